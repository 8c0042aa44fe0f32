"""Point the project at its repository URL: pyproject.toml and both Colab notebooks' badge and install cell.

    python tools/set_repo_url.py https://github.com/OWNER/REPO

pyproject.toml's `[project.urls] Repository` is the one place the URL lives; the Colab notebooks cannot read it
before tdutils is installed, so they carry copies that this script rewrites and tests/test_notebooks.py checks.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("colab/snapkv_colab.ipynb", "colab/rkv_colab.ipynb")


def repository_url(pyproject_text: str) -> str:
    """`[project.urls] Repository` of pyproject.toml (read with a regex: tomllib needs Python 3.11)."""
    found = re.search(r'^Repository = "([^"]+)"$', pyproject_text, re.MULTILINE)
    if not found:
        raise SystemExit("pyproject.toml has no [project.urls] Repository line")
    return found.group(1)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", args[0]):
        print("usage: python tools/set_repo_url.py https://github.com/OWNER/REPO (no trailing slash or .git)",
              file=sys.stderr)
        return 2
    new = args[0]
    pyproject = ROOT / "pyproject.toml"
    old = repository_url(pyproject.read_text(encoding="utf-8"))
    for rel in ("pyproject.toml", *NOTEBOOKS):
        path = ROOT / rel
        text = path.read_text(encoding="utf-8")
        # The badge links colab.research.google.com/github/OWNER/REPO/..., the rest the full URL.
        updated = text.replace(old, new).replace(old.removeprefix("https://github.com/") + "/blob/",
                                                 new.removeprefix("https://github.com/") + "/blob/")
        path.write_text(updated, encoding="utf-8")
        print(f"{rel}: {'updated' if updated != text else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
