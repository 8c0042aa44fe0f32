"""The task registry (`tdutils.eval.tasks`) and the command lines' handling of real-model tasks: names, suites,
defaults, refusals and the notes for accuracies that measure nothing. One small run loads the bundled model."""

import pandas as pd
import pytest

from tdutils.answers import ScoreReport
from tdutils.cli.eval import parse_tasks
from tdutils.cli.main import accuracy_notes, main
from tdutils.data import RULER_TASKS
from tdutils.eval import weak_task_notes
from tdutils.eval.tasks import Task, get_task, register_task, task_names
from tdutils.ruler import RULER_TEMPLATE_TASKS


def test_both_suites_are_registered_without_clashes():
    """Word-level tasks keep their names; RULER's templates are 'ruler_' + RULER's own names (two would clash)."""
    assert task_names("word") == RULER_TASKS
    partial = ("niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")  # several references: partial credit
    assert task_names("ruler") == (*(f"ruler_{t}" for t in RULER_TEMPLATE_TASKS), *(f"ruler_{t}_partial" for t in partial))
    assert parse_tasks(["ruler"]) == [f"ruler_{t}" for t in RULER_TEMPLATE_TASKS]  # the variants run when named
    assert get_task("ruler_fwe_partial").measure == "partial" and get_task("ruler_fwe").measure == "exact"
    assert get_task("text_fidelity").suite == "text" and get_task("text_fidelity").teacher_forced
    assert {"niah_multivalue", "ruler_niah_multivalue"} <= set(task_names())
    assert get_task("ruler_vt").suite == "ruler" and get_task("variable_tracking").suite == "word"
    with pytest.raises(ValueError, match="unknown task 'vt'; registered tasks are word: niah_single"):
        get_task("vt")
    with pytest.raises(ValueError, match="already registered"):
        register_task(Task("niah_single", "word", None, None, None, None))
    with pytest.raises(ValueError, match="suite must be one of"):
        register_task(Task("new", "other", None, None, None, None))


def test_parse_tasks_expands_groups_and_names_the_choices():
    """'ruler' expands to every template task (not the partial-credit variants), 'all' to the five word-level
    ones; unknown names list both."""
    assert parse_tasks(["ruler"]) == [t for t in task_names("ruler") if not t.endswith("_partial")]
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


def test_passkey_is_a_registration_with_its_own_defaults():
    """Passkey is a task like the others: aware mode only (no split), its own model, decode length and layout."""
    task = get_task("passkey")
    assert task.suite == "passkey" and task.split is None and "passkey" not in task_names("word")
    assert (task.defaults.model, task.defaults.modes, task.defaults.max_tokens) == ("tiny-qwen3", ("aware",), 10)
    assert parse_tasks(["passkey"]) == ["passkey"]


def test_drop_ratios_are_checked_once_per_path(monkeypatch):
    """`DropRatios` checks each ratio once; handing a checked tuple on checks nothing again."""
    from tdutils.eval import common
    from tdutils.eval.common import DropRatios

    calls, real = [], common.check_drop_ratio
    monkeypatch.setattr(common, "check_drop_ratio", lambda r: calls.append(r) or real(r))
    ratios = DropRatios([0.5, 0.75])
    assert DropRatios(ratios) is ratios and ratios == (0.5, 0.75) and calls == [0.5, 0.75]
    with pytest.raises(ValueError, match=r"--drop-ratios: drop_ratio must lie in \[0, 1\].*give fractions"):
        DropRatios([0.5, 1.5], option="--drop-ratios")


def test_a_registered_task_reaches_the_command_line_with_its_defaults(tmp_path):
    """A task is one registration: `eval --tasks NAME` runs it with the defaults it registered (model, policies,
    drop ratios, context lengths, n, modes), with no other edit (the bundled tiny-qwen3-ruler, 96 tokens)."""
    import json
    from dataclasses import replace

    from tdutils.eval.tasks import WORD_DEFAULTS, unregister_task

    defaults = replace(WORD_DEFAULTS, policies=("full", "random"), drop_ratios=(0.5,), context_lengths=(96,), n=2,
                       modes=("aware",))
    register_task(replace(get_task("niah_single"), name="niah_single_small", defaults=defaults))
    out = tmp_path / "eval.json"
    try:
        assert main(["eval", "--tasks", "niah_single_small", "--json", str(out), "--quiet", "--threads", "1"]) == 0
    finally:
        unregister_task("niah_single_small")
    meta = json.loads(out.read_text(encoding="utf-8"))["meta"]
    got = tuple(meta[k] for k in ("model", "policies", "drop_ratios", "context_lengths", "n", "modes"))
    assert got == ("tiny-qwen3-ruler", ["full", "random"], [0.5], [96], 2, ["aware"]), meta
    assert "niah_single_small" not in task_names()


def test_the_default_task_does_not_depend_on_which_family_was_imported_first():
    """Importing one family's module first (here text fidelity, as `tdutils.eval.precision` does) must not make its
    tasks the default benchmark: the built-in families keep their fixed order (it made `eval` run the wrong task)."""
    import subprocess
    import sys

    code = ("import tdutils.eval.task_fidelity, tdutils.eval.task_samples\n"
            "from tdutils.eval.tasks import task_names\n"
            "print(','.join(task_names()[:2]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "passkey,niah_single", (p.stdout, p.stderr[-2000:])
