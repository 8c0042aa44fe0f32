"""`python bench/throughput.py` and `python bench/accuracy.py` with bad arguments: one line, exit 2, before the model."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tdutils.policies import get_policy, policy_names

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = [n for n in policy_names() if get_policy(n).builtin]  # what a fresh process knows
PROG = "bench/throughput.py: error: "


def _bench(script, *args, cwd=None):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], check=False, capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("args,msg", [
    (["--drop-ratios", "abc"], ("argument --drop-ratios: 'abc' is not a number; give comma-separated ratios in (0, 1), "
                               "e.g. 0.5,0.75 (see --help)")),
    (["--drop-ratios", "0.5,0"], ("argument --drop-ratios: 0 is not in (0, 1): the baseline (ratio 0) always runs, and "
                                 "a ratio of 1 keeps only the always-kept tokens; give ratios such as 0.5,0.75 (see --help)")),
    (["--drop-ratios", "1"], ("argument --drop-ratios: 1 is not in (0, 1): the baseline (ratio 0) always runs, and "
                             "a ratio of 1 keeps only the always-kept tokens; give ratios such as 0.5,0.75 (see --help)")),
    (["--policies", "snapkv,foo"], ("argument --policies: unknown policy 'foo'; give comma-separated names from "
                                   f"{', '.join(BUILTIN)} (see --help)")),
    (["--num-requests", "0"], "argument --num-requests: expected a positive integer, got 0 (see --help)"),
    (["--repeats", "0"], "argument --repeats: expected a positive integer, got 0 (see --help)"),
    (["--full-requests", "0"], ("argument --full-requests: expected a number >= 1 (the budget must hold one undropped "
                               "request), got '0' (see --help)")),
    (["--dataset", "samples"], ("dataset 'samples' is not a bundled dataset, an existing file or a hub id "
                               "(owner/name): did you mean 'sample'?")),
    (["--plot", "out.xyz"], ("--plot 'out.xyz' has extension '.xyz', which matplotlib cannot save; use one of .avif, "
                            ".eps, .gif, .jpeg, .jpg, .pdf, .pgf, .png, .ps, .raw, .rgba, .svg, .svgz, .tif, .tiff, "
                            ".webp")),
])
def test_throughput_bad_arguments_fail_in_one_line(args, msg):
    p = _bench("throughput.py", *args)
    assert p.returncode == 2 and p.stderr.strip() == PROG + msg, p.stderr
    assert p.stdout == ""  # failed before loading the model (which prints the run header)


def test_throughput_dataset_and_model_problems_fail_in_one_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    p = _bench("throughput.py", "--dataset", str(data), "--num-requests", "2")
    assert p.returncode == 2 and p.stderr.strip() == (
        f"{PROG}dataset '{data}' has no column 'prompt'; columns: ['text']. From Python pass "
        f"load_prompts(..., prompt_column=NAME); the command line reads a column named 'prompt'."), p.stderr
    p = _bench("throughput.py", "--dataset", str(tmp_path / "missing.jsonl"))
    assert p.returncode == 2 and p.stderr.strip().startswith(f"{PROG}dataset file '{tmp_path / 'missing.jsonl'}' "
                                                             f"does not exist"), p.stderr
    p = _bench("throughput.py", "--model", str(tmp_path), "--num-requests", "2")
    assert p.returncode == 2 and p.stderr.strip().startswith(f"{PROG}model folder '{tmp_path}' has no config.json"), \
        p.stderr


def test_throughput_table_prints_plain_numbers():
    spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "bench" / "throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = pd.DataFrame([
        {"config": "baseline", "decode_tok_s_median": 3061.7, "decode_tok_s_min": 2990.2, "decode_tok_s_max": 3101.9,
         "peak_batch": 4, "modify_s": 0.0, "modify_of_base_decode": 0.0, "decode_speedup": 1.0,
         "decode_speedup_min": 1.0, "decode_speedup_max": 1.0,
         "capacity_limit": 1.0, "of_limit": 1.0, "e2e_speedup": 1.0},
        {"config": "snapkv@0.5", "decode_tok_s_median": 6123.4, "decode_tok_s_min": 6001.0, "decode_tok_s_max": 6200.5,
         "peak_batch": 8, "modify_s": 0.0412, "modify_of_base_decode": 0.0661, "decode_speedup": 2.0003,
         "decode_speedup_min": 1.9612, "decode_speedup_max": 2.0551,
         "capacity_limit": 2.0, "of_limit": 1.00015, "e2e_speedup": 1.456},
    ]).set_index("config")
    text = bench.H.render("throughput", table)
    assert "e+" not in text
    assert text.splitlines()[-2].split() == ["baseline", "3062", "2990", "3102", "4", "0.000", "0.000", "1.00", "1.00",
                                             "1.00", "1.00", "1.00", "1.00"]
    assert text.splitlines()[-1].split() == ["snapkv@0.5", "6123", "6001", "6200", "8", "0.041", "0.066", "2.00",
                                             "1.96", "2.06", "2.00", "1.00", "1.46"]
    table["kept_fraction"] = [1.0, 0.5]
    assert bench.batch_notes(table, 16, 4624, 1024, 64) == []  # 8 of 16 requests: the budget capped the batch
    assert bench.batch_notes(table, 8, 4624, 1024, 64) == []  # all 8 ran together, but 9 x 576 > 4624
    (note,) = bench.batch_notes(table, 8, 6000, 1024, 64)  # 9 x 576 = 5184 would have fit
    assert note.startswith("snapkv@0.5: all 8 requests decoded in one batch and the KV budget would hold more")


def test_accuracy_script_reports_bad_values_in_one_line(tmp_path):
    p = _bench("accuracy.py", "--n", "0", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == "accuracy.py: error: --n must be >= 1, got 0", p.stderr
    assert not (tmp_path / "runs").exists()


def test_engine_bench_smoke_run_writes_every_figure(tmp_path):
    """The CI smoke mode of bench/engine_bench.py: tiny sizes, every arm, prefill and a stand-in "vLLM" Python
    that answers the script's protocol (real vLLM runs only by hand); shapes and consistency, no timing targets."""
    fake = tmp_path / "fake_vllm_python"
    # answers like VLLM_SCRIPT; its argv: itself -c SCRIPT folder mode points steps repeats vocab
    fake.write_text("#!" + sys.executable + "\n"
                    "import json, sys\n"
                    "if sys.argv[2] == 'import vllm':\n    sys.exit(0)\n"  # the up-front probe
                    "mode, points = sys.argv[4], json.loads(sys.argv[5])\n"
                    "s = 0.002 if mode == 'compiled' else 0.004\n"
                    "print('VLLM_RESULT ' + json.dumps({'init_s': 1.5, 'points': [{'batch': b, 'tokens': t, "
                    "'step_s': [s, s], 'prefill_s': [0.5, 0.5]} for b, t in points]}))\n")
    fake.chmod(0o755)
    out = tmp_path / "engine.json"
    p = _bench("engine_bench.py", "--model", "tiny-qwen3", "--points", "2x32", "--prefill", "2x32", "--steps", "3",
               "--repeats", "2", "--threads", "1", "--vllm-python", str(fake), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    import json

    r = json.loads(out.read_text())
    (pt,) = r["points"]
    assert (pt["batch"], pt["tokens"], len(pt["engine_step_s"]["values"])) == (2, 32, 2)
    assert pt["ratio"]["median"] > 0 and pt["packed_bytes"] == 0  # the toy model is not packed by default
    assert pt["engine_of_vllm_compiled"] == pytest.approx(pt["engine_step_s"]["median"] / 0.002)
    assert pt["engine_of_vllm_eager"] == pytest.approx(pt["engine_step_s"]["median"] / 0.004)
    (pre,) = r["prefill"]
    assert pre["tok_s"] == pytest.approx(64 / pre["no_capture_s"]["median"])
    assert pre["engine_of_vllm_compiled"] == pytest.approx(pre["tok_s"] / (64 / 0.5))
    assert r["vllm"]["compiled"]["init_s"] == 1.5
    for want in ("engine ÷ vLLM compiled", "Prefill 2 × 32: engine", "`LLM(...)` took 2 s", "engine <= vLLM eager"):
        assert want in p.stdout, p.stdout
    again = _bench("engine_bench.py", "--summary", str(out))  # the stored run's tables, as the docs show them
    assert again.returncode == 0 and again.stdout.strip() in p.stdout, again.stdout + again.stderr


def test_lean_step_bench_prints_a_stored_run_and_refuses_bad_input_in_one_line():
    p = _bench("lean_step.py", "--summary", str(ROOT / "docs/results/lean_step_smollm2_bfloat16_1t.json"))
    assert p.returncode == 0 and "| smollm2-135m | bfloat16 | 1 | 4 x 2048 |" in p.stdout, p.stdout + p.stderr
    p = _bench("lean_step.py", "--task", "needle")
    assert p.returncode == 2 and p.stderr.startswith("bench/lean_step.py: error: --task 'needle' is not a RULER task"), p.stderr
    p = _bench("lean_step.py", "--batch-size", "0")
    assert p.returncode == 2 and "argument --batch-size: expected a positive integer, got 0" in p.stderr, p.stderr


def test_banded_prefill_bench_prints_a_stored_run_and_refuses_bad_input_in_one_line():
    p = _bench("banded_prefill.py", "--summary", str(ROOT / "docs/results/banded_prefill_gemma3_4096.json"))
    assert p.returncode == 0 and "| gemma3-270m | bfloat16 | 1 | 2 x 4096 |" in p.stdout, p.stdout + p.stderr
    p = _bench("banded_prefill.py", "--task", "needle")
    assert p.returncode == 2 and p.stderr.startswith("bench/banded_prefill.py: error: --task 'needle' is not a RULER "
                                                     "task"), p.stderr
    p = _bench("banded_prefill.py", "--json", "/dev/full")
    assert p.returncode == 2 and "--json '/dev/full' cannot be written (No space left on device)" in p.stderr, p.stderr
