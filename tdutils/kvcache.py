"""A request's cache tensors as drop functions see them: `CacheKind`, the accessors of the `tensors`
mapping, kept-index validation and `apply_keep` (gather the kept tokens, re-rotate their keys).

The bottom layer under `tdutils.edit` (drop functions) and `tdutils.policies` (token selection): it imports
neither, so policies can use it without an import circle. Layouts as in docs/design.md §3: KV `[2, L, T, D]` (0 =
keys after RoPE, 1 = values; `D = H_kv * head_dim`), query `[L, Tq, Hq * head_dim]` aligned to the end of
the KV.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import torch

from .rope import rerotate_k_cache, rerotate_keys
from .selection import pack_sets

try:  # LMCache's own enum when installed, so drop functions run unchanged on the serving path.
    from lmcache.sdk import LMCacheSDKCacheKind as CacheKind  # type: ignore
except Exception:  # noqa: BLE001 (lmcache is optional; any import failure means "not usable")

    class CacheKind(str, enum.Enum):
        """Which tensor of a request a drop function receives (same values as `lmcache.sdk`)."""

        KV = "kv"
        QUERY = "query"


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

        new_positions = torch.arange(keep.numel())
        new_kv = rerotate_k_cache(new_kv, keep, new_positions, rope_spec, inplace=True)  # new_kv is ours: no copy
    return new_kv, [int(tokens[i]) for i in keep.tolist()]


def check_keep_sets(keep: torch.Tensor, n: int, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """Validate kept indices per request `[k]`, per layer `[L, k]` or per KV head `[L, H, k]` for `n` tokens;
    returns them as a CPU LongTensor sorted on the last dim (`check_keep` for `[k]`). Unequal per-head counts come
    as `[L, H, k_max]` padded with -1 before each set's indices (`tdutils.selection.pack_sets`), returned as given.

    Raises:
        ValueError: not integers, another `L` or `H`, empty sets, indices out of range or duplicated in a set,
            padding not laid out as `pack_sets` lays it.
    """
    keep = torch.as_tensor(keep)
    if keep.dim() == 1:
        return check_keep(keep, n)
    want = (num_layers,) if keep.dim() == 2 else (num_layers, num_kv_heads)
    if keep.dim() not in (2, 3) or tuple(keep.shape[:-1]) != want or keep.dtype.is_floating_point \
            or keep.dtype == torch.bool:
        raise ValueError(f"kept indices must be an integer tensor [k], [L, k] or [L, H_kv, k] with L = {num_layers}, "
                         f"H_kv = {num_kv_heads}; got dtype {keep.dtype}, shape {tuple(keep.shape)}")
    if keep.dim() == 3 and keep.numel() and int(keep.min()) == -1:  # unequal counts, padded (`pack_sets`)
        return _check_padded(keep.long().cpu(), n)
    keep = torch.sort(keep.long().cpu(), dim=-1).values
    if keep.shape[-1] == 0:
        raise ValueError("a drop function must keep at least one token")
    if int(keep.min()) < 0 or int(keep.max()) >= n:
        raise ValueError(f"kept indices must lie in [0, {n}), got min {int(keep.min())}, max {int(keep.max())}")
    if keep.shape[-1] > 1 and bool((keep[..., 1:] == keep[..., :-1]).any()):
        raise ValueError("kept indices contain duplicates within a set")
    return keep


def _check_padded(keep: torch.Tensor, n: int) -> torch.Tensor:
    """Validate per-head sets of unequal counts `[L, H, k_max]` padded with -1 (`tdutils.selection.pack_sets`);
    returns them unchanged (their layout is the storage layout, so they are not re-sorted)."""
    valid = keep >= 0
    if int(keep.max()) >= n or int(keep.min()) < -1:
        raise ValueError(f"kept indices must lie in [0, {n}) (-1 = padding), got min {int(keep.min())}, "
                         f"max {int(keep.max())}")
    mask = torch.zeros(*keep.shape[:2], n + 1, dtype=torch.long)
    mask.scatter_add_(-1, torch.where(valid, keep, n), valid.long())
    if int(mask.max()) > 1:
        raise ValueError("kept indices contain duplicates within a set")
    if not bool(valid[..., -1].all()) or not torch.equal(pack_sets(mask[..., :n].bool()), keep):
        raise ValueError("padded per-head sets must hold each set's indices ascending after its padding -1 "
                         "(right-aligned: tdutils.selection.pack_sets)")
    return keep


def apply_keep_heads(kv: torch.Tensor, tokens: Sequence[int], keep: torch.Tensor, *, rope_spec=None,
                     rerotate: bool = True) -> tuple[torch.Tensor, list[int]]:
    """Gather one kept set per (layer, KV head); re-rotate each head's keys to compact positions.

    Args:
        kv: `[2, L, T, D]`, `D = H * head_dim` (any float dtype, any device); not modified.
        tokens: the T token ids.
        keep: LongTensor `[L, H, k]` (sorted on the last dim, `check_keep_sets`); unequal counts padded with -1
            (`tdutils.selection.pack_sets`), whose rows are stored as zeros (engines mask them).
        rope_spec: a `tdutils.rope.RopeSpec` or one per layer; required when `rerotate=True`.
        rerotate: move head `h`'s key `i` of layer `l` from position `keep[l, h, i]` to position `i` (fp32
            arithmetic, one cast; `tdutils.rope.rerotate_keys` with per-row positions).

    Returns:
        `(new_kv [2, L, k, D], new_tokens)`: row `i` of head `h` in layer `l` holds token `keep[l, h, i]`;
        `new_tokens[i] = tokens[keep[0, 0, i]]` (layer 0, head 0; the rows every set shares, such as a protected
        window at the end, hold the same token in every head); where head 0 of layer 0 has padding, the largest
        index kept in that row.
    """
    check_kv(kv, tokens)
    two, L, T, D = kv.shape
    _, H, k = keep.shape
    d = D // H
    pad = keep < 0  # [L, H, k]: padding rows of unequal counts (`pack_sets`), stored as zeros
    idx = keep.clamp(min=0).to(kv.device)  # [L, H, k]
    index = idx.transpose(1, 2)[None, :, :, :, None].expand(two, L, k, H, d)
    new = torch.gather(kv.view(two, L, T, H, d), 2, index)  # [2, L, k, H, d]
    if bool(pad.any()):
        new.masked_fill_(pad.transpose(1, 2).to(kv.device)[None, :, :, :, None], 0)
    if rerotate:
        if rope_spec is None:
            raise ValueError("rerotate=True needs the model's RoPE spec; pass model_config= to make_drop_fn")

        new_pos = torch.arange(k, device=kv.device).repeat(H)  # [H*k]: 0..k-1 in every head
        for layer in range(L):
            spec = rope_spec[layer] if isinstance(rope_spec, list | tuple) else rope_spec
            rows = new[0, layer].transpose(0, 1).reshape(H * k, d)  # [H*k, d], head-major
            rot = rerotate_keys(rows, idx[layer].reshape(-1), new_pos, spec, token_dim=-2)
            new[0, layer] = rot.view(H, k, d).transpose(0, 1)
    # a padding row's token: the largest index any set keeps in that row (every row holds a token in some set)
    rows = torch.where(pad[0, 0], keep.reshape(L * H, k).amax(dim=0), keep[0, 0]) if bool(pad.any()) else keep[0, 0]
    return new.view(two, L, k, D), [int(tokens[i]) for i in rows.tolist()]


__all__ = ["CacheKind", "apply_keep", "apply_keep_heads", "check_keep", "check_keep_sets", "check_kv", "get_kv",
           "get_query"]
