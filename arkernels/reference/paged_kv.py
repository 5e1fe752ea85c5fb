"""Naive paged KV cache reference: Python loops over tokens, obviously correct, slow on purpose."""
from __future__ import annotations

import torch


def quantize_e4m3_ref(x, scale):
    """vLLM's fp8 KV quantization: ``x / scale`` in fp32, clamped to +-448 (NaN kept), rounded to e4m3."""
    return (x.float() / float(scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def dequantize_e4m3_ref(stored, scale):
    """``stored * scale`` in fp64 (exact: a 4-bit mantissa times a 24-bit one)."""
    return stored.to(torch.float64) * float(scale)


def paged_kv_append_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Same contract as ``arkernels.paged_kv_append``: writes token t to slot ``slot_mapping[t]`` (skipping
    negative slots and slots past the cache); fp8 caches store ``quantize_e4m3_ref(key[t], k_scale)``."""
    num_blocks, block_size = k_cache.shape[:2]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 or slot >= num_blocks * block_size:
            continue
        k_cache[slot // block_size, slot % block_size] = quantize_e4m3_ref(key[t], k_scale) if fp8 else key[t]
        v_cache[slot // block_size, slot % block_size] = quantize_e4m3_ref(value[t], v_scale) if fp8 else value[t]


def paged_kv_gather_ref(k_cache, v_cache, block_table, seq_lens, max_seq_len=None):
    """Same contract as ``arkernels.paged_kv_gather``: ``[batch, heads, max_seq_len, head_dim]`` each."""
    lens = seq_lens.tolist()
    max_seq_len = max(lens, default=0) if max_seq_len is None else max_seq_len
    batch, block_size = len(lens), k_cache.shape[1]
    shape = (batch, k_cache.shape[2], max_seq_len, k_cache.shape[3])
    k_out = torch.zeros(shape, dtype=k_cache.dtype, device=k_cache.device)
    v_out = torch.zeros(shape, dtype=v_cache.dtype, device=v_cache.device)
    for b in range(batch):
        for t in range(lens[b]):
            blk = int(block_table[b, t // block_size])
            k_out[b, :, t] = k_cache[blk, t % block_size]
            v_out[b, :, t] = v_cache[blk, t % block_size]
    return k_out, v_out
