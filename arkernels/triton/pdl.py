"""Programmatic dependent launch (PDL, sm_90 and later) for the Triton kernels.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it on the stream is still
running (once all of that kernel's programs have called ``gdc_launch_dependents`` or exited), so its launch latency
hides behind that kernel's tail. ``pdl_enter`` is the first thing such a kernel does: ``griddepcontrol.wait`` (the
kernel before it has completed and its writes are visible: nothing may be read or written before it, the inputs
included) then ``griddepcontrol.launch_dependents`` (the kernel after it may launch in turn; the wait there still
orders every access after this kernel's completion). Compiled out (``PDL`` is a constexpr) under TRITON_INTERPRET,
before sm_90 and on a Triton without grid dependency control: ``pdl_supported`` decides on the host.
"""
import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: pdl_supported is False, PDL never set
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one, then let the kernel after it launch (PDL only; nothing otherwise)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def pdl_capable(device: torch.device) -> bool:
    """A CUDA device of compute capability >= 9 (``griddepcontrol`` is sm_90 PTX) and a Triton that has it."""
    return gdc_wait is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` may launch with PDL: ``pdl_capable``, not interpreted, and not switched off
    (``ARKERNELS_PDL=0``). Every Triton launcher asks this one function."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return os.environ.get("ARKERNELS_PDL", "1") != "0" and pdl_capable(device)
