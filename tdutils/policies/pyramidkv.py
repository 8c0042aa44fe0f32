"""PyramidKV: more tokens kept in the lower layers, fewer in the upper ones; SnapKV's selection per KV head.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", arXiv:2406.02069; as
NVIDIA kvpress' `PyramidKVPress` (the definition implemented, after KVCache-Factory's `pyramidkv_utils.py`). With
`T` prompt tokens, window `w`, drop ratio `r`, `L` layers and steepness `beta`:

    cap = w + T (1 - r);  lo = (cap - w) / beta;  hi = 2 (cap - w) - lo
    if hi >= T - w:  hi = T - w;  lo = 2 (cap - w) - hi
    k_l = round(hi - l (hi - lo) / (L - 1))            for layer l = 0 .. L-1
    (k_l = round(T (1 - r)) in every layer unless T >= hi >= lo >= w, or when L = 1)

so the per-layer budgets fall linearly and sum to about `L · T (1 - r)`. Each layer keeps, per KV head, its
`k_l` best tokens by SnapKV's pooled window votes (`tdutils.policies.snapkv`), the window (and the last token)
included. Counts differ between layers: the sets are padded (`tdutils.selection.pack_sets`) and the `hf` engine
stores every layer at the largest count (docs/policies.md, "Unequal counts").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..selection import pack_sets
from .params import check_int
from .registry import register_policy
from .scoring import model_attention
from .snapkv import SnapKVParams, snapkv_head_scores


@dataclass
class PyramidKVParams(SnapKVParams):
    """SnapKV's parameters plus `beta`, the pyramid's steepness (kvpress' default 20)."""

    beta: int = field(default=20, metadata={"help": "steepness of the pyramid: the top layer keeps about 1/beta of "
                                                    "the mean budget"})

    def __post_init__(self):
        super().__post_init__()
        check_int(self.beta, "beta", 1)


def pyramid_budgets(T: int, drop_ratio: float, num_layers: int, window: int, beta: int = 20) -> list[int]:
    """Tokens kept per layer (the module docstring's formula, kvpress `PyramidKVPress.get_layer_budget`).

    Returns:
        `num_layers` ints, layer 0 first, each in `[1, T]`.
    """
    cap = window + T * (1 - drop_ratio)
    lo = (cap - window) / beta
    hi = (cap - window) * 2 - lo
    if hi >= T - window:
        hi = T - window
        lo = (cap - window) * 2 - hi
    if num_layers < 2 or not (T >= hi >= lo >= window):
        return [max(1, round(T * (1 - drop_ratio)))] * num_layers
    steps = (hi - lo) / (num_layers - 1)
    return [min(T, max(1, round(hi - layer * steps))) for layer in range(num_layers)]


def _keep(kv, q, drop_ratio, *, params: PyramidKVParams, facts, attention=None):
    scores, protected = snapkv_head_scores(kv, q, params=params, facts=facts, attention=attention)
    L, H, T = scores.shape
    s = scores.clone()
    s[..., protected] = float("inf")
    s[..., -1] = float("inf")  # decode feeds the last token again: every head keeps it
    order = torch.sort(-s, dim=-1, stable=True).indices  # [L, H, T]
    budgets = torch.tensor(pyramid_budgets(T, drop_ratio, L, params.window, params.beta))
    need = int(protected.sum()) + int(not protected[-1])
    budgets = budgets.clamp(min=need)[:, None, None]  # [L, 1, 1]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T).expand(L, H, T))  # each token's rank
    return pack_sets(rank < budgets)


register_policy("pyramidkv", params=PyramidKVParams, needs="window", keep=_keep, builtin=True,
                setup=model_attention, per_head_only=True,
                summary="SnapKV per KV head with per-layer budgets falling linearly from the first layer to the last",
                paper="Cai et al. 2024, PyramidKV, arXiv:2406.02069 (as kvpress PyramidKVPress)")

__all__ = ["PyramidKVParams", "pyramid_budgets"]
