"""The command line, dataset loading and model loading, including their error messages."""

import json
import os
import subprocess
import sys

import pytest

from tdutils.data import load_prompts, make_passkey_dataset
from tdutils.models import load_model, model_facts


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tdutils", *args], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_main_job_prints_ratio_and_writes_json(tmp_path):
    out = tmp_path / "run.json"
    p = _cli("run", "--policy", "random", "--drop-ratio", "0.5", "--num-requests", "8", "--max-tokens", "4",
             "--json", str(out), "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "decode throughput ratio (random@0.5 / baseline)" in p.stdout
    report = json.loads(out.read_text())
    rows = {r["run"]: r for r in report["table"]}
    assert rows["baseline"]["decode_tokens"] == 8 * 4 == rows["random@0.5"]["decode_tokens"]
    assert rows["random@0.5"]["kv_tokens_after"] == rows["baseline"]["prompt_tokens"] // 2
    # default budget: 4.25 undropped requests of 1024 tokens + 4 decode tokens; 8 x (512 + 4) fit in it
    assert rows["baseline"]["kv_budget_tokens"] == 4369  # ceil(4.25 x 1028)
    assert rows["baseline"]["peak_batch"] == 4 and rows["random@0.5"]["peak_batch"] == 8


@pytest.mark.parametrize("args,msg", [
    (["run", "--drop-ratio", "1.5"], "drop_ratio must lie in [0, 1]"),
    (["run", "--policy", "nope"], "invalid choice: 'nope'"),
    (["run", "--dataset", "missing.jsonl"], "dataset file 'missing.jsonl' does not exist"),
    (["run", "--num-requests", "0"], "expected a positive integer"),
    (["run", "--kv-budget-tokens", "100", "--num-requests", "2"], "give at least 1088"),
    (["run", "--window", "1024", "--num-requests", "2"], "--window 1024 is not shorter than the shortest prompt (1024"),
])
def test_bad_options_exit_nonzero_with_one_clear_line(args, msg):
    p = _cli(*args, "--no-progress")
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and msg in lines[0], p.stderr


def test_help_documents_every_option():
    p = _cli("run", "--help")
    assert p.returncode == 0
    for opt in ("--policy", "--drop-ratio", "--engine", "--model", "--dataset", "--num-requests", "--max-tokens",
                "--kv-budget-tokens", "--positions", "--repeats", "--seed", "--json"):
        assert opt in p.stdout


def test_bundled_sample_and_passkey_generator(tiny):
    _, tok = tiny
    rows = load_prompts("sample")
    assert len(rows) == 16 and all(r.answer and len(r.answer.split()) == 5 for r in rows)
    ids = tok(rows[0].prompt)["input_ids"]
    assert len(ids) == 1024 and tok.unk_token_id not in ids
    # the answer digits follow the needle marker inside the prompt, and the prompt ends with the question
    assert f"pass key = {rows[0].answer} ." in rows[0].prompt and rows[0].prompt.endswith("pass key =")
    a = make_passkey_dataset(3, 200, tokenizer=tok, seed=9)
    assert a == make_passkey_dataset(3, 200, tokenizer=tok, seed=9)
    assert all(r["context_tokens"] <= 200 for r in a)


def test_local_files_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello", "answer": "A"}\n{"prompt": "bye"}\n')
    rows = load_prompts(str(f))
    assert [(r.prompt, r.answer) for r in rows] == [("hello", "A"), ("bye", None)]
    with pytest.raises(ValueError, match="fewer than num_requests=3"):
        load_prompts(str(f), num_requests=3)
    with pytest.raises(ValueError, match="no column 'text'"):
        load_prompts(str(f), prompt_column="text")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_offline_hub_model_and_dataset_give_clear_errors():
    code = ("import sys\n"
            "from tdutils.models import load_model\nfrom tdutils.data import load_prompts\n"
            "for f, a in ((load_model, 'Qwen/Qwen3-0.6B'), (load_prompts, 'raniayu/token-dropping-demo-short')):\n"
            "    try:\n        f(a)\n    except Exception as e:\n        print(type(e).__name__, '|', e)\n")
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    lines = p.stdout.splitlines()
    assert lines[0].startswith("OSError |") and "'Qwen/Qwen3-0.6B'" in lines[0] and "local folder" in lines[0]
    assert lines[1].startswith("ConnectionError |") and "pass the local file" in lines[1]


def test_tiny_model_uses_gqa(tiny):
    model, _ = tiny
    f = model_facts(model.config)
    assert (f.num_layers, f.num_query_heads, f.num_kv_heads, f.head_dim) == (2, 4, 2, 32)
    assert f.gqa_group_size == 2 and f.kv_bytes_per_token == 2 * 2 * 64 * 4
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("tiny-qwen3", dtype="float8")


def test_missing_local_model_folder_and_bad_cli_values_fail_early(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder '/nonexistent/dir' does not exist"):
        load_model("/nonexistent/dir")
    p = _cli("run", "--kernel-size", "4", "--no-progress")
    assert p.returncode == 2 and "kernel_size must be an odd number" in p.stderr and "Traceback" not in p.stderr
    p = _cli("run", "--json", str(tmp_path), "--no-progress")
    assert p.returncode == 2 and "not a writable file path" in p.stderr
    p = _cli("run", "--kv-budget-tokens", "600", "--num-requests", "2", "--no-progress")
    assert p.returncode == 2 and "cannot hold one undropped request" in p.stderr
