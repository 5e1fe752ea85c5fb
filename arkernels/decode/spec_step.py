"""The static verification step of speculative decoding (``arkernels.generate(..., cuda_graphs=True | compile=True)``
with ``prompt_lookup_num_tokens`` or ``assistant_model``): a fixed ``q = k + 1`` query positions per row, the rows
padded up to a batch-size bucket, so the step has one shape per bucket and is captured (CUDA) or compiled once per
bucket like the one-token ``StaticDecode``.

A row with fewer than ``k`` drafts (prompt lookup found fewer, or ``max_new_tokens`` is near) fills its unused
positions with its last token: they are computed, never kept (acceptance stops at the row's draft count, and their
K/V are rolled back by length with the rejected drafts). Inside the step, every position is drawn as the one-token
loop draws that token (same seed, ``step`` = the token's index) and the accepted count (drafts kept while each equals
the draw at its position) is computed on the device; the host reads ``[n, q + 1]`` ints once per step. Token rules see, at each position, the row's history plus the drafts
before it (``_position_rules``), as in the eager verification. With
Leviathan / Chen acceptance (sampled drafts of a draft model) the step returns the logits instead and
``arkernels.decode.spec.verify_sampled`` accepts on them.
"""
from __future__ import annotations

import numpy as np
import torch

from arkernels.decode.step import StaticDecode, bucket

_ROW_FIELDS = 5  # per row after the ids and slots: seq_len after the step, cache row, seed, step, draft count


class SpecStep(StaticDecode):
    """Verification of ``k`` drafts per row as one static step.

    Per bucket ``b`` one int64 buffer ``[b, q * (1 + groups) + 5]`` holds every input, a row per batch row: the ``q``
    input ids (the last emitted token, then the drafts), the ``q`` slots of each cache group (-1: nothing written),
    then seq_len after the step, the cache row, the seed, the index of the row's next token and its draft count.
    Padding rows: ids 0, slots -1, draft count 0, seq_len ``q`` (the attention needs a row's queries inside its
    length): they read the first ``q`` keys of cache row 0's table (or the scratch block), nothing is written.
    """

    ahead = 0  # rejected drafts are rolled back every step: blocks reserved ahead would be returned at once

    def __init__(self, model, cache, cache_kw: str, batch: int, seeds: list[int], k: int, draw,
                 capture: bool = False, compile: bool = False, accept: bool = True, rules: dict | None = None):
        self.q = k + 1  # before the parent's init: allocate_host reads it
        super().__init__(model, cache, cache_kw, batch, seeds, draw, capture=capture, compile=compile)
        self.rules = rules  # token_rules' tensors (per cache row) or None
        self.accept = accept  # draw and accept in the step; False: return the logits (Leviathan / Chen on the host)
        self.offsets = torch.arange(self.q, device=self.device)
        self.cu: dict[int, torch.Tensor] = {}  # bucket -> int32 [b + 1]: 0, q, 2q, ...

    def allocate_host(self, batch: int, pin: bool) -> None:
        """One int64 plan ``[batch, width]`` (flat), two alternated, pinned on CUDA; the results come back through
        ``verify``'s one read, so no id buffers."""
        self.width = self.q * (1 + self.num_groups) + _ROW_FIELDS
        self.plans = [torch.empty(self.width * batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.ids = self.events = None

    def verify(self, rows: list[int], last: list[int], drafts: list[list[int]], lengths: list[int],
               steps: list[int]) -> torch.Tensor:
        """Rows ``rows`` (cache rows holding ``lengths`` tokens) fed their ``last`` token and ``drafts``; ``steps``:
        the index of each row's next token. Returns int64 ``[n, q + 1]`` on the device (each position's draw, then
        the accepted draft count), or (``accept=False``) the logits ``[n, q, V]``."""
        n, q = len(rows), self.q
        b = bucket(n, self.batch)
        slots = self.cache.begin_static_step(rows, ahead=self.ahead, tokens=q)
        k = self.plan_tick % 2
        self.plan_tick += 1
        plan = self.plans[k][: self.width * b].view(b, self.width)
        a = self.plans_np[k][: self.width * b].reshape(b, self.width)
        a[n:] = 0
        a[n:, q: q * (1 + self.num_groups)] = -1
        a[n:, -5] = q
        for i, (x, d) in enumerate(zip(last, drafts)):
            a[i, :q] = [x, *d] + [x] * (q - 1 - len(d))
        for g, s in enumerate(slots):
            a[:n, q * (1 + g): q * (2 + g)] = np.asarray(s, dtype=np.int64).reshape(n, q)
        a[:n, -5] = np.asarray(lengths, dtype=np.int64) + q
        a[:n, -4] = rows
        a[:n, -3] = self.seeds[rows]
        a[:n, -2] = steps
        a[:n, -1] = [len(d) for d in drafts]
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = torch.empty((b, self.width), dtype=torch.int64, device=self.device)
            self.cu[b] = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=self.device)
        buf.copy_(plan, non_blocking=True)
        out = self._replay(b) if self.capture else self.run(b)
        return out[:n]

    def _forward(self, b: int) -> torch.Tensor:
        """The static verification of bucket ``b`` (what a CUDA graph captures)."""
        buf, q, G = self.buffers[b], self.q, self.num_groups
        ids, seq_lens, row = buf[:, :q], buf[:, -5], buf[:, -4]
        pos = (seq_lens - q)[:, None] + self.offsets  # padding rows: positions 0..q-1, never kept
        slots = [buf[:, q * (1 + g): q * (2 + g)].reshape(-1) for g in range(G)]
        self.cache.set_static_step(row, seq_lens.to(torch.int32), slots, self.cu[b], q)
        logits = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                            **{self.cache_kw: self.cache}).logits  # [b, q, V]
        if not self.accept:
            return logits
        seeds = buf[:, -3].repeat_interleave(q)
        steps = (buf[:, -2:-1] + self.offsets).reshape(-1)
        draws = self.draw(logits.reshape(b * q, -1), seeds, steps, self._position_rules(row, ids)).view(b, q)
        kept = (draws[:, :-1] == ids[:, 1:]) & (self.offsets[:-1] < buf[:, -1:])
        accepted = kept.to(torch.int64).cumprod(1).sum(1)
        return torch.cat([draws, accepted[:, None]], 1)

    def _position_rules(self, row: torch.Tensor, ids: torch.Tensor) -> dict | None:
        """The token rules of each of the ``b * q`` positions: its row's tensors, with a history (``token_state``, a
        copy: a replay recomputes it) that also counts the drafts before the position, as the one-token loop's
        history holds them when it draws that token. Tensor ops only (captured / compiled with the step)."""
        if self.rules is None:
            return None
        from arkernels.ops.sampling import update_token_state

        q = self.q
        owners = row.repeat_interleave(q)
        out = {n: (v[owners] if isinstance(v, torch.Tensor) else v) for n, v in self.rules.items()}
        base = torch.arange(0, row.shape[0] * q, q, device=row.device)[:, None]
        for j in range(q - 1):  # draft j (input j + 1) is in the history of positions j + 1 .. q - 1 of its row
            later = (base + self.offsets[j + 1:]).reshape(-1)
            update_token_state(out["token_state"], ids[:, j + 1].repeat_interleave(q - 1 - j), later)
        return out
