"""`HFEngine.teacher_forced_logits` (one forward per batch) against `decode(forced_ids=..., keep_logits=True)` (one
step per token): the same logits on the full cache and after request-, layer- and head-granularity edits and
unequal per-head budgets, at both position conventions; and `run_forced_cells` scores alike on both paths."""

import pytest
import torch

from tdutils.edit import make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.eval.runner import run_forced_cells

pytestmark = pytest.mark.usefixtures("one_thread")

M = 12  # continuation tokens


def _continuations(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 200, (n, M), generator=g).tolist()


def _both_paths(eng, prompts, fn, positions):
    """`(fast, stepped)`: each request's `[M, vocab]` logits by `teacher_forced_logits` and by forced decode."""
    forced = _continuations(len(prompts))
    eng.prefill(prompts)
    if fn is not None:
        eng.modify(fn, positions=positions)
    fast = eng.teacher_forced_logits(forced)
    stepped = [torch.stack(o.logits) for o in eng.decode(max_tokens=M, keep_logits=True, forced_ids=forced)]
    return fast, stepped


CELLS = [(None, "request"), ("snapkv", "request"), ("snapkv", "layer"), ("knorm", "head"), ("adakv_snapkv", "request"),
         ("pyramidkv", "request")]


@pytest.mark.parametrize("positions", ["compact", "original"])
@pytest.mark.parametrize("policy,granularity", CELLS)
def test_one_forward_gives_the_forced_decodes_logits(tiny, sample_ids, policy, granularity, positions):
    """Three ragged prompts, two per prefill batch (padding on both sides of the fed tokens), fp32: <= 1e-4."""
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=None, prefill_batch_size=2)
    fn = None if policy is None else make_drop_fn(policy, drop_ratio=0.6, model_config=eng.facts, window=8,
                                                  granularity=granularity, rerotate=positions == "compact")
    fast, stepped = _both_paths(eng, sample_ids, fn, positions)
    if policy == "adakv_snapkv":  # unequal per-head counts: the padded rows must be hidden
        assert any(r.pad is not None for r in eng.requests)
    for a, b in zip(fast, stepped):
        assert a.shape == b.shape == (M, model.config.vocab_size)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_sliding_window_layers_mask_by_position_as_decode_does(tiny):
    """A Gemma 3 family model (16-token windows, prompts of 40-57 tokens) after a request-level edit, both positions."""
    from families import family_model

    model = family_model("gemma3")
    prompts = [torch.randint(4, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 57)]
    for positions in ("compact", "original"):
        eng = HFEngine(model, tokenizer=tiny[1], progress=False, prefill_batch_size=2)
        fn = make_drop_fn("knorm", drop_ratio=0.5, model_config=eng.facts, rerotate=positions == "compact")
        fast, stepped = _both_paths(eng, prompts, fn, positions)
        for a, b in zip(fast, stepped):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_the_cache_is_left_as_it_was_and_bad_continuations_are_refused(tiny, sample_ids):
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False)
    with pytest.raises(RuntimeError, match="prefill"):
        eng.teacher_forced_logits([[5]])
    eng.prefill(sample_ids[:2])
    eng.modify(make_drop_fn("knorm", drop_ratio=0.5, model_config=eng.facts, granularity="head"))
    before = [(eng.kv(i).clone(), eng.tokens(i), eng.requests[i].refeed_pos) for i in range(2)]
    eng.teacher_forced_logits(_continuations(2))
    for i, (kv, tokens, pos) in enumerate(before):
        assert torch.equal(eng.kv(i), kv) and eng.tokens(i) == tokens and eng.requests[i].refeed_pos == pos
    with pytest.raises(ValueError, match="one token-id list per request"):
        eng.teacher_forced_logits(_continuations(3))
    with pytest.raises(ValueError, match="lies outside the vocabulary"):
        eng.teacher_forced_logits([[5, 10**6], [5, 6]])


def test_run_forced_cells_scores_alike_on_both_paths(tiny, sample_ids, monkeypatch):
    """The eval loop with the one-forward path and with the forced decode (an engine without the method)."""
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=None, prefill_batch_size=2)
    cells = [("full", 0.0, None)] + [(p, 0.5, make_drop_fn(p.partition("/")[0], drop_ratio=0.5, model_config=eng.facts,
                                                           window=8, granularity=p.partition("/")[2] or "request"))
                                     for p in ("snapkv", "snapkv/head", "adakv_snapkv")]
    forced = _continuations(3, seed=1)
    fast = run_forced_cells(eng, sample_ids, forced, cells, batch_size=3)
    monkeypatch.setattr(eng, "teacher_forced_logits", None)
    stepped = run_forced_cells(eng, sample_ids, forced, cells, batch_size=3)
    for key in fast:
        for measure in ("kl", "ppl", "agreement"):
            torch.testing.assert_close(torch.tensor(fast[key][measure]), torch.tensor(stepped[key][measure]),
                                       atol=1e-4, rtol=1e-5)
    assert fast["full", 0.0]["kl"] == [0.0] * 3 and max(fast["snapkv/head", 0.5]["kl"]) > 0
