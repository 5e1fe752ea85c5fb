"""arkernels attention for transformers: one attention function and one mask function under one name.

transformers selects attention per model config (``model.set_attn_implementation(NAME)``), and builds the mask
through ``AttentionMaskInterface[NAME]``: both must be registered under the same name, or transformers passes
``attention_mask=None`` and padding and windows are lost (KNOWLEDGE.md).

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

import torch

from arkernels.ops.window_attention import window_attention, window_attention_dense

NAME = "arkernels"  # no "flash", "/", ":" or "paged|": transformers treats those names specially
PAGED_ATTR = "_arkernels_paged"
# fp8 pools carry their layer's (k_scale, v_scale) fp32 [1] tensors under this attribute (set by PagedLayer)
KV_SCALES_ATTR = "_arkernels_kv_scales"


def arkernels_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers mask function (``AttentionMaskInterface``): left padding as int32 ``[2, batch, 1, 1]``, or None.

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
    skip = kwargs.get("allow_is_causal_skip", True)
    if attention_mask is None:
        device = kwargs.get("device")
        if skip or device is None:
            return None
        return torch.zeros((2, batch_size, 1, 1), dtype=torch.int32, device=device)
    mask = attention_mask[:, : kv_offset + kv_length].to(torch.bool)
    length = mask.shape[-1]
    # first real token of each row; the row is left padded iff every token after it is real
    first = torch.argmax(mask.to(torch.int8), dim=-1)
    real = mask.sum(-1)
    left_padded, unpadded = torch.stack([(real == length - first).all(), (first == 0).all()]).tolist()
    if unpadded and left_padded and skip:
        return None
    if not left_padded:
        return _sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                          **kwargs)
    return torch.stack([first, (first - kv_offset).clamp(min=0)]).to(torch.int32).view(2, -1, 1, 1)


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
                        sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers attention function (``AttentionInterface``).

    Args:
        query: ``[B, Hq, Tq, D]``.
        key, value: a paged cache's pools ``[num_blocks, block_size, Hkv, D]`` carrying a ``PagedStep``, or dense
            ``[B, Hkv, S, D]`` (the query is then the last Tq of the S positions).
        attention_mask: what ``arkernels_mask`` returned: None, int32 ``[2, B, 1, 1]`` left padding, or a 4D mask
            (bool / float: transformers' own, served by sdpa).
        scaling: softmax scale (Gemma: ``query_pre_attn_scalar ** -0.5``); sliding_window: W keys including the
            current one, None/0 = full; softcap: logit soft-capping, None/0 = off.

    Returns:
        ``(out [B, Tq, Hq, D], None)``.
    """
    if dropout and module.training:
        raise NotImplementedError("arkernels attention: dropout (training) is not supported; use sdpa for training")
    step = getattr(key, PAGED_ATTR, None)
    window = int(sliding_window or 0)
    cap = float(softcap or 0.0)
    if attention_mask is not None and attention_mask.dtype != torch.int32:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if step is not None:
            key, value = step.dense()
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=0.0,
                                      softcap=softcap, **kwargs)
    B, Hq, Tq, D = query.shape
    if step is None:
        out = window_attention_dense(query.transpose(1, 2), key, value,
                                     kv_start=None if attention_mask is None else attention_mask[1].view(-1),
                                     window=window, scale=scaling, softcap=cap)
        return out, None
    q = query.transpose(1, 2).reshape(B * Tq, Hq, D)
    kv_start = step.kv_start if attention_mask is None else attention_mask[0].view(-1)
    k_scale, v_scale = getattr(key, KV_SCALES_ATTR, (None, None))  # fp8 pools only
    out = window_attention(q, key, value, step.block_table, step.seq_lens, window=window, scale=scaling,
                           softcap=cap, cu_seqlens_q=step.cu_seqlens_q, max_q_len=step.max_q_len,
                           kv_start=kv_start, k_scale=k_scale, v_scale=v_scale,
                           check=False)  # our cache built the indices: no host-sync validation
    return out.view(B, Tq, Hq, D), None


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
