"""Triton kernels of the int8_matmul stem: row-wise int8 quantization, int8 x int8 -> int32 matmul with a fused
fp32 scale/bias epilogue (W8A8), and the weight-only W8A16 matmul that dequantises int8 weights in registers.

Layout: the F.linear convention, ``out[M, N] = a[M, K] @ b[N, K].T``; both operands K-major, which is also what
Hopper's int8 wgmma wants (it takes no transposed int8 operand). Any strides.

Parallelisation: one program per ``[BLOCK_M, BLOCK_N]`` output tile, tiles ordered in groups of GROUP_M rows of
tiles so neighbouring programs share B tiles in L2; the K loop walks BLOCK_K at a time. Rows and columns past
M/N are clamped to row 0 for the loads (no masks) and masked only at the store; ``EVEN_K`` drops the K masks when
BLOCK_K divides K: those two together are the fast path for aligned shapes.

Shape classes: autotune is keyed on ``(M_CLASS, N, K)`` where the M_CLASS argument carries the tuning bucket of
M (:func:`tune_bucket`): 1, 16 (2..16), then every power of two 32, 64, ..., 8192, and one bucket above 8192. A
prefill of 4096 rows therefore gets its own sweep instead of reusing the config that won at the first prefill
length. Each bucket benchmarks only the configs of its family (:func:`m_class`: 1, <=16, <=64, larger) whose
BLOCK_M is not taller than the bucket (a 256-row tile at M = 128 computes half zeros). Large M uses the tensor
cores: BLOCK_M % 64 == 0 and num_warps % 4 == 0 so Hopper emits int8 wgmma rather than mma.sync.

W8A16 decode (M <= 16, fp16/bf16 x, :func:`w8a16_path`): the weight streams once and nothing else matters.
- M <= 4: ``w8a16_gemv_kernel``. A program owns one K_HALVES x BLOCK_K slice of K (its split) and keeps the
  activation rows of that slice in registers (``[16, 512]`` as two dot operands, rows past M zero and never read)
  while it streams N_TILES (2 or 4) weight tiles of ``[512, 32]`` past them through the tensor cores: x is read
  once per N_TILES tiles. The N-tile loop is software-pipelined with num_stages = N_TILES + 1, so every tile's
  weight is a cp.async (straight to shared memory, no registers held) issued in the prologue, before the first
  wait: all of a program's weight bytes are in flight at once. The K reduction runs on the tensor cores (an FMA +
  shuffle version is issue-bound: docs/kernels.md).
- Weight layouts: the plain ``[N, K]`` (any strides), or the packed ``[N, K // 16, 16]`` of
  arkernels/ops/int8_matmul_layout.py (PACKED: 16-row groups of 512-column chunks, each program's tile contiguous
  per row group; :func:`_packed_w_ptrs`), which every w8a16 kernel reads; WHOLE_PACK makes the in-group strides
  constants when no group or chunk is partial.
- 5 <= M <= 16: ``w8a16_splitk_kernel``, a tensor-core tile of 16 rows over a K range of K_PER_SPLIT. The GEMV
  class also runs it (32 x 256 tiles, 3 stages, one split over all of K) where N alone fills the machine.
- Grids (:func:`w8a16_decode_config`): a pure function of (path, M, N, K, SM count), never autotuned (the bits do
  not depend on which config a sweep picked; decode never sweeps). GEMV class: K is split (one split per 512
  columns) only where N alone cannot fill the machine, i.e. give every SM the programs that hold LITTLE_BYTES of
  weight loads in flight (:func:`resident_programs` of registers and shared memory bounds them), balanced over the
  SMs; the LM heads and the fused gate/up run unsplit (no workspace, no ticket). Its per-chunk GEMV's N_TILES, and
  split-K's split counts (PROGRAMS_PER_SM), are planned in whole waves: the fewest programs within WAVE_SLACK of the
  best wave efficiency. Split-K keeps its workspace under 10% of the weight bytes (K = 4096 at M = 16: 3 splits).
  The per-shape figures: docs/kernels.md.
- Programmatic dependent launch (``PDL``, sm_90, launched with ``launch_pdl=True``; :func:`_pdl_start`): before
  ``gdc_wait`` a program only prefetches its first weight tiles into L2 (the weights are no upstream kernel's
  output, and a prefetch returns no data), x and every write come after it. Estimate, no GPU: the first ~16 KB of
  weight and the launch overlap the previous kernel's tail, ~0.5-1 us per launch; ~60 SASS per program.
- Split-K reduction, fused (``reduce="fused"``, the default): partial fp32 sums go to a ``[SPLIT_K, M, N]``
  workspace; each program then takes a ticket for its output tile (``tickets.last_program``: an int64 atomic
  tagged with a per-launch epoch, so an aborted launch cannot poison later ones) and the last of the tile's SPLIT_K
  programs adds the partials in split order (0, 1, ...; blocks of up to 16 splits' loads in flight), then applies
  scale and bias (:func:`_reduce_splits`): one launch instead of two, and the same bits whichever split finishes
  first. ``reduce="launch"`` keeps the previous two-launch path (``splitk_reduce_kernel``, the same order, the
  same bits) as the benchmark's baseline. With one split the matmul kernel applies the epilogue itself and no
  workspace or ticket exists. Registers, shared memory and instruction order of the offline sm_90 compile
  (tests/test_int8_matmul.py checks them): docs/kernels.md.
- Alignment: Triton specializes pointers and integer arguments divisible by 16 and strides equal to 1; an
  aligned, K-contiguous weight with rows a multiple of 16 bytes gets 16-byte loads with no hint written here,
  anything else byte loads (~4x slower). :func:`weight_unaligned_reason` names the cases; the op warns on CUDA and
  ``Int8Linear`` refuses such layers.
- int8 -> float: no per-element I2F (a quarter-rate unit on sm_90), :func:`_int8_to`. Triton 3.6 already lowers
  ``w.to(bf16)`` of an int8 tile to the byte-permute / magic-number sequence, two lanes per instruction (sm_90
  offline compile: 64 weights per thread -> 32 HADD2 + ~33 PRMT, 2 I2F in the whole kernel), but ``w.to(fp16)`` to
  one I2F per weight (64 I2F for the same tile): fp16 takes the magic number by hand (0 I2F, 32 HADD2).

Autotuning (prefill, and int8_matmul at any M) never runs during a CUDA-graph capture (:func:`_launch`).

Interpreter (TRITON_INTERPRET=1, CPU tensors): autotuning is skipped (one fixed config per class, or the caller's),
the tickets' atomics and compare-and-swap loop run as written (programs one after another), and the W8A16 dots
run in fp32 because the interpreter computes bf16 arithmetic wrongly (its int8 -> bf16 cast
gives NaN too).
This file holds the jit code and its autotune configs; what runs for a shape (configs, paths, grids) is
arkernels/triton/int8_matmul_plan.py, the launches arkernels/triton/int8_matmul_launch.py.
"""
from __future__ import annotations

import triton
import triton.language as tl
from arkernels.triton.pdl import pdl_enter

from arkernels.ops import int8_matmul_layout as layout
from arkernels.triton.tickets import last_program

QMAX: tl.constexpr = tl.constexpr(127.0)  # symmetric: the quantizers produce [-127, 127] (constexpr: a kernel global)
LARGE_M = 1 << 30  # the M class "larger than 64"
PACK_ROWS: tl.constexpr = tl.constexpr(layout.PACK_ROWS)  # the packed weight layout's row group and K chunk
PACK_K: tl.constexpr = tl.constexpr(layout.PACK_K)


# ---------------------------------------------------------------------------------------------------------------
# quantize_rowwise: x [M, K] -> q int8 [M, K], scale fp32 [M]; one program per row.
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def quantize_rowwise_kernel(
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
    # deep-K tall/wide tiles for the M >= 256 buckets (48 KB of int8 operands per stage: 144 / 192 KB of 227)
    (256, 128, 128, 8, 3), (128, 256, 128, 8, 4),
]]
CONFIGS_BY_CLASS = {1: _SMALL_M, 16: _SMALL_M, 64: _MID_M, LARGE_M: _LARGE_M}
ALL_CONFIGS = _SMALL_M + _MID_M + _LARGE_M
# w8a16 with fp32 x (DOT_FP32 on a GPU: an exact FMA dot, no tensor cores) gets its own shallow-K tiles. With the
# tiles above, triton 3.6 for sm_90 spills 3-90 KB per thread, 3 configs exceed 227 KB of shared memory, and ptxas
# needs 2-80 s per config (minutes of autotuning on the first call); these compile in < 1 s with no spills.
FP32_SMALL_M = [_cfg(16, 64, 32, 4, 2, 1), _cfg(16, 32, 32, 4, 3, 1)]
FP32_LARGER_M = [_cfg(32, 64, 32, 4, 2), _cfg(64, 64, 16, 4, 2)]
FP32_DOT_CONFIGS_BY_CLASS = {1: FP32_SMALL_M, 16: FP32_SMALL_M, 64: FP32_LARGER_M, LARGE_M: FP32_LARGER_M}

# One fixed config per class in the interpreter: big blocks (each program instance costs ~0.5 ms there).
INTERPRET_CONFIGS = {
    1: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1),
    16: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1),
    64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8),
    LARGE_M: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
}


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


@triton.jit
def _int8_to(w, DTYPE: tl.constexpr):
    """int8 tile -> DTYPE (fp16 or bf16), exact, without an I2F (quarter-rate) per element. bf16: triton's own cast
    is already the byte-permute sequence. fp16: triton 3.6 emits one I2F per element, so the magic number by hand:
    ``w ^ 0x80`` as a byte is ``w + 128``; under fp16's exponent of 1024 (0x6400, 10-bit mantissa) it is the float
    ``1024 + w + 128``, and one subtraction of 1152 leaves ``w`` (LOP3 + HADD2, two lanes per instruction)."""
    if DTYPE == tl.float16:  # compile-time branches, one return (triton 3.6 rejects typed early returns)
        out = ((w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
    else:
        out = w.to(DTYPE)
    return out


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
def int8_matmul_kernel(
    a_ptr, b_ptr, c_ptr,  # a int8 [M, K], b int8 [N, K], c [M, N] int32 (no epilogue) or fp32|fp16|bf16
    a_scale_ptr, b_scale_ptr, bias_ptr,  # fp32 [M], fp32 [N], float [N] (each used only when HAS_*)
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    M_CLASS,  # autotune key only: tune_bucket(M)
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


# ---------------------------------------------------------------------------------------------------------------
# w8a16_matmul: x [M, K] fp16|bf16 (fp32 accepted) @ (w int8 [N, K] * w_scale[N]).T + bias -> [M, N] in x's dtype.
# The weight tile is converted to x's dtype in registers (exact: |w| <= 128 fits fp16 and bf16); the per-channel
# scale factors out of the K sum, so it is applied once per output in the epilogue, not per weight.
# ---------------------------------------------------------------------------------------------------------------
@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def w8a16_matmul_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,  # x [M, K], w int8 [N, K], w_scale fp32 [N], bias [N]?, out [M, N]
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    M_CLASS,  # autotune key only: tune_bucket(M)
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 x, or the interpreter (which gets bf16 arithmetic wrong): an exact fp32 dot
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PACKED: tl.constexpr = False,  # w in the packed layout (int8_matmul_layout.py; BLOCK_K divides PACK_K)
    WHOLE_PACK: tl.constexpr = False,  # packed, N % PACK_ROWS == K % PACK_K == 0: constant strides (_packed_w_ptrs)
):
    rm, rn, rk, x_ptrs, w_ptrs = _tile_pointers(x_ptr, w_ptr, M, N, stride_xm, stride_xk, stride_wn, stride_wk,
                                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    n0 = tl.min(rn, axis=0)  # the tile's first row (packed only)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if PACKED:
            w_ptrs = _packed_w_ptrs(w_ptr, tl.where(rn < N, tl.arange(0, BLOCK_N), 0), n0, k * BLOCK_K, rk, N, K,
                                    WHOLE_PACK)
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
            acc = tl.dot(x, _int8_to(w, x.dtype), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out = acc * tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :].to(tl.int64) * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# ---------------------------------------------------------------------------------------------------------------
# w8a16 decode paths (M <= 16): GEMV (M <= 4) and split-K tensor-core tiles (5..16), one deterministic reduction.
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _finish_tile(acc, rm, rn, M, N, pid_k, part_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """A decode kernel's tile ``acc [BLOCK_M, BLOCK_N]`` fp32 for rows ``rm``, columns ``rn``: with SPLIT, the
    partial sum of split ``pid_k`` into ``part [SPLIT_K, M, N]``; without, scale, bias and the store to out."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        base = part_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        _epilogue_store(acc, rm[:, None], rn[None, :], mask, N, w_scale_ptr, bias_ptr, out_ptr, stride_om,
                        stride_on, HAS_BIAS)


@triton.jit
def _epilogue_store(acc, rows, cols, mask, N, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                    HAS_BIAS: tl.constexpr):
    """``out[rows, cols] = acc * w_scale[cols] + bias[cols]`` (fp32 math), masked; rows/cols broadcast to acc."""
    out = acc * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    o_ptrs = out_ptr + rows.to(tl.int64) * stride_om + cols.to(tl.int64) * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_partials(acc, p_ptrs, s0, M, N, COUNT: tl.constexpr):
    """``acc`` plus splits ``s0, s0 + 1, ..., s0 + COUNT - 1`` of ``part [SPLIT_K, M, N]`` at ``p_ptrs``, added in
    that order; the COUNT loads are independent of the sums (one basic block, no predicates): all issued first."""
    q = p_ptrs + tl.cast(s0, tl.int64) * M * N
    step = tl.cast(M * N, tl.int64)
    for u in tl.static_range(COUNT):
        acc = acc + tl.load(q, cache_modifier=".cg")
        q += step
    return acc


@triton.jit
def _reduce_splits(part_ptr, col0, M, N, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                   HAS_BIAS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """The last program's reduction of columns ``[col0, col0 + COLS)`` of every row: ``out = (sum over s = 0,
    1, ... of part[s]) * w_scale + bias``, the splits added one after another in split order, so the bits do not
    depend on which split finished first (and equal the two-launch reduce's). UNROLL splits per loop trip, fully
    unrolled into one basic block: their loads do not depend on the sums, so they are all issued before the first
    addition; the rest in blocks of UNROLL / 2, UNROLL / 4, ..., 1 behind uniform branches (28 splits, UNROLL 16:
    16 + 8 + 4, three L2 round trips). No per-split predicate: ptxas has 7 predicate registers, and 16 predicated
    additions made it issue the loads 4 at a time (offline sm_90 SASS). ``.cg``: the other programs' partials are
    read from L2, never from a line this SM's L1 might hold. BLOCK x UNROLL / threads <= 32 loads in flight per
    thread (:func:`reduce_shape`), under the GEMV's own register use."""
    SPLIT_K = tl.num_programs(1)
    for r0 in range(0, M * COLS, BLOCK):
        idx = r0 + tl.arange(0, BLOCK)
        rows = idx // COLS  # COLS is a power of two: a shift
        cols = col0 + idx % COLS
        mask = (rows < M) & (cols < N)
        # < 2^31: M <= 16 rows of N < 2^27 columns (checked on the host). Lanes past M / N read element 0 and splits
        # past the last read the last one (both valid, then discarded): unmasked loads, because ptxas serialises
        # masked ones on the few predicate registers (offline SASS: one load per addition, not UNROLL at once)
        p_ptrs = part_ptr + tl.where(mask, rows * N + cols, 0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        s0 = SPLIT_K * 0
        for _ in range(SPLIT_K // UNROLL):
            acc = _add_partials(acc, p_ptrs, s0, M, N, UNROLL)
            s0 += UNROLL
        for h in tl.static_range(1, 5):  # UNROLL <= 16: the remainder (< UNROLL splits) in power-of-two blocks
            if (UNROLL >> h) > 0:
                if SPLIT_K - s0 >= (UNROLL >> h):
                    acc = _add_partials(acc, p_ptrs, s0, M, N, UNROLL >> h)
                    s0 += UNROLL >> h
        _epilogue_store(acc, rows, cols, mask, N, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on, HAS_BIAS)


@triton.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2`` of the line holding each element of ``ptrs``: no data returned, no register held, no
    wait; the line is in L2 when a later load asks for it."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_weight(w_ptr, n0, k0, N, K, stride_wn, stride_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PACKED: tl.constexpr, WHOLE_PACK: tl.constexpr):
    """L2 prefetch of the weight tile ``[k0, k0 + BLOCK_K) x [n0, n0 + BLOCK_N)`` (BLOCK_K >= 128), one prefetch
    per 128 bytes of a row (a line when the row is contiguous: both layouts with K-contiguous rows), addresses
    clamped into the weight (rows past N to the tile's first, columns past K to K - 1): never outside it."""
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = k0 + tl.arange(0, BLOCK_K // 128) * 128
    rk = tl.where(rk < K, rk, K - 1)
    if PACKED:  # one K chunk per prefetch row: k0 is a multiple of BLOCK_K, which divides PACK_K
        jl = tl.where(rn < N, tl.arange(0, BLOCK_N), 0)
        ptrs = _packed_w_ptrs(w_ptr, jl, n0, k0, rk - k0, N, K, WHOLE_PACK)
    else:
        ln = tl.where(rn < N, rn, n0)
        ptrs = w_ptr + ln[None, :].to(tl.int64) * stride_wn + rk[:, None].to(tl.int64) * stride_wk
    _prefetch_l2(ptrs)


@triton.jit
def _pdl_start(w_ptr, n0, k0, N, K, stride_wn, stride_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               TILES: tl.constexpr, TILE_STEP: tl.constexpr, PACKED: tl.constexpr, WHOLE_PACK: tl.constexpr):
    """Programmatic dependent launch (sm_90, launched with ``launch_pdl=True``): this grid may start while the
    previous kernel of the stream still runs, so everything it reads from that kernel waits for ``gdc_wait``.
    Before it: only an L2 prefetch of the program's first TILES weight tiles (``[BLOCK_K, BLOCK_N]`` at ``k0``,
    ``k0 + TILE_STEP``, ... along K when TILE_STEP > 0, else along N: ``n0``, ``n0 + BLOCK_N``, ...). The weights
    are never written by a kernel upstream in the stream (quantize / load_state_dict finish long before a decode
    step), and even if one were, a prefetch returns no data: the real loads after the wait read L2, the point of
    coherence, where that kernel's stores are. After it: x (the previous kernel's output), and every write (out,
    the split-K workspace, the tickets): that kernel may still read a buffer the allocator handed us, or be our own
    previous launch on the same tickets. Every program waits (a grid that finishes is then ordered after its
    predecessors, transitively), then lets the next PDL launch start its own prologue: that launch can begin only
    once all of our programs are resident or done, so it never takes the slots our later waves need."""
    if K > 0:  # K = 0: an empty weight, nothing to prefetch (its pointer may be anything)
        if BLOCK_K >= 128:
            for t in tl.static_range(TILES):
                kt = k0 + t * TILE_STEP if TILE_STEP > 0 else k0
                nt = n0 if TILE_STEP > 0 else n0 + t * BLOCK_N
                if (kt < K) & (nt < N):  # tiles wholly past the weight's edge: none
                    _prefetch_weight(w_ptr, nt, kt, N, K, stride_wn, stride_wk, BLOCK_N, BLOCK_K, PACKED,
                                     WHOLE_PACK)
    pdl_enter(True)  # gdc_wait, then gdc_launch_dependents


@triton.jit
def _packed_w_ptrs(w_ptr, jl, n0, k, rk, N, K, WHOLE: tl.constexpr):
    """Pointers ``[BLOCK_K, len(jl)]`` into a packed weight (arkernels/ops/int8_matmul_layout.py) at rows ``n0 + jl``
    (``jl``: rows of the tile that starts at row ``n0``, a multiple of PACK_ROWS; all valid) and columns ``k + rk``
    (one K tile inside one PACK_K chunk: BLOCK_K divides PACK_K). int64 only in the tile's base ``n0 * K``; the rest
    is < BLOCK_N x K. Every term of a row's offset is a multiple of 16 (K is one), so the loads along K are 16-byte
    vectors; the row terms depend on ``jl`` alone, so a loop over tiles with the same ``jl`` can hoist them.
    WHOLE: every row group and K chunk is full (N % PACK_ROWS == K % PACK_K == 0), so the in-group strides are
    constants, not min() of the shape (docs/kernels.md: the SASS either way)."""
    k = tl.cast(k, tl.int32)  # a tensor also when the caller's loop variable is a Python int (the interpreter)
    cs = k - k % PACK_K
    g = jl - jl % PACK_ROWS  # the row's group, from the tile's first row
    if WHOLE:
        row_off = g * K + (jl - g) * PACK_K + (cs * PACK_ROWS + (k - cs))
    else:
        kw = tl.minimum(K - cs, PACK_K)
        row_off = g * K + cs * tl.minimum(N - n0 - g, PACK_ROWS) + (jl - g) * kw + (k - cs)
    return (w_ptr + n0.to(tl.int64) * K) + tl.multiple_of(row_off, 16)[None, :] + rk[:, None]


@triton.jit
def _gemv_load(x_ptr, w_ptr, rm, rk, M, K, stride_xm, stride_xk, stride_wk, EVEN_K: tl.constexpr):
    """x rows ``rm`` (past M: zeros, never read) at K lanes ``rk`` -> ``[BLOCK_M, BLOCK_K]``, and the K-lane offsets
    of the weight (``[BLOCK_K, 1]``: the tile is read K-major, as a dot's B operand)."""
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :].to(tl.int64) * stride_xk
    if EVEN_K:
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
    else:
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
    return x, w_ptr + rk[:, None].to(tl.int64) * stride_wk


@triton.jit
def _gemv_step(acc, x, w_k, w_ptr, ln, n0, k, rk, N, K, stride_wn, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
               PACKED: tl.constexpr, WHOLE_PACK: tl.constexpr):
    """``acc [16, BLOCK_N] += x [16, BLOCK_K] @ w[ln, k + rk].T`` for one weight tile ``[BLOCK_K, BLOCK_N]`` (``w_k``:
    the plain layout's K-lane pointers; packed: from ``w_ptr``, rows ``ln`` of the tile at ``n0``)."""
    if PACKED:
        w_ptrs = _packed_w_ptrs(w_ptr, ln, n0, k, tl.arange(0, rk.shape[0]), N, K, WHOLE_PACK)
    else:
        w_ptrs = w_k + ln[None, :].to(tl.int64) * stride_wn
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=rk[:, None] < K, other=0)
    if DOT_FP32:
        acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, _int8_to(w, x.dtype), acc)
    return acc


@triton.jit(do_not_specialize=["epoch"])  # a new value every launch: never a new specialization
def w8a16_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr,  # as w8a16_matmul_kernel; part fp32 [SPLIT_K, M, N]
    ticket_ptr, epoch,  # int64 [>= grid dim 0] tickets, this launch's epoch (FUSED only: see tickets.last_program)
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,  # SPLIT: K > K_HALVES * BLOCK_K, partial sums to part_ptr
    FUSED: tl.constexpr,  # with SPLIT: the last program of each column group reduces (else a second launch)
    REDUCE_BLOCK: tl.constexpr, REDUCE_UNROLL: tl.constexpr,  # the fused reduce's shape (reduce_shape)
    EVEN_K: tl.constexpr,  # K_HALVES * BLOCK_K divides K: no K masks
    DOT_FP32: tl.constexpr,  # fp32 x, or the interpreter (bf16 arithmetic is wrong there): the dot in fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_TILES: tl.constexpr,
    K_HALVES: tl.constexpr,  # 1 or 2 x slices of BLOCK_K per program: 2 halves the split workspace
    PACKED: tl.constexpr = False,  # w in the packed layout (int8_matmul_layout.py; K_HALVES x BLOCK_K <= PACK_K)
    WHOLE_PACK: tl.constexpr = False,  # packed, N % PACK_ROWS == K % PACK_K == 0: constant strides (_packed_w_ptrs)
    N_EDGE: tl.constexpr = True,  # some tile has columns past N (False: N_TILES x BLOCK_N divides N, no clamp)
    PDL: tl.constexpr = False,  # launched with launch_pdl (sm_90 only; never under the interpreter): _pdl_start
):
    """Grid ``(cdiv(N, BLOCK_N * N_TILES), cdiv(K, K_HALVES * BLOCK_K))``: program (i, s) holds the x slice of
    split s in registers and computes columns ``[i * N_TILES * BLOCK_N, (i + 1) * N_TILES * BLOCK_N)`` of it, one
    ``[K_HALVES * BLOCK_K, BLOCK_N]`` weight tile at a time."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:  # the program's N_TILES weight tiles prefetched, then the wait: x only after it
        _pdl_start(w_ptr, pid_n * (N_TILES * BLOCK_N), pid_k * (K_HALVES * BLOCK_K), N, K, stride_wn, stride_wk,
                   BLOCK_N, K_HALVES * BLOCK_K, N_TILES, 0, PACKED, WHOLE_PACK)
    rm = tl.arange(0, BLOCK_M)
    rk0 = pid_k * (K_HALVES * BLOCK_K) + tl.arange(0, BLOCK_K)
    rk1 = rk0 + BLOCK_K
    x0, w_k0 = _gemv_load(x_ptr, w_ptr, rm, rk0, M, K, stride_xm, stride_xk, stride_wk, EVEN_K)
    x1, w_k1 = _gemv_load(x_ptr, w_ptr, rm, rk1 if K_HALVES == 2 else rk0, M, K, stride_xm, stride_xk, stride_wk,
                          EVEN_K)  # K_HALVES 1: an unused copy of the first half, compiled out
    if DOT_FP32:
        x0 = x0.to(tl.float32)
        x1 = x1.to(tl.float32)
    k0 = pid_k * (K_HALVES * BLOCK_K)
    for t in range(N_TILES):  # software-pipelined (num_stages): every tile's weight is a cp.async in flight at once
        n0 = (pid_n * N_TILES + t) * BLOCK_N
        rn = n0 + tl.arange(0, BLOCK_N)
        ln = tl.where(rn < N, rn, 0)  # past-the-edge columns read column 0 (valid), masked at the store
        if PACKED:  # tile-local rows (past N: the tile's first), the same every tile when N is whole tiles
            ln = tl.where(rn < N, tl.arange(0, BLOCK_N), 0) if N_EDGE else tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _gemv_step(acc, x0, w_k0, w_ptr, ln, n0, k0, rk0, N, K, stride_wn, EVEN_K, DOT_FP32, PACKED,
                         WHOLE_PACK)
        if K_HALVES == 2:
            acc = _gemv_step(acc, x1, w_k1, w_ptr, ln, n0, k0 + BLOCK_K, rk1, N, K, stride_wn, EVEN_K, DOT_FP32,
                             PACKED, WHOLE_PACK)
        _finish_tile(acc, rm, rn, M, N, pid_k, part_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                     HAS_BIAS, SPLIT)
    if SPLIT and FUSED:
        if last_program(ticket_ptr + pid_n, epoch):
            _reduce_splits(part_ptr, pid_n * (N_TILES * BLOCK_N), M, N, w_scale_ptr, bias_ptr, out_ptr, stride_om,
                           stride_on, HAS_BIAS, N_TILES * BLOCK_N, REDUCE_BLOCK, REDUCE_UNROLL)


@triton.jit(do_not_specialize=["epoch"])
def w8a16_splitk_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, epoch,  # as w8a16_gemv_kernel
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    K_PER_SPLIT,  # a multiple of BLOCK_K: splits start on K-tile boundaries, only the last tile of K is partial
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, EVEN_K: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr, REDUCE_UNROLL: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the interpreter (bf16 arithmetic is wrong there): an fp32 dot
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_TILES: tl.constexpr,
    PACKED: tl.constexpr = False,  # w in the packed layout (int8_matmul_layout.py; BLOCK_K divides PACK_K)
    WHOLE_PACK: tl.constexpr = False,  # packed, N % PACK_ROWS == K % PACK_K == 0: constant strides (_packed_w_ptrs)
    PDL: tl.constexpr = False,  # launched with launch_pdl (sm_90 only; never under the interpreter): _pdl_start
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(K, K_PER_SPLIT))``: program (i, s) multiplies the (at most 16) rows of x by
    N tile i over K range s on the tensor cores. Rows past M are masked (zeros), not clamped: no duplicate reads."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ln = tl.where(rn < N, tl.arange(0, BLOCK_N), 0)
    k0 = pid_k * K_PER_SPLIT
    if PDL:  # the first 2 K tiles of the split prefetched (the prologue's stages), then the wait: x only after it
        _pdl_start(w_ptr, pid_n * BLOCK_N, k0, N, K, stride_wn, stride_wk, BLOCK_N, BLOCK_K, 2, BLOCK_K, PACKED,
                   WHOLE_PACK)
    x_ptrs = x_ptr + k0.to(tl.int64) * stride_xk + (rm[:, None] * stride_xm + rk[None, :] * stride_xk)
    w_ptrs = (w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn + k0.to(tl.int64) * stride_wk) + (
        ln[None, :] * stride_wn + rk[:, None] * stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k0, tl.minimum(k0 + K_PER_SPLIT, K), BLOCK_K):
        if PACKED:
            w_ptrs = _packed_w_ptrs(w_ptr, ln, pid_n * BLOCK_N, k, rk, N, K, WHOLE_PACK)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < K - k), other=0.0)
            w = tl.load(w_ptrs, mask=rk[:, None] < K - k, other=0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, _int8_to(w, x.dtype), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    _finish_tile(acc, rm, rn, M, N, pid_k, part_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                 HAS_BIAS, SPLIT)
    if SPLIT and FUSED:
        if last_program(ticket_ptr + pid_n, epoch):
            _reduce_splits(part_ptr, pid_n * BLOCK_N, M, N, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                           HAS_BIAS, BLOCK_N, REDUCE_BLOCK, REDUCE_UNROLL)


@triton.jit
def splitk_reduce_kernel(
    part_ptr, w_scale_ptr, bias_ptr, out_ptr,  # part fp32 [SPLIT_K, M, N], w_scale fp32 [N], bias [N]?, out [M, N]
    M, N, SPLIT_K, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid ``(M, cdiv(N, BLOCK_N))``: ``out[m, n] = (sum over s in order of part[s, m, n]) * w_scale[n] +
    bias[n]``. The fixed order makes the result independent of which split finished first."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rn < N
    p_ptrs = part_ptr + m.to(tl.int64) * N + rn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for _ in range(SPLIT_K):
        acc += tl.load(p_ptrs, mask=mask, other=0.0)
        p_ptrs += M * N  # < 2^31: M <= 16
    out = acc * tl.load(w_scale_ptr + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rn.to(tl.int64) * stride_on, out.to(out_ptr.dtype.element_ty),
             mask=mask)
