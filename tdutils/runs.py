"""Runs over an open engine: one configuration (`run_once`), a baseline against configurations measured
alternately (`alternate_runs`, `compare`), and the default KV budget (`default_kv_budget`).

A configuration (`RunConfig`) is a drop function applied once after prefill, a decode-time compression
(`tdutils.compression.Compression`, a budget held while the cache grows), or both. `compare` runs a baseline and
one or more configurations on the same prompts, alternately (`repeats` rounds of baseline, c1, c2, ...), so that
load from other work on the machine hits every configuration alike; the ratios are taken per repeat, against the
baseline of the same repeat. Ctrl-C during `compare` raises `Interrupted`, which carries the runs that finished.
`tdutils.sweep`, `python -m tdutils run` and `bench/decode_compression.py` build on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from .checks import check_max_tokens
from .compression import Compression
from .edit import as_drop_fn
from .metrics import RunMetrics, phase_table
from .outputs import RequestOutput


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


@dataclass(frozen=True)
class RunConfig:
    """One configuration of a comparison: what is done to the caches between prefill and the end of decoding.

    Attributes:
        drop_fn: a drop function (`make_drop_fn`, `DropFn`, or a bare modify function) applied once after
            prefill (`engine.modify`); None: none.
        compression: a decode-time compression (`tdutils.compression.Compression`, R-KV's setting,
            arXiv:2505.24133) held while the cache grows (`engine.decode(compression=...)`); None: none.
    The baseline is `RunConfig()` (neither).
    """

    drop_fn: object = None
    compression: Compression | None = None

    @property
    def is_baseline(self) -> bool:
        return self.drop_fn is None and self.compression is None


def as_config(value) -> RunConfig:
    """`value` as a `RunConfig`: None (the baseline), a `RunConfig`, a `Compression`, or a drop function."""
    if value is None:
        return RunConfig()
    if isinstance(value, RunConfig):
        return value
    if isinstance(value, Compression):
        return RunConfig(compression=value)
    return RunConfig(drop_fn=value)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped `compare`: `results` maps each configuration that finished at least one run to its
    `RunResult` (as `compare` returns them), `runs` lists the `RunMetrics` of every finished run in run order.
    A `KeyboardInterrupt`, so code that catches Ctrl-C still does."""

    def __init__(self, results: dict, runs: list):
        super().__init__(f"interrupted after {len(runs)} finished run(s)")
        self.results, self.runs = results, runs


def run_once(engine, prompts, *, name: str = "baseline", drop_fn=None, compression: Compression | None = None,
             max_tokens: int = 64, **decode_kwargs) -> RunResult:
    """Prefill `prompts`, apply `drop_fn` (None: no modify), decode `max_tokens` per request, holding
    `compression` (a `Compression`; None: none) while the caches grow.

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
    if compression is not None:  # only then: an engine without decode-time compression still runs the rest
        decode_kwargs["compression"] = compression
    outputs = engine.decode(max_tokens=max_tokens, **decode_kwargs)
    metrics = engine.metrics
    metrics.name = name
    return RunResult(name, outputs, metrics)


def _warmup_tokens(max_tokens):
    """A few decode tokens for an untimed warm-up run (one int, or one per request; checked by the caller)."""
    if not isinstance(max_tokens, Iterable):
        return min(4, int(max_tokens))
    return [min(4, int(m)) for m in list(max_tokens.tolist() if hasattr(max_tokens, "tolist") else max_tokens)[:4]]


ORDERS = ("same", "alternate")  # every repeat baseline, c1, c2, ...; or that order, then reversed, then ...


def run_orders(names, repeats: int, order: str = "same") -> list[list[str]]:
    """The run order of every repeat: `names` each time (`"same"`), or forward then backward (`"alternate"`:
    drift over the run hits every configuration alike)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    names = list(names)
    return [names if order == "same" or r % 2 == 0 else names[::-1] for r in range(repeats)]


def _check_configs(configs: dict, repeats) -> dict[str, RunConfig]:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1 (rounds of baseline and every configuration), got {repeats!r}")
    if "baseline" in configs:
        raise ValueError("a drop function is named 'baseline', the name of the run without dropping or compression; "
                         "rename it")
    return {"baseline": RunConfig(), **{name: as_config(c) for name, c in configs.items()}}


def alternate_runs(engine, prompts, configs: dict, *, max_tokens=64, repeats: int = 3, warmup: bool = True,
                   progress=None, order: str = "same", **decode_kwargs):
    """Run the baseline and every configuration `repeats` times, alternately: baseline, c1, c2, ..., baseline, ...

    Yields `(repeat, name, RunResult, ratio)` as each run finishes, `ratio` being its decode tok/s over the
    baseline's of the same repeat (1.0 for the baseline; None for a run that comes before the baseline in its
    repeat, `order="alternate"`). Each repeat measures every configuration back to back, so load from other work
    hits them alike and cancels in the ratio; a repeat the load hit unevenly shows up as a ratio far from the others.

    Args:
        engine: an open engine (`prefill`, `modify`, `decode`, `metrics`; `tokenize` when it has one; `decode`
            takes `compression=` when a configuration has one).
        prompts: strings, rows or token-id lists (tokenized once).
        configs: name -> configuration (`RunConfig`, a drop function, or a `Compression`); names must be unique
            and not "baseline".
        max_tokens: decode tokens per request (an int, or one per request).
        repeats: rounds (>= 1).
        warmup: first run the baseline and every configuration once, untimed, on the first 4 prompts with 4 decode
            tokens: a process's first forward passes (allocator, kernels, thread pools) can be many times slower
            and would count against whichever configuration runs first.
        progress: callable taking one line per run (None: silent).
        order: `"same"` (every repeat baseline first) or `"alternate"` (`run_orders`).
        **decode_kwargs: passed to `engine.decode` (e.g. `ignore_eos=True`).

    Raises:
        ValueError: `repeats` < 1, a configuration named "baseline", or an unknown order.
    """
    fns = _check_configs(configs, repeats)
    orders = run_orders(fns, repeats, order)
    ids = engine.tokenize(prompts) if hasattr(engine, "tokenize") else prompts

    check_max_tokens(max_tokens, len(ids))  # before the warm-up reads it: a clear error naming max_tokens
    if warmup:
        for cfg in fns.values():
            run_once(engine, ids[:4], name="warm-up", drop_fn=cfg.drop_fn, compression=cfg.compression,
                     max_tokens=_warmup_tokens(max_tokens), **decode_kwargs)
    for rep, names in enumerate(orders):
        base_tps = None
        for name in names:
            cfg = fns[name]
            res = run_once(engine, ids, name=name, drop_fn=cfg.drop_fn, compression=cfg.compression,
                           max_tokens=max_tokens, **decode_kwargs)
            tps = res.metrics.decode.tokens_per_s
            base_tps = tps if name == "baseline" else base_tps
            ratio = None if base_tps is None else tps / base_tps
            if progress:
                d, m = res.metrics.decode, res.metrics.modify
                shown = "x?" if ratio is None else f"x{ratio:.2f}"
                progress(f"repeat {rep + 1}/{repeats} {name:>24}: decode {tps:9.1f} tok/s, peak batch "
                         f"{d.peak_batch_size}, modify {m.seconds:.3f} s, {shown}")
            yield rep, name, res, ratio


def compare(engine, prompts, configs: dict, *, max_tokens=64, repeats: int = 3, warmup: bool = True, progress=None,
            order: str = "same", **decode_kwargs):
    """Run the baseline and each named configuration on the same prompts, alternately, `repeats` times.

    Args:
        engine: an open engine; its `kv_budget_tokens` is the fixed budget every run decodes under.
        prompts: strings, rows or token-id lists.
        configs: name -> configuration: a drop function (`make_drop_fn`), a decode-time compression
            (`tdutils.compression.Compression`), or both (`RunConfig`); names must be unique and not "baseline".
        max_tokens: decode tokens per request.
        repeats: rounds of baseline, c1, c2, ... (default 3; 1 for a quick look, which shows no spread). See
            `alternate_runs`.
        warmup: an untimed warm-up of every configuration first (see `alternate_runs`).
        progress: callable taking one line per run (e.g. `print`), or None.
        order: `"same"` or `"alternate"` (`run_orders`).
        **decode_kwargs: passed to `engine.decode`.

    Returns:
        `(results, table)`: dict name -> `RunResult` (baseline first; outputs and metrics of the last repeat,
        every repeat's metrics in `.repeats`) and the pandas phase table (`tdutils.metrics.phase_table`): medians
        over repeats, `decode_speedup` (median of the per-repeat ratios to the same repeat's baseline) with
        `decode_speedup_min` / `_max`, `decode_tok_s_min` / `_max`, `repeats` and `capacity_limit`.
        `tdutils.metrics.speedup_notes(table)` says when a ratio does not measure what dropping buys.

    Raises:
        ValueError: `repeats` < 1, or a configuration named "baseline".
        Interrupted: Ctrl-C (a `KeyboardInterrupt`); its `results` and `runs` hold the runs that finished.
    """
    results: dict[str, RunResult] = {}
    runs = []
    try:
        for _, name, res, _ in alternate_runs(engine, prompts, configs, max_tokens=max_tokens, repeats=repeats,
                                              warmup=warmup, progress=progress, order=order, **decode_kwargs):
            earlier = results[name].repeats if name in results else []
            results[name] = RunResult(name, res.outputs, res.metrics, repeats=[*earlier, res.metrics])
            runs.append(res.metrics)
    except KeyboardInterrupt:
        raise Interrupted(results, runs) from None
    return results, phase_table(results.values(), baseline="baseline")
