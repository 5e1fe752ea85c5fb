"""Naive windowed attention reference: gathers each sequence's keys with Python loops, builds the mask
explicitly, computes in fp64 with einsum. Slow and obviously correct on purpose; shares no code with the kernels."""
from __future__ import annotations

import math

import torch


def window_mask_ref(q_pos: torch.Tensor, seq_len: int, window: int, kv_start: int = 0,
                    chunk_size: int = 0) -> torch.Tensor:
    """bool ``[len(q_pos), seq_len]``: key j visible to the query at position i iff
    ``kv_start <= j <= i`` and (``window == 0`` or ``j > i - window``) and (``chunk_size == 0`` or
    ``(j - pad) // chunk_size == (i - pad) // chunk_size``, ``pad = max(kv_start, 0)``: transformers'
    ``chunked_overlay`` with its left-padding count)."""
    j = torch.arange(seq_len)[None, :]
    i = q_pos[:, None]
    mask = (j <= i) & (j >= kv_start)
    if window > 0:
        mask &= j > i - window
    if chunk_size > 0:
        pad = max(kv_start, 0)
        mask &= torch.div(j - pad, chunk_size, rounding_mode="floor") == torch.div(i - pad, chunk_size,
                                                                                   rounding_mode="floor")
    return mask


def _softmax_with_sinks(s: torch.Tensor, sinks) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 scores ``[H, Q, K]`` (-inf where masked) -> (probabilities over the keys, lse ``[H, Q]``). With ``sinks``
    (``[H]``) a sink column joins the softmax and is dropped from the probabilities, as transformers' gpt_oss eager
    attention does (``torch.cat([scores, sinks])``, softmax, ``[..., :-1]``)."""
    if sinks is not None:
        col = torch.as_tensor(sinks).detach().cpu().double().reshape(-1, 1, 1).expand(s.shape[0], s.shape[1], 1)
        s = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible (and no sink)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)  # rows with nothing: exp(-inf - -inf)
    return (p[..., :-1] if sinks is not None else p), lse


def window_attention_ref(query, k_cache, v_cache, block_table, seq_lens, *, window=0, scale=None, softcap=0.0,
                         cu_seqlens_q=None, kv_start=None, k_scale=None, v_scale=None, sinks=None, chunk_size=0):
    """Same contract as ``arkernels.window_attention``; returns ``(out fp64 like query, lse fp64 [rows, Hq])``.

    A query with no visible key gets out 0 and lse -inf (``sinks[h]`` with sinks). fp8 caches are dequantized first
    (``stored * k_scale``, in fp64: exact). The lse includes the sink term.
    """
    query = query.detach().cpu().double()
    if k_cache.dtype == torch.float8_e4m3fn:
        k_cache = k_cache.detach().cpu().double() * float(k_scale)
        v_cache = v_cache.detach().cpu().double() * float(v_scale)
    k_cache, v_cache = k_cache.detach().cpu().double(), v_cache.detach().cpu().double()
    lens = [int(x) for x in seq_lens.tolist()]
    batch = len(lens)
    hq, d = query.shape[1], query.shape[2]
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    if cu_seqlens_q is None:
        cu = list(range(batch + 1))
    else:
        cu = [int(x) for x in cu_seqlens_q.tolist()]
    starts = [0] * batch if kv_start is None else [int(x) for x in kv_start.tolist()]
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full((query.shape[0], hq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        n, q_len = lens[b], cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        key = torch.zeros(n, hkv, d, dtype=torch.float64)
        val = torch.zeros(n, hkv, d, dtype=torch.float64)
        cap = block_table.shape[1] * block_size  # keys past what the table addresses are masked (check=False)
        for t in range(min(n, cap)):
            blk = int(block_table[b, t // block_size])
            key[t] = k_cache[blk, t % block_size]
            val[t] = v_cache[blk, t % block_size]
        key = key.repeat_interleave(group, dim=1)  # [n, hq, d]
        val = val.repeat_interleave(group, dim=1)
        q = query[cu[b]:cu[b + 1]]  # [q_len, hq, d]
        q_pos = torch.arange(n - q_len, n)
        mask = window_mask_ref(q_pos, n, window, starts[b], chunk_size) & (torch.arange(n) < cap)  # [q_len, n]
        s = torch.einsum("qhd,khd->hqk", q, key) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask[None], -math.inf)
        p, row_lse = _softmax_with_sinks(s, sinks)
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", p, val)
        lse[cu[b]:cu[b + 1]] = row_lse.transpose(0, 1)
    return out, lse


def window_attention_dense_ref(query, key, value, *, seq_lens=None, kv_start=None, window=0, scale=None,
                               softcap=0.0, sinks=None, chunk_size=0):
    """Same contract as ``arkernels.window_attention_dense``: query ``[B, Tq, Hq, D]``, key/value
    ``[B, Hkv, S, D]``; returns ``(out fp64 [B, Tq, Hq, D], lse fp64 [B, Tq, Hq])``."""
    bsz, tq, hq, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    lens = [s] * bsz if seq_lens is None else [int(x) for x in seq_lens.tolist()]
    starts = [0] * bsz if kv_start is None else [int(x) for x in kv_start.tolist()]
    scale = d ** -0.5 if scale is None else scale
    q = query.detach().cpu().double()
    k = key.detach().cpu().double().repeat_interleave(hq // hkv, dim=1)
    v = value.detach().cpu().double().repeat_interleave(hq // hkv, dim=1)
    out = torch.zeros(bsz, tq, hq, d, dtype=torch.float64)
    lse = torch.full((bsz, tq, hq), -math.inf, dtype=torch.float64)
    for b in range(bsz):
        n = lens[b]
        mask = window_mask_ref(torch.arange(n - tq, n), n, window, starts[b], chunk_size)
        sc = torch.einsum("qhd,hkd->hqk", q[b], k[b, :, :n]) * scale
        if softcap > 0:
            sc = softcap * torch.tanh(sc / softcap)
        sc = sc.masked_fill(~mask[None], -math.inf)
        p, row_lse = _softmax_with_sinks(sc, sinks)
        out[b] = torch.einsum("hqk,hkd->qhd", p, v[b, :, :n])
        lse[b] = row_lse.transpose(0, 1)
    return out, lse
