"""The accuracy runner: every (context length, task, mode, policy, drop ratio) cell of registered tasks on one engine.

`run_tasks` is the one loop: per context length and task, `make_dataset(n, length, ...)` gives `n` examples, the same
for every mode and cell; per mode `run_cells` prefills each chunk once and, per cell of `build_cells` (`"full"`: no
edit, one cell at ratio 0), restores the prefilled caches (`Engine.snapshot` / `restore`), edits them (`modify`),
in the agnostic mode extends them with the question (prefill(context) -> modify -> extend(question) -> decode; aware:
prefill(prompt) -> modify -> decode), decodes greedily with EOS ignored and scores each answer (the text up to its
first EOS) with the task's scorer and a 95% Wilson interval. `task_eval` returns its rows (`TASK_COLUMNS`);
`passkey_eval` runs the passkey task in the layout of its own (`COLUMNS`: one row per length, policy and ratio).
Ratio 0 runs the policy's drop function too, so its row should equal the full cache's (docs/design.md §5).

Both entry points check their drop ratios once (`DropRatios`), then names, counts and the seed (`check_seed`; a
training seed with a bundled model is refused), and every policy's drop function is built before any work.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from ..compression import kl_per_step
from ..data import RULER_TASKS
from ..edit import make_drop_fn
from ..engines.base import Engine
from ..engines.hf import HFEngine
from ..models import RULER_MODEL_NAME, TINY_MODEL_NAME, resolve_model
from ..policies.reuse import shared_scores
from .common import DEV_SEED, FULL, TRAIN_SEED_BASE, DropRatios, check_seed, wilson_interval
from .tasks import MODES, PASSKEY, PASSKEY_DEFAULTS, RULER_DEFAULTS, WORD_DEFAULTS, Task, get_task, task_names
from .workers import WorkerPool, progress, shards, worker_cores

COLUMNS = ("policy", "drop_ratio", "context_tokens", "n", "correct", "accuracy", "ci_low", "ci_high", "modify_s",
           "kept_tokens", "scores", "answers")
TASK_COLUMNS = ("task", "mode", "policy", "drop_ratio", "context_length", "n", "correct", "accuracy", "ci_low",
                "ci_high", "partial", "kept_tokens", "modify_s", "max_tokens", "measure", "score", "scores",
                "answers")
# The defaults of the two entry points: those the passkey and word-level registrations give the command line.
DEFAULT_POLICIES = PASSKEY_DEFAULTS.policies
DEFAULT_DROP_RATIOS = PASSKEY_DEFAULTS.drop_ratios
DEFAULT_CONTEXT_LENGTHS = PASSKEY_DEFAULTS.context_lengths
DEFAULT_N = PASSKEY_DEFAULTS.n
TASKS = RULER_TASKS
DEFAULT_TASK_POLICIES = WORD_DEFAULTS.policies
DEFAULT_TASK_DROP_RATIOS = WORD_DEFAULTS.drop_ratios
DEFAULT_TASK_CONTEXT_LENGTHS = WORD_DEFAULTS.context_lengths
DEFAULT_REAL_DROP_RATIOS = RULER_DEFAULTS.drop_ratios
DEFAULT_REAL_CONTEXT_LENGTHS = RULER_DEFAULTS.context_lengths
DEFAULT_REAL_N = RULER_DEFAULTS.n
TASK_BATCH_SIZE = 25  # task_eval's prompts per prefill batch
# Bytes of edited KV caches (summed over requests) of the cells of one drop ratio decoded as one batch
# (`_cell_groups`; the decode's slot store holds as much again): 1 GiB is ~46k tokens of SmolLM2-135M's bfloat16
# cache (23 KiB per token), so 13 prompts x 10 policies decode in 4 batches at 0.5, 2 at 0.75 and 1 at 0.9
DECODE_GROUP_BYTES = 1 << 30


def passkey_eval(
    model=TINY_MODEL_NAME,
    policies: Sequence[str] = DEFAULT_POLICIES,
    drop_ratios: Sequence[float] = DEFAULT_DROP_RATIOS,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    *,
    n: int = 200,
    seed: int = DEV_SEED,
    max_tokens: int = 10,
    policy_params: Mapping[str, Mapping] | None = None,
    engine=None,
    batch_size: int = 50,
    device=None,
    dtype="auto",
    log: Callable[[str], None] | None = None,
    responses: dict | None = None,
    partial: list | None = None,
):
    """Exact-match passkey accuracy for every (policy, drop ratio, context length) cell (the `passkey` task).

    Args:
        model: bundled name (`"tiny-qwen3"`), hub id or local folder; ignored when `engine` is given.
        policies: `"full"` (no dropping) and/or registered policy names for `tdutils.make_drop_fn`
            (`tdutils.policies.policy_names()`, including policies a user registered in this process).
        drop_ratios: fractions dropped, each in [0, 1]; `"full"` ignores them (one row at 0).
        context_lengths: prompt lengths in tokens (`make_passkey_dataset` fills to exactly this many with
            the bundled tokenizer; never more).
        n: prompts per context length (the same prompts for every policy and ratio).
        seed: dataset seed, an integer >= 0 (`check_seed`); must be below `TRAIN_SEED_BASE` for the bundled model.
            `DEV_SEED` (default) for development, `HELDOUT_SEED` for published figures only
            (`tdutils.eval.common`, "Seeds").
        max_tokens: greedy decode tokens per request, EOS ignored (the answer is 5 tokens).
        policy_params: extra `make_drop_fn` keywords per policy, e.g. `{"snapkv": {"window": 32}}`.
        engine: an `HFEngine` to reuse (tests load the model once); else one is opened for `model`.
        batch_size: prompts prefilled and decoded together (bounds memory: each 2048-token request holds
            a ~2 MiB fp32 cache with the bundled model).
        device, dtype: for the engine opened here.
        log: called with one progress line per finished cell (e.g. `print`).
        responses: when a dict is given, filled with `{(policy, ratio, length): [answers]}`, each the decoded text
            up to its first EOS token (`RequestOutput.answer`), what is scored.
        partial: when a list is given, each cell's row (a dict of the table's columns) is appended to it as soon
            as the cell is scored, so a caller keeps the finished cells of a run stopped by KeyboardInterrupt.

    Returns:
        pandas DataFrame, one row per cell, in the order length → policy → ratio, with columns `policy`,
        `drop_ratio`, `context_tokens`, `n`, `correct`, `accuracy` (fraction in [0, 1]), `ci_low`,
        `ci_high` (95% Wilson), `modify_s` (seconds in `modify` for the cell's n requests; 0 for full),
        `kept_tokens` (mean KV tokens per request after modify), `scores` (`{"exact": [0/1 per prompt]}`, in the
        dataset's order: the same prompts in every cell, so two cells can be compared by a paired test), `answers`
        (the scored answer per prompt, the text up to its first EOS, in the same order).

    Raises:
        ValueError: no policies / ratios / lengths, a ratio outside [0, 1], `n < 1`, an unknown policy or
            parameter (from `make_drop_fn`), a negative seed, a training seed with the bundled model, or a
            context length too short for a passkey prompt.
    """
    return lengths_eval(PASSKEY, model, policies, drop_ratios, context_lengths, n=n, seed=seed, max_tokens=max_tokens,
                        policy_params=policy_params, engine=engine, batch_size=batch_size, device=device, dtype=dtype,
                        log=log, responses=responses, partial=partial, caller="passkey_eval")


def lengths_eval(task: str, model, policies: Sequence[str], drop_ratios: Sequence[float],
                 context_lengths: Sequence[int], *, n: int, seed: int, max_tokens: int | None,
                 policy_params: Mapping[str, Mapping] | None = None, engine=None, batch_size: int = 50, device=None,
                 dtype="auto", log: Callable[[str], None] | None = None, responses: dict | None = None,
                 partial: list | None = None, chat_template: str | bool = "auto", caller: str = "lengths_eval"):
    """`passkey_eval` for any registered `task`, aware mode: one `COLUMNS` row per (length, policy, ratio); the
    layout `"lengths"` of `tdutils.eval.tasks.Defaults`. `max_tokens` None: the task's own. Arguments, returns and
    errors as `passkey_eval` (`caller` names the function in the message for empty lists)."""
    import pandas as pd

    spec = get_task(task)
    policies, lengths = list(policies), [int(x) for x in context_lengths]
    ratios = DropRatios(drop_ratios)
    if not policies or not ratios or not lengths:
        raise ValueError(f"{caller} needs at least one policy, one drop ratio and one context length")
    for name, value in (("n", n), ("batch_size", batch_size), ("max_tokens", 1 if max_tokens is None else max_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    params = {k: dict(v) for k, v in (policy_params or {}).items()}
    engine = _open_engine(engine, model, seed, device=device, dtype=dtype)
    max_pos = getattr(engine.config, "max_position_embeddings", None)
    if max_tokens is not None and max_pos and max(lengths) + max_tokens > max_pos:
        raise ValueError(f"context length {max(lengths)} + max_tokens {max_tokens} exceeds the model's {max_pos} "
                         f"positions (max_position_embeddings); use shorter context lengths")
    cells = build_cells(engine, policies, ratios, params)
    rows: list[dict] = []

    def cell(row, texts):
        rows.append({"policy": row["policy"], "drop_ratio": row["drop_ratio"], "context_tokens": row["context_length"],
                     **{c: row.get(c) for c in ("n", "correct", "accuracy", "ci_low", "ci_high", "modify_s",
                                            "kept_tokens", "scores", "answers")}})
        if partial is not None:
            partial.append(rows[-1])
        if responses is not None:
            responses[row["policy"], row["drop_ratio"], row["context_length"]] = list(texts)
        if log is not None:
            c, low, high = row["correct"], row["ci_low"], row["ci_high"]
            log(f"{row['context_length']:>6} tokens  {row['policy']:>12} @ {row['drop_ratio']:<4g}  {c:>4}/{n}  "
                f"({100 * c / n:5.1f}%, 95% CI {100 * low:.1f}-{100 * high:.1f})")

    def group(cells_rows, seconds, together=()):  # one mode: seconds never None
        if log is not None:
            log(f"{cells_rows[0]['context_length']:>6} tokens done in {seconds:.1f} s")

    run_tasks(engine, [spec], ["aware"], cells, lengths, n=n, seed=seed, max_tokens=max_tokens, batch_size=batch_size,
              chat_template=chat_template, on_cell=cell, on_group=group)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def task_eval(
    model=RULER_MODEL_NAME,
    tasks: Sequence[str] = TASKS,
    modes: Sequence[str] = MODES,
    policies: Sequence[str] = DEFAULT_TASK_POLICIES,
    drop_ratios: Sequence[float] = DEFAULT_TASK_DROP_RATIOS,
    context_lengths: Sequence[int] = DEFAULT_TASK_CONTEXT_LENGTHS,
    *,
    n: int | Mapping[str, int] = 200, seed: int = DEV_SEED, max_tokens: int | None = None,
    policy_params: Mapping[str, Mapping] | None = None, chat_template: str | bool = "auto",
    engine=None, batch_size: int = TASK_BATCH_SIZE, device=None, dtype="auto",
    log: Callable[[str], None] | None = None, responses: dict | None = None, partial: list | None = None,
    done: Sequence[Mapping] | None = None, progress: bool = False, stop_at_eos: bool = True,
    checkpoint: Callable[[], None] | None = None, workers: int = 1, worker_threads: int | None = None,
):
    """Exact match on registered tasks (Hsieh et al., "RULER", arXiv:2404.06654; `tdutils.eval.tasks`) for every
    (task, mode, context length, policy, drop ratio) cell — the query-aware and query-agnostic leaderboard.

    Per context length and task, `make_dataset(n, length, ...)` gives `n` examples, the same for every mode and cell.
    `"aware"`: prefill(prompt) -> modify -> decode (the question is in the observation window at the edit);
    `"agnostic"`: prefill(context) -> modify -> extend(question) -> decode (kvpress' query-agnostic setting; the same
    token sequence). Greedy answers are scored by `Task.score` (as `python -m tdutils run --dataset NAME`).

    Args:
        model: a bundled name (default `"tiny-qwen3-ruler"`), packaged real model, `.gguf`, hub id or folder;
            ignored when `engine` (an `HFEngine`, or any engine with `extend` for the agnostic mode) is given.
        tasks, modes: registered task names (`task_names()`) and `"aware"` / `"agnostic"`.
        policies, drop_ratios, context_lengths: `"full"` and/or registered policies (optionally `/layer`,
            `/head`), fractions in [0, 1], prompt lengths in tokens (context and question together).
        n, seed: examples per (task, length), one count or `{task: count}` naming every task (each row keeps its
            own `n`), and the dataset seed (`check_seed`; below `TRAIN_SEED_BASE` for a bundled model).
        max_tokens: greedy decode tokens per request; None: each task's own `Task.max_tokens`.
        policy_params: extra `make_drop_fn` keywords per policy, e.g. `{"snapkv": {"window": 32}}`.
        batch_size, device, dtype: examples prefilled together; the engine opened here.
        log: one progress line per finished (task, mode, length) group; `progress`: a tqdm bar with an ETA.
        responses: a dict filled with `{(task, mode, policy, ratio, length): [answers]}` (text up to the first EOS).
        chat_template: `"auto"` / `"none"` for tasks whose prompts take the tokenizer's chat template.
        partial: a list each cell's row is appended to as soon as it is scored (kept on KeyboardInterrupt).
        done: rows of a stored run of the same grid, not run again (`run_tasks`); rows need per-prompt `scores`.
        stop_at_eos: a request leaves the decode batch at its first EOS (the scored answers are the same).
        checkpoint: called after each (length, task, mode) group that ran.
        workers, worker_threads: worker processes sharing each task's prompts and torch threads per worker
            (`_run_on_workers`; `model` must then be a name); 1 worker runs everything here.

    Returns:
        pandas DataFrame, one row per cell (length -> task -> mode -> policy -> ratio), `TASK_COLUMNS`: `correct`,
        `accuracy`, `ci_low`, `ci_high` (95% Wilson; NaN for a teacher-forced task), `partial`, `kept_tokens` (mean
        KV tokens per request at decode), `modify_s`, `max_tokens`, `measure`, `score`, `scores` (`{measure: [per
        example]}`, what `tdutils.eval.statistics` pairs), `answers` (per example, up to its first EOS; None when
        teacher-forced).

    Raises:
        ValueError: see `check_task_grid` and `prepare_cells` (empty lists, unknown names, a mode a task cannot
            run in, bad counts or seeds, a length too short for a task or too long for the model); bad workers.
    """
    import pandas as pd

    _check_workers(workers, worker_threads)
    policies = list(policies)
    specs, modes, lengths, ratios, done = check_task_grid(tasks, modes, policies, drop_ratios, context_lengths, done,
                                                          n=n, batch_size=batch_size, max_tokens=max_tokens)
    n = task_counts(n, [t.name for t in specs])
    engine = _open_engine(engine, model, seed, device=device, dtype=dtype)
    cells = prepare_cells(engine, specs, modes, policies, ratios, lengths, policy_params, seed=seed,
                          chat_template=chat_template)
    cell, group = _task_callbacks(partial, responses, log, checkpoint)
    job = dict(n=n, seed=seed, max_tokens=max_tokens, batch_size=batch_size, chat_template=chat_template,
               on_cell=cell, on_group=group, done={cell_key(r): dict(r) for r in done}, progress=progress,
               stop_at_eos=stop_at_eos)
    if workers == 1:
        rows = run_tasks(engine, specs, modes, cells, lengths, **job)
    else:
        rows = _run_on_workers(engine, model, workers, worker_threads, (seed, policies, ratios, policy_params),
                               specs, modes, cells, lengths, job)
    return pd.DataFrame(rows, columns=list(TASK_COLUMNS))


def _check_workers(workers, worker_threads) -> None:
    for name, value in (("workers", workers), ("worker_threads", 1 if worker_threads is None else worker_threads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _run_on_workers(engine, model, workers: int, worker_threads: int | None, setup: tuple, specs, modes, cells,
                    lengths, job: dict) -> list[dict]:
    """`run_tasks` with a `WorkerPool` (`tdutils.eval.workers`) of `workers` spawned processes: each opens `model`
    (a name) in `engine`'s dtype with `setup` = `(seed, policies, ratios, policy_params)`, runs `worker_threads` torch
    threads (default: this process's divided among the workers, at least 1) on cores of its own where there are
    enough (`worker_cores`), in batches of `batch_size / workers` rounded up (the prompts in flight, and so the
    memory, of one process). Spawned workers import the main module: from a script, call `task_eval` under
    `if __name__ == "__main__":`. Returns the rows.

    Raises:
        ValueError: `model` is not a name (an engine's model object cannot be reopened in a worker).
    """
    import torch

    if not isinstance(model, str):
        raise ValueError("workers > 1 reopens the model in each worker process by its name: give task_eval a "
                         "model name (a bundled or packaged name, hub id, folder or .gguf), not a model object")
    threads = worker_threads or max(1, torch.get_num_threads() // workers)
    seed, policies, ratios, params = setup  # plain types: they are pickled to the spawned workers
    setup = (seed, list(policies), [float(r) for r in ratios], {k: dict(v) for k, v in (params or {}).items()})
    dtype, device = str(engine.model.dtype).removeprefix("torch."), str(engine.device)  # the workers' as the engine's
    # each worker holds its own batch of caches and snapshots: batches of batch_size / workers keep the prompts in
    # flight, and so the memory, those of one process (two workers at 25 prompts each of 2048 tokens: one was
    # killed for memory at 12.8 GB on a 24 GB machine)
    job = {**job, "batch_size": -(-job["batch_size"] // workers)}
    with WorkerPool(workers, _worker_init, (model, dtype, device, threads, *setup),
                    cores=worker_cores(workers, threads)) as pool:
        return run_tasks(engine, specs, modes, cells, lengths, pool=pool, **job)


def check_task_grid(tasks, modes, policies, drop_ratios, context_lengths, done, *, n: int | Mapping[str, int],
                    batch_size: int, max_tokens: int | None):
    """`task_eval`'s checks that need no model: `(specs, modes, lengths, DropRatios, done rows)`.

    Raises:
        ValueError: no tasks / modes / policies / ratios / lengths, one listed twice, an unknown task or mode, the agnostic mode for a
            task without a context/question split, a teacher-forced task with the aware mode alone, `done` rows
            without per-prompt scores, a ratio outside [0, 1], or `n` (each task's), `batch_size`, `max_tokens`
            below 1, or an `n` mapping that lacks a task.
    """
    tasks, modes = list(tasks), list(modes)
    lengths = [int(x) for x in context_lengths]
    ratios = DropRatios(drop_ratios)
    if not (tasks and modes and policies and ratios and lengths):
        raise ValueError("task_eval needs at least one task, mode, policy, drop ratio and context length")
    # "snapkv/request" is "snapkv": one policy under two spellings would run one cell twice
    labels = [p if split_granularity(p)[1] != "request" else split_granularity(p)[0] for p in policies]
    for what, values in (("tasks", tasks), ("modes", modes), ("policies", labels),
                         ("drop ratios", [float(r) for r in ratios]), ("context lengths", lengths)):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # a cell run twice would be stored twice and counted twice
            raise ValueError(f"the {what} list {', '.join(twice)} more than once; give each once")
    bad = [t for t in tasks if t not in task_names()]
    if bad:
        raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(task_names())}")
    specs = [get_task(t) for t in tasks]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    aware_only = [t.name for t in specs if t.split is None and not t.teacher_forced]
    if "agnostic" in modes and aware_only:
        raise ValueError(f"task(s) {aware_only} have no context/question split, so they run in aware mode only "
                         f"(use modes=('aware',))")
    forced_only = [t.name for t in specs if not task_modes(t, modes)]
    if forced_only:
        raise ValueError(f"task(s) {forced_only} are teacher-forced and run in the agnostic mode only (the cache is "
                         f"edited before the continuation is seen); add it (modes=('aware', 'agnostic'))")
    done = list(done or [])
    if any(not isinstance(r.get("scores"), Mapping) for r in done):
        raise ValueError("the stored rows to resume from keep no per-prompt scores (a run of an older tdutils); "
                         "start the run afresh")
    task_counts(n, tasks)
    for name, value in (("batch_size", batch_size), ("max_tokens", 1 if max_tokens is None else max_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return specs, modes, lengths, ratios, done


def task_counts(n: int | Mapping[str, int], tasks: Sequence[str]) -> int | dict[str, int]:
    """`n` checked for `tasks`: an int >= 1 as it is; a mapping as `{task: n}` in `tasks` order, or the one int
    they all share (what a run's JSON `meta.n` stores).

    Raises:
        ValueError: a count below 1, or a mapping without one of `tasks`.
    """
    if isinstance(n, Mapping):
        missing = [t for t in tasks if t not in n]
        if missing:
            raise ValueError(f"n gives no count for task(s) {missing}; give an int or one per task")
        per = {t: int(n[t]) for t in tasks}
        bad = {t: k for t, k in per.items() if k < 1}
        if bad:
            raise ValueError(f"n must be >= 1 for every task, got {bad}")
        return next(iter(per.values())) if len(set(per.values())) == 1 else per
    if int(n) < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return int(n)


def task_n(n: int | Mapping[str, int], task: str) -> int:
    """The count of `task` in `n` (an int: every task's)."""
    return int(n[task]) if isinstance(n, Mapping) else int(n)


def grid_size(tasks: Sequence[Task], modes: Sequence[str], cells: int, lengths: Sequence[int],
              n: int | Mapping[str, int], batch_size: int) -> dict[str, int]:
    """What `run_tasks` does for a whole grid on an engine with `snapshot` / `extend` (`HFEngine`): `cells`, every
    (length, task, mode, cell) with `cells` policy/ratio cells per (length, task, mode); `prompts` prefilled, each
    (length, task)'s once for all its cells and modes (`run_cells_shared` prefills the context and extends it with
    the question for the aware cells); `batches`, the prefill calls of at most `batch_size` prompts."""
    out = {"cells": 0, "prompts": 0, "batches": 0}
    for task in tasks:
        k = task_n(n, task.name)
        out["cells"] += len(lengths) * len(task_modes(task, modes)) * cells
        out["prompts"] += len(lengths) * k
        out["batches"] += len(lengths) * math.ceil(k / batch_size)
    return out


def prepare_cells(engine, specs, modes, policies, ratios, lengths, policy_params, *, seed: int, chat_template):
    """`task_eval`'s checks against the open engine, then its cells (`build_cells`: every drop function built
    before any work).

    Raises:
        ValueError: the agnostic mode on an engine without `extend`, a length the model cannot decode after, a
            length too short for a task (one example is made at the shortest length first), or a bad policy.
    """
    if "agnostic" in modes and not callable(getattr(engine, "extend", None)):
        raise ValueError(f"the query-agnostic mode needs an engine with extend(); {type(engine).__name__} has none "
                         f"(use modes=('aware',))")
    params = {k: dict(v) for k, v in (policy_params or {}).items()}
    cells = build_cells(engine, policies, ratios, params)
    max_pos = getattr(engine.config, "max_position_embeddings", None)
    too_long = [x for x in lengths if max_pos and x >= max_pos]
    if too_long:  # before any prompt is made (a 100k-token prompt takes a while to build)
        raise ValueError(f"context length(s) {too_long} leave no room to decode within the model's {max_pos} positions "
                         f"(max_position_embeddings); use shorter context lengths")
    # Every (task, length) must fit before the first cell runs (a too-short length would fail mid-run).
    for spec in specs:
        try:
            spec.make_dataset(1, min(lengths), engine.tokenizer, seed, chat_template)
        except ValueError as exc:
            raise ValueError(f"{exc}; raise the shortest context length (context_lengths / --context-lengths)") from None
    return cells


def _task_callbacks(partial, responses, log, checkpoint):
    """`(on_cell, on_group)` for `run_tasks`: keep each scored cell (`partial`, `responses`), log and checkpoint
    each finished group."""

    def cell(row, texts):
        if partial is not None:
            partial.append(row)
        if responses is not None:
            responses[row["task"], row["mode"], row["policy"], row["drop_ratio"], row["context_length"]] = list(texts)

    def group(rows, seconds, together=()):
        if log is not None:
            summary = ", ".join(f"{r['policy']}@{r['drop_ratio']:g} {_score_text(r)}" for r in rows)
            if seconds is None:  # computed in the pass of an earlier group (`run_cells_shared`)
                took = f"computed with the {together[0]} cells above"
            else:
                took = f"{seconds:.1f} s" + (f", the {' and '.join(together)} cells together" if together else "")
            log(f"{rows[0]['context_length']:>6} tokens {rows[0]['task']:>17} {rows[0]['mode']:>8}: {summary} "
                f"({took})")
        if checkpoint is not None:
            checkpoint()

    return cell, group


def _score_text(row: Mapping) -> str:
    """A cell's score for a log line: exact match in percent, or the measure's mean."""
    if row.get("measure", "exact") == "exact":
        return f"{100 * row['accuracy']:.0f}%"
    return f"{row['measure']} {row['score']:.3g}"


def cell_key(row: Mapping) -> tuple:
    """`(context_length, task, mode, policy, drop_ratio)`: what names a cell across runs (resuming a stored run)."""
    return int(row["context_length"]), str(row["task"]), str(row["mode"]), str(row["policy"]), float(row["drop_ratio"])


def task_modes(task: Task, modes: Sequence[str]) -> list[str]:
    """The modes of `modes` that `task` runs in: a teacher-forced task in the agnostic mode only (its continuation
    is never in the prompt when the cache is edited)."""
    return [m for m in modes if not task.teacher_forced or m == "agnostic"]


def run_tasks(engine, tasks: Sequence[Task], modes: Sequence[str], cells: Sequence[tuple], lengths: Sequence[int], *,
              n: int | Mapping[str, int], seed: int, max_tokens: int | None, batch_size: int,
              chat_template: str | bool = "auto",
              on_cell: Callable[[dict, list], None] | None = None,
              on_group: Callable[[list[dict], float | None, list[str]], None] | None = None, done: Mapping[tuple, dict] | None = None,
              progress: bool = False, stop_at_eos: bool = True, pool=None) -> list[dict]:
    """The benchmark loop: every (length, task, mode, cell) on `engine`, scored, in that order; nothing is checked
    here but that each length leaves room for the decode (the entry points check the rest first). With `pool` (a
    `tdutils.eval.workers.WorkerPool`) each (length, task)'s cells run in its worker processes, the datasets,
    scoring, callbacks and progress bar staying here.

    Args:
        tasks: registered `Task`s; modes: `"aware"` / `"agnostic"` (the latter needs `Task.split`; a teacher-forced
            task runs in the agnostic mode only, `task_modes`).
        cells: `(policy, ratio, drop_fn or None)` from `build_cells`.
        n, seed, chat_template: for each task's `make_dataset` (`n`: one count, or `{task: count}`); max_tokens:
            decode tokens (None: `Task.max_tokens`).
        on_cell: called with each new cell's row and its answers (a teacher-forced task: no answers) once scored.
        on_group: called as `on_group(rows, seconds, together)` for each (length, task, mode): its rows, the seconds
            they took (datasets excluded), and the modes computed in one pass with it (`run_cells_shared`; empty
            when none): the first of those carries the pass's seconds, the others None.
        done: rows already scored, by `cell_key` (a resumed run): those cells are not run again and their rows
            are returned in their place; a group whose cells are all done is skipped whole.
        progress: show a progress bar over the cells with an ETA (tqdm, on stderr).
        stop_at_eos: a request leaves the decode batch at its first EOS token (what follows is never scored);
            False decodes every request to `max_tokens` (the answers are the same either way).

    Returns:
        The rows, one dict of `TASK_COLUMNS` per cell.

    Raises:
        ValueError: a length plus the decode tokens past the model's positions; a dataset maker's ValueError.
    """
    from tqdm.auto import tqdm

    done = dict(done or {})
    total = len(lengths) * sum(len(task_modes(t, modes)) for t in tasks) * len(cells)
    rows: list[dict] = []
    job = {"n": n, "seed": seed, "max_tokens": max_tokens, "batch_size": batch_size, "chat_template": chat_template,
           "stop_at_eos": stop_at_eos, "on_cell": on_cell, "on_group": on_group, "pool": pool}
    with tqdm(total=total, unit="cell", disable=not progress, dynamic_ncols=True, desc="eval",
              bar_format="{l_bar}{bar}| {n:.1f}/{total} cells [{elapsed}<{remaining}]") as bar:
        for length in lengths:
            for task in tasks:
                rows += _run_task(engine, task, task_modes(task, modes), cells, length, done, bar,
                                  **{**job, "n": task_n(n, task.name)})
    return rows


def _run_task(engine, task: Task, modes: Sequence[str], cells: Sequence[tuple], length: int, done: Mapping, bar, *,
              n: int, seed: int, max_tokens: int | None, batch_size: int, chat_template, stop_at_eos: bool,
              on_cell, on_group, pool=None) -> list[dict]:
    """`run_tasks` for one (length, task): its dataset (made only when a cell is still to run), the cells of each
    mode not in `done`, one prefill per chunk for both modes where they share it (`run_cells_shared`), the rows."""
    tok = engine.tokenizer
    todo = {m: [c for c in cells if (length, task.name, m, c[0], float(c[1])) not in done] for m in modes}
    data = decode_tokens = None
    if any(todo.values()):
        data = task.make_dataset(n, length, tok, seed, chat_template)
        decode_tokens = task.max_tokens(data, tok) if max_tokens is None else int(max_tokens)
        max_pos = getattr(engine.config, "max_position_embeddings", None)
        if max_pos and length + decode_tokens > max_pos:
            raise ValueError(f"context length {length} + {decode_tokens} decode tokens exceeds the model's {max_pos} "
                             f"positions (max_position_embeddings); use shorter context lengths")
    shared = {}
    ticked: dict[tuple, float] = {}  # (mode, policy, ratio) -> the fraction of its prompts done so far

    def tick(mode, policy, r, fraction):  # the bar moves per chunk of prompts, not only when a whole cell ends
        ticked[mode, policy, r] = ticked.get((mode, policy, r), 0.0) + fraction
        bar.update(fraction)

    t0 = time.perf_counter()
    if pool is not None and any(todo.values()):
        keys = {m: [(p, float(r)) for p, r, _ in c] for m, c in todo.items() if c}
        calls = [(task.name, list(data[a:b]), keys, decode_tokens, batch_size, stop_at_eos, (b - a) / len(data))
                 for a, b in shards(len(data), pool.workers)]
        shared = _merge_shards(pool.map(_worker_cells, calls, on_progress=tick))
    elif all(todo.get(m) for m in MODES) and not task.teacher_forced and _snapshot_capable(engine):
        contexts, questions = zip(*(task.split(tok, d) for d in data))
        shared = run_cells_shared(engine, contexts, questions, todo, max_tokens=decode_tokens, batch_size=batch_size,
                                  stop_at_eos=stop_at_eos, tick=tick)
    rows = []
    together = [m for m in modes if todo[m] and m in shared] if len(shared) > 1 else []  # computed in one pass
    for mode in modes:
        bar.update(len(cells) - len(todo[mode]))
        new: dict = {}
        if todo[mode]:
            head = {"task": task.name, "mode": mode, "context_length": length, "n": n, "max_tokens": decode_tokens}

            def scored(policy, r, row, texts, head=head, new=new, mode=mode):
                new[policy, r] = row = {**head, "policy": policy, "drop_ratio": r, **row}
                bar.update(max(0.0, 1.0 - ticked.get((mode, policy, r), 0.0)))
                if on_cell is not None:
                    on_cell(row, texts)

            _run_group(engine, task, mode, data, todo[mode], decode_tokens, batch_size, stop_at_eos, scored,
                       shared.get(mode), partial(tick, mode))
        group = [new.get((p, r)) or done[length, task.name, mode, p, float(r)] for p, r, _ in cells]
        group = [{c: row.get(c) for c in TASK_COLUMNS} for row in group]
        rows += group
        if on_group is not None and new:
            # modes computed together: the first group's seconds are the pass's, the others' are in them
            first = not together or mode == together[0]
            on_group(group, time.perf_counter() - t0 if first else None, together)
        t0 = time.perf_counter()
    return rows


def _run_group(engine, task: Task, mode: str, data: Sequence[Mapping], cells: Sequence[tuple], decode_tokens: int,
               batch_size: int, stop_at_eos: bool, scored: Callable, generated: tuple | None = None,
               tick: Callable | None = None) -> None:
    """Run `cells` of one (length, task, mode) on `data` (or score `generated`, what `run_cells` returned for them)
    and call `scored(policy, ratio, row, answers)` per cell, `row` holding the columns that depend on the cell
    (`cell_row`); `tick(policy, ratio, fraction)` after each chunk of prompts a cell finishes."""
    tok, n = engine.tokenizer, len(data)
    prompts = [d.get("prompt_ids", d.get("prompt")) for d in data]
    if task.teacher_forced:
        def forced(policy, r, per, modify_s, kept):
            scored(policy, r, cell_row(task.measure, per, modify_s, kept / n), [])

        if generated is None:
            run_forced_cells(engine, prompts, [d["continuation"] for d in data], cells, batch_size=batch_size,
                             on_cell=forced, tick=tick)
        else:  # `WorkerPool.generate`'s merged measures
            per, modify_s, kept = generated
            for policy, r, _ in cells:
                forced(policy, r, per[policy, r], modify_s[policy, r], kept[policy, r])
        return
    extensions = None
    if mode == "agnostic":
        prompts, extensions = zip(*(task.split(tok, d) for d in data))
    if generated is None:
        generated = run_cells(engine, prompts, cells, max_tokens=decode_tokens, batch_size=batch_size,
                              extensions=extensions, stop_at_eos=stop_at_eos, tick=tick)
    texts, modify_s, kept = generated
    for policy, r, _ in cells:
        marks = [task.score(d["values"], t) for d, t in zip(data, texts[policy, r])]
        per = {"exact": [float(e) for e, _ in marks], "partial": [float(p) for _, p in marks]}
        row = cell_row(task.measure, per, modify_s[policy, r], kept[policy, r] / n)
        scored(policy, r, {**row, "answers": list(texts[policy, r])}, texts[policy, r])


def cell_row(measure: str, per: Mapping[str, list], modify_s: float, kept_tokens: float) -> dict:
    """The columns of a cell's row that come from its per-prompt scores `per` (`{measure: [one per prompt]}`):
    `correct`, `accuracy`, `ci_low`, `ci_high` (95% Wilson) and `partial` from `per["exact"]` / `per["partial"]`
    (NaN for a teacher-forced task, which has neither), `measure`, `score` (mean of `per[measure]`), `scores`
    (`per` itself: what a paired test reads), `kept_tokens`, `modify_s`."""
    n = len(next(iter(per.values())))
    if "exact" in per:
        correct = int(sum(per["exact"]))
        low, high = wilson_interval(correct, n)
        counts = {"correct": correct, "accuracy": correct / n, "ci_low": low, "ci_high": high,
                  "partial": sum(per["partial"]) / n}
    else:
        counts = dict.fromkeys(("correct", "accuracy", "ci_low", "ci_high", "partial"), math.nan)
    return {**counts, "kept_tokens": kept_tokens, "modify_s": modify_s, "measure": measure,
            "score": sum(per[measure]) / n, "scores": {k: list(v) for k, v in per.items()}}


def _open_engine(engine, model, seed: int, *, device=None, dtype="auto"):
    """`engine`, or an `HFEngine` opened for `model` (no progress bars, query capture off until `build_cells`
    widens it); refuses a negative seed (`check_seed`) and a training seed with a bundled model."""
    seed = check_seed(seed)
    name = model if engine is None else getattr(engine, "model_name", None)
    if isinstance(name, str) and resolve_model(name, check=False).kind == "bundled" and seed >= TRAIN_SEED_BASE:
        raise ValueError(f"seed {seed} is a training stream of the bundled model {name!r} (>= {TRAIN_SEED_BASE}); "
                         f"evaluate with a seed below it")
    if engine is not None:
        return engine

    return HFEngine(model, device=device, dtype=dtype, kv_budget_tokens=None, prefill_batch_size=8,
                    query_window=0, progress=False)


def split_granularity(label: str) -> tuple[str, str]:
    """A policy label of a cell: `"snapkv"` -> `("snapkv", "request")`, `"snapkv/head"` -> `("snapkv", "head")`
    (the granularity dimension of the cells: docs/policies.md, "Granularity")."""
    name, _, granularity = str(label).partition("/")
    return name, granularity or "request"


def build_cells(engine, policies: Sequence[str], ratios: Sequence[float], params: Mapping[str, Mapping]) -> list:
    """Every `(policy, drop ratio, drop function)` cell (`"full"`: one cell at ratio 0 with no function), built
    before any work so that a bad name or parameter fails fast; widens the engine's query capture to what the
    policies read (none, a window, or all queries for H2O). A policy given as `name/layer` or `name/head` is a
    cell of that granularity (`split_granularity`), with the parameters of `name`."""
    cells: list[tuple[str, float, object]] = []
    for policy in policies:
        if policy == FULL:
            cells.append((FULL, 0.0, None))
            continue
        name, granularity = split_granularity(policy)
        for r in ratios:
            cells.append((policy, r, make_drop_fn(name, drop_ratio=r, model_config=engine.facts,
                                                  granularity=granularity,
                                                  **params.get(policy, params.get(name, {})))))
    if hasattr(engine, "capture_for"):
        engine.capture_for(*(fn for _, _, fn in cells))
    return cells


# ---------------------------------------------------------------------------------------- worker processes
# `task_eval(workers=N)`: each worker process opens its own engine and cells once (`_worker_init`), then runs the
# cells of one shard of a group's prompts per call (`_worker_cells`); the parent merges the shards (`_merge_shards`)
# and scores them as it scores its own.
_WORKER: dict = {}


def _worker_init(model: str, dtype: str, device: str, threads: int, seed: int, policies: list, ratios: list,
                 params: dict):
    import torch

    torch.set_num_threads(threads)
    engine = _open_engine(None, model, seed, dtype=dtype, device=device)
    _WORKER["engine"] = engine
    with warnings.catch_warnings():  # the parent built the same cells and showed their warnings once
        warnings.simplefilter("ignore")
        cells = build_cells(engine, policies, ratios, params)
    _WORKER["cells"] = {(p, float(r)): (p, r, fn) for p, r, fn in cells}


def _worker_cells(task_name: str, data: list, keys: dict, decode_tokens: int, batch_size: int, stop_at_eos: bool,
                  weight: float) -> dict[str, tuple]:
    """One shard in a worker: `generate_cells` on its engine; its progress scaled to the whole group (`weight`: the
    shard's share of the prompts) and sent to the parent's bar."""
    todo = {m: [_WORKER["cells"][k] for k in ks] for m, ks in keys.items()}
    return generate_cells(_WORKER["engine"], get_task(task_name), data, todo, decode_tokens=decode_tokens,
                          batch_size=batch_size, stop_at_eos=stop_at_eos,
                          tick=lambda mode, policy, r, fraction: progress(mode, policy, r, fraction * weight))


def _merge_shards(parts: list[dict]) -> dict[str, tuple]:
    """The shards' `{mode: (results, modify_s, kept)}` (`generate_cells`) as one, shards in prompt order: answers
    concatenated (a teacher-forced task's per-prompt measures per measure), seconds and kept tokens summed."""
    out = {}
    for mode in parts[0]:
        results, modify_s, kept = parts[0][mode]
        for part in parts[1:]:
            more, secs, rows = part[mode]
            for key, value in more.items():
                if isinstance(value, Mapping):  # teacher-forced: {measure: [per prompt]}
                    results[key] = {m: results[key][m] + xs for m, xs in value.items()}
                else:
                    results[key] = results[key] + value
                modify_s[key] += secs[key]
                kept[key] += rows[key]
        out[mode] = (results, modify_s, kept)
    return out


def generate_cells(engine, task: Task, data: Sequence[Mapping], todo: Mapping[str, Sequence[tuple]], *,
                   decode_tokens: int, batch_size: int, stop_at_eos: bool,
                   tick: Callable | None = None) -> dict[str, tuple]:
    """The raw results of every cell of `todo` (`{mode: [(policy, ratio, drop_fn)]}`) on `data`, unscored: for a
    teacher-forced task `run_forced_cells`' per-prompt measures, else `run_cells_shared` (both modes from one
    prefill) or `run_cells` per mode. `tick(mode, policy, ratio, fraction)` after each chunk of prompts.

    Returns:
        `{mode: (results, modify_s, kept)}`: `results` as `run_cells` gives answers, or for a teacher-forced task
        `run_forced_cells`' `{(policy, ratio): {measure: [per prompt]}}`; `modify_s` and `kept` per cell.
    """
    def mode_tick(mode):
        return None if tick is None else partial(tick, mode)

    tok = engine.tokenizer
    prompts = [d.get("prompt_ids", d.get("prompt")) for d in data]
    todo = {m: list(c) for m, c in todo.items() if c}
    out = {}
    if task.teacher_forced:
        for mode, cells in todo.items():
            modify_s, kept = {}, {}

            def keep(policy, r, per, secs, rows, modify_s=modify_s, kept=kept):
                modify_s[policy, r], kept[policy, r] = secs, rows

            per = run_forced_cells(engine, prompts, [d["continuation"] for d in data], cells, batch_size=batch_size,
                                   on_cell=keep, tick=mode_tick(mode))
            out[mode] = (per, modify_s, kept)
        return out
    if all(todo.get(m) for m in MODES):
        contexts, questions = zip(*(task.split(tok, d) for d in data))
        return run_cells_shared(engine, contexts, questions, todo, max_tokens=decode_tokens, batch_size=batch_size,
                                stop_at_eos=stop_at_eos, tick=tick)
    for mode, cells in todo.items():
        inputs, extensions = prompts, None
        if mode == "agnostic":
            inputs, extensions = zip(*(task.split(tok, d) for d in data))
        out[mode] = run_cells(engine, inputs, cells, max_tokens=decode_tokens, batch_size=batch_size,
                              extensions=extensions, stop_at_eos=stop_at_eos, tick=mode_tick(mode))
    return out


def run_cells(engine, prompts: Sequence, cells: Sequence[tuple], *, max_tokens: int, batch_size: int,
              extensions: Sequence | None = None, stop_at_eos: bool = True,
              tick: Callable | None = None, group_bytes: int = DECODE_GROUP_BYTES) -> tuple[dict, dict, dict]:
    """Greedy responses of every cell on the same prompts: each chunk of `batch_size` prompts is prefilled once,
    then per cell the prefilled caches are restored, edited with the cell's drop function (`modify`; none for
    the full cache), extended with `extensions` when given (`extend`, the query-agnostic flow: the edit never
    saw them) and decoded greedily, at most `max_tokens` tokens; with `stop_at_eos` (default) a request leaves the
    batch at its first EOS token, else it decodes all `max_tokens` (EOS ignored). Each response is its answer, the
    text up to its first EOS token, so what follows an EOS is never scored and both give the same answers. On an
    engine that holds its caches (`restores_prefill`: `HFEngine`) the cells of one drop ratio decode as one batch of
    their edited caches, up to `group_bytes` of KV cache (0: one cell at a time); a request's greedy tokens do not
    depend on the rows beside it, up to the float rounding of a wider matrix product.

    Args:
        engine: an open engine (`HFEngine` restores its prefilled state per cell; others prefill again).
        prompts: what `prefill` takes (strings, dicts with `prompt`, token-id lists).
        cells: `(policy, ratio, drop_fn or None)` from `build_cells`.
        extensions: None, or one extension (text or token ids) per prompt.
        tick: called as `tick(policy, ratio, fraction)` each time a cell finishes a chunk (`fraction` of the prompts).

    Returns:
        `(texts, modify_s, kept)`, dicts keyed by `(policy, ratio)`: answers (`RequestOutput.answer`: decoded up
        to the first EOS token) in prompt order, seconds in `modify` summed over chunks (a policy's scores are
        computed at its first ratio of a chunk and reused at the others, `tdutils.policies.reuse`, so the first
        ratio's cell holds the scoring), and KV tokens per request at decode summed over requests (cache after the
        edit, extension included).
    """
    out = _results(cells)
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        engine.prefill(chunk)
        ext = None if extensions is None else list(extensions[start:start + batch_size])
        _decode_cells(engine, _snapshot(engine), chunk, cells, ext, max_tokens, stop_at_eos, out,
                      _chunk_tick(tick, len(chunk) / len(prompts)), group_bytes)
    return out


def run_cells_shared(engine, contexts: Sequence, questions: Sequence, cells: Mapping[str, Sequence[tuple]], *,
                     max_tokens: int, batch_size: int, stop_at_eos: bool = True,
                     tick: Callable | None = None, group_bytes: int = DECODE_GROUP_BYTES) -> dict[str, tuple]:
    """`run_cells` of both modes from one prefill per chunk: prefill(context) is the agnostic cells' start, and
    extending it with the question (`extend`) gives the aware cells' start, the cache of prefill(context +
    question) with the question's queries captured (`HFEngine.extend` on an unedited request), so each prompt's
    context is prefilled once for every cell of both modes instead of once per mode.

    Args:
        contexts, questions: token ids per prompt (`Task.split`); together the aware prompt.
        cells: `{"aware": [...], "agnostic": [...]}`, `(policy, ratio, drop_fn or None)` each.
        tick: called as `tick(mode, policy, ratio, fraction)` each time a cell finishes a chunk.
        group_bytes: as in `run_cells`.

    Returns:
        `{mode: (texts, modify_s, kept)}` as `run_cells` returns them.
    """
    out = {mode: _results(c) for mode, c in cells.items()}

    def run(mode, saved, extension, chunk):
        mode_tick = None if tick is None else partial(tick, mode)
        _decode_cells(engine, saved, chunk, cells[mode], extension, max_tokens, stop_at_eos, out[mode],
                      _chunk_tick(mode_tick, len(chunk) / len(contexts)), group_bytes)

    for start in range(0, len(contexts), batch_size):
        chunk = list(contexts[start:start + batch_size])
        ext = list(questions[start:start + batch_size])
        engine.prefill(chunk)
        context = engine.snapshot()
        # one score memory for both modes, the agnostic first: the aware prompt is its context plus the question,
        # and H2O scores only the question's rows anew (`tdutils.policies.h2o`)
        with shared_scores():
            if "agnostic" in cells:
                run("agnostic", context, ext, chunk)
            if "aware" in cells:
                # the prompt's state is made from the context's only now, and the context's snapshot let go, so one
                # snapshot of the chunk (its caches and captured queries, ~117 MB per 2048-token prompt of
                # SmolLM2 with H2O's queries) is alive at a time
                engine.restore(context)
                context = None
                engine.extend(ext)
                run("aware", engine.snapshot(), None, chunk)
    return out


def _results(cells) -> tuple[dict, dict, dict]:
    """Empty `(texts, modify_s, kept)` of `run_cells` for `cells`."""
    return ({(p, r): [] for p, r, _ in cells}, {(p, r): 0.0 for p, r, _ in cells}, {(p, r): 0 for p, r, _ in cells})


def _chunk_tick(tick: Callable | None, fraction: float) -> Callable:
    """`tick(policy, ratio, fraction)` as a one-cell callback `(policy, ratio) -> None` for one chunk."""
    return (lambda policy, r: None) if tick is None else (lambda policy, r: tick(policy, r, fraction))


def _decode_cells(engine, saved, chunk, cells, extensions, max_tokens: int, stop_at_eos: bool, out,
                  done: Callable, group_bytes: int = 0) -> None:
    """Each cell of one chunk from the prefilled state `saved`: restore, edit, extend (when given), decode; the
    answers, modify seconds and kept tokens are added to `out` (`_results`); `done(policy, ratio)` after each.
    Cells of one drop ratio are decoded together (`_cell_groups`: their edited snapshots joined into one batch)."""
    texts, modify_s, kept = out
    width = len(chunk)
    with shared_scores():  # a policy's scores of these caches, computed at its first ratio, serve the others
        for group in _cell_groups(engine, saved, cells, width, group_bytes):
            edited = []
            for policy, r, fn in group:
                _restore(engine, saved, chunk)
                if fn is not None:
                    engine.modify(fn)
                    modify_s[policy, r] += engine.metrics.modify.seconds
                if len(group) > 1:
                    edited += engine.snapshot()
            if edited:
                engine.restore(edited)  # [cell 0's requests, cell 1's, ...]
                # the engine's requests hold these caches now: once `extend` replaces them, nothing else should
                # (a group's edited caches, its extended ones and the decode's slot store would all be alive)
                edited = None
            if extensions is not None:
                engine.extend(list(extensions) * len(group))
            outs = engine.decode(max_tokens=max_tokens, temperature=0.0, ignore_eos=not stop_at_eos)
            for k, (policy, r, _) in enumerate(group):
                rows = outs[k * width:(k + 1) * width]
                texts[policy, r] += [o.answer for o in rows]
                kept[policy, r] += sum(o.cached_tokens for o in rows)
                done(policy, r)


def _cell_groups(engine, saved, cells, width: int, group_bytes: int) -> list[list[tuple]]:
    """`cells` in groups decoded as one batch: cells of the same drop ratio, in their order, split evenly so that the
    caches they keep (`(1 - ratio)` of the longest prefilled cache, per request) hold at most `group_bytes`; a cell
    alone where `group_bytes` is 0 or the engine does not hold its caches (`Engine.restores_prefill`: edited snapshots
    then join into one batch, `Engine.restore`; an LMCache engine's caches live in its server's store)

    A decode step's cost is a fixed part (every weight read once, the Python of each layer) plus a part per row
    that shrinks with the cache, so the small caches of a high drop ratio decode several cells' worth of rows for
    nearly the price of one."""
    if group_bytes <= 0 or saved is None or not getattr(engine, "restores_prefill", False):
        return [[c] for c in cells]
    longest = max(r.kv.shape[2] for r in saved)
    token_bytes = saved[0].kv[:, :, :1].numel() * saved[0].kv.element_size()  # [2, L, 1, D]
    by_ratio: dict[float, list[tuple]] = {}
    for c in cells:
        by_ratio.setdefault(float(c[1]), []).append(c)
    groups = []
    for ratio, same in by_ratio.items():
        cell_bytes = width * max(1, math.ceil((1.0 - ratio) * longest)) * token_bytes
        parts = math.ceil(len(same) / max(1, group_bytes // cell_bytes))
        size = math.ceil(len(same) / parts)  # even parts: 10 cells in 5 + 5, not 9 + 1
        groups += [same[a:a + size] for a in range(0, len(same), size)]
    return groups


def run_forced_cells(engine, prompts: Sequence, continuations: Sequence[Sequence[int]], cells: Sequence[tuple], *,
                     batch_size: int, on_cell: Callable | None = None, tick: Callable | None = None) -> dict:
    """Fidelity of every cell to the full cache on teacher-forced continuations: each chunk of `batch_size` prompts
    is prefilled once; the full cache is forced through the continuations (`HFEngine.teacher_forced_logits`, one
    forward per batch; on other engines `decode(forced_ids=..., keep_logits=True)`, the same logits one step at a
    time), then per cell the prefilled caches are restored, edited (the edit never sees the continuation: the
    agnostic setting) and forced through the same continuations.

    Per prompt and cell: `kl`, the mean over the continuation's steps of KL(full || cell) in nats
    (`tdutils.compression.kl_per_step`; 0 for the full cache); `ppl`, the continuation's perplexity
    `exp(mean -log p(token))` under the cell; `delta_ppl`, that minus the full cache's; `agreement`, the fraction of
    steps whose argmax is the full cache's argmax.

    Args:
        prompts: token-id lists (what `prefill` takes); continuations: one token-id list per prompt, all of the same
            length m >= 1.
        cells: `(policy, ratio, drop_fn or None)` from `build_cells`.
        on_cell: called as `on_cell(policy, ratio, per, modify_s, kept)` as soon as a cell has every prompt (during
            the last chunk, so a run stopped later keeps it).
        tick: called as `tick(policy, ratio, fraction)` each time a cell finishes a chunk (`fraction` of the prompts).

    Returns:
        `{(policy, ratio): {"kl": [...], "delta_ppl": [...], "agreement": [...], "ppl": [...]}}`, lists in prompt
        order.

    Raises:
        ValueError: continuations of different lengths (or none).
    """
    m = {len(c) for c in continuations}
    if len(m) != 1 or 0 in m:
        raise ValueError(f"continuations must all have the same length >= 1, got lengths {sorted(m)}")
    (m,) = m
    per = {(p, r): {"kl": [], "delta_ppl": [], "agreement": [], "ppl": []} for p, r, _ in cells}
    modify_s = {(p, r): 0.0 for p, r, _ in cells}
    kept = {(p, r): 0 for p, r, _ in cells}
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        forced = [[int(t) for t in c] for c in continuations[start:start + batch_size]]
        engine.prefill(chunk)
        saved = _snapshot(engine)
        ref = _forced_logits(engine, forced)
        with shared_scores():  # a policy's scores of these caches, computed at its first ratio, serve the others
            for policy, r, fn in cells:
                outs = ref
                if fn is not None:
                    _restore(engine, saved, chunk)
                    engine.modify(fn)
                    modify_s[policy, r] += engine.metrics.modify.seconds
                    outs = _forced_logits(engine, forced)
                for (logits, cached), (full, _), ids in zip(outs, ref, forced):
                    for k, v in continuation_measures(full, logits, ids).items():
                        per[policy, r][k].append(v)
                    kept[policy, r] += cached
                if tick is not None:
                    tick(policy, r, len(chunk) / len(prompts))
                if on_cell is not None and start + batch_size >= len(prompts):  # its last chunk: the cell is scored
                    on_cell(policy, r, per[policy, r], modify_s[policy, r], kept[policy, r])
    return per


def _forced_logits(engine, forced: list[list[int]]) -> list[tuple]:
    """`(logits [m, vocab], KV rows at decode)` per request of the engine's current caches, teacher-forced through
    `forced`: in one forward per batch where the engine has `teacher_forced_logits` (`HFEngine`), else by
    `decode(forced_ids=..., keep_logits=True)`, one step per token (the same logits)."""
    if callable(getattr(engine, "teacher_forced_logits", None)):
        return [(x, engine.kv(i).shape[2]) for i, x in enumerate(engine.teacher_forced_logits(forced))]
    outs = engine.decode(max_tokens=len(forced[0]), temperature=0.0, ignore_eos=True, keep_logits=True,
                         forced_ids=forced)
    return [(_logit_matrix(o), o.cached_tokens) for o in outs]


def continuation_measures(full_logits, logits, continuation: Sequence[int]) -> dict[str, float]:
    """One prompt's fidelity measures from its teacher-forced logits: `[m, vocab]` tensors of the full cache and of
    an edited cache at the same m steps (step s predicts `continuation[s]`). Returns `kl` (mean KL(full || edited)
    per step, nats), `ppl` (`exp` of the mean negative log-likelihood of `continuation` under `logits`),
    `delta_ppl` (`ppl` minus the full cache's) and `agreement` (fraction of steps with the same argmax).

    Raises:
        ValueError: shapes that differ or do not match the continuation's length.
    """
    import torch

    if full_logits.shape != logits.shape or logits.shape[0] != len(continuation):
        raise ValueError(f"logits {tuple(full_logits.shape)} and {tuple(logits.shape)} must both be [m, vocab] with "
                         f"m = {len(continuation)} continuation tokens")
    ids = torch.as_tensor(list(continuation)).unsqueeze(1)

    def ppl(x):
        return math.exp(float(-torch.log_softmax(x.double(), dim=-1).gather(1, ids).mean()))

    mine = ppl(logits)
    return {"kl": float(kl_per_step(full_logits, logits).mean()), "delta_ppl": mine - ppl(full_logits),
            "agreement": float((logits.argmax(-1) == full_logits.argmax(-1)).double().mean()), "ppl": mine}


def _logit_matrix(output):
    """A `RequestOutput`'s kept logits as one `[steps, vocab]` tensor."""
    import torch

    return output.logits if isinstance(output.logits, torch.Tensor) else torch.stack(list(output.logits))


def _snapshot_capable(engine) -> bool:
    """Whether `engine` is an `Engine` (`snapshot` / `restore`, `extend`): what `run_cells_shared` needs."""
    return isinstance(engine, Engine) and callable(getattr(engine, "extend", None))


def _snapshot(engine):
    """The engine's prefilled state (`Engine.snapshot`), so every policy starts from the same caches: prefilling
    once per chunk instead of once per cell saves most of the benchmark's time. An object that is not an
    `Engine` gives None and is prefilled again."""
    return engine.snapshot() if isinstance(engine, Engine) else None


def _restore(engine, saved, prompts) -> None:
    if saved is None:
        engine.prefill(prompts)
    else:
        engine.restore(saved)


__all__ = ["COLUMNS", "DEFAULT_CONTEXT_LENGTHS", "DEFAULT_DROP_RATIOS", "DEFAULT_N", "DEFAULT_POLICIES",
           "DEFAULT_REAL_CONTEXT_LENGTHS", "DEFAULT_REAL_DROP_RATIOS", "DEFAULT_REAL_N", "DEFAULT_TASK_CONTEXT_LENGTHS",
           "DEFAULT_TASK_DROP_RATIOS", "DEFAULT_TASK_POLICIES", "DECODE_GROUP_BYTES", "TASKS", "TASK_BATCH_SIZE", "TASK_COLUMNS", "build_cells", "cell_key", "cell_row", "continuation_measures", "generate_cells", "grid_size", "lengths_eval",
           "passkey_eval", "run_cells", "run_cells_shared", "run_forced_cells", "run_tasks", "task_counts", "task_eval",
           "task_modes", "task_n"]
