"""Worker processes for `task_eval` (`python -m tdutils eval --workers N`): each (length, task) group's prompts are
split into N contiguous shards, and each shard runs every cell of the group in a process of its own, with its own
engine on its own cores.

Why: on a CPU the engine's many small operations scale poorly with threads (a 20-cell grid of SnapKV, KNorm and
TOVA on 8 prompts: 118 s at one thread, 76 s at two), while two one-thread processes each keep their core busy.
Every prompt's cells are computed as in one process (the same prefill, edits and decode per prompt; answers equal
up to float summation order where a batch holds other prompts); the parent scores the merged results, writes the
JSON after every group and shows one progress bar, as `run_tasks` does alone.

`WorkerPool` is the contract: open it with what the workers need to open their engines and build their cells,
`generate` one group's raw results, `close` (or `terminate` on Ctrl-C). Details private.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from .tasks import MODES
from .tasks import Task, get_task

# Worker-process state, set once by `_init` (one engine and its cells per process).
_ENGINE = None
_CELLS: dict = {}
_TICKS = None


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


class WorkerPool:
    """`workers` spawned processes, each with its own engine (the parent's model, dtype and cells), for
    `task_eval(..., workers=N)`.

    Args:
        workers: processes, >= 2. threads: torch threads per worker (>= 1).
        model, dtype, seed: what each worker opens (`runner._open_engine`: a model name, not an object).
        policies, ratios, params: the cells each worker builds (`runner.build_cells`), keyed by (policy, ratio).
        cores: one list of cores per worker (`worker_cores`), or None to leave the workers unbound.

    Raises:
        ValueError: fewer than 2 workers, threads below 1, or `cores` not one list per worker.
    """

    def __init__(self, workers: int, *, threads: int, model, dtype: str, seed: int, policies: Sequence[str],
                 ratios: Sequence[float], params: Mapping[str, Mapping], cores: list[list[int]] | None = None):
        if int(workers) < 2 or int(threads) < 1:
            raise ValueError(f"WorkerPool needs workers >= 2 and threads >= 1, got workers={workers}, "
                             f"threads={threads}")
        if cores is not None and len(cores) != workers:
            raise ValueError(f"cores must give one list of cores per worker ({workers}), got {len(cores)}")
        self.workers = int(workers)
        ctx = multiprocessing.get_context("spawn")  # a fork of a process with torch threads running can hang
        self._ticks = ctx.Queue()
        self._slots = slots = ctx.Queue()
        for c in cores or [None] * workers:
            slots.put(c)
        self._pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                         initargs=(model, dtype, int(threads), seed, list(policies),
                                                   [float(r) for r in ratios], {k: dict(v) for k, v in params.items()},
                                                   slots, self._ticks))

    def generate(self, task: Task, data: Sequence[Mapping], todo: Mapping[str, Sequence[tuple]], *,
                 decode_tokens: int, batch_size: int, stop_at_eos: bool,
                 tick: Callable | None = None) -> dict[str, tuple]:
        """One (length, task) group on every worker: `data` split into contiguous shards, each shard's cells of
        `todo` (`{mode: [(policy, ratio, drop_fn)]}`) run in one worker, the results merged in prompt order.

        Returns:
            `{mode: (results, modify_s, kept)}` as `runner.run_cells` (`results`: answers per cell) or, for a
            teacher-forced task, `runner.run_forced_cells` (`results`: per-prompt measures per cell) give them for
            all of `data`; `modify_s` and `kept` summed over the shards.

        Raises:
            whatever a worker raised; `concurrent.futures.process.BrokenProcessPool` when a worker died (e.g. out
            of memory).
        """
        keys = {m: [(p, float(r)) for p, r, _ in cells] for m, cells in todo.items() if cells}
        bounds = _shards(len(data), self.workers)
        futures = [self._pool.submit(_generate, task.name, list(data[a:b]), keys, decode_tokens, batch_size,
                                     stop_at_eos, (b - a) / len(data)) for a, b in bounds]
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            self._drain(tick)
        self._drain(tick)
        return _merge([f.result() for f in futures])

    def _drain(self, tick: Callable | None) -> None:
        while True:
            try:
                item = self._ticks.get_nowait()
            except queue.Empty:
                return
            if tick is not None:
                tick(*item)

    def close(self) -> None:
        """Let the workers finish and exit."""
        self._pool.shutdown(wait=True)
        self._close_queues()

    def _close_queues(self) -> None:
        for q in (self._ticks, self._slots):  # else the resource tracker warns of leaked semaphores at exit
            q.close()
            q.cancel_join_thread()

    def terminate(self) -> None:
        """Stop the workers now (Ctrl-C): queued shards are cancelled and running ones killed."""
        # ProcessPoolExecutor has no public kill: shutdown(wait=False) alone waits for running shards at exit
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.terminate()
        for p in processes:
            p.join(timeout=10)
        self._pool.shutdown(wait=True)  # its manager thread sees the dead workers and closes its own queues
        self._close_queues()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.terminate()


def _shards(n: int, workers: int) -> list[tuple[int, int]]:
    """`[(start, stop)]`: `n` prompts in at most `workers` contiguous shards of sizes differing by at most one."""
    k = min(workers, n)
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def _merge(parts: list[dict]) -> dict[str, tuple]:
    """The shards' `{mode: (results, modify_s, kept)}` as one, shards in prompt order: answers concatenated (a
    teacher-forced task's per-prompt measures per measure), seconds and kept tokens summed."""
    out = {}
    for mode in parts[0]:
        results, modify_s, kept = parts[0][mode]
        for part in parts[1:]:
            more, secs, rows = part[mode]
            for key, value in more.items():
                if isinstance(value, Mapping):  # teacher-forced: {measure: [per prompt]}
                    for measure, xs in value.items():
                        results[key][measure] = results[key][measure] + xs
                else:
                    results[key] = results[key] + value
                modify_s[key] += secs[key]
                kept[key] += rows[key]
        out[mode] = (results, modify_s, kept)
    return out


def _init(model, dtype, threads, seed, policies, ratios, params, slots, ticks) -> None:
    """Worker start: Ctrl-C is the parent's to handle; bind to this worker's cores; open the engine; build the
    cells."""
    import torch

    from .runner import _open_engine, build_cells

    global _ENGINE, _CELLS, _TICKS
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cores = slots.get()
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    _ENGINE = _open_engine(None, model, seed, dtype=dtype)
    _CELLS = {(p, float(r)): (p, r, fn) for p, r, fn in build_cells(_ENGINE, policies, ratios, params)}
    _TICKS = ticks


def _generate(task_name: str, data: list, keys: dict, decode_tokens: int, batch_size: int, stop_at_eos: bool,
              weight: float) -> dict[str, tuple]:
    """One shard in a worker: `generate_cells` on its engine, ticks scaled to the whole group."""
    task = get_task(task_name)
    todo = {m: [_CELLS[k] for k in ks] for m, ks in keys.items()}

    def tick(mode, policy, r, fraction):
        _TICKS.put((mode, policy, r, fraction * weight))

    return generate_cells(_ENGINE, task, data, todo, decode_tokens=decode_tokens, batch_size=batch_size,
                          stop_at_eos=stop_at_eos, tick=tick)


def generate_cells(engine, task: Task, data: Sequence[Mapping], todo: Mapping[str, Sequence[tuple]], *,
                   decode_tokens: int, batch_size: int, stop_at_eos: bool,
                   tick: Callable | None = None) -> dict[str, tuple]:
    """The raw results of every cell of `todo` (`{mode: [(policy, ratio, drop_fn)]}`) on `data`, unscored: for a
    teacher-forced task `run_forced_cells`' per-prompt measures, else `run_cells_shared` (both modes from one
    prefill) or `run_cells` per mode. `tick(mode, policy, ratio, fraction)` after each chunk of prompts.

    Returns:
        `{mode: (results, modify_s, kept)}` (see `WorkerPool.generate`).
    """
    from functools import partial

    from .runner import run_cells, run_cells_shared, run_forced_cells

    def mode_tick(mode):
        return None if tick is None else partial(tick, mode)

    tok = engine.tokenizer
    prompts = [d.get("prompt_ids", d.get("prompt")) for d in data]
    todo = {m: list(c) for m, c in todo.items() if c}
    if task.teacher_forced:
        out = {}
        for mode, cells in todo.items():
            modify_s, kept = {}, {}

            def keep(policy, r, per, secs, rows, modify_s=modify_s, kept=kept):
                modify_s[policy, r], kept[policy, r] = secs, rows

            per = run_forced_cells(engine, prompts, [d["continuation"] for d in data], cells, batch_size=batch_size,
                                   on_cell=keep, tick=mode_tick(mode))
            out[mode] = (per, modify_s, kept)
        return out
    if all(todo.get(m) for m in MODES):
        contexts, questions = zip(*(task.split(tok, d) for d in data))
        return run_cells_shared(engine, contexts, questions, todo, max_tokens=decode_tokens, batch_size=batch_size,
                                stop_at_eos=stop_at_eos, tick=tick)
    out = {}
    for mode, cells in todo.items():
        inputs, extensions = prompts, None
        if mode == "agnostic":
            inputs, extensions = zip(*(task.split(tok, d) for d in data))
        out[mode] = run_cells(engine, inputs, cells, max_tokens=decode_tokens, batch_size=batch_size,
                              extensions=extensions, stop_at_eos=stop_at_eos, tick=mode_tick(mode))
    return out


__all__ = ["WorkerPool", "generate_cells", "worker_cores"]
