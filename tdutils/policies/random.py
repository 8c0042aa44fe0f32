"""Random dropping and the reference's "middle of every chunk" dropping (both query-free baselines)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..selection import (
    GRANULARITIES,
    check_drop_ratio,
    check_protected,
    keep_count,
    keep_top_per_head,
    protected_mask,
)
from .params import check_int, is_int
from .registry import register_policy


@dataclass
class RandomParams:
    """Parameters of `random_keep`: RNG seed, attention sinks and observation window kept always."""

    seed: int = field(default=0, metadata={"help": "seed of the random sample, 0 to 2**64 - 1 (the same seed keeps the same tokens)"})
    n_sink: int = field(default=4, metadata={"help": "the first prompt tokens, always kept (attention sinks)"})
    window: int = field(default=16, metadata={"help": "the most recent prompt tokens, always kept"})

    def __post_init__(self):  # fail when the drop function is built, not on the first request
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0 <= self.seed < 2**64:  # torch.Generator's range: -1 would alias 2**64 - 1, past it fails at decode
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1] (torch.Generator's seeds), got {self.seed}")
        check_protected(self.n_sink, self.window)


@dataclass
class MiddleChunkParams:
    """Parameters of `middle_chunk_keep`: the chunk size (tokens)."""

    chunk_size: int = field(default=256, metadata={
        "help": "tokens per chunk; the middle of every chunk but the first and the last is dropped"})

    def __post_init__(self):
        check_int(self.chunk_size, "chunk_size", 1)


def random_keep(n: int, drop_ratio: float, *, seed: int = 0, n_sink: int = 4, window: int = 16) -> torch.Tensor:
    """Keep the first `n_sink` tokens, the last `window` tokens, and a uniform random sample of the rest.

    The sample is drawn without replacement from a `torch.Generator` seeded with `seed`, so the same
    `(n, drop_ratio, seed, n_sink, window)` always gives the same tokens.

    Args:
        n: number of tokens in the request's KV cache.
        drop_ratio: fraction of tokens to remove, in [0, 1]; total kept is `keep_count(n, drop_ratio)`,
            raised to the number of protected tokens when smaller.

    Returns:
        LongTensor [k] of kept token indices, sorted ascending. `drop_ratio=0` returns `arange(n)`.

    Raises:
        ValueError: drop_ratio outside [0, 1]; negative n, n_sink or window.
    """
    k = keep_count(n, drop_ratio)
    protected = protected_mask(n, n_sink=n_sink, window=window)
    n_prot = int(protected.sum())
    free = torch.nonzero(~protected).flatten()  # [n - n_prot]
    n_pick = min(max(k - n_prot, 0), free.numel())
    gen = torch.Generator().manual_seed(int(seed))
    picked = free[torch.randperm(free.numel(), generator=gen)[:n_pick]]
    keep = torch.cat([torch.nonzero(protected).flatten(), picked])
    return torch.sort(keep).values


def random_keep_per_head(n: int, drop_ratio: float, *, num_layers: int, num_kv_heads: int, granularity: str,
                         seed: int = 0, n_sink: int = 4, window: int = 16) -> torch.Tensor:
    """`random_keep` with an independent uniform sample per layer (`granularity="layer"`) or per KV head
    (`"head"`, as kvpress' `RandomPress`): every set keeps the protected tokens and the last token, and
    `keep_count(n, drop_ratio)` tokens in all; the samples are the ranks of `torch.rand` draws (`[L, H, n]` or
    `[L, 1, n]`, layer-major) from one `torch.Generator` seeded with `seed`.

    Returns:
        LongTensor `[L, k]` (`"layer"`) or `[L, H, k]` (`"head"`), sorted on the last dim.
    """
    gen = torch.Generator().manual_seed(int(seed))
    heads = num_kv_heads if granularity == "head" else 1
    draws = torch.rand(num_layers, heads, n, generator=gen)  # [L, H or 1, n]
    return keep_top_per_head(draws, keep_count(n, drop_ratio), protected_mask(n, n_sink=n_sink, window=window),
                             granularity)


def _random(kv, q, r, *, params: RandomParams, facts, granularity="request"):
    if granularity == "request":
        return random_keep(kv.shape[2], r, seed=params.seed, n_sink=params.n_sink, window=params.window)
    return random_keep_per_head(kv.shape[2], r, num_layers=kv.shape[1], num_kv_heads=facts.num_kv_heads,
                                granularity=granularity, seed=params.seed, n_sink=params.n_sink, window=params.window)


def middle_chunk_keep(n: int, drop_ratio: float = 0.5, *, chunk_size: int = 256) -> torch.Tensor:
    """The reference "random" notebook's policy (LMCache token-dropping examples): split the tokens into
    chunks of `chunk_size`, keep the first and the last chunk whole, and from every chunk in between drop
    its middle `round(chunk_size * drop_ratio)` tokens (a centred span).

    Because the first and last chunks are kept whole, the realised drop fraction is below `drop_ratio`
    (e.g. n=1024, chunk 256, ratio 0.5 drops 256 tokens = 25%); the engines report the real kept count.
    Prompts of at most two chunks return unchanged.

    Returns:
        LongTensor [k] of kept indices, sorted ascending.

    Raises:
        ValueError: drop_ratio outside [0, 1], or chunk_size < 1.
    """
    return _middle_chunk_keep(n, check_drop_ratio(drop_ratio), MiddleChunkParams(chunk_size).chunk_size)


def _middle_chunk_keep(n: int, r: float, chunk_size: int) -> torch.Tensor:
    # `r` and `chunk_size` checked (by `middle_chunk_keep`, or when the drop function was built)
    keep = torch.ones(n, dtype=torch.bool)
    n_chunks = -(-n // chunk_size)  # the last chunk may be partial
    n_drop = round(chunk_size * r)
    lo = (chunk_size - n_drop) // 2  # centred span [lo, lo + n_drop) inside each middle chunk
    for c in range(1, n_chunks - 1):
        start = c * chunk_size + lo
        keep[start:start + n_drop] = False
    return torch.nonzero(keep).flatten()


register_policy(
    "random", params=RandomParams, needs="kv", needs_model=False, builtin=True, granularities=GRANULARITIES,
    keep=_random,
    summary="first n_sink tokens (attention sinks), last window tokens, a seeded uniform sample of the rest",
    paper="baseline")
register_policy(
    "middle_chunk", params=MiddleChunkParams, needs="kv", needs_model=False, builtin=True,
    keep=lambda kv, q, r, *, params, facts: _middle_chunk_keep(kv.shape[2], r, params.chunk_size),
    summary="the middle round(chunk_size * r) tokens of every chunk but the first and last are dropped",
    paper="the LMCache token-dropping examples' 'random' notebook")
