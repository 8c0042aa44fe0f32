"""LongBench-v2 prompts, answer extraction and scoring (docs/design.md §7).

LongBench v2 (Bai et al., arXiv:2412.15204; code: github.com/THUDM/LongBench) asks four-choice questions about long
documents; `build_prompt` and `extract_answer(mode="official")` reproduce its 0-shot prompt, middle truncation and
answer parsing, so accuracy figures compare with published ones. Added: a `lenient` extraction mode (reported
separately, never mixed into `official`); `score_answers`, where every response counts in the denominator (empty
and unparsed ones count as wrong and are reported), with per-difficulty and per-length buckets and 95% Wilson
intervals; `score_passkey` (exact digits, the bundled model's task, §8); `score_task` (the word-level RULER-style tasks). Rows of a
dataset are scored by their task's scorer (`tdutils.eval.tasks.score_rows`), built from these.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .data import RULER_TASKS

# The official LongBench-v2 0-shot template (THUDM/LongBench, prompts/0shot.txt), word for word: the
# wording is what makes our accuracy comparable with published LongBench-v2 numbers.
LONGBENCH_V2_0SHOT_TEMPLATE = (
    "Please read the following text and answer the question below.\n\n"
    "<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\n"
    "Choices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)
# Placeholder -> column of a raw LongBench-v2 row.
_TEMPLATE_FIELDS = {"$DOC$": "context", "$Q$": "question", "$C_A$": "choice_A", "$C_B$": "choice_B",
                    "$C_C$": "choice_C", "$C_D$": "choice_D"}
_PLACEHOLDER_RE = re.compile("|".join(re.escape(k) for k in _TEMPLATE_FIELDS))

CHOICES = ("A", "B", "C", "D")
MODES = ("official", "lenient")

# LongBench-v2's labels; score_answers always lists these buckets so an empty one shows as empty.
DIFFICULTY_LEVELS = ("easy", "hard")
LENGTH_LEVELS = ("short", "medium", "long")

# z for a two-sided 95% interval (the 0.975 quantile of the standard normal).
_Z95 = 1.959963984540054


def build_prompt(example: Mapping, *, tokenizer=None, max_prompt_tokens: int | None = None) -> str:
    """The LongBench-v2 0-shot prompt of one example.

    Args:
        example: a row that already has a non-empty `prompt` (returned as is, or cut when over budget),
            or a raw LongBench-v2 row with `context`, `question` and `choice_A`..`choice_D` (other keys such
            as `answer`, `difficulty`, `length` are ignored). Each field is stripped of surrounding
            whitespace, as the official `pred.py` does.
        tokenizer: a Hugging Face tokenizer, used only to count and cut tokens.
        max_prompt_tokens: token budget. A prompt with more tokens (counted without special tokens, i.e.
            before any chat template) is cut in the middle: the first `max_prompt_tokens // 2` and the
            last `max_prompt_tokens - max_prompt_tokens // 2` tokens are kept and decoded together with
            `skip_special_tokens=True`, as LongBench-v2's `pred.py` does, so the instruction at the head
            and the question and choices at the tail survive. Re-tokenising the cut text gives about
            `max_prompt_tokens` tokens (a token can merge or split at the seam). A prompt within budget
            is returned unchanged, never round-tripped through the tokenizer.

    Returns:
        The prompt text, without a chat template: an engine opened with `chat_template="auto"` (the CLI's
        `--chat-template auto`, its default) wraps it as a user turn in the tokenizer's template (`tdutils.chat`).

    Raises:
        ValueError: a raw row lacks fields (all missing names are listed); `max_prompt_tokens` < 1, or
            given without a tokenizer.
    """
    if max_prompt_tokens is not None:
        if tokenizer is None:
            raise ValueError("max_prompt_tokens needs a tokenizer to count tokens; pass tokenizer=")
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")

    if example.get("prompt"):
        prompt = str(example["prompt"])
    else:
        missing = [k for k in _TEMPLATE_FIELDS.values() if example.get(k) is None]
        if missing:
            raise ValueError(f"example has no 'prompt' and lacks LongBench-v2 field(s) {missing}; "
                             f"keys present: {sorted(example)}")
        values = {ph: str(example[col]).strip() for ph, col in _TEMPLATE_FIELDS.items()}
        # One pass over the template: a document that itself contains "$Q$" or "$C_A$" is not rewritten,
        # which chained str.replace calls would do.
        prompt = _PLACEHOLDER_RE.sub(lambda m: values[m.group(0)], LONGBENCH_V2_0SHOT_TEMPLATE)

    if tokenizer is None or max_prompt_tokens is None:
        return prompt
    return _cut_middle(prompt, tokenizer, max_prompt_tokens)


def _cut_middle(prompt: str, tokenizer, budget: int) -> str:
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    if len(ids) <= budget:
        return prompt
    head = budget // 2
    tail = budget - head
    # Explicit slice bounds: ids[-0:] would be the whole list.
    return tokenizer.decode(ids[:head] + ids[len(ids) - tail:], skip_special_tokens=True)


# --- answer extraction ---------------------------------------------------------------------------------

_OFFICIAL_PATTERNS = (
    re.compile(r"The correct answer is \(([A-D])\)"),
    re.compile(r"The correct answer is ([A-D])"),
)

# Lenient phrasings, tried in this order; within a pattern the first match in the text wins. The letter
# must be an upper-case A-D not followed by another letter, so "a" (the article) or "Done" never match.
_LENIENT_PATTERNS = (
    # 1. The official sentence in any letter case, with optional brackets around the letter.
    re.compile(r"(?i:the\s+correct\s+answer\s+is)\s*[:\-]?\s*[(\[]?([A-D])(?![A-Za-z])"),
    # 2. "Answer: C", "answer is (C)", "The correct option is B", "My choice: (D)".
    re.compile(r"(?i:\b(?:answer|option|choice)\s*(?:is\s*:?|:))\s*[(\[]?([A-D])(?![A-Za-z])"),
    # 3. The whole response is just a letter: "C", "(C)", "C.", "[C]".
    re.compile(r"^\s*[(\[]?([A-D])[)\]]?\.?\s*$"),
    # 4. The response starts with the letter in brackets: "(C) The blue ledger ...".
    re.compile(r"^\s*[(\[]([A-D])[)\]]"),
)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _final_answer(s: str) -> str:
    """The part of a response that is its answer: after the last `</think>` (reasoning models such as Qwen3
    and DeepSeek-R1 often emit the closing tag without the opening one); `""` for a response that opened
    `<think>` and never closed it (still thinking when the generation stopped); else the whole text."""
    end = s.rfind(_THINK_CLOSE)
    if end >= 0:
        return s[end + len(_THINK_CLOSE):]
    return "" if s.lstrip().startswith(_THINK_OPEN) else s


def _first_match(patterns, s: str) -> str | None:
    for pat in patterns:
        m = pat.search(s)
        if m:
            return m.group(1)
    return None


def extract_answer(text: str | None, mode: str = "official") -> str | None:
    """The letter `"A"`..`"D"` a response commits to, or None.

    `mode="official"` is LongBench-v2's rule (`pred.py`): remove every `*`, then take the first match of
    `The correct answer is (X)`, else the first match of `The correct answer is X`; case-sensitive, X in
    A-D; otherwise None. As in the official code there is no word boundary after X, so
    `The correct answer is Done` gives `"D"`. It reads the whole text, reasoning included.

    `mode="lenient"` removes every `*` and reads the *final answer*: the text after the last `</think>`
    (reasoning models often close a block they never opened), the whole text when there is none, nothing
    when the response opened `<think>` and never closed it. In the final answer it tries, in order:

    0. the official rule;
    1. the official sentence in any letter case and with optional brackets or a colon:
       `the correct answer is (A)`, `The Correct Answer Is: [B]`, `The correct answer is C.`;
    2. `answer`, `option` or `choice` (any case) followed by `is`, `is:` or `:`: `Answer: C`, `the answer is (B)`,
       `The correct option is D`, `My choice: (A)`;
    3. a response that is only the letter: `C`, `(C)`, `C.`, `[C]`;
    4. a response that starts with the letter in brackets: `(C) The blue ledger`;

    and when none matches there, the official rule on the whole text. So lenient never does worse than
    official on a response official parses: without `</think>` it returns official's letter; with it, it
    returns official's letter on the final answer, which is what the model answered after reasoning.

    In every lenient phrasing the letter is an upper-case A-D not followed by another letter. Lenient
    figures are reported in their own column, never mixed into official ones.

    Args:
        text: the model's response; None (a failed request) is treated as an empty response.
        mode: `"official"` or `"lenient"`.

    Raises:
        ValueError: unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown extraction mode {mode!r}; use one of {MODES}")
    s = (text or "").replace("*", "")
    if mode == "official":
        return _first_match(_OFFICIAL_PATTERNS, s)
    final = _final_answer(s)
    return (_first_match(_OFFICIAL_PATTERNS, final) or _first_match(_LENIENT_PATTERNS, final)
            or _first_match(_OFFICIAL_PATTERNS, s))


# --- scoring -------------------------------------------------------------------------------------------

def wilson_interval(correct: int, n: int, z: float = _Z95) -> tuple[float, float] | None:
    """Wilson score interval for a binomial proportion `correct / n` (default: 95%).

    With `p = correct/n`: centre `(p + z²/2n) / (1 + z²/n)`, half-width
    `z·sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n)`. Unlike the normal ("Wald") interval it stays inside [0, 1]
    and is not zero-width at 0 or n correct, which matters for 10-30 questions. None when `n == 0`.

    Raises:
        ValueError: `n` or `correct` is not an integer (a bool is not one here) or is negative, `correct > n`, or
            `z` is not a finite number > 0.
    """
    import numbers

    for name, value in (("n", n), ("correct", correct)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(  # noqa: TRY004 (bad input: the documented ValueError)
                f"wilson_interval: {name} must be an integer (a count), got {value!r}")
    if n < 0:
        raise ValueError(f"wilson_interval: n must be >= 0 (the number of trials), got {n}")
    if not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: successes must lie in [0, n] = [0, {n}], got correct={correct}")
    if isinstance(z, bool) or not isinstance(z, numbers.Real) or not (math.isfinite(z) and z > 0):
        raise ValueError(f"wilson_interval: z must be a finite number > 0 (1.96 for 95%), got {z!r}")
    if n == 0:
        return None
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Bucket:
    """Counts for one group of items (all of them, or one difficulty or length level)."""

    n: int
    correct: int
    unparsed: int

    @property
    def empty(self) -> bool:
        return self.n == 0

    @property
    def accuracy(self) -> float | None:
        """`correct / n`, or None for an empty bucket (no division by zero)."""
        return self.correct / self.n if self.n else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        """95% Wilson score interval of the accuracy (None for an empty bucket)."""
        return wilson_interval(self.correct, self.n)

    def to_dict(self) -> dict:
        ci = self.ci95
        return {"n": self.n, "correct": self.correct, "unparsed": self.unparsed, "accuracy": self.accuracy,
                "ci95_low": ci[0] if ci else None, "ci95_high": ci[1] if ci else None}


@dataclass
class ScoreReport:
    """Result of `score_answers` / `score_passkey`.

    `total` counts every response, empty ones included; `unparsed` responses (no answer could be read)
    count as wrong and are reported on their own. `by_difficulty` / `by_length` map a level to its
    `Bucket` (empty dicts when no labels were given). `predictions[i]` is what was read from response `i`
    (a letter, the passkey digits, or None) and `is_correct[i]` whether it matched the gold answer.
    """

    mode: str
    correct: int
    total: int
    unparsed: int
    by_difficulty: dict[str, Bucket] = field(default_factory=dict)
    by_length: dict[str, Bucket] = field(default_factory=dict)
    predictions: list[str | None] = field(default_factory=list)
    is_correct: list[bool] = field(default_factory=list)

    @property
    def overall(self) -> Bucket:
        return Bucket(self.total, self.correct, self.unparsed)

    @property
    def accuracy(self) -> float | None:
        """`correct / total`; None when there are no responses."""
        return self.overall.accuracy

    @property
    def unparsed_rate(self) -> float | None:
        return self.unparsed / self.total if self.total else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        """95% Wilson score interval of the accuracy (see `wilson_interval`)."""
        return self.overall.ci95

    def __str__(self) -> str:
        acc = "n/a" if self.accuracy is None else f"{100 * self.accuracy:.1f}%"
        return f"{self.correct}/{self.total} correct ({acc}), {self.unparsed} unparsed"

    def summary(self) -> str:
        """Several lines: the headline, the 95% interval, then one line per bucket."""
        lines = [f"[{self.mode}] {self}"]
        if self.ci95 is not None:
            lines.append(f"  95% CI (Wilson): {100 * self.ci95[0]:.1f}%-{100 * self.ci95[1]:.1f}%")
        for axis, buckets in (("difficulty", self.by_difficulty), ("length", self.by_length)):
            for level, b in buckets.items():
                acc = "empty" if b.empty else f"{b.correct}/{b.n} ({100 * b.accuracy:.1f}%), {b.unparsed} unparsed"
                lines.append(f"  {axis}={level}: {acc}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready dict: mode, the overall counts, accuracy, interval, and the buckets."""
        return {"mode": self.mode, **self.overall.to_dict(), "total": self.total,
                "unparsed_rate": self.unparsed_rate,
                "by_difficulty": {k: b.to_dict() for k, b in self.by_difficulty.items()},
                "by_length": {k: b.to_dict() for k, b in self.by_length.items()}}

    def to_frame(self):
        """pandas DataFrame, one row per group: `all` first, then each difficulty and length level.

        Columns: mode, axis, level, n, correct, unparsed, accuracy, ci95_low, ci95_high.
        """
        import pandas as pd

        rows = [{"mode": self.mode, "axis": "all", "level": "all", **self.overall.to_dict()}]
        for axis, buckets in (("difficulty", self.by_difficulty), ("length", self.by_length)):
            rows += [{"mode": self.mode, "axis": axis, "level": k, **b.to_dict()} for k, b in buckets.items()]
        return pd.DataFrame(rows)


def _buckets(labels, ok: list[bool], parsed: list[bool], levels: tuple[str, ...]) -> dict[str, Bucket]:
    if labels is None:
        return {}
    labels = ["unknown" if lab is None else str(lab) for lab in labels]
    # Known levels first, in their natural order, so an absent one appears as an empty bucket; any other
    # label follows in order of first appearance.
    order = list(levels) + [lab for lab in dict.fromkeys(labels) if lab not in levels]
    out = {}
    for level in order:
        idx = [i for i, lab in enumerate(labels) if lab == level]
        out[level] = Bucket(n=len(idx), correct=sum(ok[i] for i in idx), unparsed=sum(not parsed[i] for i in idx))
    return out


def _check_lengths(gold, responses, difficulty, length) -> None:
    for name, seq in (("responses", responses), ("difficulty", difficulty), ("length", length)):
        if seq is not None and len(seq) != len(gold):
            raise ValueError(f"{name} has {len(seq)} items but gold has {len(gold)}; they must align one to one")


def _report(mode, predictions, ok, difficulty, length, levels_d, levels_l) -> ScoreReport:
    parsed = [p is not None for p in predictions]
    return ScoreReport(
        mode=mode, correct=sum(ok), total=len(ok), unparsed=sum(not p for p in parsed),
        by_difficulty=_buckets(difficulty, ok, parsed, levels_d),
        by_length=_buckets(length, ok, parsed, levels_l),
        predictions=list(predictions), is_correct=list(ok),
    )


def score_answers(gold: Sequence[str], responses: Sequence[str | None], *, difficulty: Sequence | None = None,
                  length: Sequence | None = None, mode: str = "official") -> ScoreReport:
    """Score multiple-choice responses against gold letters.

    Every response counts in the denominator: an empty or None response, or one where `extract_answer`
    finds no letter, is unparsed and wrong (the official LongBench scripts dropped empty answers from the
    denominator). When `difficulty` / `length` labels are given, each level gets a `Bucket` with its own
    `n`: LongBench-v2's levels (`easy`, `hard`; `short`, `medium`, `long`) are always listed, so a level
    with no items shows as empty (n=0, accuracy None); other labels follow in order of first appearance
    (None becomes `"unknown"`).

    Args:
        gold: gold letters `"A"`..`"D"` (surrounding whitespace ignored).
        responses: model responses, aligned with `gold`.
        difficulty, length: optional labels aligned with `gold`.
        mode: extraction mode, `"official"` or `"lenient"` (see `extract_answer`).

    Raises:
        ValueError: lengths differ; a gold answer is not one of A-D; unknown mode.
    """
    _check_lengths(gold, responses, difficulty, length)
    golds = [str(g).strip() for g in gold]
    bad = [g for g in golds if g not in CHOICES]
    if bad:
        raise ValueError(f"gold answers must be one of {CHOICES}; got {bad[:5]}")
    predictions = [extract_answer(r, mode) for r in responses]
    ok = [p == g for p, g in zip(predictions, golds)]
    return _report(mode, predictions, ok, difficulty, length, DIFFICULTY_LEVELS, LENGTH_LEVELS)


_ASCII_DIGIT = re.compile(r"[0-9]")  # not \d: it matches every Unicode digit (see score_passkey)


def score_passkey(gold: Sequence[str], responses: Sequence[str | None], *, difficulty: Sequence | None = None,
                  length: Sequence | None = None) -> ScoreReport:
    """Exact match of passkey digits (mode `"passkey"`), for the bundled tiny model (docs/design.md §8).

    The gold is a digit sequence such as `"4 8 1 9 2"` (any non-digits ignored; k = its number of digits,
    5 for the bundled sample). A response's digits are read in order, ignoring whitespace and every other
    character; it is correct when its first k digits equal the gold digits, and unparsed (and wrong) when it
    holds fewer than k digits. Digits are the ASCII `0`-`9` only: other Unicode digits (full-width `１２３`,
    Arabic-Indic `٤٨`, ...) are other characters, ignored like letters, because a model that writes them did not
    write the passkey's digits (Python's `\\d` would match them). `predictions[i]` is the first k digits separated
    by spaces, as the gold is written, or None. Buckets list only the labels present.

    Raises:
        ValueError: lengths differ; a gold answer has no digit 0-9.
    """
    _check_lengths(gold, responses, difficulty, length)
    predictions: list[str | None] = []
    ok: list[bool] = []
    for g, r in zip(gold, responses):
        want = _ASCII_DIGIT.findall(str(g))
        if not want:
            raise ValueError(f"gold passkey {g!r} has no digit (0-9)")
        got = _ASCII_DIGIT.findall(r or "")[: len(want)]
        predictions.append(" ".join(got) if len(got) == len(want) else None)
        ok.append(got == want)
    return _report("passkey", predictions, ok, difficulty, length, (), ())


def parse_task_items(task: str, response: str | None) -> list[str] | None:
    """Items a response lists for a RULER-style task (`tdutils.data.RULER_TASKS`), in the order written.

    The answer grammar (`tdutils.data`, "RULER-style synthetic tasks") ends at the first `.`: items are separated
    by `,` (variable tracking: by spaces), each normalised to single spaces. An item of a value task counts
    only in the shape the gold uses (`d d d d d`, or `key d d d d d` for `niah_multiquery`); others are kept as
    written, so they never match. Returns None when the response has no item at all (unparsed).
    """
    text = (response or "").split(".", 1)[0]
    parts = text.split() if task == "variable_tracking" else text.split(",")
    items = [" ".join(p.split()) for p in parts]
    items = [i for i in items if i]
    return items or None


def score_task(task: str, values: Sequence[str], response: str | None) -> tuple[bool, float]:
    """`(exact, partial)` of one response to a RULER-style task (Hsieh et al., arXiv:2404.06654).

    `exact`: the response lists exactly the gold items, each once, in any order (RULER's tasks ask for all
    values; order is not scored). `partial`: the fraction of gold items the response lists (RULER's
    `string_match_all` credit), in [0, 1]. `values` are the example's `values` from `make_task_example`.

    Raises:
        ValueError: an unknown task, or no gold items.
    """
    if task not in RULER_TASKS:
        raise ValueError(f"unknown task {task!r}; score_task scores the RULER-style tasks {', '.join(RULER_TASKS)} "
                         f"(passkey answers: score_passkey)")
    gold = [" ".join(str(v).split()) for v in values]
    if not gold:
        raise ValueError(f"{task}: an example needs at least one gold value")
    items = parse_task_items(task, response) or []
    remaining = list(items)
    found = 0
    for g in gold:
        if g in remaining:
            remaining.remove(g)
            found += 1
    return (found == len(gold) and not remaining), found / len(gold)
