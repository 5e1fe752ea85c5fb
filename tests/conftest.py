"""Shared test set-up. Without a GPU, Triton kernels run in interpreter mode on CPU tensors; the switch
must be set before triton is first imported, so it lives here."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()

# Devices every op test runs on: the CPU kernel always, the CUDA kernel when a GPU is visible.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by benchmarks/gpu_check.sh)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
