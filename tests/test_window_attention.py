"""window_attention / window_attention_dense against the naive fp64 reference.

Tolerance (the FlashAttention habit): for fp16/bf16 inputs, max|ours - ref64| <= 2 * max|torch_lowp - ref64| + 1e-5,
where torch_lowp is PyTorch's own attention (matmul + softmax) on the same low-precision inputs in that dtype with
the same mask; for fp32 inputs an absolute 2e-5 (fp32 accumulation over <= 256-wide dots and <= 70 keys).
"""
import math

import pytest
import torch

from arkernels.ops.window_attention import window_attention, window_attention_dense
from arkernels.reference.window_attention import window_attention_dense_ref, window_attention_ref, window_mask_ref
from conftest import CUDA_KERNEL_DEVICES, DEVICES, SIMT_DEVICES, runs_cuda_kernel

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 80, 96, 128, 256]
BLOCK_SIZES = [1, 16, 13]  # 13: not a power of two
GQA = [(3, 3), (6, 2), (8, 1)]  # (num_q_heads, num_kv_heads): ratios 1, 3, 8
WINDOWS = [0, 1, 7, 16, 1000]  # 0: full causal; 1000: longer than every sequence
BATCHES = [1, 3, 7]
FP32_TOL = 2e-5
NAN = float("nan")


def _lens_for(window, block_size, cap=70):
    """Ragged lengths: 1, W-1, W, W+1, ending on and across block boundaries, one long."""
    cands = {1, 2 * block_size, 2 * block_size + 1, 3 * block_size - 1, 41}
    if 0 < window < cap:
        cands |= {max(window - 1, 1), window, window + 1}
    return sorted(n for n in cands if 0 < n <= cap)


def _paged(lens, block_size, hkv, d, dtype, device, gen, extra_blocks=2):
    """Random K/V in a shuffled block pool; unused blocks and slots past each length are NaN (poison)."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    k = torch.full((num_blocks, block_size, hkv, d), NAN)
    v = torch.full((num_blocks, block_size, hkv, d), NAN)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)  # -1 past each sequence
    for b, n in enumerate(lens):
        for i in range(need[b]):
            blk = ids.pop()
            table[b, i] = blk
            used = min(block_size, n - i * block_size)
            k[blk, :used] = torch.randn(used, hkv, d, generator=gen)
            v[blk, :used] = torch.randn(used, hkv, d, generator=gen)
    return k.to(dtype).to(device), v.to(dtype).to(device), table.to(device)


def _torch_lowp(query, k_cache, v_cache, table, lens, cu, window, scale, softcap, kv_start=None, sinks=None,
                chunk_size=0):
    """PyTorch's own attention in the inputs' dtype with the same mask (the error yardstick); sinks as transformers'
    gpt_oss eager attention adds them (a column of the softmax, dropped after it)."""
    dtype, hq = query.dtype, query.shape[1]
    q_all, k_cache, v_cache = query.cpu(), k_cache.cpu(), v_cache.cpu()
    group, bs = hq // k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(query.shape, dtype=dtype)
    for b, n in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0 or n == 0:
            continue
        cap = table.shape[1] * bs  # keys past what the table addresses are masked (check=False callers)
        pos = torch.arange(n).clamp(max=cap - 1)  # any in-table row: those keys are masked below
        blk = table[b].cpu().long()[pos // bs]
        k = k_cache[blk, pos % bs].repeat_interleave(group, 1).transpose(0, 1)  # [hq, n, d]
        v = v_cache[blk, pos % bs].repeat_interleave(group, 1).transpose(0, 1)
        q = q_all[cu[b]:cu[b + 1]].transpose(0, 1)  # [hq, q_len, d]
        s = (q @ k.transpose(1, 2)) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        start = 0 if kv_start is None else int(kv_start[b])
        mask = window_mask_ref(torch.arange(n - q_len, n), n, window, start, chunk_size) & (torch.arange(n) < cap)
        s = s.masked_fill(~mask[None], -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.cpu().to(dtype).reshape(-1, 1, 1).expand(hq, q_len, 1)], dim=-1)
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        if sinks is not None:
            p = p[..., :-1]
        out[cu[b]:cu[b + 1]] = (p @ v).transpose(0, 1)
    return out


def _poison_allocator(*shapes_dtypes, device):
    """Fill and free blocks the size of the op's outputs, so a kernel that leaves an element unwritten returns
    NaN instead of fresh zeros (reliable with the CUDA caching allocator; best effort with malloc)."""
    for shape, dtype in shapes_dtypes:
        torch.full(shape, NAN, dtype=dtype, device=device)


def _check(out, lse, query, k, v, table, lens, cu, window, scale, softcap, kv_start=None, sinks=None,
           chunk_size=0):
    """out/lse against the fp64 reference. Queries with no visible key: exact zeros and lse -inf (with sinks: the
    sink, the whole denominator)."""
    ref, ref_lse = window_attention_ref(query, k, v, table, torch.tensor(lens, dtype=torch.int32), window=window,
                                       scale=scale, softcap=softcap,
                                       cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32),
                                       kv_start=kv_start, sinks=sinks, chunk_size=chunk_size)
    assert out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()
    assert lse.shape == query.shape[:2] and lse.dtype == torch.float32
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.double() - ref).abs().max().item()
    if query.dtype == torch.float32:
        tol = FP32_TOL
    else:
        cu_list = list(range(len(lens) + 1)) if cu is None else cu
        lowp = _torch_lowp(query, k, v, table, lens, cu_list, window, scale, softcap, kv_start, sinks, chunk_size)
        tol = 2 * (lowp.double() - ref).abs().max().item() + 1e-5
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    if sinks is None:
        empty = torch.isinf(ref_lse)  # queries with no visible key: exact zeros and lse -inf
        assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all())
    else:  # the sink alone: lse == sink exactly in fp64 (any visible key adds a positive term)
        sink_lse = sinks.cpu().double()[None, :].expand_as(ref_lse)
        empty = ref_lse == sink_lse
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        assert torch.allclose(lse.double()[empty], sink_lse[empty], atol=1e-5, rtol=1e-6)
    assert bool((out[empty] == 0).all())
    assert torch.allclose(lse.double()[~empty], ref_lse[~empty], atol=1e-4, rtol=1e-5)
    return empty


def _skip_unsupported(device, dtype):
    if runs_cuda_kernel(device) and dtype == torch.float32:
        pytest.skip("float32 runs on the CPU kernel only (CUDA: fp16/bf16, refused by test_window_attention_cuda_refuses)")


def _pick(seq, *keys):
    """Cycle a secondary parameter deterministically over the primary grid, so every value is covered."""
    return seq[sum(keys) % len(seq)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_window_attention_decode_grid(device, dtype, window, block_size):
    _skip_unsupported(device, dtype)
    wi, bi, di = WINDOWS.index(window), BLOCK_SIZES.index(block_size), DTYPES.index(dtype)
    d = _pick(HEAD_DIMS, wi, 2 * bi, di)
    hq, hkv = _pick(GQA, wi, bi)
    gen = torch.Generator().manual_seed(1000 * wi + 10 * bi + di)
    lens = _lens_for(window, block_size)
    k, v, table = _paged(lens, block_size, hkv, d, dtype, device, gen)
    query = torch.randn(len(lens), hq, d, generator=gen).to(dtype).to(device)
    scale = d ** -0.5
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, return_lse=True)
    _check(out, lse, query, k, v, table, lens, None, window, scale, 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("chunked", [False, True])
def test_window_attention_prefill_grid(device, dtype, head_dim, gqa, chunked):
    """Prefill with q_len == seq_len, and chunked prefill (q_len < seq_len) on top of an existing cache."""
    _skip_unsupported(device, dtype)
    di, hi, gi = DTYPES.index(dtype), HEAD_DIMS.index(head_dim), GQA.index(gqa)
    window = _pick(WINDOWS, di, hi, 2 * gi, int(chunked))
    block_size = _pick(BLOCK_SIZES, hi, gi)
    batch = _pick(BATCHES, di, gi, int(chunked))
    gen = torch.Generator().manual_seed(100 * hi + 10 * gi + di + 7 * chunked)
    cands = _lens_for(window, block_size, cap=40)
    lens = [cands[(3 * i + 1) % len(cands)] for i in range(batch)]
    lens[-1] = max(cands)  # the longest last: the grid must not be sized by the first sequence
    q_lens = [max(1, n // (b + 2)) if chunked else n for b, n in enumerate(lens)]
    if chunked and batch > 1:
        q_lens[0] = 0  # a sequence with no new queries
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    hq, hkv = gqa
    k, v, table = _paged(lens, block_size, hkv, head_dim, dtype, device, gen)
    query = torch.randn(cu[-1], hq, head_dim, generator=gen).to(dtype).to(device)
    softcap = 0.0 if (di + hi) % 2 else 3.0
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, softcap=softcap,
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device), return_lse=True)
    _check(out, lse, query, k, v, table, lens, cu, window, head_dim ** -0.5, softcap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_attention_strided_inputs_and_kv_start(device, dtype):
    """query a slice of a fused qkv output, the caches strided views, left padding via kv_start, a custom scale."""
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 80, 16
    lens = [37, 16, 5, 9]
    k, v, table = _paged(lens, bs, hkv, d, dtype, device, gen)
    # the same cache with a padded row stride: [num_blocks, block_size, hkv, d] inside a wider buffer
    wide = torch.full((k.shape[0], bs, hkv + 1, d), NAN, dtype=dtype, device=device)
    wide[:, :, 1:] = k
    k_view = wide[:, :, 1:]
    assert not k_view.is_contiguous()
    cu = [0, 6, 7, 10, 19]
    qkv = torch.randn(cu[-1], hq + 2 * hkv, d, generator=gen).to(dtype).to(device)
    query = qkv[:, :hq]
    assert not query.is_contiguous()
    kv_start = torch.tensor([3, 15, 5, -2], dtype=torch.int32)  # 5 == seq_len: every key masked; -2: none
    # check=False: check=True refuses the negative kv_start (unchecked it counts as 0)
    out, lse = window_attention(query, k_view, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=7, scale=0.3, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
                                kv_start=kv_start.to(device), return_lse=True, check=False)
    _check(out, lse, query, k, v, table, lens, cu, 7, 0.3, 0.0, kv_start=kv_start)
    assert bool((out[7:10].cpu() == 0).all())  # sequence 2: everything left-padded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("window", [0, 1000])
def test_window_attention_decode_long_context(device, dtype, window):
    """Contexts long enough for the CUDA decode kernel to split the KV range (flash-decoding partitions + combine),
    one of them far past the window; left padding on the other."""
    gen = torch.Generator().manual_seed(11)
    lens = [3001, 1500]
    k, v, table = _paged(lens, 16, 1, 128, dtype, device, gen)
    query = torch.randn(2, 4, 128, generator=gen).to(dtype).to(device)
    kv_start = torch.tensor([0, 700], dtype=torch.int32)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, kv_start=kv_start.to(device), return_lse=True)
    _check(out, lse, query, k, v, table, lens, None, window, 128 ** -0.5, 0.0, kv_start=kv_start)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 50])
def test_window_attention_prefill_long(device, dtype, window):
    """Several 64-row query tiles and key tiles, some wholly outside the window (skipped on CUDA), GQA 8/2,
    head_dim 96, chunked on top of a cache (q_len 200 of 301) and one sequence of exactly 64 queries."""
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(12)
    lens, q_lens = [301, 64], [200, 64]
    k, v, table = _paged(lens, 16, 2, 96, dtype, device, gen)
    cu = [0, q_lens[0], q_lens[0] + q_lens[1]]
    query = torch.randn(cu[-1], 8, 96, generator=gen).to(dtype).to(device)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
                                return_lse=True)
    _check(out, lse, query, k, v, table, lens, cu, window, 96 ** -0.5, 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,window,block_size", [(torch.float16, 1, 1), (torch.bfloat16, 1000, 13)])
def test_window_attention_prefill_packed_gqa(device, dtype, window, block_size):
    """GQA 16/1 (the CUDA kernel packs a KV head's 16 query heads as rows token * 16 + head: 8 tokens per 128-row
    tile), head_dim 80, window 1 (each query sees only itself) or longer than every prompt, block size 1 or 13,
    left padding (kv_start), chunked prefill over a cache and a whole prompt."""
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(14 + window)
    lens, q_lens = [45, 19], [30, 19]
    k, v, table = _paged(lens, block_size, 1, 80, dtype, device, gen)
    cu = [0, q_lens[0], q_lens[0] + q_lens[1]]
    query = torch.randn(cu[-1], 16, 80, generator=gen).to(dtype).to(device)
    kv_start = torch.tensor([3, 0], dtype=torch.int32)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
                                kv_start=kv_start.to(device), return_lse=True)
    _check(out, lse, query, k, v, table, lens, cu, window, 80 ** -0.5, 0.0, kv_start=kv_start)


@pytest.mark.parametrize("device", DEVICES)
def test_window_attention_prefill_unaligned_query(device):
    """A query whose rows are not 16-byte aligned (a view starting one element into its buffer): the CUDA prefill
    kernel loads it element by element instead of with 16-byte cp.async."""
    gen = torch.Generator().manual_seed(15)
    lens, q_lens = [70, 12], [70, 5]
    k, v, table = _paged(lens, 16, 2, 64, torch.float16, device, gen)
    cu = [0, q_lens[0], q_lens[0] + q_lens[1]]
    buf = torch.randn(cu[-1], 4, 65, generator=gen).half().to(device)
    query = buf[:, :, 1:]
    assert query.data_ptr() % 16 != 0
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device), window=30,
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device), return_lse=True)
    _check(out, lse, query, k, v, table, lens, cu, 30, 64 ** -0.5, 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 500])
def test_window_attention_decode_via_cu_seqlens(device, window):
    """One query per sequence given as cu_seqlens_q with max_q_len 1 (the HF paged path; on CUDA the prefill
    kernel takes it), including a sequence with no query, and long contexts."""
    gen = torch.Generator().manual_seed(13)
    lens, cu = [2000, 37, 900], [0, 1, 1, 2]
    k, v, table = _paged(lens, 16, 2, 64, torch.float16, device, gen)
    query = torch.randn(2, 6, 64, generator=gen).half().to(device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=window, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
                                max_q_len=1, return_lse=True)
    _check(out, lse, query, k, v, table, lens, cu, window, 64 ** -0.5, 0.0)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
def test_window_attention_cuda_refuses(device):
    """What the CUDA kernels do not take raises a clear error: fp32, an unsupported head_dim, unaligned cache rows."""
    k = torch.zeros(2, 4, 1, 64, dtype=torch.float16, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="window_attention: CUDA kernels take float16 or bfloat16"):
        window_attention(torch.zeros(1, 1, 64, device=device), k.float(), k.float(), table, lens)
    k48 = torch.zeros(2, 4, 1, 48, dtype=torch.float16, device=device)
    with pytest.raises(RuntimeError, match="window_attention: head_dim must be 64, 80, 96, 128 or 256 on CUDA"):
        window_attention(torch.zeros(1, 1, 48, dtype=torch.float16, device=device), k48, k48, table, lens)
    flat = torch.zeros(2 * 4 * 64 + 1, dtype=torch.float16, device=device)
    k_odd = flat[1:].view(2, 4, 1, 64)
    with pytest.raises(RuntimeError, match="window_attention: on CUDA k_cache and v_cache rows must be 16-byte"):
        window_attention(torch.zeros(1, 1, 64, dtype=torch.float16, device=device), k_odd, k_odd, table, lens)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
@pytest.mark.parametrize("max_q_len", [0, 1, 64])
def test_window_attention_cuda_prefill_max_q_len_too_small(device, max_q_len):
    """check=False with a max_q_len below the real query counts (200 and 70 rows): max_q_len only sizes the grid,
    each CTA strides over the sequence's real query blocks, so every row is written and right. (Once the rows past
    max_q_len were left as uninitialised memory: the poisoned allocator would return them as NaN.)"""
    gen = torch.Generator().manual_seed(21)
    lens, q_lens = [301, 70], [200, 70]
    k, v, table = _paged(lens, 16, 2, 64, torch.float16, device, gen)
    cu = [0, q_lens[0], q_lens[0] + q_lens[1]]
    query = torch.randn(cu[-1], 4, 64, generator=gen).half().to(device)
    _poison_allocator((query.shape, torch.float16), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                window=50, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
                                max_q_len=max_q_len, return_lse=True, check=False)
    _check(out, lse, query, k, v, table, lens, cu, 50, 64 ** -0.5, 0.0)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_attention_cuda_prefill_on_a_99kb_gpu(device, monkeypatch, dtype):
    """A GPU with 99 KB of shared memory per block (sm_86/sm_89, emulated with ARKERNELS_MAX_SMEM_PER_BLOCK): the
    prefill plan takes 32-key tiles for head_dim 128 (85 KB with 3 stages, as on every GPU) and for head_dim 256
    (2 stages: exactly 101376 bytes) and stays right; below that head_dim 256 is refused with a message naming the op
    and the sizes."""
    monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(99 * 1024))
    gen = torch.Generator().manual_seed(22)
    for d, lens, q_lens, hq in [(128, [150, 37], [150, 20], 6), (256, [70, 37], [70, 9], 2)]:
        k, v, table = _paged(lens, 16, 2, d, dtype, device, gen)
        cu = [0, q_lens[0], q_lens[0] + q_lens[1]]
        query = torch.randn(cu[-1], hq, d, generator=gen).to(dtype).to(device)
        _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
        out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                    window=40, softcap=3.0,
                                    cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device), return_lse=True)
        _check(out, lse, query, k, v, table, lens, cu, 40, d ** -0.5, 3.0)
    monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(96 * 1024))
    k256 = torch.zeros(2, 16, 1, 256, dtype=dtype, device=device)
    with pytest.raises(RuntimeError, match="window_attention: prefill with head_dim 256 needs at least 101376 bytes"):
        window_attention(torch.zeros(2, 1, 256, dtype=dtype, device=device), k256, k256,
                         torch.zeros(1, 1, dtype=torch.int32, device=device),
                         torch.full((1,), 2, dtype=torch.int32, device=device),
                         cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("prefill", [False, True])
def test_window_attention_length_past_block_table(device, window, prefill):
    """check=False with seq_lens past what the block table addresses (length 100, table 4 x 16 = 64 slots): keys at
    positions >= 64 are masked and the queries keep their positions (the one rule of every kernel). Decode: the query
    at 99 with window 20 sees no key (zeros, lse -inf), with no window it sees keys 0..63. Prefill: the last 40
    positions (60..99) of that sequence plus a sequence inside its table. (The CUDA kernels once clamped the length
    instead, so the query at 99 attended keys 44..63.)"""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(8)
    k, v, table = _paged([64, 30], 16, 2, 64, dtype, device, gen)
    table = table[:, :4]  # 4 x 16 slots
    lens = torch.tensor([100, 30], dtype=torch.int32)
    cu = [0, 40, 50] if prefill else None
    query = torch.randn(cu[-1] if prefill else 2, 4, 64, generator=gen).to(dtype).to(device)
    out, lse = window_attention(query, k, v, table, lens.to(device), window=window, return_lse=True, check=False,
                                cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    _check(out, lse, query, k, v, table, lens.tolist(), cu, window, 64 ** -0.5, 0.0)
    last = 39 if prefill else 0  # the row of the query at position 99
    if window:
        assert bool((out[last] == 0).all()) and bool(torch.isneginf(lse[last]).all())
    else:
        assert bool(torch.isfinite(lse[last]).all())
    with pytest.raises(ValueError):  # check=True refuses such a length before any kernel runs
        window_attention(query, k, v, table, lens.to(device), window=window, check=True,
                         cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))


def _count_key_rows(want, k_cache, table, b, lo, hi):
    """Adds 1 to the per-byte count `want` over the cache rows of sequence b's keys lo..hi, every KV head."""
    bs, hkv, d = k_cache.shape[1:]
    es = k_cache.element_size()
    for j in range(lo, hi + 1):
        blk = int(table[b, j // bs])
        for h in range(hkv):
            start = (blk * k_cache.stride(0) + (j % bs) * k_cache.stride(1) + h * k_cache.stride(2)) * es
            want[start:start + d * es] += 1


def _visible_kv_bytes(k_cache, table, lens, window, kv_start):
    """Per-byte count [storage bytes] of the K rows decode must read: each visible key's row once per KV head."""
    want = torch.zeros(k_cache.untyped_storage().nbytes(), dtype=torch.int32)
    cap = table.shape[1] * k_cache.shape[1]
    for b, n in enumerate(lens):
        i = n - 1
        lo = max(int(kv_start[b]), 0, i - window + 1 if window else 0)
        _count_key_rows(want, k_cache, table, b, lo, min(i, cap - 1))
    return want


def _assert_kv_reads(want):
    """The last emulated call read each byte of k_cache and v_cache exactly `want` times (per-byte counts over their
    storage) and wrote none."""
    import arkernels.simt

    for name in ("k_cache", "v_cache"):
        reads, writes = arkernels.simt.traffic_map(name)
        assert int(writes.sum()) == 0
        bad = (reads != want).nonzero()
        assert bad.numel() == 0, (f"{name}: {bad.numel()} bytes read a wrong number of times (first at byte "
                                  f"{int(bad[0])}: {int(reads[bad[0]])}x, want {int(want[bad[0]])}x)")


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (16, 2), (32, 2), (40, 2)])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("fp8", [False, True])
def test_window_attention_decode_traffic(device, heads, window, fp8):
    """Decode reads each visible K/V byte exactly once per KV head, whatever the split count, for every GQA group up
    to 16 (the M = 16 rows of one mma tile); a group of 20 takes 2 CTAs per KV head and reads it twice. No byte
    outside the window, kv_start or the sequence is read (the emulator counts every global load per byte)."""
    import arkernels.simt

    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq + window)
    lens = [1, 37, 300]  # 300 keys over a 3-sequence batch: several split-KV partitions on sm_90's 132 SMs
    k, v, table = _paged(lens, 16, hkv, 64, torch.float16, device, gen)
    scales = {}
    if fp8:  # 1-byte rows: the same keys, half the bytes
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = {"k_scale": torch.tensor([0.5]), "v_scale": torch.tensor([2.0])}
    kv_start = torch.tensor([0, 5, 0], dtype=torch.int32)
    query = torch.randn(3, hq, 64, generator=gen).half()
    window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), window=window, kv_start=kv_start,
                     **scales)
    _assert_kv_reads(_visible_kv_bytes(k, table, lens, window, kv_start) * -(-(hq // hkv) // 16))
    totals = arkernels.simt.traffic()
    q_read, q_written = totals["query"]  # once per split-KV partition (each CTA loads its heads' query rows)
    assert q_written == 0 and q_read > 0 and q_read % (query.numel() * 2) == 0
    assert totals["block_table"][1] == totals["seq_lens"][1] == 0  # index tensors are never written


def _decode_smem(d, stages, fp8=False):
    """Dynamic shared memory of a decode CTA (csrc/window_attention_decode.cuh, decode_layout): `stages` K/V tile
    pairs of 64 keys as stored (16-bit rows padded to d + 8 elements, fp8 rows to d + 16 bytes), the 16-row query tile
    (d + 8 16-bit elements a row), 8-byte K offsets per stage and V offsets for max(stages - 1, 1) tiles; at least the
    final merge's [4][16][d + 8] fp32 O (rows padded: conflict-free stores) and its [2][4][16] m, l."""
    ld = d + 8
    stage = 2 * 64 * (d + 16) if fp8 else 2 * 64 * ld * 2
    return max(stages * stage + 16 * ld * 2 + (stages + max(stages - 1, 1)) * 64 * 8,
               4 * 16 * (d + 10) * 4)


DECODE_GROUPS = [(1, 1), (2, 1), (8, 2), (10, 2), (16, 1), (20, 1)]  # GQA 1, 2, 4, 5, 16 and 20 (two CTAs per KV head)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_window_attention_decode_stages_and_groups(device, monkeypatch, head_dim, stages, fp8):
    """The tensor-core decode kernel for every head dim at every cp.async ring depth: the per-block shared-memory
    limit is lowered to exactly what `stages` stages need, so the planner must pick that depth (the launch's dynamic
    shared memory says which ran). GQA groups 1..20, block sizes 1, 16 and 13, ragged lengths over several 64-key
    tiles and split-KV partitions, windows, kv_start, softcap, fp16 and bf16, 16-bit and fp8 caches (fp8: operands
    converted in registers; 1 stage at small head dims is sized by the merge buffer), against the fp64 reference."""
    import arkernels.simt

    smem = _decode_smem(head_dim, stages, fp8)
    if smem > 227 * 1024:
        pytest.skip(f"{stages} stages at head_dim {head_dim} need {smem} bytes: more than sm_90 allows per block")
    monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(smem))
    hi, si = HEAD_DIMS.index(head_dim), stages - 1
    hq, hkv = _pick(DECODE_GROUPS, hi, 2 * si)
    block_size = _pick(BLOCK_SIZES, hi, si)
    window = _pick([0, 1, 77], hi, 3 * si)
    softcap = _pick([0.0, 2.5], hi, si)
    dtype = _pick([torch.float16, torch.bfloat16], hi, si + 1)
    gen = torch.Generator().manual_seed(100 * hi + si)
    lens = [1, 70, 200]  # 200 keys: 4 tiles, in 2 split-KV partitions on sm_90
    k, v, table = _paged(lens, block_size, hkv, head_dim, torch.float32 if fp8 else dtype, device, gen)
    scales = {}
    if fp8:  # powers of two: the 16-bit copy of the dequantized cache is exact, the reference runs on it
        k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)
        scales = {"k_scale": torch.tensor([0.25]), "v_scale": torch.tensor([0.125])}
    kv_start = torch.tensor([0, 3, 0], dtype=torch.int32)
    query = torch.randn(3, hq, head_dim, generator=gen).to(dtype)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k8 if fp8 else k, v8 if fp8 else v, table, torch.tensor(lens, dtype=torch.int32),
                                window=window, softcap=softcap, kv_start=kv_start, return_lse=True, **scales)
    if fp8:
        k, v = k8.to(dtype) * 0.25, v8.to(dtype) * 0.125
    assert arkernels.simt.launches()[0]["smem"] == smem
    _check(out, lse, query, k, v, table, lens, None, window, head_dim ** -0.5, softcap, kv_start=kv_start)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block_order", [0, 1, 2])
def test_window_attention_decode_split_combine(device, block_order):
    """Split-KV decode is one launch: the last split CTA of each (sequence, KV head) to finish merges the partials,
    whichever it is (the emulator runs the grid's blocks in linear order and in seeded permutations), and leaves its
    completion counter at zero: three calls in a row on the same counters, with other split counts in between
    (each checked against the fp64 reference), all right. Heads with no visible key in a split (a window much shorter
    than the context, kv_start past a split) contribute nothing; a sequence with no key at all gets zeros, lse -inf."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(40 + block_order)
    calls = [([1000, 0, 700], 0, [0, 0, 650]), ([1000, 333, 9], 300, [0, 0, 0]), ([1000, 0, 700], 0, [0, 0, 650])]
    with arkernels.simt.emulate(block_order=block_order):
        for lens, window, starts in calls:
            k, v, table = _paged(lens, 16, 2, 64, torch.bfloat16, device, gen)
            query = torch.randn(3, 6, 64, generator=gen).bfloat16()
            kv_start = torch.tensor(starts, dtype=torch.int32)
            out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), window=window,
                                        kv_start=kv_start, return_lse=True)
            launches = arkernels.simt.launches()
            assert len(launches) == 1 and launches[0]["grid"][0] > 1, launches  # split, and no combine launch
            _check(out, lse, query, k, v, table, lens, None, window, 64 ** -0.5, 0.0, kv_start=kv_start)
            if lens[1] == 0:
                assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())


@pytest.mark.cuda
def test_window_attention_decode_split_combine_cuda_graph():
    """Split-KV decode captured in a CUDA graph (its completion counters are the graph's own, zeroed per replay by a
    memset node) and replayed with new queries, interleaved with eager calls and calls on another stream (each stream
    keeps its own counters): every result matches the fp64 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator().manual_seed(45)
    lens = [3000, 1700]
    k, v, table = _paged(lens, 16, 2, 128, torch.bfloat16, "cuda", gen)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    query = torch.randn(2, 8, 128, generator=gen).bfloat16().cuda()
    run = lambda: window_attention(query, k, v, table, lens_t, return_lse=True)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for _ in range(3):
        query.copy_(torch.randn(2, 8, 128, generator=gen).bfloat16())
        graph.replay()
        eager = run()
        with torch.cuda.stream(side):
            other = run()
        torch.cuda.synchronize()
        for o, l in ((out, lse), eager, other):
            _check(o, l, query, k, v, table, lens, None, 0, 128 ** -0.5, 0.0)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("prefill", [False, True])
def test_window_attention_fp8_cache(device, head_dim, prefill):
    """float8_e4m3fn caches (key = stored * k_scale, value = stored * v_scale) in the CUDA kernels: decode and prefill
    convert each landed tile to 16 bits in shared memory and fold the scales into the score scale and the output.
    Scales are powers of two, so the 16-bit copy of the dequantized cache is exact and
    the fp64 reference over it is the yardstick (a missing or misplaced scale is off by 2x or 4x). GQA, windows,
    softcap, block sizes 1/16/13, split-KV partitions."""
    hi = HEAD_DIMS.index(head_dim)
    dtype = _pick([torch.float16, torch.bfloat16], hi, int(prefill))
    hq, hkv = _pick(DECODE_GROUPS, hi, 3 * int(prefill))
    block_size = _pick(BLOCK_SIZES, hi, int(prefill))
    window, softcap = _pick([0, 40], hi, 0), _pick([0.0, 2.5], hi, 1)
    gen = torch.Generator().manual_seed(200 + hi)
    lens = [1, 70, 200]
    k, v, table = _paged(lens, block_size, hkv, head_dim, torch.float32, "cpu", gen)
    k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)  # NaN poison stays NaN
    k_scale = torch.tensor([0.25], device=device)
    v_scale = torch.tensor([0.125], device=device)
    kd, vd = (k8.to(dtype) * 0.25).to(device), (v8.to(dtype) * 0.125).to(device)  # exact: powers of two
    cu = [0, 1, 31, 71] if prefill else None
    query = torch.randn(cu[-1] if prefill else 3, hq, head_dim, generator=gen).to(dtype).to(device)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k8.to(device), v8.to(device), table.to(device),
                                torch.tensor(lens, dtype=torch.int32, device=device), window=window, softcap=softcap,
                                k_scale=k_scale, v_scale=v_scale, return_lse=True,
                                cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    _check(out, lse, query, kd, vd, table, lens, cu, window, head_dim ** -0.5, softcap)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
def test_window_attention_fp8_cache_bf16_q_scale_spans_warps(device):
    """fp8 caches under bf16 queries: the decode kernel runs its MMAs in fp16 with Q scaled by one power of two per
    CTA, from the largest |q| of every warp's share of the tile. Here one head of each group (row 7 of the 8, loaded
    by the last warp) is 2^11 times the others: a scale taken from one warp's share would push it past fp16's range
    (inf, then NaN)."""
    hq, hkv, head_dim = 16, 2, 128
    gen = torch.Generator().manual_seed(211)
    lens = [37, 150]
    k, v, table = _paged(lens, 16, hkv, head_dim, torch.float32, "cpu", gen)
    k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)
    kd, vd = (k8.to(torch.bfloat16) * 0.25).to(device), (v8.to(torch.bfloat16) * 0.125).to(device)  # exact
    query = torch.randn(len(lens), hq, head_dim, generator=gen)
    query[:, 7::8] *= 2.0 ** 11
    query = query.to(torch.bfloat16).to(device)
    out, lse = window_attention(query, k8.to(device), v8.to(device), table.to(device),
                                torch.tensor(lens, dtype=torch.int32, device=device),
                                k_scale=torch.tensor([0.25], device=device), v_scale=torch.tensor([0.125], device=device),
                                return_lse=True)
    _check(out, lse, query, kd, vd, table, lens, None, 0, head_dim ** -0.5, 0.0)


def _prefill_smem(d, bn, stages, fp8=False):
    """Dynamic shared memory of a prefill CTA (csrc/window_attention_prefill.cuh, prefill_smem): the Q tile of 128
    packed rows (64 at head_dim 256) of d + 8 16-bit elements, and the ring of `stages` K/V tile pairs of `bn` keys:
    16-bit rows padded like Q. fp8: the converted 16-bit K and V tiles (2 * bn rows of d + 8) after the Q tile (the
    warps re-read Q from it per key tile); ring rows of d bytes and a valid-flag byte per key and stage."""
    rows, ld = (128 if d <= 128 else 64), d + 8
    if fp8:
        return (rows + 2 * bn) * ld * 2 + stages * bn * (2 * d + 1)
    return (rows + stages * 2 * bn) * ld * 2


# (key-tile width, ring depth) of the fp8 prefill plan per emulated GPU and head_dim: the first of (64, 3), (64, 2),
# (32, 3), (32, 2) that fits the per-block limit (sm_80 166912, sm_89 101376, sm_90 232448 bytes), 32-key tiles only
# at 96 and 128 (32 rows per warp: prefill_bn_max). At 256: (64, 3) needs 199872 (sm_90), (64, 2) 167040, (32, 3)
# 116832 (sm_80), (32, 2) 100416 (sm_89).
FP8_PREFILL_PLANS = {
    "sm_80": {64: (64, 3), 80: (64, 3), 96: (32, 3), 128: (32, 3), 256: (32, 3)},
    "sm_89": {64: (64, 3), 80: (64, 3), 96: (32, 3), 128: (32, 3), 256: (32, 2)},
    "sm_90": {64: (64, 3), 80: (64, 3), 96: (32, 3), 128: (32, 3), 256: (64, 3)},
}
FP8_GROUPS = [(3, 3), (6, 2), (8, 1), (10, 2), (16, 1)]


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("gpu", list(FP8_PREFILL_PLANS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_window_attention_prefill_fp8(device, gpu, head_dim):
    """Prefill over float8_e4m3fn caches read as stored (no 16-bit copy): every head_dim under the plan of each
    emulated GPU (the launch's shared memory says which tile width and ring depth ran), fp16 and bf16 queries for every
    head_dim, GQA 1..16, block sizes 1, 16 and 13, windows (1, 40, longer than every prompt, none), softcap,
    kv_start, ragged lengths: a one-token prompt, chunked prefill over a cache (several 128-row query tiles and more
    key tiles than ring stages), a whole prompt, a sequence with no new query. Power-of-two scales make the 16-bit
    copy of the dequantized cache exact, so the fp64 reference over it is the yardstick (a missing or misplaced
    scale is off by 4x or 8x)."""
    import arkernels.simt

    hi, gi = HEAD_DIMS.index(head_dim), list(FP8_PREFILL_PLANS).index(gpu)
    dtype = _pick([torch.float16, torch.bfloat16], hi, gi)
    hq, hkv = _pick(FP8_GROUPS, hi, 2 * gi)
    block_size = _pick(BLOCK_SIZES, hi, gi)
    window = _pick([0, 1, 40, 1000], hi, 3 * gi)
    softcap = _pick([0.0, 2.5], hi, gi + 1)
    gen = torch.Generator().manual_seed(300 + 10 * hi + gi)
    lens, q_lens = [1, 70, 200, 45, 9], [1, 30, 40, 45, 0]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    k, v, table = _paged(lens, block_size, hkv, head_dim, torch.float32, "cpu", gen)
    k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)  # NaN poison stays NaN
    kd, vd = k8.to(dtype) * 0.25, v8.to(dtype) * 0.125  # exact: powers of two
    kv_start = torch.tensor([0, 3, 17, 5, 0], dtype=torch.int32)
    query = torch.randn(cu[-1], hq, head_dim, generator=gen).to(dtype)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    with arkernels.simt.emulate(gpu):
        out, lse = window_attention(query, k8, v8, table, torch.tensor(lens, dtype=torch.int32), window=window,
                                    softcap=softcap, kv_start=kv_start, k_scale=torch.tensor([0.25]),
                                    v_scale=torch.tensor([0.125]), return_lse=True,
                                    cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    assert [launch["smem"] for launch in arkernels.simt.launches()] == \
        [_prefill_smem(head_dim, *FP8_PREFILL_PLANS[gpu][head_dim], fp8=True)]
    _check(out, lse, query, kd, vd, table, lens, cu, window, head_dim ** -0.5, softcap, kv_start=kv_start)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_attention_prefill_fp8_bn32(device, monkeypatch, dtype):
    """head_dim 128 over fp8 caches with 32-key tiles (the plan everywhere since 32 rows per warp; here exactly at
    its per-block limit, set by the knob): GQA 8/1, block size 13, a window, softcap, chunked and whole prompts."""
    import arkernels.simt

    smem = _prefill_smem(128, 32, 3, fp8=True)
    monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(smem))
    gen = torch.Generator().manual_seed(350 + (dtype == torch.bfloat16))
    lens, q_lens = [150, 37], [100, 37]
    cu = [0, q_lens[0], q_lens[0] + q_lens[1]]
    k, v, table = _paged(lens, 13, 1, 128, torch.float32, "cpu", gen)
    k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)
    query = torch.randn(cu[-1], 8, 128, generator=gen).to(dtype)
    out, lse = window_attention(query, k8, v8, table, torch.tensor(lens, dtype=torch.int32), window=40, softcap=2.5,
                                k_scale=torch.tensor([0.25]), v_scale=torch.tensor([0.125]), return_lse=True,
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    assert [launch["smem"] for launch in arkernels.simt.launches()] == [smem]
    _check(out, lse, query, k8.to(dtype) * 0.25, v8.to(dtype) * 0.125, table, lens, cu, 40, 128 ** -0.5, 2.5)


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
def test_window_attention_prefill_fp8_refused_below_its_smem(device, monkeypatch):
    """Below the fp8 layout's smallest plan (head_dim 256: 32-key tiles, 2 stages, 100416 bytes) prefill over an fp8
    cache is refused with a message naming the op and the sizes; at exactly that limit it runs."""
    k8 = torch.zeros(2, 16, 1, 256, dtype=torch.float8_e4m3fn, device=device)
    args = (torch.zeros(2, 1, 256, dtype=torch.float16, device=device), k8, k8,
            torch.zeros(1, 1, dtype=torch.int32, device=device), torch.full((1,), 2, dtype=torch.int32, device=device))
    kwargs = dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32, device=device),
                  k_scale=torch.tensor([1.0], device=device), v_scale=torch.tensor([1.0], device=device))
    monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(100416 - 16))
    with pytest.raises(RuntimeError, match="window_attention: prefill with head_dim 256 needs at least 100416 bytes"):
        window_attention(*args, **kwargs)
    monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(100416))
    assert bool((window_attention(*args, **kwargs).cpu() == 0).all())  # zero keys and values: zero output


@pytest.mark.parametrize("device", CUDA_KERNEL_DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("prefill", [False, True])
def test_window_attention_invalid_blocks_masked(device, fp8, prefill):
    """check=False with block ids out of range (-1, num_blocks + 3) inside the visible range: the keys of such a block
    are masked and never read (the kernels' valid flags; fp8 prefill keeps them per ring stage), which for ids from
    table column 4 on is the same as a table of 4 columns (64 slots: keys past it are masked too)."""
    gen = torch.Generator().manual_seed(40 + 2 * fp8 + prefill)
    lens = [100, 90]
    k, v, table = _paged(lens, 16, 2, 64, torch.float32, "cpu", gen)
    num_blocks = k.shape[0]
    bad = table.clone()
    bad[0, 4:] = -1
    bad[1, 4:] = num_blocks + 3
    scales = {}
    if fp8:
        k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)
        kd, vd = k8.half() * 0.25, v8.half() * 0.125  # exact: powers of two
        scales = {"k_scale": torch.tensor([0.25], device=device), "v_scale": torch.tensor([0.125], device=device)}
        k_in, v_in = k8, v8
    else:
        kd, vd = k.half(), v.half()
        k_in, v_in = kd, vd
    cu = [0, 40, 70] if prefill else None
    query = torch.randn(cu[-1] if prefill else 2, 6, 64, generator=gen).half()
    out, lse = window_attention(query.to(device), k_in.to(device), v_in.to(device), bad.to(device),
                                torch.tensor(lens, dtype=torch.int32, device=device), return_lse=True, check=False,
                                cu_seqlens_q=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device),
                                **scales)
    _check(out, lse, query, kd, vd, table[:, :4].contiguous(), lens, cu, 0, 64 ** -0.5, 0.0)


def _prefill_visible_kv_bytes(k_cache, table, lens, q_lens, group, window, kv_start, rows_per_tile):
    """Per-byte count [storage bytes] of the K rows prefill must read: the CUDA kernel packs the `group` query heads
    of a KV head into one row space (row = token * group + head), cut into tiles of `rows_per_tile`; per tile and KV
    head it reads each key some row of the tile sees exactly once, and nothing else (tiles outside every row's
    window are skipped)."""
    want = torch.zeros(k_cache.untyped_storage().nbytes(), dtype=torch.int32)
    cap = table.shape[1] * k_cache.shape[1]
    for b, (n, q_len) in enumerate(zip(lens, q_lens)):
        pos0 = n - q_len
        for r0 in range(0, q_len * group, rows_per_tile):
            t_first, t_last = r0 // group, (min(r0 + rows_per_tile, q_len * group) - 1) // group
            lo = max(int(kv_start[b]), 0, pos0 + t_first - window + 1 if window else 0)
            _count_key_rows(want, k_cache, table, b, lo, min(pos0 + t_last, cap - 1))
    return want


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (32, 2)])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("fp8", [False, True])
def test_window_attention_prefill_traffic(device, heads, window, fp8):
    """Prefill reads each K/V byte once per KV head per query tile (the GQA group's query heads share it: packed
    rows), only keys some row of the tile sees (tiles wholly outside the causal window are never read), each query
    element exactly once, and writes each output element once (the emulator counts every global access per byte).
    head_dim 64: 128 packed rows per CTA. fp8 caches: the kernel reads the e4m3 rows as stored, each element exactly
    as often as the 16-bit kernel reads it on the same table (half the bytes), and makes no 16-bit copy of the cache
    (nothing outside the named arguments is read; only out and lse are written)."""
    import arkernels.simt

    hq, hkv = heads
    group = hq // hkv
    gen = torch.Generator().manual_seed(hq + window)
    lens, q_lens = [150, 37, 9], [100, 37, 4]  # chunked (on top of a cache), whole, chunked
    k, v, table = _paged(lens, 16, hkv, 64, torch.float16, device, gen)
    kv_start = torch.tensor([0, 5, 2], dtype=torch.int32)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    query = torch.randn(cu[-1], hq, 64, generator=gen).half()
    args = dict(window=window, kv_start=kv_start, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    cache, scales, reads16 = (k, v), {}, None
    if fp8:  # first the 16-bit kernel's reads on the same table
        window_attention(query, k, v, table, lens_t, **args)
        reads16 = {name: arkernels.simt.traffic_map(name)[0] for name in ("k_cache", "v_cache")}
        k8, v8 = (k.float() * 4).to(torch.float8_e4m3fn), (v.float() * 8).to(torch.float8_e4m3fn)
        k, v = k8.half() * 0.25, v8.half() * 0.125  # the reference's inputs: exact (powers of two)
        cache, scales = (k8, v8), {"k_scale": torch.tensor([0.25]), "v_scale": torch.tensor([0.125])}
    out, lse = window_attention(query, *cache, table, lens_t, return_lse=True, **args, **scales)
    maps, totals = {name: arkernels.simt.traffic_map(name) for name in ("k_cache", "v_cache")}, arkernels.simt.traffic()
    _check(out, lse, query, k, v, table, lens, cu, window, 64 ** -0.5, 0.0, kv_start=kv_start)
    want = _prefill_visible_kv_bytes(cache[0], table, lens, q_lens, group, window, kv_start, rows_per_tile=128)
    for name, (reads, writes) in maps.items():
        assert int(writes.sum()) == 0
        bad = (reads != want).nonzero()
        assert bad.numel() == 0, (f"{name}: {bad.numel()} bytes read a wrong number of times (first at byte "
                                  f"{int(bad[0])}: {int(reads[bad[0]])}x, want {int(want[bad[0]])}x)")
        if fp8:  # per element: byte e of the fp8 cache as often as bytes 2e, 2e + 1 of the 16-bit one
            assert torch.equal(reads, reads16[name][0::2]) and torch.equal(reads, reads16[name][1::2])
    assert totals["query"] == (query.numel() * 2, 0)  # each query element loaded by exactly one CTA
    assert totals["other"] == (0, out.numel() * 2 + lse.numel() * 4)  # no scratch: out and lse written once each
    assert totals["block_table"][1] == totals["seq_lens"][1] == 0
    if fp8:
        assert totals["k_scale"][0] > 0 and totals["v_scale"][0] > 0 and totals["k_scale"][1] == 0


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("gpu", ["sm_80", "sm_89", "sm_90"])
def test_window_attention_planning_per_gpu(device, gpu):
    """The launch planning of each GPU in the emulator's table runs and stays right: split counts follow the SM
    count (108 / 142 / 132); prefill head_dim 128 takes 32-key tiles (32 rows per warp), a 3-stage ring of 85 KB on
    sm_89 and sm_90 and a 2-stage one of 68 KB on sm_80 (2 CTAs per SM); head_dim 256 takes (64 keys, 2 stages,
    165 KB) on sm_90, (32, 3, 132 KB) on sm_80 and (32, 2, exactly 99 KB) on sm_89 (the emulator refuses a launch
    above the device's limit)."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(31)
    lens = [700, 90]
    k, v, table = _paged(lens, 16, 2, 128, torch.bfloat16, device, gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    with arkernels.simt.emulate(gpu):
        query = torch.randn(2, 8, 128, generator=gen).bfloat16()
        out, lse = window_attention(query, k, v, table, lens_t, return_lse=True)
        _check(out, lse, query, k, v, table, lens, None, 0, 128 ** -0.5, 0.0)
        cu = [0, 70, 90]
        query = torch.randn(cu[-1], 8, 128, generator=gen).bfloat16()
        out, lse = window_attention(query, k, v, table, lens_t, window=48, return_lse=True,
                                    cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
        _check(out, lse, query, k, v, table, lens, cu, 48, 128 ** -0.5, 0.0)
        lens256 = [90, 20]
        k, v, table = _paged(lens256, 16, 1, 256, torch.bfloat16, device, gen)
        cu = [0, 70, 90]
        query = torch.randn(cu[-1], 2, 256, generator=gen).bfloat16()
        out, lse = window_attention(query, k, v, table, torch.tensor(lens256, dtype=torch.int32), window=48,
                                    return_lse=True, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
        _check(out, lse, query, k, v, table, lens256, cu, 48, 256 ** -0.5, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_window_attention_no_visible_keys(device):
    """seq_len 0 (decode at position -1) and a query left of kv_start: zeros and lse -inf, never NaN."""
    gen = torch.Generator().manual_seed(2)
    k, v, table = _paged([4, 1], 4, 1, 64, torch.float16, device, gen)
    query = torch.randn(3, 2, 64, generator=gen).half().to(device)
    lens = torch.tensor([4, 0, 3], dtype=torch.int32, device=device)
    table = torch.cat([table, table[:1]])
    # check=False: kv_start past seq_len is refused by check=True (tests/test_window_attention_safety.py); what is
    # tested here is what the kernels compute when it reaches them anyway
    out, lse = window_attention(query, k, v, table, lens, kv_start=torch.tensor([9, 0, 0], dtype=torch.int32,
                                                                                 device=device), return_lse=True,
                                check=False)
    assert bool((out[:2] == 0).all()) and bool(torch.isneginf(lse[:2]).all())
    assert torch.isfinite(out[2]).all() and torch.isfinite(lse[2]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tq", [1, 5])
def test_window_attention_dense(device, dtype, tq):
    """window_attention_dense over transformers' [B, Hkv, S, D] layout: transposed query view, a K/V cache slice
    with spare capacity (strided), ragged seq_lens, left padding."""
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(tq)
    bsz, hq, hkv, d, s, cap = 3, 6, 2, 96, 23, 32
    store_k = torch.randn(bsz, hkv, cap, d, generator=gen).to(dtype).to(device)
    store_v = torch.randn(bsz, hkv, cap, d, generator=gen).to(dtype).to(device)
    key, value = store_k[:, :, :s], store_v[:, :, :s]  # a static cache's filled part: strided
    q_hf = torch.randn(bsz, hq, tq, d, generator=gen).to(dtype).to(device)
    query = q_hf.transpose(1, 2)  # [B, Tq, Hq, D], what an HF attention function transposes to
    seq_lens = torch.tensor([s, s - 4, tq], dtype=torch.int32)
    kv_start = torch.tensor([0, 6, 0], dtype=torch.int32)
    for window in (0, 5):
        out, lse = window_attention_dense(query, key, value, seq_lens=seq_lens.to(device),
                                          kv_start=kv_start.to(device), window=window, return_lse=True)
        ref, ref_lse = window_attention_dense_ref(query, key, value, seq_lens=seq_lens, kv_start=kv_start,
                                                  window=window)
        assert out.shape == (bsz, tq, hq, d) and lse.shape == (bsz, tq, hq) and out.dtype == dtype
        err = (out.cpu().double() - ref).abs().max().item()
        if dtype == torch.float32:
            tol = FP32_TOL
        else:  # PyTorch's own error, on the same data seen as a paged cache of one block per sequence
            lowp = _torch_lowp(query.reshape(bsz * tq, hq, d), key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3),
                               torch.arange(bsz, dtype=torch.int32)[:, None], seq_lens.tolist(),
                               list(range(0, (bsz + 1) * tq, tq)), window, d ** -0.5, 0.0, kv_start)
            tol = 2 * (lowp.view(bsz, tq, hq, d).double() - ref).abs().max().item() + 1e-5
        assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
        assert torch.allclose(lse.cpu().double(), ref_lse, atol=1e-4)


def test_window_attention_dense_does_not_copy_kv(monkeypatch):
    """The op receives the permuted K/V views themselves (same storage, no copy)."""
    import arkernels.ops.window_attention as mod

    seen = {}
    real = mod._ops.window_attention

    class Spy:
        def __call__(self, q, k, v, *rest):
            seen["k"], seen["v"] = k, v
            return real(q, k, v, *rest)

    monkeypatch.setattr(mod, "_ops", type("O", (), {"window_attention": Spy()})())
    key = torch.randn(2, 2, 9, 64)
    value = torch.randn(2, 2, 9, 64)
    window_attention_dense(torch.randn(2, 3, 4, 64), key, value)
    assert seen["k"].data_ptr() == key.data_ptr() and seen["v"].data_ptr() == value.data_ptr()
    assert seen["k"].shape == (2, 9, 2, 64)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("tq", [1, 6])
def test_window_attention_matches_transformers_sdpa(window, tq):
    """Masks built by transformers' own mask functions (causal / sliding window + left padding), attention by its
    sdpa_attention_forward: the op with kv_start agrees on every non-padding query (fp32, tight)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    gen = torch.Generator().manual_seed(window + tq)
    bsz, hq, hkv, d, s = 3, 6, 2, 64, 11
    pads = [0, 3, 7]
    attention_mask = torch.ones(bsz, s, dtype=torch.bool)
    for b, p in enumerate(pads):
        attention_mask[b, :p] = False  # transformers' batched generate pads on the left
    fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    mask = sdpa_mask(batch_size=bsz, q_length=tq, kv_length=s, q_offset=s - tq, mask_function=fn,
                     attention_mask=attention_mask, allow_is_causal_skip=False)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = hq // hkv, True
    q = torch.randn(bsz, hq, tq, d, generator=gen)
    key = torch.randn(bsz, hkv, s, d, generator=gen)
    value = torch.randn(bsz, hkv, s, d, generator=gen)
    want, _ = sdpa_attention_forward(module, q, key, value, mask, scaling=0.125)
    got = window_attention_dense(q.transpose(1, 2), key, value, kv_start=torch.tensor(pads, dtype=torch.int32),
                                 window=window, scale=0.125)
    assert got.shape == want.shape
    live = mask[:, 0].any(-1)  # [B, Tq]: queries with at least one visible key
    torch.testing.assert_close(got[live], want[live], atol=1e-5, rtol=1e-5)
    assert bool((got[~live] == 0).all())


# ---- bad inputs: each raises, naming the op and the argument ----
def _bad_cases():
    q = torch.randn(2, 4, 64)
    k = torch.randn(3, 4, 2, 64)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    base = dict(query=q, k_cache=k, v_cache=k.clone(), block_table=table, seq_lens=lens)
    cases = [
        ("whole multiple", dict(query=torch.randn(2, 3, 64)), RuntimeError),
        ("head_dim of query", dict(query=torch.randn(2, 4, 32)), RuntimeError),
        ("float32, float16, bfloat16 or float8_e4m3fn", dict(query=q.double(), k_cache=k.double(), v_cache=k.double()),
         RuntimeError),
        ("share one dtype", dict(query=q.half()), RuntimeError),
        ("window must be >= 0", dict(window=-1), RuntimeError),
        ("softcap must be >= 0", dict(softcap=-1.0), RuntimeError),
        ("k_cache and v_cache must have one shape", dict(v_cache=k[:2].clone()), RuntimeError),
        ("seq_lens must be Int", dict(seq_lens=lens.long()), RuntimeError),
        ("block_table must be Int", dict(block_table=table.long()), RuntimeError),
        ("seq_lens has 3 entries but block_table has 2 rows", dict(seq_lens=torch.tensor([1, 1, 1], dtype=torch.int32)),
         RuntimeError),
        ("query has 2 rows", dict(query=torch.randn(2, 4, 64), block_table=table[:1], seq_lens=lens[:1]),
         RuntimeError),
        ("kv_start must have batch", dict(kv_start=torch.zeros(3, dtype=torch.int32)), RuntimeError),
        ("cu_seqlens_q must have batch \\+ 1", dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)),
         RuntimeError),
        ("cu_seqlens_q gives sequence 1 3 queries",
         dict(query=torch.randn(5, 4, 64), cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError),
        ("cu_seqlens_q must run from 0", dict(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32)), ValueError),
        (r"block_table\[1, 0\] = 7", dict(block_table=torch.tensor([[0], [7]], dtype=torch.int32)), ValueError),
        (r"seq_lens\[0\] = 5 is outside", dict(seq_lens=torch.tensor([5, 2], dtype=torch.int32)), ValueError),
        ("max_q_len = 1 is smaller", dict(query=torch.randn(3, 4, 64), max_q_len=1,
                                          cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32)), ValueError),
        ("contiguous last", dict(query=torch.randn(2, 4, 128)[..., ::2]), RuntimeError),
        ("query must be 3-D", dict(query=torch.randn(2, 256)), RuntimeError),
        ("head_dim must be in", dict(query=torch.randn(2, 4, 520), k_cache=torch.randn(3, 4, 2, 520),
                                     v_cache=torch.randn(3, 4, 2, 520)), RuntimeError),
    ]
    return cases, base


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])))
def test_window_attention_bad_inputs(case):
    cases, base = _bad_cases()
    match, override, exc = cases[case]
    args = {**base, **override}
    with pytest.raises(exc, match=f"window_attention: .*{match}"):
        window_attention(**args)


def test_window_attention_unchecked_data_errors_raise_on_cpu():
    """check=False skips the Python validation; the CPU kernel still refuses bad indices (no host sync there)."""
    q = torch.randn(2, 4, 64)
    k = torch.randn(3, 4, 2, 64)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"window_attention: block_table\[1, 0\] = 7"):
        window_attention(q, k, k, torch.tensor([[0], [7]], dtype=torch.int32), lens, check=False)
    with pytest.raises(RuntimeError, match="window_attention: max_q_len = 1 is smaller"):
        window_attention(torch.randn(3, 4, 64), k, k, torch.tensor([[0], [1]], dtype=torch.int32), lens,
                         cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32), max_q_len=1, check=False)


def test_window_attention_opcheck():
    gen = torch.Generator().manual_seed(3)
    lens = [5, 9]
    k, v, table = _paged(lens, 4, 2, 16, torch.float32, "cpu", gen)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)  # opcheck compares outputs with NaN-unaware checks
    seq = torch.tensor(lens, dtype=torch.int32)
    op = torch.ops.arkernels.window_attention.default
    q = torch.randn(2, 4, 16, generator=gen)
    torch.library.opcheck(op, (q, k, v, table, seq, None, None, 1, 0, 0.25, 0.0))
    q = torch.randn(7, 4, 16, generator=gen)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    torch.library.opcheck(op, (q, k, v, table, seq, cu, torch.tensor([1, 0], dtype=torch.int32), 4, 3, 0.25, 2.0))


def test_window_attention_compile_fullgraph():
    def step(q, k, v, table, lens, cu, starts):
        return window_attention(q, k, v, table, lens, window=3, cu_seqlens_q=cu, max_q_len=4, kv_start=starts,
                                check=False)

    gen = torch.Generator().manual_seed(4)
    k, v, table = _paged([5, 9], 4, 2, 16, torch.float32, "cpu", gen)
    args = (torch.randn(7, 4, 16, generator=gen), k, v, table, torch.tensor([5, 9], dtype=torch.int32),
            torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), step(*args))
