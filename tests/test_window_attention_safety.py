"""window_attention whatever the input (issue 27): K and V of different layouts, kv_start outside [0, seq_len],
offsets past 2^31 elements, and every hostile input of the issue refused with check=True (the message checked) and
harmless with check=False (output defined, nothing read or written outside the tensors: these cases run in the
ASan + UBSan emulator build by scripts/simt_check.sh)."""
import pytest
import torch

from arkernels.ops.window_attention import window_attention
from conftest import DEVICES, runs_cuda_kernel
from test_paged_kv import far_apart_caches
from test_window_attention import NAN, _check, _paged

I32_MIN, I32_MAX = -2 ** 31, 2 ** 31 - 1
HQ, HKV, D = 4, 2, 64


def _layout(k, v, layout):
    """(k, v) as one of the layouts callers hand the kernels, same values; every byte outside them NaN.
    - "v_permuted": V a permuted view of [num_blocks, heads, block_size, d] (transformers' HND), K as given;
    - "interleaved": transformers' paged cache, one [num_blocks, 2, block_size, heads, d] tensor, K = [:, 0], V = [:, 1]
      (one stride set, two base pointers);
    - "k_interleaved": K from the interleaved tensor, V its own dense tensor (strides differ in dim 0)."""
    if layout == "v_permuted":
        vd = torch.full((v.shape[0], v.shape[2], v.shape[1], v.shape[3]), NAN, dtype=v.dtype, device=v.device)
        vd.copy_(v.permute(0, 2, 1, 3))
        out = k, vd.permute(0, 2, 1, 3)
    else:
        kv = torch.full((k.shape[0], 2, *k.shape[1:]), NAN, dtype=k.dtype, device=k.device)
        kv[:, 0], kv[:, 1] = k, v
        out = (kv[:, 0], kv[:, 1]) if layout == "interleaved" else (kv[:, 0], v)
    assert torch.equal(out[0].cpu().nan_to_num(), k.cpu().nan_to_num())
    assert torch.equal(out[1].cpu().nan_to_num(), v.cpu().nan_to_num())
    return out


def _cu(q_lens):
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["v_permuted", "interleaved", "k_interleaved"])
@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("block_size", [16, 13])
def test_window_attention_k_and_v_of_different_layouts(device, layout, prefill, block_size):
    """Each cache is read with its own strides (a kernel reading V at K's offsets is off by O(1))."""
    gen = torch.Generator().manual_seed(11 + block_size + 2 * prefill)
    lens = [40, 9, 70]
    k, v, table = _paged(lens, block_size, HKV, D, torch.bfloat16, device, gen)
    k2, v2 = _layout(k, v, layout)
    assert k2.stride() != v2.stride() or layout == "interleaved"
    q_lens = [5, 9, 1] if prefill else [1, 1, 1]
    cu = _cu(q_lens)
    query = torch.randn(cu[-1], HQ, D, generator=gen).bfloat16().to(device)
    out, lse = window_attention(query, k2, v2, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device) if prefill else None,
                                return_lse=True)
    _check(out, lse, query, k, v, table, lens, cu if prefill else None, 0, D ** -0.5, 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("block_size", [16, 13])
def test_window_attention_kv_start_negative_or_past_the_sequence(device, prefill, block_size):
    """Unchecked, a negative kv_start counts as 0 and one at or past seq_len masks every key (zeros, lse -inf). The
    entry before each row's first block-table column is a valid block id (the previous row's last column), so a
    kernel that lets keys j < 0 in reads real data there (or before the cache) and gets another answer."""
    gen = torch.Generator().manual_seed(20 + block_size + prefill)
    lens = [40, 9, 70, 33, 20]
    k, v, table = _paged(lens, block_size, HKV, D, torch.float16, device, gen, extra_blocks=0)
    table[:, -1] = table[:, 0]  # no -1 padding in the last column: it precedes the next row's first entry
    kv_start = torch.tensor([0, -3, I32_MIN, 33 + 5, I32_MAX], dtype=torch.int32)
    q_lens = [3, 4, 2, 5, 1] if prefill else [1] * 5
    cu = _cu(q_lens)
    query = torch.randn(cu[-1], HQ, D, generator=gen).half().to(device)
    kw = dict(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device) if prefill else None,
              kv_start=kv_start.to(device), return_lse=True)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    out, lse = window_attention(query, k, v, table, lens_t, check=False, **kw)
    empty = _check(out, lse, query, k, v, table, lens, cu if prefill else None, 0, D ** -0.5, 0.0, kv_start=kv_start)
    rows = slice(cu[3], cu[5])
    assert bool(empty[rows].all()) and not bool(empty[:cu[3]].any())
    with pytest.raises(ValueError, match=r"window_attention: kv_start\[1\] = -3 is outside \[0, seq_lens\[1\] = 9\]"):
        window_attention(query, k, v, table, lens_t, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefill", [False, True])
def test_window_attention_offsets_past_2_31_elements(device, prefill):
    """K/V block 1 starts 2^36 + 128 bytes into a sparse mapping (tests/test_paged_kv.py, far_apart_caches): every
    offset a kernel computes in 32 bits wraps into block 0 and reads the wrong keys."""
    bs = 16
    gen = torch.Generator().manual_seed(31 + prefill)
    k, v = far_apart_caches(bs, HKV, D, torch.float16, device)
    for c in (k, v):
        c.copy_(torch.randn(2, bs, HKV, D, generator=gen).half())
    table = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32, device=device)
    lens = [bs + 5, 2 * bs]
    q_lens = [4, 3] if prefill else [1, 1]
    cu = _cu(q_lens)
    query = torch.randn(cu[-1], HQ, D, generator=gen).half().to(device)
    out, lse = window_attention(query, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device),
                                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device) if prefill else None,
                                return_lse=True)
    dense_k, dense_v = (c.cpu().clone(memory_format=torch.contiguous_format) for c in (k, v))
    _check(out, lse, query, dense_k, dense_v, table, lens, cu if prefill else None, 0, D ** -0.5, 0.0)


# ---- the hostile inputs: (name, prefill, call overrides, message with check=True, kind unchecked)
# Unchecked kinds: "defined" (runs, output finite, rows with no visible key zeros / lse -inf), "refused" (the op's own
# always-on check, naming the argument), "cpu_refuses" (the CUDA kernels run it, the CPU kernel validates for free).
_HOSTILE = [
    ("seq_len_int32_min", True, dict(seq_lens=[I32_MIN, 9]), r"seq_lens\[0\] = -2147483648 is outside", "cpu_refuses"),
    ("cu_seqlens_q_ends_short", True, dict(cu=[0, 4, 4], rows=8), r"cu_seqlens_q must run from 0 to num_queries = 8",
     "cpu_refuses"),
    ("cu_seqlens_q_starts_late", True, dict(cu=[2, 5, 8], rows=8), r"cu_seqlens_q must run from 0", "cpu_refuses"),
    ("cu_seqlens_q_negative_first", True, dict(cu=[-5, 4, 8], rows=8), r"cu_seqlens_q must run from 0",
     "cpu_refuses"),
    # the same with a sequence of more than 8 query rows: the prefill kernel, not the multi-query decode path
    ("cu_seqlens_q_ends_short_long", True, dict(cu=[0, 12, 12], rows=20),
     r"cu_seqlens_q must run from 0 to num_queries = 20", "cpu_refuses"),
    ("cu_seqlens_q_starts_late_long", True, dict(cu=[3, 15, 20], rows=20), r"cu_seqlens_q must run from 0",
     "cpu_refuses"),
    ("kv_start_past_seq_len", False, dict(kv_start=[50, 0]), r"kv_start\[0\] = 50 is outside \[0, seq_lens\[0\] = 40\]",
     "defined"),
    ("kv_start_negative", True, dict(kv_start=[0, -1]), r"kv_start\[1\] = -1 is outside", "defined"),
    ("kv_start_int32_max", True, dict(kv_start=[I32_MAX, 0]), r"kv_start\[0\] = 2147483647 is outside", "defined"),
    ("max_q_len_2_40", True, dict(max_q_len=2 ** 40), r"max_q_len must be <= num_queries = 7, got 1099511627776",
     "refused"),
    ("max_q_len_2_62", True, dict(max_q_len=2 ** 62), r"max_q_len must be <= num_queries = 7", "refused"),
    ("k_scale_zero", False, dict(k_scale=0.0), r"k_scale must be positive and finite, got 0.0", "defined"),
    ("v_scale_zero", True, dict(v_scale=0.0), r"v_scale must be positive and finite, got 0.0", "defined"),
    ("k_scale_negative", True, dict(k_scale=-1.0), r"k_scale must be positive and finite, got -1.0", "defined"),
    ("v_scale_inf", False, dict(v_scale=float("inf")), r"v_scale must be positive and finite, got inf", "any"),
]


def _hostile_call(device, prefill, o):
    gen = torch.Generator().manual_seed(77)
    lens = [40, 9]
    fp8 = "k_scale" in o or "v_scale" in o
    k, v, table = _paged(lens, 16, HKV, D, torch.float16, device, gen)
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    cu = o.get("cu", [0, 5, 7] if prefill else None)
    rows = o.get("rows", cu[-1] if prefill else 2)
    query = torch.randn(rows, HQ, D, generator=gen).half().to(device)
    kw = dict(return_lse=True)
    if prefill:
        kw["cu_seqlens_q"] = torch.tensor(cu, dtype=torch.int32, device=device)
    if "max_q_len" in o:
        kw["max_q_len"] = o["max_q_len"]
    if "kv_start" in o:
        kw["kv_start"] = torch.tensor(o["kv_start"], dtype=torch.int32, device=device)
    if fp8:
        kw["k_scale"] = torch.tensor([o.get("k_scale", 0.5)], device=device)
        kw["v_scale"] = torch.tensor([o.get("v_scale", 0.5)], device=device)
    seq_lens = torch.tensor(o.get("seq_lens", lens), dtype=torch.int32, device=device)
    return (query, k, v, table, seq_lens), kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c[0] for c in _HOSTILE])
def test_window_attention_hostile_input(device, case):
    _, prefill, o, message, unchecked = next(c for c in _HOSTILE if c[0] == case)
    args, kw = _hostile_call(device, prefill, o)
    with pytest.raises((ValueError, RuntimeError), match="window_attention: .*" + message):
        window_attention(*args, **kw)
    if unchecked == "refused" or (unchecked == "cpu_refuses" and not runs_cuda_kernel(device)):
        with pytest.raises(RuntimeError, match="window_attention: "):
            window_attention(*args, **kw, check=False)
        return
    out, lse = window_attention(*args, **kw, check=False)
    out, lse = out.cpu(), lse.cpu()
    if unchecked == "any":  # a NaN or infinite scale gives NaN by arithmetic; only memory safety is asked
        return
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if case == "seq_len_int32_min":  # sequence 0's queries see no key
        assert bool((out[:5] == 0).all()) and bool(torch.isneginf(lse[:5]).all())
    if case.startswith("cu_seqlens_q"):  # rows no sequence owns: zeros, lse -inf
        n = o["rows"]
        cu = [min(max(x, 0), n) for x in o["cu"]]
        for lo, hi in ((0, cu[0]), (cu[-1], n)):
            assert bool((out[lo:hi] == 0).all()) and bool(torch.isneginf(lse[lo:hi]).all()), (lo, hi)
