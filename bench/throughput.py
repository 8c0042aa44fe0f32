"""Decode throughput at a fixed KV budget: baseline vs policies × drop ratios, measured side by side.

    python bench/throughput.py                                   # bundled model, 16 x 1024-token prompts
    python bench/throughput.py --policies snapkv,random --drop-ratios 0.5,0.75 --repeats 5 --json out.json

One process, one model, one budget. The default budget holds 4.25 undropped requests (`--full-requests`): the
baseline decodes 4 at a time, and a request at drop ratio 0.5 (a T/2-token cache plus its max_tokens decode
tokens, 53% of an undropped one at T=1024, max_tokens=64) fits 8 times, so the batch can reach the 2x capacity
limit. At exactly 4 undropped requests the decode tokens, which dropping does not shrink, cap it at 7 (4352
tokens / 576 = 7.6), and 16 requests then decode in waves of 7 + 7 + 2. Each repeat runs the baseline
and every configuration back to back, so machine noise hits them alike; ratios are taken per repeat.
Prints decode tok/s (median, min, max), peak batch, modify seconds, the ratio to baseline and to the
capacity limit 1/(1-r), and the end-to-end ratio (prefill + modify + decode). Exits 1 if any run decoded a
different number of tokens than requested.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import tdutils
from tdutils.data import load_prompts
from tdutils.engines.base import DEFAULT_FULL_REQUESTS
from tdutils.sweep import SweepConfig, throughput_sweep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--dataset", default="sample")
    ap.add_argument("--policies", default="snapkv,random", help="comma-separated policy names")
    ap.add_argument("--drop-ratios", default="0.5,0.75", help="comma-separated ratios in (0, 1)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--full-requests", type=float, default=DEFAULT_FULL_REQUESTS,
                    help="KV budget in undropped requests: ceil(N x (longest prompt + max tokens))")
    ap.add_argument("--kv-budget-tokens", type=int, default=None, help="budget in tokens (overrides --full-requests)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--plot", default=None, help="save the speed-up vs drop ratio plot here (PNG, SVG, ...)")
    args = ap.parse_args(argv)

    rows = load_prompts(args.dataset, num_requests=args.num_requests)
    eng = tdutils.open_engine("hf", model=args.model, dtype=args.dtype, progress=False)
    ids = eng.tokenize(rows)
    eng.kv_budget_tokens = args.kv_budget_tokens or tdutils.default_kv_budget(map(len, ids), args.max_tokens,
                                                                              args.full_requests)
    configs = [SweepConfig(p, float(r)) for p in args.policies.split(",") for r in args.drop_ratios.split(",")]
    print(f"model={args.model} requests={len(ids)} prompt tokens={min(map(len, ids))}-{max(map(len, ids))} "
          f"max_tokens={args.max_tokens} kv_budget_tokens={eng.kv_budget_tokens} repeats={args.repeats} "
          f"torch threads={torch.get_num_threads()}", flush=True)
    try:
        table, runs = throughput_sweep(eng, ids, configs, max_tokens=args.max_tokens, repeats=args.repeats,
                                       progress=lambda line: print(line, flush=True))
    except RuntimeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    cols = ["decode_tok_s_median", "decode_tok_s_min", "decode_tok_s_max", "peak_batch", "modify_s",
            "modify_of_base_decode", "decode_speedup", "capacity_limit", "of_limit", "e2e_speedup"]
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3g}".format):
        print(table[cols].to_string())
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        from tdutils.sweep import plot_speedup

        ax = plot_speedup(table, title=f"{args.model}, {len(ids)} x {max(map(len, ids))} tokens, "
                                       f"budget {eng.kv_budget_tokens} tokens")
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        ax.figure.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({
            "args": vars(args), "machine": platform.platform(), "processor": platform.processor(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "table": json.loads(table.reset_index().to_json(orient="records")),
            "runs": runs}, indent=1, default=str))
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
