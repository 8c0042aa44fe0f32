import pytest
import torch


@pytest.fixture(scope="session")
def tiny():
    """The bundled tiny Qwen3 model (fp32, CPU, eager attention) and its tokenizer."""
    from tdutils.models import load_model

    torch.set_num_threads(2)
    return load_model("tiny-qwen3", device="cpu", attn_implementation="eager")


@pytest.fixture(scope="session")
def sample_ids(tiny):
    """Token ids of three bundled prompts cut to different lengths (a ragged batch)."""
    from tdutils.data import load_prompts

    _, tok = tiny
    rows = load_prompts("sample", num_requests=3)
    return [tok(r.prompt)["input_ids"][:n] for r, n in zip(rows, (180, 75, 301))]
