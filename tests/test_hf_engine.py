"""The embedded engine: ragged batched decoding, budget admission, position conventions, safe edits."""

import pytest
import torch

from tdutils import DropFunctionError, make_drop_fn
from tdutils.engines.hf import HFEngine


def _engine(tiny, **kw):
    model, tok = tiny
    kw.setdefault("progress", False)
    return HFEngine(model, tokenizer=tok, **kw)


def _alone(tiny, ids, drop_fn=None, **kw):
    """Decode each prompt in a batch of its own."""
    eng = _engine(tiny, max_batch_size=1, prefill_batch_size=1, **{k: v for k, v in kw.items() if k == "positions"})
    eng.prefill(ids)
    if drop_fn is not None:
        eng.modify(drop_fn)
    return eng.decode(max_tokens=kw.get("max_tokens", 8), keep_logits=True)


def _assert_same(outs_a, outs_b, atol):
    for a, b in zip(outs_a, outs_b):
        assert a.output_ids == b.output_ids
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(la, lb, atol=atol, rtol=0)


def test_prefill_exposes_one_kv_per_request(tiny, sample_ids):
    eng = _engine(tiny)
    assert eng.prefill(sample_ids) == [len(x) for x in sample_ids]  # cache lengths, as on every engine
    kvs = [eng.kv(i) for i in range(len(sample_ids))]
    assert [kv.shape for kv in kvs] == [(2, 2, len(x), 64) for x in sample_ids]
    m = eng.metrics.prefill
    assert m.requests == 3 and m.tokens == sum(map(len, sample_ids)) and len(m.ttft_s) == 3
    # Batched (left-padded) prefill gives each request the KV of prefilling it alone.
    for x, kv in zip(sample_ids, kvs):
        one = _engine(tiny)
        one.prefill([x])
        alone = one.kv(0)
        torch.testing.assert_close(kv, alone, atol=1e-5, rtol=0)



def test_prefill_batches_keep_long_prompts_unpadded():
    from tdutils.engines.hf import prefill_batches

    assert prefill_batches([300, 10, 300, 12, 301], 4, pad_free=256) == [[0, 2], [4], [1, 3]]
    assert prefill_batches([300, 300, 300], 2, pad_free=256) == [[0, 1], [2]]
    assert prefill_batches([5, 7, 9], 2, pad_free=256) == [[0, 1], [2]]  # short prompts: padded batches as before
    assert prefill_batches([], 4) == []


def test_long_and_short_prompts_keep_their_order_and_caches(tiny, sample_ids):
    """Long prompts run beside prompts of their own length only; each request still gets the KV of prefilling it
    alone, in prompt order."""
    from tdutils.engines.hf import PAD_FREE_TOKENS

    g = torch.Generator().manual_seed(0)
    long_a = torch.randint(5, 200, (PAD_FREE_TOKENS + 3,), generator=g).tolist()
    long_b = torch.randint(5, 200, (PAD_FREE_TOKENS + 3,), generator=g).tolist()
    long_c = torch.randint(5, 200, (PAD_FREE_TOKENS + 8,), generator=g).tolist()
    prompts = [long_a, sample_ids[0], long_b, sample_ids[1], long_c]
    eng = _engine(tiny, prefill_batch_size=4)
    assert eng.prefill(prompts) == [len(x) for x in prompts]
    for i, x in enumerate(prompts):
        one = _engine(tiny)
        one.prefill([x])
        torch.testing.assert_close(eng.kv(i), one.kv(0), atol=1e-5, rtol=0)

@pytest.mark.parametrize("policy_kw", [None, {"positions": "compact"}, {"positions": "original"}])
def test_ragged_batched_decoding_equals_one_at_a_time(tiny, sample_ids, policy_kw):
    model, _ = tiny
    fn = None
    if policy_kw is not None:
        fn = make_drop_fn("random", drop_ratio=0.5, model_config=model.config,
                          rerotate=policy_kw["positions"] == "compact", seed=5)
    kw = policy_kw or {}
    eng = _engine(tiny, **kw)
    eng.prefill(sample_ids)
    if fn is not None:
        eng.modify(fn)
    batched = eng.decode(max_tokens=8, keep_logits=True)
    assert eng.metrics.decode.peak_batch_size == 3
    _assert_same(batched, _alone(tiny, sample_ids, fn, **kw), atol=1e-4)


def test_requests_join_while_others_run(tiny, sample_ids):
    """A request that finishes early frees budget mid-flight; a waiting request joins the running batch,
    and every request's tokens and logits are those of the unconstrained run."""
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    ref = eng.decode(max_tokens=8, keep_logits=True)
    # Needs: 183, 83, 309. Requests 0 and 1 start; 2 joins when 0 is done (83 + 309 <= 400), 1 still running.
    eng.kv_budget_tokens = 400
    out = eng.decode(max_tokens=[3, 8, 8], keep_logits=True)
    assert [len(o.output_ids) for o in out] == [3, 8, 8]
    assert eng.metrics.decode.steps == 3 + 8  # request 2 joined after step 3 and ran 8 steps beside request 1
    assert eng.metrics.decode.peak_batch_size == 2
    for a, b in zip(out, ref):
        n = len(a.output_ids)
        assert a.output_ids == b.output_ids[:n]
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits[:n]), atol=1e-4, rtol=0)


def test_eos_stops_a_request_unless_ignored(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids[:1])
    ref = eng.decode(max_tokens=8)[0].output_ids
    eng.eos_token_id = ref[2]
    out = eng.decode(max_tokens=8, ignore_eos=False)[0]
    assert out.finish_reason == "stop" and out.output_ids == ref[:ref.index(ref[2]) + 1]
    assert eng.decode(max_tokens=8)[0].output_ids == ref  # ignore_eos=True (default) runs to max_tokens
    with pytest.raises(ValueError, match="2 entries for 1 requests"):
        eng.decode(max_tokens=[4, 4])


def test_zero_drop_gives_exactly_the_baseline_tokens(tiny, sample_ids):
    model, _ = tiny
    for positions in ("compact", "original"):
        eng = _engine(tiny, positions=positions)
        eng.prefill(sample_ids)
        base = eng.decode(max_tokens=8, keep_logits=True)
        eng.prefill(sample_ids)
        eng.modify(make_drop_fn("random", drop_ratio=0.0, model_config=model.config,
                                rerotate=positions == "compact"))
        dropped = eng.decode(max_tokens=8, keep_logits=True)
        _assert_same(base, dropped, atol=0)


def test_original_positions_equal_full_cache_with_dropped_positions_masked(tiny, sample_ids):
    """Compacted cache + original positions == full cache where the dropped positions are masked out.

    In float64 with sdpa (eager attention takes its softmax in float32 whatever the model dtype, which alone
    moves these logits by ~1e-5), so the two ways of summing the same attention terms agree to ~1e-15."""
    import copy

    model, tok = tiny
    model = copy.deepcopy(model).double()
    model.set_attn_implementation("sdpa")
    fn = make_drop_fn("random", drop_ratio=0.5, rerotate=False, seed=11)
    eng = _engine((model, tok), positions="original")
    eng.prefill(sample_ids)
    keeps = [fn.keep_indices({"kv": eng.kv(i)}, eng.tokens(i)) for i in range(len(sample_ids))]
    eng.modify(fn)
    outs = eng.decode(max_tokens=6, keep_logits=True)

    from transformers import DynamicCache

    with torch.inference_mode():
        for ids, keep, out in zip(sample_ids, keeps, outs):
            T = len(ids)
            cache = DynamicCache(config=model.config)
            # full cache of the prompt minus its last token (which decode feeds again at T-1)
            model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
            mask = torch.zeros(1, T - 1, dtype=torch.long)
            mask[0, keep[keep < T - 1]] = 1
            tok, pos = ids[-1], T - 1
            for step in range(6):
                mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
                logits = model(input_ids=torch.tensor([[tok]]), attention_mask=mask, position_ids=torch.tensor([[pos]]),
                               cache=cache, use_cache=True).logits[0, -1]
                torch.testing.assert_close(out.logits[step], logits, atol=1e-10, rtol=0)
                tok, pos = int(logits.argmax()), pos + 1
                assert tok == out.output_ids[step]


def test_budget_admission_never_exceeds_budget(tiny, sample_ids):
    ids = [sample_ids[0][:100]] * 7
    eng = _engine(tiny, kv_budget_tokens=3 * (100 + 10) + 5)
    eng.prefill(ids)
    outs = eng.decode(max_tokens=10)
    d = eng.metrics.decode
    assert d.peak_batch_size == 3
    assert d.kv_peak_reserved_tokens == 330 <= d.kv_budget_tokens
    assert d.steps == 30  # batches of 3, 3, 1
    assert all(len(o.output_ids) == 10 for o in outs) and d.output_tokens == 70


def test_dropping_fits_more_requests_into_the_same_budget(tiny, sample_ids):
    model, _ = tiny
    ids = [sample_ids[2][:300]] * 8
    eng = _engine(tiny, kv_budget_tokens=4 * (300 + 8))
    eng.prefill(ids)
    eng.decode(max_tokens=8)
    assert eng.metrics.decode.peak_batch_size == 4
    eng.prefill(ids)
    eng.modify(make_drop_fn("random", drop_ratio=0.5, model_config=model.config))
    eng.decode(max_tokens=8)
    assert eng.metrics.decode.peak_batch_size == 7  # 7 * (150 + 8) <= 1232 < 8 * 158


def test_request_larger_than_budget_is_a_clear_error(tiny, sample_ids):
    eng = _engine(tiny, kv_budget_tokens=100)
    eng.prefill(sample_ids)
    with pytest.raises(ValueError, match=r"request 0 needs 188 KV tokens \(180 cached \+ 8 to generate\).*100"):
        eng.decode(max_tokens=8)


def test_failing_drop_function_leaves_every_cache_unchanged(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    kvs = [eng.kv(i).clone() for i in range(len(sample_ids))]

    def bad(tensors, tokens):
        kv = tensors["kv"] if "kv" in tensors else next(iter(tensors.values()))
        if len(tokens) == 75:
            raise RuntimeError("boom")
        return kv[:, :, :10].clone(), list(tokens[:10])

    with pytest.raises(DropFunctionError, match=r"1 of 3 requests; no cache was changed:\n  request 1: RuntimeError: boom"):
        eng.modify(bad)
    for i, kv in enumerate(kvs):
        assert torch.equal(eng.kv(i), kv) and eng.tokens(i) == sample_ids[i]

    with pytest.warns(UserWarning, match="failed on 1 requests"):
        report = eng.modify(bad, on_error="skip")
    assert report.edited == 2 and report.failures[0][0] == 1
    assert eng.kv(0).shape[2] == 10 and torch.equal(eng.kv(1), kvs[1])


def test_bad_drop_output_is_reported(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids)

    def wrong_count(tensors, tokens):
        kv = next(iter(tensors.values()))
        return kv[:, :, :5].clone(), list(tokens[:4])

    with pytest.raises(DropFunctionError, match="len\\(new_tokens\\) = 4 but new_kv holds 5"):
        eng.modify(wrong_count)


def test_positions_and_rerotation_must_agree(tiny, sample_ids):
    model, _ = tiny
    eng = _engine(tiny, positions="original")
    eng.prefill(sample_ids)
    with pytest.raises(ValueError, match="rerotate=False"):
        eng.modify(make_drop_fn("random", model_config=model.config, rerotate=True))


def test_phase_calls_in_wrong_order_and_bad_settings(tiny):
    eng = _engine(tiny)
    with pytest.raises(RuntimeError, match="prefill"):
        eng.decode(max_tokens=4)
    with pytest.raises(ValueError, match="positions"):
        _engine(tiny, positions="absolute")
    with pytest.raises(ValueError, match="max_tokens"):
        eng.prefill([[1, 2, 3]])
        eng.decode(max_tokens=0)


def test_drop_function_editing_its_input_in_place_then_failing_changes_nothing(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    kvs = [eng.kv(i).clone() for i in range(len(sample_ids))]

    def vandal(tensors, tokens):
        next(iter(tensors.values())).zero_()
        raise RuntimeError("oops")

    with pytest.raises(DropFunctionError, match="oops"):
        eng.modify(vandal)
    assert all(torch.equal(eng.kv(i), kv) for i, kv in enumerate(kvs))
    with pytest.raises(TypeError, match="wrap a single prompt"):
        eng.prefill("one prompt as a bare string")


def test_token_ids_outside_the_vocabulary_are_refused(tiny, sample_ids):
    eng = _engine(tiny)
    vocab = tiny[0].config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt 1: token id 99999 at position 2 is outside the model's vocabulary "
                                         rf"\[0, {vocab}\)"):
        eng.prefill([[5, 6, 7], [5, 6, 99999]])
    with pytest.raises(ValueError, match="no prompts: pass a non-empty list"):
        eng.prefill([])
    # a float or bool is not a token id (int() would silently make 3.5 token 3)
    with pytest.raises(TypeError, match=r"prompt 0: token ids must be integers, got 3.5 \(float\)"):
        eng.prefill([[5, 3.5]])
    with pytest.raises(TypeError, match=r"prompt 0: token ids must be integers, got True \(bool\)"):
        eng.prefill([[True, 5]])
    eng.prefill([torch.tensor([5, 6, 7])])  # integer tensors and numpy integers stay accepted
    assert eng.tokens(0) == [5, 6, 7]
    with pytest.raises(TypeError, match=r"extension 0: token ids must be integers, got 7.9"):
        eng.extend([torch.tensor([7.9])])
    eng.prefill(sample_ids[:1])
    before = eng.kv(0).clone(), list(eng.tokens(0))

    def bad_ids(tensors, tokens):
        return tensors["kv"][:, :, :4].clone(), [10**9] * 4

    with pytest.raises(DropFunctionError, match=r"new_tokens\[0\] = 1000000000 is outside the model's vocabulary"):
        eng.modify(bad_ids, positions="original")
    assert torch.equal(eng.kv(0), before[0]) and eng.tokens(0) == before[1]  # nothing changed
    assert len(eng.decode(max_tokens=2)[0].output_ids) == 2


def test_decoding_past_the_models_positions_is_capped_there(tiny, sample_ids):
    """With EOS ignored (the default) too: the request stops at the model's last position (issue 47)."""
    eng = _engine(tiny)
    eng.prefill([(sample_ids[2] * 14)[:4000]])  # the refeed sits at 3999
    max_pos = tiny[0].config.max_position_embeddings
    assert max_pos == 4096
    with pytest.warns(UserWarning, match=f"max_tokens capped at the model's context \\(max_position_embeddings "
                                         f"{max_pos}\\) for 1 request\\(s\\), e.g. request 0: {max_pos - 3999} tokens"):
        out = eng.decode(max_tokens=100)
    assert len(out[0].output_ids) == max_pos - 3999 and out[0].finish_reason == "length"


def test_text_the_tokenizer_cannot_read_warns(tiny):
    eng = _engine(tiny)
    with pytest.warns(UserWarning, match=r"\d+% of the prompt tokens are unknown to this tokenizer .* the model cannot "
                                         r"read this text"):
        eng.tokenize(["Quantum chromodynamics describes gluons and quarks."])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, True, "0.5"])
def test_a_temperature_that_is_not_a_finite_number_is_refused(tiny, sample_ids, bad):
    """NaN was accepted and silently decoded greedily; every non-finite or non-number temperature is refused."""
    from tdutils.engines.hf import HFEngine

    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False)
    eng.prefill([sample_ids[1]])
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0 \(0 = greedy\), got "):
        eng.decode(2, temperature=bad)
