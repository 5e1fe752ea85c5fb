"""window_attention with attention sinks (gpt-oss ``s_aux``) and chunked attention (Llama 4 ``attention_chunk_size``)
against the naive fp64 reference, on the CPU kernel and the CUDA source in the SIMT emulator.

Tolerances as in tests/test_window_attention.py (``_check``): fp16/bf16 at most 2x PyTorch's own low-precision error
(its attention in the inputs' dtype, sinks as a softmax column like transformers' gpt_oss eager attention) + 1e-5;
fp32 2e-5 absolute. Queries with no visible key: exact zeros, lse the sink (or -inf).
"""
import math

import pytest
import torch

from arkernels.ops.window_attention import window_attention, window_attention_dense
from arkernels.reference.window_attention import window_attention_dense_ref, window_mask_ref
from conftest import CUDA_KERNEL_DEVICES, DEVICES, SIMT_DEVICES, SimtDevice
from test_window_attention import (BLOCK_SIZES, DTYPES, FP32_TOL, HEAD_DIMS, NAN, _check, _count_key_rows, _paged,
                                   _pick, _poison_allocator, _skip_unsupported, _torch_lowp)

# (num_q_heads, num_kv_heads): GQA 1, 3, 4, 16 and 20 (decode: two CTAs per KV head, the second's heads start at 16)
GROUPS = [(3, 3), (6, 2), (8, 2), (16, 1), (20, 1)]
WINDOWS = [0, 1, 7, 1000]  # 1000: longer than every sequence
CHUNK = 16  # chunk tests: queries at offsets 0, C - 1, C, C + 1 and 3C - 1 of their sequence's first real token
CHUNK_OFFSETS = [16, 17, 15, 0, 47, 31]
CHUNK_STARTS = [0, 3, 3, 3, 5, 0]
CHUNK_WINDOWS = [0, 5, 20]  # 5: tighter than the chunk at offset 47; 20: the chunk is tighter
SINK_DOMINANT = 4.0  # head 0's sink: most of the probability mass (a dropped or doubled sink is off by far)


def _sinks(hq, gen):
    """Per-head sink logits: random, head 0 dominant, the last head -inf (no sink) when there are 3 heads or more."""
    s = torch.randn(hq, generator=gen) * 1.5
    s[0] = SINK_DOMINANT
    if hq >= 3:
        s[-1] = -math.inf
    return s


def _cu(q_lens):
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return cu


def _splits():
    import arkernels.simt

    return arkernels.simt.launches()[0]["grid"][0]


# ---------------------------------------------------------------------------------------------------- sinks
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_window_attention_sinks_decode(device, dtype, head_dim):
    """Decode with sinks, one split (short contexts): every head dim, GQA 1..20, windows, softcap (the sink is not
    capped), kv_start, block sizes 1/16/13, a sequence of length 0 (no key: zeros, lse = the sink)."""
    _skip_unsupported(device, dtype)
    hi, di = HEAD_DIMS.index(head_dim), DTYPES.index(dtype)
    hq, hkv = _pick(GROUPS, hi, di)
    block_size = _pick(BLOCK_SIZES, hi, 2 * di)
    window = _pick(WINDOWS, hi, di + 1)
    softcap = _pick([0.0, 2.5], hi, di)
    gen = torch.Generator().manual_seed(500 + 10 * hi + di)
    lens = [1, 9, 40, 0]
    k, v, table = _paged(lens, block_size, hkv, head_dim, dtype, device, gen)
    query = torch.randn(len(lens), hq, head_dim, generator=gen).to(dtype).to(device)
    kv_start = torch.tensor([0, 2, 5, 0], dtype=torch.int32)
    sinks = _sinks(hq, gen)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, softcap=softcap, kv_start=kv_start.to(device), sinks=sinks.to(device),
                                return_lse=True)
    if isinstance(device, SimtDevice):
        assert _splits() == 1  # the single CTA adds the sink (the split path is test_..._sinks_decode_splits)
    empty = _check(out, lse, query, k, v, table, lens, None, window, head_dim ** -0.5, softcap, kv_start=kv_start,
                   sinks=sinks)
    assert bool(empty[3].all())  # the sequence of length 0


SINK_FAR = 1000.0  # far above every score (scores are O(1)): exp(sink - score) overflows fp32 unless the sink is in the max
# (lens, q_lens or None for decode): one split; several splits (the CUDA decode combine adds the sink); prefill
FAR_SINK_CASES = {"decode": ([1, 9, 40, 0], None), "decode_splits": ([700, 3], None),
                  "prefill": ([1, 45, 30, 9], [1, 45, 12, 0])}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(FAR_SINK_CASES))
def test_window_attention_sink_far_above_scores(device, dtype, case):
    """A sink of +1000 over O(1) scores (head 0) and one of -1000 (head 1): the sink must be part of the running
    maximum, or ``exp(sink - max)`` overflows to inf and lse becomes inf. Head 0: out ~0 (every key's weight
    ``exp(s - 1000)`` underflows), lse == the sink, finite; the other heads as the fp64 reference."""
    _skip_unsupported(device, dtype)
    lens, q_lens = FAR_SINK_CASES[case]
    gen = torch.Generator().manual_seed(40 + list(FAR_SINK_CASES).index(case))
    hq, hkv, d = 8, 2, 64
    k, v, table = _paged(lens, 16, hkv, d, dtype, device, gen)
    cu = None if q_lens is None else _cu(q_lens)
    query = torch.randn(len(lens) if cu is None else cu[-1], hq, d, generator=gen).to(dtype).to(device)
    sinks = _sinks(hq, gen)
    sinks[0], sinks[1] = SINK_FAR, -SINK_FAR
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                sinks=sinks.to(device), return_lse=True,
                                cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    if isinstance(device, SimtDevice) and case == "decode_splits":
        assert _splits() > 1
    _check(out, lse, query, k, v, table, lens, cu, 0, d ** -0.5, 0.0, sinks=sinks)
    out, lse = out.cpu(), lse.cpu()
    assert bool(torch.isfinite(lse[:, :2]).all())  # (the last head has no sink: -inf for a query without keys)
    assert out[:, 0].abs().max().item() <= 1e-6
    torch.testing.assert_close(lse[:, 0], torch.full_like(lse[:, 0], SINK_FAR), atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block_order", [0, 1, 2])
def test_window_attention_sinks_decode_splits(device, block_order):
    """Split-KV decode with sinks: the sink joins each head's denominator exactly once, in the fused combine of the
    last split CTA (whichever finishes last: linear and permuted block orders). GQA 20/1 (two CTAs per KV head: the
    second's sinks start at head 16), a sequence with no key (zeros, lse = sink), kv_start past a split, windows, a
    chunked call; three calls in a row on the same completion counters."""
    gen = torch.Generator().manual_seed(60 + block_order)
    calls = [([1000, 0, 700], 0, [0, 0, 650], 0), ([1000, 333, 9], 300, [0, 0, 0], 0),
             ([1000, 600, 700], 0, [0, 7, 650], 300)]
    import arkernels.simt

    with arkernels.simt.emulate(block_order=block_order):
        for lens, window, starts, chunk in calls:
            k, v, table = _paged(lens, 16, 1, 64, torch.bfloat16, device, gen)
            query = torch.randn(3, 20, 64, generator=gen).bfloat16()
            kv_start = torch.tensor(starts, dtype=torch.int32)
            sinks = _sinks(20, gen)
            out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), window=window,
                                        kv_start=kv_start, sinks=sinks, chunk_size=chunk, return_lse=True)
            assert len(arkernels.simt.launches()) == 1 and _splits() > 1
            empty = _check(out, lse, query, k, v, table, lens, None, window, 64 ** -0.5, 0.0, kv_start=kv_start,
                           sinks=sinks, chunk_size=chunk)
            if lens[1] == 0:
                assert bool(empty[1].all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_window_attention_sinks_prefill(device, dtype, head_dim):
    """Prefill with sinks: every head dim, GQA 1..20 (packed rows: a row's sink is its own head's), windows, softcap,
    kv_start (queries left of it see no key: zeros, lse = sink), block sizes 1/16/13; a one-token prompt, a whole
    prompt over several query tiles, chunked prefill over a cache, a sequence with no new query."""
    _skip_unsupported(device, dtype)
    hi, di = HEAD_DIMS.index(head_dim), DTYPES.index(dtype)
    hq, hkv = _pick(GROUPS, hi, di + 1)
    block_size = _pick(BLOCK_SIZES, hi, di)
    window = _pick(WINDOWS, hi, 2 * di)
    softcap = _pick([0.0, 2.5], hi, di + 1)
    gen = torch.Generator().manual_seed(700 + 10 * hi + di)
    lens, q_lens = [1, 45, 30, 9], [1, 45, 12, 0]
    cu = _cu(q_lens)
    k, v, table = _paged(lens, block_size, hkv, head_dim, dtype, device, gen)
    query = torch.randn(cu[-1], hq, head_dim, generator=gen).to(dtype).to(device)
    kv_start = torch.tensor([0, 3, 20, 0], dtype=torch.int32)
    sinks = _sinks(hq, gen)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, softcap=softcap, kv_start=kv_start.to(device), sinks=sinks.to(device),
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device), return_lse=True)
    empty = _check(out, lse, query, k, v, table, lens, cu, window, head_dim ** -0.5, softcap, kv_start=kv_start,
                   sinks=sinks)
    assert bool(empty[cu[2]:cu[2] + 2].all())  # sequence 2's queries at 18, 19 < kv_start 20


def test_window_attention_sinks_match_gpt_oss_eager():
    """transformers' gpt_oss eager attention (sinks as a softmax column, its left-padding + sliding-window mask)
    against window_attention_dense with kv_start and sinks, fp32, on every query that sees a key; padding queries
    get zeros."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(80)
    bsz, hq, hkv, d, s = 3, 8, 2, 64, 13
    pads = [0, 4, 9]
    attention_mask = torch.ones(bsz, s, dtype=torch.bool)
    for b, p in enumerate(pads):
        attention_mask[b, :p] = False
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = hq // hkv, False
    module.sinks = torch.nn.Parameter(_sinks(hq, gen))
    key = torch.randn(bsz, hkv, s, d, generator=gen)
    value = torch.randn(bsz, hkv, s, d, generator=gen)
    for window, tq in [(0, 1), (0, 6), (5, 13)]:
        fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
        mask = sdpa_mask(batch_size=bsz, q_length=tq, kv_length=s, q_offset=s - tq, mask_function=fn,
                         attention_mask=attention_mask, allow_is_causal_skip=False)
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        q = torch.randn(bsz, hq, tq, d, generator=gen)
        want, _ = eager_attention_forward(module, q, key, value, additive, scaling=0.125)
        got = window_attention_dense(q.transpose(1, 2), key, value, kv_start=torch.tensor(pads, dtype=torch.int32),
                                     window=window, scale=0.125, sinks=module.sinks)
        live = mask[:, 0].any(-1)  # [B, Tq]: queries that see a key (a fully masked row of eager's additive mask
        # averages the masked values where the head has no sink: padding output, not compared)
        torch.testing.assert_close(got[live], want[live], atol=2e-6, rtol=1e-5)
        assert bool((got[~live] == 0).all())


# ---------------------------------------------------------------------------------------------------- chunks
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", CHUNK_WINDOWS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_window_attention_chunked_decode(device, window, block_size):
    """Decode with chunk_size 16: queries right at a chunk boundary (offset 16 from the first real token), right after
    it (17), right before it (15), at the first token (0), deep in a later chunk (47, 31), chunks counted from
    kv_start (3, 5: transformers' rule with left padding), combined with windows tighter and looser than the chunk."""
    wi, bi = CHUNK_WINDOWS.index(window), BLOCK_SIZES.index(block_size)
    dtype = _pick([torch.float16, torch.bfloat16], wi, bi)
    hq, hkv = _pick(GROUPS, wi, bi)
    gen = torch.Generator().manual_seed(900 + 10 * wi + bi)
    lens = [s + o + 1 for s, o in zip(CHUNK_STARTS, CHUNK_OFFSETS)]
    k, v, table = _paged(lens, block_size, hkv, 64, dtype, device, gen)
    query = torch.randn(len(lens), hq, 64, generator=gen).to(dtype).to(device)
    kv_start = torch.tensor(CHUNK_STARTS, dtype=torch.int32)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, kv_start=kv_start.to(device), chunk_size=CHUNK, return_lse=True)
    _check(out, lse, query, k, v, table, lens, None, window, 64 ** -0.5, 0.0, kv_start=kv_start, chunk_size=CHUNK)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 16, 37])
@pytest.mark.parametrize("window", [0, 20])
def test_window_attention_chunked_prefill(device, chunk, window):
    """Prefill with chunks of 1 (each query sees only itself), 16 and 37 positions: every query position of a
    70-token prompt (so every boundary, and 128-row packed tiles that straddle chunks: GQA 8/2, 32 tokens a tile),
    chunked prefill over a cache with kv_start 5 (chunks from position 5), with and without a window."""
    ci, wi = [1, 16, 37].index(chunk), [0, 20].index(window)
    dtype = _pick([torch.float16, torch.bfloat16], ci, wi)
    gen = torch.Generator().manual_seed(950 + 10 * ci + wi)
    lens, q_lens = [70, 50], [70, 25]
    cu = _cu(q_lens)
    k, v, table = _paged(lens, 16, 2, 64, dtype, device, gen)
    query = torch.randn(cu[-1], 8, 64, generator=gen).to(dtype).to(device)
    kv_start = torch.tensor([0, 5], dtype=torch.int32)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, kv_start=kv_start.to(device), chunk_size=chunk, return_lse=True,
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device))
    _check(out, lse, query, k, v, table, lens, cu, window, 64 ** -0.5, 0.0, kv_start=kv_start, chunk_size=chunk)


@pytest.mark.parametrize("tq", [1, 7])
def test_window_attention_chunked_matches_transformers(tq):
    """transformers' chunked mask (chunked_causal_mask_function with its left-padding count, as
    create_chunked_causal_mask builds it) + its sdpa attention against window_attention_dense with kv_start and
    chunk_size, fp32, on every query that sees a key."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

    gen = torch.Generator().manual_seed(90 + tq)
    bsz, hq, hkv, d, s, chunk = 3, 6, 2, 64, 21, 4
    pads = [0, 3, 6]
    attention_mask = torch.ones(bsz, s, dtype=torch.bool)
    for b, p in enumerate(pads):
        attention_mask[b, :p] = False
    left = (attention_mask.cumsum(dim=-1) == 0).sum(dim=-1)  # create_chunked_causal_mask's left-padding count
    mask = sdpa_mask(batch_size=bsz, q_length=tq, kv_length=s, q_offset=s - tq,
                     mask_function=chunked_causal_mask_function(chunk, left), attention_mask=attention_mask,
                     allow_is_causal_skip=False)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = hq // hkv, True
    q = torch.randn(bsz, hq, tq, d, generator=gen)
    key = torch.randn(bsz, hkv, s, d, generator=gen)
    value = torch.randn(bsz, hkv, s, d, generator=gen)
    want, _ = sdpa_attention_forward(module, q, key, value, mask, scaling=0.125)
    got = window_attention_dense(q.transpose(1, 2), key, value, kv_start=torch.tensor(pads, dtype=torch.int32),
                                 chunk_size=chunk, scale=0.125)
    live = mask[:, 0].any(-1)
    torch.testing.assert_close(got[live], want[live], atol=1e-5, rtol=1e-5)
    assert bool((got[~live] == 0).all())


# ------------------------------------------------------------------------------------------ sinks with chunks
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tq", [1, 5])
def test_window_attention_sinks_chunked_dense(device, tq):
    """window_attention_dense with sinks (given as bf16: upcast by the wrapper), chunk_size and a window over a
    strided [B, Hkv, S, D] cache slice, left padding; against the dense fp64 reference."""
    gen = torch.Generator().manual_seed(100 + tq)
    bsz, hq, hkv, d, s, cap = 3, 6, 2, 64, 23, 32
    dtype = torch.float16
    key = torch.randn(bsz, hkv, cap, d, generator=gen).to(dtype)[:, :, :s].to(device)
    value = torch.randn(bsz, hkv, cap, d, generator=gen).to(dtype)[:, :, :s].to(device)
    query = torch.randn(bsz, hq, tq, d, generator=gen).to(dtype).transpose(1, 2).to(device)
    seq_lens = torch.tensor([s, s - 4, tq], dtype=torch.int32)
    kv_start = torch.tensor([0, 6, 0], dtype=torch.int32)
    sinks = _sinks(hq, gen).bfloat16()
    for window, chunk in [(0, 8), (5, 8), (0, 0)]:
        out, lse = window_attention_dense(query, key, value, seq_lens=seq_lens.to(device), kv_start=kv_start.to(device),
                                          window=window, sinks=sinks.to(device), chunk_size=chunk, return_lse=True)
        ref, ref_lse = window_attention_dense_ref(query, key, value, seq_lens=seq_lens, kv_start=kv_start,
                                                  window=window, sinks=sinks.float(), chunk_size=chunk)
        lowp = _torch_lowp(query.reshape(bsz * tq, hq, d), key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3),
                           torch.arange(bsz, dtype=torch.int32)[:, None], seq_lens.tolist(),
                           list(range(0, (bsz + 1) * tq, tq)), window, d ** -0.5, 0.0, kv_start, sinks.float(), chunk)
        tol = 2 * (lowp.view(bsz, tq, hq, d).double() - ref).abs().max().item() + 1e-5
        err = (out.cpu().double() - ref).abs().max().item()
        assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
        assert torch.allclose(lse.cpu().double(), ref_lse, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefill", [False, True])
def test_window_attention_sinks_chunked_strided_kv(device, prefill):
    """K and V with different strides (K a view into a wider buffer with a padded head stride, V contiguous), a
    non-contiguous query (a slice of fused qkv), sinks, chunks of 8 counted from kv_start, a window."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(110 + prefill)
    hq, hkv, d, bs = 6, 2, 96, 16
    lens = [37, 20, 12]
    k, v, table = _paged(lens, bs, hkv, d, dtype, device, gen)
    wide = torch.full((k.shape[0], bs, hkv + 1, d), NAN, dtype=dtype, device=device)
    wide[:, :, 1:] = k
    k_view = wide[:, :, 1:]
    assert k_view.stride() != v.stride()
    cu = _cu([13, 20, 1]) if prefill else None
    qkv = torch.randn(cu[-1] if prefill else 3, hq + 2 * hkv, d, generator=gen).to(dtype).to(device)
    query = qkv[:, :hq]
    kv_start = torch.tensor([3, 0, 2], dtype=torch.int32)
    sinks = _sinks(hq, gen)
    out, lse = window_attention(query, k_view, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=11, kv_start=kv_start.to(device), sinks=sinks.to(device), chunk_size=8,
                                return_lse=True,
                                cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    _check(out, lse, query, k, v, table, lens, cu, 11, d ** -0.5, 0.0, kv_start=kv_start, sinks=sinks, chunk_size=8)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("prefill", [False, True])
def test_window_attention_sinks_chunked_fp8(device, head_dim, prefill):
    """float8_e4m3fn caches with sinks and chunks (the sink is not scaled by k_scale or v_scale), every head dim,
    decode (with split-KV partitions: 200 keys) and prefill; power-of-two scales keep the dequantized reference
    inputs exact."""
    hi = HEAD_DIMS.index(head_dim)
    dtype = _pick([torch.float16, torch.bfloat16], hi, int(prefill))
    hq, hkv = _pick(GROUPS, hi, 2 * int(prefill))
    chunk = _pick([0, 16, 150], hi, int(prefill))
    window = _pick([0, 40], hi, 1)
    gen = torch.Generator().manual_seed(1200 + 2 * hi + prefill)
    lens = [1, 70, 200]
    k, v, table = _paged(lens, 16, hkv, head_dim, torch.float32, "cpu", gen)
    k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)
    kd, vd = k8.to(dtype) * 0.25, v8.to(dtype) * 0.125  # exact: powers of two
    cu = _cu([1, 30, 40]) if prefill else None
    query = torch.randn(cu[-1] if prefill else 3, hq, head_dim, generator=gen).to(dtype).to(device)
    kv_start = torch.tensor([0, 3, 9], dtype=torch.int32)
    sinks = _sinks(hq, gen)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k8.to(device), v8.to(device), table.to(device),
                                torch.tensor(lens, dtype=torch.int32, device=device), window=window,
                                kv_start=kv_start.to(device), sinks=sinks.to(device), chunk_size=chunk,
                                k_scale=torch.tensor([0.25], device=device),
                                v_scale=torch.tensor([0.125], device=device), return_lse=True,
                                cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    _check(out, lse, query, kd, vd, table, lens, cu, window, head_dim ** -0.5, 0.0, kv_start=kv_start, sinks=sinks,
           chunk_size=chunk)


# ---------------------------------------------------------------------------------------------------- traffic
def _visible_rows_bytes(k_cache, table, lens, q_lens, group, window, chunk, kv_start, rows_per_tile):
    """Per-byte count [storage bytes] of the K rows a kernel must read: per tile of `rows_per_tile` packed rows
    (row = token * group + head; decode: one token, any group) and KV head, each key that some query of the tile sees
    (the reference's mask) exactly once."""
    want = torch.zeros(k_cache.untyped_storage().nbytes(), dtype=torch.int32)
    cap = table.shape[1] * k_cache.shape[1]
    for b, (n, q_len) in enumerate(zip(lens, q_lens)):
        mask = window_mask_ref(torch.arange(n - q_len, n), n, window, int(kv_start[b]), chunk) & (torch.arange(n) < cap)
        for r0 in range(0, q_len * group, rows_per_tile):
            t_first, t_last = r0 // group, (min(r0 + rows_per_tile, q_len * group) - 1) // group
            seen = mask[t_first:t_last + 1].any(0).nonzero().flatten().tolist()
            if seen:
                assert seen == list(range(seen[0], seen[-1] + 1))  # one range per tile
                _count_key_rows(want, k_cache, table, b, seen[0], seen[-1])
    return want


def _assert_reads(name, want):
    import arkernels.simt

    reads, writes = arkernels.simt.traffic_map(name)
    assert int(writes.sum()) == 0
    bad = (reads != want).nonzero()
    assert bad.numel() == 0, (f"{name}: {bad.numel()} bytes read a wrong number of times (first at byte "
                              f"{int(bad[0])}: {int(reads[bad[0]])}x, want {int(want[bad[0]])}x)")


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("fp8", [False, True])
def test_window_attention_chunked_decode_traffic(device, window, fp8):
    """A chunked decode query reads only the keys of its chunk (from the chunk's first key, counted from kv_start, or
    the window's if later), each byte once per KV head, with split-KV partitions (no window: 700 keys, chunks of
    256, several splits over the chunk's keys only) and without (window 24); sinks read, never written."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(130 + window)
    lens = [1, 37, 700]
    k, v, table = _paged(lens, 16, 2, 64, torch.float16, device, gen)
    scales = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = {"k_scale": torch.tensor([0.5]), "v_scale": torch.tensor([2.0])}
    kv_start = torch.tensor([0, 5, 3], dtype=torch.int32)
    query = torch.randn(3, 6, 64, generator=gen).half()
    window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), window=window, kv_start=kv_start,
                     sinks=_sinks(6, gen), chunk_size=256, **scales)
    # splits planned for the chunk's 256 keys, ceil(256 / 128) = 2, not for the table's 720; a 24-key window: one
    assert _splits() == (2 if window == 0 else 1)
    want = _visible_rows_bytes(k, table, lens, [1, 1, 1], 3, window, 256, kv_start, rows_per_tile=16)
    for name in ("k_cache", "v_cache"):
        _assert_reads(name, want)
    totals = arkernels.simt.traffic()
    assert totals["sinks"][0] > 0 and totals["sinks"][1] == 0


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("chunk", [16, 50])
def test_window_attention_chunked_prefill_traffic(device, chunk):
    """Prefill with chunks: per 128-row packed tile and KV head, only keys some query of the tile sees are read, once
    (tiles before the chunk of every row of the tile are never visited), with kv_start moving the chunk origin."""
    gen = torch.Generator().manual_seed(140 + chunk)
    lens, q_lens = [150, 60], [100, 60]
    cu = _cu(q_lens)
    k, v, table = _paged(lens, 16, 2, 64, torch.float16, device, gen)
    kv_start = torch.tensor([0, 7], dtype=torch.int32)
    query = torch.randn(cu[-1], 4, 64, generator=gen).half()
    window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), kv_start=kv_start, chunk_size=chunk,
                     sinks=_sinks(4, gen), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    want = _visible_rows_bytes(k, table, lens, q_lens, 2, 0, chunk, kv_start, rows_per_tile=128)
    for name in ("k_cache", "v_cache"):
        _assert_reads(name, want)


# ------------------------------------------------------------------------------------------- bad inputs, opcheck
def _bad_cases():
    q = torch.randn(2, 4, 64)
    k = torch.randn(3, 4, 2, 64)
    base = dict(query=q, k_cache=k, v_cache=k.clone(), block_table=torch.tensor([[0], [1]], dtype=torch.int32),
                seq_lens=torch.tensor([3, 2], dtype=torch.int32))
    cases = [
        ("sinks must have num_q_heads = 4 entries, got 5", dict(sinks=torch.zeros(5)), RuntimeError),
        ("sinks must be 1-D", dict(sinks=torch.zeros(1, 4)), RuntimeError),
        ("sinks must be Float, got Double", dict(sinks=torch.zeros(4, dtype=torch.float64)), RuntimeError),
        ("sinks must be Float, got Int", dict(sinks=torch.zeros(4, dtype=torch.int32)), RuntimeError),
        (r"sinks\[1\] = nan must be finite or -inf", dict(sinks=torch.tensor([0.0, NAN, 0.0, 0.0])), ValueError),
        (r"sinks\[2\] = inf must be finite or -inf", dict(sinks=torch.tensor([0.0, 0.0, math.inf, 0.0])), ValueError),
        (r"sinks\[1\] = nan must be finite or -inf",  # check=False: the CPU kernel still refuses it
         dict(sinks=torch.tensor([0.0, NAN, 0.0, 0.0]), check=False), RuntimeError),
        ("chunk_size must be >= 0", dict(chunk_size=-1), RuntimeError),
    ]
    return cases, base


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])))
def test_window_attention_sinks_chunked_bad_inputs(case):
    cases, base = _bad_cases()
    match, override, exc = cases[case]
    with pytest.raises(exc, match=f"window_attention: .*{match}"):
        window_attention(**{**base, **override})


def test_window_attention_sinks_chunked_dense_bad_inputs():
    q, key = torch.randn(2, 3, 4, 64), torch.randn(2, 2, 9, 64)
    with pytest.raises(RuntimeError, match="window_attention: sinks must have num_q_heads = 4 entries, got 2"):
        window_attention_dense(q, key, key, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"window_attention_dense: sinks\[0\] = inf must be finite"):
        window_attention_dense(q, key, key, sinks=torch.full((4,), math.inf))
    with pytest.raises(RuntimeError, match="window_attention: chunk_size must be >= 0"):
        window_attention_dense(q, key, key, chunk_size=-3)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
def test_window_attention_sinks_cuda_limits(device):
    """What the CUDA launch refuses about the new arguments: a chunk_size past int32."""
    k = torch.zeros(2, 4, 1, 64, dtype=torch.float16, device=device)
    with pytest.raises(RuntimeError, match="window_attention: chunk_size must fit in int32"):
        window_attention(torch.zeros(1, 1, 64, dtype=torch.float16, device=device), k, k,
                         torch.zeros(1, 1, dtype=torch.int32, device=device),
                         torch.ones(1, dtype=torch.int32, device=device), chunk_size=2 ** 31)


def test_window_attention_sinks_chunked_opcheck():
    gen = torch.Generator().manual_seed(150)
    lens = [5, 9]
    k, v, table = _paged(lens, 4, 2, 16, torch.float32, "cpu", gen)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)  # opcheck compares outputs with NaN-unaware checks
    seq = torch.tensor(lens, dtype=torch.int32)
    op = torch.ops.arkernels.window_attention.default
    sinks = torch.tensor([0.5, -1.0, 2.0, -math.inf])
    torch.library.opcheck(op, (torch.randn(2, 4, 16, generator=gen), k, v, table, seq, None, None, 1, 0, 0.25, 0.0,
                               None, None, sinks, 3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    torch.library.opcheck(op, (torch.randn(7, 4, 16, generator=gen), k, v, table, seq, cu,
                               torch.tensor([1, 0], dtype=torch.int32), 4, 3, 0.25, 2.0, None, None, sinks, 2))


def test_window_attention_sinks_chunked_compile_fullgraph():
    def step(q, k, v, table, lens, cu, starts, sinks):
        return window_attention(q, k, v, table, lens, window=3, cu_seqlens_q=cu, max_q_len=4, kv_start=starts,
                                sinks=sinks, chunk_size=2, check=False)

    gen = torch.Generator().manual_seed(160)
    k, v, table = _paged([5, 9], 4, 2, 16, torch.float32, "cpu", gen)
    args = (torch.randn(7, 4, 16, generator=gen), k, v, table, torch.tensor([5, 9], dtype=torch.int32),
            torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32), torch.randn(4))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), step(*args))


def test_window_attention_sinks_fp32_cpu_tolerance_is_tight():
    """fp32 on the CPU kernel: sinks and chunks within FP32_TOL of the reference on a long row (the yardstick the
    fp32 cases above use, checked here on a case where a wrong sink weight would be far outside it)."""
    gen = torch.Generator().manual_seed(170)
    lens = [60]
    k, v, table = _paged(lens, 16, 1, 32, torch.float32, "cpu", gen)
    query = torch.randn(1, 2, 32, generator=gen)
    sinks = torch.tensor([SINK_DOMINANT, -0.5])
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), sinks=sinks,
                                chunk_size=16, return_lse=True)
    no_sink = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), chunk_size=16)
    _check(out, lse, query, k, v, table, lens, None, 0, 32 ** -0.5, 0.0, sinks=sinks, chunk_size=16)
    assert (out - no_sink).abs().max().item() > 100 * FP32_TOL  # the sink changes the output beyond the tolerance
