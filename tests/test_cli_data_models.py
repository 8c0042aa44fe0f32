"""The command line, dataset loading and model loading, including their error messages."""

import json
import os
import subprocess
import sys

import pytest
import torch

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
    assert "Loading weights" not in p.stderr  # --no-progress hides the model load's bar too
    assert "decode throughput ratio (random@0.5 / baseline)" in p.stdout
    report = json.loads(out.read_text())
    rows = {r["run"]: r for r in report["table"]}
    assert rows["baseline"]["decode_tokens"] == 8 * 4 == rows["random@0.5"]["decode_tokens"]
    assert rows["random@0.5"]["kv_tokens_after"] == rows["baseline"]["prompt_tokens"] // 2
    # default budget: 4.25 undropped requests of 1024 tokens + 4 decode tokens; 8 x (512 + 4) fit in it
    assert rows["baseline"]["kv_budget_tokens"] == 4369  # ceil(4.25 x 1028)
    assert rows["baseline"]["peak_batch"] == 4 and rows["random@0.5"]["peak_batch"] == 8
    # three alternated repeats by default: A B A B A B, the ratio the median of the per-repeat ratios with its min-max
    assert [r["name"] for r in report["runs"]] == ["baseline", "random@0.5"] * 3
    ratios = report["decode_speedups"]
    assert len(ratios) == 3 and report["decode_speedup_median"] == sorted(ratios)[1]
    assert (f"decode throughput ratio (random@0.5 / baseline): {sorted(ratios)[1]:.2f}x (median of 3 repeats; "
            f"min {min(ratios):.2f}x, max {max(ratios):.2f}x)") in p.stdout, p.stdout
    # an estimate before the runs, what they took after them; one prefill, restored for every run
    assert "estimate: the runs will take " in p.stdout and "about under" not in p.stdout and "the runs took" in p.stdout, \
        p.stdout
    assert report["timing"]["prefill"] == "once" and report["timing"]["estimate_s"] > 0
    assert len({r["prefill"]["seconds"] for r in report["runs"]}) == 1
    assert any(n.startswith("prefill_s is the one prefill") for n in report["notes"]), report["notes"]


@pytest.mark.parametrize("args,msg", [
    (["run", "--drop-ratio", "1.5"], "drop_ratio must lie in [0, 1]"),
    (["run", "--policy", "nope"], "invalid choice: 'nope'"),
    (["run", "--dataset", "missing.jsonl"], "dataset file 'missing.jsonl' does not exist"),
    (["run", "--num-requests", "0"], "expected a positive integer"),
    (["run", "--kv-budget-tokens", "100", "--num-requests", "2"], "give at least 1088"),
    (["run", "--window", "1024", "--num-requests", "2"], "--window 1024 is not shorter than the shortest prompt (1024"),
    (["run", "--dataset", "samples"], ("dataset 'samples' is not a bundled dataset, an existing file or a hub id "
                                      "(owner/name): did you mean 'sample'?")),
    (["run", "--device", "gpu"], ("device 'gpu' is not a torch device name (such as 'cpu', 'cuda', 'cuda:0', 'mps'); "
                                 "use \"cpu\" or omit the device (default: cuda when available, else cpu)")),
    (["eval", "--n", "0"], "--n must be >= 1, got 0"),
    (["eval", "--drop-ratios", "0.5", "1.5"], ("--drop-ratios: drop_ratio must lie in [0, 1] (the fraction of tokens "
                                               "removed), got 1.5; give fractions such as 0.25 0.5 0.75")),
    (["eval", "--drop-ratios", "half"], "bad --drop-ratios value (fractions such as 0.25 0.5 0.75) 'half'"),
    (["eval", "--context-lengths", "abc"],
     "bad --context-lengths value (whole numbers of tokens such as 1024 2048) 'abc'"),
    (["eval", "--threads", "0"], "--threads must be between 1 and the"),
    (["eval", "--threads", "100000"], "CPU core(s) this process may use, got 100000"),
    (["run", "--threads", "0"], "--threads must be between 1 and the"),
    (["run", "--json", "/proc/tdutils-run.json"], ("--json '/proc/tdutils-run.json' is not a writable file path: no "
                                                   "file can be created in '/proc'")),
    (["eval", "--context-lengths", "128", "--window", "200", "--n", "2"],
     "--window 200 must be shorter than the shortest context length (128 tokens)"),
    (["eval", "--policies", "knorm", "--window", "-3", "--n", "2"],
     "--window -3: window must be an integer >= 0, got -3 (policy 'knorm')"),
    (["eval", "--policies", "snapkv", "--kernel-size", "100001", "--n", "2"],
     "--kernel-size 100001 must be shorter than the shortest context length (512 tokens)"),
    (["eval", "--policies", "snapkv", "--window", "0", "--n", "2"],
     "--window 0: window must be a positive integer, got 0 (policy 'snapkv')"),
    (["eval", "--plot", "acc.xyz"], ("--plot 'acc.xyz' has extension '.xyz', which matplotlib cannot save; use one of "
                                    ".avif, .eps, .gif, .jpeg, .jpg, .pdf, .pgf, .png, .ps, .raw, .rgba, .svg, .svgz, "
                                    ".tif, .tiff, .webp")),
])
def test_bad_options_exit_nonzero_with_one_clear_line(args, msg):
    p = _cli(*args, *(["--no-progress"] if args[0] == "run" else []))
    assert p.returncode == 2 and "Traceback" not in p.stderr
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
    missing = str(tmp_path / "no" / "such" / "dir")  # never exists, whatever the machine holds elsewhere
    with pytest.raises(FileNotFoundError, match=f"model folder '{missing}' does not exist"):
        load_model(missing)
    p = _cli("run", "--kernel-size", "4", "--no-progress")
    assert p.returncode == 2 and "kernel_size must be an odd number" in p.stderr and "Traceback" not in p.stderr
    p = _cli("run", "--json", str(tmp_path), "--no-progress")
    assert p.returncode == 2 and "not a writable file path" in p.stderr
    p = _cli("run", "--kv-budget-tokens", "600", "--num-requests", "2", "--no-progress")
    assert p.returncode == 2 and "cannot hold one undropped request" in p.stderr


def test_local_model_folder_lacking_files_says_what_is_missing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    hint = ("pass a folder with config.json, the weights and the tokenizer (e.g. made by `hf download Qwen/Qwen3-0.6B "
            "--local-dir DIR`), a hub id such as 'Qwen/Qwen3-0.6B', or 'tiny-qwen3'")
    with pytest.raises(FileNotFoundError) as e:
        load_model(str(empty))
    assert str(e.value) == (f"model folder '{empty}' has no config.json and no tokenizer files (one of tokenizer.json, "
                            f"tokenizer.model, vocab.json, ...) and no weights (*.safetensors or *.bin); {hint}")
    (empty / "config.json").write_text("{}")
    (empty / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        load_model(str(empty))
    assert str(e.value) == f"model folder '{empty}' has no weights (*.safetensors or *.bin); {hint}"
    from tdutils.models import load_tokenizer

    (empty / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as e:  # the tokenizer alone needs no weights
        load_tokenizer(str(empty))
    assert str(e.value) == (f"model folder '{empty}' has no tokenizer files (one of tokenizer.json, tokenizer.model, "
                            f"vocab.json, ...); {hint}")


def test_unavailable_devices_fail_before_loading(monkeypatch):
    import torch

    from tdutils.models import check_device

    fix = 'use "cpu" or omit the device (default: cuda when available, else cpu)'
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: calls.append(a))
    for device, msg in [
        ("cuda", "device 'cuda' was asked for but CUDA is not available here (this torch is built without CUDA); "
                 + fix),
        ("cuda:1", "device 'cuda:1' was asked for but CUDA is not available here (this torch is built without "
                   "CUDA); " + fix),
        ("gpu", "device 'gpu' is not a torch device name (such as 'cpu', 'cuda', 'cuda:0', 'mps'); " + fix),
        ("mps", "device 'mps' was asked for but MPS is not available here (torch.backends.mps.is_available() is "
                "False: it needs Apple silicon and a torch built with MPS); " + fix),
    ]:
        with pytest.raises(ValueError) as e:
            load_model("tiny-qwen3", device=device)
        assert str(e.value) == msg
    assert calls == []  # nothing was loaded
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError) as e:
        check_device("cuda")
    assert str(e.value) == ("device 'cuda' was asked for but CUDA is not available here (torch.cuda.is_available() "
                            "is False: no GPU is visible); " + fix)
    assert check_device(None) is None and check_device("cpu") == torch.device("cpu")


def test_load_model_without_progress_shows_no_loading_bar(capfd):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # an earlier in-process `run --no-progress` turns the bars off for the process
    load_model("tiny-qwen3", device="cpu", progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # restored afterwards
    hf_logging.disable_progress_bar()
    try:  # a caller that disabled the bars globally (as `run --no-progress` does) sees none, during and after
        load_model("tiny-qwen3", device="cpu", progress=True)
        assert "Loading weights" not in capfd.readouterr().err
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
    load_model("tiny-qwen3", device="cpu")
    assert "Loading weights" in capfd.readouterr().err  # shown by default


def test_unreadable_dataset_files_and_rows_name_the_file_and_row(tmp_path, monkeypatch):
    empty_csv = tmp_path / "empty.csv"
    empty_csv.write_text("")
    with pytest.raises(ValueError) as e:
        load_prompts(str(empty_csv))
    assert str(e.value) == f"dataset file '{empty_csv}' could not be read as CSV: No columns to parse from file"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError) as e:
        load_prompts(str(bad))
    assert str(e.value) == f"dataset file '{bad}' could not be read as JSONL: line 2: Expecting value (column 1)"
    ints = tmp_path / "ints.jsonl"
    ints.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    with pytest.raises(ValueError) as e:
        load_prompts(str(ints))
    assert str(e.value) == (f"dataset '{ints}': row 1 (counting from 0) has a 'prompt' that is not text (int 5); every row needs the "
                            f"prompt as a string")
    ragged = tmp_path / "ragged.jsonl"
    ragged.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError) as e:
        load_prompts(str(ragged))
    assert str(e.value) == (f"dataset '{ragged}': row 1 (counting from 0) has no 'prompt' column (its columns: ['text']); every row "
                            f"needs a text 'prompt'")
    empty = tmp_path / "emptyprompt.jsonl"  # named here, not as "prompt 0 is empty" when the engine tokenizes it
    empty.write_text('{"prompt": "", "answer": "1"}\n{"prompt": "the pass key is 5", "answer": "5"}\n')
    with pytest.raises(ValueError) as e:
        load_prompts(str(empty))
    assert str(e.value) == (f"dataset '{empty}': row 0 (counting from 0) has an empty 'prompt'; give every row a "
                            f"prompt text, or remove that row")


def _run_cli(argv, capsys):
    from tdutils.cli.main import main

    rc = main(["run", *argv])
    return rc, capsys.readouterr()


def test_run_context_length_with_a_read_dataset_is_refused_in_one_line(capsys):
    rc, got = _run_cli(["--context-length", "256", "--no-progress"], capsys)  # the default dataset: 'sample'
    assert rc == 2
    assert got.err == ("python -m tdutils run: error: --context-length 256 applies to task datasets (such as --dataset "
                       "ruler_niah_single_1 or passkey), whose prompts are built at that length; dataset 'sample' is "
                       "read as it is: drop --context-length or pick a task dataset\n"), got.err
    help_text = subprocess.run([sys.executable, "-m", "tdutils", "run", "--help"], check=False, capture_output=True,
                               text=True, timeout=120).stdout
    assert "--context-length CONTEXT_LENGTH\n                        task datasets only" in help_text, help_text


def test_run_context_length_too_short_names_the_task_and_the_flag(capsys):
    from tdutils.models import resolve_model

    try:
        resolve_model("smollm2-135m")
    except (OSError, ValueError):
        pytest.skip("smollm2-135m is not cached here")
    rc, got = _run_cli(["--model", "smollm2-135m", "--context-length", "64", "--chat-template", "none",
                        "--no-progress"], capsys)
    assert rc == 2
    assert got.err.startswith("python -m tdutils run: error: --dataset ruler_niah_single_1: --context-length 64 is too "
                              "short for the task's template and needles; this tokenizer needs at least "), got.err
    assert got.err.endswith(" tokens: give a larger --context-length\n") and "context_tokens" not in got.err, got.err


def test_run_json_keeps_each_requests_answer(tmp_path, capsys):
    from tdutils.eval.tasks import dataset_task, score_rows

    out = tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:
        rc, got = _run_cli(["--policy", "random", "--num-requests", "2", "--max-tokens", "6", "--repeats", "1",
                            "--threads", "1", "--no-progress", "--json", str(out)], capsys)
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, got.err
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and report["args"]["threads"] == 1  # --threads reached torch
    gold = report["gold"]
    assert gold == [r.answer for r in load_prompts("sample", num_requests=2)], gold
    for name, marks in ((n, report["accuracy"][n]["is_correct"]) for n in report["answers"]):
        assert sum(marks) == report["accuracy"][name]["correct"] and len(marks) == 2, marks
    assert "--repeats 1: each figure is one measurement" in got.out, got.out
    answers = report["answers"]
    assert list(answers) == ["baseline", "random@0.5"] and all(len(a) == 2 for a in answers.values()), answers
    rows = load_prompts("sample", num_requests=2)
    for name, texts in answers.items():  # the stored answers are what the accuracy scored
        assert score_rows(rows, texts, task=dataset_task("sample", rows)).correct == report["accuracy"][name]["correct"]
    assert answers["baseline"][0].strip().startswith(rows[0].answer), answers  # the trained model finds the key


def test_run_at_drop_ratio_one_says_what_it_kept(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, got = _run_cli(["--drop-ratio", "1", "--num-requests", "2", "--max-tokens", "2", "--repeats", "1",
                        "--no-progress", "--json", str(out)], capsys)
    assert rc == 0, got.err
    note = ("--drop-ratio 1 keeps only the tokens snapkv always keeps (its protected tokens: 64 KV tokens per "
            "request), not 0: the ratio, capacity limit and accuracy are those of that set alone")
    assert f"note: {note}\n" in got.out, got.out
    assert "UserWarning" not in got.err, got.err  # make_drop_fn's warning gives way to the note
    report = json.loads(out.read_text())
    assert note in report["notes"]
    assert {r["run"]: r["kv_tokens_after"] for r in report["table"]}["snapkv@1"] == 2 * 64  # the 64-token window


def test_names_that_cannot_be_hub_ids_fail_without_the_hub(monkeypatch):
    from tdutils import data

    monkeypatch.setattr(data, "_read_hub", lambda *a: pytest.fail("the hub was asked"))
    what = "is not a bundled dataset, an existing file or a hub id (owner/name)"
    for name, guess in (("samples", "sample"), ("Sample", "sample"), ("mc_sample", "mc-sample"),
                        ("mcsample", "mc-sample")):
        with pytest.raises(ValueError) as e:
            load_prompts(name)
        assert str(e.value) == f"dataset {name!r} {what}: did you mean {guess!r}?"
    with pytest.raises(ValueError) as e:
        load_prompts("longbench")
    assert str(e.value) == (f"dataset 'longbench' {what}; pass 'sample' or 'mc-sample' (bundled), a "
                            f".jsonl/.json/.csv/.parquet file, or a hub id such as 'raniayu/token-dropping-demo-short'")


def test_eval_output_paths_are_checked_before_any_work(tmp_path):
    import uuid
    from pathlib import Path

    from tdutils.eval import check_output_path, check_plot_path

    at_root = Path("/") / f"tdutils-test-{uuid.uuid4().hex}" / "dir" / "x.json"
    with pytest.raises(ValueError) as e:
        check_output_path(at_root, "--json")
    assert str(e.value) == (f"--json '{at_root}': the folder '{at_root.parent}' does not exist, and missing folders "
                            f"are not created at the filesystem root; create it first or give a path such as "
                            f"runs/eval.json")
    assert not at_root.parents[1].exists()
    with pytest.raises(ValueError) as e:
        check_output_path(tmp_path, "--json")
    assert str(e.value) == (f"--json '{tmp_path}' is a folder, not a writable file path; give a file name such as "
                            f"runs/eval.json")
    afile = tmp_path / "a.txt"
    afile.write_text("")
    with pytest.raises(ValueError) as e:
        check_output_path(afile / "x.json", "--json")
    assert str(e.value) == f"--json '{afile / 'x.json'}' is not a writable file path: '{afile}' is a file, not a folder"
    with pytest.raises(ValueError) as e:
        check_plot_path(tmp_path / "plot", "--plot")
    assert str(e.value).startswith(f"--plot '{tmp_path / 'plot'}' has no file extension, which matplotlib cannot "
                                   f"save; use one of .avif, .eps,")
    new = tmp_path / "new" / "deeper" / "x.json"  # missing folders inside a writable one are fine, not created yet
    assert check_output_path(new, "--json") == new and not new.parent.exists()
    p = _cli("eval", "--json", str(at_root), "--quiet")
    assert p.returncode == 2 and not at_root.parents[1].exists()
    assert p.stderr.strip() == (f"python -m tdutils eval: error: --json '{at_root}': the folder '{at_root.parent}' does not exist, "
                                f"and missing folders are not created at the filesystem root; create it first or "
                                f"give a path such as runs/eval.json")


def test_gold_answers_that_cannot_be_scored_fail_before_the_run(tmp_path):
    """Mixed gold answers (a passkey and a letter) are refused before any prefill, with nothing written."""
    data = tmp_path / "mixed.csv"
    data.write_text("prompt,answer\nalpha beta,1 2\ngamma delta,B\n", encoding="utf-8")
    out = tmp_path / "run.json"
    p = _cli("run", "--dataset", str(data), "--num-requests", "2", "--policy", "knorm", "--repeats", "1",
             "--json", str(out), "--no-progress")
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip() == (f"python -m tdutils run: error: dataset {str(data)!r}: cannot tell how to score gold answers like "
                                "['1 2', 'B']: expected digit passkeys or letters A-D"), p.stdout + p.stderr
    assert "prefill" not in p.stdout and not out.exists(), p.stdout


def test_unreachable_hub_fails_at_once_with_one_hint(monkeypatch):
    # Without the probe, the hub client retries for ~30 s and prints every retry.
    import socket

    import huggingface_hub

    from tdutils.models import ModelRef, resolve_model

    probes = []

    def refuse(addr, timeout=None):
        probes.append((addr, timeout))
        raise OSError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    ref = resolve_model("org/never-cached", weights=False)
    with pytest.raises(OSError) as err:
        ref.files()
    msg = str(err.value)
    assert "huggingface.co cannot be reached" in msg and msg.count("could not load model") == 1, msg
    assert "local folder" in msg and probes == [(("huggingface.co", 443), 5.0)]
    # a model already in the hub cache is not probed
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: "/cache/config.json")
    assert ModelRef("org/cached", "hub", "org/cached").files() == "org/cached" and len(probes) == 1


def test_run_says_when_a_policy_stores_more_than_its_ratio_asks(tmp_path, capsys):
    # AdaKV's per-head budgets are stored padded to each layer's largest head: the kept fraction is not 1 - r
    out = tmp_path / "r.json"
    rc, got = _run_cli(["--policy", "adakv_snapkv", "--window", "8", "--num-requests", "2", "--max-tokens", "2",
                        "--repeats", "2", "--no-progress", "--json", str(out)], capsys)
    assert rc == 0, got.err
    report = json.loads(out.read_text())
    kept = {r["run"]: r["kept_fraction"] for r in report["table"]}["adakv_snapkv@0.5"]
    assert kept > 0.55, report["table"]
    note = f"adakv_snapkv@0.5 stores {kept:.2f} of the prompt's KV tokens, not 1 - 0.5 = 0.50"
    assert note in got.out and any(n.startswith(note) for n in report["notes"]), got.out
    assert "--repeats 1" not in got.out


@pytest.mark.parametrize("device, msg", [
    ("meta", "device 'meta' holds tensor shapes, not data, so nothing can run on it; give --device cpu, a GPU, or "
             "omit it"),
    ("cpu:7", "device 'cpu:7': torch has one CPU device, 'cpu', whose threads spread over the cores (--threads N "
              "sets how many); give --device cpu"),
])
def test_run_refuses_a_device_nothing_runs_on_in_one_line(device, msg):
    p = subprocess.run([sys.executable, "-m", "tdutils", "run", "--device", device], capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 2 and p.stderr.strip() == f"python -m tdutils run: error: argument --device: {msg} (see " \
                                                     f"--help)", p.stderr


@pytest.mark.parametrize("device, msg", [
    ("meta", "device 'meta' holds tensor shapes, not data, so nothing can run on it; give device=\"cpu\", a GPU, or "
             "omit it"),
    ("cpu:7", "device 'cpu:7': torch has one CPU device, 'cpu', whose threads spread over the cores "
              "(torch.set_num_threads(N) sets how many); give device=\"cpu\""),
])
def test_engine_refuses_a_device_nothing_runs_on_before_loading(device, msg, monkeypatch):
    import tdutils.engines.hf as hf

    def never(*a, **k):
        raise AssertionError("the model loaded before the device was checked")

    monkeypatch.setattr(hf, "load_model", never)
    with pytest.raises(ValueError) as exc:
        hf.HFEngine("tiny-qwen3", device=device)
    assert str(exc.value) == msg
