"""Kept sets per request, per layer and per KV head (docs/policies.md, "Granularity")."""

import pytest
import torch

from tdutils import make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.kvcache import CacheKind, apply_keep, apply_keep_heads
from tdutils.models import model_facts
from tdutils.policies.scoring import pool_tokens, reduce_gqa, window_attention
from tdutils.rope import rerotate_keys
from tdutils.selection import keep_count

pytestmark = pytest.mark.usefixtures("one_thread")

PER_HEAD = ("snapkv", "rkv", "tova", "h2o", "knorm", "keydiff", "random", "streaming_llm")
SMALL = {"snapkv": {"window": 8}, "rkv": {"window": 8}}  # the prompts are short


def _fn(eng, name, granularity, r=0.5, **kw):
    return make_drop_fn(name, drop_ratio=r, model_config=eng.facts, granularity=granularity,
                        **{**SMALL.get(name, {}), **kw})


@pytest.mark.parametrize("name", PER_HEAD)
def test_every_granularity_keeps_the_same_count_sorted_with_the_protected_tokens(request0, name):
    eng, tensors, tokens = request0
    L, H, T = eng.facts.num_layers, eng.facts.num_kv_heads, len(tokens)
    k = _fn(eng, name, "request").keep_indices(tensors, tokens).numel()
    assert k == keep_count(T, 0.5)
    for granularity, shape in (("layer", (L, k)), ("head", (L, H, k))):
        keep = _fn(eng, name, granularity).keep_indices(tensors, tokens)
        assert tuple(keep.shape) == shape
        assert bool((keep[..., 1:] > keep[..., :-1]).all())  # sorted, no duplicates
        assert bool((keep[..., -1] == T - 1).all())  # the last token in every set (decode refeeds it)
        if name in ("snapkv", "rkv"):  # the observation window in every set
            assert bool((keep[..., -8:] == torch.arange(T - 8, T)).all())


def test_head_sets_differ_between_heads_and_layer_sets_are_their_mean(request0):
    eng, tensors, tokens = request0
    head = _fn(eng, "snapkv", "head").keep_indices(tensors, tokens)
    assert not torch.equal(head[:, 0], head[:, 1])  # the heads disagree: a real per-head selection
    # knorm by hand: each head's lowest key norms; "layer": the mean of the layer's head norms
    kv = tensors[CacheKind.KV]
    L, T, H, d = kv.shape[1], kv.shape[2], eng.facts.num_kv_heads, eng.facts.head_dim
    k = keep_count(T, 0.5)
    norms = kv[0].float().view(L, T, H, d).norm(dim=-1).permute(0, 2, 1)  # [L, H, T]
    norms[..., -1] = -1.0  # the last token is kept in every set
    by_hand = torch.sort(torch.sort(norms, dim=-1, stable=True).indices[..., :k], dim=-1).values
    assert torch.equal(_fn(eng, "knorm", "head").keep_indices(tensors, tokens), by_hand)
    layer_norms = kv[0].float().view(L, T, H, d).norm(dim=-1).mean(dim=2)  # [L, T]
    layer_norms[:, -1] = -1.0
    by_hand = torch.sort(torch.sort(layer_norms, dim=-1, stable=True).indices[:, :k], dim=-1).values
    assert torch.equal(_fn(eng, "knorm", "layer").keep_indices(tensors, tokens), by_hand)


def test_snapkv_head_sets_are_the_top_k_of_each_kv_heads_pooled_vote_by_hand(request0):
    eng, tensors, tokens = request0
    kv, q = tensors[CacheKind.KV], tensors[CacheKind.QUERY]
    L, T, H, w = kv.shape[1], kv.shape[2], eng.facts.num_kv_heads, 8
    k = keep_count(T, 0.5)
    expected = []
    for layer in range(L):
        att = window_attention(kv[0, layer], q[layer, -w:], H, eng.facts.attention.layers[layer])  # [Hq, w, T]
        vote = pool_tokens(reduce_gqa(att.sum(dim=1), H, "mean")[:, :T - w], 5, "avg")  # [H, T - w]
        rows = []
        for h in range(H):
            top = torch.sort(vote[h], descending=True, stable=True).indices[:k - w]
            rows.append(torch.sort(torch.cat([top, torch.arange(T - w, T)])).values)
        expected.append(torch.stack(rows))
    got = _fn(eng, "snapkv", "head").keep_indices(tensors, tokens)
    assert torch.equal(got, torch.stack(expected))


def test_tova_per_head_equals_snapkv_per_head_with_window_1_and_no_pooling(request0):
    eng, tensors, tokens = request0
    for granularity in ("layer", "head"):
        tova = _fn(eng, "tova", granularity).keep_indices(tensors, tokens)
        snap = make_drop_fn("snapkv", drop_ratio=0.5, model_config=eng.facts, granularity=granularity, window=1,
                            kernel_size=1).keep_indices(tensors, tokens)
        assert torch.equal(tova, snap)


def test_random_draws_per_head_and_streaming_llm_repeats_its_set(request0):
    eng, tensors, tokens = request0
    a = _fn(eng, "random", "head", seed=3).keep_indices(tensors, tokens)
    assert torch.equal(a, _fn(eng, "random", "head", seed=3).keep_indices(tensors, tokens))  # seeded
    assert not torch.equal(a[0, 0], a[0, 1]) and not torch.equal(a[0, 0], a[1, 0])  # independent draws
    s = _fn(eng, "streaming_llm", "head").keep_indices(tensors, tokens)
    one = _fn(eng, "streaming_llm", "request").keep_indices(tensors, tokens)
    assert torch.equal(s, one.expand_as(s))


def test_unsupported_granularities_are_refused_in_one_line(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="middle_chunk.*one set per request only"):
        make_drop_fn("middle_chunk", model_config=model.config, granularity="head")
    with pytest.raises(ValueError, match="granularity must be one of"):
        make_drop_fn("snapkv", model_config=model.config, granularity="token")
    with pytest.raises(ValueError, match="needs model_config"):
        make_drop_fn("random", rerotate=False, granularity="layer")
    with pytest.raises(ValueError, match="registered policies"):
        make_drop_fn(lambda tensors, tokens: torch.arange(3), model_config=model.config, granularity="head")


@pytest.mark.parametrize("rerotate", [True, False])
def test_one_set_repeated_per_head_is_bit_identical_to_the_request_path(request0, rerotate):
    eng, tensors, tokens = request0
    kv, L, H = tensors[CacheKind.KV], eng.facts.num_layers, eng.facts.num_kv_heads
    keep = _fn(eng, "snapkv", "request").keep_indices(tensors, tokens)
    a_kv, a_tok = apply_keep(kv, tokens, keep, rope_spec=eng.facts.rope, rerotate=rerotate)
    b_kv, b_tok = apply_keep_heads(kv, tokens, keep.expand(L, H, -1), rope_spec=eng.facts.rope, rerotate=rerotate)
    assert torch.equal(a_kv, b_kv) and a_tok == b_tok


def test_per_head_edit_gathers_and_rerotates_each_heads_own_rows(request0):
    eng, tensors, tokens = request0
    kv, H, d = tensors[CacheKind.KV], eng.facts.num_kv_heads, eng.facts.head_dim
    fn = _fn(eng, "snapkv", "head")
    new_kv, new_tokens, keep = fn.edit(tensors, tokens)
    L, k = kv.shape[1], keep.shape[-1]
    assert new_kv.shape == (2, L, k, kv.shape[3]) and tuple(keep.shape) == (L, H, k)
    assert new_tokens == [tokens[i] for i in keep[0, 0].tolist()]
    for layer in range(L):
        for h in range(H):
            cols = slice(h * d, (h + 1) * d)
            assert torch.equal(new_kv[1, layer, :, cols], kv[1, layer, keep[layer, h], cols])
            moved = rerotate_keys(kv[0, layer, keep[layer, h], cols], keep[layer, h], torch.arange(k), eng.facts.rope)
            assert torch.equal(new_kv[0, layer, :, cols], moved)
    layer = _fn(eng, "snapkv", "layer")
    _, _, keep_l = layer.edit(tensors, tokens)
    assert tuple(keep_l.shape) == (L, H, k) and torch.equal(keep_l[:, 0], keep_l[:, 1])


# ------------------------------------------------------------------------------------------------ hf engine
def _decode_after(tiny, ids, fn, positions="compact", model=None, max_tokens=6):
    _, tok = tiny
    eng = HFEngine(model or tiny[0], tokenizer=tok, progress=False, query_window=None, positions=positions)
    eng.prefill(ids)
    keeps = [fn.keep_indices(eng.tensors(i), eng.tokens(i)) for i in range(len(ids))]
    eng.modify(fn)
    return keeps, eng.decode(max_tokens=max_tokens, keep_logits=True)


def test_request_sets_through_the_per_head_path_decode_bit_identically(tiny, sample_ids, monkeypatch):
    """(a) One set per request, handed to the engine as [L, H, k] (the per-head gather, re-rotation and decode;
    `one_set` disabled, which would otherwise gather a repeated set once), decodes exactly as the request path."""
    model, _ = tiny
    request = make_drop_fn("snapkv", drop_ratio=0.5, model_config=model, window=8)
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads

    def as_heads(tensors, tokens):
        return request.keep_indices(tensors, tokens).expand(L, H, -1)

    per_head = make_drop_fn(as_heads, drop_ratio=0.5, model_config=model)
    _, outs_a = _decode_after(tiny, sample_ids, request)
    monkeypatch.setattr("tdutils.edit.one_set", lambda keep: keep if keep.dim() == 1 else None)
    _, outs_b = _decode_after(tiny, sample_ids, per_head)
    for a, b in zip(outs_a, outs_b):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_compact_per_head_sets_decode_from_k_rows_re_rotated_per_head(tiny, sample_ids):
    """Per-head sets at compact positions: every request decodes from its `k` kept rows, whose layer-0 keys are
    each head's kept keys moved to `0..k-1` (values gathered per head), and greedy decoding runs."""
    model, _ = tiny
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=model, window=8, granularity="head")
    eng = HFEngine(model, tokenizer=tiny[1], progress=False, query_window=8)
    eng.prefill(sample_ids)
    before = [eng.kv(i).clone() for i in range(len(sample_ids))]
    keeps = [fn.keep_indices(eng.tensors(i), eng.tokens(i)) for i in range(len(sample_ids))]
    eng.modify(fn)
    for i, keep in enumerate(keeps):
        assert torch.equal(eng.kv(i), apply_keep_heads(before[i], list(range(before[i].shape[2])), keep,
                                                       rope_spec=eng.facts.rope)[0])
    outs = eng.decode(max_tokens=3)
    assert [o.cached_tokens for o in outs] == [keep_count(len(x), 0.5) for x in sample_ids]
    assert all(len(o.output_ids) == 3 for o in outs)


def _per_layer_masks(model, keep, T, S, H, g):
    """Additive masks `[1, Hq, 1, S]` per layer (`H` KV heads of `g` query heads): query heads of KV group h see the kept keys of head h before
    `T - 1` and every key from `T - 1` on (the refed token and the generated ones)."""
    masks = []
    for layer in range(keep.shape[0]):
        seen = torch.zeros(H, S, dtype=torch.bool)
        for h in range(H):
            kept = keep[layer, h]
            seen[h, kept[kept < T - 1]] = True
        seen[:, T - 1:] = True
        add = torch.zeros(H, S, dtype=model.dtype).masked_fill_(~seen, float("-inf"))
        masks.append(add.repeat_interleave(g, dim=0)[None, :, None, :])  # [1, Hq, 1, S]
    return masks


@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_original_positions_per_head_equal_the_models_forward_masked_per_head(tiny, sample_ids, granularity):
    """(b) Per-layer / per-head sets at original positions decode as the model's own forward over the full
    prompt with, in each layer, each KV head's dropped keys masked for its query heads (hooks hand each
    attention layer its own `[1, Hq, 1, S]` mask). fp64, sdpa, as the request-level test in test_hf_engine."""
    import copy

    model = copy.deepcopy(tiny[0]).double()
    model.set_attn_implementation("sdpa")
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=model, rerotate=False, granularity=granularity,
                      window=8)
    keeps, outs = _decode_after(tiny, sample_ids[:2], fn, positions="original", model=model)
    _assert_masked_forward(model, sample_ids[:2], keeps, outs, atol=1e-10)


def _assert_masked_forward(model, prompts, keeps, outs, atol):
    """Each decode step's logits equal the model's forward over its full prompt cache with every layer's own
    per-head mask (`_per_layer_masks`, handed to each attention module by a hook), within `atol`; returns the
    largest difference seen."""
    from transformers import DynamicCache

    facts = model_facts(model)  # before the hooks (it may run the model); GPT-NeoX has no GQA whatever its config says
    H, g = facts.num_kv_heads, facts.gqa_group_size
    layers = model.base_model.layers
    current, worst = {}, 0.0
    hooks = [(getattr(layer, "self_attn", None) or layer.attention).register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: (args, {**kwargs, "attention_mask": current[i]}), with_kwargs=True)
        for i, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            for ids, keep, out in zip(prompts, keeps, outs):
                keep = keep[:, None].expand(-1, H, -1) if keep.dim() == 2 else keep
                T = len(ids)
                cache = DynamicCache(config=model.config)
                current.update({i: None for i in range(len(layers))})
                model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True)  # unmasked prefill
                tok, pos = ids[-1], T - 1
                for step in range(len(out.logits)):
                    current.update(enumerate(_per_layer_masks(model, keep, T, pos + 1, H, g)))
                    logits = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]),
                                   cache=cache, use_cache=True).logits[0, -1]
                    torch.testing.assert_close(out.logits[step], logits, atol=atol, rtol=0)
                    worst = max(worst, float((out.logits[step] - logits).abs().max()))
                    tok, pos = int(logits.argmax()), pos + 1
                    assert tok == out.output_ids[step]
    finally:
        for h in hooks:
            h.remove()
    return worst


FULL_ATTENTION = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmo2", "granite", "gpt_neox",
                  "phi")


@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_families_per_head_original_positions_equal_the_masked_forward_fp32(family, tiny):
    """The same on every tiny full-attention family in fp32 (<= 1e-5), per-head random sets (query-free; KNorm ties
    on the QK-norm families, whose fresh norms are all equal)."""
    from families import family_model

    model = family_model(family)
    fn = make_drop_fn("random", drop_ratio=0.5, model_config=model, rerotate=False, granularity="head", n_sink=2,
                      window=2, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 200, (n,), generator=g).tolist() for n in (40, 57)]
    keeps, outs = _decode_after(tiny, prompts, fn, positions="original", model=model, max_tokens=4)
    assert not torch.equal(keeps[0][:, 0], keeps[0][:, 1])
    _assert_masked_forward(model, prompts, keeps, outs, atol=1e-5)


def test_sliding_window_models_refuse_per_head_sets_at_original_positions_in_one_line(tiny):
    from families import family_model

    model = family_model("gemma3")
    eng = HFEngine(model, tokenizer=tiny[1], progress=False, positions="original")
    eng.prefill([list(range(4, 60))])
    with pytest.raises(ValueError, match="sliding-window layers.*use positions='compact'"):
        eng.modify(make_drop_fn("knorm", model_config=model, granularity="head", rerotate=False))


def _assert_own_forward_over_edited_cache(model, eng, outs, atol):
    """Compact per-head sets: each decode step's logits equal the model's own forward (its own masks and sliding-window
    cache layers, `DynamicCache(config=...)`) over the edited cache minus its last row, the last row's token fed again
    at position `k - 1`; returns the largest difference seen."""
    from transformers import DynamicCache

    worst = 0.0
    with torch.inference_mode():
        for i, out in enumerate(outs):
            kv = eng.kv(i)  # [2, L, k, D]
            k, H, d = kv.shape[2], eng.facts.num_kv_heads, eng.facts.head_dim
            cache = DynamicCache(config=model.config)
            for layer in range(kv.shape[1]):
                rows = kv[:, layer, :-1].view(2, k - 1, H, d).transpose(1, 2)[:, None]  # [2, 1, H, k - 1, d]
                cache.update(rows[0], rows[1], layer)
            tok, pos = eng.tokens(i)[-1], k - 1
            for step in range(len(out.logits)):
                logits = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]), cache=cache,
                               use_cache=True).logits[0, -1]
                torch.testing.assert_close(out.logits[step], logits, atol=atol, rtol=0)
                worst = max(worst, float((out.logits[step] - logits).abs().max()))
                tok, pos = int(logits.argmax()), pos + 1
                assert tok == out.output_ids[step]
    return worst


@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_sliding_window_models_decode_compact_per_head_sets_as_their_own_forward(tiny, granularity):
    """Gemma 3 family (16-token windows on two of three layers), compact positions: row `i` sits at position `i` in
    every head, so windows by row position apply alike in every head; decode equals the model's own forward over
    the edited cache (fp32, <= 1e-5), with more kept rows than the window."""
    from families import WINDOW, family_model

    model = family_model("gemma3")
    prompts = [torch.randint(4, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (48, 61)]
    fn = make_drop_fn("random", drop_ratio=0.5, model_config=model, granularity=granularity, n_sink=2, window=2,
                      seed=1)
    eng = HFEngine(model, tokenizer=tiny[1], progress=False)
    eng.prefill(prompts)
    keeps = [fn.keep_indices(eng.tensors(i), eng.tokens(i)) for i in range(2)]
    eng.modify(fn)
    outs = eng.decode(max_tokens=4, keep_logits=True)
    assert min(eng.kv(i).shape[2] for i in range(2)) > WINDOW and not torch.equal(keeps[0][0], keeps[0][-1])
    _assert_own_forward_over_edited_cache(model, eng, outs, atol=1e-5)


def _real_model(name):
    from tdutils.models import load_model

    try:
        return load_model(name, device="cpu", dtype="float32", progress=False)
    except (OSError, ImportError) as exc:
        pytest.skip(str(exc))


@pytest.mark.real_models
@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_smollm2_per_head_original_positions_equal_the_masked_forward(tiny, granularity):
    """The same on SmolLM2-135M (fp32, <= 1e-4), per-layer / per-head SnapKV sets on a 300-token text prompt."""
    model, tok = _real_model("smollm2-135m")
    ids = tok("The grass is green. The sky is blue. The sun is yellow. " * 20)["input_ids"][:300]
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=model, rerotate=False, granularity=granularity,
                      window=16)
    keeps, outs = _decode_after((model, tok), [ids], fn, positions="original", model=model, max_tokens=3)
    assert not torch.equal(keeps[0][0], keeps[0][-1])
    _assert_masked_forward(model, [ids], keeps, outs, atol=1e-4)


@pytest.mark.real_models
def test_gemma3_compact_per_head_sets_decode_as_its_own_forward(tiny):
    """Gemma 3 270M (fp32, <= 1e-4; 512-token windows on five of six layers, one KV head per layer, so "head" and
    "layer" pick the same sets): per-head KNorm sets at compact positions, drop 0.25 of a 720-token text prompt
    (540 kept rows, more than the window), decode as the model's own forward over the edited cache."""
    model, tok = _real_model("gemma3-270m")
    ids = tok("The grass is green. The sky is blue. The sun is yellow. " * 60)["input_ids"][:720]
    fn = make_drop_fn("knorm", drop_ratio=0.25, model_config=model, granularity="head")
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=0, packed_linears=False)  # packing: ~10 s
    eng.prefill([ids])
    keep = fn.keep_indices(eng.tensors(0), eng.tokens(0))
    eng.modify(fn)
    outs = eng.decode(max_tokens=3, keep_logits=True)
    assert eng.kv(0).shape[2] == 540 > model.config.sliding_window and not torch.equal(keep[0], keep[-1])
    _assert_own_forward_over_edited_cache(model, eng, outs, atol=1e-4)


def test_per_head_original_edits_refuse_what_needs_one_position_per_row(tiny, sample_ids):
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, positions="original")
    eng.prefill(sample_ids[:1])
    eng.modify(make_drop_fn("knorm", drop_ratio=0.5, model_config=model, rerotate=False, granularity="head"))
    for call in (lambda: eng.extend([" more"]), lambda: eng.modify(make_drop_fn("knorm", model_config=model,
                                                                                 rerotate=False))):
        with pytest.raises(ValueError, match="one position per cache row"):
            call()
    assert len(eng.decode(max_tokens=2)[0].output_ids) == 2  # decoding it needs none


# ------------------------------------------------------------------------------------------------ command line
def test_cli_runs_a_policy_per_head_and_refuses_what_cannot(tiny, tmp_path, capsys):
    import json

    from tdutils.cli.main import main
    from tdutils.data import make_passkey_dataset

    data = tmp_path / "passkey.jsonl"
    rows = make_passkey_dataset(2, 160, tokenizer=tiny[1], seed=3)
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    common = ["--dataset", str(data), "--num-requests", "2", "--max-tokens", "2", "--no-progress", "--repeats", "1"]
    rc = main(["run", "--policy", "snapkv", "--window", "8", "--granularity", "head", *common,
               "--json", str(tmp_path / "run.json")])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "decode throughput ratio (snapkv@0.5/head / baseline)" in out.out, out.out
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["table"][1]["kv_tokens_after"] == 2 * 80, report["table"]
    rc = main(["run", "--policy", "middle_chunk", "--granularity", "layer", *common, "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "policy 'middle_chunk' keeps one set per request only" in err, err
    assert "use --granularity 'request', not 'layer'" in err, err  # the CLI's option, not the API's keyword
    rc = main(["run", "--policy", "knorm", "--granularity", "head", "--engine", "lmcache", *common,
               "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--granularity head needs --engine hf" in err, err


# ------------------------------------------------------------------------------------------------ eval cells
def test_eval_cells_take_a_granularity_per_policy_label(tiny):
    """`name/head` is a cell of its own: its kept-token count equals the request cell's (same k everywhere), its
    modify ran per head (the answers may differ), and a request-only policy's `/head` is refused before any work."""
    from tdutils.eval.runner import passkey_eval

    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, prefill_batch_size=8, query_window=64)
    table = passkey_eval(policies=("snapkv", "snapkv/head", "knorm/layer"), drop_ratios=(0.5,),
                         context_lengths=(200,), n=2, seed=5, max_tokens=4, engine=eng,
                         policy_params={"snapkv": {"window": 8}})
    assert list(table["policy"]) == ["snapkv", "snapkv/head", "knorm/layer"]
    assert table["kept_tokens"].nunique() == 1 and float(table["kept_tokens"].iloc[0]) > 0  # the same k everywhere
    with pytest.raises(ValueError, match="middle_chunk.*one set per request only"):
        passkey_eval(policies=("middle_chunk/head",), drop_ratios=(0.5,), context_lengths=(200,), n=1, engine=eng)


def test_eval_command_line_names_a_bad_granularity_label():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "tdutils", "eval", "--policies", "full", "snapkv/token", "--n", "2"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "--policies: unknown 'snapkv/token'" in p.stderr and "optionally with /layer or /head" in p.stderr, p.stderr
