"""Every registered policy: its defining property on hand-built tensors, the drop-function contract, the registry
(a user's own policy reaches make_drop_fn, compare() and passkey_eval), query capture per policy, and the CLI."""

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import tdutils
from tdutils import CacheKind, make_drop_fn
from tdutils.data import load_prompts
from tdutils.edit import as_drop_fn, validate_drop_output
from tdutils.engines.hf import HFEngine
from tdutils.policies import (
    RKV_METHODS,
    get_policy,
    h2o,
    h2o_keep,
    h2o_scores,
    keydiff_keep,
    keydiff_scores,
    knorm_keep,
    knorm_scores,
    policy_names,
    query_window_for,
    register_policy,
    snapkv_keep,
    snapkv_scores,
    streaming_llm_keep,
    tova_keep,
    tova_scores,
    unregister_policy,
)
from tdutils.selection import keep_count

ROOT = Path(__file__).resolve().parents[1]
NEW = ("streaming_llm", "h2o", "tova", "knorm", "keydiff")


def _kv_q(L=2, T=24, H=2, g=2, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, L, T, H * d, generator=gen)
    q = torch.randn(L, T, H * g * d, generator=gen)
    return kv, q


# ------------------------------------------------------------------------------------------ defining properties
def test_streaming_llm_keeps_the_sinks_and_the_most_recent():
    assert streaming_llm_keep(20, 0.5).tolist() == [0, 1, 2, 3] + list(range(14, 20))  # k = 10: 4 sinks + 6 recent
    assert streaming_llm_keep(20, 0.5, n_sink=0).tolist() == list(range(10, 20))
    assert streaming_llm_keep(20, 0.25, n_sink=2).tolist() == [0, 1] + list(range(7, 20))  # k = 15
    # window is a floor: at drop ratio 1 the budget is 0, the protected tokens remain
    assert streaming_llm_keep(20, 1.0, n_sink=4, window=3).tolist() == [0, 1, 2, 3, 17, 18, 19]
    assert streaming_llm_keep(3, 0.5, n_sink=4).tolist() == [0, 1, 2]  # a prompt shorter than the sinks


def test_knorm_keeps_exactly_the_lowest_norm_keys():
    L, T, H, d = 2, 12, 2, 4
    gen = torch.Generator().manual_seed(1)
    norms = torch.randperm(T, generator=gen).float() + 1.0  # distinct norms 1..12
    unit = torch.nn.functional.normalize(torch.randn(L, T, H, d, generator=gen), dim=-1)
    keys = (unit * norms[None, :, None, None]).reshape(L, T, H * d)  # every head of token t has norm norms[t]
    kv = torch.stack([keys, torch.randn(L, T, H * d, generator=gen)])
    torch.testing.assert_close(knorm_scores(kv, head_dim=d), norms)
    keep = knorm_keep(kv, 0.5, head_dim=d)
    assert keep.tolist() == sorted(torch.argsort(norms)[:6].tolist())
    # the per-head mean: a token whose heads have norms 1 and 9 scores 5
    kv2 = kv.clone()
    kv2[0, :, 0, :d] = kv2[0, :, 0, :d] / norms[0]
    kv2[0, :, 0, d:] = 9 * kv2[0, :, 0, d:] / norms[0]
    assert knorm_scores(kv2, head_dim=d)[0].item() == pytest.approx(5.0)
    # protected tokens are kept whatever their norm
    assert {0, 11} <= set(knorm_keep(kv, 0.5, head_dim=d, n_sink=1, window=1).tolist())


def test_keydiff_keeps_the_keys_least_similar_to_the_mean_key():
    L, T, H, d = 1, 6, 1, 2
    # five keys near the x axis and one along y: the anchor points along x, so the y key is the least similar
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.1], [1.0, -0.1], [0.0, 1.0], [3.0, 0.2], [1.0, 0.05]])
    kv = torch.stack([keys.view(L, T, H * d), torch.zeros(L, T, H * d)])
    assert keydiff_keep(kv, 5 / 6, head_dim=d).tolist() == [3]
    # by hand: cosine to the mean of the unit keys, for random keys with 2 heads and 2 layers
    kv, _ = _kv_q(L=2, T=16, H=2, d=4, seed=3)
    expect = torch.zeros(16)
    for layer in range(2):
        for head in range(2):
            k = kv[0, layer, :, head * 4:(head + 1) * 4].double()
            unit = k / k.norm(dim=-1, keepdim=True)
            a = unit.mean(dim=0)
            expect += (k @ a / (k.norm(dim=-1) * a.norm())).float() / 4
    torch.testing.assert_close(keydiff_scores(kv, head_dim=4), expect, atol=1e-6, rtol=0)
    keep = keydiff_keep(kv, 0.5, head_dim=4)
    assert keep.tolist() == sorted(torch.argsort(expect)[:8].tolist())
    raw = torch.zeros(16)
    for layer in range(2):
        for head in range(2):
            k = kv[0, layer, :, head * 4:(head + 1) * 4].double()
            a = k.mean(dim=0)
            raw += (k @ a / (k.norm(dim=-1) * a.norm())).float() / 4
    torch.testing.assert_close(keydiff_scores(kv, head_dim=4, anchor="raw"), raw, atol=1e-6, rtol=0)


def test_tova_equals_snapkv_with_window_1_and_no_pooling():
    kv, q = _kv_q(L=3, T=30, H=2, g=3, d=4, seed=5)  # GQA groups of 3
    s = tova_scores(kv, q, head_dim=4)
    torch.testing.assert_close(s[:-1], snapkv_scores(kv, q, head_dim=4, window=1, kernel_size=1), atol=1e-6, rtol=0)
    assert s.sum().item() == pytest.approx(1.0, abs=1e-5)  # mean of probability rows
    for r in (0.25, 0.5, 0.9):
        assert torch.equal(tova_keep(kv, q, r, head_dim=4), snapkv_keep(kv, q, r, head_dim=4, window=1, kernel_size=1))
    # only the last query row is read
    q2 = q.clone()
    q2[:, :-1] = 0
    torch.testing.assert_close(tova_scores(kv, q2, head_dim=4), s)
    torch.testing.assert_close(tova_scores(kv, q[:, -1:], head_dim=4), s)


def _h2o_by_hand(kv, q, d, n_kv_heads):
    """Accumulated causal attention with explicit loops in fp64: sum over rows i >= j of softmax_j(q_i.k_j/sqrt d)."""
    L, T = kv.shape[1], kv.shape[2]
    hq = q.shape[2] // d
    g = hq // n_kv_heads
    out = torch.zeros(T, dtype=torch.float64)
    for layer in range(L):
        per_head = torch.zeros(hq, T, dtype=torch.float64)
        for h in range(hq):
            kh = kv[0, layer, :, (h // g) * d:(h // g + 1) * d].double()
            for i in range(T):
                qi = q[layer, i, h * d:(h + 1) * d].double()
                logits = [float(qi @ kh[j]) / math.sqrt(d) for j in range(i + 1)]
                m = max(logits)
                e = [math.exp(x - m) for x in logits]
                for j in range(i + 1):
                    per_head[h, j] += e[j] / sum(e)
        out += per_head.view(n_kv_heads, g, T).mean(dim=1).mean(dim=0) / L
    return out.float()


def test_h2o_equals_accumulated_causal_attention_computed_by_hand(monkeypatch):
    kv, q = _kv_q(L=2, T=12, H=2, g=2, d=4, seed=7)
    expect = _h2o_by_hand(kv, q, 4, 2)
    s = h2o_scores(kv, q, head_dim=4)
    torch.testing.assert_close(s, expect, atol=1e-5, rtol=0)
    assert s.sum().item() == pytest.approx(12.0, abs=1e-4)  # T rows, each summing to 1
    monkeypatch.setattr(h2o, "BLOCK_ELEMENTS", 4 * 12 * 5)  # blocks of 5 query rows: the same sums
    torch.testing.assert_close(h2o_scores(kv, q, head_dim=4), s, atol=1e-6, rtol=0)
    # keep: window = half the keep count (the paper's split), the rest the heaviest hitters
    keep = h2o_keep(kv, q, 0.5, head_dim=4)  # k = 6: window 3 (tokens 9..11) + 3 heavy hitters among 0..8
    heavy = torch.argsort(expect[:9], descending=True)[:3].tolist()
    assert keep.tolist() == sorted(heavy + [9, 10, 11])
    keep = h2o_keep(kv, q, 0.5, head_dim=4, window=1)
    assert keep.tolist() == sorted(torch.argsort(expect[:11], descending=True)[:5].tolist() + [11])


def test_h2o_needs_every_prompt_query():
    kv, q = _kv_q(T=12)
    with pytest.raises(ValueError, match="query holds 11 rows but the prompt length"):
        h2o_scores(kv, q[:, 1:], head_dim=4)
    with pytest.raises(ValueError, match="H2O needs the query tensor"):
        h2o_scores(kv, None, head_dim=4)


def test_h2o_and_tova_scores_match_the_models_own_attention(tiny):
    """Queries and keys captured by the hf engine, scored by H2O and TOVA, against the attention probabilities
    the model itself returns (eager attention, output_attentions=True)."""
    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=None)
    ids = tok(load_prompts("sample", num_requests=1)[0].prompt)["input_ids"][:96]
    eng.prefill([ids])
    kv, q = eng.kv(0), eng.query(0)
    assert q.shape == (2, 96, 128)
    with torch.inference_mode():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # L x [1, Hq, T, T]
    h, hq = 2, 4
    acc = sum(a[0].sum(dim=1).view(h, hq // h, -1).mean(dim=1).mean(dim=0) for a in att) / len(att)
    torch.testing.assert_close(h2o_scores(kv, q, head_dim=32), acc.float(), atol=1e-4, rtol=1e-5)
    last = sum(a[0, :, -1].mean(dim=0) for a in att) / len(att)
    torch.testing.assert_close(tova_scores(kv, q, head_dim=32), last.float(), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------ every policy's contract
def _fn(name, r, config, **kw):
    defaults = {"snapkv": {"window": 8}, "rkv": {"window": 8}, "middle_chunk": {"chunk_size": 8}}
    return make_drop_fn(name, drop_ratio=r, model_config=config, **{**defaults.get(name, {}), **kw})


@pytest.mark.parametrize("name", [n for n in policy_names() if not get_policy(n).per_head_only])
def test_every_policy_drop_zero_is_identity_and_half_keeps_a_valid_set(tiny, name):
    model, _ = tiny
    kv, q = _kv_q(L=2, T=40, H=2, g=2, d=32, seed=11)
    tokens = list(range(100, 140))
    tensors = {CacheKind.KV: kv, CacheKind.QUERY: q}
    before = kv.clone()
    new_kv, new_tokens = _fn(name, 0.0, model.config)(tensors, tokens)
    assert torch.equal(new_kv, kv) and new_kv.data_ptr() != kv.data_ptr() and new_tokens == tokens
    fn = _fn(name, 0.5, model.config)
    keep = fn.keep_indices(tensors, tokens)
    assert torch.equal(keep, torch.sort(keep).values) and keep.unique().numel() == keep.numel()
    if name != "middle_chunk":  # middle_chunk's realised ratio is below the nominal one (first/last chunk kept)
        assert keep.numel() == keep_count(40, 0.5)
    out = validate_drop_output(kv, tokens, fn(tensors, tokens))
    assert out[0].shape == (2, 2, keep.numel(), 64) and out[1] == [tokens[i] for i in keep.tolist()]
    assert torch.equal(kv, before)  # input untouched
    p = get_policy(name).make_params(**fn.params)
    if getattr(p, "window", None):  # the protected recent tokens are kept
        assert set(range(40 - p.window, 40)) <= set(keep.tolist())
    if getattr(p, "n_sink", 0):
        assert set(range(p.n_sink)) <= set(keep.tolist())


def test_registry_lists_policies_and_what_they_need():
    names = policy_names()
    assert {"snapkv", "rkv", "random", "middle_chunk", *NEW} <= set(names)
    # registration order: the modules tdutils/policies/__init__.py names, then any other policy file of the package
    # in name order (snapkv first: the CLI's default)
    builtin = [n for n in names if get_policy(n).builtin]
    named = [m for m, _ in _imports(ROOT / "tdutils" / "policies" / "__init__.py") if m.startswith("tdutils.policies.")]
    rank = named + sorted({get_policy(n).keep.__module__ for n in builtin} - set(named))
    order = [rank.index(get_policy(n).keep.__module__) for n in builtin]
    assert order == sorted(order) and builtin[0] == "snapkv"
    assert sorted(policy_names("kv") + policy_names("window") + policy_names("all")) == sorted(names)
    assert {"random", "middle_chunk", "streaming_llm", "knorm", "keydiff"} <= set(policy_names("kv"))
    assert "h2o" in policy_names("all")
    assert {"snapkv", "rkv", "tova"} <= set(policy_names("window"))
    for name in NEW:
        pol = get_policy(name)
        assert "arXiv:" in pol.paper and pol.summary and "arXiv:" in __import__(pol.keep.__module__, fromlist=["x"]).__doc__
    assert get_policy("streaming_llm").defaults() == {"n_sink": 4, "window": 0}
    assert get_policy("tova").defaults() == {"window": 1, "n_sink": 0}
    assert get_policy("h2o").defaults() == {"window": None, "n_sink": 0}
    with pytest.raises(ValueError, match="unknown policy 'nope'; choose one of"):
        get_policy("nope")
    with pytest.raises(ValueError, match=r"unknown parameters for policy 'knorm': \['kernel_size'\]"):
        make_drop_fn("knorm", rerotate=False, kernel_size=3)
    with pytest.raises(ValueError, match="needs model_config"):
        make_drop_fn("knorm", rerotate=False)
    with pytest.raises(ValueError, match="window must be an integer >= 0, got -1"):
        make_drop_fn("streaming_llm", rerotate=False, window=-1)


def test_query_window_for_each_policy(tiny):
    model, _ = tiny
    fns = {n: _fn(n, 0.5, model.config) for n in policy_names()}
    assert [query_window_for(fns[n]) for n in policy_names("kv")] == [0] * len(policy_names("kv"))  # nothing captured
    assert query_window_for(fns["snapkv"]) == 8 and query_window_for(fns["tova"]) == 1
    assert query_window_for(fns["h2o"]) is None and query_window_for(fns["tova"], fns["h2o"]) is None
    assert query_window_for(fns["tova"], _fn("snapkv", 0.5, model.config, window=32), None) == 32
    assert query_window_for(make_drop_fn(lambda t, k: torch.arange(len(k)), rerotate=False)) == 64  # unknown
    assert query_window_for(as_drop_fn(lambda t, k: (t, k))) == 64  # a bare ModifyFn, adapted: unknown too
    assert query_window_for(fns["h2o"].timed()) is None


def test_a_users_policy_registered_in_a_cell_reaches_make_drop_fn_compare_and_eval(tiny):
    model, tok = tiny

    @dataclasses.dataclass
    class EveryOtherParams:
        window: int = 4

    def every_other_keep(kv, q, drop_ratio, *, params, facts):
        T = kv.shape[2]
        keep = set(range(0, T, 2)) | set(range(T - params.window, T))
        return torch.tensor(sorted(keep))

    register_policy("every_other", params=EveryOtherParams, needs="kv", keep=every_other_keep, needs_model=False)
    try:
        register_policy("every_other", params=EveryOtherParams, needs="kv", keep=every_other_keep)  # a re-run cell
        fn = make_drop_fn("every_other", drop_ratio=0.5, model_config=model.config, window=2)
        assert fn.keep_indices({CacheKind.KV: torch.zeros(2, 2, 10, 64)}, list(range(10))).tolist() == [0, 2, 4, 6, 8, 9]
        # setup(model_config) runs once per drop function; its values reach keep as keywords
        calls = []

        def first_layers_keep(kv, q, drop_ratio, *, params, facts, n_layers):
            assert n_layers == facts.num_layers == 2
            return torch.arange(params.window)

        register_policy("first_tokens", params=EveryOtherParams, needs="kv", keep=first_layers_keep,
                        setup=lambda facts: calls.append(1) or {"n_layers": facts.config.num_hidden_layers})
        fn2 = make_drop_fn("first_tokens", drop_ratio=0.5, model_config=model.config, window=3)
        for _ in range(2):
            assert fn2.keep_indices({CacheKind.KV: torch.zeros(2, 2, 10, 64)}, list(range(10))).tolist() == [0, 1, 2]
        assert calls == [1]
        unregister_policy("first_tokens")
        eng = HFEngine(model, tokenizer=tok, progress=False, query_window=0)
        prompts = [tok(r.prompt)["input_ids"][:64] for r in load_prompts("sample", num_requests=2)]
        _, table = tdutils.compare(eng, prompts, {"every_other": fn}, max_tokens=2)
        assert table.loc["every_other", "kv_tokens_after"] == 2 * 33
        from tdutils.eval import passkey_eval

        t = passkey_eval(policies=["full", "every_other"], drop_ratios=[0.5], context_lengths=[128], n=2,
                         max_tokens=6, engine=eng)
        assert list(t.policy) == ["full", "every_other"] and t.kept_tokens.tolist() == [128.0, 66.0]
    finally:
        unregister_policy("every_other")
    assert "every_other" not in policy_names()
    with pytest.raises(ValueError, match="built into tdutils"):
        register_policy("snapkv", params=EveryOtherParams, needs="kv", keep=every_other_keep)
    with pytest.raises(ValueError, match="needs must be one of"):
        register_policy("x", params=EveryOtherParams, needs="queries", keep=every_other_keep)
    with pytest.raises(TypeError, match="dataclass"):
        register_policy("x", params=dict, needs="kv", keep=every_other_keep)


# ------------------------------------------------------------------------------------------ capture and engines
def test_engine_captures_what_the_policy_needs(tiny):
    model, tok = tiny
    prompts = [tok(r.prompt)["input_ids"][:80] for r in load_prompts("sample", num_requests=2)]
    eng = HFEngine(model, tokenizer=tok, progress=False, query_window=0)
    knorm = make_drop_fn("knorm", drop_ratio=0.5, model_config=model.config)
    tdutils.run_once(eng, prompts, drop_fn=knorm, max_tokens=2)
    assert eng.query_window == 0  # query-free: nothing captured
    eng.prefill(prompts)
    assert eng.query(0) is None
    tova = make_drop_fn("tova", drop_ratio=0.5, model_config=model.config)
    tdutils.run_once(eng, prompts, drop_fn=tova, max_tokens=2)
    assert eng.query_window == 1
    h2o_fn = make_drop_fn("h2o", drop_ratio=0.5, model_config=model.config)
    res = tdutils.run_once(eng, prompts, drop_fn=h2o_fn, max_tokens=2)
    assert eng.query_window is None and res.metrics.modify.edited == 2
    eng.prefill(prompts)
    assert eng.query(1).shape == (2, 80, 128)  # every prompt query: [L, T, Hq*d]
    tdutils.run_once(eng, prompts, drop_fn=tova, max_tokens=2)
    assert eng.query_window is None  # never narrowed


# ------------------------------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def short_passkey(tiny, tmp_path_factory):
    """Two passkey prompts of 160 tokens with their answers, as a .jsonl file the command line reads."""
    import json

    from tdutils.data import make_passkey_dataset

    path = tmp_path_factory.mktemp("data") / "passkey_160.jsonl"
    rows = make_passkey_dataset(2, 160, tokenizer=tiny[1], seed=3)
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("policy", NEW)
def test_cli_runs_every_new_policy(policy, short_passkey, tmp_path, capsys):
    from tdutils.cli.main import main

    rc = main(["run", "--policy", policy, "--dataset", str(short_passkey), "--num-requests", "2", "--max-tokens", "2", "--no-progress",
               "--json", str(tmp_path / "run.json"), "--window", "8", "--n-sink", "2"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert f"decode throughput ratio ({policy}@0.5 / baseline)" in out.out, out.out
    assert f"accuracy {policy}@0.5 (passkey)" in out.out, out.out
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["table"][1]["kv_tokens_after"] == 2 * 80, report["table"]  # half of each 160-token prompt


def test_cli_policy_options_reach_only_policies_that_have_them(tmp_path, capsys):
    from tdutils.cli.main import main

    rc = main(["run", "--policy", "knorm", "--kernel-size", "3", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--kernel-size does not apply to policy 'knorm'; its parameters are ['n_sink', 'window']" in err, err


def _options(parser) -> dict:
    """`{dest: action}` of every option of an argparse parser."""
    return {a.dest: a for a in parser._actions if a.option_strings}


def test_cli_options_come_from_every_policys_parameters():
    import argparse

    from tdutils.cli.eval import add_arguments
    from tdutils.cli.main import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    ev = argparse.ArgumentParser()
    add_arguments(ev)
    fields = {f.name: f for n in policy_names() for f in dataclasses.fields(get_policy(n).params)}
    on_cli = {name for name, f in fields.items() if f.metadata.get("cli", True)}
    assert on_cli - {"seed"} <= set(_options(ev)) and on_cli <= set(_options(run))
    assert "device" not in on_cli and _options(run)["device"].help.startswith("torch device")  # the engine's own
    assert _options(ev)["seed"].default == 0  # eval's --seed is the dataset's, not the random policy's
    opts = _options(run)
    for name in on_cli:  # unset = the policy's default; the option is spelled as the field, with dashes
        assert opts[name].default is None and opts[name].option_strings[0] == "--" + name.replace("_", "-"), name
        assert fields[name].metadata.get("help"), f"parameter {name} has no help text"
    assert opts["pooling"].choices == ("avg", "max") and opts["redundancy"].choices == RKV_METHODS  # Literal fields
    assert opts["window"].type is int and opts["mix_lambda"].type is float
    assert "64 snapkv" in opts["window"].help and "256 middle_chunk" in opts["chunk_size"].help


def test_a_new_policys_parameter_reaches_the_cli_with_no_edit(capsys):
    from typing import Literal

    from tdutils.cli.main import build_parser
    from tdutils.cli.policy_options import policy_arguments, policy_params

    @dataclasses.dataclass
    class StrideParams:
        stride: int = dataclasses.field(default=2, metadata={"help": "keep every stride-th token"})
        side: Literal["left", "right"] = "left"
        flip: bool = False
        window: int = 4

    register_policy("stride", params=StrideParams, needs="kv", needs_model=False,
                    keep=lambda kv, q, r, *, params, facts: torch.arange(0, kv.shape[2], params.stride))
    try:
        run = build_parser()._subparsers._group_actions[0].choices["run"]
        opts = _options(run)
        assert opts["stride"].type is int and "keep every stride-th token (stride; default: 2)" in opts["stride"].help
        assert opts["side"].choices == ("left", "right") and "--no-flip" in opts["flip"].option_strings
        args = run.parse_args(["--policy", "stride", "--stride", "3", "--no-flip", "--window", "8"])
        assert policy_params(args, "stride") == {"stride": 3, "flip": False, "window": 8}
        assert policy_params(args, "knorm", strict=False) == {"window": 8}  # eval: each policy takes what it has
        with pytest.raises(ValueError, match=r"--stride, --flip does not apply to policy 'knorm'"):
            policy_params(args, "knorm")
        with pytest.raises(ValueError, match=r"policy parameters \['stride'\] clash"):
            import argparse

            ap = argparse.ArgumentParser()
            ap.add_argument("--stride")
            policy_arguments(ap)
    finally:
        unregister_policy("stride")
    assert "stride" not in _options(build_parser()._subparsers._group_actions[0].choices["run"])


def test_reduce_gqa_takes_the_max_or_mean_over_each_kv_heads_query_group():
    from tdutils.policies import scoring

    x = torch.arange(24.0).view(4, 3, 2)  # [Hq=4, ...], 2 KV heads: groups (0, 1) and (2, 3)
    assert torch.equal(scoring.reduce_gqa(x, 2, "max"), x[[1, 3]])
    assert torch.equal(scoring.reduce_gqa(x, 2, "mean"), (x[[0, 2]] + x[[1, 3]]) / 2)


@pytest.mark.parametrize("policy,params,msg", [
    ("random", {"seed": "1"}, "seed must be an integer, got '1'"),
    # torch.Generator().manual_seed(-1) draws as 2**64 - 1 does; past 2**64 - 1 it fails only at the first request
    ("random", {"seed": -1}, "seed must be an integer in [0, 2**64 - 1] (torch.Generator's seeds), got -1"),
    ("random", {"seed": 2**64}, f"seed must be an integer in [0, 2**64 - 1] (torch.Generator's seeds), got {2**64}"),
    ("random", {"n_sink": -1}, "n_sink must be an integer >= 0, got -1"),
    ("snapkv", {"window": True}, "window must be a positive integer, got True"),
    ("snapkv", {"pooling": "sum"}, "pooling must be 'avg' or 'max', got 'sum'"),
    ("keydiff", {"anchor": "mean"}, "anchor must be 'normalized' or 'raw', got 'mean'"),
    ("middle_chunk", {"chunk_size": 0}, "chunk_size must be a positive integer, got 0"),
])
def test_each_params_dataclass_checks_its_fields(policy, params, msg):
    with pytest.raises(ValueError) as e:
        get_policy(policy).make_params(**params)
    assert str(e.value) == msg

# ------------------------------------------------------------------------------------------ layering
def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names) of every import statement in a file, relative ones resolved inside tdutils."""
    tree = ast.parse(path.read_text())
    pkg = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.append((mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def test_no_module_outside_policies_imports_policy_internals_and_policies_never_import_edit():
    for path in (ROOT / "tdutils").rglob("*.py"):
        inside = "policies" in path.relative_to(ROOT / "tdutils").parts
        for mod, names in _imports(path):
            if inside:
                assert mod != "tdutils.edit" and not mod.startswith("tdutils.engines"), (path, mod)
            elif mod.startswith("tdutils.policies"):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{path} imports private {private} from {mod}"
    # edit.py reaches policies through the registry only
    assert [m for m, _ in _imports(ROOT / "tdutils" / "edit.py") if "policies" in m] == ["tdutils.policies"]


def test_builtin_policies_only_read_their_input_so_the_engine_skips_the_copy(tiny, sample_ids):
    """`DropFn.reads_only` lets the hf engine hand tdutils' own policies the cache itself (no protective copy):
    every built-in policy must leave the KV and query tensors bit for bit as they were; a user's function is
    still given a copy."""
    from tdutils.engines.hf import HFEngine
    from tdutils.policies import get_policy, policy_names

    model, tok = tiny
    eng = HFEngine(model, tokenizer=tok, query_window=None, progress=False)
    eng.prefill(sample_ids[:1])
    tensors = eng.tensors(0)
    before = {k: t.clone() for k, t in tensors.items()}
    names = [n for n in policy_names() if get_policy(n).builtin]
    assert {"snapkv", "rkv", "h2o", "tova", "knorm", "keydiff", "random", "streaming_llm"} <= set(names)
    for name in names:
        fn = tdutils.make_drop_fn(name, drop_ratio=0.5, model_config=eng.facts)
        assert fn.reads_only
        fn.edit(tensors, eng.tokens(0))
        for kind, t in tensors.items():
            assert torch.equal(t, before[kind]), (name, kind)

    seen = []

    def select(tensors, tokens):
        seen.append(tensors[tdutils.CacheKind.KV])
        return torch.arange(len(tokens) // 2)

    user = tdutils.make_drop_fn(select, drop_ratio=0.5, model_config=eng.facts)
    assert not user.reads_only
    cache = eng.requests[0].kv
    eng.modify(user)
    assert seen[0] is not cache and torch.equal(seen[0], before[tdutils.CacheKind.KV])  # a copy, not the cache
