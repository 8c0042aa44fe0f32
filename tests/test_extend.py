"""`HFEngine.extend`: the query-agnostic flow prefill(context) -> modify -> extend(question) -> decode.

References are the model's own computation: prefill of the whole prompt (unedited or keep-everything caches),
and the model's forward with explicit `position_ids` over a cache built from the kept rows (after a real
drop), or over its full cache with the dropped positions masked out (`positions="original"`).
"""

import functools

import pytest
import torch

from tdutils import CacheKind, DropFunctionError, make_drop_fn
from tdutils.engines.hf import HFEngine

from families import family_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread (tiny models, shared cores)

FAMILIES = ("llama", "mistral_sliding", "gemma2")  # plain, sliding window, hybrid + soft-capping
LENS = (40, 25, 33)  # context lengths (longer than the families' 16-token sliding window)
EXT = (6, 1, 9)  # extension lengths: ragged, one of a single token


@functools.lru_cache(maxsize=None)
def _family(name):
    return family_model(name)


def _parts(seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = [torch.randint(4, 200, (n,), generator=g).tolist() for n in LENS]
    ext = [torch.randint(4, 200, (m,), generator=g).tolist() for m in EXT]
    return ctx, ext


def _engine(model, tok, **kw):
    kw.setdefault("prefill_batch_size", 2)  # 3 requests: a padded batch of 2 and a batch of 1
    return HFEngine(model, tokenizer=tok, progress=False, **kw)


def _model_and_tok(tiny, family):
    model, tok = tiny
    return (model, tok) if family == "bundled" else (_family(family), tok)


def _same(outs_a, outs_b, atol=1e-5):
    for a, b in zip(outs_a, outs_b):
        assert a.output_ids == b.output_ids, (a.output_ids, b.output_ids)
        err = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
        assert err <= atol, err


def _keep_all(tensors, tokens):
    return tensors[CacheKind.KV].clone(), list(tokens)


@pytest.mark.parametrize("family", ["bundled", *FAMILIES])
@pytest.mark.parametrize("edit", [None, "keep_all"])
def test_extend_equals_prefilling_the_whole_prompt(tiny, family, edit):
    model, tok = _model_and_tok(tiny, family)
    ctx, ext = _parts()
    whole = _engine(model, tok, query_window=8)
    whole.prefill([c + e for c, e in zip(ctx, ext)])
    ref = whole.decode(6, keep_logits=True)
    eng = _engine(model, tok, query_window=8)
    eng.prefill(ctx)
    if edit:
        eng.modify(_keep_all)
    assert eng.extend(ext) == [len(c) + len(e) for c, e in zip(ctx, ext)]
    kvs = [eng.kv(i) for i in range(len(ctx))]
    for i, (c, e) in enumerate(zip(ctx, ext)):
        assert kvs[i].shape[2] == len(c) + len(e) and eng.tokens(i) == c + e
        torch.testing.assert_close(kvs[i], whole.kv(i), atol=1e-5, rtol=0)
        if edit is None:  # capture continues: the last 8 rows of the unedited prompt's queries
            torch.testing.assert_close(eng.query(i), whole.query(i), atol=1e-5, rtol=0)
    _same(eng.decode(6, keep_logits=True), ref)


def _reference(model, kv, feed, first_pos, steps):
    """Greedy logits of the model's own forward: `feed` at `first_pos, ...` over a `DynamicCache` holding the rows
    of `kv` [2, L, T, D], then `steps - 1` generated tokens."""
    from transformers import DynamicCache

    cfg = model.config
    h, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache()
    L, T = kv.shape[1], kv.shape[2]
    rows = kv.view(2, L, T, h, d).transpose(2, 3)  # [2, L, H, T, d]
    for layer in range(L):
        cache.update(rows[0, layer][None].clone(), rows[1, layer][None].clone(), layer)
    ids, pos, logits = list(feed), first_pos, []
    with torch.inference_mode():
        for _ in range(steps):
            positions = torch.arange(pos, pos + len(ids))[None]
            out = model(input_ids=torch.tensor([ids]), position_ids=positions, cache=cache, use_cache=True).logits[0, -1]
            logits.append(out)
            pos += len(ids)
            ids = [int(out.argmax())]
    return logits


@pytest.mark.parametrize("family", ["bundled", *FAMILIES])
def test_extend_after_a_real_drop_equals_the_models_forward_over_the_kept_rows(tiny, family):
    model, tok = _model_and_tok(tiny, family)
    ctx, ext = _parts(1)
    eng = _engine(model, tok)
    eng.prefill(ctx)
    eng.modify(make_drop_fn("random", drop_ratio=0.5, model_config=model.config, seed=3, n_sink=2, window=4))
    kept = [eng.kv(i).clone() for i in range(len(ctx))]
    eng.extend(ext)
    outs = eng.decode(5, keep_logits=True)
    for kv, e, out in zip(kept, ext, outs):
        k = kv.shape[2]
        assert out.cached_tokens == k + len(e)
        ref = _reference(model, kv, e, k, 5)  # compact positions: the extension goes at k, k+1, ...
        for step, (mine, theirs) in enumerate(zip(out.logits, ref)):
            assert float((mine - theirs).abs().max()) <= 1e-5, (family, step)
            assert out.output_ids[step] == int(theirs.argmax())


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_extend_with_original_positions_equals_the_masked_full_cache(family):
    """positions="original": the extension follows the prompt at T, T+1, ...; reference: the model's own
    forward (its own sliding-window cache) over the full context with the dropped positions masked out."""
    from transformers import DynamicCache

    from tdutils.models import load_tokenizer

    model = _family(family)
    ctx, ext = _parts(2)
    eng = _engine(model, load_tokenizer("tiny-qwen3"), positions="original")
    eng.prefill(ctx)
    fn = make_drop_fn("random", drop_ratio=0.5, rerotate=False, seed=5, n_sink=2, window=4)
    keeps = [fn.keep_indices(eng.tensors(i), eng.tokens(i)) for i in range(len(ctx))]
    eng.modify(fn)
    eng.extend(ext)
    outs = eng.decode(4, keep_logits=True)
    with torch.inference_mode():
        for c, e, keep, out in zip(ctx, ext, keeps, outs):
            T = len(c)
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([c]), cache=cache, use_cache=True)
            mask = torch.zeros(1, T, dtype=torch.long)
            mask[0, keep] = 1
            ids, pos = list(e), T
            for step in range(4):
                mask = torch.cat([mask, torch.ones(1, len(ids), dtype=torch.long)], dim=1)
                logits = model(input_ids=torch.tensor([ids]), attention_mask=mask,
                               position_ids=torch.arange(pos, pos + len(ids))[None], cache=cache,
                               use_cache=True).logits[0, -1]
                assert float((out.logits[step] - logits).abs().max()) <= 1e-5, (family, step)
                pos += len(ids)
                ids = [int(logits.argmax())]
                assert ids[0] == out.output_ids[step]


def test_a_second_modify_after_extend_edits_the_extended_cache(tiny):
    model, tok = tiny
    ctx, ext = _parts(3)
    eng = _engine(model, tok, query_window=64)
    eng.prefill(ctx)
    eng.modify(make_drop_fn("random", drop_ratio=0.5, model_config=model.config, seed=1, n_sink=2, window=4))
    eng.extend(ext)
    # after the edit only the extension's queries exist: a 16-row observation window is refused, nothing changes
    before = [(eng.kv(i), eng.tokens(i)) for i in range(len(ctx))]
    with pytest.raises(DropFunctionError, match="query holds"):
        eng.modify(make_drop_fn("snapkv", drop_ratio=0.5, model_config=model.config, window=16))
    assert all(eng.kv(i) is kv and eng.tokens(i) == t for i, (kv, t) in enumerate(before))
    # a window the captured rows cover works (the smallest extension has one token)
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=model.config, window=1, kernel_size=1)
    eng.modify(fn)
    outs = eng.decode(4, keep_logits=True)
    for i, out in enumerate(outs):
        kv = eng.kv(i)
        ref = _reference(model, kv[:, :, :-1], [eng.tokens(i)[-1]], kv.shape[2] - 1, 4)  # decode refeeds the last
        assert out.output_ids == [int(x.argmax()) for x in ref]
        assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref)) <= 1e-5


def test_extend_after_decode_continues_the_same_cache(tiny):
    """decode leaves the cache as it was: extend after it extends the prefilled (edited) cache, not the output."""
    model, tok = tiny
    ctx, ext = _parts(4)
    eng = _engine(model, tok)
    eng.prefill(ctx)
    eng.decode(3)
    eng.extend(ext)
    assert [len(eng.tokens(i)) for i in range(3)] == [c + e for c, e in zip(LENS, EXT)]


def test_bad_extensions_are_refused_and_change_nothing(tiny):
    model, tok = tiny
    ctx, ext = _parts(5)
    eng = _engine(model, tok, kv_budget_tokens=50)
    with pytest.raises(RuntimeError, match="call prefill"):
        eng.extend(ext)
    eng.prefill(ctx)
    state = [(eng.kv(i), eng.tokens(i), eng.requests[i].refeed_pos) for i in range(3)]
    cases = [
        (ext[:2], ValueError, r"2 extension\(s\) for 3 request\(s\)"),
        ([*ext[:2], []], ValueError, "extension 2 is empty"),
        ([*ext[:2], ""], ValueError, "extension 2 is empty"),
        ([*ext[:2], [10**6]], ValueError, "outside the model's vocabulary"),
        ("pass key =", TypeError, "one extension per request"),
        (None, TypeError, "takes a list with one text or token-id list per request, got NoneType"),
        ([*ext[:2], 3.5], TypeError, "extension 2 must be"),
        ([[5] * 10, [5], [5]], ValueError, r"would hold 50 KV tokens \(40 cached \+ 10 extension\).*kv_budget_tokens is 50"),
    ]
    for bad, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            eng.extend(bad)
        assert [(eng.kv(i), eng.tokens(i), eng.requests[i].refeed_pos) for i in range(3)] == state
    eng.extend([[5] * 9, [5], [5]])  # 40 + 9 + 1 == 50 fits
    assert eng.kv(0).shape[2] == 49


def test_an_extension_the_tokenizer_cannot_read_warns(tiny):
    model, tok = tiny
    eng = _engine(model, tok)
    eng.prefill(["the town", "the river"])
    with pytest.warns(UserWarning, match=r"100% of the extension tokens are unknown to this tokenizer .* the model "
                                         r"cannot read this text"):
        eng.extend([" Quantum chromodynamics", [5, 6]])
    assert eng.tokens(1)[-2:] == [5, 6]  # a warning, not an error: the extension is prefilled


def test_extend_takes_text_without_special_tokens(tiny):
    model, tok = tiny
    eng = _engine(model, tok)
    eng.prefill(["the town", "the river"])
    eng.extend([" pass key =", [5, 6]])
    assert eng.tokens(0) == tok("the town pass key =", add_special_tokens=False)["input_ids"]
    assert eng.tokens(1)[-2:] == [5, 6]


def test_lmcache_engine_extend_decodes_like_the_hf_engine(tiny, sample_ids):
    """With chunk size 1 the serving stand-in loads every cached row and prefills the rest, as the hf engine's
    extend does: greedy outputs of prefill(context) -> modify -> extend(question) -> decode agree."""
    from test_lmcache_engine import engine as lmcache_engine

    model, tok = tiny
    ctx = [x[:n] for x, n in zip(sample_ids, (120, 75, 150))]
    ext = [x[-m:] for x, m in zip(sample_ids, (6, 1, 9))]
    hf = _engine(model, tok)
    fns = [None, make_drop_fn("random", drop_ratio=0.5, model_config=model.config, seed=3),
           make_drop_fn("snapkv", drop_ratio=0.5, model_config=model.config, window=16)]
    with lmcache_engine(tiny, 1) as eng:
        for fn in fns:
            outs = []
            for e in (hf, eng):
                if fn is not None:
                    e.capture_for(fn)
                e.prefill(ctx)
                if fn is not None:
                    e.modify(fn)
                cached = [len(e.tokens(i)) for i in range(len(ctx))]
                e.extend(ext)
                if e is eng:  # LMCache still holds the cached tokens only; the extension is prefilled at decode
                    assert [len(e.tokens(i)) for i in range(len(ctx))] == cached
                outs.append([o.output_ids for o in e.decode(5)])
            assert outs[0] == outs[1], getattr(fn, "name", "full cache")
        with pytest.raises(ValueError, match=r"2 extension\(s\) for 3 request\(s\)"):
            eng.extend(ext[:2])
        # modify after extend, before decode: LMCache does not hold the extension yet; refused, nothing changes
        eng.prefill(ctx)
        eng.extend(ext)
        before = [eng.tokens(i) for i in range(len(ctx))]
        with pytest.raises(RuntimeError, match=r"requests \[0, 1, 2\] were extended and not decoded yet"):
            eng.modify(fns[1])
        assert [eng.tokens(i) for i in range(len(ctx))] == before


def test_check_query_holds_after_extend_and_refuses_edited_caches(tiny):
    """An unedited request's captured queries after extend are the extended prompt's own (the model's attention
    probabilities agree); after an edit the prompt's forward no longer describes the cache, so it is refused."""
    model, tok = tiny
    ctx, ext = _parts(6)
    eng = _engine(model, tok, query_window=8)
    eng.prefill(ctx)
    eng.extend(ext)
    assert max(eng.check_query(i, rows=8) for i in range(len(ctx))) <= 1e-5
    eng.modify(_keep_all)
    eng.extend(ext)
    with pytest.raises(RuntimeError, match="unedited prompt"):
        eng.check_query(0)
