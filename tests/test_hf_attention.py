"""The attention + mask functions registered for transformers: the mask function's compact left-padding form and
its 4D fallback, and prefill logits of every family against stock sdpa (fp32, 1e-5) through the dense path
(DynamicCache) and the paged path (PagedCache)."""
import pytest
import torch

from arkernels.generate import _cache_kwarg
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
