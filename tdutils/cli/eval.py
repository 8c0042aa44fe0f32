"""`python -m tdutils eval` (and `bench/accuracy.py`): options, task names, the run, its table, JSON and plot.

`add_arguments(parser)` adds the options and `run(args) -> exit status` runs them (the `SUBCOMMANDS` contract of
`tdutils.cli.main`). Every option left unset takes its default from the registration of the run's tasks
(`tdutils.eval.tasks.Defaults`: model, policies, drop ratios, context lengths, n, modes, decode tokens, layout);
`--tasks` unset runs the tasks registered for `--model` (none given: the passkey benchmark of `tiny-qwen3`; a model
that is not bundled: RULER's templates); `--tasks leaderboard` runs the default real-model grid
(`tdutils.eval.grid.LEADERBOARD`: its tasks, each with its own n, policies, ratios, length and dtype), and without
`--n` every task takes its own n. Before the run starts one line gives the size of the whole grid (cells, prompts
prefilled). Everything that can be checked without the model is checked before any work; bad values raise
ValueError (the command line prints one line, exit status 2), and Ctrl-C writes the cells that finished to `--json`,
marked `"interrupted": true` (exit status 130). The JSON is also rewritten after every (length, task, mode) group,
so a run killed outright leaves its finished cells there, and `--resume` continues it without running them again;
a progress bar with an ETA runs on stderr unless `--quiet`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ..chat import uses_chat_template
from ..eval import grid as grids  # read as grids.LEADERBOARD at each run (a test may replace it)
from ..eval.common import (
    DEV_SEED,
    FULL,
    HELDOUT_SEED,
    TRAIN_SEED_BASE,
    DropRatios,
    check_output_path,
    check_plot_path,
    check_seed,
)
from ..eval.grid import LEADERBOARD_WORD
from ..eval.report import (
    OVER_BUDGET,
    format_table,
    format_task_table,
    measure_markdown,
    n_text,
    plot_accuracy,
    plot_leaderboard,
    rank_policies,
    task_markdown,
    undropped_notes,
    weak_task_notes,
    write_json,
)
from ..eval.runner import (
    COLUMNS,
    TASK_BATCH_SIZE,
    TASK_COLUMNS,
    _open_engine,
    check_task_grid,
    grid_size,
    lengths_eval,
    split_granularity,
    task_counts,
    task_eval,
    task_modes,
    task_n,
)
from ..eval.statistics import has_scores
from ..eval.tasks import GROUPS, MODES, RULER, SUITE_LABELS, SUITES, Defaults, get_task, task_names
from ..metrics import duration_text, plural
from ..models import check_context_lengths, context_window, resolve_model
from ..policies import policy_names
from .args import (
    add_dtype_option,
    add_threads_option,
    check_device_output,
    check_threads,
    positive_int,
    run_device,
    usable_cores,
)
from .policy_options import checked_params, policy_arguments, policy_options, policy_params
from .startup import INTERRUPTED

ALL = "all"  # --policies: every registered policy; --tasks: every word-level task
RULER_SUITE = "ruler"  # --tasks: every RULER template task
LEADERBOARD = LEADERBOARD_WORD  # --tasks: the default real-model grid (tdutils.eval.grid.LEADERBOARD)
CHAT_TEMPLATES = ("auto", "none")
SCORED_TEXT = "each response up to its first EOS token (RequestOutput.answer); what follows an EOS is not the model's answer"
DECODED_TEXT = {True: "a request leaves the decode batch at its first EOS token",
                False: "decoding ignores EOS (--ignore-eos), so every cell decodes the same number of tokens"}
# Policy parameters that are not `eval` options: its --seed is the dataset's seed (the random policy keeps its own).
POLICY_OPTION_SKIP = ("seed",)


def _split(values: Iterable[str], cast, what: str) -> list:
    """Accept `--x a b c`, `--x a,b,c` and mixtures."""
    out = []
    for v in values:
        for part in str(v).split(","):
            if part.strip():
                try:
                    out.append(cast(part.strip()))
                except ValueError:
                    raise argparse.ArgumentTypeError(f"bad {what} {part!r}") from None
    return out


def _seed_option(text: str) -> int:
    """argparse type of `--seed`: `check_seed` on the command line's text."""
    try:
        return check_seed(int(text))
    except ValueError as exc:
        msg = str(exc) if text.strip().lstrip("+-").isdigit() else f"expected an integer >= 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _suite_defaults() -> list[tuple[str, Defaults]]:
    """`(label, defaults)` of each suite's first task, in `SUITES` order (for `--help`)."""
    return [(SUITE_LABELS[s], get_task(task_names(s)[0]).defaults) for s in SUITES if task_names(s)]


def _grouped(suite: str | None = None) -> list[str]:
    """The tasks of `suite` (all suites: None) that run by a suite's word and by default (`Task.grouped`)."""
    return [t for t in task_names(suite) if get_task(t).grouped]


def _group_word(suite: str) -> str:
    """What `--tasks` takes to run `suite`: its group word, else its first task's name."""
    return next((word for word, s in GROUPS.items() if s == suite), task_names(suite)[0])


def add_arguments(parser) -> None:
    """Options of `python -m tdutils eval` (added to an argparse parser). Options left unset take the defaults of
    the registration of the tasks `--tasks` picks (`tdutils.eval.tasks.Defaults`)."""
    def each(field):
        return "; ".join(f"{label} {' '.join(map(str, getattr(d, field)))}" for label, d in _suite_defaults())

    suites = "; ".join(f"'{_group_word(s)}': {SUITE_LABELS[s]} ({', '.join(task_names(s))})" for s in SUITES
                       if task_names(s))
    board = grids.LEADERBOARD
    parser.add_argument("--tasks", nargs="+", default=None,
                        help=f"task names or whole suites: {suites}; '{LEADERBOARD}': the default real-model grid "
                             f"({_board_text(board)}; bfloat16 on a GPU or a CPU with native bfloat16, else float32; "
                             "any option given overrides it). Default: the tasks of --model "
                             f"('{task_names()[0]}' without one; '{RULER_SUITE}' for a --model that is not bundled)")
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATES, default="auto",
                        help="RULER template tasks: 'auto' (default) wraps each prompt in the tokenizer's chat template "
                             "when it has one; 'none' feeds the raw template")
    parser.add_argument("--mode", choices=("aware", "agnostic", "both"), default=None,
                        help="'aware' (question in the prompt when the cache is edited), 'agnostic' (cache edited on "
                             "the context alone, question prefilled after the edit) or 'both'; default: the modes the "
                             "tasks run in (passkey: aware only; RULER tasks: both)")
    parser.add_argument("--policies", nargs="+", default=None,
                        help="'full' (no dropping) and/or registered policy names, space- or comma-separated, each "
                             "optionally NAME/layer or NAME/head (one kept set per layer or KV head; hf engine); "
                             f"'all' for every registered policy (default: {each('policies')})")
    parser.add_argument("--drop-ratios", nargs="+", default=None,
                        help=f"fractions dropped, each in [0, 1] (default: {each('drop_ratios')})")
    parser.add_argument("--context-lengths", nargs="+", default=None,
                        help=f"prompt lengths in tokens (default: {each('context_lengths')})")
    parser.add_argument("--n", type=int, default=None,
                        help="prompts per context length and task, the same for every task (default: each task's own: "
                             f"{'; '.join(f'{label} {d.n}' for label, d in _suite_defaults())}; '{LEADERBOARD}': "
                             f"{', '.join(f'{t} {k}' for t, k in board.task_n.items())})")
    parser.add_argument("--seed", type=_seed_option, default=DEV_SEED,
                        help=f"dataset seed, below {TRAIN_SEED_BASE} (training streams); {DEV_SEED} is the development "
                             f"seed, {HELDOUT_SEED} the held-out seed of the published table (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="bundled model, packaged real model (smollm2-135m, gemma3-270m), .gguf file, hub id or "
                             "local folder (default: the tasks' own: "
                             f"{'; '.join(f'{label} {d.model}' for label, d in _suite_defaults())})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy decode tokens per request (default: passkey 10; RULER tasks the longest answer "
                             "of each task plus 2, RULER templates their own)")
    parser.add_argument("--json", dest="json_path", default="runs/eval.json",
                        help="where to write the table as JSON (default: runs/eval.json); a run stopped with Ctrl-C "
                             "or kill (SIGTERM) writes the cells it finished there, marked \"interrupted\": true")
    parser.add_argument("--plot", default=None,
                        help="also save a plot to this path (PNG, SVG, ...): passkey accuracy per length, or the RULER "
                             "leaderboard (mean exact match over tasks vs drop ratio, one panel per mode)")
    add_dtype_option(parser, None, f" (default: auto, the checkpoint's own, float32 for the bundled and packaged "
                                   f"models; '--tasks {LEADERBOARD}': bfloat16 on a GPU or a CPU with native "
                                   "bfloat16, else float32); the JSON records the dtype the model ran in")
    parser.add_argument("--device", type=run_device, default=None,
                        help="torch device (default: cuda when available, else cpu); --workers splits a CPU's cores, "
                             "a run on a GPU is one process")
    add_threads_option(parser, ". The bundled models are tiny: 1 thread per run is fastest when several runs "
                               "share a machine")
    parser.add_argument("--workers", type=positive_int, default=None,
                        help="processes that share each task's prompts, each with its own engine and --threads / N "
                             "torch threads (--threads, if given, at least N; unset: one each), bound to cores of its "
                             "own where there are enough; the "
                             "cells are the same as in one process. On a CPU two one-thread workers do more than one "
                             f"two-thread process (docs/real_models.md). Default: 1; '--tasks {LEADERBOARD}': 2 where "
                             "this process may use 2 or more cores and --threads, if given, is 2 or more")
    parser.add_argument("--quiet", action="store_true", help="no per-cell progress lines and no progress bar")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run stored in --json (the same model, seed, n, decode tokens and dtype): its "
                             "finished cells are kept and not run again. The JSON is rewritten after every group of "
                             "cells, so a killed run resumes where it stopped")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="decode every request to its decode-token count instead of stopping it at its first EOS "
                             "(the answers, scored up to the first EOS, are the same; only slower)")
    policy_arguments(parser, skip=POLICY_OPTION_SKIP)  # --window, --n-sink, ...: each reaches every policy with it


def _board_text(board) -> str:
    """The leaderboard grid in words, for `--help`."""
    n = ", ".join(f"{t} n={k}" for t, k in board.task_n.items())
    return (f"{n}; every policy that selects one set per request (not AdaKV/PyramidKV) and full; drop ratios "
            f"{' '.join(map(str, board.drop_ratios))}; {' '.join(map(str, board.context_lengths))} tokens; "
            f"both modes (text_fidelity agnostic); model {board.model}")


def parse_tasks(values: Iterable[str]) -> list[str]:
    """`--tasks` values as a list: a suite's word (`'all'`: the word-level tasks, `'ruler'`: RULER's templates) and
    `'leaderboard'` (`tdutils.eval.grid.LEADERBOARD`'s tasks) expand to their tasks; a task whose layout is
    `"lengths"` (`passkey`) must stand alone.

    Raises:
        ValueError: an unknown task, or a `"lengths"` task mixed with other tasks (its table has no task column).
    """
    try:
        tasks = _split(values, str, "task")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    board = grids.LEADERBOARD.tasks
    tasks = list(dict.fromkeys(t for x in tasks for t in (_grouped(GROUPS[x]) if x in GROUPS else
                                                          board if x == LEADERBOARD else (x,))))
    unknown = [t for t in tasks if t not in task_names()]
    if unknown:
        choices = []
        for suite in SUITES:
            names = task_names(suite)
            if suite in GROUPS.values():
                choices.append(f"{_group_word(suite)!r} ({SUITE_LABELS[suite]}: {', '.join(names)})")
            else:
                choices += [repr(t) for t in names]
        choices.insert(2, f"{LEADERBOARD!r} (the default real-model grid: {', '.join(board)})")
        raise ValueError(f"--tasks: unknown {', '.join(map(repr, unknown))}; choose "
                         f"{', '.join(choices[:-1])} or {choices[-1]}")
    alone = [t for t in tasks if get_task(t).defaults.layout == "lengths"]
    if alone and len(tasks) > 1:
        model = get_task(alone[0]).defaults.model
        raise ValueError(f"--tasks: {alone[0]!r} runs alone (its model, {model}, is trained on it alone, and its "
                         f"table has no task column); run it and the other tasks as separate commands")
    if not tasks:
        raise ValueError("--tasks needs at least one task")
    return tasks


def default_tasks(model: str | None) -> list[str]:
    """The tasks `eval` runs without `--tasks`: those registered with `model` as their default model (no model: the
    first registered task's, `passkey` on `tiny-qwen3`); for a model that is not bundled, the tasks that need a real
    model. A `"lengths"` task runs alone, so only the first of those is taken."""
    if model is None:
        model = get_task(task_names()[0]).defaults.model
    if resolve_model(model, check=False).kind != "bundled":
        return [t for t in _grouped() if get_task(t).defaults.real_model]
    own = [t for t in task_names() if get_task(t).defaults.model == model] or list(task_names()[:1])
    return own[:1] if get_task(own[0]).defaults.layout == "lengths" else own


@dataclass
class EvalPlan:
    """What `eval` runs, decided once from its options before the model loads (`plan_eval`).

    Attributes:
        tasks: the task names; defaults: the `Defaults` the run takes (those of its first task that runs on a
            bundled model, else of its first task; `--tasks leaderboard`: with the grid's model, policies, ratios,
            lengths and modes); model, modes, policies, ratios, lengths, max_tokens: the grid;
        params: policy parameters given, per policy label; chat: `--chat-template`; threads: `--threads` or None;
        n: prompts per (task, length), an int when every task has the same, else `{task: n}` (`--n` unset: each
            task's own default; the leaderboard's own for its tasks); dtype: what the engine is opened with;
        dtype_note: why, when the leaderboard chose it (None otherwise); workers: `--workers`, and workers_note
            why, when the leaderboard chose it; device: `--device` (None: cuda when available, else cpu).
    """

    tasks: list
    defaults: Defaults
    model: str
    modes: list
    policies: list
    ratios: DropRatios
    lengths: list
    max_tokens: int | None
    params: dict
    chat: str
    threads: int | None
    n: int | dict
    dtype: str
    dtype_note: str | None = None
    workers: int = 1
    workers_note: str | None = None
    device: str | None = None

    @property
    def lengths_layout(self) -> bool:
        return self.defaults.layout == "lengths"


def run(args) -> int:
    """Run the benchmark for parsed `args` (see `add_arguments`): print the table, write JSON and plot.

    Returns the exit status: 0, or `startup.INTERRUPTED` (130) when Ctrl-C stopped it; then the cells that
    finished are written to `--json` with `"interrupted": true` in its meta, and one line says so. Raises
    ValueError for bad values (the CLI prints it as an error).
    """
    import torch

    plan = plan_eval(args)
    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
    meta = {"model": plan.model, "tasks": plan.tasks, "modes": plan.modes, "policies": plan.policies,
            # no ratio was run when only the full cache was asked for (it ignores them)
            "drop_ratios": list(plan.ratios) if any(p != FULL for p in plan.policies) else [],
            "context_lengths": plan.lengths, "n": plan.n, "seed": args.seed, "max_tokens": plan.max_tokens,
            "policy_params": plan.params, "threads": torch.get_num_threads(), "workers": plan.workers,
            # each worker process's torch threads (`threads` is this process's, which the workers divide)
            "threads_per_worker": max(1, torch.get_num_threads() // plan.workers) if plan.workers > 1 else None,
            "interrupted": False,
            "scored": SCORED_TEXT, "decoded": DECODED_TEXT[not getattr(args, "ignore_eos", False)],
            "chat_template_option": plan.chat}
    if getattr(args, "resume", False) and plan.lengths_layout:
        raise ValueError("--resume continues task grids (--tasks ...); the passkey grid of context lengths reruns "
                         "whole: drop --resume, or give another --json to keep the stored run")
    resume = getattr(args, "resume", False)
    if not plan.lengths_layout:  # a grid the runner would refuse (a policy listed twice, ...) before its plan prints
        check_task_grid(plan.tasks, plan.modes, plan.policies, plan.ratios, plan.lengths, [], n=plan.n,
                        batch_size=TASK_BATCH_SIZE, max_tokens=plan.max_tokens)
    done, before, stored = _resume_rows(args.json_path, meta) if resume else ([], 0.0, {})
    for line in plan_lines(plan, stored=len(done)):
        print(line, flush=True)
    t0 = time.perf_counter() - before  # a resumed run's seconds include those of the runs it continues
    if not plan.lengths_layout:  # wall seconds per task, summed over lengths and resumed runs (datasets included;
        # the first task also holds opening the model)
        meta["task_seconds"] = dict(stored.get("task_seconds") or {})
    finished: list[dict] = list(done)  # the cells scored so far, kept when Ctrl-C stops the run
    try:
        table, used_chat = execute_eval(args, plan, meta, done, finished, t0, stored_dtype=stored.get("dtype"))
    except KeyboardInterrupt:
        return _interrupted(finished, COLUMNS if plan.lengths_layout else TASK_COLUMNS, args.json_path, meta, t0)
    # every cell was stored: the run's seconds stay the stored run's (opening the model to find out is no grid work)
    idle = bool(resume and done and len(finished) == len(done))
    return report_eval(args, plan, table, used_chat, meta, t0, resumed_s=before, idle=idle)


def plan_eval(args) -> EvalPlan:
    """Check every `eval` option that can be checked without the model and settle the grid (`EvalPlan`); sets
    `args.n` to the run's n (`EvalPlan.n`) when it was left out.

    Raises:
        ValueError: a bad option (one line naming it), or a context length the model cannot hold.
    """
    words = getattr(args, "tasks", None) or default_tasks(getattr(args, "model", None))
    tasks = parse_tasks(words)
    board = grids.LEADERBOARD if LEADERBOARD in _split(words, str, "task") else None
    specs = [get_task(t) for t in tasks]
    # the run's defaults: those of its first task that runs on a bundled model, else of its first task
    d = next((s.defaults for s in specs if not s.defaults.real_model), specs[0].defaults)
    if board is not None:  # the leaderboard's grid where an option is left out
        d = replace(d, model=board.model, policies=tuple(board.policies()), drop_ratios=board.drop_ratios,
                    context_lengths=board.context_lengths, modes=board.modes)
    mode = getattr(args, "mode", None)
    modes = list(d.modes) if mode is None else (list(MODES) if mode == "both" else [mode])
    if len(d.modes) == 1 and mode not in (None, *d.modes):
        raise ValueError(f"--mode {mode}: {d.title} runs in {d.modes[0]} mode only; use RULER tasks "
                         f"(--tasks {RULER_SUITE}) for both modes")
    model = args.model or d.model
    _check_model(model, d)  # warnings first: they hold whatever else is wrong
    policies, ratios, lengths = _grid_options(args, d)
    if args.n is not None and args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    own = board.task_n if board is not None else {}
    args.n = n = args.n if args.n is not None else task_counts(
        {t: own.get(t, get_task(t).defaults.n) for t in tasks}, tasks)
    max_tokens = args.max_tokens if args.max_tokens is not None else d.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    dtype, dtype_note = getattr(args, "dtype", None), None
    if dtype is None and board is not None:
        dtype, why = board.dtype()
        dtype_note = f"dtype {dtype}: the {LEADERBOARD}'s default, as {why}; --dtype changes it"
    dtype = dtype or "auto"
    threads = getattr(args, "threads", None)
    check_threads(threads)
    device = getattr(args, "device", None)
    workers, workers_note = _workers(getattr(args, "workers", None), threads, board, _on_cpu(device))
    most = max(n.values()) if isinstance(n, dict) else n
    if workers > most:  # a worker shares a task's prompts: one without a prompt would only load the model
        workers_note = (f"workers {most}: --n {most} gives each task at most {most} prompt(s) to share, so "
                        f"{workers} workers would leave {workers - most} idle")
        workers = most
    # "" is checked too (and refused, as `run --json ""`), never read as "no file"
    if args.json_path is not None:
        check_output_path(args.json_path, "--json", example="runs/eval.json")
        check_device_output(args.json_path, "--json")  # /dev/full would fail only after all the work
    if args.plot is not None:
        check_plot_path(args.plot, "--plot")
    given = _policy_options(args, policies)  # each policy checks its own --window minimum (snapkv: 1, others: 0)
    _check_window(getattr(args, "window", None), lengths)
    _check_kernel(getattr(args, "kernel_size", None), lengths)
    # before the model loads and any prompt is built (`run --context-length` shares the check)
    check_context_lengths(lengths, context_window(model), model=model, option="--context-lengths")
    return EvalPlan(tasks, d, model, modes, policies, ratios, lengths, max_tokens,
                    {p: values for p, values in given.items() if values},
                    getattr(args, "chat_template", "auto") or "auto", threads, n, dtype, dtype_note, workers,
                    workers_note, device)


def _on_cpu(device: str | None) -> bool:
    """Whether a run with `--device` (None: cuda when available, else cpu) computes on the CPU."""
    import torch

    return torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()


def _workers(workers: int | None, threads: int | None, board, on_cpu: bool = True) -> tuple[int, str | None]:
    """`(workers, note)`: `--workers`, or the default (2 on the leaderboard on a CPU with 2 usable cores and
    threads to spare, else 1) and the line that says it was chosen.

    Raises:
        ValueError: more workers than usable cores, `--threads` fewer than the workers, or several workers for a
            run on a GPU."""
    note = None
    if workers is not None and workers > 1 and not on_cpu:
        raise ValueError(f"--workers {workers} splits a CPU's cores among processes; a run on a GPU is one process: "
                         f"drop --workers, or give --device cpu")
    if workers is None:
        workers = 2 if (board is not None and on_cpu and usable_cores() >= 2
                        and (threads is None or threads >= 2)) else 1
        if workers > 1:
            note = (f"workers 2: the {LEADERBOARD}'s default on 2 or more cores (each process one thread on a core "
                    f"of its own); --workers 1 changes it")
    if workers > usable_cores():
        raise ValueError(f"--workers {workers} is more than the {usable_cores()} CPU core(s) this process may use; "
                         f"give at most {usable_cores()}")
    if threads is not None and threads < workers:
        raise ValueError(f"--threads {threads} is shared among --workers {workers}: each needs at least one thread; "
                         f"give --threads {workers} or more, or fewer workers")
    return workers, note


def _check_window(window: int | None, lengths) -> None:
    """`--window` (its minimum checked by each policy, `_policy_options`): shorter than the shortest context length
    (the window is always kept: at or past the prompt length nothing would be dropped, and the table would show
    full-cache accuracy under a policy's name, as `run` refuses it). Raises ValueError naming the option."""
    if window is not None and window >= min(lengths):
        raise ValueError(f"--window {window} must be shorter than the shortest context length "
                         f"({min(lengths)} tokens): the window is always kept, so nothing would be dropped; give a "
                         "smaller --window")


def _check_kernel(kernel_size: int | None, lengths) -> None:
    """`--kernel-size` (odd and >= 1, checked by each policy): shorter than the shortest context length, else the
    pooling spreads one score over the whole prompt and the policy keeps tokens by ties. Raises ValueError."""
    if kernel_size is not None and kernel_size >= min(lengths):
        raise ValueError(f"--kernel-size {kernel_size} must be shorter than the shortest context length "
                         f"({min(lengths)} tokens): a pooling kernel that long gives every token the same score; "
                         f"give a small odd kernel (SnapKV's default is 5, R-KV's 7)")


def _policy_options(args, policies) -> dict[str, dict]:
    """Each policy's parameters given on the command line (`{policy: {name: value}}`), checked by the policy itself
    before any model loads.

    Raises:
        ValueError: a value the policy refuses (naming option and policy), or an option no policy of the grid has
            (`run` refuses one its single policy has no parameter for)."""
    given = {p: policy_params(args, split_granularity(p)[0], skip=POLICY_OPTION_SKIP, strict=False)
             for p in policies if p != FULL}
    for p, values in given.items():
        checked_params(split_granularity(p)[0], values, name_policy=True)
    reached = {name for values in given.values() for name in values}
    stray = [o.flag for o in policy_options(skip=POLICY_OPTION_SKIP).values()
             if getattr(args, o.name, None) is not None and o.name not in reached]
    if stray:
        named = sorted({split_granularity(p)[0] for p in policies if p != FULL})
        raise ValueError(f"{', '.join(stray)} applies to none of the policies run here ({', '.join(named) or 'full'}); "
                         f"drop it, or add a policy that has it (--help lists each option's policies)")
    return given


def plan_lines(plan: EvalPlan, *, stored: int = 0) -> list[str]:
    """What `eval` prints before it starts: the leaderboard's dtype choice (when it made one) and, for a task grid,
    its size: cells, prompts prefilled and prefill batches of the whole grid (`tdutils.eval.runner.grid_size`),
    and how many cells a resumed run has stored."""
    lines = [note for note in (plan.dtype_note, plan.workers_note) if note is not None]
    if plan.lengths_layout:
        return lines
    specs = [get_task(t) for t in plan.tasks]
    per = sum(1 if p == FULL else len(plan.ratios) for p in plan.policies)
    size = grid_size(specs, plan.modes, per, plan.lengths, plan.n, TASK_BATCH_SIZE)
    pairs = sum(len(task_modes(t, plan.modes)) for t in specs)
    lengths = "/".join(map(str, plan.lengths))
    left = f"; {stored} stored, {size['cells'] - stored} to run" if stored else ""
    if plan.workers > 1:
        left = f"; {plan.workers} worker processes share each task's prompts, each in batches of up to " \
               f"{-(-TASK_BATCH_SIZE // plan.workers)}{left}"
    lines.append(f"grid: {plural(size['cells'], 'cell')} = {plural(per, 'policy/ratio cell')} x {plural(pairs, '(task, mode) pair')} x "
                 f"{plural(len(plan.lengths), 'length')} ({lengths} tokens); n = {n_text(plan.n)}; {plural(size['prompts'], 'prompt')} "
                 f"prefilled, in {plural(size['batches'], 'batch', 'batches')} of up to {TASK_BATCH_SIZE}{left}")
    return lines


def _grid_options(args, d: Defaults):
    """`(policies, DropRatios, lengths)` of `--policies`, `--drop-ratios`, `--context-lengths` (defaults from `d`):
    `all` expanded to every registered policy, each name and granularity checked."""

    def pick(value, default):
        return value if value is not None else [str(x) for x in default]

    try:
        policies = _split(pick(args.policies, d.policies), str, "policy")
        ratios = _split(pick(args.drop_ratios, d.drop_ratios), float,
                        "--drop-ratios value (fractions such as 0.25 0.5 0.75)")
        lengths = _split(pick(args.context_lengths, d.context_lengths), int,
                         "--context-lengths value (whole numbers of tokens such as 1024 2048)")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    ratios = DropRatios(ratios, option="--drop-ratios")  # checked here once; the runner does not check them again
    if ALL in policies:  # every registered policy, in registration order, after "full" when given
        policies = list(dict.fromkeys(p for q in policies for p in ([*policy_names()] if q == ALL else [q])))
    unknown = [p for p in policies if p != FULL and (split_granularity(p)[0] not in policy_names()
                                                     or split_granularity(p)[1] not in ("request", "layer", "head"))]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(map(repr, unknown))}; choose from {[FULL, *policy_names()]} "
                         f"or {ALL!r}, each optionally with /layer or /head (its granularity)")
    if not policies or not ratios or not lengths:
        raise ValueError("give at least one value to each of --policies, --drop-ratios and --context-lengths")
    bad_lengths = [x for x in lengths if x < 1]
    if bad_lengths:
        raise ValueError(f"--context-lengths must be >= 1 tokens, got {bad_lengths}")
    return policies, ratios, lengths


def _check_model(model: str, d: Defaults) -> None:
    """Refuse a bundled model on tasks that need a real one; warn (stderr) when a model meets tasks it was never
    trained on."""
    bundled = resolve_model(model, check=False).kind == "bundled"
    if d.real_model and bundled:
        raise ValueError(f"--model {model}: the bundled models know only their own word-level vocabulary; RULER's "
                         f"templates need a real tokenizer and model (e.g. --model {d.model}), or use the "
                         f"word-level tasks ({ALL!r})")
    if bundled and model != d.model:  # a bundled model on tasks it was never trained on
        owner = next((get_task(t) for t in task_names() if get_task(t).defaults.model == model), None)
        trained_for = "other tasks" if owner is None else f"{owner.defaults.title} (--tasks {_group_word(owner.suite)})"
        print(f"tdutils: warning: --model {model} was trained only on {trained_for}, not on {d.title}: its "
              f"accuracy there says nothing about the policies; omit --model to use {d.model}", file=sys.stderr,
              flush=True)
    if not bundled and not d.real_model:  # a real model on the bundled models' word-level formats
        print(f"tdutils: warning: --model {model} meets tasks in the bundled models' word-level format "
              f"(needles 'pass key ...'), which real models were never taught; RULER's own templates measure them "
              f"(--tasks {_group_word(RULER)})", file=sys.stderr, flush=True)


def execute_eval(args, plan: EvalPlan, meta: dict, done: list, finished: list, t0: float, *,
                 stored_dtype: str | None = None):
    """Open the engine (`plan.dtype`; `meta["dtype"]` becomes the dtype its model runs in) and run the grid:
    `(table, whether the chat template was applied)`. Each scored cell is appended to `finished`; the JSON at
    `--json` is rewritten after every group (for `--resume`).

    Raises:
        ValueError: a resumed run (`stored_dtype`, the stored run's dtype) in another dtype than this one's model.
    """
    import pandas as pd

    last = [time.perf_counter()]

    def checkpoint():  # a killed run (no Ctrl-C) still leaves its finished cells for --resume
        now, task = time.perf_counter(), finished[-1]["task"] if finished else None
        if task is not None and "task_seconds" in meta:
            meta["task_seconds"][task] = meta["task_seconds"].get(task, 0.0) + now - last[0]
        last[0] = now
        if args.json_path is not None:
            write_json(pd.DataFrame(finished, columns=list(TASK_COLUMNS)), args.json_path,
                       meta={**meta, "interrupted": True, "seconds": time.perf_counter() - t0})

    log = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    common = {"n": plan.n, "seed": args.seed, "max_tokens": plan.max_tokens, "log": log, "policy_params": plan.params,
              "partial": finished, "chat_template": plan.chat}
    engine = _open_engine(None, plan.model, args.seed, dtype=plan.dtype, device=plan.device)
    meta["dtype"], meta["device"] = engine_dtype(engine), str(engine.device)
    if stored_dtype is not None and stored_dtype != meta["dtype"]:
        raise ValueError(f"--resume: {args.json_path} was run in {stored_dtype}, this run's model is "
                         f"{meta['dtype']}; give --dtype {stored_dtype}, or another --json")
    used_chat = plan.defaults.chat_template and _uses_chat(engine.tokenizer, plan.chat)
    if plan.lengths_layout:
        return lengths_eval(plan.tasks[0], plan.model, plan.policies, plan.ratios, plan.lengths, engine=engine,
                            **common), used_chat
    table = task_eval(plan.model, plan.tasks, plan.modes, plan.policies, plan.ratios, plan.lengths, engine=engine,
                      done=done, progress=not args.quiet, stop_at_eos=not getattr(args, "ignore_eos", False),
                      checkpoint=checkpoint, batch_size=TASK_BATCH_SIZE, workers=plan.workers, **common)
    return table, used_chat


def engine_dtype(engine) -> str:
    """The dtype name (`"float32"`, `"bfloat16"`, ...) an engine's model runs in."""
    dtype = getattr(getattr(engine, "model", None), "dtype", None) or engine.facts.kv_dtype
    return str(dtype).removeprefix("torch.")


def report_eval(args, plan: EvalPlan, table, used_chat: bool, meta: dict, t0: float, *, resumed_s: float = 0.0,
                idle: bool = False) -> int:
    """Print `eval`'s table (and, for task tables, markdown, rankings and notes), write JSON and plot; status 0.
    `t0` is when the run began counting, `resumed_s` seconds before this invocation for a resumed run (`--resume`):
    the summary line gives this invocation's seconds and the total, the JSON's `seconds` the total; `idle`: the
    resumed run had every cell stored, so its seconds stay `resumed_s`."""
    d = plan.defaults
    if plan.lengths_layout:
        print(format_table(table))
        meta["notes"] = undropped_notes(table)
        for line in meta["notes"]:
            print(line)
        what = f"{d.label}, model={plan.model}, n={plan.n} per length"
    else:
        print(format_task_table(table))
        print()
        exact = _exact_rows(table)
        if exact["correct"].notna().any():
            print(task_markdown(exact))
        for task in plan.tasks:
            if get_task(task).measure != "exact":
                print()
                print(measure_markdown(table, task))
        # not a partial-credit task's exact match, which ranks nothing
        notes = weak_task_notes(exact) + undropped_notes(table)
        for line in [*ranking_lines(table), *notes]:
            print(line)
        meta["notes"] = notes
        if d.chat_template:
            meta["chat_template"] = "applied (the tokenizer's own)" if used_chat else "none"
        chat_part = f", chat template {'applied' if used_chat else 'not applied'}" if d.chat_template else ""
        what = f"{d.label}, model={plan.model}{chat_part}, n={n_text(plan.n)} per task and length"
    meta["metric"] = d.metric
    meta["seconds"] = seconds = resumed_s if idle else time.perf_counter() - t0
    took = f"nothing left to run ({duration_text(seconds)} in the stored run)" if idle else \
        duration_text(seconds) if not resumed_s else \
        f"{duration_text(seconds - resumed_s)} (this run; {duration_text(seconds)} with the stored run it resumed)"
    print(f"\n{what}, seed={args.seed}, {took}")
    if args.json_path is not None:
        print(f"wrote {write_json(table, args.json_path, meta=meta)}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")  # a command line needs no display
        (plot_accuracy if plan.lengths_layout else plot_leaderboard)(
            table if plan.lengths_layout else _exact_rows(table), args.plot)
        print(f"wrote {args.plot}")
    return 0


def _exact_rows(table):
    """The rows of tasks ranked by exact match (`measure == "exact"`) when there are any, else all: the exact-match
    table and plot leave out tasks ranked by another measure (partial credit, text fidelity), whose own table
    (`measure_markdown`) shows their exact match beside it."""
    if "measure" not in table.columns or not (table["measure"] == "exact").any():
        return table
    return table[table["measure"] == "exact"]


def _interrupted(finished: list[dict], columns, json_path, meta: dict, t0: float) -> int:
    """Ctrl-C stopped `eval`: write the `finished` cells as JSON (meta `"interrupted": true`), say in one line where
    they went, and return `startup.INTERRUPTED`."""
    import pandas as pd

    if not finished:
        where = " before any cell finished; nothing was written"
    elif json_path is None:
        where = f"; {plural(len(finished), 'cell')} had finished (no --json to write them to)"
    else:
        meta = {**meta, "interrupted": True, "seconds": time.perf_counter() - t0}
        path = write_json(pd.DataFrame(finished, columns=list(columns)), json_path, meta=meta)
        where = f"; what finished ({plural(len(finished), 'cell')}) is in {path} (\"interrupted\": true in its meta)"
    # the form of `run`'s and of every other command's interrupt line (tdutils.cli.main)
    print(f"python -m tdutils eval: interrupted{where}", file=sys.stderr, flush=True)
    return INTERRUPTED


# an exact McNemar test and the sign-flip permutation test give p = 2 / 2^k at best over k prompts that differ: below
# 0.05 from k = 6 (0.031; 5: 0.0625)
MIN_SEPARABLE_N = 6


def ranking_lines(table) -> list[str]:
    """One line per (measure, drop ratio, mode) of a `task_eval` table: its policies in `rank_policies` order (paired
    tests on the same prompts, Holm-corrected; a shared rank: not separated), and the test that decided."""
    if not has_scores(table) or (table["policy"] == FULL).sum() == 0 or (table["drop_ratio"] > 0).sum() == 0:
        return []
    lines = []
    for measure in dict.fromkeys(table["measure"]):
        for ratio in sorted(r for r in table["drop_ratio"].unique() if r > 0):
            rank = rank_policies(table, ratio, measure=measure)
            for mode, g in rank.groupby("mode", sort=False):
                order = ", ".join(f"{r.rank}. {r.policy}{' (over budget)' if r.over_budget else ''} {r.score:.3g}"
                                  for r in g.itertuples())
                lines.append(f"ranked, {measure} @ {ratio:g}, {mode}: {order} ({g['test'].iloc[0]})")
                lines += [f"note: {r.policy} keeps {r.kept_tokens:.0f} KV tokens per request at {ratio:g}, more than "
                          f"{OVER_BUDGET:g}x the median policy's: its rank is not at equal memory"
                          for r in g.itertuples() if r.over_budget]
                n = int(g["n"].min())
                if n < MIN_SEPARABLE_N and g["rank"].nunique() == 1:
                    lines.append(f"note: at n = {plural(n, 'prompt')} no paired test can separate two policies (both "
                                 f"tests need at least {MIN_SEPARABLE_N} prompts where they differ to reach p < 0.05), "
                                 f"so every policy shares rank 1 whatever its score; give --n 20 or more to rank them")
    return lines


RESUME_KEYS = ("model", "n", "seed", "max_tokens", "policy_params", "chat_template_option")


def _resume_rows(json_path, meta: dict) -> tuple[list[dict], float, dict]:
    """The rows of the run stored at `json_path` to resume (`--resume`), the seconds it ran and its meta;
    `([], 0.0, {})` when no file is there yet. Its `n` (an int, or `{task: n}`) must give each task of this run
    (`meta["tasks"]`) the count this run gives it.

    Raises:
        ValueError: no --json, a file that is not a stored run, or one of another grid (`RESUME_KEYS` differ).
    """
    from pathlib import Path

    if json_path is not None and Path(json_path).exists() and not Path(json_path).is_file():
        raise ValueError(f"--resume: {json_path} is not a regular file (a device, pipe or folder), so it holds no "
                         f"stored run; give the --json file of the run to continue")
    if json_path is None or not Path(json_path).exists():
        if json_path is None:
            raise ValueError("--resume continues the run stored in --json; give --json PATH")
        # a mistyped path would otherwise rerun the whole grid without a word
        print(f"--resume: nothing stored at {json_path} yet: starting the whole grid there", flush=True)
        return [], 0.0, {}
    try:
        stored = json.loads(Path(json_path).read_text(encoding="utf-8"))
        old, rows = stored["meta"], stored["rows"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume: {json_path} is not a stored eval run ({exc}); remove it or give another "
                         "--json") from None
    differ = [k for k in RESUME_KEYS if not _same(k, old, meta)]
    if differ:
        what = ", ".join(f"{k} {old.get(k)!r} there, {meta.get(k)!r} here" for k in differ)
        raise ValueError(f"--resume: {json_path} is a run of another grid ({what}); rerun with its options or another "
                         "--json")
    # a resumed run rewrites the file with its own grid's cells: one that leaves stored cells out would drop them
    left = _cells_left_out(rows, meta)
    if left:
        what = "; ".join(f"{k.replace('_', ' ')} {', '.join(map(str, v))}" for k, v in left.items())
        raise ValueError(f"--resume: {json_path} holds cells this grid leaves out ({what}), which resuming would drop "
                         f"from the file; give those too (a larger grid resumes), or another --json")
    return rows, float(old.get("seconds") or 0.0), old


def _cells_left_out(rows: list, meta: Mapping) -> dict[str, list]:
    """Per grid key (`meta`'s tasks, modes, policies, drop_ratios, context_lengths), the values of stored `rows`
    this run's grid does not have."""
    new = json.loads(json.dumps(meta, default=str))
    left: dict[str, list] = {}
    for r in rows:
        for key, col in (("tasks", "task"), ("modes", "mode"), ("policies", "policy"), ("drop_ratios", "drop_ratio"),
                         ("context_lengths", "context_length")):
            v = r.get(col)
            if col == "drop_ratio" and (r.get("policy") == FULL or r.get("policy") not in new.get("policies")):
                continue  # the full cache runs once; a policy left out is named as one
            if v not in (new.get(key) or []) and v not in left.setdefault(key, []):
                left[key].append(v)
    return {k: v for k, v in left.items() if v}


def _same(key: str, old: Mapping, meta: Mapping) -> bool:
    """Whether the stored run's `old[key]` is this run's `meta[key]` (as JSON stores it); `n` per task of this run,
    so an int and a `{task: n}` that give each task the same count are the same."""
    new = json.loads(json.dumps(meta.get(key), default=str))
    if key != "n" or not (isinstance(old.get(key), Mapping) or isinstance(new, Mapping)):
        return old.get(key) == new
    stored = old.get(key)
    return all((stored.get(t) if isinstance(stored, Mapping) else stored) == task_n(new, t)
               for t in meta.get("tasks") or [])


def _uses_chat(tokenizer, chat_template) -> bool:
    return uses_chat_template(tokenizer, chat_template)


__all__ = ["ALL", "CHAT_TEMPLATES", "POLICY_OPTION_SKIP", "DECODED_TEXT", "RULER_SUITE", "SCORED_TEXT",
           "add_arguments", "default_tasks", "parse_tasks", "ranking_lines", "run"]
