"""The `hf` engine's own decode step for Llama-like decoders: the model's modules, without transformers' forward.

A decode step feeds one token per row through every layer. For a small model on a CPU, transformers' forward
spends about a quarter of such a step outside the linears and the attention (SmolLM2-135M, 30 layers, bf16, batch
4 x 2048: ~1,300 small ops and the Python around them: module calls, output records, mask and cache bookkeeping).
`LeanDecodeStep` walks the same decoder in a plain loop: per layer one fused RMSNorm (`F.rms_norm`, in fp32 as
the model's norm computes it), the model's own `nn.Linear` modules (so prepacked weights, `engines.packed`, and a
forward the user set on a linear both still apply), rotary embedding with the model's own rotary module's cos and
sin, the slot store's in-place write and `tdutils.attention.decode_attention` (what the engine's capturing `sdpa`
runs for a decode step), the MLP's own activation. Same operations, same order, same dtypes: logits equal the
model's forward up to float summation order in the norms (tests/test_lean_step.py).

Where the step applies (`lean_step_refusal` says why not, once, at engine opening; `LeanDecodeStep.usable` per
decode): the families in `LEAN_FAMILIES` (Llama, Mistral, Qwen2, Qwen3 and their RMSNorm, SiLU MLP, rotary
layout), full attention only (no sliding-window layer), on the CPU, in eval mode, with transformers' `sdpa`
attention (the engine's capturing wrapper of it included) and nothing observing the modules: no forward hook or
pre-hook on any module but the engine's own, no global module hook, no `forward` the user set on a module other
than a linear. Anything else runs transformers' forward, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import attention
from ..attention import AttentionSpec
from .kvstore import HEAD_MASK_HOOK_ATTR

# The model classes whose decoder layer is: x + attn(norm(x)), then x + mlp(norm(x)); attention = q/k/v
# projections (Qwen3: then q_norm / k_norm per head), rotary (rotate_half), cache, softmax attention, o_proj;
# mlp = down(act(gate(x)) * up(x)); RMSNorm = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype).
LEAN_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def lean_step_refusal(model: nn.Module, spec: AttentionSpec) -> str | None:
    """Why `LeanDecodeStep` cannot run `model` at all (a family, layout or attention it does not cover), or None.
    `spec`: the model's probed attention (`tdutils.attention.attention_spec`, the engine's `attention`). Per-call
    conditions (hooks, training mode, the attention backend) are `LeanDecodeStep.usable`'s."""
    family = type(model).__name__
    if family not in LEAN_FAMILIES:
        return f"{family} is not one of the lean step's families ({', '.join(LEAN_FAMILIES)})"
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or getattr(body, "rotary_emb", None) is None or getattr(body, "norm", None) is None:
        return f"{family}: no decoder layers, rotary module or final norm where the lean step looks (model.model)"
    if any(la.sliding_window or la.softcap or la.has_sinks for la in spec.layers):
        return f"{family}: sliding-window layers, soft-capping or sinks (the lean step runs plain full attention)"
    if getattr(model.config, "pretraining_tp", 1) != 1:
        return f"{family}: pretraining_tp = {model.config.pretraining_tp} (split linears)"
    for layer, la in zip(layers, spec.layers):
        a, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm, body.norm]
        norms += [n for n in (getattr(a, "q_norm", None), getattr(a, "k_norm", None)) if n is not None]
        if any(type(n).__name__ not in _NORMS for n in norms):
            return f"{family}: a norm that is not the family's RMSNorm"
        if not all(hasattr(a, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")) or not all(
                hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"{family}: an attention or MLP block without the projections the lean step calls"
        if getattr(a, "scaling", None) != la.scaling:
            return f"{family}: an attention scaling the lean step cannot read off the module"
    return None


def _rms_norm(norm: nn.Module, x: torch.Tensor, ops=None) -> torch.Tensor:
    """`norm(x)` for the families' RMSNorm (`_NORMS`) in one op (`ops`: the compiled kernels, else torch's fused
    `rms_norm`): fp32 statistics, the product with the weight in `x`'s dtype."""
    w, eps = norm.weight, norm.variance_epsilon
    if ops is not None and w.dtype == x.dtype and x.is_contiguous():
        out = torch.empty_like(x)
        ops.rms_norm_out(x, w, eps, out)
        return out
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` (transformers' `apply_rotary_pos_emb`), x `[B, H, 1, d]`, cos/sin `[B, 1, 1, d]`."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LeanDecodeStep:
    """One decode step of a `LEAN_FAMILIES` model over a `SlotKVStore`: the model's forward without its wrapping.

    Args:
        model, spec: a causal LM and its probed attention that `lean_step_refusal` accepts (ValueError with its
            reason otherwise).

    Call: `step(input_ids, mask, position_ids, store)` with `input_ids` and `position_ids` `[rows, 1]` (int64),
    `mask` the step's `[rows, 1, 1, cols]` boolean or additive mask (`SlotKVStore.attention_mask`), and `store`
    between `begin_step` and `end_step`: writes every layer's key and value of the step into the store (keys
    rotated) and returns the last position's logits `[rows, 1, vocab]` in the model's dtype, what
    `model(..., logits_to_keep=1).logits` gives.
    """

    def __init__(self, model: nn.Module, spec: AttentionSpec):
        why = lean_step_refusal(model, spec)
        if why is not None:
            raise ValueError(f"the lean decode step cannot run this model: {why}")
        self.model = model
        self.body = model.model
        self.layers = list(self.body.layers)
        # every module the step calls past (linears are called, so their hooks and forwards apply)
        self._modules = [m for m in model.modules() if not isinstance(m, nn.Linear)]

    def usable(self) -> bool:
        """Whether a decode may run the lean step now: the model on the CPU in eval mode with (capturing) `sdpa`
        attention, no query recording, and no hook or replaced `forward` on any module but linears (the engine's
        own padding pre-hooks, `kvstore.install_head_masks`, are not counted: a store with padding masks, whose
        rows they mask per head, runs transformers' forward, the engine's check)."""
        model = self.model
        impl = str(getattr(model.config, "_attn_implementation", None)).removeprefix(attention._PREFIX)
        if (impl != "sdpa" or model.training or attention._active is not None
                or next(model.parameters()).device.type != "cpu"):
            return False
        hooks = nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return False
        ours = HEAD_MASK_HOOK_ATTR
        return not any("forward" in m.__dict__ or m._forward_hooks or any(
            k != getattr(m, ours, None) for k in m._forward_pre_hooks) for m in self._modules)

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor,
                 store) -> torch.Tensor:
        body = self.body
        h = body.embed_tokens(input_ids)  # [B, 1, D]
        B = h.shape[0]
        cos, sin = body.rotary_emb(h, position_ids)  # [B, 1, d] each, in h's dtype
        ops = self._ops(h, mask, store)
        if ops is not None:
            kernel_mask = None if mask is None else mask[:, :, 0, :]  # [B, 1, cols]
            cos, sin = cos.contiguous(), sin.contiguous()
        else:
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, d]: broadcast over heads
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(layer.input_layernorm, h, ops)
            q = a.q_proj(x).view(B, -1, a.head_dim)  # [B, Hq, d] (one token per row)
            k = a.k_proj(x).view(B, -1, a.head_dim)  # [B, H_kv, d]
            v = a.v_proj(x).view(B, -1, a.head_dim)
            if getattr(a, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head's d values, before RoPE
                q, k = _rms_norm(a.q_norm, q, ops), _rms_norm(a.k_norm, k, ops)
            if ops is not None:  # rotary and the store write in one call, then the attention kernel
                qf = torch.empty(q.shape, dtype=torch.float32)
                ops.rope_write_out(q, k, v.contiguous(), cos, sin, store.keys[i], store.values[i], store.lengths,
                                   qf)
                keys, values = store.step_views(i)  # [B, H_kv, cols, d]
                out = torch.empty(q.shape, dtype=torch.float32)
                ops.decode_attention_out(qf, keys, values, kernel_mask, a.scaling, out)
                o = out.to(h.dtype)  # [B, Hq, d]
            else:
                q = _rotate(q[:, :, None], cos, sin)  # [B, Hq, 1, d]
                k = _rotate(k[:, :, None], cos, sin)  # [B, H_kv, 1, d]
                keys, values = store.write(i, k, v[:, :, None])  # [B, H_kv, cols, d] views of the store
                o = attention.decode_attention(q, keys, values, mask, a.scaling)  # [B, 1, Hq, d]
            h = h + a.o_proj(o.reshape(B, 1, -1))
            x = _rms_norm(layer.post_attention_layernorm, h, ops)
            h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.model.lm_head(_rms_norm(body.norm, h, ops))  # [B, 1, vocab]

    def _ops(self, h: torch.Tensor, mask: torch.Tensor | None, store):
        """The compiled kernels (`tdutils.kernels.step_kernels`) where they take this step: fp32 or bf16 on the
        CPU, the store in the model's dtype, a boolean or fp32 mask; else None (torch ops)."""
        if h.dtype not in (torch.float32, torch.bfloat16) or h.device.type != "cpu" or store.keys[0].dtype != h.dtype:
            return None
        if mask is not None and mask.dtype not in (torch.bool, torch.float32):
            return None
        from ..kernels import step_kernels

        return step_kernels()


__all__ = ["LEAN_FAMILIES", "LeanDecodeStep", "lean_step_refusal"]
