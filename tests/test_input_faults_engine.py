"""Inputs that broke the embedded engine: drop functions that do not report their kept positions, numeric
settings of the wrong type, huge `max_tokens` with EOS honoured, tiny temperatures, prompts without text,
keep functions of the wrong signature, chat templates."""


import pytest
import torch

from tdutils import DropFunctionError, make_drop_fn
from tdutils.engines.hf import HFEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(tiny, **kw):
    model, tok = tiny
    kw.setdefault("progress", False)
    return HFEngine(model, tokenizer=tok, **kw)


# ---------------------------------------------------------------- F1: kept positions of any drop function

@pytest.mark.parametrize("wrap", ["timed", "lambda"])
def test_original_positions_hold_for_drop_functions_that_do_not_report_kept_rows(tiny, sample_ids, wrap):
    """knorm (window 0) drops the prompt's last token; through a wrapper that only returns `(kv, tokens)` the
    engine must still refeed the last *kept* token at its own position: the same logits as the DropFn itself."""
    fn = make_drop_fn("knorm", drop_ratio=0.5, model_config=tiny[0].config, rerotate=False)
    wrapped = fn.timed() if wrap == "timed" else (lambda tensors, tokens: fn(tensors, tokens))
    runs = []
    for drop in (fn, wrapped):
        eng = _engine(tiny, positions="original")
        eng.prefill(sample_ids)
        eng.modify(drop)
        runs.append((eng.decode(max_tokens=8, keep_logits=True), [r.refeed_pos for r in eng.requests]))
    (want, want_pos), (got, got_pos) = runs
    assert got_pos == want_pos and any(p < len(x) - 1 for p, x in zip(want_pos, sample_ids))  # last token dropped
    for a, b in zip(want, got):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(la, lb) for la, lb in zip(a.logits, b.logits))


def test_original_positions_refuse_rows_that_are_not_the_caches(tiny, sample_ids):
    eng = _engine(tiny, positions="original")
    eng.prefill(sample_ids[:2])
    before = [eng.kv(i).clone() for i in range(2)]

    def reversed_rows(tensors, tokens):
        return tensors["kv"].flip(2)[:, :, :4].clone(), list(tokens[::-1][:4])

    with pytest.raises(DropFunctionError, match="not an in-order selection of unchanged cache rows"):
        eng.modify(reversed_rows)
    assert all(torch.equal(eng.kv(i), kv) for i, kv in enumerate(before))


# ---------------------------------------------------------------- F4: numeric settings, where they enter

@pytest.mark.parametrize("name", ["kv_budget_tokens", "max_batch_size", "prefill_batch_size", "query_window"])
@pytest.mark.parametrize("bad", [float("nan"), 1.5, 4000.0, True, "4000"])
def test_integer_settings_refuse_other_types_at_construction_and_later(tiny, name, bad):
    with pytest.raises(TypeError, match=rf"{name} must be an integer >= [01]"):
        _engine(tiny, **{name: bad})
    eng = _engine(tiny, kv_budget_tokens=4096)
    with pytest.raises(TypeError, match=rf"{name} must be an integer"):
        setattr(eng, name, bad)
    assert eng.kv_budget_tokens == 4096  # a refused value changes nothing


def test_integer_settings_accept_numpy_integers(tiny, sample_ids):
    import numpy as np

    eng = _engine(tiny, kv_budget_tokens=np.int64(2000), max_batch_size=np.int32(2))
    assert type(eng.kv_budget_tokens) is int and eng.kv_budget_tokens == 2000
    eng.prefill(sample_ids)
    assert eng.decode(max_tokens=np.int64(3))[0].output_ids.__len__() == 3


@pytest.mark.parametrize("bad, error", [("3", TypeError), (None, TypeError), (2.5, TypeError), (0, ValueError),
                                        ([3, 0, 3], ValueError), ([3, 3], ValueError)])
def test_max_tokens_of_the_wrong_type_is_refused(tiny, sample_ids, bad, error):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    with pytest.raises(error, match="max_tokens"):
        eng.decode(max_tokens=bad)


def test_max_tokens_per_request_as_an_array(tiny, sample_ids):
    import numpy as np

    eng = _engine(tiny)
    eng.prefill(sample_ids)
    outs = eng.decode(max_tokens=np.array([2, 3, 4]))
    assert [len(o.output_ids) for o in outs] == [2, 3, 4]
    outs = eng.decode(max_tokens=torch.tensor([4, 3, 2]))
    assert [len(o.output_ids) for o in outs] == [4, 3, 2]


def test_a_prompt_dict_without_a_prompt_key_is_named(tiny):
    eng = _engine(tiny)
    with pytest.raises(ValueError, match=r"prompt 1 is a dict without a 'prompt' key \(keys: \['answer', 'text'\]\)"):
        eng.prefill([{"prompt": "7 2 9"}, {"text": "4 4", "answer": "1"}])


# ---------------------------------------------------------------- F5: storage for tokens that are generated

def test_eos_terminated_requests_reserve_and_store_only_what_they_generate(tiny, sample_ids):
    """max_tokens=10**9 with EOS honoured: capped at the context, granted in blocks; a request that stops
    after a few tokens holds a block, not 10**9 tokens (which died in the allocator)."""
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    free = eng.decode(max_tokens=12)
    eos = free[0].output_ids[5]
    eng.eos_token_id = eos
    with pytest.warns(UserWarning, match="max_tokens capped at the model's context"):
        outs = eng.decode(max_tokens=10**9, ignore_eos=False)
    first = free[0].output_ids.index(eos)
    assert outs[0].output_ids == free[0].output_ids[:first + 1] and outs[0].finish_reason == "stop"
    d = eng.metrics.decode
    from tdutils.engines.scheduler import KV_BLOCK_TOKENS

    longest = max(map(len, sample_ids))
    assert d.kv_storage_tokens <= d.peak_batch_size * (longest + KV_BLOCK_TOKENS)
    for o, x in zip(outs, sample_ids):  # every request stopped at EOS or at the context's end
        assert o.finish_reason == "stop" or len(x) - 1 + len(o.output_ids) == eng.config.max_position_embeddings


def test_eos_terminated_requests_do_not_block_admission_and_preemption_changes_no_token(tiny, sample_ids):
    """With EOS honoured and no EOS ever generated (an empty EOS set), 3 requests of 300 tokens under a
    budget that holds their first blocks but not all their tokens: all three start together, one is
    preempted when the others' next blocks come, and every request generates exactly what it generates
    alone."""
    alone = _engine(tiny, max_batch_size=1)
    alone.prefill(sample_ids)
    want = alone.decode(max_tokens=300)
    needs = [len(x) + 300 for x in sample_ids]
    budget = sum(needs) - 40  # the first blocks fit (sum of len + 256); the last 44 tokens of all three do not
    eng = _engine(tiny, kv_budget_tokens=budget)
    eng.eos_token_ids = frozenset()
    eng.prefill(sample_ids)
    got = eng.decode(max_tokens=300, ignore_eos=False)
    d = eng.metrics.decode
    assert d.peak_batch_size == 3 and d.preemptions >= 1 and d.kv_peak_reserved_tokens <= budget
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    # the worst-case reservation (ignore_eos=True) admits only two at once under the same budget
    eng.prefill(sample_ids)
    eng.decode(max_tokens=300, ignore_eos=True)
    assert eng.metrics.decode.peak_batch_size == 2 and eng.metrics.decode.preemptions == 0


# ---------------------------------------------------------------- F6: tiny temperatures

@pytest.mark.parametrize("t", [1e-45, 1e-30, 9e-6])
def test_temperatures_below_vllms_epsilon_decode_greedily(tiny, sample_ids, t):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    greedy = eng.decode(max_tokens=6)
    assert [o.output_ids for o in eng.decode(max_tokens=6, temperature=t, seed=3)] == [o.output_ids for o in greedy]


# ---------------------------------------------------------------- a model object's loading settings

def test_loading_settings_that_disagree_with_a_model_object_are_refused(tiny):
    model, tok = tiny  # eager attention, fp32, CPU
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa' applies when the engine loads the model; this "
                                         r"model object uses 'eager'"):
        HFEngine(model, tokenizer=tok, attn_implementation="sdpa", progress=False)
    with pytest.raises(ValueError, match=r"dtype='bfloat16' applies when the engine loads the model"):
        HFEngine(model, tokenizer=tok, dtype="bfloat16", progress=False)
    # settings that describe the model as it is are fine
    HFEngine(model, tokenizer=tok, attn_implementation="eager", dtype="float32", device="cpu", progress=False)


# ---------------------------------------------------------------- register_policy checks the keep function

def test_a_keep_function_of_the_wrong_signature_fails_at_registration():
    from dataclasses import dataclass

    from tdutils.policies import policy_names, register_policy

    @dataclass
    class P:
        pass

    def two_args(kv, q):
        return torch.arange(kv.shape[2])

    with pytest.raises(TypeError, match=r"policy 'broken_keep': keep\(kv, q\) cannot be called as keep\(kv, q, "
                                        r"drop_ratio, \*, params, facts\)"):
        register_policy("broken_keep", params=P, needs="kv", keep=two_args)
    assert "broken_keep" not in policy_names()


# ---------------------------------------------------------------- F2: chat templates where prompts reach an engine

TEMPLATE = "{% for m in messages %}<bos> {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} 7 7{% endif %}"


def test_chat_template_wraps_text_prompts_only_when_asked(tiny):
    import copy

    model, tok = tiny
    assert _engine(tiny, chat_template="auto").chat_template_applied is False  # the tiny tokenizer has none
    with pytest.raises(ValueError, match="chat_template='on' but the tokenizer has no chat template"):
        _engine(tiny, chat_template="on")
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    raw = HFEngine(model, tokenizer=tok, progress=False)  # default "none": prompts as written
    chat = HFEngine(model, tokenizer=tok, progress=False, chat_template="auto")
    assert chat.chat_template_applied and not raw.chat_template_applied
    text = "3 1 4 1 5"
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<bos> 3 1 4 1 5 7 7"
    assert chat.tokenize([text, {"prompt": text}]) == [tok(rendered, add_special_tokens=False)["input_ids"]] * 2
    assert raw.tokenize([text]) == [tok(text)["input_ids"]]
    assert chat.tokenize([[5, 6, 7]]) == [[5, 6, 7]]  # token ids are never wrapped


# ---------------------------------------------------------------- found by a new user's trial

@pytest.mark.parametrize("bad, error", [(3.0, TypeError), (None, TypeError), ("4", TypeError)])
def test_compare_checks_max_tokens_before_its_warm_up(tiny, sample_ids, bad, error):
    import tdutils

    eng = _engine(tiny)
    with pytest.raises(error, match="max_tokens must be an integer >= 1"):
        tdutils.compare(eng, sample_ids[:2], {}, max_tokens=bad, repeats=1)


@pytest.mark.parametrize("bad", ["garbage", [1, 2], None, 42, []])
def test_restore_takes_only_a_snapshot_and_keeps_the_batch_otherwise(tiny, sample_ids, bad):
    eng = _engine(tiny)
    eng.prefill(sample_ids)
    with pytest.raises(TypeError, match="restore\\(\\) takes what snapshot\\(\\) returned"):
        eng.restore(bad)
    assert [eng.tokens(i) for i in range(3)] == [list(x) for x in sample_ids]


def test_a_model_that_is_none_is_named():
    with pytest.raises(TypeError, match="model must be a model name, hub id, folder or a loaded transformers model, "
                                        "got None"):
        HFEngine(None, progress=False)
