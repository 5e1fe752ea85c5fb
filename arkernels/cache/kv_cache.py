"""A paged KV cache in Python: per-layer cache tensors over one ``BlockAllocator``.

Sequences own lists of blocks; ``fork`` shares a prefix by reference count and copies a shared, partly filled last
block on the first write (copy-on-write).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arkernels.cache.allocator import BlockAllocator, OutOfBlocksError
from arkernels.cache.fp8 import per_layer_scales
from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    """Per-layer paged K/V pools plus per-sequence block tables and lengths.

    Typical step: ``slots = cache.reserve(seq_ids, new_tokens)`` once, then for every layer
    ``cache.append(layer, key, value, slots)``, then ``cache.block_table(seq_ids)`` and
    ``cache.seq_lens(seq_ids)`` for the attention kernel.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu", *,
                 k_scale: float | list[float] | None = None, v_scale: float | list[float] | None = None):
        """``dtype=torch.float8_e4m3fn``: fp8 pools; ``k_scale``/``v_scale`` (a float, or one per layer; required
        then, refused otherwise) become ``self.k_scales[layer]`` / ``self.v_scales[layer]``, fp32 ``[1]`` tensors on
        ``device`` (they may be overwritten in place, e.g. by ``calibrate_kv_scale``)."""
        if block_size <= 0:
            raise ValueError(f"PagedKVCache: block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        fp8 = dtype == torch.float8_e4m3fn
        ks = per_layer_scales("PagedKVCache", "k_scale", k_scale, num_layers, dtype)
        vs = per_layer_scales("PagedKVCache", "v_scale", v_scale, num_layers, dtype)
        if fp8 and (None in ks or None in vs):
            raise ValueError("PagedKVCache: an fp8 cache needs k_scale and v_scale (a float or one per layer)")
        self.k_scales = [torch.tensor([x], dtype=torch.float32, device=device) for x in ks] if fp8 else None
        self.v_scales = [torch.tensor([x], dtype=torch.float32, device=device) for x in vs] if fp8 else None
        self._seqs: dict[int, _Sequence] = {}

    # ---- sequences -------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"PagedKVCache: sequence {seq_id} already exists")
        self._seqs[seq_id] = _Sequence()

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as a copy of ``parent`` sharing all its blocks (no data copied now)."""
        src = self._seq(parent)
        if child in self._seqs:
            raise ValueError(f"PagedKVCache: sequence {child} already exists")
        self._seqs[child] = _Sequence(self.allocator.fork(src.blocks), src.length)

    def free_sequence(self, seq_id: int) -> None:
        self.allocator.free(self._seq(seq_id).blocks)
        del self._seqs[seq_id]

    def seq_len(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def blocks(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).blocks)

    def _seq(self, seq_id: int) -> _Sequence:
        if seq_id not in self._seqs:
            raise KeyError(f"PagedKVCache: no sequence {seq_id}")
        return self._seqs[seq_id]

    # ---- appending -------------------------------------------------------------------------------------
    def reserve(self, seq_ids: list[int], num_new: list[int]) -> torch.Tensor:
        """Make room for ``num_new[i]`` more tokens of each sequence and return their slots.

        Returns int64 ``[sum(num_new)]`` slots, sequence by sequence, on the cache's device. All or nothing:
        when the pool cannot hold every request, raises ``OutOfBlocksError`` and changes nothing.
        """
        if len(seq_ids) != len(num_new) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("PagedKVCache.reserve: seq_ids must be distinct and match num_new one to one")
        bs = self.block_size
        need, cow = 0, []
        for sid, n in zip(seq_ids, num_new):
            s = self._seq(sid)
            if n < 0:
                raise ValueError(f"PagedKVCache.reserve: num_new must be >= 0, got {n}")
            need += -(-(s.length + n) // bs) - len(s.blocks)
            # A shared, partly filled last block must be copied before it is written (copy-on-write).
            if n > 0 and s.length % bs and self.allocator.refcount(s.blocks[-1]) > 1:
                cow.append(s)
                need += 1
        if need > self.allocator.num_free:
            raise OutOfBlocksError(
                f"PagedKVCache: {need} more blocks needed but {self.allocator.num_free} are free; "
                "no sequence was changed"
            )
        for s in cow:
            old, (new,) = s.blocks[-1], self.allocator.allocate(1)
            for k, v in zip(self.k_caches, self.v_caches):
                k[new].copy_(k[old])
                v[new].copy_(v[old])
            self.allocator.free([old])
            s.blocks[-1] = new
        slots = []
        for sid, n in zip(seq_ids, num_new):
            s = self._seq(sid)
            extra = -(-(s.length + n) // bs) - len(s.blocks)
            s.blocks += self.allocator.allocate(extra)
            for pos in range(s.length, s.length + n):
                slots.append(s.blocks[pos // bs] * bs + pos % bs)
            s.length += n
        return torch.tensor(slots, dtype=torch.int64, device=self.k_caches[0].device)

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
        """int32 ``[len(seq_ids), width]`` (default: the longest table), padded with -1."""
        rows = [self._seq(s).blocks for s in seq_ids]
        width = max((len(r) for r in rows), default=0) if width is None else width
        table = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.k_caches[0].device)

    def seq_lens(self, seq_ids: list[int]) -> torch.Tensor:
        """int32 ``[len(seq_ids)]``."""
        lens = [self._seq(s).length for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.k_caches[0].device)

    def gather(self, layer: int, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key, value)`` ``[len(seq_ids), num_kv_heads, max_len, head_dim]`` of one layer, zero-padded (fp8
        caches: dequantized to float32)."""
        lens = self.seq_lens(seq_ids)
        return paged_kv_gather(self.k_caches[layer], self.v_caches[layer], self.block_table(seq_ids), lens,
                               max((self._seq(s).length for s in seq_ids), default=0), **self._scales(layer),
                               check=False)
