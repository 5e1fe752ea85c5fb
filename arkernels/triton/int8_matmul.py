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
- M <= 4: ``_w8a16_gemv_kernel``. A program owns one BLOCK_K slice of K (its split) and keeps the activation
  rows of that slice in registers (``[16, 512]`` bf16 as two dot operands: 32 registers per thread, rows past M
  zero and never read) while it streams N_TILES weight tiles of ``[512, 32]`` past them through the tensor cores:
  x is read once per N_TILES tiles, not once per tile. The K reduction on the tensor cores matters: the sm_90
  SASS of an fp32 FMA + shuffle-reduction version of this loop had 9.7 instructions per weight at M = 1 and 21.7
  at M = 4, past the ~7.7 an SM can issue per weight byte at 4.3 TB/s (128 lanes/clk / 16.5 B/clk).
- 5 <= M <= 16: ``_w8a16_splitk_kernel``, a tensor-core tile of 16 rows over a K range of K_PER_SPLIT.
- Grids (:func:`w8a16_decode_config`): a pure function of (path, M, N, K, SM count), never autotuned (the bits do
  not depend on which config a sweep picked; decode never sweeps), planned for whole waves of PROGRAMS_PER_SM
  programs per SM (4 GEMV, 2 split-K): among the N_TILES (GEMV) or split counts (split-K) the shape allows, the
  fewest programs within WAVE_SLACK of the best wave efficiency. M = 1 at 4096x14336 on 132 SMs: 3584 programs,
  6.8 waves of 528, 0.97 busy (the previous 896 programs were 1.7 waves, 0.85). Split-K keeps its workspace under
  10% of the weight bytes (K = 4096 at M = 16: 3 splits).
- Split-K reduction, fused (``reduce="fused"``, the default): partial fp32 sums go to a ``[SPLIT_K, M, N]``
  workspace; each program then takes a ticket for its output tile (:func:`_is_last_split`: an int64 atomic tagged
  with a per-launch epoch, so an aborted launch cannot poison later ones) and the last of the tile's SPLIT_K
  programs adds the partials in split order (0, 1, ...; up to 16 splits' loads in flight at once), then applies
  scale and bias (:func:`_reduce_splits`): one launch instead of two, and the same bits whichever split finishes
  first. ``reduce="launch"`` keeps the previous two-launch path (``_splitk_reduce_kernel``, the same order, the
  same bits) as the benchmark's baseline. With one split the matmul kernel applies the epilogue itself and no
  workspace or ticket exists. Offline sm_90 compile (triton 3.8, ``triton.compile`` of an ``ASTSource``, then
  ``cuobjdump``; tests/test_int8_matmul.py): GEMV fused 64 registers, 24 KB shared, split-K fused 69 registers,
  36 KB, no local memory; 13 of the GEMV reduce's 16 partial loads issue before its first addition.
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
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

QMAX: tl.constexpr = tl.constexpr(127.0)  # symmetric: the quantizers produce [-127, 127] (constexpr: a kernel global)
LARGE_M = 1 << 30  # the M class "larger than 64"
ONE_PASS_MAX_K = 16384  # rows up to this length stay in registers: one read of x instead of two


TUNE_MAX_M = 8192  # the last power-of-two tuning bucket of M; anything larger shares LARGE_M


def m_class(M: int) -> int:
    """Config family of M: 1, 16 (<= 16), 64 (<= 64) or LARGE_M. Which configs a bucket may try."""
    for bound in (1, 16, 64):
        if M <= bound:
            return bound
    return LARGE_M


def tune_bucket(M: int) -> int:
    """Autotune bucket of M (the value of the kernels' M_CLASS key): 1, 16 for 2..16 (decode batch sizes share one
    sweep), the next power of two for 17..8192, LARGE_M above."""
    if M <= 16:
        return m_class(M)
    return triton.next_power_of_2(M) if M <= TUNE_MAX_M else LARGE_M


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
    # deep-K tall/wide tiles for the M >= 256 buckets (48 KB of int8 operands per stage: 144 / 192 KB of 227)
    (256, 128, 128, 8, 3), (128, 256, 128, 8, 4),
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


def configs_for(bucket: int, dot_fp32: bool = False) -> list:
    """The configs a tuning bucket tries: its family's, less the tiles taller than the bucket (the family's
    first is always kept: BLOCK_M 16, 32 or 64 <= the smallest bucket of that family, checked by the tests)."""
    family = (FP32_DOT_CONFIGS_BY_CLASS if dot_fp32 else CONFIGS_BY_CLASS)[m_class(bucket)]
    return [c for c in family if c.kwargs["BLOCK_M"] <= max(bucket, 16)]


SMEM_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block


def smem_bytes(config, a_bytes: int) -> int:
    """Pipelined operand tiles of a config: num_stages x (A tile at ``a_bytes`` per element + int8 B tile). It
    separates the configs triton 3.6 fits into sm_90's 227 KB from those it does not (offline compile: w8a16 bf16
    256x128x128 x3 stages needs 256 KB, 128x256x128 x4 288 KB; both fit at int8, 144 / 192 KB)."""
    kw = config.kwargs
    return config.num_stages * kw["BLOCK_K"] * (kw["BLOCK_M"] * a_bytes + kw["BLOCK_N"])


def _prune_by_class(configs, named_args, **kwargs):
    bucket = named_args.get("M_CLASS", kwargs.get("M_CLASS"))
    ids = {id(c) for c in configs_for(bucket, kwargs.get("DOT_FP32", False))}
    a = named_args.get("x_ptr", named_args.get("a_ptr"))  # bf16 x doubles the A tile of the w8a16 kernel
    a_bytes = a.element_size() if isinstance(a, torch.Tensor) else 1
    return [c for c in configs if id(c) in ids and smem_bytes(c, a_bytes) <= SMEM_LIMIT]


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
def _int8_matmul_kernel(
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


_int8_matmul_tuned = triton.autotune(configs=_ALL_CONFIGS, key=["M_CLASS", "N", "K"],
                                     prune_configs_by={"early_config_prune": _prune_by_class})(_int8_matmul_kernel)


def _grid(M, N):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


# The config each autotuned shape settled on, keyed as the autotuner keys it (M bucket, N, K, the tensors' dtypes)
# plus the kernel and its flags: what a launch during a CUDA-graph capture runs.
_TUNED: dict = {}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _config_dict(config) -> dict:
    return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _launch(tuned, kernel, M, N, K, args, flags, config):
    """Launch ``kernel`` for an ``[M, N]`` output: with ``config``, or the autotuner's choice. Never a sweep
    during a CUDA-graph capture: its benchmarking launches and synchronisations would invalidate the capture, so
    a capture runs the config the same shape settled on outside it (tune ahead by running the shape once first,
    as a warm-up before capture does), else the bucket's first config, as ``ARKERNELS_AUTOTUNE=0`` would."""
    bucket = tune_bucket(M)
    key = (id(tuned), bucket, N, K, tuple(str(a.dtype) for a in args if hasattr(a, "dtype")),
           tuple(sorted(flags.items())))
    if config is None and autotuning():
        if not _capturing():
            tuned[_grid(M, N)](*args, bucket, **flags)
            _TUNED[key] = tuned.best_config
            return
        config = _TUNED.get(key)
        config = None if config is None else _config_dict(config)
    if config is not None:
        cfg = dict(config)
    elif interpreting():
        cfg = dict(INTERPRET_CONFIGS[m_class(M)])
    else:  # ARKERNELS_AUTOTUNE=0 or an untuned shape under capture: the bucket's first config, as the autotuner
        cfg = _config_dict(configs_for(bucket, flags.get("DOT_FP32", False))[0])  # would have pruned them
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
    kernel[_grid(M, N)(cfg)](*args, bucket, **flags, **cfg, **launch)


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
    _launch(_int8_matmul_tuned, _int8_matmul_kernel, M, N, K, args, flags, config)
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
    M_CLASS,  # autotune key only: tune_bucket(M)
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
            acc = tl.dot(x, _int8_to(w, x.dtype), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out = acc * tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :].to(tl.int64) * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


_w8a16_matmul_tuned = triton.autotune(configs=_ALL_CONFIGS + _FP32_SMALL_M + _FP32_LARGER_M, key=["M_CLASS", "N", "K"],
                                      prune_configs_by={"early_config_prune": _prune_by_class})(_w8a16_matmul_kernel)


def w8a16_matmul_triton(x, w, w_scale, bias=None, *, config=None, path=None, reduce="fused"):
    """x ``[M, K]`` fp16|bf16|fp32, w int8 ``[N, K]``, w_scale fp32 ``[N]``, bias ``[N]``? (checked by the caller)
    -> ``[M, N]`` in x's dtype. The kernel follows M (:func:`w8a16_path`); ``path`` forces one of "gemv",
    "splitk", "tiled". ``config``: a decode kernel's sizes (:func:`w8a16_decode_config`'s keys) with
    ``path="gemv"`` / ``"splitk"``; without a path, the tiled kernel's tile sizes as for
    :func:`int8_matmul_triton` (that kernel at any M). ``reduce``: how a decode path adds its K splits,
    ``"fused"`` (the last program of each tile, one launch) or ``"launch"`` (a second kernel; the benchmark's
    baseline); both add in split order and give the same bits."""
    if reduce not in REDUCES:
        raise ValueError(f"w8a16_matmul: reduce must be one of {REDUCES}, got {reduce!r}")
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    w_scale = w_scale.contiguous()  # read at unit stride, as are the bias and the scales of int8_matmul
    bias = None if bias is None else bias.contiguous()
    if path is None:
        path = "tiled" if config is not None else w8a16_path(M, x.dtype)
    dot_fp32 = x.dtype == torch.float32 or interpreting()
    if path != "tiled":
        _w8a16_decode(path, x, w, w_scale, bias, out, dot_fp32, config, reduce)
        return out
    args = (x, w, w_scale, w_scale if bias is None else bias, out, M, N, K, x.stride(0), x.stride(1),
            w.stride(0), w.stride(1), out.stride(0), out.stride(1))
    flags = dict(HAS_BIAS=bias is not None, DOT_FP32=dot_fp32)
    _launch(_w8a16_matmul_tuned, _w8a16_matmul_kernel, M, N, K, args, flags, config)
    return out


# ---------------------------------------------------------------------------------------------------------------
# w8a16 decode paths (M <= 16): GEMV (M <= 4) and split-K tensor-core tiles (5..16), one deterministic reduction.
# ---------------------------------------------------------------------------------------------------------------
GEMV_MAX_M = 4  # x rows held in registers across N tiles (GEMV) up to here; more rows: split-K's K loop
DECODE_MAX_M = 16  # the decode paths' limit: one 16-row tile (mma's smallest M), the weight read once
# Programs per SM that a wave is planned with (enough that every SM keeps ~23 KB of loads in flight). Below the
# occupancy limit: the offline sm_90 compile (triton 3.8) gives 24 KB / 36 KB of shared memory per GEMV / split-K
# program, so 8 / 6 fit an SM; by that count the M = 1 4096x14336 plan is 3.4 waves. Which unit the hardware's
# tail actually follows is for a GPU measurement to decide (one constant per path here).
PROGRAMS_PER_SM = {"gemv": 4, "splitk": 2}
WAVE_SLACK = 0.05  # plans within this much wave efficiency of the best one count as equal: the fewest programs wins
REDUCE_BLOCK_N = 1024  # the two-launch path's reduce kernel: columns per program
REDUCE_LOADS_PER_THREAD = 32  # the fused reduce's partial loads in flight per thread (registers: the GEMV uses ~56)
REDUCES = ("fused", "launch")  # the split-K reduction: by the last program of each tile, or a second launch
EPOCH_MAX = (1 << 31) - 1  # ticket epochs cycle in [1, EPOCH_MAX]: an int32 kernel argument, a 64-bit ticket tag


def weight_unaligned_reason(w: torch.Tensor) -> str | None:
    """Why the int8 weight ``w [N, K]`` misses the kernels' 16-byte vector loads along K, or None. Triton
    specializes pointers and integer arguments on divisibility by 16 and strides equal to 1: an aligned,
    K-contiguous weight whose rows are a multiple of 16 bytes gets those hints (and 16-byte loads) with nothing
    more; any other view compiles to byte loads, about 4x slower for a memory-bound decode."""
    if w.shape[0] > 1 and w.stride(1) != 1:
        return f"not K-contiguous (strides {tuple(w.stride())})"
    if w.stride(0) % 16 or w.shape[1] % 16:
        return f"rows of {w.shape[1]} bytes at a stride of {w.stride(0)}: not multiples of 16"
    if w.data_ptr() % 16:
        return f"its data starts {w.data_ptr() % 16} bytes past a 16-byte boundary"
    return None


def w8a16_path(M: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which w8a16 kernel serves M rows: ``"gemv"`` (M <= 4), ``"splitk"`` (5..16) or ``"tiled"`` (the autotuned
    tile kernel; always for fp32 x, which has no tensor-core dot: its own shallow-K FMA tiles compile without
    spills, the decode kernels' fp32 dots would not be). A pure function of a shape: no host sync."""
    if dtype == torch.float32 or M > DECODE_MAX_M:
        return "tiled"
    return "gemv" if M <= GEMV_MAX_M else "splitk"


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: as few, large programs as possible (~0.5 ms per program instance)
    return torch.cuda.get_device_properties(device).multi_processor_count


def reduce_shape(M: int, cols: int, split_k: int, num_warps: int = 4) -> tuple[int, int]:
    """(BLOCK, UNROLL) of the fused reduce over ``M x cols`` outputs and ``split_k`` splits: as many splits per
    trip as exist (up to 16, a power of two), then as many outputs per step as keep REDUCE_LOADS_PER_THREAD loads
    in flight per thread. M = 1, 28 splits of 32 columns: (32, 16), 2 trips; M = 16, 4 splits of 64: (1024, 4)."""
    unroll = min(16, triton.next_power_of_2(max(split_k, 1)))
    threads = 32 * num_warps
    block = min(triton.next_power_of_2(M * cols), max(threads, threads * REDUCE_LOADS_PER_THREAD // unroll))
    return block, unroll


def wave_efficiency(programs: int, wave: int) -> float:
    """Busy fraction of the program slots over the waves a grid occupies: ``programs / (waves * wave)``; 1.0 when
    the grid is a whole number of waves (896 programs on a wave of 528: 0.85, the second wave 70% idle)."""
    return programs / (triton.cdiv(programs, wave) * wave)


def _fewest_programs_near_best(candidates: list[tuple[int, dict]], wave: int) -> dict:
    """``candidates``: (programs, config). The config with the fewest programs among those whose wave efficiency
    is within WAVE_SLACK of the best (fewer programs: more x reuse, fewer partial sums, fewer tickets)."""
    best = max(wave_efficiency(p, wave) for p, _ in candidates)
    near = [(p, i) for i, (p, _) in enumerate(candidates) if wave_efficiency(p, wave) >= best - WAVE_SLACK]
    return candidates[min(near)[1]][1]


def w8a16_decode_config(path: str, M: int, N: int, K: int, num_sms: int) -> dict:
    """Tile sizes and split of a decode kernel, a pure function of (path, M, N, K, SM count): no autotuning and
    no device query, so the bits do not depend on a sweep and the plan is testable without a GPU.

    gemv: weight tiles of 2 x 256 (K) by 32 (N) (16 KB, two dots sharing an accumulator); SPLIT_K = cdiv(K, 512);
    N_TILES (weight tiles per program, sharing its x slice) is the power of two up to 16 whose grid fills whole
    waves of PROGRAMS_PER_SM x SMs best (within WAVE_SLACK, then the fewest programs). BLOCK_M 16 (the dot's
    smallest; rows past M are never read). 32 x 256 rather than 16 x 512 per dot: 274 instead of 539 sm_90 loop
    instructions per 8 KB of weights (offline SASS, triton 3.6; split-K: 272). Llama-8B on 132 SMs (waves of 528):
    4096x14336 (N x K) -> 28 splits x 128 programs = 3584 (6.8 waves, 0.97 busy; the old N_TILES 4 gave 896 =
    1.7 waves, 0.85), 14336x4096 -> 8 x 448 = 3584, 4096x4096 -> 8 x 64 = 512 (0.97). The workspace is 1.6%
    (M = 1) to 6.2% (M = 4) of the weight bytes.
    splitk: 16 x 64 x 128 tensor-core tiles, 4 stages; SPLIT_K the count, up to the K tiles, whose grid of
    cdiv(N, 64) x SPLIT_K fills whole waves of 2 x SMs best, unless the workspace would pass 10% of the weight
    bytes (K = 4096 at M = 16: 3 splits, 192 programs).
    """
    if path == "gemv":
        block_k = max(32, min(256, triton.next_power_of_2(K)))
        halves = 2 if K > block_k else 1
        block_n = max(16, min(32, triton.next_power_of_2(N)))
        n_blocks = triton.cdiv(N, block_n)
        split_k = max(1, triton.cdiv(K, halves * block_k))  # K = 0: one split of nothing
        wave = PROGRAMS_PER_SM["gemv"] * num_sms
        candidates = [(triton.cdiv(n_blocks, t) * split_k, t) for t in (1, 2, 4, 8, 16)
                      if t == 1 or t < 2 * n_blocks]  # no tile group wider than twice the columns
        n_tiles = _fewest_programs_near_best([(p, t) for p, t in candidates], wave)
        return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, N_TILES=n_tiles, K_HALVES=halves,
                    K_PER_SPLIT=halves * block_k, num_warps=4, num_stages=2)
    block_k = max(16, min(128, triton.next_power_of_2(K)))
    block_n = 64
    k_blocks = max(1, triton.cdiv(K, block_k))
    # the workspace (written, then read: 2 x splits x M x N x 4 B) stays under 10% of the weight bytes N x K; this
    # binds for K = 4096 at M = 16 (3 splits: 192 programs)
    max_splits = max(1, min(k_blocks, K // (80 * M)))
    n_cols = triton.cdiv(N, block_n)
    plans = {}  # K_PER_SPLIT -> programs (several split counts round to the same K range)
    for s in range(1, max_splits + 1):
        k_per_split = triton.cdiv(k_blocks, s) * block_k
        plans[k_per_split] = n_cols * triton.cdiv(K, k_per_split) if K > 0 else n_cols
    k_per_split = _fewest_programs_near_best([(p, kps) for kps, p in plans.items()],
                                             PROGRAMS_PER_SM["splitk"] * num_sms)
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, N_TILES=1, K_PER_SPLIT=k_per_split, num_warps=4,
                num_stages=4)


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
def _is_last_split(ticket_ptr, epoch):
    """Take this program's ticket for its output tile; True for the program that arrives last of the
    ``num_programs(1)`` splits, which then owns the reduction. The ticket is left reset for the next launch.

    A ticket is an int64 ``(tag << 32) | count``: ``count`` programs of the launch whose epoch is ``tag`` have
    arrived. The host passes every launch a new epoch (1, 2, ..., EPOCH_MAX, then 1 again), and a program that
    finds another tag (the reset value 0, or what an aborted launch left: some of its programs never arrived, so
    its last program never reset the ticket) claims the ticket for its own epoch with a compare-and-swap that
    discards the stale count. Stale state therefore never shifts a later launch's count, and no launch has to
    succeed for the next one to be right (a plain counter reset by the kernel itself stays poisoned forever after
    one aborted launch). The last program still resets the ticket to 0: a CUDA graph replays a captured launch
    with its captured epoch, so the next replay must find a count of 0, not the count it left. What a reset cannot
    cover: an aborted replay followed by a replay of the same captured launch with no other launch on the ticket
    between them (any other w8a16 decode call of the stream in between re-tags it).

    Cost: one atomic round trip (an add) for every program that finds its own tag; the first of a launch adds a
    compare-and-swap (two on contention). Ordering: the barrier puts every thread's partial-sum stores before the
    release of the single-thread atomic (the threadfence-reduction idiom); its acquire orders the last program's
    loads of the other splits' partials after their releases.
    """
    tl.debug_barrier()
    old = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    mine = old + 1
    claimed = (old >> 32) == epoch
    seen = mine
    while not claimed:  # first arrival of this epoch (or racing another first arrival): claim the tag
        want = tl.where((seen >> 32) == epoch, seen + 1, (epoch.to(tl.int64) << 32) + 1)
        got = tl.atomic_cas(ticket_ptr, seen, want, sem="acq_rel", scope="gpu")
        claimed = got == seen
        mine = want
        seen = got
    last = (mine & 0xFFFFFFFF) == tl.num_programs(1)
    if last:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _load_partial(p_ptrs, s, SPLIT_K, M, N):
    """Split ``s``'s partial sums at ``p_ptrs`` (offsets into ``part [SPLIT_K, M, N]``); past the last split, the
    last split's (a valid address, discarded by the caller)."""
    s = tl.minimum(s, SPLIT_K - 1)
    return tl.load(p_ptrs + tl.cast(s, tl.int64) * M * N, cache_modifier=".cg")


@triton.jit
def _reduce_splits(part_ptr, col0, M, N, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                   HAS_BIAS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """The last program's reduction of columns ``[col0, col0 + COLS)`` of every row: ``out = (sum over s = 0,
    1, ... of part[s]) * w_scale + bias``, the splits added one after another in split order, so the bits do not
    depend on which split finished first (and equal the two-launch reduce's). UNROLL splits per loop trip, fully
    unrolled into one basic block: their loads do not depend on the sums, so they are all issued before the first
    addition (one L2 round trip per UNROLL splits: 2 for the 28 splits of K = 14336); ``.cg``: the other programs'
    partials are read from L2, never from a line this SM's L1 might hold. BLOCK x UNROLL / threads <= 32 loads in
    flight per thread (:func:`reduce_shape`), under the GEMV's own register use."""
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
        for s0 in range(0, SPLIT_K, UNROLL):
            for u in tl.static_range(UNROLL):
                # no + 0.0 past the last split (a -0.0 sum stays -0.0, as in the two-launch reduce)
                acc = tl.where(s0 + u < SPLIT_K, acc + _load_partial(p_ptrs, s0 + u, SPLIT_K, M, N), acc)
        _epilogue_store(acc, rows, cols, mask, N, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on, HAS_BIAS)


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
def _gemv_step(acc, x, w_k, ln, rk, K, stride_wn, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """``acc [16, BLOCK_N] += x [16, BLOCK_K] @ w[ln, rk].T`` for one weight tile ``[BLOCK_K, BLOCK_N]``."""
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
def _w8a16_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr,  # as _w8a16_matmul_kernel; part fp32 [SPLIT_K, M, N]
    ticket_ptr, epoch,  # int64 [>= grid dim 0] tickets, this launch's epoch (FUSED only: see _is_last_split)
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,  # SPLIT: K > K_HALVES * BLOCK_K, partial sums to part_ptr
    FUSED: tl.constexpr,  # with SPLIT: the last program of each column group reduces (else a second launch)
    REDUCE_BLOCK: tl.constexpr, REDUCE_UNROLL: tl.constexpr,  # the fused reduce's shape (reduce_shape)
    EVEN_K: tl.constexpr,  # K_HALVES * BLOCK_K divides K: no K masks
    DOT_FP32: tl.constexpr,  # fp32 x, or the interpreter (bf16 arithmetic is wrong there): the dot in fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_TILES: tl.constexpr,
    K_HALVES: tl.constexpr,  # 1 or 2 x slices of BLOCK_K per program: 2 halves the split workspace
):
    """Grid ``(cdiv(N, BLOCK_N * N_TILES), cdiv(K, K_HALVES * BLOCK_K))``: program (i, s) holds the x slice of
    split s in registers and computes columns ``[i * N_TILES * BLOCK_N, (i + 1) * N_TILES * BLOCK_N)`` of it, one
    ``[K_HALVES * BLOCK_K, BLOCK_N]`` weight tile at a time."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rk0 = pid_k * (K_HALVES * BLOCK_K) + tl.arange(0, BLOCK_K)
    rk1 = rk0 + BLOCK_K
    x0, w_k0 = _gemv_load(x_ptr, w_ptr, rm, rk0, M, K, stride_xm, stride_xk, stride_wk, EVEN_K)
    x1, w_k1 = _gemv_load(x_ptr, w_ptr, rm, rk1 if K_HALVES == 2 else rk0, M, K, stride_xm, stride_xk, stride_wk,
                          EVEN_K)  # K_HALVES 1: an unused copy of the first half, compiled out
    if DOT_FP32:
        x0 = x0.to(tl.float32)
        x1 = x1.to(tl.float32)
    for t in range(N_TILES):
        rn = (pid_n * N_TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        ln = tl.where(rn < N, rn, 0)  # past-the-edge columns read column 0 (valid), masked at the store
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _gemv_step(acc, x0, w_k0, ln, rk0, K, stride_wn, EVEN_K, DOT_FP32)
        if K_HALVES == 2:
            acc = _gemv_step(acc, x1, w_k1, ln, rk1, K, stride_wn, EVEN_K, DOT_FP32)
        _finish_tile(acc, rm, rn, M, N, pid_k, part_ptr, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                     HAS_BIAS, SPLIT)
    if SPLIT and FUSED:
        if _is_last_split(ticket_ptr + pid_n, epoch):
            _reduce_splits(part_ptr, pid_n * (N_TILES * BLOCK_N), M, N, w_scale_ptr, bias_ptr, out_ptr, stride_om,
                           stride_on, HAS_BIAS, N_TILES * BLOCK_N, REDUCE_BLOCK, REDUCE_UNROLL)


@triton.jit(do_not_specialize=["epoch"])
def _w8a16_splitk_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, epoch,  # as _w8a16_gemv_kernel
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    K_PER_SPLIT,  # a multiple of BLOCK_K: splits start on K-tile boundaries, only the last tile of K is partial
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, EVEN_K: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr, REDUCE_UNROLL: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the interpreter (bf16 arithmetic is wrong there): an fp32 dot
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_TILES: tl.constexpr,
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
    x_ptrs = x_ptr + k0.to(tl.int64) * stride_xk + (rm[:, None] * stride_xm + rk[None, :] * stride_xk)
    w_ptrs = (w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn + k0.to(tl.int64) * stride_wk) + (
        ln[None, :] * stride_wn + rk[:, None] * stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k0, tl.minimum(k0 + K_PER_SPLIT, K), BLOCK_K):
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
        if _is_last_split(ticket_ptr + pid_n, epoch):
            _reduce_splits(part_ptr, pid_n * BLOCK_N, M, N, w_scale_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                           HAS_BIAS, BLOCK_N, REDUCE_BLOCK, REDUCE_UNROLL)


@triton.jit
def _splitk_reduce_kernel(
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




class _Tickets:
    """The fused reduce's tickets of one (device, stream): an int64 tensor, 0 between launches, and the epoch of
    the next launch. Per stream: launches on one stream run one after another, so they can share tickets (two
    streams could run two launches at once). Grown (a new zeroed tensor) when a grid needs more tiles. A CUDA graph
    keeps the tickets of the stream it was captured on (torch.cuda.graph's default capture stream is one for all
    graphs): graphs captured on one stream must not be replayed concurrently on two streams. Created during a
    capture, the tensor comes from the graph's pool and its zero-fill becomes a node of the graph (harmless: it
    runs before the graph's launches, which find the reset value anyway)."""

    def __init__(self):
        self.tensor, self.epoch, self.retired = None, 0, []

    def take(self, device: torch.device, tiles: int) -> tuple[torch.Tensor, int]:
        if self.tensor is None or self.tensor.numel() < tiles:
            if self.tensor is not None:  # a captured CUDA graph may hold its address: never freed
                self.retired.append(self.tensor)
            self.tensor = torch.zeros(max(tiles, 1 << 14), dtype=torch.int64, device=device)  # 128 KB
        self.epoch = self.epoch % EPOCH_MAX + 1
        return self.tensor, self.epoch


_TICKETS: dict = {}


def _tickets(device: torch.device, tiles: int) -> tuple[torch.Tensor, int]:
    """(tickets, epoch) for a fused launch of ``tiles`` output tiles on ``device``'s current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _TICKETS.setdefault((device, stream), _Tickets()).take(device, tiles)


def _w8a16_decode(path, x, w, w_scale, bias, out, dot_fp32, config, reduce="fused"):
    M, K = x.shape
    N = w.shape[0]
    cfg = dict(config) if config is not None else w8a16_decode_config(path, M, N, K, _num_sms(x.device))
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
    k_per_split = cfg.pop("K_PER_SPLIT", cfg["BLOCK_K"])
    if path == "gemv":
        assert k_per_split == cfg["BLOCK_K"] * cfg["K_HALVES"], "gemv: one x slice of K_HALVES * BLOCK_K per program"
    else:
        cfg.pop("K_HALVES", None)
    if M * N >= 1 << 31:  # the partial sums' in-split offsets are int32
        raise ValueError(f"w8a16_matmul: M x N = {M} x {N} outputs is too many for a decode path (< 2^31)")
    split_k = triton.cdiv(K, k_per_split) if K > 0 else 1
    # K == 0: one split of nothing (zeros, then scale and bias), not an empty grid that leaves out unwritten
    grid = (triton.cdiv(N, cfg["BLOCK_N"] * cfg["N_TILES"]), split_k)
    split = split_k > 1
    fused = split and reduce == "fused"
    part = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split else out
    tickets, epoch = _tickets(x.device, grid[0]) if fused else (part, 0)  # never read without FUSED
    bias_arg = w_scale if bias is None else bias  # never read without HAS_BIAS
    args = (x, w, w_scale, bias_arg, out, part, tickets, epoch, M, N, K, x.stride(0), x.stride(1), w.stride(0),
            w.stride(1), out.stride(0), out.stride(1))
    block, unroll = reduce_shape(M, cfg["BLOCK_N"] * cfg["N_TILES"], split_k, launch.get("num_warps", 4))
    flags = dict(HAS_BIAS=bias is not None, SPLIT=split, FUSED=fused, EVEN_K=K > 0 and K % k_per_split == 0,
                 DOT_FP32=dot_fp32, REDUCE_BLOCK=block if fused else 1, REDUCE_UNROLL=unroll if fused else 1)
    if path == "gemv":
        _w8a16_gemv_kernel[grid](*args, **flags, **cfg, **launch)
    else:
        _w8a16_splitk_kernel[grid](*args, k_per_split, **flags, **cfg, **launch)
    if split and not fused:
        _splitk_reduce_kernel[(M, triton.cdiv(N, REDUCE_BLOCK_N))](
            part, w_scale, bias_arg, out, M, N, split_k, out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
            BLOCK_N=REDUCE_BLOCK_N, num_warps=4)
