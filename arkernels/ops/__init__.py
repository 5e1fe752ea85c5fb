"""Typed Python wrappers of the arkernels ops, one module per stem; importing them registers the Triton
kernels and the fake (meta) implementations."""
from arkernels.ops import int8_matmul, paged_kv, sampling, spec_sampling, window_attention  # noqa: F401
from arkernels._library import OPS, has_kernel


def kernels_report() -> dict:
    """``{op: [dispatch keys with a kernel]}`` for every arkernels op (after the Python registrations above)."""
    return {op: [k for k in ("CPU", "CUDA") if has_kernel(op, k)] for op in OPS}
