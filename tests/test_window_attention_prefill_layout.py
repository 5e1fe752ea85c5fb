"""The prefill kernel's tile machinery (csrc/window_attention_prefill.cuh) in the SIMT emulator: the score variants
chosen once per key tile (softcap, masked or not), and fp8 caches converted to fp16 once per CTA into shared memory.

Tolerances as in tests/test_window_attention.py (``_check``: fp16/bf16 at most 2x PyTorch's own low-precision error
against the fp64 reference, + 1e-5). The fp8 path is held to more than a tolerance: e4m3 -> fp16 is exact and the
warps then run the 16-bit path on the converted tiles, with k_scale folded into the score scale and v_scale into
the output; with power-of-two scales both folds are exact too, so fp8 prefill with fp16 queries must equal, bit for
bit, 16-bit prefill over the dequantized cache with the same key-tile width (any lost, stale or misplaced
conversion, flag or barrier shows). bf16 queries run the same fp16 MMAs, their Q tile scaled into fp16 by a power of
two per warp whose inverse the score scale takes: exact too, so they must give the lse of fp16 queries of the same
values bit for bit, and outputs that round the same fp32 values (bf16 instead of fp16).
"""
import pytest
import torch

from arkernels.ops.window_attention import window_attention
from conftest import SIMT_DEVICES
from test_window_attention import _check, _paged, _pick, _poison_allocator, _prefill_smem, _prefill_visible_kv_bytes

K_SCALE, V_SCALE = 0.25, 0.125  # powers of two: the dequantized 16-bit cache and both scale folds are exact


def _cu(q_lens):
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return cu


def _fp8(k, v, dtype):
    """e4m3 caches of 4k and 8v (NaN poison stays NaN) and their exact dequantized copies in `dtype`."""
    k8, v8 = (k.float() * 4).to(torch.float8_e4m3fn), (v.float() * 8).to(torch.float8_e4m3fn)
    return k8, v8, k8.to(dtype) * K_SCALE, v8.to(dtype) * V_SCALE


def _prefill_inputs(lens, cu, hq, hkv, head_dim, dtype, fp8, gen, q_scale=1.0):
    """A paged cache of ``lens`` tokens (16-token blocks) and ``cu[-1]`` queries of ``dtype`` (times ``q_scale``):
    (query, k, v, k as the reference reads it, v likewise, block table, the op's fp8 scale arguments)."""
    k, v, table = _paged(lens, 16, hkv, head_dim, torch.float32, "cpu", gen)
    query = (torch.randn(cu[-1], hq, head_dim, generator=gen) * q_scale).to(dtype)
    if fp8:
        k, v, kd, vd = _fp8(k, v, dtype)
        return query, k, v, kd, vd, table, dict(k_scale=torch.tensor([K_SCALE]), v_scale=torch.tensor([V_SCALE]))
    k, v = k.to(dtype), v.to(dtype)
    return query, k, v, k, v, table, {}


# (head_dim, emulated GPU, bn, fp8 stages, 16-bit stages, per-block limits of the fp8 and the 16-bit call or None):
# every shared-memory layout of the fp8 path -- the 16-bit copy after the Q tile (D = 80: 10 row chunks, not a power
# of two), 32- and 64-key tiles, 2- and 3-stage rings, 32-row warps (D <= 128) and 16-row warps (D = 256) -- with the
# 16-bit kernel on the same tile width (the yardstick of the bitwise check). D = 96 with 2-stage rings: no GPU of the
# table plans them, so the knob lowers the limit per call (fp8 32/2 52288 bytes, 16-bit 32/2 53248).
FP8_LAYOUTS = [(64, "sm_90", 64, 3, 3, None), (80, "sm_89", 64, 3, 3, None), (128, "sm_90", 32, 3, 3, None),
               (96, "sm_90", 32, 2, 2, (52288, 53248)), (256, "sm_90", 64, 3, 2, None),
               (256, "sm_89", 32, 2, 2, None), (256, "sm_80", 32, 3, 3, None)]


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("layout", FP8_LAYOUTS, ids=lambda x: f"{x[0]}-{x[1]}-bn{x[2]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_attention_prefill_fp8_equals_16bit_bitwise(device, monkeypatch, layout, dtype):
    """fp8 prefill == 16-bit prefill over the exactly dequantized cache, out and lse bit for bit (the same key-tile
    width: the launches' shared memory says so), and the fp8 run against the fp64 reference: several query tiles per
    sequence, more key tiles than ring stages (every stage refilled), GQA, block size 13, softcap (scores well past
    it) or none, a window or none, rows that see no key, a sequence with no new query, and block ids out of range
    from table column 18 on (check=False: their keys are masked by the valid flags the conversion carries into the
    16-bit tile, which is the same as a table of 18 columns)."""
    import arkernels.simt

    head_dim, gpu, bn, st8, st16, limits = layout
    li, di = FP8_LAYOUTS.index(layout), int(dtype == torch.bfloat16)
    hq, hkv = _pick([(8, 2), (6, 1), (4, 4)], li, di)
    softcap, window = _pick([0.0, 2.5], li, di), _pick([0, 50], li)
    gen = torch.Generator().manual_seed(500 + 10 * li + di)
    lens, q_lens = [300, 45, 9], [100, 45, 0]  # chunked over a cache, a whole prompt, no new query
    cu = _cu(q_lens)
    k, v, table = _paged(lens, 13, hkv, head_dim, torch.float32, "cpu", gen)
    bad = table.clone()
    bad[0, 18::2] = -1  # keys 234.. of sequence 0: masked (zeros land, nothing is read)
    bad[0, 19::2] = k.shape[0] + 3
    k8, v8, kd, vd = _fp8(k, v, dtype)
    query = (torch.randn(cu[-1], hq, head_dim, generator=gen) * 2).to(dtype)
    bf16 = dtype == torch.bfloat16
    if bf16:  # values below fp16's normal range zeroed: query.half() is then exact, the yardstick's queries
        query = torch.where(query.abs() < 2 ** -14, torch.zeros_like(query), query)
    args = dict(window=window, softcap=softcap, return_lse=True, check=False,
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scales = dict(k_scale=torch.tensor([K_SCALE]), v_scale=torch.tensor([V_SCALE]))
    with arkernels.simt.emulate(gpu):
        _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
        if limits:
            monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(limits[0]))
        out8, lse8 = window_attention(query, k8, v8, bad, lens_t, **scales, **args)
        smem8 = [launch["smem"] for launch in arkernels.simt.launches()]
        if bf16:  # the yardstick: the fp8 kernel on fp16 queries of the same values
            out16, lse16 = window_attention(query.half(), k8, v8, bad, lens_t, **scales, **args)
        else:  # the 16-bit kernel over the dequantized cache
            if limits:
                monkeypatch.setenv("ARKERNELS_MAX_SMEM_PER_BLOCK", str(limits[1]))
            out16, lse16 = window_attention(query, kd, vd, bad, lens_t, **args)
        smem16 = [launch["smem"] for launch in arkernels.simt.launches()]
    assert smem8 == [_prefill_smem(head_dim, bn, st8, fp8=True)]
    assert smem16 == ([_prefill_smem(head_dim, bn, st8, fp8=True)] if bf16 else [_prefill_smem(head_dim, bn, st16)])
    assert torch.equal(lse8, lse16)
    if bf16:
        _assert_same_fp32(out8, out16)
    else:
        assert torch.equal(out8, out16), f"{int((out8 != out16).sum())} output elements differ"
    _check(out8, lse8, query, kd, vd, table[:, :18].contiguous(), lens, cu, window, head_dim ** -0.5, softcap)


def _assert_same_fp32(out_bf16, out_fp16):
    """Both outputs round one fp32 value x per element (bf16: 8 significant bits, fp16: 11 down to 2^-14): each lies
    within half its own ulp of x, so they differ by at most the two half ulps of x's binade (taken from the fp16 one)."""
    hi, lo = out_bf16.double(), out_fp16.double()
    e = torch.frexp(lo).exponent.double()  # lo = m 2^e, m in [0.5, 1); 0: x is below fp16's half subnormal
    e = torch.where(lo == 0, torch.full_like(e, -24.0), e)
    tol = 2.0 ** (e - 9) + 2.0 ** (torch.clamp(e, min=-13) - 12)
    bad = ((hi - lo).abs() > tol).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} outputs are not the fp16 run's values in bf16 (first at "
                              f"{bad[0].tolist()}: {hi[tuple(bad[0])]} vs {lo[tuple(bad[0])]})")


# bf16 queries over fp8 caches, past fp16's range both ways (x 2^20: |q| up to ~2^22 where fp16 stops at 65504;
# x 2^-30: below fp16's subnormals), the score scale divided by the same factor so the softmax is the one of unit
# queries: each warp's power of two brings its rows into fp16 and the score scale takes it back, exactly.
@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("log2_mag", [20, -30])
def test_window_attention_prefill_fp8_bf16_queries_out_of_fp16_range(device, head_dim, log2_mag):
    """Against the fp64 reference (a query tile whose fp16 image overflowed to inf or flushed to zero gives NaN or
    a uniform softmax, far past the tolerance); softcap on one magnitude, a window on the other."""
    softcap, window = (2.0, 0) if log2_mag > 0 else (0.0, 20)
    gen = torch.Generator().manual_seed(900 + head_dim + log2_mag)
    lens, q_lens = [150, 40], [90, 40]
    cu = _cu(q_lens)
    query, k, v, kd, vd, table, scales = _prefill_inputs(lens, cu, 8, 2, head_dim, torch.bfloat16, True, gen,
                                                         q_scale=2.0 ** log2_mag)
    scale = head_dim ** -0.5 * 2.0 ** -log2_mag
    _poison_allocator((query.shape, torch.bfloat16), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), scale=scale,
                                softcap=softcap, window=window, return_lse=True,
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), **scales)
    _check(out, lse, query, kd, vd, table, lens, cu, window, scale, softcap)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_window_attention_prefill_softcap_variants(device, fp8, head_dim, softcap):
    """Both variants of the per-tile softcap branch against the fp64 reference, 16-bit and fp8 caches, fp16 and bf16
    queries: scores several times the cap (queries scaled by 4: score std ~4, cap 2), so a variant applying the cap
    where it should not, or not applying it (or applying it with the wrong scale), is off by far more than the
    tolerance."""
    hi = [64, 80, 128, 256].index(head_dim)
    dtype = _pick([torch.float16, torch.bfloat16], hi, int(fp8), int(softcap > 0))
    hq, hkv = _pick([(4, 2), (3, 3), (8, 1)], hi, int(fp8))
    gen = torch.Generator().manual_seed(600 + 10 * hi + 2 * int(fp8) + int(softcap > 0))
    lens, q_lens = [150, 33], [80, 33]
    cu = _cu(q_lens)
    query, k, v, kd, vd, table, scales = _prefill_inputs(lens, cu, hq, hkv, head_dim, dtype, fp8, gen, q_scale=4)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), softcap=softcap,
                                return_lse=True, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), **scales)
    _check(out, lse, query, kd, vd, table, lens, cu, 0, head_dim ** -0.5, softcap)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("gpu", ["sm_89", "sm_90"])
def test_window_attention_prefill_fp8_traffic_head_dim_256(device, gpu):
    """fp8 caches at head_dim 256 (64-row query tiles; the 16-bit copy after the Q tile; sm_89: 32-key tiles, 2
    stages; sm_90: 64-key tiles, 3 stages): the conversion pass reads only shared memory, so each visible K/V byte is
    still read from global memory exactly once per KV head per query tile, nothing else is read, and only out and lse
    are written."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(700 + (gpu == "sm_90"))
    lens, q_lens = [200, 20], [70, 20]
    cu = _cu(q_lens)
    k, v, table = _paged(lens, 16, 2, 256, torch.float32, "cpu", gen)
    k8, v8, kd, vd = _fp8(k, v, torch.float16)
    query = torch.randn(cu[-1], 4, 256, generator=gen).half()
    kv_start = torch.tensor([3, 0], dtype=torch.int32)
    with arkernels.simt.emulate(gpu):
        out, lse = window_attention(query, k8, v8, table, torch.tensor(lens, dtype=torch.int32), window=100,
                                    kv_start=kv_start, k_scale=torch.tensor([K_SCALE]),
                                    v_scale=torch.tensor([V_SCALE]), return_lse=True,
                                    cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
        maps = {name: arkernels.simt.traffic_map(name) for name in ("k_cache", "v_cache")}
        totals = arkernels.simt.traffic()
    _check(out, lse, query, kd, vd, table, lens, cu, 100, 256 ** -0.5, 0.0, kv_start=kv_start)
    want = _prefill_visible_kv_bytes(k8, table, lens, q_lens, 2, 100, kv_start, rows_per_tile=64)
    for name, (reads, writes) in maps.items():
        assert int(writes.sum()) == 0
        bad = (reads != want).nonzero()
        assert bad.numel() == 0, (f"{name}: {bad.numel()} bytes read a wrong number of times (first at byte "
                                  f"{int(bad[0])}: {int(reads[bad[0]])}x, want {int(want[bad[0]])}x)")
    assert int(want.sum()) > 0
    assert totals["query"] == (query.numel() * 2, 0)
    assert totals["other"] == (0, out.numel() * 2 + lse.numel() * 4)


# 32 packed rows per warp at head_dim <= 128 (csrc/window_attention_prefill.cuh, prefill_warp_rows): two m16 halves
# that share each K / V fragment but own their rows' Q fragments, masks, max and sum. (head_dim, Hq, Hkv, q_lens,
# window): a query tile's live rows (q_len * group of them, a prefix of the tile's 128) end inside a warp's first
# half, inside its second half, or on a half's edge; groups of 3, 5, 6 and 7 put several tokens in each half and
# split a token's heads across the two halves and across warps. Chunked over a cache (each row at its own position)
# with a short window, so neighbouring rows see different keys on the straddling tiles.
WARP_HALF_CASES = [
    (64, 6, 2, [11, 6, 43], 9),       # group 3: 33 rows (1 in warp 1), 18 (2 in warp 0's 2nd half), 129 (2 tiles)
    (128, 10, 2, [7, 13, 3], 0),      # group 5: 35, 65, 15 rows (the last ends in warp 0's first half)
    (80, 7, 1, [5, 19], 5),           # group 7: 35, 133
    (128, 12, 2, [4, 21, 9], 40),     # group 6: 24 (8 rows in warp 0's 2nd half), 126, 54
    (96, 4, 4, [16, 17, 31, 48], 3),  # group 1: exactly one half, a half + 1 row, a warp - 1 row, a warp and a half
]


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case", WARP_HALF_CASES, ids=lambda c: f"{c[0]}-g{c[1] // c[2]}")
def test_window_attention_prefill_warp_halves(device, fp8, case):
    """Each m16 half of a 32-row warp against the fp64 reference: outputs and lse of every packed row, fp16 / bf16,
    16-bit and fp8 caches, softcap on half the cases (a half reading the other's Q rows, taking its masks, max or sum,
    or writing to its rows is off by far more than the tolerance)."""
    head_dim, hq, hkv, q_lens, window = case
    ci = WARP_HALF_CASES.index(case)
    dtype = _pick([torch.float16, torch.bfloat16], ci, int(fp8))
    softcap = _pick([0.0, 3.0], ci)
    gen = torch.Generator().manual_seed(800 + 10 * ci + int(fp8))
    lens = [q + 23 * (i + 1) for i, q in enumerate(q_lens)]  # a cache before every prompt
    cu = _cu(q_lens)
    query, k, v, kd, vd, table, scales = _prefill_inputs(lens, cu, hq, hkv, head_dim, dtype, fp8, gen)
    _poison_allocator((query.shape, dtype), (query.shape[:2], torch.float32), device=device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32), window=window,
                                softcap=softcap, return_lse=True, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                                **scales)
    _check(out, lse, query, kd, vd, table, lens, cu, window, head_dim ** -0.5, softcap)
