"""int8 ops against the naive references: quantize_rowwise (per channel / per token), int8_matmul, w8a16_matmul.

Tolerances by kind: the unscaled int8 product is integer math, so exact (torch.equal against float64, which holds
every product here exactly). Float outputs: one rounding to the output dtype (eps of that dtype, relative; the
interpreter truncates fp32 -> bf16 instead of rounding, still within one eps) plus fp32 accumulation error,
bounded by a few fp32 eps times the sum of absolute terms.

The op grid runs through the dispatcher (CPU kernel; the Triton kernel on a GPU). A smaller slice calls the Triton
launchers directly: on CPU tensors under TRITON_INTERPRET=1 without a GPU, on the GPU otherwise.
"""
import pytest
import torch
import triton
import triton.language as tl

import arkernels
from arkernels.ops.int8_matmul import int8_matmul, quantize_per_channel, quantize_per_token, w8a16_matmul
from arkernels.ops import int8_matmul_layout as layout
from arkernels.ops.int8_matmul_layout import pack_weight
from arkernels.reference.int8_matmul import (dequantize_rowwise_ref, int8_matmul_ref, quantize_rowwise_ref,
                                             sqnr_db, unpack_weight_ref, w8a16_matmul_ref)
from arkernels.triton import int8_matmul as tk  # the jit kernels and their configs
from arkernels.triton import int8_matmul_launch as tkl
from arkernels.triton import int8_matmul_plan as tkp
from conftest import DEVICES, HAS_CUDA

# The grid: M spans every shape class (1, <=16, <=64, larger) and its edges; K is never a multiple of
# every block size (34, 496, 4099); N = 971 is prime.
MS = [1, 2, 3, 7, 15, 16, 17, 33, 128]
KS = [16, 32, 34, 96, 496]
LARGE_K = 4099  # several thousand, odd: the K loop's masked tail
NS = [8, 971, 4096]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"  # launchers run on CPU tensors only in interpreter mode

# Explicit tile configs for the direct Triton tests: one per code path (small-M GEMV-like tile, mid, large-M
# tensor-core tile), sized so the interpreter runs few, large program instances.
SMALL_TILE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1)
MID_TILE = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=2)
LARGE_TILE = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)


def _int8(shape, gen, full_range=True):
    lo = -128 if full_range else -127
    return torch.randint(lo, 128, shape, generator=gen, dtype=torch.int8)


def _operands(M, K, N, gen):
    """Random int8 operands whose first rows are all -128: the largest products int8 can make."""
    a, b = _int8((M, K), gen), _int8((N, K), gen)
    a[0], b[0] = -128, -128
    return a, b


def _float_close(got, ref, out_dtype, abs_terms):
    """One rounding to out_dtype (relative eps) + fp32 accumulation (64 fp32 eps of the sum of |terms|)."""
    tol = torch.finfo(out_dtype).eps * ref.abs() + 64 * torch.finfo(torch.float32).eps * abs_terms + 1e-30
    err = (got.double().cpu() - ref).abs()
    assert torch.isfinite(got).all()
    assert (err <= tol).all(), f"max err {err.max().item():.3e} (tol there {tol.flatten()[err.argmax()].item():.3e})"


# ------------------------------------------------------------------------------------------------ int8_matmul
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M", MS)
def test_int8_matmul_exact_grid(device, M):
    gen = torch.Generator().manual_seed(M)
    for K in KS + [LARGE_K]:
        for N in NS if K != LARGE_K else NS[:2]:  # the large K with N = 4096 adds time, not coverage
            a, b = _operands(M, K, N, gen)
            got = int8_matmul(a.to(device), b.to(device))
            assert got.dtype == torch.int32 and got.shape == (M, N)
            assert torch.equal(got.cpu().double(), int8_matmul_ref(a, b)), (M, K, N)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_matmul_noncontiguous(device):
    gen = torch.Generator().manual_seed(1)
    M, K, N = 17, 96, 971
    a_wide = _int8((M, 2 * K), gen).to(device)
    a = a_wide[:, ::2]  # stride along K is 2
    b = _int8((K, N), gen).to(device).t()  # [N, K] with K-stride N: a transposed weight
    assert not a.is_contiguous() and not b.is_contiguous()
    assert torch.equal(int8_matmul(a, b).cpu().double(), int8_matmul_ref(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_matmul_scaled(device, out_dtype, with_bias):
    gen = torch.Generator().manual_seed(2)
    for M, K, N in [(1, 496, 971), (7, 34, 8), (33, 496, 130)]:
        a, b = _operands(M, K, N, gen)
        # realistic scales (absmax/127 of activations and weights), different per row and column
        a_scale = torch.rand(M, generator=gen) * 0.05 + 1e-3
        b_scale = torch.rand(N, generator=gen) * 1e-3 + 1e-5
        bias = torch.randn(N, generator=gen).to(out_dtype) if with_bias else None
        d = lambda t: None if t is None else t.to(device)  # noqa: E731
        got = int8_matmul(d(a), d(b), d(a_scale), d(b_scale), d(bias), out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == (M, N)
        ref = int8_matmul_ref(a, b, a_scale, b_scale, bias)
        abs_terms = int8_matmul_ref(a.double().abs(), b.double().abs(), a_scale, b_scale)
        _float_close(got, ref, out_dtype, abs_terms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_int8_matmul_accumulator_beyond_fp16_range(device, out_dtype):
    """The unscaled product exceeds fp16's 65504: scales must be applied in fp32 before the cast."""
    gen = torch.Generator().manual_seed(3)
    a, b = _operands(5, 496, 64, gen)
    acc = int8_matmul(a.to(device), b.to(device))
    assert acc.abs().max() > 65504  # the premise: 496 * 128 * 128 at row/col 0
    a_scale, b_scale = torch.full((5,), 1e-3), torch.full((64,), 2e-3)
    got = int8_matmul(a.to(device), b.to(device), a_scale.to(device), b_scale.to(device), out_dtype=out_dtype)
    ref = int8_matmul_ref(a, b, a_scale, b_scale)
    _float_close(got, ref, out_dtype, int8_matmul_ref(a.double().abs(), b.double().abs(), a_scale, b_scale))


@pytest.mark.parametrize("device", DEVICES)
def test_int8_matmul_default_out_dtype_and_one_sided_scale(device):
    gen = torch.Generator().manual_seed(4)
    a, b = _operands(3, 34, 8, gen)
    a_scale = torch.rand(3, generator=gen).to(device)
    got = int8_matmul(a.to(device), b.to(device), a_scale=a_scale)  # b_scale missing: 1
    assert got.dtype == torch.bfloat16
    _float_close(got, int8_matmul_ref(a, b, a_scale), torch.bfloat16,
                 int8_matmul_ref(a.double().abs(), b.double().abs(), a_scale))
    assert int8_matmul(a.to(device), b.to(device), out_dtype=torch.int32).dtype == torch.int32


@pytest.mark.parametrize("device", DEVICES)
def test_int8_matmul_empty(device):
    a = torch.zeros(0, 16, dtype=torch.int8, device=device)
    b = torch.ones(8, 16, dtype=torch.int8, device=device)
    assert int8_matmul(a, b).shape == (0, 8)
    a, b = torch.ones(3, 0, dtype=torch.int8, device=device), torch.ones(5, 0, dtype=torch.int8, device=device)
    assert torch.equal(int8_matmul(a, b).cpu(), torch.zeros(3, 5, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------ quantizers
def _assert_quant_matches(q, scale, x):
    """Same scale and codes as the reference; on a GPU a code may differ by one only at an exact rounding tie."""
    q_ref, s_ref = quantize_rowwise_ref(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(scale.cpu(), s_ref)
    diff = (q.cpu().int() - q_ref.int()).abs()
    v = x.cpu().double() / s_ref.double()[:, None]
    near_tie = ((v.abs() - v.abs().floor()) - 0.5).abs() < 1e-5
    assert diff.max() <= 1 and not (diff.bool() & ~near_tie).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_per_token_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(33, 496, generator=gen) * torch.logspace(-3, 2, 33)[:, None]).to(dtype)
    x[4] = 0  # an all-zero row: scale 1, zeros, never NaN
    q, scale = quantize_per_token(x.to(device))
    _assert_quant_matches(q, scale, x)
    assert scale[4] == 1 and not q[4].any()
    assert q.min() >= -127  # symmetric: -128 is never produced


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_rounding_and_shapes(device):
    # scale = 127 / 127 = 1: the codes are the values rounded half away from zero
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5, 2.4999, -126.5, 0.0]], device=device)
    q, scale = quantize_per_token(x)
    assert scale.item() == 1.0
    assert q.cpu().tolist() == [[127, 1, -1, 2, -3, 2, -127, 0]]
    x3 = torch.randn(2, 3, 40, device=device)
    q3, s3 = quantize_per_token(x3)  # [..., K] in, [..., K] and [...] out
    assert q3.shape == (2, 3, 40) and s3.shape == (2, 3)
    _assert_quant_matches(q3.reshape(6, 40), s3.reshape(6), x3.reshape(6, 40))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_per_channel_sqnr(device, dtype):
    """Weight round trip above 40 dB (Gaussian rows, K = 1024: ~42.5 dB expected for int8 per channel)."""
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(256, 1024, generator=gen) * torch.rand(256, 1, generator=gen)).to(dtype)
    wt = w.to(device).t().contiguous().t()  # a column-major view: non-contiguous input
    q, scale = quantize_per_channel(wt)
    assert q.is_contiguous() and q.shape == (256, 1024) and scale.shape == (256,)
    _assert_quant_matches(q, scale, w)
    assert sqnr_db(w, dequantize_rowwise_ref(q, scale)) > 40


# ------------------------------------------------------------------------------------------------ w8a16_matmul
def _w8a16_case(M, K, N, dtype, gen, with_bias=True):
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = _int8((N, K), gen, full_range=False)
    w_scale = torch.rand(N, generator=gen) * 0.02 + 1e-4
    bias = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    return x, w, w_scale, bias


def _check_w8a16(got, x, w, w_scale, bias):
    ref = w8a16_matmul_ref(x, w, w_scale, bias)
    abs_terms = w8a16_matmul_ref(x.double().abs(), w.double().abs(), w_scale)
    if bias is not None:
        abs_terms = abs_terms + bias.abs().double()
    assert got.dtype == x.dtype
    _float_close(got, ref, x.dtype, abs_terms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_w8a16_matmul_grid(device, dtype):
    gen = torch.Generator().manual_seed(7)
    for M in (1, 3, 16, 17, 128):
        for K, N in ((34, 971), (496, 8), (LARGE_K, 130)):
            x, w, w_scale, bias = _w8a16_case(M, K, N, dtype, gen, with_bias=M % 2 == 1)
            d = lambda t: None if t is None else t.to(device)  # noqa: E731
            _check_w8a16(w8a16_matmul(d(x), d(w), d(w_scale), d(bias)), x, w, w_scale, bias)
            if K % 16 == 0:  # the packed layout (what Int8Linear(mode="w8a16") stores): K a multiple of 16
                wp = pack_weight(w)
                assert torch.equal(unpack_weight_ref(wp), w)
                _check_w8a16(w8a16_matmul(d(x), d(wp), d(w_scale), d(bias)), x, w, w_scale, bias)


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_matmul_3d_and_noncontiguous(device):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 2 * 96, generator=gen).to(torch.float16)[..., ::2]  # [2, 5, 96], strided K
    w = _int8((96, 40), gen, full_range=False).t()  # [40, 96] column-major
    w_scale = torch.rand(40, generator=gen) * 0.01
    got = w8a16_matmul(x.to(device), w.to(device), w_scale.to(device))
    assert got.shape == (2, 5, 40)
    _check_w8a16(got.reshape(10, 40).cpu(), x.reshape(10, 96), w, w_scale, None)


# ------------------------------------------------------------------------------------------------ Triton direct
TRITON_MATMUL_CASES = [  # (M, K, N, tile): every tile path, K tails and EVEN_K, multi-tile grids, GROUP_M tails
    (1, 496, 971, SMALL_TILE), (3, 34, 130, SMALL_TILE), (16, 256, 64, SMALL_TILE),
    (33, 96, 200, MID_TILE), (128, 496, 257, LARGE_TILE), (200, 128, 300, LARGE_TILE),
]


@pytest.mark.parametrize("M,K,N,tile", TRITON_MATMUL_CASES)
def test_int8_matmul_triton_exact(M, K, N, tile):
    gen = torch.Generator().manual_seed(M * 7 + K)
    a, b = _operands(M, K, N, gen)
    got = tkl.int8_matmul_triton(a.to(TRITON_DEVICE), b.to(TRITON_DEVICE), config=tile)
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu().double(), int8_matmul_ref(a, b))


def test_int8_matmul_triton_noncontiguous_and_default_config():
    gen = torch.Generator().manual_seed(9)
    a = _int8((7, 2 * 96), gen)[:, ::2]
    b = _int8((96, 100), gen).t()
    got = tkl.int8_matmul_triton(a.to(TRITON_DEVICE), b.to(TRITON_DEVICE))  # the config of its M class
    assert torch.equal(got.cpu().double(), int8_matmul_ref(a, b))


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tile", [SMALL_TILE, LARGE_TILE])
def test_int8_matmul_triton_scaled(out_dtype, tile):
    gen = torch.Generator().manual_seed(10)
    M, K, N = 9, 496, 130
    a, b = _operands(M, K, N, gen)
    a_scale, b_scale = torch.rand(M, generator=gen) * 0.05, torch.rand(N, generator=gen) * 1e-3
    bias = torch.randn(N, generator=gen).to(torch.bfloat16)
    d = lambda t: t.to(TRITON_DEVICE)  # noqa: E731
    got = tkl.int8_matmul_triton(d(a), d(b), d(a_scale), d(b_scale), d(bias), out_dtype, config=tile)
    assert got.dtype == out_dtype
    _float_close(got, int8_matmul_ref(a, b, a_scale, b_scale, bias), out_dtype,
                 int8_matmul_ref(a.double().abs(), b.double().abs(), a_scale, b_scale) + bias.abs().double())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M,K,N,tile", [(1, 496, 971, SMALL_TILE), (16, 34, 64, SMALL_TILE),
                                        (40, 256, 130, MID_TILE), (130, 96, 200, LARGE_TILE)])
def test_w8a16_matmul_triton(dtype, M, K, N, tile):
    gen = torch.Generator().manual_seed(11)
    x, w, w_scale, bias = _w8a16_case(M, K, N, dtype, gen, with_bias=M != 16)
    d = lambda t: None if t is None else t.to(TRITON_DEVICE)  # noqa: E731
    _check_w8a16(tkl.w8a16_matmul_triton(d(x), d(w), d(w_scale), d(bias), config=tile).cpu(), x, w, w_scale, bias)


# w8a16 decode paths (M <= 16): GEMV (M <= 4) and split-K (5..16) with the ordered split reduction. Explicit small
# configs keep the interpreter's grids at a few programs while still making several splits and N tiles: K = 600 is
# not a multiple of the split (2 x 128 / 192: the last split is partial, the GEMV's second half of it entirely past
# K), N = 130 not one of the N tile (32 x 2 / 64). fp32 x is served by the tiled kernel unless forced, as here.
GEMV_CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, N_TILES=2, K_HALVES=2, K_PER_SPLIT=256)


SPLITK_CFG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, N_TILES=1, K_PER_SPLIT=192)
DECODE_CASES = [  # (path, M, K, N, bias, strided x)
    ("gemv", 1, 600, 130, True, False), ("gemv", 2, 600, 130, False, True), ("gemv", 3, 512, 77, True, True),
    ("gemv", 4, 600, 130, False, False), ("splitk", 5, 600, 130, True, True), ("splitk", 8, 600, 130, False, False),
    ("splitk", 13, 512, 77, True, False), ("splitk", 16, 600, 130, True, True), ("splitk", 1, 96, 40, False, False),
]




@triton.jit
def _int8_to_kernel(w_ptr, out_ptr, DTYPE: tl.constexpr):
    r = tl.arange(0, 256)
    tl.store(out_ptr + r, tk._int8_to(tl.load(w_ptr + r), DTYPE))


def test_int8_to_fp16_magic_number_exact():
    """The hand-written int8 -> fp16 conversion (bits 0x6400 | (w ^ 0x80), minus 1152) is exact for all 256 values.
    The interpreter's own dots run in fp32, so this is where the fp16 bit trick is checked without a GPU."""
    w = torch.arange(-128, 128, dtype=torch.int8, device=TRITON_DEVICE)
    out = torch.empty(256, dtype=torch.float16, device=TRITON_DEVICE)
    _int8_to_kernel[(1,)](w, out, DTYPE=tl.float16)
    assert torch.equal(out.cpu(), w.cpu().half())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("path,M,K,N,with_bias,strided", DECODE_CASES)
def test_w8a16_decode_paths(dtype, path, M, K, N, with_bias, strided):
    gen = torch.Generator().manual_seed(M * 131 + K)
    x, w, w_scale, bias = _w8a16_case(M, K, N, dtype, gen, with_bias)
    if strided:  # x with K-stride 2 and a transposed (column-major) weight
        x = torch.randn(M, 2 * K, generator=gen).to(dtype)[:, ::2]
        w = w.t().contiguous().t()
    d = lambda t: None if t is None else t.to(TRITON_DEVICE)  # noqa: E731
    out = tkl.w8a16_matmul_triton(d(x), d(w), d(w_scale), d(bias), config=GEMV_CFG if path == "gemv" else SPLITK_CFG,
                                  path=path)
    _check_w8a16(out.cpu(), x, w, w_scale, bias)


# Packed weights through every w8a16 kernel: N = 130 ends in a 2-row group, K = 1040 in a 16-column chunk (the
# general addressing); 64 x 1024 has only whole groups and chunks (WHOLE_PACK's constant strides).
# The GEMV class's K loop (the split-K kernel at the plan's GEMV_LOOP tiles), two chunks per split: 2 splits of K = 1040
GEMV_LOOP_CFG = dict(BLOCK_M=16, BLOCK_N=tkp.GEMV_LOOP["BLOCK_N"], BLOCK_K=tkp.GEMV_LOOP["BLOCK_K"], N_TILES=1,
                     K_PER_SPLIT=1024, num_warps=4, num_stages=tkp.GEMV_LOOP["num_stages"], kernel="splitk")
PACKED_CASES = [("gemv", 1, 1040, 130, GEMV_CFG), ("gemv", 4, 1024, 64, None), ("gemv", 2, 1040, 130, GEMV_LOOP_CFG),
                ("splitk", 9, 1040, 130, SPLITK_CFG),
                ("splitk", 16, 1024, 64, None), ("tiled", 20, 1040, 130, MID_TILE), ("tiled", 33, 1024, 64, None)]


@pytest.mark.parametrize("path,M,K,N,cfg", PACKED_CASES)
def test_w8a16_packed_layout_triton(path, M, K, N, cfg):
    """The kernels read the packed layout (arkernels/ops/int8_matmul_layout.py) to the same bits as the plain
    weight (the same plan, the same sums; a wrong address in any group or chunk changes them), and the reference's
    values; a tile that would straddle a row group or a K chunk is refused."""
    gen = torch.Generator().manual_seed(M + K)
    x, w, w_scale, bias = _w8a16_case(M, K, N, torch.bfloat16, gen)
    d = lambda t: t.to(TRITON_DEVICE)  # noqa: E731
    wp = pack_weight(w)
    assert not torch.equal(wp.view(N, K), w)  # the layouts really differ here
    kw = dict(config=cfg, path=path if cfg is not None or path != "tiled" else None)
    plain = tkl.w8a16_matmul_triton(d(x), d(w), d(w_scale), d(bias), **kw)
    packed = tkl.w8a16_matmul_triton(d(x), d(wp), d(w_scale), d(bias), **kw)
    assert torch.equal(packed, plain)
    _check_w8a16(packed.cpu(), x, w, w_scale, bias)
    if cfg is not None:
        bad = dict(cfg, BLOCK_N=8) if path != "gemv" else dict(cfg, BLOCK_K=1024, K_HALVES=1, K_PER_SPLIT=1024)
        with pytest.raises(ValueError, match="a packed weight needs BLOCK_N a multiple of 16"):
            tkl.w8a16_matmul_triton(d(x), d(wp), d(w_scale), d(bias), config=bad, path=path if path != "tiled"
                                    else None)


@pytest.mark.parametrize("path", ["gemv", "splitk"])
def test_w8a16_decode_deterministic_and_default_config(path, monkeypatch):
    """The same call twice gives the same bits (fixed split order: the ticket only decides which program adds),
    with the shape-derived config (GEMV: the plan for 132 SMs, where N = 40 alone cannot fill the machine, so K
    splits; split-K: the interpreter's one SM, where 2 splits fill its 2 slots)."""
    sms = 132 if path == "gemv" else 1
    monkeypatch.setattr(tkl, "_num_sms", lambda device: sms)
    gen = torch.Generator().manual_seed(21)
    M = 3 if path == "gemv" else 11
    x, w, w_scale, bias = _w8a16_case(M, 2000, 40, torch.bfloat16, gen)
    d = lambda t: t.to(TRITON_DEVICE)  # noqa: E731
    cfg = tkp.w8a16_decode_config(path, M, 40, 2000, sms)
    assert triton.cdiv(2000, cfg["K_PER_SPLIT"]) > 1  # the reduction runs
    first = tkl.w8a16_matmul_triton(d(x), d(w), d(w_scale), d(bias), path=path)
    second = tkl.w8a16_matmul_triton(d(x), d(w), d(w_scale), d(bias), path=path)
    assert torch.equal(first, second)
    _check_w8a16(first.cpu(), x, w, w_scale, bias)


@pytest.mark.parametrize("path", ["gemv", "splitk"])
def test_w8a16_decode_empty_k(path):
    """K = 0: the output is the bias (one split of nothing), never left unwritten."""
    x, w = torch.zeros(2, 0, dtype=torch.float16), torch.zeros(24, 0, dtype=torch.int8)
    w_scale, bias = torch.rand(24), torch.randn(24).half()
    d = lambda t: t.to(TRITON_DEVICE)  # noqa: E731
    out = tkl.w8a16_matmul_triton(d(x), d(w), d(w_scale), d(bias), path=path)
    assert torch.equal(out.cpu(), bias.expand(2, 24))


def test_w8a16_path_follows_m(monkeypatch):
    """M <= 4: GEMV; 5..16: split-K; above, and for fp32 x (no tensor-core dot): tiles. The launcher really takes
    that path when no config is given."""
    want = {1: "gemv", 4: "gemv", 5: "splitk", 16: "splitk", 17: "tiled", 4096: "tiled"}
    for M, path in want.items():
        assert tkp.w8a16_path(M, torch.bfloat16) == tkp.w8a16_path(M, torch.float16) == path
        assert tkp.w8a16_path(M, torch.float32) == "tiled"
    taken = []
    monkeypatch.setattr(tkl, "_w8a16_decode", lambda path, *a: taken.append(path))
    monkeypatch.setattr(tkl, "_launch", lambda *a: taken.append("tiled"))
    for M in (1, 4, 5, 16, 17):
        tkl.w8a16_matmul_triton(torch.zeros(M, 32, dtype=torch.float16), torch.zeros(8, 32, dtype=torch.int8),
                                torch.ones(8))
    assert taken == ["gemv", "gemv", "splitk", "splitk", "tiled"]


LLAMA_8B_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]
# N x K of Llama-3-8B's projections (q and o, k and v, gate and up, down, the LM head; fused q/k/v and gate/up, what
# generate's compiled / graph steps run by default) and SmolLM2-135M's (hidden 576, intermediate 1536, 3 KV heads of
# 64, vocabulary 49152), with the splits the GEMV class's plan gives on 132 SMs (H100 / H200) and the kernel that runs
# them. N alone fills the machine (>= 2 programs of 32 columns per SM, balanced) for the LM heads and the fused
# gate/up (28672: 896 programs); q/o (128 column tiles, fewer than the SMs), k/v, gate/up alone (448 programs: 3.4 per
# SM, 0.85 balanced), down and the fused q/k/v (192) keep the per-chunk GEMV's 8 / 28 splits. SmolLM2's layers are
# too small to fill it.
GEMV_PLANS_132 = {
    (4096, 4096): ("gemv", 8), (1024, 4096): ("gemv", 8), (14336, 4096): ("gemv", 8), (4096, 14336): ("gemv", 28),
    (128256, 4096): ("splitk", 1), (6144, 4096): ("gemv", 8), (28672, 4096): ("splitk", 1),
    (576, 576): ("gemv", 2), (192, 576): ("gemv", 2), (1536, 576): ("gemv", 2), (576, 1536): ("gemv", 3),
    (49152, 576): ("splitk", 1),
}
ODD_NK = [(971, 34), (1, 4099), (130, 1040), (152064, 3584), (40, 2000), (6144, 4096), (100003, 4099)]


def _plan(M, N, K, num_sms):
    path = tkp.w8a16_path(M)
    cfg = tkp.w8a16_decode_config(path, M, N, K, num_sms)
    splits = triton.cdiv(K, cfg["K_PER_SPLIT"])
    return path, cfg, splits, triton.cdiv(N, cfg["BLOCK_N"] * cfg["N_TILES"]) * splits


def _fills(option, num_sms):
    need = triton.cdiv(tkp.LITTLE_BYTES, option["in_flight"])
    return need <= option["resident"] and option["programs"] >= need * num_sms


@pytest.mark.parametrize("N,K", list(GEMV_PLANS_132) + ODD_NK)
def test_w8a16_gemv_split_plan(N, K, monkeypatch):
    """The GEMV class (M <= 4) splits K only where N alone cannot fill the machine, sized by the programs resident
    per SM and the SM count (pure Python: shapes -> splits and grid; no device query, equal inputs give equal
    plans, the same plan for every M in 1..4). Brute force over every option (the per-chunk GEMV, the K loop over all
    of K): the plan fills the machine if any option does; its balance over the SMs is within WAVE_SLACK of the best
    filling option's, and no such option has fewer splits. Splits are whole PACK_K chunks (the packed layout's
    contract), K tiles divide them. The Llama-3-8B and SmolLM2 projections get the splits GEMV_PLANS_132 lists on
    132 SMs."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: pytest.fail("the plan queried a device"))
    for num_sms in (132, 114, 78, 1):
        plans = {M: _plan(M, N, K, num_sms) for M in (1, 2, 3, 4)}
        path, cfg, splits, programs = plans[1]
        assert path == "gemv" and all(p == plans[1] for p in plans.values())
        options = tkp.gemv_split_options(N, K, num_sms)
        chosen = next(o for o in options if o["cfg"] == cfg)
        assert (chosen["splits"], chosen["programs"]) == (splits, programs)
        chunk = options[0]["cfg"]
        assert chunk["kernel"] == "gemv" and options[0]["splits"] == triton.cdiv(K, chunk["K_PER_SPLIT"])
        for o in options[1:]:
            c = o["cfg"]
            assert c["kernel"] == "splitk" and c["K_PER_SPLIT"] % layout.PACK_K == 0
            assert c["K_PER_SPLIT"] % c["BLOCK_K"] == 0 and layout.PACK_K % c["BLOCK_K"] == 0
            assert triton.cdiv(K, layout.PACK_K) % (c["K_PER_SPLIT"] // layout.PACK_K) == 0  # equal splits
            assert o["splits"] == triton.cdiv(K, c["K_PER_SPLIT"]) == 1 < options[0]["splits"]
        full = [o for o in options if _fills(o, num_sms)]
        if not full:
            assert chosen is options[0]
            continue
        assert _fills(chosen, num_sms)
        best = max(tkp.wave_efficiency(o["programs"], num_sms) for o in full)
        assert tkp.wave_efficiency(programs, num_sms) >= best - tkp.WAVE_SLACK
        assert not [o for o in full if o["splits"] < splits
                    and tkp.wave_efficiency(o["programs"], num_sms) >= best - tkp.WAVE_SLACK]
    if (N, K) in GEMV_PLANS_132:
        path, cfg, splits, programs = _plan(1, N, K, 132)
        assert (cfg["kernel"], splits) == GEMV_PLANS_132[(N, K)], (N, K, cfg)
        if splits == 1:  # no workspace, no ticket: the kernel stores the output itself
            assert cfg["K_PER_SPLIT"] >= K


@pytest.mark.parametrize("N,K", LLAMA_8B_NK + [(971, 34), (152064, 3584)])
def test_w8a16_decode_config_whole_waves(N, K, monkeypatch):
    """The plan is a pure function of (shape, SM count): no device query (any would raise here), equal inputs give
    equal plans. The per-chunk GEMV option: every program's tiles are all in flight at once (num_stages = N_TILES +
    1, N_TILES >= 2 where the columns allow), its waves are counted with the residency of its own registers and
    shared memory, and on 132 SMs (H100 / H200) the Llama-8B shapes keep >= LITTLE_BYTES of weight loads in flight
    per SM even in their last, partial wave (so that wave still saturates HBM). Split-K (M 5..16): every plan is
    within WAVE_SLACK of the best option (brute force here); splits start on K-tile boundaries; the workspace stays
    under 10% of the weight bytes."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: pytest.fail("the plan queried a device"))
    for num_sms in (132, 114, 78):
        for M in (1, 4, 5, 8, 16):
            path, cfg, splits, programs = _plan(M, N, K, num_sms)
            assert (path, cfg, splits, programs) == _plan(M, N, K, num_sms)
            assert cfg["K_PER_SPLIT"] % cfg["BLOCK_K"] == 0 and cfg["BLOCK_M"] >= M
            if N * K >= 4096 * 4096:
                assert 2 * splits * M * N * 4 <= 0.1 * N * K, (M, path, cfg)
            if path == "gemv":
                cfg = tkp.gemv_split_options(N, K, num_sms)[0]["cfg"]  # the per-chunk GEMV option
                splits = triton.cdiv(K, cfg["K_PER_SPLIT"])
                programs = triton.cdiv(N, cfg["BLOCK_N"] * cfg["N_TILES"]) * splits
                assert cfg["num_stages"] == cfg["N_TILES"] + 1 and cfg["N_TILES"] in tkp.GEMV_N_TILES
                resident = {t: tkp.resident_programs(tkp.GEMV_REGISTERS, tkp.gemv_smem(t, cfg["BLOCK_N"],
                                                                                      cfg["K_PER_SPLIT"]), 4)
                            for t in tkp.GEMV_N_TILES}
                wave = resident[cfg["N_TILES"]] * num_sms
                eff = tkp.wave_efficiency(programs, wave)
                options = [tkp.wave_efficiency(triton.cdiv(triton.cdiv(N, cfg["BLOCK_N"]), t) * splits,
                                               resident[t] * num_sms) for t in tkp.GEMV_N_TILES]
                assert eff >= max(options) - tkp.WAVE_SLACK, (M, N, K, cfg)
                if (N, K) in LLAMA_8B_NK and num_sms == 132:
                    last = programs - (triton.cdiv(programs, wave) - 1) * wave
                    tile = cfg["BLOCK_N"] * cfg["K_PER_SPLIT"]
                    assert last / num_sms * cfg["N_TILES"] * tile >= tkp.LITTLE_BYTES, (M, N, K, cfg, programs)
            else:
                wave = tkp.PROGRAMS_PER_SM[path] * num_sms
                eff = tkp.wave_efficiency(programs, wave)
                k_blocks = triton.cdiv(K, cfg["BLOCK_K"])
                options = [triton.cdiv(N, 64) * triton.cdiv(K, triton.cdiv(k_blocks, s) * cfg["BLOCK_K"])
                           for s in range(1, max(1, min(k_blocks, K // (80 * M))) + 1)]
                assert eff >= max(tkp.wave_efficiency(p, wave) for p in options) - tkp.WAVE_SLACK, (M, N, K, cfg)
    chunk = tkp.gemv_split_options(4096, 14336, 132)[0]
    assert chunk["programs"] == 1792  # 28 splits x 64 pairs of column tiles, 4 resident per SM
    assert chunk["cfg"]["N_TILES"] == 2  # 4 tiles: as many waves, but 2 programs (8 warps) per SM
    assert tkp.wave_efficiency(896, 528) == pytest.approx(896 / 1056)


def test_w8a16_resident_programs():
    """Residency from registers and shared memory, as CUDA's occupancy rules count it on sm_90: 8 programs of 4 warps
    at 64 registers (by registers: 64 x 128 = 8K of 64K; 24 KB of shared memory would allow 9), fewer as either
    grows, the per-warp register rounding (65 registers cost 72 x 32 per warp) and the block / warp caps. The GEMV
    plans' shared memory is what the offline compile allocates (tests below: test_w8a16_fused_kernels_...)."""
    rp = tkp.resident_programs
    assert rp(64, 24 * 1024, 4) == 8
    assert rp(65, 24 * 1024, 4) == 7  # 72 x 32 = 2304 registers per warp: 28 warps, 7 programs
    assert rp(128, 0, 4) == 4 and rp(255, 0, 4) == 2
    assert rp(32, 0, 1) == 32 and rp(16, 0, 1) == 32  # the 32-block cap
    assert rp(32, 0, 8) == 8  # the 64-warp cap
    assert rp(32, 227 * 1024, 4) == 1 and rp(32, 228 * 1024, 4) == 0  # 1 KB reserved per block
    assert rp(64, 50 * 1024, 4) == 4  # the GEMV's 2-tile plan: 4 x 51 KB of 228
    assert rp(tkp.GEMV_REGISTERS, tkp.gemv_smem(2, 32, 512), 4) == 4
    assert rp(tkp.GEMV_REGISTERS, tkp.gemv_smem(4, 32, 512), 4) == 2


def test_w8a16_tickets_epochs_and_growth():
    """Each fused launch takes the next epoch (EPOCH_MAX wraps to 1, never 0: the reset value's tag); a grid with
    more tiles than the tickets hold gets a larger, zeroed tensor."""
    t = tkl._Tickets()
    first, e1 = t.take(torch.device("cpu"), 5)
    assert e1 == 1 and first.numel() >= 5 and not first.any()
    assert t.take(torch.device("cpu"), 5) == (first, 2)
    t.epoch = tkl.EPOCH_MAX
    assert t.take(torch.device("cpu"), 5)[1] == 1
    first[0] = 7
    grown, _ = t.take(torch.device("cpu"), first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any()
    assert len(t.retired) == 1 and t.retired[0] is first  # kept alive: a graph captured with it still writes there


def _decode_inputs(M, K, N, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w, w_scale, bias = _w8a16_case(M, K, N, torch.bfloat16, gen)
    return [t.to(TRITON_DEVICE) for t in (x, w, w_scale, bias)]


def _tickets_state():
    t = tkl._TICKETS.get((torch.device(TRITON_DEVICE), 0))
    return None if t is None else (t.tensor.clone(), t.epoch)


FUSED_CASES = [("gemv", 1, GEMV_CFG), ("gemv", 4, GEMV_CFG), ("splitk", 5, SPLITK_CFG), ("splitk", 16, SPLITK_CFG)]


@pytest.mark.parametrize("path,M,cfg", FUSED_CASES)
def test_w8a16_fused_reduce_same_bits(path, M, cfg):
    """The fused reduce (the last program of each tile adds the splits in split order) gives the two-launch
    path's bits, the same bits on every run, and the reference's values; it leaves every ticket at 0 and takes a
    new epoch per launch. K = 600 over splits of 256 / 192: 3 / 4 splits, the last one partial."""
    x, w, w_scale, bias = _decode_inputs(M, 600, 130, seed=M)
    runs = [tkl.w8a16_matmul_triton(x, w, w_scale, bias, config=cfg, path=path) for _ in range(2)]
    before = _tickets_state()
    two_launch = tkl.w8a16_matmul_triton(x, w, w_scale, bias, config=cfg, path=path, reduce="launch")
    assert _tickets_state()[1] == before[1]  # the two-launch path takes no ticket
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], two_launch)
    assert not _tickets_state()[0].any()
    _check_w8a16(runs[0].cpu(), x.cpu(), w.cpu(), w_scale.cpu(), bias.cpu())
    with pytest.raises(ValueError, match="w8a16_matmul: reduce must be one of"):
        tkl.w8a16_matmul_triton(x, w, w_scale, bias, path=path, reduce="atomic")


def test_w8a16_decode_same_bits_across_m_in_the_gemv_class():
    """A row's output does not depend on the other rows of its GEMV batch (M = 1..4: one plan, rows padded to the
    same 16-row dot): row r of an M = 4 call has the bits of the M = 1 call on row r alone, for every option the
    GEMV class's plan may take (the per-chunk GEMV's 3 splits, the K loop's one split of 3 chunks; the default at one
    SM is the loop). The split-K class (5..16) is deterministic per M (test above); its split count follows M (the
    workspace bound), so its bits may not."""
    x, w, w_scale, bias = _decode_inputs(4, 1100, 70, seed=3)
    options = tkp.gemv_split_options(70, 1100, 1)
    assert [(o["cfg"]["kernel"], o["splits"]) for o in options] == [("gemv", 3), ("splitk", 1)]
    assert tkp.w8a16_decode_config("gemv", 4, 70, 1100, 1) == options[1]["cfg"]
    for cfg in [None] + [o["cfg"] for o in options]:
        full = tkl.w8a16_matmul_triton(x, w, w_scale, bias, path="gemv", config=cfg)
        for m in range(4):
            assert torch.equal(tkl.w8a16_matmul_triton(x[m:m + 1], w, w_scale, bias, path="gemv", config=cfg)[0],
                               full[m])
        assert torch.equal(tkl.w8a16_matmul_triton(x[1:3], w, w_scale, bias, path="gemv", config=cfg), full[1:3])
        _check_w8a16(full.cpu(), x.cpu(), w.cpu(), w_scale.cpu(), bias.cpu())


@pytest.mark.parametrize("path,M,cfg", FUSED_CASES[1:3])
def test_w8a16_tickets_survive_an_aborted_launch(path, M, cfg):
    """What an aborted launch leaves (some of its programs never arrived, so its last never reset the tickets:
    counts 1..S-1 under its epoch), or any garbage, does not change the next launch's bits, and that launch
    leaves the tickets at 0 again. Sensitivity: the same stale counts under the *next* launch's own epoch (what
    the tag exists to tell apart) do mis-combine: the ticket logic really runs (also under the interpreter)."""
    x, w, w_scale, bias = _decode_inputs(M, 600, 130, seed=7 + M)
    good = tkl.w8a16_matmul_triton(x, w, w_scale, bias, config=cfg, path=path)
    tickets, epoch = _tickets_state()
    n = 3  # column tiles of N = 130: 130 / (32 x 2) (gemv) or 130 / 64 (split-K)
    splits = triton.cdiv(600, cfg["K_PER_SPLIT"])
    live = tkl._TICKETS[(torch.device(TRITON_DEVICE), 0)].tensor
    assert splits > 1
    stale = [(epoch << 32) | (1 + i % (splits - 1)) for i in range(n)]  # epoch's launch aborted after k < S arrivals
    garbage = [-1, (123 << 32) | 77, 1 << 40]
    for poison in (stale, garbage, [0xFFFFFFFF] * n):
        live[:n] = torch.tensor(poison[:n], dtype=torch.int64)
        assert torch.equal(tkl.w8a16_matmul_triton(x, w, w_scale, bias, config=cfg, path=path), good)
        assert not live.any()
    # the negative control: the next epoch's tag with a count of 1 makes its second-to-last program the "last"
    x2, w2, w_scale2, bias2 = _decode_inputs(M, 600, 130, seed=99 + M)
    want = tkl.w8a16_matmul_triton(x2, w2, w_scale2, bias2, config=cfg, path=path)
    nxt = tkl._TICKETS[(torch.device(TRITON_DEVICE), 0)].epoch % tkl.EPOCH_MAX + 1
    live[:n] = (nxt << 32) | 1
    early = tkl.w8a16_matmul_triton(x2.clone(), w2, w_scale2, bias2, config=cfg, path=path)
    assert not torch.equal(early, want)
    live.zero_()


def _compile_sm90(kernel_name, consts, num_warps, num_stages, aligned=True, arch=90):
    """Offline compile of a decode kernel for sm_90 (no GPU needed: triton's own ptxas), in a subprocess without
    TRITON_INTERPRET (under it the kernels are interpreted functions, which do not compile) -> (PTX, SASS,
    resource-usage match, dynamic shared memory bytes). ``aligned``: the divisibility-by-16 facts Triton's launcher
    specializes an aligned weight on. ``arch``: 90, or 80 (the sm_80 build a PDL-free kernel must still compile to)."""
    import json
    import os
    import re
    import subprocess
    import sys

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bin_dir, "cuobjdump")):
        pytest.skip("triton's wheel ships no cuobjdump here")
    env = dict(os.environ, TRITON_INTERPRET="0")
    job = json.dumps([kernel_name, consts, num_warps, num_stages, aligned, arch])
    done = subprocess.run([sys.executable, __file__, job], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    return (got["ptx"], got["sass"], re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", got["res"]),
            got["shared"])


def _compile_sm90_here(kernel_name, consts, num_warps, num_stages, aligned, arch=90):
    """The subprocess side of :func:`_compile_sm90`: prints {ptx, sass, res} as one JSON line."""
    import inspect
    import json
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(tk, kernel_name)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    names = list(inspect.signature(kernel.fn).parameters)
    ptrs = dict(x_ptr="*bf16", w_ptr="*i8", w_scale_ptr="*fp32", bias_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32",
                ticket_ptr="*i64")
    consts = dict(consts, stride_xk=1, stride_wk=1, stride_on=1)  # unit strides: specialized as constants
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    hinted = {n for n in ptrs} | {"N", "K", "stride_xm", "stride_wn", "stride_om", "K_PER_SPLIT"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n in hinted and (aligned or n not in ("w_ptr", "stride_wn", "K"))}
    k = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        run = lambda *a: subprocess.run([os.path.join(bin_dir, "cuobjdump"), *a, f.name], capture_output=True,  # noqa
                                        text=True, check=True).stdout
        print(json.dumps(dict(ptx=k.asm["ptx"], sass=run("-sass"), res=run("-res-usage"), shared=k.metadata.shared)))


# 16-byte loads from global memory (PTX): cp.async of 0x10 bytes, or a 4 x 32-bit vector load
WIDE_GLOBAL_LOAD = r"cp\.async\.\w+\.shared\.global[^;]*,\s*(?:16|0x10)\s*[,;]|ld\.global[.\w]*\.v4\."


def _sass_lines(sass):
    import re

    return [x.split(";")[0].split("*/")[-1] for x in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", x)]


# (path, M, N, K, packed, option): "plan" is the planned config; "loop" the GEMV class's K loop (one split: no reduce)
COMPILE_CASES = [("gemv", 1, 4096, 14336, False, "plan"), ("gemv", 1, 4096, 14336, True, "plan"),
                 ("gemv", 1, 14336, 4096, True, "plan"), ("gemv", 1, 4096, 14336, True, "loop"),
                 ("gemv", 1, 4096, 14336, False, "loop"), ("splitk", 8, 4096, 14336, False, "plan"),
                 ("splitk", 8, 4096, 14336, True, "plan")]


@pytest.mark.parametrize("path,M,N,K,packed,option", COMPILE_CASES)
def test_w8a16_fused_kernels_compile_for_sm90(path, M, N, K, packed, option):
    """The fused decode kernels compile offline for sm_90 with the planned config: no local memory (no spills,
    STL/LDL), the ticket's atomics and the partials' L2 (.cg) loads present, the weight read by 16-byte cp.async
    when aligned, and (plain layout) byte loads without the divisibility facts (GEMV: ld.global.b8; the silent 4x
    the op warns about and Int8Linear refuses; a packed weight is contiguous with K % 16 == 0 by construction).
    Per-chunk GEMV: at most GEMV_REGISTERS registers and the shared memory gemv_smem counts (so resident_programs
    counts what the hardware holds), and every weight load of the program (N_TILES tiles) is a cp.async issued
    before the first wait on any of them (DEPBAR): all of the program's weight bytes in flight at once, no second
    DRAM round trip. The GEMV class's K loop (the split-K kernel at GEMV_LOOP): at most GEMV_LOOP_REGISTERS and
    gemv_loop_smem, and num_stages - 1 stages of weight and x cp.async issued before the first wait. ~10-20 s of
    compiles per case on 2 cores."""
    import re

    cfg = tkp.w8a16_decode_config(path, M, N, K, 132)
    if option == "loop":
        cfg = tkp.gemv_split_options(N, K, 132)[-1]["cfg"]
    consts = {k: v for k, v in cfg.items() if k.isupper() and k != "K_PER_SPLIT"}
    if cfg["kernel"] == "splitk":
        consts.pop("K_HALVES", None)
    splits = triton.cdiv(K, cfg["K_PER_SPLIT"])
    assert (splits > 1) == (option == "plan")
    block, unroll = tkp.reduce_shape(M, cfg["BLOCK_N"] * cfg["N_TILES"], splits)
    consts.update(HAS_BIAS=True, SPLIT=splits > 1, FUSED=splits > 1, EVEN_K=K % cfg["K_PER_SPLIT"] == 0,
                  DOT_FP32=False,
                  REDUCE_BLOCK=block, REDUCE_UNROLL=unroll, PACKED=packed,
                  WHOLE_PACK=packed and N % 16 == 0 and K % 512 == 0)
    if cfg["kernel"] == "gemv":  # as the launcher passes it
        consts["N_EDGE"] = not packed or N % (cfg["BLOCK_N"] * cfg["N_TILES"]) != 0
    kernel = f"w8a16_{cfg['kernel']}_kernel"
    ptx, sass, res, shared = _compile_sm90(kernel, consts, cfg["num_warps"], cfg["num_stages"])
    assert res and int(res[2]) == 0 and int(res[4]) == 0, res  # STACK 0, LOCAL 0
    assert not re.search(r"\b(?:STL|LDL)\b", sass)
    ins = _sass_lines(sass)
    if splits == 1:  # no workspace, no ticket, no reduce
        assert "atom.global" not in ptx and "ld.global.cg" not in ptx
    else:
        assert "atom.global" in ptx and "cas" in ptx and "ld.global.cg" in ptx
        # the reduce issues its partial loads (strong .cg loads in SASS) before it adds: UNROLL splits per L2 round
        # trip, not one (masked loads were serialised on predicate registers: one load per addition)
        first = next(i for i, x in enumerate(ins) if "LDG.E.STRONG.GPU" in x)
        ahead = next(i for i, x in enumerate(ins[first:]) if "FADD" in x)
        issued = ins[first:first + ahead]
        assert sum("LDG.E.STRONG.GPU" in x for x in issued) >= min(unroll, 8), issued
    assert "ld.global.b8" not in ptx  # aligned: no byte loads at all
    if cfg["kernel"] == "gemv":
        assert int(res[1]) <= tkp.GEMV_REGISTERS
        assert shared == tkp.gemv_smem(cfg["N_TILES"], cfg["BLOCK_N"], cfg["K_PER_SPLIT"]), shared
        copies = cfg["N_TILES"] * cfg["BLOCK_N"] * cfg["K_PER_SPLIT"] // (16 * 32 * cfg["num_warps"])  # per thread
        wait = next(i for i, x in enumerate(ins) if "DEPBAR.LE" in x)
        assert sum("LDGSTS.E.BYPASS.128" in x for x in ins[:wait]) == copies, ins[:wait]
        x_loads = 16 * cfg["K_PER_SPLIT"] * 2 // (16 * 32 * cfg["num_warps"])  # the bf16 x slice, [16, K_PER_SPLIT]
        assert sum("LDG.E.128" in x for x in ins) == x_loads  # no weight byte through registers
    else:
        assert len(re.findall(WIDE_GLOBAL_LOAD, ptx)) > 0
    if path == "gemv" and cfg["kernel"] == "splitk":  # the GEMV class's K loop: the residency its plan counts
        assert int(res[1]) <= tkp.GEMV_LOOP_REGISTERS and shared == tkp.gemv_loop_smem(), (res[1], shared)
        per_stage = cfg["BLOCK_K"] * (cfg["BLOCK_N"] + 16 * 2) // (16 * 32 * cfg["num_warps"])  # w + x, per thread
        wait = next(i for i, x in enumerate(ins) if "DEPBAR.LE" in x)
        assert sum("LDGSTS.E" in x for x in ins[:wait]) == (cfg["num_stages"] - 1) * per_stage, ins[:wait]
    if not packed:
        ptx_unaligned = _compile_sm90(kernel, consts, cfg["num_warps"], cfg["num_stages"], aligned=False)[0]
        assert len(re.findall(WIDE_GLOBAL_LOAD, ptx)) > len(re.findall(WIDE_GLOBAL_LOAD, ptx_unaligned))
        assert "ld.global.b8" in ptx_unaligned


@pytest.mark.parametrize("option", ["chunk", "loop"])
def test_w8a16_pdl_compiles_for_sm90_only(option):
    """PDL (programmatic dependent launch, the ``PDL`` constexpr the launcher sets with ``launch_pdl=True`` on sm_90):
    the offline sm_90 compile has ``griddepcontrol.wait`` and ``.launch_dependents``; before the wait only L2
    prefetches of the program's first weight tiles (``prefetch.global.L2``: SASS ``CCTL.E.PF2``), no load of x nor
    of anything else, no store, no atomic (PTX and SASS: ``ACQBULK`` is the wait); registers within the plan's
    budget, no spills. Without PDL (the default, the interpreter's and sm_80's) no griddepcontrol at all, and the
    sm_80 compile of the same config succeeds (griddepcontrol is sm_90 PTX). 1 Llama-3-8B down shape, M = 1:
    the per-chunk GEMV (28 splits: workspace and tickets after the wait) and the K loop (one split)."""
    import re

    N, K = 4096, 14336
    cfg = tkp.gemv_split_options(N, K, 132)[0 if option == "chunk" else -1]["cfg"]
    splits = triton.cdiv(K, cfg["K_PER_SPLIT"])
    consts = {k: v for k, v in cfg.items() if k.isupper() and k != "K_PER_SPLIT"}
    if cfg["kernel"] == "splitk":
        consts.pop("K_HALVES", None)
    else:
        consts["N_EDGE"] = False
    block, unroll = tkp.reduce_shape(1, cfg["BLOCK_N"] * cfg["N_TILES"], splits)
    consts.update(HAS_BIAS=True, SPLIT=splits > 1, FUSED=splits > 1, EVEN_K=True, DOT_FP32=False, REDUCE_BLOCK=block,
                  REDUCE_UNROLL=unroll, PACKED=True, WHOLE_PACK=True)
    kernel = f"w8a16_{cfg['kernel']}_kernel"
    ptx, sass, res, _ = _compile_sm90(kernel, dict(consts, PDL=True), cfg["num_warps"], cfg["num_stages"])
    assert int(res[2]) == 0 and int(res[4]) == 0, res
    budget = tkp.GEMV_REGISTERS if cfg["kernel"] == "gemv" else tkp.GEMV_LOOP_REGISTERS
    assert int(res[1]) <= budget
    lines = [x.strip() for x in ptx.splitlines()]
    wait = next(i for i, x in enumerate(lines) if x.startswith("griddepcontrol.wait"))
    assert any(x.startswith("griddepcontrol.launch_dependents") for x in lines[wait:])
    before = lines[:wait]
    prefetches = sum(x.startswith("prefetch.global.L2") for x in before)
    tiles = cfg["N_TILES"] if cfg["kernel"] == "gemv" else 2
    assert prefetches == tiles, before  # one per thread per tile: 128 threads x 128 B = a 16 KB / 8 KB tile's lines
    assert not [x for x in before if re.search(r"\b(?:(?:ld|st)\.(?:global|shared|local)|cp\.async|atom\.|red\.)", x)]
    ins = _sass_lines(sass)
    acq = next(i for i, x in enumerate(ins) if "ACQBULK" in x)
    assert sum("CCTL.E.PF2" in x for x in ins[:acq]) == prefetches
    assert not [x for x in ins[:acq] if re.search(r"\b(?:LDG|LDGSTS|STG|ATOMG|RED|LDS|STS)\b", x)], ins[:acq]
    assert "PREEXIT" in "".join(ins[acq:])  # launch_dependents
    off = dict(consts, PDL=False)
    assert "griddepcontrol" not in _compile_sm90(kernel, off, cfg["num_warps"], cfg["num_stages"])[0]
    assert "griddepcontrol" not in _compile_sm90(kernel, off, cfg["num_warps"], cfg["num_stages"], arch=80)[0]


def test_w8a16_pdl_launch_flags(monkeypatch):
    """The launcher sets the PDL constexpr and ``launch_pdl`` together, only where ``pdl_supported`` holds (sm_90
    and later, not under the interpreter, not with ARKERNELS_PDL=0): mocked device and kernels, no GPU here."""
    from arkernels.triton import pdl

    monkeypatch.setattr(pdl, "pdl_capable", lambda device: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.pdl_supported(torch.device("cpu"))
    monkeypatch.setenv("ARKERNELS_PDL", "0")
    assert not pdl.pdl_supported(torch.device("cpu"))
    monkeypatch.delenv("ARKERNELS_PDL")
    gemv, splitk = _Recorder(), _Recorder()
    monkeypatch.setattr(tkl, "w8a16_gemv_kernel", gemv)
    monkeypatch.setattr(tkl, "w8a16_splitk_kernel", splitk)
    x, w, w_scale = torch.zeros(1, 1024, dtype=torch.float16), torch.zeros(64, 1024, dtype=torch.int8), torch.ones(64)
    for cfg, rec in ((GEMV_CFG, gemv), (GEMV_LOOP_CFG, splitk)):
        tkl.w8a16_matmul_triton(x, w, w_scale, path="gemv", config=cfg)
        assert rec.calls[-1]["PDL"] is True and rec.calls[-1]["launch_pdl"] is True
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tkl.w8a16_matmul_triton(x, w, w_scale, path="gemv", config=GEMV_CFG)
    assert "PDL" not in gemv.calls[-1] and "launch_pdl" not in gemv.calls[-1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl, "pdl_capable", lambda device: False)  # sm_80
    tkl.w8a16_matmul_triton(x, w, w_scale, path="gemv", config=GEMV_CFG)
    assert "PDL" not in gemv.calls[-1] and "launch_pdl" not in gemv.calls[-1]


class _FakeConfig:
    def __init__(self, **kw):
        self.kwargs, self.num_warps, self.num_stages = kw, 8, 3


class _Recorder:
    """Stands in for a Triton kernel / autotuner: records how it was launched, never compiles anything."""

    def __init__(self, best=None):
        self.calls, self.best_config = [], best

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append(kw)


def test_no_autotuning_during_graph_capture(monkeypatch):
    """A launch while the stream captures a CUDA graph never runs the autotuner (its benchmark launches and syncs
    would break the capture): it takes the config the same shape settled on before the capture (tuned ahead by
    the warm-up), else the bucket's first config. Outside a capture the autotuner runs. Mocked: no GPU here."""
    monkeypatch.setattr(tkl, "autotuning", lambda: True)
    monkeypatch.setattr(tkl, "interpreting", lambda: False)  # as on a GPU
    capturing = [False]
    monkeypatch.setattr(tkl, "_capturing", lambda: capturing[0])
    tuned, kernel = _Recorder(best=_FakeConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, GROUP_M=1)), _Recorder()
    a = torch.zeros(8, 64, dtype=torch.int8)
    args = (a, a, a, a, a, a, 8, 8, 64, 64, 1, 64, 1, 8, 1)
    flags = dict(HAS_A_SCALE=True, HAS_B_SCALE=True, HAS_BIAS=False, EPILOGUE=True)
    monkeypatch.setattr(tkl, "_TUNED", {})
    for M in (1, 8):  # w8a8 at M <= 16: buckets 1 and 16
        capturing[0] = True  # a capture before any tuning of this shape: the bucket's first config, no sweep
        tkl._launch(tuned, kernel, M, 8, 64, args, flags, None)
        first = tkp.configs_for(tkp.tune_bucket(M))[0]
        assert not tuned.calls and kernel.calls[-1]["BLOCK_N"] == first.kwargs["BLOCK_N"]
        assert kernel.calls[-1]["num_warps"] == first.num_warps
        capturing[0] = False  # the warm-up outside the capture tunes
        tkl._launch(tuned, kernel, M, 8, 64, args, flags, None)
        assert len(tuned.calls) == 1
        capturing[0] = True  # the capture replays the tuned choice, still without a sweep
        tkl._launch(tuned, kernel, M, 8, 64, args, flags, None)
        assert len(tuned.calls) == 1 and kernel.calls[-1]["BLOCK_N"] == 128 and kernel.calls[-1]["num_stages"] == 3
        tuned.calls.clear()
    capturing[0] = True  # another K: not tuned, back to the first config
    tkl._launch(tuned, kernel, 1, 8, 128, args, flags, None)
    assert not tuned.calls and kernel.calls[-1]["BLOCK_N"] == tkp.configs_for(1)[0].kwargs["BLOCK_N"]


def test_w8a16_unaligned_weight_reason_and_warning():
    """The aligned fast path's conditions (Triton's 16-divisibility and unit-stride specializations) are named for
    any weight view that misses them; on CUDA the op warns once per view shape (never a silent 4x slowdown)."""
    from arkernels.ops import int8_matmul as ops_mod

    w = torch.zeros(64, 2 * 4096, dtype=torch.int8)
    assert tkp.weight_unaligned_reason(w[:, :4096]) is None  # a padded view: rows 16-byte aligned
    assert "not multiples of 16" in tkp.weight_unaligned_reason(torch.zeros(64, 4099, dtype=torch.int8))
    assert "not multiples of 16" in tkp.weight_unaligned_reason(w[:, :4099])
    assert "not K-contiguous" in tkp.weight_unaligned_reason(torch.zeros(4096, 64, dtype=torch.int8).t())
    shifted = torch.zeros(64 * 4096 + 16, dtype=torch.int8)[3:3 + 64 * 4096].view(64, 4096)
    assert shifted.data_ptr() % 16 and "past a 16-byte boundary" in tkp.weight_unaligned_reason(shifted)
    ops_mod._UNALIGNED_SEEN.clear()
    odd = torch.zeros(8, 4099, dtype=torch.int8)
    with pytest.warns(UserWarning, match=r"w8a16_matmul: the int8 weight \(8, 4099\) is rows of 4099 bytes"):
        ops_mod._warn_unaligned(odd)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops_mod._warn_unaligned(odd)  # once per view shape
        ops_mod._warn_unaligned(torch.zeros(8, 4096, dtype=torch.int8))  # aligned: silent


def test_autotune_buckets_follow_m():
    """Every power of two up to 8192 is its own tuning bucket (then one above); a bucket tries its family's configs
    no taller than itself, always at least the family's first; the new deep-K large tiles keep wgmma's rules."""
    Ms = [1, 2, 16, 17, 33, 64, 65, 200, 512, 4095, 4096, 8192, 8193, 100000]
    assert [tkp.tune_bucket(m) for m in Ms] == [1, 16, 16, 32, 64, 64, 128, 256, 512, 4096, 4096, 8192, tk.LARGE_M,
                                                tk.LARGE_M]
    for m in Ms:
        b = tkp.tune_bucket(m)
        for fp32 in (False, True):
            family = (tk.FP32_DOT_CONFIGS_BY_CLASS if fp32 else tk.CONFIGS_BY_CLASS)[tkp.m_class(b)]
            cfgs = tkp.configs_for(b, fp32)
            assert cfgs and cfgs[0] is family[0] and all(c.kwargs["BLOCK_M"] <= max(b, 16) for c in cfgs)
    assert [c.kwargs["BLOCK_M"] for c in tkp.configs_for(128)] == [128, 128, 128, 128, 64, 64, 128]
    assert len(tkp.configs_for(tk.LARGE_M)) == len(tk.CONFIGS_BY_CLASS[tk.LARGE_M]) == 9
    assert all(c.kwargs["BLOCK_M"] % 64 == 0 and c.num_warps % 4 == 0 for c in tkp.configs_for(8192))
    # shared memory: every int8 config fits sm_90; w8a16 with a bf16 x drops exactly the two that do not
    x16, i8 = torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int8)
    assert tkl._prune_by_class(tk.ALL_CONFIGS, {"M_CLASS": 8192, "a_ptr": i8}) == tkp.configs_for(8192)
    dropped = [c for c in tkp.configs_for(8192) if c not in tkl._prune_by_class(
        tkl._w8a16_matmul_tuned.configs, {"M_CLASS": 8192, "x_ptr": x16}, DOT_FP32=False)]
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages) for c in dropped] == [(256, 128, 3), (128, 256, 4)]


def _strided_vectors(M, N, gen, device):
    """Scale and bias vectors that are not unit-stride, made as views on ``device`` (a copy to another device
    would make them contiguous): a column of a [M, 3] table, one per-tensor scale expanded to [N] (stride 0), every
    other element of a [2N] bias. The Triton kernels read these vectors at unit stride."""
    a_scale = (torch.rand(M, 3, generator=gen) * 0.05 + 1e-3).to(device)[:, 1]
    b_scale = torch.tensor(2e-3, device=device).expand(N)
    bias = torch.randn(2 * N, generator=gen).to(device)[::2]
    assert a_scale.stride(0) == 3 and b_scale.stride(0) == 0 and bias.stride(0) == 2
    return a_scale, b_scale, bias


def _check_scaled(got, a, b, a_scale, b_scale, bias):
    a_scale, b_scale, bias = a_scale.cpu(), b_scale.cpu(), bias.cpu()
    _float_close(got, int8_matmul_ref(a, b, a_scale, b_scale, bias), got.dtype,
                 int8_matmul_ref(a.double().abs(), b.double().abs(), a_scale, b_scale) + bias.abs().double())


@pytest.mark.parametrize("tile", [SMALL_TILE, LARGE_TILE])
def test_int8_matmul_triton_strided_scales_and_bias(tile):
    gen = torch.Generator().manual_seed(16)
    M, K, N = 9, 96, 130
    a, b = _operands(M, K, N, gen)
    a_scale, b_scale, bias = _strided_vectors(M, N, gen, TRITON_DEVICE)
    got = tkl.int8_matmul_triton(a.to(TRITON_DEVICE), b.to(TRITON_DEVICE), a_scale, b_scale, bias, torch.float32,
                                 config=tile)
    _check_scaled(got, a, b, a_scale, b_scale, bias)


def test_w8a16_matmul_triton_strided_scale_and_bias():
    gen = torch.Generator().manual_seed(17)
    x, w, _, _ = _w8a16_case(5, 96, 130, torch.float32, gen)
    _, w_scale, bias = _strided_vectors(1, 130, gen, TRITON_DEVICE)
    got = tkl.w8a16_matmul_triton(x.to(TRITON_DEVICE), w.to(TRITON_DEVICE), w_scale, bias, config=SMALL_TILE)
    _check_w8a16(got.cpu(), x, w, w_scale.cpu(), bias.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_int8_ops_strided_scales_and_bias(device):
    """Through the ops (the Triton kernels on a GPU): non-unit-stride scale and bias vectors."""
    gen = torch.Generator().manual_seed(18)
    M, K, N = 7, 96, 130
    a, b = _operands(M, K, N, gen)
    a_scale, b_scale, bias = _strided_vectors(M, N, gen, device)
    _check_scaled(int8_matmul(a.to(device), b.to(device), a_scale, b_scale, bias, out_dtype=torch.float32),
                  a, b, a_scale, b_scale, bias)
    x, w, _, _ = _w8a16_case(M, K, N, torch.float32, gen)
    _check_w8a16(w8a16_matmul(x.to(device), w.to(device), b_scale, bias).cpu(), x, w, b_scale.cpu(), bias.cpu())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_rowwise_triton(dtype):
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(6, 2 * 300, generator=gen) * 3).to(dtype)[:, ::2]  # strided rows
    x[2] = 0
    q, scale = tkl.quantize_rowwise_triton(x.to(TRITON_DEVICE))
    _assert_quant_matches(q, scale, x)
    assert scale[2] == 1 and not q[2].any()


@pytest.mark.parametrize("K", [8, tkl.ONE_PASS_MAX_K + 8])  # the one-pass and the two-pass paths
def test_quantize_rowwise_triton_rounds_half_away_from_zero(K):
    ties = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 2.4999, -126.5, 0.0])
    x = torch.zeros(1, K)
    x[0, -8:] = ties  # in the last (masked) block of the two-pass path
    q, scale = tkl.quantize_rowwise_triton(x.to(TRITON_DEVICE))
    assert scale.item() == 1.0
    assert q[0, -8:].cpu().tolist() == [127, 1, -1, 2, -3, 2, -127, 0] and not q[0, :-8].any()


def test_quantize_rowwise_triton_two_pass_long_rows():
    """Rows longer than ONE_PASS_MAX_K take the two-pass (absmax, then quantize) path."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, tkl.ONE_PASS_MAX_K + 37, generator=gen)
    x[1, -1] = 50.0  # the absmax sits in the masked tail block
    q, scale = tkl.quantize_rowwise_triton(x.to(TRITON_DEVICE))
    _assert_quant_matches(q, scale, x)
    assert q[1, -1] == 127


def test_autotune_shape_classes():
    """Decode never sweeps: every M <= 16 maps to two classes whose configs are small-M tiles; large-M configs
    satisfy Hopper's int8 wgmma constraints."""
    assert [tkp.m_class(m) for m in (1, 2, 16, 17, 64, 65, 8192)] == [1, 16, 16, 64, 64, tk.LARGE_M, tk.LARGE_M]
    for mc, configs in tk.CONFIGS_BY_CLASS.items():
        assert tkl._prune_by_class(tk.ALL_CONFIGS, {"M_CLASS": mc}) == configs
    assert all(c.kwargs["BLOCK_M"] == 16 for c in tk.CONFIGS_BY_CLASS[16])
    assert all(c.kwargs["BLOCK_M"] % 64 == 0 and c.num_warps % 4 == 0 for c in tk.CONFIGS_BY_CLASS[tk.LARGE_M])
    assert tkl._int8_matmul_tuned.keys == ["M_CLASS", "N", "K"]


def test_autotune_fp32_w8a16_gets_shallow_k_tiles():
    """fp32 x on a GPU runs an FMA dot: only its own shallow-K tiles are tuned (the tensor-core tiles spill, exceed
    shared memory and take minutes of ptxas on sm_90); bf16/fp16 x never sees them."""
    tuned = tkl._w8a16_matmul_tuned.configs
    for mc in (1, 16, 64, tk.LARGE_M):
        fp32 = tkl._prune_by_class(tuned, {"M_CLASS": mc}, HAS_BIAS=True, DOT_FP32=True)
        assert fp32 == tk.FP32_DOT_CONFIGS_BY_CLASS[mc] and all(c.kwargs["BLOCK_K"] <= 32 for c in fp32)
        assert tkl._prune_by_class(tuned, {"M_CLASS": mc}, HAS_BIAS=True, DOT_FP32=False) == tk.CONFIGS_BY_CLASS[mc]


# ------------------------------------------------------------------------------------------------ bad inputs
def _raises(fn, op, arg):
    with pytest.raises((ValueError, TypeError), match=rf"{op}: .*{arg}"):
        fn()


@pytest.mark.parametrize("device", DEVICES)
def test_int8_matmul_bad_inputs(device):
    i8 = lambda *s: torch.zeros(*s, dtype=torch.int8, device=device)  # noqa: E731
    f32 = lambda *s: torch.ones(*s, device=device)  # noqa: E731
    a, b = i8(4, 32), i8(8, 32)
    _raises(lambda: int8_matmul(f32(4, 32), b), "int8_matmul", "a must be int8")
    _raises(lambda: int8_matmul(a, b.int()), "int8_matmul", "b must be int8")
    _raises(lambda: int8_matmul(a, i8(8, 33)), "int8_matmul", "K mismatch")
    _raises(lambda: int8_matmul(i8(2, 4, 32), b), "int8_matmul", "a must be 2-D")
    _raises(lambda: int8_matmul(a, i8(32)), "int8_matmul", "b must be 2-D")
    _raises(lambda: int8_matmul(a, b, f32(5), f32(8)), "int8_matmul", r"a_scale must have shape \[M=4\]")
    _raises(lambda: int8_matmul(a, b, f32(4), f32(8).half()), "int8_matmul", "b_scale must be torch.float32")
    _raises(lambda: int8_matmul(a, b, f32(4), f32(4, 2)), "int8_matmul", "b_scale must have shape")
    _raises(lambda: int8_matmul(a, b, f32(4), f32(8), f32(7)), "int8_matmul", "bias must have shape")
    _raises(lambda: int8_matmul(a, b, f32(4), f32(8), out_dtype=torch.int8), "int8_matmul", "out_dtype")
    _raises(lambda: int8_matmul(a, b, f32(4).to("meta"), f32(8)), "int8_matmul", "a_scale is on meta")


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_and_quantize_bad_inputs(device):
    i8 = lambda *s: torch.zeros(*s, dtype=torch.int8, device=device)  # noqa: E731
    x, w, s = torch.ones(3, 32, dtype=torch.float16, device=device), i8(8, 32), torch.ones(8, device=device)
    _raises(lambda: w8a16_matmul(i8(3, 32), w, s), "w8a16_matmul", "x must be float16")
    _raises(lambda: w8a16_matmul(x, w.half(), s), "w8a16_matmul", "w must be int8")
    _raises(lambda: w8a16_matmul(x, i8(8, 31), s), "w8a16_matmul", "K mismatch")
    _raises(lambda: w8a16_matmul(x, w, s.half()), "w8a16_matmul", "w_scale must be torch.float32")
    _raises(lambda: w8a16_matmul(x, w, s[:7]), "w8a16_matmul", r"w_scale must have shape \[N=8\]")
    _raises(lambda: w8a16_matmul(x, w, s, s[:3]), "w8a16_matmul", "bias must have shape")
    _raises(lambda: w8a16_matmul(x, i8(2, 8, 2, 16), s), "w8a16_matmul", "w must be 2-D")
    # 3-D: the packed layout [N, K // 16, 16], contiguous, K from its shape
    _raises(lambda: w8a16_matmul(x, i8(8, 4, 8), s), "w8a16_matmul", r"the packed layout \[N, K // 16, 16\]")
    _raises(lambda: w8a16_matmul(x, i8(8, 16, 2).transpose(1, 2), s), "w8a16_matmul", "packed layout")
    _raises(lambda: w8a16_matmul(x, i8(8, 3, 16), s), "w8a16_matmul", r"K mismatch.*\(8, 48\)")
    assert w8a16_matmul(x, i8(8, 2, 16), s).shape == (3, 8)
    _raises(lambda: quantize_per_channel(torch.ones(2, 3, 4, device=device)), "quantize_per_channel", "w must be 2-D")
    _raises(lambda: quantize_per_token(i8(3, 32)), "quantize_rowwise", "x must be float32")


# ------------------------------------------------------------------------------------------------ torch.library
def test_int8_ops_registered_for_cpu_and_cuda():
    report = arkernels.kernels_report()
    for op in ("quantize_rowwise", "int8_matmul", "w8a16_matmul"):
        assert report[op] == ["CPU", "CUDA"], (op, report[op])


def test_int8_opcheck():
    gen = torch.Generator().manual_seed(14)
    a, b = _operands(5, 34, 24, gen)
    a_scale, b_scale, bias = torch.rand(5), torch.rand(24) * 1e-2, torch.randn(24)
    ops = torch.ops.arkernels
    torch.library.opcheck(ops.quantize_rowwise.default, (torch.randn(5, 34),))
    torch.library.opcheck(ops.int8_matmul.default, (a, b, None, None, None, None))
    torch.library.opcheck(ops.int8_matmul.default, (a, b, a_scale, b_scale, bias, torch.float16))
    x, w, w_scale, bias = _w8a16_case(5, 34, 24, torch.bfloat16, gen)
    torch.library.opcheck(ops.w8a16_matmul.default, (x, w, w_scale, bias))
    x, w, w_scale, bias = _w8a16_case(5, 48, 24, torch.bfloat16, gen)
    torch.library.opcheck(ops.w8a16_matmul.default, (x, pack_weight(w), w_scale, bias))


def test_int8_compile_fullgraph():
    gen = torch.Generator().manual_seed(15)
    w = torch.randn(24, 34, generator=gen)
    w_q, w_s = quantize_per_channel(w)

    def w8a8(x):
        x_q, x_s = quantize_per_token(x)
        return int8_matmul(x_q, w_q, x_s, w_s, out_dtype=torch.float32) + w8a16_matmul(x, w_q, w_s)

    x = torch.randn(2, 3, 34, generator=gen).reshape(6, 34)
    compiled = torch.compile(w8a8, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), w8a8(x))


def test_autotune_switch(monkeypatch):
    """ARKERNELS_AUTOTUNE=0 turns the GPU sweeps off (the GPU check's test step); the interpreter never sweeps."""
    from arkernels.triton import int8_matmul_launch as tkl

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("ARKERNELS_AUTOTUNE", "1")
    assert tkl.autotuning()
    monkeypatch.setenv("ARKERNELS_AUTOTUNE", "0")
    assert not tkl.autotuning()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ARKERNELS_AUTOTUNE", "1")
    assert not tkl.autotuning()


if __name__ == "__main__":  # the offline sm_90 compile's subprocess (see _compile_sm90)
    import json
    import sys

    _compile_sm90_here(*json.loads(sys.argv[1]))
