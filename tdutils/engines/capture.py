"""Query capture for the embedded engine: a registered transformers attention function that records
each layer's final query states (after `q_norm` where the model has one, after RoPE) and the arguments
the model called its attention with (`scaling`, `softcap`, `sliding_window`, learned sinks: see
`tdutils.attention`), and then runs the model's usual attention.

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


class AttentionRecorder:
    """Collects, per layer, the attention arguments of one forward pass (`attention[l]`, a `LayerAttention`)."""

    def __init__(self):
        self.attention: dict = {}

    def record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        from ..attention import LayerAttention

        self.attention[layer_idx] = LayerAttention.from_call(kwargs, query, key)

    def spec(self, num_layers: int):
        """The recorded `AttentionSpec`; ValueError when a layer's attention did not run through the hook."""
        from ..attention import AttentionSpec

        missing = [i for i in range(num_layers) if i not in self.attention]
        if missing:
            raise ValueError(f"layers {missing} did not call a transformers attention function (custom attention "
                             f"code): their scale, window and sinks cannot be read")
        return AttentionSpec(tuple(self.attention[i] for i in range(num_layers)))


class QueryRecorder(AttentionRecorder):
    """Collects the last `window` query rows of every layer during one forward pass.

    `layers[l]` is `[B, Hq, Tq, d]` (a copy); `window=None` keeps all rows. `attention[l]` as
    `AttentionRecorder`.
    """

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window
        self.layers: dict[int, torch.Tensor] = {}

    def record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        super().record(layer_idx, query, key, kwargs)
        if self.window == 0:
            return
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
            _active.record(module.layer_idx, query, key, kwargs)
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
