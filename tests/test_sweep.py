import pytest

from tdutils import sweep
from tdutils.engines.hf import HFEngine
from tdutils.sweep import SweepConfig, throughput_sweep


def _engine(tiny, budget):
    model, tok = tiny
    return HFEngine(model, tokenizer=tok, progress=False, kv_budget_tokens=budget)


def test_sweep_alternates_configs_and_reports_capacity(tiny, sample_ids):
    ids = [sample_ids[0][:100]] * 4
    eng = _engine(tiny, 2 * (100 + 4))
    table, runs = throughput_sweep(eng, ids, [SweepConfig("random", 0.5)], max_tokens=4, repeats=2, progress=None)
    assert [r["run"] for r in runs] == ["baseline", "random@0.5"] * 2  # A B A B
    assert table.loc["baseline", "peak_batch"] == 2
    assert table.loc["random@0.5", "peak_batch"] == 3  # 3 x (50 + 4) <= 208 < 4 x 54
    assert table.loc["random@0.5", "capacity_limit"] == 2.0
    assert table.loc["random@0.5", "kept_fraction"] == 0.5
    assert table.loc["baseline", "decode_speedup"] == 1.0
    row = table.loc["random@0.5"]
    assert row["of_limit"] == pytest.approx(row["decode_speedup"] / 2)
    assert list(table.policy) == ["baseline", "random"]
    base = [r for r in runs if r["run"] == "baseline"]
    mine = [r for r in runs if r["run"] == "random@0.5"]
    per_repeat = [m["modify_s"] / b["decode_s"] for m, b in zip(mine, base)]
    assert row["modify_of_base_decode"] == pytest.approx(sum(per_repeat) / 2)  # the median of two is their mean

    import matplotlib

    matplotlib.use("Agg")
    assert table.loc["random@0.5", "repeats"] == 2
    ratios = [m["decode_tok_s"] / b["decode_tok_s"] for m, b in zip(mine, base)]
    assert (row["decode_speedup_min"], row["decode_speedup_max"]) == (min(ratios), max(ratios))
    ax = sweep.plot_speedup(table)
    _, labels = ax.get_legend_handles_labels()
    assert set(labels) >= {"random", "capacity limit 1/(1-r)"}, labels
    (points,) = ax.containers  # one errorbar per policy: the median point and its min-max bar
    assert points.get_label() == "random"
    assert list(points.lines[0].get_ydata()) == [row["decode_speedup"]]
    (bar,) = points.lines[2]
    assert bar.get_segments()[0][:, 1].tolist() == pytest.approx([min(ratios), max(ratios)])


def test_sweep_fails_when_a_run_loses_tokens(tiny, sample_ids, monkeypatch):
    from tdutils import runs

    real = runs._modify_decode  # what every run ends with, restored (prefill once) or prefilled again

    def lossy(*a, **kw):
        res = real(*a, **kw)
        res.metrics.decode.output_tokens -= 1
        return res

    monkeypatch.setattr(runs, "_modify_decode", lossy)
    eng = _engine(tiny, None)
    with pytest.raises(RuntimeError, match="decoded 7 tokens, expected 8"):
        throughput_sweep(eng, [sample_ids[1]] * 2, [], max_tokens=4, repeats=1, progress=None)


def test_default_budget_in_undropped_requests():
    from tdutils import default_kv_budget

    assert default_kv_budget([1024, 900], 64, 4) == 4352  # 4 x (1024 + 64)
    assert default_kv_budget([1024], 64) == 4624  # ceil(4.25 x 1088)
    with pytest.raises(ValueError, match="full_requests must be >= 1"):
        default_kv_budget([1024], 64, 0.5)


def test_a_quarter_request_of_slack_lets_half_dropped_requests_reach_twice_the_batch(tiny, sample_ids):
    from tdutils import default_kv_budget

    ids = [sample_ids[0][:100]] * 8
    for full, peak in ((4, 7), (4.25, 8)):  # 4 x 104 = 416: 7 x 54 = 378 fit, 8 x 54 = 432 do not; 442 holds 8
        eng = _engine(tiny, default_kv_budget(map(len, ids), 4, full))
        table, _ = throughput_sweep(eng, ids, [SweepConfig("random", 0.5)], max_tokens=4, repeats=1, progress=None)
        assert (table.loc["baseline", "peak_batch"], table.loc["random@0.5", "peak_batch"]) == (4, peak)
