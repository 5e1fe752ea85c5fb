"""Fused temperature -> top-k -> top-p -> min-p -> draw, one Triton kernel, no sort, no host sync.

What it computes: for every row of ``logits [batch, vocab]`` (fp32/fp16/bf16, rows strided by
``stride_row``, columns contiguous) either one token id (``DRAW``) or the filtered, renormalised fp32
distribution (``WRITE_PROBS``), with transformers' semantics (see arkernels/ops/sampling.py).

Parallelisation: one program per row, looping over the vocabulary in blocks; every pass is a block
reduction, so nothing is held per row beyond a few scalars and the launch is one kernel, graph-capturable
(no host sync, no data-dependent launch shape).

Why thresholds and not a sort: every filter keeps an *upper set* of the row, so the kept set is
``{x_i >= t_k} & {z_i >= t_p} & {exp(z_i) >= min_p}`` (``z = (x - max) / T``). Each threshold is found
by a multi-pivot search over the row's values:
  * the bracket ``[lo, cand]`` always holds the answer; ``lo`` is a value whose upper-set weight was
    *measured* to reach the target, ``cand`` the largest row value that still might;
  * one pass evaluates ``PIVOTS`` (16) pivots spaced evenly in the order-preserving integer key space of
    fp32, and also snaps every pivot to the nearest row values above/below it, so the bracket shrinks by
    at least 16x per pass over the 2^32 keys (<= 8 passes) and usually far faster (it collapses as soon as
    no row value lies strictly inside it);
  * top-k weights are 1 (exact counts, ties at the k-th value kept), top-p weights are ``exp(z)`` over the
    top-k set against ``p * sum``; the update only trusts measured sums and always keeps ``lo`` (a value
    that passed) -- float prefix sums that are not monotone cannot make it drop the maximum or loop;
    ``MAX_PASSES`` bounds the loop for graph capture anyway.
  * min-p needs no search: ``p_i >= min_p * p_max``  <=>  ``exp(z_i) >= min_p`` since ``z_max = 0``.
Passes over the row: 1 (max/argmax) + 1 (draw) without filters; + top-k search passes; + 1 (top-k mass)
+ top-p search passes with top-p.

Why an exponential race for the draw: ``argmax_i z_i - log(E_i)`` with ``E_i ~ Exp(1)`` draws ``i`` with
probability ``p_i`` (Gumbel-max); it needs no normalisation, no prefix sum and one pass, and ``E_i``
comes from a counter-based hash of (seed, step, column), so a row's token never depends on its batch
position. ``_row_key_torch`` / ``_uniform_torch`` below are the bit-identical torch twins the CPU path
uses, so CPU and GPU draw the same token up to rounding of exp/log (a race decided within an ulp, ~1e-6 of draws).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a constexpr: jit code may read it
PIVOTS = 16  # pivots per search pass: the bracket shrinks >= 16x per pass
MAX_PASSES = 12  # 2^32 keys / 16^8 = 1: 8 passes suffice; 12 leaves room, bounds the loop for graphs
DRAW_BLOCK = 2048  # elements per block in the streaming passes
SEARCH_BLOCK = 512  # elements per block in the search passes ([SEARCH_BLOCK, PIVOTS] tiles)


# ---------------------------------------------------------------------------------------------------------
# The random stream: uint32 hash of (seed, step, column) -> U in (0, 1), open at both ends.
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _fmix32(h):
    # murmur3's finaliser: a bijection of uint32 with full avalanche
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _row_key(seed, step):
    """seed, step: int64 scalars -> uint32 key of the row's stream."""
    a = _fmix32(seed.to(tl.uint32) ^ 0x243F6A88)
    a = _fmix32(a ^ (seed >> 32).to(tl.uint32))
    a = _fmix32(a ^ step.to(tl.uint32))
    a = _fmix32(a ^ (step >> 32).to(tl.uint32))
    return a


@triton.jit
def _uniform(key, cols):
    h = _fmix32(cols.to(tl.uint32) * 0x9E3779B9 + key)
    h = _fmix32(h ^ key)
    # 24 random bits + 0.5, times 2^-24: exact in fp32, never 0 or 1
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08


# The torch twin works on int32 holding the uint32 bits: int32 multiplication wraps mod 2^32 like uint32, and
# a logical right shift is an arithmetic one masked to the remaining bits (2-3x faster than int64 on the CPU).
def _s32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


def _to_u32_bits(v: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of an int64 tensor as int32."""
    lo = v & 0xFFFFFFFF
    return (lo - ((lo >> 31) << 32)).to(torch.int32)


def _fmix32_torch(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _s32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _s32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


def _row_key_torch(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``_row_key``: seed, step int64 ``[n]`` -> the rows' keys (uint32 bits in int32)."""
    a = _fmix32_torch(_to_u32_bits(seed) ^ 0x243F6A88)
    a = _fmix32_torch(a ^ _to_u32_bits(seed >> 32))
    a = _fmix32_torch(a ^ _to_u32_bits(step))
    return _fmix32_torch(a ^ _to_u32_bits(step >> 32))


def _uniform_torch(key: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``_uniform``, bit-identical: row keys and vocab columns (broadcast together, e.g.
    ``[batch, 1]`` against ``[1, vocab]``, or two ``[n]`` for gathered pairs) -> fp32 U in (0, 1)."""
    h = _fmix32_torch(cols.to(torch.int32) * _s32(0x9E3779B9) + key)
    h = _fmix32_torch(h ^ key)
    return (((h >> 8) & 0xFFFFFF).to(torch.float32) + 0.5) * 5.9604644775390625e-08


# ---------------------------------------------------------------------------------------------------------
# Row helpers
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _load_row(base, offs, mask):
    """Logits as fp32 (loads in any float dtype, arithmetic only after the upcast); NaN -> -inf,
    +inf -> FLT_MAX (tokens at +inf share the mass), masked lanes -> -inf."""
    x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    return tl.minimum(x, FLT_MAX)


@triton.jit
def _key(v):
    # order-preserving fp32 -> int32 map (an involution: the same formula maps back)
    b = v.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _threshold(base, V, lo, cand, target, m, T, tk,
               MASS: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Largest row value ``t`` with ``W(t) = sum_{v_i >= t} w_i >= target``.

    MASS False: ``v = x``, ``w = 1`` (top-k). MASS True: ``v = z = (x - m) / T``, ``w = exp(z)`` over the
    tokens with ``x >= tk`` (top-p over the top-k set). ``lo`` must satisfy the target (or be -inf: keep
    all), ``cand`` bounds the answer from above (the row's largest ``v``)."""
    j = tl.arange(0, P)
    it = 0
    while (cand > lo) & (it < MAX_PASSES):
        klo = _key(lo).to(tl.int64)
        kc = _key(cand).to(tl.int64)
        piv = _unkey((klo + ((j + 1) * (kc - klo) + P - 1) // P).to(tl.int32))  # [P] in (lo, cand]
        W = tl.zeros([P], dtype=tl.float32)
        up = tl.full([P], float("inf"), tl.float32)  # smallest row value >= pivot
        down = tl.full([P], float("-inf"), tl.float32)  # largest row value < pivot
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = _load_row(base, offs, mask)
            if MASS:
                v = tl.math.div_rn(x - m, T)
                w = tl.exp(v)
                inset = mask & (x >= tk)
            else:
                v = x
                w = tl.full([BLOCK], 1.0, tl.float32)
                inset = mask
            ge = (v[:, None] >= piv[None, :]) & inset[:, None]
            W += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
            up = tl.minimum(up, tl.min(tl.where(ge, v[:, None], float("inf")), axis=0))
            below = inset[:, None] & (v[:, None] < piv[None, :])
            down = tl.maximum(down, tl.max(tl.where(below, v[:, None], float("-inf")), axis=0))
        # the largest passing pivot; pivots above it all failed (whatever the float sums did)
        J = tl.max(tl.where(W >= target, j, -1), axis=0)
        lo = tl.where(J >= 0, tl.max(tl.where(j == J, up, float("-inf")), axis=0), lo)
        cand = tl.where(J + 1 < P, tl.max(tl.where(j == J + 1, down, float("-inf")), axis=0), lo)
        it += 1
    return lo


# ---------------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def sampling_kernel(
    logits_ptr, stride_row, V,  # [batch, V] any float dtype, row stride in elements
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # [batch] fp32, int32, fp32, fp32
    seed_ptr, step_ptr,  # [batch] int64 (DRAW only)
    ids_ptr, valid_ptr,  # [batch] int64, bool (DRAW only)
    probs_ptr, stride_probs,  # [batch, V] fp32 (WRITE_PROBS only)
    DRAW: tl.constexpr, WRITE_PROBS: tl.constexpr,
    BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, P: tl.constexpr, MAX_PASSES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    T = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)

    # pass 1: max, greedy argmax (lowest index among the maxima), min
    m = tl.full((), float("-inf"), tl.float32)
    arg = tl.zeros((), tl.int32)
    mn = tl.full((), float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = _load_row(base, offs, mask)
        bm = tl.max(x, axis=0)
        bi = tl.min(tl.where(mask & (x == bm), offs, V), axis=0)
        arg = tl.where(bm > m, bi, arg)
        m = tl.maximum(m, bm)
        mn = tl.minimum(mn, tl.min(tl.where(mask, x, float("inf")), axis=0))
    valid = m > float("-inf")
    sampled = valid & (T > 0)
    T = tl.where(sampled, T, 1.0)
    Vs = tl.where(sampled, V, 0)  # greedy and invalid rows skip every further pass

    # top-k: the k-th largest logit, ties kept
    tk = tl.full((), float("-inf"), tl.float32)
    if (k > 0) & (k < V):
        tk = _threshold(base, Vs, mn, m, k.to(tl.float32), m, T, tk,
                        False, SEARCH_BLOCK, P, MAX_PASSES)

    # top-p over the renormalised top-k set: keep z >= tp, the crossing token's z
    tp = tl.full((), float("-inf"), tl.float32)
    if p < 1.0:
        mass = tl.zeros((), tl.float32)
        for start in range(0, Vs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = _load_row(base, offs, mask)
            z = tl.math.div_rn(x - m, T)
            mass += tl.sum(tl.where(mask & (x >= tk), tl.exp(z), 0.0), axis=0)
        tp = _threshold(base, Vs, tp, tl.zeros((), tl.float32), p * mass, m, T, tk, True, SEARCH_BLOCK, P, MAX_PASSES)

    if DRAW:
        key = _row_key(tl.load(seed_ptr + row), tl.load(step_ptr + row))
        best = tl.full((), float("-inf"), tl.float32)
        best_i = arg  # greedy / invalid rows: the argmax (0 for a row with no finite logit)
        for start in range(0, Vs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = _load_row(base, offs, mask)
            z = tl.math.div_rn(x - m, T)
            keep = mask & (x >= tk) & (z >= tp) & (tl.exp(z) >= min_p)
            score = tl.where(keep, z - tl.log(-tl.log(_uniform(key, offs))), float("-inf"))
            bs = tl.max(score, axis=0)
            bi = tl.min(tl.where(keep & (score == bs), offs, V), axis=0)
            best_i = tl.where(bs > best, bi, best_i)
            best = tl.maximum(best, bs)
        tl.store(ids_ptr + row, best_i.to(tl.int64))
        tl.store(valid_ptr + row, valid)

    if WRITE_PROBS:
        total = tl.zeros((), tl.float32)
        for start in range(0, Vs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = _load_row(base, offs, mask)
            z = tl.math.div_rn(x - m, T)
            e = tl.exp(z)
            total += tl.sum(tl.where(mask & (x >= tk) & (z >= tp) & (e >= min_p), e, 0.0), axis=0)
        out = probs_ptr + row * stride_probs
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            if sampled:
                x = _load_row(base, offs, mask)
                z = tl.math.div_rn(x - m, T)
                e = tl.exp(z)
                pr = tl.where((x >= tk) & (z >= tp) & (e >= min_p), e / total, 0.0)
            else:  # greedy: one-hot at the argmax; no finite logit: all zeros
                pr = tl.where(offs == arg, 1.0, 0.0) * valid.to(tl.float32)
            tl.store(out + offs, pr, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launchers (inputs already validated and converted by arkernels/ops/sampling.py)
# ---------------------------------------------------------------------------------------------------------
def _launch(logits, temperature, top_k, top_p, min_p, seed, step, draw: bool, write_probs: bool):
    batch, vocab = logits.shape
    dev = logits.device
    ids = torch.empty(batch, dtype=torch.int64, device=dev)
    valid = torch.empty(batch, dtype=torch.bool, device=dev)
    probs = torch.empty((batch, vocab) if write_probs else (1, 1), dtype=torch.float32, device=dev)
    if seed is None:
        seed = step = ids  # unused when DRAW is False
    if batch > 0:
        with torch.cuda.device(dev) if dev.type == "cuda" else _null():
            sampling_kernel[(batch,)](
                logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p, seed, step,
                ids, valid, probs, probs.stride(0),
                DRAW=draw, WRITE_PROBS=write_probs, BLOCK=DRAW_BLOCK, SEARCH_BLOCK=SEARCH_BLOCK,
                P=PIVOTS, MAX_PASSES=MAX_PASSES, num_warps=8,
            )
    return ids, valid, probs


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def sample_triton(logits, temperature, top_k, top_p, min_p, seed, step):
    """The ``arkernels::sample`` kernel: ``(ids int64 [batch], valid bool [batch])``."""
    ids, valid, _ = _launch(logits, temperature, top_k, top_p, min_p, seed, step, True, False)
    return ids, valid


def sampling_probs_triton(logits, temperature, top_k, top_p, min_p):
    """The ``arkernels::sampling_probs`` kernel: fp32 ``[batch, vocab]``."""
    return _launch(logits, temperature, top_k, top_p, min_p, None, None, False, True)[2]
