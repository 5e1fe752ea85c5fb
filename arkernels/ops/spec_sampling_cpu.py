"""The CPU kernel of speculative sampling: the acceptance walk and the final draw, vectorised over the batch in torch,
with the torch twin of the Triton kernel's hash (bit-identical uniforms), so both draw the same tokens up to the
rounding of log (a race decided within an ulp). Semantics: arkernels/triton/spec_sampling.py's header."""
from __future__ import annotations

import torch

from arkernels.ops.sampling_cpu import fmix32_torch, row_key_torch, uniform_torch

SPEC_SALT = 0x5BD1E995  # as in arkernels/triton/spec_sampling.py (tests check both streams against the reference)
ACCEPT_COL = -1  # uint32 0xFFFFFFFF: the acceptance uniform's column


def spec_key_torch(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """int64 seed and chain position ``step + j`` (broadcast together) -> the position's key (uint32 bits in int32):
    ``sample``'s row key of (seed, pos), then fmix32 of it XOR SPEC_SALT."""
    seed, pos = torch.broadcast_tensors(seed, pos)
    return fmix32_torch(row_key_torch(seed, pos) ^ SPEC_SALT)


RACE_CUT = 1.25e-9  # exp(-20.5): a column below RACE_CUT * (the row's largest weight) can never win the race


def _race(w, key):
    """``(max, argmax)`` over columns of ``log w - log(-log U)`` (``w > 0`` only; ties: the lowest column, torch.max's
    rule). U lies in [2^-25, 1 - 2^-25], so ``-log(-log U)`` lies in [-2.85, 17.33]: the largest weight scores
    >= log w_max - 2.85 and a column with ``w < w_max * exp(-20.5)`` scores < log w_max - 3.1; it never wins, so only
    the others are hashed and logged (the rest, often denormal, cost a log each: ~1 ms per 32k row)."""
    wmax = w.max(dim=1, keepdim=True).values
    rows, cols = ((w > 0) & (w >= wmax * RACE_CUT)).nonzero(as_tuple=True)
    u = uniform_torch(key[rows], cols)
    score = torch.full_like(w, float("-inf"))
    score[rows, cols] = torch.log(w[rows, cols]) - torch.log(-torch.log(u))
    return score.max(dim=1)


def spec_walk_cpu(p, q, draft_ids, temperature, seed, step):
    """Same contract as ``arkernels.triton.spec_sampling_launch.spec_walk_triton``: ``p`` fp32 ``[batch*(k+1),
    vocab]``, ``q`` fp32 ``[batch*k, vocab]`` or None (one-hot draft), ``draft_ids`` int64 ``[batch, k]``,
    temperature fp32, seed, step int64 ``[batch]`` -> ``(tokens int64 [batch, k+1], accepted int64 [batch],
    valid bool [batch])``."""
    batch, k = draft_ids.shape
    vocab = p.shape[1]
    p = p.view(batch, k + 1, vocab)
    q = None if q is None else q.view(batch, k, vocab)
    rows = torch.arange(batch)
    greedy = ~(temperature > 0)  # as sampling_probs reads it (the wrapper refuses a negative or NaN temperature)

    # 1. the walk: all k acceptance tests at once, then the first rejection
    t = draft_ids
    ok = (t >= 0) & (t < vocab)
    tc = torch.where(ok, t, 0)
    pt = torch.where(ok, p[:, :k].gather(2, tc[..., None])[..., 0], 0.0)
    qt = torch.where(ok, 1.0 if q is None else q.gather(2, tc[..., None])[..., 0], 0.0)
    qt = torch.where(greedy[:, None], 0.0, qt)
    pos = step[:, None] + torch.arange(k)[None, :]
    u = uniform_torch(spec_key_torch(seed[:, None], pos), torch.tensor(ACCEPT_COL))
    s = (u * qt < pt).to(torch.int64).cumprod(dim=1).sum(dim=1)

    # 2. the draw at position s: residual race and p race, lowest column among equal scores (torch.max's rule)
    ps = p[rows, s]
    has_q = (s < k) & ~greedy
    sq = s.clamp(max=max(k - 1, 0))
    if k == 0:
        qs = torch.zeros_like(ps)
    elif q is None:
        qs = torch.zeros_like(ps).scatter_(1, tc[rows, sq][:, None], ok[rows, sq][:, None].float())
    else:
        qs = q[rows, sq]
    qs = torch.where(has_q[:, None], qs, 0.0)
    r = (ps - qs).clamp(min=0.0)
    key = spec_key_torch(seed, step + s)
    inf = float("-inf")
    best_r, arg_r = _race(r, key)
    best_p, arg_p = _race(ps, key)
    valid = best_p > inf
    drawn = torch.where(valid, torch.where(best_r > inf, arg_r, arg_p), 0)

    # 3. tokens: accepted drafts, the drawn token, then -1
    js = torch.arange(k + 1)[None, :]
    ext = torch.cat([t, torch.full((batch, 1), -1, dtype=torch.int64)], dim=1)
    tokens = torch.where(js < s[:, None], ext, torch.where(js == s[:, None], drawn[:, None], -1))
    return tokens, s, valid
