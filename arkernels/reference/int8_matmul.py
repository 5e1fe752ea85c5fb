"""Naive references for the int8_matmul stem: loops and float64, sharing no code with the kernels.

Quantization is symmetric and per row: ``scale = absmax(row) / 127`` (fp32), ``q = clamp(round(x / scale), -127, 127)``
with round-half-away-from-zero; an all-zero row gets ``scale = 1`` and ``q = 0`` (never NaN). The reference does
that arithmetic in fp32 on purpose (one fp32 division, then rounding), because that is what the kernels promise:
a float64 division would round a few exact ties differently.
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric int8: -128 is never produced by the quantizers (the matmul accepts it)


def quantize_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` float -> ``(q int8 [M, K], scale fp32 [M])``, one row at a time."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8)
    scale = torch.empty(M, dtype=torch.float32)
    for m in range(M):
        row = x[m].detach().cpu().to(torch.float32)
        absmax = row.abs().max() if K > 0 else torch.tensor(0.0)
        s = absmax / QMAX if absmax > 0 else torch.tensor(1.0)
        v = row / s  # fp32 division, as the kernels do it
        r = torch.sign(v) * torch.floor(v.abs() + 0.5)  # half away from zero
        q[m] = r.clamp(-QMAX, QMAX).to(torch.int8)
        scale[m] = s
    return q.to(x.device), scale.to(x.device)


def int8_matmul_ref(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None = None,
                    b_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a int8 ``[M, K]``, b int8 ``[N, K]`` -> float64 ``[M, N]``: ``(a @ b.T) * a_scale[m] * b_scale[n] + bias[n]``.

    The product is exact in float64 for any K below 2**38 (|a*b| <= 2**14). A missing scale counts as 1, a
    missing bias as 0. The caller casts (int32 for the unscaled product).
    """
    acc = torch.einsum("mk,nk->mn", a.cpu().to(torch.float64), b.cpu().to(torch.float64))
    if a_scale is not None:
        acc = acc * a_scale.cpu().to(torch.float64)[:, None]
    if b_scale is not None:
        acc = acc * b_scale.cpu().to(torch.float64)[None, :]
    if bias is not None:
        acc = acc + bias.cpu().to(torch.float64)[None, :]
    return acc


def w8a16_matmul_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float ``[..., K]``, w int8 ``[N, K]``, w_scale fp32 ``[N]`` -> float64 ``[..., N]``:
    ``x @ (w * w_scale[:, None]).T + bias``, the weight dequantised explicitly."""
    w_deq = w.cpu().to(torch.float64) * w_scale.cpu().to(torch.float64)[:, None]
    out = torch.einsum("...k,nk->...n", x.cpu().to(torch.float64), w_deq)
    if bias is not None:
        out = out + bias.cpu().to(torch.float64)
    return out


def dequantize_rowwise_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale[:, None]`` in float64."""
    return q.cpu().to(torch.float64) * scale.cpu().to(torch.float64)[:, None]


def sqnr_db(signal: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum(s^2) / sum((s - a)^2))``."""
    s = signal.detach().cpu().to(torch.float64)
    noise = (s - approx.detach().cpu().to(torch.float64)).pow(2).sum()
    return float(10 * torch.log10(s.pow(2).sum() / noise.clamp_min(1e-300)))


def unpack_weight_ref(wp: torch.Tensor, rows_per_group: int = 16, chunk: int = 512) -> torch.Tensor:
    """The packed weight ``[N, K // 16, 16]`` (arkernels/ops/int8_matmul_layout.py) -> int8 ``[N, K]``, element by
    element from the layout's definition: row groups of ``rows_per_group`` rows (the last may be shorter), each
    holding its K chunks of ``chunk`` columns (the last may be shorter) as row-major ``[rows, width]`` blocks."""
    N, K = wp.shape[0], wp.shape[1] * wp.shape[2]
    flat = wp.cpu().reshape(-1)
    w = torch.empty(N, K, dtype=torch.int8)
    offset = 0
    for g0 in range(0, N, rows_per_group):
        rows = min(rows_per_group, N - g0)
        for c0 in range(0, K, chunk):
            width = min(chunk, K - c0)
            for r in range(rows):
                w[g0 + r, c0:c0 + width] = flat[offset:offset + width]
                offset += width
    return w.to(wp.device)
