"""`python -m tdutils doctor`: check a vLLM + LMCache serving setup end to end and print what to fix.

Checks, in order (each with a finite timeout): the LMCache server answers `/healthcheck` and `/config`
(chunk size); vLLM answers `/v1/models` and serves the model; which query-export patch fits vLLM's
version (`/version`; `tdutils.serving.patches.PATCHES`); the patch state of a vLLM visible from here (`--vllm-dir`,
`--vllm-python`, or this environment) and of the LMCache installed next to it (fused K/V layout patch);
LMCache has the model's KV layout registered (vLLM runs with the LMCache MP connector), in a form its SDK
can read, and, for policies that need queries, a query registration; a one-token completion
streams token ids (`--return-tokens-as-token-ids`) whose count matches the reported usage.
Exit status 0 when nothing failed (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import os
import sys

from ..policies import get_policy, policy_names
from ..serving.completion import CompletionError, make_post_completion
from ..serving.kvlayout import FUSED_FORMATS
from ..serving.patches import (
    SUPPORTED_TEXT,
    PatchError,
    check_version,
    find_lmcache,
    find_vllm,
    fitting_patch,
    load_patch,
    patch_for,
    status,
)
from ..serving.probes import (
    LMCACHE_START_HINT,
    VLLM_START_HINT,
    ServerError,
    http_json,
    lmcache_model_name,
    registered_models,
)
from .args import OneLineParser, UsageError, check_server_urls, report_error

OK, WARN, FAIL = "ok", "warn", "FAIL"


def _doctor_hint(hint: str, options: str) -> str:
    """An engine's start hint with its "or point at it: keyword= (command line: ...)" tail replaced by the
    options of this command, which are the ones a doctor user can pass."""
    head = hint.split(", or point at it")[0]
    return f"{head}, or point doctor at it: {options}"


LMCACHE_HINT = _doctor_hint(LMCACHE_START_HINT, "--lmcache-http-url URL")
VLLM_HINT = _doctor_hint(VLLM_START_HINT, "--vllm-url URL")


class Report:
    """Collects check results; `failed` is True once any check failed."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.failed = False
        self.kv_failed = False  # a failure that stops every policy (servers, registration, completions)
        self.query_issue: str | None = None  # why policies that need queries may not run

    def add(self, level: str, what: str, fix: str = "", *, queries: bool = False) -> None:
        """One check's line; `queries=True` marks a check only policies that read queries depend on."""
        self.failed |= level == FAIL
        if queries and level != OK:
            self.query_issue = self.query_issue or what
        elif level == FAIL:
            self.kv_failed = True
        print(f"[{level:>4}] {what}", file=self.out)
        if fix:
            print(f"       fix: {fix}", file=self.out)


def add_arguments(parser) -> None:
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="vLLM server (default: %(default)s)")
    parser.add_argument("--lmcache-http-url", default="http://localhost:8080",
                        help="LMCache HTTP API (default: %(default)s)")
    parser.add_argument("--model", default=None, help="served model name (default: the only one vLLM serves)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds allowed for each HTTP call; the test completion gets 6x (default: 10)")
    parser.add_argument("--vllm-dir", default=None, help="vLLM package folder, to check the patch state")
    parser.add_argument("--vllm-python", default=None,
                        help="interpreter of vLLM's environment, to find vLLM (e.g. /path/to/vllm-venv/bin/python)")
    parser.add_argument("--no-queries", action="store_true",
                        help="do not require query export (only policies without queries will run)")


def _lmcache(rep: Report, url: str, timeout: float) -> dict | None:
    try:
        health = http_json("GET", url + "/healthcheck", timeout=timeout, what="the LMCache server",
                           hint=LMCACHE_START_HINT)
    except ServerError as exc:
        rep.add(FAIL, f"LMCache server at {url}: {str(exc).split('; start it')[0]}", LMCACHE_HINT)
        return None
    if not isinstance(health, dict) or health.get("status") != "healthy":
        rep.add(FAIL, f"LMCache at {url} is not healthy: {health}", "look at the LMCache server's log, restart it")
        return None
    try:
        conf = http_json("GET", url + "/config", timeout=timeout, what="the LMCache server")
        status = http_json("GET", url + "/status", timeout=timeout, what="the LMCache server")
        chunk = int(conf["mp"]["chunk_size"])
    except (ServerError, KeyError, TypeError, ValueError) as exc:
        rep.add(FAIL, f"LMCache at {url} is up but /config or /status is unusable: {exc}",
                "use an LMCache with the MP server (lmcache server ..., lmcache >= 0.5.6)")
        return None
    rep.add(OK, f"LMCache server at {url} is healthy; chunk size {chunk}")
    return status


def _vllm_model(rep: Report, url: str, model: str | None, timeout: float) -> tuple[str | None, str | None]:
    """The served model's name and its `root` (vLLM's model path), or (None, None) after a failure."""
    try:
        data = http_json("GET", url + "/v1/models", timeout=timeout, what="vLLM", hint=VLLM_START_HINT)
        entries = data.get("data", [])
        names = [m.get("id") for m in entries]
    except (ServerError, AttributeError) as exc:
        rep.add(FAIL, f"vLLM at {url}: {str(exc).split('; start it')[0]}", VLLM_HINT)
        return None, None
    if model is None:
        if len(names) != 1:
            rep.add(FAIL, f"vLLM at {url} serves {names}", "pass --model NAME")
            return None, None
        model = names[0]
    if model not in names:
        rep.add(FAIL, f"vLLM at {url} does not serve {model!r} (it serves {names})",
                f"pass --model with one of {names}, or start vLLM with that model")
        return None, None
    rep.add(OK, f"vLLM at {url} serves {model!r}")
    return model, entries[names.index(model)].get("root")


def _vllm_version(rep: Report, url: str, timeout: float) -> None:
    try:
        version = http_json("GET", url + "/version", timeout=timeout, what="vLLM").get("version")
    except (ServerError, AttributeError) as exc:
        rep.add(WARN, f"vLLM's /version is unavailable ({exc})")
        return
    try:
        spec = check_version(str(version))
    except PatchError:
        rep.add(WARN, f"vLLM {version} is outside the ranges the query-export patches were written for "
                      f"({SUPPORTED_TEXT})",
                "install one of those vLLM versions in vLLM's environment (policies without queries are unaffected)",
                queries=True)
        return
    rep.add(OK, f"vLLM version {version} (query-export patch that fits it: {spec.name})")


def _patch_state(rep: Report, vllm_dir: str | None, python: str | None) -> None:
    try:
        install = find_vllm(vllm_dir, python, options=("--vllm-python", "--vllm-dir"))
        spec = patch_for("vllm", install.version)
        state = status(install, load_patch(spec or fitting_patch(install))).state
    except (PatchError, OSError) as exc:
        rep.add(WARN, f"patch state unknown: {exc}",
                "run `python -m tdutils patches check` in vLLM's environment, or pass --vllm-python / --vllm-dir",
                queries=True)
        return
    _lmcache_patch_state(rep, install)
    if state == "applied":
        rep.add(OK, f"vLLM {install.version} at {install.package_dir} is patched to export query tensors"
                    + (f" ({spec.name})" if spec else ""))
    elif state == "conflict":  # `apply` refuses such a vLLM: say what does help
        rep.add(FAIL, f"vLLM {install.version} at {install.package_dir}: the query-export patch does not fit this "
                      f"vLLM (its code differs from the versions the patches were written for, {SUPPORTED_TEXT})",
                f"install a vLLM one of them fits in vLLM's environment (e.g. pip install vllm==0.33.0), or run "
                f"policies without queries ({', '.join(_query_free())}) and pass --no-queries", queries=True)
    else:
        rep.add(FAIL, f"vLLM {install.version} at {install.package_dir}: query-export patch {state}"
                      + (f" ({spec.name})" if spec else ""),
                "python -m tdutils patches apply" + (f" --python {python}" if python else "")
                + (f" --vllm-dir {vllm_dir}" if vllm_dir else "") + ", then restart vLLM", queries=True)


def _lmcache_patch_state(rep: Report, vllm: object) -> None:
    """The LMCache layout patch next to vLLM (the servers' environment): reported when LMCache is there."""
    try:
        install = find_lmcache(vllm)
        if install is None:
            return
        spec = patch_for("lmcache", install.version)
        if spec is None:
            rep.add(WARN, f"LMCache {install.version} at {install.package_dir}: no fused K/V layout patch was written "
                          f"for this version; vLLM's CPU backend needs it (GPU backends do not)")
            return
        state = status(install).state
    except (PatchError, OSError) as exc:
        rep.add(WARN, f"LMCache patch state unknown: {exc}")
        return
    if state == "applied":
        rep.add(OK, f"LMCache {install.version} at {install.package_dir} is patched to read fused K/V layouts "
                    f"({spec.name})")
    else:
        rep.add(WARN, f"LMCache {install.version} at {install.package_dir}: fused K/V layout patch {spec.name} "
                      f"{state}; vLLM's CPU backend needs it (GPU backends do not)",
                "python -m tdutils patches apply --target lmcache --python PY-OF-THAT-ENVIRONMENT, then restart "
                "the LMCache server")


def _registration(rep: Report, status: dict, model: str, root: str | None, queries: bool) -> None:
    name = lmcache_model_name(model, root, registered_models(status))
    if name is not None:
        rep.add(OK, f"LMCache has the KV layout of {model!r} registered" + (f" (as {name!r})" if name != model else ""))
        _layout_readable(rep, registered_models(status)[name], model)
    else:
        rep.add(FAIL, f"LMCache has no KV layout registered for {model!r} (registered: "
                      f"{sorted(registered_models(status))})",
                "start vLLM with the LMCacheMPConnector pointing at this LMCache server: " + VLLM_HINT)
    if not queries:
        return
    q_models = {e.get("model_name") for e in (status.get("q_context_meta") or {}).values() if isinstance(e, dict)}
    if {model, f"{model}##query", name, f"{name}##query"} & q_models:
        rep.add(OK, f"LMCache has a query ring registered for {model!r}")
    else:
        rep.add(WARN, f"no query ring registered for {model!r} in LMCache; {', '.join(_query_aware())} need queries",
                "start LMCache with --enable transfer_query and vLLM (patched) with "
                "\"lmcache.mp.transfer_intermediate_tensors\": true; or use --no-queries for "
                f"{', '.join(_query_free())}", queries=True)


def _query_free() -> list[str]:
    return policy_names("kv")


def _query_aware() -> list[str]:
    return [n for n in policy_names() if n not in _query_free() and not get_policy(n).per_head_only]


def _per_head_only() -> list[str]:
    """Policies that select per KV head whatever is asked (AdaKV, PyramidKV): no serving setup runs them."""
    return [n for n in policy_names() if get_policy(n).per_head_only]


def _policies(rep: Report, no_queries: bool) -> None:
    """The summary: which registered policies this setup can run."""
    free, aware = _query_free(), _query_aware()
    if rep.kv_failed:
        rep.add(WARN, "policies this setup can run: none until the failures above are fixed")
        return
    rep.add(OK, f"query-free policies can run (no query patch, no transfer_query): {', '.join(free)}")
    if no_queries:
        rep.add(WARN, f"not checked (--no-queries): {', '.join(aware)}, which need query tensors")
    elif rep.query_issue:
        rep.add(WARN, f"policies that need query tensors may not run: {', '.join(aware)} ({rep.query_issue})")
    else:
        rep.add(OK, f"policies that need query tensors can run: {', '.join(aware)}")
    if _per_head_only():  # LMCache stores one token list per request: one kept set per request only
        rep.add(WARN, f"per-KV-head policies need the hf engine (LMCache stores one token list per request): "
                      f"{', '.join(_per_head_only())}")


def _layout_readable(rep: Report, entry: dict, model: str) -> None:
    """Whether LMCache's SDK can read the KV layout vLLM registered.

    LMCache's SDK (0.5.6) reads each kernel group's `engine_kv_concrete_shape`, e.g. `"2 x [16384, 2, 128,
    32]"`, by splitting it at `[`. For vLLM's CPU backend (fused K/V, engine KV format `NL_X_NB_NH_BS_CS`) an
    unpatched LMCache server publishes `"Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)"` instead, and the SDK's
    connect fails with "failed to decode KV cache layout" (tests/repro_lmcache_cpu_fused_layout.py): FAIL,
    the fix is tdutils' LMCache patch. A published fused layout is OK (the lmcache engine re-shapes its
    blocks, `tdutils.serving.kvlayout`), with a warning when it is not float32 (the only dtype whose CPU
    packing was measured, docs/design.md §6).
    """
    groups = (entry.get("kv_cache_layout") or {}).get("kernel_groups") or []
    bad = [g for g in groups if "[" not in str(g.get("engine_kv_concrete_shape", "["))]
    if bad:
        g = bad[0]
        rep.add(FAIL, f"LMCache cannot describe the KV layout vLLM registered for {model!r}: engine KV format "
                      f"{g.get('engine_kv_format')} ({g.get('attention_backend')}), concrete shape "
                      f"{g.get('engine_kv_concrete_shape')!r}; LMCache's SDK cannot connect to it, so the lmcache "
                      f"engine cannot edit this cache",
                "lmcache 0.5.6 needs tdutils' patch for the fused K/V layout of vLLM's CPU backend: python -m "
                "tdutils patches apply --target lmcache --python PY-OF-THE-SERVERS-ENVIRONMENT, then restart LMCache "
                "and vLLM")
        return
    fused = [g for g in groups if g.get("engine_kv_format") in FUSED_FORMATS]
    if not fused:
        return
    g = fused[0]
    line = (f"LMCache describes the fused K/V layout vLLM registered for {model!r}: {g.get('engine_kv_format')}, "
            f"{g.get('engine_kv_concrete_shape')}, {g.get('dtype')}; the lmcache engine re-shapes its blocks "
            f"(K transposed then V per block and head, as vLLM's CPU backend writes them)")
    if str(g.get("dtype")) in ("torch.float32", "float32"):
        rep.add(OK, line)
    else:
        rep.add(WARN, line + f"; measured in float32 only, vLLM-CPU packs {g.get('dtype')} blocks differently",
                "serve with --dtype float32 on the CPU")


def _token_ids(rep: Report, url: str, model: str, timeout: float) -> None:
    prompt = [1, 2, 3]
    try:  # real token ids of a short text, when vLLM offers /tokenize
        tokens = http_json("POST", url + "/tokenize", timeout=timeout, body={"model": model, "prompt": "Hello"})
        prompt = [int(t) for t in tokens["tokens"]] or prompt
    except (ServerError, KeyError, TypeError, ValueError):
        pass
    try:
        with make_post_completion(url, model, timeout=6 * timeout, connect_timeout=min(timeout, 5.0),
                                  extra_body={}) as post:
            ids = [ev.token_id for ev in post(prompt, {"max_tokens": 2, "temperature": 0, "ignore_eos": True}, "")]
            usage = post.last_result.usage if post.last_result else None
    except CompletionError as exc:
        fix = ("start vLLM with --return-tokens-as-token-ids" if "return-tokens-as-token-ids" in str(exc)
               else VLLM_HINT)
        rep.add(FAIL, f"test completion failed: {exc}", fix)
        return
    if len(ids) != 2:
        rep.add(FAIL, f"test completion returned {len(ids)} token ids for max_tokens=2", VLLM_HINT)
        return
    rep.add(OK, f"completions stream token ids ({ids}); usage {'matches' if usage else 'not reported'}")


def check_vllm_python(python: str) -> str:
    """`python` (`--vllm-python`) after checking it names an executable file (a bare name is looked up on PATH).

    Raises:
        UsageError: it does not exist, is a folder, or is not executable; the message says what to pass.
    """
    import shutil

    want = ("pass the Python interpreter of vLLM's environment, e.g. --vllm-python /path/to/vllm-venv/bin/python, "
            "or vLLM's package folder with --vllm-dir")
    if os.sep not in python and (os.altsep is None or os.altsep not in python):  # a command name: found on PATH
        if shutil.which(python) is None:
            raise UsageError(f"--vllm-python {python!r} is not a command on PATH; {want}")
        return python
    if not os.path.exists(python):
        raise UsageError(f"--vllm-python {python!r} does not exist; {want}")
    if os.path.isdir(python):
        raise UsageError(f"--vllm-python {python!r} is a folder, not an interpreter (a venv's is its bin/python); "
                         f"{want}")
    if not os.access(python, os.X_OK):
        raise UsageError(f"--vllm-python {python!r} is not executable; {want}")
    return python


def run(args, out=None) -> int:
    """Run every check; print one line each (with a fix for failures); 0 if none failed, else 1.

    Raises:
        ValueError: `--timeout` is not a finite number > 0; `--vllm-url` or `--lmcache-http-url` is not an http(s)
            URL (`check_http_url`); `--vllm-python` is not an executable file
            (`check_vllm_python`) or `--vllm-dir` not a folder (checked before any server is asked).
    """
    if not 0 < args.timeout < float("inf"):
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if args.vllm_python is not None:
        check_vllm_python(args.vllm_python)
    if args.vllm_dir is not None and not os.path.isdir(args.vllm_dir):
        raise UsageError(f"--vllm-dir {args.vllm_dir!r} is not a folder; pass vLLM's package folder (e.g. "
                         f"/path/to/site-packages/vllm), or its interpreter with --vllm-python")
    check_server_urls(vars(args))
    rep = Report(out)
    vllm_url = args.vllm_url.rstrip("/").removesuffix("/v1")
    lmc_url = args.lmcache_http_url.rstrip("/")
    status = _lmcache(rep, lmc_url, args.timeout)
    model, root = _vllm_model(rep, vllm_url, args.model, args.timeout)
    if model is not None:
        _vllm_version(rep, vllm_url, args.timeout)
    if not args.no_queries:
        _patch_state(rep, args.vllm_dir, args.vllm_python)
    if status is not None and model is not None:
        _registration(rep, status, model, root, not args.no_queries)
    if model is not None:
        _token_ids(rep, vllm_url, model, args.timeout)
    _policies(rep, args.no_queries)
    print("all checks passed" if not rep.failed else "some checks failed: fix them in order, then run doctor again",
          file=rep.out)
    return 1 if rep.failed else 0


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m tdutils doctor", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except Exception as exc:  # noqa: BLE001 - bad input in one line (exit 2), a bug with its traceback (exit 1)
        return report_error(exc, prog=ap.prog)


if __name__ == "__main__":
    sys.exit(main())
