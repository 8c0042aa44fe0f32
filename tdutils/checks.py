"""Checks of settings shared by the engines and the modules below them: integer counts, timeouts, temperatures,
per-request decode lengths, drop ratios.

A leaf module (standard library only, no torch): `tdutils.runs`, `tdutils.compression`, `tdutils.selection`, the
engines and the command line (`tdutils.cli.args`) all check with it, so none of them imports another for a check.
Each check returns the value in its canonical type and raises TypeError / ValueError with a one-line message that
names the setting and what to pass.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable


def check_drop_ratio(drop_ratio: float) -> float:
    """Return `drop_ratio` as a float; ValueError unless it is a finite number in [0, 1] (a bool or a string
    is not a number here, though Python's `float` would take both)."""
    if isinstance(drop_ratio, (bool, str, bytes)):
        raise ValueError(f"drop_ratio must be a number in [0, 1], got {drop_ratio!r}")  # noqa: TRY004 (documented ValueError)
    try:
        r = float(drop_ratio)
    except (TypeError, ValueError):
        raise ValueError(f"drop_ratio must be a number in [0, 1], got {drop_ratio!r}") from None
    if not math.isfinite(r) or r < 0.0 or r > 1.0:
        raise ValueError(f"drop_ratio must lie in [0, 1] (the fraction of tokens removed), got {drop_ratio!r}")
    return r


GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily


def check_temperature(temperature) -> float:
    """The sampling temperature as a float: a finite number >= 0; below `GREEDY_BELOW` (1e-5, vLLM's
    convention) decoding is greedy (dividing logits by a smaller temperature overflows float32).

    Raises:
        ValueError: a bool, a non-number, NaN, infinity or a negative value.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    return float(temperature)


def check_count(value, name: str, minimum: int, *, none: str | None = None) -> int | None:
    """An integer setting as an int: `>= minimum`, or None when `none` says what None means.

    Accepts Python and numpy / torch integer scalars; refuses bools, floats (also 4000.0 and NaN) and strings,
    which would otherwise surface deep inside decode (a NaN budget as "cannot reshape tensor of 0 elements").

    Raises:
        TypeError: not an integer (the message names `name` and what to pass).
        ValueError: an integer below `minimum`.
    """
    what = f"an integer >= {minimum}" + (f", or None ({none})" if none else "")
    if value is None and none:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})") from None
    if value < minimum:
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def check_seconds(value, name: str) -> float:
    """A timeout as a float: a finite number of seconds > 0.

    Raises:
        TypeError: a bool, a string or another non-number.
        ValueError: zero, negative, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite number of seconds > 0, got {value!r} ({type(value).__name__})")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class CountSetting:
    """An engine attribute holding an integer setting, checked by `check_count` whenever it is set (in
    `__init__` and later, e.g. `engine.kv_budget_tokens = 4096`)."""

    def __init__(self, minimum: int, none: str | None = None):
        self.minimum, self.none = minimum, none

    def __set_name__(self, owner, name):
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj, value):
        setattr(obj, self.slot, check_count(value, self.name, self.minimum, none=self.none))


def check_engine_settings(kv_budget_tokens, max_batch_size, query_window) -> None:
    """Settings every engine shares: a positive budget and batch cap, a query window >= 0 (None means
    unlimited / all tokens). Raises TypeError for a non-integer, ValueError for one out of range."""
    check_count(kv_budget_tokens, "kv_budget_tokens", 1, none="unlimited")
    check_count(max_batch_size, "max_batch_size", 1, none="no cap")
    check_count(query_window, "query_window", 0, none="all prompt tokens")


def check_max_tokens(max_tokens, num_requests: int) -> list[int]:
    """Tokens to generate per request: one integer for all, or one per request (a list, tuple, numpy array or
    tensor of integers).

    Raises:
        TypeError: a string, None, a float or another non-integer (entry named).
        ValueError: an entry < 1, or a per-request sequence whose length is not `num_requests`.
    """
    if isinstance(max_tokens, str) or max_tokens is None:
        raise TypeError(f"max_tokens must be an integer >= 1 or one per request, got {max_tokens!r}")
    if hasattr(max_tokens, "tolist") and getattr(max_tokens, "ndim", 1) == 0:
        max_tokens = max_tokens.tolist()  # a numpy / torch scalar
    if isinstance(max_tokens, Iterable):
        values = list(max_tokens.tolist() if hasattr(max_tokens, "tolist") else max_tokens)
        if len(values) != num_requests:
            raise ValueError(f"max_tokens has {len(values)} entries for {num_requests} requests; pass one integer, "
                             f"or one per request")
        return [check_count(m, f"max_tokens[{i}]", 1) for i, m in enumerate(values)]
    return [check_count(max_tokens, "max_tokens", 1)] * num_requests


def admits(reserved: int, need: int, running: int, budget: int | None, max_batch_size: int | None) -> bool:
    """Whether a request reserving `need` KV tokens may join `running` requests that reserve `reserved` in all:
    the sum stays within `budget` (None: unlimited) and the batch within `max_batch_size` (None: no cap)."""
    return (budget is None or reserved + need <= budget) and (max_batch_size is None or running < max_batch_size)
