"""Continuous measures as tasks: `text_fidelity` (KL, perplexity change and argmax agreement of a teacher-forced
book continuation, against the full cache and against the model's own forward) on the bundled tiny model, the
measures against hand-computed values, the bundled texts, and resuming a run from its stored rows."""

import math

import pytest
import torch

from tdutils.eval import cell_key, continuation_measures, task_eval
from tdutils.eval.task_fidelity import TEXTS, load_text, make_fidelity_dataset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread (tiny models, shared cores)


@pytest.fixture(scope="module")
def engine(tiny):
    """An engine over the tiny model whose prefill batches (2) split the 3 prompts unevenly."""
    from tdutils.engines.hf import HFEngine

    return HFEngine(tiny[0], tokenizer=tiny[1], progress=False, prefill_batch_size=2, query_window=0)


@pytest.fixture(scope="module")
def fidelity(engine):
    return task_eval(tasks=("text_fidelity",), modes=("aware", "agnostic"), policies=("full", "snapkv", "random"),
                     drop_ratios=(0.0, 0.75), context_lengths=(96,), n=3, seed=3, engine=engine, batch_size=2)


def test_measures_hand_computed():
    # step 1: p = (1/2, 1/2), q = (3/4, 1/4), token 0; step 2: p = (s, 1 - s), q = (1 - s), s = sigmoid(2), token 1
    full = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    cell = torch.tensor([[math.log(3), 0.0], [0.0, 2.0]])
    s = 1 / (1 + math.exp(-2))
    kl1 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # = 0.5 ln(4/3)
    kl2 = (s - (1 - s)) * 2  # s ln(s/(1-s)) + (1-s) ln((1-s)/s), ln(s/(1-s)) = 2
    got = continuation_measures(full, cell, [0, 1])
    assert got["kl"] == pytest.approx((kl1 + kl2) / 2, rel=1e-7)  # float32 logits
    ppl_full = math.sqrt(2 * (1 + math.exp(2)))  # exp(mean(ln 2, ln(1 + e^2)))
    ppl_cell = math.sqrt(4 / 3 * (1 + math.exp(-2)))  # exp(mean(-ln 3/4, ln(1 + e^-2)))
    assert got["ppl"] == pytest.approx(ppl_cell, rel=1e-7)  # float32 logits
    assert got["delta_ppl"] == pytest.approx(ppl_cell - ppl_full, rel=1e-7)  # float32 logits and got["delta_ppl"] < 0
    assert got["agreement"] == 0.5  # step 1: both argmax 0; step 2: 0 vs 1
    same = continuation_measures(full, full, [0, 1])
    assert (same["kl"], same["delta_ppl"], same["agreement"]) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="must both be"):
        continuation_measures(full, cell, [0])


def test_bundled_texts_and_windows(tiny):
    _, tok = tiny
    for b in TEXTS:  # whole texts of 125k-471k characters, LF line ends
        text = load_text(b)
        assert len(text) > 120_000 and "\r" not in text and text.isascii()
    data = make_fidelity_dataset(9, 96, tok, seed=3, continuation=8)
    assert [d["source"] for d in data] == [*TEXTS, *TEXTS, TEXTS[0]]  # prompt i from TEXTS[i % 4]
    assert all(len(d["prompt_ids"]) == 96 and len(d["continuation"]) == 8 for d in data)
    # the first k examples of a seed are those of any larger n; another seed draws other windows
    assert make_fidelity_dataset(2, 96, tok, seed=3, continuation=8) == data[:2]
    assert make_fidelity_dataset(1, 96, tok, seed=4, continuation=8)[0]["offset"] != data[0]["offset"]


def test_kl_is_zero_for_the_full_cache_and_ratio_zero_and_positive_when_dropping(fidelity):
    t = fidelity
    assert set(t["mode"]) == {"agnostic"}  # teacher-forced: the aware mode does not apply
    assert set(t["measure"]) == {"kl"} and t["correct"].isna().all()
    rows = {(r.policy, r.drop_ratio): r for r in t.itertuples()}
    full = rows["full", 0.0].scores
    assert full["kl"] == [0.0] * 3 and full["delta_ppl"] == [0.0] * 3 and full["agreement"] == [1.0] * 3
    for policy in ("snapkv", "random"):  # nothing dropped: the same distributions, up to float rounding
        assert max(rows[policy, 0.0].scores["kl"]) < 1e-6
    for policy in ("snapkv", "random"):
        assert min(rows[policy, 0.75].scores["kl"]) > 1e-4
        assert rows[policy, 0.75].score == pytest.approx(sum(rows[policy, 0.75].scores["kl"]) / 3)
    assert (t["max_tokens"] == 64).all()


def test_full_cache_perplexity_is_the_models_own(fidelity, tiny):
    model, tok = tiny
    data = make_fidelity_dataset(3, 96, tok, seed=3)
    full = fidelity[fidelity["policy"] == "full"].iloc[0]
    for d, ppl in zip(data, full["scores"]["ppl"]):
        ids = torch.tensor([d["prompt_ids"] + d["continuation"]])
        with torch.no_grad():
            logits = model(ids).logits[0, 95:95 + 64].double()  # position T-1+s predicts continuation[s]
        nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(d["continuation"]).unsqueeze(1)).mean()
        assert ppl == pytest.approx(math.exp(float(nll)), rel=1e-4)


def test_aware_alone_is_refused(engine):
    with pytest.raises(ValueError, match="teacher-forced and run in the agnostic mode only"):
        task_eval(tasks=("text_fidelity",), modes=("aware",), policies=("full",), drop_ratios=(0.5,),
                  context_lengths=(96,), n=1, engine=engine)


def test_resume_keeps_stored_cells_and_runs_the_rest(fidelity, engine):
    stored = [dict(r) for r in fidelity.to_dict("records")[:2]]
    stored[1]["score"] = -1.0  # a marker: a cell that is run again would lose it
    calls = []
    again = task_eval(tasks=("text_fidelity",), modes=("agnostic",), policies=("full", "snapkv", "random"),
                      drop_ratios=(0.0, 0.75), context_lengths=(96,), n=3, seed=3, engine=engine, batch_size=2,
                      done=stored, partial=calls)
    assert [cell_key(r) for r in again.to_dict("records")] == [cell_key(r) for r in fidelity.to_dict("records")]
    assert again.iloc[1]["score"] == -1.0 and len(calls) == len(fidelity) - 2
    assert list(again["scores"].iloc[2:]) == list(fidelity["scores"].iloc[2:])
    with pytest.raises(ValueError, match="keep no per-prompt scores"):
        task_eval(tasks=("text_fidelity",), modes=("agnostic",), policies=("full",), drop_ratios=(0.5,),
                  context_lengths=(96,), n=1, engine=engine, done=[{"task": "text_fidelity"}])
