"""Chunked prefill under a KV budget: peak memory and time against one-shot prefill, on one long prompt.

    python bench/chunked_prefill.py                                   # Gemma 3 270M, RULER niah at 4k/8k/32k
    python bench/chunked_prefill.py --model smollm2-135m --lengths 2048,8192 --json docs/results/chunked_prefill.json

Each configuration runs in a fresh process (so `ru_maxrss` is its own peak): load the model, build one
`ruler_niah_single_1` prompt of `L` tokens, then prefill it either in one shot (the whole prompt's cache, and
attention over all of it) or in chunks of `C` tokens cut back to the budget `B` after each chunk with the policy
(`HFEngine.prefill(prompts, chunk=C, compression=Compression(policy, budget=B))`), and decode a few tokens. It
prints, per configuration, the largest KV cache the request held (`metrics.prefill.peak_cache_tokens`), the
process's peak resident memory during prefill above what it held just before (sampled every 5 ms), prefill seconds, and whether the needle came
back. One shot is skipped above `--one-shot-max` tokens (its attention alone would take tens of GB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    """This process's resident memory now (MiB), from /proc/self/statm."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(args) -> dict:
    """One configuration in this process; returns its figures."""
    import gc
    import threading
    import time

    import torch

    torch.set_num_threads(args.threads)
    import tdutils
    from tdutils.answers import score_rows
    from tdutils.compression import Compression
    from tdutils.data import load_prompts

    eng = tdutils.open_engine("hf", model=args.model, progress=False, query_window=64)
    rows = load_prompts("ruler_niah_single_1", model=args.model, num_requests=1, context_tokens=args.length,
                        seed=args.seed)
    gc.collect()
    base_mb = _rss_mib()
    peak = [base_mb]
    done = threading.Event()

    def sample():  # the process's resident memory every 5 ms while prefill runs
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if args.chunk:
        eng.prefill(rows, chunk=args.chunk, compression=Compression(args.policy, budget=args.budget))
    else:
        eng.prefill(rows)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak_mb = max(peak[0], _rss_mib())
    outs = eng.decode(args.max_tokens, ignore_eos=False)
    score = score_rows(rows, [o.answer for o in outs])
    pm = eng.metrics.prefill
    return {"model": args.model, "prompt_tokens": pm.tokens, "mode": "chunked" if args.chunk else "one-shot",
            "chunk": args.chunk, "budget": args.budget if args.chunk else None, "policy": args.policy if args.chunk else None,
            "peak_cache_tokens": pm.peak_cache_tokens[0], "final_cache_tokens": eng.kv(0).shape[2],
            "cuts": pm.cuts, "cut_s": round(pm.cut_seconds, 2), "prefill_s": round(seconds, 2),
            "rss_before_prefill_mib": round(base_mb), "peak_rss_above_load_mib": round(peak_mb - base_mb),
            "answer": outs[0].answer[:60], "correct": bool(score.is_correct[0]),
            "threads": args.threads}


def markdown(report: dict) -> str:
    """The stored run as a markdown table with its legend (what docs/decode_compression.md shows)."""
    rows = report["rows"]
    head = ("prompt tokens", "prefill", "peak cache / request", "cache at decode", "peak memory above the model, MiB",
            "prefill s (cut s)", "needle")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mode = "one shot" if r["mode"] == "one-shot" else f"chunk {r['chunk']}, B = {r['budget']} ({r['policy']})"
        lines.append(f"| {r['prompt_tokens']} | {mode} | {r['peak_cache_tokens']} | {r['final_cache_tokens']} | "
                     f"{r['peak_rss_above_load_mib']} | {r['prefill_s']:.1f} ({r['cut_s']:.1f}) | "
                     f"{'found' if r['correct'] else 'missed'} |")
    r0 = rows[0]
    lines.append("")
    lines.append(f"Model `{r0['model']}`, one `ruler_niah_single_1` prompt per length (held-out seed), each "
                 f"configuration in a fresh process; memory: the process's resident set sampled every 5 ms during "
                 f"prefill, above what it held just before (model loaded, {r0['rss_before_prefill_mib']} MiB); "
                 f"{r0['threads']} torch thread, 2 shared cores. One shot above 8192 tokens not run.")
    return "\n".join(lines)


def _lengths(text: str) -> list[int]:
    """argparse type of `--lengths`: comma-separated prompt lengths, each >= 1."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated token counts, e.g. 4096,8192") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts >= 1, e.g. 4096,8192")
    return out


def build_parser() -> argparse.ArgumentParser:
    from tdutils.cli_args import OneLineParser, count, int_at_least, positive_int, usable_cores

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import compression_policies

    ap = OneLineParser(prog="bench/chunked_prefill.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--lengths", type=_lengths, default=[4096, 8192, 32000],
                    help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--chunk", type=positive_int, default=1024, help="C: prompt tokens per chunk")
    ap.add_argument("--budget", type=int_at_least(2), default=1024, help="B: tokens kept after each chunk")
    ap.add_argument("--policy", default="snapkv", choices=compression_policies())
    ap.add_argument("--one-shot-max", type=count, default=8192, help="longest prompt also prefilled in one shot")
    ap.add_argument("--max-tokens", type=positive_int, default=24)
    ap.add_argument("--threads", type=int_at_least(1), default=1, help=f"torch threads (at most {usable_cores()})")
    ap.add_argument("--seed", type=count, default=5_000_000)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--summary", help="print the markdown table of a stored run (RUN.json) and exit")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: run one configuration
    ap.add_argument("--one-shot", action="store_true", help=argparse.SUPPRESS)  # internal: no chunks
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return ap


def check_args(args) -> None:
    """Before any model loads: the budget the policy can hold, a model that can do RULER, lengths within its
    positions, `--json`.

    Raises:
        ValueError: one line naming the option.
    """
    from _report import check_json_dest

    from tdutils.compression import Compression
    from tdutils.models import check_context_lengths, context_window
    from tdutils.ruler import check_ruler_model

    if args.json is not None:
        check_json_dest(args.json, example="docs/results/chunked_prefill.json")
    try:
        Compression(args.policy, budget=args.budget)
    except ValueError as exc:
        raise ValueError(f"--budget {args.budget} ({args.policy}): {exc}") from None
    check_ruler_model(args.model, "--model")
    check_context_lengths(args.lengths, context_window(args.model, progress=False), model=args.model,
                          option="--lengths", decode_tokens=args.max_tokens, decode_option="--max-tokens")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from _report import check_report, one_line_errors, read_json

    if args.summary:
        def summary():
            report = read_json(args.summary)
            check_report(report, f"--summary {args.summary!r}", ap.prog, keys=("rows",))
            if not report["rows"] or not all(isinstance(r, dict) and "mode" in r for r in report["rows"]):
                raise ValueError(f"--summary {args.summary!r} is not a run of {ap.prog} (its rows have no mode); "
                                 f"give a file it wrote with --json")
            print(markdown(report))
        one_line_errors(ap, summary)
        return 0
    if args.one:
        if args.one_shot:
            args.chunk = 0
        print(json.dumps(one_line_errors(ap, run_one, args)))
        return 0
    one_line_errors(ap, check_args, args)
    rows = []
    for length in args.lengths:
        for one_shot in ([True, False] if length <= args.one_shot_max else [False]):
            cmd = [sys.executable, __file__, "--one", "--model", args.model, "--length", str(length), "--chunk",
                   str(args.chunk), "--budget", str(args.budget), "--policy", args.policy, "--max-tokens",
                   str(args.max_tokens), "--threads", str(args.threads), "--seed", str(args.seed)]
            cmd += ["--one-shot"] if one_shot else []
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600, check=False)
            if proc.returncode == 2:  # bad input the configuration found: its one line
                lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
                print(lines[-1] if lines else f"{ap.prog}: error: a configuration failed", file=sys.stderr)
                return 2
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return proc.returncode
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{row['prompt_tokens']:>6} tokens {row['mode']:>8}: peak cache {row['peak_cache_tokens']:>6} "
                  f"tokens, peak RSS +{row['peak_rss_above_load_mib']:>5} MiB, prefill {row['prefill_s']:>7.1f} s "
                  f"({row['cuts']} cuts, {row['cut_s']} s), needle {'found' if row['correct'] else 'missed'}: "
                  f"{row['answer']!r}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
