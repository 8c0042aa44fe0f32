"""Engines that run prefill -> modify -> decode: `hf` (embedded transformers) and `lmcache` (serving)."""

from .base import ModifyReport, RequestOutput, RunResult, compare, default_kv_budget, open_engine, run_once

__all__ = ["ModifyReport", "RequestOutput", "RunResult", "compare", "default_kv_budget", "open_engine", "run_once"]
