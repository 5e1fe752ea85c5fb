"""Naive speculative-sampling reference: one row and one chain position at a time, in float64, written from the
algorithm (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023) and the op's documented conventions. Slow and
obviously correct on purpose; shares no code with the kernels: the distributions come from the sampling
reference (``sampling_probs_ref``, ``token_rules_ref`` over prompt + generated + the drafts accepted before the
position) and the random streams are re-derived here from their spec with Python integers."""
from __future__ import annotations

import math

import torch

from arkernels.reference.sampling import sampling_probs_ref, token_rules_ref

_M32 = 0xFFFFFFFF
SALT = 0x5BD1E995  # the op's stream salt (arkernels/ops/spec_sampling.py's docstring)
ACCEPT_COLUMN = 0xFFFFFFFF  # the acceptance uniform's column


def _mix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def spec_uniform_ref(seed: int, pos: int, col: int) -> float:
    """U in (0, 1) of chain position ``pos`` (= step + j), column ``col``: sample's row key of (seed, pos) from
    64-bit two's-complement integers, mixed once more with the salt, then sample's column hash; the 24 bits + 1/2
    rounded to fp32, as the kernels compute it."""
    s, t = seed & 0xFFFFFFFFFFFFFFFF, pos & 0xFFFFFFFFFFFFFFFF
    a = _mix((s & _M32) ^ 0x243F6A88)
    a = _mix(a ^ (s >> 32))
    a = _mix(a ^ (t & _M32))
    a = _mix(a ^ (t >> 32))
    a = _mix(a ^ SALT)
    h = _mix(((col * 0x9E3779B9) + a) & _M32)
    h = _mix(h ^ a)
    return float(torch.tensor(((h >> 8) + 0.5) / 2**24, dtype=torch.float32))  # an fp32 stream: rounded once


def _position_probs(logits_row, b, accepted_so_far, temperature, top_k, top_p, min_p, rules):
    """float64 ``[vocab]``: one position's distribution, the rules seeing the row's history plus the drafts so far."""
    x = logits_row[None].float()
    if rules is not None:
        per_row = {n: [v[b]] for n, v in rules.items() if n not in ("prompts", "generated", "eos_token_id") and v}
        x = token_rules_ref(x, [rules["prompts"][b]], [list(rules["generated"][b]) + accepted_so_far],
                            eos_token_id=rules.get("eos_token_id", ()), **per_row)
    return sampling_probs_ref(x, [temperature], [top_k], [top_p], [min_p])[0]


def chain_speculative_sampling_ref(target_logits, draft_logits, draft_ids, temperature, top_k, top_p, min_p, seed,
                                   step, rules=None):
    """Same contract as ``arkernels.chain_speculative_sampling`` with explicit per-row parameters (lists or
    tensors) and seeds: ``(tokens int64 [batch, k+1], accepted int64 [batch], valid bool [batch])``.

    ``rules``: None, or the per-row arguments of ``token_rules_ref`` as a dict (``prompts``, ``generated``,
    ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``banned``,
    ``eos_token_id``, ``min_new_tokens``); position ``j`` of row ``b`` sees ``generated[b] + draft_ids[b, :j]``."""
    batch, kp1, vocab = target_logits.shape
    k = kp1 - 1
    tokens = torch.full((batch, kp1), -1, dtype=torch.int64)
    accepted = torch.zeros(batch, dtype=torch.int64)
    valid = torch.zeros(batch, dtype=torch.bool)
    for b in range(batch):
        T, K, P, MP = float(temperature[b]), int(top_k[b]), float(top_p[b]), float(min_p[b])
        sd, st = int(seed[b]), int(step[b])
        drafts = [int(t) for t in draft_ids[b]]
        greedy = T == 0
        s = 0
        while s < k:
            t = drafts[s]
            if not 0 <= t < vocab:
                break  # an id outside the vocabulary is never accepted
            p = _position_probs(target_logits[b, s], b, drafts[:s], T, K, P, MP, rules)
            if greedy:
                q_t = 0.0  # greedy: accepted iff the target's one-hot sits on it
            elif draft_logits is None:
                q_t = 1.0  # one-hot draft
            else:
                q_t = float(_position_probs(draft_logits[b, s], b, drafts[:s], T, K, P, MP, rules)[t])
            # accept with probability min(1, p(t) / q(t)): U < p / q, written without the division
            if spec_uniform_ref(sd, st + s, ACCEPT_COLUMN) * q_t < float(p[t]):
                tokens[b, s] = t
                s += 1
            else:
                break
        accepted[b] = s
        p = _position_probs(target_logits[b, s], b, drafts[:s], T, K, P, MP, rules)
        r = p.clone()
        if s < k and not greedy:
            if draft_logits is None:
                q = torch.zeros(vocab, dtype=torch.float64)
                if 0 <= drafts[s] < vocab:
                    q[drafts[s]] = 1.0
            else:
                q = _position_probs(draft_logits[b, s], b, drafts[:s], T, K, P, MP, rules)
            r = (p - q).clamp(min=0.0)  # the residual; renormalising does not change the race's winner
            if float(r.sum()) == 0.0:
                r = p
        if float(p.sum()) == 0.0:
            tokens[b, s] = 0  # no finite target logit at the drawing position
            continue
        valid[b] = True
        best, best_i = -math.inf, 0
        for i in range(vocab):
            if r[i] > 0:
                score = math.log(float(r[i])) - math.log(-math.log(spec_uniform_ref(sd, st + s, i)))
                if score > best:
                    best, best_i = score, i
        tokens[b, s] = best_i
    return tokens, accepted, valid
