"""What ``arkernels.generate`` returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateResult:
    """``tokens[b]``: the new token ids of prompt ``b`` (EOS included when emitted); ``texts[b]`` their decoded text
    when a tokenizer was given; ``prompt_lens[b]``; timings in seconds; ``decode_tokens``: tokens produced by the
    decode steps (the first token of each row comes from prefill)."""

    tokens: list[list[int]]
    texts: list[str] | None
    prompt_lens: list[int]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    finished_by_eos: list[bool] = field(default_factory=list)
    cache_blocks_in_use: dict[int, int] = field(default_factory=dict)  # per cache group after the call: all 0
    logprobs: list[list["TokenLogprobs"]] | None = None  # with generate(logprobs=n): one per token of tokens[b]
    # with prompt_lookup_num_tokens: per row, draft tokens proposed and accepted (empty lists otherwise)
    proposed_tokens: list[int] = field(default_factory=list)
    accepted_tokens: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class TokenLogprobs:
    """One generated token's logprobs (``generate(logprobs=n)``): the chosen ``token``, its ``logprob`` and vLLM's
    ``rank`` (how many tokens have a logprob >= its own), and ``top``: the ``n`` most likely ``(id, logprob, rank)``,
    rank ``j + 1`` for entry ``j``, equal logprobs ordered by lowest id first."""

    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float, int]]
