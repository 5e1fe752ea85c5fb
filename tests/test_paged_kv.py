"""paged_kv_append / paged_kv_gather against the naive reference: exact (pure data movement)."""
import mmap

import pytest
import torch

import arkernels
from arkernels.cache import SCRATCH_BLOCK, BlockTable
from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather
from arkernels.reference.paged_kv import paged_kv_append_ref, paged_kv_gather_ref
from conftest import DEVICES, SIMT_DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [8, 64, 80, 96, 128, 256]
BLOCK_SIZES = [1, 8, 16, 32, 13]  # 13: not a power of two
NUM_KV_HEADS = [1, 3]
SENTINEL = -7.0  # caches are poisoned with this before every call


def _cache(num_blocks, block_size, heads, head_dim, dtype, device):
    shape = (num_blocks, block_size, heads, head_dim)
    return (torch.full(shape, SENTINEL, dtype=dtype, device=device),
            torch.full(shape, SENTINEL, dtype=dtype, device=device))


def _slots(num_tokens, num_slots, n, gen):
    """n distinct random slots, two of them padding (-1)."""
    slots = torch.randperm(num_slots, generator=gen)[:n].long()
    if n >= 3:
        slots[1] = -1
        slots[n - 1] = -5
    return slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_kv_append_grid(device, dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim * 31 + block_size)
    heads, num_blocks, num_tokens = 3, 7, 19
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype).to(device)
    n = min(num_tokens - 2, num_blocks * block_size)  # a short slot_mapping: tokens past n are padding
    slots = _slots(num_tokens, num_blocks * block_size, n, gen).to(device)
    for slot_dtype in (torch.int32, torch.int64):
        k, v = _cache(num_blocks, block_size, heads, head_dim, dtype, device)
        k_ref, v_ref = k.clone(), v.clone()
        paged_kv_append(key, value, k, v, slots.to(slot_dtype))
        paged_kv_append_ref(key, value, k_ref, v_ref, slots)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kv_append_strided_inputs(device, dtype):
    """key/value as slices of a fused qkv output: strided rows, contiguous head_dim."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, head_dim, block_size = 11, 2, 80, 16
    qkv = torch.randn(tokens, 3 * heads + 1, head_dim, generator=gen).to(dtype).to(device)
    key, value = qkv[:, heads:2 * heads], qkv[:, 2 * heads + 1:]
    assert not key.is_contiguous()
    slots = torch.tensor([5, 0, -1, 17, 31, 2, 3, 40, 41, 63, 9], device=device)
    k, v = _cache(4, block_size, heads, head_dim, dtype, device)
    k_ref, v_ref = k.clone(), v.clone()
    paged_kv_append(key, value, k, v, slots)
    paged_kv_append_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_kv_append_misaligned_takes_scalar_path(device):
    """A key view starting one element in: not 16-byte aligned, so the scalar path must be exact too."""
    base = torch.randn(5 * 2 * 64 + 1, dtype=torch.float16, device=device)
    key = base[1:].view(5, 2, 64)
    k, v = _cache(2, 4, 2, 64, torch.float16, device)
    k_ref, v_ref = k.clone(), v.clone()
    slots = torch.tensor([7, 0, 3, -1, 6], device=device)
    paged_kv_append(key, key, k, v, slots)
    paged_kv_append_ref(key, key, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def _random_table(lens, block_size, num_blocks, gen, pad=-1):
    need = [-(-n // block_size) for n in lens]
    width = max(need) + 1
    ids = torch.randperm(num_blocks, generator=gen)[: sum(need)].tolist()
    table = torch.full((len(lens), width), pad, dtype=torch.int32)
    for b, k in enumerate(need):
        table[b, :k] = torch.tensor(ids[:k], dtype=torch.int32)
        ids = ids[k:]
    return table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_kv_gather_grid(device, dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    heads = 2
    # ends mid-block, exactly on a block boundary, a single token, and an empty sequence
    lens = [2 * block_size + 3, 3 * block_size, 1, 0]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype).to(device)
    table = _random_table(lens, block_size, num_blocks, gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    got = paged_kv_gather(k, v, table, seq_lens)
    want = paged_kv_gather_ref(k, v, table, seq_lens)
    assert got[0].shape == (len(lens), heads, max(lens), head_dim)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_kv_gather_strided_cache_and_explicit_length(device):
    """A cache that is a strided view (dense [B, S, H, D] permuted from [B, H, S, D]), one block per sequence."""
    dense = torch.randn(3, 2, 10, 64, device=device)  # [B, H, S, D]
    cache = dense.permute(0, 2, 1, 3)  # [num_blocks=B, block_size=S, H, D], non-contiguous
    table = torch.arange(3, dtype=torch.int32, device=device)[:, None]
    lens = torch.tensor([10, 4, 7], dtype=torch.int32, device=device)
    k, v = paged_kv_gather(cache, cache, table, lens, max_seq_len=10)
    k_ref, _ = paged_kv_gather_ref(cache, cache, table, lens, 10)
    assert torch.equal(k, k_ref)
    assert torch.equal(k[0], dense[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_kv_gather_k_and_v_of_different_layouts(device, dtype):
    """k_cache contiguous, v_cache a permuted view (different strides): each is read with its own strides. The CUDA
    gather once refused this (and read v with k's strides) while the CPU kernel accepted it."""
    gen = torch.Generator().manual_seed(5)
    block_size, heads, head_dim = 13, 3, 80
    lens = [2 * block_size + 3, 1, 0]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype).to(device)
    v_dense = torch.randn(num_blocks, heads, block_size, head_dim, generator=gen).to(dtype).to(device)
    v = v_dense.permute(0, 2, 1, 3)  # [num_blocks, block_size, heads, head_dim], strides differ from k's
    assert k.stride() != v.stride()
    table = _random_table(lens, block_size, num_blocks, gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    got = paged_kv_gather(k, v, table, seq_lens)
    want = paged_kv_gather_ref(k, v, table, seq_lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _row_bytes(cache, rows, heads):
    """Per-byte count over cache's storage: 1 for every (slot, head) row of `rows`."""
    nb, bs, hkv, d = cache.shape
    es = cache.element_size()
    want = torch.zeros(cache.untyped_storage().nbytes(), dtype=torch.int32)
    for slot in rows:
        for h in range(heads):
            start = ((slot // bs) * cache.stride(0) + (slot % bs) * cache.stride(1) + h * cache.stride(2)) * es
            want[start:start + d * es] += 1
    return want


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("head_dim", [64, 6])  # 6: 12-byte rows take the element-wise path
def test_paged_kv_append_traffic(device, head_dim):
    """Append writes exactly the bytes it was given, each once, at their slots (none for padding slots), and reads
    each valid token's K/V row once; it never reads the cache (the emulator counts every global access per byte)."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(head_dim)
    heads, block_size = 3, 8
    key = torch.randn(9, heads, head_dim, generator=gen).half()
    value = torch.randn(9, heads, head_dim, generator=gen).half()
    slots = torch.tensor([5, -1, 17, 30, 2, -3, 8, 31])  # 8 of 9 tokens (the 9th is padding); two padding slots
    k, v = _cache(4, block_size, heads, head_dim, torch.float16, device)
    paged_kv_append(key, value, k, v, slots)
    valid = [int(s) for s in slots if s >= 0]
    row = heads * head_dim * 2
    for name, cache in (("k_cache", k), ("v_cache", v)):
        reads, writes = arkernels.simt.traffic_map(name)
        assert int(reads.sum()) == 0 and torch.equal(writes, _row_bytes(cache, valid, heads)), name
    totals = arkernels.simt.traffic()
    assert totals["key"] == totals["value"] == (len(valid) * row, 0)
    assert totals["other"] == (0, 0)


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_paged_kv_gather_traffic(device):
    """Gather reads each cached byte of every sequence once (nothing past a length or in unused blocks) and writes
    each output byte once (zeros past a length)."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(3)
    heads, head_dim, block_size = 2, 64, 8
    lens = [2 * block_size + 3, 1, 0]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).half()
    v = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).half()
    table = _random_table(lens, block_size, num_blocks, gen)
    k_out, v_out = paged_kv_gather(k, v, table, torch.tensor(lens, dtype=torch.int32))
    slots = [int(table[b, j // block_size]) * block_size + j % block_size for b, n in enumerate(lens) for j in range(n)]
    for name, cache in (("k_cache", k), ("v_cache", v)):
        reads, writes = arkernels.simt.traffic_map(name)
        assert int(writes.sum()) == 0 and torch.equal(reads, _row_bytes(cache, slots, heads)), name
    assert arkernels.simt.traffic()["other"] == (0, k_out.numel() * 2 + v_out.numel() * 2)  # outputs, written once


def test_paged_kv_roundtrip_through_allocator():
    cache = arkernels.PagedKVCache(num_layers=2, num_blocks=9, block_size=4, num_kv_heads=2, head_dim=8,
                                   dtype=torch.float32)
    for sid in (0, 1):
        cache.add_sequence(sid)
    slots = cache.reserve([0, 1], [5, 3])
    key = torch.randn(8, 2, 8)
    for layer in range(2):
        cache.append(layer, key * (layer + 1), -key, slots)
    k, v = cache.gather(1, [0, 1])
    assert torch.equal(k[0, :, :5], (2 * key[:5]).transpose(0, 1))
    assert torch.equal(k[1, :, :3], (2 * key[5:]).transpose(0, 1))
    assert torch.equal(k[1, :, 3:], torch.zeros_like(k[1, :, 3:]))


def test_block_allocator_fork_and_copy_on_write():
    cache = arkernels.PagedKVCache(num_layers=1, num_blocks=6, block_size=4, num_kv_heads=1, head_dim=8,
                                   dtype=torch.float32)
    cache.add_sequence(0)
    slots = cache.reserve([0], [6])  # blocks: one full, one half full
    key = torch.randn(6, 1, 8)
    cache.append(0, key, key, slots)
    cache.fork(0, 1)
    assert cache.blocks(1) == cache.blocks(0) == [1, 2]  # low ids first; block 0 (SCRATCH_BLOCK) is never handed out
    assert cache.allocator.num_free == 3  # 6 blocks - the scratch block - the 2 shared ones
    new = cache.reserve([1], [1])  # the shared half block is copied before the child writes into it
    assert cache.blocks(1)[0] == cache.blocks(0)[0] and cache.blocks(1)[1] != cache.blocks(0)[1]
    cache.append(0, torch.ones(1, 1, 8), torch.ones(1, 1, 8), new)
    k0, _ = cache.gather(0, [0])
    k1, _ = cache.gather(0, [1])
    assert torch.equal(k0[0, 0, :6], key[:, 0]) and torch.equal(k1[0, 0, :6], key[:, 0])
    assert torch.equal(k1[0, 0, 6], torch.ones(8))
    cache.free_sequence(0)
    cache.free_sequence(1)
    assert cache.allocator.num_free == 5  # num_blocks - 1: the scratch block stays taken
    assert cache.allocator.refcount(SCRATCH_BLOCK) == 1


def test_out_of_blocks_leaves_sequences_intact():
    cache = arkernels.PagedKVCache(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=8)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.reserve([0], [3])
    before = (cache.blocks(0), cache.seq_len(0), cache.allocator.num_free)
    assert before == ([1, 2], 3, 1)  # 3 usable blocks (block 0 is the scratch block), 2 taken
    with pytest.raises(arkernels.OutOfBlocksError, match="PagedKVCache.reserve: 2 more blocks needed but 1 of 3"):
        cache.reserve([0, 1], [1, 3])
    assert (cache.blocks(0), cache.seq_len(0), cache.allocator.num_free) == before
    assert cache.seq_len(1) == 0
    with pytest.raises(ValueError, match="double free"):
        cache.allocator.free([3])  # the one block nobody holds


def _poisoned_cache(num_layers, num_blocks, block_size, heads, head_dim):
    """A float32 PagedKVCache whose pools hold a distinct value in every element (pool i: 1000 * (i + 1) + index), so a
    copy from the wrong block, layer or pool shows."""
    cache = arkernels.PagedKVCache(num_layers, num_blocks, block_size, heads, head_dim, dtype=torch.float32)
    for i, pool in enumerate((*cache.k_caches, *cache.v_caches)):
        pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view_as(pool) + 1000.0 * (i + 1))
    return cache


def _state(cache, seq_ids):
    """Everything a reserve may change: the pools, the table's rows, lengths and int32 table, every reference count."""
    t, alloc = cache.table, cache.allocator
    return dict(pools=torch.stack([*cache.k_caches, *cache.v_caches]).clone(), table=t.table.clone(),
                rows=[list(r) for r in t.rows], lens=list(t.lens), bytes_copied=t.bytes_copied,
                refs=[alloc.refcount(b) for b in range(alloc.num_blocks)], num_free=alloc.num_free,
                blocks=[cache.blocks(s) for s in seq_ids], seq_lens=cache.seq_lens(seq_ids).tolist(),
                block_table=cache.block_table(seq_ids, width=4))


def _assert_same_state(before, after):
    assert before.keys() == after.keys()
    for name, value in before.items():
        same = torch.equal(value, after[name]) if isinstance(value, torch.Tensor) else value == after[name]
        assert same, name


def test_paged_kv_cache_copy_on_write_copies_one_block_per_layer():
    """A child's first write into a shared, partly filled last block copies exactly that block, in every layer's K and
    V pool (nothing else in the pools changes); the parent's data stays as written; the last owner writes in place."""
    layers, bs, heads, dim = 3, 4, 2, 8
    cache = _poisoned_cache(layers, 7, bs, heads, dim)
    key = torch.randn(6, heads, dim, generator=torch.Generator().manual_seed(3))
    cache.add_sequence(-3)
    slots = cache.reserve([-3], [6])  # one full block, one half full
    for layer in range(layers):
        cache.append(layer, key + layer, -key - layer, slots)
    cache.fork(-3, 40)
    parent, shared = cache.blocks(-3), cache.blocks(-3)[1]
    before = torch.stack([*cache.k_caches, *cache.v_caches]).clone()
    child_slots = cache.reserve([40], [1])
    new = cache.blocks(40)[1]
    assert cache.blocks(40)[0] == parent[0] and new not in (SCRATCH_BLOCK, *parent) and cache.blocks(-3) == parent
    assert cache.table.bytes_copied == 2 * layers * bs * heads * dim * 4  # one fp32 block per K and V pool
    expect = before.clone()
    expect[:, new] = before[:, shared]
    assert torch.equal(torch.stack([*cache.k_caches, *cache.v_caches]), expect)
    assert child_slots.tolist() == [new * bs + 2]
    token = torch.full((1, heads, dim), 5.0)
    for layer in range(layers):
        cache.append(layer, token, token, child_slots)
        k, v = cache.gather(layer, [-3, 40])
        assert torch.equal(k[0, :, :6], (key + layer).transpose(0, 1)) and torch.equal(k[0, :, 6], torch.zeros(2, 8))
        assert torch.equal(v[1, :, :6], (-key - layer).transpose(0, 1)) and torch.equal(v[1, :, 6], token[0])
    assert torch.equal(torch.stack([*cache.k_caches, *cache.v_caches])[:, shared], before[:, shared])
    assert cache.allocator.refcount(shared) == cache.allocator.refcount(new) == 1
    assert cache.reserve([-3], [1]).tolist() == [shared * bs + 2]  # now the last owner: in place, no copy
    assert cache.table.bytes_copied == 2 * layers * bs * heads * dim * 4


def test_paged_kv_cache_reserve_that_does_not_fit_changes_nothing():
    """All or nothing with a copy-on-write due: the child's shared half block (1) and the new sequence's blocks (3)
    need 4 blocks, 3 are free: OutOfBlocksError, and nothing changed. Then the capacity is exactly num_blocks - 1."""
    cache = _poisoned_cache(2, 6, 4, 1, 8)
    cache.add_sequence(7)
    slots = cache.reserve([7], [6])
    for layer in range(2):
        cache.append(layer, torch.ones(6, 1, 8), torch.ones(6, 1, 8), slots)
    cache.fork(7, 8)
    cache.add_sequence(9)
    before = _state(cache, [7, 8, 9])
    with pytest.raises(arkernels.OutOfBlocksError, match="4 more blocks needed but 3 of 5 are free"):
        cache.reserve([8, 9], [1, 9])
    _assert_same_state(before, _state(cache, [7, 8, 9]))
    cache.reserve([8, 9], [1, 8])  # 1 copy + 2 blocks: every usable block is taken now
    held = sorted({b for s in (7, 8, 9) for b in cache.blocks(s)})
    assert cache.allocator.num_free == 0 and held == [1, 2, 3, 4, 5]  # never block 0
    cache.reserve([7], [2])  # fits in its own (no longer shared) last block
    before = _state(cache, [7, 8, 9])
    with pytest.raises(arkernels.OutOfBlocksError, match="1 more blocks needed but 0 of 5 are free"):
        cache.reserve([9], [1])
    _assert_same_state(before, _state(cache, [7, 8, 9]))


def test_paged_kv_cache_any_int_sequence_id():
    """Negative, huge and padding-like (-1) ids each map to their own table row; released rows are reused."""
    ids, lens = [-1, -(2 ** 40), 2 ** 62, 0, 17], [3, 1, 4, 0, 2]
    cache = arkernels.PagedKVCache(1, 12, 2, 1, 8, dtype=torch.float32)
    for s in ids:
        cache.add_sequence(s)
    slots = cache.reserve(ids, lens)
    data = torch.arange(sum(lens) * 8, dtype=torch.float32).view(-1, 1, 8)
    cache.append(0, data, -data, slots)
    k, v = cache.gather(0, ids)
    for i, chunk in enumerate(data.split(lens)):
        assert torch.equal(k[i, 0, : lens[i]], chunk[:, 0]) and torch.equal(v[i, 0, : lens[i]], -chunk[:, 0])
    assert cache.seq_lens(ids).tolist() == lens and [cache.seq_len(s) for s in ids] == lens
    table = cache.block_table(ids, width=3)
    for i, s in enumerate(ids):
        blocks = cache.blocks(s)
        assert len(blocks) == -(-lens[i] // 2) and SCRATCH_BLOCK not in blocks
        assert table[i, : len(blocks)].tolist() == blocks and (table[i, len(blocks):] == SCRATCH_BLOCK).all()
    assert torch.equal(cache.block_table(ids[::-1]), cache.block_table(ids).flip(0))
    cache.free_sequence(2 ** 62)
    cache.free_sequence(-1)
    with pytest.raises(KeyError, match="no sequence -1"):
        cache.seq_len(-1)
    cache.add_sequence(2 ** 62 + 1)
    cache.fork(-(2 ** 40), -1)
    assert cache.seq_len(2 ** 62 + 1) == 0 and cache.blocks(2 ** 62 + 1) == []
    assert cache.blocks(-1) == cache.blocks(-(2 ** 40)) and cache.seq_len(-1) == 1
    assert len(cache.table.rows) == len(ids)  # both new sequences took released rows
    with pytest.raises(ValueError, match="PagedKVCache: sequence 17 already exists"):
        cache.add_sequence(17)


@pytest.mark.parametrize("num_blocks", [1, 0, -3])
def test_paged_kv_cache_needs_two_blocks(num_blocks):
    with pytest.raises(ValueError, match=rf"PagedKVCache: num_blocks must be >= 2 .*got {num_blocks}"):
        arkernels.PagedKVCache(1, num_blocks, 4, 1, 8)


def test_paged_kv_cache_smallest_and_padding():
    """num_blocks=2: one usable block (1); the scratch block pads every table; a width below a table refuses."""
    cache = arkernels.PagedKVCache(1, 2, 4, 1, 8)
    cache.add_sequence(0)
    cache.add_sequence(1)
    assert cache.allocator.num_free == 1 and cache.reserve([0], [4]).tolist() == [4, 5, 6, 7]
    with pytest.raises(arkernels.OutOfBlocksError):
        cache.reserve([1], [1])
    assert cache.block_table([0, 1], width=3).tolist() == [[1, SCRATCH_BLOCK, SCRATCH_BLOCK], [SCRATCH_BLOCK] * 3]
    assert cache.block_table([1]).tolist() == [[SCRATCH_BLOCK]]
    with pytest.raises(ValueError, match="PagedKVCache.block_table: width 0 is shorter"):
        cache.block_table([0], width=0)


def test_paged_kv_cache_is_the_table_owner():
    """The BlockTable owner protocol: copy_block copies one block in every pool and says how many bytes; grow_pools
    keeps every pool's contents. The table has a fixed capacity (grow=False, full attention only)."""
    cache = _poisoned_cache(2, 3, 2, 1, 4)
    assert cache.table.owners == [cache] and not cache.table.grow and cache.table.window == 0
    before = torch.stack([*cache.k_caches, *cache.v_caches]).clone()
    assert cache.copy_block(2, 1) == 4 * 2 * 4 * 4  # 4 pools x one block of 2 x 1 x 4 fp32
    expect = before.clone()
    expect[:, 1] = before[:, 2]
    assert torch.equal(torch.stack([*cache.k_caches, *cache.v_caches]), expect)
    cache.grow_pools(5)
    grown = torch.stack([*cache.k_caches, *cache.v_caches])
    assert grown.shape[1] == 5 and torch.equal(grown[:, :3], expect) and not grown[:, 3:].any()
    with pytest.raises(ValueError, match="BlockTable: grow=False needs num_blocks and window 0"):
        BlockTable(8, 4, None, 4, grow=False)
    with pytest.raises(ValueError, match="BlockTable: grow=False needs num_blocks and window 0"):
        BlockTable(0, 4, None, None, grow=False)

# ---- bad inputs: each raises, naming the op and argument, and the cache is byte-identical afterwards ----
def _bad_append_cases():
    k = torch.zeros(4, 4, 2, 64)
    key = torch.ones(3, 2, 64)
    slots = torch.tensor([0, 1, 2])
    return [
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 16, 1])), ValueError),  # past the cache
        ("slot_mapping", dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), RuntimeError),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1, 2, 3])), RuntimeError),  # longer than key
        ("must share one dtype", dict(key=key.half()), RuntimeError),
        ("does not match", dict(key=torch.ones(3, 3, 64), value=torch.ones(3, 3, 64)), RuntimeError),
        ("key must be 3-D", dict(key=torch.ones(3, 128), value=torch.ones(3, 128)), RuntimeError),
        ("float32, float16, bfloat16 or float8_e4m3fn", dict(key=key.double(), value=key.double(),
                                                             k_cache=k.double(), v_cache=k.double()), RuntimeError),
        ("contiguous last", dict(key=torch.ones(3, 2, 128)[..., ::2]), RuntimeError),
    ], dict(key=key, value=key, k_cache=k, v_cache=k.clone(), slot_mapping=slots)


@pytest.mark.parametrize("case", range(8))
def test_paged_kv_append_bad_inputs(case):
    cases, base = _bad_append_cases()
    match, override, exc = cases[case]
    args = {**base, **override}
    snapshot = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(exc, match=f"paged_kv_append: .*{match}"):
        paged_kv_append(**args)
    assert torch.equal(args["k_cache"], snapshot[0]) and torch.equal(args["v_cache"], snapshot[1])


# Slots past the cache: just past, far past, the int32 / int64 extremes, and values whose low 32 bits are a valid
# slot (2^32 + 1 -> 1, -2^32 + 3 -> 3: a kernel that truncates slots to 32 bits writes those).
_HOSTILE_SLOTS = {torch.int32: [16, 1000, 2 ** 31 - 1, -2 ** 31, -1],
                  torch.int64: [16, 2 ** 32 + 1, -2 ** 32 + 3, 2 ** 63 - 1, -2 ** 63, 2 ** 31]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_paged_kv_append_unchecked_never_writes_past_cache(device, slot_dtype):
    """check=False skips validation, but no kernel (CPU, CUDA, the CUDA source emulated) writes outside the cache:
    guard blocks on both sides stay poisoned and the cache is untouched."""
    storage = torch.full((6, 4, 1, 8), SENTINEL, device=device)  # guard blocks before and after the 4-block cache
    k, v = storage[1:5], torch.full((4, 4, 1, 8), SENTINEL, device=device)
    # first the slots just past the cache (they land in the guard block if the bound is missing), then the extremes
    for values in ([16, 17, 19], _HOSTILE_SLOTS[slot_dtype]):
        slots = torch.tensor(values, dtype=slot_dtype, device=device)
        key = torch.ones(len(slots), 1, 8, device=device)
        paged_kv_append(key, key, k, v, slots, check=False)
        assert torch.all(storage == SENTINEL) and torch.all(v == SENTINEL), values
    with pytest.raises(ValueError, match=r"paged_kv_append: slot_mapping\[0\] = 16 is outside the cache"):
        paged_kv_append(key, key, k, v, slots)


# ---- 64-bit offsets without a 64 GB allocation: cache views whose block 1 starts 2^36 + 128 bytes into a sparse
# anonymous mapping (MAP_NORESERVE: only the pages the test touches exist). That offset is past 2^32 in every unit a
# kernel may count in (fp16 / fp8 elements, 16-byte copy units, bytes), so an offset computed in 32 bits wraps to a
# small positive one, inside block 0: the write or read lands silently in the wrong place (no crash) and the
# comparison with the reference fails.
_MAP_NORESERVE = 0x4000  # Linux (the mmap module does not export it)
_BIG_STRIDE_BYTES = 2 ** 36 + 128  # between block 0 and block 1


def huge_flat(nbytes, device):
    """A flat uint8 tensor of nbytes: sparse virtual memory on the CPU (torch keeps the mapping alive), real on CUDA."""
    if device == "cuda":
        return torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    return torch.frombuffer(mm, dtype=torch.uint8)


def far_apart_caches(block_size, heads, head_dim, dtype, device):
    """(k_cache, v_cache) [2, block_size, heads, head_dim], block 1 _BIG_STRIDE_BYTES after block 0 in one sparse
    storage (V's rows right after K's in each block), both poisoned."""
    row = block_size * heads * head_dim
    es = torch.empty((), dtype=dtype).element_size()
    flat = huge_flat(_BIG_STRIDE_BYTES + 2 * row * es, device).view(dtype)
    stride = (_BIG_STRIDE_BYTES // es, heads * head_dim, head_dim, 1)
    k = flat.as_strided((2, block_size, heads, head_dim), stride, 0)
    v = flat.as_strided((2, block_size, heads, head_dim), stride, row)
    for c in (k, v):
        c.view(torch.uint8).fill_(0x55)  # 0x55: 3.25 in e4m3, 0x5555 in fp16: never a value written here
    return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_paged_kv_append_offsets_past_2_31_elements(device, dtype):
    block_size, heads, head_dim = 4, 2, 64
    gen = torch.Generator().manual_seed(7)
    k, v = far_apart_caches(block_size, heads, head_dim, dtype, device)
    key = torch.randn(5, heads, head_dim, generator=gen).half().to(device)
    value = torch.randn(5, heads, head_dim, generator=gen).half().to(device)
    slots = torch.tensor([5, 2, 7, -1, 4], device=device)  # block 1 (past 2^36 bytes) and block 0
    scales = {}
    if dtype == torch.float8_e4m3fn:
        scales = dict(k_scale=torch.tensor([0.5], device=device), v_scale=torch.tensor([0.25], device=device))
    want_k, want_v = (c.cpu().clone(memory_format=torch.contiguous_format) for c in (k, v))  # dense copies
    paged_kv_append(key, value, k, v, slots, **scales)
    paged_kv_append_ref(key.cpu(), value.cpu(), want_k, want_v, slots.cpu(), *(s.cpu() for s in scales.values()))
    for got, want in ((k, want_k), (v, want_v)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_kv_gather_offsets_past_2_31_elements(device):
    block_size, heads, head_dim = 4, 2, 64
    gen = torch.Generator().manual_seed(8)
    k, v = far_apart_caches(block_size, heads, head_dim, torch.float16, device)
    for c in (k, v):
        c.copy_(torch.randn(2, block_size, heads, head_dim, generator=gen).half())
    table = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32, device=device)
    lens = torch.tensor([6, 8], dtype=torch.int32, device=device)
    got = paged_kv_gather(k, v, table, lens)
    want = paged_kv_gather_ref(k.cpu(), v.cpu(), table.cpu(), lens.cpu())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_paged_kv_gather_bad_inputs():
    k = torch.zeros(4, 4, 2, 64)
    table = torch.tensor([[0, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"paged_kv_gather: block_table\[0, 1\] = 9"):
        paged_kv_gather(k, k, table, torch.tensor([6], dtype=torch.int32))
    # the same bad entry past the sequence's length is ignored
    k_out, _ = paged_kv_gather(k, k, table, torch.tensor([4], dtype=torch.int32))
    assert k_out.shape == (1, 2, 4, 64)
    with pytest.raises(RuntimeError, match="paged_kv_gather: block_table must be Int"):
        paged_kv_gather(k, k, table.long(), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="paged_kv_gather: seq_lens has 2 entries"):
        paged_kv_gather(k, k, table, torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="paged_kv_gather: k_cache and v_cache must have one shape"):
        paged_kv_gather(k, k[:2], table, torch.tensor([4], dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_kv_gather_lengths_vs_max_seq_len(device):
    """A sequence longer than max_seq_len is refused with check=True (never truncated silently), and with check=False
    gathers its first max_seq_len positions, as documented; a default max_seq_len beyond the table's reach is refused
    naming seq_lens (the argument the caller gave), a negative length is refused with check=True and gathers zeros
    with check=False."""
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(4, 4, 2, 64, generator=gen).to(device)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    lens = torch.tensor([7, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"paged_kv_gather: seq_lens\[0\] = 7 exceeds max_seq_len = 5"):
        paged_kv_gather(k, k, table, lens, 5)
    got, _ = paged_kv_gather(k, k, table, lens, 5, check=False)
    want, _ = paged_kv_gather_ref(k.cpu(), k.cpu(), table.cpu(), lens.cpu())
    assert torch.equal(got.cpu(), want[:, :, :5])
    with pytest.raises(ValueError, match=r"paged_kv_gather: seq_lens\[1\] = 9 exceeds what block_table can address"):
        paged_kv_gather(k, k, table, torch.tensor([7, 9], dtype=torch.int32, device=device), check=False)
    neg = torch.tensor([-3, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"paged_kv_gather: seq_lens\[0\] = -3 is negative"):
        paged_kv_gather(k, k, table, neg)
    got, _ = paged_kv_gather(k, k, table, neg, check=False)
    assert got.shape[2] == 3 and torch.all(got[0] == 0) and torch.equal(got[1].cpu(), want[1, :, :3])
    want8, _ = paged_kv_gather_ref(k.cpu(), k.cpu(), table.cpu(), torch.tensor([0, 3], dtype=torch.int32), 8)
    for extreme in (-2 ** 31, 2 ** 31 - 1):  # unchecked, on device: no read outside the table or the cache
        got, _ = paged_kv_gather(k, k, table, torch.tensor([extreme, 3], dtype=torch.int32, device=device), 8,
                                 check=False)
        assert torch.equal(got[1].cpu(), want8[1]) and not torch.isnan(got).any()


@pytest.mark.parametrize("device", DEVICES)
def test_paged_kv_fp8_scales_positive_and_finite(device):
    k = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn, device=device)
    key = torch.ones(2, 1, 16, device=device)
    one = torch.tensor([1.0], device=device)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        scale = torch.tensor([bad], device=device)
        with pytest.raises(ValueError, match=f"paged_kv_append: v_scale must be positive and finite, got {bad}"):
            paged_kv_append(key, key, k, k.clone(), torch.tensor([0, 1], device=device), k_scale=one, v_scale=scale)
        table = torch.tensor([[0]], dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match=f"paged_kv_gather: k_scale must be positive and finite, got {bad}"):
            paged_kv_gather(k, k, table, torch.tensor([2], dtype=torch.int32, device=device), k_scale=scale,
                            v_scale=one)


def test_paged_kv_opcheck():
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(5, 2, 16, generator=gen)
    k, v = torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16)
    slots = torch.tensor([0, 5, -1, 11, 2])
    torch.library.opcheck(torch.ops.arkernels.paged_kv_append.default, (key, key, k, v, slots))
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.arkernels.paged_kv_gather.default, (k, v, table, lens, 6))


def test_paged_kv_compile_fullgraph():
    def step(key, value, k, v, slots, table, lens):
        paged_kv_append(key, value, k, v, slots, check=False)
        return paged_kv_gather(k, v, table, lens, 6, check=False)

    key = torch.randn(4, 2, 16)
    k, v = torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16)
    slots = torch.tensor([0, 1, 8, 9])
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    lens = torch.tensor([6, 2], dtype=torch.int32)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(key, key, k, v, slots, table, lens)
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    want = step(key, key, k2, v2, slots, table, lens)
    assert torch.equal(got[0], want[0]) and torch.equal(k, k2)
