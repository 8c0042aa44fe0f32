"""Evaluation tasks as registrations: a name, a dataset maker, the context/question split, a scorer, decode length.

`tdutils.evaluate.task_eval` runs any registered task in both modes (aware: the question is in the prompt when the
cache is edited; agnostic: the cache is edited on the context alone and the question is prefilled afterwards).
Two suites are registered:

- `word`: the word-level RULER-style tasks of the bundled model `tiny-qwen3-ruler` (`tdutils.data`: `niah_single`,
  `niah_multikey`, `niah_multivalue`, `niah_multiquery`, `variable_tracking`; needles `pass key W V .`);
- `ruler`: RULER's own templates for real tokenizers (`tdutils.ruler`; Hsieh et al., arXiv:2404.06654), registered
  as `ruler_` + RULER's task name (`ruler_niah_single_1` ... `ruler_fwe`), with the model's chat template when it
  has one.

A task's examples are dicts with at least `prompt` (what `prefill` takes: text or token ids) and `values` (the gold
items its scorer reads); `split(tokenizer, example)` returns `(context ids, question ids)` whose concatenation is
exactly the aware prompt's ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

WORD, RULER = "word", "ruler"
SUITES = (WORD, RULER)


@dataclass(frozen=True)
class Task:
    """One evaluation task.

    Attributes:
        name: registry key (`--tasks NAME`).
        suite: `"word"` (bundled word-level models) or `"ruler"` (RULER's templates, real tokenizers).
        make_dataset: `(n, context_tokens, tokenizer, seed, chat_template) -> list[dict]`, each example of exactly
            `context_tokens` prompt tokens for that tokenizer; ValueError when the length cannot hold the task.
        split: `(tokenizer, example) -> (context ids, question ids)`.
        score: `(values, response text) -> (exact: bool, partial: float in [0, 1])`.
        max_tokens: `(examples, tokenizer) -> int`, greedy decode tokens that hold the longest full answer.
        about: one line for tables and `--help`.
    """

    name: str
    suite: str
    make_dataset: Callable[..., list[dict]]
    split: Callable[[object, Mapping], tuple[list[int], list[int]]]
    score: Callable[[Sequence[str], str | None], tuple[bool, float]]
    max_tokens: Callable[[Sequence[Mapping], object], int]
    about: str = ""


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Make `task` reachable by name (`get_task`, `task_eval`, `python -m tdutils eval --tasks`).

    Raises:
        ValueError: a name already registered, or an unknown suite.
    """
    if task.suite not in SUITES:
        raise ValueError(f"task {task.name!r}: suite must be one of {SUITES}, got {task.suite!r}")
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    _TASKS[task.name] = task
    return task


def task_names(suite: str | None = None) -> tuple[str, ...]:
    """Registered task names in registration order, all or of one suite."""
    _register_builtin()
    return tuple(n for n, t in _TASKS.items() if suite is None or t.suite == suite)


def get_task(name: str) -> Task:
    """The registered task `name`.

    Raises:
        ValueError: an unknown name (the message lists the registered ones by suite).
    """
    _register_builtin()
    if name not in _TASKS:
        listing = "; ".join(f"{s}: {', '.join(task_names(s))}" for s in SUITES)
        raise ValueError(f"unknown task {name!r}; registered tasks are {listing}")
    return _TASKS[name]


# --- built-in registrations ------------------------------------------------------------------------------

def _word_task(name: str) -> Task:
    from .answers import score_task
    from .data import make_task_dataset

    def make(n, length, tokenizer, seed, chat_template=None):
        return make_task_dataset(name, n, length, tokenizer=tokenizer, seed=seed)

    def split(tokenizer, example):
        from .evaluate import split_question

        return split_question(tokenizer, example)

    def max_tokens(examples, tokenizer):
        # the longest gold answer plus 2 tokens: room to show an extra item, which exact match counts as wrong
        return max(len(tokenizer(e["answer"], add_special_tokens=False)["input_ids"]) for e in examples) + 2

    return Task(name, WORD, make, split, lambda values, text: score_task(name, values, text), max_tokens,
                about="word-level RULER-style task of the bundled model tiny-qwen3-ruler")


RULER_PREFIX = "ruler_"  # registry names of RULER's templates: "ruler_" + RULER's own task name (two of which,
# niah_multivalue and niah_multiquery, are also names of word-level tasks)


def _ruler_task(name: str) -> Task:
    from . import ruler

    def make(n, length, tokenizer, seed, chat_template="auto"):
        return ruler.make_ruler_dataset(name, n, length, tokenizer=tokenizer, seed=seed, chat_template=chat_template)

    def split(tokenizer, example):
        ids, cut = list(example["prompt_ids"]), int(example["split"])
        return ids[:cut], ids[cut:]

    def max_tokens(examples, tokenizer):
        # RULER's own tokens_to_generate is 30-128; on CPU about twice the longest gold answer is enough
        return ruler.RULER_CPU_MAX_TOKENS[name]

    return Task(RULER_PREFIX + name, RULER, make, split, lambda values, text: ruler.score_ruler(name, values, text),
                max_tokens,
                about="RULER's own template (NVIDIA/RULER), for real tokenizers")


_BUILTIN_DONE = False


def _register_builtin() -> None:
    global _BUILTIN_DONE
    if _BUILTIN_DONE:
        return
    _BUILTIN_DONE = True
    from .data import RULER_TASKS
    from .ruler import RULER_TEMPLATE_TASKS

    for name in RULER_TASKS:
        register_task(_word_task(name))
    for name in RULER_TEMPLATE_TASKS:
        register_task(_ruler_task(name))
