"""Phase metrics (prefill, modify, decode) -> dicts, JSON and pandas tables; speed-up caveats; plot helpers.

A configuration measured several times (`tdutils.compare(..., repeats=N)`: baseline and every drop function
alternated) gives one table row of medians with the spread: `phase_table` pairs repeat `i` of every run with
repeat `i` of the baseline, so each ratio compares runs measured back to back. `speedup_notes` says when a ratio
does not measure what dropping buys, and which case it is: the machine was busy (repeats disagree by more than
`SPREAD_THRESHOLD`), no larger batch, slower despite a larger batch, above the capacity limit.

Units: seconds for times, tokens per second for throughputs, tokens for sizes. TTFT (time to first
token) is measured per request from the start of the prefill phase; TPOT (time per output token) per
request over its decode tokens after the first.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


def duration_text(seconds: float) -> str:
    """A wall time as people read it: `"45 s"` under a minute (`"under 1 s"` below one second), else `"3.2 min"`."""
    if seconds < 1:
        return "under 1 s"
    return f"{seconds:.0f} s" if seconds < 59.5 else f"{seconds / 60:.1f} min"


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`"1 prompt"`, `"2 prompts"`: a count with its noun; `many` is the plural form (default: `noun + "s"`)."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"


def _quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default); NaN for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class PrefillMetrics:
    """Prefill phase: prompt tokens processed, wall seconds, and TTFT (s) of each request.

    `peak_cache_tokens` is the largest KV cache each request held during prefill (its prompt length, or at most
    `budget + chunk` under chunked prefill with a budget); `cuts` / `cut_seconds` count the cuts to the budget
    made during prefill and their time (included in `seconds`).
    """

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    peak_cache_tokens: list[int] = field(default_factory=list)
    cuts: int = 0
    cut_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class ModifyMetrics:
    """Modify phase: drop-function seconds, KV tokens before and after, requests edited / failed."""

    seconds: float = 0.0
    tokens_before: int = 0
    tokens_after: int = 0
    edited: int = 0
    failed: int = 0

    @property
    def kept_fraction(self) -> float:
        return self.tokens_after / self.tokens_before if self.tokens_before else float("nan")


@dataclass
class DecodeMetrics:
    """Decode phase: output tokens, wall seconds, TPOT (s) per request, peak batch size, KV budget.

    `kv_peak_reserved_tokens` is the largest sum, over the running batch, of each request's reservation:
    its cache length plus the tokens it may generate (all of `max_tokens` with `ignore_eos=True`; with EOS
    honoured, what it has been granted so far, in blocks): the quantity admission keeps under `kv_budget_tokens`.
    `kv_storage_tokens` / `kv_storage_bytes` are the hf engine's decode storage at its largest (slots x width,
    `tdutils.engines.kvstore`); storage beyond `kv_peak_reserved_tokens` is padding. `preemptions` counts the
    requests moved out of the batch (and resumed later, unchanged) so that another one's next block fits.
    With decode-time compression, `compressions` counts the cuts back to the budget and `compress_seconds` their
    time (included in `seconds`); `kv_peak_cache_tokens` is the longest cache a request attended over.
    """

    output_tokens: int = 0
    seconds: float = 0.0
    tpot_s: list[float] = field(default_factory=list)
    peak_batch_size: int = 0
    kv_budget_tokens: int | None = None
    kv_peak_reserved_tokens: int = 0
    steps: int = 0
    kv_storage_tokens: int = 0
    kv_storage_bytes: int = 0
    preemptions: int = 0
    compressions: int = 0
    compress_seconds: float = 0.0
    kv_peak_cache_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class RunMetrics:
    """All phases of one run (one configuration: baseline or a drop function)."""

    name: str
    prefill: PrefillMetrics = field(default_factory=PrefillMetrics)
    modify: ModifyMetrics = field(default_factory=ModifyMetrics)
    decode: DecodeMetrics = field(default_factory=DecodeMetrics)

    def summary(self) -> dict:
        """Flat dict of the headline figures (one table row)."""
        p, m, d = self.prefill, self.modify, self.decode
        return {
            "run": self.name,
            "requests": p.requests,
            "prompt_tokens": p.tokens,
            "prefill_s": p.seconds,
            "prefill_tok_s": p.tokens_per_s,
            "ttft_mean_s": statistics.fmean(p.ttft_s) if p.ttft_s else float("nan"),
            "modify_s": m.seconds,
            "kept_fraction": m.kept_fraction if m.tokens_before else 1.0,
            "kv_tokens_after": m.tokens_after if m.tokens_before else p.tokens,
            "decode_tokens": d.output_tokens,
            "decode_s": d.seconds,
            "decode_tok_s": d.tokens_per_s,
            "tpot_mean_s": statistics.fmean(d.tpot_s) if d.tpot_s else float("nan"),
            "tpot_p50_s": _quantile(d.tpot_s, 0.5),
            "tpot_p90_s": _quantile(d.tpot_s, 0.9),
            "peak_batch": d.peak_batch_size,
            "kv_budget_tokens": d.kv_budget_tokens,
            "kv_peak_reserved_tokens": d.kv_peak_reserved_tokens,
            "end_to_end_s": p.seconds + m.seconds + d.seconds,
        }

    def to_dict(self) -> dict:
        """Everything, JSON-serialisable (per-request lists included)."""
        out = {"name": self.name, "summary": self.summary()}
        for phase in ("prefill", "modify", "decode"):
            out[phase] = asdict(getattr(self, phase))
        return out


SPREAD_THRESHOLD = 0.2
"""Widest trustworthy spread of a decode-throughput ratio over repeats, as a fraction of its median:
`(max − min) / median` of the per-repeat ratios. Each repeat runs the baseline and the dropped configuration back
to back, so load that hits both alike cancels in their ratio; repeats that disagree by more than this mean the
load changed within a repeat, and the median is a guess. For scale: on a quiet 2-core machine docs/results.md's three
repeats of `python -m tdutils run` gave 1.98–2.13× (SnapKV) and 1.82–1.97× (random), spreads of 7–8%; with a
dozen other processes on the same 2 cores, `run --num-requests 8 --max-tokens 16` gave 2.39×, 9.12× and 19.72×."""

CAPACITY_TOLERANCE = 0.05
"""How far (as a fraction) a ratio may exceed the capacity limit before it is flagged: dropping may make each
decode step a little cheaper (shorter caches to attend over), so a ratio a hair above the limit is no error."""

# Kinds of speed-up caveats (the first words of each note), see `ratio_caveats`.
NO_LARGER_BATCH = "no larger batch"
SLOWER = "slower despite a larger batch"
ABOVE_LIMIT = "above the capacity limit"
BUSY = "machine busy"


def _median(xs):
    """Median of a list; an integer stays an integer when the median is one (peak batch, token counts)."""
    m = statistics.median(xs)
    return int(m) if all(isinstance(x, int) for x in xs) and float(m).is_integer() else m


def _as_repeats(item) -> list[RunMetrics]:
    """One run's repeats: a RunMetrics / RunResult, or a list of them, or a RunResult of `compare` (`.repeats`)."""
    if isinstance(item, list | tuple):
        return [getattr(r, "metrics", r) for r in item]
    reps = getattr(item, "repeats", None)
    return list(reps) if reps else [getattr(item, "metrics", item)]


def repeat_ratios(baseline, run) -> list[float]:
    """Per-repeat decode-throughput ratios: repeat `i` of `run` over repeat `i` of `baseline` (tok/s / tok/s).

    Args:
        baseline, run: lists of `RunMetrics` in repeat order (or anything `phase_table` accepts as one run).

    Raises:
        ValueError: the two runs have different numbers of repeats.
    """
    base, mine = _as_repeats(baseline), _as_repeats(run)
    if len(base) != len(mine):
        raise ValueError(f"run {mine[0].name!r} has {len(mine)} repeats and the baseline {len(base)}: ratios pair "
                         "repeat i of each run with repeat i of the baseline, so give both the same repeats")
    return [m.decode.tokens_per_s / b.decode.tokens_per_s for b, m in zip(base, mine)]


def phase_table(runs, baseline: str | None = None):
    """pandas DataFrame with one row per run: medians over repeats and the decode-throughput ratio with its spread.

    Args:
        runs: iterable of runs; each a `RunMetrics` (or an object with `.metrics`, such as a `RunResult`) for a
            single measurement, or a list of them — its repeats, in order, repeat `i` of every run measured next
            to repeat `i` of the baseline (what `tdutils.compare(..., repeats=N)` does). A `RunResult` of
            `compare` carries its repeats in `.repeats`.
        baseline: name of the reference run; default the first run.

    Returns:
        Index `run`; every column of `RunMetrics.summary()` as the median over the run's repeats (seconds, tok/s,
        token counts, peak batch), and: `repeats`; `decode_tok_s_min`, `decode_tok_s_max` (tok/s); `decode_speedup`
        (median over repeats of decode tok/s / the same repeat's baseline decode tok/s; 1.0 for the baseline),
        `decode_speedup_min`, `decode_speedup_max`; `capacity_limit` (`1 / kept_fraction`: at a fixed KV budget,
        at most that many times as many requests fit the decode batch).

    Raises:
        ValueError: a run has a different number of repeats than the baseline.
    """
    import pandas as pd

    reps = {}
    for item in runs:
        r = _as_repeats(item)
        reps[r[0].name] = r
    rows = []
    for name, r in reps.items():
        summaries = [m.summary() for m in r]
        row = {k: (v if not isinstance(v, int | float) or v is None else _median([s[k] for s in summaries]))
               for k, v in summaries[0].items()}
        row["run"] = name
        tps = [s["decode_tok_s"] for s in summaries]
        row.update(repeats=len(r), decode_tok_s_min=min(tps), decode_tok_s_max=max(tps))
        rows.append(row)
    df = pd.DataFrame(rows).set_index("run") if rows else pd.DataFrame()
    if len(df):
        base = baseline or df.index[0]
        if base not in reps:
            raise ValueError(f"baseline {base!r} is not one of the runs {list(reps)}")
        spread = [median_min_max(repeat_ratios(reps[base], reps[name])) for name in df.index]
        df["decode_speedup"] = [s[0] for s in spread]
        df["decode_speedup_min"] = [s[1] for s in spread]
        df["decode_speedup_max"] = [s[2] for s in spread]
        df["capacity_limit"] = 1.0 / df["kept_fraction"]
    return df


def median_min_max(xs) -> tuple[float, float, float]:
    """(median, min, max) of a non-empty sequence of numbers (the spread of a figure over repeats)."""
    xs = list(xs)
    return statistics.median(xs), min(xs), max(xs)


def capacity_limit(drop_ratio: float) -> float:
    """The decode speed-up ceiling `1/(1 − r)` at drop ratio `r` in [0, 1]; `inf` at `r = 1` (no tokens kept
    but the protected ones, so any number of requests would fit the budget)."""
    r = float(drop_ratio)
    return 1.0 / (1.0 - r) if r < 1 else float("inf")


def speedup_line(table, name: str, baseline: str = "baseline") -> str:
    """One line for a headline ratio: `decode throughput ratio (NAME / baseline): 1.95x (median of 3 repeats;
    min 1.90x, max 2.01x)`, from a `phase_table` / `compare` / `throughput_sweep` table."""
    row = table.loc[name]
    line = f"decode throughput ratio ({name} / {baseline}): {row['decode_speedup']:.2f}x"
    n = int(row.get("repeats", 1))
    if n > 1:
        line += f" (median of {n} repeats; min {row['decode_speedup_min']:.2f}x, max {row['decode_speedup_max']:.2f}x)"
    return line


def _caveats(base_batch, dropped_batch, ratio, limit, ratio_min, ratio_max, repeats) -> list[tuple[str, str]]:
    """(kind, sentence) pairs, see `ratio_caveats`."""
    notes = []
    if repeats > 1 and ratio_min is not None and ratio_max is not None and ratio > 0:
        width = (ratio_max - ratio_min) / ratio
        if width > SPREAD_THRESHOLD:
            notes.append((BUSY, f"the {repeats} repeats gave ratios from {ratio_min:.2f}x to {ratio_max:.2f}x, a spread "
                                f"of {width:.0%} of the median {ratio:.2f}x (more than {SPREAD_THRESHOLD:.0%}): the "
                                "machine was busy; rerun or raise repeats"))
    if dropped_batch <= base_batch:
        notes.append((NO_LARGER_BATCH, f"both runs decoded at most {plural(base_batch, 'request')} at a time, so dropping bought "
                                       "no larger batch and the ratio only reflects cheaper steps and machine noise; use "
                                       "more requests or a smaller KV budget"))
    elif ratio < 1:
        notes.append((SLOWER, f"the batch grew ({base_batch} -> {dropped_batch} requests at a time) yet decoding was "
                              f"slower ({ratio:.2f}x): either another job took the CPU during the dropped runs (rerun "
                              "or raise repeats), or a decode step here costs in proportion to its batch (compute-bound), "
                              "so a larger batch buys nothing"))
    ceiling = max(limit, dropped_batch / max(base_batch, 1))
    if ratio > (1 + CAPACITY_TOLERANCE) * ceiling:
        notes.append((ABOVE_LIMIT, f"{ratio:.2f}x exceeds the capacity limit 1/(1-r) = {limit:.2f}x"
                                   + (f" and the batch growth {base_batch} -> {dropped_batch}" if ceiling > limit else "")
                                   + ": at most that many more requests fit the KV budget, so the rest "
                                   "comes from cheaper steps over shorter caches or, more likely on a busy machine, from "
                                   "noise (the baseline ran while the machine was busier); rerun or raise repeats"))
    return notes


def ratio_caveats(base_batch: int, dropped_batch: int, ratio: float, drop_ratio: float, *,
                  ratio_min: float | None = None, ratio_max: float | None = None, repeats: int = 1) -> list[str]:
    """Why a decode-throughput ratio may not measure what token dropping buys (empty list when it does).

    Args:
        base_batch, dropped_batch: peak decode batch sizes of the baseline and the dropped run.
        ratio: dropped decode tok/s / baseline decode tok/s (the median over repeats).
        drop_ratio: the fraction dropped (capacity limit `1/(1 - r)`).
        ratio_min, ratio_max, repeats: the spread of the per-repeat ratios and the number of repeats.

    Returns:
        Sentences (no "note:" prefix), each starting with its kind: `machine busy:` (the repeats' ratios span more
        than `SPREAD_THRESHOLD` of their median), `no larger batch:` (the batch did not grow), `slower despite a
        larger batch:` (the batch grew, the ratio is below 1), `above the capacity limit:` (the ratio exceeds
        `1/(1 - r)` and the batch growth by more than `CAPACITY_TOLERANCE`).
    """
    limit = capacity_limit(drop_ratio)
    return [f"{kind}: {text}" for kind, text in
            _caveats(base_batch, dropped_batch, ratio, limit, ratio_min, ratio_max, repeats)]


def speedup_caveats(table, baseline: str = "baseline") -> list[tuple[str, str, str]]:
    """`(run, kind, sentence)` for every caveat of every dropped run of a table (see `speedup_notes`)."""
    base = int(table.loc[baseline, "peak_batch"])
    out = []
    for run, row in table.iterrows():
        if run == baseline:
            continue
        limit = float(row["capacity_limit"]) if "capacity_limit" in row else 1.0 / float(row["kept_fraction"])
        ratio = float(row["decode_speedup"])
        lo, hi = (float(row["decode_speedup_min"]), float(row["decode_speedup_max"])) \
            if "decode_speedup_min" in row else (ratio, ratio)
        for kind, text in _caveats(base, int(row["peak_batch"]), ratio, limit, lo, hi, int(row.get("repeats", 1))):
            out.append((str(run), kind, text))
    return out


def speedup_notes(table, baseline: str = "baseline") -> list[str]:
    """Caveats on every dropped run of a table (`tdutils.compare`, `phase_table`, `throughput_sweep`).

    Reads `peak_batch`, `decode_speedup`, `capacity_limit` (or `kept_fraction`: limit `1 / kept_fraction`) and,
    when present, `decode_speedup_min`, `decode_speedup_max` and `repeats`. Each note is `RUN: KIND: sentence`,
    KIND one of `machine busy`, `no larger batch`, `slower despite a larger batch`, `above the capacity limit`
    (see `ratio_caveats`).
    """
    return [f"{run}: {kind}: {text}" for run, kind, text in speedup_caveats(table, baseline)]


def plot_decode_throughput(table, ax=None, title: str = "Decode throughput", baseline: str | None = None):
    """Bar chart of the median decode tok/s per run, with the spread over repeats and the capacity limit.

    Each bar is the median (`decode_tok_s`); its error bar spans `decode_tok_s_min`..`decode_tok_s_max` over the
    repeats; its label is the median ratio to the baseline with the per-repeat range below it, and above it in red
    the kind of any caveat (`speedup_caveats`: machine busy, no larger batch, ...); a dashed line over each dropped run marks the capacity limit, the
    baseline's tok/s × `capacity_limit`.

    Args:
        table: a `phase_table` / `tdutils.compare` table.
        ax: matplotlib axes (default: a new figure).
        baseline: the reference run (default: the first row).

    Returns:
        The axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(table)), 3.6))
    base = baseline or table.index[0]
    names = [str(i) for i in table.index]
    tps = table["decode_tok_s"]
    lo = table["decode_tok_s_min"] if "decode_tok_s_min" in table else tps
    hi = table["decode_tok_s_max"] if "decode_tok_s_max" in table else tps
    repeats = int(table["repeats"].max()) if "repeats" in table else 1
    colors = ["#888888" if n == str(base) else "#2b7bba" for n in names]
    bars = ax.bar(names, tps, color=colors, yerr=[tps - lo, hi - tps], capsize=4, ecolor="black",
                  label=f"median of {repeats} repeats, min-max" if repeats > 1 else None)
    kinds: dict[str, list[str]] = {}
    if "peak_batch" in table and base in table.index and len(table) > 1:
        for run, kind, _ in speedup_caveats(table, base):
            kinds.setdefault(run, []).append(kind)
    base_tps = float(tps.loc[base])
    drew_limit = False
    for bar, (run, row) in zip(bars, table.iterrows()):
        x, w = bar.get_x(), bar.get_width()
        label = f"{row['decode_speedup']:.2f}x"
        if repeats > 1 and run != base:
            label += f"\n{row['decode_speedup_min']:.2f}-{row['decode_speedup_max']:.2f}"
        top = max(float(hi.loc[run]), float(tps.loc[run]))
        ax.annotate(label, (x + w / 2, top), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")
        if run != base and "capacity_limit" in row and row["capacity_limit"] < float("inf"):
            ax.hlines(base_tps * row["capacity_limit"], x - 0.08 * w, x + 1.08 * w, colors="black", linestyles="--",
                      lw=1, label=None if drew_limit else "capacity limit (baseline x 1/kept fraction)")
            drew_limit = True
        if kinds.get(str(run)):
            ax.annotate("\n".join(kinds[str(run)]), (x + w / 2, top), ha="center", va="bottom", fontsize=7,
                        color="#c0392b", xytext=(0, 24 if repeats > 1 and run != base else 14), textcoords="offset points")
    ax.margins(y=0.35 if kinds else 0.22)
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    if repeats > 1 or drew_limit:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    return ax
