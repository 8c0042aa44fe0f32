"""What each granularity costs in the `hf` engine: modify seconds and greedy decode speed after one policy's edit at
request / layer / head granularity (and AdaKV's unequal per-head budgets, whose padded rows are masked per head),
on the same prefilled prompts, the variants alternated over rounds so that a shared machine's load falls on all.

    python tools/granularity_cost.py --model smollm2-135m --n 4 --length 2048 --tokens 32 --rounds 2 \\
        --json docs/results/granularity_cost_smollm2_2048.json

Per round and variant: restore the prefilled caches, `modify` (seconds: `metrics.modify.seconds`), decode
`--tokens` tokens per request in one batch, EOS ignored (tokens/s: `metrics.decode`). Prompts: the text-fidelity
task's texts (`text_fidelity`, held-out seed 5000000), so the caches are those of the leaderboard.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from tdutils.edit import make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.eval.tasks import get_task

VARIANTS = (("snapkv", "request"), ("snapkv", "layer"), ("snapkv", "head"), ("adakv_snapkv", "request"))


def measure(engine: HFEngine, prompts, ratio: float, tokens: int, rounds: int) -> list[dict]:
    """One row per (round, variant): `policy`, `granularity`, `modify_s`, `decode_s`, `tokens_per_s`, `kv_rows`."""
    fns = [(p, g, make_drop_fn(p, drop_ratio=ratio, model_config=engine.facts, granularity=g)) for p, g in VARIANTS]
    engine.capture_for(*(fn for _, _, fn in fns))
    engine.prefill(prompts)
    saved = engine.snapshot()
    rows = []
    for rnd in range(rounds):
        for policy, granularity, fn in fns:
            engine.restore(saved)
            engine.modify(fn)
            modify_s = engine.metrics.modify.seconds
            engine.decode(max_tokens=tokens, ignore_eos=True)
            dm = engine.metrics.decode
            rows.append({"round": rnd, "policy": policy, "granularity": granularity, "modify_s": modify_s,
                         "decode_s": dm.seconds, "tokens_per_s": dm.output_tokens / dm.seconds,
                         "kv_rows": engine.kv(0).shape[2]})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=4, help="prompts, prefilled and decoded as one batch")
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--ratio", type=float, default=0.5, help="drop ratio")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = HFEngine(args.model, dtype="float32", prefill_batch_size=args.n, progress=False)
    data = get_task("text_fidelity").make_dataset(args.n, args.length, engine.tokenizer, 5000000, "auto")
    rows = measure(engine, [d.get("prompt_ids", d.get("prompt")) for d in data], args.ratio, args.tokens, args.rounds)
    meta = {**{k: v for k, v in vars(args).items() if k != "json"}, "machine": platform.machine(),
            "seconds": time.perf_counter() - t0}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
