"""Runs over an open engine: one configuration (`run_once`), a baseline against configurations measured
alternately (`alternate_runs`, `compare`), and the default KV budget (`default_kv_budget`).

A configuration (`RunConfig`) is a drop function applied once after prefill, a decode-time compression
(`tdutils.compression.Compression`, a budget held while the cache grows), or both. `compare` runs a baseline and
one or more configurations on the same prompts, alternately (`repeats` rounds of baseline, c1, c2, ...), so that
load from other work on the machine hits every configuration alike; the ratios are taken per repeat, against the
baseline of the same repeat. On an engine that restores a prefilled batch (`restores_prefill`: the hf engine) the
prompts are prefilled once and every run starts from those caches (`Engine.snapshot` / `restore`): the runs'
`prefill_s` is then that one prefill's time. After the warm-up, `alternate_runs` estimates how long the runs will
take from it (`estimate_runs`). Ctrl-C during `compare` raises `Interrupted`, which carries the runs that finished.
`tdutils.sweep`, `python -m tdutils run` and `bench/decode_compression.py` build on it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from .checks import admits, check_max_tokens
from .compression import Compression
from .edit import as_drop_fn
from .metrics import DecodeMetrics, ModifyMetrics, RunMetrics, duration_text, phase_table, plural
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

    Args:
        prompt_lengths: token counts T, one int per prompt (not the prompts or `PromptRow`s themselves).

    Raises:
        TypeError: an item of `prompt_lengths` that is not an int (a prompt, a `PromptRow`).
        ValueError: `full_requests < 1`, no lengths or one below 1, `max_tokens < 1`.
    """
    if full_requests < 1:
        raise ValueError(f"full_requests must be >= 1 (the budget must hold one undropped request), got {full_requests}")
    lengths = list(prompt_lengths)
    bad = next((x for x in lengths if isinstance(x, bool) or not hasattr(x, "__index__")), None)
    if bad is not None:
        raise TypeError(f"prompt_lengths must be token counts (ints, one per prompt), got {type(bad).__name__}; pass "
                        f"the prompts' lengths, e.g. [len(ids) for ids in token_ids] or, for rows, "
                        f"[len(tokenizer(r.prompt)['input_ids']) for r in rows]")
    lengths = [x.__index__() for x in lengths]
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
        super().__init__(f"interrupted after {plural(len(runs), 'finished run')}")
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
    return _modify_decode(engine, name, drop_fn, compression, max_tokens, decode_kwargs)


def run_restored(engine, saved, prefill, *, name: str = "baseline", drop_fn=None,
                 compression: Compression | None = None, max_tokens: int = 64, **decode_kwargs) -> RunResult:
    """`run_once` from a prefilled batch instead of a new prefill: restore `saved` (`engine.snapshot()`, taken
    after a prefill that captured the queries `drop_fn` needs), then modify and decode as `run_once` does.

    The result's metrics are its own `RunMetrics`: `prefill` is the given `PrefillMetrics` (the prefill `saved`
    was taken after; shared by every run restored from it), `modify` and `decode` this run's.
    """
    engine.restore(saved)
    run = engine.metrics  # what restore left: the last run's phases, replaced before this run's
    run.prefill, run.modify, run.decode = prefill, ModifyMetrics(), DecodeMetrics()
    res = _modify_decode(engine, name, drop_fn, compression, max_tokens, decode_kwargs)
    m = res.metrics  # the engine's object, which the next run reuses: this run keeps a copy of its phases
    res.metrics = RunMetrics(name, prefill=m.prefill, modify=m.modify, decode=m.decode)
    return res


def _modify_decode(engine, name, drop_fn, compression, max_tokens, decode_kwargs) -> RunResult:
    if drop_fn is not None:
        drop_fn = as_drop_fn(drop_fn)
        drop_fn.reset()
        engine.modify(drop_fn)
    if compression is not None:  # only then: an engine without decode-time compression still runs the rest
        decode_kwargs = {**decode_kwargs, "compression": compression}
    outputs = engine.decode(max_tokens=max_tokens, **decode_kwargs)
    metrics = engine.metrics
    metrics.name = name
    return RunResult(name, outputs, metrics)


WARMUP_REQUESTS, WARMUP_TOKENS = 4, 8  # the warm-up's prompts and decode tokens (its steps time the estimate)


def _warmup_tokens(max_tokens):
    """A few decode tokens for an untimed warm-up run (one int, or one per request; checked by the caller)."""
    if not isinstance(max_tokens, Iterable):
        return min(WARMUP_TOKENS, int(max_tokens))
    rows = list(max_tokens.tolist() if hasattr(max_tokens, "tolist") else max_tokens)[:WARMUP_REQUESTS]
    return [min(WARMUP_TOKENS, int(m)) for m in rows]


PREFILLS = ("auto", "once", "each")  # alternate_runs' prefill: one for every run, one per run, or once where it can


def prefill_once(engine, prefill: str = "auto") -> bool:
    """Whether `alternate_runs` prefills once and restores the caches for every run (`"once"`), or prefills
    again for each run (`"each"`); `"auto"`: once where the engine says it restores a prefilled batch exactly
    (`restores_prefill`, the hf engine; an engine whose caches live elsewhere, such as LMCache's, does not).

    Raises:
        ValueError: an unknown `prefill`, or `"once"` on an engine that does not restore a prefilled batch.
    """
    if prefill not in PREFILLS:
        raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
    can = bool(getattr(engine, "restores_prefill", False))
    if prefill == "once" and not can:
        raise ValueError(f"prefill='once' needs an engine that restores a prefilled batch (restores_prefill); "
                         f"{type(engine).__name__} does not: use prefill='each'")
    return can if prefill == "auto" else prefill == "once"


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


@dataclass
class RunTiming:
    """How long `alternate_runs` took, against what it estimated after its warm-up (`estimate_runs`).

    Attributes:
        prefill: `"once"` (one prefill, restored for every run: the runs' `prefill_s` is that prefill's) or
            `"each"` (a prefill per run).
        estimate_s: the estimated seconds of the prefill(s), modifies and decodes after the warm-up; None without
            a warm-up (nothing to estimate from).
        estimate: the estimate's split, `{"prefill_s", "modify_s", "decode_s"}` (all runs together).
        basis: what the estimate was made from, in words.
        elapsed_s: the seconds the same work took (from the estimate to the last run's end); None until then.
        split: what it took, `{"prefill_s", "modify_s", "decode_s"}` (the prefills counted once each).
    """

    prefill: str = "each"
    estimate_s: float | None = None
    estimate: dict = field(default_factory=dict)
    basis: str = ""
    elapsed_s: float | None = None
    split: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _estimate_line(timing: RunTiming) -> str:
    e = timing.estimate
    total = duration_text(timing.estimate_s)
    parts = ", ".join(f"{k} {duration_text(e[f'{k}_s'])}" for k in ("prefill", "modify", "decode"))
    return (f"estimate: the runs will take {'' if total.startswith('under') else 'about '}{total} ({parts}), "
            f"{timing.basis}")


def alternate_runs(engine, prompts, configs: dict, *, max_tokens=64, repeats: int = 3, warmup: bool = True,
                   progress=None, order: str = "same", prefill: str = "auto", timing: RunTiming | None = None,
                   **decode_kwargs):
    """Run the baseline and every configuration `repeats` times, alternately: baseline, c1, c2, ..., baseline, ...

    Yields `(repeat, name, RunResult, ratio)` as each run finishes, `ratio` being its decode tok/s over the
    baseline's of the same repeat (1.0 for the baseline; None for a run that comes before the baseline in its
    repeat, `order="alternate"`). Each repeat measures every configuration back to back, so load from other work
    hits them alike and cancels in the ratio; a repeat the load hit unevenly shows up as a ratio far from the others.

    Args:
        engine: an open engine (`prefill`, `modify`, `decode`, `metrics`; `tokenize` when it has one; `decode`
            takes `compression=` when a configuration has one; `snapshot` / `restore` to prefill once).
        prompts: strings, rows or token-id lists (tokenized once).
        configs: name -> configuration (`RunConfig`, a drop function, or a `Compression`); names must be unique
            and not "baseline".
        max_tokens: decode tokens per request (an int, or one per request).
        repeats: rounds (>= 1).
        warmup: first run the baseline and every configuration once, untimed, on the first 4 prompts with 8 decode
            tokens: a process's first forward passes (allocator, kernels, thread pools) can be many times slower
            and would count against whichever configuration runs first. Its timings give the estimate
            (`estimate_runs`), printed through `progress` before the timed runs start.
        progress: callable taking one line per run, the estimate and the prefill (None: silent).
        order: `"same"` (every repeat baseline first) or `"alternate"` (`run_orders`).
        prefill: `"once"` (one prefill whose caches every run restores: the same caches for every configuration,
            and one prefill's time instead of one per run), `"each"` (a prefill per run) or `"auto"` (default:
            once where the engine restores a prefilled batch, `prefill_once`). Outputs are the same either way.
        timing: a `RunTiming` to fill in (the estimate and the time the runs took), or None.
        **decode_kwargs: passed to `engine.decode` (e.g. `ignore_eos=True`).

    Raises:
        ValueError: `repeats` < 1, a configuration named "baseline", an unknown order or prefill, or
            `prefill="once"` on an engine that cannot restore.
    """
    fns = _check_configs(configs, repeats)
    orders = run_orders(fns, repeats, order)
    once = prefill_once(engine, prefill)
    timing = timing if timing is not None else RunTiming()
    timing.prefill = "once" if once else "each"
    ids = engine.tokenize(prompts) if hasattr(engine, "tokenize") else prompts

    check_max_tokens(max_tokens, len(ids))  # before the warm-up reads it: a clear error naming max_tokens
    if once and hasattr(engine, "capture_for"):  # the one prefill captures what every drop function needs
        engine.capture_for(*[c.drop_fn for c in fns.values() if c.drop_fn is not None])
    if warmup:
        warm = _warmup(engine, ids[:WARMUP_REQUESTS], fns, max_tokens, once, decode_kwargs)
        est = estimate_runs(warm, ids, max_tokens=max_tokens, repeats=repeats, prefills=1 if once else
                            repeats * len(fns), budget=getattr(engine, "kv_budget_tokens", None),
                            max_batch_size=getattr(engine, "max_batch_size", None))
        timing.estimate_s, timing.basis, timing.estimate = est.pop("seconds"), est.pop("basis"), est
        if progress:
            progress(_estimate_line(timing))
    t0 = time.perf_counter()
    saved, shared = _prefill_shared(engine, ids, progress) if once else (None, None)
    spent = {"prefill_s": shared.seconds if once else 0.0, "modify_s": 0.0, "decode_s": 0.0}
    for rep, names in enumerate(orders):
        base_tps = None
        for name in names:
            cfg = fns[name]
            args = dict(name=name, drop_fn=cfg.drop_fn, compression=cfg.compression, max_tokens=max_tokens,
                        **decode_kwargs)
            res = run_restored(engine, saved, shared, **args) if once else run_once(engine, ids, **args)
            m = res.metrics
            spent["prefill_s"] += 0.0 if once else m.prefill.seconds
            spent["modify_s"] += m.modify.seconds
            spent["decode_s"] += m.decode.seconds
            timing.elapsed_s, timing.split = time.perf_counter() - t0, dict(spent)
            tps = m.decode.tokens_per_s
            base_tps = tps if name == "baseline" else base_tps
            ratio = None if base_tps is None else tps / base_tps
            if progress:
                d, mm = m.decode, m.modify
                shown = "x?" if ratio is None else f"x{ratio:.2f}"
                progress(f"repeat {rep + 1}/{repeats} {name:>24}: decode {tps:9.1f} tok/s, peak batch "
                         f"{d.peak_batch_size}, modify {mm.seconds:.3f} s, {shown}")
            yield rep, name, res, ratio


def _prefill_shared(engine, ids, progress):
    """Prefill `ids` once for every run: `(snapshot, PrefillMetrics)`."""
    engine.prefill(ids)
    saved, shared = engine.snapshot(), engine.metrics.prefill
    if progress:
        progress(f"prefill: {plural(shared.requests, 'prompt')}, {shared.tokens} tokens in {shared.seconds:.1f} s, once: every "
                 f"run restores these caches")
    return saved, shared


def _warmup(engine, ids, fns: dict, max_tokens, once: bool, decode_kwargs) -> dict:
    """The untimed warm-up: every configuration once on `ids` (the first prompts) with a few decode tokens; one
    prefill restored for each configuration when `once`. Returns name -> `RunResult` (what `estimate_runs` reads)."""
    warm, tokens = {}, _warmup_tokens(max_tokens)
    if once:
        engine.prefill(ids)
        saved, shared = engine.snapshot(), engine.metrics.prefill
    for name, cfg in fns.items():
        args = dict(name="warm-up", drop_fn=cfg.drop_fn, compression=cfg.compression, max_tokens=tokens,
                    **decode_kwargs)
        warm[name] = run_restored(engine, saved, shared, **args) if once else run_once(engine, ids, **args)
    return warm


def estimate_runs(warm: dict, ids, *, max_tokens, repeats: int, prefills: int, budget: int | None,
                  max_batch_size: int | None) -> dict:
    """Seconds the timed runs of `alternate_runs` will take, estimated from its warm-up on this machine as loaded now.

    Prefill: the warm-up's prefill seconds scaled by prompt tokens (`prefills` of all of `ids`). Modify: each
    configuration's warm-up modify seconds scaled by requests. Decode: a decode step is modelled as
    `w + a * K` seconds, `K` the KV tokens the batch attends over (weights read once per step, attention reads every
    cached token), fitted to the configurations' warm-up steps (median seconds per step after the first, at the
    warm-up's batch); a run's steps and attended tokens come from first come first served admission under
    `budget` (`tdutils.engines.scheduler.admits`) with each request's cache at the warm-up's kept fraction. With
    a single configuration, or warm-up steps that the load made disagree with the model (`a` or `w` < 0), each
    configuration's own step seconds are used instead (`a = 0`). Decode-time compression's cuts are not modelled.

    Args:
        warm: name -> `RunResult` of the warm-up (`outputs` with `cached_tokens`, `prompt_tokens`, `tpot_s`;
            `metrics` with `prefill.seconds`, `prefill.tokens`, `modify.seconds`, `decode.peak_batch_size`).
        ids: the prompts of the timed runs (token-id lists); max_tokens: an int or one per request.
        repeats: rounds; prefills: prefills of all prompts (1 when restored, else one per run).
        budget, max_batch_size: the engine's KV budget (tokens) and batch cap (None: none).

    Returns:
        `{"seconds", "prefill_s", "modify_s", "decode_s", "basis"}`: the total and its split (seconds), and a line
        saying what the estimate was made from.
    """
    lengths = [len(x) for x in ids]
    m = [int(x) for x in (max_tokens.tolist() if hasattr(max_tokens, "tolist") else max_tokens)] \
        if isinstance(max_tokens, Iterable) else [int(max_tokens)] * len(ids)
    first = next(iter(warm.values()))
    pm = first.metrics.prefill
    prefill_s = pm.seconds * sum(lengths) / max(pm.tokens, 1) * prefills
    points = {name: _step_point(r) for name, r in warm.items()}
    w, a = _fit_step(list(points.values()))
    modify_s = decode_s = 0.0
    for name, r in warm.items():
        kept = sum(o.cached_tokens for o in r.outputs) / max(sum(o.prompt_tokens for o in r.outputs), 1)
        steps, attended = _decode_work([max(1, round(kept * t)) for t in lengths], m, budget, max_batch_size)
        own = points[name][1]
        decode_s += repeats * (steps * own if a is None else steps * w + a * attended)
        modify_s += repeats * r.metrics.modify.seconds * len(ids) / max(len(r.outputs), 1)
    n_steps = len(first.outputs[0].output_ids) if first.outputs else 0
    basis = (f"from the warm-up on this machine as loaded now ({plural(len(first.outputs), 'prompt')} prefilled, "
             f"{plural(n_steps, 'decode step')} per configuration; a decode step modelled as "
             f"{'its own seconds' if a is None else 'weights + attended KV tokens'})")
    total = prefill_s + modify_s + decode_s
    return {"seconds": total, "prefill_s": prefill_s, "modify_s": modify_s, "decode_s": decode_s, "basis": basis}


def _step_point(res: RunResult) -> tuple[float, float]:
    """`(K, seconds)` of one warm-up decode: the KV tokens a step attended over (the batch's caches at the middle
    of its steps) and the median seconds per step after the first (the outputs' TPOT)."""
    outs = res.outputs
    batch = max(1, min(res.metrics.decode.peak_batch_size or len(outs), len(outs)))
    cache = statistics.fmean(o.cached_tokens + len(o.output_ids) / 2 for o in outs)
    tpots = [o.tpot_s for o in outs if o.tpot_s == o.tpot_s]  # NaN with a single token
    return batch * cache, statistics.median(tpots) if tpots else res.metrics.decode.seconds / max(
        res.metrics.decode.steps, 1)


def _fit_step(points: list[tuple[float, float]]) -> tuple[float, float | None]:
    """Least squares `seconds = w + a * K` over `points`; `(w, None)` when they cannot tell `a` (one point,
    equal K) or the fit is not physical (negative `a` or `w`)."""
    if len(points) < 2:
        return points[0][1], None
    ks, ts = [k for k, _ in points], [t for _, t in points]
    mk, mt = statistics.fmean(ks), statistics.fmean(ts)
    var = sum((k - mk) ** 2 for k in ks)
    if var <= (0.05 * mk) ** 2:
        return mt, None
    a = sum((k - mk) * (t - mt) for k, t in points) / var
    w = mt - a * mk
    return (mt, None) if a < 0 or w < 0 else (w, a)


def _decode_work(caches: list[int], m: list[int], budget: int | None, max_batch_size: int | None) -> tuple[int, float]:
    """`(steps, attended)`: decode steps of requests with `caches[i]` cached tokens generating `m[i]` each, admitted
    first come first served while their needs (`cache + m`) fit `budget` (the hf engine's admission with EOS
    ignored), and the KV tokens all steps attend over together."""
    waiting, running, steps = deque(zip(caches, m)), [], 0
    while waiting or running:
        while waiting and (not running or admits(sum(c + n for c, n, _ in running), sum(waiting[0]), len(running),
                                                 budget, max_batch_size)):
            c, n = waiting.popleft()
            running.append((c, n, n))
        steps += 1
        running = [(c, n, left - 1) for c, n, left in running if left > 1]
    attended = sum(n * c + n * (n - 1) / 2 for c, n in zip(caches, m))
    return steps, attended


def compare(engine, prompts, configs: dict, *, max_tokens=64, repeats: int = 3, warmup: bool = True, progress=None,
            order: str = "same", prefill: str = "auto", **decode_kwargs):
    """Run the baseline and each named configuration on the same prompts, alternately, `repeats` times.

    Args:
        engine: an open engine; its `kv_budget_tokens` is the fixed budget every run decodes under.
        prompts: strings, rows or token-id lists.
        configs: name -> configuration: a drop function (`make_drop_fn`), a decode-time compression
            (`tdutils.compression.Compression`), or both (`RunConfig`); names must be unique and not "baseline".
        max_tokens: decode tokens per request.
        repeats: rounds of baseline, c1, c2, ... (default 3; 1 for a quick look, which shows no spread). See
            `alternate_runs`.
        warmup: an untimed warm-up of every configuration first, which the estimate is made from (see
            `alternate_runs`).
        progress: callable taking one line per run, the estimate and the prefill (e.g. `print`), or None.
        order: `"same"` or `"alternate"` (`run_orders`).
        prefill: `"auto"`, `"once"` or `"each"` (`alternate_runs`): with `"once"` every run's `prefill_s` is the
            one prefill's time.
        **decode_kwargs: passed to `engine.decode`.

    Returns:
        `(results, table)`: dict name -> `RunResult` (baseline first; outputs and metrics of the last repeat,
        every repeat's metrics in `.repeats`) and the pandas phase table (`tdutils.metrics.phase_table`): medians
        over repeats, `decode_speedup` (median of the per-repeat ratios to the same repeat's baseline) with
        `decode_speedup_min` / `_max`, `decode_tok_s_min` / `_max`, `repeats` and `capacity_limit`; its
        `attrs["timing"]` is the `RunTiming` as a dict (the prefill mode, the estimate and the time taken).
        `tdutils.metrics.speedup_notes(table)` says when a ratio does not measure what dropping buys.

    Raises:
        ValueError: `repeats` < 1, a configuration named "baseline", or a bad `order` / `prefill`.
        Interrupted: Ctrl-C (a `KeyboardInterrupt`); its `results` and `runs` hold the runs that finished.
    """
    results: dict[str, RunResult] = {}
    runs = []
    timing = RunTiming()
    try:
        for _, name, res, _ in alternate_runs(engine, prompts, configs, max_tokens=max_tokens, repeats=repeats,
                                              warmup=warmup, progress=progress, order=order, prefill=prefill,
                                              timing=timing, **decode_kwargs):
            earlier = results[name].repeats if name in results else []
            results[name] = RunResult(name, res.outputs, res.metrics, repeats=[*earlier, res.metrics])
            runs.append(res.metrics)
    except KeyboardInterrupt:
        raise Interrupted(results, runs) from None
    table = phase_table(results.values(), baseline="baseline")
    table.attrs["timing"] = timing.to_dict()
    return results, table


PREFILL_ONCE_NOTE = ("prefill_s is the one prefill every run restored its caches from (the baseline and the dropped "
                     "configuration start from the same caches); end_to_end_s adds it to each run's modify and decode")


def timing_line(timing: dict) -> str:
    """One line: what the runs took against the estimate printed before them (`RunTiming.to_dict()`), with the
    split by phase."""
    s = timing.get("split") or {}
    took = (f"the runs took {duration_text(timing['elapsed_s'])} (prefill {s.get('prefill_s', 0):.0f} s, modify "
            f"{s.get('modify_s', 0):.0f} s, decode {s.get('decode_s', 0):.0f} s)")
    if timing.get("estimate_s") is None:
        return took
    return f"{took}; estimated {duration_text(timing['estimate_s'])}"
