"""Integration tests: execute each notebook headless with papermill and check the figures it recorded
(`tdutils.claims`) against what its text claims.

Executed copies go to `executed/` (git-ignored) so a failure can be inspected.
"""

import json
import math
from pathlib import Path

import nbformat
import pytest

from tdutils.claims import read as read_claims
from tdutils.selection import keep_count

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "executed"

# Each notebook ends with `tdutils.claims.record(...)`: the figures its text relies on. The checks below hold
# the bounds of what the text claims and assert the recorded figures against them; `must_show` keeps only lines
# that no figure carries (which path a notebook took).


def _one_prompt(claims) -> float:
    """Margin of "within a prompt of": one prompt of the run's requests."""
    return 1 / claims["requests"] + 1e-9


def check_snapkv(c):
    acc = c["accuracy"]
    # SnapKV keeps the needle: at most one prompt below the full cache; random loses it most of the time.
    assert acc["snapkv@0.5"] >= acc["baseline"] - _one_prompt(c)
    assert acc["random@0.5"] <= acc["snapkv@0.5"] - 0.5
    assert c["needle_tokens"] >= 8 and c["needle_tokens_kept"] == c["needle_tokens"]  # `pass key = d d d d d`: all kept


def check_random(c):
    acc, peak, n = c["accuracy"], c["peak_batch"], c["requests"]
    # "the budget holds about four requests at a time"; half-size caches fit twice as many (4.25-request budget)
    assert peak["baseline"] == min(n, 4)
    assert peak["random@0.5"] == peak["every-other"] == min(n, 8)
    assert acc["baseline"] >= 1 - _one_prompt(c)
    assert acc["random@0.5"] <= acc["baseline"] - 0.5  # "loses part of the needle most of the time"


def check_query(c):
    # recomputed attention equals the model's to fp32 rounding (a mixed-up capture differs by 0.1-1)
    assert 0 <= c["max_attention_diff"] <= 1e-5  # measured 6e-7: margin 15x
    assert c["kept_tokens"] == keep_count(c["prompt_tokens"], 0.5)


def check_rope(c):
    fp32, bf16 = "fp32 arithmetic, one cast", "bf16 arithmetic"
    ratio, mean = c["roundtrip_max_err_over_pair_norm"], c["roundtrip_mean_abs_err"]
    # two bf16 stores alone: |error| <= (1 + sqrt 2) 2^-8 of the pair norm (the notebook derives it)
    assert c["store_bound_over_pair_norm"] == pytest.approx((1 + math.sqrt(2)) / 256, rel=1e-12)
    assert ratio[fp32] <= c["store_bound_over_pair_norm"]
    assert ratio[bf16] > c["store_bound_over_pair_norm"]       # bf16 arithmetic breaks it
    assert mean[bf16] >= 3 * mean[fp32]                        # "several times larger"
    # re-rotated keys give the fresh logits to fp32 rounding (unit vectors: logits in [-1, 1]); a uniform
    # shift keeps the original logits (~1e-5 from fp32 angles at positions in the thousands); stale keys do not
    assert c["rerotated_vs_fresh_max"] <= 1e-6        # measured 6e-8
    assert c["shift_vs_original_max"] <= 1e-4         # measured 2.5e-5
    assert c["not_rerotated_vs_fresh_min"] >= 0.1


# compare_policies on tiny-qwen3-ruler, ranking on niah_multikey by default (four needles, one asked; full-cache exact
# match 99.0% at 1k tokens on the held-out seed): the full cache answers nearly all; at drop 0.75 in aware mode
# SnapKV stays >= 40 points above random (docs/results.md, n = 200: 98.0 vs 0.0%).
COMPARE_FULL_FLOOR = 0.9
COMPARE_SNAPKV_MARGIN = 0.4


def check_compare(c):
    acc, ranking, r = c["accuracy"], c["ranking"], c["rank_ratio"]
    pooled = c["n"] * len(c["tasks"])  # examples behind each ranked figure
    # the full cache reads the same token sequence in both modes, so it answers alike (task_eval's contract)
    assert acc["aware/full@0"] == acc["agnostic/full@0"]
    assert acc["aware/full@0"] >= COMPARE_FULL_FLOOR
    # "in aware mode the query-aware policies keep what the question needs": SnapKV far above random
    assert acc[f"aware/snapkv@{r:g}"] >= acc[f"aware/random@{r:g}"] + COMPARE_SNAPKV_MARGIN
    for mode, rows in ranking.items():
        assert [x["accuracy"] for x in rows] == sorted((x["accuracy"] for x in rows), reverse=True), mode
        for x in rows:
            name = f"{mode}/{x['policy']}@{0 if x['policy'] == 'full' else r:g}"
            assert x["accuracy"] == pytest.approx(acc[name]), name  # pooled over tasks = mean over tasks (same n)
            assert x["ci_low"] - 1e-12 <= x["accuracy"] <= x["ci_high"] + 1e-12, x
            assert x["ci_high"] - x["ci_low"] <= 2 / math.sqrt(pooled), x  # a 95% Wilson interval of `pooled` answers
        # the count the notebook prints is the number of pairs whose intervals do not overlap
        assert c["separated_pairs"][mode] == sum(a["ci_low"] > b["ci_high"] for a in rows for b in rows), mode
    # the "done when": the ranking's intervals do not all overlap
    assert c["separated_pairs"]["aware"] >= 1, c["separated_pairs"]
    peak, req = c["peak_batch"], c["requests"]
    assert peak["baseline"] == min(req, 4)
    # drop ratios >= 0.5 keep at most half of each cache: twice the requests fit the 4.25-request budget
    assert all(b >= min(req, 8) for name, b in peak.items() if name != "baseline"), peak


def check_colab(dropped):
    def check(c):
        acc = c["accuracy"]
        assert c["hardware"].startswith("CPU"), c["hardware"]  # the CPU fallback ran
        assert acc["baseline"] >= 1 - _one_prompt(c)
        assert acc[dropped] >= acc["baseline"] - _one_prompt(c)
    return check


# Kept-set agreement with `exact` on request 0: 1.0 for the exact methods; the buffered floor is the one its
# notebook states ("What buffering changes": 95.7-98.4% over the 16 bundled prompts at chunk_size 256; request 0
# gives 96.9%).
AGREEMENT_FLOOR = {"reference": 1.0, "exact": 1.0, "tiled": 1.0, "buffered": 0.95}


def check_rkv(method):
    def check(c):
        assert c["method"] == method
        assert c["agreement_with_exact"] >= AGREEMENT_FLOOR[method]
        acc = c["accuracy"]
        assert acc[f"rkv-{method}@0.5"] >= acc["baseline"] - _one_prompt(c)
    return check


def check_decode_time(c):
    s, cache = c["settings"], c["cache"]
    B, N, steps, n = s["budget"], s["buffer"], s["max_tokens"], s["requests"]
    assert len(set(s["prompt_tokens"])) == 1, s["prompt_tokens"]  # prompts cut to one length: the same cuts for all
    T = s["prompt_tokens"][0]

    def cut_steps(budget):  # a cache of T entries at step 1 grows by one a step; cut at B + N, then every N steps
        return list(range(max(1, budget + N - T + 1), steps, N))  # (the last step cuts nothing)

    # the full cache's line: T entries at step 1 (T - 1 cached and the refed token), one more every step
    assert (cache["full_first"], cache["full_last"]) == (T, T + steps - 1)
    # the sawtooth: a step attends B + N entries and cuts back to B; the next ones attend B + 1 .. B + N
    assert cache["cut_steps"] == cut_steps(B) and cut_steps(B), cache
    assert set(cache["cut_after"]) == {B}
    assert (cache["min_after_cut"], cache["max_after_cut"]) == (B + 1, B + N)
    assert cache["kv_peak_cache_tokens"] == max(T, B + N) and cache["compressions"] == n * len(cut_steps(B))
    for name, f in c["fidelity"].items():
        cuts = cut_steps(f["budget"])
        assert (f["first_cut"], f["cuts"]) == (cuts[0], n * len(cuts)), name
        # the tokens up to the first cut are the full cache's, so they agree; then the caches differ
        assert cuts[0] <= f["agreement_min"] <= f["agreement_mean"] <= steps and 0 <= f["identical"] <= 1, name
        assert 0 <= f["kl_mean"] <= f["kl_max"], name
        # before the first cut the KL is 0: the mean over every step is the after-cut mean diluted by those steps
        assert f["kl_mean"] * steps == pytest.approx(f["kl_mean_after_cut"] * (steps - cuts[0]), rel=1e-6, abs=1e-12)
    # greedy agreement read from the teacher-forced run equals the free-running decode's
    assert c["free_agreement"] == c["forced_agreement"] and len(c["free_agreement"]) == n
    t = c["throughput"]
    budget, full, comp = t["kv_budget_tokens"], t["full"], t["compressed"]
    # "a full-cache request reserves its whole final length; a compressed one at most B + N + 1 (or its prompt)"
    assert full["peak_batch"] == min(n, budget // (T + steps))
    assert comp["peak_batch"] == min(n, budget // (max(T, B + N) + 1)) > full["peak_batch"]
    assert max(full["kv_peak_reserved_tokens"], comp["kv_peak_reserved_tokens"]) <= budget
    assert comp["compressions"] == cache["compressions"] and full["compressions"] == 0
    assert min(full["decode_tok_s"], comp["decode_tok_s"]) > 0
    p = c["prefill"]
    # one shot: a cache of the whole prompt; chunked under the budget: never more than budget + chunk
    assert p["one_shot_peak"] == p["prompt_tokens"]
    assert p["chunked_peak"] == [min(x, p["budget"] + p["chunk"]) for x in p["prompt_tokens"]]
    assert p["chunked_lens"] == [min(x, p["budget"]) for x in p["prompt_tokens"]]


# notebook -> (small parameters, check of the recorded claims, text the executed notebook must show)
NOTEBOOKS = {
    "notebooks/get_query_tensor.ipynb": ({"num_requests": 2, "query_window": 16, "window": 8}, check_query, []),
    "notebooks/snapkv_token_dropping.ipynb": ({"num_requests": 6, "max_tokens": 8, "window": 32}, check_snapkv, []),
    "notebooks/rope_rerotation.ipynb": (
        {"n_tokens": 1024, "timing_cache_shape": [2, 2, 1024, 1024], "timing_repeats": 1}, check_rope, []),
    "notebooks/compare_policies.ipynb": (
        {"tasks": ["niah_multikey"], "n": 30, "policies": ["full", "random", "snapkv"],
         "drop_ratios": [0.75], "rank_ratio": 0.75, "num_requests": 6, "max_tokens": 8, "repeats": 1},
        check_compare, []),
    "notebooks/decode_time_compression.ipynb": (
        {"num_requests": 6, "prompt_tokens": 48, "max_tokens": 64, "budget": 24, "buffer": 16, "window": 4,
         "policies": ["rkv", "knorm"], "budgets": [16, 24], "repeats": 1, "prefill_requests": 2,
         "prefill_budget": 64, "prefill_chunk": 64}, check_decode_time, []),
    "notebooks/random_token_dropping.ipynb": ({"num_requests": 6, "max_tokens": 8}, check_random, []),
    "notebooks/rkv_token_dropping.ipynb": ({"num_requests": 4, "max_tokens": 8}, check_rkv("reference"), []),
    "notebooks/rkv_variants/rkv_variant_cpu_exact.ipynb": ({"num_requests": 4, "max_tokens": 8}, check_rkv("exact"), []),
    "notebooks/rkv_variants/rkv_variant_gpu_exact.ipynb": (
        {"num_requests": 4, "max_tokens": 8, "row_tile": 300, "col_block": 256}, check_rkv("tiled"),
        ["tiled redundancy device: cpu"]),
    "notebooks/rkv_variants/rkv_variant_buffered_cpu.ipynb": (
        {"num_requests": 4, "max_tokens": 8, "chunk_size": 256}, check_rkv("buffered"), []),
    # Colab notebooks: CPU fallback (bundled tiny model and data), install step skipped.
    "colab/snapkv_colab.ipynb": (
        {"install": False, "num_requests": 6, "max_tokens": 8}, check_colab("snapkv@0.5"),
        ["No GPU found", "lmcache section skipped (run_lmcache=False)"]),
    "colab/rkv_colab.ipynb": (
        {"install": False, "num_requests": 6, "max_tokens": 8}, check_colab("rkv-tiled@0.5"),
        ["No GPU found", "lmcache section skipped (run_lmcache=False)"]),
}


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            data = out.get("data", {})
            parts.append(data.get("text/plain", "") if isinstance(data.get("text/plain", ""), str)
                         else "".join(data["text/plain"]))
    return "\n".join(parts)


@pytest.mark.notebook
@pytest.mark.parametrize("path", sorted(NOTEBOOKS))
def test_notebook_executes(path):
    import papermill as pm

    params, check, must_show = NOTEBOOKS[path]
    OUT.mkdir(exist_ok=True)
    out_path = OUT / Path(path).name
    try:
        pm.execute_notebook(str(ROOT / path), str(out_path), parameters=params, kernel_name="python3",
                            cwd=str(ROOT / Path(path).parent), progress_bar=False)
    except pm.PapermillExecutionError as exc:
        pytest.fail(f"{path} failed in cell {exc.exec_count}: {exc.ename}: {exc.evalue} (see {out_path})")
    nb = nbformat.read(out_path, as_version=4)
    # Whatever papermill's exit status says, no cell may have produced an error.
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path}: error outputs {[(e['ename'], e['evalue']) for e in errors]}"
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), "a code cell did not run"
    text = _outputs_text(nb)
    for needle in must_show:
        assert needle in text, f"{path}: executed notebook does not show {needle!r}"
    claims = read_claims(nb)
    assert claims, f"{path}: recorded no claims (its last cell calls tdutils.claims.record)"
    try:
        check(claims)
    except (AssertionError, KeyError) as exc:
        pytest.fail(f"{path}: a recorded figure contradicts the notebook's text ({type(exc).__name__}: {exc}); "
                    f"recorded: {json.dumps(claims, sort_keys=True)} (see {out_path})")


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for d in ("notebooks", "colab")
                                        for p in (ROOT / d).glob("**/*.ipynb") if ".ipynb_checkpoints" not in p.parts))
def test_notebook_is_committed_clean(path):
    """Committed notebooks carry no outputs and start with a cell tagged `parameters`."""
    nb = nbformat.read(ROOT / path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and "parameters" in code[0].metadata.get("tags", []), f"{path}: first code cell is not tagged 'parameters'"
    assert not any(c.outputs or c.execution_count for c in code), f"{path}: committed with outputs"
    # papermill reads the parameters cell to list and type the parameters (`papermill --help-notebook`); a
    # line it cannot parse (e.g. an `=` inside a comment) is silently left out, so every assignment must parse.
    from papermill.translators import PythonTranslator

    assigned = {line.split("=", 1)[0].strip() for line in code[0].source.splitlines()
                if "=" in line.split("#", 1)[0] and not line.startswith((" ", "#"))}
    parsed = {p.name for p in PythonTranslator.inspect(code[0])}
    assert assigned <= parsed, f"{path}: papermill cannot parse the parameters {sorted(assigned - parsed)}"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS))
def test_notebook_records_its_claims(path):
    """Every executed notebook's last code cell records the figures its checks read (`tdutils.claims.record`)."""
    nb = nbformat.read(ROOT / path, as_version=4)
    last = [c for c in nb.cells if c.cell_type == "code"][-1].source
    assert "from tdutils.claims import record" in last and "record(" in last, f"{path}: last code cell is\n{last}"


@pytest.mark.parametrize("name", ["snapkv_colab", "rkv_colab"])
def test_colab_notebook_points_at_the_repository(name):
    """The badge and the install cell use the one repository URL of pyproject.toml ([project.urls] Repository)."""
    import re

    url = re.search(r'^Repository = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    nb = nbformat.read(ROOT / "colab" / f"{name}.ipynb", as_version=4)
    owner_repo = url.removeprefix("https://github.com/")
    assert f"colab.research.google.com/github/{owner_repo}/blob/main/colab/{name}.ipynb" in nb.cells[0].source
    assert f'repo_url = "{url}"' in nb.cells[1].source
    install = nb.cells[2].source
    assert 'find_spec("tdutils")' in install, "the install cell must skip an importable tdutils"
    assert "torch==" in install, "the install cell must hold Colab's torch with a constraint"
