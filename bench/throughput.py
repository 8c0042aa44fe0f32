"""Decode throughput at a fixed KV budget: baseline vs policies × drop ratios, measured side by side.

    python bench/throughput.py                                   # bundled model, 16 x 1024-token prompts
    python bench/throughput.py --policies snapkv,random --drop-ratios 0.5,0.75 --repeats 5 --json out.json

Exits 1 if a run decoded a different number of tokens than requested. Columns and the budget:
docs/benchmarks.md#benchthroughputpy-decode-throughput-at-a-fixed-kv-budget.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

import tdutils
from tdutils.cli.args import drop_ratios, full_requests, name_list, positive_int
from tdutils.data import load_prompts
from tdutils.eval import check_plot_path
from tdutils.metrics import speedup_notes
from tdutils.runs import DEFAULT_FULL_REQUESTS
from tdutils.sweep import SweepConfig, throughput_sweep

POLICIES = tuple(tdutils.policies.policy_names())  # every registered policy
DTYPES = ("auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16")


def build_parser() -> argparse.ArgumentParser:
    ap = H.parser("bench/throughput.py", __doc__)
    H.add_standard(ap, model="tiny-qwen3", repeats=3, json_dest="json_path", summary=False)
    ap.add_argument("--dataset", default="sample")
    ap.add_argument("--policies", type=name_list(POLICIES), default="snapkv,random",
                    help=f"comma-separated policy names ({', '.join(POLICIES)})")
    ap.add_argument("--drop-ratios", type=drop_ratios, default="0.5,0.75", help="comma-separated ratios in (0, 1)")
    ap.add_argument("--num-requests", type=positive_int, default=16)
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--full-requests", type=full_requests, default=DEFAULT_FULL_REQUESTS,
                    help="KV budget in undropped requests (>= 1): ceil(N x (longest prompt + max tokens))")
    ap.add_argument("--kv-budget-tokens", type=positive_int, default=None,
                    help="budget in tokens (overrides --full-requests)")
    ap.add_argument("--dtype", choices=DTYPES, default="auto")
    ap.add_argument("--plot", default=None, help="save the speed-up vs drop ratio plot here (PNG, SVG, ...)")
    return ap


def batch_notes(table, n_requests: int, kv_budget: int, prompt_tokens: int, max_tokens: int) -> list[str]:
    """Configurations whose batch the request count, not the KV budget, capped: their `of_limit` understates.

    A configuration is capped when every request ran in one batch and the budget would have held one more
    request of the same size (`kept_fraction * prompt_tokens + max_tokens` KV tokens).
    """
    notes = []
    for c in table.index:
        if c == "baseline" or table.loc[c, "peak_batch"] < n_requests:
            continue
        per_request = math.ceil(table.loc[c, "kept_fraction"] * prompt_tokens) + max_tokens
        if (n_requests + 1) * per_request <= kv_budget:
            notes.append(f"{c}: all {n_requests} requests decoded in one batch and the KV budget would hold more, "
                         f"so the request count capped its batch and its of_limit understates what the budget "
                         f"allows; use more --num-requests")
    return notes


def setup(args):
    """`(engine, token ids, configurations)`; every check that needs no model runs before loading it.

    Raises:
        ValueError / OSError: bad options, dataset or model (reported in one line).
    """
    if args.json_path is not None:  # "" too: an empty path is refused, never read as "no JSON"
        H.check_json_dest(args.json_path, example="runs/throughput.json")
    if args.plot is not None:
        check_plot_path(args.plot, "--plot")
    rows = load_prompts(args.dataset, num_requests=args.num_requests)
    eng = tdutils.open_engine("hf", model=args.model, dtype=args.dtype, progress=False)  # no loading bar either
    ids = eng.tokenize(rows)
    eng.kv_budget_tokens = args.kv_budget_tokens or tdutils.default_kv_budget(map(len, ids), args.max_tokens,
                                                                              args.full_requests)
    need = max(map(len, ids)) + args.max_tokens
    if eng.kv_budget_tokens < need:
        raise ValueError(f"--kv-budget-tokens {eng.kv_budget_tokens} cannot hold one undropped request ({need} "
                         f"tokens = longest prompt + --max-tokens); give at least {need}")
    return eng, ids, [SweepConfig(p, r) for p in args.policies for r in args.drop_ratios]


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    eng, ids, configs = H.one_line_errors(ap, setup, args)
    print(f"model={args.model} requests={len(ids)} prompt tokens={min(map(len, ids))}-{max(map(len, ids))} "
          f"max_tokens={args.max_tokens} kv_budget_tokens={eng.kv_budget_tokens} repeats={args.repeats} "
          f"torch threads={torch.get_num_threads()}", flush=True)
    try:
        table, runs = throughput_sweep(eng, ids, configs, max_tokens=args.max_tokens, repeats=args.repeats,
                                       progress=lambda line: print(line, flush=True))
    except ValueError as exc:  # e.g. a policy parameter that does not fit these prompts
        H.fail(ap, exc)
    except RuntimeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(H.render("throughput", table))
    for line in batch_notes(table, len(ids), eng.kv_budget_tokens, max(map(len, ids)), args.max_tokens) + \
            speedup_notes(table):
        print(f"note: {line}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        from tdutils.sweep import plot_speedup

        ax = plot_speedup(table, title=f"{args.model}, {len(ids)} x {max(map(len, ids))} tokens, "
                                       f"budget {eng.kv_budget_tokens} tokens")
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        ax.figure.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    if args.json_path is not None:
        H.write_json({"args": vars(args), **H.platform_fields(), "date": time.strftime("%Y-%m-%d %H:%M"),
                      "table": json.loads(table.reset_index().to_json(orient="records")), "runs": runs},
                     args.json_path, indent=1, default=str)
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
