"""``arkernels.patch(model)``: make a plain ``model.generate()`` run on arkernels, for this model instance only.

This module only orchestrates: it checks the arguments, installs three independent pieces and returns the handle
that undoes them.
- attention: our attention + mask functions registered under ``arkernels.hf.attention.NAME`` and selected on this
  model's config (``set_attn_implementation``); the registries are global, the selection is per instance.
- cache: the paged cache and its compiled decode step (``arkernels.hf.cache_hook``).
- sampler: the fused draw in place of transformers' warpers and token rules (``arkernels.hf.sampler_hook``), and the
  fused acceptance of a sampling draft model's tokens (``arkernels.hf.spec_hook``).

A call none of them can serve exactly (``output_attentions=True``, training mode) runs as the unpatched model would,
for that call (``arkernels.hf.stock_call``); a vision or audio tower keeps the model's own attention.

``patch`` checks what it can before changing anything: the family, ``block_size``, the model's dtype and device.
"""
from __future__ import annotations

import torch

from arkernels.hf.cache_hook import (COMPILE_AFTER, Tier, wrap_cache, wrap_compile_criteria, wrap_compiled_call,
                                    wrap_masks)
from arkernels.hf import spec_hook
from arkernels.hf.sampler_hook import wrap_logits_processor

_PATCH_ATTR = "_arkernels_patch"


class PatchHandle:
    """Returned by ``patch``; ``undo()`` restores the model exactly (idempotent)."""

    def __init__(self, model, saved_attn: str | None, attrs: list[str], fuse_handle=None, shadowed=None):
        self.model = model
        self._saved_attn = saved_attn
        self._attrs = attrs
        self._shadowed = shadowed or {}  # instance attributes a hook replaced (accelerate's forward): put back
        self._fuse = fuse_handle  # arkernels.fuse.FuseHandle while the patch holds the projections fused
        self._spec_hook = "_get_logits_processor" in attrs  # the sampler's pieces hold spec_hook's module attribute
        self.active = True

    def undo(self) -> None:
        if not self.active:
            return
        model = self.model
        if "init_continuous_batching" in self._attrs:
            from arkernels.hf.cb import unhook_continuous_batching

            unhook_continuous_batching(model)  # first: it stops a CB session still running on our attention
        if self._spec_hook:
            spec_hook.release()
        for name in self._attrs:
            model.__dict__.pop(name, None)  # the class method shows through again
        model.__dict__.update(self._shadowed)
        if self._saved_attn is not None:
            model.set_attn_implementation(self._saved_attn)
        if self._fuse is not None:
            self._fuse.undo()
        model.__dict__.pop(_PATCH_ATTR, None)
        self.active = False

    def fuse_when_compiled(self) -> None:
        """``fuse="auto"`` where the patch did not fuse up front (``compile="auto"``): called whenever a call is about
        to compile its decode step, the first such call fuses the projections (what ``compile=True`` does at patch
        time), kept until ``undo()``; a model fused by its caller or tensor-parallel is left as it is."""
        from arkernels.fuse import fuse_in_generate, wants_fusion

        if self.active and self._fuse is None and wants_fusion(self.model, "auto", True, "arkernels.patch"):
            self._fuse = fuse_in_generate(self.model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def _check_patch_args(model, block_size, attention: bool, cache: bool, sampler, compile, compile_after,
                      kv_cache_dtype, k_scale, v_scale) -> None:
    """Every argument of ``patch`` checked, in this order, before anything is changed (one error naming it)."""
    from arkernels.cache.fp8 import kv_cache_dtype_of, per_layer_scales
    from arkernels.hf.capability import check_model, check_model_tensors

    check_model(model, "arkernels.patch")
    check_model_tensors(model, "arkernels.patch", attention)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"arkernels.patch: block_size must be an int >= 1 (tokens per cache block), got "
                         f"{block_size!r}")
    if sampler not in ("auto", True, False):
        raise ValueError(f"arkernels.patch: sampler must be 'auto', True or False, got {sampler!r}")
    if compile not in ("auto", True, False):
        raise ValueError(f"arkernels.patch: compile must be 'auto', True or False, got {compile!r}")
    if compile_after is not None and (not isinstance(compile_after, int) or isinstance(compile_after, bool)
                                      or compile_after < 0):
        raise ValueError(f"arkernels.patch: compile_after must be an int >= 0 (decode steps) or None, got "
                         f"{compile_after!r}")
    kv_dtype = kv_cache_dtype_of("arkernels.patch", kv_cache_dtype)
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        per_layer_scales("arkernels.patch", name, sc,
                         model.config.get_text_config(decoder=True).num_hidden_layers, kv_dtype)
    if kv_dtype is not None and not cache:
        raise ValueError("arkernels.patch: kv_cache_dtype='fp8' needs cache=True (the paged cache holds the fp8 K/V)")
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise RuntimeError("arkernels.patch: this model is already patched; undo() the first handle")


def _hook_attention(model, state: dict, sampler) -> tuple[str, list[str], dict]:
    """Select our attention on this model, its stock-call hooks on generate / forward and the continuous-batching
    hook: ``(the attention implementation it had, the attributes set, the instance attributes they shadow)``."""
    from arkernels.hf.attention import register
    from arkernels.hf.cb import hook_continuous_batching
    from arkernels.hf.stock_call import AttentionSwap, wrap_forward, wrap_generate

    saved_attn = model.config._attn_implementation
    swap = AttentionSwap(model)
    model.set_attn_implementation(register())
    swap.record_after()
    shadowed = {name: model.__dict__[name] for name in ("generate", "forward") if name in model.__dict__}
    model.generate = wrap_generate(model, model.generate, swap, state)
    model.forward = wrap_forward(model, model.forward, swap)
    attrs = ["generate", "forward"]
    # continuous batching (generate_batch, init_continuous_batching, generate(cache_implementation="paged")):
    # its own instance hook, see arkernels.hf.cb
    if hook_continuous_batching(model, sampler=sampler is not False):  # CB's batched draw: fused unless False
        attrs.append("init_continuous_batching")
    return saved_attn, attrs, shadowed


def patch(model, attention: bool = True, cache: bool = True, sampler: bool | str = "auto", *, block_size: int = 16,
          fuse: bool | str = "auto", kv_cache_dtype: str | torch.dtype = "auto",
          k_scale: float | list[float] | None = None, v_scale: float | list[float] | None = None,
          compile: bool | str = "auto", compile_after: int | None = COMPILE_AFTER):
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
            ``arkernels.hf.sampler_hook``); greedy calls, and every call on the CPU (where ``arkernels.sample`` is
            composed of more torch ops than the stock warpers it replaces), keep transformers' processors: stock's
            tokens at stock's cost. True: the fused draw for every call it can serve exactly, greedy ones with token rules
            included, on every device (arkernels' seeded draws everywhere). False: never.
        fuse: also merge q/k/v and gate/up into one layer each (``arkernels.fuse_projections``, undone with the
            rest). "auto" (default): where the decode step compiles: with ``compile=True`` and the cache from the
            patch on (greedy / sampling calls compile from the first), with ``compile="auto"`` from the first call
            that compiles (the tier's, or one with ``compile_config``; kept fused from then on, eager calls
            included), never with ``compile=False``, nor on a model already fused or tensor-parallel; True: always;
            False: never. While fused, ``model.state_dict()`` holds ``qkv_proj`` / ``gate_up_proj``: undo before
            saving.
        kv_cache_dtype: the ``PagedCache``'s storage: "auto" (the model's dtype) or "fp8" (float8_e4m3fn with a K
            and a V scale per layer, vLLM's convention), read by the CPU and the CUDA attention kernels.
        k_scale, v_scale: fp8 only: a float, one float per layer, or None (default): calibrated per layer on each
            call's prefill as ``max(absmax / 200, 1e-6)`` for K, ``/ 100`` for V (vLLM's defaults).
        compile: the decode step of greedy / sampling calls. "auto" (default) and True: the paged cache of such a call
            has fixed shapes (every block reserved at prefill, lengths advanced on the device). "auto" is tiered on
            every device: the patched model's first ``compile_after`` decode steps run eagerly (transformers compiles
            no call on its default cache, and a short call runs as stock runs it: no compile, a returned cache that
            says ``is_compileable`` False), then its calls compile (transformers' default ``CompileConfig`` unless the
            call passes one): short one-off calls never pay the compile, sustained use gets the compiled step. True:
            transformers compiles the fixed cache wherever it would compile a static cache (``compile_config``; any
            CUDA model), and on the CPU from the first call. False: the host-path paged cache, never compiled.
            ``generate(..., disable_compile=True)`` or ``torch.compiler.set_stance("force_eager")`` turn compilation
            off for a call; ``cache_implementation="static"`` keeps transformers' static cache and its compile. The
            compile is transformers': one graph per batch size; a compile that fails under "auto" (no C++ compiler for
            Inductor, say) warns once and the model stays eager.
        compile_after: "auto" only: decode steps (forwards of one token per row, summed over this patch's calls) after
            which its calls compile; an int >= 0, or None: transformers' rule only (it compiles the fixed cache from
            the first call with ``compile_config`` or on CUDA). Default ``COMPILE_AFTER`` (1024): on the host-bound
            tiny Llama the first compile costs about as much CPU time as 1000-1500 eager steps, so the rule pays at
            most about twice the best choice made in hindsight (rent-or-buy).

    Returns:
        ``PatchHandle``: ``handle.undo()`` restores the model; also a context manager.
    """
    _check_patch_args(model, block_size, attention, cache, sampler, compile, compile_after, kv_cache_dtype, k_scale,
                      v_scale)
    from arkernels.fuse import fuse_projections, wants_fusion

    fuse_handle = None
    if wants_fusion(model, fuse, compile is True and cache, "arkernels.patch"):
        # first: it is the only piece that can refuse (fuse=True on a model already fused), before anything changes
        fuse_handle = fuse_projections(model)
    # mode: this call's generation mode (the cache hook runs before the logits-processor hook); tier: the "auto"
    # rule's count of eager decode steps (see Tier); stock: this call runs as the unpatched model (stock_call)
    state = {"mode": None, "tier": Tier(compile_after if compile == "auto" else None), "stock": False}
    saved_attn, attrs, shadowed = None, [], {}
    if attention:
        saved_attn, attrs, shadowed = _hook_attention(model, state, sampler)
    if cache or sampler:
        cache_kwargs = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        model._prepare_cache_for_generation = wrap_cache(model, model._prepare_cache_for_generation, block_size,
                                                         state, swap=cache, cache_kwargs=cache_kwargs, compile=compile)
        attrs.append("_prepare_cache_for_generation")
    if cache and compile is not False:
        def late_fuse():  # fuse="auto": the first patched call that compiles fuses (``handle`` is made below)
            if not state["stock"]:
                handle.fuse_when_compiled()

        model.get_compiled_call = wrap_compiled_call(model, model.get_compiled_call, state["tier"],
                                                     late_fuse if fuse == "auto" else None)
        model.create_masks_for_generate = wrap_masks(model)
        model._valid_auto_compile_criteria = wrap_compile_criteria(model._valid_auto_compile_criteria)
        attrs += ["get_compiled_call", "create_masks_for_generate", "_valid_auto_compile_criteria"]
    if sampler:
        model._get_logits_processor = wrap_logits_processor(model._get_logits_processor, state, sampler)
        if "generate" not in attrs:  # attention=False: generate is not wrapped yet
            shadowed.update({"generate": model.__dict__["generate"]} if "generate" in model.__dict__ else {})
            attrs.append("generate")
        model.generate = spec_hook.wrap_generate(model, model.generate, state, sampler)
        spec_hook.hold()
        attrs.append("_get_logits_processor")
    handle = PatchHandle(model, saved_attn, attrs, fuse_handle, shadowed)
    model.__dict__[_PATCH_ATTR] = handle
    return handle
