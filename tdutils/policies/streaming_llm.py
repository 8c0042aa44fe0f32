"""StreamingLLM: keep the attention sinks and the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453.

Definition: of `T` tokens with a keep count `k = keep_count(T, r)`, keep the first `n_sink` tokens (the
attention sinks, which soak up attention whatever their content) and the `k - n_sink` most recent ones.
Query-free: it reads neither keys nor queries, so it needs no model config and no query capture (on the
serving path it runs on a stock vLLM). Defaults: `n_sink=4` (the paper's four initial tokens); `window=0`
(the paper's recent window is the rest of the budget; `window` is a floor: that many recent tokens are kept
even when the budget is smaller, e.g. at drop ratio 1). One kept set per request, as in the paper (which
evicts the same positions in every layer and head); `granularity="layer" | "head"` repeats that set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..selection import GRANULARITIES, check_protected, keep_count, protected_mask, repeat_keep
from .registry import register_policy


@dataclass
class StreamingLLMParams:
    """StreamingLLM parameters: `n_sink` first tokens always kept; `window` recent tokens always kept."""

    n_sink: int = field(default=4, metadata={"help": "the first prompt tokens, always kept (attention sinks)"})
    window: int = field(default=0, metadata={"help": "the most recent prompt tokens, always kept"})

    def __post_init__(self):
        check_protected(self.n_sink, self.window)


def streaming_llm_keep(n: int, drop_ratio: float, *, n_sink: int = 4, window: int = 0) -> torch.Tensor:
    """Kept indices of StreamingLLM (arXiv:2309.17453): the first `n_sink` and the most recent tokens.

    Args:
        n: tokens in the request's KV cache, `T`.
        drop_ratio: fraction removed, in [0, 1]; `k = keep_count(n, drop_ratio)` tokens are kept, raised to
            the protected ones (`n_sink` first, `window` last) when smaller.

    Returns:
        LongTensor [k] sorted: `0 .. n_sink-1` and `n - (k - n_sink) .. n-1`. `drop_ratio=0` keeps all.

    Raises:
        ValueError: drop_ratio outside [0, 1]; negative n, n_sink or window.
    """
    k = keep_count(n, drop_ratio)
    protected = protected_mask(n, n_sink=n_sink, window=window)
    keep = protected.clone()
    recent = max(k - int(protected[: min(n_sink, n)].sum()), 0)  # the budget left after the sinks
    if recent:
        keep[max(0, n - recent):] = True
    return torch.nonzero(keep).flatten()


register_policy(
    "streaming_llm", params=StreamingLLMParams, needs="kv", needs_model=False, builtin=True,
    granularities=GRANULARITIES,  # a set of positions: the same set in every layer and head
    keep=lambda kv, q, r, *, params, facts, granularity="request": repeat_keep(
        streaming_llm_keep(kv.shape[2], r, n_sink=params.n_sink, window=params.window), kv.shape[1],
        facts.num_kv_heads if facts is not None else 1, granularity),
    summary="the first n_sink tokens (attention sinks) and the most recent ones",
    paper="Xiao et al. 2023, StreamingLLM, arXiv:2309.17453")

__all__ = ["StreamingLLMParams", "streaming_llm_keep"]
