"""Loads the compiled op library (``arkernels._C``) and reports what it holds."""
import torch

from arkernels import _C  # noqa: F401  (registers the arkernels:: ops with torch)

OPS = (
    "paged_kv_append",
    "paged_kv_gather",
    "window_attention",
    "sampling_probs",
    "sample",
    "quantize_rowwise",
    "int8_matmul",
    "w8a16_matmul",
)


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"arkernels::{op}", key)


def cuda_kernels_built() -> bool:
    """True when this build carries the hand-written CUDA kernels (decided by the toolkit at build time,
    not by a visible GPU)."""
    return _has_kernel("paged_kv_append", "CUDA")


def kernels_report() -> dict:
    """``{op: [dispatch keys with a kernel]}`` for every arkernels op (after the Python registrations)."""
    import arkernels.ops  # noqa: F401  (Triton ops register their kernels on import)

    return {op: [k for k in ("CPU", "CUDA") if _has_kernel(op, k)] for op in OPS}
