"""A paged KV cache in Python: per-layer K/V pools over one ``BlockTable`` (window 0, fixed capacity).

The table does the block bookkeeping: sequences own lists of blocks, ``fork`` shares a prefix by reference count, and a
shared, partly filled last block is copied on the first write (copy-on-write, ``BlockTable.advance``). Block 0 is
``SCRATCH_BLOCK``, as in the transformers cache and vLLM's block pool: never handed to a sequence, so padding entries of
a block table point at memory the pools own.
"""
from __future__ import annotations

import torch

from arkernels.cache.allocator import SCRATCH_BLOCK, BlockAllocator, OutOfBlocksError
from arkernels.cache.fp8 import per_layer_scales
from arkernels.cache.table import BlockTable
from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather


class PagedKVCache:
    """Per-layer paged K/V pools ``[num_blocks, block_size, num_kv_heads, head_dim]`` plus, in one ``BlockTable``
    (``self.table``), per-sequence block lists and lengths. Sequence ids are any ints; each maps to a table row
    (released rows are reused).

    Block 0 (``SCRATCH_BLOCK``) is reserved: ``num_blocks - 1`` blocks hold tokens, and ``block_table`` pads with 0.
    The capacity is fixed: a ``reserve`` that does not fit raises ``OutOfBlocksError`` and changes nothing.

    Typical step: ``slots = cache.reserve(seq_ids, new_tokens)`` once, then for every layer
    ``cache.append(layer, key, value, slots)``, then ``cache.block_table(seq_ids)`` and
    ``cache.seq_lens(seq_ids)`` for the attention kernel.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu", *,
                 k_scale: float | list[float] | None = None, v_scale: float | list[float] | None = None):
        """``num_blocks`` (>= 2) blocks per pool, block 0 of them the scratch block. ``dtype=torch.float8_e4m3fn``:
        fp8 pools; ``k_scale``/``v_scale`` (a float, or one per layer; required then, refused otherwise) become
        ``self.k_scales[layer]`` / ``self.v_scales[layer]``, fp32 ``[1]`` tensors on ``device`` (they may be
        overwritten in place, e.g. by ``calibrate_kv_scale``)."""
        if block_size <= 0:
            raise ValueError(f"PagedKVCache: block_size must be > 0, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"PagedKVCache: num_blocks must be >= 2 (block 0 is the scratch block), got {num_blocks}")
        fp8 = dtype == torch.float8_e4m3fn
        ks = per_layer_scales("PagedKVCache", "k_scale", k_scale, num_layers, dtype)
        vs = per_layer_scales("PagedKVCache", "v_scale", v_scale, num_layers, dtype)
        if fp8 and (None in ks or None in vs):
            raise ValueError("PagedKVCache: an fp8 cache needs k_scale and v_scale (a float or one per layer)")
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scales = [torch.tensor([x], dtype=torch.float32, device=device) for x in ks] if fp8 else None
        self.v_scales = [torch.tensor([x], dtype=torch.float32, device=device) for x in vs] if fp8 else None
        self.table = BlockTable(0, block_size, None, num_blocks - 1, grow=False)  # + SCRATCH_BLOCK: num_blocks
        self.table.init(0, 1, torch.empty(0, device=device))  # no rows yet: add_sequence adds them
        self.table.owners.append(self)
        self._rows: dict[int, int] = {}  # seq_id -> table row
        self._free_rows: list[int] = []  # released rows, reused by the next new sequence

    @property
    def allocator(self) -> BlockAllocator:
        """The table's block ids and reference counts (block 0, ``SCRATCH_BLOCK``, is always taken)."""
        return self.table.allocator

    # ---- the table's owner protocol: the pools follow the table -----------------------------------------------
    def grow_pools(self, num_blocks: int) -> None:
        """Every layer's K and V pool to ``num_blocks`` blocks, contents kept (unused: the capacity is fixed)."""
        for pools in (self.k_caches, self.v_caches):
            for i, old in enumerate(pools):
                pools[i] = torch.zeros((num_blocks, *old.shape[1:]), dtype=old.dtype, device=old.device)
                pools[i][: old.shape[0]] = old

    def copy_block(self, old: int, new: int) -> int:
        """Copy-on-write: block ``old`` into block ``new`` in every layer's K and V pool; returns the bytes copied."""
        for pool in (*self.k_caches, *self.v_caches):
            pool[new].copy_(pool[old])
        return sum(p[new].numel() * p.element_size() for p in (*self.k_caches, *self.v_caches))

    # ---- sequences -------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self._new_row(seq_id)

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as a copy of ``parent`` sharing all its blocks (no data copied now)."""
        src = self._row(parent)
        self.table.fork_row(src, self._new_row(child))

    def free_sequence(self, seq_id: int) -> None:
        r = self._row(seq_id)
        self.table.release_row(r)
        del self._rows[seq_id]
        self._free_rows.append(r)

    def seq_len(self, seq_id: int) -> int:
        return self.table.lens[self._row(seq_id)]

    def blocks(self, seq_id: int) -> list[int]:
        return list(self.table.rows[self._row(seq_id)])

    def _row(self, seq_id: int) -> int:
        if seq_id not in self._rows:
            raise KeyError(f"PagedKVCache: no sequence {seq_id}")
        return self._rows[seq_id]

    def _new_row(self, seq_id: int) -> int:
        if seq_id in self._rows:
            raise ValueError(f"PagedKVCache: sequence {seq_id} already exists")
        r = self._free_rows.pop() if self._free_rows else self.table.add_row()
        self._rows[seq_id] = r
        return r

    # ---- appending -------------------------------------------------------------------------------------
    def reserve(self, seq_ids: list[int], num_new: list[int]) -> torch.Tensor:
        """Make room for ``num_new[i]`` more tokens of each sequence and return their slots.

        Returns int64 ``[sum(num_new)]`` slots, sequence by sequence, on the cache's device. All or nothing:
        when the pool cannot hold every request, raises ``OutOfBlocksError`` and changes nothing.
        """
        if len(seq_ids) != len(num_new) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("PagedKVCache.reserve: seq_ids must be distinct and match num_new one to one")
        rows = [self._row(s) for s in seq_ids]
        for n in num_new:
            if n < 0:
                raise ValueError(f"PagedKVCache.reserve: num_new must be >= 0, got {n}")
        try:
            self.table.advance(rows, list(num_new))
        except OutOfBlocksError as err:
            raise OutOfBlocksError(f"PagedKVCache.reserve: {str(err).removeprefix('BlockTable: ')}") from None
        return self.table.slots

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` of one layer at ``reserve``'s slots."""
        paged_kv_append(key, value, self.k_caches[layer], self.v_caches[layer], slot_mapping,
                        **self._scales(layer), check=False)

    def _scales(self, layer: int) -> dict:
        if self.k_scales is None:
            return {}
        return dict(k_scale=self.k_scales[layer], v_scale=self.v_scales[layer])

    # ---- reading ---------------------------------------------------------------------------------------
    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """int32 ``[len(seq_ids), width]`` (default: the longest table; at least 1 column), padded with
        ``SCRATCH_BLOCK`` (0): a read of padding lands in the scratch block, which the pools own."""
        rows = [self._row(s) for s in seq_ids]
        longest = max((len(self.table.rows[r]) for r in rows), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"PagedKVCache.block_table: width {width} is shorter than a sequence's {longest} blocks")
        src = self.table.table
        out = torch.full((len(rows), max(width, 1)), SCRATCH_BLOCK, dtype=torch.int32, device=src.device)
        cols = min(out.shape[1], src.shape[1])  # the table's entries past a row's blocks are SCRATCH_BLOCK too
        out[:, :cols] = src[torch.tensor(rows, dtype=torch.int64, device=src.device), :cols]
        return out

    def seq_lens(self, seq_ids: list[int]) -> torch.Tensor:
        """int32 ``[len(seq_ids)]``."""
        lens = [self.table.lens[self._row(s)] for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.k_caches[0].device)

    def gather(self, layer: int, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key, value)`` ``[len(seq_ids), num_kv_heads, max_len, head_dim]`` of one layer, zero-padded (fp8
        caches: dequantized to float32)."""
        lens = self.seq_lens(seq_ids)
        return paged_kv_gather(self.k_caches[layer], self.v_caches[layer], self.block_table(seq_ids), lens,
                               max((self.seq_len(s) for s in seq_ids), default=0), **self._scales(layer),
                               check=False)
