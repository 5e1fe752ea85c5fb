"""int8 ops: symmetric row-wise quantization, int8 x int8 matmul (W8A8), weight-only int8 matmul (W8A16).

Convention of ``F.linear``: ``out[M, N] = a[M, K] @ b[N, K].T``. Quantization is symmetric per row:
``scale = absmax / 127`` (fp32), ``q = clamp(round_half_away(x / scale), -127, 127)``; an all-zero row gets
``scale = 1`` and ``q = 0``. Scales are always fp32 (an int32 accumulator times an fp16 scale overflows).

Kernels: Triton on CUDA (arkernels/triton/int8_matmul.py, launched by arkernels/triton/int8_matmul_launch.py),
registered here for the "cuda" key; a CPU implementation (arkernels/ops/int8_matmul_cpu.py: ``torch._int_mm`` for the
exact int32 product, fp32 math elsewhere) registered for "cpu", so quantized models run and are tested without a
GPU. The schemas live in csrc/torch_bindings.cpp; the fakes sit under their wrappers.
"""
from __future__ import annotations

import warnings

import torch

from arkernels import _library  # noqa: F401  (loads the op library: the schemas)
from arkernels.ops._checks import expect
from arkernels.ops.int8_matmul_cpu import int8_matmul_cpu, quantize_rowwise_cpu, w8a16_matmul_cpu
from arkernels.ops.int8_matmul_layout import PACK_INNER, is_packed, unpack_weight

_ops = torch.ops.arkernels

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Checks: one place, used by the CPU kernel, the CUDA kernel and the fake alike. Messages are formatted only on
# failure: these run on every decode step of every layer (eager f-strings cost ~10 us a call).
# ---------------------------------------------------------------------------------------------------------------
def _fail(op, msg, exc=ValueError):
    expect(False, op, msg, exc)


def _check_2d(op, name, t):
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}", TypeError)
    if t.dim() != 2:
        _fail(op, f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _check_same_device(op, first, dev, **others):
    for name, t in others.items():
        if t is not None and t.device != dev:
            _fail(op, f"{name} is on {t.device} but {first} is on {dev}")


def _check_vector(op, name, t, n, what, dtypes):
    if t.dim() != 1 or t.shape[0] != n:
        _fail(op, f"{name} must have shape [{what}={n}], got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(op, f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}", TypeError)


def _check_quantize_rowwise(x):
    _check_2d("quantize_rowwise", "x", x)
    if x.dtype not in FLOAT_DTYPES:
        _fail("quantize_rowwise", f"x must be float32, float16 or bfloat16, got {x.dtype}", TypeError)


def _check_int8_matmul(a, b, a_scale, b_scale, bias, out_dtype) -> torch.dtype:
    """Validate and return the output dtype: int32 when there is no epilogue (no scale, no bias, out_dtype None
    or int32), else ``out_dtype`` (default bfloat16)."""
    op = "int8_matmul"
    _check_2d(op, "a", a)
    _check_2d(op, "b", b)
    if a.dtype != torch.int8:
        _fail(op, f"a must be int8, got {a.dtype}", TypeError)
    if b.dtype != torch.int8:
        _fail(op, f"b must be int8 [N, K], got {b.dtype}", TypeError)
    if a.shape[1] != b.shape[1]:
        _fail(op, f"K mismatch: a is [M, K] = {tuple(a.shape)} and b is [N, K] = {tuple(b.shape)} (a @ b.T)")
    _check_same_device(op, "a", a.device, b=b, a_scale=a_scale, b_scale=b_scale, bias=bias)
    M, N = a.shape[0], b.shape[0]
    if a_scale is not None:
        _check_vector(op, "a_scale", a_scale, M, "M", (torch.float32,))
    if b_scale is not None:
        _check_vector(op, "b_scale", b_scale, N, "N", (torch.float32,))
    if bias is not None:
        _check_vector(op, "bias", bias, N, "N", FLOAT_DTYPES)
    epilogue = a_scale is not None or b_scale is not None or bias is not None
    if not epilogue and out_dtype in (None, torch.int32):
        return torch.int32
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        _fail(op, f"out_dtype must be float32, float16 or bfloat16 with scales or bias (int32 only without), "
                  f"got {out_dtype}", TypeError)
    return torch.bfloat16 if out_dtype is None else out_dtype


def _check_w8a16_matmul(x, w, w_scale, bias):
    op = "w8a16_matmul"
    _check_2d(op, "x", x)
    if isinstance(w, torch.Tensor) and w.dim() == 3:  # the packed layout (int8_matmul_layout.py)
        if w.shape[2] != PACK_INNER or not w.is_contiguous():
            _fail(op, f"a 3-D w is the packed layout [N, K // {PACK_INNER}, {PACK_INNER}], contiguous (pack_weight); "
                      f"got shape {tuple(w.shape)}, strides {tuple(w.stride())}")
        w_k = w.shape[1] * PACK_INNER
    else:
        _check_2d(op, "w", w)
        w_k = w.shape[1]
    if x.dtype not in FLOAT_DTYPES:
        _fail(op, f"x must be float16 or bfloat16 (float32 accepted), got {x.dtype}", TypeError)
    if w.dtype != torch.int8:
        _fail(op, f"w must be int8 [N, K], got {w.dtype}", TypeError)
    if x.shape[1] != w_k:
        _fail(op, f"K mismatch: x is [M, K] = {tuple(x.shape)} and w is [N, K] = {(w.shape[0], w_k)}")
    _check_same_device(op, "x", x.device, w=w, w_scale=w_scale, bias=bias)
    _check_vector(op, "w_scale", w_scale, w.shape[0], "N", (torch.float32,))
    if bias is not None:
        _check_vector(op, "bias", bias, w.shape[0], "N", FLOAT_DTYPES)


def _check_w8a16_fragment(x, w, w_scale, bias):
    """The fake's checks: the C++ kernels run check_w8a16_fragment_matmul (csrc/int8_matmul.h), the same rules."""
    op = "w8a16_fragment_matmul"
    _check_2d(op, "x", x)
    if x.dtype not in FLOAT_DTYPES:
        _fail(op, f"x must be float16 or bfloat16 (float32 on the CPU), got {x.dtype}", TypeError)
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or tuple(w.shape[2:]) != (4, 4):
        _fail(op, f"w must be the fragment layout [N, K / 16, 4, 4], contiguous (fragment_weight), got "
                  f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if w.dtype != torch.int8:
        _fail(op, f"w must be int8, got {w.dtype}", TypeError)
    if x.shape[1] != w.shape[1] * 16:
        _fail(op, f"K mismatch: x is [M, K] = {tuple(x.shape)} and w holds [N, K] = {(w.shape[0], w.shape[1] * 16)}")
    _check_same_device(op, "x", x.device, w=w, w_scale=w_scale, bias=bias)
    _check_vector(op, "w_scale", w_scale, w.shape[0], "N", (torch.float32,))
    if bias is not None:
        _check_vector(op, "bias", bias, w.shape[0], "N", FLOAT_DTYPES)


# ---------------------------------------------------------------------------------------------------------------
# Public wrappers, each with its fake right under it.
# ---------------------------------------------------------------------------------------------------------------
def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a weight.

    Args:
        w: ``[N, K]`` float32, float16 or bfloat16 (the ``nn.Linear.weight`` layout), any strides.

    Returns:
        ``(w_int8 [N, K] int8 contiguous, w_scale [N] float32)`` with ``w ~= w_int8 * w_scale[:, None]``.
    """
    _check_2d("quantize_per_channel", "w", w)
    return _ops.quantize_rowwise(w)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic per-token int8 quantization of activations (one fused pass: absmax, scale, round, clamp).

    Args:
        x: ``[..., K]`` (typically ``[M, K]``) float32, float16 or bfloat16.

    Returns:
        ``(x_int8 [..., K] int8, x_scale [...] float32)``; an all-zero row gives scale 1 and zeros, never NaN.
    """
    expect(isinstance(x, torch.Tensor) and x.dim() >= 1, "quantize_per_token",
           "x must be a tensor [..., K] with at least one dimension")
    lead, K = x.shape[:-1], x.shape[-1]
    q, scale = _ops.quantize_rowwise(x.reshape(-1, K))
    return q.view(*lead, K), scale.view(lead)


@torch.library.register_fake("arkernels::quantize_rowwise")
def _(x):
    _check_quantize_rowwise(x)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


def int8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """int8 x int8 matmul, ``a @ b.T`` (the ``F.linear`` convention).

    Args:
        a: int8 ``[M, K]`` (quantized activations), any strides.
        b: int8 ``[N, K]`` (quantized weight), any strides. Full int8 range, -128 included.
        a_scale: float32 ``[M]`` (per token) or None (1).
        b_scale: float32 ``[N]`` (per output channel) or None (1).
        bias: ``[N]`` float32/float16/bfloat16, or None.
        out_dtype: output dtype when there is an epilogue (default bfloat16).

    Returns:
        Without scales and bias: the exact int32 product ``[M, N]`` (int32 accumulation, as cuBLAS/_int_mm).
        Otherwise ``acc * a_scale[m] * b_scale[n] + bias[n]`` computed in fp32, cast to ``out_dtype``, ``[M, N]``.
    """
    return _ops.int8_matmul(a, b, a_scale, b_scale, bias, out_dtype)


@torch.library.register_fake("arkernels::int8_matmul")
def _(a, b, a_scale, b_scale, bias, out_dtype):
    dtype = _check_int8_matmul(a, b, a_scale, b_scale, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=dtype)


def w8a16_matmul(
    x: torch.Tensor,
    w_int8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int8 matmul: ``x @ (w_int8 * w_scale[:, None]).T + bias``, weights dequantised in registers
    (never materialised in memory on CUDA). On CUDA the kernel follows the row count M = prod(x.shape[:-1]) (a
    shape: no host sync): M <= 4 a tensor-core GEMV (split over K), 5..16 split-K tensor-core tiles, larger the
    autotuned tile kernel; the split-K partial sums are added in a fixed order (by the last program of each tile,
    in the same launch), so equal inputs give equal bits. A weight that is not K-contiguous with rows a multiple of
    16 bytes (16-byte aligned) runs on CUDA at byte-load speed (~4x slower) and warns once per view shape.

    Args:
        x: ``[..., K]`` float16 or bfloat16 (float32 is accepted too: the CPU path serves fp32 models, the CUDA
            path then runs an fp32 dot, slower).
        w_int8: int8 ``[N, K]``, or the packed ``[N, K // 16, 16]`` of
            :func:`arkernels.ops.int8_matmul_layout.pack_weight` (the layout the decode kernels stream fastest:
            what ``Int8Linear(mode="w8a16")`` stores).
        w_scale: float32 ``[N]``.
        bias: ``[N]`` float or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    expect(isinstance(x, torch.Tensor) and x.dim() >= 1, "w8a16_matmul", "x must be a tensor [..., K]")
    lead, K = x.shape[:-1], x.shape[-1]
    out = _ops.w8a16_matmul(x.reshape(-1, K), w_int8, w_scale, bias)
    return out.view(*lead, out.shape[-1])


@torch.library.register_fake("arkernels::w8a16_matmul")
def _(x, w, w_scale, bias):
    _check_w8a16_matmul(x, w, w_scale, bias)
    return x.new_empty((x.shape[0], w.shape[0]))


def w8a16_fragment_matmul(
    x: torch.Tensor,
    w_frag: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int8 matmul on the fragment layout, the hand-written CUDA decode kernel (csrc/int8_matmul.cu):
    ``x @ (w * w_scale[:, None]).T + bias`` with ``w`` in mma B-fragment order, so its bytes go global -> registers
    -> fp16/bf16 -> tensor cores with no shared memory. Built for decode, M = prod(x.shape[:-1]) <= 16 (larger M runs
    as 16-row slices, each reading the whole weight: use :func:`w8a16_matmul` for prefill). Split-K partial sums are
    added in split order by the last CTA of each column (same launch): equal inputs give equal bits. Not yet measured
    on a GPU.

    Args:
        x: ``[..., K]`` float16 or bfloat16 (float32: the CPU kernel only; the CUDA kernel refuses it).
        w_frag: the fragment layout ``[N, K // 16, 4, 4]`` of
            :func:`arkernels.ops.int8_matmul_layout.fragment_weight`, contiguous.
        w_scale: float32 ``[N]``.
        bias: ``[N]`` float or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    expect(isinstance(x, torch.Tensor) and x.dim() >= 1, "w8a16_fragment_matmul", "x must be a tensor [..., K]")
    lead, K = x.shape[:-1], x.shape[-1]
    out = _ops.w8a16_fragment_matmul(x.reshape(lead.numel(), K), w_frag, w_scale, bias)
    return out.view(*lead, out.shape[-1])


@torch.library.register_fake("arkernels::w8a16_fragment_matmul")
def _(x, w, w_scale, bias):
    _check_w8a16_fragment(x, w, w_scale, bias)
    return x.new_empty((x.shape[0], w.shape[0]))


# ---------------------------------------------------------------------------------------------------------------
# CPU kernels (arkernels/ops/int8_matmul_cpu.py), behind the checks.
# ---------------------------------------------------------------------------------------------------------------
@torch.library.register_kernel("arkernels::quantize_rowwise", "cpu")
def _quantize_rowwise_cpu(x):
    _check_quantize_rowwise(x)
    return quantize_rowwise_cpu(x)


@torch.library.register_kernel("arkernels::int8_matmul", "cpu")
def _int8_matmul_cpu(a, b, a_scale, b_scale, bias, out_dtype):
    dtype = _check_int8_matmul(a, b, a_scale, b_scale, bias, out_dtype)
    return int8_matmul_cpu(a, b, a_scale, b_scale, bias, dtype)


@torch.library.register_kernel("arkernels::w8a16_matmul", "cpu")
def _w8a16_matmul_cpu(x, w, w_scale, bias):
    _check_w8a16_matmul(x, w, w_scale, bias)
    # packed: unpacked straight to fp32, the pass the plain path's own int8 -> fp32 conversion makes anyway
    return w8a16_matmul_cpu(x, unpack_weight(w, torch.float32) if is_packed(w) else w, w_scale, bias)


# ---------------------------------------------------------------------------------------------------------------
# CUDA kernels: Triton. Skipped when triton is not importable (a CPU-only torch), the CPU path still works.
# ---------------------------------------------------------------------------------------------------------------
try:
    from arkernels.triton import int8_matmul_launch as _tk
    from arkernels.triton.int8_matmul_plan import weight_unaligned_reason
except ImportError:  # pragma: no cover - CPU-only installs without triton
    _tk = None

if _tk is not None:
    @torch.library.register_kernel("arkernels::quantize_rowwise", "cuda")
    def _quantize_rowwise_cuda(x):
        _check_quantize_rowwise(x)
        with torch.cuda.device(x.device):
            return _tk.quantize_rowwise_triton(x)

    @torch.library.register_kernel("arkernels::int8_matmul", "cuda")
    def _int8_matmul_cuda(a, b, a_scale, b_scale, bias, out_dtype):
        dtype = _check_int8_matmul(a, b, a_scale, b_scale, bias, out_dtype)
        with torch.cuda.device(a.device):
            return _tk.int8_matmul_triton(a, b, a_scale, b_scale, bias, None if dtype == torch.int32 else dtype)

    _UNALIGNED_SEEN: set = set()

    def _warn_unaligned(w):
        """Never a silent 4x: an unaligned or odd-stride weight still runs (the op takes any view), once warned
        per (shape, strides). Int8Linear refuses such layers at construction; this is for direct op calls."""
        reason = weight_unaligned_reason(w)
        key = (tuple(w.shape), tuple(w.stride()), reason)
        if reason is not None and key not in _UNALIGNED_SEEN:
            _UNALIGNED_SEEN.add(key)
            warnings.warn(f"w8a16_matmul: the int8 weight {tuple(w.shape)} is {reason}; the CUDA kernels fall back "
                          "to byte loads (~4x slower). Use a contiguous weight with in_features a multiple of 16",
                          stacklevel=3)

    @torch.library.register_kernel("arkernels::w8a16_matmul", "cuda")
    def _w8a16_matmul_cuda(x, w, w_scale, bias):
        _check_w8a16_matmul(x, w, w_scale, bias)
        _warn_unaligned(w)
        with torch.cuda.device(x.device):
            return _tk.w8a16_matmul_triton(x, w, w_scale, bias)
