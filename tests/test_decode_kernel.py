"""`tdutils.kernels`' compiled decode attention against fp64 `sdpa` (the model's own attention), across head dims
(the AVX-512 blocks of 16 columns and 64 values, and the generic loop), GQA group sizes, cache lengths that are not
a multiple of 16, every mask form the engine passes, and the batched-matmul fallback it replaces."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from tdutils import kernels
from tdutils.attention import decode_attention

HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None


def _case(dtype, d, g, T=77, B=3, H=2, seed=0):
    W = T + 13  # the store is wider than the view
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, W, d, generator=gen).to(dtype)[:, :, :T]  # slot store views: [S, H_kv, W, d] cut at T
    v = torch.randn(B, H, W, d, generator=gen).to(dtype)[:, :, :T]
    q = torch.randn(B, H * g, 1, d, generator=gen).to(dtype)
    return q, k, v


def _masks(B, Hq, T):
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(B, 1, 1, T, generator=gen) > 0.4
    keep[..., -1] = True
    heads = torch.rand(B, Hq, 1, T, generator=gen) > 0.5
    heads[..., -1] = True
    prefix = torch.arange(T)[None, :] < torch.tensor([T, 17, 40])[:B, None]  # whole blocks of 16 hidden
    prefix = prefix[:, None, None, :]
    return {"none": None, "bool": keep, "per_head": heads, "prefix": prefix,
            "additive": torch.zeros(keep.shape).masked_fill_(~keep, torch.finfo(torch.float32).min)}


def _reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=m, scale=scale).transpose(1, 2)


@pytest.fixture(scope="module")
def op():
    op = kernels.decode_attention_kernel()
    if op is None and not HAS_COMPILER:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    assert op is not None, kernels.kernel_status()
    return op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,g", [(64, 3), (64, 5), (128, 1), (256, 4), (16, 2), (40, 3)])
@pytest.mark.parametrize("kind", ["none", "bool", "per_head", "prefix", "additive"])
def test_kernel_is_sdpa(op, dtype, d, g, kind):
    q, k, v = _case(dtype, d, g)
    mask = _masks(q.shape[0], q.shape[1], k.shape[2])[kind]
    out = decode_attention(q, k, v, mask, 0.3)
    assert out.shape == (q.shape[0], 1, q.shape[1], d) and out.dtype == dtype
    ref = _reference(q, k, v, mask, 0.3)
    # fp32: summation order; bf16: the inputs are exact, the fp32 result is rounded once to bf16 (half an ulp)
    atol = 2e-6 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8 if dtype == torch.bfloat16 else 0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_matmul_fallback_agree(op, dtype, monkeypatch):
    q, k, v = _case(dtype, 64, 3, T=200)
    mask = _masks(3, 6, 200)["prefix"]
    fast = decode_attention(q, k, v, mask)
    monkeypatch.setitem(kernels._state, "ops", None)  # what a machine without a compiler runs
    slow = decode_attention(q, k, v, mask)
    tol = {"rtol": 0, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2 ** -6, "atol": 2 ** -6}
    torch.testing.assert_close(fast.float(), slow.float(), **tol)


def test_a_head_that_attends_nowhere_gets_zeros(op):
    q, k, v = _case(torch.float32, 64, 3, T=20)
    mask = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    mask[1] = False
    out = decode_attention(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()


def test_kernel_reads_no_column_past_the_view(op):
    q, k, v = _case(torch.bfloat16, 64, 3, T=33)
    k._base[:, :, 33:], v._base[:, :, 33:] = float("nan"), float("nan")  # past the view: never read
    out = decode_attention(q, k, v, None)
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("lowest", [torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min])
def test_columns_an_additive_mask_hides_with_the_dtype_minimum_are_not_read(op, lowest):
    # the engine's sliding-window layers hide old columns this way: reading them cost Gemma 3 four times the
    # bytes of its 512-token window at 2048 tokens
    q, k, v = _case(torch.float32, 64, 3, T=40)
    seen = torch.zeros(3, 1, 1, 40, dtype=torch.bool)
    seen[..., 25:] = True  # a window of the last 15 columns
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :25], v_nan[:, :, :25] = float("nan"), float("nan")  # outside the window: must not be read
    additive = torch.zeros(seen.shape).masked_fill_(~seen, float(lowest))
    out = decode_attention(q, k_nan, v_nan, additive)
    torch.testing.assert_close(out, decode_attention(q, k[:, :, 25:], v[:, :, 25:], None), rtol=0, atol=2e-6)


def test_turned_off_it_says_nothing_and_the_matmuls_run(monkeypatch, capsys):
    monkeypatch.setenv(kernels.ENV, "0")
    monkeypatch.setattr(kernels, "_state", {})
    assert kernels.decode_attention_kernel() is None
    assert capsys.readouterr().err == ""
    q, k, v = _case(torch.float32, 64, 3)
    torch.testing.assert_close(decode_attention(q, k, v, None).double(), _reference(q, k, v, None, None),
                               rtol=0, atol=2e-6)


def test_a_failed_build_falls_back_with_one_line(monkeypatch, capsys):
    from torch.utils import cpp_extension

    def fail(*a, **k):
        raise RuntimeError("Error building extension 'tdutils_kernels'")

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setattr(kernels, "NAME", "tdutils_kernels_missing")  # not the loaded op
    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    assert kernels.decode_attention_kernel() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tdutils: decode attention falls back to batched matmuls: the build failed"), err
    assert kernels.kernel_status().startswith("compiled decode attention: not in use (the build failed")


def test_a_killed_builds_lock_is_removed_not_waited_for(tmp_path, capsys):
    """A build killed hard leaves torch's `lock` file; torch's loader would wait for it forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - kernels.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert kernels._wait_for_lock(lock) == ""
    assert not lock.exists()
    assert "left 12" in capsys.readouterr().err  # its age, in seconds
    assert kernels._wait_for_lock(tmp_path / "none") == ""


def test_a_live_build_is_waited_for_then_given_up(tmp_path, monkeypatch, capsys):
    lock = tmp_path / "lock"
    lock.write_text("")
    monkeypatch.setattr(kernels, "LOCK_WAIT_S", 1.0)
    why = kernels._wait_for_lock(lock)
    assert why.startswith("another process has been compiling it for") and str(lock) in why, why
    assert lock.exists()  # never removed while it may belong to a live build
    assert capsys.readouterr().err.startswith("tdutils: waiting for another process compiling")
