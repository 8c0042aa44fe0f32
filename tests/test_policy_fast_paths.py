"""The fast paths of the query-aware policies (issue 34, item 3) against the definitions they compute.

`scoring.window_column_sums` (SnapKV, TOVA) against `window_attention` summed over its rows; H2O's blocked,
fused accumulation against the dense causal softmax in float64; R-KV's batched redundancy scan (every head of
every layer at once, rows packed and heads regrouped as they finish, the dense off-CPU accumulation included)
against the literal `reference` method and against one head at a time; and the kept sets they lead to.
"""

import math

import pytest
import torch

from tdutils.attention import AttentionSpec, LayerAttention
from tdutils.policies import (
    h2o,
    h2o_keep,
    h2o_scores,
    rkv,
    rkv_keep,
    rkv_scores,
    scoring,
    snapkv_keep,
    snapkv_scores,
    tova_scores,
)
from tdutils.policies.scoring import reduce_gqa, window_attention, window_column_sums
from tdutils.profiling import synthetic_keys

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = {
    "plain": LayerAttention(0.125),
    "softcap": LayerAttention(0.125, softcap=5.0),
    "window": LayerAttention(0.125, sliding_window=7),
    "sinks": LayerAttention(0.125, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5]), has_sinks=True),
}


def _kv_q(L=3, T=40, H=2, g=3, d=8, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, L, T, H * d, generator=gen) * scale
    q = torch.randn(L, T, H * g * d, generator=gen) * scale
    return kv, q


@pytest.mark.parametrize("kind", [None, *LAYERS])
@pytest.mark.parametrize("w", [1, 5, 40])
def test_window_column_sums_equal_window_attention_summed_over_rows(kind, w):
    kv, q = _kv_q(L=3, T=40, H=2, g=3, d=8, seed=w)
    layer = None if kind is None else LAYERS[kind]
    got = window_column_sums(kv[0], q[:, -w:], 2, layer)  # [3, 6, 40]
    for b in range(3):
        want = window_attention(kv[0, b], q[b, -w:], 2, layer).sum(dim=1)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


def _snapkv_by_layer(kv, q, d, w, attention, kernel=5, pooling="avg", how="mean"):
    """SnapKV as first written: one layer at a time through `window_attention`."""
    L, T = kv.shape[1], kv.shape[2]
    n, h = T - w, kv.shape[3] // d
    total = torch.zeros(n)
    for layer in range(L):
        probs = window_attention(kv[0, layer], q[layer, -w:], h, attention.layers[layer])
        vote = reduce_gqa(probs[:, :, :n].sum(dim=1), h, how)
        total += scoring.pool_tokens(vote, kernel, pooling).mean(dim=0)
    return total / L


@pytest.mark.parametrize("batch", [1, 1 << 20])
def test_snapkv_and_tova_match_the_per_layer_definition_on_mixed_layers(monkeypatch, batch):
    monkeypatch.setattr(scoring, "BATCH_ELEMENTS", batch)  # one layer a batch, or every layer of one kind at once
    kv, q = _kv_q(L=5, T=50, H=2, g=3, d=8, seed=3)
    mixed = AttentionSpec((LAYERS["plain"], LAYERS["plain"], LAYERS["softcap"], LAYERS["window"], LAYERS["sinks"]))
    plain = AttentionSpec((LAYERS["plain"],) * 5)
    for spec in (mixed, plain):
        for how in ("mean", "max"):
            want = _snapkv_by_layer(kv, q, 8, 6, spec, how=how)
            torch.testing.assert_close(snapkv_scores(kv, q, head_dim=8, window=6, attention=spec, gqa_reduce=how),
                                       want, atol=1e-6, rtol=1e-5)
        full = torch.cat([_snapkv_by_layer(kv, q, 8, 6, spec), torch.full((6,), math.inf)])
        assert snapkv_keep(kv, q, 0.5, head_dim=8, window=6, attention=spec).tolist() == sorted(
            torch.sort(-full, stable=True).indices[:25].tolist())
        tova = sum(window_attention(kv[0, i], q[i, -1:], 2, spec.layers[i])[:, 0].mean(dim=0) for i in range(5)) / 5
        torch.testing.assert_close(tova_scores(kv, q, head_dim=8, attention=spec), tova, atol=1e-6, rtol=1e-5)


def _h2o_dense(kv, q, d, attention):
    """H2O's definition in float64: every query's full softmax over the keys it sees, summed over queries."""
    L, T = kv.shape[1], kv.shape[2]
    h = kv.shape[3] // d
    hq = q.shape[2] // d
    g = hq // h
    pos = torch.arange(T)
    rel = pos[:, None] - pos[None, :]
    total = torch.zeros(T, dtype=torch.float64)
    for layer in range(L):
        spec = attention.layers[layer] if attention is not None else LayerAttention(d ** -0.5)
        k = kv[0, layer].double().view(T, h, d).transpose(0, 1).repeat_interleave(g, dim=0)  # [Hq, T, d]
        qh = q[layer].double().view(T, hq, d).transpose(0, 1)
        x = (qh @ k.transpose(1, 2)) * spec.scaling
        if spec.softcap is not None:
            x = torch.tanh(x / spec.softcap) * spec.softcap
        hidden = rel < 0
        if spec.sliding_window is not None:
            hidden |= rel >= spec.sliding_window
        x = x.masked_fill(hidden, -math.inf)
        if spec.sinks is not None:
            x = torch.cat([x, spec.sinks.double()[:, None, None].expand(hq, T, 1)], dim=-1)
        p = torch.softmax(x, dim=-1)[..., :T]
        total += p.sum(dim=1).view(h, g, T).mean(dim=1).mean(dim=0)
    return (total / L).float()


@pytest.mark.parametrize("block", [1, 6 * 40 * 7, 1 << 22])  # one query row a block, 7 rows, all rows at once
def test_h2o_blocks_equal_the_dense_definition_on_every_kind_of_layer(monkeypatch, block):
    monkeypatch.setattr(h2o, "BLOCK_ELEMENTS", block)
    kv, q = _kv_q(L=4, T=40, H=2, g=3, d=8, seed=11)
    for spec in (None, AttentionSpec(tuple(LAYERS.values())), AttentionSpec((LAYERS["plain"],) * 4)):
        want = _h2o_dense(kv, q, 8, spec)
        got = h2o_scores(kv, q, head_dim=8, attention=spec)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        protected = torch.zeros(40, dtype=torch.bool)
        protected[-10:] = True  # window = k // 2 = 10
        order = torch.sort(-want.double().masked_fill(protected, math.inf), stable=True).indices
        want_keep = sorted(order[:20].tolist())
        assert h2o_keep(kv, q, 0.5, head_dim=8, attention=spec).tolist() == want_keep


def test_h2o_on_a_short_prompt_blocks_no_more_rows_than_it_has():
    """A 6-token prompt: the block of query rows is capped at T (uncapped, BLOCK_ELEMENTS // (Hq * T) rows made a
    [rows, rows] causal mask of terabytes for T this short)."""
    kv, q = _kv_q(L=2, T=6, H=2, g=3, d=8, seed=3)
    torch.testing.assert_close(h2o_scores(kv, q, head_dim=8), _h2o_dense(kv, q, 8, None), atol=2e-6, rtol=1e-5)


def _heterogeneous_keys(L=4, H=3, n=300, d=16, seed=0):
    """Heads that finish the scan at very different speeds: random (hits far away or none), realistic (hits at
    the right edge), exact duplicates and zero keys, and one head with both."""
    heads = []
    for i in range(L * H):
        kind = ("random", "realistic")[i % 2]
        k = synthetic_keys(1, n, d, kind=kind, seed=seed + i)[0]
        if i % 3 == 0:
            k[n // 2:n // 2 + 20] = k[10:30]  # duplicates of early keys in the middle
        if i % 5 == 0:
            k[n - 7:] = 0.0  # zero keys (normalise to 0: no hit at a positive threshold)
        heads.append(k)
    return torch.stack(heads).view(L, H, n, d)


@pytest.mark.parametrize("method,tiles", [("exact", {}), ("exact", {"col_block": 37, "first_block": 3}),
                                          ("tiled", {}), ("tiled", {"row_tile": 50, "col_block": 64, "first_block": 8})])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("threshold", [0.5, 0.1, -0.2])
def test_batched_redundancy_equals_reference_head_by_head(monkeypatch, method, tiles, dense, threshold):
    """Every head of every layer in one call, groups and block slices forced small, with the CPU's index_add_ or
    the dense (GPU) accumulation: the literal reference per head, and the same as one head at a time."""
    monkeypatch.setattr(rkv, "GROUP_BYTES", 5 * 8 * 300 * 16)  # groups of ~5 heads
    monkeypatch.setattr(rkv, "BLOCK_BYTES", 4000)  # a block's heads sliced as thin as the widest allows
    monkeypatch.setattr(rkv, "_dense_retain", lambda device: dense)
    keys = _heterogeneous_keys()
    got = rkv.rkv_redundancy(keys, method=method, threshold=threshold, **tiles)  # [4, 3, 300]
    ref = rkv.rkv_redundancy(keys, method="reference", threshold=threshold)
    rel = ((got.double() - ref.double()).abs() / ref.double().abs()).max().item()
    assert rel < 1e-5
    one = torch.stack([rkv.rkv_redundancy(keys[i, j:j + 1], method=method, threshold=threshold, **tiles)[0]
                       for i in range(4) for j in range(3)]).view(4, 3, 300)
    torch.testing.assert_close(got, one, atol=1e-9, rtol=1e-6)


def test_rkv_batched_layers_equal_one_layer_at_a_time(monkeypatch):
    """The off-CPU layout (every layer in one batch) and the CPU one (a layer at a time) score alike."""
    kv, q = _kv_q(L=4, T=120, H=3, g=2, d=16, seed=5, scale=1.0)
    kv[0, :, 60:80] = kv[0, :, 20:40]  # near-duplicates for the redundancy
    spec = AttentionSpec((LAYERS["plain"], LAYERS["softcap"], LAYERS["window"], LAYERS["plain"]))
    for method in ("exact", "tiled", "reference"):
        per_layer = rkv_scores(kv, q, head_dim=16, attention=spec, redundancy=method)
        keep = rkv_keep(kv, q, 0.5, head_dim=16, attention=spec, redundancy=method)
        monkeypatch.setattr(rkv, "_batch_layers", lambda device: True)
        batched = rkv_scores(kv, q, head_dim=16, attention=spec, redundancy=method)
        assert torch.equal(rkv_keep(kv, q, 0.5, head_dim=16, attention=spec, redundancy=method), keep)
        monkeypatch.setattr(rkv, "_batch_layers", lambda device: False)
        torch.testing.assert_close(batched, per_layer, atol=1e-6, rtol=1e-5)
        # and the definition: per layer, importance and the reference redundancy, averaged over heads
        want = torch.zeros(120 - 16)
        for layer in range(4):
            imp = rkv.rkv_importance(kv[0, layer], q[layer, -16:], 3, 7, spec.layers[layer])
            red = rkv.rkv_redundancy(kv[0, layer].view(120, 3, 16).transpose(0, 1), method="reference")
            want += (0.25 * imp - 0.75 * red[:, :104]).mean(dim=0)
        torch.testing.assert_close(per_layer, want, atol=1e-6, rtol=1e-5)
