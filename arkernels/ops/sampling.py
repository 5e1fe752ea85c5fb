"""Sampling ops: temperature -> top-k -> top-p -> min-p -> draw, straight from logits.

Semantics (transformers' order and conventions, the same on every device):
  * ``z = (x - max) / T``; temperature 0 is greedy: the lowest index among the maximal logits.
  * top-k keeps every token tied with the k-th largest logit (``top_k`` 0 or ``>= vocab``: off).
  * top-p, over the renormalised top-k set, keeps a token iff the mass strictly above it is ``< top_p``
    (the crossing token and its ties are kept; the maximum always is; ``top_p`` 1: off). At the float
    boundary it compares as transformers' TopPLogitsWarper does: fp32 probabilities summed from the bottom,
    a token dropped iff its group's cumulative mass is ``<= 1 - top_p`` in fp32.
  * min-p keeps ``p_i >= min_p * p_max``.
  * NaN logits count as -inf; +inf logits count as the largest float (the tokens at +inf share the mass).
    A row with no finite logit (all -inf / NaN) returns token 0 and ``valid`` False; its
    ``sampling_probs`` row is all zeros. It never disturbs other rows.
  * the draw is keyed on (seed, step, vocab column), never on the row's position in the batch.

Token rules (``sampling_rules``; ``sample`` and ``sampling_probs`` apply them in their own passes, before the
temperature), per row, in transformers' processor order, each where it runs:
  1. logit bias (``logit_bias`` table, fp32): ``x + bias`` (transformers' ``sequence_bias`` with one-token keys,
     vLLM / OpenAI ``logit_bias``);
  2. repetition penalty over prompt + generated tokens (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM's
     ``repetition_penalty``): ``x * r`` where ``x < 0``, else ``x / r``;
  3. frequency then presence penalty over generated tokens (vLLM's ``apply_penalties``, OpenAI's rule):
     ``x - f * count``, then ``x - p * (count > 0)``;
  4. bans and minimum length: banned tokens (``bad_words_ids`` of one token, ``suppress_tokens``) and, while the
     row has fewer than ``min_new_tokens`` new tokens, its EOS ids (``MinNewTokensLengthLogitsProcessor``) -> -inf.
  The logits are sanitised before and after (NaN -> -inf, +inf -> the largest float, -0.0 -> +0.0).
The token history lives on the device: ``token_state`` int32 ``[rows, vocab]`` (see ``token_state``), one word per
token: **4 * vocab bytes per row** (512 KB at vocab 128k), plus 4 * vocab bytes for a ``logit_bias`` table when a
bias is set. ``update_token_state`` adds each step's draws on the device (no host sync); rows fork by indexing
(``token_state[parents]``, beams / ``num_return_sequences``). Multi-token bad words and sequence biases are not
implemented here (patched ``generate`` keeps transformers' processors for them).

The CUDA kernels are the Triton kernels in arkernels/triton/sampling.py (``sample``: truncate to <= 4096
candidates, then search; ``sampling_probs``: the full-row search), launched by arkernels/triton/sampling_launch.py;
the CPU kernel (arkernels/ops/sampling_cpu.py) is a vectorised torch version of the same thresholds, using the same
hash, so both draw the same tokens. Both are registered below the fakes, behind one set of argument checks.
"""
from __future__ import annotations

import math

import torch

from arkernels import _library  # noqa: F401  (loads the op library: the schemas live in csrc/torch_bindings.cpp)
from arkernels.ops._checks import expect, per_row
from arkernels.ops.sampling_cpu import sample_cpu, sampling_probs_cpu, sampling_rules_cpu
from arkernels.token_state_layout import BAN_BIT, COUNT_MAX, EOS_BIT, PROMPT_BIT
from arkernels.triton.sampling_launch import sample_triton, sampling_probs_triton, sampling_rules_triton

_ops = torch.ops.arkernels
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FLT_MAX = torch.finfo(torch.float32).max


def token_state(prompts, vocab: int, *, banned=None, eos_token_id=None, device=None) -> torch.Tensor:
    """The device-side token history the token rules read: int32 ``[len(prompts), vocab]`` (4 * vocab bytes a row).

    Word layout per (row, token): bits 0-23 the count of generated occurrences (0 here; ``update_token_state`` adds
    draws), bit 24 the token occurs in the row's prompt, bit 25 banned, bit 26 an EOS id (masked while the row has
    fewer than ``min_new_tokens`` new tokens).

    Args:
        prompts: one sequence of token ids per row (lists or 1-D integer tensors); ids outside ``[0, vocab)`` are
            refused.
        vocab: the vocabulary size (the logits' width).
        banned: token ids banned in every row (a list), or one list per row.
        eos_token_id: an id or a list of ids: the tokens ``min_new_tokens`` masks.
        device: where the table lives (default: the CPU).
    """
    op = "token_state"
    expect(isinstance(vocab, int) and vocab > 0, op, f"vocab must be a positive int, got {vocab!r}")
    rows = [torch.as_tensor(p, dtype=torch.int64).reshape(-1).cpu() for p in prompts]
    n = len(rows)
    st = torch.zeros(n, vocab, dtype=torch.int32)

    def ids(name, v):
        t = torch.as_tensor(v, dtype=torch.int64).reshape(-1)
        bad = t[(t < 0) | (t >= vocab)]
        expect(bad.numel() == 0, op, f"{name} holds token id {int(bad[0]) if bad.numel() else 0}, outside [0, {vocab})")
        return t

    for r, p in enumerate(rows):
        st[r, ids("prompt", p)] |= PROMPT_BIT
    if banned is not None:
        per_row_lists = len(banned) > 0 and all(isinstance(b, (list, tuple, torch.Tensor)) for b in banned)
        if per_row_lists:
            expect(len(banned) == n, op, f"banned must be one list of ids, or one list per row ({n}), got {len(banned)}")
            for r, b in enumerate(banned):
                st[r, ids("banned", b)] |= BAN_BIT
        else:
            st[:, ids("banned", banned)] |= BAN_BIT
    if eos_token_id is not None:
        st[:, ids("eos_token_id", eos_token_id)] |= EOS_BIT
    return st.to(device) if device is not None else st


def update_token_state(token_state: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Count one drawn token per row into ``token_state`` (in place, on its device, no host sync; capturable).

    Args:
        token_state: int32 ``[N, vocab]`` (``token_state(...)``).
        ids: int ``[n]``: the token drawn by each row; ids outside ``[0, vocab)`` (padding) are skipped.
        rows: int ``[n]`` distinct history rows (default ``arange(n)``); rows outside ``[0, N)`` are skipped.
    Counts saturate at ``COUNT_MAX`` (2**24 - 1) instead of spilling into the flag bits."""
    N, vocab = token_state.shape
    ids = ids.reshape(-1).to(device=token_state.device, dtype=torch.int64)
    rows = (torch.arange(ids.shape[0], device=ids.device) if rows is None
            else rows.reshape(-1).to(device=ids.device, dtype=torch.int64))
    ok = (ids >= 0) & (ids < vocab) & (rows >= 0) & (rows < N)
    flat = token_state.view(-1)
    at = torch.where(ok, rows * vocab + ids, 0)
    inc = ok & ((flat.gather(0, at) & COUNT_MAX) < COUNT_MAX)
    flat.scatter_add_(0, at, inc.to(torch.int32))


def logit_bias_table(biases, vocab: int, *, device=None) -> torch.Tensor:
    """fp32 ``[len(biases), vocab]`` from one ``{token_id: bias}`` mapping per row (``-inf`` bans the token)."""
    op = "logit_bias_table"
    out = torch.zeros(len(biases), vocab, dtype=torch.float32)
    for r, b in enumerate(biases):
        for t, v in (b or {}).items():
            expect(isinstance(t, int) and 0 <= t < vocab, op, f"row {r}: token id {t!r} outside [0, {vocab})")
            v = float(v)
            expect(not math.isnan(v) and v != math.inf, op, f"row {r}: bias of token {t} must be finite or -inf, got {v}")
            out[r, t] = v
    return out.to(device) if device is not None else out


def seed_and_step(op, seed, step, generator, batch: int, dev):
    """The draw's stream keys as int64 ``[batch]`` on ``dev`` (every seeded op: ``sample``,
    ``chain_speculative_sampling``): ``seed`` None draws one per row from ``generator``; floats and bools refused."""
    if seed is None:
        gdev = generator.device if generator is not None else dev
        seed = torch.randint(-2**63, 2**63 - 1, (batch,), dtype=torch.int64, device=gdev, generator=generator)
    for name, value in (("seed", seed), ("step", step)):
        bad = isinstance(value, (float, bool)) or (
            isinstance(value, torch.Tensor) and (value.is_floating_point() or value.dtype == torch.bool))
        if bad:
            what = value.dtype if isinstance(value, torch.Tensor) else repr(value)  # built only on failure
            expect(False, op, f"{name} must be an int or an int64 [batch] tensor, got {what}")
    return per_row(op, "seed", seed, batch, torch.int64, dev), per_row(op, "step", step, batch, torch.int64, dev)


def rule_tensors(op, logits, token_state, history_rows, new_tokens, min_new_tokens, repetition_penalty, frequency_penalty,
           presence_penalty, logit_bias):
    """The public token-rule arguments -> the op's ``(token_state, history, penalties, logit_bias)`` (all None when
    no rule is on); ``logits`` ``[batch, vocab]`` gives the batch, vocabulary and device (every op with token rules:
    ``sample``, ``sampling_probs``, ``sampling_rules``, ``chain_speculative_sampling``)."""
    batch, dev = logits.shape[0], logits.device
    penal = (("repetition_penalty", repetition_penalty, 1.0, lambda t: (t > 0) & (t < math.inf), "> 0 and finite"),
             ("frequency_penalty", frequency_penalty, 0.0, lambda t: t.abs() < math.inf, "finite"),
             ("presence_penalty", presence_penalty, 0.0, lambda t: t.abs() < math.inf, "finite"))
    asked = [name for name, v, off, _, _ in penal if isinstance(v, torch.Tensor) or v != off]
    if isinstance(min_new_tokens, torch.Tensor) or min_new_tokens != 0:
        asked.append("min_new_tokens")
    if token_state is None and logit_bias is None:
        expect(not asked, op, f"{', '.join(asked)} need token_state= (arkernels.token_state(...))")
        return None, None, None, None
    tables = [(n, t, d) for n, t, d in (("token_state", token_state, torch.int32), ("logit_bias", logit_bias,
                                                                                     torch.float32)) if t is not None]
    if token_state is None:
        expect(not asked, op, f"{', '.join(asked)} need token_state= (arkernels.token_state(...))")
    N = tables[0][1].shape[0] if tables[0][1].dim() == 2 else -1
    for name, t, dtype in tables:
        expect(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == logits.shape[1], op,
               f"{name} must be [rows, vocab={logits.shape[1]}], got {tuple(getattr(t, 'shape', ()))}")
        expect(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")
        expect(t.device == dev, op, f"{name} is on {t.device}, logits on {dev}")
        expect(t.shape[0] == N, op, f"token_state and logit_bias must have the same rows, got {N} and {t.shape[0]}")
    if history_rows is None:
        expect(N == batch, op, f"without history_rows the tables need one row per logits row ({batch}), got {N}")
        history_rows = torch.arange(batch, device=dev)
    cols = []
    for name, v in (("history_rows", history_rows), ("new_tokens", new_tokens), ("min_new_tokens", min_new_tokens)):
        if isinstance(v, torch.Tensor):
            expect(not v.is_floating_point() and v.dtype != torch.bool, op, f"{name} must be an integer tensor, got {v.dtype}")
        else:
            expect(isinstance(v, int) and not isinstance(v, bool), op, f"{name} must be an int or an int [batch] tensor, got {v!r}")
            expect(name == "history_rows" or v >= 0, op, f"{name} must be >= 0, got {v}")
        cols.append(per_row(op, name, v, batch, torch.int64, dev))
    history = torch.stack(cols, dim=1)
    pens = []
    tensor_checks = not torch.compiler.is_compiling()
    for name, v, off, ok, rule in penal:
        if not isinstance(v, torch.Tensor):
            expect(isinstance(v, (int, float)) and not isinstance(v, bool) and bool(ok(torch.tensor(float(v)))), op,
                   f"{name} must be a number {rule}, got {v!r}")
        t = per_row(op, name, v, batch, torch.float32, dev)
        if isinstance(v, torch.Tensor) and t.device.type == "cpu" and tensor_checks:
            bad = (~ok(t)).nonzero()
            expect(bad.numel() == 0, op, f"{name} must be {rule}, got {name}[{int(bad[0, 0]) if bad.numel() else 0}]")
        pens.append(t)
    return token_state, history, torch.stack(pens, dim=1), logit_bias


_RULES_DOC = """token_state: int32 ``[N, vocab]`` token history (``arkernels.token_state``) or None.
        history_rows: int ``[batch]``: each logits row's row in the tables (default ``arange(batch)``, then
            ``N == batch``); outside ``[0, N)``: no rule for that row.
        new_tokens, min_new_tokens: int or int ``[batch]``: the row's EOS ids are -inf while ``new_tokens <
            min_new_tokens``.
        repetition_penalty (> 0, 1: off), frequency_penalty, presence_penalty (0: off): numbers or fp32 ``[batch]``.
        logit_bias: fp32 ``[N, vocab]`` added to the logits (``arkernels.logit_bias_table``) or None."""


def sampler_params(op, logits, temperature, top_k, top_p, min_p):
    """Numbers or ``[batch]`` tensors -> the four per-row tensors, range-checked (ValueError) where that
    needs no host sync: Python numbers always, tensors when they live on the CPU."""
    expect(isinstance(logits, torch.Tensor) and logits.dim() == 2, op,
           f"logits must be a [batch, vocab] tensor, got {getattr(logits, 'shape', type(logits))}")
    expect(logits.dtype in _FLOATS, op, f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    batch, dev = logits.shape[0], logits.device
    checks = (
        ("temperature", temperature, torch.float32, lambda t: t >= 0, ">= 0"),
        ("top_k", top_k, torch.int32, lambda t: t >= 0, ">= 0 (0: off)"),
        ("top_p", top_p, torch.float32, lambda t: (t > 0) & (t <= 1), "in (0, 1] (1: off)"),
        ("min_p", min_p, torch.float32, lambda t: (t >= 0) & (t <= 1), "in [0, 1] (0: off)"),
    )
    tensor_checks = not torch.compiler.is_compiling()
    out = []
    for name, value, dtype, ok, rule in checks:
        if isinstance(value, torch.Tensor):
            expect(not value.is_floating_point() if dtype == torch.int32 else True, op,
                   f"{name} must be an integer tensor, got {value.dtype}")
        elif dtype == torch.int32:
            expect(isinstance(value, int) and not isinstance(value, bool), op, f"{name} must be an int, got {value!r}")
        if not isinstance(value, torch.Tensor):
            expect(bool(ok(value)), op, f"{name} must be {rule}, got {value!r}")
        t = per_row(op, name, value, batch, dtype, dev)
        if isinstance(value, torch.Tensor) and t.device.type == "cpu" and tensor_checks:
            bad = (~ok(t)).nonzero()
            if bad.numel() > 0:
                i = int(bad[0, 0])
                expect(False, op, f"{name} must be {rule}, got {name}[{i}] = {t[i].item()}")
        out.append(t)
    return out


def sampling_probs(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
    token_state: torch.Tensor | None = None,
    history_rows: torch.Tensor | None = None,
    new_tokens: int | torch.Tensor = 0,
    min_new_tokens: int | torch.Tensor = 0,
    repetition_penalty: float | torch.Tensor = 1.0,
    frequency_penalty: float | torch.Tensor = 0.0,
    presence_penalty: float | torch.Tensor = 0.0,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The filtered, renormalised distribution that :func:`sample` draws from (token rules, then the filters).

    Args:
        logits: ``[batch, vocab]`` float32, float16 or bfloat16; rows may be strided (a padded vocabulary).
        temperature: number or fp32 ``[batch]``, ``>= 0``; 0: greedy (a one-hot row).
        top_k: int or int ``[batch]``, ``>= 0``; 0 or ``>= vocab``: off.
        top_p: number or fp32 ``[batch]`` in ``(0, 1]``; 1: off.
        min_p: number or fp32 ``[batch]`` in ``[0, 1]``; 0: off.
        {rules}

    Returns:
        fp32 ``[batch, vocab]``, each row summing to 1, or all zeros for a row with no finite logit.
    """
    op = "sampling_probs"
    t, k, p, mp = sampler_params(op, logits, temperature, top_k, top_p, min_p)
    st, hist, pen, bias = rule_tensors(op, logits, token_state, history_rows, new_tokens, min_new_tokens,
                                 repetition_penalty, frequency_penalty, presence_penalty, logit_bias)
    return _ops.sampling_probs(logits, t, k, p, mp, st, hist, pen, bias)


@torch.library.register_fake("arkernels::sampling_probs")
def _(logits, temperature, top_k, top_p, min_p, token_state=None, history=None, penalties=None, logit_bias=None):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def sampling_rules(
    logits: torch.Tensor,
    *,
    token_state: torch.Tensor | None = None,
    history_rows: torch.Tensor | None = None,
    new_tokens: int | torch.Tensor = 0,
    min_new_tokens: int | torch.Tensor = 0,
    repetition_penalty: float | torch.Tensor = 1.0,
    frequency_penalty: float | torch.Tensor = 0.0,
    presence_penalty: float | torch.Tensor = 0.0,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The processed logits :func:`sample` and :func:`sampling_probs` see: the token rules (module docstring) on
    the sanitised logits, one streaming pass (the sampler itself applies them inside its own passes).

    Args:
        logits: ``[batch, vocab]`` float32, float16 or bfloat16; rows may be strided.
        {rules}

    Returns:
        fp32 ``[batch, vocab]``: NaN -> -inf, +inf -> the largest float, -0.0 -> +0.0, then the rules.
    """
    op = "sampling_rules"
    expect(isinstance(logits, torch.Tensor) and logits.dim() == 2, op,
           f"logits must be a [batch, vocab] tensor, got {getattr(logits, 'shape', type(logits))}")
    expect(logits.dtype in _FLOATS, op, f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    st, hist, pen, bias = rule_tensors(op, logits, token_state, history_rows, new_tokens, min_new_tokens,
                                 repetition_penalty, frequency_penalty, presence_penalty, logit_bias)
    return _ops.sampling_rules(logits, st, hist, pen, bias)


@torch.library.register_fake("arkernels::sampling_rules")
def _(logits, token_state, history, penalties, logit_bias):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def sample(
    logits: torch.Tensor,
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row (temperature -> top-k -> top-p -> min-p), with no sort and no host sync.

    Args:
        logits, temperature, top_k, top_p, min_p: as in :func:`sampling_probs`.
        seed: int or int64 ``[batch]``: row ``b``'s draw is a pure function of its logits, parameters,
            ``seed[b]`` and ``step[b]``, whatever the batch around it. None: per-row seeds are drawn from
            ``generator`` (or torch's default generator) on the logits' device, so ``torch.manual_seed``
            makes runs reproducible.
        step: int or int64 ``[batch]`` (may be a device tensor, e.g. under CUDA graphs): a fresh draw per step.
        generator: the source of seeds when ``seed`` is None.
        return_valid: also return ``valid``.
        {rules}
            The rules run inside the sampler's passes (no extra pass, no host sync); a row's draw then also
            depends on its history, still never on the batch around it. ``update_token_state`` counts the draw.

    Returns:
        ids int64 ``[batch]`` in ``[0, vocab)``; with ``return_valid``, ``(ids, valid)`` where ``valid`` is
        bool ``[batch]``, False for a row with no finite logit (its id is 0).
    """
    op = "sample"
    t, k, p, mp = sampler_params(op, logits, temperature, top_k, top_p, min_p)
    batch, dev = logits.shape[0], logits.device
    seed, step = seed_and_step(op, seed, step, generator, batch, dev)
    st, hist, pen, bias = rule_tensors(op, logits, token_state, history_rows, new_tokens, min_new_tokens,
                                       repetition_penalty, frequency_penalty, presence_penalty, logit_bias)
    ids, valid = _ops.sample(logits, t, k, p, mp, seed, step, st, hist, pen, bias)
    return (ids, valid) if return_valid else ids


@torch.library.register_fake("arkernels::sample")
def _(logits, temperature, top_k, top_p, min_p, seed, step, token_state=None, history=None, penalties=None,
      logit_bias=None):
    batch = logits.shape[0]
    return logits.new_empty((batch,), dtype=torch.int64), logits.new_empty((batch,), dtype=torch.bool)


for _f in (sampling_probs, sampling_rules, sample):
    _f.__doc__ = _f.__doc__.replace("{rules}", _RULES_DOC)


# ---------------------------------------------------------------------------------------------------------
# Kernel registrations: argument checks shared by both devices, then the Triton (CUDA) or torch (CPU) kernel
# ---------------------------------------------------------------------------------------------------------
def _check(op, logits, temperature, top_k, top_p, min_p, seed=None, step=None):
    expect(logits.dim() == 2, op, f"logits must be 2-D [batch, vocab], got {tuple(logits.shape)}", RuntimeError)
    expect(logits.dtype in _FLOATS, op, f"logits must be float32, float16 or bfloat16, got {logits.dtype}",
           RuntimeError)
    batch = logits.shape[0]
    named = [("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
             ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32)]
    if seed is not None:
        named += [("seed", seed, torch.int64), ("step", step, torch.int64)]
    for name, t, dtype in named:
        expect(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}", RuntimeError)
        expect(t.dim() == 1 and t.shape[0] == batch, op,
               f"{name} must be [batch={batch}], got {tuple(t.shape)}", RuntimeError)
        expect(t.device == logits.device, op, f"{name} is on {t.device}, logits on {logits.device}", RuntimeError)
    # columns must be contiguous for the kernel; strided rows are fine
    return logits if logits.shape[1] <= 1 or logits.stride(1) == 1 else logits.contiguous()


def _check_rules(op, logits, token_state, history, penalties, logit_bias):
    """The token-rule tensors of the ops: dtypes, shapes, devices; returns them contiguous (None stays None)."""
    batch, vocab = logits.shape
    named = [("token_state", token_state, torch.int32, None), ("logit_bias", logit_bias, torch.float32, None),
             ("history", history, torch.int64, (batch, 3)), ("penalties", penalties, torch.float32, (batch, 3))]
    rows = None
    for name, t, dtype, shape in named:
        if t is None:
            continue
        expect(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}", RuntimeError)
        expect(t.device == logits.device, op, f"{name} is on {t.device}, logits on {logits.device}", RuntimeError)
        if shape is None:
            expect(t.dim() == 2 and t.shape[1] == vocab, op,
                   f"{name} must be [rows, vocab={vocab}], got {tuple(t.shape)}", RuntimeError)
            expect(rows is None or rows == t.shape[0], op, "token_state and logit_bias must have the same rows",
                   RuntimeError)
            rows = t.shape[0]
        else:
            expect(tuple(t.shape) == shape, op, f"{name} must be [batch={batch}, 3], got {tuple(t.shape)}",
                   RuntimeError)
    expect(rows is None or history is not None, op, "history is required with token_state or logit_bias",
           RuntimeError)
    return tuple(None if t is None else t.contiguous() for t in (token_state, history, penalties, logit_bias))


def _sample_cuda(logits, temperature, top_k, top_p, min_p, seed, step, token_state=None, history=None,
                 penalties=None, logit_bias=None):
    logits = _check("sample", logits, temperature, top_k, top_p, min_p, seed, step)
    rules = _check_rules("sample", logits, token_state, history, penalties, logit_bias)
    return sample_triton(logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
                         min_p.contiguous(), seed.contiguous(), step.contiguous(), *rules)


def _sampling_probs_cuda(logits, temperature, top_k, top_p, min_p, token_state=None, history=None, penalties=None,
                         logit_bias=None):
    logits = _check("sampling_probs", logits, temperature, top_k, top_p, min_p)
    rules = _check_rules("sampling_probs", logits, token_state, history, penalties, logit_bias)
    return sampling_probs_triton(logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
                                 min_p.contiguous(), *rules)


def _check_rules_logits(op, logits):
    expect(logits.dim() == 2, op, f"logits must be 2-D [batch, vocab], got {tuple(logits.shape)}", RuntimeError)
    expect(logits.dtype in _FLOATS, op, f"logits must be float32, float16 or bfloat16, got {logits.dtype}",
           RuntimeError)
    return logits if logits.shape[1] <= 1 or logits.stride(1) == 1 else logits.contiguous()


def _sampling_rules_cuda(logits, token_state, history, penalties, logit_bias):
    logits = _check_rules_logits("sampling_rules", logits)
    return sampling_rules_triton(logits, *_check_rules("sampling_rules", logits, token_state, history, penalties,
                                                       logit_bias))


def _sampling_rules_cpu(logits, token_state, history, penalties, logit_bias):
    logits = _check_rules_logits("sampling_rules", logits)
    return sampling_rules_cpu(logits, *_check_rules("sampling_rules", logits, token_state, history, penalties,
                                                    logit_bias))


def _sampling_probs_cpu(logits, temperature, top_k, top_p, min_p, token_state=None, history=None, penalties=None,
                        logit_bias=None):
    logits = _check("sampling_probs", logits, temperature, top_k, top_p, min_p)
    rules = _check_rules("sampling_probs", logits, token_state, history, penalties, logit_bias)
    return sampling_probs_cpu(logits, temperature, top_k, top_p, min_p, *rules)


def _sample_cpu(logits, temperature, top_k, top_p, min_p, seed, step, token_state=None, history=None,
                penalties=None, logit_bias=None):
    logits = _check("sample", logits, temperature, top_k, top_p, min_p, seed, step)
    rules = _check_rules("sample", logits, token_state, history, penalties, logit_bias)
    return sample_cpu(logits, temperature, top_k, top_p, min_p, seed, step, *rules)


torch.library.register_kernel("arkernels::sample", "cuda", _sample_cuda)
torch.library.register_kernel("arkernels::sampling_probs", "cuda", _sampling_probs_cuda)
torch.library.register_kernel("arkernels::sample", "cpu", _sample_cpu)
torch.library.register_kernel("arkernels::sampling_probs", "cpu", _sampling_probs_cpu)
torch.library.register_kernel("arkernels::sampling_rules", "cuda", _sampling_rules_cuda)
torch.library.register_kernel("arkernels::sampling_rules", "cpu", _sampling_rules_cpu)


# ---------------------------------------------------------------------------------------------------------
# logprobs (vLLM's two meanings): from the raw logits or from the distribution the row draws from
# ---------------------------------------------------------------------------------------------------------
def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of the sanitised logits (NaN -> -inf, +inf -> the largest float), fp32 ``[batch, vocab]``;
    a row with no finite logit is all -inf (never NaN). One extra pass over the logits (not fused)."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x).clamp(max=_FLT_MAX)
    lp = torch.log_softmax(x, dim=-1)
    return torch.where(torch.isnan(lp), float("-inf"), lp)


def top_logprobs(lp: torch.Tensor, ids: torch.Tensor, n: int):
    """Per row: the chosen token's logprob and rank, and the top ``n`` (id, logprob), from fp32 logprobs ``[batch,
    vocab]`` (no full sort: one ``topk`` over an exact int64 key).

    Returns ``(chosen fp32 [batch], rank int64 [batch], top_ids int64 [batch, n], top_lp fp32 [batch, n])``.
    ``rank`` is vLLM's: the number of tokens whose logprob is >= the chosen one's (1 for the most likely; ties count
    against it). Top-n entry ``j`` has rank ``j + 1``; equal logprobs are ordered by the lowest token id first (the
    key is the order-preserving int32 image of the fp32 logprob, then ``vocab - 1 - id``: unique, so ``topk`` is
    exact whatever its own tie order)."""
    batch, vocab = lp.shape
    ids = ids.reshape(-1, 1).to(torch.int64)
    chosen = lp.gather(1, ids)
    rank = (lp >= chosen).sum(dim=1)
    b = lp.contiguous().view(torch.int32).to(torch.int64)
    key = torch.where(b >= 0, b, b ^ 0x7FFFFFFF) * (1 << 32) + (vocab - 1 - torch.arange(vocab, device=lp.device))
    n = min(n, vocab)
    top_ids = torch.topk(key, n, dim=1).indices if n > 0 else ids.new_empty(batch, 0)
    return chosen[:, 0], rank, top_ids, lp.gather(1, top_ids)


SEED_STRIDE = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: consecutive samples' seeds land far apart


def wrap64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64."""
    x &= 2**64 - 1
    return x - 2**64 if x >= 2**63 else x


def seed_stream(seed: int, n: int) -> list[int]:
    """The seeds of ``n`` samples that share one seed: sample ``j`` draws with ``seed + j * SEED_STRIDE`` (int64,
    wrapping), so sample 0 keeps ``seed`` and every sample has its own random stream (``arkernels.generate``'s
    ``num_return_sequences``, the patched sampler's rows)."""
    return [wrap64(seed + j * SEED_STRIDE) for j in range(n)]
