"""AdaKV: per-head budgets within each layer's total, on top of a per-head scorer.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
arXiv:2407.11550; as NVIDIA kvpress' `AdaKVPress` (the definition implemented): per layer, with the scorer's
per-KV-head scores `s [H, n]` and the uniform keep count `k = keep_count(n, r)`,

1. safeguard: the `floor(alpha_safeguard · k)` best tokens of every head are kept;
2. the layer keeps `H · k` tokens in all: the safeguarded ones, then the highest scores *compared across the
   layer's heads* (one top-`H·k` over the `[H, n]` scores), so a head whose scores are peaked gives budget to
   one whose scores are flat.

The scorer's protected tokens (SnapKV's window, sinks) and the last token are kept in every head first (they
count towards the safeguard, as kvpress' window scores, set to the maximum, do). Ties go to the earlier head, then
the earlier token (a stable sort over the flattened `[H · n]` scores). Counts differ between heads: the sets are
padded (`tdutils.selection.pack_sets`), and the `hf` engine stores each layer at the largest count and masks the
padding (docs/policies.md, "Unequal counts"). Departure from kvpress: `k` rounds half to even (`keep_count`), kvpress
truncates (`int(n · (1 - r))`).

Registered per scorer as kvpress' evaluation registry names them: `adakv_snapkv` (AdaKV's own Ada-SnapKV) and
`adakv_expected_attention` (kvpress' leaderboard entry "expected_attention": `epsilon=1e-2`); the parameters are the
scorer's plus `alpha_safeguard`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

import torch

from ..selection import keep_count, pack_sets
from . import expected_attention, snapkv  # noqa: F401 (the scorers register first)
from .params import is_number
from .registry import get_policy, register_policy


def adakv_keep(scores: torch.Tensor, k: int, alpha_safeguard: float = 0.2, protected: torch.Tensor | None = None
               ) -> torch.Tensor:
    """AdaKV's kept sets from per-head scores (the module docstring's allocation).

    Args:
        scores: `[L, H, n]` scores, higher = keep (ranked in fp32).
        k: the uniform keep count per head; the layer keeps `H · k` (raised to the protected tokens plus the last).
        alpha_safeguard: in [0, 1], the fraction of `k` every head keeps by its own ranking.
        protected: optional BoolTensor `[n]`, kept in every head.

    Returns:
        LongTensor `[L, H, k_max]`, unequal counts padded with -1 (`tdutils.selection.pack_sets`); every layer keeps
        `H · k` tokens in all.

    Raises:
        ValueError: `scores` not `[L, H, n]`, `alpha_safeguard` outside [0, 1].
    """
    if scores.dim() != 3:
        raise ValueError(f"per-head scores must have shape [L, H, n], got {tuple(scores.shape)}")
    _check_alpha(alpha_safeguard)
    L, H, n = scores.shape
    s = scores.detach().float().clone()
    always = torch.zeros(n, dtype=torch.bool)
    if protected is not None:
        always |= protected.cpu()
    always[-1:] = True
    k = min(n, max(int(k), int(always.sum())))
    s = s.cpu()
    s[..., always] = float("inf")
    safe = max(int(k * alpha_safeguard), int(always.sum()))
    order = torch.sort(-s, dim=-1, stable=True).indices[..., :safe]  # [L, H, safe]
    s.scatter_(-1, order, float("inf"))
    flat = torch.sort(-s.reshape(L, H * n), dim=-1, stable=True).indices[:, :H * k]  # [L, H*k] across heads
    mask = torch.zeros(L, H * n, dtype=torch.bool).scatter_(-1, flat, True).view(L, H, n)
    return pack_sets(mask)


def _check_alpha(alpha) -> None:
    if not (is_number(alpha) and 0 <= alpha <= 1):
        raise ValueError(f"alpha_safeguard must be a number in [0, 1] (the fraction of a head's budget it keeps "
                         f"whatever the other heads score), got {alpha!r}")


def _register(name: str, scorer: str, **defaults) -> None:
    base = get_policy(scorer)

    def post_init(self):
        base.params.__post_init__(self)
        _check_alpha(self.alpha_safeguard)

    # the scorer's parameters (some defaults changed) plus alpha_safeguard
    params = dataclasses.make_dataclass(
        f"AdaKV_{scorer}_Params",
        [(f.name, f.type, field(default=defaults.get(f.name, f.default), metadata=f.metadata))
         for f in dataclasses.fields(base.params)]
        + [("alpha_safeguard", float, field(default=0.2, metadata={
            "help": "fraction of a head's uniform budget it keeps by its own ranking (AdaKV's safeguard)"}))],
        namespace={"__module__": base.params.__module__,  # the scorer's annotations resolve in its module
                   "__post_init__": post_init, "__doc__": f"AdaKV over {scorer}: {scorer}'s parameters and "
                                                          "alpha_safeguard."})

    def keep(kv, q, drop_ratio, *, params, facts, **extra):
        scores, protected = base.head_scores(kv, q, params=params, facts=facts, **extra)
        return adakv_keep(scores, keep_count(kv.shape[2], drop_ratio), params.alpha_safeguard, protected)

    register_policy(name, params=params, needs=base.needs, keep=keep, setup=base.setup, query_rows=base.query_rows,
                    builtin=True, per_head_only=True,
                    summary=f"AdaKV over {scorer}: per-head budgets within each layer's total, by scores compared "
                            "across the layer's heads",
                    paper="Feng et al. 2024, Ada-KV, arXiv:2407.11550 (as kvpress AdaKVPress)")


_register("adakv_snapkv", "snapkv")
_register("adakv_expected_attention", "expected_attention", epsilon=1e-2)

__all__ = ["adakv_keep"]
