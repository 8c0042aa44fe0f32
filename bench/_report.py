"""JSON output shared by the bench scripts (run as `python bench/NAME.py`, so this folder is on sys.path)."""

from __future__ import annotations

import json


def write_json(results: dict, dest: str) -> None:
    """Write `results` as indented JSON to the file `dest`, or to stdout when `dest` is "-"."""
    text = json.dumps(results, indent=2)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")
