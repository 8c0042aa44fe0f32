"""The hf engine's lean decode step (`tdutils.engines.lean_step`): the same logits and tokens as transformers'
forward on every family it takes, and transformers' forward wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from families import family_model
from tdutils.engines import open_engine
from tdutils.engines.lean_step import LeanDecodeStep, lean_step_refusal

LEAN = ("llama", "llama3_rope", "mistral", "mistral_sliding", "qwen2", "qwen2_sliding", "qwen3", "gemma3")
NOT_LEAN = ("gemma2", "phi3", "granite", "olmo2", "gpt_neox", "gpt_oss")
LENS = (30, 17, 24)
pytestmark = pytest.mark.filterwarnings("ignore:.*RoPE scaling factor.*")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tokenizer():
    from tdutils.models import load_tokenizer

    return load_tokenizer("tiny-qwen3")


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(4, 200, (n,), generator=g).tolist() for n in LENS]


def _decode(model, lean, steps=6, **kw):
    """(token ids, per-step logits, lean calls) of one greedy decode of `_prompts()`."""
    eng = open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False, lean_decode=lean, **kw)
    if eng._lean is not None:
        eng._lean = _Counted(eng._lean)
    eng.prefill(_prompts())
    outs = eng.decode(steps, keep_logits=True)
    return [o.output_ids for o in outs], [torch.stack(o.logits) for o in outs], getattr(eng._lean, "calls", 0)


class _Counted:
    """A lean step that counts its calls."""

    def __init__(self, step):
        self.step, self.calls = step, 0

    def usable(self):
        return self.step.usable()

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", LEAN)
def test_lean_step_gives_the_models_logits_bit_for_bit(family, dtype):
    model = family_model(family, dtype=dtype)
    packed = True if dtype == torch.bfloat16 else None  # bf16: the engine's prepacked linears in both arms
    ref_ids, ref_logits, none = _decode(model, False, packed_linears=packed)
    ids, logits, calls = _decode(model, None, packed_linears=packed)  # the default takes the lean step here
    assert none == 0 and calls == 6, (none, calls)
    assert ids == ref_ids
    # the same ops in the same order (the compiled norms take torch's own mean; the rotary rounds where it rounds)
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), \
        (family, dtype, max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)))


@pytest.mark.parametrize("family", NOT_LEAN)
def test_other_families_run_transformers_forward_and_refuse_lean_true(family):
    model = family_model(family)
    eng = open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False)
    why = lean_step_refusal(model, eng.attention)
    assert eng._lean is None and why, (family, why)
    with pytest.raises(ValueError, match="lean_decode=True: .*pass lean_decode=None or False"):
        open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False, lean_decode=True)
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanDecodeStep(model, eng.attention)


def test_a_hook_or_replaced_forward_sends_the_decode_through_transformers():
    model = family_model("qwen3")
    ref_ids, ref_logits, _ = _decode(model, False)
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    try:
        ids, logits, calls = _decode(model, None)
    finally:
        handle.remove()
    assert calls == 0 and seen.count(1) == 6  # every decode step (one token per row) ran the hooked layer
    assert ids == ref_ids
    norm = model.model.layers[0].input_layernorm
    norm.forward = lambda x, _f=type(norm).forward, _n=norm: _f(_n, x) * 1.0
    try:
        _, _, calls = _decode(model, None)
    finally:
        del norm.forward
    assert calls == 0
    eng = open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False)
    norm.forward = lambda x, _f=type(norm).forward, _n=norm: _f(_n, x)
    assert eng.decode_path == "transformers"
    del norm.forward
    assert eng.decode_path == "lean"
    _, _, calls = _decode(model, None)  # nothing observing any more: the lean step again
    assert calls == 6


def test_lean_decode_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="lean_decode must be None, True or False"):
        open_engine("hf", model="tiny-qwen3", progress=False, lean_decode="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_write_equals_transformers_rotary_and_the_store_write(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from tdutils.kernels import step_kernels

    ops = step_kernels()
    if ops is None:
        pytest.skip("the compiled kernels cannot be built here (tdutils.kernels says why)")
    g = torch.Generator().manual_seed(3)
    B, Hq, H, d, S, W = 3, 6, 2, 64, 4, 9
    q, k, v = (torch.randn(B, n, d, generator=g).to(dtype) for n in (Hq, H, H))
    angle = torch.rand(B, d // 2, generator=g) * 50
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)  # [B, d]
    ks, vs = torch.zeros(S, H, W, d, dtype=dtype), torch.zeros(S, H, W, d, dtype=dtype)
    lengths = torch.tensor([4, 0, 8, 5])
    q_out = torch.empty(B, Hq, d)
    ops.rope_write_out(q, k, v, cos, sin, ks, vs, lengths, q_out)
    q_ref, k_ref = apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos[:, None], sin[:, None])  # [B, H, 1, d]
    assert torch.equal(q_out, q_ref[:, :, 0].float())  # the same roundings: bit for bit
    for b in range(B):
        assert torch.equal(ks[b, :, lengths[b]], k_ref[b, :, 0]) and torch.equal(vs[b, :, lengths[b]], v[b])
    assert int((ks != 0).any(-1).sum()) == B * H and not ks[3].any()  # one column per row, nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_compiled_rms_norm_equals_the_models_norm(dtype, kind):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from tdutils.kernels import step_kernels

    ops = step_kernels()
    if ops is None:
        pytest.skip("the compiled kernels cannot be built here (tdutils.kernels says why)")
    g = torch.Generator().manual_seed(4)
    norm = (LlamaRMSNorm if kind == "llama" else Gemma3RMSNorm)(576, eps=1e-5).to(dtype)
    norm.weight.data = (float(kind == "llama") + 0.3 * torch.randn(576, generator=g)).to(dtype)
    x = (3 * torch.randn(5, 1, 576, generator=g)).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm_out(x, norm.weight.detach(), 1e-5, int(kind != "llama"), out)
    assert torch.equal(out, norm(x))  # the module's statistics and roundings: bit for bit


def test_lean_step_with_and_without_the_compiled_kernels_agree(monkeypatch):
    from tdutils import kernels

    model = family_model("qwen3")
    ids, logits, calls = _decode(model, True)
    monkeypatch.setitem(kernels._state, "ops", None)  # a machine without a compiler: torch ops
    ids2, logits2, calls2 = _decode(model, True)
    assert calls == calls2 == 6 and ids == ids2
    # without the build, the attention runs as batched matmuls too (tdutils.attention): float summation order
    err = max(float((a - b).abs().max()) for a, b in zip(logits, logits2))
    assert err <= 1e-5, err
