"""The RULER-style task benchmark's machinery (`tdutils.eval.task_eval`, its summaries and command line).

These tests check the flow and the bookkeeping with the bundled passkey model (same tokenizer; it is not trained
on the tasks, so its answers are wrong, but the same token sequence must still give the same answer): the
query-agnostic full cache (prefill(context) -> extend(question)) answers exactly as the query-aware one
(prefill(prompt)), a ratio-0 edit exactly as the full cache, and the tables are computed from the rows they
summarise. The accuracy regression on the trained model lives in `tests/test_accuracy.py`.
"""

import argparse
import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from tdutils.cli.eval import add_arguments, run
from tdutils.data import RULER_TASKS, make_task_dataset
from tdutils.eval import TASK_COLUMNS, leaderboard, split_question, task_eval, task_markdown

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread (tiny models, shared cores)


@pytest.fixture(scope="module")
def engine(tiny):
    from tdutils.engines.hf import HFEngine

    model, tok = tiny
    return HFEngine(model, tokenizer=tok, progress=False, prefill_batch_size=4, query_window=0)


@pytest.fixture(scope="module")
def small(engine):
    responses = {}
    table = task_eval(tasks=("niah_single", "niah_multiquery"), policies=("full", "snapkv", "random"),
                      drop_ratios=(0.0, 0.5), context_lengths=(160,), n=6, seed=2, engine=engine, batch_size=4,
                      responses=responses)
    return table, responses


@pytest.mark.parametrize("task", RULER_TASKS)
def test_split_question_gives_the_aware_prompts_tokens(tiny, task):
    _, tok = tiny
    for ex in make_task_dataset(task, 3, 200, tokenizer=tok, seed=4):
        context, question = split_question(tok, ex)
        assert context + question == tok(ex["prompt"])["input_ids"]
        assert context == tok(ex["context"])["input_ids"]
        assert question == tok(" " + ex["question"], add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="needs a task example with 'prompt' and 'context'.*has no 'context'"):
        split_question(tok, {"prompt": ex["prompt"]})


def test_rows_columns_and_bookkeeping(small):
    table, _ = small
    assert tuple(table.columns) == TASK_COLUMNS
    # length -> task -> mode -> policy -> ratio; "full" is one row at ratio 0
    cells = [("full", 0.0), ("snapkv", 0.0), ("snapkv", 0.5), ("random", 0.0), ("random", 0.5)]
    expect = [(t, m, p, r) for t in ("niah_single", "niah_multiquery") for m in ("aware", "agnostic") for p, r in cells]
    assert list(zip(table["task"], table["mode"], table["policy"], table["drop_ratio"])) == expect
    assert (table["n"] == 6).all() and (table["context_length"] == 160).all()
    assert (table["correct"] == (table["accuracy"] * 6).round()).all()
    # (answers.wilson_interval's ends are off by ~1e-16 at 0 and n correct)
    assert ((table["ci_low"] <= table["accuracy"] + 1e-12) & (table["accuracy"] <= table["ci_high"] + 1e-12)).all()
    assert ((0 <= table["partial"]) & (table["partial"] <= 1) & (table["partial"] >= table["accuracy"])).all()
    aware = table[(table["mode"] == "aware")]
    assert list(aware["kept_tokens"]) == [160, 160, 80, 160, 80] * 2  # keep_count(160, 0.5) = 80
    agnostic = table[(table["mode"] == "agnostic") & (table["drop_ratio"] == 0.5)]
    assert (agnostic["kept_tokens"] > 80).all()  # the context's kept tokens plus the question
    assert (table.loc[table["policy"] == "full", "modify_s"] == 0).all()
    # the longest gold answer + 2: "V ." is 6 tokens; four "key V" items are 4 * 6 + 3 commas + "." = 28
    assert set(table.loc[table["task"] == "niah_single", "max_tokens"]) == {8}
    assert set(table.loc[table["task"] == "niah_multiquery", "max_tokens"]) == {30}


def test_rows_keep_each_prompts_scored_answer(small):
    """Each row stores the answer it scored per prompt (text up to the first EOS), beside its per-prompt scores."""
    table, responses = small
    for r in table.itertuples():
        assert r.answers == responses[r.task, r.mode, r.policy, r.drop_ratio, r.context_length]
        assert len(r.answers) == len(r.scores["exact"]) == 6


def test_agnostic_full_cache_answers_as_aware_and_ratio_zero_as_full(small):
    """prefill(context) + extend(question) holds the prompt's cache, so greedy answers are identical; a ratio-0
    edit returns the cache unchanged (docs/design.md §5), in both modes."""
    _, responses = small
    for task in ("niah_single", "niah_multiquery"):
        full = responses[task, "aware", "full", 0.0, 160]
        assert responses[task, "agnostic", "full", 0.0, 160] == full
        for mode in ("aware", "agnostic"):
            for policy in ("snapkv", "random"):
                assert responses[task, mode, policy, 0.0, 160] == full


def test_one_prefill_for_both_modes_answers_as_the_aware_prefill(small, engine):
    """Both modes run from one prefill per chunk (`run_cells_shared`: prefill(context), then extend(question) for
    the aware cells); the aware answers equal those of an aware-only run, which prefills the prompt itself."""
    table, responses = small
    alone = {}
    aware = task_eval(tasks=("niah_single", "niah_multiquery"), modes=("aware",), policies=("full", "snapkv", "random"),
                      drop_ratios=(0.0, 0.5), context_lengths=(160,), n=6, seed=2, engine=engine, batch_size=4,
                      responses=alone)
    assert alone == {k: v for k, v in responses.items() if k[1] == "aware"}
    shared = table[table["mode"] == "aware"].reset_index(drop=True)
    assert list(aware["scores"]) == list(shared["scores"]) and list(aware["kept_tokens"]) == list(shared["kept_tokens"])
    # what the answers rest on: SnapKV keeps the same tokens from either start (the question's queries vote)
    from tdutils.edit import make_drop_fn

    tok = engine.tokenizer
    data = make_task_dataset("niah_multiquery", 3, 160, tokenizer=tok, seed=2)
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=engine.config, window=8)
    engine.capture_for(fn)
    kept = []
    for start in ("prompt", "context"):
        if start == "prompt":
            engine.prefill([tok(d["prompt"])["input_ids"] for d in data])
        else:
            engine.prefill([split_question(tok, d)[0] for d in data])
            engine.extend([split_question(tok, d)[1] for d in data])
        engine.modify(fn)
        kept.append([list(r.tokens) for r in engine.requests])
    assert kept[0] == kept[1] and len(kept[0][0]) == 80


def test_leaderboard_and_markdown_are_computed_from_the_rows():
    rows = []
    for task, correct in (("niah_single", (10, 8, 2)), ("variable_tracking", (6, 4, 0))):
        for (policy, ratio), c in zip((("full", 0.0), ("snapkv", 0.5), ("snapkv", 0.9)), correct):
            rows.append({"task": task, "mode": "aware", "policy": policy, "drop_ratio": ratio, "context_length": 1024,
                         "n": 10, "correct": c, "accuracy": c / 10, "partial": c / 10})
    table = pd.DataFrame(rows)
    board = leaderboard(table)
    got = {(p, r): a for p, r, a in zip(board["policy"], board["drop_ratio"], board["accuracy"])}
    assert got == pytest.approx({("full", 0.0): 0.8, ("snapkv", 0.5): 0.6, ("snapkv", 0.9): 0.1})
    md = task_markdown(table).splitlines()
    assert md[0] == "Exact match (%), 1024 tokens, n = 10 per task and length"
    assert md[2] == "| mode | policy | drop ratios | niah_single | variable_tracking | average |"
    assert md[4] == "| aware | full | 0 | 100.0 | 60.0 | 80.0 |"
    assert md[5] == "| aware | snapkv | 0.5 / 0.9 | 80.0 / 20.0 | 40.0 / 0.0 | 60.0 / 10.0 |"
    with pytest.raises(ValueError, match="no rows at context length 2048"):
        task_markdown(table, context_length=2048)


def _args(argv):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(argv)


def test_cli_runs_the_tasks_and_writes_json_and_the_leaderboard_plot(tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "board.png"
    args = _args(["--tasks", "niah_single,variable_tracking", "--model", "tiny-qwen3-ruler", "--policies", "full", "random",
                  "--drop-ratios", "0.5", "--context-lengths", "128", "--n", "3", "--seed", "2", "--json", str(out),
                  "--plot", str(png), "--quiet"])
    assert run(args) == 0
    printed = capsys.readouterr().out
    assert "| mode | policy | drop ratios | niah_single | variable_tracking | average |" in printed, printed
    assert "ranked, exact @ 0.5, aware: 1. " in printed and "(exact McNemar, Holm-corrected, alpha 0.05)" in printed
    report = json.loads(out.read_text())
    assert report["meta"]["tasks"] == ["niah_single", "variable_tracking"]
    assert report["meta"]["modes"] == ["aware", "agnostic"]  # --mode defaults to both
    keys = {"task", "mode", "policy", "drop_ratio", "context_length", "n", "accuracy", "ci_low", "ci_high", "partial"}
    assert all(keys <= set(r) for r in report["rows"]), report["rows"][0]
    assert len(report["rows"]) == 2 * 2 * 2  # tasks x modes x (full, random@0.5)
    assert png.stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "passkey", "--mode", "agnostic"], "aware mode only"),
    (["--tasks", "passkey", "niah_single"], "runs alone"),
    (["--tasks", "niah_everything"], "unknown 'niah_everything'"),
    (["--tasks", "all", "--policies", "nope"], "unknown 'nope'"),
])
def test_cli_refuses_bad_task_options_before_running(argv, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(_args([*argv, "--json", str(tmp_path / "x.json")]))


def test_task_eval_refuses_bad_input(engine):
    with pytest.raises(ValueError, match="unknown task"):
        task_eval(tasks=("niah_none",), engine=engine, n=1)
    with pytest.raises(ValueError, match="unknown mode"):
        task_eval(modes=("sideways",), engine=engine, n=1)
    with pytest.raises(ValueError, match="training stream"):
        task_eval(seed=10_000_000, n=1)
    # a length too short for a later task is refused before any cell runs (no log line, nothing decoded)
    logged = []
    with pytest.raises(ValueError, match=r"too short for a niah_multivalue prompt .*raise the shortest context length"):
        task_eval(tasks=("niah_single", "niah_multivalue"), modes=("aware",), policies=("full",), context_lengths=(20,),
                  engine=engine, n=2, log=logged.append)
    assert logged == []


def test_bench_summary_of_a_stored_task_run_is_the_per_task_table(small):
    """`python bench/accuracy.py --summary RUN.json` prints `task_markdown` of the stored rows (what the per-task
    tables of docs/results.md are written from, `tools/render_results.py`)."""
    from test_bench_results import _tables

    table, _ = small
    report = json.loads(table.to_json(orient="records"))
    assert _tables().accuracy({"rows": report}) == task_markdown(table)


def test_docs_agnostic_example_runs_and_answers(capsys):
    """The documentation's query-agnostic Python example, run as written: the bundled `tiny-qwen3-ruler` answers its
    2048-token multi-value example (seed 0) exactly after SnapKV drops 75% of the context's cache."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    blocks = [(page.relative_to(root), b) for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
              for b in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL) if "eng.extend(" in b]
    assert len(blocks) == 1, f"README.md and docs/ should hold one Python example of the query-agnostic flow: {blocks}"
    page, block = blocks[0]
    exec(compile(block, str(page), "exec"), {})
    out = capsys.readouterr().out
    assert out.rstrip().endswith("| (True, 1.0)"), out


def test_cli_resume_keeps_the_stored_cells_and_refuses_another_grid(tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval.json"
    argv = ["--tasks", "niah_single", "--model", "tiny-qwen3-ruler", "--policies", "full", "random", "--drop-ratios",
            "0.5", "--context-lengths", "128", "--n", "3", "--seed", "2", "--json", str(out), "--quiet", "--resume"]
    assert run(_args(argv)) == 0  # no file yet: a fresh run
    first = json.loads(out.read_text())
    assert all(len(r["scores"]["exact"]) == 3 for r in first["rows"])  # every prompt's score is kept
    assert all(len(r["answers"]) == 3 for r in first["rows"])  # and the answer each one scored
    # a killed run leaves what its last checkpoint wrote; resuming it runs only the missing cell (stored by a
    # tdutils that kept no answers: such a file still resumes)
    old_rows = [{k: v for k, v in r.items() if k != "answers"} for r in first["rows"][:3]]
    assert set(first["meta"]["task_seconds"]) == {"niah_single"} and first["meta"]["task_seconds"]["niah_single"] > 0
    stored = {**first, "rows": old_rows, "meta": {**first["meta"], "interrupted": True, "seconds": 1000.0,
                                                  "task_seconds": {"niah_single": 900.0}}}
    out.write_text(json.dumps(stored))
    capsys.readouterr()
    from tdutils.eval import runner

    ran = []
    real = runner._run_group
    monkeypatch.setattr(runner, "_run_group", lambda *a: ran.append([c[:2] for c in a[4]]) or real(*a))
    assert run(_args(argv)) == 0
    assert ran == [[("random", 0.5)]]  # agnostic: the full cache was stored, only random@0.5 ran
    again = json.loads(out.read_text())
    assert [r["scores"] for r in again["rows"]] == [r["scores"] for r in first["rows"]]
    assert [r["answers"] for r in again["rows"]] == [None] * 3 + [first["rows"][3]["answers"]]
    assert again["meta"]["interrupted"] is False and again["meta"]["seconds"] >= 1000  # the total, with the stored run
    assert 900 < again["meta"]["task_seconds"]["niah_single"] < 1000  # the stored task's seconds, plus this run's
    # the summary gives this invocation's seconds and the total
    # (in minutes past one: 1000 s stored + this run's few seconds)
    out_text = capsys.readouterr().out
    took = re.search(r", (under 1 s|\d+ s) \(this run; ([\d.]+) min with the stored run it resumed\)\n", out_text)
    assert took and float(took[2]) == round(again["meta"]["seconds"] / 60, 1), out_text[-300:]
    with pytest.raises(ValueError, match="--resume: .* is a run of another grid \\(n 3 there, 4 here\\)"):
        run(_args([*argv[:-6], "--n", "4", "--seed", "2", "--json", str(out), "--quiet", "--resume"]))


def test_resume_refuses_a_grid_that_would_drop_stored_cells_and_extends_a_larger_one(tmp_path):
    out = tmp_path / "eval.json"
    base = ["--tasks", "niah_single", "--model", "tiny-qwen3-ruler", "--n", "2", "--seed", "2", "--json", str(out),
            "--quiet"]
    assert run(_args([*base, "--policies", "full", "random", "--drop-ratios", "0.5", "0.75", "--context-lengths",
                      "128"])) == 0
    stored = out.read_text()
    with pytest.raises(ValueError, match=r"--resume: .* holds cells this grid leaves out \(drop ratios 0.75\), "
                                         r"which resuming would drop from the file"):
        run(_args([*base, "--policies", "full", "random", "--drop-ratios", "0.5", "--context-lengths", "128",
                   "--resume"]))
    with pytest.raises(ValueError, match=r"leaves out \(policies random\)"):
        run(_args([*base, "--policies", "full", "--drop-ratios", "0.5", "--context-lengths", "128", "--resume"]))
    with pytest.raises(ValueError, match=r"leaves out \(context lengths 128\)"):
        run(_args([*base, "--policies", "full", "random", "--drop-ratios", "0.5", "0.75", "--context-lengths", "160",
                   "--resume"]))
    assert out.read_text() == stored  # refused before anything ran: the file as it was
    # a larger grid keeps every stored cell and runs only the new ones
    assert run(_args([*base, "--policies", "full", "random", "--drop-ratios", "0.5", "0.75", "--context-lengths",
                      "128", "160", "--resume"])) == 0
    rows = json.loads(out.read_text())["rows"]
    old = {(r["mode"], r["policy"], r["drop_ratio"], r["context_length"]): r["scores"]
           for r in json.loads(stored)["rows"]}
    new = {(r["mode"], r["policy"], r["drop_ratio"], r["context_length"]): r["scores"] for r in rows}
    assert {k: new[k] for k in old} == old and len(new) == 2 * len(old)


@pytest.mark.parametrize("option, values", [("--drop-ratios", ["0.5", "0.5"]), ("--policies", ["full", "full"]),
                                            ("--context-lengths", ["128", "128"])])
def test_a_value_given_twice_is_refused(option, values, capsys):
    argv = ["--tasks", "niah_single", "--model", "tiny-qwen3-ruler", "--n", "2", "--quiet", "--policies", "full",
            "random", "--drop-ratios", "0.5", "--context-lengths", "128"]
    i = argv.index(option)
    argv[i + 1:i + (3 if option == "--policies" else 2)] = values
    with pytest.raises(ValueError, match="more than once; give each once"):
        run(_args(argv))
    assert "grid:" not in capsys.readouterr().out  # refused before the plan of a grid that will not run


def test_task_table_leaves_out_the_columns_no_row_has():
    import pandas as pd

    from tdutils.eval.report import format_task_table

    base = {"context_length": 512, "mode": "agnostic", "drop_ratio": 0.5, "n": 2, "modify_s": 0.1, "kept_tokens": 256}
    fidelity = pd.DataFrame([{**base, "task": "text_fidelity", "policy": "snapkv", "correct": float("nan"),
                              "accuracy": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"),
                              "partial": float("nan"), "measure": "kl", "score": 0.0299}])
    text = format_task_table(fidelity)
    assert "nan" not in text and "accuracy" not in text and "partial" not in text, text
    assert text.splitlines()[1].split()[-2:] == ["kl", "0.0299"], text
    needle = {**base, "task": "ruler_niah_single_1", "policy": "knorm", "correct": 1, "accuracy": 0.5,
              "ci_low": 0.0945, "ci_high": 0.9055, "partial": 0.5, "measure": "exact", "score": 0.5}
    mixed = format_task_table(pd.DataFrame([needle, fidelity.iloc[0].to_dict()]))
    rows = mixed.splitlines()
    assert "accuracy" in rows[0] and "50.0%" in rows[1] and "9.4-90.5" in rows[1], mixed
    assert "nan" not in mixed and rows[2].count("–") == 4, mixed


def test_resume_from_a_path_with_nothing_stored_says_it_starts_the_whole_grid(tmp_path, capsys):
    from tdutils.cli.eval import _resume_rows

    missing = tmp_path / "typo.json"
    assert _resume_rows(str(missing), {}) == ([], 0.0, {})
    assert f"--resume: nothing stored at {missing} yet: starting the whole grid there" in capsys.readouterr().out


def test_a_policy_that_dropped_nothing_gets_a_note():
    """At a length its window covers, a policy keeps every token: its row is the full cache's under its name."""
    import pandas as pd

    from tdutils.eval import undropped_notes

    table = pd.DataFrame([
        {"task": "t", "mode": "aware", "context_length": 10, "policy": "full", "drop_ratio": 0.0, "kept_tokens": 10.0},
        {"task": "t", "mode": "aware", "context_length": 10, "policy": "snapkv", "drop_ratio": 0.5, "kept_tokens": 10.0},
        {"task": "t", "mode": "aware", "context_length": 10, "policy": "knorm", "drop_ratio": 0.5, "kept_tokens": 5.0},
    ])
    notes = undropped_notes(table)
    assert notes == ["note: snapkv at drop ratio 0.5 (t, aware, 10 tokens) kept 10 KV tokens per request, 100% of "
                     "the full cache's: its protected tokens (window, sinks) cover this prompt, so it dropped "
                     "(almost) nothing; use longer context lengths"]
    no_full = table[table.policy != "full"].rename(columns={"context_length": "context_tokens"}).drop(
        columns=["task", "mode"])
    assert len(undropped_notes(no_full)) == 1  # the context length is the reference without a full cell


def test_cells_of_one_ratio_decode_as_one_batch_with_the_same_answers(engine):
    """`run_cells_shared` decodes the cells of one drop ratio as one batch of their edited caches (`_cell_groups`,
    `Engine.restore` of joined snapshots); each request's greedy answer and kept tokens are those of decoding the
    cells one at a time (fp32 tiny model), in both modes, and the batches are fewer."""
    from tdutils.eval.runner import build_cells, run_cells_shared

    tok = engine.tokenizer
    data = make_task_dataset("niah_multiquery", 5, 160, tokenizer=tok, seed=3)
    parts = [split_question(tok, d) for d in data]
    contexts, questions = [c for c, _ in parts], [q for _, q in parts]
    cells = build_cells(engine, ["full", "snapkv", "random", "streaming_llm", "h2o"], [0.5, 0.75], {})
    calls = []
    decode = engine.decode

    def counted(*args, **kwargs):
        calls.append(len(engine.requests))
        return decode(*args, **kwargs)

    engine.decode = counted
    try:
        runs = {}
        for tokens in (0, 1 << 30):
            calls.clear()
            runs[tokens] = run_cells_shared(engine, contexts, questions, {"aware": cells, "agnostic": cells},
                                            max_tokens=12, batch_size=3, group_bytes=tokens)
            runs[tokens, "calls"] = list(calls)
    finally:
        del engine.decode
    for mode in ("aware", "agnostic"):
        (texts, _, kept), (joint_texts, _, joint_kept) = runs[0][mode], runs[1 << 30][mode]
        assert joint_texts == texts and joint_kept == kept
    # requests per decode call, chunks of 3 and 2 prompts, aware then agnostic: one cell at a time (9 cells), or
    # the full cache alone and each ratio's 4 cells together
    assert runs[0, "calls"] == [3] * 18 + [2] * 18
    assert runs[1 << 30, "calls"] == [3, 12, 12, 3, 12, 12, 2, 8, 8, 2, 8, 8]


def test_cell_groups_split_each_ratio_evenly_within_the_byte_budget(engine):
    """`_cell_groups`: one ratio's cells in even parts whose kept caches fit `group_bytes` ((1 - ratio) of the
    longest prefilled cache per request); the full cache alone; no groups without a budget."""
    from tdutils.eval.runner import _cell_groups

    engine.prefill([[5] * 100, [6] * 98])  # longest 100 tokens
    saved = engine.snapshot()
    token_bytes = saved[0].kv[:, :, :1].numel() * 4  # fp32 [2, L, 1, D]
    cells = [("full", 0.0, None)] + [(p, r, None) for r in (0.5, 0.9) for p in "abcde"]
    budget = 2 * 50 * token_bytes * 2  # two cells of 2 requests x 50 tokens at 0.5
    groups = _cell_groups(engine, saved, cells, 2, budget)
    assert [[(p, r) for p, r, _ in g] for g in groups] == [
        [("full", 0.0)], [("a", 0.5), ("b", 0.5)], [("c", 0.5), ("d", 0.5)], [("e", 0.5)],
        [(p, 0.9) for p in "abcde"]]  # 0.9: 5 x 2 x 10 tokens fit; 0.5: 3 parts of at most 2
    assert _cell_groups(engine, saved, cells, 2, 0) == [[c] for c in cells]


def test_group_lines_of_modes_computed_in_one_pass(engine):
    """Both modes from one prefill per chunk (`run_cells_shared`): the first group's line carries the pass's seconds
    and says so, the second points to it instead of printing 0.0 s."""
    import re

    logged = []
    task_eval(tasks=("niah_single",), policies=("full", "snapkv"), drop_ratios=(0.5,), context_lengths=(160,), n=2,
              seed=2, engine=engine, batch_size=2, log=logged.append)
    assert len(logged) == 2, logged
    assert re.search(r" aware: .*\(\d+\.\d s, the aware and agnostic cells together\)$", logged[0]), logged
    assert logged[1].endswith("(computed with the aware cells above)"), logged


def test_eval_into_a_closed_pipe_stops_quietly_with_status_141(tmp_path):
    # `python -m tdutils eval ... | head -1`: the reader goes away; the command stops as a pipe's writer does, at
    # its first line (the grid's plan), and prints no error or traceback
    out = tmp_path / "eval.json"
    p = subprocess.Popen([sys.executable, "-m", "tdutils", "eval", "--tasks", "niah_single", "--policies", "full",
                          "--n", "1", "--context-lengths", "128", "--mode", "aware", "--json", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141, err
    assert "Error" not in err and "Traceback" not in err and not out.exists(), err


def test_a_tdutils_warning_prints_as_one_line_without_the_source(capsys, tmp_path):
    from tdutils.cli.main import main

    rc = main(["eval", "--tasks", "niah_single", "--policies", "full", "snapkv", "--drop-ratios", "1", "--n", "1",
               "--context-lengths", "128", "--mode", "aware", "--quiet", "--json", str(tmp_path / "e.json")])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "tdutils: warning: drop_ratio=1 keeps only the tokens snapkv always keeps" in err, err
    assert "UserWarning" not in err and ".py:" not in err, err
