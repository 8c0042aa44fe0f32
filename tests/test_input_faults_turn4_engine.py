"""Inputs that broke the embedded engine (issue 47, turn 4): weights edited after the engine packed them, a
forward the user installed on a linear, the attention backend switched after opening, bit-identical cache rows
under a plain ModifyFn, unbounded `max_tokens`, compact compression past the model's context, ties of knorm,
R-KV's `threshold=1`, a mutable `Compression`, a float64 cast after packing.

Each test runs on a tiny random family and, where the engine's default differs there (packed linears are on by
default for SmolLM2 only), on SmolLM2-135M (skipped when it cannot be loaded)."""

from __future__ import annotations

import pytest
import torch
from families import family_config

from tdutils.engines.hf import HFEngine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 42, 9, 33, 71, 12, 8, 90, 44, 21, 63, 18, 27], [7, 64, 29, 11, 50, 13, 88, 41, 6]]


def _tokenizer():
    from tdutils.models import load_tokenizer

    return load_tokenizer("tiny-qwen3")


def _tiny(name="qwen3", *, tied=True, **extra):
    """A fresh tiny random model of family `name` (weights std 0.2; lm_head tied to the embedding when `tied`)."""
    from transformers import AutoModelForCausalLM

    config = family_config(name)
    config.tie_word_embeddings, config.initializer_range = tied, 0.2
    for key, value in extra.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


_SMOL: dict = {}


def _smol():
    """SmolLM2-135M fp32 (its engine packs its linears by default); skip where it cannot be loaded."""
    if "model" not in _SMOL:
        from tdutils.models import load_model

        try:
            _SMOL["model"] = load_model("smollm2-135m", device="cpu", dtype="float32", progress=False)
        except (OSError, ImportError) as exc:
            _SMOL["model"] = exc
    got = _SMOL["model"]
    if isinstance(got, Exception):
        pytest.skip(str(got))
    return got


def _decode(model, tok, prompts, *, packed, n=6, **kw):
    eng = HFEngine(model, tokenizer=tok, progress=False, packed_linears=packed, **kw)
    eng.prefill(prompts)
    return eng, eng.decode(max_tokens=n, keep_logits=True)


def _assert_same(got, want, atol=2e-5):
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=atol, rtol=0)


# ---------------------------------------------------------------- 1: weights edited after packing


def _adamw_step(model):
    model.train()
    ids = torch.tensor([PROMPTS[0]])
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=0.05, fused=True).step()
    model.zero_grad(set_to_none=True)
    model.eval()


EDITS = {
    "data.mul_": lambda m: m.model.layers[0].mlp.down_proj.weight.data.mul_(0),
    "data.copy_": lambda m: m.model.layers[-1].self_attn.o_proj.weight.data.copy_(
        torch.randn_like(m.model.layers[-1].self_attn.o_proj.weight)),
    "tied lm_head": lambda m: m.lm_head.weight.data.mul_(-1.5),
    "fused AdamW": _adamw_step,
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_weights_edited_after_packing_are_what_decode_runs(edit):
    """Edits through `.data` and a fused optimizer step bump no `_version`: decode ran the packed copy of the old
    weights (prefill the new ones). Now each decode packs again what changed: it equals the unpacked engine."""
    tok = _tokenizer()
    model = _tiny()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    eng, before = _decode(model, tok, PROMPTS, packed=True)
    EDITS[edit](model)
    eng.prefill(PROMPTS)
    got = eng.decode(max_tokens=6, keep_logits=True)
    _, want = _decode(model, tok, PROMPTS, packed=False)
    assert any(a.output_ids != b.output_ids for a, b in zip(before, want))  # the edit changes the tokens
    _assert_same(got, want)


def test_refresh_repacks_everything():
    tok = _tokenizer()
    model = _tiny()
    eng, _ = _decode(model, tok, PROMPTS, packed=True)
    assert eng._packed.refresh() == len(eng._packed) > 0
    eng.refresh()  # the engine's spelling; a no-op without packed linears
    HFEngine(model, tokenizer=tok, progress=False, packed_linears=False).refresh()


@pytest.mark.real_models
def test_smollm2_default_packing_follows_a_data_edit():
    model, tok = _smol()
    ids = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]
    eng = HFEngine(model, tokenizer=tok, progress=False)  # the default: packed on SmolLM2
    assert eng._packed is not None and len(eng._packed) > 0
    eng.prefill([ids])
    eng.decode(max_tokens=2)
    w = model.model.layers[3].mlp.down_proj.weight
    saved = w.detach().clone()
    try:
        w.data.mul_(0)
        eng.prefill([ids])
        got = eng.decode(max_tokens=6, keep_logits=True)
        _, want = _decode(model, tok, [ids], packed=False)
        _assert_same(got, want, atol=1e-3)
    finally:
        with torch.no_grad():
            w.copy_(saved)


# ---------------------------------------------------------------- 2: a forward the user installed


def _ablate(lin):
    def ablated(x):  # the linear's output, halved: an ablation experiment
        return torch.nn.functional.linear(x, lin.weight, lin.bias) * 0.5
    lin.forward = ablated
    return ablated


def _check_user_forward(model, tok, lin, prompts, atol):
    eng, _ = _decode(model, tok, prompts, packed=None if lin is None else True)
    target = lin or model.model.layers[2].mlp.down_proj
    ablated = _ablate(target)
    try:
        eng.prefill(prompts)
        got = eng.decode(max_tokens=6, keep_logits=True)
        assert target.__dict__.get("forward") is ablated  # what the user set is still there
        _, want = _decode(model, tok, prompts, packed=False)
        _assert_same(got, want, atol=atol)
    finally:
        target.__dict__.pop("forward", None)


def test_a_forward_installed_after_opening_is_honoured_and_kept():
    model = _tiny()
    _check_user_forward(model, _tokenizer(), model.model.layers[1].mlp.up_proj, PROMPTS, 2e-5)


@pytest.mark.real_models
def test_smollm2_a_forward_installed_after_opening_is_honoured_and_kept():
    model, tok = _smol()
    _check_user_forward(model, tok, None, [tok("The capital of France is Paris. The capital of Italy is")["input_ids"]],
                        1e-3)


# ---------------------------------------------------------------- 11: a float64 cast after packing


def test_a_model_cast_to_float64_after_packing_runs_unpacked():
    tok = _tokenizer()
    model = _tiny()
    eng, _ = _decode(model, tok, PROMPTS, packed=True)
    model.double()
    eng.prefill(PROMPTS)
    got = eng.decode(max_tokens=6, keep_logits=True)  # died in oneDNN
    _, want = _decode(model, tok, PROMPTS, packed=False)
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


# ---------------------------------------------------------------- 3: the attention backend switched after opening


def _compressed_run(eng):
    """Prefill, the captured queries (None with query_window=0), and a compressed decode that cuts every request."""
    from tdutils.compression import Compression

    eng.prefill(PROMPTS)
    queries = [eng.query(i) for i in range(len(PROMPTS))]
    outs = eng.decode(max_tokens=12, keep_logits=True, compression=Compression("snapkv", budget=6, buffer=4, window=2))
    return queries, outs


@pytest.mark.parametrize("query_window", [64, 0])
def test_switching_the_attention_backend_after_opening_keeps_query_capture(query_window):
    """`set_attn_implementation("eager")` after opening removed the capturing wrapper: the next prefill died with a
    bare KeyError, and a compressed decode scored every cut with stale queries. Now capture wraps the new backend:
    the same queries, cuts and tokens as an engine opened on the eager model."""
    tok = _tokenizer()
    model = _tiny()
    assert model.config._attn_implementation == "sdpa"
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=query_window)
    _compressed_run(eng)  # capture installed and used under sdpa first
    eng.model.set_attn_implementation("eager")
    got_q, got = _compressed_run(eng)
    ref_model = _tiny()
    ref_model.set_attn_implementation("eager")
    want_q, want = _compressed_run(HFEngine(ref_model, tokenizer=tok, progress=False, query_window=query_window))
    assert all(o.compressions for o in want)  # cuts happened
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got_q, want_q))
    for a, b in zip(got, want):
        assert a.compressions == b.compressions
    _assert_same(got, want, atol=1e-6)


def test_a_backend_capture_cannot_wrap_is_refused_in_one_line():
    tok = _tokenizer()
    model = _tiny()
    eng = HFEngine(model, tokenizer=tok, progress=False)
    model.config._attn_implementation = "flash_attention_2"  # what set_attn_implementation would leave
    with pytest.raises(ValueError, match=r"^the model's attention backend is 'flash_attention_2' \(switched after the "
                                         r"engine opened\?\); query capture wraps only 'sdpa' and 'eager'"):
        eng.prefill(PROMPTS)
