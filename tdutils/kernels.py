"""Compiled CPU kernels of the `hf` engine's decode step, built on first use with torch's C++ extension loader.

`decode_attention_kernel()` returns the compiled decode attention (`tdutils/csrc/decode_attention.cpp`: one query
token per row over a KV cache read in place, GQA without copies, each key and value row streamed once, AVX-512
where the CPU has it) or None where it cannot be built: then `tdutils.attention.decode_attention` computes the same
attention with batched matmuls, and one line says why. `step_kernels()` returns the same build's fused elementwise
ops of the lean decode step (`tdutils/csrc/decode_step.cpp`: RMSNorm; rotary embedding with the slot store write),
or None where it cannot be built (then `tdutils.engines.lean_step` runs them as torch ops). `linear_kernels(dtype)`
returns the linear layers of the decode step (`tdutils/csrc/linear.cpp`: weights packed in column panels, streamed
once per call), or None where the build has no path for `dtype` (then `tdutils.engines.packed` keeps oneDNN). The first call on a machine compiles it (about 15 s on 2
cores; torch caches the build under `TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); later
processes load the cached build in well under a second.

Needs a C++ compiler (`c++`/`g++`, or `CXX`) and ninja (a requirement of tdutils). `TDUTILS_DECODE_KERNEL=0`
turns the kernel off (the matmul path only), e.g. to compare the two.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("decode_attention.cpp", "decode_step.cpp", "linear.cpp")]
NAME = "tdutils_kernels"
# -fopenmp: at::parallel_for's OpenMP regions (the work items spread over torch's threads); the module then needs
# libgomp.so.1, which the loader finds already loaded with torch (one OpenMP runtime, torch.set_num_threads applies)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]
ENV = "TDUTILS_DECODE_KERNEL"
# torch's loader guards a build with a `lock` file in the build directory and waits, without a time limit, while it
# exists: a build killed hard (kill -9, out of memory) leaves it behind. A build takes ~15 s (a minute on a loaded
# machine), so a lock older than STALE_LOCK_S is a dead build's, removed; a younger one is waited for, polled,
# at most LOCK_WAIT_S, then this process uses the matmul path.
STALE_LOCK_S = 120.0
LOCK_WAIT_S = 150.0

_lock = threading.Lock()
_state: dict = {}  # "ops": the loaded ops namespace or None, "why": why not


def decode_attention_kernel():
    """The compiled `decode_attention_out(q, k, v, mask, scaling, out)` op, or None where it cannot be built
    (no compiler or ninja, a failed build, `TDUTILS_DECODE_KERNEL=0`); builds it on the first call (one line on
    stderr while it compiles, one line when it is unavailable). Never raises.

    The op's contract (shapes, dtypes): `tdutils/csrc/decode_attention.cpp`'s header; `decode_attention` calls it.
    """
    ops = _ops()
    return None if ops is None else ops.decode_attention_out


def step_kernels():
    """The namespace of the compiled lean-step ops, `rms_norm_out(x, w, eps, mode, out)` and `rope_write_out(q, k, v,
    cos, sin, key_store, value_store, lengths, q_out)` (contracts: `tdutils/csrc/decode_step.cpp`'s header), or
    None where the kernels cannot be built (as `decode_attention_kernel`). Never raises."""
    return _ops()


def linear_kernels(dtype: torch.dtype):
    """`(pack_linear, linear_out)`, the compiled linear ops for weights in `dtype` (contracts:
    `tdutils/csrc/linear.cpp`'s header), or None where the kernels cannot be built or the build has no path for
    `dtype` (float32 needs AVX-512, bfloat16 AVX512-BF16; other dtypes: never). Never raises."""
    ops = _ops()
    if ops is None or dtype not in (torch.float32, torch.bfloat16) or not ops.linear_native(torch.empty(0, dtype=dtype)):
        return None
    return ops.pack_linear, ops.linear_out


def _ops():
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"], _state["why"] = _build()
            if _state["ops"] is None and _state["why"]:
                print(f"tdutils: decode attention falls back to batched matmuls: {_state['why']}", file=sys.stderr,
                      flush=True)
    return _state["ops"]


def kernel_status() -> str:
    """One line: whether the compiled decode attention is in use, and why not (builds it if not tried yet)."""
    op = decode_attention_kernel()
    return "compiled decode attention: in use" if op is not None else \
        f"compiled decode attention: not in use ({_state.get('why') or 'unknown'})"


def _build():
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None, ""  # asked for: no line
    if hasattr(torch.ops, NAME) and hasattr(getattr(torch.ops, NAME), "linear_out"):
        return getattr(torch.ops, NAME), ""  # loaded by another copy of this module
    import shutil

    bin_dir = str(Path(sys.executable).parent)  # pip's ninja lives beside the interpreter of an unactivated venv
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir) is not None:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")  # torch's loader looks on PATH
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
    except Exception as exc:  # noqa: BLE001 - any missing piece means the matmul path
        return None, f"ninja is missing ({exc}); pip install ninja"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return None, f"no C++ compiler ({cxx}, g++) on PATH"
    try:
        # one build per CPU type (-march=native code from a newer CPU would crash an older one sharing the home
        # directory: a cluster's nodes) and per source version (two checkouts of tdutils on one machine would
        # otherwise rebuild over each other's build, each waiting on the other's lock)
        build_dir = Path(cpp_extension._get_build_directory(NAME, verbose=False)).with_name(
            f"{NAME}-{_cpu_tag()}-{_source_tag()}")
        build_dir.mkdir(parents=True, exist_ok=True)
        busy = _wait_for_lock(build_dir / "lock")
        if busy:
            return None, busy
        if not (build_dir / f"{NAME}.so").exists():
            print("tdutils: compiling the CPU decode attention kernel (once per machine, ~15 s)", file=sys.stderr,
                  flush=True)
        cpp_extension.load(NAME, sources=[str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=LDFLAGS,
                           build_directory=str(build_dir), is_python_module=False, verbose=False)
        return getattr(torch.ops, NAME), ""
    except Exception as exc:  # noqa: BLE001 - a failed build falls back, with the reason
        msg = str(exc).strip().splitlines()
        return None, f"the build failed ({msg[-1] if msg else type(exc).__name__})"


def _wait_for_lock(lock: Path) -> str:
    """Wait while another process builds (its `lock` younger than `STALE_LOCK_S`, at most `LOCK_WAIT_S`); remove
    a stale lock. Returns "" when the build may go ahead, else why this process falls back."""
    import time

    deadline, said = time.monotonic() + LOCK_WAIT_S, False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return ""
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            print(f"tdutils: removed {lock}, left {age:.0f} s ago by a kernel build that was killed", file=sys.stderr,
                  flush=True)
            return ""
        if time.monotonic() > deadline:
            return (f"another process has been compiling it for {age:.0f} s ({lock}); if none is, delete that file")
        if not said:
            print(f"tdutils: waiting for another process compiling the decode attention kernel ({lock})",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(0.5)


def _source_tag() -> str:
    """A short hash of the kernel sources and compiler flags."""
    import hashlib

    digest = hashlib.sha1(" ".join(FLAGS + LDFLAGS).encode())
    for path in SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction sets (its model name and flags where the OS lists them)."""
    import hashlib
    import platform

    desc = platform.machine() + platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
        desc += "".join(line for line in info if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(desc.encode()).hexdigest()[:10]
