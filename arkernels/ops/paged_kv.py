"""Paged KV cache ops: append new K/V rows, gather sequences back out.

Cache layout (vLLM "flash" / FlashInfer NHD): ``k_cache``, ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s = block * block_size + offset``.

fp8 caches (vLLM's convention): ``torch.float8_e4m3fn`` caches with a per-layer ``k_scale`` / ``v_scale`` (fp32
one-element tensors on the cache's device): ``stored = saturate_e4m3(x / k_scale)`` (round to nearest even, clamped
to +-448, NaN kept) and ``value = stored * k_scale``. Scales are required iff the cache is fp8, and refused otherwise.
"""
from __future__ import annotations

import torch

from arkernels import _library  # noqa: F401  (loads the op library)
from arkernels.ops._checks import check_scales, eager_checks, expect

_ops = torch.ops.arkernels


def paged_kv_append(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
) -> None:
    """Write ``key``/``value`` rows into the paged caches, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``; may be strided views (last dim contiguous),
            e.g. slices of a fused qkv projection.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype as ``key``
            (float32, float16 or bfloat16), or ``float8_e4m3fn`` (``key`` then fp32/fp16/bf16, quantized on write:
            ``saturate_e4m3(key / k_scale)``).
        slot_mapping: int32 or int64 ``[n]``, ``n <= num_tokens``: token ``t < n`` goes to slot
            ``slot_mapping[t]``; tokens past ``n`` are ignored (CUDA-graph padding). A negative slot is
            padding and is skipped. A slot at or past ``num_blocks * block_size`` is never written.
        k_scale, v_scale: fp32 ``[1]`` on the cache's device (read there: no host sync); required iff the caches
            are ``float8_e4m3fn``, an error otherwise.
        check: validate the slots (and fp8 scales: positive, finite) first (a host sync) and raise ``ValueError``
            naming the first slot past the cache. ``False`` skips that for hot paths whose slots come from our own
            allocator; the kernels then still write nothing outside the cache, whatever the slots. Skipped while
            ``torch.compile`` traces (``_checks.eager_checks``): compiled code never syncs.
    """
    if eager_checks(check) and slot_mapping.numel() > 0 and slot_mapping.dtype in (torch.int32, torch.int64):
        num_slots = k_cache.shape[0] * k_cache.shape[1] if k_cache.dim() == 4 else 0
        bad = (slot_mapping >= num_slots).nonzero()
        if bad.numel() > 0:
            i = int(bad[0, 0])
            raise ValueError(
                f"paged_kv_append: slot_mapping[{i}] = {int(slot_mapping[i])} is outside the cache "
                f"({num_slots} slots = num_blocks * block_size)"
            )
    if eager_checks(check):
        check_scales("paged_kv_append", k_scale=k_scale, v_scale=v_scale)
    _ops.paged_kv_append(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_kv_gather(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's keys and values out of the paged caches.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: int32 ``[batch, max_blocks_per_seq]``; entry ``[b, i]`` is the cache block holding
            positions ``i * block_size ...`` of sequence ``b``. Entries past a sequence's length are ignored
            (they may be -1); an entry within it that is out of range is an error (``check=True``) and is
            never read.
        seq_lens: int32 ``[batch]``; negative lengths gather nothing (zeros).
        max_seq_len: the output length; default ``max(seq_lens)`` (one host sync). Give it to stay sync-free.
            A sequence longer than ``max_seq_len`` is refused with ``check=True``; with ``check=False`` only its
            first ``max_seq_len`` positions are gathered (the output has no room for more).
        k_scale, v_scale: fp8 caches: fp32 ``[1]``; given, the gathered rows are dequantized
            (``stored.float() * k_scale``, then cast to ``out_dtype``). None: the op moves the fp8 bytes as they are.
            Refused for caches of another dtype.
        out_dtype: the dequantized output's dtype (default float32); only with ``k_scale``/``v_scale``.
        check: validate the lengths (``0 <= seq_lens[b] <= max_seq_len``) and the block-table entries within each
            length (one host sync); skipped while ``torch.compile`` traces (``_checks.eager_checks``). Whatever the
            lengths and entries, the kernels read only inside the caches and the table.

    Returns:
        ``(key, value)``, each ``[batch, num_kv_heads, max_seq_len, head_dim]`` (transformers' layout),
        zero beyond each sequence's length.
    """
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    expect((k_scale is None) == (v_scale is None), "paged_kv_gather", "give k_scale and v_scale together")
    expect(k_scale is None or fp8, "paged_kv_gather",
           f"k_scale is only taken with float8_e4m3fn caches, but k_cache is {k_cache.dtype}")
    expect(out_dtype is None or k_scale is not None, "paged_kv_gather",
           "out_dtype is only taken with k_scale/v_scale (fp8 caches dequantized)")
    shapes_ok = block_table.dim() == 2 and seq_lens.dim() == 1 and k_cache.dim() == 4
    if max_seq_len is None:
        max_seq_len = max(int(seq_lens.max()), 0) if seq_lens.numel() > 0 else 0
        # not while torch.compile traces: the length is then a data-dependent size (the kernel still bounds it)
        addressable = block_table.shape[1] * k_cache.shape[1] if shapes_ok else None
        if addressable is not None and not torch.compiler.is_compiling() and max_seq_len > addressable:
            # the op would refuse the length it was given as "max_seq_len", which this caller never passed
            b = int(seq_lens.argmax())
            raise ValueError(f"paged_kv_gather: seq_lens[{b}] = {max_seq_len} exceeds what block_table can address "
                             f"({block_table.shape[1]} blocks of {k_cache.shape[1]})")
    if eager_checks(check) and seq_lens.dim() == 1 and seq_lens.numel() > 0:
        bad = ((seq_lens < 0) | (seq_lens > max_seq_len)).nonzero()
        if bad.numel() > 0:
            b = int(bad[0, 0])
            n = int(seq_lens[b])
            raise ValueError(f"paged_kv_gather: seq_lens[{b}] = {n} is negative" if n < 0 else
                             f"paged_kv_gather: seq_lens[{b}] = {n} exceeds max_seq_len = {max_seq_len} (the output "
                             f"would hold only its first {max_seq_len} positions)")
    if eager_checks(check) and shapes_ok and block_table.numel() > 0:
        bs = k_cache.shape[1]
        used = torch.arange(block_table.shape[1], device=block_table.device) * bs < seq_lens.to(
            block_table.device)[:, None].long()
        bad = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"paged_kv_gather: block_table[{b}, {i}] = {int(block_table[b, i])} is out of range "
                f"[0, {k_cache.shape[0]}) within sequence {b}'s length {int(seq_lens[b])}"
            )
    if eager_checks(check):
        check_scales("paged_kv_gather", k_scale=k_scale, v_scale=v_scale)
    k, v = _ops.paged_kv_gather(k_cache, v_cache, block_table, seq_lens, max_seq_len)
    if k_scale is None:
        return k, v
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        expect(sc.numel() == 1 and sc.dtype == torch.float32 and sc.device == k_cache.device, "paged_kv_gather",
               f"{name} must be a one-element float32 tensor on the cache's device ({k_cache.device}) when k_cache is "
               f"float8_e4m3fn, got {sc.dtype} {tuple(sc.shape)} on {sc.device}")
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    return ((k.float() * k_scale.reshape(())).to(out_dtype), (v.float() * v_scale.reshape(())).to(out_dtype))


@torch.library.register_fake("arkernels::paged_kv_append")
def _(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


@torch.library.register_fake("arkernels::paged_kv_gather")
def _(k_cache, v_cache, block_table, seq_lens, max_seq_len):
    shape = (block_table.shape[0], k_cache.shape[2], max_seq_len, k_cache.shape[3])
    return k_cache.new_empty(shape), v_cache.new_empty(shape)
