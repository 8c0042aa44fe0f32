"""Write the bundled tiny model `tdutils/assets/tiny-qwen3/` (config, seeded random weights, tokenizer).

    python tools/make_tiny_model.py            # rewrites the assets
    python tools/make_tiny_model.py --sample   # also rewrites the bundled passkey sample

The weights are random from a fixed seed: the model exercises every code path (GQA, RoPE, q/k norms)
but answers nothing correctly. Training it on passkey retrieval is a separate tool.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import Qwen3ForCausalLM

from tdutils.data import SAMPLE_PATH, filler_words, make_passkey_dataset
from tdutils.models import TINY_MODEL_DIR, build_tiny_tokenizer, tiny_qwen3_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", action="store_true", help="also regenerate the bundled passkey sample")
    args = ap.parse_args()

    tok = build_tiny_tokenizer(filler_words())
    cfg = tiny_qwen3_config(len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg)
    TINY_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(TINY_MODEL_DIR)
    tok.save_pretrained(TINY_MODEL_DIR)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {TINY_MODEL_DIR} ({n_params} parameters, vocabulary {len(tok)})")

    if args.sample:
        # 16 prompts of ~1024 tokens: the default workload of `python -m tdutils run`.
        rows = make_passkey_dataset(16, 1024, tokenizer=tok, seed=1234)
        with open(SAMPLE_PATH, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {SAMPLE_PATH} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
