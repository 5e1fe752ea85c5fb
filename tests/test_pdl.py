"""Programmatic dependent launch (csrc/pdl.cuh) of every hand-written CUDA kernel.

In the emulator (its device sm_90 by default) each op's launches are PDL launches, every thread of them waits
(griddepcontrol.wait) before its first global access (the emulator reports one that does not: every emulated test of
the ops checks that), and the CTAs trigger their dependents (griddepcontrol.launch_dependents); on sm_80 and with
ARKERNELS_PDL=0 the launches are plain. nvcc's PTX of pdl.cuh (no GPU needed): griddepcontrol.wait before the global
load and launch_dependents after it for sm_90, neither for sm_80. On a GPU: a kernel that triggers its dependents early (the append) followed by
one that reads what it writes (decode), many times in a row, gives the reference's result.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather
from arkernels.ops.window_attention import window_attention
from conftest import SIMT_DEVICES

ROOT = Path(__file__).resolve().parent.parent
CSRC = os.environ.get("ARKERNELS_PTX_CSRC", str(ROOT / "csrc"))  # scripts/simt_faults.py points it at a copy


def _cache(num_blocks, block_size, heads, d, dtype, device="cpu"):
    return (torch.zeros(num_blocks, block_size, heads, d, dtype=dtype, device=device),
            torch.zeros(num_blocks, block_size, heads, d, dtype=dtype, device=device))


def _ops(fp8=False):
    """One call of each op (append, gather, decode, multi-query decode, prefill) -> [(name, launches)]."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(3)
    heads, d, bs, nb = 2, 64, 16, 12
    k, v = _cache(nb, bs, heads, d, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scales = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([0.25])) if fp8 else {}
    key = torch.randn(150, heads, d, generator=gen).bfloat16()
    value = torch.randn(150, heads, d, generator=gen).bfloat16()
    slots = torch.arange(150, dtype=torch.int64)
    out = []
    paged_kv_append(key, value, k, v, slots, **scales)
    out.append(("append", arkernels.simt.launches()))
    table = torch.arange(nb, dtype=torch.int32).view(1, nb).repeat(2, 1)
    lens = torch.tensor([150, 45], dtype=torch.int32)
    if not fp8:
        paged_kv_gather(k, v, table, lens, 150)
        out.append(("gather", arkernels.simt.launches()))
    query = torch.randn(2, 4 * heads, d, generator=gen).bfloat16()
    window_attention(query, k, v, table, lens, **scales)
    out.append(("decode", arkernels.simt.launches()))
    for name, q_len in (("multi-query decode", 2), ("prefill", 40)):
        cu = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
        query = torch.randn(2 * q_len, 4 * heads, d, generator=gen).bfloat16()
        window_attention(query, k, v, table, lens, cu_seqlens_q=cu, max_q_len=q_len, **scales)
        out.append((name, arkernels.simt.launches()))
    return out


def _ctas(launch):
    x, y, z = launch["grid"]
    return x * y * z


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
def test_every_launch_is_pdl_on_sm_90_and_triggers(device, fp8):
    import arkernels.simt

    with arkernels.simt.emulate(device="sm_90"):
        ops = _ops(fp8)
    assert [name for name, _ in ops][-3:] == ["decode", "multi-query decode", "prefill"]
    for name, launches in ops:
        assert len(launches) == 1 and launches[0]["pdl"], (name, launches)
        launch = launches[0]
        if name == "prefill":  # CTAs whose sequence has no query tile for them exit before the key loop
            assert 1 <= launch["triggered"] <= _ctas(launch), (name, launch)
        else:  # the copies trigger right after the wait, decode after its key loop: every CTA
            assert launch["triggered"] == _ctas(launch), (name, launch)


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_launches_are_plain_on_sm_80(device):
    import arkernels.simt

    with arkernels.simt.emulate(device="sm_80"):
        for name, launches in _ops():
            assert len(launches) == 1 and not launches[0]["pdl"], (name, launches)


_ENV_SCRIPT = """
import torch, arkernels.simt
from arkernels.ops.paged_kv import paged_kv_append
k = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
v = torch.zeros_like(k)
x = torch.randn(5, 2, 64).bfloat16()
with arkernels.simt.emulate(device="sm_90"):
    paged_kv_append(x, x, k, v, torch.arange(5))
    print("pdl", arkernels.simt.launches()[0]["pdl"])
"""


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("env, want", [("0", "pdl False"), ("1", "pdl True")])
def test_arkernels_pdl_env_switch(device, env, want):
    """ARKERNELS_PDL=0 (read once per process, by the launch helper the GPU build shares) makes every launch plain."""
    import arkernels.simt

    run = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, ARKERNELS_PDL=env, ARKERNELS_SIMT_LIB=str(arkernels.simt.library_path()),
                                  PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert want in run.stdout.splitlines()


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_append_then_decode_on_a_gpu(pdl):
    """The append triggers its dependents right after its wait, so decode's CTAs are resident while the append still
    writes the keys decode reads; decode's own wait must hold them back. 20 append -> decode steps of a 16k-token
    sequence written whole each step (a long append: a wide window for a missing wait to show), against fp32 attention
    over the appended keys. Run in a fresh process per setting (ARKERNELS_PDL is read once)."""
    script = """
import torch
from arkernels.ops.paged_kv import paged_kv_append
from arkernels.ops.window_attention import window_attention
torch.manual_seed(0)
n, hkv, group, d, bs = 16384, 8, 4, 128, 16
k = torch.full((n // bs, bs, hkv, d), float("nan"), dtype=torch.bfloat16, device="cuda")
v = torch.full_like(k, float("nan"))
table = torch.arange(n // bs, dtype=torch.int32, device="cuda").view(1, -1)
lens = torch.tensor([n], dtype=torch.int32, device="cuda")
slots = torch.arange(n, device="cuda")
worst = 0.0
for step in range(20):
    key = torch.randn(n, hkv, d, device="cuda").bfloat16()
    value = torch.randn(n, hkv, d, device="cuda").bfloat16()
    q = torch.randn(1, hkv * group, d, device="cuda").bfloat16()
    k.fill_(float("nan")); v.fill_(float("nan"))
    paged_kv_append(key, value, k, v, slots)
    out = window_attention(q, k, v, table, lens)
    qf = q.float().view(hkv, group, d)
    s = torch.einsum("hgd,nhd->hgn", qf, key.float()) * d ** -0.5
    ref = torch.einsum("hgn,nhd->hgd", s.softmax(-1), value.float()).reshape(1, hkv * group, d)
    err = (out.float() - ref).abs().max().item()
    worst = max(worst, err if err == err else float("inf"))  # NaN (a poisoned key read) counts as the worst
print("worst", worst)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, ARKERNELS_PDL=pdl, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    worst = float(run.stdout.split("worst")[-1])
    assert worst < 0.02, worst  # bf16 output of fp32-accumulated attention: ~4e-3; NaN or stale keys are far off


_PTX_PROBE = r"""
#include "pdl.cuh"
extern "C" __global__ void probe_pdl(const float* __restrict__ src, float* __restrict__ dst) {
  arkernels::dev::pdl_wait();
  dst[threadIdx.x] = 2.f * src[threadIdx.x];
  arkernels::dev::pdl_launch_dependents();
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ptx_griddepcontrol_only_for_sm_90(tmp_path, arch):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    (tmp_path / "probe.cu").write_text(_PTX_PROBE)
    res = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-O3", "-std=c++17", f"-I{CSRC}", str(tmp_path / "probe.cu"),
                          "-o", str(tmp_path / "probe.ptx")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    body = (tmp_path / "probe.ptx").read_text()
    lines = [ln.strip() for ln in body.splitlines()]
    grid = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.")]
    if arch == "sm_80":
        assert grid == [], body
        return
    load = next(i for i, ln in enumerate(lines) if re.match(r"ld\.global\.", ln))
    store = next(i for i, ln in enumerate(lines) if re.match(r"st\.global\.", ln))
    assert [lines[i] for i in grid] == ["griddepcontrol.wait;", "griddepcontrol.launch_dependents;"], body
    assert grid[0] < load < store < grid[1], body
