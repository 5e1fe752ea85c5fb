"""Block tables: which blocks of the K/V pools each row (sequence) holds, and how rows advance, share and shrink.

``BlockTable`` is the bookkeeping under ``arkernels.hf.cache.PagedCache`` (one per group of layers that see the same
positions) and under ``arkernels.cache.kv_cache.PagedKVCache`` (one, of fixed capacity): block lists, lengths, the int32
table the attention kernels read, copy-on-write, sliding-window freeing, fork / select / truncate / release, and the
fixed-shape reservation that torch.compile and CUDA graphs replay. Torch only: the pools belong to its owners.
"""
from __future__ import annotations

import torch

from arkernels.cache.allocator import SCRATCH_BLOCK, BlockAllocator, OutOfBlocksError


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a host wait: on CUDA through pinned memory and a non-blocking copy
    (a pageable copy waits for the stream to drain); elsewhere the host tensor itself."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # the pinned block is reused only after the copy ends
    return t.to(device)


def _grow_allocator(old: BlockAllocator, num_blocks: int) -> BlockAllocator:
    """A bigger ``BlockAllocator`` with the same blocks taken, the same reference counts, through its public API."""
    new = BlockAllocator(num_blocks)
    taken = new.allocate(old.num_blocks)  # ids 0 .. old.num_blocks-1, low ids first
    new.free([b for b in taken if old.refcount(b) == 0])
    for b in taken:
        for _ in range(old.refcount(b) - 1):
            new.fork([b])
    return new


def static_inputs(*tensors: torch.Tensor, dynamic: tuple = ()) -> None:
    """Tell torch.compile these cache tensors live at fixed addresses for the cache's life (CUDA graphs then read them
    in place instead of copying them in, as transformers' StaticCache does), and that the dims in ``dynamic``
    (``(tensor, dim)`` pairs: pool blocks, table width, which follow each call's length) are sizes one compiled graph
    serves for every call."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        torch._dynamo.mark_static_address(t)
    for t, d in dynamic:
        torch._dynamo.maybe_mark_dynamic(t, d)


class BlockTable:
    """The block bookkeeping of layers that see the same positions (the full-attention layers, or the sliding layers of
    one window W): what one set of K/V pools ``[num_blocks, block_size, Hkv, D]`` per layer is addressed by.

    Owns: a ``BlockAllocator`` (block ids, reference counts), per row the list of its block ids (None where a sliding
    row freed one out of the window) and its length, and the int32 block table ``[rows, capacity]`` the attention
    kernels read. It holds no K/V: the pools belong to its ``owners`` (objects with ``grow_pools(num_blocks)`` and
    ``copy_block(old, new) -> bytes copied``), which it asks to grow when the allocator does and to copy a block on
    copy-on-write, so it never imports the transformers integration.

    Invariants:
    - ``SCRATCH_BLOCK`` (0) is allocated at ``init`` and never handed to a row: every table entry that is not one of a
      row's blocks (past its length, freed out of the window, a released row) is ``SCRATCH_BLOCK``, so a kernel that
      reads one reads memory the pools own.
    - ``table[r, i] == rows[r][i]`` for every block a row holds; ``len(rows[r]) * block_size >= lens[r]``.
    - A block held by k rows has reference count k (``select_rows`` / ``fork_row`` share, never copy); a row writes into
      a shared, partly filled last block only after ``advance`` gave it a private copy (copy-on-write).
    - A sliding row (``window`` W, not ``record_past``) holds no block lying wholly before its first visible key
      (``lens[r] - W + 1``) after ``advance``.
    - ``generation`` changes whenever the table or the pools are reallocated (CUDA graphs captured before are stale).

    Two ways to advance: ``advance`` (host: per-forward block reservation, ragged rows) and, after ``init_fixed``, the
    fixed-shape reservation (every block of the call up front; ``advance_fixed_host`` / ``advance_fixed_device``)
    until ``unfix`` hands the rows to the host path for good.

    Capacity: by default (``grow=True``, the transformers cache) the allocator doubles when ``advance`` needs more
    blocks than are free, and the owners' pools follow (``grow_pools``). ``grow=False`` (``PagedKVCache``; needs
    ``num_blocks`` and window 0) fixes the capacity at ``num_blocks`` blocks besides ``SCRATCH_BLOCK``: an ``advance``
    that does not fit raises ``OutOfBlocksError`` before it changes anything (rows, lengths, table, reference counts,
    pools).
    """

    def __init__(self, window: int, block_size: int, max_length: int | None, num_blocks: int | None, *,
                 grow: bool = True):
        if not grow and (window or num_blocks is None):
            raise ValueError("BlockTable: grow=False needs num_blocks and window 0 (out-of-window freeing would change "
                             f"the rows before the capacity check); got num_blocks={num_blocks}, window={window}")
        self.window, self.block_size, self.grow = window, block_size, grow
        self.max_length, self.num_blocks_hint = max_length, num_blocks
        self.owners: list = []  # the pools' owners: grow_pools(num_blocks), copy_block(old, new) -> bytes
        self.allocator: BlockAllocator | None = None
        self.rows: list[list[int | None]] = []  # per row: block ids, None where freed out of the window
        self.lens: list[int] = []
        self.table: torch.Tensor | None = None  # int32 [rows, capacity]
        self.slots: torch.Tensor | None = None  # int64 [tokens of this forward]
        self.plan: tuple[list[int], list[int]] | None = None  # (rows, q_lens) of the last advance; None: stale
        self.forward_start: list[int] = []  # lens before this forward (per row of the plan)
        # what the owners derived from this forward's table (PagedCache: the attention's PagedStep, and a static
        # decode step's (slots, step)); opaque here, dropped whenever the rows change
        self.step = None
        self.static = None
        self.generation = 0  # +1 whenever the table or the pools are reallocated
        self.record_past = False  # sliding: keep out-of-window blocks until crop (transformers' rollback protocol)
        self.bytes_copied = 0  # K/V bytes copied by copy-on-write (every owner's pools, K and V)
        self.kept_from = 0  # sliding: the first position DynamicSlidingWindowLayer would still hold (readable keys)
        # fixed shapes (PagedCache(compileable=True)): every block of the call reserved at the first forward, the rows'
        # lengths advance on the device (dev_lens); False once the table runs on the host path (``unfix``)
        self.fixed = False
        self.ring = 0  # fixed sliding table: blocks a row, reused in turn (logical block i lives in rows[r][i % ring])
        self.dev_lens: torch.Tensor | None = None  # int32 [rows]: each row's length after the last forward
        self.fixed_cu: torch.Tensor | None = None  # int32 [rows+1]: query layout of a fixed multi-token forward

    # ---- allocation ----------------------------------------------------------------------------------------
    def init(self, batch: int, first_tokens: int, like: torch.Tensor) -> None:
        bs = self.block_size
        if self.num_blocks_hint is not None:
            n = self.num_blocks_hint
        else:
            span = self.max_length or first_tokens
            if self.window:
                span = min(span, self.window - 1 + max(first_tokens, 1)) + bs  # +1 block: a window straddles two
            n = batch * -(-max(span, 1) // bs) + 1
        self.allocator = BlockAllocator(n + 1)
        assert self.allocator.allocate(1) == [SCRATCH_BLOCK]
        self.rows = [[] for _ in range(batch)]
        self.lens = [0] * batch
        cap = -(-max(self.max_length or first_tokens, 1) // bs)
        self.table = torch.full((batch, cap), SCRATCH_BLOCK, dtype=torch.int32, device=like.device)

    # ---- fixed shapes: reserved once, advanced on the device (compileable) -----------------------------------------
    def init_fixed(self, batch: int, first_tokens: int, like: torch.Tensor) -> None:
        """Reserve every block of the call (``max_length`` positions per row) and build the table once.

        Full attention: ``ceil(max_length / block_size)`` blocks per row. Sliding window W: a ring of
        ``(W + T0 - 2) // block_size + 2`` blocks per row (T0: this first forward's tokens), enough that the keys any
        query of a forward of at most T0 tokens can see (W - 1 back, plus the forward's own) lie in distinct blocks; the
        table's logical entry i points at ring block ``i % ring``, so the attention kernel and the slot arithmetic see a
        plain block table and the window's memory stays bounded as in the host path."""
        bs = self.block_size
        width = -(-max(self.max_length, first_tokens, 1) // bs)
        ring = width
        if self.window:
            ring = min((self.window + max(first_tokens, 1) - 2) // bs + 2, width)
            self.ring = ring
        self.allocator = BlockAllocator(batch * ring + 1)
        assert self.allocator.allocate(1) == [SCRATCH_BLOCK]
        self.rows = [self.allocator.allocate(ring) for _ in range(batch)]
        self.lens = [0] * batch
        table = torch.tensor(self.rows, dtype=torch.int64)[:, torch.arange(width) % ring]
        pos = torch.arange(width * bs)
        dev = like.device
        self.table = table.to(torch.int32).contiguous().to(dev)
        # the slot of every position of every row, computed once: a step's slots are one gather at the lengths (8 bytes
        # per position and row, against the K/V's 2 * Hkv * D elements per layer)
        self.slot_of = (table[:, pos // bs] * bs + pos % bs).to(dev)
        self.dev_lens = torch.zeros(batch, dtype=torch.int32, device=dev)  # what the attention kernel reads
        self.dev_pos = torch.zeros((batch, 1), dtype=torch.int64, device=dev)  # the same lengths as a gather index
        self.capacity = width * bs
        # the longest forward whose keys (W - 1 back, plus its own) lie in distinct ring blocks
        self.max_forward = (ring - 1) * bs - self.window + 1 if ring < width else self.capacity
        self.fixed = True
        static_inputs(self.table, self.slot_of, self.dev_lens, self.dev_pos,
                       dynamic=((self.table, 1), (self.slot_of, 1)))

    def fits(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` more tokens per row stays within the fixed reservation (rows advance
        together on a fixed cache)."""
        return self.lens[0] + tokens <= self.capacity and tokens <= self.max_forward

    def advance_fixed_host(self, tokens: int) -> None:
        """Host half of a fixed forward: the host's copy of the lengths (what get_seq_length / get_mask_sizes report)."""
        self.lens = [n + tokens for n in self.lens]
        if self.window and not self.record_past:
            self.kept_from = max(self.lens[0] - self.window + 1, 0)

    def advance_fixed_device(self, tokens: int) -> None:
        """Device half of a fixed forward (tensor ops only: graph-safe, no host data): each row's slots from its length
        on the device, then the lengths advance in place (the attention then reads the whole table and those lengths)."""
        pos = self.dev_pos
        if tokens == 1:
            self.slots = self.slot_of.gather(1, pos).view(-1)
        else:
            self.slots = self.slot_of.gather(1, pos + torch.arange(tokens, device=pos.device)).view(-1)
            rows = pos.shape[0]
            self.fixed_cu = torch.arange(0, (rows + 1) * tokens, tokens, dtype=torch.int32, device=pos.device)
        pos.add_(tokens)
        self.dev_lens.add_(tokens)

    def unfix(self) -> None:
        """Hand the table to the host path: per-row logical block lists, unused reservations back to the pool."""
        if not self.fixed:
            return
        self.fixed = False
        bs = self.block_size
        for r, L in enumerate(self.lens):
            blocks, last = self.rows[r], (L - 1) // bs if L else -1
            if self.ring:  # logical blocks still intact in the ring: the last `ring` ones
                lo = max(last - self.ring + 1, 0)
                logical = [None] * lo + [blocks[i % self.ring] for i in range(lo, last + 1)]
            else:
                lo, logical = 0, blocks[: last + 1]
            kept = {b for b in logical if b is not None}
            self.allocator.free([b for b in blocks if b not in kept])
            self.rows[r] = logical
            self.table[r].fill_(SCRATCH_BLOCK)
            if last >= lo:
                self.table[r, lo: last + 1] = torch.tensor(logical[lo:], dtype=torch.int32, device=self.table.device)
        self.ring, self.dev_lens, self.dev_pos, self.slot_of = 0, None, None, None
        self.plan = self.step = None
        self.generation += 1

    def _ensure_free(self, need: int) -> None:
        if need <= self.allocator.num_free:
            return
        if not self.grow:
            raise OutOfBlocksError(
                f"BlockTable: {need} more blocks needed but {self.allocator.num_free} of "
                f"{self.allocator.num_blocks - 1} are free (fixed capacity); nothing was changed"
            )
        old_n = self.allocator.num_blocks
        new_n = max(2 * old_n, old_n + need - self.allocator.num_free)
        self.allocator = _grow_allocator(self.allocator, new_n)
        for owner in self.owners:
            owner.grow_pools(new_n)
        self.generation += 1

    def _ensure_width(self, width: int) -> None:
        if width > self.table.shape[1]:
            extra = max(width, 2 * self.table.shape[1]) - self.table.shape[1]
            pad = torch.full((self.table.shape[0], extra), SCRATCH_BLOCK, dtype=torch.int32, device=self.table.device)
            self.table = torch.cat([self.table, pad], dim=1)
            self.generation += 1

    def advance(self, rows: list[int], q_lens: list[int], make_slots: bool = True, ahead: int = 0) -> None:
        """Free out-of-window blocks, reserve slots for ``q_lens[i]`` new tokens of each row; one call per forward.
        ``make_slots=False`` (static decode) leaves ``self.slots`` unset: the caller computes them on the host.
        ``ahead``: when a row needs a new block, also reserve the blocks of its next ``ahead`` tokens (capped at
        ``max_length``; full-attention groups only), so most steps write no block-table entry at all."""
        bs, W = self.block_size, self.window
        dirty = False
        cap = self.max_length if ahead and not W and self.max_length else 0
        if W and not self.record_past:
            for r in rows:
                self._free_out_of_window(r)
        # copy-on-write: a row about to write into a partly filled last block that other rows share (beams forked by
        # reorder_cache / batch_repeat_interleave) gets its own copy first; the last owner writes in place
        cow = [r for r, n in zip(rows, q_lens)
               if n > 0 and self.lens[r] % bs and self.allocator.refcount(self.rows[r][-1]) > 1]
        reach = []  # blocks each row holds after this call
        for r, n in zip(rows, q_lens):
            end = self.lens[r] + n
            if cap and -(-end // bs) > len(self.rows[r]):  # a new block is due: take the next `ahead` tokens' too
                end = max(min(end + ahead, cap), end)
            reach.append(-(-end // bs))
        need = sum(max(k - len(self.rows[r]), 0) for r, k in zip(rows, reach)) + len(cow)
        self._ensure_free(need)
        for r in cow:
            if self.allocator.refcount(self.rows[r][-1]) > 1:  # an earlier copy may have left this row the last owner
                self._copy_last_block(r)
        self._ensure_width(max(reach, default=0))
        writes = ([], [], [])  # (row, column, block) of every new table entry: one host-to-device copy for all
        for r, k in zip(rows, reach):
            extra = k - len(self.rows[r])
            if extra > 0:
                new = self.allocator.allocate(extra)
                start = len(self.rows[r])
                self.rows[r] += new
                writes[0].extend([r] * extra)
                writes[1].extend(range(start, start + extra))
                writes[2].extend(new)
                dirty = True
        if dirty:
            idx = to_device(writes, torch.int64, self.table.device)
            self.table[idx[0], idx[1]] = idx[2].to(torch.int32)
        self.forward_start = [self.lens[r] for r in rows]
        for r, n in zip(rows, q_lens):
            self.lens[r] += n
        if W and not self.record_past:  # a DynamicSlidingWindowLayer keeps W - 1 keys unless recording its past
            self.kept_from = max(max(self.lens) - W + 1, 0)
        self.plan = (rows, q_lens)
        self.slots = self._slots(rows, q_lens, dirty) if make_slots else None

    def _free_out_of_window(self, r: int) -> None:
        """Return row ``r``'s blocks that lie wholly before the earliest key its next query can see."""
        bs, blocks = self.block_size, self.rows[r]
        first_visible = self.lens[r] - self.window + 1
        done = [i for i in range(min(len(blocks), max(first_visible, 0) // bs)) if blocks[i] is not None]
        if done:
            self.allocator.free([blocks[i] for i in done])
            for i in done:
                blocks[i] = None
            self.table[r, done[0]: done[-1] + 1] = SCRATCH_BLOCK

    def _copy_last_block(self, r: int) -> None:
        """Give row ``r`` a private copy of its shared last block, in every owner's pools (copy-on-write)."""
        old = self.rows[r][-1]
        (new,) = self.allocator.allocate(1)
        for owner in self.owners:
            self.bytes_copied += owner.copy_block(old, new)
        self.allocator.free([old])
        self.rows[r][-1] = new
        self.table[r, len(self.rows[r]) - 1] = new

    # ---- beam search, parallel samples, rollback: block-table rows and reference counts, no K/V copy -----------
    def select_rows(self, indices: list[int]) -> None:
        """Row ``i`` becomes old row ``indices[i]`` (repeats allowed): the rows share its blocks by reference count;
        a shared, partly filled last block is copied only when a row writes to it (``advance``)."""
        if self.allocator is None:
            return
        for i in indices:  # take the new references before dropping the old ones: shared blocks never hit 0
            self.allocator.fork([b for b in self.rows[i] if b is not None])
        for blocks in self.rows:
            self.allocator.free([b for b in blocks if b is not None])
        self.rows = [list(self.rows[i]) for i in indices]
        self.lens = [self.lens[i] for i in indices]
        self.table = self.table.index_select(0, torch.tensor(indices, dtype=torch.int64, device=self.table.device))
        self.plan = self.step = None
        self.generation += 1

    def truncate(self, new_len: int) -> None:
        """Every row back to ``new_len`` positions: whole blocks past it return to the pool. A sliding table then drops
        what falls out of the window of ``new_len`` (what ``DynamicSlidingWindowLayer.crop`` keeps: W - 1 keys)."""
        if self.allocator is None:
            return
        bs = self.block_size
        keep = -(-new_len // bs)
        for r, blocks in enumerate(self.rows):
            if len(blocks) > keep:
                self.allocator.free([b for b in blocks[keep:] if b is not None])
                del blocks[keep:]
                self.table[r, keep:] = SCRATCH_BLOCK
            self.lens[r] = min(self.lens[r], new_len)
            if self.window:
                self._free_out_of_window(r)
        if self.window:
            self.kept_from = max(new_len - self.window + 1, 0)
        self.plan = self.step = None

    def truncate_row(self, r: int, new_len: int) -> None:
        """Row ``r`` back to ``new_len`` positions (speculative decoding's rollback of rejected drafts): whole blocks
        past it return to the pool, nothing is copied. A sliding row keeps what it holds: the blocks ``advance`` freed
        lay before the first key its last forward's first query saw, so none of them is visible again."""
        if self.allocator is None or new_len >= self.lens[r]:
            return
        keep = -(-new_len // self.block_size)
        blocks = self.rows[r]
        if len(blocks) > keep:
            self.allocator.free([b for b in blocks[keep:] if b is not None])
            del blocks[keep:]
            self.table[r, keep:] = SCRATCH_BLOCK
        self.lens[r] = new_len
        self.plan = self.step = None

    def _slots(self, rows, q_lens, dirty) -> torch.Tensor:
        bs = self.block_size
        dev = self.table.device
        if all(n == 1 for n in q_lens):
            ridx, pos = to_device([rows, self.forward_start], torch.int64, dev)
            return self.table[ridx, pos // bs].to(torch.int64) * bs + pos % bs
        slots = []
        for r, n, start in zip(rows, q_lens, self.forward_start):
            pos = torch.arange(start, start + n, device=dev)
            slots.append(self.table[r, pos // bs].to(torch.int64) * bs + pos % bs)
        return torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64, device=dev)

    def fork_row(self, src: int, dst: int) -> None:
        """Row ``dst`` (empty) starts as a copy of row ``src`` sharing its blocks (reference counts, no K/V copy)."""
        self.release_row(dst)
        self.rows[dst] = list(self.rows[src])
        self.allocator.fork([b for b in self.rows[dst] if b is not None])
        self.lens[dst] = self.lens[src]
        self.table[dst] = self.table[src]

    def add_row(self) -> int:
        """Append an empty row (no blocks, length 0, every table entry ``SCRATCH_BLOCK``); returns its index. Host path
        only (a fixed table's rows are reserved once, by ``init_fixed``)."""
        if self.fixed:
            raise RuntimeError("BlockTable.add_row: a fixed-shape table has its rows reserved by init_fixed")
        self.rows.append([])
        self.lens.append(0)
        pad = torch.full((1, self.table.shape[1]), SCRATCH_BLOCK, dtype=torch.int32, device=self.table.device)
        self.table = torch.cat([self.table, pad])
        self.plan = self.step = None
        self.generation += 1
        return len(self.rows) - 1

    def release_row(self, r: int) -> None:
        """Return all blocks of row ``r`` to the pool (the row's length becomes 0)."""
        self.allocator.free([b for b in self.rows[r] if b is not None])
        self.rows[r] = []
        self.lens[r] = 0
        if not any(self.lens):
            self.kept_from = 0
        self.table[r].fill_(SCRATCH_BLOCK)

    @property
    def blocks_in_use(self) -> int:
        return 0 if self.allocator is None else self.allocator.num_blocks - 1 - self.allocator.num_free

