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
def test_masked_gqa_forward_is_transformers_sdpa_without_repeat_kv(dtype, kind):
    """A masked multi-token GQA forward (prefill of unequal prompts, extend) runs sdpa with `enable_gqa`: the same
    numbers transformers' sdpa gives after copying each key and value `g` times."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(3)
    B, H, g, M, T, d = 2, 2, 3, 5, 12, 16
    q = torch.randn(B, H * g, M, d, generator=gen).to(dtype)
    k, v = (torch.randn(B, H, T, d, generator=gen).to(dtype) for _ in range(2))
    keep = torch.rand(B, 1, M, T, generator=gen) > 0.3
    keep[..., -1] = True
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min)
    layer = _Layer().eval()
    assert attention._masked_gqa_fits(layer, q, k, mask, {"scaling": 0.25})
    assert not attention._masked_gqa_fits(layer, q, k, None, {})  # no mask: transformers uses enable_gqa itself
    assert not attention._masked_gqa_fits(layer, q, k, mask, {"softcap": 30.0})
    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)  # [B, M, Hq, d]
    out = attention._masked_gqa_sdpa(q, k, v, mask, 0.25)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


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
