"""``arkernels.generate``'s inputs: every argument checked and normalised here, before the prefill runs.

Prompts in any of the accepted forms become lists of token ids (``as_prompts``); the token rules become the fused
sampler's per-row tensors (``token_rules``); seeds become one int64 per prompt (``seeds_of``); the rest is checked
by ``check_args``. A bad value raises a ValueError naming the argument (TypeError for a model dtype).
"""
from __future__ import annotations

import inspect
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch


def is_int(v) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an int to Python, never a token id or seed here)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def pad_id_of(model, tokenizer) -> int | None:
    """The pad id a padded batch would hold: the tokenizer's, else the model's generation config, else its config."""
    for src in (tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None)):
        pad = getattr(src, "pad_token_id", None)
        if is_int(pad):
            return int(pad)
    return None


def as_prompts(x, tokenizer, *, input_ids=None, attention_mask=None, token_type_ids=None, pad_id: int | None = None,
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
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not all(is_int(t) for t in p):
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
    ok = (lambda x: is_int(x)) if kind is int else (lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool))
    if not values or not all(ok(x) for x in values) or len(values) not in (1, n):
        raise ValueError(f"generate: {name} must be {'an int' if kind is int else 'a number'} or one per prompt ({n}), "
                         f"got {v!r}")
    return [kind(x) for x in values] * (n if len(values) == 1 else 1)


def token_rules(model, prompts, n_seq, eos, device, *, repetition_penalty, frequency_penalty, presence_penalty,
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
                isinstance(w, (list, tuple)) and len(w) >= 1 and all(is_int(t) for t in w) for w in bad_words_ids):
            raise ValueError(f"generate: bad_words_ids must be a list of token-id lists, got {bad_words_ids!r}")
        long = [w for w in bad_words_ids if len(w) > 1]
        if long:
            raise ValueError(f"generate: bad_words_ids takes single tokens only (got {list(long[0])}); multi-token "
                             "bad words run in patched model.generate, with transformers' processor")
        banned += [int(w[0]) for w in bad_words_ids if int(w[0]) not in eos]  # transformers never bans an EOS id
    if suppress_tokens is not None:
        if not isinstance(suppress_tokens, (list, tuple)) or not all(is_int(t) for t in suppress_tokens):
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
    vocab = vocab_size_of(model)
    _refuse_empty_rows(vocab, banned, biases, eos if any(mn) else set(), P)
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


def _refuse_empty_rows(vocab: int | None, banned: list[int], biases, eos_masked: set[int], P: int) -> None:
    """A prompt whose rules ban every token has nothing to draw (the sampler would return token 0 and stock's
    multinomial raises): refused before the prefill, naming the prompt. ``eos_masked``: EOS ids ``min_new_tokens``
    masks at the first steps."""
    if vocab is None:
        return
    for i in range(P):
        gone = {t for t in banned if 0 <= t < vocab}
        bias = (biases[i] if biases is not None else None) or {}
        gone |= {int(t) for t, v in bias.items() if float(v) == -math.inf and is_int(t) and 0 <= t < vocab}
        if len(gone) == vocab:
            raise ValueError(f"generate: prompt {i}: bad_words_ids, suppress_tokens and logit_bias ban every token "
                             f"of the vocabulary ({vocab}): there is nothing to draw")
        if len(gone | {t for t in eos_masked if 0 <= t < vocab}) == vocab:
            raise ValueError(f"generate: prompt {i}: every token but the EOS ids is banned and min_new_tokens masks "
                             "the EOS ids: there is nothing to draw at the first step")


def check_args(*, max_new_tokens, num_return_sequences, block_size, temperature, top_k, top_p, min_p, stream):
    """Every scalar argument of ``generate`` checked before any model work (one ValueError naming the argument)."""
    from arkernels.ops.sampling import sampler_params

    for name, v, lo in (("max_new_tokens", max_new_tokens, 0), ("num_return_sequences", num_return_sequences, 1),
                        ("block_size", block_size, 1)):
        if not is_int(v) or v < lo:
            raise ValueError(f"generate: {name} must be an int >= {lo}, got {v!r}")
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise ValueError(f"generate: {name} must be a number, got {v!r}")
    if not is_int(top_k):
        raise ValueError(f"generate: top_k must be an int (0: off), got {top_k!r}")
    # the sampler's own range rules, on a one-row stand-in (so its words and generate's agree)
    sampler_params("generate", torch.zeros(1, 1), float(temperature), int(top_k), float(top_p), float(min_p))
    if stream is not None and not callable(stream):
        raise ValueError(f"generate: stream must be a callable stream(row, token_id) or None, got {stream!r}")


def seeds_of(seed, n: int) -> torch.Tensor:
    """``seed`` (an int, one int per prompt, or an integer tensor) as int64 ``[n]``; floats and bools are refused
    (``torch.as_tensor(1.5, dtype=torch.int64)`` would silently truncate to 1)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype.is_floating_point or seed.dtype.is_complex or seed.dtype == torch.bool:
            raise ValueError(f"generate: seed must be an int, a list of ints or an integer tensor, got a {seed.dtype} "
                             "tensor")
        seeds = seed.to(torch.int64).reshape(-1).cpu()
    else:
        values = list(seed) if isinstance(seed, Sequence) and not isinstance(seed, str) else [seed]
        bad = next((v for v in values if not is_int(v) or not -2**63 <= v < 2**63), None)
        if bad is not None or not values:
            raise ValueError(f"generate: seed must be an int64 or a list of them, got {seed!r}")
        seeds = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if seeds.numel() == 1:
        seeds = seeds.expand(n)
    if seeds.numel() != n:
        raise ValueError(f"generate: seed must be an int or one per prompt ({n}), got {seeds.numel()}")
    return seeds


def vocab_size_of(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    return n if n is not None else getattr(model.config.get_text_config(), "vocab_size", None)


def warn_past_max_positions(model, length: int) -> None:
    """Stock generate's reminder (``MaxLengthCriteria``) when a row would run past ``max_position_embeddings``; said
    once up front, since the lengths are known before the prefill."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and length > limit:
        warnings.warn(f"generate: prompt + max_new_tokens reaches {length} tokens, past the model's predefined maximum "
                      f"length (max_position_embeddings={limit}); depending on the model you may observe "
                      "exceptions, performance degradation, or nothing at all", stacklevel=3)


def cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def eos_ids(model, tokenizer, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    return {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id])}


@dataclass
class Plan:
    """One ``arkernels.generate`` call, checked: ``prompts`` (token-id lists), ``n_seq`` samples per prompt (rows
    ``b * n_seq + j``), per-row ``seeds`` (int64 on the model's device; ``seed_list`` the host copy), ``eos`` ids,
    ``rules`` (``token_rules``' tensors or None), ``sampling`` (temperature, top_k, top_p, min_p) and the rest of
    the call's options as given."""

    prompts: list[list[int]]
    n_seq: int
    device: torch.device
    eos: set[int]
    seeds: torch.Tensor
    seed_list: list[int]
    rules: dict | None
    sampling: dict
    max_new_tokens: int
    cuda_graphs: bool
    compile: bool
    block_size: int
    cache_options: dict  # kv_cache_dtype, k_scale, v_scale
    stream: Callable[[int, int], None] | None
    logprobs: int | None
    logprobs_mode: str
    lookup: tuple[int, int] | None = None  # prompt lookup: (prompt_lookup_num_tokens, max_matching_ngram_size)
    assistant: tuple | None = None  # a draft model: (assistant_model, num_assistant_tokens)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n_seq

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts for _ in range(self.n_seq)]


def make_plan(model, prompts_or_input_ids, *, input_ids, attention_mask, token_type_ids, max_new_tokens, temperature,
              top_k, top_p, min_p, seed, eos_token_id, tokenizer, stream, cuda_graphs, block_size,
              num_return_sequences, compile, kv_cache_dtype, k_scale, v_scale, repetition_penalty, frequency_penalty,
              presence_penalty, min_new_tokens, logit_bias, bad_words_ids, suppress_tokens, logprobs,
              logprobs_mode, prompt_lookup_num_tokens=None, max_matching_ngram_size=None, assistant_model=None,
              num_assistant_tokens=None) -> Plan:
    """Every argument of ``arkernels.generate`` checked (in one place) and turned into a ``Plan``."""
    from arkernels.hf.capability import check_model, check_model_tensors
    from arkernels.ops.sampling import seed_stream

    check_model(model, "arkernels.generate")
    check_model_tensors(model, "generate")
    check_args(max_new_tokens=max_new_tokens, num_return_sequences=num_return_sequences, block_size=block_size,
               temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stream=stream)
    _check_logprobs(logprobs, logprobs_mode, cuda_graphs or compile, vocab_size_of(model))
    lookup = lookup_of(prompt_lookup_num_tokens, max_matching_ngram_size)
    assistant = assistant_of(model, assistant_model, num_assistant_tokens, lookup)
    # composite configs (Gemma 3, Fuyu: a text config inside) keep the token ids on the text config
    bos_id = (getattr(tokenizer, "bos_token_id", None) if tokenizer is not None
              else getattr(model.config.get_text_config(decoder=True), "bos_token_id", None))
    prompts = as_prompts(prompts_or_input_ids, tokenizer, input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids, pad_id=pad_id_of(model, tokenizer), bos_id=bos_id,
                         vocab_size=vocab_size_of(model))
    n_seq, P = num_return_sequences, len(prompts)
    device = next(model.parameters()).device
    eos = eos_ids(model, tokenizer, eos_token_id)
    seeds = seeds_of(seed, P)
    warn_past_max_positions(model, max(len(p) for p in prompts) + max_new_tokens)
    rules = token_rules(model, prompts, n_seq, eos, device, repetition_penalty=repetition_penalty,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        min_new_tokens=min_new_tokens, logit_bias=logit_bias, bad_words_ids=bad_words_ids,
                        suppress_tokens=suppress_tokens)
    if n_seq > 1:  # sample j of prompt b: its own stream (a golden-ratio stride; sample 0 keeps the prompt's seed)
        stride = torch.tensor(seed_stream(0, n_seq), dtype=torch.int64)
        seeds = seeds.repeat_interleave(n_seq) + stride.repeat(P)  # int64 addition wraps: seeds stay any int64
    return Plan(prompts, n_seq, device, eos, seeds.to(device), seeds.tolist(), rules,
                dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p), max_new_tokens,
                cuda_graphs or compile, compile, block_size,
                dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale), stream, logprobs,
                logprobs_mode, lookup, assistant)


def lookup_of(num_tokens, max_ngram) -> tuple[int, int] | None:
    """Prompt lookup's options (transformers' names and default n-gram size, 2) checked: ``(k, n)`` or None (off)."""
    if num_tokens is None:
        if max_ngram is not None:
            raise ValueError("generate: max_matching_ngram_size goes with prompt_lookup_num_tokens")
        return None
    if not is_int(num_tokens) or num_tokens < 1:
        raise ValueError(f"generate: prompt_lookup_num_tokens must be None or an int >= 1, got {num_tokens!r}")
    n = 2 if max_ngram is None else max_ngram
    if not is_int(n) or n < 1:
        raise ValueError(f"generate: max_matching_ngram_size must be None or an int >= 1, got {max_ngram!r}")
    return int(num_tokens), int(n)


def assistant_of(model, draft, k, lookup) -> tuple | None:
    """A draft model checked (arkernels runs it, the target's vocabulary, the target's device): ``(draft, k)`` or
    None (off)."""
    from arkernels.hf.capability import check_model, check_model_tensors

    if draft is None:
        if k is not None:
            raise ValueError("generate: num_assistant_tokens goes with assistant_model")
        return None
    if lookup is not None:
        raise ValueError("generate: pass assistant_model or prompt_lookup_num_tokens, not both")
    k = 5 if k is None else k
    if not is_int(k) or k < 1:
        raise ValueError(f"generate: num_assistant_tokens must be None or an int >= 1, got {k!r}")
    check_model(draft, "arkernels.generate (assistant_model)")
    check_model_tensors(draft, "generate (assistant_model)")
    if vocab_size_of(draft) != vocab_size_of(model):
        raise ValueError(f"generate: assistant_model's vocabulary ({vocab_size_of(draft)}) is not the model's "
                         f"({vocab_size_of(model)}): its draft tokens would not be the model's tokens")
    d_dev, m_dev = next(draft.parameters()).device, next(model.parameters()).device
    if d_dev != m_dev:
        raise ValueError(f"generate: assistant_model is on {d_dev}, the model on {m_dev}: put both on one device")
    return draft, int(k)


def _check_logprobs(logprobs, logprobs_mode, static: bool, vocab: int | None) -> None:
    if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
        raise ValueError(f"generate: logprobs must be None or an int >= 0, got {logprobs!r}")
    if logprobs is not None and vocab is not None and logprobs > vocab:
        # (vLLM refuses more than its max_logprobs; there is no top-n past the vocabulary)
        raise ValueError(f"generate: logprobs={logprobs} asks for more top tokens than the vocabulary's {vocab}")
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"generate: logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
    if logprobs is not None and static:
        raise ValueError("generate: logprobs= runs on the eager decode path (cuda_graphs=False, compile=False)")
