"""JSON output and input shared by the bench scripts (run as `python bench/NAME.py`, so this folder is on sys.path)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def check_json_dest(dest: str, option: str = "--json", example: str = "runs/bench.json") -> None:
    """Check before any work that `dest` ("-" for stdout, else a file path) can be written.

    Raises:
        ValueError: an empty or unwritable path (`tdutils.eval.check_output_path`).
    """
    if dest != "-":
        from tdutils.eval import check_output_path

        check_output_path(dest, option, example=example)


def read_json(path: str, option: str = "--summary"):
    """The JSON value stored in `path` (a bench's own `--json` file).

    Raises:
        ValueError: the file is missing, unreadable, not UTF-8 or not JSON; the message names `option` and the path.
    """
    from tdutils.textio import read_text

    try:
        return json.loads(read_text(path))
    except OSError as exc:
        raise ValueError(f"{option} {path!r}: {exc.strerror or exc}; give a file a bench wrote with --json") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} {path!r} is not JSON ({exc}); give a file a bench wrote with --json") from None


def write_json(results: dict, dest: str) -> None:
    """Write `results` as indented JSON to the file `dest`, or to stdout when `dest` is "-"."""
    text = json.dumps(results, indent=2)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def summary_or_check(parser, args, summary, example: str) -> bool:
    """The start of a bench's `main`: with `--summary FILE` print `summary(read_json(FILE))` and return True;
    otherwise check `--device` and `--json` before any work and return False. A bad value ends in one line,
    exit status 2."""
    from tdutils.models import check_device

    try:
        if args.summary:
            print(summary(read_json(args.summary)))
            return True
        check_device(args.device)
        if args.json is not None:
            check_json_dest(args.json, example=example)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return False


def machine() -> str:
    """The CPU model and core count, as the stored runs record it (e.g. "Intel(R) Xeon(R) Processor, 2 cores
    (shared)")."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)"


def compression_policies() -> list[str]:
    """The registered policies that can hold a budget while the cache grows (`tdutils.compression.Compression`):
    those whose cut, tried on the bundled model's shapes, keeps the budget. Leaves out `h2o` (needs every prompt
    query) and `middle_chunk` (keeps a fixed share, not the budget)."""
    from tdutils.compression import Compression
    from tdutils.models import tiny_qwen3_config
    from tdutils.policies import policy_names

    config, out = tiny_qwen3_config(64), []
    for name in policy_names():
        try:
            Compression(name, budget=64, buffer=64).drop_fn(model_config=config)
        except ValueError:
            continue
        out.append(name)
    return out


def at_least_one(text: str) -> float:
    """argparse type of `--full-requests`: a finite number >= 1 (the KV budget must hold one undropped request)."""
    import argparse
    import math

    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 1):
        raise argparse.ArgumentTypeError(f"expected a number >= 1 (the budget must hold one undropped request), "
                                         f"got {text!r}")
    return v


def one_line_errors(parser, fn, *args):
    """`fn(*args)`, with bad input (`tdutils.cli_args.is_usage_error`: ValueError, OSError, ...) reported in one
    line as `parser.prog: error: ...`, exit status 2; anything else (a bug) keeps its traceback."""
    from tdutils.cli_args import is_usage_error

    try:
        return fn(*args)
    except Exception as exc:
        if not is_usage_error(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        parser.exit(2, f"{parser.prog}: error: {first}\n")


def check_report(report, option: str, prog: str, keys=("meta", "rows")) -> None:
    """Refuse a `--summary` file that is not a run of this bench (a dict without `keys`, or a list of such)."""
    runs = report if isinstance(report, list) else [report]
    if not runs or not all(isinstance(r, dict) and set(keys) <= set(r) for r in runs):
        raise ValueError(f"{option} is not a run of {prog} (no {' and '.join(keys)}); give a file it wrote with --json")
