"""KNorm: keep the keys with the lowest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv:2406.11430.

Observation of the paper: a low key norm goes with a high attention score, so the keys with the smallest
L2 norm are the ones worth keeping. Definition implemented here: per layer and KV head the norm
`‖k_t‖₂` of every cached key (keys are stored after RoPE, which rotates channel pairs and so leaves the
norm unchanged); averaged over KV heads and layers into one score per token; keep the `k` tokens with the
lowest mean norm (ties to the earlier token). Query-free: it needs the KV cache only (no query capture; on
the serving path it runs on a stock vLLM) and the model's `head_dim` to split heads.

Departure from the paper: the paper (and kvpress's `KnormPress`) keeps a separate set per layer and head;
here one set per request, shared by all layers and heads, as the serving path (one token list per request)
needs; `granularity="head"` keeps the paper's set per KV head, `"layer"` one per layer. Defaults: `window=0`, `n_sink=0` (the paper and kvpress protect no token); a `window` protects the
question at the end of the prompt, `n_sink` the first tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..selection import (
    GRANULARITIES,
    check_protected,
    keep_count,
    keep_top_per_head,
    keep_top_scores,
    protected_mask,
)
from .registry import register_policy


@dataclass
class KNormParams:
    """KNorm parameters: protected most recent tokens (`window`) and first tokens (`n_sink`)."""

    window: int = field(default=0, metadata={"help": "the most recent prompt tokens, always kept"})
    n_sink: int = field(default=0, metadata={"help": "the first prompt tokens, always kept (attention sinks)"})

    def __post_init__(self):
        check_protected(self.n_sink, self.window)


def check_key_heads(kv: torch.Tensor, head_dim: int) -> None:
    """ValueError unless `kv` is `[2, L, T, D]` and `head_dim` divides `D`."""
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"kv must have shape [2, L, T, D], got {tuple(kv.shape)}")
    if head_dim < 1 or kv.shape[3] % head_dim:
        raise ValueError(f"head_dim {head_dim} does not divide D={kv.shape[3]}")


def key_heads(kv: torch.Tensor, layer: int, head_dim: int) -> torch.Tensor:
    """Keys of one layer split into KV heads: fp32 `[H, T, d]` from `kv [2, L, T, H*d]`.

    Raises:
        ValueError: `kv` not `[2, L, T, D]`, or `head_dim` not dividing `D`.
    """
    check_key_heads(kv, head_dim)
    T = kv.shape[2]
    return kv[0, layer].float().view(T, -1, head_dim).transpose(0, 1)


def knorm_scores(kv: torch.Tensor, *, head_dim: int) -> torch.Tensor:
    """Mean key L2 norm of every token (arXiv:2406.11430), over KV heads and layers.

    Args:
        kv: `[2, L, T, D]`, keys after RoPE, `D = H * head_dim` (any float dtype).
        head_dim: `d`.

    Returns:
        fp32 `[T]` mean norms (lower = keep).
    """
    check_key_heads(kv, head_dim)
    L, T = kv.shape[1], kv.shape[2]
    norms = kv[0].float().reshape(L, T, -1, head_dim).norm(dim=-1)  # [L, T, H]: every layer and head at once
    return norms.mean(dim=2).sum(dim=0) / L


def equal_norms(norms: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the mean key norms `norms [T]` are all equal up to rounding: their spread is within
    `max(eps(dtype), 1e-5)` of the largest (keys in `dtype`; measured on tiny random QK-norm models, whose norms
    are equal: 3.6e-7 in fp32, 3.2e-3 in bf16; a model without QK-norm spreads by tens of percent)."""
    if norms.numel() < 2:
        return True
    tol = max(torch.finfo(dtype).eps, 1e-5) if dtype.is_floating_point else 1e-5
    return float(norms.max() - norms.min()) <= tol * float(norms.abs().max())


def knorm_keep(kv: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int = 0, n_sink: int = 0,
               granularity: str = "request") -> torch.Tensor:
    """Kept indices: the protected tokens plus the lowest-norm keys, `keep_count(T, drop_ratio)` in all.

    Equal norms: QK-norm models whose `k_norm` weights are all 1 (freshly initialised ones, tiny test models)
    normalise every key to the same norm, so the scores differ only by rounding (`equal_norms`). Then every token
    ties and the earliest unprotected tokens are kept (the tie rule of `keep_top_scores`: deterministic, by
    position) instead of a ranking of rounding noise. Ties of exactly equal norms go to the earlier token too.

    `granularity="head"`: each KV head's own key norms (the paper's and kvpress' set per head); `"layer"`: their
    mean over the layer's KV heads (docs/policies.md, "Granularity"); equal norms (all of them) tie as above.

    Returns LongTensor [k] (`"request"`), `[L, k]` or `[L, H, k]`, sorted on the last dim.
    """
    T = kv.shape[2]
    protected = protected_mask(T, n_sink=n_sink, window=window)
    if granularity != "request":
        return keep_top_per_head(_head_scores(kv, head_dim), keep_count(T, drop_ratio), protected, granularity)
    norms = knorm_scores(kv, head_dim=head_dim).cpu()
    scores = torch.zeros_like(norms) if equal_norms(norms, kv.dtype) else -norms
    return keep_top_scores(scores, keep_count(T, drop_ratio), protected)


def _head_scores(kv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """fp32 `[L, H, T]` on the CPU: minus each KV head's key norms (all 0 when the norms are equal, see `knorm_keep`)."""
    check_key_heads(kv, head_dim)
    T = kv.shape[2]
    norms = kv[0].float().reshape(kv.shape[1], T, -1, head_dim).norm(dim=-1).transpose(1, 2).cpu()  # [L, H, T]
    return torch.zeros_like(norms) if equal_norms(norms.flatten(), kv.dtype) else -norms


def knorm_head_scores(kv, q, *, params: KNormParams, facts):
    """KNorm's per-KV-head score (the registry's `head_scores`, for AdaKV): `(-‖k‖ fp32 [L, H, T], protected [T])`."""
    return _head_scores(kv, facts.head_dim), protected_mask(kv.shape[2], n_sink=params.n_sink, window=params.window)


register_policy(
    "knorm", params=KNormParams, needs="kv", builtin=True, granularities=GRANULARITIES, head_scores=knorm_head_scores,
    keep=lambda kv, q, r, *, params, facts, granularity="request": knorm_keep(
        kv, r, head_dim=facts.head_dim, window=params.window, n_sink=params.n_sink, granularity=granularity),
    summary="the keys with the lowest L2 norm (mean over KV heads and layers)",
    paper="Devoto et al. 2024, KNorm, arXiv:2406.11430")

__all__ = ["KNormParams", "check_key_heads", "equal_norms", "key_heads", "knorm_head_scores", "knorm_keep",
           "knorm_scores"]
