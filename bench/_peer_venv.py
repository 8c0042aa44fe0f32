"""The peer venv of `bench/peer_kvpress.py`: NVIDIA kvpress in its own environment.

kvpress pins `transformers<5.3` while tdutils runs a newer one, so kvpress never goes into tdutils' venv (the
same reason the server tier lives in its own venv, `tests/servertier.py`). The venv is built once, under
`$TDUTILS_PEER_VENV` or `~/.cache/tdutils/peer-kvpress-venv-<version>`, and reused while its marker file
matches the pinned packages:

1. `python -m venv` (the interpreter running this file);
2. `pip install torch==2.13.0` first: the CPU wheel on this machine's disk, so pip never fetches a CUDA torch;
3. `pip install kvpress==<version>` with a constraint file holding `torch==2.13.0`, so kvpress' dependencies
   (transformers <5.3, accelerate, peft, datasets, ...) cannot move torch.

    python bench/_peer_venv.py          # build (or check) it and print its folder, build seconds and size
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

KVPRESS_VERSION = "0.5.5"
TORCH_VERSION = "2.13.0"
PACKAGES = (f"torch=={TORCH_VERSION}", f"kvpress=={KVPRESS_VERSION}")
MARKER = ".tdutils-peer-venv.json"
INSTALL_TIMEOUT_S = 3600


def venv_dir() -> Path:
    """`$TDUTILS_PEER_VENV`, else a versioned folder in ~/.cache/tdutils."""
    if os.environ.get("TDUTILS_PEER_VENV"):
        return Path(os.environ["TDUTILS_PEER_VENV"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tdutils" / f"peer-kvpress-venv-{KVPRESS_VERSION}"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def venv_info(venv: Path | None = None) -> dict | None:
    """The marker of a complete venv (packages, versions, build seconds, size), or None when it must be built."""
    marker = (venv or venv_dir()) / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if info.get("packages") != list(PACKAGES) or not venv_python(venv).exists():
        return None
    return info


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def install_pinned(py: str, packages, torch_version: str, timeout: float) -> None:
    """`pip install` `packages[0]` (torch's CPU wheel) first, then the rest with a constraint file pinning
    `torch==torch_version`, so no package pulls another (CUDA) torch. Raises CalledProcessError /
    TimeoutExpired."""
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, packages[0]], check=True, timeout=timeout)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={torch_version}\n")
        constraint = f.name
    try:
        subprocess.run([*pip, "-c", constraint, *packages[1:]], check=True, timeout=timeout)
    finally:
        os.unlink(constraint)


def ensure_venv(*, timeout: float = INSTALL_TIMEOUT_S, log=print) -> Path:
    """The peer venv's python, building the venv first when it is missing or incomplete.

    Raises:
        subprocess.CalledProcessError / TimeoutExpired: venv creation, pip or the import check failed.
    """
    venv = venv_dir()
    if venv_info(venv) is not None:
        return venv_python(venv)
    if venv.exists():  # half-built (an interrupted pip): start again rather than patch it up
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the kvpress venv in {venv} (once; a few minutes)")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv_python(venv))
    install_pinned(py, PACKAGES, TORCH_VERSION, timeout)
    check = ("import torch, transformers, kvpress, importlib.metadata as m; "
             "print(torch.__version__, transformers.__version__, m.version('kvpress'))")
    out = subprocess.run([py, "-c", check], check=True, timeout=600, capture_output=True, text=True).stdout.split()
    if not out[0].startswith(TORCH_VERSION):  # the constraint should make this impossible; say so if it happens
        raise RuntimeError(f"the peer venv got torch {out[0]}, not {TORCH_VERSION}")
    info = {"packages": list(PACKAGES), "torch": out[0], "transformers": out[1], "kvpress": out[2],
            "build_s": round(time.perf_counter() - t0, 1), "size_mb": round(dir_size(venv) / 2**20),
            "built": time.strftime("%Y-%m-%d %H:%M:%S")}
    (venv / MARKER).write_text(json.dumps(info, indent=1))
    return venv_python(venv)


if __name__ == "__main__":
    py = ensure_venv()
    print(json.dumps({"python": str(py), **(venv_info() or {})}, indent=1))
