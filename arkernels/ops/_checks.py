"""Argument checks shared by every Python wrapper: one helper, so every op words its errors alike."""
from __future__ import annotations

import math

import torch


def eager_checks(check: bool) -> bool:
    """Whether a wrapper should run its value checks: ``check`` and not inside ``torch.compile`` tracing.

    The value checks read index tensors back to the host (``bool(bad.any())``, ``.nonzero()``), which dynamo cannot
    trace under ``fullgraph=True`` (a data-dependent branch). Compiled code skips them; the kernels never read or
    write outside the cache whatever the indices (each wrapper's docstring says how), so a bad index there gives
    masked keys / skipped slots, never memory corruption. Run the function eagerly once to get the errors."""
    return check and not torch.compiler.is_compiling()


def expect(cond: bool, op: str, msg: str, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc("<op>: <msg>")`` when ``cond`` is false."""
    if not cond:
        raise exc(f"{op}: {msg}")


def per_row(op: str, name: str, value, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A Python number or a ``[batch]`` tensor as a contiguous ``[batch]`` tensor of ``dtype`` on ``device``."""
    if isinstance(value, torch.Tensor):
        expect(value.dim() == 1 and value.shape[0] == batch, op,
               f"{name} must be a number or a [batch={batch}] tensor, got shape {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).contiguous()
    return torch.full((batch,), value, dtype=dtype, device=device)


def check_scales(op: str, **scales: torch.Tensor | None) -> None:
    """fp8 cache scales (one-element float tensors; their shape and dtype are the op's own check) must be positive
    and finite: 0 stores NaN or +-448 for every element, a negative one flips signs. One host sync per scale."""
    for name, s in scales.items():
        if s is None or s.numel() != 1 or not s.is_floating_point():
            continue
        v = float(s.reshape(()))
        expect(math.isfinite(v) and v > 0, op, f"{name} must be positive and finite, got {v}")
