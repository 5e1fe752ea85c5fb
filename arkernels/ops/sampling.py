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

The CUDA kernels are the Triton kernels in arkernels/triton/sampling.py (``sample``: truncate to <= 4096
candidates, then search; ``sampling_probs``: the full-row search); the CPU kernel (below the fakes) is a
vectorised torch version of the same thresholds, using the same hash, so both draw the same tokens.
"""
from __future__ import annotations

import torch

from arkernels import _library  # noqa: F401  (loads the op library: the schemas live in csrc/torch_bindings.cpp)
from arkernels.ops._checks import expect, per_row
from arkernels.triton.sampling import _row_key_torch, _uniform_torch, sample_triton, sampling_probs_triton

_ops = torch.ops.arkernels
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FLT_MAX = torch.finfo(torch.float32).max


def _params(op, logits, temperature, top_k, top_p, min_p):
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
) -> torch.Tensor:
    """The filtered, renormalised distribution that :func:`sample` draws from.

    Args:
        logits: ``[batch, vocab]`` float32, float16 or bfloat16; rows may be strided (a padded vocabulary).
        temperature: number or fp32 ``[batch]``, ``>= 0``; 0: greedy (a one-hot row).
        top_k: int or int ``[batch]``, ``>= 0``; 0 or ``>= vocab``: off.
        top_p: number or fp32 ``[batch]`` in ``(0, 1]``; 1: off.
        min_p: number or fp32 ``[batch]`` in ``[0, 1]``; 0: off.

    Returns:
        fp32 ``[batch, vocab]``, each row summing to 1, or all zeros for a row with no finite logit.
    """
    t, k, p, mp = _params("sampling_probs", logits, temperature, top_k, top_p, min_p)
    return _ops.sampling_probs(logits, t, k, p, mp)


@torch.library.register_fake("arkernels::sampling_probs")
def _(logits, temperature, top_k, top_p, min_p):
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

    Returns:
        ids int64 ``[batch]`` in ``[0, vocab)``; with ``return_valid``, ``(ids, valid)`` where ``valid`` is
        bool ``[batch]``, False for a row with no finite logit (its id is 0).
    """
    op = "sample"
    t, k, p, mp = _params(op, logits, temperature, top_k, top_p, min_p)
    batch, dev = logits.shape[0], logits.device
    if seed is None:
        gdev = generator.device if generator is not None else dev
        seed = torch.randint(-2**63, 2**63 - 1, (batch,), dtype=torch.int64, device=gdev, generator=generator)
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, (float, bool)) or (isinstance(value, torch.Tensor) and value.is_floating_point()):
            what = value.dtype if isinstance(value, torch.Tensor) else repr(value)  # built only on failure
            expect(False, op, f"{name} must be an int or an int64 [batch] tensor, got {what}")
    seed = per_row(op, "seed", seed, batch, torch.int64, dev)
    step = per_row(op, "step", step, batch, torch.int64, dev)
    ids, valid = _ops.sample(logits, t, k, p, mp, seed, step)
    return (ids, valid) if return_valid else ids


@torch.library.register_fake("arkernels::sample")
def _(logits, temperature, top_k, top_p, min_p, seed, step):
    batch = logits.shape[0]
    return logits.new_empty((batch,), dtype=torch.int64), logits.new_empty((batch,), dtype=torch.bool)


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


def _sample_cuda(logits, temperature, top_k, top_p, min_p, seed, step):
    logits = _check("sample", logits, temperature, top_k, top_p, min_p, seed, step)
    return sample_triton(logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
                         min_p.contiguous(), seed.contiguous(), step.contiguous())


def _sampling_probs_cuda(logits, temperature, top_k, top_p, min_p):
    logits = _check("sampling_probs", logits, temperature, top_k, top_p, min_p)
    return sampling_probs_triton(logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
                                 min_p.contiguous())


def _keep_cpu(logits, temperature, top_k, top_p, min_p):
    """The kernel's filter on the CPU, vectorised over the batch: returns ``(z, e, keep, arg, valid,
    sampled)``, all ``[batch, vocab]`` or ``[batch]``. Same thresholds as the Triton kernels (only float
    sums are taken in another order)."""
    batch, vocab = logits.shape
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x).clamp(max=_FLT_MAX)
    m, arg = x.max(dim=1)  # ties: torch.max returns the first maximal index
    valid = m > float("-inf")
    sampled = valid & (temperature > 0)
    T = torch.where(sampled, temperature, 1.0)
    mm = torch.where(valid, m, 0.0)[:, None]
    z = (x - mm) / T[:, None]
    e = torch.exp(z)

    # top-k: the k-th largest logit, ties kept
    tk = torch.full((batch,), float("-inf"))
    use_k = sampled & (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        kmax = int(top_k[use_k].max())
        vals = torch.topk(x[use_k], kmax, dim=1).values
        tk[use_k] = vals.gather(1, (top_k[use_k].long() - 1)[:, None])[:, 0]
    in_k = x >= tk[:, None]

    # top-p over the top-k set, compared the way transformers' TopPLogitsWarper does: fp32 probabilities
    # e / mass summed from the bottom, a token dropped iff the mass strictly below it plus its own is
    # <= 1 - top_p (ties: the group is kept when its top member would be). tp is the largest z whose mass
    # strictly below is <= 1 - top_p. Tokens with probability < (1 - p) / vocab hold < 1 - p together, so
    # all are dropped: only the others are sorted (a handful for a peaked row), the rest enter as one sum.
    tp = torch.full((batch,), float("-inf"))
    use_p = sampled & (top_p < 1)
    if bool(use_p.any()):
        rows = use_p.nonzero()[:, 0]
        eK = torch.where(in_k[rows], e[rows], 0.0)
        pr = eK / eK.sum(dim=1, keepdim=True)
        q = 1 - top_p[rows]  # fp32, as transformers' fp32 cumsum against 1 - top_p
        cand = in_k[rows] & (pr >= (q / vocab * (1 - 1e-3))[:, None])
        n_cand = int(cand.sum(dim=1).max())
        rest = torch.where(cand, 0.0, pr).sum(dim=1)
        vals, idx = torch.topk(torch.where(cand, z[rows], float("-inf")), n_cand, dim=1)
        vals, idx = vals.flip(1), idx.flip(1)  # ascending, as transformers' cumsum
        pc = torch.where(vals > float("-inf"), pr.gather(1, idx), 0.0)
        below = rest[:, None] + (pc.cumsum(dim=1) - pc)
        tp[rows] = torch.where(below <= q[:, None], vals, float("-inf")).max(dim=1).values

    keep = sampled[:, None] & in_k & (z >= tp[:, None]) & (e >= min_p[:, None])
    return z, e, keep, arg, valid, sampled


def _sampling_probs_cpu(logits, temperature, top_k, top_p, min_p):
    logits = _check("sampling_probs", logits, temperature, top_k, top_p, min_p)
    z, e, keep, arg, valid, sampled = _keep_cpu(logits, temperature, top_k, top_p, min_p)
    kept = torch.where(keep, e, 0.0)
    probs = kept / kept.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    onehot = torch.zeros_like(probs).scatter_(1, arg[:, None], 1.0) * valid[:, None]
    return torch.where(sampled[:, None], probs, onehot)


def _sample_cpu(logits, temperature, top_k, top_p, min_p, seed, step):
    logits = _check("sample", logits, temperature, top_k, top_p, min_p, seed, step)
    vocab = logits.shape[1]
    z, e, keep, arg, valid, sampled = _keep_cpu(logits, temperature, top_k, top_p, min_p)
    ids = arg.clone()
    rows = sampled.nonzero()[:, 0]
    if rows.numel() > 0:
        # exponential race over the kept tokens: argmax z - log(E), E = -log(U), U from the shared hash.
        # U lies in [2^-25, 1 - 2^-25], so -log(E) lies in [-2.85, 17.33]: the maximum (z = 0) scores
        # >= -2.86 and a token with z < -20.5 can never win. Hashing only the tokens that can win skips
        # most of the vocabulary (the hash is ~20 int64 ops per element) and changes no draw.
        r, c = (keep[rows] & (z[rows] >= -20.5)).nonzero(as_tuple=True)
        u = _uniform_torch(_row_key_torch(seed[rows], step[rows])[r], c)
        score = torch.full((rows.numel(), vocab), float("-inf"))
        score[r, c] = z[rows][r, c] - torch.log(-torch.log(u))
        ids[rows] = score.argmax(dim=1)
    return ids, valid


torch.library.register_kernel("arkernels::sample", "cuda", _sample_cuda)
torch.library.register_kernel("arkernels::sampling_probs", "cuda", _sampling_probs_cuda)
torch.library.register_kernel("arkernels::sample", "cpu", _sample_cpu)
torch.library.register_kernel("arkernels::sampling_probs", "cpu", _sampling_probs_cpu)
