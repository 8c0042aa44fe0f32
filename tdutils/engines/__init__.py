"""Engines that run prefill -> modify -> decode, by kind: `hf` (embedded transformers) and `lmcache` (vLLM +
LMCache serving). The contract is `tdutils.engines.base.Engine`; a module here that registers an engine
(`@register_engine("kind")`) is found by `open_engine` and `engine_kinds` without further edits."""

from __future__ import annotations

import importlib
import pkgutil

from ..outputs import ModifyReport, RequestOutput
from ..runs import RunResult, compare, default_kv_budget, run_once
from .base import _ENGINES, Engine, register_engine

_SCANNED = False


def _discover() -> None:
    """Import this package's modules once, so every engine they register is known (lazily: the serving engine's
    module is imported only when someone asks which engines exist)."""
    global _SCANNED
    if not _SCANNED:
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")
        _SCANNED = True


def engine_kinds() -> list[str]:
    """The registered engine kinds (`"hf"`, `"lmcache"`, and any other registered one)."""
    _discover()
    return sorted(_ENGINES, key=lambda k: (k != "hf", k))


def engine_class(kind: str) -> type[Engine]:
    """The `Engine` subclass registered as `kind` (its constructor says which settings it takes).

    Raises:
        ValueError: unknown kind (the message lists the known ones).
    """
    if kind not in _ENGINES:
        _discover()
    if kind not in _ENGINES:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {engine_kinds()}")
    return _ENGINES[kind]


def open_engine(kind: str = "hf", **settings) -> Engine:
    """Open an engine by kind: `open_engine("hf", model="tiny-qwen3", kv_budget_tokens=4096)`.

    Args:
        kind: `"hf"` — embedded Hugging Face transformers engine (CPU or GPU; `engines.hf.HFEngine` lists its
            settings: model, dtype, device, kv_budget_tokens, positions, ...); `"lmcache"` — the vLLM + LMCache
            serving path (`engines.lmcache.LMCacheEngine`: model, vllm_url, lmcache_url, query_window, ...);
            or any kind registered with `register_engine`.
        **settings: passed to the engine class.

    Raises:
        ValueError: unknown kind (the message lists the known ones).
        ConnectionError: `"lmcache"` with a server down (the message has the command that starts it).
        ImportError: `"lmcache"` without the lmcache package installed.
    """
    return engine_class(kind)(**settings)


__all__ = ["Engine", "ModifyReport", "RequestOutput", "RunResult", "compare", "default_kv_budget", "engine_class",
           "engine_kinds", "open_engine", "register_engine", "run_once"]
