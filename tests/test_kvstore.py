"""Decode storage of the hf engine (tdutils.engines.kvstore): sizing, in-place writes, masks, engine outputs."""

import pytest
import torch

from tdutils.engines.kvstore import SlotKVStore, plan_slots


def test_plan_slots_sizes_from_the_budget():
    # needs 183, 83, 309 under 400: at most two run at once (83 + 183 <= 400 < 83 + 183 + 309)
    plan = plan_slots([183, 83, 309], 400)
    assert (plan.slots, plan.width) == (2, 308)
    assert plan.admissible_tokens == 400  # 309 + 183 = 492 > 400: the budget itself bounds what runs
    assert plan.storage_tokens == 616 and plan.padding_tokens == 216
    # uniform requests: the storage is the budget, no padding beyond the tokens never fed
    plan = plan_slots([1056] * 16, 4488)
    assert (plan.slots, plan.width, plan.admissible_tokens) == (4, 1055, 4224)
    assert plan.storage_tokens == 4220
    assert plan_slots([10, 10, 10], None).slots == 3
    assert plan_slots([10, 10, 10], None, max_batch_size=2).slots == 2
    with pytest.raises(ValueError, match="needs 50 KV tokens but the budget is 40"):
        plan_slots([50], 40)
    with pytest.raises(ValueError, match="at least one request"):
        plan_slots([], 10)


def _store(**kw):
    kw = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 3, "slots": 3, "width": 6, "dtype": torch.float32,
          "device": "cpu", **kw}
    return SlotKVStore(**kw)


def test_admit_write_release_touch_only_their_own_slot():
    st = _store()
    a = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).view(2, 2, 4, 3)
    b = -torch.arange(2 * 2 * 2 * 3, dtype=torch.float32).view(2, 2, 2, 3) - 1
    assert st.admit(a, a + 1000) == 0 and st.admit(b, b - 1000) == 1
    assert st.rows == 2 and st.lengths.tolist() == [4, 2, 0]
    st.begin_step()
    new_k = torch.full((2, 2, 1, 3), 7.0)
    k, v = st.write(0, new_k, new_k + 1)
    assert k.shape == (2, 2, 5, 3)  # rows 0-1, columns up to the longest row + the new entry
    assert torch.equal(st.keys[0][0, :, :4], a[0]) and torch.equal(st.keys[0][0, :, 4], new_k[0, :, 0])
    assert torch.equal(st.keys[0][1, :, :2], b[0]) and torch.equal(st.keys[0][1, :, 2], new_k[1, :, 0])
    assert torch.equal(st.values[0][1, :, 2], new_k[1, :, 0] + 1)
    assert st.attention_mask()[:, 0, 0].tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    st.end_step()
    assert st.lengths.tolist() == [5, 3, 0]
    before = st.keys[1][1].clone()
    st.release(0)  # row 1 is not moved: slot 0 idles until a request fills it
    assert torch.equal(st.keys[1][1], before) and st.rows == 2 and st.free_slots == 2
    assert st.admit(b, b) == 0  # the lowest free slot
    with pytest.raises(ValueError, match="slot 2 is not in use"):
        st.release(2)
    with pytest.raises(ValueError, match="leaves no column to decode into"):
        st.admit(torch.zeros(2, 2, 6, 3), torch.zeros(2, 2, 6, 3))
    with pytest.raises(ValueError, match=r"must be \[L, H_kv, n, d\]"):
        st.admit(torch.zeros(2, 3, 2, 3), torch.zeros(2, 3, 2, 3))


def test_idle_rows_and_sliding_window_masks_use_positions():
    st = _store(track_positions=True)
    k = torch.zeros(2, 2, 4, 3)
    st.admit(k, k, torch.tensor([0, 3, 7, 9]))  # original positions with holes
    st.admit(k[:, :, :2], k[:, :, :2], torch.tensor([0, 1]))
    st.admit(k[:, :, :1], k[:, :, :1], torch.tensor([0]))
    st.release(1)  # an idle row between two running ones
    q = torch.tensor([10, 0, 1])
    st.begin_step(q)
    full = st.attention_mask(query_positions=q)[:, 0, 0]
    assert full.tolist() == [[True] * 5, [True, False, False, False, False], [True, True, False, False, False]]
    # window 4 by positions: key position > 10 - 4 = 6 for row 0 -> 7, 9 and the query itself (10)
    win = st.attention_mask(window=4, query_positions=q)[:, 0, 0]
    assert win[0].tolist() == [False, False, True, True, True]
    add = st.attention_mask(window=4, query_positions=q, additive_dtype=torch.float32)[0, 0, 0]
    assert add.tolist()[2:] == [0.0, 0.0, 0.0] and add[0] == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="needs tracked positions"):
        _store().attention_mask(window=4, query_positions=q)


def test_engine_decode_equals_generate_in_admission_waves(tiny, sample_ids):
    """Greedy tokens and logits of the engine (three ragged prompts, a budget that runs two at a time) equal the
    model's own `generate` on each prompt alone, to the float32 rounding of a different summation order (2e-5;
    logits reach ~20; generate computes the prompt in one pass, the engine feeds its last token again over the
    cache); the storage is sized from the budget. (Float64 does not tighten this: Qwen3's RMSNorm
    runs in float32 whatever the model dtype.)"""
    from tdutils.engines.hf import HFEngine

    model, tok = tiny
    dtype = torch.float32
    eng = HFEngine(model, tokenizer=tok, kv_budget_tokens=400, progress=False)
    eng.prefill(sample_ids)
    outs = eng.decode(max_tokens=8, keep_logits=True)
    d = eng.metrics.decode
    assert d.peak_batch_size == 2 and d.kv_storage_tokens == 2 * (301 + 8 - 1)
    elt = torch.empty((), dtype=dtype).element_size()
    assert d.kv_storage_bytes == 2 * 2 * (2 * 308) * 2 * 32 * elt  # K and V, layers, slots x width, H_kv x d
    with torch.inference_mode():
        for ids, out in zip(sample_ids, outs):
            ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            assert out.output_ids == ref.sequences[0, len(ids):].tolist()
            torch.testing.assert_close(torch.stack(out.logits), torch.cat(ref.logits), atol=2e-5, rtol=0)


def test_random_model_has_the_real_shapes_and_a_clear_name_syntax():
    from tdutils.models import parse_random_name, random_model, resolve_model

    model, tok = random_model("qwen3-0.6b", num_layers=2, device="meta")  # shapes only, no memory
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.num_hidden_layers, c.vocab_size) == (1024, 3072, 16, 8, 128, 2, 151936)
    per_layer = 1024 * (16 * 128) * 2 + 1024 * (8 * 128) * 2 + 3 * 1024 * 3072 + 2 * 128 + 2 * 1024
    assert sum(p.numel() for p in model.parameters()) == 151936 * 1024 + 2 * per_layer + 1024  # tied embeddings
    assert model.name_or_path == "random:qwen3-0.6b:2L"
    assert tok.decode([5, 151935]) == "<5> <151935>" and tok.eos_token_id == 151934
    assert parse_random_name("random:qwen3-0.6b:4L") == ("qwen3-0.6b", 4)
    assert parse_random_name("random:qwen3-8b") == ("qwen3-8b", None) and parse_random_name("Qwen/Qwen3-0.6B") is None
    with pytest.raises(ValueError, match="layer count must look like 4L"):
        parse_random_name("random:qwen3-0.6b:four")
    with pytest.raises(ValueError, match="unknown random architecture 'llama-9b'.*known: qwen3-0.6b"):
        resolve_model("random:llama-9b")


def test_release_free_heap_trims_glibc_before_each_cpu_decode(tiny, sample_ids, monkeypatch):
    """On glibc `release_free_heap` returns the heap's freed pages (True), and `HFEngine.decode` calls it once per
    call on a CPU engine, before the store is allocated; the greedy tokens do not change."""
    import platform

    from tdutils.engines import hf as hf_module
    from tdutils.engines import kvstore
    from tdutils.engines.hf import HFEngine

    assert kvstore.release_free_heap() == (platform.libc_ver()[0] == "glibc")
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False)
    eng.prefill([sample_ids[0][:40], sample_ids[1][:30]])
    before = [o.output_ids for o in eng.decode(max_tokens=6)]
    calls = []
    monkeypatch.setattr(hf_module, "release_free_heap", lambda: calls.append(len(eng.requests)) or True)
    eng.prefill([sample_ids[0][:40], sample_ids[1][:30]])
    assert [o.output_ids for o in eng.decode(max_tokens=6)] == before
    eng.decode(max_tokens=2)
    assert calls == [2, 2]
