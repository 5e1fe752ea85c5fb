"""The sampler hook of ``arkernels.patch``: ``wrap_logits_processor``, an instance attribute over
``_get_logits_processor`` (by default for sampling calls on CUDA only, see ``patch``'s ``sampler``).

For plain sampling (``do_sample=True``, one beam, no assistant, no ``output_scores``) whose warpers are exactly a
trailing run of temperature / top-k / top-p / min-p (transformers' order, ``min_tokens_to_keep`` 1) with values the
fused sampler reproduces exactly (``_fusable``: not ``top_p=0``, not a temperature below 2**-100), those warpers are
replaced by one processor (``ArkernelsSampler``) that draws with ``arkernels.sample`` and hands generate a one-hot
distribution (so its own multinomial returns exactly our draw). Anything else (other warpers, a processor after
them, beams, assisted decoding, ``output_scores``, those values) keeps the stock warpers for that call. When every
processor ahead of them (or, for greedy decoding, every processor) is one of the token rules the sampler implements
(``_fused_rules``: repetition penalty, one-token ``sequence_bias`` / ``bad_words_ids``, ``min_new_tokens``,
``suppress_tokens``), those are fused into the same draw too, in transformers' order; otherwise they run as stock
processors before our draw (sampling) or the call stays stock (greedy).
"""
from __future__ import annotations

import inspect
import math

import torch


class ArkernelsSampler:
    """A logits processor that draws the next token with ``arkernels.sample`` and returns a one-hot score row.

    The draw of a row depends only on (its logits, the parameters, the seed, the step): the seed is taken from
    torch's global generator when generate starts, so ``torch.manual_seed`` makes runs reproducible. ``rules``
    (``_HFRules``): transformers' token-rule processors this draw replaces. ``ArkernelsSampler.calls`` counts the
    draws made (all instances; tests read it to see the fused sampler ran).
    """

    calls = 0

    def __init__(self, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, rules=None):
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.seed, self.step, self.rules = seed, 0, rules
        self.seeds = None  # per-row seeds, built at the first call

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from arkernels.ops.sampling import sample

        kw = self.rules.kwargs(input_ids, scores) if self.rules is not None else {}
        batch = scores.shape[0]
        if self.seeds is None or self.seeds.shape[0] != batch or self.seeds.device != scores.device:
            # row r draws with seed + r * stride (arkernels.generate's stream per sample): the rows of
            # num_return_sequences share their logits, and one seed for all would make them identical samples
            from arkernels.ops.sampling import seed_stream

            self.seeds = torch.tensor(seed_stream(self.seed, batch), dtype=torch.int64, device=scores.device)
        ids = sample(scores, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                     seed=self.seeds, step=self.step, **kw)
        self.step += 1
        ArkernelsSampler.calls += 1
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, ids.view(-1, 1).to(torch.int64), 0.0)
        return out


# Below this temperature stock's ``scores / T`` can overflow fp32 (|logit| > T * 3.4e38 ~ 2.7e8 at T = 2**-100) and
# stock then fails in its multinomial; above it both give the same kept sets (only the argmax survives long before).
_MIN_FUSED_TEMPERATURE = 2.0**-100
_INT32_MAX = 2**31 - 1


def _fused_params(processors) -> tuple[int, dict] | None:
    """``(first, params)`` when the processors end with a run of temperature / top-k / top-p / min-p warpers in
    transformers' order, each at most once and keeping at least one token (what ``arkernels.sample`` implements);
    ``first`` is where that run starts. None when anything else would run among or after them, or when a value is
    one transformers accepts but the fused sampler does not reproduce exactly (``_fusable``): stock's warpers then
    serve the call."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    order = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    first, rank = len(processors), len(order)
    for i in range(len(processors) - 1, -1, -1):
        p = processors[i]
        r = next((j for j, cls in enumerate(order) if type(p) is cls), None)
        if r is None:
            break
        if r >= rank or getattr(p, "min_tokens_to_keep", 1) != 1:
            return None  # out of order, repeated, or keeping more than one token
        if isinstance(p, TemperatureLogitsWarper):
            params["temperature"] = float(p.temperature)
        elif isinstance(p, TopKLogitsWarper):
            params["top_k"] = int(p.top_k)
        elif isinstance(p, TopPLogitsWarper):
            params["top_p"] = float(p.top_p)
        else:
            params["min_p"] = float(p.min_p)
        first, rank = i, r
    if any(isinstance(p, order) for p in processors[:first]):
        return None  # one of ours runs before another processor: the fused sampler cannot move it
    if not _fusable(**params):
        return None
    params["top_k"] = min(params["top_k"], _INT32_MAX)  # stock clamps top_k to the vocab: past it, both are "off"
    return first, params


def _fusable(temperature: float, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether the fused sampler gives stock's kept set for these warper values (the ones transformers' warpers
    accept; anything they refuse has raised already, before this hook sees it).

    - ``top_p`` 0 (``TopPLogitsWarper`` takes [0, 1]): stock keeps exactly one token (the last of its ascending sort);
      ``arkernels.sample`` takes ``(0, 1]``. (A NaN ``top_p`` gets no warper from transformers: ``nan < 1`` is False.)
    - ``temperature`` below ``_MIN_FUSED_TEMPERATURE`` or infinite: stock's division overflows or turns ``-inf``
      scores into NaN; its own behaviour (an error from multinomial) is the contract.
    - ``top_k`` < 0 or ``min_p`` outside [0, 1] cannot reach here (stock refuses them), checked anyway."""
    return (math.isfinite(temperature) and temperature >= _MIN_FUSED_TEMPERATURE and top_k >= 0
            and 0.0 < top_p <= 1.0 and 0.0 <= min_p <= 1.0)


class _HFRules:
    """transformers' token-rule processors of one generate call as the fused sampler's arguments: the token history
    (``arkernels.token_state``, int32 ``[batch, vocab]``) is built from ``input_ids`` at the first step (positions
    before the repetition processor's ``prompt_ignore_length`` left out, as it leaves them out) and each later
    step adds the columns ``input_ids`` grew by, on the device."""

    def __init__(self, processors, repetition, ignore, bias: dict, banned: list, suppressed: list, eos: list,
                 min_len: int):
        self.processors = processors  # the stock processors replaced (they raise stock's errors on bad ids)
        self.repetition, self.ignore, self.bias, self.banned = repetition, ignore, bias, banned
        self.suppressed = suppressed  # suppress_tokens: ids outside the vocabulary suppress nothing (stock's isin)
        self.eos, self.min_len = eos, min_len  # EOS masked while input_ids is shorter than min_len
        self.state = self.table = None
        self.seen = 0

    def kwargs(self, input_ids: torch.Tensor, scores: torch.Tensor) -> dict:
        from arkernels.ops.sampling import logit_bias_table, token_state, update_token_state
        from arkernels.token_state_layout import PROMPT_BIT

        batch, vocab = scores.shape
        if self.state is None:
            ids = [t for t in list(self.bias) + self.banned]
            if any(not 0 <= t < vocab for t in ids) or bool(((input_ids < 0) | (input_ids >= vocab)).any()):
                for p in self.processors:  # transformers' own error for ids outside the vocabulary
                    p(input_ids, scores.clone())
            # stock's min-length and suppress processors match ids against the vocabulary (isin): an EOS id of -1
            # (generate warns and runs) or one past the vocabulary masks nothing
            banned = self.banned + [t for t in self.suppressed if 0 <= t < vocab]
            eos = [t for t in self.eos if 0 <= t < vocab]
            st = token_state([[]] * batch, vocab, banned=banned or None, eos_token_id=eos or None,
                             device=scores.device)
            keep = torch.ones_like(input_ids, dtype=torch.bool)
            if self.ignore is not None:
                pos = torch.arange(input_ids.shape[1], device=input_ids.device)
                ignore = torch.as_tensor(self.ignore, device=input_ids.device).reshape(-1, 1)
                keep = (pos[None, :] >= ignore).expand_as(input_ids)  # an int ignore: one row for all
            rows = torch.arange(batch, device=input_ids.device)[:, None].expand_as(input_ids)
            st[rows[keep], input_ids[keep]] |= PROMPT_BIT
            self.state = st
            if self.bias:
                self.table = logit_bias_table([self.bias] * batch, vocab, device=scores.device)
        else:
            for j in range(self.seen, input_ids.shape[1]):  # normally one column: the last step's tokens
                update_token_state(self.state, input_ids[:, j])
        self.seen = input_ids.shape[1]
        return dict(token_state=self.state, logit_bias=self.table,
                    repetition_penalty=1.0 if self.repetition is None else self.repetition,
                    new_tokens=input_ids.shape[1], min_new_tokens=self.min_len)


def _fused_rules(processors):
    """``_HFRules`` when every processor is a token rule the sampler implements and their order gives transformers'
    results (finite biases before the repetition penalty; bans and masks commute with both), else None."""
    from transformers.generation.logits_process import (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                                                        NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor, SuppressTokensLogitsProcessor)

    if not processors:
        return None
    repetition, ignore, bias, banned, suppressed, eos, min_len = None, None, {}, [], [], None, 0
    for p in processors:
        kind = type(p)
        if kind is RepetitionPenaltyLogitsProcessor and repetition is None:
            if not (isinstance(p.penalty, float) and 0 < p.penalty < math.inf):
                return None
            repetition, ignore = p.penalty, p.prompt_ignore_length
        elif kind in (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor):
            items = dict(p.sequence_bias).items()
            if any(len(k) != 1 for k, _ in items):
                return None  # multi-token sequences: stock
            for (t,), v in items:
                v = float(v)
                if v == -math.inf:
                    banned.append(int(t))
                elif math.isfinite(v) and repetition is None:
                    bias[int(t)] = bias.get(int(t), 0.0) + v
                else:
                    return None  # +inf / NaN, or a bias after the repetition penalty
        elif kind in (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor):
            # both mask the EOS ids while input_ids is shorter than a length: min_length, or the prompt length +
            # min_new_tokens; together, the longer of the two
            ids = sorted({int(t) for t in torch.as_tensor(p.eos_token_id).reshape(-1).tolist()})
            if eos is not None and ids != eos:
                return None
            eos = ids
            n = (int(p.min_length) if kind is MinLengthLogitsProcessor
                 else int(p.prompt_length_to_skip) + int(p.min_new_tokens))
            min_len = max(min_len, n)
        elif kind is SuppressTokensLogitsProcessor:
            suppressed += [int(t) for t in p.suppress_tokens.reshape(-1).tolist()]
        else:
            return None
    return _HFRules(list(processors), repetition, ignore, bias, banned, suppressed, eos or [], min_len)


def sampler_serves(sampler: bool | str, do_sample: bool, device) -> bool:
    """Whether the fused draw may replace this call's processors: ``sampler=True`` always (where exact), "auto" only
    for sampling on a CUDA device (see ``patch``)."""
    if sampler == "auto":
        return bool(do_sample) and device is not None and torch.device(device).type == "cuda"
    return bool(sampler)


def wrap_logits_processor(original, state: dict, sampler: bool | str = True):
    signature = inspect.signature(original)

    def _get_logits_processor(*args, **kwargs):
        processors = original(*args, **kwargs)
        if state["stock"]:
            return processors  # a call served as the unpatched model (arkernels.hf.stock_call)
        bound = signature.bind(*args, **kwargs).arguments
        config = bound["generation_config"]
        device = bound.get("device") or getattr(getattr(original, "__self__", None), "device", None)
        if not sampler_serves(sampler, config.do_sample, device):
            return processors
        # only plain sampling / greedy: beams draw several candidates from the warped scores, assisted decoding
        # compares distributions, output_scores returns the warped scores: a one-hot row would change all three
        if (state.get("mode") not in (None, "sample", "greedy_search") or (config.num_beams or 1) != 1
                or config.output_scores):
            return processors
        if config.do_sample:
            fused = _fused_params(processors)
            if fused is None:
                return processors
            first, params = fused
        else:
            first, params = len(processors), dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
        rules = _fused_rules(processors[:first])
        if rules is None and not config.do_sample:
            return processors  # greedy with nothing to fuse (or something we do not implement): stock
        kept = type(processors)(processors[:first] if rules is None else [])
        # greedy takes no seed (and so leaves torch's generator as stock leaves it)
        seed = int(torch.randint(0, 2**62, (1,)).item()) if config.do_sample else 0
        kept.append(ArkernelsSampler(**params, seed=seed, rules=rules))
        return kept

    return _get_logits_processor
