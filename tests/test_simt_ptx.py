"""The two implementations of csrc/device_mma.cuh's primitives checked against the PTX ISA, so that the emulated one
(csrc/simt/simt_mma.h, which every emulated kernel test runs) stands for the inline PTX the GPU runs:

- the emulator's mma.sync.m16n8k16 and ldmatrix, fed per-lane registers built here from the fragment tables of the
  PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type", "ldmatrix"), written out below from the
  ISA's formulas and sharing no code with simt_mma.h, against plain matmuls and copies;
- the inline PTX (the nvcc branch of device_mma.cuh, compiled to PTX by nvcc here, no GPU needed): each asm operand
  bound to the register the ISA table means (a[0..3], b[0..1], c[0..3] in order, d[i] stored where the caller put it;
  ldmatrix's registers in order, the .x1/.x2/.x4/.trans variant each function promises).
Together: whatever layout the PTX operands mean on the GPU is what the emulator computes. benchmarks/gpu_check.sh runs
the nvcc-built csrc/simt/tests/primitives.cpp on the GPU first, which checks the ISA's meaning itself.
"""
import os
import re
import shutil
import subprocess

import pytest
import torch

from conftest import SIMT_DEVICES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.environ.get("ARKERNELS_PTX_CSRC", os.path.join(REPO, "csrc"))  # scripts/simt_faults.py points it at a copy


# ---- the PTX ISA's fragment tables (groupID = lane >> 2, threadID_in_group = lane % 4) ----
def isa_a(i, lane):
    """(row, col) of element a_i (i in 0..7; register i // 2, low half for even i) of the 16x16 A operand."""
    g, t = lane >> 2, lane % 4
    row = g if (i < 2 or 4 <= i < 6) else g + 8
    col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def isa_b(i, lane):
    """(row, col) of element b_i (i in 0..3) of the 16x8 B operand (row = k, col = n)."""
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def isa_c(i, lane):
    """(row, col) of element c_i / d_i (i in 0..3) of the 16x8 fp32 accumulator."""
    g, t = lane >> 2, lane % 4
    return g if i < 2 else g + 8, t * 2 + (i & 1)


def isa_ldmatrix(lane, trans):
    """(row, col) within matrix m of the two 16-bit elements lane receives in register m (low half first)."""
    r, c = lane // 4, 2 * (lane % 4)
    return [(c, r), (c + 1, r)] if trans else [(r, c), (r, c + 1)]


def _bits(x):
    return x.view(torch.int16).to(torch.int64) & 0xFFFF


def _pack(lo, hi):
    v = lo | (hi << 16)
    return v - (1 << 32) if v >= 1 << 31 else v  # as int32


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("integers", [False, True])
def test_emulated_mma_follows_the_ptx_isa_fragments(device, dtype, integers):
    import arkernels.simt

    gen = torch.Generator().manual_seed(3 + integers)
    if integers:  # small integers: every product and sum is exact, so the result must be bit-exact
        A, B, C = (torch.randint(-3, 4, s, generator=gen).float() for s in ((16, 16), (16, 8), (16, 8)))
    else:
        A, B, C = (torch.randn(s, generator=gen) for s in ((16, 16), (16, 8), (16, 8)))
    A, B = A.to(dtype), B.to(dtype)
    ab, bb = _bits(A), _bits(B)
    a = torch.tensor([[_pack(int(ab[isa_a(2 * r, l)]), int(ab[isa_a(2 * r + 1, l)])) for r in range(4)]
                      for l in range(32)], dtype=torch.int32)
    b = torch.tensor([[_pack(int(bb[isa_b(2 * r, l)]), int(bb[isa_b(2 * r + 1, l)])) for r in range(2)]
                      for l in range(32)], dtype=torch.int32)
    c = torch.tensor([[float(C[isa_c(i, l)]) for i in range(4)] for l in range(32)])
    d = arkernels.simt.mma_probe(a, b, c, dtype == torch.bfloat16)
    ref = A.double() @ B.double() + C.double()
    abs_sum = A.double().abs() @ B.double().abs() + C.double().abs()
    got = torch.empty(16, 8, dtype=torch.float64)
    for l in range(32):
        for i in range(4):
            got[isa_c(i, l)] = float(d[l, i])
    # fp32 sum of 16 exact products: <= 17 * 2^-24 * sum|terms|; a layout error is O(|a b|), far above
    tol = 0.0 if integers else 2 * 17 * 2.0 ** -24 * abs_sum
    assert bool(((got - ref).abs() <= tol).all()), (got - ref).abs().max()
    # the tolerance can fail: B's rows k and k^1 exchanged (a packing-order error) exceeds it almost everywhere
    swapped = A.double() @ B.double()[torch.arange(16) ^ 1] + C.double()
    assert int(((swapped - ref).abs() > tol).sum()) > 100


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_emulated_ldmatrix_follows_the_ptx_isa(device, n, trans):
    import arkernels.simt

    gen = torch.Generator().manual_seed(n * 2 + trans)
    tile = torch.randint(-2 ** 15, 2 ** 15, (32, 8), generator=gen, dtype=torch.int16)
    got = arkernels.simt.ldmatrix_probe(tile, n, trans)
    u = tile.to(torch.int64) & 0xFFFF
    for lane in range(32):
        for m in range(n):
            (r0, c0), (r1, c1) = isa_ldmatrix(lane, trans)
            want = _pack(int(u[8 * m + r0, c0]), int(u[8 * m + r1, c1]))
            assert int(got[lane, m]) == want, (lane, m)


# ---- the inline PTX's operand binding, from nvcc's PTX output ----
_PROBE = r"""
#include "device_mma.cuh"
using namespace arkernels;
template <typename T>
__device__ void mma_probe(const volatile uint32_t* in, const volatile float* cin, volatile float* out) {
  uint32_t a[4], b[2];
  float c[4], d[4];
  for (int i = 0; i < 4; ++i) a[i] = in[i];
  for (int i = 0; i < 2; ++i) b[i] = in[4 + i];
  for (int i = 0; i < 4; ++i) c[i] = cin[i];
  dev::mma_m16n8k16<T>(d, a, b, c);
  for (int i = 0; i < 4; ++i) out[i] = d[i];
}
extern "C" __global__ void probe_mma_f16(const volatile uint32_t* in, const volatile float* cin, volatile float* out) {
  mma_probe<__half>(in, cin, out);
}
extern "C" __global__ void probe_mma_bf16(const volatile uint32_t* in, const volatile float* cin, volatile float* out) {
  mma_probe<__nv_bfloat16>(in, cin, out);
}
#define LDSM_PROBE(fn, n)                                               \
  extern "C" __global__ void probe_##fn(volatile uint32_t* out) {       \
    __shared__ __align__(16) uint16_t s[32 * 8];                        \
    s[threadIdx.x * 8] = uint16_t(threadIdx.x);                         \
    __syncwarp();                                                       \
    uint32_t r[n];                                                      \
    dev::fn(r, s + threadIdx.x * 8);                                    \
    for (int i = 0; i < n; ++i) out[i] = r[i];                          \
  }
LDSM_PROBE(ldmatrix_x1, 1)
LDSM_PROBE(ldmatrix_x2, 2)
LDSM_PROBE(ldmatrix_x4, 4)
LDSM_PROBE(ldmatrix_x1_trans, 1)
LDSM_PROBE(ldmatrix_x2_trans, 2)
LDSM_PROBE(ldmatrix_x4_trans, 4)
extern "C" __global__ void probe_cp_async(const uint4* src, int n, volatile uint32_t* out) {
  __shared__ __align__(16) uint4 s[32];
  dev::cp_async_16(&s[threadIdx.x], src + threadIdx.x, n);
  dev::cp_async_commit();
  dev::cp_async_wait<1>();
  dev::cp_async_wait_all();
  out[threadIdx.x] = s[threadIdx.x].x;
}
"""


def _nvcc():
    return shutil.which("nvcc")


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    d = tmp_path_factory.mktemp("ptx")
    (d / "probe.cu").write_text(_PROBE)
    res = subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-O3", "-std=c++17", f"-I{CSRC}", str(d / "probe.cu"),
                          "-o", str(d / "probe.ptx")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    text = (d / "probe.ptx").read_text()
    entries = {}
    for m in re.finditer(r"\.entry (\w+)\((.*?)\n}\n", text, re.S):
        entries[m.group(1)] = m.group(2)
    return entries


def _loads(body, kind):
    """{register: element index} of the volatile global loads of `kind` (u32 / f32)."""
    out = {}
    for m in re.finditer(rf"ld\.volatile\.global\.{kind}\s+(%\w+),\s*\[%\w+(?:\+(\d+))?\];", body):
        out[m.group(1)] = int(m.group(2) or 0) // 4
    return out


def _stores(body, kind):
    """{element index: register} of the volatile global stores of `kind`."""
    return {int(m.group(1) or 0) // 4: m.group(2)
            for m in re.finditer(rf"st\.volatile\.global\.{kind}\s+\[%\w+(?:\+(\d+))?\],\s*(%\w+);", body)}


def _regs(group):
    return [r.strip() for r in group.split(",")]


@pytest.mark.parametrize("name,ab", [("probe_mma_f16", "f16"), ("probe_mma_bf16", "bf16")])
def test_ptx_mma_binds_the_isa_operands(ptx, name, ab):
    body = ptx[name]
    ins = re.findall(r"(mma\.sync\.aligned\.\S+)\s+\{([^}]*)\},\s*\{([^}]*)\},\s*\{([^}]*)\},\s*\{([^}]*)\};", body)
    assert len(ins) == 1, body
    op, d, a, b, c = ins[0]
    assert op == f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32"
    u32, f32 = _loads(body, "u32"), _loads(body, "f32")
    assert [u32.get(r) for r in _regs(a)] == [0, 1, 2, 3], "A registers out of order"
    assert [u32.get(r) for r in _regs(b)] == [4, 5], "B registers out of order"
    assert [f32.get(r) for r in _regs(c)] == [0, 1, 2, 3], "C registers out of order"
    stores = _stores(body, "f32")
    assert [stores.get(i) for i in range(4)] == _regs(d), "D registers out of order"


@pytest.mark.parametrize("fn", ["ldmatrix_x1", "ldmatrix_x2", "ldmatrix_x4", "ldmatrix_x1_trans", "ldmatrix_x2_trans",
                                "ldmatrix_x4_trans"])
def test_ptx_ldmatrix_is_the_named_variant(ptx, fn):
    body = ptx[f"probe_{fn}"]
    n = int(fn[len("ldmatrix_x")])
    trans = fn.endswith("_trans")
    ins = re.findall(r"(ldmatrix\.sync\.aligned\.\S+)\s+\{([^}]*)\},\s*\[(%\w+)\];", body)
    assert len(ins) == 1, body
    op, regs, _ = ins[0]
    assert op == f"ldmatrix.sync.aligned.m8n8.x{n}{'.trans' if trans else ''}.shared.b16"
    stores = _stores(body, "u32")
    assert [stores.get(i) for i in range(n)] == _regs(regs), "registers out of order"


def test_ptx_cp_async_is_16_bytes_with_the_callers_src_size(ptx):
    body = ptx["probe_cp_async"]
    ins = re.findall(r"cp\.async\.cg\.shared\.global\s+\[%\w+\],\s*\[%\w+\],\s*(\d+),\s*(%\w+);", body)
    assert len(ins) == 1 and ins[0][0] == "16", body
    param = re.search(r"ld\.param\.u32\s+(%\w+),\s*\[probe_cp_async_param_1\];", body)
    assert param and param.group(1) == ins[0][1], "src-size operand is not the n argument"
    assert "cp.async.commit_group;" in body and "cp.async.wait_group 1;" in body and "cp.async.wait_all;" in body
