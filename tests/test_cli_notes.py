"""The main job's caveats on its printed ratio, and its refusal of runs past the model's positions."""

import os
import subprocess
import sys

import pytest

from tdutils.metrics import ratio_caveats, speedup_notes
from tdutils.policies import get_policy, policy_names


def test_no_caveat_when_the_batch_grows_as_expected():
    assert ratio_caveats(4, 8, 1.95, 0.5) == []
    assert ratio_caveats(4, 8, 2.08, 0.5) == []  # cheaper steps may beat the batch ratio by a hair (5%)
    assert ratio_caveats(4, 8, 1.95, 0.5, ratio_min=1.85, ratio_max=2.0, repeats=3) == []  # 8% spread


def test_equal_batches_and_impossible_ratios_are_flagged():
    (note,) = ratio_caveats(4, 4, 14.7, 0.5)[:1]
    assert note.startswith("no larger batch: both runs decoded at most 4 requests at a time, so dropping bought no "
                           "larger batch"), note
    notes = ratio_caveats(1, 1, 1.92, 0.5)
    assert len(notes) == 1 and "at most 1 request at a time" in notes[0], notes
    (note,) = ratio_caveats(4, 8, 6.5, 0.5)
    assert note.startswith("above the capacity limit: 6.50x exceeds the capacity limit 1/(1-r) = 2.00x:"), note


def test_a_ratio_above_the_capacity_limit_is_flagged():
    """Issue 16: one run printed 2.42x against a 2.0x limit with no note."""
    (note,) = ratio_caveats(4, 8, 2.42, 0.5)
    assert note.startswith("above the capacity limit: 2.42x exceeds the capacity limit 1/(1-r) = 2.00x"), note
    # a batch that grew more than 1/(1-r) (budget rounding) raises the bar to the batch growth
    assert ratio_caveats(1, 3, 2.9, 0.5) == []
    (note,) = ratio_caveats(1, 3, 3.5, 0.5)
    assert "and the batch growth 1 -> 3" in note, note


def test_a_slower_run_with_a_larger_batch_is_flagged():
    (note,) = ratio_caveats(4, 8, 0.93, 0.5)
    assert note.startswith("slower despite a larger batch: the batch grew (4 -> 8 requests at a time) yet decoding "
                           "was slower (0.93x)"), note


def test_a_wide_spread_says_the_machine_was_busy():
    notes = ratio_caveats(4, 8, 1.9, 0.5, ratio_min=1.2, ratio_max=2.0, repeats=3)
    assert notes == ["machine busy: the 3 repeats gave ratios from 1.20x to 2.00x, a spread of 42% of the median "
                     "1.90x (more than 20%): the machine was busy; rerun or raise repeats"], notes
    # one repeat has no spread to judge
    assert ratio_caveats(4, 8, 1.9, 0.5, ratio_min=1.2, ratio_max=2.0, repeats=1) == []


def test_run_past_the_models_positions_is_refused():
    p = subprocess.run([sys.executable, "-m", "tdutils", "run", "--num-requests", "1", "--max-tokens", "3500",
                        "--no-progress"], check=False, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 2, p.stderr
    assert ("the longest prompt (1024 tokens) plus --max-tokens 3500 exceeds the model's 4096 positions "
            "(max_position_embeddings); lower --max-tokens") in p.stderr


@pytest.mark.parametrize("lengths,max_tokens,msg", [
    ([], 64, "prompt_lengths must be positive token counts of at least one prompt"),
    ([-5], 10, "prompt_lengths must be positive token counts"),
    ([1024], -64, "max_tokens must be >= 1"),
])
def test_default_budget_rejects_bad_sizes(lengths, max_tokens, msg):
    from tdutils import default_kv_budget

    with pytest.raises(ValueError, match=msg):
        default_kv_budget(lengths, max_tokens)


def test_default_budget_names_what_to_pass_for_rows_instead_of_lengths():
    from tdutils import default_kv_budget
    from tdutils.data import load_prompts

    rows = load_prompts("sample", num_requests=2)
    with pytest.raises(TypeError, match=r"prompt_lengths must be token counts \(ints, one per prompt\), got PromptRow; "
                                        r"pass the prompts' lengths, e\.g\. \[len\(ids\) for ids in token_ids\]"):
        default_kv_budget(rows, 64)
    with pytest.raises(TypeError, match="got str"):
        default_kv_budget(["a prompt"], 64)
    assert default_kv_budget([1024, 512], 64) == 4624  # ceil(4.25 x 1088)


def test_a_near_miss_of_the_bundled_model_fails_at_once():
    from tdutils.models import load_model

    with pytest.raises(FileNotFoundError, match="model 'tiny-qwen' is neither a local folder nor a bundled or packaged model: "
                                                "did you mean 'tiny-qwen3'"):
        load_model("tiny-qwen")


def test_eval_refuses_contexts_past_the_models_positions():
    from tdutils.eval import passkey_eval

    with pytest.raises(ValueError, match=r"context length 6000 \+ max_tokens 10 exceeds the model's 4096 positions"):
        passkey_eval(policies=["full"], drop_ratios=[0.0], context_lengths=[6000], n=2)


def test_snapkv_after_a_first_modify_says_why_the_query_is_gone():
    import tdutils

    eng = tdutils.open_engine("hf", progress=False)
    ids = eng.tokenize(tdutils.data.load_prompts("sample", num_requests=1))
    eng.prefill(ids)
    fn = tdutils.make_drop_fn("snapkv", drop_ratio=0.5, model_config=eng.facts)
    eng.modify(fn)
    with pytest.raises(tdutils.DropFunctionError, match="discards it after the first modify .* prefill again"):
        eng.modify(fn)


def test_a_json_object_is_not_read_as_an_empty_dataset(tmp_path):
    from tdutils.data import load_prompts

    one = tmp_path / "one.json"
    one.write_text('{"prompt": "a"}')
    with pytest.raises(ValueError, match=r"could not be read as JSON: expected a list of rows .* got a JSON dict"):
        load_prompts(str(one))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text('{"data": [{"prompt": "pass key"}]}')
    assert [r.prompt for r in load_prompts(str(wrapped))] == ["pass key"]


def test_eval_names_the_policies_it_knows():
    p = subprocess.run([sys.executable, "-m", "tdutils", "eval", "--policies", "full", "foo", "--n", "2"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    builtin = [n for n in policy_names() if get_policy(n).builtin]  # what the fresh process knows
    assert f"--policies: unknown 'foo'; choose from {['full', *builtin]} or 'all'" in p.stderr, p.stderr


@pytest.mark.parametrize("args,model,suite,default", [
    (["--tasks", "niah_single", "--model", "tiny-qwen3"], "tiny-qwen3", "the RULER-style tasks", "tiny-qwen3-ruler"),
    # (a bare --model tiny-qwen3-ruler runs the tasks it was trained on; the passkey suite must be asked for)
    (["--tasks", "passkey", "--model", "tiny-qwen3-ruler"], "tiny-qwen3-ruler", "the passkey benchmark", "tiny-qwen3"),
])
def test_eval_warns_when_a_bundled_model_meets_a_suite_it_never_saw(args, model, suite, default):
    """The passkey model scored 0% on niah_single without a word; the warning comes before any work (here the
    unknown policy then stops the run, so no model loads)."""
    p = subprocess.run([sys.executable, "-m", "tdutils", "eval", *args, "--policies", "foo", "--n", "2"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert (f"--model {model} was trained only on" in p.stderr and f"not on {suite}: its accuracy there says nothing "
            f"about the policies; omit --model to use {default}" in p.stderr), p.stderr


def test_speedup_notes_read_a_phase_table():
    import pandas as pd

    table = pd.DataFrame([{"run": "baseline", "peak_batch": 4, "decode_speedup": 1.0, "kept_fraction": 1.0},
                          {"run": "snapkv@0.5", "peak_batch": 4, "decode_speedup": 1.13, "kept_fraction": 0.5},
                          {"run": "random@0.5", "peak_batch": 8, "decode_speedup": 1.97, "kept_fraction": 0.5}]
                         ).set_index("run")
    (note,) = speedup_notes(table)
    assert note.startswith("snapkv@0.5: no larger batch: both runs decoded at most 4 requests at a time"), note
    spread = table.assign(repeats=3, decode_speedup_min=[1.0, 1.1, 1.5], decode_speedup_max=[1.0, 1.15, 2.0],
                          capacity_limit=[1.0, 2.0, 2.0])
    notes = speedup_notes(spread)
    assert [n.split(": ")[:2] for n in notes] == [["snapkv@0.5", "no larger batch"], ["random@0.5", "machine busy"]], notes


def test_a_broken_model_folder_fails_before_the_dataset_loads(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    p = subprocess.run([sys.executable, "-m", "tdutils", "run", "--model", str(tmp_path), "--no-progress"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "has no tokenizer files" in p.stderr and "unreachable" not in p.stdout, (p.stdout, p.stderr)


@pytest.mark.parametrize("kept, says", [(0.3359, "fewer than 1 - 0.5 = 0.50"), (0.62, "not 1 - 0.5 = 0.50"),
                                        (0.51, None)])
def test_a_dropped_run_that_stores_another_fraction_says_so(kept, says):
    """middle_chunk --chunk-size 3 at 0.5 drops round(1.5) = 2 of every 3 tokens: 0.34 stored, not 0.5."""
    import argparse

    import pandas as pd

    from tdutils.cli.main import stored_notes

    table = pd.DataFrame({"kept_fraction": [1.0, kept]}, index=["baseline", "middle_chunk@0.5"])
    notes = stored_notes(argparse.Namespace(repeats=3, drop_ratio=0.5), table, "middle_chunk@0.5")
    if says is None:
        assert notes == []
    else:
        assert len(notes) == 1 and says in notes[0] and f"stores {kept:.2f}" in notes[0], notes
