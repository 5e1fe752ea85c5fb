"""A patched model does what a stock one does: every generation mode, stock vs patched, identical tokens.

Cases written from transformers' documented behaviour of ``generate`` (not from its test code). Each case runs the
same call on the stock tiny model and on the same model under ``arkernels.patch`` and compares tokens exactly and
scores / logits within fp32 noise (atol 1e-4 on logits of order 1: our attention kernel sums in another order).

Grid (kept under ~2.5 min per transformers version on 2 cores): the full mode list for llama (full attention only)
and gemma3_text (interleaved sliding + full layers, the hardest cache); a representative slice (greedy with left
padding, beam search) for mistral (sliding only), qwen2 and qwen3 (per-layer windows). Sampled
modes compare under the same torch seed with ``output_scores=True`` (the fused sampler then steps aside, so stock
warpers draw with torch's generator: identical); the fused sampler itself is checked where it takes over. A
compiled forward (``compile_config`` + static cache) runs once, for llama.

Last section: ``torch.compile(fullgraph=True)`` over the ops with their default ``check=True``.
"""
import inspect
import warnings

import pytest
import torch

from transformers import DynamicCache

import arkernels
from arkernels.hf.cache import PagedCache
from arkernels.hf.tiny import tiny_model

from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather
from arkernels.ops.window_attention import window_attention

# batch 2, row 0 left padded by 3; 10 positions > the tiny window of 5; block_size 4: sliding layers free blocks
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
MASK = (IDS != 0).long()
REPEATING = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # prompt lookup finds n-gram matches
NEW = 6
BLOCK = 4
FULL_GRID = ["llama", "gemma3_text"]
SLICE = ["mistral", "qwen2", "qwen3"]
SLICE_MODES = ["greedy_left_pad", "beam_search"]
# greedy_scores_logits is greedy with left padding plus scores and logits; beams_inputs_embeds covers inputs_embeds
MODES = ["greedy_scores_logits", "sample_scores", "num_return_sequences_sample", "beam_search", "beam_sample",
         "beams_inputs_embeds", "assisted", "assisted_sample", "prompt_lookup", "continue_from_cache", "static_cache"]
CASES = [(f, m) for f in FULL_GRID for m in MODES] + [(f, m) for f in SLICE for m in SLICE_MODES]
_models = {}


def _model(family, seed=0):
    if (family, seed) not in _models:
        _models[family, seed] = tiny_model(family, seed=seed)
    return _models[family, seed]


def _cache_kwarg(model):  # transformers 5.24 renamed past_key_values to cache
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    return getattr(out, "cache", None) or out.past_key_values


_ASSISTANT_TOKENS = 20  # transformers' default draft length for assisted decoding


def _run(model, mode, seed=0):
    """One generate call of ``mode``; returns what must match stock (a dict of tensors)."""
    kw = dict(max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    dict_out = dict(return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(seed)
    if mode == "greedy_left_pad":
        out = model.generate(input_ids=IDS, attention_mask=MASK, do_sample=False, **kw, **dict_out)
    elif mode == "greedy_scores_logits":
        out = model.generate(input_ids=IDS, attention_mask=MASK, do_sample=False, output_logits=True, **kw, **dict_out)
    elif mode == "sample_scores":
        out = model.generate(input_ids=IDS, attention_mask=MASK, do_sample=True, temperature=0.8, top_k=20,
                             top_p=0.9, **kw, **dict_out)
    elif mode == "num_return_sequences_sample":
        out = model.generate(input_ids=IDS, attention_mask=MASK, do_sample=True, num_return_sequences=3, min_p=0.05,
                             **kw, **dict_out)
    elif mode == "beam_search":
        out = model.generate(input_ids=IDS, attention_mask=MASK, num_beams=3, num_return_sequences=2,
                             do_sample=False, **kw, **dict_out)
    elif mode == "beam_sample":
        out = model.generate(input_ids=IDS, attention_mask=MASK, num_beams=2, do_sample=True, temperature=0.9,
                             **kw, **dict_out)
    elif mode == "beams_inputs_embeds":
        out = model.generate(inputs_embeds=model.get_input_embeddings()(IDS), attention_mask=MASK, num_beams=2,
                             do_sample=False, **kw, **dict_out)
    elif mode in ("assisted", "assisted_sample"):
        assistant = _model(model.config.model_type, seed=1)
        # transformers' "heuristic" schedule writes the adapted draft length back into the assistant's generation
        # config after every call: start each call from the same length, or the second run of a pair drafts a
        # different number of tokens and (when sampling) consumes the random stream differently from the first
        assistant.generation_config.num_assistant_tokens = _ASSISTANT_TOKENS
        out = model.generate(input_ids=IDS[1:], assistant_model=assistant, do_sample=mode == "assisted_sample", **kw,
                             **dict_out)
    elif mode == "prompt_lookup":
        out = model.generate(input_ids=REPEATING, prompt_lookup_num_tokens=3, do_sample=False, **kw, **dict_out)
    elif mode == "continue_from_cache":
        first = model.generate(input_ids=IDS, attention_mask=MASK, do_sample=False, **kw, return_dict_in_generate=True)
        cache = _cache_of(first)
        ids = first.sequences
        out = model.generate(input_ids=ids, attention_mask=torch.cat([MASK, torch.ones(2, NEW, dtype=MASK.dtype)], 1),
                             do_sample=False, **{_cache_kwarg(model): cache}, **kw, **dict_out)
        out.first_cache_type = type(cache)
    elif mode == "static_cache":
        out = model.generate(input_ids=IDS, attention_mask=MASK, do_sample=False, cache_implementation="static",
                             **kw, **dict_out)
    else:
        raise AssertionError(mode)
    return out


@pytest.mark.parametrize("family,mode", CASES)
def test_generate_mode_matches_stock(family, mode):
    model = _model(family)
    ref = _run(model, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the static-cache warning has its own test
        with arkernels.patch(model, block_size=BLOCK):
            out = _run(model, mode)
    assert torch.equal(out.sequences, ref.sequences)
    for name in ("scores", "logits"):
        got, want = getattr(out, name, None), getattr(ref, name, None)
        assert (got is None) == (want is None)
        if want is not None:
            assert len(got) == len(want)
            for g, w in zip(got, want):  # -inf where a warper removed a token: the same set on both sides
                torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
    if getattr(ref, "sequences_scores", None) is not None:
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=0, atol=1e-4)
    cache = _cache_of(out)
    if mode == "static_cache":  # the paged cache cannot serve a static (compiled) cache: stock cache, one warning
        assert not isinstance(cache, PagedCache)
    else:
        assert isinstance(cache, PagedCache)  # the mode really ran on the paged cache
        assert isinstance(cache, DynamicCache)  # user code that checks for the default cache type keeps working
        for layer, ref_layer in zip(cache.layers, _cache_of(ref).layers):  # the returned cache reads like stock's
            torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=0, atol=1e-4)
            torch.testing.assert_close(layer.values, ref_layer.values, rtol=0, atol=1e-4)
    if mode == "continue_from_cache":
        assert out.first_cache_type is PagedCache


def test_compiled_static_forward_matches_stock():
    """``compile_config`` over a static cache: the paged cache steps aside for the call (one warning), the forward is
    compiled with fullgraph=True through arkernels' attention registration (its mask falls back to transformers' 4D
    mask while tracing), tokens identical. Backend "eager": dynamo traces the whole graph, no C++ codegen (minutes on
    2 cores); ``_compile_all_devices``: generate compiles only on accelerators otherwise."""
    from transformers import CompileConfig

    model = _model("llama")
    outs = []
    for patched in (False, True):
        config = CompileConfig(backend="eager", fullgraph=True)
        config._compile_all_devices = True
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = arkernels.patch(model, block_size=BLOCK) if patched else None
            try:
                outs.append(model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=3, do_sample=False,
                                           eos_token_id=None, pad_token_id=0, cache_implementation="static",
                                           compile_config=config))
            finally:
                if handle is not None:
                    handle.undo()
    assert torch.equal(outs[0], outs[1])


def test_fused_sampler_takes_over_only_when_exact():
    from transformers import GenerationConfig

    from arkernels.hf.sampler_hook import ArkernelsSampler

    model = _model("llama")
    with arkernels.patch(model, block_size=BLOCK, sampler=True):
        # top_k=1 leaves one candidate: the fused sampler returns the greedy token whatever the seed
        greedy = model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False,
                                eos_token_id=None)
        top1 = model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=True, top_k=1,
                              temperature=0.7, eos_token_id=None)
        procs = {}
        for name, cfg in {"exact": dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),
                          "typical": dict(temperature=0.7, typical_p=0.9), "eta": dict(top_k=5, eta_cutoff=0.01),
                          "renorm": dict(top_k=5, renormalize_logits=True)}.items():
            procs[name] = model._get_logits_processor(GenerationConfig(do_sample=True, **cfg))
    assert torch.equal(top1, greedy)
    exact = procs["exact"]
    assert type(exact[-1]) is ArkernelsSampler and len(exact) == 1
    assert (exact[-1].temperature, exact[-1].top_k, exact[-1].top_p, exact[-1].min_p) == (0.7, 5, 0.9, 0.1)
    for name in ("typical", "eta", "renorm"):  # processing the fused sampler does not implement: stock warpers stay
        assert not any(type(p) is ArkernelsSampler for p in procs[name]), name
    # the stock fallbacks draw exactly what stock draws (same torch seed)
    ref = []
    for patched in (False, True):
        handle = arkernels.patch(model, block_size=BLOCK, sampler=True) if patched else None
        torch.manual_seed(3)
        ref.append(model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=True,
                                  temperature=1.3, typical_p=0.95, eos_token_id=None))
        if handle is not None:
            handle.undo()
    assert torch.equal(ref[0], ref[1])


def test_static_cache_warns_once():
    from arkernels.hf import cache_hook

    model = _model("llama")
    cache_hook._warned.discard("impl:static")
    with arkernels.patch(model, block_size=BLOCK):
        with pytest.warns(UserWarning, match="static"):
            model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, cache_implementation="static",
                           eos_token_id=None, pad_token_id=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, cache_implementation="static",
                           eos_token_id=None, pad_token_id=0)


# ---- torch.compile(fullgraph=True) over the ops with default arguments (check=True validates eagerly only) --------
NUM_BLOCKS, BLOCK, HKV, HQ, D = 7, 4, 2, 4, 8  # 7 blocks: not a power of two


def _append_gather(k, v, kc, vc, slots, table, lens):
    paged_kv_append(k, v, kc, vc, slots)
    return paged_kv_gather(kc, vc, table, lens)


def _attend(q, kc, vc, table, lens, cu):
    return window_attention(q, kc, vc, table, lens, cu_seqlens_q=cu, window=3)


def _pools():
    return torch.full((NUM_BLOCKS, BLOCK, HKV, D), float("nan")), torch.full((NUM_BLOCKS, BLOCK, HKV, D), float("nan"))


def test_compile_fullgraph_append_gather_defaults():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, HKV, D, generator=g), torch.randn(6, HKV, D, generator=g)
    slots = torch.tensor([12, 13, 14, 15, 4, -1])  # row 0 in block 3, row 1 starts in block 1; -1: padding
    table = torch.tensor([[3, 0], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([4, 1], dtype=torch.int32)
    kc, vc = _pools()
    ek, ev = _append_gather(k, v, kc, vc, slots, table, lens)
    kc2, vc2 = _pools()
    ck, cv = torch.compile(_append_gather, fullgraph=True)(k, v, kc2, vc2, slots, table, lens)
    assert torch.equal(ck, ek) and torch.equal(cv, ev)  # data movement: exact
    assert torch.equal(kc2.nan_to_num(7.0), kc.nan_to_num(7.0))  # the same slots written, the rest untouched
    with pytest.raises(ValueError, match="outside the cache"):  # eagerly the default check still validates
        paged_kv_append(k, v, kc, vc, torch.tensor([0, 1, 2, 3, 4, NUM_BLOCKS * BLOCK]))


def test_compile_fullgraph_attention_defaults():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=g), torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=g)
    table = torch.tensor([[2, 5, 1], [6, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)  # 3 queries for row 0, 2 for row 1: max_q_len left to default
    q = torch.randn(5, HQ, D, generator=g)
    ref = _attend(q, kc, vc, table, lens, cu)
    out = torch.compile(_attend, fullgraph=True)(q, kc, vc, table, lens, cu)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)  # the same kernel, a larger grid bound: fp32 noise only
    with pytest.raises(ValueError, match="out of range"):
        _attend(q, kc, vc, torch.tensor([[2, 9, 1], [6, 0, 0]], dtype=torch.int32), lens, cu)


def test_model_as_its_own_assistant_past_the_window():
    """Assisted decoding with the model as its own assistant (transformers' test_assisted_decoding_with_logits_to_keep)
    on sliding layers past their window: the assistant's cache is rolled back by ``crop``, which transformers allows
    because it marks an assistant's cache for past recording; the paged cache that replaces it must be marked too."""
    model = _model("gemma3_text")
    ids = torch.arange(3, 15)[None]  # 12 positions > the window of 5
    kw = dict(max_new_tokens=8, do_sample=False, assistant_model=model, return_dict_in_generate=True,
              output_scores=True, eos_token_id=None, pad_token_id=0)
    ref = model.generate(input_ids=ids, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with arkernels.patch(model, block_size=BLOCK):
            out = model.generate(input_ids=ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
