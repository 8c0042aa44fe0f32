"""The policy registry: every token-selection policy is reachable by name through it.

A policy declares its name, a parameters dataclass (fields with defaults, each checked once in
`__post_init__`; `field(metadata={"help": ...})` is its `--help` text, see `tdutils.cli.policy_options`), what it
needs from the engine, and `keep(kv [2, L, T, D], q [L, Tq, Hq*d] | None, drop_ratio, *, params, facts) ->
sorted LongTensor [k]` (with `granularities=("request", "layer", "head")` also `keep(..., granularity=...)` ->
`[L, k]` / `[L, H_kv, k]`). `tdutils.make_drop_fn(name, ...)`, `python -m tdutils run --policy NAME`,
`passkey_eval`, `tdutils.sweep` and the notebooks look policies up here, so a policy is one file nothing else
has to know about; a user's own registers the same way (example: docs/policies.md, section "Your own
policy"). Errors: `ValueError` (unknown name or parameter, bad registration), `TypeError` (bad signature).
What a policy needs (`needs`) decides what the engines capture at prefill (memory: docs/policies.md):
- `"kv"`: the KV cache only; nothing is captured, and on the serving path (`lmcache` engine) the policy runs
  on a stock vLLM, without the query-export patch and without LMCache's `transfer_query`.
- `"window"`: the queries of the last `w` prompt tokens, `[L, w, Hq*d]` (`w = query_rows(params)`, by default
  `params.window`): SnapKV, R-KV, TOVA (`w = 1`).
- `"all"`: the queries of every prompt token, `[L, T, Hq*d]` (H2O), held until the request is edited.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

NEEDS = ("kv", "window", "all")

# keep(kv [2, L, T, D], q [L, Tq, Hq*d] | None, drop_ratio, *, params, facts) -> sorted LongTensor [k]
KeepFn = Callable[..., object]


@dataclass(frozen=True)
class Policy:
    """A registered policy.

    Attributes:
        name: the name `make_drop_fn`, `--policy` and `passkey_eval` use.
        params: a dataclass type; its fields (all with defaults) are the policy's parameters.
        needs: `"kv"`, `"window"` or `"all"` (see the module docstring).
        keep: `keep(kv, q, drop_ratio, *, params, facts) -> LongTensor [k]` of kept token indices, sorted
            ascending. `kv` is `[2, L, T, D]`; `q` is the captured query `[L, Tq, Hq*d]` (None when
            `needs="kv"` or when none was captured); `params` an instance of `params`; `facts` the model's
            `tdutils.models.ModelFacts` (head_dim, head counts), None when no model config was given.
        summary: one line for tables and `--help`.
        paper: the paper the policy implements, with its arXiv id ("" for baselines).
        needs_model: `keep` reads `facts` (head_dim, head counts); `make_drop_fn` then requires `model_config`.
        query_rows: for `needs="window"`, `query_rows(params) -> w` query rows needed (default `params.window`).
        setup: optional `setup(facts) -> dict` of extra keyword arguments for `keep`, computed once when the
            drop function is built (per-model values such as the model's attention arithmetic), not per request;
            `facts` is the model's `tdutils.models.ModelFacts` (`facts.rope`, `facts.attention`, `facts.config`).
        builtin: registered by tdutils itself (replacing it needs `replace=True`).
        granularities: the granularities the policy selects at (`tdutils.selection.GRANULARITIES`): `"request"`
            (one set `[k]`); with `"layer"` / `"head"` listed, `keep` also takes `granularity="layer" | "head"` and
            returns `[L, k]` / `[L, H_kv, k]` (docs/policies.md, "Granularity").
        head_scores: optional `head_scores(kv, q, *, params, facts, **setup) -> (scores fp32 [L, H_kv, T],
            protected BoolTensor [T])`: the policy's per-KV-head score (higher = keep) and its protected tokens,
            for the policies that allocate budgets on top of a scorer (AdaKV).
        per_head_only: the policy moves budget between heads or layers (AdaKV, PyramidKV), so it selects per KV head
            whatever granularity is asked for (`"request"`, every caller's default, gives its per-head sets;
            `"layer"` is refused); `keep` takes no `granularity` and may return unequal counts per head, padded
            (`tdutils.selection.pack_sets`).
    """

    name: str
    params: type
    needs: str
    keep: KeepFn
    summary: str = ""
    paper: str = ""
    needs_model: bool = True
    query_rows: Callable | None = None
    setup: Callable | None = None
    builtin: bool = False
    granularities: tuple = ("request",)
    head_scores: Callable | None = None
    per_head_only: bool = False

    def make_params(self, **values):
        """An instance of `params` from keyword values; ValueError on an unknown name (or a bad value,
        raised by the dataclass's own checks)."""
        known = {f.name for f in dataclasses.fields(self.params)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown parameters for policy {self.name!r}: {sorted(unknown)}; known: {sorted(known)}")
        return self.params(**values)

    def defaults(self) -> dict:
        """The parameters' default values, `{name: value}`."""
        return {f.name: f.default for f in dataclasses.fields(self.params)}

    def rows(self, params) -> int | None:
        """Query rows this policy needs with `params`: 0 (none), `w` (the last `w` prompt tokens) or None (all)."""
        if self.needs == "kv":
            return 0
        if self.needs == "all":
            return None
        return int(self.query_rows(params) if self.query_rows is not None else params.window)


_REGISTRY: dict[str, Policy] = {}


def register_policy(name: str, *, params: type, needs: str, keep: KeepFn, summary: str = "", paper: str = "",
                    needs_model: bool = True, query_rows: Callable | None = None, setup: Callable | None = None,
                    replace: bool = False, builtin: bool = False, granularities=("request",),
                    head_scores: Callable | None = None, per_head_only: bool = False) -> Policy:
    """Make a policy reachable by name everywhere (`make_drop_fn`, `--policy`, `passkey_eval`, notebooks).

    Args:
        name: the policy's name (letters, digits, `_`, `-`).
        params: a dataclass type whose fields, all with defaults, are the policy's parameters; validate
            values in its `__post_init__` so a bad value fails when the drop function is built.
        needs: `"kv"` (KV only), `"window"` (the last `w` prompt queries) or `"all"` (every prompt query).
        keep: `keep(kv, q, drop_ratio, *, params, facts) -> LongTensor [k]` (see `Policy`).
        summary, paper: one-line description and source.
        needs_model: `keep` reads the model facts (then `make_drop_fn` requires `model_config`).
        query_rows: for `needs="window"`, `query_rows(params) -> w` (default: `params.window`).
        setup: `setup(facts) -> dict` of extra keyword arguments for `keep`, computed once per drop function
            from the model's `ModelFacts` (requires `model_config`).
        replace: allow replacing a policy tdutils itself registers. A user's own policy may be registered
            again under its name (re-running a notebook cell) without it.
        builtin: for tdutils' own policies.
        granularities: the granularities `keep` selects at, `"request"` among them; `"layer"` / `"head"` mean
            `keep(..., granularity=...)` returns `[L, k]` / `[L, H_kv, k]` (see `Policy`).
        head_scores: the policy's per-KV-head scores, for budget allocators on top of it (see `Policy`).
        per_head_only: `keep` always returns per-head sets (budgets that move); see `Policy`.

    Returns:
        The registered `Policy`.

    Raises:
        ValueError: a bad name, `needs` or `granularities`, a parameter without a default, or a built-in name
            without `replace=True`.
        TypeError: `params` not a dataclass type, or `keep` not callable as `keep(kv, q, drop_ratio, *, params,
            facts)`.
    """
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"policy name must be a non-empty string of letters, digits, '_' or '-', got {name!r}")
    if needs not in NEEDS:
        raise ValueError(f"needs must be one of {NEEDS} (KV only, the last window's queries, all prompt queries), "
                         f"got {needs!r}")
    if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
        raise TypeError(f"params must be a dataclass type (its fields are the policy's parameters), got {params!r}")
    missing = [f.name for f in dataclasses.fields(params)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"every parameter of policy {name!r} needs a default; {missing} have none")
    if setup is not None and not callable(setup):
        raise TypeError(f"setup must be callable as setup(facts) -> dict, got {setup!r}")
    if not callable(keep):
        raise TypeError(f"keep must be callable as keep(kv, q, drop_ratio, *, params, facts), got {keep!r}")
    _check_keep_signature(name, keep, setup)
    if needs == "window" and query_rows is None and "window" not in {f.name for f in dataclasses.fields(params)}:
        raise ValueError(f"policy {name!r} needs window queries: give its params a 'window' field or pass query_rows=")
    granularities = tuple(granularities)
    if "request" not in granularities or set(granularities) - {"request", "layer", "head"}:
        raise ValueError(f"granularities of policy {name!r} must include 'request' and be among ('request', 'layer', "
                         f"'head'), got {granularities!r}")
    old = _REGISTRY.get(name)
    if old is not None and old.builtin and not replace:
        raise ValueError(f"policy {name!r} is built into tdutils; pass replace=True to replace it, or choose another name")
    if head_scores is not None and not callable(head_scores):
        raise TypeError(f"head_scores must be callable as head_scores(kv, q, *, params, facts), got {head_scores!r}")
    if per_head_only:
        granularities = ("request", "head")
    policy = Policy(name, params, needs, keep, summary, paper, needs_model, query_rows, setup, builtin, granularities,
                    head_scores, per_head_only)
    _REGISTRY[name] = policy
    return policy


def _check_keep_signature(name: str, keep: Callable, setup: Callable | None) -> None:
    """TypeError now, not at the first `modify`, when `keep` cannot be called as `modify` calls it:
    `keep(kv, q, drop_ratio, params=..., facts=...)` (plus `setup`'s keywords, unknown until a model is given)."""
    import inspect

    try:
        sig = inspect.signature(keep)
    except (TypeError, ValueError):  # some builtins and C callables have none to read
        return
    try:
        (sig.bind_partial if setup is not None else sig.bind)(None, None, 0.5, params=None, facts=None)
    except TypeError as exc:
        raise TypeError(f"policy {name!r}: keep{sig} cannot be called as keep(kv, q, drop_ratio, *, params, facts) "
                        f"({exc}); give it that signature (extra keyword arguments come from setup=)") from None


def unregister_policy(name: str) -> None:
    """Remove a user-registered policy. Raises ValueError for an unknown or built-in name."""
    policy = get_policy(name)
    if policy.builtin:
        raise ValueError(f"policy {name!r} is built into tdutils and cannot be removed")
    del _REGISTRY[name]


def get_policy(name: str) -> Policy:
    """The registered policy `name`. Raises ValueError naming the known policies when there is none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy {name!r}; choose one of {policy_names()}, register your own with "
                         f"tdutils.policies.register_policy, or pass a selection function") from None


def policy_names(needs: str | None = None) -> list[str]:
    """Registered policy names in registration order, optionally only those with the given `needs`."""
    return [p.name for p in _REGISTRY.values() if needs is None or p.needs == needs]


def query_window_for(*drop_fns, default: int | None = 64) -> int | None:
    """The query rows an engine must capture at prefill for these drop functions.

    Args:
        drop_fns: `DropFn`s (they declare `needs` and `query_rows`; `tdutils.edit.as_drop_fn` adapts a bare
            ModifyFn, whose needs are unknown), or None entries (the baseline).
        default: rows for drop functions that do not say what they need (`needs` None).

    Returns:
        0 when none needs queries (query-free policies: nothing is captured), None when one needs every
        prompt token's query (H2O), else the largest window.
    """
    rows = 0
    for fn in drop_fns:
        if fn is None:
            continue
        need = fn.query_rows if fn.needs is not None else default
        if need is None:
            return None
        rows = max(rows, int(need))
    return rows


__all__ = ["NEEDS", "Policy", "get_policy", "policy_names", "query_window_for", "register_policy",
           "unregister_policy"]
