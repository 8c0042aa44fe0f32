"""The hf engine's prefill with banded masked attention in blocks (`tdutils.attention._masked_sdpa`) beside one
masked `sdpa` call per layer, on the same prompts, arms alternated.

    python bench/banded_prefill.py --model gemma3-270m --context-length 2048 --threads 1 --json runs/banded.json
    python bench/banded_prefill.py --summary docs/results/banded_prefill_gemma3_2048.json

One engine prefills `--batch-size` RULER prompts of `--context-length` tokens `--repeats` times per arm: "blocks"
(the engine as it runs: a masked forward of at least two `attention.QUERY_BLOCK` query rows runs one `sdpa` call
per block over the keys the block may see) and "one call" (`QUERY_BLOCK` set past the prompt: every masked layer
is one `sdpa` call over all keys, what transformers runs). A model's sliding-window layers (Gemma 3: 5 of 6, a
512-token window) always take the masked path; full-attention layers take it when the batch's prompts differ in
length (padding). Printed: per arm the median and best prefill seconds, the ratio of medians, and how far apart
the two arms' caches are (mean and largest absolute difference of the keys and values). A bfloat16 run also
prefills the prompts once in float32 (one call) and gives each arm's mean absolute difference to that cache: in
bfloat16 the arms part by rounding that 18 layers amplify, and the question is whether blocks move further from
the exact values than one call does.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/harness.py, also when loaded by path
import harness as H

ARMS = ("blocks", "one call")


def measure(args) -> dict:
    import torch

    from tdutils import attention
    from tdutils.engines.hf import HFEngine

    H.check_ruler_task(args.task)
    cores = H.bind_cores(args.threads or 1)
    engine = HFEngine(args.model, dtype=args.dtype, kv_budget_tokens=None, prefill_batch_size=args.batch_size,
                      progress=False)
    _, prompts, _ = H.ruler_prompts(args.task, args.batch_size, args.context_length, engine.tokenizer, args.seed, 8)
    block = attention.QUERY_BLOCK
    seconds, caches = {a: [] for a in ARMS}, {}
    try:
        for rep in range(args.repeats):
            for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                attention.QUERY_BLOCK = block if arm == "blocks" else 1 << 30
                t = time.perf_counter()
                engine.prefill(prompts)
                seconds[arm].append(time.perf_counter() - t)
                caches[arm] = [engine.kv(i).float() for i in range(len(prompts))]  # [2, L, T, D]
    finally:
        attention.QUERY_BLOCK = block
    diff = max(float((a - b).abs().max()) for a, b in zip(caches["blocks"], caches["one call"]))
    mean_diff = _mean_abs(caches["blocks"], caches["one call"])
    scale = max(float(b.abs().max()) for b in caches["one call"])
    to_fp32 = None
    if args.dtype != "float32":  # each arm's distance to the float32 cache of one sdpa call per layer
        del engine
        exact = HFEngine(args.model, dtype="float32", kv_budget_tokens=None, prefill_batch_size=args.batch_size,
                         progress=False)
        attention.QUERY_BLOCK = 1 << 30
        try:
            exact.prefill(prompts)
        finally:
            attention.QUERY_BLOCK = block
        ref = [exact.kv(i) for i in range(len(prompts))]
        to_fp32 = {a: _mean_abs(caches[a], ref) for a in ARMS}
    med = {a: statistics.median(v) for a, v in seconds.items()}
    return {"meta": {**H.run_record("bench/banded_prefill.py"), "model": args.model, "dtype": args.dtype,
                     "batch_size": args.batch_size, "context_length": args.context_length, "task": args.task,
                     "prompt_tokens": [len(p) for p in prompts], "repeats": args.repeats, "cores": cores,
                     "seed": args.seed, "query_block": block, "torch_threads": torch.get_num_threads()},
            "seconds": seconds, "median_seconds": med, "ratio": med["one call"] / med["blocks"],
            "cache_max_abs_diff": diff, "cache_mean_abs_diff": mean_diff, "cache_max_abs": scale,
            "mean_abs_diff_to_float32": to_fp32}


def _mean_abs(xs, ys) -> float:
    """Mean absolute difference over every element of two lists of caches `[2, L, T, D]`."""
    total = sum(float((x - y).abs().sum()) for x, y in zip(xs, ys))
    return total / sum(x.numel() for x in xs)


def main(argv=None) -> int:
    ap = H.parser("bench/banded_prefill.py", __doc__)
    H.add_standard(ap, threads=1, repeats=3, model="gemma3-270m")
    H.add_ruler_batch_options(ap, batch_help="prompts prefilled together")
    return H.measure_main(ap, argv, "banded_prefill", "runs/banded.json", ("meta", "seconds", "ratio"), measure)


if __name__ == "__main__":
    sys.exit(main())
