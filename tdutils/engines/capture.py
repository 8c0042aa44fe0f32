"""Query capture for the embedded engine: a registered transformers attention function that records
each layer's final query states (after `q_norm` where the model has one, after RoPE) and then runs the
model's usual attention.

transformers 5 dispatches attention by name (`config._attn_implementation`) through
`AttentionInterface`, and builds masks through a *separate* registry, `AttentionMaskInterface`: a name
missing from the mask registry makes transformers skip mask creation altogether (it assumes an external
backend), which would silently remove causal and padding masks. So every capture function is registered
in both, with the mask function of the backend it wraps.
"""

from __future__ import annotations

import sys

import torch

_PREFIX = "tdutils_capture_"


class QueryRecorder:
    """Collects the last `window` query rows of every layer during one forward pass.

    `layers[l]` is `[B, Hq, Tq, d]` (a copy); `window=None` keeps all rows.
    """

    def __init__(self, window: int | None):
        self.window = window
        self.layers: dict[int, torch.Tensor] = {}

    def record(self, layer_idx: int, query: torch.Tensor) -> None:
        # query: [B, Hq, q_len, d]; with left padding the real tokens end at the right edge of every row,
        # so the last `window` columns are the last `window` tokens of each request.
        q = query if self.window is None else query[:, :, -self.window:, :]
        self.layers[layer_idx] = q.detach().clone()


_active: QueryRecorder | None = None


class recording:
    """Context manager: capture queries into `recorder` for the forward passes run inside it."""

    def __init__(self, recorder: QueryRecorder):
        self.recorder = recorder

    def __enter__(self):
        global _active
        self._prev, _active = _active, self.recorder
        return self.recorder

    def __exit__(self, *exc):
        global _active
        _active = self._prev
        return False


def _wrap(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        if _active is not None:
            _active.record(module.layer_idx, query)
        if base == "eager":
            # each modeling file defines its own eager attention (GQA repeat, softcapping, ...)
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            fn = ALL_ATTENTION_FUNCTIONS[base]
        return fn(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{_PREFIX}{base}"
    return attention


def capture_implementation(base: str) -> str:
    """Register (once) and return the name of the capturing attention that wraps backend `base`.

    Args:
        base: `"sdpa"` or `"eager"` (the model's current `config._attn_implementation`).

    Raises:
        ValueError: another backend (flash / flex attention kernels are not wrapped yet).
    """
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if base.startswith(_PREFIX):
        return base
    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    if base not in masks:
        raise ValueError(f"query capture supports the 'sdpa' and 'eager' attention backends, got {base!r}; "
                         f"load the model with attn_implementation='sdpa'")
    name = _PREFIX + base
    AttentionInterface.register(name, _wrap(base))
    AttentionMaskInterface.register(name, masks[base])
    return name
