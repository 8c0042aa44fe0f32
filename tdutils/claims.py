"""The figures a notebook's text relies on, recorded in its outputs so a test can check them.

A notebook states things such as "SnapKV keeps the full cache's accuracy, random dropping loses the needle"
or "fp32 re-rotation errs by the bf16 store alone". Tables and printed lines show the figures behind those
statements, but a test that looks for a column label passes whatever the numbers are. So each notebook ends
with a cell that calls `record(...)` with the figures its text relies on; `record` displays them as one
JSON output (MIME type `MIME`, with a readable text line for people), and `read` collects them from an
executed copy (papermill's output notebook), as scrapbook's "glue" does, without another dependency.
`tests/test_notebooks.py` holds the bounds and asserts each notebook's figures against them.

    from tdutils.claims import record
    record(accuracy={"baseline": 1.0, "snapkv@0.5": 0.94}, needle_tokens_kept=9, needle_tokens=9)

    from tdutils.claims import read
    read("executed/snapkv_token_dropping.ipynb")["accuracy"]["snapkv@0.5"]   # -> 0.94
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

MIME = "application/vnd.tdutils.claims+json"


def _plain(value, where: str):
    """`value` as JSON-ready Python: dicts with str keys, lists, str, bool, int, float (torch/numpy scalars
    become Python numbers). NaN and infinities are refused: a claim must be a number a bound can judge."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # torch / numpy scalar
        value = value.item()
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"claim {where} is {value}; record a finite number")
        return value
    if isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"claim {where} has type {type(value).__name__}; record numbers, strings, lists or dicts")


def record(**figures) -> dict:
    """Display `figures` as a claims output of the running notebook and return them as plain JSON values.

    Args:
        **figures: name -> number, string, bool, or a (nested) list / dict of them; torch and numpy scalars
            are converted. Outside IPython the JSON is printed on one line instead.

    Raises:
        TypeError: a value that is not JSON-like (e.g. a tensor with more than one element).
        ValueError: no figures, or a NaN or infinite number.
    """
    if not figures:
        raise ValueError("record() needs at least one figure, e.g. record(accuracy=0.95)")
    plain = _plain(figures, "claims")
    text = "claims: " + json.dumps(plain, sort_keys=True)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # plain Python: print the line
        print(text)
        return plain
    if get_ipython() is None:
        print(text)
    else:
        display({MIME: plain, "text/plain": text}, raw=True)
    return plain


def read(notebook) -> dict:
    """Every figure recorded in an executed notebook, merged in cell order (a later cell's name wins).

    Args:
        notebook: path of an `.ipynb` file or an `nbformat` notebook node.

    Returns:
        dict name -> value; empty when the notebook recorded nothing.
    """
    if isinstance(notebook, (str, Path)):
        import nbformat

        notebook = nbformat.read(str(notebook), as_version=4)
    merged: dict = {}
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if MIME in data:
                value = data[MIME]
                merged.update(json.loads(value) if isinstance(value, str) else dict(value))
    return merged


__all__ = ["MIME", "read", "record"]
