"""Passkey accuracy benchmark of issue 8: policies x drop ratios x context lengths on the bundled model.

    python bench/accuracy.py                                   # n=200 per cell, 512/1024/2048 tokens
    python bench/accuracy.py --n 50 --context-lengths 512      # quicker
    python bench/accuracy.py --policies full random snapkv rkv # R-KV once make_drop_fn knows it

A thin script over `tdutils.evaluate` (the same code as `python -m tdutils eval`): prints the table
(exact match of the five passkey digits, 95% Wilson interval, modify seconds), writes it as JSON and the
accuracy-vs-drop-ratio plot as PNG (defaults `runs/accuracy.json`, `runs/accuracy.png`).

Targets (issue 8, n >= 200 per cell): full cache >= 98% at 512, 1024 and 2048 tokens; SnapKV and R-KV at
drop ratio 0.5 >= 97%; at 0.75, report what they reach. Runtime on 2 CPU cores: a few minutes at the
defaults, most of it prefilling the 2048-token prompts.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tdutils.evaluate import add_arguments, run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.set_defaults(json_path="runs/accuracy.json", plot="runs/accuracy.png")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
