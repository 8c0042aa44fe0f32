"""Compression while the cache grows: a KV budget held during decoding (R-KV) and during chunked prefill.

R-KV (Cai et al. 2025, arXiv:2505.24133) holds each request's cache at a fixed budget while it decodes: new
tokens fill a buffer of `N`, and when the cache reaches `B + N` tokens the queries of its last `w` tokens score
it and it is cut back to `B` (R-KV's code: `B = 128`, `N = 128`, `w = 8`). `Compression` names that setting for
any registered policy whose inputs exist during decoding (the KV, or the queries of the last tokens); `BudgetDropFn`
is the drop function that cuts one cache of `T > B` tokens to `B` (a `ModifyFn`, docs/design.md §3).
`HFEngine.decode(compression=...)` runs it inside the batch; `HFEngine.prefill(prompts, chunk=C,
compression=...)` cuts after every chunk of `C` prompt tokens, so a prompt's cache never exceeds `B + C`.
`cache_sizes` turns a request's compression events into its cache length after every decode step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .kvcache import check_kv, get_kv
from .selection import keep_count

DEFAULT_WINDOW = 8  # R-KV's decode-time observation window (its run scripts: --window_size 8)


@dataclass(frozen=True)
class Compression:
    """A KV budget held while the cache grows (R-KV's decode-time setting, arXiv:2505.24133).

    Attributes:
        policy: a registered policy name (`tdutils.policies.policy_names()`) that scores from the KV or from
            the last `w` tokens' queries; policies that need every prompt query (`h2o`) cannot run while the
            cache grows (those queries are gone after the first cut).
        budget: `B`, tokens a request's cache is cut back to (>= 2, and > `window` when one is set).
        buffer: `N`, tokens the cache may grow by before the next cut (decode); >= the query rows the policy
            reads, so every cut is scored by queries computed after the previous one.
        window: `w`, passed as the policy's `window` parameter (the most recent tokens it always keeps; for
            snapkv and rkv also the queries that vote). Default 8, R-KV's decode setting; None keeps the
            policy's own default; policies without a `window` parameter ignore it.
        params: the policy's other parameters (`{"mix_lambda": 0.1}`).
        rerotate: None = follow the engine's `positions` (compact re-rotates kept keys); engines check it.

    Raises:
        ValueError: an unknown policy, a policy needing every prompt query, bad sizes, or bad `params` (the
            policy's own checks, run here so a bad value fails before anything is prefilled).
    """

    policy: str = "rkv"
    budget: int = 128
    buffer: int = 128
    window: int | None = DEFAULT_WINDOW
    params: Mapping = field(default_factory=dict)

    def __post_init__(self):
        from .engines.base import check_count
        from .policies import get_policy

        check_count(self.budget, "budget", 2)
        check_count(self.buffer, "buffer", 1)
        if self.window is not None:
            check_count(self.window, "window", 0)
        if not isinstance(self.params, Mapping):
            raise TypeError(f"params must be a mapping of the policy's parameters, got {type(self.params).__name__}")
        pol = get_policy(self.policy)  # ValueError naming the known policies
        if pol.needs == "all":
            raise ValueError(f"policy {self.policy!r} scores with every prompt query; they do not exist while the "
                             "cache grows (after the first cut the dropped tokens' queries are gone). Use a policy "
                             "that reads the KV or the last tokens' queries (snapkv, rkv, tova, knorm, ...)")
        p = pol.make_params(**self.policy_params())  # the policy's own checks
        rows = pol.rows(p) or 0
        w = getattr(p, "window", 0) or 0
        if w >= self.budget:
            raise ValueError(f"budget {self.budget} must exceed the window {w} the policy always keeps")
        if rows > self.buffer:
            raise ValueError(f"buffer {self.buffer} is smaller than the {rows} query rows {self.policy!r} scores "
                             f"with: every cut must be scored by queries computed after the previous one; raise "
                             f"buffer or lower window")

    def policy_params(self) -> dict:
        """The keyword parameters the policy is built with: `params`, plus `window` when set and accepted."""
        import dataclasses

        from .policies import get_policy

        names = {f.name for f in dataclasses.fields(get_policy(self.policy).params)}
        out = dict(self.params)
        if self.window is not None and "window" in names and "window" not in out:
            out["window"] = self.window
        return out

    @property
    def query_rows(self) -> int:
        """Query rows of the last tokens a cut is scored with (0 for KV-only policies)."""
        from .policies import get_policy

        pol = get_policy(self.policy)
        return pol.rows(pol.make_params(**self.policy_params())) or 0

    def drop_fn(self, *, model_config, rerotate: bool = True) -> BudgetDropFn:
        """The drop function that cuts a cache to `budget` with this policy (see `BudgetDropFn`)."""
        return BudgetDropFn(self, model_config=model_config, rerotate=rerotate)


class BudgetDropFn:
    """A `ModifyFn` that keeps `budget` tokens of a cache of `T > budget` tokens, and all of a shorter one.

    The policy's drop ratio for a cache of `T` tokens is `1 - B / T` (`keep_count(T, r) == B`, checked); the drop
    function of each `T` is built once (`tdutils.make_drop_fn`) and reused. Attributes `name`, `rerotate`,
    `needs` and `query_rows` are those engines read from a `DropFn`; `edit` also returns the kept indices.

    Raises (from `edit`):
        ValueError: the policy's own input errors (bad shapes, too few query rows).
        RuntimeError: the policy kept more than `budget` tokens (its protected tokens exceed the budget).
    """

    def __init__(self, compression: Compression, *, model_config, rerotate: bool = True):
        from .policies import get_policy

        self.compression = compression
        self.budget = compression.budget
        self.model_config = model_config
        self.rerotate = rerotate
        self.name = compression.policy
        self.needs = get_policy(compression.policy).needs
        self.query_rows = compression.query_rows
        self._fns: dict[int, object] = {}

    def _fn(self, n: int):
        fn = self._fns.get(n)
        if fn is None:
            from .edit import make_drop_fn

            r = 1.0 - self.budget / n
            if keep_count(n, r) != self.budget:  # float rounding: nudge to the ratio that keeps exactly B
                r = (n - self.budget) / n
            assert keep_count(n, r) == self.budget, (n, self.budget, r)
            fn = make_drop_fn(self.compression.policy, drop_ratio=r, model_config=self.model_config,
                              rerotate=self.rerotate, **self.compression.policy_params())
            self._fns[n] = fn
        return fn

    def edit(self, tensors: Mapping, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """`(new_kv [2, L, k, D], new_tokens, kept indices LongTensor [k])` with `k = min(T, budget)`."""
        kv = get_kv(tensors)
        check_kv(kv, tokens)
        n = kv.shape[2]
        if n <= self.budget:
            return kv.clone(), [int(t) for t in tokens], torch.arange(n)
        new_kv, new_tokens, keep = self._fn(n).edit(tensors, tokens)
        if keep.numel() > self.budget:
            raise RuntimeError(f"policy {self.name!r} kept {keep.numel()} tokens of {n}, more than the budget "
                               f"{self.budget} (its protected tokens: window, sinks); lower them or raise the budget")
        return new_kv, new_tokens, keep

    def __call__(self, tensors: Mapping, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        new_kv, new_tokens, _ = self.edit(tensors, tokens)
        return new_kv, new_tokens


def cache_sizes(output) -> list[int]:
    """A request's KV length after each decode step, from `RequestOutput.compressions` (for plots).

    Entry `s` is the number of cache entries the request's step `s + 1` attended over (the cache it started
    decoding from, minus the refed token, plus one per step), after any cut that step made. Without
    compression it grows by one per step from `cached_tokens`.
    """
    sizes, n = [], output.cached_tokens
    events = {e["step"]: e["after"] for e in (output.compressions or [])}
    for step in range(1, len(output.output_ids) + 1):
        n = events.get(step, n if step == 1 else n + 1)
        sizes.append(n)
    return sizes


__all__ = ["DEFAULT_WINDOW", "BudgetDropFn", "Compression", "cache_sizes"]
