"""`tdutils.models.resolve_model`: one record per model name (kind, what to load, tokenizer source) that loading,
the tokenizer and the command line read; and the one-line errors for names that resolve to nothing."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tdutils import gguf
from tdutils.models import (
    RANDOM_MAX_POSITIONS,
    RULER_MODEL_DIR,
    TINY_MODEL_DIR,
    ModelRef,
    context_window,
    load_model,
    load_tokenizer,
    resolve_model,
)


def _folder(path: Path, *, weights: bool = True) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_bundled_names_resolve_to_their_folder_and_word_level_tokenizer():
    assert resolve_model("tiny-qwen3") == ModelRef("tiny-qwen3", "bundled", str(TINY_MODEL_DIR), "word-level", None)
    ruler = resolve_model("tiny-qwen3-ruler")
    assert (ruler.kind, ruler.target, ruler.tokenizer) == ("bundled", str(RULER_MODEL_DIR), "word-level")
    assert ruler.files() == str(RULER_MODEL_DIR)


def test_packaged_names_are_converted_by_gguf_only_when_their_files_are_asked_for(monkeypatch):
    ref = resolve_model("gemma3-270m")
    assert ref == ModelRef("gemma3-270m", "packaged", "gemma3-270m", "checkpoint", None)
    calls = []
    monkeypatch.setattr(gguf, "packaged_folder", lambda name, **kw: calls.append((name, kw)) or Path("/cache/m"))
    assert ref.files(progress=False, fetch=False) == "/cache/m"
    assert calls == [("gemma3-270m", {"fetch": False, "progress": False})]


def test_gguf_paths_resolve_to_the_expanded_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.GGUF").write_bytes(b"GGUF")
    assert resolve_model("~/m.GGUF") == ModelRef("~/m.GGUF", "gguf", str(tmp_path / "m.GGUF"), "checkpoint", None)
    assert resolve_model(tmp_path / "m.GGUF").name == str(tmp_path / "m.GGUF")  # a Path is taken as its text


def test_random_names_resolve_to_an_architecture_and_the_id_tokenizer():
    ref = resolve_model("random:Qwen3-0.6B:4L")
    assert ref == ModelRef("random:Qwen3-0.6B:4L", "random", "qwen3-0.6b", "ids", 4)
    assert resolve_model("random:qwen3-8b").num_layers is None
    with pytest.raises(ValueError, match="has random weights and no files"):
        ref.files()
    assert load_tokenizer(ref).decode([7, 151935]) == "<7> <151935>"
    assert context_window(ref) == RANDOM_MAX_POSITIONS == 40960


def test_folders_resolve_to_themselves_and_are_checked_for_weights_only_when_asked(tmp_path):
    full = _folder(tmp_path / "full")
    assert resolve_model(str(full)) == ModelRef(str(full), "folder", str(full), "checkpoint", None)
    bare = _folder(tmp_path / "bare", weights=False)
    assert resolve_model(str(bare), weights=False).kind == "folder"
    with pytest.raises(FileNotFoundError, match=r"has no weights \(\*\.safetensors or \*\.bin\); pass a folder"):
        resolve_model(str(bare))


def test_other_names_are_hub_ids():
    assert resolve_model("Qwen/Qwen3-0.6B") == ModelRef("Qwen/Qwen3-0.6B", "hub", "Qwen/Qwen3-0.6B", "checkpoint")
    assert resolve_model("gpt2").kind == "hub"
    assert resolve_model("gpt2").files(fetch=False) == "gpt2"


def test_the_record_is_frozen_and_resolving_it_again_returns_it():
    ref = resolve_model("tiny-qwen3")
    assert resolve_model(ref) is ref
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.kind = "hub"


@pytest.mark.parametrize("name,error,message", [
    ("smollm2", FileNotFoundError,
     "model 'smollm2' is neither a local folder nor a bundled or packaged model: did you mean 'smollm2-135m'?"),
    ("./no-such-model", FileNotFoundError, ("model folder './no-such-model' does not exist; pass a folder with "
     "config.json, the weights and the tokenizer (e.g. made by `hf download Qwen/Qwen3-0.6B --local-dir DIR`), a hub "
     "id such as 'Qwen/Qwen3-0.6B', or 'tiny-qwen3'")),
    ("/no/such.gguf", FileNotFoundError, ("GGUF file '/no/such.gguf' does not exist; pass an existing .gguf file, or "
     "one of the packaged real models smollm2-135m, gemma3-270m")),
    ("random:llama-9b", ValueError,
     "unknown random architecture 'llama-9b' in 'random:llama-9b'; known: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b"),
    ("random:qwen3-0.6b:4", ValueError, ("model 'random:qwen3-0.6b:4': the layer count must look like 4L (a positive "
     "number then L), got '4'")),
    (42, TypeError, "model must be a name, path or hub id (str), got int 42"),
])
def test_bad_names_fail_in_one_line_saying_what_to_do(name, error, message):
    with pytest.raises(error) as info:
        resolve_model(name)
    assert str(info.value) == message


def test_check_false_resolves_from_the_spelling_alone():
    assert resolve_model("./no-such-model", check=False) == ModelRef("./no-such-model", "hub", "./no-such-model")
    assert resolve_model("/no/such.gguf", check=False).kind == "gguf"


def test_load_model_reads_the_record_and_reports_the_name_asked_for():
    model, tok = load_model(resolve_model("tiny-qwen3"), device="cpu", progress=False)
    assert model.name_or_path == "tiny-qwen3" and model.config.num_hidden_layers == 2
    assert tok.name_or_path == str(TINY_MODEL_DIR)


def test_the_cli_prints_one_line_for_a_near_miss_of_a_packaged_name():
    p = subprocess.run([sys.executable, "-m", "tdutils", "run", "--model", "gemma3", "--num-requests", "1"],
                       check=False, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("python -m tdutils run: error: model 'gemma3' is neither a local folder nor a "
                                "bundled or packaged model: did you mean 'gemma3-270m'?")
