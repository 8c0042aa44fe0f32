"""tdutils against its peer, NVIDIA kvpress, on the same RULER prompts (the same token ids) of a real model.

    python bench/peer_kvpress.py                                   # smollm2-135m, niah_single_1, 2048 tokens,
                                                                   # n=50, ratios 0.5/0.75, every press below
    python bench/peer_kvpress.py --n 4 --context-length 1024 --presses snapkv,random,tova --ratios 0.5
    python bench/peer_kvpress.py --task niah_multikey_1 --out runs/peer_multikey.json

Runtime (2 shared CPU cores, 1 thread): n=4 at 1024 tokens with 4 presses at one ratio took ~5 min (tdutils 70 s,
kvpress 220 s); kvpress prefills every prompt once per press and ratio, so the default run (n=50, 2048 tokens,
11 presses x 2 ratios) is several hours, nearly all of it on the kvpress side.

What it measures. tdutils drops tokens from each request's KV cache after prefill and keeps ONE token set per
request, shared by every layer and head (what a paged serving cache can store), re-rotates RoPE to compact
positions and decodes the edited requests together in one batch (`hf` engine). kvpress (github.com/NVIDIA/kvpress)
compresses inside the prefill, layer by layer, keeps one token set per layer *and KV head*, leaves the kept keys at
their original positions, and decodes one request at a time. Both run here on the same prompts, the same
weights (float32), the same compression ratios (fraction of prompt tokens dropped), greedy, EOS ignored, the
same number of new tokens, and both are scored the same way.

Flow per prompt `ids` (T tokens: context, then the question):
- tdutils (this venv): `HFEngine.prefill(ids)` -> `modify(make_drop_fn(policy, drop_ratio=r))` -> `decode`;
  the kept set is `DropFn.keep_indices` of the prefilled cache (indices into 0..T-1). The engine drops the
  last cached entry and feeds the last kept token again, so every generated token attends to the edited cache.
- kvpress (its own venv, `VENV`; `worker` runs there through `bench/harness.py`): `with press(model):
  model.model(ids[:-1])` (the press compresses each layer's cache right after its attention, as
  `KVPressTextGenerationPipeline` compresses the context), then `ids[-1]` is fed at position T-1 on the
  compressed cache and greedy decoding continues at T, T+1, ... — the pipeline's own `generate_answer` with the
  last prompt token as the "question". So here too every generated token attends to the compressed cache, and
  query-aware presses see the question (their window is ids[T-1-w:T-1], one token earlier than tdutils'
  ids[T-w:T]). Its kept set for layer l and KV head h is the press' kept indices of ids[:-1] plus T-1 (the
  re-fed token, always in the cache). The kept indices are read in `compress`: for presses that gather (most),
  by matching each kept key row bit for bit to its row of the uncompressed keys; for presses that mask
  (AdaKV: `module.masked_key_indices`, keys stay in the cache), as everything not masked.
- Row "none" (ratio 0): both sides' full caches, the same flow without an edit: a check that the two venvs
  (tdutils' transformers vs kvpress' transformers <5.3) compute the same answers.

Columns (one row per press x ratio; n prompts; `docs/results/peer_kvpress.json` holds them, per-request details and
`meta` with the command line, settings and both sides' defaults):
- `press`, `policy`: the kvpress press and the tdutils policy it is compared with (`PRESSES`: same method, or
  the nearest one where tdutils has no such policy, marked `~`);
- `kv_em`, `kv_partial` / `td_em`, `td_partial`: exact match (every gold value in the response) and partial
  credit (fraction of gold values present, RULER's string_match_part) of kvpress / tdutils on the same prompts;
  `*_ci`: 95% Wilson score interval of the exact match (`tdutils.answers.wilson_interval`);
- `kv_tok_s`: kvpress decode tokens/s, batch 1 (all generated tokens of all requests / seconds from the re-fed
  token to the last token, summed over requests); `td_tok_s`: tdutils decode tokens/s of the batched decode
  (`engine.metrics.decode.tokens_per_s`, up to `--batch-size` requests at once); both exclude prefill and edit;
- `kv_kept`, `td_kept`: mean KV tokens per request after the edit (kvpress: mean over layers and heads);
- `overlap`: per request, mean over layers l and KV heads h of |S ∩ K_lh| / |S|, S = tdutils' kept set, K_lh =
  kvpress' kept set of layer l, head h (both as prompt positions 0..T-1); then mean over requests. 1.0 = kvpress
  keeps everything tdutils keeps, in every layer and head (with equal budgets, the same sets).

Defaults that differ (recorded in `meta.defaults`): window sizes (SnapKV 64 on both sides; tdutils' random keeps
4 sinks + the last 16 tokens, kvpress' RandomPress none; tova/knorm/keydiff: tdutils' window 1/0/0, kvpress the
last token / none / none; ObservedAttention averages attention over the queries that saw each key, tdutils' h2o
sums it); the keep count (tdutils round-half-even of T(1-r); kvpress int((T-1)(1-r)) of ids[:-1], plus the re-fed
token); per-head selection (kvpress scores per KV head; tdutils averages scores over heads and layers into one set).

Sources: kvpress (NVIDIA, https://github.com/NVIDIA/kvpress, Apache-2.0; version `KVPRESS_VERSION`).
SnapKV arXiv:2404.14469; StreamingLLM arXiv:2309.17453; TOVA arXiv:2401.06104; Knorm arXiv:2406.11430; KeyDiff
arXiv:2504.15364; H2O (ObservedAttention) arXiv:2306.14048; Expected Attention arXiv:2510.00636; AdaKV
arXiv:2407.11550; CriticalKV arXiv:2502.03805; PyramidKV arXiv:2406.02069; RULER arXiv:2404.06654.

The peer venv: built on first use (`harness.PeerVenv`; `torch==2.13.0` CPU wheel first, then
`kvpress==0.5.5` under a constraint keeping that torch) under `~/.cache/tdutils/peer-kvpress-venv-0.5.5`
(`$TDUTILS_PEER_VENV` overrides), reused afterwards. Prompts: `tdutils.ruler.make_ruler_dataset(task, n,
context_length, tokenizer=<the model's>, seed=seed)` (RULER's templates, in the model's chat template when it has
one), scored by `tdutils.ruler.score_ruler`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

# press key -> (kvpress construction, tdutils policy, exact counterpart?, needs eager attention)
PRESSES = {
    "snapkv": ("SnapKVPress", "snapkv", True, False),
    "random": ("RandomPress", "random", True, False),
    "streaming_llm": ("StreamingLLMPress", "streaming_llm", True, False),
    "tova": ("TOVAPress", "tova", True, False),
    "knorm": ("KnormPress", "knorm", True, False),
    "keydiff": ("KeyDiffPress", "keydiff", True, False),
    "observed_attention": ("ObservedAttentionPress", "h2o", True, True),
    "expected_attention": ("ExpectedAttentionPress", "snapkv", False, False),
    "adakv": ("AdaKVPress(SnapKVPress)", "snapkv", False, False),
    "criticalkv": ("CriticalKVPress(SnapKVPress)", "snapkv", False, False),
    "pyramidkv": ("PyramidKVPress", "snapkv", False, False),
}
FULL = "none"  # the full-cache row on both sides
DEFAULT_OUT = "docs/results/peer_kvpress.json"
DEFAULT_SEED = 5_000_000  # tdutils.eval.HELDOUT_SEED (not imported: the worker runs without tdutils)
KVPRESS_VERSION = "0.5.5"
# kvpress pins transformers<5.3 while tdutils runs a newer one: kvpress never goes into tdutils' venv
VENV = H.PeerVenv(f"peer-kvpress-venv-{KVPRESS_VERSION}", "TDUTILS_PEER_VENV",
                  ("torch==2.13.0", f"kvpress=={KVPRESS_VERSION}"),
                  "import torch, transformers, kvpress, importlib.metadata as m; "
                  "print(torch.__version__, transformers.__version__, m.version('kvpress'))",
                  ("torch", "transformers", "kvpress"))


# --------------------------------------------------------------------------------------------------------------
# Worker: runs in the peer venv (torch, transformers <5.3, kvpress); must not import tdutils.

def _make_press(key: str, ratio: float):
    import kvpress

    inner = {"adakv": "AdaKVPress", "criticalkv": "CriticalKVPress"}
    if key in inner:  # wrappers around a scorer press: SnapKV, the press tdutils' nearest policy is
        return getattr(kvpress, inner[key])(kvpress.SnapKVPress(compression_ratio=ratio))
    return getattr(kvpress, PRESSES[key][0])(compression_ratio=ratio)


def _press_defaults(key: str) -> dict:
    press = _make_press(key, 0.5)
    out = {}
    for obj, prefix in ((press, ""), (getattr(press, "press", None), "press.")):
        if obj is not None:  # dataclass fields and plain attributes both live in __dict__
            out.update({prefix + k: v for k, v in vars(obj).items()
                        if isinstance(v, (int, float, bool, str, type(None))) and k != "compression_ratio"})
    return out


def _kept_rows(before, after, module):
    """BoolTensor [H, T]: which of the T uncompressed key rows of each KV head the press kept (batch 1)."""
    import torch

    _, heads, t, _ = before.shape
    masked = getattr(module, "masked_key_indices", None)
    if masked is not None and after.shape == before.shape:  # masking press: keys stay, masked ones are hidden
        keep = torch.ones(heads, t, dtype=torch.bool)
        _, h_idx, s_idx = masked
        keep[h_idx.cpu(), s_idx.cpu()] = False
        return keep
    # Gathering press: the kept rows are bit-identical copies, so an exact integer hash of each row's bits finds
    # its origin (float matmul hashes could round differently on tensors of different shapes).
    weights = torch.randint(-(2**31), 2**31, (before.shape[-1],), generator=torch.Generator().manual_seed(0),
                            dtype=torch.int64)

    def hashes(x):
        bits = x[0].contiguous().view(torch.int32) if x.dtype == torch.float32 else x[0].float().view(torch.int32)
        return (bits.long() * weights).sum(-1)  # [H, rows]; int64 wrap-around is exact and order-free

    hb, ha = hashes(before), hashes(after)
    keep = torch.zeros(heads, t, dtype=torch.bool)
    for h in range(heads):
        where = {v: i for i, v in enumerate(hb[h].tolist())}
        idx = [where.get(v) for v in ha[h].tolist()]
        if None in idx or len(where) != t:
            raise RuntimeError(f"layer {module.layer_idx} head {h}: kept keys do not match the prompt's keys "
                               f"(the press changed them); cannot recover its kept set")
        keep[h, idx] = True
    return keep


def _record_kept(press, record: dict):
    """Wrap `press.compress` so each layer's kept rows land in `record[layer]` (the hook calls self.compress)."""
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        record[module.layer_idx] = _kept_rows(keys, new_keys, module)
        return new_keys, new_values

    press.compress = compress
    return press


def worker(spec: dict) -> dict:
    """Runs in the peer venv (`harness.call`): every press and ratio on the prompts of `spec`; the kept sets go
    to `spec["kept_path"]` (torch.save: too large for JSON), the rows and versions come back."""
    import importlib.metadata

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(spec["threads"])
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would flood the log
    models = {}

    def model_for(attn: str):
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32,
                                                                attn_implementation=attn).eval()
        return models[attn]

    results, kept_masks = [], {}
    for key in spec["presses"]:
        for ratio in ([0.0] if key == FULL else spec["ratios"]):
            eager = key != FULL and PRESSES[key][3]
            model = model_for("eager" if eager else "sdpa")
            row = {"press": key, "ratio": ratio, "requests": []}
            try:
                for i, ids in enumerate(spec["prompts"]):
                    torch.manual_seed(spec["seed"] + i)  # RandomPress draws from torch's default generator
                    record: dict = {}
                    cache = DynamicCache()
                    ctx = torch.tensor([ids[:-1]])
                    with torch.inference_mode():
                        if key == FULL:
                            model.model(input_ids=ctx, past_key_values=cache)
                        else:
                            press = _record_kept(_make_press(key, ratio), record)
                            with press(model):
                                model.model(input_ids=ctx, past_key_values=cache)
                        t = len(ids)
                        cached = [cache.layers[layer].keys.shape[2] for layer in range(len(cache.layers))]
                        # decode: re-feed the last prompt token at T-1, then greedy at T, T+1, ... (EOS ignored)
                        t0 = time.perf_counter()
                        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache,
                                    position_ids=torch.tensor([[t - 1]]), logits_to_keep=1)
                        gen = [int(out.logits[0, -1].argmax())]
                        for step in range(spec["max_tokens"] - 1):
                            out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=cache,
                                        position_ids=torch.tensor([[t + step]]))
                            gen.append(int(out.logits[0, -1].argmax()))
                        seconds = time.perf_counter() - t0
                    if key != FULL:
                        layers = len(model.model.layers)
                        if sorted(record) != list(range(layers)):
                            raise RuntimeError(f"the press compressed layers {sorted(record)}, not all {layers}")
                        # [L, H, T]: the press' rows of ids[:-1], plus the re-fed token T-1 (always cached)
                        mask = torch.stack([record[layer] for layer in range(layers)])
                        mask = torch.cat([mask, torch.ones(*mask.shape[:2], 1, dtype=torch.bool)], dim=2)
                        kept_masks[f"{key}|{ratio}|{i}"] = mask
                        kept = mask.sum(-1).float().mean().item()
                    else:
                        kept = float(t)
                    row["requests"].append({"output_ids": gen, "decode_s": seconds, "kept": kept,
                                            "cache_lengths": sorted(set(cached))})
                    print(f"[kvpress] {key} r={ratio} prompt {i + 1}/{len(spec['prompts'])}: "
                          f"{len(gen) / seconds:.1f} tok/s, kept {kept:.0f}/{t}", file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001 (a press that cannot run here is reported, the others go on)
                row = {"press": key, "ratio": ratio, "error": f"{type(exc).__name__}: {exc}"[:500]}
                print(f"[kvpress] {key} r={ratio} FAILED: {row['error']}", file=sys.stderr, flush=True)
            results.append(row)
    torch.save(kept_masks, spec["kept_path"])
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "kvpress": importlib.metadata.version("kvpress"),
            "defaults": {k: _press_defaults(k) for k in spec["presses"] if k != FULL}}
    return {"info": info, "rows": results}


# --------------------------------------------------------------------------------------------------------------
# tdutils side.

def run_tdutils(engine, prompts, policies, ratios, *, max_tokens, batch_size) -> dict:
    """{(policy, ratio): {"texts" (answers: decoded up to the first EOS), "keep" (sorted index lists), "tok_s",
    "kept"}}; policy FULL at ratio 0."""
    import copy

    from tdutils.eval import build_cells

    cells = [(FULL, 0.0, None)] + [c for c in build_cells(engine, policies, ratios, {}) if c[0] != FULL]
    res = {(p, r): {"texts": [], "keep": [], "tokens": 0, "seconds": 0.0, "kept": []} for p, r, _ in cells}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        engine.prefill(chunk)
        saved = [copy.copy(r) for r in engine.requests]  # modify/decode replace fields, never edit in place
        for policy, r, fn in cells:
            engine.requests = [copy.copy(q) for q in saved]
            cell = res[policy, r]
            if fn is not None:
                # the kept set (the same selection modify makes next; computed apart so modify stays untouched)
                cell["keep"] += [fn.keep_indices(engine.tensors(q.request_id), engine.tokens(q.request_id)).tolist()
                                 for q in engine.requests]
                engine.modify(fn)
            outs = engine.decode(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            cell["texts"] += [o.answer for o in outs]  # scored: the text up to the first EOS, never after it
            cell["kept"] += [o.cached_tokens for o in outs]
            cell["tokens"] += engine.metrics.decode.output_tokens
            cell["seconds"] += engine.metrics.decode.seconds
            print(f"[tdutils] {policy} r={r} prompts {start + 1}-{start + len(chunk)}: "
                  f"{engine.metrics.decode.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    for cell in res.values():
        cell["tok_s"] = cell["tokens"] / cell["seconds"] if cell["seconds"] > 0 else float("nan")
    return res


# --------------------------------------------------------------------------------------------------------------
# Command line and report.

def _list(cast, what):
    def parse(text):
        out = []
        for part in str(text).split(","):
            if part.strip():
                try:
                    out.append(cast(part.strip()))
                except ValueError:
                    raise argparse.ArgumentTypeError(f"bad {what} {part.strip()!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one {what}")
        return out
    return parse


def _ratio(text):
    r = float(text)
    if not 0.0 < r < 1.0:  # kvpress refuses 1, and 0 is the full row already
        raise ValueError
    return r


def _press(text):
    key = text.lower().removesuffix("press").replace("-", "_")
    key = {"streamingllm": "streaming_llm", "observedattention": "observed_attention", "h2o": "observed_attention",
           "expectedattention": "expected_attention"}.get(key, key)
    if key not in PRESSES:
        raise ValueError
    return key


def parse_args(argv=None):
    from tdutils.cli_args import count, positive_int

    ap = H.parser("peer_kvpress.py", __doc__)
    H.add_standard(ap, model="smollm2-135m", json=None, summary=False)
    ap.add_argument("--task", default="niah_single_1", help="RULER task (default niah_single_1)")
    ap.add_argument("--context-length", type=positive_int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--n", type=positive_int, default=50, help="prompts (default 50)")
    ap.add_argument("--ratios", type=_list(_ratio, "ratio in (0, 1)"), default=[0.5, 0.75],
                    help="compression ratios, fraction of tokens dropped (default 0.5,0.75)")
    ap.add_argument("--presses", type=_list(_press, f"press (one of {', '.join(PRESSES)})"), default=list(PRESSES),
                    help=f"comma-separated presses (default all: {', '.join(PRESSES)})")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="greedy new tokens (default: the longest gold answer's tokens + 4, as 'v1, v2, ...')")
    ap.add_argument("--seed", type=count, default=DEFAULT_SEED, help="dataset seed (default 5000000, held out)")
    ap.add_argument("--batch-size", type=positive_int, default=8, help="tdutils prefill/decode batch (default 8)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads on both sides (default: "
                    "tdutils.cli_args.usable_cores())")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    return ap, ap.parse_args(argv)


def _fmt_em(em, ci):
    return f"{em:.2f} [{ci[0]:.2f},{ci[1]:.2f}]" if ci else f"{em:.2f}"


def format_table(rows) -> str:
    head = ("press", "policy", "ratio", "kv EM [95% CI]", "kv part", "td EM [95% CI]", "td part", "kv tok/s",
            "td tok/s", "kv kept", "td kept", "overlap")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((r["press"], r["policy"], f"{r['ratio']:g}", "FAILED: " + r["error"][:60], *[""] * 8))
            continue
        lines.append((r["press"], r["policy"], f"{r['ratio']:g}", _fmt_em(r["kv_em"], r["kv_ci"]),
                      f"{r['kv_partial']:.2f}", _fmt_em(r["td_em"], r["td_ci"]), f"{r['td_partial']:.2f}",
                      f"{r['kv_tok_s']:.1f}", f"{r['td_tok_s']:.1f}", f"{r['kv_kept']:.0f}", f"{r['td_kept']:.0f}",
                      "" if r["overlap"] is None else f"{r['overlap']:.3f}"))
    widths = [max(len(str(line[i])) for line in lines if len(line) > i) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError, subprocess.CalledProcessError, H.WorkerError) as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    import torch

    from tdutils import ruler
    from tdutils.answers import wilson_interval
    from tdutils.cli_args import usable_cores
    from tdutils.engines.hf import HFEngine
    from tdutils.eval import check_output_path
    from tdutils.models import resolve_model
    from tdutils.policies import policy_names
    from tdutils.policies.registry import get_policy

    out_path = check_output_path(args.out, "--out", example=DEFAULT_OUT)
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    presses = list(dict.fromkeys(args.presses))
    policies = list(dict.fromkeys(PRESSES[p][1] for p in presses))
    missing = [p for p in policies if p not in policy_names()]
    if missing:
        raise ValueError(f"tdutils has no policy {missing}")
    H.check_ruler_task(args.task)  # before minutes of model loading
    folder = resolve_model(args.model).files()  # the folder (or hub id) the peer's transformers loads

    t0 = time.perf_counter()
    engine = HFEngine(args.model, dtype="float32", kv_budget_tokens=None, prefill_batch_size=args.batch_size,
                      query_window=0, progress=False)
    data, prompts, args.max_tokens = H.ruler_prompts(args.task, args.n, args.context_length, engine.tokenizer,
                                                     args.seed, args.max_tokens)
    td = run_tdutils(engine, prompts, policies, args.ratios, max_tokens=args.max_tokens, batch_size=args.batch_size)
    td_s = time.perf_counter() - t0

    py = VENV.ensure(log=H.log)
    with tempfile.TemporaryDirectory(prefix="peer_kvpress_") as tmp:
        spec = {"folder": folder, "prompts": prompts, "presses": [FULL] + presses, "ratios": args.ratios,
                "max_tokens": args.max_tokens, "seed": args.seed, "threads": threads,
                "kept_path": str(Path(tmp) / "kept.pt")}
        t1 = time.perf_counter()
        peer = H.call(__file__, "worker", spec, python=py, env=H.peer_env(threads), stream=True)
        kv_s = time.perf_counter() - t1
        kept_masks = torch.load(spec["kept_path"])

    def scores(texts):
        s = [ruler.score_ruler(args.task, ex["values"], text) for ex, text in zip(data, texts)]
        return [bool(e) for e, _ in s], [float(p) for _, p in s]

    rows, details = [], []
    for prow in peer["rows"]:
        key, ratio = prow["press"], prow["ratio"]
        policy = FULL if key == FULL else PRESSES[key][1]
        label = policy if key == FULL or PRESSES[key][2] else f"~{policy}"
        row = {"press": key if key == FULL else PRESSES[key][0], "policy": label, "ratio": ratio}
        if "error" in prow:
            rows.append({**row, "error": prow["error"]})
            continue
        cell = td[policy, ratio]
        kv_texts = [engine.tokenizer.decode(r["output_ids"], skip_special_tokens=True) for r in prow["requests"]]
        kv_ex, kv_part = scores(kv_texts)
        td_ex, td_part = scores(cell["texts"])
        overlaps = []
        for i, keep in enumerate(cell["keep"]):
            mask = kept_masks[f"{key}|{ratio}|{i}"]  # [L, H, T]
            idx = torch.tensor(keep)
            overlaps.append(mask[:, :, idx].float().mean().item())  # mean over l, h of |S ∩ K_lh| / |S|
        n = len(prompts)
        decode_s = sum(r["decode_s"] for r in prow["requests"])
        kv_tokens = sum(len(r["output_ids"]) for r in prow["requests"])
        row.update(n=n, kv_em=sum(kv_ex) / n, kv_ci=wilson_interval(sum(kv_ex), n), kv_partial=sum(kv_part) / n,
                   td_em=sum(td_ex) / n, td_ci=wilson_interval(sum(td_ex), n), td_partial=sum(td_part) / n,
                   kv_tok_s=kv_tokens / decode_s, td_tok_s=cell["tok_s"],
                   kv_kept=sum(r["kept"] for r in prow["requests"]) / n, td_kept=sum(cell["kept"]) / n,
                   overlap=sum(overlaps) / n if overlaps else None,
                   same_text=sum(a == b for a, b in zip(kv_texts, cell["texts"])))
        rows.append(row)
        details.append({"press": key, "ratio": ratio, "requests": [
            {"values": ex["values"], "kv_text": a, "td_text": b, "kv_exact": ke, "td_exact": te,
             "kv_kept": r["kept"], "td_kept": tk, "kv_cache_lengths": r["cache_lengths"],
             "overlap": overlaps[i] if overlaps else None}
            for i, (ex, a, b, ke, te, r, tk) in enumerate(zip(data, kv_texts, cell["texts"], kv_ex, td_ex,
                                                               prow["requests"], cell["kept"]))]})

    print(format_table(rows))
    meta = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "model": args.model, "folder": folder,
            "task": args.task, "context_length": args.context_length, "n": args.n, "ratios": args.ratios,
            "presses": presses, "max_tokens": args.max_tokens, "seed": args.seed, "batch_size": args.batch_size,
            "threads": threads, "tdutils_seconds": round(td_s, 1),
            "kvpress_seconds": round(kv_s, 1), "peer": peer["info"], "peer_venv": VENV.info(),
            "defaults": {"kvpress": peer["info"]["defaults"],
                         "tdutils": {p: get_policy(p).defaults() for p in policies}},
            "mapping": {k: {"press": PRESSES[k][0], "policy": PRESSES[k][1], "exact": PRESSES[k][2]}
                        for k in presses}}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "rows": rows, "requests": details}, indent=1, default=str))
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
