"""The embedded `hf` engine: in-process Hugging Face transformers prefill, modify and batched decode.

Per request the engine keeps its KV cache as one `[2, L, T, D]` tensor (docs/design.md §3). Prefill runs in
left-padded batches (`DynamicCache`), with query capture (after q_norm and RoPE) for the policies that need it;
`extend` prefills more tokens on top of a (possibly edited) cache; decode runs many requests of different
lengths in one batch over preallocated slots (`engines.kvstore`), admitting requests while their reservations
fit `kv_budget_tokens` (§2; `engines.scheduler`), choosing tokens with `engines.sampling`, and regenerates from the edited cache as vLLM does (the last kept token is fed again
at its position); decode steps run the model's large linears on oneDNN-prepacked weights (`engines.packed`). Positions: `"compact"` (kept keys re-rotated to `0..k-1`) or `"original"` (keys unchanged,
decoding continues after the last kept position, equal to the model's forward with dropped positions masked).
Sliding-window layers keep every token and apply their window by position in the masks, so dropping means the
same in every layer. `decode(compression=...)` (`engines.decode_compression`) and `prefill(chunk=...,
compression=...)` hold caches at a budget while they grow (§9). Model families: docs/models.md; errors name the family and why.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from ..attention import (
    AttentionSpec,
    QueryRecorder,
    capture_implementation,
    ensure_capture,
    recording,
    slot_decode,
)
from ..chat import uses_chat_template
from ..checks import (
    GREEDY_BELOW,
    CountSetting,
    check_count,
    check_engine_settings,
    check_max_tokens,
    check_temperature,
)
from ..compression import Compression
from ..edit import DropFn
from ..kvcache import CacheKind, check_kv
from ..metrics import DecodeMetrics, RunMetrics
from ..models import _torch_dtype, check_compute_device, load_model, model_facts
from ..outputs import RequestOutput, answer_text
from ..policies.scoring import window_attention
from .base import Engine, register_engine, tokenize_extensions
from .decode_compression import SlotCompressor
from ..kernels import decode_attention_kernel
from .lean_step import LeanDecodeStep, lean_step_refusal
from .kvstore import PaddingMasks, SlotKVStore, install_head_masks, plan_slots, release_free_heap, wide_cache
from .packed import PackedLinears, default_min_elements, packing_available, packing_pays
from .sampling import check_forced_ids, choose_tokens, request_generators
from .scheduler import (
    KV_BLOCK_TOKENS,
    DecodeScheduler,
    check_extension_fits,
    context_limits,
    warn_past_context,
)

POSITIONS = ("compact", "original")
# A prompt at least this long is prefilled only beside prompts of its own length: without padding the model's
# causal attention needs no mask, and torch's CPU sdpa then skips the blocks above the diagonal (SmolLM2-135M,
# 2048 tokens, bf16, one thread: 19.3 s for 4 prompts one by one against 27.5 s left-padded together). The linears
# lose nothing at that length (thousands of rows per matmul either way); shorter prompts still share a batch.
PAD_FREE_TOKENS = 256


def prefill_batches(lengths: Sequence[int], batch_size: int, pad_free: int = PAD_FREE_TOKENS) -> list[list[int]]:
    """Prompt indices per prefill batch, in prompt order within each: prompts of at least `pad_free` tokens go
    `batch_size` at a time with prompts of exactly their length (no padding), the shorter ones `batch_size` at a
    time together (left-padded). E.g. lengths `[300, 10, 300, 12, 301]`, batch size 4, `pad_free=256`:
    `[[0, 2], [4], [1, 3]]`."""
    groups: dict[int, list[int]] = {}
    short = []
    for i, n in enumerate(lengths):
        (groups.setdefault(n, []) if n >= pad_free else short).append(i)
    return [g[a:a + batch_size] for g in (*groups.values(), short) for a in range(0, len(g), batch_size)]
BF16_EMULATED = ("dtype=bfloat16 on a CPU without AVX512-BF16 or AMX: torch emulates bfloat16 (converts to float32 op by "
                 "op), so it runs slower than float32 with bfloat16's rounding; open the engine with dtype='float32'")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo: x86 AVX512-BF16, x86 AMX, Arm's BF16 extension


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]
    kv: torch.Tensor  # [2, L, T, D]
    tokens: list[int]  # the T token ids the cache holds
    refeed_pos: int  # position of the last cached token, fed again at decode start
    positions: torch.Tensor | None = None  # [T] position of each cache row; None = 0..T-1
    pad: torch.Tensor | None = None  # [L, H_kv, T] True on padding rows (unequal per-head counts); None = none
    query: torch.Tensor | None = None  # [L, Tq, Hq*d], last Tq cached tokens; None after an edit (until extend)
    edited: bool = False  # modify changed this cache (the prompt's own forward no longer describes it)
    ttft_s: float = float("nan")
    # decode state
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logits: list | None = None
    finish_reason: str = "length"
    resume: tuple | None = None  # preempted mid-decode: (keys, values, positions, next token, its position)


@dataclass
class _DecodeRun:
    """The state of one `decode` call's loop."""

    sched: DecodeScheduler
    store: SlotKVStore
    comp: SlotCompressor | None
    dm: DecodeMetrics
    temperature: float  # 0 = greedy
    generators: dict  # request_id -> torch.Generator (`request_generators`)
    forced: dict | None  # request_id -> forced token ids (teacher forcing)
    keep_logits: bool
    ignore_eos: bool
    next_ids: torch.Tensor  # [S] per slot: the token fed next step
    next_pos: torch.Tensor  # [S] and its position
    lean: bool = False  # steps run `LeanDecodeStep` (while the store holds no padding)


@register_engine("hf")
class HFEngine(Engine):
    """Embedded engine over a transformers causal LM: any decoder with full and/or sliding-window attention
    and one key and one value per layer and token (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, gpt-oss, OLMo 2,
    Granite, GPT-NeoX, Phi ...: docs/models.md, "Supported model families"). Any other model fails here with one line naming
    its family and the reason (`ValueError`).

    Args:
        model: a bundled name (`"tiny-qwen3"`), hub id, local folder, or an already loaded model
            (then pass `tokenizer=` too).
        tokenizer: tokenizer when `model` is a model object.
        dtype, device, attn_implementation: passed to `tdutils.models.load_model` (attention default `"sdpa"`).
            With a model object they describe it as it is: one that disagrees (e.g. `attn_implementation="eager"`
            for an sdpa model) raises ValueError instead of being ignored; set it on the model first. `device`
            must be one a model computes on (`tdutils.models.check_compute_device`: not `"meta"`, not `"cpu:7"`).
            `dtype="bfloat16"` / `"float16"` are for speed and memory, not for fidelity: rounding moves greedy
            decoding off fp32's tokens within a few tokens on small models, and the engine's batched bf16
            arithmetic off bf16 `model.generate`'s too (docs/models.md, "Half precision"); compare policies in fp32.
            bfloat16 on a CPU without AVX512-BF16 or AMX (`cpu_has_native_bf16`) is emulated by torch, slower than
            fp32: opening warns in one line (`BF16_EMULATED`).
        kv_budget_tokens: KV tokens the running decode batch may hold (cache lengths plus tokens still
            to generate); None = unlimited (every request decodes in one batch).
        kv_budget_bytes: the same budget in bytes of KV cache instead (give one of the two): converted once to
            `kv_budget_tokens = kv_budget_bytes // facts.kv_bytes_per_token` (2 x layers x KV heads x head_dim x
            the cache dtype's element size: what the slot store holds per token, so a bfloat16 cache fits twice
            the tokens of a float32 one). Both attributes stay readable: `kv_budget_tokens` is the budget
            admission enforces, `kv_budget_bytes` the bytes given (or, for a budget given in tokens, tokens x
            bytes per token); setting either later replaces the other.
        max_batch_size: optional cap on the running batch.
        prefill_batch_size: prompts prefilled together (left-padded).
        positions: `"compact"` or `"original"` (docs/design.md §3).
        query_window: how many final prompt tokens' query states prefill captures per request (`[L, Tq,
            Hq*d]`, after q_norm and RoPE) for policies that need them (SnapKV, R-KV, TOVA; H2O needs all);
            default 64, the largest default policy window; None captures all tokens; 0 captures nothing.
            `run_once` / `compare` widen it to what their drop function needs (`capture_for`).
        chat_template: `"none"` (default: text prompts are tokenized as given), `"auto"` (wrapped as a user turn
            in the tokenizer's chat template when it has one) or `"on"` (always; ValueError without one);
            `chat_template_applied` says which. Token-id prompts and `extend` texts are never wrapped.
        progress: show tqdm progress bars for the prefill and decode phases.
        packed_linears: decode steps run the model's `nn.Linear` layers on weights prepacked for oneDNN
            (`tdutils.engines.packed`: about twice the weight bandwidth of `F.linear` at decode batch sizes,
            outputs equal up to float summation order) at the cost of one more copy of those weights; None
            (default) = on where available (CPU, fp32 or bf16, torch with oneDNN) and worth it (`packing_pays`:
            at least 32 MiB of large weights; not the bundled toy models), False = off, True = every linear
            packed, or ValueError where unavailable. Each decode starts by packing again the weights edited since
            the last (a fingerprint per weight: one read of them, less than a decode step; `refresh()` forces it);
            a linear whose `forward` the user replaced keeps it.
        lean_decode: decode steps run `tdutils.engines.lean_step.LeanDecodeStep` (the model's own modules in a
            plain loop over the layers, without transformers' forward around them: the same logits bit for bit)
            instead of `model(...)`; None (default) = where it can (`LEAN_FAMILIES`:
            Llama, Mistral, Qwen2, Qwen3, Gemma 3, on the CPU, and per decode: eval mode, `sdpa`, no
            decode-time compression, no padded per-head caches, no module hooks or replaced forwards besides
            linears'), False = never, True = ValueError where the model is not one it can run.

    Query capture switches the model to a registered attention function that wraps its `sdpa` or
    `eager` attention (`tdutils.attention.capture_implementation`); outputs are unchanged. A backend switched
    after opening (`engine.model.set_attn_implementation("eager")` drops the capture) is wrapped again where
    queries are captured (prefill, extend, a query-aware compression or modify); one that capture cannot wrap
    (flash / flex kernels) raises a one-line ValueError there.
    """

    prefill_batch_size = CountSetting(1)
    restores_prefill = True  # requests hold their caches; modify and decode never edit them in place

    def __init__(self, model="tiny-qwen3", *, tokenizer=None, dtype="auto", device=None,
                 attn_implementation: str | None = None, kv_budget_tokens: int | None = None,
                 kv_budget_bytes: int | None = None, max_batch_size: int | None = None, prefill_batch_size: int = 4, positions: str = "compact",
                 query_window: int | None = 64, chat_template: str = "none", progress: bool = True,
                 packed_linears: bool | None = None, lean_decode: bool | None = None):
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        for name, value in (("packed_linears", packed_linears), ("lean_decode", lean_decode)):
            if value is not None and not isinstance(value, bool):  # before the model loads
                raise TypeError(f"{name} must be None, True or False, got {value!r}")
        check_engine_settings(kv_budget_tokens, max_batch_size, query_window)
        check_count(kv_budget_bytes, "kv_budget_bytes", 1, none="unlimited")
        if kv_budget_tokens is not None and kv_budget_bytes is not None:
            raise ValueError(f"give kv_budget_tokens or kv_budget_bytes, not both (got {kv_budget_tokens} tokens and "
                             f"{kv_budget_bytes} bytes)")
        check_count(prefill_batch_size, "prefill_batch_size", 1)
        check_compute_device(device)  # before the model loads
        if isinstance(model, str):
            self.model_name = model
            self.model, self.tokenizer = load_model(model, dtype=dtype, device=device, progress=progress,
                                                    attn_implementation=attn_implementation or "sdpa")
        else:
            if model is None or not hasattr(model, "parameters"):
                raise TypeError(f"model must be a model name, hub id, folder or a loaded transformers model, got "
                                f"{model!r}")
            if tokenizer is None:
                raise ValueError("pass tokenizer= together with a model object")
            _check_loaded_model_settings(model, dtype, device, attn_implementation)
            self.model_name = getattr(model, "name_or_path", type(model).__name__)
            self.model, self.tokenizer = model.eval(), tokenizer
        self.device = next(self.model.parameters()).device
        if self.model.dtype == torch.bfloat16 and self.device.type == "cpu" and not cpu_has_native_bf16():
            warnings.warn(BF16_EMULATED, stacklevel=2)
        self.query_window = query_window
        # transformers renamed `past_key_values` to `cache` during 5.x; support both spellings.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.facts = model_facts(self.model, self.model.dtype)
        # unequal per-head counts: padding masked per layer and head in decode
        self._head_masks = install_head_masks(getattr(self.model.base_model, "layers", []), self.facts.gqa_group_size)
        self.attention = self._check_supported()  # one-line ValueError naming the family (backend included)
        if query_window != 0 or self.model.config._attn_implementation == "sdpa":  # sdpa: decode_attention too
            ensure_capture(self.model)
        windows = self.attention.sliding_windows
        # per mask key (a layer type, or None when one mask serves every layer): its sliding window
        self._mask_windows = _mask_windows(self.model.config, windows) if any(windows) else None
        self.kv_budget_tokens = kv_budget_tokens
        if kv_budget_bytes is not None:
            self.kv_budget_bytes = kv_budget_bytes
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.positions = positions
        self.progress = progress
        self.eos_token_ids = _eos_ids(self.tokenizer, self.model)  # decode stops on any unless ignore_eos
        uses_chat_template(self.tokenizer, chat_template)  # a bad value, or "on" without a template, fails here
        self.chat_template = chat_template
        self.requests: list[_Request] = []
        self.metrics = RunMetrics("run")
        if packed_linears and not packing_available(self.model):
            raise ValueError(f"packed_linears=True needs torch with oneDNN and a CPU model in float32 or bfloat16 "
                             f"(this one: {self.model.dtype} on {self.device}); pass packed_linears=None or False")
        use = packing_pays(self.model) if packed_linears is None else packed_linears
        # True packs every nn.Linear; the default only those large enough that packing pays (default_min_elements)
        least = default_min_elements(self.model.dtype) if packed_linears is None else 1
        self._packed = PackedLinears(self.model, min_elements=least) if use else None
        self._lean = self._lean_step(lean_decode)
        if self.device.type == "cpu":  # build (once per machine) or load the decode kernels now, not in a decode
            decode_attention_kernel()

    def _lean_step(self, lean_decode: bool | None) -> LeanDecodeStep | None:
        """The lean decode step (`engines.lean_step`) where asked for (None: where it can run the model, on a CPU)."""
        why = lean_step_refusal(self.model, self.attention)
        if why is None and self.device.type != "cpu":
            why = f"the model is on {self.device}, and the lean step is for CPU decoding"
        if lean_decode and why is not None:
            raise ValueError(f"lean_decode=True: {why}; pass lean_decode=None or False")
        return LeanDecodeStep(self.model, self.attention) if why is None and lean_decode is not False else None

    @property
    def decode_path(self) -> str:
        """What a decode started now runs per step: `"lean"` (`engines.lean_step`) or `"transformers"` (the model's
        forward; also every step of a decode with compression or padded per-head caches)."""
        return "lean" if self._lean is not None and self._lean.usable() else "transformers"

    # ------------------------------------------------------------------ helpers
    @property
    def config(self):
        return self.model.config

    @property
    def kv_budget_tokens(self) -> int | None:
        """The KV budget admission enforces, in tokens (None: unlimited): as set, or `kv_budget_bytes // bytes
        per token` when the budget was given in bytes. Setting it gives the budget in tokens."""
        return self._kv_budget_tokens

    @kv_budget_tokens.setter
    def kv_budget_tokens(self, value) -> None:
        self._kv_budget_tokens = check_count(value, "kv_budget_tokens", 1, none="unlimited")
        self._kv_budget_bytes = None

    @property
    def kv_budget_bytes(self) -> int | None:
        """The KV budget in bytes (None: unlimited): as set, or `kv_budget_tokens x facts.kv_bytes_per_token` when
        the budget was given in tokens. Setting it converts it once to `kv_budget_tokens` (rounded down).

        Raises (on setting):
            TypeError: not an integer; ValueError: below one token's bytes (`facts.kv_bytes_per_token`).
        """
        if self._kv_budget_bytes is not None or self._kv_budget_tokens is None:
            return self._kv_budget_bytes
        return self._kv_budget_tokens * self.facts.kv_bytes_per_token

    @kv_budget_bytes.setter
    def kv_budget_bytes(self, value) -> None:
        value = check_count(value, "kv_budget_bytes", 1, none="unlimited")
        per = self.facts.kv_bytes_per_token
        if value is not None and value < per:
            raise ValueError(f"kv_budget_bytes {value} holds no KV token of this model ({per} bytes per token at "
                             f"{str(self.facts.kv_dtype).removeprefix('torch.')}); give at least {per}")
        self._kv_budget_tokens = None if value is None else value // per
        self._kv_budget_bytes = value

    @property
    def kv_budget_in_bytes(self) -> bool:
        """Whether the budget was given in bytes (`kv_budget_bytes`) rather than in tokens."""
        return self._kv_budget_bytes is not None

    def refresh(self) -> None:
        """Pack the model's linear weights again from their current values (`packed_linears`; nothing to do
        without). Each decode already packs again every weight whose fingerprint changed
        (`tdutils.engines.packed`); call this after an edit too small to move it."""
        if self._packed is not None:
            self._packed.refresh()

    @property
    def eos_token_id(self) -> int | None:
        """One EOS id (the tokenizer's when it is among `eos_token_ids`); setting it makes it the only one."""
        tok = self.tokenizer.eos_token_id
        return tok if tok in self.eos_token_ids else min(self.eos_token_ids, default=None)

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.eos_token_ids = frozenset() if value is None else frozenset({int(value)})

    def _vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _new_cache(self):
        from transformers import DynamicCache

        # no config: every layer keeps every token (sliding windows are applied by the masks, see module doc)
        return DynamicCache()

    def _check_supported(self) -> AttentionSpec:
        """The model's `AttentionSpec`, or ValueError naming the family and why the engine cannot serve it."""
        config = self.model.config
        family = getattr(config, "model_type", type(self.model).__name__)
        other = sorted({t for t in getattr(config, "layer_types", None) or () if t not in _LAYER_TYPES})
        if other:
            raise ValueError(f"{family}: layers of type {other} are not supported by the hf engine (only full and "
                             f"sliding-window attention keep one [2, L, T, D] KV per request)")
        try:
            spec = AttentionSpec.from_model(self.model)
            cache = self._new_cache()
            with torch.inference_mode():
                self._forward(torch.tensor([[1, 2]], device=self.device), None, None, cache)
        except Exception as exc:  # any failure here means: this family does not fit the engine
            raise ValueError(f"{family}: the hf engine cannot run this model ({exc.__class__.__name__}: "
                             f"{str(exc).splitlines()[0][:160]})") from exc
        layers = getattr(cache, "layers", [])
        shapes = {(tuple(lay.keys.shape), tuple(lay.values.shape)) for lay in layers}
        want = (1, self.facts.num_kv_heads, 2, self.facts.head_dim)
        if len(layers) != self.facts.num_layers or shapes != {(want, want)}:
            raise ValueError(f"{family}: its cache is not one key and one value of [heads={self.facts.num_kv_heads}, "
                             f"head_dim={self.facts.head_dim}] per layer and token (got {len(layers)} layers of "
                             f"{sorted(shapes)[:2]}), so it has no [2, L, T, D] KV per request")
        return spec

    def _forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep=1):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, logits_to_keep=logits_to_keep, **{self._cache_kw: cache})

    def _bar(self, total, desc):
        from tqdm.auto import tqdm

        # delay: a bar appears only for phases that take more than a couple of seconds
        return tqdm(total=total, desc=desc, disable=not self.progress, leave=False, mininterval=1.0, delay=2.0)

    # ------------------------------------------------------------------ phases
    @torch.inference_mode()
    def prefill(self, prompts, *, chunk: int | None = None, compression: Compression | None = None) -> list[int]:
        """Prefill every prompt, in batches of up to `prefill_batch_size` (`prefill_batches`: a prompt of at least
        `PAD_FREE_TOKENS` tokens only beside prompts of its length, so its causal attention runs without a padding
        mask; shorter prompts left-padded together); one cache per request.

        Args:
            prompts: strings, `PromptRow`s, dicts with `prompt`, or lists of token ids.
            chunk: prefill `C` prompt tokens at a time: the first `C` as a prefill, each next `C` on top of the
                cache (as `extend` does), so activations stay bounded; without `compression` the cache equals a
                one-shot prefill's. With a query-aware policy `C` must be at least twice its query rows (a last
                chunk shorter than them takes tokens from the one before). A prompt past the model's context warns
                only under `positions="original"` (compact cuts renumber positions).
            compression: a `tdutils.compression.Compression`: after every chunk (after the whole prompt without
                `chunk`) each cache longer than `budget` is cut back to `budget` by its policy, scored by the
                chunk's last queries (a stream's query-agnostic setting), at the engine's `positions`. A
                request's cache never exceeds `budget + C` tokens; `metrics.prefill.peak_cache_tokens` has the
                largest each request held.

        Returns:
            Each request's cache length `T` (its KV `[2, L, T, D]`, model dtype and device, is `kv(i)`). Resets
            the engine's requests and metrics.

        Raises:
            TypeError / ValueError: bad prompts, a `chunk` that is not an integer >= 1 (or too short for the
            policy's query rows), `compression` not a `Compression`, or a policy that cannot keep exactly the
            budget (`Compression.drop_fn`). A failure during the chunks leaves no batch (`decode` asks for a
            `prefill`), not a half-prefilled one.
        """
        ids = self.tokenize(prompts)
        if chunk is None and compression is None:
            return self._prefill_ids(ids)
        return self._prefill_chunked(ids, chunk, compression)

    def _prefill_ids(self, ids: list[list[int]]) -> list[int]:
        warn_past_context("prefill", max(map(len, ids)) - 1, getattr(self.model.config, "max_position_embeddings", None),
                          stacklevel=2)
        self.requests, self.metrics = [], RunMetrics("run")
        pm = self.metrics.prefill
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        t0 = time.perf_counter()
        bar = self._bar(sum(map(len, ids)), "prefill")
        ttft = [0.0] * len(ids)
        requests: list[_Request | None] = [None] * len(ids)
        for rows in prefill_batches(list(map(len, ids)), self.prefill_batch_size):
            batch = [ids[i] for i in rows]
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
            if self.query_window != 0:
                self._prepare_capture(self.query_window, ())
            with recording(recorder):
                self._forward(input_ids.to(self.device), mask.to(self.device), position_ids.to(self.device), cache)
            now = time.perf_counter() - t0
            if recorder.attention or self.query_window != 0:
                # what the attention functions were called with (scale, window, sinks ...); ValueError naming the
                # layers whose attention did not run through the capture
                self.attention = recorder.spec(len(cache.layers))
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
                rid = rows[b]
                ttft[rid] = now
                requests[rid] = _Request(rid, x, kv, list(x), refeed_pos=len(x) - 1, ttft_s=now, query=query)
            bar.update(sum(lens))
            del cache
        bar.close()
        self.requests = requests
        pm.requests, pm.tokens, pm.seconds, pm.ttft_s = len(ids), sum(map(len, ids)), time.perf_counter() - t0, ttft
        pm.peak_cache_tokens = list(map(len, ids))
        return [r.kv.shape[2] for r in self.requests]

    def _prefill_chunked(self, ids: list[list[int]], chunk: int | None, compression: Compression | None) -> list[int]:
        """`prefill` by chunks of `chunk` tokens, cutting every cache to `compression.budget` after each; a failure
        leaves no batch (`decode` then asks for a prefill), never a half-prefilled one."""
        if compression is not None and not isinstance(compression, Compression):
            raise TypeError(f"compression must be a tdutils.compression.Compression, got {type(compression).__name__}")
        size = max(map(len, ids)) if chunk is None else check_count(chunk, "chunk", 1)
        cut, rows = None, 0
        if compression is not None:
            cut = compression.drop_fn(model_config=self.facts, rerotate=self.positions == "compact")
            rows = cut.query_rows
            if chunk is not None and rows and size < 2 * rows:
                raise ValueError(f"chunk {size} is too short for the {rows} query rows {cut.name!r} scores a cut with "
                                 f"(its window): each chunk's last {rows} queries score the cut after it, and a short "
                                 f"last chunk borrows tokens from the one before; use chunk >= {2 * rows}")
            self.capture_for(cut)  # the chunk's last queries score the cut
        bounds = [_chunk_bounds(len(x), size, rows) for x in ids]
        compact = compression.budget if cut is not None and self.positions == "compact" else None
        how = "" if compact is None else (f" (compact cuts renumber the cache to 0..{compact - 1} and the next chunk "
                                          f"of up to {size} tokens follows it: budget + chunk reaches past it)")
        warn_past_context("prefill", max(_chunk_last_position(b, compact) for b in bounds),
                          getattr(self.model.config, "max_position_embeddings", None), how, stacklevel=4)
        try:
            return self._run_chunks(ids, bounds, cut, compression)
        except BaseException:
            self.requests, self.metrics = [], RunMetrics("run")  # no half-built batch survives a failure
            raise

    def _run_chunks(self, ids, bounds, cut, compression) -> list[int]:
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # the first chunks are short: _prefill_ids' context warning is prefill's
            warnings.simplefilter("ignore", UserWarning)
            self._prefill_ids([x[:b[0][1]] for x, b in zip(ids, bounds)])
        pm = self.metrics.prefill
        peak = [b[0][1] for b in bounds]
        ttft = [float("nan")] * len(ids)
        k = 1
        while True:
            if cut is not None:
                self._cut(cut, [r for r in self.requests if len(r.tokens) > compression.budget])
            for r, b in zip(self.requests, bounds):
                if len(b) == k:  # its prompt is all in: its first token comes next
                    ttft[r.request_id] = time.perf_counter() - t0
            todo = [(r, x[b[k][0]:b[k][1]], b[k][0]) for r, x, b in zip(self.requests, ids, bounds) if len(b) > k]
            if not todo:
                break
            for start in range(0, len(todo), self.prefill_batch_size):
                batch = todo[start:start + self.prefill_batch_size]
                # the chunk continues the prompt: at its prompt positions under "original" (a cut may have dropped
                # the chunk's last token), right after the k kept tokens under "compact"
                starts = [at if self.positions == "original" else r.refeed_pos + 1 for r, _, at in batch]
                updates = self._extend_batch([r for r, _, _ in batch], [x for _, x, _ in batch], starts)
                for (r, x, _), first, (kv, query) in zip(batch, starts, updates):
                    if r.positions is not None:
                        r.positions = torch.cat([r.positions, torch.arange(first, first + len(x))])
                    r.kv, r.query = kv, query
                    r.tokens, r.prompt_ids = r.tokens + x, r.prompt_ids + x
                    r.refeed_pos = first + len(x) - 1
                    peak[r.request_id] = max(peak[r.request_id], kv.shape[2])
            k += 1
        pm.seconds, pm.tokens, pm.ttft_s, pm.peak_cache_tokens = time.perf_counter() - t0, sum(map(len, ids)), ttft, peak
        for r in self.requests:
            r.ttft_s = ttft[r.request_id]
        return [r.kv.shape[2] for r in self.requests]

    def kv(self, request_id: int) -> torch.Tensor:
        """The current KV `[2, L, T, D]` of one request (after `modify`, the edited one)."""
        return self.requests[request_id].kv

    def _prepare_capture(self, need, drop_fns) -> None:
        # installed at opening unless query_window=0; a backend switched since (set_attn_implementation) drops it
        ensure_capture(self.model)

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
        `rows` prompt tokens from the captured `q` and `kv` with the scoring helper the query-aware policies
        use (`policies.scoring.window_attention` with the scale, soft-cap, sinks and sliding window the model's
        attention was called with at prefill, `self.attention`) and compare with the model's own attention
        probabilities (eager attention, `output_attentions=True`).

        Returns:
            The largest absolute difference over layers, heads and rows (≈1e-7 in fp32 when the capture is
            right; a mixed-up row gives differences of order 0.1–1).

        Raises:
            RuntimeError: the request has no captured query (query_window=0), or its cache was edited (`modify`:
                the model's forward over the prompt no longer describes it).
        """
        req = self.requests[request_id]
        if req.query is None or req.edited:
            raise RuntimeError(f"request {request_id} has no captured query of its unedited prompt (query_window=0, "
                               f"or it was edited)")
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
            mine = window_attention(req.kv[0, layer], req.query[layer, -rows:], self.facts.num_kv_heads,
                                    self.attention.layers[layer])
            worst = max(worst, float((mine - a[0, :, -rows:, :].float()).abs().max()))
        return worst

    def tokens(self, request_id: int) -> list[int]:
        """The token ids the cache of one request holds."""
        return list(self.requests[request_id].tokens)

    # ------------------------------------------------------------------ modify's hooks (the flow is Engine.modify)
    def _check_modify(self, drop_fn, positions):
        positions = positions or self.positions
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        rerotate = drop_fn.rerotate  # None: a bare ModifyFn (it says nothing)
        if rerotate is not None and rerotate != (positions == "compact"):
            raise ValueError(f"positions={positions!r} needs a drop function with rerotate={positions == 'compact'}, "
                             f"got rerotate={rerotate}; build it with make_drop_fn(..., rerotate={positions == 'compact'})")
        if drop_fn.granularity != "request" and self._mask_windows is not None and positions == "original":
            # compact positions give row i position i in every head, so windows by row position stay exact
            raise ValueError(f"granularity={drop_fn.granularity!r} at positions='original' needs a model with full "
                             "attention only: this model's sliding-window layers mask keys by one position per cache "
                             "row, and each head keeps its own positions; use positions='compact' or "
                             "granularity='request'")
        if positions == "original" or any(r.pad is not None for r in self.requests):
            self._refuse_per_head_positions("another modify()")
        return positions

    def _refuse_per_head_positions(self, op: str, padded: bool = True) -> None:
        """ValueError when a request holds per-head kept positions (an `"original"` edit per layer or head):
        its cache rows have no single position, which `op` would need; with `padded`, also when one holds padding
        rows (unequal per-head counts)."""
        if any((r.positions is not None and r.positions.dim() > 1) or (padded and r.pad is not None)
               for r in self.requests):
            raise ValueError(f"{op} needs one position per cache row, and a request was edited per layer or head with "
                             f"positions='original' (its rows' positions differ by head) or with unequal per-head "
                             f"counts (padded rows); prefill again first")

    def _position_window(self) -> float:
        # sliding-window layers mask keys by position; full-attention layers see every earlier key
        return max((w for w in (self._mask_windows or {}).values() if w), default=0)

    def _edit_input(self, request_id, drop_fn):
        req = self.requests[request_id]
        tensors = self.tensors(request_id)
        if not drop_fn.reads_only:
            # a copy: a drop function that edits its input in place and then fails must not touch the cache
            # (tdutils' own policies only read it: `DropFn.reads_only`, and a ~94 MB copy per 2k-token request
            # of a 30-layer model is a third of a cheap policy's modify time)
            tensors = {kind: t.clone() for kind, t in tensors.items()}
        return tensors, list(req.tokens), req.kv

    def _edit_stage(self, request_id, new_kv, new_tokens, keep):
        req = self.requests[request_id]
        if keep is not None:
            old = req.positions if req.positions is not None else torch.arange(req.kv.shape[2])
            keep = keep.cpu()  # positions of the kept rows (a second edit indexes the first's rows); -1 = padding
            keep = torch.where(keep < 0, keep, old[keep.clamp(min=0)])
            if not self._head_masks and bool((keep < 0).any()):
                raise ValueError("unequal per-head counts need per-head masks in decode, and this model's attention "
                                 "modules take their cache under no known keyword; use a policy with equal counts")
            if keep.dim() > 1 and bool((keep[..., -1] != keep.flatten()[-1]).any()):
                # decode refeeds the last row's token at its position: one token, one position in every head
                raise ValueError("per-head kept sets must end in the same row in every layer and head (decode feeds "
                                 "its token again); keep the last token in every set")
        return new_kv, new_tokens, keep

    def _edit_commit(self, request_id, staged, positions):
        req = self.requests[request_id]
        req.kv, req.tokens, kept_pos = staged
        req.edited = True
        req.pad = kept_pos < 0 if kept_pos is not None and bool((kept_pos < 0).any()) else None
        req.query = None  # the captured rows belonged to the unedited prompt
        # compact: the last kept token sits at k-1; original: its prompt position (T-1 when kept).
        if positions == "compact":
            req.positions, req.refeed_pos = None, len(req.tokens) - 1
        else:
            req.positions, req.refeed_pos = kept_pos, int(kept_pos.flatten()[-1])  # [k], or [L, H, k] per head

    def _cut(self, cut: DropFn, reqs: list[_Request]) -> None:
        """Cut each request's cache to `cut.budget` (chunked prefill); a failure raises (the caller drops the batch)."""
        pm = self.metrics.prefill
        t0 = time.perf_counter()
        for r in reqs:
            new_kv, new_tokens, keep = cut.edit(self.tensors(r.request_id), r.tokens)
            staged = self._edit_stage(r.request_id, new_kv, new_tokens, keep)
            self._edit_commit(r.request_id, staged, self.positions)
            pm.cuts += 1
        pm.cut_seconds += time.perf_counter() - t0

    def modify(self, drop_fn, *, positions: str | None = None, on_error: str = "raise"):
        """`Engine.modify` (all or nothing, per-request failures) with both position conventions.

        `positions`: `"compact"` / `"original"`; default the engine's setting. A `DropFn` whose `rerotate`
        disagrees (compact needs re-rotated keys, original needs untouched ones) is refused before anything
        runs. Under `"original"` the kept positions come from `DropFn.edit`, or, for any other ModifyFn, from
        its output rows (`tdutils.edit.kept_rows`; an output that is not an in-order selection of unchanged
        rows, or keeps bit-identical rows whose position changes the result, fails that request).
        """
        with torch.inference_mode():
            return super().modify(drop_fn, positions=positions, on_error=on_error)

    @torch.inference_mode()
    def extend(self, prompts) -> list[int]:
        """Append tokens to every request and prefill them on top of its current (possibly edited) cache.

        The query-agnostic flow (docs/design.md §3; kvpress' "query-agnostic" setting): `prefill(context)`,
        `modify(drop_fn)` while the question is unknown, then `extend(questions)` and `decode`. Each extension
        is prefilled at the positions that follow the cache: `refeed_pos + 1, ...` — after a compacting edit
        (`positions="compact"`) that is `k, k+1, ...` for a cache of `k` kept tokens, on an unedited cache
        `T, T+1, ...`, with `positions="original"` the position after the last kept token. Its tokens attend to
        every cached row (sliding-window layers: to the rows whose positions lie in the window, as in `decode`)
        and causally to each other. So for a request never modified, `prefill(A) + extend(B)` holds the cache of
        `prefill(A + B)` and decodes the same tokens.

        Afterwards the request's cache holds `T + m` rows `[2, L, T + m, D]` and its tokens and prompt end with
        the extension; `decode` refeeds its last token. Query capture continues: the captured query `[L, Tq,
        Hq*d]` ends with the extension's query rows (the last `query_window` rows of the unedited prompt's
        queries followed by the extension's on an unedited request; only the extension's rows after an edit,
        computed over the edited cache). A second `modify` after `extend` therefore edits the extended cache;
        a query-aware policy whose window needs more rows than were captured refuses with its own error and
        the cache is left as it was.

        `decode` does not add its output to the cache, so `extend` after a `decode` appends to the prefilled
        (edited) cache, not to the generated text. Requests are extended in batches of `prefill_batch_size`
        (caches and extensions padded, padding masked). Text with over 10% tokens unknown to the tokenizer warns.

        Args:
            prompts: one string (tokenized without special tokens, so pass `" " + question` to continue a
                text) or token-id list per request, in request order; each at least one token.

        Returns:
            Each request's cache length `T + m` (its KV `[2, L, T + m, D]` is `kv(i)`).

        Raises:
            RuntimeError: called before `prefill`.
            TypeError / ValueError: not one extension per request, an empty extension, a token id outside the
                vocabulary, or a request whose cache plus extension leaves no KV token to decode into under
                `kv_budget_tokens` (the message gives the numbers). Nothing is changed when any check fails.
        """
        if not self.requests:
            raise RuntimeError("extend() needs prefilled requests; call prefill(prompts) first")
        self._refuse_per_head_positions("extend()", padded=False)
        ext = tokenize_extensions(self.tokenizer, prompts, len(self.requests), self.model.config.vocab_size)
        for r, x in zip(self.requests, ext):
            check_extension_fits(r.request_id, r.kv.shape[2], len(x), self.kv_budget_tokens)
        warn_past_context("extend()", max(r.refeed_pos + len(x) for r, x in zip(self.requests, ext)),
                          getattr(self.model.config, "max_position_embeddings", None))
        updates = []
        for start in range(0, len(self.requests), self.prefill_batch_size):
            updates += self._extend_batch(self.requests[start:start + self.prefill_batch_size],
                                          ext[start:start + self.prefill_batch_size])
        for r, x, (kv, query) in zip(self.requests, ext, updates):  # every forward succeeded: commit
            first = r.refeed_pos + 1
            if r.positions is not None:
                r.positions = torch.cat([r.positions, torch.arange(first, first + len(x))])
            r.kv, r.query = kv, query
            if r.pad is not None:  # the extension's rows are real in every head
                r.pad = torch.cat([r.pad, r.pad.new_zeros((*r.pad.shape[:2], len(x)))], dim=2)
            r.tokens, r.prompt_ids = r.tokens + x, r.prompt_ids + x  # new lists: snapshots of a request stay valid
            r.refeed_pos = first + len(x) - 1
        return [r.kv.shape[2] for r in self.requests]

    def _extend_batch(self, reqs: list[_Request], ext: list[list[int]], starts: list[int] | None = None
                      ) -> list[tuple]:
        """One padded forward of `ext` over the caches of `reqs`; returns each request's new `(kv, query)`.

        Extension `b` is fed at positions `starts[b], starts[b] + 1, ...` (default: `refeed_pos + 1`).

        Layout per row `b` (cache width `C = max T_b`, extension width `M = max m_b`): `[pad, cache_b, pad,
        ext_b]`, the padding masked out; masks are built by position (the slot store's rule), so sliding windows
        apply as in `decode`.
        """
        cache, recorder, _ = self._extend_forward(reqs, ext, starts)
        ms, width = [len(x) for x in ext], max(r.kv.shape[2] for r in reqs) + max(map(len, ext))
        return [self._extend_row(b, r, ms[b], cache, recorder, width) for b, r in enumerate(reqs)]

    def _extend_forward(self, reqs: list[_Request], ext: list[list[int]], starts: list[int] | None = None, *,
                        capture: bool = True, logits_to_keep: int = 1) -> tuple:
        """`_extend_batch`'s padded forward: `(cache, recorder, model output)`, the output's logits those of the
        last `logits_to_keep` columns `[B, logits_to_keep, vocab]`; `capture` False records no queries. A request
        holding per-head positions (`[L, H_kv, T]`, an `"original"` edit per layer or head) masks its cache by each
        row's latest position: every row precedes the fed tokens (models with sliding windows refuse such edits)."""
        B, L = len(reqs), self.facts.num_layers
        lens, ms = [r.kv.shape[2] for r in reqs], [len(x) for x in ext]
        C, M = max(lens), max(ms)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # [L, B, H_kv, C + M, d] at its final width: the forward writes the extension after the cache in place;
        # only the left padding is zeroed (masked, but read: it must be finite)
        keys = torch.empty((L, B, self.facts.num_kv_heads, C + M, self.facts.head_dim), dtype=self.model.dtype,
                           device=self.device)
        values = torch.empty_like(keys)
        key_pos = torch.zeros((B, C + M), dtype=torch.long)  # position of every key column
        key_ok = torch.zeros((B, C + M), dtype=torch.bool)  # False on padding
        input_ids = torch.full((B, M), pad_id, dtype=torch.long)
        query_pos = torch.zeros((B, M), dtype=torch.long)
        for b, (r, x) in enumerate(zip(reqs, ext)):
            T, m, first = lens[b], ms[b], r.refeed_pos + 1 if starts is None else starts[b]
            k, v = self._row_kv(r.kv)  # [L, H_kv, T, d]
            keys[:, b, :, C - T:C], values[:, b, :, C - T:C] = k, v
            keys[:, b, :, :C - T], values[:, b, :, :C - T] = 0, 0
            pos = r.positions if r.positions is None or r.positions.dim() == 1 else r.positions.flatten(0, -2).amax(0)
            key_pos[b, C - T:C] = pos if pos is not None else torch.arange(T)
            key_ok[b, C - T:C] = True
            new_pos = torch.arange(first, first + m)
            input_ids[b, M - m:] = torch.tensor(x)
            query_pos[b] = first  # padding rows: any position (their outputs are discarded)
            query_pos[b, M - m:] = new_pos
            key_pos[b, C + M - m:], key_ok[b, C + M - m:] = new_pos, True
        cache = wide_cache(keys, values, C)
        del keys, values
        self._hide_padding(reqs, cache, lens, C + M)
        masks = self._extend_masks(key_ok, key_pos, query_pos, ms, C)
        recorder = QueryRecorder(self.query_window if capture else 0)
        if recorder.window != 0:
            self._prepare_capture(self.query_window, ())
        with recording(recorder) if capture else nullcontext():
            out = self._forward(input_ids.to(self.device), masks, query_pos.to(self.device), cache, logits_to_keep)
        if recorder.window != 0:
            recorder.spec(L)  # ValueError naming the layers whose attention did not run through the capture
        return cache, recorder, out

    @torch.inference_mode()
    def teacher_forced_logits(self, continuations: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher forcing in one forward per batch: the logits `decode(max_tokens=m, forced_ids=continuations,
        keep_logits=True)` keeps, computed by feeding each request's last cached token and its continuation but
        the last (`[tokens[-1]] + continuation[:-1]`, `m` tokens) over its cache minus its last row (decode
        refeeds that token, so the first logits are computed over the edited cache, as vLLM does) at the positions
        decode feeds them: `refeed_pos, refeed_pos + 1, ...` (compact after an edit: from `k - 1`; original: after
        the last kept position), attending to every cached row (per-head padding rows hidden, sliding windows by
        position) and causally to each other. Equal to the decode path up to float summation order (fp32: within
        1e-4 of SmolLM2-135M's logits, whose decode runs on prepacked linears), in one forward instead of `m`;
        the caches are left as they were.

        Args:
            continuations: one token-id list per request (lengths may differ), each at least one id in the vocabulary.

        Returns:
            Per request its logits `[m, vocab]` on the CPU (fp32, or the model dtype when wider): row `s` predicts
            `continuations[i][s]`.

        Raises:
            RuntimeError: called before `prefill`.
            TypeError / ValueError: not one non-empty list of in-vocabulary ids per request (`check_forced_ids`).
        """
        if not self.requests:
            raise RuntimeError("teacher_forced_logits() needs prefilled requests; call prefill(prompts) first")
        lengths = [len(c) if isinstance(c, Sequence) and not isinstance(c, str) else 1 for c in continuations]
        forced = check_forced_ids(continuations, [r.request_id for r in self.requests], [max(1, n) for n in lengths],
                                  self._vocab_size())
        fed = [[r.tokens[-1]] + forced[r.request_id][:-1] for r in self.requests]
        warn_past_context("teacher_forced_logits()", max(r.refeed_pos + len(x) - 1 for r, x in zip(self.requests, fed)),
                          getattr(self.model.config, "max_position_embeddings", None))
        logits = []
        for start in range(0, len(self.requests), self.prefill_batch_size):
            views = [_without_last_row(r) for r in self.requests[start:start + self.prefill_batch_size]]
            ext = fed[start:start + self.prefill_batch_size]
            M = max(map(len, ext))
            _, _, out = self._extend_forward(views, ext, [r.refeed_pos for r in views], capture=False,
                                             logits_to_keep=M)
            x = out.logits.float() if out.logits.dtype in (torch.float16, torch.bfloat16) else out.logits
            logits += [x[b, M - len(e):].cpu() for b, e in enumerate(ext)]  # [m, vocab]; left padding dropped
        return logits

    def _hide_padding(self, reqs: list[_Request], cache, lens: list[int], width: int) -> None:
        """Unequal per-head counts: the padding rows of each padded request's cache (its `pad` `[L, H_kv, T]`,
        right-aligned at `lens[b]` before the extension) stay hidden from every query of `_extend_batch`."""
        if all(r.pad is None for r in reqs):
            return
        L, C = self.facts.num_layers, max(lens)
        hidden = torch.zeros((L, len(reqs), self.facts.num_kv_heads, width), dtype=torch.bool)  # [L, B, H_kv, C + M]
        for b, r in enumerate(reqs):
            if r.pad is not None:
                hidden[:, b, :, C - lens[b]:C] = r.pad
        cache.slot_store = PaddingMasks(list(hidden.to(self.device)))

    def _extend_masks(self, key_ok: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor, ms: list[int],
                      C: int):
        """`_extend_batch`'s 4D masks `[B, 1, M, C + M]` from each key column's position `key_pos` `[B, C + M]`
        (`key_ok` False on padding) and each query's `query_pos` `[B, M]` (`ms`: real extension lengths, the
        rest left padding): causal by position, sliding windows by position; boolean for sdpa, additive for
        eager and sliding-window models; a dict by layer type when layers' windows differ."""
        M = query_pos.shape[1]
        # [B, M, C + M]: a real key at a position <= the query's (causal by position, as the slot store masks)
        allowed = key_ok[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
        rows = torch.arange(M)
        padded_query = rows[None, :] < (M - torch.tensor(ms))[:, None]  # [B, M]

        def mask(window, additive):
            a = allowed if window is None else allowed & (key_pos[:, None, :] > query_pos[:, :, None] - window)
            a = a.clone()
            a[:, rows, C + rows] |= padded_query  # a padding query sees itself only (no all-masked row)
            a = a[:, None].to(self.device)  # [B, 1, M, C + M]
            if additive is None:
                return a
            return torch.zeros(a.shape, dtype=additive, device=self.device).masked_fill_(~a, torch.finfo(additive).min)

        if self._mask_windows is None:
            return mask(None, self.model.dtype if "eager" in self.model.config._attn_implementation else None)
        masks = {key: mask(w, self.model.dtype) for key, w in self._mask_windows.items()}
        return masks.get(None, masks)

    def _extend_row(self, b: int, r: _Request, m: int, cache, recorder: QueryRecorder, width: int) -> tuple:
        """Row `b`'s new `(kv [2, L, T + m, D], query [L, Tq, Hq*d] or None)` after `_extend_batch`'s forward
        (`width` = C + M cache columns, the row's `m` extension tokens last)."""
        L = self.facts.num_layers
        # cache layer [B, H_kv, C + M, d] -> this row's new [L, m, H_kv*d]
        k = torch.stack([lay.keys[b, :, width - m:, :].transpose(0, 1).reshape(m, -1) for lay in cache.layers])
        v = torch.stack([lay.values[b, :, width - m:, :].transpose(0, 1).reshape(m, -1) for lay in cache.layers])
        kv = torch.cat([r.kv, torch.stack([k, v])], dim=2)  # [2, L, T + m, D]
        if self.query_window == 0:
            return kv, None
        # recorded [B, Hq, <= window, d] -> this row's last extension rows [L, t, Hq*d]
        t = min(m, recorder.layers[0].shape[2])
        query = torch.stack([recorder.layers[i][b, :, -t:, :].transpose(0, 1).reshape(t, -1) for i in range(L)])
        if r.query is not None:  # rows aligned to the end of the cache: earlier rows, then these
            query = torch.cat([r.query, query], dim=1)
        if self.query_window is not None:
            query = query[:, -self.query_window:]
        return kv, query
    @torch.inference_mode()
    def decode(self, max_tokens: int | Sequence[int] = 64, *, temperature: float = 0.0, ignore_eos: bool = True, seed: int = 0,
               keep_logits: bool = False, compression: Compression | None = None,
               forced_ids: Sequence[Sequence[int]] | None = None) -> list[RequestOutput]:
        """Batched decoding of every request under the KV budget; returns one `RequestOutput` per request.

        Requests are admitted first come first served while the sum of their reservations over the running
        batch stays within `kv_budget_tokens` (and the batch within `max_batch_size`); a reservation is the
        cache length plus the tokens the request may generate. With `ignore_eos=True` that is all of
        `max_tokens` (the output length is known). With EOS honoured a request is granted `KV_BLOCK_TOKENS`
        (256) at a time as it generates, and its storage grows with it, so a request that stops early neither
        holds memory nor blocks admission for tokens it never produced; when a request's next block does not
        fit, the most recently admitted other request leaves the batch with its cache and generated tokens and
        resumes, unchanged, when there is room (vLLM's preemption order). A request leaves the batch when it has
        `max_tokens` tokens (or generated EOS with `ignore_eos=False`).

        Args:
            max_tokens: tokens to generate per request (>= 1): one int for all, or one per request (list, tuple,
                numpy array or tensor of ints). Capped at the model's context (`max_position_embeddings`, with
                EOS honoured or not; a warning says so): the request stops there with finish_reason "length"
                (`engines.scheduler.context_limits`; compact compression caps only when `B + N` reaches past the context).
            temperature: 0 = greedy (as is any temperature below `GREEDY_BELOW`, 1e-5, vLLM's convention); > 0
                samples from softmax(logits / temperature), each request from its own generator seeded with
                `engines.sampling.request_seed(seed, request_id)`, so its tokens do not depend on the batch.
            ignore_eos: keep generating after an EOS token (fixed output lengths, for benchmarks); EOS is any of
                `eos_token_ids`: the tokenizer's EOS and every id in the model's `generation_config.eos_token_id`.
                `RequestOutput.answer` holds the text before the first EOS either way.
            keep_logits: store each step's logits `[vocab]` (fp32, or the model dtype when wider) in the outputs.
            compression: a `tdutils.compression.Compression(policy, budget=B, buffer=N, window=w)`: R-KV's
                decode-time setting (arXiv:2505.24133). Each step also captures the fed token's query (after
                q_norm and RoPE, as at prefill); when a request's cache reaches `B + N` entries and its last `w`
                queries exist, the policy scores the cache with them and it is cut back to `B` in its slot, in
                the batch (the other requests go on), at the engine's `positions` (compact: kept keys re-rotated
                to `0..B-1`, decoding continues at `B`, so positions stay below `B + N` and the model's context
                does not cap `max_tokens` unless `B + N` exceeds it; original: keys and positions unchanged). A request therefore reserves at
                most `B + N + 1` KV tokens (more while its first `w` queries are still missing, and, for the whole
                decode, a cache that starts longer than `B + N`: cut such prompts at prefill with
                `prefill(..., compression=...)`), so many more requests fit `kv_budget_tokens`; with `B + N` at least the final
                length nothing is cut and the output is the uncompressed decode's. Each cut is in
                `RequestOutput.compressions`; `metrics.decode.compressions` counts them.
            forced_ids: teacher forcing: one token-id list per request (at least its `max_tokens` long); step `s`
                outputs and then feeds `forced_ids[i][s]` instead of the sampled token, while `keep_logits`
                records the model's distribution at every step (fidelity to a reference generation: KL per step).

        Raises:
            RuntimeError: called before `prefill`.
            TypeError: `max_tokens` not an integer or one integer per request (a string, None, a float), or
                `compression` not a `Compression`.
            ValueError: `max_tokens < 1`, a bad temperature, a request that alone needs more KV tokens than
                `kv_budget_tokens` (the message gives both numbers), or `forced_ids` not one list of at least
                `max_tokens` in-vocabulary ids per request.
        """
        if not self.requests:
            raise RuntimeError("decode() needs prefilled requests; call prefill(prompts) first")
        if self.device.type == "cpu":  # the freed memory of the edits and extends, back to the OS before the store
            release_free_heap()
        run = self._plan_decode(max_tokens, temperature, ignore_eos, seed, keep_logits, compression, forced_ids)
        bar = self._bar(sum(run.sched.limits.values()), "decode")
        t0 = time.perf_counter()
        # once per decode: entering packs again the weights edited since the last one (engines.packed)
        with self._packed or nullcontext():
            while run.sched.waiting or run.sched.running:
                self._admit_waiting(run)
                self._decode_step(run, t0, bar)
        run.dm.seconds = time.perf_counter() - t0
        bar.close()
        if run.comp is None:  # the step that fed a request's last token attended over its whole cache
            run.dm.kv_peak_cache_tokens = max(r.kv.shape[2] - 1 + len(r.output_ids) for r in self.requests)
        return [request_output(r, self.tokenizer, self.eos_token_ids, run.dm, None if run.comp is None else
                               run.comp.events(r)) for r in self.requests]

    def _plan_decode(self, max_tokens, temperature, ignore_eos, seed, keep_logits, compression, forced_ids
                     ) -> _DecodeRun:
        """`decode`'s checks (in its order: max_tokens, forced ids, temperature, compression, context, budget),
        then its scheduler, storage and sampling state; the requests' decode state is reset."""
        rids = [r.request_id for r in self.requests]
        per_request = check_max_tokens(max_tokens, len(self.requests))
        forced = None if forced_ids is None else check_forced_ids(forced_ids, rids, per_request, self._vocab_size())
        temperature = check_temperature(temperature)
        if temperature < GREEDY_BELOW:
            temperature = 0.0
        comp = None
        if compression is not None:
            self._refuse_per_head_positions("decode(compression=...)")
            comp = SlotCompressor(self, compression)
        compact = comp is not None and comp.compact  # cuts renumber positions: a request feeds below its bound
        limits = context_limits(dict(zip(rids, per_request)), {r.request_id: r.refeed_pos for r in self.requests},
                                getattr(self.model.config, "max_position_embeddings", None),
                                {r.request_id: comp.bound(r) for r in self.requests} if compact else None,
                                comp.budget + comp.buffer if compact else None)
        # KV tokens a request may hold at once (+ 1, the token it generates last): all its tokens, or with
        # compression at most its bound (B + N, or longer while it starts)
        caps = {r.request_id: None if comp is None else comp.bound(r) + 1 for r in self.requests}
        block = None if ignore_eos else KV_BLOCK_TOKENS
        sched = DecodeScheduler({r.request_id: r.kv.shape[2] for r in self.requests}, limits,
                                budget=self.kv_budget_tokens, max_batch_size=self.max_batch_size, block=block, caps=caps)
        sched.check_fits(compression)
        dm = self.metrics.decode = DecodeMetrics(kv_budget_tokens=self.kv_budget_tokens)
        for r in self.requests:
            r.output_ids, r.token_times, r.finish_reason = [], [], "length"
            r.logits = [] if keep_logits else None
            r.resume = None
        store = self._new_store([sched.reservation(rid) for rid in rids], self.kv_budget_tokens,
                                max(map(sched.need, rids)) - 1 if block is None else None, positions=comp is not None)
        if comp is not None:
            comp.start(store)
        sched.waiting.extend(self.requests)
        return _DecodeRun(sched, store, comp, dm, temperature, request_generators(seed, rids), forced, keep_logits,
                          ignore_eos, torch.zeros(store.slots, dtype=torch.long, device=self.device),
                          torch.zeros(store.slots, dtype=torch.long, device=self.device),
                          lean=self._lean is not None and comp is None and self._lean.usable())

    def _admit_waiting(self, run: _DecodeRun) -> None:
        """Admit waiting requests while a slot is free and their reservations fit (`DecodeScheduler`)."""
        sched, store = run.sched, run.store
        while (r := sched.pop_admissible(store.free_slots)) is not None:
            store.grow(sched.reservation(r.request_id) - 1)
            resumed = r.resume is not None
            slot = self._admit(store, r)
            sched.running[slot] = r
            if run.comp is not None:
                run.comp.join(slot, r, resumed)
            if r.resume is None:
                run.next_ids[slot], run.next_pos[slot] = r.tokens[-1], r.refeed_pos
            else:
                run.next_ids[slot], run.next_pos[slot] = r.resume[3], r.resume[4]
                r.resume = None
        reserved = sched.reserved()
        run.dm.peak_batch_size = max(run.dm.peak_batch_size, len(sched.running))
        run.dm.kv_peak_reserved_tokens = max(run.dm.kv_peak_reserved_tokens, reserved)
        assert sched.budget is None or reserved <= sched.budget, (reserved, sched.budget)  # admission and grants keep this

    def _decode_step(self, run: _DecodeRun, t0: float, bar) -> None:
        """One forward of the running batch: choose each row's token, book it, cut caches that reached `B + N`,
        grant blocks (preempting where needed)."""
        sched, store, comp, dm = run.sched, run.store, run.comp, run.dm
        rows = store.rows
        store.begin_step(run.next_pos[:rows])
        fed = run.next_ids[:rows].tolist() if comp is not None else None
        ids, mask, pos = run.next_ids[:rows, None], self._decode_masks(store, run.next_pos[:rows]), run.next_pos[:rows, None]
        if run.lean and store.hidden is None:
            logits = self._lean(ids, mask, pos, store)[:, -1, :]
        else:
            with comp.capture(rows) if comp is not None else nullcontext(), slot_decode():
                logits = self._forward(ids, mask, pos, store.cache()).logits[:, -1, :]
        store.end_step()
        # logits: [rows, vocab]; idle rows (free slots) are ignored
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # sampling and keep_logits in at least fp32
        new_ids = choose_tokens(logits, sched.running, run.temperature, run.generators, run.forced)  # [rows]
        now = time.perf_counter() - t0
        dm.steps += 1
        bar.update(len(sched.running))
        run.next_ids[:rows] = new_ids.to(self.device)
        run.next_pos[:rows] += 1
        stepped = list(sched.running.items())  # every request this step fed, including those that finish now
        for slot, r in stepped:
            tok = int(new_ids[slot])
            r.output_ids.append(tok)
            r.token_times.append(now)
            if run.keep_logits:
                r.logits.append(logits[slot].cpu())
            done = len(r.output_ids) >= sched.limits[r.request_id]
            if not done and not run.ignore_eos and tok in self.eos_token_ids:
                r.finish_reason, done = "stop", True
            if done:
                del sched.running[slot]
                store.release(slot)
        if comp is not None:  # the fed tokens are cached now: cut the caches that reached B + N
            comp.after_step(stepped, sched.running, fed, run.next_pos, dm)
        self._grant_blocks(run)
        dm.kv_storage_tokens = max(dm.kv_storage_tokens, store.slots * store.width)
        dm.kv_storage_bytes = max(dm.kv_storage_bytes, store.bytes)

    def _grant_blocks(self, run: _DecodeRun) -> None:
        """Grant the next block to requests that used theirs, preempting the latest admitted others if needed:
        a preempted request leaves with its cache and generated tokens and resumes, unchanged, later."""
        sched = run.sched
        for slot, r in list(sched.running.items()):
            if not sched.needs_block(slot, r):
                continue
            sched.grant_block(r.request_id)
            while sched.over_budget():
                victim = sched.victim(slot)
                if run.comp is not None:
                    run.comp.leave(victim, sched.running[victim])
                sched.running[victim].resume = (*run.store.take(victim), int(run.next_ids[victim]),
                                                int(run.next_pos[victim]))
                sched.preempt(victim)
                run.dm.preemptions += 1
            run.store.grow(sched.reservation(r.request_id) - 1)

    # ------------------------------------------------------------------ batch bookkeeping
    def _row_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[2, L, T, D]` -> keys, values `[L, H_kv, T, d]` (the layout of a cache layer, batch dim removed)."""
        L, T = kv.shape[1], kv.shape[2]
        h, d = self.facts.num_kv_heads, self.facts.head_dim
        kv = kv.view(2, L, T, h, d).transpose(2, 3)  # [2, L, H_kv, T, d]
        return kv[0], kv[1]

    def _new_store(self, needs: list[int], budget: int | None, width: int | None = None, *, positions: bool = False
                   ) -> SlotKVStore:
        """Decode storage for requests reserving `needs` KV tokens (see `engines.kvstore`), `width` tokens per
        slot (default: the largest need - 1; it grows when requests are granted more); it tracks each entry's
        position when sliding-window layers need masks by position, or when `positions` (compression)."""
        plan = plan_slots(needs, budget, self.max_batch_size)
        return SlotKVStore(num_layers=self.facts.num_layers, num_kv_heads=self.facts.num_kv_heads,
                           head_dim=self.facts.head_dim, slots=plan.slots, width=width or plan.width,
                           dtype=self.model.dtype, device=self.device,
                           track_positions=positions or self._mask_windows is not None)

    def _admit(self, store: SlotKVStore, r: _Request) -> int:
        """Copy a request's cache minus its last entry into a free slot (that entry's token is fed again at
        `refeed_pos`, so the first generated token is computed over the edited cache); returns the slot. A
        preempted request (`r.resume`) gets back exactly the entries it left with."""
        hidden = None
        if r.pad is not None:  # the padding rows stay hidden; generated rows come after them
            n = r.resume[0].shape[2] if r.resume is not None else r.kv.shape[2] - 1
            hidden = torch.zeros(*r.pad.shape[:2], n, dtype=torch.bool)
            hidden[:, :, :r.pad.shape[2] - 1] = r.pad[:, :, :-1]
        if r.resume is not None:
            return store.admit(*r.resume[:3], hidden=hidden)
        check_kv(r.kv, r.tokens)
        k, v = self._row_kv(r.kv)
        positions = None
        if store.positions is not None:
            n = r.kv.shape[2]
            positions = r.positions[:-1] if r.positions is not None else torch.arange(n - 1)
        return store.admit(k[:, :, :-1, :], v[:, :, :-1, :], positions, hidden=hidden)

    def _decode_masks(self, store: SlotKVStore, query_positions: torch.Tensor):
        """Prepared 4D masks of one decode step, `[rows, 1, 1, cols]`: boolean for sdpa, additive for eager and
        for sliding-window models (by position, docs/design.md §3); one tensor when every layer has the same
        window, else a dict by layer type (what hybrid models' forward looks masks up by)."""
        if self._mask_windows is None:
            additive = self.model.dtype if "eager" in self.model.config._attn_implementation else None
            return store.attention_mask(additive_dtype=additive)
        masks = {key: store.attention_mask(window=w, query_positions=query_positions, additive_dtype=self.model.dtype)
                 for key, w in self._mask_windows.items()}
        return masks.get(None, masks)


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _without_last_row(r: _Request) -> _Request:
    """A view of request `r` whose cache lacks its last row (the token decode feeds again), for
    `teacher_forced_logits`; `r` is unchanged."""
    return replace(r, kv=r.kv[:, :, :-1], tokens=r.tokens[:-1],
                   positions=None if r.positions is None else r.positions[..., :-1],
                   pad=None if r.pad is None else r.pad[..., :-1])


def _chunk_bounds(n: int, size: int, rows: int) -> list[tuple[int, int]]:
    """`[start, end)` of each chunk of a prompt of `n` tokens: `size` tokens each, except that a last chunk shorter
    than `rows` (the query rows a cut is scored with) takes tokens from the one before it, so that every chunk
    after which a cut may come ends with `rows` queries of its own (`size >= 2 * rows` keeps both long enough)."""
    bounds = [(a, min(a + size, n)) for a in range(0, n, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < rows:
        (a, _), (_, end) = bounds[-2], bounds[-1]
        split = end - rows
        bounds[-2:] = [(a, split), (split, end)]
    return bounds


def _chunk_last_position(bounds: list[tuple[int, int]], budget: int | None) -> int:
    """The largest position a chunked prefill of `bounds` feeds: the prompt's last (`n - 1`) without compact cuts;
    with them (`budget`: each cache longer than it is cut to it and renumbered `0..budget-1` after every chunk)
    the largest `kept + chunk length - 1`."""
    held, last = 0, 0
    for a, b in bounds:
        last = max(last, held + (b - a) - 1)
        held += b - a
        if budget is not None and held > budget:
            held = budget
    return last


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware: x86 AVX512-BF16 or AMX (torch's own probes,
    `torch.cpu._is_avx512_bf16_supported` / `_is_amx_tile_supported`), or a `/proc/cpuinfo` flag of
    `BF16_CPU_FLAGS` (Arm's BF16 extension too). Elsewhere torch emulates bfloat16 (the engine warns at open,
    `BF16_EMULATED`)."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    if any(p is not None and p() for p in probes):
        return True
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            words = set(f.read().split())
    except OSError:  # not Linux: only torch's probes
        return False
    return any(flag in words for flag in BF16_CPU_FLAGS)


def _check_loaded_model_settings(model, dtype, device, attn_implementation) -> None:
    """Loading settings passed with an already loaded model must describe it (the engine does not convert a
    user's model); ValueError naming the setting and what to do otherwise."""
    first = next(model.parameters(), None)
    have_attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if have_attn is not None:
        have_attn = have_attn.removeprefix("tdutils_capture_")  # an engine's query capture wraps the backend
    if attn_implementation is not None and have_attn is not None and attn_implementation != have_attn:
        raise ValueError(f"attn_implementation={attn_implementation!r} applies when the engine loads the model; "
                         f"this model object uses {have_attn!r}: call model.set_attn_implementation("
                         f"{attn_implementation!r}) first, or leave attn_implementation out")
    if dtype != "auto" and first is not None and _torch_dtype(dtype) != first.dtype:
        raise ValueError(f"dtype={dtype!r} applies when the engine loads the model; this model object is "
                         f"{first.dtype}: convert it (model.to({_torch_dtype(dtype)})) or leave dtype out")
    if device is not None and first is not None and torch.device(device).type != first.device.type:
        raise ValueError(f"device={device!r} applies when the engine loads the model; this model object is on "
                         f"{first.device}: move it (model.to({str(device)!r})) or leave device out")


def _mask_windows(config, windows: list[int | None]) -> dict:
    """Decode masks a sliding-window model needs: `{None: W}` when every layer has the same window, else
    `{layer_type: window}` from `config.layer_types` (the keys transformers' hybrid models look masks up by).

    Raises:
        ValueError: layers of one type with different windows, or different windows without `layer_types`.
    """
    if len(set(windows)) == 1:
        return {None: windows[0]}
    types = getattr(config, "layer_types", None)
    by_type: dict = {}
    for i, window in enumerate(windows):
        t = types[i] if types and i < len(types) else None
        if t is None or by_type.setdefault(t, window) != window:
            raise ValueError(f"{getattr(config, 'model_type', '?')}: sliding windows {windows} per layer do not follow "
                             f"its layer_types {types}; the hf engine cannot build its masks")
    return by_type


def request_output(r: _Request, tokenizer, eos: frozenset[int], dm: DecodeMetrics, compressions) -> RequestOutput:
    """The `RequestOutput` of one decoded request (its text decoded without special tokens, its answer up to the
    first EOS, its TPOT: mean seconds per token after the first, NaN with one token); books its output tokens and
    TPOT in `dm`."""
    dm.output_tokens += len(r.output_ids)
    t = r.token_times
    tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
    if len(t) > 1:
        dm.tpot_s.append(tpot)
    text = tokenizer.decode(r.output_ids, skip_special_tokens=True)
    return RequestOutput(request_id=r.request_id, prompt_tokens=len(r.prompt_ids), cached_tokens=r.kv.shape[2],
                         output_ids=list(r.output_ids), text=text, answer=answer_text(tokenizer, r.output_ids, eos, text),
                         finish_reason=r.finish_reason, ttft_s=r.ttft_s, tpot_s=tpot, logits=r.logits,
                         compressions=compressions)


def _eos_ids(tokenizer, model) -> frozenset[int]:
    """EOS ids: the tokenizer's `eos_token_id` united with `generation_config.eos_token_id` (an int or a list;
    Llama-3-Instruct's `<|eot_id|>`, Gemma 3's `[1, 106]`), as `model.generate` and vLLM stop on."""
    ids = set()
    gen = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(gen, "eos_token_id", None)):
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return frozenset(ids)
