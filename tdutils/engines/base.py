"""The engine contract: prefill -> modify -> (extend) -> decode over a batch of requests.

Method map of `Engine` (what an engine must write, what it gets):

| method | who | contract |
|---|---|---|
| `prefill(prompts) -> list[int]` | required | compute each request's KV cache; returns cache lengths |
| `decode(max_tokens, ...) -> list[RequestOutput]` | required | batched decoding under `kv_budget_tokens` |
| `tensors(i)` / `tokens(i)` | required | what a drop function receives: KV `[2, L, T, D]` (+ queries) and T ids |
| `extend(prompts) -> list[int]` | optional | append one text per request on top of its (edited) cache |
| `modify(drop_fn) -> ModifyReport` | shared | every request's cache edited, all or nothing, over the `_edit_*` hooks |
| `tokenize`, `capture_for`, `snapshot` / `restore`, `close`, `with` | shared | |

The text helpers below check prompts for every engine (settings are checked in `tdutils.checks`);
`register_engine` names an engine kind for `tdutils.open_engine`. Runs over an engine (`run_once`, `compare`) are in `tdutils.runs`.
"""

from __future__ import annotations

import copy
import math
import operator
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable

from ..chat import chat_prompt_ids, uses_chat_template
from ..checks import CountSetting
from ..edit import DropFunctionError, as_drop_fn, check_token_ids, kept_rows, validate_drop_output
from ..metrics import ModifyMetrics
from ..outputs import ModifyReport, RequestOutput
from ..policies import query_window_for


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


# ---------------------------------------------------------------------------------------------------- the contract
_ENGINES: dict[str, type] = {}


def register_engine(kind: str):
    """Class decorator: make an `Engine` subclass reachable as `tdutils.open_engine(kind, ...)` and the CLI's
    `--engine kind`. A module under `tdutils/engines/` is found by `open_engine` on its own; an engine defined
    elsewhere is registered when its module is imported.

    Raises:
        TypeError: not an `Engine` subclass.
        ValueError: a kind already taken by another class.
    """
    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, Engine)):
            raise TypeError(f"register_engine({kind!r}) takes an Engine subclass, got {cls!r}")
        old = _ENGINES.get(kind)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"engine kind {kind!r} is taken by {old.__module__}.{old.__qualname__}")
        cls.kind = kind
        _ENGINES[kind] = cls
        return cls

    return register


class Engine(ABC):
    """An engine over one model: a batch of requests goes prefill -> modify(drop_fn) -> (extend) -> decode.

    Subclasses write the required methods and the `_edit_*` hooks; `modify` is shared, so it means the same
    on every engine: each request's tensors go to the drop function, its output is validated, and the
    edits are committed only when every request succeeded (`on_error="raise"`) or for those that did
    (`"skip"`). Settings `kv_budget_tokens`, `max_batch_size`, `query_window` are checked whenever set.
    Subclasses set `tokenizer`, `requests` (one record per request, `snapshot` copies them), `metrics`,
    `chat_template` and `facts` (the model's `tdutils.models.ModelFacts`, which drop functions are built from:
    `make_drop_fn(..., model_config=engine.facts)`) in `__init__`. `modify` adapts a bare ModifyFn once
    (`tdutils.edit.as_drop_fn`) and its hooks read the `DropFn`'s declared attributes.
    """

    kind: str = ""
    # `restore(snapshot())` gives back exactly the prefilled batch, its caches held here (not in a server's store
    # that `modify` writes to): `tdutils.runs.alternate_runs` may then prefill once for every run
    restores_prefill: bool = False
    kv_budget_tokens = CountSetting(1, none="unlimited")
    max_batch_size = CountSetting(1, none="no cap")
    query_window = CountSetting(0, none="all prompt tokens")
    chat_template: str = "none"

    # ------------------------------------------------------------------ required
    @abstractmethod
    def prefill(self, prompts) -> list[int]:
        """Compute every prompt's KV cache (a new batch of requests); returns each request's cache length."""

    @abstractmethod
    def decode(self, max_tokens=64, *, temperature: float = 0.0, ignore_eos: bool = True, seed: int = 0,
               keep_logits: bool = False, compression=None) -> list[RequestOutput]:
        """Generate `max_tokens` per request from the current caches, batched under `kv_budget_tokens`;
        with `compression` (`tdutils.compression.Compression`) each cache is cut back to its budget whenever it
        grows by the buffer (R-KV's decode-time setting), the cuts reported in `RequestOutput.compressions`."""

    @abstractmethod
    def tensors(self, request_id: int) -> dict:
        """What a drop function receives: `{CacheKind.KV: [2, L, T, D][, CacheKind.QUERY: [L, Tq, Hq*d]]}`."""

    @abstractmethod
    def tokens(self, request_id: int) -> list[int]:
        """The T token ids the request's current cache holds."""

    # ------------------------------------------------------------------ optional
    def extend(self, prompts) -> list[int]:
        """Append one text or token-id list per request on top of its cache; returns the new cache lengths."""
        raise NotImplementedError(f"the {self.kind or type(self).__name__} engine has no extend()")

    def close(self) -> None:
        """Release what the engine holds (connections, servers' contexts); the default holds nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ------------------------------------------------------------------ shared
    def tokenize(self, prompts) -> list[list[int]]:
        """Token ids of each prompt: a string, a `PromptRow`/dict with `prompt`, or a list of ids; text prompts
        wrapped in the chat template when the engine was opened with one (`tdutils.chat`)."""
        return tokenize_prompts(self.tokenizer, prompts, self._vocab_size(), chat=self.chat_template_applied)

    @property
    def chat_template_applied(self) -> bool:
        """Whether text prompts are wrapped in the tokenizer's chat template (`chat_template` setting)."""
        return uses_chat_template(self.tokenizer, self.chat_template)

    def capture_for(self, *drop_fns) -> int | None:
        """Widen query capture to what `drop_fns` need before the next `prefill`; never narrows it.

        `tdutils.policies.query_window_for` says what they need: nothing (query-free policies), the last `w`
        prompt queries (SnapKV, R-KV, TOVA) or all of them (H2O). Drop functions that do not say (a bare
        ModifyFn) change nothing. `run_once` and `compare` call this. Returns the `query_window` after the call
        (None = all prompt tokens).
        """
        drop_fns = [as_drop_fn(f) for f in drop_fns if f is not None]
        need = query_window_for(*drop_fns, default=0)
        if need == 0:
            return self.query_window
        self._prepare_capture(need, drop_fns)
        if self.query_window is None or (need is not None and self.query_window >= need):
            return self.query_window
        self.query_window = need
        return need

    def snapshot(self):
        """The batch's state (caches, tokens, positions), for `restore`: e.g. to run several drop functions on
        one prefill. Caches are never edited in place, so a snapshot shares their tensors."""
        self._require_requests("snapshot()")
        return [copy.copy(r) for r in self.requests]

    def restore(self, state) -> None:
        """Go back to a `snapshot()`: the requests' caches as they were when it was taken. Snapshots joined into
        one list (`a + b`: e.g. one prefill's caches edited by two drop functions) restore as one batch of all
        their requests, numbered 0..N-1 in that order, so one `decode` serves them all.

        Raises:
            TypeError: `state` is not a snapshot of this kind of engine (nothing is changed).
        """
        kind = type(self.requests[0]) if getattr(self, "requests", None) else None
        if not isinstance(state, list) or not state or (kind is not None and not all(isinstance(r, kind) for r in state)):
            raise TypeError(f"restore() takes what snapshot() returned on this engine, got {type(state).__name__}")
        requests = [copy.copy(r) for r in state]
        for i, r in enumerate(requests):  # a request's id is its place in the batch (`tensors(i)`, `kv(i)`)
            r.request_id = i
        self.requests = requests

    def modify(self, drop_fn, *, positions: str | None = None, on_error: str = "raise") -> ModifyReport:
        """Apply `drop_fn(tensors, tokens) -> (new_kv, new_tokens)` to every request's cache.

        Args:
            drop_fn: a `DropFn` (`tdutils.make_drop_fn`) or any LMCache-style ModifyFn (adapted once,
                `tdutils.edit.as_drop_fn`). It receives `tensors(i)` and the request's T token ids; a `DropFn`
                also reports its kept indices (`edit`).
            positions: `"compact"` / `"original"` (where the engine has it); default the engine's setting.
            on_error: `"raise"` — if any request fails, no cache is changed and `DropFunctionError` lists
                every failure; `"skip"` — failed requests keep their cache unchanged, the others are edited,
                failures are returned in the report and warned about.

        Raises:
            RuntimeError: called before `prefill` (and engine-specific order errors).
            ValueError: bad `positions` / `on_error`, or a drop function the engine's positions cannot take.
            DropFunctionError: with `on_error="raise"`, when the function raised or returned bad output.
        """
        self._require_requests("modify()")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        drop_fn = as_drop_fn(drop_fn)  # what it reads and does, declared once
        positions = self._check_modify(drop_fn, positions)
        mm = self.metrics.modify = ModifyMetrics()
        mm.tokens_before = sum(self._cache_length(i) for i in range(len(self.requests)))
        t0 = time.perf_counter()
        staged, failures = {}, []
        for i in range(len(self.requests)):
            got = self._edit_input(i, drop_fn)
            if isinstance(got, str):  # nothing this request's cache can give the drop function
                failures.append((i, got))
                continue
            tensors, tokens, reference = got
            try:
                *result, keep = drop_fn.edit(tensors, list(tokens))  # keep: None from a bare ModifyFn
                new_kv, new_tokens = validate_drop_output(reference, tokens, result, vocab_size=self._vocab_size())
                if keep is None and positions == "original":
                    # decode refeeds the last kept token at its own position: any drop function's kept rows
                    # must be known, not assumed to end at T - 1
                    keep = kept_rows(reference, tokens, new_kv, new_tokens, window=self._position_window())
                staged[i] = self._edit_stage(i, new_kv, new_tokens, keep)  # may refuse this request's sets
            except Exception as exc:  # noqa: BLE001 (any failure of user code is reported below, never swallowed)
                failures.append((i, f"{exc.__class__.__name__}: {exc}{self._failure_note(i, tensors)}"))
                continue
            del tensors, result
        mm.seconds = time.perf_counter() - t0
        if failures and on_error == "raise":
            mm.failed, mm.tokens_after = len(failures), mm.tokens_before
            lines = "\n".join(f"  request {i}: {msg}" for i, msg in failures[:10])
            raise DropFunctionError(f"the drop function failed on {len(failures)} of {len(self.requests)} requests; "
                                    f"no cache was changed:\n{lines}")
        for i, edit_ in staged.items():
            self._edit_commit(i, edit_, positions)
        mm.edited, mm.failed = len(staged), len(failures)
        mm.tokens_after = sum(self._cache_length(i) for i in range(len(self.requests)))
        if failures:
            warnings.warn(f"drop function failed on {len(failures)} requests (caches left unchanged): {failures[:3]}",
                          stacklevel=2)
        return ModifyReport(edited=len(staged), failures=failures)

    # ------------------------------------------------------------------ hooks (private)
    def _require_requests(self, op: str) -> None:
        if not getattr(self, "requests", None):
            raise RuntimeError(f"{op} needs prefilled requests; call prefill(prompts) first")

    def _vocab_size(self) -> int | None:
        """Token ids must lie in `[0, vocab_size)` (None: unchecked)."""
        return None

    def _position_window(self) -> float:
        """The model's largest sliding window (0: none), which `kept_rows` needs to tell when identical rows make
        kept positions ambiguous; unknown here: every position matters."""
        return math.inf

    def _prepare_capture(self, need: int | None, drop_fns) -> None:
        """Before query capture widens to `need` rows (None: all): raise if it cannot, install what it needs."""

    def _cache_length(self, request_id: int) -> int:
        return len(self.tokens(request_id))

    @abstractmethod
    def _check_modify(self, drop_fn, positions: str | None) -> str:
        """Check `modify`'s drop function and positions against the engine; return the positions to use."""

    @abstractmethod
    def _edit_input(self, request_id: int, drop_fn):
        """`(tensors, tokens, reference_kv)` for the drop function (tensors it may edit in place; the cache's
        own KV to validate against), or a string saying why this request has nothing to edit."""

    def _failure_note(self, request_id: int, tensors: dict) -> str:
        """Appended to a failed request's message (e.g. why queries were missing)."""
        return ""

    @abstractmethod
    def _edit_stage(self, request_id: int, new_kv, new_tokens: list[int], keep):
        """Prepare request `request_id`'s edit (validated output; `keep` = kept row indices or None) without
        changing what the request decodes from; returns what `_edit_commit` needs."""

    @abstractmethod
    def _edit_commit(self, request_id: int, staged, positions: str) -> None:
        """Switch the request to its staged edit."""
