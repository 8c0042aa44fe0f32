"""Time and peak extra memory of R-KV redundancy (four methods) and of SnapKV / R-KV scoring.

    python bench/rkv_bench.py                                   # full size, CPU or CUDA
    python bench/rkv_bench.py --sizes 1024 4096 --repeats 1 --json out.json
    python bench/rkv_bench.py --summary docs/results/rkv_bench.json   # the docs/results.md lines of a stored run

Variants, processes and ratios: docs/benchmarks.md#benchrkv_benchpy-r-kvs-redundancy-methods.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/harness.py, also when loaded by path
import harness as H

from tdutils.cli.args import count, drop_ratio, int_at_least, positive_int
from tdutils.policies.rkv import rkv_importance, rkv_redundancy, rkv_scores
from tdutils.policies.snapkv import snapkv_scores
from tdutils.profiling import kept_agreement, peak_memory, synthetic_keys
from tdutils.selection import keep_count, keep_top_scores, protected_mask

METHODS = ("reference", "exact", "tiled", "buffered")
VARIANTS = (*METHODS, "snapkv", "rkv_scores_exact")
KINDS = ("realistic", "random")  # key distributions
RKV_WINDOW, SNAPKV_WINDOW, MIX = 16, 64, 0.25


# ----------------------------------------------------------------------------------------------- inputs
def make_inputs(kind: str, n: int, args, device: str):
    """keys [H, n, d] fp32, kv [2, 1, n, H*d] (values = keys: unused by scoring), q [1, 64, Hq*d]."""
    keys = synthetic_keys(args.heads, n, args.head_dim, kind=kind, seed=args.seed + n, device=device)
    k = keys.transpose(0, 1).reshape(n, -1)  # [n, H*d]
    kv = torch.stack([k, k])[:, None]  # [2, L=1, n, D]
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    q = torch.empty(1, SNAPKV_WINDOW, args.query_heads * args.head_dim, device=device).normal_(generator=g)
    return keys, kv, q


def variant_fn(variant: str, keys, kv, q, head_dim: int):
    if variant in METHODS:
        return lambda: rkv_redundancy(keys, method=variant)
    if variant == "snapkv":
        return lambda: snapkv_scores(kv, q, head_dim=head_dim, window=SNAPKV_WINDOW)
    return lambda: rkv_scores(kv, q[:, -RKV_WINDOW:], head_dim=head_dim, window=RKV_WINDOW, redundancy="exact")


# ----------------------------------------------------------------------------------------------- child
def _warm_up(kind: str, variants, args, device: str) -> None:
    """One call of each variant on a 64-token input: thread pools, kernel code pages, allocator."""
    wk, wkv, wq = make_inputs(kind, 64, args, device)
    for variant in variants:
        variant_fn(variant, wk, wkv, wq, args.head_dim)()


def run_time_child(args) -> dict:
    """Worker (`harness.call`): every variant at one size in this (fresh) process, alternated inside each round
    (A B C, then C B A, ...). `args`: the options (a dict from the parent), `time_child` = [kind, n].

    Returns `{"kind", "n", "device", "threads", "order": [[variants of round 0], ...], "times_s": {variant:
    [seconds per round]}}`; saves the first round's `exact` and `buffered` redundancies for `agreement`.
    """
    args = H.options(args)
    kind, n = args.time_child[0], int(args.time_child[1])
    variants, device = list(args.variants), args.device
    _warm_up(kind, variants, args, device)
    keys, kv, q = make_inputs(kind, n, args, device)

    def keep(i, variant, result):  # the first round's redundancies, for `agreement`
        if i == 0 and args.save_dir and variant in ("exact", "buffered"):
            torch.save(result.cpu(), os.path.join(args.save_dir, f"{kind}_{n}_{variant}.pt"))

    times, order = H.time_alternated({v: variant_fn(v, keys, kv, q, args.head_dim) for v in variants},
                                     args.repeats, device, keep)
    return {"kind": kind, "n": n, "device": device, "threads": torch.get_num_threads(), "order": order,
            "times_s": times}


def run_memory_child(args) -> dict:
    """Worker (`harness.call`): one variant at one size in this (fresh) process: peak extra memory of one call
    (and the profiler's peak). `args`: the options (a dict from the parent), `child` = [kind, n, variant]."""
    args = H.options(args)
    kind, n, variant = args.child
    n = int(n)
    device = args.device
    _warm_up(kind, [variant], args, device)
    keys, kv, q = make_inputs(kind, n, args, device)
    fn = variant_fn(variant, keys, kv, q, args.head_dim)
    out = {"kind": kind, "n": n, "variant": variant, "device": device, "threads": torch.get_num_threads()}
    # CPU: each tensor >= 128 KiB its own mapping, unmapped when freed, so RSS follows live tensors
    result, out["peak_extra_bytes"], out["memory_method"], _ = H.extra_memory(fn, device, mmap_threshold=128 * 1024)
    del result
    if not device.startswith("cuda") and n <= args.profile_max_n:
        _, alloc = peak_memory(fn)
        out["alloc_peak_bytes"] = alloc  # torch profiler: peak live tensor bytes of one more call
    return out


# ----------------------------------------------------------------------------------------------- agreement
def agreement(kind: str, n: int, args, save_dir: str) -> dict | None:
    """Kept-set agreement of buffered with exact: full R-KV score (λ·I − (1−λ)·R) and redundancy alone."""
    paths = {m: os.path.join(save_dir, f"{kind}_{n}_{m}.pt") for m in ("exact", "buffered")}
    if not all(os.path.exists(p) for p in paths.values()):
        return None
    red = {m: torch.load(p) for m, p in paths.items()}  # [H, n]
    _, kv, q = make_inputs(kind, n, args, "cpu")
    imp = rkv_importance(kv[0, 0], q[0, -RKV_WINDOW:], args.heads, 7)  # [H, n - w]
    k = keep_count(n, args.drop_ratio)
    prot = protected_mask(n, window=RKV_WINDOW)
    keeps, red_keeps = {}, {}
    for m, r in red.items():
        z = (MIX * imp - (1 - MIX) * r[:, : n - RKV_WINDOW]).mean(dim=0)
        keeps[m] = keep_top_scores(torch.cat([z, torch.zeros(RKV_WINDOW)]), k, prot)
        red_keeps[m] = keep_top_scores(-r.mean(dim=0), k)  # the least redundant k tokens
    return {"drop_ratio": args.drop_ratio, "kept": k,
            "buffered_vs_exact_rkv": kept_agreement(keeps["buffered"], keeps["exact"]),
            "buffered_vs_exact_redundancy_only": kept_agreement(red_keeps["buffered"], red_keeps["exact"]),
            "max_rel_diff_R": ((red["buffered"] - red["exact"]).abs() / red["exact"]).max().item()}


# ----------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = H.parser("bench/rkv_bench.py", __doc__)
    p.add_argument("--sizes", type=int_at_least(RKV_WINDOW + 1, f"R-KV always keeps its last {RKV_WINDOW} tokens"),
                   nargs="+", default=[1024, 4096, 16384], help="key lengths n")
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads H")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--query-heads", type=positive_int, default=32, help="query heads (SnapKV / R-KV importance)")
    p.add_argument("--drop-ratio", type=drop_ratio, default=0.5)
    p.add_argument("--seed", type=count, default=0)
    p.add_argument("--profile-max-n", type=count, default=4096,
                   help="CPU: also measure the profiler's tensor peak for n up to this (one extra call)")
    H.add_standard(p, threads=True, repeats=3, device="auto")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = H.start(p, argv, "rkv_bench", "runs/rkv_bench.json", ("summary", "config"))  # before any child runs
    if args is None:
        return 0
    if args.query_heads % args.heads:
        p.error("--query-heads must be a multiple of --heads")

    print(f"R-KV redundancy bench: H={args.heads} d={args.head_dim} Hq={args.query_heads} one layer, "
          f"device={args.device}, repeats={args.repeats} (variants alternated), torch {torch.__version__}", flush=True)
    results = {"config": {**{k: v for k, v in vars(args).items() if k not in ("json", "summary")},
                          "kinds": list(KINDS), "variants": list(VARIANTS)},
               "torch": torch.__version__, "machine": H.machine_record(), "runs": [], "summary": []}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as save_dir:
        for kind in KINDS:
            for n in args.sizes:
                # memory children first, while the timing child's memory is not around
                memory = {v: H.call(__file__, "run_memory_child", {**vars(args), "child": [kind, n, v]},
                                    what=f"child memory {kind} n={n} {v}") for v in VARIANTS}
                timing = H.call(__file__, "run_time_child", {**vars(args), "time_child": [kind, n],
                                                             "save_dir": save_dir, "variants": VARIANTS},
                                what=f"child timing {kind} n={n}")
                runs = {}
                for variant in VARIANTS:
                    times = timing["times_s"][variant]
                    r = {**memory[variant], "times_s": times, "median_s": statistics.median(times),
                         "order": timing["order"]}
                    runs[variant] = r
                    results["runs"].append(r)
                    print(H.render("rkv_bench_run", r), flush=True)
                results["summary"].append(summarize(kind, n, runs, agreement(kind, n, args, save_dir)))
    results["seconds"] = time.perf_counter() - t_start
    print(H.render("rkv_bench_rounds", results["summary"]))
    if args.json is not None:
        H.write_json(results, args.json)
        print(f"wrote {args.json}; docs/results.md lines:\n{H.render('rkv_bench', results)}")
    return 0


def _round_ratio(num: list[float], den: list[float]) -> float:
    """Median of the per-round ratios num[i] / den[i] (both measured in the same round)."""
    return statistics.median(a / b for a, b in zip(num, den))


def summarize(kind: str, n: int, runs: dict, agree: dict | None) -> dict:
    """Ratios to reference (time: reference / method, memory: method / reference) and to SnapKV; time ratios
    are medians of per-round ratios (the variants alternate inside each round)."""
    s = {"kind": kind, "n": n, "agreement": agree}
    ref, snap = runs.get("reference"), runs.get("snapkv")
    for name, r in runs.items():
        row = {"median_s": r["median_s"], "peak_extra_mib": (r["peak_extra_bytes"] or 0) / H.MiB}
        if r.get("alloc_peak_bytes") is not None:
            row["alloc_peak_mib"] = r["alloc_peak_bytes"] / H.MiB
        if ref:
            row["speedup_vs_reference"] = _round_ratio(ref["times_s"], r["times_s"])
            if ref["peak_extra_bytes"]:
                row["memory_vs_reference"] = (r["peak_extra_bytes"] or 0) / ref["peak_extra_bytes"]
        if snap:
            row["time_vs_snapkv"] = _round_ratio(r["times_s"], snap["times_s"])
        s[name] = row
    return s


if __name__ == "__main__":
    sys.exit(main())
