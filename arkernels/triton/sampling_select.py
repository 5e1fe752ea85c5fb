"""On-chip selection for the sampler's draw (issue 34 item 4): the exact top-k and top-p thresholds of a row from its
candidates, held in registers, with no search pass (arkernels/triton/sampling.py calls these from the row's last
compaction program; the candidate search there stays for the rows these do not cover).

1. ``survivor_positions``: the candidates (an upper set of the row: every token in the row-histogram buckets >= the
   cutoff, <= DRAW_TILE of them) load once as one tile of order-preserving keys. Radix levels on the key bits below
   the cutoff bucket's 12 (8, 8, then 4 bits; a 256-bin histogram and its suffix counts each) narrow them to the
   *survivors*: the key range holding the k-th largest value and everything above it, at most KMAX tokens (usually
   after one level), or none narrower exists (more than KMAX tokens tied at the k-th value: the caller searches).
   Their positions come out as a [KMAX] tile (a scan and a KMAX-bin histogram: position of the j-th survivor =
   #{p: survivors in [0, p] <= j}).
2. ``survivor_thresholds``: pairwise over the [KMAX, KMAX] tile: top-k's threshold is the largest survivor value
   with >= k survivors at or above it (the survivors are an upper set of the row, so these counts are the row's),
   and top-p's is the largest z whose mass strictly below it within the top-k set is <= 1 - top_p in fp32: one
   fixed-tree masked sum per survivor, monotone in the threshold (rounding is monotone and masked terms add 0), so
   the kept set is an upper set whatever the rounding. Same definitions as the pivot search (``_threshold``): the
   same top-k threshold bit for bit; the top-p mass is summed in another order (a top_p within fp32 rounding of a
   boundary can move, as between the fast path and the fallback).
"""
import triton
import triton.language as tl

KMAX = 64  # top-k at most this: the survivors' tile (pairwise [KMAX, KMAX]: 16 elements per thread at 8 warps)
DRAW_TILE = 4096  # candidates loaded as one tile (the default candidate bound); rows with more take the search
RADIX_BINS = tl.constexpr(256)  # 8 key bits per radix level


@triton.jit
def order_key(v):
    """Order-preserving fp32 -> int32 map (an involution: ``order_unkey`` is the same formula)."""
    b = v.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def order_unkey(k):
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _radix_bound(key, mask, k, prefix, shift, KS: tl.constexpr):
    """The largest key ``lo`` on the radix grid inside ``prefix`` (keys ``>> shift == prefix``: the cutoff bucket)
    such that ``{key >= lo}`` still holds the k largest keys, refined a digit at a time until it holds <= KS keys or
    the key is exhausted. Returns ``(lo, count of keys >= lo, count above the cutoff bucket)``."""
    above = tl.sum((mask & ((key >> shift) > prefix)).to(tl.int32), axis=0)
    cnt = tl.sum((mask & ((key >> shift) >= prefix)).to(tl.int32), axis=0)
    b = tl.arange(0, RADIX_BINS)
    one = tl.full((), 1, tl.int32)
    shift = shift + tl.zeros((), tl.int32)  # loop-carried: a run-time value
    above0 = above
    # invariant: above < k <= cnt (the k-th largest key has this prefix); stops when the range is narrow enough
    while (cnt > KS) & (shift > 0) & (above < k) & (k <= cnt):
        nshift = tl.maximum(shift - 8, 0)
        inpre = mask & ((key >> shift) == prefix)
        h = tl.histogram((key >> nshift) & ((one << (shift - nshift)) - 1), RADIX_BINS, mask=inpre)
        suf = tl.cumsum(h, axis=0, reverse=True)  # keys of the prefix with a digit >= b
        dig = tl.max(tl.where(above + suf >= k, b, 0), axis=0)  # the digit holding the k-th largest
        cnt = above + tl.sum(tl.where(b == dig, suf, 0), axis=0)
        above = cnt - tl.sum(tl.where(b == dig, h, 0), axis=0)
        prefix = (prefix << (shift - nshift)) | dig
        shift = nshift
    return prefix << shift, cnt, above0


@triton.jit
def survivor_positions(cb, n, k, prefix, SHIFT: tl.constexpr, DT: tl.constexpr, KS: tl.constexpr):
    """``cb[:n]``: the row's candidates (fp32, an upper set of the row, all with ``key >> SHIFT >= prefix``; n <= DT).
    Returns ``(pos [KS] int32, count)``: the positions in ``cb`` of the survivors (an upper set of the row holding
    the top-k set, ``pos[j]`` for ``j < count``), or a ``count`` over KS (or under ``min(k, n)``: an inconsistent
    prefix) when none fits the tile: the caller then searches."""
    j = tl.arange(0, KS)
    pos = j
    cnt = n
    if n > KS:
        offs = tl.arange(0, DT)
        mask = offs < n
        key = order_key(tl.load(cb + offs, mask=mask, other=0.0))
        lo, cnt, above = _radix_bound(key, mask, k, prefix, SHIFT, KS)
        if above >= k:
            cnt = -1  # the k-th largest lies above the cutoff bucket: never, by the cutoff's construction
        flag = mask & (key >= lo)
        incl = tl.cumsum(flag.to(tl.int32), axis=0)  # survivors in [0, p]
        pos = tl.cumsum(tl.histogram(incl, KS, mask=incl < KS), axis=0)  # #{p: incl[p] <= j}
    return pos, cnt


@triton.jit
def survivor_thresholds(sx, live, m, T, k, p, KS: tl.constexpr):
    """Survivors ``sx [KS]`` (fp32 logits, ``live`` marks the real ones; an upper set of the row holding its top-k
    set), the row max ``m``, temperature ``T`` > 0, top-k ``k`` and top-p ``p``. Returns ``(tk, z, tp)``: the
    top-k threshold on the logits (-inf: keep all), ``z = (x - m) / T`` per survivor and the top-p threshold on z
    (-inf: keep all), as ``_threshold`` defines them."""
    ninf = float("-inf")
    ge = tl.sum(((sx[None, :] >= sx[:, None]) & live[None, :]).to(tl.int32), axis=1)
    tk = tl.max(tl.where(live & (ge >= k), sx, ninf), axis=0)
    inset = live & (sx >= tk)
    z = tl.math.div_rn(sx - m, T)
    tp = tl.full((), ninf, tl.float32)
    if p < 1.0:
        e = tl.exp(z)
        Z = tl.sum(tl.where(inset, e, 0.0), axis=0)
        Z = tl.where(Z > 0, Z, 1.0)
        w = tl.math.div_rn(e, Z)
        below = tl.sum(tl.where(inset[None, :] & (z[None, :] < z[:, None]), w[None, :], 0.0), axis=1)
        tp = tl.max(tl.where(inset & (below <= 1.0 - p), z, ninf), axis=0)
    return tk, z, tp
