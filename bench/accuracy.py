"""Accuracy benchmarks: passkey and RULER-style tasks in query-aware / query-agnostic mode (`tdutils.eval`).

    python bench/accuracy.py                                   # passkey: n=200 per cell, 512/1024/2048 tokens
    python bench/accuracy.py --policies full all --drop-ratios 0.5 --context-lengths 1024   # every policy
    python bench/accuracy.py --policies knorm keydiff --window 64   # protect the last 64 tokens (the question)
    python bench/accuracy.py --tasks all --mode both --json runs/ruler.json --plot runs/ruler.png   # RULER
    python bench/accuracy.py --summary docs/results/accuracy.json   # the docs/results.md table of a stored run

The code and options of `python -m tdutils eval`, on the held-out seed (`tdutils.eval.HELDOUT_SEED`) and writing
`runs/accuracy.json` / `runs/accuracy.png` by default. Suites, defaults and targets:
docs/benchmarks.md#benchaccuracypy-and-python--m-tdutils-eval-exact-match.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

from tdutils.cli.eval import add_arguments, run
from tdutils.eval import FULL, HELDOUT_SEED, task_markdown

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
