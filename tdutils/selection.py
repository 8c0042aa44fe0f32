"""Keep counts, protected tokens (attention sinks, observation window) and top-k selection.

Every policy in `tdutils.policies` reduces to: how many tokens to keep (`keep_count`), which tokens are
protected (always kept, winning every tie), and which of the remaining tokens to keep. The helpers here
return kept token indices as a sorted 1-D LongTensor.
"""

from __future__ import annotations

import torch

from .checks import check_drop_ratio


def keep_count(n: int, drop_ratio: float) -> int:
    """Number of tokens kept out of `n` at `drop_ratio`: `round(n * (1 - drop_ratio))`.

    Rounding is Python's `round`, i.e. half to even (as the LMCache reference), so `keep_count(5, 0.5)
    == 2` and `keep_count(7, 0.5) == 4`. `drop_ratio = 0` keeps all `n`; `drop_ratio = 1` keeps 0 (policies
    still keep their protected tokens, see `protected_mask`).

    Raises:
        ValueError: `n < 0`, or `drop_ratio` outside [0, 1] or not finite.
    """
    r = check_drop_ratio(drop_ratio)
    if int(n) != n or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    return round(int(n) * (1.0 - r))


def check_protected(n_sink=0, window=0, *, window_min: int = 0) -> None:
    """Validate protected-token counts when a policy's parameters are built (not on the first request).

    Raises:
        ValueError: `n_sink` not an integer >= 0, or `window` not an integer >= `window_min`.
    """
    for name, value, low in (("n_sink", n_sink, 0), ("window", window, window_min)):
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def protected_mask(n: int, *, n_sink: int = 0, window: int = 0) -> torch.Tensor:
    """BoolTensor [n]: True for the first `n_sink` tokens (attention sinks) and the last `window` tokens
    (the observation window, which holds the question)."""
    if n_sink < 0 or window < 0:
        raise ValueError(f"n_sink and window must be >= 0, got n_sink={n_sink}, window={window}")
    mask = torch.zeros(n, dtype=torch.bool)
    mask[: min(n_sink, n)] = True
    if window > 0:
        mask[max(0, n - window):] = True
    return mask


def keep_top_scores(scores: torch.Tensor, k: int, protected: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the `k` tokens to keep: all protected tokens, then the highest `scores` among the rest.

    Args:
        scores: [n] float scores (any dtype; ranked in fp32), higher = more worth keeping.
        k: total keep count; raised to the number of protected tokens when smaller, and to 1 when `n >= 1`
            (a cache must keep a token to decode from: at drop ratio 1 a policy with nothing protected keeps
            its single best-scored token).
        protected: optional BoolTensor [n]; protected tokens are always kept and win every tie.

    Returns:
        LongTensor [min(n, max(k, #protected, 1))] of kept indices, sorted ascending. Ties among unprotected
        tokens go to the earlier token (stable sort), so the result is deterministic.
    """
    n = scores.shape[0]
    if protected is None:
        protected = torch.zeros(n, dtype=torch.bool, device=scores.device)
    k = min(n, max(int(k), int(protected.sum()), 1))
    s = scores.detach().float().clone()
    s[protected] = float("inf")
    # Stable descending sort: among equal scores the lower index comes first.
    order = torch.sort(-s, stable=True).indices
    return torch.sort(order[:k]).values


# ------------------------------------------------------------------------------------------------ granularity
GRANULARITIES = ("request", "layer", "head")


def check_granularity(granularity) -> str:
    """Return `granularity`; ValueError unless it is `"request"`, `"layer"` or `"head"`."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES} (one kept set per request, per layer or per KV "
                         f"head), got {granularity!r}")
    return granularity


def keep_top_per_head(scores: torch.Tensor, k: int, protected: torch.Tensor | None, granularity: str
                      ) -> torch.Tensor:
    """Kept indices per layer or per KV head from per-(layer, KV head) scores (docs/policies.md, "Granularity").

    `"head"`: top-k of each KV head's own scores; `"layer"`: top-k of the mean of the layer's KV-head scores
    (`scores.mean(dim=1)`). The same `k` everywhere; the protected tokens and the last token (decode feeds it
    again at its position, so its row must be the same in every head) are kept in every set and win every tie;
    ties among the others go to the earlier token, as `keep_top_scores`.

    Args:
        scores: `[L, H, n]` float scores (ranked in fp32), higher = more worth keeping.
        k: keep count; raised to the number of protected tokens (the last one included) when smaller.
        protected: optional BoolTensor `[n]`.
        granularity: `"layer"` or `"head"`.

    Returns:
        LongTensor `[L, k]` (`"layer"`) or `[L, H, k]` (`"head"`), sorted on the last dim, on `scores`' device.

    Raises:
        ValueError: `scores` not `[L, H, n]`, or a granularity other than `"layer"` / `"head"`.
    """
    if scores.dim() != 3:
        raise ValueError(f"per-head scores must have shape [L, H, n], got {tuple(scores.shape)}")
    if granularity not in ("layer", "head"):
        raise ValueError(f"keep_top_per_head selects per 'layer' or 'head', got {granularity!r}")
    n = scores.shape[-1]
    s = scores.detach().float()
    s = s.mean(dim=1) if granularity == "layer" else s.clone()  # [L, n] or [L, H, n]
    keep_mask = torch.zeros(n, dtype=torch.bool, device=s.device)
    if protected is not None:
        keep_mask |= protected.to(s.device)
    keep_mask[-1:] = True
    k = min(n, max(int(k), int(keep_mask.sum())))
    s[..., keep_mask] = float("inf")
    order = torch.sort(-s, dim=-1, stable=True).indices[..., :k]  # stable: the earlier token wins a tie
    return torch.sort(order, dim=-1).values


def pack_sets(mask: torch.Tensor) -> torch.Tensor:
    """Kept sets of unequal sizes per (layer, KV head) as one padded index (docs/policies.md, "Unequal counts").

    Args:
        mask: BoolTensor `[L, H, n]`, True where a head keeps the token; every head keeps at least one.

    Returns:
        LongTensor `[L, H, k_max]`, `k_max` the largest count: each head's kept indices ascending, right-aligned
        after its padding `-1` (a head keeping `k_h` tokens: `k_max - k_h` padding columns first), so that the last
        column holds every set's last token (decode feeds it again), row `i` of a set is the cache row an engine
        stores it in, and at compact positions (row index = position) each head's kept keys sit at the positions
        `k_max - k_h .. k_max - 1` right before the next query, as an equal count would put them. (Padding placed
        before only the last index instead put a head's older keys `k_max - k_h` positions further from every query
        than its own count gives, which moved SmolLM2's next-token distribution ~20x further from the full cache.)

    Raises:
        ValueError: `mask` not `[L, H, n]`, or a head keeping nothing.
    """
    if mask.dim() != 3:
        raise ValueError(f"a keep mask must have shape [L, H, n], got {tuple(mask.shape)}")
    counts = mask.sum(dim=-1)  # [L, H]
    if int(counts.min()) < 1:
        raise ValueError("every (layer, KV head) must keep at least one token")
    n, k_max = mask.shape[-1], int(counts.max())
    ar = torch.arange(n, device=mask.device)
    idx = torch.sort(torch.where(mask, ar, n), dim=-1).values[..., :k_max]  # [L, H, k_max]: kept ascending, then n
    src = torch.arange(k_max, device=mask.device) - (k_max - counts[..., None])  # [L, H, k_max]: < 0 on padding
    return torch.where(src >= 0, idx.gather(-1, src.clamp(min=0)), torch.full_like(idx, -1))


def repeat_keep(keep: torch.Tensor, num_layers: int, num_kv_heads: int, granularity: str) -> torch.Tensor:
    """One kept set `[k]` as the set of every layer (`[L, k]`, `"layer"`) or every KV head (`[L, H, k]`,
    `"head"`); `keep` itself for `"request"`. For policies whose set does not depend on the head (StreamingLLM)
    and for prompts a policy cannot cut (all tokens protected)."""
    if granularity == "request":
        return keep
    shape = (num_layers, keep.numel()) if granularity == "layer" else (num_layers, num_kv_heads, keep.numel())
    return keep.expand(*shape).clone()
