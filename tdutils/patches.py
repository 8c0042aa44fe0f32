"""Apply, check and revert the vLLM patch that exports query tensors to the KV connector (SPEC §6).

    python -m tdutils.patches check    # is the installed vLLM patched?   exit 0 yes, 1 no, 2 error
    python -m tdutils.patches apply    # patch it (idempotent: a patched vLLM is left as it is)
    python -m tdutils.patches revert   # undo it (idempotent)

The diff, `vllm-export-intermediate-tensors.diff`, is written against vLLM 0.25.1's
`vllm/distributed/kv_transfer/kv_connector/v1/base.py` and
`vllm/model_executor/layers/attention/kv_transfer_utils.py`. It ships inside the package
(`tdutils/assets/patches/`, package data, so an installed wheel has it); `patches/` at the repository
root holds the same file for people who prefer `patch -p1` (a test keeps the two identical).

vLLM is found without importing it (importing vLLM is slow and may initialise CUDA): `--vllm-dir DIR`
(the folder that holds vLLM's `__init__.py`), or `--python PY` (the interpreter of vLLM's own
environment, which usually is not tdutils' environment), or else this interpreter's `vllm` package.
Versions outside 0.23.0-0.25.1 are refused. The applier is pure Python (no `patch` binary needed): each
hunk's old block is searched in the file and replaced by its new block, so it tolerates line shifts
between versions but never applies a hunk whose context does not match.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .textio import READ_ENCODING, WRITE_ENCODING, read_text

PATCH_NAME = "vllm-export-intermediate-tensors.diff"
PACKAGED_PATCH = Path(__file__).parent / "assets" / "patches" / PATCH_NAME
SUPPORTED = ((0, 23, 0), (0, 25, 1))  # inclusive range of vLLM releases the patch was tested on
SUPPORTED_TEXT = "0.23.0-0.25.1"


class PatchError(RuntimeError):
    """vLLM not found, unsupported version, unwritable files, or a file whose text the patch does not fit."""


@dataclass
class Hunk:
    """One hunk: `old` lines are replaced by `new` lines; `start` is the 1-based line in the old file."""

    start: int
    old: list[str]
    new: list[str]


@dataclass
class FilePatch:
    """The hunks of one file; `path` is relative to the folder above the `vllm` package (`vllm/...`)."""

    path: str
    hunks: list[Hunk] = field(default_factory=list)


def parse_diff(text: str) -> list[FilePatch]:
    """Parse a unified diff (`--- a/X`, `+++ b/X`, `@@ -l,n +l,n @@` hunks); text before the first file is ignored.

    Raises:
        PatchError: malformed hunk headers or hunk bodies whose line counts disagree with their header.
    """
    files: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            path = path[2:] if path.startswith(("a/", "b/")) else path
            files.append(FilePatch(path))
            i += 2
            continue
        if line.startswith("@@"):
            m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
            if not m or not files:
                raise PatchError(f"malformed hunk header in the patch: {line!r}")
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            hunk = Hunk(int(m.group(1)), [], [])
            i += 1
            while i < len(lines) and (len(hunk.old) < n_old or len(hunk.new) < n_new):
                body = lines[i]
                tag, content = (body[:1], body[1:]) if body else (" ", "")
                if tag == " ":
                    hunk.old.append(content)
                    hunk.new.append(content)
                elif tag == "-":
                    hunk.old.append(content)
                elif tag == "+":
                    hunk.new.append(content)
                elif tag != "\\":  # "\ No newline at end of file"
                    raise PatchError(f"malformed hunk line in the patch: {body!r}")
                i += 1
            if len(hunk.old) != n_old or len(hunk.new) != n_new:
                raise PatchError(f"hunk {line!r} has {len(hunk.old)} old / {len(hunk.new)} new lines, header says "
                                 f"{n_old} / {n_new}")
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise PatchError("the patch holds no file")
    return files


def _find(lines: list[str], block: list[str], near: int) -> list[int]:
    """0-based indices where `block` occurs in `lines`, nearest to line `near` first."""
    n = len(block)
    hits = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == block]
    return sorted(hits, key=lambda i: abs(i - near))


def hunk_state(lines: list[str], hunk: Hunk) -> str:
    """`"applied"` (the new block is present), `"unapplied"` (the old block is), or `"conflict"` (neither).

    The new block is looked for first: a hunk that only adds lines leaves its old context intact, so the
    old block can still match a patched file.
    """
    if _find(lines, hunk.new, hunk.start - 1):
        return "applied"
    if _find(lines, hunk.old, hunk.start - 1):
        return "unapplied"
    return "conflict"


def file_state(text: str, fp: FilePatch) -> str:
    """`"applied"`, `"unapplied"`, `"partial"` (some hunks of each) or `"conflict"` for one file's text."""
    lines = text.splitlines()
    states = {hunk_state(lines, h) for h in fp.hunks}
    if "conflict" in states:
        return "conflict"
    if states == {"applied"}:
        return "applied"
    if states == {"unapplied"}:
        return "unapplied"
    return "partial"


def transform(text: str, fp: FilePatch, *, reverse: bool = False) -> str:
    """Apply (or with `reverse`, undo) every hunk of `fp` not yet in the wanted state; returns the new text.

    Raises:
        PatchError: a hunk whose old (new, when reversing) block is not in the text.
    """
    lines = text.splitlines()
    for hunk in fp.hunks:
        src, dst = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
        state = hunk_state(lines, hunk)
        if state == ("unapplied" if reverse else "applied"):
            continue
        hits = _find(lines, src, hunk.start - 1)
        if not hits:
            raise PatchError(f"{fp.path}: the text around line {hunk.start} does not match the patch")
        i = hits[0]
        lines[i:i + len(src)] = dst
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


@dataclass
class VllmInstall:
    """Where vLLM is: `package_dir` (holds `__init__.py`), `root` (its parent: patch paths are relative to
    it), and `version` (a string, e.g. "0.25.1")."""

    package_dir: Path
    version: str

    @property
    def root(self) -> Path:
        return self.package_dir.parent


def _version_tuple(version: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise PatchError(f"cannot read vLLM's version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def read_version(package_dir: Path) -> str:
    """vLLM's version from `vllm/_version.py` (setuptools-scm) or, failing that, the dist-info next to it.

    Raises:
        PatchError: neither is readable.
    """
    vfile = package_dir / "_version.py"
    if vfile.is_file():
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", read_text(vfile))
        if m:
            return m.group(1)
    for dist in sorted(package_dir.parent.glob("vllm*.dist-info")):
        meta = dist / "METADATA"
        if meta.is_file():
            m = re.search(r"^Version:\s*(\S+)", meta.read_text(encoding=READ_ENCODING, errors="replace"), re.MULTILINE)
            if m:
                return m.group(1)
    raise PatchError(f"cannot tell the version of the vLLM in {package_dir}: no _version.py and no vllm*.dist-info")


def find_vllm(vllm_dir: str | os.PathLike | None = None, python: str | None = None, *,
              options: tuple[str, str] = ("--python", "--vllm-dir")) -> VllmInstall:
    """Locate vLLM without importing it.

    Args:
        vllm_dir: the folder holding vLLM's `__init__.py` (e.g. `.../site-packages/vllm`).
        python: an interpreter whose environment has vLLM (`find_spec("vllm")` runs there, 30 s timeout).
        options: the command-line options of the calling command that set `python` and `vllm_dir`, named
            in the "point at it" hint (`python -m tdutils.patches`: `--python`, `--vllm-dir`; `python -m
            tdutils doctor`: `--vllm-python`, `--vllm-dir`).

    Raises:
        PatchError: not found (the message says how to point at it).
    """
    if vllm_dir is not None:
        pkg = Path(vllm_dir)
        if pkg.name != "vllm" and (pkg / "vllm" / "__init__.py").is_file():
            pkg = pkg / "vllm"  # a site-packages folder or a source checkout was given
    elif python is not None:
        code = "import importlib.util as u; s = u.find_spec('vllm'); print(s.submodule_search_locations[0] if s else '')"
        try:
            out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise PatchError(f"could not ask {python} where vLLM is: {exc}") from exc
        if not out.strip():
            raise PatchError(f"vLLM is not installed for {python}; give the interpreter of vLLM's environment to "
                             f"{options[0]}, or its package folder to {options[1]}")
        pkg = Path(out.strip())
    else:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise PatchError(
                f"vLLM is not installed in this Python environment ({sys.executable}); point at it with "
                f"{options[0]} /path/to/vllm-venv/bin/python or {options[1]} /path/to/site-packages/vllm")
        pkg = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg / "__init__.py").is_file():
        raise PatchError(f"{pkg} is not a vLLM package folder (no __init__.py)")
    return VllmInstall(pkg, read_version(pkg))


def check_version(version: str) -> None:
    """Raise PatchError unless `version` lies in the tested range (local suffixes like `+cpu` ignored)."""
    v = _version_tuple(version)
    lo, hi = SUPPORTED
    if not lo <= v <= hi:
        raise PatchError(
            f"vLLM {version} is outside the range this patch was tested on ({SUPPORTED_TEXT}); the patched code is "
            f"vLLM-internal and changes between releases. Install a vLLM in that range (pip install vllm==0.25.1), "
            f"or pass --force to try anyway (a hunk whose context does not match is still refused).")


def load_patch(path: str | os.PathLike | None = None) -> list[FilePatch]:
    """The parsed patch: `path`, else the copy shipped in the package."""
    p = Path(path) if path is not None else PACKAGED_PATCH
    if not p.is_file():
        raise PatchError(f"patch file {p} not found")
    return parse_diff(read_text(p))


@dataclass
class PatchStatus:
    """State of the patch in one vLLM install: overall `state` and one state per file."""

    install: VllmInstall
    files: dict[str, str]

    @property
    def state(self) -> str:
        states = set(self.files.values())
        if states == {"applied"}:
            return "applied"
        if states == {"unapplied"}:
            return "unapplied"
        if "missing" in states or "conflict" in states:
            return "conflict"
        return "partial"


def status(install: VllmInstall, patch: list[FilePatch] | None = None) -> PatchStatus:
    """Per-file state (`applied`, `unapplied`, `partial`, `conflict`, `missing`) of the patch in `install`."""
    patch = patch if patch is not None else load_patch()
    files = {}
    for fp in patch:
        target = install.root / fp.path
        files[fp.path] = file_state(read_text(target), fp) if target.is_file() else "missing"
    return PatchStatus(install, files)


def _write(path: Path, text: str) -> None:
    """Replace `path` atomically (a crash never leaves a half-written vLLM file)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tdutils-tmp")
    except OSError as exc:
        raise PatchError(f"cannot write next to {path}: {exc}; run as the owner of vLLM's environment") from exc
    try:
        with os.fdopen(fd, "w", encoding=WRITE_ENCODING) as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def apply(install: VllmInstall, *, reverse: bool = False, patch: list[FilePatch] | None = None) -> list[str]:
    """Apply (or revert) the patch; returns one line per file saying what changed.

    Every file is checked before any is written, so a file that does not fit leaves all files untouched.

    Raises:
        PatchError: a file missing, or in a state the patch cannot fix (`conflict`).
    """
    patch = patch if patch is not None else load_patch()
    plans = []
    for fp in patch:
        target = install.root / fp.path
        if not target.is_file():
            raise PatchError(f"{target} not found: this vLLM has no {fp.path}; nothing was changed")
        text = read_text(target)
        state = file_state(text, fp)
        if state == "conflict":
            raise PatchError(f"{target} does not match the patch (changed by hand or another patch?); nothing was "
                             f"changed")
        plans.append((fp, target, text, state))
    report = []
    done_state = "unapplied" if reverse else "applied"
    for fp, target, text, state in plans:
        if state == done_state:
            report.append(f"{fp.path}: already {'reverted' if reverse else 'patched'}, unchanged")
            continue
        new = transform(text, fp, reverse=reverse)
        _write(target, new)
        delta = len(new.splitlines()) - len(text.splitlines())
        report.append(f"{fp.path}: {'reverted' if reverse else 'patched'} ({len(fp.hunks)} hunk"
                      f"{'s' if len(fp.hunks) != 1 else ''}, {delta:+d} lines)")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tdutils.patches",
                                 description="Apply, check or revert the vLLM patch that exports query tensors "
                                             "to the KV connector (needed by policies that use queries).")
    ap.add_argument("action", choices=("check", "apply", "revert"))
    ap.add_argument("--vllm-dir", help="folder holding vLLM's __init__.py (default: find it without importing it)")
    ap.add_argument("--python", help="interpreter of vLLM's own environment, used to find vLLM")
    ap.add_argument("--patch", help=f"patch file (default: the {PATCH_NAME} shipped with tdutils)")
    ap.add_argument("--force", action="store_true", help=f"try a vLLM outside {SUPPORTED_TEXT}")
    args = ap.parse_args(argv)
    try:
        install = find_vllm(args.vllm_dir, args.python)
        print(f"vLLM {install.version} at {install.package_dir}")
        if not args.force:
            check_version(install.version)
        patch = load_patch(args.patch)
        if args.action == "check":
            st = status(install, patch)
            for path, state in st.files.items():
                print(f"  {path}: {state}")
            print(f"patch {PATCH_NAME}: {st.state}")
            if st.state == "unapplied":
                print("apply it with: python -m tdutils.patches apply" + (f" --python {args.python}" if args.python
                                                                         else ""))
            return 0 if st.state == "applied" else 1 if st.state == "unapplied" else 2
        for line in apply(install, reverse=args.action == "revert", patch=patch):
            print("  " + line)
        return 0
    except (PatchError, OSError) as exc:
        print(f"tdutils.patches: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
