"""Runs over an open engine: one configuration (`run_once`), a baseline against drop functions measured
alternately (`alternate_runs`, `compare`), and the default KV budget (`default_kv_budget`).

`compare` runs a baseline and one or more drop functions on the same prompts, alternately (`repeats` rounds of
baseline, fn1, fn2, ...), so that load from other work on the machine hits every configuration alike; the
ratios are taken per repeat, against the baseline of the same repeat. `tdutils.sweep` builds on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .edit import as_drop_fn
from .metrics import RunMetrics, phase_table

if TYPE_CHECKING:
    from .engines.base import RequestOutput


@dataclass
class RunResult:
    """Outputs and metrics of one configuration.

    Attributes:
        name: the configuration ("baseline" or the drop function's name in `compare`).
        outputs: one `RequestOutput` per request (of the last repeat: greedy outputs are the same every repeat).
        metrics: the `RunMetrics` of the last repeat.
        repeats: the `RunMetrics` of every repeat, in order (`compare`); empty for a single `run_once`.
    """

    name: str
    outputs: list[RequestOutput]
    metrics: RunMetrics
    repeats: list[RunMetrics] = field(default_factory=list)

    @property
    def texts(self) -> list[str]:
        return [o.text for o in self.outputs]


DEFAULT_FULL_REQUESTS = 4.25  # the default KV budget, in undropped requests


def default_kv_budget(prompt_lengths, max_tokens: int, full_requests: float = DEFAULT_FULL_REQUESTS) -> int:
    """A KV budget (tokens) of `full_requests` undropped requests: `ceil(full_requests * (max T + max_tokens))`.

    The default 4.25 decodes 4 undropped requests at a time (the baseline), and leaves room for 8 requests
    at drop ratio 0.5: each keeps `T/2` cache tokens but still needs its `max_tokens` decode tokens, which
    dropping does not shrink, so at exactly 4 only 7 would fit and the 2x capacity limit `1/(1 - r)` could
    not be reached (for T = 1024, max_tokens = 64: 8 x 576 = 4608 <= 4624 < 5 x 1088).

    Raises:
        ValueError: `full_requests < 1`.
    """
    if full_requests < 1:
        raise ValueError(f"full_requests must be >= 1 (the budget must hold one undropped request), got {full_requests}")
    lengths = list(prompt_lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"prompt_lengths must be positive token counts of at least one prompt, got {lengths[:8]}")
    if int(max_tokens) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return math.ceil(full_requests * (max(lengths) + int(max_tokens)))


def run_once(engine, prompts, *, name: str = "baseline", drop_fn=None, max_tokens: int = 64, **decode_kwargs) -> RunResult:
    """Prefill `prompts`, apply `drop_fn` (None: baseline, no modify), decode `max_tokens` per request.

    A drop function that records per-run timings (`DropFn.timed()`) is reset before
    this run's modify, so what it records afterwards describes this run only: reusing it in a second run
    (or `compare`, or a sweep's repeats) never adds that run's timings to the first one's. Before prefill the
    engine widens its query capture to what `drop_fn` needs (`engine.capture_for`).
    """
    if drop_fn is not None and hasattr(engine, "capture_for"):
        engine.capture_for(drop_fn)
    engine.prefill(prompts)
    if drop_fn is not None:
        drop_fn = as_drop_fn(drop_fn)
        drop_fn.reset()
        engine.modify(drop_fn)
    outputs = engine.decode(max_tokens=max_tokens, **decode_kwargs)
    metrics = engine.metrics
    metrics.name = name
    return RunResult(name, outputs, metrics)


def _warmup_tokens(max_tokens):
    """A few decode tokens for an untimed warm-up run (one int, or one per request; checked by the caller)."""
    if not isinstance(max_tokens, Iterable):
        return min(4, int(max_tokens))
    return [min(4, int(m)) for m in list(max_tokens.tolist() if hasattr(max_tokens, "tolist") else max_tokens)[:4]]


def alternate_runs(engine, prompts, drop_fns: dict, *, max_tokens=64, repeats: int = 3, warmup: bool = True,
                   progress=None, **decode_kwargs):
    """Run the baseline and every drop function `repeats` times, alternately: baseline, fn1, fn2, ..., baseline, ...

    Yields `(repeat, name, RunResult, ratio)` as each run finishes, `ratio` being its decode tok/s over the
    baseline's of the same repeat (1.0 for the baseline). Each repeat measures every configuration back to back,
    so load from other work hits them alike and cancels in the ratio; a repeat the load hit unevenly shows up as
    a ratio far from the others.

    Args:
        engine: an open engine (`prefill`, `modify`, `decode`, `metrics`; `tokenize` when it has one).
        prompts: strings, rows or token-id lists (tokenized once).
        drop_fns: name -> drop function; names must be unique and not "baseline".
        max_tokens: decode tokens per request (an int, or one per request).
        repeats: rounds (>= 1).
        warmup: first run the baseline and every drop function once, untimed, on the first 4 prompts with 4 decode
            tokens: a process's first forward passes (allocator, kernels, thread pools) can be many times slower
            and would count against whichever configuration runs first.
        progress: callable taking one line per run (None: silent).
        **decode_kwargs: passed to `engine.decode` (e.g. `ignore_eos=True`).

    Raises:
        ValueError: `repeats` < 1, or a drop function named "baseline".
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1 (rounds of baseline and every drop function), got {repeats!r}")
    if "baseline" in drop_fns:
        raise ValueError("a drop function is named 'baseline', the name of the run without dropping; rename it")
    ids = engine.tokenize(prompts) if hasattr(engine, "tokenize") else prompts
    from .engines.base import check_max_tokens

    check_max_tokens(max_tokens, len(ids))  # before the warm-up reads it: a clear error naming max_tokens
    fns = {"baseline": None, **drop_fns}
    if warmup:
        for name, fn in fns.items():
            run_once(engine, ids[:4], name="warm-up", drop_fn=fn, max_tokens=_warmup_tokens(max_tokens), **decode_kwargs)
    for rep in range(repeats):
        base_tps = None
        for name, fn in fns.items():
            res = run_once(engine, ids, name=name, drop_fn=fn, max_tokens=max_tokens, **decode_kwargs)
            tps = res.metrics.decode.tokens_per_s
            base_tps = tps if fn is None else base_tps
            ratio = tps / base_tps
            if progress:
                d, m = res.metrics.decode, res.metrics.modify
                progress(f"repeat {rep + 1}/{repeats} {name:>24}: decode {tps:9.1f} tok/s, peak batch "
                         f"{d.peak_batch_size}, modify {m.seconds:.3f} s, x{ratio:.2f}")
            yield rep, name, res, ratio


def compare(engine, prompts, drop_fns: dict, *, max_tokens=64, repeats: int = 3, warmup: bool = True, progress=None,
            **decode_kwargs):
    """Run the baseline and each named drop function on the same prompts, alternately, `repeats` times.

    Args:
        engine: an open engine; its `kv_budget_tokens` is the fixed budget every run decodes under.
        prompts: strings, rows or token-id lists.
        drop_fns: name -> drop function (`make_drop_fn`); names must be unique and not "baseline".
        max_tokens: decode tokens per request.
        repeats: rounds of baseline, fn1, fn2, ... (default 3; 1 for a quick look, which shows no spread). See
            `alternate_runs`.
        warmup: an untimed warm-up of every configuration first (see `alternate_runs`).
        progress: callable taking one line per run (e.g. `print`), or None.
        **decode_kwargs: passed to `engine.decode`.

    Returns:
        `(results, table)`: dict name -> `RunResult` (baseline first; outputs and metrics of the last repeat,
        every repeat's metrics in `.repeats`) and the pandas phase table (`tdutils.metrics.phase_table`): medians
        over repeats, `decode_speedup` (median of the per-repeat ratios to the same repeat's baseline) with
        `decode_speedup_min` / `_max`, `decode_tok_s_min` / `_max`, `repeats` and `capacity_limit`.
        `tdutils.metrics.speedup_notes(table)` says when a ratio does not measure what dropping buys.

    Raises:
        ValueError: `repeats` < 1, or a drop function named "baseline".
    """
    results: dict[str, RunResult] = {}
    for _, name, res, _ in alternate_runs(engine, prompts, drop_fns, max_tokens=max_tokens, repeats=repeats,
                                          warmup=warmup, progress=progress, **decode_kwargs):
        earlier = results[name].repeats if name in results else []
        results[name] = RunResult(name, res.outputs, res.metrics, repeats=[*earlier, res.metrics])
    return results, phase_table(results.values(), baseline="baseline")
