"""Tests for tdutils.rope (issue 3): hand-computed vectors, round trips for every rope type and both
layouts, bf16 error bounds, relative-position invariance, config resolution, and equality with
transformers' own rotary embeddings (the model's keys)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace as NS

import pytest
import torch

from tdutils import rope as R
from tdutils.rope import RopeSpec, apply_rope, rerotate_k_cache, rerotate_keys

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # scaled-rope stub configs trigger harmless validation notes


# --------------------------------------------------------------------------------------------------
# specs for every supported rope type (resolved through transformers' own init functions)
# --------------------------------------------------------------------------------------------------

HEAD_DIM = 32


def _scaled_params(rope_type: str) -> dict | None:
    half = HEAD_DIM // 2
    return {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 4.0},
        "dynamic": {"rope_type": "dynamic", "factor": 4.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 2048},
        "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                     "short_factor": [1.0 + 0.05 * i for i in range(half)],
                     "long_factor": [1.5 + 0.25 * i for i in range(half)]},
    }[rope_type]


def _llama_config(rope_type: str, max_pos: int = 16384):
    rp = _scaled_params(rope_type)
    params = {"rope_type": "default", "rope_theta": 5e5} if rp is None else dict(rp, rope_theta=5e5)
    return transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
        intermediate_size=64, num_hidden_layers=1, vocab_size=32, max_position_embeddings=max_pos,
        rope_parameters=params,
    )


def _spec(rope_type: str, layout: str = "neox", seq_len: int | None = None) -> RopeSpec:
    return RopeSpec.from_config(_llama_config(rope_type), layout=layout, seq_len=seq_len)


# --------------------------------------------------------------------------------------------------
# hand-computed vectors (issue 3)
# --------------------------------------------------------------------------------------------------


def _hand_spec(layout: str = "neox") -> RopeSpec:
    # head_dim 8, partial_rotary_factor 0.5 -> rotary_dim 4, theta 1e4 -> inv_freq [1, 0.01]
    return RopeSpec.from_config(NS(head_dim=8, partial_rotary_factor=0.5, rope_theta=1e4), layout=layout)


def test_hand_vector_neox_apply_and_rerotate():
    spec = _hand_spec()
    assert spec.rotary_dim == 4
    torch.testing.assert_close(spec.inv_freq, torch.tensor([1.0, 0.01]), rtol=0, atol=1e-9)
    x = torch.arange(1.0, 9.0)[None]  # [T=1, 8]
    y = apply_rope(x, torch.tensor([3]), spec)
    # (x0, x2) rotated by 3 rad, (x1, x3) by 0.03 rad
    expected_at_3 = torch.tensor([[-1.413353, 1.879118, -2.828857, 4.058191, 5, 6, 7, 8]])
    torch.testing.assert_close(y, expected_at_3, rtol=0, atol=1e-6)
    z = rerotate_keys(y, torch.tensor([3]), torch.tensor([1]), spec)
    expected_at_1 = torch.tensor([[-1.984111, 1.959901, 2.462378, 4.019800, 5, 6, 7, 8]])
    torch.testing.assert_close(z, expected_at_1, rtol=0, atol=1e-6)
    # channels past rotary_dim are bit-identical after both operations
    assert torch.equal(y[:, 4:], x[:, 4:]) and torch.equal(z[:, 4:], x[:, 4:])


def test_hand_vector_gptj_layout():
    spec = _hand_spec("gptj")
    x = torch.arange(1.0, 9.0)[None]
    y = apply_rope(x, torch.tensor([3]), spec)
    # pairs (x0, x1) by 3 rad, (x2, x3) by 0.03 rad: 1cos3-2sin3, 2cos3+1sin3, 3cos.03-4sin.03, 4cos.03+3sin.03
    expected = torch.tensor([[-1.272233, -1.838865, 2.878668, 4.088187, 5, 6, 7, 8]])
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)
    assert torch.equal(y[:, 4:], x[:, 4:])


def test_pass_through_channels_bit_identical_in_bf16():
    spec = _hand_spec()
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(50, 3, 8, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 9000, (50,), generator=g)
    for out in (apply_rope(k, pos, spec), rerotate_keys(k, pos, pos.flip(0), spec)):
        assert out.dtype == torch.bfloat16
        assert torch.equal(out[..., 4:], k[..., 4:])


# --------------------------------------------------------------------------------------------------
# round trips, every rope type and both layouts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("rope_type", list(R.SUPPORTED_ROPE_TYPES))
def test_round_trip_every_type_and_layout(rope_type, layout):
    g = torch.Generator().manual_seed(0)
    t = 256
    old = torch.randint(0, 16000, (t,), generator=g)   # not monotone, far from the new positions
    new = torch.randperm(t, generator=g)
    # dynamic/longrope: frequencies depend on the prefill length, here 16000
    spec = _spec(rope_type, layout, seq_len=16000 if rope_type in ("dynamic", "longrope") else None)
    assert spec.rope_type == rope_type and spec.layout == layout
    k = torch.randn(t, 2, HEAD_DIM, generator=g)
    moved = rerotate_keys(apply_rope(k, old, spec), old, new, spec)
    torch.testing.assert_close(moved, apply_rope(k, new, spec), rtol=0, atol=1e-6)
    # identity when old == new: exactly the input
    k_rot = apply_rope(k, old, spec)
    assert torch.equal(rerotate_keys(k_rot, old, old, spec), k_rot)


def test_identity_is_bit_exact_in_bf16():
    spec = _spec("yarn")
    k = torch.randn(64, 2, HEAD_DIM).to(torch.bfloat16)
    pos = torch.arange(64) * 7
    assert torch.equal(rerotate_keys(k, pos, pos, spec), k)


def test_yarn_rerotation_keeps_key_norms_apply_scales_them():
    spec = _spec("yarn")
    assert spec.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)  # YaRN mscale for factor 4
    k = torch.randn(100, 2, HEAD_DIM, dtype=torch.float32)
    pos = torch.arange(100)
    # apply_rope multiplies cos/sin by attention_scaling, as transformers does
    torch.testing.assert_close(apply_rope(k, pos, spec).norm(dim=-1), k.norm(dim=-1) * spec.attention_scaling)
    # a re-rotation is a pure rotation: norms unchanged
    moved = rerotate_keys(k, pos, pos * 3 + 11, spec)
    torch.testing.assert_close(moved.norm(dim=-1), k.norm(dim=-1), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------------
# bf16 error bounds (issue 3)
# --------------------------------------------------------------------------------------------------


# Two bf16 stores alone: a store rounds x by at most half an ulp <= 2^-8 |x| <= 2^-8 of the norm of x's channel
# pair (which rotations keep); the way back rotates the first store's error (pair norm <= sqrt2 2^-8) and stores
# again, so every error is at most (1 + sqrt2) 2^-8 = 0.00943 of its pair's norm, plus fp32 rounding (~1e-7).
# Measured with fp32 arithmetic: 0.0072-0.0075 (seeds 0-2), so the bound has a margin of 25%; bf16 arithmetic
# measures 0.0153, above it. The mean error of the stores alone is about a quarter ulp: measured 0.00097 for
# std-3 keys; bound 0.002 (a margin of 2x), which bf16 arithmetic (0.0051) also breaks.
STORE_BOUND = (1 + math.sqrt(2)) * 2.0 ** -8
MEAN_BOUND = 0.002


def _bf16_round_trip_error(compute_dtype):
    """(max |error| / pair norm, mean |error|) of a there-and-back re-rotation of std-3 keys stored in bf16."""
    g = torch.Generator().manual_seed(0)
    spec = RopeSpec.from_config(NS(head_dim=128, rope_theta=1e6))
    k = (torch.randn(4096, 128, generator=g) * 3).to(torch.bfloat16)   # [T, head_dim], std 3
    old = torch.randint(0, 16000, (4096,), generator=g)
    new = torch.arange(4096)
    there = rerotate_keys(k, old, new, spec, compute_dtype=compute_dtype)      # bf16 store
    back = rerotate_keys(there, new, old, spec, compute_dtype=compute_dtype)   # bf16 store
    assert there.dtype == back.dtype == torch.bfloat16
    err = (back.float() - k.float()).abs()
    kf = k.float()
    pair_norm = kf[:, :64].hypot(kf[:, 64:]).repeat(1, 2)                     # neox pairs (i, i + 64)
    return (err / pair_norm).max().item(), err.mean().item()


def test_bf16_round_trip_error_bounds_fp32_arithmetic():
    max_ratio, mean_err = _bf16_round_trip_error(torch.float32)
    assert max_ratio <= STORE_BOUND, (max_ratio, STORE_BOUND)
    assert mean_err <= MEAN_BOUND, mean_err


def test_bf16_arithmetic_is_measurably_worse():
    # why the module insists on fp32: the same round trip with arithmetic in bf16 breaks both bounds
    max_ratio, mean_err = _bf16_round_trip_error(torch.bfloat16)
    assert max_ratio > STORE_BOUND and mean_err > MEAN_BOUND, (max_ratio, mean_err)


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_rerotate_k_cache_extra_memory_within_its_documented_bound(kv_heads):
    """The docstring's promise: at most max(3/H, 1/2 + 1/H) of one layer's keys in fp32 beyond the output.

    The bound is the code's own tensor accounting (table building, tables, two chunk temporaries) and the
    profiler counts allocated bytes exactly, so there is no measurement noise to leave room for: measured
    62.5% / 150% / 300% of a layer for H = 8 / 2 / 1, the bound itself.
    """
    from tdutils.profiling import peak_memory

    t, d = 4096, 128  # a quarter layer is between the chunk floor (64 Ki elements) and cap (4 Mi)
    spec = RopeSpec.from_config(NS(head_dim=d, rope_theta=1e6))
    kv = torch.randn(2, 2, t, kv_heads * d, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    old, new = torch.sort(torch.randperm(2 * t, generator=torch.Generator().manual_seed(11))[:t]).values, torch.arange(t)
    out, peak = peak_memory(rerotate_k_cache, kv, old, new, spec)
    extra = peak - out.numel() * out.element_size()
    layer = 4 * t * kv_heads * d
    assert extra <= max(3 / kv_heads, 1 / 2 + 1 / kv_heads) * layer, (extra / layer, kv_heads)


# --------------------------------------------------------------------------------------------------
# relative-position invariance
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("offset", [-300, 200])
def test_relative_position_invariance(layout, offset):
    g = torch.Generator().manual_seed(2)
    spec = RopeSpec.from_config(NS(head_dim=64, rope_theta=1e4, model_type="qwen3"), layout=layout)
    h, t = 4, 300
    # unit vectors so logits are cosines and 1e-5 is a relative tolerance
    q0 = torch.nn.functional.normalize(torch.randn(h, 64, generator=g), dim=-1)         # [H, d]
    k0 = torch.nn.functional.normalize(torch.randn(t, h, 64, generator=g), dim=-1)      # [T, H, d]
    pk = torch.randperm(t, generator=g) + 300      # keys at 300..599 in random order
    pq = torch.tensor([650])                       # query after them
    q = apply_rope(q0[None], pq, spec)[0]          # [H, d]
    k = apply_rope(k0, pk, spec)                   # [T, H, d]
    logits = torch.einsum("hd,thd->th", q, k)
    # shift kept keys (re-rotation) and the query by the same offset
    k_moved = rerotate_keys(k, pk, pk + offset, spec)
    q_moved = rerotate_keys(q[None], pq, pq + offset, spec)[0]
    logits_moved = torch.einsum("hd,thd->th", q_moved, k_moved)
    torch.testing.assert_close(logits_moved, logits, rtol=0, atol=1e-5)
    # a query the model computes directly at the shifted position sees the same logits too
    q_direct = apply_rope(q0[None], pq + offset, spec)[0]
    torch.testing.assert_close(torch.einsum("hd,thd->th", q_direct, k_moved), logits, rtol=0, atol=1e-5)
    # independent reference: fp64 logits from the relative angle (pq - pk) * inv_freq alone
    ref = _fp64_relative_logits(q0, k0, (pq - pk).double(), spec)
    torch.testing.assert_close(logits.double(), ref, rtol=0, atol=1e-5)


def _fp64_relative_logits(q0, k0, rel, spec):
    """q·R(rel·f)k computed from scratch in fp64: sum over pairs of (qa ka + qb kb) cos + (qa kb - qb ka) sin,
    with the sign convention q·k = Σ |q||k| cos(θq - θk), rel = pq - pk."""
    half = spec.rotary_dim // 2
    if spec.layout == "neox":
        qa, qb = q0[..., :half], q0[..., half:spec.rotary_dim]
        ka, kb = k0[..., :half], k0[..., half:spec.rotary_dim]
    else:
        qa, qb = q0[..., 0:spec.rotary_dim:2], q0[..., 1:spec.rotary_dim:2]
        ka, kb = k0[..., 0:spec.rotary_dim:2], k0[..., 1:spec.rotary_dim:2]
    qa, qb, ka, kb = (v.double() for v in (qa, qb, ka, kb))
    ang = rel[:, None, None] * spec.inv_freq.double()                         # [T, 1, rd/2]
    dot = (qa * ka + qb * kb) * torch.cos(ang) + (qa * kb - qb * ka) * torch.sin(ang)
    tail = (q0[..., spec.rotary_dim:].double() * k0[..., spec.rotary_dim:].double()).sum(-1)
    return dot.sum(-1) + tail


# --------------------------------------------------------------------------------------------------
# config resolution on stub configs
# --------------------------------------------------------------------------------------------------


def test_head_dim_present_absent_none():
    # present and different from hidden/heads (small Qwen3 models)
    s = RopeSpec.from_config(NS(head_dim=32, hidden_size=128, num_attention_heads=2, rope_theta=1e6))
    assert (s.head_dim, s.rotary_dim) == (32, 32)
    # absent -> hidden // heads
    s = RopeSpec.from_config(NS(hidden_size=128, num_attention_heads=2, rope_theta=1e6))
    assert (s.head_dim, s.rotary_dim) == (64, 64)
    # None -> hidden // heads
    s = RopeSpec.from_config(NS(head_dim=None, hidden_size=96, num_attention_heads=2, rope_theta=1e6))
    assert s.head_dim == 48
    with pytest.raises(ValueError, match="head_dim"):
        RopeSpec.from_config(NS(rope_theta=1e6))


def test_theta_in_rope_theta_or_rope_parameters():
    inv = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))  # independent fp64 formula
    for cfg in (
        NS(head_dim=16, rope_theta=1e6),
        NS(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        NS(head_dim=16, rope_parameters=NS(rope_type="default", rope_theta=1e6)),  # object form
        {"head_dim": 16, "rope_theta": 1e6},                                        # config.json dict
        {"head_dim": 16, "rope_parameters": {"rope_theta": 1e6}},
    ):
        s = RopeSpec.from_config(cfg)
        assert s.theta == 1e6 and s.rope_type == "default" and s.attention_scaling == 1.0
        assert s.inv_freq.dtype == torch.float32 and s.inv_freq.shape == (8,)
        torch.testing.assert_close(s.inv_freq.double(), inv, rtol=1e-6, atol=0)
    # rope_parameters wins over a stale top-level rope_theta
    assert RopeSpec.from_config(NS(head_dim=16, rope_theta=1e4, rope_parameters={"rope_theta": 1e6})).theta == 1e6


def test_missing_theta_raises_naming_fields():
    for cfg in (NS(head_dim=16), NS(head_dim=16, rope_parameters={"rope_type": "default"}), {"head_dim": 16}):
        with pytest.raises(ValueError) as err:
            RopeSpec.from_config(cfg)
        msg = str(err.value)
        for field in ("rope_parameters['rope_theta']", "rope_theta", "rope_scaling['rope_theta']"):
            assert field in msg


def test_rotary_dim_sources_and_odd_rejected():
    assert RopeSpec.from_config(NS(head_dim=64, rope_theta=1e4, partial_rotary_factor=0.25)).rotary_dim == 16
    assert RopeSpec.from_config(
        NS(head_dim=64, rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5})).rotary_dim == 32
    assert RopeSpec.from_config(NS(hidden_size=256, num_attention_heads=4, rope_theta=1e4,
                                   rotary_pct=0.25)).rotary_dim == 16
    assert RopeSpec.from_config(NS(head_dim=64, rope_theta=1e4, rotary_dim=24)).rotary_dim == 24
    with pytest.raises(ValueError, match="even"):
        RopeSpec.from_config(NS(head_dim=64, rope_theta=1e4, rotary_dim=23))
    with pytest.raises(ValueError, match="even"):
        RopeSpec.from_config(NS(head_dim=10, rope_theta=1e4, partial_rotary_factor=0.5))  # 5 channels


def test_legacy_rope_scaling_and_unknown_type():
    s = RopeSpec.from_config(NS(head_dim=16, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}))
    assert s.rope_type == "linear"
    torch.testing.assert_close(s.inv_freq, R._default_inv_freq(1e4, 16) / 2.0)
    with pytest.raises(ValueError, match="unsupported rope_type"):
        RopeSpec.from_config(NS(head_dim=16, rope_parameters={"rope_theta": 1e4, "rope_type": "mystery"}))


def test_layout_defaults_and_override():
    assert RopeSpec.from_config(transformers.Qwen3Config(head_dim=32)).layout == "neox"
    assert RopeSpec.from_config(transformers.LlamaConfig()).layout == "neox"
    gptj = RopeSpec.from_config(transformers.GPTJConfig(n_embd=256, n_head=4, rotary_dim=16))
    # GPT-J: interleaved pairs, partial rotary, base hard-coded to 10000 by its model code
    assert (gptj.layout, gptj.head_dim, gptj.rotary_dim, gptj.theta) == ("gptj", 64, 16, 10000.0)
    assert RopeSpec.from_config(NS(head_dim=16, rope_theta=1e4, model_type="glm")).layout == "gptj"
    assert RopeSpec.from_config(NS(head_dim=16, rope_theta=1e4, model_type="qwen3"), layout="gptj").layout == "gptj"
    spec = dataclasses.replace(_hand_spec(), layout="gptj")
    assert spec.layout == "gptj"
    with pytest.raises(ValueError, match="layout"):
        dataclasses.replace(_hand_spec(), layout="sideways")


def test_per_layer_type_rope_needs_layer_type():
    cfg = transformers.Gemma3TextConfig()
    with pytest.raises(ValueError, match="layer_type"):
        RopeSpec.from_config(cfg)
    assert RopeSpec.from_config(cfg, layer_type="full_attention").theta == 1e6
    assert RopeSpec.from_config(cfg, layer_type="sliding_attention").theta == 1e4


def test_dynamic_refuses_positions_past_its_base():
    spec = _spec("dynamic")   # max_position_embeddings 16384: the unscaled base
    torch.testing.assert_close(spec.inv_freq, R._default_inv_freq(5e5, HEAD_DIM), rtol=0, atol=0)
    k = torch.randn(2, 3, HEAD_DIM)                         # [T, H, d]
    with pytest.raises(ValueError, match="seq_len"):
        rerotate_keys(k, torch.tensor([20000, 5]), torch.tensor([0, 1]), spec)
    longer = _spec("dynamic", seq_len=20001)   # base for a 20001-token prefill, used for both legs
    assert longer.max_positions == 20001 and (longer.inv_freq < spec.inv_freq).any()
    rerotate_keys(k, torch.tensor([20000, 5]), torch.tensor([0, 1]), longer)


# --------------------------------------------------------------------------------------------------
# equality with transformers' own rotary embeddings
# --------------------------------------------------------------------------------------------------


def test_apply_rope_equals_qwen3_rotary_embedding():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.Qwen3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   rope_theta=1e6, max_position_embeddings=40960)
    spec = RopeSpec.from_config(cfg)
    emb = Qwen3RotaryEmbedding(cfg)
    assert torch.equal(spec.inv_freq, emb.inv_freq)
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 40000, (200,), generator=g)
    k = torch.randn(1, 2, 200, 32, generator=g)            # [B, H, T, d] as transformers holds it
    cos, sin = emb(k, pos[None])
    _, k_ref = apply_rotary_pos_emb(k, k, cos, sin)
    mine = apply_rope(k[0].transpose(0, 1), pos, spec)     # [T, H, d]
    torch.testing.assert_close(mine, k_ref[0].transpose(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rope_type", list(R.SUPPORTED_ROPE_TYPES))
def test_apply_rope_equals_llama_rotary_embedding_every_type(rope_type):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = _llama_config(rope_type, max_pos=8192)
    g = torch.Generator().manual_seed(4)
    pos = torch.randint(0, 12000, (128,), generator=g)
    # transformers picks dynamic/longrope frequencies from max(position)+1; tell the spec the same length
    seq_len = int(pos.max()) + 1 if rope_type in ("dynamic", "longrope") else None
    spec = RopeSpec.from_config(cfg, seq_len=seq_len)
    k = torch.randn(1, 2, 128, HEAD_DIM, generator=g)
    cos, sin = LlamaRotaryEmbedding(cfg)(k, pos[None])
    _, k_ref = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(apply_rope(k[0], pos, spec, token_dim=-2), k_ref[0], rtol=0, atol=1e-6)


def test_apply_rope_equals_phi_partial_rotary():
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.PhiConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                 partial_rotary_factor=0.5, max_position_embeddings=4096)
    spec = RopeSpec.from_config(cfg)
    assert (spec.head_dim, spec.rotary_dim, spec.layout) == (64, 32, "neox")
    pos = torch.randint(0, 4000, (50,), generator=torch.Generator().manual_seed(5))
    k = torch.randn(1, 2, 50, 64)
    cos, sin = PhiRotaryEmbedding(cfg)(k, pos[None])
    k_rot, k_pass = k[..., :32], k[..., 32:]               # what PhiAttention does
    _, k_rot = apply_rotary_pos_emb(k_rot, k_rot, cos, sin)
    k_ref = torch.cat([k_rot, k_pass], dim=-1)
    torch.testing.assert_close(apply_rope(k[0], pos, spec, token_dim=-2), k_ref[0], rtol=0, atol=1e-6)


def test_apply_rope_equals_gptj_interleaved():
    from transformers.models.gptj import modeling_gptj as gm

    cfg = transformers.GPTJConfig(n_embd=256, n_head=4, rotary_dim=16)
    spec = RopeSpec.from_config(cfg)
    pos = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(6))
    k = torch.randn(1, 40, 4, 64)                           # GPT-J rotates [B, T, H, d] before transposing
    sincos = gm.create_sinusoidal_positions(2048, 16)[pos][None]   # [1, T, rd]
    sin, cos = torch.split(sincos, 8, dim=-1)
    k_ref = torch.cat([gm.apply_rotary_pos_emb(k[..., :16], sin, cos), k[..., 16:]], dim=-1)
    torch.testing.assert_close(apply_rope(k[0], pos, spec), k_ref[0], rtol=0, atol=1e-6)


def test_rerotated_cache_equals_tiny_qwen3_prefill_of_kept_tokens():
    """Layer-0 keys depend only on the token and its position, so re-rotating a full prefill's layer-0
    keys to compact positions must give the keys the model computes when it prefills only the kept
    tokens (values: the same rows, untouched)."""
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   rope_theta=1e6, max_position_embeddings=4096)
    torch.manual_seed(7)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 40))
    keep = torch.tensor([0, 1, 2, 5, 9, 17, 23, 30, 38, 39])

    def kv_of(input_ids):
        with torch.no_grad():
            out = model(input_ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        layers = [(lay.keys[0].transpose(0, 1).reshape(input_ids.shape[1], -1),
                   lay.values[0].transpose(0, 1).reshape(input_ids.shape[1], -1)) for lay in cache.layers]
        return torch.stack([torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])])

    kv_full = kv_of(ids)                                    # [2, L, 40, 64]
    kv_kept = kv_of(ids[:, keep])                           # [2, L, 10, 64]
    gathered = kv_full[:, :, keep]
    moved = rerotate_k_cache(gathered, keep, torch.arange(len(keep)), cfg)   # config accepted directly
    torch.testing.assert_close(moved[0, 0], kv_kept[0, 0], rtol=0, atol=2e-6)
    assert torch.equal(moved[1], gathered[1])
    # without re-rotation the layer-0 keys are clearly wrong
    assert (gathered[0, 0] - kv_kept[0, 0]).abs().max() > 0.1


# --------------------------------------------------------------------------------------------------
# rerotate_k_cache: shapes, no mutation, chunking
# --------------------------------------------------------------------------------------------------


def _qwen3_spec():
    return RopeSpec.from_config(transformers.Qwen3Config(head_dim=32, rope_theta=1e6))


def test_rerotate_k_cache_matches_rerotate_keys_and_leaves_input(monkeypatch):
    spec = _qwen3_spec()
    g = torch.Generator().manual_seed(8)
    kv = (torch.randn(2, 3, 70, 4 * 32, generator=g) * 3).to(torch.bfloat16)   # [2, L, T, D], H_kv = 4
    before = kv.clone()
    old = torch.sort(torch.randperm(500, generator=g)[:70]).values
    new = torch.arange(70)
    monkeypatch.setattr(R, "_CHUNK_ELEMS", 4 * 32 * 9)       # force several token chunks per layer
    out = rerotate_k_cache(kv, old, new, spec)
    assert torch.equal(kv, before)                           # never mutates its input
    assert out.shape == kv.shape and out.dtype == kv.dtype and out.data_ptr() != kv.data_ptr()
    assert torch.equal(out[1], kv[1])                        # values bit-identical
    for layer in range(3):
        ref = rerotate_keys(kv[0, layer].view(70, 4, 32), old, new, spec).view(70, 128)
        assert torch.equal(out[0, layer], ref)


def test_rerotate_k_cache_shape_errors():
    spec = _qwen3_spec()
    kv = torch.zeros(2, 2, 5, 64)
    pos = torch.arange(5)
    with pytest.raises(ValueError, match=r"\[2, L, T, D\]"):
        rerotate_k_cache(torch.zeros(2, 5, 64), pos, pos, spec)
    with pytest.raises(ValueError, match=r"\[2, L, T, D\]"):
        rerotate_k_cache(torch.zeros(3, 2, 5, 64), pos, pos, spec)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        rerotate_k_cache(torch.zeros(2, 2, 5, 48), pos, pos, spec)
    with pytest.raises(ValueError, match="old_positions"):
        rerotate_k_cache(kv, torch.arange(4), pos, spec)
    with pytest.raises(ValueError, match="new_positions"):
        rerotate_k_cache(kv, pos, torch.arange(6), spec)
    with pytest.raises(TypeError, match="integers"):
        rerotate_k_cache(kv, pos.float(), pos, spec)
    with pytest.raises(TypeError):
        rerotate_k_cache(kv.long(), pos, pos, spec)


def test_chunking_keeps_qwen3_8b_cache_under_one_layer_fp32():
    # issue 3: for [2, 36, 16384, 1024] bf16 the temporaries stay under one layer's keys in fp32.
    # rerotate_k_cache holds the cos/sin tables and, per chunk, the fp32 rotary channels plus the two
    # rotated halves (= twice the chunk's rotary channels).
    t, heads, head_dim = 16384, 8, 128
    chunk = R._token_chunk(t, heads, head_dim)
    temporaries = 2 * chunk * heads * head_dim * 4 + 2 * t * (head_dim // 2) * 4
    assert temporaries < t * heads * head_dim * 4


def test_scaled_type_missing_parameter_is_value_error():
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeSpec.from_config(NS(head_dim=16, max_position_embeddings=4096, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "high_freq_factor": 4.0}))


def test_non_contiguous_cache():
    spec = _qwen3_spec()
    base = torch.randn(2, 2, 64, 20, generator=torch.Generator().manual_seed(9))
    kv = base.transpose(2, 3)                                 # [2, 2, 20, 64], not contiguous
    old, new = torch.arange(20) * 3, torch.arange(20)
    out = rerotate_k_cache(kv, old, new, spec)
    assert torch.equal(out, rerotate_k_cache(kv.contiguous(), old, new, spec))


def test_apply_rope_shape_errors_and_ambiguity():
    spec = _hand_spec()
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(torch.zeros(3, 6), torch.arange(3), spec)
    with pytest.raises(ValueError, match="T = len"):
        apply_rope(torch.zeros(3, 8), torch.arange(4), spec)
    with pytest.raises(ValueError, match="1-D"):
        apply_rope(torch.zeros(3, 8), torch.zeros(1, 3, dtype=torch.long), spec)
    x = torch.randn(2, 2, 8)                                  # [T, H, d] or [B, T, d] with T = H = 2
    with pytest.raises(ValueError, match="ambiguous"):
        apply_rope(x, torch.tensor([0, 5]), spec)
    as_heads = apply_rope(x, torch.tensor([0, 5]), spec, token_dim=-3)
    assert torch.equal(as_heads[0], x[0])                     # token 0 at position 0: unchanged
    assert not torch.equal(as_heads[1], x[1])


@pytest.mark.parametrize("per_layer", [False, True])
def test_inplace_rerotation_is_bit_identical_and_copies_nothing(per_layer):
    """`inplace=True` (what apply_keep uses on its freshly gathered rows) gives the same bits as the copying path,
    rotates the given tensor itself, and falls back to a new tensor for a layout it cannot view in place."""
    torch.manual_seed(0)
    spec = RopeSpec.from_config(NS(head_dim=8, partial_rotary_factor=0.5, rope_theta=1e4))
    specs = [spec, dataclasses.replace(spec, layout="gptj"), spec] if per_layer else spec
    kv = torch.randn(2, 3, 10, 16)  # 2 KV heads of 8
    old, new = torch.tensor([0, 2, 3, 5, 8, 9, 11, 12, 15, 20]), torch.arange(10)
    want = rerotate_k_cache(kv, old, new, specs)
    mine = kv.clone()
    got = rerotate_k_cache(mine, old, new, specs, inplace=True)
    assert got is mine and torch.equal(got, want)
    assert not torch.equal(want[0], kv[0]) and torch.equal(want[1], kv[1])  # keys moved, values untouched
    for aliased in (torch.randn(10, 16).expand(2, 3, 10, 16), torch.randn(3, 10, 16).expand(2, 3, 10, 16)):
        want = rerotate_k_cache(aliased.contiguous(), old, new, specs)  # layers or keys/values sharing memory
        got = rerotate_k_cache(aliased, old, new, specs, inplace=True)
        assert got is not aliased and torch.equal(got, want)
    strided = torch.randn(2, 3, 16, 10).transpose(2, 3)  # [2, L, T, D] whose rows are not contiguous
    got = rerotate_k_cache(strided, old, new, specs, inplace=True)
    assert got is not strided and torch.equal(got, rerotate_k_cache(strided.contiguous(), old, new, specs))
