"""The CPU kernel's two builds (baseline ISA and AVX2, picked at run time) give bit-identical outputs: the same IEEE
operations in the same order, only the SIMD width differs. The AVX2 build runs in this process where the CPU has it;
the baseline runs in a child process with ARKERNELS_CPU_ISA=baseline. Both are also checked against the reference by
the grids in test_window_attention.py (whichever build the machine picks)."""
import os
import subprocess
import sys

import pytest
import torch

import arkernels  # noqa: F401  (registers the ops)

# head dims: a multiple of 4 x 8 lanes, one that leaves a single 8-lane vector (72), one with a scalar tail (70),
# one below a vector (3); q_lens 11 and 9 span two row chunks (8 rows per task), 0 and 1 are the edges.
HEAD_DIMS = [64, 72, 70, 3]
Q_LENS = [11, 0, 1, 9, 3]
LENS = [40, 7, 1, 29, 100]


def _case(d: int, fp8: bool, window: int, softcap: float, sinks: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(d * 7 + window)
    hkv, group, bs = 2, 3, 8
    nb = sum((n + bs - 1) // bs for n in LENS) + 1
    k = torch.randn(nb, bs, hkv, d, generator=gen)
    v = torch.randn(nb, bs, hkv, d + 5, generator=gen)[..., :d]  # V with a different row stride from K
    perm = torch.randperm(nb - 1, generator=gen) + 1
    table = torch.zeros(len(LENS), max((n + bs - 1) // bs for n in LENS), dtype=torch.int32)
    at = 0
    for b, n in enumerate(LENS):
        m = (n + bs - 1) // bs
        table[b, :m] = perm[at:at + m].to(torch.int32)
        at += m
    cu = torch.tensor([0] + torch.tensor(Q_LENS).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hkv * group, d + 3, generator=gen)[..., :d].to(dtype)  # non-contiguous rows
    ks = vs = None
    if fp8:
        k, v = (k * 4).to(torch.float8_e4m3fn), (v * 4).to(torch.float8_e4m3fn)
        ks, vs = torch.tensor([0.3]), torch.tensor([0.2])
    else:
        k, v = k.to(dtype), v.to(dtype)
    sk = torch.randn(hkv * group, generator=gen) if sinks else None
    lens = torch.tensor(LENS, dtype=torch.int32)
    return (q, k, v, table, lens, cu, None, max(Q_LENS), window, d ** -0.5, softcap, ks, vs, sk, 0)


def _outputs() -> list[torch.Tensor]:
    outs = []
    for d in HEAD_DIMS:
        for fp8, window, softcap, sinks, dtype in [(False, 0, 0.0, False, torch.float32),
                                                   (False, 5, 0.0, True, torch.bfloat16),
                                                   (True, 0, 3.0, False, torch.float16),
                                                   (False, 0, 0.0, False, torch.float16)]:
            args = _case(d, fp8, window, softcap, sinks, dtype)
            outs += list(torch.ops.arkernels.window_attention(*args))
            q, k, v, table, lens = args[:5]
            rows, seqs = [10, 11, 20, 23], [0, 2, 3, 4]  # decode: one query per sequence (its last position)
            outs += list(torch.ops.arkernels.window_attention(q[rows], k, v, table[seqs], lens[seqs], None, None, 0,
                                                              *args[8:]))
    return outs


def test_window_attention_cpu_builds_bit_identical(tmp_path):
    if os.environ.get("ARKERNELS_CPU_ISA") == "baseline":
        pytest.skip("this process already runs the baseline build")
    here = _outputs()
    out = tmp_path / "baseline.pt"
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
            f"from test_window_attention_cpu import _outputs; torch.save(_outputs(), {str(out)!r})")
    env = dict(os.environ, ARKERNELS_CPU_ISA="baseline")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    there = torch.load(out)
    assert len(here) == len(there)
    for i, (a, b) in enumerate(zip(here, there)):
        assert torch.equal(a, b) or (a.isnan().equal(b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())), i
