"""The CPU kernels of the sampling stem (``sample``, ``sampling_probs``, ``sampling_rules``): vectorised torch over
the batch, the same thresholds as the Triton kernels (arkernels/triton/sampling.py; only float sums are taken in
another order) and the same random stream, through the torch twins of the kernels' hash below, so CPU and GPU
draw the same tokens. Inputs arrive validated by arkernels/ops/sampling.py, which registers these for "cpu".
"""
from __future__ import annotations

import torch

from arkernels.token_state_layout import BAN_BIT, COUNT_MAX, EOS_BIT, SEEN_MASK

_FLT_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------------------------------------------------
# The random stream: the torch twins of ``fmix32`` / ``row_key`` / ``uniform`` in arkernels/triton/sampling.py
# ---------------------------------------------------------------------------------------------------------
# The torch twin works on int32 holding the uint32 bits: int32 multiplication wraps mod 2^32 like uint32, and
# a logical right shift is an arithmetic one masked to the remaining bits (2-3x faster than int64 on the CPU).
def _s32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


def _to_u32_bits(v: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of an int64 tensor as int32."""
    lo = v & 0xFFFFFFFF
    return (lo - ((lo >> 31) << 32)).to(torch.int32)


def fmix32_torch(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _s32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _s32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


def row_key_torch(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``row_key``: seed, step int64 ``[n]`` -> the rows' keys (uint32 bits in int32)."""
    a = fmix32_torch(_to_u32_bits(seed) ^ 0x243F6A88)
    a = fmix32_torch(a ^ _to_u32_bits(seed >> 32))
    a = fmix32_torch(a ^ _to_u32_bits(step))
    return fmix32_torch(a ^ _to_u32_bits(step >> 32))


def uniform_torch(key: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``uniform``, bit-identical: row keys and vocab columns (broadcast together, e.g.
    ``[batch, 1]`` against ``[1, vocab]``, or two ``[n]`` for gathered pairs) -> fp32 U in (0, 1)."""
    h = fmix32_torch(cols.to(torch.int32) * _s32(0x9E3779B9) + key)
    h = fmix32_torch(h ^ key)
    return (((h >> 8) & 0xFFFFFF).to(torch.float32) + 0.5) * 5.9604644775390625e-08


# ---------------------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------------------
def sampling_rules_cpu(logits, token_state, history, penalties, logit_bias):
    """The ``arkernels::sampling_rules`` kernel on the CPU: the token rules, vectorised over the batch (the same fp32
    operations, in the same order, as ``_load_x`` in the Triton kernels): the processed, sanitised fp32 logits."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x).clamp(max=_FLT_MAX)
    if token_state is None and logit_bias is None:
        return torch.where(x == 0, 0.0, x)
    N = (token_state if token_state is not None else logit_bias).shape[0]
    h = history[:, 0]
    rv = ((h >= 0) & (h < N))[:, None]
    hr = torch.where(rv[:, 0], h, 0)
    if logit_bias is not None:
        x = x + torch.where(rv, logit_bias[hr], 0.0)
    if token_state is not None:
        w = torch.where(rv, token_state[hr], 0)
        if penalties is None:
            penalties = torch.tensor([[1.0, 0.0, 0.0]]).expand(x.shape[0], 3)
        rp, fq, pr = (penalties[:, i:i + 1] for i in range(3))
        cnt = w & COUNT_MAX
        x = torch.where((w & SEEN_MASK) != 0, torch.where(x < 0, x * rp, x / rp), x)
        x = x - fq * cnt.float()
        x = x - torch.where(cnt > 0, pr, 0.0)
        eos_on = (history[:, 1] < history[:, 2])[:, None]
        x = torch.where(((w & BAN_BIT) != 0) | (((w & EOS_BIT) != 0) & eos_on), float("-inf"), x)
    x = torch.where(torch.isnan(x), float("-inf"), x).clamp(max=_FLT_MAX)
    return torch.where(x == 0, 0.0, x)


def _keep_cpu(logits, temperature, top_k, top_p, min_p):
    """The kernel's filter on the CPU, vectorised over the batch: returns ``(z, e, keep, arg, valid,
    sampled)``, all ``[batch, vocab]`` or ``[batch]``. Same thresholds as the Triton kernels (only float
    sums are taken in another order)."""
    batch, vocab = logits.shape
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x).clamp(max=_FLT_MAX)
    m, arg = x.max(dim=1)  # ties: torch.max returns the first maximal index
    valid = m > float("-inf")
    sampled = valid & (temperature > 0)
    T = torch.where(sampled, temperature, 1.0)
    mm = torch.where(valid, m, 0.0)[:, None]
    z = (x - mm) / T[:, None]
    e = torch.exp(z)

    # top-k: the k-th largest logit, ties kept
    tk = torch.full((batch,), float("-inf"))
    use_k = sampled & (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        kmax = int(top_k[use_k].max())
        vals = torch.topk(x[use_k], kmax, dim=1).values
        tk[use_k] = vals.gather(1, (top_k[use_k].long() - 1)[:, None])[:, 0]
    in_k = x >= tk[:, None]

    # top-p over the top-k set, compared the way transformers' TopPLogitsWarper does: fp32 probabilities
    # e / mass summed from the bottom, a token dropped iff the mass strictly below it plus its own is
    # <= 1 - top_p (ties: the group is kept when its top member would be). tp is the largest z whose mass
    # strictly below is <= 1 - top_p. Tokens with probability < (1 - p) / vocab hold < 1 - p together, so
    # all are dropped: only the others are sorted (a handful for a peaked row), the rest enter as one sum.
    tp = torch.full((batch,), float("-inf"))
    use_p = sampled & (top_p < 1)
    if bool(use_p.any()):
        rows = use_p.nonzero()[:, 0]
        eK = torch.where(in_k[rows], e[rows], 0.0)
        pr = eK / eK.sum(dim=1, keepdim=True)
        q = 1 - top_p[rows]  # fp32, as transformers' fp32 cumsum against 1 - top_p
        cand = in_k[rows] & (pr >= (q / vocab * (1 - 1e-3))[:, None])
        n_cand = int(cand.sum(dim=1).max())
        rest = torch.where(cand, 0.0, pr).sum(dim=1)
        vals, idx = torch.topk(torch.where(cand, z[rows], float("-inf")), n_cand, dim=1)
        vals, idx = vals.flip(1), idx.flip(1)  # ascending, as transformers' cumsum
        pc = torch.where(vals > float("-inf"), pr.gather(1, idx), 0.0)
        below = rest[:, None] + (pc.cumsum(dim=1) - pc)
        tp[rows] = torch.where(below <= q[:, None], vals, float("-inf")).max(dim=1).values

    keep = sampled[:, None] & in_k & (z >= tp[:, None]) & (e >= min_p[:, None])
    return z, e, keep, arg, valid, sampled


def sampling_probs_cpu(logits, temperature, top_k, top_p, min_p, token_state=None, history=None, penalties=None,
                       logit_bias=None):
    """The ``arkernels::sampling_probs`` kernel on the CPU: fp32 ``[batch, vocab]``."""
    logits = sampling_rules_cpu(logits, token_state, history, penalties, logit_bias)
    z, e, keep, arg, valid, sampled = _keep_cpu(logits, temperature, top_k, top_p, min_p)
    kept = torch.where(keep, e, 0.0)
    probs = kept / kept.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    onehot = torch.zeros_like(probs).scatter_(1, arg[:, None], 1.0) * valid[:, None]
    return torch.where(sampled[:, None], probs, onehot)


def sample_cpu(logits, temperature, top_k, top_p, min_p, seed, step, token_state=None, history=None,
               penalties=None, logit_bias=None):
    """The ``arkernels::sample`` kernel on the CPU: ``(ids int64 [batch], valid bool [batch])``."""
    logits = sampling_rules_cpu(logits, token_state, history, penalties, logit_bias)
    vocab = logits.shape[1]
    z, e, keep, arg, valid, sampled = _keep_cpu(logits, temperature, top_k, top_p, min_p)
    ids = arg.clone()
    rows = sampled.nonzero()[:, 0]
    if rows.numel() > 0:
        # exponential race over the kept tokens: argmax z - log(E), E = -log(U), U from the shared hash.
        # U lies in [2^-25, 1 - 2^-25], so -log(E) lies in [-2.85, 17.33]: the maximum (z = 0) scores
        # >= -2.86 and a token with z < -20.5 can never win. Hashing only the tokens that can win skips
        # most of the vocabulary (the hash is ~20 int64 ops per element) and changes no draw.
        r, c = (keep[rows] & (z[rows] >= -20.5)).nonzero(as_tuple=True)
        u = uniform_torch(row_key_torch(seed[rows], step[rows])[r], c)
        score = torch.full((rows.numel(), vocab), float("-inf"))
        score[r, c] = z[rows][r, c] - torch.log(-torch.log(u))
        ids[rows] = score.argmax(dim=1)
    return ids, valid
