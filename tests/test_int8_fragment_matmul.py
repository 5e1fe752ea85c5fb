"""w8a16_fragment_matmul (the hand-written CUDA decode GEMV on the fragment layout, csrc/int8_matmul*.{cu,cuh,cpp})
against the float64 reference, on the CPU kernel, the CUDA source in the SIMT emulator and (when present) a GPU."""
import mmap

import pytest
import torch

from arkernels.ops.int8_matmul import w8a16_fragment_matmul
from arkernels.ops.int8_matmul_layout import fragment_weight
from arkernels.reference.int8_matmul import w8a16_matmul_ref
from conftest import CUDA_KERNEL_DEVICES, DEVICES, SIMT_DEVICES, runs_cuda_kernel

DTYPES = [torch.float16, torch.bfloat16]
# (M, N, K): decode rows 1 / 3 / 16; N with a short last group (4016 + 5), an odd column count (272 = 17 groups: the
# last CTA column holds one group), a K tail (K % 32 == 16), K of a tail only, and shapes that split K (272 x 1040:
# 2 splits on both devices; 4021 x 2064: 4 splits on sm_90, 3 on sm_80) or not (32 x 64), and a K range of 20 units
# (64 x 656: 2 whole steps of 8 units and a partial one, in columns with no short or missing group: the checked loop).
SHAPES = [(1, 272, 1040), (3, 4021, 2064), (16, 272, 1040), (1, 32, 64), (3, 17, 48), (16, 37, 16), (5, 100, 528),
          (4, 64, 656)]
# fp32 accumulation of K products: |error| <= ~K 2^-24 sum |x w|; then one rounding to the output dtype.
OUT_EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def make_inputs(M, N, K, dtype, device, bias_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    scale = torch.rand(N, generator=g) * 0.02 + 0.001
    bias = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dev(x), w, dev(fragment_weight(w)), dev(scale), dev(bias)


def assert_close_to_ref(y, x, w, scale, bias):
    ref = w8a16_matmul_ref(x.cpu(), w, scale.cpu(), None if bias is None else bias.cpu())
    mag = (x.cpu().double().abs() @ w.double().abs().T) * scale.cpu().double()
    bound = OUT_EPS[y.dtype] * ref.abs() + 2.0 ** -20 * mag + 1e-6
    err = (y.cpu().double() - ref).abs()
    assert torch.isfinite(y.cpu()).all()
    assert (err <= bound).all(), f"max err {err.max().item()} at {divmod(int(err.argmax()), y.shape[1])}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_w8a16_fragment_matmul_matches_reference(device, dtype, M, N, K):
    x, w, wf, scale, bias = make_inputs(M, N, K, dtype, device)
    y = w8a16_fragment_matmul(x, wf, scale, bias)
    assert y.shape == (M, N) and y.dtype == dtype
    assert_close_to_ref(y, x, w, scale, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_dtype", [None, torch.float16, torch.bfloat16, torch.float32])
def test_w8a16_fragment_matmul_bias_kinds(device, bias_dtype):
    x, w, wf, scale, bias = make_inputs(3, 272, 1040, torch.float16, device, bias_dtype, seed=1)
    assert_close_to_ref(w8a16_fragment_matmul(x, wf, scale, bias), x, w, scale, bias)


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_fragment_matmul_non_contiguous_x(device):
    x, w, wf, scale, bias = make_inputs(3, 100, 528, torch.bfloat16, device, seed=2)
    wide = torch.zeros(3, 600, dtype=x.dtype, device=x.device)
    wide[:, 40:568] = x
    rows = wide[:, 40:568]  # row stride 600: read in place
    cols = torch.stack([x, x], 2).view(3, 2 * 528)[:, ::2]  # column stride 2: copied
    assert not rows.is_contiguous() and not cols.is_contiguous()
    for view in (rows, cols):
        assert_close_to_ref(w8a16_fragment_matmul(view, wf, scale, bias), x, w, scale, bias)
    x3 = x.view(3, 1, 528)  # leading dims are flattened
    assert w8a16_fragment_matmul(x3, wf, scale, bias).shape == (3, 1, 100)


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_fragment_matmul_more_than_16_rows(device):
    x, w, wf, scale, bias = make_inputs(37, 48, 1040, torch.float16, device, seed=3)
    assert_close_to_ref(w8a16_fragment_matmul(x, wf, scale, bias), x, w, scale, bias)


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_fragment_matmul_extremes(device):
    """Every int8 value, -128 included, and large activations: the in-register conversion must be exact."""
    N, K = 48, 272
    w = torch.arange(N * K, dtype=torch.int64).remainder(256).sub(128).to(torch.int8).view(N, K)
    x = torch.full((2, K), 1.0, dtype=torch.float16)
    x[1] = -0.5
    scale = torch.ones(N)
    y = w8a16_fragment_matmul(x.to(device), fragment_weight(w).to(device), scale.to(device))
    ref = w8a16_matmul_ref(x, w, scale)
    assert torch.equal(y.cpu().double(), ref.half().double())  # integer sums below 2^11: exact in fp16


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_fragment_matmul_degenerate(device):
    x, w, wf, scale, bias = make_inputs(2, 16, 16, torch.float16, device)
    assert w8a16_fragment_matmul(x[:0], wf, scale, bias).shape == (0, 16)
    assert w8a16_fragment_matmul(x, wf[:0], scale[:0], bias[:0]).shape == (2, 0)
    y = w8a16_fragment_matmul(x[:, :0], wf[:, :0], scale, bias)
    assert torch.equal(y.cpu(), bias.cpu().half().expand(2, 16))


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
@pytest.mark.parametrize("M,N,K", [(3, 4021, 2064), (16, 272, 1040)])
def test_w8a16_fragment_matmul_deterministic(device, M, N, K):
    """Split-K partial sums are added in split order by whichever CTA arrives last: equal bits run to run and whatever
    order the CTAs run in (the emulator permutes them)."""
    import arkernels.simt as simt

    x, w, wf, scale, bias = make_inputs(M, N, K, torch.bfloat16, device, seed=4)
    first = w8a16_fragment_matmul(x, wf, scale, bias)
    if isinstance(device, str) and device != "cuda":
        for order in (3, 11):
            with simt.emulate(block_order=order):
                assert torch.equal(w8a16_fragment_matmul(x, wf, scale, bias), first)
    assert torch.equal(w8a16_fragment_matmul(x, wf, scale, bias), first)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("sm,splits", [("sm_90", 4), ("sm_80", 3)])
def test_w8a16_fragment_plan_follows_the_device(device, sm, splits):
    """Split K only where the columns alone cannot keep 3 CTAs on every SM; the count follows the SM count."""
    import arkernels.simt as simt

    x, w, wf, scale, bias = make_inputs(1, 4021, 2064, torch.float16, device, seed=5)
    with simt.emulate(device=sm):
        y = w8a16_fragment_matmul(x, wf, scale, bias)
        (launch,) = simt.launches()
    assert launch["grid"] == (126, splits, 1) and launch["threads"] == 128
    assert launch["pdl"] == (sm == "sm_90")
    if sm == "sm_90":
        assert launch["triggered"] == 126 * splits  # every CTA lets its successor launch
    assert_close_to_ref(y, x, w, scale, bias)
    for shape, grid in (((1, 12800, 1024), (400, 1, 1)), ((1, 32, 64), (1, 1, 1)), ((1, 272, 1040), (9, 2, 1))):
        xx, ww, wwf, ss, _ = make_inputs(*shape, torch.float16, device, bias_dtype=None)
        with simt.emulate(device=sm):
            w8a16_fragment_matmul(xx, wwf, ss)
            assert simt.launches()[0]["grid"] == grid, shape


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("M,N,K", [(1, 272, 1040), (16, 37, 528), (3, 4021, 2064)])
def test_w8a16_fragment_reads_every_weight_byte_once(device, M, N, K):
    """Each weight byte is loaded exactly once (a wrong lane or unit offset reads some twice and others never), the
    scale once per output row pass, x only in its M rows."""
    import arkernels.simt as simt

    x, w, wf, scale, bias = make_inputs(M, N, K, torch.float16, device, seed=6)
    w8a16_fragment_matmul(x, wf, scale, bias)
    reads, writes = simt.traffic_map("w")
    assert torch.equal(reads, torch.ones_like(reads)) and int(writes.sum()) == 0
    x_reads, _ = simt.traffic_map("x")
    assert int(x_reads.min()) >= 1  # every element of every real row is read


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_fragment_matmul_offsets_past_2_31(device):
    """x rows 2^36 + 128 bytes apart in a sparse mapping: an x offset computed in 32 bits wraps into row 0."""
    K, N = 528, 48
    stride_bytes = 2 ** 36 + 128
    if device == "cuda":
        flat = torch.zeros(stride_bytes + 2 * K, dtype=torch.uint8, device="cuda")
    else:
        mm = mmap.mmap(-1, stride_bytes + 2 * K, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    x = flat.view(torch.float16).as_strided((2, K), (stride_bytes // 2, 1))
    g = torch.Generator().manual_seed(9)
    dense = torch.randn(2, K, generator=g).half()
    x.copy_(dense.to(x.device))
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    scale = torch.rand(N, generator=g) * 0.02
    y = w8a16_fragment_matmul(x, fragment_weight(w).to(x.device), scale.to(x.device))
    assert_close_to_ref(y, dense, w, scale, None)


@pytest.mark.parametrize("device", DEVICES)
def test_w8a16_fragment_matmul_bad_inputs(device):
    x, w, wf, scale, bias = make_inputs(2, 32, 64, torch.float16, device)
    cases = [
        ((x, w.to(device), scale, bias), "fragment layout"),
        ((x, wf.float(), scale, bias), "int8|Char"),
        ((x[:, :48], wf, scale, bias), "K mismatch"),
        ((x, wf, scale[:16], bias), "w_scale must have shape"),
        ((x, wf, scale.half(), bias), "w_scale must be"),
        ((x, wf, scale, bias[:8]), "bias must have shape"),
        ((x.int(), wf, scale, bias), "x must be float16 or bfloat16"),
        ((x[0], wf, scale, bias), "x must be 2-D"),
    ]
    for args, msg in cases:
        with pytest.raises((RuntimeError, ValueError, TypeError), match=f"w8a16_fragment_matmul.*({msg})"):
            torch.ops.arkernels.w8a16_fragment_matmul(*args)
    if runs_cuda_kernel(device):  # fp32 x: the CPU kernel's only
        with pytest.raises(RuntimeError, match="w8a16_fragment_matmul: the CUDA kernel takes x float16 or bfloat16"):
            torch.ops.arkernels.w8a16_fragment_matmul(x.float(), wf, scale, bias)
    else:
        assert_close_to_ref(w8a16_fragment_matmul(x.float(), wf, scale, bias).half(), x, w, scale, bias)


def test_w8a16_fragment_matmul_opcheck():
    x, w, wf, scale, bias = make_inputs(3, 37, 80, torch.bfloat16, "cpu")
    op = torch.ops.arkernels.w8a16_fragment_matmul.default
    torch.library.opcheck(op, (x, wf, scale, bias))
    torch.library.opcheck(op, (x[:1], wf[:32], scale[:32], None))


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("M,N,K", [(1, 272, 1040), (3, 37, 528), (15, 4021, 2064)])
def test_w8a16_fragment_touches_only_its_rows(device, M, N, K):
    """x is the first M rows of a 16-row buffer: rows M.. are never read; every output byte is written once; nothing
    outside the named buffers (x, w, w_scale, bias, y, the split workspace and counters) is touched."""
    import arkernels.simt as simt

    x, w, wf, scale, bias = make_inputs(16, N, K, torch.float16, device, seed=10)
    y = w8a16_fragment_matmul(x[:M], wf, scale, bias)
    x_reads, _ = simt.traffic_map("x")
    row_bytes = K * 2
    assert int(x_reads[M * row_bytes:].sum()) == 0, "rows past M read"
    assert int(x_reads[:M * row_bytes].min()) >= 1
    _, y_writes = simt.traffic_map("y")
    assert torch.equal(y_writes, torch.ones_like(y_writes))
    assert simt.traffic()["other"] == (0, 0)
    assert_close_to_ref(y, x[:M], w, scale, bias)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block", [9, 17])
def test_w8a16_fragment_recovers_from_an_aborted_launch(device, block):
    """A launch that dies with a split CTA missing (block 9: column 0 of split 1; 17: the last column's) leaves its
    columns' counters short of their count: the next launches' epochs must erase that, never count it, and calls of
    other shapes on the same stream's counters must be right too."""
    import arkernels.simt as simt

    x, w, wf, scale, bias = make_inputs(1, 272, 1040, torch.float16, device, seed=11)  # 9 columns x 2 splits
    good = w8a16_fragment_matmul(x, wf, scale, bias)
    simt.abort_block_of_next_launch(block)
    w8a16_fragment_matmul(x, wf, scale, bias)  # its output is undefined (a column never reduced)
    for _ in range(2):
        assert torch.equal(w8a16_fragment_matmul(x, wf, scale, bias), good)
    x2, w2, wf2, scale2, bias2 = make_inputs(3, 4021, 2064, torch.float16, device, seed=12)
    assert_close_to_ref(w8a16_fragment_matmul(x2, wf2, scale2, bias2), x2, w2, scale2, bias2)
    assert torch.equal(w8a16_fragment_matmul(x, wf, scale, bias), good)
