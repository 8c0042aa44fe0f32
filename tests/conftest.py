import signal

import pytest
import torch


def pytest_configure(config):
    # A test run started as a background job (nohup, `cmd &` in a script) inherits SIGINT ignored, and so would
    # every `python -m tdutils` the Ctrl-C tests start: they would run to the end. Give this process Python's usual
    # handler, so its children start with SIGINT's default disposition, as under a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny():
    """The bundled tiny Qwen3 model (fp32, CPU, eager attention) and its tokenizer."""
    from tdutils.models import load_model

    torch.set_num_threads(2)
    return load_model("tiny-qwen3", device="cpu", attn_implementation="eager")


@pytest.fixture(scope="module")
def one_thread(tiny):
    """One torch thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`), set after the
    session's `tiny` (which sets two) and restored afterwards: a tiny model on a shared 2-core machine runs one
    thread up to ~40x faster than two that spin-wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def sample_ids(tiny):
    """Token ids of three bundled prompts cut to different lengths (a ragged batch)."""
    from tdutils.data import load_prompts

    _, tok = tiny
    rows = load_prompts("sample", num_requests=3)
    return [tok(r.prompt)["input_ids"][:n] for r, n in zip(rows, (180, 75, 301))]


@pytest.fixture(scope="module")
def request0(tiny, sample_ids):
    """(hf engine, tensors, tokens) of one prefilled request of `tiny`, every prompt query captured."""
    from tdutils.engines.hf import HFEngine

    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=None)
    eng.prefill([sample_ids[1]])
    return eng, eng.tensors(0), eng.tokens(0)


def pytest_collection_modifyitems(config, items):
    """Run the `servers` tier (real vLLM + LMCache, tests/test_servers.py) after every other test, so the unit
    tests report first and a slow server build never delays them; skip it when TDUTILS_SKIP_SERVERS=1 (same
    as `-m "not servers"`)."""
    import os

    tier = [item for item in items if item.get_closest_marker("servers")]
    if not tier:
        return
    items[:] = [item for item in items if not item.get_closest_marker("servers")] + tier
    if os.environ.get("TDUTILS_SKIP_SERVERS", "") not in ("", "0"):
        skip = pytest.mark.skip(reason="TDUTILS_SKIP_SERVERS is set: the real-server tier is skipped")
        for item in tier:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Print the server tier's measured figures (venv build, start-up, memory) when it ran."""
    import sys

    tier = sys.modules.get("servertier")
    if tier is not None and tier.FIGURES:
        terminalreporter.section("server test tier")
        for name, value in tier.FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")
