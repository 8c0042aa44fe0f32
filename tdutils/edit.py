"""Drop functions: a policy becomes an LMCache-style `ModifyFn` that edits one request's KV cache.

Contract (docs/design.md §3, LMCache's `ModifyFnType`)::

    fn(tensors: Mapping[CacheKind, Tensor], tokens: Sequence[int]) -> (new_kv, new_tokens)

`tensors[CacheKind.KV]` is `[2, L, T, D]` (keys after RoPE, values; `D = H_kv * head_dim`), `tensors[CacheKind.QUERY]`
`[L, Tq, Hq * head_dim]` aligned to the end of the KV. The result is `new_kv [2, L, k, D]` and `k` ids: kept
indices sorted ascending, values gathered, keys gathered and (with `rerotate=True`) moved by RoPE from position
`keep[i]` to `i`. A drop function never mutates its input; engines validate its output (`validate_drop_output`)
and keep a request's cache unchanged when it fails. With `granularity="layer" | "head"` each layer or KV head keeps
its own `k` rows (`apply_keep_heads`; docs/policies.md, "Granularity"). `make_drop_fn` finds policies by name in
`tdutils.policies`; `kept_rows` recovers the kept indices of any ModifyFn's output. The tensor helpers live in `tdutils.kvcache` and
are re-exported here.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .kvcache import (
    apply_keep,
    apply_keep_heads,
    check_keep_sets,
    check_kv,
    get_kv,
    get_query,
)
from .models import model_facts
from .policies import get_policy
from .selection import check_drop_ratio, check_granularity, keep_count

ModifyFn = Callable[[Mapping, Sequence[int]], tuple[torch.Tensor, list[int]]]
# A selection function: (tensors, tokens) -> LongTensor of kept indices.
SelectFn = Callable[[Mapping, Sequence[int]], torch.Tensor]


class DropFunctionError(RuntimeError):
    """A drop function raised or returned output that breaks the ModifyFn contract."""



def check_token_ids(ids: Sequence[int], vocab_size: int) -> int | None:
    """Index of the first id outside `[0, vocab_size)`, or None when all are inside."""
    for j, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return j
    return None


def validate_drop_output(kv: torch.Tensor, tokens: Sequence[int], result,
                         vocab_size: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Check a drop function's return value against its input (docs/design.md §3); returns `(new_kv, new_tokens)`.

    Args:
        vocab_size: when given, every new token id must lie in `[0, vocab_size)` (decode feeds the last one
            to the model again).

    Raises:
        DropFunctionError: not a `(tensor, tokens)` pair; shape not `[2, L, k, D]` with the input's
            `L` and `D`; `k` not in `[1, T]`; `len(new_tokens) != k`; token ids not integers or outside
            the vocabulary; dtype or device changed; non-finite values.
    """
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise DropFunctionError(f"a drop function must return (new_kv, new_tokens), got {type(result).__name__}")
    new_kv, new_tokens = result
    if not isinstance(new_kv, torch.Tensor):
        raise DropFunctionError(f"new_kv must be a torch.Tensor, got {type(new_kv).__name__}")
    _, n_layers, n_tok, dim = kv.shape
    if new_kv.dim() != 4 or new_kv.shape[0] != 2 or new_kv.shape[1] != n_layers or new_kv.shape[3] != dim:
        raise DropFunctionError(f"new_kv must have shape [2, {n_layers}, k, {dim}], got {tuple(new_kv.shape)}")
    k = new_kv.shape[2]
    if not 1 <= k <= n_tok:
        raise DropFunctionError(f"new_kv keeps {k} tokens; it must keep between 1 and {n_tok}")
    try:
        as_int = [int(t) for t in new_tokens]
    except (TypeError, ValueError):
        raise DropFunctionError("new_tokens must be a sequence of integer token ids") from None
    if any(isinstance(t, float | bool) or a != t for t, a in zip(new_tokens, as_int)):
        raise DropFunctionError("new_tokens must be integer token ids (got floats or bools); return the kept "
                                "entries of `tokens`")
    new_tokens = as_int
    if vocab_size is not None:
        bad = check_token_ids(new_tokens, vocab_size)
        if bad is not None:
            raise DropFunctionError(f"new_tokens[{bad}] = {new_tokens[bad]} is outside the model's vocabulary "
                                    f"[0, {vocab_size}); return the kept entries of `tokens`")
    if len(new_tokens) != k:
        raise DropFunctionError(f"len(new_tokens) = {len(new_tokens)} but new_kv holds {k} tokens; they must match")
    if new_kv.dtype != kv.dtype:
        raise DropFunctionError(f"new_kv has dtype {new_kv.dtype}, the cache is {kv.dtype}")
    if new_kv.device != kv.device:
        raise DropFunctionError(f"new_kv is on {new_kv.device}, the cache is on {kv.device}")
    # One fp32 sum is finite exactly when no element is NaN/inf (barring an fp32 overflow of the sum, which
    # the elementwise check below then rules out); ~10x cheaper than isfinite(new_kv).all() on CPU.
    if not bool(torch.isfinite(new_kv.sum(dtype=torch.float32))) and not bool(torch.isfinite(new_kv).all()):
        raise DropFunctionError("new_kv contains NaN or infinite values")
    return new_kv, new_tokens


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def kept_rows(kv: torch.Tensor, tokens: Sequence[int], new_kv: torch.Tensor, new_tokens: Sequence[int], *,
              window: float = math.inf) -> torch.Tensor:
    """The cache rows a drop function kept, recovered from its output: `LongTensor[k]`, ascending, with
    `new_kv[:, :, i] == kv[:, :, keep[i]]` bit for bit and `new_tokens[i] == tokens[keep[i]]`.

    For drop functions that do not report their kept indices (a lambda, a wrapper, a user's `ModifyFn`) when
    the engine needs the kept *positions* (`positions="original"`: keys keep their rotation, so each kept row
    is an unchanged cache row). Rows are matched by an exact integer fingerprint of their bits (K and V over
    every layer) and their token, in order, then checked element for element.

    Identical rows. Rows can be bit-identical with the same token (a prompt of repeated pad ids with zero
    embeddings gives all-zero K/V rows), and then an output row may be any of several cache rows. Each output
    row's candidates run from its earliest in-order match to its latest (matching from the right). Where they
    differ the choice is harmless only when it cannot change what the model computes: not for the last kept
    row (decoding continues after its position), and for the others only when every candidate lies `window`
    or more rows before the last kept one (out of every sliding window from then on: later positions only
    grow); then the earliest match is returned. Otherwise the kept positions are ambiguous and this raises.

    Args:
        kv: `[2, L, T, D]`, the cache the function received; `tokens`: its T token ids.
        new_kv: `[2, L, k, D]` and `new_tokens` (k ids), its validated output (`validate_drop_output`).
        window: the model's largest sliding window in tokens; 0 for a model without sliding-window layers
            (full attention sees every earlier key wherever it sits); default `inf`: every position matters.

    Raises:
        DropFunctionError: the output rows are not an in-order selection of the input rows (keys re-rotated,
            rows merged, reordered or changed), so no position can be given to them; or they are, in more than
            one way that changes the result (identical rows, above).
    """
    T, k = kv.shape[2], new_kv.shape[2]
    old_rows = kv.permute(2, 0, 1, 3).reshape(T, -1)  # [T, 2*L*D]
    new_rows = new_kv.permute(2, 0, 1, 3).reshape(k, -1)  # [k, 2*L*D]
    as_int = _INT_VIEW[kv.element_size()]
    # A fixed random int64 weight per element: equal rows give equal sums (integer arithmetic is exact; overflow
    # wraps the same way for both), different rows almost never do; every match is verified below anyway.
    weights = torch.randint(-2**62, 2**62, (old_rows.shape[1],), generator=torch.Generator().manual_seed(0),
                            dtype=torch.int64).to(kv.device)
    old_key = list(zip((old_rows.contiguous().view(as_int).long() * weights).sum(1).tolist(), map(int, tokens)))
    new_key = list(zip((new_rows.contiguous().view(as_int).long() * weights).sum(1).tolist(), map(int, new_tokens)))
    first = _match_in_order(old_key, new_key)
    keep_t = torch.tensor(first, dtype=torch.long)
    if len(first) != k or not torch.equal(old_rows[keep_t.to(kv.device)], new_rows):
        raise DropFunctionError(
            "positions='original' needs the kept positions, and the drop function's output is not an in-order "
            "selection of unchanged cache rows with their own token ids (keys re-rotated, rows merged, reordered or "
            "edited, or new_tokens[i] not the token of the row kept), so they cannot "
            "be recovered; use positions='compact' (with re-rotated keys), a drop function from "
            "tdutils.make_drop_fn, or one with an `edit(tensors, tokens) -> (new_kv, new_tokens, keep)` method")
    last = _match_in_order(old_key[::-1], new_key[::-1])  # from the right: each row's latest possible match
    last = [T - 1 - j for j in reversed(last)]
    harmful = [i for i in range(k) if first[i] != last[i] and (i == k - 1 or last[i] > first[-1] - window)]
    if harmful:
        i = harmful[0]
        raise DropFunctionError(
            f"positions='original' needs the kept positions, and output row {i} (token {int(new_tokens[i])}) is "
            f"bit-identical to cache rows {first[i]} to {last[i]} with the same token (repeated pad tokens give "
            f"identical K/V rows), so which position it kept is ambiguous and changes the result (it is the last "
            f"kept row, or lies within the model's sliding window of it); use positions='compact', a drop function "
            f"from tdutils.make_drop_fn, or one with an `edit(tensors, tokens) -> (new_kv, new_tokens, keep)` method")
    return keep_t


def _match_in_order(old: list, new: list) -> list[int]:
    """Greedy in-order matching: for each item of `new`, the index of its earliest equal item in `old` after the
    previous match (stops at the first item without one: fewer indices than `new`)."""
    keep, j = [], 0
    for item in new:
        while j < len(old) and old[j] != item:
            j += 1
        if j == len(old):
            break
        keep.append(j)
        j += 1
    return keep


def one_set(keep: torch.Tensor) -> torch.Tensor | None:
    """The one kept set `[k]` of `keep` (`[k]`, or `[L, H, k]` with every set equal), else None."""
    if keep.dim() == 1:
        return keep
    return keep[0, 0] if bool((keep == keep[:1, :1]).all()) else None


@dataclass
class Timings:
    """Per request, the seconds a drop function spent choosing tokens (`score_s`) and applying the choice
    (`rerotate_s`: gathering K/V and RoPE re-rotation); CUDA is synchronised around each part."""

    score_s: list = field(default_factory=list)
    rerotate_s: list = field(default_factory=list)

    def reset(self) -> None:
        self.score_s.clear()
        self.rerotate_s.clear()

    def split(self) -> dict:
        """Totals over the recorded requests: `requests`, `score_s`, `rerotate_s` (gather + re-rotation)."""
        return {"requests": len(self.score_s), "score_s": sum(self.score_s), "rerotate_s": sum(self.rerotate_s)}


@dataclass
class DropFn:
    """The one drop-function type: a ModifyFn (`fn(tensors, tokens) -> (new_kv, new_tokens)`) whose engines read
    what it needs and does from declared attributes, never by probing.

    Built three ways: `make_drop_fn(policy, drop_ratio=r)` (keep by ratio), `make_drop_fn(policy, budget=B)`
    (keep by budget: a cache of `T > B` tokens is cut to exactly `B` at drop ratio `1 - B/T`, a shorter one kept
    whole; decode-time compression's cut, `Compression.drop_fn`), and `as_drop_fn(modify_fn)` (any bare
    ModifyFn, adapted once: it edits the cache itself, so its kept indices and re-rotation are unknown).
    `timed()` gives a copy that records per-request timings.

    Attributes:
        name: policy name (for tables).
        select: `(tensors, tokens, drop_ratio) -> LongTensor[k]` of kept indices; None for an adapted ModifyFn.
        drop_ratio: the nominal fraction dropped (keep by ratio); None when keeping by budget or adapted.
        budget: tokens kept of a longer cache (keep by budget); None otherwise.
        rerotate: whether keys are moved to compact positions (engines check it against their `positions`);
            None when unknown (an adapted ModifyFn).
        rope_spec: the model's RoPE (`ModelFacts.rope`; None when `rerotate` is not True).
        params: the policy's parameters, `{name: value}`.
        needs: what the policy reads: `"kv"`, `"window"` (the last `query_rows` prompt queries) or `"all"`
            (every prompt query); None when unknown (a selection function or ModifyFn passed directly).
        query_rows: query rows to capture at prefill: 0, `w`, or None (all); see
            `tdutils.policies.query_window_for`.
        reads_only: the function never writes the tensors it is given (tdutils' built-in policies, which the
            tests check), so an engine may hand it the cache itself instead of a protective copy.
        modify: the adapted ModifyFn (`as_drop_fn`), else None.
        timings: per-request `Timings` when built with `timed()`, else None.
        granularity: `"request"` (one kept set `[k]`), `"layer"` (`[L, k]`) or `"head"` (`[L, H_kv, k]`);
            docs/policies.md, "Granularity". Engines that store one token list per request refuse the others.
        num_kv_heads: the model's KV heads `H_kv` (from `model_config`), to check per-head sets; None unknown.
    """

    name: str
    select: Callable | None
    drop_ratio: float | None = None
    budget: int | None = None
    rerotate: bool | None = True
    rope_spec: object | None = None
    params: dict = field(default_factory=dict)
    needs: str | None = None
    query_rows: int | None = 0
    reads_only: bool = False
    modify: ModifyFn | None = None
    timings: Timings | None = None
    granularity: str = "request"
    num_kv_heads: int | None = None

    def ratio_for(self, n: int) -> float:
        """The drop ratio applied to a cache of `n` tokens: `drop_ratio`, or by budget `1 - B/n` (exactly `B`
        kept: `keep_count(n, r) == B`), 0 when `n <= B`."""
        if self.budget is None:
            return self.drop_ratio
        if n <= self.budget:
            return 0.0
        r = 1.0 - self.budget / n
        if keep_count(n, r) != self.budget:  # float rounding: nudge to the ratio that keeps exactly B
            r = (n - self.budget) / n
        return r

    def keep_indices(self, tensors: Mapping, tokens: Sequence[int]) -> torch.Tensor:
        """The indices this function keeps for one request: LongTensor `[k]` (granularity `"request"`), `[L, k]`
        (`"layer"`) or `[L, H_kv, k]` (`"head"`), sorted on the last dim; unequal per-head counts (AdaKV, PyramidKV)
        as `[L, H_kv, k_max]` padded with -1 before each set's indices (`tdutils.selection.pack_sets`).

        Raises:
            TypeError: an adapted ModifyFn (its kept indices are known only from its output: `kept_rows`).
        """
        if self.select is None:
            raise TypeError(f"{self.name} is a bare ModifyFn: it reports no kept indices; use "
                            "tdutils.edit.kept_rows on its output")
        kv = get_kv(tensors)
        check_kv(kv, tokens)
        return self._check_sets(self.select(tensors, tokens, self.ratio_for(kv.shape[2])), kv)

    def _check_sets(self, keep, kv: torch.Tensor) -> torch.Tensor:
        heads = self.num_kv_heads
        if heads is None:  # unknown: whatever a [L, H, k] result says, as long as it divides D
            keep = torch.as_tensor(keep)
            heads = keep.shape[1] if keep.dim() == 3 and keep.shape[1] and kv.shape[3] % keep.shape[1] == 0 else 1
        return check_keep_sets(keep, kv.shape[2], kv.shape[1], heads)

    def __call__(self, tensors: Mapping, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        new_kv, new_tokens, _ = self.edit(tensors, tokens)
        return new_kv, new_tokens

    def edit(self, tensors: Mapping, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """`__call__` plus the kept indices: `LongTensor[k]` for one set per request, `[L, H_kv, k]` for sets per
        layer or per KV head (a layer's set repeated over its heads); None for an adapted ModifyFn, whose output
        the engine validates and, for original positions, maps back with `kept_rows`.

        Per-layer / per-head sets (`apply_keep_heads`): `new_kv [2, L, k, D]` holds in row `i` of head `h` of
        layer `l` the token `keep[l, h, i]` (keys re-rotated from that position to `i` with `rerotate`);
        `new_tokens` are the tokens of layer 0 / head 0's set: exact for the rows every set shares (the protected
        tokens at the end, and the last token, which every per-head set keeps).

        Raises:
            ValueError: the policy's own input errors (bad shapes, too few query rows).
            RuntimeError: keeping by budget, the policy kept more than `budget` tokens (its protected tokens,
                window and sinks, exceed the budget).
        """
        if self.modify is not None:
            return (*self.modify(tensors, tokens), None)
        kv = get_kv(tensors)
        check_kv(kv, tokens)
        n = kv.shape[2]
        r = self.ratio_for(n)
        if r == 0.0:  # docs/design.md §5: ratio 0 returns the input unchanged, bit for bit
            return kv.clone(), [int(t) for t in tokens], torch.arange(n)
        t0 = self._tick(kv)
        keep = self._check_sets(self.select(tensors, tokens, r), kv)
        if self.budget is not None and keep.shape[-1] > self.budget:
            raise RuntimeError(f"policy {self.name!r} kept {keep.shape[-1]} tokens of {n}, more than the budget "
                               f"{self.budget} (its protected tokens, window and sinks, or a keep rule that does not "
                               f"follow the drop ratio); lower them or raise the budget")
        t1 = self._tick(kv)
        if keep.dim() == 2:  # one set per layer: the same in each of its heads
            keep = keep[:, None, :].expand(-1, self.num_kv_heads or 1, -1).contiguous()
        one = one_set(keep)
        if one is not None:  # one set (StreamingLLM's, repeated): gathered once, as apply_keep_heads would, bit for bit
            new_kv, new_tokens = apply_keep(kv, tokens, one, rope_spec=self.rope_spec, rerotate=bool(self.rerotate))
        else:
            new_kv, new_tokens = apply_keep_heads(kv, tokens, keep, rope_spec=self.rope_spec,
                                                  rerotate=bool(self.rerotate))
        if self.timings is not None:
            self.timings.score_s.append(t1 - t0)
            self.timings.rerotate_s.append(self._tick(kv) - t1)
        return new_kv, new_tokens, keep

    def _tick(self, kv: torch.Tensor) -> float:
        if self.timings is not None and kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        return time.perf_counter()

    def timed(self) -> DropFn:
        """A copy that records, per request, the seconds spent scoring and applying (`timings`, `split()`)."""
        return dataclasses.replace(self, timings=Timings())

    def reset(self) -> None:
        """Forget recorded timings (`run_once` calls it before each run's modify); a no-op without timings."""
        if self.timings is not None:
            self.timings.reset()

    def split(self) -> dict:
        """`Timings.split()` of a timed drop function.

        Raises:
            ValueError: built without `timed()`.
        """
        if self.timings is None:
            raise ValueError(f"drop function {self.name!r} records no timings; build it with .timed()")
        return self.timings.split()


def as_drop_fn(fn) -> DropFn:
    """`fn` as a `DropFn`: itself when it is one, else a bare ModifyFn adapted once (its name, unknown `needs`,
    `rerotate` and kept indices; its input is copied before each call). Engines call this at their entry points
    and read the attributes.

    Raises:
        TypeError: `fn` is not callable as `fn(tensors, tokens)`.
    """
    if isinstance(fn, DropFn):
        return fn
    if not callable(fn):
        raise TypeError(f"a drop function must be callable as fn(tensors, tokens) -> (new_kv, new_tokens), "
                        f"got {type(fn).__name__}")
    return DropFn(getattr(fn, "__name__", "custom"), None, rerotate=None, needs=None, query_rows=None, modify=fn)


def _user_select(policy: Callable, r: float, params: dict) -> tuple[str, Callable]:
    """A user's selection function as `select(tensors, tokens, drop_ratio)`, its call checked now."""
    name = getattr(policy, "__name__", "custom")
    sig = inspect.signature(policy).parameters
    takes_ratio = "drop_ratio" in sig or any(p.kind is p.VAR_KEYWORD for p in sig.values())
    extra = {"drop_ratio": r, **params} if takes_ratio else dict(params)
    try:  # the call every request will make, checked now rather than at modify time
        inspect.signature(policy).bind(None, None, **extra)
    except TypeError as exc:
        raise ValueError(f"selection function {name}{inspect.signature(policy)} cannot be called as "
                         f"select(tensors, tokens{''.join(f', {k}=...' for k in extra)}): {exc}. It gets "
                         "the tensors and the token ids positionally and drop_ratio only as a keyword "
                         "(name the parameter drop_ratio)") from None

    def select(tensors, tokens, drop_ratio):
        return policy(tensors, tokens, **({**extra, "drop_ratio": drop_ratio} if takes_ratio else extra))

    return name, select


def _keep_rule(drop_ratio: float | None, budget: int | None) -> float | None:
    """`make_drop_fn`'s drop ratio (checked; 0.5 when neither is given), or None when it keeps a `budget`."""
    if budget is None:
        return check_drop_ratio(0.5 if drop_ratio is None else drop_ratio)
    if drop_ratio is not None:
        raise ValueError(f"give drop_ratio ({drop_ratio}) or budget ({budget}), not both")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an integer number of tokens >= 1, got {budget!r}")
    return None


def policy_granularity(pol, policy: str, granularity: str, *, option: str = "granularity=") -> str:
    """The granularity a registered policy selects at when `granularity` is asked; ValueError where it has none,
    naming the setting as `option` spells it (`"granularity="` for the API, `"--granularity "` for the CLI)."""
    if pol.per_head_only and granularity != "head":
        if granularity == "layer":
            raise ValueError(f"policy {policy!r} moves budget between heads or layers, so it selects per KV head only; "
                             f"use {option}'head' (or the default), not 'layer'")
        return "head"  # the default ("request") asks for the policy's own sets: per head
    if granularity not in pol.granularities:
        raise ValueError(f"policy {policy!r} keeps one set per request only (its scores are not defined per layer or "
                         f"head); use {option}'request', not {granularity!r}")
    return granularity


def make_drop_fn(policy: str | SelectFn, *, drop_ratio: float | None = None, budget: int | None = None,
                 model_config=None, rerotate: bool = True, granularity: str = "request", **params) -> DropFn:
    """Build the drop function (LMCache `ModifyFn`) of a policy.

    Args:
        policy: a registered policy name (`tdutils.policies.policy_names()`: `"snapkv"`, `"rkv"`, `"random"`,
            `"middle_chunk"`, `"streaming_llm"`, `"h2o"`, `"tova"`, `"knorm"`, `"keydiff"`, `"expected_attention"`,
            `"adakv_snapkv"`, `"adakv_expected_attention"`, `"pyramidkv"`, and any registered with
            `tdutils.policies.register_policy`; its parameters are the fields of its params dataclass,
            e.g. `tdutils.policies.SnapKVParams`), or your own selection function `select(tensors, tokens) ->
            LongTensor` of kept indices (it may read `CacheKind.KV` and `CacheKind.QUERY`); `drop_ratio` is then
            passed to it as a keyword if it accepts one.
        drop_ratio: fraction of tokens to remove, in [0, 1] (default 0.5 when no `budget` is given).
        budget: keep exactly `budget` tokens (>= 1) of a longer cache and all of a shorter one (the policy at
            drop ratio `1 - budget/T`), instead of a drop ratio.
        model_config: the model's facts, handed on explicitly: the hf engine's `engine.facts` (read from its
            loaded model), a loaded model, or a transformers config (`tdutils.models.model_facts`). Needed for
            RoPE re-rotation and by the query-aware policies (head counts, the model's attention: scale,
            soft-cap, sinks, sliding windows — `tdutils.attention`). A bare config gives RoPE frequencies and
            attention from its definition, and a model with learned sinks (gpt-oss) then fails for snapkv/rkv
            (their values live in the weights).
        rerotate: re-rotate kept keys to compact positions (True: what vLLM + LMCache decode with).
        granularity: `"request"` (one kept set for all layers and heads, the default), `"layer"` (one per layer) or
            `"head"` (one per KV head), for the policies that register it (`Policy.granularities`; docs/policies.md,
            "Granularity"); not `"request"` needs `model_config` (the KV head count). The policies that move
            budget between heads or layers (`Policy.per_head_only`: AdaKV, PyramidKV) select per head whatever is
            asked (`"layer"` refused), unequal counts padded (`tdutils.selection.pack_sets`).
        **params: the policy's parameters (e.g. `window=32`); unknown names are refused.

    Returns:
        A `DropFn`, callable as `fn(tensors, tokens) -> (new_kv [2, L, k, D], new_tokens)`; its `needs` and
        `query_rows` say which queries the engine must capture at prefill.

    Raises:
        ValueError: unknown policy name, drop_ratio outside [0, 1], both or a bad `budget`, unknown or bad
            params, `rerotate=True` (or a policy reading head counts, or a granularity other than `"request"`)
            without `model_config`, an unknown granularity or one the policy does not define.
    """
    check_granularity(granularity)
    r = _keep_rule(drop_ratio, budget)
    facts = model_facts(model_config) if model_config is not None else None
    rope_spec = None
    if rerotate:
        if facts is None and not callable(policy) and _reads_model(get_policy(policy)):
            raise _needs_model(policy)  # rerotate=False would not do without model_config either
        if facts is None:
            raise ValueError("rerotate=True needs model_config (the model's facts: engine.facts, the model or its "
                             "config) to re-rotate keys; or pass rerotate=False and decode at the original positions "
                             "(an engine opened with positions='original', e.g. open_engine('hf', ..., "
                             "positions='original'), or engine.modify(fn, positions='original'))")
        rope_spec = facts.rope
    if granularity != "request" and facts is None:
        raise ValueError(f"granularity={granularity!r} needs model_config (the model's layer and KV head counts)")
    heads = facts.num_kv_heads if facts is not None else None
    if callable(policy):
        if granularity != "request":
            raise ValueError(f"granularity={granularity!r} is for registered policies; a selection function's sets "
                             f"are what it returns ([k], [L, k] or [L, H_kv, k])")
        name, select = _user_select(policy, 0.5 if r is None else r, params)
        return DropFn(name, select, r, budget, rerotate, rope_spec, dict(params), needs=None, query_rows=None,
                      num_kv_heads=heads)

    pol = get_policy(policy)
    granularity = policy_granularity(pol, policy, granularity)
    p = pol.make_params(**params)
    if facts is None and _reads_model(pol):
        raise _needs_model(policy)
    extra = dict(pol.setup(facts)) if pol.setup is not None else {}  # per-model values, computed once
    keep, reads_query = pol.keep, pol.needs != "kv"
    if granularity != "request" and not pol.per_head_only:  # request-only policies never see the keyword
        extra["granularity"] = granularity

    def select(tensors, tokens, drop_ratio):
        return keep(get_kv(tensors), get_query(tensors) if reads_query else None, drop_ratio, params=p, facts=facts,
                    **extra)

    if r == 1:
        warnings.warn(ratio_one_note(policy, vars(p)), stacklevel=2)
    return DropFn(policy, select, r, budget, rerotate, rope_spec, dict(vars(p)), needs=pol.needs,
                  query_rows=pol.rows(p), reads_only=pol.builtin, granularity=granularity, num_kv_heads=heads)


def _reads_model(pol) -> bool:
    return pol.needs_model or pol.setup is not None


def _needs_model(policy: str) -> ValueError:
    return ValueError(f"policy {policy!r} needs model_config (the model's facts: engine.facts, the model or its "
                      "config): its head_dim and head counts")


def ratio_one_note(policy: str, params: Mapping) -> str:
    """What drop ratio 1 keeps: not 0 tokens, but those `policy` always keeps (`tdutils.selection.keep_count`'s
    rule: ratio 1 keeps 0, the policies still keep their protected tokens; at least one), named by its `params`."""
    protected = ", ".join(f"{k}={params[k]}" for k in ("n_sink", "window") if params.get(k))
    return (f"drop_ratio=1 keeps only the tokens {policy} always keeps ({protected or 'none protected'}; at least one "
            f"per request), not 0: a test of the protected tokens alone; make_drop_fn(..., budget=k) keeps exactly k")


__all__ = ["DropFn", "DropFunctionError", "ModifyFn", "Timings", "as_drop_fn", "check_token_ids", "kept_rows",
           "make_drop_fn", "one_set", "ratio_one_note", "validate_drop_output"]
