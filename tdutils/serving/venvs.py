"""Separate venvs for packages that pin another torch or transformers than tdutils' (vLLM + LMCache, kvpress,
OpenVINO): `install_venv` builds one, `CachedVenv` keeps one built under `~/.cache/tdutils` behind a marker file
(the server test tier, `bench/peer_kvpress.py`, `bench/peer_openvino.py`), `pip_install_keeping_torch` adds
packages to an environment without replacing its torch (the Colab notebooks' kernel).

Stdlib only: `bench/harness.py` loads this file by its path, also inside the peer venvs, which have no tdutils.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARKER = ".tdutils-peer-venv.json"


def pip_install(python, packages, *, torch: str | None = None, timeout_s: float = 1800) -> None:
    """`python -m pip install -q packages`; with `torch` (a version), `torch==<torch>` is a pip constraint, so a
    package that needs another torch makes pip fail with a resolution error instead of replacing it.

    Raises:
        subprocess.CalledProcessError: pip failed (its output is above); subprocess.TimeoutExpired.
    """
    cmd = [str(python), "-m", "pip", "install", "-q", *packages]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        if torch:
            f.write(f"torch=={torch}\n")
            cmd += ["-c", f.name]
    try:
        subprocess.run(cmd, check=True, timeout=timeout_s)
    finally:
        os.unlink(f.name)


def pip_install_keeping_torch(*packages: str, python: str = sys.executable, timeout_s: float = 1800) -> None:
    """`pip install packages` into `python`'s environment without ever replacing its torch (`pip_install` with
    the installed torch's version; no torch there: nothing to keep), so Colab's CUDA build stays.

    Raises:
        subprocess.CalledProcessError: pip failed (its output is above); subprocess.TimeoutExpired.
    """
    probe = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                           timeout=120, check=False)
    pip_install(python, packages, torch=probe.stdout.strip() if probe.returncode == 0 else None, timeout_s=timeout_s)


def pinned_torch(packages) -> str | None:
    """The torch version the first of `packages` pins (`"torch==2.13.0"` -> `"2.13.0"`), else None."""
    first = next(iter(packages), "")
    return first.split("==", 1)[1] if first.startswith("torch==") else None


def install_venv(path: str | os.PathLike, packages, *, remove=(), timeout_s: float = 3600) -> Path:
    """Create a venv at `path` (unless its python already exists) and pip-install `packages` into it.

    Args:
        packages: pip requirements, e.g. `["vllm==0.25.1", "lmcache==0.5.6"]`. When the first pins torch
            (`torch==2.13.0`: the CPU wheel from this machine's wheels), it goes in first and the rest install
            with that torch as a constraint (no package pulls a CUDA torch).
        remove: distributions to uninstall afterwards (CUDA builds of torchvision/torchaudio/torchcodec that
            some packages pull in break the transformers import on a CPU torch).

    Returns:
        The venv's python.

    Raises:
        subprocess.CalledProcessError / TimeoutExpired: venv creation or pip failed.
    """
    py = Path(path) / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    packages, torch = list(packages), pinned_torch(packages)
    if torch:
        pip_install(py, packages[:1], timeout_s=timeout_s)
    pip_install(py, packages[1:] if torch else packages, torch=torch, timeout_s=timeout_s)
    if remove:
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *remove], check=True, timeout=600)
    return py


class CachedVenv:
    """A venv built once (`install_venv`) under `$env_var` or `~/.cache/tdutils/<name>` and reused while its
    marker file (written last, so an interrupted build has none) names the same `packages`. After the install,
    `check` (Python code) runs in it and prints the versions named `versions` (torch's first when `packages[0]`
    pins torch, which must match); the marker records them with the build seconds and size."""

    def __init__(self, name: str, env_var: str, packages, check: str, versions=(), remove=(), marker: str = MARKER):
        self.name, self.env_var, self.packages = name, env_var, tuple(packages)
        self.check, self.versions, self.remove, self.marker = check, tuple(versions), tuple(remove), marker

    def dir(self) -> Path:
        if os.environ.get(self.env_var):
            return Path(os.environ[self.env_var]).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tdutils" / self.name

    def python(self, venv: Path | None = None) -> Path:
        return (venv or self.dir()) / "bin" / "python"

    def info(self, venv: Path | None = None) -> dict | None:
        """The marker of a complete venv (packages, versions, build seconds, size), or None when it must be built."""
        try:
            info = json.loads(((venv or self.dir()) / self.marker).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if info.get("packages") != list(self.packages) or not self.python(venv).exists():
            return None
        return info

    def ensure(self, *, timeout: float = 3600, log=print) -> Path:
        """The venv's python, building the venv first when it is missing or incomplete.

        Raises:
            subprocess.CalledProcessError / TimeoutExpired: venv creation, pip or the check failed.
            RuntimeError: the venv got another torch than `packages[0]` pins.
        """
        venv = self.dir()
        if self.info(venv) is not None:
            return self.python(venv)
        if venv.exists():  # half-built (an interrupted pip): start again rather than patch it up
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        log(f"building the venv {venv} (once; a few minutes)")
        t0 = time.perf_counter()
        py = install_venv(venv, self.packages, remove=self.remove, timeout_s=timeout)
        out = subprocess.run([str(py), "-c", self.check], check=True, timeout=600, capture_output=True, text=True,
                             stdin=subprocess.DEVNULL).stdout.split()
        torch = pinned_torch(self.packages)
        if torch and not out[0].startswith(torch):  # the constraint should make this impossible; say so if it does
            raise RuntimeError(f"the venv {venv} got torch {out[0]}, not {torch}")
        size = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())
        info = {"packages": list(self.packages), **({"removed": list(self.remove)} if self.remove else {}),
                **dict(zip(self.versions, out)), "build_s": round(time.perf_counter() - t0, 1),
                "size_mb": round(size / 2**20), "built": time.strftime("%Y-%m-%d %H:%M:%S")}
        (venv / self.marker).write_text(json.dumps(info, indent=1), encoding="utf-8")
        return py
