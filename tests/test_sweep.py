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


def test_sweep_fails_when_a_run_loses_tokens(tiny, sample_ids, monkeypatch):
    real = sweep.run_once

    def lossy(*a, **kw):
        res = real(*a, **kw)
        res.metrics.decode.output_tokens -= 1
        return res

    monkeypatch.setattr(sweep, "run_once", lossy)
    eng = _engine(tiny, None)
    with pytest.raises(RuntimeError, match="decoded 7 tokens, expected 8"):
        throughput_sweep(eng, [sample_ids[1]] * 2, [], max_tokens=4, repeats=1, progress=None)
