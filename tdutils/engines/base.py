"""Engine-independent types and the prefill -> modify -> decode workflow.

Every engine offers the same three phases (SPEC §1): `prefill(prompts)` computes each request's KV
cache, `modify(drop_fn)` edits every request's cache with a drop function, `decode(max_tokens)`
generates from the edited caches in batches under a KV budget. A fourth, optional step serves the
query-agnostic flow (SPEC §3): `extend(prompts)`, after `prefill` (and usually `modify`), appends one text or
token-id list to each request and prefills it on top of the (edited) cache at the next positions, so
`decode` continues after it: `prefill(context) -> modify(drop_fn) -> extend(question) -> decode`; its input
is checked by `tokenize_extensions`. `run_once` chains them and `compare`
runs a baseline and one or more drop functions on the same prompts, alternately (`repeats` rounds of
baseline, fn1, fn2, ...) so that load from other work on the machine hits every configuration alike; the
ratios are taken per repeat, against the baseline of the same repeat.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..edit import check_token_ids
from ..metrics import RunMetrics, phase_table


@dataclass
class RequestOutput:
    """One request's result.

    Attributes:
        request_id: index of the prompt in the `prefill` call.
        prompt_tokens: prompt length T before modification.
        cached_tokens: KV length after modification (k; equals T for the baseline).
        output_ids: generated token ids (length `max_tokens` with `ignore_eos=True`).
        text: decoded `output_ids` (with `ignore_eos=True`, including what follows an EOS token).
        answer: the text up to (excluding) the first EOS token in `output_ids`; equals `text` when no EOS was
            generated. What scorers read: text a model writes after its EOS is not part of its answer.
        finish_reason: "length" or "stop" (an EOS token was generated).
        ttft_s: time to first token from the start of prefill, seconds.
        tpot_s: mean seconds per output token after the first.
        logits: optional list of fp32 tensors [vocab], one per generated token (`keep_logits=True`).
    """

    request_id: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    answer: str | None = None
    finish_reason: str = "length"
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    logits: list | None = None

    def __post_init__(self):
        if self.answer is None:
            self.answer = self.text


def answer_text(tokenizer, output_ids: list[int], eos_ids, text: str) -> str:
    """The answer part of a generation: `output_ids` decoded up to (excluding) the first id in `eos_ids`;
    `text` itself when none of them was generated (so an engine's own detokenization is kept)."""
    for i, t in enumerate(output_ids):
        if t in eos_ids:
            return tokenizer.decode(output_ids[:i], skip_special_tokens=True)
    return text


@dataclass
class ModifyReport:
    """What `modify` did: per-request failures as `(request_id, message)`; edited count."""

    edited: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)


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


GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily


def check_temperature(temperature) -> float:
    """The sampling temperature as a float: a finite number >= 0; below `GREEDY_BELOW` (1e-5, vLLM's
    convention) decoding is greedy (dividing logits by a smaller temperature overflows float32).

    Raises:
        ValueError: a bool, a non-number, NaN, infinity or a negative value.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    return float(temperature)


def check_count(value, name: str, minimum: int, *, none: str | None = None) -> int | None:
    """An integer setting as an int: `>= minimum`, or None when `none` says what None means.

    Accepts Python and numpy / torch integer scalars; refuses bools, floats (also 4000.0 and NaN) and strings,
    which would otherwise surface deep inside decode (a NaN budget as "cannot reshape tensor of 0 elements").

    Raises:
        TypeError: not an integer (the message names `name` and what to pass).
        ValueError: an integer below `minimum`.
    """
    what = f"an integer >= {minimum}" + (f", or None ({none})" if none else "")
    if value is None and none:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})") from None
    if value < minimum:
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def check_seconds(value, name: str) -> float:
    """A timeout as a float: a finite number of seconds > 0.

    Raises:
        TypeError: a bool, a string or another non-number.
        ValueError: zero, negative, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite number of seconds > 0, got {value!r} ({type(value).__name__})")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class CountSetting:
    """An engine attribute holding an integer setting, checked by `check_count` whenever it is set (in
    `__init__` and later, e.g. `engine.kv_budget_tokens = 4096`)."""

    def __init__(self, minimum: int, none: str | None = None):
        self.minimum, self.none = minimum, none

    def __set_name__(self, owner, name):
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj, value):
        setattr(obj, self.slot, check_count(value, self.name, self.minimum, none=self.none))


def check_engine_settings(kv_budget_tokens, max_batch_size, query_window) -> None:
    """Settings every engine shares: a positive budget and batch cap, a query window >= 0 (None means
    unlimited / all tokens). Raises TypeError for a non-integer, ValueError for one out of range."""
    check_count(kv_budget_tokens, "kv_budget_tokens", 1, none="unlimited")
    check_count(max_batch_size, "max_batch_size", 1, none="no cap")
    check_count(query_window, "query_window", 0, none="all prompt tokens")


def check_max_tokens(max_tokens, num_requests: int) -> list[int]:
    """Tokens to generate per request: one integer for all, or one per request (a list, tuple, numpy array or
    tensor of integers).

    Raises:
        TypeError: a string, None, a float or another non-integer (entry named).
        ValueError: an entry < 1, or a per-request sequence whose length is not `num_requests`.
    """
    if isinstance(max_tokens, str) or max_tokens is None:
        raise TypeError(f"max_tokens must be an integer >= 1 or one per request, got {max_tokens!r}")
    if hasattr(max_tokens, "tolist") and getattr(max_tokens, "ndim", 1) == 0:
        max_tokens = max_tokens.tolist()  # a numpy / torch scalar
    if isinstance(max_tokens, Iterable):
        values = list(max_tokens.tolist() if hasattr(max_tokens, "tolist") else max_tokens)
        if len(values) != num_requests:
            raise ValueError(f"max_tokens has {len(values)} entries for {num_requests} requests; pass one integer, "
                             f"or one per request")
        return [check_count(m, f"max_tokens[{i}]", 1) for i, m in enumerate(values)]
    return [check_count(max_tokens, "max_tokens", 1)] * num_requests


def _token_id(t, what: str, i: int) -> int:
    """One token id as an int; TypeError for a float, bool or other non-integer (int() would truncate 3.5 to 3)."""
    if not isinstance(t, bool):
        try:
            return operator.index(t)  # ints and numpy / torch integer scalars
        except TypeError:
            pass
    raise TypeError(f"{what} {i}: token ids must be integers, got {t!r} ({type(t).__name__}); pass the ids a "
                    f"tokenizer returns, or a string")


def _item_ids(tokenizer, p, i: int, what: str, vocab_size: int | None, special_tokens: bool) -> tuple[list[int], bool]:
    """Token ids of one prompt or extension (a string or a list of ids) and whether they came from text; the
    type, emptiness and vocabulary checks of `tokenize_prompts` / `tokenize_extensions` (errors name `what i`)."""
    if isinstance(p, str):
        ids, text = tokenizer(p, add_special_tokens=special_tokens)["input_ids"], True
    elif isinstance(p, list | tuple) or hasattr(p, "tolist"):
        ids, text = [_token_id(t, what, i) for t in (p.tolist() if hasattr(p, "tolist") else p)], False
    else:
        raise TypeError(f"{what} {i} must be a string or a list of token ids, got {type(p).__name__}")
    if not ids:
        raise ValueError(f"{what} {i} is empty" + (": extend() needs at least one token per request"
                                                     if what == "extension" else ""))
    if vocab_size is not None:
        bad = check_token_ids(ids, vocab_size)
        if bad is not None:
            raise ValueError(f"{what} {i}: token id {ids[bad]} at position {bad} is outside the model's "
                             f"vocabulary [0, {vocab_size}); token ids must come from this model's tokenizer")
    return ids, text


def tokenize_prompts(tokenizer, prompts, vocab_size: int | None = None, chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt: a string, a `PromptRow`/dict with `prompt`, or a list of token ids.

    Args:
        vocab_size: when given, token ids must lie in `[0, vocab_size)` (the model's embedding rows).
        chat: wrap each text prompt as a user turn in the tokenizer's chat template
            (`tdutils.chat.chat_prompt_ids`); token-id prompts are used as they are.

    Raises:
        TypeError: a prompt of another type.
        ValueError: no prompts, an empty prompt, or a token id outside the vocabulary (index given).
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of prompts; wrap a single prompt as [prompt]")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts: pass a non-empty list of prompts")
    items = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            if "prompt" not in p:
                raise ValueError(f"prompt {i} is a dict without a 'prompt' key (keys: {sorted(map(str, p))[:8]}); "
                                 f"pass {{'prompt': text, ...}}, a PromptRow, a string or token ids")
            p = p["prompt"]
        elif hasattr(p, "prompt"):
            p = p.prompt
        if chat and isinstance(p, str):
            from ..chat import chat_prompt_ids

            p = chat_prompt_ids(tokenizer, p)  # ids, checked below like any others; text for the unknown-token check
            items.append((_item_ids(tokenizer, p, i, "prompt", vocab_size, True)[0], True))
        else:
            items.append(_item_ids(tokenizer, p, i, "prompt", vocab_size, True))
    _warn_unknown(tokenizer, items, "prompt")
    return [ids for ids, _ in items]


def _warn_unknown(tokenizer, items, what: str) -> None:
    """Warn when over 10% of the tokens of the texts among `items` (`(ids, from_text)`) are the tokenizer's
    unknown token: e.g. English text for the bundled tiny models' vocabulary, whose answers then mean nothing."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    from_text = sum(len(ids) for ids, text in items if text)
    unknown = sum(t == unk for ids, text in items if text for t in ids)
    if from_text and unknown > 0.1 * from_text:
        warnings.warn(f"{unknown / from_text:.0%} of the {what} tokens are unknown to this tokenizer "
                      f"({getattr(tokenizer, 'unk_token', None)!r}): the model cannot read this text, so its answers "
                      "mean nothing (the bundled tiny models read only their synthetic tasks: passkey prompts, dataset "
                      "'sample', or tdutils.data's RULER-style tasks)", stacklevel=4)


def tokenize_extensions(tokenizer, extensions, num_requests: int, vocab_size: int | None = None) -> list[list[int]]:
    """Token ids of the text each request's `extend` appends: one string or token-id list per request, in request
    order. Strings are tokenized without special tokens (no BOS in the middle of a request), so
    `context ids + tokenize(" " + question)` is the prompt a tokenizer that splits at spaces gives for
    `context + " " + question`.

    Raises:
        TypeError: a single string instead of a list, or an item of another type.
        ValueError: not exactly `num_requests` items, an empty item, or a token id outside `[0, vocab_size)`.

    Warns (UserWarning) when over 10% of the text's tokens are unknown to the tokenizer, as `tokenize_prompts`.
    """
    if isinstance(extensions, str):
        raise TypeError("extend() takes one extension per request; wrap a single text as [text]")
    if not isinstance(extensions, Iterable):
        raise TypeError(f"extend() takes a list with one text or token-id list per request, got "
                        f"{type(extensions).__name__}")
    extensions = list(extensions)
    if len(extensions) != num_requests:
        raise ValueError(f"extend() got {len(extensions)} extension(s) for {num_requests} request(s); pass exactly one "
                         f"text or token-id list per request, in request order")
    items = [_item_ids(tokenizer, p, i, "extension", vocab_size, False) for i, p in enumerate(extensions)]
    _warn_unknown(tokenizer, items, "extension")
    return [ids for ids, _ in items]


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

    A drop function that records per-run state and has a `reset()` method (`TimedDropFn`) is reset before
    this run's modify, so what it records afterwards describes this run only: reusing it in a second run
    (or `compare`, or a sweep's repeats) never adds that run's timings to the first one's. Before prefill the
    engine widens its query capture to what `drop_fn` needs (`engine.capture_for`).
    """
    if drop_fn is not None and hasattr(engine, "capture_for"):
        engine.capture_for(drop_fn)
    engine.prefill(prompts)
    if drop_fn is not None:
        reset = getattr(drop_fn, "reset", None)
        if callable(reset):
            reset()
        engine.modify(drop_fn)
    outputs = engine.decode(max_tokens=max_tokens, **decode_kwargs)
    metrics = engine.metrics
    metrics.name = name
    return RunResult(name, outputs, metrics)


def _warmup_tokens(max_tokens):
    """A few decode tokens for an untimed warm-up run (one int, or one per request)."""
    if isinstance(max_tokens, int):
        return min(4, max_tokens)
    return [min(4, int(m)) for m in list(max_tokens)[:4]]


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


def open_engine(kind: str = "hf", **settings):
    """Open an engine by kind.

    Args:
        kind: `"hf"` — embedded Hugging Face transformers engine (CPU or GPU; see `engines.hf.HFEngine`
            for its settings: model, dtype, device, kv_budget_tokens, positions, ...).
            `"lmcache"` — vLLM + LMCache serving path (GPU box; see `engines.lmcache.LMCacheEngine` for its
            settings: model, vllm_url, lmcache_url, lmcache_http_url, query_window, align, ...).

    Raises:
        ValueError: unknown kind.
        ConnectionError: `"lmcache"` with a server down (the message has the command that starts it).
        ImportError: `"lmcache"` without the lmcache package installed.
    """
    if kind == "hf":
        from .hf import HFEngine

        return HFEngine(**settings)
    if kind == "lmcache":
        from .lmcache import LMCacheEngine

        return LMCacheEngine(**settings)
    raise ValueError(f"unknown engine kind {kind!r}; choose 'hf' or 'lmcache'")
