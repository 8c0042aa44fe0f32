"""`tdutils/csrc/linear.cpp`, the decode step's linear layers (fp32, bf16): the panel layouts by hand, products
against fp64 with an error no larger than `F.linear`'s own, bias, row counts on both sides of the 4-row blocks,
panels cut at N, bad input refused, and `PackedLinears` running weights through it."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdutils import kernels

HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None


def _ops(dtype):
    got = kernels.linear_kernels(dtype) if HAS_COMPILER else None
    if got is None:
        pytest.skip(f"no compiled {dtype} linear kernel here (no compiler, or no AVX-512 / AVX512-BF16)")
    return got


@pytest.fixture(scope="module")
def ops():
    return _ops(torch.float32)


@pytest.fixture(scope="module")
def ops_bf16():
    return _ops(torch.bfloat16)


def test_panels_by_hand(ops):
    pack, _ = ops
    w = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)  # N = 70: two panels, the second cut at 6 columns
    p = pack(w)
    assert p.shape == (2, 3, 64)
    assert p[0, 1, 5].item() == w[5, 1].item() and p[1, 2, 5].item() == w[69, 2].item()
    assert torch.equal(p[1, :, 6:], torch.zeros(3, 58))  # past N: zeros


def test_bf16_panels_by_hand(ops_bf16):
    pack, _ = ops_bf16
    w = torch.arange(70 * 4, dtype=torch.float32).reshape(70, 4).to(torch.bfloat16)  # exact: integers < 256
    p = pack(w)
    assert p.shape == (2, 2, 128) and p.dtype == torch.bfloat16  # pairs of k side by side per column
    assert p[0, 1, 2 * 5 + 1].item() == w[5, 3].item() and p[1, 0, 2 * 5].item() == w[69, 0].item()
    assert not p[1, :, 12:].any()  # past N: zeros
    with pytest.raises(RuntimeError, match="K even"):
        pack(torch.ones(8, 5, dtype=torch.bfloat16))


@pytest.mark.parametrize("M", [1, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("N,K", [(576, 576), (70, 200), (192, 1536), (64, 64)])
def test_bf16_products_are_fp32_sums_of_bf16_values_rounded_once(ops_bf16, M, N, K):
    pack, linear_out = ops_bf16
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    w, x = torch.randn(N, K, generator=gen).bfloat16(), torch.randn(M, K, generator=gen).bfloat16()
    b = torch.randn(N, generator=gen).bfloat16()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    linear_out(x, pack(w), b, out)
    exact = x.double() @ w.double().T + b.double()
    # one rounding to bf16 (2^-8 relative) plus fp32 summation: within 1 bf16 ulp of the exact value, as F.linear
    ulp = exact.abs().clamp_min(1e-3) * 2 ** -7
    assert ((out.double() - exact).abs() <= ulp).all()
    assert ((F.linear(x, w, b).double() - exact).abs() <= ulp).all()


@pytest.mark.parametrize("M", [1, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("N,K", [(576, 576), (70, 200), (192, 1536), (64, 63)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_against_fp64_within_f_linears_error(ops, M, N, K, bias):
    pack, linear_out = ops
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    w, x = torch.randn(N, K, generator=gen), torch.randn(M, K, generator=gen)
    b = torch.randn(N, generator=gen) if bias else None
    out = torch.full((M, N), float("nan"))
    linear_out(x, pack(w), b, out)
    exact = x.double() @ w.double().T + (b.double() if bias else 0.0)
    own = (out.double() - exact).abs().max().item()
    theirs = (F.linear(x, w, b).double() - exact).abs().max().item()
    assert own <= 2 * theirs + 1e-6, (own, theirs)  # every column written (no NaN left), at F.linear's accuracy


def test_no_rows_writes_nothing(ops):
    pack, linear_out = ops
    out = torch.empty(0, 8)
    linear_out(torch.empty(0, 5), pack(torch.randn(8, 5)), None, out)
    assert out.shape == (0, 8)


def test_bad_input_is_refused(ops):
    pack, linear_out = ops
    w = torch.randn(10, 6)
    p = pack(w)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        pack(w.double())
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        linear_out(torch.randn(6, 3).T, p, None, torch.empty(3, 10))
    with pytest.raises(RuntimeError, match="no kernel for Double"):
        linear_out(torch.randn(3, 6).double(), p, None, torch.empty(3, 10))
    with pytest.raises(RuntimeError, match="in x's dtype, for x's K"):
        linear_out(torch.randn(3, 7), p, None, torch.empty(3, 10))
    with pytest.raises(RuntimeError, match="N the packed weight's rows"):
        linear_out(torch.randn(3, 6), p, None, torch.empty(3, 70))
    with pytest.raises(RuntimeError, match=r"bias: \[N\] in x's dtype"):
        linear_out(torch.randn(3, 6), p, torch.randn(9), torch.empty(3, 10))


def test_packed_linears_take_it_in_both_dtypes(ops, ops_bf16):
    from tdutils.engines.packed import PackedLinears

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    x = torch.randn(2, 5, 24)
    with torch.inference_mode():
        want = net(x)
        packed = PackedLinears(net, min_elements=1)
        assert {p.dim() for p, *_ in packed._packed.values()} == {3}  # the panels
        assert packed.bytes == (24 + 40) * 64 * 4  # one panel each, 64 columns wide
        with packed:
            got = net(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    net = net.to(torch.bfloat16)
    bf16 = PackedLinears(net, min_elements=1)
    assert {p.dim() for p, *_ in bf16._packed.values()} == {3}
    with torch.inference_mode():
        want = net(x.bfloat16())
        with bf16:
            got = net(x.bfloat16())
    torch.testing.assert_close(got, want, atol=2 ** -6, rtol=2 ** -7)  # bf16 roundings apart


def test_packed_linears_keep_autograd_where_gradients_are_needed(ops):
    from tdutils.engines.packed import PackedLinears

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40))
    x = torch.randn(2, 24)
    with PackedLinears(net, min_elements=1):
        y = net(x)  # grad mode, trainable weights: the panels have no backward, so F.linear runs
    assert y.requires_grad
    y.sum().backward()
    torch.testing.assert_close(net[0].weight.grad, torch.ones(40, 1) * x.sum(0)[None, :])
