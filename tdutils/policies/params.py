"""Checks for the fields of the policies' parameter dataclasses.

A policy's parameters are a dataclass whose `__post_init__` validates every field once, when the drop
function is built (`make_drop_fn`) or a public scoring function is called, never per request. These helpers
keep the messages alike: each names the field, what it must be, and the value it got (`{value!r}`, so a
string `"8"` reads differently from the number 8). A bool is never a number here, though Python treats it as
one (`True == 1`).
"""

from __future__ import annotations

import math


def is_number(x) -> bool:
    """A finite real number: an int or a float, not a bool, a string, NaN or infinity."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x) -> bool:
    """A whole number: an int, or a float without a fractional part (`8.0`, as JSON may give it); no bool."""
    return is_number(x) and int(x) == x


def check_int(value, name: str, low: int = 0, why: str = "") -> None:
    """ValueError unless `value` is a whole number >= `low`: "`name` must be a positive integer" (`low=1`) or
    "... an integer >= `low`", then `why` in parentheses when given, then what it got."""
    if not (is_int(value) and value >= low):
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {what}{f' ({why})' if why else ''}, got {value!r}")


def check_odd_kernel(value, name: str = "kernel_size") -> None:
    """ValueError unless `value` is an odd whole number >= 1 (a pooling kernel with same padding; 1 = none)."""
    if not (is_int(value) and value >= 1 and value % 2 == 1):
        raise ValueError(f"{name} must be an odd number >= 1 (1 = no pooling), got {value!r}")


def check_choice(value, name: str, choices) -> None:
    """ValueError unless `value` is one of `choices`: "`name` must be 'a' or 'b'" (two) or "one of (...)"."""
    if value not in tuple(choices):
        what = " or ".join(map(repr, choices)) if len(choices) == 2 else f"one of {tuple(choices)}"
        raise ValueError(f"{name} must be {what}, got {value!r}")


__all__ = ["check_choice", "check_int", "check_odd_kernel", "is_int", "is_number"]
