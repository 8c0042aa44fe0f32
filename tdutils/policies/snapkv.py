"""SnapKV: keep the tokens that the last queries of the prompt (the observation window) attend to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469.

Per layer: logits of the last `w` queries against all `n` keys, causal inside the window; softmax over
the keys in fp32 — computed as the model computes them (`tdutils.attention.AttentionSpec`): its scale
(`q·k / sqrt(d)` for most families; Granite's `attention_multiplier`, Gemma's `query_pre_attn_scalar`),
logit soft-capping (Gemma 2), learned sinks in the denominator (gpt-oss) and sliding window (a window
query at position `p` votes only for keys at positions `> p - W`); the *vote* of each earlier token is its attention summed over the
`w` window rows. The `g = Hq / H` query heads of a GQA group share one KV head (query head `h` reads KV
head `h // g`), so their votes are reduced per group (`mean`, or `max`). Votes are pooled along tokens
(`avg` or `max`, stride 1, same padding) so that neighbours of a voted token survive with it, then
averaged over KV heads and layers into one score per token: one kept set for all layers and heads, as
the serving path (one token list per request) needs. Keep the `k - w` best earlier tokens plus the
whole window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, LayerAttention, masked_logits, softmax_with_sinks
from ..selection import keep_count, keep_top_scores, protected_mask


@dataclass
class SnapKVParams:
    """SnapKV parameters: observation window `w`, pooling kernel and kind, GQA reduction."""

    window: int = 64
    kernel_size: int = 5
    pooling: str = "avg"
    gqa_reduce: str = "mean"

    def __post_init__(self):  # fail when the drop function is built, not on the first request
        if int(self.window) != self.window or self.window < 1:
            raise ValueError(f"window must be a positive integer, got {self.window!r}")
        if int(self.kernel_size) != self.kernel_size or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd number >= 1 (1 = no pooling), got {self.kernel_size!r}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {self.pooling!r}")
        if self.gqa_reduce not in ("mean", "max"):
            raise ValueError(f"gqa_reduce must be 'mean' or 'max', got {self.gqa_reduce!r}")


def _check(kv: torch.Tensor, q: torch.Tensor, window: int, head_dim: int, kernel_size: int, pooling: str,
           gqa_reduce: str) -> torch.Tensor:
    if q is None:
        raise ValueError("SnapKV needs the query tensor (CacheKind.QUERY): the hf engine captures it at prefill "
                         "when query_window >= window and discards it after the first modify (it belongs to the "
                         "unedited prompt; prefill again to edit anew); the lmcache engine needs the vLLM query "
                         "patch and transfer_query")
    if q.dim() == 4 and q.shape[0] == 1:  # LMCache returns [1, L, Tq, Hq*d]
        q = q[0]
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"kv must have shape [2, L, T, D], got {tuple(kv.shape)}")
    if q.dim() != 3 or q.shape[0] != kv.shape[1]:
        raise ValueError(f"q must have shape [L, Tq, Hq*d] with L = {kv.shape[1]}, got {tuple(q.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if q.shape[1] < window:
        raise ValueError(f"the query holds {q.shape[1]} rows but the observation window is {window}; capture at "
                         f"least `window` final queries (hf engine: query_window >= {window})")
    if kv.shape[3] % head_dim or q.shape[2] % head_dim:
        raise ValueError(f"head_dim {head_dim} divides neither D={kv.shape[3]} nor Hq*d={q.shape[2]}")
    h, hq = kv.shape[3] // head_dim, q.shape[2] // head_dim
    if hq % h:
        raise ValueError(f"{hq} query heads are not a multiple of {h} KV heads (GQA)")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be an odd number >= 1 (1 = no pooling), got {kernel_size}")
    if pooling not in ("avg", "max"):
        raise ValueError(f"pooling must be 'avg' or 'max', got {pooling!r}")
    if gqa_reduce not in ("mean", "max"):
        raise ValueError(f"gqa_reduce must be 'mean' or 'max', got {gqa_reduce!r}")
    return q


def window_logits(k: torch.Tensor, q: torch.Tensor, n_kv_heads: int, layer: LayerAttention | None = None
                  ) -> torch.Tensor:
    """The model's attention logits of the window queries over all keys of one layer, masked to `-inf` where
    the model's attention hides a key (causal inside the window; outside a sliding window).

    Args:
        k: `[T, H*d]` keys (any float dtype), key `j` at position `j` (an unedited cache).
        q: `[w, Hq*d]` the last `w` queries (row `i` is token `T - w + i`).
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
        the softmax is dropped, as the model drops it).
    """
    logits = window_logits(k, q, n_kv_heads, layer)
    return softmax_with_sinks(logits, None if layer is None else layer.sinks)


def _layers(attention: AttentionSpec | None, num_layers: int) -> list:
    """Per-layer `LayerAttention` (None entries = plain attention); checks the layer count and sink values."""
    if attention is None:
        return [None] * num_layers
    if len(attention.layers) != num_layers:
        raise ValueError(f"the attention spec has {len(attention.layers)} layers but the KV has {num_layers}")
    attention.check_sinks()
    return list(attention.layers)


def pool_tokens(x: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool `[..., n]` along the last axis: stride 1, same padding (avg counts the zero padding, as SnapKV)."""
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


def snapkv_scores(kv: torch.Tensor, q: torch.Tensor, *, head_dim: int, window: int = 64, kernel_size: int = 5,
                  pooling: str = "avg", gqa_reduce: str = "mean", attention: AttentionSpec | None = None
                  ) -> torch.Tensor:
    """SnapKV score of every token before the observation window (arXiv:2404.14469).

    Args:
        kv: `[2, L, T, D]` KV of one request, keys after RoPE, `D = H * head_dim` (any float dtype).
        q: `[L, Tq, Hq * head_dim]` (or `[1, L, Tq, Hq*d]`) queries aligned to the end of the KV, `Tq >= window`.
        head_dim: `d`.
        window: `w`, the observation window (the last `w` prompt tokens).
        kernel_size: odd pooling kernel along tokens (1 = no pooling).
        pooling: `"avg"` or `"max"`.
        gqa_reduce: how the `g` query heads of a KV group combine their votes, `"mean"` or `"max"`.
        attention: the model's `AttentionSpec` (scale, soft-cap, sinks, sliding window per layer); None =
            plain softmax attention with scale `head_dim ** -0.5` in every layer.

    Returns:
        fp32 `[T - w]` scores (higher = keep); empty when `T <= w`.

    Raises:
        ValueError: missing query, bad shapes, `Tq < window`, even kernel, unknown pooling / reduction, an
            `attention` spec of another layer count or with unknown sink values.
    """
    q = _check(kv, q, window, head_dim, kernel_size, pooling, gqa_reduce)
    layers = _layers(attention, kv.shape[1])
    L, T = kv.shape[1], kv.shape[2]
    n = T - window
    if n <= 0:
        return torch.zeros(0, dtype=torch.float32, device=kv.device)
    h = kv.shape[3] // head_dim
    total = torch.zeros(n, dtype=torch.float32, device=kv.device)
    for layer in range(L):  # one layer at a time: the [Hq, w, T] probabilities are the big temporary
        probs = window_attention(kv[0, layer], q[layer, -window:], h, layers[layer])  # [Hq, w, T]
        vote = probs[:, :, :n].sum(dim=1)  # [Hq, n]
        vote = vote.view(h, -1, n)  # [H, g, n]
        vote = vote.mean(dim=1) if gqa_reduce == "mean" else vote.amax(dim=1)  # [H, n]
        total += pool_tokens(vote, kernel_size, pooling).mean(dim=0)
    return total / L


def snapkv_keep(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int = 64,
                kernel_size: int = 5, pooling: str = "avg", gqa_reduce: str = "mean",
                attention: AttentionSpec | None = None) -> torch.Tensor:
    """Kept indices: the whole window plus the `keep_count(T, drop_ratio) - w` best-scored earlier tokens.

    Returns `arange(T)` when `T <= w` (nothing can be dropped). LongTensor [k], sorted.
    """
    T = kv.shape[2]
    k = keep_count(T, drop_ratio)
    if T <= window:  # the whole prompt is the observation window
        return torch.arange(T)
    scores = snapkv_scores(kv, q, head_dim=head_dim, window=window, kernel_size=kernel_size, pooling=pooling,
                           gqa_reduce=gqa_reduce, attention=attention)
    full = torch.cat([scores.cpu(), torch.zeros(window)])  # window slots are protected below
    return keep_top_scores(full, k, protected_mask(T, window=window))
