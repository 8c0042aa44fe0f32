"""What the eval modules share: the dataset seeds, the full cache's name, checks run once at an entry, one statistic.

Seeds (docs/design.md §8; each dataset seed gives its own prompts): `TRAIN_SEED_BASE` (10_000_000) and above are
the training streams of `tools/train_*_model.py`; `DEV_SEED` (0) is development (the training reports use it, so
the fine-tunes were chosen on it; `eval`'s default); 1-9 unit tests; 1234 the bundled sample; `HELDOUT_SEED`
(5_000_000) the published tables only (`bench/accuracy.py`'s default; the training script refuses it).

`DropRatios` is a tuple of drop ratios checked once (`tdutils.checks.check_drop_ratio`): an entry point
(`passkey_eval`, `task_eval`, the command line) checks them, and what it passes them on to does not check again.
`wilson_interval` gives a table cell its 95% interval; `check_output_path` / `check_plot_path` refuse an unwritable
`--json` or `--plot` before any work.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..answers import wilson_interval as _wilson
from ..checks import check_drop_ratio

TRAIN_SEED_BASE = 10_000_000  # training streams of tools/train_tiny_model.py start here
DEV_SEED = 0  # development: the training script reports on it, so the fine-tune was chosen on it
HELDOUT_SEED = 5_000_000  # published accuracy table only; never used by training, selection or tests
FULL = "full"  # the policy name of the full cache (no modify; one cell at ratio 0)


class DropRatios(tuple):
    """Drop ratios as floats, each checked once with `tdutils.checks.check_drop_ratio`.

    `DropRatios(values)` checks `values`; a `DropRatios` given again is returned as it is, unchecked, so a ratio
    is validated once per path however many functions it passes through. `option` (e.g. `"--drop-ratios"`) makes
    the error a command-line message.

    Raises:
        ValueError: a ratio that is not a finite number in [0, 1].
    """

    def __new__(cls, values: Iterable[float], option: str | None = None):
        if isinstance(values, DropRatios):
            return values

        try:
            return super().__new__(cls, [check_drop_ratio(r) for r in values])
        except ValueError as exc:
            if option is None:
                raise
            raise ValueError(f"{option}: {exc}; give fractions such as 0.25 0.5 0.75") from None


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


def wilson_interval(correct: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of `correct / n` as `(low, high)` in [0, 1]; `(nan, nan)` when n == 0.

    Thin wrapper over `tdutils.answers.wilson_interval` (which returns None for n == 0) so a table cell
    is always a pair of floats. Whole numbers stored as floats (a table read back from JSON) count as integers.

    Raises:
        ValueError: `n` or `correct` is negative or not a whole number, or `correct > n`.
    """
    def whole(x):  # 5.0 -> 5; 2.5 stays 2.5 and is refused below, never truncated
        return int(x) if isinstance(x, float) and x.is_integer() else x

    ci = _wilson(whole(correct), whole(n))
    return (math.nan, math.nan) if ci is None else ci


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


__all__ = ["DEV_SEED", "FULL", "HELDOUT_SEED", "TRAIN_SEED_BASE", "DropRatios", "check_output_path", "check_plot_path",
           "check_seed", "wilson_interval"]
