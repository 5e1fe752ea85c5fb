"""sample / sampling_probs against the float64 reference.

Filters are exact (the kept set must equal the reference's; parameters are placed between float decision
boundaries so fp32 sums cannot legitimately differ from fp64), probabilities agree to fp32 rounding, and
draws are checked statistically (chi-square) and for exact CPU == Triton agreement. The Triton kernel runs
here in interpreter mode on CPU tensors (conftest sets TRITON_INTERPRET=1): small grids.
"""
import math

import pytest
import torch
from scipy import stats

import arkernels
from arkernels.ops.sampling_cpu import row_key_torch, uniform_torch
from arkernels.reference.sampling import sample_ref, sampling_probs_ref
from arkernels.triton.sampling import MAX_SPLITS, STATS_BLOCK, TILE_CHUNKS, sampling_stats_kernel
from arkernels.triton.sampling_launch import (TARGET_PROGRAMS, sample_triton, sampling_probs_triton, sampling_splits,
                                              sampling_tile_chunks, sampling_workspace)
from conftest import DEVICES

VOCABS = [111, 32003]  # odd small vocab, and a 32k-scale one (not a power of two)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["op", "triton"]  # the op through its CPU registration; the Triton kernel directly (interpreter)
TIES = {111: 4.0, 32003: 64.0}  # logits rounded to 1/TIES: many ties, also at the k-th value and the top-p boundary
CHI2_ALPHA = 1e-3  # significance of the goodness-of-fit test; fixed seeds make it deterministic


def _logits(batch, vocab, seed, scale=2.0, ties=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=gen) * scale
    if ties:
        x = torch.round(x * ties) / ties
    return x.to(dtype)


def _groups(x, T, k):
    """fp64 distinct-value groups of one row after temperature and top-k: (values desc, q per group,
    mass strictly above each group)."""
    x = x.double()
    if 0 < k < x.numel():
        x = x[x >= torch.sort(x, descending=True).values[k - 1]]
    vals, counts = torch.unique(x, sorted=True, return_counts=True)
    vals, counts = vals.flip(0), counts.flip(0)
    q = torch.exp((vals - vals[0]) / T) * counts
    q = q / q.sum()
    return vals, q, torch.cumsum(q, 0) - q


def _safe_top_p(x, T, k, p0):
    """A top_p near p0 halfway between two decision boundaries (the masses strictly above consecutive
    groups), so the kept set is unambiguous in fp32: the margin is half the crossing group's mass."""
    _, q, above = _groups(x, T, k)
    i = int(torch.searchsorted(above, torch.tensor(p0, dtype=torch.float64)).clamp(1, len(above) - 1))
    nxt = above[i] if i < len(above) else torch.tensor(1.0, dtype=torch.float64)
    return float((above[i - 1] + nxt) / 2)


def _safe_min_p(x, T, frac):
    """A min_p halfway between two consecutive distinct ratios p_i / p_max near the ``frac`` quantile."""
    vals, _, _ = _groups(x, T, 0)
    r = torch.exp((vals - vals[0]) / T)
    i = max(1, min(len(r) - 1, int(frac * len(r))))
    return float((r[i - 1] + r[i]) / 2)


def _row_params(x, vocab):
    """Per-row mixed parameters: every filter alone, all combined, greedy, and all off."""
    batch = x.shape[0]
    T = torch.tensor([1.0, 0.7, 1.3, 0.9, 1.0, 0.0, 2.0, 1.0][:batch])
    k = torch.tensor([0, 5, 0, 0, 40, 3, 17, vocab][:batch], dtype=torch.int32)
    p0 = [1.0, 1.0, 0.6, 1.0, 0.8, 0.5, 0.7, 1.0][:batch]
    m0 = [0.0, 0.0, 0.0, 0.3, 0.05, 0.0, 0.5, 0.0][:batch]
    p = [(_safe_top_p(x[b].float(), float(T[b]), int(k[b]), p0[b]) if p0[b] < 1 and T[b] > 0 else p0[b])
         for b in range(batch)]
    mp = [(_safe_min_p(x[b].float(), float(T[b]), m0[b]) if m0[b] > 0 else 0.0) for b in range(batch)]
    return T, k, torch.tensor(p), torch.tensor(mp)


def _probs(impl, x, T, k, p, mp):
    if impl == "triton":
        return sampling_probs_triton(x, T, k, p, mp)
    return arkernels.sampling_probs(x, temperature=T, top_k=k, top_p=p, min_p=mp)


def _sample(impl, x, T, k, p, mp, seed, step):
    if impl == "triton":
        return sample_triton(x, T, k, p, mp, seed, step)
    return arkernels.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=seed, step=step, return_valid=True)


def _check_probs(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got > 0, want > 0)  # the kept set is exact
    # fp32 exp and sums against fp64: a few ulp of each probability
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_sampling_probs_filters_match_reference(impl, vocab):
    batch = 8 if vocab < 1000 else 5
    x = _logits(batch, vocab, seed=vocab, ties=TIES[vocab])
    T, k, p, mp = _row_params(x, vocab)
    got = _probs(impl, x, T, k, p, mp)
    want = sampling_probs_ref(x, T, k, p, mp)
    _check_probs(got, want)
    # the filters did bite: row 1 keeps the (tied) top 5, row 2 loses mass to top-p
    assert 5 <= int((got[1] > 0).sum()) < vocab and int((got[2] > 0).sum()) < vocab


@pytest.mark.parametrize("impl", IMPLS)
def test_top_k_keeps_ties_at_kth_value(impl):
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.5]])
    ones = torch.ones(1)
    got = _probs(impl, x, ones, torch.tensor([3], dtype=torch.int32), ones, torch.zeros(1))
    assert torch.equal(got[0] > 0, torch.tensor([0, 1, 1, 1, 1, 0, 1, 0], dtype=torch.bool))


@pytest.mark.parametrize("impl", IMPLS)
def test_top_p_keeps_crossing_token_and_its_ties(impl):
    # probabilities 0.4, 0.2, 0.2, 0.1, 0.1: mass above the 0.2 pair is 0.4 < 0.5 -> both kept, even
    # though the first of them already crosses 0.5; mass above the 0.1 pair is 0.8 -> dropped
    q = torch.tensor([[0.1, 0.2, 0.4, 0.2, 0.1]])
    x = torch.log(q)
    ones = torch.ones(1)
    got = _probs(impl, x, ones, torch.zeros(1, dtype=torch.int32), torch.tensor([0.5]), torch.zeros(1))
    assert torch.equal(got[0] > 0, torch.tensor([0, 1, 1, 1, 0], dtype=torch.bool))
    torch.testing.assert_close(got[0], torch.tensor([0.0, 0.25, 0.5, 0.25, 0.0]))
    # a tiny top_p still keeps the maximum
    got = _probs(impl, x, ones, torch.zeros(1, dtype=torch.int32), torch.tensor([1e-6]), torch.zeros(1))
    assert torch.equal(got[0], torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_special_rows(impl):
    """NaN, +inf and all -inf rows mixed with normal and greedy rows: nothing leaks across rows."""
    V = 37
    x = _logits(6, V, seed=3)
    x[0, 4] = float("nan")
    x[1, [5, 20]] = float("inf")  # the +inf tokens share the mass
    x[2] = float("-inf")
    x[3] = float("nan")
    x[4, :] = float("-inf")
    x[4, 30] = -2.0  # a single finite logit
    T = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])  # row 5: greedy
    k = torch.tensor([0, 0, 5, 0, 3, 0], dtype=torch.int32)
    p, mp = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.9, 1.0]), torch.zeros(6)
    probs = _probs(impl, x, T, k, p, mp)
    assert not torch.isnan(probs).any()
    assert probs[0, 4] == 0 and math.isclose(float(probs[0].sum()), 1.0, rel_tol=1e-5)
    torch.testing.assert_close(probs[1, [5, 20]], torch.tensor([0.5, 0.5]))
    assert float(probs[1].sum()) == 1.0
    assert torch.all(probs[2] == 0) and torch.all(probs[3] == 0)
    assert probs[4, 30] == 1.0
    assert probs[5, int(torch.argmax(x[5]))] == 1.0
    ids, valid = _sample(impl, x, T, k, p, mp, torch.arange(6), torch.zeros(6, dtype=torch.int64))
    assert ids.dtype == torch.int64 and valid.dtype == torch.bool
    assert valid.tolist() == [True, True, False, False, True, True]
    assert ids[0] != 4 and int(ids[1]) in (5, 20) and ids[2] == 0 and ids[3] == 0 and ids[4] == 30
    assert ids[5] == torch.argmax(x[5])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_picks_lowest_index_among_maxima(impl):
    x = torch.tensor([[0.0, 2.0, 1.0, 2.0], [float("-inf"), 5.0, 5.0, float("nan")]])
    z2 = torch.zeros(2)
    ids, valid = _sample(impl, x, z2, torch.zeros(2, dtype=torch.int32), torch.ones(2), z2,
                         torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert ids.tolist() == [1, 1] and valid.all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_low_precision_and_strided_rows(impl, dtype):
    """fp16/bf16 logits as rows of a padded buffer (row stride > vocab): the same as the reference on the
    same (upcast) values."""
    V, pad = 111, 13
    buf = _logits(4, V + pad, seed=11, ties=8.0, dtype=dtype)
    x = buf[:, :V]
    assert not x.is_contiguous() and x.stride(0) == V + pad
    T = torch.tensor([1.0, 0.8, 1.2, 0.0])
    k = torch.tensor([0, 10, 0, 0], dtype=torch.int32)
    p = torch.tensor([1.0, 1.0, _safe_top_p(x[2].float(), 1.2, 0, 0.7), 1.0])
    mp = torch.tensor([_safe_min_p(x[0].float(), 1.0, 0.3), 0.0, 0.0, 0.0])
    got = _probs(impl, x, T, k, p, mp)
    _check_probs(got, sampling_probs_ref(x, T, k, p, mp))
    seed, step = torch.tensor([5, 6, 7, 8]), torch.tensor([1, 1, 2, 2])
    ids, _ = _sample(impl, x, T, k, p, mp, seed, step)
    assert torch.equal(ids, _sample(impl, x.contiguous(), T, k, p, mp, seed, step)[0])
    assert torch.all(got.gather(1, ids[:, None]) > 0)


def test_cpu_and_triton_draw_the_same_tokens_as_the_reference():
    """Same inputs, same (seed, step): the CPU op, the Triton kernel and the fp64 reference (its own
    re-derivation of the hash) pick the same token."""
    V = 111
    x = _logits(8, V, seed=21, ties=4.0)
    T, k, p, mp = _row_params(x, V)
    seed = torch.tensor([0, -1, 2**40 + 3, 7, -(2**62), 11, 12, 13])
    for step_value in (0, 1, 2**33 + 5):
        step = torch.full((8,), step_value, dtype=torch.int64)
        ids_op, valid_op = _sample("op", x, T, k, p, mp, seed, step)
        ids_tr, valid_tr = _sample("triton", x, T, k, p, mp, seed, step)
        ids_ref, valid_ref = sample_ref(x, T, k, p, mp, seed, step)
        assert torch.equal(ids_op, ids_tr) and torch.equal(valid_op, valid_tr)
        assert torch.equal(ids_op, ids_ref) and torch.equal(valid_op, valid_ref)


def test_draws_follow_sampling_probs_chi_square():
    """4000 draws of one row (4000 seeds) under every filter: never outside the kept set, and a chi-square
    goodness-of-fit against sampling_probs that a correct sampler passes at alpha = 1e-3."""
    V, n = 111, 4000
    row = _logits(1, V, seed=5, scale=1.5)
    T, k = 0.9, 30
    p = _safe_top_p(row[0], T, k, 0.85)
    mp = _safe_min_p(row[0], T, 0.1)
    probs = arkernels.sampling_probs(row, temperature=T, top_k=k, top_p=p, min_p=mp)[0].double()
    ids = arkernels.sample(row.expand(n, V), temperature=T, top_k=k, top_p=p, min_p=mp,
                           seed=torch.arange(n) * 7919, step=3)
    counts = torch.bincount(ids, minlength=V).double()
    assert counts[probs == 0].sum() == 0
    kept = (probs > 0).nonzero()[:, 0]
    assert len(kept) >= 5
    assert stats.chisquare(*_pooled(counts[kept], probs[kept])).pvalue > CHI2_ALPHA
    # the same test rejects a wrong distribution (uniform over the kept set) for these draws
    assert stats.chisquare(*_pooled(counts[kept], torch.ones(len(kept), dtype=torch.float64))).pvalue < CHI2_ALPHA


def _pooled(obs, probs):
    """(observed, expected) with bins expected under 5 draws pooled into one, expected scaled to the
    observed total (chi-square's validity condition)."""
    exp = probs / probs.sum() * obs.sum()
    small = exp < 5
    obs_b, exp_b = obs[~small], exp[~small]
    if small.any():
        obs_b, exp_b = torch.cat([obs_b, obs[small].sum()[None]]), torch.cat([exp_b, exp[small].sum()[None]])
    exp_b = exp_b / exp_b.sum() * obs_b.sum()
    return obs_b.numpy(), exp_b.numpy()


@pytest.mark.parametrize("impl", IMPLS)
def test_seeded_draws_are_batch_invariant(impl):
    """A row alone, in a batch of 5 and in a shuffled batch draws the same token; a new step draws afresh."""
    V = 111
    x = _logits(5, V, seed=8, scale=0.5)
    T, k = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.0]), torch.tensor([0, 0, 50, 0, 9], dtype=torch.int32)
    p, mp = torch.tensor([1.0, 0.95, 1.0, 0.9, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.01])
    seed, step = torch.tensor([10, 20, 30, 40, 50]), torch.tensor([4, 4, 5, 5, 6])
    full, _ = _sample(impl, x, T, k, p, mp, seed, step)
    perm = torch.tensor([3, 0, 4, 2, 1])
    shuffled, _ = _sample(impl, x[perm], T[perm], k[perm], p[perm], mp[perm], seed[perm], step[perm])
    assert torch.equal(shuffled, full[perm])
    for b in (0, 3):
        alone, _ = _sample(impl, x[b:b + 1], T[b:b + 1], k[b:b + 1], p[b:b + 1], mp[b:b + 1], seed[b:b + 1],
                           step[b:b + 1])
        assert alone[0] == full[b]
    again, _ = _sample(impl, x, T, k, p, mp, seed, step)
    assert torch.equal(again, full)
    draws = {int(_sample(impl, x[:1], T[:1], k[:1], p[:1], mp[:1], seed[:1], torch.tensor([s]))[0][0])
             for s in range(12)}
    assert len(draws) >= 4  # 12 steps over a flat 111-token row: fresh draws, not one repeated token


def test_unseeded_reproducible_under_manual_seed_and_generator():
    x = _logits(16, 111, seed=9, scale=0.3)
    torch.manual_seed(1234)
    a = arkernels.sample(x, top_p=0.9)
    torch.manual_seed(1234)
    b = arkernels.sample(x, top_p=0.9)
    assert torch.equal(a, b)
    c = arkernels.sample(x, top_p=0.9)
    assert not torch.equal(a, c)  # the default generator advanced: 16 rows of a flat row agree by chance ~0
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(arkernels.sample(x, generator=g1), arkernels.sample(x, generator=g2))


def test_step_and_params_as_tensors_and_numbers_agree():
    x = _logits(3, 111, seed=12)
    a = arkernels.sample(x, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=7, step=3)
    b = arkernels.sample(x, temperature=torch.full((3,), 0.8), top_k=torch.full((3,), 20),
                         top_p=torch.full((3,), 0.9), min_p=torch.full((3,), 0.01),
                         seed=torch.full((3,), 7), step=torch.full((3,), 3))
    assert torch.equal(a, b) and a.dtype == torch.int64 and torch.all((a >= 0) & (a < 111))


BAD_ARGS = [
    (dict(temperature=-0.5), "sample: temperature must be >= 0"),
    (dict(temperature=float("nan")), "sample: temperature must be >= 0"),
    (dict(top_k=-1), "sample: top_k must be >= 0"),
    (dict(top_k=2.5), "sample: top_k must be an int"),
    (dict(top_p=0.0), r"sample: top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"sample: top_p must be in \(0, 1\]"),
    (dict(top_p=torch.tensor([0.5, 1.2])), r"sample: top_p must be in \(0, 1\].*got top_p\[1\]"),
    (dict(min_p=-0.1), r"sample: min_p must be in \[0, 1\]"),
    (dict(min_p=torch.tensor([0.5, 1.01])), r"sample: min_p must be in \[0, 1\]"),
    (dict(top_k=torch.tensor([1, 2, 3])), r"sample: top_k must be a number or a \[batch=2\] tensor"),
    (dict(seed=1.5), "sample: seed must be an int"),
    (dict(step=torch.tensor([0.0, 1.0])), "sample: step must be an int"),
]


@pytest.mark.parametrize("case", range(len(BAD_ARGS)))
def test_sample_bad_inputs(case):
    kwargs, match = BAD_ARGS[case]
    with pytest.raises(ValueError, match=match):
        arkernels.sample(torch.zeros(2, 10), **kwargs)


def test_bad_logits_and_op_level_checks():
    with pytest.raises(ValueError, match="sampling_probs: logits must be float32, float16 or bfloat16"):
        arkernels.sampling_probs(torch.zeros(2, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sample: logits must be a \[batch, vocab\] tensor"):
        arkernels.sample(torch.zeros(10))
    ops, x, f = torch.ops.arkernels, torch.zeros(2, 10), torch.ones(2)
    i32, i64 = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="sample: top_k must be torch.int32"):
        ops.sample(x, f, i64, f, f, i64, i64)
    with pytest.raises(RuntimeError, match=r"sampling_probs: temperature must be \[batch=2\]"):
        ops.sampling_probs(x, torch.ones(3), i32, f, f)
    with pytest.raises(RuntimeError, match="sample: seed must be torch.int64"):
        ops.sample(x, f, i32, f, f, i32, i64)


def test_sampling_opcheck():
    x = _logits(3, 50, seed=1)
    f, T = torch.ones(3), torch.tensor([1.0, 0.0, 0.5])
    k = torch.tensor([0, 4, 10], dtype=torch.int32)
    p, mp = torch.tensor([0.9, 1.0, 0.8]), torch.tensor([0.0, 0.1, 0.0])
    torch.library.opcheck(torch.ops.arkernels.sampling_probs.default, (x, T, k, p, mp))
    torch.library.opcheck(torch.ops.arkernels.sample.default,
                          (x, T, k, p, mp, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1])))
    del f


def test_sampling_compile_fullgraph():
    def step_fn(logits, seed, step):
        ids = arkernels.sample(logits, temperature=0.7, top_k=20, top_p=0.9, seed=seed, step=step)
        return ids, arkernels.sampling_probs(logits, temperature=0.7, top_k=20, top_p=0.9)

    x, seed, step = _logits(4, 111, seed=2), torch.arange(4), torch.full((4,), 3)
    compiled = torch.compile(step_fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, seed, step), step_fn(x, seed, step)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_matches_cpu(device):
    """On a GPU: the Triton kernel against the CPU op on the same inputs (skipped without one)."""
    V = 32003
    x = _logits(6, V, seed=4, ties=TIES[V])
    T, k, p, mp = _row_params(x, V)
    seed, step = torch.arange(6) * 3 + 1, torch.full((6,), 9)
    want = arkernels.sampling_probs(x, temperature=T, top_k=k, top_p=p, min_p=mp)
    got = arkernels.sampling_probs(x.to(device), temperature=T.to(device), top_k=k.to(device),
                                   top_p=p.to(device), min_p=mp.to(device))
    assert torch.equal(got.cpu() > 0, want > 0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-7)
    ids = arkernels.sample(x.to(device), temperature=T.to(device), top_k=k.to(device), top_p=p.to(device),
                           min_p=mp.to(device), seed=seed.to(device), step=step.to(device))
    assert torch.equal(ids.cpu(), arkernels.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=seed,
                                                   step=step))


# ---------------------------------------------------------------------------------------------------------
# The fast path (truncate, compact, search the candidates) against the full-row fallback
# ---------------------------------------------------------------------------------------------------------
FAST_CAP = 256  # a small candidate bound keeps the interpreter grids small; the default (CAND_CAP) is 4096


@pytest.mark.parametrize("impl", ["reference", "op", "triton_probs", "triton_fast", "triton_fallback"])
def test_top_p_matches_transformers_at_float_boundary(impl):
    """transformers' own TopPLogitsWarper test row: log([0.3, 0.1, 0.1, 0.5]) at top_p 0.8 drops both 0.1
    tokens (their fp32 mass from below, 0.2, is <= 1 - 0.8), although the fp64 mass above them,
    0.8000000042, is below fp32 0.8 = 0.8000000119: every path must compare as transformers does."""
    from transformers.generation.logits_process import TopPLogitsWarper

    x = torch.log(torch.tensor([[0.3, 0.1, 0.1, 0.5]]))
    hf_kept = TopPLogitsWarper(0.8)(None, x.clone())[0] > float("-inf")
    assert hf_kept.tolist() == [True, False, False, True]
    n = 24  # 24 seeds of the same row: were the 0.1 tokens kept, the race would pick one for some (checked below)
    xs, T, k = x.expand(n, 4), torch.ones(n), torch.zeros(n, dtype=torch.int32)
    p, mp, seed, step = torch.full((n,), 0.8), torch.zeros(n), torch.arange(n), torch.zeros(n, dtype=torch.int64)
    if impl in ("reference", "op", "triton_probs"):
        fn = {"reference": sampling_probs_ref, "op": lambda *a: _probs("op", *a),
              "triton_probs": lambda *a: _probs("triton", *a)}[impl]
        assert torch.equal(fn(x, T[:1], k[:1], p[:1], mp[:1])[0] > 0, hf_kept)
        return
    if impl == "op":
        ids = arkernels.sample(xs, top_p=0.8, seed=seed)
    else:
        ids, _, (ncand, _) = sample_triton(xs, T, k, p, mp, seed, step, cap=FAST_CAP if impl == "triton_fast" else 1,
                                           debug=True)
        assert bool((ncand >= 0).all()) == (impl == "triton_fast")
    assert hf_kept[ids].all() and len(set(ids.tolist())) == 2
    # the test can fail: the same race over all four tokens picks a 0.1 token for some of these seeds
    u = uniform_torch(row_key_torch(seed, step)[:, None], torch.arange(4)[None, :])
    assert not hf_kept[(x - torch.log(-torch.log(u))).argmax(dim=1)].all()


def _regime_rows(vocab, seed):
    """One row per regime: top-k, top-p alone, top-k + top-p, min-p, temperature only on a peaked row, all
    four, greedy. Parameters sit between float decision boundaries (see _safe_top_p)."""
    x = _logits(7, vocab, seed=seed, scale=4.0)
    x[4] *= 3.0  # peaked: temperature alone leaves few tokens within reach of the race (z >= -21)
    T = torch.tensor([1.0, 0.8, 0.9, 1.0, 1.0, 0.7, 0.0])
    k = torch.tensor([50, 0, 40, 0, 0, 30, 0], dtype=torch.int32)
    p = torch.tensor([1.0, _safe_top_p(x[1], 0.8, 0, 0.9), _safe_top_p(x[2], 0.9, 40, 0.9), 1.0, 1.0,
                      _safe_top_p(x[5], 0.7, 30, 0.8), 1.0])
    mp = torch.tensor([0.0, 0.0, 0.0, _safe_min_p(x[3], 1.0, 0.002), 0.0, 0.02, 0.0])
    return x, T, k, p, mp


def test_fast_path_and_fallback_draw_the_same_tokens():
    """Every regime row takes the fast path with the default bound and the fallback with a bound of 1: the
    same tokens (several steps), the same as the CPU op, inside the reference's kept set; the fast path reads
    the row twice, the fallback more often."""
    V = 4099  # not a multiple of any block
    x, T, k, p, mp = _regime_rows(V, seed=31)
    seed = torch.arange(7) * 101 + 5
    kept = sampling_probs_ref(x, T, k, p, mp) > 0
    for s in (1,):
        step = torch.full((7,), s, dtype=torch.int64)
        fast, valid, (nc_fast, pass_fast) = sample_triton(x, T, k, p, mp, seed, step, debug=True)
        slow, _, (nc_slow, pass_slow) = sample_triton(x, T, k, p, mp, seed, step, cap=1, debug=True)
        # rows 3 and 4 (min-p, temperature alone) need no search: their fallback races in the split programs
        assert (nc_fast[:6] > 0).all() and nc_fast[6] == 0 and nc_slow[:6].tolist() == [-1, -1, -1, -2, -2, -1]
        assert torch.equal(fast, slow) and valid.all()
        assert torch.equal(fast, _sample("op", x, T, k, p, mp, seed, step)[0])
        assert kept.gather(1, fast[:, None]).all()
        assert (pass_fast[:6] == 2).all() and (pass_slow[:6] >= 2).all() and (pass_slow[[0, 2, 5]] >= 3).all()


def test_rows_at_and_over_the_candidate_bound():
    """A row whose top-k bucket holds exactly the bound takes the fast path; one more token and it falls
    back; flat rows under top-p 0.99 or temperature alone overflow the default bound (the latter races in the
    split programs, the same token as in one). All draw what the CPU op draws."""
    V, cap = 5003, FAST_CAP  # the flat row (2) has > 4096 candidates: over the default bound too
    gen = torch.Generator().manual_seed(2)
    x = torch.full((4, V), -6.0) - torch.rand(4, V, generator=gen)  # buckets far below [5, 5.5)
    x[0, 7:7 + cap] = 5.0 + 0.4 * torch.rand(cap, generator=gen)  # cap tokens in one bucket
    x[1, 11:12 + cap] = 5.0 + 0.4 * torch.rand(cap + 1, generator=gen)  # cap + 1 tokens
    x[2:] = torch.randn(2, V, generator=gen) * 0.05  # flat
    T = torch.ones(4)
    k = torch.tensor([cap, cap + 1, 0, 0], dtype=torch.int32)
    p = torch.tensor([1.0, 1.0, 0.99, 1.0])
    mp, seed, step = torch.zeros(4), torch.tensor([3, 4, 5, 6]), torch.zeros(4, dtype=torch.int64)
    ids, _, (ncand, npass) = sample_triton(x, T, k, p, mp, seed, step, cap=cap, debug=True)
    assert ncand.tolist() == [cap, -1, -1, -2] and npass[3] == 2
    assert torch.equal(ids, _sample("op", x, T, k, p, mp, seed, step)[0])
    assert 7 <= ids[0] < 7 + cap and 11 <= ids[1] < 12 + cap
    ids_default, _, (ncand, _) = sample_triton(x[2:], T[2:], k[2:], p[2:], mp[2:], seed[2:], step[2:], debug=True)
    assert ncand.tolist() == [-1, -2] and torch.equal(ids_default, ids[2:])
    assert sample_triton(x[3:], T[3:], k[3:], p[3:], mp[3:], seed[3:], step[3:], splits=1)[0] == ids[3]


def test_several_programs_per_row_draw_what_one_program_draws():
    """Batch 1, 9 chunks, over 1 program (tiles of 4 chunks: 4 + 4 + 1, no merge), 2 (4 + 1), 3 (3 chunks: one
    tile with a masked chunk row) and the default (9 programs of 1 chunk, the two-level merge over 9 partial
    histograms): the same candidates, passes and token."""
    V = 9000
    x, T, k, p, mp = _regime_rows(V, seed=41)
    assert sampling_splits(1, V) == 9
    for b in (1, 3, 5):  # top-p alone, min-p, all four
        args = (x[b:b + 1], T[b:b + 1], k[b:b + 1], p[b:b + 1], mp[b:b + 1], torch.tensor([b + 9]),
                torch.tensor([2]))
        got = [sample_triton(*args, splits=s, debug=True) for s in (1, 2, 3, None)]
        assert all(torch.equal(g[0], got[0][0]) and torch.equal(g[2][0], got[0][2][0]) and
                   torch.equal(g[2][1], got[0][2][1]) for g in got)
        assert got[0][2][0][0] > 0 and got[0][2][1][0] == 2


def _count_launches(monkeypatch):
    """The names of the Triton kernels launched from now on (the interpreter's launch entry point, counted)."""
    launched = []
    cls = type(sampling_stats_kernel)
    run = cls.run

    def counted(self, *args, **kwargs):
        launched.append(self.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run", counted)
    return launched


def test_sample_is_two_launches_and_leaves_the_workspace_at_zero(monkeypatch):
    """Issue 34: ``sample`` is two launches per call, stats (+ the row's cutoff) and compaction (+ the draw), on
    every path: several programs per row (tickets) or one, fast path, fallback, split race, greedy, rules on; the
    tokens are the CPU op's, and each row's last programs leave the tickets and the row histograms at 0. A ticket
    left stale under another epoch (an aborted launch's) is claimed and the draw is unchanged."""
    launched = _count_launches(monkeypatch)
    V = 9000
    x, T, k, p, mp = _regime_rows(V, seed=61)
    seed, step = torch.arange(7) * 13 + 2, torch.full((7,), 3)
    want = _sample("op", x, T, k, p, mp, seed, step)[0]
    ws, seen = sampling_workspace(torch.device("cpu")), set()
    for rows, splits, cap in ((slice(1, 2), None, FAST_CAP), (slice(0, 7), None, FAST_CAP), (slice(0, 7), None, 1),
                              (slice(0, 7), 1, FAST_CAP)):
        launched.clear()
        args = (x[rows], T[rows], k[rows], p[rows], mp[rows], seed[rows], step[rows])
        ids, valid, (ncand, _) = sample_triton(*args, cap=cap, splits=splits, debug=True)
        assert launched == ["sampling_stats_kernel", "sampling_compact_kernel"]
        assert torch.equal(ids, want[rows]) and valid.all()
        assert not ws.tickets.any() and not ws.rhist.any()
        seen.update(ncand.tolist())
    assert {0, -1, -2} < seen and max(seen) > 0  # greedy, fallback, split race and fast-path rows all ran
    ws.tickets[:7] = (ws.epoch + 5) << 32 | 3  # 3 programs of another launch arrived, its last never did
    ws.tickets[ws.rows:ws.rows + 7] = (ws.epoch + 5) << 32 | 2
    launched.clear()
    assert torch.equal(sample_triton(x, T, k, p, mp, seed, step, cap=1)[0], want)
    assert len(launched) == 2 and not ws.tickets.any()


def test_row_mass_where_used_at_temperature_one_and_not():
    """The stats pass sums the row's mass only for top-p without top-k, without the division at T 1 (x / 1 is x):
    top-p alone at T 1 and at T 0.7 on the fast path and the fallback draws the CPU op's tokens, in the
    reference's kept set (a mass summed wrong moves the cutoff and the top-p threshold)."""
    V, n = 3001, 4
    x = _logits(n, V, seed=71, scale=3.0)
    for t in (1.0, 0.7):
        T, k, mp = torch.full((n,), t), torch.zeros(n, dtype=torch.int32), torch.zeros(n)
        p = torch.tensor([_safe_top_p(x[i], t, 0, p0) for i, p0 in enumerate((0.5, 0.8, 0.9, 0.95))])
        seed, step = torch.arange(n) + 5, torch.zeros(n, dtype=torch.int64)
        kept = sampling_probs_ref(x, T, k, p, mp) > 0
        fast, _, (ncand, _) = sample_triton(x, T, k, p, mp, seed, step, debug=True)
        slow, _ = sample_triton(x, T, k, p, mp, seed, step, cap=1)
        assert (ncand > 0).all() and torch.equal(fast, slow) and kept.gather(1, fast[:, None]).all()
        assert torch.equal(fast, _sample("op", x, T, k, p, mp, seed, step)[0])


@pytest.mark.cuda
def test_cuda_sample_is_two_launches():
    """On a GPU (skipped without one): one ``arkernels.sample`` call at batch 1 and 256, rules off, is two device
    operations in the profiler (kernels, memsets and copies counted): no stand-in or zero fill."""
    from torch.profiler import ProfilerActivity, profile

    for batch in (1, 256):
        x = torch.randn(batch, 128256, device="cuda")
        seed = torch.arange(batch, device="cuda")
        run = lambda: arkernels.sample(x, temperature=0.8, top_k=50, top_p=0.9, seed=seed)  # noqa: E731
        run()
        torch.cuda.synchronize()
        t = torch.tensor([0.8] * batch, device="cuda")
        k = torch.full((batch,), 50, dtype=torch.int32, device="cuda")
        p, mp = torch.full((batch,), 0.9, device="cuda"), torch.zeros(batch, device="cuda")
        step = torch.zeros(batch, dtype=torch.int64, device="cuda")
        sample_triton(x, t, k, p, mp, seed, step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sample_triton(x, t, k, p, mp, seed, step)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert len(names) == 2 and all("sampling_" in n for n in names), names


def test_programs_per_row_plan():
    """``sampling_splits`` (a pure function of batch and vocab): 32-64 programs for a batch-1 128k row, one per
    row at batch 256 (no merge launch), about TARGET_PROGRAMS in all, every program with at least one chunk."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    assert sampling_splits(1, 128256) == 63 and sampling_tile_chunks(cdiv(126, 63)) == 2
    assert sampling_splits(256, 128256) == 1 and sampling_tile_chunks(126) == TILE_CHUNKS
    assert sampling_splits(8, 32000) == 32 and sampling_tile_chunks(1) == 1
    for vocab in (1, 111, 1024, 1025, 9000, 32000, 128256, 256000):
        nchunk, prev = cdiv(vocab, STATS_BLOCK), MAX_SPLITS
        for batch in (1, 2, 7, 8, 33, 64, 132, 133, 256, 4096):
            s = sampling_splits(batch, vocab)
            cps = cdiv(nchunk, s)
            assert 1 <= s <= min(MAX_SPLITS, nchunk) and (s - 1) * cps < nchunk <= s * cps  # no empty program
            assert batch * s <= max(TARGET_PROGRAMS, batch) and s <= prev  # never more programs as batch grows
            assert batch > 4 or nchunk < 32 or 32 <= s  # a small batch spreads a long row over the GPU
            assert sampling_tile_chunks(cps) in (1, 2, TILE_CHUNKS) and sampling_tile_chunks(cps) <= max(cps, 1) * 2
            prev = s


def test_signed_zero_ties_stay_together():
    """+0.0 and -0.0 are tied logits but have different order-preserving keys (histogram buckets): a
    top-k whose k-th value is 0 keeps both signs on the fast path too."""
    V, n = 111, 16
    x = -1.0 - torch.rand(V, generator=torch.Generator().manual_seed(6))
    x[10:30], x[50:70] = 0.0, -0.0
    xs, T, k = x.expand(n, V), torch.ones(n), torch.full((n,), 5, dtype=torch.int32)
    p, mp, seed, step = torch.ones(n), torch.zeros(n), torch.arange(n) + 77, torch.zeros(n, dtype=torch.int64)
    fast, _, (ncand, _) = sample_triton(xs, T, k, p, mp, seed, step, debug=True)
    slow, _ = sample_triton(xs, T, k, p, mp, seed, step, cap=1)
    assert (ncand == 40).all() and torch.equal(fast, slow)
    assert torch.equal(fast, _sample("op", xs, T, k, p, mp, seed, step)[0])
    assert (fast >= 50).any() and (fast < 30).any() and ((fast >= 10) & (fast < 70) & ((fast < 30) | (fast >= 50))).all()


@pytest.mark.cuda
def test_cuda_fast_path_passes_and_graph_capture():
    """On a GPU (skipped without one): at vocab 128256 the fast path reads the row twice and draws what the
    fallback and the CPU op draw; ``sample`` captured in a CUDA graph (no host sync, fixed launch shape)
    replays to the eager tokens for new step values."""
    V = 128256
    x, T, k, p, mp = _regime_rows(V, seed=51)
    seed, step = torch.arange(7) * 11 + 1, torch.full((7,), 4)
    dx, dT, dk, dp, dmp, dseed, dstep = (t.cuda() for t in (x, T, k, p, mp, seed, step))
    fast, _, (ncand, npass) = sample_triton(dx, dT, dk, dp, dmp, dseed, dstep, debug=True)
    slow, _ = sample_triton(dx, dT, dk, dp, dmp, dseed, dstep, cap=1)
    assert (ncand[:6] > 0).all() and (npass[:6] == 2).all()
    assert torch.equal(fast, slow) and torch.equal(fast.cpu(), _sample("op", x, T, k, p, mp, seed, step)[0])
    run = lambda: arkernels.sample(dx, temperature=dT, top_k=dk, top_p=dp, min_p=dmp, seed=dseed, step=dstep)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for s in (5, 6):
        dstep.fill_(s)
        graph.replay()
        assert torch.equal(out, run())
