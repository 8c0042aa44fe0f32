"""The task registry (`tdutils.tasks`) and the command lines' handling of real-model tasks: names, suites, defaults,
refusals and the notes for accuracies that measure nothing. No model is loaded."""

import pandas as pd
import pytest

from tdutils.__main__ import accuracy_notes, main
from tdutils.answers import ScoreReport
from tdutils.data import RULER_TASKS
from tdutils.evaluate import parse_tasks, weak_task_notes
from tdutils.ruler import RULER_TEMPLATE_TASKS
from tdutils.tasks import Task, get_task, register_task, task_names


def test_both_suites_are_registered_without_clashes():
    """Word-level tasks keep their names; RULER's templates are 'ruler_' + RULER's own names (two would clash)."""
    assert task_names("word") == RULER_TASKS
    assert task_names("ruler") == tuple(f"ruler_{t}" for t in RULER_TEMPLATE_TASKS)
    assert {"niah_multivalue", "ruler_niah_multivalue"} <= set(task_names())
    assert get_task("ruler_vt").suite == "ruler" and get_task("variable_tracking").suite == "word"
    with pytest.raises(ValueError, match="unknown task 'vt'; registered tasks are word: niah_single"):
        get_task("vt")
    with pytest.raises(ValueError, match="already registered"):
        register_task(Task("niah_single", "word", None, None, None, None))
    with pytest.raises(ValueError, match="suite must be one of"):
        register_task(Task("new", "other", None, None, None, None))


def test_parse_tasks_expands_groups_and_names_the_choices():
    """'ruler' expands to every template task, 'all' to the five word-level ones; unknown names list both."""
    assert parse_tasks(["ruler"]) == list(task_names("ruler"))
    assert parse_tasks(["all", "ruler_cwe"]) == [*RULER_TASKS, "ruler_cwe"]
    with pytest.raises(ValueError, match=r"--tasks: unknown 'niah_single_1'.*'ruler' \(RULER templates"):
        parse_tasks(["niah_single_1"])


def test_a_bundled_model_is_refused_the_ruler_templates(capsys):
    """The bundled word-level models cannot read RULER's English: exit 2, one line, before any work."""
    assert main(["eval", "--model", "tiny-qwen3", "--tasks", "ruler_niah_single_1", "--json", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "RULER's templates need a real tokenizer" in err, err
    assert main(["run", "--model", "tiny-qwen3", "--dataset", "ruler_niah_single_1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "need a real model and tokenizer" in err, err


def test_weak_tasks_get_a_note_instead_of_a_ranking():
    """A task the full cache fails (< 50%) is named with its score; one it solves is not."""
    rows = [{"task": "ruler_vt", "mode": "aware", "policy": "full", "drop_ratio": 0.0, "context_length": 2048,
             "accuracy": 0.1},
            {"task": "ruler_niah_single_1", "mode": "aware", "policy": "full", "drop_ratio": 0.0,
             "context_length": 2048, "accuracy": 1.0},
            {"task": "ruler_vt", "mode": "aware", "policy": "snapkv", "drop_ratio": 0.5, "context_length": 2048,
             "accuracy": 0.0}]
    notes = weak_task_notes(pd.DataFrame(rows))
    assert len(notes) == 1 and notes[0].startswith("note: ruler_vt (aware, 2048 tokens): the full cache scores 10%")


def _report(correct, total):
    return ScoreReport(mode="test", correct=correct, total=total, unparsed=0)


def test_accuracy_notes_flag_chance_and_a_failing_baseline():
    """Four-choice accuracy whose interval holds 25% measures nothing; so does a baseline below half."""
    chance = accuracy_notes({"baseline": _report(3, 16), "snapkv@0.5": _report(3, 16)}, chance=0.25)
    assert len(chance) == 1 and "within chance level (25% for four choices" in chance[0], chance
    weak = accuracy_notes({"baseline": _report(3, 16)}, chance=None)
    assert len(weak) == 1 and "cannot do this task reliably" in weak[0], weak
    assert accuracy_notes({"baseline": _report(15, 16)}, chance=0.25) == []
    assert accuracy_notes({"baseline": _report(16, 16)}, chance=None) == []


def test_a_real_model_on_word_level_tasks_is_warned(capsys):
    """A real model meeting the bundled models' word-level format gets a warning before any work (the unknown
    policy then stops the run, so no model loads)."""
    assert main(["eval", "--model", "smollm2-135m", "--tasks", "niah_single", "--policies", "foo"]) == 2
    err = capsys.readouterr().err
    assert "tdutils: warning: --model smollm2-135m meets tasks in the bundled models' word-level format" in err, err
    assert "(--tasks ruler)" in err, err
