"""arkernels' own decode loop over a transformers model: ragged prompts, one paged cache, the fused sampler.

Prefill packs every prompt into one ``[1, sum(prompt_lens)]`` row (no padding waste: each sequence owns exactly
its blocks), with per-sequence positions and ``cu_seqlens_q`` for the attention kernel; decode runs the still
active rows as ``[rows, 1]``. A row that emits EOS (or reaches ``max_new_tokens``) leaves the batch and its blocks
go back to the pool at once. Row ``b``'s draw at step ``t`` depends only on (its logits, the sampling parameters,
``seed[b]``, ``t``): the same prompt and seed give the same text whatever else is in the batch.

``cuda_graphs=True`` runs decode as a static step (``_StaticDecode``): the active rows are padded up to a batch-size
bucket (1, 2, 4, 8, ... capped at the batch) and every input of the step lives in one preallocated buffer per bucket,
filled by one copy before the step; on a GPU the step is captured in a CUDA graph once per bucket and replayed.
``compile=True`` runs that step under ``torch.compile`` (one graph per bucket), captured as above on a GPU.
"""
from __future__ import annotations

import inspect
import math
import numbers
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch


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


def _is_int(v) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an int to Python, never a token id or seed here)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _pad_id(model, tokenizer) -> int | None:
    """The pad id a padded batch would hold: the tokenizer's, else the model's generation config, else its config."""
    for src in (tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None)):
        pad = getattr(src, "pad_token_id", None)
        if _is_int(pad):
            return int(pad)
    return None


def _as_prompts(x, tokenizer, *, input_ids=None, attention_mask=None, token_type_ids=None, pad_id: int | None = None,
                bos_id: int | None = None, vocab_size: int | None = None) -> list[list[int]]:
    """Every input form ``generate`` takes -> one list of token ids per prompt, validated.

    ``x`` (the positional argument) or ``input_ids=``: a str or list of str (encoded with ``tokenizer``), a list of
    token-id lists or 1-D tensors (ragged), an integer tensor ``[batch, len]`` / ``[len]``, or a mapping with
    ``input_ids`` (and ``attention_mask``), e.g. a tokenizer's ``BatchEncoding``. With ``attention_mask`` (same shape
    as the ids, 0/1) each row keeps the tokens its mask marks: left or right padding is stripped per row, which gives
    the same attention and positions as stock ``model.generate`` with that mask (it numbers positions by the mask's
    cumulative sum). Without a mask, a tensor whose rows visibly start with ``pad_id`` is refused: those pads would
    be generated from as prompt tokens. Every id must lie in ``[0, vocab_size)``.
    """
    if isinstance(x, Mapping):
        unknown = sorted(set(x) - {"input_ids", "attention_mask", "token_type_ids"})
        if unknown:
            raise ValueError(f"generate: the inputs mapping has keys arkernels.generate does not take: {unknown} "
                             "(it takes input_ids, attention_mask, token_type_ids)")
        if "input_ids" not in x:
            raise ValueError("generate: the inputs mapping has no 'input_ids'")
        if input_ids is not None or attention_mask is not None:
            raise ValueError("generate: pass the inputs either as a mapping or as input_ids= / attention_mask=, "
                             "not both")
        x, attention_mask, token_type_ids = x["input_ids"], x.get("attention_mask"), x.get("token_type_ids")
    elif input_ids is not None:
        if x is not None:
            raise ValueError("generate: pass the prompts positionally or as input_ids=, not both")
        x = input_ids
    if x is None:
        raise ValueError("generate: no prompts: pass a str, a list of str (with tokenizer=), token-id lists, an "
                         "input_ids tensor, or a tokenizer's output")
    if token_type_ids is not None and bool(torch.as_tensor(token_type_ids).ne(0).any()):
        raise ValueError("generate: token_type_ids other than all zeros are not supported (a decoder-only model "
                         "takes one segment)")
    if isinstance(x, str):
        x = [x]
    if isinstance(x, Sequence) and len(x) > 0 and all(isinstance(p, str) for p in x):
        if tokenizer is None:
            raise ValueError("generate: text prompts need tokenizer=")
        if attention_mask is not None:
            raise ValueError("generate: attention_mask goes with token ids, not with text prompts")
        prompts = [tokenizer(p)["input_ids"] for p in x]
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} ({x[i]!r}) encodes to no tokens")
    elif attention_mask is not None:
        prompts = _strip_by_mask(x, attention_mask)
    elif isinstance(x, torch.Tensor):
        ids = _ids_tensor(x)
        _refuse_unmasked_padding(ids, pad_id, bos_id)
        prompts = ids.tolist()
    else:
        if not isinstance(x, Sequence) or len(x) == 0:
            what = "an empty list" if isinstance(x, Sequence) else type(x).__name__
            raise ValueError("generate: pass a non-empty list of prompts (str, needs tokenizer) or of token-id lists, "
                             f"got {what}")
        prompts = []
        for i, p in enumerate(x):
            if isinstance(p, torch.Tensor):
                if p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
                    raise ValueError(f"generate: prompt {i} must be a 1-D integer tensor, got "
                                     f"{tuple(p.shape)} {p.dtype}")
                p = p.tolist()
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not all(_is_int(t) for t in p):
                raise ValueError(f"generate: prompt {i} must be a list of int token ids (or every prompt a str), "
                                 f"got {type(p).__name__}")
            prompts.append([int(t) for t in p])
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty: every prompt needs at least one token")
        if vocab_size is not None:
            bad = next((t for t in p if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"generate: prompt {i} holds token id {bad}, outside the model's vocabulary "
                                 f"[0, {vocab_size})")
    return prompts


def _ids_tensor(x) -> torch.Tensor:
    """``input_ids`` as an integer ``[batch, len]`` tensor with at least one row and one column."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (ValueError, TypeError, RuntimeError) as e:  # ragged lists: no tensor, so no mask can go with them
            raise ValueError(f"generate: input_ids with an attention_mask must be rectangular ({e})") from None
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 2 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"generate: input_ids must be an integer [batch, len] or [len] tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"generate: input_ids is empty (shape {tuple(x.shape)}): every prompt needs at least one "
                         "token")
    return x


def _strip_by_mask(x, attention_mask) -> list[list[int]]:
    ids = _ids_tensor(x)
    mask = torch.as_tensor(attention_mask)
    if mask.dim() == 1:
        mask = mask[None]
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"generate: attention_mask must have input_ids' shape {tuple(ids.shape)}, got "
                         f"{tuple(mask.shape)}")
    mask = mask.cpu()
    if mask.dtype.is_floating_point or mask.dtype.is_complex or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("generate: attention_mask must hold only 0 (padding) and 1 (token)")
    mask = mask.bool()
    empty = (~mask.any(dim=1)).nonzero()
    if empty.numel():
        raise ValueError(f"generate: attention_mask row {int(empty[0, 0])} is all zeros: every prompt needs at "
                         "least one token")
    ids = ids.cpu()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def _refuse_unmasked_padding(ids: torch.Tensor, pad_id: int | None, bos_id: int | None) -> None:
    """Refuse a tensor that visibly starts with padding: some row's first token is the pad id (and, where the pad id
    is also the BOS id, its second one too: one BOS is a normal start)."""
    if pad_id is None or ids.shape[1] == 0:
        return
    ids = ids.cpu()
    padded = ids[:, 0] == pad_id
    if pad_id == bos_id:
        padded &= (ids[:, 1] == pad_id) if ids.shape[1] > 1 else torch.zeros_like(padded)
    rows = padded.nonzero()
    if rows.numel():
        raise ValueError(f"generate: input_ids row {int(rows[0, 0])} starts with the pad token id {pad_id}: a left-"
                         "padded batch needs its attention_mask (pass attention_mask=, or the tokenizer's whole "
                         "output: generate(model, **tokenizer(prompts, return_tensors='pt', padding=True)))")


def _per_prompt(name, v, n: int, kind) -> list:
    """A number or one per prompt -> a list of ``n`` values of ``kind`` (int or float; bools refused)."""
    values = list(v) if isinstance(v, (list, tuple)) else [v]
    ok = (lambda x: _is_int(x)) if kind is int else (lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool))
    if not values or not all(ok(x) for x in values) or len(values) not in (1, n):
        raise ValueError(f"generate: {name} must be {'an int' if kind is int else 'a number'} or one per prompt ({n}), "
                         f"got {v!r}")
    return [kind(x) for x in values] * (n if len(values) == 1 else 1)


def _token_rules(model, prompts, n_seq, eos, device, *, repetition_penalty, frequency_penalty, presence_penalty,
                 min_new_tokens, logit_bias, bad_words_ids, suppress_tokens):
    """The token rules of a generate call: None when every rule is off, else the keyword arguments of
    ``arkernels.sample`` for all ``len(prompts) * n_seq`` rows (history row ``b * n_seq + j``: each returned
    sequence forks its prompt's table row), plus the per-row value tensors ``generate`` gathers each step."""
    from arkernels.ops.sampling import logit_bias_table, token_state

    P = len(prompts)
    rp = _per_prompt("repetition_penalty", repetition_penalty, P, float)
    fq = _per_prompt("frequency_penalty", frequency_penalty, P, float)
    pr = _per_prompt("presence_penalty", presence_penalty, P, float)
    mn = _per_prompt("min_new_tokens", min_new_tokens, P, int)
    if any(not (v > 0 and math.isfinite(v)) for v in rp):
        raise ValueError(f"generate: repetition_penalty must be > 0 and finite, got {repetition_penalty!r}")
    if any(not math.isfinite(v) for v in fq + pr):
        raise ValueError("generate: frequency_penalty and presence_penalty must be finite")
    if any(v < 0 for v in mn):
        raise ValueError(f"generate: min_new_tokens must be >= 0, got {min_new_tokens!r}")
    banned = []
    if bad_words_ids is not None:
        if not isinstance(bad_words_ids, (list, tuple)) or not all(
                isinstance(w, (list, tuple)) and len(w) >= 1 and all(_is_int(t) for t in w) for w in bad_words_ids):
            raise ValueError(f"generate: bad_words_ids must be a list of token-id lists, got {bad_words_ids!r}")
        long = [w for w in bad_words_ids if len(w) > 1]
        if long:
            raise ValueError(f"generate: bad_words_ids takes single tokens only (got {list(long[0])}); multi-token "
                             "bad words run in patched model.generate, with transformers' processor")
        banned += [int(w[0]) for w in bad_words_ids if int(w[0]) not in eos]  # transformers never bans an EOS id
    if suppress_tokens is not None:
        if not isinstance(suppress_tokens, (list, tuple)) or not all(_is_int(t) for t in suppress_tokens):
            raise ValueError(f"generate: suppress_tokens must be a list of token ids, got {suppress_tokens!r}")
        banned += [int(t) for t in suppress_tokens]
    biases = None
    if logit_bias is not None:
        biases = [logit_bias] * P if isinstance(logit_bias, Mapping) else list(logit_bias)
        if len(biases) != P or not all(b is None or isinstance(b, Mapping) for b in biases):
            raise ValueError(f"generate: logit_bias must be a {{token_id: bias}} dict or one per prompt ({P})")
    if (all(v == 1.0 for v in rp) and not any(fq) and not any(pr) and not any(mn) and not banned
            and not any(biases or [])):
        return None
    vocab = _vocab_size(model)
    rows = [p for p in prompts for _ in range(n_seq)]
    state = token_state(rows, vocab, banned=banned or None,
                        eos_token_id=sorted(eos) if eos and any(mn) else None).to(device)
    bias = None
    if biases is not None and any(biases):
        try:
            bias = logit_bias_table([b for b in biases for _ in range(n_seq)], vocab).to(device)
        except ValueError as e:
            raise ValueError(f"generate: logit_bias: {e}") from None
    rep_n = lambda v: torch.tensor(v, device=device).repeat_interleave(n_seq)  # noqa: E731
    return dict(token_state=state, logit_bias=bias, repetition_penalty=rep_n(rp), frequency_penalty=rep_n(fq),
                presence_penalty=rep_n(pr), min_new_tokens=rep_n(mn))


def _check_args(*, max_new_tokens, num_return_sequences, block_size, temperature, top_k, top_p, min_p, stream):
    """Every scalar argument of ``generate`` checked before any model work (one ValueError naming the argument)."""
    from arkernels.ops.sampling import _params

    for name, v, lo in (("max_new_tokens", max_new_tokens, 0), ("num_return_sequences", num_return_sequences, 1),
                        ("block_size", block_size, 1)):
        if not _is_int(v) or v < lo:
            raise ValueError(f"generate: {name} must be an int >= {lo}, got {v!r}")
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise ValueError(f"generate: {name} must be a number, got {v!r}")
    if not _is_int(top_k):
        raise ValueError(f"generate: top_k must be an int (0: off), got {top_k!r}")
    # the sampler's own range rules, on a one-row stand-in (so its words and generate's agree)
    _params("generate", torch.zeros(1, 1), float(temperature), int(top_k), float(top_p), float(min_p))
    if stream is not None and not callable(stream):
        raise ValueError(f"generate: stream must be a callable stream(row, token_id) or None, got {stream!r}")


def _seeds(seed, n: int) -> torch.Tensor:
    """``seed`` (an int, one int per prompt, or an integer tensor) as int64 ``[n]``; floats and bools are refused
    (``torch.as_tensor(1.5, dtype=torch.int64)`` would silently truncate to 1)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype.is_floating_point or seed.dtype.is_complex or seed.dtype == torch.bool:
            raise ValueError(f"generate: seed must be an int, a list of ints or an integer tensor, got a {seed.dtype} "
                             "tensor")
        seeds = seed.to(torch.int64).reshape(-1).cpu()
    else:
        values = list(seed) if isinstance(seed, Sequence) and not isinstance(seed, str) else [seed]
        bad = next((v for v in values if not _is_int(v) or not -2**63 <= v < 2**63), None)
        if bad is not None or not values:
            raise ValueError(f"generate: seed must be an int64 or a list of them, got {seed!r}")
        seeds = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if seeds.numel() == 1:
        seeds = seeds.expand(n)
    if seeds.numel() != n:
        raise ValueError(f"generate: seed must be an int or one per prompt ({n}), got {seeds.numel()}")
    return seeds


def _vocab_size(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    return n if n is not None else getattr(model.config.get_text_config(), "vocab_size", None)


def _warn_past_max_positions(model, length: int) -> None:
    """Stock generate's reminder (``MaxLengthCriteria``) when a row would run past ``max_position_embeddings``; said
    once up front, since the lengths are known before the prefill."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and length > limit:
        warnings.warn(f"generate: prompt + max_new_tokens reaches {length} tokens, past the model's predefined maximum "
                      f"length (max_position_embeddings={limit}); depending on the model you may observe "
                      "exceptions, performance degradation, or nothing at all", stacklevel=3)


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def generate(model, prompts_or_input_ids=None, *, input_ids=None, attention_mask=None, token_type_ids=None,
             max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int | Sequence[int] | torch.Tensor = 0,
             eos_token_id: int | Sequence[int] | None = None, tokenizer=None,
             stream: Callable[[int, int], None] | None = None, cuda_graphs: bool = False,
             block_size: int = 16, num_return_sequences: int = 1, compile: bool = False,
             kv_cache_dtype: str | torch.dtype = "auto", k_scale: float | Sequence[float] | None = None,
             v_scale: float | Sequence[float] | None = None, repetition_penalty: float | Sequence[float] = 1.0,
             frequency_penalty: float | Sequence[float] = 0.0, presence_penalty: float | Sequence[float] = 0.0,
             min_new_tokens: int | Sequence[int] = 0, logit_bias: Mapping[int, float] | Sequence | None = None,
             bad_words_ids: Sequence[Sequence[int]] | None = None, suppress_tokens: Sequence[int] | None = None,
             logprobs: int | None = None, logprobs_mode: str = "raw") -> GenerateResult:
    """Generate from ragged prompts with a paged cache and the fused sampler.

    Args:
        model: a transformers decoder ``arkernels.patch`` accepts (``arkernels.hf.capability.check_model``; its
            attention is switched to arkernels' for the call and restored afterwards).
        prompts_or_input_ids: a str or list of str (needs ``tokenizer``), a list of token-id lists or 1-D tensors
            (ragged), an integer tensor ``[batch, len]`` / ``[len]``, or a tokenizer's output (``BatchEncoding`` or
            dict with ``input_ids`` and ``attention_mask``). A tensor whose rows start with the pad id is refused
            without a mask (the pads would be prompt tokens).
        input_ids, attention_mask: the transformers way, e.g. ``generate(model, **tokenizer(prompts,
            return_tensors="pt", padding=True))``: each row keeps the tokens its mask marks (left or right padding
            stripped per row; the same tokens as stock ``model.generate`` with that mask). ``token_type_ids`` (what
            some tokenizers add) must be all zeros.
        max_new_tokens: new tokens per row at most.
        temperature, top_k, top_p, min_p: sampling (``arkernels.sample``); temperature 0 (default) is greedy.
        seed: one int for every prompt or one per prompt (list of ints / integer tensor ``[batch]``); floats are
            refused, not truncated.
        eos_token_id: an id or ids that end a row (default: the model's generation config, then the tokenizer's).
        tokenizer: decodes ``texts`` and encodes text prompts.
        stream: called as ``stream(row, token_id)`` for every new token, in order.
        cuda_graphs: run decode as a static step over preallocated buffers, padded to a batch-size bucket; on a
            CUDA model each bucket's step is captured in a CUDA graph on first use and replayed (the first step of
            a bucket runs 2 eager warm-ups before the capture). On any other device the same static step runs
            eagerly, without capture (token-identical to the default path; the CPU tests check that).
        block_size: tokens per cache block.
        num_return_sequences: samples per prompt. Each prompt is prefilled once; its samples fork its blocks
            (reference counts: no K/V copied, except each sample's copy of a shared, partly filled last block when it
            first writes). Result row ``b * n + j`` is sample ``j`` of prompt ``b``; it draws with seed
            ``seed[b] + j * 0x9E3779B97F4A7C15`` (int64, wrapping), so sample 0 is what ``num_return_sequences=1``
            gives and every sample has its own random stream.
        compile: run the static decode step (implies ``cuda_graphs=True``) under ``torch.compile`` (Inductor, no
            dynamic shapes): one compile per batch-size bucket, reused across steps, lengths and calls with the same
            model; on CUDA the compiled step is then captured per bucket as above, elsewhere it runs uncaptured.
            Off by default: token-identical to ``compile=False`` on the CPU (tests), untested on a GPU so far.
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" (float8_e4m3fn K/V, a K and a V scale per layer).
        k_scale, v_scale: fp8 only: a float, one per layer, or None: calibrated per layer on the prefill
            (K: ``max(absmax / 200, 1e-6)``, V: ``/ 100``, vLLM's defaults; see ``arkernels.hf.cache.PagedCache``).
        repetition_penalty, frequency_penalty, presence_penalty, min_new_tokens: a number or one per prompt; the
            token rules of ``arkernels.sample`` (transformers' repetition rule over prompt + generated tokens;
            vLLM's frequency / presence rule over generated tokens; EOS masked until the row has
            ``min_new_tokens`` new tokens), run inside the fused sampler's passes from a device-side token history
            (int32, 4 * vocab bytes per row), updated on the device after each draw (no host sync); the samples of
            ``num_return_sequences`` fork their prompt's history. They apply to greedy rows too.
        logit_bias: ``{token_id: bias}`` for every prompt or one dict per prompt (``-inf`` bans); a table of
            4 * vocab bytes per row.
        bad_words_ids: transformers' form, single tokens only (``[[id], ...]``; an EOS id is never banned, as in
            transformers); suppress_tokens: ids banned in every row.
        logprobs: None (off) or ``n >= 0``: ``result.logprobs[b][i]`` is a ``TokenLogprobs`` for token ``i`` of row
            ``b``: its logprob, rank and the top ``n``. ``logprobs_mode`` (vLLM's meanings): "raw" (log_softmax of
            the model's logits, before any rule), or "processed" (the log of the distribution the row draws from:
            rules, temperature, top-k / top-p / min-p; a greedy row's is one-hot). An extra full-vocabulary pass per
            step (not fused into the sampler), on the eager decode path only (``cuda_graphs=False``).

    Every argument is checked before the prefill runs (a ValueError naming it; TypeError for a model dtype the
    kernels do not take). A prompt + ``max_new_tokens`` past ``max_position_embeddings`` warns, as stock does.

    Returns:
        ``GenerateResult`` (``tokens``, ``texts``, timings), one row per returned sequence.
    """
    from arkernels.hf.attention import NAME, register
    from arkernels.hf.cache import PagedCache
    from arkernels.hf.capability import check_model
    from arkernels.hf.patch import _check_model_tensors
    from arkernels.ops.sampling import sample

    check_model(model, "arkernels.generate")
    _check_model_tensors(model, "generate")
    _check_args(max_new_tokens=max_new_tokens, num_return_sequences=num_return_sequences, block_size=block_size,
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stream=stream)
    pad_id = _pad_id(model, tokenizer)
    # composite configs (Gemma 3, Fuyu: a text config inside) keep the token ids on the text config
    bos_id = (getattr(tokenizer, "bos_token_id", None) if tokenizer is not None
              else getattr(model.config.get_text_config(decoder=True), "bos_token_id", None))
    prompts = _as_prompts(prompts_or_input_ids, tokenizer, input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids, pad_id=pad_id, bos_id=bos_id, vocab_size=_vocab_size(model))
    cuda_graphs = cuda_graphs or compile
    n_seq = num_return_sequences
    P = len(prompts)
    B = P * n_seq
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer, eos_token_id)
    seeds = _seeds(seed, P)
    _warn_past_max_positions(model, max(len(p) for p in prompts) + max_new_tokens)
    if logprobs is not None and (not _is_int(logprobs) or logprobs < 0):
        raise ValueError(f"generate: logprobs must be None or an int >= 0, got {logprobs!r}")
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"generate: logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
    if logprobs is not None and cuda_graphs:
        raise ValueError("generate: logprobs= runs on the eager decode path (cuda_graphs=False, compile=False)")
    rules = _token_rules(model, prompts, n_seq, eos, device, repetition_penalty=repetition_penalty,
                         frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                         min_new_tokens=min_new_tokens, logit_bias=logit_bias, bad_words_ids=bad_words_ids,
                         suppress_tokens=suppress_tokens)
    if n_seq > 1:  # sample j of prompt b: its own stream (a golden-ratio stride; sample 0 keeps the prompt's seed)
        stride = torch.tensor([_wrap64(j * _SEED_STRIDE) for j in range(n_seq)], dtype=torch.int64)
        seeds = seeds.repeat_interleave(n_seq) + stride.repeat(P)  # int64 addition wraps: seeds stay any int64
    seed_list = seeds.tolist()  # host copy (seeds are still on the CPU here): the decode step's plan carries them
    seeds = seeds.to(device)
    prompt_lens = [len(p) for p in prompts for _ in range(n_seq)]
    result = GenerateResult([[] for _ in range(B)], None, prompt_lens, finished_by_eos=[False] * B)
    if logprobs is not None:
        result.logprobs = [[] for _ in range(B)]
    if max_new_tokens == 0:
        return _finish(result, tokenizer)

    saved_attn = model.config._attn_implementation
    if saved_attn != NAME:
        model.set_attn_implementation(register())
    cache_kw = _cache_kwarg(model)
    cache = PagedCache(model.config, block_size=block_size, max_length=max(prompt_lens) + max_new_tokens,
                       kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    cache.set_rows(B)
    steps = torch.zeros(B, dtype=torch.int64, device=device)
    try:
        aux: dict = {}  # the last draw's logprobs (eager path)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)

        def draw(lg, sd, st, hr):
            return _draw(sample, lg, None, sd, st, **sampling, idx=..., rules=rules, rows=hr, logprobs=logprobs,
                         logprobs_mode=logprobs_mode, aux=aux)

        kind = _StaticDecode if cuda_graphs else _DecodeStep
        dec = kind(model, cache, cache_kw, B, seed_list, draw, capture=cuda_graphs and device.type == "cuda",
                   compile=compile, token_state=None if rules is None else rules["token_state"])
        # ---- prefill: all prompts packed in one row --------------------------------------------------------
        t0 = time.perf_counter()
        rows = list(range(B))
        heads = rows[::n_seq]  # one prefill per prompt; its other samples fork its blocks below
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)[None]
        lens = [len(p) for p in prompts]
        pos = torch.cat([torch.arange(n) for n in lens]).to(device)[None]
        last = torch.tensor(lens).cumsum(0).sub(1).to(device)
        cache.begin_step(heads, lens)
        logits = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=last,
                       **{cache_kw: cache}).logits[0]
        if n_seq > 1:
            for h in heads:
                for j in range(1, n_seq):
                    cache.fork_row(h, h + j)
            logits = logits.repeat_interleave(n_seq, dim=0)
        new = _draw(sample, logits, rows, seeds, steps, **sampling, rules=rules, logprobs=logprobs,
                    logprobs_mode=logprobs_mode, aux=aux)
        if rules is not None:
            from arkernels.ops.sampling import update_token_state

            update_token_state(rules["token_state"], new)
        if compile:  # the static step passes no mask: a name without a mask function skips mask building
            model.set_attn_implementation(_register_static())
        inflight = deque([(rows, dec.fetch(new), aux.pop("lp", None))])  # launched, tokens not read yet
        result.prefill_s = time.perf_counter() - t0
        # ---- decode: the host plans and launches step t+1, then reads step t's tokens -----------------------
        # Token ids never leave the device on their way to the next step (``dec.step`` gathers them there); the
        # host reads each step's ids one step late, through one non-blocking copy, so the device is never idle
        # while the host waits. The price: a row that emitted EOS at step t still runs step t+1, whose token is
        # dropped (the output is unchanged: a row's token depends on its own inputs only). max_new_tokens is
        # checked on the host exactly (``issued`` counts the tokens drawn, in flight included).
        t0 = time.perf_counter()
        issued = [1] * B  # tokens drawn per row so far (the prefill's included)
        lengths = list(prompt_lens)  # cache length of each row before its next step
        done = [False] * B  # EOS read or max_new_tokens reached
        while inflight:
            last_rows = inflight[-1][0]
            nxt = [i for i, r in enumerate(last_rows) if not done[r] and issued[r] < max_new_tokens]
            if nxt:
                go = [last_rows[i] for i in nxt]
                out = dec.step(go, nxt, [lengths[r] for r in go], [issued[r] for r in go])
                for r in go:
                    lengths[r] += 1
                    issued[r] += 1
                inflight.append((go, dec.fetch(out), aux.pop("lp", None)))
            got, handle, lp = inflight.popleft()
            toks = dec.read(handle)
            lp = None if lp is None else [t.tolist() for t in lp]
            for i, (r, tok) in enumerate(zip(got, toks)):
                if done[r]:  # the step after its EOS: dropped
                    continue
                result.tokens[r].append(tok)
                if lp is not None:
                    top = [(t, v, j + 1) for j, (t, v) in enumerate(zip(lp[2][i], lp[3][i]))]
                    result.logprobs[r].append(TokenLogprobs(tok, lp[0][i], lp[1][i], top))
                if stream is not None:
                    stream(r, tok)
                if len(result.tokens[r]) > 1:
                    result.decode_tokens += 1
                if tok in eos:
                    result.finished_by_eos[r] = True
                if tok in eos or len(result.tokens[r]) >= max_new_tokens:
                    done[r] = True
                    cache.release_row(r)  # a step still in flight for it runs first (stream order)
        result.decode_s = time.perf_counter() - t0
    finally:
        if model.config._attn_implementation != saved_attn:
            model.set_attn_implementation(saved_attn)
        for r in range(B):  # rows cut short by an exception (finished rows hold nothing: a no-op for them)
            cache.release_row(r)
    result.cache_blocks_in_use = cache.blocks_in_use
    return _finish(result, tokenizer)


_SEED_STRIDE = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: consecutive samples' seeds land far apart


def _wrap64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64."""
    x &= 2**64 - 1
    return x - 2**64 if x >= 2**63 else x


def _draw(sample, logits, active, seeds, steps, temperature, top_k, top_p, min_p, idx=None, rules=None, rows=None,
          logprobs=None, logprobs_mode="raw", aux=None):
    """Greedy argmax or the fused sampler; ``idx=...`` (Ellipsis): ``seeds``/``steps`` are already per row and
    ``rows`` holds each row's cache (= history) row, -1 for padding. ``rules``: ``_token_rules``' keywords (the
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


def _bucket(n: int, batch: int) -> int:
    """The batch-size bucket of ``n`` active rows: the next power of two, capped at the batch."""
    return min(1 << (n - 1).bit_length(), batch)


_WARMUP = 2  # eager runs of a bucket's step on a side stream before its capture (allocator + Triton JIT warm)


class _DecodeStep:
    """The one-token decode step over fixed per-step buffers, fed without a host wait (the default path: eager, no
    padding; ``_StaticDecode`` pads to buckets and captures).

    Per batch size ``b`` one int64 buffer ``[7 + groups, b]`` on the model's device holds every per-step input, one
    row each: input ids, position ids, seq_lens after the step, cache row index, sampling seed, sampling step, the
    index of each row in the previous step's output, then the new token's slot in each cache group. The host writes
    rows 1.. into a pinned host buffer (numpy, no tensor built from a list) and sends it with one non-blocking copy;
    the ids (row 0) are gathered on the device from the previous step's output: sampled ids never visit the host on
    their way to the next step. Columns past the active count are padding: id of output 0, position 0, seq_len 0 (the
    attention kernel outputs zeros), row 0, slot -1 (nothing written). ``fetch`` starts the copy of a step's ids to a
    pinned host buffer (non-blocking), ``read`` waits for it: the loop reads step t while step t+1 runs.

    Two pinned plan buffers and two pinned id buffers alternate: the loop reads step t's ids (which follow step t's
    plan copy on the stream) before it writes step t+2's plan into the same buffer.
    """

    pad = False  # pad the active rows up to a batch-size bucket (``_StaticDecode``)
    ahead = 64  # tokens of block reservation ahead (full-attention groups): most steps write no table entry

    def __init__(self, model, cache, cache_kw: str, batch: int, seeds: list[int], draw, capture: bool = False,
                 compile: bool = False, token_state: torch.Tensor | None = None):
        self.model, self.cache, self.cache_kw = model, cache, cache_kw
        self.batch, self.seeds, self.draw, self.capture = batch, np.asarray(seeds, dtype=np.int64), draw, capture
        # the step as run and captured: eager, or compiled once per bucket (``b`` is a Python int: dynamo
        # specialises on it, so each bucket gets its own fixed-shape graph; every other host value the trace reads
        # is the same at every step: tests/test_generate.py counts one graph per bucket)
        self.run = torch.compile(self._forward, dynamic=False) if compile else self._forward
        self.device = next(model.parameters()).device
        self.num_groups = len(cache.groups)
        self.rows_per_step = 7 + self.num_groups
        pin = self.device.type == "cuda"
        self.plans = [torch.empty(self.rows_per_step * batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.plans_np = [p.numpy() for p in self.plans]  # the host writes the plan through these views
        self.ids = [torch.empty(batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self.plan_tick = self.id_tick = 0
        self.buffers: dict[int, torch.Tensor] = {}  # bucket -> int64 [7 + groups, bucket]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, token ids [b])
        self.pool = None  # one CUDA graph memory pool shared by every bucket (captured largest first)
        self.generation = cache.generation
        self.prev: torch.Tensor | None = None  # the last step's token ids on the device
        # the token rules' history, counted after each step outside the captured / compiled region: warm-up runs and
        # replays of a freshly captured graph recompute a step, and must not count its token twice
        self.token_state = token_state

    def step(self, rows: list[int], src: list[int], positions: list[int], steps: list[int]) -> torch.Tensor:
        """One token for each of ``rows`` (cache rows) at ``positions``, fed the ids at ``src`` of the last fetched
        output (device-side gather); returns int64 ``[len(rows)]`` on the device."""
        n = len(rows)
        b = _bucket(n, self.batch) if self.pad else n
        slots = self.cache.begin_static_step(rows, ahead=self.ahead)
        k = self.plan_tick % 2
        self.plan_tick += 1
        plan = self.plans[k][: self.rows_per_step * b].view(self.rows_per_step, b)
        a = self.plans_np[k][: self.rows_per_step * b].reshape(self.rows_per_step, b)
        pos = np.asarray(positions, dtype=np.int64)
        a[:, n:] = 0
        a[0, :n] = 0
        a[1, :n] = pos
        a[2, :n] = pos + 1
        a[3, :n] = rows
        a[4, :n] = self.seeds[rows]
        a[5, :n] = steps
        a[6, :n] = src
        for i, s in enumerate(slots):
            a[7 + i, :n] = s
            a[7 + i, n:] = -1
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = torch.empty((self.rows_per_step, b), dtype=torch.int64, device=self.device)
        buf.copy_(plan, non_blocking=True)
        torch.index_select(self.prev, 0, buf[6], out=buf[0])  # outside any graph: the previous output moves
        out = self._replay(b) if self.capture else self.run(b)
        if self.token_state is not None:
            from arkernels.ops.sampling import update_token_state

            update_token_state(self.token_state, out[:n], buf[3][:n])
        return out[:n]

    def fetch(self, out: torch.Tensor):
        """Start copying ``out`` (int64 ``[n]`` token ids) to the host; it also feeds the next ``step``."""
        self.prev = out
        k = self.id_tick % 2
        self.id_tick += 1
        host = self.ids[k][: out.shape[0]]
        host.copy_(out, non_blocking=True)
        if self.events is None:
            return host, None
        self.events[k].record()
        return host, self.events[k]

    @staticmethod
    def read(handle) -> list[int]:
        """The ids of a ``fetch``, once the copy has landed (the loop's one wait, a step behind the device)."""
        host, event = handle
        if event is not None:
            event.synchronize()
        return host.tolist()

    def _forward(self, b: int) -> torch.Tensor:
        """The static step of bucket ``b`` (what a CUDA graph captures): int64 token ids ``[b]``."""
        buf = self.buffers[b]
        self.cache.set_static_step(buf[3], buf[2].to(torch.int32), [buf[7 + i] for i in range(self.num_groups)])
        logits = self.model(input_ids=buf[0][:, None], position_ids=buf[1][:, None], use_cache=True,
                            **{self.cache_kw: self.cache}).logits[:, -1]
        # padding columns (seq_len 0) get history row -1: no rule, and they are never counted
        return self.draw(logits, buf[4], buf[5], torch.where(buf[2] > 0, buf[3], -1))

    def _replay(self, b: int) -> torch.Tensor:
        if self.cache.generation != self.generation:  # a table or pool moved: every captured graph is stale
            self.graphs.clear()
            self.generation = self.cache.generation
        entry = self.graphs.get(b)
        if entry is None:
            entry = self.graphs[b] = self._capture(b)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                self.run(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # one pool for every bucket: safe because graphs never run concurrently and are replayed in capture order
        # (the batch only shrinks, so buckets are first used, captured and replayed largest first), and the one
        # value that outlives a replay, its token ids ``out``, stays referenced by ``self.graphs``
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.run(b)
        return graph, out


class _StaticDecode(_DecodeStep):
    """The decode step of ``cuda_graphs=True``: the active rows padded up to a batch-size bucket, so the step's shapes
    take few values; on CUDA each bucket's step is captured once and replayed.

    The captured region (``_forward``) reads only the bucket's buffer, the cache's block tables and pools, and the
    weights: no ``.tolist()``/``.item()``, no tensor from host data. Re-running a step is harmless (the same K/V to
    the same slots, attention only reads), which is what lets the warm-up runs and the replay of a freshly captured
    graph compute the same step. A graph is stale once the cache reallocates a table or pool
    (``PagedCache.generation``): the graphs are then dropped and recaptured.
    """

    pad = True


def _register_static() -> str:
    """The attention implementation of the compiled static step: arkernels' attention registered without a mask
    function, so transformers' mask builders return None at once (``_preprocess_mask_arguments`` gives no mask to an
    implementation without one). With arkernels' own mask function, ``arkernels_mask`` returns sdpa's 4D mask while
    ``torch.compile`` traces, and the attention then asks the static step for dense keys, which it has not (a
    RuntimeError, seen on the tiny Llama). The static step's attention reads its bounds from ``PagedStep`` only."""
    from transformers import AttentionInterface

    from arkernels.hf.attention import arkernels_attention

    AttentionInterface.register(_STATIC_NAME, arkernels_attention)
    return _STATIC_NAME


_STATIC_NAME = "arkernels_static"


def _eos_ids(model, tokenizer, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    return {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id])}


def _finish(result: GenerateResult, tokenizer) -> GenerateResult:
    if tokenizer is not None:
        result.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    return result
