"""bench/peer_openvino.py's pure helpers: arguments, budget matching, the prefill/decode split, the report table.

No network, no OpenVINO (it lives in its own venv, never in this one), no model: each test takes milliseconds.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pov():
    spec = importlib.util.spec_from_file_location("peer_openvino", ROOT / "bench" / "peer_openvino.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "openvino" not in sys.modules  # importing the bench must not need OpenVINO here
    return mod


# ------------------------------------------------------------------------------------------------ arguments
def test_defaults(pov):
    _, a = pov.parse_args([])
    assert (a.model, a.task, a.context_length, a.n, a.drop_ratio, a.batch_size) == (
        "smollm2-135m", "niah_single_1", 2048, 16, 0.5, 4)
    assert (a.start_size, a.recent_size, a.aggregation, a.rotation) == (32, 64, "norm_sum", "both")
    assert a.max_tokens is None and not a.smoke and a.out == pov.DEFAULT_OUT and a.dtype == "float32"
    assert pov.parse_args(["--dtype", "bfloat16"])[1].dtype == "bfloat16"


def test_compiled_properties_are_read_from_what_openvino_prints(pov, capfd):
    """The LLM's block of OPENVINO_LOG_LEVEL=3's print (the tokenizers' blocks come first), written to fd 1 as C++
    does, comes back as a dict; nothing reaches the real stdout."""
    import os

    printed = ("Model: OV Tokenizer\n  KV_CACHE_PRECISION: u8\nEXECUTION_DEVICES:\n CPU: X\n"
               "Model: LLM with Paged Attention\n  INFERENCE_PRECISION_HINT: bf16\n  KV_CACHE_PRECISION: bf16\n"
               "  MODEL_DISTRIBUTION_POLICY: \nEXECUTION_DEVICES:\n CPU: X\n")
    out, props = pov._compiled_properties(lambda x: os.write(1, printed.encode()) and x, 7)
    assert out == 7 and props == {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16",
                                  "MODEL_DISTRIBUTION_POLICY": ""}
    assert pov._compiled_properties(lambda: 1) == (1, {})
    assert capfd.readouterr().out == ""


def test_smoke_overrides_sizes(pov):
    _, a = pov.parse_args(["--smoke", "--n", "50", "--context-length", "4096"])
    assert (a.n, a.context_length, a.max_tokens, a.batch_size) == (2, 512, 8, 2)


@pytest.mark.parametrize("args,msg", [
    (["--drop-ratio", "0"], "argument --drop-ratio: expected a drop ratio in (0, 1), got '0'"),
    (["--drop-ratio", "nan"], "argument --drop-ratio: expected a drop ratio in (0, 1), got 'nan'"),
    (["--drop-ratio", "x"], "argument --drop-ratio: expected a drop ratio in (0, 1), got 'x'"),
    (["--start-size", "16"], "argument --start-size: expected a positive multiple of the KV block size 32, got '16'"),
    (["--recent-size", "0"], "argument --recent-size: expected a positive multiple of the KV block size 32, got '0'"),
    (["--aggregation", "max"], "argument --aggregation: invalid choice: 'max'"),
    (["--rotation", "yes"], "argument --rotation: invalid choice: 'yes'"),
    (["--n", "0"], "argument --n: expected a positive integer, got 0"),
])
def test_bad_arguments_one_line(pov, capsys, args, msg):
    with pytest.raises(SystemExit) as exc:
        pov.parse_args(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err


def test_smoke_skips_without_venv(pov, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TDUTILS_OPENVINO_VENV", str(tmp_path / "absent"))
    assert pov.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "skipped: no OpenVINO venv at" in out and str(tmp_path / "absent") in out
    assert not (tmp_path / "absent").exists()  # --smoke never builds it


def test_venv_marker_must_match_packages(pov, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert pov.venv_info(tmp_path) is None  # no marker
    (tmp_path / pov.MARKER).write_text('{"packages": ["torch==2.13.0", "openvino==2025.0.0"]}')
    assert pov.venv_info(tmp_path) is None  # other pins: rebuild
    import json
    (tmp_path / pov.MARKER).write_text(json.dumps({"packages": list(pov.PACKAGES)}))
    assert pov.venv_info(tmp_path) == {"packages": list(pov.PACKAGES)}


# ------------------------------------------------------------------------------------------------ budget
@pytest.mark.parametrize("keep,expected", [
    (1024, 1024),   # 2048 tokens at drop 0.5: already a block multiple
    (1000, 992),    # 31.25 blocks -> 31
    (1008, 1024),   # 31.5 blocks: halves round up
    (1009, 1024),
    (256, 256),     # the smoke run: 512 tokens at 0.5
    (100, 128),     # below start + recent + one block (32 + 64 + 32)
    (1, 128),
])
def test_match_max_cache_size(pov, keep, expected):
    assert pov.match_max_cache_size(keep, 32, 32, 64) == expected


def test_match_max_cache_size_other_block(pov):
    assert pov.match_max_cache_size(1000, 16, 16, 64) == 1008  # 62.5 blocks of 16 -> 63
    assert pov.match_max_cache_size(10, 16, 16, 16) == 48


@pytest.mark.parametrize("args", [(0, 32, 32, 64), (100, 32, 16, 64), (100, 32, 32, 0), (100, 0, 32, 64)])
def test_match_max_cache_size_refuses(pov, args):
    with pytest.raises(ValueError):
        pov.match_max_cache_size(*args)


def test_ov_configs(pov):
    _, a = pov.parse_args(["--rotation", "both", "--aggregation", "sum"])
    confs = pov.ov_configs(a, 1024)
    assert [c["name"] for c in confs] == ["full", "evict sum rot=off", "evict sum rot=on"]
    assert confs[0]["eviction"] is None
    ev = confs[1]["eviction"]
    assert ev == {"start_size": 32, "recent_size": 64, "max_cache_size": 1024, "aggregation": "sum",
                  "apply_rotation": False, "snapkv_window_size": 64}
    assert confs[2]["eviction"]["apply_rotation"] is True
    _, a = pov.parse_args(["--rotation", "off"])
    assert [c["name"] for c in pov.ov_configs(a, 1000)] == ["full", "evict norm_sum rot=off"]
    assert pov.ov_configs(a, 1000)[1]["eviction"]["max_cache_size"] == 992


# ------------------------------------------------------------------------------------------------ timing split
def test_phase_split(pov):
    steps = [{"seconds": 2.0, "new": [1, 0]},   # request 0 prefilled (first token)
             {"seconds": 3.0, "new": [1, 1]},   # request 1's first token: prefill ends here
             {"seconds": 0.5, "new": [1, 1]},
             {"seconds": 0.25, "new": [1, 0]}]
    ph = pov.phase_split(steps, 2)
    assert ph["prefill_s"] == 5.0 and ph["decode_s"] == 0.75
    assert ph["decode_tokens"] == 3 and ph["decode_steps"] == 2
    assert ph["first_token_s"] == [2.0, 5.0]


def test_phase_split_all_first_tokens_in_one_step(pov):
    ph = pov.phase_split([{"seconds": 4.0, "new": [1, 1, 1]}] + [{"seconds": 0.1, "new": [1, 1, 1]}] * 3, 3)
    assert ph["prefill_s"] == 4.0 and ph["decode_tokens"] == 9 and ph["decode_s"] == pytest.approx(0.3)


def test_cut_at_eos(pov):
    assert pov.cut_at_eos([5, 6, 2, 7], [2]) == [5, 6]
    assert pov.cut_at_eos([5, 6, 7], {2, 0}) == [5, 6, 7]
    assert pov.cut_at_eos([0, 5], {2, 0}) == []


# ------------------------------------------------------------------------------------------------ report
def _rows():
    return [
        {"engine": "tdutils", "config": "full", "n": 4, "kept": 2048, "tok_s": 20.0, "prefill_s": 30.0,
         "em": 1.0, "partial": 1.0, "same": None},
        {"engine": "tdutils", "config": "snapkv r=0.5", "n": 4, "kept": 1024, "tok_s": 25.0, "prefill_s": 30.0,
         "em": 0.75, "partial": 0.75, "same": 3},
        {"engine": "openvino", "config": "full", "n": 4, "kept": 2056, "tok_s": 34.0, "prefill_s": 22.2,
         "em": 1.0, "partial": 1.0, "same": 4},
        {"engine": "openvino", "config": "evict norm_sum rot=off", "n": 4, "kept": 1056, "tok_s": 38.25,
         "prefill_s": 18.4, "em": 1.0, "partial": 1.0, "same": 4},
        {"engine": "openvino", "config": "evict norm_sum rot=on", "error": "RuntimeError: boom"},
    ]


def test_add_ratios(pov):
    rows = pov.add_ratios(_rows())
    assert [r["ratio"] for r in rows] == [1.0, 1.25, 1.0, 1.125, None]


def test_add_ratios_without_baseline(pov):
    rows = pov.add_ratios([r for r in _rows() if not (r["engine"] == "openvino" and r["config"] == "full")])
    assert rows[2]["ratio"] is None and rows[1]["ratio"] == 1.25


def test_format_table(pov):
    table = pov.H.render("peer_openvino", pov.add_ratios(_rows())).splitlines()
    assert table[0].split() == ["engine", "config", "kept", "decode", "tok/s", "after", "1st", "tok/s", "ratio",
                                "prefill", "s", "EM", "part", "same"]
    # a stored run without the engine's after-first-token figure leaves it blank; OpenVINO's rows count only those
    assert table[2].split() == ["tdutils", "snapkv", "r=0.5", "1024", "25.0", "1.25", "30.0", "0.75", "0.75", "3/4"]
    assert table[4].split() == ["openvino", "evict", "norm_sum", "rot=off", "1056", "38.2", "38.2", "1.12", "18.4",
                                "1.00", "1.00", "4/4"]
    with_steady = [dict(r, steady_tok_s=26.5) if r["engine"] == "tdutils" else r for r in _rows()]
    line = pov.H.render("peer_openvino", pov.add_ratios(with_steady)).splitlines()[2].split()
    assert line[4:6] == ["25.0", "26.5"], line
    assert table[1].split()[-1] == "1.00"  # no "same" column for a baseline of its own
    assert table[5].split()[:4] == ["openvino", "evict", "norm_sum", "rot=on"] and "FAILED: RuntimeError: boom" in table[5]
    # columns line up: every value starts where its header does
    col = table[0].index("ratio")
    assert table[2][col:col + 4] == "1.25" and table[3][col:col + 4] == "1.00"
