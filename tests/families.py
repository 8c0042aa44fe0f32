"""Tiny random decoder models of every family the engine supports, built from transformers' own config
classes (no download): the fixtures of `tests/test_families.py`.

Each family is a config at tiny size (2-4 layers, hidden 64, 4 query heads, 2 KV heads, head_dim 16) with
the feature that sets the family apart switched on and made to bite at test lengths: sliding windows of 16
tokens (prompts are 20-60 tokens), Granite's `attention_multiplier`, Gemma's `query_pre_attn_scalar` and
logit soft-capping, gpt-oss's learned sinks, partial rotary, llama3 rope scaling, mixture-of-experts MLPs.
"""

from __future__ import annotations

import torch

WINDOW = 16  # sliding window of the sliding-window families: shorter than every test prompt
VOCAB = 256  # >= the bundled tokenizer's 234 ids, so the bundled tokenizer can serve every model
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=2,
              eos_token_id=3, tie_word_embeddings=False)


def _configs():
    import transformers as tf

    hybrid = ["sliding_attention", "full_attention", "sliding_attention"]
    return {
        "llama": (tf.LlamaConfig, {}),
        "llama3_rope": (tf.LlamaConfig, dict(rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
        "mistral": (tf.MistralConfig, dict(sliding_window=None)),
        "mistral_sliding": (tf.MistralConfig, dict(sliding_window=WINDOW)),
        "qwen2": (tf.Qwen2Config, {}),
        "qwen2_sliding": (tf.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                               num_hidden_layers=3)),
        "qwen3": (tf.Qwen3Config, {}),
        "qwen3_moe": (tf.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              decoder_sparse_step=1)),
        "phi3": (tf.Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=WINDOW, original_max_position_embeddings=512)),
        "gemma2": (tf.Gemma2Config, dict(query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=30.0, sliding_window=WINDOW, layer_types=hybrid,
                                         num_hidden_layers=3)),
        "gemma3": (tf.Gemma3TextConfig, dict(query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=hybrid,
                                             num_hidden_layers=3)),
        "gpt_oss": (tf.GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                          layer_types=hybrid, num_hidden_layers=3, rope_parameters={
                                              "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                              "original_max_position_embeddings": 64})),
        "olmo2": (tf.Olmo2Config, {}),
        "granite": (tf.GraniteConfig, dict(attention_multiplier=0.1, embedding_multiplier=2.0, residual_multiplier=0.5,
                                           logits_scaling=2.0)),
        "gpt_neox": (tf.GPTNeoXConfig, dict(rotary_pct=0.5)),
        "phi": (tf.PhiConfig, dict(partial_rotary_factor=0.5)),
    }


FAMILIES = tuple(_configs())


def family_config(name: str):
    """The tiny transformers config of family `name` (one of `FAMILIES`)."""
    cls, extra = _configs()[name]
    return cls(**{**COMMON, **extra})


# Weights are drawn with std 0.2 so that greedy decoding is decisive (no near-ties between the two best
# logits). gpt-oss (experts + sinks) at 0.2 amplifies fp32 rounding so much that two equivalent computations
# of the model itself (its own sliding-window cache vs a full cache) differ by 1.6e-5 in the logits; at 0.1
# they differ by 2.5e-6, under the 1e-5 the tests hold every family to.
INIT_STD = {"gpt_oss": 0.1}


def family_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random `...ForCausalLM` of family `name`, eval mode, on CPU (weight std: `INIT_STD`, else 0.2)."""
    from transformers import AutoModelForCausalLM

    config = family_config(name)
    config.initializer_range = INIT_STD.get(name, 0.2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for mod in model.modules():
            if getattr(mod, "sinks", None) is not None:  # gpt-oss: learned sinks start at zero
                mod.sinks.normal_(0.0, 1.0)
    return model.eval()
