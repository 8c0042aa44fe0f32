"""`bench/policy_cost.py`: the smoke run (bundled tiny model, seconds), its stored table, bad arguments."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "policy_cost.py"


def _bench(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          timeout=300)


def _module():
    spec = importlib.util.spec_from_file_location("policy_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_run_times_every_policy_and_stores_a_table(tmp_path):
    out = tmp_path / "cost.json"
    p = _bench("--smoke", "--threads", "1", "--json", str(out))
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    assert names == list(_module().VARIANTS)
    m = report["meta"]
    assert m["smoke"] and m["model"] == "tiny-qwen3" and m["num_requests"] == 2 and m["threads"] == 1
    for r in report["rows"]:
        assert r["modify_s"] > 0 and r["score_s"] <= r["modify_s"]
        assert r["per_request_ms"] == 1e3 * r["modify_s"] / 2
        assert abs(r["per_layer_ms"] - r["per_request_ms"] / m["num_layers"]) < 1e-9
        assert r["kept_tokens"] < 2 * m["prompt_tokens"]  # something was dropped
    assert "| rkv_tiled |" in p.stdout and "smoke run: timings not judged" in p.stdout
    s = _bench("--summary", str(out))
    assert s.returncode == 0 and s.stdout.splitlines()[0].startswith("| policy | modify s |")


def test_bad_arguments_fail_in_one_line():
    p = _bench("--policies", "snapkv,foo")
    assert p.returncode == 2 and "unknown policy 'foo'" in p.stderr and p.stdout == ""
    p = _bench("--drop-ratio", "1")
    assert p.returncode == 2 and "expected a drop ratio in (0, 1), got '1'" in p.stderr
    p = _bench("--smoke", "--model", "/nonexistent/model-folder")  # a path: no hub look-up
    assert p.returncode == 2 and p.stderr.startswith("bench/policy_cost.py: error: --model '/nonexistent/model-fold"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
