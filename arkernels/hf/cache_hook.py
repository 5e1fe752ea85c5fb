"""The cache and compile hooks of ``arkernels.patch``: instance attributes over three of the model's generate methods.

- ``wrap_cache`` (``_prepare_cache_for_generation``): where generate would build its default ``DynamicCache`` for a
  mode the paged cache serves (greedy, sampling, beam search, beam sampling, assisted and prompt-lookup decoding),
  it gets a ``PagedCache`` sized for the call (prompt + max_new_tokens). Any other cache request
  (``cache_implementation="static"`` and the other compiled caches, a cache the user passed, a mode outside that list)
  keeps transformers' own cache for that call; modes the paged cache cannot take warn once. Greedy and sampling calls
  get it with fixed shapes (compileable): transformers then compiles their decode forward where it compiles a static
  cache. A call that must not compile (``disable_compile``, ``torch.compiler.set_stance("force_eager")``) gets a cache
  that is not compileable.
- ``wrap_compiled_call`` (``get_compiled_call``): the cache's host half of each step runs before the compiled forward.
- ``wrap_masks`` (``create_masks_for_generate``): a call's decode masks are built once.

``Tier`` holds the ``compile="auto"`` rule's state (``COMPILE_AFTER`` eager decode steps before the CPU compiles).
"""
from __future__ import annotations

import functools
import inspect
import warnings


# compile="auto" on a device where transformers does not compile by itself (the CPU): eager decode steps of a patched
# model before its calls compile. The host-bound tiny Llama's first compile (~7-13 s of CPU on this project's 2-core
# machines) costs about 1000-1500 of its eager steps (~5-6 ms each), SmolLM2-135M's (~30 layers) about as many of its
# ~50-100 ms steps: 1024 keeps the rent-or-buy rule within ~2x of the best choice made in hindsight for both.
COMPILE_AFTER = 1024


class Tier:
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


@functools.cache
def _compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile: dynamo's errors (a backend's failure included) and
    Inductor's (imported on first use: torch._dynamo is slow to import)."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return TorchDynamoException, InductorError


_warned: set[str] = set()


def _warn_once(key: str, msg: str, stacklevel: int = 3) -> None:
    """Warn once per key (per process); ``stacklevel`` 3 names the caller of the hook that warns."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=stacklevel)


def _paged_modes():
    """The generation modes a PagedCache serves (names of transformers' ``GenerationMode``)."""
    return ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")


# modes whose decode forwards all take one token per row and never reorder or roll back the cache: their paged cache
# has fixed shapes and is compileable; beams (reorders, copy-on-write) and assisted decoding (crop, candidate runs of
# varying length) keep the host path, eager
_FIXED_MODES = ("greedy_search", "sample")


def wrap_cache(model, original, block_size: int, state: dict, swap: bool, cache_kwargs: dict | None = None,
               compile: bool | str = "auto"):
    """``_prepare_cache_for_generation``: generate's default ``DynamicCache`` replaced by a ``PagedCache`` sized for
    the call, for the modes it serves (see the module docstring); ``state["mode"]`` records the call's mode."""
    from transformers import DynamicCache

    from arkernels.hf.cache import PagedCache

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
        if not swap or state["stock"] or not _default_cache_asked(generation_config):
            return
        for name in ("cache", "past_key_values"):  # 5.24 renamed the argument
            made = model_kwargs.get(name)
            if type(made) is DynamicCache and not getattr(made, "_is_user_defined", False):
                if state["mode"] not in _paged_modes():
                    _warn_once(f"mode:{state['mode']}", f"arkernels.patch: generation mode {state['mode']!r} keeps "
                               "transformers' DynamicCache for this call")
                    return
                model_kwargs[name] = _paged_cache(model, generation_config, state, bound.arguments.get(
                    "max_cache_length"), block_size, cache_kwargs, compile)

    return _prepare_cache_for_generation


def _default_cache_asked(generation_config) -> bool:
    """Whether the call asks for transformers' default cache (the one the paged cache replaces); any other
    ``cache_implementation`` warns once and keeps transformers' cache."""
    if generation_config.cache_implementation in (None, "dynamic"):
        return True
    # static / hybrid / offloaded / quantized caches exist for compiled forwards and memory layouts the paged
    # cache does not reproduce: transformers' cache serves this call (arkernels attention still runs)
    _warn_once(f"impl:{generation_config.cache_implementation}",
               f"arkernels.patch: cache_implementation={generation_config.cache_implementation!r} keeps "
               "transformers' own cache for this call (the paged cache has no compiled static step in "
               "generate yet)", stacklevel=4)
    return False


def _paged_cache(model, generation_config, state: dict, max_length, block_size: int, cache_kwargs: dict | None,
                 compile: bool | str):
    """The call's ``PagedCache``: fixed shapes (compileable) for greedy / sampling calls that may compile, and the
    "auto" rule's decision (``Tier``) on the CPU, where transformers does not compile by itself."""
    from arkernels.hf.attention import NAME
    from arkernels.hf.cache import PagedCache
    from arkernels.hf.stock_call import compile_forbidden

    paged = model.config._attn_implementation == NAME
    fixed = (compile is not False and paged and state["mode"] in _FIXED_MODES and bool(max_length)
             and _masks_for_generate_work(model.config) and not compile_forbidden(generation_config))
    if generation_config.compile_config is not None and not fixed and not compile_forbidden(generation_config):
        _warn_once(f"eager:{state['mode']}", f"arkernels.patch: generation mode {state['mode']!r} runs the paged "
                   "cache eagerly (compile_config applies to greedy and sampling calls)", stacklevel=4)
    eager = fixed and _tier_decides(model, generation_config, state["tier"], compile)
    cache = PagedCache(model.config, block_size=block_size, max_length=max_length, paged_attention=paged,
                       compileable=fixed, **(cache_kwargs or {}))
    if eager:
        cache.step_counter = state["tier"]  # an eager call: its decode steps count towards the "auto" rule
        cache.eager_call = True  # wrap_compile_criteria: transformers does not compile this call
    if fixed:
        state.setdefault("call_caches", []).append(cache)  # end_call when generate returns (stock_call)
    if getattr(generation_config, "is_assistant", False):
        # what transformers did to the cache it built (an assistant's cache is rolled back by crop)
        cache.activate_past_recording()
    return cache


def _tier_decides(model, generation_config, tier: Tier, compile: bool | str) -> bool:
    """The compile decision for a fixed-shape call; True when it must run eagerly. ``compile="auto"`` (with
    ``compile_after``) is tiered on every device: the patched model's first ``compile_after`` decode steps are eager,
    whatever transformers would do with a compileable cache (stock compiles no default-cache call: a short call
    stays as stock runs it), then its calls compile (transformers' default ``CompileConfig`` unless the call has
    one). ``compile=True``, and "auto" with ``compile_after=None``: transformers' rule, and on the CPU, where that
    rule never compiles without ``compile_config``, True compiles from the first call."""
    tier.this_call = False
    if compile == "auto" and tier.after is not None:
        tier.this_call = tier.due()
        if not tier.this_call:
            return True
        _warn_once("tier", f"arkernels.patch: compiling this model's decode step after {tier.steps} eager decode "
                   "steps (compile='auto'; the first call of each batch size compiles; patch(compile_after=None) "
                   "keeps it eager)", stacklevel=5)
    if generation_config.compile_config is None and (tier.this_call or (compile is True
                                                                        and model.device.type == "cpu")):
        generation_config.compile_config = _default_compile_config(model)
    return False


def wrap_compile_criteria(original):
    """``_valid_auto_compile_criteria`` (generate's decision to compile a call's forward): False for a call the
    "auto" rule keeps eager (``PagedCache.eager_call``), transformers' own rule otherwise."""
    from arkernels.hf.cache import PagedCache

    @functools.wraps(original)
    def _valid_auto_compile_criteria(model_kwargs, generation_config):
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if isinstance(cache, PagedCache) and cache.eager_call:
            return False
        return original(model_kwargs, generation_config)

    return _valid_auto_compile_criteria


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


def wrap_masks(model):
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


def wrap_compiled_call(model, original, tier: Tier, before_compile=None):
    """``get_compiled_call`` (what generate uses for every forward after the prefill when the cache is compileable):
    the compiled forward, preceded by the paged cache's host half of the step (its traced ``update`` does only device
    work). ``before_compile()``, when given, runs each time generate asks for the compiled call, before the prefill
    and the trace (patch: ``fuse="auto"`` fuses the projections there). A forward the fixed-shape cache cannot serve (it then leaves fixed shapes) runs eagerly: that call's
    decode is eager from there on, with one warning. When the "auto" rule asked for this compile (``tier``), a
    compile that raises (no C++ compiler for Inductor, an unsupported op) warns once and the model decodes eagerly
    from then on: the compile of a forward's first graph happens before any of it runs, so the cache is untouched."""
    from arkernels.hf.cache import PagedCache

    def get_compiled_call(compile_config):
        if before_compile is not None:
            before_compile()
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
                out = compiled(*args, **kwargs)
                cache.compiled_forwards += 1
                return out
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

