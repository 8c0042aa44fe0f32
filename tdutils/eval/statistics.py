"""Paired statistics of eval cells: every cell runs on the same prompts as the full cache, so two cells differ
prompt by prompt, and a paired test resolves far smaller differences than two per-cell intervals at the same n.

- Binary scores (exact match): the exact McNemar test, a two-sided binomial test on the discordant pairs
  (`scipy.stats.binomtest(b, b + c, 0.5)`; McNemar 1947, the exact form of Fay 2010, "Two-sided exact tests and
  matching confidence intervals for discordant pairs").
- Continuous scores (partial credit, KL, perplexity change, greedy agreement): the paired bootstrap 95% interval of
  the mean difference (`scipy.stats.bootstrap` on the per-prompt differences, percentile method, seeded) and the
  sign-flip permutation test of the mean difference (`scipy.stats.permutation_test`, `permutation_type="samples"`;
  exact when n <= 12, else seeded random sign flips).
- Many pairs at once (`pairwise_tests`, `rank_policies`): Holm's step-down correction (Holm 1979) holds the
  family-wise error rate at `alpha` (`ALPHA`, 0.05) across every pair of one mode.

A `MEASURES` entry says whether a measure is binary and which direction is better. Each `task_eval` row keeps its
per-prompt scores in `scores` (`{measure: [one float per prompt]}`), in the order of the task's examples, so any
paired test can be recomputed from a stored run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .common import FULL

ALPHA = 0.05  # the family-wise error rate of a ranking (Holm-corrected across the pairs of one mode)
CONFIDENCE = 0.95
N_RESAMPLES = 9999
SEED = 0  # bootstrap and permutation draws: the same table gives the same intervals


@dataclass(frozen=True)
class Measure:
    """A per-prompt score: `binary` (0/1, McNemar) or continuous (bootstrap), and its better direction."""

    name: str
    binary: bool
    higher_is_better: bool
    about: str


MEASURES = {m.name: m for m in (
    Measure("exact", True, True, "exact match (every reference in the answer), 0 or 1"),
    Measure("partial", False, True, "fraction of the references found in the answer (RULER string_match_all)"),
    Measure("kl", False, False, "mean KL(full || edited) per continuation token, nats"),
    Measure("delta_ppl", False, False, "perplexity of the continuation, edited minus full cache"),
    Measure("agreement", False, True, "fraction of continuation tokens whose argmax is the full cache's"),
)}


def get_measure(name: str) -> Measure:
    """The `Measure` called `name`. Raises ValueError for an unknown name (the message lists the known ones)."""
    if name not in MEASURES:
        raise ValueError(f"unknown measure {name!r}; known measures are {', '.join(MEASURES)}")
    return MEASURES[name]


@dataclass(frozen=True)
class PairedResult:
    """One paired comparison of cell `x` against cell `y` on the same prompts.

    Attributes:
        n: prompts compared.
        mean_x, mean_y: the two cells' mean scores.
        diff: `mean_x - mean_y` (the mean per-prompt difference).
        ci_low, ci_high: paired bootstrap 95% interval of `diff` (percentile method; both `diff` when every
            difference is the same).
        p_value: two-sided: exact McNemar (binary) or the sign-flip permutation test (continuous).
        b, c: binary only: prompts where only `x` scores 1 (b) and only `y` (c), the discordant pairs; else None.
        test: the test's name.
    """

    n: int
    mean_x: float
    mean_y: float
    diff: float
    ci_low: float
    ci_high: float
    p_value: float
    b: int | None
    c: int | None
    test: str


def mcnemar_exact(x: Sequence[float], y: Sequence[float]) -> tuple[int, int, float]:
    """Exact McNemar test of two paired binary score lists: `(b, c, p)`, `b` the prompts only `x` gets right, `c`
    those only `y` gets right, `p` the two-sided `scipy.stats.binomtest(b, b + c, 0.5)` p-value (1.0 when there is
    no discordant pair). E.g. b = 0, c = 5 gives p = 2 * 0.5**5 = 0.0625.

    Raises:
        ValueError: lists of different lengths, or a score other than 0 or 1.
    """
    from scipy.stats import binomtest

    xs, ys = _paired(x, y)
    if any(v not in (0.0, 1.0) for v in (*xs, *ys)):
        raise ValueError("mcnemar_exact needs binary scores (0 or 1); use paired_bootstrap for continuous ones")
    b = sum(1 for u, v in zip(xs, ys) if u > v)
    c = sum(1 for u, v in zip(xs, ys) if u < v)
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)
    return b, c, min(p, 1.0)


def paired_bootstrap(x: Sequence[float], y: Sequence[float], *, confidence: float = CONFIDENCE,
                     n_resamples: int = N_RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """`(mean difference, low, high)`: the mean of `x - y` over paired prompts and its bootstrap interval
    (`scipy.stats.bootstrap` on the differences, percentile method, `n_resamples` draws seeded with `seed`).
    A constant difference (all prompts differ by the same amount, e.g. all 0) gives `(d, d, d)`.

    Raises:
        ValueError: lists of different lengths or empty.
    """
    import numpy as np
    from scipy.stats import bootstrap

    xs, ys = _paired(x, y)
    d = np.asarray(xs, dtype=float) - np.asarray(ys, dtype=float)
    mean = float(d.mean())
    if np.all(d == d[0]):
        return mean, mean, mean
    res = bootstrap((d,), np.mean, confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                    random_state=np.random.default_rng(seed))
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


def sign_flip_test(x: Sequence[float], y: Sequence[float], *, n_resamples: int = N_RESAMPLES,
                   seed: int = SEED) -> float:
    """Two-sided p-value that the mean of `x - y` is 0: the paired permutation test that flips the sign of each
    prompt's difference (`scipy.stats.permutation_test`, `permutation_type="samples"`; exact for n <= 12 prompts
    whose 2**n flips fit `n_resamples`). 1.0 when every difference is 0, and for one prompt (its two flips, d and
    -d, are both as far from 0: scipy's test needs two).

    Raises:
        ValueError: lists of different lengths or empty.
    """
    import numpy as np
    from scipy.stats import permutation_test

    xs, ys = _paired(x, y)
    d = np.asarray(xs, dtype=float) - np.asarray(ys, dtype=float)
    if np.all(d == 0) or len(d) == 1:
        return 1.0
    res = permutation_test((d,), np.mean, permutation_type="samples", n_resamples=n_resamples,
                           alternative="two-sided", random_state=np.random.default_rng(seed))
    return float(min(res.pvalue, 1.0))


def paired_test(x: Sequence[float], y: Sequence[float], measure: str | Measure = "exact", *,
                seed: int = SEED) -> PairedResult:
    """Compare cell `x` with cell `y` on the same prompts (`x[i]` and `y[i]` score the same prompt): the mean
    difference with its paired bootstrap 95% interval, and the exact McNemar p-value (binary `measure`) or the
    sign-flip permutation p-value (continuous).

    Raises:
        ValueError: lists of different lengths or empty, an unknown measure, non-binary scores for a binary one.
    """
    m = measure if isinstance(measure, Measure) else get_measure(measure)
    xs, ys = _paired(x, y)
    diff, low, high = paired_bootstrap(xs, ys, seed=seed)
    if m.binary:
        b, c, p = mcnemar_exact(xs, ys)
        test = "exact McNemar"
    else:
        b = c = None
        p = sign_flip_test(xs, ys, seed=seed)
        test = "sign-flip permutation"
    return PairedResult(len(xs), sum(xs) / len(xs), sum(ys) / len(ys), diff, low, high, p, b, c, test)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979, "A simple sequentially rejective multiple test procedure"),
    in the input order: rejecting where the adjusted p-value is below `alpha` holds the family-wise error rate at
    `alpha` across all the tests. (scipy has no Holm correction; `scipy.stats.false_discovery_control` controls
    the false discovery rate instead.)"""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    m, running, out = len(p_values), 0.0, [0.0] * len(p_values)
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * float(p_values[i])))
        out[i] = running
    return out


def has_scores(table) -> bool:
    """Whether a `task_eval` table keeps per-prompt scores in every row (runs stored before they did, do not)."""
    return "scores" in table.columns and bool(len(table)) and all(isinstance(s, Mapping) and s for s in table["scores"])


def pooled_scores(rows, measure: str) -> list[float]:
    """The per-prompt scores of `measure` of several rows (cells of one policy on several tasks or lengths),
    concatenated in row order. Raises ValueError when a row has no such scores."""
    out: list[float] = []
    for r in rows.itertuples():
        scores = r.scores if isinstance(r.scores, Mapping) else {}
        if measure not in scores:
            raise ValueError(f"row {r.task} / {r.mode} / {r.policy} @ {r.drop_ratio:g} has no per-prompt {measure!r} "
                             f"scores (it has {sorted(scores)})")
        out += [float(v) for v in scores[measure]]
    return out


def paired_differences(table, measure: str | None = None, *, reference: str | None = None,
                       seed: int = SEED):
    """Every cell against the full cache on the same prompts: per (task, mode, context length, policy, ratio), the
    paired difference of `measure` (cell minus full cache) with its bootstrap 95% interval and p-value.

    Args:
        table: a `task_eval` table (or its JSON's rows as a DataFrame) with per-prompt `scores`.
        measure: the measure compared; None: each row's own `measure` (exact match for rows without one).
        reference: the policy compared against (default the full cache).

    Returns:
        pandas DataFrame, one row per cell other than the reference, columns `task`, `mode`, `context_length`,
        `policy`, `drop_ratio`, `measure`, `n`, `score`, `reference_score`, `diff`, `ci_low`, `ci_high`, `p_value`,
        `b`, `c` (discordant pairs, binary only), `test`.

    Raises:
        ValueError: the table keeps no per-prompt scores (a run stored before they were kept), or has no
            reference row for a cell's task, mode and length.
    """
    import pandas as pd

    reference = reference or FULL
    if not has_scores(table):
        raise ValueError("this table keeps no per-prompt scores (a run stored before tdutils kept them), so no "
                         "paired test can be computed; rerun it to get them")
    out = []
    for (task, mode, length), g in table.groupby(["task", "mode", "context_length"], sort=False):
        ref = g[g["policy"] == reference]
        if ref.empty:
            raise ValueError(f"no {reference!r} row for {task} / {mode} / {length} tokens to pair the cells with")
        for r in g[g["policy"] != reference].itertuples():
            name = measure or getattr(r, "measure", None) or "exact"
            res = paired_test(pooled_scores(g.loc[[r.Index]], name), pooled_scores(ref, name), name, seed=seed)
            out.append({"task": task, "mode": mode, "context_length": int(length), "policy": r.policy,
                        "drop_ratio": float(r.drop_ratio), "measure": name, "n": res.n, "score": res.mean_x,
                        "reference_score": res.mean_y, "diff": res.diff, "ci_low": res.ci_low, "ci_high": res.ci_high,
                        "p_value": res.p_value, "b": res.b, "c": res.c, "test": res.test})
    return pd.DataFrame(out)


def pairwise_tests(pooled: Mapping[str, Sequence[float]], measure: str | Measure, *, alpha: float = ALPHA,
                   seed: int = SEED):
    """Every pair of cells of `pooled` (`{name: per-prompt scores}`, all on the same prompts) tested against each
    other, with Holm-adjusted p-values across the pairs.

    Returns:
        pandas DataFrame, one row per unordered pair `(a, b)` in the order of `pooled`: `a`, `b`, `n`, `mean_a`,
        `mean_b`, `diff` (a - b), `ci_low`, `ci_high`, `p_value`, `p_holm`, `separated` (`p_holm < alpha`) and
        `better` (the name of the better cell where separated, else "").
    """
    import pandas as pd

    m = measure if isinstance(measure, Measure) else get_measure(measure)
    names = list(pooled)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            res = paired_test(pooled[a], pooled[b], m, seed=seed)
            rows.append({"a": a, "b": b, "n": res.n, "mean_a": res.mean_x, "mean_b": res.mean_y, "diff": res.diff,
                         "ci_low": res.ci_low, "ci_high": res.ci_high, "p_value": res.p_value})
    out = pd.DataFrame(rows, columns=["a", "b", "n", "mean_a", "mean_b", "diff", "ci_low", "ci_high", "p_value"])
    out["p_holm"] = holm(list(out["p_value"]))
    out["separated"] = out["p_holm"] < alpha
    better_a = (out["diff"] > 0) == m.higher_is_better
    out["better"] = [(a if ba else b) if sep else "" for a, b, ba, sep in
                     zip(out["a"], out["b"], better_a, out["separated"])]
    return out


def _paired(x, y) -> tuple[list[float], list[float]]:
    xs, ys = [float(v) for v in x], [float(v) for v in y]
    if len(xs) != len(ys):
        raise ValueError(f"paired scores need the same prompts on both sides, got {len(xs)} and {len(ys)} scores")
    if not xs:
        raise ValueError("paired scores need at least one prompt")
    if any(math.isnan(v) for v in (*xs, *ys)):
        raise ValueError("paired scores must not be NaN")
    return xs, ys


__all__ = ["ALPHA", "MEASURES", "Measure", "PairedResult", "get_measure", "has_scores", "holm", "mcnemar_exact",
           "paired_bootstrap", "paired_differences", "paired_test", "pairwise_tests", "pooled_scores",
           "sign_flip_test"]
