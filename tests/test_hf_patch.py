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
    with arkernels.patch(model, block_size=BLOCK_SIZE, sampler=True):
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


# sampler="auto" (the default): transformers' processors serve greedy calls and every CPU call, so stock's seeded
# tokens come out exactly; the fused draw takes sampling calls on a CUDA device only
AUTO_CASES = {
    "sample": dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.9),
    "sample+rules": dict(do_sample=True, temperature=1.2, repetition_penalty=1.3, min_new_tokens=4, eos_token_id=2),
    "greedy+rules": dict(do_sample=False, repetition_penalty=1.5, bad_words_ids=[[7]], min_new_tokens=4,
                         eos_token_id=2, suppress_tokens=[3]),
}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_sampler_auto_is_stock_on_the_cpu(case):
    from arkernels.hf.sampler_hook import ArkernelsSampler

    model = tiny_model("llama")
    kw = dict(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=NEW_TOKENS, pad_token_id=0,
              **AUTO_CASES[case])
    torch.manual_seed(11)
    ref = model.generate(**kw)
    with arkernels.patch(model, block_size=BLOCK_SIZE):
        before = ArkernelsSampler.calls
        torch.manual_seed(11)
        out = model.generate(**kw)
        assert ArkernelsSampler.calls == before  # no fused draw on the CPU
    assert torch.equal(out, ref)


def test_sampler_auto_fuses_sampling_on_cuda_only():
    from transformers import GenerationConfig

    from arkernels.hf.sampler_hook import ArkernelsSampler

    model = tiny_model("llama")
    sample = GenerationConfig(do_sample=True, top_k=5, repetition_penalty=1.2)
    greedy = GenerationConfig(do_sample=False, repetition_penalty=1.2)
    for config in (sample, greedy):
        config._eos_token_tensor = None  # what generate sets before it builds the processors
    with arkernels.patch(model, block_size=BLOCK_SIZE):
        got = {(name, device): model._get_logits_processor(config, input_ids_seq_length=3, device=device)
               for name, config in (("sample", sample), ("greedy", greedy)) for device in ("cpu", "cuda")}
    with arkernels.patch(model, block_size=BLOCK_SIZE, sampler=True):
        forced = model._get_logits_processor(greedy, input_ids_seq_length=3, device="cpu")
    fused = {k: any(isinstance(p, ArkernelsSampler) for p in v) for k, v in got.items()}
    assert fused == {("sample", "cpu"): False, ("sample", "cuda"): True, ("greedy", "cpu"): False,
                     ("greedy", "cuda"): False}
    assert type(forced[-1]) is ArkernelsSampler and len(forced) == 1  # True: the rules fused into the draw
    with pytest.raises(ValueError, match="arkernels.patch: sampler must be 'auto', True or False"):
        arkernels.patch(model, sampler="cuda")


# ids stock accepts and its isin-based processors ignore (generate warns about an EOS of -1 and runs)
IGNORED_IDS = {"eos -1": dict(min_new_tokens=4, eos_token_id=-1),
               "eos past the vocabulary": dict(min_new_tokens=4, eos_token_id=[2, 5000]),
               "suppress outside the vocabulary": dict(suppress_tokens=[-5, 3, 100000])}


@pytest.mark.parametrize("case", list(IGNORED_IDS))
def test_fused_rules_ignore_the_ids_stock_ignores(case):
    from arkernels.hf.sampler_hook import ArkernelsSampler

    model = tiny_model("llama")
    kw = dict(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0, **IGNORED_IDS[case])
    ref = model.generate(**kw)
    with arkernels.patch(model, block_size=BLOCK_SIZE, sampler=True):
        before = ArkernelsSampler.calls
        out = model.generate(**kw)
        assert ArkernelsSampler.calls > before  # the fused draw served it
    assert torch.equal(out, ref)


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


def test_patch_refuses_before_changing_anything():
    # falcon's attention runs its own code, not transformers' registry: our attention would never run
    from arkernels.hf.tiny import tiny_causal_lm

    model = tiny_causal_lm("falcon")
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=r"^arkernels.patch: FalconForCausalLM \(model type 'falcon'\): "
                       r"layer 0 \(FalconAttention\) does not call transformers' attention registry"):
        arkernels.patch(model)
    assert "_prepare_cache_for_generation" not in model.__dict__
    assert model.config._attn_implementation == before


def test_check_model_needs_generate():
    from transformers import LlamaConfig, LlamaModel

    from arkernels.hf.capability import check_model

    with pytest.raises(TypeError, match="LlamaModel has no generate"):
        check_model(LlamaModel(LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=64)))


class _Param:  # what _check_device reads of a parameter: a CUDA device without a GPU
    def __init__(self, device, dtype):
        self.device, self.dtype = torch.device(device), dtype


class _Stub(torch.nn.Module):
    def __init__(self, device, dtype):
        super().__init__()
        self._param = _Param(device, dtype)

    def parameters(self, recurse=True):
        return iter([self._param])


def test_check_model_cuda_head_dims_and_dtypes():
    from arkernels.hf.capability import _check_device

    attn = tiny_model("llama").model.layers[0].self_attn  # head_dim 16: CPU only
    with pytest.raises(NotImplementedError, match=r"layer 0 \(LlamaAttention\) has head_dim 16; the CUDA kernels "
                                                  r"are built for 64, 80, 96, 128, 256"):
        _check_device("arkernels.patch", "m", [attn], _Stub("cuda", torch.bfloat16))
    _check_device("arkernels.patch", "m", [attn], _Stub("cpu", torch.float32))  # the CPU kernel covers it
    attn.head_dim = 64
    with pytest.raises(NotImplementedError, match=r"is torch.float32 on CUDA; the CUDA kernels take float16"):
        _check_device("arkernels.patch", "m", [attn], _Stub("cuda", torch.float32))
    _check_device("arkernels.patch", "m", [attn], _Stub("cuda", torch.float16))
    attn.head_dim = 576
    with pytest.raises(NotImplementedError, match=r"has head_dim 576; arkernels' kernels take at most 512"):
        _check_device("arkernels.patch", "m", [attn], _Stub("cpu", torch.float32))


def test_check_model_refuses_ops_without_sinks_or_chunks(monkeypatch):
    from arkernels.hf import capability
    from arkernels.hf.tiny import tiny_causal_lm

    monkeypatch.setattr(capability, "_ops_support", lambda name: False)  # a build from before sinks / chunk_size
    with pytest.raises(NotImplementedError, match=r"layer 0 \(GptOssAttention\) passes s_aux \(attention sinks\) "
                                                  r"and this build's window_attention has no sinks"):
        capability.check_model(tiny_causal_lm("gpt_oss"))
    with pytest.raises(NotImplementedError, match=r"has chunked_attention layers and this build's window_attention "
                                                  r"has no chunk_size"):
        capability.check_model(tiny_causal_lm("llama4_text"))


def test_check_model_refuses_unknown_keyword_statically():
    # a layer whose forward hands the attention function a keyword arkernels does not know refuses at patch time
    import transformers.models.llama.modeling_llama as ml
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401  (the name the source reads)

    from arkernels.hf.capability import check_model

    class BiasedAttention(ml.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
            return attention_interface(self, hidden_states, hidden_states, hidden_states, attention_mask,
                                       scaling=self.scaling, position_bias=None, **kwargs)

    model = tiny_model("llama")
    layer = model.model.layers[1]
    old = layer.self_attn
    layer.self_attn = BiasedAttention(model.config, 1)
    with pytest.raises(NotImplementedError, match=r"layer 1 \(BiasedAttention\) passes position_bias \(a "
                                                  r"relative-position bias added to the scores\) to the attention "
                                                  r"function, which arkernels attention does not implement"):
        check_model(model)
    layer.self_attn = old
    check_model(model)
