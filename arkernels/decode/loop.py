"""arkernels' own decode loop over a transformers model: ragged prompts, one paged cache, the fused sampler.

Prefill packs every prompt into one ``[1, sum(prompt_lens)]`` row (no padding waste: each sequence owns exactly
its blocks), with per-sequence positions and ``cu_seqlens_q`` for the attention kernel; decode runs the still
active rows as ``[rows, 1]``. A row that emits EOS (or reaches ``max_new_tokens``) leaves the batch and its blocks
go back to the pool at once. Row ``b``'s draw at step ``t`` depends only on (its logits, the sampling parameters,
``seed[b]``, ``t``): the same prompt and seed give the same text whatever else is in the batch.

``cuda_graphs=True`` runs decode as a static step (``arkernels.decode.step.StaticDecode``): the active rows are padded up to a batch-size
bucket (1, 2, 4, 8, ... capped at the batch) and every input of the step lives in one preallocated buffer per bucket,
filled by one copy before the step; on a GPU the step is captured in a CUDA graph once per bucket and replayed.
``compile=True`` runs that step under ``torch.compile`` (one graph per bucket), captured as above on a GPU.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Mapping, Sequence

import torch

from arkernels.decode.emit import draw, take
from arkernels.decode.inputs import Plan, cache_kwarg, make_plan
from arkernels.decode.result import GenerateResult
from arkernels.decode.drafts import make_drafter, speculative_sampling
from arkernels.decode.spec import decode_spec
from arkernels.decode.spec_step import SpecStep
from arkernels.decode.step import DecodeStep, StaticDecode, register_static
from arkernels.fuse import fused_for_call


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
             logprobs: int | None = None, logprobs_mode: str = "raw", prompt_lookup_num_tokens: int | None = None,
             max_matching_ngram_size: int | None = None, assistant_model=None,
             num_assistant_tokens: int | None = None, fuse: bool | str = "auto") -> GenerateResult:
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

        prompt_lookup_num_tokens: None (off) or ``k >= 1``: speculative decoding with prompt-lookup drafts
            (transformers' name and rule): each step a row proposes up to ``k`` tokens that followed the earliest
            earlier occurrence of its last ``max_matching_ngram_size`` (default 2, then shorter) tokens, and one
            forward verifies them all; the tokens are those of ``prompt_lookup_num_tokens=None`` for the same seeds
            (``arkernels.decode.spec``). ``result.proposed_tokens`` / ``accepted_tokens`` count the drafts per row.
            With ``cuda_graphs`` / ``compile`` the verification is a static step of ``k + 1`` positions per row
            (``arkernels.decode.spec_step``: one graph per batch-size bucket); logprobs there are refused.
        assistant_model, num_assistant_tokens: speculative decoding with a draft model (transformers' names): a
            decoder ``check_model`` accepts, with the target's vocabulary size, on the same device, proposes
            ``num_assistant_tokens`` (default 5, fixed) greedy tokens per step on its own paged cache; the target
            verifies them as above (the same tokens as without a draft model).
        fuse: merge q/k/v and gate/up into one matmul each for this call (``arkernels.fuse_projections``, undone
            after it: the model is unchanged afterwards). "auto" (default): with ``cuda_graphs`` / ``compile`` (3
            launches fewer per layer in the captured step); True: on every path; False: never.

    Every argument is checked before the prefill runs (a ValueError naming it; TypeError for a model dtype the
    kernels do not take). A prompt + ``max_new_tokens`` past ``max_position_embeddings`` warns, as stock does.

    Returns:
        ``GenerateResult`` (``tokens``, ``texts``, timings), one row per returned sequence.
    """
    plan = make_plan(model, prompts_or_input_ids, input_ids=input_ids, attention_mask=attention_mask,
                     token_type_ids=token_type_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, eos_token_id=eos_token_id,
                     tokenizer=tokenizer, stream=stream, cuda_graphs=cuda_graphs, block_size=block_size,
                     num_return_sequences=num_return_sequences, compile=compile, kv_cache_dtype=kv_cache_dtype,
                     k_scale=k_scale, v_scale=v_scale, repetition_penalty=repetition_penalty,
                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                     min_new_tokens=min_new_tokens, logit_bias=logit_bias, bad_words_ids=bad_words_ids,
                     suppress_tokens=suppress_tokens, logprobs=logprobs, logprobs_mode=logprobs_mode,
                     prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                     max_matching_ngram_size=max_matching_ngram_size, assistant_model=assistant_model,
                     num_assistant_tokens=num_assistant_tokens)
    B = plan.rows
    result = GenerateResult([[] for _ in range(B)], None, plan.prompt_lens, finished_by_eos=[False] * B)
    if logprobs is not None:
        result.logprobs = [[] for _ in range(B)]
    with fused_for_call(model, fuse, plan.cuda_graphs and max_new_tokens > 0):  # fuse checked either way
        if max_new_tokens > 0:
            _run(model, plan, result)
    return _finish(result, tokenizer)


def _run(model, plan: Plan, result: GenerateResult) -> None:
    """The call on arkernels' attention (selected for it, restored after) over one paged cache: prefill, then decode."""
    from arkernels.hf.attention import NAME, register
    from arkernels.hf.cache import PagedCache

    B = plan.rows
    saved_attn = model.config._attn_implementation
    if saved_attn != NAME:
        model.set_attn_implementation(register())
    cache_kw = cache_kwarg(model)
    cache = PagedCache(model.config, block_size=plan.block_size,
                       max_length=max(plan.prompt_lens) + plan.max_new_tokens, **plan.cache_options)
    cache.set_rows(B)
    try:
        aux: dict = {}  # the last draw's logprobs (eager path)
        spec = plan.lookup is not None or plan.assistant is not None
        # (the one-token step's pinned buffers are made before the prefill: the decode loop then reads no host data
        # but each step's token ids)
        dec = _spec_step(model, plan, cache, cache_kw) if spec else _one_token_step(model, plan, cache, cache_kw, aux)
        t0 = time.perf_counter()
        first = _prefill(model, plan, cache, cache_kw, aux)
        result.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if spec:
            drafter = make_drafter(plan)
            try:
                decode_spec(model, plan, cache, cache_kw, first, aux.pop("lp", None), result, drafter, dec)
            finally:
                drafter.close()
        else:
            inflight = deque([(list(range(B)), dec.fetch(first), aux.pop("lp", None))])  # launched, not read yet
            _decode(plan, cache, dec, inflight, aux, result)
        result.decode_s = time.perf_counter() - t0
    finally:
        if model.config._attn_implementation != saved_attn:
            model.set_attn_implementation(saved_attn)
        for r in range(B):  # rows cut short by an exception (finished rows hold nothing: a no-op for them)
            cache.release_row(r)
    result.cache_blocks_in_use = cache.blocks_in_use


def _one_token_step(model, plan: Plan, cache, cache_kw: str, aux: dict):
    """The one-token decode step: ``DecodeStep`` (eager) or ``StaticDecode`` (buffers, graphs, compile)."""
    from arkernels.ops.sampling import sample

    def step_draw(lg, sd, st, hr):
        return draw(sample, lg, None, sd, st, **plan.sampling, idx=..., rules=plan.rules, rows=hr,
                    logprobs=plan.logprobs, logprobs_mode=plan.logprobs_mode, aux=aux)

    kind = StaticDecode if plan.cuda_graphs else DecodeStep
    return kind(model, cache, cache_kw, plan.rows, plan.seed_list, step_draw,
                capture=plan.cuda_graphs and plan.device.type == "cuda", compile=plan.compile,
                token_state=None if plan.rules is None else plan.rules["token_state"])


def _spec_step(model, plan: Plan, cache, cache_kw: str) -> SpecStep | None:
    """The static verification step of a speculative ``cuda_graphs=True`` / ``compile=True`` call (None: eager)."""
    from arkernels.ops.sampling import sample

    if not plan.cuda_graphs:
        return None

    def step_draw(lg, sd, st, rules):  # rules: per position (``SpecStep``); no logprobs here (make_plan refuses them)
        return draw(sample, lg, None, sd, st, **plan.sampling, idx=..., rules=rules)

    k = plan.lookup[0] if plan.lookup is not None else plan.assistant[1]
    return SpecStep(model, cache, cache_kw, plan.rows, plan.seed_list, k, step_draw,
                    capture=plan.device.type == "cuda", compile=plan.compile, accept=not speculative_sampling(plan),
                    rules=plan.rules)


def _prefill(model, plan: Plan, cache, cache_kw: str, aux: dict) -> torch.Tensor:
    """All prompts packed in one row, one prefill per prompt (its other samples fork its blocks); returns the first
    token of every row (on the device)."""
    from arkernels.ops.sampling import sample

    n_seq, device, prompts = plan.n_seq, plan.device, plan.prompts
    rows = list(range(plan.rows))
    heads = rows[::n_seq]
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
    steps = torch.zeros(plan.rows, dtype=torch.int64, device=device)
    new = draw(sample, logits, rows, plan.seeds, steps, **plan.sampling, rules=plan.rules, logprobs=plan.logprobs,
               logprobs_mode=plan.logprobs_mode, aux=aux)
    if plan.rules is not None:
        from arkernels.ops.sampling import update_token_state

        update_token_state(plan.rules["token_state"], new)
    if plan.compile:  # the static step passes no mask: a name without a mask function skips mask building
        model.set_attn_implementation(register_static())
    return new


def _decode(plan: Plan, cache, dec, inflight: deque, aux: dict, result: GenerateResult) -> None:
    """The host plans and launches step t+1, then reads step t's tokens.

    Token ids never leave the device on their way to the next step (``dec.step`` gathers them there); the host reads
    each step's ids one step late, through one non-blocking copy, so the device is never idle while the host waits.
    The price: a row that emitted EOS at step t still runs step t+1, whose token is dropped (the output is unchanged:
    a row's token depends on its own inputs only). max_new_tokens is checked on the host exactly (``issued`` counts
    the tokens drawn, in flight included)."""
    B, max_new = plan.rows, plan.max_new_tokens
    issued = [1] * B  # tokens drawn per row so far (the prefill's included)
    lengths = list(plan.prompt_lens)  # cache length of each row before its next step
    done = [False] * B  # EOS read or max_new_tokens reached
    while inflight:
        last_rows = inflight[-1][0]
        nxt = [i for i, r in enumerate(last_rows) if not done[r] and issued[r] < max_new]
        if nxt:
            go = [last_rows[i] for i in nxt]
            out = dec.step(go, nxt, [lengths[r] for r in go], [issued[r] for r in go])
            for r in go:
                lengths[r] += 1
                issued[r] += 1
            inflight.append((go, dec.fetch(out), aux.pop("lp", None)))
        got, handle, lp = inflight.popleft()
        take(plan, cache, dec.read(handle), got, None if lp is None else [t.tolist() for t in lp], done, result)


def _finish(result: GenerateResult, tokenizer) -> GenerateResult:
    if tokenizer is not None:
        result.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    return result
