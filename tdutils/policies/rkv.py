"""R-KV: keep tokens that are attended to *and* say something new (importance minus redundancy).

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", arXiv:2505.24133 (code:
github.com/Zefan-Cai/R-KV). docs/design.md §5 "R-KV" is the definition implemented here.

Importance `I` (`rkv_importance`, per layer and KV head): the model's logits
(`tdutils.attention.AttentionSpec`) of the last `w` queries against the `n - w` earlier keys; the `g = Hq / H`
query heads of a GQA group reduced by **max of the logits** (as R-KV's `compute_attention_scores`); softmax
over the earlier keys (fp32); mean over the window rows; max-pooled along tokens (`kernel_size=7`, stride 1,
same padding). Redundancy `R` (`rkv_redundancy`, over all `n` keys): the softmax of each key's mean cosine
similarity to the others, each row's newest near-duplicate left out. Score `Z = λ·I − (1 − λ)·R[:, :n−w]`,
averaged over KV heads and summed over layers: one kept set for the whole request (the serving path stores one
token list); `granularity="layer" | "head"`: one set per layer or per KV head from `Z` (docs/policies.md). Keep the top `k − w` earlier tokens plus the window. Defaults `w=16, kernel_size=7, λ=0.25,
threshold=0.5` (R-KV's own code: `w=8, λ=0.07`). `R` has four methods, `reference`, `exact`, `tiled` and
`buffered` (approximate): their algorithms and memory bounds are in `rkv_redundancy`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from ..attention import AttentionSpec, LayerAttention, masked_logits
from ..kvcache import apply_keep, get_kv, get_query
from ..models import model_facts
from ..profiling import kept_agreement, peak_memory, timed
from ..selection import (
    GRANULARITIES,
    keep_count,
    keep_top_per_head,
    keep_top_scores,
    protected_mask,
    repeat_keep,
)
from .params import check_int, check_odd_kernel, is_number
from .registry import register_policy
from .reuse import reused
from .scoring import check_query, layer_attentions, model_attention, pool_tokens

Redundancy = Literal["reference", "exact", "tiled", "buffered"]
RKV_METHODS = get_args(Redundancy)

# Tile parameters each method accepts, with their defaults (None = the keys' device).
_METHOD_TILES = {
    "reference": {"row_tile": 256, "device": None},
    "exact": {"col_block": 256, "first_block": 64, "device": None},
    "tiled": {"row_tile": 2048, "col_block": 1024, "first_block": 64, "device": None},
    "buffered": {"chunk_size": 512, "col_block": 1024, "first_block": 64, "device": None},
}
TILE_FIELDS = ("row_tile", "col_block", "first_block", "chunk_size", "device")


@dataclass
class RKVParams:
    """R-KV parameters (docs/design.md §5). Tile fields left at None take the chosen method's default.

    Attributes:
        window: `w`, the observation window (last `w` prompt tokens, always kept).
        kernel_size: odd max-pool kernel for the importance (1 = no pooling).
        mix_lambda: `λ` in `Z = λ·I − (1 − λ)·R`, in [0, 1].
        threshold: cosine similarity above which two keys count as near-duplicates, in (-1, 1] (1: none).
        redundancy: `"reference"`, `"exact"`, `"tiled"` or `"buffered"`.
        eps: added to key norms before normalising (zero keys normalise to 0, never NaN).
        row_tile, col_block, first_block, chunk_size, device: tile settings (see `rkv_redundancy`).
    """

    window: int = field(default=16, metadata={
        "help": "the observation window: the most recent prompt tokens, whose queries vote (always kept)"})
    kernel_size: int = field(default=7, metadata={
        "help": "odd max-pool kernel of the importance along tokens (1 = no pooling)"})
    mix_lambda: float = field(default=0.25, metadata={
        "help": "lambda in Z = lambda*I - (1 - lambda)*R: the weight of importance against redundancy, in [0, 1]"})
    threshold: float = field(default=0.5, metadata={
        "help": "cosine similarity above which two keys count as near-duplicates, in (-1, 1] (1 = none)"})
    redundancy: Redundancy = field(default="exact", metadata={
        "help": "how the redundancy is computed: reference (the literal formula, row tiles), exact (linear memory), "
                "tiled (row tiles x column blocks, any device), buffered (within chunks, approximate)"})
    eps: float = field(default=1e-8, metadata={"help": "added to key norms before normalising, > 0"})
    row_tile: int | None = field(default=None, metadata={
        "help": "rows of the key similarities per tile (reference, tiled; unset: the method's default)"})
    col_block: int | None = field(default=None, metadata={
        "help": "widest column block of the right-to-left scan (exact, tiled, buffered; unset: the method's "
                "default)"})
    first_block: int | None = field(default=None, metadata={
        "help": "first, narrowest column block of that scan (exact, tiled, buffered; unset: the method's default)"})
    chunk_size: int | None = field(default=None, metadata={
        "help": "tokens per chunk of the buffered redundancy, similarities computed inside each (unset: 512)"})
    # Not a command-line option: there `--device` places the engine, and the keys with it (None follows them).
    device: str | None = field(default=None, metadata={
        "help": "device the redundancy is computed on (unset: the keys' device)", "cli": False})

    def __post_init__(self):  # fail when the drop function is built, not on the first request
        check_int(self.window, "window", 1)
        check_odd_kernel(self.kernel_size)
        if not is_number(self.mix_lambda) or not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must lie in [0, 1] (the weight of importance against redundancy in "
                             f"Z = λ·I − (1 − λ)·R), got {self.mix_lambda!r}")
        if not is_number(self.threshold) or not -1.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must lie in (-1, 1]: it is the cosine similarity above which two keys count "
                             f"as near-duplicates, so at -1 or below every pair would (1 = none), got {self.threshold!r}")
        if not is_number(self.eps) or not self.eps > 0:
            raise ValueError(f"eps must be a number > 0 (it keeps zero-norm keys from dividing by zero), "
                             f"got {self.eps!r}")
        _method_settings(self.redundancy, self.tiles())  # a bad method or tile fails here, not on the first request

    def tiles(self) -> dict:
        """The tile settings that were set (non-None), as keyword arguments of `rkv_redundancy`."""
        return {k: getattr(self, k) for k in TILE_FIELDS if getattr(self, k) is not None}

    def settings(self) -> dict:
        """Every tile setting of the chosen method: the ones set here over the method's defaults."""
        return {**_METHOD_TILES[self.redundancy], **self.tiles()}

    def score_kwargs(self) -> dict:
        """Keyword arguments of `rkv_scores` / `rkv_keep` (everything but `head_dim`)."""
        return {"window": self.window, "kernel_size": self.kernel_size, "mix_lambda": self.mix_lambda,
                "threshold": self.threshold, "redundancy": self.redundancy, "eps": self.eps, **self.tiles()}


# --------------------------------------------------------------------------------------------- redundancy
def _method_settings(method: str, tiles: dict) -> dict:
    if method not in _METHOD_TILES:
        raise ValueError(f"unknown redundancy method {method!r}; choose one of {list(RKV_METHODS)}")
    known = _METHOD_TILES[method]
    unknown = set(tiles) - set(known)
    if unknown:
        raise ValueError(f"redundancy method {method!r} takes {sorted(known)}, got unknown {sorted(unknown)}")
    settings = {**known, **{k: v for k, v in tiles.items() if v is not None}}
    for name, value in settings.items():
        if name != "device" and (int(value) != value or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return settings


def normalize_keys(keys: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`k / (‖k‖ + eps)` along the last axis, in fp32 (a new tensor; zero keys stay 0)."""
    k = keys.float()
    return k / (k.norm(dim=-1, keepdim=True) + eps)


def _blocks_right_to_left(lo_bound: int, hi_bound: int, first: int, widest: int):
    """Column blocks `[lo, hi)` covering `[lo_bound, hi_bound)` from the right; widths first, 2·first, ...,
    capped at `widest`. Small first blocks are cheap when most rows hit right next to the right edge."""
    hi, width = hi_bound, min(first, widest)
    while hi > lo_bound:
        lo = max(lo_bound, hi - width)
        yield lo, hi
        hi, width = lo, min(2 * width, widest)


def _reference(kh: torch.Tensor, threshold: float, row_tile: int) -> torch.Tensor:
    """Literal R-KV redundancy `softmax_j(mean_i S[i, j])`, `row_tile` rows of S at a time.

    kh: fp32 `[G, n, d]` normalised keys. Returns fp32 `[G, n]`.
    """
    G, n, _ = kh.shape
    cols = torch.arange(n, device=kh.device)
    colsum = torch.zeros(G, n, dtype=torch.float32, device=kh.device)
    for r0 in range(0, n, row_tile):
        r1 = min(n, r0 + row_tile)
        rows = torch.arange(r0, r1, device=kh.device)
        s = kh[:, r0:r1] @ kh.transpose(1, 2)  # [G, t, n] cosine similarities of rows r0..r1-1
        s[:, rows - r0, rows] = 0.0  # diagonal
        # as the original code: column index where S > threshold, else 0; the max is the rightmost hit
        idx = torch.where(s > threshold, cols, 0)  # [G, t, n] int64
        retain = idx.max(dim=-1).values  # [G, t]
        del idx
        s.scatter_(-1, retain[..., None], 0.0)  # one distinct column per row: deterministic
        colsum += s.sum(dim=1)
        del s
    return torch.softmax(colsum / n, dim=-1)


# Heads whose normalised keys are held at once (`_group_size`): every head of every layer of a request on prompts
# of a few thousand tokens. Each column block's similarities are computed for slices of heads of at most
# BLOCK_BYTES of temporaries (fp32 similarities + bool hits), so a block stays in memory the allocator reuses.
GROUP_BYTES = 1 << 28
BLOCK_BYTES = 1 << 24
SPLIT_HEADS = 4  # buckets of more heads than this are split by rows left (`_rebucket`)


def _dense_retain(device: torch.device) -> bool:
    """Whether retained entries are summed by a dense masked reduction (off the CPU: no atomic scatter, so the
    result does not depend on thread order) rather than by `index_add_` (CPU: sequential, deterministic)."""
    return device.type != "cpu"


def _batch_layers(device: torch.device) -> bool:
    """Whether R-KV scores every layer of a request in one batch (off the CPU: fewer kernel launches) rather than
    one layer at a time (CPU: one layer's temporaries stay in cache; same arithmetic)."""
    return device.type != "cpu"


@dataclass
class _Bucket:
    """Heads of one batch of the right-to-left scan: `heads [Gb]` (indices into the keys' heads), the rows each
    slot holds `idx [Gb, A]` and whether that row is still scanning `ok [Gb, A]` (its rightmost hit not found)."""

    heads: torch.Tensor
    idx: torch.Tensor
    ok: torch.Tensor
    whole: tuple[int, int] | None = None  # `(r0, r1)` while the bucket is every head with rows r0..r1-1 in order


def _block_hits(kh: torch.Tensor, b: _Bucket, lo: int, hi: int, threshold: float, retained: torch.Tensor) -> None:
    """Scan the columns `[lo, hi)` for the rows of bucket `b`: each row still scanning finds its rightmost entry
    above `threshold` there (diagonal set to 0 first), adds it to `retained [G, n]` and stops (`b.ok` cleared).

    The block's keys are multiplied in reversed column order, so the rightmost hit is the *first* True of each
    row, which `max` over the bool hits (as bytes) returns: one comparison and one byte reduction per entry.
    On the CPU the retained entries are added by `index_add_` (sequential, deterministic); elsewhere by a dense
    masked reduction per column (no atomics: deterministic on GPUs too)."""
    n = kh.shape[1]
    width = hi - lo
    step = max(1, BLOCK_BYTES // max(1, 5 * b.idx.shape[1] * width))
    for h0 in range(0, b.heads.numel(), step):
        heads, idx, ok = b.heads[h0:h0 + step], b.idx[h0:h0 + step], b.ok[h0:h0 + step]
        kb = kh[:, lo:hi].index_select(0, heads).flip(1)  # [g, B, d]: column hi - 1 - c at c
        if b.whole is None:
            rows = kh[heads[:, None], idx]  # [g, A, d]
        else:  # the first block of a tile: every row of every head, a view
            rows = kh[h0:h0 + step, b.whole[0]:b.whole[1]]
        s = rows @ kb.transpose(1, 2)  # [g, A, B]
        local = (hi - 1) - idx  # each slot's own (reversed) column in the block, if it lies there
        on = (local >= 0) & (local < width)
        if bool(on.any()):  # S̃ has a zero diagonal
            gi, ai = on.nonzero(as_tuple=True)
            s[gi, ai, local[gi, ai]] = 0.0
        # rightmost hit = first True of the reversed row: `max` over the hits as bytes returns the first index of
        # the maximum (documented), and whether there is one, in one byte reduction
        any_hit, first = torch.max((s > threshold).view(torch.uint8), dim=-1)  # [g, A]; first = 0 when none
        found = any_hit.bool() & ok
        if not _dense_retain(s.device):
            col = (hi - 1) - first  # [g, A] absolute column
            retained.view(-1).index_add_(0, (heads[:, None] * n + col)[found], s.gather(-1, first[..., None])[..., 0][found])
        else:
            onehot = (torch.arange(width, device=s.device) == first[..., None]) & found[..., None]  # [g, A, B]
            retained[heads, lo:hi] += torch.where(onehot, s, 0.0).sum(dim=1).flip(-1)  # heads are distinct
        b.ok[h0:h0 + step] = ok & ~found
        del s


def _rebucket(b: _Bucket) -> list[_Bucket]:
    """The rows of `b` still scanning, packed to the front of each head's slots (in row order); heads with none
    left dropped; the others split, when they are many and finish at very different speeds, so that each
    bucket's widest head has at most twice the rows of its narrowest (one batched matmul per bucket, little
    padding)."""
    c = b.ok.sum(dim=1).tolist()
    live = sorted((i for i in range(len(c)) if c[i] > 0), key=lambda i: -c[i])
    if not live:
        return []
    groups = [live]
    if len(live) > SPLIT_HEADS and c[live[0]] > 2 * c[live[-1]]:
        groups, start = [], 0
        while start < len(live):
            end = start + 1
            while end < len(live) and 2 * c[live[end]] >= c[live[start]]:
                end += 1
            groups.append(live[start:end])
            start = end
    out = []
    for group in groups:
        sel = torch.tensor(group, device=b.ok.device)
        ok, idx = b.ok[sel], b.idx[sel]
        r, j = ok.nonzero(as_tuple=True)  # row-major: each head's rows still scanning, in row order
        pos = ok.cumsum(dim=1)[r, j] - 1  # their packed slot
        width = c[group[0]]
        packed_idx = idx.new_zeros(len(group), width)
        packed_idx[r, pos] = idx[r, j]
        packed_ok = torch.zeros(len(group), width, dtype=torch.bool, device=ok.device)
        packed_ok[r, pos] = True
        out.append(_Bucket(b.heads[sel], packed_idx, packed_ok))
    return out


def _scan(kh: torch.Tensor, threshold: float, row_tile: int, col_block: int, first_block: int) -> torch.Tensor:
    """Column sums of S̃ (diagonal and retained entries removed) of every head, batched over heads.

    kh: fp32 `[G, n, d]` normalised keys (G independent heads). Returns fp32 `[G, n]` = `Σ_i S̃[i, j]`.

    `Σ_i S[i, j]` over `i != j` without forming `S`: `⟨Σ_i k̂_i, k̂_j⟩ − ⟨k̂_j, k̂_j⟩`. Then, per tile of `row_tile`
    rows of every head, column blocks are scanned from the right (`_blocks_right_to_left`); in each block every
    row still scanning finds its rightmost entry above `threshold` (`_block_hits`), and the rows that found one
    add that entry to its column's retained sum and stop. After each block the rows still scanning are packed
    and the heads regrouped by how many they have left (`_rebucket`), so a block costs what its remaining rows
    need, in one batched matmul per group of heads. Rows that find no entry at all retain column 0
    (`S̃[i, 0]`; nothing for row 0, whose `S[0, 0]` is the diagonal).
    """
    G, n, _ = kh.shape
    dev = kh.device
    # ⟨k̂_j, k̂_j⟩ as the squared norm: no [G, n, d] temporary
    colsum = (kh @ kh.sum(dim=1)[..., None])[..., 0] - torch.linalg.vector_norm(kh, dim=-1).square()  # [G, n]
    retained = torch.zeros(G, n, dtype=torch.float32, device=dev)
    for r0 in range(0, n, row_tile):
        r1 = min(n, r0 + row_tile)
        buckets = [_Bucket(torch.arange(G, device=dev), torch.arange(r0, r1, device=dev).expand(G, -1),
                           torch.ones(G, r1 - r0, dtype=torch.bool, device=dev), whole=(r0, r1))]
        for lo, hi in _blocks_right_to_left(0, n, first_block, col_block):
            for b in buckets:
                _block_hits(kh, b, lo, hi, threshold, retained)
            buckets = [part for b in buckets for part in _rebucket(b)]
            if not buckets:  # every row of the tile has its rightmost hit: stop scanning left
                break
        for b in buckets:  # rows with no near-duplicate retain column 0
            v = (kh[b.heads[:, None], b.idx] @ kh[b.heads, 0, :, None])[..., 0]  # [Gb, A] = S[i, 0]
            retained[b.heads, 0] += torch.where(b.ok & (b.idx != 0), v, 0.0).sum(dim=1)
    return colsum - retained


def _group_size(method: str, n: int, d: int, settings: dict) -> int:
    """Heads per group of `method` on `n` keys of `d` channels: `GROUP_BYTES` over one head's worst-case
    temporaries (normalised keys, similarities of a tile or block with their masks and indices)."""
    if method == "reference":
        t = min(settings["row_tile"], n)
        per_head = 4 * n * d + 13 * t * n
    elif method == "buffered":
        c = min(settings["chunk_size"], n)
        per_head = 8 * c * d + 10 * c * min(settings["col_block"], c)
    else:  # exact, tiled: the keys and the gathered rows (block temporaries are bounded by BLOCK_BYTES)
        per_head = 8 * n * d + 12 * n
    return max(1, GROUP_BYTES // max(1, per_head))


def rkv_redundancy(keys: torch.Tensor, *, method: str = "exact", threshold: float = 0.5, eps: float = 1e-8,
                   **tiles) -> torch.Tensor:
    """R-KV redundancy of every key (arXiv:2505.24133; docs/design.md §5): `softmax_j(mean_i S̃[i, j])` per head.

    Definition (per layer, per KV head, over all `n` keys): `k̂ = k / (‖k‖ + eps)` in fp32;
    `S = K̂ K̂ᵀ` with the diagonal set to 0; in each row `i` the rightmost column `j` with `S[i, j] >
    threshold` (the most recent near-duplicate; column 0 when there is none) is set to 0 (`S̃`) — so of
    several copies of a key, the newest keeps the lowest redundancy; `R = softmax_j(mean_i S̃[i, j])`.

    Four ways to compute it, all `[..., H, n]` and all within fp32 rounding of each other except `buffered`:

    - `reference`: the literal formula, `row_tile` rows of `S` at a time (`[H, tile, n]` temporaries, the
      `[H, tile, n]` int64 "rightmost hit" index of the original code included; never `[H, n, n]`). Peak extra
      memory ≈ `4·G·n·d + 13·G·t·n` bytes per group of heads (`G` heads, `t = min(row_tile, n)`).
    - `exact`: linear memory, every row of a head as one tile. Column sums without `S`:
      `Σ_i S[i, j] = ⟨Σ_i k̂_i, k̂_j⟩ − ⟨k̂_j, k̂_j⟩`; then each row's retained entry is found by scanning
      column blocks from the right (widths `first_block`, doubling up to `col_block`) and dropping rows from
      the scan as soon as they hit; the retained entries are subtracted from their columns (`_scan`: one
      batched matmul per block for all heads of a group, the rows still scanning packed and the heads regrouped
      by how many they have left, so a block costs what its remaining rows need). Time: fastest when rows hit
      near the right edge (real keys); keys with no near-duplicates at all are scanned to the left edge (`n²·d`
      per head, as the reference, without its memory).
    - `tiled`: the same scan over tiles of `row_tile` rows (`exact` is `tiled` with one tile per head), on any
      device (`device="cuda"` moves the keys there); deterministic off the CPU: every accumulation is a dense
      reduction or an add at distinct indices, no atomic scatter.

    Memory of `exact` and `tiled`: heads in groups of at most `GROUP_BYTES` of normalised keys and packed rows
    (`8·n·d` bytes a head), each block's similarities computed for slices of heads of at most `BLOCK_BYTES`
    (5 bytes an entry: fp32 similarity, bool hit; at least one head: `5·t·B`, `t` = the tile's rows still
    scanning, `B <= col_block`), plus `12·G·n` (column sums, retained sums, result).
    - `buffered` (approximate): similarities only inside consecutive chunks of `chunk_size` tokens (default
      512): each key's column mean runs over the rows of its own chunk (divided by that chunk's length), the
      rightmost hit is searched inside the chunk, and the softmax still runs over all `n` tokens so that `R`
      keeps the scale of the exact one. `chunk_size >= n` is the exact method.

    Args:
        keys: `[H, n, d]` keys of one layer (any float dtype, any device; computed in fp32). Leading
            batch dims `[..., H, n, d]` are allowed: every head of every request is independent.
        method: `"reference"` (literal, row-tiled), `"exact"` (linear memory, per head), `"tiled"` (row
            tiles × column blocks, any device, deterministic) or `"buffered"` (within chunks, approximate);
            see above.
        threshold: cosine similarity above which a key counts as a near-duplicate of another; 1 or more: none
            (not even duplicate keys, whose computed similarity rounding may put above 1).
        eps: added to the norm before normalising; must be > 0 (zero keys then normalise to 0).
        **tiles: per method — reference: `row_tile` (256); exact: `col_block` (256), `first_block` (64);
            tiled: `row_tile` (2048), `col_block` (1024), `first_block` (64); buffered: `chunk_size`
            (512), `col_block` (1024), `first_block` (64); all: `device` (compute there; default the
            keys' device). Column blocks grow from `first_block` to `col_block` as the scan moves left.

    Returns:
        fp32 `[..., H, n]` on the keys' device; each head's row sums to 1. Higher = more redundant.

    Raises:
        ValueError: keys not `[..., H, n, d]` floats, unknown method, a tile the method does not take,
            non-positive tiles, `eps <= 0`, non-finite threshold.
    """
    if not isinstance(keys, torch.Tensor) or keys.dim() < 3 or not keys.dtype.is_floating_point:
        shape = tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"keys must be a float tensor [H, n, d] (or [..., H, n, d]), got {shape}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps zero-norm keys from dividing by zero), got {eps}")
    threshold = float(threshold)
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold}")
    return _redundancy(keys, method, threshold, eps, _method_settings(method, tiles))


def _redundancy(keys: torch.Tensor, method: str, threshold: float, eps: float, settings: dict) -> torch.Tensor:
    """`rkv_redundancy` with checked arguments: `settings` every tile of `method` (`RKVParams.settings`)."""
    if threshold >= 1.0:
        # "none": a cosine similarity never exceeds 1, but fp32 rounding puts some duplicates' at 1 + 1 ulp, and
        # where depends on the matmul's shape (the tile settings); no entry is a hit in any method
        threshold = math.inf
    out_device = keys.device
    device = torch.device(settings["device"]) if settings["device"] is not None else keys.device
    *lead, n, d = keys.shape
    flat = keys.reshape(-1, n, d)  # [G, n, d]: G = batch x heads, all independent
    G = flat.shape[0]
    if n == 0:
        return torch.zeros(*lead, 0, dtype=torch.float32, device=out_device)

    group = _group_size(method, n, d, settings)
    red = torch.empty(G, n, dtype=torch.float32, device=device)
    for g0 in range(0, G, group):  # each group: one batch of every method's matmuls
        red[g0:g0 + group] = _group_redundancy(flat[g0:g0 + group], method, threshold, eps, settings, device)
    return red.reshape(*lead, n).to(out_device)


def _group_redundancy(flat: torch.Tensor, method: str, threshold: float, eps: float, settings: dict,
                      device: torch.device) -> torch.Tensor:
    """The redundancy of one group of heads `flat [G, n, d]` (raw keys) on `device`: fp32 `[G, n]`."""
    G, n, _ = flat.shape
    if method == "reference":
        return _reference(normalize_keys(flat.to(device), eps), threshold, settings["row_tile"])
    if method in ("exact", "tiled"):  # the same scan; exact takes every row of a head as one tile
        kh = normalize_keys(flat.to(device), eps)
        tile = n if method == "exact" else settings["row_tile"]
        sums = _scan(kh, threshold, tile, settings["col_block"], settings["first_block"])
        del kh
        return torch.softmax(sums / n, dim=-1)
    # buffered: similarities inside each chunk only; the mean runs over the chunk's rows
    c = settings["chunk_size"]
    means = torch.empty(G, n, dtype=torch.float32, device=device)
    for c0 in range(0, n, c):
        c1 = min(n, c0 + c)
        kh = normalize_keys(flat[:, c0:c1].to(device), eps)  # [G, c, d]
        means[:, c0:c1] = _scan(kh, threshold, c1 - c0, settings["col_block"], settings["first_block"]) / (c1 - c0)
        del kh
    return torch.softmax(means, dim=-1)  # over all n tokens: R keeps the exact method's scale


# --------------------------------------------------------------------------------------------- importance
def rkv_importance(k: torch.Tensor, q: torch.Tensor, n_kv_heads: int, kernel_size: int = 7,
                   layer: LayerAttention | None = None) -> torch.Tensor:
    """R-KV importance of the tokens before the window, for one layer.

    Args:
        k: `[T, H*d]` keys (any float dtype).
        q: `[w, Hq*d]` the last `w` queries (row `i` is token `T - w + i`); `T > w`.
        n_kv_heads: `H`; query head `h` reads KV head `h // (Hq / H)`.
        kernel_size: odd max-pool kernel along tokens (1 = none).
        layer: the model's `LayerAttention`: its scale and soft-cap make the logits, keys outside a query's
            sliding window get `-inf` (a row that sees none of the earlier keys contributes zeros), and a
            learned sink logit per query head joins the GQA max and the softmax denominator. None = `d ** -0.5`.

    Returns:
        fp32 `[H, T - w]`: softmax over the `T - w` earlier keys of the GQA-max logits, mean over the `w`
        window rows, max-pooled.
    """
    T, w = k.shape[0], q.shape[0]
    n = T - w
    d = k.shape[1] // n_kv_heads
    g = q.shape[1] // d // n_kv_heads
    kh = k[:n].float().view(n, n_kv_heads, d).transpose(0, 1)  # [H, n, d]: earlier keys only
    # [H, g*w, d]: query head h*g+j reads KV head h; one batched matmul per KV head, so the keys are never
    # expanded to the g query heads (a broadcast matmul would copy them g times)
    qh = q.float().view(w, n_kv_heads, g, d).permute(1, 2, 0, 3).reshape(n_kv_heads, g * w, d)
    if layer is None:
        logits = (qh @ kh.transpose(1, 2) / d**0.5).view(n_kv_heads, g, w, n)  # [H, g, w, n]
    else:
        pos = torch.arange(T, device=k.device)
        logits = masked_logits((qh @ kh.transpose(1, 2)).view(n_kv_heads, g, w, n), layer, pos[n:], pos[:n])
        if layer.sinks is not None:  # one more column: the sink logit of each query head
            sinks = layer.sinks.to(logits.device).view(n_kv_heads, g, 1, 1).expand(n_kv_heads, g, w, 1)
            logits = torch.cat([logits, sinks], dim=-1)
    logits = logits.amax(dim=1)  # [H, w, n(+1)]: GQA group reduced by max of the logits, before the softmax
    probs = torch.softmax(logits, dim=-1)[..., :n].nan_to_num_(0.0)  # over the n - w earlier keys (+ sink) only
    return pool_tokens(probs.mean(dim=1), kernel_size, "max")  # [H, n]


# --------------------------------------------------------------------------------------------- scores
def rkv_scores(kv: torch.Tensor, q: torch.Tensor, *, head_dim: int, window: int = 16, kernel_size: int = 7,
               mix_lambda: float = 0.25, threshold: float = 0.5, redundancy: Redundancy = "exact",
               eps: float = 1e-8, attention: AttentionSpec | None = None, **tiles) -> torch.Tensor:
    """R-KV score of every token before the observation window (arXiv:2505.24133; docs/design.md §5).

    `Z = λ·I − (1 − λ)·R[:, :T−w]` per layer and KV head, averaged over heads, summed over layers.

    Args:
        kv: `[2, L, T, D]` KV of one request, keys after RoPE, `D = H * head_dim` (any float dtype/device).
        q: `[L, Tq, Hq * head_dim]` (or `[1, L, Tq, Hq*d]`) queries aligned to the end of the KV, `Tq >= window`.
        head_dim: `d`.
        window: `w`, the observation window.
        kernel_size: odd max-pool kernel for the importance (1 = none).
        mix_lambda: `λ`, in [0, 1].
        threshold, eps, redundancy, **tiles: passed to `rkv_redundancy` (method and its tile settings).
        attention: the model's `AttentionSpec` for the importance (see `rkv_importance`); None = plain
            attention with scale `head_dim ** -0.5`.

    Returns:
        fp32 `[T - w]` scores on the KV's device (higher = keep); empty when `T <= w`.

    Raises:
        ValueError: bad parameters (`RKVParams`: even kernel, `λ` outside [0, 1], unknown redundancy method
            or tile, ...), missing query, bad shapes, `Tq < window`.
    """
    return _scores(kv, q, _params(window, kernel_size, mix_lambda, threshold, redundancy, eps, tiles), head_dim,
                   attention)


def rkv_keep(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, *, head_dim: int, window: int = 16,
             kernel_size: int = 7, mix_lambda: float = 0.25, threshold: float = 0.5, redundancy: Redundancy = "exact",
             eps: float = 1e-8, attention: AttentionSpec | None = None, **tiles) -> torch.Tensor:
    """Kept indices: the whole window plus the `keep_count(T, drop_ratio) − w` best-scored earlier tokens.

    Returns `arange(T)` when `T <= w` (nothing can be dropped). LongTensor [k] (CPU), sorted; ties go to
    the earlier token. Arguments and errors as `rkv_scores`.
    """
    p = _params(window, kernel_size, mix_lambda, threshold, redundancy, eps, tiles)
    return _keep_indices(kv, q, drop_ratio, p, head_dim, attention)


def _params(window, kernel_size, mix_lambda, threshold, redundancy, eps, tiles: dict) -> RKVParams:
    """The checked `RKVParams` of the public functions' keywords; a tile no method takes is named with what
    this method takes (as `rkv_redundancy` names it), not as an unexpected keyword argument."""
    if set(tiles) - set(TILE_FIELDS):
        _method_settings(redundancy, tiles)  # raises
    return RKVParams(window, kernel_size, mix_lambda, threshold, redundancy, eps, **tiles)


# Below the public functions the parameters are a checked `RKVParams` (checked once, when built); the
# request's tensors are checked per request.
def _scores(kv: torch.Tensor, q: torch.Tensor, p: RKVParams, head_dim: int, attention: AttentionSpec | None
            ) -> torch.Tensor:
    z = _head_scores(kv, q, p, head_dim, attention)  # [L, H, n]
    if not _batch_layers(_score_device(p, kv)):  # the order of the sums the CPU path has always taken
        total = torch.zeros(z.shape[-1], dtype=torch.float32, device=z.device)
        for zl in z:
            total += zl.mean(dim=0)
        return total
    return z.mean(dim=1).sum(dim=0)


@reused
def _head_scores(kv: torch.Tensor, q: torch.Tensor, p: RKVParams, head_dim: int, attention: AttentionSpec | None
                 ) -> torch.Tensor:
    """`Z = λ·I − (1 − λ)·R[:, :T−w]` per layer and KV head: fp32 `[L, H, T - w]` on the KV's device."""
    q = check_query(kv, q, p.window, head_dim, "R-KV")
    L, T = kv.shape[1], kv.shape[2]
    n = T - p.window
    h = kv.shape[3] // head_dim
    if n <= 0:
        return torch.zeros(L, h, 0, dtype=torch.float32, device=kv.device)
    layers = layer_attentions(attention, L)
    settings = p.settings()
    if not _batch_layers(_score_device(p, kv)):
        # one layer at a time: on a CPU, temporaries of one layer (that stay in cache and in memory the allocator
        # reuses) beat one batch of every layer, whose arithmetic is the same (measured: bench/policy_cost.py)
        z = torch.empty(L, h, n, dtype=torch.float32, device=kv.device)
        for layer in range(L):
            k = kv[0, layer]  # [T, H*d]
            imp = rkv_importance(k, q[layer, -p.window:], h, p.kernel_size, layers[layer])  # [H, n]
            # [H, T]: redundancy among all T keys, window included
            red = _redundancy(k.view(T, h, head_dim).transpose(0, 1), p.redundancy, float(p.threshold), p.eps,
                              settings)
            z[layer] = p.mix_lambda * imp - (1.0 - p.mix_lambda) * red[:, :n]
        return z
    # elsewhere (GPUs), every head of every layer in one batch (`_redundancy` bounds its memory): one kernel per
    # scan step instead of one per layer and step
    imp = torch.stack([rkv_importance(kv[0, i], q[i, -p.window:], h, p.kernel_size, layers[i]) for i in range(L)])
    red = _redundancy(kv[0].view(L, T, h, head_dim).transpose(1, 2), p.redundancy, float(p.threshold), p.eps,
                      settings)  # [L, H, T]
    return p.mix_lambda * imp - (1.0 - p.mix_lambda) * red[..., :n].to(imp.device)  # [L, H, n]


def _score_device(p: RKVParams, kv: torch.Tensor) -> torch.device:
    """Where the redundancy is computed: `p.device`, else the keys' device."""
    return torch.device(p.device) if p.device is not None else kv.device


def _keep_indices(kv: torch.Tensor, q: torch.Tensor, drop_ratio: float, p: RKVParams, head_dim: int,
                  attention: AttentionSpec | None, granularity: str = "request") -> torch.Tensor:
    T = kv.shape[2]
    k = keep_count(T, drop_ratio)
    if T <= p.window:
        return repeat_keep(torch.arange(T), kv.shape[1], kv.shape[3] // head_dim, granularity)
    protected = protected_mask(T, window=p.window)
    if granularity != "request":  # the per-KV-head scores, the window's slots protected
        z = _head_scores(kv, q, p, head_dim, attention).cpu()  # [L, H, T - w]
        full = torch.cat([z, z.new_zeros(*z.shape[:2], p.window)], dim=-1)
        return keep_top_per_head(full, k, protected, granularity)
    full = torch.cat([_scores(kv, q, p, head_dim, attention).cpu(), torch.zeros(p.window)])  # window: protected
    return keep_top_scores(full, k, protected)


# --------------------------------------------------------------------------------------------- method table

def compare_redundancy_methods(tensors, tokens, *, drop_ratio: float, model_config, methods=RKV_METHODS,
                               method_tiles: dict | None = None, repeats: int = 1, **params):
    """Run R-KV with each redundancy method on one request; a pandas table of cost and agreement.

    Args:
        tensors: `{CacheKind.KV: kv [2, L, T, D], CacheKind.QUERY: q}` of one request (unedited).
        tokens: its T token ids.
        drop_ratio: fraction dropped.
        model_config: the model's facts (`engine.facts`), a loaded model or its config (head_dim, RoPE for the
            re-rotation timing, the attention the scores use).
        methods: redundancy methods to run; `"exact"` is always run (the agreement baseline).
        method_tiles: optional `{method: {tile: value}}` (e.g. `{"tiled": {"device": "cuda"}}`).
        repeats: timing repeats (median).
        **params: other `RKVParams` fields (window, mix_lambda, threshold, kernel_size, eps).

    Returns:
        DataFrame indexed by method: `device`, `score_s` (choosing the kept tokens), `rerotate_s` (gather +
        RoPE re-rotation of the kept keys), `modify_s` (their sum), `score_peak_mib` (peak tensor memory of
        the scoring step, see `peak_memory`), `kept`, `agreement_with_exact`, `same_as_exact`.
    """
    import pandas as pd

    method_tiles = method_tiles or {}
    kv, q = get_kv(tensors), get_query(tensors)
    facts = model_facts(model_config)  # a config, a loaded model or engine.facts
    head_dim, spec, attention = facts.head_dim, facts.rope, facts.attention
    order = ["exact"] + [m for m in methods if m != "exact"]
    rows, base = {}, None
    for method in order:
        p = RKVParams(**params, redundancy=method, **method_tiles.get(method, {}))
        dev = torch.device(p.device) if p.device is not None else kv.device

        def score(p=p):
            return _keep_indices(kv, q, drop_ratio, p, head_dim, attention)

        keep, score_s = timed(score, device=dev, repeats=repeats)
        _, peak = peak_memory(score, device=dev)
        _, rerotate_s = timed(apply_keep, kv, tokens, keep, rope_spec=spec, rerotate=True, device=kv.device,
                              repeats=repeats)
        if base is None:
            base = keep
        rows[method] = {"device": str(dev), "score_s": score_s, "rerotate_s": rerotate_s,
                        "modify_s": score_s + rerotate_s, "score_peak_mib": peak / 2**20, "kept": keep.numel(),
                        "agreement_with_exact": kept_agreement(keep, base),
                        "same_as_exact": bool(torch.equal(keep, base))}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "redundancy"
    return table.loc[[m for m in methods if m in rows] + ([] if "exact" in methods else ["exact"])]


def _keep(kv, q, drop_ratio, *, params: RKVParams, facts, attention=None, granularity="request"):
    return _keep_indices(kv, q, drop_ratio, params, facts.head_dim, attention, granularity)


register_policy("rkv", params=RKVParams, needs="window", keep=_keep, builtin=True, setup=model_attention,
                granularities=GRANULARITIES,
                summary="the window plus the earlier tokens with the highest importance minus redundancy",
                paper="Cai et al. 2025, R-KV, arXiv:2505.24133")


__all__ = ["RKV_METHODS", "RKVParams", "compare_redundancy_methods", "normalize_keys", "rkv_importance", "rkv_keep",
           "rkv_redundancy", "rkv_scores"]
