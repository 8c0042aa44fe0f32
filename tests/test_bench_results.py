"""Published figures come from stored runs: the generated tables of the docs pages equal what
`tools/render_results.py` writes from `docs/results/*.json` (the bench scripts' own summaries among them), every
stored run is published, and those runs alternated their variants inside each repeat."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _render():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench(name):
    """`bench/NAME.py` as a module (the scripts import `bench/harness.py` as a sibling)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return mod


def _tables():
    """`tools/bench_tables.py`, the renderers of the benches' runs (what `--summary` prints)."""
    return _render().T


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def test_docs_pages_are_what_the_stored_runs_give():
    """Every generated block of every page equals what the script writes from the stored JSON; every block is
    shown on some page, and every stored run under docs/results/ feeds some block."""
    render = _render()
    shown = []
    for page in render.PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        assert text == render.render(text), (
            f"{page} is not what docs/results/*.json gives: `python tools/render_results.py --check` shows the "
            f"difference, `python tools/render_results.py` rewrites it")
        shown += render.blocks_in(text)
    assert sorted(shown) == sorted(render.BLOCKS), f"blocks shown on no page, or on two: {sorted(shown)}"
    read = {name for _, sources in render.BLOCKS.values() for name in sources}
    assert read == {p.stem for p in (DOCS / "results").glob("*.json")}, "a stored run no page publishes"


def test_render_refuses_broken_markers():
    render = _render()
    with pytest.raises(ValueError, match="unknown generated block"):
        render.render("<!-- generated: nosuch -->\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="no '<!-- end generated -->'"):
        render.render("<!-- generated: throughput -->\n| a table |\n")
    assert render.render("no blocks here\n") == "no blocks here\n"


@pytest.mark.parametrize("script, stored", [("accuracy", "accuracy.json"), ("accuracy", "ruler_policies.json"),
                                            ("accuracy", "ruler_policies_4096.json"),
                                            ("accuracy", "ruler_full.json"), ("rkv_bench", "rkv_bench.json"),
                                            ("rope_bench", "rope_bench.json")])
def test_results_page_shows_the_bench_summaries(script, stored):
    report = json.loads((DOCS / "results" / stored).read_text())
    expected = getattr(_tables(), script)(report)
    assert expected and _flat(expected) in _flat(_page("results.md")), (
        f"docs/results.md does not show the figures of docs/results/{stored}; `python bench/{script}.py --summary "
        f"docs/results/{stored}` prints them:\n{expected}")


def test_published_accuracy_is_on_the_held_out_seed():
    from tdutils.eval import DEV_SEED, HELDOUT_SEED, TRAIN_SEED_BASE

    for stored in ("accuracy.json", "ruler_policies.json", "ruler_policies_4096.json", "ruler_full.json"):
        meta = json.loads((DOCS / "results" / stored).read_text())["meta"]
        assert meta["seed"] == HELDOUT_SEED != DEV_SEED and HELDOUT_SEED < TRAIN_SEED_BASE, (stored, meta)
    assert f"held-out evaluation seed {HELDOUT_SEED}" in _flat(_page("results.md"))
    # bench/accuracy.py runs on the held-out seed unless told otherwise
    bench = _bench("accuracy")
    seen = []
    bench.run = lambda args: seen.append(args) or 0
    assert bench.main([]) == 0 and seen[0].seed == HELDOUT_SEED, seen


def test_training_script_refuses_to_report_on_the_held_out_seed(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("train_tiny_model", ROOT / "tools" / "train_tiny_model.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    from tdutils.eval import HELDOUT_SEED

    with pytest.raises(SystemExit) as exit_info:
        # were the seed accepted, these options would finish at once (no training step, one report prompt) with 0
        train.main(["--eval-seed", str(HELDOUT_SEED), "--max-minutes", "0", "--eval-n", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--eval-seed {HELDOUT_SEED} is the held-out seed" in err, err


def _alternates(orders, names):
    return orders[0] == list(names) and all(o == (list(names) if i % 2 == 0 else list(names)[::-1])
                                            for i, o in enumerate(orders))


def test_stored_bench_runs_alternated_their_variants():
    rope = json.loads((ROOT / "docs" / "results" / "rope_bench.json").read_text())
    assert len(rope["order"]) == rope["repeats"] >= 3 and _alternates(rope["order"], ["fp32", "bf16"]), rope["order"]
    rkv = json.loads((ROOT / "docs" / "results" / "rkv_bench.json").read_text())
    variants = rkv["config"]["variants"]
    for run in rkv["runs"]:
        assert len(run["order"]) == rkv["config"]["repeats"] == len(run["times_s"]) >= 3, run
        assert _alternates(run["order"], variants), run["order"]


def test_rope_bench_times_both_variants_in_every_repeat():
    rope = _bench("rope_bench")
    spec = rope.make_spec(64, 1e4)
    kv = rope.make_cache(1, 32, 128, "cpu")
    old, new = rope.make_positions(32, "cpu")
    times, orders = rope.time_variants(kv, old, new, spec, 3, "cpu")
    assert orders == [["fp32", "bf16"], ["bf16", "fp32"], ["fp32", "bf16"]]
    assert {k: len(v) for k, v in times.items()} == {"fp32": 3, "bf16": 3} and all(t > 0 for v in times.values() for t in v)


def test_rkv_bench_times_every_variant_in_every_round(tmp_path):
    rkv = _bench("rkv_bench")
    payload = {"time_child": ["realistic", "96"], "variants": ["reference", "exact", "snapkv"], "device": "cpu",
               "repeats": 2, "heads": 2, "head_dim": 16, "query_heads": 4, "seed": 0, "save_dir": str(tmp_path)}
    torch.manual_seed(0)
    out = rkv.run_time_child(payload)  # the options as harness.call hands them to the child
    assert out["order"] == [["reference", "exact", "snapkv"], ["snapkv", "exact", "reference"]]
    assert {k: len(v) for k, v in out["times_s"].items()} == {"reference": 2, "exact": 2, "snapkv": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["realistic_96_exact.pt"]  # kept for the agreement


def test_real_model_tables_are_the_stored_runs():
    """docs/real_models.md and the SmolLM2 column of docs/policies.md show what docs/results/ruler_smollm2_2048.json
    and docs/results/peer_kvpress.json hold."""
    import pandas as pd

    from tdutils.eval import task_markdown

    stored = json.loads((DOCS / "results" / "ruler_smollm2_2048.json").read_text())
    table = pd.DataFrame(stored["rows"])
    doc = _page("real_models.md")
    expected = task_markdown(table)
    assert _flat(expected) in _flat(doc), f"docs/real_models.md does not show the stored leaderboard:\n{expected}"
    assert stored["meta"]["seed"] == 5_000_000 and stored["meta"]["n"] == 20, stored["meta"]
    single = table[(table.task == "ruler_niah_single_1") & (table.drop_ratio == 0.5)]
    policies = _page("policies.md")
    for policy in single.policy.unique():
        aware, agnostic = (int(single[(single.policy == policy) & (single["mode"] == m)].correct.iloc[0])
                           for m in ("aware", "agnostic"))
        row = next(line for line in policies.splitlines() if line.startswith(f"| `{policy}` |") and "/200" in line)
        assert f"| {aware}/20 / {agnostic}/20 |" in row, (policy, aware, agnostic, row)
    peer = json.loads((DOCS / "results" / "peer_kvpress.json").read_text())
    for r in peer["rows"]:
        n = r["n"]
        cells = f"| {r['press']} | {r['policy']} | {round(r['kv_em'] * n)}/{n} | {round(r['td_em'] * n)}/{n} |"
        assert cells in doc, cells
