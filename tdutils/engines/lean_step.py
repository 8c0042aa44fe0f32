"""The `hf` engine's own decode step for Llama-like decoders and Gemma 3: the model's modules, without transformers'
forward around them.

A decode step feeds one token per row through every layer. For a small model on a CPU, transformers' forward
spends about a quarter of such a step outside the linears and the attention (SmolLM2-135M, 30 layers, bf16, batch
4 x 2048: ~1,300 small ops and the Python around them: module calls, output records, mask and cache bookkeeping).
`LeanDecodeStep` walks the same decoder in a plain loop: the model's own `nn.Linear` modules (so prepacked weights,
`engines.packed`, and a forward the user set on a linear both still apply), embedding, rotary module and MLP
activation; RMSNorm, and rotary embedding with the slot store write, each as one compiled op
(`tdutils/csrc/decode_step.cpp`: the norms' statistics by torch's own reduction, every rounding where the model's
modules round); the attention kernel that the engine's capturing `sdpa` runs for a decode step
(`tdutils.attention.decode_attention`). Without the compiled ops (no compiler), the norms run as the model's
modules and the rotary as torch ops. Logits equal the engine's transformers-forward step bit for bit, in fp32 and
bf16, on every family it takes (tests/test_lean_step.py).

Where the step applies (`lean_step_refusal` says why not, once, at engine opening; `LeanDecodeStep.usable` per
decode): the families in `LEAN_FAMILIES` with plain softmax attention (sliding windows included: the engine's
masks carry them; no soft-capped attention logits, no sinks), on the CPU, in eval mode, with transformers' `sdpa`
attention (the engine's capturing wrapper of it included) and nothing observing the modules: no forward hook or
pre-hook on any module but the engine's own, no global module hook, no `forward` the user set on a module other
than a linear. Anything else runs transformers' forward, unchanged.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .. import attention
from ..attention import AttentionSpec
from ..kernels import step_kernels
from .kvstore import HEAD_MASK_HOOK_ATTR

# Decoder layers: h + attn(norm(h)), then h + mlp(norm(h)) (Gemma 3: each sublayer's output normed too);
# attention = q/k/v projections (Qwen3, Gemma 3: then q_norm / k_norm per head), rotary (rotate_half layout),
# cache, softmax attention, o_proj; mlp = down(act(gate(x)) * up(x)).
LEAN_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma3ForCausalLM")
# RMSNorm classes -> the kernel's mode: 0 = weight * T(x * r) (Llama), 1 = T(x * r * (1 + weight)) (Gemma);
# x, r = rsqrt(mean(x^2) + eps) and the products in fp32, T the model's dtype
_NORMS = {"LlamaRMSNorm": 0, "MistralRMSNorm": 0, "Qwen2RMSNorm": 0, "Qwen3RMSNorm": 0, "Gemma3RMSNorm": 1}


def lean_step_refusal(model: nn.Module, spec: AttentionSpec) -> str | None:
    """Why `LeanDecodeStep` cannot run `model` at all (a family, layout or attention it does not cover), or None.
    `spec`: the model's probed attention (`tdutils.attention.attention_spec`, the engine's `attention`). Per-call
    conditions (hooks, training mode, the attention backend) are `LeanDecodeStep.usable`'s."""
    family, config = type(model).__name__, model.config
    if family not in LEAN_FAMILIES:
        return f"{family} is not one of the lean step's families ({', '.join(LEAN_FAMILIES)})"
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or getattr(body, "rotary_emb", None) is None or getattr(body, "norm", None) is None:
        return f"{family}: no decoder layers, rotary module or final norm where the lean step looks (model.model)"
    if any(la.softcap or la.has_sinks for la in spec.layers) or getattr(config, "use_bidirectional_attention", False):
        return f"{family}: soft-capped attention logits, sinks or bidirectional attention (the lean step runs a " \
               f"plain causal softmax)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"{family}: pretraining_tp = {config.pretraining_tp} (split linears)"
    if len(layers) != len(spec.layers):
        return f"{family}: {len(spec.layers)} attention calls for {len(layers)} layers"
    for layer, la in zip(layers, spec.layers):
        a, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm, body.norm]
        norms += [getattr(layer, n) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
                  if hasattr(layer, n)]
        norms += [getattr(a, n) for n in ("q_norm", "k_norm") if getattr(a, n, None) is not None]
        if any(type(n).__name__ not in _NORMS for n in norms):
            return f"{family}: a norm that is not one of the lean step's RMSNorms"
        if not all(hasattr(a, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")) or not all(
                hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"{family}: an attention or MLP block without the projections the lean step calls"
        if getattr(a, "scaling", None) != la.scaling:
            return f"{family}: an attention scaling the lean step cannot read off the module"
    return None


def _rms_norm(norm: nn.Module, x: torch.Tensor, ops) -> torch.Tensor:
    """`norm(x)`: one compiled op (`ops`), else the module itself."""
    w = norm.weight
    if ops is None or w.dtype != x.dtype or not x.is_contiguous():
        return norm(x)
    out = torch.empty_like(x)
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    ops.rms_norm_out(x, w, eps, _NORMS[type(norm).__name__], out)
    return out


class LeanDecodeStep:
    """One decode step of a `LEAN_FAMILIES` model over a `SlotKVStore`: the model's forward without its wrapping.

    Args:
        model, spec: a causal LM and its probed attention that `lean_step_refusal` accepts (ValueError with its
            reason otherwise).

    Call: `step(input_ids, mask, position_ids, store)` with `input_ids` and `position_ids` `[rows, 1]` (int64),
    `mask` the step's `[rows, 1, 1, cols]` boolean or additive mask, or a dict of them by layer type (the engine's
    `_decode_masks`), and `store` between `begin_step` and `end_step`: writes every layer's key and value of the
    step into the store (keys rotated) and returns the last position's logits `[rows, 1, vocab]` in the model's
    dtype (soft-capped where the model caps them), what `model(..., logits_to_keep=1).logits` gives.
    """

    def __init__(self, model: nn.Module, spec: AttentionSpec):
        why = lean_step_refusal(model, spec)
        if why is not None:
            raise ValueError(f"the lean decode step cannot run this model: {why}")
        self.model = model
        self.body = model.model
        self.layers = list(self.body.layers)
        config = model.config
        # Gemma 3: one rotary table per layer type (sliding layers use a local base)
        typed = "layer_type" in inspect.signature(self.body.rotary_emb.forward).parameters
        types = list(getattr(config, "layer_types", None) or [None] * len(self.layers))
        self.rotary_types = types if typed else [None] * len(self.layers)
        self.mask_types = types
        self.sandwich = hasattr(self.layers[0], "pre_feedforward_layernorm")  # Gemma's four norms per layer
        self.logit_cap = getattr(config, "final_logit_softcapping", None)
        # the modeling module's own rotary application, for steps without the compiled ops
        self._apply_rope = inspect.getmodule(type(self.layers[0].self_attn)).apply_rotary_pos_emb
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

    def __call__(self, input_ids: torch.Tensor, mask, position_ids: torch.Tensor, store) -> torch.Tensor:
        body = self.body
        h = body.embed_tokens(input_ids)  # [B, 1, D]
        B = h.shape[0]
        ops = self._ops(h, store)
        rotary = {}  # layer type -> (cos, sin): [B, d] for the compiled op, else [B, 1, d]
        for t in dict.fromkeys(self.rotary_types):
            cos, sin = body.rotary_emb(h, position_ids, t) if t is not None else body.rotary_emb(h, position_ids)
            rotary[t] = (cos.contiguous(), sin.contiguous()) if ops is not None else (cos, sin)
        masks = mask if isinstance(mask, dict) else {t: mask for t in set(self.mask_types)}
        if ops is not None:  # the attention kernel's [B, 1, cols] masks, boolean or fp32 additive, once per step
            masks = {t: None if m is None else (m[:, :, 0, :] if m.dtype in (torch.bool, torch.float32)
                                                else m[:, :, 0, :].float()) for t, m in masks.items()}
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            cos, sin = rotary[self.rotary_types[i]]
            m = masks[self.mask_types[i]]
            x = _rms_norm(layer.input_layernorm, h, ops)
            q = a.q_proj(x).view(B, -1, a.head_dim)  # [B, Hq, d] (one token per row)
            k = a.k_proj(x).view(B, -1, a.head_dim)  # [B, H_kv, d]
            v = a.v_proj(x).view(B, -1, a.head_dim)
            if getattr(a, "q_norm", None) is not None:  # Qwen3, Gemma 3: RMSNorm over each head's d values, before RoPE
                q, k = _rms_norm(a.q_norm, q, ops), _rms_norm(a.k_norm, k, ops)
            if ops is not None:  # rotary and the store write in one call, then the attention kernel
                qf = torch.empty(q.shape, dtype=torch.float32)
                ops.rope_write_out(q, k, v.contiguous(), cos, sin, store.keys[i], store.values[i], store.lengths,
                                   qf)
                keys, values = store.step_views(i)  # [B, H_kv, cols, d]
                out = torch.empty(q.shape, dtype=torch.float32)
                ops.decode_attention_out(qf, keys, values, m, a.scaling, out)
                o = out.to(h.dtype)  # [B, Hq, d]
            else:
                q, k = self._apply_rope(q[:, :, None], k[:, :, None], cos, sin)  # [B, Hq, 1, d], [B, H_kv, 1, d]
                keys, values = store.write(i, k, v[:, :, None])  # [B, H_kv, cols, d] views of the store
                o = attention.decode_attention(q, keys, values, m, a.scaling)  # [B, 1, Hq, d]
            o = a.o_proj(o.reshape(B, 1, -1))
            if self.sandwich:  # Gemma 3: norm the attention output, then a normed MLP whose output is normed too
                h = h + _rms_norm(layer.post_attention_layernorm, o, ops)
                x = _rms_norm(layer.pre_feedforward_layernorm, h, ops)
                h = h + _rms_norm(layer.post_feedforward_layernorm, self._mlp(mlp, x), ops)
            else:
                h = h + o
                h = h + self._mlp(mlp, _rms_norm(layer.post_attention_layernorm, h, ops))
        logits = self.model.lm_head(_rms_norm(body.norm, h, ops))  # [B, 1, vocab]
        if self.logit_cap is not None:  # as the model's forward: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        return logits

    @staticmethod
    def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    @staticmethod
    def _ops(h: torch.Tensor, store):
        """The compiled kernels (`tdutils.kernels.step_kernels`) where they take this step: fp32 or bf16 on the
        CPU with the store in the model's dtype; else None (the modules and torch ops)."""
        if h.dtype not in (torch.float32, torch.bfloat16) or h.device.type != "cpu" or store.keys[0].dtype != h.dtype:
            return None
        return step_kernels()


__all__ = ["LEAN_FAMILIES", "LeanDecodeStep", "lean_step_refusal"]
