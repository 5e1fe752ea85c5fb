"""Loads the compiled op library (``arkernels._C``) and names the ops it defines (``kernels_report`` lives in
``arkernels.ops``: it needs the Triton registrations, and ops/* import this module)."""
import torch

from arkernels import _C  # noqa: F401  (registers the arkernels:: ops with torch)

# every arkernels:: schema of csrc/torch_bindings.cpp, in its order (tests/test_imports.py checks it)
OPS = (
    "paged_kv_append",
    "paged_kv_gather",
    "window_attention",
    "sampling_rules",
    "sampling_probs",
    "sample",
    "chain_speculative_sampling",
    "quantize_rowwise",
    "int8_matmul",
    "w8a16_matmul",
    "w8a16_fragment_matmul",
)


def has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"arkernels::{op}", key)


def cuda_kernels_built() -> bool:
    """True when this build carries the hand-written CUDA kernels (decided by the toolkit at build time,
    not by a visible GPU)."""
    return has_kernel("paged_kv_append", "CUDA")

