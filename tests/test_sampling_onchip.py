"""The on-chip draw (issue 34 item 4): rows with top-k <= KMAX draw from their candidates in registers (radix levels
below the cutoff bucket narrow them to <= KMAX survivors; top-k / top-p thresholds pairwise; the race on the
survivors). It must draw exactly what the candidate search, the full-row fallback, the CPU op and the reference draw.
The Triton kernels run in interpreter mode on CPU tensors (conftest): small grids.
"""
import pytest
import torch
import triton
import triton.language as tl

import arkernels
import arkernels.triton.sampling_launch as launch
from arkernels.reference.sampling import sampling_probs_ref
from arkernels.triton.sampling_launch import sample_triton
from arkernels.triton.sampling_select import KMAX, survivor_positions, survivor_thresholds

V = 4099  # 5 chunks: 5 programs per row at small batch (tickets), not a multiple of any block


def _rows():
    """One row per on-chip regime (and two that must leave it): (logits, T, k, top_p, min_p)."""
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(10, V, generator=gen) * 4.0
    x[1] *= 3.0  # peaked: the top-10 bucket holds <= KMAX candidates (no radix level)
    # row 2: 300 consecutive floats at the top (keys 1 apart): radix levels down to the last 4 bits
    x[2] = -8.0 - torch.rand(V, generator=gen)
    top = torch.tensor(5.0).view(torch.int32) + torch.arange(300, dtype=torch.int32)
    x[2, torch.randperm(V, generator=gen)[:300]] = top.view(torch.float32)
    # row 3: 100 tokens tied at the top, k = 5 keeps them all (> KMAX survivors: the candidate search)
    x[3, :100] = 30.0
    # row 7: +0.0 / -0.0 tied at the k-th value
    x[7] = -1.0 - torch.rand(V, generator=gen)
    x[7, 10:40], x[7, 50:80] = 0.0, -0.0
    T = torch.tensor([1.0, 0.7, 1.0, 1.0, 0.8, 1.3, 1.0, 1.0, 0.9, 1.0])
    k = torch.tensor([50, 10, 61, 5, KMAX, 40, KMAX + 1, 5, 20, 30], dtype=torch.int32)
    p = torch.tensor([1.0, 0.9, 0.95, 1.0, 0.9, 0.8, 0.9, 1.0, 1.0, 0.7])
    mp = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.3, 0.0])
    return x, T, k, p, mp


def _steps(x, T, k, p, mp, steps=3, **kw):
    seed = torch.arange(x.shape[0]) * 31 + 7
    out = []
    for s in range(steps):
        step = torch.full((x.shape[0],), s, dtype=torch.int64)
        out.append(sample_triton(x, T, k, p, mp, seed, step, debug=True, **kw))
    return out


def test_onchip_draws_what_the_search_the_fallback_and_the_cpu_op_draw():
    """Every regime row, 3 steps: on chip (kmax KMAX), by the candidate search (kmax 0), by the full-row fallback
    (cap 1) and by the CPU op: the same tokens, inside the reference's kept set; the fast path stays 2 passes."""
    x, T, k, p, mp = _rows()
    kept = sampling_probs_ref(x, T, k, p, mp) > 0
    seed = torch.arange(x.shape[0]) * 31 + 7
    onchip, search, slow = _steps(x, T, k, p, mp), _steps(x, T, k, p, mp, kmax=0), _steps(x, T, k, p, mp, cap=1)
    for s, (a, b, c) in enumerate(zip(onchip, search, slow)):
        ids, valid, (ncand, passes) = a
        assert (ncand > 0).all() and (passes == 2).all() and valid.all()
        assert ncand[1] <= KMAX and ncand[2] > KMAX and ncand[0] > KMAX  # both survivor routes ran
        assert torch.equal(ids, b[0]) and torch.equal(ids, c[0])
        step = torch.full((x.shape[0],), s, dtype=torch.int64)
        want = arkernels.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=seed, step=step)
        assert torch.equal(ids, want) and kept.gather(1, ids[:, None]).all()


def test_onchip_rows_need_no_search_pass(monkeypatch):
    """With the pivot search cut to 0 passes (its thresholds then keep every candidate), rows with top-k <= KMAX
    still draw the CPU op's tokens (the on-chip path decided them), while the same rows through the search do not:
    the test sees which path ran."""
    x, T, k, p, mp = _rows()
    onchip_rows = torch.tensor([0, 1, 2, 4, 5, 7, 8, 9])  # top-k <= KMAX, <= KMAX tokens tied at the k-th value
    x, T, k, p, mp = x[onchip_rows], T[onchip_rows], k[onchip_rows], p[onchip_rows], mp[onchip_rows]
    seed = torch.arange(x.shape[0]) * 31 + 7
    want = [arkernels.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=seed, step=s) for s in range(3)]
    monkeypatch.setattr(launch, "MAX_PASSES", 0)
    got = [r[0] for r in _steps(x, T, k, p, mp)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    searched = [r[0] for r in _steps(x, T, k, p, mp, kmax=0)]
    assert not all(torch.equal(g, w) for g, w in zip(searched, want))


def test_onchip_min_p_with_top_k():
    """Top-k 10 with min-p 0.3: nine tokens at a probability ratio of 0.295 share the min-p bound's bucket, so they are
    candidates and survivors, and min-p must drop them in the on-chip race: every seed draws the maximum."""
    x = torch.full((16, 111), -10.0)
    x[:, 5], x[:, 20:29] = 0.0, -1.22
    T, k, p, mp = torch.ones(16), torch.full((16,), 10, dtype=torch.int32), torch.ones(16), torch.full((16,), 0.3)
    seed, step = torch.arange(16) + 3, torch.zeros(16, dtype=torch.int64)
    ids, _, (ncand, _) = sample_triton(x, T, k, p, mp, seed, step, debug=True)
    assert (ncand == 10).all() and (ids == 5).all()
    assert torch.equal(ids, arkernels.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=seed, step=step))


@triton.jit
def _survivors_kernel(x_ptr, n, k, prefix, pos_ptr, cnt_ptr, DT: tl.constexpr, KS: tl.constexpr):
    pos, cnt = survivor_positions(x_ptr, n, k, prefix, 20, DT, KS)
    tl.store(pos_ptr + tl.arange(0, KS), pos)
    tl.store(cnt_ptr, cnt)


def _key(x):
    b = x.view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


@pytest.mark.parametrize("case", ["spread", "consecutive", "ties", "few", "above"])
def test_survivor_positions(case):
    """``survivor_positions`` on candidate sets built to need 0..3 radix levels or none that fits: the survivors are
    an upper set (every candidate at or above the smallest survivor), hold the top-k set, fit KMAX when a fitting
    upper set exists, and come out in candidate order."""
    gen = torch.Generator().manual_seed(3)
    DT, k = 512, 60
    if case == "spread":
        x = 5.0 + 0.4 * torch.rand(300, generator=gen)
    elif case == "consecutive":  # keys 1 apart, the k-th 60 keys below the top: all three levels (the last on 4 bits)
        x = (torch.tensor(5.0).view(torch.int32) + torch.randperm(300, generator=gen).int()).view(torch.float32)
        k = 61
    elif case == "ties":  # 80 tokens tied at the k-th value: no upper set of <= KMAX holds the top-k
        x = torch.cat([torch.full((80,), 5.25), 5.0 + 0.2 * torch.rand(200, generator=gen), torch.full((20,), 5.3)])
    elif case == "few":
        x, k = 5.0 + 0.4 * torch.rand(40, generator=gen), 50
    else:  # the k-th largest above the cutoff bucket (an inconsistent cutoff): refused
        x, k = torch.cat([torch.full((70,), 7.0), torch.full((100,), 5.2)]), 60
    n = x.numel()
    prefix = int(_key(torch.tensor([5.0]))[0]) >> 20
    buf = torch.zeros(DT)
    buf[:n] = x
    pos, cnt = torch.zeros(KMAX, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _survivors_kernel[(1,)](buf, n, k, prefix, pos, cnt, DT=DT, KS=KMAX)
    cnt = int(cnt[0])
    if case == "ties":
        assert cnt > KMAX
        return
    if case == "above":
        assert cnt < min(k, n)
        return
    assert min(k, n) <= cnt <= KMAX
    surv = pos[:cnt].long()
    assert torch.equal(surv, surv.sort().values) and len(set(surv.tolist())) == cnt
    lo = x[surv].min()
    assert torch.equal(torch.sort(surv).values, (x >= lo).nonzero()[:, 0])  # an upper set of the candidates
    assert (x[surv] >= torch.sort(x, descending=True).values[min(k, n) - 1]).all()  # holds the top-k set
    if case == "consecutive":
        assert cnt == k  # narrowed to the k-th key itself


@triton.jit
def _thresholds_kernel(x_ptr, n, m, T, k, p, out_ptr, KS: tl.constexpr):
    j = tl.arange(0, KS)
    live = j < n
    tk, z, tp = survivor_thresholds(tl.load(x_ptr + j, mask=live, other=float("-inf")), live, m, T, k, p, KS)
    tl.store(out_ptr, tk)
    tl.store(out_ptr + 1, tp)


def _want_thresholds(x, T, k, p):
    """Top-k's threshold (the k-th largest, -inf when fewer) and top-p's on z over the top-k set (the largest z whose
    fp64 mass strictly below is under 1 - p; p is placed between boundaries), from sorted fp64."""
    xs = torch.sort(x.double(), descending=True).values
    tk = float(xs[k - 1]) if k <= x.numel() else float("-inf")
    m = float(xs[0])
    z = ((x.double() - m) / T)[x >= tk]
    if p >= 1:
        return tk, float("-inf")
    q = torch.exp(z) / torch.exp(z).sum()
    below = torch.stack([q[z < v].sum() for v in z])
    passing = z[below <= 1 - p]
    return tk, float(passing.max()) if passing.numel() else float("-inf")


@pytest.mark.parametrize("case", ["distinct", "ties", "k1", "fewer", "topp"])
def test_survivor_thresholds(case):
    """``survivor_thresholds`` against sorted fp64: top-k's threshold is the k-th largest value exactly (ties at it
    kept, fewer survivors than k keep all), top-p's the z of the smallest kept token (p between boundaries)."""
    gen = torch.Generator().manual_seed(9)
    T, p = 0.8, 1.0
    x = torch.randn(50, generator=gen) * 2
    k = 20
    if case == "ties":
        x = torch.round(x * 2) / 2  # many ties, also at the k-th value
    elif case == "k1":
        k = 1
    elif case == "fewer":
        k = 60
    elif case == "topp":  # a flat row: the tokens outside the top-k set hold much of the mass (Z is the set's)
        x = torch.round(x * 16) / 64
        tk, _ = _want_thresholds(x, T, k, 1.0)
        z = torch.unique((x[x >= tk].double() - x.max()) / T, sorted=True)
        q = torch.exp(z) * torch.stack([((x[x >= tk].double() - x.max()) / T == v).sum() for v in z])
        q = q / q.sum()
        below = torch.cumsum(q, 0) - q  # mass strictly below each distinct z, ascending
        p = float(1 - (below[len(below) // 2] + below[len(below) // 2 + 1]) / 2)  # halfway between two boundaries
    out = torch.zeros(2)
    _thresholds_kernel[(1,)](x, x.numel(), float(x.max()), T, k, p, out, KS=KMAX)
    tk, tp = _want_thresholds(x, T, k, p)
    assert float(out[0]) == tk
    if case == "topp":
        assert tp > float("-inf") and float(out[1]) == pytest.approx(tp, abs=1e-6)
        assert (((x - x.max()) / T) == out[1]).any()  # a survivor's fp32 z, not a value between two
    else:
        assert float(out[1]) == float("-inf")


def test_kmax_is_checked():
    x, T, k, p, mp = (t[:1] for t in _rows())
    with pytest.raises(ValueError, match="kmax"):
        sample_triton(x, T, k, p, mp, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), kmax=48)


def test_pdl_only_where_supported():
    """Programmatic dependent launch is off on the CPU / interpreter, and asking for it there is refused."""
    from arkernels.triton.pdl import pdl_supported

    assert not pdl_supported(torch.device("cpu"))
    x, T, k, p, mp = (t[:1] for t in _rows())
    with pytest.raises(ValueError, match="pdl"):
        sample_triton(x, T, k, p, mp, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), pdl=True)


_PDL_COMPILE = r"""
import inspect, json
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import arkernels.triton.sampling as S
INT = {"topk_ptr": "*i32", "carg_ptr": "*i32", "hist_ptr": "*i32", "rhist_ptr": "*i32", "passes_ptr": "*i32",
       "state_ptr": "*i32", "hrow_ptr": "*i64", "ticket_ptr": "*i64", "cut_ptr": "*i32", "off_ptr": "*i32",
       "ncand_ptr": "*i32"}
fn = S.sampling_stats_kernel
params = list(inspect.signature(fn.fn).parameters)
out = {}
for cap, warps, pdl in ((80, 32, False), (90, 128, True), (90, 128, False)):
    c = dict(BLOCK=S.STATS_BLOCK, R=1, NCP=128, SP=S.MAX_SPLITS, DEBUG=False, STATE=False, BIAS=False, PDL=pdl)
    sig = {p: "constexpr" if p in c else INT.get(p, "*fp32") if p.endswith("_ptr")
           else "i64" if p.startswith("stride") else "i32" for p in params}
    k = triton.compile(ASTSource(fn, signature=sig, constexprs=c), target=GPUTarget("cuda", cap, warps),
                       options=dict(num_warps=16, **({"launch_pdl": True} if pdl else {})))
    out[f"{cap}-{pdl}"] = k.asm["ptx"].count("griddepcontrol")
print(json.dumps(out))
"""


def test_pdl_compiles_in_for_sm90_only():
    """The stats kernel's PTX: ``griddepcontrol`` (wait + launch_dependents) with PDL on sm_90, none for sm_80 (the
    host never sets PDL there) nor with PDL off."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _PDL_COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"80-False": 0, "90-True": 2, "90-False": 0}
