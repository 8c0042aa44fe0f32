"""bfloat16 end to end: the one line on a CPU that emulates it, policies scoring a bf16 cache in fp32 (the same kept
set as the fp32 upcast of that cache), and `dtype_fidelity` (bf16 against fp32 on the same prompts)."""

import warnings

import pytest
import torch

from tdutils import CacheKind, make_drop_fn, open_engine
from tdutils.engines import hf
from tdutils.eval import dtype_fidelity
from tdutils.policies import get_policy, policy_names

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ the CPU line
def _open_bf16():
    return open_engine("hf", model="tiny-qwen3", dtype="bfloat16", progress=False)


def test_bf16_on_a_cpu_without_avx512_bf16_or_amx_warns_in_one_line(monkeypatch):
    monkeypatch.setattr(hf, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="without AVX512-BF16 or AMX") as seen:
        eng = _open_bf16()
    assert eng.model.dtype == torch.bfloat16  # a warning, not a refusal: it still runs
    assert [str(w.message) for w in seen if "AVX512" in str(w.message)] == [hf.BF16_EMULATED]
    assert "\n" not in hf.BF16_EMULATED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_engine("hf", model="tiny-qwen3", dtype="float32", progress=False)  # fp32: nothing to say


def test_bf16_on_a_cpu_with_native_bf16_opens_silently(monkeypatch):
    monkeypatch.setattr(hf, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _open_bf16()
    assert not [w for w in seen if "AVX512" in str(w.message)]


def test_cpu_has_native_bf16_agrees_with_the_cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert hf.cpu_has_native_bf16() == any(flag in words for flag in hf.BF16_CPU_FLAGS)


# ------------------------------------------------------------------- policies score a bf16 cache in fp32
def _cases():
    for name in policy_names():
        pol = get_policy(name)
        grans = [] if pol.per_head_only else ["request"]
        grans += [g for g in ("layer", "head") if g in (pol.granularities or ())]
        yield from ((name, g) for g in grans)


@pytest.mark.parametrize("name,granularity", list(_cases()))
def test_a_bf16_cache_keeps_the_set_of_its_fp32_upcast(tiny, name, granularity):
    """Every score is computed in fp32 from the slices it reads (docs/policies.md, "Precision"): a bf16 cache and
    its exact fp32 upcast give the same kept set, so rounding in the scores never moves it."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(3)
    L, T, H, g, d = 2, 96, 2, 2, 32
    # key norms within a few percent of each other (as QK-norm models' are): scores closer than bf16's 8 bits, so a
    # score computed in bf16 ties and moves the kept set; spread beyond `knorm.equal_norms`' bf16 tolerance
    kv = torch.randn(2, L, T, H, d, generator=gen)
    kv = kv / kv.norm(dim=-1, keepdim=True) * (1 + 0.02 * torch.randn(2, L, T, H, 1, generator=gen))
    kv = kv.reshape(2, L, T, H * d).bfloat16()
    q = torch.randn(L, T, H * g * d, generator=gen).bfloat16()
    tokens = list(range(100, 100 + T))
    kw = {} if granularity == "request" else {"granularity": granularity}
    fn = make_drop_fn(name, drop_ratio=0.5, model_config=model.config, **kw)
    bf16 = fn.keep_indices({CacheKind.KV: kv, CacheKind.QUERY: q}, tokens)
    fp32 = fn.keep_indices({CacheKind.KV: kv.float(), CacheKind.QUERY: q.float()}, tokens)
    assert torch.equal(bf16, fp32)


# ---------------------------------------------------------------------------------------------- dtype_fidelity
SMALL = {"context_tokens": 192, "texts": 2, "continuation": 6, "task": "passkey", "n": 2, "batch_size": 2}


def test_dtype_fidelity_of_float32_against_itself_is_exact():
    r = dtype_fidelity("tiny-qwen3", dtype="float32", reference="float32", **SMALL)
    for part in ("text", "answers"):
        assert set(r[part]) == {"full@0", "snapkv@0.5"}
        for m in r[part].values():
            assert m["kl_max"] == 0.0 and m["argmax_agreement"] == 1.0 and m["identical"] == 1.0
    for m in r["answers"].values():
        assert m["mcnemar"] == (0, 0, 1.0) and m["same_answer"] == 1.0 and m["exact_reference"] == m["exact_dtype"]
    assert r["text"]["full@0"]["greedy_prefix_mean"] == SMALL["continuation"]


def test_dtype_fidelity_of_bfloat16_measures_a_small_nonzero_kl():
    r = dtype_fidelity("tiny-qwen3", cells=(("full", 0.0),), **SMALL)
    text = r["text"]["full@0"]
    assert 0.0 < text["kl_mean"] <= text["kl_max"] < 0.1  # bf16 rounds: not zero; the tiny model: 3e-4 nats
    assert 0.0 <= text["argmax_agreement"] <= 1.0 and set(r["decode_step_s"]) == {"float32", "bfloat16"}
    b, c, p = r["answers"]["full@0"]["mcnemar"]
    assert r["answers"]["full@0"]["exact_reference"] - r["answers"]["full@0"]["exact_dtype"] == b - c
    assert 0.0 < p <= 1.0
