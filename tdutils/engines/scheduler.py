"""Decode scheduling shared by the engines: KV-budget admission, block grants, preemption, and the fit checks
(KV budget, context length) with their one-line messages (docs/design.md §2).

Units: every count here is in KV tokens, one cache entry of one request (`[2, L, 1, D]` of its KV). A request's
*need* is its cache length plus the tokens it may generate; its *reservation* is the part of its need granted so
far (all of it with EOS ignored, `KV_BLOCK_TOKENS` at a time with EOS honoured); admission keeps the sum of the
running requests' reservations within `kv_budget_tokens` (vLLM's scheduler: first come first served, preempting
the most recently admitted request when a running one needs its next block).
"""

from __future__ import annotations

import warnings
from collections import deque

from ..checks import admits

KV_BLOCK_TOKENS = 256  # with EOS honoured, decode grants a request its tokens (reservation, storage) in blocks


class DecodeScheduler:
    """Admission, block grants and preemption of one decode call.

    Args:
        cache_lengths: `{request_id: T}`, each request's cache length at decode start (KV tokens).
        limits: `{request_id: n}`, tokens each request generates at most (`max_tokens`, after context caps).
        budget: `kv_budget_tokens` (None: unlimited); max_batch_size: the running batch's cap (None: none).
        block: tokens granted at a time (`KV_BLOCK_TOKENS` with EOS honoured), or None: all `limits` at once.
        caps: `{request_id: c}`, the most KV tokens a request holds at once (decode-time compression: its cache
            bound `+ 1`), or None where it holds all its tokens.

    `waiting` (a deque of requests, first come first served) and `running` (`{slot: request}` in admission
    order) hold objects with a `request_id` and an `output_ids` list; the engine takes requests out of `waiting`
    with `pop_admissible`, puts them in `running` under their slot, deletes them there when they finish, and
    hands them back with `preempt`.
    """

    def __init__(self, cache_lengths: dict[int, int], limits: dict[int, int], *, budget: int | None,
                 max_batch_size: int | None, block: int | None, caps: dict[int, int | None] | None = None):
        self.cache_lengths, self.limits = cache_lengths, limits
        self.budget, self.max_batch_size, self.block = budget, max_batch_size, block
        self.caps = caps or {}
        # tokens each request may generate before it needs more: all of them, or one block at a time
        self.grant = {rid: n if block is None else min(n, block) for rid, n in limits.items()}
        self.waiting: deque = deque()
        self.running: dict = {}

    def _capped(self, rid: int, n: int) -> int:
        cap = self.caps.get(rid)
        return n if cap is None else min(n, cap)

    def need(self, rid: int) -> int:
        """KV tokens request `rid` needs for its whole decode: `T + limit`, at most its cap."""
        return self._capped(rid, self.cache_lengths[rid] + self.limits[rid])

    def reservation(self, rid: int) -> int:
        """KV tokens request `rid` holds granted now: `T + grant`, at most its cap."""
        return self._capped(rid, self.cache_lengths[rid] + self.grant[rid])

    def reserved(self) -> int:
        """The running batch's reservations summed (KV tokens)."""
        return sum(self.reservation(r.request_id) for r in self.running.values())

    def pop_admissible(self, free_slots: int):
        """The next waiting request when a slot is free and its reservation fits beside the running batch's
        (`admits`), removed from `waiting`; else None."""
        if not self.waiting or not free_slots:
            return None
        if not admits(self.reserved(), self.reservation(self.waiting[0].request_id), len(self.running),
                      self.budget, self.max_batch_size):
            return None
        return self.waiting.popleft()

    def needs_block(self, slot: int, r) -> bool:
        """Whether running request `r` (in `slot`) used its whole grant and so needs the next block."""
        return slot in self.running and len(r.output_ids) >= self.grant[r.request_id]

    def grant_block(self, rid: int) -> None:
        """Grant request `rid` its next block (at most up to its limit)."""
        self.grant[rid] = min(self.limits[rid], self.grant[rid] + self.block)

    def over_budget(self) -> bool:
        """Whether the running batch's reservations exceed the budget (after a grant)."""
        return self.budget is not None and self.reserved() > self.budget

    def victim(self, keep_slot: int) -> int:
        """The slot to preempt so that `keep_slot` gets its block: the most recently admitted other request."""
        return next(s for s in reversed(self.running) if s != keep_slot)

    def preempt(self, slot: int):
        """Take the request in `slot` out of the batch, to the front of `waiting`; it resumes where it stopped,
        with its next block when it had used its grant. Returns the request."""
        r = self.running.pop(slot)
        if len(r.output_ids) >= self.grant[r.request_id]:
            self.grant_block(r.request_id)
        self.waiting.appendleft(r)
        return r

    def check_fits(self, compression=None) -> None:
        """ValueError when a request alone needs more KV tokens than the budget (`request_budget_error`)."""
        if self.budget is None:
            return
        for rid, T in self.cache_lengths.items():
            need = self.need(rid)
            if need <= self.budget:
                continue
            if self.caps.get(rid) is not None and need == self.caps[rid]:
                raise compressed_budget_error(rid, need, compression.budget + compression.buffer, T, self.budget)
            raise request_budget_error(rid, T, self.limits[rid], self.budget)


def request_budget_error(request_id: int, cached: int, to_generate: int, budget: int) -> ValueError:
    """The error of a request needing `cached + to_generate` KV tokens, more than `budget` alone."""
    return ValueError(f"request {request_id} needs {cached + to_generate} KV tokens ({cached} cached + {to_generate} "
                      f"to generate) but kv_budget_tokens is {budget}; raise kv_budget_tokens, lower max_tokens, or "
                      f"drop more tokens")


def compressed_budget_error(request_id: int, need: int, top: int, cached: int, budget: int) -> ValueError:
    """The error of a request under decode-time compression (cut at `top` = budget + buffer entries) needing
    `need` KV tokens at once, more than `budget` alone."""
    return ValueError(f"request {request_id} needs {need} KV tokens at once under compression (the largest cache it "
                      f"holds, max(budget + buffer = {top}, its {cached} cached entries), + 1) but kv_budget_tokens is "
                      f"{budget}; raise kv_budget_tokens, lower the compression's budget or buffer, or cut the prompt "
                      f"at prefill (prefill(..., compression=...))")


def check_extension_fits(request_id: int, cached: int, extension: int, budget: int | None,
                         max_model_len: int | None = None) -> None:
    """`extend`: a request's `cached` KV tokens plus an `extension` must leave one KV token to decode into under
    `budget`, and (a server's `max_model_len`, when given) stay below it. ValueError with the numbers otherwise."""
    n = cached + extension
    if max_model_len and n >= max_model_len:
        raise ValueError(f"request {request_id} would be {n} tokens ({cached} + {extension} extension) but vLLM's "
                         f"max_model_len is {max_model_len}; shorten the extension or drop more")
    if budget is not None and n + 1 > budget:
        raise ValueError(f"request {request_id} would hold {n} KV tokens ({cached} cached + {extension} extension) and "
                         f"needs at least one more to decode, but kv_budget_tokens is {budget}; raise kv_budget_tokens, "
                         f"shorten the extension, or drop more tokens")


def check_prompt_fits(index: int, tokens: int, pad: int, max_model_len: int | None) -> None:
    """A serving engine's prompt of `tokens` (`pad` of them padding) must stay below vLLM's `max_model_len`."""
    if max_model_len and tokens >= max_model_len:
        raise ValueError(f"prompt {index} has {tokens} tokens (with {pad} padding) but vLLM's max_model_len is "
                         f"{max_model_len}; shorten it or start vLLM with a larger --max-model-len")


def warn_past_context(what: str, last: int, max_pos: int | None, how: str = "", *, stacklevel: int = 3) -> None:
    """Warn when `what` (a phase) feeds position `last` at or beyond the model's `max_position_embeddings`."""
    if max_pos and last >= max_pos:
        warnings.warn(f"{what} feeds position {last}, beyond the model's max_position_embeddings {max_pos}: "
                      f"positions past it are extrapolation{how}", stacklevel=stacklevel + 1)


def context_limits(limits: dict[int, int], refeed: dict[int, int], max_pos: int | None,
                   bounds: dict[int, int] | None = None, top: int | None = None) -> dict[int, int]:
    """`max_tokens` per request capped at the model's context, for every decode setting (EOS honoured or not,
    with or without compression): the largest position request `rid` feeds, `refeed[rid] + limits[rid] - 1`
    (under compact compression, `bounds`, at most its cache bound - 1: cuts renumber the cache), stays below
    `max_pos`; a warning names the capped requests (`top`: compact compression's budget + buffer, for the
    message). A cache already past the context (a prompt longer than it) decodes one token and warns that it
    is extrapolation."""
    if not max_pos:
        return limits
    capped = {}
    for rid, n in limits.items():
        last = refeed[rid] + n - 1
        if bounds is not None:
            last = min(last, bounds[rid] - 1)
        capped[rid] = max(1, min(n, max_pos - refeed[rid])) if last >= max_pos else n
    few = [i for i in capped if capped[i] < limits[i]]
    if few:
        why = "" if bounds is None else (f"; compact compression renumbers positions, but budget + buffer = {top} "
                                         f"(or a longer start cache) reaches past the context")
        warnings.warn(f"max_tokens capped at the model's context (max_position_embeddings {max_pos}) for "
                      f"{len(few)} request(s), e.g. request {few[0]}: {capped[few[0]]} tokens; they stop there "
                      f"with finish_reason 'length'{why}", stacklevel=5)
    last = max(refeed.values())
    if last >= max_pos:
        warnings.warn(f"decoding feeds position {last}, beyond the model's max_position_embeddings {max_pos} "
                      f"(the prompt is past it): outputs there are extrapolation", stacklevel=5)
    return capped
