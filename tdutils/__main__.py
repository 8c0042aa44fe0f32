"""Command line: `python -m tdutils run --policy snapkv --drop-ratio 0.5`.

`run` runs the baseline and the dropped configuration on the same prompts, alternately (`--repeats`, default 3,
times), prints the phase table (medians over repeats) with the decode-throughput ratio (median of the per-repeat
ratios, min-max), a note when that ratio does not measure what dropping buys (`tdutils.metrics.speedup_notes`:
busy machine, no larger batch, slower despite a larger batch, above the capacity limit), and writes JSON.
Other subcommands live next to their code (see `SUBCOMMANDS`).
Bad input is reported in one line with exit status 2; anything else is a bug and shows its traceback
and a request to report it, exit status 1 (`tdutils.cli_args.report_error`). Ctrl-C stops a command in one line
with exit status 130; `run` and `eval` first write what they finished to their `--json`, marked
`"interrupted": true`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from .cli_args import (
    INTERRUPTED,
    OneLineParser,
    UsageError,
    drop_ratio,
    interrupt_as_exception,
    positive_int,
    report_error,
)

# Subcommands defined in other modules: name -> (module, help). Each module provides
# `add_arguments(parser)` and `run(args) -> int` (exit status).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("tdutils.eval.cli", ("accuracy of policies x drop ratios x context lengths: passkey, or RULER-style "
                                  "tasks in query-aware / query-agnostic mode")),
    "doctor": ("tdutils.doctor", "check a vLLM + LMCache serving setup end to end and print what to fix"),
    "patches": ("tdutils.serving.patches", "check, apply or revert the vLLM / LMCache patches of the serving path"),
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
    from .policies import get_policy, policy_names

    names = policy_names()
    run.add_argument("--policy", choices=names, default="snapkv", metavar="{" + ",".join(names) + "}",
                     help="token-selection policy (default: snapkv): " + "; ".join(
                         f"{n}: {get_policy(n).summary}" for n in names))
    run.add_argument("--drop-ratio", type=drop_ratio, default=0.5,
                     help="fraction of each request's tokens to drop, in [0, 1] (default: 0.5)")
    from .engines import engine_kinds

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
                          "choice), a RULER template task such as 'ruler_niah_single_1' (built for the model's "
                          "tokenizer at --context-length tokens), a .jsonl/.json/.csv/.parquet file with a 'prompt' "
                          "column, or a hub dataset id such as raniayu/token-dropping-demo (default: 'sample' for "
                          f"the bundled and random models; '{REAL_MODEL_DATASET}' for real models)")
    run.add_argument("--context-length", type=positive_int, default=2048,
                     help="RULER template datasets: prompt tokens per request (default: 2048)")
    run.add_argument("--chat-template", choices=("auto", "none"), default="auto",
                     help="'auto' wraps every prompt as a user turn in the tokenizer's chat template when it has one "
                          "(default; instruction-tuned models answer raw prompts poorly); 'none' never")
    run.add_argument("--num-requests", type=positive_int, default=16, help="prompts to run (default: 16)")
    run.add_argument("--max-tokens", type=positive_int, default=64,
                     help="decode tokens per request, EOS ignored (default: 64)")
    run.add_argument("--kv-budget-tokens", type=positive_int, default=None,
                     help="KV tokens the decode batch may hold (cache lengths + tokens still to generate); "
                          "default: 4.25 undropped requests, ceil(4.25 x (longest prompt + max tokens)): the baseline decodes 4 at "
                          "a time, 8 requests at drop ratio 0.5 fit")
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
    from .policies.cli import policy_arguments

    policy_arguments(run)  # --window, --n-sink, --kernel-size, ...: one per policy parameter
    run.add_argument("--dtype", default="auto", help="model dtype: auto, float32, float16, bfloat16 (default: auto)")
    run.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
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


def _chance(rows) -> float | None:
    """Accuracy of guessing: 1/4 for multiple-choice rows (gold A-D), None otherwise (a passkey has no chance level
    worth naming)."""
    from .answers import CHOICES

    gold = [getattr(r, "answer", None) for r in rows or []]
    return 1 / len(CHOICES) if gold and all(str(g).strip() in CHOICES for g in gold) else None


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


def cmd_run(args) -> int:
    import pandas as pd

    from . import make_drop_fn, open_engine
    from .data import load_prompts
    from .eval.common import check_output_path
    from .metrics import phase_table, repeat_ratios, speedup_line, speedup_notes
    from .runs import RunResult, alternate_runs, default_kv_budget

    out = check_output_path(args.json_path, "--json", example="runs/run.json")  # before any work
    from .cli_args import check_device_output

    check_device_output(out, "--json")  # /dev/full would fail only after all the work
    from .policies import get_policy
    from .policies.cli import policy_params

    params = policy_params(args, args.policy)
    policy = get_policy(args.policy)
    try:
        settings = policy.make_params(**params)
    except ValueError as exc:  # the policy's own check ("window must be ..."): name the options given
        named = [f"--{k.replace('_', '-')} {v}" for k, v in params.items() if k in str(exc)] or \
            [f"--{k.replace('_', '-')} {v}" for k, v in params.items()]
        raise UsageError(f"{', '.join(named)}: {exc}" if named else str(exc)) from None
    if args.granularity not in policy.granularities:
        raise UsageError(f"--granularity {args.granularity}: policy {args.policy!r} keeps one set per request only; "
                         "drop --granularity (or give --granularity request)")
    if args.granularity != "request" and args.engine != "hf":
        raise UsageError(f"--granularity {args.granularity} needs --engine hf: LMCache stores one token list per request")
    window = getattr(settings, "window", None)  # protected recent tokens (None: the policy decides)
    from .models import resolve_model

    # the model name resolved once; a broken local folder fails before the dataset loads
    model_ref = resolve_model(args.model, weights=args.engine == "hf")
    if args.dataset is None:
        from .data import SAMPLE_NAME

        # the bundled sample for the bundled model and for random (throughput-only) models: no download; a real
        # model gets a task it can do (a RULER needle: SmolLM2-135M scores chance on the multiple-choice sample)
        local = model_ref.kind in ("bundled", "random")
        args.dataset = SAMPLE_NAME if local else REAL_MODEL_DATASET
    from .eval.tasks import task_names

    ruler_task = args.dataset if args.dataset in task_names("ruler") else None
    if ruler_task is not None:
        from .models import check_context_lengths, context_window
        from .ruler import check_ruler_model

        check_ruler_model(model_ref, f"--dataset {ruler_task}")
        # before the prompts are built (a 300k-token prompt takes seconds and gigabytes to make)
        check_context_lengths([args.context_length], context_window(args.model, progress=not args.no_progress),
                              model=args.model, option="--context-length", decode_tokens=args.max_tokens,
                              decode_option="--max-tokens")
    # RULER template rows are made for the model's own tokenizer
    rows = load_prompts(args.dataset, num_requests=args.num_requests, model=args.model,
                        context_tokens=args.context_length, chat_template=args.chat_template)
    if ruler_task is not None:
        print(f"dataset {ruler_task}: {len(rows)} prompts of {args.context_length} tokens, chat template "
              f"{'applied' if rows[0].meta['chat_template'] else 'not applied'}", flush=True)
    # Accuracy is scored over the rows with a gold answer, and not at all for a random-weight model (its outputs
    # mean nothing); unscorable gold answers fail now, before any work.
    random_weights = model_ref.kind == "random"
    scored = [] if random_weights else [r for r in rows if r.answer is not None]
    if scored:
        from .answers import score_rows

        try:
            score_rows(scored, [""] * len(scored))
        except ValueError as exc:
            raise UsageError(f"dataset {args.dataset!r}: {exc}") from None
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    servers = {} if args.engine == "hf" else {
        "vllm_url": args.vllm_url, "lmcache_url": args.lmcache_url, "lmcache_http_url": args.lmcache_http_url}
    engine = open_engine(args.engine, model=args.model, dtype=args.dtype, device=args.device,
                         positions=args.positions, progress=not args.no_progress,
                         query_window=policy.rows(settings), chat_template=args.chat_template,
                         **servers)  # 0: nothing captured
    prompt_ids = engine.tokenize(rows)  # text rows wrapped in the chat template here; RULER rows are ids already
    if ruler_task is None:
        from .chat import uses_chat_template

        print(f"dataset {args.dataset}: {len(rows)} prompts, chat template "
              f"{'applied' if uses_chat_template(engine.tokenizer, args.chat_template) else 'not applied'}", flush=True)
    if args.kv_budget_tokens is None:
        engine.kv_budget_tokens = default_kv_budget(map(len, prompt_ids), args.max_tokens)
    else:
        engine.kv_budget_tokens = args.kv_budget_tokens
    need = max(map(len, prompt_ids)) + args.max_tokens
    if engine.kv_budget_tokens < need:  # the baseline cannot drop: say so before any work
        raise UsageError(f"--kv-budget-tokens {engine.kv_budget_tokens} cannot hold one undropped request of the "
                         f"baseline ({need} tokens = longest prompt + --max-tokens); give at least {need}")
    max_pos = getattr(engine.config, "max_position_embeddings", None)
    if max_pos and max(map(len, prompt_ids)) + args.max_tokens > max_pos:  # the baseline decodes at T..T+m-1
        raise UsageError(f"the longest prompt ({max(map(len, prompt_ids))} tokens) plus --max-tokens {args.max_tokens} "
                         f"exceeds the model's {max_pos} positions (max_position_embeddings); lower --max-tokens")
    shortest = min(map(len, prompt_ids))
    if window is not None and window >= shortest:  # the window is always kept: nothing would be dropped
        raise UsageError(f"--window {window} is not shorter than the shortest prompt ({shortest} tokens); "
                         f"the {args.policy} window is always kept, so nothing would be dropped: give a smaller --window")
    drop_fn = make_drop_fn(args.policy, drop_ratio=args.drop_ratio, model_config=engine.facts,
                           rerotate=args.positions == "compact", granularity=args.granularity, **params)
    name = f"{args.policy}@{args.drop_ratio:g}" + ("" if args.granularity == "request" else f"/{args.granularity}")
    print(f"engine={args.engine} model={args.model} dataset={args.dataset} requests={len(rows)} "
          f"prompt tokens={sum(map(len, prompt_ids))} max_tokens={args.max_tokens} "
          f"kv_budget_tokens={engine.kv_budget_tokens} positions={args.positions}", flush=True)

    # A B A B ...: both configurations see the same machine noise, each ratio is taken within one repeat; an
    # untimed warm-up of both comes first (a process's first forward passes can be many times slower). The runs
    # are collected here (as `compare` does) so that Ctrl-C keeps the ones that finished.
    results: dict[str, RunResult] = {}
    finished = []
    try:
        for _, run_name, res, _ in alternate_runs(
                engine, prompt_ids, {name: drop_fn}, max_tokens=args.max_tokens, repeats=args.repeats,
                progress=(lambda line: print(line, flush=True)) if args.repeats > 1 else None):
            earlier = results[run_name].repeats if run_name in results else []
            results[run_name] = RunResult(run_name, res.outputs, res.metrics, repeats=[*earlier, res.metrics])
            finished.append(res.metrics)
    except KeyboardInterrupt:
        accuracy, notes = _accuracy(rows, scored, results, random_weights, args.model, ruler_task, quiet=True)
        report = {"args": _args_dict(args), "interrupted": True, "accuracy": accuracy, "notes": notes,
                  "runs": [m.to_dict() for m in finished]}
        if not finished:
            print("python -m tdutils run: interrupted before any run finished; nothing was written", file=sys.stderr)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
            print(f"python -m tdutils run: interrupted; the {len(finished)} finished run(s) are in {out} "
                  f"(\"interrupted\": true)", file=sys.stderr)
        return INTERRUPTED
    table = phase_table(results.values(), baseline="baseline")
    runs = [m.to_dict() for pair in zip(results["baseline"].repeats, results[name].repeats) for m in pair]
    speedups = repeat_ratios(results["baseline"], results[name])
    med = float(table.loc[name, "decode_speedup"])
    cols = ["requests", "prompt_tokens", "kv_tokens_after", "kept_fraction", "prefill_s", "modify_s", "decode_tokens", "decode_s",
            "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "tpot_mean_s", "peak_batch", "kv_budget_tokens",
            "end_to_end_s", "decode_speedup", "decode_speedup_min", "decode_speedup_max", "capacity_limit"]
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", _fmt):
        print(table[cols].T.to_string())
    print(f"\n{speedup_line(table, name)}")
    speed_notes = speedup_notes(table)
    for line in speed_notes:
        print(f"note: {line}")
    accuracy, notes = _accuracy(rows, scored, results, random_weights, args.model, ruler_task)
    notes = [*notes, *speed_notes]  # the JSON keeps every note the run printed
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": _args_dict(args), "interrupted": False, "decode_speedups": speedups,
              "decode_speedup_median": med, "accuracy": accuracy, "notes": notes,
              "table": json.loads(table.reset_index().to_json(orient="records")), "runs": runs}
    out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _args_dict(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


EOS_NOTE = ("answers are scored up to each response's first EOS token: decoding ignores EOS so that every run "
            "decodes the same number of tokens, and what a model writes after its EOS is not its answer")


def _accuracy(rows, scored, results, random_weights: bool, model: str, ruler_task, *, quiet: bool = False):
    """`(accuracy, notes)` of the finished runs: `{run name: ScoreReport.to_dict()}` over the rows with a gold
    answer (`scored`), and the notes printed with them (what the figures mean, or why there are none). Prints the
    accuracy and note lines unless `quiet`."""
    from .answers import score_rows

    notes = []
    if random_weights:
        notes.append(f"no accuracy: {model} has random weights (a real architecture's shapes, for throughput "
                     f"and memory only), so its answers mean nothing")
    elif not scored:
        notes.append("no accuracy: no row of the dataset has a gold 'answer'")
    reports = {}
    if scored:
        ok = [r.answer is not None for r in rows]
        reports = {run_name: score_rows(scored, [o.answer for o, has in zip(res.outputs, ok) if has])
                   for run_name, res in results.items()}
    for run_name, rep in reports.items():
        lo, hi = rep.ci95 or (float("nan"), float("nan"))
        if not quiet:
            print(f"accuracy {run_name} ({rep.mode}): {rep} [95% CI {100 * lo:.0f}-{100 * hi:.0f}%]")
    if reports:
        notes += accuracy_notes(reports, chance=None if ruler_task else _chance(scored),
                                missing=len(rows) - len(scored)) + [EOS_NOTE]
    if not quiet:
        for line in notes:
            print(f"note: {line}")
    return {run_name: rep.to_dict() for run_name, rep in reports.items()}, notes


def _preload(command: str) -> None:
    """Import what `run` and `eval` import first anyway (pandas, transformers' model classes: seconds), so that a
    Ctrl-C during those imports ends the process in one line instead of interrupting an import halfway (a
    half-imported module fails later with an unrelated ImportError, and a library's `except BaseException` can
    swallow the interrupt)."""
    if command in ("run", "eval"):
        import pandas  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def main(argv=None) -> int:
    """Parse `argv`, run the subcommand and return its exit status: bad input in one line with status 2,
    anything else (a bug) with its traceback and a line asking for a report, status 1 (`cli_args.report_error`);
    Ctrl-C in one line with status 130 (`INTERRUPTED`; `run` and `eval` first write what they finished)."""
    args = build_parser().parse_args(argv)
    try:
        _preload(args.command)  # while Ctrl-C still ends the process at once (cli_args, tdutils/__init__.py)
        interrupt_as_exception()  # from here the commands catch KeyboardInterrupt and keep what they finished
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C before a subcommand had results to keep (run and eval keep theirs)
        print(f"python -m tdutils {args.command}: interrupted; nothing was written", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every error is reported, bugs with their traceback
        # name the subcommand, as argparse does for a bad option: "python -m tdutils eval: error: ..."
        return report_error(exc, prog=f"python -m tdutils {args.command}")


if __name__ == "__main__":
    sys.exit(main())
