"""Scores reused across drop ratios: a policy's token scores depend on the cache, not on how many tokens it keeps.

SnapKV's votes, R-KV's importance-minus-redundancy, H2O's accumulated attention and ExpectedAttention's expected
attention are functions of the request's KV cache, its captured queries and the policy's parameters; the drop
ratio only picks how many of the best-scored tokens stay. An evaluation grid runs every policy at several ratios
on the same prefilled caches (`tdutils.eval.runner.run_cells`), so inside `shared_scores()` each decorated score
function (`@reused`) is computed once per (cache, queries, parameters) and handed back for the other ratios.
H2O's score is `O(L * Hq * T² * d)` (2 s per 2048-token prompt of SmolLM2-135M on one core), 6x its selection.

Outside `shared_scores()` nothing is remembered and every call computes. Inside it a call is recognised by the
identity of its tensor arguments and, outside inference mode, their version counters (the engines never edit
a cache in place: `Engine.snapshot` shares its tensors) and by the `repr` of its other arguments (parameter dataclasses, `head_dim`, the model's
attention); the entries hold their tensors, so an identity cannot be reused while the context is open, and the
context drops every entry when it closes. Each hit returns a fresh copy (callers may write their scores).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_memo: dict | None = None  # open `shared_scores()`: key -> (arguments held alive, result)
_scratch: dict | None = None  # open `shared_scores()`: name -> a score function's own memory (`scratch`)
_stats = {"calls": 0, "hits": 0}


@contextmanager
def shared_scores() -> Iterator[dict]:
    """Within the block, `@reused` score functions compute once per (cache, queries, parameters) and return
    copies of that result on later calls (another drop ratio of the same policy on the same request).

    Yields:
        `{"calls": int, "hits": int}`: the decorated calls and those answered from memory so far in the block.
    Nested blocks share the outer one's memory.
    """
    global _memo, _scratch
    if _memo is not None:  # nested: the outer block owns the memory
        yield _stats
        return
    _memo, _scratch = {}, {}
    _stats.update(calls=0, hits=0)
    try:
        yield _stats
    finally:
        _memo = _scratch = None


def scratch(name: str) -> dict | None:
    """A score function's own memory for the open `shared_scores()` block (a dict, the same for `name` until the
    block closes), for what `@reused`'s exact-argument memory cannot see, e.g. a cache that extends an earlier
    one (H2O's prefix, `tdutils.policies.h2o`); None outside a block, where nothing may be remembered."""
    return None if _scratch is None else _scratch.setdefault(name, {})


def _key(value):
    if isinstance(value, torch.Tensor):  # inference tensors (the engines' caches) keep no version counter
        return ("tensor", id(value), None if value.is_inference() else value._version)
    if isinstance(value, tuple | list):
        return (type(value).__name__, *map(_key, value))
    return repr(value)


def _clone(result):
    if isinstance(result, torch.Tensor):
        return result.clone()
    if isinstance(result, tuple):
        return tuple(_clone(r) for r in result)
    return result


def reused(fn: Callable) -> Callable:
    """Decorator of a pure score function of tensors and parameters (never of the drop ratio): inside
    `shared_scores()` its result is computed once per distinct arguments; outside it, a plain call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _memo is None:
            return fn(*args, **kwargs)
        key = (fn.__module__, fn.__qualname__, _key(args), tuple(sorted((k, _key(v)) for k, v in kwargs.items())))
        _stats["calls"] += 1
        if key in _memo:
            _stats["hits"] += 1
            return _clone(_memo[key][1])
        result = fn(*args, **kwargs)
        _memo[key] = ((args, kwargs), result)  # the arguments stay alive: their ids stay theirs
        return _clone(result)

    return wrapper


__all__ = ["reused", "scratch", "shared_scores"]
