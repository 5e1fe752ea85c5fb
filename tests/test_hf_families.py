"""Every causal-LM type the installed transformers ships, as a tiny random model (``arkernels.hf.tiny``): arkernels
either runs it exactly or refuses it, by what its layers do, before anything changes.

Runs: stock vs patched ``model.generate`` greedy tokens identical on a short prompt (5 tokens), one past the window
and the chunk (19 tokens; windows and chunks are 8) and a left-padded batch; ``arkernels.generate`` on the two
unpadded prompts gives stock's tokens; a counter at the attention registry proves arkernels' attention ran in every
layer on every forward, on the kernel path (never the 4D-mask fallback). Refused: the message is checked against
``REFUSED`` (the reason, by family): a new refusal, or a refused family that starts to be accepted, fails here until
it is reviewed. Skipped: only what transformers itself cannot build (the reason is its own error).

Beam search and seeded sampling on a slice (``SLICE``). fp32 throughout: stock is exact math, our kernels sum in
another order; token identity on random tiny models is the bar (logit gaps of random weights are far above fp32
noise), as in tests/test_hf_conformance.py.
"""
import collections
import warnings

import pytest
import torch
import transformers
from packaging.version import Version

import arkernels
from arkernels.hf import attention as attention_module
from arkernels.hf.attention import NAME
from arkernels.hf.capability import check_model
from arkernels.hf.tiny import CannotBuild, build_family, causal_lm_types

SHORT = [5, 6, 7, 8, 9]
LONG = [(7 * i + 3) % 250 + 3 for i in range(19)]  # 19 tokens: past the window (8) and two chunk boundaries
PADDED = torch.tensor([[0, 0, 0] + LONG[:13], LONG[2:18]])  # row 0 left padded by 3
PADDED_MASK = (torch.arange(16) >= torch.tensor([[3], [0]])).long()
NEW = 5
BLOCK = 4  # small blocks: sliding and chunked groups free blocks during the test

# family -> a regex the refusal must match (the reason in a few words)
_HYBRID = r"layer \d+ is a '(linear_attention|hybrid|hybrid_sliding|conv)' layer"
_REGISTRY = r"does not call transformers' attention registry"
_CROSS = r"is cross-attention"
_BIDIR = r"is bidirectional \(is_causal=False\)"
_MLA = r"K head dim 16 and V head dim 8 \(multi-head latent attention, MLA\)"
_SPARSE = (r"layer 0 is a '(indexed_attention|deepseek_sparse_attention|heavily_compressed_attention|"
           r"compressed_sparse_attention)' layer")
REFUSED = {
    # hybrids: recurrent / convolution states the paged K/V cache does not hold
    **{t: _HYBRID for t in ("bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "inkling2_text",
                            "inkling2_loop_text", "inkling_text", "jamba", "kimi_linear", "lara_mini", "lfm3", "mamba",
                            "minimax", "nemotron_h", "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text",
                            "qwen3_5_text", "qwen3_next", "recurrent_gemma")},
    # sparse / compressed attention
    **{t: _SPARSE for t in ("axk2", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "hy_v4")},
    "minimax_m3_vl_text": r"reworks the key / value returned by the cache update .*self.indexer",  # block-sparse
    "blt": r"names no num_hidden_layers \(not one stack of decoder layers\)",  # byte-level stacks + cross-attention
    # multi-head latent attention: K and V head dims differ
    **{t: _MLA for t in ("axk1", "deepseek_v2", "deepseek_v3", "sarvam_mla", "glm4_moe_lite", "minicpm3",
                        "longcat_flash", "youtu", "mimo_v2_flash")},
    # a sliding cache layer whose attention is told no window (stock attends over whatever keys are left)
    **{t: r"is a sliding_attention layer \(its cache keeps a window of keys\) but its attention passes no "
          r"sliding_window" for t in ("doge", "moshi", "phimoe")},
    # the cached key / value reworked before attending: the paged pools are only readable by our attention
    **{t: r"reworks the key / value returned by the cache update" for t in ("diffllama", "jetmoe")},
    # attention code of their own: arkernels attention would never run
    **{t: _REGISTRY for t in ("big_bird", "bloom", "cpmant", "falcon", "gpt_neox_japanese", "megatron-bert",
                              "modernbert-decoder", "mvp", "openai-gpt", "rembert", "roformer", "rwkv", "trocr",
                              "xglm", "xlm", "xlnet", "xlstm")},
    **{t: r"does not let transformers switch its attention implementation" for t in ("got_ocr2",)},
    # decoders of encoder-decoder models: cross-attention layers
    **{t: _CROSS for t in ("bart", "blenderbot", "blenderbot-small", "marian", "mbart", "mllama", "pegasus", "plbart",
                           "whisper")},
    "prophetnet": r"cross-attention layers \(add_cross_attention=True\)",
    # encoders used as LM heads, without is_decoder: bidirectional
    **{t: _BIDIR for t in ("bert", "bert-generation", "bigbird_pegasus", "camembert", "data2vec-text", "electra",
                           "ernie", "roberta", "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl",
                           "xmod")},
    **{t: r"configured for bidirectional attention" for t in ("gemma4_unified", "gemma4_unified_assistant",
                                                              "gemma4_unified_text")},
    "mpt": r"uses ALiBi position biases",
    "hrm_text": r"layer 0 has 2 attention modules",
    **{t: r"has no layer_idx, so it cannot address the paged cache" for t in ("git", "phi4_multimodal")},
}
if Version(transformers.__version__) < Version("5.18"):  # 5.17: these still ran their own attention code
    REFUSED.update({t: _REGISTRY for t in ("codegen", "gptj", "recurrent_gemma")})
SLICE = ("llama4_text", "gpt_oss", "gemma2", "phi3", "gpt2", "qwen3_moe", "gemma3")
TYPES = causal_lm_types()


def _build(model_type):
    try:
        return build_family(model_type)
    except CannotBuild as e:
        pytest.skip(f"transformers cannot build a tiny {model_type}: {e}")


class _Counter:
    """Wraps the registered attention function: which layers ran it, and how many calls took the 4D fallback."""

    def __init__(self, monkeypatch):
        from transformers import AttentionInterface

        self.layers: list[int] = []
        self.fallbacks = 0
        inner, fallback = attention_module.arkernels_attention, attention_module._masked_fallback

        def counted(module, *args, **kwargs):
            self.layers.append(module.layer_idx)
            return inner(module, *args, **kwargs)

        def counted_fallback(*args, **kwargs):
            self.fallbacks += 1
            return fallback(*args, **kwargs)

        attention_module.register()
        monkeypatch.setitem(AttentionInterface._global_mapping, NAME, counted)
        monkeypatch.setattr(attention_module, "_masked_fallback", counted_fallback)

    def take(self):
        layers, fallbacks = self.layers, self.fallbacks
        self.layers, self.fallbacks = [], 0
        return layers, fallbacks


def _greedy(model, ids, mask=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)


def _assert_ran_everywhere(counter, n_layers, forwards, what):
    layers, fallbacks = counter.take()
    assert fallbacks == 0, f"{what}: {fallbacks} attention calls took the 4D-mask fallback"
    # every layer on every forward (generate runs NEW forwards: the prefill and NEW - 1 decode steps), the same
    # number of times each (differential attention, DiffLlama, calls it twice per layer)
    calls = collections.Counter(layers)
    assert set(calls) == set(range(n_layers)), f"{what}: layers that ran: {sorted(calls)}"
    per_layer = calls[0]
    assert per_layer % forwards == 0 and all(c == per_layer for c in calls.values()), f"{what}: calls {calls}"


@pytest.mark.parametrize("model_type", TYPES)
def test_family(model_type, monkeypatch):
    model = _build(model_type)
    if model_type in REFUSED:
        reason = REFUSED[model_type]
        with pytest.raises(NotImplementedError, match=f"^arkernels.patch: .*{reason}"):
            arkernels.patch(model)
        assert "_prepare_cache_for_generation" not in model.__dict__ and model.config._attn_implementation != NAME
        with pytest.raises(NotImplementedError, match=f"^arkernels.generate: .*{reason}"):
            arkernels.generate(model, [SHORT], max_new_tokens=1)
        return
    check_model(model)  # accepted: a refusal here is a new one to review (add it to REFUSED)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    try:
        stock = {"short": _greedy(model, torch.tensor([SHORT])), "long": _greedy(model, torch.tensor([LONG])),
                 "padded": _greedy(model, PADDED, PADDED_MASK)}
    except Exception as e:  # noqa: BLE001  (transformers' own model fails: nothing to compare against)
        pytest.skip(f"transformers' own generate fails on a tiny {model_type}: {type(e).__name__}: {e}")
    counter = _Counter(monkeypatch)
    with arkernels.patch(model, block_size=BLOCK):
        assert model.config._attn_implementation == NAME
        for name, ids, mask in (("short", [SHORT], None), ("long", [LONG], None), ("padded", PADDED, PADDED_MASK)):
            out = _greedy(model, torch.as_tensor(ids), mask)
            _assert_ran_everywhere(counter, n_layers, NEW, f"patched generate, {name} prompt")
            assert torch.equal(out, stock[name]), f"{name}: patched {out.tolist()} != stock {stock[name].tolist()}"
    res = arkernels.generate(model, [SHORT, LONG], max_new_tokens=NEW, eos_token_id=[], block_size=BLOCK)
    _assert_ran_everywhere(counter, n_layers, NEW, "arkernels.generate")
    assert res.tokens == [stock["short"][0, len(SHORT):].tolist(), stock["long"][0, len(LONG):].tolist()]


def _modes(model, **kw):
    base = dict(max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                output_scores=True, **kw)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["beams"] = model.generate(input_ids=PADDED, attention_mask=PADDED_MASK, num_beams=3,
                                      num_return_sequences=2, do_sample=False, **base)
        torch.manual_seed(7)  # output_scores: the fused sampler steps aside, stock warpers draw with torch's seed
        out["sample"] = model.generate(input_ids=PADDED, attention_mask=PADDED_MASK, do_sample=True, temperature=0.9,
                                       top_k=20, **base)
    return out


@pytest.mark.parametrize("model_type", SLICE)
def test_family_beams_and_sampling(model_type):
    if model_type not in TYPES:
        pytest.skip(f"{model_type} is not in this transformers")
    model = _build(model_type)
    stock = _modes(model)
    with arkernels.patch(model, block_size=BLOCK):
        ours = _modes(model)
    for mode in ("beams", "sample"):
        assert torch.equal(ours[mode].sequences, stock[mode].sequences), mode
        for got, want in zip(ours[mode].scores, stock[mode].scores):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # -inf where warpers removed tokens: same set


def test_families_cover_what_the_kernels_must_get_right():
    """The tiny models above exercise what the issue names (so a family passing test_family proves it): layers
    without RoPE (SmolLM3, Llama 4's NoPE layers), chunked layers (Llama 4), per-layer head dims (Gemma 4), attention
    sinks (gpt-oss), softcapping (Gemma 2), the Gemma 3 multimodal wrapper."""
    need = {"smollm3", "llama4_text", "gemma4_text", "gpt_oss", "gemma2", "gemma3"}
    if not need <= set(TYPES):
        pytest.skip(f"not in this transformers: {sorted(need - set(TYPES))}")
    mods = {t: check_model(_build(t)) for t in sorted(need)}
    assert {a.use_rope for a in mods["smollm3"]} == {0, 1}  # NoPE and RoPE layers side by side
    llama4 = [(a.use_rope, a.config.layer_types[a.layer_idx]) for a in mods["llama4_text"]]
    assert {(1, "chunked_attention"), (0, "full_attention")} <= set(llama4)
    assert len({a.head_dim for a in mods["gemma4_text"]}) > 1
    assert all(a.sinks.shape == (a.config.num_attention_heads,) for a in mods["gpt_oss"])
    assert all(a.config.attn_logit_softcapping for a in mods["gemma2"])
    assert type(mods["gemma3"][0]).__name__ == "Gemma3Attention"


def test_gemma3_images_match_stock():
    """Gemma 3's multimodal wrapper patches for text (test_family[gemma3]); an image prompt reaches the vision tower,
    whose bidirectional attention keeps the model's own implementation (the patch selects arkernels' attention on
    the decoder only): stock's tokens and scores, the text on the paged cache."""
    if "gemma3" not in TYPES:
        pytest.skip("gemma3 is not in this transformers")
    from arkernels.hf.cache import PagedCache

    model = _build("gemma3")
    cfg = model.config
    ids = torch.tensor([[5, 6, cfg.boi_token_index] + [cfg.image_token_index] * cfg.mm_tokens_per_image
                        + [cfg.eoi_token_index, 7]])
    pixels = torch.randn(1, 3, cfg.vision_config.image_size, cfg.vision_config.image_size)
    kw = dict(input_ids=ids, pixel_values=pixels, max_new_tokens=3, do_sample=False, eos_token_id=None,
              return_dict_in_generate=True, output_scores=True)
    vision = cfg.vision_config._attn_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model.generate(**kw)
        with arkernels.patch(model, block_size=BLOCK):
            assert cfg.vision_config._attn_implementation == vision
            out = model.generate(**kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert isinstance(out.past_key_values, PagedCache)
    for got, want in zip(out.scores, ref.scores):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # our kernel sums in another order: fp32 noise
