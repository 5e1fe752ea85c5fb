"""Windowed attention over the paged cache: decode GB/s and prefill TFLOP/s against torch SDPA.

Decode bytes are the K/V a kernel must read: min(L, W) keys per sequence (2 x batch x min(L, W) x Hkv x D x
element size); every method is credited with the same bytes, so the ratio is a time ratio. Prefill FLOPs are counted
as FlashAttention's benchmarks count causal attention (4 x B x Hq x D x S^2 / 2), and with a window 4 x Hq x D per
visible (query, key) pair; the same for every method. Prefill baselines: SDPA causal pinned to its flash and to its
memory-efficient backend, SDPA with an explicit window mask, FlexAttention with a causal sliding-window block mask.
Baselines, measured in the same run: SDPA on K/V already gathered into transformers' dense layout (full causal; the
gather itself is NOT timed, which favours the baseline), SDPA with an explicit window mask, and FlexAttention with a
sliding-window block mask where the installed torch has it (GPU only). Our output is checked against the fp64
reference (small case) and against the masked SDPA output (every case) before timing.
Decode is timed over rotating copies of the cache (enough for 4x the 50 MB L2 of an H100/H200, column `rotations`), so
a batch-1 8k-token cache (33.5 MB) is read from HBM, not L2; the fp8 column times the same problem with
float8_e4m3fn caches (tokens/s ratio against the 16-bit cache).
Sinks and chunks (issue 21): decode with gpt-oss attention sinks against the same call without them (the sink's cost)
and against transformers' gpt_oss eager attention on the dense copy (matmul, a sink column, softmax, matmul); decode
with Llama 4 chunked attention (the query at ctx - 1 reads only its chunk's (ctx - 1) % C + 1 keys) against SDPA on the
chunk's keys sliced out and SDPA with the chunked mask; prefill with chunks against SDPA with the chunked mask.
Speculative verification (issue 33): the k + 1 query rows of every sequence at its last positions in one call with
cu_seqlens_q and max_q_len = k + 1 <= 8 (the multi-query decode kernel: packed (query row, head) MMA rows, split-KV),
against the same call forced onto the prefill kernel (max_q_len 9: still a valid upper bound), SDPA over the dense
copy with the bottom-right causal (windowed) mask, and one decode step (one query per sequence) over the same cache:
bytes are the union of the rows' keys, min(ctx, W + q_len - 1) per sequence, read once per KV head.
GPU goals (issue 11, H200): decode >= 85% of copy bandwidth at batch 32 x 8k, >= 60% at batch 1 x 8k (bf16), >= 1.8x
that throughput with the fp8 cache, >= SDPA-flash and flex_attention; prefill (issue 12) >= SDPA flash for full causal
and >= 2x SDPA with a window mask.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, simt_traffic, timeit, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.reference.window_attention import window_attention_ref  # noqa: E402

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _timing(device) -> dict:
    """Fewer repetitions on the CPU (the --quick CI mode), the default on a GPU."""
    return dict(device=device, warmup=1, iters=5) if torch.device(device).type == "cpu" else dict(device=device)


def copy_bandwidth(device) -> float:
    n = (1 << 28) if torch.device(device).type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timeit(lambda: dst.copy_(src), device=device) / 1e9


def paged_problem(batch, ctx, dtype, device, gen):
    """K/V of `batch` sequences of `ctx` tokens in a shuffled paged pool, plus the same data gathered densely."""
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * per_seq
    k = torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, generator=gen).to(dtype).to(device)
    v = torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, generator=gen).to(dtype).to(device)
    table = torch.randperm(num_blocks, generator=gen).int().view(batch, per_seq).to(device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    k_dense, v_dense = arkernels.paged_kv_gather(k, v, table, lens, ctx, check=False)  # [B, Hkv, ctx, D]
    return k, v, table, lens, k_dense, v_dense


def window_mask(q_pos, ctx, window, device):
    j = torch.arange(ctx, device=device)[None, :]
    i = q_pos[:, None]
    m = j <= i
    if window > 0:
        m &= j > i - window
    return m


def flex_fn(window, q_len, ctx, device):
    """A compiled FlexAttention call with a causal sliding-window block mask (bottom-right aligned), or None."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    off = ctx - q_len

    def mask_mod(b, h, q, kv):
        keep = kv <= q + off
        if window > 0:
            keep = keep & (kv > q + off - window)
        return keep

    block_mask = create_block_mask(mask_mod, None, None, q_len, ctx, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)


def chunked_mask(q_pos, ctx, chunk, device):
    """bool [len(q_pos), ctx]: causal and in the query's chunk of `chunk` positions (no left padding)."""
    j = torch.arange(ctx, device=device)[None, :]
    i = q_pos[:, None]
    return (j <= i) & (j // chunk == i // chunk)


def gpt_oss_eager(q4, kd, vd, sinks, mask):
    """transformers' gpt_oss eager attention on dense K/V: [B, Hq, Tq, D] -> [B, Hq, Tq, D] (repeat_kv, a sink column,
    softmax in the inputs' dtype, drop the sink)."""
    k = kd.repeat_interleave(HQ // HKV, dim=1)
    v = vd.repeat_interleave(HQ // HKV, dim=1)
    s = (q4 @ k.transpose(2, 3)) * HEAD_DIM ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    col = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return p @ v


def check_reference(dtype, device):
    """Decode and prefill against the fp64 reference on a small paged problem, before any timing."""
    gen = torch.Generator().manual_seed(0)
    k, v, table, lens, _, _ = paged_problem(2, 77, dtype, device, gen)
    q = torch.randn(2, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for window in (0, 32):
        got = arkernels.window_attention(q, k, v, table, lens, window=window)
        want, _ = window_attention_ref(q, k, v, table, lens, window=window)
        err = (got.cpu().double() - want).abs().max().item()
        assert err < tol, f"decode window={window}: error {err:.3g} vs the fp64 reference"
        qp = torch.randn(2 * 20, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
        cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
        got = arkernels.window_attention(qp, k, v, table, lens, window=window, cu_seqlens_q=cu)
        want, _ = window_attention_ref(qp, k, v, table, lens, window=window, cu_seqlens_q=cu)
        err = (got.cpu().double() - want).abs().max().item()
        assert err < tol, f"prefill window={window}: error {err:.3g} vs the fp64 reference"
    sinks = torch.randn(HQ, generator=gen).to(device)
    for kw in (dict(sinks=sinks), dict(chunk_size=32), dict(sinks=sinks, chunk_size=32, window=20)):
        got = arkernels.window_attention(q, k, v, table, lens, **kw)
        want, _ = window_attention_ref(q, k, v, table, lens, **kw)
        err = (got.cpu().double() - want).abs().max().item()
        assert err < tol, f"decode {sorted(kw)}: error {err:.3g} vs the fp64 reference"


L2_BYTES = 50 * 2**20  # H100/H200 L2 (50 MB): a batch-1 8k-token K/V (33.5 MB) would stay in it between calls


def rotations(nbytes, device) -> int:
    """Copies of a decode problem to cycle through so that no call finds its K/V in L2 from the previous one: enough
    for 4x the L2 (at most 16); 1 on the CPU or when one copy already dwarfs the L2."""
    if torch.device(device).type != "cuda" or nbytes >= 4 * L2_BYTES:
        return 1
    return min(16, -(-4 * L2_BYTES // nbytes))


def cycle(fns):
    """One callable that calls fns[0], fns[1], ... in turn (rotating buffers, one per call)."""
    state = {"i": -1}

    def call():
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()
    return call


def bench_decode(batch, ctx, window, dtype, device, gen):
    """Decode over `rot` rotating copies of the cache (see rotations): ours (16-bit and fp8 caches), SDPA on the
    dense copy (default dispatch, pinned to flash, and the math backend; with a window, SDPA gets the window's keys
    sliced out, which is what a user would do), SDPA with an explicit window mask and FlexAttention with a causal
    sliding-window block mask over the dense copy."""
    keys = min(ctx, window) if window > 0 else ctx
    elt = torch.tensor([], dtype=dtype).element_size()
    nbytes = 2 * batch * keys * HKV * HEAD_DIM * elt
    rot = rotations(2 * batch * ctx * HKV * HEAD_DIM * elt, device)
    probs = [paged_problem(batch, ctx, dtype, device, gen) for _ in range(rot)]
    q = torch.randn(batch, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
    q4 = q[:, :, None]  # [B, Hq, 1, D]
    mask = window_mask(torch.tensor([ctx - 1], device=device), ctx, window, device)[None, None]  # [1,1,1,ctx]
    lo = ctx - keys  # SDPA on the window's keys only

    def ours_fn(k, v, table, lens, **kw):
        return lambda: arkernels.window_attention(q, k, v, table, lens, window=window, max_q_len=1, check=False, **kw)

    ours = cycle([ours_fn(k, v, t, n) for k, v, t, n, _, _ in probs])
    sdpa_full = cycle([lambda kd=kd, vd=vd: F.scaled_dot_product_attention(q4, kd[:, :, lo:], vd[:, :, lo:],
                                                                           enable_gqa=True) for *_, kd, vd in probs])
    sdpa_mask = cycle([lambda kd=kd, vd=vd: F.scaled_dot_product_attention(q4, kd, vd, attn_mask=mask, enable_gqa=True)
                       for *_, kd, vd in probs])
    err = (ours().float() - sdpa_mask()[:, :, 0].float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"decode disagrees with SDPA: {err:.3g}"
    row = dict(kind="decode", batch=batch, ctx=ctx, window=window, tokens=batch * ctx, rotations=rot)
    row["ours_us"] = timeit(ours, **_timing(device)) * 1e6
    row["sdpa_full_us"] = timeit(sdpa_full, **_timing(device)) * 1e6
    row["sdpa_mask_us"] = timeit(sdpa_mask, **_timing(device)) * 1e6
    if torch.device(device).type == "cuda":
        for name, key in (("FLASH_ATTENTION", "sdpa_flash_us"), ("MATH", "sdpa_math_us")):
            fn = pinned_sdpa(name, sdpa_full)
            if fn is not None:
                row[key] = timeit(fn, device=device) * 1e6
        flex = flex_fn(window, 1, ctx, device)
        if flex is not None:
            try:
                fl = cycle([lambda kd=kd, vd=vd: flex(q4, kd, vd) for *_, kd, vd in probs])
                row["flex_us"] = timeit(fl, device=device) * 1e6
            except Exception as e:  # noqa: BLE001 (flex support varies across torch builds)
                print(f"flex attention unavailable: {type(e).__name__}", file=sys.stderr)
        if dtype != torch.float32:  # fp8 cache (scales 1: the bytes are what is timed)
            one = torch.ones(1, device=device)
            fp8 = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), t, n) for k, v, t, n, _, _ in probs]
            ours8 = cycle([ours_fn(k, v, t, n, k_scale=one, v_scale=one) for k, v, t, n in fp8])
            row["ours_fp8_us"] = timeit(ours8, device=device) * 1e6
            row["fp8_x_tokens"] = row["ours_us"] / row["ours_fp8_us"]
    row["ours_GBps"] = nbytes / row["ours_us"] / 1e3
    for key in ("sdpa_full", "sdpa_mask", "sdpa_flash", "sdpa_math", "flex"):
        if f"{key}_us" in row:
            row[f"x_vs_{key}"] = row[f"{key}_us"] / row["ours_us"]
    return row


def bench_sinks_decode(batch, ctx, dtype, device, gen):
    """Decode with per-head sinks (gpt-oss): ours with and without sinks (the same bytes), and transformers' gpt_oss
    eager attention on the dense copy."""
    elt = torch.tensor([], dtype=dtype).element_size()
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * elt
    rot = rotations(nbytes, device)
    probs = [paged_problem(batch, ctx, dtype, device, gen) for _ in range(rot)]
    q = torch.randn(batch, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
    sinks = torch.randn(HQ, generator=gen).to(device)
    mask = torch.ones(1, 1, 1, ctx, dtype=torch.bool, device=device)
    ours = cycle([lambda k=k, v=v, t=t, n=n: arkernels.window_attention(q, k, v, t, n, sinks=sinks, max_q_len=1,
                                                                         check=False) for k, v, t, n, _, _ in probs])
    plain = cycle([lambda k=k, v=v, t=t, n=n: arkernels.window_attention(q, k, v, t, n, max_q_len=1, check=False)
                   for k, v, t, n, _, _ in probs])
    eager = cycle([lambda kd=kd, vd=vd: gpt_oss_eager(q[:, :, None], kd, vd, sinks, mask) for *_, kd, vd in probs])
    err = (ours().float() - eager()[:, :, 0].float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"sinks decode disagrees with gpt_oss eager: {err:.3g}"
    row = dict(kind="sinks", batch=batch, ctx=ctx, chunk=0, tokens=batch * ctx, rotations=rot)
    row["ours_us"] = timeit(ours, **_timing(device)) * 1e6
    row["no_sinks_us"] = timeit(plain, **_timing(device)) * 1e6
    row["eager_us"] = timeit(eager, **_timing(device)) * 1e6
    row["ours_GBps"] = nbytes / row["ours_us"] / 1e3
    row["x_vs_no_sinks"] = row["no_sinks_us"] / row["ours_us"]
    row["x_vs_eager"] = row["eager_us"] / row["ours_us"]
    return row


def bench_chunked_decode(batch, ctx, chunk, dtype, device, gen):
    """Decode with Llama 4 chunked attention at position ctx - 1: ours reads the chunk's keys only; SDPA on those keys
    sliced from the dense copy (what a user would write) and SDPA with the chunked mask over all ctx keys."""
    keys = (ctx - 1) % chunk + 1
    elt = torch.tensor([], dtype=dtype).element_size()
    nbytes = 2 * batch * keys * HKV * HEAD_DIM * elt
    rot = rotations(2 * batch * ctx * HKV * HEAD_DIM * elt, device)
    probs = [paged_problem(batch, ctx, dtype, device, gen) for _ in range(rot)]
    q = torch.randn(batch, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
    q4 = q[:, :, None]
    mask = chunked_mask(torch.tensor([ctx - 1], device=device), ctx, chunk, device)[None, None]
    lo = ctx - keys
    ours = cycle([lambda k=k, v=v, t=t, n=n: arkernels.window_attention(q, k, v, t, n, chunk_size=chunk, max_q_len=1,
                                                                         check=False) for k, v, t, n, _, _ in probs])
    sdpa_sliced = cycle([lambda kd=kd, vd=vd: F.scaled_dot_product_attention(q4, kd[:, :, lo:], vd[:, :, lo:],
                                                                             enable_gqa=True) for *_, kd, vd in probs])
    sdpa_mask = cycle([lambda kd=kd, vd=vd: F.scaled_dot_product_attention(q4, kd, vd, attn_mask=mask, enable_gqa=True)
                       for *_, kd, vd in probs])
    err = (ours().float() - sdpa_mask()[:, :, 0].float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"chunked decode disagrees with SDPA: {err:.3g}"
    row = dict(kind="chunked", batch=batch, ctx=ctx, chunk=chunk, tokens=batch * ctx, rotations=rot)
    row["ours_us"] = timeit(ours, **_timing(device)) * 1e6
    row["sdpa_sliced_us"] = timeit(sdpa_sliced, **_timing(device)) * 1e6
    row["sdpa_mask_us"] = timeit(sdpa_mask, **_timing(device)) * 1e6
    row["ours_GBps"] = nbytes / row["ours_us"] / 1e3
    row["x_vs_sdpa_sliced"] = row["sdpa_sliced_us"] / row["ours_us"]
    row["x_vs_sdpa_mask"] = row["sdpa_mask_us"] / row["ours_us"]
    return row


def bench_chunked_prefill(batch, seq, chunk, dtype, device, gen):
    """Prefill with chunks of `chunk` positions: ours (key tiles before each query tile's chunk never visited) against
    SDPA with the chunked mask; FLOPs counted per visible (query, key) pair, as for windows."""
    k, v, table, lens, kd, vd = paged_problem(batch, seq, dtype, device, gen)
    q = torch.randn(batch * seq, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
    q4 = q.view(batch, seq, HQ, HEAD_DIM).transpose(1, 2)
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
    mask = chunked_mask(torch.arange(seq, device=device), seq, chunk, device)[None, None]
    ours = lambda: arkernels.window_attention(q, k, v, table, lens, chunk_size=chunk, cu_seqlens_q=cu,  # noqa: E731
                                              max_q_len=seq, check=False)
    sdpa_mask = lambda: F.scaled_dot_product_attention(q4, kd, vd, attn_mask=mask, enable_gqa=True)  # noqa: E731
    want = sdpa_mask().transpose(1, 2).reshape(batch * seq, HQ, HEAD_DIM)
    err = (ours().float() - want.float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"chunked prefill disagrees with SDPA: {err:.3g}"
    flops = 4 * batch * HQ * HEAD_DIM * sum(i % chunk + 1 for i in range(seq))
    row = dict(kind="chunked_prefill", batch=batch, ctx=seq, chunk=chunk, tokens=batch * seq)
    row["ours_us"] = timeit(ours, **_timing(device)) * 1e6
    row["sdpa_mask_us"] = timeit(sdpa_mask, **_timing(device)) * 1e6
    row["ours_TFLOPs"] = flops / row["ours_us"] / 1e6
    row["sdpa_mask_TFLOPs"] = flops / row["sdpa_mask_us"] / 1e6
    row["x_vs_sdpa_mask"] = row["sdpa_mask_us"] / row["ours_us"]
    return row


def bench_verify(batch, ctx, q_len, window, dtype, device, gen):
    """Speculative verification: q_len query rows per sequence at positions ctx - q_len .. ctx - 1, through the
    multi-query decode kernel, the prefill kernel (max_q_len past the decode rule: same call, other kernel), SDPA with
    the causal mask on the dense copy, and one decode step for comparison (what verifying should cost)."""
    keys = min(ctx, window + q_len - 1) if window > 0 else ctx
    elt = torch.tensor([], dtype=dtype).element_size()
    nbytes = 2 * batch * keys * HKV * HEAD_DIM * elt
    rot = rotations(2 * batch * ctx * HKV * HEAD_DIM * elt, device)
    probs = [paged_problem(batch, ctx, dtype, device, gen) for _ in range(rot)]
    q = torch.randn(batch * q_len, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
    q4 = q.view(batch, q_len, HQ, HEAD_DIM).transpose(1, 2)
    q1 = q.view(batch, q_len, HQ, HEAD_DIM)[:, -1]
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    mask = window_mask(torch.arange(ctx - q_len, ctx, device=device), ctx, window, device)[None, None]

    def call(max_q_len):
        # max_q_len <= num_queries (the op's rule): rows past cu_seqlens_q[-1] belong to no sequence (the CUDA kernels
        # write zeros to them; the CPU kernel refuses them, and runs both calls with one kernel anyway)
        rows = torch.cat([q, q.new_zeros(max(0, max_q_len - q.shape[0]), HQ, HEAD_DIM)])
        return cycle([lambda k=k, v=v, t=t, n=n: arkernels.window_attention(
            rows, k, v, t, n, window=window, cu_seqlens_q=cu, max_q_len=max_q_len, check=False)[:batch * q_len]
            for k, v, t, n, _, _ in probs])
    ours = call(q_len)
    on_gpu = torch.device(device).type == "cuda"
    prefill = call(9) if on_gpu else None  # 9: one past the multi-query decode rule (kDecodeMaxQueries = 8)
    step = cycle([lambda k=k, v=v, t=t, n=n: arkernels.window_attention(q1, k, v, t, n, window=window, check=False)
                  for k, v, t, n, _, _ in probs])
    sdpa = cycle([lambda kd=kd, vd=vd: F.scaled_dot_product_attention(q4, kd, vd, attn_mask=mask, enable_gqa=True)
                  for *_, kd, vd in probs])
    want = sdpa().transpose(1, 2).reshape(batch * q_len, HQ, HEAD_DIM).float()
    for name, fn in (("multi-query decode", ours), ("prefill", prefill)):
        if fn is None:
            continue
        err = (fn().float() - want).abs().max().item()
        assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"verify ({name}) disagrees with SDPA: {err:.3g}"
    row = dict(kind="verify", batch=batch, ctx=ctx, q_len=q_len, window=window, tokens=batch * ctx, rotations=rot)
    for key, fn in (("ours", ours), ("prefill", prefill), ("sdpa_mask", sdpa), ("decode_step", step)):
        if fn is not None:
            row[f"{key}_us"] = timeit(fn, **_timing(device)) * 1e6
    row["ours_GBps"] = nbytes / row["ours_us"] / 1e3
    if prefill is not None:
        row["x_vs_prefill"] = row["prefill_us"] / row["ours_us"]
    row["x_vs_sdpa_mask"] = row["sdpa_mask_us"] / row["ours_us"]
    row["x_of_decode_step"] = row["ours_us"] / row["decode_step_us"]  # 1.0: verifying costs one decode step
    return row


def pinned_sdpa(backend_name, fn):
    """``fn`` (an SDPA call) run under one SDPA backend ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"), or None
    where that backend refuses the inputs (e.g. GQA on a torch whose flash backend lacks enable_gqa)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    backend = getattr(SDPBackend, backend_name)

    def pinned():
        with sdpa_kernel(backend):
            return fn()
    try:
        pinned()
    except RuntimeError as e:
        print(f"SDPA {backend_name} refused: {str(e)[:80]}", file=sys.stderr)
        return None
    return pinned


def prefill_flops(batch, seq, window):
    """FLOPs as FlashAttention's benchmarks count them: 4 * B * Hq * D * S^2 for non-causal, halved for causal; with a
    window, 4 * B * Hq * D per visible (query, key) pair (causal-within-window: sum_i min(i + 1, W))."""
    if window <= 0 or window >= seq:
        return 4 * batch * HQ * HEAD_DIM * seq * seq // 2
    pairs = sum(min(i + 1, window) for i in range(seq))
    return 4 * batch * HQ * HEAD_DIM * pairs


def bench_prefill(batch, seq, window, dtype, device, gen):
    k, v, table, lens, kd, vd = paged_problem(batch, seq, dtype, device, gen)
    q = torch.randn(batch * seq, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
    q4 = q.view(batch, seq, HQ, HEAD_DIM).transpose(1, 2)
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
    mask = window_mask(torch.arange(seq, device=device), seq, window, device)[None, None]
    ours = lambda: arkernels.window_attention(q, k, v, table, lens, window=window, cu_seqlens_q=cu,  # noqa: E731
                                              max_q_len=seq, check=False)
    sdpa_full = lambda: F.scaled_dot_product_attention(q4, kd, vd, is_causal=True, enable_gqa=True)  # noqa: E731
    sdpa_mask = lambda: F.scaled_dot_product_attention(q4, kd, vd, attn_mask=mask, enable_gqa=True)  # noqa: E731
    want = sdpa_mask().transpose(1, 2).reshape(batch * seq, HQ, HEAD_DIM)
    err = (ours().float() - want.float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"prefill disagrees with SDPA: {err:.3g}"
    flops = prefill_flops(batch, seq, window)
    row = dict(kind="prefill", batch=batch, ctx=seq, window=window, tokens=batch * seq)
    row["ours_us"] = timeit(ours, **_timing(device)) * 1e6
    # Full-causal baselines do less or equal work than a windowed call (they ignore the window): at W = 0 they are
    # the like-for-like comparison, at W > 0 the ratio shows what skipping the tiles outside the window buys.
    row["sdpa_full_us"] = timeit(sdpa_full, **_timing(device)) * 1e6
    row["sdpa_mask_us"] = timeit(sdpa_mask, **_timing(device)) * 1e6
    if torch.device(device).type == "cuda":
        for name, key in (("FLASH_ATTENTION", "sdpa_flash_us"), ("EFFICIENT_ATTENTION", "sdpa_efficient_us")):
            fn = pinned_sdpa(name, lambda: F.scaled_dot_product_attention(q4, kd, vd, is_causal=True, enable_gqa=True))
            if fn is not None:
                row[key] = timeit(fn, device=device) * 1e6
    flex = flex_fn(window, seq, seq, device)
    if flex is not None:
        try:
            row["flex_us"] = timeit(lambda: flex(q4, kd, vd), device=device) * 1e6
        except Exception as e:  # noqa: BLE001
            print(f"flex attention unavailable: {type(e).__name__}", file=sys.stderr)
    row["ours_TFLOPs"] = flops / row["ours_us"] / 1e6
    for key in ("sdpa_full", "sdpa_mask", "sdpa_flash", "sdpa_efficient", "flex"):
        if f"{key}_us" in row:
            row[f"{key}_TFLOPs"] = flops / row[f"{key}_us"] / 1e6
            row[f"x_vs_{key}"] = row[f"{key}_us"] / row["ours_us"]
    return row


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true",
                   help="the GPU check's sweep: the issues' headline shapes only (each FlexAttention shape compiles)")
    args = p.parse_args()
    device = args.device
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    check_reference(dtype, device)
    gen = torch.Generator().manual_seed(1)
    if args.quick:
        decode = [(b, c, w) for b in (1, 4) for c in (256, 1024) for w in (0, 128)]
        prefill = [(1, s, w) for s in (64, 128) for w in (0, 32)]
        sinks, chunked, chunked_prefill = [(1, 1024)], [(1, 1024, 256)], [(1, 128, 48)]
        verify = [(1, 512, 5, 0), (2, 256, 3, 64)]
    elif args.short:  # decode batch 1 / 32 x 8k (+ a window past it), prefill 4k / 16k causal and 16k windowed
        decode = [(1, 8192, 0), (32, 8192, 0), (1, 32768, 4096)]
        prefill = [(1, 4096, 0), (1, 16384, 0), (1, 16384, 4096)]
        sinks, chunked, chunked_prefill = [(1, 8192)], [(1, 32768, 8192)], [(1, 16384, 8192)]
        verify = [(1, 8192, 4, 0), (1, 8192, 8, 0), (32, 8192, 5, 0)]  # k = 3, 7 and 4 drafted tokens
    else:
        decode = [(b, c, w) for b in (1, 8, 32) for c in (1024, 8192, 32768) for w in (0, 4096) if b * c <= 262144]
        # prompt lengths 512..16k, batch 1 and 8 (<= 128k tokens), full causal and a 4096-token window
        prefill = [(b, s, w) for b in (1, 8) for s in (512, 1024, 2048, 4096, 8192, 16384) for w in (0, 4096)
                   if b * s <= 131072 and not (w and w >= s)]
        # gpt-oss sinks at batch 1 / 32; Llama 4 chunks of 8192 (its attention_chunk_size) at the chunk's end
        sinks = [(1, 8192), (32, 8192), (1, 32768)]
        chunked = [(1, 32768, 8192), (32, 16384, 8192)]
        chunked_prefill = [(1, 16384, 8192), (1, 16384, 2048)]
        verify = [(b, c, q, w) for b in (1, 8, 32) for c in (1024, 8192) for q in (2, 4, 5, 8) for w in (0, 4096)
                  if not (w and w >= c)]
    rows = [bench_decode(b, c, w, dtype, device, gen) for b, c, w in decode]
    rows += [bench_prefill(b, s, w, dtype, device, gen) for b, s, w in prefill]
    extra = [bench_sinks_decode(b, c, dtype, device, gen) for b, c in sinks]
    extra += [bench_chunked_decode(b, c, ch, dtype, device, gen) for b, c, ch in chunked]
    extra += [bench_chunked_prefill(b, s, ch, dtype, device, gen) for b, s, ch in chunked_prefill]
    ver = [bench_verify(b, c, q, w, dtype, device, gen) for b, c, q, w in verify]
    bw = copy_bandwidth(device)
    for r in rows:
        r["device"] = device_name(device)
        r["dtype"] = str(dtype).replace("torch.", "")
        if r["kind"] == "decode":
            r["pct_copy_bw"] = 100 * r["ours_GBps"] / bw
    dec = [r for r in rows if r["kind"] == "decode"]
    for r in dec:
        r["series"] = f"B={r['batch']} W={r['window']}"
    pre = [r for r in rows if r["kind"] == "prefill"]
    for r in pre:
        r["series"] = f"W={r['window']}"
    write_results(dec, args.out, "window_attention_decode", plot=("ctx", "ours_GBps", "series"),
                  title=f"decode GB/s, GQA {HQ}/{HKV}, D={HEAD_DIM} ({device_name(device)}; copy {bw:.0f} GB/s)")
    write_results(pre, args.out, "window_attention_prefill", plot=("ctx", "ours_TFLOPs", "series"),
                  title=f"prefill TFLOP/s, GQA {HQ}/{HKV}, D={HEAD_DIM} ({device_name(device)})")
    for r in extra:
        r["device"] = device_name(device)
        r["dtype"] = str(dtype).replace("torch.", "")
        if "ours_GBps" in r:
            r["pct_copy_bw"] = 100 * r["ours_GBps"] / bw
    for r in ver:
        r["device"] = device_name(device)
        r["dtype"] = str(dtype).replace("torch.", "")
        r["pct_copy_bw"] = 100 * r["ours_GBps"] / bw
        r["series"] = f"B={r['batch']} W={r['window']}"
    write_results(ver, args.out, "window_attention_verify", plot=("q_len", "ours_us", "series"),
                  title=f"verify (q_len rows per sequence), GQA {HQ}/{HKV}, D={HEAD_DIM} ({device_name(device)})")
    write_results(extra, args.out, "window_attention_sinks_chunked", plot=("ctx", "ours_us", "kind"),
                  title=f"sinks and chunks: time per call, GQA {HQ}/{HKV}, D={HEAD_DIM} ({device_name(device)})")
    print(f"device {device_name(device)}, dtype {dtype}, copy bandwidth {bw:.1f} GB/s")
    print_table(dec, ["batch", "ctx", "window", "rotations", "ours_us", "ours_GBps", "pct_copy_bw", "fp8_x_tokens",
                      "x_vs_sdpa_full", "x_vs_sdpa_flash", "x_vs_sdpa_math", "x_vs_sdpa_mask", "x_vs_flex"])
    print_table(pre, ["batch", "ctx", "window", "ours_us", "ours_TFLOPs", "sdpa_flash_TFLOPs", "sdpa_efficient_TFLOPs",
                      "flex_TFLOPs", "x_vs_sdpa_mask", "x_vs_sdpa_full", "x_vs_flex"])
    print_table(extra, ["kind", "batch", "ctx", "chunk", "ours_us", "ours_GBps", "pct_copy_bw", "ours_TFLOPs",
                        "x_vs_no_sinks", "x_vs_eager", "x_vs_sdpa_sliced", "x_vs_sdpa_mask"])
    print_table(ver, ["batch", "ctx", "q_len", "window", "ours_us", "ours_GBps", "pct_copy_bw", "prefill_us",
                      "decode_step_us", "x_of_decode_step", "x_vs_prefill", "x_vs_sdpa_mask"])
    if args.quick:
        print_traffic()


def print_traffic():
    """Bytes the CUDA kernels move / bytes they must move (each visible K/V byte once per KV head, the query and
    the output once), counted by the SIMT emulator on small shapes of the benchmark's GQA 32/8, D=128."""
    gen = torch.Generator().manual_seed(0)
    kv_row = HKV * HEAD_DIM * 2
    rows = []
    for batch, ctx, window in ((1, 512, 0), (4, 256, 64)):
        k, v, table, lens, _, _ = paged_problem(batch, ctx, torch.float16, "cpu", gen)
        q = torch.randn(batch, HQ, HEAD_DIM, generator=gen).half()
        visible = batch * (min(ctx, window) if window else ctx)
        need = 2 * visible * kv_row + 2 * q.numel() * 2 + batch * HQ * 4 + table.numel() * 4 + batch * 4
        rows.append(simt_traffic(f"decode B={batch} ctx={ctx} W={window}",
                                 lambda: arkernels.window_attention(q, k, v, table, lens, window=window, check=False),
                                 need))
    batch, seq, window = 1, 256, 0
    k, v, table, lens, _, _ = paged_problem(batch, seq, torch.float16, "cpu", gen)
    q = torch.randn(seq, HQ, HEAD_DIM, generator=gen).half()
    cu = torch.tensor([0, seq], dtype=torch.int32)
    need = 2 * seq * kv_row + 2 * q.numel() * 2 + seq * HQ * 4 + table.numel() * 4 + 3 * 4
    rows.append(simt_traffic(f"prefill B=1 seq={seq} W=0",
                             lambda: arkernels.window_attention(q, k, v, table, lens, cu_seqlens_q=cu, max_q_len=seq,
                                                                check=False), need))
    # verify: 5 rows of GQA 4 = 20 packed rows, 2 head chunks (rows t = 0..3, t = 4): each reads its rows' union
    batch, ctx, q_len = 1, 256, 5
    k, v, table, lens, _, _ = paged_problem(batch, ctx, torch.float16, "cpu", gen)
    q = torch.randn(q_len, HQ, HEAD_DIM, generator=gen).half()
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    chunks = -(-q_len * (HQ // HKV) // 16)
    need = 2 * ctx * kv_row * chunks + 2 * q.numel() * 2 + q_len * HQ * 4 + table.numel() * 4 + 3 * 4
    rows.append(simt_traffic(f"verify B=1 ctx={ctx} q_len={q_len} W=0",
                             lambda: arkernels.window_attention(q, k, v, table, lens, cu_seqlens_q=cu, max_q_len=q_len,
                                                                check=False), need))
    if rows[0] is None:
        print("SIMT emulator not built: no traffic ratios (python -m arkernels.simt build)")
        return
    print("global-memory traffic of the CUDA kernels (SIMT emulator; bytes read/written per buffer; 'other' = "
          "outputs and split-KV partials):")
    print_table(rows, ["kernel", "ratio", "moved_B", "necessary_B", "k_cache_rw", "v_cache_rw", "query_rw",
                       "block_table_rw", "other_rw"])


if __name__ == "__main__":
    main()
