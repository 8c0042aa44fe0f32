"""Record, then check, the hf engine's decode outputs under many settings: a refactor of the engine's decode
path (scheduler, sampling, decode-time compression, extend) must leave them bit-identical.

    PYTHONPATH=. python tools/decode_golden.py record /tmp/before.pt   # on the commit before the change
    PYTHONPATH=. python tools/decode_golden.py check /tmp/before.pt    # after it: exit 1 naming what differs

Models: the bundled tiny-qwen3 and tiny random gemma3 (sliding windows) and llama (tests/families.py). Settings,
at both positions and with no / a tight / a batch-capped budget: mixed max_tokens, EOS honoured, temperature with
seed and kept logits, forced ids, decode-time compression (knorm, snapkv, rkv with sampling and EOS), preemption
(blocks of 8 tokens, EOS honoured, tight budgets, with sampling, compression and forcing), modify + extend,
chunked prefill with compression. Compared: token ids, texts, finish reasons, cut events, logits, decode
metrics, caches after extend, and the exact error messages of the settings that are refused.
"""
import math
import sys
import warnings

import torch

torch.set_num_threads(1)
sys.path.insert(0, "tests")
from families import family_model

from tdutils.compression import Compression
from tdutils.edit import make_drop_fn
from tdutils.engines.hf import HFEngine
from tdutils.models import load_tokenizer


def set_block(n):
    for modname in ("tdutils.engines.hf", "tdutils.engines.scheduler"):
        mod = sys.modules.get(modname)
        if mod is not None and hasattr(mod, "KV_BLOCK_TOKENS"):
            mod.KV_BLOCK_TOKENS = n

def outs(eng, o):
    d = eng.metrics.decode
    return {"ids": [x.output_ids for x in o], "fin": [x.finish_reason for x in o], "text": [x.text for x in o],
            "answer": [x.answer for x in o], "cached": [x.cached_tokens for x in o], "prompt": [x.prompt_tokens for x in o],
            "comp": [x.compressions for x in o], "logits": [None if x.logits is None else torch.stack(x.logits) for x in o],
            "m": (d.preemptions, d.steps, d.peak_batch_size, d.kv_peak_reserved_tokens, d.kv_peak_cache_tokens,
                  d.kv_storage_tokens, d.kv_storage_bytes, d.compressions, d.output_tokens, d.kv_budget_tokens)}

def run(name, eng, prompts):
    res = {}
    g = torch.Generator().manual_seed(1)
    forced = [torch.randint(4, 200, (40,), generator=g).tolist() for _ in prompts]
    settings = {
        "greedy_mixed": {"max_tokens": [12, 30, 7, 20][:len(prompts)]},
        "eos": {"max_tokens": 40, "ignore_eos": False},
        "temp_seed": {"max_tokens": [10, 25, 15, 5][:len(prompts)], "temperature": 0.8, "seed": 7, "keep_logits": True},
        "forced": {"max_tokens": 20, "forced_ids": forced, "keep_logits": True},
        "comp_knorm": {"max_tokens": [40, 30, 50, 20][:len(prompts)], "compression": Compression("knorm", budget=16, buffer=8)},
        "comp_snapkv": {"max_tokens": [40, 30, 50, 20][:len(prompts)], "compression": Compression("snapkv", budget=24, buffer=8, window=8)},
        "comp_eos_temp": {"max_tokens": 45, "ignore_eos": False, "temperature": 0.9, "seed": 3, "compression": Compression("rkv", budget=20, buffer=8, window=4)},
    }
    budgets = {None: None, "tight": 130, "batch2": None}
    for pos in ("compact", "original"):
        eng.positions = pos
        for bname, budget in budgets.items():
            eng.kv_budget_tokens = budget
            eng.max_batch_size = 2 if bname == "batch2" else None
            for sname, kw in settings.items():
                eng.prefill(prompts)
                key = f"{name}/{pos}/{bname}/{sname}"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        res[key] = outs(eng, eng.decode(**kw))
                except (ValueError, TypeError, RuntimeError) as e:
                    res[key] = f"{type(e).__name__}: {e}"
        # preemption: blocks of 8 tokens, EOS honoured, tight budget
        set_block(8)
        try:
            for budget in (80, 100):
                for sname, kw in (("eos_pre", {"max_tokens": [30, 45, 20, 38][:len(prompts)], "ignore_eos": False}),
                                  ("eos_pre_temp", {"max_tokens": 40, "ignore_eos": False, "temperature": 0.7, "seed": 11}),
                                  ("eos_pre_comp", {"max_tokens": 40, "ignore_eos": False, "compression": Compression("snapkv", budget=20, buffer=8, window=4)}),
                                  ("eos_pre_forced", {"max_tokens": 30, "ignore_eos": False, "forced_ids": forced, "keep_logits": True})):
                    eng.kv_budget_tokens, eng.max_batch_size = budget, None
                    eng.prefill(prompts)
                    key = f"{name}/{pos}/pre{budget}/{sname}"
                    try:
                        res[key] = outs(eng, eng.decode(**kw))
                    except (ValueError, TypeError, RuntimeError) as e:
                        res[key] = f"{type(e).__name__}: {e}"
        finally:
            set_block(256)
        # modify + extend + decode; chunked prefill with compression
        eng.kv_budget_tokens, eng.max_batch_size = None, None
        eng.prefill(prompts)
        eng.modify(make_drop_fn("snapkv", drop_ratio=0.4, model_config=eng.facts, rerotate=pos == "compact"))
        eng.extend([[7, 8, 9, 10, 11], [12, 13], [14, 15, 16], [17]][:len(prompts)])
        res[f"{name}/{pos}/extend_kv"] = [eng.kv(i).clone() for i in range(len(prompts))]
        res[f"{name}/{pos}/extend"] = outs(eng, eng.decode(15))
        eng.prefill(prompts, chunk=16, compression=Compression("snapkv", budget=20, buffer=8, window=4))
        res[f"{name}/{pos}/chunked_kv"] = [eng.kv(i).clone() for i in range(len(prompts))]
        res[f"{name}/{pos}/chunked"] = outs(eng, eng.decode(12, compression=Compression("snapkv", budget=20, buffer=8, window=4)))
    return res

def main():
    mode, path = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 200, (n,), generator=g).tolist() for n in (20, 35, 50, 28)]
    res = {}
    eng = HFEngine("tiny-qwen3", progress=False)
    res.update(run("qwen3", eng, prompts))
    tok = load_tokenizer("tiny-qwen3")
    for fam in ("gemma3", "llama"):
        eng = HFEngine(family_model(fam), tokenizer=tok, progress=False)
        res.update(run(fam, eng, prompts[:3]))
    errs = sum(isinstance(v, str) for v in res.values())
    pre = sum(v["m"][0] for v in res.values() if isinstance(v, dict))
    comps = sum(v["m"][7] for v in res.values() if isinstance(v, dict))
    print(f"{len(res)} cases, {errs} errors, {pre} preemptions, {comps} compressions")
    for k, v in res.items():
        if isinstance(v, str): print("  ", k, v[:150])
    if mode == "record":
        torch.save(res, path)
        return
    want = torch.load(path, weights_only=False)
    bad = []
    def eq(a, b):
        if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, (list, tuple)): return type(a) is type(b) and len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
        if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
        if isinstance(a, float) and math.isnan(a): return isinstance(b, float) and math.isnan(b)
        return a == b
    for k in want.keys() | res.keys():
        if k not in want or k not in res or not eq(want[k], res[k]):
            bad.append(k)
    print("MISMATCH:" if bad else "all bit-identical", sorted(bad)[:20])
    sys.exit(1 if bad else 0)

main()
