"""Worker processes for `task_eval(workers=N)` (`python -m tdutils eval --workers N`): a small process pool that
runs one function per shard of a group's prompts in spawned processes, each bound to cores of its own, and relays
their progress to the parent.

Why: on a CPU the engine's many small operations scale poorly with threads (a 20-cell grid of SnapKV, KNorm and
TOVA on 8 prompts: 118 s at one thread, 76 s at two), while two one-thread processes each keep their core busy.
What runs in the workers (an engine per process, the cells of a shard) is `tdutils.eval.runner`'s; this module
knows only processes, cores, shards and progress.

`WorkerPool` is the contract: open it with the function that sets up each worker, `map` a function over shards,
`close` (or `terminate` on Ctrl-C). Details private.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

_PROGRESS = None  # in a worker: the queue `progress` puts on


def worker_cores(workers: int, threads: int) -> list[list[int]] | None:
    """Cores per worker: the usable cores (`os.sched_getaffinity`) in order, `threads` to each worker, or None where
    there are fewer than `workers * threads` (the workers are then left to the scheduler). Binding keeps a
    one-thread worker on one core (unbound, the scheduler moved a one-thread decode between cores: 53 against
    71-78 tok/s bound, docs/peer_openvino.md)."""
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if len(usable) < workers * threads:
        return None
    return [usable[i * threads:(i + 1) * threads] for i in range(workers)]


def shards(n: int, workers: int) -> list[tuple[int, int]]:
    """`[(start, stop)]`: `n` items in at most `workers` contiguous shards of sizes differing by at most one (no
    empty shard)."""
    k = min(workers, n)
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def progress(*item) -> None:
    """In a worker: pass `item` to the parent's `on_progress` (`WorkerPool.map`)."""
    _PROGRESS.put(item)


class WorkerPool:
    """`workers` spawned processes; each runs `initializer(*initargs)` once (after ignoring Ctrl-C, which is the
    parent's to handle, and binding itself to its cores), then the functions `map` gives it.

    Args:
        workers: processes, >= 2. initializer, initargs: a module-level function and its picklable arguments.
        cores: one list of cores per worker (`worker_cores`), or None to leave the workers unbound.

    Raises:
        ValueError: fewer than 2 workers, or `cores` not one list per worker.
    """

    def __init__(self, workers: int, initializer: Callable, initargs: tuple = (),
                 cores: list[list[int]] | None = None):
        if int(workers) < 2:
            raise ValueError(f"WorkerPool needs workers >= 2, got {workers}")
        if cores is not None and len(cores) != workers:
            raise ValueError(f"cores must give one list of cores per worker ({workers}), got {len(cores)}")
        self.workers = int(workers)
        ctx = multiprocessing.get_context("spawn")  # a fork of a process with torch threads running can hang
        self._progress = ctx.Queue()
        self._slots = ctx.Queue()
        for c in cores or [None] * workers:
            self._slots.put(c)
        self._pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start,
                                         initargs=(self._slots, self._progress, initializer, tuple(initargs)))

    def map(self, fn: Callable, calls: Sequence[tuple], on_progress: Callable | None = None) -> list:
        """`[fn(*args) for args in calls]`, computed in the workers (one call each at a time), in `calls`' order;
        `on_progress(*item)` here for every `progress(*item)` a worker sends, while they run.

        Raises:
            whatever `fn` raised in a worker; `BrokenProcessPool` when a worker died (out of memory, killed, or
            a script that spawned workers outside `if __name__ == "__main__":`).
        """
        futures = [self._pool.submit(fn, *args) for args in calls]
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            self._drain(on_progress)
        self._drain(on_progress)
        try:
            return [f.result() for f in futures]
        except BrokenProcessPool as exc:
            raise BrokenProcessPool(f"{exc} A worker died: out of memory (fewer workers, or a smaller batch), "
                                    f"killed, or, from a script, the workers were started outside "
                                    f"`if __name__ == '__main__':` (each worker imports the main module)") from None

    def _drain(self, on_progress: Callable | None) -> None:
        while True:
            try:
                item = self._progress.get_nowait()
            except queue.Empty:
                return
            if on_progress is not None:
                on_progress(*item)

    def close(self) -> None:
        """Let the workers finish and exit."""
        self._pool.shutdown(wait=True)
        self._close_queues()

    def terminate(self) -> None:
        """Stop the workers now (Ctrl-C): queued calls are cancelled and running ones killed."""
        # ProcessPoolExecutor has no public kill: shutdown(wait=False) alone waits for running calls at exit
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.terminate()
        for p in processes:
            p.join(timeout=10)
        self._pool.shutdown(wait=True)  # its manager thread sees the dead workers and closes its own queues
        self._close_queues()

    def _close_queues(self) -> None:
        for q in (self._progress, self._slots):
            q.close()
            q.cancel_join_thread()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.terminate()


def _start(slots, progress_queue, initializer: Callable, initargs: tuple) -> None:
    """A worker's start: Ctrl-C left to the parent, bound to its cores, then `initializer(*initargs)`."""
    global _PROGRESS
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cores = slots.get()
    if cores is not None:
        os.sched_setaffinity(0, cores)
    _PROGRESS = progress_queue
    initializer(*initargs)


__all__ = ["WorkerPool", "progress", "shards", "worker_cores"]
