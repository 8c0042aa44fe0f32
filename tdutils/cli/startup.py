"""The start of `python -m tdutils`: until the command is ready to catch it, Ctrl-C ends the process in one line.

Stdlib only: `tdutils/__init__.py` calls `exit_on_interrupt_while_starting` before its own imports (torch,
transformers), the one import of the command-line wing from below it.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130  # exit status of a command stopped with Ctrl-C: 128 + SIGINT, what a shell reports for it
TERMINATED = 143  # ... stopped with SIGTERM (`kill PID`): 128 + SIGTERM

# `python -m tdutils`: Ctrl-C before the command has anything to keep ends the process at once, in one line.
_STARTING = {"installed": False, "terminated": False}


def _exit_interrupted(signum, frame) -> None:
    import os

    try:
        sys.stderr.write("python -m tdutils: interrupted while starting; nothing was written\n")
        sys.stderr.flush()
    finally:
        os._exit(INTERRUPTED)


def _run_as_tdutils_main() -> bool:
    """Whether this process is `python -m tdutils ...` (and not another `-m` module or a program importing us)."""
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] == "tdutils"
        if arg.startswith("-m"):
            return arg[2:] == "tdutils"
    return False


def exit_on_interrupt_while_starting() -> None:
    """In `python -m tdutils` only: until `interrupt_as_exception()`, SIGINT (Ctrl-C) prints one line and ends the
    process with status 130 at once. Called first thing in `tdutils/__init__.py`, so that a Ctrl-C during the
    seconds of imports (torch, transformers) neither prints a traceback, nor leaves a half-imported module that
    fails later with an ImportError, nor is swallowed by a library's `except BaseException`. Nothing has been
    written then, so no clean-up is skipped. Other programs that import tdutils keep their own handler."""
    import signal

    if _STARTING["installed"] or not _run_as_tdutils_main():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # the program (or python -X / an embedding) chose its own handling
    signal.signal(signal.SIGINT, _exit_interrupted)
    _STARTING["installed"] = True


def _terminate_as_interrupt(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM, while the finished work is written, ends it
    _STARTING["terminated"] = True
    raise KeyboardInterrupt


def interrupted_status() -> int:
    """The exit status of a command stopped before it finished: 143 (128 + SIGTERM) when SIGTERM stopped it, else
    130 (Ctrl-C), what a shell reports for a process those signals end."""
    return TERMINATED if _STARTING["terminated"] else INTERRUPTED


def interrupt_as_exception() -> None:
    """Undo `exit_on_interrupt_while_starting`: Ctrl-C raises KeyboardInterrupt again (the commands catch it to
    write what they finished). In `python -m tdutils`, SIGTERM (`kill PID`) does the same while it has its default
    disposition: a job started with `nohup ... &` ignores SIGINT, and `kill` is then the only way to stop it without
    losing the cells it finished; a second SIGTERM ends the process at once."""
    import signal

    if _STARTING["installed"] and signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _STARTING["installed"] = False
    if _run_as_tdutils_main() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate_as_interrupt)
