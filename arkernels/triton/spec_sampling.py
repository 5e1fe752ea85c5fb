"""Speculative sampling in Triton: the acceptance walk over a row's k drafts and the final draw (jit code only; the
host launch is arkernels/triton/spec_sampling_launch.py, the semantics arkernels/ops/spec_sampling.py).

What it computes, per row ``b`` of the batch, from the filtered, renormalised fp32 distributions that
``sampling_probs`` wrote (token rules already applied per chain position):
  * ``p`` ``[batch * (k+1), vocab]``: the target's, row ``b * (k+1) + j`` for chain position ``j``;
  * ``q`` ``[batch * k, vocab]``: the draft's, row ``b * k + j`` (ONEHOT: no tensor, ``q_j = onehot(t_j)``);
  * ``draft`` int64 ``[batch, k]`` (row stride ``draft_stride``): the proposed tokens ``t_j``.
  1. The walk, k scalar steps: draft ``j`` is accepted iff the chain is still alive and ``u_j * q_j(t_j) <
     p_j(t_j)`` (probability ``min(1, p/q)``; a token with ``p_j(t_j) = 0`` is never accepted, one with
     ``q_j(t_j) = 0 < p_j(t_j)`` always is; ids outside ``[0, vocab)`` never are; greedy rows use ``q = 0``:
     accepted iff ``p_j(t_j) = 1``, i.e. ``t_j`` is the target's argmax). ``s`` = the accepted count.
  2. The draw at position ``s``: an exponential race ``argmax_i log r_i - log(-log U_i)`` over the residual
     ``r = max(0, p_s - q_s)`` (``s < k``, sampled rows) or ``r = p_s`` (``s = k``: the bonus; greedy rows), in one
     streaming pass of BLOCK columns, with a second race over ``p_s`` alongside: it decides when the residual is
     empty (``p_s <= q_s`` everywhere: rounding or an inconsistent draft) and whether the row is valid.
  3. ``tokens[b] = (t_0 .. t_{s-1}, drawn, -1 ...)``, ``accepted[b] = s``, ``valid[b]`` = ``p_s`` has mass (else
     the drawn token is 0, as ``sample`` returns for a row with no finite logit).

The random streams (the op's docstring states them for users): ``sample``'s hash family (murmur3's fmix32 over
seed, step and column), keyed per chain position ``pos = step + j`` and salted (``SPEC_SALT``) so that a draft
drawn by ``arkernels.sample`` with the same (seed, step + j) is independent of the op's uniforms (a shared stream
would couple the residual race to the draft token and bias it). Acceptance uses column ``ACCEPT_COL`` (uint32
0xFFFFFFFF, a column no vocabulary reaches), the race columns ``0 .. vocab-1``. A row's tokens depend on its own
inputs and (seed, step) only, never on the batch around it.

Parallelisation: one program per row, grid ``(batch,)``. Bytes per row: 2k scalar loads plus one pass over one
(two with a draft distribution) fp32 row of 4 * vocab B; the k+1 (2k+1) rows ``sampling_probs`` writes dominate.
"""
from __future__ import annotations

import triton
import triton.language as tl

from arkernels.triton.sampling import fmix32, row_key, uniform

SPEC_SALT = tl.constexpr(0x5BD1E995)  # murmur2's multiplier: separates the op's streams from sample's
ACCEPT_COL = tl.constexpr(-1)  # int32 -1 = uint32 0xFFFFFFFF: the acceptance uniform's column (vocab < 2^31)
BLOCK = 2048  # columns per trip of the draw's streaming pass


@triton.jit
def _spec_key(seed, pos):
    """seed, pos: int64 scalars -> the uint32 key of chain position ``pos``: sample's row key, then salted."""
    return fmix32(row_key(seed, pos) ^ SPEC_SALT)


@triton.jit
def spec_sampling_kernel(p_ptr, q_ptr, draft_ptr, draft_stride, temp_ptr, seed_ptr, step_ptr, tokens_ptr,
                         accepted_ptr, valid_ptr, K, V, ONEHOT: tl.constexpr, BLOCK: tl.constexpr,
                         KP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    # greedy rows (temperature 0; not > 0, as sampling_probs reads it) ignore the draft distribution (q = 0)
    greedy = (tl.load(temp_ptr + b) > 0.0) == 0
    seed = tl.load(seed_ptr + b)
    step = tl.load(step_ptr + b)
    drow = draft_ptr + b * draft_stride

    # 1. the walk: accept draft j while alive and u_j * q_j(t_j) < p_j(t_j)
    n = tl.program_id(0) * 0  # int32 scalar: accepted so far
    alive = n == 0
    for j in range(0, K):
        t = tl.load(drow + j)
        ok = (t >= 0) & (t < V)  # an id outside [0, vocab) is never read, never accepted
        tc = tl.where(ok, t, 0)
        pt = tl.where(ok, tl.load(p_ptr + (b * (K + 1) + j) * V + tc), 0.0)
        if ONEHOT:
            qt = tl.where(ok, 1.0, 0.0)
        else:
            qt = tl.where(ok, tl.load(q_ptr + (b * K + j) * V + tc), 0.0)
        qt = tl.where(greedy, 0.0, qt)
        u = uniform(_spec_key(seed, step + j), n * 0 + ACCEPT_COL)
        acc = alive & (u * qt < pt)
        n += acc.to(tl.int32)
        alive = acc

    # 2. the draw at position s: races over the residual and over p_s, lowest column among equal scores
    s = n.to(tl.int64)
    prow = p_ptr + (b * (K + 1) + s) * V
    has_q = (s < K) & (greedy == 0)
    sq = tl.maximum(tl.minimum(s, K - 1), 0)  # a row that exists (loads masked by has_q)
    ts = tl.load(drow + sq, mask=has_q, other=-1)
    qrow = q_ptr + (b * K + sq) * V
    key = _spec_key(seed, step + s)
    best_r = tl.program_id(0).to(tl.float32) * 0.0 + float("-inf")
    best_p = best_r
    arg_r = b * 0
    arg_p = b * 0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < V
        pv = tl.load(prow + cols, mask=m, other=0.0)
        if ONEHOT:
            qv = tl.where(has_q & (cols == ts), 1.0, 0.0)
        else:
            qv = tl.load(qrow + cols, mask=m & has_q, other=0.0)
        r = tl.maximum(pv - qv, 0.0)
        g = tl.log(-tl.log(uniform(key, cols)))
        sr = tl.where(m & (r > 0), tl.log(tl.where(r > 0, r, 1.0)) - g, float("-inf"))  # no log(0) computed
        sp = tl.where(m & (pv > 0), tl.log(tl.where(pv > 0, pv, 1.0)) - g, float("-inf"))
        mr = tl.max(sr, 0)
        mp = tl.max(sp, 0)
        ir = tl.min(tl.where(sr == mr, cols, V), 0).to(tl.int64)
        ip = tl.min(tl.where(sp == mp, cols, V), 0).to(tl.int64)
        arg_r = tl.where(mr > best_r, ir, arg_r)  # strictly greater: the earlier block keeps a tie
        best_r = tl.maximum(best_r, mr)
        arg_p = tl.where(mp > best_p, ip, arg_p)
        best_p = tl.maximum(best_p, mp)
    valid = best_p > float("-inf")
    drawn = tl.where(best_r > float("-inf"), arg_r, arg_p)
    drawn = tl.where(valid, drawn, 0)

    # 3. tokens: accepted drafts, the drawn token, then -1
    js = tl.arange(0, KP)
    tj = tl.load(drow + js, mask=js < K, other=-1)
    out = tl.where(js < s, tj, tl.where(js == s, drawn, -1))
    tl.store(tokens_ptr + b * (K + 1) + js, out, mask=js < K + 1)
    tl.store(accepted_ptr + b, s)
    tl.store(valid_ptr + b, valid)
