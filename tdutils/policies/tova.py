"""TOVA: keep the tokens the last query attends to most, averaged over heads.

Oren et al., "Transformers are Multi-State RNNs" (Token Omission Via Attention), arXiv:2401.06104.

Definition in the paper: when the cache is full, drop the token with the lowest attention score of the
current (last) query, averaged over the attention heads of the layer. Implemented here once, at the end of
prefill: the attention of the last prompt query over all keys, computed by the helper SnapKV uses
(`scoring.window_column_sums`, so the model's attention arithmetic is shared), averaged over all query heads
and then over layers into one score per token; keep the `k` best (ties to the earlier token). It equals
SnapKV with window 1, no pooling and the mean over each GQA group (tested). Needs the query of the last
prompt token (`needs="window"`, one row) and the model's head counts.

Departures from the paper: it evicts one token per decode step and keeps a separate set per layer; here the
tokens are chosen once, one set per request (shared by all layers and heads), as the serving path needs; `granularity=
"layer" | "head"` keeps one set per layer or per KV head instead (docs/policies.md, "Granularity").
Defaults: `window=1` (the last token, whose query scores, is always kept; kvpress's `TOVAPress`), `n_sink=0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import AttentionSpec
from ..selection import (
    GRANULARITIES,
    check_protected,
    keep_count,
    keep_top_per_head,
    keep_top_scores,
    protected_mask,
)
from .registry import register_policy
from .scoring import (
    check_query,
    layer_attentions,
    layer_batches,
    model_attention,
    reduce_gqa,
    window_column_sums,
)


@dataclass
class TOVAParams:
    """TOVA parameters: protected most recent tokens (`window`) and first tokens (`n_sink`)."""

    window: int = field(default=1, metadata={"help": "the most recent prompt tokens, always kept"})
    n_sink: int = field(default=0, metadata={"help": "the first prompt tokens, always kept (attention sinks)"})

    def __post_init__(self):
        check_protected(self.n_sink, self.window)


def tova_scores(kv: torch.Tensor, q: torch.Tensor, *, head_dim: int, attention: AttentionSpec | None = None
                ) -> torch.Tensor:
    """Attention of the last prompt query to every token, mean over query heads and layers (arXiv:2401.06104).

    Args:
        kv: `[2, L, T, D]`, keys after RoPE, `D = H * head_dim`.
        q: `[L, Tq, Hq * head_dim]` (or `[1, L, Tq, Hq*d]`), rows aligned to the end of the KV, `Tq >= 1`;
            only the last row is read.
        head_dim: `d`.
        attention: the model's `AttentionSpec` (scale, soft-cap, sinks, sliding window per layer); None =
            plain softmax attention with scale `head_dim ** -0.5`.

    Returns:
        fp32 `[T]`, summing to 1 (less with learned sinks) (higher = keep).

    Raises:
        ValueError: missing query or bad shapes.
    """
    check_query(kv, q, 1, head_dim, "TOVA")  # before reading kv's shape
    total = torch.zeros(kv.shape[2], dtype=torch.float32, device=kv.device)
    for sums in _last_query_attention(kv, q, head_dim, attention):
        total += sums.mean(dim=1).sum(dim=0)  # [B, Hq, T] -> [T]
    return total / kv.shape[1]


def _last_query_attention(kv: torch.Tensor, q: torch.Tensor, head_dim: int, attention: AttentionSpec | None):
    """The last query's attention per query head of each batch of layers (`layer_batches`): yields fp32
    `[B, Hq, T]`."""
    q = check_query(kv, q, 1, head_dim, "TOVA")
    L, h = kv.shape[1], kv.shape[3] // head_dim
    layers = layer_attentions(attention, L)
    T, hq = kv.shape[2], q.shape[2] // head_dim
    for a, b, layer in layer_batches(layers, 1, T, hq):  # batches of layers sharing one attention
        yield window_column_sums(kv[0, a:b], q[a:b, -1:], h, layer)


def tova_keep(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int = 1,
              n_sink: int = 0, attention: AttentionSpec | None = None, granularity: str = "request") -> torch.Tensor:
    """Kept indices: the protected tokens plus the best-scored ones, `keep_count(T, drop_ratio)` in all.

    `granularity="head"`: per KV head, the attention averaged over the query heads of its GQA group; `"layer"`:
    per layer, those averaged over the layer's KV heads (docs/policies.md, "Granularity").

    Returns LongTensor [k] (`"request"`), `[L, k]` (`"layer"`) or `[L, H, k]` (`"head"`), sorted on the last dim.
    """
    T = kv.shape[2]
    protected = protected_mask(T, n_sink=n_sink, window=window)
    if granularity != "request":
        h = kv.shape[3] // head_dim
        per_head = torch.cat([reduce_gqa(s.transpose(0, 1), h, "mean").transpose(0, 1)  # [B, Hq, T] -> [B, H, T]
                              for s in _last_query_attention(kv, q, head_dim, attention)])
        return keep_top_per_head(per_head.cpu(), keep_count(T, drop_ratio), protected, granularity)
    scores = tova_scores(kv, q, head_dim=head_dim, attention=attention).cpu()
    return keep_top_scores(scores, keep_count(T, drop_ratio), protected)


register_policy(
    "tova", params=TOVAParams, needs="window", query_rows=lambda params: 1, builtin=True, setup=model_attention,
    granularities=GRANULARITIES,
    keep=lambda kv, q, r, *, params, facts, attention=None, granularity="request": tova_keep(
        kv, q, r, head_dim=facts.head_dim, window=params.window, n_sink=params.n_sink, attention=attention,
        granularity=granularity),
    summary="the tokens the last prompt query attends to most (mean over heads and layers)",
    paper="Oren et al. 2024, TOVA, arXiv:2401.06104")

__all__ = ["TOVAParams", "tova_keep", "tova_scores"]
