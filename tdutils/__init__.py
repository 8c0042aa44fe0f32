"""tdutils: token dropping for long-context LLM decoding.

Drop the tokens a policy judges least useful from each request's KV cache after prefill, re-rotate the
surviving keys' RoPE, and decode more requests per batch. See README.md and docs/.
"""

# `python -m tdutils`: a Ctrl-C during the imports below (seconds) ends in one line, exit status 130 (stdlib only)
from .cli.startup import exit_on_interrupt_while_starting as _exit_on_interrupt

_exit_on_interrupt()
# after the Ctrl-C handler; policies is the policy registry (tdutils.policies.register_policy, policy_names)
from . import policies
from .compression import Compression
from .edit import DropFn, DropFunctionError, as_drop_fn, make_drop_fn
from .engines import compare, default_kv_budget, open_engine, run_once
from .kvcache import CacheKind
from .selection import keep_count

__version__ = "0.1.0"

__all__ = [
           "CacheKind",
           "Compression",
           "DropFn",
           "DropFunctionError",
           "__version__",
           "as_drop_fn",
           "compare",
           "default_kv_budget",
           "keep_count",
           "make_drop_fn",
           "open_engine",
           "policies",
           "run_once",
]
