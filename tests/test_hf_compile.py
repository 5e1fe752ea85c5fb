"""A patched ``model.generate`` with a compiled decode step: the fixed-shape paged cache under transformers' own
auto-compile path (``compile_config``; ``_compile_all_devices`` lets the CPU compile).

- tokens: stock (DynamicCache, eager) vs patched + ``compile_config``, greedy and seeded sampling, every family of the
  conformance suite, left padding, past the window and across block boundaries;
- graphs: one dynamo graph per batch size over several calls, prompt lengths and ``max_new_tokens`` (no recompile per
  step, per length or per call);
- the step itself: no host sync and no tensor built from Python data inside a compiled decode step (CPU profiler);
- modes the fixed cache does not serve (beams, assisted decoding) and a continuation longer than the reservation run
  eagerly on the host path, with stock's tokens.

Backend "eager" (dynamo traces the whole forward, ``fullgraph=True``: a graph break fails the test; no C++ codegen,
which takes minutes on 2 cores); the Inductor path is what benchmarks/bench_decode.py times.
"""
import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import CompileConfig

import arkernels
from arkernels.hf import cache_hook
from arkernels.hf.cache import PagedCache
from arkernels.hf.tiny import TINY_WINDOW, tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
BLOCK = 4
# batch 2, row 0 left padded by 3; 10 positions > the tiny window of 5
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
MASK = (IDS != 0).long()
NEW = 9  # 10 + 9 positions: decode crosses block boundaries 12 and 16, the window slides every step
assert IDS.shape[1] > TINY_WINDOW and (IDS.shape[1] + NEW) // BLOCK > IDS.shape[1] // BLOCK + 1


def _config(backend="eager"):
    config = CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True  # generate compiles on accelerators only otherwise
    return config


def _generate(model, ids=IDS, mask=MASK, new=NEW, seed=None, **kw):
    """Token ids ``[batch, prompt + new]`` of one generate call (``seed``: seeded sampling, else greedy)."""
    kw.setdefault("return_dict_in_generate", True)
    if seed is not None:
        torch.manual_seed(seed)
        # output_scores: the fused sampler steps aside, stock warpers draw from torch's generator as stock does
        kw.update(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, output_scores=True)
    else:
        kw.update(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         eos_token_id=None, pad_token_id=0, **kw)
    _generate.last_cache = getattr(out, "cache", None) or out.past_key_values
    return out.sequences


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [None, 7])
def test_compiled_decode_matches_stock(family, seed):
    model = tiny_model(family)
    ref = _generate(model, seed=seed)
    with arkernels.patch(model, block_size=BLOCK, compile=True):
        out = _generate(model, seed=seed, compile_config=_config())
    assert torch.equal(out, ref)
    cache = _generate.last_cache
    assert isinstance(cache, PagedCache) and cache.is_compileable  # it ran with fixed shapes to the end
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # the decode forward compiled


# (prompt width, max_new_tokens) of the calls that must share one graph: other block boundaries, table widths and
# pool sizes; the widest prompt is longer than 10 (3 more tokens on the left)
CALLS = [(10, NEW), (7, 5), (13, 12), (10, 3)]


def _prompt(width):
    """IDS cut or extended on the left to ``width`` positions, still left padded (row 0 keeps its 7 real tokens)."""
    if width <= IDS.shape[1]:
        ids = IDS[:, -width:]
    else:
        extra = width - IDS.shape[1]
        ids = torch.cat([torch.cat([torch.zeros(1, extra, dtype=IDS.dtype), IDS[:1]], 1),
                         torch.cat([torch.arange(20, 20 + extra)[None], IDS[1:]], 1)])
    return ids, (ids != 0).long()


def test_one_graph_per_batch_size():
    """Calls with other prompt lengths and max_new_tokens reuse the batch's graph; another batch size compiles once."""
    model = tiny_model("gemma3_text")  # a sliding and a full group
    config = _config()
    ref = [_generate(model, *_prompt(w), n) for w, n in CALLS]
    ref_b1 = [_generate(model, IDS[:1], MASK[:1], 4), _generate(model, IDS[:1, 2:], MASK[:1, 2:], 6)]
    with arkernels.patch(model, block_size=BLOCK, compile=True):
        for (w, n), want in zip(CALLS, ref):
            assert torch.equal(_generate(model, *_prompt(w), n, compile_config=config), want), (w, n)
            assert counters["stats"]["unique_graphs"] == 1, (w, n)
        assert torch.equal(_generate(model, IDS[:1], MASK[:1], 4, compile_config=config), ref_b1[0])
        assert counters["stats"]["unique_graphs"] == 2
        assert torch.equal(_generate(model, IDS[:1, 2:], MASK[:1, 2:], 6, compile_config=config), ref_b1[1])
        assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]


def _mark_compiled_steps(model):
    """Wrap the patched ``get_compiled_call`` so every compiled decode step (its host half included) is a
    ``compiled_step`` profiler range."""
    inner = model.get_compiled_call

    def get_compiled_call(config):
        forward = inner(config)

        def marked(*args, **kwargs):
            with record_function("compiled_step"):
                return forward(*args, **kwargs)
        return marked

    model.get_compiled_call = get_compiled_call  # an instance attribute over the patch's: dropped by undo


def test_compiled_step_has_no_host_sync():
    """Inside a compiled decode step: no host read of device data (``_local_scalar_dense``: .item() / .tolist() /
    bool()), and no tensor built from Python data (``lift_fresh``: torch.tensor(list)), which a CUDA graph would
    replay stale."""
    model = tiny_model("gemma3_text")
    config = _config()
    with arkernels.patch(model, block_size=BLOCK, compile=True):
        _mark_compiled_steps(model)
        _generate(model, compile_config=config)  # compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _generate(model, compile_config=config)
    events = prof.events()
    steps = [e for e in events if e.name == "compiled_step"]
    assert len(steps) == NEW - 1  # every decode forward ran through the compiled call
    inside = [e for e in events if any(s.time_range.start <= e.time_range.start <= s.time_range.end for s in steps)]
    assert any(e.name.startswith("arkernels::window_attention") for e in inside)  # our kernel, not sdpa's fallback
    assert not [e.name for e in inside if e.name.startswith(("aten::sdpa", "aten::scaled_dot_product"))]
    bad = [e.name for e in inside if e.name in ("aten::_local_scalar_dense", "aten::item", "aten::lift_fresh",
                                                  "aten::is_nonzero", "aten::nonzero")]
    assert not bad
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("mode", ["beam_search", "assisted"])
def test_modes_outside_fixed_shapes_run_eagerly(mode):
    """Beams (reorders + copy-on-write) and assisted decoding (crop, candidate runs) keep the host path with a
    compile request: stock's tokens, one warning, nothing compiled."""
    model = tiny_model("llama")
    kw = dict(num_beams=3) if mode == "beam_search" else dict(assistant_model=tiny_model("llama", seed=1))
    ids, mask = (IDS, MASK) if mode == "beam_search" else (IDS[1:], MASK[1:])  # assisted: batch 1
    ref = _generate(model, ids, mask, **kw)
    cache_hook._warned.discard(f"eager:{'beam_search' if mode == 'beam_search' else 'assisted_generation'}")
    with arkernels.patch(model, block_size=BLOCK):
        with pytest.warns(UserWarning, match="eagerly"):
            out = _generate(model, ids, mask, compile_config=_config(), **kw)
    assert torch.equal(out, ref)
    assert isinstance(_generate.last_cache, PagedCache) and not _generate.last_cache.is_compileable
    assert counters["stats"]["unique_graphs"] == 0


def test_continuation_past_the_reservation_leaves_fixed_shapes():
    """A returned fixed cache continued by a longer call: the prefill does not fit what was reserved, the cache takes
    the host path (not compileable any more) and that call decodes eagerly, with stock's tokens."""
    model = tiny_model("gemma3_text")
    config = _config()
    first = _generate(model)
    first_cache = _generate.last_cache
    ids2 = torch.cat([first, torch.full((2, 3), 9)], 1)
    mask2 = torch.cat([MASK, torch.ones(2, ids2.shape[1] - MASK.shape[1], dtype=MASK.dtype)], 1)
    ref = _generate(model, ids2, mask2, 5, **{"cache" if "cache" in _fwd_params(model) else "past_key_values":
                                                 first_cache})
    with arkernels.patch(model, block_size=BLOCK, compile=True):
        got_first = _generate(model, compile_config=config)
        cache = _generate.last_cache
        assert torch.equal(got_first, first) and cache.is_compileable
        cache_hook._warned.discard("unfixed")
        with pytest.warns(UserWarning, match="decodes eagerly"):
            got = _generate(model, ids2, mask2, 5, compile_config=config,
                            **{"cache" if "cache" in _fwd_params(model) else "past_key_values": cache})
    assert torch.equal(got, ref)
    assert not cache.is_compileable


def _fwd_params(model):
    import inspect

    return inspect.signature(model.forward).parameters


def test_mask_the_kernel_cannot_express_leaves_fixed_shapes():
    """A padding hole (not left padding): transformers' 4D mask and sdpa serve it, over dense K/V sized on the host,
    so the cache stops being compileable at the prefill and the call decodes eagerly: stock's tokens, no graph (and
    no recompile per step)."""
    model = tiny_model("qwen3")
    mask = MASK.clone()
    mask[1, 4] = 0
    ref = _generate(model, IDS, mask)
    cache_hook._warned.discard("unfixed")
    with arkernels.patch(model, block_size=BLOCK, compile=True):
        with pytest.warns(UserWarning, match="decodes eagerly"):
            out = _generate(model, IDS, mask, compile_config=_config())
    assert torch.equal(out, ref)
    assert not _generate.last_cache.is_compileable
    assert counters["stats"]["unique_graphs"] == 0


def test_masks_transformers_cannot_build_keep_the_eager_cache(monkeypatch):
    """transformers 5.17's ``create_masks_for_generate`` passes ``block_sequence_ids`` to a mask function that does not
    take it (``create_chunked_causal_mask``: Llama 4). Emulated here on gemma3's sliding layers with a mask function of
    that older signature: a compile request keeps the eager paged cache (stock's DynamicCache never calls it), with
    stock's tokens and one warning, rather than the TypeError."""
    import inspect

    from transformers import masking_utils

    model = tiny_model("gemma3_text")
    ref = _generate(model)
    original = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING["sliding_attention"]

    def older(*args, **kwargs):
        if "block_sequence_ids" in kwargs:
            raise TypeError("older() got an unexpected keyword argument 'block_sequence_ids'")
        return original(*args, **kwargs)

    older.__signature__ = inspect.Signature([p for p in inspect.signature(original).parameters.values()
                                             if p.name != "block_sequence_ids"])
    monkeypatch.setitem(masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING, "sliding_attention", older)
    assert not cache_hook._masks_for_generate_work(model.config)
    cache_hook._warned.discard("eager:greedy_search")
    with arkernels.patch(model, block_size=BLOCK):
        with pytest.warns(UserWarning, match="eagerly"):
            out = _generate(model, compile_config=_config())
    assert torch.equal(out, ref)
    assert isinstance(_generate.last_cache, PagedCache) and not _generate.last_cache.is_compileable
    monkeypatch.undo()
    assert cache_hook._masks_for_generate_work(model.config)


def _eager_default_config(monkeypatch, backend="eager"):
    """The compile config the patch picks by itself, on dynamo's "eager" backend (Inductor's C++ codegen takes
    minutes on 2 cores; bench_decode.py times the Inductor path)."""
    monkeypatch.setattr(cache_hook, "_default_compile_config", lambda model: _config(backend))


def test_auto_compiles_on_the_cpu_after_compile_after_steps(monkeypatch):
    """compile="auto" on the CPU: calls decode eagerly until the patched model has run compile_after decode steps,
    then compile (one warning, one graph); stock's tokens throughout."""
    _eager_default_config(monkeypatch)
    model = tiny_model("llama")
    ref = _generate(model)
    steps = NEW - 1  # one-token forwards of a call (its first token comes from the prefill)
    cache_hook._warned.discard("tier")
    with arkernels.patch(model, block_size=BLOCK, compile_after=2 * steps) as handle:
        for _ in range(2):  # steps 0 .. 2 * steps - 1: eager
            assert torch.equal(_generate(model), ref)
            assert counters["stats"]["unique_graphs"] == 0
            assert _generate.last_cache.decode_steps == steps
        with pytest.warns(UserWarning, match=f"after {2 * steps} eager decode steps"):
            assert torch.equal(_generate(model), ref)
        assert counters["stats"]["unique_graphs"] == 1  # the third call compiled
        assert torch.equal(_generate(model), ref)
        assert counters["stats"]["unique_graphs"] == 1  # and the fourth reused it
        assert handle.model is model
    assert not counters["graph_break"]


def test_auto_compile_after_none_and_disable_compile_stay_eager(monkeypatch):
    """compile_after=None: transformers' rule only (eager on the CPU), however many steps; disable_compile=True: that
    call stays eager even when the rule is due."""
    _eager_default_config(monkeypatch)
    model = tiny_model("llama")
    ref = _generate(model)
    with arkernels.patch(model, block_size=BLOCK, compile_after=None):
        for _ in range(3):
            assert torch.equal(_generate(model), ref)
    assert counters["stats"]["unique_graphs"] == 0
    with arkernels.patch(model, block_size=BLOCK, compile_after=0):
        assert torch.equal(_generate(model, disable_compile=True), ref)
        assert counters["stats"]["unique_graphs"] == 0
        assert torch.equal(_generate(model), ref)  # due from the first call: compile_after=0
        assert counters["stats"]["unique_graphs"] == 1


def test_auto_compile_that_fails_stays_eager(monkeypatch):
    """A compile the "auto" rule asked for that raises (here a backend that fails, as Inductor does without a C++
    compiler): one warning, that call and later ones decode eagerly with stock's tokens; the same failure with an
    explicit compile request raises, as stock does."""

    tries = []

    def broken(gm, example_inputs, **options):  # (CompileConfig passes its mode)
        tries.append(1)
        raise RuntimeError("no C++ compiler")

    _eager_default_config(monkeypatch, backend=broken)
    model = tiny_model("llama")
    ref = _generate(model)
    cache_hook._warned.discard("tier-failed")
    with arkernels.patch(model, block_size=BLOCK, compile_after=0):
        with pytest.warns(UserWarning, match="compiling the decode step failed"):
            assert torch.equal(_generate(model), ref)
        assert len(tries) == 1
        assert torch.equal(_generate(model), ref)
        assert len(tries) == 1  # no second attempt: eager from then on
    torch._dynamo.reset()
    with arkernels.patch(model, block_size=BLOCK, compile=True):
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
            _generate(model, compile_config=_config(broken))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1024"])
def test_compile_after_refused_before_any_change(bad):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="arkernels.patch: compile_after must be an int >= 0"):
        arkernels.patch(model, compile_after=bad)
    with pytest.raises(ValueError, match="arkernels.patch: compile must be"):
        arkernels.patch(model, compile="yes")
    assert model.config._attn_implementation == before and "_prepare_cache_for_generation" not in model.__dict__
