import pytest
import torch

from tdutils import CacheKind, DropFunctionError, make_drop_fn
from tdutils.edit import validate_drop_output
from tdutils.kvcache import apply_keep
from tdutils.rope import RopeSpec, apply_rope


def _kv(L=2, T=10, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, L, T, D, generator=g).to(dtype)


def test_zero_ratio_returns_input_bit_for_bit_without_mutation(tiny):
    model, _ = tiny
    kv = _kv(T=40, D=64, dtype=torch.bfloat16)
    before = kv.clone()
    fn = make_drop_fn("random", drop_ratio=0.0, model_config=model.config)
    new_kv, new_tokens = fn({CacheKind.KV: kv}, list(range(40)))
    assert torch.equal(new_kv, kv) and new_kv.data_ptr() != kv.data_ptr()
    assert new_tokens == list(range(40))
    assert torch.equal(kv, before)


def test_drop_fn_gathers_values_tokens_and_rerotates_keys(tiny):
    model, _ = tiny
    spec = RopeSpec.from_config(model.config)  # head_dim 32, 2 KV heads -> D = 64
    T, L, H, d = 50, 2, 2, 32
    raw = torch.randn(L, T, H, d)
    pos = torch.arange(T)
    keys = torch.stack([apply_rope(raw[layer], pos, spec) for layer in range(L)]).reshape(L, T, H * d)
    values = torch.randn(L, T, H * d)
    kv = torch.stack([keys, values])  # [2, L, T, D]
    tokens = [1000 + i for i in range(T)]
    fn = make_drop_fn("random", drop_ratio=0.5, model_config=model.config, seed=3, n_sink=2, window=4)
    keep = fn.keep_indices({CacheKind.KV: kv}, tokens)
    new_kv, new_tokens = fn({CacheKind.KV: kv}, tokens)
    k = keep.numel()
    assert k == 25 and new_kv.shape == (2, L, k, H * d)
    assert new_tokens == [tokens[i] for i in keep.tolist()]
    assert torch.equal(new_kv[1], values[:, keep])  # V rows gathered as they are
    # K rows now carry RoPE of positions 0..k-1: equal to rotating the raw keys there directly.
    expect = torch.stack([apply_rope(raw[layer][keep], torch.arange(k), spec) for layer in range(L)])
    torch.testing.assert_close(new_kv[0], expect.reshape(L, k, H * d), atol=1e-5, rtol=1e-5)


def test_rerotate_false_keeps_keys_as_they_are():
    kv = _kv(T=30, D=64)
    fn = make_drop_fn("random", drop_ratio=0.5, rerotate=False, n_sink=1, window=2)
    keep = fn.keep_indices({CacheKind.KV: kv}, list(range(30)))
    new_kv, _ = fn({"kv": kv}, list(range(30)))
    assert torch.equal(new_kv, kv[:, :, keep])


def test_make_drop_fn_rejects_bad_arguments(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="unknown policy"):
        make_drop_fn("nope", model_config=model.config)
    with pytest.raises(ValueError, match="drop_ratio"):
        make_drop_fn("random", drop_ratio=1.5, model_config=model.config)
    with pytest.raises(ValueError, match="model_config"):
        make_drop_fn("random", drop_ratio=0.5)
    with pytest.raises(ValueError, match="unknown parameters"):
        make_drop_fn("random", model_config=model.config, windw=3)


def test_without_model_config_the_message_points_to_what_works():
    # a policy that reads the model: model_config is the only way (rerotate=False would fail next)
    with pytest.raises(ValueError) as e:
        make_drop_fn("snapkv", drop_ratio=0.5)
    assert str(e.value) == ("policy 'snapkv' needs model_config (the model's facts: engine.facts, the model or its "
                            "config): its head_dim and head counts")
    with pytest.raises(ValueError, match="policy 'snapkv' needs model_config"):
        make_drop_fn("snapkv", drop_ratio=0.5, rerotate=False)
    # one that does not: rerotate=False, decoded at original positions, which is an engine's option
    with pytest.raises(ValueError) as e:
        make_drop_fn("random", drop_ratio=0.5)
    assert "or pass rerotate=False and decode at the original positions (an engine opened with " \
           "positions='original', e.g. open_engine('hf', ..., positions='original'), or engine.modify(fn, " \
           "positions='original'))" in str(e.value), str(e.value)
    assert make_drop_fn("random", drop_ratio=0.5, rerotate=False).rerotate is False  # what it suggests builds


def test_drop_ratio_one_warns_that_only_the_protected_tokens_stay():
    kv = _kv(T=30, D=64)
    with pytest.warns(UserWarning) as caught:
        fn = make_drop_fn("random", drop_ratio=1.0, rerotate=False, n_sink=1, window=2)
    assert [str(w.message) for w in caught] == [(
        "drop_ratio=1 keeps only the tokens random always keeps (n_sink=1, window=2; at least one per request), not "
        "0: a test of the protected tokens alone; make_drop_fn(..., budget=k) keeps exactly k")]
    assert fn.keep_indices({CacheKind.KV: kv}, list(range(30))).tolist() == [0, 28, 29]  # what it says it keeps


def test_drop_fn_checks_input_shapes():
    fn = make_drop_fn("random", rerotate=False)
    with pytest.raises(ValueError, match=r"\[2, L, T, D\]"):
        fn({CacheKind.KV: torch.zeros(3, 2, 10, 8)}, list(range(10)))
    with pytest.raises(ValueError, match="must match"):
        fn({CacheKind.KV: torch.zeros(2, 2, 10, 8)}, list(range(9)))
    with pytest.raises(KeyError, match="no KV entry"):
        fn({CacheKind.QUERY: torch.zeros(2, 10, 8)}, list(range(10)))


def test_custom_selection_function_receives_drop_ratio():
    seen = {}

    def every_other(tensors, tokens, drop_ratio):
        seen["r"] = drop_ratio
        return torch.arange(0, len(tokens), 2)

    fn = make_drop_fn(every_other, drop_ratio=0.5, rerotate=False)
    kv = _kv(T=9)
    new_kv, new_tokens = fn({CacheKind.KV: kv}, list(range(9)))
    assert seen["r"] == 0.5 and new_tokens == [0, 2, 4, 6, 8] and torch.equal(new_kv, kv[:, :, ::2])


@pytest.mark.parametrize("keep,msg", [
    (torch.tensor([0, 0, 3]), "duplicates"), (torch.tensor([0, 10]), "lie in"), (torch.tensor([], dtype=torch.long), "at least one"),
    (torch.tensor([0.0, 1.0]), "integer"),
])
def test_apply_keep_rejects_bad_indices(keep, msg):
    with pytest.raises(ValueError, match=msg):
        apply_keep(_kv(T=10), list(range(10)), keep, rerotate=False)


def test_validate_drop_output_catches_contract_violations():
    kv, tokens = _kv(T=10), list(range(10))
    good = (kv[:, :, :4].clone(), [0, 1, 2, 3])
    assert validate_drop_output(kv, tokens, good)[1] == [0, 1, 2, 3]
    cases = [
        (kv[:, :, :4].clone(), [0, 1, 2], "len\\(new_tokens\\)"),
        (kv[:, :1, :4].clone(), [0, 1, 2, 3], "shape"),
        (kv[:, :, :4].double(), [0, 1, 2, 3], "dtype"),
        (kv[:, :, :0].clone(), [], "between 1 and 10"),
        (kv[:, :, :4] * float("nan"), [0, 1, 2, 3], "NaN"),
        ("not a tensor", [0], "torch.Tensor"),
    ]
    for new_kv, new_tokens, msg in cases:
        with pytest.raises(DropFunctionError, match=msg):
            validate_drop_output(kv, tokens, (new_kv, new_tokens))
    with pytest.raises(DropFunctionError, match="must return"):
        validate_drop_output(kv, tokens, kv)


def test_validate_drop_output_finiteness_is_elementwise():
    kv, tokens = _kv(T=10), list(range(10))
    one_inf = kv[:, :, :4].clone()
    one_inf[1, 0, 2, 3] = float("inf")  # a single value: the sum is inf
    big = torch.full_like(kv[:, :, :4], 3e38)  # every value finite, but their fp32 sum overflows
    with pytest.raises(DropFunctionError, match="NaN or infinite"):
        validate_drop_output(kv, tokens, (one_inf, [0, 1, 2, 3]))
    assert validate_drop_output(kv, tokens, (big, [0, 1, 2, 3]))[0] is big


def test_custom_selection_signature_is_checked_when_built():
    with pytest.raises(ValueError, match=r"selection function <lambda>\(te, to, r\) cannot be called as "
                                         r"select\(tensors, tokens\).*name the parameter drop_ratio"):
        make_drop_fn(lambda te, to, r: None, rerotate=False)
    with pytest.raises(ValueError, match=r"cannot be called as select\(tensors, tokens, drop_ratio=\.\.\., top=\.\.\.\)"):
        make_drop_fn(lambda te, to, drop_ratio: None, rerotate=False, top=3)
    assert make_drop_fn(lambda te, to, drop_ratio=0.5: None, rerotate=False).drop_ratio == 0.5


def test_validate_drop_output_checks_token_ids():
    kv, tokens = _kv(T=10), list(range(10))
    new_kv = kv[:, :, :4].clone()
    assert validate_drop_output(kv, tokens, (new_kv, [0, 1, 2, 3]), vocab_size=4)[1] == [0, 1, 2, 3]
    with pytest.raises(DropFunctionError, match=r"new_tokens\[2\] = 1000000000 is outside the model's vocabulary "
                                                r"\[0, 100\)"):
        validate_drop_output(kv, tokens, (new_kv, [0, 1, 10**9, 3]), vocab_size=100)
    with pytest.raises(DropFunctionError, match=r"new_tokens\[0\] = -1 is outside"):
        validate_drop_output(kv, tokens, (new_kv, [-1, 1, 2, 3]), vocab_size=100)
    with pytest.raises(DropFunctionError, match="must be integer token ids \\(got floats or bools\\)"):
        validate_drop_output(kv, tokens, (new_kv, [0.0, 1.5, 2.0, 3.0]))


# ---------------------------------------------------------------- one drop-function type


def test_keep_by_budget_keeps_exactly_the_budget_and_a_short_cache_whole():
    """`make_drop_fn(policy, budget=B)`: the policy at drop ratio 1 - B/T keeps exactly B of T > B tokens (the same
    set as the ratio-built function at that ratio), and a cache of T <= B tokens bit for bit."""
    kv = _kv(T=37, D=64)
    tokens = list(range(37))
    by_budget = make_drop_fn("random", budget=10, rerotate=False, seed=1, n_sink=2, window=3)
    keep = by_budget.keep_indices({CacheKind.KV: kv}, tokens)
    by_ratio = make_drop_fn("random", drop_ratio=1 - 10 / 37, rerotate=False, seed=1, n_sink=2, window=3)
    assert keep.numel() == 10 and torch.equal(keep, by_ratio.keep_indices({CacheKind.KV: kv}, tokens))
    assert keep[:2].tolist() == [0, 1] and keep[-3:].tolist() == [34, 35, 36]  # sinks and window protected
    short = kv[:, :, :10]
    new_kv, new_tokens, kept = by_budget.edit({CacheKind.KV: short}, tokens[:10])
    assert torch.equal(new_kv, short) and new_tokens == tokens[:10] and kept.tolist() == list(range(10))
    with pytest.raises(ValueError, match="not both"):
        make_drop_fn("random", drop_ratio=0.5, budget=10, rerotate=False)
    with pytest.raises(ValueError, match="budget must be an integer"):
        make_drop_fn("random", budget=0, rerotate=False)
    with pytest.raises(RuntimeError, match="more than the budget"):  # its window alone exceeds the budget
        make_drop_fn("random", budget=2, rerotate=False, n_sink=0, window=5)({CacheKind.KV: kv}, tokens)


def test_a_bare_modify_fn_is_adapted_once_and_says_what_it_does_not_know():
    from tdutils.edit import DropFn, as_drop_fn

    def halve(tensors, tokens):
        kv = tensors[CacheKind.KV]
        return kv[:, :, ::2].clone(), list(tokens)[::2]

    fn = as_drop_fn(halve)
    assert isinstance(fn, DropFn) and as_drop_fn(fn) is fn
    assert (fn.name, fn.rerotate, fn.needs, fn.query_rows, fn.reads_only) == ("halve", None, None, None, False)
    kv = _kv(T=8)
    new_kv, new_tokens, keep = fn.edit({CacheKind.KV: kv}, list(range(8)))
    assert torch.equal(new_kv, kv[:, :, ::2]) and new_tokens == [0, 2, 4, 6] and keep is None
    with pytest.raises(TypeError, match="reports no kept indices"):
        fn.keep_indices({CacheKind.KV: kv}, list(range(8)))
    with pytest.raises(TypeError, match="callable"):
        as_drop_fn("snapkv")


def test_timed_copy_records_each_request_and_the_original_does_not():
    fn = make_drop_fn("random", drop_ratio=0.5, rerotate=False)
    timed = fn.timed()
    kv = _kv(T=40)
    for _ in range(3):
        assert torch.equal(timed({CacheKind.KV: kv}, list(range(40)))[0], fn({CacheKind.KV: kv}, list(range(40)))[0])
    assert timed.split()["requests"] == 3 and all(s >= 0 for s in timed.timings.score_s)
    assert fn.timings is None
    with pytest.raises(ValueError, match="timed"):
        fn.split()
    timed.reset()
    assert timed.split() == {"requests": 0, "score_s": 0, "rerotate_s": 0}


def test_model_facts_are_handed_on_explicitly_with_no_registry(tiny):
    """The engine's facts carry the live model's RoPE; a bare config its definition; nothing global links them."""
    import tdutils.attention as attention
    from tdutils.models import model_facts

    model, _ = tiny
    assert not hasattr(attention, "register_live_model") and not hasattr(attention, "live_model")
    live, bare = model_facts(model), model_facts(model.config)
    assert live == bare and live.source is model and bare.source is model.config and bare.config is model.config
    assert model_facts(live) is live
    torch.testing.assert_close(live.rope.inv_freq, model.model.rotary_emb.inv_freq.float(), atol=0, rtol=0)
    fn = make_drop_fn("snapkv", drop_ratio=0.5, model_config=live)
    assert fn.rope_spec is live.rope  # computed once, reused
