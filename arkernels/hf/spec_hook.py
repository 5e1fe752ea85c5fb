"""The speculative-sampling hook of ``arkernels.patch``: ``model.generate(assistant_model=draft, do_sample=True)``
accepts the draft's tokens with ``arkernels.chain_speculative_sampling`` (one fused op) instead of transformers'
``_speculative_sampling`` (softmaxes, a gather, a rand, a cumsum and a multinomial, with host syncs between them).

transformers hands that function the draft's and the target's *processed* scores (its logits processors and warpers
already ran), so the op runs with temperature 1 and no filters of its own: ``p`` and ``q`` are the same softmaxes, the
acceptance rule and the residual draw are Leviathan / Chen's as in transformers, and the emitted tokens have the same
distribution as stock's (not the same tokens: the op draws from its own seeded streams, keyed by a seed taken from
torch's global generator per call, so ``torch.manual_seed`` makes runs reproducible).

transformers looks the function up as a global of ``transformers.generation.utils``, so the hook has two parts: an
instance attribute over ``generate`` that marks the calls of a patched model (a context variable), and a
module attribute installed while at least one patched model holds the hook (counted), which serves marked calls with
the op and every other call (an unpatched model, a call made with ``assistant_ensemble_weight``, or an argument
transformers added that it does not know) with transformers' own function.
"""
from __future__ import annotations

import contextvars
import inspect

import torch

# the patch state of the call being served (None: none, or the fused draw not allowed on its device)
_serving = contextvars.ContextVar("arkernels_spec_sampling", default=None)
_installed = {"holders": 0, "original": None, "signature": None}
FUSED_ARGS = ("candidate_input_ids", "candidate_logits", "candidate_length", "new_logits", "is_done_candidate")
fused_calls = [0]  # calls served by the op (tests read it)


def fused_speculative_sampling(*args, **kwargs):
    """transformers' ``_speculative_sampling`` contract: ``(valid_tokens [1, n + 1], n_matches)`` for batch 1."""
    original = _installed["original"]
    bound = (_installed["signature"] or inspect.signature(original)).bind(*args, **kwargs)
    bound.apply_defaults()
    extra = {n: v for n, v in bound.arguments.items() if n not in FUSED_ARGS}
    state = _serving.get()
    # state["stock"]: a call served as the unpatched model (arkernels.hf.stock_call)
    if state is None or state["stock"] or any(v is not None and v is not False for v in extra.values()):
        return original(*args, **kwargs)
    from arkernels.ops.spec_sampling import chain_speculative_sampling

    a = bound.arguments
    k = int(a["candidate_length"])
    draft_ids = a["candidate_input_ids"][:, a["candidate_input_ids"].shape[1] - k:]
    target = a["new_logits"][:, :k + 1]
    tokens, accepted = chain_speculative_sampling(target, draft_ids, a["candidate_logits"][:, :k].to(target.dtype))
    fused_calls[0] += 1
    n = accepted[0]
    # transformers <= 5.17's is_done_candidate (the draft ended on EOS or the length): every draft kept means no
    # bonus token (stock's rule: the candidates alone, n_matches - 1)
    if a.get("is_done_candidate") is not None and bool(a["is_done_candidate"]) and int(n) == k:
        return draft_ids, n - 1
    return tokens[:, :int(n) + 1], n


def wrap_generate(model, original, state: dict, sampler: bool | str):
    """An instance attribute over ``generate`` (transformers looks ``_assisted_decoding`` up on the class, so the
    mark is set around the whole call): its assisted decoding accepts drafts with the op where ``sampler`` allows the
    fused draw on the model's device (``sampler_hook.sampler_serves``)."""
    from arkernels.hf.sampler_hook import sampler_serves

    def generate(*args, **kwargs):
        token = _serving.set(state if sampler_serves(sampler, True, model.device) else None)
        try:
            return original(*args, **kwargs)
        finally:
            _serving.reset(token)

    return generate


def hold() -> None:
    """One more patched model uses the hook: install the module attribute if it is the first."""
    import transformers.generation.utils as gen

    if _installed["holders"] == 0:
        _installed["original"] = gen._speculative_sampling
        _installed["signature"] = inspect.signature(gen._speculative_sampling)  # once, not per verification
        gen._speculative_sampling = fused_speculative_sampling
    _installed["holders"] += 1


def release() -> None:
    """A patched model was undone: put transformers' function back after the last one."""
    import transformers.generation.utils as gen

    _installed["holders"] -= 1
    if _installed["holders"] == 0:
        gen._speculative_sampling = _installed["original"]
        _installed["original"] = _installed["signature"] = None
