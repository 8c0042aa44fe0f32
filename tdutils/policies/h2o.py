"""H2O: keep the heavy hitters (tokens with the most accumulated attention) and a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv:2306.14048.

Score of token `j`: its attention accumulated over every prompt query that can see it,
`Σ_{i ≥ j} softmax_j(q_i · k_j / sqrt(d))` (causal, per head; `scoring.window_attention` in blocks of query
rows, so no `[Hq, T, T]` tensor is formed), the `g` query heads of each GQA group averaged, then the KV heads
and layers averaged into one score per token. Keep the `window` most recent tokens plus the `k - window` heavy
hitters among the others (ties to the earlier token). Needs the queries of *all* prompt tokens (`needs="all"`:
`[L, T, Hq*d]` per request; its memory: docs/policies.md); scoring costs `O(L * Hq * T² * d)`.

Departures from the paper: it evicts greedily at every decode step, per layer and head; here the tokens are
chosen once after prefill, one set per request (shared by all layers and heads), as the serving path needs.
Defaults: `window=None`, the paper's even split (recent tokens = heavy hitters = `k // 2`); `n_sink=0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import AttentionSpec
from ..selection import check_protected, keep_count, keep_top_scores, protected_mask
from .registry import register_policy
from .scoring import check_query, layer_attentions, model_attention, reduce_gqa, window_attention

BLOCK_ELEMENTS = 1 << 24  # fp32 attention probabilities held per block of query rows (64 MiB)


@dataclass
class H2OParams:
    """H2O parameters: recent `window` (None = half the keep count, the paper's split) and `n_sink`."""

    window: int | None = field(default=None, metadata={
        "help": "the most recent prompt tokens, always kept; unset: half the keep count (the paper's split)"})
    n_sink: int = field(default=0, metadata={"help": "the first prompt tokens, always kept (attention sinks)"})

    def __post_init__(self):
        check_protected(self.n_sink, 0 if self.window is None else self.window)


def h2o_scores(kv: torch.Tensor, q: torch.Tensor, *, head_dim: int, attention: AttentionSpec | None = None
               ) -> torch.Tensor:
    """Attention accumulated over all prompt queries (causal), per token (arXiv:2306.14048).

    Args:
        kv: `[2, L, T, D]`, keys after RoPE, `D = H * head_dim`.
        q: `[L, T, Hq * head_dim]` (or `[1, L, T, Hq*d]`): the queries of every prompt token.
        head_dim: `d`.
        attention: the model's `AttentionSpec` (scale, soft-cap, sinks, sliding window per layer); None =
            plain softmax attention with scale `head_dim ** -0.5`.

    Returns:
        fp32 `[T]`: `Σ_i att[i, j]` with the GQA group's query heads averaged, then KV heads and layers
        averaged; the scores sum to `T` (each query row sums to 1).

    Raises:
        ValueError: missing query, bad shapes, or fewer than `T` query rows (capture all prompt queries:
            `query_window=None`).
    """
    T = kv.shape[2]
    q = check_query(kv, q, T, head_dim, "H2O", what="the prompt length (H2O reads every prompt query)")
    L, h = kv.shape[1], kv.shape[3] // head_dim
    layers = layer_attentions(attention, L)
    hq = q.shape[2] // head_dim
    rows = max(1, BLOCK_ELEMENTS // (hq * T))
    total = torch.zeros(T, dtype=torch.float32, device=kv.device)
    for layer in range(L):
        acc = torch.zeros(hq, T, dtype=torch.float32, device=kv.device)
        qs = q[layer, -T:]
        for a in range(0, T, rows):
            b = min(T, a + rows)
            # rows a..b-1 are the last rows of the first b tokens: the window_attention layout
            acc[:, :b] += window_attention(kv[0, layer, :b], qs[a:b], h, layers[layer]).sum(dim=1)  # [Hq, b]
        total += reduce_gqa(acc, h, "mean").mean(dim=0)  # [Hq, T] -> [H, T] -> [T]
    return total / L


def h2o_keep(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int | None = None,
             n_sink: int = 0, attention: AttentionSpec | None = None) -> torch.Tensor:
    """Kept indices: the recent window, the sinks, and the heavy hitters, `keep_count(T, drop_ratio)` in all.

    `window=None` takes `keep_count(T, drop_ratio) // 2` recent tokens (the paper's split). Returns
    LongTensor [k], sorted ascending; `arange(T)` when nothing is dropped.
    """
    T = kv.shape[2]
    k = keep_count(T, drop_ratio)
    if k >= T:
        return torch.arange(T)
    w = k // 2 if window is None else window
    scores = h2o_scores(kv, q, head_dim=head_dim, attention=attention).cpu()
    return keep_top_scores(scores, k, protected_mask(T, n_sink=n_sink, window=w))


register_policy(
    "h2o", params=H2OParams, needs="all", builtin=True, setup=model_attention,
    keep=lambda kv, q, r, *, params, facts, attention=None: h2o_keep(
        kv, q, r, head_dim=facts.head_dim, window=params.window, n_sink=params.n_sink, attention=attention),
    summary="the recent window plus the heavy hitters: attention accumulated over all prompt queries",
    paper="Zhang et al. 2023, H2O, arXiv:2306.14048")

__all__ = ["BLOCK_ELEMENTS", "H2OParams", "h2o_keep", "h2o_scores"]
