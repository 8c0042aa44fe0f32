"""KVzip's CPU cost on SmolLM2-135M (docs/policies.md, "KVzip"): `python tools/kvzip_cost.py` from the repository root.

KVzip (arXiv:2505.23416, as kvpress' `KVzipPress` with one 2048-token chunk) scores a prefilled cache by running the
model again on "Repeat the previous context exactly." + the context over that cache, then taking, per layer and KV
head, the max attention each context key receives from those queries. Timed here: one prefill of 2048 tokens, the
reconstruction forward, and the scoring (queries x [4 sinks, the chunk, the repeat] keys, softmax, max per KV group),
each the fastest of its runs, fp32, one torch thread. Prints one line.
"""

import copy
import math
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from tdutils.models import load_model

T = 2048


def fastest(f, runs: int = 2) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32", progress=False)
    cfg = model.config
    ids = tok(Path("README.md").read_text(encoding="utf-8") * 4)["input_ids"][:T]
    rep = tok.encode("\n\nRepeat the previous context exactly.\n", add_special_tokens=False) + ids
    L, hq, h = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    d, g = cfg.hidden_size // hq, hq // h

    def prefill():
        cache = DynamicCache(config=cfg)
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    with torch.inference_mode():
        t_prefill = fastest(prefill)
        cache = prefill()
        t_repeat = fastest(lambda: model(input_ids=torch.tensor([rep]), cache=copy.deepcopy(cache), use_cache=True,
                                         logits_to_keep=1, position_ids=torch.arange(T, T + len(rep))[None]))
        q = torch.randn(h, g * len(rep), d)  # [H, g * q_len, d]: one layer's reconstruction queries by KV group
        k = torch.randn(h, 4 + T + len(rep), d)  # sinks, the chunk, the repeat

        def score():
            for _ in range(L):
                (q @ k.transpose(1, 2) / math.sqrt(d)).softmax(-1)[..., 4:4 + T].amax(dim=1)

        t_score = fastest(score, 1)
    print(f"SmolLM2-135M fp32, 1 thread, T={T}: prefill {t_prefill:.2f} s; reconstruction forward ({len(rep)} tokens "
          f"over the {T}-token cache) {t_repeat:.2f} s; scoring {t_score:.2f} s; KVzip adds "
          f"{(t_repeat + t_score) / t_prefill:.2f}x the prefill")


if __name__ == "__main__":
    main()
