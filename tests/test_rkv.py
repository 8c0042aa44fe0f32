"""R-KV: the four redundancy methods against the literal definition, hand-computed scores, drop functions."""

import math

import pytest
import torch

from tdutils import CacheKind, make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.policies.rkv import RKV_METHODS, compare_redundancy_methods, rkv_keep, rkv_redundancy, rkv_scores
from tdutils.profiling import kept_agreement, peak_memory, synthetic_keys
from tdutils.selection import keep_top_scores

# tile settings that do not divide the test lengths (257, 3000); the one-column and 7-row extremes only run
# on the short lengths (they are slow loops at n = 3000)
EXACT_TILES = [{}, {"col_block": 97, "first_block": 13}]
TILED_TILES = [{}, {"row_tile": 700, "col_block": 333, "first_block": 5}, {"row_tile": 4096, "col_block": 4096}]
SHORT_ONLY = [("exact", {"col_block": 1, "first_block": 1}), ("tiled", {"row_tile": 7, "col_block": 19, "first_block": 2})]


def _brute_force(keys, threshold=0.5, eps=1e-8, chunk=None):
    """docs/design.md §5 in float64, one row at a time, as written: an independent check of every method.

    With `chunk`, the buffered definition: S restricted to each chunk, mean over the chunk's rows,
    softmax over all n."""
    k = keys.double()
    kh = k / (k.norm(dim=-1, keepdim=True) + eps)
    H, n, _ = kh.shape
    chunk = chunk or n
    out = torch.empty(H, n, dtype=torch.float64)
    for h in range(H):
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            S = kh[h, c0:c1] @ kh[h, c0:c1].T
            S.fill_diagonal_(0.0)
            for i in range(c1 - c0):
                hits = [j for j in range(c1 - c0) if S[i, j] > threshold]
                S[i, max(hits) if hits else 0] = 0.0
            out[h, c0:c1] = S.mean(dim=0)
        out[h] = torch.softmax(out[h], dim=-1)
    return out


def _rel_err(a, b):
    return ((a.double() - b.double()).abs() / b.double().abs()).max().item()


@pytest.mark.parametrize("kind", ["random", "realistic"])
@pytest.mark.parametrize("n", [1, 2, 257, 3000])
def test_exact_and_tiled_equal_reference(kind, n):
    keys = synthetic_keys(2, n, 32, kind=kind, seed=n)  # d=32: random keys have hits at all distances
    ref = rkv_redundancy(keys, method="reference", row_tile=333)
    assert ref.shape == (2, n) and ref.dtype == torch.float32
    torch.testing.assert_close(ref.sum(dim=-1), torch.ones(2))
    k = n // 2
    ref_keep = keep_top_scores(-ref.mean(dim=0), k)  # the least redundant half
    runs = [("exact", t) for t in EXACT_TILES] + [("tiled", t) for t in TILED_TILES] + (SHORT_ONLY if n < 1000 else [])
    for method, tiles in runs:
        red = rkv_redundancy(keys, method=method, **tiles)
        assert _rel_err(red, ref) < 1e-5, (method, tiles)
        assert torch.equal(keep_top_scores(-red.mean(dim=0), k), ref_keep), (method, tiles)


@pytest.mark.parametrize("kind", ["random", "realistic"])
def test_kept_sets_of_full_rkv_are_identical_across_exact_methods(kind):
    T, H, d, hq = 3000, 2, 32, 4
    keys = synthetic_keys(H, T, d, kind=kind, seed=7)  # [H, T, d]
    kv = torch.stack([keys.transpose(0, 1).reshape(T, H * d), torch.randn(T, H * d)])[:, None]  # [2, 1, T, D]
    q = torch.randn(1, 16, hq * d, generator=torch.Generator().manual_seed(1))
    ref = rkv_keep(kv, q, 0.5, head_dim=d, redundancy="reference")
    assert ref.numel() == 1500
    for method, tiles in [("exact", {"col_block": 97}), ("tiled", {"row_tile": 700, "col_block": 333})]:
        assert torch.equal(rkv_keep(kv, q, 0.5, head_dim=d, redundancy=method, **tiles), ref), method


def test_every_method_matches_the_definition_in_float64():
    g = torch.Generator().manual_seed(0)
    for trial in range(24):
        n, d = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        keys = torch.randn(2, n, d, generator=g)
        if n > 3:  # a zero key and an exact duplicate in every head
            keys[:, 1] = 0.0
            keys[:, n // 2] = keys[:, 0]
        threshold = (0.5, 0.0, -0.3, 0.9)[trial % 4]  # negative: the zero diagonal itself counts as a hit
        want = _brute_force(keys, threshold)
        tiles = {"reference": {"row_tile": 7}, "exact": {"col_block": 5, "first_block": 2},
                 "tiled": {"row_tile": 6, "col_block": 4, "first_block": 3}, "buffered": {"chunk_size": 64}}
        for method in RKV_METHODS:
            assert _rel_err(rkv_redundancy(keys, method=method, threshold=threshold, **tiles[method]), want) < 1e-5


def test_tiled_is_bit_identical_on_repeat():
    keys = synthetic_keys(4, 700, 32, kind="random", seed=3)
    first = rkv_redundancy(keys, method="tiled", row_tile=300, col_block=128)
    for _ in range(2):
        assert torch.equal(rkv_redundancy(keys, method="tiled", row_tile=300, col_block=128), first)


@pytest.mark.parametrize("method", RKV_METHODS)
def test_identical_zero_and_orthogonal_keys(method):
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([-4.0, 3.0])  # b is orthogonal to a
    keys = torch.stack([a, a, a, torch.zeros(2), b])[None]  # [H=1, n=5, d=2]
    red = rkv_redundancy(keys, method=method, **({"chunk_size": 3} if method == "buffered" else {}))[0]
    assert not torch.isnan(red).any()
    if method == "buffered":  # chunks [a a a] [0 b]: same ordering inside the first chunk
        assert red[2] < red[1] < red[0] and red[3] == red[4]
        return
    # By hand: S has 1 between the copies 0,1,2 and 0 elsewhere. Rightmost hits: row 0 -> 2, row 1 -> 2,
    # row 2 -> 1; rows 3 (zero key) and 4 (orthogonal) have none and retain column 0 (S = 0 there).
    # Column sums after removing them: [2, 1, 0, 0, 0]; R = softmax(sums / 5).
    e = [math.exp(s / 5) for s in (2, 1, 0, 0, 0)]
    torch.testing.assert_close(red, torch.tensor([x / sum(e) for x in e]), atol=1e-6, rtol=1e-6)
    assert red[2] < red[1] < red[0]  # the newest copy is the least redundant of the three
    assert red[4] == red[3]  # the orthogonal key is exactly as redundant as the zero key


def test_buffered_with_large_chunks_equals_exact_and_small_chunks_follow_the_definition():
    for kind in ("random", "realistic"):
        keys = synthetic_keys(2, 700, 32, kind=kind, seed=5)
        exact = rkv_redundancy(keys, method="exact")
        for chunk in (700, 701, 4096):
            assert _rel_err(rkv_redundancy(keys, method="buffered", chunk_size=chunk), exact) < 1e-5
    keys = synthetic_keys(2, 70, 4, kind="random", seed=6)
    got = rkv_redundancy(keys, method="buffered", chunk_size=32, col_block=9, first_block=2)
    assert _rel_err(got, _brute_force(keys, chunk=32)) < 1e-5


def test_batch_of_two_requests_gets_its_own_redundancy_each():
    k1 = synthetic_keys(2, 300, 16, kind="realistic", seed=1)
    k2 = synthetic_keys(2, 300, 16, kind="random", seed=2)
    for method in RKV_METHODS:
        both = rkv_redundancy(torch.stack([k1, k2]), method=method)  # [B=2, H, n, d] -> [2, H, n]
        assert both.shape == (2, 2, 300)
        torch.testing.assert_close(both[0], rkv_redundancy(k1, method=method), atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(both[1], rkv_redundancy(k2, method=method), atol=1e-7, rtol=1e-6)
        assert not torch.allclose(both[0], both[1])


def _hand_example():
    """1 layer, 1 KV head, 2 query heads, d=2, T=5, window 1.

    Keys [1,0], [1,0], [1,1], [0,1] and the window's [1,0]. Query head 0 is [x, 0], head 1 [0, y] with
    x = sqrt(2) ln 2, y = sqrt(2) ln 3, so the GQA-max logits over the four earlier keys are
    [ln 2, ln 2, ln 3, ln 3] and the importance is softmax = [2, 2, 3, 3] / 10.
    Cosines (c = 1/sqrt(2)): copies of [1,0] at 0, 1, 4 are 1 to each other, [1,1] is c to every other
    key, [0,1] is 0 to the copies. Rightmost hits above 0.5: rows 0, 1, 2 -> 4; rows 3, 4 -> 2. Column sums
    after zeroing those: [2 + c, 2 + c, 2c, c, 0]; R = softmax(sums / 5).
    """
    keys = torch.tensor([[1.0, 0], [1, 0], [1, 1], [0, 1], [1, 0]])
    kv = torch.stack([keys, torch.randn(5, 2)])[:, None]  # [2, L=1, T=5, D=2]
    x, y = math.sqrt(2) * math.log(2), math.sqrt(2) * math.log(3)
    q = torch.tensor([[[x, 0.0, 0.0, y]]])  # [L=1, Tq=1, Hq*d=4]
    c = math.sqrt(0.5)
    e = [math.exp(s / 5) for s in (2 + c, 2 + c, 2 * c, c, 0.0)]
    red = [v / sum(e) for v in e]
    imp = [0.2, 0.2, 0.3, 0.3]
    return kv, q, red, imp


def test_rkv_scores_match_hand_computation():
    kv, q, red, imp = _hand_example()
    for method in RKV_METHODS:
        torch.testing.assert_close(rkv_redundancy(kv[0, 0][None], method=method)[0], torch.tensor(red),
                                   atol=1e-6, rtol=0)
    z = torch.tensor([0.25 * i - 0.75 * r for i, r in zip(imp, red)])  # ≈ [-.1364, -.1364, -.0689, -.0499]
    s = rkv_scores(kv, q, head_dim=2, window=1, kernel_size=1)
    torch.testing.assert_close(s, z, atol=1e-6, rtol=0)
    # max-pool 3 spreads importance [.2, .2, .3, .3] -> [.2, .3, .3, .3]
    pooled = torch.tensor([0.25 * i - 0.75 * r for i, r in zip([0.2, 0.3, 0.3, 0.3], red)])
    torch.testing.assert_close(rkv_scores(kv, q, head_dim=2, window=1, kernel_size=3), pooled, atol=1e-6, rtol=0)
    # other mix: lambda = 1 is importance only
    torch.testing.assert_close(rkv_scores(kv, q, head_dim=2, window=1, kernel_size=1, mix_lambda=1.0),
                               torch.tensor(imp), atol=1e-6, rtol=0)
    # layers are summed: two copies of the layer give twice the score
    kv2, q2 = torch.cat([kv, kv], dim=1), torch.cat([q, q], dim=0)
    torch.testing.assert_close(rkv_scores(kv2, q2, head_dim=2, window=1, kernel_size=1), 2 * z, atol=1e-6, rtol=0)
    # keep 3 of 5 = the window + tokens 2, 3; keep 4 adds the earlier of the tied tokens 0, 1
    assert rkv_keep(kv, q, 0.4, head_dim=2, window=1, kernel_size=1).tolist() == [2, 3, 4]
    assert rkv_keep(kv, q, 0.2, head_dim=2, window=1, kernel_size=1).tolist() == [0, 2, 3, 4]


def test_bf16_and_zero_keys_give_finite_scores():
    kv, q, _, _ = _hand_example()
    kv = kv.clone()
    kv[0, 0, 1] = 0.0  # a zero-norm key
    for dtype in (torch.float32, torch.bfloat16):
        s = rkv_scores(kv.to(dtype), q.to(dtype), head_dim=2, window=1, kernel_size=1)
        assert s.dtype == torch.float32 and torch.isfinite(s).all()


def test_short_prompts_and_bad_inputs():
    w = 4
    q = torch.randn(1, w, 8)
    kv = torch.randn(2, 1, w, 8)
    assert rkv_keep(kv, q, 0.5, head_dim=4, window=w).tolist() == [0, 1, 2, 3]
    assert rkv_scores(kv, q, head_dim=4, window=w).shape == (0,)
    kv = torch.randn(2, 1, 10, 8)
    with pytest.raises(ValueError, match="R-KV needs the query"):
        rkv_scores(kv, None, head_dim=4, window=w)
    with pytest.raises(ValueError, match="unknown redundancy method"):
        rkv_scores(kv, q, head_dim=4, window=w, redundancy="fast")
    with pytest.raises(ValueError, match="takes"):
        rkv_redundancy(torch.randn(1, 5, 4), method="exact", chunk_size=2)
    with pytest.raises(ValueError, match="positive integer"):
        rkv_redundancy(torch.randn(1, 5, 4), method="tiled", row_tile=0)
    with pytest.raises(ValueError, match="eps"):
        rkv_redundancy(torch.randn(1, 5, 4), eps=0.0)
    with pytest.raises(ValueError, match="mix_lambda"):
        rkv_scores(kv, q, head_dim=4, window=w, mix_lambda=1.5)
    with pytest.raises(ValueError, match=r"\[H, n, d\]"):
        rkv_redundancy(torch.randn(5, 4))


def test_peak_memory_counts_live_tensor_bytes():
    def f():
        a = torch.ones(1024, 256)  # 1 MiB
        b = torch.ones(1024, 256)  # 1 MiB, both alive
        del a
        return b.sum()

    _, peak = peak_memory(f)
    assert 2 * 2**20 <= peak < 2 * 2**20 + 4096


def _engine(tiny, **kw):
    model, tok = tiny
    return HFEngine(model, tokenizer=tok, progress=False, **kw)


def test_rkv_drop_fn_end_to_end_per_request(tiny, sample_ids):
    model, _ = tiny
    eng = _engine(tiny, query_window=16)
    eng.prefill(sample_ids)
    fn = make_drop_fn("rkv", drop_ratio=0.5, model_config=model.config, redundancy="tiled", row_tile=50)
    keeps = [fn.keep_indices(eng.tensors(i), eng.tokens(i)) for i in range(3)]
    for i, ids in enumerate(sample_ids):  # each request of the batch scored on its own cache
        alone = _engine(tiny, query_window=16)
        alone.prefill([ids])
        assert torch.equal(fn.keep_indices(alone.tensors(0), alone.tokens(0)), keeps[i])
        assert set(range(len(ids) - 16, len(ids))) <= set(keeps[i].tolist())
        assert keeps[i].numel() == round(len(ids) * 0.5)
    exact = make_drop_fn("rkv", drop_ratio=0.5, model_config=model.config)
    assert all(kept_agreement(exact.keep_indices(eng.tensors(i), eng.tokens(i)), keeps[i]) == 1.0 for i in range(3))

    table = compare_redundancy_methods(eng.tensors(2), eng.tokens(2), drop_ratio=0.5, model_config=model.config)
    assert list(table.index) == list(RKV_METHODS)
    assert table.loc[["reference", "exact", "tiled"], "same_as_exact"].all()
    assert (table["score_peak_mib"] > 0).all() and (table["rerotate_s"] > 0).all()

    timed = fn.timed()
    eng.modify(timed)
    assert timed.split()["requests"] == 3 and timed.split()["score_s"] > 0
    assert [eng.tokens(i) for i in range(3)] == [[ids[j] for j in k.tolist()] for ids, k in zip(sample_ids, keeps)]
    assert all(len(o.output_ids) == 3 for o in eng.decode(max_tokens=3))


def test_rkv_drop_fn_errors(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="unknown parameters"):
        make_drop_fn("rkv", model_config=model.config, pooling="avg")
    with pytest.raises(ValueError, match="unknown redundancy method"):
        make_drop_fn("rkv", model_config=model.config, redundancy="fast")
    with pytest.raises(ValueError, match="takes"):
        make_drop_fn("rkv", model_config=model.config, redundancy="exact", chunk_size=64)
    with pytest.raises(ValueError, match="model_config"):
        make_drop_fn("rkv", rerotate=False)
    fn = make_drop_fn("rkv", model_config=model.config)
    kv = torch.randn(2, 2, 40, 64)
    with pytest.raises(ValueError, match="R-KV needs the query"):
        fn({CacheKind.KV: kv}, list(range(40)))


@pytest.mark.parametrize("params,msg", [
    ({"mix_lambda": 2}, ("mix_lambda must lie in [0, 1] (the weight of importance against redundancy in "
                        "Z = λ·I − (1 − λ)·R), got 2")),
    ({"mix_lambda": -0.1}, ("mix_lambda must lie in [0, 1] (the weight of importance against redundancy in "
                           "Z = λ·I − (1 − λ)·R), got -0.1")),
    ({"threshold": -1}, ("threshold must lie in (-1, 1]: it is the cosine similarity above which two keys count as "
                        "near-duplicates, so at -1 or below every pair would (1 = none), got -1")),
    ({"threshold": 1.5}, ("threshold must lie in (-1, 1]: it is the cosine similarity above which two keys count as "
                         "near-duplicates, so at -1 or below every pair would (1 = none), got 1.5")),
    ({"window": 0}, "window must be a positive integer, got 0"),
    ({"kernel_size": 4}, "kernel_size must be an odd number >= 1 (1 = no pooling), got 4"),
    ({"eps": 0}, "eps must be a number > 0 (it keeps zero-norm keys from dividing by zero), got 0"),
])
def test_rkv_params_are_checked_when_the_drop_fn_is_built(tiny, params, msg):
    from tdutils.policies.rkv import RKVParams

    model, _ = tiny
    with pytest.raises(ValueError) as e:
        make_drop_fn("rkv", drop_ratio=0.5, model_config=model.config, **params)
    assert str(e.value) == msg
    with pytest.raises(ValueError) as e:
        RKVParams(**params)
    assert str(e.value) == msg
    assert RKVParams(mix_lambda=0, threshold=1).mix_lambda == 0  # the closed ends are fine
