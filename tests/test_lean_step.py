"""The hf engine's lean decode step (`tdutils.engines.lean_step`): the same logits and tokens as transformers'
forward on every family it takes, and transformers' forward wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from families import family_model
from tdutils.engines import open_engine
from tdutils.engines.lean_step import LeanDecodeStep, lean_step_refusal

LEAN = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")
NOT_LEAN = ("mistral_sliding", "qwen2_sliding", "gemma3", "phi3", "granite", "olmo2", "gpt_neox")
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


@pytest.mark.parametrize("family", LEAN)
def test_lean_step_gives_the_models_logits_and_tokens(family):
    model = family_model(family)
    ref_ids, ref_logits, none = _decode(model, False)
    ids, logits, calls = _decode(model, None)  # the default takes the lean step for these families
    assert none == 0 and calls == 6, (none, calls)
    assert ids == ref_ids
    err = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert err <= 1e-5, (family, err)


def test_lean_step_in_bfloat16_keeps_the_tokens():
    model = family_model("llama", dtype=torch.bfloat16)
    ref_ids, ref_logits, _ = _decode(model, False, packed_linears=True)
    ids, logits, calls = _decode(model, True, packed_linears=True)
    assert calls == 6 and ids == ref_ids
    scale = max(float(r.abs().max()) for r in ref_logits)
    err = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert err <= 0.02 * scale, (err, scale)  # a few bf16 ulps of the largest logit (norms: fused vs 4 ops)


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
    _, _, calls = _decode(model, None)  # nothing observing any more: the lean step again
    assert calls == 6


def test_lean_decode_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="lean_decode must be None, True or False"):
        open_engine("hf", model="tiny-qwen3", progress=False, lean_decode="yes")
