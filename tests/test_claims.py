"""`tdutils.claims`: figures a notebook records in its outputs, read back from the executed notebook."""

import math

import nbformat
import pytest
import torch

from tdutils.claims import MIME, read, record


def _executed(*outputs_per_cell):
    nb = nbformat.v4.new_notebook()
    for outputs in outputs_per_cell:
        cell = nbformat.v4.new_code_cell("pass")
        cell.outputs = [nbformat.v4.new_output("display_data", data=data) for data in outputs]
        nb.cells.append(cell)
    return nb


def test_record_outside_ipython_prints_one_json_line_and_returns_plain_values(capsys):
    got = record(accuracy={"baseline": 1.0, "snapkv@0.5": torch.tensor(0.75)}, requests=4, method="exact")
    assert got == {"accuracy": {"baseline": 1.0, "snapkv@0.5": 0.75}, "requests": 4, "method": "exact"}
    assert type(got["accuracy"]["snapkv@0.5"]) is float
    printed = capsys.readouterr().out
    assert printed == 'claims: {"accuracy": {"baseline": 1.0, "snapkv@0.5": 0.75}, "method": "exact", "requests": 4}\n', \
        printed


@pytest.mark.parametrize("bad, error, match", [
    ({"x": math.nan}, ValueError, r"claim claims.x is nan; record a finite number"),
    ({"acc": {"a": math.inf}}, ValueError, r"claim claims.acc.a is inf"),
    ({"x": torch.ones(2)}, TypeError, r"claim claims.x has type Tensor; record numbers, strings, lists or dicts"),
    ({}, ValueError, r"record\(\) needs at least one figure"),
])
def test_record_refuses_what_a_bound_cannot_judge(bad, error, match):
    with pytest.raises(error, match=match):
        record(**bad)


def test_read_merges_claims_in_cell_order_and_ignores_other_outputs(tmp_path):
    nb = _executed([{"text/plain": "a table"}],
                   [{MIME: {"a": 1, "b": 2}, "text/plain": "claims: ..."}],
                   [],
                   [{MIME: '{"b": 3, "c": [1, 2]}'}])          # a JSON string, as some writers store it
    assert read(nb) == {"a": 1, "b": 3, "c": [1, 2]}
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert read(path) == read(str(path)) == {"a": 1, "b": 3, "c": [1, 2]}
    assert read(_executed([{"text/plain": "nothing recorded"}])) == {}
