"""Compression while the cache grows (R-KV's decode-time setting, arXiv:2505.24133) and chunked prefill, measured.

    python bench/decode_compression.py throughput --json docs/results/decode_compression_throughput.json
    python bench/decode_compression.py fidelity --model smollm2-135m --json docs/results/decode_compression_fidelity.json
    python bench/decode_compression.py ruler --policies snapkv --json docs/results/decode_compression_ruler.json
    python bench/decode_compression.py kvpress --json docs/results/decode_compression_kvpress.json
    python bench/decode_compression.py --summary docs/results/decode_compression_fidelity.json   # a stored run's table

Every part, option and column: docs/benchmarks.md#benchdecode_compressionpy-compression-while-the-cache-grows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

PARTS = ("throughput", "fidelity", "ruler", "kvpress")
RULER_PREFILL_BATCH = 4  # prompts prefilled together in `ruler` (recorded in its meta)
FIDELITY_POLICIES = ("rkv", "snapkv", "tova", "knorm", "streaming_llm", "random")
# kvpress press (`peer_kvpress.PRESSES`) -> (tdutils window, kvpress keyword arguments set to the run's window).
# Windows follow kvpress' own behaviour: SnapKV scores with (and keeps) the last w queries (w = the run's window on
# both sides); TOVA keeps and scores with the last token; Knorm and StreamingLLM (4 sinks) keep no extra window.
KVPRESS_PRESSES = {"snapkv": (None, ("window_size",)), "tova": (1, ()), "knorm": (0, ()), "streaming_llm": (0, ())}


# ------------------------------------------------------------------------------------------ pure functions
def top1_rate(reference_ids, logits) -> float:
    """Fraction of a teacher-forced run's steps whose argmax is the reference token (`logits`: `[steps, vocab]`
    or one `[vocab]` tensor per step)."""
    import torch

    top = (logits if isinstance(logits, torch.Tensor) else torch.stack(list(logits))).argmax(-1).tolist()
    if not top:
        raise ValueError("no steps")
    return sum(int(a) == b for a, b in zip(reference_ids, top)) / len(top)


def summary_stats(values) -> dict:
    """mean, median, min and max of a non-empty list of numbers."""
    values = [float(v) for v in values]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


# ------------------------------------------------------------------------------------------ shared setup
def _meta(args, part: str, **extra) -> dict:
    return {"part": part, **H.run_record("bench/decode_compression.py"), "model": args.model, **extra}


def _engine(args, **kw):
    import tdutils

    return tdutils.open_engine("hf", model=args.model, progress=False, **kw)


# ------------------------------------------------------------------------------------------ throughput
def run_throughput(args) -> dict:
    import tdutils
    from tdutils.compression import Compression
    from tdutils.metrics import repeat_ratios
    from tdutils.ruler import essay_prompts
    from tdutils.runs import run_orders

    t_start = time.perf_counter()
    eng = _engine(args)
    prompts = essay_prompts(eng.tokenizer, args.num_requests, args.prompt_tokens, wrap=False)
    eng.kv_budget_tokens = tdutils.default_kv_budget(map(len, prompts), args.max_tokens, args.full_requests)
    configs = {f"B={b}": Compression(args.policy, budget=b, buffer=args.buffer, window=args.window)
               for b in args.budgets}
    orders = run_orders(["full", *configs], args.repeats, "alternate")
    H.log(f"model={args.model} requests={len(prompts)} prompt_tokens={args.prompt_tokens} max_tokens={args.max_tokens} "
         f"kv_budget_tokens={eng.kv_budget_tokens} policy={args.policy} N={args.buffer} w={args.window}")
    # the shared comparison loop (tdutils.runs.compare): forward, then backward order in every repeat
    results, _ = tdutils.compare(eng, prompts, configs, max_tokens=args.max_tokens, repeats=args.repeats,
                                 order="alternate", progress=H.log, ignore_eos=True)
    runs = [_throughput_run(name, rep, results["baseline" if name == "full" else name], len(prompts) * args.max_tokens)
            for rep, order in enumerate(orders) for name in order]
    configs = {"full": None, **configs}
    rows = []
    for name, comp in configs.items():
        mine = [r for r in runs if r["config"] == name]  # in repeat order
        decode_s = sum(r["decode_s"] for r in mine)
        ratios = repeat_ratios(results["baseline"], results["baseline" if name == "full" else name])  # per repeat
        rows.append({"config": name, "budget": None if comp is None else comp.budget,
                     "peak_batch": max(r["peak_batch"] for r in mine),
                     "tok_s": summary_stats(r["decode_tok_s"] for r in mine),
                     "ratio": summary_stats(ratios), "ratios": ratios,
                     "compressions": mine[0]["compressions"],
                     "compress_share": sum(r["compress_s"] for r in mine) / decode_s,
                     "kv_peak_cache_tokens": max(r["kv_peak_cache_tokens"] for r in mine),
                     "kv_peak_reserved_tokens": max(r["kv_peak_reserved_tokens"] for r in mine)})
    meta = _meta(args, "throughput", num_requests=len(prompts), prompt_tokens=args.prompt_tokens,
                 max_tokens=args.max_tokens, kv_budget_tokens=eng.kv_budget_tokens, full_requests=args.full_requests,
                 budgets=args.budgets, buffer=args.buffer, window=args.window, policy=args.policy,
                 positions=eng.positions, repeats=args.repeats, orders=orders,
                 seconds=time.perf_counter() - t_start)
    return {"part": "throughput", "meta": meta, "rows": rows, "runs": runs}


def _throughput_run(name: str, rep: int, result, tokens: int) -> dict:
    """The throughput record of repeat `rep` of configuration `name` (a `tdutils.runs.RunResult` of `compare`)."""
    dm = result.repeats[rep].decode
    if dm.output_tokens != tokens:
        raise RuntimeError(f"{name}: decoded {dm.output_tokens} tokens, not {tokens}")
    return {"config": name, "repeat": rep, "decode_tok_s": dm.tokens_per_s, "decode_s": dm.seconds,
            "steps": dm.steps, "peak_batch": dm.peak_batch_size, "compressions": dm.compressions,
            "compress_s": dm.compress_seconds, "kv_peak_cache_tokens": dm.kv_peak_cache_tokens or
            max(o.cached_tokens + len(o.output_ids) - 1 for o in result.outputs),
            "kv_peak_reserved_tokens": dm.kv_peak_reserved_tokens, "preemptions": dm.preemptions}


# ------------------------------------------------------------------------------------------ fidelity
def run_fidelity(args) -> dict:
    from tdutils.compression import Compression, cache_sizes, fidelity, greedy_agreement
    from tdutils.ruler import essay_prompts

    t_start = time.perf_counter()
    eng = _engine(args, positions=args.positions)
    prompts = essay_prompts(eng.tokenizer, args.num_requests, args.prompt_tokens, wrap=False)
    eng.prefill(prompts)
    saved = eng.snapshot()
    t0 = time.perf_counter()
    full = eng.decode(args.max_tokens, ignore_eos=True, keep_logits=True)
    ref_ids = [o.output_ids for o in full]
    full_cache = [statistics.fmean(cache_sizes(o)) for o in full]
    H.log(f"model={args.model} requests={len(prompts)} prompt_tokens={args.prompt_tokens} max_tokens={args.max_tokens} "
         f"N={args.buffer} w={args.window} positions={args.positions}; full cache {time.perf_counter() - t0:.0f} s")
    rows, checks = [], []
    for policy in args.policies:
        for b in args.budgets:
            comp = Compression(policy, budget=b, buffer=args.buffer, window=args.window)
            eng.restore(saved)
            t0 = time.perf_counter()
            outs = eng.decode(args.max_tokens, ignore_eos=True, keep_logits=True, compression=comp, forced_ids=ref_ids)
            seconds = time.perf_counter() - t0
            f = fidelity(full, outs)
            row = {"policy": policy, "budget": b, "agreement": summary_stats(f["agreement"]),
                   "agreements": f["agreement"], "identical": f["identical"],
                   "top1_rate": statistics.fmean(top1_rate(r, o.logits) for r, o in zip(ref_ids, outs)),
                   "kl_mean": f["kl_mean"], "kl_mean_after_cut": f["kl_mean_after_cut"], "kl_p90": f["kl_p90"],
                   "kl_max": f["kl_max"], "cuts_per_request": f["cuts"] / len(outs),
                   "first_cut_steps": [o.compressions[0]["step"] if o.compressions else None for o in outs],
                   "mean_cache_of_full": statistics.fmean(statistics.fmean(cache_sizes(o)) / c
                                                          for o, c in zip(outs, full_cache)),
                   "tokens": sum(f["steps"]), "seconds": seconds}
            del outs
            if policy in args.check_free:
                eng.restore(saved)
                free = eng.decode(args.max_tokens, ignore_eos=True, compression=comp)
                for i, o in enumerate(free):
                    checks.append({"policy": policy, "budget": b, "request": i, "forced": f["agreement"][i],
                                   "free": greedy_agreement(ref_ids[i], o.output_ids)})
            rows.append(row)
            H.log(f"  {policy:>13} B={b:<4}: agreement mean {row['agreement']['mean']:.1f} median "
                 f"{row['agreement']['median']:.1f}, top-1 {row['top1_rate']:.3f}, KL {row['kl_mean']:.4f} "
                 f"(after the first cut {row['kl_mean_after_cut']:.4f}), {row['cuts_per_request']:.1f} cuts, "
                 f"{seconds:.0f} s")
    bad = [c for c in checks if c["free"] != c["forced"]]
    if bad:
        H.log(f"WARNING: {len(bad)} free greedy runs differ from the teacher-forced prediction: {bad[:3]}")
    meta = _meta(args, "fidelity", num_requests=len(prompts), prompt_tokens=args.prompt_tokens,
                 max_tokens=args.max_tokens, budgets=args.budgets, buffer=args.buffer, window=args.window,
                 positions=args.positions, policies=args.policies, seconds=time.perf_counter() - t_start)
    return {"part": "fidelity", "meta": meta, "rows": rows, "free_checks": checks, "full_cache_ids": ref_ids}


# ------------------------------------------------------------------------------------------ ruler
def run_ruler(args) -> dict:
    from tdutils import ruler
    from tdutils.answers import wilson_interval
    from tdutils.compression import Compression
    from tdutils.eval.tasks import load_rows, score_rows
    from tdutils.policies import get_policy

    t_start = time.perf_counter()
    eng = _engine(args, prefill_batch_size=RULER_PREFILL_BATCH)
    rows_in = load_rows(f"ruler_{args.task}", model=args.model, tokenizer=eng.tokenizer, num_requests=args.n,
                        context_tokens=args.context_length, seed=args.seed)
    max_tokens = args.max_tokens or ruler.RULER_CPU_MAX_TOKENS[args.task]
    chat = rows_in[0].meta.get("chat_template")
    H.log(f"model={args.model} task={args.task} n={len(rows_in)} T={args.context_length} B={args.budget} "
         f"max_tokens={max_tokens} chat_template={chat}")
    rows, details = [], []

    def score(policy, mode, chunk, comp, lengths, peak, prefill_s):
        outs = eng.decode(max_tokens, ignore_eos=True)
        report = score_rows(rows_in, [o.answer for o in outs])  # the task's scorer: every reference present
        partial = statistics.fmean(ruler.score_ruler(args.task, r.meta["values"], o.answer)[1]
                                   for r, o in zip(rows_in, outs))
        row = {"policy": policy, "mode": mode, "chunk": chunk, "budget": None if comp is None else args.budget,
               "n": len(rows_in), "correct": report.correct, "accuracy": report.correct / len(rows_in),
               "ci": wilson_interval(report.correct, len(rows_in)), "partial": partial,
               "cache_tokens": statistics.fmean(lengths), "peak_cache_tokens": peak, "prefill_s": prefill_s,
               "decode_s": eng.metrics.decode.seconds}
        rows.append(row)
        details.append({"policy": policy, "mode": mode, "answers": [o.answer for o in outs],
                        "exact": list(report.is_correct)})
        H.log(f"  {policy:>7} {mode:>10}: {row['correct']}/{row['n']} (partial {partial:.2f}), cache "
             f"{row['cache_tokens']:.0f}, peak {row['peak_cache_tokens']}, prefill {prefill_s:.0f} s")

    # The full prefill serves the full-cache row and every policy's one-shot row: one-shot compression is the
    # whole prompt's cache cut once to B, which `modify` with the same drop function computes bit for bit as
    # `prefill(compression=...)` does (the same cut, same captured queries), without prefilling again.
    t0 = time.perf_counter()
    full_lengths = eng.prefill(rows_in)
    full_s = time.perf_counter() - t0
    saved = eng.snapshot()
    score("full", "full", None, None, full_lengths, max(full_lengths), full_s)
    for policy in args.policies:
        comp = Compression(policy, budget=args.budget, window=None)
        eng.restore(saved)
        t0 = time.perf_counter()
        eng.modify(comp.drop_fn(model_config=eng.facts, rerotate=eng.positions == "compact"))
        cut_s = time.perf_counter() - t0
        score(policy, "one-shot", None, comp, [len(eng.tokens(i)) for i in range(len(rows_in))], max(full_lengths),
              full_s + cut_s)
        for c in args.chunks:
            t0 = time.perf_counter()
            lengths = eng.prefill(rows_in, chunk=c, compression=comp)
            score(policy, f"chunk {c}", c, comp, lengths, max(eng.metrics.prefill.peak_cache_tokens),
                  time.perf_counter() - t0)
        del comp
    windows = {p: get_policy(p).defaults().get("window") for p in args.policies}
    meta = _meta(args, "ruler", task=f"ruler_{args.task}", context_length=args.context_length, n=len(rows_in),
                 seed=args.seed, budget=args.budget, chunks=args.chunks, policies=args.policies,
                 max_tokens=max_tokens, chat_template="the tokenizer's own" if chat else "none",
                 windows=windows, prefill_batch_size=RULER_PREFILL_BATCH, seconds=time.perf_counter() - t_start)
    return {"part": "ruler", "meta": meta, "rows": rows, "answers": details,
            "gold": [r.meta["values"] for r in rows_in]}


# ------------------------------------------------------------------------------------------ kvpress
def run_kvpress(args) -> dict:
    import peer_kvpress
    import transformers

    from tdutils.compression import Compression, greedy_agreement
    from tdutils.models import resolve_model
    from tdutils.ruler import essay_prompts

    t_start = time.perf_counter()
    folder = resolve_model(args.model).files()  # the folder (or hub id) the peer's transformers loads
    B, N, w = args.budget, args.buffer, args.window
    prompt_tokens = args.prompt_tokens or B  # T = B: both sides cut first when the cache reaches B + N
    td = {}
    for positions in ("compact", "original"):
        eng = _engine(args, positions=positions)
        prompts = essay_prompts(eng.tokenizer, args.num_requests, prompt_tokens, wrap=False)
        eng.prefill(prompts)
        saved = eng.snapshot()
        full = [o.output_ids for o in eng.decode(args.max_tokens, ignore_eos=True)]
        td[positions, "full"] = full
        for key in args.presses:
            policy, window = peer_kvpress.PRESSES[key][1], KVPRESS_PRESSES[key][0]
            eng.restore(saved)
            comp = Compression(policy, budget=B, buffer=N, window=w if window is None else window)
            outs = eng.decode(args.max_tokens, ignore_eos=True, compression=comp)
            td[positions, key] = [greedy_agreement(f, o.output_ids) for f, o in zip(full, outs)]
            H.log(f"  tdutils {positions:>8} {key:>13}: agreement {td[positions, key]}")
        del eng
    td_s = time.perf_counter() - t_start

    py = peer_kvpress.VENV.ensure(log=H.log)
    spec = {"folder": folder, "prompts": prompts, "budget": B, "buffer": N, "max_tokens": args.max_tokens,
            "threads": args.threads, "presses": {k: dict.fromkeys(KVPRESS_PRESSES[k][1], w) for k in args.presses}}
    t1 = time.perf_counter()
    peer = H.call(peer_kvpress.__file__, "decoding_worker", spec, python=py, env=H.peer_env(args.threads), stream=True)
    kv_s = time.perf_counter() - t1
    kv_full = [r["output_ids"] for r in peer["rows"][0]["requests"]]
    cross = [greedy_agreement(a, b) for a, b in zip(td["compact", "full"], kv_full)]
    rows = []
    for prow in peer["rows"][1:]:
        key = prow["press"]
        name, policy, window = *peer_kvpress.PRESSES[key][:2], KVPRESS_PRESSES[key][0]
        row = {"press": name, "policy": policy, "tdutils_window": w if window is None else window}
        if "error" in prow:
            rows.append({**row, "error": prow["error"]})
            continue
        kv_agree = [greedy_agreement(f, r["output_ids"]) for f, r in zip(kv_full, prow["requests"])]
        row.update(kvpress=summary_stats(kv_agree), kvpress_agreements=kv_agree,
                   compact=summary_stats(td["compact", key]), compact_agreements=td["compact", key],
                   original=summary_stats(td["original", key]), original_agreements=td["original", key],
                   kv_tok_s=sum(len(r["output_ids"]) - 1 for r in prow["requests"]) /
                   sum(r["decode_s"] for r in prow["requests"]),
                   kv_max_cache=max(r["max_cache"] for r in prow["requests"]),
                   kv_vs_td_full=[greedy_agreement(a, r["output_ids"]) for a, r in zip(td["compact", "full"],
                                                                                      prow["requests"])])
        rows.append(row)
    meta = _meta(args, "kvpress", num_requests=len(prompts), prompt_tokens=prompt_tokens, max_tokens=args.max_tokens,
                 budget=B, buffer=N, window=w, presses=args.presses, folder=folder, peer=peer["info"],
                 peer_venv=peer_kvpress.VENV.info(), tdutils_seconds=td_s, kvpress_seconds=kv_s,
                 seconds=time.perf_counter() - t_start)
    meta["transformers"] = transformers.__version__
    return {"part": "kvpress", "meta": meta, "rows": rows, "cross": summary_stats(cross), "cross_agreements": cross}


# ------------------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    from tdutils.cli.args import count, full_requests, int_list, name_list, positive_int, usable_cores
    from tdutils.compression import compression_policies

    held = compression_policies()  # the policies that can hold a budget while the cache grows
    budgets = int_list("budgets", "64,128")
    ap = H.parser("bench/decode_compression.py", __doc__)
    H.add_standard(ap, json=None)
    sub = ap.add_subparsers(dest="part")

    def part(name: str, text: str, requests=None, prompt_tokens=None, max_tokens=256):
        """A part's subcommand: the shared options, then (given `requests`) the essay prompts' and the cache's."""
        p = sub.add_parser(name, help=text)
        H.add_standard(p, model="smollm2-135m", threads=usable_cores(), summary=False)
        if requests:
            p.add_argument("--num-requests", type=positive_int, default=requests)
            p.add_argument("--prompt-tokens", type=positive_int, default=prompt_tokens,
                           help=None if prompt_tokens else "default: the budget")
            p.add_argument("--max-tokens", type=positive_int, default=max_tokens, help="generated tokens per request")
            p.add_argument("--buffer", type=positive_int, default=64, help="buffer N (default 64)")
            p.add_argument("--window", type=count, default=8)
        return p

    p = part("throughput", "full cache vs decode-time compression at a fixed KV budget", 16, 128, 384)
    p.add_argument("--budgets", type=budgets, default=[64, 128], help="budgets B (default 64,128)")
    p.add_argument("--policy", default="rkv", choices=held)
    p.add_argument("--full-requests", type=full_requests, default=4.25, help="KV budget in full-cache requests")
    p.add_argument("--repeats", type=positive_int, default=2)

    p = part("fidelity", "greedy agreement and teacher-forced KL against the full cache", 4, 128)
    p.add_argument("--policies", type=name_list(held), default=list(FIDELITY_POLICIES))
    p.add_argument("--budgets", type=budgets, default=[32, 64, 128])
    p.add_argument("--positions", choices=("compact", "original"), default="compact")
    p.add_argument("--check-free", type=name_list(held, allow_none=True), default=["rkv"],
                   help="policies whose free greedy decode also runs, to check the teacher-forced agreement "
                        "(default rkv; none: no check)")

    p = part("ruler", "RULER exact match: chunked prefill under a budget vs one-shot compression")
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--context-length", type=positive_int, default=2048)
    p.add_argument("--n", type=positive_int, default=20)
    p.add_argument("--seed", type=int, default=5_000_000, help="dataset seed (default: the held-out seed)")
    p.add_argument("--budget", type=positive_int, default=512)
    p.add_argument("--chunks", type=int_list("chunk sizes", "256,512"), default=[256, 512])
    p.add_argument("--policies", type=name_list(held), default=["snapkv", "knorm"])
    p.add_argument("--max-tokens", type=positive_int, default=None, help="default: the task's CPU default")

    p = part("kvpress", "kvpress' DecodingPress beside tdutils' decode-time compression", 4)
    p.add_argument("--presses", type=name_list(tuple(KVPRESS_PRESSES), "press"), default=list(KVPRESS_PRESSES))
    p.add_argument("--budget", type=positive_int, default=128)
    return ap


RUNNERS = {"throughput": run_throughput, "fidelity": run_fidelity, "ruler": run_ruler, "kvpress": run_kvpress}


def check_args(args) -> None:
    """Everything that can be checked before the model loads: every `Compression` the part builds (a window at or
    past a budget, budgets below 2), RULER on a model that cannot spell it, `--json`.

    Raises:
        ValueError: one line naming the option.
    """
    from tdutils.compression import Compression
    from tdutils.ruler import check_ruler_model

    if args.json is not None:
        H.check_json_dest(args.json, example=f"docs/results/decode_compression_{args.part}.json")
    if args.part == "ruler":
        check_ruler_model(args.model, "--model")
        H.check_ruler_task(args.task)
    budgets = getattr(args, "budgets", None) or [getattr(args, "budget", 2)]
    policies = getattr(args, "policies", None) or [getattr(args, "policy", "snapkv")]
    window = None if args.part == "ruler" else args.window
    for policy in policies if args.part != "kvpress" else ["snapkv"]:
        for b in budgets:
            try:
                Compression(policy, budget=b, buffer=getattr(args, "buffer", 128), window=window)
            except ValueError as exc:
                opts = f"--budget{'s' if hasattr(args, 'budgets') else ''} {b}" + \
                    (f" --window {window}" if window is not None else "")
                raise ValueError(f"{opts} ({policy}): {exc}") from None


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    def known_part(report, path):
        first = report[0] if isinstance(report, list) else report
        if first["part"] not in PARTS:
            raise ValueError(f"--summary {path!r}: unknown part {first['part']!r}")
    if H.summary(ap, args, "decode_compression", keys=("part", "meta", "rows"), check=known_part):
        return 0
    if args.part is None:
        ap.error(f"choose a part: {', '.join(PARTS)} (or --summary RUN.json)")
    H.one_line_errors(ap, check_args, args)
    import torch

    torch.set_num_threads(args.threads)
    report = H.one_line_errors(ap, RUNNERS[args.part], args)  # an unloadable --model, a too-long --prompt-tokens
    print(H.render("decode_compression", report))
    if args.json is not None:
        H.write_json(report, args.json, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
