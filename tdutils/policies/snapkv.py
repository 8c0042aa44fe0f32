"""SnapKV: keep the tokens that the last queries of the prompt (the observation window) attend to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469.

Per layer: logits of the last `w` queries against all `n` keys, causal inside the window; softmax over the
keys in fp32 — computed as the model computes them (`scoring.window_attention` over the model's
`tdutils.attention.AttentionSpec`): its scale (`q·k / sqrt(d)` for most families; Granite's
`attention_multiplier`, Gemma's `query_pre_attn_scalar`), logit soft-capping (Gemma 2), learned sinks in the
denominator (gpt-oss) and sliding window (a window query at position `p` votes only for keys at positions
`> p - W`); the *vote* of each earlier token is its attention summed over the `w` window rows
(`scoring.window_column_sums`, several layers per batch). The
`g = Hq / H` query heads of a GQA group share one KV head (query head `h` reads KV head `h // g`), so their
votes are reduced per group (`mean`, or `max`). Votes are pooled along tokens (`avg` or `max`, stride 1, same
padding) so that neighbours of a voted token survive with it, then averaged over KV heads and layers into one
score per token: one kept set for all layers and heads, as the serving path (one token list per request)
needs. Keep the `k - w` best earlier tokens plus the whole window. `granularity="head"` keeps the paper's (and
kvpress') set per KV head instead, from the pooled votes of each KV head; `"layer"` one set per layer from their
mean over the layer's KV heads (docs/policies.md, "Granularity").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import AttentionSpec
from ..selection import (
    GRANULARITIES,
    keep_count,
    keep_top_per_head,
    keep_top_scores,
    protected_mask,
    repeat_keep,
)
from .params import check_choice, check_int, check_odd_kernel
from .registry import register_policy
from .reuse import reused
from .scoring import (
    GQA_REDUCTIONS,
    POOLINGS,
    GQAReduce,
    Pooling,
    check_query,
    layer_attentions,
    layer_batches,
    model_attention,
    pool_tokens,
    window_column_sums,
)


@dataclass
class SnapKVParams:
    """SnapKV parameters: observation window `w`, pooling kernel and kind, GQA reduction."""

    window: int = field(default=64, metadata={
        "help": "the observation window: the most recent prompt tokens, whose queries vote (always kept)"})
    kernel_size: int = field(default=5, metadata={"help": "odd pooling kernel along tokens (1 = no pooling)"})
    pooling: Pooling = field(default="avg", metadata={"help": "how the votes are pooled along tokens"})
    gqa_reduce: GQAReduce = field(default="mean", metadata={
        "help": "how the query heads of a GQA group combine their votes"})

    def __post_init__(self):  # fail when the drop function is built, not on the first request
        check_int(self.window, "window", 1)
        check_odd_kernel(self.kernel_size)
        check_choice(self.pooling, "pooling", POOLINGS)
        check_choice(self.gqa_reduce, "gqa_reduce", GQA_REDUCTIONS)


def snapkv_scores(kv: torch.Tensor, q: torch.Tensor, *, head_dim: int, window: int = 64, kernel_size: int = 5,
                  pooling: Pooling = "avg", gqa_reduce: GQAReduce = "mean", attention: AttentionSpec | None = None
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
        ValueError: bad parameters (`SnapKVParams`), missing query, bad shapes, `Tq < window`, an `attention`
            spec of another layer count or with unknown sink values.
    """
    return _scores(kv, q, SnapKVParams(window, kernel_size, pooling, gqa_reduce), head_dim, attention)


def snapkv_keep(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int = 64,
                kernel_size: int = 5, pooling: Pooling = "avg", gqa_reduce: GQAReduce = "mean",
                attention: AttentionSpec | None = None) -> torch.Tensor:
    """Kept indices: the whole window plus the `keep_count(T, drop_ratio) - w` best-scored earlier tokens.

    Returns `arange(T)` when `T <= w` (nothing can be dropped). LongTensor [k], sorted. Arguments and errors
    as `snapkv_scores`.
    """
    return _keep_indices(kv, q, drop_ratio, SnapKVParams(window, kernel_size, pooling, gqa_reduce), head_dim,
                         attention)


# Below the public functions the parameters are a checked `SnapKVParams` (checked once, when built); the
# request's tensors are checked per request.
def _pooled_votes(kv: torch.Tensor, q: torch.Tensor, p: SnapKVParams, head_dim: int,
                  attention: AttentionSpec | None):
    """The pooled votes per KV head of each batch of layers (`layer_batches`): yields fp32 `[B, H, T - w]`;
    nothing when `T <= w`."""
    q = check_query(kv, q, p.window, head_dim, "SnapKV")
    layers = layer_attentions(attention, kv.shape[1])
    T = kv.shape[2]
    n = T - p.window
    if n <= 0:
        return
    h = kv.shape[3] // head_dim
    hq = q.shape[2] // head_dim
    # batches of layers (`layer_batches`): the [B, Hq, w, T] logits are the big temporary
    for a, b, layer in layer_batches(layers, p.window, T, hq):
        sums = window_column_sums(kv[0, a:b], q[a:b, -p.window:], h, layer)  # [B, Hq, T]
        grouped = sums[..., :n].reshape(b - a, h, hq // h, n)  # query head h*g+j reads KV head h
        vote = grouped.mean(dim=2) if p.gqa_reduce == "mean" else grouped.amax(dim=2)  # [B, H, n]
        yield pool_tokens(vote, p.kernel_size, p.pooling)


@reused
def _scores(kv: torch.Tensor, q: torch.Tensor, p: SnapKVParams, head_dim: int, attention: AttentionSpec | None
            ) -> torch.Tensor:
    check_query(kv, q, p.window, head_dim, "SnapKV")  # before reading kv's shape
    n = max(0, kv.shape[2] - p.window)
    total = torch.zeros(n, dtype=torch.float32, device=kv.device)
    for votes in _pooled_votes(kv, q, p, head_dim, attention):
        total += votes.mean(dim=1).sum(dim=0)
    return total / kv.shape[1]


def _keep_indices(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, p: SnapKVParams, head_dim: int,
                  attention: AttentionSpec | None, granularity: str = "request") -> torch.Tensor:
    T = kv.shape[2]
    k = keep_count(T, drop_ratio)
    if T <= p.window:  # the whole prompt is the observation window
        return repeat_keep(torch.arange(T), kv.shape[1], kv.shape[3] // head_dim, granularity)
    protected = protected_mask(T, window=p.window)
    if granularity != "request":  # the per-KV-head votes, the window's slots protected
        return keep_top_per_head(_head_votes(kv, q, p, head_dim, attention), k, protected, granularity)
    scores = _scores(kv, q, p, head_dim, attention)
    full = torch.cat([scores.cpu(), torch.zeros(p.window)])  # window slots are protected below
    return keep_top_scores(full, k, protected)


@reused
def _head_votes(kv, q, p: SnapKVParams, head_dim: int, attention) -> torch.Tensor:
    """fp32 `[L, H, T]` on the CPU: the pooled votes per KV head, 0 in the window's slots (`T > w`)."""
    votes = torch.cat(list(_pooled_votes(kv, q, p, head_dim, attention))).cpu()  # [L, H, T - w]
    return torch.cat([votes, votes.new_zeros(*votes.shape[:2], p.window)], dim=-1)


def snapkv_head_scores(kv, q, *, params: SnapKVParams, facts, attention=None):
    """SnapKV's per-KV-head score (the registry's `head_scores`, for AdaKV / PyramidKV): `(votes fp32 [L, H, T],
    protected [T])`, the pooled window votes of each KV head (0 in the window's slots, which are protected; all
    zeros and all protected when `T <= w`). Arguments and errors as `snapkv_scores`."""
    T = kv.shape[2]
    protected = protected_mask(T, window=params.window)
    check_query(kv, q, params.window, facts.head_dim, "SnapKV")
    if T <= params.window:
        return torch.zeros(kv.shape[1], kv.shape[3] // facts.head_dim, T), protected
    return _head_votes(kv, q, params, facts.head_dim, attention), protected


def _keep(kv, q, drop_ratio, *, params: SnapKVParams, facts, attention=None, granularity="request"):
    return _keep_indices(kv, q, drop_ratio, params, facts.head_dim, attention, granularity)


register_policy("snapkv", params=SnapKVParams, needs="window", keep=_keep, builtin=True, setup=model_attention,
                granularities=GRANULARITIES, head_scores=snapkv_head_scores,
                summary="the observation window plus the earlier tokens its queries attend to most (pooled vote)",
                paper="Li et al. 2024, SnapKV, arXiv:2404.14469")

__all__ = ["SnapKVParams", "snapkv_head_scores", "snapkv_keep", "snapkv_scores"]
