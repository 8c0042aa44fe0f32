"""Integration tests: execute each notebook headless with papermill and check what it recorded.

Executed copies go to `executed/` (git-ignored) so a failure can be inspected.
"""

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "executed"

# notebook -> (small parameters, text the executed notebook must show)
NOTEBOOKS = {
    "notebooks/get_query_tensor.ipynb": (
        {"num_requests": 2, "query_window": 16, "window": 8},
        ["max |Δ attention|", "kept 512 of 1024 tokens"],
    ),
    "notebooks/snapkv_token_dropping.ipynb": (
        {"num_requests": 6, "max_tokens": 8, "window": 32},
        ["decode_speedup", "snapkv@0.5:", "needle at"],
    ),
    "notebooks/rope_rerotation.ipynb": (
        {"n_tokens": 1024, "timing_cache_shape": [2, 2, 1024, 1024], "timing_repeats": 1},
        ["re-rotated vs fresh", "GB/s (read+write)"],
    ),
    "notebooks/compare_policies.ipynb": (
        {"n_eval": 8, "context_length": 512, "num_requests": 6, "max_tokens": 8, "repeats": 1,
         "rkv_methods": ["exact", "buffered"], "drop_ratios": [0.5]},
        ["full cache accuracy", "decode_speedup", "rkv/buffered"],
    ),
    "notebooks/random_token_dropping.ipynb": (
        {"num_requests": 6, "max_tokens": 8},
        ["decode_speedup", "decode throughput ratio"],
    ),
    "notebooks/rkv_token_dropping.ipynb": (
        {"num_requests": 4, "max_tokens": 8},
        ["decode throughput ratio (rkv-reference@0.5", "kept-set agreement with exact (reference): 1.000",
         "peak memory of the scoring step (reference)", "= scoring"],
    ),
    "notebooks/rkv_variants/rkv_variant_cpu_exact.ipynb": (
        {"num_requests": 4, "max_tokens": 8},
        ["decode throughput ratio (rkv-exact@0.5", "kept-set agreement with exact (exact): 1.000",
         "peak memory of the scoring step (exact)", "= scoring"],
    ),
    "notebooks/rkv_variants/rkv_variant_gpu_exact.ipynb": (
        {"num_requests": 4, "max_tokens": 8, "row_tile": 300, "col_block": 256},
        ["tiled redundancy device:", "decode throughput ratio (rkv-tiled@0.5",
         "kept-set agreement with exact (tiled): 1.000",
         "peak memory of the scoring step (tiled)", "= scoring"],
    ),
    # Colab notebooks: CPU fallback (bundled tiny model and data), install step skipped.
    "colab/snapkv_colab.ipynb": (
        {"install": False, "num_requests": 6, "max_tokens": 8},
        ["No GPU found", "snapkv@0.5: 6/6 correct", "decode_speedup", "hardware: CPU", "peak RSS",
         "lmcache section skipped (run_lmcache=False)"],
    ),
    "colab/rkv_colab.ipynb": (
        {"install": False, "num_requests": 6, "max_tokens": 8},
        ["No GPU found", "rkv-tiled@0.5: 6/6 correct", "decode_speedup", "hardware: CPU", "peak RSS",
         "lmcache section skipped (run_lmcache=False)"],
    ),
    "notebooks/rkv_variants/rkv_variant_buffered_cpu.ipynb": (
        {"num_requests": 4, "max_tokens": 8, "chunk_size": 256},
        ["decode throughput ratio (rkv-buffered@0.5", "kept-set agreement with exact (buffered)",
         "peak memory of the scoring step (buffered)", "= scoring"],
    ),
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

    params, must_show = NOTEBOOKS[path]
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
