"""`python -m tdutils doctor` against absent servers and stand-in vLLM / LMCache servers on 127.0.0.1."""

import importlib.util
import io
import sys
import time

from standins import chunk, closed_port_url, models_route, serve, usage_chunk

from tdutils.cli.main import build_parser
from tdutils.policies import get_policy, policy_names

MODEL = "Qwen/Qwen3-0.6B"
QUERY_FREE = ", ".join(policy_names("kv"))  # what doctor lists, in registration order
WITH_QUERIES = ", ".join(n for n in policy_names()
                         if n not in policy_names("kv") and not get_policy(n).per_head_only)
PER_HEAD_ONLY = ", ".join(n for n in policy_names() if get_policy(n).per_head_only)  # AdaKV, PyramidKV


def _doctor(*argv):
    args = build_parser().parse_args(["doctor", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def _routes(*, as_text=False, registered=True, queries=True, version="0.25.1", groups=None):
    """Stand-in routes of vLLM (OpenAI server) and the LMCache server's HTTP API on one port."""
    def completions(h, body):
        h.start_sse()
        h.write_line(chunk([11, 12], "ab", "length", as_text=as_text))
        h.write_line("")
        h.write_line(usage_chunk(len(body["prompt"]), 2))
        h.write_line("data: [DONE]")

    meta = {"7": {"model_name": MODEL, "world_size": 1, "kv_cache_layout": {"num_layers": 28, "kernel_groups": groups or []}}}
    qmeta = {"8": {"model_name": MODEL + "##query", "world_size": 1, "q_ring_layout": {}}}
    return {
        ("GET", "/healthcheck"): lambda h, b: h.send_json(200, {"status": "healthy"}),
        ("GET", "/config"): lambda h, b: h.send_json(200, {"mp": {"chunk_size": 256}}),
        ("GET", "/status"): lambda h, b: h.send_json(200, {"cache_context_meta": meta if registered else {},
                                                           "q_context_meta": qmeta if queries else {}}),
        ("GET", "/v1/models"): models_route(MODEL),
        ("GET", "/version"): lambda h, b: h.send_json(200, {"version": version}),
        ("POST", "/tokenize"): lambda h, b: h.send_json(200, {"count": 1, "tokens": [9707]}),
        ("POST", "/v1/completions"): completions,
    }


def _synthetic_vllm(tmp_path, patched: bool):
    from tdutils.serving import patches as tp

    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text("__version__ = '0.25.1'\n")
    for fp in tp.load_patch():
        p = tmp_path / fp.path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("\n".join(line for h in fp.hunks for line in (h.new if patched else h.old)) + "\n")
    return pkg


def test_absent_servers_say_how_to_start_them_quickly():
    down = closed_port_url()
    t0 = time.perf_counter()
    rc, out = _doctor("--vllm-url", down, "--lmcache-http-url", down, "--timeout", "2")
    assert rc == 1 and time.perf_counter() - t0 < 10
    assert "[FAIL] LMCache server" in out and "fix: start it with `lmcache server" in out
    assert "[FAIL] vLLM at" in out and "vllm serve MODEL" in out and "some checks failed" in out


def test_a_url_that_is_not_one_is_bad_input_in_one_line(capsys):
    from tdutils.cli.main import main

    assert main(["doctor", "--vllm-url", "notaurl"]) == 2
    assert capsys.readouterr().err == ("python -m tdutils doctor: error: --vllm-url 'notaurl' is not a URL: it needs "
                                       "http:// or https:// and a host, such as http://localhost:8000\n")
    assert main(["doctor", "--lmcache-http-url", "localhost:8080"]) == 2  # no scheme: "localhost" is read as one
    assert "--lmcache-http-url 'localhost:8080' is not a URL" in capsys.readouterr().err
    # run checks the addresses the serving engine takes before it opens (no server is asked, no model loaded)
    assert main(["run", "--engine", "lmcache", "--vllm-url", "notaurl"]) == 2
    assert capsys.readouterr().err == ("python -m tdutils run: error: --vllm-url 'notaurl' is not a URL: it needs "
                                       "http:// or https:// and a host, such as http://localhost:8000\n")


def test_a_working_setup_passes(tmp_path):
    pkg = _synthetic_vllm(tmp_path, patched=True)
    with serve(_routes()) as (url, log):
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--vllm-dir", str(pkg))
    assert rc == 0, out
    assert "chunk size 256" in out and f"serves '{MODEL}'" in out and "vLLM version 0.25.1" in out
    assert "is patched" in out and "KV layout of" in out and "query ring registered" in out
    assert "completions stream token ids ([11, 12])" in out and out.rstrip().endswith("all checks passed")
    ok_line = f"[  ok] query-free policies can run (no query patch, no transfer_query): {QUERY_FREE}"
    assert ok_line in out.splitlines(), out
    assert f"[  ok] policies that need query tensors can run: {WITH_QUERIES}" in out.splitlines(), out
    assert (f"[warn] per-KV-head policies need the hf engine (LMCache stores one token list per request): "
            f"{PER_HEAD_ONLY}") in out.splitlines(), out
    body = next(b for m, p, b in log if p == "/v1/completions")
    assert body["prompt"] == [9707] and body["return_tokens_as_token_ids"] is True


def test_problems_are_reported_with_their_fix(tmp_path):
    pkg = _synthetic_vllm(tmp_path, patched=False)
    with serve(_routes(as_text=True, registered=False, queries=False, version="0.26.0")) as (url, _):
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--vllm-dir", str(pkg))
    assert rc == 1
    assert "[warn] vLLM 0.26.0 is outside the range" in out
    assert "query-export patch unapplied" in out and "python -m tdutils patches apply" in out
    assert "no KV layout registered" in out and "LMCacheMPConnector" in out
    assert "no query ring registered" in out and "--enable transfer_query" in out
    assert "fix: start vLLM with --return-tokens-as-token-ids" in out


def test_unknown_model_and_no_queries_mode():
    with serve(_routes()) as (url, _):
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--model", "other")
        assert rc == 1 and "does not serve 'other'" in out
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--no-queries")
        assert rc == 0 and "patch state" not in out and "query ring" not in out
        assert "[  ok] query-free policies can run (no query patch, no transfer_query)" in out, out
        assert f"[warn] not checked (--no-queries): {WITH_QUERIES}, which need query tensors" in out, out


def test_doctor_says_which_policies_an_unpatched_setup_can_run(tmp_path):
    """A stock vLLM (patch not applied) with a working KV path: query-free policies run, the others do not."""
    pkg = _synthetic_vllm(tmp_path, patched=False)
    with serve(_routes(queries=False)) as (url, _):
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--vllm-dir", str(pkg))
    lines = out.splitlines()
    assert rc == 1, out  # the patch check fails ...
    # ... but these run
    assert f"[  ok] query-free policies can run (no query patch, no transfer_query): {QUERY_FREE}" in lines, out
    assert any(x.startswith(f"[warn] policies that need query tensors may not run: {WITH_QUERIES} (vLLM ")
               and "query-export patch unapplied" in x for x in lines), out


def test_fix_lines_name_doctors_own_options(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no vLLM in this environment
    down = closed_port_url()
    rc, out = _doctor("--vllm-url", down, "--lmcache-http-url", down, "--timeout", "2")
    assert rc == 1
    assert "lmcache_url=" not in out and "lmcache_http_url=" not in out and "vllm_url=" not in out
    assert "--python " not in out  # doctor's option is --vllm-python
    fixes = [line.strip() for line in out.splitlines() if line.strip().startswith("fix:")]
    assert fixes[0].startswith("fix: start it with `lmcache server ") and "--enable transfer_query`" in fixes[0]
    assert fixes[0].endswith(", or point doctor at it: --lmcache-http-url URL"), fixes[0]
    assert fixes[1].startswith("fix: start it with `vllm serve MODEL ") and "--return-tokens-as-token-ids" in fixes[1]
    assert fixes[1].endswith(", or point doctor at it: --vllm-url URL"), fixes[1]
    for fix in fixes[:2]:  # a fix that points at the documentation points at a section that exists
        _assert_doc_pointer_exists(fix)
    assert (f"[warn] patch state unknown: vLLM is not installed in this Python environment ({sys.executable}); "
            f"point at it with --vllm-python /path/to/vllm-venv/bin/python or --vllm-dir "
            f"/path/to/site-packages/vllm") in out


def _assert_doc_pointer_exists(text: str) -> None:
    """Every "(PAGE, section 'TITLE')" in `text` names a heading of README.md or of a page under docs/ (the
    section may have moved between them; the title must exist)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    headings = {re.sub(r"^#+\s*", "", line).strip()
                for page in [root / "README.md", *(root / "docs").glob("*.md")]
                for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")}
    for title in re.findall(r"section '([^']+)'", text):
        assert any(h == title or h.startswith(title + " (") for h in headings), (title, sorted(headings))


def _fused_group(shape, dtype="torch.float32"):
    return {"engine_kv_format": "NL_X_NB_NH_BS_CS", "attention_backend": "vLLM non-MLA blocks-first, fused K/V (HND)",
            "engine_kv_concrete_shape": shape, "tokens_per_block": 128, "dtype": dtype}


def test_vllm_cpu_fused_layout_unpatched_patched_and_bfloat16():
    """vLLM's CPU backend (fused K/V): a stock lmcache 0.5.6 publishes no concrete shape (its SDK cannot
    connect: FAIL, fixed by tdutils' LMCache patch); once published, float32 is readable (the lmcache engine
    re-shapes the blocks), bfloat16 is flagged (its CPU packing was not measured)."""
    cases = (("Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)", "torch.float32", 1),
             ("28 x [8192, 8, 128, 256]", "torch.float32", 0), ("28 x [8192, 8, 128, 256]", "torch.bfloat16", 0))
    for shape, dtype, rc_expected in cases:
        with serve(_routes(version="0.32.0", groups=[_fused_group(shape, dtype)])) as (url, _):
            rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--no-queries")
        lines = out.splitlines()
        assert rc == rc_expected, out
        assert ("[  ok] vLLM version 0.32.0 (query-export patch that fits it: vllm-0.32-export-intermediate-tensors.diff)"
                in lines), out
        if shape.startswith("Unknown"):
            assert (f"[FAIL] LMCache cannot describe the KV layout vLLM registered for '{MODEL}': engine KV format "
                    f"NL_X_NB_NH_BS_CS (vLLM non-MLA blocks-first, fused K/V (HND)), concrete shape '{shape}'; "
                    f"LMCache's SDK cannot connect to it, so the lmcache engine cannot edit this cache") in lines, out
            assert ("       fix: lmcache 0.5.6 needs tdutils' patch for the fused K/V layout of vLLM's CPU backend: "
                    "python -m tdutils patches apply --target lmcache --python PY-OF-THE-SERVERS-ENVIRONMENT, then "
                    "restart LMCache and vLLM") in lines, out
            continue
        line = (f"LMCache describes the fused K/V layout vLLM registered for '{MODEL}': NL_X_NB_NH_BS_CS, {shape}, "
                f"{dtype}; the lmcache engine re-shapes its blocks (K transposed then V per block and head, as vLLM's "
                f"CPU backend writes them)")
        if dtype == "torch.float32":
            assert f"[  ok] {line}" in lines, out
        else:
            assert (f"[warn] {line}; measured in float32 only, vLLM-CPU packs torch.bfloat16 blocks differently"
                    in lines), out
            assert "       fix: serve with --dtype float32 on the CPU" in lines, out
