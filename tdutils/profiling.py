"""Timers, memory peaks and test keys for measuring drop functions (the benches, the R-KV notebooks, tests).

None of this is part of a policy: `timed` and `peak_memory` measure any call (CUDA synchronised around it);
(`DropFn.timed()` splits each request's modify time into choosing the tokens and applying the choice);
`synthetic_keys` makes key tensors `[heads, n, head_dim]` with or
without near-duplicates (R-KV's redundancy is cheap or costly on them); `kept_agreement` compares two kept
sets. `tdutils.policies.rkv.compare_redundancy_methods` builds R-KV's method table from them.
"""

from __future__ import annotations

import statistics
import time

import torch


def synthetic_keys(heads: int, n: int, head_dim: int, *, kind: str = "random", seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """Keys `[heads, n, head_dim]` for tests and benchmarks.

    `kind="random"`: i.i.d. N(0, 1) (almost no pair above a 0.5 cosine once `d` is large).
    `kind="realistic"`: `0.6·μ_h + 0.4·N(0, 1)` with one N(0, 1) mean vector `μ_h` per head, like real
    post-RoPE keys that share a large per-head component: most pairs are near-duplicates, so most rows
    find their rightmost hit right next to the right edge. Filled in place (no full-size temporaries).
    """
    if kind not in ("random", "realistic"):
        raise ValueError(f"kind must be 'random' or 'realistic', got {kind!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    keys = torch.empty(heads, n, head_dim, dtype=torch.float32, device=device).normal_(generator=g)
    if kind == "realistic":
        mu = torch.empty(heads, 1, head_dim, dtype=torch.float32, device=device).normal_(generator=g)
        keys.mul_(0.4).add_(mu, alpha=0.6)
    return keys.to(dtype)


def kept_agreement(keep: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of `reference`'s kept tokens that `keep` also keeps (1.0 = same set when sizes match)."""
    ref = set(torch.as_tensor(reference).tolist())
    if not ref:
        return 1.0
    return len(ref & set(torch.as_tensor(keep).tolist())) / len(ref)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(fn, *args, device: str | torch.device | None = None, **kwargs) -> tuple[object, int]:
    """Run `fn(*args, **kwargs)` once; return `(result, peak bytes allocated by torch during the call)`.

    CUDA: `torch.cuda.max_memory_allocated` minus what was allocated before the call. CPU: the torch
    profiler's allocation events (`profile_memory=True`), replayed in time order; the peak of live bytes
    allocated after the call started, the returned tensors included. Counts tensors only (not Python
    objects, allocator slack, or memory freed but kept by the C allocator).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:  # + allocation, - free
        live += nbytes
        peak = max(peak, live)
    return out, peak


def timed(fn, *args, device: str | torch.device | None = None, repeats: int = 1, **kwargs) -> tuple[object, float]:
    """`(result of the last call, median seconds over `repeats` calls)`, synchronising CUDA around each."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    times, out = [], None
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


__all__ = ["kept_agreement", "peak_memory", "synthetic_keys", "timed"]
