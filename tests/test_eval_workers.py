"""`task_eval(workers=N)` / `eval --workers N`: each group's prompts in contiguous shards on worker processes give
the cells of one process; the shard and merge helpers on hand-computed values; bad worker counts refused."""

import math

import pytest

from tdutils.eval import task_eval
from tdutils.eval.runner import _merge_shards
from tdutils.eval.workers import shards, worker_cores

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread (tiny models, shared cores)


def test_shards_are_contiguous_and_even():
    assert shards(5, 2) == [(0, 2), (2, 5)]
    assert shards(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert shards(1, 4) == [(0, 1)]  # never an empty shard


def test_merge_keeps_prompt_order_and_sums_seconds():
    a = {"aware": ({("snapkv", 0.5): ["x", "y"]}, {("snapkv", 0.5): 1.5}, {("snapkv", 0.5): 10})}
    b = {"aware": ({("snapkv", 0.5): ["z"]}, {("snapkv", 0.5): 0.5}, {("snapkv", 0.5): 4})}
    assert _merge_shards([a, b]) == {"aware": ({("snapkv", 0.5): ["x", "y", "z"]}, {("snapkv", 0.5): 2.0},
                                        {("snapkv", 0.5): 14})}
    f1 = {"agnostic": ({("full", 0.0): {"kl": [0.0], "ppl": [3.0]}}, {("full", 0.0): 0.0}, {("full", 0.0): 7})}
    f2 = {"agnostic": ({("full", 0.0): {"kl": [0.0], "ppl": [5.0]}}, {("full", 0.0): 0.0}, {("full", 0.0): 8})}
    assert _merge_shards([f1, f2])["agnostic"][0] == {("full", 0.0): {"kl": [0.0, 0.0], "ppl": [3.0, 5.0]}}


def test_worker_cores_split_the_usable_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 2, 7, 5}, raising=False)
    assert worker_cores(2, 1) == [[2], [4]]
    assert worker_cores(2, 2) == [[2, 4], [5, 7]]
    assert worker_cores(3, 2) is None  # fewer cores than workers x threads: left to the scheduler


def test_two_workers_give_the_cells_of_one_process():
    kw = dict(model="tiny-qwen3", tasks=("niah_single", "text_fidelity"), modes=("aware", "agnostic"),
              policies=("full", "snapkv", "random"), drop_ratios=(0.5,), context_lengths=(160,), n=5, seed=2,
              batch_size=2)
    one = task_eval(**kw)
    two = task_eval(**kw, workers=2, worker_threads=1)
    assert len(one) == len(two) == 9  # niah_single: 3 cells x 2 modes; text_fidelity: 3 cells, agnostic only
    for a, b in zip(one.to_dict("records"), two.to_dict("records")):
        assert (a["task"], a["mode"], a["policy"], a["drop_ratio"]) == (b["task"], b["mode"], b["policy"],
                                                                       b["drop_ratio"])
        assert a["answers"] == b["answers"]
        assert a["kept_tokens"] == b["kept_tokens"]
        for measure, xs in a["scores"].items():
            assert len(xs) == 5
            assert all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(xs, b["scores"][measure])), \
                (a["task"], a["policy"], measure, xs, b["scores"][measure])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_worker_counts_are_refused(bad):
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        task_eval(model="tiny-qwen3", tasks=("niah_single",), n=1, workers=bad)


def test_workers_need_a_model_name(tiny):
    from tdutils.engines.hf import HFEngine

    engine = HFEngine(tiny[0], tokenizer=tiny[1], progress=False)
    with pytest.raises(ValueError, match="reopens the model in each worker process by its name"):
        task_eval(model=tiny[0], engine=engine, tasks=("niah_single",), policies=("full",), drop_ratios=(0.5,),
                  context_lengths=(160,), n=2, workers=2)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "argument --workers: expected a positive integer, got 0"),
    (["--workers", "64"], "--workers 64 is more than the 2 CPU core(s)"),
    (["--workers", "2", "--threads", "1"], "--threads 1 is shared among --workers 2: each needs at least one thread"),
    (["--device", "meta"], "argument --device: device 'meta' holds tensor shapes, not data"),
    (["--device", "xla"], "argument --device: device 'xla' is not a backend this torch computes on here"),
    (["--json", "/dev/full"], "--json '/dev/full' cannot be written (No space left on device)"),
    (["--json", "/dev/zero", "--resume"], "--resume: /dev/zero is not a regular file (a device, pipe or folder)"),
    (["--policies", "snapkv", "snapkv/request"], "the policies list snapkv more than once; give each once"),
])
def test_eval_refuses_bad_options_in_one_line(monkeypatch, capsys, argv, message):
    import tdutils.cli.eval as cli_eval
    import tdutils.cli.main as cli

    monkeypatch.setattr(cli_eval, "usable_cores", lambda: 2)
    monkeypatch.setattr("tdutils.cli.args.usable_cores", lambda: 2)
    try:
        status = cli.main(["eval", "--tasks", "niah_single", "--n", "1", "--json", "/tmp/unused.json", *argv])
    except SystemExit as exc:  # argparse's own type errors
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


def test_eval_on_a_gpu_is_one_process(monkeypatch):
    """`--device cuda` (here a GPU pretended, checked before any model loads): the leaderboard's default of two
    workers becomes one, and `--workers 2` is refused with what to give instead."""
    import argparse

    import tdutils.cli.eval as cli_eval

    monkeypatch.setattr(cli_eval, "usable_cores", lambda: 2)
    monkeypatch.setattr(cli_eval, "_on_cpu", lambda device: device in (None, "cpu"))
    monkeypatch.setattr(cli_eval, "check_context_lengths", lambda *a, **k: None)
    monkeypatch.setattr("tdutils.models.check_compute_device", lambda device, option="device": device)

    def plan(*argv):
        ap = argparse.ArgumentParser()
        cli_eval.add_arguments(ap)
        return cli_eval.plan_eval(ap.parse_args(["--tasks", "leaderboard", "--json", "/tmp/unused.json", *argv]))

    assert (plan().workers, plan("--device", "cpu").workers) == (2, 2)
    assert plan("--device", "cuda").workers == 1 and plan("--device", "cuda").device == "cuda"
    with pytest.raises(ValueError, match="--workers 2 splits a CPU's cores among processes; a run on a GPU is one "
                                         "process: drop --workers, or give --device cpu"):
        plan("--device", "cuda", "--workers", "2")


def test_workers_do_not_repeat_the_cells_warnings(capfd, tmp_path):
    """The parent builds the cells (and shows a drop ratio 1 warning) once; the spawned workers build them again
    without printing it a second and third time."""
    from tdutils.cli.main import main

    assert main(["eval", "--tasks", "niah_single", "--policies", "full", "snapkv", "--drop-ratios", "1", "--n", "2",
                 "--context-lengths", "128", "--mode", "aware", "--workers", "2", "--threads", "2", "--quiet",
                 "--json", str(tmp_path / "eval.json")]) == 0
    err = capfd.readouterr().err
    assert err.count("drop_ratio=1 keeps only") == 1 and "UserWarning" not in err, err
