"""Naive sampling reference: one row at a time in float64 (top-p in fp32, step for step as transformers'
TopPLogitsWarper, whose float boundary is the one users see), a stable sort per filter, obviously correct and
slow on purpose. Shares no code with the kernels (the random stream is re-derived here from its spec with
Python integers)."""
from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF


def sampling_probs_ref(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """Same contract as ``arkernels.sampling_probs``; per-row parameters are ``[batch]`` tensors or lists.
    Returns float64 ``[batch, vocab]``."""
    batch, vocab = logits.shape
    out = torch.zeros(batch, vocab, dtype=torch.float64)
    for b in range(batch):
        x = logits[b].double().cpu()
        x = torch.where(torch.isnan(x), -math.inf, x)
        x = x.clamp(max=torch.finfo(torch.float32).max)  # +inf: the largest float, as documented
        m = float(x.max())
        if m == -math.inf:
            continue  # no finite logit: all zeros
        T = float(temperature[b])
        if T == 0:
            out[b, int(torch.nonzero(x == m)[0])] = 1.0  # lowest index among the maxima
            continue
        z = (x - m) / T
        keep = torch.ones(vocab, dtype=torch.bool)
        k = int(top_k[b])
        if 0 < k < vocab:
            kth = torch.sort(x, descending=True, stable=True).values[k - 1]
            keep &= x >= kth  # every token tied with the k-th value stays
        p = float(top_p[b])
        if p < 1:
            # transformers' TopPLogitsWarper, literally: fp32 softmax, ascending sort, fp32 cumsum, drop where
            # the cumsum is <= 1 - top_p (fp32); a tie group is kept when its last (top) member is kept
            q = torch.softmax(torch.where(keep, z, -math.inf).float(), dim=0)
            s, order = torch.sort(q, descending=False, stable=True)
            cum = torch.cumsum(s, 0)
            last = torch.searchsorted(s, s, right=True) - 1  # last position of each value's tie group
            drop = torch.empty(vocab, dtype=torch.bool)
            drop[order] = cum[last] <= torch.tensor(1.0, dtype=torch.float32) - torch.tensor(p, dtype=torch.float32)
            # min_tokens_to_keep=1: the top token (here its tie group) stays even when the fp32 total rounds
            # to <= 1 - top_p (top_p 1e-6 over 6000 tokens)
            keep &= ~drop | (q == q.max())
        q = torch.where(keep, torch.exp(z), torch.zeros(()))
        q = q / q.sum()
        mp = float(min_p[b])
        keep &= q >= mp * q.max()
        q = torch.where(keep, q, torch.zeros(()))
        out[b] = q / q.sum()
    return out


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_ref(seed: int, step: int, col: int) -> float:
    """The random stream's spec: U in (0, 1) for (seed, step, vocab column), from 64-bit two's-complement
    seed and step."""
    s, t = seed & 0xFFFFFFFFFFFFFFFF, step & 0xFFFFFFFFFFFFFFFF
    a = _fmix32((s & _M32) ^ 0x243F6A88)
    a = _fmix32(a ^ (s >> 32))
    a = _fmix32(a ^ (t & _M32))
    a = _fmix32(a ^ (t >> 32))
    h = _fmix32(((col * 0x9E3779B9) + a) & _M32)
    h = _fmix32(h ^ a)
    return ((h >> 8) + 0.5) / 2**24


def sample_ref(logits, temperature, top_k, top_p, min_p, seed, step) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``arkernels.sample`` with explicit seeds: an exponential race
    ``argmax_i q_i / E_i`` over the reference distribution, ``E_i = -log U_i``."""
    q = sampling_probs_ref(logits, temperature, top_k, top_p, min_p)
    batch, vocab = q.shape
    ids = torch.zeros(batch, dtype=torch.int64)
    valid = torch.zeros(batch, dtype=torch.bool)
    for b in range(batch):
        if q[b].sum() == 0:
            continue
        valid[b] = True
        best, best_i = -math.inf, 0
        for i in torch.nonzero(q[b] > 0)[:, 0].tolist():
            score = math.log(float(q[b, i])) - math.log(-math.log(uniform_ref(int(seed[b]), int(step[b]), i)))
            if score > best:
                best, best_i = score, i
        ids[b] = best_i
    return ids, valid


def token_rules_ref(logits, prompts, generated, *, repetition_penalty=None, frequency_penalty=None,
                    presence_penalty=None, logit_bias=None, banned=None, eos_token_id=(), min_new_tokens=None):
    """The token rules, one row and one token at a time, from their published definitions (not from the kernels'
    state table): float32 ``[batch, vocab]``.

    Per row ``b`` (every per-row argument a list, None: off): logits sanitised (NaN -> -inf, +inf -> the largest
    float); ``logit_bias[b]`` ({token: bias}) added (transformers' SequenceBiasLogitsProcessor); every token of
    ``prompts[b] + generated[b]`` penalised once by transformers' RepetitionPenaltyLogitsProcessor rule (negative
    scores times the penalty, the others divided by it); vLLM's ``apply_penalties`` over ``generated[b]``:
    ``logits -= frequency * count`` then ``logits -= presence * (count > 0)``; ``banned[b]`` ids and, while
    ``len(generated[b]) < min_new_tokens[b]``, the ``eos_token_id`` ids set to -inf. All arithmetic in fp32, as
    transformers and vLLM do it on fp32 scores."""
    f32 = torch.float32
    batch, vocab = logits.shape
    out = torch.empty(batch, vocab, dtype=f32)
    big = torch.tensor(torch.finfo(f32).max, dtype=f32)
    for b in range(batch):
        row = [torch.tensor(float(v), dtype=f32) for v in logits[b].float().tolist()]
        row = [torch.tensor(-math.inf, dtype=f32) if torch.isnan(v) else torch.minimum(v, big) for v in row]
        for t, v in ((logit_bias[b] if logit_bias else None) or {}).items():
            row[t] = row[t] + torch.tensor(v, dtype=f32)
        if repetition_penalty is not None:
            r = torch.tensor(repetition_penalty[b], dtype=f32)
            for t in set(list(prompts[b]) + list(generated[b])):
                row[t] = row[t] * r if row[t] < 0 else row[t] / r
        counts = {}
        for t in generated[b]:
            counts[t] = counts.get(t, 0) + 1
        if frequency_penalty is not None:
            f = torch.tensor(frequency_penalty[b], dtype=f32)
            for t, c in counts.items():
                row[t] = row[t] - f * torch.tensor(float(c), dtype=f32)
        if presence_penalty is not None:
            p = torch.tensor(presence_penalty[b], dtype=f32)
            for t in counts:
                row[t] = row[t] - p
        for t in (banned[b] if banned else None) or ():
            row[t] = torch.tensor(-math.inf, dtype=f32)
        if min_new_tokens is not None and len(generated[b]) < min_new_tokens[b]:
            for t in eos_token_id:
                row[t] = torch.tensor(-math.inf, dtype=f32)
        row = [torch.tensor(-math.inf, dtype=f32) if torch.isnan(v) else torch.minimum(v, big) for v in row]
        out[b] = torch.stack(row)
    return out
