"""The CPU kernels of the int8_matmul stem: exact int32 products through ``torch._int_mm``, fp32 everywhere else,
so quantized models run and are tested without a GPU. Inputs arrive checked by arkernels/ops/int8_matmul.py, which
registers these for "cpu" (the Triton kernels, for "cuda": arkernels/triton/int8_matmul.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = 127.0


def quantize_rowwise_cpu(x):
    """The ``arkernels::quantize_rowwise`` kernel on the CPU: x ``[M, K]`` -> ``(q int8 [M, K], scale fp32 [M])``."""
    xf = x.to(torch.float32)
    absmax = xf.abs().amax(dim=1) if x.shape[1] > 0 else xf.new_zeros(x.shape[0])
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    v = xf / scale[:, None]
    r = v.abs().add_(0.5).floor_().copysign_(v)  # half away from zero; in-place: 4 passes fewer on big weights
    return r.clamp_(-QMAX, QMAX).to(torch.int8).contiguous(), scale


def _epilogue_cpu(acc, a_scale, b_scale, bias, dtype):
    out = acc.to(torch.float32)
    if a_scale is not None:
        out = out * a_scale[:, None]
    if b_scale is not None:
        out = out * b_scale[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)[None, :]
    return out.to(dtype)


def int8_matmul_cpu(a, b, a_scale, b_scale, bias, dtype):
    """The ``arkernels::int8_matmul`` kernel on the CPU: ``[M, N]`` int32 when ``dtype`` is int32 (no epilogue),
    else ``dtype`` with the fp32 epilogue."""
    M, N = a.shape[0], b.shape[0]
    if M == 0 or N == 0 or a.shape[1] == 0:
        acc = torch.zeros((M, N), dtype=torch.int32)
    else:
        acc = torch._int_mm(a, b.t())  # exact int32 accumulation, any M/N/K on the CPU
    return acc if dtype == torch.int32 else _epilogue_cpu(acc, a_scale, b_scale, bias, dtype)


def w8a16_matmul_cpu(x, w, w_scale, bias):
    """The ``arkernels::w8a16_matmul`` kernel on the CPU: ``[M, N]`` in x's dtype."""
    # Dequantising per call costs ~4 bytes per weight of scratch, still ~20x faster on the CPU than
    # torch._weight_int8pack_mm here (0.18 ms vs 4 ms at [1, 576] x [1536, 576]); the scale is applied after the
    # sum (it factors out of it), as the CUDA kernel does.
    out = F.linear(x.to(torch.float32), w.to(torch.float32)) * w_scale[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)[None, :]
    return out.to(x.dtype)
