"""Speculative decode steps for ``arkernels.generate(prompt_lookup_num_tokens=k)`` / ``(assistant_model=draft)``:
drafts (``arkernels.decode.drafts``) verified in one forward per step, rejected drafts rolled back by lengths.

Each step, every active row gets up to ``k`` draft tokens from its proposer (prompt lookup or a draft model); one
packed forward runs each row's last token and its drafts (``q_len = 1 + drafts``, ragged rows in one
``[1, sum(q_len)]`` row, ``cu_seqlens_q`` for the attention kernel); position ``j`` of a row is then drawn exactly as
the one-token loop draws that row's token ``j`` (same seed, ``step`` = the token's index, the token rules over a
history that holds the drafts before it). The row keeps drafts while each equals the draw at its position, and emits
the first draw that differs (or the bonus draw after ``k`` matches); the K/V of the rejected drafts are dropped by
length (``PagedCache.truncate_row``: whole blocks back to the pool, no K/V copied).

Exactness: a proposed draft is a point mass, so "keep the draft iff the target's draw equals it" is speculative
sampling's acceptance rule for a one-hot draft (accept with probability ``p(t)``, else draw from ``p`` without ``t``,
renormalised), and because the draw is the one the one-token loop makes for that token, the tokens are the same as
without speculation for the same seeds (greedy and sampling, rules included), up to the logits' float differences
between a multi-token forward and one-token forwards.

A sampling call with a draft model and neither token rules nor logprobs (``drafts.speculative_sampling``) instead
draws its drafts from the draft's distribution q and accepts them with ``arkernels.chain_speculative_sampling``
(``verify_sampled``: Leviathan / Chen, accept t with probability min(1, p(t) / q(t)), else a draw from the residual):
``sum min(p, q)`` acceptance instead of ``p(argmax q)``, tokens distributed as the one-token loop's, but not the same
tokens for the same seeds (the op's streams are its own).
"""
from __future__ import annotations

import torch

from arkernels.decode.emit import draw, take
from arkernels.decode.inputs import Plan
from arkernels.decode.result import GenerateResult


def _expand_rules(rules: dict | None, owners: torch.Tensor, drafts: list[list[int]], q_lens: list[int]):
    """The token rules of each packed position: its row's tensors, with a history (``token_state``) that also counts
    the drafts before the position (what the one-token loop's history holds when it draws that token)."""
    if rules is None:
        return None
    from arkernels.ops.sampling import update_token_state

    out = {n: (v[owners] if isinstance(v, torch.Tensor) else v) for n, v in rules.items()}
    state = out["token_state"]
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    dev = state.device
    for j in range(max(q_lens) - 1):  # draft j of a row is in the history of the row's positions after it
        pos = [s + i for s, d in zip(starts, drafts) if len(d) > j for i in range(j + 1, len(d) + 1)]
        ids = [d[j] for d in drafts if len(d) > j for _ in range(j + 1, len(d) + 1)]
        update_token_state(state, torch.tensor(ids, device=dev), torch.tensor(pos, device=dev))
    return out


def verify(plan: Plan, logits: torch.Tensor, rows: list[int], drafts: list[list[int]], done_tokens: list[int],
           aux: dict) -> list[list[int]]:
    """The tokens each row emits from one verification forward's logits ``[sum(q_lens), V]``: its drafts while each
    equals the draw at its position, then that position's draw."""
    from arkernels.ops.sampling import sample

    q_lens = [1 + len(d) for d in drafts]
    dev = logits.device
    owner_list = [r for r, q in zip(rows, q_lens) for _ in range(q)]
    owners = torch.tensor(owner_list, device=dev)
    steps = torch.tensor([done_tokens[i] + j for i, q in enumerate(q_lens) for j in range(q)], device=dev)
    rules = _expand_rules(plan.rules, owners, drafts, q_lens)
    positions = torch.arange(len(owner_list), device=dev)
    ids = draw(sample, logits, None, plan.seeds[owners], steps, **plan.sampling, idx=..., rules=rules,
               rows=positions, logprobs=plan.logprobs, logprobs_mode=plan.logprobs_mode, aux=aux).tolist()
    out, at = [], 0
    for d in drafts:
        got = ids[at:at + len(d) + 1]
        a = next((j for j, t in enumerate(d) if got[j] != t), len(d))
        out.append(got[:a + 1])
        at += len(d) + 1
    return out


def verify_sampled(plan: Plan, logits: torch.Tensor, rows: list[int], drafts: list[list[int]],
                   done_tokens: list[int], draft_logits: dict[int, list[torch.Tensor]]) -> list[list[int]]:
    """Leviathan / Chen acceptance of sampled drafts (module docstring), with the fused op over the rows that proposed
    the same number of drafts (one call, one host read, per distinct count)."""
    from arkernels.ops.spec_sampling import chain_speculative_sampling

    starts = [sum(1 + len(d) for d in drafts[:i]) for i in range(len(drafts))]
    out: list[list[int]] = [[] for _ in rows]
    dev = logits.device
    for m in sorted({len(d) for d in drafts}):
        group = [i for i, d in enumerate(drafts) if len(d) == m]
        target = torch.stack([logits[starts[i]:starts[i] + m + 1] for i in group])
        q = torch.stack([torch.stack(draft_logits[rows[i]]) for i in group]).to(target.dtype) if m else None
        ids = torch.tensor([drafts[i] for i in group], dtype=torch.int64, device=dev).view(len(group), m)
        idx = torch.tensor([rows[i] for i in group], device=dev)
        tokens, accepted = chain_speculative_sampling(
            target, ids, q, **plan.sampling, seed=plan.seeds[idx],
            step=torch.tensor([done_tokens[i] for i in group], dtype=torch.int64, device=dev))
        for i, t, a in zip(group, tokens.tolist(), accepted.tolist()):
            out[i] = t[:a + 1]
    return out


def decode_spec(model, plan: Plan, cache, cache_kw: str, first: torch.Tensor, lp, result: GenerateResult,
                drafter, static=None) -> None:
    """The decode loop with speculative steps (after the prefill drew ``first``, int64 ``[rows]``); ``drafter``: an
    ``arkernels.decode.drafts`` proposer; ``static``: the ``SpecStep`` of ``cuda_graphs=True`` (None: eager)."""
    B = plan.rows
    history = [list(plan.prompts[r // plan.n_seq]) for r in range(B)]
    done = [False] * B
    lengths = list(plan.prompt_lens)  # tokens in each row's cache
    result.proposed_tokens, result.accepted_tokens = [0] * B, [0] * B
    first_lp = None if lp is None else {r: [[h[r] for h in (t.tolist() for t in lp)]] for r in range(B)}
    first_ids = {r: [t] for r, t in enumerate(first.tolist())}
    _emit(plan, cache, first_ids, first_lp, done, history, result, count=False)
    drafter.commit(list(range(B)), [[] for _ in range(B)], list(first_ids.values()))
    while not all(done):
        rows = [r for r in range(B) if not done[r]]
        drafts = drafter.propose(rows, history, [plan.max_new_tokens - len(result.tokens[r]) - 1 for r in rows])
        last, row_lens = [history[r][-1] for r in rows], [lengths[r] for r in rows]
        aux: dict = {}
        done_tokens = [len(result.tokens[r]) for r in rows]
        sampled = getattr(drafter, "sampling", None) is not None
        if static is not None and not sampled:
            emitted = [t[:t[-1] + 1] for t in static.verify(rows, last, drafts, row_lens, done_tokens).tolist()]
        else:
            if static is not None:  # the step's logits [n, q, V], each row's positions packed as the eager forward's
                full = static.verify(rows, last, drafts, row_lens, done_tokens)
                logits = torch.cat([x[:1 + len(d)] for x, d in zip(full, drafts)])
            else:
                logits = _forward(model, cache, cache_kw, rows, last, drafts, row_lens)
            if sampled:
                emitted = verify_sampled(plan, logits, rows, drafts, done_tokens, drafter.logits)
            else:
                emitted = verify(plan, logits, rows, drafts, done_tokens, aux)
        lps = _split_logprobs(aux.pop("lp", None), rows, drafts, emitted)
        for r, d, e in zip(rows, drafts, emitted):
            result.proposed_tokens[r] += len(d)
            result.accepted_tokens[r] += len(e) - 1
            lengths[r] += len(e)  # the row's last token and its kept drafts; the last emitted one is fed next
            cache.truncate_row(r, lengths[r])
        drafter.commit(rows, drafts, emitted)
        _emit(plan, cache, dict(zip(rows, emitted)), lps, done, history, result)
        for r in rows:
            if done[r]:
                drafter.release(r)


def _forward(model, cache, cache_kw: str, rows: list[int], last: list[int], drafts: list[list[int]],
             lengths: list[int]) -> torch.Tensor:
    """One packed forward of each row's last token and drafts; logits ``[sum(1 + drafts), V]``."""
    dev = next(model.parameters()).device
    q_lens = [1 + len(d) for d in drafts]
    ids = torch.tensor([t for x, d in zip(last, drafts) for t in [x, *d]], dtype=torch.int64, device=dev)[None]
    pos = torch.tensor([p for n, q in zip(lengths, q_lens) for p in range(n, n + q)], device=dev)[None]
    cache.begin_step(rows, q_lens)
    return model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kw: cache}).logits[0]


def _split_logprobs(lp, rows, drafts, emitted):
    """``top_logprobs``' tensors over the packed positions -> ``{row: [per emitted token: (logprob, rank, top ids,
    top logprobs)]}`` on the host."""
    if lp is None:
        return None
    host = [t.tolist() for t in lp]
    out, at = {}, 0
    for r, d, e in zip(rows, drafts, emitted):
        out[r] = [[h[at + j] for h in host] for j in range(len(e))]
        at += len(d) + 1
    return out


def _emit(plan: Plan, cache, emitted: dict[int, list[int]], lps, done: list[bool], history: list[list[int]],
          result: GenerateResult, count: bool = True) -> None:
    """Each row's emitted tokens in order through ``take`` (stream, logprobs, EOS, max_new_tokens), and into the row's
    lookup history and (``count``: the prefill's draw is counted already) the token rules' history."""
    rules = plan.rules
    width = max((len(e) for e in emitted.values()), default=0)
    for j in range(width):
        got = [r for r, e in emitted.items() if len(e) > j and not done[r]]
        if not got:
            break
        toks = [emitted[r][j] for r in got]
        lp = None if lps is None else [list(x) for x in zip(*[lps[r][j] for r in got])]
        if rules is not None and count:
            from arkernels.ops.sampling import update_token_state

            dev = rules["token_state"].device
            update_token_state(rules["token_state"], torch.tensor(toks, device=dev), torch.tensor(got, device=dev))
        for r, t in zip(got, toks):
            history[r].append(t)
        take(plan, cache, toks, got, lp, done, result)
