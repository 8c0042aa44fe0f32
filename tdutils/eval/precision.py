"""bfloat16 against float32: how far a lower-precision engine (weights, activations and KV cache in `dtype`) moves a
model's outputs from the float32 engine's on the same prompts (`dtype_fidelity`).

Two measurements, each run once per dtype on one engine per dtype (`open_engine("hf", dtype=...)`):

- text: the text-fidelity windows (`task_fidelity.make_fidelity_dataset`: public-domain texts, a continuation of
  `CONTINUATION` tokens teacher-forced through both engines): KL(reference || dtype) per token in nats
  (`tdutils.compression.kl_per_step`), the fraction of steps whose argmax agrees, and the greedy agreement (the
  tokens a free-running greedy decode in `dtype` shares with the reference's before the first difference,
  `tdutils.compression.greedy_agreement`, read from the forced run as `compression.fidelity` does);
- answers: a RULER task's prompts (`tasks.load_rows`) decoded greedily in both dtypes, each answer scored exactly
  (`tasks.score_rows`), the two dtypes compared by the exact McNemar test on the same prompts
  (`statistics.mcnemar_exact`); the dtype's decode is also teacher-forced with the reference's answer tokens for the
  KL and agreement on those prompts.

Both measurements run for every cell (`(policy, drop_ratio)`, `("full", 0.0)` = no edit): the policy scores the
cache of its own dtype, so the comparison includes any change in the kept set that rounding brings.
"""

from __future__ import annotations

import statistics as stats
from collections.abc import Sequence

import torch

from ..compression import greedy_agreement, kl_per_step
from ..edit import make_drop_fn
from ..engines import open_engine
from .common import FULL
from .statistics import mcnemar_exact
from .task_fidelity import CONTINUATION, make_fidelity_dataset
from .tasks import get_task, load_rows, score_rows

DEFAULT_CELLS = ((FULL, 0.0), ("snapkv", 0.5))


def dtype_fidelity(model: str = "smollm2-135m", *, dtype: str = "bfloat16", reference: str = "float32",
                   context_tokens: int = 2048, texts: int = 8, continuation: int = CONTINUATION,
                   task: str = "ruler_niah_single_1", n: int = 16, cells: Sequence[tuple[str, float]] = DEFAULT_CELLS,
                   batch_size: int = 4, seed: int = 0) -> dict:
    """Outputs of an engine in `dtype` against the same engine in `reference` precision, on the same prompts.

    Args:
        model: a model name `open_engine("hf", model=...)` loads (e.g. `"smollm2-135m"`).
        dtype, reference: the compared and the reference precision (`"bfloat16"`, `"float32"`, `"float16"`).
        context_tokens: prompt length of every text window and RULER prompt.
        texts: text-fidelity windows (0 = none); continuation: tokens teacher-forced after each.
        task: a registered answer task (`tdutils.eval.task_names()`), `n` prompts of it (0 = none).
        cells: `(policy, drop_ratio)` pairs; `"full"` (any ratio) leaves the cache whole.
        batch_size: prompts prefilled and decoded together.
        seed: the seed of the text windows and of the task's prompts.

    Returns:
        `{"model", "dtype", "reference", "context_tokens", "text": {cell: measures}, "answers": {cell: measures},
        "decode_step_s": {dtype: seconds}}`, cells keyed `"policy@ratio"`. Text measures: `kl_mean` / `kl_p90` /
        `kl_max` (nats per token, over every step of every window), `argmax_agreement` (fraction of steps),
        `greedy_prefix_mean` (tokens), `identical` (fraction of windows whose every argmax agrees). Answer measures:
        `exact_reference` / `exact_dtype` (correct answers of `n`), `mcnemar` `(b, c, p)` (`b` right only in the
        reference), `same_answer` (fraction of identical answer texts), and the KL and agreement measures over the
        answer tokens. `decode_step_s`: the mean wall seconds of one step of the full cache's forced text decode
        (batch `batch_size` x `context_tokens`), median over its batches.

    Raises:
        ValueError: an unknown dtype, model, task or policy (from the engine, `load_rows`, `make_drop_fn`), or a
            teacher-forced `task`.
    """
    runs = []  # the reference's, then the dtype's: two engines even when the dtypes are equal
    for d in (reference, dtype):
        engine = open_engine("hf", model=model, dtype=d, progress=False, prefill_batch_size=batch_size, query_window=0)
        tok = engine.tokenizer
        windows = make_fidelity_dataset(texts, context_tokens, tok, seed, continuation=continuation) if texts else []
        rows = load_rows(task, num_requests=n, tokenizer=tok, context_tokens=context_tokens, seed=seed) if n else []
        fns = {c: None if c[0] == FULL else make_drop_fn(c[0], drop_ratio=c[1], model_config=engine.facts)
               for c in cells}
        engine.capture_for(*fns.values())  # the queries the cells' policies read, and no more
        answer_tokens = get_task(task).max_tokens(rows, tok) if n else 0
        runs.append({"text": _forced_text(engine, windows, fns, batch_size),
                     "answers": _answers(engine, rows, fns, batch_size, answer_tokens,
                                         runs[0]["answers"] if runs else None)})
        del engine
    ref, run = runs
    out = {"model": model, "dtype": dtype, "reference": reference, "context_tokens": context_tokens, "text": {},
           "answers": {}, "decode_step_s": {reference: ref["text"]["step_s"], dtype: run["text"]["step_s"]}}
    for cell in cells:
        key = f"{cell[0]}@{cell[1]:g}"
        if texts:
            out["text"][key] = _agreement(ref["text"][cell], run["text"][cell])
        if n:
            out["answers"][key] = _answer_measures(rows, task, ref["answers"][cell], run["answers"][cell])
    return out


def _forced_text(engine, windows: list[dict], fns: dict, batch_size: int) -> dict:
    """Per cell, the forced continuation of every window: `{cell: [(ids, logits fp32 [m, vocab]), ...]}`, and
    `step_s`: the full cache's mean decode step, median over the batches (nan without windows)."""
    out, steps = {c: [] for c in fns}, []
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        forced = [list(w["continuation"]) for w in chunk]
        engine.prefill([w["prompt_ids"] for w in chunk])
        saved = engine.snapshot()
        for cell, fn in fns.items():
            engine.restore(saved)
            if fn is not None:
                engine.modify(fn)
            before = engine.metrics.decode.seconds, engine.metrics.decode.steps
            outs = engine.decode(max_tokens=len(forced[0]), keep_logits=True, ignore_eos=True, forced_ids=forced)
            if fn is None:
                seconds, count = engine.metrics.decode.seconds - before[0], engine.metrics.decode.steps - before[1]
                steps.append(seconds / max(1, count))
            out[cell] += [(ids, _logits(o)) for ids, o in zip(forced, outs)]
    out["step_s"] = stats.median(steps) if steps else float("nan")
    return out


def _answers(engine, rows: list, fns: dict, batch_size: int, max_tokens: int, reference: dict | None) -> dict:
    """Per cell, each row's greedy answer: `{cell: [(answer text, output ids, forced logits or None), ...]}`; with
    `reference` (that dtype's own result) the decode is also teacher-forced with the reference's output ids."""
    out = {c: [] for c in fns}
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        engine.prefill(chunk)
        saved = engine.snapshot()
        for cell, fn in fns.items():
            engine.restore(saved)
            if fn is not None:
                engine.modify(fn)
            free = engine.decode(max_tokens=max_tokens, ignore_eos=False, keep_logits=reference is None)
            logits = [_logits(o) if reference is None else None for o in free]
            if reference is not None:
                forced = [ids for _, ids, _ in reference[cell][start:start + batch_size]]
                engine.restore(saved)
                if fn is not None:
                    engine.modify(fn)
                outs = engine.decode(max_tokens=[len(f) for f in forced], keep_logits=True, ignore_eos=True,
                                     forced_ids=forced)
                logits = [_logits(o) for o in outs]
            out[cell] += [(o.answer, list(o.output_ids), x) for o, x in zip(free, logits)]
    return out


def _logits(output) -> torch.Tensor:
    return torch.stack([torch.as_tensor(x).float() for x in output.logits])  # [steps, vocab]


def _agreement(reference: list, other: list) -> dict:
    """KL and agreement of `other`'s forced logits with `reference`'s: lists of `(ids, logits)` (reference `ids`:
    the tokens both were forced with or the reference's greedy tokens)."""
    kls, match, prefix, identical = [], 0, [], 0
    for (ids, ref), (_, mine) in zip(reference, other):
        kls.append(kl_per_step(ref, mine))
        arg = mine.argmax(dim=-1).tolist()
        match += sum(int(a == b) for a, b in zip(ref.argmax(dim=-1).tolist(), arg))
        prefix.append(greedy_agreement(ref.argmax(dim=-1).tolist(), arg))
        identical += int(prefix[-1] == len(arg))
    every = torch.cat(kls)
    return {"kl_mean": float(every.mean()), "kl_p90": float(every.kthvalue(-(-9 * len(every) // 10)).values),
            "kl_max": float(every.max()), "argmax_agreement": match / len(every),
            "greedy_prefix_mean": sum(prefix) / len(prefix), "identical": identical / len(prefix)}


def _answer_measures(rows: list, task: str, reference: list, other: list) -> dict:
    right_ref = score_rows(rows, [a for a, _, _ in reference], task=task).is_correct
    right = score_rows(rows, [a for a, _, _ in other], task=task).is_correct
    b, c, p = mcnemar_exact([float(x) for x in right_ref], [float(x) for x in right])
    forced = _agreement([(ids, x) for _, ids, x in reference], [(ids, x) for _, ids, x in other])
    same = sum(int(a == o) for (a, _, _), (o, _, _) in zip(reference, other)) / len(rows)
    return {"exact_reference": sum(right_ref), "exact_dtype": sum(right), "n": len(rows), "mcnemar": (b, c, p),
            "same_answer": same, **forced}


__all__ = ["DEFAULT_CELLS", "dtype_fidelity"]
