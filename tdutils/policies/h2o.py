"""H2O: keep the heavy hitters (tokens with the most accumulated attention) and a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv:2306.14048.

Score of token `j`: its attention accumulated over every prompt query that can see it,
`Σ_{i ≥ j} softmax_j(q_i · k_j / sqrt(d))` (causal, per head, with the model's attention arithmetic; computed
in blocks of query rows against the keys they can see, so no `[Hq, T, T]` tensor is formed and the causal upper
triangle is skipped: `_accumulated`), the `g` query heads of each GQA group averaged, then the KV heads
and layers averaged into one score per token. Keep the `window` most recent tokens plus the `k - window` heavy
hitters among the others (ties to the earlier token). Needs the queries of *all* prompt tokens (`needs="all"`:
`[L, T, Hq*d]` per request; its memory: docs/policies.md); scoring costs `O(L * Hq * T² * d)`.

Departures from the paper: it evicts greedily at every decode step, per layer and head; here the tokens are
chosen once after prefill, one set per request (shared by all layers and heads), as the serving path needs;
`granularity="layer" | "head"` keeps one set per layer or per KV head (docs/policies.md, "Granularity").
Defaults: `window=None`, the paper's even split (recent tokens = heavy hitters = `k // 2`); `n_sink=0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import AttentionSpec, LayerAttention, masked_logits, softmax_with_sinks
from ..selection import (
    GRANULARITIES,
    check_protected,
    keep_count,
    keep_top_per_head,
    keep_top_scores,
    protected_mask,
    repeat_keep,
)
from .registry import register_policy
from .reuse import reused, scratch
from .scoring import check_query, layer_attentions, model_attention, plain_attention, reduce_gqa

# fp32 attention probabilities held per block of query rows (4 MiB: small blocks skip most of the causal upper
# triangle and stay in memory the allocator reuses; SmolLM2-135M's 9 query heads at 2048 tokens, one thread, bf16
# keys: 57 ms per layer at 4 MiB against 77 ms at 16 MiB and 71 ms at 1 MiB, where the matmuls get too thin)
BLOCK_ELEMENTS = 1 << 20


@dataclass
class H2OParams:
    """H2O parameters: recent `window` (None = half the keep count, the paper's split) and `n_sink`."""

    window: int | None = field(default=None, metadata={
        "help": "the most recent prompt tokens, always kept; unset: half the keep count (the paper's split)"})
    n_sink: int = field(default=0, metadata={"help": "the first prompt tokens, always kept (attention sinks)"})

    def __post_init__(self):
        check_protected(self.n_sink, 0 if self.window is None else self.window)


@reused
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
    total = None
    for acc in _head_scores(kv, q, head_dim, attention):
        total = acc.mean(dim=0) if total is None else total + acc.mean(dim=0)  # [H, T] -> [T]
    return total / kv.shape[1]


def _head_scores(kv: torch.Tensor, q: torch.Tensor, head_dim: int, attention: AttentionSpec | None):
    """Accumulated attention per KV head (its GQA group's query heads averaged), layer by layer: yields fp32
    `[H, T]`. Inside `shared_scores()`, a cache that extends one scored earlier in the block (the same first `t`
    keys and queries: an evaluation's query-aware prompt is its query-agnostic context plus the question) reuses
    that one's sums and computes only query rows `t..T-1` (`_prefix_sums`): a causal query never sees later keys,
    so rows `0..t-1` attend exactly as they did."""
    T = kv.shape[2] if kv.dim() == 4 else 0
    q = check_query(kv, q, T, head_dim, "H2O", what="the prompt length (H2O reads every prompt query)")[:, -T:]
    L, h = kv.shape[1], kv.shape[3] // head_dim
    layers = layer_attentions(attention, L)
    store = scratch(f"h2o {head_dim} {attention!r}")
    start, prior = _prefix_sums(store, kv, q)
    sums = []
    for layer in range(L):
        sums.append(_accumulated(kv[0, layer], q[layer], h, layers[layer], start, None if prior is None else prior[layer]))
        yield reduce_gqa(sums[-1], h, "mean")  # [Hq, T] -> [H, T]
    if store is not None:
        store[id(kv)] = (kv, q, sums)  # held: the id stays this tensor's while the block is open


def _prefix_sums(store: dict | None, kv: torch.Tensor, q: torch.Tensor) -> tuple[int, list | None]:
    """`(t, sums)`: the longest cache scored earlier in `store` whose keys and queries are the first `t` of these
    (`kv [2, L, T, D]`, `q [L, T, Hq*d]`, compared exactly) and its per-layer `[Hq, t]` sums; `(0, None)` if none."""
    best = (0, None)
    for pk, pq, sums in (store or {}).values():
        t = pk.shape[2]
        if (best[0] < t <= kv.shape[2] and pk.shape[:2] == kv.shape[:2] and pk.shape[3] == kv.shape[3]
                and pk.dtype == kv.dtype and pq.dtype == q.dtype and pq.shape[2] == q.shape[2]
                and torch.equal(pk[:, :, t - 1], kv[:, :, t - 1]) and torch.equal(pk, kv[:, :, :t])
                and torch.equal(pq, q[:, :t])):
            best = (t, sums)
    return best


def _accumulated(k: torch.Tensor, q: torch.Tensor, n_kv_heads: int, layer: LayerAttention | None, start: int = 0,
                 prior: torch.Tensor | None = None) -> torch.Tensor:
    """`Σ_i att[h, i, j]` of one layer for every query head: fp32 `[Hq, T]` from keys `k [T, H*d]` and the queries
    of every prompt token `q [T, Hq*d]` (row `i` is token `i`); with `start`, only rows `start..T-1` are computed
    and `prior` (`[Hq, start]`, the sums of rows `0..start-1`, which see no key past `start - 1`) is added.

    Blocks of query rows `a..b-1` against the keys they can see (`..b-1`; from `a - W + 1` in a sliding-window
    layer), so the causal upper triangle is skipped but for the block's own diagonal square and no block holds
    more than about `BLOCK_ELEMENTS` probabilities. Plain layers (no soft-cap, window or sinks, as most models
    have) take a fused path: the scale folded into the queries, only the diagonal square masked, `exp` in place,
    and the column sums of the probabilities taken as `(1 / Z)ᵀ · exp(logits − max)` (one matmul per block
    instead of normalising every row); other layers go through the model's arithmetic (`masked_logits`,
    `softmax_with_sinks`), the same as `window_attention`. Both equal the definition up to fp32 rounding.
    """
    T = k.shape[0]
    d = k.shape[1] // n_kv_heads
    hq = q.shape[1] // d
    g = hq // n_kv_heads
    kh = k.float().view(T, n_kv_heads, d).transpose(0, 1).contiguous()  # [H, T, d]
    qh = q.float().view(T, n_kv_heads, g, d).permute(1, 2, 0, 3)  # [H, g, T, d]: query head h*g+j reads KV head h
    plain = plain_attention(layer)
    if plain:
        qh = qh * (d ** -0.5 if layer is None else layer.scaling)
    window = None if layer is None else layer.sliding_window
    rows = min(T, max(1, BLOCK_ELEMENTS // (hq * T)))  # never more query rows than the prompt has
    acc = torch.zeros(hq, T, dtype=torch.float32, device=k.device)
    if prior is not None:
        acc[:, :start] = prior
    pos = torch.arange(T, device=k.device)
    above = torch.ones(rows, rows, dtype=torch.bool, device=k.device).triu_(1)  # key after the query: hidden
    for a in range(start, T, rows):
        b = min(T, a + rows)
        lo = 0 if window is None else max(0, a - window + 1)
        r = b - a
        s = (qh[:, :, a:b].reshape(n_kv_heads, g * r, d) @ kh[:, lo:b].transpose(1, 2)).view(hq, r, b - lo)
        if plain:
            s[:, :, a - lo:].masked_fill_(above[:r, :r], float("-inf"))  # causal inside the diagonal square
            s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # every row sees its own key: the max is finite
            inv = s.sum(dim=-1, keepdim=True).reciprocal_().transpose(1, 2)  # [Hq, 1, r]
            acc[:, lo:b] += (inv @ s)[:, 0]
        else:
            probs = softmax_with_sinks(masked_logits(s, layer, pos[a:b], pos[lo:b]), layer.sinks)
            acc[:, lo:b] += probs.sum(dim=1)
        del s
    return acc


@reused
def _stacked_head_scores(kv, q, head_dim, attention) -> torch.Tensor:
    """fp32 `[L, H, T]` on the CPU: `_head_scores` of every layer."""
    return torch.stack(list(_head_scores(kv, q, head_dim, attention))).cpu()


def h2o_keep(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int | None = None,
             n_sink: int = 0, attention: AttentionSpec | None = None, granularity: str = "request") -> torch.Tensor:
    """Kept indices: the recent window, the sinks, and the heavy hitters, `keep_count(T, drop_ratio)` in all.

    `window=None` takes `keep_count(T, drop_ratio) // 2` recent tokens (the paper's split). Returns
    LongTensor [k], sorted ascending; `arange(T)` when nothing is dropped. `granularity="layer" | "head"`:
    `[L, k]` / `[L, H, k]` from the per-KV-head scores (docs/policies.md, "Granularity").
    """
    T = kv.shape[2]
    k = keep_count(T, drop_ratio)
    if k >= T:
        return repeat_keep(torch.arange(T), kv.shape[1], kv.shape[3] // head_dim, granularity)
    w = k // 2 if window is None else window
    if granularity != "request":
        per_head = _stacked_head_scores(kv, q, head_dim, attention)  # [L, H, T]
        return keep_top_per_head(per_head, k, protected_mask(T, n_sink=n_sink, window=w), granularity)
    scores = h2o_scores(kv, q, head_dim=head_dim, attention=attention).cpu()
    return keep_top_scores(scores, k, protected_mask(T, n_sink=n_sink, window=w))


register_policy(
    "h2o", params=H2OParams, needs="all", builtin=True, setup=model_attention, granularities=GRANULARITIES,
    keep=lambda kv, q, r, *, params, facts, attention=None, granularity="request": h2o_keep(
        kv, q, r, head_dim=facts.head_dim, window=params.window, n_sink=params.n_sink, attention=attention,
        granularity=granularity),
    summary="the recent window plus the heavy hitters: attention accumulated over all prompt queries",
    paper="Zhang et al. 2023, H2O, arXiv:2306.14048")

__all__ = ["BLOCK_ELEMENTS", "H2OParams", "h2o_keep", "h2o_scores"]
