"""Time and peak extra memory of R-KV redundancy (four methods) and of SnapKV / R-KV scoring.

For each key distribution and length n (default n in {1024, 4096, 16384}, H=8 KV heads, d=128, one layer):

- `reference`, `exact`, `tiled`, `buffered`: `rkv_redundancy(keys [H, n, d])` with each method's defaults;
- `snapkv`: `snapkv_scores` (window 64, avg-pool 5) of one layer, 32 query heads;
- `rkv_scores_exact`: the whole R-KV score (importance + exact redundancy, window 16) of that layer.

Key distributions: `random` — i.i.d. N(0, 1); `realistic` — `0.6·μ_h + 0.4·N(0, 1)` with one N(0, 1) mean per
head (real keys share a large per-head component: most rows find a near-duplicate next to the right edge).
Queries are N(0, 1). Kept-set agreement of `buffered` with `exact` is reported at `--drop-ratio` (0.5), for
the full R-KV score and for the redundancy alone.

Method, for every (distribution, n):
- time: one fresh subprocess builds the inputs once, warms every variant up on a 64-token input (kernel code
  pages, OpenMP threads) and then runs the variants alternated inside each of --repeats rounds (A B C …, then
  … C B A, so no variant always runs first or last), with the default allocator settings (CUDA synchronised).
  Each variant's time is the median of its rounds, and each ratio (speed-up over `reference`, time over
  SnapKV scoring) is the median of the per-round ratios, so machine load that changes between rounds moves
  numerator and denominator together;
- memory: every variant in a fresh subprocess of its own, so no variant's high-water mark can hide another's.
  On the CPU the child warms up, switches glibc malloc to `M_MMAP_THRESHOLD = 128 KiB` (mallopt) and
  `malloc_trim(0)`, so that every tensor of 128 KiB or more is its own mapping, unmapped when freed, and RSS
  follows live tensors instead of glibc's heap (which keeps freed chunks resident and reuses them invisibly);
  it resets its peak RSS (VmHWM, by writing 5 to /proc/self/clear_refs), reads its RSS, makes one call and
  reads VmHWM: extra = VmHWM − RSS before (the returned tensors included). Memory is measured apart from the
  timing because mmap-per-tensor makes the many small temporaries of the block scans page-fault on every
  allocation (10x slower `exact` here). RSS also moves with non-tensor memory (code pages, allocator slack: a
  few MiB of noise), so for n <= --profile-max-n the child also replays the torch profiler's allocation
  events of one more call (`tdutils.profiling.peak_memory`): the peak of live tensor bytes, an independent
  figure. CUDA: `torch.cuda.max_memory_allocated()` during one call minus what was allocated before.

`--json docs/results/rkv_bench.json` stores every time, memory figure and ratio; docs/results.md's R-KV figures are
`readme_summary` of that file (`tests/test_bench_results.py` checks they match).

On a CPU shared with other busy processes, use `--threads 1`: with more OpenMP threads than free cores every
parallel region can stall on a descheduled thread, which hits the methods made of many small operations
(`exact`, `buffered`) far harder than one large matmul.

    python bench/rkv_bench.py                                   # full size, CPU or CUDA
    python bench/rkv_bench.py --sizes 1024 4096 --repeats 1 --json out.json
    python bench/rkv_bench.py --summary docs/results/rkv_bench.json   # the docs/results.md lines of a stored run
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

from tdutils.cli_args import count, drop_ratio, int_at_least, positive_int
from tdutils.policies.rkv import rkv_importance, rkv_redundancy, rkv_scores
from tdutils.policies.snapkv import snapkv_scores
from tdutils.profiling import kept_agreement, peak_memory, synthetic_keys
from tdutils.selection import keep_count, keep_top_scores, protected_mask

METHODS = ("reference", "exact", "tiled", "buffered")
VARIANTS = (*METHODS, "snapkv", "rkv_scores_exact")
RKV_WINDOW, SNAPKV_WINDOW, MIX = 16, 64, 0.25
MiB = H.MiB


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
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


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
    args = _options(args)
    kind, n = args.time_child[0], int(args.time_child[1])
    variants, device = list(args.variants), args.device
    _warm_up(kind, variants, args, device)
    keys, kv, q = make_inputs(kind, n, args, device)
    fns = {v: variant_fn(v, keys, kv, q, args.head_dim) for v in variants}
    times = {v: [] for v in variants}
    order = H.alternating_orders(variants, args.repeats)
    for i, round_order in enumerate(order):
        for variant in round_order:
            _sync(device)
            t0 = time.perf_counter()
            result = fns[variant]()
            _sync(device)
            times[variant].append(time.perf_counter() - t0)
            if i == 0 and args.save_dir and variant in ("exact", "buffered"):
                torch.save(result.cpu(), os.path.join(args.save_dir, f"{kind}_{n}_{variant}.pt"))
            del result
    return {"kind": kind, "n": n, "device": device, "threads": torch.get_num_threads(), "order": order,
            "times_s": times}


def run_memory_child(args) -> dict:
    """Worker (`harness.call`): one variant at one size in this (fresh) process: peak extra memory of one call
    (and the profiler's peak). `args`: the options (a dict from the parent), `child` = [kind, n, variant]."""
    args = _options(args)
    kind, n, variant = args.child
    n = int(n)
    device = args.device
    _warm_up(kind, [variant], args, device)
    keys, kv, q = make_inputs(kind, n, args, device)
    fn = variant_fn(variant, keys, kv, q, args.head_dim)
    _sync(device)
    out = {"kind": kind, "n": n, "variant": variant, "device": device, "threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        result, out["peak_extra_bytes"] = H.cuda_peak(fn)
        out["memory_method"] = "torch.cuda.max_memory_allocated - allocated before"
    else:
        mmap_ok = H.mmap_every_tensor()
        hwm_ok = H.reset_peak_rss()
        before = H.rss_bytes()
        result = fn()
        peak = H.peak_rss_bytes() if hwm_ok else None
        out["peak_extra_bytes"] = max(0, peak - before) if peak is not None else None
        out["memory_method"] = ("VmHWM (reset via /proc/self/clear_refs) - RSS before, fresh subprocess"
                                if hwm_ok else "unavailable (no /proc/self/clear_refs)")
        out["memory_method"] += ", mallopt(M_MMAP_THRESHOLD=128 KiB)" if mmap_ok else ", default malloc"
    del result
    if not device.startswith("cuda") and n <= args.profile_max_n:
        _, alloc = peak_memory(fn)
        out["alloc_peak_bytes"] = alloc  # torch profiler: peak live tensor bytes of one more call
    return out


def _options(args):
    if isinstance(args, dict):
        args = argparse.Namespace(**args)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return args


def spawn_time_child(kind: str, n: int, args, save_dir: str) -> dict:
    payload = {**vars(args), "time_child": [kind, n], "save_dir": save_dir}
    return H.call(__file__, "run_time_child", payload, what=f"child timing {kind} n={n}")


def spawn_memory_child(kind: str, n: int, variant: str, args) -> dict:
    payload = {**vars(args), "child": [kind, n, variant]}
    return H.call(__file__, "run_memory_child", payload, what=f"child memory {kind} n={n} {variant}")


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
    p = H.parser("bench/rkv_bench.py", __doc__, raw=False)
    p.add_argument("--sizes", type=int_at_least(RKV_WINDOW + 1, f"R-KV always keeps its last {RKV_WINDOW} tokens"),
                   nargs="+", default=[1024, 4096, 16384], help="key lengths n")
    p.add_argument("--kinds", nargs="+", default=["realistic", "random"], choices=["realistic", "random"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads H")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--query-heads", type=positive_int, default=32, help="query heads (SnapKV / R-KV importance)")
    p.add_argument("--drop-ratio", type=drop_ratio, default=0.5)
    p.add_argument("--seed", type=count, default=0)
    p.add_argument("--profile-max-n", type=count, default=4096,
                   help="CPU: also measure the profiler's tensor peak for n up to this (one extra call)")
    H.add_standard(p, threads=True, repeats=3, device="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    # bad values in one line, before any child runs
    if H.summary_or_check(p, args, readme_summary, "runs/rkv_bench.json", keys=("summary", "config")):
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.query_heads % args.heads:
        p.error("--query-heads must be a multiple of --heads")

    print(f"R-KV redundancy bench: H={args.heads} d={args.head_dim} Hq={args.query_heads} one layer, "
          f"device={args.device}, repeats={args.repeats} (variants alternated), torch {torch.__version__}", flush=True)
    results = {"config": {k: v for k, v in vars(args).items()
                          if k not in ("json", "summary")},
               "torch": torch.__version__, "machine": H.machine_record(), "runs": [], "summary": []}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as save_dir:
        for kind in args.kinds:
            for n in args.sizes:
                # memory children first, while the timing child's memory is not around
                memory = {v: spawn_memory_child(kind, n, v, args) for v in args.variants}
                timing = spawn_time_child(kind, n, args, save_dir)
                runs = {}
                for variant in args.variants:
                    times = timing["times_s"][variant]
                    r = {**memory[variant], "times_s": times, "median_s": statistics.median(times),
                         "order": timing["order"]}
                    runs[variant] = r
                    results["runs"].append(r)
                    mem, alloc = r["peak_extra_bytes"], r.get("alloc_peak_bytes")
                    print(f"{kind:9} n={n:6} {variant:17} {r['median_s']:9.3f} s  peak extra "
                          f"{(mem or 0) / MiB:9.1f} MiB" + (f" (tensors {alloc / MiB:.1f} MiB)" if alloc else ""),
                          flush=True)
                results["summary"].append(summarize(kind, n, runs, agreement(kind, n, args, save_dir)))
    results["seconds"] = time.perf_counter() - t_start
    print_summary(results["summary"])
    if args.json is not None:
        H.write_json(results, args.json)
        print(f"wrote {args.json}; docs/results.md lines:\n{readme_summary(results)}")
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
        row = {"median_s": r["median_s"], "peak_extra_mib": (r["peak_extra_bytes"] or 0) / MiB}
        if r.get("alloc_peak_bytes") is not None:
            row["alloc_peak_mib"] = r["alloc_peak_bytes"] / MiB
        if ref:
            row["speedup_vs_reference"] = _round_ratio(ref["times_s"], r["times_s"])
            if ref["peak_extra_bytes"]:
                row["memory_vs_reference"] = (r["peak_extra_bytes"] or 0) / ref["peak_extra_bytes"]
        if snap:
            row["time_vs_snapkv"] = _round_ratio(r["times_s"], snap["times_s"])
        s[name] = row
    return s


def readme_summary(results: dict) -> str:
    """The R-KV figures of docs/results.md, written from a stored run (largest n; `realistic` keys, then `random`)."""
    summary = results["summary"]
    n = max(s["n"] for s in summary)
    at = {s["kind"]: s for s in summary if s["n"] == n}
    cfg = results["config"]
    lines = []
    real = at.get("realistic")
    if real and all(m in real for m in (*METHODS, "snapkv", "rkv_scores_exact")):
        ref, ex, ti, bu = (real[m] for m in METHODS)
        a = real["agreement"]
        lines.append(
            f"n={n}, {cfg['repeats']} rounds, realistic keys: `reference` {ref['median_s']:.3g} s / "
            f"{ref['peak_extra_mib']:.0f} MiB extra; `exact` {ex['median_s']:.3g} s / {ex['peak_extra_mib']:.1f} MiB "
            f"({ex['speedup_vs_reference']:.0f}x faster, {ex['memory_vs_reference']:.1%} of the memory); `tiled` "
            f"{ti['median_s']:.3g} s / {ti['peak_extra_mib']:.0f} MiB; `buffered` {bu['median_s']:.3g} s / "
            f"{bu['peak_extra_mib']:.1f} MiB"
            + (f" with {a['buffered_vs_exact_rkv']:.1%} kept-set agreement with `exact` at drop {a['drop_ratio']:g}"
               if a else "")
            + f"; R-KV scoring with `exact` {real['rkv_scores_exact']['median_s']:.3g} s against SnapKV scoring "
            f"{real['snapkv']['median_s']:.3g} s ({real['rkv_scores_exact']['time_vs_snapkv']:.2f}x).")
    rand = at.get("random")
    if rand and "exact" in rand and "reference" in rand:
        lines.append(f"On random keys (no near-duplicates) `exact` scans every column: {rand['exact']['median_s']:.3g} s, "
                     f"{rand['exact']['speedup_vs_reference']:.1f}x faster than `reference`.")
    return "\n".join(lines)


def print_summary(summary: list[dict]) -> None:
    print("\nratios: speed-up = reference time / method time; memory = method peak extra / reference peak extra; "
          "x SnapKV = time / SnapKV scoring time")
    for s in summary:
        print(f"-- {s['kind']} n={s['n']}")
        for name in VARIANTS:
            if name not in s:
                continue
            r = s[name]
            parts = [f"{r['median_s']:8.3f} s", f"{r['peak_extra_mib']:8.1f} MiB"]
            if "speedup_vs_reference" in r:
                parts.append(f"speed-up {r['speedup_vs_reference']:6.2f}x")
            if "memory_vs_reference" in r:
                parts.append(f"memory {r['memory_vs_reference']:6.1%}")
            if "time_vs_snapkv" in r:
                parts.append(f"{r['time_vs_snapkv']:6.2f}x SnapKV")
            print(f"   {name:17} " + "  ".join(parts))
        a = s["agreement"]
        if a:
            print(f"   buffered vs exact kept sets at drop {a['drop_ratio']}: {a['buffered_vs_exact_rkv']:.1%} (R-KV "
                  f"score), {a['buffered_vs_exact_redundancy_only']:.1%} (redundancy alone)")


if __name__ == "__main__":
    sys.exit(main())
