"""Accuracy regressions on the trained bundled models: passkey (issue 8, tiny-qwen3) and the RULER-style tasks
(issue 17, tiny-qwen3-ruler; bounds and measurements at the end of this file), and the pieces of `tdutils.eval`.

The regression bounds (small n, fixed seeds, a length the model was trained at): full cache >= 95%;
SnapKV and R-KV at drop ratio 0.5 within 5 points of the full cache (the issue gives R-KV SnapKV's
bound); random at 0.5 at least 30 points below SnapKV. A policy change that drops the needle, or a broken RoPE re-rotation, fails it.
"""

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from tdutils.cli.eval import add_arguments, run
from tdutils.data import make_passkey_dataset
from tdutils.eval import COLUMNS, TRAIN_SEED_BASE, passkey_eval, wilson_interval

ROOT = Path(__file__).resolve().parents[1]
REGRESSION_LENGTH = 512  # trained at 64..2048; 512 keeps the test fast
REGRESSION_N = 60
REGRESSION_SEED = 1  # evaluation seeds are small; training streams start at TRAIN_SEED_BASE


@pytest.fixture(scope="module")
def engine(tiny):
    from tdutils.engines.hf import HFEngine

    model, tok = tiny
    return HFEngine(model, tokenizer=tok, progress=False, prefill_batch_size=8, query_window=64)


@pytest.fixture(scope="module")
def regression(engine):
    responses = {}
    table = passkey_eval(policies=("full", "random", "snapkv", "rkv"), drop_ratios=(0.5,),
                         context_lengths=(REGRESSION_LENGTH,), n=REGRESSION_N, seed=REGRESSION_SEED,
                         max_tokens=6, engine=engine, batch_size=30, responses=responses)
    return table, responses


def _acc(table, policy):
    return float(table.loc[table["policy"] == policy, "accuracy"].iloc[0])


def test_full_cache_retrieves_the_passkey(regression):
    table, responses = regression
    assert _acc(table, "full") >= 0.95, responses["full", 0.0, REGRESSION_LENGTH][:5]


@pytest.mark.parametrize("policy", ["snapkv", "rkv"])
def test_attention_policies_at_half_keep_full_cache_accuracy(regression, policy):
    table, _ = regression
    assert _acc(table, policy) >= _acc(table, "full") - 0.05


def test_random_at_half_loses_the_needle(regression):
    table, _ = regression
    assert _acc(table, "random") <= _acc(table, "snapkv") - 0.30


def test_table_columns_and_cells(regression):
    table, _ = regression
    assert tuple(table.columns) == COLUMNS
    assert list(table["policy"]) == ["full", "random", "snapkv", "rkv"]
    assert list(table["drop_ratio"]) == [0.0, 0.5, 0.5, 0.5]  # "full" is one row at ratio 0
    assert (table["n"] == REGRESSION_N).all() and (table["context_tokens"] == REGRESSION_LENGTH).all()
    assert list(table["kept_tokens"]) == [512, 256, 256, 256]
    assert (table["correct"] == (table["accuracy"] * REGRESSION_N).round()).all()
    # (answers.wilson_interval gives 0.9999999999999999, not 1.0, as the upper end at n/n correct)
    assert ((table["ci_low"] <= table["accuracy"]) & (table["accuracy"] <= table["ci_high"] + 1e-12)).all()
    assert table.loc[table["policy"] == "full", "modify_s"].iloc[0] == 0.0
    assert (table.loc[table["policy"] != "full", "modify_s"] > 0).all()


def test_passkey_dataset_is_deterministic_and_seeds_differ(tiny):
    _, tok = tiny
    a = make_passkey_dataset(5, 256, tokenizer=tok, seed=3)
    assert a == make_passkey_dataset(5, 256, tokenizer=tok, seed=3)
    b = make_passkey_dataset(5, 256, tokenizer=tok, seed=4)
    assert [r["prompt"] for r in a] != [r["prompt"] for r in b]
    assert all(r["context_tokens"] == 256 for r in a)
    assert all(len(tok(r["prompt"])["input_ids"]) == 256 for r in a)  # no BOS; exactly the length


def test_training_and_evaluation_seeds_are_disjoint():
    spec = importlib.util.spec_from_file_location("train_tiny_model", ROOT / "tools" / "train_tiny_model.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    assert train.TRAIN_SEED_BASE == TRAIN_SEED_BASE == 10_000_000
    assert REGRESSION_SEED < TRAIN_SEED_BASE
    with pytest.raises(ValueError, match="training stream"):
        passkey_eval(n=1, seed=TRAIN_SEED_BASE)


@pytest.mark.parametrize("correct, n, low, high", [
    (0, 10, 0.0, 0.277533),        # upper = z^2 / (n + z^2)
    (10, 10, 0.722467, 1.0),
    (5, 10, 0.236593, 0.763407),
    (95, 100, 0.888250, 0.978456),
])
def test_wilson_interval_hand_values(correct, n, low, high):
    lo, hi = wilson_interval(correct, n)
    assert lo == pytest.approx(low, abs=1e-6) and hi == pytest.approx(high, abs=1e-6)


def test_wilson_interval_of_no_items_is_nan():
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_unknown_policy_and_bad_ratio_fail_before_running(engine):
    with pytest.raises(ValueError, match="unknown policy"):
        passkey_eval(policies=("full", "no_such_policy"), n=1, engine=engine)
    with pytest.raises(ValueError):
        passkey_eval(drop_ratios=(1.5,), n=1, engine=engine)


def test_cli_pieces_print_table_and_write_json_and_plot(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    out, png = tmp_path / "eval.json", tmp_path / "acc.png"
    args = ap.parse_args(["--policies", "full,random", "--drop-ratios", "0", "0.5", "--context-lengths", "128",
                          "--n", "4", "--seed", "2", "--json", str(out), "--plot", str(png), "--quiet"])
    assert run(args) == 0
    printed = capsys.readouterr().out
    assert "random" in printed and "95% CI" in printed and "n=4" in printed
    report = json.loads(out.read_text())
    assert report["meta"]["n"] == 4 and report["meta"]["drop_ratios"] == [0.0, 0.5]
    rows = {(r["policy"], r["drop_ratio"]): r for r in report["rows"]}
    assert set(rows) == {("full", 0.0), ("random", 0.0), ("random", 0.5)}
    # Ratio 0 returns the cache unchanged (docs/design.md §5), so it answers exactly as the full cache does.
    assert rows["random", 0.0]["correct"] == rows["full", 0.0]["correct"]
    assert png.stat().st_size > 0


def test_cli_full_cache_alone_records_no_drop_ratio(tmp_path, capsys):
    """`full` ignores --drop-ratios (one row at 0), so the report must not claim the default ratios were run."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    out = tmp_path / "eval.json"
    assert run(ap.parse_args(["--policies", "full", "--context-lengths", "128", "--n", "2", "--json", str(out),
                              "--quiet"])) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["meta"]["drop_ratios"] == [] and [r["drop_ratio"] for r in report["rows"]] == [0.0], report


def test_cli_all_policies_and_window(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    out = tmp_path / "eval.json"
    args = ap.parse_args(["--policies", "all", "--drop-ratios", "0.5", "--context-lengths", "128", "--n", "2",
                          "--window", "24", "--json", str(out), "--quiet", "--threads", "1"])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert run(args) == 0, capsys.readouterr()
        assert torch.get_num_threads() == 1  # --threads reached torch
        assert json.loads(out.read_text())["meta"]["threads"] == 1
    finally:
        torch.set_num_threads(before)
    report = json.loads(out.read_text())
    from tdutils.policies import get_policy, policy_names

    assert [r["policy"] for r in report["rows"]] == policy_names()
    with_window = {p for p in policy_names() if "window" in get_policy(p).defaults()}
    assert report["meta"]["policy_params"] == {p: {"window": 24} for p in with_window}
    assert {"knorm", "h2o", "snapkv", "streaming_llm"} <= with_window and "middle_chunk" not in with_window


# --- RULER-style tasks on tiny-qwen3-ruler (issue 17) ---------------------------------------------------------
#
# Measured on the bundled weights (model.safetensors sha256 78be2990..., run 9, 2026-12-01), 1024 tokens, drop
# ratio 0.75, exact match in % (full / SnapKV / random):
#   seed 1, n=32, aware: niah_single 100 / 100 / 0, niah_multikey 100 / 100 / 0, niah_multivalue 100 / 96.9 / 0,
#                 niah_multiquery 96.9 / 96.9 / 0, variable_tracking 100 / 100 / 0; agnostic niah_multikey 100 / 93.8 / 0
# The bounds are floors and gaps with room for sampling noise (n = 32), never ceilings. A policy change that drops
# the needles, a broken extend, or a model that stops matching keys fails them.

# 1024: the shortest length runs 5-9 trained at. At 512 tokens, where SnapKV at 0.75 keeps 64 tokens beside its
# 64-token window, run 9's weights (RoPE theta 100000) score 43.8 / 56.2% on multi-value / multi-query and 75.0% on
# agnostic multi-key (same seed and n), where run 8's (theta 10000) scored 87.5 / 93.8 / 96.9% (cause not measured).
RULER_LENGTH = 1024
RULER_N = 32  # per task: 160 examples per policy over the five tasks
RULER_RATIO = 0.75


@pytest.fixture(scope="module")
def ruler():
    """`task_eval` of full, SnapKV and random at drop ratio 0.75 on the bundled `tiny-qwen3-ruler`: every task in
    aware mode, and niah_multikey (four needles, one asked) in agnostic mode (one thread: a tiny model on a shared
    2-core machine runs many times faster so). Returns `(table, responses)` of both runs together."""
    import pandas as pd

    from tdutils.engines.hf import HFEngine
    from tdutils.eval import task_eval

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFEngine("tiny-qwen3-ruler", device="cpu", progress=False, prefill_batch_size=8, query_window=0)
        responses = {}
        common = dict(policies=("full", "snapkv", "random"), drop_ratios=(RULER_RATIO,), context_lengths=(RULER_LENGTH,),
                      n=RULER_N, seed=REGRESSION_SEED, engine=engine, batch_size=RULER_N, responses=responses)
        aware = task_eval(modes=("aware",), **common)
        agnostic = task_eval(tasks=("niah_multikey",), modes=("agnostic",), **common)
    finally:
        torch.set_num_threads(before)
    return pd.concat([aware, agnostic], ignore_index=True), responses


def _task_acc(table, task, policy, mode="aware"):
    cell = table[(table["task"] == task) & (table["policy"] == policy) & (table["mode"] == mode)]
    return float(cell["accuracy"].iloc[0])


def test_ruler_full_cache_solves_every_task(ruler):
    table, responses = ruler
    for task in table["task"].unique():
        assert _task_acc(table, task, "full") >= 0.80, (task, responses[task, "aware", "full", 0.0, RULER_LENGTH][:5])


@pytest.mark.parametrize("mode", ["aware", "agnostic"])
def test_ruler_snapkv_keeps_the_asked_needle_and_random_loses_it(ruler, mode):
    """Multi-key: four needles, one asked, so keeping *a* needle is not enough."""
    table, _ = ruler
    full, snapkv, random = (_task_acc(table, "niah_multikey", p, mode) for p in ("full", "snapkv", "random"))
    assert snapkv >= full - 0.15, (mode, full, snapkv)
    assert random <= snapkv - 0.60, (mode, snapkv, random)


def test_ruler_snapkv_beats_random_on_every_task(ruler):
    table, _ = ruler
    aware = table[table["mode"] == "aware"]
    assert aware["task"].nunique() == 5
    mean = aware.groupby("policy")["accuracy"].mean()
    assert mean["full"] >= 0.85 and mean["snapkv"] - mean["random"] >= 0.50, mean.to_dict()
    for task in aware["task"].unique():
        assert _task_acc(table, task, "snapkv") - _task_acc(table, task, "random") >= 0.30, task


def test_ruler_agnostic_full_cache_answers_exactly_as_aware(ruler):
    """prefill(context) + extend(question) reads the aware prompt's tokens: the trained model answers the same."""
    _, responses = ruler
    key = ("niah_multikey", "full", 0.0, RULER_LENGTH)
    assert responses[key[0], "agnostic", *key[1:]] == responses[key[0], "aware", *key[1:]]
