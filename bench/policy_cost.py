"""What choosing the tokens costs on a real model: each policy's `modify` ÷ the baseline decode.

    python bench/policy_cost.py                       # SmolLM2-135M, 8 requests x 2048 tokens, 64 decode tokens
    python bench/policy_cost.py --json docs/results/policy_cost.json
    python bench/policy_cost.py --smoke               # the bundled tiny model, seconds (CI): no pass/fail on timing
    python bench/policy_cost.py --summary docs/results/policy_cost.json

Targets and the method: docs/benchmarks.md#benchpolicy_costpy-what-choosing-the-tokens-costs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

# name -> (policy, parameters, target share of the baseline decode)
VARIANTS = {
    "snapkv": ("snapkv", {}, 0.10),
    "tova": ("tova", {}, 0.10),
    "knorm": ("knorm", {}, 0.10),
    "keydiff": ("keydiff", {}, 0.10),
    "streaming_llm": ("streaming_llm", {}, 0.10),
    "random": ("random", {}, 0.10),
    "rkv": ("rkv", {"redundancy": "exact"}, 0.25),
    "rkv_tiled": ("rkv", {"redundancy": "tiled"}, 0.25),
    "h2o": ("h2o", {}, 0.25),
}
SMOKE = {"model": "tiny-qwen3", "num_requests": 2, "prompt_tokens": 96, "max_tokens": 4, "repeats": 1}


def captured(state: list, rows: int | None) -> list:
    """The requests of an hf engine `snapshot()` taken with every prompt query captured (`query_window=None`), as
    a prefill capturing `rows` would have left them (`tdutils.policies.query_window_for` of one drop function):
    no query (0), the last `rows` query rows (a copy), or all (None). The engine copies every tensor it hands a
    drop function, so each policy is timed with what a run of that policy alone holds."""
    out = []
    for r in state:
        r = copy.copy(r)
        if rows == 0:
            r.query = None
        elif rows is not None and r.query is not None:
            r.query = r.query[:, -rows:].clone()
        out.append(r)
    return out


def run(args) -> dict:
    """Prefill once, time the baseline decode and every variant's modify; returns the report (`table` renders it)."""
    import torch

    import tdutils
    from tdutils.policies import query_window_for
    from tdutils.ruler import essay_prompts

    t_start = time.perf_counter()
    try:
        eng = tdutils.open_engine("hf", model=args.model, query_window=None, progress=False, device=args.device)
    except (OSError, ValueError) as exc:  # a model that does not load: one line, naming the option
        raise ValueError(f"--model {args.model!r}: {str(exc).splitlines()[0]}") from None
    facts = eng.facts
    prompts = essay_prompts(eng.tokenizer, args.num_requests, args.prompt_tokens)
    eng.prefill(prompts)
    prefill_s = eng.metrics.prefill.seconds
    H.log(f"model={args.model} layers={facts.num_layers} requests={len(prompts)} prompt_tokens={args.prompt_tokens} "
         f"threads={torch.get_num_threads()} prefill {prefill_s:.1f} s")
    saved = eng.snapshot()

    decode_s = []
    for rep in range(args.repeats + 1):  # the first, untimed: a process's first forwards are slower
        eng.restore(saved)
        eng.decode(args.max_tokens, ignore_eos=True)
        if rep:
            decode_s.append(eng.metrics.decode.seconds)
        H.log(f"  baseline decode {'(warm-up)' if not rep else f'repeat {rep}'}: {eng.metrics.decode.seconds:.2f} s")
    base = statistics.median(decode_s)

    rows = []
    for name in args.policies:
        policy, params, target = VARIANTS[name]
        fn = tdutils.make_drop_fn(policy, drop_ratio=args.drop_ratio, model_config=eng.facts, **params).timed()
        state = captured(saved, query_window_for(fn))
        modify_s, score_s, kept = [], [], 0
        for rep in range(args.repeats + 1):  # the first, untimed (warm-up)
            eng.restore(state)
            fn.reset()
            eng.modify(fn)
            if rep:
                modify_s.append(eng.metrics.modify.seconds)
                score_s.append(fn.split()["score_s"])
            kept = eng.metrics.modify.tokens_after
        m = statistics.median(modify_s)
        n, L = len(prompts), facts.num_layers
        row = {"name": name, "policy": policy, "params": params, "modify_s": m, "modify_all_s": modify_s,
               "score_s": statistics.median(score_s), "per_request_ms": 1e3 * m / n,
               "per_layer_ms": 1e3 * m / (n * L), "share": m / base, "target": target,
               "passed": m / base <= target, "kept_tokens": kept}
        rows.append(row)
        H.log(f"  {name:>14}: modify {m:.3f} s ({row['per_request_ms']:.1f} ms/request, {row['per_layer_ms']:.2f} "
             f"ms/request/layer), {row['share']:.1%} of the baseline decode (target {target:.0%})")
    meta = {**H.run_record("bench/policy_cost.py"), "model": args.model,
            "num_layers": facts.num_layers, "num_kv_heads": facts.num_kv_heads, "num_query_heads": facts.num_query_heads,
            "head_dim": facts.head_dim, "num_requests": len(prompts), "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "drop_ratio": args.drop_ratio, "repeats": args.repeats,
            "smoke": args.smoke, "prefill_s": prefill_s, "baseline_decode_s": base,
            "baseline_decode_all_s": decode_s, "seconds": time.perf_counter() - t_start}
    return {"meta": meta, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    from tdutils.cli.args import name_list, open_ratio, positive_int, usable_cores

    ap = H.parser("bench/policy_cost.py", __doc__)
    ap.add_argument("--smoke", action="store_true",
                    help=f"the bundled tiny model, {SMOKE['num_requests']} short prompts, 1 repeat: seconds (CI); "
                         "no pass/fail on timing")
    H.add_standard(ap, model="smollm2-135m", repeats=3, threads=usable_cores(), device=None)
    ap.add_argument("--num-requests", type=positive_int, default=8)
    ap.add_argument("--prompt-tokens", type=positive_int, default=2048)
    ap.add_argument("--max-tokens", type=positive_int, default=64, help="baseline decode tokens per request")
    ap.add_argument("--drop-ratio", type=open_ratio, default=0.5)
    ap.add_argument("--policies", type=name_list(VARIANTS), default=list(VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)} (default: all)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = H.start(ap, argv, "policy_cost", "docs/results/policy_cost.json", ("meta", "rows"))
    if args is None:
        return 0
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    report = H.one_line_errors(ap, run, args)
    print(H.render("policy_cost", report))
    if args.json is not None:
        H.write_json(report, args.json)
    failed = [r["name"] for r in report["rows"] if not r["passed"]]
    return 1 if failed and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
