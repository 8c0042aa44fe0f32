"""Accuracy benchmarks: passkey and RULER-style tasks in query-aware / query-agnostic mode (`tdutils.eval`).

    python bench/accuracy.py                                   # passkey: n=200 per cell, 512/1024/2048 tokens
    python bench/accuracy.py --policies full all --drop-ratios 0.5 --context-lengths 1024   # every policy
    python bench/accuracy.py --tasks all --mode both --json runs/ruler.json --plot runs/ruler.png   # RULER
    python bench/accuracy.py --summary docs/results/accuracy.json   # the docs/results.md table of a stored run

`python -m tdutils eval` on the held-out seed, writing runs/accuracy.json / .png by default. Suites, defaults
and targets: docs/benchmarks.md#benchaccuracypy-and-python--m-tdutils-eval-exact-match.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness as H

from tdutils.cli.eval import add_arguments, run
from tdutils.eval import HELDOUT_SEED


def main(argv=None) -> int:
    ap = H.parser(None, __doc__)
    add_arguments(ap)  # tdutils.eval's options (the same as `python -m tdutils eval`), --json among them
    ap.set_defaults(json_path="runs/accuracy.json", plot="runs/accuracy.png", seed=HELDOUT_SEED)
    H.add_standard(ap, json=None)
    args = ap.parse_args(argv)
    if H.summary(ap, args, "accuracy"):
        return 0
    return H.one_line_errors(ap, run, args)


if __name__ == "__main__":
    sys.exit(main())
