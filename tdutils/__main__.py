"""Command line: `python -m tdutils run --policy snapkv --drop-ratio 0.5`.

`run` runs the baseline and the dropped configuration on the same prompts, alternately (`--repeats`
times), prints the phase table (medians over repeats) with the decode-throughput ratio, and writes JSON.
Other subcommands live next to their code (see `SUBCOMMANDS`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys

from .cli_args import OneLineParser, positive_int

POLICIES = ("snapkv", "rkv", "random", "middle_chunk")

# Subcommands defined in other modules: name -> (module, help). Each module provides
# `add_arguments(parser)` and `run(args) -> int` (exit status).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("tdutils.evaluate", "passkey-retrieval accuracy of policies x drop ratios x context lengths"),
    "doctor": ("tdutils.doctor", "check a vLLM + LMCache serving setup end to end and print what to fix"),
}


def _ratio(text: str) -> float:
    from .selection import check_drop_ratio

    try:
        return check_drop_ratio(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fmt(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.4g}"


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m tdutils", description="Token dropping for long-context LLM decoding.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = sub.add_parser(
        "run", help="baseline vs token dropping: phase metrics and the decode-throughput ratio",
        description="Prefill the prompts, drop tokens from every request's KV cache with a policy, decode under "
                    "a fixed KV budget, and compare with the baseline (no dropping) on the same prompts.")
    run.add_argument("--policy", choices=POLICIES, default="snapkv",
                     help="token-selection policy: snapkv (attention of the last prompt tokens), rkv (importance "
                          "minus redundancy), random, middle_chunk (the LMCache reference's chunk-middle dropping) "
                          "(default: snapkv)")
    run.add_argument("--drop-ratio", type=_ratio, default=0.5,
                     help="fraction of each request's tokens to drop, in [0, 1] (default: 0.5)")
    run.add_argument("--engine", choices=("hf", "lmcache"), default="hf",
                     help="hf: embedded transformers engine (default); lmcache: vLLM + LMCache serving path")
    run.add_argument("--vllm-url", default="http://localhost:8000", help="lmcache engine: vLLM server URL")
    run.add_argument("--lmcache-url", default="tcp://localhost:6555", help="lmcache engine: LMCache server (SDK port)")
    run.add_argument("--lmcache-http-url", default="http://localhost:8080", help="lmcache engine: LMCache HTTP API")
    run.add_argument("--model", default="tiny-qwen3",
                     help="bundled model name, hub id (e.g. Qwen/Qwen3-0.6B), local folder, or random:ARCH:NL (a real-shaped "
                          "random model, e.g. random:qwen3-0.6b:4L, for throughput only) (default: tiny-qwen3)")
    run.add_argument("--dataset", default=None,
                     help="'sample' (bundled passkey prompts, ~1k tokens), 'mc-sample' (bundled English multiple "
                          "choice), a .jsonl/.json/.csv/.parquet file with a 'prompt' column, or a hub dataset id "
                          "(default: 'sample' for the bundled model, which reads no English; for other models "
                          "raniayu/token-dropping-demo, or 'mc-sample' when the hub is unreachable)")
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
    run.add_argument("--repeats", type=positive_int, default=1,
                     help="baseline and dropped run alternately this many times; the table shows medians")
    run.add_argument("--window", type=positive_int, default=None,
                     help="observation window: the last prompt tokens always kept, whose queries vote in snapkv "
                          "(default: 64 for snapkv, 16 for rkv and random)")
    run.add_argument("--kernel-size", type=positive_int, default=5, help="snapkv pooling kernel, odd (default: 5)")
    run.add_argument("--pooling", choices=("avg", "max"), default="avg", help="snapkv pooling (default: avg)")
    run.add_argument("--redundancy", choices=("exact", "reference", "tiled", "buffered"), default="exact",
                     help="rkv redundancy method (default: exact, linear memory)")
    run.add_argument("--seed", type=int, default=0, help="seed of the random policy (default: 0)")
    run.add_argument("--chunk-size", type=positive_int, default=256, help="chunk size of middle_chunk (default: 256)")
    run.add_argument("--dtype", default="auto", help="model dtype: auto, float32, float16, bfloat16 (default: auto)")
    run.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    run.add_argument("--json", dest="json_path", default="runs/run.json",
                     help="where to write the metrics as JSON (default: runs/run.json)")
    run.add_argument("--no-progress", action="store_true", help="hide progress bars")
    run.set_defaults(func=cmd_run)
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return ap


def cmd_run(args) -> int:
    import pandas as pd

    from . import make_drop_fn, open_engine
    from .data import load_prompts
    from .engines.base import default_kv_budget, run_once
    from .evaluate import check_output_path
    from .metrics import ratio_caveats

    out = check_output_path(args.json_path, "--json", example="runs/run.json")  # before any work
    from .models import _check_local

    _check_local(args.model, weights=args.engine == "hf")  # a broken local folder fails before the dataset loads
    if args.dataset is None:
        from .data import DEMO_DATASET, MC_SAMPLE_NAME, SAMPLE_NAME
        from .models import TINY_MODEL_NAME

        from .models import parse_random_name

        # the bundled sample for the bundled model and for random (throughput-only) models: no download
        local = args.model == TINY_MODEL_NAME or parse_random_name(args.model) is not None
        args.dataset = SAMPLE_NAME if local else DEMO_DATASET
        if args.dataset == DEMO_DATASET:
            try:
                rows = load_prompts(args.dataset, num_requests=args.num_requests)
            except ConnectionError:
                print(f"note: {DEMO_DATASET} is unreachable; using the bundled {MC_SAMPLE_NAME!r}", flush=True)
                args.dataset = MC_SAMPLE_NAME
    rows = load_prompts(args.dataset, num_requests=args.num_requests)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    params = {
        "snapkv": {"window": args.window or 64, "kernel_size": args.kernel_size, "pooling": args.pooling},
        "rkv": {"window": args.window or 16, "redundancy": args.redundancy},
        "random": {"seed": args.seed, "window": args.window or 16},
        "middle_chunk": {"chunk_size": args.chunk_size},
    }[args.policy]
    servers = {} if args.engine == "hf" else {
        "vllm_url": args.vllm_url, "lmcache_url": args.lmcache_url, "lmcache_http_url": args.lmcache_http_url}
    engine = open_engine(args.engine, model=args.model, dtype=args.dtype, device=args.device,
                         positions=args.positions, progress=not args.no_progress,
                         query_window=max(64, params.get("window", 0)), **servers)
    prompt_ids = engine.tokenize(rows)
    if args.kv_budget_tokens is None:
        engine.kv_budget_tokens = default_kv_budget(map(len, prompt_ids), args.max_tokens)
    else:
        engine.kv_budget_tokens = args.kv_budget_tokens
    need = max(map(len, prompt_ids)) + args.max_tokens
    if engine.kv_budget_tokens < need:  # the baseline cannot drop: say so before any work
        raise ValueError(f"--kv-budget-tokens {engine.kv_budget_tokens} cannot hold one undropped request of the "
                         f"baseline ({need} tokens = longest prompt + --max-tokens); give at least {need}")
    max_pos = getattr(engine.config, "max_position_embeddings", None)
    if max_pos and max(map(len, prompt_ids)) + args.max_tokens > max_pos:  # the baseline decodes at T..T+m-1
        raise ValueError(f"the longest prompt ({max(map(len, prompt_ids))} tokens) plus --max-tokens {args.max_tokens} "
                         f"exceeds the model's {max_pos} positions (max_position_embeddings); lower --max-tokens")
    shortest = min(map(len, prompt_ids))
    if params.get("window", 0) >= shortest:  # the window is always kept: nothing would be dropped
        raise ValueError(f"--window {params['window']} is not shorter than the shortest prompt ({shortest} tokens); "
                         f"the {args.policy} window is always kept, so nothing would be dropped: give a smaller --window")
    drop_fn = make_drop_fn(args.policy, drop_ratio=args.drop_ratio, model_config=engine.config,
                           rerotate=args.positions == "compact", **params)
    name = f"{args.policy}@{args.drop_ratio:g}"
    print(f"engine={args.engine} model={args.model} dataset={args.dataset} requests={len(rows)} "
          f"prompt tokens={sum(map(len, prompt_ids))} max_tokens={args.max_tokens} "
          f"kv_budget_tokens={engine.kv_budget_tokens} positions={args.positions}", flush=True)

    # Untimed warm-up of both configurations: the first forward passes of a process (allocator, kernels,
    # thread pools) can be many times slower and would otherwise count against the baseline.
    run_once(engine, prompt_ids[:4], name="warm-up", max_tokens=min(4, args.max_tokens))
    run_once(engine, prompt_ids[:4], name="warm-up", drop_fn=drop_fn, max_tokens=min(4, args.max_tokens))
    runs, speedups, texts = [], [], {}
    for rep in range(args.repeats):  # A B A B ...: both configurations see the same machine noise
        base = run_once(engine, prompt_ids, name="baseline", max_tokens=args.max_tokens)
        dropped = run_once(engine, prompt_ids, name=name, drop_fn=drop_fn, max_tokens=args.max_tokens)
        runs += [base.metrics.to_dict(), dropped.metrics.to_dict()]
        texts = {"baseline": base.texts, name: dropped.texts}  # greedy decoding: the same every repeat
        speedups.append(dropped.metrics.decode.tokens_per_s / base.metrics.decode.tokens_per_s)
        if args.repeats > 1:
            print(f"repeat {rep + 1}/{args.repeats}: decode speedup {speedups[-1]:.2f}x", flush=True)

    table = pd.DataFrame([r["summary"] for r in runs]).groupby("run", sort=False).median(numeric_only=True)
    med = statistics.median(speedups)
    # the median of per-repeat ratios (each against its own repeat's baseline), as in the last line
    table["decode_speedup"] = [1.0, med]
    cols = ["requests", "prompt_tokens", "kv_tokens_after", "kept_fraction", "prefill_s", "modify_s", "decode_tokens", "decode_s",
            "decode_tok_s", "tpot_mean_s", "peak_batch", "kv_budget_tokens", "end_to_end_s", "decode_speedup"]
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", _fmt):
        print(table[cols].T.to_string())
    print(f"\ndecode throughput ratio ({name} / baseline): {med:.2f}x"
          + (f" (median of {len(speedups)}; min {min(speedups):.2f}x, max {max(speedups):.2f}x)" if len(speedups) > 1 else ""))
    for line in ratio_caveats(int(table.loc["baseline", "peak_batch"]), int(table.loc[name, "peak_batch"]), med,
                               args.drop_ratio):
        print(f"note: {line}")
    accuracy = {}
    if all(r.answer is not None for r in rows):
        from .answers import score_rows

        for run_name, run_texts in texts.items():
            rep = score_rows(rows, run_texts)
            accuracy[run_name] = rep.to_dict()
            lo, hi = rep.ci95 or (float("nan"), float("nan"))
            print(f"accuracy {run_name} ({rep.mode}): {rep} [95% CI {100 * lo:.0f}-{100 * hi:.0f}%]")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "decode_speedups": speedups,
              "decode_speedup_median": med, "accuracy": accuracy,
              "table": json.loads(table.reset_index().to_json(orient="records")), "runs": runs}
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, ConnectionError, NotImplementedError, RuntimeError, AssertionError) as exc:
        # RuntimeError covers DropFunctionError and torch's bad-device errors; AssertionError torch's "not
        # compiled with CUDA"
        print(f"tdutils: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
