"""arkernels attention for transformers: one attention function and one mask function under one name.

transformers selects attention per model config (``model.set_attn_implementation(NAME)``), and builds the mask
through ``AttentionMaskInterface[NAME]``: both must be registered under the same name, or transformers passes
``attention_mask=None`` and padding and windows are lost.

What flows between them:
- the mask function never builds a ``[B, 1, Tq, Tk]`` mask for the common case. Causal order and the sliding window
  are enforced by the kernel (``window=`` from the model's ``sliding_window`` kwarg); the only thing the 2D padding
  mask adds is LEFT padding, which the mask function turns into an int32 ``[2, B, 1, 1]`` tensor (4D, so that
  transformers passes it through untouched when generate builds the masks ahead of a compiled forward; its dtype tells
  it from a 4D mask):
  row 0 = number of left-pad tokens (absolute positions: the paged cache keeps every position),
  row 1 = the same relative to the keys handed over by a dense cache (``max(pad - kv_offset, 0)``: a sliding
  DynamicCache layer drops its oldest keys). ``None`` when nothing is padded, except for the decode step of a
  compileable cache (transformers then passes ``allow_is_causal_skip=False``): zeros, so that the compiled forward
  gets a prepared mask and never builds one from the cache's lengths.
  Any other padding pattern or custom mask overlay falls back to transformers' own 4D ``sdpa_mask`` and
  ``sdpa_attention_forward``: slower, never wrong.
- the paged cache (arkernels.hf.cache) hands the attention function its pools ``[num_blocks, block_size, Hkv, D]``
  with a ``PagedStep`` attached as ``_arkernels_paged`` (block table, lengths, query layout); the attention function
  then reads the cache in place through ``window_attention``. Any other cache hands over dense ``[B, Hkv, S, D]``
  keys, which go through ``window_attention_dense`` without a copy.
"""
from __future__ import annotations

import weakref

import torch

from arkernels.ops.window_attention import window_attention, window_attention_dense

NAME = "arkernels"  # no "flash", "/", ":" or "paged|": transformers treats those names specially
PAGED_ATTR = "_arkernels_paged"
# fp8 pools carry their layer's (k_scale, v_scale) fp32 [1] tensors under this attribute (set by PagedLayer)
KV_SCALES_ATTR = "_arkernels_kv_scales"


def arkernels_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers mask function (``AttentionMaskInterface``): left padding as int32 ``[2, batch, 1, 1]``, or None.

    A model with chunked layers (``config.attention_chunk_size``) gets ``[3, batch]`` for its local masks over keys
    that start at ``kv_offset > 0``: row 2 holds ``kv_offset``, where the dense keys start (``arkernels_attention``).

    ``attention_mask`` is the 2D padding mask ``[batch, >= kv_offset + kv_length]`` (True = real token) or None.
    Falls back to ``sdpa_mask`` (a 4D bool mask) for padding that is not left padding, custom overlays (``use_vmap``)
    and keys that do not end at the last query (a static cache), which the kernels cannot express, and while
    ``torch.compile`` traces.
    """
    # keys that do not end at the last query (a StaticCache hands over all max_cache_len slots, filled or not, and
    # gives q_offset as a tensor; dynamic and paged caches give ints), custom overlays (use_vmap), and tracing under
    # torch.compile (the left-padding test below syncs with the host): the kernel's bottom-right alignment cannot
    # express these, so transformers' own 4D mask (and sdpa) serve them
    if (kwargs.get("use_vmap", False) or isinstance(q_offset, torch.Tensor)
            or q_offset + q_length != kv_offset + kv_length or torch.compiler.is_compiling()):
        return _sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                          **kwargs)
    # a chunked layer's mask (Llama 4: transformers passes local_size=attention_chunk_size; sliding layers pass their
    # window there too, so every local mask of a model with chunks gets it) whose dense keys start past position 0:
    # the attention function needs that offset to place the chunk boundaries (row 2)
    chunked_offset = (kwargs.get("local_size") is not None and kv_offset > 0
                      and getattr(kwargs.get("config"), "attention_chunk_size", None) is not None)
    # allow_is_causal_skip=False: transformers wants a mask object even when nothing is padded (the decode step of a
    # compileable cache, whose graph must not switch between None and a tensor): zeros then
    skip = kwargs.get("allow_is_causal_skip", True)
    device = kwargs.get("device")
    if attention_mask is None:
        if not chunked_offset and (skip or device is None):
            return None
        first = torch.zeros(batch_size, dtype=torch.int64, device=device)
    else:
        mask = attention_mask[:, : kv_offset + kv_length].to(torch.bool)
        length = mask.shape[-1]
        # first real token of each row; the row is left padded iff every token after it is real
        first = torch.argmax(mask.to(torch.int8), dim=-1)
        real = mask.sum(-1)
        left_padded, unpadded = torch.stack([(real == length - first).all(), (first == 0).all()]).tolist()
        if unpadded and left_padded and skip and not chunked_offset:
            return None
        if not left_padded:
            return _sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                              **kwargs)
    rows = [first, (first - kv_offset).clamp(min=0)]
    if chunked_offset:
        rows.append(torch.full_like(first, kv_offset))
    # 4-D ([rows, B, 1, 1]) so transformers passes a pre-built mask through untouched; told apart by dtype int32
    return torch.stack(rows).to(torch.int32).view(len(rows), -1, 1, 1)


def _sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs):
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs.pop("allow_is_causal_skip", None)
    if q_offset:
        kwargs["q_offset"] = q_offset
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, kv_offset=kv_offset,
                     mask_function=mask_function or causal_mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, **kwargs)


def arkernels_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                        sliding_window: int | None = None, softcap: float | None = None,
                        s_aux: torch.Tensor | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention function (``AttentionInterface``).

    Args:
        query: ``[B, Hq, Tq, D]``.
        key, value: a paged cache's pools ``[num_blocks, block_size, Hkv, D]`` carrying a ``PagedStep``, or dense
            ``[B, Hkv, S, D]`` (the query is then the last Tq of the S positions).
        attention_mask: what ``arkernels_mask`` returned: None, int32 ``[2, B, 1, 1]`` left padding (``[3, B, 1, 1]``
            for chunked layers: row 2 is the dense keys' first position), or a 4D mask (bool / float: transformers'
            own, served by sdpa or the model's eager attention).
        scaling: softmax scale (Gemma: ``query_pre_attn_scalar ** -0.5``); sliding_window: W keys including the
            current one, None/0 = full; softcap: logit soft-capping, None/0 = off.
        s_aux: gpt-oss attention sinks ``[Hq]``: one logit per query head in the softmax denominator, no value.
        is_causal: None / True; False (bidirectional) refuses.
        kwargs: every other keyword transformers passes; each must be harmless or None (``capability.HARMLESS``),
            anything else refuses naming the layer and the keyword (nothing is silently dropped).

    Chunked layers (``config.layer_types[layer_idx] == "chunked_attention"``, Llama 4) attend within chunks of
    ``config.attention_chunk_size`` positions counted from the first real token.

    Returns:
        ``(out [B, Tq, Hq, D], None)``.
    """
    step = getattr(key, PAGED_ATTR, None)
    problem = ("dropout in training mode" if dropout and module.training
               else _kwargs_problem(module, is_causal=is_causal, **kwargs))
    if problem is not None:
        original = None if step is not None or _compact(attention_mask) else _original_function(module)
        if original is None:
            _refuse(module, problem)
        # a layer called on its own, over dense keys and its caller's mask (the model's forward and generate route
        # such calls to the original implementation before they reach here): that implementation serves it
        extra = {k: v for k, v in dict(sliding_window=sliding_window, softcap=softcap, s_aux=s_aux,
                                       is_causal=is_causal).items() if v is not None}
        return original(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **extra,
                        **kwargs)
    window = int(sliding_window or 0)
    cap = float(softcap or 0.0)
    chunk = _chunk_size(module)
    sinks = None if s_aux is None else s_aux.to(torch.float32)
    compact = attention_mask is not None and attention_mask.dtype == torch.int32
    if chunk and step is None and compact and len(attention_mask) == 3:
        # a chunked layer over dense keys that start at position kv_offset: the dense kernel counts chunks from the
        # first visible key, which is a chunk start only when kv_offset <= the left padding
        pad, offset = attention_mask[0].view(-1), attention_mask[2].view(-1)
        if bool((offset > pad).any()):
            attention_mask = _chunked_dense_mask(pad, offset, query.shape[2], key.shape[2], chunk)
    if attention_mask is not None and attention_mask.dtype != torch.int32:
        if step is not None:
            key, value = step.dense()
        return _masked_fallback(module, query, key, value, attention_mask, scaling, softcap, s_aux, **kwargs)
    B, Hq, Tq, D = query.shape
    extra = dict(sinks=sinks) if sinks is not None else {}
    if chunk:
        extra["chunk_size"] = chunk
    if step is None:
        out = window_attention_dense(query.transpose(1, 2), key, value,
                                     kv_start=None if attention_mask is None else attention_mask[1].view(-1),
                                     window=window, scale=scaling, softcap=cap, **extra)
        return out, None
    q = query.transpose(1, 2).reshape(B * Tq, Hq, D)
    kv_start = step.kv_start if attention_mask is None else attention_mask[0].view(-1)
    k_scale, v_scale = getattr(key, KV_SCALES_ATTR, (None, None))  # fp8 pools only
    out = window_attention(q, key, value, step.block_table, step.seq_lens, window=window, scale=scaling,
                           softcap=cap, cu_seqlens_q=step.cu_seqlens_q, max_q_len=step.max_q_len,
                           kv_start=kv_start, k_scale=k_scale, v_scale=v_scale,
                           check=False, **extra)  # our cache built the indices: no host-sync validation
    return out.view(B, Tq, Hq, D), None


def _compact(mask) -> bool:
    return mask is not None and mask.dtype == torch.int32  # arkernels_mask's: only our kernels read it


# id(config) -> (a weak reference to it, its implementation before arkernels.patch): what a layer called on its own
# falls back to; kept off the config object itself (save_pretrained writes a config's attributes)
_originals: dict[int, tuple[weakref.ref, str | None]] = {}


def remember_original(config, name: str | None) -> None:
    """Record the attention implementation ``config`` had before the patch selected ours (stock_call.AttentionSwap)."""
    _originals[id(config)] = (weakref.ref(config), name)


def _original_function(module):
    """The attention function of ``module``'s implementation before ``arkernels.patch`` (its modeling file's eager
    attention for "eager"), or None when unknown."""
    import sys

    config = getattr(module, "config", None)
    entry = _originals.get(id(config))
    if entry is None or entry[0]() is not config or entry[1] == NAME:
        return None
    name = entry[1]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if name in (None, "eager"):
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def _refuse(module, problem: str) -> None:
    from arkernels.hf.capability import describe_module

    hint = (" (a vision or audio tower under the patch: run such inputs on the unpatched model)"
            if problem.startswith("is_causal=False") else "")
    raise NotImplementedError(
        f"arkernels attention: {describe_module(module)} passes {problem}, which arkernels attention does not "
        f"implement{hint}; keep this model on transformers' attention (undo the patch)")


def _kwargs_problem(module, **kwargs) -> str | None:
    """The first keyword whose value arkernels does not implement, described, or None (every call of every layer:
    the common keywords cost nothing)."""
    from arkernels.hf.capability import ALWAYS_HARMLESS, attention_kwarg_problem

    if getattr(module, "is_causal", True) is False:
        kwargs["is_causal"] = False  # the module's own flag: sdpa would honour it, so it counts the same way
    for name, value in kwargs.items():
        if value is None or name in ALWAYS_HARMLESS:
            continue
        problem = attention_kwarg_problem(name, value)
        if problem is not None:
            return problem
    return None


_chunk_sizes: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[object, int]]" = weakref.WeakKeyDictionary()


def _chunk_size(module) -> int:
    """``attention_chunk_size`` for a chunked layer (Llama 4), else 0. Kept per module while its config object is the
    same (read every call of every layer: transformers' config attribute lookups cost ~40 us a step per layer)."""
    config = getattr(module, "config", None)
    if torch.compiler.is_compiling():  # traced once per graph: no memo (dynamo would guard on its contents)
        return _read_chunk_size(module, config)
    known = _chunk_sizes.get(module)
    if known is not None and known[0] is config:
        return known[1]
    size = _read_chunk_size(module, config)
    _chunk_sizes[module] = (config, size)
    return size


def _read_chunk_size(module, config) -> int:
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is None or idx is None or idx >= len(types) or types[idx] != "chunked_attention":
        return 0
    return int(config.attention_chunk_size)


def _chunked_dense_mask(pad: torch.Tensor, offset: torch.Tensor, q_len: int, kv_len: int, chunk: int) -> torch.Tensor:
    """4D bool ``[B, 1, q_len, kv_len]`` mask of a chunked layer over dense keys at positions ``offset ..``:
    transformers' ``chunked_overlay`` (chunks of ``chunk`` positions counted from the left padding ``pad``)."""
    j = offset[:, None, None] + torch.arange(kv_len, device=pad.device)  # [B, 1, kv_len]
    i = offset[:, None, None] + kv_len - q_len + torch.arange(q_len, device=pad.device)[:, None]  # [B, q_len, 1]
    p = pad[:, None, None]
    visible = (j <= i) & (j >= p) & (torch.div(j - p, chunk, rounding_mode="floor")
                                     == torch.div(i - p, chunk, rounding_mode="floor"))
    return visible[:, None]


def _masked_fallback(module, query, key, value, mask, scaling, softcap, s_aux, **kwargs):
    """A 4D mask the kernels cannot express: transformers' sdpa, or, when the layer's math is more than sdpa does
    (sinks, soft-capping), the model's own eager attention (it implements exactly that model's math)."""
    if s_aux is None and not softcap:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=0.0, **kwargs)
    import sys

    from arkernels.hf.capability import describe_module

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"arkernels attention: {describe_module(module)} needs a mask "
            "the kernels cannot express (not left padding) together with sinks / softcap, and its model has no eager "
            "attention to fall back to")
    additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~mask, torch.finfo(query.dtype).min)
    extra = {"s_aux": s_aux} if s_aux is not None else {}
    if softcap:
        extra["softcap"] = softcap
    return eager(module, query, key, value, additive, scaling=scaling, dropout=0.0, **extra)


_registered = False


def register() -> str:
    """Register the attention and mask functions under ``NAME`` (idempotent); returns ``NAME``."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, arkernels_attention)
        AttentionMaskInterface.register(NAME, arkernels_mask)
        _registered = True
    return NAME
