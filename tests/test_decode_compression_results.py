"""bench/decode_compression.py (issue 33, item 5): its pure functions, and the stored runs behind
docs/decode_compression.md (the page's generated tables are what its renderer, `tools/bench_tables.py`, makes of
docs/results/decode_compression_*.json; the runs measure what the page says they do)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "decode_compression.md"


def _load(path: Path, name: str):
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load(ROOT / "bench" / "decode_compression.py", "bench_decode_compression")


@pytest.fixture(scope="module")
def tables():
    return _load(ROOT / "tools" / "bench_tables.py", "bench_tables")


def _stored(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------ pure functions
def test_kl_is_zero_for_equal_logits_and_matches_the_definition():
    from tdutils.compression import kl_per_step

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 11, generator=g)
    assert torch.equal(kl_per_step(ref, ref.clone()), torch.zeros(5, dtype=torch.float64))
    other = ref + torch.randn(5, 11, generator=g)
    p, q = torch.softmax(ref.double(), -1), torch.softmax(other.double(), -1)
    expected = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(kl_per_step(ref, other), expected)
    assert (kl_per_step(other, ref) >= 0).all()
    # two tokens: P = (1/2, 1/2), Q = (e/(1+e), 1/(1+e)) -> KL = log 2 - 1/2 log(...) by hand
    kl = float(kl_per_step(torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0]]))[0])
    q1 = math.e / (1 + math.e)
    assert kl == pytest.approx(0.5 * math.log(0.5 / q1) + 0.5 * math.log(0.5 / (1 - q1)), rel=1e-12)


def test_top1_rate_and_forced_agreement_read_the_argmax(bench):
    from tdutils.compression import greedy_agreement

    logits = torch.full((4, 6), -5.0)
    for step, tok in enumerate([3, 1, 0, 2]):
        logits[step, tok] = 5.0
    reference = [3, 1, 4, 2]  # differs at step 2 only
    assert bench.top1_rate(reference, logits) == 0.75
    assert bench.top1_rate(reference, list(logits)) == 0.75  # one [vocab] tensor per step, as decode keeps them
    assert greedy_agreement(reference, logits.argmax(-1).tolist()) == 2
    with pytest.raises(ValueError):
        bench.top1_rate([], torch.zeros(0, 6))


def test_fidelity_p90_is_the_nearest_rank_of_every_step():
    from tdutils.compression import fidelity, kl_per_step
    from tdutils.outputs import RequestOutput

    g = torch.Generator().manual_seed(0)
    ref = [RequestOutput(i, 5, 5, output_ids=[1, 2, 3, 4], logits=list(torch.randn(4, 7, generator=g)))
           for i in range(3)]
    out = [RequestOutput(i, 5, 5, output_ids=[1, 2, 3, 4], logits=list(torch.randn(4, 7, generator=g)))
           for i in range(3)]
    every = sorted(float(x) for a, b in zip(ref, out) for x in kl_per_step(a.logits, b.logits))
    assert len(every) == 12 and fidelity(ref, out)["kl_p90"] == every[10]  # rank ceil(0.9 * 12) = 11


def test_summary_stats_and_percentile(bench):
    s = bench.summary_stats([3, 1, 2, 10])
    assert s == {"mean": 4.0, "median": 2.5, "min": 1.0, "max": 10.0}


def test_runs_alternate():
    from tdutils.runs import run_orders

    assert run_orders(["full", "B=64", "B=128"], 3, "alternate") == [
        ["full", "B=64", "B=128"], ["B=128", "B=64", "full"], ["full", "B=64", "B=128"]]


def test_bench_refuses_bad_options_before_loading_a_model(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["fidelity", "--policies", "nosuch"])
    assert exc.value.code == 2 and "unknown policy 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["throughput", "--budgets", "0,64"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        bench.main([])
    assert exc.value.code == 2 and "choose a part" in capsys.readouterr().err


def test_loop_start_finds_where_a_generation_only_repeats(tables):
    assert tables.loop_start([1, 2, 3, 4, 5]) is None
    assert tables.loop_start([9, 1, 2, 1, 2, 1, 2]) == 1
    assert tables.loop_start([7, 7, 7, 7]) == 0
    assert tables.loop_start([5, 6, 1, 2, 3, 1, 2, 3, 1, 2, 3]) == 2
    assert tables.loop_start([1, 2, 3, 1, 2], min_repeats=2) is None  # less than two whole periods


# ------------------------------------------------------------------------------------------ the stored runs
def _render():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_page_shows_what_the_stored_runs_give(tables):
    """docs/decode_compression.md is what the bench's renderer makes of every decode_compression run, each run
    is shown, and `--summary` prints the same tables."""
    render = _render()
    text = PAGE.read_text(encoding="utf-8")
    assert text == render.render(text), "run `python tools/render_results.py` (docs/decode_compression.md is stale)"
    shown = set(render.blocks_in(text))
    assert shown == set(render.DECODE_COMPRESSION_BLOCKS) | {"chunked_prefill"}
    used = {name for stored in render.DECODE_COMPRESSION_BLOCKS.values() for name in stored}
    assert used == {p.stem for p in RESULTS.glob("decode_compression_*.json")}, "a stored run the page does not show"
    for name, stored in render.DECODE_COMPRESSION_BLOCKS.items():
        reports = [_stored(s) for s in stored]
        table = tables.decode_compression(reports[0] if len(reports) == 1 else reports)
        assert table in text, name


def test_summary_prints_the_stored_table(bench, tables, capsys):
    assert bench.main(["--summary", str(RESULTS / "decode_compression_throughput.json")]) == 0
    assert capsys.readouterr().out.strip() == tables.decode_compression(_stored("decode_compression_throughput")).strip()


def test_throughput_run_alternated_and_its_ratios_are_per_repeat():
    from tdutils.runs import run_orders

    run = _stored("decode_compression_throughput")
    m = run["meta"]
    configs = ["full"] + [f"B={b}" for b in m["budgets"]]
    assert m["orders"] == run_orders(configs, m["repeats"], "alternate") and m["repeats"] >= 2
    assert [r["config"] for r in run["runs"]] == [c for order in m["orders"] for c in order]
    tok_s = {(r["config"], r["repeat"]): r["decode_tok_s"] for r in run["runs"]}
    per_token = m["prompt_tokens"] + m["max_tokens"]
    for row in run["rows"]:  # each repeat against the full cache's in the same repeat, not pooled
        assert row["ratios"] == pytest.approx([tok_s[row["config"], k] / tok_s["full", k] for k in range(m["repeats"])])
        assert row["kv_peak_reserved_tokens"] <= m["kv_budget_tokens"]
        if row["config"] == "full":
            assert row["peak_batch"] == m["kv_budget_tokens"] // per_token == 4
        else:  # a request never holds more than B + N (or its prompt, when longer) and reserves one more
            bound = max(row["budget"] + m["buffer"], m["prompt_tokens"])
            assert row["kv_peak_cache_tokens"] <= bound
            assert row["peak_batch"] == min(m["num_requests"], m["kv_budget_tokens"] // (bound + 1)) > 4
            assert row["compressions"] > 0
    assert all(r["steps"] > 0 for r in run["runs"])


@pytest.mark.parametrize("stored", ["decode_compression_fidelity", "decode_compression_fidelity_gemma3"])
def test_fidelity_run_covers_a_thousand_tokens_per_row(stored):
    run = _stored(stored)
    m = run["meta"]
    assert {(r["policy"], r["budget"]) for r in run["rows"]} == {(p, b) for p in m["policies"] for b in m["budgets"]}
    for r in run["rows"]:
        assert r["tokens"] == m["num_requests"] * m["max_tokens"] >= 1000
        assert all(0 <= a <= m["max_tokens"] for a in r["agreements"])
        assert 0 <= r["kl_mean"] <= r["kl_max"] and 0 <= r["top1_rate"] <= 1
    assert all(c["free"] == c["forced"] for c in run["free_checks"])  # the free greedy runs, where checked
    assert [len(x) for x in run["full_cache_ids"]] == [m["max_tokens"]] * m["num_requests"]
    if stored == "decode_compression_fidelity":  # SmolLM2: every policy, rkv's free runs checked at every budget
        assert len(run["free_checks"]) == len(m["budgets"]) * m["num_requests"]


def test_kvpress_run_compares_the_same_setting_on_both_sides():
    run = _stored("decode_compression_kvpress")
    m = run["meta"]
    assert m["prompt_tokens"] == m["budget"] and m["peer"]["kvpress"] == "0.5.5"  # both first cut at B + N
    assert run["cross_agreements"] == [m["max_tokens"]] * m["num_requests"]  # the two full caches agree
    assert [r["press"] for r in run["rows"]] == ["SnapKVPress", "TOVAPress", "KnormPress", "StreamingLLMPress"]
    for r in run["rows"]:
        assert "error" not in r, r
        assert r["kv_max_cache"] == m["budget"] + m["buffer"] - 1  # kvpress held the cache to B + N too
        for side in ("kvpress", "compact", "original"):
            assert len(r[f"{side}_agreements"]) == m["num_requests"]
            assert all(0 <= a <= m["max_tokens"] for a in r[f"{side}_agreements"])


def test_ruler_runs_hold_the_budget_and_bound_the_chunked_peak():
    for policy in ("snapkv", "knorm"):
        run = _stored(f"decode_compression_ruler_{policy}")
        m = run["meta"]
        assert m["n"] >= 20 and m["seed"] == 5_000_000 and m["policies"] == [policy]
        rows = {r["mode"]: r for r in run["rows"]}
        assert set(rows) == {"full", "one-shot", *(f"chunk {c}" for c in m["chunks"])}
        assert rows["full"]["cache_tokens"] == rows["full"]["peak_cache_tokens"] == m["context_length"]
        assert rows["full"]["correct"] == m["n"]  # the full cache solves the task: a fair reference
        for mode, r in rows.items():
            if mode == "full":
                continue
            assert r["cache_tokens"] == m["budget"]  # the same final cache, one-shot or chunked
            assert r["peak_cache_tokens"] <= m["budget"] + (r["chunk"] or m["context_length"])
            assert r["ci"][0] <= r["accuracy"] <= r["ci"][1]
        assert [sum(a["exact"]) for a in run["answers"]] == [r["correct"] for r in run["rows"]]


def test_chunked_prefill_run_stays_within_budget_plus_chunk():
    """The stored Gemma run: every chunked row held at most B + C tokens and decoded from B; one shot held the
    prompt; the chunked prefill's memory does not grow with the prompt the way one shot's does."""
    rows = _stored("chunked_prefill_gemma3")["rows"]
    chunked = [r for r in rows if r["mode"] == "chunked"]
    assert chunked and all(r["peak_cache_tokens"] <= r["budget"] + r["chunk"] and r["final_cache_tokens"] == r["budget"]
                           for r in chunked)
    assert all(r["peak_cache_tokens"] == r["prompt_tokens"] for r in rows if r["mode"] == "one-shot")
    assert max(r["prompt_tokens"] for r in chunked) >= 32000
    one = {r["prompt_tokens"]: r["peak_rss_above_load_mib"] for r in rows if r["mode"] == "one-shot"}
    assert max(r["peak_rss_above_load_mib"] for r in chunked) < max(one.values())
