"""The word-level RULER-style tasks of the bundled `tiny-qwen3-ruler` (`tdutils.data.RULER_TASKS`, `--tasks all`):
needles `pass key W V .` in the bundled filler (`tdutils.data.make_task_dataset`), both modes, scored by
`tdutils.answers.score_task` (exact: every gold item, each once; partial: the fraction listed)."""

from __future__ import annotations

from ..answers import score_task
from ..data import RULER_TASKS, make_task_dataset
from .tasks import WORD, WORD_DEFAULTS, Task, register_task, split_question


def word_task(name: str) -> Task:
    """The registration of word-level task `name` (one of `RULER_TASKS`)."""

    def make(n, length, tokenizer, seed, chat_template=None):
        return make_task_dataset(name, n, length, tokenizer=tokenizer, seed=seed)

    def max_tokens(examples, tokenizer):
        # the longest gold answer plus 2 tokens: room to show an extra item, which exact match counts as wrong
        return max(len(tokenizer(e["answer"], add_special_tokens=False)["input_ids"]) for e in examples) + 2

    return Task(name, WORD, make, split_question, lambda values, text: score_task(name, values, text), max_tokens,
                about="word-level RULER-style task of the bundled model tiny-qwen3-ruler", defaults=WORD_DEFAULTS)


for _name in RULER_TASKS:
    register_task(word_task(_name))
