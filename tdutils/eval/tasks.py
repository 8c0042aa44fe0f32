"""The task registry: a task is a name, a dataset maker, the context/question split, a scorer, a decode length and
the command line's defaults; `task_eval`, `passkey_eval`, `python -m tdutils eval --tasks NAME` and
`python -m tdutils run --dataset NAME` find it by name, and score with its scorer (`score_rows`).

Each family of tasks is one file `tdutils/eval/task_<name>.py` that calls `register_task(Task(...))`; such files
are imported at the first lookup (`BUILTIN` first, in that order, then the others in name order), with no other
edit: `task_passkey` (the bundled `tiny-qwen3`'s needle, docs/design.md §8; aware mode only), `task_word` (the
word-level RULER-style tasks of `tiny-qwen3-ruler`, `--tasks all`), `task_ruler` (RULER's own templates for real
tokenizers, Hsieh et al., arXiv:2404.06654, `ruler_` + RULER's task name, `--tasks ruler`), `task_samples` (the
bundled `sample` and `mc-sample`), `task_partial` and `task_fidelity`. `load_rows` gives a dataset name's rows
(a generated task's examples for a model's tokenizer, else `tdutils.data.load_prompts`: files, hub ids, the
bundled samples), `dataset_task` the task that scores them.

A task's examples are dicts with `prompt` (what `prefill` takes: text, or `prompt_ids`) and `values` (the gold items
its scorer reads; a teacher-forced task's examples have `prompt_ids` and `continuation` ids instead); `split(tokenizer, example)` returns `(context ids, question ids)` whose concatenation is exactly
the aware prompt's ids (None: aware mode only). `Defaults` are what the command line runs when an option is left
out; a run takes those of its first task that runs on a bundled model (else of its first task).
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..answers import CHOICES, ScoreReport
from ..data import MC_SAMPLE_NAME, SAMPLE_NAME, TASK_MODES, PromptRow, load_prompts
from ..models import RULER_MODEL_NAME, TINY_MODEL_NAME, load_tokenizer
from .common import FULL
from .statistics import get_measure

PASSKEY, WORD, RULER, TEXT, SAMPLES = "passkey", "word", "ruler", "text", "samples"
SUITES = (WORD, RULER, TEXT, SAMPLES, PASSKEY)  # the order tasks are listed in
GROUPS = {"all": WORD, "ruler": RULER}  # --tasks words that run a whole suite
SUITE_LABELS = {WORD: "word-level", RULER: "RULER templates", TEXT: "natural text", SAMPLES: "bundled samples",
                PASSKEY: "the passkey benchmark"}
BUILTIN = ("task_passkey", "task_word", "task_ruler")  # imported first: `task_names()[0]` is the default benchmark
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
        report: `(rows, responses) -> tdutils.answers.ScoreReport` for a task whose scorer also reports unparsed
            answers or buckets (passkey, multiple choice); None: `score_rows` counts `score`'s exact matches.
        check_model: `(model, what) -> None`, raising ValueError (starting with `what`) for a model the task's
            prompts cannot be made for, before any work (`load_rows`); None: every model.
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
    report: Callable[[Sequence, Sequence[str | None]], object] | None = None
    check_model: Callable[[object, str], None] | None = None


_TASKS: dict[str, Task] = {}
_ORIGIN: dict[str, str] = {}  # task name -> the module that registered it (orders the built-in families)


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

    get_measure(task.measure)
    if task.score is None and not task.teacher_forced:
        raise ValueError(f"task {task.name!r}: a task that generates answers needs a scorer (score=...)")
    _TASKS[task.name] = task
    _ORIGIN[task.name] = sys._getframe(1).f_globals.get("__name__", "")
    return task


def unregister_task(name: str) -> None:
    """Remove a registered task (a notebook re-running its cell, a test). Raises ValueError for an unknown name."""
    get_task(name)
    del _TASKS[name]
    _ORIGIN.pop(name, None)


def task_names(suite: str | None = None) -> tuple[str, ...]:
    """Registered task names, all or of one suite: the built-in families in their fixed order (`BUILTIN`, then the
    other `task_*.py` files by name, each in its own registration order), then tasks registered elsewhere in
    registration order — whichever module was imported first."""
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


# --- datasets: a registered task's rows, and the task that scores a dataset's rows ---------------------------

def task_rows(name: str, n: int, *, model=None, tokenizer=None, context_tokens: int = 2048,
              chat_template: str | bool = "auto", seed: int = 0) -> list[PromptRow]:
    """`n` examples of registered task `name` (its `make_dataset`, made for the model's own tokenizer) as
    `tdutils.data.PromptRow`s: `prompt` is the example's `prompt_ids` when it has them (token ids, which
    `Engine.tokenize` passes through) else its text; `answer` its gold `answer`, else its gold items joined by
    `", "`; `meta` its other fields with `task` (= `name`) and `values` (what the task's scorer reads).

    Raises:
        ValueError: an unknown or teacher-forced task, a model the task refuses (`Task.check_model`), neither
            `model` nor `tokenizer`, or the task's own errors (a length too short for it, ...).
    """
    task = get_task(name)
    if task.teacher_forced:
        raise ValueError(f"task {name!r} is teacher-forced (scored from next-token distributions, not answers): "
                         f"run it with python -m tdutils eval --tasks {name}")
    if task.check_model is not None:
        task.check_model(model, f"dataset {name!r}")  # a bundled or random:ARCH model, even with its tokenizer given
    if tokenizer is None:
        if model is None:
            raise ValueError(f"dataset {name!r} is made for a model's own tokenizer: pass model= (e.g. "
                             f"{task.defaults.model!r}) or tokenizer=")
        tokenizer = load_tokenizer(model)
    rows = []
    for e in task.make_dataset(n, context_tokens, tokenizer, seed, chat_template):
        values = list(e["values"])
        answer = e.get("answer") if e.get("answer") is not None else ", ".join(map(str, values))
        meta = {k: v for k, v in e.items() if k not in ("prompt", "prompt_ids", "answer")}
        prompt = list(e["prompt_ids"]) if "prompt_ids" in e else e["prompt"]
        rows.append(PromptRow(prompt, answer, {**meta, "task": name, "values": values}))
    return rows


def load_rows(dataset: str, *, num_requests: int | None = None, model=None, tokenizer=None,
              context_tokens: int = 2048, chat_template: str | bool = "auto", seed: int = 0,
              **file_options) -> list[PromptRow]:
    """The rows of a dataset name, as `python -m tdutils run --dataset` reads them: a registered task that makes its
    prompts (`task_names()`, e.g. `"ruler_niah_single_1"`, `"niah_single"`, `"passkey"`; the bundled samples aside)
    gives `task_rows(dataset, num_requests or 16, ...)`; anything else (`"sample"`, `"mc-sample"`, a file, a hub id)
    is read by `tdutils.data.load_prompts(dataset, num_requests=..., **file_options)`.

    Raises:
        ValueError: `num_requests < 1`; then those of `task_rows` or `load_prompts`.
    """
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if isinstance(dataset, str) and dataset in task_names() and get_task(dataset).suite != SAMPLES:
        return task_rows(dataset, 16 if num_requests is None else num_requests, model=model, tokenizer=tokenizer,
                         context_tokens=context_tokens, chat_template=chat_template, seed=seed)
    made = [t for t in task_names() if get_task(t).suite != SAMPLES]  # load_prompts names the bundled ones' typos
    close = difflib.get_close_matches(str(dataset), made, n=1, cutoff=0.8)
    if close and not Path(str(dataset)).expanduser().exists():  # a typo of a task name, not a file or hub id
        raise ValueError(f"dataset {dataset!r} is not a registered task, a bundled dataset or a file: did you mean "
                         f"{close[0]!r}?")
    return load_prompts(dataset, num_requests=num_requests, **file_options)


def _as_row(row) -> PromptRow:
    if isinstance(row, PromptRow):
        return row
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "meta")}
    return PromptRow(row.get("prompt", ""), row.get("answer"), {**meta, **(row.get("meta") or {})})


def dataset_task(dataset, rows) -> Task:
    """The registered task whose scorer scores `rows` (`PromptRow`s or dicts, each with a gold `answer`) of
    `dataset`: the task named `dataset`; else the task every row names (`meta["task"]`); else, for a file or hub
    dataset, the bundled sample of the same shape: gold answers all digits -> `sample` (passkey digits), all
    letters A-D -> `mc-sample` (LongBench-v2 multiple choice).

    Raises:
        ValueError: a row without a gold answer, or gold answers of neither shape.
    """
    if isinstance(dataset, str) and dataset in task_names():
        return get_task(dataset)
    rows = [_as_row(r) for r in rows]
    named = {r.meta.get("task") for r in rows}
    if rows and len(named) == 1 and next(iter(named)) in task_names() and all("values" in r.meta for r in rows):
        return get_task(next(iter(named)))
    gold = [r.answer for r in rows]
    if any(g is None for g in gold):
        raise ValueError("every row needs a gold 'answer' to be scored")
    gold = [str(g).strip() for g in gold]
    if all(re.fullmatch(r"[0-9\s]+", g) for g in gold):
        return get_task(SAMPLE_NAME)
    if all(g in CHOICES for g in gold):
        return get_task(MC_SAMPLE_NAME)
    raise ValueError(f"cannot tell how to score gold answers like {gold[:3]}: expected digit passkeys or letters A-D")


def score_rows(rows, responses: Sequence[str | None], *, task: Task | str | None = None) -> ScoreReport:
    """Score `responses` (one text per row, e.g. `RequestOutput.answer`) against dataset `rows` with the scorer of
    their task (`task`, a name or a `Task`; None: `dataset_task(None, rows)`): its `report` when it has one
    (passkey: `score_passkey`, mode "passkey"; multiple choice: `score_answers`, mode "official", with the rows'
    `difficulty` / `length` buckets), else the exact matches of its `score(values, response)` (mode
    "<task>: every reference"). The same scorer `task_eval` scores the task's cells with.

    Raises:
        TypeError: a single string for `responses`.
        ValueError: a different number of responses and rows; those of `dataset_task`.
    """
    if isinstance(responses, str):
        raise TypeError("responses must be a list with one text per row, not a single string")
    rows = [_as_row(r) for r in rows]
    if len(responses) != len(rows):
        raise ValueError(f"{len(responses)} responses for {len(rows)} rows: pass one response per row")
    task = get_task(task) if isinstance(task, str) else task or dataset_task(None, rows)
    if task.report is not None:
        return task.report(rows, list(responses))
    ok = [task.score(r.meta.get("values", [r.answer]), t)[0] for r, t in zip(rows, responses)]
    return ScoreReport(mode=f"{task.name}: every reference", correct=sum(ok), total=len(ok), unparsed=0, is_correct=ok)


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

    found = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("task_"))
    modules = [f"{__package__}.{m}" for m in [*BUILTIN, *(m for m in found if m not in BUILTIN)]]
    for module in modules:
        importlib.import_module(module)
    # A family imported directly before this ran (e.g. by another module of the package) registered early: put
    # every task back in its family's place, so the default benchmark (`task_names()[0]`) never depends on it.
    rank = {m: i for i, m in enumerate(modules)}
    ordered = sorted(_TASKS.items(), key=lambda item: rank.get(_ORIGIN.get(item[0]), len(modules)))  # stable
    _TASKS.clear()
    _TASKS.update(ordered)


__all__ = [
    "BUILTIN",
    "GROUPS",
    "MODES",
    "PASSKEY",
    "PASSKEY_DEFAULTS",
    "RULER",
    "RULER_DEFAULTS",
    "SAMPLES",
    "SUITES",
    "SUITE_LABELS",
    "TEXT",
    "WORD",
    "WORD_DEFAULTS",
    "Defaults",
    "Task",
    "dataset_task",
    "get_task",
    "load_rows",
    "register_task",
    "score_rows",
    "split_question",
    "task_names",
    "task_rows",
    "unregister_task",
]
