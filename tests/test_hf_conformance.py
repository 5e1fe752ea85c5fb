"""A patched model does what a stock one does.

Compile section: ``torch.compile(fullgraph=True)`` over the ops with their default ``check=True``.
"""
import pytest
import torch

from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather
from arkernels.ops.window_attention import window_attention

# ---- torch.compile(fullgraph=True) over the ops with default arguments (check=True validates eagerly only) --------
NUM_BLOCKS, BLOCK, HKV, HQ, D = 7, 4, 2, 4, 8  # 7 blocks: not a power of two


def _append_gather(k, v, kc, vc, slots, table, lens):
    paged_kv_append(k, v, kc, vc, slots)
    return paged_kv_gather(kc, vc, table, lens)


def _attend(q, kc, vc, table, lens, cu):
    return window_attention(q, kc, vc, table, lens, cu_seqlens_q=cu, window=3)


def _pools():
    return torch.full((NUM_BLOCKS, BLOCK, HKV, D), float("nan")), torch.full((NUM_BLOCKS, BLOCK, HKV, D), float("nan"))


def test_compile_fullgraph_append_gather_defaults():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, HKV, D, generator=g), torch.randn(6, HKV, D, generator=g)
    slots = torch.tensor([12, 13, 14, 15, 4, -1])  # row 0 in block 3, row 1 starts in block 1; -1: padding
    table = torch.tensor([[3, 0], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([4, 1], dtype=torch.int32)
    kc, vc = _pools()
    ek, ev = _append_gather(k, v, kc, vc, slots, table, lens)
    kc2, vc2 = _pools()
    ck, cv = torch.compile(_append_gather, fullgraph=True)(k, v, kc2, vc2, slots, table, lens)
    assert torch.equal(ck, ek) and torch.equal(cv, ev)  # data movement: exact
    assert torch.equal(kc2.nan_to_num(7.0), kc.nan_to_num(7.0))  # the same slots written, the rest untouched
    with pytest.raises(ValueError, match="outside the cache"):  # eagerly the default check still validates
        paged_kv_append(k, v, kc, vc, torch.tensor([0, 1, 2, 3, 4, NUM_BLOCKS * BLOCK]))


def test_compile_fullgraph_attention_defaults():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=g), torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=g)
    table = torch.tensor([[2, 5, 1], [6, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)  # 3 queries for row 0, 2 for row 1: max_q_len left to default
    q = torch.randn(5, HQ, D, generator=g)
    ref = _attend(q, kc, vc, table, lens, cu)
    out = torch.compile(_attend, fullgraph=True)(q, kc, vc, table, lens, cu)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)  # the same kernel, a larger grid bound: fp32 noise only
    with pytest.raises(ValueError, match="out of range"):
        _attend(q, kc, vc, torch.tensor([[2, 9, 1], [6, 0, 0]], dtype=torch.int32), lens, cu)
