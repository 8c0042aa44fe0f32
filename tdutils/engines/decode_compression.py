"""Decode-time compression (R-KV's setting, arXiv:2505.24133; `decode(compression=...)`): the pieces both engines
share (the cut built from a `Compression`, the fit of a compressed request under the KV budget, the bookkeeping of
each cut by sequence index) and the `hf` engine's in-batch compressor (`SlotCompressor`), which cuts a request's
cache in its decode slot. The `lmcache` engine cuts between vLLM requests instead (rounds: decode, prefill what
was fed, retrieve, cut, store under a new salt), so its loop stays in `engines.lmcache`.

Sequence index: a request's cache at decode start holds entries `0..T-1`; its `j`-th generated token is `T + j`.
Each cut is reported as `{"step": tokens generated, "before": entries, "after": entries, "kept": [indices]}`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from ..attention import recording
from ..compression import Compression
from ..kvcache import CacheKind
from .kvstore import SlotKVStore


def decode_cut(compression, model_config, *, rerotate: bool):
    """The drop function (by budget) of a decode-time `compression` (`Compression.drop_fn`).

    Raises:
        TypeError: `compression` is not a `tdutils.compression.Compression`.
        ValueError: what `Compression.drop_fn` raises (a policy that cannot keep exactly the budget).
    """
    if not isinstance(compression, Compression):
        raise TypeError(f"compression must be a tdutils.compression.Compression, got {type(compression).__name__}")
    return compression.drop_fn(model_config=model_config, rerotate=rerotate)


def cut_event(seq: list[int], keep: list[int], step: int, rows: int | None = None) -> tuple[list[int], dict]:
    """One cut of a cache whose entries have sequence indices `seq` (length `before`): the cut kept rows `keep`
    of its first `rows` entries (default all) and the entries after them stay. Returns the kept entries'
    sequence indices and the event `{"step", "before", "after", "kept"}` (`RequestOutput.compressions`)."""
    rows = len(seq) if rows is None else rows
    kept = [seq[j] for j in keep] + seq[rows:]
    return kept, {"step": step, "before": len(seq), "after": len(kept), "kept": list(kept)}


class _RingRecorder:
    """Capture hook of one decode step: each layer's query of the fed tokens `[rows, Hq, 1, d]` goes into its
    row's ring slot (`ring [S, L, w, Hq*d]`, column `cols[row]`)."""

    def __init__(self, ring: torch.Tensor, index: torch.Tensor, cols: torch.Tensor):
        self.ring, self.index, self.cols = ring, index, cols

    def record(self, layer_idx, query, key, kwargs):
        self.ring[self.index, layer_idx, self.cols] = query[:, :, 0, :].reshape(query.shape[0], -1).to(self.ring.dtype)


class SlotCompressor:
    """Decode-time compression of one `decode` call (`HFEngine.decode(compression=...)`, R-KV's loop).

    `engine`: the hf engine (`facts`, `positions`, `model`, `device`); a request `r` is its request record (`kv`
    `[2, L, T, D]`, `tokens`, `query` `[L, Tq, Hq*d]` or None, `request_id`, `output_ids`).

    Per slot it keeps a ring of the last `w` fed tokens' queries `[S, L, w, Hq*d]` (written by the capture hook
    during the forward); per request the token ids of its cached entries and their index in the request's
    sequence (its cache at decode start, then its generated tokens), so each cut is reported by sequence index.
    """

    def __init__(self, engine, compression: Compression):
        self.engine = engine
        self.cut = decode_cut(compression, engine.facts, rerotate=engine.positions == "compact")
        self.budget, self.buffer, self.w = compression.budget, compression.buffer, self.cut.query_rows
        self.compact = engine.positions == "compact"
        f = engine.facts
        self.L, self.h, self.d = f.num_layers, f.num_kv_heads, f.head_dim
        self.state: dict[int, dict] = {}
        if self.w:
            engine._prepare_capture(self.w, ())  # the capture hook is installed even with query_window=0

    def _prompt_rows(self, r) -> int:
        """Rows of the captured prompt query usable as the ring's first rows (the refed token's own row is
        computed again by the first step, so it is left out)."""
        if not self.w or r.query is None:
            return 0
        return min(self.w, r.query.shape[1] - 1)

    def bound(self, r) -> int:
        """Most cache entries `r` holds at once: `B + N`, or its start cache (plus the steps until its first `w`
        queries exist) when that is longer."""
        T = r.kv.shape[2]
        return max(self.budget + self.buffer, T, T - 1 + self.w - self._prompt_rows(r))

    def start(self, store: SlotKVStore) -> None:
        self.store = store
        if self.w:
            hq_d = self.engine.facts.num_query_heads * self.d
            self.ring = torch.zeros((store.slots, self.L, self.w, hq_d), dtype=self.engine.model.dtype,
                                    device=self.engine.device)
        self.count = [0] * store.slots  # queries written to each slot's ring since it joined / was last cut

    def join(self, slot: int, r, resumed: bool) -> None:
        st = self.state.get(r.request_id)
        if st is None:  # first admission: the cached entries are the start cache minus the refed token
            T = r.kv.shape[2]
            st = self.state[r.request_id] = {"tokens": list(r.tokens[:-1]), "seq": list(range(T - 1)), "next": T - 1,
                                             "events": [], "saved": None}
            a = self._prompt_rows(r)
            if a:
                self.ring[slot, :, :a] = r.query[:, -1 - a:-1].to(self.ring.dtype)
            self.count[slot] = a
        elif resumed and st["saved"] is not None:  # back from preemption with its ring
            ring, self.count[slot] = st["saved"]
            if self.w:
                self.ring[slot] = ring
            st["saved"] = None

    def leave(self, slot: int, r) -> None:
        st = self.state[r.request_id]
        st["saved"] = (self.ring[slot].clone() if self.w else None, self.count[slot])

    def capture(self, rows: int):
        """Context manager for one step's forward: each layer's query of the fed tokens goes into the ring."""
        if not self.w:
            return nullcontext()
        cols = torch.tensor([c % self.w for c in self.count[:rows]], device=self.engine.device)
        return recording(_RingRecorder(self.ring, torch.arange(rows, device=self.engine.device), cols))

    def after_step(self, stepped: list, running: dict, fed: list[int], next_pos: torch.Tensor, dm) -> None:
        """Book the tokens the step cached (every request in `stepped`); cut every cache still `running` that
        reached `B + N` (with its `w` queries)."""
        B = self.budget
        for slot, r in stepped:
            st = self.state[r.request_id]
            st["tokens"].append(fed[slot])
            st["seq"].append(st["next"])
            st["next"] += 1
            self.count[slot] += 1
            n = len(st["tokens"])
            dm.kv_peak_cache_tokens = max(dm.kv_peak_cache_tokens, n)
            assert n <= self.bound(r), (n, self.bound(r))  # the reservation admission counted on
            if slot in running and n >= B + self.buffer and self.count[slot] >= self.w:
                t0 = time.perf_counter()
                self._cut_slot(slot, r, st, n, next_pos)
                dm.compressions += 1
                dm.compress_seconds += time.perf_counter() - t0

    def _cut_slot(self, slot: int, r, st: dict, n: int, next_pos: torch.Tensor) -> None:
        store, L, h, d = self.store, self.L, self.h, self.d
        keys = torch.stack([store.keys[i][slot, :, :n] for i in range(L)])  # [L, H_kv, n, d]
        values = torch.stack([store.values[i][slot, :, :n] for i in range(L)])
        kv = torch.stack([keys, values]).transpose(2, 3).reshape(2, L, n, h * d)  # [2, L, n, D]
        tensors = {CacheKind.KV: kv}
        if self.w:
            c = self.count[slot]
            order = [(c - self.w + i) % self.w for i in range(self.w)]  # oldest first: aligned to the KV's end
            tensors[CacheKind.QUERY] = self.ring[slot][:, order]  # [L, w, Hq*d]
        new_kv, new_tokens, keep = self.cut.edit(tensors, st["tokens"])
        k = new_kv.shape[2]
        assert k <= self.budget, (k, self.budget)  # DropFn (by budget) refuses more; the budget is never exceeded
        new = new_kv.view(2, L, k, h, d).transpose(2, 3)  # [2, L, H_kv, k, d]
        for i in range(L):
            store.keys[i][slot, :, :k] = new[0, i]
            store.values[i][slot, :, :k] = new[1, i]
        keep_list = keep.tolist()
        if self.compact:  # kept keys now sit at 0..k-1; the token generated last is fed at k
            store.positions[slot, :k] = torch.arange(k, device=store.positions.device)
            next_pos[slot] = k
        else:  # keys keep their rotation and positions
            store.positions[slot, :k] = store.positions[slot, :n][keep.to(store.positions.device)].clone()
        store.lengths[slot] = k
        st["tokens"] = new_tokens
        st["seq"], event = cut_event(st["seq"], keep_list, len(r.output_ids))
        st["events"].append(event)
        self.count[slot] = 0  # the ring's rows belong to the cache before the cut (compact: other positions)

    def events(self, r) -> list[dict]:
        st = self.state.get(r.request_id)
        return [] if st is None else st["events"]
