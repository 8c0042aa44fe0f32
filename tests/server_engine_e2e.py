"""The `lmcache` engine end to end against running servers; prints one JSON report (test-only script).

Runs with the servers' Python (it has lmcache's SDK, which tdutils' own venv must not get) and tdutils on
PYTHONPATH; tests/test_servers.py starts it and checks the report. Flow: open the engine, prefill two
bundled prompts (LMCache stores their KV under the run's prefill salt), retrieve one request's KV, drop half
of every request's tokens with the `random` policy (no queries needed, so vLLM needs no patch) and store
the result under each request's own edit salt, then decode from the edited caches.
"""

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-url", required=True)
    ap.add_argument("--lmcache-url", required=True)
    ap.add_argument("--lmcache-http-url", required=True)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    import tdutils
    from tdutils.data import load_prompts

    eng = tdutils.open_engine("lmcache", vllm_url=args.vllm_url, lmcache_url=args.lmcache_url,
                              lmcache_http_url=args.lmcache_http_url, query_window=0, timeout=120,
                              http_timeout=20, retrieve_timeout=60, progress=False)
    try:
        rows = load_prompts("sample", num_requests=2)
        ids = eng.tokenize(rows)
        lengths = eng.prefill(ids)
        kv = eng.kv(0)
        fn = tdutils.make_drop_fn("random", drop_ratio=0.5, model_config=eng.config, seed=0)
        report = eng.modify(fn)
        outs = eng.decode(max_tokens=args.max_tokens)
        print(json.dumps({
            "chunk_size": eng.chunk_size, "prompt_lengths": [len(x) for x in ids], "padded_lengths": lengths,
            "kv_shape": list(kv.shape), "edited": report.edited, "failures": report.failures,
            "salts": sorted({r.salt for r in eng.requests}), "cached_tokens": [o.cached_tokens for o in outs],
            "output_ids": [o.output_ids for o in outs], "finish_reasons": [o.finish_reason for o in outs]}))
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
