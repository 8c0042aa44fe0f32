"""ExpectedAttention: keep the keys that the *future* queries are expected to attend to (query-agnostic).

NVIDIA kvpress, `ExpectedAttentionPress` (Devoto et al., "Expected Attention: KV cache compression by estimating
attention from future queries distribution", arXiv:2510.00636; the press's docstring is the definition). Per
layer, from the prompt's own queries (the question need not be in the cache):

1. the mean `μ` and covariance `Σ` over tokens of the queries *before* RoPE, each query head on its own, the
   first `n_sink` tokens left out (their hidden states are outliers);
2. the RoPE rotation averaged over the next `n_future_positions` positions `T .. T + F - 1`,
   `R̄ = mean_p R(p)` (not a rotation: the average shrinks the fast channels), applied as `μ' = R̄ μ` and
   `Σ' = R̄ Σ R̄ᵀ`;
3. for a Gaussian query `q ~ N(μ', Σ')` the expected `exp(q·k / √d)` is `exp(μ'·k / √d + kᵀ Σ' k / (2d))`: the
   score of key `k_t` (after RoPE, as cached) is that exponent, softmaxed over the keys after the sinks, then
   averaged over the query heads of each KV head;
4. with `use_vnorm`, rescaled by the value norm: `(score + epsilon) · ‖v_t‖₂`.

The first `n_sink` tokens are kept (kvpress gives them the top score). kvpress scores and keeps per KV head
(`granularity="head"`); `"layer"` averages a layer's KV-head scores, `"request"` averages them over heads and
layers (docs/policies.md, "Granularity"). kvpress' leaderboard entry "expected_attention" is AdaKV on top of this
score with `epsilon=1e-2`: `adakv_expected_attention` (`tdutils.policies.adakv`).

Queries: the captured post-RoPE queries of every prompt token (`needs="all"`, as H2O), moved back to position 0
with the model's RoPE (`tdutils.rope.rerotate_keys`: exact to fp32 rounding); the rows are taken to sit at
positions `T - Tq .. T - 1`, the KV's own. The logit scale is kvpress' `1/√d`, whatever the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..rope import _model_angles, _rotate_into, rerotate_keys
from ..selection import (
    GRANULARITIES,
    check_protected,
    keep_count,
    keep_top_per_head,
    keep_top_scores,
    protected_mask,
)
from .params import check_int, is_number
from .registry import register_policy
from .reuse import reused
from .scoring import check_query


@dataclass
class ExpectedAttentionParams:
    """ExpectedAttention parameters (kvpress' names and defaults), plus a protected `window` (0 in kvpress)."""

    n_future_positions: int = field(default=512, metadata={
        "help": "future positions the RoPE rotation of the query statistics is averaged over"})
    n_sink: int = field(default=4, metadata={
        "help": "first prompt tokens kept and left out of the query statistics (attention sinks)"})
    use_covariance: bool = field(default=True, metadata={"help": "include the queries' covariance term"})
    use_vnorm: bool = field(default=True, metadata={"help": "rescale scores by the value norms"})
    epsilon: float = field(default=0.0, metadata={"help": "added to the scores before the value-norm rescaling"})
    window: int = field(default=0, metadata={"help": "the most recent prompt tokens, always kept"})

    def __post_init__(self):
        check_int(self.n_future_positions, "n_future_positions", 1)
        check_protected(self.n_sink, self.window)
        if not is_number(self.epsilon) or self.epsilon < 0:
            raise ValueError(f"epsilon must be a number >= 0, got {self.epsilon!r}")


def averaged_rotation(spec, start: int, count: int) -> torch.Tensor:
    """`R̄ = mean over p in [start, start + count) of R(p)`, the RoPE matrix of `spec` (a `RopeSpec`) at position
    `p` with its `attention_scaling`: fp32 `[d, d]` with `R̄ x = mean_p apply_rope(x, p)` for a vector `x`."""
    phi = _model_angles(torch.arange(start, start + count), spec.inv_freq)  # [count, rd/2]
    cos = (phi.cos() * spec.attention_scaling).mean(dim=0, keepdim=True)  # [1, rd/2]
    sin = (phi.sin() * spec.attention_scaling).mean(dim=0, keepdim=True)
    eye = torch.eye(spec.head_dim)
    out = torch.empty_like(eye)
    _rotate_into(out, eye, cos, sin, spec, torch.float32)  # row j = R̄ e_j
    return out.T


@reused
def expected_attention_head_scores(kv: torch.Tensor, q: torch.Tensor, *, params: ExpectedAttentionParams, facts
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The expected-attention score of every token per KV head (the module docstring's definition).

    Args:
        kv: `[2, L, T, D]` (keys after RoPE, values), `D = H * d`, any float dtype.
        q: `[L, Tq, Hq * d]` post-RoPE queries of the last `Tq` prompt tokens (`Tq > n_sink`; every prompt token
            in kvpress: `needs="all"`).
        params: `ExpectedAttentionParams`.
        facts: the model's `ModelFacts` (`head_dim`, `rope`: a `RopeSpec` or one per layer).

    Returns:
        `(scores fp32 [L, H, T] on the CPU, protected BoolTensor [T])`; the sinks' (and window's) scores are 0,
        they are protected.

    Raises:
        ValueError: no query or bad shapes (`scoring.check_query`); `T` or `Tq` not above `n_sink`.
    """
    p, d = params, facts.head_dim
    q = check_query(kv, q, 1, d, "ExpectedAttention", "the query")
    L, T, Tq = kv.shape[1], kv.shape[2], q.shape[1]
    if T <= p.n_sink or Tq <= p.n_sink:
        raise ValueError(f"ExpectedAttention needs more than n_sink={p.n_sink} tokens and query rows, got {T} tokens, "
                         f"{Tq} query rows")
    H = kv.shape[3] // d
    scores = torch.zeros(L, H, T)
    for layer in range(L):
        spec = facts.rope[layer] if isinstance(facts.rope, list | tuple) else facts.rope
        scores[layer, :, p.n_sink:] = _layer_scores(kv[:, layer], q[layer], spec, p, T - Tq).cpu()
    return scores, protected_mask(T, n_sink=p.n_sink, window=p.window)


def _layer_scores(kv: torch.Tensor, q: torch.Tensor, spec, p: ExpectedAttentionParams, first: int) -> torch.Tensor:
    """One layer: `kv [2, T, H*d]`, `q [Tq, Hq*d]` at positions `first ..`; fp32 `[H, T - n_sink]`."""
    d = spec.head_dim
    T = kv.shape[1]
    H = kv.shape[2] // d
    qh = q[p.n_sink:].float().view(-1, q.shape[1] // d, d)  # [n, Hq, d], the rows after the sinks
    pos = torch.arange(first + p.n_sink, first + q.shape[0], device=q.device)
    pre = rerotate_keys(qh, pos, torch.zeros_like(pos), spec, token_dim=-3)  # before RoPE (position 0)
    mu = pre.mean(dim=0)  # [Hq, d]
    rbar = averaged_rotation(spec, T, p.n_future_positions).to(q.device)
    mu = mu @ rbar.T
    keys = kv[0, p.n_sink:].float().view(-1, H, d).transpose(0, 1)  # [H, n, d]
    g = mu.shape[0] // H
    keys_q = keys.repeat_interleave(g, dim=0)  # [Hq, n, d]: query head h*g+j reads KV head h
    logits = torch.einsum("hnd,hd->hn", keys_q, mu) / math.sqrt(d)
    if p.use_covariance:
        centered = pre - pre.mean(dim=0)
        cov = torch.einsum("nhi,nhj->hij", centered, centered) / pre.shape[0]  # [Hq, d, d]
        cov = rbar @ cov @ rbar.T
        logits = logits + torch.einsum("hni,hij,hnj->hn", keys_q, cov, keys_q) / d / 2
    scores = torch.softmax(logits, dim=-1).view(H, g, -1).mean(dim=1)  # [H, n]
    if p.use_vnorm:
        scores = (scores + p.epsilon) * kv[1, p.n_sink:].float().view(-1, H, d).norm(dim=-1).T
    return scores


def expected_attention_keep(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, *,
                            params: ExpectedAttentionParams, facts, granularity: str = "request") -> torch.Tensor:
    """Kept indices: the sinks (and window) plus the best-scored tokens, `keep_count(T, drop_ratio)` in all;
    `[k]`, `[L, k]` or `[L, H, k]` by `granularity`. A prompt of at most `n_sink` tokens is kept whole. Arguments and
    errors as `expected_attention_head_scores`."""
    T = kv.shape[2]
    if T <= params.n_sink:
        keep = torch.arange(T)
        shape = {"request": (T,), "layer": (kv.shape[1], T), "head": (kv.shape[1], kv.shape[3] // facts.head_dim, T)}
        return keep.expand(*shape[granularity]).clone()
    scores, protected = expected_attention_head_scores(kv, q, params=params, facts=facts)
    k = keep_count(T, drop_ratio)
    if granularity != "request":
        return keep_top_per_head(scores, k, protected, granularity)
    return keep_top_scores(scores.mean(dim=1).mean(dim=0), k, protected)


register_policy(
    "expected_attention", params=ExpectedAttentionParams, needs="all", builtin=True, granularities=GRANULARITIES,
    head_scores=expected_attention_head_scores,
    keep=lambda kv, q, r, *, params, facts, granularity="request": expected_attention_keep(
        kv, q, r, params=params, facts=facts, granularity=granularity),
    summary="the keys the future queries are expected to attend to (query statistics, averaged RoPE)",
    paper="Devoto et al. 2025, Expected Attention (NVIDIA kvpress), arXiv:2510.00636")

__all__ = ["ExpectedAttentionParams", "averaged_rotation", "expected_attention_head_scores",
           "expected_attention_keep"]
