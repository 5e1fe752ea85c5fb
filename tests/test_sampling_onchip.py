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
from arkernels.triton.sampling_select import KMAX, order_key, survivor_positions

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


def test_kmax_is_checked():
    x, T, k, p, mp = (t[:1] for t in _rows())
    with pytest.raises(ValueError, match="kmax"):
        sample_triton(x, T, k, p, mp, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), kmax=48)
