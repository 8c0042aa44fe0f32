"""The `lmcache` engine: vLLM (OpenAI-compatible server, LMCache MP connector) + LMCache server, driven through
LMCache's SDK (`lmcache.sdk`), with the `hf` engine's API (docs/design.md §1, §6).

`prefill` clears LMCache and sends every prompt to vLLM with `max_tokens=1` under a fresh prefill salt (vLLM's
connector stores its KV and, with tdutils' vLLM patch, its queries); each prompt is front-padded to a multiple of
the chunk size so the whole prompt, question included, reaches the drop function (`align="pad"`). `modify`
retrieves each request's KV `[2, L, T, D]` (and queries), checks rows against the model, runs the drop function
and stores the result under the request's own edit salt; requests switch to their edited caches only when every
request succeeded. `decode` streams from the (edited) caches under the KV budget; `decode(compression=...)` runs
LMCache's multi-round flow (§9). vLLM decodes at compact positions, so drop functions must re-rotate.
Fused K/V layouts (vLLM-CPU) are converted by `tdutils.serving.kvlayout` and need tdutils' LMCache patch
(`python -m tdutils patches apply --target lmcache`). `lmcache` is imported only when an engine is opened; tests
pass a stand-in `sdk`.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ..checks import CountSetting, check_count, check_engine_settings, check_seconds, check_temperature
from ..compression import Compression
from ..edit import validate_drop_output
from ..kvcache import CacheKind, check_kv
from ..metrics import DecodeMetrics, RunMetrics
from ..models import load_tokenizer, model_facts, resolve_model
from ..outputs import RequestOutput, answer_text
from ..rope import RopeSpec, apply_rope
from ..serving.completion import CompletionError, make_post_completion
from ..serving.kvlayout import ARRANGEMENTS, FUSED_FORMATS, fused_to_kv, kv_to_fused
from ..serving.probes import (
    LMCACHE_START_HINT,
    VLLM_START_HINT,
    ServerError,
    http_json,
    lmcache_health,
    lmcache_model_name,
    registered_models,
    served_models,
)
from ..textio import read_text
from .base import Engine, register_engine, tokenize_extensions
from .decode_compression import cut_event, decode_cut
from .scheduler import (
    admits,
    check_extension_fits,
    check_prompt_fits,
    compressed_budget_error,
    request_budget_error,
)

ALIGN = ("pad", "none")
FUSED_ARRANGEMENTS = ("auto", *ARRANGEMENTS)


class QueryCheckError(ValueError):
    """Retrieved query or key rows do not belong to the request's tokens (mixed-up or shifted rows)."""


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]  # as given
    tokens: list[int]  # the prompt vLLM saw (front-padded with align="pad")
    salt: str  # the salt its current cache lives under
    cached: int  # tokens its current cache holds (edited: k)
    pad: int = 0
    ttft_s: float = float("nan")
    edited: bool = False
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    tpot_s: float = float("nan")


class _Layer0:
    """Recomputes layer 0's keys and queries of a few tokens from the checkpoint (embedding, input norm,
    q/k projections, q/k norms, RoPE), to check retrieved rows against the tokens they claim to be.

    Layer 0's input is the token embedding alone, so its keys and queries depend only on the token id and
    its position: a row from another token or position shows up as a low cosine similarity. Supports
    the Llama / Mistral / Qwen2 / Qwen3 weight layout; reads only the needed embedding rows.
    """

    NAMES: ClassVar[dict[str, str]] = {"embed": "model.embed_tokens.weight", "norm": "model.layers.0.input_layernorm.weight",
             "q": "model.layers.0.self_attn.q_proj.weight", "k": "model.layers.0.self_attn.k_proj.weight",
             "q_bias": "model.layers.0.self_attn.q_proj.bias", "k_bias": "model.layers.0.self_attn.k_proj.bias",
             "q_norm": "model.layers.0.self_attn.q_norm.weight", "k_norm": "model.layers.0.self_attn.k_norm.weight"}
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")

    def __init__(self, model_dir: Path, config):
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(read_text(index))["weight_map"]
        elif (model_dir / "model.safetensors").is_file():
            with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
                weight_map = {n: "model.safetensors" for n in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)
        else:
            raise FileNotFoundError(f"no safetensors weights in {model_dir}")
        self.facts = model_facts(config)
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.spec = RopeSpec.from_config(config)
        self.weights: dict[str, torch.Tensor] = {}
        self._embed = None
        for key, name in self.NAMES.items():
            fname = weight_map.get(name)
            if fname is None:
                if key in ("embed", "norm", "q", "k"):
                    raise KeyError(f"{name} not in the checkpoint")
                continue
            f = safe_open(str(model_dir / fname), "pt")
            if key == "embed":
                self._embed = f.get_slice(name)  # rows read on demand: the table can be GBs
            else:
                self.weights[key] = f.get_tensor(name).float()

    @classmethod
    def load(cls, source: str | None, config) -> _Layer0 | None:
        """The checker for a local folder / bundled name / hub id already in the local cache, or None."""
        if source is None or getattr(config, "model_type", None) not in cls.MODEL_TYPES:
            return None
        path = Path(resolve_model(source, check=False).target)  # a bundled name's folder, else the source
        if not path.is_dir():
            try:
                from huggingface_hub import snapshot_download

                path = Path(snapshot_download(source, local_files_only=True,
                                              allow_patterns=["*.json", "*.safetensors"]))
            except Exception:  # noqa: BLE001 (not cached, no hub client, offline: all mean "no checker")
                return None
        try:
            return cls(path, config)
        except (OSError, KeyError, ValueError):
            return None

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def qk(self, token_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer-0 queries `[n, Hq, d]` and keys `[n, H_kv, d]` (fp32, after norms and RoPE)."""
        f = self.facts
        emb = torch.stack([self._embed[t:t + 1][0] for t in token_ids]).float()  # [n, hidden]
        h = self._rms(emb, self.weights["norm"])
        out = []
        for name, heads in (("q", f.num_query_heads), ("k", f.num_kv_heads)):
            x = h @ self.weights[name].T
            if f"{name}_bias" in self.weights:
                x = x + self.weights[f"{name}_bias"]
            x = x.view(len(token_ids), heads, f.head_dim)
            if f"{name}_norm" in self.weights:
                x = self._rms(x, self.weights[f"{name}_norm"])
            out.append(apply_rope(x, torch.tensor(positions), self.spec, token_dim=-3))
        return out[0], out[1]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity along the last dim (fp32)."""
    a, b = a.float(), b.float()
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)


@register_engine("lmcache")
class LMCacheEngine(Engine):
    """Serving-path engine over vLLM + LMCache (see the module docstring for what each phase does).

    Args:
        model: the model name vLLM serves (default: the only one it serves).
        vllm_url: vLLM's OpenAI-compatible server, `http://HOST:PORT`.
        lmcache_url: LMCache's request endpoint for the SDK (`tcp://HOST:PORT`, or `grpc://...`).
        lmcache_http_url: LMCache's HTTP API (`/healthcheck`, `/config`, `/status`, `/cache/clear`).
        config: the model's transformers config; default loaded from the served model's `root`
            (a local folder, or a hub id in the local cache).
        tokenizer: for string prompts and the pad token; default loaded like `config`.
        query_window: final prompt tokens whose queries drop functions receive (`[L, Tq, Hq*d]`); None:
            all; 0: no queries (no QUERY context is connected).
        align: `"pad"` (default) or `"none"`; docs/design.md §6.
        pad_token_id: the token used for front padding; default the tokenizer's pad (else EOS) token.
        kv_budget_tokens: decode admission budget (prompt + tokens to generate, summed over running
            requests), None = all requests at once (vLLM's scheduler then decides).
        max_batch_size: optional cap on concurrently running requests.
        check_rows: rows of keys and queries checked against the model before the drop function runs
            (layer-0 recomputation when the checkpoint is readable locally; shape and finiteness checks
            always); 0 turns the check off.
        clear_cache: POST `/cache/clear` to LMCache at every `prefill` (isolates runs).
        fused_arrangement: how a fused K/V cache (engine KV format `NL_X_NB_NH_BS_CS`) packs K and V in a
            block: `"auto"` (default: the arrangement whose layer-0 keys match the model's; `"kt_v"` when the
            checkpoint is not readable here), `"kt_v"` (vLLM's CPU backend) or `"k_v"` (K|V per token).
        timeout: read timeout of completion streams (s); http_timeout: of other HTTP calls (s);
            retrieve_timeout: how long `modify` waits for vLLM's asynchronous stores to land in LMCache (s).
        positions: only `"compact"` (vLLM decodes the kept tokens as a new prompt).
        dtype, device: accepted for CLI compatibility; vLLM chooses the dtype (`vllm serve --dtype`) and
            device, so only `"auto"` / None are valid.
        chat_template: `"none"` (default), `"auto"` or `"on"`: text prompts wrapped in the tokenizer's chat
            template, as on the `hf` engine (`tdutils.chat`).
        sdk: the `lmcache.sdk` module (default: imported here); tests pass a stand-in.

    Raises:
        ServerError (a ConnectionError): a server is down or not set up; the message has the start command.
        ImportError: lmcache is not installed (`pip install 'tdutils[lmcache]'`).
        ValueError: bad settings, or a model that vLLM does not serve / LMCache has no layout for.
    """

    check_rows = CountSetting(0)

    def __init__(self, model: str | None = None, *, vllm_url: str = "http://localhost:8000",
                 lmcache_url: str = "tcp://localhost:6555", lmcache_http_url: str = "http://localhost:8080",
                 config=None, tokenizer=None, query_window: int | None = 64, align: str = "pad",
                 pad_token_id: int | None = None, kv_budget_tokens: int | None = None,
                 max_batch_size: int | None = None, check_rows: int = 4, clear_cache: bool = True,
                 timeout: float = 120.0, http_timeout: float = 10.0, retrieve_timeout: float = 60.0,
                 fused_arrangement: str = "auto", positions: str = "compact", dtype="auto", device=None,
                 chat_template: str = "none", progress: bool = True, sdk=None):
        if align not in ALIGN:
            raise ValueError(f"align must be one of {ALIGN}, got {align!r}")
        if fused_arrangement not in FUSED_ARRANGEMENTS:
            raise ValueError(f"fused_arrangement must be one of {FUSED_ARRANGEMENTS}, got {fused_arrangement!r}")
        if positions != "compact":
            raise ValueError(f"the lmcache engine decodes the kept tokens as a new prompt, so only positions='compact' "
                             f"exists there, got {positions!r}; use engine 'hf' for positions='original'")
        if dtype not in ("auto", None) or device not in (None, "auto"):
            raise ValueError("dtype and device are chosen by vLLM on the lmcache engine (vllm serve --dtype ...); "
                             f"leave them at their defaults, got dtype={dtype!r}, device={device!r}")
        check_engine_settings(kv_budget_tokens, max_batch_size, query_window)
        check_count(check_rows, "check_rows", 0)
        for name, value in (("timeout", timeout), ("http_timeout", http_timeout),
                            ("retrieve_timeout", retrieve_timeout)):
            check_seconds(value, name)
        self.vllm_url = vllm_url.rstrip("/").removesuffix("/v1")
        self.lmcache_url, self.lmcache_http_url = lmcache_url, lmcache_http_url.rstrip("/")
        self.query_window, self.align, self.check_rows = query_window, align, check_rows
        self.kv_budget_tokens, self.max_batch_size = kv_budget_tokens, max_batch_size
        self.clear_cache, self.progress = clear_cache, progress
        if chat_template not in ("auto", "on", "none"):
            raise ValueError(f"chat_template must be 'auto', 'on' or 'none', got {chat_template!r}")
        self.chat_template = chat_template  # applied to text prompts when tokenizing (tdutils.chat)
        self.http_timeout, self.retrieve_timeout = float(http_timeout), float(retrieve_timeout)
        self.positions = "compact"

        registered = self._connect_servers(model)
        self._read_layout(config, registered, fused_arrangement)
        self._tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self._layer0 = None
        self._layer0_loaded = False
        self._connect_sdk(sdk, lmcache_url, query_window, registered)
        self.post_completion = make_post_completion(self.vllm_url, self.model_name, timeout=timeout,
                                                    connect_timeout=min(self.http_timeout, 5.0))
        self.requests: list[_Request] = []
        self.metrics = RunMetrics("run")
        self.run_id = None

    @property
    def kv_budget_bytes(self) -> None:
        """Always None: the budget is in tokens here (`kv_budget_tokens`). vLLM chooses the cache's dtype
        (`vllm serve --dtype`), so a budget in bytes has no token count this engine knows; setting one raises
        ValueError."""
        return None

    @kv_budget_bytes.setter
    def kv_budget_bytes(self, value) -> None:
        raise ValueError("the lmcache engine takes its KV budget in tokens only (kv_budget_tokens): vLLM chooses its "
                         "cache's dtype (vllm serve --dtype), so a budget in bytes cannot be converted here")

    def _connect_servers(self, model: str | None) -> dict:
        """Both servers up, the model served and registered (clear errors before anything heavy): sets
        `model_name`, `max_model_len`, `model_source`, `chunk_size`, `lmcache_model_name`; returns LMCache's
        registered layouts by model name."""
        lmcache_health(self.lmcache_http_url, timeout=self.http_timeout)
        models = served_models(self.vllm_url, timeout=self.http_timeout)
        names = [m.get("id") for m in models]
        if model is None:
            if len(names) != 1:
                raise ValueError(f"vLLM at {self.vllm_url} serves {names}; pass model= to choose one")
            model = names[0]
        if model not in names:
            raise ValueError(f"vLLM at {self.vllm_url} does not serve {model!r}; it serves {names}")
        info = models[names.index(model)]
        self.model_name = model
        self.max_model_len = info.get("max_model_len")
        self.model_source = info.get("root") or model
        server_conf = http_json("GET", self.lmcache_http_url + "/config", timeout=self.http_timeout,
                                what="the LMCache server", hint=LMCACHE_START_HINT)
        try:
            self.chunk_size = int(server_conf["mp"]["chunk_size"])
        except (KeyError, TypeError, ValueError):
            raise ServerError(f"LMCache's /config at {self.lmcache_http_url} has no mp.chunk_size: "
                              f"{str(server_conf)[:300]}") from None
        status = http_json("GET", self.lmcache_http_url + "/status", timeout=self.http_timeout,
                           what="the LMCache server", hint=LMCACHE_START_HINT)
        registered = registered_models(status)
        self.lmcache_model_name = lmcache_model_name(model, self.model_source, registered)
        if self.lmcache_model_name is None:
            raise ValueError(
                f"LMCache has no KV layout registered for {model!r} (registered: {sorted(registered)}); vLLM registers "
                f"it at start-up when it runs with the LMCacheMPConnector pointing at this LMCache server: "
                f"{VLLM_START_HINT}")
        return registered

    def _read_layout(self, config, registered: dict, fused_arrangement: str) -> None:
        """Model facts from the served checkpoint (or `config`), cross-checked with the KV layout LMCache
        registered: sets `config`, `facts`, `engine_kv_format`, `block_size`, `fused`, `fused_arrangement`."""
        model = self.model_name
        self.config = config if config is not None else self._load_config(self.model_source)
        self.facts = model_facts(self.config)
        layout = registered[self.lmcache_model_name].get("kv_cache_layout") or {}
        if layout.get("num_layers") not in (None, self.facts.num_layers):
            raise ValueError(f"LMCache's layout for {model!r} has {layout['num_layers']} layers but the model config "
                             f"has {self.facts.num_layers}; config= belongs to another model")
        group = (layout.get("kernel_groups") or [{}])[0]
        self.engine_kv_format = group.get("engine_kv_format")
        self.block_size = int(group.get("tokens_per_block") or 0)
        self.fused = self.engine_kv_format in FUSED_FORMATS
        self.fused_arrangement = fused_arrangement if self.fused else None
        if self.fused and (self.block_size < 1 or self.chunk_size % self.block_size):
            raise ServerError(f"LMCache's layout for {model!r} has {self.block_size} tokens per block, which does not "
                              f"divide its chunk size {self.chunk_size}; the fused K/V layout cannot be read")

    def _connect_sdk(self, sdk, lmcache_url: str, query_window: int | None, registered: dict) -> None:
        """The SDK (imported only now when `sdk` is None) and its KV (and, unless `query_window=0`, query)
        contexts: sets `sdk`, `kv_ctx`, `q_ctx`, `query_unavailable`."""
        layout = registered[self.lmcache_model_name].get("kv_cache_layout") or {}
        if sdk is None:
            try:
                from lmcache import sdk  # type: ignore
            except ImportError as exc:
                raise ImportError("the lmcache engine needs LMCache's SDK: pip install 'tdutils[lmcache]' "
                                  f"(or pip install lmcache) in this environment ({exc})") from exc
        self.sdk = sdk
        try:
            self.kv_ctx = sdk.connect(sdk.LMCacheSDKCacheKind.KV, lmcache_url, self.lmcache_http_url,
                                      self.lmcache_model_name, timeout=self.http_timeout)
        except Exception as exc:
            # Keep LMCache's own exception (type and message) and say which layout it was given.
            formats = sorted({g.get("engine_kv_format", "?") for g in layout.get("kernel_groups") or []})
            exc.add_note(f"tdutils: LMCache's SDK could not connect to the KV cache vLLM registered for "
                         f"{self.lmcache_model_name!r} (engine KV format {', '.join(formats) or 'unknown'}). "
                         f"For the fused K/V layout of vLLM's CPU backend (NL_X_NB_NH_BS_CS), lmcache 0.5.6 "
                         f"needs tdutils' layout patch in the environment of the LMCache server and of this "
                         f"client: python -m tdutils patches apply --target lmcache (docs/design.md §6).")
            raise
        self.q_ctx = None
        self.query_unavailable = None
        if query_window != 0:
            try:
                self.q_ctx = sdk.connect(sdk.LMCacheSDKCacheKind.QUERY, lmcache_url, self.lmcache_http_url,
                                         self.lmcache_model_name, timeout=self.http_timeout)
            except Exception as exc:  # noqa: BLE001 (policies without queries still run; the reason is kept)
                self.query_unavailable = (f"no query context ({exc.__class__.__name__}: {exc}); start LMCache with "
                                          f"--enable transfer_query and vLLM patched (python -m tdutils patches "
                                          f"apply) with lmcache.mp.transfer_intermediate_tensors")
                warnings.warn(f"lmcache engine: {self.query_unavailable}", stacklevel=2)
        if int(self.kv_ctx.chunk_size) != self.chunk_size:
            raise ServerError(f"LMCache /config says chunk_size {self.chunk_size} but the SDK context uses "
                              f"{self.kv_ctx.chunk_size}")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _load_config(source: str):
        from transformers import AutoConfig

        path = resolve_model(source, check=False).target  # a bundled name's folder, else the source
        try:
            return AutoConfig.from_pretrained(str(path))
        except OSError as exc:
            raise OSError(f"could not load the config of the served model {source!r} ({exc}); pass config= (and "
                          f"tokenizer=), e.g. from AutoConfig.from_pretrained(LOCAL_DIR)") from exc

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_source)
        return self._tokenizer

    def _pad_id(self) -> int:
        if self.pad_token_id is None:
            tok = self.tokenizer
            pid = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            if pid is None:
                raise ValueError("the tokenizer has neither a pad nor an EOS token; pass pad_token_id=")
            self.pad_token_id = int(pid)
        return self.pad_token_id

    def _aligned(self, ids: list[int]) -> tuple[list[int], int]:
        """`ids` front-padded to a multiple of the chunk size (after a leading BOS), and the pad count."""
        if self.align == "none":
            return list(ids), 0
        n_pad = (-len(ids)) % self.chunk_size
        if n_pad == 0:
            return list(ids), 0
        pad = [self._pad_id()] * n_pad
        bos = getattr(self.config, "bos_token_id", None)
        if bos is not None and ids[0] == bos:
            return [ids[0], *pad, *ids[1:]], n_pad
        return pad + list(ids), n_pad

    def _contexts(self):
        return [c for c in (self.kv_ctx, self.q_ctx) if c is not None]

    def _run_streams(self, prompts: list[tuple[list[int], str]], params: dict, needs: list[int] | None,
                     phase: str):
        """Generate on every (prompt, salt) concurrently through SDK request streams.

        Returns `(streams, perfs, starts, seconds, peak, peak_reserved)`: the streams, their
        `StreamPerfMetrics`, each stream's start (s after the phase start), wall seconds, the peak number
        running at once, and the peak of the summed `needs` of running requests (0 without a budget).
        """
        budget = self.kv_budget_tokens if needs is not None else None
        streams = [self.sdk.request.create_request(self._contexts(), self.post_completion, ids, cache_salt=salt)
                   for ids, salt in prompts]
        n = len(streams)
        perfs, starts, errors = [None] * n, [0.0] * n, {}
        cond = threading.Condition()
        state = {"reserved": 0, "running": 0, "peak": 0, "peak_reserved": 0}
        t0 = time.perf_counter()

        def run(i):
            try:
                starts[i] = time.perf_counter() - t0
                perfs[i] = streams[i].generate(dict(params))
            except Exception as exc:  # noqa: BLE001 (collected; the first is raised after all threads end)
                errors[i] = exc
            finally:
                with cond:
                    state["reserved"] -= needs[i] if budget is not None else 0
                    state["running"] -= 1
                    cond.notify_all()

        with ThreadPoolExecutor(max_workers=max(1, min(n, self.max_batch_size or n))) as pool:
            for i in range(n):
                with cond:  # first come, first served admission, as the hf engine does
                    while state["running"] and not admits(state["reserved"], needs[i] if budget is not None else 0,
                                                          state["running"], budget, self.max_batch_size):
                        cond.wait()
                    state["reserved"] += needs[i] if budget is not None else 0
                    state["running"] += 1
                    state["peak"] = max(state["peak"], state["running"])
                    state["peak_reserved"] = max(state["peak_reserved"], state["reserved"])
                pool.submit(run, i)
        seconds = time.perf_counter() - t0
        if errors:
            i = min(errors)
            exc = errors[i]
            root = exc
            while root.__cause__ is not None and not isinstance(root, CompletionError):
                root = root.__cause__
            if isinstance(root, CompletionError):
                raise root
            raise RuntimeError(f"{phase}: request {i} failed ({len(errors)} of {n} failed): {exc}") from exc
        return streams, perfs, starts, seconds, state["peak"], state["peak_reserved"]

    # ------------------------------------------------------------------ phases
    def prefill(self, prompts) -> list[int]:
        """Prefill every prompt on vLLM (max_tokens=1); LMCache stores each request's KV (and queries).

        Clears LMCache's cache first (`clear_cache`) and starts a new run: a new prefill salt (shared by the
        run's unedited prompts: the same tokens have the same KV) and new per-request edit salts.

        Args:
            prompts: strings, `PromptRow`s, dicts with `prompt`, or lists of token ids.

        Returns:
            Each request's cached prompt length T (after front padding). The KV stays in LMCache (a long
            request's KV is GBs); `kv(i)` / `tensors(i)` fetch one request's.

        Raises:
            ValueError: a prompt longer than vLLM's max_model_len.
            CompletionError / ServerError: vLLM or LMCache failed.
        """
        ids = self.tokenize(prompts)
        if self.clear_cache:
            http_json("POST", self.lmcache_http_url + "/cache/clear", timeout=self.http_timeout,
                      what="the LMCache server", hint=LMCACHE_START_HINT)
        self.run_id = uuid.uuid4().hex[:16]
        self._salt_prefill = f"tdutils-{self.run_id}-prefill"
        self.requests, self.metrics = [], RunMetrics("run")
        for i, x in enumerate(ids):
            tokens, pad = self._aligned(x)
            check_prompt_fits(i, len(tokens), pad, self.max_model_len)
            self.requests.append(_Request(i, x, tokens, self._salt_prefill, len(tokens), pad))
        params = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        _, perfs, starts, seconds, _, _ = self._run_streams([(r.tokens, r.salt) for r in self.requests], params, None,
                                                         "prefill")
        pm = self.metrics.prefill
        for r, perf, start in zip(self.requests, perfs, starts):
            r.ttft_s = start + float(getattr(perf, "ttft", 0.0))  # from the start of the phase, as on hf
        pm.requests, pm.tokens, pm.seconds = len(ids), sum(len(r.tokens) for r in self.requests), seconds
        pm.ttft_s = [r.ttft_s for r in self.requests]
        return [len(r.tokens) for r in self.requests]

    def _retrieve(self, ctx, tokens: list[int], salt: str, rows: int, what: str) -> torch.Tensor:
        """Poll `ctx.retrieve` until it returns `rows` tokens (vLLM stores asynchronously)."""
        deadline = time.perf_counter() + self.retrieve_timeout
        got = None
        while True:
            got = ctx.retrieve(tokens, salt)
            if got is not None and got.shape[-2] >= rows:
                return got
            if time.perf_counter() >= deadline:
                have = 0 if got is None else got.shape[-2]
                raise TimeoutError(f"LMCache holds {have} of the {rows} {what} tokens of this request after "
                                   f"{self.retrieve_timeout:g}s (retrieve_timeout)")
            time.sleep(0.05)

    def edit_salt(self, request_id: int) -> str:
        """The cache salt request `request_id`'s edited KV is stored under in this run: its own, never shared
        with another request (whose kept tokens may share leading chunks but not their KV) nor another run."""
        return f"tdutils-{self.run_id}-edit-{int(request_id)}"

    def tokens(self, request_id: int) -> list[int]:
        """The token ids the request's current cache holds (the padded prompt, or the kept tokens)."""
        self._require_requests("tokens()")
        r = self.requests[request_id]
        return list(r.tokens[:r.cached])

    def kv(self, request_id: int) -> torch.Tensor:
        """The request's current cached KV `[2, L, T, D]` (chunk-aligned), fetched from LMCache (CPU)."""
        self._require_requests("kv()")
        r = self.requests[request_id]
        rows = (r.cached // self.chunk_size) * self.chunk_size
        kv = self._retrieve(self.kv_ctx, r.tokens[:r.cached], r.salt, rows, "KV")
        return self._check_kv_layout(self._from_lmcache(kv[:, :, :rows], r.tokens[:rows]))

    def _prepare_capture(self, need, drop_fns) -> None:
        """Query-free policies (`needs="kv"`) need nothing: they run without the vLLM query patch and without
        LMCache's `transfer_query` (open the engine with `query_window=0`); a policy that needs queries on an
        engine without a query context raises ValueError."""
        if self.q_ctx is None:
            why = self.query_unavailable or "the engine was opened with query_window=0"
            names = [f.name for f in drop_fns]
            raise ValueError(f"{', '.join(names)} needs query tensors, but this lmcache engine has none ({why}); "
                             f"use a query-free policy (tdutils.policies.policy_names('kv')) or open the engine with "
                             f"query_window=None or >= {need} against a patched vLLM and LMCache --enable transfer_query")

    def query(self, request_id: int) -> torch.Tensor | None:
        """The request's query rows `[L, Tq, Hq*d]` (aligned to the end of its unedited KV), or None after an
        edit or without a query context."""
        self._require_requests("query()")
        r = self.requests[request_id]
        if self.q_ctx is None or r.edited or self.query_window == 0:
            return None
        rows = (len(r.tokens) // self.chunk_size) * self.chunk_size
        return self._fetch_query(r, rows)

    def tensors(self, request_id: int) -> dict:
        """What a drop function receives for one request: `{CacheKind.KV: kv[, CacheKind.QUERY: q]}`."""
        kv = self.kv(request_id)
        out = {CacheKind.KV: kv}
        q = self.query(request_id)
        if q is not None:
            out[CacheKind.QUERY] = q
        return out

    def _from_lmcache(self, raw: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """What the SDK retrieved -> `[2, L, T, D]`: unchanged for split K/V layouts; for a fused K/V layout
        re-shaped by `kvlayout.fused_to_kv` (the arrangement decided on the first call, see `fused_arrangement`).

        Raises:
            ValueError: `"auto"` found no arrangement whose layer-0 keys match the model's (e.g. vLLM serving
                bfloat16 on the CPU, which packs its blocks differently: serve float32).
        """
        if not self.fused:
            return raw
        f = self.facts
        geometry = {"block_size": self.block_size, "num_kv_heads": f.num_kv_heads, "head_dim": f.head_dim}
        if self.fused_arrangement == "auto":
            if self._layer0_checker() is None:
                self.fused_arrangement = "kt_v"
            else:
                tried = {}
                for arrangement in ARRANGEMENTS:
                    kv = fused_to_kv(raw, arrangement=arrangement, **geometry)
                    tried[arrangement] = self._key_match(kv, tokens)
                    if tried[arrangement] >= 0.95:
                        self.fused_arrangement = arrangement
                        return kv
                raise ValueError(f"the fused K/V cache LMCache returned matches no known arrangement (layer-0 key "
                                 f"cosine per arrangement: { {a: round(s, 3) for a, s in tried.items()} }); vLLM's CPU "
                                 f"backend is known to pack float32 caches only: serve with --dtype float32 (docs/design.md §6)")
        return fused_to_kv(raw, arrangement=self.fused_arrangement, **geometry)

    def _to_lmcache(self, kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """`(kv [2, L, k, D], tokens)` -> what the SDK's `store` takes: for a fused layout the chunk-aligned
        prefix (the SDK stores whole chunks only) in LMCache's fused rows, `[1, L, k', 2D]`, with its tokens."""
        if not self.fused:
            return kv, tokens
        n = (kv.shape[2] // self.chunk_size) * self.chunk_size
        f = self.facts
        fused = kv_to_fused(kv[:, :, :n], block_size=self.block_size, num_kv_heads=f.num_kv_heads,
                            head_dim=f.head_dim, arrangement=self.fused_arrangement)
        return fused, list(tokens[:n])

    def _layer0_checker(self):
        if not self._layer0_loaded:
            self._layer0 = _Layer0.load(self.model_source, self.config)
            self._layer0_loaded = True
            if self._layer0 is None:
                warnings.warn(f"lmcache engine: cannot read layer-0 weights of {self.model_source!r} locally; query and "
                              f"key rows get shape and value checks only", stacklevel=4)
        return self._layer0

    def _key_match(self, kv: torch.Tensor, tokens: Sequence[int], n_rows: int = 8) -> float:
        """Lowest cosine, over a spread of rows and every KV head, between layer-0 keys of `kv` and the model's."""
        f = self.facts
        T = kv.shape[2]
        rows = sorted({min(T - 1, i * T // n_rows + (T // n_rows) // 2) for i in range(n_rows)})
        _, k0 = self._layer0.qk([int(tokens[p]) for p in rows], rows)
        return min(_cosine(kv[0, 0, p].view(f.num_kv_heads, f.head_dim), k0[j]).min().item() for j, p in enumerate(rows))

    def _check_kv_layout(self, kv: torch.Tensor) -> torch.Tensor:
        f = self.facts
        if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != f.num_layers or kv.shape[3] != f.kv_dim:
            raise ValueError(
                f"LMCache returned KV of shape {tuple(kv.shape)}, expected [2, {f.num_layers}, T, {f.kv_dim}] for "
                f"this model (LMCache's layout: engine KV format {self.engine_kv_format}, {self.block_size} tokens "
                f"per block); a [1, L, T, 2D] tensor is a fused K/V layout (docs/design.md §6)")
        return kv

    def _fetch_query(self, r: _Request, rows: int) -> torch.Tensor:
        try:
            q = self._retrieve(self.q_ctx, r.tokens[:rows], r.salt, rows, "query")
        except TimeoutError as exc:
            raise TimeoutError(
                f"{exc}: query capture is incomplete. Check that vLLM is patched (python -m tdutils patches check), "
                f"runs with lmcache.mp.transfer_intermediate_tensors, LMCache with --enable transfer_query, and "
                f"that --max-num-batched-tokens is at least the longest prompt (queries of a prompt prefilled "
                f"in several steps are not captured)") from None
        q = q[0] if q.dim() == 4 and q.shape[0] == 1 else q
        f = self.facts
        if q.dim() != 3 or q.shape[0] != f.num_layers or q.shape[2] != f.num_query_heads * f.head_dim:
            raise ValueError(f"LMCache returned queries of shape {tuple(q.shape)}, expected "
                             f"[1, {f.num_layers}, T, {f.num_query_heads * f.head_dim}]")
        q = q[:, :rows]
        if self.query_window is not None:
            q = q[:, -self.query_window:]
        return q

    def check_query_rows(self, kv: torch.Tensor, q: torch.Tensor | None, tokens: Sequence[int],
                         *, threshold: float = 0.95) -> str:
        """Check a few key and query rows against the tokens they belong to; returns how (for logs).

        Always: shapes, finite values, no all-zero rows (an unwritten ring slot). When the checkpoint is
        readable locally (`_Layer0`): layer 0's keys and queries of `check_rows` tokens (the last ones and
        a spread) are recomputed and must match the retrieved rows (cosine >= `threshold` for every head),
        which catches rows of another token or position (shifted or mixed-up rows).

        Raises:
            QueryCheckError: a check failed (the message names the row, layer 0, and the similarity).
        """
        n_rows = self.check_rows
        if n_rows <= 0:
            return "off"
        T = kv.shape[2]
        rows = sorted({T - 1 - i * max(1, T // n_rows) for i in range(n_rows)} & set(range(T)))
        if q is not None:
            tq = q.shape[1]
            if tq > T:
                raise QueryCheckError(f"{tq} query rows for {T} KV tokens; queries must be aligned to the end of the KV")
            q_rows = [T - 1 - i for i in range(min(n_rows, tq))]
            sample = q[:, [p - (T - tq) for p in q_rows]]
            if not bool(torch.isfinite(sample).all()) or bool((sample.float().abs().sum(-1) == 0).any()):
                raise QueryCheckError(f"query rows {q_rows} hold zeros or non-finite values (unwritten ring slots?)")
        sample_k = kv[0][:, rows]
        if not bool(torch.isfinite(sample_k).all()):
            raise QueryCheckError(f"key rows {rows} hold non-finite values")
        if self._layer0_checker() is None:
            return "shape"
        f = self.facts
        positions = rows if q is None else sorted(set(rows) | set(q_rows))
        q0, k0 = self._layer0.qk([int(tokens[p]) for p in positions], positions)
        for j, p in enumerate(positions):
            if p in rows:
                sim = _cosine(kv[0, 0, p].view(f.num_kv_heads, f.head_dim), k0[j]).min().item()
                if sim < threshold:
                    raise QueryCheckError(f"the cached key of token {p} does not match token id {tokens[p]} at position "
                                          f"{p} (layer 0, cosine {sim:.3f} < {threshold}); KV rows are mixed up")
            if q is not None and p in q_rows:
                row = q[0, p - (T - q.shape[1])].view(f.num_query_heads, f.head_dim)
                sim = _cosine(row, q0[j]).min().item()
                if sim < threshold:
                    raise QueryCheckError(f"query row {p - (T - q.shape[1])} (token {p}) does not match token id "
                                          f"{tokens[p]} at position {p} (layer 0, cosine {sim:.3f} < {threshold}); "
                                          f"query rows are mixed up or shifted")
        return "layer0"

    def modify(self, drop_fn, *, positions: str | None = None, on_error: str = "raise"):
        """`Engine.modify` on what LMCache holds.

        Per request: retrieve the KV `[2, L, T, D]` (T = the padded prompt; with `align="none"` its
        chunk-aligned prefix) and the last `query_window` query rows `[L, Tq, Hq*d]` (none for a query-free
        drop function, `needs="kv"`, which so never waits for queries an unpatched vLLM does not send), check rows
        (`check_query_rows`), call the drop function, validate its output (`validate_drop_output`) and
        store it under the request's own edit salt (`edit_salt`). Requests switch to their edited cache only after all of
        them were processed (with `on_error="raise"`, only if none failed). A prompt shorter than one LMCache
        chunk has nothing cached: that request fails ("nothing to edit").

        Args:
            drop_fn: an LMCache-style ModifyFn (e.g. `tdutils.make_drop_fn(..., rerotate=True)`).
            positions: only `"compact"` (or None).
            on_error: as `Engine.modify`.

        Raises:
            RuntimeError: called before `prefill`, twice in one run, or after `extend` before `decode`.
            ValueError: bad arguments, a drop function with `rerotate=False`, KV of an unexpected layout.
            QueryCheckError: retrieved rows do not belong to the request's tokens.
            TimeoutError: LMCache did not get the request's KV (or queries) within `retrieve_timeout`.
            DropFunctionError: with `on_error="raise"`.
        """
        return super().modify(drop_fn, positions=positions, on_error=on_error)

    # ------------------------------------------------------------------ modify's hooks (the flow is Engine.modify)
    def _check_modify(self, drop_fn, positions):
        if positions not in (None, "compact"):
            raise ValueError(f"the lmcache engine supports positions='compact' only, got {positions!r}")
        if pending := [r.request_id for r in self.requests if len(r.tokens) > r.cached]:
            # The extension reaches LMCache only when decode sends it to vLLM: nothing to retrieve yet.
            raise RuntimeError(f"requests {pending} were extended and not decoded yet: the lmcache engine edits only what "
                               f"LMCache holds, so call decode() before another modify(), or modify before extend()")
        if drop_fn.rerotate is False:
            raise ValueError("vLLM decodes the kept tokens at compact positions, so the drop function must re-rotate "
                             "keys; build it with make_drop_fn(..., rerotate=True)")
        if drop_fn.granularity != "request":
            raise ValueError(f"the lmcache engine stores one token list per request (LMCache keys its chunks by the "
                             f"request's tokens), so it takes granularity='request' only, got {drop_fn.granularity!r}; "
                             f"use the hf engine for per-layer or per-head sets")
        if any(r.edited for r in self.requests):
            raise RuntimeError("this run's caches were already modified; call prefill(prompts) to start a new run")
        # a query-free policy (needs="kv") never waits for query rows, which an unpatched vLLM never sends
        self._reads_query = drop_fn.needs != "kv"
        return "compact"

    def _cache_length(self, request_id):
        return len(self.requests[request_id].tokens)

    def _edit_input(self, request_id, drop_fn):
        r = self.requests[request_id]
        rows = (len(r.tokens) // self.chunk_size) * self.chunk_size
        if rows == 0:  # shorter than one chunk: nothing is cached, nothing to edit
            return f"prompt of {len(r.tokens)} tokens is shorter than one LMCache chunk ({self.chunk_size}); nothing to edit"
        raw = self._retrieve(self.kv_ctx, r.tokens[:rows], r.salt, rows, "KV")[:, :, :rows]
        tokens = r.tokens[:rows]
        kv = self._check_kv_layout(self._from_lmcache(raw, tokens))
        check_kv(kv, tokens)
        q = None
        if self.q_ctx is not None and self.query_window != 0 and self._reads_query:
            q = self._fetch_query(r, rows)
        self.check_query_rows(kv, q, tokens)
        tensors = {CacheKind.KV: kv}  # retrieved for this call only: the drop function may edit it
        if q is not None:
            tensors[CacheKind.QUERY] = q
        return tensors, tokens, kv

    def _failure_note(self, request_id, tensors):
        if CacheKind.QUERY not in tensors and self.query_unavailable:
            return f" [queries were not available: {self.query_unavailable}]"
        return ""

    def _edit_stage(self, request_id, new_kv, new_tokens, keep):
        # The request's edit salt is used by nobody until the switch, so storing now changes nothing that anyone
        # reads; a failure later leaves these entries unreachable (cleared next run).
        if not self.kv_ctx.store(*self._to_lmcache(new_kv, new_tokens), self.edit_salt(request_id)):
            warnings.warn(f"request {request_id}: LMCache reports the edited KV as already cached", stacklevel=3)
        r = self.requests[request_id]
        rows = (len(r.tokens) // self.chunk_size) * self.chunk_size
        return new_tokens + r.tokens[rows:]  # the unaligned tail (align="none") stays as is

    def _edit_commit(self, request_id, staged, positions):
        r = self.requests[request_id]
        r.tokens = staged
        r.cached = len(r.tokens)
        r.salt = self.edit_salt(request_id)
        r.edited = True

    def extend(self, prompts) -> list[int]:
        """Append tokens to every request (the query-agnostic flow, docs/design.md §3: prefill(context) -> modify ->
        extend(question) -> decode).

        Nothing is sent now: each request's decode prompt becomes its cached tokens (the kept tokens after an
        edit) followed by the extension, under the same cache salt, so at `decode` vLLM loads the (edited) cached
        chunks from LMCache and prefills the extension on top of them at the next compact positions — the KV the
        `hf` engine's `extend` computes. `tokens(i)` keeps returning what LMCache holds (without the extension).
        A `modify` after `extend` and before `decode` would look for chunks LMCache does not hold yet (vLLM
        stores the extension's KV when `decode` prefills it): decode first.

        Args:
            prompts: one string (tokenized without special tokens: pass `" " + question`) or token-id list per
                request, in request order; each at least one token.

        Returns:
            Each request's decode prompt length (cached tokens + extension).

        Raises:
            RuntimeError: called before `prefill`.
            TypeError / ValueError: not one extension per request, an empty extension, a prompt that reaches
                vLLM's max_model_len, or one that leaves no KV token to decode into under `kv_budget_tokens`.
                Nothing is changed when any check fails.
        """
        self._require_requests("extend()")
        ext = tokenize_extensions(self.tokenizer, prompts, len(self.requests))
        for r, x in zip(self.requests, ext):
            check_extension_fits(r.request_id, len(r.tokens), len(x), self.kv_budget_tokens, self.max_model_len)
        for r, x in zip(self.requests, ext):
            r.tokens = r.tokens + x  # a new list: the cached prefix r.tokens[:r.cached] is unchanged
        return [len(r.tokens) for r in self.requests]

    def decode(self, max_tokens: int = 64, *, temperature: float = 0.0, ignore_eos: bool = True, seed: int = 0,
               keep_logits: bool = False, compression=None) -> list[RequestOutput]:
        """Decode `max_tokens` per request on vLLM from the (edited) caches; one `RequestOutput` per request.

        Each request's prompt is its current token list (kept tokens after an edit) with its current salt;
        vLLM loads the cached chunks from LMCache and recomputes the rest, so the first generated token
        already sees the edited cache.

        `compression` (a `tdutils.compression.Compression`, greedy only) runs the multi-round flow of LMCache's
        SDK, the `hf` engine's decode-time compression on the serving path: decode until a request's cache
        would hold `budget + buffer` entries, prefill what it fed on top of its cache (vLLM stores the new
        chunks' KV and queries in LMCache), retrieve them, cut to `budget` with the policy, store the kept KV
        under a new salt and continue from it with the last generated token. For a query-aware policy the kept
        prefix's query rows are stored as zeros (vLLM computes queries only for the chunks it computes, and LMCache
        returns chunks from the first on; the policy reads only the last `w`, computed ones); LMCache 0.5.6's SDK
        refuses to store query rows on vLLM-CPU (measured), so there only the KV-only policies run in rounds.
        Exact on the `hf` engine's cuts when `budget + buffer` and `budget` are multiples of the chunk size
        (LMCache stores whole chunks; a tail is recomputed by vLLM).

        Raises:
            RuntimeError: called before `prefill`.
            ValueError: `max_tokens < 1`, negative temperature, `keep_logits=True` (vLLM does not return
                logits), a request that alone needs more than `kv_budget_tokens`, or `compression` with
                sampling or with a query-aware policy and no query context.
        """
        self._require_requests("decode()")
        max_tokens = check_count(max_tokens, "max_tokens", 1)
        temperature = check_temperature(temperature)
        if keep_logits:
            raise ValueError("keep_logits is not available on the lmcache engine (vLLM streams token ids only)")
        if compression is not None:
            return self._decode_rounds(max_tokens, compression, temperature, ignore_eos)
        needs = [len(r.tokens) + int(max_tokens) for r in self.requests]
        budget = self.kv_budget_tokens
        if budget is not None:
            for r, need in zip(self.requests, needs):
                if need > budget:
                    raise request_budget_error(r.request_id, len(r.tokens), max_tokens, budget)
        params = {"max_tokens": int(max_tokens), "temperature": float(temperature), "ignore_eos": bool(ignore_eos)}
        if temperature > 0:
            params["seed"] = int(seed)
        streams, perfs, _, seconds, peak, peak_reserved = self._run_streams([(r.tokens, r.salt) for r in self.requests], params,
                                                             needs, "decode")
        dm = self.metrics.decode = DecodeMetrics(kv_budget_tokens=budget)
        dm.seconds, dm.peak_batch_size = seconds, peak
        dm.kv_peak_reserved_tokens = peak_reserved
        outputs = []
        for r, stream, perf in zip(self.requests, streams, perfs):
            tpot = list(getattr(perf, "tpot", []) or [])
            r.tpot_s = sum(tpot) / len(tpot) if tpot else float("nan")
            if tpot:
                dm.tpot_s.append(r.tpot_s)
            outputs.append(self._request_output(r, [int(t) for t in stream.tokens[len(r.tokens):]],
                                                getattr(stream, "output_text", ""), max_tokens, r.cached, dm, tpot=r.tpot_s))
        return outputs

    def _request_output(self, r: _Request, ids: list[int], text: str, max_tokens: int, cached: int,
                        dm: DecodeMetrics, compressions: list | None = None, tpot: float = float("nan")
                        ) -> RequestOutput:
        """The `RequestOutput` of request `r` that generated `ids` (`text`; its answer up to the first EOS;
        finish_reason "length" when it has `max_tokens`, else "stop"), its cache holding `cached` entries, `tpot`
        its mean seconds per output token after the first; books the output tokens in `dm`."""
        r.output_ids, r.text = ids, text
        dm.output_tokens += len(ids)
        return RequestOutput(
            request_id=r.request_id, prompt_tokens=len(r.prompt_ids) + r.pad, cached_tokens=cached,
            output_ids=list(ids), text=text, answer=answer_text(self.tokenizer, ids, self._eos_ids(), text),
            finish_reason="length" if len(ids) >= max_tokens else "stop", ttft_s=r.ttft_s, tpot_s=tpot,
            compressions=compressions)

    def _eos_ids(self) -> set[int]:
        """EOS ids as vLLM stops on them: the tokenizer's and the checkpoint config's (an int or a list)."""
        config_eos = getattr(self.config, "eos_token_id", None)
        eos = {self.tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos])}
        eos.discard(None)
        return eos

    def _decode_rounds(self, max_tokens: int, compression, temperature: float, ignore_eos: bool) -> list[RequestOutput]:
        """`decode(compression=...)`: rounds of decode -> prefill of what was fed -> cut -> store (see `decode`)."""
        if temperature > 0 and isinstance(compression, Compression):
            raise ValueError("decode-time compression on the lmcache engine is greedy only: every round is a new vLLM "
                             "request, whose sampler would restart from its seed; use temperature=0")
        cut = decode_cut(compression, self.config, rerotate=True)
        self._reads_query = cut.needs != "kv"
        if self._reads_query and (self.q_ctx is None or self.query_window == 0):
            raise ValueError(f"{cut.name} needs query tensors, but this lmcache engine has none "
                             f"({self.query_unavailable or 'query_window=0'})")
        top = compression.budget + compression.buffer  # cache entries at which a request is cut
        budget = self.kv_budget_tokens
        for r in self.requests:  # a request holds at most max(top, its cache) entries, + 1 it generates
            need = max(top, len(r.tokens)) + 1
            if budget is not None and need > budget:
                raise compressed_budget_error(r.request_id, need, top, len(r.tokens), budget)
        eos = self._eos_ids()
        dm = self.metrics.decode = DecodeMetrics(kv_budget_tokens=budget)
        state = {r.request_id: {"seq": list(range(len(r.tokens))), "T": len(r.tokens), "out": [], "events": [],
                                "done": False} for r in self.requests}
        rounds = 0
        while active := [r for r in self.requests if not state[r.request_id]["done"]]:
            # tokens each request generates before its cache (all it fed: its tokens, then all but the last
            # generated) holds `top` entries, or until it has max_tokens
            plan = {r.request_id: min(max(1, top - len(r.tokens) + 1), max_tokens - len(state[r.request_id]["out"]))
                    for r in active}
            for n in sorted(set(plan.values())):
                group = [r for r in active if plan[r.request_id] == n]
                needs = [len(r.tokens) + n for r in group]
                params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": bool(ignore_eos)}
                streams, _, _, seconds, peak, peak_reserved = self._run_streams(
                    [(r.tokens, r.salt) for r in group], params, needs if budget is not None else None, "decode")
                dm.seconds += seconds
                dm.peak_batch_size = max(dm.peak_batch_size, peak)
                dm.kv_peak_reserved_tokens = max(dm.kv_peak_reserved_tokens, peak_reserved)
                for r, stream in zip(group, streams):
                    st = state[r.request_id]
                    gen = [int(t) for t in stream.tokens[len(r.tokens):]]
                    st["round_start"] = len(st["out"])
                    st["out"] += gen
                    stop = not ignore_eos and any(t in eos for t in gen)
                    st["done"] = stop or len(st["out"]) >= max_tokens
                    st["fed"], st["pending"] = r.tokens + gen[:-1], gen[-1] if gen else None
            cuts = [r for r in active if not state[r.request_id]["done"]]
            if not cuts:
                break
            rounds += 1
            # vLLM stores the KV (and queries) of everything the requests fed, on top of their caches
            fed = [(state[r.request_id]["fed"], r.salt) for r in cuts]
            _, _, _, seconds, _, _ = self._run_streams(fed, {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
                                                        None, "decode (prefill of a round)")
            dm.seconds += seconds
            t1 = time.perf_counter()
            for r in cuts:
                st = state[r.request_id]
                r.tokens, r.cached = st["fed"], len(st["fed"])
                self._cut_request(r, cut, st, rounds)
            dm.compressions += len(cuts)
            dm.compress_seconds += time.perf_counter() - t1
            dm.seconds += time.perf_counter() - t1
        outputs = []
        for r in self.requests:
            st = state[r.request_id]
            ids = st["out"][:max_tokens]
            outputs.append(self._request_output(r, ids, self.tokenizer.decode(ids, skip_special_tokens=True),
                                                max_tokens, len(st["seq"]), dm, st["events"]))
        return outputs

    def _cut_request(self, r: _Request, cut, st: dict, round_no: int) -> None:
        """Retrieve the request's fed entries, cut them to the budget, store the kept KV under a new salt."""
        got = self._edit_input(r.request_id, cut)
        if isinstance(got, str):  # nothing cached to cut (a cache shorter than one LMCache chunk)
            raise RuntimeError(f"request {r.request_id}: {got}")  # noqa: TRY004 (a state error, not a type)
        tensors, tokens, reference = got
        new_kv, new_tokens, keep = cut.edit(tensors, list(tokens))
        new_kv, new_tokens = validate_drop_output(reference, tokens, (new_kv, new_tokens), vocab_size=self._vocab_size())
        salt = f"{self.edit_salt(r.request_id)}-round-{round_no}"  # kept sets of rounds may share leading tokens
        if self._reads_query:  # placeholder rows for the kept prefix: vLLM computes queries for new chunks only
            rows = (len(new_tokens) // self.chunk_size) * self.chunk_size
            if rows:
                f = self.facts
                try:
                    self.q_ctx.store(torch.zeros((1, f.num_layers, rows, f.num_query_heads * f.head_dim),
                                                 dtype=new_kv.dtype), list(new_tokens[:rows]), salt)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"LMCache's SDK could not store the query rows of request {r.request_id}'s kept prefix "
                        f"({exc}); without them the next round's queries cannot be retrieved (LMCache returns a "
                        f"request's chunks from its first one on). Decode-time compression on this LMCache runs "
                        f"the KV-only policies (knorm, keydiff, streaming_llm, random); the request's cache is as "
                        f"it was before this cut") from exc
        kv, kv_tokens = self._to_lmcache(new_kv, new_tokens)
        self.kv_ctx.store(kv, kv_tokens, salt)
        rows, n = len(tokens), len(r.tokens)
        # sequence indices (the cache at decode start, then the generated tokens) of the entries fed
        fed_seq = st["seq"] + [st["T"] + j for j in range(st["round_start"], len(st["out"]) - 1)]
        assert len(fed_seq) == n, (len(fed_seq), n)
        kept, event = cut_event(fed_seq, keep.tolist(), len(st["out"]), rows)
        st["events"].append(event)
        st["seq"] = kept + [st["T"] + len(st["out"]) - 1]  # the kept entries, then the pending token
        r.tokens = list(new_tokens) + list(r.tokens[rows:]) + [st["pending"]]
        r.cached, r.salt, r.edited = len(new_tokens), salt, True

    def close(self) -> None:
        """Close the HTTP client and the SDK contexts."""
        self.post_completion.close()
        for ctx in self._contexts():
            close = getattr(ctx, "close", None)
            if close is not None:
                close()
