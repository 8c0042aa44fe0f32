"""`eval --tasks leaderboard` (the default real-model grid, `tdutils.eval.grid.LEADERBOARD`), per-task n and
`eval --dtype`.

The real grid needs SmolLM2; the runs here replace `LEADERBOARD` by a grid of the bundled word-level tasks on
`tiny-qwen3-ruler` (two tasks with different n, 128 tokens, two cells), so the command line's path is the same.
"""

import argparse
import json
from dataclasses import replace

import pytest

import tdutils.cli.eval as cli_eval
from tdutils.cli.eval import add_arguments, parse_tasks, plan_eval, plan_lines, run
from tdutils.cli.main import main
from tdutils.eval import grid as grids
from tdutils.eval import task_eval
from tdutils.eval.grid import LEADERBOARD, Grid
from tdutils.policies import policy_names
from tdutils.policies.registry import get_policy

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread (tiny models, shared cores)

TASKS = ("ruler_niah_single_1", "ruler_niah_multikey_1", "ruler_niah_multivalue_partial", "text_fidelity")
PER_HEAD = ("adakv_snapkv", "adakv_expected_attention", "pyramidkv")  # budgets moved between heads or layers
SMALL = Grid(tasks=("niah_single", "niah_multikey"), n=(2, 3), model="tiny-qwen3-ruler", drop_ratios=(0.5,),
             context_lengths=(128,))


def _args(argv):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(argv)


@pytest.fixture
def no_download(monkeypatch):
    """Plans of the SmolLM2 grid without fetching SmolLM2's config (its context window: 8192 positions)."""
    monkeypatch.setattr(cli_eval, "context_window", lambda model: 8192)


@pytest.fixture
def small_board(monkeypatch):
    """`--tasks leaderboard` runs `SMALL`, in float32 (no GPU, no native bfloat16)."""
    monkeypatch.setattr(grids, "LEADERBOARD", SMALL)
    monkeypatch.setattr(grids, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(grids.torch.cuda, "is_available", lambda: False)


def test_the_leaderboard_word_expands_to_its_four_tasks():
    assert LEADERBOARD.tasks == TASKS
    assert parse_tasks(["leaderboard"]) == list(TASKS)
    assert parse_tasks(["ruler_niah_single_1,leaderboard", "ruler_vt"]) == [*TASKS, "ruler_vt"]  # no task twice
    assert LEADERBOARD.task_n == {"ruler_niah_single_1": 100, "ruler_niah_multikey_1": 100,
                                  "ruler_niah_multivalue_partial": 100, "text_fidelity": 32}
    with pytest.raises(ValueError, match="'leaderboard' \\(the default real-model grid: ruler_niah_single_1, "):
        parse_tasks(["leaderbord"])


def test_its_policies_are_every_policy_with_one_set_per_request_and_full():
    policies = LEADERBOARD.policies()
    assert policies[0] == "full" and len(set(policies)) == len(policies)
    assert set(policies[1:]) == {p for p in policy_names() if not get_policy(p).per_head_only}
    assert not set(PER_HEAD) & set(policies) and set(PER_HEAD) <= set(policy_names())
    assert {"snapkv", "rkv", "knorm", "tova", "h2o", "random", "streaming_llm"} <= set(policies)


def test_plan_of_the_leaderboard(no_download, tmp_path, monkeypatch):
    monkeypatch.setattr(grids, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(grids.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli_eval, "usable_cores", lambda: 2)
    monkeypatch.setattr("tdutils.cli.args.usable_cores", lambda: 2)
    plan = plan_eval(_args(["--tasks", "leaderboard", "--json", str(tmp_path / "lb.json")]))
    assert plan.tasks == list(TASKS) and plan.model == "smollm2-135m"
    assert plan.policies == LEADERBOARD.policies()
    assert list(plan.ratios) == [0.5, 0.75, 0.9] and plan.lengths == [2048] and plan.modes == ["aware", "agnostic"]
    assert plan.n == LEADERBOARD.task_n and plan.dtype == "bfloat16"
    cells = 1 + 3 * (len(plan.policies) - 1)  # full once, every other policy at three ratios
    dtype_line, workers_line, size_line = plan_lines(plan)
    assert dtype_line == "dtype bfloat16: the leaderboard's default, as this CPU computes bfloat16 natively; --dtype " \
                         "changes it"
    assert plan.workers == 2 and workers_line == ("workers 2: the leaderboard's default on 2 or more cores (each "
                                                  "process one thread on a core of its own); --workers 1 changes it")
    for argv in (["--threads", "1"], ["--workers", "1"]):  # one thread, or one worker asked for: one process
        one = plan_eval(_args(["--tasks", "leaderboard", "--json", str(tmp_path / "lb.json"), *argv]))
        assert one.workers == 1 and one.workers_note is None
    one = plan_eval(_args(["--tasks", "leaderboard", "--n", "1", "--workers", "2", "--json", str(tmp_path / "lb.json")]))
    assert one.workers == 1 and one.workers_note == ("workers 1: --n 1 gives each task at most 1 prompt(s) to share, "
                                                     "so 2 workers would leave 1 idle")
    # 3 RULER tasks x 2 modes + text fidelity agnostic; one prefill per (task, length) serves both modes
    assert size_line == (f"grid: {7 * cells} cells = {cells} policy/ratio cells x 7 (task, mode) pairs x 1 length "
                         "(2048 tokens); n = 100 (ruler_niah_single_1, ruler_niah_multikey_1, "
                         "ruler_niah_multivalue_partial), 32 (text_fidelity); 332 prompts prefilled, in 14 batches of "
                         "up to 25; 2 worker processes share each task's prompts, each in batches of up to 13")
    # options given override the grid's
    plan = plan_eval(_args(["--tasks", "leaderboard", "--n", "8", "--policies", "snapkv", "full", "--context-lengths",
                            "4096", "--dtype", "float32", "--mode", "agnostic", "--workers", "1", "--json",
                            str(tmp_path / "lb.json")]))
    assert (plan.n, plan.policies, plan.lengths, plan.dtype, plan.modes) == (8, ["snapkv", "full"], [4096], "float32",
                                                                             ["agnostic"])
    assert plan_lines(plan) == [("grid: 16 cells = 4 policy/ratio cells x 4 (task, mode) pairs x 1 length (4096 "
                                 "tokens); n = 8; 32 prompts prefilled, in 4 batches of up to 25")]


def test_without_n_each_task_takes_its_own(no_download, tmp_path):
    plan = plan_eval(_args(["--tasks", "text_fidelity", "ruler_niah_multivalue_partial", "--json",
                            str(tmp_path / "x.json")]))
    assert plan.n == {"text_fidelity": 32, "ruler_niah_multivalue_partial": 50}  # their registered defaults
    assert plan.dtype == "auto" and plan.dtype_note is None  # the leaderboard's dtype only for the leaderboard
    assert plan_eval(_args(["--tasks", "ruler", "--json", str(tmp_path / "x.json")])).n == 50  # one n: an int


@pytest.mark.parametrize("native, dtype", [(True, "bfloat16"), (False, "float32")])
def test_the_leaderboard_dtype_falls_back_to_float32_without_native_bfloat16(monkeypatch, native, dtype):
    monkeypatch.setattr(grids, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(grids.torch.cuda, "is_available", lambda: False)
    assert LEADERBOARD.dtype()[0] == dtype
    monkeypatch.setattr(grids.torch.cuda, "is_available", lambda: True)
    assert LEADERBOARD.dtype() == ("bfloat16", "there is a GPU")  # any GPU


def test_a_bad_dtype_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--dtype", "float8"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == ("python -m tdutils eval: error: argument --dtype: expected one of auto, float32, float16, bfloat16, "
                   "got 'float8' (see --help)\n"), err
    assert _args(["--dtype", "bf16"]).dtype == "bfloat16" and _args([]).dtype is None


def test_per_task_n_reaches_the_rows(engine):
    table = task_eval(tasks=("niah_single", "niah_multikey"), modes=("aware",), policies=("full", "random"),
                      drop_ratios=(0.5,), context_lengths=(128,), n={"niah_single": 2, "niah_multikey": 3}, seed=2,
                      engine=engine, batch_size=4)
    for r in table.itertuples():
        assert r.n == {"niah_single": 2, "niah_multikey": 3}[r.task]
        assert len(r.scores["exact"]) == len(r.answers) == r.n
    with pytest.raises(ValueError, match=r"n gives no count for task\(s\) \['niah_multikey'\]"):
        task_eval(tasks=("niah_single", "niah_multikey"), n={"niah_single": 2}, engine=engine)
    with pytest.raises(ValueError, match="n must be >= 1 for every task, got {'niah_single': 0}"):
        task_eval(tasks=("niah_single",), n={"niah_single": 0}, engine=engine)


@pytest.fixture(scope="module")
def engine(tiny):
    from tdutils.engines.hf import HFEngine

    model, tok = tiny
    return HFEngine(model, tokenizer=tok, progress=False, prefill_batch_size=4, query_window=0)


def test_leaderboard_run_stores_per_task_n_and_dtype_and_resumes(small_board, tmp_path, capsys, monkeypatch):
    out = tmp_path / "lb.json"
    argv = ["--tasks", "leaderboard", "--policies", "full", "random", "--mode", "aware", "--seed", "2", "--json",
            str(out), "--quiet", "--threads", "1"]
    assert run(_args(argv)) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("dtype float32: the leaderboard's default, as this CPU has no native bfloat16 (torch "
                              "would emulate it, slower than float32); --dtype changes it\n"
                              "grid: 4 cells = 2 policy/ratio cells x 2 (task, mode) pairs x 1 length (128 "
                              "tokens); n = 2 (niah_single), 3 (niah_multikey); 5 prompts prefilled, in 2 batches of "
                              "up to 25\n"), printed
    assert "n=2 (niah_single), 3 (niah_multikey) per task and length" in printed
    first = json.loads(out.read_text())
    meta, rows = first["meta"], first["rows"]
    assert meta["n"] == {"niah_single": 2, "niah_multikey": 3} and meta["dtype"] == "float32"
    assert [(r["task"], r["n"], len(r["scores"]["exact"])) for r in rows] == [
        ("niah_single", 2, 2), ("niah_single", 2, 2), ("niah_multikey", 3, 3), ("niah_multikey", 3, 3)]
    # a killed run: its last checkpoint kept the first task; --resume runs only the second task's cells
    out.write_text(json.dumps({**first, "rows": rows[:2], "meta": {**meta, "interrupted": True}}))
    from tdutils.eval import runner

    ran = []
    real = runner._run_group
    monkeypatch.setattr(runner, "_run_group", lambda *a: ran.append((a[1].name, len(a[3]))) or real(*a))
    assert run(_args([*argv, "--resume"])) == 0
    assert ran == [("niah_multikey", 3)]  # the missing task, with its own n
    assert "; 2 stored, 2 to run\n" in capsys.readouterr().out
    again = json.loads(out.read_text())
    assert [r["scores"] for r in again["rows"]] == [r["scores"] for r in rows]
    assert again["meta"]["n"] == meta["n"] and again["meta"]["interrupted"] is False
    # resuming a finished run runs nothing and keeps its seconds (opening the model is not part of the grid)
    ran.clear()
    assert run(_args([*argv, "--resume"])) == 0
    done = json.loads(out.read_text())
    assert ran == [] and done["meta"]["seconds"] == again["meta"]["seconds"]
    assert "nothing left to run (" in capsys.readouterr().out
    # the same counts as one int where every task has it; another count is another grid
    assert run(_args([*argv, "--n", "2", "--json", str(tmp_path / "one.json")])) == 0
    assert json.loads((tmp_path / "one.json").read_text())["meta"]["n"] == 2
    with pytest.raises(ValueError, match="is a run of another grid \\(n {'niah_single': 2, 'niah_multikey': 3} there, "
                                         "2 here\\)"):
        run(_args([*argv, "--n", "2", "--resume"]))
    # a stored run in another dtype is not continued in this one
    out.write_text(json.dumps({**again, "rows": again["rows"][:2], "meta": {**again["meta"], "dtype": "bfloat16"}}))
    with pytest.raises(ValueError, match="--resume: .* was run in bfloat16, this run's model is float32; give --dtype "
                                         "bfloat16, or another --json"):
        run(_args([*argv, "--resume"]))


def test_resume_accepts_an_int_n_stored_for_a_per_task_run(tmp_path):
    """A stored `n` of one int continues a run whose tasks all take that count, and a `{task: n}` one whose tasks
    take those; a task whose count differs is another grid."""
    from tdutils.cli.eval import _resume_rows

    path = tmp_path / "run.json"
    meta = {"model": "m", "tasks": ["a", "b"], "n": {"a": 5, "b": 7}, "seed": 0, "max_tokens": None,
            "policy_params": {}, "chat_template_option": "auto"}
    path.write_text(json.dumps({"meta": {**meta, "seconds": 3.0}, "rows": []}))
    assert _resume_rows(str(path), meta)[:2] == ([], 3.0)
    assert _resume_rows(str(path), {**meta, "tasks": ["b"], "n": 7})[:2] == ([], 3.0)  # the one task it keeps
    with pytest.raises(ValueError, match="another grid"):
        _resume_rows(str(path), {**meta, "n": 5})
    path.write_text(json.dumps({"meta": {**meta, "n": 5}, "rows": []}))
    assert _resume_rows(str(path), {**meta, "n": {"a": 5, "b": 5}})[:2] == ([], 0.0)
    with pytest.raises(ValueError, match="another grid"):
        _resume_rows(str(path), meta)


def test_grid_checks_one_n_per_task():
    with pytest.raises(ValueError, match="one n >= 1 per task"):
        replace(SMALL, n=(2,))
