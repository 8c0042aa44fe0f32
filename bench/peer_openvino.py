"""tdutils against OpenVINO GenAI's cache eviction, on the same RULER prompts (the same token ids) of SmolLM2-135M.

    python bench/peer_openvino.py                      # niah_single_1, 2048 tokens, n=16, batch 4, drop 0.5
    python bench/peer_openvino.py --n 8 --context-length 1024 --rotation off
    python bench/peer_openvino.py --smoke              # CI: n=2 at 512 tokens, < 2 min; skips without the venv
    python bench/peer_openvino.py --build-venv         # build (or check) the OpenVINO venv and the IR, then exit
    python bench/peer_openvino.py --dtype bfloat16     # both sides in bf16 (weights, activations, KV cache)

OpenVINO runs in its own venv (`VENV`, `worker` through `harness.call`). The venv, the IR, budget matching and
every column: docs/peer_openvino.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

OV_VERSION = "2026.4.1"
TORCH_VERSION = "2.13.0"
PACKAGES = (f"torch=={TORCH_VERSION}", f"openvino=={OV_VERSION}", f"openvino-genai=={OV_VERSION}.0",
            f"openvino-tokenizers=={OV_VERSION}.0", "optimum-intel==2.2.0", "transformers==5.0.0")
# transformers 5.0.0: optimum-intel 2.2.0 exports Gemma 3 only up to 5.0 (its Gemma configs' MAX_TRANSFORMERS_VERSION;
# 5.5.4 refused it), Llama with any version in its range (>=4.51, <5.6)
REMOVE = ("torchvision",)  # a CUDA build pulled in by optimum-intel; breaks `import transformers` on CPU torch
MARKER = H.MARKER
BLOCK_SIZE = 32  # the CPU plugin's paged KV block, in tokens (measured: 64 blocks for a 2048-token prompt)
DEFAULT_OUT = "runs/peer_openvino.json"
AGGREGATION = ("norm_sum", "sum")
ROTATION = {"off": (False,), "on": (True,), "both": (False, True)}
SNAPKV_WINDOW = 64  # OpenVINO snapkv_window_size: SnapKV's window on tdutils' side
SMOKE = {"n": 2, "context_length": 512, "max_tokens": 8, "batch_size": 2}
PRECISION = {"float32": "f32", "bfloat16": "bf16"}  # --dtype -> OpenVINO's INFERENCE_PRECISION_HINT / KV_CACHE_PRECISION


# --------------------------------------------------------------------------------------------------------------
# Pure helpers (stdlib only: the worker uses them too).

def match_max_cache_size(keep: int, block_size: int = BLOCK_SIZE, start_size: int = 32, recent_size: int = 64) -> int:
    """OpenVINO's `max_cache_size` for a kept count `keep`: the nearest multiple of `block_size` (halves round up),
    at least `start_size + recent_size + block_size` (OpenVINO wants it larger than start + recent).

    Raises:
        ValueError: keep < 1, block_size < 1, or start/recent sizes not positive multiples of block_size.
    """
    if keep < 1 or block_size < 1:
        raise ValueError(f"keep and block_size must be >= 1, got {keep}, {block_size}")
    for name, v in (("start_size", start_size), ("recent_size", recent_size)):
        if v < 1 or v % block_size:
            raise ValueError(f"{name} must be a positive multiple of the block size {block_size}, got {v}")
    rounded = (keep + block_size // 2) // block_size * block_size
    return max(rounded, start_size + recent_size + block_size)


def phase_split(steps: list[dict], n_requests: int) -> dict:
    """Split a hand-stepped batch into prefill and decode. `steps`: one dict per `step()` call, `seconds` and
    `new` (tokens each request received in that step, a list of `n_requests` ints). The prefill phase ends with the
    step after which every request holds at least one token; the decode phase is every later step.

    Returns {"prefill_s", "decode_s", "decode_tokens", "decode_steps", "first_token_s" (per request, from the
    batch's start)}.
    """
    got = [0] * n_requests
    first = [math.nan] * n_requests
    elapsed, prefill_s, decode_s, decode_tokens, decode_steps, in_decode = 0.0, 0.0, 0.0, 0, 0, False
    for st in steps:
        elapsed += st["seconds"]
        if in_decode:
            decode_s += st["seconds"]
            decode_tokens += sum(st["new"])
            decode_steps += 1
            continue
        prefill_s += st["seconds"]
        for i, k in enumerate(st["new"]):
            if k and not got[i]:
                first[i] = elapsed
            got[i] += k
        in_decode = all(got)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens": decode_tokens,
            "decode_steps": decode_steps, "first_token_s": first}


def cut_at_eos(ids: list[int], eos_ids) -> list[int]:
    """`ids` up to (excluding) the first id in `eos_ids` (what tdutils scores: the answer ends at EOS)."""
    eos = set(eos_ids)
    for i, t in enumerate(ids):
        if t in eos:
            return list(ids[:i])
    return list(ids)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set each row's `ratio`: its decode tok/s over the full-cache row's of the same engine (None without one)."""
    base = {r["engine"]: r["tok_s"] for r in rows if r.get("config") == "full" and "error" not in r}
    for r in rows:
        b = base.get(r["engine"])
        r["ratio"] = r["tok_s"] / b if "error" not in r and b else None
    return rows


# --------------------------------------------------------------------------------------------------------------
# The OpenVINO venv and the IR.

VENV = H.PeerVenv(f"peer-openvino-venv-{OV_VERSION}", "TDUTILS_OPENVINO_VENV", PACKAGES,
                  "import torch, transformers, openvino, openvino_genai, optimum.intel, importlib.metadata as m; "
                  "print(torch.__version__, transformers.__version__, openvino.__version__, "
                  "m.version('openvino-genai'), m.version('optimum-intel'))",
                  ("torch", "transformers", "openvino", "openvino_genai", "optimum_intel"), remove=REMOVE)
venv_dir, venv_info, ensure_venv = VENV.dir, VENV.info, VENV.ensure


def _env(threads: int) -> dict:
    # OPENVINO_LOG_LEVEL=3: openvino.genai prints each compiled model's properties (`_compiled_properties`)
    return H.peer_env(threads, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OPENVINO_LOG_LEVEL="3")


def ensure_ir(py: Path, folder: Path, *, log=print) -> Path:
    """The fp32 OpenVINO IR of the transformers folder `folder`, exported offline once into `<folder>-openvino-fp32`."""
    out = folder.parent / f"{folder.name}-openvino-fp32"
    marker = out / ".tdutils-ir.json"
    if marker.exists() and (out / "openvino_model.xml").exists() and (out / "openvino_tokenizer.xml").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    log(f"exporting {folder} to OpenVINO IR (fp32) in {out}")
    t0 = time.perf_counter()
    cli = py.parent / "optimum-cli"
    res = subprocess.run([str(cli), "export", "openvino", "--model", str(folder), "--task",
                          "text-generation-with-past", "--weight-format", "fp32", str(out)],
                         check=False, env=_env(1), capture_output=True, text=True, timeout=1800)
    if res.returncode or not (out / "openvino_model.xml").exists():
        raise RuntimeError(f"optimum-cli export openvino failed (rc {res.returncode}): {res.stderr[-1500:]}")
    marker.write_text(json.dumps({"source": str(folder), "weight_format": "fp32",
                                  "export_s": round(time.perf_counter() - t0, 1)}))
    return out


# --------------------------------------------------------------------------------------------------------------
# Worker: runs in the OpenVINO venv; must not import tdutils.

def _pipeline(spec: dict, conf: dict, props: dict):
    """`(ContinuousBatchingPipeline, eviction config text or None)` of one configuration: whole prompts first then
    pure decode steps (no dynamic split-fuse), `batch_size` sequences, no prefix caching, `conf["eviction"]`."""
    import openvino_genai as ovg

    sc = ovg.SchedulerConfig()
    sc.cache_size = spec["cache_gb"]
    sc.dynamic_split_fuse = False
    sc.max_num_batched_tokens = spec["batch_size"] * (max(map(len, spec["prompts"])) + spec["max_tokens"])
    sc.max_num_seqs = spec["batch_size"]
    sc.enable_prefix_caching = False
    ev, text = conf.get("eviction"), None
    if ev:
        sc.use_cache_eviction = True
        sc.cache_eviction_config = ovg.CacheEvictionConfig(
            ev["start_size"], ev["recent_size"], ev["max_cache_size"],
            getattr(ovg.AggregationMode, ev["aggregation"].upper()), apply_rotation=ev["apply_rotation"],
            snapkv_window_size=ev["snapkv_window_size"])
        text = sc.cache_eviction_config.to_string()
    return ovg.ContinuousBatchingPipeline(spec["ir"], sc, "CPU", props), text


def _compiled_properties(make, *args):
    """`(make(*args), properties)`: the properties of the compiled LLM ("Model: LLM ..." block) that openvino.genai
    prints on stdout under OPENVINO_LOG_LEVEL=3 while `make(*args)` builds a pipeline (its Python API returns no compiled
    model), read from file descriptor 1; {} when it printed none."""
    sys.stdout.flush()
    with tempfile.TemporaryFile("w+") as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)  # C++ writes there, not through sys.stdout
        try:
            out = make(*args)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        block = f.read().partition("Model: LLM")[2].partition("EXECUTION_DEVICES:\n")[0]
    return out, {k.strip(): v.strip() for k, sep, v in (ln.partition(": ") for ln in block.splitlines()[1:]) if sep}


def _run_batch(pipe, chunk, start: int, max_tokens: int, bytes_per_token: int):
    """One batch added at once and the pipeline stepped by hand (greedy, EOS ignored): `(generated ids per
    request, batch figures: `phase_split` + block slots per request at the last step and at the peak)`."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ovg

    gc = ovg.GenerationConfig()
    gc.max_new_tokens, gc.ignore_eos, gc.do_sample = max_tokens, True, False
    handles = [pipe.add_request(start + i, ov.Tensor(np.array([p], dtype=np.int64)), gc) for i, p in enumerate(chunk)]
    ids, steps = [[] for _ in chunk], []
    while pipe.has_non_finished_requests():
        t = time.perf_counter()
        pipe.step()
        dt, new = time.perf_counter() - t, [0] * len(chunk)
        for i, h in enumerate(handles):
            while h.can_read():
                for out in h.read().values():
                    ids[i] += list(out.generated_ids)
                    new[i] += len(out.generated_ids)
        m = pipe.get_metrics()
        steps.append({"seconds": dt, "new": new, "cache_usage": m.cache_usage})
    slots = m.kv_cache_size_in_bytes / bytes_per_token / 100 / len(chunk)  # per request, per % of the pool
    return ids, {**phase_split(steps, len(chunk)), "size": len(chunk), "slots_last": steps[-1]["cache_usage"] * slots,
                 "slots_peak": max(st["cache_usage"] for st in steps) * slots, "steps": len(steps)}


def worker(spec: dict) -> dict:
    """Runs in the OpenVINO venv (`harness.call`): every configuration of `spec` on its prompts; the rows and
    versions come back."""
    import importlib.metadata

    cfg = json.loads((Path(spec["ir"]) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    prec = spec.get("precision", "f32")
    bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * (4 if prec == "f32" else 2)
    props = {"INFERENCE_PRECISION_HINT": prec, "KV_CACHE_PRECISION": prec, "INFERENCE_NUM_THREADS": spec["threads"]}
    prompts, bs = spec["prompts"], spec["batch_size"]
    results = []
    for conf in spec["configs"]:
        row = {"config": conf["name"], "requests": [], "batches": []}
        try:
            (pipe, text), row["compiled"] = _compiled_properties(_pipeline, spec, conf, props)
            if text:
                row["eviction_config"] = text
            for start in range(0, len(prompts), bs):
                ids, batch = _run_batch(pipe, prompts[start:start + bs], start, spec["max_tokens"], bytes_per_token)
                row["batches"].append(batch)
                row["requests"] += [{"output_ids": x, "ttft_s": f} for x, f in zip(ids, batch["first_token_s"])]
                H.log(f"[openvino] {conf['name']} prompts {start + 1}-{start + len(ids)}: "
                      f"{batch['decode_tokens'] / batch['decode_s']:.1f} tok/s, prefill {batch['prefill_s']:.1f} s, "
                      f"{batch['slots_last']:.0f} slots/request")
            del pipe
        except Exception as exc:  # noqa: BLE001 (a configuration that cannot run is reported, the others go on)
            row = {"config": conf["name"], "error": f"{type(exc).__name__}: {exc}"[:800]}
            H.log(f"[openvino] {conf['name']} FAILED: {row['error']}")
        results.append(row)
    info = {name: importlib.metadata.version(name) for name in
            ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "transformers", "torch")}
    return {"info": {**info, "properties": props}, "rows": results}


# --------------------------------------------------------------------------------------------------------------
# Command line and report.

def _block_multiple(text):
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1 or v % BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"expected a positive multiple of the KV block size {BLOCK_SIZE}, "
                                         f"got {text!r}")
    return v


def parse_args(argv=None):
    from tdutils.cli.args import open_ratio, positive_int

    ap = H.parser("peer_openvino.py", __doc__)
    H.add_peer_options(ap, n=16, batch_size=4, out=DEFAULT_OUT)
    ap.add_argument("--dtype", choices=tuple(PRECISION), default="float32", help="weights, activations and KV cache "
                    "on both sides (OpenVINO: INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION; default float32)")
    ap.add_argument("--drop-ratio", type=open_ratio, default=0.5, help="SnapKV drop ratio; sets the OpenVINO "
                    "budget (default 0.5)")
    ap.add_argument("--start-size", type=_block_multiple, default=32, help="OpenVINO start_size (default 32)")
    ap.add_argument("--recent-size", type=_block_multiple, default=64,
                    help="OpenVINO recent_size (default 64 = SnapKV's window)")
    ap.add_argument("--aggregation", choices=AGGREGATION, default="norm_sum", help="aggregation_mode")
    ap.add_argument("--rotation", choices=tuple(ROTATION), default="both",
                    help="apply_rotation rows: off, on or both (default both)")
    ap.add_argument("--cache-gb", type=positive_int, default=2, help="OpenVINO KV cache pool, whole GB (default 2)")
    ap.add_argument("--smoke", action="store_true", help=f"tiny run for CI ({SMOKE}); skipped with a one-line "
                    "reason when the OpenVINO venv does not exist (it is never built in this mode)")
    ap.add_argument("--build-venv", action="store_true", help="build (or check) the venv and the IR, then exit")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    return ap, args


def ov_configs(args, keep: int) -> list[dict]:
    """The OpenVINO rows: the full cache, then eviction at the matched budget for each rotation setting."""
    mcs = match_max_cache_size(keep, BLOCK_SIZE, args.start_size, args.recent_size)
    out = [{"name": "full", "eviction": None}]
    for rot in ROTATION[args.rotation]:
        out.append({"name": f"evict {args.aggregation} rot={'on' if rot else 'off'}", "eviction": {
            "start_size": args.start_size, "recent_size": args.recent_size, "max_cache_size": mcs,
            "aggregation": args.aggregation, "apply_rotation": rot, "snapkv_window_size": SNAPKV_WINDOW}})
    return out


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    if args.smoke and venv_info() is None:
        print(f"{ap.prog}: skipped: no OpenVINO venv at {venv_dir()} (build it with --build-venv; --smoke never "
              f"builds it)")
        return 0
    return H.one_line_errors(ap, run, args, also=(RuntimeError, subprocess.CalledProcessError))  # WorkerError too


def run(args) -> int:
    import torch

    from tdutils import make_drop_fn
    from tdutils.cli.args import usable_cores
    from tdutils.engines.hf import HFEngine
    from tdutils.kernels import kernel_status
    from tdutils.eval import check_output_path
    from tdutils.models import resolve_model
    from tdutils.selection import keep_count

    ref = resolve_model(args.model)
    folder = Path(ref.files(progress=False)) if ref.kind != "random" else None
    if folder is None or not folder.is_dir():
        raise ValueError(f"--model {args.model!r} is not a real model tdutils can resolve to a folder")
    py = ensure_venv(log=H.log)
    ir = ensure_ir(py, folder, log=H.log)
    if args.build_venv:
        print(json.dumps({"python": str(py), "ir": str(ir), **(venv_info() or {})}, indent=1))
        return 0
    H.check_ruler_task(args.task)
    out_path = check_output_path(args.out, "--out", example=DEFAULT_OUT)
    threads = args.threads or usable_cores()
    cores = H.bind_cores(threads)  # the OpenVINO worker inherits the binding: the same cores for both
    torch.set_num_threads(threads)
    engine = HFEngine(args.model, dtype=args.dtype, kv_budget_tokens=None, prefill_batch_size=args.batch_size,
                      query_window=64, progress=False)  # SnapKV scores with the last 64 queries
    data, prompts, args.max_tokens = H.ruler_prompts(args.task, args.n, args.context_length, engine.tokenizer,
                                                     args.seed, args.max_tokens)
    keep = keep_count(max(len(p) for p in prompts), args.drop_ratio)
    configs = ov_configs(args, keep)
    t0 = time.perf_counter()
    snapkv = make_drop_fn("snapkv", drop_ratio=args.drop_ratio, model_config=engine.model.config)
    td = H.decode_cells(engine, prompts, [("full", None), ("snapkv", snapkv)], max_tokens=args.max_tokens,
                        batch_size=args.batch_size)
    td_s = time.perf_counter() - t0

    spec = {"ir": str(ir), "prompts": prompts, "configs": configs, "max_tokens": args.max_tokens,
            "batch_size": args.batch_size, "threads": threads, "cache_gb": args.cache_gb,
            "precision": PRECISION[args.dtype]}
    t1 = time.perf_counter()
    peer = H.call(__file__, "worker", spec, python=py, env=_env(threads), stream=True)
    ov_s = time.perf_counter() - t1
    rows, texts = report_rows(args, data, td, peer["rows"], engine.tokenizer, sorted(engine.eos_token_ids))
    print(H.render("peer_openvino", rows))
    meta = H.peer_meta(args, folder=str(folder), ir=str(ir), drop_ratio=args.drop_ratio, keep=keep, configs=configs,
                       threads=threads, cores=cores, dtype=args.dtype, cache_gb=args.cache_gb, tdutils_seconds=round(td_s, 1),
                       openvino_seconds=round(ov_s, 1), peer=peer["info"], venv=venv_info(),
                       decode_path=engine.decode_path, kernels=kernel_status(),
                       date=time.strftime("%Y-%m-%d %H:%M:%S"))
    details = [{"values": ex["values"], **{f"{e}|{c}": t[i] for (e, c), t in texts.items()}}
               for i, ex in enumerate(data)]
    H.write_json({"meta": meta, "rows": rows, "batches": {r["config"]: r.get("batches") for r in peer["rows"]},
                  "requests": details}, str(out_path), indent=1, default=str)
    H.log(f"wrote {out_path}")
    return 0


def report_rows(args, data, td, peer_rows, tok, eos) -> tuple[list[dict], dict]:
    """The table's rows (tdutils' cells, then OpenVINO's configurations, with `add_ratios`) and every answer text
    by (engine, config); OpenVINO's ids are cut at tdutils' EOS ids before decoding."""
    def score(texts):
        em, part = H.ruler_scores(args.task, data, texts)
        return sum(em) / len(em), sum(part) / len(part)

    n, rows, texts = len(data), [], {}
    for name, cell in td.items():
        em, part = score(cell["texts"])
        texts["tdutils", name] = cell["texts"]
        rows.append({"engine": "tdutils", "config": "full" if name == "full" else f"snapkv r={args.drop_ratio:g}",
                     "n": n, "kept": sum(cell["kept"]) / n, "tok_s": cell["tokens"] / cell["seconds"],
                     "steady_tok_s": cell["steady_tok_s"],
                     "prefill_s": sum(cell["prefill_s"]) / len(cell["prefill_s"]), "em": em, "partial": part,
                     "same": None if name == "full" else sum(a == b for a, b in zip(cell["texts"], td["full"]["texts"]))})
    for prow in peer_rows:
        if "error" in prow:
            rows.append({"engine": "openvino", "config": prow["config"], "error": prow["error"]})
            continue
        out_texts = [tok.decode(cut_at_eos(r["output_ids"], eos), skip_special_tokens=True) for r in prow["requests"]]
        texts["openvino", prow["config"]] = out_texts
        em, part = score(out_texts)
        b = prow["batches"]
        ref = td["full"]["texts"] if prow["config"] == "full" else texts.get(("openvino", "full"))
        rows.append({"engine": "openvino", "config": prow["config"], "n": n,
                     "kept": sum(x["slots_last"] * x["size"] for x in b) / n,
                     "tok_s": sum(x["decode_tokens"] for x in b) / sum(x["decode_s"] for x in b),
                     "prefill_s": sum(x["prefill_s"] for x in b) / len(b), "em": em, "partial": part,
                     "same": None if ref is None else sum(a == c for a, c in zip(out_texts, ref)),
                     "eviction_config": prow.get("eviction_config"), "compiled": prow.get("compiled")})
    for r in rows:
        r["dtype"] = args.dtype
    return add_ratios(rows), texts


if __name__ == "__main__":
    sys.exit(main())
