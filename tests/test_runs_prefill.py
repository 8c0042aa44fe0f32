"""`tdutils.compare` prefills once and restores the caches for every run (`prefill="once"`, the hf engine's default):
the outputs equal those of a prefill per run, and the estimate printed before the runs is computed as documented."""

import pytest

import tdutils
from tdutils.engines.hf import HFEngine
from tdutils.metrics import DecodeMetrics, ModifyMetrics, PrefillMetrics, RunMetrics
from tdutils.outputs import RequestOutput
from tdutils.runs import (
    PREFILL_ONCE_NOTE,
    RunResult,
    _decode_work,
    _fit_step,
    estimate_runs,
    prefill_once,
    timing_line,
)


@pytest.fixture
def setup(tiny, sample_ids):
    model, tok = tiny
    ids = [sample_ids[i % 3][:64 - 4 * i] for i in range(6)]  # unequal lengths: a ragged batch
    eng = HFEngine(model, tokenizer=tok, progress=False, kv_budget_tokens=tdutils.default_kv_budget([64], 3, 2.25))
    # SnapKV reads the prompt's last queries: the one prefill must capture them for the dropped runs
    fn = tdutils.make_drop_fn("snapkv", drop_ratio=0.5, model_config=eng.facts, window=8)
    return eng, ids, {"snapkv@0.5": fn}


def _counting_prefills(eng):
    calls = []
    real = eng.prefill

    def prefill(prompts, **kw):
        calls.append(len(prompts))
        return real(prompts, **kw)

    eng.prefill = prefill
    return calls


def test_the_runs_restore_one_prefill_instead_of_prefilling_again(setup):
    eng, ids, fns = setup
    calls = _counting_prefills(eng)
    _, table = tdutils.compare(eng, ids, fns, max_tokens=3, repeats=2)
    assert calls == [4, 6]  # the warm-up's 4 prompts, then all 6 once for 2 repeats x 2 configurations
    assert table.attrs["timing"]["prefill"] == "once"
    calls.clear()
    _, table = tdutils.compare(eng, ids, fns, max_tokens=3, repeats=2, prefill="each")
    assert calls == [4, 4, 6, 6, 6, 6] and table.attrs["timing"]["prefill"] == "each"


def test_restored_runs_equal_runs_that_prefill_again(setup):
    eng, ids, fns = setup
    once, t_once = tdutils.compare(eng, ids, fns, max_tokens=5, repeats=2, prefill="once")
    each, t_each = tdutils.compare(eng, ids, fns, max_tokens=5, repeats=2, prefill="each")
    for name in ("baseline", "snapkv@0.5"):
        assert [o.output_ids for o in once[name].outputs] == [o.output_ids for o in each[name].outputs], name
        assert [o.cached_tokens for o in once[name].outputs] == [o.cached_tokens for o in each[name].outputs]
    for col in ("prompt_tokens", "kv_tokens_after", "decode_tokens", "peak_batch"):
        assert list(t_once[col]) == list(t_each[col]), col
    assert t_once.loc["snapkv@0.5", "kv_tokens_after"] < t_once.loc["baseline", "kv_tokens_after"]


def test_every_restored_run_keeps_its_own_phases(setup):
    eng, ids, fns = setup
    results, _ = tdutils.compare(eng, ids, fns, max_tokens=3, repeats=2)
    runs = [*results["baseline"].repeats, *results["snapkv@0.5"].repeats]
    assert len({id(m) for m in runs}) == 4 and len({id(m.decode) for m in runs}) == 4
    assert len({id(m.prefill) for m in runs}) == 1 and runs[0].prefill.tokens == sum(map(len, ids))
    assert [m.name for m in runs] == ["baseline", "baseline", "snapkv@0.5", "snapkv@0.5"]
    # the baseline modifies nothing; the dropped runs' modify is their own, every decode its own 6 x 3 tokens
    assert [m.modify.tokens_before for m in runs[:2]] == [0, 0]
    assert all(m.modify.tokens_before == sum(map(len, ids)) for m in runs[2:])
    assert all(m.decode.output_tokens == 18 for m in runs)


def test_prefill_mode_is_checked(setup):
    eng, ids, fns = setup
    with pytest.raises(ValueError, match="prefill must be one of"):
        tdutils.compare(eng, ids, fns, max_tokens=3, repeats=1, prefill="twice")

    class Remote:  # an engine whose caches live elsewhere says nothing about restoring them
        pass

    assert prefill_once(eng) is True and prefill_once(Remote()) is False and prefill_once(eng, "each") is False
    with pytest.raises(ValueError, match="Remote does not: use prefill='each'"):
        prefill_once(Remote(), "once")


def test_decode_work_follows_first_come_first_served_admission():
    # caches of 10 tokens, 3 decode tokens each (need 13); a budget of 26 runs 2 at a time: 3 steps, then 3 more
    steps, attended = _decode_work([10, 10, 10], [3, 3, 3], 26, None)
    assert steps == 6 and attended == 3 * (3 * 10 + 0 + 1 + 2)
    assert _decode_work([10, 10, 10], [3, 3, 3], None, None)[0] == 3  # no budget: one batch
    assert _decode_work([10, 10, 10], [3, 3, 3], None, 1)[0] == 9  # batch cap 1: one after the other
    assert _decode_work([10, 2], [3, 5], 15, None)[0] == 8  # 13 + 7 > 15: the second waits 3 steps, then takes 5


def test_the_step_fit_is_exact_on_exact_points_and_refuses_unphysical_ones():
    w, a = _fit_step([(100, 1.1), (200, 1.2), (300, 1.3)])
    assert w == pytest.approx(1.0) and a == pytest.approx(0.001)
    assert _fit_step([(100, 1.2), (200, 1.1)]) == (pytest.approx(1.15), None)  # slower with fewer tokens: load
    assert _fit_step([(100, 1.0)]) == (1.0, None)
    assert _fit_step([(100, 1.0), (101, 1.2)]) == (pytest.approx(1.1), None)  # equal K cannot tell a


def _warm(name, prompt, cached, tpot, prefill_s, modify_s, batch=2):
    outs = [RequestOutput(i, prompt, cached, output_ids=[0, 0, 0], tpot_s=tpot) for i in range(batch)]
    m = RunMetrics(name, prefill=PrefillMetrics(requests=batch, tokens=batch * prompt, seconds=prefill_s),
                   modify=ModifyMetrics(seconds=modify_s), decode=DecodeMetrics(peak_batch_size=batch))
    return RunResult(name, outs, m)


def test_the_estimate_scales_the_warm_up_as_documented():
    # warm-up: 2 prompts of 100 tokens; baseline steps attend 2 x (100 + 1.5) = 203 tokens in 0.3 s, the dropped
    # run's (kept 50) 2 x 51.5 = 103 in 0.2 s: a step costs w + a K with a = 0.001 s per token, w = 0.097 s
    warm = {"baseline": _warm("baseline", 100, 100, 0.3, 2.0, 0.0), "d": _warm("d", 100, 50, 0.2, 2.0, 0.5)}
    ids = [[0] * 100] * 4
    est = estimate_runs(warm, ids, max_tokens=4, repeats=3, prefills=1, budget=216, max_batch_size=None)
    assert est["prefill_s"] == pytest.approx(2.0 * 400 / 200)  # scaled by prompt tokens, once
    assert est["modify_s"] == pytest.approx(3 * 0.5 * 4 / 2)  # per request, every repeat
    w, a = 0.097, 0.001
    # a budget of 216: the baseline 2 at a time (need 104 each): 8 steps attending 4 x (4 x 100 + 6) tokens; dropped: 4 at once, 4 steps
    base = 8 * w + a * 4 * (400 + 6)
    dropped = 4 * w + a * 4 * (200 + 6)
    assert est["decode_s"] == pytest.approx(3 * (base + dropped))
    assert est["seconds"] == pytest.approx(est["prefill_s"] + est["modify_s"] + est["decode_s"])
    assert "weights + attended KV tokens" in est["basis"]
    each = estimate_runs(warm, ids, max_tokens=4, repeats=3, prefills=6, budget=216, max_batch_size=None)
    assert each["prefill_s"] == pytest.approx(6 * est["prefill_s"])


def test_compare_records_the_estimate_and_what_the_runs_took(setup):
    eng, ids, fns = setup
    lines = []
    results, table = tdutils.compare(eng, ids, fns, max_tokens=3, repeats=2, progress=lines.append)
    timing = table.attrs["timing"]
    assert lines[0].startswith(("estimate: the runs will take about", "estimate: the runs will take under 1 s")) \
        and "about under" not in lines[0] and timing["estimate_s"] > 0
    runs = [*results["baseline"].repeats, *results["snapkv@0.5"].repeats]
    assert timing["split"]["decode_s"] == pytest.approx(sum(m.decode.seconds for m in runs))
    assert timing["split"]["prefill_s"] == runs[0].prefill.seconds  # counted once
    assert timing["elapsed_s"] >= sum(timing["split"].values())
    assert timing_line(timing).startswith("the runs took ") and "; estimated " in timing_line(timing)
    _, quiet = tdutils.compare(eng, ids, fns, max_tokens=3, repeats=1, warmup=False)
    assert quiet.attrs["timing"]["estimate_s"] is None and "estimated" not in timing_line(quiet.attrs["timing"])
    assert "one prefill" in PREFILL_ONCE_NOTE
