"""Reports of an accuracy table: text tables, the leaderboard, the per-task markdown, the ranking, notes, JSON and plots.

A `passkey_eval` table (`COLUMNS`) prints with `format_table` and plots with `plot_accuracy` (accuracy vs drop
ratio per context length); a `task_eval` table (`TASK_COLUMNS`, or the `rows` of its JSON report as a DataFrame)
prints with `format_task_table` and `task_markdown` (the per-task table of docs/results.md), is summarised by
`leaderboard` (mean exact match over tasks per mode, policy and drop ratio; `plot_leaderboard`) and ranked by
`rank_policies` at one drop ratio by paired tests on the same prompts (`tdutils.eval.statistics`; `plot_ranking`). `weak_tasks` /
`weak_task_notes` name the tasks the full cache itself fails (below `WEAK_FULL_ACCURACY`), whose scores rank nothing.
`write_json` stores `{"meta": ..., "rows": [...]}`. Plots return the matplotlib Figure and save it when given a path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from .common import FULL, check_output_path, check_plot_path, wilson_interval
from .statistics import (
    ALPHA,
    MEASURES,
    get_measure,
    has_scores,
    paired_bootstrap,
    pairwise_tests,
    pooled_scores,
)

WEAK_FULL_ACCURACY = 0.5  # a task the full cache solves less often than this ranks no policy
# a policy keeping this much more than the median policy at the same drop ratio is not compared at equal memory
OVER_BUDGET = 1.05
UNPAIRED = ("unpaired 95% Wilson intervals: this run keeps no per-prompt scores, so no paired test; differences "
            "the intervals do not separate may still be real")


def format_table(table) -> str:
    """The table as text: accuracy and its 95% interval in percent, one row per cell."""
    t = table.copy()
    t["accuracy"] = (100 * t["accuracy"]).map("{:.1f}%".format)
    t["95% CI"] = [f"{100 * lo:.1f}-{100 * hi:.1f}" for lo, hi in zip(table["ci_low"], table["ci_high"])]
    t["modify_s"] = t["modify_s"].map("{:.3f}".format)
    t["kept_tokens"] = t["kept_tokens"].map("{:.0f}".format)
    cols = ["context_tokens", "policy", "drop_ratio", "n", "correct", "accuracy", "95% CI", "modify_s", "kept_tokens"]
    return t[cols].to_string(index=False)


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def format_task_table(table) -> str:
    """A `task_eval` table as text: one row per cell, exact match and its 95% interval in percent, partial credit.

    A column no row has (exact match on a teacher-forced task, partial credit on a single-answer one) is left out;
    a row without a value shows `–`."""
    t = table.copy()

    def pct(x):
        return "–" if _missing(x) else f"{100 * x:.1f}%"

    t["accuracy"] = t["accuracy"].map(pct)
    t["95% CI"] = ["–" if _missing(lo) else f"{100 * lo:.1f}-{100 * hi:.1f}"
                   for lo, hi in zip(table["ci_low"], table["ci_high"])]
    t["correct"] = ["–" if _missing(c) else f"{c:.0f}" for c in table["correct"]]
    t["partial"] = t["partial"].map(pct)
    t["modify_s"] = t["modify_s"].map("{:.3f}".format)
    t["kept_tokens"] = t["kept_tokens"].map("{:.0f}".format)
    cols = ["context_length", "task", "mode", "policy", "drop_ratio", "n"]
    if table["accuracy"].notna().any():
        cols += ["correct", "accuracy", "95% CI"]
    if table["partial"].notna().any():
        cols += ["partial"]
    cols += ["modify_s", "kept_tokens"]
    if "measure" in t.columns and (t["measure"] != "exact").any():  # partial credit, text fidelity: their own score
        t["score"] = t["score"].map("{:.3g}".format)
        cols += ["measure", "score"]
    return t[cols].to_string(index=False)


def n_text(n: int | Mapping[str, int]) -> str:
    """Prompts per cell in words: an int (or a run's JSON `meta.n`) `"100"`; `{task: n}` `"100 (a, b), 32 (c)"`,
    or `"100"` when every task has the same."""
    if not isinstance(n, Mapping):
        return str(int(n))
    by: dict[int, list[str]] = {}
    for task, k in n.items():
        by.setdefault(int(k), []).append(str(task))
    if len(by) == 1:
        return str(next(iter(by)))
    return ", ".join(f"{k} ({', '.join(tasks)})" for k, tasks in by.items())


def _n_of(table) -> str:
    """`n_text` of a `task_eval` table's rows (each task's `n`)."""
    return n_text(dict(zip(table["task"], table["n"].astype(int))))


def leaderboard(table):
    """Average exact match over tasks and context lengths per (mode, policy, drop ratio) of a `task_eval` table:
    a DataFrame with `mode`, `policy`, `drop_ratio`, `accuracy` (mean of the cells' exact-match fractions, each
    task weighing the same), `partial`, `cells` (how many cells were averaged) and `n` (examples in all)."""
    g = table.groupby(["mode", "policy", "drop_ratio"], sort=False)
    return g.agg(accuracy=("accuracy", "mean"), partial=("partial", "mean"), cells=("accuracy", "size"),
                 n=("n", "sum")).reset_index()


def task_markdown(table, *, context_length: int | None = None) -> str:
    """The per-task table (markdown, as in docs/results.md) of a `task_eval` table (or the `rows` of its JSON report, as a
    DataFrame): one row per (mode, policy), one column per task plus the average; a cell lists the exact match
    (%) at each drop ratio, `a / b / c` in ascending ratio order (the full cache: one figure). Cells of several
    context lengths are pooled (correct answers over examples) unless `context_length` picks one.

    Raises:
        ValueError: `context_length` is not in the table.
    """
    t = table[table["correct"].notna()]  # a teacher-forced task has no exact match (`measure_markdown`)
    if context_length is not None:
        t = t[t["context_length"] == context_length]
        if t.empty:
            raise ValueError(f"no rows at context length {context_length}; the table has "
                             f"{sorted(table['context_length'].unique())}")
    tasks = list(dict.fromkeys(t["task"]))
    pooled = t.groupby(["mode", "policy", "drop_ratio", "task"], sort=False)[["correct", "n"]].sum()
    lengths = "/".join(str(x) for x in sorted(t["context_length"].unique()))
    head = ["mode", "policy", "drop ratios", *tasks, "average"]
    lines = [f"Exact match (%), {lengths} tokens, n = {_n_of(t)} per task and length",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (mode, policy), g in t.groupby(["mode", "policy"], sort=False):
        ratios = sorted(g["drop_ratio"].unique())
        cells = []
        for task in [*tasks, None]:
            values = []
            for r in ratios:
                if task is None:
                    values.append(sum(100 * pooled.loc[(mode, policy, r, x), "correct"] / pooled.loc[(mode, policy, r, x), "n"]
                                      for x in tasks) / len(tasks))
                else:
                    row = pooled.loc[(mode, policy, r, task)]
                    values.append(100 * row["correct"] / row["n"])
            cells.append(" / ".join(f"{v:.1f}" for v in values))
        lines.append("| " + " | ".join([mode, policy, " / ".join(f"{r:g}" for r in ratios), *cells]) + " |")
    return "\n".join(lines)


def measure_markdown(table, task: str) -> str:
    """The table of one task's per-prompt measures (markdown): one row per (mode, policy), one column per measure
    its rows keep (`scores`: exact and partial, or kl, delta_ppl, agreement and ppl of a teacher-forced task), a
    cell the mean at each drop ratio, `a / b / c` in ascending ratio order; pooled over context lengths.

    Raises:
        ValueError: no rows of `task`, or rows without per-prompt scores.
    """
    t = table[table["task"] == task]
    if t.empty or not has_scores(t):
        raise ValueError(f"no rows of {task!r} with per-prompt scores in this table")
    names = [m for m in t["scores"].iloc[0] if m in MEASURES or m == "ppl"]
    pct = {"exact", "partial", "agreement"}
    lengths = "/".join(str(x) for x in sorted(t["context_length"].unique()))
    head = ["mode", "policy", "drop ratios", *(f"{m} (%)" if m in pct else m for m in names)]
    lines = [f"`{task}`, {lengths} tokens, n = {int(t['n'].iloc[0])} per length; mean per prompt", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (mode, policy), g in t.groupby(["mode", "policy"], sort=False):
        ratios = sorted(g["drop_ratio"].unique())
        cells = []
        for m in names:
            means = []
            for r in ratios:
                xs = [v for s in g.loc[g["drop_ratio"] == r, "scores"] for v in s[m]]
                means.append(sum(xs) / len(xs) * (100 if m in pct else 1))
            cells.append(" / ".join(f"{v:.1f}" if m in pct else f"{v:.3g}" for v in means))
        lines.append("| " + " | ".join([mode, policy, " / ".join(f"{r:g}" for r in ratios), *cells]) + " |")
    return "\n".join(lines)


def rank_policies(table, drop_ratio: float | None = None, *, measure: str | None = None, alpha: float = ALPHA):
    """Rank the policies of a `task_eval` table per mode at one drop ratio by paired tests: a policy ranks below
    another only where a test on the same prompts separates them.

    Per (mode, policy) the cells at `drop_ratio` (the full cache: its ratio-0 cells) whose task is scored by
    `measure` are pooled over tasks and context lengths: their per-prompt scores are concatenated in (task, length)
    order, the same prompts for every policy. Every pair of policies of a mode is compared on them
    (`tdutils.eval.statistics.pairwise_tests`: exact McNemar for exact match, the sign-flip permutation test for a
    continuous measure), with Holm's correction across the mode's pairs at family-wise level `alpha`. A policy's
    rank is 1 + the number of policies separated above it, so policies the tests do not separate share a rank.

    A table without per-prompt scores (runs stored before they were kept) cannot be paired: it is ranked by
    unpaired 95% Wilson intervals of the pooled exact match instead (one separates another where its interval
    lies wholly above the other's), and the `test` column says so.

    Args:
        table: a `task_eval` table (columns `task`, `mode`, `policy`, `drop_ratio`, `context_length`, `correct`,
            `n`, and `scores` / `measure` in runs that keep per-prompt scores).
        drop_ratio: the ratio to rank at; None: the largest non-zero ratio of the table.
        measure: the measure ranked (`tdutils.eval.statistics.MEASURES`); None: exact match when the table has
            exact-match tasks, else the measure of its first row.
        alpha: the family-wise error rate (default `ALPHA`, 0.05).

    Returns:
        pandas DataFrame ordered by mode (as in the table), then rank and score (best first), with columns `mode`,
        `rank`, `policy`, `drop_ratio`, `measure`, `n` (prompts pooled), `score` (mean of the measure), `ci_low`,
        `ci_high` (exact match: 95% Wilson interval; continuous: bootstrap 95% interval of the mean), `correct`,
        `accuracy` (exact match only; NaN otherwise), `above` (the policies of the same mode this one is
        separated above, comma-separated), `test` (how the separations were decided), `kept_tokens` (mean KV
        tokens per request after the edit, over the pooled cells; NaN where the table has no `kept_tokens`) and
        `over_budget` (True where a policy keeps more than `OVER_BUDGET` times the median of the mode's dropped
        policies at that ratio, e.g. `middle_chunk`, which keeps its first and last chunk whole: its score is not
        at equal memory, whatever its rank).

    Raises:
        ValueError: the table has no rows at `drop_ratio` besides the full cache, no ratio above 0, or no task
            scored by `measure`; a policy that lacks a task or length the others have.
    """
    import pandas as pd

    dropped = table[table["policy"] != FULL]
    ratios = sorted(r for r in dropped["drop_ratio"].unique() if r > 0)
    if drop_ratio is None:
        if not ratios:
            raise ValueError("rank_policies needs a table with a drop ratio above 0 (a policy other than the full cache)")
        drop_ratio = ratios[-1]
    at = table[((table["policy"] == FULL) & (table["drop_ratio"] == 0)) |
               ((table["policy"] != FULL) & (table["drop_ratio"] == drop_ratio))]
    if at[at["policy"] != FULL].empty:
        raise ValueError(f"no rows at drop ratio {drop_ratio:g}; the table has {[float(r) for r in ratios]}")
    own = at["measure"] if "measure" in at.columns else pd.Series("exact", index=at.index)
    if measure is None:
        measure = "exact" if (own == "exact").any() else str(own.iloc[0])
    get_measure(measure)
    at = at[own == measure]
    if at.empty:
        raise ValueError(f"no task of this table is scored by {measure!r}; its measures are {sorted(set(own))}")
    paired = has_scores(at)
    rows = [(_rank_paired(g, mode, MEASURES[measure], alpha) if paired else _rank_wilson(g))
            .assign(mode=mode, measure=measure) for mode, g in at.groupby("mode", sort=False)]
    out = pd.concat(rows, ignore_index=True)
    out["drop_ratio"] = [0.0 if p == FULL else float(drop_ratio) for p in out["policy"]]
    out = _with_budget(out, at)
    return out[["mode", "rank", "policy", "drop_ratio", "measure", "n", "score", "ci_low", "ci_high", "correct",
                "accuracy", "above", "test", "kept_tokens", "over_budget"]]


def _with_budget(ranking, at):
    """`ranking` with `kept_tokens` (mean over each (mode, policy)'s cells of `at`, weighted by their prompts) and
    `over_budget` (more than `OVER_BUDGET` times the median of the mode's dropped policies)."""
    if "kept_tokens" not in at.columns:
        return ranking.assign(kept_tokens=math.nan, over_budget=False)
    w = at.assign(_w=at["kept_tokens"] * at["n"])
    sums = w.groupby(["mode", "policy"], sort=False)[["_w", "n"]].sum()
    kept = (sums["_w"] / sums["n"]).to_dict()
    ranking = ranking.assign(kept_tokens=[kept.get((m, p), math.nan) for m, p in zip(ranking["mode"],
                                                                                        ranking["policy"])])
    dropped = ranking[ranking["policy"] != FULL]
    median = dropped.groupby("mode", sort=False)["kept_tokens"].median().to_dict()
    return ranking.assign(over_budget=[p != FULL and k > OVER_BUDGET * median.get(m, math.inf)
                                       for m, p, k in zip(ranking["mode"], ranking["policy"], ranking["kept_tokens"])])


def _rank_paired(g, mode: str, measure, alpha: float):
    """`rank_policies` of one mode from per-prompt scores (see there)."""
    import pandas as pd

    pooled, keys = {}, None
    for policy, rows in g.groupby("policy", sort=False):
        rows = rows.sort_values(["task", "context_length"], kind="stable")
        cells = list(zip(rows["task"], rows["context_length"]))
        if keys is not None and cells != keys:
            raise ValueError(f"{mode}: {policy!r} has the cells {cells} but the others {keys}; a paired ranking "
                             "needs every policy on the same tasks and lengths")
        keys = cells
        pooled[policy] = pooled_scores(rows, measure.name)
    pairs = pairwise_tests(pooled, measure, alpha=alpha)
    out = []
    for policy, xs in pooled.items():
        won = [b if a == policy else a for a, b, w in zip(pairs["a"], pairs["b"], pairs["better"]) if w == policy]
        lost = sum(1 for a, b, w in zip(pairs["a"], pairs["b"], pairs["better"]) if policy in (a, b) and w not in
                   ("", policy))
        score = sum(xs) / len(xs)
        if measure.binary:
            correct = round(sum(xs))
            low, high = wilson_interval(correct, len(xs))
        else:
            correct = math.nan
            _, low, high = paired_bootstrap(xs, [0.0] * len(xs))
        out.append({"policy": policy, "rank": 1 + lost, "n": len(xs), "score": score, "ci_low": low, "ci_high": high,
                    "correct": correct, "accuracy": score if measure.binary else math.nan, "above": won})
    test = ("exact McNemar" if measure.binary else "sign-flip permutation") + f", Holm-corrected, alpha {alpha:g}"
    df = pd.DataFrame(out).assign(test=test)
    df = df.sort_values(["rank", "score"], ascending=[True, not measure.higher_is_better], kind="stable")
    order = list(df["policy"])
    df["above"] = [", ".join(sorted(w, key=order.index)) for w in df["above"]]
    return df.reset_index(drop=True)


def _rank_wilson(g):
    """`rank_policies` of one mode without per-prompt scores: pooled exact match and unpaired Wilson intervals."""
    g = g.groupby("policy", sort=False)[["correct", "n"]].sum().reset_index()
    g = g.assign(score=g["correct"] / g["n"])
    g["accuracy"] = g["score"]
    g[["ci_low", "ci_high"]] = [wilson_interval(c, n) for c, n in zip(g["correct"], g["n"])]
    g = g.sort_values("score", ascending=False, kind="stable")
    g["rank"] = [1 + sum(1 for q in g.itertuples() if q.ci_low > row.ci_high) for row in g.itertuples()]
    g["above"] = [", ".join(q.policy for q in g.itertuples() if q.ci_high < row.ci_low) for row in g.itertuples()]
    return g.assign(test=UNPAIRED).sort_values(["rank", "score"], ascending=[True, False], kind="stable")


def weak_tasks(table, threshold: float = WEAK_FULL_ACCURACY) -> dict:
    """`{(task, mode, context_length): full-cache accuracy}` for the cells where the full cache scores below
    `threshold`: there the model cannot do the task, so no policy's score there says anything about the policy.
    Empty when the table has no `"full"` rows."""
    full = table[table["policy"] == FULL]
    return {(r.task, r.mode, int(r.context_length)): float(r.accuracy) for r in full.itertuples()
            if r.accuracy < threshold}


def weak_task_notes(table, threshold: float = WEAK_FULL_ACCURACY) -> list[str]:
    """One line per task (and mode, length) that the full cache itself fails (`weak_tasks`), for tables and logs."""
    return [f"note: {task} ({mode}, {length} tokens): the full cache scores {100 * acc:.0f}% (< {100 * threshold:.0f}%): "
            f"the model cannot do this task, so the policies' scores on it rank nothing"
            for (task, mode, length), acc in weak_tasks(table, threshold).items()]


def undropped_notes(table, kept_at_least: float = 0.98) -> list[str]:
    """One line per cell whose policy, at a drop ratio above 0, kept at least `kept_at_least` of the KV tokens
    the full cache keeps in the same (task, mode, length) (of the context length where the grid has no full
    cell): at that length its protected tokens (window, sinks) cover the prompt, so it dropped (almost) nothing
    and its score is the full cache's under its name. Reads `policy`, `drop_ratio`, `kept_tokens` and
    `context_length` (or the passkey table's `context_tokens`), grouped by `task` and `mode` where present."""
    length = "context_length" if "context_length" in table.columns else "context_tokens"
    keys = [c for c in ("task", "mode", length) if c in table.columns]
    notes = []
    for group, rows in table.groupby(keys, sort=False):
        named = dict(zip(keys, group if isinstance(group, tuple) else (group,)))
        full = rows[rows["policy"] == FULL]["kept_tokens"]
        ref = float(full.iloc[0]) if len(full) else float(named[length])
        for r in rows.itertuples():
            if r.policy != FULL and r.drop_ratio > 0 and ref > 0 and r.kept_tokens >= kept_at_least * ref:
                where = ", ".join(f"{named[k]}" for k in ("task", "mode") if k in named)
                notes.append(f"note: {r.policy} at drop ratio {r.drop_ratio:g} ({where + ', ' if where else ''}"
                             f"{named[length]} tokens) kept {r.kept_tokens:.0f} KV tokens per request, "
                             f"{100 * r.kept_tokens / ref:.0f}% of the full cache's: its protected tokens (window, "
                             f"sinks) cover this prompt, so it dropped (almost) nothing; use longer context lengths")
    return notes


def write_json(table, path: str | Path, *, meta: Mapping | None = None) -> Path:
    """Write `{"meta": meta, "rows": [one dict per table row]}` to `path` (parents created); returns it.

    Raises:
        ValueError: `path` is not a writable file path (see `check_output_path`).
    """
    path = check_output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"meta": dict(meta or {}), "rows": json.loads(table.to_json(orient="records"))}
    path.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    return path


def plot_accuracy(table, path: str | Path | None = None, *, title: str = "Passkey retrieval accuracy"):
    """Accuracy (%) vs drop ratio, one line per policy (95% interval shaded), one panel per context length.

    The full cache is drawn as a dashed horizontal line with its interval as a band. Returns the
    matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    lengths = sorted(table["context_tokens"].unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), sharey=True, squeeze=False)
    ratios = sorted(table["drop_ratio"].unique())
    x_lo, x_hi = (min(ratios), max(ratios)) if len(ratios) > 1 else (0.0, 1.0)
    for ax, length in zip(axes[0], lengths):
        sub = table[table["context_tokens"] == length]
        for policy, g in sub.groupby("policy", sort=False):
            g = g.sort_values("drop_ratio")
            if policy == FULL:
                acc, lo, hi = (100 * float(g[c].iloc[0]) for c in ("accuracy", "ci_low", "ci_high"))
                ax.axhline(acc, color="black", ls="--", lw=1, label="full cache")
                ax.axhspan(lo, hi, color="black", alpha=0.08)
                continue
            line, = ax.plot(g["drop_ratio"], 100 * g["accuracy"], marker="o", label=policy)
            ax.fill_between(g["drop_ratio"], 100 * g["ci_low"], 100 * g["ci_high"], color=line.get_color(), alpha=0.15)
        _ratio_panel(ax, f"{length} tokens (n={int(sub['n'].iloc[0])})", x_lo, x_hi)
    axes[0][0].set_ylabel("exact match (%)")
    axes[0][-1].legend(loc="lower left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return _save_figure(fig, path)


def plot_leaderboard(table, path: str | Path | None = None, *, title: str = "RULER-style tasks: average exact match"):
    """Leaderboard figure of a `task_eval` table: average exact match (%) over tasks (and context lengths) vs drop
    ratio, one line per policy, one panel per mode (`aware`, `agnostic`); the full cache as a dashed line.

    Returns the matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    board = leaderboard(table)
    modes = list(dict.fromkeys(board["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), 3.6), sharey=True, squeeze=False)
    ratios = sorted(board.loc[board["policy"] != FULL, "drop_ratio"].unique())
    x_lo, x_hi = (min(ratios), max(ratios)) if len(ratios) > 1 else (0.0, 1.0)
    lengths = ", ".join(str(x) for x in sorted(table["context_length"].unique()))
    colors = {p: f"C{i}" for i, p in enumerate(x for x in dict.fromkeys(board["policy"]) if x != FULL)}
    for ax, mode in zip(axes[0], modes):
        sub = board[board["mode"] == mode]
        for policy, g in sub.groupby("policy", sort=False):
            g = g.sort_values("drop_ratio")
            if policy == FULL:
                ax.axhline(100 * float(g["accuracy"].iloc[0]), color="black", ls="--", lw=1, label="full cache")
                continue
            ax.plot(g["drop_ratio"], 100 * g["accuracy"], marker="o", color=colors[policy], label=policy)
        _ratio_panel(ax, f"query-{mode}", x_lo, x_hi)
    axes[0][0].set_ylabel("exact match, mean over tasks (%)")
    axes[0][-1].legend(loc="best", fontsize=8)
    tasks = table["task"].nunique()
    fig.suptitle(f"{title} ({tasks} tasks; {lengths} tokens; n={_n_of(table)} per cell)", fontsize=10)
    fig.tight_layout()
    return _save_figure(fig, path)


def plot_ranking(ranking, path: str | Path | None = None, *, title: str | None = None):
    """Forest plot of `rank_policies` output: one panel per mode, one row per policy (best on top, labelled with its
    rank, so policies the paired tests do not separate share a number), its pooled score as a dot and its 95%
    interval as a bar (exact match: Wilson; continuous: bootstrap); the full cache in black. The title names the
    test the ranks come from.

    Returns the matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(ranking["mode"]))
    measure = MEASURES[str(ranking["measure"].iloc[0])]
    scale, unit = (100, " (%)") if measure.name in ("exact", "partial", "agreement") else (1, "")
    height = 0.9 + 0.32 * max(len(g) for _, g in ranking.groupby("mode"))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), height + 0.3), sharex=True, squeeze=False)
    ratio = max(ranking["drop_ratio"])
    for ax, mode in zip(axes[0], modes):
        g = ranking[ranking["mode"] == mode].reset_index(drop=True)
        y = list(range(len(g)))[::-1]
        for yi, row in zip(y, g.itertuples()):
            color = "black" if row.policy == FULL else "C0"
            err = [[scale * max(0.0, row.score - row.ci_low)], [scale * max(0.0, row.ci_high - row.score)]]  # 0 - 1e-17
            ax.errorbar(scale * row.score, yi, xerr=err, fmt="o", color=color, capsize=3)
        ax.set_yticks(y, [f"{row.rank}. {row.policy}" for row in g.itertuples()])
        ax.set_title(f"query-{mode}, drop ratio {ratio:g}")
        ax.set_xlabel(f"{measure.name}, pooled over tasks{unit}")
        if scale == 100:
            ax.set_xlim(-3, 103)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title or f"Policies ranked by {ranking['test'].iloc[0]}", fontsize=9)
    fig.tight_layout()
    return _save_figure(fig, path)


def plot_paired_differences(diffs, path: str | Path | None = None, *, title: str | None = None):
    """Forest plot of `tdutils.eval.statistics.paired_differences`: one panel per (task, mode), one row per policy
    and drop ratio, the mean per-prompt difference to the full cache on the same prompts as a dot with its paired
    bootstrap 95% interval as a bar; filled where the paired test's p-value is below 0.05 (uncorrected: one cell
    against the full cache), hollow where it is not; a line at 0.

    Returns the matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(zip(diffs["task"], diffs["mode"])))
    rows = max(len(g) for _, g in diffs.groupby(["task", "mode"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 0.9 + 0.24 * rows), squeeze=False)
    for ax, (task, mode) in zip(axes[0], panels):
        g = diffs[(diffs["task"] == task) & (diffs["mode"] == mode)].reset_index(drop=True)
        y = list(range(len(g)))[::-1]
        for yi, row in zip(y, g.itertuples()):
            err = [[max(0.0, row.diff - row.ci_low)], [max(0.0, row.ci_high - row.diff)]]
            sig = row.p_value < ALPHA
            ax.errorbar(row.diff, yi, xerr=err, fmt="o", capsize=2, color="C3" if sig else "C0",
                        mfc=None if sig else "white")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(y, [f"{row.policy} @ {row.drop_ratio:g}" for row in g.itertuples()], fontsize=7)
        ax.set_title(f"{task}, query-{mode}", fontsize=9)
        ax.set_xlabel(f"{g['measure'].iloc[0]}: cell - full cache (paired)")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title or "Paired differences to the full cache, bootstrap 95% intervals (filled: p < 0.05)",
                 fontsize=9)
    fig.tight_layout()
    return _save_figure(fig, path)


def _ratio_panel(ax, title: str, x_lo: float, x_hi: float) -> None:
    """One panel of exact match (%) vs drop ratio: title, x label, the ratios' range with a margin, 0-100 %, a grid."""
    ax.set_title(title)
    ax.set_xlabel("drop ratio")
    ax.set_xlim(x_lo - 0.03, x_hi + 0.03)
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)


def _save_figure(fig, path: str | Path | None):
    """Save `fig` to `path` (PNG, SVG, ... by suffix; parents created) when a path is given; returns `fig`."""
    if path is not None:
        path = check_plot_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


__all__ = ["OVER_BUDGET", "UNPAIRED", "WEAK_FULL_ACCURACY", "format_table", "format_task_table", "leaderboard", "measure_markdown", "undropped_notes",
           "n_text", "plot_accuracy",
           "plot_leaderboard", "plot_paired_differences", "plot_ranking", "rank_policies", "task_markdown", "weak_task_notes", "weak_tasks",
           "write_json"]
