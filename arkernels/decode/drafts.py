"""Draft proposers for ``arkernels.decode.spec``: where a speculative step's draft tokens come from.

A proposer has ``propose(rows, history, room) -> drafts`` (up to ``room[i]`` tokens for row ``rows[i]``, given every
row's history: prompt + emitted tokens), ``commit(rows, drafts, emitted)`` (what the target kept, so the proposer's
state follows) and ``close()``.

- ``LookupDrafts``: prompt lookup, transformers' ``PromptLookupCandidateGenerator`` rule (``propose_ngram``).
- ``ModelDrafts``: a draft model on its own paged cache; rejected drafts are rolled back by length, and the tokens it
  has not yet seen (the target's correction, or the last draft after a full accept) are fed at its next step. Greedy
  (its argmax is the token most likely to equal the target's draw), or, with ``sampling`` (``speculative_sampling``
  says when), drawn from its own distribution with ``arkernels.sample`` and kept with their logits for Leviathan /
  Chen acceptance (``arkernels.decode.spec``).
"""
from __future__ import annotations

import torch


def make_drafter(plan):
    """The proposer of a plan's speculation (``plan.lookup`` or ``plan.assistant``)."""
    if plan.lookup is not None:
        return LookupDrafts(*plan.lookup, plan.eos)
    draft, k = plan.assistant
    return ModelDrafts(draft, k, plan.prompts, plan.rows, plan.n_seq, max(plan.prompt_lens) + plan.max_new_tokens,
                       plan.block_size, (plan.sampling, plan.seeds) if speculative_sampling(plan) else None)


def speculative_sampling(plan) -> bool:
    """Whether a plan's draft-model steps use Leviathan / Chen acceptance: a sampling call (temperature > 0) with no
    token rules and no logprobs. Otherwise the drafts are greedy and kept while they equal the one-token loop's draws
    (token rules inside a sampled draft chain and logprobs of its emitted tokens are not built)."""
    return (plan.assistant is not None and plan.sampling["temperature"] > 0 and plan.rules is None
            and plan.logprobs is None)


def propose_ngram(history: list[int], k: int, max_ngram: int, eos: set[int]) -> list[int]:
    """transformers' prompt-lookup rule: for n from ``max_ngram`` down to 1, the earliest earlier occurrence of the
    last n tokens that has a continuation gives up to ``k`` following tokens, cut at the first EOS id; ``[]`` when
    nothing matches."""
    L = len(history)
    if k <= 0 or L < 2:
        return []
    for n in range(min(max_ngram, L - 1), 0, -1):
        tail = history[L - n:]
        first = tail[0]
        for i in range(L - n):  # matches ending before the tail itself (the tail has no continuation)
            if history[i] == first and history[i:i + n] == tail:
                out = history[i + n:min(i + n + k, L)]
                cut = next((j for j, t in enumerate(out) if t in eos), len(out))
                if out:
                    return out[:cut]
    return []


class LookupDrafts:
    """Prompt-lookup drafts: up to ``k`` tokens, n-grams of up to ``max_ngram`` tokens."""

    def __init__(self, k: int, max_ngram: int, eos: set[int]):
        self.k, self.max_ngram, self.eos = k, max_ngram, eos

    def propose(self, rows: list[int], history: list[list[int]], room: list[int]) -> list[list[int]]:
        return [propose_ngram(history[r], min(self.k, m), self.max_ngram, self.eos) for r, m in zip(rows, room)]

    def commit(self, rows, drafts, emitted) -> None:
        pass

    def release(self, r: int) -> None:
        pass

    def close(self) -> None:
        pass


class ModelDrafts:
    """A draft model's greedy proposals, ``k`` per step, on its own ``PagedCache`` (arkernels' attention selected on
    it for the call). Per row: ``lens`` tokens in its cache, ``pending`` tokens of the history it has not seen."""

    def __init__(self, draft, k: int, prompts: list[list[int]], rows: int, n_seq: int, max_length: int,
                 block_size: int, sampling: tuple[dict, torch.Tensor] | None = None):
        from arkernels.decode.inputs import cache_kwarg
        from arkernels.hf.attention import NAME, register
        from arkernels.hf.cache import PagedCache

        self.model, self.k = draft, k
        self.saved_attn = draft.config._attn_implementation
        if self.saved_attn != NAME:
            draft.set_attn_implementation(register())
        self.cache_kw = cache_kwarg(draft)
        self.cache = PagedCache(draft.config, block_size=block_size, max_length=max_length + k)
        self.cache.set_rows(rows)
        self.lens = [0] * rows
        self.pending = [list(prompts[r // n_seq]) for r in range(rows)]
        self.prompt_lens = [len(prompts[r // n_seq]) for r in range(rows)]
        self.device = next(draft.parameters()).device
        self.sampling = sampling  # (temperature / top_k / top_p / min_p, per-row seeds) or None: greedy drafts
        self.logits: dict[int, list[torch.Tensor]] = {}  # sampling: each row's draft logits [V] of the last propose

    def _forward(self, rows: list[int], feeds: list[list[int]], steps: list[int]) -> list[int]:
        """One packed forward of ``feeds[i]`` for row ``rows[i]``; the token at each row's last position: its argmax,
        or (sampling) a draw from the draft's distribution at token index ``steps[i]`` of the row's seed."""
        q = [len(f) for f in feeds]
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64, device=self.device)[None]
        pos = torch.tensor([p for r, n in zip(rows, q) for p in range(self.lens[r], self.lens[r] + n)],
                           device=self.device)[None]
        last = torch.tensor(q).cumsum(0).sub(1).to(self.device)
        self.cache.begin_step(rows, q)
        logits = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=last,
                            **{self.cache_kw: self.cache}).logits[0]
        for r, n in zip(rows, q):
            self.lens[r] += n
        if self.sampling is None:
            return torch.argmax(logits, dim=-1).tolist()
        from arkernels.ops.sampling import sample

        params, seeds = self.sampling
        idx = torch.tensor(rows, device=seeds.device)
        for r, row in zip(rows, logits):
            self.logits[r].append(row)
        return sample(logits, **params, seed=seeds[idx], step=torch.tensor(steps, device=seeds.device)).tolist()

    def propose(self, rows: list[int], history: list[list[int]], room: list[int]) -> list[list[int]]:
        want = {r: min(self.k, m) for r, m in zip(rows, room)}
        drafts = {r: [] for r in rows}
        self.logits = {r: [] for r in rows}
        go = [r for r in rows if want[r] > 0]
        feeds = [self.pending[r] for r in go]
        while go:
            # a draft's token index in its row (the one-token loop's ``step``): emitted so far + drafts before it
            steps = [len(history[r]) - self.prompt_lens[r] + len(drafts[r]) for r in go]
            for r, t in zip(go, self._forward(go, feeds, steps)):
                drafts[r].append(t)
                self.pending[r] = []
            go = [r for r in go if len(drafts[r]) < want[r]]
            feeds = [[drafts[r][-1]] for r in go]
        return [drafts[r] for r in rows]

    def commit(self, rows: list[int], drafts: list[list[int]], emitted: list[list[int]]) -> None:
        """The target kept ``len(emitted) - 1`` drafts of each row and added one token: drafts the cache holds past
        them are dropped by length; what it has not seen waits in ``pending``."""
        for r, d, e in zip(rows, drafts, emitted):
            if not d:
                self.pending[r] += e
                continue
            seen = len(d) - 1  # the last draft was proposed, never fed
            keep = min(len(e) - 1, seen)
            self.lens[r] -= seen - keep
            self.cache.truncate_row(r, self.lens[r])
            self.pending[r] = e[keep:]

    def release(self, r: int) -> None:
        self.cache.release_row(r)

    def close(self) -> None:
        for r in range(len(self.lens)):
            self.cache.release_row(r)
        if self.model.config._attn_implementation != self.saved_attn:
            self.model.set_attn_implementation(self.saved_attn)
