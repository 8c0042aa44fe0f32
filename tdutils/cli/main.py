"""Command line: `python -m tdutils run --policy snapkv --drop-ratio 0.5`.

`run` runs the baseline and the dropped configuration on the same prompts, alternately (`--repeats`, default 3,
times), prints the phase table (medians over repeats) with the decode-throughput ratio (median of the per-repeat
ratios, min-max), a note when that ratio does not measure what dropping buys (`tdutils.metrics.speedup_notes`:
busy machine, no larger batch, slower despite a larger batch, above the capacity limit), and writes JSON.
The other subcommands are modules of `tdutils.cli` beside this one (see `SUBCOMMANDS`).
Bad input is reported in one line with exit status 2; anything else is a bug and shows its traceback
and a request to report it, exit status 1 (`tdutils.cli.args.report_error`). Ctrl-C stops a command in one line
with exit status 130; `run` and `eval` first write what they finished to their `--json`, marked
`"interrupted": true`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import (
    make_drop_fn,
    metrics,  # module access: tests replace metrics.speedup_notes
    open_engine,
)
from ..answers import CHOICES
from ..chat import uses_chat_template
from ..data import MC_SAMPLE_NAME, SAMPLE_NAME
from ..edit import policy_granularity
from ..engines import engine_class, engine_kinds
from ..eval.common import check_output_path
from ..eval.tasks import SAMPLES, dataset_task, get_task, load_rows, score_rows, task_names
from ..metrics import duration_text, plural
from ..models import check_context_lengths, context_window, resolve_model
from ..policies import get_policy, policy_names
from ..ruler import ContextTooShort
from ..runs import (
    DEFAULT_FULL_REQUESTS,
    PREFILL_ONCE_NOTE,
    Interrupted,
    compare,
    default_kv_budget,
    timing_line,
)
from .args import (
    OneLineParser,
    UsageError,
    add_dtype_option,
    add_threads_option,
    check_device_output,
    check_server_urls,
    check_threads,
    drop_ratio,
    positive_float,
    positive_int,
    run_device,
    report_error,
)
from .policy_options import checked_params, policy_arguments, policy_params
from .startup import INTERRUPTED, interrupt_as_exception, interrupted_status

# Subcommands defined in the other modules of tdutils.cli: name -> (module, help). Each module provides
# `add_arguments(parser)` and `run(args) -> int` (exit status).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("tdutils.cli.eval", ("accuracy of policies x drop ratios x context lengths: passkey, or RULER-style "
                                  "tasks in query-aware / query-agnostic mode")),
    "doctor": ("tdutils.cli.doctor", "check a vLLM + LMCache serving setup end to end and print what to fix"),
    "patches": ("tdutils.cli.patches", "check, apply or revert the vLLM / LMCache patches of the serving path"),
}


def _fmt(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.4g}"


# Words a user may try as a subcommand that belong to another command: word -> what to run instead.
ELSEWHERE = {
    "patch": "python -m tdutils patches apply (or check, revert) patches vLLM and LMCache; python -m tdutils doctor "
             "says whether a serving setup needs it",
    "apply": "python -m tdutils patches apply patches vLLM and LMCache",
    "check": "python -m tdutils doctor checks a vLLM + LMCache setup; python -m tdutils patches check shows the patch "
             "state",
    "evaluate": "python -m tdutils eval measures accuracy", "accuracy": "python -m tdutils eval measures accuracy",
    "bench": "python -m tdutils eval measures accuracy, python -m tdutils run throughput",
}


class _TopParser(OneLineParser):
    """The top-level parser: an unknown subcommand is reported with the one the user probably meant."""

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        commands = list(getattr(self, "commands", ()))
        if argv and commands and not argv[0].startswith("-") and argv[0] not in commands:
            self.error(unknown_command(argv[0], commands))
        return super().parse_known_args(argv, namespace)


def unknown_command(word: str, commands) -> str:
    """The error for a subcommand `word` that does not exist: the subcommands there are, and what `word` probably
    meant (`ELSEWHERE`, or the closest subcommand's name for a typo)."""
    import difflib

    head = f"{word!r} is not a subcommand (choose from {', '.join(commands)})"
    key = word.strip().lower()
    if key in ELSEWHERE:
        return f"{head}; {ELSEWHERE[key]}"
    close = difflib.get_close_matches(key, list(commands) + list(ELSEWHERE), n=1, cutoff=0.6)
    if close and close[0] in ELSEWHERE:
        return f"{head}; {ELSEWHERE[close[0]]}"
    return f"{head}; did you mean {close[0]!r}?" if close else head


def build_parser() -> argparse.ArgumentParser:
    ap = _TopParser(prog="python -m tdutils", description="Token dropping for long-context LLM decoding.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = sub.add_parser(
        "run", help="baseline vs token dropping: phase metrics and the decode-throughput ratio",
        description="Prefill the prompts, drop tokens from every request's KV cache with a policy, decode under "
                    "a fixed KV budget, and compare with the baseline (no dropping) on the same prompts.")
    names = policy_names()
    run.add_argument("--policy", choices=names, default="snapkv", metavar="{" + ",".join(names) + "}",
                     help="token-selection policy (default: snapkv): " + "; ".join(
                         f"{n}: {get_policy(n).summary}" for n in names))
    run.add_argument("--drop-ratio", type=drop_ratio, default=0.5,
                     help="fraction of each request's tokens to drop, in [0, 1] (default: 0.5)")
    run.add_argument("--engine", choices=engine_kinds(), default="hf",
                     help="hf: embedded transformers engine (default); lmcache: vLLM + LMCache serving path; any other "
                          "registered engine (tdutils.engines.register_engine)")
    run.add_argument("--vllm-url", default="http://localhost:8000", help="lmcache engine: vLLM server URL")
    run.add_argument("--lmcache-url", default="tcp://localhost:6555", help="lmcache engine: LMCache server (SDK port)")
    run.add_argument("--lmcache-http-url", default="http://localhost:8080", help="lmcache engine: LMCache HTTP API")
    run.add_argument("--model", default="tiny-qwen3",
                     help="bundled model name, packaged real model (smollm2-135m, gemma3-270m), .gguf file, hub id "
                          "(e.g. Qwen/Qwen3-0.6B), local folder, or random:ARCH:NL (a real-shaped random model, e.g. "
                          "random:qwen3-0.6b:4L, for throughput only) (default: tiny-qwen3)")
    run.add_argument("--dataset", default=None,
                     help="'sample' (bundled passkey prompts, ~1k tokens), 'mc-sample' (bundled English multiple "
                          "choice), any task of 'python -m tdutils eval --tasks' such as 'ruler_niah_single_1' or "
                          "'passkey' (built for the model's tokenizer at --context-length tokens, scored by the "
                          "task's own scorer), a .jsonl/.json/.csv/.parquet file with a 'prompt' "
                          "column, or a hub dataset id such as raniayu/token-dropping-demo (default: 'sample' for "
                          f"the bundled and random models; '{REAL_MODEL_DATASET}' for real models)")
    run.add_argument("--context-length", type=positive_int, default=None,
                     help="task datasets only (such as 'ruler_niah_single_1' or 'passkey'): prompt tokens per request "
                          f"(default: {DEFAULT_CONTEXT_LENGTH}); refused with 'sample', 'mc-sample', files and hub "
                          "datasets, whose prompts are read as they are")
    run.add_argument("--chat-template", choices=("auto", "none"), default="auto",
                     help="'auto' wraps every prompt as a user turn in the tokenizer's chat template when it has one "
                          "(default; instruction-tuned models answer raw prompts poorly); 'none' never")
    run.add_argument("--num-requests", type=positive_int, default=16, help="prompts to run (default: 16)")
    run.add_argument("--max-tokens", type=positive_int, default=64,
                     help="decode tokens per request, EOS ignored (default: 64)")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget-tokens", type=positive_int, default=None,
                        help="KV tokens the decode batch may hold (cache lengths + tokens still to generate); "
                             "default: 4.25 undropped requests, ceil(4.25 x (longest prompt + max tokens)): the baseline "
                             "decodes 4 at a time, 8 requests at drop ratio 0.5 fit")
    budget.add_argument("--kv-budget-gb", type=positive_float, default=None,
                        help="the KV budget in GiB (2**30 bytes) instead of --kv-budget-tokens (not both): converted "
                             "to tokens at the cache's bytes per token, 2 x layers x KV heads x head_dim x the dtype's "
                             "element size, so a bfloat16 cache fits twice the tokens of a float32 one (hf engine)")
    run.add_argument("--positions", choices=("compact", "original"), default="compact",
                     help="compact: re-rotate kept keys to 0..k-1 and decode at k (default, as vLLM+LMCache); "
                          "original: keep rotations and decode at T")
    run.add_argument("--granularity", choices=("request", "layer", "head"), default="request",
                     help="kept sets: one per request (default; what LMCache stores), one per layer, or one per KV head "
                          "(the papers' and kvpress' selection; hf engine only; docs/policies.md, Granularity)")
    run.add_argument("--repeats", type=positive_int, default=3,
                     help="run the baseline and the dropped configuration alternately this many times; the table "
                          "shows medians, the ratio is the median of the per-repeat ratios with its min-max, and a "
                          "note says when the repeats disagree (a busy machine); 1 for a quick look (default: 3)")
    policy_arguments(run)  # --window, --n-sink, --kernel-size, ...: one per policy parameter
    add_dtype_option(run, "auto", " (default: auto)")
    run.add_argument("--device", type=run_device, default=None,
                     help="torch device (default: cuda when available, else cpu)")
    add_threads_option(run, "; the JSON records the threads used")
    run.add_argument("--json", dest="json_path", default="runs/run.json",
                     help="where to write the metrics as JSON (default: runs/run.json); a run stopped with Ctrl-C "
                          "writes the runs it finished there, marked \"interrupted\": true")
    run.add_argument("--no-progress", action="store_true", help="hide progress bars")
    run.set_defaults(func=cmd_run)
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    ap.commands = ["run", *SUBCOMMANDS]
    return ap


REAL_MODEL_DATASET = "ruler_niah_single_1"  # `run`'s default dataset for a real model
DEFAULT_CONTEXT_LENGTH = 2048  # `run --context-length` of a task dataset


def accuracy_notes(reports, *, chance: float | None, missing: int = 0) -> list[str]:
    """Notes for accuracies that measure nothing: the baseline's 95% interval contains the chance level (guessing
    scores the same), or the baseline itself solves under half of the prompts (the model cannot do the task, so a
    policy's score cannot show what dropping costs). With `missing` rows that have no gold answer (left out of
    the scores), a first note says how many, and over how many rows the accuracies are."""
    base = reports.get("baseline")
    if base is None or not base.total:
        return []
    if missing:
        line = (f"{missing} of {base.total + missing} rows have no gold 'answer': the accuracies are over the "
                f"{base.total} that have one")
        return [line, *accuracy_notes(reports, chance=chance)]
    lo, hi = base.ci95
    if chance is not None and lo <= chance <= hi:
        line = (f"the baseline's accuracy ({base}) is within chance level ({100 * chance:.0f}% for four choices; 95% "
                f"CI {100 * lo:.0f}-{100 * hi:.0f}%): this model cannot do this task, so the accuracies measure "
                f"nothing about the policy; use a task it can do (e.g. --dataset {REAL_MODEL_DATASET})")
        return [line]
    if base.accuracy < 0.5:
        line = (f"the baseline scores {base}: this model cannot do this task reliably, so the accuracies say "
                f"little about the policy; use a task it can do")
        return [line]
    return []


@dataclass
class RunPlan:
    """What `run` does, decided once before the engine opens (`plan_run`).

    Attributes:
        policy, params, settings, window: the policy (`tdutils.policies.Policy`), its parameters as given, its
            checked settings, and the recent tokens it always keeps (None: the policy decides).
        name: the dropped configuration's name (`snapkv@0.5`, `/layer` or `/head` appended for a granularity).
        rows: the dataset's rows (`tdutils.eval.tasks.load_rows`); generated: they are a task's examples, made for
            the model's tokenizer (token ids), rather than read.
        task: the task whose scorer scores the rows (`tdutils.eval.tasks.dataset_task`); None: no accuracy.
        scored: the rows with a gold answer (none for a random-weight model: its outputs mean nothing).
        random_weights: the model is `random:ARCH` (throughput only).
        kv_budget: the KV budget the runs decode under (`kv_budget_meta`), set when the engine opens.
    """

    policy: object
    params: dict
    settings: object
    window: int | None
    name: str
    rows: list
    generated: bool
    task: object
    scored: list
    random_weights: bool
    kv_budget: dict = field(default_factory=dict)


def plan_run(args) -> RunPlan:
    """Check every option of `run` that can be checked without the model, load the dataset and pick its scorer.

    Raises:
        UsageError: a bad policy parameter or granularity, a dataset whose gold answers cannot be scored.
        ValueError: those of `load_rows` (a missing file, a context length the model cannot hold, ...).
    """
    check_threads(args.threads)
    policy, params, settings = _plan_policy(args)
    # the model name resolved once; a broken local folder fails before the dataset loads
    model_ref = resolve_model(args.model, weights=args.engine == "hf")
    random_weights = model_ref.kind == "random"
    if args.dataset is None:
        # the bundled sample for the bundled model and for random (throughput-only) models: no download; a real
        # model gets a task it can do (a RULER needle: SmolLM2-135M scores chance on the multiple-choice sample)
        local = model_ref.kind in ("bundled", "random")
        args.dataset = SAMPLE_NAME if local else REAL_MODEL_DATASET
    generated = args.dataset in task_names() and get_task(args.dataset).suite != SAMPLES
    if not generated and args.context_length is not None:  # read prompts keep their own length
        raise UsageError(f"--context-length {args.context_length} applies to task datasets (such as --dataset "
                         f"{REAL_MODEL_DATASET} or passkey), whose prompts are built at that length; dataset "
                         f"{args.dataset!r} is read as it is: drop --context-length or pick a task dataset")
    if generated:  # before the prompts are built (a 300k-token prompt takes seconds and gigabytes to make)
        args.context_length = args.context_length or DEFAULT_CONTEXT_LENGTH
        task = get_task(args.dataset)
        if task.check_model is not None:
            task.check_model(args.model, f"--dataset {args.dataset}")
        check_context_lengths([args.context_length], context_window(args.model, progress=not args.no_progress),
                              model=args.model, option="--context-length", decode_tokens=args.max_tokens,
                              decode_option="--max-tokens")
    try:
        rows = load_rows(args.dataset, num_requests=args.num_requests, model=args.model,
                         context_tokens=args.context_length or DEFAULT_CONTEXT_LENGTH, chat_template=args.chat_template)
    except ContextTooShort as exc:  # its message names the RULER task and `context_tokens`, not run's options
        raise UsageError(f"--dataset {args.dataset}: --context-length {args.context_length} is too short for the "
                         f"task's template and needles; this tokenizer needs at least {exc.need} tokens: give a "
                         "larger --context-length") from None
    if generated:
        print(f"dataset {args.dataset}: {plural(len(rows), 'prompt')} of {args.context_length} tokens, chat template "
              f"{'applied' if rows[0].meta.get('chat_template') else 'not applied'}", flush=True)
    scored = [] if random_weights else [r for r in rows if r.answer is not None]
    task = None
    if scored:  # unscorable gold answers fail now, before any work
        try:
            task = dataset_task(args.dataset, scored)
            score_rows(scored, [""] * len(scored), task=task)
        except ValueError as exc:
            raise UsageError(f"dataset {args.dataset!r}: {exc}") from None
    name = f"{args.policy}@{args.drop_ratio:g}" + ("" if args.granularity == "request" else f"/{args.granularity}")
    return RunPlan(policy, params, settings, getattr(settings, "window", None), name, rows, generated, task, scored,
                   random_weights)


def _plan_policy(args):
    """`(policy, params, settings)` of `run`'s `--policy` and its options, checked (UsageError naming the options)."""
    params = policy_params(args, args.policy)
    policy = get_policy(args.policy)
    try:
        settings = checked_params(args.policy, params)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        policy_granularity(policy, args.policy, args.granularity, option="--granularity ")  # make_drop_fn's check
    except ValueError as exc:
        raise UsageError(f"--granularity {args.granularity}: {exc}") from None
    if args.granularity != "request" and args.engine != "hf":
        raise UsageError(f"--granularity {args.granularity} needs --engine hf: LMCache stores one token list per request")
    return policy, params, settings


def open_run_engine(args, plan: RunPlan):
    """Open `run`'s engine, tokenize the rows and set the KV budget: `(engine, prompt ids)`.

    Raises:
        UsageError: a KV budget that cannot hold one undropped request, prompts plus `--max-tokens` beyond the
            model's positions, or a `--window` not shorter than the shortest prompt.
    """
    if args.no_progress:
        from transformers.utils import logging as hf_logging  # transformers: seconds to import, only here

        hf_logging.disable_progress_bar()
    # the server addresses go to the engines that take them (lmcache), not to in-process ones (hf, a user's own)
    takes = inspect.signature(engine_class(args.engine)).parameters
    if args.kv_budget_gb is not None and "kv_budget_bytes" not in takes:
        raise UsageError(f"--kv-budget-gb: the {args.engine} engine takes its KV budget in tokens only (it does not "
                         f"choose its cache's dtype: on lmcache vLLM does, vllm serve --dtype); give --kv-budget-tokens")
    servers = {k: v for k, v in (("vllm_url", args.vllm_url), ("lmcache_url", args.lmcache_url),
                                 ("lmcache_http_url", args.lmcache_http_url)) if k in takes}
    check_server_urls(servers)  # before the engine opens: a typo is not a server that does not answer
    engine = open_engine(args.engine, model=args.model, dtype=args.dtype, device=args.device,
                         positions=args.positions, progress=not args.no_progress,
                         query_window=plan.policy.rows(plan.settings), chat_template=args.chat_template, **servers)
    prompt_ids = engine.tokenize(plan.rows)  # text rows wrapped in the chat template here; generated rows are ids
    if not plan.generated:
        print(f"dataset {args.dataset}: {plural(len(plan.rows), 'prompt')}, chat template "
              f"{'applied' if uses_chat_template(engine.tokenizer, args.chat_template) else 'not applied'}", flush=True)
    plan.kv_budget = set_kv_budget(args, engine, prompt_ids)
    longest, shortest = max(map(len, prompt_ids)), min(map(len, prompt_ids))
    need = longest + args.max_tokens
    max_pos = getattr(engine.config, "max_position_embeddings", None)
    if max_pos and need > max_pos:  # the baseline decodes at T..T+m-1
        raise UsageError(f"the longest prompt ({longest} tokens) plus --max-tokens {args.max_tokens} "
                         f"exceeds the model's {max_pos} positions (max_position_embeddings); lower --max-tokens")
    if plan.window is not None and plan.window >= shortest:  # the window is always kept: nothing would be dropped
        raise UsageError(f"--window {plan.window} is not shorter than the shortest prompt ({shortest} tokens); "
                         f"the {args.policy} window is always kept, so nothing would be dropped: give a smaller --window")
    return engine, prompt_ids


GIB = 2 ** 30  # --kv-budget-gb's unit


def set_kv_budget(args, engine, prompt_ids) -> dict:
    """Set `engine`'s KV budget from `--kv-budget-gb` (bytes), `--kv-budget-tokens` or the default
    (`default_kv_budget`), and return `kv_budget_meta(engine, applies)`.

    Raises:
        UsageError: a budget that cannot hold one undropped request of the baseline (longest prompt +
            `--max-tokens` tokens); the message gives the least budget that does, in the option's unit.
    """
    need = max(map(len, prompt_ids)) + args.max_tokens
    if args.kv_budget_gb is not None:
        nbytes, per = round(args.kv_budget_gb * GIB), engine.facts.kv_bytes_per_token
        if nbytes < need * per:  # also refuses a budget below one token
            least = math.ceil(need * per / GIB * 1e6) / 1e6
            raise UsageError(f"--kv-budget-gb {args.kv_budget_gb:g} (= {nbytes // per:,} tokens at "
                             f"{_dtype_name(engine.facts.kv_dtype)}, {per:,} B per token) cannot hold one undropped "
                             f"request of the baseline ({need:,} tokens = longest prompt + --max-tokens); give at "
                             f"least --kv-budget-gb {least:g} (GiB)")
        engine.kv_budget_bytes = nbytes
        return kv_budget_meta(engine, "--kv-budget-gb")
    engine.kv_budget_tokens = args.kv_budget_tokens or default_kv_budget(map(len, prompt_ids), args.max_tokens)
    if engine.kv_budget_tokens < need:  # the baseline cannot drop: say so before any work
        raise UsageError(f"--kv-budget-tokens {engine.kv_budget_tokens} cannot hold one undropped request of the "
                         f"baseline ({need} tokens = longest prompt + --max-tokens); give at least {need}")
    return kv_budget_meta(engine, "--kv-budget-tokens" if args.kv_budget_tokens else "default")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_budget_meta(engine, applies: str) -> dict:
    """What `run` records about its KV budget: `applies` (the option that set it, or `"default"`), `tokens`
    (the budget admission enforces), and where the engine knows its cache's dtype (`kv_budget_bytes`: the hf
    engine) `bytes`, `gib`, `bytes_per_token` and `dtype`; `note` says it in one line, e.g. `KV budget 0.5 GiB
    (--kv-budget-gb) = 23,456 tokens at bfloat16 (22,880 B per token)`."""
    tokens = engine.kv_budget_tokens
    nbytes = getattr(engine, "kv_budget_bytes", None)
    meta = {"applies": applies, "tokens": tokens}
    origin = {"default": f"default: {DEFAULT_FULL_REQUESTS:g} undropped requests"}.get(applies, applies)
    if nbytes is None:  # the engine does not know its cache's bytes (lmcache: vLLM's dtype)
        return {**meta, "note": f"KV budget {tokens:,} tokens ({origin})"}
    per, dtype = engine.facts.kv_bytes_per_token, _dtype_name(engine.facts.kv_dtype)
    meta.update(bytes=nbytes, gib=nbytes / GIB, bytes_per_token=per, dtype=dtype)
    if applies == "--kv-budget-gb":
        note = f"KV budget {nbytes / GIB:g} GiB ({origin}) = {tokens:,} tokens at {dtype} ({per:,} B per token)"
    else:
        note = f"KV budget {tokens:,} tokens ({origin}) = {nbytes / GIB:.4g} GiB at {dtype} ({per:,} B per token)"
    return {**meta, "note": note}


def cmd_run(args) -> int:
    """`python -m tdutils run`: plan once (`plan_run`: options, dataset, scorer), open the engine
    (`open_run_engine`), compare the baseline with the dropped configuration (`tdutils.runs.compare`: A B A B ...,
    an untimed warm-up first) and report (`report_run`); Ctrl-C keeps the runs that finished (`Interrupted`)."""
    started = time.perf_counter()
    out = check_output_path(args.json_path, "--json", example="runs/run.json")  # before any work
    check_device_output(out, "--json")  # /dev/full would fail only after all the work
    plan = plan_run(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine, prompt_ids = open_run_engine(args, plan)
    with warnings.catch_warnings():  # ratio 1's warning: the run prints its own note, with the kept counts
        warnings.filterwarnings("ignore", message="drop_ratio=1 keeps only")
        drop_fn = make_drop_fn(args.policy, drop_ratio=args.drop_ratio, model_config=engine.facts,
                               rerotate=args.positions == "compact", granularity=args.granularity, **plan.params)
    print(f"engine={args.engine} model={args.model} dataset={args.dataset} requests={len(plan.rows)} "
          f"prompt tokens={sum(map(len, prompt_ids))} max_tokens={args.max_tokens} "
          f"kv_budget_tokens={engine.kv_budget_tokens} positions={args.positions}", flush=True)
    print(plan.kv_budget["note"], flush=True)
    try:
        results, table = compare(engine, prompt_ids, {plan.name: drop_fn}, max_tokens=args.max_tokens,
                                 repeats=args.repeats, progress=lambda line: print(line, flush=True))
    except Interrupted as stop:
        return _write_interrupted(args, plan, out, stop)
    status = report_run(args, plan, out, results, table, started=started)
    print(f"{duration_text(time.perf_counter() - started)} since the command started (model, dataset and warm-up "
          f"included)")
    return status


RUN_COLUMNS = ["requests", "prompt_tokens", "kv_tokens_after", "kept_fraction", "prefill_s", "modify_s",
               "decode_tokens", "decode_s", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "tpot_mean_s",
               "peak_batch", "kv_budget_tokens", "end_to_end_s", "decode_speedup", "decode_speedup_min",
               "decode_speedup_max", "capacity_limit"]


def report_run(args, plan: RunPlan, out, results, table, *, started: float | None = None) -> int:
    """Print `run`'s phase table, speed-up line, notes and accuracy, and write its JSON to `out`; exit status 0.
    `started`: the command's `time.perf_counter()` at its start; the JSON's `command_s` is the seconds from it to
    the report (model, dataset and warm-up included; None without it)."""
    name = plan.name
    runs = [m.to_dict() for pair in zip(results["baseline"].repeats, results[name].repeats) for m in pair]
    import pandas as pd  # seconds to import; `_preload` has it loaded before a run

    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", _fmt):
        print(table[RUN_COLUMNS].T.to_string())
    print(f"\n{metrics.speedup_line(table, name)}")
    timing = table.attrs.get("timing", {})
    print(timing_line(timing))
    speed_notes = metrics.speedup_notes(table) + ([PREFILL_ONCE_NOTE] if timing.get("prefill") == "once" else [])
    speed_notes += ratio_one_notes(args, results[name]) + stored_notes(args, table, name)
    for line in speed_notes:
        print(f"note: {line}")
    accuracy, notes = _accuracy(args, plan, results)
    report = {"args": _args_dict(args), "threads": torch.get_num_threads(), "interrupted": False,
              "kv_budget": plan.kv_budget,
              "decode_speedups": metrics.repeat_ratios(results["baseline"], results[name]),
              "decode_speedup_median": float(table.loc[name, "decode_speedup"]), "accuracy": accuracy, "timing": timing,
              "notes": [*notes, *speed_notes],  # the JSON keeps every note the run printed
              "answers": run_answers(results), "gold": [r.answer for r in plan.rows],
              "table": json.loads(table.reset_index().to_json(orient="records")),
              "runs": runs,
              "command_s": None if started is None else time.perf_counter() - started}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _write_interrupted(args, plan: RunPlan, out, stop: Interrupted) -> int:
    """Ctrl-C stopped `run`: write the finished runs to `out`, marked `"interrupted": true`; exit status 130."""
    accuracy, notes = _accuracy(args, plan, stop.results, quiet=True)
    if not stop.runs:
        print("python -m tdutils run: interrupted before any run finished; nothing was written", file=sys.stderr)
        return INTERRUPTED
    report = {"args": _args_dict(args), "threads": torch.get_num_threads(), "interrupted": True,
              "kv_budget": plan.kv_budget, "accuracy": accuracy, "notes": notes, "answers": run_answers(stop.results),
              "gold": [r.answer for r in plan.rows], "runs": [m.to_dict() for m in stop.runs]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    print(f"python -m tdutils run: interrupted; what finished ({plural(len(stop.runs), 'run')}) is in {out} "
          f"(\"interrupted\": true)", file=sys.stderr)
    return INTERRUPTED


def ratio_one_notes(args, dropped) -> list[str]:
    """At `--drop-ratio 1`, one note: what the dropped run (`RunResult`) kept per request (its policy's protected
    tokens; `tdutils.selection.keep_count`: ratio 1 keeps 0, the policies still keep those), read from its outputs."""
    if args.drop_ratio != 1:
        return []
    kept = sorted({o.cached_tokens for o in dropped.outputs})
    span = f"{kept[0]}" if len(kept) == 1 else f"{kept[0]}-{kept[-1]}"
    note = (f"--drop-ratio 1 keeps only the tokens {args.policy} always keeps (its protected tokens: {span} KV "
            f"tokens per request), not 0: the ratio, capacity limit and accuracy are those of that set alone")
    return [note]


def stored_notes(args, table, name: str) -> list[str]:
    """Notes on what a run's figures rest on: a single repeat (no spread to show noise), and a dropped run that
    stores more than `1 - drop_ratio` of the prompt (protected tokens; per-head budgets padded per layer) or fewer
    (a policy whose keep count rounds per chunk, e.g. middle_chunk's `round(chunk_size * r)` of a short chunk)."""
    notes = []
    if args.repeats == 1:
        notes.append("--repeats 1: each figure is one measurement, with no spread to show a busy machine (which can "
                     "move a ratio 2x or more); use --repeats 3 (the default) for a ratio to rely on")
    kept, want = float(table.loc[name, "kept_fraction"]), 1 - args.drop_ratio
    if args.drop_ratio < 1 and kept > want + 0.05:
        notes.append(f"{name} stores {kept:.2f} of the prompt's KV tokens, not 1 - {args.drop_ratio:g} = {want:.2f}: "
                     "its protected tokens (window, sinks) or, for per-head budgets (AdaKV, PyramidKV), each layer "
                     "stored at its largest head's count; the capacity limit and the speed-up follow what is stored")
    elif args.drop_ratio < 1 and kept < want - 0.05:
        notes.append(f"{name} stores {kept:.2f} of the prompt's KV tokens, fewer than 1 - {args.drop_ratio:g} = "
                     f"{want:.2f}: the policy's keep count rounds per unit it drops (e.g. middle_chunk drops "
                     f"round(chunk_size x r) tokens of each chunk: a small --chunk-size rounds far from r); its "
                     "accuracy and speed-up are those of the ratio stored")
    return notes


def run_answers(results) -> dict:
    """`{run name: [answer per request]}`, in the dataset's order: each request's scored answer
    (`RequestOutput.answer`, the text up to its first EOS token) of the last repeat (greedy: the same every repeat),
    so a reader of the JSON sees why a request was scored wrong."""
    return {run_name: [o.answer for o in res.outputs] for run_name, res in results.items()}


def _args_dict(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


EOS_NOTE = ("answers are scored up to each response's first EOS token: decoding ignores EOS so that every run "
            "decodes the same number of tokens, and what a model writes after its EOS is not its answer")


def _accuracy(args, plan: RunPlan, results, *, quiet: bool = False):
    """`(accuracy, notes)` of the finished runs: `{run name: ScoreReport.to_dict()}` over the rows with a gold
    answer (`plan.scored`, by `plan.task`'s scorer), and the notes printed with them (what the figures mean, or
    why there are none). Prints the accuracy and note lines unless `quiet`."""
    notes = []
    if plan.random_weights:
        notes.append(f"no accuracy: {args.model} has random weights (a real architecture's shapes, for throughput "
                     f"and memory only), so its answers mean nothing")
    elif not plan.scored:
        notes.append("no accuracy: no row of the dataset has a gold 'answer'")
    reports = {}
    ok = [r.answer is not None for r in plan.rows]
    if plan.scored:
        reports = {run_name: score_rows(plan.scored, [o.answer for o, has in zip(res.outputs, ok) if has],
                                        task=plan.task) for run_name, res in results.items()}
    for run_name, rep in reports.items():
        lo, hi = rep.ci95 or (float("nan"), float("nan"))
        if not quiet:
            print(f"accuracy {run_name} ({rep.mode}): {rep} [95% CI {100 * lo:.0f}-{100 * hi:.0f}%]")
    if reports:
        chance = 1 / len(CHOICES) if plan.task.name == MC_SAMPLE_NAME else None  # four-choice guessing
        notes += accuracy_notes(reports, chance=chance, missing=len(plan.rows) - len(plan.scored)) + [EOS_NOTE]
    if not quiet:
        for line in notes:
            print(f"note: {line}")
    return {run_name: {**rep.to_dict(), "is_correct": _per_request(rep.is_correct, ok)}
            for run_name, rep in reports.items()}, notes


def _per_request(marks: list[bool], scored: list[bool]) -> list[bool | None]:
    """The scorer's marks (one per row with a gold answer) laid out per request, None where a row has none."""
    it = iter(marks)
    return [next(it) if has else None for has in scored]


def _preload(command: str) -> None:
    """Import what `run` and `eval` import first anyway (pandas, transformers' model classes: seconds), so that a
    Ctrl-C during those imports ends the process in one line instead of interrupting an import halfway (a
    half-imported module fails later with an unrelated ImportError, and a library's `except BaseException` can
    swallow the interrupt)."""
    if command in ("run", "eval"):
        import pandas  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # tdutils/
BROKEN_PIPE = 141  # exit status of a writer whose reader went away (`| head`): 128 + SIGPIPE, what a shell reports


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` for the commands: tdutils' own warnings as one `tdutils: warning: ...` line (they
    are written for the user, the source line says nothing to them), any other library's as Python prints it."""
    if str(filename).startswith(_PACKAGE_DIR):
        print(f"tdutils: warning: {message}", file=sys.stderr if file is None else file, flush=True)
    else:
        _SHOW_WARNING(message, category, filename, lineno, file, line)


_SHOW_WARNING = warnings.showwarning


def main(argv=None) -> int:
    """Parse `argv`, run the subcommand and return its exit status: bad input in one line with status 2,
    anything else (a bug) with its traceback and a line asking for a report, status 1 (`args.report_error`);
    Ctrl-C in one line with status 130 (`INTERRUPTED`; `run` and `eval` first write what they finished), SIGTERM
    likewise with status 143; a closed output pipe (`| head`) quietly with status 141. tdutils' own warnings print
    as one `tdutils: warning: ...` line."""
    args = build_parser().parse_args(argv)
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        _preload(args.command)  # while Ctrl-C still ends the process at once (tdutils.cli.startup, tdutils/__init__.py)
        interrupt_as_exception()  # from here the commands catch KeyboardInterrupt and keep what they finished
        status = args.func(args)
        return interrupted_status() if status == INTERRUPTED else status  # SIGTERM: 143, as a shell reports it
    except BrokenPipeError:  # the reader of stdout went away: stop as a pipe's writer does, without a message
        import os

        with open(os.devnull, "wb") as devnull:  # nor one at exit, flushing into the pipe
            os.dup2(devnull.fileno(), sys.stdout.fileno())
        return BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C before a subcommand had results to keep (run and eval keep theirs)
        print(f"python -m tdutils {args.command}: interrupted; nothing was written", file=sys.stderr)
        return interrupted_status()
    except Exception as exc:  # noqa: BLE001 - every error is reported, bugs with their traceback
        # name the subcommand, as argparse does for a bad option: "python -m tdutils eval: error: ..."
        return report_error(exc, prog=f"python -m tdutils {args.command}")
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
