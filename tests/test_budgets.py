"""Budgets that move between heads and layers: AdaKV, PyramidKV, ExpectedAttention, and unequal per-head counts in the
hf engine (docs/policies.md, "Unequal counts")."""

import math

import pytest
import torch
from test_granularity import FULL_ATTENTION, _assert_masked_forward, _decode_after

from tdutils import make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.kvcache import CacheKind, apply_keep_heads, check_keep_sets
from tdutils.models import model_facts
from tdutils.policies.adakv import adakv_keep
from tdutils.policies.expected_attention import ExpectedAttentionParams, expected_attention_head_scores
from tdutils.policies.pyramidkv import pyramid_budgets
from tdutils.policies.snapkv import SnapKVParams, snapkv_head_scores
from tdutils.selection import keep_count, pack_sets

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ representation
def test_pack_sets_right_aligns_each_set_after_its_padding_and_validates():
    mask = torch.tensor([[[1, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 1]]], dtype=torch.bool)
    keep = pack_sets(mask)
    assert keep.tolist() == [[[0, 2, 3, 5], [-1, -1, 1, 5]]]  # 2 padding columns, then head 1's set
    assert torch.equal(check_keep_sets(keep, 6, 1, 2), keep)
    for bad in ([[[0, 2, 3, 5], [-1, 1, -1, 5]]], [[[0, 2, 3, 5], [1, -1, -1, 5]]], [[[0, 2, 3, 5], [-1, 1, 5, -1]]],
                [[[0, 3, 2, 5], [-1, -1, 1, 5]]], [[[0, 2, 2, 5], [-1, -1, 1, 5]]]):
        with pytest.raises(ValueError, match="padded|duplicates"):
            check_keep_sets(torch.tensor(bad), 6, 1, 2)


def test_padded_rows_are_zeros_and_the_rest_gathered_per_head():
    kv = torch.randn(2, 1, 6, 2 * 4, dtype=torch.float64)
    keep = torch.tensor([[[0, 2, 3, 5], [1, -1, -1, 5]]])
    new_kv, new_tokens = apply_keep_heads(kv, list(range(10, 16)), keep, rerotate=False)
    heads = kv.view(2, 1, 6, 2, 4)
    out = new_kv.view(2, 1, 4, 2, 4)
    assert torch.equal(out[:, 0, :, 0], heads[:, 0, [0, 2, 3, 5], 0])
    assert torch.equal(out[:, 0, [0, 3], 1], heads[:, 0, [1, 5], 1])
    assert not out[:, 0, 1:3, 1].any()
    assert new_tokens == [10, 12, 13, 15]


# ------------------------------------------------------------------------------------------------ AdaKV
def test_adakv_allocation_by_hand():
    """k = 3 per head, H = 2: the layer keeps 6. alpha 0.7: int(2.1) = 2 safeguarded per head (the last token and the
    head's best; head 1 ties, the earlier token wins), then the 2 best of the rest across heads, both in head 0."""
    scores = torch.tensor([[[9.0, 8, 7, 6, 0, 0], [1, 1, 1, 1, 1, 0]]])
    assert adakv_keep(scores, 3, 0.7).tolist() == [[[0, 1, 2, 5], [-1, -1, 0, 5]]]
    assert adakv_keep(scores, 3, 1.0).tolist() == [[[0, 1, 5], [0, 1, 5]]]  # all safeguarded: uniform
    protected = torch.tensor([False, False, False, False, True, True])
    assert adakv_keep(scores, 3, 0.0, protected).tolist() == [[[0, 1, 4, 5], [-1, -1, 4, 5]]]


def _kvpress_adakv(scores, k, alpha, always):
    """kvpress AdaKVPress.compress transcribed (`n_kept` given, protected scores set to the maximum first)."""
    L, H, n = scores.shape
    s = scores.clone()
    s[..., always] = torch.finfo(s.dtype).max
    out = torch.zeros(L, H, n, dtype=torch.bool)
    for layer in range(L):
        sl = s[layer].clone()
        top = torch.topk(sl, int(k * alpha), dim=-1).indices
        sl.scatter_(-1, top, torch.finfo(sl.dtype).max)
        pruned = torch.topk(-sl.reshape(-1), H * (n - k)).indices
        keep = torch.ones(H * n, dtype=torch.bool)
        keep[pruned] = False
        out[layer] = keep.view(H, n)
    return out


def test_adakv_matches_kvpress_allocation_on_random_scores():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 4, 50, generator=g)
    always = torch.zeros(50, dtype=torch.bool)
    always[-5:] = True
    for k, alpha in ((20, 0.2), (12, 0.5), (30, 0.0)):
        ours = adakv_keep(scores, k, alpha, always)
        mask = torch.zeros(3, 4, 51, dtype=torch.long).scatter_(-1, torch.where(ours < 0, 50, ours), 1)[..., :50].bool()
        assert torch.equal(mask, _kvpress_adakv(scores, k, alpha, always))
        assert (mask.sum(dim=(1, 2)) == 4 * k).all()
        assert len(set(mask.sum(-1).flatten().tolist())) > 1  # the heads' counts differ


def test_adakv_snapkv_uses_snapkvs_per_head_votes(request0):
    eng, tensors, tokens = request0
    fn = make_drop_fn("adakv_snapkv", drop_ratio=0.5, model_config=eng.facts, granularity="head", window=8)
    keep = fn.keep_indices(tensors, tokens)
    scores, protected = snapkv_head_scores(tensors[CacheKind.KV], tensors[CacheKind.QUERY],
                                           params=SnapKVParams(window=8), facts=eng.facts)
    assert torch.equal(keep, adakv_keep(scores, keep_count(len(tokens), 0.5), 0.2, protected))
    assert int((keep >= 0).sum()) == eng.facts.num_layers * eng.facts.num_kv_heads * keep_count(len(tokens), 0.5)
    default = make_drop_fn("adakv_snapkv", drop_ratio=0.5, model_config=eng.facts, window=8)  # "request" asks for them
    assert default.granularity == "head" and torch.equal(default.keep_indices(tensors, tokens), keep)
    with pytest.raises(ValueError, match="selects per KV head only"):
        make_drop_fn("adakv_snapkv", model_config=eng.facts, granularity="layer")


# ------------------------------------------------------------------------------------------------ PyramidKV
def test_pyramid_budgets_follow_the_papers_formula_by_hand():
    # cap = 10 + 50 = 60, lo = 50 / 4 = 12.5, hi = 100 - 12.5 = 87.5; steps 18.75; round half to even
    assert pyramid_budgets(100, 0.5, 5, 10, beta=4) == [88, 69, 50, 31, 12]
    # hi = 2 * 80 - 4 = 156 >= T - w = 90: hi = 90, lo = 160 - 90 = 70
    assert pyramid_budgets(100, 0.2, 5, 10, beta=20) == [90, 85, 80, 75, 70]
    assert pyramid_budgets(100, 0.5, 5, 10, beta=1) == [50] * 5  # beta 1: flat
    assert pyramid_budgets(100, 0.95, 5, 10, beta=20) == [5] * 5  # lo < w: SnapKV's uniform budget
    assert pyramid_budgets(100, 0.5, 1, 10) == [50]


def test_pyramidkv_keeps_each_layers_budget_of_top_votes_per_head(request0):
    eng, tensors, tokens = request0
    T, L = len(tokens), eng.facts.num_layers
    fn = make_drop_fn("pyramidkv", drop_ratio=0.5, model_config=eng.facts, granularity="head", window=8, beta=2)
    keep = fn.keep_indices(tensors, tokens)
    budgets = pyramid_budgets(T, 0.5, L, 8, 2)
    assert budgets[0] > budgets[-1]
    scores, _ = snapkv_head_scores(tensors[CacheKind.KV], tensors[CacheKind.QUERY], params=SnapKVParams(window=8),
                                   facts=eng.facts)
    scores[..., -8:] = math.inf
    for layer, k in enumerate(budgets):
        rows = keep[layer]
        assert ((rows >= 0).sum(-1) == k).all()
        for h in range(rows.shape[0]):
            by_hand = torch.sort(torch.sort(-scores[layer, h], stable=True).indices[:k]).values
            assert torch.equal(torch.sort(rows[h][rows[h] >= 0]).values, by_hand)


# ------------------------------------------------------------------------------------------------ ExpectedAttention
def _kvpress_expected_attention(model, ids, p: ExpectedAttentionParams):
    """kvpress ExpectedAttentionPress.score transcribed on the model's own modules: pre-RoPE queries from each layer's
    input hidden states (q_proj, q_norm), the averaged rotation from the model's rotary embedding."""
    from transformers import DynamicCache

    seen = {}
    layers = model.base_model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(layers)]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    for h in hooks:
        h.remove()
    out = []
    T = len(ids)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        d = attn.head_dim
        h = seen[i][:, p.n_sink:]
        q = attn.q_norm(attn.q_proj(h).view(1, h.shape[1], -1, d)).transpose(1, 2)  # [1, Hq, n, d]
        mu = q.mean(dim=2, keepdim=True)
        c = q - mu
        cov = torch.einsum("bnsi,bnsj->bnij", c, c) / h.shape[1]
        mu = mu.squeeze(2)
        cos, sin = model.base_model.rotary_emb(mu, torch.arange(T, T + p.n_future_positions)[None])
        cos, sin = cos[0], sin[0]
        eye = torch.eye(d)
        P = torch.zeros(d, d)
        P[d // 2:, :d // 2], P[:d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
        R = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * P).mean(dim=0)
        mu, cov = mu @ R.T, R @ cov @ R.T
        keys, values = cache.layers[i].keys[:, :, p.n_sink:], cache.layers[i].values[:, :, p.n_sink:]
        g = q.shape[1] // keys.shape[1]
        k = keys.repeat_interleave(g, dim=1).transpose(2, 3)
        s = torch.matmul(mu.unsqueeze(2), k).squeeze(2) / math.sqrt(d)
        s = s + torch.einsum("bhin,bhij,bhjn->bhn", k, cov, k) / d / 2
        s = torch.softmax(s, dim=-1).view(1, keys.shape[1], g, -1).mean(dim=2)
        s = (s + p.epsilon) * values.norm(dim=-1)
        out.append(s[0])
    return torch.stack(out)  # [L, H, T - n_sink]


def test_expected_attention_scores_equal_kvpress_computation_on_the_model(tiny, request0):
    model, _ = tiny
    eng, tensors, tokens = request0
    p = ExpectedAttentionParams(n_future_positions=64, epsilon=1e-2)
    ours, protected = expected_attention_head_scores(tensors[CacheKind.KV], tensors[CacheKind.QUERY], params=p,
                                                     facts=eng.facts)
    ref = _kvpress_expected_attention(model, tokens, p)
    torch.testing.assert_close(ours[..., 4:], ref, rtol=1e-4, atol=1e-7)
    assert protected[:4].all() and not protected[4:].any()
    keep = make_drop_fn("expected_attention", drop_ratio=0.5, model_config=eng.facts,
                        granularity="head").keep_indices(tensors, tokens)
    assert (keep[..., :4] == torch.arange(4)).all()  # the sinks in every head


def test_expected_attention_refuses_a_too_short_query_in_one_line(request0):
    eng, tensors, tokens = request0
    fn = make_drop_fn("expected_attention", model_config=eng.facts)
    assert fn.needs == "all"
    short = {CacheKind.KV: tensors[CacheKind.KV], CacheKind.QUERY: tensors[CacheKind.QUERY][:, -3:]}
    with pytest.raises(ValueError, match="more than n_sink=4"):
        fn.keep_indices(short, tokens)


# ------------------------------------------------------------------------------------------------ hf engine
@pytest.mark.parametrize("name", ["adakv_snapkv", "pyramidkv"])
def test_unequal_counts_decode_as_the_models_forward_masked_per_head(tiny, sample_ids, name):
    """Original positions, fp64: the padded store with its per-head masks decodes as the model's own forward over
    the full prompt with, in each layer, each KV head's dropped keys masked."""
    import copy

    model = copy.deepcopy(tiny[0]).double()
    model.set_attn_implementation("sdpa")
    fn = make_drop_fn(name, drop_ratio=0.5, model_config=model, rerotate=False, granularity="head", window=8)
    keeps, outs = _decode_after(tiny, sample_ids[:2], fn, positions="original", model=model)
    assert any(bool((k < 0).any()) for k in keeps)  # padding present
    _assert_masked_forward(model, sample_ids[:2], keeps, outs, atol=1e-10)


@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_families_unequal_counts_equal_the_masked_forward_fp32(family, tiny):
    from families import family_model

    model = family_model(family)
    fn = make_drop_fn("adakv_snapkv", drop_ratio=0.5, model_config=model, rerotate=False, granularity="head", window=2,
                      kernel_size=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 200, (n,), generator=g).tolist() for n in (40, 57)]
    keeps, outs = _decode_after(tiny, prompts, fn, positions="original", model=model, max_tokens=4)
    assert bool((keeps[0] < 0).any())
    _assert_masked_forward(model, prompts, keeps, outs, atol=1e-5)


def test_the_kv_budget_charges_the_padded_rows(tiny, sample_ids):
    """A padded request is charged its largest head's count: it decodes under a budget of exactly `k_max + N`
    (what is stored) and is refused under one token less, though its heads hold fewer rows on average."""
    model, tok = tiny
    fn = make_drop_fn("adakv_snapkv", drop_ratio=0.5, model_config=model, granularity="head", window=8,
                      alpha_safeguard=0.0)
    ids = sample_ids[1]
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=8)
    eng.prefill([ids])
    k_max = fn.keep_indices(eng.tensors(0), eng.tokens(0)).shape[-1]
    assert k_max > keep_count(len(ids), 0.5)
    for budget, ok in ((k_max + 3, True), (k_max + 2, False)):
        eng = HFEngine(model, tokenizer=tok, progress=False, query_window=8, kv_budget_tokens=budget)
        eng.prefill([ids])
        eng.modify(fn)
        assert eng.kv(0).shape[2] == k_max
        if ok:
            assert eng.decode(max_tokens=3)[0].cached_tokens == k_max
        else:
            with pytest.raises(ValueError, match=f"needs {k_max + 3} KV tokens"):
                eng.decode(max_tokens=3)


def test_budgets_that_move_refuse_compression_and_the_lmcache_layout_in_one_line(tiny):
    from tdutils.compression import Compression

    with pytest.raises(ValueError, match="unequal counts per head"):
        Compression("adakv_snapkv", budget=64)
    fn = make_drop_fn("pyramidkv", model_config=tiny[0])
    assert fn.granularity == "head"  # what the lmcache engine refuses (one token list per request)


@pytest.mark.parametrize("agnostic", [False, True])
def test_compact_unequal_counts_decode_as_the_models_forward_over_the_edited_cache(tiny, sample_ids, agnostic):
    """Compact positions: the padded, per-head re-rotated cache decodes as the model's own forward over that cache
    (a DynamicCache of its rows) with each layer's padding masked per head, fp64; query-agnostic (`agnostic`): a
    question appended by `extend` after the edit attends to the same rows, causally to itself."""
    import copy

    model = copy.deepcopy(tiny[0]).double()
    model.set_attn_implementation("sdpa")
    # AdaKV pads layer 0 too: the extension's keys and values of layer 1 depend on it (PyramidKV pads only the last)
    fn = make_drop_fn("adakv_snapkv" if agnostic else "pyramidkv", drop_ratio=0.5, model_config=model, window=8)
    eng = HFEngine(model, tokenizer=tiny[1], progress=False, query_window=8)
    eng.prefill([sample_ids[1]])
    keep = fn.keep_indices(eng.tensors(0), eng.tokens(0))
    eng.modify(fn)
    kv, tokens = eng.kv(0).clone(), eng.tokens(0)
    ext = sample_ids[0][5:12] if agnostic else []
    if agnostic:
        eng.extend([ext])
    out = eng.decode(max_tokens=3, keep_logits=True)[0]
    # decode refeeds the last cached token (its row recomputed); extend appends after every cached row
    feed, kv, pad = (ext, kv, keep < 0) if agnostic else (tokens[-1:], kv[:, :, :-1], (keep < 0)[..., :-1])
    _assert_edited_forward(model, kv, pad, feed, out)


def _assert_edited_forward(model, kv, pad, feed, out):
    """The model's forward over the rows of an edited `kv [2, L, k, D]` (their padding `pad [L, H, k]` masked per
    head), fed `feed` at positions `k, k + 1, ...` (causal among themselves), then greedy decoding: each step's logits
    equal `out`'s (fp64, 1e-10)."""
    from transformers import DynamicCache

    facts = model_facts(model)
    L, H, g, d = facts.num_layers, facts.num_kv_heads, facts.gqa_group_size, facts.head_dim
    k = kv.shape[2]
    cache = DynamicCache(config=model.config)
    for layer in range(L):
        rows = kv[:, layer].reshape(2, k, H, d).transpose(1, 2)[:, None]  # [2, 1, H, k, d]
        cache.update(rows[0], rows[1], layer)
    hidden = pad.repeat_interleave(g, dim=1)  # [L, Hq, k]
    current = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: (args, {**kwargs, "attention_mask": current[i]}), with_kwargs=True)
        for i, layer in enumerate(model.base_model.layers)]

    def step(ids, pos):
        q, S = len(ids), pos + len(ids)
        for layer in range(L):
            m = torch.zeros(hidden.shape[1], q, S, dtype=torch.float64)
            m[:, :, :k] = m[:, :, :k].masked_fill(hidden[layer, :, None, :], float("-inf"))
            m[:, :, S - q:] = torch.zeros(q, q).masked_fill(torch.ones(q, q).triu(1).bool(), float("-inf"))
            current[layer] = m[None]
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), position_ids=torch.arange(pos, pos + q)[None],
                         cache=cache, use_cache=True).logits[0, -1]

    try:
        logits = step(feed, k)
        pos = k + len(feed)
        for i in range(len(out.logits)):
            torch.testing.assert_close(out.logits[i], logits, atol=1e-10, rtol=0)
            tok = int(logits.argmax())
            assert tok == out.output_ids[i]
            logits, pos = step([tok], pos), pos + 1
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.real_models
def test_smollm2_unequal_counts_equal_the_masked_forward(tiny):
    """SmolLM2-135M (fp32, <= 1e-4): AdaKV over SnapKV at original positions, on a 300-token text prompt."""
    from tdutils.models import load_model

    try:
        model, tok = load_model("smollm2-135m", device="cpu", dtype="float32", progress=False)
    except (OSError, ImportError) as exc:
        pytest.skip(str(exc))
    ids = tok("The grass is green. The sky is blue. The sun is yellow. " * 20)["input_ids"][:300]
    fn = make_drop_fn("adakv_snapkv", drop_ratio=0.5, model_config=model, rerotate=False, window=16)
    keeps, outs = _decode_after((model, tok), [ids], fn, positions="original", model=model, max_tokens=3)
    assert bool((keeps[0] < 0).any())
    worst = _assert_masked_forward(model, [ids], keeps, outs, atol=1e-4)
    print(f"largest difference {worst:.2e}")
