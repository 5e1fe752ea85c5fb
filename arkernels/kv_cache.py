"""A paged KV cache in Python: a reference-counted block pool and per-layer cache tensors.

One ``BlockAllocator`` hands out block ids; a block id addresses the same block in every layer's
``[num_blocks, block_size, num_kv_heads, head_dim]`` pool (the vLLM design: one table per sequence, not
one per layer). Sequences own lists of blocks; ``fork`` shares a prefix by reference count and copies a
shared, partly filled last block on the first write (copy-on-write).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather


# fp8 KV cache (vLLM's convention): stored = saturate_e4m3(x / scale). A calibrated scale maps the prompt's absmax to
# K_RANGE (keys) / V_RANGE (values) rather than to e4m3's largest value 448: vLLM's calculate_kv_scales defaults
# (K_SCALE_CONSTANT=200, V_SCALE_CONSTANT=100), which leave 2.2x / 4.5x headroom for decode tokens larger than any in
# the prompt before they saturate; e4m3's relative precision is the same across its normal range, so the headroom
# costs only the smallest values (below 2^-6 * scale they become subnormal). Floored so that an all-zero layer does
# not divide by 0.
FP8_MAX = 448.0
K_RANGE = 200.0
V_RANGE = 100.0
MIN_KV_SCALE = 1e-6


def calibrate_kv_scale(x: torch.Tensor, target: float = FP8_MAX) -> torch.Tensor:
    """fp32 ``[1]`` on ``x``'s device: ``max(absmax(x) / target, 1e-6)``, computed there (no host sync)."""
    return (x.detach().abs().amax().float() / target).clamp(min=MIN_KV_SCALE).reshape(1)


def kv_cache_dtype_of(owner: str, kv_cache_dtype) -> torch.dtype | None:
    """"auto" / None -> None (the model's dtype); "fp8" / "fp8_e4m3" / torch.float8_e4m3fn -> float8_e4m3fn."""
    if kv_cache_dtype in (None, "auto"):
        return None
    if kv_cache_dtype in ("fp8", "fp8_e4m3", torch.float8_e4m3fn):
        return torch.float8_e4m3fn
    raise ValueError(f"{owner}: kv_cache_dtype must be 'auto' or 'fp8' (float8_e4m3fn), got {kv_cache_dtype!r}")


def per_layer_scales(owner: str, name: str, scale, num_layers: int, dtype: torch.dtype | None) -> list:
    """A float, one float per layer, or None (calibrate) -> a list of ``num_layers`` floats or Nones."""
    if scale is None:
        return [None] * num_layers
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"{owner}: {name} is only taken with an fp8 KV cache (kv_cache_dtype='fp8')")
    values = [float(scale)] * num_layers if isinstance(scale, (int, float)) else [float(x) for x in scale]
    if len(values) != num_layers:
        raise ValueError(f"{owner}: {name} must be a float or one float per layer ({num_layers}), got {len(values)}")
    bad = [v for v in values if not (v > 0 and v < float("inf"))]
    if bad:
        raise ValueError(f"{owner}: {name} must be positive and finite, got {bad[0]}")
    return values


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs. Nothing was allocated or changed."""


class BlockAllocator:
    """Reference-counted pool of block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"BlockAllocator: num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (refcount 1), or ``OutOfBlocksError`` with nothing taken."""
        if n > len(self._free):
            raise OutOfBlocksError(
                f"BlockAllocator: need {n} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share ``blocks`` with one more owner (each refcount + 1); returns a new list of the same ids."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"BlockAllocator.fork: block {b} is not allocated")
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 returns to the pool."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"BlockAllocator.free: block {b} is not allocated (double free?)")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


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
