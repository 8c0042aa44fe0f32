"""Prepacked linears (`tdutils.engines.packed`): the same products as `F.linear`, the module restored after use,
repacked after an in-place weight edit, and the engine's greedy decode unchanged by them."""

import pytest
import torch
from torch import nn

from tdutils.engines.packed import PackedLinears, packing_available

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _net(bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40, bias=bias), nn.ReLU(), nn.Linear(40, 8, bias=False))


@pytest.mark.parametrize("shape", [(8, 24), (3, 24), (2, 5, 24), (1, 1, 24)])
def test_packed_products_equal_f_linear(shape):
    net = _net()
    x = torch.randn(*shape)
    with torch.inference_mode():
        want = net(x)
        with PackedLinears(net, rows=8, min_elements=1) as packed:
            assert all("forward" in m.__dict__ for m in (net[0], net[2]))  # the packed path is what runs
            got = net(x)
    assert len(packed) == 2 and packed.bytes >= (24 * 40 + 40 * 8) * 4  # fp32 panels pad to 64 columns
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all("forward" not in m.__dict__ for m in net)  # restored on exit


def test_forward_restored_after_an_error_and_nested_use():
    net = _net()
    packed = PackedLinears(net, min_elements=1)
    with pytest.raises(RuntimeError, match="boom"), packed:
        with packed:  # nested: still packed after the inner exit
            pass
        assert "forward" in net[0].__dict__
        raise RuntimeError("boom")
    assert "forward" not in net[0].__dict__ and "forward" not in net[2].__dict__


def test_weight_edited_in_place_is_packed_again():
    net = _net()
    x = torch.randn(4, 24)
    packed = PackedLinears(net, min_elements=1)
    with torch.no_grad():
        net[0].weight.mul_(2.0)  # e.g. a fine-tuning step after the engine was opened
        want = net(x)
        with packed:
            got = net(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hooked_and_subclassed_linears_keep_their_forward():
    class MyLinear(nn.Linear):
        pass

    net = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4))
    hooked = nn.Linear(4, 4)
    hooked.forward = lambda x: x  # as accelerate's offload hooks do
    net.append(hooked)
    assert len(PackedLinears(net, min_elements=1)) == 1


def test_the_default_packs_only_models_whose_weights_stream_from_memory(tiny):
    from tdutils.engines.packed import packing_pays

    assert not packing_pays(tiny[0])  # the bundled toy model fits the caches: F.linear is faster there
    big = nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 8))  # 32 MiB in one large matrix
    assert packing_pays(big) and len(PackedLinears(big)) == 1  # the 8-row one (below MIN_ELEMENTS) stays on F.linear


def test_unavailable_models_are_refused():
    half = _net().half()
    assert not packing_available(half)
    with pytest.raises(RuntimeError, match="packed_linears=False"):
        PackedLinears(half)


def test_engine_decode_packed_equals_unpacked(tiny, sample_ids):
    """Greedy tokens equal, logits within float32 summation-order noise, with and without packed linears; the
    engine refuses a packed_linears it cannot honour."""
    from tdutils.engines.hf import HFEngine

    model, tok = tiny
    outs = {}
    for flag in (False, True):
        eng = HFEngine(model, tokenizer=tok, kv_budget_tokens=400, progress=False, packed_linears=flag)
        assert (eng._packed is not None and len(eng._packed) > 0) == flag
        eng.prefill(sample_ids)
        outs[flag] = eng.decode(max_tokens=8, keep_logits=True)
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=2e-5, rtol=0)
    assert all("forward" not in m.__dict__ for m in model.modules())  # the user's model is unchanged after decode
    with pytest.raises(TypeError, match="packed_linears must be None, True or False"):
        HFEngine(model, tokenizer=tok, progress=False, packed_linears="yes")
    with pytest.raises(TypeError, match="packed_linears must be None, True or False, got 1"):
        HFEngine(model, tokenizer=tok, progress=False, packed_linears=1)


def test_bf16_and_fp32_panels_pack_smaller_weights_than_onednn_fp32():
    from tdutils.engines.packed import default_min_elements
    from tdutils.kernels import linear_kernels

    net = nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 16))  # the second: 2^16 elements, a k/v projection's size
    fp32 = 2 if linear_kernels(torch.float32) is not None else 1  # tdutils' panels: small ones too; oneDNN: not
    assert len(PackedLinears(net, min_elements=default_min_elements(torch.float32))) == fp32
    bf16 = net.to(torch.bfloat16)
    assert len(PackedLinears(bf16, min_elements=default_min_elements(torch.bfloat16))) == 2
