"""w8a16 decode GEMV: the hand-written CUDA kernel on the fragment layout (``w8a16_fragment_matmul``,
csrc/int8_matmul_kernels.cuh) against the Triton w8a16 kernels on the packed layout (what ``Int8Linear(mode="w8a16")``
runs by default) and bf16 ``F.linear``, in one run, on the Llama-3-8B decode shapes (N x K = out x in features):
4096x4096 (q / o), 1024x4096 (k / v), 6144x4096 (fused qkv), 14336x4096 (gate / up), 28672x4096 (fused gate/up),
4096x14336 (down); M = 1, 4, 16.

Memory bound: the unit is GB/s of the bytes each implementation must move at least (x, the int8 weight, the fp32
scale, y) and ``pct_copy_bw``, that rate over the device-to-device copy bandwidth measured at the start of the run;
``ratio_vs_triton`` is the Triton packed time over this row's time (> 1: the CUDA kernel is faster). Every call rotates
over weight copies totalling >= 256 MB (a weight resident in the 50 MB L2 would overstate HBM rates). Each
implementation is checked against the float64 reference before timing. The issue's target (issue 34 item 1): >= 88%
of copy bandwidth at M = 1 (the Triton GEMV's estimate: 70-80%). ``Int8Linear(layout="fragment")`` becomes the
default only once these rows say so. On the CPU (``--quick``) the ops run their CPU kernels: the figures only show
that the benchmark works.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, timeit, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.ops.int8_matmul import w8a16_fragment_matmul  # noqa: E402
from arkernels.ops.int8_matmul_layout import fragment_weight, pack_weight  # noqa: E402
from arkernels.reference.int8_matmul import w8a16_matmul_ref  # noqa: E402

LLAMA_8B = [(4096, 4096), (1024, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336)]
MS = [1, 4, 16]
QUICK_SHAPES = [(272, 1040)]
ROTATE_BYTES = 256 << 20


def copy_bandwidth(device) -> float:
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timeit(lambda: dst.copy_(src), device=device) / 1e9


def check(name, y, x, w_q, w_s):
    """Within one output rounding (x's dtype) plus fp32 accumulation error of the float64 reference."""
    ref = w8a16_matmul_ref(x.cpu(), w_q.cpu(), w_s.cpu())
    mag = (x.cpu().double().abs() @ w_q.cpu().double().abs().T) * w_s.cpu().double()
    eps = 2.0 ** -8 if x.dtype == torch.bfloat16 else 2.0 ** -11 if x.dtype == torch.float16 else 1e-6
    err = (y.cpu().double() - ref).abs()
    if not bool((err <= eps * ref.abs() + 2.0 ** -18 * mag + 1e-6).all()):
        raise AssertionError(f"{name}: max error {err.max().item():.3g} against the float64 reference")


def bench_shape(M, N, K, dtype, device, copy_gbps):
    gen = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    e = x.element_size()

    def make():
        w = (torch.randn(N, K, generator=gen) * 0.02).to(dtype).to(device)
        w_q, w_s = arkernels.quantize_per_channel(w)
        return w, w_q, w_s, pack_weight(w_q), fragment_weight(w_q)

    copies = max(1, -(-ROTATE_BYTES // (N * K * (e + 3)))) if device == "cuda" else 1
    sets = [make() for _ in range(copies)]
    cycle = itertools.cycle(sets)
    w, w_q, w_s, w_p, w_f = sets[0]
    impls = {
        "F.linear": (lambda ws: F.linear(x, ws[0]), e * (M * K + N * K + M * N)),
        "triton-packed": (lambda ws: arkernels.w8a16_matmul(x, ws[3], ws[2]), e * M * K + N * K + 4 * N + e * M * N),
        "cuda-fragment": (lambda ws: w8a16_fragment_matmul(x, ws[4], ws[2]), e * M * K + N * K + 4 * N + e * M * N),
    }
    for name in ("triton-packed", "cuda-fragment"):
        check(name, impls[name][0](sets[0]), x, w_q, w_s)
    first = impls["cuda-fragment"][0](sets[0])
    assert torch.equal(impls["cuda-fragment"][0](sets[0]), first), "cuda-fragment: not deterministic"
    times = {name: timeit(lambda fn=fn: fn(next(cycle)), device=device) for name, (fn, _) in impls.items()}
    rows = []
    for name, (_, nbytes) in impls.items():
        t = times[name]
        gbps = nbytes / t / 1e9
        rows.append(dict(shape=f"{N}x{K}", impl=name, series=f"{N}x{K} {name}", M=M, N=N, K=K, us=t * 1e6, gbps=gbps,
                         pct_copy_bw=100 * gbps / copy_gbps, ratio_vs_triton=times["triton-packed"] / t,
                         dtype=str(dtype).split(".")[-1], device=device_name(device)))
    return rows


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", metavar="NxK", help="weight shapes (default: the Llama-3-8B ones on a GPU)")
    p.add_argument("--ms", nargs="+", type=int, help="values of M (default 1 4 16)")
    args = p.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the CPU kernels serve fp32 models
    small = args.quick or dev != "cuda"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else (
        QUICK_SHAPES if small else LLAMA_8B)
    ms = args.ms or MS
    copy_gbps = copy_bandwidth(dev)
    rows = [r for N, K in shapes for M in ms for r in bench_shape(M, N, K, dtype, dev, copy_gbps)]
    write_results(rows, args.out, "int8_fragment", plot=("M", "pct_copy_bw", "series"),
                  title=f"w8a16 decode GEMV, % of copy bandwidth ({str(dtype).split('.')[-1]}), {device_name(dev)}")
    print(f"device {device_name(dev)}, copy bandwidth {copy_gbps:.0f} GB/s; results in {args.out}/int8_fragment.*")
    print_table(rows, ["shape", "impl", "M", "us", "gbps", "pct_copy_bw", "ratio_vs_triton"])


if __name__ == "__main__":
    main()
