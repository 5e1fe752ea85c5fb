"""Tiny random-weight decoders, built from one seed (tests, demo fallback, CI benchmarks).

``tiny_model(family)``: the five families the hand-written tests grew up on (``FAMILIES``). All share: vocab 256,
hidden 64, 2 layers, GQA 4/2 heads, head_dim 16, pad 0 / bos 1 / eos 2. Windows are short (5 keys) so that an 8+
token prompt already slides.

``tiny_causal_lm(model_type)`` / ``build_family``: any causal-LM type of the installed transformers
(``causal_lm_types()``), from ``AutoConfig.for_model`` with ``TINY_TEXT`` sizes (tests/test_hf_families.py,
scripts/families_table.py).
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


# ---- every causal-LM type transformers ships, as a tiny random model (the families conformance test, the table) ----
# Sizes every config field of that name gets, when the config class has such a field (dataclass fields; properties
# such as FalconConfig.head_dim are derived and left alone). The window and the chunk are 8 so that a 19-token prompt
# and its decode run past them; 4 layers so interleaved patterns (sliding/full, NoPE every other layer) show up.
TINY_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_kv_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, sliding_window=8, attention_chunk_size=8, sliding_window_pattern=2, no_rope_layer_interval=2,
    # mixture of experts: 4 experts, 2 per token, small expert MLPs
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
    # multi-head latent attention (DeepSeek): small ranks, and K (nope + rope = 16) and V (8) head dims that differ,
    # as in every MLA checkpoint (DeepSeek-V3: 192 and 128)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    # GPT-2 / encoder-decoder naming of the same sizes
    n_embd=64, n_layer=4, n_head=4, n_positions=256, n_ctx=256, d_model=64, decoder_layers=4, encoder_layers=1,
    decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128, ffn_dim=128,
    num_layers=4, num_heads=4, d_ff=128, n_inner=128, ffn_hidden_size=128, rotary_dim=8,
    # per-layer input embeddings (Gemma 3n / 4): the default table is 262144 x 256 per layer
    vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
    # multimodal wrappers (Gemma 3): image tokens inside the tiny vocabulary, 2 x 2 pooled image tokens
    mm_tokens_per_image=4, image_token_index=250, boi_token_index=251, eoi_token_index=252,
)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                   patch_size=8, depth=1, embed_dim=32, num_heads=2)


def _fields(config_class) -> set[str]:
    import dataclasses

    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    import inspect

    return set(inspect.signature(config_class.__init__).parameters)


def _tiny_kwargs(config_class, sizes: dict) -> dict:
    fields = _fields(config_class)
    return {k: v for k, v in sizes.items() if k in fields}


def tiny_config(model_type: str, **overrides):
    """A tiny config of ``model_type`` from ``AutoConfig.for_model``: ``TINY_TEXT`` sizes where the config has those
    fields; composite (multimodal) configs get them on their text config and ``TINY_VISION`` on a vision config."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kw = _tiny_kwargs(cls, TINY_TEXT)
    for key, sub in getattr(cls, "sub_configs", {}).items():
        default = getattr(cls(), key, None)
        if default is None:
            continue
        sizes = TINY_VISION if "vision" in key else TINY_TEXT
        kw[key] = {"model_type": default.model_type, **_tiny_kwargs(type(default), sizes)}
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def tiny_causal_lm(model_type: str, seed: int = 0, *, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random model of ``model_type`` as ``AutoModelForCausalLM`` builds it (``*ForCausalLM``, or the
    ``*ForConditionalGeneration`` wrapper multimodal types map to), in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class CannotBuild(Exception):
    """transformers itself cannot build a tiny random model of this type (the reason is the message)."""


def build_family(model_type: str, seed: int = 0, *, timeout_s: int = 30):
    """``tiny_causal_lm(model_type)``, or ``CannotBuild`` naming transformers' own error (a missing optional
    dependency, a config that rejects small sizes, a model class without a ``generate``), within ``timeout_s``."""
    import signal
    import warnings

    def _late(*_):
        raise TimeoutError(f"building took over {timeout_s} s")

    old = signal.signal(signal.SIGALRM, _late) if timeout_s else None
    if timeout_s:
        signal.alarm(timeout_s)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_causal_lm(model_type, seed)
    except Exception as e:  # noqa: BLE001  (every reason transformers gives is reported as it is)
        raise CannotBuild(f"{type(e).__name__}: {' '.join(str(e).split())[:160]}") from e
    finally:
        if timeout_s:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    return model
