"""arkernels.patch on tiny random models of every supported family: greedy generate token-identical to the
unpatched model (batch 2, left padding, prompts longer than the sliding windows), the sampler, undo and isolation."""
import pytest
import torch

import arkernels
from arkernels.hf.attention import NAME
from arkernels.hf.cache import PagedCache
from arkernels.hf.tiny import FAMILIES, tiny_model

# batch 2, row 0 left padded by 3; 11 positions > the tiny window of 5; block_size 4 makes sliding layers free blocks
INPUT_IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
ATTENTION_MASK = (INPUT_IDS != 0).long()
NEW_TOKENS = 12
BLOCK_SIZE = 4


def _greedy(model, **kw):
    return model.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_greedy_identical(family):
    model = tiny_model(family)
    ref = _greedy(model)
    handle = arkernels.patch(model, block_size=BLOCK_SIZE)
    try:
        out = _greedy(model, return_dict_in_generate=True)
        cache = getattr(out, "cache", None) or out.past_key_values
    finally:
        handle.undo()
    assert isinstance(cache, PagedCache)  # generate really ran on the paged cache
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("attention,cache", [(True, False), (False, True)])
def test_patch_pieces_alone(attention, cache):
    model = tiny_model("gemma3_text")
    ref = _greedy(model)
    with arkernels.patch(model, attention=attention, cache=cache, sampler=False, block_size=BLOCK_SIZE):
        out = _greedy(model)
    assert torch.equal(out, ref)


def test_patch_sampler():
    model = tiny_model("llama")
    ref = _greedy(model)
    with arkernels.patch(model, block_size=BLOCK_SIZE):
        # top_k=1 leaves one candidate: the fused sampler must return the greedy token whatever the seed
        top1 = model.generate(
            input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1,
            temperature=0.7, eos_token_id=None)
        torch.manual_seed(5)
        a = model.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=NEW_TOKENS,
                           do_sample=True, top_k=0, top_p=1.0, temperature=1.5, eos_token_id=None)
        torch.manual_seed(5)
        b = model.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=NEW_TOKENS,
                           do_sample=True, top_k=0, top_p=1.0, temperature=1.5, eos_token_id=None)
        processors = model._get_logits_processor(model.generation_config.__class__(do_sample=True, top_k=3))
    assert torch.equal(top1, ref)
    assert torch.equal(a, b)  # seeded from torch's generator: reproducible
    assert not torch.equal(a, ref)  # temperature 1.5 over 256 tokens: 24 draws all greedy would be a broken sampler
    assert type(processors[-1]).__name__ == "ArkernelsSampler"
    assert not any(type(p).__name__ == "TopKLogitsWarper" for p in processors)


def test_undo_restores_and_isolates():
    model, other = tiny_model("qwen3"), tiny_model("qwen3", seed=1)
    attn_before = model.config._attn_implementation
    ref_other = other.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=4,
                               do_sample=False, eos_token_id=None)
    handle = arkernels.patch(model)
    assert model.config._attn_implementation == NAME
    assert other.config._attn_implementation == attn_before  # patching one model leaves another alone
    out = other.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=4, do_sample=False,
                         eos_token_id=None, return_dict_in_generate=True)
    assert not isinstance(getattr(out, "cache", None) or out.past_key_values, PagedCache)
    assert torch.equal(out.sequences, ref_other)
    with pytest.raises(RuntimeError, match="already patched"):
        arkernels.patch(model)
    handle.undo()
    handle.undo()  # idempotent
    assert model.config._attn_implementation == attn_before
    for name in ("_prepare_cache_for_generation", "_get_logits_processor", "_arkernels_patch"):
        assert name not in model.__dict__
    assert model._prepare_cache_for_generation.__func__ is type(model)._prepare_cache_for_generation
    out = model.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=4, do_sample=False,
                         eos_token_id=None, return_dict_in_generate=True)
    assert not isinstance(getattr(out, "cache", None) or out.past_key_values, PagedCache)
    arkernels.patch(model).undo()  # patchable again after undo


def test_patch_unsupported_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match="supported: llama"):
        arkernels.patch(model)
    assert "_prepare_cache_for_generation" not in model.__dict__
