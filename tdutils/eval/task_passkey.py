"""The passkey benchmark of the bundled `tiny-qwen3` (docs/design.md §8) as the task `passkey`: synthetic passkey
prompts of exactly the asked length (`tdutils.data.make_passkey_dataset`), aware mode only, scored by
`tdutils.answers.score_passkey` (the first 5 digits of the response)."""

from __future__ import annotations

from ..answers import score_passkey
from ..data import make_passkey_dataset
from .tasks import PASSKEY, PASSKEY_DEFAULTS, Task, register_task


def passkey_score(values, text) -> tuple[bool, float]:
    """`(exact, partial)` of one passkey response: exact = its first digits are the gold's (`score_passkey`)."""
    exact = score_passkey(values[:1], [text]).correct == 1
    return exact, float(exact)


def passkey_report(rows, responses):
    """`score_passkey` of `rows` (their gold `answer`) and `responses`: the passkey family's `Task.report`."""
    return score_passkey([r.answer for r in rows], responses)


def _make(n, length, tokenizer, seed, chat_template=None):
    return [{**d, "values": [d["answer"]]} for d in make_passkey_dataset(n, length, tokenizer=tokenizer, seed=seed)]


register_task(Task(PASSKEY, PASSKEY, _make, None, passkey_score, lambda examples, tokenizer: PASSKEY_DEFAULTS.max_tokens,
                   about="passkey retrieval of the bundled model tiny-qwen3 (aware mode only)",
                   defaults=PASSKEY_DEFAULTS, report=passkey_report))
