"""The attention + mask functions registered for transformers: the mask function's compact left-padding form and
its 4D fallback, and prefill logits of every family against stock sdpa (fp32, 1e-5) through the dense path
(DynamicCache) and the paged path (PagedCache)."""
import pytest
import torch

from arkernels.decode.inputs import cache_kwarg as _cache_kwarg
from arkernels.hf.attention import NAME, arkernels_mask, register
from arkernels.hf.cache import PagedCache
from arkernels.hf.tiny import FAMILIES, tiny_model

INPUT_IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
LEFT_PADDED = (INPUT_IDS != 0).long()
HOLED = torch.ones_like(INPUT_IDS)
HOLED[1, 4] = 0  # a hole in the middle: not left padding, the kernels cannot express it -> 4D fallback
ATOL = 1e-5  # fp32 end to end: both sides are fp32 softmax attention; differences are summation order only


def test_mask_function_forms():
    ones = torch.ones(2, 6, dtype=torch.bool)
    assert arkernels_mask(2, 6, 6, attention_mask=None) is None
    assert arkernels_mask(2, 6, 6, attention_mask=ones) is None
    left = ones.clone()
    left[0, :2] = False
    out = arkernels_mask(2, 1, 4, q_offset=5, kv_offset=2, attention_mask=left)  # a sliding layer's decode step
    # row 0: 2 pad tokens (absolute); relative to keys that start at position 2: none left
    assert out.dtype == torch.int32 and out.shape == (2, 2, 1, 1) and out.view(2, 2).tolist() == [[2, 0], [0, 0]]
    # a compileable cache's decode step (no causal skip): zeros rather than None, a prepared mask for the compiled step
    zeros = arkernels_mask(2, 1, 6, q_offset=5, attention_mask=ones, allow_is_causal_skip=False)
    assert zeros.dtype == torch.int32 and zeros.shape == (2, 2, 1, 1) and not zeros.any()
    # keys that do not end at the query (a static cache: all max_cache_len slots, q_offset a tensor): 4D fallback
    for static in (arkernels_mask(2, 1, 8, q_offset=torch.tensor(5), attention_mask=left),
                   arkernels_mask(2, 1, 8, q_offset=5, attention_mask=left)):
        assert static.dim() == 4 and static.shape[-1] == 8 and not bool(static[1, 0, 0, 6])  # slot 6 is unwritten
    holed = ones.clone()
    holed[1, 3] = False
    full = arkernels_mask(2, 6, 6, attention_mask=holed)
    assert full.dim() == 4 and full.dtype == torch.bool and not bool(full[1, 0, 5, 3]) and bool(full[1, 0, 5, 2])


def _logits(model, attention_mask, cache=None):
    kw = {}
    if cache is not None:
        kw[_cache_kwarg(model)] = cache  # 5.24 renamed past_key_values to cache
    return model(input_ids=INPUT_IDS, attention_mask=attention_mask, use_cache=True, **kw).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mask", ["left", "holed"])
def test_prefill_logits_close(family, mask):
    attention_mask = LEFT_PADDED if mask == "left" else HOLED
    model = tiny_model(family)
    real = attention_mask.bool()
    with torch.no_grad():
        ref = _logits(model, attention_mask)
        model.set_attn_implementation(register())
        try:
            dense = _logits(model, attention_mask)
            paged = _logits(model, attention_mask, PagedCache(model.config, block_size=4))
        finally:
            model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    for out in (dense, paged):
        assert torch.allclose(out[real], ref[real], atol=ATOL, rtol=0), (out[real] - ref[real]).abs().max()


def test_attention_refuses_dropout():
    from arkernels.hf.attention import arkernels_attention

    module = torch.nn.Linear(1, 1).train()
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="dropout"):
        arkernels_attention(module, q, q, q, None, scaling=1.0, dropout=0.1)


def test_name_is_safe_for_transformers():
    # transformers treats names containing these specially (hub kernels, paged continuous batching, flash paths)
    assert not any(s in NAME for s in ("flash", "/", ":", "paged|"))


class _Layer(torch.nn.Module):
    """What arkernels_attention reads of a transformers attention module."""

    def __init__(self, layer_idx=3, config=None):
        super().__init__()
        self.layer_idx, self.config, self.is_causal = layer_idx, config, True


def _qkv(B=2, Hq=4, Hkv=2, T=6, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
            torch.randn(B, Hkv, T, D, generator=g))


@pytest.mark.parametrize("kwargs,message", [
    (dict(position_bias=torch.zeros(1)), r"layer 3 \(_Layer\) passes position_bias \(a relative-position bias"),
    (dict(head_mask=torch.ones(4)), r"passes head_mask \(a per-head output mask\)"),
    (dict(cu_seq_lens_q=torch.zeros(3, dtype=torch.int32)), r"passes cu_seq_lens_q \(packed variable-length"),
    (dict(some_new_flag=1.0), r"layer 3 \(_Layer\) passes some_new_flag, which arkernels attention does not "
                              r"implement"),
    (dict(is_causal=False), r"passes is_causal=False \(bidirectional attention\)"),
    (dict(output_attentions=True), r"passes output_attentions=True \(arkernels returns no attention weights\)"),
])
def test_attention_refuses_unknown_keywords(kwargs, message):
    from arkernels.hf.attention import arkernels_attention

    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=message):
        arkernels_attention(_Layer(), q, k, v, None, scaling=0.3, **kwargs)


def test_attention_harmless_and_none_keywords_pass():
    from arkernels.hf.attention import arkernels_attention
    from arkernels.hf.capability import HARMLESS

    q, k, v = _qkv()
    ref, _ = arkernels_attention(_Layer(), q, k, v, None, scaling=0.3)
    harmless = {name: torch.zeros(1) for name in HARMLESS if name != "output_attentions"}
    out, _ = arkernels_attention(_Layer(), q, k, v, None, scaling=0.3, is_causal=True, output_attentions=False,
                                 some_new_flag=None, position_bias=None, **harmless)
    assert torch.equal(out, ref)


def test_attention_refuses_bidirectional_module():
    from arkernels.hf.attention import arkernels_attention

    layer = _Layer()
    layer.is_causal = False  # a vision tower's attention under the patch (Gemma 3 images)
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=r"layer 3 \(_Layer\) passes is_causal=False \(bidirectional "
                                                  r"attention\).* \(a vision or audio tower under the patch"):
        arkernels_attention(layer, q, k, v, None, scaling=0.3)


def test_attention_sinks_match_gpt_oss_eager():
    """gpt-oss' own eager attention (sinks in the softmax denominator) vs ours, dense and through the 4D fallback."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from arkernels.hf.attention import _masked_fallback, arkernels_attention

    class GptOssLike(_Layer):  # the fallback looks up the eager attention of the module's model
        __module__ = eager_attention_forward.__module__

    q, k, v = _qkv(seed=1)
    layer = GptOssLike()
    layer.num_key_value_groups, layer.training = 2, False
    layer.sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    ref, _ = eager_attention_forward(layer, q, k, v, torch.zeros(2, 1, 6, 6).masked_fill(~causal, float("-inf")),
                                     scaling=0.3, s_aux=layer.sinks)
    out, _ = arkernels_attention(layer, q, k, v, None, scaling=0.3, s_aux=layer.sinks)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    no_sink, _ = arkernels_attention(layer, q, k, v, None, scaling=0.3)
    assert (no_sink - ref).abs().max() > 1e-2  # the sinks matter at this size: a dropped sink cannot pass
    fallback, _ = _masked_fallback(layer, q, k, v, causal, 0.3, None, layer.sinks)
    torch.testing.assert_close(fallback, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kv_offset", [0, 5, 8, 11])
def test_chunked_dense_keys_with_offset(kv_offset):
    """A chunked layer (Llama 4) over dense keys that start at kv_offset (transformers' DynamicCache keeps the last
    C - 1 keys of a chunked layer): our mask + attention vs sdpa over transformers' own chunked mask."""
    from transformers import Llama4TextConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

    C, q_len, kv_len = 4, 3, 7
    config = Llama4TextConfig(num_hidden_layers=2, attention_chunk_size=C,
                              layer_types=["chunked_attention", "full_attention"])
    layer = _Layer(layer_idx=0, config=config)
    layer.num_key_value_groups = 2
    pad = torch.tensor([2, 0])
    mask_2d = (torch.arange(kv_offset + kv_len) >= pad[:, None]).long()
    q, k, v = _qkv(T=kv_len, seed=2)
    q = q[:, :, -q_len:]
    kw = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=kv_offset + kv_len - q_len,
              kv_offset=kv_offset, attention_mask=mask_2d.bool(), local_size=C, config=config)
    ours_mask = arkernels_mask(mask_function=chunked_causal_mask_function(C, pad), **kw)
    want_mask = sdpa_mask(mask_function=chunked_causal_mask_function(C, pad), allow_is_causal_skip=False,
                          **{n: kw[n] for n in ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset",
                                                "attention_mask")})
    out, _ = arkernels_attention_fn()(layer, q, k, v, ours_mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(layer, q, k, v, want_mask, scaling=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    if kv_offset:
        layer.config = None  # not chunked: the same keys and mask give another result (the chunk rule ran above)
        plain, _ = arkernels_attention_fn()(layer, q, k, v, ours_mask, scaling=0.3)
        assert (plain - ref).abs().max() > 1e-3


def arkernels_attention_fn():
    from arkernels.hf.attention import arkernels_attention

    return arkernels_attention
