"""int8 matmul: W8A16 (weight-only) and W8A8 (int8 tensor cores) against bf16 F.linear, torch._int_mm and a
torch.compile'd plain-torch int8 weight-only linear, all measured in one run.

Shapes: the Llama-3-8B projections (N x K = out x in features) 4096x4096 (q/o), 6144x4096 (fused qkv),
14336x4096 (gate/up), 4096x14336 (down). Decode rows M = 1, 2, 4, 8, 16 are memory bound: the unit is GB/s of the
bytes each implementation must move at least (activations, weights, scales, output: an int8 weight is half the
bytes of a bf16 one) and ``pct_copy_bw``, that rate over the device-to-device copy bandwidth measured at the start
of the same run. Prefill rows M = 512 .. 8192 are compute bound: TFLOP/s (2*M*N*K). ``ratio_vs_linear`` is the
F.linear time (bf16 on a GPU, fp32 on the CPU) over this implementation's time.

Baselines: ``F.linear`` (cuBLAS), ``torch._int_mm`` (cuBLAS int8, int32 out, no scales; CUDA needs M > 16), and
``torch-int8-wo``: torchao's / gpt-fast's int8 weight-only recipe in plain torch, ``F.linear(x,
w_int8.to(x.dtype)) * scale``, under torch.compile (inductor fuses the cast into the matmul or, at small M, into a
reduction kernel; eager on the CPU, where inductor would need minutes of C++ compiles in CI).

Weights that fit in L2 (50 MB on an H200) would be re-read from it between timed calls and overstate HBM rates
1.5-2x: on a GPU every implementation rotates over enough weight copies (>= 256 MB) that each call reads HBM.
Every implementation is checked against the float64 reference (a few rows) before timing.

First GPU run: Triton autotune sweeps, one per (kernel, M bucket, N, K, dtype); configs compile once per kernel and
are reused across buckets, so a bucket costs its benchmark sweep (~9 configs), not its compiles. The decode paths
never sweep. ``--shapes 14336x4096 --ms 1 16 4096`` is the short form that covers both goals.

``w8a16-packed``: the same op on the packed weight layout (arkernels/ops/int8_matmul_layout.py, what
``Int8Linear(mode="w8a16")`` stores), checked to give the plain layout's bits at M <= 16 (one plan, the same
sums) and the reference's values at any M; ``w8a16`` is the plain ``[N, K]`` weight.

GEMV plan rows (M <= 4, packed weight, issue 34): ``w8a16-chunk`` (one split per 512 columns), ``w8a16-loop`` (the
K loop, one split: no workspace, no tickets), ``w8a16-nopdl`` (the planned call without programmatic dependent
launch; PDL overlaps a launch's weight prefetch with the previous launch's tail, which back-to-back timed calls
show). The plan takes the loop only for N that fills the machine alone (``--shapes 128256x4096``, the LM head).

Fused vs two-launch split-K reduce (decode rows, M <= 16): ``w8a16-fused`` and ``w8a16-2launch`` call the Triton
decode kernels directly with ``reduce="fused"`` (the last program of each tile adds the splits: one launch) and
``reduce="launch"`` (the previous design: partial sums, then a reduce kernel); both are checked to give the same
bits (and the reference's values) before timing. On a GPU in x's dtype (bf16); on the CPU only under
TRITON_INTERPRET=1, forcing the decode paths with fp32 x (the interpreter's dots run in fp32 anyway), where the
times only show the rows work.

GPU goals (issue 15, H200): w8a16 at M <= 16 >= 80% of copy bandwidth and >= 1.8x bf16 F.linear; w8a8 at
M = 4096 >= 1.7x bf16. On the CPU (``--quick``, CI) the ops run their CPU implementations in fp32; the figures
there only show the benchmark works.
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
from arkernels.ops.int8_matmul_layout import pack_weight  # noqa: E402
from arkernels.reference.int8_matmul import int8_matmul_ref, w8a16_matmul_ref  # noqa: E402
from arkernels.triton import int8_matmul_launch as tkl  # noqa: E402
from arkernels.triton import int8_matmul_plan as tkp  # noqa: E402

LLAMA_8B = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]  # (N, K) = (out_features, in_features)
MS_DECODE = [1, 2, 4, 8, 16]
MS_PREFILL = [512, 1024, 2048, 4096, 8192]
QUICK_SHAPES = [(1024, 512), (512, 1024)]
MS_QUICK = [1, 16, 128]
ROTATE_BYTES = 256 << 20  # > 5x the H200's 50 MB L2
DECODE_REDUCE_ROWS = ("w8a16-fused", "w8a16-2launch")  # the Triton decode kernels, reduce="fused" / "launch"
# the GEMV class's options on the packed weight (M <= 4): per-chunk GEMV, K loop (one split), the plan without PDL
GEMV_PLAN_ROWS = ("w8a16-chunk", "w8a16-loop", "w8a16-nopdl")


def _check_rows(M):
    return sorted({0, M // 2, M - 1})  # first, middle, last row: every row is independent of the others


def _assert_close(got, ref, dtype, abs_terms, what):
    """One rounding to dtype plus fp32 accumulation error (64 eps of the sum of |terms|)."""
    tol = torch.finfo(dtype).eps * ref.abs() + 64 * torch.finfo(torch.float32).eps * abs_terms
    err = (got.cpu().double() - ref).abs()
    assert bool((err <= tol).all()), f"{what}: max error {err.max().item():.3g} exceeds the tolerance"


def int8_weight_only_linear(x, w_int8, w_scale):
    """torchao's / gpt-fast's int8 weight-only linear in plain torch (the baseline users would otherwise compile)."""
    return F.linear(x, w_int8.to(x.dtype)) * w_scale.to(x.dtype)


def check(x, w_q, w_s, w_p, x_q, x_s, dtype, torch_wo):
    """Every arkernels implementation and the plain-torch baseline against the float64 reference on a few rows."""
    rows = _check_rows(x.shape[0])
    xr, xqr, xsr = x[rows].cpu(), x_q[rows].cpu(), x_s[rows].cpu()
    wq, ws = w_q.cpu(), w_s.cpu()
    ref, terms = w8a16_matmul_ref(xr, wq, ws), w8a16_matmul_ref(xr.double().abs(), wq.double().abs(), ws)
    plain = arkernels.w8a16_matmul(x, w_q, w_s)
    _assert_close(plain[rows], ref, dtype, terms, "w8a16_matmul")
    packed = arkernels.w8a16_matmul(x, w_p, w_s)
    _assert_close(packed[rows], ref, dtype, terms, "w8a16_matmul (packed)")
    if x.shape[0] <= tkp.DECODE_MAX_M:
        assert torch.equal(packed, plain), "w8a16: the packed and the plain layout differ at decode M"
    # the baseline multiplies by a scale rounded to x's dtype: one more rounding of the output's size
    _assert_close(torch_wo(x, w_q, w_s)[rows], ref, dtype, terms + ref.abs() * 4, "torch-int8-wo")
    got = arkernels.int8_matmul(x_q, w_q)[rows]
    assert torch.equal(got.cpu().double(), int8_matmul_ref(xqr, wq)), "int8_matmul (int32) is not exact"
    got = arkernels.int8_matmul(x_q, w_q, x_s, w_s, out_dtype=dtype)[rows]
    _assert_close(got, int8_matmul_ref(xqr, wq, xsr, ws), dtype,
                  int8_matmul_ref(xqr.double().abs(), wq.double().abs(), xsr, ws), "int8_matmul (scaled)")


def decode_reduce_impls(x, w_q, w_s, dtype, nbytes):
    """The fused and two-launch split-K reduce rows (see the module docstring), checked against each other (same
    bits) and against the reference before they are timed."""
    path = tkp.w8a16_path(x.shape[0], torch.bfloat16)  # fp32 x (CPU interpreter) forced onto the same decode path
    fns = {name: (lambda ws, r=reduce: tkl.w8a16_matmul_triton(x, ws[1], ws[2], path=path, reduce=r))
           for name, reduce in zip(DECODE_REDUCE_ROWS, ("fused", "launch"))}
    ws = (None, w_q, w_s)
    fused, two = fns["w8a16-fused"](ws), fns["w8a16-2launch"](ws)
    assert torch.equal(fused, two), "w8a16: the fused and the two-launch reduce differ"
    rows = _check_rows(x.shape[0])
    xr, wq, wsc = x[rows].cpu(), w_q.cpu(), w_s.cpu()
    _assert_close(fused[rows], w8a16_matmul_ref(xr, wq, wsc), dtype,
                  w8a16_matmul_ref(xr.double().abs(), wq.double().abs(), wsc), "w8a16 fused reduce")
    return {name: (fn, nbytes) for name, fn in fns.items()}


def gemv_plan_impls(x, w_q, w_p, w_s, dtype, nbytes):
    """The GEMV class's options (M <= 4, packed weight ``w_p``; arkernels/triton/int8_matmul_plan.py): the per-chunk
    GEMV (one split per 512 columns: workspace, tickets, fused reduce), the K loop over all of K (one split: none of
    them; only where K has more than one chunk) and the planned call with programmatic dependent launch off, each
    checked against the reference before it is timed. The plan picks the loop only where N alone fills the machine
    (the LM heads, the fused gate/up): these rows show what each choice costs at every shape."""
    N, K = w_q.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    options = tkp.gemv_split_options(N, K, sms)
    cfgs = {"w8a16-chunk": options[0]["cfg"]}
    if len(options) > 1:
        cfgs["w8a16-loop"] = options[-1]["cfg"]
    fns = {name: (lambda ws, c=cfg: tkl.w8a16_matmul_triton(x, ws[3], ws[2], path="gemv", config=c))
           for name, cfg in cfgs.items()}
    fns["w8a16-nopdl"] = lambda ws: tkl.w8a16_matmul_triton(x, ws[3], ws[2], path="gemv", pdl=False)
    rows = _check_rows(x.shape[0])
    xr, wq, wsc = x[rows].cpu(), w_q.cpu(), w_s.cpu()
    for name, fn in fns.items():
        _assert_close(fn((None, None, w_s, w_p))[rows], w8a16_matmul_ref(xr, wq, wsc), dtype,
                      w8a16_matmul_ref(xr.double().abs(), wq.double().abs(), wsc), name)
    return {name: (fn, nbytes) for name, fn in fns.items()}


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate in GB/s (bytes read + bytes written), the roofline for memory-bound rows."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timeit(lambda: dst.copy_(src), device=device) / 1e9


def _rotating(make, nbytes, device):
    """A list of independent weight sets totalling >= ROTATE_BYTES on a GPU (one on the CPU) and a cycling picker."""
    copies = max(1, -(-ROTATE_BYTES // nbytes)) if device == "cuda" else 1
    sets = [make() for _ in range(copies)]
    it = itertools.cycle(sets)
    return sets[0], lambda: next(it)


def bench_shape(M, N, K, dtype, device, torch_wo, copy_gbps):
    gen = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    e = x.element_size()

    def make():
        w = (torch.randn(N, K, generator=gen) * 0.02).to(dtype).to(device)
        w_q, w_s = arkernels.quantize_per_channel(w)
        return w, w_q, w_s, pack_weight(w_q)

    (w, w_q, w_s, w_p), pick = _rotating(make, N * K * (e + 2), device)
    x_q, x_s = arkernels.quantize_per_token(x)
    check(x, w_q, w_s, w_p, x_q, x_s, dtype, torch_wo)

    def w8a8_with_quant(ws):  # what Int8Linear(mode="w8a8") runs at M >= 17: per-token quantization, then the matmul
        xq, xs = arkernels.quantize_per_token(x)
        return arkernels.int8_matmul(xq, ws[1], xs, ws[2], out_dtype=dtype)

    impls = {  # name: (fn(weight set), minimum bytes moved)
        "F.linear": (lambda ws: F.linear(x, ws[0]), e * (M * K + N * K + M * N)),
        "w8a16": (lambda ws: arkernels.w8a16_matmul(x, ws[1], ws[2]), e * M * K + N * K + 4 * N + e * M * N),
        "w8a16-packed": (lambda ws: arkernels.w8a16_matmul(x, ws[3], ws[2]), e * M * K + N * K + 4 * N + e * M * N),
        "torch-int8-wo": (lambda ws: torch_wo(x, ws[1], ws[2]), e * M * K + N * K + 4 * N + e * M * N),
        "w8a8": (lambda ws: arkernels.int8_matmul(x_q, ws[1], x_s, ws[2], out_dtype=dtype),
                 M * K + N * K + 4 * (M + N) + e * M * N),
        "w8a8+quant": (w8a8_with_quant, e * M * K + M * K + N * K + 4 * (M + N) + e * M * N),
    }
    if device != "cuda" or M > 16:  # cuBLAS int8 (torch._int_mm) needs M > 16 on CUDA
        impls["torch._int_mm"] = (lambda ws: torch._int_mm(x_q, ws[1].t()), M * K + N * K + 4 * M * N)
    if M <= tkp.DECODE_MAX_M and (device == "cuda" or tkl.interpreting()):
        impls.update(decode_reduce_impls(x, w_q, w_s, dtype, e * M * K + N * K + 4 * N + e * M * N))
        if M <= tkp.GEMV_MAX_M:
            impls.update(gemv_plan_impls(x, w_q, w_p, w_s, dtype, e * M * K + N * K + 4 * N + e * M * N))
    # the interpreter's decode rows: one timed call each (a call is ~0.5 s there; --quick stays quick)
    slow = dict(warmup=0, iters=1) if device != "cuda" else {}
    interpreted = DECODE_REDUCE_ROWS + GEMV_PLAN_ROWS
    times = {name: timeit(lambda fn=fn: fn(pick()), device=device, **(slow if name in interpreted else {}))
             for name, (fn, _) in impls.items()}
    rows = []
    for name, (_, nbytes) in impls.items():
        t = times[name]
        gbps = nbytes / t / 1e9
        rows.append(dict(shape=f"{N}x{K}", impl=name, series=f"{N}x{K} {name}", M=M, N=N, K=K, us=t * 1e6,
                         tflops=2 * M * N * K / t / 1e12, gbps=gbps, pct_copy_bw=100 * gbps / copy_gbps,
                         ratio_vs_linear=times["F.linear"] / t, dtype=str(dtype).split(".")[-1],
                         device=device_name(device)))
    return rows


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", metavar="NxK", help="weight shapes (default: the Llama-8B ones on a GPU)")
    p.add_argument("--ms", nargs="+", type=int, help="values of M (default: 1..16 and 512..8192 on a GPU)")
    args = p.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the CPU path serves fp32 models
    small = args.quick or dev != "cuda"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else (
        QUICK_SHAPES if small else LLAMA_8B)
    ms = args.ms or (MS_QUICK if small else MS_DECODE + MS_PREFILL)
    torch_wo = int8_weight_only_linear
    if dev == "cuda":  # one static compile per (M, N, K), as gpt-fast runs it; dynamo stops at 8 by default
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(shapes) * len(ms))
        torch_wo = torch.compile(int8_weight_only_linear, dynamic=False)
    copy_gbps = copy_bandwidth(dev)
    rows = []
    for N, K in shapes:
        for M in ms:
            rows += bench_shape(M, N, K, dtype, dev, torch_wo, copy_gbps)
    write_results(rows, args.out, "int8_matmul", plot=("M", "ratio_vs_linear", "series"),
                  title=f"int8 matmul vs F.linear ({str(dtype).split('.')[-1]}), {device_name(dev)}")
    print(f"device {device_name(dev)}, baseline F.linear in {dtype}, copy bandwidth {copy_gbps:.0f} GB/s "
          f"(torch-int8-wo {'compiled' if dev == 'cuda' else 'eager'}); results in {args.out}/int8_matmul.*")
    decode = [r for r in rows if r["M"] <= 16 and r["impl"] != "w8a8+quant"]
    prefill = [r for r in rows if r["M"] > 16]
    if decode:
        print("decode rows (memory bound):")
        print_table(decode, ["shape", "impl", "M", "us", "gbps", "pct_copy_bw", "ratio_vs_linear"])
    if prefill:
        print("prefill rows (compute bound):")
        print_table(prefill, ["shape", "impl", "M", "us", "tflops", "ratio_vs_linear"])


if __name__ == "__main__":
    main()
