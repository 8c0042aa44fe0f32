"""A KV budget in bytes (`HFEngine(kv_budget_bytes=...)`, `run --kv-budget-gb`): bytes per token, the conversion
to tokens, admission equal to the equivalent token budget, and the errors."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from families import family_model

from tdutils.engines.hf import HFEngine
from tdutils.models import load_tokenizer, model_facts

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(tiny, **kw):
    model, tok = tiny
    return HFEngine(model, tokenizer=tok, progress=False, **kw)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tdutils", *args], check=False, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))


def test_bytes_per_token_by_hand_and_bf16_fits_twice_the_tokens(tiny):
    f32 = model_facts(tiny[0].config, torch.float32)
    bf16 = dataclasses.replace(f32, kv_dtype=torch.bfloat16)
    # tiny-qwen3: 2 layers, 2 KV heads, head_dim 32; K and V
    assert f32.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4 == 1024
    assert bf16.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2 == 512
    eng32 = _engine(tiny, kv_budget_bytes=100_000)
    assert (eng32.kv_budget_tokens, eng32.kv_budget_bytes, eng32.kv_budget_in_bytes) == (97, 100_000, True)
    eng16 = HFEngine("tiny-qwen3", dtype="bfloat16", progress=False, kv_budget_bytes=100_000)
    assert eng16.facts.kv_bytes_per_token == 512 and eng16.kv_budget_tokens == 195  # 100000 // 512
    eng16.kv_budget_bytes = 10 * 1024
    assert eng16.kv_budget_tokens == 2 * 10 == 2 * (10 * 1024 // eng32.facts.kv_bytes_per_token)


def test_sliding_window_family_is_charged_every_layer_as_its_slot_store_holds():
    """Gemma 3 (sliding and global layers): every layer keeps every token, so a token costs
    2 x 3 layers x 2 KV heads x head_dim 16 x 4 bytes, and the decode storage is exactly that per column."""
    eng = HFEngine(family_model("gemma3"), tokenizer=load_tokenizer("tiny-qwen3"), progress=False,
                   kv_budget_bytes=200 * 768 + 767)
    assert eng.facts.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4 == 768
    assert eng.kv_budget_tokens == 200 and eng.kv_budget_bytes == 200 * 768 + 767
    eng.prefill([list(range(5, 45)), list(range(7, 67))])  # 40 and 60 tokens: past the window of 16
    eng.decode(max_tokens=8)
    d = eng.metrics.decode
    assert d.kv_storage_tokens > 0 and d.kv_storage_bytes == d.kv_storage_tokens * 768


def test_a_budget_in_bytes_admits_and_preempts_exactly_as_its_token_budget(tiny, sample_ids):
    """The preempting setting of test_input_faults_engine: 3 requests that start together under a budget that
    cannot hold all their tokens; the budget given in bytes (rounded down to the same tokens) runs the same
    schedule and the same logits, bit for bit."""
    budget = sum(len(x) + 300 for x in sample_ids) - 40
    runs = []
    for kw in ({"kv_budget_tokens": budget}, {"kv_budget_bytes": budget * 1024 + 1023}):
        eng = _engine(tiny, **kw)
        assert eng.kv_budget_tokens == budget and eng.kv_budget_bytes == kw.get("kv_budget_bytes", budget * 1024)
        eng.eos_token_ids = frozenset()
        eng.prefill(sample_ids)
        outs = eng.decode(max_tokens=300, ignore_eos=False, keep_logits=True)
        d = eng.metrics.decode
        runs.append((outs, (d.peak_batch_size, d.preemptions, d.kv_peak_reserved_tokens, d.kv_budget_tokens)))
    (a, da), (b, db) = runs
    assert da == db and da[1] >= 1 and da[0] == 3
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert all(torch.equal(torch.stack(x.logits), torch.stack(y.logits)) for x, y in zip(a, b))


def test_budget_errors_and_which_unit_applies(tiny):
    with pytest.raises(ValueError, match=r"^give kv_budget_tokens or kv_budget_bytes, not both \(got 100 tokens and "
                                         r"4096 bytes\)$"):
        _engine(tiny, kv_budget_tokens=100, kv_budget_bytes=4096)
    eng = _engine(tiny, kv_budget_tokens=100)
    assert (eng.kv_budget_bytes, eng.kv_budget_in_bytes) == (100 * 1024, False)
    with pytest.raises(ValueError, match=r"^kv_budget_bytes 1000 holds no KV token of this model \(1024 bytes per "
                                         r"token at float32\); give at least 1024$"):
        eng.kv_budget_bytes = 1000
    assert eng.kv_budget_tokens == 100  # a refused setting changes nothing
    with pytest.raises(ValueError, match="kv_budget_bytes must be an integer >= 1"):
        eng.kv_budget_bytes = 0
    with pytest.raises(TypeError, match="kv_budget_bytes must be an integer"):
        eng.kv_budget_bytes = 2.5e6
    eng.kv_budget_bytes = 5000
    assert (eng.kv_budget_tokens, eng.kv_budget_in_bytes) == (4, True)
    eng.kv_budget_tokens = 7  # setting the other replaces it
    assert (eng.kv_budget_bytes, eng.kv_budget_in_bytes) == (7 * 1024, False)
    eng.kv_budget_bytes = None
    assert eng.kv_budget_tokens is None and eng.kv_budget_bytes is None


@pytest.mark.parametrize("args,msg", [
    (["--kv-budget-gb", "0.5", "--kv-budget-tokens", "5000"],
     "argument --kv-budget-tokens: not allowed with argument --kv-budget-gb"),
    (["--kv-budget-gb", "0"], "argument --kv-budget-gb: expected a finite number > 0, got '0'"),
    (["--kv-budget-gb", "-1"], "argument --kv-budget-gb: expected a finite number > 0, got '-1'"),
    (["--kv-budget-gb", "0.0001", "--num-requests", "2"],
     ("--kv-budget-gb 0.0001 (= 104 tokens at float32, 1,024 B per token) cannot hold one undropped request of the "
      "baseline (1,088 tokens = longest prompt + --max-tokens); give at least --kv-budget-gb 0.001038 (GiB)")),
    (["--kv-budget-gb", "0.01", "--engine", "lmcache"],
     "--kv-budget-gb: the lmcache engine takes its KV budget in tokens only"),
])
def test_cli_budget_errors_are_one_line_with_status_2(args, msg):
    p = _cli("run", *args, "--no-progress")
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and msg in lines[0], p.stderr


def test_cli_budget_in_gib_is_noted_and_recorded(tmp_path):
    out = tmp_path / "run.json"
    p = _cli("run", "--policy", "random", "--kv-budget-gb", "0.004", "--num-requests", "4", "--max-tokens", "2",
             "--repeats", "1", "--json", str(out), "--no-progress")
    assert p.returncode == 0, p.stderr
    nbytes = round(0.004 * 2 ** 30)  # 4294967 bytes = 4194 tokens of 1024 B (tiny-qwen3, fp32)
    note = f"KV budget 0.004 GiB (--kv-budget-gb) = {nbytes // 1024:,} tokens at float32 (1,024 B per token)"
    assert note in p.stdout.splitlines()
    report = json.loads(out.read_text())
    assert report["kv_budget"] == {"applies": "--kv-budget-gb", "tokens": nbytes // 1024, "bytes": nbytes,
                                   "gib": nbytes / 2 ** 30, "bytes_per_token": 1024, "dtype": "float32", "note": note}
    assert {r["kv_budget_tokens"] for r in report["table"]} == {nbytes // 1024}
