"""tdutils against OpenVINO GenAI's cache eviction, on the same RULER prompts (the same token ids) of SmolLM2-135M.

    python bench/peer_openvino.py                      # niah_single_1, 2048 tokens, n=16, batch 4, drop 0.5
    python bench/peer_openvino.py --n 8 --context-length 1024 --rotation off
    python bench/peer_openvino.py --smoke              # CI: n=2 at 512 tokens, < 2 min; skips without the venv
    python bench/peer_openvino.py --build-venv         # build (or check) the OpenVINO venv and the IR, then exit

What it measures, per engine and configuration (one table row each; docs/peer_openvino.md has a measured run):
- tdutils (this venv, `hf` engine, float32): the full cache, and SnapKV at `--drop-ratio` (one kept set per
  request shared by every layer and head, `keep_count(T, r)` tokens, RoPE re-rotated to compact positions):
  `prefill(batch) -> modify(make_drop_fn("snapkv")) -> decode`, batches of `--batch-size`;
- OpenVINO GenAI (its own venv; `worker` runs there through `bench/harness.py`): `ContinuousBatchingPipeline` on the CPU with an
  IR exported offline from the same weights, fp32 (`--weight-format fp32`, no int8 weight compression; properties
  `INFERENCE_PRECISION_HINT=f32`, `KV_CACHE_PRECISION=f32`), `--batch-size` requests added at once and the
  pipeline stepped by hand: the full cache (no eviction), and `CacheEvictionConfig(start_size, recent_size,
  max_cache_size, aggregation_mode, apply_rotation, snapkv_window_size)` with and/or without rotation.

Budget matching: `max_cache_size = match_max_cache_size(keep_count(T, r), block_size, start, recent)`: the keep
count rounded to the nearest multiple of the CPU plugin's KV block size (32 tokens; halves round up), and at least
`start + recent + block`. OpenVINO keeps whole blocks per layer: after the prefill it evicts the lowest-scoring
blocks of the evictable area (between the first `start_size` and last `recent_size` tokens) until the sequence
fits `max_cache_size`; while decoding it evicts again each time a block past the arena fills, so a sequence holds
`max_cache_size` .. `max_cache_size + 31` tokens. tdutils keeps exactly `k` tokens and then grows by the
generated tokens. Defaults mirror tdutils' SnapKV: `recent_size = snapkv_window_size = 64` (SnapKV's window),
`start_size = 32` (one block, the smallest OpenVINO allows; tdutils' SnapKV has no sinks), NORM_SUM.

Columns: `kept`: mean KV tokens per request after the edit (tdutils: `cached_tokens`; OpenVINO: cache blocks in
use at the last decode step, from `get_metrics().cache_usage`, in tokens, divided by the batch: block slots, so
rounded up to 32); `decode tok/s`: generated tokens / seconds of the decode phase (tdutils:
`engine.metrics.decode`; OpenVINO: the `step()` calls after every request of the batch has its first token),
summed over batches; `ratio`: decode tok/s / the same engine's full-cache decode tok/s; `prefill s`: prefill
seconds per batch (tdutils: prefill alone, the edit excluded; OpenVINO: steps until every request has its first
token, so prefill + first token + the eviction that follows); `EM`, `part`: RULER exact match and partial credit
(`tdutils.ruler.score_ruler`) of the answer (greedy, EOS ignored while decoding, the text cut at the first EOS);
`same`: answers equal to the same engine family's full-cache answers (OpenVINO full vs tdutils full: the two
stacks agree).

The venv (`VENV`, a `harness.PeerVenv`): `python -m venv`, `pip install torch==2.13.0` first (the CPU wheel on this machine's
disk), then the OpenVINO packages with a constraint file holding torch==2.13.0; torchvision (pulled in by
optimum-intel, a CUDA build that fails against the CPU torch with "operator torchvision::nms does not exist" and
breaks `import transformers`) is uninstalled. Under `$TDUTILS_OPENVINO_VENV` or
`~/.cache/tdutils/peer-openvino-venv-<version>`. The IR: `optimum-cli export openvino --task
text-generation-with-past --weight-format fp32` of `tdutils.models.resolve_model(model).files()` (offline, HF_HUB_OFFLINE=1),
into `<model folder>-openvino-fp32`, tokenizers converted by openvino-tokenizers alongside.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

OV_VERSION = "2026.4.1"
TORCH_VERSION = "2.13.0"
PACKAGES = (f"torch=={TORCH_VERSION}", f"openvino=={OV_VERSION}", f"openvino-genai=={OV_VERSION}.0",
            f"openvino-tokenizers=={OV_VERSION}.0", "optimum-intel==2.2.0", "transformers==5.5.4")
REMOVE = ("torchvision",)  # a CUDA build pulled in by optimum-intel; breaks `import transformers` on CPU torch
MARKER = H.MARKER
BLOCK_SIZE = 32  # the CPU plugin's paged KV block, in tokens (measured: 64 blocks for a 2048-token prompt)
DEFAULT_OUT = "runs/peer_openvino.json"
DEFAULT_SEED = 5_000_000  # tdutils.eval.HELDOUT_SEED (not imported: the worker runs without tdutils)
AGGREGATION = ("norm_sum", "sum")
ROTATION = {"off": (False,), "on": (True,), "both": (False, True)}
SMOKE = {"n": 2, "context_length": 512, "max_tokens": 8, "batch_size": 2}


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


def _f(v, spec):
    return "" if v is None else format(v, spec)


def format_table(rows: list[dict]) -> str:
    """The report: engine, config, kept tokens, decode tok/s, ratio to the same engine's full cache, prefill
    seconds per batch, RULER exact match and partial credit, answers equal to the full cache's."""
    head = ("engine", "config", "kept", "decode tok/s", "ratio", "prefill s", "EM", "part", "same")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((r["engine"], r["config"], "FAILED: " + r["error"][:80]))
            continue
        lines.append((r["engine"], r["config"], _f(r["kept"], ".0f"), _f(r["tok_s"], ".1f"), _f(r["ratio"], ".2f"),
                      _f(r["prefill_s"], ".1f"), _f(r["em"], ".2f"), _f(r["partial"], ".2f"),
                      "" if r.get("same") is None else f"{r['same']}/{r['n']}"))
    widths = [max(len(str(line[i])) for line in lines if len(line) > i and (i < 2 or len(line) == len(head)))
              for i in range(len(head))]  # a FAILED row's message spans the value columns
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


# --------------------------------------------------------------------------------------------------------------
# The OpenVINO venv and the IR.

VENV = H.PeerVenv(f"peer-openvino-venv-{OV_VERSION}", "TDUTILS_OPENVINO_VENV", PACKAGES,
                  "import torch, transformers, openvino, openvino_genai, optimum.intel, importlib.metadata as m; "
                  "print(torch.__version__, transformers.__version__, openvino.__version__, "
                  "m.version('openvino-genai'), m.version('optimum-intel'))",
                  ("torch", "transformers", "openvino", "openvino_genai", "optimum_intel"), remove=REMOVE)
venv_dir, venv_info, ensure_venv = VENV.dir, VENV.info, VENV.ensure


def _env(threads: int) -> dict:
    return H.peer_env(threads, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


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

def worker(spec: dict) -> dict:
    """Runs in the OpenVINO venv (`harness.call`): every configuration of `spec` on its prompts; the rows and
    versions come back."""
    import importlib.metadata

    import numpy as np
    import openvino as ov
    import openvino_genai as ovg

    cfg = json.loads((Path(spec["ir"]) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # K+V, f32
    props = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
             "INFERENCE_NUM_THREADS": spec["threads"]}
    prompts, bs = spec["prompts"], spec["batch_size"]
    longest = max(len(p) for p in prompts)
    results = []
    for conf in spec["configs"]:
        row = {"config": conf["name"], "requests": [], "batches": []}
        try:
            sc = ovg.SchedulerConfig()
            sc.cache_size = spec["cache_gb"]
            sc.dynamic_split_fuse = False  # whole prompts first, then pure decode steps
            sc.max_num_batched_tokens = bs * (longest + spec["max_tokens"])
            sc.max_num_seqs = bs
            sc.enable_prefix_caching = False
            ev = conf.get("eviction")
            if ev:
                sc.use_cache_eviction = True
                sc.cache_eviction_config = ovg.CacheEvictionConfig(
                    ev["start_size"], ev["recent_size"], ev["max_cache_size"],
                    getattr(ovg.AggregationMode, ev["aggregation"].upper()), apply_rotation=ev["apply_rotation"],
                    snapkv_window_size=ev["snapkv_window_size"])
                row["eviction_config"] = sc.cache_eviction_config.to_string()
            pipe = ovg.ContinuousBatchingPipeline(spec["ir"], sc, "CPU", props)
            gc = ovg.GenerationConfig()
            gc.max_new_tokens, gc.ignore_eos, gc.do_sample = spec["max_tokens"], True, False
            for start in range(0, len(prompts), bs):
                chunk = prompts[start:start + bs]
                handles = [pipe.add_request(start + i, ov.Tensor(np.array([p], dtype=np.int64)), gc)
                           for i, p in enumerate(chunk)]
                ids = [[] for _ in chunk]
                steps = []
                while pipe.has_non_finished_requests():
                    t = time.perf_counter()
                    pipe.step()
                    dt = time.perf_counter() - t
                    new = [0] * len(chunk)
                    for i, h in enumerate(handles):
                        while h.can_read():
                            for out in h.read().values():
                                ids[i] += list(out.generated_ids)
                                new[i] += len(out.generated_ids)
                    m = pipe.get_metrics()
                    steps.append({"seconds": dt, "new": new, "cache_usage": m.cache_usage})
                total_slots = m.kv_cache_size_in_bytes / bytes_per_token
                last = steps[-1]["cache_usage"] / 100 * total_slots / len(chunk)  # block slots per request
                peak = max(s["cache_usage"] for s in steps) / 100 * total_slots / len(chunk)
                ph = phase_split(steps, len(chunk))
                row["batches"].append({**ph, "size": len(chunk), "slots_last": last, "slots_peak": peak,
                                       "steps": len(steps)})
                row["requests"] += [{"output_ids": x, "ttft_s": f} for x, f in zip(ids, ph["first_token_s"])]
                print(f"[openvino] {conf['name']} prompts {start + 1}-{start + len(chunk)}: "
                      f"{ph['decode_tokens'] / ph['decode_s']:.1f} tok/s, prefill {ph['prefill_s']:.1f} s, "
                      f"{last:.0f} slots/request", file=sys.stderr, flush=True)
            del pipe
        except Exception as exc:  # noqa: BLE001 (a configuration that cannot run is reported, the others go on)
            row = {"config": conf["name"], "error": f"{type(exc).__name__}: {exc}"[:800]}
            print(f"[openvino] {conf['name']} FAILED: {row['error']}", file=sys.stderr, flush=True)
        results.append(row)
    info = {name: importlib.metadata.version(name) for name in
            ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "transformers", "torch")}
    info["properties"] = props
    return {"info": info, "rows": results}


# --------------------------------------------------------------------------------------------------------------
# tdutils side.

def run_tdutils(engine, prompts, drop_ratio, *, max_tokens, batch_size) -> dict:
    """{"full"|"snapkv": {"texts", "kept", "tokens", "seconds", "prefill_s" (list per batch)}}."""
    import copy

    from tdutils import make_drop_fn

    fn = make_drop_fn("snapkv", drop_ratio=drop_ratio, model_config=engine.model.config)
    res = {c: {"texts": [], "kept": [], "tokens": 0, "seconds": 0.0, "prefill_s": []} for c in ("full", "snapkv")}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        engine.prefill(chunk)
        prefill_s = engine.metrics.prefill.seconds
        saved = [copy.copy(r) for r in engine.requests]
        for name, cell in res.items():
            engine.requests = [copy.copy(q) for q in saved]
            if name == "snapkv":
                engine.modify(fn)
            outs = engine.decode(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            cell["texts"] += [o.answer for o in outs]
            cell["kept"] += [o.cached_tokens for o in outs]
            cell["tokens"] += engine.metrics.decode.output_tokens
            cell["seconds"] += engine.metrics.decode.seconds
            cell["prefill_s"].append(prefill_s)
            print(f"[tdutils] {name} prompts {start + 1}-{start + len(chunk)}: "
                  f"{engine.metrics.decode.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    return res


# --------------------------------------------------------------------------------------------------------------
# Command line and report.

def _ratio(text):
    try:
        r = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a drop ratio in (0, 1), got {text!r}") from None
    if not 0.0 < r < 1.0:
        raise argparse.ArgumentTypeError(f"expected a drop ratio in (0, 1), got {text!r}")
    return r


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
    from tdutils.cli_args import count, positive_int

    ap = H.parser("peer_openvino.py", __doc__)
    H.add_standard(ap, model="smollm2-135m", json=None, summary=False)
    ap.add_argument("--task", default="niah_single_1", help="RULER task (default niah_single_1)")
    ap.add_argument("--context-length", type=positive_int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--n", type=positive_int, default=16, help="prompts (default 16)")
    ap.add_argument("--drop-ratio", type=_ratio, default=0.5, help="SnapKV drop ratio; sets the OpenVINO budget "
                    "(default 0.5)")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="greedy new tokens (default: the longest gold answer's tokens + 4)")
    ap.add_argument("--batch-size", type=positive_int, default=4, help="requests decoded together (default 4)")
    ap.add_argument("--seed", type=count, default=DEFAULT_SEED, help="dataset seed (default 5000000, held out)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch / OpenVINO inference threads (default: tdutils.cli_args.usable_cores())")
    ap.add_argument("--start-size", type=_block_multiple, default=32, help="OpenVINO start_size (default 32)")
    ap.add_argument("--recent-size", type=_block_multiple, default=64,
                    help="OpenVINO recent_size (default 64 = SnapKV's window)")
    ap.add_argument("--snapkv-window", type=count, default=64, help="OpenVINO snapkv_window_size (default 64)")
    ap.add_argument("--aggregation", choices=AGGREGATION, default="norm_sum", help="aggregation_mode")
    ap.add_argument("--rotation", choices=tuple(ROTATION), default="both",
                    help="apply_rotation rows: off, on or both (default both)")
    ap.add_argument("--cache-gb", type=positive_int, default=2, help="OpenVINO KV cache pool, whole GB (default 2)")
    ap.add_argument("--smoke", action="store_true", help=f"tiny run for CI ({SMOKE}); skipped with a one-line "
                    "reason when the OpenVINO venv does not exist (it is never built in this mode)")
    ap.add_argument("--build-venv", action="store_true", help="build (or check) the venv and the IR, then exit")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
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
            "aggregation": args.aggregation, "apply_rotation": rot, "snapkv_window_size": args.snapkv_window}})
    return out


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    if args.smoke and venv_info() is None:
        print(f"{ap.prog}: skipped: no OpenVINO venv at {venv_dir()} (build it with --build-venv; --smoke never "
              f"builds it)")
        return 0
    try:
        return run(args)
    except (ValueError, OSError, RuntimeError, subprocess.CalledProcessError) as exc:  # WorkerError too
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    import torch

    from tdutils import ruler
    from tdutils.cli_args import usable_cores
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
    torch.set_num_threads(threads)

    from tdutils.engines.hf import HFEngine

    engine = HFEngine(args.model, dtype="float32", kv_budget_tokens=None, prefill_batch_size=args.batch_size,
                      query_window=64, progress=False)  # SnapKV scores with the last 64 queries
    tok = engine.tokenizer
    data, prompts, args.max_tokens = H.ruler_prompts(args.task, args.n, args.context_length, tok, args.seed,
                                                     args.max_tokens)
    keep = keep_count(max(len(p) for p in prompts), args.drop_ratio)
    configs = ov_configs(args, keep)
    t0 = time.perf_counter()
    td = run_tdutils(engine, prompts, args.drop_ratio, max_tokens=args.max_tokens, batch_size=args.batch_size)
    td_s = time.perf_counter() - t0

    spec = {"ir": str(ir), "prompts": prompts, "configs": configs, "max_tokens": args.max_tokens,
            "batch_size": args.batch_size, "threads": threads, "cache_gb": args.cache_gb}
    t1 = time.perf_counter()
    peer = H.call(__file__, "worker", spec, python=py, env=_env(threads), stream=True)
    ov_s = time.perf_counter() - t1

    eos = sorted(engine.eos_token_ids)  # the ids tdutils' own answers end at

    def score(texts):
        s = [ruler.score_ruler(args.task, ex["values"], t) for ex, t in zip(data, texts)]
        return sum(bool(e) for e, _ in s) / len(s), sum(p for _, p in s) / len(s)

    n = len(prompts)
    rows, texts = [], {}
    for name, cell in td.items():
        em, part = score(cell["texts"])
        texts["tdutils", name] = cell["texts"]
        rows.append({"engine": "tdutils", "config": "full" if name == "full" else f"snapkv r={args.drop_ratio:g}",
                     "n": n, "kept": sum(cell["kept"]) / n, "tok_s": cell["tokens"] / cell["seconds"],
                     "prefill_s": sum(cell["prefill_s"]) / len(cell["prefill_s"]), "em": em, "partial": part,
                     "same": None if name == "full" else sum(a == b for a, b in zip(cell["texts"], td["full"]["texts"]))})
    for prow in peer["rows"]:
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
                     "eviction_config": prow.get("eviction_config")})
    add_ratios(rows)
    print(format_table(rows))
    meta = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "model": args.model, "folder": str(folder),
            "ir": str(ir), "task": args.task, "context_length": args.context_length, "n": n,
            "drop_ratio": args.drop_ratio, "keep": keep, "configs": configs, "max_tokens": args.max_tokens,
            "batch_size": args.batch_size, "seed": args.seed, "threads": threads, "cache_gb": args.cache_gb,
            "tdutils_seconds": round(td_s, 1), "openvino_seconds": round(ov_s, 1), "peer": peer["info"],
            "venv": venv_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    details = [{"values": ex["values"], **{f"{e}|{c}": t[i] for (e, c), t in texts.items()}}
               for i, ex in enumerate(data)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "rows": rows, "batches": {r["config"]: r.get("batches")
                                                                             for r in peer["rows"]},
                                    "requests": details}, indent=1, default=str))
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
