"""transformers' continuous batching (CB) on arkernels' kernels, for one patched model instance.

CB has three entry points: ``model.generate_batch(...)``, ``model.init_continuous_batching()`` (then ``add_request`` /
``get_result``) and ``model.generate(cache_implementation="paged")``, which calls ``generate_batch``. The last two go
through ``init_continuous_batching``, so an instance attribute wrapping that one method covers all three
(``hook_continuous_batching``, called by ``arkernels.patch``; the patch handle removes it).

Registration. CB's gate (``switch_to_cb_friendly_attn``) refuses our plain attention name, and it differs by version
(told apart by whether ``"paged|sdpa"`` is registered, ``paged_prefix_layout``; tested on 5.17 and 5.24):
- transformers 5.17-5.22 switch the model to ``"paged|" + name`` and call that registered function with the
  ``PagedAttentionCache`` in its kwargs (the function calls ``cache.update`` itself): our CB function is registered
  under ``"paged|arkernels"``, the name CB itself would switch to (its official extension point).
- transformers >= 5.23 admit only ``"sdpa"``, ``"paged|eager"`` or a name containing ``"flash"``, and the model calls
  ``cache.update`` before the attention function. Overriding ``"sdpa"`` would change every other model, so our CB
  function is registered under ``CB_FLASH_NAME`` (no digit: CB's flash-2/3 block-table decode path, which would load
  the flash-attn package, stays off). A flash name is also the truthful contract for CB's planning: the kernel needs no
  float mask (CB then builds none) and reads grouped KV heads as they are stored (CB's memory sizing).
Both names are selected only for a CB session: the wrapper sets it on the config just before CB's gate (through the
config setter: ``set_attn_implementation`` would look a flash name up on the Hub) and hands CB our plain name as the
one to restore, which CB's own ``stop()`` puts back. The mask function under both names is ``arkernels_mask`` (CB's
cache makes transformers skip mask creation; a plain forward made while a session holds the name runs our plain
attention).

What runs per layer:
- full-attention layers read CB's cache blocks in place: the new K/V rows are written once with ``paged_kv_append``
  at CB's ``write_index`` slots (instead of CB's ``index_copy_``, and no read-back ``index_select``), and
  ``window_attention`` reads the pages through a block table taken from CB's ``read_index`` (one entry per page: the
  first slot of each page, divided by the page size). Prefix-shared blocks are pages several tables point to. On
  5.24 this needs the cache's ``update`` replaced on the instance CB built for this manager (``_hook_cache_update``);
  on 5.17 our function is the one that calls ``update``.
- sliding-window layers keep CB's update: CB's cache there is a ring of ``window`` slots that a chunk overwrites while
  its earlier queries still need the old keys, so CB reads them out before writing (at most ``window - 1 + q`` rows
  per request). ``window_attention`` then reads those rows as a paged cache of one-row pages (no copy).
- CB's per-request temperature / top-k / top-p (and generate's min-p) draw: when the processors CB kept end with a
  run of exactly those, the run is replaced by one draw with ``arkernels.sample`` (CB's softmax + multinomial over
  the resulting one-hot row returns that token). CB's per-request values still arrive through CB's own argument rows.
  Anything else, and ``return_logprobs`` (a one-hot row would report log-probability 0), keeps CB's processors.
Compile / CUDA graphs: every step is device-side (no host sync, shapes fixed by CB's padded sizes); the queries CB pads
past its last sequence are given to one extra sequence (``_attend``). CB's decode fast path (block tables) is never on
for our names, so decode steps take CB's varlen path (in place for full layers, as above).
"""
from __future__ import annotations

import functools
import weakref

import torch

from arkernels.hf.attention import NAME, arkernels_attention, arkernels_mask
from arkernels.ops.paged_kv import paged_kv_append
from arkernels.ops.sampling import sample
from arkernels.ops.window_attention import window_attention

CB_FLASH_NAME = "arkernels_cb_flash"  # transformers >= 5.23: CB admits names containing "flash"; no digit (see above)
CB_PAGED_NAME = "paged|" + NAME  # transformers 5.17-5.22: the name CB switches a model to
_IN_PLACE = "_arkernels_cb_pages"  # kwargs key our 5.24 cache update hands the attention function
_HOOKED = "_arkernels_cb_hooked"  # set on managers / caches already hooked
_CREATED = "_arkernels_cb_manager"  # set on managers created under the hook (undo destroys a cached one)
FULL, SLIDING = "full_attention", "sliding_attention"


def paged_prefix_layout() -> bool:
    """True for transformers whose CB switches to ``"paged|" + name`` and lets that function call ``cache.update``
    (5.17-5.22: ``"paged|sdpa"`` is registered); False for the flash-name layout (>= 5.23)."""
    from transformers import AttentionInterface

    return "paged|sdpa" in AttentionInterface()


def cb_name() -> str:
    """The attention name a CB session of a patched model runs under, on this transformers."""
    return CB_PAGED_NAME if paged_prefix_layout() else CB_FLASH_NAME


_registered = False


def register_cb() -> str:
    """Register the CB attention + mask functions under this transformers' CB name (idempotent); returns it."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        for name in (CB_PAGED_NAME, CB_FLASH_NAME):
            AttentionInterface.register(name, arkernels_cb_attention)
            AttentionMaskInterface.register(name, arkernels_mask)
        _registered = True
    return cb_name()


# --------------------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------------------
class _InPlace:
    """A full-attention layer's pages ``[num_pages, page_size, Hkv, D]`` and the slots of this batch's keys (CB's
    ``read_index`` for the group, or its ``write_index`` when no request reads past keys: then the keys are the new
    tokens themselves), handed from the cache update to the attention function."""

    __slots__ = ("k_pages", "v_pages", "index")

    def __init__(self, k_pages, v_pages, index):
        self.k_pages, self.v_pages, self.index = k_pages, v_pages, index


def _append(key, value, k_pages, v_pages, write_index):
    """Write CB's new rows (``key``/``value`` ``[1, Hkv, T, D]``) at its slots; padding slots point at CB's trash."""
    paged_kv_append(key[0].transpose(0, 1), value[0].transpose(0, 1), k_pages, v_pages, write_index,
                    check=False)  # CB's allocator built the slots: no host sync


def _in_place_pages(read_index, write_index, k_pages, v_pages):
    return _InPlace(k_pages, v_pages, read_index if read_index.numel() > 0 else write_index)


def _block_table(index: torch.Tensor, cu_k: torch.Tensor, max_len_k: int, page_size: int) -> torch.Tensor:
    """int32 ``[batch, ceil(max_len_k / page_size)]`` from CB's per-token slots: sequence b's keys are
    ``index[cu_k[b] : cu_k[b + 1]]`` in position order, so page j holds slot ``index[cu_k[b] + j * page_size]``.
    Entries past a sequence's length point at some valid page and are masked by its length."""
    cols = torch.arange(-(-max_len_k // page_size), device=index.device) * page_size
    pos = (cu_k[:-1].long()[:, None] + cols).clamp_(max=index.numel() - 1)
    return torch.div(index[pos], page_size, rounding_mode="floor").to(torch.int32)


def _seq_lens(cu_k: torch.Tensor) -> torch.Tensor:
    return (cu_k[1:] - cu_k[:-1]).to(torch.int32)


def _attend(query, k_cache, v_cache, block_table, cu_k, cu_q, max_q, window, scaling, softcap):
    """``window_attention`` over CB's packed queries ``[1, Hq, T, D]``; returns ``[1, T, Hq, D]``.

    Under CUDA graphs / compile CB pads the queries to a static ``T`` past its last sequence (``cu_q[-1] < T``).
    Whether it did is only known on the device, so one more sequence always owns the tail rows
    (``T - cu_q[-1]`` queries, 0 when unpadded) over as many keys of page 0 (any page: its outputs are discarded),
    which keeps every shape static and needs no host sync."""
    q = query[0].transpose(0, 1)  # [T, Hq, D], a view
    total_q = q.shape[0]
    cu_q = cu_q.to(torch.int32)
    tail = total_q - cu_q[-1:]
    cu_q = torch.cat([cu_q, cu_q.new_full((1,), total_q)])
    seq_lens = torch.cat([_seq_lens(cu_k), tail])
    block_table = torch.cat([block_table, block_table.new_zeros((1, block_table.shape[1]))])
    out = window_attention(q, k_cache, v_cache, block_table, seq_lens, window=window, scale=scaling,
                           softcap=softcap, cu_seqlens_q=cu_q, max_q_len=max(int(max_q), 1),
                           check=False)  # CB built the indices; no host sync (CUDA graphs)
    return out.unsqueeze(0)


def _attend_gathered(query, key, value, cu_k, cu_q, max_q, max_k, window, scaling, softcap):
    """Attention over the rows CB gathered (``[total_k, Hkv, D]``, sequence b's at ``cu_k[b]:cu_k[b+1]``), read as a
    paged cache of one-row pages: a view, no copy."""
    total = key.shape[0]
    cols = torch.arange(max(int(max_k), 1), device=key.device)
    table = (cu_k[:-1].long()[:, None] + cols).clamp_(max=max(total - 1, 0)).to(torch.int32)
    return _attend(query, key.unsqueeze(1), value.unsqueeze(1), table, cu_k, cu_q, max_q, window, scaling, softcap)


def _per_type(x, layer_type):
    return x[layer_type] if isinstance(x, dict) else x


def arkernels_cb_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                           sliding_window=None, softcap=None, **kwargs):
    """transformers attention function for CB's packed batches (``AttentionInterface``, under ``cb_name()``).

    Args:
        query: ``[1, Hq, T, D]``: every scheduled token of every request, packed; request b's are rows
            ``cu_seq_lens_q[b] : cu_seq_lens_q[b + 1]`` (rows past the last are CUDA-graph padding).
        key, value: 5.24: what the cache update returned: ``[1, Hkv, total_k, D]`` rows CB gathered (sliding layers),
            or the new rows (full layers: ``kwargs[_IN_PLACE]`` then holds the pages). 5.17: the new rows
            ``[1, Hkv, T, D]`` (this function calls ``cache.update``).
        kwargs: CB's ``cu_seq_lens_q`` int32 ``[B + 1]``, ``cu_seq_lens_k`` (int32 ``[B + 1]`` or one per layer type),
            ``max_length_q/k`` (5.24) or ``max_seqlen_q/k`` (5.17), ``read_index`` / ``write_index`` (one int64 tensor
            per layer group), ``cache`` (5.17). A call without them (a plain forward) runs ``arkernels_attention``.

    Returns:
        ``(out [1, T, Hq, D], None)``.
    """
    if "read_index" not in kwargs or "cu_seq_lens_q" not in kwargs:
        return arkernels_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   sliding_window=sliding_window, softcap=softcap, **kwargs)
    if dropout and module.training:
        raise NotImplementedError("arkernels attention: dropout (training) is not supported; use sdpa for training")
    window, cap = int(sliding_window or 0), float(softcap or 0.0)
    cu_q = kwargs["cu_seq_lens_q"]
    max_q = kwargs.get("max_length_q", kwargs.get("max_seqlen_q"))
    cache = kwargs.get("cache")
    if cache is not None and hasattr(cache, "layer_index_to_group_indices"):  # 5.17: we call the cache update
        group, in_group = cache.layer_index_to_group_indices[module.layer_idx]
        layer_type = FULL if cache.sliding_windows[module.layer_idx] == 1 else SLIDING
        cu_k = _per_type(kwargs["cu_seq_lens_k"], layer_type).to(torch.int32)
        max_k = _per_type(kwargs.get("max_seqlen_k", kwargs.get("max_length_k")), layer_type)
        read, write = kwargs["read_index"][group], kwargs["write_index"][group]
        if layer_type == FULL:
            shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
            k_pages, v_pages = cache.key_cache[in_group].view(shape), cache.value_cache[in_group].view(shape)
            _append(key, value, k_pages, v_pages, write)
            ip = _in_place_pages(read, write, k_pages, v_pages)
            out = _attend(query, ip.k_pages, ip.v_pages, _block_table(ip.index, cu_k, max_k, cache.block_size),
                          cu_k, cu_q, max_q, window, scaling, cap)
            return out, None
        k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                            read_index=kwargs["read_index"], write_index=kwargs["write_index"])  # [total_k, Hkv, D]
        return _attend_gathered(query, k, v, cu_k, cu_q, max_q, max_k, window, scaling, cap), None
    # 5.24: the cache update already ran (and, for full layers, handed us the pages)
    cu_k = kwargs["cu_seq_lens_k"].to(torch.int32)
    max_k = kwargs.get("max_length_k", kwargs.get("max_seqlen_k"))
    ip = kwargs.get(_IN_PLACE)
    if ip is not None:
        page_size = ip.k_pages.shape[1]
        out = _attend(query, ip.k_pages, ip.v_pages, _block_table(ip.index, cu_k, max_k, page_size), cu_k, cu_q,
                      max_q, window, scaling, cap)
        return out, None
    if kwargs.get("block_table") is not None:  # CB's flash-2/3 decode path: never enabled for our name (see top)
        raise NotImplementedError("arkernels CB attention: CB's flash block-table decode path is not supported")
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [total_k, Hkv, D] views of what CB gathered
    return _attend_gathered(query, k, v, cu_k, cu_q, max_q, max_k, window, scaling, cap), None


def _hook_cache_update(cache) -> None:
    """5.24: replace this ``PagedAttentionCache`` instance's ``update`` so full-attention layers write their new rows
    once with ``paged_kv_append`` and hand the pages to the attention function instead of gathering a copy; sliding
    layers (and CB's block-table path) keep CB's update."""
    if getattr(cache, _HOOKED, False) or not hasattr(cache, "layer_to_allocator"):
        return
    original = cache.update

    @torch.compiler.disable  # as CB's own update: it indexes views of the cache tensor
    def update(key_states, value_states, layer_idx, kwargs):
        allocator = cache.layer_to_allocator[layer_idx]
        if (kwargs.get("block_table") is not None or allocator.layer_type != FULL
                or not hasattr(allocator, "get_cache_for_block_table")):
            return original(key_states, value_states, layer_idx, kwargs)
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)  # [num_pages, page_size, Hkv, D]
        write, read = kwargs["write_index"][allocator.index], kwargs["read_index"][allocator.index]
        _append(key_states, value_states, k_pages, v_pages, write)
        kwargs[_IN_PLACE] = _in_place_pages(read, write, k_pages, v_pages)
        return key_states, value_states

    cache.update = update
    setattr(cache, _HOOKED, True)


# --------------------------------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------------------------------
class _FusedDraw:
    """State shared by one fused run: per-row parameter tensors collected from CB's argument rows this step."""

    def __init__(self, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
        self.defaults = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        self.rows = {}

    def draw(self, scores: torch.Tensor) -> torch.Tensor:
        params = dict(self.defaults)
        params.update(self.rows)
        self.rows = {}
        ids = sample(scores, **params)  # seeds from torch's generator: CB seeds it (ContinuousBatchingConfig.seed)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, ids.view(-1, 1), 0.0)


def _per_request_slot(cb_processor, draw: _FusedDraw, name: str, last: bool):
    """A CB per-request processor whose argument row (filled by CB, per request) feeds ``draw``; the last of the run
    draws. Built as a subclass of the processor's own class so CB's list still hands it its row."""
    base = type(cb_processor)

    class Slot(base):
        def __init__(self):
            self.__dict__.update(cb_processor.__dict__)

        def __call__(self, scores, tensor_arg):
            row = tensor_arg[: scores.shape[0]]
            draw.rows[name] = row if name == "top_k" else row.view(torch.float32)
            return draw.draw(scores) if last else scores

    Slot.__name__ = Slot.__qualname__ = "Arkernels" + base.__name__
    return Slot()


class _FusedWarpers:
    """generate's warpers (CB without ``per_request_processors``): one draw with fixed parameters."""

    def __init__(self, draw: _FusedDraw):
        self.draw_state = draw

    def __call__(self, input_ids, scores):
        return self.draw_state.draw(scores)


def _fuse_sampler(manager) -> bool:
    """Replace the trailing temperature / top-k / top-p / min-p run of the manager's processors by one fused draw.
    Returns True when it did."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from transformers.generation.continuous_batching import cb_logits_processors as cbl

    lp = manager.logit_processor
    if manager.continuous_batching_config.return_logprobs or not getattr(manager.generation_config, "do_sample",
                                                                         False):
        return False
    kinds = [("temperature", TemperatureLogitsWarper, cbl.ContinuousBatchingTemperatureLogitsWarper),
             ("top_k", TopKLogitsWarper, cbl.ContinuousBatchingTopKLogitsWarper),
             ("top_p", TopPLogitsWarper, cbl.ContinuousBatchingTopPLogitsWarper),
             ("min_p", MinPLogitsWarper, None)]
    procs = list(lp.logits_processor)
    run, rank = [], len(kinds)
    for i in range(len(procs) - 1, -1, -1):
        p = procs[i]
        hit = next(((r, k, type(p) is cb) for r, (k, classic, cb) in enumerate(kinds)
                    if type(p) is classic or (cb is not None and type(p) is cb)), None)
        if hit is None:
            break
        r, name, per_request = hit
        if r >= rank or getattr(p, "min_tokens_to_keep", 1) != 1:
            return False  # out of order, repeated, or keeping more than one token
        run.insert(0, (i, name, per_request, p))
        rank = r
    if not run or any(type(p) in {c for _, c, _ in kinds} | {c for _, _, c in kinds if c} for p in
                      procs[:run[0][0]]):
        return False
    defaults = {}
    for _, name, per_request, p in run:
        defaults[name] = {"temperature": float, "top_k": int, "top_p": float, "min_p": float}[name](getattr(p, name))
    draw = _FusedDraw(**defaults)
    kept = procs[:run[0][0]]
    flags = [per_request for _, _, per_request, _ in run]
    if flags != sorted(flags, reverse=True):
        return False  # a per-request processor after a fixed warper: the draw would come before it
    per_request_run = [(name, p) for _, name, per_request, p in run if per_request]
    for j, (name, p) in enumerate(per_request_run):
        kept.append(_per_request_slot(p, draw, name, last=j == len(run) - 1))
    if len(per_request_run) < len(run):
        kept.append(_FusedWarpers(draw))
    lp.logits_processor = LogitsProcessorList(kept)
    lp._retrieve_processors_kwargs()
    lp.do_processing = True
    return True


# --------------------------------------------------------------------------------------------------------------------
# The hook
# --------------------------------------------------------------------------------------------------------------------
def _hook_manager(manager, sampler: bool) -> None:
    if getattr(manager, _HOOKED, False):
        return
    if sampler:
        _fuse_sampler(manager)
    create = manager._create_batch_processor

    @functools.wraps(create)
    def _create_batch_processor():
        processor = create()
        _hook_cache_update(processor.cache)
        return processor

    manager._create_batch_processor = _create_batch_processor
    setattr(manager, _HOOKED, True)


def hook_continuous_batching(model, sampler: bool = True) -> bool:
    """Wrap this model's ``init_continuous_batching`` (an instance attribute) so CB sessions run on arkernels while
    the model's attention is ``NAME``; returns False when this transformers has no CB. ``unhook_continuous_batching``
    (called by the patch handle) undoes it."""
    original = getattr(model, "init_continuous_batching", None)
    if original is None:
        return False
    name = register_cb()
    managers = weakref.WeakSet()  # managers this hook built (undo stops those still running)

    @functools.wraps(original)
    def init_continuous_batching(*args, **kwargs):
        ours = model.config._attn_implementation == NAME
        if ours:
            # the config setter, not set_attn_implementation: that one looks names containing "flash" up on the Hub
            model.config._attn_implementation = name
        # CB converts generate's own warpers into its per-request processors: let it see the stock ones (the
        # generate() sampler hook would hand it a one-hot processor without per-request values)
        generate_hook = model.__dict__.pop("_get_logits_processor", None)
        try:
            manager = original(*args, **kwargs)
        except BaseException:
            if ours:
                model.config._attn_implementation = NAME
            raise
        finally:
            if generate_hook is not None:
                model.__dict__["_get_logits_processor"] = generate_hook
        if ours:
            manager._original_attn_impl = NAME  # CB's stop() restores it, as it restores its own switches
            _hook_manager(manager, sampler)
            setattr(manager, _CREATED, True)
            managers.add(manager)
        return manager

    init_continuous_batching._arkernels_managers = managers
    model.init_continuous_batching = init_continuous_batching
    return True


def unhook_continuous_batching(model) -> None:
    """Undo ``hook_continuous_batching``: stop (flush, then join) a session of this hook still running (it runs our
    functions under our name), destroy a persistent manager kept from a hooked session (it holds our processors and
    cache hook) so the next session is built by stock CB, and drop the wrapper."""
    hook = model.__dict__.pop("init_continuous_batching", None)
    for manager in list(getattr(hook, "_arkernels_managers", ())):
        if manager.is_running():
            manager.stop(block=True)  # CB's stop() puts our plain name back; the patch handle then restores its own
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None and getattr(cached, _CREATED, False):
        model.destroy_cached_continuous_batching_manager()
    if model.config._attn_implementation in (CB_FLASH_NAME, CB_PAGED_NAME):
        model.config._attn_implementation = NAME
