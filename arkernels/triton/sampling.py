"""Fused temperature -> top-k -> top-p -> min-p -> draw in Triton: truncate, compact, then search; no sort,
no host sync, a launch shape fixed by (batch, vocab), graph-capturable.

What it computes: for every row of ``logits [batch, vocab]`` (fp32/fp16/bf16, rows strided by
``stride_row``, columns contiguous) either one token id (``sample``) or the filtered, renormalised fp32
distribution (``sampling_probs``), with transformers' semantics (see arkernels/ops/sampling.py).

``sample``: two kernels, two full-row passes on the fast path; grids ``(batch, splits)``, ``splits =
sampling_splits(batch, vocab)`` programs per row (about TARGET_PROGRAMS in all, <= MAX_SPLITS: 63 for one 128k row,
1 from batch 133 on), each over whole chunks of STATS_BLOCK columns, TILE_CHUNKS (R) chunks per loop trip.
  1. ``sampling_stats_kernel``: per chunk max, argmax and (rows that use it, ``_needs_z``) ``sum exp((x - chunk
     max) / T)``; per program a histogram of the top 12 bits of the order-preserving fp32 key (NB = 4096 buckets).
     Chunk partials, not program partials, so a row's floats never depend on the batch around it. With several
     programs per row, each adds its occupied buckets into the row histogram (integer atomics: exact) and takes a
     ticket; the row's last program (one program per row: that one) picks the cutoff bucket (``_cutoff``: a
     superset of the final kept set), each program's output offset and the candidate count (``_plan_row``).
  2. ``sampling_compact_kernel``: each program compacts its candidates (bucket >= cutoff) into ``[batch, cap]``
     scratch in column order; over ``cap`` candidates the row falls back (a row needing no search races here,
     split like the stats pass); the row's last program draws (``_draw``): with top-k <= KMAX on chip (candidates
     loaded once, survivors by radix levels, thresholds pairwise: sampling_select.py), else by the pivot search
     and the race on the candidates, or for a flagged row the full-row search.
``sampling_probs``: one program per row, the full-row search (``sampling_probs_kernel``).

Why thresholds and not a sort: every filter keeps an *upper set* of the row, so the kept set is
``{x_i >= t_k} & {z_i >= t_p} & {exp(z_i) >= min_p}`` (``z = (x - max) / T``). ``_threshold`` finds one by a
multi-pivot search: ``PIVOTS`` (16) pivots per pass, spaced evenly in the key space between the bracket
``(lo, cand]`` and snapped to values present: the bracket shrinks >= 16x per pass (<= 8 passes). top-k counts
(ties at the k-th value kept). top-p compares the way transformers' TopPLogitsWarper does: fp32
probabilities ``exp(z) / Z`` summed from the bottom (the mass strictly below a token), a token dropped iff
that sum is ``<= 1 - top_p`` in fp32 -- transformers' own row ``log([0.3, 0.1, 0.1, 0.5])`` at top_p 0.8
drops both 0.1 tokens, where comparing the mass above (0.8000000042) with fp32 0.8 (0.8000000119) kept
them. min-p needs no search: ``p_i >= min_p * p_max  <=>  exp(z_i) >= min_p``.

Arithmetic (launch sizes, bytes, barriers per trip, estimates), ptxas figures: docs/kernels.md ("Sampler").
Why an exponential race for the draw: ``argmax_i z_i - log(E_i)`` with ``E_i ~ Exp(1)`` draws ``i`` with
probability ``p_i`` (Gumbel-max); it needs no normalisation, no prefix sum and one pass, and ``E_i``
comes from a counter-based hash of (seed, step, column), so a row's token never depends on its batch
position. ``row_key_torch`` / ``uniform_torch`` (arkernels/ops/sampling_cpu.py), the bit-identical torch twins, let
the CPU kernel draw the same token up to rounding of exp/log (a race decided within an ulp, ~1e-6 of draws).
Host side (splits, scratch, launches): arkernels/triton/sampling_launch.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from arkernels import token_state_layout as _layout
from arkernels.triton.pdl import pdl_enter
from arkernels.triton.sampling_select import order_key, order_unkey, survivor_positions, survivor_thresholds
from arkernels.triton.tickets import last_program

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a constexpr: jit code may read it
PIVOTS = 16  # pivots per search pass: the bracket shrinks >= 16x per pass
MAX_PASSES = 12  # 2^32 keys / 16^8 = 1: 8 passes suffice; 12 leaves room, bounds the loop
DRAW_BLOCK = 2048  # elements per block in the streaming passes
STATS_BLOCK = 1024  # columns per chunk (the unit of the chunk partials); loops run TILE_CHUNKS of them per trip
SEARCH_BLOCK = 512  # elements per block in the search passes ([SEARCH_BLOCK, PIVOTS] tiles)
NB = tl.constexpr(4096)  # histogram buckets = the top 12 bits of the fp32 key: 8 buckets per octave (16 KB)
BUCKET_SHIFT = tl.constexpr(20)  # 32 - 12
MAX_SPLITS = 64  # programs per row at most (batch 1): 128k columns over 63 programs of 2 chunks
TILE_CHUNKS = 4  # chunks per loop trip in the stats / compaction passes: a [4, 1024] tile, 4 chunks' loads in flight
# Launch options per kernel (the offline sm_90 compile test reads them too; its registers and spills: docs/kernels.md)
LAUNCH = {
    "sampling_stats_kernel": dict(num_warps=16),
    # the draw's [SEARCH_BLOCK, PIVOTS] tiles: 8 warps keep it spill-free (16 warps: 64 registers, spills)
    "sampling_compact_kernel": dict(num_warps=8, maxnreg=168),
    "sampling_probs_kernel": dict(num_warps=8),
    "sampling_rules_kernel": dict(num_warps=8),
}
RACE_Z = tl.constexpr(-21.0)  # U in [2^-25, 1 - 2^-25]: -log(-log U) in [-2.85, 17.33], so z < -20.2 never wins


# ---------------------------------------------------------------------------------------------------------
# The random stream: uint32 hash of (seed, step, column) -> U in (0, 1), open at both ends.
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def fmix32(h):
    # murmur3's finaliser: a bijection of uint32 with full avalanche
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def row_key(seed, step):
    """seed, step: int64 scalars -> uint32 key of the row's stream."""
    a = fmix32(seed.to(tl.uint32) ^ 0x243F6A88)
    a = fmix32(a ^ (seed >> 32).to(tl.uint32))
    a = fmix32(a ^ step.to(tl.uint32))
    a = fmix32(a ^ (step >> 32).to(tl.uint32))
    return a


@triton.jit
def uniform(key, cols):
    h = fmix32(cols.to(tl.uint32) * 0x9E3779B9 + key)
    h = fmix32(h ^ key)
    # 24 random bits + 0.5, times 2^-24: exact in fp32, never 0 or 1
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08


# ---------------------------------------------------------------------------------------------------------
# Row helpers
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _load_row(base, offs, mask):
    """Logits as fp32 (loads in any float dtype, arithmetic only after the upcast); NaN -> -inf,
    +inf -> FLT_MAX (tokens at +inf share the mass), masked lanes -> -inf, -0.0 -> +0.0 (equal as floats,
    but their keys differ: a top-k bucket holding +0.0 would miss the tied -0.0 tokens)."""
    x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    x = tl.where(x == 0.0, 0.0, x)
    return tl.minimum(x, FLT_MAX)


# token_state word (one int32 per history row and vocabulary column): the layout of arkernels/token_state_layout.py
COUNT_MASK = tl.constexpr(_layout.COUNT_MASK)  # generated occurrences
SEEN_MASK = tl.constexpr(_layout.SEEN_MASK)  # count or in the prompt: the repetition penalty applies
BAN_BIT = tl.constexpr(_layout.BAN_BIT)  # banned
EOS_BIT = tl.constexpr(_layout.EOS_BIT)  # an EOS id: masked while the row has fewer than min_new_tokens new tokens


@triton.jit
def _row_rules(row, hist_ptr, pen_ptr, NH, STATE: tl.constexpr, BIAS: tl.constexpr):
    """A row's token-rule parameters: ``(history row (clamped), in range, repetition, frequency, presence, EOS
    masked)``. A history row outside ``[0, NH)`` applies no rule (its loads are masked off): never out of bounds."""
    hr = tl.zeros((), tl.int64)
    rv = tl.zeros((), tl.int1)
    rp = tl.full((), 1.0, tl.float32)
    fq = tl.zeros((), tl.float32)
    ps = tl.zeros((), tl.float32)
    eos_on = tl.zeros((), tl.int1)
    if STATE or BIAS:
        h = tl.load(hist_ptr + row * 3)
        rv = (h >= 0) & (h < NH)
        hr = tl.where(rv, h, 0)
    if STATE:
        rp = tl.load(pen_ptr + row * 3)
        fq = tl.load(pen_ptr + row * 3 + 1)
        ps = tl.load(pen_ptr + row * 3 + 2)
        eos_on = tl.load(hist_ptr + row * 3 + 1) < tl.load(hist_ptr + row * 3 + 2)
    return hr, rv, rp, fq, ps, eos_on


@triton.jit
def _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE: tl.constexpr, BIAS: tl.constexpr):
    """``_load_row`` followed by the token rules at vocabulary columns ``offs`` (``sb``, ``bb``: the row's
    token_state / logit_bias rows): bias added; repetition (transformers: negative logits multiplied, the others
    divided) where the token is in the prompt or was generated; ``- frequency * count - presence * (count > 0)``
    (vLLM / OpenAI); banned and masked EOS ids to -inf. Then sanitised as ``_load_row`` does (a bias can overflow)."""
    x = _load_row(base, offs, mask)
    if STATE or BIAS:
        m2 = mask & rv
        if BIAS:
            x = x + tl.load(bb + offs, mask=m2, other=0.0)
        if STATE:
            w = tl.load(sb + offs, mask=m2, other=0)
            cnt = w & COUNT_MASK
            x = tl.where((w & SEEN_MASK) != 0, tl.where(x < 0, x * rp, tl.math.div_rn(x, rp)), x)
            x = x - fq * cnt.to(tl.float32)
            x = x - tl.where(cnt > 0, ps, 0.0)
            ban = ((w & BAN_BIT) != 0) | (((w & EOS_BIT) != 0) & eos_on)
            x = tl.where(ban, float("-inf"), x)
        x = tl.where(x != x, float("-inf"), x)
        x = tl.where(x == 0.0, 0.0, x)
        x = tl.minimum(x, FLT_MAX)
    return x


@triton.jit
def _bucket(x):
    """fp32 -> histogram bucket in [0, NB): the key's top 12 bits, monotone in x. Any int32 key already lands in
    [0, NB) (an arithmetic shift by 20 gives [-2048, 2047]); the clamp keeps ``tl.histogram``'s shared-memory
    atomics in range if BUCKET_SHIFT or NB is ever edited apart (two instructions per element)."""
    return tl.minimum(tl.maximum((order_key(x) >> BUCKET_SHIFT) + NB // 2, 0), NB - 1)


@triton.jit
def _bucket_lo(b):
    """The smallest fp32 value in bucket ``b``."""
    return order_unkey((b - NB // 2) << BUCKET_SHIFT)


@triton.jit
def _threshold(base, V, lo, cand, target, m, T, tk, Z, off, sb, bb, rv, rp, fq, ps, eos_on, STATE: tl.constexpr, BIAS: tl.constexpr,
               BELOW: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, MAX_PASSES: tl.constexpr):
    """The largest row value ``t`` that passes, found by a pivot search over ``base[:V]``.

    BELOW False (top-k): ``v = x``; passes iff ``#{x_i >= t} >= target``.
    BELOW True (top-p, transformers' comparison): ``v = z = (x - m) / T`` over the top-k set (``x >= tk``);
    passes iff ``off + sum_{z_i < t} fp32(exp(z_i) / Z) <= target`` (``target = 1 - p``, ``off``: the mass of
    set members not in ``base``). ``lo`` must pass (or be -inf: keep all), ``cand`` bounds the answer from
    above. Returns ``(t, passes)``."""
    j = tl.arange(0, P)
    it = 0
    while (cand > lo) & (it < MAX_PASSES):
        klo = order_key(lo).to(tl.int64)
        kc = order_key(cand).to(tl.int64)
        piv = order_unkey((klo + ((j + 1) * (kc - klo) + P - 1) // P).to(tl.int32))  # [P] in (lo, cand]
        W = tl.zeros([P], dtype=tl.float32)
        up = tl.full([P], float("inf"), tl.float32)  # smallest row value >= pivot
        down = tl.full([P], float("-inf"), tl.float32)  # largest row value < pivot
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
            if BELOW:
                v = tl.math.div_rn(x - m, T)
                w = tl.math.div_rn(tl.exp(v), Z)
                inset = mask & (x >= tk)
            else:
                v = x
                w = tl.full([BLOCK], 1.0, tl.float32)
                inset = mask
            ge = (v[:, None] >= piv[None, :]) & inset[:, None]
            below = inset[:, None] & (v[:, None] < piv[None, :])
            if BELOW:
                W += tl.sum(tl.where(below, w[:, None], 0.0), axis=0)
            else:
                W += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
            up = tl.minimum(up, tl.min(tl.where(ge, v[:, None], float("inf")), axis=0))
            down = tl.maximum(down, tl.max(tl.where(below, v[:, None], float("-inf")), axis=0))
        if BELOW:
            ok = (W + off) <= target
        else:
            ok = W >= target
        # the largest passing pivot; pivots above it all failed (whatever the float sums did)
        J = tl.max(tl.where(ok, j, -1), axis=0)
        lo = tl.where(J >= 0, tl.max(tl.where(j == J, up, float("-inf")), axis=0), lo)
        cand = tl.where(J + 1 < P, tl.max(tl.where(j == J + 1, down, float("-inf")), axis=0), lo)
        it += 1
    return lo, it


@triton.jit
def _filters(base, n, lo_k, m, T, k, p, V, Z_row, off_row, USE_ROW_Z, sb, bb, rv, rp, fq, ps, eos_on, STATE: tl.constexpr, BIAS: tl.constexpr,
             BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, P: tl.constexpr, MAX_PASSES: tl.constexpr):
    """top-k then top-p thresholds over ``base[:n]`` (the whole row, or a superset of the kept set).
    ``lo_k``: a value <= every element (or -inf). ``USE_ROW_Z`` (runtime; only without top-k): take the
    mass ``Z_row`` and the mass ``off_row`` of the tokens missing from ``base`` instead of a pass over it.
    Returns ``(tk, tp, full-length passes)``."""
    npass = 0
    tk = tl.full((), float("-inf"), tl.float32)
    if (k > 0) & (k < V):
        tk, it = _threshold(base, n, lo_k, m, k.to(tl.float32), m, T, tk, 1.0, 0.0, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS,
                            False, SEARCH_BLOCK, P, MAX_PASSES)
        npass += it
    tp = tl.full((), float("-inf"), tl.float32)
    if p < 1.0:
        if USE_ROW_Z:
            Z = Z_row
            off = off_row
        else:
            Z = tl.zeros((), tl.float32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
                Z += tl.sum(tl.where(mask & (x >= tk), tl.exp(tl.math.div_rn(x - m, T)), 0.0), axis=0)
            npass += 1
            off = tl.zeros((), tl.float32)
        Z = tl.where(Z > 0, Z, 1.0)  # 0 only on rows with nothing to search (greedy: n = 0)
        tp, it = _threshold(base, n, tp, tl.zeros((), tl.float32), 1.0 - p, m, T, tk, Z, tl.math.div_rn(off, Z),
                            sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS, True, SEARCH_BLOCK, P, MAX_PASSES)
        npass += it
    return tk, tp, npass


@triton.jit
def _race_tile(x, cols, mask, z, tk, tp, min_p, key):
    """One tile of the race: ``(best score, the lowest column among the best)`` over the kept lanes (-inf, INT_MAX
    when none is kept)."""
    keep = mask & (x >= tk) & (z >= tp) & (tl.exp(z) >= min_p)
    score = tl.where(keep, z - tl.log(-tl.log(uniform(key, cols))), float("-inf"))
    bs = tl.max(score, axis=0)
    return bs, tl.min(tl.where(keep & (score == bs), cols, 2147483647), axis=0)


@triton.jit
def _race(base, idx_ptr, first, n, m, T, tk, tp, min_p, key, sb, bb, rv, rp, fq, ps, eos_on, STATE: tl.constexpr, BIAS: tl.constexpr, USE_IDX: tl.constexpr,
          BLOCK: tl.constexpr):
    """The exponential race over the kept tokens of ``base[first:n]``: ``(best score, the winner's vocab column)``
    (its index, or ``idx_ptr[i]`` with ``USE_IDX``); ties to the lowest column (columns ascend along ``base``)."""
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), tl.int32)
    for start in range(first, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
        if USE_IDX:
            cols = tl.load(idx_ptr + offs, mask=mask, other=0)
        else:
            cols = offs
        bs, bi = _race_tile(x, cols, mask, tl.math.div_rn(x - m, T), tk, tp, min_p, key)
        best_i = tl.where(bs > best, bi, best_i)
        best = tl.maximum(best, bs)
    return best, best_i


@triton.jit
def _row_stats(cmax_ptr, carg_ptr, csum_ptr, row, NCHUNK, T, NCP: tl.constexpr):
    """Merge a row's chunk partials (in chunk order, a fixed tree: batch-invariant) -> (max, argmax, Z)."""
    c = tl.arange(0, NCP)
    cm_mask = c < NCHUNK
    cm = tl.load(cmax_ptr + row * NCHUNK + c, mask=cm_mask, other=float("-inf"))
    m = tl.max(cm, axis=0)
    ca = tl.load(carg_ptr + row * NCHUNK + c, mask=cm_mask, other=2147483647)
    arg = tl.min(tl.where(cm_mask & (cm == m), ca, 2147483647), axis=0)  # lowest index among the maxima
    cs = tl.load(csum_ptr + row * NCHUNK + c, mask=cm_mask, other=0.0)
    live = cm_mask & (cm > float("-inf"))
    d = tl.where(live, cm, 0.0) - tl.where(live, m, 0.0)  # no -inf - -inf on a row without a finite logit
    Z = tl.sum(tl.where(live, cs * tl.exp(tl.math.div_rn(d, T)), 0.0), axis=0)
    return m, arg, Z


# ---------------------------------------------------------------------------------------------------------
# sample: stats (+ the row's cutoff, by its last program) -> compaction (+ the draw, by its last program)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _needs_z(T, k, p, V):
    """Whether a row reads its full mass Z: top-p without top-k (with top-k, the draw sums the mass of the top-k
    candidates itself); the stats pass skips the per-element exp for the other rows."""
    return (T > 0) & (p < 1.0) & ((k <= 0) | (k >= V))


@triton.jit
def sampling_stats_kernel(
    logits_ptr, stride_row, V,  # [batch, V] any float dtype, row stride in elements
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # [batch] fp32, int32, fp32, fp32
    cmax_ptr, carg_ptr, csum_ptr,  # [batch, NCHUNK] fp32, int32, fp32: per-chunk max, argmax, sum exp((x - max) / T)
    hist_ptr,  # [batch, S, NB] int32: per-program suffix counts (S > 1 only)
    rhist_ptr,  # [batch, NB] int32: the row histogram, summed by atomics; all 0 between launches (S > 1 only)
    ticket_ptr, epoch,  # int64 [batch] tickets, this launch's epoch (S > 1 only: see tickets.last_program)
    cut_ptr, off_ptr, ncand_ptr,  # [batch] int32 cutoff bucket; [batch, SP] int32 program offsets; [batch] int32
    passes_ptr,  # [batch] int32 (DEBUG only): full-row passes
    state_ptr, hrow_ptr, pen_ptr, bias_ptr, NH,  # token rules (see _row_rules); NH: history rows
    NCHUNK, CPS, S, CAP,  # chunks per row, chunks per program, programs per row, candidates per row
    BLOCK: tl.constexpr, R: tl.constexpr, NCP: tl.constexpr, SP: tl.constexpr, DEBUG: tl.constexpr,
    STATE: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)  # before any access: the logits come from the kernel before (arkernels/triton/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    base = logits_ptr + row * stride_row
    hr, rv, rp, fq, ps, eos_on = _row_rules(row, hrow_ptr, pen_ptr, NH, STATE, BIAS)
    sb = state_ptr + hr * V
    bb = bias_ptr + hr * V
    T = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    Tg = tl.where(T > 0, T, 1.0)  # greedy rows: Z is unused
    need_z = _needs_z(T, k, p, V)
    hist = tl.zeros([NB], tl.int32)
    r = tl.arange(0, R)
    c1 = tl.minimum(s * CPS + CPS, NCHUNK)
    # R chunks per trip as one [R, BLOCK] tile: R chunks' loads in flight, the reductions run along axis 1
    # (one cross-warp round for R chunks) and one histogram per trip
    for c0 in range(s * CPS, c1, R):
        ch = c0 + r[:, None]  # [R, 1] chunk ids; rows past c1 are masked off (a program's last trip)
        offs = ch * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (ch < c1) & (offs < V)
        x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
        # max and the lowest index among the maxima in one reduction (masked lanes are -inf and lie after the
        # chunk's columns, so an all -inf chunk reports its first column, as a masked min over columns did).
        # keep_dims: the [R, 1] results stay in the tile's layout, so the stores need no layout conversion
        bm, bi = tl.max(x, axis=1, return_indices=True, return_indices_tie_break_left=True, keep_dims=True)
        live = ch < c1
        tl.store(cmax_ptr + row * NCHUNK + ch, bm, mask=live)
        tl.store(carg_ptr + row * NCHUNK + ch, ch * BLOCK + bi, mask=live)
        cs = tl.zeros([R, 1], tl.float32)
        if need_z:
            d = x - tl.where(bm > float("-inf"), bm, 0.0)  # all -inf: all exp 0
            if Tg == 1.0:  # d / 1 is d: the same bits without the IEEE division
                cs = tl.sum(tl.exp(d), axis=1, keep_dims=True)
            else:
                cs = tl.sum(tl.exp(tl.math.div_rn(d, Tg)), axis=1, keep_dims=True)
        tl.store(csum_ptr + row * NCHUNK + ch, cs, mask=live)
        # masked lanes are not counted: bucket -1 marks them through the reorder (a histogram ignores order)
        bk = tl.reshape(tl.where(mask, _bucket(x), -1), [R * BLOCK], can_reorder=True)
        hist += tl.histogram(tl.maximum(bk, 0), NB, mask=bk >= 0)
    b = tl.arange(0, NB)
    last = s == 0  # one program per row: it is the last
    if S > 1:
        # suffix counts (a program's candidates at any cutoff are one load away); the row's histogram by atomics on
        # the occupied buckets only (integers: exact in any order)
        tl.store(hist_ptr + (row * S + s) * NB + b, tl.cumsum(hist, axis=0, reverse=True))
        tl.atomic_add(rhist_ptr + row * NB + b, hist, mask=hist > 0, sem="relaxed", scope="gpu")
        last = last_program(ticket_ptr + row, epoch)
    if last:
        if S > 1:
            hist = tl.load(rhist_ptr + row * NB + b, cache_modifier=".cg")
            tl.store(rhist_ptr + row * NB + b, tl.zeros([NB], tl.int32))  # 0 again for the next launch
        _plan_row(hist, row, S, V, T, k, p, tl.load(minp_ptr + row), cmax_ptr, carg_ptr, csum_ptr, hist_ptr,
                  cut_ptr, off_ptr, ncand_ptr, NCHUNK, CAP, NCP, SP)
        if DEBUG:
            tl.store(passes_ptr + row, 1)


@triton.jit
def _cutoff(h, above, m, T, k, p, min_p, Z, V):
    """The lowest bucket that may hold a kept token (from the row histogram ``h [NB]`` and its suffix counts
    ``above [NB]``: tokens in buckets >= b), and whether a row must fall back anyway (a cutoff at or below
    bucket(-inf) would admit -inf tokens)."""
    b = tl.arange(0, NB)
    use_k = (k > 0) & (k < V)
    use_p = p < 1.0
    cut = tl.zeros((), tl.int32)
    # top-k: the bucket holding the k-th largest logit (ties with it are in it too)
    b_k = tl.max(tl.where(above >= k, b, 0), axis=0)
    cut = tl.where(use_k, b_k, cut)
    # top-p without top-k: a token below bucket b has mass above it >= the larger of two bounds: the buckets
    # >= b at their lower edges (the maximum counted as exactly 1), and Z minus the buckets < b at their
    # upper edges. Once that clears p * Z by a margin far above fp32 rounding (1e-3), every token below b is
    # dropped by the exact comparison too. The second bound matters: a bucket is 1/8 octave wide (1-2 logits
    # near 10-30), so lower edges alone undercount by e^1-e^2.5 and never reach 0.9 Z on Gaussian logits;
    # with both, 128k x N(0, 4^2) logits at p 0.9 keep 2937 candidates for 1122 kept tokens (numpy model).
    bm = _bucket(m)
    in_row = (h > 0) & (b <= bm)
    # edges above the max's bucket read as m, NaN bit patterns (buckets below -inf's) as -inf: all unused
    lo_e = tl.where(b <= bm, _bucket_lo(b), m)
    hi_e = tl.where(b < bm, _bucket_lo(b + 1), m)  # the next bucket's lower edge: <= 1 ulp over
    # edges below -1e30 read as -1e30: exp(z) is 0 there either way, and z stays finite in fp32 for |m| < 1e37
    lo_z = tl.math.div_rn(tl.where(lo_e == lo_e, tl.maximum(lo_e, -1e30), -1e30) - m, T)
    hi_z = tl.math.div_rn(tl.where(hi_e == hi_e, tl.maximum(hi_e, -1e30), -1e30) - m, T)
    hf = h.to(tl.float32)
    lb = tl.where(in_row, hf * tl.exp(tl.where(in_row, lo_z, 0.0)), 0.0)
    lb = tl.where(b == bm, 1.0 + (hf - 1.0) * tl.exp(lo_z), lb)
    ub = tl.where(in_row, hf * tl.exp(tl.where(in_row, hi_z, 0.0)), 0.0)
    mass_above = tl.maximum(tl.sum(lb, axis=0) - tl.cumsum(lb, axis=0) + lb, Z - (tl.cumsum(ub, axis=0) - ub))
    b_p = tl.max(tl.where(mass_above >= p * Z * 1.001 + 1e-5 * Z, b, 0), axis=0)
    cut = tl.where(use_p & (~use_k), tl.maximum(cut, b_p), cut)
    # min-p (z >= log(min_p), 0.01 of slack for exp's rounding) and the race (z >= RACE_Z) drop tokens
    # outright; 1e-5 |m| more covers the rounding of m + T * z. With top-k and top-p both on, top-p needs the
    # whole top-k set's mass, so they do not raise the cutoff
    lmp = tl.where(min_p > 0, tl.log(tl.where(min_p > 0, min_p, 1.0)) - 0.01, RACE_Z)
    b_z = _bucket(m + T * tl.maximum(lmp, RACE_Z) - 1e-5 * tl.abs(m))
    cut = tl.where(use_k & use_p, cut, tl.maximum(cut, b_z))
    return cut, cut <= _bucket(tl.full((), float("-inf"), tl.float32))


@triton.jit
def _plan_row(hist, row, S, V, T, k, p, min_p, cmax_ptr, carg_ptr, csum_ptr, hist_ptr, cut_ptr, off_ptr, ncand_ptr,
              NCHUNK, CAP, NCP: tl.constexpr, SP: tl.constexpr):
    """The last stats program's work, once per row: from the row histogram ``hist [NB]``, the cutoff bucket, each
    program's output offset (the candidates of the programs before it: one suffix count each, exact integers, so
    deterministic) and the row's candidate count (``ncand``: see sampling_compact_kernel)."""
    Tg = tl.where(T > 0, T, 1.0)
    m, arg, Z = _row_stats(cmax_ptr, carg_ptr, csum_ptr, row, NCHUNK, Tg, NCP)
    n = tl.zeros((), tl.int32)
    if (m > float("-inf")) & (T > 0):
        above = tl.cumsum(hist, axis=0, reverse=True)
        cut, low = _cutoff(hist, above, m, Tg, k, p, min_p, Z, V)
        total = tl.sum(tl.where(tl.arange(0, NB) == cut, above, 0), axis=0)
        t = tl.arange(0, SP)
        cnt = tl.load(hist_ptr + (row * S + t) * NB + cut, mask=(t < S) & (S > 1), other=0, cache_modifier=".cg")
        tl.store(off_ptr + row * SP + t, tl.cumsum(cnt, axis=0) - cnt, mask=t < S)
        tl.store(cut_ptr + row, cut)
        fast = (~low) & (total <= CAP)
        # a row that overflows but needs no search (no top-k, no top-p: temperature / min-p on a flat row)
        # races in the compaction programs, split like the stats pass, instead of in one program
        split_race = (~fast) & ((k <= 0) | (k >= V)) & (p >= 1.0)
        n = tl.where(fast, total, tl.where(split_race, -2, -1))
    tl.store(ncand_ptr + row, n)


@triton.jit
def sampling_compact_kernel(
    logits_ptr, stride_row, V,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # [batch] fp32, int32, fp32, fp32
    seed_ptr, step_ptr,  # [batch] int64
    cmax_ptr, carg_ptr, csum_ptr, cut_ptr, off_ptr,  # from sampling_stats_kernel
    ncand_ptr,  # [batch] int32: candidate count; 0: greedy / no finite logit; -1: full-row fallback; -2: raced here
    cval_ptr, cidx_ptr,  # [batch, CAP] fp32, int32: candidates (logit, column) in column order
    rbest_ptr, rcol_ptr,  # [batch, S] fp32, int32: each program's race winner (score, column) when ncand is -2
    ticket_ptr, epoch,  # int64 [batch] tickets, this launch's epoch (S > 1 only: see tickets.last_program)
    ids_ptr, valid_ptr,  # [batch] int64, bool
    passes_ptr,
    state_ptr, hrow_ptr, pen_ptr, bias_ptr, NH,  # token rules (see _row_rules); NH: history rows
    NCHUNK, CPS, S, CAP,
    BLOCK: tl.constexpr, R: tl.constexpr, DRAW_BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, P: tl.constexpr,
    MAX_PASSES: tl.constexpr, NCP: tl.constexpr, SP: tl.constexpr, DEBUG: tl.constexpr, STATE: tl.constexpr,
    BIAS: tl.constexpr, KMAX: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr,
):
    """Each program compacts its columns' candidates (bucket >= the row's cutoff) into ``[batch, cap]`` scratch in
    column order from its offset (R chunks per trip; a trip without a candidate costs one reduction, no scan and
    no store), or, on a row flagged -2, races its own columns; the row's last program then draws (``_draw``)."""
    pdl_enter(PDL)  # before any access: the stats launch's outputs
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    base = logits_ptr + row * stride_row
    hr, rv, rp, fq, ps, eos_on = _row_rules(row, hrow_ptr, pen_ptr, NH, STATE, BIAS)
    sb = state_ptr + hr * V
    bb = bias_ptr + hr * V
    n = tl.load(ncand_ptr + row)
    first = s * CPS * BLOCK
    last = tl.minimum(first + CPS * BLOCK, V)  # this program's columns [first, last)
    if n == -2:
        T = tl.load(temp_ptr + row)
        m, _, _ = _row_stats(cmax_ptr, carg_ptr, csum_ptr, row, NCHUNK, T, NCP)
        ninf = tl.full((), float("-inf"), tl.float32)
        sc, col = _race(base, base, first, last, m, T, ninf, ninf, tl.load(minp_ptr + row),
                        row_key(tl.load(seed_ptr + row), tl.load(step_ptr + row)), sb, bb, rv, rp, fq, ps, eos_on,
                        STATE, BIAS, False, R * BLOCK)
        tl.store(rbest_ptr + row * S + s, sc)
        tl.store(rcol_ptr + row * S + s, col)
    if n > 0:
        cut = tl.load(cut_ptr + row)
        pos = tl.load(off_ptr + row * SP + s)
        for start in range(first, last, R * BLOCK):
            offs = start + tl.arange(0, R * BLOCK)
            mask = offs < last
            x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
            keep = (mask & (_bucket(x) >= cut)).to(tl.int32)
            nk = tl.sum(keep, axis=0)
            if nk > 0:
                dest = pos + tl.cumsum(keep, axis=0) - keep
                put = (keep != 0) & (dest < CAP)  # dest < n <= CAP already: the bound holds whatever the input
                tl.store(cval_ptr + row * CAP + dest, x, mask=put)
                tl.store(cidx_ptr + row * CAP + dest, offs, mask=put)
            pos += nk
    if DEBUG:
        if (s == 0) & ((n > 0) | (n == -2)):
            tl.store(passes_ptr + row, tl.load(passes_ptr + row) + 1)
    done = s == 0  # one program per row: it is the last
    if S > 1:
        done = last_program(ticket_ptr + row, epoch)
    if done:
        _draw(base, row, V, n, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, cmax_ptr, carg_ptr,
              csum_ptr, cval_ptr, cidx_ptr, cut_ptr, rbest_ptr, rcol_ptr, ids_ptr, valid_ptr, passes_ptr,
              sb, bb, rv, rp, fq, ps, eos_on, NCHUNK, CAP, S, DRAW_BLOCK, SEARCH_BLOCK, P, MAX_PASSES, NCP, SP,
              DEBUG, STATE, BIAS, KMAX, DT)


@triton.jit
def _draw_candidates(cb, ib, n, cut, m, T, k, p, min_p, V, Z, row_z, key, BLOCK: tl.constexpr,
                     SEARCH_BLOCK: tl.constexpr, P: tl.constexpr, MAX_PASSES: tl.constexpr, KMAX: tl.constexpr,
                     DT: tl.constexpr):
    """The fast path's token from the ``n`` candidates ``cb`` (processed logits; columns ``ib``; the buckets >=
    ``cut``). Top-k in [1, KMAX]: on chip (sampling_select.py: the candidates loaded once, the survivors' thresholds
    pairwise, the race on them), unless more than KMAX tokens tie at the k-th value or ``n`` > DT. Otherwise
    (top-p without top-k: thousands of candidates; top-k > KMAX) the pivot search over the candidates."""
    best_i = tl.zeros((), tl.int32)
    todo = True
    if KMAX > 0:
        if (k > 0) & (k <= KMAX) & (k < V) & (n <= DT):
            pos, cnt = survivor_positions(cb, n, k, cut - NB // 2, BUCKET_SHIFT, DT, KMAX)
            if (cnt <= KMAX) & (cnt >= tl.minimum(k, n)):
                live = tl.arange(0, KMAX) < cnt
                sx = tl.load(cb + pos, mask=live, other=float("-inf"))
                col = tl.load(ib + pos, mask=live, other=0)
                tk, z, tp = survivor_thresholds(sx, live, m, T, k, p, KMAX)
                bs, bi = _race_tile(sx, col, live, z, tk, tp, min_p, key)
                best_i = tl.where(bs > float("-inf"), bi, 0)
                todo = False
    if todo:
        # the candidates' minimum (a top-k search bracket) and mass (the rest of Z lies below them); a row with
        # neither top-k nor top-p only races
        cmin = tl.full((), float("inf"), tl.float32)
        Zc = tl.zeros((), tl.float32)
        if ((k > 0) & (k < V)) | (p < 1.0):
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                x = _load_row(cb, offs, mask)
                cmin = tl.minimum(cmin, tl.min(tl.where(mask, x, float("inf")), axis=0))
                Zc += tl.sum(tl.where(mask, tl.exp(tl.math.div_rn(x - m, T)), 0.0), axis=0)
        # the candidates hold processed logits already: no rules on them (cb stands in for the rule tables)
        zero = tl.zeros((), tl.int1)
        tk, tp, _ = _filters(cb, n, cmin, m, T, k, p, V, Z, tl.maximum(Z - Zc, 0.0), row_z, cb, cb, zero, 1.0, 0.0,
                             0.0, zero, False, False, BLOCK, SEARCH_BLOCK, P, MAX_PASSES)
        _, best_i = _race(cb, ib, 0, n, m, T, tk, tp, min_p, key, cb, cb, zero, 1.0, 0.0, 0.0, zero, False, False,
                          True, BLOCK)
    return best_i


@triton.jit
def _draw(base, row, V, n, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, cmax_ptr, carg_ptr, csum_ptr,
          cval_ptr, cidx_ptr, cut_ptr, rbest_ptr, rcol_ptr, ids_ptr, valid_ptr, passes_ptr, sb, bb, rv, rp, fq, ps,
          eos_on, NCHUNK, CAP, S, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, P: tl.constexpr,
          MAX_PASSES: tl.constexpr, NCP: tl.constexpr, SP: tl.constexpr, DEBUG: tl.constexpr,
          STATE: tl.constexpr, BIAS: tl.constexpr, KMAX: tl.constexpr, DT: tl.constexpr):
    """The row's token: thresholds and race on the ``n`` candidates (fast path), the merge of the programs' race
    winners (``n`` -2), or the full-row search (``n`` -1): the same token (top-k counts exact on either set, the same
    race scores; only the top-p mass summed in another order: a top_p within fp32 rounding of a boundary)."""
    T = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    Tg = tl.where(T > 0, T, 1.0)
    m, arg, Z = _row_stats(cmax_ptr, carg_ptr, csum_ptr, row, NCHUNK, Tg, NCP)
    valid = m > float("-inf")
    best_i = arg  # greedy / invalid rows: the argmax (0 for a row with no finite logit)
    if valid & (T > 0):
        key = row_key(tl.load(seed_ptr + row), tl.load(step_ptr + row))
        row_z = (k <= 0) | (k >= V)  # no top-k: the top-p mass is the row's Z, already merged
        if n >= 0:
            best_i = _draw_candidates(cval_ptr + row * CAP, cidx_ptr + row * CAP, n, tl.load(cut_ptr + row), m, Tg,
                                      k, p, min_p, V, Z, row_z, key, BLOCK, SEARCH_BLOCK, P, MAX_PASSES, KMAX, DT)
        elif n == -2:  # raced by the compaction programs: the best score, ties to the first program
            j = tl.arange(0, SP)
            sc = tl.load(rbest_ptr + row * S + j, mask=j < S, other=float("-inf"))
            col = tl.load(rcol_ptr + row * S + j, mask=j < S, other=2147483647)
            best_i = tl.min(tl.where((j < S) & (sc == tl.max(sc, axis=0)), col, 2147483647), axis=0)
        else:
            ninf = tl.full((), float("-inf"), tl.float32)
            tk, tp, npass = _filters(base, V, ninf, m, Tg, k, p, V, Z, tl.zeros((), tl.float32), row_z, sb, bb, rv,
                                     rp, fq, ps, eos_on, STATE, BIAS, BLOCK, SEARCH_BLOCK, P, MAX_PASSES)
            _, best_i = _race(base, base, 0, V, m, Tg, tk, tp, min_p, key, sb, bb, rv, rp, fq, ps, eos_on, STATE,
                              BIAS, False, BLOCK)
            if DEBUG:
                tl.store(passes_ptr + row, tl.load(passes_ptr + row) + npass + 1)
    tl.store(ids_ptr + row, best_i.to(tl.int64))
    tl.store(valid_ptr + row, valid)

# ---------------------------------------------------------------------------------------------------------
# sampling_probs: one program per row, the full-row search
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def sampling_probs_kernel(
    logits_ptr, stride_row, V,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,
    probs_ptr, stride_probs,  # [batch, V] fp32
    state_ptr, hrow_ptr, pen_ptr, bias_ptr, NH,  # token rules (see _row_rules); NH: history rows
    BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, P: tl.constexpr, MAX_PASSES: tl.constexpr,
    STATE: tl.constexpr, BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    hr, rv, rp, fq, ps, eos_on = _row_rules(row, hrow_ptr, pen_ptr, NH, STATE, BIAS)
    sb = state_ptr + hr * V
    bb = bias_ptr + hr * V
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
        x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
        bm = tl.max(x, axis=0)
        bi = tl.min(tl.where(mask & (x == bm), offs, V), axis=0)
        arg = tl.where(bm > m, bi, arg)
        m = tl.maximum(m, bm)
        mn = tl.minimum(mn, tl.min(tl.where(mask, x, float("inf")), axis=0))
    valid = m > float("-inf")
    sampled = valid & (T > 0)
    T = tl.where(sampled, T, 1.0)
    Vs = tl.where(sampled, V, 0)  # greedy and invalid rows skip every further pass
    tk, tp, npass = _filters(base, Vs, mn, m, T, k, p, V, 1.0, 0.0, False, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS,
                             BLOCK, SEARCH_BLOCK, P, MAX_PASSES)

    total = tl.zeros((), tl.float32)
    for start in range(0, Vs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
        z = tl.math.div_rn(x - m, T)
        e = tl.exp(z)
        total += tl.sum(tl.where(mask & (x >= tk) & (z >= tp) & (e >= min_p), e, 0.0), axis=0)
    out = probs_ptr + row * stride_probs
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        if sampled:
            x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
            z = tl.math.div_rn(x - m, T)
            e = tl.exp(z)
            pr = tl.where((x >= tk) & (z >= tp) & (e >= min_p), e / total, 0.0)
        else:  # greedy: one-hot at the argmax; no finite logit: all zeros
            pr = tl.where(offs == arg, 1.0, 0.0) * valid.to(tl.float32)
        tl.store(out + offs, pr, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# sampling_rules: the processed logits the passes above see (one streaming pass; tests, logprobs, scores)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def sampling_rules_kernel(
    logits_ptr, stride_row, V,
    out_ptr,  # [batch, V] fp32
    state_ptr, hrow_ptr, pen_ptr, bias_ptr, NH,
    BLOCK: tl.constexpr, STATE: tl.constexpr, BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    hr, rv, rp, fq, ps, eos_on = _row_rules(row, hrow_ptr, pen_ptr, NH, STATE, BIAS)
    sb = state_ptr + hr * V
    bb = bias_ptr + hr * V
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = _load_x(base, offs, mask, sb, bb, rv, rp, fq, ps, eos_on, STATE, BIAS)
    tl.store(out_ptr + row * V + offs, x, mask=mask)
