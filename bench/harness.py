"""What every bench script shares: standard options, `--summary` (the tables: `tools/bench_tables.py`), bad input in
one line, machine info, memory probes, peer venvs and the worker protocol. Stdlib at import: the peer venvs run
workers through this file without tdutils.

Worker protocol: `call(file, func, payload)` runs `python bench/harness.py --worker FILE FUNC` (this venv's Python
or a peer's): `FUNC(json from stdin)`, printed as a last `RESULT <json>` line; bad input (ValueError, OSError):
one line on stderr, exit status 2 (`WorkerError.returncode == 2`).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
MiB = 2 ** 20


# ------------------------------------------------------------------------------------------------ options
def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A `tdutils.cli.args.OneLineParser` named `prog` (bad options: one line, exit 2) with `doc` as its help."""
    from tdutils.cli.args import OneLineParser

    return OneLineParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_standard(ap, *, json: str | None = "--json", json_dest: str = "json", summary: bool = True,
                 threads=False, repeats: int | None = None, model: str | None = None, device=False) -> None:
    """The options benches share: `--json PATH` ('-' for stdout), `--summary RUN.json`, `--threads N` (default
    `threads` when not False/True), `--repeats N`, `--model NAME` and `--device` (when given a value; "auto": CUDA
    where there is one)."""
    from tdutils.cli.args import positive_int

    if model is not None:
        ap.add_argument("--model", default=model, help=f"any model load_model takes (default {model})")
    if repeats is not None:
        ap.add_argument("--repeats", type=positive_int, default=repeats, help=f"timed repeats (default {repeats})")
    if threads is not False:
        ap.add_argument("--threads", type=positive_int, default=None if threads is True else threads,
                        help="torch CPU threads; 1 is steadier on a machine shared with other work")
    if device == "auto":  # CUDA where there is one
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device is not False:
        ap.add_argument("--device", default=device)
    if json:
        ap.add_argument(json, dest=json_dest, default=None, metavar="PATH", help="write the run as JSON ('-': stdout)")
    if summary:
        ap.add_argument("--summary", default=None, metavar="RUN.json", help="print the tables of a stored run and exit")


def fail(ap, message) -> None:
    """End the bench with `prog: error: message` on stderr, exit status 2 (the project's bad-input convention)."""
    ap.exit(2, f"{ap.prog}: error: {message}\n")


def one_line_errors(ap, fn, *args, also=()):
    """`fn(*args)`, with bad input (`tdutils.cli.args.is_usage_error`: ValueError, OSError, ...; and the types in
    `also`, e.g. a failed peer venv build) reported in one line as `prog: error: ...`, exit status 2; anything
    else (a bug) keeps its traceback."""
    from tdutils.cli.args import is_usage_error

    try:
        return fn(*args)
    except Exception as exc:
        if not (is_usage_error(exc) or isinstance(exc, also)):
            raise
        fail(ap, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


# ------------------------------------------------------------------------------------------------ JSON and --summary
def check_json_dest(dest: str, option: str = "--json", example: str = "runs/bench.json") -> None:
    """Check before any work that `dest` ("-" for stdout, else a file path) can be written.

    Raises:
        ValueError: an empty or unwritable path (`tdutils.eval.check_output_path`), or a device that takes no write
            (`tdutils.cli.args.check_device_output`: `/dev/full`).
    """
    if dest != "-":
        from tdutils.cli.args import check_device_output
        from tdutils.eval import check_output_path

        check_output_path(dest, option, example=example)
        check_device_output(dest, option)  # /dev/full: refused now, not after the measurement


def write_json(results, dest: str, indent: int = 2, **kw) -> None:
    """Write `results` as indented JSON to the file `dest` (its folder made), or to stdout when `dest` is "-"."""
    text = json.dumps(results, indent=indent, **kw)
    if dest == "-":
        print(text)
    else:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(text + "\n", encoding="utf-8")


def load_file(name: str, path: Path):
    """The module of the file `path`, loaded once as `sys.modules[name]` (no package around it is imported)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def render(name: str, *args) -> str:
    """`bench_tables.NAME(*args)` of `tools/bench_tables.py`, the renderers of the benches' runs (`NAME` a bench's
    name: the table of its stored run, as the docs pages show it)."""
    return getattr(load_file("bench_tables", ROOT / "tools" / "bench_tables.py"), name)(*args)


def summary(ap, args, name: str, keys=None, check=None) -> bool:
    """With `--summary FILE`: print `render(name, report)` of the stored run and return True (bad files: missing,
    unreadable, not UTF-8 or not JSON: one line naming the path, exit 2); `keys` the run (a dict, or a list of such)
    must hold, `check(report, path)` any further test (raises ValueError)."""
    if not args.summary:
        return False

    def show():
        from tdutils.textio import read_text

        try:
            report = json.loads(read_text(args.summary))
        except OSError as exc:
            raise ValueError(f"--summary {args.summary!r}: {exc.strerror or exc}; give a file a bench wrote with "
                             f"--json") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--summary {args.summary!r} is not JSON ({exc}); give a file a bench wrote with "
                             f"--json") from None
        runs = report if isinstance(report, list) else [report]
        if keys and not (runs and all(isinstance(r, dict) and set(keys) <= set(r) for r in runs)):
            raise ValueError(f"--summary {args.summary!r} is not a run of {ap.prog} (no {' and '.join(keys)}); "
                             f"give a file it wrote with --json")
        if check:
            check(report, args.summary)
        print(render(name, report))
    one_line_errors(ap, show)
    return True


def start(ap, argv, name: str, example: str, keys, check=None, json_dest: str = "json"):
    """The first lines of a measuring bench's `main`: parse `argv`; with `--summary` print the stored run
    (`summary`, `keys` and `check` as there) and return None; else check `--device` (where the bench has it) and
    the `--json` path (option dest `json_dest`) before any work (a bad value: one line, exit 2), set torch's CPU
    threads to `--threads` when given, and return the options."""
    args = ap.parse_args(argv)
    if summary(ap, args, name, keys, check):
        return None
    from tdutils.models import check_device

    one_line_errors(ap, check_device, getattr(args, "device", None))
    if getattr(args, json_dest) is not None:
        one_line_errors(ap, check_json_dest, getattr(args, json_dest), "--json", example)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    return args



def add_ruler_batch_options(ap, *, batch_help: str) -> None:
    """The options of the one-engine A/B benches (`lean_step.py`, `banded_prefill.py`): `--dtype`, `--batch-size`,
    `--context-length`, RULER `--task` and dataset `--seed`."""
    from tdutils.cli.args import positive_int

    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                    help="weights, activations and KV cache (default bfloat16)")
    ap.add_argument("--batch-size", type=positive_int, default=4, help=f"{batch_help} (default 4)")
    ap.add_argument("--context-length", type=positive_int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--task", default="niah_single_1", help="RULER template task of the prompts (default niah_single_1)")
    ap.add_argument("--seed", type=int, default=5_000_000, help="dataset seed (default 5000000, held out)")


def measure_main(ap, argv, name: str, example: str, keys, measure) -> int:
    """A measuring bench's `main` after its options: `start` (`--summary` prints the stored run), then
    `measure(args)` (a ValueError: one line, exit 2), its table (`render(name, run)`) printed and `--json` written."""
    args = start(ap, argv, name, example, keys=keys)
    if args is None:
        return 0
    run = one_line_errors(ap, measure, args)
    print(render(name, run))
    if args.json:
        write_json(run, args.json)
    return 0

# ------------------------------------------------------------------------------------------------ machine
def machine_record() -> dict:
    """Platform, processor, CPU count and Python version (the `machine` field of the rope / R-KV runs)."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def log(message: str) -> None:
    """A progress line on stderr (stdout holds the tables and, with `--json -`, the run)."""
    print(message, file=sys.stderr, flush=True)


def run_record(prog: str) -> dict:
    """What a run was measured with: its command line, torch threads, machine (the CPU model and core count, e.g.
    "Intel(R) Xeon(R) Processor, 2 cores (shared)"), platform, torch and transformers versions and the date (the
    `meta` fields of the policy-cost and decode-compression runs)."""
    import torch
    import transformers

    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    machine = f"{cpu or platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)"
    return {"command": " ".join([prog] + sys.argv[1:]), "threads": torch.get_num_threads(), "machine": machine,
            "platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def ruler_prompts(task: str, n: int, context_length: int, tokenizer, seed: int, max_tokens: int | None):
    """`(rows, prompt ids, max_tokens)` of the peer comparisons: `tdutils.ruler.make_ruler_dataset` rows, their token
    ids, and `max_tokens` or, when None, enough for every gold value listed once (`" v1, v2, ..."` + 4)."""
    from tdutils import ruler

    data = ruler.make_ruler_dataset(task, n, context_length, tokenizer=tokenizer, seed=seed)
    prompts = [list(map(int, ex["prompt_ids"])) for ex in data]
    if max_tokens is None:
        max_tokens = 4 + max(len(tokenizer.encode(" " + ", ".join(ex["values"]), add_special_tokens=False))
                             for ex in data)
    return data, prompts, max_tokens


def check_ruler_task(task: str) -> None:
    """Raises ValueError unless `task` is a RULER template task (`tdutils.ruler.RULER_TEMPLATE_TASKS`)."""
    from tdutils import ruler

    if task not in ruler.RULER_TEMPLATE_TASKS:
        raise ValueError(f"--task {task!r} is not a RULER task; known: {', '.join(ruler.RULER_TEMPLATE_TASKS)}")


def add_peer_options(ap, *, n: int, batch_size: int, out: str) -> None:
    """The options of the peer comparisons (`peer_kvpress.py`, `peer_openvino.py`): `--model`, RULER `--task`,
    `--context-length`, `--n`, `--max-tokens`, `--seed`, `--batch-size`, `--threads` and `--out`."""
    from tdutils.cli.args import count, positive_int

    add_standard(ap, model="smollm2-135m", json=None, summary=False)
    ap.add_argument("--task", default="niah_single_1", help="RULER task (default niah_single_1)")
    ap.add_argument("--context-length", type=positive_int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--n", type=positive_int, default=n, help=f"prompts (default {n})")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="greedy new tokens (default: the longest gold answer's tokens + 4, as 'v1, v2, ...')")
    ap.add_argument("--seed", type=count, default=5_000_000, help="dataset seed (default 5000000, held out)")
    ap.add_argument("--batch-size", type=positive_int, default=batch_size,
                    help=f"tdutils' prefill / decode batch (default {batch_size})")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch / peer threads on both sides (default: tdutils.cli.args.usable_cores())")
    ap.add_argument("--out", default=out, help=f"JSON report (default {out})")


def peer_meta(args, **extra) -> dict:
    """The `meta` fields both peer comparisons record: the command line and the shared options, then `extra`."""
    return {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "model": args.model, "task": args.task,
            "context_length": args.context_length, "n": args.n, "max_tokens": args.max_tokens, "seed": args.seed,
            "batch_size": args.batch_size, **extra}


def bind_cores(threads: int) -> list[int] | None:
    """Bind this process (and the subprocesses it starts, which inherit it) to its first `threads` usable cores, so
    that both sides of a thread-matched comparison run on the same cores (an unbound 1-thread run moved between the
    2 shared cores here and decoded 30% slower in some runs); returns the cores, or None where the OS has no
    affinity call."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))[:max(1, threads)]
    os.sched_setaffinity(0, cores)
    return cores


def decode_cells(engine, prompts, cells, *, max_tokens: int, batch_size: int, keep: bool = False) -> dict:
    """tdutils' side of a peer comparison: `prompts` prefilled `batch_size` at a time, then from that one prefill
    (`snapshot` / `restore`) each cell `(name, drop_fn or None)` edited and decoded (greedy, EOS ignored).

    Returns {name: {"texts" (answers, cut at the first EOS), "kept" (cached tokens at decode), "tokens",
    "seconds", "tok_s" (decode: every `decode()` call whole, from the slot store's allocation and the caches'
    admission to the last token), "steady_tokens", "steady_seconds", "steady_tok_s" (the tokens after each
    request's first and the seconds from the step that gave the batch its last first token to the last step:
    OpenVINO's decode phase, `peer_openvino.phase_split`), "prefill_s" (per batch), "keep" (with `keep`: each
    request's kept indices)}}.
    """
    res = {name: {"texts": [], "kept": [], "keep": [], "tokens": 0, "seconds": 0.0, "prefill_s": [],
                  "steady_tokens": 0, "steady_seconds": 0.0} for name, _ in cells}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        engine.prefill(chunk)
        prefill_s, saved = engine.metrics.prefill.seconds, engine.snapshot()
        for name, fn in cells:
            engine.restore(saved)
            cell = res[name]
            if fn is not None:
                if keep:  # the selection modify makes next, read apart so modify stays untouched
                    cell["keep"] += [fn.keep_indices(engine.tensors(q.request_id), engine.tokens(q.request_id)).tolist()
                                     for q in engine.requests]
                engine.modify(fn)
            outs = engine.decode(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            d = engine.metrics.decode
            cell["texts"] += [o.answer for o in outs]
            cell["kept"] += [o.cached_tokens for o in outs]
            cell["tokens"] += d.output_tokens
            cell["seconds"] += d.seconds
            times = [r.token_times for r in engine.requests]  # seconds from the decode call's start, per token
            cell["steady_tokens"] += sum(len(t) - 1 for t in times)
            cell["steady_seconds"] += max(t[-1] for t in times) - max(t[0] for t in times)
            cell["prefill_s"].append(prefill_s)
            log(f"[tdutils] {name} prompts {start + 1}-{start + len(chunk)}: {d.tokens_per_s:.1f} tok/s")
    for cell in res.values():
        cell["tok_s"] = cell["tokens"] / cell["seconds"] if cell["seconds"] > 0 else math.nan
        cell["steady_tok_s"] = cell["steady_tokens"] / cell["steady_seconds"] if cell["steady_seconds"] > 0 else math.nan
    return res


def ruler_scores(task: str, data, texts) -> tuple[list[bool], list[float]]:
    """Exact match and partial credit of each answer (`tdutils.ruler.score_ruler` against the row's `values`)."""
    from tdutils import ruler

    s = [ruler.score_ruler(task, ex["values"], text) for ex, text in zip(data, texts)]
    return [bool(e) for e, _ in s], [float(p) for _, p in s]


def platform_fields() -> dict:
    """`machine` (platform string) and `processor`: the fields of the throughput and engine runs."""
    return {"machine": platform.platform(), "processor": platform.processor()}


# ------------------------------------------------------------------------------------------------ memory probes
class PeakRSS:
    """Context manager: the peak of this process's resident set inside the block (Linux /proc). On exit: `start`
    and `peak` (bytes: the RSS before, and VmHWM, reset on entry by writing 5 to /proc/self/clear_refs), `growth` =
    peak - start, `maxrss` (getrusage's ru_maxrss - start) and `method`. Where VmHWM cannot be reset the peak is
    start + maxrss: ru_maxrss cannot be reset and a child inherits its parent's, so run the block in a fresh process.
    `mmap_threshold` (bytes): first have glibc serve every allocation that large by its own mmap (unmapped when
    freed; also stops glibc raising the threshold) and return freed heap, so RSS follows live tensors (`mmap`:
    whether glibc took it)."""

    def __init__(self, mmap_threshold: int | None = None):
        self.mmap_threshold, self.mmap, self.hwm = mmap_threshold, False, True

    def __enter__(self):
        if self.mmap_threshold:
            try:
                libc = ctypes.CDLL("libc.so.6")
                self.mmap = libc.mallopt(-3, self.mmap_threshold) == 1  # M_MMAP_THRESHOLD
                libc.malloc_trim(0)
            except (OSError, AttributeError):  # no glibc
                pass
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.hwm = False
        self.start = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return self

    def __exit__(self, *exc):
        self.maxrss = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start)  # Linux: KiB
        hwm = [ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM:")]
        self.peak = int(hwm[0].split()[1]) * 1024 if self.hwm else self.start + self.maxrss
        self.growth = max(0, self.peak - self.start)
        self.method = ("VmHWM (reset via /proc/self/clear_refs)" if self.hwm else "ru_maxrss") + " - RSS before"
        return False


def time_alternated(fns: dict, repeats: int, device: str = "cpu", keep=None):
    """`({name: [seconds per repeat]}, [order of each repeat])`: every `fns[name]()` once per repeat, the order
    alternating forward / backward (`tdutils.runs.run_orders`), timed by `tdutils.profiling.timed` (the device
    synchronised around each call). `keep(repeat, name, result)`, when given, sees each result before it is freed."""
    from tdutils.profiling import timed
    from tdutils.runs import run_orders

    times = {name: [] for name in fns}
    orders = run_orders(fns, repeats, "alternate")
    for i, order in enumerate(orders):
        for name in order:
            result, seconds = timed(fns[name], device=device)
            times[name].append(seconds)
            if keep:
                keep(i, name, result)
            del result
    return times, orders


def extra_memory(fn, device: str = "cpu", mmap_threshold: int | None = None) -> tuple:
    """`(fn(), bytes, method, ru_maxrss bytes)`: the memory one call of `fn` takes above what was held before.
    CUDA: the allocator's peak (`tdutils.profiling.peak_memory`; no ru_maxrss: None). CPU (run it in a fresh
    process): `PeakRSS(mmap_threshold)` around the call; the returned tensors count."""
    if device.startswith("cuda"):
        from tdutils.profiling import peak_memory

        out, extra = peak_memory(fn, device=device)
        return out, extra, "torch.cuda.max_memory_allocated - allocated before", None
    with PeakRSS(mmap_threshold) as mem:
        out = fn()
    malloc = f", mallopt(M_MMAP_THRESHOLD={mmap_threshold // 1024} KiB)" if mem.mmap else ", default malloc"
    return out, mem.growth, mem.method + ", subprocess" + (malloc if mmap_threshold else ""), mem.maxrss


# ------------------------------------------------------------------------------------------------ peer venvs
venvs = load_file("tdutils_venvs", ROOT / "tdutils" / "serving" / "venvs.py")  # stdlib only, also in a peer venv
PeerVenv, MARKER = venvs.CachedVenv, venvs.MARKER  # a peer's own venv, built once and reused (its docstring)


def peer_env(threads: int, **extra) -> dict:
    """The environment of a peer venv's process: no PYTHONPATH / VIRTUAL_ENV of ours, `threads` OpenMP threads."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", **extra)
    return env


# ------------------------------------------------------------------------------------------------ workers
TAG = "RESULT"


class WorkerError(RuntimeError):
    """A worker ended without a result: `returncode` (2: bad input, its one line is `last_line`) and its
    stderr's last lines in the message."""

    def __init__(self, what: str, returncode: int, stderr: str):
        lines = [ln for ln in (stderr or "").splitlines() if ln.strip()]
        self.returncode, self.last_line = returncode, lines[-1] if lines else ""
        super().__init__(f"{what} failed (exit {returncode}): {lines[-3:]}")


def run_tagged(argv, *, tag: str = TAG, what: str = "worker", input: str | None = None, stream: bool = False,
               **kw):
    """Run `argv` and return the JSON of its last stdout line `"<tag> <json>"`. `stream`: its stderr goes to ours
    (progress of long runs) instead of into the error. `kw` go to `subprocess.run` (timeout, env, cwd).

    Raises:
        WorkerError: no tagged line (the process failed). subprocess.TimeoutExpired: past `timeout`.
    """
    proc = subprocess.run(argv, input=input, stdout=subprocess.PIPE, stderr=None if stream else subprocess.PIPE,
                          text=True, check=False, **kw)
    tagged = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
    if not tagged or proc.returncode:
        raise WorkerError(what, proc.returncode, proc.stderr or "")
    return json.loads(tagged[-1][len(tag) + 1:])


def call(file, func: str, payload, *, python=sys.executable, what: str | None = None, **kw):
    """`func(payload)` of the bench `file`, run in a fresh `python` process (this venv's or a peer's); the
    payload and the result travel as JSON. `kw` as for `run_tagged`."""
    return run_tagged([str(python), str(HERE), "--worker", str(file), func], input=json.dumps(payload),
                      what=what or f"{Path(file).name} {func}", **kw)


def options(payload: dict) -> argparse.Namespace:
    """A worker's payload of options (a bench's own, as a dict) as a Namespace; torch's CPU threads set to its
    `threads` when given."""
    if payload.get("threads"):
        import torch

        torch.set_num_threads(payload["threads"])
    return argparse.Namespace(**payload)


def _worker_main(file: str, func: str) -> int:
    spec = importlib.util.spec_from_file_location(f"bench_worker_{Path(file).stem}", file)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HERE.parent))
    spec.loader.exec_module(mod)
    try:
        result = getattr(mod, func)(json.loads(sys.stdin.read()))
    except (ValueError, OSError) as exc:  # bad input: one line, exit 2 (the parent reads WorkerError.last_line)
        print(f"bench/{Path(file).name}: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2
    print(f"{TAG} {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2], sys.argv[3]))
    sys.exit(f"usage: python {Path(__file__).name} --worker FILE FUNC < payload.json")
