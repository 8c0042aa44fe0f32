import math

import pytest
import torch

from tdutils.policies import middle_chunk_keep, random_keep
from tdutils.selection import keep_count, keep_top_scores, protected_mask


@pytest.mark.parametrize("n,r,k", [
    (10, 0.0, 10), (10, 1.0, 0), (10, 0.5, 5), (0, 0.5, 0), (1, 0.5, 0),  # round(0.5) = 0 (half to even)
    (3, 0.5, 2), (5, 0.5, 2), (7, 0.5, 4), (1, 0.0, 1), (1024, 0.25, 768), (1000, 0.75, 250),
])
def test_keep_count_rounds_half_to_even(n, r, k):
    assert keep_count(n, r) == k


@pytest.mark.parametrize("bad", [-0.01, 1.5, math.nan, math.inf, "half", None])
def test_keep_count_rejects_ratio_outside_unit_interval(bad):
    with pytest.raises(ValueError, match="drop_ratio"):
        keep_count(10, bad)


def test_keep_count_rejects_negative_n():
    with pytest.raises(ValueError, match="non-negative"):
        keep_count(-1, 0.5)


def test_protected_mask_marks_sinks_and_window():
    m = protected_mask(10, n_sink=2, window=3)
    assert m.tolist() == [True, True, False, False, False, False, False, True, True, True]
    assert protected_mask(3, n_sink=4, window=16).all()


def test_keep_top_scores_protected_win_ties_and_ties_go_to_earlier():
    scores = torch.tensor([1.0, 5.0, 5.0, 0.0, 9.0])
    prot = torch.tensor([False, False, False, True, False])
    # k=3: protected 3, then 9.0 (index 4), then the tie 5.0/5.0 goes to index 1.
    assert keep_top_scores(scores, 3, prot).tolist() == [1, 3, 4]
    # k smaller than the protected count is raised to it.
    assert keep_top_scores(scores, 0, prot).tolist() == [3]


def test_random_keep_is_seeded_and_deterministic():
    a = random_keep(1000, 0.5, seed=7)
    b = random_keep(1000, 0.5, seed=7)
    c = random_keep(1000, 0.5, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("n,r", [(1000, 0.5), (100, 0.25), (64, 0.9), (37, 0.5), (1000, 1.0)])
def test_random_keep_exact_count_sorted_unique_and_protected(n, r):
    keep = random_keep(n, r, seed=1, n_sink=4, window=16)
    expected = max(keep_count(n, r), min(n, 4 + 16))
    assert keep.numel() == expected
    assert torch.equal(keep, torch.sort(keep).values)
    assert keep.unique().numel() == keep.numel()
    kept = set(keep.tolist())
    assert set(range(4)) <= kept  # attention sinks
    assert set(range(n - 16, n)) <= kept  # observation window


def test_random_keep_short_prompt_and_zero_ratio_keep_everything():
    assert random_keep(15, 0.5, n_sink=4, window=16).tolist() == list(range(15))
    assert random_keep(100, 0.0).tolist() == list(range(100))


def test_middle_chunk_keep_drops_centre_of_inner_chunks():
    keep = middle_chunk_keep(1024, 0.5, chunk_size=256)
    dropped = sorted(set(range(1024)) - set(keep.tolist()))
    # chunks 1 and 2 lose their middle 128 tokens: [256+64, 256+192) and [512+64, 512+192)
    assert dropped == list(range(320, 448)) + list(range(576, 704))
    assert keep.numel() == 768
    # a partial last chunk counts as the last chunk and is kept whole
    keep = middle_chunk_keep(600, 0.5, chunk_size=256)
    assert sorted(set(range(600)) - set(keep.tolist())) == list(range(320, 448))
    assert middle_chunk_keep(512, 0.5, chunk_size=256).numel() == 512  # two chunks: nothing to drop


def test_middle_chunk_keep_rejects_bad_args():
    with pytest.raises(ValueError, match="drop_ratio"):
        middle_chunk_keep(100, 2.0)
    with pytest.raises(ValueError, match="chunk_size"):
        middle_chunk_keep(100, 0.5, chunk_size=0)


def test_drop_ratio_one_keeps_the_best_token_when_nothing_is_protected(tiny):
    """At r = 1 the keep count is 0; a cache must keep a token to decode from, so a policy with nothing
    protected (knorm, keydiff, h2o's defaults) keeps its single best-scored token instead of failing."""
    scores = torch.tensor([0.1, 0.7, 0.3, 0.7])
    assert keep_top_scores(scores, 0).tolist() == [1]  # the tie between 1 and 3 goes to the earlier token
    assert keep_top_scores(torch.zeros(0), 0).tolist() == []
    from tdutils import make_drop_fn
    from tdutils.kvcache import CacheKind

    model, _ = tiny  # 2 layers, 2 KV heads and 4 query heads of head_dim 32
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 12, 64, generator=gen)  # [2, L, T, D]
    kv[0, :, 5] *= 0.01  # the smallest key norm in every layer: what KNorm keeps
    tensors = {CacheKind.KV: kv, CacheKind.QUERY: torch.randn(2, 12, 128, generator=gen)}  # [L, T, Hq*d]
    for policy in ("knorm", "keydiff", "h2o"):
        fn = make_drop_fn(policy, drop_ratio=1.0, model_config=model.config, rerotate=False)
        keep = fn.keep_indices(tensors, list(range(12)))
        assert keep.numel() == 1, (policy, keep)
        new_kv, new_tokens = fn(tensors, list(range(12)))
        assert new_kv.shape == (2, 2, 1, 64) and new_tokens == keep.tolist(), policy
    assert make_drop_fn("knorm", drop_ratio=1.0, model_config=model.config,
                        rerotate=False).keep_indices(tensors, list(range(12))).tolist() == [5]


@pytest.mark.parametrize("bad", ["0.5", True, b"0.5", None])
def test_drop_ratio_must_be_a_number_not_a_string_or_bool(bad):
    """`float("0.5")` and `float(True)` would pass: both were accepted (True as a drop ratio of 1.0)."""
    with pytest.raises(ValueError, match=r"drop_ratio must be a number in \[0, 1\], got "):
        keep_count(10, bad)
