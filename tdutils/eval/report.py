"""Reports of an accuracy table: text tables, the leaderboard, the per-task markdown, the ranking, notes, JSON and plots.

A `passkey_eval` table (`COLUMNS`) prints with `format_table` and plots with `plot_accuracy` (accuracy vs drop
ratio per context length); a `task_eval` table (`TASK_COLUMNS`, or the `rows` of its JSON report as a DataFrame)
prints with `format_task_table` and `task_markdown` (the per-task table of docs/results.md), is summarised by
`leaderboard` (mean exact match over tasks per mode, policy and drop ratio; `plot_leaderboard`) and ranked by
`rank_policies` at one drop ratio with 95% intervals pooled over tasks (`plot_ranking`). `weak_tasks` /
`weak_task_notes` name the tasks the full cache itself fails (below `WEAK_FULL_ACCURACY`), whose scores rank nothing.
`write_json` stores `{"meta": ..., "rows": [...]}`. Plots return the matplotlib Figure and save it when given a path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .common import FULL, check_output_path, check_plot_path, wilson_interval

WEAK_FULL_ACCURACY = 0.5  # a task the full cache solves less often than this ranks no policy


def format_table(table) -> str:
    """The table as text: accuracy and its 95% interval in percent, one row per cell."""
    t = table.copy()
    t["accuracy"] = (100 * t["accuracy"]).map("{:.1f}%".format)
    t["95% CI"] = [f"{100 * lo:.1f}-{100 * hi:.1f}" for lo, hi in zip(table["ci_low"], table["ci_high"])]
    t["modify_s"] = t["modify_s"].map("{:.3f}".format)
    t["kept_tokens"] = t["kept_tokens"].map("{:.0f}".format)
    cols = ["context_tokens", "policy", "drop_ratio", "n", "correct", "accuracy", "95% CI", "modify_s", "kept_tokens"]
    return t[cols].to_string(index=False)


def format_task_table(table) -> str:
    """A `task_eval` table as text: one row per cell, exact match and its 95% interval in percent, partial credit."""
    t = table.copy()
    t["accuracy"] = (100 * t["accuracy"]).map("{:.1f}%".format)
    t["95% CI"] = [f"{100 * lo:.1f}-{100 * hi:.1f}" for lo, hi in zip(table["ci_low"], table["ci_high"])]
    t["partial"] = (100 * t["partial"]).map("{:.1f}%".format)
    t["modify_s"] = t["modify_s"].map("{:.3f}".format)
    t["kept_tokens"] = t["kept_tokens"].map("{:.0f}".format)
    cols = ["context_length", "task", "mode", "policy", "drop_ratio", "n", "correct", "accuracy", "95% CI", "partial",
            "modify_s", "kept_tokens"]
    return t[cols].to_string(index=False)


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
    t = table
    if context_length is not None:
        t = t[t["context_length"] == context_length]
        if t.empty:
            raise ValueError(f"no rows at context length {context_length}; the table has "
                             f"{sorted(table['context_length'].unique())}")
    tasks = list(dict.fromkeys(t["task"]))
    pooled = t.groupby(["mode", "policy", "drop_ratio", "task"], sort=False)[["correct", "n"]].sum()
    lengths = "/".join(str(x) for x in sorted(t["context_length"].unique()))
    head = ["mode", "policy", "drop ratios", *tasks, "average"]
    lines = [f"Exact match (%), {lengths} tokens, n = {int(t['n'].iloc[0])} per task and length",
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


def rank_policies(table, drop_ratio: float | None = None):
    """Rank the policies of a `task_eval` table per mode at one drop ratio, with 95% intervals, to say which
    differences the run can tell apart.

    Per (mode, policy) the cells at `drop_ratio` (the full cache: its ratio-0 cells) are pooled over tasks and
    context lengths: `correct` and `n` are summed and `accuracy = correct / n` (with the same `n` per cell, the
    mean exact match over tasks the leaderboard plots) gets a 95% Wilson score interval. Tasks differ in
    difficulty, so the pooled answers are independent Bernoulli draws with unequal rates; their count varies
    less than a binomial's of the same mean, so the interval is conservative.

    Args:
        table: a `task_eval` table (columns `mode`, `policy`, `drop_ratio`, `correct`, `n`).
        drop_ratio: the ratio to rank at; None: the largest non-zero ratio of the table.

    Returns:
        pandas DataFrame ordered by mode (as in the table), then by accuracy (best first), with columns `mode`,
        `rank` (1 = best; equal accuracies share the better rank), `policy`, `drop_ratio`, `correct`, `n`,
        `accuracy`, `ci_low`, `ci_high` (fractions in [0, 1]) and `above` (the policies of the same mode whose
        interval lies wholly below this one's, comma-separated: the differences the run resolves).

    Raises:
        ValueError: the table has no rows at `drop_ratio` besides the full cache, or no ratio above 0.
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
    pooled = at.groupby(["mode", "policy"], sort=False)[["correct", "n"]].sum().reset_index()
    rows = []
    for mode, g in pooled.groupby("mode", sort=False):
        g = g.assign(accuracy=g["correct"] / g["n"])
        g[["ci_low", "ci_high"]] = [wilson_interval(c, n) for c, n in zip(g["correct"], g["n"])]
        g = g.sort_values("accuracy", ascending=False, kind="stable")
        g["rank"] = g["accuracy"].rank(method="min", ascending=False).astype(int)
        g["above"] = [", ".join(q.policy for q in g.itertuples() if q.ci_high < row.ci_low) for row in g.itertuples()]
        rows.append(g.assign(drop_ratio=[0.0 if p == FULL else float(drop_ratio) for p in g["policy"]]))
    out = pd.concat(rows, ignore_index=True)
    return out[["mode", "rank", "policy", "drop_ratio", "correct", "n", "accuracy", "ci_low", "ci_high", "above"]]


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
    fig.suptitle(f"{title} ({tasks} tasks; {lengths} tokens; n={int(table['n'].iloc[0])} per cell)", fontsize=10)
    fig.tight_layout()
    return _save_figure(fig, path)


def plot_ranking(ranking, path: str | Path | None = None, *, title: str = "Policies ranked: exact match, 95% interval"):
    """Forest plot of `rank_policies` output: one panel per mode, one row per policy (best on top), its pooled exact
    match (%) as a dot and its 95% Wilson interval as a bar; the full cache in black.

    Returns the matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(ranking["mode"]))
    height = 0.9 + 0.32 * max(len(g) for _, g in ranking.groupby("mode"))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), height), sharex=True, squeeze=False)
    ratio = max(ranking["drop_ratio"])
    for ax, mode in zip(axes[0], modes):
        g = ranking[ranking["mode"] == mode].reset_index(drop=True)
        y = list(range(len(g)))[::-1]
        for yi, row in zip(y, g.itertuples()):
            color = "black" if row.policy == FULL else "C0"
            err = [[100 * max(0.0, row.accuracy - row.ci_low)], [100 * max(0.0, row.ci_high - row.accuracy)]]  # 0 - 1e-17
            ax.errorbar(100 * row.accuracy, yi, xerr=err, fmt="o", color=color, capsize=3)
        ax.set_yticks(y, [f"{row.rank}. {row.policy}" for row in g.itertuples()])
        ax.set_title(f"query-{mode}, drop ratio {ratio:g}")
        ax.set_xlabel("exact match, pooled over tasks (%)")
        ax.set_xlim(-3, 103)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
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


__all__ = ["WEAK_FULL_ACCURACY", "format_table", "format_task_table", "leaderboard", "plot_accuracy",
           "plot_leaderboard", "plot_ranking", "rank_policies", "task_markdown", "weak_task_notes", "weak_tasks",
           "write_json"]
