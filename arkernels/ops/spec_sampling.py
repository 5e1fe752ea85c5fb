"""Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): verify a chain of k draft tokens per row against
the target model's logits in one op, on the device, with no host sync.

Semantics (every device), per row, for chain positions ``j = 0 .. k``:
  * ``p_j`` / ``q_j``: the target's / draft's filtered, renormalised distribution at position ``j``, exactly what
    ``arkernels.sampling_probs`` gives (token rules, then temperature -> top-k -> top-p -> min-p, the row's own
    parameters for both). A one-hot draft (``draft_logits`` None, prompt lookup) has ``q_j = onehot(t_j)``.
  * Token rules inside the chain are exact: position ``j`` sees what non-speculative decoding would see after
    accepting drafts ``0 .. j-1``: their occurrences are counted into the row's ``token_state`` word (repetition,
    frequency, presence; saturating, as ``update_token_state``) and ``new_tokens`` grows by ``j`` (min_new_tokens).
    How: one derived table of ``(k+1) * batch`` rows (row ``j * batch + b`` = the row's history plus drafts
    ``0 .. j-1``, built with ``update_token_state``), read by ``sampling_probs`` over the flattened
    ``[batch * (k+1), vocab]`` logits; the draft's rows read the same table. Cost: 4 * vocab B per (row, position)
    for the table (and as much again for a ``logit_bias`` table), only when ``token_state`` is given.
  * Acceptance: draft ``t_j`` is accepted iff every earlier one was and ``u_j * q_j(t_j) < p_j(t_j)``
    (probability ``min(1, p_j(t_j) / q_j(t_j))``); a token the target's filters removed (``p_j(t_j) = 0``) is never
    accepted, nor an id outside ``[0, vocab)``.
  * At the first rejection the token is drawn from the residual ``max(0, p_j - q_j)`` (renormalised; were it empty,
    from ``p_j``); after k acceptances the bonus token is drawn from ``p_k``. Each emitted token is then distributed
    as non-speculative sampling from the target would draw it, whatever the draft.
  * Greedy rows (temperature 0) ignore the draft distribution: ``t_j`` is accepted iff it is the target's argmax
    (lowest index among ties, as ``sample``), and the emitted token is the target's argmax: exactly the tokens of
    k+1 non-speculative greedy steps, up to the first mismatch.
  * Random streams: ``sample``'s hash family keyed on (seed, step + j), salted so that a draft drawn by
    ``arkernels.sample`` with the same seed and steps stays independent of them: the acceptance uniform is the
    column 0xFFFFFFFF of position ``j``'s stream, the draw's exponential race uses columns ``0 .. vocab-1`` of the
    drawing position's stream. Nothing depends on the row's index in the batch.
  * A drawing position with no finite target logit gives token 0 and ``valid`` False (``sample``'s convention).

The CUDA kernels are ``sampling_probs``'s Triton kernel (per position) and arkernels/triton/spec_sampling.py (the
walk and the draw, launched by arkernels/triton/spec_sampling_launch.py); the CPU kernel is ``sampling_probs``'s
CPU kernel and arkernels/ops/spec_sampling_cpu.py (the same hash: both draw the same tokens).
"""
from __future__ import annotations

import torch

from arkernels import _library  # noqa: F401  (loads the op library: the schemas live in csrc/torch_bindings.cpp)
from arkernels.ops._checks import expect
from arkernels.ops.sampling import rule_tensors, sampler_params, seed_and_step, update_token_state
from arkernels.ops.spec_sampling_cpu import spec_walk_cpu
from arkernels.triton.spec_sampling_launch import spec_walk_triton

_ops = torch.ops.arkernels
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
OP = "chain_speculative_sampling"


def _check_tensors(target_logits, draft_ids, draft_logits):
    """The wrapper's tensor checks (ValueError): shapes, dtypes, devices, k everywhere, ids in range (CPU tensors:
    no host sync for device ones). Returns ``(batch, k+1, vocab)``."""
    shape = lambda t: tuple(getattr(t, "shape", ())) if isinstance(t, torch.Tensor) else type(t)  # noqa: E731
    expect(isinstance(target_logits, torch.Tensor) and target_logits.dim() == 3, OP,
           f"target_logits must be a [batch, k+1, vocab] tensor, got {shape(target_logits)}")
    expect(target_logits.dtype in _FLOATS, OP,
           f"target_logits must be float32, float16 or bfloat16, got {target_logits.dtype}")
    batch, kp1, vocab = target_logits.shape
    dev = target_logits.device
    expect(kp1 >= 1 and vocab >= 1, OP,
           f"target_logits needs k+1 >= 1 positions and vocab >= 1, got {shape(target_logits)}")
    expect(isinstance(draft_ids, torch.Tensor) and draft_ids.dim() == 2, OP,
           f"draft_ids must be an int64 [batch, k] tensor, got {shape(draft_ids)}")
    expect(draft_ids.dtype == torch.int64, OP, f"draft_ids must be torch.int64, got {draft_ids.dtype}")
    expect(tuple(draft_ids.shape) == (batch, kp1 - 1), OP, f"draft_ids must be [batch={batch}, k={kp1 - 1}] "
           f"(target_logits holds k+1={kp1} positions), got {shape(draft_ids)}")
    expect(draft_ids.device == dev, OP, f"draft_ids is on {draft_ids.device}, target_logits on {dev}")
    if dev.type == "cpu" and draft_ids.numel() > 0 and not torch.compiler.is_compiling():
        bad = ((draft_ids < 0) | (draft_ids >= vocab)).nonzero()
        if bad.numel() > 0:
            at = tuple(bad[0].tolist())
            expect(False, OP, f"draft_ids holds token id {int(draft_ids[at])} at {at}, outside [0, {vocab})")
    if draft_logits is not None:
        expect(isinstance(draft_logits, torch.Tensor) and tuple(draft_logits.shape) == (batch, kp1 - 1, vocab), OP,
               f"draft_logits must be [batch={batch}, k={kp1 - 1}, vocab={vocab}], got {shape(draft_logits)}")
        expect(draft_logits.dtype in _FLOATS, OP,
               f"draft_logits must be float32, float16 or bfloat16, got {draft_logits.dtype}")
        expect(draft_logits.device == dev, OP, f"draft_logits is on {draft_logits.device}, target_logits on {dev}")
    return batch, kp1, vocab


def chain_speculative_sampling(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor | None = None,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
    seed: int | torch.Tensor | None = None,
    step: int | torch.Tensor = 0,
    generator: torch.Generator | None = None,
    return_valid: bool = False,
    token_state: torch.Tensor | None = None,
    history_rows: torch.Tensor | None = None,
    new_tokens: int | torch.Tensor = 0,
    min_new_tokens: int | torch.Tensor = 0,
    repetition_penalty: float | torch.Tensor = 1.0,
    frequency_penalty: float | torch.Tensor = 0.0,
    presence_penalty: float | torch.Tensor = 0.0,
    logit_bias: torch.Tensor | None = None,
):
    """Verify k draft tokens per row against the target and emit the accepted ones plus one more (module docstring).

    Parameters
    ----------
    target_logits : ``[batch, k+1, vocab]`` float32, float16 or bfloat16 (any strides)
        The target model's logits at the k draft positions and the one after them.
    draft_ids : int64 ``[batch, k]``
        The proposed tokens. Ids outside ``[0, vocab)`` raise for CPU tensors (a device tensor is not read back: such
        an id is never accepted).
    draft_logits : ``[batch, k, vocab]`` float32, float16 or bfloat16, optional
        The draft model's logits; None: a one-hot draft (prompt lookup), ``q_j(draft_ids[:, j]) = 1``.
    temperature, top_k, top_p, min_p : number or ``[batch]``
        As :func:`arkernels.sample` (temperature 0: greedy), for the target and the draft alike.
    seed, step : int or int64 ``[batch]``
        ``step`` is the position index of the first proposed token: position ``j`` uses stream (seed, step + j).
        ``seed`` None: drawn from ``generator`` (or torch's default generator).
    return_valid : bool
        Also return ``valid``.
    token_state, history_rows, new_tokens, min_new_tokens, repetition_penalty, frequency_penalty, presence_penalty,
    logit_bias
        The token rules, as :func:`arkernels.sample` takes them (the row's history before the chain); position ``j``
        also counts drafts ``0 .. j-1`` and ``new_tokens + j``. ``token_state`` is not modified: count the emitted
        tokens with ``update_token_state`` afterwards.

    Returns
    -------
    tokens : int64 ``[batch, k+1]``
        The accepted drafts, then the drawn (correction or bonus) token; ``-1`` after it.
    accepted : int64 ``[batch]``
        The number of accepted drafts, in ``[0, k]``; the row emits ``accepted + 1`` tokens.
    valid : bool ``[batch]``, with ``return_valid``
        False where the drawing position has no finite target logit (its token is then 0).
    """
    batch, kp1, vocab = _check_tensors(target_logits, draft_ids, draft_logits)
    dev = target_logits.device
    t, k, p, mp = sampler_params(OP, target_logits[:, 0], temperature, top_k, top_p, min_p)
    seed, step = seed_and_step(OP, seed, step, generator, batch, dev)
    rules = rule_tensors(OP, target_logits[:, 0], token_state, history_rows, new_tokens, min_new_tokens,
                         repetition_penalty, frequency_penalty, presence_penalty, logit_bias)
    tokens, accepted, valid = _ops.chain_speculative_sampling(target_logits, draft_logits, draft_ids, t, k, p, mp,
                                                              seed, step, *rules)
    return (tokens, accepted, valid) if return_valid else (tokens, accepted)


@torch.library.register_fake("arkernels::chain_speculative_sampling")
def _(target_logits, draft_logits, draft_ids, temperature, top_k, top_p, min_p, seed, step, token_state=None,
      history=None, penalties=None, logit_bias=None):
    batch, kp1 = target_logits.shape[0], target_logits.shape[1]
    i64 = dict(dtype=torch.int64)
    return (target_logits.new_empty((batch, kp1), **i64), target_logits.new_empty((batch,), **i64),
            target_logits.new_empty((batch,), dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------
# Kernel registrations: one set of checks, the per-position distributions, then the walk (Triton or torch)
# ---------------------------------------------------------------------------------------------------------
def _check(target_logits, draft_logits, draft_ids, params, rules):
    """Op-level checks (RuntimeError): shapes, dtypes, devices; ``k`` agrees everywhere."""
    expect(target_logits.dim() == 3, OP, f"target_logits must be [batch, k+1, vocab], got {tuple(target_logits.shape)}",
           RuntimeError)
    batch, kp1, vocab = target_logits.shape
    dev = target_logits.device
    expect(kp1 >= 1 and vocab >= 1, OP,
           f"target_logits needs k+1 >= 1 and vocab >= 1, got {tuple(target_logits.shape)}", RuntimeError)
    for name, x in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        expect(x is None or x.dtype in _FLOATS, OP, f"{name} must be float32, float16 or bfloat16, got "
               f"{getattr(x, 'dtype', None)}", RuntimeError)
    expect(draft_logits is None or (tuple(draft_logits.shape) == (batch, kp1 - 1, vocab)
                                    and draft_logits.device == dev), OP,
           f"draft_logits must be [batch={batch}, k={kp1 - 1}, vocab={vocab}] on {dev}, got "
           f"{tuple(getattr(draft_logits, 'shape', ()))}", RuntimeError)
    expect(draft_ids.dtype == torch.int64 and tuple(draft_ids.shape) == (batch, kp1 - 1) and draft_ids.device == dev,
           OP, f"draft_ids must be int64 [batch={batch}, k={kp1 - 1}] on {dev}, got {draft_ids.dtype} "
           f"{tuple(draft_ids.shape)} on {draft_ids.device}", RuntimeError)
    for (name, dtype), x in zip((("temperature", torch.float32), ("top_k", torch.int32), ("top_p", torch.float32),
                                 ("min_p", torch.float32), ("seed", torch.int64), ("step", torch.int64)), params):
        expect(x.dtype == dtype and tuple(x.shape) == (batch,) and x.device == dev, OP,
               f"{name} must be {dtype} [batch={batch}] on {dev}, got {x.dtype} {tuple(x.shape)} on {x.device}",
               RuntimeError)
    token_state, history, penalties, logit_bias = rules
    for name, x, dtype in (("token_state", token_state, torch.int32), ("logit_bias", logit_bias, torch.float32)):
        expect(x is None or (x.dtype == dtype and x.dim() == 2 and x.shape[1] == vocab and x.device == dev), OP,
               f"{name} must be {dtype} [rows, vocab={vocab}] on {dev}", RuntimeError)
    expect(history is not None or (token_state is None and logit_bias is None), OP,
           "history is required with token_state or logit_bias", RuntimeError)
    for name, x, dtype in (("history", history, torch.int64), ("penalties", penalties, torch.float32)):
        expect(x is None or (x.dtype == dtype and tuple(x.shape) == (batch, 3) and x.device == dev), OP,
               f"{name} must be {dtype} [batch={batch}, 3] on {dev}", RuntimeError)


def _position_rules(draft_ids, vocab, token_state, history, penalties, logit_bias):
    """The rule tensors for the flattened chain (module docstring): ``(table, bias, history_p, history_q, pen_p,
    pen_q)``; logits row ``b * (k+1) + j`` (target) and ``b * k + j`` (draft) read table row ``j * batch + b``."""
    batch, k = draft_ids.shape
    dev = draft_ids.device
    N = (token_state if token_state is not None else logit_bias).shape[0]
    h = history[:, 0]
    rv = (h >= 0) & (h < N)
    hr = torch.where(rv, h, 0)
    table = bias = None
    if token_state is not None:
        table = torch.empty(k + 1, batch, vocab, dtype=torch.int32, device=dev)
        table[0] = token_state[hr]
        for j in range(1, k + 1):  # position j = position j-1 plus draft j-1 (saturating, ids outside skipped)
            table[j] = table[j - 1]
            update_token_state(table[j], draft_ids[:, j - 1])
        table = table.view((k + 1) * batch, vocab)
        bias = None if logit_bias is None else logit_bias[hr].repeat(k + 1, 1)
        rows = torch.arange(k + 1, device=dev)[None, :] * batch + torch.arange(batch, device=dev)[:, None]
    else:  # the bias alone does not depend on the chain: every position reads the caller's row
        bias = logit_bias
        rows = h[:, None].expand(batch, k + 1)
    rows = torch.where(rv[:, None], rows, -1)
    new = history[:, 1:2] + torch.arange(k + 1, device=dev)[None, :]
    hist = torch.stack([rows, new, history[:, 2:3].expand(batch, k + 1)], dim=2)  # [batch, k+1, 3]
    pen = penalties if penalties is not None else torch.tensor([1.0, 0.0, 0.0], device=dev).expand(batch, 3)
    pen = pen[:, None, :].expand(batch, k + 1, 3)
    return (table, bias, hist.reshape(-1, 3), hist[:, :k].reshape(-1, 3), pen.reshape(-1, 3),
            pen[:, :k].reshape(-1, 3))


def _chain_probs(target_logits, draft_logits, draft_ids, params, rules):
    """``p`` fp32 ``[batch*(k+1), vocab]`` and ``q`` fp32 ``[batch*k, vocab]`` (None for a one-hot draft), by
    ``sampling_probs`` on the flattened positions (its own kernel on each device)."""
    batch, kp1, vocab = target_logits.shape
    t, k, p, mp = params[:4]
    per = lambda x, n: x.repeat_interleave(n)  # noqa: E731  (row b's parameters for each of its positions)
    table = bias = hp = hq = pp = pq = None
    if rules[0] is not None or rules[3] is not None:
        table, bias, hp, hq, pp, pq = _position_rules(draft_ids, vocab, *rules)
    probs_p = _ops.sampling_probs(target_logits.reshape(batch * kp1, vocab), per(t, kp1), per(k, kp1), per(p, kp1),
                                  per(mp, kp1), table, hp, pp, bias)
    if draft_logits is None:
        return probs_p, None
    probs_q = _ops.sampling_probs(draft_logits.reshape(batch * (kp1 - 1), vocab), per(t, kp1 - 1), per(k, kp1 - 1),
                                  per(p, kp1 - 1), per(mp, kp1 - 1), table, hq, pq, bias)
    return probs_p, probs_q


def chain_kernel(walk):
    """The op's kernel for one device around ``walk`` (``spec_walk_triton`` or ``spec_walk_cpu``): the checks, the
    per-position distributions (``sampling_probs`` on the tensors' device), then the walk. Tests call
    ``chain_kernel(spec_walk_triton)`` on CPU tensors to run the Triton walk in the interpreter."""

    def kernel(target_logits, draft_logits, draft_ids, temperature, top_k, top_p, min_p, seed, step,
               token_state=None, history=None, penalties=None, logit_bias=None):
        params = (temperature, top_k, top_p, min_p, seed, step)
        rules = (token_state, history, penalties, logit_bias)
        _check(target_logits, draft_logits, draft_ids, params, rules)
        probs_p, probs_q = _chain_probs(target_logits, draft_logits, draft_ids, params, rules)
        return walk(probs_p, probs_q, draft_ids.contiguous(), temperature.contiguous(), seed.contiguous(),
                    step.contiguous())

    return kernel


torch.library.register_kernel("arkernels::chain_speculative_sampling", "cuda", chain_kernel(spec_walk_triton))
torch.library.register_kernel("arkernels::chain_speculative_sampling", "cpu", chain_kernel(spec_walk_cpu))
