"""Preallocated KV storage for the `hf` engine's batched decode: slots written in place (docs/design.md §2).

`SlotKVStore` holds, per layer, keys and values `[S, H_kv, W, d]` allocated once per decode phase (`S` slots and
`W` tokens per slot, from `plan_slots`), instead of a `DynamicCache` that copies the batch at every step. A
request is admitted into a free slot (its cache copied once to columns `0..n-1`); each step writes every row's
new key and value in place at its length and attention reads the view `[:rows, :, :cols]`; a finished request
releases its slot and nothing else moves; `grow` widens slots and `take` copies one out (preemption). Attention
stays exact under the prepared mask `attention_mask` (columns past a row's length hidden; sliding windows by
stored *position*, so a key's column never matters). Storage is `S × W` tokens per layer; `padding_tokens`
bounds what no request can use.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch


@functools.cache
def _glibc_trim():
    """glibc's `malloc_trim`, or None (another C library, or not Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname; find_library would run ldconfig in a subprocess
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Hand the host heap's freed pages back to the OS before a decode allocates its store (glibc `malloc_trim(0)`);
    returns False where there is no glibc (then nothing happens).

    Why: glibc serves allocations under its mmap threshold (at most 32 MiB, so every per-layer tensor of a batch of
    caches) from its heap and keeps what is freed there. A CPU process that edits, extends and decodes batch after
    batch (`tdutils.eval`) then holds its live tensors plus that many freed pages: one worker of the default
    leaderboard grid, 13 prompts of `ruler_niah_multivalue_partial` x 62 cells, peaked at 10.1-10.4 GiB resident
    and 7.05 GiB with this call before each decode, in the same time (405 s against 413-420 s, one thread)."""
    trim = _glibc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@dataclass(frozen=True)
class SlotPlan:
    """Storage shape for one decode phase: `slots` rows of `width` tokens.

    Attributes:
        slots: S, the most requests that can decode at once under the budget (and the batch cap).
        width: W, tokens per slot: the largest `cache length + tokens to generate - 1` over the requests.
        admissible_tokens: the largest sum of needs (`cache + tokens to generate`) of `slots` requests that
            fits the budget; `slots * width - admissible_tokens` bounds the padding (storage no request uses).
    """

    slots: int
    width: int
    admissible_tokens: int

    @property
    def storage_tokens(self) -> int:
        return self.slots * self.width

    @property
    def padding_tokens(self) -> int:
        return max(0, self.storage_tokens - self.admissible_tokens)


def plan_slots(needs: list[int], budget: int | None, max_batch_size: int | None = None) -> SlotPlan:
    """Size the storage for requests needing `needs[i]` KV tokens (cache length + tokens to generate).

    `slots` is the largest number of requests whose needs fit `budget` together (taking the smallest needs
    first, so no admission order can run more at once), capped by `max_batch_size` and the request count;
    `width` is `max(needs) - 1` (the last generated token is never written).

    Raises:
        ValueError: no requests, a need < 2, or a request that alone exceeds the budget.
    """
    if not needs:
        raise ValueError("plan_slots needs at least one request")
    if min(needs) < 2:
        raise ValueError(f"every request needs >= 2 KV tokens (a cache entry and one token to generate), got {min(needs)}")
    if budget is not None and max(needs) > budget:
        raise ValueError(f"a request needs {max(needs)} KV tokens but the budget is {budget}")
    slots, total = 0, 0
    for n in sorted(needs):
        if budget is not None and total + n > budget:
            break
        slots, total = slots + 1, total + n
    if max_batch_size is not None:
        slots = min(slots, max_batch_size)
        total = sum(sorted(needs)[:slots])
    if budget is not None:  # the padding bound uses the largest admissible sum, not the smallest
        big = sorted(needs, reverse=True)
        total = max(total, min(budget, sum(big[:slots])))
    return SlotPlan(slots=slots, width=max(needs) - 1, admissible_tokens=total)


class SlotKVStore:
    """Per-layer keys and values `[S, H_kv, W, d]`, preallocated; rows are slots (see the module docstring).

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape (`L`, `H_kv`, `d`).
        slots, width: `S` and `W` (e.g. from `plan_slots`).
        dtype, device: the cache's (the model's) dtype and device.
        track_positions: keep each stored key's position (`[S, W]` int64), needed only for sliding-window
            masks.

    Raises:
        ValueError: `slots` or `width` < 1.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, slots: int, width: int,
                 dtype: torch.dtype, device, track_positions: bool = False):
        if slots < 1 or width < 1:
            raise ValueError(f"slots and width must be >= 1, got slots={slots}, width={width}")
        shape = (slots, num_kv_heads, width, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots, self.width, self.device = slots, width, torch.device(device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # tokens stored per slot
        self.positions = torch.zeros(slots, width, dtype=torch.long, device=device) if track_positions else None
        self._used = [False] * slots
        # per layer [S, H_kv, W] bool, True on padding columns (unequal per-head counts); None until one is admitted
        self.hidden: list[torch.Tensor] | None = None
        self._rows = 0  # rows the current step runs (one past the highest occupied slot)
        self._cols = 0  # columns the current step attends over

    # ----------------------------------------------------------------- slots
    @property
    def bytes(self) -> int:
        """Bytes the keys and values tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def free_slots(self) -> int:
        return self._used.count(False)

    @property
    def rows(self) -> int:
        """Batch rows a step runs: one past the highest occupied slot (0 when empty)."""
        return max((i + 1 for i, u in enumerate(self._used) if u), default=0)

    def admit(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None,
              hidden: torch.Tensor | None = None) -> int:
        """Copy one request's cache into the lowest free slot; returns the slot.

        Args:
            keys, values: `[L, H_kv, n, d]`, the cache entries the request attends to (n >= 0).
            positions: `[n]` int64, each entry's position (required when positions are tracked).
            hidden: optional BoolTensor `[L, H_kv, n]`, True on padding entries (unequal per-head counts, stored
                at the layer's largest count): attention never sees them (`head_masks`).

        Raises:
            RuntimeError: no free slot.
            ValueError: `n >= W` (no column left for the tokens to generate), wrong shapes, or missing positions.
        """
        if not self.free_slots:
            raise RuntimeError(f"all {self.slots} slots are in use; release one before admitting")
        n = keys.shape[2]
        want = (len(self.keys), *self.keys[0].shape[1:2], n, self.keys[0].shape[3])
        if tuple(keys.shape) != want or tuple(values.shape) != want:
            raise ValueError(f"keys and values must be [L, H_kv, n, d] = {list(want)}, got {list(keys.shape)} and "
                             f"{list(values.shape)}")
        if n >= self.width:
            raise ValueError(f"a cache of {n} entries leaves no column to decode into in slots of width {self.width}")
        if self.positions is not None and (positions is None or positions.shape != (n,)):
            raise ValueError(f"this store tracks positions: pass positions of shape [{n}]")
        slot = self._used.index(False)
        for layer in range(len(self.keys)):
            self.keys[layer][slot, :, :n] = keys[layer]
            self.values[layer][slot, :, :n] = values[layer]
        if self.positions is not None:
            self.positions[slot, :n] = positions.to(self.device)
        if self.hidden is not None:
            for h in self.hidden:
                h[slot] = False
        if hidden is not None and bool(hidden.any()):
            if self.hidden is None:
                self.hidden = [torch.zeros(k.shape[:3], dtype=torch.bool, device=self.device) for k in self.keys]
            for layer, h in enumerate(self.hidden):
                h[slot, :, :n] = hidden[layer].to(self.device)
        self.lengths[slot] = n
        self._used[slot] = True
        return slot

    def release(self, slot: int) -> None:
        """Free `slot` (its request finished); nothing is copied.

        Raises:
            ValueError: the slot is not in use.
        """
        if not (0 <= slot < self.slots and self._used[slot]):
            raise ValueError(f"slot {slot} is not in use")
        self._used[slot] = False
        self.lengths[slot] = 0

    def grow(self, width: int) -> None:
        """Widen every slot to `width` tokens (no-op when already that wide): new tensors, stored entries copied
        to the same columns. For requests that are granted their tokens in blocks as they generate."""
        if width <= self.width:
            return
        cols = self.width
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = old.new_zeros((old.shape[0], old.shape[1], width, old.shape[3]))
                new[:, :, :cols] = old
                store[layer] = new
        if self.positions is not None:
            new = self.positions.new_zeros((self.slots, width))
            new[:, :cols] = self.positions
            self.positions = new
        if self.hidden is not None:
            for layer, old in enumerate(self.hidden):
                self.hidden[layer] = torch.cat([old, old.new_zeros((*old.shape[:2], width - cols))], dim=2)
        self.width = width

    def take(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Copy out a slot's entries and release it (a request leaving the batch before it finished);
        returns keys, values `[L, H_kv, n, d]` and positions `[n]` (None when not tracked), what `admit`
        takes back."""
        if not (0 <= slot < self.slots and self._used[slot]):
            raise ValueError(f"slot {slot} is not in use")
        n = int(self.lengths[slot])
        keys = torch.stack([k[slot, :, :n] for k in self.keys])
        values = torch.stack([v[slot, :, :n] for v in self.values])
        positions = self.positions[slot, :n].clone() if self.positions is not None else None
        self.release(slot)
        return keys, values, positions

    # ----------------------------------------------------------------- one decode step
    def begin_step(self, query_positions: torch.Tensor | None = None) -> None:
        """Fix the rows and columns of the next forward pass (call before it, then `end_step` after).

        Each of the `rows` rows writes its new key/value at column `lengths[row]`; idle rows (free slots)
        write at column 0 of their own slot. `query_positions` `[rows]` is the position each row feeds,
        stored for sliding-window masks when positions are tracked.

        Raises:
            ValueError: a row is full (its request generated more tokens than its slot was planned for).
        """
        self._rows = rows = self.rows
        lengths = self.lengths[:rows]
        longest = int(lengths.max()) if rows else 0
        if longest >= self.width:
            raise ValueError(f"a slot is full ({longest} of {self.width} tokens): a request decodes more tokens "
                             f"than the storage was planned for")
        self._cols = longest + 1
        self._row_index = torch.arange(rows, device=self.device)
        if self.positions is not None and query_positions is not None:
            self.positions[self._row_index, lengths] = query_positions.to(self.device)

    def end_step(self) -> None:
        """Count the token every occupied row just wrote (idle rows stay empty)."""
        used = torch.tensor(self._used[:self._rows], device=self.device)
        self.lengths[:self._rows] += used.long()

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write one step's `[rows, H_kv, 1, d]` keys and values in place; return the views attention reads,
        `[rows, H_kv, cols, d]`."""
        cols = self.lengths[:self._rows]
        k, v = self.keys[layer], self.values[layer]
        k[self._row_index, :, cols] = key_states[:, :, 0, :]
        v[self._row_index, :, cols] = value_states[:, :, 0, :]
        return self.step_views(layer)

    def step_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values this step attends over, `[rows, H_kv, cols, d]` views (between
        `begin_step` and `end_step`; row `r` writes its new entry at column `lengths[r]`)."""
        return self.keys[layer][:self._rows, :, :self._cols], self.values[layer][:self._rows, :, :self._cols]

    def attention_mask(self, *, window: int | None = None, query_positions: torch.Tensor | None = None,
                       additive_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The mask of the next step, `[rows, 1, 1, cols]`: True where a row's query may attend.

        Args:
            window: a sliding window (in positions): keys whose position is `<= query position - window`
                are hidden too (needs tracked positions and `query_positions` `[rows]`).
            additive_dtype: return the additive float form instead (0 allowed, the dtype's minimum hidden),
                what eager attention takes.

        Raises:
            ValueError: a window without tracked positions or query positions.
        """
        rows, cols = self._rows, self._cols
        col = torch.arange(cols, device=self.device)
        mask = col[None, :] <= self.lengths[:rows, None]  # stored entries plus the one written this step
        if window is not None:
            if self.positions is None or query_positions is None:
                raise ValueError("a sliding-window mask needs tracked positions and the query positions")
            mask &= self.positions[:rows, :cols] > (query_positions.to(self.device)[:, None] - window)
        mask = mask[:, None, None, :]
        if additive_dtype is not None:
            return torch.zeros(mask.shape, dtype=additive_dtype, device=self.device).masked_fill_(
                ~mask, torch.finfo(additive_dtype).min)
        return mask

    def head_mask(self, layer: int, mask: torch.Tensor | None, group: int) -> torch.Tensor | None:
        """`mask` (this step's `[rows, 1, 1, cols]`, boolean or additive) with layer `layer`'s padding entries hidden
        per head (`hide_padding`); `mask` itself when no slot holds padding."""
        if self.hidden is None:
            return mask
        return hide_padding(mask, self.hidden[layer][:self._rows, :, :self._cols], group)

    def cache(self):
        """A transformers `Cache` over this store, to pass as the model's cache for one decode step."""
        return _slot_cache(self)


def hide_padding(mask: torch.Tensor | None, hidden: torch.Tensor, group: int) -> torch.Tensor:
    """An attention mask `[B, 1, Q, cols]` (boolean, True = attend, or additive) with the padding entries `hidden`
    (`[B, H_kv, cols]` bool) hidden from every query head of their KV head: `[B, H_kv * group, Q, cols]` (query
    head `h * group + j` reads KV head `h`); `~hidden` as a boolean mask when `mask` is None."""
    hid = hidden.repeat_interleave(group, dim=1)[:, :, None, :]  # [B, Hq, 1, cols]
    if mask is None:
        return ~hid
    if mask.dtype == torch.bool:
        return mask & ~hid
    return torch.where(hid, torch.finfo(mask.dtype).min, mask)


class PaddingMasks:
    """Padding entries of a batch's cache per layer, `hidden[layer]` `[B, H_kv, cols]` bool, for a forward over a
    cache that is not a slot store (`extend`): set as the cache's `slot_store` attribute, `install_head_masks`'
    hooks read it as they read a slot store's."""

    def __init__(self, hidden: list[torch.Tensor]):
        self.hidden = hidden

    def head_mask(self, layer: int, mask: torch.Tensor | None, group: int) -> torch.Tensor:
        return hide_padding(mask, self.hidden[layer], group)


CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # by transformers version and family


HEAD_MASK_HOOK_ATTR = "_tdutils_head_mask_hook"  # on an attention module: the id of its padding-mask pre-hook


def install_head_masks(layers, group: int) -> bool:
    """Forward pre-hooks on the attention modules of `layers` (a model's decoder layers, in order) that hand each
    layer its own per-head mask (`SlotKVStore.head_mask`) when the cache it is given is a slot store holding padding
    (unequal per-head counts); other calls pass unchanged. `group`: query heads per KV head. A module gets one hook
    however often this is called. Returns whether every attention module takes its cache under a keyword the hooks
    know (`CACHE_KWARGS`); where not, padded caches cannot be masked and engines refuse them."""
    import inspect

    def hook(module, args, kwargs, layer):
        cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
        store = getattr(cache, "slot_store", None)
        if store is None or store.hidden is None:
            return None
        return args, {**kwargs, "attention_mask": store.head_mask(layer, kwargs.get("attention_mask"), group)}

    known = len(layers) > 0
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        if attn is None or not set(CACHE_KWARGS) & set(inspect.signature(attn.forward).parameters):
            known = False
            continue
        if getattr(attn, HEAD_MASK_HOOK_ATTR, None) is not None:  # one hook per module, however many engines share it
            continue
        handle = attn.register_forward_pre_hook(lambda mod, args, kwargs, i=i: hook(mod, args, kwargs, i),
                                                with_kwargs=True)
        setattr(attn, HEAD_MASK_HOOK_ATTR, handle.id)  # the lean decode step tells this hook from a user's
    return known


_CACHE_CLASSES: tuple | None = None
_WIDE_CACHE: type | None = None


def _cache_classes():
    """`(SlotCache, SlotLayer)`, defined on first use (transformers is imported lazily)."""
    global _CACHE_CLASSES
    if _CACHE_CLASSES is None:
        from transformers.cache_utils import Cache, CacheLayerMixin

        class SlotLayer(CacheLayerMixin):
            """One layer's view of a `SlotKVStore`: `update` writes in place and returns the attended views."""

            is_sliding = False

            def __init__(self, store: SlotKVStore, layer: int):
                super().__init__()
                self.store, self.layer = store, layer
                self.is_initialized = True

            def lazy_initialization(self, key_states, value_states):  # storage is allocated up front
                return None

            def update(self, key_states, value_states, *args, **kwargs):
                if key_states.shape[2] != 1:
                    raise ValueError(f"the slot store takes one token per row and step, got {key_states.shape[2]}")
                return self.store.write(self.layer, key_states, value_states)

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                return self.store._cols, 0

            def get_seq_length(self) -> int:
                return self.store._cols - 1

            def get_max_length(self) -> int:
                return self.store.width

        class SlotCache(Cache):
            """A transformers `Cache` whose layers write into a `SlotKVStore`."""

            def __init__(self, store: SlotKVStore):
                super().__init__(layers=[SlotLayer(store, i) for i in range(len(store.keys))])
                self.slot_store = store  # read by `install_head_masks`' hooks

        _CACHE_CLASSES = (SlotCache, SlotLayer)
    return _CACHE_CLASSES


def _slot_cache(store: SlotKVStore):
    return _cache_classes()[0](store)


def _wide_cache_class():
    """`WideCache`, defined on first use (transformers is imported lazily)."""
    global _WIDE_CACHE
    if _WIDE_CACHE is None:
        from transformers.cache_utils import Cache, CacheLayerMixin

        class WideLayer(CacheLayerMixin):
            """One layer of a batch cache allocated at its final width `[B, H_kv, C + M, d]`, its first `C` columns
            filled: `update` writes the fed tokens' keys and values into the next columns and returns the filled
            views, so a forward of `M` tokens copies nothing that was cached (a `DynamicLayer` concatenates)."""

            is_sliding = False

            def __init__(self, keys: torch.Tensor, values: torch.Tensor, cached: int):
                super().__init__()
                self.keys, self.values, self.cached = keys, values, cached
                self.is_initialized = True

            def lazy_initialization(self, key_states, value_states):  # storage is allocated up front
                return None

            def update(self, key_states, value_states, *args, **kwargs):
                end = self.cached + key_states.shape[2]
                if end > self.keys.shape[2]:
                    raise ValueError(f"the wide cache holds {self.keys.shape[2]} columns; {self.cached} are filled "
                                     f"and {key_states.shape[2]} more were fed")
                self.keys[:, :, self.cached:end] = key_states
                self.values[:, :, self.cached:end] = value_states
                self.cached = end
                return self.keys[:, :, :end], self.values[:, :, :end]

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                return self.cached + query_length, 0

            def get_seq_length(self) -> int:
                return self.cached

            def get_max_length(self) -> int:
                return self.keys.shape[2]

        class WideCache(Cache):
            """A transformers `Cache` of `WideLayer`s over `keys`, `values` `[L, B, H_kv, C + M, d]`."""

            def __init__(self, keys: torch.Tensor, values: torch.Tensor, cached: int):
                super().__init__(layers=[WideLayer(k, v, cached) for k, v in zip(keys, values)])

        _WIDE_CACHE = WideCache
    return _WIDE_CACHE


def wide_cache(keys: torch.Tensor, values: torch.Tensor, cached: int):
    """A transformers `Cache` over preallocated `keys`, `values` `[L, B, H_kv, C + M, d]` whose first `cached`
    columns hold the cache: a forward writes its tokens' keys and values in place after them (`WideLayer`), so
    extending a long cache by a few tokens does not copy it again per layer."""
    return _wide_cache_class()(keys, values, cached)
