"""The `lmcache` engine end to end against running servers, with the `hf` engine as reference; prints one JSON
report (test-only script).

Runs with the servers' Python (it has lmcache's SDK, which tdutils' own venv must not get) and tdutils on
PYTHONPATH; tests/test_servers.py starts it and checks the report. Flow on the serving path: open the
engine, prefill two bundled prompts (vLLM's LMCache connector stores their KV, and with the query-export
patch their queries, under the run's prefill salt), retrieve each request's KV and queries through the SDK,
drop half of every request's tokens with SnapKV, store the result under each request's own edit salt, then
let vLLM decode greedily from the edited caches. The same padded prompts go through the `hf` engine in
float32 (prefill, SnapKV, compact positions, greedy decode); the report carries both engines' kept indices
and output ids and the largest differences of the tensors SnapKV read. Then the same for R-KV (key
redundancy + window attention), under `"rkv"`; then decode-time compression (`decode(compression=...)`: cut to
one LMCache chunk every chunk of generated tokens, KNorm with the last 8 tokens kept) on both engines, under
`"rounds"`, with what a query-aware policy (SnapKV) gets in rounds on this LMCache.
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
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--round-tokens", type=int, default=300)
    args = ap.parse_args()

    import tdutils
    from tdutils.compression import Compression
    from tdutils.data import load_prompts
    from tdutils.kvcache import CacheKind
    from tdutils.policies import snapkv_scores

    eng = tdutils.open_engine("lmcache", vllm_url=args.vllm_url, lmcache_url=args.lmcache_url,
                              lmcache_http_url=args.lmcache_http_url, query_window=None, timeout=300,
                              http_timeout=30, retrieve_timeout=120, progress=False)
    try:
        fn = tdutils.make_drop_fn("snapkv", drop_ratio=0.5, model_config=eng.facts, window=args.window)
        eng.capture_for(fn)
        ids = eng.tokenize(load_prompts("sample", num_requests=2))
        lengths = eng.prefill(ids)
        padded = [list(r.tokens) for r in eng.requests]
        served = [eng.tensors(i) for i in range(len(padded))]
        keep_lm = [fn.keep_indices(t, tok).tolist() for t, tok in zip(served, padded)]
        report = eng.modify(fn)
        kept_lm = [eng.tokens(i) for i in range(len(padded))]
        outs = eng.decode(max_tokens=args.max_tokens)
        rkv = tdutils.make_drop_fn("rkv", drop_ratio=0.5, model_config=eng.facts)
        eng.capture_for(rkv)
        eng.prefill(ids)
        rkv_keep_lm = [rkv.keep_indices(eng.tensors(i), padded[i]).tolist() for i in range(len(padded))]
        eng.modify(rkv)
        rkv_kept_lm = [eng.tokens(i) for i in range(len(padded))]
        rkv_out = [o.output_ids for o in eng.decode(max_tokens=args.max_tokens)]
        rep = {"engine_kv_format": eng.engine_kv_format, "block_size": eng.block_size,
               "fused_arrangement": eng.fused_arrangement, "chunk_size": eng.chunk_size,
               "prompt_lengths": [len(x) for x in ids], "padded_lengths": lengths,
               "kv_shape": list(served[0][CacheKind.KV].shape), "query_shape": list(served[0][CacheKind.QUERY].shape),
               "edited": report.edited, "failures": report.failures, "salts": [r.salt for r in eng.requests],
               "cached_tokens": [o.cached_tokens for o in outs], "output_ids": [o.output_ids for o in outs],
               "finish_reasons": [o.finish_reason for o in outs], "keep_lmcache": keep_lm}
        # decode-time compression, LMCache's multi-round flow: cut to one chunk every chunk of new tokens
        comp = Compression("knorm", budget=eng.chunk_size, buffer=eng.chunk_size, window=8)
        eng.prefill(ids)
        rounds_out = eng.decode(max_tokens=args.round_tokens, compression=comp)
        rounds_cuts = eng.metrics.decode.compressions
        eng.prefill(ids)  # a query-aware policy needs LMCache to store the kept prefix's query rows
        try:
            eng.decode(max_tokens=args.round_tokens,
                       compression=Compression("snapkv", budget=eng.chunk_size, buffer=eng.chunk_size, window=8))
            query_rounds = "ran"
        except RuntimeError as exc:
            query_rounds = str(exc)
        rounds_rep = {"events": [[{k: e[k] for k in ("step", "before", "after")} for e in o.compressions]
                                 for o in rounds_out],
                      "kept": [[e["kept"] for e in o.compressions] for o in rounds_out],
                      "output_ids": [o.output_ids for o in rounds_out],
                      "compressions": rounds_cuts, "query_rounds": query_rounds}
    finally:
        eng.close()

    ref = tdutils.open_engine("hf", model="tiny-qwen3", dtype="float32", query_window=None, progress=False)
    ref.capture_for(fn)
    ref.prefill(padded)
    mine = [ref.tensors(i) for i in range(len(padded))]
    rep["keep_hf"] = [fn.keep_indices(t, tok).tolist() for t, tok in zip(mine, padded)]
    for kind, name in ((CacheKind.KV, "kv"), (CacheKind.QUERY, "query")):
        diffs = []
        for a, b in zip(served, mine):
            x, y = a[kind].float(), b[kind].float()
            x = x[0] if x.dim() == 4 and kind is CacheKind.QUERY else x
            y = y[0] if y.dim() == 4 and kind is CacheKind.QUERY else y
            t = min(x.shape[-2], y.shape[-2])
            diffs.append(float((x[..., -t:, :] - y[..., -t:, :]).abs().max()))
        rep[f"max_abs_diff_{name}"] = max(diffs)
    def scores(t):
        q = t[CacheKind.QUERY]
        return snapkv_scores(t[CacheKind.KV].float(), (q[0] if q.dim() == 4 else q).float(),
                             head_dim=ref.config.head_dim, window=args.window)

    rep["max_abs_diff_snapkv_scores"] = max(float((scores(a) - scores(b)).abs().max()) for a, b in zip(served, mine))
    ref.modify(fn)
    rep["kept_equal"] = [ref.tokens(i) == kept_lm[i] for i in range(len(padded))]
    rep["output_ids_hf"] = [o.output_ids for o in ref.decode(max_tokens=args.max_tokens)]

    ref.capture_for(rkv)
    ref.prefill(padded)
    keep_hf = [rkv.keep_indices(ref.tensors(i), padded[i]).tolist() for i in range(len(padded))]
    ref.modify(rkv)
    rep["rkv"] = {"keep_lmcache": rkv_keep_lm, "keep_hf": keep_hf,
                  "kept_equal": [ref.tokens(i) == rkv_kept_lm[i] for i in range(len(padded))],
                  "output_ids": rkv_out, "output_ids_hf": [o.output_ids for o in ref.decode(max_tokens=args.max_tokens)]}
    ref.prefill(padded)
    hf_rounds = ref.decode(max_tokens=args.round_tokens, compression=comp)
    rounds_rep["events_hf"] = [[{k: e[k] for k in ("step", "before", "after")} for e in o.compressions]
                               for o in hf_rounds]
    rounds_rep["kept_hf"] = [[e["kept"] for e in o.compressions] for o in hf_rounds]
    rounds_rep["output_ids_hf"] = [o.output_ids for o in hf_rounds]
    rep["rounds"] = rounds_rep
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
