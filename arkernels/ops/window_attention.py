"""Causal (sliding-window, chunked) attention over the paged KV cache, with GQA/MQA, softcap, left padding and
attention sinks.

Visibility of key ``j`` to the query at absolute position ``i`` of sequence ``b``, with ``s = max(kv_start[b], 0)``:
``s <= j <= i`` and (``window == 0`` or ``i - window < j``): W keys including the current one, the convention of
transformers, vLLM and FlashAttention; and (``chunk_size == 0`` or ``(j - s) // C == (i - s) // C``): Llama 4's
chunked attention, chunks of C positions counted from the first real token (transformers' chunked mask with left
padding). Sequence ``b``'s queries are its last ``q_len_b`` positions (bottom-right aligned), so chunked prefill on top
of an existing cache works.

Attention sinks (gpt-oss ``s_aux``): one logit ``sinks[h]`` per query head joins the softmax denominator of every
query of head h and carries no value; it is neither scaled by ``scale`` nor softcapped (transformers' gpt_oss eager
attention appends it to the scaled, masked scores):
``out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h]))``.
"""
from __future__ import annotations

import torch

from arkernels import _library  # noqa: F401  (loads the op library)
from arkernels.ops._checks import check_scales, eager_checks, expect

_ops = torch.ops.arkernels
_OP = "window_attention"


def _check_data(query, k_cache, block_table, seq_lens, cu_seqlens_q, max_q_len, kv_start, k_scale, v_scale) -> None:
    """Validate the index tensors' values (one host sync): what the CUDA kernel can only mask, never report."""
    check_scales(_OP, k_scale=k_scale, v_scale=v_scale)
    if (block_table.dim() != 2 or seq_lens.dim() != 1 or k_cache.dim() != 4 or seq_lens.dtype != torch.int32
            or block_table.shape[0] != seq_lens.shape[0]):
        return  # the op's own shape/dtype checks word these
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    lens = seq_lens.long()
    cap = block_table.shape[1] * block_size
    bad = ((lens < 0) | (lens > cap)).nonzero()
    if bad.numel() > 0:
        b = int(bad[0, 0])
        raise ValueError(f"{_OP}: seq_lens[{b}] = {int(lens[b])} is outside [0, {cap}] "
                         f"(block_table width {block_table.shape[1]} x block_size {block_size})")
    if block_table.numel() > 0 and block_table.dtype == torch.int32:
        used = torch.arange(block_table.shape[1], device=block_table.device) * block_size < lens.to(
            block_table.device)[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{_OP}: block_table[{b}, {i}] = {int(block_table[b, i])} is out of range "
                             f"[0, {num_blocks}) within sequence {b}'s length {int(lens[b])}")
    if cu_seqlens_q is not None and cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] == lens.shape[0] + 1:
        cu = cu_seqlens_q.long().cpu()
        expect(int(cu[0]) == 0 and int(cu[-1]) == query.shape[0], _OP,
               f"cu_seqlens_q must run from 0 to num_queries = {query.shape[0]}, got {int(cu[0])} .. {int(cu[-1])}")
        q_lens = cu[1:] - cu[:-1]
        bad = (q_lens < 0).nonzero()
        expect(bad.numel() == 0, _OP, "cu_seqlens_q must be non-decreasing")
        bad = (q_lens > lens.cpu()).nonzero()
        if bad.numel() > 0:
            b = int(bad[0, 0])
            raise ValueError(f"{_OP}: cu_seqlens_q gives sequence {b} {int(q_lens[b])} queries but seq_lens[{b}] = "
                             f"{int(lens[b])} (queries are the last q_len positions of a sequence)")
        if max_q_len is not None and q_lens.numel() > 0:
            expect(int(q_lens.max()) <= max_q_len, _OP,
                   f"max_q_len = {max_q_len} is smaller than the largest query count {int(q_lens.max())}")
    if kv_start is not None and kv_start.dim() == 1 and kv_start.shape[0] == lens.shape[0]:
        starts = kv_start.long().to(lens.device)
        bad = ((starts < 0) | (starts > lens)).nonzero()
        if bad.numel() > 0:
            b = int(bad[0, 0])
            raise ValueError(f"{_OP}: kv_start[{b}] = {int(starts[b])} is outside [0, seq_lens[{b}] = {int(lens[b])}] "
                             f"(the number of left-padding positions of sequence {b})")


def _sinks_arg(sinks: torch.Tensor | None, op: str, check: bool) -> torch.Tensor | None:
    """``sinks`` as the op takes it: fp32 (fp16/bf16 upcast), detached (the op has no backward). With ``check``
    (eager), NaN and +inf are refused (one host sync): they would make every output of that head NaN."""
    if sinks is None:
        return None
    if sinks.dtype in (torch.float16, torch.bfloat16):
        sinks = sinks.float()
    sinks = sinks.detach()
    if eager_checks(check) and sinks.dtype == torch.float32 and sinks.numel() > 0:
        bad = (torch.isnan(sinks) | torch.isposinf(sinks)).nonzero()
        if bad.numel() > 0:
            h = int(bad.flatten()[0])
            raise ValueError(f"{op}: sinks[{h}] = {float(sinks.flatten()[h])} must be finite or -inf "
                             f"(-inf: no sink for that head)")
    return sinks


def window_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    cu_seqlens_q: torch.Tensor | None = None,
    max_q_len: int | None = None,
    kv_start: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    return_lse: bool = False,
    check: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of new queries over a paged KV cache, optionally within a sliding window or a chunk, with
    optional attention sinks.

    Args:
        query: decode: ``[batch, num_q_heads, head_dim]``, one query per sequence at position ``seq_lens[b] - 1``;
            prefill / multi-query (``cu_seqlens_q`` given): ``[total_q, num_q_heads, head_dim]``, sequence b's
            queries are rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` and sit at its last ``q_len_b`` positions
            (causal among themselves). Any strides with a contiguous last dim.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides, last dim
            contiguous), same dtype as ``query``: fp16/bf16 on CUDA (head_dim 64, 80, 96, 128, 256), also fp32
            on the CPU (any head_dim up to 512). ``num_q_heads % num_kv_heads == 0`` (GQA/MQA). Or
            ``float8_e4m3fn`` with ``k_scale``/``v_scale`` (vLLM's convention: key = stored * k_scale), any query
            dtype above (fp16/bf16 on CUDA: both kernels stage the fp8 tiles as stored and convert them in the MMA
            operand registers, no 16-bit copy of the cache).
        block_table: int32 ``[batch, max_blocks]``: entry ``[b, i]`` holds positions ``i*block_size ...``.
        seq_lens: int32 ``[batch]``: keys ``0 .. seq_lens[b]-1`` exist, the new tokens included.
        window: 0 for full causal attention; ``W > 0``: key j is visible to query i iff ``i - W < j <= i``.
        scale: score scale, default ``head_dim ** -0.5``.
        softcap: ``> 0`` applies ``softcap * tanh(score / softcap)`` after scaling (Gemma 2); 0 is off.
        cu_seqlens_q: int32 ``[batch + 1]`` cumulative query counts (prefill); None for decode.
        max_q_len: at least the largest ``q_len_b`` (sizes the CUDA grid without a host sync, and picks the kernel:
            1-8 query rows per sequence with ``max_q_len * group <= 64`` and head_dim <= 128 run the split-KV decode
            kernel with the rows folded into its MMA rows, speculative verification's shape; longer ones, prefill);
            default computed from ``cu_seqlens_q`` (one sync); ignored for decode. Too small: ``check`` and the CPU kernel
            raise; with ``check=False`` the CUDA kernel still computes every row (extra passes over the grid).
            At most ``num_queries`` (refused above: no sequence has more queries than there are rows).
        kv_start: int32 ``[batch]``: keys ``j < kv_start[b]`` are masked (left padding); None: 0.
            ``0 <= kv_start[b] <= seq_lens[b]`` (``check`` refuses others; unchecked, a negative one counts as 0
            and a larger one masks every key).
        k_scale, v_scale: fp32 ``[1]`` on the cache's device; required iff the caches are ``float8_e4m3fn``,
            an error otherwise; positive and finite (``check``).
        sinks: ``[num_q_heads]`` on the query's device, fp32 (fp16/bf16 are upcast; not differentiated): attention
            sink logits in natural-log units, used as given (not multiplied by ``scale``, not softcapped), one more
            term ``exp(sinks[h])`` in the softmax denominator of every query of head h. ``-inf``: no sink for that
            head; NaN and +inf are refused (``check``). None: no sinks.
        chunk_size: 0 for no chunks; ``C > 0``: key j is visible to query i only if both lie in the same chunk of C
            positions counted from ``max(kv_start[b], 0)`` (Llama 4 ``attention_chunk_size``). Combines with
            ``window`` (both bounds hold).
        return_lse: also return the fp32 natural-log sum-exp of the scaled (capped) scores; with ``sinks`` the sink
            term is included, ``lse = log(sum_j exp(s_j) + exp(sinks[h]))`` (FlashInfer's convention: ``out`` is the
            sink-normalised output, so a state merged from two calls would count the sink twice; merge lse from
            calls without sinks and add the sink once).
        check: validate the index tensors' values first (one host sync) and raise ``ValueError`` on a block id
            out of range, a length past the block table, or ``cu_seqlens_q`` inconsistent with ``seq_lens``.
            ``False`` for hot paths and CUDA graphs; every kernel then masks such keys, never reading outside
            the cache: keys under an out-of-range block id (CUDA; the CPU kernel raises), and keys at positions
            ``>= max_blocks * block_size`` when ``seq_lens[b]`` exceeds what the table addresses (all kernels).
            Queries keep the positions ``seq_lens`` gives them, so such a query may see no key (zeros, lse -inf).
            Query rows outside every sequence's ``cu_seqlens_q`` range (CUDA) get zeros and lse -inf.

    Returns:
        ``out`` shaped like ``query`` (contiguous) in its dtype; with ``return_lse``, ``(out, lse)`` where
        ``lse`` is fp32 ``[num_queries, num_q_heads]``. A query with no visible key gets zeros and lse -inf, or
        lse ``sinks[h]`` with sinks (the sink alone is the denominator; the output is still zeros).
    """
    if eager_checks(check):  # no host sync while torch.compile traces
        _check_data(query, k_cache, block_table, seq_lens, cu_seqlens_q, max_q_len, kv_start, k_scale, v_scale)
    if max_q_len is None:
        if cu_seqlens_q is None:
            max_q_len = 1
        elif torch.compiler.is_compiling():  # no sync while tracing: every query row is a safe upper bound
            max_q_len = query.shape[0]
        else:  # clamped to [0, rows] (the kernels clamp each sequence's rows so): an unchecked cu_seqlens_q may be
            # anything, and an error about max_q_len would name an argument this caller never passed
            q_lens = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
            max_q_len = min(max(int(q_lens.max()), 0), query.shape[0]) if cu_seqlens_q.numel() > 1 else 0
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    sinks = _sinks_arg(sinks, _OP, check)
    out, lse = _ops.window_attention(query, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
                                     max_q_len, window, scale, float(softcap), k_scale, v_scale, sinks, chunk_size)
    return (out, lse) if return_lse else out


@torch.library.register_fake("arkernels::window_attention")
def _(query, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_q_len, window, scale, softcap,
      k_scale=None, v_scale=None, sinks=None, chunk_size=0):
    return query.new_empty(query.shape), query.new_empty((query.shape[0], query.shape[1]), dtype=torch.float32)


def window_attention_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    return_lse: bool = False,
    check: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``window_attention`` over contiguous K/V (transformers' DynamicCache layout), without copying K/V.

    ``key``/``value`` are viewed as a paged cache of one block per sequence (``key.permute(0, 2, 1, 3)``:
    ``[num_blocks=B, block_size=S, Hkv, D]``) with the identity block table; no host sync.

    Args:
        query: ``[B, Tq, Hq, D]``: the last ``Tq`` positions of each sequence (bottom-right aligned). Copied
            to ``[B*Tq, Hq, D]`` only when Tq > 1 and its strides do not allow a view.
        key, value: ``[B, Hkv, S, D]``, any strides with a contiguous last dim.
        seq_lens: int32 ``[B]``, keys ``0 .. seq_lens[b]-1`` exist (``Tq <= seq_lens[b] <= S``); default S.
        kv_start: int32 ``[B]``: keys ``j < kv_start[b]`` are masked (transformers' left padding).
        window, scale, softcap, chunk_size: as in ``window_attention`` (chunks count from ``kv_start[b]``).
        sinks: ``[Hq]`` attention-sink logits, as in ``window_attention`` (fp32; fp16/bf16 upcast).
        return_lse: also return fp32 lse ``[B, Tq, Hq]`` (with sinks, the sink term included).
        check: refuse NaN / +inf sinks (one host sync); False skips it.

    Returns:
        ``out`` ``[B, Tq, Hq, D]`` in ``query``'s dtype (what a transformers attention function returns);
        with ``return_lse``, ``(out, lse)``.
    """
    expect(query.dim() == 4, "window_attention_dense", f"query must be 4-D [B, Tq, Hq, D], got {tuple(query.shape)}")
    expect(key.dim() == 4 and value.dim() == 4 and key.shape == value.shape, "window_attention_dense",
           f"key and value must be 4-D [B, Hkv, S, D] of one shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    bsz, tq, hq, d = query.shape
    expect(key.shape[0] == bsz, "window_attention_dense",
           f"query has batch {bsz} but key has batch {key.shape[0]}")
    s = key.shape[2]
    dev = query.device
    block_table = torch.arange(bsz, dtype=torch.int32, device=dev)[:, None]
    if seq_lens is None:
        expect(tq <= s, "window_attention_dense", f"query has Tq = {tq} positions but key has only S = {s}")
        seq_lens = torch.full((bsz,), s, dtype=torch.int32, device=dev)
    else:
        seq_lens = seq_lens.to(device=dev, dtype=torch.int32)
    if kv_start is not None:
        kv_start = kv_start.to(device=dev, dtype=torch.int32)
    k_cache, v_cache = key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
    if tq == 1:  # decode: a view, one query per sequence
        q, cu, max_q_len = query[:, 0], None, 1
    else:
        q = query.reshape(bsz * tq, hq, d)
        cu = torch.arange(0, (bsz + 1) * tq, tq, dtype=torch.int32, device=dev)
        max_q_len = tq
    scale = d ** -0.5 if scale is None else float(scale)
    sinks = _sinks_arg(sinks, "window_attention_dense", check)
    out, lse = _ops.window_attention(q, k_cache, v_cache, block_table, seq_lens, cu, kv_start, max_q_len, window,
                                     scale, float(softcap), None, None, sinks, chunk_size)
    out = out.view(bsz, tq, hq, d)
    return (out, lse.view(bsz, tq, hq)) if return_lse else out
