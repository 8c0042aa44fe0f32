"""Argument types and the parser shared by the command line (`python -m tdutils`) and the `bench/` scripts.

A bad option is reported in one line that names the option and what it expects, with exit status 2.
"""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (no usage block) and exits with status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v
