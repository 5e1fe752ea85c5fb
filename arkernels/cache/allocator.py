"""Block ids: a reference-counted pool (``BlockAllocator``) and the one "no block" value (``SCRATCH_BLOCK``).

A block id addresses the same block in every layer's ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool (the
vLLM design: one table per sequence, not one per layer).
"""
from __future__ import annotations

# reserved in every pool (the transformers cache, PagedKVCache), never handed to a row: unused table entries point here
SCRATCH_BLOCK = 0


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
