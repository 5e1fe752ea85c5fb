"""Triton kernels of the int8_matmul stem: row-wise int8 quantization, int8 x int8 -> int32 matmul with a fused
fp32 scale/bias epilogue (W8A8), and the weight-only W8A16 matmul that dequantises int8 weights in registers.

Layout: the F.linear convention, ``out[M, N] = a[M, K] @ b[N, K].T``; both operands K-major, which is also what
Hopper's int8 wgmma wants (it takes no transposed int8 operand). Any strides.

Parallelisation: one program per ``[BLOCK_M, BLOCK_N]`` output tile, tiles ordered in groups of GROUP_M rows of
tiles so neighbouring programs share B tiles in L2; the K loop walks BLOCK_K at a time. Rows and columns past
M/N are clamped to row 0 for the loads (no masks) and masked only at the store; ``EVEN_K`` drops the K masks when
BLOCK_K divides K: those two together are the fast path for aligned shapes.

Shape classes: autotune is keyed on ``(M_CLASS, N, K)`` with M bucketed as 1, <=16, <=64, larger, and each class
only benchmarks its own configs. A decode step (M = batch <= 16) therefore hits the cache after the first step of
the first layer of each shape, never a sweep per new M. Small M is memory bound (a GEMV over the weight): BLOCK_M
16, narrow N tiles so there are enough programs to cover 132 SMs even for N = 4096, and deep K tiles / pipelines
to keep bytes in flight. Large M uses the tensor cores: BLOCK_M % 64 == 0 and num_warps % 4 == 0 so Hopper emits
int8 wgmma rather than mma.sync.

Interpreter (TRITON_INTERPRET=1, CPU tensors): autotuning is skipped (one fixed config per class, or the caller's),
and the W8A16 dot runs in fp32 because the interpreter computes bf16 arithmetic wrongly.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

QMAX: tl.constexpr = tl.constexpr(127.0)  # symmetric: the quantizers produce [-127, 127] (constexpr: a kernel global)
LARGE_M = 1 << 30  # the M class "larger than 64"
ONE_PASS_MAX_K = 16384  # rows up to this length stay in registers: one read of x instead of two


def m_class(M: int) -> int:
    """Autotune bucket of M: 1, 16 (<= 16), 64 (<= 64) or LARGE_M."""
    for bound in (1, 16, 64):
        if M <= bound:
            return bound
    return LARGE_M


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    """Autotune on a GPU unless ``ARKERNELS_AUTOTUNE=0``: then each shape class launches its first config, with no
    benchmarking sweep (the GPU check's test step: ~70 sweeps over the test grid would not fit its time budget)."""
    return not interpreting() and os.environ.get("ARKERNELS_AUTOTUNE", "1") != "0"


# ---------------------------------------------------------------------------------------------------------------
# quantize_rowwise: x [M, K] -> q int8 [M, K], scale fp32 [M]; one program per row.
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _quantize_rowwise_kernel(
    x_ptr, q_ptr, scale_ptr,  # x [M, K] fp32|fp16|bf16 (any strides), q int8 [M, K] contiguous, scale fp32 [M]
    K, stride_xm, stride_xk,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,  # the whole row fits one block: read x once
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    cols = tl.arange(0, BLOCK_K)
    # int64 column offsets into x: col * stride_xk passes 2^31 for a column-major view of > 2^31 elements (e.g. a
    # transposed 152k x 16k weight); free when stride_xk == 1 (the pointer add widens to 64 bits anyway)
    cols64 = cols.to(tl.int64)
    if ONE_PASS:
        mask = cols < K
        x = tl.load(x_row + cols64 * stride_xk, mask=mask, other=0.0).to(tl.float32)
        absmax = tl.max(tl.abs(x), axis=0)
    else:
        run = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = (k0 + cols) < K
            xk = tl.load(x_row + (k0 + cols64) * stride_xk, mask=m, other=0.0).to(tl.float32)
            run = tl.maximum(run, tl.abs(xk))
        absmax = tl.max(run, axis=0)
    # all-zero row: scale 1 so q = 0 and q * scale = 0, never 0/0. div_rn: IEEE division, as the reference does.
    scale = tl.where(absmax > 0.0, tl.math.div_rn(absmax, QMAX), 1.0)
    tl.store(scale_ptr + row, scale)
    if ONE_PASS:
        v = tl.math.div_rn(x, scale)
        r = tl.where(v >= 0.0, tl.floor(v + 0.5), -tl.floor(0.5 - v))  # half away from zero
        r = tl.minimum(tl.maximum(r, -QMAX), QMAX)
        tl.store(q_row + cols, r.to(tl.int8), mask=mask)
    else:
        for k0 in range(0, K, BLOCK_K):
            m = (k0 + cols) < K
            xk = tl.load(x_row + (k0 + cols64) * stride_xk, mask=m, other=0.0).to(tl.float32)
            v = tl.math.div_rn(xk, scale)
            r = tl.where(v >= 0.0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
            r = tl.minimum(tl.maximum(r, -QMAX), QMAX)
            tl.store(q_row + k0 + cols, r.to(tl.int8), mask=m)


def quantize_rowwise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` fp32|fp16|bf16 (checked by the caller) -> ``(q int8 [M, K], scale fp32 [M])``."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    one_pass = K <= ONE_PASS_MAX_K
    block_k = max(16, triton.next_power_of_2(K)) if one_pass else 4096
    num_warps = 4 if block_k <= 2048 else (8 if block_k <= 8192 else 16)
    _quantize_rowwise_kernel[(M,)](x, q, scale, K, x.stride(0), x.stride(1), BLOCK_K=block_k, ONE_PASS=one_pass,
                                   num_warps=num_warps)
    return q, scale


# ---------------------------------------------------------------------------------------------------------------
# Autotune configs per M class.
# ---------------------------------------------------------------------------------------------------------------
def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# Small M (decode): memory bound, the weight streams once. Narrow N tiles (N=4096 / 32 = 128 programs and up),
# deep K tiles, deep pipelines. GROUP_M 1: there is a single row of tiles.
_SMALL_M = [_cfg(16, bn, bk, w, s, 1) for bn, bk, w, s in [
    (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4), (64, 128, 4, 5), (64, 512, 8, 3),
    (128, 128, 4, 4), (128, 256, 8, 3), (16, 512, 4, 4),
]]
_MID_M = [_cfg(bm, bn, bk, w, s) for bm, bn, bk, w, s in [
    (32, 64, 128, 4, 4), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3),
    (64, 128, 64, 4, 5), (64, 256, 64, 8, 3),
]]
# Large M (prefill): tensor cores; BLOCK_M % 64 == 0 and num_warps % 4 == 0 (Hopper wgmma).
_LARGE_M = [_cfg(bm, bn, bk, w, s) for bm, bn, bk, w, s in [
    (128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (128, 256, 128, 8, 3),
    (64, 128, 128, 4, 4), (256, 128, 64, 8, 3), (64, 256, 128, 8, 3),
]]
CONFIGS_BY_CLASS = {1: _SMALL_M, 16: _SMALL_M, 64: _MID_M, LARGE_M: _LARGE_M}
_ALL_CONFIGS = _SMALL_M + _MID_M + _LARGE_M
# w8a16 with fp32 x (DOT_FP32 on a GPU: an exact FMA dot, no tensor cores) gets its own shallow-K tiles. With the
# tiles above, triton 3.6 for sm_90 spills 3-90 KB per thread, 3 configs exceed 227 KB of shared memory, and ptxas
# needs 2-80 s per config (minutes of autotuning on the first call); these compile in < 1 s with no spills.
_FP32_SMALL_M = [_cfg(16, 64, 32, 4, 2, 1), _cfg(16, 32, 32, 4, 3, 1)]
_FP32_LARGER_M = [_cfg(32, 64, 32, 4, 2), _cfg(64, 64, 16, 4, 2)]
FP32_DOT_CONFIGS_BY_CLASS = {1: _FP32_SMALL_M, 16: _FP32_SMALL_M, 64: _FP32_LARGER_M, LARGE_M: _FP32_LARGER_M}

# One fixed config per class in the interpreter: big blocks (each program instance costs ~0.5 ms there).
INTERPRET_CONFIGS = {
    1: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1),
    16: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1),
    64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8),
    LARGE_M: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
}


def _prune_by_class(configs, named_args, **kwargs):
    mc = named_args.get("M_CLASS", kwargs.get("M_CLASS"))
    table = FP32_DOT_CONFIGS_BY_CLASS if kwargs.get("DOT_FP32", False) else CONFIGS_BY_CLASS
    ids = {id(c) for c in table[mc]}
    return [c for c in configs if id(c) in ids]


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M rows of tiles share each column of B tiles while it is hot in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _tile_pointers(a_ptr, b_ptr, M, N, stride_am, stride_ak, stride_bn, stride_bk, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows ``rm``, columns ``rn``, K lanes ``rk`` and the first K-tile pointers into
    ``a [M, K]`` (``[BLOCK_M, BLOCK_K]``) and ``b [N, K]`` (``[BLOCK_K, BLOCK_N]``), for both matmul kernels.

    int64 only in the tile's scalar base; int32 offsets inside the tile (int64 offset tensors cost 2 registers per
    element and spilled kilobytes at 128x128 tiles). Rows/cols past the edge read the tile's first row/col (always
    valid) instead of masking every load; the store masks them.
    """
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    lm = tl.where(rm < M, tl.arange(0, BLOCK_M), 0)
    ln = tl.where(rn < N, tl.arange(0, BLOCK_N), 0)
    a_ptrs = (a_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_am) + (lm[:, None] * stride_am + rk[None, :] * stride_ak)
    b_ptrs = (b_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_bn) + (ln[None, :] * stride_bn + rk[:, None] * stride_bk)
    return rm, rn, rk, a_ptrs, b_ptrs


# ---------------------------------------------------------------------------------------------------------------
# int8_matmul: a int8 [M, K] @ b int8 [N, K].T -> int32, or fp32 epilogue acc * a_scale[m] * b_scale[n] + bias[n].
# ---------------------------------------------------------------------------------------------------------------
@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _int8_matmul_kernel(
    a_ptr, b_ptr, c_ptr,  # a int8 [M, K], b int8 [N, K], c [M, N] int32 (no epilogue) or fp32|fp16|bf16
    a_scale_ptr, b_scale_ptr, bias_ptr,  # fp32 [M], fp32 [N], float [N] (each used only when HAS_*)
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    M_CLASS,  # autotune key only: 1, 16, 64 or LARGE_M
    HAS_A_SCALE: tl.constexpr, HAS_B_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,  # False: store the exact int32 accumulator
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    rm, rn, rk, a_ptrs, b_ptrs = _tile_pointers(a_ptr, b_ptr, M, N, stride_am, stride_ak, stride_bn, stride_bk,
                                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :].to(tl.int64) * stride_cn
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if EPILOGUE:
        out = acc.to(tl.float32)  # scales stay fp32: int32 * an fp16 scale would overflow
        if HAS_A_SCALE:
            out = out * tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
        if HAS_B_SCALE:
            out = out * tl.load(b_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        tl.store(c_ptrs, acc, mask=c_mask)


_int8_matmul_tuned = triton.autotune(configs=_ALL_CONFIGS, key=["M_CLASS", "N", "K"],
                                     prune_configs_by={"early_config_prune": _prune_by_class})(_int8_matmul_kernel)


def _grid(M, N):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def _launch(tuned, kernel, M, N, args, flags, config):
    mc = m_class(M)
    if config is None and autotuning():
        tuned[_grid(M, N)](*args, mc, **flags)
        return
    if config is not None:
        cfg = dict(config)
    elif interpreting():
        cfg = dict(INTERPRET_CONFIGS[mc])
    else:  # ARKERNELS_AUTOTUNE=0 on a GPU: the class's first config, as the autotuner would have pruned them
        first = (FP32_DOT_CONFIGS_BY_CLASS if flags.get("DOT_FP32", False) else CONFIGS_BY_CLASS)[mc][0]
        cfg = dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
    kernel[_grid(M, N)(cfg)](*args, mc, **flags, **cfg, **launch)


def int8_matmul_triton(a, b, a_scale=None, b_scale=None, bias=None, out_dtype=None, *, config=None):
    """a int8 ``[M, K]``, b int8 ``[N, K]`` (checked by the caller) -> ``[M, N]``: int32 when ``out_dtype`` is
    None (no epilogue), else ``out_dtype`` with the fp32 epilogue. ``config``: explicit tile sizes
    (``BLOCK_M/N/K``, ``GROUP_M``, optional ``num_warps``/``num_stages``) instead of autotuning."""
    M, K = a.shape
    N = b.shape[0]
    epilogue = out_dtype is not None
    c = torch.empty((M, N), dtype=out_dtype if epilogue else torch.int32, device=a.device)
    if M == 0 or N == 0:
        return c
    flags = dict(HAS_A_SCALE=a_scale is not None, HAS_B_SCALE=b_scale is not None, HAS_BIAS=bias is not None,
                 EPILOGUE=epilogue)
    # The kernel reads scales and bias at unit stride: a strided or expanded (stride 0) vector is made contiguous
    # here (a no-op for the usual contiguous one), or it would read the wrong elements or past its storage.
    # None -> c, never read: the HAS_* flags compile those loads out.
    vecs = [c if t is None else t.contiguous() for t in (a_scale, b_scale, bias)]
    args = (a, b, c, *vecs, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    _launch(_int8_matmul_tuned, _int8_matmul_kernel, M, N, args, flags, config)
    return c


# ---------------------------------------------------------------------------------------------------------------
# w8a16_matmul: x [M, K] fp16|bf16 (fp32 accepted) @ (w int8 [N, K] * w_scale[N]).T + bias -> [M, N] in x's dtype.
# The weight tile is converted to x's dtype in registers (exact: |w| <= 128 fits fp16 and bf16); the per-channel
# scale factors out of the K sum, so it is applied once per output in the epilogue, not per weight.
# ---------------------------------------------------------------------------------------------------------------
@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _w8a16_matmul_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,  # x [M, K], w int8 [N, K], w_scale fp32 [N], bias [N]?, out [M, N]
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    M_CLASS,  # autotune key only
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 x, or the interpreter (which gets bf16 arithmetic wrong): an exact fp32 dot
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    rm, rn, rk, x_ptrs, w_ptrs = _tile_pointers(x_ptr, w_ptr, M, N, stride_xm, stride_xk, stride_wn, stride_wk,
                                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out = acc * tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :].to(tl.int64) * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


_w8a16_matmul_tuned = triton.autotune(configs=_ALL_CONFIGS + _FP32_SMALL_M + _FP32_LARGER_M, key=["M_CLASS", "N", "K"],
                                      prune_configs_by={"early_config_prune": _prune_by_class})(_w8a16_matmul_kernel)


def w8a16_matmul_triton(x, w, w_scale, bias=None, *, config=None):
    """x ``[M, K]`` fp16|bf16|fp32, w int8 ``[N, K]``, w_scale fp32 ``[N]``, bias ``[N]``? (checked by the caller)
    -> ``[M, N]`` in x's dtype. ``config`` as for :func:`int8_matmul_triton`."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    w_scale = w_scale.contiguous()  # read at unit stride, as are the bias and the scales of int8_matmul
    args = (x, w, w_scale, w_scale if bias is None else bias.contiguous(), out, M, N, K, x.stride(0), x.stride(1),
            w.stride(0), w.stride(1), out.stride(0), out.stride(1))
    flags = dict(HAS_BIAS=bias is not None, DOT_FP32=x.dtype == torch.float32 or interpreting())
    _launch(_w8a16_matmul_tuned, _w8a16_matmul_kernel, M, N, args, flags, config)
    return out
