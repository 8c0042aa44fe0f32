"""Scores reused across drop ratios (`tdutils.policies.reuse`): the same kept sets as computing anew, fewer scorings."""

import pytest
import torch

from tdutils import make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.eval.runner import build_cells, run_cells
from tdutils.policies.reuse import shared_scores

pytestmark = pytest.mark.usefixtures("one_thread")

RATIOS = (0.25, 0.5, 0.75, 0.9)
# the policies whose score functions are decorated, and one that is not (knorm: its score is one norm)
POLICIES = [("snapkv", "request"), ("snapkv", "head"), ("rkv", "request"), ("rkv", "layer"), ("h2o", "request"),
            ("h2o", "head"), ("expected_attention", "request"), ("expected_attention", "head"),
            ("adakv_snapkv", "head"), ("pyramidkv", "head"), ("knorm", "request")]


def _fns(eng, name, granularity):
    return [make_drop_fn(name, drop_ratio=r, model_config=eng.facts, granularity=granularity) for r in RATIOS]


@pytest.mark.parametrize(("name", "granularity"), POLICIES)
def test_reused_scores_keep_the_same_sets_as_scoring_anew_at_every_ratio(request0, name, granularity):
    eng, tensors, tokens = request0
    fns = _fns(eng, name, granularity)
    anew = [fn.keep_indices(tensors, tokens) for fn in fns]
    with shared_scores() as stats:
        reused = [fn.keep_indices(tensors, tokens) for fn in fns]
        again = [fn.keep_indices(tensors, tokens) for fn in fns]  # a hit hands out a copy, never the stored result
    for a, b, c in zip(anew, reused, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    if name == "knorm":
        assert stats["calls"] == 0
    else:  # the scorings of the first ratio; every later call is answered from memory
        per_keep = stats["calls"] // (2 * len(RATIOS))
        assert per_keep >= 1 and stats["calls"] == per_keep * 2 * len(RATIOS)
        assert stats["calls"] - stats["hits"] == per_keep


def test_nothing_is_remembered_outside_the_block_or_for_another_cache(tiny, sample_ids):
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=None)
    eng.prefill([sample_ids[0], sample_ids[1]])
    fn = make_drop_fn("h2o", drop_ratio=0.5, model_config=eng.facts)
    with shared_scores() as stats:
        first = fn.keep_indices(eng.tensors(0), eng.tokens(0))
        second = fn.keep_indices(eng.tensors(1), eng.tokens(1))  # another request: another cache, scored anew
        assert stats == {"calls": 2, "hits": 0}
        assert not torch.equal(first[:10], second[:10]) or len(first) != len(second)
    with shared_scores() as stats:  # a new block starts empty
        fn.keep_indices(eng.tensors(0), eng.tokens(0))
        assert stats == {"calls": 1, "hits": 0}
    with shared_scores() as stats:  # an edited tensor (its version counter moved) is scored anew
        t = {k: v.clone() for k, v in eng.tensors(0).items()}
        fn.keep_indices(t, eng.tokens(0))
        next(iter(t.values())).mul_(2.0)
        fn.keep_indices(t, eng.tokens(0))
        assert stats == {"calls": 2, "hits": 0}


def test_run_cells_answers_are_the_same_with_scores_shared_across_ratios(tiny, sample_ids, monkeypatch):
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False)
    cells = build_cells(eng, ["snapkv", "h2o", "full"], [0.5, 0.75], {})
    shared = run_cells(eng, sample_ids, cells, max_tokens=6, batch_size=3)

    import tdutils.eval.runner as runner

    monkeypatch.setattr(runner, "shared_scores", _no_sharing)
    eng2 = HFEngine(model, tokenizer=tok, progress=False)
    cells2 = build_cells(eng2, ["snapkv", "h2o", "full"], [0.5, 0.75], {})
    anew = run_cells(eng2, sample_ids, cells2, max_tokens=6, batch_size=3)
    assert shared[0] == anew[0] and shared[2] == anew[2]  # answers and kept tokens per cell


class _no_sharing:
    def __enter__(self):
        return {}

    def __exit__(self, *exc):
        return False


def test_h2o_scores_a_cache_that_extends_a_scored_one_from_its_new_rows_only(tiny, sample_ids, monkeypatch):
    """Inside `shared_scores()`, H2O's scores of prefill(context) + extend(question) (eval's query-aware prompt)
    reuse the sums of prefill(context) scored before and compute only the question's query rows; the scores equal
    scoring the prompt anew (fp32, up to summation order) and so does the kept set, at the request and head level."""
    import tdutils.policies.h2o as h2o

    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=None)
    eng.prefill([sample_ids[0][:150]])
    ctx, ctx_tokens = eng.tensors(0), eng.tokens(0)
    eng.extend([sample_ids[0][150:180]])
    prompt, tokens = eng.tensors(0), eng.tokens(0)
    starts = []
    accumulated = h2o._accumulated
    monkeypatch.setattr(h2o, "_accumulated", lambda *a: starts.append(a[4]) or accumulated(*a))
    L, d = eng.facts.num_layers, eng.facts.head_dim
    anew = h2o.h2o_scores(prompt["kv"], prompt["query"], head_dim=d)
    with shared_scores():
        h2o.h2o_scores(ctx["kv"], ctx["query"], head_dim=d)
        reused = h2o.h2o_scores(prompt["kv"], prompt["query"], head_dim=d)
    assert starts == [0] * L + [0] * L + [150] * L  # anew; the context; the prompt from the question's rows
    assert torch.allclose(reused, anew, rtol=1e-5, atol=1e-6)
    fns = [make_drop_fn("h2o", drop_ratio=0.5, model_config=eng.facts, granularity=g) for g in ("request", "head")]
    kept_anew = [fn.keep_indices(prompt, tokens) for fn in fns]
    with shared_scores():
        for fn in fns:
            fn.keep_indices(ctx, ctx_tokens)
        kept = [fn.keep_indices(prompt, tokens) for fn in fns]
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_anew))
    starts.clear()
    with shared_scores():  # a context that is no prefix of this prompt: both scored anew
        eng.prefill([sample_ids[1][:60]])
        h2o.h2o_scores(eng.tensors(0)["kv"], eng.tensors(0)["query"], head_dim=d)
        h2o.h2o_scores(prompt["kv"], prompt["query"], head_dim=d)
    assert starts == [0] * (2 * L)
