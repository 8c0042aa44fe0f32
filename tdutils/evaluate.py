"""Accuracy of token-dropping policies on CPU: passkey retrieval and RULER-style tasks in query-aware and
query-agnostic modes.

Passkey retrieval (Mohtashami & Jaggi, "Landmark Attention: Random-Access Infinite Context Length for
Transformers", arXiv:2305.16300): a long filler context hides one needle `pass key = d d d d d .` at a
random depth and ends with the question `pass key =`; the answer is the five digits. The bundled model
`tiny-qwen3` is trained on exactly this task (`tools/train_tiny_model.py`), so a policy that drops the
needle loses the answer and one that keeps it does not: accuracy separates policies sharply (docs/design.md §8).

For every context length, `passkey_eval` builds `make_passkey_dataset(n, length, seed=seed)`, prefills
each chunk of prompts once on the embedded `hf` engine, and then for every policy and drop ratio
restores the prefilled caches, applies `make_drop_fn(policy, drop_ratio=r, ...)` (`modify`), decodes
`max_tokens` tokens greedily with EOS ignored, and scores the responses by exact match of the five digits
(`tdutils.answers.score_passkey`). Each cell gets its accuracy and a 95% Wilson score interval
(`tdutils.answers.wilson_interval`).

Policy names: `"full"` is the full cache (no `modify`; one row per length at drop ratio 0); any other
name goes to `tdutils.make_drop_fn` as it is, so every policy it knows (`random`, `middle_chunk`,
`snapkv`, `rkv`) works here, and an unknown name fails with its error before anything
runs. Ratio 0 runs the policy's drop function too (it must return the cache unchanged, docs/design.md §5), so its
row should equal the full cache's: a cheap check of that contract.

RULER-style tasks (`task_eval`; Hsieh et al., "RULER", arXiv:2404.06654, the suite behind NVIDIA kvpress'
leaderboard): single, multi-key, multi-value and multi-query needles and variable tracking
(`tdutils.data.RULER_TASKS`), scored by exact match of every gold item with partial credit beside it
(`tdutils.answers.score_task`), on the bundled model `tiny-qwen3-ruler` (`tools/train_ruler_model.py`). Each
task runs in two modes: `aware` (prefill(prompt) -> modify -> decode: the question is in the observation window
when the cache is edited) and `agnostic` (prefill(context) -> modify -> extend(question) -> decode: the cache is
edited before the question exists, as when a stored context serves many questions). `leaderboard`,
`plot_leaderboard` and `task_markdown` summarise a table: mean exact match over tasks per policy and drop
ratio, one panel per mode, and the per-task table of docs/results.md; `rank_policies` / `plot_ranking` rank the policies at
one drop ratio with 95% intervals of the exact match pooled over tasks (`notebooks/compare_policies.ipynb`).
Both benchmarks share `build_cells` / `run_cells` (prefill each chunk once, restore the prefilled caches per
cell, one modify per policy x ratio, greedy decode).

Command line (`python -m tdutils eval`, `bench/accuracy.py`): `--tasks passkey` (default, the passkey
benchmark with its model and defaults) or `--tasks all` / task names (defaults
`DEFAULT_TASK_POLICIES`, drop ratios 0.25 / 0.5 / 0.75 / 0.9, lengths 1024 / 2048 / 4096, `--mode both`).

Seeds (dataset seeds of `make_passkey_dataset` and `make_task_dataset`; each gives its own prompts), by use:

- `TRAIN_SEED_BASE` (10_000_000) and above: training streams of `tools/train_tiny_model.py`
  (`TRAIN_SEED_BASE + --seed`);
- `DEV_SEED` (0): development. The training script's final report uses it, so the fine-tune was chosen on it;
  it is the default here, in `python -m tdutils eval` and in `notebooks/compare_policies.ipynb`;
- 1-9: unit tests (the regressions of `tests/test_accuracy.py` use 1); 1234: the bundled sample
  (`tools/make_tiny_model.py`);
- `HELDOUT_SEED` (5_000_000): the published accuracy table only (`bench/accuracy.py`'s default). No training,
  selection or tuning step has seen it, and the training script refuses it as `--eval-seed`.

Bundled models are refused a training seed (`tools/train_ruler_model.py` also draws from `TRAIN_SEED_BASE + seed`). The random policy draws its kept set from its own `seed`
(default 0): all prompts of one length share it, while the needle's depth varies per prompt.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from .data import RULER_TASKS, TASK_MODES
from .models import RULER_MODEL_NAME as RULER_MODEL
from .models import TINY_MODEL_NAME as TINY_MODEL

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
# RULER-style tasks: the model trained on them, and the leaderboard defaults.
TASKS, MODES = RULER_TASKS, TASK_MODES
PASSKEY = "passkey"  # command line: the passkey benchmark above, with its own model and defaults
DEFAULT_TASK_POLICIES = ("full", "random", "streaming_llm", "knorm", "snapkv", "rkv")
DEFAULT_TASK_DROP_RATIOS = (0.25, 0.5, 0.75, 0.9)
DEFAULT_TASK_CONTEXT_LENGTHS = (1024, 2048, 4096)
# Real pretrained models (any model that is not bundled): RULER's own templates (`tdutils.ruler`).
RULER_SUITE = "ruler"  # command line: every RULER template task
DEFAULT_REAL_DROP_RATIOS = (0.5, 0.75, 0.9)
DEFAULT_REAL_CONTEXT_LENGTHS = (2048, 4096)
DEFAULT_REAL_N = 50
DEFAULT_N = 200
CHAT_TEMPLATES = ("auto", "none")
WEAK_FULL_ACCURACY = 0.5  # a task the full cache solves less often than this ranks no policy
TASK_COLUMNS = ("task", "mode", "policy", "drop_ratio", "context_length", "n", "correct", "accuracy", "ci_low",
                "ci_high", "partial", "kept_tokens", "modify_s", "max_tokens")


def wilson_interval(correct: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of `correct / n` as `(low, high)` in [0, 1]; `(nan, nan)` when n == 0.

    Thin wrapper over `tdutils.answers.wilson_interval` (which returns None for n == 0) so a table cell
    is always a pair of floats. Whole numbers stored as floats (a table read back from JSON) count as integers.

    Raises:
        ValueError: `n` or `correct` is negative or not a whole number, or `correct > n`.
    """
    from .answers import wilson_interval as _wilson

    def whole(x):  # 5.0 -> 5; 2.5 stays 2.5 and is refused below, never truncated
        return int(x) if isinstance(x, float) and x.is_integer() else x

    ci = _wilson(whole(correct), whole(n))
    return (math.nan, math.nan) if ci is None else ci


def passkey_eval(
    model=TINY_MODEL,
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
    partial: list | None = None,
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
        seed: dataset seed, an integer >= 0 (`check_seed`); must be below `TRAIN_SEED_BASE` for the bundled model.
            `DEV_SEED` (default) for development, `HELDOUT_SEED` for published figures only (module docstring,
            "Seeds").
        max_tokens: greedy decode tokens per request, EOS ignored (the answer is 5 tokens).
        policy_params: extra `make_drop_fn` keywords per policy, e.g. `{"snapkv": {"window": 32}}`.
        engine: an `HFEngine` to reuse (tests load the model once); else one is opened for `model`.
        batch_size: prompts prefilled and decoded together (bounds memory: each 2048-token request holds
            a ~2 MiB fp32 cache with the bundled model).
        device, dtype: for the engine opened here.
        log: called with one progress line per finished cell (e.g. `print`).
        responses: when a dict is given, filled with `{(policy, ratio, length): [answers]}`, each the decoded text
            up to its first EOS token (`RequestOutput.answer`), what is scored.
        partial: when a list is given, each cell's row (a dict of the table's columns) is appended to it as soon
            as the cell is scored, so a caller keeps the finished cells of a run stopped by KeyboardInterrupt.

    Returns:
        pandas DataFrame, one row per cell, in the order length → policy → ratio, with columns `policy`,
        `drop_ratio`, `context_tokens`, `n`, `correct`, `accuracy` (fraction in [0, 1]), `ci_low`,
        `ci_high` (95% Wilson), `modify_s` (seconds in `modify` for the cell's n requests; 0 for full),
        `kept_tokens` (mean KV tokens per request after modify).

    Raises:
        ValueError: no policies / ratios / lengths, a ratio outside [0, 1], `n < 1`, an unknown policy or
            parameter (from `make_drop_fn`), a negative seed, a training seed with the bundled model, or a
            context length too short for a passkey prompt.
    """
    import pandas as pd

    from .answers import score_passkey
    from .data import make_passkey_dataset
    from .selection import check_drop_ratio

    policies, lengths = list(policies), [int(x) for x in context_lengths]
    ratios = [check_drop_ratio(r) for r in drop_ratios]
    if not policies or not ratios or not lengths:
        raise ValueError("passkey_eval needs at least one policy, one drop ratio and one context length")
    for name, value in (("n", n), ("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    params = {k: dict(v) for k, v in (policy_params or {}).items()}
    engine = _open_engine(engine, model, seed, device=device, dtype=dtype)

    max_pos = getattr(engine.config, "max_position_embeddings", None)
    if max_pos and max(lengths) + max_tokens > max_pos:
        raise ValueError(f"context length {max(lengths)} + max_tokens {max_tokens} exceeds the model's {max_pos} "
                         f"positions (max_position_embeddings); use shorter context lengths")
    cells = build_cells(engine, policies, ratios, params)

    rows = []
    for length in lengths:
        data = make_passkey_dataset(n, length, tokenizer=engine.tokenizer, seed=seed)
        gold = [d["answer"] for d in data]
        t_len = time.perf_counter()
        texts, modify_s, kept = run_cells(engine, data, cells, max_tokens=max_tokens, batch_size=batch_size)
        for policy, r, _ in cells:
            report = score_passkey(gold, texts[policy, r])
            low, high = wilson_interval(report.correct, n)
            rows.append({"policy": policy, "drop_ratio": r, "context_tokens": length, "n": n,
                         "correct": report.correct, "accuracy": report.correct / n, "ci_low": low, "ci_high": high,
                         "modify_s": modify_s[policy, r], "kept_tokens": kept[policy, r] / n})
            if partial is not None:
                partial.append(rows[-1])
            if responses is not None:
                responses[policy, r, length] = list(texts[policy, r])
            if log is not None:
                log(f"{length:>6} tokens  {policy:>12} @ {r:<4g}  {report.correct:>4}/{n}  "
                    f"({100 * report.correct / n:5.1f}%, 95% CI {100 * low:.1f}-{100 * high:.1f})")
        if log is not None:
            log(f"{length:>6} tokens done in {time.perf_counter() - t_len:.1f} s")
    return pd.DataFrame(rows, columns=list(COLUMNS))


def task_eval(
    model=RULER_MODEL,
    tasks: Sequence[str] = TASKS,
    modes: Sequence[str] = MODES,
    policies: Sequence[str] = DEFAULT_TASK_POLICIES,
    drop_ratios: Sequence[float] = DEFAULT_TASK_DROP_RATIOS,
    context_lengths: Sequence[int] = DEFAULT_TASK_CONTEXT_LENGTHS,
    *,
    n: int = 200,
    seed: int = DEV_SEED,
    max_tokens: int | None = None,
    policy_params: Mapping[str, Mapping] | None = None,
    engine=None,
    batch_size: int = 25,
    device=None,
    dtype="auto",
    log: Callable[[str], None] | None = None,
    responses: dict | None = None,
    chat_template: str | bool = "auto",
    partial: list | None = None,
):
    """Exact match on the RULER-style tasks (Hsieh et al., "RULER", arXiv:2404.06654; `tdutils.data`) for every
    (task, mode, context length, policy, drop ratio) cell — the query-aware and query-agnostic leaderboard.

    Per context length and task, `make_task_dataset(task, n, length, seed=seed)` gives `n` examples, the same for
    every mode, policy and ratio. Modes:
    - `"aware"`: prefill(prompt) -> modify -> decode: the question ends the prompt, so it sits in the observation
      window when the cache is edited;
    - `"agnostic"`: prefill(context) -> modify -> extend(question) -> decode: the cache is edited before the
      question exists (a stored context reused for many questions, LMCache's case; kvpress' query-agnostic
      setting). The question's tokens are the aware prompt's tokens after the context's, so both modes read the
      same token sequence; the full cache is prefill(context) -> extend(question) -> decode.
    Each chunk of `batch_size` examples is prefilled once per mode (`run_cells`); responses are decoded greedily
    (EOS ignored) and scored with `tdutils.answers.score_task`.

    Args:
        model: bundled name (default `"tiny-qwen3-ruler"`), packaged real model (`"smollm2-135m"`), `.gguf` file,
            hub id or local folder; ignored when `engine` is given.
        tasks: registered task names (`tdutils.tasks.task_names()`): the word-level tasks of the bundled model
            (`tdutils.data.RULER_TASKS`, the default) and RULER's own templates for real tokenizers
            (`tdutils.ruler.RULER_TEMPLATE_TASKS`).
        modes: `"aware"` and/or `"agnostic"` (`tdutils.data.TASK_MODES`).
        policies: `"full"` and/or registered policy names (`tdutils.policies.policy_names()`).
        drop_ratios: fractions dropped, each in [0, 1]; `"full"` ignores them (one row at 0).
        context_lengths: prompt lengths in tokens, context and question together (exact with the bundled
            tokenizer).
        n: examples per (task, length).
        seed: dataset seed, an integer >= 0 (`check_seed`); below `TRAIN_SEED_BASE` for a bundled model (module
            docstring, "Seeds").
        max_tokens: greedy decode tokens per request; None (default): per task, its own `Task.max_tokens` (word
            tasks: the longest gold answer plus 2 tokens, room to show an extra item, which exact match counts as
            wrong; RULER templates: `tdutils.ruler.decode_tokens`).
        policy_params: extra `make_drop_fn` keywords per policy, e.g. `{"snapkv": {"window": 32}}`.
        engine: an `HFEngine` (or any engine with `extend`) to reuse; else one is opened for `model`.
        batch_size: examples prefilled and decoded together (a 4096-token request of the bundled model holds an
            8 MiB fp32 cache).
        device, dtype: for the engine opened here.
        log: called with one progress line per finished (task, mode, length) group of cells.
        responses: when a dict is given, filled with `{(task, mode, policy, ratio, length): [answers]}`, each the
            decoded text up to its first EOS token (`RequestOutput.answer`), what is scored.
        chat_template: RULER template tasks: `"auto"` (default) wraps each prompt in the tokenizer's chat template
            when it has one, `"none"` never (`tdutils.ruler.uses_chat_template`); word-level tasks ignore it.
        partial: when a list is given, each cell's row (a dict of `TASK_COLUMNS`) is appended to it as soon as the
            cell is scored, so a caller keeps the finished cells of a run stopped by KeyboardInterrupt.

    Returns:
        pandas DataFrame, one row per cell, ordered length -> task -> mode -> policy -> ratio, with columns
        `TASK_COLUMNS`: `task`, `mode`, `policy`, `drop_ratio`, `context_length`, `n`, `correct`, `accuracy`
        (exact-match fraction), `ci_low`, `ci_high` (95% Wilson interval of `accuracy`), `partial` (mean fraction
        of gold items listed, RULER's partial credit), `kept_tokens` (mean KV tokens per request at decode:
        after the edit, the question included), `modify_s` (seconds in `modify` for the cell's n requests; 0 for
        the full cache), `max_tokens`.

    Raises:
        ValueError: no tasks / modes / policies / ratios / lengths, an unknown task or mode, a ratio outside
            [0, 1], `n < 1`, an unknown policy or parameter, a negative seed, a training seed with a bundled
            model, a context length too short for a task or too long for the model, or the agnostic mode on an
            engine without `extend`.
    """
    import pandas as pd

    from .selection import check_drop_ratio
    from .tasks import get_task, task_names

    tasks, modes, policies = list(tasks), list(modes), list(policies)
    lengths = [int(x) for x in context_lengths]
    ratios = [check_drop_ratio(r) for r in drop_ratios]
    if not (tasks and modes and policies and ratios and lengths):
        raise ValueError("task_eval needs at least one task, mode, policy, drop ratio and context length")
    bad = [t for t in tasks if t not in task_names()]
    if bad:
        raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(task_names())}")
    specs = {t: get_task(t) for t in tasks}
    bad = [m for m in modes if m not in TASK_MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {', '.join(TASK_MODES)}")
    for name, value in (("n", n), ("batch_size", batch_size), ("max_tokens", 1 if max_tokens is None else max_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    engine = _open_engine(engine, model, seed, device=device, dtype=dtype)
    if "agnostic" in modes and not callable(getattr(engine, "extend", None)):
        raise ValueError(f"the query-agnostic mode needs an engine with extend(); {type(engine).__name__} has none "
                         f"(use modes=('aware',))")
    params = {k: dict(v) for k, v in (policy_params or {}).items()}
    cells = build_cells(engine, policies, ratios, params)
    tok = engine.tokenizer
    max_pos = getattr(engine.config, "max_position_embeddings", None)
    too_long = [x for x in lengths if max_pos and x >= max_pos]
    if too_long:  # before any prompt is made (a 100k-token prompt takes a while to build)
        raise ValueError(f"context length(s) {too_long} leave no room to decode within the model's {max_pos} positions "
                         f"(max_position_embeddings); use shorter context lengths")
    # Every (task, length) must fit before the first cell runs (a too-short length would fail mid-run).
    for task in tasks:
        try:
            specs[task].make_dataset(1, min(lengths), tok, seed, chat_template)
        except ValueError as exc:
            raise ValueError(f"{exc}; raise the shortest context length (context_lengths / --context-lengths)") from None
    rows = []
    for length in lengths:
        for task in tasks:
            spec = specs[task]
            data = spec.make_dataset(n, length, tok, seed, chat_template)
            decode_tokens = spec.max_tokens(data, tok) if max_tokens is None else int(max_tokens)
            if max_pos and length + decode_tokens > max_pos:
                raise ValueError(f"context length {length} + {decode_tokens} decode tokens exceeds the model's "
                                 f"{max_pos} positions (max_position_embeddings); use shorter context lengths")
            for mode in modes:
                t0 = time.perf_counter()
                if mode == "aware":
                    prompts, extensions = [d.get("prompt_ids", d["prompt"]) for d in data], None
                else:
                    prompts, extensions = zip(*(spec.split(tok, d) for d in data))
                texts, modify_s, kept = run_cells(engine, prompts, cells, max_tokens=decode_tokens,
                                                  batch_size=batch_size, extensions=extensions)
                for policy, r, _ in cells:
                    scores = [spec.score(d["values"], t) for d, t in zip(data, texts[policy, r])]
                    correct = sum(exact for exact, _ in scores)
                    low, high = wilson_interval(correct, n)
                    rows.append({"task": task, "mode": mode, "policy": policy, "drop_ratio": r, "context_length": length,
                                 "n": n, "correct": correct, "accuracy": correct / n, "ci_low": low, "ci_high": high,
                                 "partial": sum(p for _, p in scores) / n, "kept_tokens": kept[policy, r] / n,
                                 "modify_s": modify_s[policy, r], "max_tokens": decode_tokens})
                    if partial is not None:
                        partial.append(rows[-1])
                    if responses is not None:
                        responses[task, mode, policy, r, length] = list(texts[policy, r])
                if log is not None:
                    summary = ", ".join(f"{p}@{r:g} {100 * row['accuracy']:.0f}%" for (p, r, _), row in
                                        zip(cells, rows[-len(cells):]))
                    log(f"{length:>6} tokens {task:>17} {mode:>8}: {summary} ({time.perf_counter() - t0:.1f} s)")
    return pd.DataFrame(rows, columns=list(TASK_COLUMNS))


def split_question(tokenizer, example: Mapping) -> tuple[list[int], list[int]]:
    """`(context ids, question ids)` of a task example for the query-agnostic flow, such that together they are
    exactly the token ids of the aware prompt `example["prompt"]` (= context + " " + question).

    The context's own ids are used when they are a prefix of the prompt's (always with the bundled word-level
    tokenizer); otherwise the prompt is cut after as many tokens as the context has, so both modes still read
    the same sequence.

    Raises:
        ValueError: an example without `prompt` and `context` (not from `make_task_example`), or a context that
            is not shorter than the prompt.
    """
    missing = [k for k in ("prompt", "context") if k not in example]
    if missing:
        raise ValueError(f"split_question needs a task example with 'prompt' and 'context' (from "
                         f"tdutils.data.make_task_example); this one has no {' or '.join(map(repr, missing))}")
    prompt = tokenizer(example["prompt"])["input_ids"]
    context = tokenizer(example["context"])["input_ids"]
    if len(context) >= len(prompt):
        raise ValueError(f"the context ({len(context)} tokens) is not shorter than the prompt ({len(prompt)}); "
                         f"a task example needs a question after its context")
    cut = len(context)
    return prompt[:cut], prompt[cut:]


SCORED_TEXT = ("each response up to its first EOS token (RequestOutput.answer): decoding ignores EOS so every cell "
               "decodes the same number of tokens, and what follows an EOS is not the model's answer")


def _interrupted(finished: list[dict], columns, json_path, meta: dict, t0: float) -> int:
    """Ctrl-C stopped `run`: write the `finished` cells as JSON (meta `"interrupted": true`), say in one line where
    they went, and return `cli_args.INTERRUPTED`."""
    import sys

    import pandas as pd

    from .cli_args import INTERRUPTED

    if not finished:
        where = "no cell had finished; nothing was written"
    elif json_path is None:
        where = f"{len(finished)} cell(s) had finished (no --json to write them to)"
    else:
        meta = {**meta, "interrupted": True, "seconds": time.perf_counter() - t0}
        path = write_json(pd.DataFrame(finished, columns=list(columns)), json_path, meta=meta)
        where = f"the {len(finished)} finished cell(s) are in {path} (\"interrupted\": true in its meta)"
    print(f"tdutils: interrupted; {where}", file=sys.stderr, flush=True)
    return INTERRUPTED


def _uses_chat(tokenizer, chat_template) -> bool:
    from .ruler import uses_chat_template

    return uses_chat_template(tokenizer, chat_template)


def check_seed(seed) -> int:
    """`seed` after checking it is a dataset seed: an integer >= 0.

    A negative seed is refused because it is not a seed of its own: `random.Random(-s)` draws exactly what
    `random.Random(s)` draws (Python seeds with the absolute value), so `-s` would repeat seed `s`'s prompts, and
    `-TRAIN_SEED_BASE` and below would evaluate a bundled model on its training prompts past the training-seed
    check.

    Raises:
        ValueError: a bool, a non-integer or a negative number.
    """
    import numbers

    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")  # noqa: TRY004 (documented ValueError)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}: random.Random(-s) draws the same prompts as "
                         f"random.Random(s), so a negative seed repeats another seed's prompts (from "
                         f"-{TRAIN_SEED_BASE} down, a bundled model's training prompts); give a seed >= 0 (below "
                         f"{TRAIN_SEED_BASE} for a bundled model)")
    return int(seed)


def _seed_option(text: str) -> int:
    """argparse type of `--seed`: `check_seed` on the command line's text."""
    import argparse

    try:
        return check_seed(int(text))
    except ValueError as exc:
        msg = str(exc) if text.strip().lstrip("+-").isdigit() else f"expected an integer >= 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _open_engine(engine, model, seed: int, *, device=None, dtype="auto"):
    """`engine`, or an `HFEngine` opened for `model` (no progress bars, query capture off until `build_cells`
    widens it); refuses a negative seed (`check_seed`) and a training seed with a bundled model."""
    from .models import bundled_model_path

    seed = check_seed(seed)
    name = model if engine is None else getattr(engine, "model_name", None)
    if isinstance(name, str) and bundled_model_path(name) is not None and seed >= TRAIN_SEED_BASE:
        raise ValueError(f"seed {seed} is a training stream of the bundled model {name!r} (>= {TRAIN_SEED_BASE}); "
                         f"evaluate with a seed below it")
    if engine is not None:
        return engine
    from .engines.hf import HFEngine

    return HFEngine(model, device=device, dtype=dtype, kv_budget_tokens=None, prefill_batch_size=8,
                    query_window=0, progress=False)


def build_cells(engine, policies: Sequence[str], ratios: Sequence[float], params: Mapping[str, Mapping]) -> list:
    """Every `(policy, drop ratio, drop function)` cell (`"full"`: one cell at ratio 0 with no function), built
    before any work so that a bad name or parameter fails fast; widens the engine's query capture to what the
    policies read (none, a window, or all queries for H2O)."""
    from .edit import make_drop_fn

    cells: list[tuple[str, float, object]] = []
    for policy in policies:
        if policy == FULL:
            cells.append((FULL, 0.0, None))
            continue
        for r in ratios:
            cells.append((policy, r, make_drop_fn(policy, drop_ratio=r, model_config=engine.config,
                                                  **params.get(policy, {}))))
    if hasattr(engine, "capture_for"):
        engine.capture_for(*(fn for _, _, fn in cells))
    return cells


def run_cells(engine, prompts: Sequence, cells: Sequence[tuple], *, max_tokens: int, batch_size: int,
              extensions: Sequence | None = None) -> tuple[dict, dict, dict]:
    """Greedy responses of every cell on the same prompts: each chunk of `batch_size` prompts is prefilled once,
    then per cell the prefilled caches are restored, edited with the cell's drop function (`modify`; none for
    the full cache), extended with `extensions` when given (`extend`, the query-agnostic flow: the edit never
    saw them) and decoded (`max_tokens` tokens, greedy, EOS ignored so every cell decodes the same count; each
    response is its answer, the text up to its first EOS token, so what follows an EOS is never scored).

    Args:
        engine: an open engine (`HFEngine` restores its prefilled state per cell; others prefill again).
        prompts: what `prefill` takes (strings, dicts with `prompt`, token-id lists).
        cells: `(policy, ratio, drop_fn or None)` from `build_cells`.
        extensions: None, or one extension (text or token ids) per prompt.

    Returns:
        `(texts, modify_s, kept)`, dicts keyed by `(policy, ratio)`: answers (`RequestOutput.answer`: decoded up
        to the first EOS token) in prompt order, seconds in `modify` summed over chunks, and KV tokens per request
        at decode summed over requests (cache after the edit, extension included).
    """
    texts = {(p, r): [] for p, r, _ in cells}
    modify_s = {(p, r): 0.0 for p, r, _ in cells}
    kept = {(p, r): 0 for p, r, _ in cells}
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        engine.prefill(chunk)
        saved = _snapshot(engine)
        for policy, r, fn in cells:
            _restore(engine, saved, chunk)
            if fn is not None:
                engine.modify(fn)
                modify_s[policy, r] += engine.metrics.modify.seconds
            if extensions is not None:
                engine.extend(list(extensions[start:start + batch_size]))
            outs = engine.decode(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            texts[policy, r] += [o.answer for o in outs]
            kept[policy, r] += sum(o.cached_tokens for o in outs)
    return texts, modify_s, kept


def _snapshot(engine):
    """The engine's prefilled state (`Engine.snapshot`), so every policy starts from the same caches: prefilling
    once per chunk instead of once per cell saves most of the benchmark's time. An object that is not an
    `Engine` gives None and is prefilled again."""
    from .engines.base import Engine

    return engine.snapshot() if isinstance(engine, Engine) else None


def _restore(engine, saved, prompts) -> None:
    if saved is None:
        engine.prefill(prompts)
    else:
        engine.restore(saved)


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
    return _save_figure(fig, path)


def format_task_table(table) -> str:
    """A `task_eval` table as text: one row per cell, exact match and its 95% interval in percent, partial credit."""
    t = table.copy()
    t["accuracy"] = (100 * t["accuracy"]).map("{:.1f}%".format)
    t["95% CI"] = [f"{100 * lo:.1f}-{100 * hi:.1f}" for lo, hi in zip(table["ci_low"], table["ci_high"])]
    t["partial"] = (100 * t["partial"]).map("{:.1f}%".format)
    t["modify_s"] = t["modify_s"].map("{:.3f}".format)
    t["kept_tokens"] = t["kept_tokens"].map("{:.0f}".format)
    cols = ["context_length", "task", "mode", "policy", "drop_ratio", "n", "correct", "accuracy", "95% CI", "partial",
            "modify_s", "kept_tokens"]
    return t[cols].to_string(index=False)


def leaderboard(table):
    """Average exact match over tasks and context lengths per (mode, policy, drop ratio) of a `task_eval` table:
    a DataFrame with `mode`, `policy`, `drop_ratio`, `accuracy` (mean of the cells' exact-match fractions, each
    task weighing the same), `partial`, `cells` (how many cells were averaged) and `n` (examples in all)."""
    g = table.groupby(["mode", "policy", "drop_ratio"], sort=False)
    return g.agg(accuracy=("accuracy", "mean"), partial=("partial", "mean"), cells=("accuracy", "size"),
                 n=("n", "sum")).reset_index()


def task_markdown(table, *, context_length: int | None = None) -> str:
    """The per-task table (markdown, as in docs/results.md) of a `task_eval` table (or the `rows` of its JSON report, as a
    DataFrame): one row per (mode, policy), one column per task plus the average; a cell lists the exact match
    (%) at each drop ratio, `a / b / c` in ascending ratio order (the full cache: one figure). Cells of several
    context lengths are pooled (correct answers over examples) unless `context_length` picks one.

    Raises:
        ValueError: `context_length` is not in the table.
    """
    t = table
    if context_length is not None:
        t = t[t["context_length"] == context_length]
        if t.empty:
            raise ValueError(f"no rows at context length {context_length}; the table has "
                             f"{sorted(table['context_length'].unique())}")
    tasks = list(dict.fromkeys(t["task"]))
    pooled = t.groupby(["mode", "policy", "drop_ratio", "task"], sort=False)[["correct", "n"]].sum()
    lengths = "/".join(str(x) for x in sorted(t["context_length"].unique()))
    head = ["mode", "policy", "drop ratios", *tasks, "average"]
    lines = [f"Exact match (%), {lengths} tokens, n = {int(t['n'].iloc[0])} per task and length",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (mode, policy), g in t.groupby(["mode", "policy"], sort=False):
        ratios = sorted(g["drop_ratio"].unique())
        cells = []
        for task in [*tasks, None]:
            values = []
            for r in ratios:
                if task is None:
                    values.append(sum(100 * pooled.loc[(mode, policy, r, x), "correct"] / pooled.loc[(mode, policy, r, x), "n"]
                                      for x in tasks) / len(tasks))
                else:
                    row = pooled.loc[(mode, policy, r, task)]
                    values.append(100 * row["correct"] / row["n"])
            cells.append(" / ".join(f"{v:.1f}" for v in values))
        lines.append("| " + " | ".join([mode, policy, " / ".join(f"{r:g}" for r in ratios), *cells]) + " |")
    return "\n".join(lines)


def plot_leaderboard(table, path: str | Path | None = None, *, title: str = "RULER-style tasks: average exact match"):
    """Leaderboard figure of a `task_eval` table: average exact match (%) over tasks (and context lengths) vs drop
    ratio, one line per policy, one panel per mode (`aware`, `agnostic`); the full cache as a dashed line.

    Returns the matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    board = leaderboard(table)
    modes = list(dict.fromkeys(board["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), 3.6), sharey=True, squeeze=False)
    ratios = sorted(board.loc[board["policy"] != FULL, "drop_ratio"].unique())
    x_lo, x_hi = (min(ratios), max(ratios)) if len(ratios) > 1 else (0.0, 1.0)
    lengths = ", ".join(str(x) for x in sorted(table["context_length"].unique()))
    colors = {p: f"C{i}" for i, p in enumerate(x for x in dict.fromkeys(board["policy"]) if x != FULL)}
    for ax, mode in zip(axes[0], modes):
        sub = board[board["mode"] == mode]
        for policy, g in sub.groupby("policy", sort=False):
            g = g.sort_values("drop_ratio")
            if policy == FULL:
                ax.axhline(100 * float(g["accuracy"].iloc[0]), color="black", ls="--", lw=1, label="full cache")
                continue
            ax.plot(g["drop_ratio"], 100 * g["accuracy"], marker="o", color=colors[policy], label=policy)
        ax.set_title(f"query-{mode}")
        ax.set_xlabel("drop ratio")
        ax.set_xlim(x_lo - 0.03, x_hi + 0.03)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("exact match, mean over tasks (%)")
    axes[0][-1].legend(loc="best", fontsize=8)
    tasks = table["task"].nunique()
    fig.suptitle(f"{title} ({tasks} tasks; {lengths} tokens; n={int(table['n'].iloc[0])} per cell)", fontsize=10)
    fig.tight_layout()
    return _save_figure(fig, path)


def rank_policies(table, drop_ratio: float | None = None):
    """Rank the policies of a `task_eval` table per mode at one drop ratio, with 95% intervals, to say which
    differences the run can tell apart.

    Per (mode, policy) the cells at `drop_ratio` (the full cache: its ratio-0 cells) are pooled over tasks and
    context lengths: `correct` and `n` are summed and `accuracy = correct / n` (with the same `n` per cell, the
    mean exact match over tasks the leaderboard plots) gets a 95% Wilson score interval. Tasks differ in
    difficulty, so the pooled answers are independent Bernoulli draws with unequal rates; their count varies
    less than a binomial's of the same mean, so the interval is conservative.

    Args:
        table: a `task_eval` table (columns `mode`, `policy`, `drop_ratio`, `correct`, `n`).
        drop_ratio: the ratio to rank at; None: the largest non-zero ratio of the table.

    Returns:
        pandas DataFrame ordered by mode (as in the table), then by accuracy (best first), with columns `mode`,
        `rank` (1 = best; equal accuracies share the better rank), `policy`, `drop_ratio`, `correct`, `n`,
        `accuracy`, `ci_low`, `ci_high` (fractions in [0, 1]) and `above` (the policies of the same mode whose
        interval lies wholly below this one's, comma-separated: the differences the run resolves).

    Raises:
        ValueError: the table has no rows at `drop_ratio` besides the full cache, or no ratio above 0.
    """
    import pandas as pd

    dropped = table[table["policy"] != FULL]
    ratios = sorted(r for r in dropped["drop_ratio"].unique() if r > 0)
    if drop_ratio is None:
        if not ratios:
            raise ValueError("rank_policies needs a table with a drop ratio above 0 (a policy other than the full cache)")
        drop_ratio = ratios[-1]
    at = table[((table["policy"] == FULL) & (table["drop_ratio"] == 0)) |
               ((table["policy"] != FULL) & (table["drop_ratio"] == drop_ratio))]
    if at[at["policy"] != FULL].empty:
        raise ValueError(f"no rows at drop ratio {drop_ratio:g}; the table has {[float(r) for r in ratios]}")
    pooled = at.groupby(["mode", "policy"], sort=False)[["correct", "n"]].sum().reset_index()
    rows = []
    for mode, g in pooled.groupby("mode", sort=False):
        g = g.assign(accuracy=g["correct"] / g["n"])
        g[["ci_low", "ci_high"]] = [wilson_interval(c, n) for c, n in zip(g["correct"], g["n"])]
        g = g.sort_values("accuracy", ascending=False, kind="stable")
        g["rank"] = g["accuracy"].rank(method="min", ascending=False).astype(int)
        g["above"] = [", ".join(q.policy for q in g.itertuples() if q.ci_high < row.ci_low) for row in g.itertuples()]
        rows.append(g.assign(drop_ratio=[0.0 if p == FULL else float(drop_ratio) for p in g["policy"]]))
    out = pd.concat(rows, ignore_index=True)
    return out[["mode", "rank", "policy", "drop_ratio", "correct", "n", "accuracy", "ci_low", "ci_high", "above"]]


def plot_ranking(ranking, path: str | Path | None = None, *, title: str = "Policies ranked: exact match, 95% interval"):
    """Forest plot of `rank_policies` output: one panel per mode, one row per policy (best on top), its pooled exact
    match (%) as a dot and its 95% Wilson interval as a bar; the full cache in black.

    Returns the matplotlib Figure; saves it to `path` (PNG, SVG, ... by suffix) when given.
    """
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(ranking["mode"]))
    height = 0.9 + 0.32 * max(len(g) for _, g in ranking.groupby("mode"))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), height), sharex=True, squeeze=False)
    ratio = max(ranking["drop_ratio"])
    for ax, mode in zip(axes[0], modes):
        g = ranking[ranking["mode"] == mode].reset_index(drop=True)
        y = list(range(len(g)))[::-1]
        for yi, row in zip(y, g.itertuples()):
            color = "black" if row.policy == FULL else "C0"
            err = [[100 * max(0.0, row.accuracy - row.ci_low)], [100 * max(0.0, row.ci_high - row.accuracy)]]  # 0 - 1e-17
            ax.errorbar(100 * row.accuracy, yi, xerr=err, fmt="o", color=color, capsize=3)
        ax.set_yticks(y, [f"{row.rank}. {row.policy}" for row in g.itertuples()])
        ax.set_title(f"query-{mode}, drop ratio {ratio:g}")
        ax.set_xlabel("exact match, pooled over tasks (%)")
        ax.set_xlim(-3, 103)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save_figure(fig, path)


def _save_figure(fig, path: str | Path | None):
    """Save `fig` to `path` (PNG, SVG, ... by suffix; parents created) when a path is given; returns `fig`."""
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
        ValueError: `path` is empty, a folder, an unwritable file, or lies under a file, an unwritable folder or
            missing folders that would start at the filesystem root; the message names `option` (e.g.
            `"--json"`) and the path.
    """
    where = f"{option} {str(path)!r}"
    if str(path) == "":  # Path("") is the current folder: say what was given, not "is a folder"
        raise ValueError(f"{where} is an empty path; give a file name such as {example}")
    p = Path(path).expanduser()
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
                except ValueError:
                    raise argparse.ArgumentTypeError(f"bad {what} {part!r}") from None
    return out


# Policy parameters that are not `eval` options: its --seed is the dataset's seed (the random policy keeps its own).
POLICY_OPTION_SKIP = ("seed",)


def add_arguments(parser) -> None:
    """Options of `python -m tdutils eval` (added to an argparse parser). Options left unset take the defaults of
    the suite `--tasks` picks: `passkey` (the default; `passkey_eval`, model tiny-qwen3) or RULER-style tasks
    (`task_eval`, model tiny-qwen3-ruler)."""
    parser.add_argument("--tasks", nargs="+", default=None,
                        help=f"'{PASSKEY}' (the passkey benchmark of the tiny-qwen3 model; the default without "
                             f"--model), word-level RULER-style tasks {', '.join(TASKS)} or 'all' for those five (model "
                             f"tiny-qwen3-ruler), or RULER's own templates for real models (task names of "
                             f"tdutils.ruler, or '{RULER_SUITE}' for all; the default for a --model that is not bundled)")
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATES, default="auto",
                        help="RULER template tasks: 'auto' (default) wraps each prompt in the tokenizer's chat template "
                             "when it has one; 'none' feeds the raw template")
    parser.add_argument("--mode", choices=("aware", "agnostic", "both"), default=None,
                        help="RULER tasks: 'aware' (question in the prompt when the cache is edited), 'agnostic' (cache "
                             "edited on the context alone, question prefilled after the edit) or 'both' (default); "
                             "passkey: aware only")
    parser.add_argument("--policies", nargs="+", default=None,
                        help="'full' (no dropping) and/or registered policy names, space- or comma-separated; "
                             f"'all' for every registered policy (default: passkey {' '.join(DEFAULT_POLICIES)}; "
                             f"RULER tasks {' '.join(DEFAULT_TASK_POLICIES)})")
    parser.add_argument("--drop-ratios", nargs="+", default=None,
                        help="fractions dropped, each in [0, 1] (default: passkey "
                             f"{' '.join(map(str, DEFAULT_DROP_RATIOS))}; RULER tasks "
                             f"{' '.join(map(str, DEFAULT_TASK_DROP_RATIOS))})")
    parser.add_argument("--context-lengths", nargs="+", default=None,
                        help="prompt lengths in tokens (default: passkey "
                             f"{' '.join(map(str, DEFAULT_CONTEXT_LENGTHS))}; RULER tasks "
                             f"{' '.join(map(str, DEFAULT_TASK_CONTEXT_LENGTHS))})")
    parser.add_argument("--n", type=int, default=None,
                        help=f"prompts per context length and task (default: {DEFAULT_N}; {DEFAULT_REAL_N} for a real "
                             f"model)")
    parser.add_argument("--seed", type=_seed_option, default=DEV_SEED,
                        help=f"dataset seed, below {TRAIN_SEED_BASE} (training streams); {DEV_SEED} is the development "
                             f"seed, {HELDOUT_SEED} the held-out seed of the published table (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="bundled model, packaged real model (smollm2-135m, gemma3-270m), .gguf file, hub id or "
                             f"local folder (default: passkey tiny-qwen3; word-level RULER tasks {RULER_MODEL}; "
                             "RULER templates smollm2-135m)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy decode tokens per request (default: passkey 10; RULER tasks the longest answer "
                             "of each task plus 2)")
    parser.add_argument("--json", dest="json_path", default="runs/eval.json",
                        help="where to write the table as JSON (default: runs/eval.json); a run stopped with Ctrl-C "
                             "writes the cells it finished there, marked \"interrupted\": true")
    parser.add_argument("--plot", default=None,
                        help="also save a plot to this path (PNG, SVG, ...): passkey accuracy per length, or the RULER "
                             "leaderboard (mean exact match over tasks vs drop ratio, one panel per mode)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (torch.set_num_threads; default: torch's choice). The bundled models "
                             "are tiny: 1 thread per run is fastest when several runs share a machine")
    parser.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    from .policies.cli import policy_arguments

    policy_arguments(parser, skip=POLICY_OPTION_SKIP)  # --window, --n-sink, ...: each reaches every policy with it


def parse_tasks(values: Iterable[str]) -> list[str]:
    """`--tasks` values as a list: `'all'` expands to the five word-level tasks, `'ruler'` to RULER's templates;
    `passkey` must stand alone.

    Raises:
        ValueError: an unknown task, or `passkey` mixed with other tasks (they use different models).
    """
    import argparse

    from .tasks import task_names

    try:
        tasks = _split(values, str, "task")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    groups = {ALL: TASKS, RULER_SUITE: task_names("ruler")}
    tasks = list(dict.fromkeys(t for x in tasks for t in groups.get(x, (x,))))
    unknown = [t for t in tasks if t not in (PASSKEY, *task_names())]
    if unknown:
        raise ValueError(f"--tasks: unknown {', '.join(map(repr, unknown))}; choose {PASSKEY!r}, {ALL!r} (word-level: "
                         f"{', '.join(TASKS)}) or {RULER_SUITE!r} (RULER templates: {', '.join(task_names('ruler'))})")
    if PASSKEY in tasks and len(tasks) > 1:
        raise ValueError(f"--tasks: {PASSKEY!r} runs alone (its model, tiny-qwen3, is not trained on the RULER tasks); "
                         f"run it and the RULER tasks as two commands")
    if not tasks:
        raise ValueError("--tasks needs at least one task")
    return tasks


def weak_tasks(table, threshold: float = WEAK_FULL_ACCURACY) -> dict:
    """`{(task, mode, context_length): full-cache accuracy}` for the cells where the full cache scores below
    `threshold`: there the model cannot do the task, so no policy's score there says anything about the policy.
    Empty when the table has no `"full"` rows."""
    full = table[table["policy"] == FULL]
    return {(r.task, r.mode, int(r.context_length)): float(r.accuracy) for r in full.itertuples()
            if r.accuracy < threshold}


def weak_task_notes(table, threshold: float = WEAK_FULL_ACCURACY) -> list[str]:
    """One line per task (and mode, length) that the full cache itself fails (`weak_tasks`), for tables and logs."""
    return [f"note: {task} ({mode}, {length} tokens): the full cache scores {100 * acc:.0f}% (< {100 * threshold:.0f}%): "
            f"the model cannot do this task, so the policies' scores on it rank nothing"
            for (task, mode, length), acc in weak_tasks(table, threshold).items()]


def run(args) -> int:
    """Run the benchmark for parsed `args` (see `add_arguments`): print the table, write JSON and plot.

    Returns the exit status: 0, or `cli_args.INTERRUPTED` (130) when Ctrl-C stopped it; then the cells that
    finished are written to `--json` with `"interrupted": true` in its meta, and one line says so. Raises
    ValueError for bad values (the CLI prints it as an error).
    """
    import argparse
    import sys

    from .models import BUNDLED_MODELS

    model_arg = getattr(args, "model", None)
    real = model_arg is not None and model_arg not in BUNDLED_MODELS
    default_tasks = [RULER_SUITE] if real else ([ALL] if model_arg == RULER_MODEL else [PASSKEY])
    tasks = parse_tasks(getattr(args, "tasks", None) or default_tasks)
    passkey = tasks == [PASSKEY]
    from .tasks import get_task

    templates = not passkey and all(get_task(t).suite == "ruler" for t in tasks)
    mode = getattr(args, "mode", None)
    if passkey and mode not in (None, "aware"):
        raise ValueError(f"--mode {mode}: the passkey benchmark runs in aware mode only; use RULER tasks "
                         f"(--tasks all) for the query-agnostic mode")
    modes = list(MODES) if mode in (None, "both") else [mode]

    def pick(value, passkey_default, task_default, real_default=None):
        default = passkey_default if passkey else (real_default if templates and real_default else task_default)
        return value if value is not None else [str(x) for x in default]

    try:
        policies = _split(pick(args.policies, DEFAULT_POLICIES, DEFAULT_TASK_POLICIES), str, "policy")
        ratios = _split(pick(args.drop_ratios, DEFAULT_DROP_RATIOS, DEFAULT_TASK_DROP_RATIOS, DEFAULT_REAL_DROP_RATIOS),
                        float, "--drop-ratios value (fractions such as 0.25 0.5 0.75)")
        lengths = _split(pick(args.context_lengths, DEFAULT_CONTEXT_LENGTHS, DEFAULT_TASK_CONTEXT_LENGTHS,
                              DEFAULT_REAL_CONTEXT_LENGTHS), int,
                         "--context-lengths value (whole numbers of tokens such as 1024 2048)")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    from .selection import check_drop_ratio

    try:
        ratios = [check_drop_ratio(r) for r in ratios]
    except ValueError as exc:
        raise ValueError(f"--drop-ratios: {exc}; give fractions such as 0.25 0.5 0.75") from None
    model = args.model or (TINY_MODEL if passkey else ("smollm2-135m" if templates else RULER_MODEL))
    n = args.n if args.n is not None else (DEFAULT_REAL_N if templates else DEFAULT_N)
    args.n = n
    if templates and model in BUNDLED_MODELS:
        raise ValueError(f"--model {model}: the bundled models know only their own word-level vocabulary; RULER's "
                         f"templates need a real tokenizer and model (e.g. --model smollm2-135m), or use the "
                         f"word-level tasks ({ALL!r})")
    max_tokens = args.max_tokens if args.max_tokens is not None else (10 if passkey else None)
    trained_for = {TINY_MODEL: "the passkey benchmark (--tasks passkey)", RULER_MODEL: "the RULER-style tasks"}
    if model == (RULER_MODEL if passkey else TINY_MODEL):  # a bundled model on a suite it was never trained on
        suite = "the passkey benchmark" if passkey else "the RULER-style tasks"
        print(f"tdutils: warning: --model {model} was trained only on {trained_for[model]}, not on {suite}: its "
              f"accuracy there says nothing about the policies; omit --model to use "
              f"{TINY_MODEL if passkey else RULER_MODEL}", file=sys.stderr, flush=True)
    if model not in BUNDLED_MODELS and not templates:  # a real model on the bundled models' word-level formats
        print(f"tdutils: warning: --model {model} meets tasks in the bundled models' word-level format "
              f"(needles 'pass key ...'), which real models were never taught; RULER's own templates measure them "
              f"(--tasks {RULER_SUITE})", file=sys.stderr, flush=True)
    # Everything that can be checked without the model, before any work.
    from .policies import policy_names

    if ALL in policies:  # every registered policy, in registration order, after "full" when given
        policies = list(dict.fromkeys(p for q in policies for p in ([*policy_names()] if q == ALL else [q])))
    unknown = [p for p in policies if p not in (FULL, *policy_names())]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(map(repr, unknown))}; choose from {[FULL, *policy_names()]} or {ALL!r}")
    for option, value in (("--n", args.n), ("--max-tokens", 1 if max_tokens is None else max_tokens)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if not policies or not ratios or not lengths:
        raise ValueError("give at least one value to each of --policies, --drop-ratios and --context-lengths")
    bad_lengths = [x for x in lengths if x < 1]
    if bad_lengths:
        raise ValueError(f"--context-lengths must be >= 1 tokens, got {bad_lengths}")
    threads = getattr(args, "threads", None)
    from .cli_args import usable_cores

    cores = usable_cores()
    if threads is not None and not 1 <= threads <= cores:
        raise ValueError(f"--threads must be between 1 and the {cores} CPU core(s) this process may use, got {threads} "
                         "(more threads than cores only wait on each other)")
    # "" is checked too (and refused, as `run --json ""`), never read as "no file"
    if args.json_path is not None:
        check_output_path(args.json_path, "--json", example="runs/eval.json")
    if args.plot is not None:
        check_plot_path(args.plot, "--plot")
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    log = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    from .policies.cli import policy_params

    window = getattr(args, "window", None)
    if window is not None and (window < 0 or window >= min(lengths)):
        # the window is always kept: at or past the prompt length nothing would be dropped, and the table
        # would show full-cache accuracy under a policy's name (as `run` refuses it)
        raise ValueError(f"--window {window} must be >= 0 and shorter than the shortest context length "
                         f"({min(lengths)} tokens): the window is always kept, so nothing would be dropped; give a "
                         "smaller --window")
    given = {p: policy_params(args, p, skip=POLICY_OPTION_SKIP, strict=False) for p in policies if p != FULL}
    params = {p: values for p, values in given.items() if values}
    chat = getattr(args, "chat_template", "auto") or "auto"
    meta = {"model": model, "tasks": tasks, "modes": ["aware"] if passkey else modes, "policies": policies,
            # no ratio was run when only the full cache was asked for (it ignores them)
            "drop_ratios": ratios if any(p != FULL for p in policies) else [], "context_lengths": lengths, "n": args.n, "seed": args.seed, "max_tokens": max_tokens,
            "policy_params": params, "threads": torch.get_num_threads(), "interrupted": False,
            "scored": SCORED_TEXT}
    finished: list[dict] = []  # the cells scored so far, kept when Ctrl-C stops the run
    if passkey:
        try:
            table = passkey_eval(model, policies, ratios, lengths, n=args.n, seed=args.seed, max_tokens=max_tokens,
                                 log=log, policy_params=params, partial=finished)
        except KeyboardInterrupt:
            return _interrupted(finished, COLUMNS, args.json_path, meta, t0)
        print(format_table(table))
        meta["metric"] = "exact match of the 5 passkey digits (tdutils.answers.score_passkey), 95% Wilson interval"
        what = f"passkey exact match, model={model}, n={args.n} per length"
    else:
        try:
            engine = _open_engine(None, model, args.seed)
            used_chat = templates and _uses_chat(engine.tokenizer, chat)
            table = task_eval(model, tasks, modes, policies, ratios, lengths, n=args.n, seed=args.seed,
                              max_tokens=max_tokens, log=log, policy_params=params, engine=engine, chat_template=chat,
                              partial=finished)
        except KeyboardInterrupt:
            return _interrupted(finished, TASK_COLUMNS, args.json_path, meta, t0)
        print(format_task_table(table))
        print()
        print(task_markdown(table))
        notes = weak_task_notes(table)
        for line in notes:
            print(line)
        meta["notes"] = notes
        if templates:
            meta["chat_template"] = "applied (the tokenizer's own)" if used_chat else "none"
            meta["metric"] = ("RULER string_match_all: exact = every reference in the response, partial = fraction of "
                              "references present (tdutils.ruler.score_ruler); 95% Wilson interval of exact")
            what = (f"RULER template exact match, model={model}, chat template {'applied' if used_chat else 'not applied'}"
                    f", n={args.n} per task and length")
        else:
            meta["metric"] = ("exact match of every gold item (tdutils.answers.score_task), 95% Wilson interval; "
                              "partial = mean fraction of gold items listed")
            what = f"RULER-style exact match, model={model}, n={args.n} per task and length"
    seconds = time.perf_counter() - t0
    meta["seconds"] = seconds
    print(f"\n{what}, seed={args.seed}, {seconds:.0f} s")
    if args.json_path is not None:
        print(f"wrote {write_json(table, args.json_path, meta=meta)}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")  # a command line needs no display
        (plot_accuracy if passkey else plot_leaderboard)(table, args.plot)
        print(f"wrote {args.plot}")
    return 0


__all__ = ["COLUMNS", "DEFAULT_CONTEXT_LENGTHS", "DEFAULT_DROP_RATIOS", "DEFAULT_POLICIES", "DEFAULT_TASK_CONTEXT_LENGTHS",
           "DEFAULT_TASK_DROP_RATIOS", "DEFAULT_TASK_POLICIES", "DEV_SEED", "FULL", "HELDOUT_SEED", "MODES", "PASSKEY",
           "RULER_MODEL", "TASKS", "TASK_COLUMNS", "TRAIN_SEED_BASE", "add_arguments", "build_cells", "check_output_path",
           "check_plot_path", "check_seed", "format_table", "format_task_table", "leaderboard", "parse_tasks", "passkey_eval",
           "plot_accuracy", "plot_leaderboard", "plot_ranking", "rank_policies", "run", "run_cells", "split_question", "task_eval", "task_markdown",
           "wilson_interval", "write_json"]
