"""Compression while the cache grows: a KV budget held during decoding (R-KV) and during chunked prefill.

R-KV (Cai et al. 2025, arXiv:2505.24133) holds each request's cache at a fixed budget while it decodes: new
tokens fill a buffer of `N`, and when the cache reaches `B + N` tokens the queries of its last `w` tokens score
it and it is cut back to `B` (R-KV's code: `B = 128`, `N = 128`, `w = 8`). `Compression` names that setting for
any registered policy whose inputs exist during decoding (the KV, or the queries of the last tokens); its drop function
(`Compression.drop_fn`, a `DropFn` keeping by budget) cuts one cache of `T > B` tokens to `B`.
`HFEngine.decode(compression=...)` runs it inside the batch; `HFEngine.prefill(prompts, chunk=C,
compression=...)` cuts after every chunk of `C` prompt tokens, so a prompt's cache never exceeds `B + C`.
`cache_sizes` turns a request's compression events into its cache length after every decode step; `fidelity`
(`kl_per_step`, `greedy_agreement`) compares a teacher-forced compressed decode with the full cache's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .checks import check_count
from .edit import DropFn, make_drop_fn
from .kvcache import CacheKind
from .models import model_facts, tiny_qwen3_config
from .policies import get_policy, policy_names

DEFAULT_WINDOW = 8  # R-KV's decode-time observation window (its run scripts: --window_size 8)


@dataclass(frozen=True)
class Compression:
    """A KV budget held while the cache grows (R-KV's decode-time setting, arXiv:2505.24133).

    Attributes:
        policy: a registered policy name (`tdutils.policies.policy_names()`) that scores from the KV or from
            the last `w` tokens' queries; policies that need every prompt query (`h2o`) cannot run while the
            cache grows (those queries are gone after the first cut).
        budget: `B`, tokens a request's cache is cut back to (>= 2, and > `window` when one is set).
        buffer: `N`, tokens the cache may grow by before the next cut (decode); >= the query rows the policy
            reads, so every cut is scored by queries computed after the previous one.
        window: `w`, passed as the policy's `window` parameter (the most recent tokens it always keeps; for
            snapkv and rkv also the queries that vote). Default 8, R-KV's decode setting; None keeps the
            policy's own default; policies without a `window` parameter ignore it.
        params: the policy's other parameters (`{"mix_lambda": 0.1}`); `window` belongs in `window`. Kept as a
            read-only copy (`types.MappingProxyType`), so the checked setting cannot change afterwards;
            `Compression` is frozen and hashable.

    Engines build the cut with the engine's positions (compact: kept keys re-rotated) and, before anything runs,
    try it once on a random cache of `budget + buffer` tokens (`Compression.drop_fn`): a policy whose keep count
    does not follow its drop ratio (`middle_chunk`, a user policy that keeps a fixed share) or whose protected
    tokens exceed the budget is refused there.

    Raises:
        ValueError: an unknown policy, a policy needing every prompt query, bad sizes, or bad `params` (the
            policy's own checks, run here so a bad value fails before anything is prefilled).
    """

    policy: str = "rkv"
    budget: int = 128
    buffer: int = 128
    window: int | None = DEFAULT_WINDOW
    params: Mapping = field(default_factory=dict)

    def __post_init__(self):
        check_count(self.budget, "budget", 2)
        check_count(self.buffer, "buffer", 1)
        if self.window is not None:
            check_count(self.window, "window", 0)
        if not isinstance(self.params, Mapping):
            raise TypeError(f"params must be a mapping of the policy's parameters, got {type(self.params).__name__}")
        # a read-only copy: changing the caller's dict afterwards would bypass the checks below
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        if "window" in self.params and self.window is not None:
            raise ValueError(f"window given twice (window={self.window}, params['window']={self.params['window']}); "
                             "pass it as window= only")
        pol = get_policy(self.policy)  # ValueError naming the known policies
        if pol.needs == "all":
            raise ValueError(f"policy {self.policy!r} scores with every prompt query; they do not exist while the "
                             "cache grows (after the first cut the dropped tokens' queries are gone). Use a policy "
                             "that reads the KV or the last tokens' queries (snapkv, rkv, tova, knorm, ...)")
        if pol.per_head_only:
            raise ValueError(f"policy {self.policy!r} keeps unequal counts per head (budgets that move), and a cache that "
                             "grows and is cut again needs one set per request; use a policy that keeps one (snapkv, "
                             "knorm, ...)")
        p = pol.make_params(**self.policy_params())  # the policy's own checks
        rows = pol.rows(p) or 0
        w = getattr(p, "window", 0) or 0
        if w >= self.budget:
            raise ValueError(f"budget {self.budget} must exceed the window {w} the policy always keeps")
        if rows > self.buffer:
            raise ValueError(f"buffer {self.buffer} is smaller than the {rows} query rows {self.policy!r} scores "
                             f"with: every cut must be scored by queries computed after the previous one; raise "
                             f"buffer or lower window")

    def __hash__(self) -> int:
        """Hashable (a frozen value: a dict key, a set member); TypeError when a `params` value is unhashable."""
        return hash((self.policy, self.budget, self.buffer, self.window, tuple(sorted(self.params.items()))))

    def __reduce__(self):  # copy / pickle: MappingProxyType itself cannot be pickled
        return (Compression, (self.policy, self.budget, self.buffer, self.window, dict(self.params)))

    def policy_params(self) -> dict:
        """The keyword parameters the policy is built with: `params`, plus `window` when set and accepted."""
        names = {f.name for f in dataclasses.fields(get_policy(self.policy).params)}
        out = dict(self.params)
        if self.window is not None and "window" in names and "window" not in out:
            out["window"] = self.window
        return out

    @property
    def query_rows(self) -> int:
        """Query rows of the last tokens a cut is scored with (0 for KV-only policies)."""
        pol = get_policy(self.policy)
        return pol.rows(pol.make_params(**self.policy_params())) or 0

    def drop_fn(self, *, model_config, rerotate: bool = True) -> DropFn:
        """The drop function that cuts a cache to `budget` with this policy: `make_drop_fn(policy,
        budget=budget, ...)`, tried once on a random cache of `budget + buffer` tokens (seeded; the model's
        shapes from `model_config`) so a policy that cannot hold the budget fails before anything is prefilled
        or decoded.

        Args:
            model_config: the model's facts (`engine.facts`), a loaded model or a config (`make_drop_fn`).
            rerotate: compact positions (kept keys re-rotated) or original ones.

        Raises:
            ValueError: the policy kept another number of tokens than the budget (the message says why that
                can be), or `make_drop_fn`'s errors.
        """
        fn = make_drop_fn(self.policy, budget=self.budget, model_config=model_config, rerotate=rerotate,
                          **self.policy_params())
        f = model_facts(model_config)
        n = self.budget + self.buffer
        g = torch.Generator().manual_seed(0)
        tensors = {CacheKind.KV: torch.randn((2, f.num_layers, n, f.num_kv_heads * f.head_dim), generator=g)}
        if fn.query_rows:
            tensors[CacheKind.QUERY] = torch.randn((f.num_layers, fn.query_rows, f.num_query_heads * f.head_dim),
                                                   generator=g)
        try:
            kept = fn.keep_indices(tensors, list(range(n))).numel()
        except RuntimeError:
            kept = None
        if kept != self.budget:
            raise ValueError(f"policy {self.policy!r} kept {kept if kept is not None else 'more'} of {n} tokens at "
                             f"drop ratio {fn.ratio_for(n):.4f} where the budget is {self.budget}: a cut must keep "
                             f"exactly the budget, so the policy's keep count has to follow its drop ratio "
                             f"(middle_chunk's does not) and its protected tokens (window, sinks) must fit the budget")
        return fn


def compression_policies() -> list[str]:
    """The registered policies that can hold a budget while the cache grows (`Compression`): those whose cut,
    tried on the bundled tiny model's shapes (`Compression(name, budget=64, buffer=64).drop_fn`), keeps the
    budget. Leaves out `h2o` (needs every prompt query) and `middle_chunk` (keeps a fixed share, not the
    budget); a policy registered later is tried the same way."""
    config, out = tiny_qwen3_config(64), []
    for name in policy_names():
        try:
            Compression(name, budget=64, buffer=64).drop_fn(model_config=config)
        except ValueError:
            continue
        out.append(name)
    return out

def cache_sizes(output) -> list[int]:
    """A request's KV length at each decode step, from `RequestOutput.compressions` (for plots).

    Entry `s - 1` is the number of cache entries step `s` attended over: the cache it started decoding from
    (`cached_tokens`, the refed token included) at step 1, one more every step, back to `after + 1` on the step
    after a cut. So with compression it is a sawtooth from `budget + 1` up to `budget + buffer` (the cut steps);
    its maximum over a decode is `metrics.decode.kv_peak_cache_tokens`.
    """
    sizes, n = [], output.cached_tokens - 1
    events = {e["step"]: e["after"] for e in (output.compressions or [])}
    for step in range(1, len(output.output_ids) + 1):
        n += 1
        sizes.append(n)
        n = events.get(step, n)
    return sizes


# ---------------------------------------------------------------- fidelity to the full cache (teacher forcing)
def kl_per_step(reference_logits, logits) -> torch.Tensor:
    """`KL(P_ref || P)` in nats at every step: how far a compressed cache's next-token distribution is from the
    full cache's.

    Args:
        reference_logits: the full cache's logits, a `[steps, vocab]` tensor or a sequence of `[vocab]` tensors
            (`RequestOutput.logits` of `decode(keep_logits=True)`).
        logits: the compressed run's logits at the same steps, same form; teacher-forced with the reference's
            tokens (`decode(forced_ids=...)`), so both distributions condition on the same prefix.

    Returns:
        A float64 tensor `[steps]`, each entry >= 0 (rounding below zero is clamped); 0 where the distributions
        are identical. Computed in float64 from log-softmax; tokens the reference gives probability 0 add 0.

    Raises:
        ValueError: different numbers of steps or vocabulary sizes, or no steps.
    """
    ref, mine = _logit_rows(reference_logits, "reference_logits"), _logit_rows(logits, "logits")
    if ref.shape != mine.shape:
        raise ValueError(f"reference_logits {tuple(ref.shape)} and logits {tuple(mine.shape)} must have the same "
                         "[steps, vocab] shape")
    log_p = torch.log_softmax(ref.double(), dim=-1)
    log_q = torch.log_softmax(mine.double(), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1).clamp_min(0.0)


def _logit_rows(logits, name: str) -> torch.Tensor:
    if isinstance(logits, torch.Tensor):
        rows = logits
    else:
        rows = torch.stack([torch.as_tensor(x) for x in logits]) if len(logits) else torch.empty(0, 0)
    if rows.ndim != 2 or rows.shape[0] == 0:
        raise ValueError(f"{name} must be [steps, vocab] (or one [vocab] tensor per step) with steps >= 1, got "
                         f"shape {tuple(rows.shape)}")
    return rows


def greedy_agreement(reference_ids: Sequence[int], ids: Sequence[int]) -> int:
    """Tokens two generations share before their first difference (the length of their common prefix): the
    greedy agreement of a compressed decode with the full cache's. Equal sequences give their length."""
    n = 0
    for a, b in zip(reference_ids, ids):
        if int(a) != int(b):
            break
        n += 1
    return n


def fidelity(reference, forced) -> dict:
    """Fidelity of a compressed decode to the full cache's, over a batch: greedy agreement and per-step KL.

    Args:
        reference: the full cache's `RequestOutput`s of a greedy `decode(..., keep_logits=True)`.
        forced: the compressed decode of the same requests teacher-forced with the reference's tokens
            (`decode(..., compression=..., keep_logits=True, forced_ids=[o.output_ids for o in reference])`).

    The greedy agreement is read from the forced run: the steps before its argmax first differs from the
    reference's token. A free-running greedy compressed decode feeds the very same tokens up to that step (and
    makes the same cuts, scored by the same queries), so it is the number of tokens the free-running decode
    shares with the reference (`greedy_agreement` of the two; tests/test_decode_compression.py checks it).

    Returns:
        `agreement` (per request), `agreement_mean`, `agreement_min`, `identical` (fraction of requests whose
        every token agrees), `kl_mean` / `kl_max` / `kl_p90` (nats, over every step of every request; the 90th
        percentile by nearest rank), `kl_mean_after_cut`
        (over the steps that attended over a cut cache: after each request's first cut; before it the caches
        are the full one's and the KL is 0; 0.0 when nothing was cut), `steps` (per request), `cuts` (total)
        and `first_cut` (the earliest step any request was cut at; None when none was).

    Raises:
        ValueError: different request counts, outputs without logits, or different step counts.
    """
    if len(reference) != len(forced) or not reference:
        raise ValueError(f"reference and forced must hold the same requests (at least one), got {len(reference)} and "
                         f"{len(forced)}")
    agreement, kls, after, steps, first, cuts = [], [], [], [], [], 0
    for ref, out in zip(reference, forced):
        if ref.logits is None or out.logits is None:
            raise ValueError(f"request {ref.request_id}: decode with keep_logits=True for both runs")
        kl = kl_per_step(ref.logits, out.logits)
        agreement.append(greedy_agreement(ref.output_ids, [int(x.argmax()) for x in out.logits]))
        events = out.compressions or []
        cuts += len(events)
        if events:
            first.append(events[0]["step"])
            after.append(kl[events[0]["step"]:])  # step s's logits were computed before its cut
        kls.append(kl)
        steps.append(len(kl))
    every = torch.cat(kls)
    after = torch.cat(after) if after else torch.zeros(0, dtype=torch.float64)
    return {"agreement": agreement, "agreement_mean": sum(agreement) / len(agreement),
            "agreement_min": min(agreement), "identical": sum(a == n for a, n in zip(agreement, steps)) / len(steps),
            "kl_mean": float(every.mean()), "kl_max": float(every.max()),
            "kl_p90": float(every.kthvalue(-(-9 * len(every) // 10)).values),  # rank ceil(0.9 n)
            "kl_mean_after_cut": float(after.mean()) if after.numel() else 0.0, "steps": steps, "cuts": cuts,
            "first_cut": min(first, default=None)}


__all__ = ["DEFAULT_WINDOW", "Compression", "cache_sizes", "compression_policies", "fidelity", "greedy_agreement",
           "kl_per_step"]
