"""Prepacked linear layers for the CPU decode step (oneDNN), what vLLM-CPU and Inductor's freezing do.

A decode step multiplies a few rows (the batch) by every weight matrix of the model: it is bound by how fast
the weights stream from memory. For 8 to 64 rows MKL's `F.linear` on a plain row-major weight reaches 10-15 GB/s
on 2 cores, while oneDNN's matmul on a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, then `torch.ops.mkldnn._linear_pointwise`) reaches about twice that
(bench/engine_bench.py measures what it buys). `PackedLinears` reorders every `nn.Linear` weight of a model once
and, inside `with packed:`, routes those modules' forward through the packed copy; outside it the model is the
user's, unchanged. Results equal `F.linear`'s up to float summation order (about 1e-6 relative in fp32).

Where the CPU has the instructions (fp32: AVX-512; bf16: AVX512-BF16), weights take tdutils' own kernel instead
(`tdutils.kernels.linear_kernels`, `tdutils/csrc/linear.cpp`): the weight packed once into panels of 64 output
columns, each panel one sequential stream read once per call. At the decode batches of the engine (1 to 8 rows)
oneDNN's matmul left the weight stream well below a plain read of the same bytes (`bench/lean_step.py --compare
linears` times both in the engine's decode step, side by side).

Cost: one more copy of the linear weights (the packed layout), made when the engine is opened.

Weights edited after packing. Many edits leave no trace autograd sees: `w.data.mul_(0)`, `w.data.copy_(...)`,
an edit of a tied `lm_head.weight.data`, a fused optimizer step (`torch.optim.AdamW(fused=True)`) change the
values without bumping `w._version`. So each `with packed:` (the engine: each decode) starts by comparing every
packed weight's fingerprint, its product with a fixed random vector `w @ r` (`[out]`, in the weight's dtype: one
read of the weights, less than a decode step), with the one taken at packing, and packs again what changed; during
the block, an in-place edit that bumps `_version` or moves the storage is seen at the module's next call. An
edit so small that no row of `w @ r` moves is below the rounding of the layer's own output; `refresh()` packs
everything again regardless. A module whose `forward` the user replaced (`lin.forward = f`) or whose weight is no
longer packable (`model.double()`, moved off the CPU) runs its own forward, and what the user set is never removed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import linear_kernels

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Packing pays where a weight streams from memory: a matrix of at least 2^18 elements (1 MiB in fp32; smaller
# ones gain little through oneDNN, whose call costs ~12 us) in a model whose packed weights (>= 32 MiB) do not stay
# in the CPU caches between steps. In bf16 MKL's small matmuls are slow (SmolLM2's 192 x 576 k/v projections: 68 us
# each, cold, in a decode step), and packing from 2^16 elements bought 13% of a bf16 step. In fp32 oneDNN from 2^16
# bought 2%, not taken, as it moved fp32 logits by float summation order past the real-model exactness tests' 1e-4;
# tdutils' panels (summed in blocks, F.linear's accuracy) take fp32 from 2^16 too (Gemma 3's 256 x 640 k/v
# projections: 4.7% of an fp32 step through F.linear).
MIN_ELEMENTS = 1 << 18
MIN_ELEMENTS_SMALL = 1 << 16
AUTO_MIN_BYTES = 32 << 20


def _eligible(model: nn.Module, min_elements: int) -> list[nn.Linear]:
    # exactly nn.Linear (quantized / adapter subclasses keep their forward); a module whose forward is already
    # replaced (accelerate's offload hooks) keeps it
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype in PACKED_DTYPES
            and m.weight.numel() >= min_elements and "forward" not in m.__dict__]


def default_min_elements(dtype: torch.dtype) -> int:
    """The smallest weight (in elements) the engine's default packs for a model in `dtype`: `MIN_ELEMENTS_SMALL` in
    bf16 and where tdutils' fp32 panels run (`tdutils.kernels.linear_kernels`), else `MIN_ELEMENTS`."""
    if dtype == torch.bfloat16:
        return MIN_ELEMENTS_SMALL
    return MIN_ELEMENTS_SMALL if dtype == torch.float32 and linear_kernels(dtype) is not None else MIN_ELEMENTS


def packing_pays(model: nn.Module) -> bool:
    """Whether the engine's default packs `model`: `packing_available` and at least `AUTO_MIN_BYTES` of linear
    weights with `MIN_ELEMENTS` or more each (a model that fits the CPU caches gains nothing)."""
    return packing_available(model) and sum(
        m.weight.numel() * m.weight.element_size() for m in _eligible(model, MIN_ELEMENTS)) >= AUTO_MIN_BYTES


def packing_available(model: nn.Module) -> bool:
    """Whether `PackedLinears` can serve `model`: torch built with oneDNN, weights on the CPU in fp32 or bf16."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype in PACKED_DTYPES


def _packable(w: torch.Tensor) -> bool:
    return w.dtype in PACKED_DTYPES and w.device.type == "cpu"


class PackedLinears:
    """The `nn.Linear` modules of `model` with their weights prepacked for oneDNN; a context manager.

    Args:
        model: a CPU model in fp32 or bf16 (`packing_available`); only modules of exactly type `nn.Linear`
            (not subclasses: quantized or adapter layers keep their own forward) are packed.
        rows: the typical number of input rows (the decode batch) oneDNN chooses its blocking for; any row
            count works.
        min_elements: pack only weights of at least this many elements (default `MIN_ELEMENTS`; 1 packs all).

    Inside `with packed:` each packed module computes `y = x @ W.T + b` (x `[..., in]` -> y `[..., out]`, the
    module's dtype) from the packed copy of its *current* weight: entering (depth 0) packs again every weight
    whose fingerprint changed (module docstring). A module with a forward of the user's own (set after packing)
    or a weight no longer in fp32/bf16 on the CPU keeps its own forward. The context removes only the forwards
    it installed on exit, also after an error. Raises RuntimeError from `__init__` when `packing_available(model)`
    is False.
    """

    def __init__(self, model: nn.Module, rows: int = 8, min_elements: int = MIN_ELEMENTS):
        if not packing_available(model):
            raise RuntimeError("prepacked linears need torch with oneDNN (mkldnn) and a CPU model in float32 or "
                               "bfloat16; open the engine with packed_linears=False")
        self.rows = max(1, int(rows))
        self._mods = _eligible(model, min_elements)
        self._forwards = [(lambda x, _m=m: self._forward(_m, x)) for m in self._mods]
        # id(module) -> (packed weight, its _version, data_ptr, fingerprint) at packing
        self._packed: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        self._probes: dict[tuple, torch.Tensor] = {}  # (in_features, dtype) -> the fixed random vector r
        self._installed: list[tuple[nn.Module, object]] = []
        self._depth = 0
        # dtype -> (pack, linear_out) or None (that dtype's weights then go to oneDNN)
        self._panels = {dt: linear_kernels(dt) for dt in PACKED_DTYPES}
        for m in self._mods:
            self._pack(m)

    def __len__(self) -> int:
        return len(self._mods)

    @property
    def bytes(self) -> int:
        """Bytes of the packed copies (the memory this costs on top of the model)."""
        return sum(p.numel() * p.element_size() for p, *_ in self._packed.values())

    def _fingerprint(self, w: torch.Tensor) -> torch.Tensor:
        """`w @ r` `[out]` in `w`'s dtype, `r` a fixed random vector per input width and dtype."""
        key = (w.shape[1], w.dtype)
        if key not in self._probes:
            gen = torch.Generator().manual_seed(w.shape[1])
            self._probes[key] = torch.randn(w.shape[1], generator=gen).to(w.dtype)
        return torch.mv(w, self._probes[key])

    def _pack(self, m: nn.Linear) -> torch.Tensor:
        w = m.weight.detach()
        panels = self._panels.get(w.dtype)
        if panels is not None and (w.dtype == torch.float32 or w.shape[1] % 2 == 0):
            packed = panels[0](w.contiguous())  # panels [ceil(out / 64), in, 64] (bf16: pairs of in)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, self.rows)  # blocked copy [out, in]
        self._packed[id(m)] = (packed, w._version, w.data_ptr(), self._fingerprint(w))
        return packed

    def refresh(self) -> int:
        """Pack every packable weight again from its current values; returns how many were packed."""
        with torch.inference_mode():
            mods = [m for m in self._mods if _packable(m.weight)]
            for m in mods:
                self._pack(m)
        return len(mods)

    def sync(self) -> int:
        """Pack again every packable weight whose storage, `_version` or fingerprint changed since it was packed
        (edits through `.data` and fused optimizer steps move only the fingerprint); returns how many.
        Cost: one `w @ r` per weight, a read of all packed weights."""
        n = 0
        with torch.inference_mode():
            for m in self._mods:
                w = m.weight.detach()
                if not _packable(w):
                    continue
                _, version, ptr, fp = self._packed[id(m)]
                if (w._version != version or w.data_ptr() != ptr or fp.dtype != w.dtype
                        or not torch.equal(self._fingerprint(w), fp)):
                    self._pack(m)
                    n += 1
        return n

    def _forward(self, m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = m.weight
        if x.dtype != w.dtype or x.device.type != "cpu" or not _packable(w):
            return F.linear(x, w, m.bias)
        packed, version, ptr, _ = self._packed[id(m)]
        if w._version != version or w.data_ptr() != ptr:  # edited in place inside the block: pack again
            packed = self._pack(m)
        if packed.dim() == 3:  # tdutils' panels (no autograd: a product that needs gradients takes F.linear)
            bias = m.bias
            if (bias is not None and bias.dtype != w.dtype) or (torch.is_grad_enabled() and (
                    x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad))):
                return F.linear(x, w, bias)
            rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, in]
            out = rows.new_empty((rows.shape[0], w.shape[0]))  # [M, out]
            self._panels[w.dtype][1](rows, packed, None if bias is None else bias.detach().contiguous(), out)
            return out.reshape(*x.shape[:-1], w.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed, m.bias, "none", [], "")

    def __enter__(self):
        if self._depth == 0:
            self.sync()
            self._installed = []
            for m, fwd in zip(self._mods, self._forwards):
                # a forward of the user's own (an ablation, an offload hook set after packing) is honoured
                if "forward" in m.__dict__ or not _packable(m.weight):
                    continue
                m.__dict__["forward"] = fwd  # an instance attribute: this module only, nothing else changes
                self._installed.append((m, fwd))
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for m, fwd in self._installed:
                if m.__dict__.get("forward") is fwd:  # never what the user set meanwhile
                    del m.__dict__["forward"]
            self._installed = []
        return False
