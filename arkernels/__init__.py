"""arkernels: hand-written GPU kernels for fast autoregressive decoding of Hugging Face models.

Ops (CPU and CUDA/Triton kernels behind one schema each, see csrc/torch_bindings.cpp):
paged_kv_append, paged_kv_gather, window_attention, window_attention_dense, sample, sampling_probs,
chain_speculative_sampling,
quantize_per_channel, quantize_per_token, int8_matmul, w8a16_matmul, w8a16_fragment_matmul.
Modules: PagedKVCache, BlockAllocator, Int8Linear. Model-level: patch, generate, quantize, fuse_projections.
"""
from arkernels._library import cuda_kernels_built
from arkernels.cache import BlockAllocator, OutOfBlocksError, PagedKVCache
from arkernels.ops import kernels_report
from arkernels.ops.int8_matmul import (int8_matmul, quantize_per_channel, quantize_per_token, w8a16_fragment_matmul,
                                       w8a16_matmul)
from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather
from arkernels.ops.sampling import (logit_bias_table, sample, sampling_probs, sampling_rules, token_state,
                                    update_token_state)
from arkernels.ops.spec_sampling import chain_speculative_sampling
from arkernels.ops.window_attention import window_attention, window_attention_dense
from arkernels.quant import Int8Linear, load_quantized, quantize, save_quantized
from arkernels.hf.patch import patch
from arkernels.fuse import fuse_projections
from arkernels.decode import generate

__version__ = "0.1.0"

__all__ = [
    "BlockAllocator", "Int8Linear", "OutOfBlocksError", "PagedKVCache", "chain_speculative_sampling", "cuda_kernels_built",
    "fuse_projections",
    "generate", "int8_matmul", "kernels_report", "load_quantized", "paged_kv_append", "paged_kv_gather", "patch",
    "quantize", "quantize_per_channel", "quantize_per_token", "sample", "sampling_probs", "sampling_rules", "token_state", "update_token_state", "logit_bias_table", "save_quantized",
    "w8a16_fragment_matmul", "w8a16_matmul", "window_attention", "window_attention_dense", "__version__",
]
