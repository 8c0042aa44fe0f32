"""Passkey-retrieval accuracy of token-dropping policies: the CPU accuracy benchmark (issue 8).

Passkey retrieval (Mohtashami & Jaggi, "Landmark Attention: Random-Access Infinite Context Length for
Transformers", arXiv:2305.16300): a long filler context hides one needle `pass key = d d d d d .` at a
random depth and ends with the question `pass key =`; the answer is the five digits. The bundled model
`tiny-qwen3` is trained on exactly this task (`tools/train_tiny_model.py`), so a policy that drops the
needle loses the answer and one that keeps it does not: accuracy separates policies sharply (SPEC §8).

For every context length, `passkey_eval` builds `make_passkey_dataset(n, length, seed=seed)`, prefills
each chunk of prompts once on the embedded `hf` engine, and then for every policy and drop ratio
restores the prefilled caches, applies `make_drop_fn(policy, drop_ratio=r, ...)` (`modify`), decodes
`max_tokens` tokens greedily with EOS ignored, and scores the responses by exact match of the five digits
(`tdutils.answers.score_passkey`). Each cell gets its accuracy and a 95% Wilson score interval
(`tdutils.answers.wilson_interval`).

Policy names: `"full"` is the full cache (no `modify`; one row per length at drop ratio 0); any other
name goes to `tdutils.make_drop_fn` as it is, so every policy it knows (`random`, `middle_chunk`,
`snapkv`, and `rkv` once it lands) works here, and an unknown name fails with its error before anything
runs. Ratio 0 runs the policy's drop function too (it must return the cache unchanged, SPEC §5), so its
row should equal the full cache's: a cheap check of that contract.

Seeds (dataset seeds of `make_passkey_dataset`; each gives its own prompts), by use:

- `TRAIN_SEED_BASE` (10_000_000) and above: training streams of `tools/train_tiny_model.py`
  (`TRAIN_SEED_BASE + --seed`);
- `DEV_SEED` (0): development. The training script's final report uses it, so the fine-tune was chosen on it;
  it is the default here, in `python -m tdutils eval` and in `notebooks/compare_policies.ipynb`;
- 1-9: unit tests (the regression of `tests/test_accuracy.py` uses 1); 1234: the bundled sample
  (`tools/make_tiny_model.py`);
- `HELDOUT_SEED` (5_000_000): the published accuracy table only (`bench/accuracy.py`'s default). No training,
  selection or tuning step has seen it, and the training script refuses it as `--eval-seed`.

The bundled model is refused a training seed. The random policy draws its kept set from its own `seed`
(default 0): all prompts of one length share it, while the needle's depth varies per prompt.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

TRAIN_SEED_BASE = 10_000_000  # training streams of tools/train_tiny_model.py start here
DEV_SEED = 0  # development: the training script reports on it, so the fine-tune was chosen on it
HELDOUT_SEED = 5_000_000  # published accuracy table only; never used by training, selection or tests
FULL = "full"
DEFAULT_POLICIES = ("full", "random", "snapkv")
ALL = "all"  # command line: every registered policy
DEFAULT_DROP_RATIOS = (0.0, 0.25, 0.5, 0.75)
DEFAULT_CONTEXT_LENGTHS = (512, 1024, 2048)
COLUMNS = ("policy", "drop_ratio", "context_tokens", "n", "correct", "accuracy", "ci_low", "ci_high", "modify_s",
           "kept_tokens")


def wilson_interval(correct: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of `correct / n` as `(low, high)` in [0, 1]; `(nan, nan)` when n == 0.

    Thin wrapper over `tdutils.answers.wilson_interval` (which returns None for n == 0) so a table cell
    is always a pair of floats.
    """
    from .answers import wilson_interval as _wilson

    ci = _wilson(int(correct), int(n))
    return (math.nan, math.nan) if ci is None else ci


def passkey_eval(
    model="tiny-qwen3",
    policies: Sequence[str] = DEFAULT_POLICIES,
    drop_ratios: Sequence[float] = DEFAULT_DROP_RATIOS,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    *,
    n: int = 200,
    seed: int = DEV_SEED,
    max_tokens: int = 10,
    policy_params: Mapping[str, Mapping] | None = None,
    engine=None,
    batch_size: int = 50,
    device=None,
    dtype="auto",
    log: Callable[[str], None] | None = None,
    responses: dict | None = None,
):
    """Exact-match passkey accuracy for every (policy, drop ratio, context length) cell.

    Args:
        model: bundled name (`"tiny-qwen3"`), hub id or local folder; ignored when `engine` is given.
        policies: `"full"` (no dropping) and/or registered policy names for `tdutils.make_drop_fn`
            (`tdutils.policies.policy_names()`, including policies a user registered in this process).
        drop_ratios: fractions dropped, each in [0, 1]; `"full"` ignores them (one row at 0).
        context_lengths: prompt lengths in tokens (`make_passkey_dataset` fills to exactly this many with
            the bundled tokenizer; never more).
        n: prompts per context length (the same prompts for every policy and ratio).
        seed: dataset seed; must be below `TRAIN_SEED_BASE` for the bundled model. `DEV_SEED` (default) for
            development, `HELDOUT_SEED` for published figures only (module docstring, "Seeds").
        max_tokens: greedy decode tokens per request, EOS ignored (the answer is 5 tokens).
        policy_params: extra `make_drop_fn` keywords per policy, e.g. `{"snapkv": {"window": 32}}`.
        engine: an `HFEngine` to reuse (tests load the model once); else one is opened for `model`.
        batch_size: prompts prefilled and decoded together (bounds memory: each 2048-token request holds
            a ~2 MiB fp32 cache with the bundled model).
        device, dtype: for the engine opened here.
        log: called with one progress line per finished cell (e.g. `print`).
        responses: when a dict is given, filled with `{(policy, ratio, length): [decoded texts]}`.

    Returns:
        pandas DataFrame, one row per cell, in the order length → policy → ratio, with columns `policy`,
        `drop_ratio`, `context_tokens`, `n`, `correct`, `accuracy` (fraction in [0, 1]), `ci_low`,
        `ci_high` (95% Wilson), `modify_s` (seconds in `modify` for the cell's n requests; 0 for full),
        `kept_tokens` (mean KV tokens per request after modify).

    Raises:
        ValueError: no policies / ratios / lengths, a ratio outside [0, 1], `n < 1`, an unknown policy or
            parameter (from `make_drop_fn`), a training seed with the bundled model, or a context length
            too short for a passkey prompt.
    """
    import pandas as pd

    from .answers import score_passkey
    from .data import make_passkey_dataset
    from .edit import make_drop_fn
    from .selection import check_drop_ratio

    policies, lengths = list(policies), [int(x) for x in context_lengths]
    ratios = [check_drop_ratio(r) for r in drop_ratios]
    if not policies or not ratios or not lengths:
        raise ValueError("passkey_eval needs at least one policy, one drop ratio and one context length")
    for name, value in (("n", n), ("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    params = {k: dict(v) for k, v in (policy_params or {}).items()}
    if engine is None:
        from .engines.hf import HFEngine

        if model == "tiny-qwen3" and seed >= TRAIN_SEED_BASE:
            raise ValueError(f"seed {seed} is a training stream of the bundled model (>= {TRAIN_SEED_BASE}); "
                             f"evaluate with a seed below it")
        # query capture starts off; capture_for below widens it to what the policies need
        engine = HFEngine(model, device=device, dtype=dtype, kv_budget_tokens=None, prefill_batch_size=8,
                          query_window=0, progress=False)  # no bars, the model load's included
    elif getattr(engine, "model_name", None) == "tiny-qwen3" and seed >= TRAIN_SEED_BASE:
        raise ValueError(f"seed {seed} is a training stream of the bundled model (>= {TRAIN_SEED_BASE})")

    max_pos = getattr(engine.config, "max_position_embeddings", None)
    if max_pos and max(lengths) + max_tokens > max_pos:
        raise ValueError(f"context length {max(lengths)} + max_tokens {max_tokens} exceeds the model's {max_pos} "
                         f"positions (max_position_embeddings); use shorter context lengths")
    # Every (policy, ratio) cell and its drop function, built before any work so a bad name fails fast.
    cells: list[tuple[str, float, object]] = []
    for policy in policies:
        if policy == FULL:
            cells.append((FULL, 0.0, None))
            continue
        for r in ratios:
            cells.append((policy, r, make_drop_fn(policy, drop_ratio=r, model_config=engine.config,
                                                  **params.get(policy, {}))))
    if hasattr(engine, "capture_for"):  # capture the queries the policies read: none, a window, or all (H2O)
        engine.capture_for(*(fn for _, _, fn in cells))

    rows = []
    for length in lengths:
        data = make_passkey_dataset(n, length, tokenizer=engine.tokenizer, seed=seed)
        gold = [d["answer"] for d in data]
        texts = {(p, r): [] for p, r, _ in cells}
        modify_s = {(p, r): 0.0 for p, r, _ in cells}
        kept = {(p, r): 0 for p, r, _ in cells}
        t_len = time.perf_counter()
        for start in range(0, n, batch_size):
            chunk = data[start:start + batch_size]
            engine.prefill(chunk)
            saved = _snapshot(engine)
            for policy, r, fn in cells:
                _restore(engine, saved, chunk)
                if fn is not None:
                    engine.modify(fn)
                    modify_s[policy, r] += engine.metrics.modify.seconds
                outs = engine.decode(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                texts[policy, r] += [o.text for o in outs]
                kept[policy, r] += sum(o.cached_tokens for o in outs)
        for policy, r, _ in cells:
            report = score_passkey(gold, texts[policy, r])
            low, high = wilson_interval(report.correct, n)
            rows.append({"policy": policy, "drop_ratio": r, "context_tokens": length, "n": n,
                         "correct": report.correct, "accuracy": report.correct / n, "ci_low": low, "ci_high": high,
                         "modify_s": modify_s[policy, r], "kept_tokens": kept[policy, r] / n})
            if responses is not None:
                responses[policy, r, length] = list(texts[policy, r])
            if log is not None:
                log(f"{length:>6} tokens  {policy:>12} @ {r:<4g}  {report.correct:>4}/{n}  "
                    f"({100 * report.correct / n:5.1f}%, 95% CI {100 * low:.1f}-{100 * high:.1f})")
        if log is not None:
            log(f"{length:>6} tokens done in {time.perf_counter() - t_len:.1f} s")
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _snapshot(engine):
    """The engine's prefilled per-request state, so every policy starts from the same caches.

    `HFEngine.modify` and `decode` replace a request's fields (never edit tensors in place), so shallow
    copies of its request records are enough; prefilling once per chunk instead of once per cell saves
    most of the benchmark's time. Engines without such records return None and are prefilled again.
    """
    requests = getattr(engine, "requests", None)
    return None if requests is None else [copy.copy(r) for r in requests]


def _restore(engine, saved, prompts) -> None:
    if saved is None:
        engine.prefill(prompts)
    else:
        engine.requests = [copy.copy(r) for r in saved]


def format_table(table) -> str:
    """The table as text: accuracy and its 95% interval in percent, one row per cell."""
    t = table.copy()
    t["accuracy"] = (100 * t["accuracy"]).map("{:.1f}%".format)
    t["95% CI"] = [f"{100 * lo:.1f}-{100 * hi:.1f}" for lo, hi in zip(table["ci_low"], table["ci_high"])]
    t["modify_s"] = t["modify_s"].map("{:.3f}".format)
    t["kept_tokens"] = t["kept_tokens"].map("{:.0f}".format)
    cols = ["context_tokens", "policy", "drop_ratio", "n", "correct", "accuracy", "95% CI", "modify_s", "kept_tokens"]
    return t[cols].to_string(index=False)


def plot_accuracy(table, path: str | Path | None = None, *, title: str = "Passkey retrieval accuracy"):
    """Accuracy (%) vs drop ratio, one line per policy (95% interval shaded), one panel per context length.

    The full cache is drawn as a dashed horizontal line with its interval as a band. Returns the
    matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    lengths = sorted(table["context_tokens"].unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), sharey=True, squeeze=False)
    ratios = sorted(table["drop_ratio"].unique())
    x_lo, x_hi = (min(ratios), max(ratios)) if len(ratios) > 1 else (0.0, 1.0)
    for ax, length in zip(axes[0], lengths):
        sub = table[table["context_tokens"] == length]
        for policy, g in sub.groupby("policy", sort=False):
            g = g.sort_values("drop_ratio")
            if policy == FULL:
                acc, lo, hi = (100 * float(g[c].iloc[0]) for c in ("accuracy", "ci_low", "ci_high"))
                ax.axhline(acc, color="black", ls="--", lw=1, label="full cache")
                ax.axhspan(lo, hi, color="black", alpha=0.08)
                continue
            line, = ax.plot(g["drop_ratio"], 100 * g["accuracy"], marker="o", label=policy)
            ax.fill_between(g["drop_ratio"], 100 * g["ci_low"], 100 * g["ci_high"], color=line.get_color(), alpha=0.15)
        ax.set_title(f"{length} tokens (n={int(sub['n'].iloc[0])})")
        ax.set_xlabel("drop ratio")
        ax.set_xlim(x_lo - 0.03, x_hi + 0.03)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("exact match (%)")
    axes[0][-1].legend(loc="lower left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        path = check_plot_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def write_json(table, path: str | Path, *, meta: Mapping | None = None) -> Path:
    """Write `{"meta": meta, "rows": [one dict per table row]}` to `path` (parents created); returns it.

    Raises:
        ValueError: `path` is not a writable file path (see `check_output_path`).
    """
    path = check_output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"meta": dict(meta or {}), "rows": json.loads(table.to_json(orient="records"))}
    path.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    return path


def check_output_path(path: str | Path, option: str = "path", example: str = "runs/eval.json") -> Path:
    """`path` as a Path after checking a file can be written there; leaves nothing behind (a nameless
    temporary file tells whether the folder takes files at all).

    A missing parent folder is fine when its nearest existing ancestor is a writable folder other than the
    filesystem root (the writer creates the missing folders there); nothing is ever created at the root.

    Raises:
        ValueError: `path` is a folder, an unwritable file, or lies under a file, an unwritable folder or
            missing folders that would start at the filesystem root; the message names `option` (e.g.
            `"--json"`) and the path.
    """
    p = Path(path).expanduser()
    where = f"{option} {str(path)!r}"
    if p.is_dir():
        raise ValueError(f"{where} is a folder, not a writable file path; give a file name such as {example}")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ValueError(f"{where}: the file exists and is not writable; give another file name")
        return p
    parent = p.absolute().parent
    ancestor = parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{where} is not a writable file path: {str(ancestor)!r} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{where} is not a writable file path: the folder {str(ancestor)!r} is not writable")
    if ancestor != parent and ancestor.parent == ancestor:
        raise ValueError(f"{where}: the folder {str(parent)!r} does not exist, and missing folders are not created "
                         f"at the filesystem root; create it first or give a path such as {example}")
    try:  # permission bits do not tell everything (root, read-only or virtual filesystems such as /proc): try it
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:
        raise ValueError(f"{where} is not a writable file path: no file can be created in {str(ancestor)!r} "
                         f"({exc.strerror or exc}); give a path such as {example}") from None
    return p


def check_plot_path(path: str | Path, option: str = "path") -> Path:
    """`check_output_path` plus a file extension matplotlib can save (`.png`, `.svg`, `.pdf`, ...)."""
    from matplotlib.figure import Figure

    p = check_output_path(path, option, example="runs/accuracy.png")
    supported = Figure().canvas.get_supported_filetypes()
    ext = p.suffix.lower().lstrip(".")
    if ext not in supported:
        what = f"extension {p.suffix!r}" if p.suffix else "no file extension"
        raise ValueError(f"{option} {str(path)!r} has {what}, which matplotlib cannot save; use one of "
                         f"{', '.join('.' + e for e in sorted(supported))}")
    return p


# --- command line: `python -m tdutils eval` ------------------------------------------------------------

def _split(values: Iterable[str], cast, what: str) -> list:
    """Accept `--x a b c`, `--x a,b,c` and mixtures."""
    import argparse

    out = []
    for v in values:
        for part in str(v).split(","):
            if part.strip():
                try:
                    out.append(cast(part.strip()))
                except ValueError as exc:
                    raise argparse.ArgumentTypeError(f"bad {what} {part!r}: {exc}") from None
    return out


def add_arguments(parser) -> None:
    """Options of `python -m tdutils eval` (added to an argparse parser)."""
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                        help="'full' (no dropping) and/or registered policy names, space- or comma-separated; "
                             "'all' for every registered policy (default: full random snapkv)")
    parser.add_argument("--drop-ratios", nargs="+", default=[str(r) for r in DEFAULT_DROP_RATIOS],
                        help="fractions dropped, each in [0, 1] (default: 0 0.25 0.5 0.75)")
    parser.add_argument("--context-lengths", nargs="+", default=[str(x) for x in DEFAULT_CONTEXT_LENGTHS],
                        help="prompt lengths in tokens (default: 512 1024 2048)")
    parser.add_argument("--window", type=int, default=None,
                        help="most recent tokens always kept, for every policy with a window parameter "
                             "(default: each policy's own)")
    parser.add_argument("--n", type=int, default=200, help="prompts per context length (default: 200)")
    parser.add_argument("--seed", type=int, default=DEV_SEED,
                        help=f"dataset seed, below {TRAIN_SEED_BASE} (training streams); {DEV_SEED} is the development "
                             f"seed, {HELDOUT_SEED} the held-out seed of the published table (default: %(default)s)")
    parser.add_argument("--model", default="tiny-qwen3", help="bundled model, hub id or local folder (default: tiny-qwen3)")
    parser.add_argument("--max-tokens", type=int, default=10, help="greedy decode tokens per request (default: 10)")
    parser.add_argument("--json", dest="json_path", default="runs/eval.json",
                        help="where to write the table as JSON (default: runs/eval.json)")
    parser.add_argument("--plot", default=None, help="also save the accuracy plot to this path (PNG, SVG, ...)")
    parser.add_argument("--quiet", action="store_true", help="no per-cell progress lines")


def run(args) -> int:
    """Run the benchmark for parsed `args` (see `add_arguments`): print the table, write JSON and plot.

    Returns the exit status (0). Raises ValueError for bad values (the CLI prints it as an error).
    """
    import argparse
    import sys

    try:
        policies = _split(args.policies, str, "policy")
        ratios = _split(args.drop_ratios, float, "drop ratio")
        lengths = _split(args.context_lengths, int, "context length")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    # Everything that can be checked without the model, before any work.
    from .policies import policy_names

    if ALL in policies:  # every registered policy, in registration order, after "full" when given
        policies = list(dict.fromkeys(p for q in policies for p in ([*policy_names()] if q == ALL else [q])))
    unknown = [p for p in policies if p not in (FULL, *policy_names())]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(map(repr, unknown))}; choose from {[FULL, *policy_names()]} or {ALL!r}")
    for option, value in (("--n", args.n), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if not policies or not ratios or not lengths:
        raise ValueError("give at least one value to each of --policies, --drop-ratios and --context-lengths")
    bad_lengths = [x for x in lengths if x < 1]
    if bad_lengths:
        raise ValueError(f"--context-lengths must be >= 1 tokens, got {bad_lengths}")
    if args.json_path:
        check_output_path(args.json_path, "--json", example="runs/eval.json")
    if args.plot:
        check_plot_path(args.plot, "--plot")
    t0 = time.perf_counter()
    log = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    from .policies import get_policy

    window = getattr(args, "window", None)
    if window is not None and (window < 0 or window >= min(lengths)):
        # the window is always kept: at or past the prompt length nothing would be dropped, and the table
        # would show full-cache accuracy under a policy's name (as `run` refuses it)
        raise ValueError(f"--window {window} must be >= 0 and shorter than the shortest context length "
                         f"({min(lengths)} tokens): the window is always kept, so nothing would be dropped; give a "
                         "smaller --window")
    params = {} if window is None else {
        p: {"window": window} for p in policies if p != FULL and "window" in get_policy(p).defaults()}
    table = passkey_eval(args.model, policies, ratios, lengths, n=args.n, seed=args.seed,
                         max_tokens=args.max_tokens, log=log, policy_params=params)
    seconds = time.perf_counter() - t0
    print(format_table(table))
    print(f"\npasskey exact match, model={args.model}, n={args.n} per length, seed={args.seed}, "
          f"{seconds:.0f} s")
    meta = {"model": args.model, "policies": policies, "drop_ratios": ratios, "context_lengths": lengths,
            "n": args.n, "seed": args.seed, "max_tokens": args.max_tokens, "seconds": seconds, "policy_params": params,
            "metric": "exact match of the 5 passkey digits (tdutils.answers.score_passkey), 95% Wilson interval"}
    if args.json_path:
        print(f"wrote {write_json(table, args.json_path, meta=meta)}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")  # a command line needs no display
        plot_accuracy(table, args.plot)
        print(f"wrote {args.plot}")
    return 0


__all__ = ["COLUMNS", "DEFAULT_CONTEXT_LENGTHS", "DEFAULT_DROP_RATIOS", "DEFAULT_POLICIES", "DEV_SEED", "FULL",
           "HELDOUT_SEED", "TRAIN_SEED_BASE", "add_arguments", "check_output_path", "check_plot_path", "format_table", "passkey_eval", "plot_accuracy", "run",
           "wilson_interval", "write_json"]
