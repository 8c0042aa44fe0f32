"""`tdutils.attention.decode_attention`, the `hf` engine's decode-step attention over slot store views: what `sdpa`
computes (GQA, boolean / additive / per-head masks, strided keys and values), and the engine routes its decode
steps, and only those, through it."""

import pytest
import torch
import torch.nn.functional as F

from tdutils import attention
from tdutils.attention import decode_attention, slot_decode
from tdutils.engines.hf import HFEngine


def _inputs(dtype, B=3, H=2, g=3, W=40, T=33, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    store_k = torch.randn(B, H, W, d, generator=gen).to(dtype)  # a slot store layer: [S, H_kv, W, d]
    store_v = torch.randn(B, H, W, d, generator=gen).to(dtype)
    q = torch.randn(B, H * g, 1, d, generator=gen).to(dtype)
    return q, store_k[:, :, :T], store_v[:, :, :T], g  # the views a step attends over


def _sdpa(q, k, v, g, mask, scale=None):
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)  # [B, 1, Hq, d]


@pytest.mark.parametrize("kind", ["none", "bool", "additive", "per_head"])
def test_decode_attention_is_sdpa(kind):
    q, k, v, g = _inputs(torch.float32)
    B, Hq, T = q.shape[0], q.shape[1], k.shape[2]
    keep = torch.rand(B, Hq if kind == "per_head" else 1, 1, T, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[..., -1] = True  # every row attends somewhere (the token written this step)
    mask = {"none": None, "bool": keep, "per_head": keep,
            "additive": torch.zeros(keep.shape).masked_fill_(~keep, torch.finfo(torch.float32).min)}[kind]
    out = decode_attention(q, k, v, mask, 0.3)
    assert out.shape == (B, 1, Hq, q.shape[-1]) and out.dtype == torch.float32
    torch.testing.assert_close(out, _sdpa(q, k, v, g, mask, 0.3), rtol=0, atol=2e-6)


def test_decode_attention_in_bf16_is_within_bf16_rounding_of_fp32():
    q, k, v, g = _inputs(torch.bfloat16)
    out = decode_attention(q, k, v, None)
    ref = _sdpa(q.float(), k.float(), v.float(), g, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2 ** -6)  # one bf16 ulp of values of size ~1


def test_half_precision_reads_whole_slot_rows_and_weighs_the_columns_past_the_view_zero():
    q, k, v, _ = _inputs(torch.bfloat16)
    T = k.shape[2]
    k._base[:, :, T:], v._base[:, :, T:] = 3e4, -3e4  # what lies past the view: never seen
    assert attention._whole_rows(k, T).shape == (k.shape[0] * k.shape[1], k._base.shape[2], k.shape[3])
    assert attention._whole_rows(k.float(), T) is None and attention._whole_rows(k.contiguous(), T) is None
    out = decode_attention(q, k, v, None)
    torch.testing.assert_close(out, decode_attention(q, k.contiguous(), v.contiguous(), None), rtol=0, atol=2 ** -7)


def test_the_engine_runs_decode_steps_and_only_them_through_it(monkeypatch):
    calls = []
    real = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    # transformers' forward (the lean step calls the kernel itself: tests/test_lean_step.py)
    eng = HFEngine("tiny-qwen3", dtype="float32", progress=False, lean_decode=False)
    eng.prefill([[5, 6, 7, 8, 9], [10, 11, 12]])
    assert calls == []  # prefill: sdpa
    eng.decode(max_tokens=3)
    layers = eng.facts.num_layers
    assert len(calls) == 3 * layers and {s[2] for s in calls} == {1}
    with slot_decode():
        assert attention._slot_decode
    assert not attention._slot_decode


class _Layer(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("groups", [3, 1])
def test_masked_forward_is_transformers_sdpa_without_repeat_kv(dtype, kind, groups):
    """A masked multi-token GQA forward (prefill of unequal prompts, extend) runs sdpa with `enable_gqa`: the same
    numbers transformers' sdpa gives after copying each key and value `g` times."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(3)
    B, H, g, M, T, d = 2, 2, groups, 5, 12, 16
    q = torch.randn(B, H * g, M, d, generator=gen).to(dtype)
    k, v = (torch.randn(B, H, T, d, generator=gen).to(dtype) for _ in range(2))
    keep = torch.rand(B, 1, M, T, generator=gen) > 0.3
    keep[..., -1] = True
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min)
    layer = _Layer().eval()
    layer.num_key_value_groups = groups
    assert attention._masked_fits(layer, q, k, mask, {"scaling": 0.25})
    assert not attention._masked_fits(layer, q, k, None, {})  # no mask: transformers uses enable_gqa itself
    assert not attention._masked_fits(layer, q, k, mask, {"softcap": 30.0})
    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)  # [B, M, Hq, d]
    out = attention._masked_sdpa(q, k, v, mask, 0.25)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _sliding(T: int, window: int) -> torch.Tensor:
    i = torch.arange(T)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)  # [T, T]: key j visible to query i


def test_key_spans_of_a_sliding_window_mask_by_hand():
    mask = _sliding(1024, 300)[None, None]  # [1, 1, 1024, 1024]
    # rows 0-255 see keys 0-255; rows 256-511 from max(0, 256 - 299) = 0 to 511; rows 512-767 from 213; rows 768-
    # 1023 from 469
    assert attention._key_spans(mask, 256) == [(0, 256, 0, 256), (256, 512, 0, 512), (512, 768, 213, 768),
                                               (768, 1024, 469, 1024)]
    assert attention._key_spans(mask[..., :400, :400], 256) is None  # shorter than two blocks: one sdpa call
    assert attention._key_spans(torch.ones(1, 1, 1024, 1024, dtype=torch.bool), 256) is None  # no band: no saving
    holes = mask.clone()
    holes[..., 256:512, :] = False
    assert attention._key_spans(holes, 256) is None  # a block that sees no key: left to sdpa as a whole
    additive = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    assert attention._key_spans(additive, 256) == attention._key_spans(mask, 256)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_banded_masked_forward_in_blocks_matches_one_sdpa_call(kind):
    """Gemma 3's sliding layers over a long prefill with a left-padded row: the blocked forward sums over the same
    visible keys as one masked `sdpa` call (fp32: equal up to the order of the sums)."""
    gen = torch.Generator().manual_seed(5)
    B, H, g, T, d = 2, 1, 4, 1100, 32
    q = torch.randn(B, H * g, T, d, generator=gen)
    k, v = (torch.randn(B, H, T, d, generator=gen) for _ in range(2))
    keep = _sliding(T, 300)[None, None].repeat(B, 1, 1, 1)  # [B, 1, T, T]
    keep[1, :, :, :40] = False  # row 1: 40 tokens of left padding, each padding query sees only itself
    keep[1, :, torch.arange(40), torch.arange(40)] = True
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill_(~keep, torch.finfo(torch.float32).min)
    assert attention._key_spans(mask) is not None
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    out = attention._masked_sdpa(q, k, v, mask, 0.2)  # [B, T, Hq, d]
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_the_wide_cache_writes_in_place_and_refuses_overflow():
    from tdutils.engines.kvstore import wide_cache

    keys, values = torch.zeros(2, 1, 1, 5, 4), torch.zeros(2, 1, 1, 5, 4)  # [L, B, H_kv, C + M, d], C = 3
    cache = wide_cache(keys, values, 3)
    new = torch.ones(1, 1, 2, 4)
    k, _ = cache.update(new, 2 * new, 0)
    assert k.shape == (1, 1, 5, 4) and k.data_ptr() == keys[0].data_ptr()  # a view: nothing cached was copied
    assert torch.equal(keys[0, 0, 0, 3:], torch.ones(2, 4)) and torch.equal(values[0, 0, 0, 3:], 2 * torch.ones(2, 4))
    assert cache.get_seq_length(1) == 3 and cache.layers[0].get_seq_length() == 5
    with pytest.raises(ValueError, match="holds 5 columns; 5 are filled and 2 more"):
        cache.update(new, new, 0)
