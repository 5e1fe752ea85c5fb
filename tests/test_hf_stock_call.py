"""What a patched model cannot serve exactly it serves as the unpatched model would, for that call (hf/stock_call.py).

Two classes of transformers' own generation tests failed patched only (issue 31); each has cases here, on every family
the conformance tests cover:
- ``output_attentions=True`` with ``return_dict_in_generate`` (greedy, sampling, beams): patched equals stock, the
  attention weights (``eager``: tensors; ``sdpa``: none) and the hidden states, values and ``None``s alike; the next
  call is arkernels' again.
- ``torch.compiler.set_stance("force_eager")`` / ``disable_compile``: no compile at all, and the returned cache says
  it is not compileable; ``compile_config`` on the default cache compiles nothing before the "auto" rule is due
  (as stock); a call that compiled returns a cache that says so.
"""
import warnings

import pytest
import torch

import arkernels
from arkernels.hf.cache import PagedCache
from arkernels.hf.tiny import tiny_model

FAMILIES = ["llama", "gemma3_text", "mistral", "qwen2", "qwen3"]
IMPLEMENTATIONS = ["eager", "sdpa"]
MODES = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=5, temperature=0.9),
         "beams": dict(num_beams=2, num_return_sequences=2)}
# row 0 left padded by 3; 10 positions > the tiny models' window of 5 (sliding layers drop keys in stock's cache)
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
MASK = (IDS != 0).long()
NEW = 4
_models = {}


def _model(family, implementation):
    if family not in _models:
        _models[family] = tiny_model(family, seed=0)
    model = _models[family]
    model.set_attn_implementation(implementation)
    return model


def _generate(model, **kw):
    torch.manual_seed(0)
    return model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True, **kw)


def _patched(model, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with arkernels.patch(model, block_size=4):
            return fn()


def _same(got, want, atol):
    """Nested tuples of tensors / Nones: the same structure, Nones where stock has them, values within ``atol``."""
    if want is None or got is None:
        assert got is None and want is None
        return
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        return
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want):
        _same(g, w, atol)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_matches_stock(family, mode, implementation):
    """The whole call runs on the original implementation and cache: exactly stock's weights (same shapes for sliding
    layers, whose stock cache keeps only the window), stock's tokens and hidden states."""
    model = _model(family, implementation)
    kw = dict(MODES[mode], output_attentions=True, output_hidden_states=True)
    ref = _generate(model, **kw)
    out = _patched(model, lambda: _generate(model, **kw))
    assert torch.equal(out.sequences, ref.sequences)
    _same(out.attentions, ref.attentions, atol=0)
    _same(out.hidden_states, ref.hidden_states, atol=0)
    _same(out.scores, ref.scores, atol=0)
    if implementation == "eager":  # the test really compares weights
        assert isinstance(ref.attentions[0][0], torch.Tensor)
    assert model.config._attn_implementation == implementation  # undo left the original selected


@pytest.mark.parametrize("family", FAMILIES)
def test_output_hidden_states_alone_runs_on_arkernels(family):
    """Hidden states need no fallback: arkernels serves the call (paged cache) and gives stock's values."""
    model = _model(family, "sdpa")
    ref = _generate(model, do_sample=False, output_hidden_states=True)
    out = _patched(model, lambda: _generate(model, do_sample=False, output_hidden_states=True))
    assert torch.equal(out.sequences, ref.sequences)
    assert isinstance(out.past_key_values, PagedCache)
    _same(out.hidden_states, ref.hidden_states, atol=1e-4)  # our kernel sums in another order: fp32 noise


def test_the_next_call_is_arkernels_again():
    model = _model("llama", "eager")
    calls = []

    def both():
        calls.append(_generate(model, do_sample=False, output_attentions=True))
        assert model.config._attn_implementation == arkernels.hf.attention.NAME  # restored after the stock call
        calls.append(_generate(model, do_sample=False))
        return calls

    stock_call, ours = _patched(model, both)
    assert not isinstance(stock_call.past_key_values, PagedCache)
    assert isinstance(ours.past_key_values, PagedCache)
    assert torch.equal(stock_call.sequences, ours.sequences)


def test_generation_config_output_attentions_is_read():
    """The flag on a passed ``generation_config`` (positional too) or on the model's asks for weights as well."""
    from transformers import GenerationConfig

    model = _model("llama", "eager")
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, output_attentions=True, return_dict_in_generate=True,
                              eos_token_id=None, pad_token_id=0)
    ref = model.generate(IDS, config, attention_mask=MASK)
    out = _patched(model, lambda: model.generate(IDS, config, attention_mask=MASK))
    _same(out.attentions, ref.attentions, atol=0)
    model.generation_config.output_attentions = True
    try:
        ref = model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, return_dict_in_generate=True, pad_token_id=0)
        out = _patched(model, lambda: model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW,
                                                     return_dict_in_generate=True, pad_token_id=0))
    finally:
        model.generation_config.output_attentions = False
    _same(out.attentions, ref.attentions, atol=0)


@pytest.mark.parametrize("flag", ["kwarg", "config"])
def test_direct_forward_output_attentions(flag):
    model = _model("gemma3_text", "eager")
    kw = dict(output_attentions=True) if flag == "kwarg" else {}
    model.config.output_attentions = flag == "config"
    try:
        ref = model(IDS, attention_mask=MASK, **kw)
        out = _patched(model, lambda: model(IDS, attention_mask=MASK, **kw))
    finally:
        model.config.output_attentions = False
    assert isinstance(ref.attentions[0], torch.Tensor)
    _same(out.attentions, ref.attentions, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)


def test_direct_forward_output_attentions_over_a_paged_cache_refuses():
    model = _model("llama", "eager")

    def call():
        cache = PagedCache(model.config, block_size=4, paged_attention=True)
        model(IDS, attention_mask=MASK, past_key_values=cache, output_attentions=True)

    with pytest.raises(NotImplementedError, match="output_attentions"):
        _patched(model, call)


def test_training_mode_runs_stock():
    """A model in training mode (dropout) runs on its own attention, generate and forward: arkernels' kernels are for
    inference. The tiny models have attention dropout 0, so stock's values are reproducible."""
    model = _model("llama", "sdpa")
    model.train()
    try:
        ref_logits = model(IDS, attention_mask=MASK).logits
        ref = _generate(model, do_sample=False)
        logits = _patched(model, lambda: model(IDS, attention_mask=MASK).logits)
        out = _patched(model, lambda: _generate(model, do_sample=False))
    finally:
        model.eval()
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert torch.equal(out.sequences, ref.sequences)
    assert not isinstance(out.past_key_values, PagedCache)


@pytest.mark.parametrize("call", ["generate", "forward"])
def test_a_layer_left_in_training_runs_stock(call):
    """One attention layer left in ``train()`` with attention dropout inside an eval model: stock applies its dropout
    (sdpa's, seeded here); arkernels' attention has none, so the call runs as the unpatched model, same seed, same
    values."""
    model = _model("llama", "sdpa")
    attn = model.model.layers[0].self_attn
    attn.attention_dropout = 0.5
    attn.train()

    def run():
        torch.manual_seed(3)
        if call == "forward":
            return model(IDS, attention_mask=MASK).logits
        return _generate(model, do_sample=False).sequences

    try:
        ref = run()
        model.eval()  # the control: no dropout
        control = run()
        attn.train()
        got = _patched(model, run)
    finally:
        model.eval()
    assert not torch.equal(ref, control)  # the dropout changed stock's result: the test can see it
    assert torch.equal(got, ref)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("ask", ["output_attentions", "is_causal=False", "dropout"])
def test_a_layer_called_on_its_own_runs_its_original_attention(impl, ask):
    """An attention layer called directly (outside the model's forward, where neither generate's nor forward's hook
    sees the call) with what only its original implementation gives: that implementation serves it, output and
    weights exactly as unpatched (eager: weights; sdpa: None)."""
    model = _model("llama", impl)
    attn = model.model.layers[0].self_attn
    h = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = model.model.rotary_emb(h, torch.arange(5)[None].expand(2, 5))
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None, None].expand(2, 1, 5, 5)
    kw = {"output_attentions": dict(output_attentions=True), "is_causal=False": dict(is_causal=False),
          "dropout": {}}[ask]

    def run():
        if ask == "dropout":
            attn.attention_dropout = 0.5
            attn.train()
        torch.manual_seed(1)
        try:
            return attn(h, position_embeddings=pos, attention_mask=mask, **kw)
        finally:
            attn.eval()

    ref = run()
    got = _patched(model, run)
    _same(got, ref, atol=0)


def test_undo_restores_generate_and_forward():
    model = tiny_model("llama", seed=0)

    def shadow(*args, **kwargs):  # an instance-level forward set before the patch (accelerate's hooks do this)
        return type(model).forward(model, *args, **kwargs)

    model.forward = shadow
    handle = arkernels.patch(model)
    assert model.forward is not shadow and "generate" in model.__dict__
    handle.undo()
    assert model.forward is shadow and "generate" not in model.__dict__


def _compile_config():
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)  # "eager": dynamo traces, no codegen
    config._compile_all_devices = True
    return config


def _compiled_generate(model, **kw):
    return model.generate(input_ids=IDS[:1], max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True, compile_config=_compile_config(), **kw)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("how", ["force_eager", "disable_compile"])
def test_no_compile_means_no_compile(family, how):
    """transformers' ``test_generate_compile_model_forward_fullgraph``, first half: inside ``force_eager`` (or with
    ``disable_compile``) a default-cache call compiles nothing, and its returned cache is a DynamicCache that says it
    is not compileable."""
    from transformers import DynamicCache

    model = tiny_model(family, seed=0)
    torch.compiler.reset()

    def call():
        if how == "force_eager":
            with torch.compiler.set_stance("force_eager"):
                return _compiled_generate(model)
        return _compiled_generate(model, disable_compile=True)

    ref = call()
    out = _patched(model, call)
    assert isinstance(out.past_key_values, DynamicCache)
    assert not out.past_key_values.is_compileable
    assert not hasattr(model, "_compiled_call")
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_compile_config_on_the_default_cache_compiles_nothing(family):
    """transformers' ``test_generate_compile_model_forward``, first half: ``compile_config`` (``_compile_all_devices``)
    with the default cache compiles nothing stock ("our auto compile should NOT have been called"); patched, the
    "auto" rule keeps the model's first ``compile_after`` decode steps eager too: the returned cache is a DynamicCache
    that says it is not compileable and the model has no ``_compiled_call``, on two calls."""
    from transformers import DynamicCache

    model = tiny_model(family, seed=0)
    torch.compiler.reset()
    ref = _compiled_generate(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with arkernels.patch(model, block_size=4):
            outs = [_compiled_generate(model) for _ in range(2)]
    for out in outs:
        assert isinstance(out.past_key_values, PagedCache) and isinstance(out.past_key_values, DynamicCache)
        assert not out.past_key_values.is_compileable
        assert torch.equal(out.sequences, ref.sequences)
    assert not hasattr(model, "_compiled_call")


@pytest.mark.parametrize("how", ["compile=True", "compile_after=0", "compile_after=None"])
def test_a_call_that_compiles_says_so(how):
    """The other side: a patched call whose decode step compiled (``compile=True``, the "auto" rule due, or
    ``compile_after=None``: transformers' rule, which compiles a compileable cache under ``compile_config``) returns
    a cache that says it is compileable."""
    model = tiny_model("llama", seed=0)
    torch.compiler.reset()
    ref = _compiled_generate(model)
    kw = {"compile=True": dict(compile=True), "compile_after=0": dict(compile_after=0),
          "compile_after=None": dict(compile_after=None)}[how]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with arkernels.patch(model, block_size=4, **kw):
            out = _compiled_generate(model)
    assert isinstance(out.past_key_values, PagedCache) and out.past_key_values.is_compileable
    assert out.past_key_values.compiled_forwards == 2  # max_new_tokens 3: the prefill, then two compiled steps
    assert hasattr(model, "_compiled_call")
    assert torch.equal(out.sequences, ref.sequences)


def test_an_eager_fixed_call_on_the_cpu_says_it_did_not_compile():
    """No compile_config on the CPU (transformers compiles nothing there), before the "auto" rule is due: the fixed
    paged cache ran eagerly, and the cache it returns says it is not compileable."""
    model = tiny_model("llama", seed=0)
    with arkernels.patch(model, block_size=4):
        out = model.generate(input_ids=IDS[:1], max_new_tokens=3, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, PagedCache) and cache.fixed and cache.decode_steps == 2
    assert not cache.is_compileable and cache.compiled_forwards == 0


def test_arkernels_generate_on_a_patched_model_stays_on_arkernels():
    """``arkernels.generate``'s forwards carry its PagedCache: a config that asks for attentions (or training mode)
    does not move them to the original attention, which cannot read the cache's pools."""
    model = _model("llama", "eager")
    ref = arkernels.generate(model, [[5, 6, 7, 8]], max_new_tokens=3).tokens
    model.config.output_attentions = True
    try:
        got = _patched(model, lambda: arkernels.generate(model, [[5, 6, 7, 8]], max_new_tokens=3).tokens)
    finally:
        model.config.output_attentions = False
    assert got == ref
