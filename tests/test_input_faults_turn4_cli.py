"""Issue 47 (turn 4 of the input-fault hunt), the command line, benches and model loading: each finding's test
(items 5, 7, 8, 9, 10 and the CLI / model parts of 11)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    return env


# ------------------------------------------------------------------------------------------ item 10: Ctrl-C
@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0, 3.5])
def test_ctrl_c_while_starting_ends_in_one_line_with_130(tmp_path, delay):
    """SIGINT at several instants of `python -m tdutils run`'s first seconds (imports): one line on stderr and
    exit status 130, never a traceback, an ImportError or a run that goes on."""
    out = tmp_path / "run.json"
    proc = subprocess.Popen([sys.executable, "-m", "tdutils", "run", "--num-requests", "2", "--repeats", "1",
                             "--max-tokens", "2", "--json", str(out), "--no-progress"], cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    # 130, or death by SIGINT (-2), which a shell reports as 130 too: seen once in 4 CI runs at 3.5 s, after the
    # one-line message, cause not found yet (a KeyboardInterrupt re-raised during interpreter shutdown?)
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, stderr[-2000:])
    assert len(lines) == 1 and "interrupted" in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr


# ------------------------------------------------------------------------------------------ a local real-shaped model
@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE trained here on RULER's essay (600 tokens, a BOS, a chat template): spells English as a
    real tokenizer does, without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = (ROOT / "tdutils" / "assets" / "ruler" / "alice_ch1-6.txt").read_text()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, special_tokens=["<bos>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    bos = tk.token_to_id("<bos>")
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return tok


@pytest.fixture(scope="module")
def local_model(tmp_path_factory, bpe_tokenizer):
    """A local model folder (not bundled, not random:): a 1-layer Qwen3 of 1024 positions with random weights and
    the BPE tokenizer, as `hf download` would leave one."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    folder = tmp_path_factory.mktemp("local-model")
    config = Qwen3Config(vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    return str(folder)


def _never(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran: the bad input was not refused up front")
    return fail


# ------------------------------------------------------------------------------------------ item 5: --context-length
def test_run_checks_context_length_before_building_prompts(local_model, tmp_path, monkeypatch, capsys):
    """`run --context-length` past the model's positions: one line naming both options and the longest length that
    fits, exit 2, before any RULER prompt is built (99,999,999 used to be killed for memory)."""
    from tdutils import ruler
    from tdutils.cli.main import main

    monkeypatch.setattr(ruler, "make_ruler_dataset", _never("make_ruler_dataset"))
    for length in ("99999999", "1000"):  # 1000 + 64 decode tokens > 1024 positions
        rc = main(["run", "--model", local_model, "--dataset", "ruler_niah_single_1", "--context-length", length,
                   "--json", str(tmp_path / "r.json"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err == (f"python -m tdutils run: error: --context-length {length} + --max-tokens 64 does "
                                   f"not fit in {local_model}'s 1024 positions (max_position_embeddings): the prompt "
                                   f"leaves no room for 64 decode tokens; give --context-length at most 960"), err


def test_eval_shares_the_context_check_before_the_model_loads(local_model, tmp_path, monkeypatch, capsys):
    from tdutils.cli import eval as cli
    from tdutils.cli.main import main

    monkeypatch.setattr(cli, "_open_engine", _never("the engine"))
    rc = main(["eval", "--model", local_model, "--tasks", "ruler_niah_single_1", "--context-lengths", "512,1024",
               "--json", str(tmp_path / "e.json"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err == (f"python -m tdutils eval: error: --context-lengths 1024 does not fit in {local_model}'s "
                               f"1024 positions (max_position_embeddings): the prompt leaves no room for any decode "
                               f"tokens; give --context-lengths at most 1023"), err


def test_check_context_lengths_passes_what_fits():
    from tdutils.models import check_context_lengths

    check_context_lengths([960], 1024, model="m", decode_tokens=64, decode_option="--max-tokens")  # exactly fits
    check_context_lengths([10**9], None, model="m")  # no max_position_embeddings: nothing to check
    with pytest.raises(ValueError, match="at most 960"):
        check_context_lengths([961], 1024, model="m", decode_tokens=64, decode_option="--max-tokens")


# ------------------------------------------------------------------------------------------ item 11: run options
def test_run_window_0_names_the_option(tmp_path, capsys):
    from tdutils.cli.main import main

    rc = main(["run", "--policy", "snapkv", "--window", "0", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == "python -m tdutils run: error: --window 0: window must be a positive integer, got 0", err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_run_json_to_a_full_device_is_refused_before_the_work(monkeypatch, capsys):
    import tdutils
    from tdutils.cli.main import main

    monkeypatch.setattr(tdutils, "open_engine", _never("the engine"))
    rc = main(["run", "--json", "/dev/full"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == ("python -m tdutils run: error: --json '/dev/full' cannot be written (No space left on "
                               "device); give a file path such as runs/run.json"), err


# ------------------------------------------------------------------------------------------ item 9, item 11: RULER
def test_ruler_prompts_for_a_random_model_are_refused():
    """random:ARCH's id tokenizer reads English as its unknown token: the prompts held no needle, silently."""
    from tdutils.eval.tasks import load_rows
    from tdutils.models import load_tokenizer

    with pytest.raises(ValueError, match=r"random:qwen3-0\.6b:1L has random weights and an id tokenizer"):
        load_rows("ruler_niah_single_1", model="random:qwen3-0.6b:1L", num_requests=1, context_tokens=256)
    with pytest.raises(ValueError, match="cannot spell RULER's English text"):  # its tokenizer alone
        load_rows("ruler_niah_single_1", tokenizer=load_tokenizer("random:qwen3-0.6b"), num_requests=1,
                  context_tokens=256)
    with pytest.raises(ValueError, match="reads only its own word-level vocabulary"):  # the bundled one, tokenizer given
        load_rows("ruler_niah_single_1", model="tiny-qwen3", tokenizer=load_tokenizer("tiny-qwen3"),
                  num_requests=1, context_tokens=256)


def test_ruler_minimum_length_does_not_depend_on_the_seed(bpe_tokenizer):
    """Near a task's minimum a length used to work or fail by the draw (cwe at 1200 tokens of this BPE failed for
    17 of 40 seeds); now every seed is refused below the floor with its number, and every seed builds at it."""
    from tdutils import ruler

    floor = ruler.min_context_tokens("cwe", bpe_tokenizer, chat_template="auto", context_tokens=1200)
    assert floor > 1200
    for seed in range(12):
        with pytest.raises(ValueError, match=f"needs at least {floor} tokens"):
            ruler.make_ruler_dataset("cwe", 1, 1200, tokenizer=bpe_tokenizer, seed=seed)
        ex, = ruler.make_ruler_dataset("cwe", 1, floor, tokenizer=bpe_tokenizer, seed=seed)
        assert len(ex["prompt_ids"]) == floor


# ------------------------------------------------------------------------------------------ item 7, item 11: the cache
def _tiny_gguf(path, arch="llama"):
    """A 1-layer Llama GGUF file (float32 tensors, no tokenizer) written with the `gguf` package; `arch` relabels
    its `general.architecture` afterwards, keeping the Llama tensors and keys."""
    np = pytest.importorskip("numpy")
    writer_mod = pytest.importorskip("gguf")
    w = writer_mod.GGUFWriter(str(path), "llama")
    h, ff, heads, kv, vocab = 16, 32, 2, 1, 64
    w.add_context_length(128)
    w.add_embedding_length(h)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(h // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, h), "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (h // heads, h),
              "blk.0.attn_v.weight": (h // heads, h), "blk.0.attn_output.weight": (h, h),
              "blk.0.ffn_gate.weight": (ff, h), "blk.0.ffn_up.weight": (ff, h), "blk.0.ffn_down.weight": (h, ff)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if arch != "llama":
        data = path.read_bytes()
        old = (5).to_bytes(8, "little") + b"llama"  # the value of general.architecture (a length-prefixed string)
        assert data.count(old) == 1
        path.write_bytes(data.replace(old, len(arch).to_bytes(8, "little") + arch.encode(), 1))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from tdutils import gguf

    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _converted(folder, tokenizer):
    """A converted model folder as `dequantized_folder` leaves it (weights, config, tokenizer, the record)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tdutils import gguf

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gguf._write_manifest(folder)
    return folder


def test_a_truncated_cached_safetensors_is_found_and_rebuilt(cache, bpe_tokenizer, capsys):
    from tdutils import gguf

    folder = _converted(cache / "models" / "smollm2-135m", bpe_tokenizer)
    assert gguf.packaged_folder("smollm2-135m") == folder  # whole: used as it is, no fetch
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert gguf.damage(folder) == "model.safetensors is truncated or not a safetensors file"
    assert not gguf._complete(folder)  # resolve converts it again (here: nothing to fetch it from)
    with pytest.raises(OSError, match="not installed and fetching is off"):
        gguf.packaged_folder("smollm2-135m", fetch=False)


def test_a_rewritten_cached_file_is_checked_by_its_checksum(cache, bpe_tokenizer):
    from tdutils import gguf

    folder = _converted(cache / "models" / "m", bpe_tokenizer)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # same size, header intact: only the sha256 (read because the mtime changed) tells
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert gguf.damage(folder) == "model.safetensors differs from what was saved (sha256)"


def test_damage_the_checks_cannot_see_fails_in_one_line_at_load(cache, bpe_tokenizer):
    """Same size and time as recorded (bytes flipped in place): safetensors' own error becomes one line naming the
    folder and what to do, not a traceback labelled a bug in tdutils."""
    from tdutils.cli.args import is_usage_error
    from tdutils.models import load_model

    folder = _converted(cache / "models" / "m", bpe_tokenizer)
    weights = folder / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8:8 + n] = b"{" + b" " * (n - 1)  # a header that is not JSON, same length
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(OSError) as info:
        load_model(str(folder), device="cpu", progress=False)
    msg = str(info.value)
    assert "\n" not in msg and f"the weights in {folder} cannot be read" in msg and "delete" in msg, msg
    assert is_usage_error(info.value)



def test_an_interrupted_conversions_temporary_folder_is_removed_by_the_next_run(cache, bpe_tokenizer):
    from tdutils import gguf

    _converted(cache / "models" / "smollm2-135m", bpe_tokenizer)
    dead = cache / "models" / ".smollm2-135m.pid999999999.abcd1234"  # no such process
    live = cache / "models" / f".smollm2-135m.pid{os.getpid()}.efgh5678"  # a conversion still running
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    gguf.packaged_folder("smollm2-135m")
    assert not dead.exists() and live.exists()


def test_a_gguf_cut_inside_its_tensor_data_says_truncated(cache, tmp_path):
    from tdutils import gguf

    whole = _tiny_gguf(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-1000])
    with pytest.raises(ValueError) as info:
        gguf.dequantized_folder(cut, progress=False)
    assert str(info.value) == (f"cut.gguf: truncated GGUF file ({cut.stat().st_size} bytes: its tensor data runs past "
                               f"the end of the file); download or copy it again")


def test_a_relabelled_gguf_is_refused_and_not_cached(cache, tmp_path):
    """A Llama GGUF whose architecture reads `mamba` loaded as a Mamba of random weights, and was cached."""
    from tdutils import gguf

    path = _tiny_gguf(tmp_path / "relabelled.gguf", arch="mamba")
    with pytest.raises(ValueError) as info:
        gguf.dequantized_folder(path, progress=False)
    msg = str(info.value)
    assert msg.startswith("relabelled.gguf: its tensors do not fit the architecture it declares ('mamba'): ") and \
        "weights are missing (e.g. backbone." in msg and "not loaded nor cached" in msg, msg
    assert not any((cache / "models").iterdir())


def test_an_uncreatable_cache_is_named_before_the_conversion(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from tdutils import gguf
    from tdutils.models import resolve_model

    (tmp_path / "file").write_text("")
    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _never("the conversion"))
    with pytest.raises(OSError) as info:
        resolve_model(str(_tiny_gguf(tmp_path / "m.gguf"))).files()
    msg = str(info.value)
    assert msg.startswith(f"TDUTILS_CACHE='{tmp_path / 'file' / 'cache'}': the model cache ") and \
        "set TDUTILS_CACHE to a writable folder or unset it" in msg, msg


# ------------------------------------------------------------------------------------------ item 8: the benches
def _bench_main(script):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bench_{script}", ROOT / "bench" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


DC = "bench/decode_compression.py"
CP = "bench/chunked_prefill.py"


@pytest.mark.parametrize("script,args,msg", [
    ("decode_compression", ["throughput", "--window", "64", "--budgets", "64"],
     f"{DC}: error: --budgets 64 --window 64 (rkv): budget 64 must exceed the window 64 the policy always keeps"),
    ("decode_compression", ["throughput", "--policy", "h2o"], (f"{DC} throughput: error: argument --policy: invalid "
     "choice: 'h2o' (choose from 'snapkv', 'rkv', 'random', 'streaming_llm', 'tova', 'knorm', 'keydiff') (see --help)")),
    ("decode_compression", ["fidelity", "--policies", "middle_chunk"], (f"{DC} fidelity: error: argument --policies: "
     "unknown policy 'middle_chunk'; give comma-separated names from snapkv, rkv, random, streaming_llm, tova, knorm, keydiff (see --help)")),
    ("decode_compression", ["throughput", "--full-requests", "0"], (f"{DC} throughput: error: argument "
     "--full-requests: expected a number >= 1 (the budget must hold one undropped request), got '0' (see --help)")),
    ("decode_compression", ["throughput", "--model", "tiny-qwen3", "--prompt-tokens", "100000", "--num-requests",
                            "2"], f"{DC}: error: the essay text (12821 words) cannot give 2 passages of 100000 tokens"),
    ("decode_compression", ["fidelity", "--budgets", "1"],
     f"{DC}: error: --budgets 1 --window 8 (rkv): budget must be an integer >= 2, got 1"),
    ("decode_compression", ["ruler", "--model", "tiny-qwen3"], (f"{DC}: error: --model: RULER's templates need a real "
     "model and tokenizer (e.g. smollm2-135m); 'tiny-qwen3' reads only its own word-level vocabulary")),
    ("decode_compression", ["throughput", "--model", "/no/such/model"], (f"{DC}: error: model folder '/no/such/model' "
     "does not exist; pass a folder with config.json, the weights and the tokenizer (e.g. made by `hf download "
     "Qwen/Qwen3-0.6B --local-dir DIR`), a hub id such as 'Qwen/Qwen3-0.6B', or 'tiny-qwen3'")),
    ("chunked_prefill", ["--lengths", "abc"],
     f"{CP}: error: argument --lengths: 'abc': give comma-separated token counts, e.g. 4096,8192 (see --help)"),
    ("chunked_prefill", ["--threads", "0"], (f"{CP}: error: argument --threads: expected an integer >= 1, got 0 "
     "(see --help)")),
    ("chunked_prefill", ["--budget", "1"], (f"{CP}: error: argument --budget: expected an integer >= 2, got 1 "
     "(see --help)")),
    ("chunked_prefill", ["--chunk", "0"], (f"{CP}: error: argument --chunk: expected a positive integer, got 0 "
     "(see --help)")),
    ("chunked_prefill", ["--policy", "middle_chunk"], (f"{CP}: error: argument --policy: invalid choice: "
     "'middle_chunk' (choose from 'snapkv', 'rkv', 'random', 'streaming_llm', 'tova', 'knorm', 'keydiff') (see --help)")),
    ("chunked_prefill", ["--model", "random:qwen3-0.6b:1L"], (f"{CP}: error: --model: RULER's templates need a real "
     "model and tokenizer (e.g. smollm2-135m); random:qwen3-0.6b:1L has random weights and an id tokenizer that "
     "cannot spell RULER's text")),
])
def test_bench_bad_options_fail_in_one_line(script, args, msg, capsys):
    with pytest.raises(SystemExit) as info:
        _bench_main(script)(args)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err == msg, err


def test_bench_lengths_past_the_models_positions_and_other_summaries(local_model, tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text('{"rows": [{"config": "full"}]}')
    cases = [("chunked_prefill", ["--model", local_model, "--lengths", "512,2000"],
              (f"{CP}: error: --lengths 2000 + --max-tokens 24 does not fit in {local_model}'s 1024 positions "
              "(max_position_embeddings): the prompt leaves no room for 24 decode tokens; give --lengths at most 1000")),
             ("chunked_prefill", ["--summary", str(other)], (f"{CP}: error: --summary '{other}' is not a run of {CP} "
              "(its rows have no mode); give a file it wrote with --json")),
             ("decode_compression", ["--summary", str(other)], (f"{DC}: error: --summary '{other}' is not a run of "
              f"{DC} (no part and meta and rows); give a file it wrote with --json"))]
    for script, args, msg in cases:
        with pytest.raises(SystemExit) as info:
            _bench_main(script)(args)
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and err == msg, err
