"""The model's own attention, per layer: scale, logit soft-capping, learned sinks and sliding window.

Query-aware scores (SnapKV, R-KV's importance, `HFEngine.check_query`) recompute attention from captured
queries and cached keys. They must compute what the model computes, and families differ: Granite scales
logits by `attention_multiplier`, Gemma 2/3 by `query_pre_attn_scalar ** -0.5`, Gemma 2 soft-caps logits
(`c * tanh(x / c)`), gpt-oss adds one learned *sink* logit per query head to the softmax denominator,
and sliding-window layers (Mistral, Phi-3, Qwen2 `use_sliding_window`, Gemma 2/3, gpt-oss) let a query at
position `p` see only keys at positions `> p - W`.

No family formula is written down here. `AttentionSpec` records, per layer, the arguments the model's
attention function is *called with* (`scaling`, `softcap`, `sliding_window`, `s_aux`/`sinks`): the
embedded engine records them at every prefill through the capture hook at the end of this module;
`AttentionSpec.from_model` runs a 2-token forward of a loaded model under the same hook; and
`AttentionSpec.from_config` runs that forward on the `meta` device (no weights, no memory), which gives
everything but the *values* of learned sinks (those need the weights: pass the loaded model).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .kernels import decode_attention_kernel

SINK_KWARGS = ("s_aux", "sinks")  # names under which transformers' attention modules pass learned sinks


@dataclass(frozen=True)
class LayerAttention:
    """How one layer turns `q·k` into attention probabilities.

    Fields:
        scaling: logits are `q·k * scaling` (`head_dim ** -0.5` for most families).
        softcap: when set, logits become `softcap * tanh(logits / softcap)` (Gemma 2).
        sliding_window: when set, a query at position `p` sees keys at positions `> p - sliding_window`
            (transformers' definition: the query itself and the `sliding_window - 1` tokens before it).
        sinks: fp32 `[Hq]` learned sink logit per query head (gpt-oss): one extra softmax column that
            takes probability mass and is then dropped, so a row sums to less than 1.
        has_sinks: the layer adds sinks; True with `sinks=None` when only the config was seen.
    """

    scaling: float
    softcap: float | None = None
    sliding_window: int | None = None
    sinks: torch.Tensor | None = None
    has_sinks: bool = False
    num_query_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None

    @classmethod
    def from_call(cls, kwargs: dict, query: torch.Tensor | None = None, key: torch.Tensor | None = None
                  ) -> LayerAttention:
        """From the keyword arguments an attention function received (`scaling=`, `softcap=`, ...) and the
        shapes of its `query [B, Hq, T, d]` and `key [B, H, T, d]` (head counts as the model computes them)."""
        sinks = next((kwargs[k] for k in SINK_KWARGS if kwargs.get(k) is not None), None)
        values = None
        if sinks is not None and sinks.device.type != "meta":
            values = sinks.detach().float().flatten().cpu().clone()
        window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        return cls(scaling=float(kwargs["scaling"]), softcap=float(softcap) if softcap else None,
                   sliding_window=int(window) if window else None, sinks=values, has_sinks=sinks is not None,
                   num_query_heads=None if query is None else int(query.shape[1]),
                   num_kv_heads=None if key is None else int(key.shape[1]),
                   head_dim=None if key is None else int(key.shape[-1]))

    def logits(self, qk: torch.Tensor) -> torch.Tensor:
        """Scaled (and soft-capped) logits from raw fp32 dot products `q·k` (any shape; a new tensor)."""
        x = qk * self.scaling
        if self.softcap is not None:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x


@dataclass(frozen=True)
class AttentionSpec:
    """`LayerAttention` of every layer of one model (`layers[l]` for layer `l`)."""

    layers: tuple[LayerAttention, ...]

    @classmethod
    def standard(cls, num_layers: int, head_dim: int) -> AttentionSpec:
        """Plain softmax attention with scale `head_dim ** -0.5`, no window, cap or sinks (Llama, Qwen3 ...)."""
        return cls(tuple(LayerAttention(head_dim ** -0.5) for _ in range(num_layers)))

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per layer: its sliding window, or None for full attention."""
        return [layer.sliding_window for layer in self.layers]

    def check_sinks(self) -> None:
        """Raise ValueError when a layer adds learned sinks whose values are unknown (spec from a config)."""
        if any(layer.has_sinks and layer.sinks is None for layer in self.layers):
            raise ValueError("this model adds learned attention sinks to its softmax and their values live in the "
                             "weights: pass the loaded model or the hf engine's facts (model_config=engine.facts) "
                             "instead of a bare config")

    @classmethod
    def from_model(cls, model) -> AttentionSpec:
        """Record the attention arguments of a loaded transformers causal LM with a 2-token forward."""
        return _probe(model, model.device)

    @classmethod
    def from_config(cls, config) -> AttentionSpec:
        """The same from a config alone: the model is built on the `meta` device (no weights) and probed.

        Learned sinks come back with `has_sinks=True, sinks=None` (see `check_sinks`).

        Raises:
            ValueError: the model cannot run on the meta device (the message says to pass the loaded model).
        """
        key = config.to_json_string(use_diff=False)
        if key not in _CONFIG_SPECS:
            from transformers import AutoModelForCausalLM

            try:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config)
                if hasattr(model, "set_experts_implementation") and getattr(config, "_experts_implementation", 1):
                    try:  # mixture-of-experts: the only experts kernel that runs on meta tensors
                        model.set_experts_implementation("batched_mm")
                    except (ValueError, AttributeError):
                        pass
                _CONFIG_SPECS[key] = _probe(model, "meta")
            except Exception as exc:  # noqa: BLE001 (any failure becomes one clear message)
                raise ValueError(f"cannot read the attention of {type(config).__name__} from its config "
                                 f"({exc.__class__.__name__}: {str(exc).splitlines()[0][:120]}); pass the loaded "
                                 f"model as model_config") from exc
        return _CONFIG_SPECS[key]


_CONFIG_SPECS: dict[str, AttentionSpec] = {}


def attention_spec(model_or_config) -> AttentionSpec:
    """`AttentionSpec` of a loaded model (its own forward), else of a config (the model built on `meta`)."""
    if isinstance(model_or_config, torch.nn.Module):
        return AttentionSpec.from_model(model_or_config)
    return AttentionSpec.from_config(model_or_config)


def scoring_attention(model_config) -> AttentionSpec | None:
    """The `AttentionSpec` query-aware policies score with, from what `make_drop_fn(model_config=...)` got.

    Returns None (plain attention, scale `head_dim ** -0.5`) for objects that are neither a transformers
    config nor a model (mappings, namespaces standing in for a config).

    Raises:
        ValueError: the model has learned sinks and only a bare config was given (see `check_sinks`), or the
            config's model cannot be built on the meta device.
    """
    from transformers import PreTrainedConfig

    if not isinstance(model_config, (PreTrainedConfig, torch.nn.Module)):
        return None
    spec = attention_spec(model_config)
    spec.check_sinks()
    return spec


def _probe(model, device) -> AttentionSpec:
    impl = model.config._attn_implementation
    recorder = AttentionRecorder()
    model.set_attn_implementation(capture_implementation(impl))
    try:
        with torch.inference_mode(), recording(recorder):
            model(input_ids=torch.tensor([[1, 2]], device=device))
    finally:
        model.set_attn_implementation(impl)
    return recorder.spec(model.config.num_hidden_layers)


def masked_logits(qk: torch.Tensor, layer: LayerAttention, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Model logits with causal and sliding-window masking by position (`-inf` where a key is invisible).

    Args:
        qk: fp32 `[..., w, T]` raw dot products of `w` queries with `T` keys.
        layer: the layer's attention.
        q_pos: `[w]` query positions; k_pos: `[T]` key positions.
    """
    x = layer.logits(qk)
    rel = q_pos[:, None] - k_pos[None, :]  # [w, T]
    hidden = rel < 0
    if layer.sliding_window is not None:
        hidden |= rel >= layer.sliding_window
    return x.masked_fill_(hidden, float("-inf"))


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of fp32 `[Hq, w, T]` logits, with one extra sink logit per head
    (`sinks [Hq]`) in the denominator when given; rows with every key masked give zeros, not NaN."""
    if sinks is not None:
        col = sinks.to(logits.device, torch.float32)[:, None, None].expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return probs.nan_to_num_(0.0)


# ----------------------------------------------------------------------------------------------------------------
# Query capture: a registered transformers attention function that records each layer's final query states (after
# `q_norm` where the model has one, after RoPE) and the arguments the model called its attention with, then runs
# the model's usual attention. transformers 5 dispatches attention by name (`config._attn_implementation`) through
# `AttentionInterface` and builds masks through a *separate* registry, `AttentionMaskInterface`: a name missing
# from the mask registry makes transformers skip mask creation altogether (it assumes an external backend), which
# would silently remove causal and padding masks. So every capture function is registered in both, with the mask
# function of the backend it wraps.

_PREFIX = "tdutils_capture_"


class AttentionRecorder:
    """Collects, per layer, the attention arguments of one forward pass (`attention[l]`, a `LayerAttention`)."""

    def __init__(self):
        self.attention: dict = {}

    def record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        self.attention[layer_idx] = LayerAttention.from_call(kwargs, query, key)

    def spec(self, num_layers: int):
        """The recorded `AttentionSpec`; ValueError when a layer's attention did not run through the hook."""
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
_slot_decode = False  # set by `slot_decode`: the engine's decode step, keys and values are slot store views


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None = None) -> torch.Tensor:
    """Softmax attention of one query token per row over a cache read in place: what `sdpa` computes for a decode
    step, streaming each key and value once (GQA without `repeat_kv`).

    fp32 and bf16 caches on the CPU go to the compiled kernel (`tdutils.kernels`: logits, softmax and the
    weighted sum in fp32, columns the mask hides for every head of a KV head skipped). Otherwise, or where it
    cannot be built, two batched matmuls (the `g` query heads of a KV head are the rows of one product) with the
    softmax in fp32 (float64 stays float64); in bf16 / fp16 a slot store view is then read as its whole rows
    (`_whole_rows`: up to the store's width, the columns past `T` weighted 0), which torch's `bmm` reads
    without a copy.

    Args:
        query: `[B, Hq, 1, d]`. key, value: `[B, H, T, d]` with `H` dividing `Hq` (query head `h * g + j` reads
            KV head `h`); strided views (a slot store's `[:rows, :, :cols]`) are read without a copy.
        mask: None, or `[B, 1 or Hq, 1, T]`: boolean (True where a query attends) or additive (float); each row
            attends somewhere.
        scaling: logits are `q·k * scaling` (default `d ** -0.5`).

    Returns:
        `[B, 1, Hq, d]` in `query`'s dtype (transformers' attention output layout).
    """
    B, Hq, _, d = query.shape
    H, T = key.shape[1], key.shape[2]
    g = Hq // H
    scaling = d ** -0.5 if scaling is None else scaling
    if _kernel_fits(key, value, mask):
        op = decode_attention_kernel()
        if op is not None:
            out = torch.empty(B, Hq, d, dtype=torch.float32)
            m = None if mask is None else mask[:, :, 0, :]  # [B, 1 or Hq, T]
            if m is not None and m.dtype != torch.bool:
                m = m.float()
            op(query.reshape(B, Hq, d).float().contiguous(), key, value, m, float(scaling), out)
            return out.to(query.dtype).view(B, 1, Hq, d)
    k, v, Tw = _whole_rows(key, T), _whole_rows(value, T), T
    if k is None or v is None:
        k, v = key.reshape(B * H, T, d), value.reshape(B * H, T, d)
    else:
        Tw = k.shape[1]
    q = query.reshape(B * H, g, d)
    # the cache as the left operand (measured faster than q @ k^T on strided keys): [B*H, Tw, g], in the cache's
    # dtype (bf16 logits are rounded to bf16: upcasting the keys instead cost more than it saved); at least fp32 on
    logits = torch.bmm(k, q.transpose(1, 2))[:, :T].view(B, H, T, g).transpose(2, 3)  # [B, H, g, T]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits.mul_(scaling)
    if mask is not None:  # [B, H or 1, g or 1, T]
        mask = mask.reshape(B, -1, g if mask.shape[1] == Hq else 1, T)
        logits = logits.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else logits.add_(mask)
    probs = logits.new_zeros((B, H, g, Tw), dtype=value.dtype)  # columns past T (whole rows) weigh 0
    probs[..., :T] = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs.view(B * H, g, Tw), v)  # [B*H, g, d]
    return out.view(B, 1, Hq, d)


def _kernel_fits(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the compiled kernel (`tdutils.kernels`) takes these operands: CPU keys and values both fp32 or both
    bf16 with unit last stride, a boolean or floating mask."""
    return (key.device.type == "cpu" and key.dtype == value.dtype and key.dtype in (torch.float32, torch.bfloat16)
            and key.stride(-1) == 1 and value.stride(-1) == 1 and key.shape == value.shape
            and (mask is None or mask.dtype == torch.bool or mask.is_floating_point()))


def _whole_rows(x: torch.Tensor, T: int) -> torch.Tensor | None:
    """`x` `[B, H, T, d]`, a view of the first `T` of `Tw` columns of a `[.., B, H, Tw, d]` tensor (a slot store's
    `[:rows, :, :cols]`), as the whole `[B*H, Tw, d]` rows: a batch torch's half-precision `bmm` reads in place,
    where it copies the strided `[B*H, T, d]` first (fp32 `bmm` does not); the columns past `T` must hold finite
    values (a slot store's do): they are read and weighted 0. None when `x` is not such a view, or not half
    precision."""
    B, H, _, d = x.shape
    Tw = x.stride(1) // d
    if x.stride() != (H * Tw * d, Tw * d, d, 1) or Tw == T or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if x.untyped_storage().nbytes() < (x.storage_offset() + B * H * Tw * d) * x.element_size():
        return None
    return x.as_strided((B * H, Tw, d), (Tw * d, d, 1))


class slot_decode:
    """Context manager: inside it, the capturing `sdpa` attention runs `decode_attention` for one-token queries
    on the CPU without soft-capping, sinks or dropout (the `hf` engine's decode step, whose keys
    and values are slot store views); anything else goes to `sdpa` as usual."""

    def __enter__(self):
        global _slot_decode
        self._prev, _slot_decode = _slot_decode, True
        return self

    def __exit__(self, *exc):
        global _slot_decode
        _slot_decode = self._prev
        return False


def _plain_softmax(kwargs) -> bool:
    """No soft-capping, sinks or dropout asked of the attention call: a plain masked softmax."""
    return (not kwargs.get("dropout") and kwargs.get("softcap") is None
            and not any(kwargs.get(k) is not None for k in SINK_KWARGS))


def _decode_fits(query, key, mask, kwargs) -> bool:
    return (query.shape[2] == 1 and query.device.type == "cpu" and query.shape[1] % key.shape[1] == 0
            and (mask is None or (mask.dim() == 4 and mask.shape[2] == 1)) and _plain_softmax(kwargs))


def _masked_fits(module, query, key, mask, kwargs) -> bool:
    """A masked multi-token forward on the CPU that `_masked_sdpa` can take (no soft-capping, sinks, position bias,
    dropout or attention weights asked for)."""
    return (query.device.type == "cpu" and mask is not None and mask.dim() == 4 and query.shape[2] > 1
            and query.shape[1] % key.shape[1] == 0
            and _plain_softmax({**kwargs, "dropout": 0}) and not (kwargs.get("dropout") and module.training)
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions"))


QUERY_BLOCK = 256  # query rows per `sdpa` call of a banded masked forward (`_key_spans`)


def _key_spans(mask: torch.Tensor, block: int | None = None) -> list[tuple[int, int, int, int]] | None:
    """The `(q0, q1, k0, k1)` key span each block of `block` (default `QUERY_BLOCK`) query rows attends to in `mask` (`[B, 1 or H, M, T]`,
    boolean keep or additive): keys `k0:k1` hold every key any row of the block (in any batch row and head) may
    see. None where blocks would not save a quarter of the work (a short forward, a mask without a band) or a
    block sees no key at all (left to `sdpa` as a whole)."""
    M, T = mask.shape[-2:]
    block = block or QUERY_BLOCK
    if M < 2 * block:
        return None
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    rows = allowed.flatten(0, 1).any(dim=0)  # [M, T]
    spans = []
    for q0 in range(0, M, block):
        q1 = min(q0 + block, M)
        cols = rows[q0:q1].any(dim=0).nonzero()
        if cols.numel() == 0:
            return None
        spans.append((q0, q1, int(cols[0]), int(cols[-1]) + 1))
    if sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in spans) > 0.75 * M * T:
        return None
    return spans


def _masked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
    """transformers' `sdpa` attention of a masked multi-token forward (the engine's prefill of unequal prompts,
    sliding-window layers, `extend`, teacher forcing), with two savings:

    - GQA without `repeat_kv`: torch's CPU kernel reads KV head `h // g` for query head `h` (`enable_gqa`), where
      transformers copies every key and value `g` times whenever a mask is given. Same kernel, same sums.
    - Banded masks in blocks: a sliding window (Gemma 3's local layers) or a causal mask over a long forward runs
      one `sdpa` call per `QUERY_BLOCK` query rows over the keys that block may see (`_key_spans`), where the
      masked kernel would visit all `T` keys of every row (at 2048 tokens and a 512-token window, 2.6x less work).
      The keys left out are masked for every row of the block, so only the order of the softmax sums changes.

    query `[B, Hq, M, d]`, key / value `[B, H_kv, T, d]`, mask `[B, 1 or Hq, M, T]` (boolean or additive) ->
    `[B, M, Hq, d]` (transformers' attention output layout)."""
    mask = mask[..., :key.shape[2]]
    gqa = query.shape[1] != key.shape[1]
    spans = _key_spans(mask)
    if spans is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()
    B, Hq, M, _ = query.shape
    out = torch.empty(B, M, Hq, value.shape[-1], dtype=query.dtype, device=query.device)  # [B, M, Hq, d]
    for q0, q1, k0, k1 in spans:
        part = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], attn_mask=mask[..., q0:q1, k0:k1],
            scale=scaling, enable_gqa=gqa)  # [B, Hq, q1 - q0, d]
        out[:, q0:q1] = part.transpose(1, 2)
    return out


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
        if _slot_decode and base == "sdpa" and _decode_fits(query, key, attention_mask, kwargs):
            return decode_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
        if base == "sdpa" and _masked_fits(module, query, key, attention_mask, kwargs):
            return _masked_sdpa(query, key, value, attention_mask, kwargs.get("scaling")), None
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


def ensure_capture(model) -> None:
    """Make `model` run the capturing attention that wraps its *current* backend: a no-op when it already does;
    after `model.set_attn_implementation("eager")` (which drops the capturing function, e.g. when a user switched
    backends to get attentions) it wraps the new backend.

    Raises:
        ValueError: the current backend is one capture cannot wrap (flash / flex attention kernels), in one line
            naming it.
    """
    impl = model.config._attn_implementation
    if impl.startswith(_PREFIX):
        return
    try:
        name = capture_implementation(impl)
    except ValueError:
        raise ValueError(f"the model's attention backend is {impl!r} (switched after the engine opened?); query "
                         f"capture wraps only 'sdpa' and 'eager': call model.set_attn_implementation('sdpa') or "
                         f"('eager') first") from None
    model.set_attn_implementation(name)


__all__ = ["AttentionRecorder", "AttentionSpec", "LayerAttention", "QueryRecorder", "attention_spec",
           "capture_implementation", "ensure_capture", "masked_logits", "recording",
           "scoring_attention", "softmax_with_sinks"]
