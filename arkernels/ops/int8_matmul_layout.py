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
