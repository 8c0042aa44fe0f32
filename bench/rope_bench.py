"""Time and peak memory of `tdutils.rope.rerotate_k_cache`: fp32 arithmetic vs cache-dtype (bf16) arithmetic.

    python bench/rope_bench.py                          # full size: [2, 36, 8192, 1024] bf16 (Qwen3-8B)
    python bench/rope_bench.py --layers 8 --tokens 4096 --repeats 3 --json out.json
    python bench/rope_bench.py --summary docs/results/rope_bench.json   # the docs/results.md lines of a stored run

The method: docs/benchmarks.md#benchrope_benchpy-re-rotation-in-fp32-or-bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/harness.py, also when loaded by path
import harness as H

from tdutils import rope as R
from tdutils.cli.args import positive_float, positive_int
from tdutils.rope import RopeSpec, rerotate_k_cache

VARIANTS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_spec(head_dim: int, theta: float) -> RopeSpec:
    # a stub config with the fields a Qwen3 config has; keeps the bench free of model downloads
    return RopeSpec.from_config({"model_type": "qwen3", "head_dim": head_dim, "rope_theta": theta})


def make_cache(layers: int, tokens: int, dim: int, device: str, seed: int = 0) -> torch.Tensor:
    """[2, L, T, D] bf16 with std 3, filled slice by slice so no full-size fp32 temporary exists."""
    g = torch.Generator(device=device).manual_seed(seed)
    kv = torch.empty(2, layers, tokens, dim, dtype=torch.bfloat16, device=device)
    for i in range(2):
        for layer in range(layers):
            kv[i, layer].normal_(0.0, 3.0, generator=g)
    return kv


def make_positions(tokens: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.sort(torch.randperm(2 * tokens, generator=g)[:tokens]).values  # kept half of a 2T prompt
    return old.to(device), torch.arange(tokens, device=device)


def analytic_extra_bytes(layers: int, tokens: int, dim: int, spec: RopeSpec, compute: torch.dtype) -> dict:
    """Temporaries of rerotate_k_cache, from its code (tdutils/rope.py)."""
    heads = dim // spec.head_dim
    half = spec.rotary_dim // 2
    table = tokens * half
    cdt = torch.empty(0, dtype=compute).element_size()
    # Upper bound: counts the output as resident from the start, while its physical pages fill in layer by
    # layer (so on CPU the table-building phase rarely sets the measured peak).
    # building cos/sin (_delta_tables): fp64 delta + one leg's fp32 and fp64 angles, or
    # delta + cos + the fp64 sin before its cast; per element of the [T, rd/2] table
    build = table * max(8 + 4 + 8, 8 + cdt + 8 + cdt)
    tables = 2 * table * cdt
    chunk = R._token_chunk(tokens, heads, spec.rotary_dim)
    per_chunk = chunk * heads * spec.rotary_dim          # elements of the rotary channels of one chunk
    # xr (compute copy of the rotary channels; a view when compute == cache dtype) + ra + rb (half each)
    xr = per_chunk * cdt if compute != torch.bfloat16 else 0
    chunk_tmp = xr + per_chunk * cdt
    return {
        "chunk_tokens": chunk,
        "extra_bytes": max(build, tables + chunk_tmp),
        "one_layer_keys_fp32_bytes": tokens * dim * 4,
    }


def measure_memory_here(args, variant: str) -> dict:
    """One call in this process; extra = peak - before - output bytes (`harness.extra_memory`)."""
    spec = make_spec(args.head_dim, args.theta)
    kv = make_cache(args.layers, args.tokens, args.dim, args.device)
    old, new = make_positions(args.tokens, args.device)
    out_bytes = kv.numel() * kv.element_size()
    if not args.device.startswith("cuda"):
        # warm-up on a tiny cache first: the first call maps kernel code and starts the OpenMP threads,
        # fixed costs that are not temporaries of the re-rotation
        tiny = make_cache(1, 64, args.dim, args.device)
        rerotate_k_cache(tiny, *make_positions(64, args.device), spec, compute_dtype=VARIANTS[variant])
        del tiny
    out, extra, method, maxrss = H.extra_memory(
        lambda: rerotate_k_cache(kv, old, new, spec, compute_dtype=VARIANTS[variant]), args.device)
    del out
    res = {"measured_extra_bytes": max(0, extra - out_bytes), "memory_method": method}
    if maxrss is not None:
        res["ru_maxrss_extra_bytes"] = max(0, maxrss - out_bytes)
    return res


def time_variants(kv, old, new, spec, repeats: int, device: str) -> tuple[dict[str, list[float]], list[list[str]]]:
    """Seconds per call of every variant, alternated inside each repeat (fp32 bf16, then bf16 fp32, ...), after
    one warm-up call each: `({variant: [seconds per repeat]}, [order of each repeat])`."""
    fns = {v: (lambda c=c: rerotate_k_cache(kv, old, new, spec, compute_dtype=c)) for v, c in VARIANTS.items()}
    for fn in fns.values():
        fn()  # warm-up
    return H.time_alternated(fns, repeats, device)


def memory_child(payload: dict) -> dict:
    """Worker (`harness.call`): one memory measurement in a fresh process; payload: the options and `variant`."""
    args = H.options(payload)
    return measure_memory_here(args, args.variant)


def child_memory(args, variant: str) -> dict:
    """Median over --memory-runs fresh subprocesses (RSS readings pick up a few MiB of noise: page cache
    reclaim of code pages, allocator slack)."""
    # every allocation >= 128 KiB gets its own mmap and is unmapped when freed, so RSS follows live tensors
    # instead of glibc's heap (which would keep freed chunks resident and reuse them invisibly)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    payload = {**vars(args), "variant": variant, "json": None, "summary": None}
    runs = [H.call(__file__, "memory_child", payload, env=env) for _ in range(args.memory_runs)]
    extras = [r["measured_extra_bytes"] for r in runs]
    return {"measured_extra_bytes": statistics.median(extras), "measured_extra_bytes_runs": extras,
            "ru_maxrss_extra_bytes_runs": [r["ru_maxrss_extra_bytes"] for r in runs],
            "memory_method": runs[0]["memory_method"]}


def accuracy_layer0(kv, old, new, spec) -> dict:
    """Error of each variant against an fp64 rotation of layer 0 (then the one unavoidable bf16 store)."""
    k = kv[:, :1].clone()                                    # [2, 1, T, D]
    ref = rerotate_k_cache(k.double(), old, new, spec, compute_dtype=torch.float64)[0, 0]  # fp64, no store
    out = {}
    for variant in VARIANTS:
        got = rerotate_k_cache(k, old, new, spec, compute_dtype=VARIANTS[variant])[0, 0].double()
        err = (got - ref).abs()
        out[variant] = {"max_abs_err": err.max().item(), "mean_abs_err": err.mean().item()}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = H.parser("bench/rope_bench.py", __doc__)
    p.add_argument("--layers", type=positive_int, default=36)
    p.add_argument("--tokens", type=positive_int, default=8192)
    p.add_argument("--dim", type=positive_int, default=1024, help="D = H_kv * head_dim")
    p.add_argument("--head-dim", type=positive_int, default=128, help="even: RoPE rotates pairs of dimensions")
    p.add_argument("--theta", type=positive_float, default=1e6)
    p.add_argument("--memory-runs", type=positive_int, default=3, help="CPU: subprocess measurements per variant")
    H.add_standard(p, threads=True, repeats=3, device="auto")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = H.start(p, argv, "rope_bench", "runs/rope_bench.json", ("variants", "shape"))  # before any child runs
    if args is None:
        return 0
    if args.head_dim % 2:
        p.error(f"--head-dim must be even (RoPE rotates pairs of dimensions), got {args.head_dim}")
    if args.dim % args.head_dim:
        p.error("--dim must be a multiple of --head-dim")

    spec = make_spec(args.head_dim, args.theta)
    on_cuda = args.device.startswith("cuda")
    # CPU memory children run first, while this process is still small: Linux carries a parent's peak RSS
    # into ru_maxrss of a child it spawns, which would hide the child's own peak behind ours.
    cpu_memory = {} if on_cuda else {variant: child_memory(args, variant) for variant in VARIANTS}
    kv = make_cache(args.layers, args.tokens, args.dim, args.device)
    old, new = make_positions(args.tokens, args.device)
    shape = list(kv.shape)
    cache_bytes = kv.numel() * kv.element_size()
    print(f"rerotate_k_cache on {shape} {kv.dtype} ({cache_bytes / H.MiB:.0f} MiB) device={args.device} "
          f"threads={torch.get_num_threads()} repeats={args.repeats}")

    results = {"shape": shape, "dtype": str(kv.dtype), "device": args.device, "threads": torch.get_num_threads(),
               "repeats": args.repeats, "torch": torch.__version__, "machine": H.machine_record(), "variants": {}}
    all_times, results["order"] = time_variants(kv, old, new, spec, args.repeats, args.device)
    for variant, compute in VARIANTS.items():
        times = all_times[variant]
        results["variants"][variant] = {"times_s": times, "median_s": statistics.median(times), "min_s": min(times),
                                        **analytic_extra_bytes(args.layers, args.tokens, args.dim, spec, compute),
                                        **cpu_memory.get(variant, {})}
    if on_cuda:
        # same process, one variant at a time, with the timing cache freed so it does not count
        del kv
        torch.cuda.empty_cache()
        for variant in VARIANTS:
            results["variants"][variant].update(measure_memory_here(args, variant))
            torch.cuda.empty_cache()
        kv = make_cache(args.layers, args.tokens, args.dim, args.device)
    results["accuracy_layer0_vs_fp64"] = accuracy_layer0(kv, old, new, spec)

    fp32, bf16 = results["variants"]["fp32"], results["variants"]["bf16"]
    per_repeat = [a / b for a, b in zip(fp32["times_s"], bf16["times_s"])]  # same repeat: side by side
    results["time_ratio_fp32_over_bf16_per_repeat"] = per_repeat
    results["time_ratio_fp32_over_bf16"] = statistics.median(per_repeat)
    results["time_ratio_fp32_over_bf16_min"] = fp32["min_s"] / bf16["min_s"]
    print(H.render("rope_bench_run", results, cache_bytes))
    if args.json is not None:
        H.write_json(results, args.json)
        if args.json != "-":
            print(f"wrote {args.json}; docs/results.md lines:\n{H.render('rope_bench', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
