"""Decode-throughput sweeps: baseline and every policy × drop ratio, alternated, on the same prompts.

At a fixed KV budget, keeping a fraction `1 − r` of every cache fits at most `1/(1 − r)` times as many
requests into the decode batch (fewer, since generated tokens share the budget): that *capacity limit*
is the physical ceiling of the decode speed-up. Measurements on a shared machine drift, so each repeat
runs the baseline and every configuration back to back (A B C … A B C …) and every ratio is taken
against the baseline of its own repeat.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .edit import make_drop_fn
from .metrics import capacity_limit, median_min_max, speedup_caveats
from .runs import alternate_runs


@dataclass
class SweepConfig:
    """One configuration: a policy name (or None for the baseline), its drop ratio and parameters."""

    policy: str | None
    drop_ratio: float = 0.0
    params: dict | None = None

    @property
    def name(self) -> str:
        if self.policy is None:
            return "baseline"
        extra = "".join(f",{k}={v}" for k, v in (self.params or {}).items())
        return f"{self.policy}@{self.drop_ratio:g}{extra}"


def throughput_sweep(engine, prompts, configs: list[SweepConfig], *, max_tokens: int = 64, repeats: int = 3,
                     progress=print):
    """Measure every configuration `repeats` times, alternating with the baseline.

    Args:
        engine: an open engine (its `kv_budget_tokens` is the fixed budget).
        prompts: strings, rows or token-id lists (tokenized once).
        configs: the configurations besides the baseline (which always runs first in each repeat).
        max_tokens: decode tokens per request; EOS is ignored so every run decodes the same count.
        repeats: rounds of A B C ...
        progress: callable for one line per run (None: silent).

    Returns:
        `(table, runs)`: a pandas DataFrame with one row per configuration — `repeats`, decode tok/s median / min /
        max, `decode_speedup` (median over repeats of the ratio to that repeat's baseline) with
        `decode_speedup_min` / `_max` (`tdutils.metrics.speedup_notes` reads them), the capacity
        limit `1/(1−r)` and `of_limit` (speedup / limit), peak batch, modify seconds and
        `modify_of_base_decode` (median of modify seconds / the same repeat's baseline decode seconds),
        end-to-end seconds (prefill + modify + decode) and its ratio — and the list of per-run summaries.

    Raises:
        RuntimeError: a run decoded a different number of tokens than `requests × max_tokens`.
    """
    import pandas as pd

    ids = engine.tokenize(prompts)
    expected = len(ids) * max_tokens
    fns = {c.name: make_drop_fn(c.policy, drop_ratio=c.drop_ratio, model_config=engine.facts,
                                rerotate=getattr(engine, "positions", "compact") == "compact", **(c.params or {}))
           for c in configs}
    ratios = {c.name: c.drop_ratio for c in [SweepConfig(None)] + list(configs)}
    policies = {c.name: c.policy or "baseline" for c in [SweepConfig(None)] + list(configs)}
    runs, base = [], {}
    for rep, name, res, speedup in alternate_runs(engine, ids, fns, max_tokens=max_tokens, repeats=repeats,
                                                  progress=progress, ignore_eos=True):
        s = res.metrics.summary()
        if s["decode_tokens"] != expected:
            raise RuntimeError(f"{name} decoded {s['decode_tokens']} tokens, expected {expected} "
                               f"({len(ids)} requests x {max_tokens})")
        if name == "baseline":
            base = s
        s.update(repeat=rep, drop_ratio=ratios[name], speedup=speedup, e2e_speedup=base["end_to_end_s"] / s["end_to_end_s"],
                 modify_of_base_decode=s["modify_s"] / base["decode_s"])
        runs.append(s)

    rows = []
    for name, r in ratios.items():
        mine = [s for s in runs if s["run"] == name]
        tps = [s["decode_tok_s"] for s in mine]
        limit = capacity_limit(r)
        speedup, lo, hi = median_min_max([s["speedup"] for s in mine])
        rows.append({
            "config": name, "policy": policies[name], "drop_ratio": r, "repeats": len(mine),
            "decode_tok_s_median": statistics.median(tps), "decode_tok_s_min": min(tps), "decode_tok_s_max": max(tps),
            "decode_speedup": speedup, "decode_speedup_min": lo, "decode_speedup_max": hi,
            "capacity_limit": limit, "of_limit": speedup / limit,
            "peak_batch": max(s["peak_batch"] for s in mine),
            "kept_fraction": statistics.median(s["kept_fraction"] for s in mine),
            "modify_s": statistics.median(s["modify_s"] for s in mine),
            "modify_of_base_decode": statistics.median(s["modify_of_base_decode"] for s in mine),
            "end_to_end_s": statistics.median(s["end_to_end_s"] for s in mine),
            "e2e_speedup": statistics.median(s["e2e_speedup"] for s in mine),
        })
    return pd.DataFrame(rows).set_index("config"), runs


def plot_speedup(table, ax=None, title: str = "Decode speed-up at a fixed KV budget", label_column: str = "policy"):
    """Decode speed-up vs drop ratio, one line per `label_column` value, with the spread over repeats and the
    capacity limit `1/(1 − r)`.

    Each point is the median of the per-repeat ratios (`decode_speedup`); its error bar spans
    `decode_speedup_min`..`decode_speedup_max` when the table has them; a point with a caveat
    (`tdutils.metrics.speedup_caveats`: machine busy, no larger batch, ...) is circled in red.

    Args:
        table: the table of `throughput_sweep` (columns `drop_ratio`, `decode_speedup`, `label_column`).
            Drop ratio 1.0 is allowed: its limit is infinite, drawn as a dotted vertical line at r = 1.
        ax: matplotlib axes (default: a new figure).

    Returns:
        The axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.8))
    rows = table[table[label_column] != "baseline"]
    spread = "decode_speedup_min" in rows and "repeats" in rows and len(rows) and int(rows["repeats"].max()) > 1
    for label, g in rows.groupby(label_column, sort=False):
        g = g.sort_values("drop_ratio")
        yerr = [g.decode_speedup - g.decode_speedup_min, g.decode_speedup_max - g.decode_speedup] if spread else None
        ax.errorbar(g.drop_ratio, g.decode_speedup, yerr=yerr, marker="o", capsize=3, label=label)
    rs = sorted(set(rows.drop_ratio))
    finite = [r for r in rs if r < 1]  # at r = 1 the limit 1/(1-r) is infinite: no point to draw
    ax.plot(finite, [capacity_limit(r) for r in finite], "k--", lw=1, marker="_", ms=14, label="capacity limit 1/(1-r)")
    if len(finite) < len(rs):
        ax.axvline(1.0, color="k", ls=":", lw=1, label="r = 1: no capacity limit")
    flagged = {run for run, _, _ in speedup_caveats(table)} if "baseline" in table.index else set()
    if flagged:
        f = rows.loc[[c for c in rows.index if c in flagged]]
        ax.scatter(f.drop_ratio, f.decode_speedup, s=160, facecolors="none", edgecolors="#c0392b", lw=1.5,
                   label="caveat (see the notes)", zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("drop ratio")
    ax.set_ylabel("decode tok/s vs baseline" + (" (median, min-max)" if spread else ""))
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def plot_accuracy_vs_speedup(both, full_accuracy: float | None = None, ax=None,
                             title: str = "Accuracy vs throughput (labels: drop ratio)", label_column: str = "policy"):
    """Accuracy (%) against decode speed-up, one line per `label_column` value, each point labelled with its drop
    ratio; horizontal error bars span the speed-up's min-max over repeats when `both` has them.

    Args:
        both: rows with `drop_ratio`, `accuracy` (fraction), `decode_speedup` and optionally `decode_speedup_min`,
            `decode_speedup_max` (an accuracy table merged with a `throughput_sweep` table).
        full_accuracy: the full cache's accuracy (fraction), drawn as a dashed line.
        ax: matplotlib axes (default: a new figure).

    Returns:
        The axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.8))
    spread = "decode_speedup_min" in both and "decode_speedup_max" in both
    for label, g in both.groupby(label_column, sort=False):
        xerr = [g.decode_speedup - g.decode_speedup_min, g.decode_speedup_max - g.decode_speedup] if spread else None
        ax.errorbar(g.decode_speedup, 100 * g.accuracy, xerr=xerr, marker="o", capsize=3, label=label)
        for _, row in g.iterrows():
            ax.annotate(f"{row.drop_ratio:g}", (row.decode_speedup, 100 * row.accuracy), fontsize=7)
    if full_accuracy is not None:
        ax.axhline(100 * full_accuracy, color="k", ls="--", lw=1, label="full cache")
    ax.set_xlabel("decode speed-up vs baseline" + (" (median, min-max)" if spread else ""))
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax
