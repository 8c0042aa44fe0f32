"""Drop functions: a policy becomes an LMCache-style `ModifyFn` that edits one request's KV cache.

Contract (docs/design.md §3, LMCache's `ModifyFnType`)::

    fn(tensors: Mapping[CacheKind, Tensor], tokens: Sequence[int]) -> (new_kv, new_tokens)

`tensors[CacheKind.KV]` is `[2, L, T, D]` (keys after RoPE, values; `D = H_kv * head_dim`), `tensors[CacheKind.QUERY]`
`[L, Tq, Hq * head_dim]` aligned to the end of the KV. The result is `new_kv [2, L, k, D]` and `k` ids: kept
indices sorted ascending, values gathered, keys gathered and (with `rerotate=True`) moved by RoPE from position
`keep[i]` to `i`. A drop function never mutates its input; engines validate its output (`validate_drop_output`)
and keep a request's cache unchanged when it fails. `make_drop_fn` finds policies by name in `tdutils.policies`;
`kept_rows` recovers the kept indices of any ModifyFn's output. The tensor helpers live in `tdutils.kvcache` and
are re-exported here.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .kvcache import CacheKind, apply_keep, check_keep, check_kv, get_kv, get_query
from .selection import check_drop_ratio, keep_count

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


@dataclass
class DropFn:
    """A ModifyFn built by `make_drop_fn`: `select` picks kept indices, then `apply_keep` edits the cache.

    Attributes:
        name: policy name (for tables).
        select: `(tensors, tokens) -> LongTensor[k]` of kept indices.
        drop_ratio: the nominal fraction dropped.
        rerotate: whether keys are moved to compact positions (engines check this against their
            `positions` setting).
        rope_spec: the model's `RopeSpec` (None when `rerotate=False`).
        params: the policy's parameters, `{name: value}`.
        needs: what the policy reads: `"kv"`, `"window"` (the last `query_rows` prompt queries) or `"all"`
            (every prompt query); None for a selection function passed directly (unknown).
        query_rows: query rows to capture at prefill: 0, `w`, or None (all); see
            `tdutils.policies.query_window_for`.
        reads_only: `select` never writes the tensors it is given (tdutils' built-in policies, which the tests
            check), so an engine may hand it the cache itself instead of a protective copy; False for a
            registered or passed user function, whose input is copied first.
    """

    name: str
    select: SelectFn
    drop_ratio: float
    rerotate: bool = True
    rope_spec: object | None = None
    params: dict = field(default_factory=dict)
    needs: str | None = None
    query_rows: int | None = 0
    reads_only: bool = False

    def keep_indices(self, tensors: Mapping, tokens: Sequence[int]) -> torch.Tensor:
        """Sorted LongTensor [k] of the indices this function keeps for one request."""
        kv = get_kv(tensors)
        check_kv(kv, tokens)
        return check_keep(self.select(tensors, tokens), kv.shape[2])

    def __call__(self, tensors: Mapping, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        new_kv, new_tokens, _ = self.edit(tensors, tokens)
        return new_kv, new_tokens

    def edit(self, tensors: Mapping, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """`__call__` plus the sorted kept indices `LongTensor[k]` (engines that need kept positions use it)."""
        kv = get_kv(tensors)
        check_kv(kv, tokens)
        if self.drop_ratio == 0.0:  # docs/design.md §5: ratio 0 returns the input unchanged, bit for bit
            return kv.clone(), [int(t) for t in tokens], torch.arange(kv.shape[2])
        keep = check_keep(self.select(tensors, tokens), kv.shape[2])
        new_kv, new_tokens = apply_keep(kv, tokens, keep, rope_spec=self.rope_spec, rerotate=self.rerotate)
        return new_kv, new_tokens, keep


def make_drop_fn(policy: str | SelectFn, *, drop_ratio: float = 0.5, model_config=None, rerotate: bool = True,
                 **params) -> DropFn:
    """Build the drop function (LMCache `ModifyFn`) of a policy.

    Args:
        policy: a registered policy name (`tdutils.policies.policy_names()`: `"snapkv"`, `"rkv"`, `"random"`,
            `"middle_chunk"`, `"streaming_llm"`, `"h2o"`, `"tova"`, `"knorm"`, `"keydiff"`, and any registered
            with `tdutils.policies.register_policy`; its parameters are the fields of its params dataclass,
            e.g. `tdutils.policies.SnapKVParams`), or your own selection function `select(tensors, tokens) ->
            LongTensor` of kept indices (it may read `CacheKind.KV` and `CacheKind.QUERY`); `drop_ratio` is then
            passed to it as a keyword if it accepts one.
        drop_ratio: fraction of tokens to remove, in [0, 1].
        model_config: the model's transformers config, or the loaded model; needed for RoPE re-rotation and
            by the query-aware policies (head counts, and the model's attention: scale, soft-cap, sinks,
            sliding windows — `tdutils.attention`). With a loaded model, or the config of a model the hf
            engine has open (`engine.config`), RoPE frequencies and learned sinks are read from the live
            model (`tdutils.rope.model_rope`); a bare config gives them from its definition, and a model
            with learned sinks (gpt-oss) then fails for snapkv/rkv (their values live in the weights).
        rerotate: re-rotate kept keys to compact positions (True: what vLLM + LMCache decode with).
        **params: the policy's parameters (e.g. `window=32`); unknown names are refused.

    Returns:
        A `DropFn`, callable as `fn(tensors, tokens) -> (new_kv [2, L, k, D], new_tokens)`; its `needs` and
        `query_rows` say which queries the engine must capture at prefill.

    Raises:
        ValueError: unknown policy name, drop_ratio outside [0, 1], unknown or bad params, or
            `rerotate=True` (or a policy reading head counts) without `model_config`.
    """
    r = check_drop_ratio(drop_ratio)
    rope_spec = None
    if rerotate:
        if model_config is None:
            raise ValueError("rerotate=True needs model_config (the model's transformers config) to re-rotate "
                             "keys; pass model_config=model.config, or rerotate=False with positions='original'")
        from .rope import model_rope

        rope_spec = model_rope(model_config)

    if callable(policy):
        user_select = policy
        name = getattr(policy, "__name__", "custom")
        sig = inspect.signature(user_select).parameters
        takes_ratio = "drop_ratio" in sig or any(p.kind is p.VAR_KEYWORD for p in sig.values())
        extra = {"drop_ratio": r, **params} if takes_ratio else dict(params)
        try:  # the call every request will make, checked now rather than at modify time
            inspect.signature(user_select).bind(None, None, **extra)
        except TypeError as exc:
            raise ValueError(f"selection function {name}{inspect.signature(user_select)} cannot be called as "
                             f"select(tensors, tokens{''.join(f', {k}=...' for k in extra)}): {exc}. It gets "
                             "the tensors and the token ids positionally and drop_ratio only as a keyword "
                             "(name the parameter drop_ratio)") from None

        def select(tensors, tokens):
            return user_select(tensors, tokens, **extra)

        return DropFn(name, select, r, rerotate, rope_spec, dict(params), needs=None, query_rows=None)

    from .policies import get_policy

    pol = get_policy(policy)
    p = pol.make_params(**params)
    facts = None
    if model_config is not None:
        from .models import model_facts

        facts = model_facts(model_config)
    elif pol.needs_model or pol.setup is not None:
        raise ValueError(f"policy {policy!r} needs model_config (head_dim and head counts of the model)")
    extra = dict(pol.setup(model_config)) if pol.setup is not None else {}  # per-model values, computed once
    keep, reads_query = pol.keep, pol.needs != "kv"

    def select(tensors, tokens):
        return keep(get_kv(tensors), get_query(tensors) if reads_query else None, r, params=p, facts=facts, **extra)

    return DropFn(policy, select, r, rerotate, rope_spec, dict(vars(p)), needs=pol.needs, query_rows=pol.rows(p),
                  reads_only=pol.builtin)


__all__ = ["CacheKind", "DropFn", "DropFunctionError", "ModifyFn", "apply_keep", "check_keep", "check_kv",
           "get_kv", "get_query", "keep_count", "make_drop_fn", "validate_drop_output"]
