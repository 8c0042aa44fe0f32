"""Contract tests of the `lmcache` engine against stand-ins of vLLM, the LMCache server and LMCache's SDK.

`Serving` below is a stand-in for the GPU serving stack: it plays vLLM's OpenAI-compatible server (a real
HTTP server on 127.0.0.1 streaming vLLM's format) *and* its LMCache MP connector (storing each prompt's
KV and query chunks, loading cached chunks before computing the rest), running the bundled tiny model on
the CPU, plus the LMCache server's HTTP API. `StandInContext` replaces
`lmcache.sdk.context.LMCacheSDKContext` and `StandInRequestStream` replaces
`lmcache.sdk.request.LMCacheRequestStream`; both follow the rules the SDK 0.5.6 documents.
"""

import inspect
import threading
import time
import types
import warnings
from contextlib import contextmanager

import pytest
import torch
from standins import closed_port_url, models_route, serve

import tdutils
from tdutils import CacheKind, DropFunctionError, make_drop_fn
from tdutils.attention import QueryRecorder, capture_implementation, recording
from tdutils.engines.hf import HFEngine
from tdutils.engines.lmcache import LMCacheEngine, QueryCheckError
from tdutils.models import TINY_MODEL_DIR
from tdutils.serving.kvlayout import fused_to_kv, kv_to_fused
from tdutils.serving.probes import ServerError

MODEL = "tiny"


class Backend:
    """The LMCache server's storage, as a stand-in: whole chunks keyed by (namespace, salt, token prefix)."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.chunks = {}

    def put(self, ns, salt, tokens, tensor, first_chunk: int = 0) -> bool:
        """Store the whole chunks of `tensor` (rows of tokens from chunk `first_chunk` on); True if any was new."""
        c, new = self.chunk_size, False
        keys = self._keys(ns, salt, tokens, first_chunk + tensor.shape[2] // c)
        for j in range(tensor.shape[2] // c):
            key = keys[first_chunk + j]
            if key not in self.chunks:
                self.chunks[key] = tensor[:, :, j * c:(j + 1) * c].clone()
                new = True
        return new

    def _keys(self, ns, salt, tokens, n_chunks):
        """Chained chunk keys, as LMCache hashes them: chunk i's key covers every token before its end."""
        keys, h, c = [], hash((ns, salt)), self.chunk_size
        for i in range(min(n_chunks, len(tokens) // c)):
            h = hash((h, tuple(tokens[i * c:(i + 1) * c])))
            keys.append(h)
        return keys

    def get(self, ns, salt, tokens):
        """The longest cached chunk-aligned prefix of `tokens` (chunks concatenated), or None."""
        parts = []
        for key in self._keys(ns, salt, tokens, len(tokens)):
            part = self.chunks.get(key)
            if part is None:
                break
            parts.append(part)
        return torch.cat(parts, dim=2) if parts else None


def _namespace(kind, model):
    return f"{model}##query" if kind == CacheKind.QUERY else model


class StandInContext:
    """Stand-in for `lmcache.sdk.context.LMCacheSDKContext` (the real one reaches the LMCache server over
    ZMQ/gRPC and shared memory). Same rules: retrieval is chunk-aligned and returns the longest cached
    prefix, None when nothing is cached (or fewer tokens than a chunk are asked for); `store` requires
    `len(tokens) == kv.shape[2]` and stores whole chunks only; the QUERY kind lives in the
    `{model}##query` namespace and comes back as `[1, L, T, Hq*d]`."""

    def __init__(self, backend: Backend, kind, model: str):
        self._backend, self.kind, self.namespace = backend, kind, _namespace(kind, model)

    @property
    def chunk_size(self) -> int:
        return self._backend.chunk_size

    def retrieve(self, tokens, cache_salt=""):
        if len(tokens) < self.chunk_size:
            return None
        return self._backend.get(self.namespace, cache_salt, list(tokens))

    def store(self, kv, tokens, cache_salt=""):
        if len(tokens) != kv.shape[2]:
            raise RuntimeError(f"Number of tokens ({len(tokens)}) does not match KV tensor's token dimension "
                               f"({kv.shape[2]}).")
        return self._backend.put(self.namespace, cache_salt, list(tokens), kv.detach().cpu())

    def close(self):
        pass


class StandInRequestStream:
    """Stand-in for `lmcache.sdk.request.LMCacheRequestStream`: `generate` calls post_completion with the
    stream's tokens and salt, appends the generated ids, and returns per-call metrics (ttft, tpot in s)."""

    def __init__(self, contexts, post_completion, prompt_token_ids, cache_salt=""):
        self.contexts, self.post_completion = list(contexts), post_completion
        self.tokens, self.cache_salt, self._text = list(prompt_token_ids), cache_salt, []

    @property
    def output_text(self):
        return "".join(self._text)

    def generate(self, sampling_params):
        events = self.post_completion(self.tokens, sampling_params, self.cache_salt)
        t0 = last = time.perf_counter()
        gaps, ids = [], []
        for ev in events:
            ids.append(ev.token_id)
            self._text.append(ev.text)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        self.tokens.extend(ids)
        return types.SimpleNamespace(duration=last - t0, input_tokens=len(self.tokens) - len(ids),
                                     output_tokens=len(ids), ttft=gaps[0] if gaps else 0.0, tpot=gaps[1:])


def standin_sdk(backend: Backend, connects: list):
    """A stand-in `lmcache.sdk` module: `connect`, `LMCacheSDKCacheKind`, `request.create_request`."""
    def connect(kind, url, http_url, model_name, timeout=60.0):
        connects.append((kind, url, http_url, model_name, timeout))
        return StandInContext(backend, kind, model_name)

    return types.SimpleNamespace(LMCacheSDKCacheKind=CacheKind, connect=connect,
                                 request=types.SimpleNamespace(create_request=StandInRequestStream))


class Serving:
    """Stand-in for vLLM + its LMCache MP connector + the LMCache server's HTTP API, on the tiny model.

    A completion loads the longest cached chunk-aligned prefix stored under the request's salt (at most
    all prompt tokens but the last), computes the rest of the prompt at positions `n..T-1`, stores the
    prompt's whole KV chunks and the query chunks it computed, then decodes greedily and streams the ids
    (two tokens per SSE chunk, a usage chunk, `[DONE]`).
    """

    def __init__(self, tiny, chunk_size: int, *, shift_queries: bool = False, registered: bool = True,
                 export_queries: bool = True, fused: str | None = None, block_size: int = 4):
        self.model, self.tok = tiny
        self.model.set_attn_implementation(capture_implementation(self.model.config._attn_implementation))
        self.backend = Backend(chunk_size)
        self.shift_queries, self.registered = shift_queries, registered
        self.export_queries = export_queries  # False: a stock vLLM without the query-export patch
        # A fused K/V cache (vLLM's CPU backend): LMCache holds block rows `[1, L, T, H*2d]`, packed as `fused`
        # says ("kt_v": vLLM-CPU; "k_v": K|V per token; "scrambled": neither), with `block_size` tokens a block.
        self.fused, self.block_size = fused, block_size
        self.lock = threading.Lock()
        self.clears = 0
        self.completions = []  # (prompt, salt, loaded tokens)
        sig = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in sig else "past_key_values"

    @torch.inference_mode()
    def complete(self, prompt, salt, max_tokens):
        from transformers import DynamicCache

        m, c = self.model, self.backend.chunk_size
        L = m.config.num_hidden_layers
        H, d = m.config.num_key_value_heads, m.config.head_dim
        hit = self.backend.get(MODEL, salt, prompt)
        if hit is not None and self.fused:
            hit = fused_to_kv(hit, block_size=self.block_size, num_kv_heads=H, head_dim=d,
                              arrangement="k_v" if self.fused == "k_v" else "kt_v")
        n = 0 if hit is None else min(hit.shape[2], len(prompt) - 1)
        self.completions.append((list(prompt), salt, n))
        cache = DynamicCache(config=m.config)
        if n:
            kv = hit[:, :, :n].view(2, L, n, H, d).transpose(2, 3)  # [2, L, H, n, d]
            for layer in range(L):
                cache.update(kv[0, layer][None], kv[1, layer][None], layer)
        rec = QueryRecorder(None)
        ids = torch.tensor([prompt[n:]])
        with recording(rec):
            out = m(input_ids=ids, position_ids=torch.arange(n, len(prompt))[None],
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long), use_cache=True,
                    **{self.cache_kw: cache})
        T = len(prompt)
        k = torch.stack([lay.keys[0].transpose(0, 1).reshape(T, -1) for lay in cache.layers])
        v = torch.stack([lay.values[0].transpose(0, 1).reshape(T, -1) for lay in cache.layers])
        self.backend.put(MODEL, salt, prompt, self._engine_layout(torch.stack([k, v])))
        first = -(-n // c)  # query chunks computed whole in this pass
        q = torch.stack([rec.layers[i][0].transpose(0, 1).reshape(T - n, -1) for i in range(L)])[None]
        if self.shift_queries:  # fault injection: every row one token late (mixed-up rows)
            q = torch.roll(q, 1, dims=2)
        if self.export_queries:
            self.backend.put(f"{MODEL}##query", salt, prompt, q[:, :, first * c - n:], first_chunk=first)
        out_ids, pos = [], T
        logits = out.logits[0, -1]
        for _ in range(max_tokens):
            tok = int(logits.argmax())
            out_ids.append(tok)
            step = m(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]),
                     attention_mask=torch.ones(1, pos + 1, dtype=torch.long), use_cache=True,
                     **{self.cache_kw: cache})
            logits, pos = step.logits[0, -1], pos + 1
        return out_ids

    def _engine_layout(self, kv):
        """`[2, L, T, D]` -> what LMCache holds for this engine (unchanged, or fused block rows of whole chunks)."""
        if not self.fused:
            return kv
        c = self.backend.chunk_size
        m = self.model.config
        rows = kv_to_fused(kv[:, :, :kv.shape[2] // c * c], block_size=self.block_size, num_kv_heads=m.num_key_value_heads,
                           head_dim=m.head_dim, arrangement="k_v" if self.fused == "k_v" else "kt_v")
        return rows.flip(-1) if self.fused == "scrambled" else rows

    def routes(self):
        from standins import chunk, usage_chunk

        def completions(h, body):
            with self.lock:
                ids = self.complete(body["prompt"], body.get("cache_salt", ""), body["max_tokens"])
            h.start_sse()
            for i in range(0, len(ids), 2):
                part = ids[i:i + 2]
                h.write_line(chunk(part, self.tok.decode(part), "length" if i + 2 >= len(ids) else None))
                h.write_line("")
            h.write_line(usage_chunk(len(body["prompt"]), len(ids)))
            h.write_line("")
            h.write_line("data: [DONE]")

        def clear(h, body):
            self.backend.chunks.clear()
            self.clears += 1
            h.send_json(200, {"status": "ok", "cleared": {"tier": "l1"}})

        layout = {"num_layers": 2}
        if self.fused:
            layout["kernel_groups"] = [{"engine_kv_format": "NL_X_NB_NH_BS_CS", "tokens_per_block": self.block_size,
                                        "dtype": "torch.float32", "engine_kv_concrete_shape": "2 x [64, 2, 4, 64]"}]
        meta = {"1": {"model_name": MODEL, "world_size": 1, "kv_cache_layout": layout}}
        return {
            ("GET", "/v1/models"): models_route(MODEL, 4096, root=str(TINY_MODEL_DIR)),
            ("POST", "/v1/completions"): completions,
            ("GET", "/version"): lambda h, b: h.send_json(200, {"version": "0.25.1"}),
            ("GET", "/healthcheck"): lambda h, b: h.send_json(200, {"status": "healthy"}),
            ("GET", "/config"): lambda h, b: h.send_json(200, {"mp": {"chunk_size": self.backend.chunk_size}}),
            ("GET", "/status"): lambda h, b: h.send_json(200, {"cache_context_meta": meta if self.registered else {}}),
            ("POST", "/cache/clear"): clear,
        }


@contextmanager
def engine(tiny, chunk_size=16, serving_kw=None, **kw):
    serving = Serving(tiny, chunk_size, **(serving_kw or {}))
    connects = []
    with serve(serving.routes()) as (url, log):
        eng = tdutils.open_engine("lmcache", vllm_url=url, lmcache_http_url=url, lmcache_url="tcp://127.0.0.1:1",
                                  sdk=standin_sdk(serving.backend, connects), timeout=30, **kw)
        eng.serving, eng.connects, eng.log = serving, connects, log
        try:
            yield eng
        finally:
            eng.close()


# ---------------------------------------------------------------- the stand-in context follows the SDK rules


def test_standin_context_follows_the_sdk_rules():
    backend = Backend(4)
    kv_ctx, q_ctx = StandInContext(backend, CacheKind.KV, "m"), StandInContext(backend, CacheKind.QUERY, "m")
    assert q_ctx.namespace == "m##query"
    assert kv_ctx.retrieve([1, 2, 3, 4, 5]) is None  # nothing cached
    with pytest.raises(RuntimeError, match="does not match"):
        kv_ctx.store(torch.zeros(2, 1, 5, 2), [1, 2, 3])
    assert kv_ctx.store(torch.ones(2, 1, 6, 2), [1, 2, 3, 4, 5, 6], "s")
    assert kv_ctx.retrieve([1, 2, 3], "s") is None  # fewer than a chunk
    assert kv_ctx.retrieve([1, 2, 3, 4, 5, 6, 7, 8], "s").shape == (2, 1, 4, 2)  # whole chunks only
    assert kv_ctx.retrieve([1, 2, 3, 4], "other") is None and q_ctx.retrieve([1, 2, 3, 4], "s") is None


# ---------------------------------------------------------------- servers absent or not set up


def test_absent_servers_fail_fast_with_the_start_commands():
    down = closed_port_url()
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError, match="lmcache server --l1-size-gb.*--enable transfer_query"):
        tdutils.open_engine("lmcache", vllm_url=down, lmcache_http_url=down, http_timeout=2)
    with serve({("GET", "/healthcheck"): lambda h, b: h.send_json(200, {"status": "healthy"})}) as (url, _), \
            pytest.raises(ServerError, match="vllm serve MODEL.*--return-tokens-as-token-ids.*LMCacheMPConnector"):
        tdutils.open_engine("lmcache", vllm_url=down, lmcache_http_url=url, http_timeout=2)
    assert time.perf_counter() - t0 < 10


def test_unserved_or_unregistered_model_and_missing_sdk(tiny):
    serving = Serving(tiny, 16)
    with serve(serving.routes()) as (url, _):
        with pytest.raises(ValueError, match=r"does not serve 'other'; it serves \['tiny'\]"):
            LMCacheEngine("other", vllm_url=url, lmcache_http_url=url, sdk=standin_sdk(serving.backend, []))
        try:
            import lmcache  # noqa: F401
        except ImportError:
            with pytest.raises(ImportError, match=r"pip install 'tdutils\[lmcache\]'"):
                LMCacheEngine(vllm_url=url, lmcache_http_url=url)
        serving.registered = False
        with pytest.raises(ValueError, match="no KV layout registered for 'tiny'.*LMCacheMPConnector"):
            LMCacheEngine(vllm_url=url, lmcache_http_url=url, sdk=standin_sdk(serving.backend, []))
    with pytest.raises(ValueError, match="positions='compact'"):
        LMCacheEngine(positions="original")


# ---------------------------------------------------------------- the serving path end to end


def test_padding_puts_the_true_end_of_the_prompt_in_the_window(tiny, sample_ids):
    seen = []

    def select(tensors, tokens):
        seen.append((tensors[CacheKind.KV].shape, tensors[CacheKind.QUERY].shape, list(tokens)))
        return torch.arange(len(tokens))[::2].sort().values.unique()

    with engine(tiny, 16, query_window=32) as eng:
        assert eng.chunk_size == 16 and eng.facts.num_layers == 2
        assert [(k.value, model) for k, _, _, model, _ in eng.connects] == [("kv", MODEL), ("query", MODEL)]
        lengths = eng.prefill(sample_ids)
        assert all(n % 16 == 0 and n - len(x) < 16 for n, x in zip(lengths, sample_ids))
        fn = make_drop_fn(select, drop_ratio=0.5, model_config=eng.facts)
        report = eng.modify(fn)
        assert report.edited == 3 and not report.failures
        for (kv_shape, q_shape, tokens), x, n in zip(seen, sample_ids, lengths):
            assert kv_shape == (2, 2, n, 64) and q_shape == (2, 32, 128)
            assert tokens[-len(x):] == x  # every prompt token, the question at the end included
            assert set(tokens[:n - len(x)]) <= {eng.pad_token_id}
        outs = eng.decode(max_tokens=5)
    assert [len(o.output_ids) for o in outs] == [5, 5, 5] and all(o.finish_reason == "length" for o in outs)
    assert [o.cached_tokens for o in outs] == [(n + 1) // 2 for n in lengths]


def test_distinct_salts_cache_clears_and_no_leak_to_unsalted_requests(tiny, sample_ids):
    with engine(tiny, 16) as eng:
        fn = make_drop_fn("random", drop_ratio=0.5, model_config=eng.facts, seed=1)
        res = tdutils.run_once(eng, sample_ids, name="random", drop_fn=fn, max_tokens=3)
        first_run = eng.run_id
        salts = [c[1] for c in eng.serving.completions]
        assert salts[:3] == [f"tdutils-{first_run}-prefill"] * 3
        assert sorted(salts[3:]) == [f"tdutils-{first_run}-edit-{i}" for i in range(3)]  # one edit salt per request
        assert all(loaded > 0 for _, _, loaded in eng.serving.completions[3:])  # decode read the edited cache
        assert eng.serving.clears == 1
        # A later, unsalted request with the kept tokens finds nothing cached: no edited KV leaks to it.
        kept = eng.serving.completions[3][0]
        assert eng.serving.backend.get(MODEL, "", kept) is None
        tdutils.run_once(eng, sample_ids, name="baseline", max_tokens=3)
        assert eng.serving.clears == 2 and eng.run_id != first_run
        assert res.metrics.modify.edited == 3 and res.metrics.decode.output_tokens == 9
        assert len(res.metrics.prefill.ttft_s) == 3 and res.metrics.prefill.tokens % 16 == 0


def test_drop_functions_run_unchanged_and_decode_like_the_hf_engine(tiny, sample_ids):
    """With chunk size 1 the serving path loads all but the last prompt token and recomputes that one,
    which is exactly what the hf engine does; so greedy outputs must agree, for the baseline and after
    dropping with the same drop function objects."""
    model, tok = tiny
    ids = [x[:n] for x, n in zip(sample_ids, (120, 75, 150))]
    hf = HFEngine(model, tokenizer=tok, prefill_batch_size=1, max_batch_size=1, progress=False)
    fns = [None] + [make_drop_fn(p, drop_ratio=0.5, model_config=model.config, **kw) for p, kw in
                    (("random", {"seed": 3}), ("middle_chunk", {"chunk_size": 32}), ("snapkv", {"window": 16}))]
    with engine(tiny, 1) as eng:
        for fn in fns:
            a = tdutils.run_once(hf, ids, drop_fn=fn, max_tokens=5).outputs
            b = tdutils.run_once(eng, ids, drop_fn=fn, max_tokens=5).outputs
            assert [o.output_ids for o in a] == [o.output_ids for o in b], getattr(fn, "name", "baseline")
            assert [o.cached_tokens for o in a] == [o.cached_tokens for o in b]


def test_query_free_policies_run_without_query_export(tiny, sample_ids):
    """KNorm, KeyDiff and StreamingLLM read the KV only: with no query context (query_window=0, no
    transfer_query) they run; against a vLLM that exports no queries (unpatched) a query context that stays
    empty is never waited for. A policy that needs queries is refused before any work."""
    fns = [make_drop_fn(p, drop_ratio=0.5, model_config=tiny[0].config) for p in ("knorm", "keydiff", "streaming_llm")]
    with engine(tiny, 16, query_window=0) as eng:
        assert [k.value for k, *_ in eng.connects] == ["kv"]  # no QUERY context
        for fn in fns:
            res = tdutils.run_once(eng, sample_ids, name=fn.name, drop_fn=fn, max_tokens=2)
            assert res.metrics.modify.edited == 3 and res.metrics.decode.output_tokens == 6, fn.name
        with pytest.raises(ValueError, match="snapkv needs query tensors, but this lmcache engine has none"):
            tdutils.run_once(eng, sample_ids, drop_fn=make_drop_fn("snapkv", drop_ratio=0.5,
                                                                   model_config=tiny[0].config), max_tokens=2)
    with engine(tiny, 16, serving_kw={"export_queries": False}, retrieve_timeout=5) as eng:
        assert eng.q_ctx is not None
        t0 = time.perf_counter()
        res = tdutils.run_once(eng, sample_ids, drop_fn=fns[0], max_tokens=2)
        assert res.metrics.modify.edited == 3 and res.metrics.modify.seconds < 5, time.perf_counter() - t0


def test_compare_gives_the_phase_table(tiny, sample_ids):
    with engine(tiny, 16, kv_budget_tokens=700) as eng:
        fn = make_drop_fn("random", drop_ratio=0.5, model_config=eng.facts)
        _, table = tdutils.compare(eng, sample_ids, {"random@0.5": fn}, max_tokens=4)
    assert list(table.index) == ["baseline", "random@0.5"]
    assert table.loc["random@0.5", "kept_fraction"] < 0.6 and table.loc["baseline", "decode_tokens"] == 12
    assert table.loc["baseline", "kv_peak_reserved_tokens"] <= 700 and table.loc["baseline", "peak_batch"] >= 1


def test_mixed_up_query_rows_are_caught_before_scoring(tiny, sample_ids):
    calls = []

    def select(tensors, tokens):
        calls.append(1)
        return torch.arange(len(tokens) // 2)

    with engine(tiny, 16, serving_kw={"shift_queries": True}) as eng:
        eng.prefill(sample_ids)
        fn = make_drop_fn(select, drop_ratio=0.5, model_config=eng.facts)
        with pytest.raises(QueryCheckError, match="query rows are mixed up or shifted"):
            eng.modify(fn)
        assert not calls
        eng.decode(max_tokens=2)  # nothing was switched: decoding uses the prefill salt
        assert all(salt.endswith("-prefill") for _, salt, _ in eng.serving.completions)


def test_correct_rows_pass_the_layer0_check(tiny, sample_ids):
    with engine(tiny, 16) as eng:
        eng.prefill(sample_ids[:1])
        t = eng.tensors(0)
        assert eng.check_query_rows(t[CacheKind.KV], t[CacheKind.QUERY], eng.tokens(0)) == "layer0"
        kv = t[CacheKind.KV].clone()
        kv[:, :, -1] = kv[:, :, -2]  # the last key row copied from its neighbour
        with pytest.raises(QueryCheckError, match="KV rows are mixed up"):
            eng.check_query_rows(kv, None, eng.tokens(0))


def _snapshot(eng):
    """Each request's cache as the engine serves it: (token ids, salt, stored KV fetched from LMCache)."""
    return [(eng.tokens(i), eng.requests[i].salt, eng.kv(i)) for i in range(len(eng.requests))]


def test_a_failing_drop_function_changes_no_cache_or_skips(tiny, sample_ids):
    def select(tensors, tokens):
        if len(tokens) > 300:
            raise RuntimeError("boom")
        return torch.arange(len(tokens) // 2)

    with engine(tiny, 16, retrieve_timeout=0.5) as eng:
        eng.prefill(sample_ids)
        before = _snapshot(eng)  # taken before modify: the check below compares two states, not one twice
        fn = make_drop_fn(select, drop_ratio=0.5, model_config=eng.facts)
        with pytest.raises(DropFunctionError, match="failed on 1 of 3 requests; no cache was changed"):
            eng.modify(fn)
        after = _snapshot(eng)
        for i, ((tok0, salt0, kv0), (tok1, salt1, kv1)) in enumerate(zip(before, after)):
            assert tok1 == tok0 and salt1 == salt0, f"request {i}: tokens or salt changed by a failed modify"
            assert torch.equal(kv1, kv0), f"request {i}: stored KV changed by a failed modify"
        assert all(not r.edited for r in eng.requests)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = eng.modify(fn, on_error="skip")
        assert report.edited == 2 and [i for i, _ in report.failures] == [2]
        skipped = _snapshot(eng)
        assert skipped[2][0] == before[2][0] and torch.equal(skipped[2][2], before[2][2])  # the failed one: as it was
        assert [len(skipped[i][0]) for i in (0, 1)] == [len(before[i][0]) // 2 for i in (0, 1)]
        outs = eng.decode(max_tokens=2)
        assert outs[2].cached_tokens == 304 and outs[0].cached_tokens < 200
        with pytest.raises(ValueError, match="rerotate=True"):
            eng.modify(make_drop_fn("random", drop_ratio=0.5, rerotate=False))
        with pytest.raises(ValueError, match="keep_logits"):
            eng.decode(max_tokens=2, keep_logits=True)


def test_edited_requests_sharing_leading_kept_chunks_each_get_their_own_kv(tiny, sample_ids):
    """Two prompts that differ only in the 32 tokens a drop function removes: their kept token ids share two
    whole 16-token chunks, but those tokens' KV (layer 1 onwards) was computed in different contexts. LMCache
    keys a chunk by its token prefix and salt, so under one shared edit salt the second store would find the
    first request's chunks already cached and request 1 would decode from request 0's KV."""
    shared, tails = sample_ids[2][:32], (sample_ids[2][32:48], sample_ids[2][48:64])
    prompts = [sample_ids[0][:32] + shared + tails[0], sample_ids[1][:32] + shared + tails[1]]
    assert prompts[0][:32] != prompts[1][:32] and all(len(p) == 80 for p in prompts)
    edited = []

    def keep_after_context(tensors, tokens):
        return torch.arange(32, len(tokens))

    fn = make_drop_fn(keep_after_context, drop_ratio=0.4, model_config=tiny[0].config)

    def recording_fn(tensors, tokens):
        out = fn(tensors, tokens)
        edited.append(out)
        return out

    recording_fn.rerotate = True
    with engine(tiny, 16) as eng:
        assert eng.prefill(prompts) == [80, 80]  # whole chunks: no padding
        report = eng.modify(recording_fn)
        assert report.edited == 2
        (kv0, ids0), (kv1, ids1) = edited
        assert ids0[:32] == ids1[:32] == shared and ids0[32:] != ids1[32:]
        # the precondition: the shared kept tokens' KV differs between the two contexts
        assert not torch.equal(kv0[:, :, :32], kv1[:, :, :32])
        for i, (kv, ids) in enumerate(edited):  # what each request will decode from is its own edited KV
            assert eng.tokens(i) == ids
            assert torch.equal(eng.kv(i), kv), f"request {i} is served another request's edited KV"
        assert eng.requests[0].salt != eng.requests[1].salt
        eng.decode(max_tokens=2)
        loaded = sorted((salt, n) for _, salt, n in eng.serving.completions[2:])  # streams run concurrently
        assert loaded == [(eng.edit_salt(0), 47), (eng.edit_salt(1), 47)]  # all but the last token from its own KV


@pytest.mark.parametrize("packing", ["kt_v", "k_v"])
def test_a_fused_kv_cache_is_reshaped_both_ways(tiny, sample_ids, packing):
    """vLLM's CPU backend: LMCache holds block rows `[1, L, T, H*2d]`. The engine hands drop functions the
    per-token KV (equal to the hf engine's), finds the packing from layer-0 keys, stores edited KV back as
    block rows, and vLLM decodes from it as from any cache (same outputs as the hf engine)."""
    model, tok = tiny
    ids = [x[:n] for x, n in zip(sample_ids, (64, 48))]
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=model.config, window=8)
    hf = HFEngine(model, tokenizer=tok, prefill_batch_size=1, max_batch_size=1, query_window=None, progress=False)
    with engine(tiny, 8, serving_kw={"fused": packing, "block_size": 4}, query_window=None) as eng:
        assert (eng.fused, eng.block_size, eng.fused_arrangement) == (True, 4, "auto")
        eng.prefill(ids)
        padded = [list(r.tokens) for r in eng.requests]
        hf.prefill(padded)
        for i in range(len(ids)):
            assert torch.allclose(eng.kv(i), hf.kv(i)[:, :, :len(padded[i])], atol=1e-5)
        assert eng.fused_arrangement == packing
        eng.modify(fn)
        hf.modify(fn)
        for i, r in enumerate(eng.requests):  # stored as block rows under the edit salt; unfused = the edit
            stored = eng.serving.backend.get(MODEL, r.salt, r.tokens)
            assert stored.shape[0] == 1 and stored.shape[3] == 2 * model.config.num_key_value_heads * model.config.head_dim
            back = fused_to_kv(stored, block_size=4, num_kv_heads=model.config.num_key_value_heads,
                               head_dim=model.config.head_dim, arrangement=packing)
            n = back.shape[2]
            assert n == len(r.tokens) // 8 * 8 and torch.allclose(back, hf.kv(i)[:, :, :n], atol=1e-5)
        assert [r.tokens for r in eng.requests] == [hf.tokens(i) for i in range(len(ids))]
        out = eng.decode(max_tokens=4)
        assert [o.output_ids for o in out] == [o.output_ids for o in hf.decode(max_tokens=4)]


def test_a_fused_cache_of_unknown_packing_is_refused(tiny, sample_ids):
    with engine(tiny, 8, serving_kw={"fused": "scrambled", "block_size": 4}) as eng:
        eng.prefill([sample_ids[0][:40]])
        with pytest.raises(ValueError, match=r"matches no known arrangement \(layer-0 key cosine per arrangement: "
                                             r"\{'kt_v': -?\d\.\d+, 'k_v': -?\d\.\d+\}\)"):
            eng.kv(0)


# ---------------------------------------------------------------- decode-time compression: the multi-round flow


@pytest.mark.parametrize("policy", ["snapkv", "knorm"])
def test_multi_round_compression_cuts_what_the_hf_engine_cuts(tiny, sample_ids, policy):
    """decode -> prefill of what was fed -> retrieve KV and queries -> cut to B -> store -> continue: with chunk
    size 1 every cached entry is LMCache's, so each round keeps the sequence indices the hf engine's in-batch cut
    keeps, and the greedy tokens are the same."""
    from tdutils.compression import Compression

    model, tok = tiny
    ids = [x[:n] for x, n in zip(sample_ids, (40, 30, 52))]
    comp = Compression(policy, budget=24, buffer=10, window=4)
    hf = HFEngine(model, tokenizer=tok, progress=False)
    hf.prefill(ids)
    want = hf.decode(40, compression=comp)
    with engine(tiny, 1) as eng:
        eng.prefill(ids)
        got = eng.decode(40, compression=comp)
        assert eng.metrics.decode.compressions == sum(len(o.compressions) for o in got) >= 3 * 3
    for a, b in zip(want, got):
        assert [e["kept"] for e in a.compressions] == [e["kept"] for e in b.compressions], policy
        assert [(e["step"], e["before"], e["after"]) for e in a.compressions] == [
            (e["step"], e["before"], e["after"]) for e in b.compressions]
        assert a.output_ids == b.output_ids, policy


def test_multi_round_compression_refuses_sampling_and_a_small_budget(tiny, sample_ids):
    from tdutils.compression import Compression

    with engine(tiny, 1, kv_budget_tokens=30) as eng:
        eng.prefill([x[:20] for x in sample_ids])
        with pytest.raises(ValueError, match="greedy only"):
            eng.decode(8, temperature=0.7, compression=Compression("knorm", budget=16, buffer=4))
        with pytest.raises(ValueError, match="needs 31 KV tokens"):
            eng.decode(8, compression=Compression("knorm", budget=20, buffer=10))


def test_per_layer_and_per_head_sets_are_refused_in_one_line(tiny, sample_ids):
    """LMCache stores one token list per request: a per-layer / per-head drop function is refused before any
    cache is read, and the caches stay as they were."""
    with engine(tiny, 16) as eng:
        eng.prefill(sample_ids)
        before = _snapshot(eng)
        for granularity in ("layer", "head"):
            fn = make_drop_fn("knorm", drop_ratio=0.5, model_config=eng.facts, granularity=granularity)
            with pytest.raises(ValueError, match=f"granularity='request' only, got '{granularity}'"):
                eng.modify(fn)
        after = _snapshot(eng)
        assert all(a[0] == b[0] and torch.equal(a[2], b[2]) for a, b in zip(before, after))
        assert all(not r.edited for r in eng.requests)
