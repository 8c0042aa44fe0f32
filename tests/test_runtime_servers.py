"""Runtime choice of the Colab notebooks (tdutils.runtime) and background server control (tdutils.serving.servers)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from tdutils import runtime
from tdutils.serving import servers


def test_plan_falls_back_to_the_bundled_model_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = runtime.plan_runtime(max_tokens=256)
    assert (plan.device, plan.model, plan.dtype, plan.dataset) == ("cpu", "tiny-qwen3", "float32", "sample")
    assert plan.fallback and plan.max_tokens == runtime.CPU_MAX_TOKENS == 64
    assert "No GPU found" in plan.describe()


def test_plan_keeps_an_explicit_model_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = runtime.plan_runtime("Qwen/Qwen3-0.6B", max_tokens=256)
    assert (plan.model, plan.dataset, plan.max_tokens, plan.fallback) == (
        "Qwen/Qwen3-0.6B", runtime.GPU_DATASET, 256, False)
    assert "No GPU found" not in plan.describe()


class _T4:
    name, total_memory = "Tesla T4", 15 * 2**30


def test_plan_on_a_t4_uses_float16_and_the_demo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # compute capability 7.5
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _T4())
    plan = runtime.plan_runtime()
    assert (plan.device, plan.model, plan.dtype, plan.dataset, plan.max_tokens, plan.fallback) == (
        "cuda", "Qwen/Qwen3-1.7B", "float16", "raniayu/token-dropping-demo-short", 256, False)
    assert plan.hardware == "Tesla T4 (15.0 GiB)"


def test_plan_rejects_bad_settings(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees no GPU"):
        runtime.plan_runtime(device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        runtime.plan_runtime(device="tpu")
    for bad in (0, 2.7, "abc", None, True):
        with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
            runtime.plan_runtime(max_tokens=bad)
    with pytest.raises(ValueError, match=r"dtype must be 'auto' or one of \('float32', 'float16', 'bfloat16'\), got 'garbage'"):
        runtime.plan_runtime(dtype="garbage")
    with pytest.raises(ValueError, match="model must be a non-empty string"):
        runtime.plan_runtime(model=None)


def test_fallback_with_another_dataset_says_what_the_tiny_model_reads(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = runtime.plan_runtime(dataset="mc-sample").describe()
    assert "falls back to the bundled tiny model with dataset 'mc-sample' (the tiny model reads only its passkey" in text


def test_runtime_report_lists_every_phase(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    table = pd.DataFrame([{"run": "baseline", "prefill_s": 1.5, "modify_s": 0.0, "decode_s": 2.0,
                           "decode_tok_s": 128.0, "peak_batch": 4, "end_to_end_s": 3.5}]).set_index("run")
    text = runtime.runtime_report(table)
    assert "baseline: prefill    1.50 s | modify   0.00 s | decode    2.00 s (   128.0 tok/s, peak batch 4)" in text
    assert "end to end    3.50 s" in text and "peak RSS" in text
    assert capsys.readouterr().out.strip() == text


def test_lmcache_server_command_is_spec_section_6():
    assert servers.lmcache_server_command(port=7000, http_port=7001, l1_size_gb=0.5, shm_name="t1") == [
        "lmcache", "server", "--l1-size-gb", "0.5", "--eviction-policy", "LRU", "--chunk-size", "256",
        "--port", "7000", "--http-port", "7001", "--shm-name", "t1", "--no-l1-use-lazy",
        "--supported-transfer-mode", "auto", "--enable", "transfer_query"]
    assert "--enable" not in servers.lmcache_server_command(transfer_query=False)


def test_vllm_server_command_t4_settings_and_connector():
    cmd = servers.vllm_server_command("Qwen/Qwen3-1.7B", port=8001, lmcache_port=7000, python="py", dtype="half",
                                      max_model_len=4096, gpu_memory_utilization=0.6, attention_backend="TRITON_ATTN")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-1.7B"]
    for flag, value in [("--port", "8001"), ("--dtype", "half"), ("--max-model-len", "4096"),
                        ("--gpu-memory-utilization", "0.6"), ("--attention-backend", "TRITON_ATTN")]:
        assert cmd[cmd.index(flag) + 1] == value
    for flag in ("--return-tokens-as-token-ids", "--enforce-eager", "--no-enable-prefix-caching"):
        assert flag in cmd
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "lmcache.mp.port": 7000, "lmcache.mp.transfer_intermediate_tensors": True, "lmcache.mp.q.ring_depth": 2}}
    cpu = servers.vllm_server_command("m", lmcache_port=7000, transfer_intermediate_tensors=False, lmcache_driven=True)
    extra = json.loads(cpu[cpu.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"lmcache.mp.port": 7000, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
    assert "--kv-transfer-config" not in servers.vllm_server_command("m", lmcache_port=None)


# A stand-in server: answers 200 on /health after `delay` seconds and forks a child that sleeps, so stopping
# must take down the whole process group.
_SERVER = textwrap.dedent("""
    import http.server, os, subprocess, sys, time
    time.sleep(float(sys.argv[2]))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_start_wait_and_stop_a_process_group(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    port = servers.free_port()
    srv = servers.start_server("stand-in", [sys.executable, str(script), str(port), "0.3"],
                               health_url=f"http://127.0.0.1:{port}/health", log_path=tmp_path / "logs" / "s.log")
    try:
        took = servers.wait_healthy([srv], timeout_s=30, poll_s=0.1)
        assert took >= 0.3
        child = int(srv.log_tail().split()[-1])
        assert _alive(child)
    finally:
        servers.stop_servers([srv], timeout_s=5)
    assert not srv.alive()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the server's child outlived stop_servers"
    servers.stop_servers([srv])  # a second stop is harmless


def test_a_server_that_exits_reports_its_log_tail(tmp_path):
    srv = servers.start_server("broken", [sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"],
                               health_url="http://127.0.0.1:9/health", log_path=tmp_path / "b.log")
    with pytest.raises(servers.ServerStartError) as err:
        servers.wait_healthy([srv], timeout_s=30, poll_s=0.05)
    assert "broken (pid" in str(err.value) and "exited with code 3" in str(err.value)
    assert "bad flag --foo" in str(err.value)


def test_a_server_that_never_answers_times_out(tmp_path):
    srv = servers.start_server("silent", [sys.executable, "-c", "import time; time.sleep(60)"],
                               health_url=f"http://127.0.0.1:{servers.free_port()}/health", log_path=tmp_path / "s.log")
    try:
        with pytest.raises(servers.ServerStartError, match=r"silent \(pid \d+\) not healthy at .* after 0.5 s"):
            servers.wait_healthy([srv], timeout_s=0.5, poll_s=0.05)
    finally:
        servers.stop_servers([srv], timeout_s=1)
    assert srv.process.returncode == -signal.SIGTERM


def test_missing_executable_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot start lmcache: '/nonexistent/lmcache' not found"):
        servers.start_server("lmcache", ["/nonexistent/lmcache", "server"], health_url="http://x",
                             log_path=tmp_path / "l.log")


_SHM_HOLDER = textwrap.dedent("""
    import mmap, sys, time
    from pathlib import Path
    d, ready = Path(sys.argv[1]), Path(sys.argv[2])
    held = open(d / "psm_ours", "wb")                      # held open (/proc/PID/fd)
    with open(d / "sem.mp-ours", "wb") as f:               # mapped, fd closed (/proc/PID/maps)
        f.write(b"x" * 4096)
    with open(d / "sem.mp-ours", "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 4096)
    shared = open(d / "psm_shared", "ab")                  # also held by the foreign process below
    ready.write_text("ok")
    time.sleep(120)
""")


def _wait_for(path, timeout=60):
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def test_stopping_removes_only_the_shm_files_the_servers_made(tmp_path):
    """Files held by a stopped server's processes (open or mapped) and LMCache's segments named after its
    --shm-name are removed; another program's files of the same kinds are not, nor a file that a live
    process outside the server still holds, nor files that existed before."""
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("psm_old", "sem.mp-old", "lmcache_l1_pool_other"):
        (shm / name).write_bytes(b"x")
    (shm / "psm_shared").write_bytes(b"")
    # A foreign program (not started by tdutils) holding two files of the same kinds, alive throughout.
    foreign_ready = tmp_path / "foreign.ready"
    foreign = subprocess.Popen([sys.executable, "-c", ("import sys, time\nfrom pathlib import Path\n"
                                "a = open(sys.argv[1] + '/psm_foreign', 'wb'); b = open(sys.argv[1] + '/psm_shared', 'ab')\n"
                                "Path(sys.argv[2]).write_text('ok'); time.sleep(120)"), str(shm), str(foreign_ready)])
    try:
        _wait_for(foreign_ready)
        ready = tmp_path / "server.ready"
        srv = servers.start_server("s", [sys.executable, "-c", _SHM_HOLDER, str(shm), str(ready), "--shm-name", "t1"],
                                   health_url="http://127.0.0.1:1/health", log_path=tmp_path / "s.log")
        (shm / "lmcache_l1_pool_t1").write_bytes(b"x")  # what LMCache --shm-name t1 leaves after SIGKILL
        (shm / "lmcache_kv_t1_0").write_bytes(b"x")
        _wait_for(ready)
        assert srv.track_shm(shm) == {shm / "psm_ours", shm / "sem.mp-ours", shm / "psm_shared"}
        servers.stop_servers(srv, timeout_s=5)
        assert not srv.alive()
        removed = servers.remove_server_shm(srv, shm)
        assert [p.name for p in removed] == ["lmcache_kv_t1_0", "lmcache_l1_pool_t1", "psm_ours", "sem.mp-ours"]
        assert sorted(p.name for p in shm.iterdir()) == ["lmcache_l1_pool_other", "psm_foreign", "psm_old",
                                                         "psm_shared", "sem.mp-old"]
    finally:
        foreign.kill()
        foreign.wait()
    # Once nobody holds it, the file the server had shared is removed on the next call.
    assert [p.name for p in servers.remove_server_shm(srv, shm)] == ["psm_shared"]


def test_shm_files_only_reports(tmp_path):
    (tmp_path / "psm_1").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    assert servers.shm_files(tmp_path) == {tmp_path / "psm_1"}
    assert (tmp_path / "psm_1").exists()


_STANDIN = textwrap.dedent("""
    import http.server, sys
    args = sys.argv[1:]
    port = int(args[args.index("{flag}") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "{path}" else 404); self.end_headers()
        def log_message(self, *a): pass
    print("listening", port, args, flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def test_serving_stack_starts_both_and_stops_both(tmp_path):
    """serving_stack with stand-ins for `lmcache server` (the venv's script) and `python -m vllm....api_server`."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    lmcache = venv_bin / "lmcache"
    lmcache.write_text(f"#!{sys.executable}\n" + _STANDIN.format(flag="--http-port", path="/healthcheck"))
    lmcache.chmod(0o755)
    api = tmp_path / "pkgs" / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True)
    for d in (api.parent.parent, api.parent, api):
        (d / "__init__.py").write_text("")
    (api / "api_server.py").write_text(_STANDIN.format(flag="--port", path="/health"))
    with servers.serving_stack("my-model", python=str(venv_bin / "python"), log_dir=tmp_path / "logs",
                               env={"PYTHONPATH": str(tmp_path / "pkgs")}, lmcache_options={"l1_size_gb": 1},
                               vllm_options={"dtype": "half"}, timeout_s=60) as stack:
        settings = stack.engine_settings()
        assert set(settings) == {"vllm_url", "lmcache_url", "lmcache_http_url"}
        assert settings["lmcache_url"].startswith("tcp://127.0.0.1:")
        procs = {s.name: s for s in stack.servers}
        assert all(s.alive() for s in procs.values())
        assert "'--model', 'my-model'" in procs["vllm"].log_tail() and "'--dtype', 'half'" in procs["vllm"].log_tail()
        assert "'--l1-size-gb', '1'" in procs["lmcache"].log_tail()
    assert not any(s.alive() for s in procs.values())


def test_bad_server_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match=r"command must be a non-empty list of strings .* \(split the string"):
        servers.start_server("s", "sleep 100", health_url="http://127.0.0.1:1/health", log_path=tmp_path / "s.log")
    with pytest.raises(TypeError, match="command must be a non-empty list"):
        servers.start_server("s", [], health_url="http://127.0.0.1:1/health", log_path=tmp_path / "s.log")
    with pytest.raises(ValueError, match="health_url must be an http\\(s\\) URL .* got 'not a url'"):
        servers.start_server("s", ["sleep", "1"], health_url="not a url", log_path=tmp_path / "s.log")
    with pytest.raises(TypeError, match="stop_servers takes Server objects from start_server, got NoneType"):
        servers.stop_servers([None])
    srv = servers.start_server("s", [sys.executable, "-c", "import time; time.sleep(60)"],
                               health_url="http://127.0.0.1:1/health", log_path=tmp_path / "s.log")
    servers.stop_servers(srv, timeout_s=1)  # a single server is accepted
    assert not srv.alive()


def test_an_unwritable_log_path_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"cannot write s's log file '.*a_file/x.log': .*give a log_path in a "
                                         r"writable folder"):
        servers.start_server("s", [sys.executable, "-c", "pass"], health_url="http://127.0.0.1:1/health",
                             log_path=blocker / "x.log")
    with pytest.raises(FileNotFoundError, match="not found"):
        servers.start_server("s", ["/nonexistent/exe"], health_url="http://127.0.0.1:1/health",
                             log_path=tmp_path / "logs" / "x.log")
    assert not (tmp_path / "logs").exists()  # nothing left behind by a start that could not happen


_SEM_OWNER = textwrap.dedent("""
    import multiprocessing as mp, signal, sys, time

    def worker():  # like vLLM-CPU's worker: a named semaphore, and it outlives its server's SIGTERM for a while
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lock = mp.get_context("spawn").Lock()
        print("/dev/shm/sem." + lock._semlock.name.lstrip("/"), flush=True)
        time.sleep(120)

    if __name__ == "__main__":
        mp.get_context("spawn").Process(target=worker).start()
        time.sleep(120)
""")


def test_stopping_lets_the_resource_tracker_release_a_killed_workers_semaphore(tmp_path):
    """A server whose worker ignores SIGTERM: the worker is killed, but not its multiprocessing resource
    tracker, which then unlinks the worker's named semaphore (/dev/shm/sem.mp-*) itself; stop_servers does
    not delete it. (Killed together with the worker, the tracker unlinks nothing and the file stays.)"""
    script = tmp_path / "owner.py"
    script.write_text(_SEM_OWNER)
    srv = servers.start_server("sem-owner", [sys.executable, str(script)], health_url="http://127.0.0.1:1/health",
                               log_path=tmp_path / "o.log")
    try:
        end = time.monotonic() + 60
        while "/dev/shm/sem.mp-" not in srv.log_tail():
            assert srv.alive() and time.monotonic() < end, srv.log_tail()
            time.sleep(0.05)
        sem = Path(srv.log_tail().splitlines()[0].strip())
        assert sem.exists() and sem in servers.held_shm_files(srv.pid)  # mapped by the worker
    finally:
        removed = servers.stop_servers(srv, timeout_s=1)
    assert not servers.group_alive(srv.pid)
    assert not sem.exists(), f"{sem} left in /dev/shm"
    assert sem not in removed, "the semaphore was deleted by stop_servers, not released by its owner's tracker"
    assert "resource_tracker: There appear to be 1 leaked semaphore objects" in srv.log_tail(), srv.log_tail()
