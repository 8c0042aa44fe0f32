"""Phase metrics (prefill, modify, decode) -> dicts, JSON and pandas tables; plot helpers.

Units: seconds for times, tokens per second for throughputs, tokens for sizes. TTFT (time to first
token) is measured per request from the start of the prefill phase; TPOT (time per output token) per
request over its decode tokens after the first.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


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
    """Prefill phase: prompt tokens processed, wall seconds, and TTFT (s) of each request."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)

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

    `kv_peak_reserved_tokens` is the largest sum, over the running batch, of each request's cache length
    plus the tokens it still had to generate: the quantity admission keeps under `kv_budget_tokens`.
    `kv_storage_tokens` / `kv_storage_bytes` are what the hf engine preallocated for the decode batch (slots x
    width, `tdutils.engines.kvstore`); storage beyond `kv_peak_reserved_tokens` is padding.
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


def phase_table(runs, baseline: str | None = None):
    """pandas DataFrame with one row per run and a `decode_speedup` column relative to `baseline`.

    Args:
        runs: iterable of `RunMetrics` (or objects with a `.metrics` RunMetrics).
        baseline: name of the reference run; default the first run.
    """
    import pandas as pd

    rows = [getattr(r, "metrics", r).summary() for r in runs]
    df = pd.DataFrame(rows).set_index("run")
    if len(df):
        base = baseline or df.index[0]
        df["decode_speedup"] = df["decode_tok_s"] / df.loc[base, "decode_tok_s"]
    return df


def plot_decode_throughput(table, ax=None, title: str = "Decode throughput"):
    """Bar chart of `decode_tok_s` per run, each bar labelled with its ratio to the first run."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.2))
    names = [str(i) for i in table.index]
    bars = ax.bar(names, table["decode_tok_s"], color=["#888888"] + ["#2b7bba"] * (len(names) - 1))
    for bar, ratio in zip(bars, table["decode_speedup"]):
        ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    return ax


def ratio_caveats(base_batch: int, dropped_batch: int, ratio: float, drop_ratio: float) -> list[str]:
    """Why a decode-throughput ratio may not measure what token dropping buys (empty list when it does).

    Args:
        base_batch, dropped_batch: peak decode batch sizes of the baseline and the dropped run.
        ratio: dropped decode tok/s / baseline decode tok/s.
        drop_ratio: the fraction dropped (capacity limit `1/(1 - r)`).

    Returns:
        Sentences (no "note:" prefix): the batch did not grow, or the ratio exceeds what the batch sizes and
        the capacity limit explain by more than 25% (machine noise on short runs).
    """
    notes = []
    if dropped_batch <= base_batch:
        notes.append(f"both runs decoded at most {base_batch} requests at a time, so dropping bought no larger batch "
                     "and the ratio only reflects cheaper steps and machine noise; use more requests or a smaller KV "
                     "budget")
    limit = 1 / (1 - drop_ratio) if drop_ratio < 1 else float("inf")
    if ratio > 1.25 * max(limit, dropped_batch / max(base_batch, 1)):
        notes.append(f"the ratio is above what the batch sizes ({base_batch} -> {dropped_batch}) and the capacity limit "
                     f"1/(1-r) = {limit:.2f} explain: runs this short are dominated by machine noise; repeat it on a "
                     "quiet machine (run --repeats 5, bench/throughput.py)")
    return notes


def speedup_notes(table, baseline: str = "baseline") -> list[str]:
    """`ratio_caveats` for every dropped run of a phase table (`tdutils.compare`, `throughput_sweep`).

    Reads `peak_batch`, `decode_speedup` and `kept_fraction` (drop ratio = 1 - kept fraction); each note
    starts with the run's name.
    """
    base = int(table.loc[baseline, "peak_batch"])
    return [f"{run}: {line}" for run, row in table.iterrows() if run != baseline
            for line in ratio_caveats(base, int(row["peak_batch"]), float(row["decode_speedup"]),
                                      1.0 - float(row["kept_fraction"]))]
