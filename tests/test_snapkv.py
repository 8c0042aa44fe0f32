"""SnapKV scores (hand-computed), window protection, and query capture in the hf engine."""

import pytest
import torch

from tdutils import CacheKind, make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.policies.scoring import window_attention
from tdutils.policies.snapkv import snapkv_keep, snapkv_scores


def _gqa_example():
    """1 layer, 4 query heads, 2 KV heads, d=2, window 1, three earlier tokens (issue 4)."""
    head0 = torch.tensor([[5.0, 0], [0, 5], [0, 0], [0, 0]])  # KV head 0 keys of tokens 0..3
    head1 = torch.tensor([[0.0, 0], [5, 0], [0, 5], [0, 0]])  # KV head 1
    keys = torch.cat([head0, head1], dim=1)  # [T=4, H*d=4]
    kv = torch.stack([keys, torch.randn(4, 4)])[:, None]  # [2, L=1, T=4, D=4]
    q = torch.tensor([[1.0, 0, 1, 0, 0, 1, 0, 1]])[None]  # [L=1, Tq=1, Hq*d=8]: heads 0,1 [1,0]; 2,3 [0,1]
    return kv, q


def test_gqa_grouping_matches_hand_computation():
    kv, q = _gqa_example()
    s = snapkv_scores(kv, q, head_dim=2, window=1, kernel_size=1)
    torch.testing.assert_close(s, torch.tensor([0.4732, 0.0268, 0.4732]), atol=1e-4, rtol=0)
    # keep 3 of 4 tokens: the window token 3 plus the two best earlier tokens 0 and 2
    assert snapkv_keep(kv, q, 0.25, head_dim=2, window=1, kernel_size=1).tolist() == [0, 2, 3]
    # max over the group gives the same here (both heads of a group have the same query)
    torch.testing.assert_close(snapkv_scores(kv, q, head_dim=2, window=1, kernel_size=1, gqa_reduce="max"), s)


def test_pooling_spreads_votes_to_neighbours():
    kv, q = _gqa_example()
    s = snapkv_scores(kv, q, head_dim=2, window=1, kernel_size=3, pooling="avg")
    raw = torch.tensor([0.9196, 0.0268, 0.0268, 0.0268, 0.0268, 0.9196])  # per KV head before pooling
    h0 = torch.tensor([(0 + raw[0] + raw[1]) / 3, (raw[0] + raw[1] + raw[2]) / 3, (raw[1] + raw[2]) / 3])
    h1 = torch.tensor([(raw[3] + raw[4]) / 3, (raw[3] + raw[4] + raw[5]) / 3, (raw[4] + raw[5]) / 3])
    torch.testing.assert_close(s, (h0 + h1) / 2, atol=1e-4, rtol=0)
    smax = snapkv_scores(kv, q, head_dim=2, window=1, kernel_size=3, pooling="max")
    # head 0 [.9196, .0268, .0268] -> [.9196, .9196, .0268]; head 1 mirrored; mean over heads
    torch.testing.assert_close(smax, torch.tensor([0.4732, 0.9196, 0.4732]), atol=1e-4, rtol=0)


def test_window_wins_ties_and_ties_go_to_earlier_tokens():
    T, w = 10, 3
    kv = torch.zeros(2, 2, T, 8)  # all keys zero: every earlier token gets the same vote
    q = torch.randn(2, w, 16)
    keep = snapkv_keep(kv, q, 0.5, head_dim=4, window=w, kernel_size=1)
    assert keep.tolist() == [0, 1, 7, 8, 9]


def test_short_prompts_are_returned_unchanged_or_window_only():
    w = 4
    q = torch.randn(1, w, 8)
    kv = torch.randn(2, 1, w, 8)
    assert snapkv_keep(kv, q, 0.5, head_dim=4, window=w).tolist() == [0, 1, 2, 3]  # n == w
    kv = torch.randn(2, 1, w + 1, 8)
    assert snapkv_scores(kv, q, head_dim=4, window=w).shape == (1,)
    # n == w + 1 at ratio 0.5 keeps round(2.5) = 2 < w, raised to the window
    assert snapkv_keep(kv, q, 0.5, head_dim=4, window=w).tolist() == [1, 2, 3, 4]


def test_bf16_keys_are_ranked_in_fp32():
    # q.k is 1.0 for token 0 and 1.00390625 for token 1: equal once rounded to bf16, not in fp32.
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.00390625], [0.0, 0.0]], dtype=torch.bfloat16)
    assert torch.tensor(1.00390625).to(torch.bfloat16) == torch.tensor(1.0).to(torch.bfloat16)
    kv = torch.stack([keys, keys])[:, None]  # [2, 1, 3, 2]
    q = torch.tensor([[[1.0, 1.0]]], dtype=torch.bfloat16)
    s = snapkv_scores(kv, q, head_dim=2, window=1, kernel_size=1)
    assert s.dtype == torch.float32 and s[1] > s[0]
    assert snapkv_keep(kv, q, 1 / 3, head_dim=2, window=1, kernel_size=1).tolist() == [1, 2]


def test_bad_inputs_raise_clear_errors():
    kv, q = _gqa_example()
    with pytest.raises(ValueError, match="needs the query"):
        snapkv_scores(kv, None, head_dim=2, window=1)
    with pytest.raises(ValueError, match="query holds 1 rows but the observation window is 2"):
        snapkv_scores(kv, q, head_dim=2, window=2)
    with pytest.raises(ValueError, match="odd"):
        snapkv_scores(kv, q, head_dim=2, window=1, kernel_size=4)
    with pytest.raises(ValueError, match="pooling"):
        snapkv_scores(kv, q, head_dim=2, window=1, pooling="sum")
    with pytest.raises(ValueError, match="gqa_reduce"):
        snapkv_scores(kv, q, head_dim=2, window=1, gqa_reduce="sum")
    with pytest.raises(ValueError, match="multiple"):
        snapkv_scores(kv, q[:, :, :6], head_dim=2, window=1)
    # LMCache's [1, L, Tq, Hq*d] query layout is accepted
    torch.testing.assert_close(snapkv_scores(kv, q[None], head_dim=2, window=1, kernel_size=1),
                               snapkv_scores(kv, q, head_dim=2, window=1, kernel_size=1))


def _engine(tiny, **kw):
    model, tok = tiny
    return HFEngine(model, tokenizer=tok, progress=False, **kw)


def test_captured_queries_in_a_ragged_batch_equal_prefilling_alone(tiny, sample_ids):
    eng = _engine(tiny, query_window=16)
    eng.prefill(sample_ids)
    for i, ids in enumerate(sample_ids):
        q = eng.query(i)
        assert q.shape == (2, 16, 4 * 32)
        alone = _engine(tiny, query_window=16)
        alone.prefill([ids])
        torch.testing.assert_close(q, alone.query(0), atol=1e-5, rtol=0)
    # query_window=None captures every token; a request shorter than the window gets all of its rows
    eng = _engine(tiny, query_window=None)
    eng.prefill(sample_ids)
    assert [eng.query(i).shape[1] for i in range(3)] == [len(x) for x in sample_ids]
    eng = _engine(tiny, query_window=100)
    eng.prefill(sample_ids)
    assert [eng.query(i).shape[1] for i in range(3)] == [100, 75, 100]


def test_captured_queries_reproduce_the_models_attention(tiny, sample_ids):
    model, _ = tiny
    assert model.config._attn_implementation.endswith("eager")
    ids = sample_ids[1]
    eng = _engine(tiny, query_window=8)
    eng.prefill([ids])
    kv, q = eng.kv(0), eng.query(0)
    with torch.inference_mode():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # L x [1, Hq, T, T]
    for layer in range(2):
        mine = window_attention(kv[0, layer], q[layer], n_kv_heads=2)  # [Hq, 8, T]
        torch.testing.assert_close(mine, att[layer][0, :, -8:, :].float(), atol=1e-5, rtol=0)


def test_snapkv_drop_end_to_end_keeps_the_window(tiny, sample_ids):
    model, _ = tiny
    eng = _engine(tiny, query_window=64)
    eng.prefill(sample_ids)
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=model.config, window=32)
    keeps = [fn.keep_indices(eng.tensors(i), eng.tokens(i)) for i in range(3)]
    eng.modify(fn)
    for i, (ids, keep) in enumerate(zip(sample_ids, keeps)):
        T = len(ids)
        assert set(range(T - 32, T)) <= set(keep.tolist())
        assert keep.numel() == max(round(T * 0.5), 32) and eng.tokens(i) == [ids[j] for j in keep.tolist()]
        assert eng.query(i) is None  # the captured rows described the unedited prompt
    outs = eng.decode(max_tokens=4)
    assert all(len(o.output_ids) == 4 for o in outs)


def test_snapkv_without_captured_queries_is_reported(tiny, sample_ids):
    model, _ = tiny
    eng = _engine(tiny, query_window=0)
    eng.prefill(sample_ids)
    assert CacheKind.QUERY not in eng.tensors(0)
    with pytest.raises(Exception, match="needs the query tensor"):
        eng.modify(make_drop_fn("snapkv", drop_ratio=0.5, model_config=model.config))


def test_check_query_flags_mixed_up_rows(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    assert eng.check_query(0) < 1e-5 and eng.check_query(2) < 1e-5
    eng.requests[0].query = eng.requests[2].query.clone()  # another request's rows: what a batching bug does
    assert eng.check_query(0) > 1e-2
    assert eng.model.config._attn_implementation == "tdutils_capture_eager"
