"""Rotary position embeddings (RoPE): resolve them from a model config, apply them, and move keys.

RoPE: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864; the
scaled types (`SUPPORTED_ROPE_TYPES`: linear, dynamic, yarn (arXiv:2309.00071), llama3, longrope) take
their frequencies and `attention_scaling` from transformers' `ROPE_INIT_FUNCTIONS`, bit for bit.

- `RopeSpec.from_config(config)`, `model_rope(model_or_config)`: the spec (`head_dim`, `rotary_dim`, layout
  `"neox"` or `"gptj"`, fp32 `inv_freq [rotary_dim/2]`); one per layer where layer types differ (Gemma 3).
- `apply_rope(x, positions, spec)`: `x [..., T, H, head_dim]` or `[..., T, head_dim]`, as the model does.
- `rerotate_keys(k, old, new, spec)`, `rerotate_k_cache(kv [2, L, T, D], old, new, spec)`: move post-RoPE
  keys to new positions, equal to the model's own keys there to fp32 rounding; a pure rotation (norms kept).
Arithmetic in fp32, cast once to the input dtype; channels past `rotary_dim` pass through bit-identical.
Errors: `TypeError` (x not floating, positions not integers); `ValueError` (shapes, config, rope type,
layout, positions beyond a `dynamic`/`longrope` spec's range). A wrong rotation raises nothing and only
degrades answers, hence the strictness; background: docs/models.md, "RoPE and re-rotation (`tdutils.rope`)".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SUPPORTED_ROPE_TYPES", "RopeSpec", "apply_rope", "model_rope", "rerotate_k_cache", "rerotate_keys"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_LAYOUTS = ("neox", "gptj")

# Model families whose transformers implementation rotates interleaved pairs (2i, 2i+1); every
# other family uses transformers' default `rotate_half` (neox) layout. Checked against transformers
# 5.24: gptj/codegen use `rotate_every_two`, the others a `rotate_half` built from x[..., ::2], x[..., 1::2].
_GPTJ_LAYOUT_FAMILIES = frozenset({
    "gptj", "codegen", "cohere", "cohere2", "cohere2_moe", "glm", "glm4", "helium",
    "ernie4_5", "ernie4_5_moe", "blt",
})

# Families whose modeling code hard-codes the base and whose configs carry no theta field at all:
# transformers' modeling_gptj.py / modeling_codegen.py `create_sinusoidal_positions` use 10000.
# This is a fact about those models, not a fallback: any other config without theta is an error.
_HARDCODED_THETA_BY_FAMILY = {"gptj": 10000.0, "codegen": 10000.0}

# Config fields searched for theta, in order; named in the error when none is found.
_THETA_FIELDS = (
    "rope_parameters['rope_theta']",
    "rope_theta",
    "rope_scaling['rope_theta']",
    "rotary_emb_base",
)

# Element budget of one fp32 temporary in rerotate_k_cache (4 Mi elements = 16 MiB); see _token_chunk.
_CHUNK_ELEMS = 1 << 22
# ... and at least 64 Ki elements (256 KiB): a small cache is rotated in one chunk per layer, since for it
# the per-chunk operator overhead, not memory, is the cost (the SnapKV/R-KV modify step of the tiny model).
_CHUNK_FLOOR = 1 << 16


# --------------------------------------------------------------------------------------------------
# config reading helpers
# --------------------------------------------------------------------------------------------------


def _get(obj: Any, name: str) -> Any:
    """Field ``name`` of a config that may be a transformers config, a plain object or a mapping."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _first(obj: Any, *names: str) -> Any:
    for name in names:
        value = _get(obj, name)
        if value is not None:
            return value
    return None


def _as_dict(obj: Any) -> dict[str, Any] | None:
    """rope_parameters / rope_scaling as a dict: accepts a mapping, an object with to_dict(), or any object."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "to_dict"):
        return dict(obj.to_dict())
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _is_nested(params: dict[str, Any]) -> bool:
    """True for per-layer-type rope parameters ({"full_attention": {...}, "sliding_attention": {...}})."""
    flat_keys = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"}
    return bool(params) and not (flat_keys & params.keys()) and all(
        v is None or isinstance(v, Mapping) for v in params.values()
    )


class _InitConfig:
    """The minimal config transformers' ROPE_INIT_FUNCTIONS read (transformers 5.x).

    They call ``config.standardize_rope_params()`` (a no-op here: we pass standardized parameters),
    read ``config.rope_parameters`` (``rope_theta``, ``partial_rotary_factor``, ``factor`` and the
    type's own keys), ``head_dim`` (or ``hidden_size // num_attention_heads``) and
    ``max_position_embeddings``. We present ``head_dim = rotary_dim`` with ``partial_rotary_factor = 1``,
    so ``dim = int(head_dim * partial_rotary_factor)`` is exactly our rotary_dim, with no float rounding.
    """

    def __init__(self, rope_parameters: dict[str, Any], rotary_dim: int, max_position_embeddings: int | None):
        self.rope_parameters = rope_parameters
        self.head_dim = rotary_dim
        self.hidden_size = rotary_dim
        self.num_attention_heads = 1
        self.max_position_embeddings = max_position_embeddings

    def standardize_rope_params(self) -> None:
        return None


def _missing_keys_as_value_error(fn, rope_type: str):
    """transformers' init functions index rope_parameters directly; report a missing key as a ValueError."""

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyError as err:
            raise ValueError(f"rope_type {rope_type!r}: rope parameters lack {err}") from err

    return call


def _default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    # Same expression as transformers' compute_default_rope_parameters (Llama, Qwen3, ...), so the
    # fp32 values are bit-identical to the model's buffer. [rd/2] fp32
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def _text_config(config: Any) -> Any:
    """The language model's config: multimodal configs keep its fields in a text config."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    if isinstance(config, Mapping) and "text_config" in config and "num_attention_heads" not in config:
        return config["text_config"]
    return config


def _head_dim(config: Any) -> int:
    """``config.head_dim`` when present and not None, else ``hidden_size // num_attention_heads``."""
    head_dim = _get(config, "head_dim")
    if head_dim is None:
        hidden = _first(config, "hidden_size", "n_embd", "d_model")
        heads = _first(config, "num_attention_heads", "n_head", "num_heads")
        if hidden is None or heads is None:
            raise ValueError(
                "cannot resolve head_dim: config has no head_dim and no hidden_size/num_attention_heads"
            )
        head_dim = int(hidden) // int(heads)
    return int(head_dim)


def _rope_params(config: Any, layer_type: str | None) -> tuple[dict | None, dict | None, dict[str, Any]]:
    """``(rope_parameters, rope_scaling, merged)``: transformers-5 ``rope_parameters`` (the ``layer_type``
    entry of per-layer-type ones), legacy ``rope_scaling``, and both merged without None values
    (``rope_parameters`` wins where both set a key)."""
    rope_parameters = _as_dict(_get(config, "rope_parameters"))
    rope_scaling = _as_dict(_get(config, "rope_scaling"))
    if rope_parameters and _is_nested(rope_parameters):
        if layer_type is None:
            raise ValueError(
                f"config has per-layer-type rope parameters {sorted(rope_parameters)}; "
                "pass layer_type= to choose one (one RopeSpec describes one rotation)"
            )
        if layer_type not in rope_parameters or rope_parameters[layer_type] is None:
            raise ValueError(f"layer_type {layer_type!r} not in rope parameters {sorted(rope_parameters)}")
        rope_parameters = _as_dict(rope_parameters[layer_type])
    params: dict[str, Any] = {}
    for source in (rope_scaling, rope_parameters):
        if source:
            params.update({k: v for k, v in source.items() if v is not None})
    if params.get("mrope_section") is not None:
        raise ValueError("multimodal RoPE (mrope_section) is not supported: its positions are 3-D")
    return rope_parameters, rope_scaling, params


def _theta(config: Any, rope_parameters: dict | None, rope_scaling: dict | None, model_type: Any) -> float:
    """The RoPE base from the fields of `_THETA_FIELDS` in order, else the family's hard-coded one; never a
    silent default."""
    candidates = (_first(rope_parameters, "rope_theta"), _get(config, "rope_theta"),
                  _first(rope_scaling, "rope_theta"), _get(config, "rotary_emb_base"),
                  _HARDCODED_THETA_BY_FAMILY.get(model_type))
    theta = next((c for c in candidates if c is not None), None)
    if theta is None:
        raise ValueError(
            "RoPE theta not found in the config; looked at " + ", ".join(_THETA_FIELDS)
            + f" (model_type={model_type!r}). Set rope_theta (or rope_parameters['rope_theta'])."
        )
    return float(theta)


def _rotary_dim(config: Any, params: dict[str, Any], head_dim: int) -> int:
    """``int(head_dim * partial_rotary_factor)``, else ``int(head_dim * rotary_pct)``, else ``rotary_dim``,
    else ``head_dim``; checked even and in ``(0, head_dim]``."""
    prf = params.get("partial_rotary_factor", _get(config, "partial_rotary_factor"))
    rotary_pct = _get(config, "rotary_pct")
    rotary_dim_field = _get(config, "rotary_dim")
    if prf is not None:
        rotary_dim = int(head_dim * float(prf))  # int(), as transformers computes `dim`
    elif rotary_pct is not None:
        rotary_dim = int(head_dim * float(rotary_pct))
    elif rotary_dim_field is not None:
        rotary_dim = int(rotary_dim_field)
    else:
        rotary_dim = head_dim
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim} "
            f"(partial_rotary_factor={prf}, rotary_pct={rotary_pct}, rotary_dim={rotary_dim_field})"
        )
    return rotary_dim


def _scaled_init_params(config: Any, params: dict[str, Any], rope_type: str, theta: float, max_pos: Any) -> dict:
    """The rope parameters transformers' init function of a scaled `rope_type` reads, checked for the keys it
    needs."""
    init_params = {k: v for k, v in params.items() if k != "type"}
    init_params.update(rope_type=rope_type, rope_theta=theta, partial_rotary_factor=1.0)
    if rope_type in ("llama3", "yarn", "longrope"):
        # mirrors RotaryEmbeddingConfigMixin.standardize_rope_params: a config-level
        # original_max_position_embeddings (Phi-3) takes priority, else max_position_embeddings
        omp = _get(config, "original_max_position_embeddings")
        if omp is not None:
            init_params["original_max_position_embeddings"] = omp
        elif init_params.get("original_max_position_embeddings") is None:
            init_params["original_max_position_embeddings"] = max_pos
        if init_params["original_max_position_embeddings"] is None:
            raise ValueError(
                f"rope_type {rope_type!r} needs original_max_position_embeddings or "
                "max_position_embeddings in the config"
            )
    if rope_type == "dynamic" and max_pos is None:
        raise ValueError("rope_type 'dynamic' needs max_position_embeddings in the config")
    if rope_type in ("linear", "dynamic", "llama3") and init_params.get("factor") is None:
        raise ValueError(f"rope_type {rope_type!r} needs rope_parameters['factor']")
    return init_params


def _scaled_frequencies(config: Any, params: dict[str, Any], rope_type: str, theta: float, rotary_dim: int,
                        seq_len: int | None) -> tuple[torch.Tensor, float, int | None]:
    """``(inv_freq [rd/2], attention_scaling, max_positions)`` of a scaled rope type, from transformers'
    ``ROPE_INIT_FUNCTIONS`` (see `RopeSpec.from_config` for ``dynamic`` and ``longrope``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    max_pos = _first(config, "max_position_embeddings", "n_positions")
    init_params = _scaled_init_params(config, params, rope_type, theta, max_pos)
    init_cfg = _InitConfig(init_params, rotary_dim, None if max_pos is None else int(max_pos))
    init_fn = _missing_keys_as_value_error(ROPE_INIT_FUNCTIONS[rope_type], rope_type)
    if rope_type == "dynamic":
        # one base for both legs: the base transformers uses for a sequence of `eff` tokens
        eff = int(max_pos) if seq_len is None else max(int(seq_len), int(max_pos))
        inv_freq, attention_scaling = init_fn(init_cfg, None, seq_len=eff)
        return inv_freq, attention_scaling, eff
    if rope_type == "longrope":
        omp = int(init_params["original_max_position_embeddings"])
        # transformers: short factors while seq_len <= original_max_position_embeddings, long after
        inv_freq, attention_scaling = init_fn(init_cfg, None, seq_len=seq_len)
        return inv_freq, attention_scaling, omp if (seq_len is None or seq_len <= omp) else None
    inv_freq, attention_scaling = init_fn(init_cfg, None)
    return inv_freq, attention_scaling, None


# --------------------------------------------------------------------------------------------------
# RopeSpec
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class RopeSpec:
    """Everything needed to apply or move RoPE for one model.

    Fields:
        head_dim: channels per attention head (``d``).
        rotary_dim: rotated channels per head (``rd``, even, ``0 < rd <= d``); the rest pass through.
        theta: RoPE base (``rope_theta``) before any scaling.
        layout: ``"neox"`` (pairs ``i, i + rd/2``) or ``"gptj"`` (pairs ``2i, 2i+1``).
        rope_type: one of :data:`SUPPORTED_ROPE_TYPES`.
        attention_scaling: factor transformers multiplies cos and sin by (1.0 except yarn/longrope).
        inv_freq: fp32 tensor ``[rd/2]``, the model's inverse frequencies (after scaling).
        max_positions: positions must be ``< max_positions`` (``dynamic``/``longrope`` only, whose
            frequencies depend on the sequence length); ``None`` means no limit.

    Build it with :meth:`from_config`; change the layout with ``dataclasses.replace(spec, layout=...)``.
    """

    head_dim: int
    rotary_dim: int
    theta: float
    layout: str
    rope_type: str
    attention_scaling: float
    inv_freq: torch.Tensor
    max_positions: int | None = None

    def __post_init__(self) -> None:
        self.inv_freq = torch.as_tensor(self.inv_freq, dtype=torch.float32).detach().cpu()
        self._validate()

    def _validate(self) -> None:
        if self.layout not in _LAYOUTS:
            raise ValueError(f"RopeSpec.layout must be one of {_LAYOUTS}, got {self.layout!r}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}"
            )
        if tuple(self.inv_freq.shape) != (self.rotary_dim // 2,):
            raise ValueError(
                f"inv_freq must have shape [rotary_dim/2] = [{self.rotary_dim // 2}], "
                f"got {list(self.inv_freq.shape)}"
            )

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        layout: str | None = None,
        seq_len: int | None = None,
        layer_type: str | None = None,
    ) -> RopeSpec:
        """Resolve the RoPE of a model from its config.

        Args:
            config: a transformers ``PreTrainedConfig`` (multimodal configs: the text config is used),
                any object with the same attribute names, or a mapping (e.g. a parsed ``config.json``).
            layout: ``"neox"`` or ``"gptj"``; default from ``config.model_type`` (interleaved ``gptj`` for
                GPT-J, CodeGen, Cohere, GLM, Helium, ERNIE-4.5; ``neox`` for every other family).
            seq_len: only for ``dynamic`` and ``longrope``, whose frequencies depend on the sequence
                length: the prefill length the cached keys were computed with. Default: the length
                up to which the unscaled (``dynamic``) or short-factor (``longrope``) frequencies apply.
            layer_type: for configs with per-layer-type rope parameters (Gemma 3 ...): which entry.

        ``dynamic`` (NTK) RoPE: transformers recomputes the base from the current sequence length, so the keys
        of one prompt carry the base of its prefill length. This method therefore resolves *one* base, the one
        transformers uses for a sequence of ``seq_len`` tokens (default ``max_position_embeddings``, which
        gives the unscaled ``theta``), and the spec uses it for both legs of a re-rotation. Positions at or
        beyond the length that base is valid for are refused with a ``ValueError`` rather than re-rotated
        with a base the model did not use. ``longrope`` is handled the same way (short factors up to
        ``original_max_position_embeddings``, long factors for longer prefills).

        Resolution:
            - ``head_dim``: ``config.head_dim`` when present and not None, else
              ``hidden_size // num_attention_heads``.
            - ``rotary_dim``: ``int(head_dim * partial_rotary_factor)`` (in ``rope_parameters`` or on the
              config), else ``int(head_dim * rotary_pct)``, else ``rotary_dim``, else ``head_dim``.
            - ``theta`` and scaling: transformers-5 ``rope_parameters`` (dict or object), else
              ``rope_theta`` + ``rope_scaling``; ``rotary_emb_base`` (old GPT-NeoX); GPT-J/CodeGen
              hard-code 10000 in their model code.
            - scaled types call ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]``.

        Raises:
            ValueError: no theta anywhere (the message names the fields looked at); odd or out-of-range
                rotary_dim; head_dim not derivable; unknown rope type, layout or layer type;
                multimodal (``mrope_section``) rope; missing ``max_position_embeddings`` where a scaled
                type needs it.
        """
        config = _text_config(config)
        model_type = _get(config, "model_type")
        head_dim = _head_dim(config)
        rope_parameters, rope_scaling, params = _rope_params(config, layer_type)
        theta = _theta(config, rope_parameters, rope_scaling, model_type)
        rotary_dim = _rotary_dim(config, params, head_dim)
        rope_type = params.get("rope_type", params.get("type")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if rope_type == "default":
            inv_freq, attention_scaling, max_positions = _default_inv_freq(theta, rotary_dim), 1.0, None
        else:
            inv_freq, attention_scaling, max_positions = _scaled_frequencies(
                config, params, rope_type, theta, rotary_dim, seq_len)
        return cls(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            theta=theta,
            layout=layout if layout is not None else (
                "gptj" if model_type in _GPTJ_LAYOUT_FAMILIES else "neox"
            ),
            rope_type=rope_type,
            attention_scaling=float(attention_scaling),
            inv_freq=inv_freq,
            max_positions=max_positions,
        )


# --------------------------------------------------------------------------------------------------
# tensor helpers
# --------------------------------------------------------------------------------------------------


def _as_positions(positions: Any, n: int, name: str, device: torch.device) -> torch.Tensor:
    """Validate positions: 1-D integers of length n. Returns int64 [n] on device."""
    p = positions if isinstance(positions, torch.Tensor) else torch.as_tensor(positions)
    if p.dtype == torch.bool or p.is_floating_point() or p.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {p.dtype}")
    if p.dim() != 1 or p.shape[0] != n:
        raise ValueError(f"{name} must have shape [T] = [{n}], got {list(p.shape)}")
    return p.to(device=device, dtype=torch.int64)


def _positions_1d(positions: Any, name: str) -> torch.Tensor:
    p = positions if isinstance(positions, torch.Tensor) else torch.as_tensor(positions)
    if p.numel() == 0:
        p = p.to(torch.int64)  # torch.as_tensor([]) is float; an empty position list is still valid
    if p.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor [T], got shape {list(p.shape)}")
    return p


def _check_range(spec: RopeSpec, *positions: torch.Tensor) -> None:
    if spec.max_positions is None:
        return
    for p in positions:
        if p.numel() and (int(p.max()) >= spec.max_positions or int(p.min()) < 0):
            raise ValueError(
                f"rope_type {spec.rope_type!r}: positions must lie in [0, {spec.max_positions}) for this "
                f"RopeSpec (got [{int(p.min())}, {int(p.max())}]); its frequencies depend on the sequence "
                "length, so build the spec with RopeSpec.from_config(config, seq_len=<prefill length>)"
            )


def _model_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # phi(p) = fp32(p) * inv_freq in fp32, exactly as transformers' rotary embedding forms it.
    # positions [T] int64, inv_freq [rd/2] fp32 -> [T, rd/2] fp32
    return positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]


def _token_axes(x: torch.Tensor, n: int, token_dim: int | None) -> list[int]:
    """The axes of x the positions may index: [-2] for [..., T, head_dim], [-3] for [..., T, H, head_dim],
    [-2, -3] when both x.shape[-2] and x.shape[-3] equal T (resolved by `_pick_axis`)."""
    if token_dim is not None:
        if token_dim not in (-2, -3) or x.dim() < -token_dim:
            raise ValueError(f"token_dim must be -2 or -3 (and exist in x), got {token_dim}")
        if x.shape[token_dim] != n:
            raise ValueError(f"x.shape[{token_dim}] = {x.shape[token_dim]} but positions have length {n}")
        return [token_dim]
    candidates = [ax for ax in (-2, -3) if x.dim() >= -ax and x.shape[ax] == n]
    if not candidates:
        raise ValueError(
            f"x must be [..., T, head_dim] or [..., T, H, head_dim] with T = len(positions) = {n}; "
            f"got shape {list(x.shape)}"
        )
    return candidates


def _pick_axis(x: torch.Tensor, axes: list[int], *tables: torch.Tensor) -> int:
    """The token axis; for an ambiguous shape, either when every row of the [T, rd/2] angle tables is the same
    (one position, or positions whose rotations coincide), since both readings then give the same result
    bit for bit; otherwise the shape is refused."""
    if len(axes) == 1:
        return axes[0]
    if all(bool((t == t[:1]).all()) for t in tables):
        return -2
    raise ValueError(
        f"x of shape {list(x.shape)} is ambiguous for T = {x.shape[-2]} (both x.shape[-2] and x.shape[-3] equal T, "
        "and the two readings rotate differently); pass token_dim=-2 for [..., T, head_dim] or token_dim=-3 for "
        "[..., T, H, head_dim]"
    )


def _check_x(x: torch.Tensor, spec: RopeSpec) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point tensor")
    if x.dim() < 2 or x.shape[-1] != spec.head_dim:
        raise ValueError(f"x must end in head_dim = {spec.head_dim}; got shape {list(x.shape)}")
    spec._validate()


def _rows_contiguous(kv: torch.Tensor) -> bool:
    """Whether every layer's keys `kv[0, l]` ([T, D]) are contiguous and no two layers, nor keys and values, share
    memory (what in-place re-rotation needs: an expanded or aliased tensor is rotated through a copy)."""
    if kv.dim() != 4 or kv.stride(-1) != 1 or kv.stride(-2) != kv.shape[-1]:
        return False
    _, n_layers, t, d = kv.shape
    return kv.stride(1) >= t * d and kv.stride(0) >= n_layers * kv.stride(1)


def _rotate_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec,
    compute_dtype: torch.dtype,
) -> None:
    """out[..., :rd] = rotation of x[..., :rd] by (cos, sin); out[..., rd:] = x[..., rd:] bit for bit.

    x, out: same shape [..., d], any dtype, distinct storage or the same tensor (the rotated halves are computed
    into temporaries before `out` is written); cos, sin: broadcastable to [..., rd/2] in compute_dtype.
    Each rotated value is cast to out.dtype once (by copy_).
    """
    rd, half = spec.rotary_dim, spec.rotary_dim // 2
    xr = x[..., :rd].to(compute_dtype)  # [..., rd]; a view when x is already compute_dtype (never written)
    if spec.layout == "neox":
        a, b = xr[..., :half], xr[..., half:]          # pairs (i, i + rd/2)
        out_a, out_b = out[..., :half], out[..., half:rd]
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]              # pairs (2i, 2i + 1)
        out_a, out_b = out[..., 0:rd:2], out[..., 1:rd:2]
    ra = a * cos                                         # [..., rd/2]
    ra.addcmul_(b, sin, value=-1.0)                      # a cos - b sin
    rb = b * cos
    rb.addcmul_(a, sin)                                  # b cos + a sin
    out_a.copy_(ra)                                      # the one cast to the output dtype
    out_b.copy_(rb)
    if rd < x.shape[-1]:
        out[..., rd:].copy_(x[..., rd:])                 # pass-through channels, same dtype: bit-identical


def _expand_table(t: torch.Tensor, axis: int) -> torch.Tensor:
    # [T, rd/2] -> [T, rd/2] for axis -2, [T, 1, rd/2] for axis -3 (broadcast over heads)
    return t if axis == -2 else t[:, None, :]


# --------------------------------------------------------------------------------------------------
# public operations
# --------------------------------------------------------------------------------------------------


def apply_rope(
    x: torch.Tensor, positions: Any, spec: RopeSpec, *, token_dim: int | None = None
) -> torch.Tensor:
    """Apply RoPE at ``positions`` to ``x`` (RoFormer, arXiv:2104.09864), as the model does.

    Args:
        x: ``[..., T, H, head_dim]`` or ``[..., T, head_dim]``, floating (fp32, bf16, fp16).
        positions: integer tensor ``[T]`` (any integers, in any order).
        spec: a :class:`RopeSpec`.
        token_dim: ``-2`` or ``-3`` to say which axis ``positions`` index; needed only when both
            ``x.shape[-2]`` and ``x.shape[-3]`` equal ``T`` and the two readings would give different
            results (without it such a shape is refused; with one position, or positions whose rotations
            coincide, both readings agree bit for bit and none is needed).

    Returns:
        A new tensor, same shape and dtype as ``x``: the first ``rotary_dim`` channels rotated by
        ``positions * inv_freq`` with cos and sin multiplied by ``spec.attention_scaling`` (as
        transformers does for YaRN/LongRoPE), computed in fp32 and cast once; the other channels
        bit-identical.

    Raises:
        TypeError: ``x`` not floating, ``positions`` not integers.
        ValueError: shapes (last dim must be ``head_dim``; a token axis of length ``T``); positions out of
            the range a ``dynamic``/``longrope`` spec is valid for.
    """
    _check_x(x, spec)
    pos = _positions_1d(positions, "positions")
    axes = _token_axes(x, pos.shape[0], token_dim)
    pos = _as_positions(pos, pos.shape[0], "positions", x.device)
    _check_range(spec, pos)
    phi = _model_angles(pos, spec.inv_freq)               # [T, rd/2] fp32
    cos = phi.cos() * spec.attention_scaling              # transformers: emb.cos() * attention_scaling
    sin = phi.sin() * spec.attention_scaling
    axis = _pick_axis(x, axes, cos, sin)
    out = torch.empty_like(x)
    _rotate_into(out, x, _expand_table(cos, axis), _expand_table(sin, axis), spec, torch.float32)
    return out


def _delta_tables(
    old: torch.Tensor, new: torch.Tensor, spec: RopeSpec, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of phi(new) - phi(old), [T, rd/2] in compute_dtype.

    phi is the model's own fp32 angle; the difference and its cos/sin are taken in fp64 and rounded
    once, so a re-rotated key equals the key the model would have computed at `new`. No attention
    scaling: a re-rotation must not change key norms (YaRN, arXiv:2309.00071, scales cos/sin once).
    """
    inv = spec.inv_freq
    delta = _model_angles(new, inv).double()                # [T, rd/2] fp64 (exact copy of fp32 angles)
    delta.sub_(_model_angles(old, inv).double())            # phi(new) - phi(old), exact in fp64
    return delta.cos().to(compute_dtype), delta.sin().to(compute_dtype)


def rerotate_keys(
    k: torch.Tensor,
    old_positions: Any,
    new_positions: Any,
    spec: RopeSpec,
    *,
    token_dim: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Move post-RoPE keys from ``old_positions`` to ``new_positions``.

    Rotates the first ``rotary_dim`` channels by ``(new - old) * inv_freq``, so that
    ``rerotate_keys(apply_rope(k, old), old, new) == apply_rope(k, new)`` to fp32 rounding. A pure
    rotation: norms are unchanged, ``attention_scaling`` is not applied again.

    Angles are formed the way transformers (and vLLM) form them: ``phi(p) = fp32(p) * fp32(inv_freq)`` in
    fp32. The keys are rotated by ``phi(new) - phi(old)``, the difference taken in fp64: that is the
    rotation by ``(new - old) * inv_freq``, and it makes re-rotated keys equal, to fp32 rounding, the keys
    the model itself would have produced at ``new`` — at any position. (A plain fp32 product
    ``(new - old) * inv_freq`` would differ from the model's own angles by up to ``~p * 2**-24`` rad, about
    1e-3 rad at ``p = 16k``.)

    Args:
        k: ``[..., T, H, head_dim]`` or ``[..., T, head_dim]`` (post-RoPE keys, any float dtype).
        old_positions, new_positions: integer tensors ``[T]``, any integers, monotone or not.
        spec: a :class:`RopeSpec`.
        token_dim: as in :func:`apply_rope`.
        compute_dtype: arithmetic dtype; keep the default fp32. Another dtype (e.g. bf16) exists only to
            measure what cache-dtype arithmetic costs in accuracy and speed.

    Returns:
        A new tensor, same shape and dtype as ``k``; channels past ``rotary_dim`` bit-identical.

    Raises:
        TypeError, ValueError: as :func:`apply_rope`; also when the two position tensors differ in length.
    """
    _check_x(k, spec)
    old = _positions_1d(old_positions, "old_positions")
    axes = _token_axes(k, old.shape[0], token_dim)
    t = old.shape[0]
    old = _as_positions(old, t, "old_positions", k.device)
    new = _as_positions(new_positions, t, "new_positions", k.device)
    _check_range(spec, old, new)
    cos, sin = _delta_tables(old, new, spec, compute_dtype)  # [T, rd/2]
    axis = _pick_axis(k, axes, cos, sin)
    out = torch.empty_like(k)
    _rotate_into(out, k, _expand_table(cos, axis), _expand_table(sin, axis), spec, compute_dtype)
    return out


def _token_chunk(t: int, heads: int, rotary_dim: int) -> int:
    """Tokens per chunk so that one fp32 temporary holds at most min(16 MiB, max(256 KiB, a quarter of one
    layer's rotated keys)). _rotate_into keeps at most two such temporaries alive (the fp32 copy of the rotary
    channels, then the two rotated halves), so the chunk working set is at most half of one layer's keys in
    fp32 (or 512 KiB for a small cache); the cos/sin tables come on top (see rerotate_k_cache)."""
    per_token = heads * rotary_dim
    budget = min(_CHUNK_ELEMS, max(_CHUNK_FLOOR, (t * per_token) // 4))
    return max(1, budget // per_token)


def model_rope(model_or_config: Any) -> RopeSpec | tuple[RopeSpec, ...]:
    """The RoPE a model rotates with: one `RopeSpec`, or one per layer when layer types rotate differently
    (Gemma 3: `rope_local_base_freq` on sliding layers).

    Args:
        model_or_config: a loaded transformers model, or a config.

    With a loaded model, `inv_freq` and `attention_scaling` are read from its rotary module (`inv_freq`, or
    `{layer_type}_inv_freq` for per-layer-type rotations): the frequencies the cached keys were actually
    rotated with — after `model.half()` or `.to(torch.bfloat16)` they are rounded, and exact frequencies
    would miss that rounding. `dynamic` and `longrope` frequencies change with the sequence length at run
    time; they are taken from the config (see `RopeSpec.from_config`). Raises as `RopeSpec.from_config`.
    """
    import dataclasses

    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = model.config if model is not None else model_or_config
    params = _first(config, "rope_parameters", "rope_scaling")
    types = _get(config, "layer_types")
    per_type = isinstance(params, Mapping) and _is_nested(params) and types
    specs = ([RopeSpec.from_config(config, layer_type=t) for t in types] if per_type
             else [RopeSpec.from_config(config)])
    if model is not None:
        rotary = [m for m in model.modules() if any(n.endswith("inv_freq") and not n.endswith("original_inv_freq")
                                                    for n, _ in m.named_buffers(recurse=False))]
        if len(rotary) == 1:
            mod = rotary[0]
            live = []
            for spec, t in zip(specs, types if per_type else [None] * len(specs)):
                name = f"{t}_inv_freq" if t else "inv_freq"
                inv = getattr(mod, name, None)
                if inv is None or spec.rope_type in ("dynamic", "longrope") or inv.numel() != spec.rotary_dim // 2:
                    live.append(spec)
                    continue
                scale = getattr(mod, f"{t}_attention_scaling" if t else "attention_scaling", spec.attention_scaling)
                live.append(dataclasses.replace(spec, inv_freq=inv.detach().float().cpu(),
                                                attention_scaling=float(scale)))
            specs = live
    return tuple(specs) if per_type else specs[0]


def _rerotate_per_layer(kv: torch.Tensor, old_positions: Any, new_positions: Any, specs, compute_dtype: torch.dtype,
                        inplace: bool) -> torch.Tensor:
    """`rerotate_k_cache` with one `RopeSpec` per layer of ``kv [2, L, T, D]`` (Gemma 3's local and global
    rotations): each layer re-rotated with its own spec."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or len(specs) != kv.shape[1]:
        raise ValueError(f"{len(specs)} per-layer RoPE specs for a kv of shape "
                         f"{list(getattr(kv, 'shape', []))}: give one RopeSpec per layer [2, L, T, D]")
    out = kv if inplace and _rows_contiguous(kv) else torch.empty_like(kv, memory_format=torch.contiguous_format)
    for layer, spec in enumerate(specs):
        got = rerotate_k_cache(kv[:, layer:layer + 1], old_positions, new_positions, spec,
                               compute_dtype=compute_dtype, inplace=out is kv)
        if out is not kv:
            out[:, layer:layer + 1] = got
    return out


def rerotate_k_cache(
    kv: torch.Tensor,
    old_positions: Any,
    new_positions: Any,
    spec_or_config: Any,
    *,
    compute_dtype: torch.dtype = torch.float32,
    inplace: bool = False,
) -> torch.Tensor:
    """Re-rotate the keys of a KV cache from ``old_positions`` to ``new_positions``.

    Args:
        kv: ``[2, L, T, D]``: index 0 keys (post-RoPE), 1 values; ``L`` layers, ``T`` tokens,
            ``D = H_kv * head_dim``; any float dtype, any device.
        old_positions, new_positions: integer tensors ``[T]`` (e.g. ``keep`` and ``arange(k)``).
        spec_or_config: a :class:`RopeSpec`, a sequence of ``L`` of them (one per layer, e.g. from
            :func:`model_rope` for Gemma 3), or a model config passed to :meth:`RopeSpec.from_config`.
        compute_dtype: arithmetic dtype; default fp32 (see :func:`rerotate_keys`).
        inplace: rotate the keys of ``kv`` itself and return it (no copy of the values: for a cache the caller
            has just made, e.g. the gathered kept rows of ``apply_keep``). Needs each layer's keys ``kv[0, l]``
            contiguous; otherwise a new tensor is returned as without it. Results are bit-identical either way.

    Returns:
        A new tensor like ``kv`` (the input is never modified; with ``inplace``, ``kv`` itself): keys
        re-rotated (fp32 arithmetic, one cast), values bit-identical.

    Memory: works layer by layer and in token chunks. Beyond the returned tensor it holds at most the larger of
    (a) building the cos/sin tables: at most 24 bytes per table element (``T * rotary_dim/2`` elements: fp64
    angle differences, their fp64 cos/sin, the fp32 results), and (b) the two fp32 tables (8 bytes per element)
    plus two fp32 chunk temporaries of at most ``min(4 Mi, max(64 Ki, T*H*rotary_dim/4))`` elements each. In
    units of one layer's keys in fp32 (``4*T*H*head_dim`` bytes) with ``rotary_dim = head_dim``, that is at most
    ``max(3/H, 1/2 + 1/H)``, ``H`` = KV heads: 62.5% for ``H = 8`` (Qwen3-8B), 1.5 layers for ``H = 2``;
    a small cache may reach 512 KiB of chunk temporaries instead. ``tests/test_rope.py`` checks it against
    the profiler's allocations; ``bench/rope_bench.py`` measures it on a large cache (docs/benchmarks.md).

    Raises:
        ValueError: ``kv`` not ``[2, L, T, D]``, ``D % head_dim != 0``, positions not of length ``T``,
            positions outside a ``dynamic``/``longrope`` spec's range.
        TypeError: ``kv`` not floating, positions not integers.
    """
    if isinstance(spec_or_config, (list, tuple)):
        return _rerotate_per_layer(kv, old_positions, new_positions, spec_or_config, compute_dtype, inplace)
    spec = spec_or_config if isinstance(spec_or_config, RopeSpec) else RopeSpec.from_config(spec_or_config)
    spec._validate()
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point():
        raise TypeError("kv must be a floating-point tensor [2, L, T, D]")
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"kv must have shape [2, L, T, D] (0 keys, 1 values); got {list(kv.shape)}")
    _, n_layers, t, d_total = kv.shape
    if d_total % spec.head_dim:
        raise ValueError(f"kv last dim D = {d_total} is not a multiple of head_dim = {spec.head_dim}")
    heads = d_total // spec.head_dim
    old = _as_positions(old_positions, t, "old_positions", kv.device)
    new = _as_positions(new_positions, t, "new_positions", kv.device)
    _check_range(spec, old, new)

    if inplace and _rows_contiguous(kv):
        out = kv  # keys rotated where they are (_rotate_into reads a chunk whole before it writes it)
    else:
        out = torch.empty_like(kv, memory_format=torch.contiguous_format)  # [2, L, T, D]
        out[1].copy_(kv[1])                               # values: bit-identical
    if t == 0 or n_layers == 0:
        return out
    cos, sin = _delta_tables(old, new, spec, compute_dtype)  # [T, rd/2], shared by all layers
    cos, sin = cos[:, None, :], sin[:, None, :]           # [T, 1, rd/2], broadcast over heads
    step = _token_chunk(t, heads, spec.rotary_dim)
    for layer in range(n_layers):
        k_out = out[0, layer].view(t, heads, spec.head_dim)      # [T, H, d] view into the result
        for s in range(0, t, step):
            e = min(t, s + step)
            # [t_chunk, H, d]; a view for a contiguous cache, else a copy of this chunk only
            k_in = kv[0, layer, s:e].reshape(e - s, heads, spec.head_dim)
            _rotate_into(k_out[s:e], k_in, cos[s:e], sin[s:e], spec, compute_dtype)
    return out
