"""``arkernels.patch(model)``: make a plain ``model.generate()`` run on arkernels, for this model instance only.

Three independent pieces, each undone by the handle:
- attention: our attention + mask functions registered under ``arkernels.hf.attention.NAME`` and selected on this
  model's config (``set_attn_implementation``); the registries are global, the selection is per instance.
- cache: an instance attribute wrapping ``_prepare_cache_for_generation``: where generate would build its default
  ``DynamicCache`` for a mode the paged cache serves (greedy, sampling, beam search, beam sampling, assisted and
  prompt-lookup decoding), it gets a ``PagedCache`` sized for the call (prompt + max_new_tokens). Any other cache
  request (``cache_implementation="static"`` and the other compiled caches, a cache the user passed, a mode outside
  that list) keeps transformers' own cache for that call; modes the paged cache cannot take warn once. Greedy and
  sampling calls get it with fixed shapes (compileable): transformers then compiles their decode forward where it
  compiles a static cache, through ``get_compiled_call`` (wrapped: the cache's host half of each step runs before the
  compiled forward) and ``create_masks_for_generate`` (wrapped: a call's decode masks are built once).
- sampler: an instance attribute wrapping ``_get_logits_processor`` (by default for sampling calls on CUDA only, see
  ``patch``'s ``sampler``): for plain sampling (``do_sample=True``, one beam,
  no assistant, no ``output_scores``) whose warpers are exactly a trailing run of temperature / top-k / top-p / min-p
  (transformers' order, ``min_tokens_to_keep`` 1) with values the fused sampler reproduces exactly (``_fusable``:
  not ``top_p=0``, not a temperature below 2**-100), those warpers are replaced by one processor that draws with
  ``arkernels.sample`` and hands generate a one-hot distribution (so its own multinomial returns exactly our draw).
  Anything else (other warpers, a processor after them, beams, assisted decoding, ``output_scores``, those values)
  keeps the stock warpers for that call. When every processor ahead of them (or, for greedy decoding, every
  processor) is one of the token rules the sampler implements (``_fused_rules``: repetition penalty, one-token
  ``sequence_bias`` / ``bad_words_ids``, ``min_new_tokens``, ``suppress_tokens``), those are fused into the same
  draw too, in transformers' order; otherwise they run as stock processors before our draw (sampling) or the call
  stays stock (greedy).

A call none of them can serve exactly (``output_attentions=True``, training mode) runs as the unpatched model would,
for that call (``arkernels.hf.stock_call``); a vision or audio tower keeps the model's own attention. A call that must
not compile (``disable_compile``, ``torch.compiler.set_stance("force_eager")``) gets a cache that is not compileable.

``patch`` checks what it can before changing anything: the family, ``block_size``, the model's dtype and device.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings

import torch

_PATCH_ATTR = "_arkernels_patch"


class PatchHandle:
    """Returned by ``patch``; ``undo()`` restores the model exactly (idempotent)."""

    def __init__(self, model, saved_attn: str | None, attrs: list[str], fuse_handle=None, shadowed=None):
        self.model = model
        self._saved_attn = saved_attn
        self._attrs = attrs
        self._shadowed = shadowed or {}  # instance attributes a hook replaced (accelerate's forward): put back
        self._fuse = fuse_handle  # arkernels.fuse.FuseHandle when patch(fuse=True)
        self.active = True

    def undo(self) -> None:
        if not self.active:
            return
        model = self.model
        if "init_continuous_batching" in self._attrs:
            from arkernels.hf.cb import unhook_continuous_batching

            unhook_continuous_batching(model)  # first: it stops a CB session still running on our attention
        for name in self._attrs:
            model.__dict__.pop(name, None)  # the class method shows through again
        model.__dict__.update(self._shadowed)
        if self._saved_attn is not None:
            model.set_attn_implementation(self._saved_attn)
        if self._fuse is not None:
            self._fuse.undo()
        model.__dict__.pop(_PATCH_ATTR, None)
        self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def _check_patch_args(model, block_size, attention: bool) -> None:
    from arkernels.hf.capability import check_model_tensors

    check_model_tensors(model, "arkernels.patch", attention)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"arkernels.patch: block_size must be an int >= 1 (tokens per cache block), got "
                         f"{block_size!r}")


# compile="auto" on a device where transformers does not compile by itself (the CPU): eager decode steps of a patched
# model before its calls compile. The host-bound tiny Llama's first compile (~7-13 s of CPU on this project's 2-core
# machines) costs about 1000-1500 of its eager steps (~5-6 ms each), SmolLM2-135M's (~30 layers) about as many of its
# ~50-100 ms steps: 1024 keeps the rent-or-buy rule within ~2x of the best choice made in hindsight for both.
COMPILE_AFTER = 1024


class _Tier:
    """The "auto" rule's state for one patch: eager decode steps of the patched model's fixed-shape calls (each such
    call's cache adds its one-token forwards to ``steps``), whether the current call's compile was this rule's doing
    (its failure then keeps the model eager instead of raising) and whether a compile failed."""

    def __init__(self, after: int | None):
        self.after = after  # None: never (compile=True / False, or compile_after=None)
        self.steps = 0
        self.this_call = False
        self.failed = False

    def due(self) -> bool:
        return self.after is not None and not self.failed and self.steps >= self.after


def patch(model, attention: bool = True, cache: bool = True, sampler: bool | str = "auto", *, block_size: int = 16,
          fuse: bool = False, kv_cache_dtype: str | torch.dtype = "auto", k_scale: float | list[float] | None = None,
          v_scale: float | list[float] | None = None, compile: bool | str = "auto",
          compile_after: int | None = COMPILE_AFTER):
    """Route ``model.generate`` through arkernels' attention, paged cache and sampler.

    Args:
        model: a transformers decoder (``*ForCausalLM``, or a multimodal ``*ForConditionalGeneration`` for its text
            path) whose layers arkernels can run: ``arkernels.hf.capability.check_model`` decides from what the
            layers do (attention through transformers' registry, full / sliding / chunked layers, the keywords each
            layer passes) and refuses, naming the layer and the reason, before anything is changed.
        attention: select arkernels' attention + mask functions on this model's config.
        cache: give ``generate`` a ``PagedCache`` (``block_size`` tokens per block, an int >= 1) instead of a
            DynamicCache, for the modes it serves (greedy, sampling, beam search / sampling, assisted and
            prompt-lookup decoding); any other request keeps transformers' cache for that call (a warning, once per
            kind). With attention too,
            the attention kernel reads the paged cache in place; alone, the cache hands dense K/V to whatever
            attention the model uses.
        sampler: "auto" (default): plain ``do_sample=True`` calls on a CUDA model draw with ``arkernels.sample``
            (one kernel, no sort of the vocabulary) when the requested warpers are exactly what it implements (see
            the module docstring); greedy calls, and every call on the CPU (where ``arkernels.sample`` is composed
            of more torch ops than the stock warpers it replaces), keep transformers' processors: stock's tokens at
            stock's cost. True: the fused draw for every call it can serve exactly, greedy ones with token rules
            included, on every device (arkernels' seeded draws everywhere). False: never.
        fuse: also merge q/k/v and gate/up into one layer each (``arkernels.fuse_projections``; opt-in, undone with
            the rest).
        kv_cache_dtype: the ``PagedCache``'s storage: "auto" (the model's dtype) or "fp8" (float8_e4m3fn with a K
            and a V scale per layer, vLLM's convention), read by the CPU and the CUDA attention kernels.
        k_scale, v_scale: fp8 only: a float, one float per layer, or None (default): calibrated per layer on each
            call's prefill as ``max(absmax / 200, 1e-6)`` for K, ``/ 100`` for V (vLLM's defaults).
        compile: the decode step of greedy / sampling calls. "auto" (default) and True: the paged cache of such a call
            has fixed shapes (every block reserved at prefill, lengths advanced on the device) and is compileable, so
            transformers compiles the decode forward wherever it would compile a static cache (``compile_config``;
            any CUDA model). Where transformers would not compile (the CPU), True compiles from the first call and
            "auto" once this patched model has run ``compile_after`` eager decode steps (tiered: short one-off calls
            never pay the compile, sustained use gets the compiled step). False: the host-path paged cache, never
            compiled. ``generate(..., disable_compile=True)`` turns compilation off for one call. The compile is
            transformers' (its default ``CompileConfig``): one graph per batch size; a compile that fails under
            "auto" (no C++ compiler for Inductor, say) warns once and the model stays eager.
        compile_after: "auto" only: decode steps (forwards of one token per row, summed over this patch's calls) after
            which the CPU compiles; an int >= 0, or None: never (transformers' rule only). Default ``COMPILE_AFTER``
            (1024): on the host-bound tiny Llama the first compile costs about as much CPU time as 1000-1500 eager
            steps, so the rule pays at most about twice the best choice made in hindsight (rent-or-buy).

    Returns:
        ``PatchHandle``: ``handle.undo()`` restores the model; also a context manager.
    """
    from arkernels.hf.capability import check_model

    check_model(model, "arkernels.patch")
    _check_patch_args(model, block_size, attention)
    if sampler not in ("auto", True, False):
        raise ValueError(f"arkernels.patch: sampler must be 'auto', True or False, got {sampler!r}")
    if compile not in ("auto", True, False):
        raise ValueError(f"arkernels.patch: compile must be 'auto', True or False, got {compile!r}")
    if compile_after is not None and (not isinstance(compile_after, int) or isinstance(compile_after, bool)
                                      or compile_after < 0):
        raise ValueError(f"arkernels.patch: compile_after must be an int >= 0 (decode steps) or None, got "
                         f"{compile_after!r}")
    from arkernels.cache.fp8 import kv_cache_dtype_of, per_layer_scales

    kv_dtype = kv_cache_dtype_of("arkernels.patch", kv_cache_dtype)  # refuse bad values before changing anything
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        per_layer_scales("arkernels.patch", name, sc,
                         model.config.get_text_config(decoder=True).num_hidden_layers, kv_dtype)
    if kv_dtype is not None and not cache:
        raise ValueError("arkernels.patch: kv_cache_dtype='fp8' needs cache=True (the paged cache holds the fp8 K/V)")
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise RuntimeError("arkernels.patch: this model is already patched; undo() the first handle")
    fuse_handle = None
    if fuse:  # first: it is the only piece that can refuse (a model already fused), before anything is changed
        from arkernels.fuse import fuse_projections

        fuse_handle = fuse_projections(model)
    # mode: this call's generation mode (the cache hook runs before the logits-processor hook); tier: the "auto"
    # rule's count of eager decode steps (see _Tier); stock: this call runs as the unpatched model (stock_call)
    state = {"mode": None, "tier": _Tier(compile_after if compile == "auto" else None), "stock": False}
    saved_attn, attrs, shadowed = None, [], {}
    if attention:
        from arkernels.hf.attention import register
        from arkernels.hf.stock_call import AttentionSwap, wrap_forward, wrap_generate

        saved_attn = model.config._attn_implementation
        swap = AttentionSwap(model)
        model.set_attn_implementation(register())
        swap.record_after()
        shadowed = {name: model.__dict__[name] for name in ("generate", "forward") if name in model.__dict__}
        model.generate = wrap_generate(model, model.generate, swap, state)
        model.forward = wrap_forward(model, model.forward, swap)
        attrs += ["generate", "forward"]
        # continuous batching (generate_batch, init_continuous_batching, generate(cache_implementation="paged")):
        # its own instance hook, see arkernels.hf.cb
        from arkernels.hf.cb import hook_continuous_batching

        if hook_continuous_batching(model, sampler=sampler is not False):  # CB's batched draw: fused unless False
            attrs.append("init_continuous_batching")
    if cache or sampler:
        model._prepare_cache_for_generation = _wrap_cache(model, model._prepare_cache_for_generation, block_size,
                                                          state, swap=cache,
                                                          cache_kwargs=dict(kv_cache_dtype=kv_cache_dtype,
                                                                            k_scale=k_scale, v_scale=v_scale),
                                                          compile=compile)
        attrs.append("_prepare_cache_for_generation")
    if cache and compile is not False:
        model.get_compiled_call = _wrap_compiled_call(model, model.get_compiled_call, state["tier"])
        model.create_masks_for_generate = _wrap_masks(model)
        attrs += ["get_compiled_call", "create_masks_for_generate"]
    if sampler:
        model._get_logits_processor = _wrap_logits_processor(model._get_logits_processor, state, sampler)
        attrs.append("_get_logits_processor")
    handle = PatchHandle(model, saved_attn, attrs, fuse_handle, shadowed)
    model.__dict__[_PATCH_ATTR] = handle
    return handle


@functools.cache
def _compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile: dynamo's errors (a backend's failure included) and
    Inductor's (imported on first use: torch._dynamo is slow to import)."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return TorchDynamoException, InductorError


_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


def _paged_modes():
    """The generation modes a PagedCache serves (names of transformers' ``GenerationMode``)."""
    return ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")


# modes whose decode forwards all take one token per row and never reorder or roll back the cache: their paged cache
# has fixed shapes and is compileable; beams (reorders, copy-on-write) and assisted decoding (crop, candidate runs of
# varying length) keep the host path, eager
_FIXED_MODES = ("greedy_search", "sample")


def _wrap_cache(model, original, block_size: int, state: dict, swap: bool, cache_kwargs: dict | None = None,
                compile: bool | str = "auto"):
    from transformers import DynamicCache

    from arkernels.hf.attention import NAME
    from arkernels.hf.cache import PagedCache
    from arkernels.hf.stock_call import compile_forbidden

    signature = inspect.signature(original)

    def _prepare_cache_for_generation(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        generation_config, model_kwargs = bound.arguments["generation_config"], bound.arguments["model_kwargs"]
        mode = bound.arguments.get("generation_mode")
        state["mode"] = getattr(mode, "value", mode)
        original(*args, **kwargs)
        for name in ("cache", "past_key_values"):  # a cache passed back in: its decode masks were another call's
            if isinstance(model_kwargs.get(name), PagedCache):
                model_kwargs[name].decode_masks = None
        if not swap or state["stock"]:
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            # static / hybrid / offloaded / quantized caches exist for compiled forwards and memory layouts the paged
            # cache does not reproduce: transformers' cache serves this call (arkernels attention still runs)
            _warn_once(f"impl:{generation_config.cache_implementation}",
                       f"arkernels.patch: cache_implementation={generation_config.cache_implementation!r} keeps "
                       "transformers' own cache for this call (the paged cache has no compiled static step in "
                       "generate yet)")
            return
        for name in ("cache", "past_key_values"):  # 5.24 renamed the argument
            made = model_kwargs.get(name)
            if type(made) is DynamicCache and not getattr(made, "_is_user_defined", False):
                if state["mode"] not in _paged_modes():
                    _warn_once(f"mode:{state['mode']}", f"arkernels.patch: generation mode {state['mode']!r} keeps "
                               "transformers' DynamicCache for this call")
                    return
                paged = model.config._attn_implementation == NAME
                max_length = bound.arguments.get("max_cache_length")
                fixed = (compile is not False and paged and state["mode"] in _FIXED_MODES and bool(max_length)
                         and _masks_for_generate_work(model.config) and not compile_forbidden(generation_config))
                if generation_config.compile_config is not None and not fixed and not compile_forbidden(
                        generation_config):
                    _warn_once(f"eager:{state['mode']}", f"arkernels.patch: generation mode {state['mode']!r} runs "
                               "the paged cache eagerly (compile_config applies to greedy and sampling calls)")
                tier = state["tier"]
                tier.this_call = False
                cpu_eager = fixed and generation_config.compile_config is None and model.device.type == "cpu"
                if cpu_eager:  # (where transformers compiles by itself, CUDA, it compiles this cache from call one)
                    tier.this_call = compile == "auto" and not generation_config.disable_compile and tier.due()
                    if compile is True or tier.this_call:
                        if tier.this_call:
                            _warn_once("tier", f"arkernels.patch: compiling this model's decode step after "
                                       f"{tier.steps} eager decode steps (compile='auto'; the first call of each "
                                       "batch size compiles; patch(compile_after=None) keeps it eager)")
                        generation_config.compile_config = _default_compile_config(model)
                        cpu_eager = False
                cache = PagedCache(model.config, block_size=block_size, max_length=max_length, paged_attention=paged,
                                   compileable=fixed, **(cache_kwargs or {}))
                if cpu_eager:
                    cache.step_counter = tier  # an eager call: its decode steps count towards the "auto" rule
                if getattr(generation_config, "is_assistant", False):
                    # what transformers did to the cache it built (an assistant's cache is rolled back by crop)
                    cache.activate_past_recording()
                model_kwargs[name] = cache

    return _prepare_cache_for_generation


def _masks_for_generate_work(config) -> bool:
    """Whether transformers' ``create_masks_for_generate`` (what generate calls on a compileable cache, the fixed
    paged cache included) can build this model's masks: every mask function its layer types map to takes every
    argument it passes. transformers 5.17 passes ``block_sequence_ids`` to ``create_chunked_causal_mask``, which does
    not take it (Llama 4: stock StaticCache fails the same way); such a model keeps the eager paged cache, as stock
    keeps its DynamicCache, and runs the same tokens."""
    from transformers import masking_utils

    passed = set(inspect.signature(masking_utils.create_masks_for_generate).parameters) - {"kwargs"}
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    for layer_type in set(getattr(config.get_text_config(), "layer_types", None) or ()):
        functions = mapping.get(layer_type)
        for function in (functions.values() if isinstance(functions, dict) else [functions]):
            if function is None:
                continue
            parameters = inspect.signature(function).parameters
            if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                continue
            if not passed <= set(parameters):
                return False
    return True


def _default_compile_config(model):
    """transformers' default compile config for this model, allowed on every device (it compiles on accelerators
    only unless ``_compile_all_devices``)."""
    import copy

    from transformers import CompileConfig

    config = copy.deepcopy(getattr(model.generation_config, "compile_config", None) or CompileConfig())
    config._compile_all_devices = True
    return config


def _wrap_masks(model):
    """``create_masks_for_generate`` (what generate calls before every forward on a compileable cache): on a
    fixed-shape paged cache, a call's one-token forwards get the masks its first decode step built. Valid because a
    call's decode masks only grow by real tokens (generate appends ones), so its left padding, all the kernel reads,
    stays the same; the wrapped cache hook clears them at every call, a multi-token forward clears them too."""
    from transformers import masking_utils

    from arkernels.hf.cache import PagedCache

    original = getattr(model, "create_masks_for_generate", None) or masking_utils.create_masks_for_generate

    def create_masks_for_generate(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        embeds = kwargs.get("inputs_embeds")
        if not isinstance(cache, PagedCache) or not cache.is_compileable or embeds is None or embeds.shape[1] != 1:
            return original(*args, **kwargs)
        if cache.decode_masks is None:
            cache.decode_masks = original(*args, **kwargs)
        return cache.decode_masks

    return create_masks_for_generate


def _wrap_compiled_call(model, original, tier: _Tier):
    """``get_compiled_call`` (what generate uses for every forward after the prefill when the cache is compileable):
    the compiled forward, preceded by the paged cache's host half of the step (its traced ``update`` does only device
    work). A forward the fixed-shape cache cannot serve (it then leaves fixed shapes) runs eagerly: that call's
    decode is eager from there on, with one warning. When the "auto" rule asked for this compile (``tier``), a
    compile that raises (no C++ compiler for Inductor, an unsupported op) warns once and the model decodes eagerly
    from then on: the compile of a forward's first graph happens before any of it runs, so the cache is untouched."""
    from arkernels.hf.cache import PagedCache

    def get_compiled_call(compile_config):
        compiled = original(compile_config)

        def forward(*args, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if tier.failed and tier.this_call:
                return model.__call__(*args, **kwargs)
            if not isinstance(cache, PagedCache):
                return compiled(*args, **kwargs)
            ids = kwargs.get("input_ids")
            tokens = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
            if not cache.begin_forward(tokens):
                _warn_once("unfixed", "arkernels.patch: the paged cache left its fixed shapes (a forward longer than "
                           "it reserved, or a padding mask that is not left padding); this call decodes eagerly")
                return model.__call__(*args, **kwargs)
            try:
                return compiled(*args, **kwargs)
            except Exception as e:
                if not tier.this_call or not isinstance(e, _compile_errors()):
                    raise
                tier.failed = True
                _warn_once("tier-failed", f"arkernels.patch: compiling the decode step failed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); this model decodes eagerly from now on")
                return model.__call__(*args, **kwargs)  # begin_forward's host half stands (host_ahead)
            finally:
                cache.end_forward()

        return forward

    return get_compiled_call


class ArkernelsSampler:
    """A logits processor that draws the next token with ``arkernels.sample`` and returns a one-hot score row.

    The draw of a row depends only on (its logits, the parameters, the seed, the step): the seed is taken from
    torch's global generator when generate starts, so ``torch.manual_seed`` makes runs reproducible. ``rules``
    (``_HFRules``): transformers' token-rule processors this draw replaces. ``ArkernelsSampler.calls`` counts the
    draws made (all instances; tests read it to see the fused sampler ran).
    """

    calls = 0

    def __init__(self, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, rules=None):
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.seed, self.step, self.rules = seed, 0, rules
        self.seeds = None  # per-row seeds, built at the first call

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from arkernels.ops.sampling import sample

        kw = self.rules.kwargs(input_ids, scores) if self.rules is not None else {}
        batch = scores.shape[0]
        if self.seeds is None or self.seeds.shape[0] != batch or self.seeds.device != scores.device:
            # row r draws with seed + r * stride (arkernels.generate's stream per sample): the rows of
            # num_return_sequences share their logits, and one seed for all would make them identical samples
            from arkernels.ops.sampling import seed_stream

            self.seeds = torch.tensor(seed_stream(self.seed, batch), dtype=torch.int64, device=scores.device)
        ids = sample(scores, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                     seed=self.seeds, step=self.step, **kw)
        self.step += 1
        ArkernelsSampler.calls += 1
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, ids.view(-1, 1).to(torch.int64), 0.0)
        return out


# Below this temperature stock's ``scores / T`` can overflow fp32 (|logit| > T * 3.4e38 ~ 2.7e8 at T = 2**-100) and
# stock then fails in its multinomial; above it both give the same kept sets (only the argmax survives long before).
_MIN_FUSED_TEMPERATURE = 2.0**-100
_INT32_MAX = 2**31 - 1


def _fused_params(processors) -> tuple[int, dict] | None:
    """``(first, params)`` when the processors end with a run of temperature / top-k / top-p / min-p warpers in
    transformers' order, each at most once and keeping at least one token (what ``arkernels.sample`` implements);
    ``first`` is where that run starts. None when anything else would run among or after them, or when a value is
    one transformers accepts but the fused sampler does not reproduce exactly (``_fusable``): stock's warpers then
    serve the call."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    order = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    first, rank = len(processors), len(order)
    for i in range(len(processors) - 1, -1, -1):
        p = processors[i]
        r = next((j for j, cls in enumerate(order) if type(p) is cls), None)
        if r is None:
            break
        if r >= rank or getattr(p, "min_tokens_to_keep", 1) != 1:
            return None  # out of order, repeated, or keeping more than one token
        if isinstance(p, TemperatureLogitsWarper):
            params["temperature"] = float(p.temperature)
        elif isinstance(p, TopKLogitsWarper):
            params["top_k"] = int(p.top_k)
        elif isinstance(p, TopPLogitsWarper):
            params["top_p"] = float(p.top_p)
        else:
            params["min_p"] = float(p.min_p)
        first, rank = i, r
    if any(isinstance(p, order) for p in processors[:first]):
        return None  # one of ours runs before another processor: the fused sampler cannot move it
    if not _fusable(**params):
        return None
    params["top_k"] = min(params["top_k"], _INT32_MAX)  # stock clamps top_k to the vocab: past it, both are "off"
    return first, params


def _fusable(temperature: float, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether the fused sampler gives stock's kept set for these warper values (the ones transformers' warpers
    accept; anything they refuse has raised already, before this hook sees it).

    - ``top_p`` 0 (``TopPLogitsWarper`` takes [0, 1]): stock keeps exactly one token (the last of its ascending sort);
      ``arkernels.sample`` takes ``(0, 1]``. (A NaN ``top_p`` gets no warper from transformers: ``nan < 1`` is False.)
    - ``temperature`` below ``_MIN_FUSED_TEMPERATURE`` or infinite: stock's division overflows or turns ``-inf``
      scores into NaN; its own behaviour (an error from multinomial) is the contract.
    - ``top_k`` < 0 or ``min_p`` outside [0, 1] cannot reach here (stock refuses them), checked anyway."""
    return (math.isfinite(temperature) and temperature >= _MIN_FUSED_TEMPERATURE and top_k >= 0
            and 0.0 < top_p <= 1.0 and 0.0 <= min_p <= 1.0)


class _HFRules:
    """transformers' token-rule processors of one generate call as the fused sampler's arguments: the token history
    (``arkernels.token_state``, int32 ``[batch, vocab]``) is built from ``input_ids`` at the first step (positions
    before the repetition processor's ``prompt_ignore_length`` left out, as it leaves them out) and each later
    step adds the columns ``input_ids`` grew by, on the device."""

    def __init__(self, processors, repetition, ignore, bias: dict, banned: list, suppressed: list, eos: list,
                 min_len: int):
        self.processors = processors  # the stock processors replaced (they raise stock's errors on bad ids)
        self.repetition, self.ignore, self.bias, self.banned = repetition, ignore, bias, banned
        self.suppressed = suppressed  # suppress_tokens: ids outside the vocabulary suppress nothing (stock's isin)
        self.eos, self.min_len = eos, min_len  # EOS masked while input_ids is shorter than min_len
        self.state = self.table = None
        self.seen = 0

    def kwargs(self, input_ids: torch.Tensor, scores: torch.Tensor) -> dict:
        from arkernels.ops.sampling import PROMPT_BIT, logit_bias_table, token_state, update_token_state

        batch, vocab = scores.shape
        if self.state is None:
            ids = [t for t in list(self.bias) + self.banned]
            if any(not 0 <= t < vocab for t in ids) or bool(((input_ids < 0) | (input_ids >= vocab)).any()):
                for p in self.processors:  # transformers' own error for ids outside the vocabulary
                    p(input_ids, scores.clone())
            # stock's min-length and suppress processors match ids against the vocabulary (isin): an EOS id of -1
            # (generate warns and runs) or one past the vocabulary masks nothing
            banned = self.banned + [t for t in self.suppressed if 0 <= t < vocab]
            eos = [t for t in self.eos if 0 <= t < vocab]
            st = token_state([[]] * batch, vocab, banned=banned or None, eos_token_id=eos or None,
                             device=scores.device)
            keep = torch.ones_like(input_ids, dtype=torch.bool)
            if self.ignore is not None:
                pos = torch.arange(input_ids.shape[1], device=input_ids.device)
                ignore = torch.as_tensor(self.ignore, device=input_ids.device).reshape(-1, 1)
                keep = (pos[None, :] >= ignore).expand_as(input_ids)  # an int ignore: one row for all
            rows = torch.arange(batch, device=input_ids.device)[:, None].expand_as(input_ids)
            st[rows[keep], input_ids[keep]] |= PROMPT_BIT
            self.state = st
            if self.bias:
                self.table = logit_bias_table([self.bias] * batch, vocab, device=scores.device)
        else:
            for j in range(self.seen, input_ids.shape[1]):  # normally one column: the last step's tokens
                update_token_state(self.state, input_ids[:, j])
        self.seen = input_ids.shape[1]
        return dict(token_state=self.state, logit_bias=self.table,
                    repetition_penalty=1.0 if self.repetition is None else self.repetition,
                    new_tokens=input_ids.shape[1], min_new_tokens=self.min_len)


def _fused_rules(processors):
    """``_HFRules`` when every processor is a token rule the sampler implements and their order gives transformers'
    results (finite biases before the repetition penalty; bans and masks commute with both), else None."""
    from transformers.generation.logits_process import (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                                                        NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor, SuppressTokensLogitsProcessor)

    if not processors:
        return None
    repetition, ignore, bias, banned, suppressed, eos, min_len = None, None, {}, [], [], None, 0
    for p in processors:
        kind = type(p)
        if kind is RepetitionPenaltyLogitsProcessor and repetition is None:
            if not (isinstance(p.penalty, float) and 0 < p.penalty < math.inf):
                return None
            repetition, ignore = p.penalty, p.prompt_ignore_length
        elif kind in (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor):
            items = dict(p.sequence_bias).items()
            if any(len(k) != 1 for k, _ in items):
                return None  # multi-token sequences: stock
            for (t,), v in items:
                v = float(v)
                if v == -math.inf:
                    banned.append(int(t))
                elif math.isfinite(v) and repetition is None:
                    bias[int(t)] = bias.get(int(t), 0.0) + v
                else:
                    return None  # +inf / NaN, or a bias after the repetition penalty
        elif kind in (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor):
            # both mask the EOS ids while input_ids is shorter than a length: min_length, or the prompt length +
            # min_new_tokens; together, the longer of the two
            ids = sorted({int(t) for t in torch.as_tensor(p.eos_token_id).reshape(-1).tolist()})
            if eos is not None and ids != eos:
                return None
            eos = ids
            n = (int(p.min_length) if kind is MinLengthLogitsProcessor
                 else int(p.prompt_length_to_skip) + int(p.min_new_tokens))
            min_len = max(min_len, n)
        elif kind is SuppressTokensLogitsProcessor:
            suppressed += [int(t) for t in p.suppress_tokens.reshape(-1).tolist()]
        else:
            return None
    return _HFRules(list(processors), repetition, ignore, bias, banned, suppressed, eos or [], min_len)


def _sampler_serves(sampler: bool | str, do_sample: bool, device) -> bool:
    """Whether the fused draw may replace this call's processors: ``sampler=True`` always (where exact), "auto" only
    for sampling on a CUDA device (see ``patch``)."""
    if sampler == "auto":
        return bool(do_sample) and device is not None and torch.device(device).type == "cuda"
    return bool(sampler)


def _wrap_logits_processor(original, state: dict, sampler: bool | str = True):
    signature = inspect.signature(original)

    def _get_logits_processor(*args, **kwargs):
        processors = original(*args, **kwargs)
        if state["stock"]:
            return processors  # a call served as the unpatched model (arkernels.hf.stock_call)
        bound = signature.bind(*args, **kwargs).arguments
        config = bound["generation_config"]
        device = bound.get("device") or getattr(getattr(original, "__self__", None), "device", None)
        if not _sampler_serves(sampler, config.do_sample, device):
            return processors
        # only plain sampling / greedy: beams draw several candidates from the warped scores, assisted decoding
        # compares distributions, output_scores returns the warped scores: a one-hot row would change all three
        if (state.get("mode") not in (None, "sample", "greedy_search") or (config.num_beams or 1) != 1
                or config.output_scores):
            return processors
        if config.do_sample:
            fused = _fused_params(processors)
            if fused is None:
                return processors
            first, params = fused
        else:
            first, params = len(processors), dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
        rules = _fused_rules(processors[:first])
        if rules is None and not config.do_sample:
            return processors  # greedy with nothing to fuse (or something we do not implement): stock
        kept = type(processors)(processors[:first] if rules is None else [])
        # greedy takes no seed (and so leaves torch's generator as stock leaves it)
        seed = int(torch.randint(0, 2**62, (1,)).item()) if config.do_sample else 0
        kept.append(ArkernelsSampler(**params, seed=seed, rules=rules))
        return kept

    return _get_logits_processor
