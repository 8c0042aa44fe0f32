"""Alternated repeats in `tdutils.compare`: the spread over repeats, and the notes a disturbed repeat triggers.

A stand-in clock makes the timings exact: the real engine decodes (real batching under the KV budget, real step
counts), and its decode seconds are replaced by `steps x step cost`, so a run's throughput is what its batching
buys and nothing else. Disturbing one run (a slower step, as another job on the machine would cause) then moves
exactly that repeat's ratio. One test slows a real run instead (a sleep in the model's forward pass).
"""

import time

import pytest

import tdutils
from tdutils.engines.hf import HFEngine
from tdutils.metrics import (
    ABOVE_LIMIT,
    BUSY,
    SLOWER,
    SPREAD_THRESHOLD,
    phase_table,
    plot_decode_throughput,
    speedup_caveats,
    speedup_line,
    speedup_notes,
)

STEP_S = 0.01  # the stand-in clock's seconds per decode step


class SteppedClock:
    """Wraps an engine; each decode's seconds become `steps x STEP_S x slowdown` of the run (runs counted from 0,
    warm-up runs included), whatever the wall clock says."""

    def __init__(self, engine, slowdown=None):
        self.engine = engine
        self.slowdown = slowdown or {}  # run index -> factor
        self.runs = 0

    def __getattr__(self, name):  # tokenize, prefill, modify, config, positions, metrics ...
        return getattr(self.engine, name)

    def decode(self, *args, **kwargs):
        out = self.engine.decode(*args, **kwargs)
        d = self.engine.metrics.decode
        d.seconds = d.steps * STEP_S * self.slowdown.get(self.runs, 1.0)
        self.runs += 1
        return out


@pytest.fixture
def setup(tiny, sample_ids):
    model, tok = tiny
    ids = [sample_ids[0][:64]] * 8
    eng = HFEngine(model, tokenizer=tok, progress=False, kv_budget_tokens=tdutils.default_kv_budget([64], 3, 2.25))
    fn = tdutils.make_drop_fn("random", drop_ratio=0.5, model_config=eng.facts, seed=0)
    return eng, ids, {"random@0.5": fn}


# run indices with warm-up (2 runs: baseline, random) first: repeat r's baseline is run 2 + 2r, its dropped run 3 + 2r
def _base(rep):
    return 2 + 2 * rep


def _dropped(rep):
    return 3 + 2 * rep


def test_an_undisturbed_median_equals_the_single_run_ratio(setup):
    eng, ids, fns = setup
    _, one = tdutils.compare(SteppedClock(eng), ids, fns, max_tokens=3, repeats=1)
    results, three = tdutils.compare(SteppedClock(eng), ids, fns, max_tokens=3, repeats=3)
    # 8 requests x 3 tokens in a budget of 151 tokens: the baseline decodes 2 at a time (67 tokens each; 12 steps),
    # the dropped run 4 (32 + 3 tokens each; 6 steps)
    assert (three.loc["baseline", "peak_batch"], three.loc["random@0.5", "peak_batch"]) == (2, 4)
    row = three.loc["random@0.5"]
    assert row["decode_speedup"] == one.loc["random@0.5", "decode_speedup"] == 2.0
    assert (row["decode_speedup_min"], row["decode_speedup_max"], row["repeats"]) == (2.0, 2.0, 3)
    assert row["decode_tok_s"] == pytest.approx(24 / (6 * STEP_S)) and row["decode_tok_s_min"] == row["decode_tok_s_max"]
    assert row["capacity_limit"] == 2.0
    assert len(results["random@0.5"].repeats) == 3 and results["random@0.5"].metrics is results["random@0.5"].repeats[-1]
    assert speedup_notes(three) == []
    assert speedup_line(three, "random@0.5") == ("decode throughput ratio (random@0.5 / baseline): 2.00x "
                                                 "(median of 3 repeats; min 2.00x, max 2.00x)")
    assert speedup_line(one, "random@0.5") == "decode throughput ratio (random@0.5 / baseline): 2.00x"


def test_a_disturbed_repeat_moves_the_spread_not_the_median(setup):
    eng, ids, fns = setup
    clock = SteppedClock(eng, {_base(1): 3.0})  # another job slowed the baseline of repeat 2 three times
    _, table = tdutils.compare(clock, ids, fns, max_tokens=3, repeats=3)
    row = table.loc["random@0.5"]
    assert (row["decode_speedup"], row["decode_speedup_min"], row["decode_speedup_max"]) == (2.0, 2.0, 6.0)
    assert table.loc["baseline", "decode_tok_s_min"] == pytest.approx(table.loc["baseline", "decode_tok_s"] / 3)
    kinds = [(run, kind) for run, kind, _ in speedup_caveats(table)]
    assert kinds == [("random@0.5", BUSY)], speedup_notes(table)
    (note,) = speedup_notes(table)
    assert note == ("random@0.5: machine busy: the 3 repeats gave ratios from 2.00x to 6.00x, a spread of 200% of "
                    "the median 2.00x (more than 20%): the machine was busy; rerun or raise repeats")


def test_a_small_disturbance_stays_within_the_threshold(setup):
    eng, ids, fns = setup
    factor = 1 + SPREAD_THRESHOLD / 2
    _, table = tdutils.compare(SteppedClock(eng, {_dropped(0): factor}), ids, fns, max_tokens=3, repeats=3)
    assert table.loc["random@0.5", "decode_speedup_min"] == pytest.approx(2.0 / factor)
    assert speedup_notes(table) == []


def test_one_disturbed_run_gives_a_note_that_names_what_happened(setup):
    eng, ids, fns = setup
    # the dropped run slowed 3x: the batch doubled, yet the ratio is 2/3
    _, slow = tdutils.compare(SteppedClock(eng, {_dropped(0): 3.0}), ids, fns, max_tokens=3, repeats=1)
    assert slow.loc["random@0.5", "decode_speedup"] == pytest.approx(2 / 3)
    assert [k for _, k, _ in speedup_caveats(slow)] == [SLOWER], speedup_notes(slow)
    # the baseline slowed 1.5x: 3.0x against a 2.0x limit
    _, fast = tdutils.compare(SteppedClock(eng, {_base(0): 1.5}), ids, fns, max_tokens=3, repeats=1)
    assert fast.loc["random@0.5", "decode_speedup"] == pytest.approx(3.0)
    assert [k for _, k, _ in speedup_caveats(fast)] == [ABOVE_LIMIT], speedup_notes(fast)


def test_compare_alternates_and_warms_up(setup):
    eng, ids, fns = setup
    order = []
    real = eng.decode

    def spy(*a, **kw):
        order.append((len(eng.requests), eng.metrics.modify.tokens_before > 0))
        return real(*a, **kw)

    eng.decode = spy
    lines = []
    tdutils.compare(eng, ids, fns, max_tokens=3, repeats=2, progress=lines.append)
    # warm-up on 4 requests (baseline, dropped), then baseline, dropped, baseline, dropped on all 8
    assert order == [(4, False), (4, True), (8, False), (8, True), (8, False), (8, True)]
    # the estimate after the warm-up, the one prefill every run restores, then one line per run
    assert [line.split(":")[0].split() for line in lines] == [
        ["estimate"], ["prefill"], ["repeat", "1/2", "baseline"], ["repeat", "1/2", "random@0.5"],
        ["repeat", "2/2", "baseline"], ["repeat", "2/2", "random@0.5"]]
    order.clear()
    tdutils.compare(eng, ids, fns, max_tokens=3, repeats=1, warmup=False)
    assert order == [(8, False), (8, True)]
    eng.decode = real


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_bad_repeats_are_refused(setup, repeats):
    eng, ids, fns = setup
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        tdutils.compare(eng, ids, fns, max_tokens=3, repeats=repeats)


def test_a_drop_function_named_baseline_is_refused(setup):
    eng, ids, fns = setup
    with pytest.raises(ValueError, match="a drop function is named 'baseline'"):
        tdutils.compare(eng, ids, {"baseline": fns["random@0.5"]}, max_tokens=3, repeats=1)


def test_phase_table_pairs_repeats_and_refuses_uneven_ones(setup):
    eng, ids, fns = setup
    results, _ = tdutils.compare(SteppedClock(eng, {_base(0): 2.0}), ids, fns, max_tokens=3, repeats=2)
    base, mine = results["baseline"].repeats, results["random@0.5"].repeats
    table = phase_table([base, mine])  # lists of RunMetrics, as a caller with its own loop would pass
    assert table.loc["random@0.5", "decode_speedup_max"] == pytest.approx(4.0)  # repeat 1: baseline 2x slower
    assert table.loc["random@0.5", "decode_speedup_min"] == pytest.approx(2.0)
    assert table.loc["random@0.5", "decode_speedup"] == pytest.approx(3.0)  # the median of two is their mean
    with pytest.raises(ValueError, match="run 'random@0.5' has 1 repeats and the baseline 2"):
        phase_table([base, mine[:1]])


def test_the_chart_shows_the_spread_the_limit_and_the_caveat(setup):
    import matplotlib

    matplotlib.use("Agg")
    eng, ids, fns = setup
    _, table = tdutils.compare(SteppedClock(eng, {_base(1): 3.0}), ids, fns, max_tokens=3, repeats=3)
    ax = plot_decode_throughput(table)
    from matplotlib.container import BarContainer

    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    (err,) = bars.errorbar.lines[2]
    base, mine = table.loc["baseline"], table.loc["random@0.5"]
    spans = [seg[:, 1].tolist() for seg in err.get_segments()]  # one min-max bar per run, in table order
    assert spans == [pytest.approx([base.decode_tok_s_min, base.decode_tok_s_max]),
                     pytest.approx([mine.decode_tok_s_min, mine.decode_tok_s_max])]
    assert base.decode_tok_s_min < base.decode_tok_s_max  # the disturbed baseline shows its spread
    (limit,) = [c for c in ax.collections if c.get_label().startswith("capacity limit")]
    assert limit.get_segments()[0][0, 1] == pytest.approx(base.decode_tok_s * 2.0)
    texts = [t.get_text() for t in ax.texts]
    assert "2.00x\n2.00-6.00" in texts and BUSY in texts, texts


def test_a_deliberately_slowed_real_run_triggers_the_warning(tiny, sample_ids):
    """Real clock: a forward hook sleeps 0.2 s per step during the baseline of the second repeat only (2 requests
    decode at a time in the baseline, 4 after dropping half)."""
    model, tok = tiny
    ids = [sample_ids[0][:100]] * 4
    eng = HFEngine(model, tokenizer=tok, progress=False, kv_budget_tokens=tdutils.default_kv_budget([100], 3, 2.25))
    fn = tdutils.make_drop_fn("random", drop_ratio=0.5, model_config=eng.facts, seed=0)
    runs = {"n": 0}
    real = eng.decode

    def counting(*a, **kw):
        try:
            return real(*a, **kw)
        finally:
            runs["n"] += 1

    def slow(*_):
        if runs["n"] == _base(1):
            time.sleep(0.2)

    eng.decode = counting
    handle = model.register_forward_pre_hook(slow)
    try:
        results, table = tdutils.compare(eng, ids, {"random@0.5": fn}, max_tokens=3, repeats=3)
    finally:
        handle.remove()
    from tdutils.metrics import repeat_ratios

    ratios = repeat_ratios(results["baseline"], results["random@0.5"])
    assert max(ratios) == ratios[1], ratios  # the slowed baseline's repeat has by far the largest ratio
    assert any(n.startswith("random@0.5: machine busy:") for n in speedup_notes(table)), (ratios, speedup_notes(table))
