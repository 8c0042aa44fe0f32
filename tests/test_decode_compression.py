"""Compression while the cache grows (`tdutils.compression`; R-KV's decode-time setting, arXiv:2505.24133).

References are the model's own computation: with `B + N` at least the final length decoding is bit for bit the
uncompressed decode; under `positions="original"` every step's logits equal the model's forward over its full
cache (its own `DynamicCache`) with the tokens cut so far masked out, on every decoder family; under `"compact"`
each cut sees exactly the KV and queries that prefill -> modify (the previous cut's kept rows) -> extend computes;
a request decodes the same tokens in a batch under a KV budget as alone; chunked prefill without a budget is the
one-shot prefill, and with one a cache never holds more than `budget + chunk` tokens.
"""

import copy
import functools

import pytest
import torch

from tdutils import CacheKind
from tdutils.compression import Compression, cache_sizes
from tdutils.edit import DropFn
from tdutils.engines.hf import HFEngine

from families import FAMILIES, family_model

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*RoPE scaling factor.*")]


def _engine(model_tok, **kw):
    model, tok = model_tok
    kw.setdefault("progress", False)
    return HFEngine(model, tokenizer=tok, **kw)


@pytest.fixture(scope="module")
def tiny64(tiny):
    """The tiny model in float64 with sdpa: two ways of summing the same attention terms agree to ~1e-15."""
    model, tok = tiny
    model = copy.deepcopy(model).double()
    model.set_attn_implementation("sdpa")
    return model, tok


def _record_cuts(monkeypatch):
    """Record the tensors and tokens every cut (a `DropFn` keeping by budget) receives (copies)."""
    seen = []
    edit = DropFn.edit

    def recording_edit(self, tensors, tokens):
        if self.budget is not None:
            seen.append(({k: v.clone() for k, v in tensors.items()}, list(tokens)))
        return edit(self, tensors, tokens)

    monkeypatch.setattr(DropFn, "edit", recording_edit)
    return seen


@pytest.mark.parametrize("positions", ["compact", "original"])
@pytest.mark.parametrize("policy", ["rkv", "knorm"])
def test_a_budget_that_holds_the_final_length_changes_nothing(tiny, sample_ids, positions, policy):
    eng = _engine(tiny, positions=positions)
    eng.prefill(sample_ids)
    saved = eng.snapshot()
    base = eng.decode(12, keep_logits=True)
    eng.restore(saved)
    longest = max(map(len, sample_ids)) + 12
    comp = eng.decode(12, keep_logits=True, compression=Compression(policy, budget=longest - 8, buffer=8))
    for a, b in zip(base, comp):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        assert b.compressions == []
    assert eng.metrics.decode.compressions == 0


def _masked_reference(model, seq, T, events, steps):
    """Logits of decode steps 1..steps from the model's own cache over `seq` (the prompt, then the generated
    tokens), each step seeing the entries kept by the cuts before it; `events` as `RequestOutput.compressions`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([seq[:T - 1]]), cache=cache, use_cache=True)  # decode refeeds token T-1
    mask = torch.ones(1, T - 1, dtype=torch.long)
    cuts = {e["step"]: e["kept"] for e in events}
    out = []
    for step in range(1, steps + 1):
        i = T - 2 + step  # the sequence index fed at this step, at its own position
        mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
        out.append(model(input_ids=torch.tensor([[seq[i]]]), attention_mask=mask, position_ids=torch.tensor([[i]]),
                         cache=cache, use_cache=True).logits[0, -1])
        if step in cuts:
            mask = torch.zeros_like(mask)
            mask[0, cuts[step]] = 1
    return out


def test_original_positions_equal_the_masked_full_cache_after_every_cut(tiny64, sample_ids):
    model, _ = tiny64
    eng = _engine(tiny64, positions="original")
    ids = [x[:60] for x in sample_ids]
    eng.prefill(ids)
    steps = 40
    outs = eng.decode(steps, keep_logits=True, compression=Compression("rkv", budget=24, buffer=8, window=4))
    with torch.inference_mode():
        for x, out in zip(ids, outs):
            assert len(out.compressions) >= 4  # the prompt's cut at step 1, then one per 8 tokens
            assert all(e["after"] == 24 and len(e["kept"]) == 24 for e in out.compressions)
            ref = _masked_reference(model, x + out.output_ids, len(x), out.compressions, steps)
            for step, (mine, theirs) in enumerate(zip(out.logits, ref)):
                torch.testing.assert_close(mine, theirs, atol=1e-10, rtol=0, msg=f"step {step + 1}")
                assert int(theirs.argmax()) == out.output_ids[step]


@functools.cache
def _family(family):
    from tdutils.models import load_tokenizer

    return family_model(family), load_tokenizer("tiny-qwen3")


@pytest.mark.parametrize("family", FAMILIES)
def test_original_positions_equal_the_masked_full_cache_on_every_family(family):
    """Sliding-window layers included: cuts are scored in decode, and the steps after each see exactly the kept
    tokens (of the window, where the model has one) that the model's own cache with the cut tokens masked sees."""
    model, tok = _family(family)
    eng = HFEngine(model, tokenizer=tok, positions="original", progress=False, kv_budget_tokens=80)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, 200, (n,), generator=g).tolist() for n in (30, 21)]
    eng.prefill(ids)
    steps = 20
    outs = eng.decode(steps, keep_logits=True, compression=Compression("snapkv", budget=12, buffer=6, window=4))
    assert eng.metrics.decode.compressions >= 2 * 3
    with torch.inference_mode():
        for x, out in zip(ids, outs):
            ref = _masked_reference(model, x + out.output_ids, len(x), out.compressions, steps)
            for step, (mine, theirs) in enumerate(zip(out.logits, ref)):
                err = float((mine - theirs).abs().max())
                # fp32 over 20 steps (eager softmax in fp32, MoE kernels: no float64 here); a wrong kept set moves
                # these logits by 0.1-10
                assert err <= 1e-4, (family, step + 1, err)
                assert int(theirs.argmax()) == out.output_ids[step], (family, step + 1)


def test_compact_cuts_score_what_prefill_modify_extend_computes(tiny, sample_ids, monkeypatch):
    """At each cut the KV and the last w queries equal the model's: at the first, a prefill of everything
    cached so far; at the second, that prefill cut to the first cut's kept rows (re-rotated to 0..B-1) and
    extended by the tokens generated since (at positions B, B+1, ...)."""
    seen = _record_cuts(monkeypatch)
    eng = _engine(tiny)
    x = sample_ids[1][:40]
    eng.prefill([x])
    B, N, w = 32, 16, 8
    out = eng.decode(60, compression=Compression("rkv", budget=B, buffer=N, window=w))[0]
    first, second = out.compressions[:2]
    assert (first["step"], first["before"], second["step"], second["before"]) == (9, B + N, 9 + N, B + N)
    seq = x + out.output_ids
    n1 = len(x) - 1 + first["step"]  # entries cached at the first cut: seq[:n1]

    ref = _engine(tiny, query_window=w)
    ref.prefill([seq[:n1]])
    (t1, toks1), (t2, toks2) = seen[:2]
    assert toks1 == seq[:n1]
    torch.testing.assert_close(t1[CacheKind.KV], ref.kv(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(t1[CacheKind.QUERY], ref.query(0), atol=1e-5, rtol=0)

    kept = torch.tensor(first["kept"])
    ref.modify(tdutils_keep(kept, ref.config))
    n2 = len(x) - 1 + second["step"]
    ref.extend([seq[n1:n2]])
    assert toks2 == [seq[i] for i in first["kept"]] + seq[n1:n2]
    torch.testing.assert_close(t2[CacheKind.KV], ref.kv(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(t2[CacheKind.QUERY], ref.query(0)[:, -w:], atol=1e-5, rtol=0)


def tdutils_keep(kept, config):
    from tdutils import make_drop_fn

    return make_drop_fn(lambda tensors, tokens: kept, drop_ratio=0.5, model_config=config)  # 0 would copy


def test_a_batch_under_the_budget_decodes_what_each_request_decodes_alone(tiny, sample_ids):
    """Admission counts B + N + 1 per request, so under a budget of 4 such requests 4 decode at once where the
    full caches would fit 2; every cache stays within B + N, each cut keeps B, and every request's tokens and
    cuts are those it gets alone."""
    B, N, steps = 48, 16, 50
    comp = Compression("snapkv", budget=B, buffer=N, window=8)
    ids = [x[:60] for x in sample_ids] + [sample_ids[2][100:160]]
    budget = 4 * (B + N + 1) + 6  # uncompressed, each request needs 60 + 50 = 110
    eng = _engine(tiny, kv_budget_tokens=budget)
    eng.prefill(ids)
    outs = eng.decode(steps, compression=comp)
    d = eng.metrics.decode
    assert d.peak_batch_size == 4 and d.kv_peak_reserved_tokens <= budget
    assert d.kv_peak_cache_tokens == B + N
    for i, (x, out) in enumerate(zip(ids, outs)):
        assert len(out.compressions) == 3  # at 64 cached entries: steps 5, 21, 37
        assert all(e["before"] == B + N and e["after"] == B for e in out.compressions)
        assert max(cache_sizes(out)) == B + N
        alone = _engine(tiny)
        alone.prefill([x])
        single = alone.decode(steps, compression=comp)[0]
        assert out.output_ids == single.output_ids, i
        assert [e["kept"] for e in out.compressions] == [e["kept"] for e in single.compressions], i
    eng.kv_budget_tokens = B + N  # one request's bound (B + N entries + the token generated last) does not fit
    with pytest.raises(ValueError, match=r"needs 65 KV tokens at once under compression .* lower the compression"):
        eng.decode(steps, compression=comp)


def test_cache_sizes_follow_the_cuts(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill([sample_ids[1][:20]])
    out = eng.decode(30, compression=Compression("knorm", budget=16, buffer=4))[0]
    sizes = cache_sizes(out)
    # step 1 attends 19 entries + the refed token = 20 = B + N and cuts to 16; then 17, 18, 19, 20 (cut) ...
    assert sizes[:6] == [20, 17, 18, 19, 20, 17]
    assert max(sizes) == 20 == eng.metrics.decode.kv_peak_cache_tokens and min(sizes) == 17
    assert [e["step"] for e in out.compressions] == list(range(1, 31, 4))


def test_chunked_prefill_without_a_budget_is_the_one_shot_prefill(tiny, sample_ids):
    one = _engine(tiny)
    one.prefill(sample_ids)
    base = one.decode(6)
    eng = _engine(tiny, prefill_batch_size=2)
    assert eng.prefill(sample_ids, chunk=64) == list(map(len, sample_ids))
    for i, x in enumerate(sample_ids):
        assert eng.tokens(i) == x
        torch.testing.assert_close(eng.kv(i), one.kv(i), atol=1e-5, rtol=0)
    assert [o.output_ids for o in eng.decode(6)] == [o.output_ids for o in base]


@pytest.mark.parametrize("positions", ["compact", "original"])
def test_chunked_prefill_under_a_budget_stays_within_budget_plus_chunk(tiny, sample_ids, positions):
    B, C = 64, 48
    eng = _engine(tiny, positions=positions)
    lens = eng.prefill(sample_ids, chunk=C, compression=Compression("snapkv", budget=B, window=8))
    assert lens == [min(B, len(x)) for x in sample_ids]
    pm = eng.metrics.prefill
    assert pm.peak_cache_tokens == [min(len(x), B + C) for x in sample_ids]
    assert pm.tokens == sum(map(len, sample_ids)) and pm.cuts >= 1
    for i, x in enumerate(sample_ids):
        assert eng.tokens(i)[-8:] == x[-8:]  # the window of the last chunk is kept
        assert eng.requests[i].prompt_ids == x
    if positions == "original":  # kept rows keep their prompt positions: the last one is the prompt's end
        assert [int(eng.requests[i].positions[-1]) for i in range(3)] == [len(x) - 1 for x in sample_ids]
    assert all(len(o.output_ids) == 4 for o in eng.decode(4))


def test_bad_settings_fail_before_anything_runs(tiny, sample_ids):
    with pytest.raises(ValueError, match="every prompt query"):
        Compression("h2o")
    with pytest.raises(ValueError, match="buffer 4 is smaller than the 8 query rows"):
        Compression("rkv", budget=64, buffer=4, window=8)
    with pytest.raises(ValueError, match="must exceed the window"):
        Compression("snapkv", budget=8, window=8)
    with pytest.raises(ValueError, match="unknown policy"):
        Compression("nope")
    with pytest.raises(ValueError, match="unknown parameters"):
        Compression("rkv", params={"bogus": 1})
    with pytest.raises(TypeError, match="budget"):
        Compression("rkv", budget=12.5)
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    with pytest.raises(TypeError, match="Compression"):
        eng.decode(4, compression={"budget": 16})
    with pytest.raises(TypeError, match="chunk"):
        eng.prefill(sample_ids, chunk=1.5)
    assert eng.tokens(0) == sample_ids[0]  # nothing was lost


def test_a_policy_that_keeps_more_than_the_budget_is_refused(tiny):
    comp = Compression("streaming_llm", budget=16, buffer=8, window=4, params={"n_sink": 14})
    with pytest.raises(ValueError, match="kept 18 of 24 tokens .* where the budget is 16"):
        comp.drop_fn(model_config=tiny[0].config)


def test_teacher_forcing_a_models_own_greedy_output_gives_its_logits(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    saved = eng.snapshot()
    base = eng.decode(10, keep_logits=True)
    eng.restore(saved)
    forced = eng.decode(10, keep_logits=True, forced_ids=[o.output_ids for o in base])
    for a, b in zip(base, forced):
        assert a.output_ids == b.output_ids and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    eng.restore(saved)
    other = [[5] * 10 for _ in sample_ids]
    outs = eng.decode(10, keep_logits=True, forced_ids=other)
    assert [o.output_ids for o in outs] == other
    assert not torch.equal(outs[0].logits[1], base[0].logits[1])  # step 2 saw token 5, not the greedy one
    with pytest.raises(ValueError, match="needs at least 10"):
        eng.decode(10, forced_ids=[[5] * 9] * 3)


def test_kl_per_step_is_the_kl_of_the_softmaxes():
    from tdutils.compression import kl_per_step

    g = torch.Generator().manual_seed(0)
    ref, other = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    p, log_q = torch.softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    expected = (p * (p.log() - log_q)).sum(-1)
    torch.testing.assert_close(kl_per_step(ref, other), expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(kl_per_step(list(ref), list(other)), expected, atol=1e-12, rtol=0)  # [vocab] per step
    assert torch.equal(kl_per_step(ref, ref), torch.zeros(5, dtype=torch.float64))
    masked = ref.clone()
    masked[:, 3] = float("-inf")  # a token the reference rules out adds nothing (0 * log 0, not NaN)
    kl = kl_per_step(masked, other)
    assert torch.isfinite(kl).all() and (kl >= 0).all()
    with pytest.raises(ValueError, match="same"):
        kl_per_step(ref, other[:4])
    with pytest.raises(ValueError, match="steps >= 1"):
        kl_per_step([], [])


def test_greedy_agreement_counts_the_common_prefix():
    from tdutils.compression import greedy_agreement

    assert greedy_agreement([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert greedy_agreement([7, 8], [7, 8]) == 2
    assert greedy_agreement([1], [2, 3]) == 0
    assert greedy_agreement(torch.tensor([4, 5, 6]), [4, 5]) == 2


def test_fidelity_reads_the_free_running_agreement_from_the_forced_run(tiny, sample_ids):
    """The forced run's first argmax difference is where a free-running compressed greedy decode leaves the full
    cache's tokens (same tokens fed and same cuts until then); before the first cut the KL is exactly 0."""
    from tdutils.compression import fidelity, greedy_agreement, kl_per_step

    eng = _engine(tiny)
    ids = [x[:40] for x in sample_ids]
    eng.prefill(ids)
    saved = eng.snapshot()
    steps = 48
    full = eng.decode(steps, keep_logits=True)
    comp = Compression("rkv", budget=24, buffer=8, window=4)
    eng.restore(saved)
    free = eng.decode(steps, compression=comp)
    eng.restore(saved)
    forced = eng.decode(steps, keep_logits=True, compression=comp, forced_ids=[o.output_ids for o in full])
    f = fidelity(full, forced)
    assert f["agreement"] == [greedy_agreement(a.output_ids, b.output_ids) for a, b in zip(full, free)]
    assert f["first_cut"] == 1 and f["cuts"] == sum(len(o.compressions) for o in forced) > 0  # 40 > B + N: cut at once
    assert f["agreement_min"] >= 1 and f["steps"] == [steps] * 3
    for a, b in zip(full, forced):
        kl = kl_per_step(a.logits, b.logits)
        assert float(kl[0]) == 0.0  # step 1 is computed before its cut
    assert 0 < f["kl_mean"] <= f["kl_mean_after_cut"] <= f["kl_max"]
    eng.restore(saved)
    same = eng.decode(steps, keep_logits=True, compression=Compression("rkv", budget=80, buffer=8, window=4),
                      forced_ids=[o.output_ids for o in full])
    g = fidelity(full, same)  # B + N holds the final length: nothing cut, nothing differs
    assert (g["cuts"], g["first_cut"], g["identical"], g["kl_max"]) == (0, None, 1.0, 0.0)
    assert g["agreement"] == [steps] * 3
    with pytest.raises(ValueError, match="keep_logits"):
        fidelity(full, free)
    with pytest.raises(ValueError, match="same requests"):
        fidelity(full, forced[:2])


def test_forced_ids_are_integer_ids_of_the_vocabulary(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    ok = [[5] * 4] * 3
    for bad, err, match in ((["1234"] * 3, TypeError, "must be a list of token ids"),
                            ([[1.7] * 4] * 3, TypeError, r"forced_ids\[0\]\[0\] = 1.7 is not an integer"),
                            ([[True] * 4] * 3, TypeError, "is not an integer"),
                            ([[5, 5, -1, 5]] * 3, ValueError, r"forced_ids\[0\]\[2\] = -1 lies outside"),
                            ([[5, 5, 5, 10**6]] * 3, ValueError, "lies outside the vocabulary"),
                            ([None] * 3, TypeError, "must be a list of token ids"),
                            (iter(ok), TypeError, "one token-id list per request"),
                            (ok[:2], ValueError, r"one token-id list per request \(3\), got 2")):
        with pytest.raises(err, match=match):
            eng.decode(4, forced_ids=bad)
    assert [o.output_ids for o in eng.decode(4, forced_ids=ok)] == ok


def test_chunks_end_with_the_query_rows_a_cut_needs(tiny, sample_ids):
    """A last chunk shorter than the policy's query rows takes tokens from the one before (1024 = 4 * 255 + 4),
    a failed chunked prefill leaves no batch, and a chunk too short for the rows is refused up front."""
    from tdutils.engines.hf import _chunk_bounds

    assert _chunk_bounds(1024, 255, 8)[-2:] == [(765, 1016), (1016, 1024)]
    assert _chunk_bounds(1024, 256, 8) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert _chunk_bounds(100, 256, 8) == [(0, 100)]
    eng = _engine(tiny)
    x = sample_ids[2][:260]  # 255 + 5: the last chunk borrows 3 tokens
    assert eng.prefill([x], chunk=255, compression=Compression("snapkv", budget=128)) == [128]
    assert eng.metrics.prefill.peak_cache_tokens == [252]  # the first chunk, shortened by 3; then 128 + 8
    with pytest.raises(ValueError, match="chunk 12 is too short .* use chunk >= 16"):
        eng.prefill([x], chunk=12, compression=Compression("rkv", budget=32, buffer=16, window=8))
    assert eng.tokens(0) == eng.requests[0].tokens  # refused before anything ran: the last batch is intact

    def failing(kv, q, drop_ratio, *, params, facts):  # keeps exactly its share on the check, fails on real caches
        if kv.shape[2] != 48:
            raise RuntimeError("boom")
        from tdutils.selection import keep_count
        return torch.arange(keep_count(kv.shape[2], drop_ratio))

    from dataclasses import dataclass

    from tdutils.policies import register_policy, unregister_policy

    @dataclass
    class NoParams:
        pass

    register_policy("fails_later", params=NoParams, needs="kv", keep=failing, needs_model=False)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            eng.prefill([x], chunk=64, compression=Compression("fails_later", budget=32, buffer=16, window=None))
        with pytest.raises(RuntimeError, match="call prefill"):
            eng.decode(4)
    finally:
        unregister_policy("fails_later")


def test_a_policy_that_cannot_hold_the_budget_is_refused_before_anything_runs(tiny, sample_ids):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    for comp in (Compression("middle_chunk", budget=16, buffer=16, window=None),
                 Compression("streaming_llm", budget=16, buffer=16, window=8, params={"n_sink": 12})):
        with pytest.raises(ValueError, match="kept .* where the budget is 16"):
            eng.decode(8, compression=comp)
        with pytest.raises(ValueError, match="kept .* where the budget is 16"):
            eng.prefill(sample_ids, chunk=64, compression=comp)
    with pytest.raises(ValueError, match="window given twice"):
        Compression("rkv", window=8, params={"window": 4})
