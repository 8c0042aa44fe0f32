"""Attention from captured queries: the scoring arithmetic the query-aware policies share.

SnapKV (Li et al. 2024, arXiv:2404.14469), R-KV (Cai et al. 2025, arXiv:2505.24133), H2O (Zhang et al.
2023, arXiv:2306.14048) and TOVA (Oren et al. 2024, arXiv:2401.06104) all score a token by the attention
that some prompt queries pay it, recomputed here from the KV cache (keys after RoPE) and the query rows the
engine captured at prefill, as the model computes it (`tdutils.attention.AttentionSpec`: its scale, logit
soft-capping, learned sinks and sliding windows), one layer at a time. Shapes: `kv [2, L, T, H*d]` (any
float dtype), `q [L, Tq, Hq*d]` aligned to the end of the KV (row `i` is token `T - Tq + i`); query head `h`
reads KV head `h // g`, `g = Hq / H`. Probabilities are fp32; bad shapes or no query raise `ValueError`.

- `check_query`: a request's KV and captured query checked and put in the `[L, Tq, Hq*d]` layout.
- `model_attention`: these policies' `setup` (the model's attention, once per drop function), per layer
  by `layer_attentions`; `window_logits` / `window_attention`: logits / probabilities `[Hq, w, T]` of the
  last `w` queries; `reduce_gqa`: `[Hq, ...] -> [H, ...]` over each GQA group (mean or max).
- `pool_tokens`: 1-D pooling along tokens (SnapKV's and R-KV's smoothing of the votes).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, LayerAttention, masked_logits, softmax_with_sinks

Pooling = Literal["avg", "max"]
POOLINGS = get_args(Pooling)
GQAReduce = Literal["mean", "max"]
GQA_REDUCTIONS = get_args(GQAReduce)


def check_query(kv: torch.Tensor, q: torch.Tensor | None, rows: int, head_dim: int, who: str = "SnapKV",
                what: str | None = None) -> torch.Tensor:
    """Validate a request's KV and captured query for a query-aware policy; returns `q` as `[L, Tq, Hq*d]`.

    Args:
        kv: `[2, L, T, D]`.
        q: `[L, Tq, Hq*d]` or `[1, L, Tq, Hq*d]` (LMCache's layout), or None.
        rows: query rows the policy reads (the last `rows` prompt tokens), `Tq >= rows` required.
        head_dim: `d`.
        who: the policy's name, for messages.
        what: what `rows` is called in the message (default: "the observation window").

    Raises:
        ValueError: no query (with how to capture it), bad shapes, too few rows, head counts that do not
            divide (GQA).
    """
    if q is None:
        raise ValueError(f"{who} needs the query tensor (CacheKind.QUERY): the hf engine captures it at prefill "
                         f"when query_window >= {rows} (None: all prompt tokens) and discards it after the first "
                         "modify (it belongs to the unedited prompt; prefill again to edit anew); the lmcache engine "
                         "needs the vLLM query patch and transfer_query")
    if q.dim() == 4 and q.shape[0] == 1:  # LMCache returns [1, L, Tq, Hq*d]
        q = q[0]
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"kv must have shape [2, L, T, D], got {tuple(kv.shape)}")
    if q.dim() != 3 or q.shape[0] != kv.shape[1]:
        raise ValueError(f"q must have shape [L, Tq, Hq*d] with L = {kv.shape[1]}, got {tuple(q.shape)}")
    if rows < 1:
        raise ValueError(f"window must be >= 1, got {rows}")
    if q.shape[1] < rows:
        raise ValueError(f"the query holds {q.shape[1]} rows but {what or 'the observation window'} is {rows}; capture "
                         f"at least {rows} final queries (hf engine: query_window >= {rows}, or None for all)")
    if kv.shape[3] % head_dim or q.shape[2] % head_dim:
        raise ValueError(f"head_dim {head_dim} divides neither D={kv.shape[3]} nor Hq*d={q.shape[2]}")
    h, hq = kv.shape[3] // head_dim, q.shape[2] // head_dim
    if hq % h:
        raise ValueError(f"{hq} query heads are not a multiple of {h} KV heads (GQA)")
    return q


def model_attention(model_config) -> dict:
    """`setup` of the query-aware policies: `{"attention": AttentionSpec}`, the model's own attention
    (`tdutils.attention.scoring_attention`: scale, soft-cap, sinks, sliding windows), computed once when the drop
    function is built, not per request."""
    from ..attention import scoring_attention

    return {"attention": scoring_attention(model_config)}


def layer_attentions(attention: AttentionSpec | None, num_layers: int) -> list[LayerAttention | None]:
    """Per-layer `LayerAttention` of `attention` (`[None] * num_layers` = plain attention, scale `d ** -0.5`).

    Raises:
        ValueError: the spec has another layer count than the KV, or learned sinks whose values are unknown.
    """
    if attention is None:
        return [None] * num_layers
    if len(attention.layers) != num_layers:
        raise ValueError(f"the attention spec has {len(attention.layers)} layers but the KV has {num_layers}")
    attention.check_sinks()
    return list(attention.layers)


def window_logits(k: torch.Tensor, q: torch.Tensor, n_kv_heads: int, layer: LayerAttention | None = None
                  ) -> torch.Tensor:
    """The model's attention logits of the window queries over all keys of one layer, masked to `-inf` where
    the model's attention hides a key (causal inside the window; outside a sliding window).

    Args:
        k: `[T, H*d]` keys (any float dtype), key `j` at position `j` (an unedited cache).
        q: `[w, Hq*d]` the last `w` queries (row `i` is token `T - w + i`), `w <= T`.
        n_kv_heads: `H`; query head `h` reads KV head `h // (Hq / H)`.
        layer: the layer's `LayerAttention` (scale, soft-cap, sliding window); None = scale `d ** -0.5` only.

    Returns:
        fp32 `[Hq, w, T]`.
    """
    T, w = k.shape[0], q.shape[0]
    if w > T:
        raise ValueError(f"{w} window queries for {T} keys: the window queries are the last prompt tokens, so w <= T")
    d = k.shape[1] // n_kv_heads
    hq = q.shape[1] // d
    g = hq // n_kv_heads
    kh = k.float().view(T, n_kv_heads, d).transpose(0, 1)  # [H, T, d]
    qh = q.float().view(w, hq, d).transpose(0, 1)  # [Hq, w, d]
    # query head h reads KV head h // g: group the query heads instead of copying the keys g times
    qk = (qh.reshape(n_kv_heads, g * w, d) @ kh.transpose(1, 2)).view(hq, w, T)  # [Hq, w, T]
    if layer is None:
        layer = LayerAttention(d ** -0.5)
    pos = torch.arange(T, device=k.device)
    return masked_logits(qk, layer, pos[T - w:], pos)


def window_attention(k: torch.Tensor, q: torch.Tensor, n_kv_heads: int, layer: LayerAttention | None = None
                     ) -> torch.Tensor:
    """Attention probabilities of the window queries over all keys of one layer, as the model computes them.

    Args:
        k, q, n_kv_heads, layer: as `window_logits`.

    Returns:
        fp32 `[Hq, w, T]`: each row sums to 1, or to less when the layer has learned sinks (their share of
        the softmax is dropped, as the model drops it); rows with every key masked are zeros.
    """
    logits = window_logits(k, q, n_kv_heads, layer)
    return softmax_with_sinks(logits, None if layer is None else layer.sinks)


def reduce_gqa(x: torch.Tensor, n_kv_heads: int, how: GQAReduce = "mean") -> torch.Tensor:
    """Combine the `g = Hq / H` query heads of each GQA group: `[Hq, ...] -> [H, ...]` by `"mean"` or `"max"`.

    Query heads `h*g .. h*g + g - 1` read KV head `h` (transformers' `repeat_kv` order). Any dtype.
    """
    grouped = x.view(n_kv_heads, -1, *x.shape[1:])  # [H, g, ...]
    return grouped.mean(dim=1) if how == "mean" else grouped.amax(dim=1)


def pool_tokens(x: torch.Tensor, kernel_size: int, pooling: Pooling) -> torch.Tensor:
    """Pool `[..., n]` along the last axis with an odd `kernel_size`: stride 1, same padding, so the shape is
    kept (`"avg"` counts the zero padding, as SnapKV's code does; `"max"`). `kernel_size=1` returns `x`."""
    if kernel_size == 1:
        return x
    shape = x.shape
    x = x.reshape(-1, 1, shape[-1])
    pad = kernel_size // 2
    if pooling == "avg":
        x = F.avg_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        x = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    return x.reshape(shape)


__all__ = ["GQA_REDUCTIONS", "POOLINGS", "GQAReduce", "Pooling", "check_query", "layer_attentions", "model_attention",
           "pool_tokens", "reduce_gqa", "window_attention", "window_logits"]
