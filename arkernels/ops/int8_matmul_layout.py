"""The packed ("tile-order") int8 weight layout of the w8a16 decode kernels: its tags, and the conversions.

A weight ``w [N, K]`` (``K % 16 == 0``) is stored as row groups of PACK_ROWS rows (the last group may be shorter:
``r = min(PACK_ROWS, N - g * PACK_ROWS)`` rows); inside a group, K is cut in chunks of PACK_K columns (the last may be
shorter: ``kw = min(PACK_K, K - c * PACK_K)``) and each chunk is stored as its own row-major ``[r, kw]`` block, the
chunks one after another. Element ``(n, k)`` of group ``g = n // 16``, chunk start ``cs = k - k % PACK_K``::

    offset = g * PACK_ROWS * K + cs * r + (n % PACK_ROWS) * kw + (k - cs)

So the ``[32, 512]`` weight tile one GEMV program reads for one split of K is two contiguous 8 KB blocks (one per
row group), in the order the program consumes them; rows ``[a, b)`` with ``a``, ``b`` multiples of PACK_ROWS (or ``b =
N``) are the contiguous bytes ``[a * K, b * K)`` and are themselves the packed form of those rows, so packed weights
concatenate and slice along N like plain ones (what ``fuse_projections`` relies on).

The packed tensor has shape ``[N, K // 16, 16]`` (contiguous): dim 0 still counts rows (each row's K bytes, by group),
and the 3-D shape is what tells every op this layout from the plain ``[N, K]`` one. Its elements are *not* indexable
as ``w[n, k // 16, k % 16]``: read them through :func:`unpack_weight`.
"""
from __future__ import annotations

import torch

PACK_ROWS = 16  # rows per group: the mma's N granularity, and the unit in which packed weights slice and concatenate
PACK_K = 512  # K columns per chunk: the GEMV's split of K (K_HALVES x BLOCK_K), so one program reads whole chunks
PACK_INNER = 16  # the packed tensor's last dim ([N, K // 16, 16]); K must be a multiple of it
LAYOUT_PLAIN = 1  # Int8Linear.weight_format: [N, K] row-major (checkpoints without the tag)
LAYOUT_PACKED = 2  # [N, K // 16, 16] in the order above


def is_packed(w: torch.Tensor) -> bool:
    """True for a weight in the packed layout (its 3-D shape ``[N, K // 16, 16]``)."""
    return w.dim() == 3


def _convert(src: torch.Tensor, N: int, K: int, to_plain: bool, dtype: torch.dtype) -> torch.Tensor:
    """The ``N x K`` bytes of ``src`` (contiguous) in the other order, as a new contiguous ``dtype`` tensor of ``N *
    K`` elements: packed -> plain when ``to_plain``, else plain -> packed. One pass (each block is a strided view
    copied once, the dtype conversion included), no concatenation."""
    src, out = src.reshape(-1), torch.empty(N * K, dtype=dtype, device=src.device)
    full, tail = K // PACK_K, K % PACK_K
    whole = (N // PACK_ROWS) * PACK_ROWS
    packed_flat, plain_flat = (src, out) if to_plain else (out, src)
    for row0, rows, count in ((0, PACK_ROWS, whole // PACK_ROWS), (whole, N - whole, int(N > whole))):
        if count == 0:  # no whole group, or no partial last one
            continue
        lo, hi = row0 * K, (row0 + count * rows) * K
        packed, plain = packed_flat[lo:hi].view(count, rows * K), plain_flat[lo:hi].view(count, rows, K)
        pairs = [(plain[:, :, full * PACK_K:], packed[:, full * rows * PACK_K:].view(count, rows, tail))]
        if full:
            pairs.append((plain[:, :, :full * PACK_K].unflatten(2, (full, PACK_K)),
                          packed[:, :full * rows * PACK_K].view(count, full, rows, PACK_K).permute(0, 2, 1, 3)))
        for p, q in pairs:
            p.copy_(q) if to_plain else q.copy_(p)
    return out


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` (any strides; ``K % 16 == 0``) -> the packed ``[N, K // 16, 16]``, contiguous."""
    N, K = w.shape
    if K % PACK_INNER:
        raise ValueError(f"pack_weight: K = {K} is not a multiple of {PACK_INNER}")
    return _convert(w.contiguous(), N, K, False, torch.int8).view(N, K // PACK_INNER, PACK_INNER)


def unpack_weight(wp: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """The packed ``[N, K // 16, 16]`` -> the plain ``[N, K]`` in ``dtype`` (int8: the weight itself; a float dtype:
    its values, converted in the same pass, as the CPU kernel takes them), contiguous (a copy)."""
    N, K = wp.shape[0], wp.shape[1] * wp.shape[2]
    return _convert(wp.contiguous(), N, K, True, dtype).view(N, K)


# ---------------------------------------------------------------------------------------------------------------
# The fragment layout (LAYOUT_FRAGMENT, Marlin's idea on our int8 format): the bytes of each whole 16-row group in
# the order the CUDA decode kernel (csrc/int8_matmul_kernels.cuh) feeds them to mma.sync m16n8k16's B operand, so one
# 16-byte load per lane (LDG.128, 512 contiguous bytes per warp) is that lane's B fragments of 4 MMAs, with no
# shared-memory staging.
#
# mma.m16n8k16's B fragment (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"): lane l =
# 4 g + t holds B[k][n] for n = g and k = 2t, 2t + 1 (register b0), 2t + 8, 2t + 9 (b1); here B[k][n] = w[n, k].
# Group G (rows 16 G .. 16 G + 15, bytes [16 G K, 16 (G + 1) K)) is cut into units of FRAG_UNIT_K = 32 columns
# (512 bytes: 2 n8 tiles j x 2 k16 steps s); element (n, k) = (16 G + 8 j + g, 32 u + 16 s + 8 h + 2 t + e) sits at
#
#     16 G K + 512 u + 16 (4 g + t) + 8 s + 4 j + 2 h + e
#
# A K tail (K % 32 == 16) is one more unit of 16 columns (256 bytes, s = 0 only) at 512 (K // 32): lane (g, t)'s
# 8 bytes at 16 G K + 512 (K // 32) + 8 (4 g + t) + 4 j + 2 h + e. A short last group (r = N % 16 rows) is stored
# plain (row-major [r, K]): the kernel reads it with 16-bit loads. So rows [a, b) with a, b multiples of 16 (or
# b = N) are bytes [a K, b K) and are the fragment form of those rows: fragment weights slice and concatenate along
# N like plain and packed ones (fuse_projections). The tensor's shape is [N, K // 16, 4, 4] (contiguous): 4-D marks
# the layout for every op; its elements are not indexable as w[n, ...]: read them through unfragment_weight.
# ---------------------------------------------------------------------------------------------------------------
LAYOUT_FRAGMENT = 3  # Int8Linear.weight_format: the fragment order above, [N, K // 16, 4, 4]
FRAG_ROWS = 16  # rows per group: the unit in which fragment weights slice and concatenate
FRAG_UNIT_K = 32  # K columns per 16-byte-per-lane unit (2 mma k-steps)


def is_fragment(w: torch.Tensor) -> bool:
    """True for a weight in the fragment layout (its 4-D shape ``[N, K // 16, 4, 4]``)."""
    return w.dim() == 4


def _frag_pairs(frag: torch.Tensor, plain: torch.Tensor, N: int, K: int):
    """(fragment view, plain view) pairs over the flat ``frag`` / ``plain`` buffers of one ``[N, K]`` weight whose
    elements correspond one to one: whole groups' full units, their K tail, and the short last group."""
    whole, units = N // FRAG_ROWS, K // FRAG_UNIT_K
    gk = FRAG_ROWS * K
    pairs = []
    if whole:
        f = frag[:whole * gk].view(whole, gk)
        p = plain[:whole * gk].view(whole, 2, 8, K)  # [G, j, g, k]
        if units:
            # fragment [G, u, g, t, s, j, h, e] <- plain [G, j, g, u, s, h, t, e]
            fv = f[:, :units * 512].unflatten(1, (units, 8, 4, 2, 2, 2, 2))
            pv = p[..., :units * FRAG_UNIT_K].unflatten(3, (units, 2, 2, 4, 2)).permute(0, 3, 2, 6, 4, 1, 5, 7)
            pairs.append((fv, pv))
        if K % FRAG_UNIT_K:
            # tail: fragment [G, g, t, j, h, e] <- plain [G, j, g, h, t, e] at column 32 u
            fv = f[:, units * 512:].unflatten(1, (8, 4, 2, 2, 2))
            pv = p[..., units * FRAG_UNIT_K:].unflatten(3, (2, 4, 2)).permute(0, 2, 4, 1, 3, 5)
            pairs.append((fv, pv))
    if N > whole * FRAG_ROWS:
        pairs.append((frag[whole * gk:], plain[whole * gk:]))
    return pairs


def fragment_weight(w: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` (any strides; ``K % 16 == 0``) -> the fragment layout ``[N, K // 16, 4, 4]``, contiguous. One
    pass: each part is a strided view copied once."""
    if w.dim() != 2 or w.dtype != torch.int8:
        raise ValueError(f"fragment_weight: w must be int8 [N, K], got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    if K % PACK_INNER:
        raise ValueError(f"fragment_weight: K = {K} is not a multiple of {PACK_INNER}")
    src = w.contiguous().reshape(-1)
    out = torch.empty(N * K, dtype=torch.int8, device=w.device)
    for f, p in _frag_pairs(out, src, N, K):
        f.copy_(p)
    return out.view(N, K // 16, 4, 4)


def unfragment_weight(wf: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """The fragment layout ``[N, K // 16, 4, 4]`` -> the plain ``[N, K]`` in ``dtype`` (int8: the weight; a float
    dtype: its values, converted in the same pass), contiguous (a copy)."""
    if wf.dim() != 4 or wf.shape[2:] != (4, 4):
        raise ValueError(f"unfragment_weight: expected the fragment layout [N, K // 16, 4, 4], got {tuple(wf.shape)}")
    N, K = wf.shape[0], wf.shape[1] * 16
    src = wf.contiguous().reshape(-1)
    out = torch.empty(N * K, dtype=dtype, device=wf.device)
    for f, p in _frag_pairs(src, out, N, K):
        p.copy_(f)
    return out.view(N, K)


def to_plain(w: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Any of the three layouts -> the plain ``[N, K]`` (a copy for packed and fragment; plain returned as is when
    ``dtype`` is int8)."""
    if is_fragment(w):
        return unfragment_weight(w, dtype)
    if is_packed(w):
        return unpack_weight(w, dtype)
    return w if dtype == torch.int8 else w.to(dtype)
