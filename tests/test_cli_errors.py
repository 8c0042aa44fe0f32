"""`python -m tdutils`: bad input in one line (exit 2); a bug with its traceback and a request to report it (exit 1)."""

import pytest

import tdutils.cli.main as cli
from tdutils.cli.args import UsageError, is_usage_error, report_error


def _main_failing_with(exc, monkeypatch) -> int:
    """Exit status of `python -m tdutils run` when the subcommand raises `exc`."""
    def fail(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_run", fail)
    return cli.main(["run"])


@pytest.mark.parametrize("exc", [UsageError("--window 9 is too long; give a smaller --window"),
                                 ValueError("bad value"), FileNotFoundError("no such file"),
                                 ConnectionError("vLLM is down")])
def test_bad_input_is_one_line_with_status_2(monkeypatch, capsys, exc):
    assert _main_failing_with(exc, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err == f"python -m tdutils run: error: {exc}\n", err


@pytest.mark.parametrize("exc", [TypeError("unsupported operand"), RuntimeError("shape mismatch"),
                                 AssertionError("invariant broken"), KeyError("peak_batch"), IndexError("list index")])
def test_a_bug_shows_its_traceback_and_asks_for_a_report(monkeypatch, capsys, exc):
    assert _main_failing_with(exc, monkeypatch) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):", err
    assert "in fail" in err and f"{type(exc).__name__}: " in err, err  # where it was raised, and what
    assert lines[-1].startswith(f"python -m tdutils run: internal error ({type(exc).__name__}): this is a bug in tdutils, not a "
                                f"problem with your input; please report it with the command you ran and the "
                                f"traceback above"), err


def test_report_names_the_issue_tracker_of_the_installed_package(capsys):
    report_error(RuntimeError("x"))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.endswith(" at https://github.com/tdutils/tdutils/issues"), last


def test_server_refusals_count_as_input_problems():
    from tdutils.serving.completion import CompletionError, CompletionHTTPError

    assert is_usage_error(CompletionError("x")) and issubclass(CompletionHTTPError, CompletionError)
    assert not is_usage_error(RuntimeError("x")) and not is_usage_error(NotImplementedError("x"))

