"""Inputs that broke the embedded engine (issue 47, turn 4): weights edited after the engine packed them, a
forward the user installed on a linear, the attention backend switched after opening, bit-identical cache rows
under a plain ModifyFn, unbounded `max_tokens`, compact compression past the model's context, ties of knorm,
R-KV's `threshold=1`, a mutable `Compression`, a float64 cast after packing.

Each test runs on a tiny random family and, where the engine's default differs there (packed linears are on by
default for SmolLM2 only), on SmolLM2-135M (skipped when it cannot be loaded)."""

from __future__ import annotations

import contextlib
import warnings

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


# ---------------------------------------------------------------- 6, 11: lengths past the model's context


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _ids(n, seed=0):
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_unbounded_max_tokens_with_eos_ignored_is_capped_at_the_context():
    """`decode(max_tokens=10**9)` with ignore_eos=True (the default) and no KV budget reserved 10**9 tokens and
    died in the allocator; now every setting stops at the model's last position (64 here)."""
    eng = HFEngine(_tiny(max_position_embeddings=64), tokenizer=_tokenizer(), progress=False)
    eng.prefill(PROMPTS)
    with pytest.warns(UserWarning, match=r"max_tokens capped at the model's context \(max_position_embeddings 64\) "
                                         r"for 2 request\(s\), e.g. request 0: 51 tokens"):
        outs = eng.decode(max_tokens=10**9)
    assert [len(o.output_ids) for o in outs] == [64 - (len(x) - 1) for x in PROMPTS]
    assert eng.metrics.decode.kv_storage_tokens <= 2 * 64


def test_compact_compression_past_the_context_is_capped_and_within_it_is_not():
    """Compact compression renumbers positions, so it lifted the context cap even when budget + buffer exceeds
    the context; now only a bound within it decodes on."""
    from tdutils.compression import Compression

    eng = HFEngine(_tiny(max_position_embeddings=64), tokenizer=_tokenizer(), progress=False)
    eng.prefill(PROMPTS)
    with pytest.warns(UserWarning, match=r"max_tokens capped .* request 0: 51 tokens; .*compact compression "
                                         r"renumbers positions, but budget \+ buffer = 70"):
        outs = eng.decode(max_tokens=100, compression=Compression("knorm", budget=60, buffer=10))
    assert [len(o.output_ids) for o in outs] == [64 - (len(x) - 1) for x in PROMPTS]
    eng.prefill(PROMPTS)
    with _no_warnings():  # B + N = 24: positions stay below 24, all 100 tokens decode
        outs = eng.decode(max_tokens=100, compression=Compression("knorm", budget=16, buffer=8))
    assert [len(o.output_ids) for o in outs] == [100, 100] and all(o.compressions for o in outs)


def test_chunked_prefill_under_compact_cuts_warns_when_budget_plus_chunk_passes_the_context():
    from tdutils.compression import Compression

    eng = HFEngine(_tiny(max_position_embeddings=64), tokenizer=_tokenizer(), progress=False)
    with pytest.warns(UserWarning, match=r"prefill feeds position 69, beyond the model's max_position_embeddings 64"
                                         r": .*compact cuts renumber the cache to 0..29"):
        eng.prefill([_ids(120)], chunk=40, compression=Compression("knorm", budget=30))
    with _no_warnings():  # 20 + 30 positions at most, though the prompt is 120 tokens
        eng.prefill([_ids(120)], chunk=30, compression=Compression("knorm", budget=20))


# ---------------------------------------------------------------- 4: identical rows under a plain ModifyFn


def _keeping(rows):
    def fn(tensors, tokens):  # a plain ModifyFn: no `edit`, so the engine recovers the kept rows
        return tensors["kv"][:, :, rows].clone(), [tokens[j] for j in rows]
    return fn


def _masked_reference(model, ids, keep, steps):
    """Greedy logits of the model's own forward over the whole prompt (its own cache, sliding layers and all) with
    the positions outside `keep` masked out, decoding on from the last kept position (as the engine refeeds it)."""
    from transformers import DynamicCache

    last = int(keep[-1])
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:last]]), cache=cache, use_cache=True)
        mask = torch.zeros(1, last, dtype=torch.long)
        mask[0, [j for j in keep if j < last]] = 1
        tok, pos, out = ids[last], last, []
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
            logits = model(input_ids=torch.tensor([[tok]]), attention_mask=mask, position_ids=torch.tensor([[pos]]),
                           cache=cache, use_cache=True).logits[0, -1]
            out.append(logits)
            tok, pos = int(logits.argmax()), pos + 1
    return out


PADS = [0] * 16  # pad id 0: a zero embedding row, so every pad position has all-zero K/V rows


@pytest.mark.parametrize("family,real,keep", [
    ("mistral_sliding", 40, [0, 1, 15, *range(30, 56)]),  # the pads lie out of the window of the last kept row
    ("llama", 10, [0, 1, 15, *range(17, 26)]),  # full attention: where a pad sits does not matter
])
def test_identical_rows_kept_by_a_plain_modify_fn_equal_the_masked_reference(family, real, keep):
    model = _tiny(family, tied=False)
    ids = PADS + _ids(real, seed=3)
    eng = HFEngine(model, tokenizer=_tokenizer(), progress=False, positions="original")
    eng.prefill([ids])
    assert torch.equal(eng.kv(0)[:, :, 2], eng.kv(0)[:, :, 15])  # identical rows
    eng.modify(_keeping(keep))
    out = eng.decode(max_tokens=5, keep_logits=True)[0]
    want = _masked_reference(model, ids, keep, 5)
    assert out.output_ids == [int(x.argmax()) for x in want]
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,keep", [
    ("mistral_sliding", [0, 1, 15, *range(17, 26)]),  # row 15 is inside the window of the last kept row (25)
    ("llama", [3, 15]),  # the last kept row: decoding continues at its position
])
def test_identical_rows_whose_position_changes_the_result_are_refused(family, keep):
    """The earliest bit-identical row was taken (row 15 recorded as row 2): under a sliding window, or for the last
    kept row, the logits differed from the masked reference. Now that ambiguity is refused and the cache kept."""
    from tdutils import DropFunctionError

    ids = PADS + _ids(10, seed=3)
    eng = HFEngine(_tiny(family, tied=False), tokenizer=_tokenizer(), progress=False, positions="original")
    eng.prefill([ids])
    before = eng.kv(0).clone()
    with pytest.raises(DropFunctionError, match=r"output row \d+ \(token 0\) is bit-identical to cache rows \d+ to "
                                                r"\d+ with the same token .* ambiguous"):
        eng.modify(_keeping(keep))
    assert torch.equal(eng.kv(0), before)


# ---------------------------------------------------------------- 11: knorm ties, R-KV threshold=1, Compression


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_knorm_on_equal_key_norms_keeps_the_earliest_tokens_not_rounding_noise(dtype):
    """Qwen3's per-head k_norm with unit weights (a fresh model) gives every key the same norm: the ranking was
    rounding noise. Now every token ties and the earliest are kept; a model without QK-norm still ranks."""
    from tdutils.policies.knorm import knorm_keep, knorm_scores

    ids = _ids(60, seed=1)
    kvs = {}
    for family in ("qwen3", "llama"):
        eng = HFEngine(_tiny(family, tied=False).to(dtype), tokenizer=_tokenizer(), progress=False, query_window=0)
        eng.prefill([ids])
        kvs[family] = eng.kv(0)
    norms = knorm_scores(kvs["qwen3"], head_dim=16)
    assert not torch.all(norms == norms[0])  # equal up to rounding only
    assert knorm_keep(kvs["qwen3"], 0.5, head_dim=16).tolist() == list(range(30))
    assert knorm_keep(kvs["qwen3"], 0.5, head_dim=16, n_sink=2, window=4).tolist() == [*range(26), *range(56, 60)]
    assert knorm_keep(kvs["llama"], 0.5, head_dim=16).tolist() != list(range(30))
    from tdutils.policies.knorm import equal_norms

    assert equal_norms(norms, dtype) and not equal_norms(knorm_scores(kvs["llama"], head_dim=16), dtype)


def test_rkv_threshold_one_finds_no_duplicate_in_any_method_or_tile():
    """threshold=1 means "none"; exact duplicate keys have a computed cosine of 1 + 1 ulp in some matmul shapes, so
    some exact/tiled tile settings found hits the reference did not. Now every method and tile agrees."""
    from tdutils.policies.rkv import rkv_redundancy

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 40, 16, generator=gen)
    keys = torch.cat([base, base[:, :24], base[:, 5:30]], dim=1)  # [3, 89, 16]: most keys twice or three times
    want = rkv_redundancy(keys, method="reference", threshold=1.0)
    tiles = [("reference", {"row_tile": t}) for t in (1, 7, 64, 256)]
    tiles += [("exact", {"col_block": c, "first_block": f}) for c in (1, 8, 64, 256) for f in (1, 4, 64)]
    tiles += [("tiled", {"row_tile": t, "col_block": c, "first_block": f}) for t in (1, 9, 89) for c in (3, 32, 1024)
              for f in (1, 64)]
    for method, tile in tiles:
        got = rkv_redundancy(keys, method=method, threshold=1.0, **tile)
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5, msg=lambda m, t=(method, tile): f"{t}: {m}")


def test_compression_is_hashable_and_keeps_a_read_only_copy_of_its_params():
    import copy
    import pickle

    from tdutils.compression import Compression

    params = {"mix_lambda": 0.1}
    comp = Compression("rkv", budget=64, buffer=32, params=params)
    params["mix_lambda"] = 7.0  # the caller's dict changing afterwards does not reach the checked setting
    assert comp.params["mix_lambda"] == 0.1
    with pytest.raises(TypeError):
        comp.params["mix_lambda"] = 7.0
    same = Compression("rkv", budget=64, buffer=32, params={"mix_lambda": 0.1})
    assert {comp: 1}[same] == 1 and hash(comp) == hash(same) and comp == same
    assert comp != Compression("rkv", budget=64, buffer=32, params={"mix_lambda": 0.2})
    assert copy.deepcopy(comp) == comp == pickle.loads(pickle.dumps(comp))


@pytest.mark.real_models
def test_smollm2_cast_to_float64_after_opening_runs_unpacked():
    model, tok = _smol()
    ids = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]
    eng = HFEngine(model, tokenizer=tok, progress=False)  # packed by default
    assert eng._packed is not None
    try:
        model.double()
        eng.prefill([ids])
        got = eng.decode(max_tokens=3, keep_logits=True)  # died in oneDNN
        _, want = _decode(model, tok, [ids], packed=False, n=3)
        assert got[0].output_ids == want[0].output_ids
        assert all(torch.equal(x, y) for x, y in zip(got[0].logits, want[0].logits))
    finally:
        model.float()  # fp32 -> fp64 -> fp32 is exact
