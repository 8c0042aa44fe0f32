"""Drop functions: a policy becomes an LMCache-style `ModifyFn` that edits one request's KV cache.

Contract (SPEC §3, LMCache's `ModifyFnType`)::

    fn(tensors: Mapping[CacheKind, Tensor], tokens: Sequence[int]) -> (new_kv, new_tokens)

`tensors[CacheKind.KV]` is `[2, L, T, D]` (0 = keys after RoPE, 1 = values; `D = H_kv * head_dim`);
`tensors[CacheKind.QUERY]`, when present, is `[L, Tq, Hq * head_dim]` aligned to the end of the KV.
The result is `new_kv [2, L, k, D]` with `new_tokens` a list of `k` ints: kept indices `keep` sorted
ascending, `new_tokens[i] = tokens[keep[i]]`, V rows gathered as they are, K rows gathered and (with
`rerotate=True`) moved by RoPE from position `keep[i]` to position `i` ("compact positions").

A drop function never mutates its input and validates shapes first; the engines validate its output
(`validate_drop_output`) and keep a request's cache unchanged when it fails.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .selection import check_drop_ratio, keep_count

try:  # LMCache's own enum when installed, so drop functions run unchanged on the serving path.
    from lmcache.sdk import LMCacheSDKCacheKind as CacheKind  # type: ignore
except Exception:  # noqa: BLE001 (lmcache is optional; any import failure means "not usable")

    class CacheKind(str, enum.Enum):
        """Which tensor of a request a drop function receives (same values as `lmcache.sdk`)."""

        KV = "kv"
        QUERY = "query"


ModifyFn = Callable[[Mapping, Sequence[int]], tuple[torch.Tensor, list[int]]]
# A selection function: (tensors, tokens) -> LongTensor of kept indices.
SelectFn = Callable[[Mapping, Sequence[int]], torch.Tensor]


class DropFunctionError(RuntimeError):
    """A drop function raised or returned output that breaks the ModifyFn contract."""


def get_kv(tensors: Mapping) -> torch.Tensor:
    """The `[2, L, T, D]` KV tensor of `tensors`, keyed by `CacheKind.KV` (or the string "kv")."""
    for key, value in tensors.items():
        if key == CacheKind.KV or getattr(key, "value", key) == "kv":
            return value
    raise KeyError(f"tensors has no KV entry (keys: {[getattr(k, 'value', k) for k in tensors]}); "
                   f"pass {{CacheKind.KV: kv}}")


def get_query(tensors: Mapping) -> torch.Tensor | None:
    """The query tensor `[L, Tq, Hq*d]` (a leading batch dim of 1, as LMCache returns, is removed), or None."""
    for key, value in tensors.items():
        if key == CacheKind.QUERY or getattr(key, "value", key) == "query":
            return value[0] if value.dim() == 4 and value.shape[0] == 1 else value
    return None


def check_kv(kv: torch.Tensor, tokens: Sequence[int]) -> None:
    """Raise TypeError unless `kv` is a tensor, ValueError unless it is `[2, L, T, D]` with `T == len(tokens)`."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"KV must be a torch.Tensor of shape [2, L, T, D], got {type(kv).__name__}")
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"KV must have shape [2, L, T, D] (keys and values), got {tuple(kv.shape)}")
    if kv.shape[2] != len(tokens):
        raise ValueError(f"KV holds {kv.shape[2]} tokens but {len(tokens)} token ids were given; "
                         f"they must match")


def check_keep(keep: torch.Tensor, n: int) -> torch.Tensor:
    """Validate kept indices for `n` tokens; returns them as a sorted CPU LongTensor.

    Raises:
        ValueError: not 1-D integers, empty, out of range, or duplicated.
    """
    keep = torch.as_tensor(keep)
    if keep.dim() != 1 or keep.dtype.is_floating_point or keep.dtype == torch.bool:
        raise ValueError(f"kept indices must be a 1-D integer tensor, got dtype {keep.dtype}, shape {tuple(keep.shape)}")
    keep = torch.sort(keep.long().cpu()).values
    if keep.numel() == 0:
        raise ValueError("a drop function must keep at least one token")
    if keep[0] < 0 or keep[-1] >= n:
        raise ValueError(f"kept indices must lie in [0, {n}), got min {int(keep[0])}, max {int(keep[-1])}")
    if keep.numel() > 1 and bool((keep[1:] == keep[:-1]).any()):
        raise ValueError("kept indices contain duplicates")
    return keep


def apply_keep(kv: torch.Tensor, tokens: Sequence[int], keep: torch.Tensor, *, rope_spec=None,
               rerotate: bool = True) -> tuple[torch.Tensor, list[int]]:
    """Gather the kept tokens of one request's KV; re-rotate keys to compact positions.

    Args:
        kv: `[2, L, T, D]` (any float dtype, any device); not modified.
        tokens: the T token ids.
        keep: LongTensor [k] of kept indices (validated and sorted here).
        rope_spec: a `tdutils.rope.RopeSpec`; required when `rerotate=True`.
        rerotate: move key `i` from position `keep[i]` to position `i` (fp32 arithmetic, one cast).

    Returns:
        `(new_kv [2, L, k, D], new_tokens list[int] of length k)`: new tensors, input untouched.
    """
    check_kv(kv, tokens)
    n = kv.shape[2]
    keep = check_keep(keep, n)
    if keep.numel() == n:  # nothing dropped: return an exact copy (bit for bit)
        return kv.clone(), [int(t) for t in tokens]
    two, n_layers, _, dim = kv.shape
    # [2L, T, D] gather along tokens: several times faster than index_select on dim 2 of the 4-D view
    new_kv = kv.reshape(two * n_layers, n, dim).index_select(1, keep.to(kv.device)).view(two, n_layers, -1, dim)
    if rerotate:
        if rope_spec is None:
            raise ValueError("rerotate=True needs the model's RoPE spec; pass model_config= to make_drop_fn")
        from .rope import rerotate_k_cache

        new_positions = torch.arange(keep.numel())
        new_kv = rerotate_k_cache(new_kv, keep, new_positions, rope_spec)
    return new_kv, [int(tokens[i]) for i in keep.tolist()]


def check_token_ids(ids: Sequence[int], vocab_size: int) -> int | None:
    """Index of the first id outside `[0, vocab_size)`, or None when all are inside."""
    for j, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return j
    return None


def validate_drop_output(kv: torch.Tensor, tokens: Sequence[int], result,
                         vocab_size: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Check a drop function's return value against its input (SPEC §3); returns `(new_kv, new_tokens)`.

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
    """

    name: str
    select: SelectFn
    drop_ratio: float
    rerotate: bool = True
    rope_spec: object | None = None
    params: dict = field(default_factory=dict)

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
        if self.drop_ratio == 0.0:  # SPEC §5: ratio 0 returns the input unchanged, bit for bit
            return kv.clone(), [int(t) for t in tokens], torch.arange(kv.shape[2])
        keep = check_keep(self.select(tensors, tokens), kv.shape[2])
        new_kv, new_tokens = apply_keep(kv, tokens, keep, rope_spec=self.rope_spec, rerotate=self.rerotate)
        return new_kv, new_tokens, keep


_POLICIES = ("random", "middle_chunk", "snapkv", "rkv")


def make_drop_fn(policy: str | SelectFn, *, drop_ratio: float = 0.5, model_config=None, rerotate: bool = True,
                 **params) -> DropFn:
    """Build the drop function (LMCache `ModifyFn`) of a policy.

    Args:
        policy: `"random"` (`policies.random_keep`; params `seed`, `n_sink`, `window`), `"middle_chunk"`
            (`policies.middle_chunk_keep`; param `chunk_size`), `"snapkv"` (`policies.snapkv_keep`; params
            `window`, `kernel_size`, `pooling`, `gqa_reduce`; needs `CacheKind.QUERY`), `"rkv"` (`policies.rkv_keep`;
            params of `policies.rkv.RKVParams`: `window`, `kernel_size`, `mix_lambda`, `threshold`, `redundancy`
            ("reference" | "exact" | "tiled" | "buffered"), `eps` and the method's tiles `row_tile`, `col_block`,
            `first_block`, `chunk_size`, `device`; needs `CacheKind.QUERY`), or your own selection function
            `select(tensors, tokens) -> LongTensor` of kept indices (it may read `CacheKind.KV` and
            `CacheKind.QUERY`); `drop_ratio` is then passed to it as a keyword if it accepts one.
        drop_ratio: fraction of tokens to remove, in [0, 1].
        model_config: the model's transformers config, or the loaded model; needed for RoPE re-rotation and
            by the query-aware policies (head counts, and the model's attention: scale, soft-cap, sinks,
            sliding windows — `tdutils.attention`). With a loaded model, or the config of a model the hf
            engine has open (`engine.config`), RoPE frequencies and learned sinks are read from the live
            model (`tdutils.rope.model_rope`); a bare config gives them from its definition, and a model
            with learned sinks (gpt-oss) then fails for snapkv/rkv (their values live in the weights).
        rerotate: re-rotate kept keys to compact positions (True: what vLLM + LMCache decode with).

    Returns:
        A `DropFn`, callable as `fn(tensors, tokens) -> (new_kv [2, L, k, D], new_tokens)`.

    Raises:
        ValueError: unknown policy name, drop_ratio outside [0, 1], unknown params, or
            `rerotate=True` without `model_config`.
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

        return DropFn(name, select, r, rerotate, rope_spec, dict(params))

    if policy == "random":
        from .policies.random import RandomParams, random_keep

        p = _params(RandomParams, params, policy)

        def select(tensors, tokens):
            return random_keep(len(tokens), r, seed=p.seed, n_sink=p.n_sink, window=p.window)

    elif policy == "middle_chunk":
        from .policies.random import middle_chunk_keep

        chunk_size = int(params.pop("chunk_size", 256))
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if params:
            raise ValueError(f"unknown parameters for policy 'middle_chunk': {sorted(params)}; known: ['chunk_size']")
        p = {"chunk_size": chunk_size}

        def select(tensors, tokens):
            return middle_chunk_keep(len(tokens), r, chunk_size=chunk_size)

    elif policy == "snapkv":
        from .attention import scoring_attention
        from .models import model_facts
        from .policies.snapkv import SnapKVParams, snapkv_keep

        if model_config is None:
            raise ValueError("policy 'snapkv' needs model_config (head_dim and head counts of the model)")
        p = _params(SnapKVParams, params, policy)
        head_dim = model_facts(model_config).head_dim
        attention = scoring_attention(model_config)

        def select(tensors, tokens):
            return snapkv_keep(get_kv(tensors), get_query(tensors), r, head_dim=head_dim, window=p.window,
                               kernel_size=p.kernel_size, pooling=p.pooling, gqa_reduce=p.gqa_reduce,
                               attention=attention)

    elif policy == "rkv":
        from .attention import scoring_attention
        from .models import model_facts
        from .policies.rkv import RKVParams, _method_settings, rkv_keep

        if model_config is None:
            raise ValueError("policy 'rkv' needs model_config (head_dim and head counts of the model)")
        p = _params(RKVParams, params, policy)
        _method_settings(p.redundancy, p.tiles())  # a bad method or tile fails here, not on the first request
        rkv_kwargs = p.score_kwargs()
        head_dim = model_facts(model_config).head_dim
        attention = scoring_attention(model_config)

        def select(tensors, tokens):
            return rkv_keep(get_kv(tensors), get_query(tensors), r, head_dim=head_dim, attention=attention,
                            **rkv_kwargs)

    else:
        raise ValueError(f"unknown policy {policy!r}; choose one of {list(_POLICIES)} or pass a selection function")
    return DropFn(policy, select, r, rerotate, rope_spec, p if isinstance(p, dict) else vars(p))


def _params(cls, params: dict, policy: str):
    known = set(cls.__dataclass_fields__)
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"unknown parameters for policy {policy!r}: {sorted(unknown)}; known: {sorted(known)}")
    return cls(**params)


__all__ = ["CacheKind", "DropFn", "DropFunctionError", "ModifyFn", "apply_keep", "check_keep", "check_kv",
           "get_kv", "get_query", "keep_count", "make_drop_fn", "validate_drop_output"]
