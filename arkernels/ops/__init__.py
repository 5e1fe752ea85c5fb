"""Typed Python wrappers of the arkernels ops, one module per stem; importing them registers the Triton
kernels and the fake (meta) implementations."""
from arkernels.ops import int8_matmul, paged_kv, sampling, window_attention  # noqa: F401
