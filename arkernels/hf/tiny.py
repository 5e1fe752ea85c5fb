"""Tiny random-weight decoders of every supported family, built from one seed (tests, demo fallback, CI benchmarks).

All share: vocab 256, hidden 64, 2 layers, GQA 4/2 heads, head_dim 16, pad 0 / bos 1 / eos 2. Windows are short
(5 keys) so that an 8+ token prompt already slides.
"""
from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
TINY_WINDOW = 5
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_model(family: str, seed: int = 0, *, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random ``*ForCausalLM`` of ``family`` (one of ``FAMILIES``), in eval mode."""
    import transformers as tf

    cfg = dict(_COMMON)
    if family == "llama":
        cls, conf = tf.LlamaForCausalLM, tf.LlamaConfig
    elif family == "mistral":  # one window for every layer, shorter than the test prompts
        cls, conf = tf.MistralForCausalLM, tf.MistralConfig
        cfg.update(sliding_window=TINY_WINDOW, head_dim=16)
    elif family == "qwen2":  # per-layer windows: layer 0 full, layer 1 sliding
        cls, conf = tf.Qwen2ForCausalLM, tf.Qwen2Config
        cfg.update(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1)
    elif family == "qwen3":
        cls, conf = tf.Qwen3ForCausalLM, tf.Qwen3Config
        cfg.update(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1, head_dim=16)
    elif family == "gemma3_text":  # interleaved sliding / full layers, its own query scaling
        cls, conf = tf.Gemma3ForCausalLM, tf.Gemma3TextConfig
        cfg.update(sliding_window=TINY_WINDOW, head_dim=16, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(f"tiny_model: unknown family {family!r}; one of {FAMILIES}")
    cfg.update(overrides)
    torch.manual_seed(seed)
    return cls(conf(**cfg)).to(dtype).eval()
