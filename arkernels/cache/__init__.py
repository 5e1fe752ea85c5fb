"""The paged KV cache without transformers: block ids (``allocator``), block tables (``table``), fp8 scales (``fp8``)
and a per-layer cache over them (``kv_cache``)."""
from arkernels.cache.allocator import SCRATCH_BLOCK, BlockAllocator, OutOfBlocksError
from arkernels.cache.kv_cache import PagedKVCache
from arkernels.cache.table import BlockTable

__all__ = ["SCRATCH_BLOCK", "BlockAllocator", "BlockTable", "OutOfBlocksError", "PagedKVCache"]
