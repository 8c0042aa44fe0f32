"""`tools/train_ruler_model.py`: the pointer loss's attention rows and the command line's refusals."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("train_ruler_model", ROOT / "tools" / "train_ruler_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pointer_rows_equal_the_models_eager_attention(tool):
    """`PointerRows.hit` (SDPA forward + rows recomputed) == `output_attentions` of eager attention."""
    from transformers import Qwen3ForCausalLM

    from tdutils.models import ASSETS

    model = Qwen3ForCausalLM.from_pretrained(ASSETS / "tiny-qwen3-ruler", attn_implementation="eager").eval()
    rows = tool.PointerRows(model.model.layers[-1].self_attn)
    ids = torch.randint(5, 200, (3, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, output_attentions=True).attentions[-1]  # [B, H, T, T]
        # every query head (both KV heads of the GQA group 2), first/middle/last positions, self and far sources
        b = torch.tensor([0, 1, 2, 2, 1, 0])
        head = torch.tensor([0, 1, 2, 3, 3, 2])
        qpos = torch.tensor([119, 60, 0, 119, 5, 100])
        src = torch.tensor([3, 60, 0, 118, 0, 99])
        got = rows.hit(b, head, qpos, src)
    want = ref[b, head, qpos, src]
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), (got, want)
    assert float(got[2]) == pytest.approx(1.0)  # position 0 attends only to itself
    rows.handle.remove()


def test_inserted_layers_keep_the_models_function(tool):
    """`insert_layers`: two identity-initialised layers before the last leave the logits as they were, the last
    layer's weights move to the new last index, and the new layers can learn (their output projections are the
    only zero weights)."""
    from transformers import Qwen3ForCausalLM

    from tdutils.models import ASSETS

    model = Qwen3ForCausalLM.from_pretrained(ASSETS / "tiny-qwen3-ruler").eval()
    grown = tool.insert_layers(model, 2).eval()
    n = model.config.num_hidden_layers
    assert grown.config.num_hidden_layers == n + 2 and len(grown.config.layer_types) == n + 2
    assert [layer.self_attn.layer_idx for layer in grown.model.layers] == list(range(n + 2))
    assert torch.equal(grown.model.layers[-1].self_attn.q_proj.weight, model.model.layers[-1].self_attn.q_proj.weight)
    assert torch.equal(grown.model.layers[n - 2].mlp.up_proj.weight, model.model.layers[n - 2].mlp.up_proj.weight)
    new = grown.model.layers[n - 1]
    assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
    assert new.self_attn.q_proj.weight.abs().sum() > 0
    ids = torch.randint(5, 200, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(grown(input_ids=ids).logits, model(input_ids=ids).logits)


def test_probe_is_saved_beside_the_model_folder(tool, tmp_path):
    assert tool.probe_path(tmp_path / "run") == tmp_path / "run.probe.pt"


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --out"),
    (["--out", str(ROOT / "tdutils" / "assets" / "tiny-qwen3-ruler")], "inside the package's assets"),
    (["--init-from", "/nonexistent", "--out", "{tmp}/r"], "is not a model folder (no config.json)"),
    (["--eval-n", "0", "--out", "{tmp}/r"], "--eval-n must be >= 1"),
    (["--max-minutes", "0", "--out", "{tmp}/r"], "--max-minutes must be > 0"),
    (["--lengths", "300", "--out", "{tmp}/r"], "--lengths must be taken from"),
    (["--insert-layers", "2", "--out", "{tmp}/r"], "--insert-layers needs --init-from (the trained model to grow)"),
    (["--insert-layers", "-1", "--out", "{tmp}/r"], "--insert-layers must be a count >= 0, got -1"),
    (["--threads", "0", "--out", "{tmp}/r"], "--threads must be between 1 and the"),
    (["--threads", "100000", "--out", "{tmp}/r"], "CPU core(s) this process may use, got 100000"),
    (["--lr", "-1", "--out", "{tmp}/r"], "--lr must be a finite number > 0, got -1.0"),
    (["--rope-theta", "0", "--out", "{tmp}/r"], "--rope-theta must be > 1 and finite (the RoPE base frequency"),
    (["--rope-theta", "inf", "--out", "{tmp}/r"], "--rope-theta must be > 1 and finite"),
    (["--lr", "inf", "--out", "{tmp}/r"], "--lr must be a finite number > 0, got inf"),
    (["--drop-aug", "2", "--out", "{tmp}/r"], "--drop-aug must be a fraction of steps in [0, 1], got 2.0"),
    (["--recall", "-1", "--out", "{tmp}/r"], "--recall must be a fraction of steps in [0, 1], got -1.0"),
    (["--eval-length", "8192", "--out", "{tmp}/r"], "--eval-length must be one of the trained lengths"),
    (["--pointer-head", "3", "--scratch", "--out", "{tmp}/r"], "--pointer-head 3 must be 0..2 in this 4-head model"),
    (["--pointer-layer", "7", "--scratch", "--out", "{tmp}/r"], "--pointer-layer 7 is not a layer of this 4-layer model"),
])
def test_bad_arguments_exit_with_one_clear_line(tool, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        tool.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err  # one line, no usage block
    assert not list(tmp_path.iterdir())  # nothing written


def test_out_that_is_a_file_fails_before_training(tool, tmp_path, capsys):
    """The save at the end would fail on it (mkdir) after the whole budget: refuse it at the start."""
    out = tmp_path / "model.json"
    out.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        tool.main(["--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--out {out} is a file; give a folder" in err, err
    assert out.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["model.json"]


def test_bundled_model_rotates_with_the_theta_run_9_trained_at():
    """Run 9 raised the RoPE base to 100000 (`--rope-theta`): the model's own rotary module and tdutils' re-rotation
    (`RopeSpec.from_config`) must both use it, or every edited cache would be re-rotated at the wrong frequencies."""
    from transformers import Qwen3ForCausalLM

    from tdutils.models import ASSETS
    from tdutils.rope import RopeSpec

    model = Qwen3ForCausalLM.from_pretrained(ASSETS / "tiny-qwen3-ruler")
    expected = 100000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)  # head_dim 32
    assert torch.allclose(model.model.rotary_emb.inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert torch.allclose(RopeSpec.from_config(model.config).inv_freq.double(), expected, rtol=1e-6, atol=0)
