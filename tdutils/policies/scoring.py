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
  last `w` queries; `window_column_sums`: those probabilities summed over the window rows, `[B, Hq, T]` for a
  batch of layers (`layer_batches`), fused for plain softmax layers; `reduce_gqa`: `[Hq, ...] -> [H, ...]` over
  each GQA group (mean or max).
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


def model_attention(facts) -> dict:
    """`setup` of the query-aware policies: `{"attention": AttentionSpec}`, the model's own attention
    (`ModelFacts.attention`: scale, soft-cap, sinks, sliding windows), computed once when the drop function is
    built, not per request.

    Args:
        facts: the model's `tdutils.models.ModelFacts` (what `make_drop_fn` hands every `setup`).
    """
    return {"attention": facts.attention}


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


# layers of one request scored in one batch by `window_column_sums`: at most this many fp32 logits (4 MiB: on a CPU
# larger batches are slower, their temporaries falling out of cache and out of the memory the allocator reuses)
BATCH_ELEMENTS = 1 << 20


def plain_attention(layer: LayerAttention | None) -> bool:
    """The layer's attention is a scaled softmax and nothing more (no soft-cap, sliding window or sinks), as in
    most models: `window_column_sums` then takes its fused path."""
    return layer is None or (layer.softcap is None and layer.sliding_window is None and layer.sinks is None
                             and not layer.has_sinks)


def same_attention(layers: list) -> bool:
    """Every layer computes its logits alike (same scale, soft-cap and window; no learned sinks, whose values
    differ per layer): one batched computation then serves them all."""
    if all(layer is None for layer in layers):
        return True
    if any(layer is None or layer.has_sinks or layer.sinks is not None for layer in layers):
        return False
    first = layers[0]
    return all((x.scaling, x.softcap, x.sliding_window) == (first.scaling, first.softcap, first.sliding_window)
               for x in layers)


def window_column_sums(k: torch.Tensor, q: torch.Tensor, n_kv_heads: int, layer: LayerAttention | None = None
                       ) -> torch.Tensor:
    """Attention of the window queries summed over the window rows: `window_attention(k, q, ...).sum(dim=-2)`,
    for a batch of layers that share one `LayerAttention` — SnapKV's vote (Li et al. 2024, arXiv:2404.14469)
    before the GQA reduction and pooling, and TOVA's score with `w = 1` (Oren et al. 2024, arXiv:2401.06104).

    Args:
        k: `[B, T, H*d]` keys of `B` layers (any float dtype); q: `[B, w, Hq*d]` their last `w` queries (row `i` is
            token `T - w + i`), `w <= T`.
        n_kv_heads: `H`; query head `h` reads KV head `h // (Hq / H)`.
        layer: the layers' `LayerAttention`; None = scale `d ** -0.5` only.

    Returns:
        fp32 `[B, Hq, T]`: `Σ_i att[h, i, j]`, equal to `window_attention` summed over its rows up to fp32
        rounding. Plain layers (`plain_attention`) take a fused path: the scale folded into the queries, only the
        window's own `w × w` square masked (causal), `exp` in place and the column sums of the probabilities
        taken as `(1 / Z)ᵀ · exp(logits − max)`, one matmul instead of normalising every row; other layers go
        through `window_attention` (soft-cap, sliding window, sinks).
    """
    nb, T, w = k.shape[0], k.shape[1], q.shape[1]
    if not plain_attention(layer):
        return torch.stack([window_attention(k[b], q[b], n_kv_heads, layer).sum(dim=1) for b in range(nb)])
    if w > T:
        raise ValueError(f"{w} window queries for {T} keys: the window queries are the last prompt tokens, so w <= T")
    scale = _logit_scale(k.shape[2] // n_kv_heads, layer)
    s = _grouped_logits(k, q.float() * scale, n_kv_heads)  # [H, B, g, w, T]
    above = torch.ones(w, w, dtype=torch.bool, device=k.device).triu_(1)  # a key after the query: hidden
    s[..., T - w:].masked_fill_(above, float("-inf"))
    s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # every row sees its own key: the max is finite
    inv = s.sum(dim=-1, keepdim=True).reciprocal_().transpose(-1, -2)  # [H, B, g, 1, w]
    out = (inv @ s)[..., 0, :]  # [H, B, g, T]
    return out.permute(1, 0, 2, 3).reshape(nb, -1, T)  # [B, Hq, T]: query head h*g+j at h*g+j


def _logit_scale(head_dim: int, layer: LayerAttention | None) -> float:
    """The logit scale of a layer: its `scaling`, or `head_dim ** -0.5` for plain attention (None)."""
    return head_dim ** -0.5 if layer is None else layer.scaling


def _grouped_logits(k: torch.Tensor, q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Raw dot products of queries with keys for a batch of layers, grouped by KV head: fp32 `[H, B, g, w, T]`.

    Args:
        k: `[B, T, H*d]` keys (any float dtype); q: `[B, w, Hq*d]` queries (any float dtype); query head
            `h*g + j` reads KV head `h`, `g = Hq / H`.

    One batched matmul per KV head over the `B` layers, reading each head's keys in place (strided; never
    copied `g` times, nor gathered into a `[B, H, T, d]` copy) and writing into one contiguous result.
    """
    nb, T, w = k.shape[0], k.shape[1], q.shape[1]
    d = k.shape[2] // n_kv_heads
    g = q.shape[2] // d // n_kv_heads
    kf = k.float()
    qh = q.float().view(nb, w, n_kv_heads, g, d)
    out = torch.empty(n_kv_heads, nb, g * w, T, dtype=torch.float32, device=k.device)
    for h in range(n_kv_heads):
        qg = qh[:, :, h].transpose(1, 2).reshape(nb, g * w, d)  # [B, g*w, d] (a small copy)
        torch.bmm(qg, kf[:, :, h * d:(h + 1) * d].transpose(1, 2), out=out[h])
    return out.view(n_kv_heads, nb, g, w, T)


def layer_batches(layers: list, rows: int, cols: int, heads: int):
    """Slices `a:b` of the layers that `window_column_sums` scores together: consecutive layers of one
    attention (all of them when `same_attention`), at most `BATCH_ELEMENTS` logits (`heads × rows × cols` per
    layer) a batch; yields `(a, b, layer)`."""
    L = len(layers)
    if not same_attention(layers):
        yield from ((i, i + 1, layers[i]) for i in range(L))
        return
    step = max(1, BATCH_ELEMENTS // max(1, heads * rows * cols))
    for a in range(0, L, step):
        yield a, min(L, a + step), layers[a]


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


__all__ = ["BATCH_ELEMENTS", "GQA_REDUCTIONS", "POOLINGS", "GQAReduce", "Pooling", "check_query", "layer_attentions",
           "layer_batches", "model_attention", "plain_attention", "pool_tokens", "reduce_gqa", "same_attention",
           "window_attention", "window_column_sums", "window_logits"]
