"""Shared test set-up. Without a GPU, Triton kernels run in interpreter mode on CPU tensors; the switch
must be set before triton is first imported, so it lives here.

Devices the hand-written CUDA ops are tested on:
- "cpu": the CPU kernels (csrc/<stem>_cpu.cpp);
- "simt": the CUDA kernels' own source run by the SIMT emulator (arkernels/simt.py) on CPU tensors. The parameter
  is a str equal to "cpu" (tensors are created on the CPU) whose type marks it; an autouse fixture wraps such tests
  in `arkernels.simt.emulate()`. Without an emulator build these skip, unless ARKERNELS_SIMT_REQUIRED=1 (the test
  command sets it whenever it could build the emulator), where they fail;
- "cuda": the CUDA kernels on a GPU, when one is visible.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


class SimtDevice(str):
    """"cpu" for torch, "simt" for the tests: the CUDA source through the emulator."""

    def __new__(cls):
        return super().__new__(cls, "cpu")


SIMT = SimtDevice()
_simt = pytest.param(SIMT, id="simt", marks=pytest.mark.simt)
_cuda = pytest.param("cuda", marks=pytest.mark.cuda)
# Devices every op test runs on: the CPU kernel always, the CUDA source in the emulator, the CUDA kernel on a GPU.
DEVICES = ["cpu", _simt, _cuda]
# Devices that run the CUDA kernels (tests of CUDA-only behaviour: refusals, grid/shared-memory planning).
CUDA_KERNEL_DEVICES = [_simt, _cuda]
# The emulator alone (what only it can observe: global-memory traffic per byte).
SIMT_DEVICES = [_simt]


def runs_cuda_kernel(device) -> bool:
    """True when `device` runs the hand-written CUDA kernels (on a GPU or in the emulator)."""
    return isinstance(device, SimtDevice) or device == "cuda"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by benchmarks/gpu_check.sh)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _simt_emulation(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or not any(isinstance(v, SimtDevice) for v in callspec.params.values()):
        yield
        return
    import arkernels.simt

    if not arkernels.simt.available():
        if os.environ.get("ARKERNELS_SIMT_REQUIRED") == "1":
            pytest.fail(f"ARKERNELS_SIMT_REQUIRED=1 but the emulator library does not load "
                        f"({arkernels.simt.library_path()})")
        pytest.skip("SIMT emulator not built (python -m arkernels.simt build)")
    with arkernels.simt.emulate():
        yield
