"""Calls a patched model serves as the unpatched model would: the per-call way back to transformers' own path.

A drop-in serves every call stock serves. What arkernels' kernels cannot give exactly in one call, the model's
original attention implementation gives, for that call only; the next call is arkernels' again:

- ``output_attentions=True`` (per call, or ``generation_config.output_attentions``): arkernels' attention returns no
  weights. A ``generate`` call that asks for them runs whole on stock: the attention implementation the model had
  before ``patch`` (``eager`` returns the weights, ``sdpa`` warns and returns None, exactly as unpatched), its
  ``DynamicCache`` (so a sliding layer's attention covers the keys stock's cache keeps) and stock's warpers. A
  direct forward that asks for them runs that forward on the original implementation.
- a vision or audio tower (bidirectional attention): it keeps the original implementation for good (the patch
  selects arkernels' attention on the decoder's configs only).
- a call in training mode (``model.train()``, or any module left in training: dropout): the original
  implementation (arkernels' kernels are inference kernels), ``generate`` and forward alike.
- a layer called on its own (outside the model's forward) with ``output_attentions=True``, ``is_causal=False`` or
  dropout in training: ``arkernels_attention`` hands that call to the layer's original implementation
  (``arkernels.hf.attention.remember_original``), over the dense keys and the mask the caller passed.

``AttentionSwap`` holds, per config object of the model, the implementation before the patch and after it; swapping
writes transformers' internal attribute directly (``set_attn_implementation`` re-validates every submodule: too
slow per forward, and nothing to validate: both values were set by transformers itself).

Compile: ``compile_forbidden`` says when a call must not compile at all (``generation_config.disable_compile``,
``torch.compiler.set_stance("force_eager")``): the patch then gives that call a cache that is not compileable, so
transformers neither compiles nor builds a compiled call, and the returned cache says so.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from arkernels.hf.attention import remember_original

_INTERNAL = "_attn_implementation_internal"  # where transformers keeps a config's implementation (5.17 - 5.24)


class AttentionSwap:
    """Each config of ``model`` (the top one, its sub-configs, its submodules') with the implementation it had before
    the patch (``before``) and has after it (``after``): only the configs the patch changed."""

    def __init__(self, model):
        self.model = model
        self.configs = _configs(model)
        self.before = [getattr(c, _INTERNAL, None) for c in self.configs]
        self.after: list | None = None
        self.depth = 0  # > 0 while a stock call runs (re-entrant)
        self.generating = 0  # > 0 inside this model's generate (its forwards follow the call's decision)

    def record_after(self) -> None:
        """After ``set_attn_implementation``: the configs outside the decoder (a vision or audio tower: bidirectional
        attention, which arkernels does not implement) get their original implementation back for good, so images
        run as unpatched; the rest is what ``stock`` swaps."""
        decoder = _decoder_configs(self.model)
        for config, value in zip(self.configs, self.before):
            if id(config) not in decoder:
                setattr(config, _INTERNAL, value)
        after = [getattr(c, _INTERNAL, None) for c in self.configs]
        keep = [i for i, (b, a) in enumerate(zip(self.before, after)) if b != a]
        self.configs = [self.configs[i] for i in keep]
        self.before = [self.before[i] for i in keep]
        self.after = [after[i] for i in keep]
        for config, value in zip(self.configs, self.before):
            remember_original(config, value)

    @contextlib.contextmanager
    def stock(self):
        """The original implementation on every changed config while the block runs (re-entrant)."""
        if self.depth == 0:
            self._write(self.before)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._write(self.after)

    def _write(self, values) -> None:
        for config, value in zip(self.configs, values):
            setattr(config, _INTERNAL, value)


def _configs(model) -> list:
    """Every distinct config object reachable from ``model``: submodules' ``config`` and sub-configs, depth first."""
    seen, out = set(), []
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        config = stack.pop()
        if config is None or id(config) in seen or not hasattr(config, _INTERNAL):
            continue
        seen.add(id(config))
        out.append(config)
        stack += [getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {}]
    return out


def _decoder_configs(model) -> set[int]:
    """ids of the configs arkernels' attention serves: the top config and those of the decoder's modules."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    modules = decoder.modules() if isinstance(decoder, torch.nn.Module) else model.modules()
    ids = {id(model.config)} | {id(getattr(m, "config", None)) for m in modules}
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else None
    return ids | {id(text)}


def wants_attentions(model, signature: inspect.Signature, args, kwargs) -> bool:
    """Whether a ``generate(*args, **kwargs)`` call returns attention weights: ``output_attentions`` given, else the
    passed ``generation_config``'s, else the model's (transformers' precedence)."""
    if "output_attentions" in kwargs:
        return bool(kwargs["output_attentions"])
    config = kwargs.get("generation_config")
    if config is None and args:
        config = signature.bind_partial(*args).arguments.get("generation_config")
    config = config if config is not None else getattr(model, "generation_config", None)
    return bool(getattr(config, "output_attentions", False))


def wrap_generate(model, original, swap: AttentionSwap, state: dict):
    """``generate``: a call that asks for attention weights, or runs in training mode, runs whole on stock (see the
    module docstring); ``state["stock"]`` tells the cache and sampler hooks to step aside for it."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        stock = in_training(model) or wants_attentions(model, signature, args, kwargs)
        previous, outer_caches = state.get("stock", False), state.get("call_caches")
        state["stock"], state["call_caches"] = stock, []  # the fixed caches this call makes (cache_hook)
        swap.generating += 1
        try:
            with swap.stock() if stock else contextlib.nullcontext():
                return original(*args, **kwargs)
        finally:
            swap.generating -= 1
            for cache in state["call_caches"]:
                cache.end_call()
            state["stock"], state["call_caches"] = previous, outer_caches

    return generate


def wrap_forward(model, original, swap: AttentionSwap):
    """``forward``: a direct forward (outside ``generate``) that asks for attention weights (``output_attentions=True``,
    or the config's flag when the call does not say) or runs in training mode runs on the original implementation.
    A forward over a PagedCache built for arkernels' attention (``arkernels.generate``'s) stays on arkernels: only
    an explicit ``output_attentions=True`` refuses there. Inside ``generate`` (which decides per call) and while
    ``torch.compile`` traces it changes nothing."""

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if torch.compiler.is_compiling() or swap.generating or swap.depth:
            return original(*args, **kwargs)
        attentions = _asks_attentions(model, kwargs)
        if not (attentions or in_training(model)):
            return original(*args, **kwargs)
        if _over_paged_cache(kwargs):
            if kwargs.get("output_attentions"):
                raise NotImplementedError(
                    "arkernels.patch: a forward asks for attention weights (output_attentions=True) over a PagedCache "
                    "built for arkernels' attention, which returns none; pass a transformers cache (or none) to that "
                    "forward, or call generate(output_attentions=True), which runs on the model's own attention and "
                    "cache")
            return original(*args, **kwargs)
        with swap.stock():
            return original(*args, **kwargs)

    return forward


def in_training(model) -> bool:
    """Whether any module of the model is in training mode (a layer left in ``train()`` inside an eval model applies
    its attention dropout stock; arkernels' attention has none): such a call runs as the unpatched model."""
    return model.training or any(m.training for m in model.modules())


def _asks_attentions(model, kwargs) -> bool:
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(model.config, "output_attentions", False)
    return bool(flag)


def _over_paged_cache(kwargs) -> bool:
    from arkernels.hf.cache import PagedCache

    return any(isinstance(kwargs.get(name), PagedCache) and kwargs[name].paged_attention
               for name in ("cache", "past_key_values"))


def compile_forbidden(generation_config) -> bool:
    """Whether this call must not compile: ``disable_compile``, or ``torch.compiler.set_stance("force_eager")`` in
    force (torch keeps the stance in ``torch._dynamo.eval_frame._stance``; read defensively)."""
    if getattr(generation_config, "disable_compile", False):
        return True
    from torch._dynamo import eval_frame

    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    return stance == "force_eager"
