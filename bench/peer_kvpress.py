"""tdutils against NVIDIA kvpress on the same RULER prompts (the same token ids) of a real model.

    python bench/peer_kvpress.py                                   # smollm2-135m, niah_single_1, 2048 tokens,
                                                                   # n=50, ratios 0.5/0.75, every press below
    python bench/peer_kvpress.py --n 4 --context-length 1024 --presses snapkv,random,tova --ratios 0.5

kvpress runs in its own venv (`VENV`, `worker` through `harness.call`; `decoding_worker` is decode_compression.py's
kvpress side). The flow, the columns and the defaults: docs/benchmarks.md#benchpeer_kvpresspy-nvidia-kvpress-on-the-same-token-ids.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

# press key -> (kvpress construction, tdutils policy, exact counterpart?, needs eager attention, the granularity the
# press selects at, tdutils parameters matching the press' defaults: `meta.defaults` records both sides')
PRESSES = {
    "snapkv": ("SnapKVPress", "snapkv", True, False, "head", {"window": 64, "kernel_size": 5, "pooling": "avg"}),
    "random": ("RandomPress", "random", True, False, "head", {"n_sink": 0, "window": 0}),
    "streaming_llm": ("StreamingLLMPress", "streaming_llm", True, False, "head", {"n_sink": 4, "window": 0}),
    "tova": ("TOVAPress", "tova", True, False, "layer", {"window": 1}),  # its score: the mean over all query heads
    "knorm": ("KnormPress", "knorm", True, False, "head", {"window": 0, "n_sink": 0}),
    "keydiff": ("KeyDiffPress", "keydiff", True, False, "head", {"window": 0, "n_sink": 0, "anchor": "normalized"}),
    "observed_attention": ("ObservedAttentionPress", "h2o", False, True, "head", {"window": 0}),  # sums, not means
    "expected_attention": ("ExpectedAttentionPress", "expected_attention", True, False, "head",
                           {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True,
                            "epsilon": 0.0, "window": 0}),
    "adakv": ("AdaKVPress(SnapKVPress)", "adakv_snapkv", True, False, "head",
              {"window": 64, "kernel_size": 5, "alpha_safeguard": 0.2}),
    "criticalkv": ("CriticalKVPress(SnapKVPress)", "adakv_snapkv", False, False, "head",
                   {"window": 64, "kernel_size": 5, "alpha_safeguard": 0.2}),
    "pyramidkv": ("PyramidKVPress", "pyramidkv", True, False, "head", {"window": 64, "kernel_size": 5, "beta": 20}),
}
# kvpress keeps int(n (1 - r)) of n keys (`compute_n_kept`); PyramidKV computes its layer budgets from r itself
RATIO_KEPT = ("pyramidkv",)
FULL = "none"  # the full-cache row on both sides
DEFAULT_OUT = "docs/results/peer_kvpress.json"
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


def _greedy(model, cache, token: int, position: int, steps: int) -> tuple[list[int], float, list[int]]:
    """`steps` greedy tokens (EOS ignored), fed one at a time into `cache` from `token` at `position` on, as
    kvpress' pipeline does (`generate_answer`): `(token ids, seconds, the cache's length after each step)`."""
    import torch

    gen, lengths = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for step in range(steps):
            out = model(input_ids=torch.tensor([[gen[-1] if gen else token]]), past_key_values=cache,
                        position_ids=torch.tensor([[position + step]]), logits_to_keep=1)
            gen.append(int(out.logits[0, -1].argmax()))
            lengths.append(cache.layers[0].keys.shape[2])
    return gen, time.perf_counter() - t0, lengths


def _run_request(model, key: str, ratio: float, ids: list[int], max_tokens: int):
    """One prompt through kvpress: `(generated ids, decode seconds, cache lengths, kept mask [L, H, T] or None)`.
    `with press(model): model.model(ids[:-1])` compresses each layer's cache after its attention; then the last
    prompt token is re-fed at T-1 and greedy decoding goes on at T, T+1, ... (EOS ignored)."""
    import torch
    from transformers import DynamicCache

    record: dict = {}
    cache, t = DynamicCache(), len(ids)
    with torch.inference_mode():
        if key == FULL:
            model.model(input_ids=torch.tensor([ids[:-1]]), past_key_values=cache)
        else:
            with _record_kept(_make_press(key, ratio), record)(model):
                model.model(input_ids=torch.tensor([ids[:-1]]), past_key_values=cache)
    cached = [layer.keys.shape[2] for layer in cache.layers]
    gen, seconds, _ = _greedy(model, cache, ids[-1], t - 1, max_tokens)
    if key == FULL:
        return gen, seconds, cached, None
    layers = len(model.model.layers)
    if sorted(record) != list(range(layers)):
        raise RuntimeError(f"the press compressed layers {sorted(record)}, not all {layers}")
    mask = torch.stack([record[layer] for layer in range(layers)])  # [L, H, T-1]: the press' rows of ids[:-1]
    return gen, seconds, cached, torch.cat([mask, torch.ones(*mask.shape[:2], 1, dtype=torch.bool)], dim=2)  # + T-1


def _peer_models(spec: dict, attns) -> dict:
    """{attention implementation: the model of `spec["folder"]` in float32}, torch at `spec["threads"]` threads."""
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would flood the log
    return {attn: transformers.AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32,
                                                                    attn_implementation=attn).eval()
            for attn in attns}


def _versions() -> dict:
    """The peer venv's torch, transformers and kvpress versions."""
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "kvpress")}


def worker(spec: dict) -> dict:
    """Runs in the peer venv (`harness.call`): every press and ratio on the prompts of `spec`; the kept sets go
    to `spec["kept_path"]` (torch.save: too large for JSON), the rows and versions come back."""
    import torch

    models = _peer_models(spec, {"eager" if k != FULL and PRESSES[k][3] else "sdpa" for k in spec["presses"]})
    results, kept_masks = [], {}
    for key in spec["presses"]:
        for ratio in ([0.0] if key == FULL else spec["ratios"]):
            model = models["eager" if key != FULL and PRESSES[key][3] else "sdpa"]
            row = {"press": key, "ratio": ratio, "requests": []}
            try:
                for i, ids in enumerate(spec["prompts"]):
                    torch.manual_seed(spec["seed"] + i)  # RandomPress draws from torch's default generator
                    gen, seconds, cached, mask = _run_request(model, key, ratio, ids, spec["max_tokens"])
                    kept = float(len(ids)) if mask is None else mask.sum(-1).float().mean().item()
                    if mask is not None:
                        kept_masks[f"{key}|{ratio}|{i}"] = mask
                    row["requests"].append({"output_ids": gen, "decode_s": seconds, "kept": kept,
                                            "cache_lengths": sorted(set(cached))})
                    H.log(f"[kvpress] {key} r={ratio} prompt {i + 1}/{len(spec['prompts'])}: "
                          f"{len(gen) / seconds:.1f} tok/s, kept {kept:.0f}/{len(ids)}")
            except Exception as exc:  # noqa: BLE001 (a press that cannot run here is reported, the others go on)
                row = {"press": key, "ratio": ratio, "error": f"{type(exc).__name__}: {exc}"[:500]}
                H.log(f"[kvpress] {key} r={ratio} FAILED: {row['error']}")
            results.append(row)
    torch.save(kept_masks, spec["kept_path"])
    return {"info": {**_versions(), "defaults": {k: _press_defaults(k) for k in spec["presses"] if k != FULL}},
            "rows": results}


def decoding_worker(spec: dict) -> dict:
    """Runs in the peer venv (`harness.call`) for `bench/decode_compression.py kvpress`: the full cache, then each
    press of `spec["presses"]` ({key: keyword arguments}) inside kvpress' `DecodingPress` (budget, buffer), on every
    prompt; per request the generated ids, decode seconds and the cache's largest, smallest after the first
    compression, and last length."""
    import kvpress
    import torch
    from transformers import DynamicCache

    model = _peer_models(spec, ["sdpa"])["sdpa"]

    def generate(ids):
        """Greedy, EOS ignored: the whole prompt prefilled (DecodingPress does nothing there), then each generated
        token fed at its original position."""
        cache = DynamicCache()
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
        first = int(out.logits[0, -1].argmax())
        gen, seconds, lengths = _greedy(model, cache, first, len(ids), spec["max_tokens"] - 1)
        return [first, *gen], seconds, lengths

    results = []
    for key, kw in {FULL: None, **spec["presses"]}.items():
        row = {"press": "full" if key == FULL else key, "requests": []}
        try:
            for i, ids in enumerate(spec["prompts"]):
                if key == FULL:
                    gen, seconds, lengths = generate(ids)
                else:
                    press = kvpress.DecodingPress(base_press=getattr(kvpress, PRESSES[key][0])(**kw),
                                                  compression_interval=spec["buffer"], target_size=spec["budget"],
                                                  hidden_states_buffer_size=spec["buffer"])
                    with press(model):
                        gen, seconds, lengths = generate(ids)
                row["requests"].append({"output_ids": gen, "decode_s": seconds, "max_cache": max(lengths),
                                        "min_cache_after_first": min(lengths[spec["buffer"]:] or lengths),
                                        "last_cache": lengths[-1]})
                H.log(f"[kvpress] {row['press']} prompt {i + 1}/{len(spec['prompts'])}: {len(gen) / seconds:.1f} "
                      f"tok/s, cache max {max(lengths)} last {lengths[-1]}")
        except Exception as exc:  # noqa: BLE001 (a press that cannot run is reported; the others go on)
            row = {"press": row["press"], "error": f"{type(exc).__name__}: {exc}"[:500]}
            H.log(f"[kvpress] {row['press']} FAILED: {row['error']}")
        results.append(row)
    return {"info": _versions(), "rows": results}


# --------------------------------------------------------------------------------------------------------------
# Command line and report.

def _presses(text: str) -> list[str]:
    """argparse type of `--presses`: press keys, also as kvpress class names (`SnapKVPress`) or `h2o`."""
    from tdutils.cli.args import name_list

    alias = {"streamingllm": "streaming_llm", "observedattention": "observed_attention", "h2o": "observed_attention",
             "expectedattention": "expected_attention"}
    keys = (t.strip().lower().removesuffix("press").replace("-", "_") for t in text.split(","))
    return name_list(PRESSES, "press")(",".join(alias.get(k, k) for k in keys))


def parse_args(argv=None):
    from tdutils.cli.args import drop_ratios
    from tdutils.engines.hf import POSITIONS
    from tdutils.selection import GRANULARITIES

    ap = H.parser("peer_kvpress.py", __doc__)
    H.add_peer_options(ap, n=50, batch_size=8, out=DEFAULT_OUT)
    ap.add_argument("--ratios", type=drop_ratios, default=[0.5, 0.75],
                    help="compression ratios, fraction of tokens dropped (default 0.5,0.75)")
    ap.add_argument("--presses", type=_presses, default=list(PRESSES),
                    help=f"comma-separated presses (default all: {', '.join(PRESSES)})")
    ap.add_argument("--granularity", choices=GRANULARITIES, default="head",
                    help="tdutils' kept sets: one per request, layer, or what each press selects (head, default: per "
                         "KV head; TOVAPress per layer); AdaKV and PyramidKV always per head")
    ap.add_argument("--positions", choices=POSITIONS, default="original",
                    help="tdutils' kept keys: at their original positions (default, as kvpress) or re-rotated to "
                         "compact ones")
    return ap, ap.parse_args(argv)


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    return H.one_line_errors(ap, run, args, also=(subprocess.CalledProcessError, H.WorkerError))


def _cell(key, ratio) -> str:
    return f"{key} r={ratio:g}"


def _drop_fn(engine, key: str, args, *, drop_ratio=None, budget=None):
    """tdutils' drop function for press `key`: its policy and matching parameters, at `args.granularity` ("head":
    the granularity the press selects at) and `args.positions`."""
    from tdutils.edit import make_drop_fn
    from tdutils.policies.registry import get_policy

    _, policy, _, _, native, params = PRESSES[key]
    granularity = native if args.granularity == "head" else args.granularity
    if get_policy(policy).per_head_only:  # AdaKV, PyramidKV: per head whatever is asked (the row records it)
        granularity = "head"
    return make_drop_fn(policy, drop_ratio=drop_ratio, budget=budget, model_config=engine.facts,
                        granularity=granularity, rerotate=args.positions == "compact", **params)


def same_input_sets(engine, prompts, presses, args) -> dict:
    """tdutils' kept sets on kvpress' input: each prompt's `ids[:-1]` prefilled (kvpress compresses those, its
    window the last queries of them) and each press' policy keeping kvpress' count `int(n (1 - r))` of the n keys
    (`RATIO_KEPT`: the ratio itself). Returns {(key, ratio): [keep_indices per prompt]} (`DropFn.keep_indices`)."""
    out: dict = {}
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start:start + args.batch_size]
        engine.prefill([ids[:-1] for ids in chunk])
        for q, ids in zip(engine.requests, chunk):
            tensors, tokens, n = engine.tensors(q.request_id), engine.tokens(q.request_id), len(ids) - 1
            for key in presses:
                for r in args.ratios:
                    rule = {"drop_ratio": r} if key in RATIO_KEPT else {"budget": max(1, int(n * (1 - r)))}
                    out.setdefault((key, r), []).append(_drop_fn(engine, key, args, **rule).keep_indices(tensors, tokens))
    return out


def head_overlaps(mask, keep):
    """FloatTensor `[L, H]`: |S_lh ∩ K_lh| / |S_lh| per layer and KV head, S tdutils' kept set `keep` (`[k]`,
    `[L, k]` or `[L, H, k]`, -1 padding) and K kvpress' `mask` (BoolTensor `[L, H, T]`, True = kept)."""
    import torch

    L, H, _ = mask.shape
    keep = torch.as_tensor(keep)
    keep = (keep[None, None] if keep.dim() == 1 else keep[:, None] if keep.dim() == 2 else keep).expand(L, H, -1)
    valid = keep >= 0
    hits = mask.gather(-1, keep.clamp(min=0)) & valid
    return hits.sum(-1).float() / valid.sum(-1).clamp(min=1).float()


def _tdutils_side(args, presses):
    """tdutils' engine, RULER rows, prompts, decoded cells and same-input kept sets, and its seconds."""
    from tdutils.engines.hf import HFEngine

    t0 = time.perf_counter()
    engine = HFEngine(args.model, dtype="float32", kv_budget_tokens=None, prefill_batch_size=args.batch_size,
                      query_window=0, progress=False, positions=args.positions)
    data, prompts, args.max_tokens = H.ruler_prompts(args.task, args.n, args.context_length, engine.tokenizer,
                                                     args.seed, args.max_tokens)
    fns = {(k, r): _drop_fn(engine, k, args, drop_ratio=r) for k in presses for r in args.ratios}
    engine.capture_for(*fns.values())
    cells = [(_cell(FULL, 0.0), None)] + [(_cell(k, r), fn) for (k, r), fn in fns.items()]
    td = H.decode_cells(engine, prompts, cells, max_tokens=args.max_tokens, batch_size=args.batch_size, keep=True)
    sets = same_input_sets(engine, prompts, presses, args)
    granularity = {k: fn.granularity for (k, _), fn in fns.items()}
    return engine, data, prompts, td, sets, granularity, time.perf_counter() - t0


def run(args) -> int:
    import torch

    from tdutils.cli.args import usable_cores
    from tdutils.eval import check_output_path
    from tdutils.models import resolve_model
    from tdutils.outputs import answer_text
    from tdutils.policies.registry import get_policy

    out_path = check_output_path(args.out, "--out", example=DEFAULT_OUT)
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    presses = list(dict.fromkeys(args.presses))
    H.check_ruler_task(args.task)  # before minutes of model loading
    folder = resolve_model(args.model).files()  # the folder (or hub id) the peer's transformers loads
    engine, data, prompts, td, sets, granularity, td_s = _tdutils_side(args, presses)

    py = VENV.ensure(log=H.log)
    with tempfile.TemporaryDirectory(prefix="peer_kvpress_") as tmp:
        spec = {"folder": folder, "prompts": prompts, "presses": [FULL] + presses, "ratios": args.ratios,
                "max_tokens": args.max_tokens, "seed": args.seed, "threads": threads,
                "kept_path": str(Path(tmp) / "kept.pt")}
        t1 = time.perf_counter()
        peer = H.call(__file__, "worker", spec, python=py, env=H.peer_env(threads), stream=True)
        kv_s = time.perf_counter() - t1
        kept_masks = torch.load(spec["kept_path"])

    rows, details = [], []
    for prow in peer["rows"]:
        key, ratio = prow["press"], prow["ratio"]
        policy = FULL if key == FULL else PRESSES[key][1]
        label = policy if key == FULL or PRESSES[key][2] else f"~{policy}"
        row = {"press": key if key == FULL else PRESSES[key][0], "policy": label, "ratio": ratio,
               "granularity": None if key == FULL else granularity[key], "positions": args.positions}
        if "error" in prow:
            rows.append({**row, "error": prow["error"]})
            continue
        cell = td[_cell(key, ratio)]
        kv_texts = [answer_text(engine.tokenizer, r["output_ids"], engine.eos_token_ids,  # as tdutils' answers:
                                engine.tokenizer.decode(r["output_ids"], skip_special_tokens=True))  # to the EOS
                    for r in prow["requests"]]
        masks = [kept_masks[f"{key}|{ratio}|{i}"] for i in range(len(prompts))] if key != FULL else None
        row.update(_row_figures(args.task, data, prow["requests"], kv_texts, cell, masks, sets.get((key, ratio))))
        per = row.pop("per_request")
        rows.append(row)
        details.append({"press": key, "ratio": ratio, "requests": [
            {"values": ex["values"], "kv_text": a, "td_text": b, "kv_kept": r["kept"], "td_kept": tk,
             "kv_cache_lengths": r["cache_lengths"], **p}
            for ex, a, b, r, tk, p in zip(data, kv_texts, cell["texts"], prow["requests"], cell["kept"], per)]})

    print(H.render("peer_kvpress", rows))
    meta = H.peer_meta(args, folder=folder, ratios=args.ratios, presses=presses, threads=threads,
                       granularity=args.granularity, positions=args.positions,
                       tdutils_seconds=round(td_s, 1), kvpress_seconds=round(kv_s, 1), peer=peer["info"],
                       peer_venv=VENV.info(), defaults={"kvpress": peer["info"]["defaults"],
                                                        "tdutils": {k: PRESSES[k][5] for k in presses}},
                       mapping={k: {"press": PRESSES[k][0], "policy": PRESSES[k][1], "exact": PRESSES[k][2],
                                    "press_granularity": PRESSES[k][4], "granularity": granularity[k],
                                    "keep_rule": "ratio" if k in RATIO_KEPT else "int(n(1-r))"} for k in presses},
                       tdutils_policy_defaults={p: get_policy(p).defaults()
                                                for p in dict.fromkeys(PRESSES[k][1] for k in presses)})
    H.write_json({"meta": meta, "rows": rows, "requests": details}, str(out_path), indent=1, default=str)
    H.log(f"wrote {out_path}")
    return 0


def _overlap_stats(masks, keeps, trim: bool) -> tuple[list, list, list]:
    """Per request: mean and minimum over (layer, KV head) of `head_overlaps`, and the per-layer means
    `[L]`; with `trim`, kvpress' mask without its last column (the re-fed token, not in `ids[:-1]`)."""
    per = [head_overlaps(m[..., :-1] if trim else m, k) for m, k in zip(masks, keeps)]  # [L, H] each
    return [o.mean().item() for o in per], [o.min().item() for o in per], [o.mean(1).tolist() for o in per]


def _row_figures(task, data, kv_requests, kv_texts, cell, masks, sets) -> dict:
    """One press x ratio: both sides' exact match (with Wilson interval) and partial credit, decode tok/s, kept
    tokens, and the overlaps (`head_overlaps`; `masks` [L, H, T] per request, None for the full cache):
    `overlap` / `overlap_min` / `overlap_layers` on the same input (`same_input_sets`: mean over requests of the
    mean over (layer, KV head), the minimum over requests, layers and heads, per layer), `overlap_flow` between
    the sets each side decoded with (tdutils' of all T tokens)."""
    from tdutils.answers import wilson_interval

    n = len(data)
    kv_ex, kv_part = H.ruler_scores(task, data, kv_texts)
    td_ex, td_part = H.ruler_scores(task, data, cell["texts"])
    out = {"n": n, "kv_em": sum(kv_ex) / n, "kv_ci": wilson_interval(sum(kv_ex), n), "kv_partial": sum(kv_part) / n,
           "td_em": sum(td_ex) / n, "td_ci": wilson_interval(sum(td_ex), n), "td_partial": sum(td_part) / n,
           "kv_tok_s": sum(len(r["output_ids"]) for r in kv_requests) / sum(r["decode_s"] for r in kv_requests),
           "td_tok_s": cell["tok_s"], "kv_kept": sum(r["kept"] for r in kv_requests) / n,
           "td_kept": sum(cell["kept"]) / n, "same_text": sum(a == b for a, b in zip(kv_texts, cell["texts"])),
           "overlap": None, "overlap_min": None, "overlap_flow": None, "overlap_layers": None}
    per = [{"kv_exact": a, "td_exact": b} for a, b in zip(kv_ex, td_ex)]
    if masks is None:
        return {**out, "per_request": per}
    same, same_min, layers = _overlap_stats(masks, sets, trim=True)
    flow, _, _ = _overlap_stats(masks, cell["keep"], trim=False)
    out.update(overlap=sum(same) / n, overlap_min=min(same_min), overlap_flow=sum(flow) / n,
               overlap_layers=[sum(col) / n for col in zip(*layers)])
    for p, a, b, c in zip(per, same, same_min, flow):
        p.update(overlap=a, overlap_min=b, overlap_flow=c)
    return {**out, "per_request": per}


if __name__ == "__main__":
    sys.exit(main())
