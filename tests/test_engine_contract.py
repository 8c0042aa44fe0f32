"""The engine contract (`tdutils.engines.base.Engine`): required methods, the shared `modify`, snapshots, the
registry behind `open_engine` and the CLI's `--engine`, and a third engine written in one class."""

import pytest
import torch

from tdutils import CacheKind, DropFunctionError, make_drop_fn
from tdutils.engines import Engine, engine_kinds, open_engine, register_engine
from tdutils.engines.base import _ENGINES
from tdutils.engines.hf import HFEngine
from tdutils.outputs import ModifyReport, RequestOutput

pytestmark = pytest.mark.usefixtures("one_thread")


class _Req:
    def __init__(self, kv, tokens):
        self.kv, self.tokens = kv, tokens


class ListEngine(Engine):
    """A third engine in one class: caches are given, decode repeats the last cached token. Only the required
    methods and the `_edit_*` hooks are written; `modify`, `snapshot`, `tokenize`, `with` come from `Engine`."""

    def __init__(self, caches=(), tokenizer=None):
        self.tokenizer, self.requests, self.closed = tokenizer, [], False
        from tdutils.metrics import RunMetrics

        self.metrics = RunMetrics("run")
        self._caches = list(caches)

    def prefill(self, prompts):
        self.requests = [_Req(kv.clone(), list(p)) for kv, p in zip(self._caches, prompts)]
        return [len(p) for p in prompts]

    def decode(self, max_tokens=64, **kw):
        return [RequestOutput(i, len(r.tokens), len(r.tokens), [r.tokens[-1]] * max_tokens)
                for i, r in enumerate(self.requests)]

    def tensors(self, request_id):
        return {CacheKind.KV: self.requests[request_id].kv}

    def tokens(self, request_id):
        return list(self.requests[request_id].tokens)

    def close(self):
        self.closed = True

    def _check_modify(self, drop_fn, positions):
        return "compact"

    def _edit_input(self, request_id, drop_fn):
        r = self.requests[request_id]
        return {CacheKind.KV: r.kv.clone()}, list(r.tokens), r.kv

    def _edit_stage(self, request_id, new_kv, new_tokens, keep):
        return new_kv, new_tokens

    def _edit_commit(self, request_id, staged, positions):
        self.requests[request_id].kv, self.requests[request_id].tokens = staged


def _caches(lengths, L=2, D=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, L, n, D, generator=g) for n in lengths]


def test_the_contract_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Engine()

    class NoDecode(ListEngine):
        decode = Engine.decode

    with pytest.raises(TypeError, match="decode"):
        NoDecode()


def test_a_third_engine_gets_modify_all_or_nothing_and_the_registry():
    caches = _caches([6, 4])
    eng = ListEngine(caches)
    assert eng.prefill([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]) == [6, 4]

    def halve_or_fail(tensors, tokens):
        if len(tokens) == 4:
            raise RuntimeError("no")
        kv = tensors[CacheKind.KV]
        return kv[:, :, ::2].clone(), list(tokens[::2])

    with pytest.raises(DropFunctionError, match=r"failed on 1 of 2 requests; no cache was changed:\n  request 1: "
                                                r"RuntimeError: no"):
        eng.modify(halve_or_fail)
    assert [eng.tokens(i) for i in range(2)] == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    with pytest.warns(UserWarning, match="drop function failed on 1 requests"):
        report = eng.modify(halve_or_fail, on_error="skip")
    assert report == ModifyReport(edited=1, failures=[(1, "RuntimeError: no")])
    assert eng.tokens(0) == [1, 3, 5] and torch.equal(eng.tensors(0)[CacheKind.KV], caches[0][:, :, ::2])
    assert (eng.metrics.modify.tokens_before, eng.metrics.modify.tokens_after) == (10, 7)

    register_engine("list-test")(ListEngine)
    try:
        assert "list-test" in engine_kinds()
        with open_engine("list-test", caches=caches) as opened:
            assert isinstance(opened, ListEngine) and opened.kind == "list-test"
        assert opened.closed  # the with-block closed it
    finally:
        _ENGINES.pop("list-test")


def test_registry_knows_both_builtin_engines_and_names_them_for_an_unknown_kind():
    assert engine_kinds()[:1] == ["hf"] and "lmcache" in engine_kinds()
    with pytest.raises(ValueError, match=r"unknown engine kind 'vllm-offline'; choose one of \['hf', 'lmcache'"):
        open_engine("vllm-offline")
    with pytest.raises(TypeError, match="takes an Engine subclass"):
        register_engine("x")(object)
    with pytest.raises(ValueError, match="engine kind 'hf' is taken by tdutils.engines.hf.HFEngine"):
        register_engine("hf")(ListEngine)


def test_snapshot_and_restore_run_several_drop_functions_on_one_prefill(tiny, sample_ids):
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False)
    assert eng.prefill(sample_ids) == [len(x) for x in sample_ids]
    base = eng.decode(max_tokens=6)
    state = eng.snapshot()
    eng.modify(make_drop_fn("random", drop_ratio=0.5, model_config=model.config, seed=1))
    assert eng.tokens(0) != list(sample_ids[0])
    eng.restore(state)
    assert [eng.tokens(i) for i in range(3)] == [list(x) for x in sample_ids]
    assert [o.output_ids for o in eng.decode(max_tokens=6)] == [o.output_ids for o in base]
    # the snapshot survives a restore: it can be restored again after another edit
    eng.modify(make_drop_fn("knorm", drop_ratio=0.5, model_config=model.config))
    eng.restore(state)
    assert eng.kv(0).shape[2] == len(sample_ids[0])


def test_joined_snapshots_restore_as_one_batch_numbered_in_order(tiny, sample_ids):
    """`restore(a + b)`: the requests of both snapshots in one batch, ids 0..N-1, each decoding as it did alone
    (fp32; how `run_cells` decodes several cells' edited caches at once)."""
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False)
    eng.prefill(sample_ids)
    full = eng.snapshot()
    alone = [o.output_ids for o in eng.decode(max_tokens=6)]
    eng.modify(make_drop_fn("knorm", drop_ratio=0.5, model_config=model.config))
    edited = eng.snapshot()
    alone += [o.output_ids for o in eng.decode(max_tokens=6)]
    eng.restore(full + edited)
    assert [r.request_id for r in eng.requests] == list(range(6))
    assert [eng.kv(i).shape[2] for i in range(6)] == [len(x) for x in sample_ids] + [r.kv.shape[2] for r in edited]
    assert [o.output_ids for o in eng.decode(max_tokens=6)] == alone
    assert [r.request_id for r in edited] == [0, 1, 2]  # the snapshots themselves are not renumbered


def test_the_clis_engine_choices_come_from_the_registry():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "tdutils", "run", "--engine", "nope"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "'hf', 'lmcache'" in p.stderr, p.stderr


def test_run_opens_a_users_in_process_engine_without_the_server_settings(capsys, tmp_path):
    """An engine registered by a user (here the hf engine under another kind) runs under `run --engine KIND`: the
    vLLM / LMCache addresses go only to engines whose constructor takes them (it raised TypeError before)."""
    from tdutils.cli.main import main

    class OtherHF(HFEngine):
        pass

    register_engine("hf-other-test")(OtherHF)
    try:
        code = main(["run", "--engine", "hf-other-test", "--policy", "streaming_llm", "--num-requests", "2",
                     "--max-tokens", "4", "--repeats", "1", "--no-progress", "--json", str(tmp_path / "run.json")])
    finally:
        _ENGINES.pop("hf-other-test")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "accuracy streaming_llm@0.5" in out, out
