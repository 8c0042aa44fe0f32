"""Datasets are tasks (issue 46, step 3): `run --dataset NAME` and `eval --tasks NAME` read one registry and score
with the task's own scorer; and one configuration type for every comparison (step 6): `compare` runs drop
functions and decode-time compressions alike and keeps the runs that finished on Ctrl-C."""

import json
from dataclasses import replace

import pytest

import tdutils
from tdutils.cli.main import main
from tdutils.compression import Compression
from tdutils.engines.hf import HFEngine
from tdutils.eval import task_eval
from tdutils.eval.tasks import dataset_task, get_task, load_rows, register_task, score_rows, unregister_task
from tdutils.runs import Interrupted, RunConfig

pytestmark = pytest.mark.usefixtures("one_thread")
TASK, MODEL, LENGTH, N, TOKENS = "niah_single", "tiny-qwen3-ruler", 96, 3, 8


def _run_cli(tmp_path, dataset):
    out = tmp_path / f"{dataset}.json"
    rc = main(["run", "--model", MODEL, "--dataset", dataset, "--context-length", str(LENGTH), "--num-requests",
               str(N), "--max-tokens", str(TOKENS), "--repeats", "1", "--policy", "streaming_llm", "--drop-ratio",
               "0.5", "--json", str(out), "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text(encoding="utf-8"))["accuracy"]


def _eval(task, responses=None):
    table = task_eval(MODEL, [task], ["aware"], ["full", "streaming_llm"], [0.5], [LENGTH], n=N, seed=0,
                      max_tokens=TOKENS, responses=responses)
    return {p: (int(c), list(s["exact"])) for p, c, s in zip(table["policy"], table["correct"], table["scores"])}


def test_a_dataset_name_runs_in_run_and_eval_with_the_same_scores(tmp_path):
    responses = {}
    cells = _eval(TASK, responses)
    acc = _run_cli(tmp_path, TASK)
    assert acc["baseline"]["correct"] == cells["full"][0] and acc["baseline"]["n"] == N, (acc, cells)
    assert acc["streaming_llm@0.5"]["correct"] == cells["streaming_llm"][0], (acc, cells)
    # the rows `run` reads are the task's examples, scored by the task's scorer on the same answers as eval
    rows = load_rows(TASK, model=MODEL, num_requests=N, context_tokens=LENGTH)
    assert dataset_task(TASK, rows) is get_task(TASK)
    answers = responses[TASK, "aware", "full", 0.0, LENGTH]
    assert score_rows(rows, answers).is_correct == [bool(x) for x in cells["full"][1]]
    assert cells["full"][0] > 0  # the trained model finds the needle: the equality above is not 0 == 0


def test_the_scorer_is_the_tasks_own(tmp_path):
    """A task registered with a scorer that marks every answer wrong scores 0 in run and in eval alike."""
    strict = replace(get_task(TASK), name="niah_single_never", score=lambda values, text: (False, 0.0))
    register_task(strict)
    try:
        acc = _run_cli(tmp_path, "niah_single_never")
        cells = _eval("niah_single_never")
    finally:
        unregister_task("niah_single_never")
    assert acc["baseline"]["correct"] == acc["streaming_llm@0.5"]["correct"] == 0, acc
    assert cells["full"][0] == cells["streaming_llm"][0] == 0, cells
    assert acc["baseline"]["n"] == N


def test_load_prompts_reads_files_only_and_names_load_rows():
    with pytest.raises(ValueError, match="not a bundled dataset"):
        tdutils.data.load_prompts("ruler_niah_single_1")


class StopAt:
    """Wraps an engine; the `stop`-th decode (counted from 0, warm-ups included) raises KeyboardInterrupt."""

    def __init__(self, engine, stop):
        self.engine, self.stop, self.calls = engine, stop, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def decode(self, *args, **kwargs):
        if self.calls == self.stop:
            raise KeyboardInterrupt
        self.calls += 1
        return self.engine.decode(*args, **kwargs)


@pytest.fixture
def setup(tiny, sample_ids):
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, kv_budget_tokens=tdutils.default_kv_budget([64], 12, 2.25))
    fn = tdutils.make_drop_fn("random", drop_ratio=0.5, model_config=eng.facts, seed=0)
    configs = {"random@0.5": fn, "B=40": Compression("snapkv", budget=40, buffer=4, window=4),
               "both": RunConfig(drop_fn=fn, compression=Compression("snapkv", budget=24, buffer=4, window=4))}
    return eng, [sample_ids[0][:64]] * 2, configs


def test_compare_runs_drop_functions_and_compressions(setup):
    eng, ids, configs = setup
    results, table = tdutils.compare(eng, ids, configs, max_tokens=12, repeats=1, warmup=False)
    assert list(results) == ["baseline", *configs]
    assert results["baseline"].metrics.decode.compressions == results["random@0.5"].metrics.decode.compressions == 0
    # B=40, N=4: 64-token caches are cut at the first step; "both" drops to 32 tokens, then is cut from B + N = 28
    assert results["B=40"].metrics.decode.compressions > 0 and results["both"].metrics.decode.compressions > 0
    assert results["random@0.5"].metrics.modify.tokens_after == results["both"].metrics.modify.tokens_after == 64
    assert list(table.index) == ["baseline", *configs]


def test_compare_keeps_the_finished_runs_on_ctrl_c(setup):
    eng, ids, configs = setup
    # no warm-up; repeat 1: baseline (0), random (1), B=40 (2), both (3); repeat 2: baseline (4), then Ctrl-C
    with pytest.raises(Interrupted) as stop:
        tdutils.compare(StopAt(eng, 5), ids, configs, max_tokens=12, repeats=2, warmup=False)
    got = stop.value
    assert isinstance(got, KeyboardInterrupt)
    assert [m.name for m in got.runs] == ["baseline", "random@0.5", "B=40", "both", "baseline"]
    assert {k: len(r.repeats) for k, r in got.results.items()} == {"baseline": 2, "random@0.5": 1, "B=40": 1, "both": 1}
    assert got.results["B=40"].metrics.decode.compressions > 0
