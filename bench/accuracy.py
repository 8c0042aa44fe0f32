"""Accuracy benchmarks: passkey and RULER-style tasks in query-aware / query-agnostic mode.

    python bench/accuracy.py                                   # passkey: n=200 per cell, 512/1024/2048 tokens
    python bench/accuracy.py --n 50 --context-lengths 512      # quicker
    python bench/accuracy.py --policies full random snapkv rkv # R-KV too
    python bench/accuracy.py --policies full all --drop-ratios 0.5 --context-lengths 1024   # every policy
    python bench/accuracy.py --policies knorm keydiff --window 64   # protect the last 64 tokens (the question)
    python bench/accuracy.py --summary docs/results/accuracy.json   # the docs/results.md table of a stored run
    python bench/accuracy.py --tasks all --mode both --json runs/ruler.json --plot runs/ruler.png
                                                               # RULER leaderboard: 5 tasks x 2 modes, n=200,
                                                               # 1024/2048/4096 tokens, drop 0.25/0.5/0.75/0.9
    python bench/accuracy.py --tasks niah_multikey --mode agnostic --n 50 --context-lengths 1024   # quicker
    python bench/accuracy.py --summary runs/ruler.json        # its per-task table (markdown)

A thin script over `tdutils.eval` (the same code as `python -m tdutils eval`): prints the table
(exact match, 95% Wilson interval, modify seconds; RULER tasks also partial credit and the per-task markdown
table), writes it as JSON and a plot as PNG (defaults `runs/accuracy.json`, `runs/accuracy.png`): passkey
accuracy vs drop ratio per length, or the RULER leaderboard (mean exact match over tasks vs drop ratio, one
panel per mode). `--tasks passkey` (default) runs the passkey benchmark on `tiny-qwen3`; `--tasks all` or task
names run `tdutils.eval.task_eval` on `tiny-qwen3-ruler` with `--mode aware|agnostic|both` (default both). Its dataset seed
defaults to `tdutils.eval.HELDOUT_SEED` (5_000_000), which no training, selection or test step uses
(`tdutils.eval.common`, "Seeds"); `python -m tdutils eval` defaults to the development seed 0 instead.

Targets (n >= 200 per cell): full cache >= 98% at 512, 1024 and 2048 tokens; SnapKV and R-KV at
drop ratio 0.5 >= 97%; at 0.75, report what they reach. Runtime: 467 s at n=200 with the policies full,
random, snapkv and rkv on 2 quiet CPU cores, 3355 s on the same 2 cores shared with six other jobs (docs/results.md), most of it prefilling the 2048-token prompts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

from tdutils.eval import FULL, HELDOUT_SEED, add_arguments, run, task_markdown

NAMES = {"random": "random", "snapkv": "SnapKV", "rkv": "R-KV", "middle_chunk": "middle-chunk"}


def readme_summary(report: dict) -> str:
    """The accuracy table of docs/results.md (markdown), written from a stored `--json` report. Passkey: one row per context
    length, the full cache, then each policy's accuracy (%) at its drop ratios > 0. RULER tasks (rows with a
    `task`): `tdutils.eval.task_markdown`, one row per mode and policy, one column per task."""
    rows = report["rows"]
    if rows and "task" in rows[0]:
        import pandas as pd

        return task_markdown(pd.DataFrame(rows))
    lengths = sorted({r["context_tokens"] for r in rows})
    policies = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != FULL]
    ratios = {p: sorted({r["drop_ratio"] for r in rows if r["policy"] == p and r["drop_ratio"] > 0}) for p in policies}
    acc = {(r["policy"], r["drop_ratio"], r["context_tokens"]): 100 * r["accuracy"] for r in rows}
    head = ["tokens", "full"] + [f"{NAMES.get(p, p)} {' / '.join(f'{x:g}' for x in ratios[p])}" for p in policies]
    return "\n".join(H.md_table(head, ([str(n), f"{acc[FULL, 0.0, n]:.1f}%"] + [
        " / ".join(f"{acc[p, x, n]:.1f}" for x in ratios[p]) for p in policies] for n in lengths)))


def main(argv=None) -> int:
    ap = H.parser(None, __doc__)
    add_arguments(ap)  # tdutils.eval's options (the same as `python -m tdutils eval`), --json among them
    ap.set_defaults(json_path="runs/accuracy.json", plot="runs/accuracy.png", seed=HELDOUT_SEED)
    H.add_standard(ap, json=None)
    args = ap.parse_args(argv)
    if H.summary(ap, args, readme_summary):
        return 0
    return H.one_line_errors(ap, run, args)


if __name__ == "__main__":
    sys.exit(main())
