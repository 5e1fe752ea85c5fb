"""What a decode step does with its logits, shared by the decode loops (``loop``: one token per step; ``spec``:
speculative steps): ``draw`` (greedy argmax or the fused sampler with the token rules and logprobs) and ``take`` (a
step's tokens appended to their rows: streamed, logprobs, EOS and ``max_new_tokens``)."""
from __future__ import annotations

import torch

from arkernels.decode.inputs import Plan
from arkernels.decode.result import GenerateResult, TokenLogprobs


def take(plan: Plan, cache, toks: list[int], got: list[int], lp, done: list[bool], result: GenerateResult) -> None:
    """One step's tokens read back: appended to their rows (streamed, logprobs), rows ended by EOS or the length."""
    for i, (r, tok) in enumerate(zip(got, toks)):
        if done[r]:  # the step after its EOS: dropped
            continue
        result.tokens[r].append(tok)
        if lp is not None:
            top = [(t, v, j + 1) for j, (t, v) in enumerate(zip(lp[2][i], lp[3][i]))]
            result.logprobs[r].append(TokenLogprobs(tok, lp[0][i], lp[1][i], top))
        if plan.stream is not None:
            plan.stream(r, tok)
        if len(result.tokens[r]) > 1:
            result.decode_tokens += 1
        if tok in plan.eos:
            result.finished_by_eos[r] = True
        if tok in plan.eos or len(result.tokens[r]) >= plan.max_new_tokens:
            done[r] = True
            cache.release_row(r)  # a step still in flight for it runs first (stream order)


def draw(sample, logits, active, seeds, steps, temperature, top_k, top_p, min_p, idx=None, rules=None, rows=None,
          logprobs=None, logprobs_mode="raw", aux=None):
    """Greedy argmax or the fused sampler; ``idx=...`` (Ellipsis): ``seeds``/``steps`` are already per row and
    ``rows`` holds each row's cache (= history) row, -1 for padding. ``rules``: ``token_rules``' keywords (the
    per-row values gathered by row here); with ``logprobs``, ``aux["lp"]`` receives ``top_logprobs``' tensors."""
    lp_mode = logprobs is not None
    if rules is None and not lp_mode and isinstance(temperature, (int, float)) and temperature == 0:
        # greedy: the sampler's rule (lowest index among the max logits) is torch.argmax's; skipping the sampler's
        # parameter set-up saves ~1 ms per step on the CPU
        return torch.argmax(logits, dim=-1)
    if idx is None:
        idx = torch.tensor(active, device=logits.device)
    if rows is None:
        rows = idx if idx is not ... else torch.arange(logits.shape[0], device=logits.device)
    seed, step = seeds[idx], steps[idx]
    kw = {}
    if rules is not None:
        safe = rows.clamp(min=0)  # padding columns read row 0's values; their history row -1 applies no rule
        kw = dict(token_state=rules["token_state"], logit_bias=rules["logit_bias"], history_rows=rows,
                  new_tokens=step, **{n: rules[n][safe] for n in ("repetition_penalty", "frequency_penalty",
                                                                   "presence_penalty", "min_new_tokens")})
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ids = sample(logits, **sampling, seed=seed, step=step, **kw)
    if lp_mode:
        from arkernels.ops.sampling import raw_logprobs, sampling_probs, top_logprobs

        if logprobs_mode == "raw":
            lp = raw_logprobs(logits)
        else:
            lp = torch.log(sampling_probs(logits, **sampling, **kw))
        aux["lp"] = top_logprobs(lp, ids, logprobs)
    return ids
