"""KeyDiff: keep the keys least similar to the mean key.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv:2504.15364.

The paper observes that keys pointing away from the others (low cosine similarity to an anchor, the mean key
direction) draw attention and are worth keeping; keys close to the anchor are redundant. Implemented here: per
layer and KV head, the anchor `a = mean_t k̂_t` of the unit keys `k̂ = k / ‖k‖` (`anchor="normalized"`, as
kvpress's `KeyDiffPress`; `anchor="raw"` uses the mean of the keys themselves), the score of token `t` is
`cos(k_t, a)`; scores averaged over KV heads and layers; keep the `k` tokens with the lowest mean cosine (ties
to the earlier token). Query-free: KV only (no query capture; a stock vLLM on the serving path) + `head_dim`.

Departures from the paper: it evicts block by block while prefilling, per layer and head; here the whole
prompt is scored at once after prefill, one set per request (shared by all layers and heads), as the serving
path needs (`granularity="layer" | "head"`: one set per layer or per KV head). Defaults: `window=0`, `n_sink=0` (kvpress protects no token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from ..selection import (
    GRANULARITIES,
    check_protected,
    keep_count,
    keep_top_per_head,
    keep_top_scores,
    protected_mask,
)
from .knorm import key_heads
from .params import check_choice
from .registry import register_policy

Anchor = Literal["normalized", "raw"]
ANCHORS = get_args(Anchor)


@dataclass
class KeyDiffParams:
    """KeyDiff parameters: protected tokens (`window` last, `n_sink` first) and the anchor kind."""

    window: int = field(default=0, metadata={"help": "the most recent prompt tokens, always kept"})
    n_sink: int = field(default=0, metadata={"help": "the first prompt tokens, always kept (attention sinks)"})
    anchor: Anchor = field(default="normalized", metadata={
        "help": "the anchor keys are compared with: the mean of the unit keys (normalized) or of the keys (raw)"})

    def __post_init__(self):
        check_protected(self.n_sink, self.window)
        check_choice(self.anchor, "anchor", ANCHORS)


def keydiff_scores(kv: torch.Tensor, *, head_dim: int, anchor: Anchor = "normalized") -> torch.Tensor:
    """Mean cosine similarity of every key to its head's anchor (arXiv:2504.15364), over KV heads and layers.

    Args:
        kv: `[2, L, T, D]`, keys after RoPE, `D = H * head_dim` (any float dtype).
        head_dim: `d`.
        anchor: `"normalized"` (mean of unit keys) or `"raw"` (mean key).

    Returns:
        fp32 `[T]` (lower = keep). A zero key has similarity 0.

    Raises:
        ValueError: bad shapes or an unknown anchor.
    """
    check_choice(anchor, "anchor", ANCHORS)
    return _scores(kv, head_dim, anchor)


def _scores(kv: torch.Tensor, head_dim: int, anchor: Anchor) -> torch.Tensor:
    # `anchor` checked (by `keydiff_scores`, or when the drop function was built)
    total = torch.zeros(kv.shape[2], dtype=torch.float32, device=kv.device)
    for cos in _head_cosines(kv, head_dim, anchor):
        total += cos.mean(dim=0)  # mean over heads
    return total / kv.shape[1]


def _head_cosines(kv: torch.Tensor, head_dim: int, anchor: Anchor):
    """Each key's cosine similarity to its KV head's anchor, layer by layer: yields fp32 `[H, T]`."""
    for layer in range(kv.shape[1]):
        k = key_heads(kv, layer, head_dim)  # [H, T, d]
        unit = F.normalize(k, dim=-1)
        a = (unit if anchor == "normalized" else k).mean(dim=1, keepdim=True)  # [H, 1, d]
        yield (unit * F.normalize(a, dim=-1)).sum(dim=-1)  # [H, T]


def keydiff_keep(kv: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int = 0, n_sink: int = 0,
                 anchor: Anchor = "normalized", granularity: str = "request") -> torch.Tensor:
    """Kept indices: the protected tokens plus the keys least similar to the anchor, `keep_count(T, r)` in all.

    `granularity="head"`: each KV head's own cosines (kvpress' `KeyDiffPress` set per head); `"layer"`: their
    mean over the layer's KV heads (docs/policies.md, "Granularity").

    Returns LongTensor [k] (`"request"`), `[L, k]` or `[L, H, k]`, sorted on the last dim. Raises ValueError for
    bad parameters (`KeyDiffParams`).
    """
    return _keep(kv, drop_ratio, KeyDiffParams(window, n_sink, anchor), head_dim, granularity)


def _keep(kv: torch.Tensor, drop_ratio: float, p: KeyDiffParams, head_dim: int, granularity: str = "request"
          ) -> torch.Tensor:
    T = kv.shape[2]
    protected = protected_mask(T, n_sink=p.n_sink, window=p.window)
    if granularity != "request":
        cos = torch.stack(list(_head_cosines(kv, head_dim, p.anchor))).cpu()  # [L, H, T]
        return keep_top_per_head(-cos, keep_count(T, drop_ratio), protected, granularity)
    scores = -_scores(kv, head_dim, p.anchor).cpu()
    return keep_top_scores(scores, keep_count(T, drop_ratio), protected)


register_policy(
    "keydiff", params=KeyDiffParams, needs="kv", builtin=True, granularities=GRANULARITIES,
    keep=lambda kv, q, r, *, params, facts, granularity="request": _keep(kv, r, params, facts.head_dim, granularity),
    summary="the keys least similar (cosine) to the mean key direction",
    paper="Park et al. 2025, KeyDiff, arXiv:2504.15364")

__all__ = ["ANCHORS", "KeyDiffParams", "keydiff_keep", "keydiff_scores"]
