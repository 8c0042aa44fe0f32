"""Issue 47 (turn 4 of the input-fault hunt), the command line, benches and model loading: each finding's test
(items 5, 7, 8, 9, 10 and the CLI / model parts of 11)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    return env


# ------------------------------------------------------------------------------------------ item 10: Ctrl-C
@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0, 3.5])
def test_ctrl_c_while_starting_ends_in_one_line_with_130(tmp_path, delay):
    """SIGINT at several instants of `python -m tdutils run`'s first seconds (imports): one line on stderr and
    exit status 130, never a traceback, an ImportError or a run that goes on."""
    out = tmp_path / "run.json"
    proc = subprocess.Popen([sys.executable, "-m", "tdutils", "run", "--num-requests", "2", "--repeats", "1",
                             "--max-tokens", "2", "--json", str(out), "--no-progress"], cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert proc.returncode == 130, (proc.returncode, stderr[-2000:])
    assert len(lines) == 1 and "interrupted" in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr
