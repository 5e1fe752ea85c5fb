"""int8 matmul: W8A16 (weight-only) and W8A8 (int8 tensor cores) against F.linear in bf16 and torch._int_mm.

Shapes: the Llama-8B projections (N x K) 4096x4096 (q/o), 14336x4096 (gate/up), 4096x14336 (down), M from 1
(decode) to 8192 (prefill). TFLOP/s counts 2*M*N*K; GB/s counts the bytes each implementation must move at least
(activations, weights, scales, output: an int8 weight is half the bytes of a bf16 one, which is where W8A16's
decode speed-up comes from). ``ratio_vs_linear`` is the F.linear time (bf16 on a GPU, fp32 on the CPU) over
this implementation's time, both measured in this run. Every implementation is checked against the float64
reference (a few rows) before timing.

The first GPU run includes Triton's autotune sweeps: one per (kernel, M class, N, K, output dtype), about 36 for
the default sweep; ``--shapes 14336x4096 --ms 1 16 4096`` is the short form that covers both goals.

GPU goals (issue 5, H200): w8a16 at M = 1..16 on 14336x4096 >= 1.8x bf16; w8a8 at M = 4096 >= 1.7x bf16.
On the CPU (``--quick``, CI) the ops run their CPU implementations in fp32; the figures there only show the
benchmark works.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, timeit, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.reference.int8_matmul import int8_matmul_ref, w8a16_matmul_ref  # noqa: E402

LLAMA_8B = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K) = (out_features, in_features)
MS_GPU = [1, 4, 16, 64, 256, 1024, 4096, 8192]
QUICK_SHAPES = [(1024, 512), (512, 1024)]
MS_QUICK = [1, 16, 128]


def _check_rows(M):
    return sorted({0, M // 2, M - 1})  # first, middle, last row: every row is independent of the others


def _assert_close(got, ref, dtype, abs_terms, what):
    """One rounding to dtype plus fp32 accumulation error (64 eps of the sum of |terms|)."""
    tol = torch.finfo(dtype).eps * ref.abs() + 64 * torch.finfo(torch.float32).eps * abs_terms
    err = (got.cpu().double() - ref).abs()
    assert bool((err <= tol).all()), f"{what}: max error {err.max().item():.3g} exceeds the tolerance"


def check(x, w_q, w_s, x_q, x_s, dtype):
    """Every arkernels implementation against the float64 reference on a few rows, before any timing."""
    rows = _check_rows(x.shape[0])
    xr, xqr, xsr = x[rows].cpu(), x_q[rows].cpu(), x_s[rows].cpu()
    wq, ws = w_q.cpu(), w_s.cpu()
    got = arkernels.w8a16_matmul(x, w_q, w_s)[rows]
    _assert_close(got, w8a16_matmul_ref(xr, wq, ws), dtype,
                  w8a16_matmul_ref(xr.double().abs(), wq.double().abs(), ws), "w8a16_matmul")
    got = arkernels.int8_matmul(x_q, w_q)[rows]
    assert torch.equal(got.cpu().double(), int8_matmul_ref(xqr, wq)), "int8_matmul (int32) is not exact"
    got = arkernels.int8_matmul(x_q, w_q, x_s, w_s, out_dtype=dtype)[rows]
    _assert_close(got, int8_matmul_ref(xqr, wq, xsr, ws), dtype,
                  int8_matmul_ref(xqr.double().abs(), wq.double().abs(), xsr, ws), "int8_matmul (scaled)")


def bench_shape(M, N, K, dtype, device):
    gen = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) * 0.02).to(dtype).to(device)
    w_q, w_s = arkernels.quantize_per_channel(w)
    x_q, x_s = arkernels.quantize_per_token(x)
    check(x, w_q, w_s, x_q, x_s, dtype)

    def w8a8_with_quant():  # what Int8Linear(mode="w8a8") runs: per-token quantization, then the matmul
        xq, xs = arkernels.quantize_per_token(x)
        return arkernels.int8_matmul(xq, w_q, xs, w_s, out_dtype=dtype)

    e = torch.tensor([], dtype=dtype).element_size()
    impls = {  # name: (fn, minimum bytes moved)
        "F.linear": (lambda: F.linear(x, w), e * (M * K + N * K + M * N)),
        "w8a16": (lambda: arkernels.w8a16_matmul(x, w_q, w_s), e * M * K + N * K + 4 * N + e * M * N),
        "w8a8": (lambda: arkernels.int8_matmul(x_q, w_q, x_s, w_s, out_dtype=dtype),
                 M * K + N * K + 4 * (M + N) + e * M * N),
        "w8a8+quant": (w8a8_with_quant,
                       e * M * K + M * K + N * K + 4 * (M + N) + e * M * N),  # per-token quantization included
    }
    if device != "cuda" or M > 16:  # cuBLAS int8 (torch._int_mm) needs M > 16 on CUDA
        impls["torch._int_mm"] = (lambda: torch._int_mm(x_q, w_q.t()), M * K + N * K + 4 * M * N)
    times = {name: timeit(fn, device=device) for name, (fn, _) in impls.items()}
    rows = []
    for name, (_, nbytes) in impls.items():
        t = times[name]
        rows.append(dict(shape=f"{N}x{K}", impl=name, series=f"{N}x{K} {name}", M=M, N=N, K=K, us=t * 1e6,
                         tflops=2 * M * N * K / t / 1e12, gbps=nbytes / t / 1e9,
                         ratio_vs_linear=times["F.linear"] / t, dtype=str(dtype).split(".")[-1],
                         device=device_name(device)))
    return rows


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", metavar="NxK", help="weight shapes (default: the Llama-8B ones on a GPU)")
    p.add_argument("--ms", nargs="+", type=int, help="values of M (default: 1 to 8192 on a GPU)")
    args = p.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the CPU path serves fp32 models
    small = args.quick or dev != "cuda"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else (
        QUICK_SHAPES if small else LLAMA_8B)
    ms = args.ms or (MS_QUICK if small else MS_GPU)
    rows = []
    for N, K in shapes:
        for M in ms:
            rows += bench_shape(M, N, K, dtype, dev)
    write_results(rows, args.out, "int8_matmul", plot=("M", "ratio_vs_linear", "series"),
                  title=f"int8 matmul vs F.linear ({str(dtype).split('.')[-1]}), {device_name(dev)}")
    print(f"device {device_name(dev)}, baseline F.linear in {dtype}; results in {args.out}/int8_matmul.*")
    print_table([r for r in rows if r["impl"] != "F.linear"],
                ["shape", "impl", "M", "us", "tflops", "gbps", "ratio_vs_linear"])


if __name__ == "__main__":
    main()
