"""The task registry: a task is a name, a dataset maker, the context/question split, a scorer, a decode length and
the command line's defaults; `task_eval`, `passkey_eval` and `python -m tdutils eval --tasks NAME` find it by name.

Three suites are registered here (a fourth, `text`, in `task_fidelity.py`): `passkey` (the bundled `tiny-qwen3`'s needle, docs/design.md §8; aware mode
only); `word`, the word-level RULER-style tasks of `tiny-qwen3-ruler` (`tdutils.data.RULER_TASKS`, `--tasks all`);
`ruler`, RULER's own templates for real tokenizers (`tdutils.ruler`, Hsieh et al., arXiv:2404.06654), registered as
`ruler_` + RULER's task name (`--tasks ruler`). A new task is one file `tdutils/eval/task_<name>.py` that calls
`register_task(Task(...))`: such files are imported at the first lookup, in name order, with no other edit.

A task's examples are dicts with `prompt` (what `prefill` takes: text, or `prompt_ids`) and `values` (the gold items
its scorer reads; a teacher-forced task's examples have `prompt_ids` and `continuation` ids instead); `split(tokenizer, example)` returns `(context ids, question ids)` whose concatenation is exactly
the aware prompt's ids (None: aware mode only). `Defaults` are what the command line runs when an option is left
out; a run takes those of its first task that runs on a bundled model (else of its first task).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..data import RULER_PREFIX, RULER_TASKS, TASK_MODES
from ..models import RULER_MODEL_NAME, TINY_MODEL_NAME
from .common import FULL

PASSKEY, WORD, RULER, TEXT = "passkey", "word", "ruler", "text"
SUITES = (WORD, RULER, TEXT, PASSKEY)  # the order tasks are listed in
GROUPS = {"all": WORD, "ruler": RULER}  # --tasks words that run a whole suite
SUITE_LABELS = {WORD: "word-level", RULER: "RULER templates", TEXT: "natural text", PASSKEY: "the passkey benchmark"}
MODES = TASK_MODES  # ("aware", "agnostic")
LAYOUTS = ("tasks", "lengths")


@dataclass(frozen=True)
class Defaults:
    """The command line's defaults for a task (`python -m tdutils eval --tasks NAME` with options left out).

    Attributes:
        model: `--model` (a bundled name, or the real model RULER's templates are shown with).
        policies, drop_ratios, context_lengths, n: `--policies`, `--drop-ratios`, `--context-lengths` (tokens), `--n`.
        modes: the modes the task runs in (`--mode` unset runs these).
        max_tokens: `--max-tokens`; None: the task's own `Task.max_tokens` per dataset.
        real_model: the task needs a real tokenizer; the bundled word-level models are refused.
        chat_template: prompts take the tokenizer's chat template (`--chat-template`); the JSON records it.
        layout: `"tasks"` (a `task_eval` table, `TASK_COLUMNS`) or `"lengths"` (a `passkey_eval` table, `COLUMNS`:
            no task or mode column, so such a task runs alone).
        title: what the task set is called in warnings ("the passkey benchmark").
        label, metric: the run's closing line ("passkey exact match, model=...") and the JSON's `metric`.
    """

    model: str
    policies: tuple[str, ...]
    drop_ratios: tuple[float, ...]
    context_lengths: tuple[int, ...]
    n: int
    modes: tuple[str, ...] = MODES
    max_tokens: int | None = None
    real_model: bool = False
    chat_template: bool = False
    layout: str = "tasks"
    title: str = "the tasks"
    label: str = "exact match"
    metric: str = "exact match, 95% Wilson interval; partial = mean fraction of gold items found"


TASK_POLICIES = (FULL, "random", "streaming_llm", "knorm", "snapkv", "rkv")
PASSKEY_DEFAULTS = Defaults(
    TINY_MODEL_NAME, (FULL, "random", "snapkv"), (0.0, 0.25, 0.5, 0.75), (512, 1024, 2048), 200, modes=("aware",),
    max_tokens=10, layout="lengths", title="the passkey benchmark", label="passkey exact match",
    metric="exact match of the 5 passkey digits (tdutils.answers.score_passkey), 95% Wilson interval")
WORD_DEFAULTS = Defaults(
    RULER_MODEL_NAME, TASK_POLICIES, (0.25, 0.5, 0.75, 0.9), (1024, 2048, 4096), 200, title="the RULER-style tasks",
    label="RULER-style exact match",
    metric=("exact match of every gold item (tdutils.answers.score_task), 95% Wilson interval; "
            "partial = mean fraction of gold items listed"))
RULER_DEFAULTS = Defaults(
    "smollm2-135m", TASK_POLICIES, (0.5, 0.75, 0.9), (2048, 4096), 50, real_model=True, chat_template=True,
    title="RULER's templates", label="RULER template exact match",
    metric=("RULER string_match_all: exact = every reference in the response, partial = fraction of "
            "references present (tdutils.ruler.score_ruler); 95% Wilson interval of exact"))


@dataclass(frozen=True)
class Task:
    """One evaluation task.

    Attributes:
        name: registry key (`--tasks NAME`).
        suite: `"word"`, `"ruler"`, `"text"` or `"passkey"` (`SUITES`; `--tasks all` / `ruler` run a whole suite).
        make_dataset: `(n, context_tokens, tokenizer, seed, chat_template) -> list[dict]`, each example of exactly
            `context_tokens` prompt tokens for that tokenizer; ValueError when the length cannot hold the task.
        split: `(tokenizer, example) -> (context ids, question ids)`; None: the task runs in aware mode only.
        score: `(values, response text) -> (exact: bool, partial: float in [0, 1])`; None for a teacher-forced
            task (scored from its logits).
        max_tokens: `(examples, tokenizer) -> int`, greedy decode tokens that hold the longest full answer (a
            teacher-forced task: its continuation's length).
        about: one line for tables and `--help`.
        defaults: the command line's defaults (`Defaults`).
        measure: the per-prompt score the task is ranked by (`tdutils.eval.statistics.MEASURES`): `"exact"`
            (binary exact match), `"partial"` (fraction of the references found), or for a teacher-forced task
            `"kl"`; every row keeps each prompt's scores of all its measures.
        teacher_forced: the examples carry a `continuation` that is fed, not generated
            (`decode(forced_ids=...)`): the cells are compared with the full cache's next-token distributions
            (`tdutils.eval.runner.run_forced_cells`) instead of scoring answers. Agnostic mode only (the cache is
            edited before the continuation is seen).
        grouped: run by its suite's word (`--tasks ruler`) and by default; False for a task that re-scores
            another task's prompts (`ruler_<task>_partial`), which runs when named.
    """

    name: str
    suite: str
    make_dataset: Callable[..., list[dict]]
    split: Callable[[object, Mapping], tuple[list[int], list[int]]] | None
    score: Callable[[Sequence[str], str | None], tuple[bool, float]] | None
    max_tokens: Callable[[Sequence[Mapping], object], int]
    about: str = ""
    defaults: Defaults = WORD_DEFAULTS
    measure: str = "exact"
    teacher_forced: bool = False
    grouped: bool = True


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Make `task` reachable by name (`get_task`, `task_eval`, `python -m tdutils eval --tasks`).

    Raises:
        ValueError: a name already registered, an unknown suite, layout or measure, or a task without a scorer
            that is not teacher-forced.
    """
    if task.suite not in SUITES:
        raise ValueError(f"task {task.name!r}: suite must be one of {SUITES}, got {task.suite!r}")
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    if task.defaults.layout not in LAYOUTS:
        raise ValueError(f"task {task.name!r}: layout must be one of {LAYOUTS}, got {task.defaults.layout!r}")
    from .statistics import get_measure

    get_measure(task.measure)
    if task.score is None and not task.teacher_forced:
        raise ValueError(f"task {task.name!r}: a task that generates answers needs a scorer (score=...)")
    _TASKS[task.name] = task
    return task


def unregister_task(name: str) -> None:
    """Remove a registered task (a notebook re-running its cell, a test). Raises ValueError for an unknown name."""
    get_task(name)
    del _TASKS[name]


def task_names(suite: str | None = None) -> tuple[str, ...]:
    """Registered task names in registration order, all or of one suite."""
    _discover()
    return tuple(n for n, t in _TASKS.items() if suite is None or t.suite == suite)


def get_task(name: str) -> Task:
    """The registered task `name`.

    Raises:
        ValueError: an unknown name (the message lists the registered ones by suite).
    """
    _discover()
    if name not in _TASKS:
        listing = "; ".join(f"{s}: {', '.join(task_names(s))}" for s in SUITES if task_names(s))
        raise ValueError(f"unknown task {name!r}; registered tasks are {listing}")
    return _TASKS[name]


def split_question(tokenizer, example: Mapping) -> tuple[list[int], list[int]]:
    """`(context ids, question ids)` of a task example for the query-agnostic flow, such that together they are
    exactly the token ids of the aware prompt `example["prompt"]` (= context + " " + question).

    The context's own ids are used when they are a prefix of the prompt's (always with the bundled word-level
    tokenizer); otherwise the prompt is cut after as many tokens as the context has, so both modes still read
    the same sequence.

    Raises:
        ValueError: an example without `prompt` and `context` (not from `make_task_example`), or a context that
            is not shorter than the prompt.
    """
    missing = [k for k in ("prompt", "context") if k not in example]
    if missing:
        raise ValueError(f"split_question needs a task example with 'prompt' and 'context' (from "
                         f"tdutils.data.make_task_example); this one has no {' or '.join(map(repr, missing))}")
    prompt = tokenizer(example["prompt"])["input_ids"]
    context = tokenizer(example["context"])["input_ids"]
    if len(context) >= len(prompt):
        raise ValueError(f"the context ({len(context)} tokens) is not shorter than the prompt ({len(prompt)}); "
                         f"a task example needs a question after its context")
    cut = len(context)
    return prompt[:cut], prompt[cut:]


# --- built-in registrations ------------------------------------------------------------------------------

def _passkey_task() -> Task:
    from ..answers import score_passkey
    from ..data import make_passkey_dataset

    def make(n, length, tokenizer, seed, chat_template=None):
        return [{**d, "values": [d["answer"]]} for d in make_passkey_dataset(n, length, tokenizer=tokenizer, seed=seed)]

    def score(values, text):
        exact = score_passkey(values, [text]).correct == 1
        return exact, float(exact)

    return Task(PASSKEY, PASSKEY, make, None, score, lambda examples, tokenizer: PASSKEY_DEFAULTS.max_tokens,
                about="passkey retrieval of the bundled model tiny-qwen3 (aware mode only)", defaults=PASSKEY_DEFAULTS)


def _word_task(name: str) -> Task:
    from ..answers import score_task
    from ..data import make_task_dataset

    def make(n, length, tokenizer, seed, chat_template=None):
        return make_task_dataset(name, n, length, tokenizer=tokenizer, seed=seed)

    def max_tokens(examples, tokenizer):
        # the longest gold answer plus 2 tokens: room to show an extra item, which exact match counts as wrong
        return max(len(tokenizer(e["answer"], add_special_tokens=False)["input_ids"]) for e in examples) + 2

    return Task(name, WORD, make, split_question, lambda values, text: score_task(name, values, text), max_tokens,
                about="word-level RULER-style task of the bundled model tiny-qwen3-ruler", defaults=WORD_DEFAULTS)


def _ruler_task(name: str) -> Task:
    from .. import ruler

    def make(n, length, tokenizer, seed, chat_template="auto"):
        return ruler.make_ruler_dataset(name, n, length, tokenizer=tokenizer, seed=seed, chat_template=chat_template)

    def split(tokenizer, example):
        ids, cut = list(example["prompt_ids"]), int(example["split"])
        return ids[:cut], ids[cut:]

    def max_tokens(examples, tokenizer):
        # RULER's own tokens_to_generate is 30-128; on CPU about twice the longest gold answer is enough
        return ruler.RULER_CPU_MAX_TOKENS[name]

    return Task(RULER_PREFIX + name, RULER, make, split, lambda values, text: ruler.score_ruler(name, values, text),
                max_tokens, about="RULER's own template (NVIDIA/RULER), for real tokenizers", defaults=RULER_DEFAULTS)


def _register_builtin() -> None:
    from ..ruler import RULER_TEMPLATE_TASKS

    register_task(_passkey_task())
    for name in RULER_TASKS:
        register_task(_word_task(name))
    for name in RULER_TEMPLATE_TASKS:
        register_task(_ruler_task(name))


_register_builtin()
_DISCOVERED = False


def _discover() -> None:
    """Import every `tdutils/eval/task_*.py` once (name order): each registers its own tasks."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import importlib
    import pkgutil
    from pathlib import Path

    for module in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])):
        if module.startswith("task_"):
            importlib.import_module(f"{__package__}.{module}")


__all__ = [
    "GROUPS",
    "MODES",
    "PASSKEY",
    "PASSKEY_DEFAULTS",
    "RULER",
    "RULER_DEFAULTS",
    "SUITES",
    "SUITE_LABELS",
    "TEXT",
    "WORD",
    "WORD_DEFAULTS",
    "Defaults",
    "Task",
    "get_task",
    "register_task",
    "split_question",
    "task_names",
    "unregister_task",
]
