"""RULER-style task generators (`tdutils.data`) and their scoring (`tdutils.answers.score_task`)."""

import random
import re

import pytest

from tdutils.answers import parse_task_items, score_task
from tdutils.data import RULER_TASKS, TASK_HOPS, TASK_KEY_WORDS, TASK_NEEDLES, make_task_dataset, make_task_example
from tdutils.models import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-qwen3")


def needles(context: str) -> list[tuple[str, str]]:
    """(key, value) of every needle `pass key K V .` in a context, in order (V: five digits or a name)."""
    return [(k, v.strip()) for k, v in re.findall(r"pass key (\w+) ([\w ]+?) \.", context)]


@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("length", [128, 1024, 4096])
def test_exact_length_and_known_tokens(tok, task, length):
    for ex in make_task_dataset(task, 5, length, tokenizer=tok, seed=3):
        ids = tok(ex["prompt"], add_special_tokens=False)["input_ids"]
        assert len(ids) == length == ex["context_tokens"], (task, len(ids), ex["prompt"][-200:])
        assert tok.unk_token_id not in ids, ex["prompt"]
        assert ex["prompt"] == ex["context"] + " " + ex["question"]
        # context + question tokens are the prompt's tokens (the agnostic flow prefills them separately)
        ctx = tok(ex["context"], add_special_tokens=False)["input_ids"]
        q = tok(" " + ex["question"], add_special_tokens=False)["input_ids"]
        assert ctx + q == ids
        assert ex["depths"] == sorted(ex["depths"]) and all(0 <= d <= 1 for d in ex["depths"])


def test_answers_follow_from_the_needles(tok):
    rng = random.Random(7)
    for _ in range(20):
        ex = make_task_example("niah_single", 300, tokenizer=tok, rng=rng)
        (k, v), = needles(ex["context"])
        assert ex["question"] == f"pass key {k}" and ex["values"] == [v] and ex["answer"] == v + " ."

        ex = make_task_example("niah_multikey", 300, tokenizer=tok, rng=rng)
        found = dict(needles(ex["context"]))
        assert len(found) == TASK_NEEDLES  # distinct keys
        asked = ex["question"].split()[2]
        assert ex["values"] == [found[asked]]

        ex = make_task_example("niah_multivalue", 300, tokenizer=tok, rng=rng)
        found = needles(ex["context"])
        assert len({k for k, _ in found}) == 1 and len(found) == TASK_NEEDLES
        assert ex["values"] == [v for _, v in found]  # document order
        assert ex["answer"] == " , ".join(ex["values"]) + " ."
        assert ex["question"] == f"pass key every {found[0][0]}"

        ex = make_task_example("niah_multiquery", 300, tokenizer=tok, rng=rng)
        found = dict(needles(ex["context"]))
        asked = ex["question"].split()[2:-1]
        assert sorted(asked) == sorted(found) and ex["question"].endswith("?")
        assert ex["values"] == [f"{k} {found[k]}" for k in asked]
        assert ex["answer"] == " , ".join(ex["values"]) + " ."

        ex = make_task_example("variable_tracking", 300, tokenizer=tok, rng=rng)
        chain = needles(ex["context"])
        assert len(chain) == TASK_HOPS + 1
        assert ex["question"].startswith("pass key ? ") and ex["question"].endswith(" :")
        value = ex["question"][len("pass key ? "):-len(" :")]
        # follow the chain by hand: the names bound to the value, directly or through others
        bound = {k for k, v in chain if v == value}
        for k, v in chain:
            if v in bound:
                bound.add(k)
        assert set(ex["values"]) == bound and ex["values"][0] == chain[0][0]
        assert all(k in TASK_KEY_WORDS for k, _ in chain)


def test_datasets_are_reproducible_and_distinct_per_task(tok):
    a = make_task_dataset("niah_multikey", 3, 256, tokenizer=tok, seed=1)
    assert a == make_task_dataset("niah_multikey", 3, 256, tokenizer=tok, seed=1)
    assert a != make_task_dataset("niah_multikey", 3, 256, tokenizer=tok, seed=2)
    b = make_task_dataset("niah_single", 3, 256, tokenizer=tok, seed=1)
    assert [x["values"] for x in a] != [x["values"] for x in b]


def test_bad_input(tok):
    with pytest.raises(ValueError, match="unknown task 'niah'.*niah_single"):
        make_task_dataset("niah", 2, 256, tokenizer=tok, seed=0)
    with pytest.raises(ValueError, match="too short for a niah_multiquery prompt"):
        make_task_example("niah_multiquery", 20, tokenizer=tok, rng=random.Random(0))
    with pytest.raises(ValueError, match="n must be >= 1"):
        make_task_dataset("niah_single", 0, 256, tokenizer=tok, seed=0)
    with pytest.raises(ValueError, match="at least one gold"):
        score_task("niah_single", [], "1 2 3 4 5 .")
    with pytest.raises(ValueError, match="unknown task 'passkey'; score_task scores the RULER-style tasks"):
        score_task("passkey", ["1 2 3 4 5"], "1 2 3 4 5 .")  # would score (False, 0.0) silently


@pytest.mark.parametrize("task,values,response,expected", [
    ("niah_single", ["1 2 3 4 5"], "1 2 3 4 5 .", (True, 1.0)),
    ("niah_single", ["1 2 3 4 5"], " 1  2 3 4 5 . 9 9 , 8", (True, 1.0)),  # after the first "." is ignored
    ("niah_single", ["1 2 3 4 5"], "1 2 3 4 6 .", (False, 0.0)),
    ("niah_single", ["1 2 3 4 5"], "1 2 3 4 5 , 1 2 3 4 5 .", (False, 1.0)),  # an extra item is not exact
    ("niah_single", ["1 2 3 4 5"], None, (False, 0.0)),
    ("niah_multivalue", ["1 1 1 1 1", "2 2 2 2 2", "3 3 3 3 3", "4 4 4 4 4"],
     "4 4 4 4 4 , 2 2 2 2 2 , 1 1 1 1 1 , 3 3 3 3 3 .", (True, 1.0)),  # order is not scored
    ("niah_multivalue", ["1 1 1 1 1", "2 2 2 2 2", "3 3 3 3 3", "4 4 4 4 4"],
     "1 1 1 1 1 , 2 2 2 2 2 , 3 3 3 3 3 .", (False, 0.75)),
    ("niah_multiquery", ["sea 1 2 3 4 5", "inn 5 4 3 2 1"], "sea 1 2 3 4 5 , inn 5 4 3 2 2 .", (False, 0.5)),
    ("niah_multiquery", ["sea 1 2 3 4 5", "inn 5 4 3 2 1"], "inn 5 4 3 2 1 , sea 1 2 3 4 5 .", (True, 1.0)),
    ("variable_tracking", ["town", "sea", "inn"], "town sea inn .", (True, 1.0)),
    ("variable_tracking", ["town", "sea", "inn"], "inn town .", (False, 2 / 3)),
])
def test_score_task_known_answers(task, values, response, expected):
    assert score_task(task, values, response) == pytest.approx(expected)


def test_parse_task_items():
    assert parse_task_items("niah_multivalue", "1 2 , 3 4 . 5") == ["1 2", "3 4"]
    assert parse_task_items("variable_tracking", "a b c . d") == ["a", "b", "c"]
    assert parse_task_items("niah_single", " . ") is None
