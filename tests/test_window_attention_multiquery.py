"""window_attention's multi-query decode path (issue 33, speculative verification): with cu_seqlens_q and a small
max_q_len the CUDA decode kernel takes the call, its M = 16 tensor-core rows the packed (query row, query head of the
GQA group) pairs, each row with its own causal limit and window / chunk / kv_start range. Checked against the fp64
reference with the attention tests' tolerance (test_window_attention.py: _check), in the SIMT emulator (the CUDA
source), on the CPU kernel and on a GPU when there is one.
"""
import math

import pytest
import torch

from arkernels.ops.window_attention import window_attention
from conftest import DEVICES, SIMT_DEVICES, SimtDevice
from test_window_attention import (HEAD_DIMS, NAN, _assert_kv_reads, _check, _count_key_rows, _decode_smem, _paged,
                                   _pick)

MQ_GROUPS = [(4, 4), (8, 2), (16, 2)]  # (num_q_heads, num_kv_heads): GQA 1, 4 and 8
# Ragged query counts of a verify batch (k + 1 rows for k drafted tokens), 0 and 1 included: with 8 rows at GQA 8 the
# packed rows of a sequence are 64 = 4 head chunks of 16.
Q_LEN_SETS = [[5, 0, 8, 1, 3], [2, 7, 4, 6, 1], [8, 3, 0, 2, 5]]
# Lengths whose last queries sit on and across the 64-key tile edges, one long enough for several split-KV partitions.
LENS = [67, 9, 200, 64, 130]


def _cu(q_lens, first=0):
    cu = [first]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return cu


def _decode_ran(launch, hkv, group, max_q_len, d, fp8):
    """The launch is the decode kernel's: its dynamic shared memory is a decode layout's and its grid has
    ceil(max_q_len * group / 16) CTAs per KV head (prefill's grid has one column per KV head)."""
    chunks = -(-max_q_len * group // 16)
    return launch["grid"][1] == hkv * chunks and launch["smem"] in {_decode_smem(d, s, fp8) for s in range(1, 5)}


def _fp8(k, v):
    """fp8 caches with power-of-two scales (the dequantized 16-bit copy is exact: the reference runs on it)."""
    k8, v8 = (k.float() * 4).to(torch.float8_e4m3fn), (v.float() * 8).to(torch.float8_e4m3fn)
    return k8, v8, {"k_scale": torch.tensor([0.25]), "v_scale": torch.tensor([0.125])}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("gqa", MQ_GROUPS)
@pytest.mark.parametrize("fp8", [False, True])
def test_window_attention_multiquery_grid(device, head_dim, gqa, fp8):
    """Ragged verify batches (q_len 0..8 per sequence) at every head dim (80 and 96: non-power-of-two k-steps; 256 runs
    the prefill kernel), GQA 1,
    4 and 8, block sizes 16 and 13, windows that cut the earlier rows' keys differently from the later ones', chunks,
    kv_start, softcap, sinks, fp16 and bf16, 16-bit and fp8 caches; the query a slice of a fused qkv buffer, K a
    strided view of a wider buffer and V contiguous (different strides), NaN in every slot no row may read."""
    hi, gi = HEAD_DIMS.index(head_dim), MQ_GROUPS.index(gqa)
    hq, hkv = gqa
    dtype = _pick([torch.float16, torch.bfloat16], hi, gi, int(fp8))
    q_lens = _pick(Q_LEN_SETS, hi, gi)
    window = _pick([0, 7, 70, 1], hi, 2 * gi, int(fp8))
    chunk = _pick([0, 0, 48], hi, gi)
    block_size = _pick([16, 13], hi, gi, int(fp8))
    softcap = _pick([0.0, 2.5], hi, gi)
    with_sinks = _pick([False, True], hi, gi, int(fp8) + 1)
    gen = torch.Generator().manual_seed(1000 + 100 * hi + 10 * gi + int(fp8))
    k, v, table = _paged(LENS, block_size, hkv, head_dim, torch.float32, "cpu", gen)
    scales = {}
    if fp8:
        k_dev, v_dev, scales = _fp8(k, v)
        k, v = k_dev.to(dtype) * 0.25, v_dev.to(dtype) * 0.125
    else:
        k, v = k.to(dtype), v.to(dtype)
        k_dev, v_dev = k, v
    wide = torch.full((k.shape[0], block_size, hkv + 1, head_dim), NAN).to(k_dev.dtype)
    wide[:, :, 1:] = k_dev
    k_dev = wide[:, :, 1:]  # K strided, V contiguous
    cu = _cu(q_lens)
    qkv = torch.randn(cu[-1], hq + 2 * hkv, head_dim, generator=gen).to(dtype)
    query = qkv[:, :hq]
    kv_start = torch.tensor([3, 0, 40, 0, 0], dtype=torch.int32)
    sinks = torch.randn(hq, generator=gen) * 1.5 if with_sinks else None
    if sinks is not None:
        sinks[-1] = -math.inf  # a head without a sink
    out, lse = window_attention(query.to(device), k_dev.to(device), v_dev.to(device), table.to(device),
                                torch.tensor(LENS, dtype=torch.int32, device=device), window=window, softcap=softcap,
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device), max_q_len=8,
                                kv_start=kv_start.to(device), chunk_size=chunk,
                                sinks=None if sinks is None else sinks.to(device), return_lse=True,
                                **{n: t.to(device) for n, t in scales.items()})
    if isinstance(device, SimtDevice):
        import arkernels.simt

        launches = arkernels.simt.launches()
        # head_dim 256 stays on prefill (use_multiquery_decode: the multi-query instantiation spilled there)
        assert len(launches) == 1 and _decode_ran(launches[0], hkv, hq // hkv, 8, head_dim, fp8) == (head_dim <= 128)
    _check(out, lse, query, k, v, table, LENS, cu, window, head_dim ** -0.5, softcap, kv_start=kv_start,
           sinks=sinks, chunk_size=chunk)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block_order", [0, 1])
@pytest.mark.parametrize("case", ["plain", "sinks_fp8", "window_gqa8"])
def test_window_attention_multiquery_splits(device, block_order, case):
    """Long contexts: the verify rows' keys in several split-KV partitions, merged by the column's last split CTA
    (the emulator runs the blocks in linear order and in a seeded permutation); a sequence of 0 rows and one whose
    every key is left padding (kv_start == seq_len: zeros, lse -inf or the sink)."""
    import arkernels.simt

    hq, hkv = (16, 2) if case == "window_gqa8" else (8, 2)
    d, dtype = (128, torch.bfloat16) if case != "sinks_fp8" else (96, torch.float16)
    window = 300 if case == "window_gqa8" else 0
    gen = torch.Generator().manual_seed(50 + block_order)
    lens, q_lens = [1500, 700, 40, 900], [5, 0, 3, 8]
    k, v, table = _paged(lens, 16, hkv, d, torch.float32, "cpu", gen)
    scales = {}
    if case == "sinks_fp8":
        k_dev, v_dev, scales = _fp8(k, v)
        k, v = k_dev.to(dtype) * 0.25, v_dev.to(dtype) * 0.125
    else:
        k, v = k.to(dtype), v.to(dtype)
        k_dev, v_dev = k, v
    cu = _cu(q_lens)
    query = torch.randn(cu[-1], hq, d, generator=gen).to(dtype)
    kv_start = torch.tensor([0, 0, 40, 100], dtype=torch.int32)
    sinks = torch.randn(hq, generator=gen) if case == "sinks_fp8" else None
    with arkernels.simt.emulate(block_order=block_order):
        out, lse = window_attention(query, k_dev, v_dev, table, torch.tensor(lens, dtype=torch.int32), window=window,
                                    cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), kv_start=kv_start,
                                    sinks=sinks, return_lse=True, **scales)
        launches = arkernels.simt.launches()
    assert len(launches) == 1 and launches[0]["grid"][0] > 1, launches  # split, combined in the same launch
    assert _decode_ran(launches[0], hkv, hq // hkv, max(q_lens), d, case == "sinks_fp8"), launches
    _check(out, lse, query, k, v, table, lens, cu, window, d ** -0.5, 0.0, kv_start=kv_start, sinks=sinks)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("max_q_len,group,decode", [(8, 8, True), (9, 1, False), (5, 16, False), (4, 16, True),
                                                    (1, 4, True), (0, 4, False)])
def test_window_attention_multiquery_dispatch(device, max_q_len, group, decode):
    """The rule: cu_seqlens_q with 1 <= max_q_len <= 8 and max_q_len x group <= 64 packed rows (at most 4 head chunks)
    goes to the decode kernel, anything else to prefill; both are right (max_q_len 0: every sequence has no query)."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(60 + max_q_len + group)
    q_lens = [max_q_len, max(max_q_len - 1, 0)]
    lens = [100, 30]
    hkv, d = 1, 64
    k, v, table = _paged(lens, 16, hkv, d, torch.float16, device, gen)
    cu = _cu(q_lens)
    query = torch.randn(cu[-1], group * hkv, d, generator=gen).half()
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32),
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_q_len=max_q_len,
                                return_lse=True)
    launches = arkernels.simt.launches()
    if cu[-1] > 0:
        assert _decode_ran(launches[0], hkv, group, max_q_len, d, False) == decode, launches
        _check(out, lse, query, k, v, table, lens, cu, 0, d ** -0.5, 0.0)


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_window_attention_multiquery_unchecked_rows(device):
    """check=False: query rows outside every sequence's cu_seqlens_q range get zeros and lse -inf (as prefill gives
    them), and a max_q_len smaller than a sequence's query count (2 for 7 rows at GQA 4: one head chunk planned, two
    needed) still computes every row (more passes by the column's split 0, over all of its keys)."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(70)
    lens, q_lens = [600, 90], [7, 2]
    hq, hkv, d = 8, 2, 64
    k, v, table = _paged(lens, 16, hkv, d, torch.bfloat16, device, gen)
    cu = _cu(q_lens, first=2)  # rows 0, 1 and 11, 12 belong to no sequence
    rows = cu[-1] + 2
    query = torch.randn(rows, hq, d, generator=gen).bfloat16()
    torch.full((rows, hq, d), NAN).bfloat16()  # a poisoned allocation for the output to reuse
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32),
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_q_len=2, return_lse=True,
                                check=False)
    launches = arkernels.simt.launches()
    assert _decode_ran(launches[0], hkv, hq // hkv, 2, d, False) and launches[0]["grid"][0] > 1, launches
    owned = slice(cu[0], cu[-1])
    _check(out[owned], lse[owned], query[owned], k, v, table, lens, [c - cu[0] for c in cu], 0, d ** -0.5, 0.0)
    for r in (0, 1, rows - 2, rows - 1):
        assert bool((out[r] == 0).all()) and bool(torch.isneginf(lse[r]).all()), r


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("gqa", [(2, 2), (8, 2), (16, 2)])
@pytest.mark.parametrize("window", [0, 24])
def test_window_attention_multiquery_traffic(device, gqa, window):
    """The bytes argument: verifying a sequence's q_len rows reads each K/V byte of the union of their visible
    ranges exactly once per KV head and head chunk (one chunk while q_len x group <= 16; else each chunk of 16 packed
    rows reads its own rows' union), whatever the split count; no byte outside every row's window, kv_start or the
    sequence is read."""
    import arkernels.simt

    hq, hkv = gqa
    gen = torch.Generator().manual_seed(80 + hq + window)
    lens, q_lens = [5, 37, 300], [5, 2, 4]
    k, v, table = _paged(lens, 16, hkv, 64, torch.float16, device, gen)
    kv_start = torch.tensor([0, 5, 0], dtype=torch.int32)
    cu = _cu(q_lens)
    query = torch.randn(cu[-1], hq, 64, generator=gen).half()
    window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), window=window, kv_start=kv_start,
                     cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_q_len=max(q_lens))
    assert _decode_ran(arkernels.simt.launches()[0], hkv, hq // hkv, max(q_lens), 64, False)
    want = torch.zeros(k.untyped_storage().nbytes(), dtype=torch.int32)
    group = hq // hkv
    for b, (n, q) in enumerate(zip(lens, q_lens)):
        for m0 in range(0, q * group, 16):  # a head chunk: packed rows m0 .. m0 + 15 (row t * group + head)
            first, last = n - q + m0 // group, n - q + (min(m0 + 16, q * group) - 1) // group  # their positions
            lo = max(int(kv_start[b]), 0, first - window + 1 if window else 0)
            _count_key_rows(want, k, table, b, lo, last)
    _assert_kv_reads(want)
