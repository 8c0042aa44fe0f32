"""The bundled sample datasets as tasks (`run --dataset sample`, `eval --tasks sample`): `sample` (16 passkey
prompts of 1024 tokens of the bundled tokenizer, docs/design.md §8; `tdutils.answers.score_passkey`) and
`mc-sample` (20 English four-choice prompts in LongBench-v2's 0-shot template, `tdutils.data.load_mc_sample`;
`tdutils.answers.score_answers`, official extraction). Their prompts are fixed, read by
`tdutils.data.load_prompts`: a context length is the longest prompt a run takes, and fewer fitting rows than `n`
is an error. Aware mode only (a prompt has no context/question split). A file or hub dataset of the same shape
(gold digits, gold letters A-D) is scored by these tasks (`tdutils.eval.tasks.dataset_task`).
"""

from __future__ import annotations

from ..answers import extract_answer, score_answers
from ..data import MC_SAMPLE_NAME, SAMPLE_NAME, load_prompts
from ..models import TINY_MODEL_NAME
from .task_passkey import passkey_report, passkey_score
from .tasks import PASSKEY_DEFAULTS, RULER_DEFAULTS, SAMPLES, Defaults, Task, register_task

SAMPLE_DEFAULTS = Defaults(
    TINY_MODEL_NAME, PASSKEY_DEFAULTS.policies, PASSKEY_DEFAULTS.drop_ratios, (1024,), 16, modes=("aware",),
    max_tokens=10, title="the bundled passkey sample", label="passkey exact match on the bundled sample",
    metric="exact match of the 5 passkey digits (tdutils.answers.score_passkey), 95% Wilson interval")
MC_DEFAULTS = Defaults(
    RULER_DEFAULTS.model, RULER_DEFAULTS.policies, RULER_DEFAULTS.drop_ratios, (4096,), 20, modes=("aware",),
    max_tokens=32, real_model=True, title="the bundled multiple-choice sample", label="multiple-choice accuracy",
    metric="LongBench-v2 official answer extraction, exact letter (tdutils.answers.score_answers), 95% Wilson interval")


def fixed_rows(dataset: str, n: int, context_tokens: int | None, tokenizer) -> list[dict]:
    """The first `n` rows of a bundled dataset whose prompts hold at most `context_tokens` tokens of `tokenizer`
    (None: every row), as task examples (`prompt`, `answer`, `values` = [answer], and the row's other columns).

    Raises:
        ValueError: fewer than `n` rows fit.
    """
    rows = []
    for r in load_prompts(dataset):
        if context_tokens is None or len(tokenizer(r.prompt)["input_ids"]) <= context_tokens:
            rows.append({**r.meta, "prompt": r.prompt, "answer": r.answer, "values": [r.answer]})
        if len(rows) == n:
            return rows
    raise ValueError(f"{dataset}: {len(rows)} of its prompts fit in {context_tokens} tokens, fewer than n={n}; "
                     f"raise the context length or lower n")


def _mc_score(values, text) -> tuple[bool, float]:
    exact = extract_answer(text) == str(values[0]).strip()
    return exact, float(exact)


def _mc_report(rows, responses):
    labels = {k: [r.meta.get(k) for r in rows] for k in ("difficulty", "length")}
    labels = {k: v if any(x is not None for x in v) else None for k, v in labels.items()}
    return score_answers([str(r.answer).strip() for r in rows], responses, **labels)


def _max_tokens(defaults: Defaults):
    return lambda examples, tokenizer: defaults.max_tokens


register_task(Task(SAMPLE_NAME, SAMPLES, lambda n, length, tok, seed, chat=None: fixed_rows(SAMPLE_NAME, n, length, tok),
                   None, passkey_score, _max_tokens(SAMPLE_DEFAULTS), about="the bundled passkey prompts (~1k tokens)",
                   defaults=SAMPLE_DEFAULTS, report=passkey_report))
register_task(Task(MC_SAMPLE_NAME, SAMPLES, lambda n, length, tok, seed, chat=None: fixed_rows(MC_SAMPLE_NAME, n, length, tok),
                   None, _mc_score, _max_tokens(MC_DEFAULTS), about="the bundled English multiple-choice prompts",
                   defaults=MC_DEFAULTS, report=_mc_report))
