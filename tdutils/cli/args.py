"""Argument types, the parser and the error report shared by the command line (`python -m tdutils`) and the
`bench/` scripts.

A bad option is reported in one line that names the option and what it expects, with exit status 2. So is bad
input found later (`UsageError`, and the library's documented bad-input errors: `ValueError`, `OSError`,
`ConnectionError`, a server's refusal); anything else is a bug, reported with its traceback, a line asking for
a report, and exit status 1 (`report_error`).
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from urllib.parse import urlsplit

from ..checks import check_drop_ratio
from ..serving.completion import CompletionError


class UsageError(ValueError):
    """Bad input the user can fix (an option's value, a file, a model, a server's address), found after parsing.

    The message says what was wrong and what to do; the command line prints it in one line with exit status 2.
    A subclass of ValueError, the type the library raises for bad input, so callers catching ValueError keep
    working.
    """


def is_usage_error(exc: BaseException) -> bool:
    """Whether `exc` is bad input or an unusable environment (one line) rather than a bug (traceback).

    True for `UsageError` and the types the library documents for bad input: `ValueError` (bad values, files
    that do not parse), `OSError` (missing or unwritable files), `ConnectionError` (a server that is down) and
    `tdutils.serving.completion.CompletionError` (a server that refused or failed a request). False for everything else,
    e.g. `TypeError`, `RuntimeError`, `AssertionError`, `KeyError`, `IndexError`: those mean tdutils itself
    went wrong.
    """
    if isinstance(exc, (ValueError, OSError, ConnectionError)):
        return True

    return isinstance(exc, CompletionError)


def report_error(exc: BaseException, prog: str = "tdutils") -> int:
    """Print `exc` for the command line and return the exit status.

    Bad input (`is_usage_error`): `"{prog}: error: {exc}"` in one line on stderr, status 2. Anything else: the
    traceback, then one line saying this is a bug in tdutils and asking for a report (with the repository's
    issue tracker when the installed metadata names it), status 1.
    """
    if is_usage_error(exc):
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    traceback.print_exception(exc, file=sys.stderr)
    print(f"{prog}: internal error ({type(exc).__name__}): this is a bug in tdutils, not a problem with your input; "
          f"please report it with the command you ran and the traceback above{_issue_tracker()}", file=sys.stderr)
    return 1


def _issue_tracker() -> str:
    """' at https://.../issues' from the installed package's `Repository` URL, or '' when unknown."""
    try:
        from importlib.metadata import PackageNotFoundError, metadata

        urls = metadata("tdutils").get_all("Project-URL") or []
    except (ImportError, PackageNotFoundError):
        return ""
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "repository" and url.strip():
            return f" at {url.strip().rstrip('/')}/issues"
    return ""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one, else `os.cpu_count()`): the
    most torch threads worth asking for (more only wait on each other; far more exhaust the machine's threads)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_threads_option(parser: argparse.ArgumentParser, more_help: str = "") -> None:
    """`--threads N` (torch CPU threads; None: torch's choice), checked by `check_threads` once parsed."""
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads (torch.set_num_threads; default: torch's choice){more_help}")


def check_threads(threads: int | None) -> None:
    """Check a `--threads` value: None (torch's choice) or 1 .. `usable_cores()`.

    Raises:
        ValueError: outside that range (the message names the cores this process may use).
    """
    cores = usable_cores()
    if threads is not None and not 1 <= threads <= cores:
        raise ValueError(f"--threads must be between 1 and the {cores} CPU core(s) this process may use, got {threads} "
                         "(more threads than cores only wait on each other)")


DTYPES = ("auto", "float32", "float16", "bfloat16")  # --dtype values (tdutils.models.load_model's names)
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # load_model reads these too


def dtype_option(text: str) -> str:
    """argparse type of `--dtype`: one of `DTYPES` (or an alias of `DTYPE_ALIASES`, given back as its full name)."""
    value = DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    return value


def add_dtype_option(parser: argparse.ArgumentParser, default: str | None = "auto", more_help: str = "") -> None:
    """`--dtype` (the model's dtype when the engine loads it), checked by `dtype_option` as it is parsed: a bad value
    is refused in one line with exit status 2. `more_help` is added to the help after the choices."""
    parser.add_argument("--dtype", type=dtype_option, default=default,
                        help=f"model dtype: {', '.join(DTYPES)}{more_help}")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (no usage block) and exits with status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def run_device(text: str) -> str:
    """argparse type: a torch device this machine has that a run can compute on
    (`tdutils.models.check_compute_device`: not `meta`, nor a CPU index)."""
    from ..models import check_compute_device  # cost: torch and transformers, only when --device is given

    try:
        check_compute_device(text, option="--device")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def int_at_least(low: int, why: str = ""):
    """argparse type factory: an integer >= `low`; `why` (e.g. "the window of 16 tokens is always kept") is
    added to the error."""
    what = f"an integer >= {low}" + (f" ({why})" if why else "")

    def parse(text: str) -> int:
        return _int_at_least(text, low, what)

    parse.__name__ = f"int_at_least_{low}"
    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (`nan` and `inf` are refused, though Python's `float` reads both)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def drop_ratio(text: str) -> float:
    """argparse type: one drop ratio, a finite number in [0, 1] (`tdutils.checks.check_drop_ratio`)."""
    try:
        value = float(text)  # the command line's text; check_drop_ratio takes numbers only
    except ValueError:
        raise argparse.ArgumentTypeError(f"drop_ratio must be a number in [0, 1], got {text!r}") from None
    try:
        return check_drop_ratio(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def drop_ratios(text: str) -> list[float]:
    """argparse type: comma-separated drop ratios, each in the open interval (0, 1), for sweeps that always run the
    baseline (ratio 0) and where ratio 1 would keep only the always-kept tokens."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            r = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number; give comma-separated ratios in (0, 1), "
                                             f"e.g. 0.5,0.75") from None
        if not 0 < r < 1:  # also refuses nan, which compares false with everything
            raise argparse.ArgumentTypeError(f"{part} is not in (0, 1): the baseline (ratio 0) always runs, and "
                                             f"a ratio of 1 keeps only the always-kept tokens; give ratios such as 0.5,0.75")
        out.append(r)
    return out


def open_ratio(text: str) -> float:
    """argparse type: one drop ratio in the open interval (0, 1)."""
    try:
        r = float(text)
    except ValueError:
        r = math.nan
    if not 0.0 < r < 1.0:  # nan compares false
        raise argparse.ArgumentTypeError(f"expected a drop ratio in (0, 1), got {text!r}")
    return r


def full_requests(text: str) -> float:
    """argparse type of `--full-requests` (a KV budget in undropped requests): a finite number >= 1, as the budget
    must hold one undropped request."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 1):
        raise argparse.ArgumentTypeError(f"expected a number >= 1 (the budget must hold one undropped request), "
                                         f"got {text!r}")
    return v


def int_list(what: str, example: str):
    """argparse type factory: comma-separated integers >= 1 (e.g. `int_list("token counts", "4096,8192")`)."""
    def parse(text: str) -> list[int]:
        try:
            out = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {what}, e.g. {example}") from None
        if not out or min(out) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what} >= 1, e.g. {example}")
        return out
    return parse


def name_list(choices, what: str = "policy", allow_none: bool = False):
    """argparse type factory: comma-separated names, each one of `choices` (with `allow_none`, "none": [])."""
    def parse(text: str) -> list[str]:
        if allow_none and text.strip().lower() == "none":
            return []
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0] if bad else text!r}; give comma-separated "
                                             f"names from {', '.join(choices)}")
        return out
    return parse


def check_device_output(path, option: str = "--json") -> None:
    """Check up front that an output path which already exists and is not a regular file (a character device such
    as `/dev/full`, a pipe, a terminal) takes a write: one newline is written and flushed (JSON readers skip
    leading whitespace). Regular files and new paths are left alone (`tdutils.eval.check_output_path` checks
    those without writing to them).

    Raises:
        ValueError: the write fails (e.g. `/dev/full`: no space left on device); the message names `option`.
    """
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return  # a new file: its folder is checked elsewhere
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n")
            f.flush()
    except OSError as exc:
        raise ValueError(f"{option} {str(path)!r} cannot be written ({exc.strerror or exc}); give a file path such "
                         f"as runs/run.json") from None


def check_http_url(url: str, option: str, example: str) -> None:
    """UsageError when `url` is not an http(s) URL with a host (bad input, not a server to start).

    Raises:
        UsageError: a scheme other than http or https, or no host; the message names `option`.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{option} {url!r} is not a URL: it needs http:// or https:// and a host, such as {example}")


HTTP_SERVER_OPTIONS = (("vllm_url", "--vllm-url", "http://localhost:8000"),
                       ("lmcache_http_url", "--lmcache-http-url", "http://localhost:8080"))


def check_server_urls(values: dict) -> None:
    """`check_http_url` on each of `--vllm-url` / `--lmcache-http-url` that `values` (keyword -> URL) holds.

    Raises:
        UsageError: one of them is not an http(s) URL with a host.
    """
    for key, option, example in HTTP_SERVER_OPTIONS:
        if key in values:
            check_http_url(values[key], option, example)
