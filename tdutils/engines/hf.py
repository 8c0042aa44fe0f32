"""The embedded `hf` engine: in-process Hugging Face transformers prefill, modify and batched decode.

Per request the engine keeps its KV cache as one `[2, L, T, D]` tensor (SPEC §3). Decoding runs many
requests of different lengths in one batch: caches are left-padded to a common length, an attention
mask hides the padding, and every row gets its own `position_ids`. Requests join the running batch
only while the sum over the batch of (cache length + tokens still to generate) fits `kv_budget_tokens`
— so a smaller cache per request means a bigger batch, which is the point of token dropping.

Decode regenerates from the edited cache, as vLLM does after LMCache returns a modified prefix: the
last cached entry is removed and the last kept prompt token is fed again at its position, so every
generated token (the first one included) attends to the edited cache only.

Positions (SPEC §3): `"compact"` (default) — the drop function re-rotates kept keys to positions
0..k-1 and decoding continues at k; `"original"` — keys keep their rotation and decoding continues at
T, the prompt length (the dropped positions simply become holes).
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..edit import CacheKind, DropFunctionError, check_kv, validate_drop_output
from ..metrics import DecodeMetrics, ModifyMetrics, RunMetrics
from ..models import load_model, model_facts
from .base import ModifyReport, RequestOutput, check_engine_settings, tokenize_prompts
from .capture import QueryRecorder, capture_implementation, recording
from .kvstore import SlotKVStore, plan_slots

POSITIONS = ("compact", "original")


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]
    kv: torch.Tensor  # [2, L, T, D]
    tokens: list[int]  # the T token ids the cache holds
    refeed_pos: int  # position of the last cached token, fed again at decode start
    query: torch.Tensor | None = None  # [L, Tq, Hq*d], last Tq prompt tokens; None after an edit
    ttft_s: float = float("nan")
    # decode state
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logits: list | None = None
    finish_reason: str = "length"


class HFEngine:
    """Embedded engine over a transformers causal LM (Qwen3, Llama, Mistral, ... with a `DynamicCache`).

    Args:
        model: a bundled name (`"tiny-qwen3"`), hub id, local folder, or an already loaded model
            (then pass `tokenizer=` too).
        tokenizer: tokenizer when `model` is a model object.
        dtype, device, attn_implementation: passed to `tdutils.models.load_model`.
        kv_budget_tokens: KV tokens the running decode batch may hold (cache lengths plus tokens still
            to generate); None = unlimited (every request decodes in one batch).
        max_batch_size: optional cap on the running batch.
        prefill_batch_size: prompts prefilled together (left-padded).
        positions: `"compact"` or `"original"` (see module docstring).
        query_window: how many final prompt tokens' query states prefill captures per request (`[L, Tq,
            Hq*d]`, after q_norm and RoPE) for policies that need them (SnapKV, R-KV); default 64, the
            largest default policy window; None captures all tokens; 0 captures nothing.
        progress: show tqdm progress bars for the prefill and decode phases.

    Query capture switches the model to a registered attention function that wraps its `sdpa` or
    `eager` attention (`tdutils.engines.capture`); outputs are unchanged.
    """

    kind = "hf"

    def __init__(self, model="tiny-qwen3", *, tokenizer=None, dtype="auto", device=None,
                 attn_implementation: str | None = "sdpa", kv_budget_tokens: int | None = None,
                 max_batch_size: int | None = None, prefill_batch_size: int = 4, positions: str = "compact",
                 query_window: int | None = 64, progress: bool = True):
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        check_engine_settings(kv_budget_tokens, max_batch_size, query_window)
        if prefill_batch_size < 1:
            raise ValueError(f"prefill_batch_size must be >= 1, got {prefill_batch_size}")
        if isinstance(model, str):
            self.model_name = model
            self.model, self.tokenizer = load_model(model, dtype=dtype, device=device, progress=progress,
                                                    attn_implementation=attn_implementation)
        else:
            if tokenizer is None:
                raise ValueError("pass tokenizer= together with a model object")
            self.model_name = getattr(model, "name_or_path", type(model).__name__)
            self.model, self.tokenizer = model.eval(), tokenizer
        self.device = next(self.model.parameters()).device
        self.query_window = query_window
        if query_window != 0:
            self.model.set_attn_implementation(capture_implementation(self.model.config._attn_implementation))
        self.facts = model_facts(self.model.config, self.model.dtype)
        self.kv_budget_tokens = kv_budget_tokens
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.positions = positions
        self.progress = progress
        self.eos_token_id = self.tokenizer.eos_token_id  # decode stops on it unless ignore_eos
        # transformers renamed `past_key_values` to `cache` during 5.x; support both spellings.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.requests: list[_Request] = []
        self.metrics = RunMetrics("run")

    # ------------------------------------------------------------------ helpers
    @property
    def config(self):
        return self.model.config

    def tokenize(self, prompts) -> list[list[int]]:
        """Token ids of each prompt: a string, a `PromptRow`/dict with `prompt`, or a list of ids."""
        return tokenize_prompts(self.tokenizer, prompts, self.model.config.vocab_size)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep=1):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, logits_to_keep=logits_to_keep, **{self._cache_kw: cache})

    def _bar(self, total, desc):
        from tqdm.auto import tqdm

        # delay: a bar appears only for phases that take more than a couple of seconds
        return tqdm(total=total, desc=desc, disable=not self.progress, leave=False, mininterval=1.0, delay=2.0)

    # ------------------------------------------------------------------ phases
    @torch.inference_mode()
    def prefill(self, prompts) -> list[torch.Tensor]:
        """Prefill every prompt (in left-padded batches of `prefill_batch_size`); one cache per request.

        Args:
            prompts: strings, `PromptRow`s, dicts with `prompt`, or lists of token ids.

        Returns:
            List of each request's KV `[2, L, T, D]` (model dtype, model device). The engine keeps them;
            `kv(i)` returns one again. Resets the engine's requests and metrics.
        """
        ids = self.tokenize(prompts)
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        if max_pos and max(map(len, ids)) > max_pos:
            warnings.warn(f"a prompt of {max(map(len, ids))} tokens is longer than the model's "
                          f"max_position_embeddings {max_pos}: positions past it are extrapolation", stacklevel=2)
        self.requests, self.metrics = [], RunMetrics("run")
        pm = self.metrics.prefill
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        t0 = time.perf_counter()
        bar = self._bar(sum(map(len, ids)), "prefill")
        ttft = [0.0] * len(ids)
        for start in range(0, len(ids), self.prefill_batch_size):
            batch = ids[start:start + self.prefill_batch_size]
            lens = [len(x) for x in batch]
            width = max(lens)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for b, x in enumerate(batch):  # left padding
                input_ids[b, width - len(x):] = torch.tensor(x)
                mask[b, width - len(x):] = 1
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, width]; 0..T-1 on real tokens
            cache = self._new_cache()
            recorder = QueryRecorder(self.query_window)
            with recording(recorder):
                self._forward(input_ids.to(self.device), mask.to(self.device), position_ids.to(self.device), cache)
            now = time.perf_counter() - t0
            for b, x in enumerate(batch):
                pad = width - len(x)
                # cache layer keys/values: [B, H_kv, width, d] -> this row's [L, T, H_kv*d]
                k = torch.stack([lay.keys[b, :, pad:, :].transpose(0, 1).reshape(len(x), -1) for lay in cache.layers])
                v = torch.stack([lay.values[b, :, pad:, :].transpose(0, 1).reshape(len(x), -1) for lay in cache.layers])
                kv = torch.stack([k, v])  # [2, L, T, D]
                query = None
                if self.query_window != 0:
                    tq = len(x) if self.query_window is None else min(self.query_window, len(x))
                    # recorded [B, Hq, window, d] -> this row's last tq tokens [L, tq, Hq*d]
                    query = torch.stack([recorder.layers[i][b, :, -tq:, :].transpose(0, 1).reshape(tq, -1)
                                         for i in range(len(cache.layers))])
                rid = start + b
                ttft[rid] = now
                self.requests.append(_Request(rid, x, kv, list(x), refeed_pos=len(x) - 1, ttft_s=now, query=query))
            bar.update(sum(lens))
            del cache
        bar.close()
        pm.requests, pm.tokens, pm.seconds, pm.ttft_s = len(ids), sum(map(len, ids)), time.perf_counter() - t0, ttft
        return [r.kv for r in self.requests]

    def kv(self, request_id: int) -> torch.Tensor:
        """The current KV `[2, L, T, D]` of one request (after `modify`, the edited one)."""
        return self.requests[request_id].kv

    def query(self, request_id: int) -> torch.Tensor | None:
        """The captured query `[L, Tq, Hq*d]` of one request (rows aligned to the end of its KV), or None."""
        return self.requests[request_id].query

    def tensors(self, request_id: int) -> dict:
        """What a drop function receives for one request: `{CacheKind.KV: kv[, CacheKind.QUERY: q]}`."""
        req = self.requests[request_id]
        tensors = {CacheKind.KV: req.kv}
        if req.query is not None:
            tensors[CacheKind.QUERY] = req.query
        return tensors

    @torch.inference_mode()
    def check_query(self, request_id: int, rows: int = 8) -> float:
        """Validate a request's captured queries against its keys: recompute the attention of its last
        `rows` prompt tokens from the captured `q` and `kv` (`softmax(q·kᵀ/sqrt(d))`, causal) and compare
        with the model's own attention probabilities (eager attention, `output_attentions=True`).

        Returns:
            The largest absolute difference over layers, heads and rows (≈1e-7 in fp32 when the capture is
            right; a mixed-up row gives differences of order 0.1–1).

        Raises:
            RuntimeError: the request has no captured query (query_window=0, or after modify).
        """
        from ..policies.snapkv import window_attention

        req = self.requests[request_id]
        if req.query is None:
            raise RuntimeError(f"request {request_id} has no captured query (query_window=0, or it was edited)")
        rows = min(rows, req.query.shape[1])
        impl = self.model.config._attn_implementation
        self.model.set_attn_implementation(capture_implementation("eager"))  # only eager returns probabilities
        try:
            ids = torch.tensor([req.prompt_ids], device=self.device)
            att = self.model(input_ids=ids, output_attentions=True).attentions  # L x [1, Hq, T, T]
        finally:
            self.model.set_attn_implementation(impl)
        worst = 0.0
        for layer, a in enumerate(att):
            mine = window_attention(req.kv[0, layer], req.query[layer, -rows:], self.facts.num_kv_heads)
            worst = max(worst, float((mine - a[0, :, -rows:, :].float()).abs().max()))
        return worst

    def tokens(self, request_id: int) -> list[int]:
        """The token ids the cache of one request holds."""
        return list(self.requests[request_id].tokens)

    @torch.inference_mode()
    def modify(self, drop_fn, *, positions: str | None = None, on_error: str = "raise") -> ModifyReport:
        """Apply `drop_fn(tensors, tokens) -> (new_kv, new_tokens)` to every request's cache.

        Args:
            drop_fn: an LMCache-style ModifyFn (e.g. from `tdutils.make_drop_fn`). It receives
                `{CacheKind.KV: kv [2, L, T, D], CacheKind.QUERY: q [L, Tq, Hq*d]}` (the query when
                captured, i.e. before the first edit) and the T token ids.
            positions: `"compact"` / `"original"`; default the engine's setting. A `DropFn` whose
                `rerotate` disagrees (compact needs re-rotated keys, original needs untouched ones) is
                refused before anything runs.
            on_error: `"raise"` — if any request fails, no cache is changed and `DropFunctionError` lists
                every failure; `"skip"` — failed requests keep their cache unchanged, the others are
                edited, failures are returned in the report and warned about.

        Raises:
            RuntimeError: called before `prefill`.
            ValueError: bad `positions` / `on_error`, or a `DropFn` whose `rerotate` contradicts positions.
            DropFunctionError: with `on_error="raise"`, when the function raised or returned bad output.
        """
        if not self.requests:
            raise RuntimeError("modify() needs prefilled requests; call prefill(prompts) first")
        positions = positions or self.positions
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        rerotate = getattr(drop_fn, "rerotate", None)
        if rerotate is not None and rerotate != (positions == "compact"):
            raise ValueError(f"positions={positions!r} needs a drop function with rerotate={positions == 'compact'}, "
                             f"got rerotate={rerotate}; build it with make_drop_fn(..., rerotate={positions == 'compact'})")
        mm = self.metrics.modify = ModifyMetrics()
        t0 = time.perf_counter()
        edits, failures = {}, []
        for req in self.requests:
            try:
                # a copy: a drop function that edits its input in place and then fails must not touch the cache
                tensors = {kind: t.clone() for kind, t in self.tensors(req.request_id).items()}
                result = drop_fn(tensors, list(req.tokens))
                edits[req.request_id] = validate_drop_output(req.kv, req.tokens, result,
                                                             vocab_size=self.model.config.vocab_size)
            except Exception as exc:  # noqa: BLE001 (any failure of user code is reported below, never swallowed)
                failures.append((req.request_id, f"{exc.__class__.__name__}: {exc}"))
        mm.seconds = time.perf_counter() - t0
        mm.tokens_before = sum(r.kv.shape[2] for r in self.requests)
        if failures and on_error == "raise":
            mm.failed = len(failures)
            mm.tokens_after = mm.tokens_before
            lines = "\n".join(f"  request {i}: {msg}" for i, msg in failures[:10])
            raise DropFunctionError(f"the drop function failed on {len(failures)} of {len(self.requests)} requests; "
                                    f"no cache was changed:\n{lines}")
        for req in self.requests:
            if req.request_id in edits:
                new_kv, new_tokens = edits[req.request_id]
                req.kv, req.tokens = new_kv, new_tokens
                req.query = None  # the captured rows belonged to the unedited prompt
                # compact: the last kept token sits at k-1; original: the prompt's last position T-1.
                req.refeed_pos = len(new_tokens) - 1 if positions == "compact" else len(req.prompt_ids) - 1
        mm.edited, mm.failed = len(edits), len(failures)
        mm.tokens_after = sum(r.kv.shape[2] for r in self.requests)
        if failures:
            warnings.warn(f"drop function failed on {len(failures)} requests (caches left unchanged): {failures[:3]}",
                          stacklevel=2)
        return ModifyReport(edited=len(edits), failures=failures)

    @torch.inference_mode()
    def decode(self, max_tokens: int | Sequence[int] = 64, *, temperature: float = 0.0, ignore_eos: bool = True, seed: int = 0,
               keep_logits: bool = False) -> list[RequestOutput]:
        """Batched decoding of every request under the KV budget; returns one `RequestOutput` per request.

        Requests are admitted first come first served while `sum(cache_len + tokens_to_generate)` over the
        running batch stays within `kv_budget_tokens` (and the batch within `max_batch_size`); a request
        leaves the batch when it has `max_tokens` tokens (or generated EOS with `ignore_eos=False`).

        Args:
            max_tokens: tokens to generate per request (>= 1): one int for all, or one per request.
            temperature: 0 = greedy; > 0 samples from softmax(logits / temperature) with `seed`.
            ignore_eos: keep generating after an EOS token (fixed output lengths, for benchmarks).
            keep_logits: store each step's logits `[vocab]` (fp32, or the model dtype when wider) in the outputs.

        Raises:
            RuntimeError: called before `prefill`.
            ValueError: `max_tokens < 1`, negative temperature, or a request that alone needs more KV
                tokens than `kv_budget_tokens` (the message gives both numbers).
        """
        if not self.requests:
            raise RuntimeError("decode() needs prefilled requests; call prefill(prompts) first")
        per_request = list(max_tokens) if isinstance(max_tokens, Sequence) else [max_tokens] * len(self.requests)
        if len(per_request) != len(self.requests):
            raise ValueError(f"max_tokens has {len(per_request)} entries for {len(self.requests)} requests")
        for m in per_request:
            if isinstance(m, bool) or int(m) != m or m < 1:
                raise ValueError(f"max_tokens must be a positive integer, got {m!r}")
        limit = {r.request_id: int(m) for r, m in zip(self.requests, per_request)}
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        budget = self.kv_budget_tokens
        need = {r.request_id: r.kv.shape[2] + limit[r.request_id] for r in self.requests}
        if budget is not None:
            for r in self.requests:
                if need[r.request_id] > budget:
                    raise ValueError(
                        f"request {r.request_id} needs {need[r.request_id]} KV tokens ({r.kv.shape[2]} cached + "
                        f"{limit[r.request_id]} to generate) but kv_budget_tokens is {budget}; raise kv_budget_tokens, "
                        f"lower max_tokens, or drop more tokens")
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        if max_pos:
            # positions fed: the refeed (k-1 or T-1) and then max_tokens - 1 generated tokens
            last = max(r.refeed_pos + limit[r.request_id] - 1 for r in self.requests)
            if last >= max_pos:
                warnings.warn(f"decoding feeds position {last}, beyond the model's max_position_embeddings "
                              f"{max_pos}: outputs there are extrapolation; lower max_tokens", stacklevel=2)
        dm = self.metrics.decode = DecodeMetrics(kv_budget_tokens=budget)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        eos = self.eos_token_id
        for r in self.requests:
            r.output_ids, r.token_times, r.finish_reason = [], [], "length"
            r.logits = [] if keep_logits else None

        store = self._new_store([need[r.request_id] for r in self.requests], budget)
        dm.kv_storage_tokens, dm.kv_storage_bytes = store.slots * store.width, store.bytes
        n_slots = store.slots
        next_ids = torch.zeros(n_slots, dtype=torch.long, device=self.device)  # per slot: token fed next step
        next_pos = torch.zeros(n_slots, dtype=torch.long, device=self.device)  # and its position
        waiting = deque(self.requests)
        running: dict[int, _Request] = {}  # slot -> request
        bar = self._bar(sum(limit.values()), "decode")
        t0 = time.perf_counter()
        while waiting or running:
            reserved = sum(need[r.request_id] for r in running.values())
            while waiting and store.free_slots and (budget is None or reserved + need[waiting[0].request_id] <= budget) and (
                    self.max_batch_size is None or len(running) < self.max_batch_size):
                r = waiting.popleft()
                slot = self._admit(store, r)
                running[slot] = r
                next_ids[slot], next_pos[slot] = r.tokens[-1], r.refeed_pos
                reserved += need[r.request_id]
            dm.peak_batch_size = max(dm.peak_batch_size, len(running))
            dm.kv_peak_reserved_tokens = max(dm.kv_peak_reserved_tokens, reserved)

            rows = store.rows
            store.begin_step(next_pos[:rows])
            out = self._forward(next_ids[:rows, None], self._decode_masks(store, next_pos[:rows]),
                                next_pos[:rows, None], store.cache())
            store.end_step()
            logits = out.logits[:, -1, :]  # [rows, vocab]; idle rows (free slots) are ignored
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()  # sampling and keep_logits in at least fp32
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1).cpu()
                new_ids = torch.multinomial(probs, 1, generator=gen).flatten()
            else:
                new_ids = logits.argmax(dim=-1).cpu()
            now = time.perf_counter() - t0
            dm.steps += 1
            bar.update(len(running))
            for slot, r in list(running.items()):
                tok = int(new_ids[slot])
                r.output_ids.append(tok)
                r.token_times.append(now)
                if keep_logits:
                    r.logits.append(logits[slot].cpu())
                if len(r.output_ids) >= limit[r.request_id]:
                    del running[slot]
                    store.release(slot)
                elif not ignore_eos and eos is not None and tok == eos:
                    r.finish_reason = "stop"
                    del running[slot]
                    store.release(slot)
            next_ids[:rows] = new_ids.to(self.device)
            next_pos[:rows] += 1
        dm.seconds = time.perf_counter() - t0
        bar.close()

        outputs = []
        for r in self.requests:
            dm.output_tokens += len(r.output_ids)
            t = r.token_times
            tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
            if len(t) > 1:
                dm.tpot_s.append(tpot)
            outputs.append(RequestOutput(
                request_id=r.request_id, prompt_tokens=len(r.prompt_ids), cached_tokens=r.kv.shape[2],
                output_ids=list(r.output_ids), text=self.tokenizer.decode(r.output_ids, skip_special_tokens=True),
                finish_reason=r.finish_reason, ttft_s=r.ttft_s, tpot_s=tpot, logits=r.logits))
        return outputs

    # ------------------------------------------------------------------ batch bookkeeping
    def _row_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[2, L, T, D]` -> keys, values `[L, H_kv, T, d]` (the layout of a cache layer, batch dim removed)."""
        L, T = kv.shape[1], kv.shape[2]
        h, d = self.facts.num_kv_heads, self.facts.head_dim
        kv = kv.view(2, L, T, h, d).transpose(2, 3)  # [2, L, H_kv, T, d]
        return kv[0], kv[1]

    def _new_store(self, needs: list[int], budget: int | None) -> SlotKVStore:
        """Preallocated decode storage for requests needing `needs` KV tokens (see `engines.kvstore`)."""
        plan = plan_slots(needs, budget, self.max_batch_size)
        windows = self._layer_windows()
        return SlotKVStore(num_layers=self.facts.num_layers, num_kv_heads=self.facts.num_kv_heads,
                           head_dim=self.facts.head_dim, slots=plan.slots, width=plan.width, dtype=self.model.dtype,
                           device=self.device, track_positions=any(w is not None for w in windows.values()))

    def _admit(self, store: SlotKVStore, r: _Request) -> int:
        """Copy a request's cache minus its last entry into a free slot (that entry's token is fed again at
        `refeed_pos`, so the first generated token is computed over the edited cache); returns the slot."""
        check_kv(r.kv, r.tokens)
        k, v = self._row_kv(r.kv)
        positions = None
        if store.positions is not None:
            n = r.kv.shape[2]
            if getattr(r, "positions", None) is not None:
                positions = torch.as_tensor(r.positions[:-1])
            elif n == len(r.prompt_ids) or self.positions == "compact":
                positions = torch.arange(n - 1)
            else:
                raise NotImplementedError("sliding-window layers with positions='original' after an edit need the "
                                          "kept positions of each request; use positions='compact'")
        return store.admit(k[:, :, :-1, :], v[:, :, :-1, :], positions)

    def _layer_windows(self) -> dict[str, int | None]:
        """Sliding window (tokens) of each layer type the model has; None for full attention.

        Raises:
            NotImplementedError: a layer type other than full / sliding attention (chunked, linear, ...).
        """
        cfg = self.model.config
        types = getattr(cfg, "layer_types", None)
        if not types:  # Mistral-style configs: every layer slides when `sliding_window` is set
            window = getattr(cfg, "sliding_window", None)
            return {"sliding_attention" if window else "full_attention": window}
        out = {}
        for t in set(types):
            if t == "full_attention":
                out[t] = None
            elif t == "sliding_attention":
                out[t] = cfg.sliding_window
            else:
                raise NotImplementedError(f"the hf engine's decode does not support {t!r} layers "
                                          f"({type(self.model).__name__})")
        return out

    def _decode_masks(self, store: SlotKVStore, query_positions: torch.Tensor):
        """Prepared 4D masks of one decode step (`[rows, 1, 1, cols]`, bool for sdpa, additive for eager): one
        tensor when every layer has the same kind, else a dict by layer type (what the model's forward takes)."""
        additive = self.model.dtype if "eager" in self.model.config._attn_implementation else None
        masks = {t: store.attention_mask(window=w, query_positions=query_positions, additive_dtype=additive)
                 for t, w in self._layer_windows().items()}
        return next(iter(masks.values())) if len(masks) == 1 else masks
