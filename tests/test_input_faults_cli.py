"""Inputs that broke the command line, the benches and the scorers: bench arguments, negative seeds, unknown
subcommands, doctor's interpreter, empty output paths, undecodable and empty datasets, rows without a gold
answer, random-weight models, full-width digits, impossible Wilson intervals, Ctrl-C, and text after EOS.

Each bad input gets one line that names the argument and what to pass, exit status 2, no traceback."""

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import tdutils
import tdutils.cli.main as cli
from tdutils.answers import score_passkey, wilson_interval
from tdutils.data import load_prompts
from tdutils.eval.tasks import score_rows
from tdutils.textio import NotUTF8Error

ROOT = Path(tdutils.__file__).resolve().parents[1]
BENCH = ROOT / "bench"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _progress_bars_restored():
    """`run --no-progress` turns transformers' progress bars off process-wide; later tests expect them as before."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    yield
    (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def _cmd(*args, cwd=None):
    """A command line run as a user runs it; returns (status, stdout + stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, *map(str, args)], check=False, capture_output=True, text=True, timeout=300,
                       cwd=cwd, env=env)
    return p.returncode, p.stdout + p.stderr


def _exit_of(fn, *args):
    """The exit status of an argparse error (SystemExit) or the return value of `fn(*args)`."""
    try:
        return fn(*args)
    except SystemExit as exc:
        return exc.code


def _one_error_line(err: str, prog: str) -> str:
    """The single `prog: error: ...` line of `err` (asserts there is exactly one line and no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


# ---------------------------------------------------------------- 1. bench arguments (F7)

@pytest.fixture
def bench_module(monkeypatch):
    """Import a bench script as a module (its sibling bench/harness.py on sys.path, as when it runs)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(BENCH))

    def load(name):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


@pytest.mark.parametrize("script,args,want", [
    ("rkv_bench.py", ["--sizes", "0"], ("argument --sizes: expected an integer >= 17 (R-KV always keeps its last 16 "
                                        "tokens), got 0 (see --help)")),
    ("rope_bench.py", ["--layers", "0"], "argument --layers: expected a positive integer, got 0 (see --help)"),
])
def test_the_reported_bench_commands_fail_in_one_line(script, args, want):
    rc, out = _cmd(BENCH / script, *args)
    assert rc == 2 and _one_error_line(out, f"bench/{script}") == f"bench/{script}: error: {want}", out


@pytest.mark.parametrize("script,args,want", [
    ("rkv_bench", ["--sizes", "16"], "argument --sizes: expected an integer >= 17"),
    ("rkv_bench", ["--sizes", "-5"], "argument --sizes: expected an integer >= 17"),
    ("rkv_bench", ["--heads", "0"], "argument --heads: expected a positive integer, got 0"),
    ("rkv_bench", ["--head-dim", "-1"], "argument --head-dim: expected a positive integer, got -1"),
    ("rkv_bench", ["--query-heads", "0"], "argument --query-heads: expected a positive integer, got 0"),
    ("rkv_bench", ["--repeats", "0"], "argument --repeats: expected a positive integer, got 0"),
    ("rkv_bench", ["--drop-ratio", "nan"], "argument --drop-ratio: drop_ratio must lie in [0, 1]"),
    ("rkv_bench", ["--drop-ratio", "-0.5"], "argument --drop-ratio: drop_ratio must lie in [0, 1]"),
    ("rkv_bench", ["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    ("rkv_bench", ["--threads", "0"], "argument --threads: expected a positive integer, got 0"),
    ("rkv_bench", ["--profile-max-n", "-1"], "argument --profile-max-n: expected an integer >= 0, got -1"),
    ("rkv_bench", ["--device", "gpu"], "device 'gpu' is not a torch device name"),
    ("rkv_bench", ["--json", ""], "--json '' is an empty path; give a file name such as runs/rkv_bench.json"),
    ("rkv_bench", ["--summary", "missing.json"], "--summary 'missing.json': No such file or directory"),
    ("rope_bench", ["--tokens", "-1"], "argument --tokens: expected a positive integer, got -1"),
    ("rope_bench", ["--dim", "0"], "argument --dim: expected a positive integer, got 0"),
    ("rope_bench", ["--head-dim", "0"], "argument --head-dim: expected a positive integer, got 0"),
    ("rope_bench", ["--head-dim", "7", "--dim", "7"], "--head-dim must be even (RoPE rotates pairs of dimensions)"),
    ("rope_bench", ["--theta", "nan"], "argument --theta: expected a finite number > 0, got 'nan'"),
    ("rope_bench", ["--theta", "0"], "argument --theta: expected a finite number > 0, got '0'"),
    ("rope_bench", ["--theta=-1e6"], "argument --theta: expected a finite number > 0, got '-1e6'"),
    ("rope_bench", ["--repeats", "0"], "argument --repeats: expected a positive integer, got 0"),
    ("rope_bench", ["--memory-runs", "0"], "argument --memory-runs: expected a positive integer, got 0"),
    ("rope_bench", ["--threads", "-2"], "argument --threads: expected a positive integer, got -2"),
    ("rope_bench", ["--json", ""], "--json '' is an empty path; give a file name such as runs/rope_bench.json"),
    ("engine_bench", ["--throughput-drop-ratios", "nan"], "argument --throughput-drop-ratios: nan is not in (0, 1)"),
    ("engine_bench", ["--throughput-drop-ratios", "0.5,1"], "argument --throughput-drop-ratios: 1 is not in (0, 1)"),
    ("engine_bench", ["--json", ""], "--json '' is an empty path"),
    ("engine_bench", ["--vllm-modes", "fast"], "--vllm-modes 'fast': give compiled and/or eager, comma-separated"),
    ("engine_bench", ["--prefill", "8x1"], "argument --prefill: '8x1': batch must be >= 1 and tokens >= 2"),
    ("engine_bench", ["--points", "", "--prefill", ""], "nothing to measure: --points and --prefill are empty"),
    ("engine_bench", ["--vllm-python", sys.executable], "cannot import vllm (ModuleNotFoundError"),
    ("throughput", ["--json", ""], "--json '' is an empty path"),
    ("peer_kvpress", ["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    ("peer_kvpress", ["--ratios", "nan"], "argument --ratios: nan is not in (0, 1)"),
    ("peer_kvpress", ["--granularity", "token"], "argument --granularity: invalid choice: 'token'"),
    ("peer_kvpress", ["--positions", "shifted"], "argument --positions: invalid choice: 'shifted'"),
    ("accuracy", ["--seed", "-5"], "argument --seed: seed must be >= 0, got -5"),
    ("accuracy", ["--window", "-1"], "--window -1: window must be an integer >= 0, got -1 (policy 'random')"),
    ("accuracy", ["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    ("accuracy", ["--context-lengths", "0"], "--context-lengths must be >= 1 tokens, got [0]"),
    ("accuracy", ["--drop-ratios", "nan"], "--drop-ratios: drop_ratio must lie in [0, 1]"),
    ("accuracy", ["--summary", "missing.json"], "--summary 'missing.json': No such file or directory"),
])
def test_every_bench_refuses_bad_numbers_in_one_line(bench_module, capsys, monkeypatch, tmp_path, script, args, want):
    monkeypatch.chdir(tmp_path)
    mod = bench_module(script)
    rc = _exit_of(mod.main, args)
    err = capsys.readouterr().err
    assert rc == 2, err
    line = _one_error_line(err, err.split(": error: ")[0])
    assert want in line, line
    assert list(tmp_path.iterdir()) == []  # refused before any work: nothing written


@pytest.mark.parametrize("script", ["rkv_bench", "rope_bench", "engine_bench", "throughput"])
def test_no_bench_argument_takes_an_unchecked_number(bench_module, script):
    """A bare `type=int` / `type=float` takes 0, negatives and nan alike; every numeric option uses a checked type."""
    parser = bench_module(script).build_parser()
    bare = [a.option_strings for a in parser._actions if a.type in (int, float)]
    assert bare == [], f"{script}: options with an unchecked numeric type: {bare}"


# ---------------------------------------------------------------- 2. negative seeds (F3)

def test_a_negative_seed_would_replay_a_training_stream():
    """Why negative seeds are refused: Python seeds with the absolute value."""
    assert random.Random(-10_000_000).random() == random.Random(10_000_000).random()


def test_eval_refuses_negative_seeds_on_the_command_line(capsys):
    rc = _exit_of(cli.main, ["eval", "--seed", "-10000000", "--n", "1"])
    line = _one_error_line(capsys.readouterr().err, "python -m tdutils eval")
    assert rc == 2 and line.startswith("python -m tdutils eval: error: argument --seed: seed must be >= 0, got "
                                       "-10000000: random.Random(-s) draws the same prompts as random.Random(s)"), line
    rc = _exit_of(cli.main, ["eval", "--seed", "1.5"])
    line = _one_error_line(capsys.readouterr().err, "python -m tdutils eval")
    assert rc == 2 and line == ("python -m tdutils eval: error: argument --seed: expected an integer >= 0, got '1.5' "
                                "(see --help)"), line


@pytest.mark.parametrize("seed,match", [(-10_000_000, "seed must be >= 0, got -10000000"), (-1, "got -1"),
                                        (1.5, "seed must be an integer >= 0, got 1.5"), (True, "got True")])
def test_the_python_api_refuses_negative_and_non_integer_seeds(seed, match):
    from tdutils.eval import check_seed, passkey_eval, task_eval

    for fn in (passkey_eval, task_eval):  # before any model loads
        with pytest.raises(ValueError, match=match):
            fn(n=1, seed=seed)
    with pytest.raises(ValueError, match=match):
        check_seed(seed)
    assert check_seed(0) == 0 and check_seed(5_000_000) == 5_000_000


# ---------------------------------------------------------------- 3. unknown subcommands

def test_patch_is_not_a_subcommand_and_the_error_points_to_the_patches_subcommand():
    rc, out = _cmd("-m", "tdutils", "patch")
    line = _one_error_line(out, "python -m tdutils")
    assert rc == 2 and line == (
        "python -m tdutils: error: 'patch' is not a subcommand (choose from run, eval, doctor, patches); python -m "
        "tdutils patches apply (or check, revert) patches vLLM and LMCache; python -m tdutils doctor says whether a "
        "serving setup needs it (see --help)"), out
    rc, out = _cmd("-m", "tdutils", "patches", "apply", "--help")  # the subcommand it names takes those actions
    assert rc == 0 and "--target" in out, out


@pytest.mark.parametrize("word,hint", [("evalu", "did you mean 'eval'?"), ("docter", "did you mean 'doctor'?"),
                                       ("Run", "did you mean 'run'?"), ("apply", "python -m tdutils patches apply"),
                                       ("evaluate", "python -m tdutils eval measures accuracy")])
def test_an_unknown_subcommand_says_which_one_was_meant(capsys, word, hint):
    assert _exit_of(cli.main, [word]) == 2
    line = _one_error_line(capsys.readouterr().err, "python -m tdutils")
    assert line.startswith(f"python -m tdutils: error: {word!r} is not a subcommand (choose from run, eval, doctor, patches); ")
    assert hint in line, line


# ---------------------------------------------------------------- 4. doctor --vllm-python

WANT = ("pass the Python interpreter of vLLM's environment, e.g. --vllm-python /path/to/vllm-venv/bin/python, or "
        "vLLM's package folder with --vllm-dir")


def test_doctor_names_a_missing_or_unusable_interpreter(capsys, tmp_path):
    from standins import closed_port_url

    down = closed_port_url()
    plain = tmp_path / "python"
    plain.write_text("", encoding="utf-8")
    plain.chmod(0o644)
    folder = "is a folder, not an interpreter (a venv's is its bin/python)"
    for value, what in (("/nonexistent", "does not exist"), (str(tmp_path), folder),
                        (str(plain), "is not executable"), ("no-such-python-3x", "is not a command on PATH")):
        rc = cli.main(["doctor", "--vllm-python", value, "--vllm-url", down, "--lmcache-http-url", down])
        captured = capsys.readouterr()
        line = _one_error_line(captured.err, "python -m tdutils doctor")
        assert rc == 2 and line == f"python -m tdutils doctor: error: --vllm-python {value!r} {what}; {WANT}", line
        assert captured.out == ""  # refused before any check ran
    rc = cli.main(["doctor", "--vllm-dir", "/nonexistent", "--vllm-url", down, "--lmcache-http-url", down])
    line = _one_error_line(capsys.readouterr().err, "python -m tdutils doctor")
    assert rc == 2 and "--vllm-dir '/nonexistent' is not a folder; pass vLLM's package folder" in line, line


# ---------------------------------------------------------------- 5. --json ""

@pytest.mark.parametrize("command,example", [("run", "runs/run.json"), ("eval", "runs/eval.json")])
def test_run_and_eval_refuse_an_empty_json_path_alike(capsys, monkeypatch, tmp_path, command, example):
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, "--json", ""]) == 2
    line = _one_error_line(capsys.readouterr().err, f"python -m tdutils {command}")
    assert line == f"python -m tdutils {command}: error: --json '' is an empty path; give a file name such as {example}"
    assert list(tmp_path.iterdir()) == []


def test_eval_refuses_an_empty_plot_path(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["eval", "--plot", ""]) == 2
    assert "--plot '' is an empty path" in _one_error_line(capsys.readouterr().err, "python -m tdutils eval")


# ---------------------------------------------------------------- 6. a byte that is not UTF-8: its line

@pytest.mark.parametrize("suffix,head", [(".jsonl", b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "R'),
                                         (".csv", b"prompt,answer\na,1\nR")])
def test_a_byte_that_is_not_utf8_is_reported_with_its_line_and_offset(tmp_path, suffix, head):
    path = tmp_path / f"latin1{suffix}"
    tail = b'\xe9sum\xe9"}\n' if suffix == ".jsonl" else b"\xe9sum\xe9,2\n"
    path.write_bytes(head + tail)
    with pytest.raises(NotUTF8Error) as info:
        load_prompts(str(path))
    assert str(info.value) == (f"{str(path)!r} is not UTF-8 text (line 3, byte offset {len(head)}: byte 0xe9 in "
                               f"b'\\xe9sum' cannot be decoded); save it as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 IN "
                               f"> OUT)"), info.value


def test_the_offset_counts_a_byte_order_mark_and_crlf_lines(tmp_path):
    path = tmp_path / "bom.jsonl"
    head = b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "'
    path.write_bytes(head + b'\xff"}\r\n')
    with pytest.raises(NotUTF8Error, match=rf"\(line 2, byte offset {len(head)}: byte 0xff "):
        load_prompts(str(path))


def test_the_command_line_reports_the_line_of_a_bad_byte(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xe9"}\n')
    rc, out = _cmd("-m", "tdutils", "run", "--dataset", path, "--no-progress", "--json", tmp_path / "r.json")
    line = _one_error_line(out, "python -m tdutils run")
    assert rc == 2 and "is not UTF-8 text (line 2, byte offset 28: byte 0xe9" in line, out


# ---------------------------------------------------------------- 7. empty datasets

@pytest.mark.parametrize("name,content", [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n\n"),
                                          ("header.csv", b"prompt,answer\n"), ("empty.json", b"[]"),
                                          ("wrapped.json", b'{"data": []}')])
def test_an_empty_dataset_is_refused_naming_the_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    assert str(info.value) == (f"dataset file {str(path)!r} has no rows; give a dataset with at least one row that "
                               f"has a 'prompt' (a CSV needs rows below its header)"), info.value


def test_an_empty_parquet_file_is_refused_too(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "none.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match=r"has no rows; give a dataset with at least one row"):
        load_prompts(str(path))


# ---------------------------------------------------------------- 8, 9, 13. what `run` scores, and says

def _sample_file(tmp_path, n: int, *, drop_answer=()) -> Path:
    """`n` bundled passkey prompts as a JSONL file, without a gold answer at the indices `drop_answer`."""
    rows = load_prompts("sample", num_requests=n)
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps({"prompt": r.prompt, **({} if i in drop_answer else {"answer": r.answer})}) + "\n"
             for i, r in enumerate(rows)]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _run(tmp_path, *args):
    out = tmp_path / "run.json"
    argv = ["run", "--policy", "streaming_llm", "--num-requests", "2", "--max-tokens", "6", "--repeats", "1",
            "--no-progress", "--json", str(out), *args]
    return cli.main(argv), out


def test_rows_without_a_gold_answer_are_left_out_and_counted(tmp_path, capsys):
    rc, out = _run(tmp_path, "--dataset", str(_sample_file(tmp_path, 2, drop_answer={1})))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    lines = printed.splitlines()
    acc = [line for line in lines if line.startswith("accuracy ")]
    assert [line.split(":")[0] for line in acc] == ["accuracy baseline (passkey)",
                                                    "accuracy streaming_llm@0.5 (passkey)"], printed
    assert all(" correct (" in line and line.split(": ")[1].split(" ")[0].endswith("/1") for line in acc), printed
    assert ("note: 1 of 2 rows have no gold 'answer': the accuracies are over the 1 that have one") in lines, printed
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["accuracy"]["baseline"]["n"] == 1 and report["interrupted"] is False, report["accuracy"]
    assert report["notes"][0] == "1 of 2 rows have no gold 'answer': the accuracies are over the 1 that have one"


def test_a_dataset_without_gold_answers_says_why_there_is_no_accuracy(tmp_path, capsys):
    rc, _ = _run(tmp_path, "--dataset", str(_sample_file(tmp_path, 2, drop_answer={0, 1})))
    printed = capsys.readouterr().out
    assert rc == 0 and "accuracy " not in printed, printed
    assert "note: no accuracy: no row of the dataset has a gold 'answer'" in printed.splitlines(), printed


def test_accuracy_notes_count_the_rows_without_gold():
    report = score_passkey(["1 2 3 4 5"] * 3, ["1 2 3 4 5"] * 3)
    notes = cli.accuracy_notes({"baseline": report}, chance=None, missing=2)
    assert notes == ["2 of 5 rows have no gold 'answer': the accuracies are over the 3 that have one"], notes
    assert cli.accuracy_notes({"baseline": report}, chance=None) == []


def test_a_random_weight_model_gets_no_accuracy_figure(tmp_path, capsys, monkeypatch, tiny):
    """`random:ARCH` names are real-shaped models with random weights; the tiny model stands in for the (large)
    random one here, so the run is quick and only the name decides."""
    from tdutils import models

    monkeypatch.setattr(models, "random_model", lambda *a, **k: tiny)
    rc, out = _run(tmp_path, "--model", "random:qwen3-0.6b:1L", "--max-tokens", "2")
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "accuracy " not in printed, printed
    note = ("no accuracy: random:qwen3-0.6b:1L has random weights (a real architecture's shapes, for throughput and "
            "memory only), so its answers mean nothing")
    assert f"note: {note}" in printed.splitlines(), printed
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["accuracy"] == {} and report["notes"][0] == note, report


def test_run_scores_answers_up_to_the_first_eos(tmp_path, capsys, monkeypatch):
    """Text after EOS is not scored: answers cut at EOS before the digits score 0, though `text` holds them."""
    from tdutils import runs

    real = runs.run_restored  # the hf engine prefills once: every run restores it

    def eos_first(*a, **k):  # as if every request generated EOS first and the passkey after it
        res = real(*a, **k)
        for o in res.outputs:
            o.answer = ""
        return res

    monkeypatch.setattr(runs, "run_restored", eos_first)
    rc, out = _run(tmp_path)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    acc = [line for line in printed.splitlines() if line.startswith("accuracy baseline")]
    assert acc and acc[0].startswith("accuracy baseline (passkey): 0/2 correct (0.0%), 2 unparsed"), printed
    assert f"note: {cli.EOS_NOTE}" in printed.splitlines(), printed
    assert "up to each response's first EOS token" in cli.EOS_NOTE
    assert cli.EOS_NOTE in json.loads(out.read_text(encoding="utf-8"))["notes"]


def test_eval_scores_answers_up_to_the_first_eos():
    """`run_cells` hands the scorers `RequestOutput.answer`, never the text generated after EOS."""
    from tdutils.eval import run_cells
    from tdutils.outputs import RequestOutput

    class Engine:  # prefill and decode only: the full cache needs nothing else
        requests = None

        def prefill(self, prompts):
            self.n = len(prompts)

        def decode(self, **kw):
            return [RequestOutput(i, 10, 10, [3, 7], text="<eos>4 8 1 9 2", answer="") for i in range(self.n)]

    texts, _, kept = run_cells(Engine(), ["a", "b"], [("full", 0.0, None)], max_tokens=2, batch_size=2)
    assert texts == {("full", 0.0): ["", ""]} and kept == {("full", 0.0): 20}
    assert score_passkey(["4 8 1 9 2"] * 2, texts["full", 0.0]).correct == 0


# ---------------------------------------------------------------- 10. full-width digits

def test_full_width_digits_are_not_passkey_digits():
    gold = ["4 8 1 9 2"]
    report = score_passkey(gold, ["pass key = ４ ８ １ ９ ２ ."])
    assert (report.correct, report.unparsed, report.predictions) == (0, 1, [None]), report
    report = score_passkey(gold, ["４8 1 9 2 ٣"])  # one ASCII digit short: full-width and Arabic-Indic ignored
    assert (report.correct, report.predictions) == (0, [None]), report
    report = score_passkey(gold, ["１２ 4 8 1 9 2"])
    assert (report.correct, report.predictions) == (1, ["4 8 1 9 2"]), report
    with pytest.raises(ValueError, match="has no digit"):
        score_passkey(["４８１９２"], ["4 8 1 9 2"])
    with pytest.raises(ValueError, match="cannot tell how to score"):
        score_rows([{"answer": "４８１９２"}], ["4 8 1 9 2"])


# ---------------------------------------------------------------- 11. Wilson intervals

@pytest.mark.parametrize("correct,n,match", [
    (6, 5, r"successes must lie in \[0, n\] = \[0, 5\], got correct=6"),
    (-1, 5, r"successes must lie in \[0, n\] = \[0, 5\], got correct=-1"),
    (1, 0, r"successes must lie in \[0, n\] = \[0, 0\], got correct=1"),
    (0, -3, r"n must be >= 0 \(the number of trials\), got -3"),
    (2.5, 5, r"correct must be an integer \(a count\), got 2.5"),
    (2, 5.0, r"n must be an integer \(a count\), got 5.0"),
    (True, 5, r"correct must be an integer \(a count\), got True"),
    ("3", 5, r"correct must be an integer \(a count\), got '3'"),
])
def test_wilson_interval_refuses_impossible_counts(correct, n, match):
    with pytest.raises(ValueError, match=match):
        wilson_interval(correct, n)


def test_wilson_interval_checks_z_and_keeps_its_edges():
    import numpy as np

    import tdutils.eval as evaluate

    for z in (0, -1.96, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="z must be a finite number > 0"):
            wilson_interval(1, 5, z)
    assert wilson_interval(0, 0) is None
    lo, hi = wilson_interval(np.int64(5), np.int64(5))
    assert hi == 1.0 and 0.5 < lo < 0.6
    assert evaluate.wilson_interval(5.0, 10.0) == wilson_interval(5, 10)  # a table read back from JSON
    with pytest.raises(ValueError, match="successes must lie in"):
        evaluate.wilson_interval(6, 5)
    with pytest.raises(ValueError, match="correct must be an integer"):
        evaluate.wilson_interval(2.5, 5)  # was truncated to 2


# ---------------------------------------------------------------- 12. Ctrl-C

def test_ctrl_c_during_run_keeps_the_finished_runs(tmp_path, capsys, monkeypatch):
    from tdutils import runs

    real, calls = runs.run_restored, []  # every run of the hf engine restores one prefill

    def interrupt_the_fourth(*a, **k):  # warm-up x 2, the baseline, then Ctrl-C during the dropped run
        calls.append(k.get("name"))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runs, "run_restored", interrupt_the_fourth)
    rc, out = _run(tmp_path)
    captured = capsys.readouterr()
    assert rc == 130 and calls == ["warm-up", "warm-up", "baseline", "streaming_llm@0.5"], captured
    assert "Traceback" not in captured.err and captured.err.strip().splitlines() == [
        f"python -m tdutils run: interrupted; what finished (1 run) is in {out} (\"interrupted\": true)"], captured.err
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["interrupted"] is True
    assert [(r["name"], r["summary"]["decode_tokens"]) for r in report["runs"]] == [("baseline", 12)], report["runs"]
    assert list(report["accuracy"]) == ["baseline"] and report["accuracy"]["baseline"]["n"] == 2, report["accuracy"]


def test_ctrl_c_before_any_run_finished_writes_nothing(tmp_path, capsys, monkeypatch):
    from tdutils import runs

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "run_restored", interrupt)
    rc, out = _run(tmp_path)
    err = capsys.readouterr().err
    assert rc == 130 and not out.exists(), err
    want = "python -m tdutils run: interrupted before any run finished; nothing was written"
    assert err.strip().splitlines() == [want], err


def test_ctrl_c_during_eval_keeps_the_finished_cells(tmp_path, capsys, monkeypatch):
    from tdutils.eval import runner

    real, calls = runner.run_cells, []

    def interrupt_the_second_length(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "run_cells", interrupt_the_second_length)
    out = tmp_path / "eval.json"
    rc = cli.main(["eval", "--policies", "full", "random", "--drop-ratios", "0.5", "--context-lengths", "128", "256",
                   "--n", "2", "--max-tokens", "6", "--json", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 130, captured
    assert "Traceback" not in captured.err and captured.err.strip().splitlines() == [
        (f"python -m tdutils eval: interrupted; what finished (2 cells) is in {out} (\"interrupted\": true in its "
         f"meta)")], captured.err
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["meta"]["interrupted"] is True and "first EOS token" in report["meta"]["scored"], report["meta"]
    assert report["meta"]["decoded"] == "a request leaves the decode batch at its first EOS token", report["meta"]
    cells = [(r["policy"], r["drop_ratio"], r["context_tokens"], r["n"]) for r in report["rows"]]
    assert cells == [("full", 0.0, 128, 2), ("random", 0.5, 128, 2)], report["rows"]
    assert all(0 <= r["correct"] <= 2 for r in report["rows"])


def test_ctrl_c_anywhere_else_is_one_line_with_status_130(capsys, monkeypatch):
    def interrupt(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_run", interrupt)
    assert cli.main(["run"]) == 130
    assert capsys.readouterr().err == "python -m tdutils run: interrupted; nothing was written\n"


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_real_run_cleanly(tmp_path, signame):
    """SIGINT (what Ctrl-C sends) or SIGTERM (`kill`; a `nohup ... &` job ignores SIGINT) to `python -m tdutils
    run`: status 130 (SIGINT) or 143 (SIGTERM), as a shell reports them, one line, no traceback, the finished runs
    written."""
    import signal
    import time

    out = tmp_path / "run.json"
    p = subprocess.Popen([sys.executable, "-m", "tdutils", "run", "--policy", "streaming_llm", "--num-requests", "2",
                          "--max-tokens", "400", "--repeats", "3", "--no-progress", "--json", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    for line in p.stdout:  # the dropped run's line comes after the baseline's run was collected
        if line.startswith("repeat 1/3") and "streaming_llm" in line or time.time() > deadline:
            break
    p.send_signal(getattr(signal, signame))
    _, err = p.communicate(timeout=120)
    assert p.returncode == {"SIGINT": 130, "SIGTERM": 143}[signame], err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "interrupted" in err, err
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["interrupted"] is True and report["runs"][0]["name"] == "baseline", report.get("runs")
    n = len(report["runs"])
    assert f"interrupted; what finished ({n} run{'s' if n != 1 else ''}) is in {out}" in err, err


def test_argparse_types_shared_with_the_benches():
    from tdutils.cli.args import drop_ratios, int_at_least, positive_float

    assert int_at_least(17)("17") == 17 and positive_float("1e6") == 1e6 and drop_ratios("0.5, 0.75") == [0.5, 0.75]
    for fn, text in ((int_at_least(17), "16"), (positive_float, "nan"), (positive_float, "inf"), (drop_ratios, "nan")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_the_speedup_caveats_the_run_prints_are_kept_in_its_json(tmp_path, capsys, monkeypatch):
    """A busy machine's caveat ("the repeats gave ratios from ... to ...") was printed but not saved."""
    import tdutils.metrics

    monkeypatch.setattr(tdutils.metrics, "speedup_notes", lambda table: ["machine busy: a test caveat"])
    rc, out = _run(tmp_path)
    printed = capsys.readouterr().out
    assert rc == 0 and "note: machine busy: a test caveat" in printed.splitlines(), printed
    assert "machine busy: a test caveat" in json.loads(out.read_text(encoding="utf-8"))["notes"]
