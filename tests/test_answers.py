"""LongBench-v2 prompts, answer extraction, scoring, demo-dataset loading and the bundled MC sample."""

import json
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tdutils.answers import (
    ScoreReport,
    build_prompt,
    extract_answer,
    score_answers,
    score_passkey,
    wilson_interval,
)
from tdutils.data import MC_SAMPLE_PATH, filler_words, load_demo_dataset, load_mc_sample, load_prompts

ROOT = Path(__file__).resolve().parents[1]


# --- extraction ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("The correct answer is (B).", "B"),
    ("**The correct answer is (C)**", "C"),
    ("The correct answer is **(D)**", "D"),
    ("The correct answer is D", "D"),
    ("**Answer: C**", None),
    ("the correct answer is (A)", None),
    ("The correct answer is (E)", None),
    ("The correct answer is (A). Wait... The correct answer is (B).", "A"),
    # The bracketed form wins over an earlier bare one: the official code tries it first.
    ("The correct answer is B, or rather The correct answer is (C).", "C"),
    # No word boundary after the letter in the official rule.
    ("The correct answer is Done", "D"),
    ("", None),
    (None, None),
])
def test_official_extraction(text, expected):
    assert extract_answer(text) == expected
    assert extract_answer(text, mode="official") == expected


@pytest.mark.parametrize("text,expected", [
    ("**Answer: C**", "C"),
    ("the correct answer is (A)", "A"),
    ("The Correct Answer Is: [B]", "B"),
    ("The answer is: B", "B"),
    ("The correct option is D.", "D"),
    ("My choice: (A)", "A"),
    ("C", "C"),
    ("(C).", "C"),
    ("(B) In the boathouse", "B"),
    # A leading think block is skipped: the answer after it counts, not the one inside.
    ("<think>Maybe The correct answer is (A).</think>\nThe correct answer is (B).", "B"),
    # Still thinking when generation stopped: the final answer is empty, and lenient falls back to the
    # official rule on the whole text (never worse than official, issue 19).
    ("<think>The correct answer is (A), let me check", "A"),
    ("<think>Answer: A, let me check", None),
    ("The correct answer is (E)", None),
    # Official reads "D" here (no word boundary after X); lenient never does worse than official.
    ("The correct answer is Done", "D"),
    ("the correct answer is a bit unclear", None),
    ("The correct answer is (A). Wait... The correct answer is (B).", "A"),
    ("", None),
])
def test_lenient_extraction(text, expected):
    assert extract_answer(text, mode="lenient") == expected


def test_think_block_is_not_skipped_in_official_mode():
    assert extract_answer("<think>The correct answer is (A).</think> The correct answer is (B).") == "A"


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="unknown extraction mode 'strict'"):
        extract_answer("The correct answer is (A)", mode="strict")
    with pytest.raises(ValueError, match="unknown extraction mode"):
        score_answers(["A"], ["A"], mode="loose")


# --- scoring -------------------------------------------------------------------------------------------

GOLD = ["A", "B", "C", "D"]
RESPONSES = [
    "The correct answer is (A).",                                   # correct
    "The correct answer is (C).",                                   # wrong
    "",                                                             # empty: unparsed, still counted
    "The correct answer is (A). No - The correct answer is (D).",   # first statement wrong: wrong
]
DIFFICULTY = ["easy", "hard", "easy", "hard"]
LENGTH = ["short", "short", "long", "long"]


def test_score_four_records_by_hand():
    r = score_answers(GOLD, RESPONSES, difficulty=DIFFICULTY, length=LENGTH)
    assert isinstance(r, ScoreReport) and r.mode == "official"
    assert (r.correct, r.total, r.unparsed) == (1, 4, 1)
    assert r.accuracy == 0.25 and r.unparsed_rate == 0.25
    assert r.predictions == ["A", "C", None, "A"]
    assert r.is_correct == [True, False, False, False]
    assert str(r) == "1/4 correct (25.0%), 1 unparsed"
    # difficulty: easy = records 1 (right) and 3 (empty); hard = records 2 and 4 (both wrong)
    assert list(r.by_difficulty) == ["easy", "hard"]
    easy, hard = r.by_difficulty["easy"], r.by_difficulty["hard"]
    assert (easy.n, easy.correct, easy.unparsed, easy.accuracy) == (2, 1, 1, 0.5)
    assert (hard.n, hard.correct, hard.unparsed, hard.accuracy) == (2, 0, 0, 0.0)
    # length: short = records 1, 2; medium has none (reported empty); long = records 3, 4
    assert list(r.by_length) == ["short", "medium", "long"]
    short, medium, long_ = r.by_length["short"], r.by_length["medium"], r.by_length["long"]
    assert (short.n, short.correct, short.unparsed, short.accuracy) == (2, 1, 0, 0.5)
    assert (medium.n, medium.correct, medium.unparsed, medium.accuracy, medium.empty) == (0, 0, 0, None, True)
    assert medium.ci95 is None
    assert (long_.n, long_.correct, long_.unparsed, long_.accuracy) == (2, 0, 1, 0.0)
    # Wilson 95% for 1/4: centre (0.25 + z²/8)/(1 + z²/4) = 0.37248, half-width 0.32689
    lo, hi = r.ci95
    assert lo == pytest.approx(0.04559, abs=1e-4) and hi == pytest.approx(0.69937, abs=1e-4)


def test_lenient_scoring_is_a_separate_report():
    responses = ["Answer: A", "The correct answer is (B)", "", "(D)"]
    official = score_answers(GOLD, responses)
    lenient = score_answers(GOLD, responses, mode="lenient")
    assert (official.mode, official.correct, official.unparsed) == ("official", 1, 3)
    assert (lenient.mode, lenient.correct, lenient.unparsed) == ("lenient", 3, 1)
    assert str(lenient) == "3/4 correct (75.0%), 1 unparsed"


def test_wilson_interval_hand_values():
    # 2/4: centre exactly 0.5, half-width z*sqrt(1/16 + z²/64)/(1 + z²/4) = 0.34996
    lo, hi = wilson_interval(2, 4)
    assert lo == pytest.approx(0.15004, abs=1e-4) and hi == pytest.approx(0.84996, abs=1e-4)
    # 0/4: lower bound 0, upper bound z²/(n + z²) = 3.8415/7.8415
    lo, hi = wilson_interval(0, 4)
    assert lo == 0.0 and hi == pytest.approx(0.48990, abs=1e-4)
    assert wilson_interval(0, 0) is None


def test_report_tables():
    r = score_answers(GOLD, RESPONSES, difficulty=DIFFICULTY, length=LENGTH)
    d = r.to_dict()
    assert (d["mode"], d["n"], d["total"], d["correct"], d["unparsed"], d["accuracy"]) == \
        ("official", 4, 4, 1, 1, 0.25)
    assert d["by_length"]["medium"] == {"n": 0, "correct": 0, "unparsed": 0, "accuracy": None,
                                        "ci95_low": None, "ci95_high": None}
    json.dumps(d)  # JSON-ready
    df = r.to_frame()
    assert list(df["level"]) == ["all", "easy", "hard", "short", "medium", "long"]
    assert list(df["n"]) == [4, 2, 2, 2, 0, 2]
    assert list(df.columns) == ["mode", "axis", "level", "n", "correct", "unparsed", "accuracy",
                                "ci95_low", "ci95_high"]
    assert "length=medium: empty" in r.summary()


def test_scoring_edge_cases():
    with pytest.raises(ValueError, match="responses has 3 items but gold has 4"):
        score_answers(GOLD, RESPONSES[:3])
    with pytest.raises(ValueError, match="length has 2 items"):
        score_answers(GOLD, RESPONSES, length=["short", "long"])
    with pytest.raises(ValueError, match="gold answers must be one of"):
        score_answers(["E"], ["The correct answer is (A)"])
    empty = score_answers([], [])
    assert (empty.total, empty.accuracy, empty.ci95) == (0, None, None)
    assert str(empty) == "0/0 correct (n/a), 0 unparsed"
    # No labels: no buckets. Labels outside LongBench-v2's levels get their own bucket after them.
    assert score_answers(GOLD, RESPONSES).by_difficulty == {}
    r = score_answers(["A", "B"], ["The correct answer is (A)", None], difficulty=["easy", None])
    assert list(r.by_difficulty) == ["easy", "hard", "unknown"]
    assert (r.by_difficulty["unknown"].n, r.by_difficulty["unknown"].unparsed) == (1, 1)


def test_score_passkey():
    gold = ["4 8 1 9 2"] * 5
    responses = ["4 8 1 9 2", "48192 and then 7", "4 8 1 9 3 .", "4 8 1", None]
    r = score_passkey(gold, responses, length=["1k"] * 5)
    assert r.mode == "passkey"
    assert r.predictions == ["4 8 1 9 2", "4 8 1 9 2", "4 8 1 9 3", None, None]
    assert r.is_correct == [True, True, False, False, False]
    assert str(r) == "2/5 correct (40.0%), 2 unparsed"
    # Passkey buckets hold only the labels present (no LongBench levels).
    assert list(r.by_length) == ["1k"] and r.by_length["1k"].accuracy == 0.4
    # Non-digits around the digits are ignored.
    assert score_passkey(["1 2 3 4 5"], ["pass key = 1 2 3 4 5 ."]).correct == 1
    with pytest.raises(ValueError, match="has no digit"):
        score_passkey(["none"], ["1 2 3"])
    with pytest.raises(ValueError, match="responses has 1 items but gold has 2"):
        score_passkey(["1", "2"], ["1"])


# --- prompts -------------------------------------------------------------------------------------------

RAW = {"context": "  The cat sat on the mat.\n", "question": " Where did the cat sit? ", "choice_A": "On the mat",
       "choice_B": "On the roof", "choice_C": "In the box", "choice_D": "Under the bed", "answer": "A",
       "difficulty": "easy", "length": "short"}


def test_build_prompt_from_raw_row():
    assert build_prompt(RAW) == (
        "Please read the following text and answer the question below.\n\n"
        "<text>\nThe cat sat on the mat.\n</text>\n\n"
        "What is the correct answer to this question: Where did the cat sit?\n"
        "Choices:\n(A) On the mat\n(B) On the roof\n(C) In the box\n(D) Under the bed\n\n"
        'Format your response as follows: "The correct answer is (insert answer here)".'
    )


def test_build_prompt_placeholders_in_the_document_stay():
    p = build_prompt({**RAW, "context": "Literal $Q$ and $C_A$ here."})
    assert "<text>\nLiteral $Q$ and $C_A$ here.\n</text>" in p


def test_build_prompt_from_prompt_row_and_errors():
    assert build_prompt({"prompt": "already built", "answer": "B"}) == "already built"
    with pytest.raises(ValueError, match=r"lacks LongBench-v2 field\(s\) \['choice_C', 'choice_D'\]"):
        build_prompt({k: v for k, v in RAW.items() if k not in ("choice_C", "choice_D")})
    with pytest.raises(ValueError, match="needs a tokenizer"):
        build_prompt(RAW, max_prompt_tokens=10)


def test_build_prompt_cuts_the_middle_with_the_tiny_tokenizer():
    from tdutils.models import load_tokenizer

    tok = load_tokenizer("tiny-qwen3")
    words = [w for w in filler_words() if w.isalpha()][:30]   # one token each in the word-level vocabulary
    prompt = " ".join(words)
    assert len(tok.encode(prompt, add_special_tokens=False)) == 30
    cut = build_prompt({"prompt": prompt}, tokenizer=tok, max_prompt_tokens=11)
    # head 11 // 2 = 5 tokens, tail 11 - 5 = 6 tokens, as LongBench-v2's pred.py keeps them
    assert cut == " ".join(words[:5] + words[-6:])
    assert len(tok.encode(cut, add_special_tokens=False)) == 11
    # A prompt within budget comes back untouched, even with words the tokenizer does not know.
    odd = "Zebras " + prompt
    assert build_prompt({"prompt": odd}, tokenizer=tok, max_prompt_tokens=31) == odd
    # Budget 1: the single last token (no ids[-0:] slip that would keep everything).
    assert build_prompt({"prompt": prompt}, tokenizer=tok, max_prompt_tokens=1) == words[-1]
    with pytest.raises(ValueError, match="max_prompt_tokens must be >= 1"):
        build_prompt({"prompt": prompt}, tokenizer=tok, max_prompt_tokens=0)


# --- loading -------------------------------------------------------------------------------------------

ROWS = [{"prompt": "p1", "answer": "A", "difficulty": "easy", "length": "short"},
        {"prompt": "p2", "answer": "C", "difficulty": "hard", "length": "long"}]


def test_local_jsonl_round_trip(tmp_path):
    path = tmp_path / "demo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_demo_dataset(str(path)) == ROWS
    # and through load_prompts, as the engines read prompts
    assert [(p.prompt, p.answer, p.meta["length"]) for p in load_prompts(str(path))] == \
        [("p1", "A", "short"), ("p2", "C", "long")]


def test_local_json_and_parquet(tmp_path):
    import pandas as pd

    (tmp_path / "demo.json").write_text(json.dumps(ROWS))
    assert load_demo_dataset(str(tmp_path / "demo.json")) == ROWS
    pd.DataFrame(ROWS).to_parquet(tmp_path / "demo.parquet")
    assert load_demo_dataset(str(tmp_path / "demo.parquet")) == ROWS


def test_missing_column_is_named(tmp_path):
    path = tmp_path / "noanswer.jsonl"
    path.write_text(json.dumps({"prompt": "p1", "gold": "A"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['answer'\] \(1 of 1 rows\)"):
        load_demo_dataset(str(path))
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(RAW) + "\n")
    with pytest.raises(ValueError, match=r"\['prompt'\].*build_prompt"):
        load_demo_dataset(str(raw))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_demo_dataset(str(tmp_path / "absent.jsonl"))


def test_offline_hub_id_gives_one_clear_error(tmp_path):
    # The offline switches are read when huggingface_hub / datasets are imported: use a fresh interpreter,
    # and an empty cache so a previously downloaded copy cannot answer.
    code = (
        "from tdutils.data import load_demo_dataset\n"
        "for ds in ('raniayu/token-dropping-demo', 'raniayu/token-dropping-demo-short'):\n"
        "    try:\n"
        "        load_demo_dataset(ds)\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__, '|', exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                       env=env, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 2, p.stdout + p.stderr
    for line, ds in zip(lines, ("raniayu/token-dropping-demo", "raniayu/token-dropping-demo-short")):
        kind, msg = line.split(" | ", 1)
        assert kind == "ConnectionError"
        assert f"could not load hub dataset '{ds}'" in msg
        assert "pass the local file instead" in msg and "'mc-sample'" in msg


# --- the bundled multiple-choice sample ----------------------------------------------------------------

def _context(prompt: str) -> str:
    return prompt.split("<text>\n", 1)[1].split("\n</text>", 1)[0]


def test_mc_sample_schema_and_balance():
    rows = load_mc_sample()
    assert len(rows) == 20
    assert MC_SAMPLE_PATH.stat().st_size < 500_000
    cols = {"id", "prompt", "answer", "difficulty", "length", "question", "choice_A", "choice_B", "choice_C",
            "choice_D", "needle", "needle_depth", "decoy", "decoy_depth", "context_words", "context_chars",
            "template", "source"}
    assert all(set(r) == cols for r in rows)
    assert Counter(r["answer"] for r in rows) == {"A": 5, "B": 5, "C": 5, "D": 5}
    assert Counter(r["difficulty"] for r in rows) == {"easy": 10, "hard": 10}
    assert Counter(r["length"] for r in rows) == {"short": 7, "medium": 7, "long": 6}
    assert len({r["id"] for r in rows}) == 20
    for r in rows:
        context = _context(r["prompt"])
        # The prompt is the official template over the document.
        assert r["prompt"] == build_prompt({**r, "prompt": None, "context": context})
        assert (len(context.split()), len(context)) == (r["context_words"], r["context_chars"])
        lo, hi = {"short": (1000, 1300), "medium": (1800, 2100), "long": (2600, 2900)}[r["length"]]
        assert lo <= r["context_words"] <= hi
        # The planted fact is there once, at its recorded depth, and holds the gold choice's value.
        assert context.count(r["needle"]) == 1
        before = len(context[: context.index(r["needle"])].split())
        assert before / r["context_words"] == pytest.approx(r["needle_depth"], abs=1e-4)
        gold_text = r[f"choice_{r['answer']}"]
        assert gold_text.removeprefix("In the ") in r["needle"]
        choices = [r[f"choice_{c}"] for c in "ABCD"]
        assert len(set(choices)) == 4
        if r["difficulty"] == "hard":
            # The decoy states a wrong choice's value about another object.
            assert context.count(r["decoy"]) == 1 and r["decoy_depth"] is not None
            wrong = [c for c in choices if c != gold_text]
            assert sum(c.removeprefix("In the ") in r["decoy"] for c in wrong) == 1
        else:
            assert r["decoy"] is None and r["decoy_depth"] is None
        assert "public domain" in r["source"]
    # Also reachable by name through load_prompts, like the passkey sample.
    prompts = load_prompts("mc-sample", num_requests=2)
    assert prompts[0].answer == rows[0]["answer"] and prompts[0].meta["difficulty"] == rows[0]["difficulty"]
    # The gold answers score 20/20.
    report = score_answers([r["answer"] for r in rows], [f"The correct answer is ({r['answer']})." for r in rows],
                           difficulty=[r["difficulty"] for r in rows], length=[r["length"] for r in rows])
    assert str(report) == "20/20 correct (100.0%), 0 unparsed"


def test_mc_sample_is_reproducible(tmp_path):
    first = json.loads(MC_SAMPLE_PATH.read_text().splitlines()[0])
    if f"Python {platform.python_version()} " not in first["source"]:
        pytest.skip(f"the sample was written from another Python's stdlib text ({first['source']})")
    out = tmp_path / "mc.jsonl"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "make_mc_sample.py"), "--out", str(out)],
                       check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes() == MC_SAMPLE_PATH.read_bytes()


def test_score_rows_picks_passkey_or_multiple_choice_scoring():
    from tdutils.data import PromptRow
    from tdutils.eval.tasks import score_rows

    rows = [PromptRow("p", "1 2 3 4 5"), PromptRow("p", "0 0 0 0 1")]
    rep = score_rows(rows, ["1 2 3 4 5 and more", "0 0 0 0"])
    assert (rep.mode, rep.correct, rep.total, rep.unparsed) == ("passkey", 1, 2, 1)
    rows = [PromptRow("p", "B", {"difficulty": "easy", "length": "short"}), {"prompt": "p", "answer": "C"}]
    rep = score_rows(rows, ["The correct answer is (B)", "The correct answer is (A)"])
    assert (rep.mode, rep.correct, rep.total) == ("official", 1, 2)
    assert rep.by_difficulty["easy"].n == 1 and rep.by_difficulty["easy"].correct == 1
    with pytest.raises(ValueError, match="cannot tell"):
        score_rows([PromptRow("p", "B"), PromptRow("p", "12")], ["", ""])
    with pytest.raises(ValueError, match="gold 'answer'"):
        score_rows([PromptRow("p")], [""])
