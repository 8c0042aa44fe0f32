"""bench/peer_kvpress.py's set-for-set pieces (issue 44): the overlap per layer and KV head, the drop function each
press maps to at each granularity and positions, tdutils' sets on kvpress' input, and the stored run's parameters
matching kvpress' defaults."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tdutils.engines.hf import HFEngine

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def peer():
    sys.path.insert(0, str(ROOT / "bench"))  # its sibling harness.py, as when it runs
    try:
        spec = importlib.util.spec_from_file_location("bench_peer_kvpress", ROOT / "bench" / "peer_kvpress.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return mod


def test_head_overlaps_counts_each_layer_and_head_and_skips_padding(peer):
    mask = torch.tensor([[[1, 1, 0, 0], [0, 1, 1, 0]],
                         [[1, 0, 0, 1], [1, 1, 1, 1]]], dtype=torch.bool)  # [L=2, H=2, T=4] kvpress' kept rows
    request = peer.head_overlaps(mask, torch.tensor([0, 1]))
    assert request.tolist() == [[1.0, 0.5], [0.5, 1.0]]
    layer = peer.head_overlaps(mask, torch.tensor([[0, 1], [2, 3]]))
    assert layer.tolist() == [[1.0, 0.5], [0.5, 1.0]]
    # head 1 of layer 0 keeps one token (-1: padding); counted as index 0 it would read kvpress' False there
    head = peer.head_overlaps(mask, torch.tensor([[[0, 1], [-1, 2]], [[0, 2], [1, 2]]]))
    assert head.tolist() == [[1.0, 1.0], [0.5, 1.0]]


def test_each_press_maps_to_its_granularity_and_positions(peer, tiny):
    model, _ = tiny
    from tdutils.models import model_facts

    engine = SimpleNamespace(facts=model_facts(model))
    kvpress_like = SimpleNamespace(granularity="head", positions="original")
    snap = peer._drop_fn(engine, "snapkv", kvpress_like, drop_ratio=0.5)
    assert (snap.granularity, snap.rerotate, snap.params["window"], snap.params["kernel_size"]) == ("head", False, 64, 5)
    assert peer._drop_fn(engine, "tova", kvpress_like, drop_ratio=0.5).granularity == "layer"  # TOVAPress' mean
    request = SimpleNamespace(granularity="request", positions="compact")
    knorm = peer._drop_fn(engine, "knorm", request, drop_ratio=0.5)
    assert (knorm.granularity, knorm.rerotate) == ("request", True)
    assert peer._drop_fn(engine, "adakv", request, drop_ratio=0.5).granularity == "head"  # moves budget: per head


def test_same_input_sets_select_on_the_prompt_without_its_last_token_at_kvpress_count(peer, tiny, sample_ids):
    model, tok = tiny
    engine = HFEngine(model, tokenizer=tok, progress=False, query_window=None, positions="original")
    prompts = [sample_ids[0], sample_ids[2]]  # 180, 301 tokens: n = 179 keeps int(89.5) = 89, round() 90
    args = SimpleNamespace(batch_size=2, ratios=[0.5], granularity="head", positions="original")
    sets = peer.same_input_sets(engine, prompts, ["snapkv", "knorm"], args)
    L, H = engine.facts.num_layers, engine.facts.num_kv_heads
    for key in ("snapkv", "knorm"):
        for ids, keep in zip(prompts, sets[(key, 0.5)]):
            n = len(ids) - 1
            assert tuple(keep.shape) == (L, H, int(n * (1 - 0.5)))  # kvpress' compute_n_kept, not round()
            assert int(keep.max()) == n - 1  # the last key of ids[:-1]; ids[-1] is never in the set
    # SnapKV's window: the last 64 keys of ids[:-1], in every layer and head
    window = torch.arange(len(prompts[0]) - 1 - 64, len(prompts[0]) - 1)
    assert all(bool(torch.isin(window, sets[("snapkv", 0.5)][0][layer, head]).all())
               for layer in range(L) for head in range(H))


def test_stored_run_uses_kvpress_defaults():
    """docs/results/peer_kvpress_head.json: every press parameter kvpress recorded with a tdutils counterpart has
    the value tdutils ran with (window_size -> window, the rest by name)."""
    meta = json.loads((ROOT / "docs" / "results" / "peer_kvpress_head.json").read_text())["meta"]
    rename = {"window_size": "window"}
    checked = 0
    for key, kv in meta["defaults"]["kvpress"].items():
        td = meta["defaults"]["tdutils"][key]
        for name, value in kv.items():
            name = rename.get(name.removeprefix("press."), name.removeprefix("press."))
            if name in td:
                assert td[name] == value, (key, name, td[name], value)
                checked += 1
    assert checked >= 10, meta["defaults"]
    assert meta["granularity"] == "head" and meta["positions"] == "original"
