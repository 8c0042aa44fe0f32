"""The hf engine and every policy on every decoder family (tiny random models from transformers' config
classes, `tests/families.py`): the model's own computation is the reference throughout.

Per family: greedy decoding at drop ratio 0 equals `model.generate`; `positions="original"` after a seeded
random drop equals the model's forward over its full cache with the dropped positions masked out (decode
logits within 1e-5 absolute and relative in fp32; prompts of mixed lengths, longer than the sliding windows, in
one batch under a KV budget that forces admission waves); `check_query` within 1e-5 (the scores use the model's own scale,
soft-cap, sinks and window); compact re-rotation puts layer-0 keys exactly where the model's rotary module
puts them; snapkv, rkv and random run at drop ratio 0.5.
"""

import functools

import pytest
import torch

from tdutils import CacheKind, DropFunctionError, make_drop_fn
from tdutils.engines import open_engine
from tdutils.selection import keep_count

from families import FAMILIES, WINDOW, family_config, family_model

LENS = (40, 25, 12, 33)  # mixed lengths, most longer than the sliding window (16)
BUDGET = 60  # KV tokens: one or two requests at a time -> several admission waves
pytestmark = pytest.mark.filterwarnings("ignore:.*RoPE scaling factor.*")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread is fastest (on a shared 2-core machine two threads spin-wait on each other,
    ~30x slower here); the previous setting is restored for the modules after this one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _model(family):
    return family_model(family)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from tdutils.models import load_tokenizer

    return load_tokenizer("tiny-qwen3")


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 200, (n,), generator=g).tolist() for n in LENS]


def _engine(family, **kw):
    kw.setdefault("kv_budget_tokens", BUDGET)
    return open_engine("hf", model=_model(family), tokenizer=_tokenizer(), progress=False, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_equals_generate_and_queries_match_the_models_attention(family):
    model = _model(family)
    eng = _engine(family)
    prompts = _prompts()
    assert eng.prefill(prompts) == list(LENS)
    kvs = [eng.kv(i) for i in range(len(prompts))]
    L, D = eng.facts.num_layers, eng.facts.kv_dim
    assert [tuple(kv.shape) for kv in kvs] == [(2, L, n, D) for n in LENS]  # sliding layers keep every token
    outs = eng.decode(6)
    assert eng.metrics.decode.peak_batch_size < len(prompts)  # the budget forced admission waves
    for p, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert out.output_ids == ref, (family, out.output_ids, ref)
    errors = [eng.check_query(i, rows=8) for i in range(len(prompts))]
    assert max(errors) <= 1e-5, (family, errors)


@pytest.mark.parametrize("family", FAMILIES)
def test_original_positions_equal_the_masked_full_cache(family):
    """Edited cache + original positions == the model's own forward over the full cache (its own
    `DynamicCache(config=...)`, sliding layers and all) with the dropped positions masked out."""
    from transformers import DynamicCache

    model = _model(family)
    eng = _engine(family, positions="original")
    prompts = _prompts(1)
    eng.prefill(prompts)
    fn = make_drop_fn("random", drop_ratio=0.5, rerotate=False, seed=5, n_sink=2, window=4)
    keeps = [fn.keep_indices(eng.tensors(i), eng.tokens(i)) for i in range(len(prompts))]
    eng.modify(fn)
    outs = eng.decode(5, keep_logits=True)
    assert eng.metrics.decode.peak_batch_size < len(prompts)
    with torch.inference_mode():
        for ids, keep, out in zip(prompts, keeps, outs):
            T = len(ids)
            assert out.cached_tokens == keep.numel() == keep_count(T, 0.5)
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True)  # decode refeeds token T-1
            mask = torch.zeros(1, T - 1, dtype=torch.long)
            mask[0, keep[keep < T - 1]] = 1
            tok, pos = ids[-1], T - 1
            for step in range(5):
                mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
                logits = model(input_ids=torch.tensor([[tok]]), attention_mask=mask,
                               position_ids=torch.tensor([[pos]]), cache=cache, use_cache=True).logits[0, -1]
                # 1e-5 absolute and relative: the decode kernel's fp32 sums run in another order than the model's
                # sdpa; 20 float32 ulps of a logit of 4.5 after two layers is 1.1e-5 on an AVX-512 CPU
                torch.testing.assert_close(out.logits[step], logits, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, T=T, step=step: f"{family} T={T} step={step}: {m}")
                tok, pos = int(logits.argmax()), pos + 1
                assert tok == out.output_ids[step], (family, T, step)


@pytest.mark.parametrize("family", FAMILIES)
def test_compact_rerotation_and_every_policy_at_half(family):
    """Layer-0 keys depend on the token and its position only, so after a compacting edit they must equal
    the layer-0 keys the model computes for the kept tokens fed as a fresh prompt at positions 0..k-1 (the
    frequencies read from the model's rotary module, per layer type for Gemma 3). Then snapkv, rkv and
    random each edit and decode at drop ratio 0.5 (random is the compacting edit above)."""
    model = _model(family)
    eng = _engine(family)
    prompts = _prompts(2)
    eng.prefill(prompts)
    fn = make_drop_fn("random", drop_ratio=0.5, model_config=eng.facts, seed=3, n_sink=2, window=4)
    eng.modify(fn)
    fresh = open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False, query_window=0)
    fresh.prefill([eng.tokens(i) for i in range(len(prompts))])
    for i in range(len(prompts)):
        err = float((eng.kv(i)[0, 0] - fresh.kv(i)[0, 0]).abs().max())
        assert err <= 1e-5, (family, i, err)
    assert len(eng.decode(3)[0].output_ids) == 3

    window = 4  # <= every prompt's keep count at 0.5, so each policy keeps exactly keep_count tokens
    for policy, params in (("snapkv", {"window": window}), ("rkv", {"window": window})):
        eng.prefill(prompts)
        eng.modify(make_drop_fn(policy, drop_ratio=0.5, model_config=eng.facts, **params))
        assert [eng.kv(i).shape[2] for i in range(len(prompts))] == [keep_count(n, 0.5) for n in LENS], policy
        assert all(len(o.output_ids) == 3 for o in eng.decode(3)), policy


def test_scores_follow_the_models_attention_not_one_formula():
    """SnapKV's vote equals the one taken from the model's own attention probabilities (`output_attentions`)
    on families whose attention differs from softmax(q·k/sqrt(d)): Granite's multiplier, Gemma 2's soft-cap
    and window, gpt-oss's sinks; so does TOVA's, built by name through the policy registry."""
    from tdutils.policies import snapkv_scores
    from tdutils.policies.tova import tova_keep, tova_scores

    ids = _prompts(3)[0]
    w = 8
    for family in ("granite", "gemma2", "gpt_oss"):
        model = _model(family)
        eng = _engine(family)
        eng.prefill([ids])
        spec = eng.facts.attention  # read from the engine's live model (its learned sinks included)
        mine = snapkv_scores(eng.kv(0), eng.query(0), head_dim=eng.facts.head_dim, window=w, kernel_size=1,
                             attention=spec)
        impl = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            with torch.inference_mode():
                att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        finally:
            model.set_attn_implementation(impl)
        n, g = len(ids) - w, eng.facts.gqa_group_size
        ref = torch.stack([a[0, :, -w:, :n].sum(1).view(-1, g, n).mean(1).mean(0) for a in att]).mean(0)
        torch.testing.assert_close(mine, ref.float(), atol=1e-6, rtol=1e-5)
        plain = snapkv_scores(eng.kv(0), eng.query(0), head_dim=eng.facts.head_dim, window=w, kernel_size=1)
        assert float((plain - ref).abs().max()) > 1e-3, family  # the plain formula would be wrong here
        # TOVA (the last query's attention, mean over heads and layers) through the registry: make_drop_fn's
        # setup hands the model's attention to it, so its kept set is the one the model's attention gives.
        tova_ref = torch.stack([a[0, :, -1, :].mean(0) for a in att]).mean(0).float()
        tova = tova_scores(eng.kv(0), eng.query(0), head_dim=eng.facts.head_dim, attention=spec)
        torch.testing.assert_close(tova, tova_ref, atol=1e-6, rtol=1e-5)
        fn = make_drop_fn("tova", drop_ratio=0.5, model_config=eng.facts, rerotate=False)
        assert torch.equal(fn.keep_indices(eng.tensors(0), eng.tokens(0)),
                           tova_keep(eng.kv(0), eng.query(0), 0.5, head_dim=eng.facts.head_dim, attention=spec))


def test_spec_from_the_config_alone_matches_the_recorded_one():
    """The lmcache path sees only a config: the spec built on the meta device equals the one the model's
    attention calls record, except the values of learned sinks, which then refuse to score."""
    from tdutils.attention import AttentionSpec

    for family in FAMILIES:
        live = AttentionSpec.from_model(_model(family))
        meta = AttentionSpec.from_config(family_config(family))
        for a, b in zip(live.layers, meta.layers, strict=True):
            assert (a.scaling, a.softcap, a.sliding_window, a.has_sinks, a.num_kv_heads) == (
                b.scaling, b.softcap, b.sliding_window, b.has_sinks, b.num_kv_heads), family
    with pytest.raises(ValueError, match="learned attention sinks"):
        make_drop_fn("snapkv", model_config=family_config("gpt_oss"))
    assert [x.sliding_window for x in AttentionSpec.from_config(family_config("gemma3")).layers] == [WINDOW, None, WINDOW]


def test_head_counts_come_from_the_attention_not_the_config():
    """GPT-NeoX is multi-head whatever `num_key_value_heads` says."""
    from tdutils.models import model_facts

    config = family_config("gpt_neox")
    assert config.num_key_value_heads == 2
    for source in (config, _model("gpt_neox")):
        facts = model_facts(source)
        assert (facts.num_query_heads, facts.num_kv_heads, facts.head_dim) == (4, 4, 16)


def test_rope_frequencies_come_from_the_live_model():
    """A model cast with `.half()` rotates with rounded `inv_freq`; re-rotation must use those."""
    import copy

    from tdutils.rope import RopeSpec, model_rope

    model = copy.deepcopy(_model("llama")).half()
    live = model_rope(model)
    buf = model.model.rotary_emb.inv_freq
    assert buf.dtype == torch.float16
    torch.testing.assert_close(live.inv_freq, buf.float(), atol=0, rtol=0)
    assert not torch.equal(live.inv_freq, RopeSpec.from_config(model.config).inv_freq)
    # the keys the model caches carry the rounded frequencies: re-rotating with them lands on the model's own
    # layer-0 keys (to fp16 rounding); with the exact frequencies of a bare config copy it misses by ~10x more
    ids = [torch.randint(4, 200, (400,), generator=torch.Generator().manual_seed(0)).tolist()]
    errors = {}
    for source in ("live", "config"):
        eng = open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False, query_window=0)
        eng.prefill(ids)
        config = eng.facts if source == "live" else eng.config  # the engine's facts read the live model
        eng.modify(make_drop_fn("random", drop_ratio=0.5, model_config=config, seed=0, n_sink=2, window=4))
        fresh = open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False, query_window=0)
        fresh.prefill([eng.tokens(0)])
        errors[source] = float((eng.kv(0)[0, 0].float() - fresh.kv(0)[0, 0].float()).abs().max())
    assert errors["live"] <= 4e-3 and errors["config"] > 5 * errors["live"], errors
    gemma = model_rope(_model("gemma3"))  # one spec per layer: local and global bases
    rot = _model("gemma3").model.rotary_emb
    assert torch.equal(gemma[0].inv_freq, rot.sliding_attention_inv_freq.float())
    assert torch.equal(gemma[1].inv_freq, rot.full_attention_inv_freq.float())
    assert not torch.equal(gemma[0].inv_freq, gemma[1].inv_freq)


def test_unsupported_family_fails_at_open_with_one_line():
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError) as err:
        open_engine("hf", model=model, tokenizer=_tokenizer(), progress=False)
    msg = str(err.value)
    assert msg.startswith("deepseek_v3: ") and "\n" not in msg, msg


def test_eos_ids_are_the_tokenizer_and_generation_config_union(tiny):
    """Bundled model, generation_config.eos_token_id = [3, 4]: stops on 4 as model.generate does."""
    import copy

    from tdutils.data import load_prompts

    model, tok = tiny
    model = copy.deepcopy(model)
    model.generation_config.eos_token_id = [3, 4]
    eng = open_engine("hf", model=model, tokenizer=tok, progress=False)
    assert eng.eos_token_ids == {3, 4}
    eng.prefill(load_prompts("sample", num_requests=1))
    out = eng.decode(8, ignore_eos=False)[0]
    assert (out.output_ids, out.finish_reason) == ([11, 5, 4], "stop"), out
    ids = torch.tensor([eng.requests[0].prompt_ids])
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert ref == out.output_ids


def test_seeded_sampling_does_not_depend_on_the_batch(tiny, sample_ids):
    model, tok = tiny
    prompts = [ids[:48] for ids in sample_ids + sample_ids[:1]]  # request 3 repeats request 0's prompt
    alone = open_engine("hf", model=model, tokenizer=tok, progress=False)
    alone.prefill(prompts[:1])
    solo = alone.decode(16, temperature=1.5, seed=0)[0].output_ids
    batch = open_engine("hf", model=model, tokenizer=tok, progress=False)
    batch.prefill(prompts)
    outs = batch.decode(16, temperature=1.5, seed=0)
    assert outs[0].output_ids == solo
    assert outs[3].output_ids != solo  # same prompt, another request id: its own random stream
    other = batch.decode(16, temperature=1.5, seed=1)
    assert [o.output_ids for o in other] != [o.output_ids for o in outs]  # the seed matters


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_a_local_folder_of_an_eager_only_family_opens_and_scores(family, tmp_path):
    """`open_engine("hf", model=DIR)` on an architecture without an sdpa path (soft-capping, sinks) loads it
    with its eager attention instead of failing, and snapkv scores with the sinks read from the live model."""
    _model(family).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    eng = open_engine("hf", model=str(tmp_path), device="cpu", progress=False)
    assert eng.model.config._attn_implementation.endswith("eager")
    eng.prefill(_prompts()[:2])
    assert max(eng.check_query(i) for i in range(2)) <= 1e-5
    eng.modify(make_drop_fn("snapkv", drop_ratio=0.5, model_config=eng.facts, window=4))
    assert [eng.kv(i).shape[2] for i in range(2)] == [keep_count(n, 0.5) for n in LENS[:2]]


def test_original_positions_on_a_sliding_model_recover_a_plain_modify_fns_kept_positions():
    """A plain ModifyFn does not say which positions it kept; the engine recovers them from its output rows
    (the window masks by position), so it decodes exactly what the DropFn keeping the same rows decodes; an
    output that is not a selection of unchanged rows is refused before any cache changes."""
    T = LENS[0]
    outs = []
    for fn in (lambda tensors, tokens: (tensors[CacheKind.KV][:, :, ::2].clone(), list(tokens[::2])),
               make_drop_fn(lambda tensors, tokens: torch.arange(0, len(tokens), 2), drop_ratio=0.5, rerotate=False)):
        eng = _engine("mistral_sliding", positions="original")
        eng.prefill(_prompts()[:1])
        eng.modify(fn)
        assert eng.requests[0].positions.tolist() == list(range(0, T, 2))
        outs.append(eng.decode(max_tokens=6, keep_logits=True)[0])
    assert outs[0].output_ids == outs[1].output_ids
    assert all(torch.equal(a, b) for a, b in zip(outs[0].logits, outs[1].logits))

    eng = _engine("mistral_sliding", positions="original")
    eng.prefill(_prompts()[:1])
    before = eng.kv(0).clone()

    def halve_and_scale(tensors, tokens):
        return tensors[CacheKind.KV][:, :, ::2] * 1.5, list(tokens[::2])

    with pytest.raises(DropFunctionError, match="cannot be recovered; use positions='compact'"):
        eng.modify(halve_and_scale)
    assert torch.equal(eng.kv(0), before)
    eng.modify(halve_and_scale, positions="compact")  # compact positions need nothing more
    assert eng.kv(0).shape[2] == (T + 1) // 2


@pytest.mark.parametrize("family", ["gemma3", "mistral_sliding"])
def test_a_long_prefill_runs_the_sliding_layers_in_blocks_and_decodes_as_generate(family, monkeypatch):
    """Prompts longer than two query blocks (`attention.QUERY_BLOCK`, 64 here for the tiny models' 512 positions):
    the sliding-window layers' masked prefill runs in blocks over the keys each block sees, and greedy decoding
    still equals the model's own `generate`."""
    from tdutils import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 64)
    taken = []
    spans = attention._key_spans
    monkeypatch.setattr(attention, "_key_spans", lambda *a, **k: taken.append(spans(*a, **k)) or taken[-1])
    model = _model(family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 200, (n,), generator=g).tolist() for n in (300, 200)]
    eng = _engine(family, kv_budget_tokens=None)
    eng.prefill(prompts)
    outs = eng.decode(4)
    assert any(s is not None for s in taken), family  # some layer ran in blocks
    for p, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert out.output_ids == ref, (family, out.output_ids, ref)
