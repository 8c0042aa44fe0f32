"""Inputs modelled on public bug reports (issue 19): data files, encodings, reasoning output, event streams,
plots at drop ratio 1.0, reused timers and ambiguous RoPE shapes. Each fault is tested for its whole kind:
every loader, every stream path, every plot helper."""

import ast
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tdutils
from tdutils.answers import extract_answer, score_passkey
from tdutils.serving.completion import TokenEvent, iter_sse_lines, iter_token_events, make_post_completion
from tdutils.data import _read_hub, load_prompts
from tdutils.textio import NotUTF8Error, read_text

ROOT = Path(tdutils.__file__).resolve().parent
BOM = b"\xef\xbb\xbf"
UNICODE_PROMPT = "Résumé — 日本語"

# ---------------------------------------------------------------- 1. datasets arrive exactly as written

# The same three rows in every format: a passkey with a leading zero, a missing answer, a plain number; a
# text column holding "NA" (pandas' default would read it as missing) and an integer column with a gap.
ROWS = [{"prompt": "p one", "answer": "04819", "note": "NA"},
        {"prompt": "p two", "answer": None, "note": "x"},
        {"prompt": "p three", "answer": "48192", "note": None}]
WANT_ANSWERS = ["04819", None, "48192"]
CSV_TEXT = "prompt,answer,note\np one,04819,NA\np two,,x\np three,48192,\n"


def _write(fmt: str, folder: Path) -> str:
    """The ROWS as a dataset of format `fmt`; returns what to pass to the loader."""
    if fmt == "csv":
        path = folder / "d.csv"
        path.write_text(CSV_TEXT, encoding="utf-8")
    elif fmt == "jsonl":
        path = folder / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    elif fmt == "json":
        path = folder / "d.json"
        path.write_text(json.dumps(ROWS), encoding="utf-8")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "d.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:  # a hub dataset made of a CSV file: `datasets` resolves a folder exactly as a downloaded repo
        path = folder / "hub"
        path.mkdir()
        (path / "data.csv").write_text(CSV_TEXT, encoding="utf-8")
    return str(path)


def _rows(fmt: str, src: str) -> list[dict]:
    return _read_hub(src, "train") if fmt == "hub" else [
        {"prompt": r.prompt, "answer": r.answer, **r.meta} for r in load_prompts(src)]


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "json", "parquet", "hub"])
def test_every_loader_keeps_text_as_written_and_empty_cells_missing(fmt, tmp_path):
    rows = _rows(fmt, _write(fmt, tmp_path))
    assert [r["answer"] for r in rows] == WANT_ANSWERS, rows
    assert [r["note"] for r in rows] == ["NA", "x", None], rows
    assert [r["prompt"] for r in rows] == ["p one", "p two", "p three"]


def test_a_csv_passkey_with_a_leading_zero_scores_right(tmp_path):
    rows = load_prompts(_write("csv", tmp_path))
    report = score_passkey([rows[0].answer], ["0 4 8 1 9"])
    assert rows[0].answer == "04819" and report.correct == 1, (rows[0], report)


def test_parquet_integers_with_a_gap_stay_integers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": pa.array([48192, None, 7], pa.int64())}), path)
    assert [r.answer for r in load_prompts(str(path))] == ["48192", None, "7"]  # pandas would give 48192.0


# ---------------------------------------------------------------- 2. text files: UTF-8, BOM tolerated


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_text_datasets_with_a_byte_order_mark_and_non_ascii_text(suffix, tmp_path):
    row = {"prompt": UNICODE_PROMPT, "answer": "B"}
    text = {".jsonl": json.dumps(row, ensure_ascii=False) + "\n", ".json": json.dumps([row], ensure_ascii=False),
            ".csv": f"prompt,answer\n{UNICODE_PROMPT},B\n"}[suffix]
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(BOM + text.encode("utf-8"))
    rows = load_prompts(str(path))
    assert [(r.prompt, r.answer) for r in rows] == [(UNICODE_PROMPT, "B")]


def test_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    """Under an ASCII locale (LC_ALL=C without Python's UTF-8 mode) every loader still reads UTF-8."""
    files = []
    for suffix, text in ((".jsonl", json.dumps({"prompt": UNICODE_PROMPT}, ensure_ascii=False) + "\n"),
                         (".json", json.dumps([{"prompt": UNICODE_PROMPT}], ensure_ascii=False)),
                         (".csv", f"prompt\n{UNICODE_PROMPT}\n")):
        path = tmp_path / f"u{suffix}"
        path.write_bytes(text.encode("utf-8"))
        files.append(str(path))
    code = ("import locale, sys; from tdutils.data import load_prompts, filler_sentences; "
            "print(locale.getpreferredencoding(False)); "
            "print(ascii([load_prompts(f)[0].prompt for f in sys.argv[1:]])); print(len(filler_sentences()) > 0)")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONIOENCODING": "ascii:backslashreplace"}
    p = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, env=env, timeout=120,
                       check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    lines = p.stdout.splitlines()
    assert "utf" not in lines[0].lower(), f"the locale is not ASCII, so this test proves nothing: {out}"
    assert lines[1] == ascii([UNICODE_PROMPT] * 3) and lines[2] == "True", out


def test_a_file_that_is_not_utf8_is_refused_clearly(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"prompt": "Résumé"}, ensure_ascii=False).encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=r"is not UTF-8 text .*0xe9.*save it as UTF-8"):
        load_prompts(str(path))
    with pytest.raises(NotUTF8Error, match="latin1.jsonl"):
        read_text(path)


def _unencoded_text_opens(tree: ast.AST) -> list[int]:
    """Lines of calls that open a text file without encoding=: open()/os.fdopen() in a text mode,
    Path.read_text()/write_text()/open()."""
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        kws = {k.arg for k in node.keywords}
        if name in ("read_text", "write_text") and isinstance(f, ast.Attribute) and "encoding" not in kws:
            if not (isinstance(f.value, ast.Name) and f.value.id == "textio"):
                bad.append(node.lineno)
        elif name in ("open", "fdopen") and "encoding" not in kws:
            pos = 0 if isinstance(f, ast.Attribute) and f.attr == "open" else 1  # Path.open(mode) / open(p, mode)
            mode = node.args[pos] if len(node.args) > pos else next(
                (k.value for k in node.keywords if k.arg == "mode"), None)
            if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str) and "b" in mode.value):
                bad.append(node.lineno)
    return bad


# tdutils/servers.py is changed by issue 19 item 9 (the coordinator's); its log read is listed in the report.


def test_every_text_file_tdutils_opens_names_its_encoding():
    found = {}
    for path in sorted([*ROOT.rglob("*.py"), *(ROOT.parent / "tools").glob("*.py")]):
        if path.name == "textio.py":
            continue
        lines = _unencoded_text_opens(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[str(path.relative_to(ROOT.parent))] = lines
    assert not found, f"text files opened without encoding= (use tdutils.textio): {found}"


def test_the_encoding_check_finds_what_it_looks_for():
    tree = ast.parse("open(p)\nopen(p, 'rb')\nopen(p, encoding='utf-8')\nPath(p).read_text()\n"
                     "os.fdopen(fd, 'w')\nos.fdopen(fd, 'wb')\np.write_text(s, encoding='utf-8')\n")
    assert sorted(_unencoded_text_opens(tree)) == [1, 4, 5]


# ---------------------------------------------------------------- 3. answers of reasoning models

ISSUE_EXAMPLE = "Maybe the correct answer is (A)? ...\n</think>\n\nThe correct answer is (B)"


def test_lenient_reads_the_answer_after_the_last_think_block():
    assert extract_answer(ISSUE_EXAMPLE) == "B"
    assert extract_answer(ISSUE_EXAMPLE, "lenient") == "B"
    # Qwen3 / DeepSeek-R1: the closing tag without the opening one; several blocks: the last one counts
    assert extract_answer("Okay, so option (A) looks right.\n</think>\n\nAnswer: C", "lenient") == "C"
    assert extract_answer("<think>a</think> Answer: A <think>no</think>\nThe answer is (D)", "lenient") == "D"
    # nothing after the reasoning: the official rule on the whole text still counts
    assert extract_answer("<think>The correct answer is (B)</think>", "lenient") == "B"
    assert extract_answer("<think>Answer: B</think>", "lenient") is None


_FRAGMENTS = ["The correct answer is (A)", "The correct answer is B", "the correct answer is (C)", "Answer: D",
              "The correct answer is Done", "(B) because", "maybe (C)?", "</think>", "<think>", "**", "\n\n",
              "I think the answer is (A).", "C", "The Correct Answer Is: [D]", "my choice: (B)", "so..."]


def _responses(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_FRAGMENTS) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 6)))
            for _ in range(n)]


def test_lenient_never_does_worse_than_official_on_what_official_parses():
    checked = 0
    for text in _responses(3000, seed=19) + [ISSUE_EXAMPLE]:
        official, lenient = extract_answer(text), extract_answer(text, "lenient")
        if official is None:
            continue
        checked += 1
        assert lenient is not None, (text, official)
        s = text.replace("*", "")
        if "</think>" not in s:
            assert lenient == official, (text, official, lenient)  # no reasoning block: the same letter
        else:
            final = s[s.rfind("</think>") + len("</think>"):]
            if extract_answer(final) is not None:  # the final answer holds the official sentence: its letter
                assert lenient == extract_answer(final), (text, lenient)
    assert checked > 1000  # the generated responses exercise the rule


# ---------------------------------------------------------------- 4. event streams: UTF-8, leading BOM ignored


def _chunk(ids, text):
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None,
                                               "logprobs": {"tokens": [f"token_id:{i}" for i in ids]}}]},
                                 ensure_ascii=False)


def _usage(n):
    return "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})


STREAM = [_chunk([5], "Ré"), "", _chunk([6, 7], "sumé \u2028—"), "", _usage(3), "", "data: [DONE]", ""]


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_leading_bom_keeps_the_first_event(as_bytes):
    lines = ["\ufeff" + STREAM[0]] + STREAM[1:]
    if as_bytes:
        lines = [x.encode("utf-8") for x in lines]
    events = list(iter_token_events(lines, require_done=True))
    assert [e.token_id for e in events] == [5, 6, 7]
    assert "".join(e.text for e in events) == "Résumé \u2028—"


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_sse_lines_from_bytes_in_any_chunking(eol):
    body = BOM + eol.join(STREAM).encode("utf-8")
    for size in (1, 2, 3, 5, 64, len(body)):
        parts = [body[i:i + size] for i in range(0, len(body), size)]
        assert list(iter_sse_lines(parts)) == STREAM[:-1], size
        events = list(iter_token_events(iter_sse_lines(parts), require_done=True))
        assert [e.token_id for e in events] == [5, 6, 7], size


@pytest.mark.parametrize("charset", ["", "; charset=iso-8859-1", "; charset=utf-16"])
def test_http_streams_are_utf8_whatever_the_header_says(charset):
    from standins import serve

    def route(h, body):
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream" + charset)
        h.end_headers()
        h.wfile.write(BOM + "\n".join(STREAM).encode("utf-8"))

    with serve({("POST", "/v1/completions"): route}) as (url, _), \
            make_post_completion(url, "m", timeout=10, event_type=TokenEvent) as post:
        events = list(post([1], {"max_tokens": 3}))
    assert [e.token_id for e in events] == [5, 6, 7]
    assert "".join(e.text for e in events) == "Résumé \u2028—"


# ---------------------------------------------------------------- 5. every plot helper at drop ratio 1.0


@pytest.fixture
def agg():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def test_a_sweep_at_drop_ratio_one_plots(tiny, sample_ids, agg):
    from tdutils.engines.hf import HFEngine
    from tdutils.metrics import capacity_limit, speedup_notes
    from tdutils.sweep import SweepConfig, plot_speedup, throughput_sweep

    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, kv_budget_tokens=2 * (60 + 2))
    table, _ = throughput_sweep(eng, [sample_ids[0][:60]] * 3, [SweepConfig("random", 0.5), SweepConfig("random", 1.0)],
                                max_tokens=2, repeats=1, progress=None)
    assert capacity_limit(1.0) == float("inf") and capacity_limit(0.5) == 2.0 and capacity_limit(0) == 1.0
    assert table.loc["random@1", "capacity_limit"] == float("inf") and table.loc["random@1", "of_limit"] == 0.0
    ax = plot_speedup(table)
    lines = {line.get_label(): line for line in ax.get_lines()}
    bars = {c.get_label(): c for c in ax.containers}  # the policy's points are an errorbar (median, min-max)
    assert list(bars["random"].lines[0].get_xdata()) == [0.5, 1.0]
    assert list(lines["capacity limit 1/(1-r)"].get_xdata()) == [0.5]  # finite points only
    assert list(lines["capacity limit 1/(1-r)"].get_ydata()) == [2.0]
    assert list(lines["r = 1: no capacity limit"].get_xdata()) == [1.0, 1.0]
    assert all(n.startswith("random@") for n in speedup_notes(table))


def test_the_other_plot_helpers_take_drop_ratio_one(agg):
    import pandas as pd

    from tdutils.eval import plot_accuracy
    from tdutils.metrics import plot_decode_throughput, ratio_caveats

    phases = pd.DataFrame({"decode_tok_s": [100.0, 250.0], "decode_speedup": [1.0, 2.5]}, index=["baseline", "r1"])
    ax = plot_decode_throughput(phases)
    assert [t.get_text() for t in ax.texts] == ["1.00x", "2.50x"]
    acc = pd.DataFrame({"policy": ["full", "snapkv", "snapkv"], "drop_ratio": [0.0, 0.5, 1.0],
                        "context_tokens": [128] * 3, "n": [4] * 3, "accuracy": [1.0, 0.75, 0.0],
                        "ci_low": [0.5, 0.3, 0.0], "ci_high": [1.0, 0.95, 0.5]})
    fig = plot_accuracy(acc)
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "snapkv")
    assert list(line.get_xdata()) == [0.5, 1.0] and list(line.get_ydata()) == [75.0, 0.0]
    assert ratio_caveats(2, 8, 4.0, 1.0) == []  # limit inf: the 4x is explained


# ---------------------------------------------------------------- 6. a reused timed drop function


def test_a_reused_timed_drop_fn_reports_each_run_alone(tiny, sample_ids):
    from tdutils.engines.hf import HFEngine
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False)
    timed = tdutils.make_drop_fn("random", drop_ratio=0.5, model_config=model.config).timed()
    ids = [x[:64] for x in sample_ids[:2]]
    for _ in range(2):
        tdutils.run_once(eng, ids, name="r", drop_fn=timed, max_tokens=1)
        assert timed.split()["requests"] == 2 and len(timed.timings.score_s) == len(timed.timings.rerotate_s) == 2, timed.split()
    tdutils.compare(eng, ids, {"a": timed}, max_tokens=1)
    assert timed.split()["requests"] == 2


# ---------------------------------------------------------------- 7. RoPE: refuse only a real ambiguity


def _spec():
    from types import SimpleNamespace

    from tdutils.rope import RopeSpec

    return RopeSpec.from_config(SimpleNamespace(head_dim=8, rope_theta=1e4))  # neox, inv_freq [1, .1, .01, .001]


def test_one_token_one_position_by_hand():
    from tdutils.rope import apply_rope

    x = torch.zeros(1, 1, 8)
    x[..., 0] = 1.0  # pairs (i, i + 4): channel 0 rotates into channel 4 by angle 3 * inv_freq[0] = 3 rad
    got = apply_rope(x, torch.tensor([3]), _spec())
    want = torch.zeros(1, 1, 8)
    want[..., 0], want[..., 4] = torch.tensor(3.0).cos(), torch.tensor(3.0).sin()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("shape,positions", [((1, 1, 8), [3]), ((3, 3, 8), [7, 7, 7]), ((2, 1, 1, 8), [5])])
def test_ambiguous_shapes_whose_readings_agree_are_accepted(shape, positions):
    from tdutils.rope import apply_rope, rerotate_keys

    x = torch.randn(*shape)
    spec = _spec()
    got = apply_rope(x, torch.tensor(positions), spec)
    assert torch.equal(got, apply_rope(x, torch.tensor(positions), spec, token_dim=-2))
    assert torch.equal(got, apply_rope(x, torch.tensor(positions), spec, token_dim=-3))
    assert not torch.equal(got, x)  # position != 0 rotates
    back = rerotate_keys(got, torch.tensor(positions), torch.zeros(len(positions), dtype=torch.long), spec)
    assert torch.allclose(back, x, atol=1e-6)


def test_ambiguous_shapes_are_refused_only_when_readings_differ():
    from tdutils.rope import apply_rope, rerotate_keys

    spec = _spec()
    x = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="ambiguous.*rotate differently.*token_dim"):
        apply_rope(x, torch.tensor([0, 5]), spec)
    # every token moved from the same old to the same new position: one rotation, whichever axis
    moved = rerotate_keys(x, torch.tensor([5, 5]), torch.tensor([3, 3]), spec)
    assert torch.equal(moved, rerotate_keys(x, torch.tensor([5, 5]), torch.tensor([3, 3]), spec, token_dim=-3))
    assert torch.equal(moved, rerotate_keys(x, torch.tensor([5, 5]), torch.tensor([3, 3]), spec, token_dim=-2))
    with pytest.raises(ValueError, match="ambiguous"):
        rerotate_keys(x, torch.tensor([5, 6]), torch.tensor([3, 3]), spec)
