"""The fused K/V layout adapter (tdutils.serving.kvlayout): hand-built caches in vLLM-CPU's measured layout
-> the per-token KV the lmcache engine hands to drop functions, the exact inverse, and clear errors."""

import pytest
import torch

from tdutils.serving.kvlayout import ARRANGEMENTS, KVLayoutError, fused_to_kv, kv_to_fused

NB, H, BS, D, L = 3, 2, 4, 3, 2  # blocks, KV heads, block size, head size, layers (small, so rows are readable)


def _cache(seed: int):
    """One layer of vLLM-CPU's cache `[NB, H, BS, 2D]` built by hand from known K and V `[NB, H, BS, D]`: each
    (block, head) holds K transposed `[D, BS]` then V `[BS, D]` (docs/design.md §6)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(NB, H, BS, D, generator=g), torch.randn(NB, H, BS, D, generator=g)
    slab = torch.cat([k.transpose(-1, -2).reshape(NB, H, D * BS), v.reshape(NB, H, BS * D)], dim=-1)
    return slab.reshape(NB, H, BS, 2 * D), k, v


def _lmcache_rows(caches):
    """What LMCache hands the SDK for those caches: row t of a layer is cache[t // BS, h, t % BS, :] for each
    head h, head-major: `[1, L, NB*BS, H*2D]`."""
    return torch.stack([c.permute(0, 2, 1, 3).reshape(NB * BS, H * 2 * D) for c in caches])[None]


def _per_token(x):
    """`[NB, H, BS, D]` -> `[NB*BS, H*D]` (token t = block t // BS, row t % BS; heads concatenated)."""
    return x.permute(0, 2, 1, 3).reshape(NB * BS, H * D)


def test_vllm_cpu_blocks_become_per_token_keys_and_values():
    built = [_cache(s) for s in range(L)]
    kv = fused_to_kv(_lmcache_rows([c for c, _, _ in built]), block_size=BS, num_kv_heads=H, head_dim=D)
    assert kv.shape == (2, L, NB * BS, H * D)
    for layer, (_, k, v) in enumerate(built):
        assert torch.equal(kv[0, layer], _per_token(k))
        assert torch.equal(kv[1, layer], _per_token(v))
    # one value checked by hand: token 5 = block 1, row 1; head 1, channel 2 of K sits in K^T at [2, 1], i.e. at
    # flat offset 2*BS + 1 of that (block, head)'s slab
    cache0 = built[0][0]
    assert kv[0, 0, 5, 1 * D + 2] == cache0[1, 1].reshape(-1)[2 * BS + 1]
    assert kv[1, 0, 5, 1 * D + 2] == cache0[1, 1].reshape(-1)[D * BS + 1 * D + 2]


def test_k_v_per_token_arrangement_is_what_lmcache_names():
    """`k_v`: each row of a (block, head) is K|V of one token (what NL_X_NB_NH_BS_CS promises)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(NB, H, BS, D, generator=g), torch.randn(NB, H, BS, D, generator=g)
    rows = _lmcache_rows([torch.cat([k, v], dim=-1)])[0]  # [L=1, T, H*2D], a 3-D input works too
    kv = fused_to_kv(rows, block_size=BS, num_kv_heads=H, head_dim=D, arrangement="k_v")
    assert torch.equal(kv[0, 0], _per_token(k)) and torch.equal(kv[1, 0], _per_token(v))


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_gives_the_same_bytes(arrangement, dtype):
    fused = torch.randn(1, L, NB * BS, H * 2 * D).to(dtype)
    kv = fused_to_kv(fused, block_size=BS, num_kv_heads=H, head_dim=D, arrangement=arrangement)
    back = kv_to_fused(kv, block_size=BS, num_kv_heads=H, head_dim=D, arrangement=arrangement)
    assert back.dtype == dtype and back.is_contiguous()
    assert torch.equal(back.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       fused.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    kv2 = torch.randn(2, L, 2 * BS, H * D).to(dtype)
    again = fused_to_kv(kv_to_fused(kv2, block_size=BS, num_kv_heads=H, head_dim=D, arrangement=arrangement),
                        block_size=BS, num_kv_heads=H, head_dim=D, arrangement=arrangement)
    assert torch.equal(again, kv2)


def test_shapes_that_do_not_fit_are_refused_clearly():
    fused = torch.zeros(1, L, NB * BS, H * 2 * D)
    with pytest.raises(KVLayoutError, match=r"does not fit \[1, L, T, 12\] \(H_kv=2 heads x 2\*3\)"):
        fused_to_kv(torch.zeros(1, L, NB * BS, 10), block_size=BS, num_kv_heads=H, head_dim=D)
    with pytest.raises(KVLayoutError, match="holds 11 tokens, not a whole number of 4-token blocks"):
        fused_to_kv(fused[:, :, :11], block_size=BS, num_kv_heads=H, head_dim=D)
    with pytest.raises(KVLayoutError, match="does not fit"):
        fused_to_kv(torch.zeros(L, NB * BS), block_size=BS, num_kv_heads=H, head_dim=D)
    with pytest.raises(KVLayoutError, match=r"KV of shape \(1, 2, 12, 6\) does not fit \[2, L, T, 6\]"):
        kv_to_fused(torch.zeros(1, L, NB * BS, H * D), block_size=BS, num_kv_heads=H, head_dim=D)
    with pytest.raises(KVLayoutError, match="KV holds 6 tokens, not a whole number of 4-token blocks"):
        kv_to_fused(torch.zeros(2, L, 6, H * D), block_size=BS, num_kv_heads=H, head_dim=D)
    with pytest.raises(KVLayoutError, match="arrangement must be one of"):
        fused_to_kv(fused, block_size=BS, num_kv_heads=H, head_dim=D, arrangement="v_k")
    with pytest.raises(KVLayoutError, match="block_size must be a positive integer, got 0"):
        kv_to_fused(torch.zeros(2, L, 4, H * D), block_size=0, num_kv_heads=H, head_dim=D)
