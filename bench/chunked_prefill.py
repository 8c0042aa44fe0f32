"""Chunked prefill under a KV budget: peak memory and time against one-shot prefill, on one long prompt.

    python bench/chunked_prefill.py                                   # Gemma 3 270M, RULER niah at 4k/8k/32k
    python bench/chunked_prefill.py --summary docs/results/chunked_prefill_gemma3.json

Each configuration in a fresh process (`run_one`). What it measures: docs/benchmarks.md#benchchunked_prefillpy-one-long-prompt-in-bounded-memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

ONE_SHOT_MAX = 8192  # longest prompt also prefilled in one shot (the docs' table says so)


def run_one(args: dict) -> dict:
    """Worker (`harness.call`): one configuration (the options as a dict, `length`, `chunk` 0 for one shot) in
    this fresh process, so its peak RSS is its own; returns its figures."""
    import gc
    import time

    args = H.options(args)
    import tdutils
    from tdutils.compression import Compression
    from tdutils.eval.tasks import load_rows, score_rows

    eng = tdutils.open_engine("hf", model=args.model, progress=False, query_window=64)
    rows = load_rows("ruler_niah_single_1", model=args.model, num_requests=1, context_tokens=args.length,
                     seed=args.seed)
    gc.collect()
    with H.PeakRSS() as mem:  # the resident set's peak while prefill runs
        t0 = time.perf_counter()
        if args.chunk:
            eng.prefill(rows, chunk=args.chunk, compression=Compression(args.policy, budget=args.budget))
        else:
            eng.prefill(rows)
        seconds = time.perf_counter() - t0
    base_mb, peak_mb = mem.start / H.MiB, mem.peak / H.MiB
    outs = eng.decode(args.max_tokens, ignore_eos=False)
    score = score_rows(rows, [o.answer for o in outs])
    pm = eng.metrics.prefill
    return {"model": args.model, "prompt_tokens": pm.tokens, "mode": "chunked" if args.chunk else "one-shot",
            "chunk": args.chunk, "budget": args.budget if args.chunk else None, "policy": args.policy if args.chunk else None,
            "peak_cache_tokens": pm.peak_cache_tokens[0], "final_cache_tokens": eng.kv(0).shape[2],
            "cuts": pm.cuts, "cut_s": round(pm.cut_seconds, 2), "prefill_s": round(seconds, 2),
            "rss_before_prefill_mib": round(base_mb), "peak_rss_above_load_mib": round(peak_mb - base_mb),
            "memory_method": mem.method,
            "answer": outs[0].answer[:60], "correct": bool(score.is_correct[0]),
            "threads": args.threads}


def build_parser() -> argparse.ArgumentParser:
    from tdutils.cli.args import count, int_at_least, int_list, positive_int, usable_cores
    from tdutils.compression import compression_policies

    ap = H.parser("bench/chunked_prefill.py", __doc__)
    H.add_standard(ap, model="gemma3-270m")
    ap.add_argument("--lengths", type=int_list("token counts", "4096,8192"), default=[4096, 8192, 32000],
                    help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--chunk", type=positive_int, default=1024, help="C: prompt tokens per chunk")
    ap.add_argument("--budget", type=int_at_least(2), default=1024, help="B: tokens kept after each chunk")
    ap.add_argument("--policy", default="snapkv", choices=compression_policies())
    ap.add_argument("--max-tokens", type=positive_int, default=24)
    ap.add_argument("--threads", type=int_at_least(1), default=1, help=f"torch threads (at most {usable_cores()})")
    ap.add_argument("--seed", type=count, default=5_000_000)
    return ap


def check_args(args) -> None:
    """Before any model loads: the budget the policy can hold, a model that can do RULER, lengths within its
    positions.

    Raises:
        ValueError: one line naming the option.
    """
    from tdutils.compression import Compression
    from tdutils.models import check_context_lengths, context_window
    from tdutils.ruler import check_ruler_model

    try:
        Compression(args.policy, budget=args.budget)
    except ValueError as exc:
        raise ValueError(f"--budget {args.budget} ({args.policy}): {exc}") from None
    check_ruler_model(args.model, "--model")
    check_context_lengths(args.lengths, context_window(args.model, progress=False), model=args.model,
                          option="--lengths", decode_tokens=args.max_tokens, decode_option="--max-tokens")


def _rows_have_mode(report, path: str) -> None:
    if not report["rows"] or not all(isinstance(r, dict) and "mode" in r for r in report["rows"]):
        raise ValueError(f"--summary {path!r} is not a run of bench/chunked_prefill.py (its rows have no mode); "
                         f"give a file it wrote with --json")


def main(argv=None) -> int:
    ap = build_parser()
    args = H.start(ap, argv, "chunked_prefill", "docs/results/chunked_prefill.json", ("rows",), check=_rows_have_mode)
    if args is None:
        return 0
    H.one_line_errors(ap, check_args, args)
    rows = []
    for length in args.lengths:
        for one_shot in ([True, False] if length <= ONE_SHOT_MAX else [False]):
            payload = {**vars(args), "length": length, "chunk": 0 if one_shot else args.chunk}
            try:
                row = H.call(__file__, "run_one", payload, cwd=H.ROOT, timeout=3600)
            except H.WorkerError as exc:
                if exc.returncode == 2:  # bad input the configuration found: its one line
                    H.fail(ap, exc.last_line.split(": error: ", 1)[-1])
                raise
            rows.append(row)
            print(H.render("chunked_prefill_row", row), flush=True)
    if args.json:
        H.write_json({"rows": rows}, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
