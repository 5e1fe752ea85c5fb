"""Paged KV cache append and gather: GB/s against the torch indexing a user would write.

Bytes are counted honestly: append reads key+value and writes them into the cache (4 x rows x row bytes) plus
the slot mapping; gather reads each sequence's K/V and writes the padded [batch, heads, max_len, head_dim]
outputs (zero padding included) plus the block table. The GPU goal (issue 2): >= 85% of the device's measured
copy bandwidth at 16k+ tokens and >= 3x the torch baseline.
append_fp8 (issue 11): fp16/bf16 K/V quantized into float8_e4m3fn caches (x / scale, saturated): it reads the same
bytes as append and writes half of them (the bytes_written column); its baseline is the torch a user would write,
``index_copy_`` of ``(x / scale).clamp(-448, 448).to(float8_e4m3fn)``.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, simt_traffic, timeit, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.reference.paged_kv import paged_kv_append_ref, paged_kv_gather_ref  # noqa: E402

HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
SEQS = 8  # gather: the tokens are spread over this many sequences


def copy_bandwidth(device) -> float:
    """GB/s of a plain device-to-device copy (read + write counted), the ceiling for data movement."""
    n = (1 << 28) if torch.device(device).type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timeit(lambda: dst.copy_(src), device=device) / 1e9


def bench_append(n, dtype, device):
    num_blocks = -(-n // BLOCK_SIZE) + 1
    key = torch.randn(n, HEADS, HEAD_DIM, device=device).to(dtype)
    value = torch.randn(n, HEADS, HEAD_DIM, device=device).to(dtype)
    k = torch.zeros(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:n]
    if n <= 4096:  # check against the reference before timing
        k_ref, v_ref = k.clone().cpu(), v.clone().cpu()  # caches start zeroed
        paged_kv_append_ref(key.cpu(), value.cpu(), k_ref, v_ref, slots.cpu())
        arkernels.paged_kv_append(key, value, k, v, slots)
        assert torch.equal(k.cpu(), k_ref) and torch.equal(v.cpu(), v_ref), "append disagrees with reference"

    def torch_baseline():  # what a user writes: index_copy_ into the flattened cache
        k.view(-1, HEADS, HEAD_DIM).index_copy_(0, slots, key)
        v.view(-1, HEADS, HEAD_DIM).index_copy_(0, slots, value)

    t_ours = timeit(lambda: arkernels.paged_kv_append(key, value, k, v, slots, check=False), device=device)
    t_torch = timeit(torch_baseline, device=device)
    nbytes = 4 * key.numel() * key.element_size() + slots.numel() * slots.element_size()
    return t_ours, t_torch, nbytes


def bench_append_fp8(n, dtype, device):
    """Returns (t_ours, t_torch, bytes moved, bytes written to the caches)."""
    num_blocks = -(-n // BLOCK_SIZE) + 1
    key = torch.randn(n, HEADS, HEAD_DIM, device=device).to(dtype)
    value = torch.randn(n, HEADS, HEAD_DIM, device=device).to(dtype)
    fp8 = torch.float8_e4m3fn
    k = torch.zeros(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=fp8, device=device)
    v = torch.zeros_like(k)
    ks = torch.tensor([0.02], device=device)
    vs = torch.tensor([0.01], device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:n]
    if n <= 4096:  # check against the reference before timing (bytes equal)
        k_ref, v_ref = k.clone().cpu(), v.clone().cpu()
        paged_kv_append_ref(key.cpu(), value.cpu(), k_ref, v_ref, slots.cpu(), ks.cpu(), vs.cpu())
        arkernels.paged_kv_append(key, value, k, v, slots, k_scale=ks, v_scale=vs)
        assert torch.equal(k.cpu().view(torch.uint8), k_ref.view(torch.uint8)), "fp8 append disagrees with reference"
        assert torch.equal(v.cpu().view(torch.uint8), v_ref.view(torch.uint8)), "fp8 append disagrees with reference"

    def torch_baseline():  # index_copy_ has no fp8 kernel on the CPU: the same bytes as uint8
        for c, x, sc in ((k, key, ks), (v, value, vs)):
            q = (x.float() / sc).clamp(-448, 448).to(fp8).view(torch.uint8)
            c.view(torch.uint8).view(-1, HEADS, HEAD_DIM).index_copy_(0, slots, q)

    t_ours = timeit(lambda: arkernels.paged_kv_append(key, value, k, v, slots, k_scale=ks, v_scale=vs, check=False),
                    device=device)
    t_torch = timeit(torch_baseline, device=device)
    written = 2 * key.numel()  # one byte per element
    nbytes = 2 * key.numel() * key.element_size() + written + slots.numel() * slots.element_size()
    return t_ours, t_torch, nbytes, written


def bench_gather(n, dtype, device):
    per_seq = max(1, n // SEQS)
    batch = min(SEQS, n)
    blocks_per_seq = -(-per_seq // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, device=device).to(dtype)
    v = torch.randn_like(k)
    table = torch.randperm(num_blocks, device=device).int().view(batch, blocks_per_seq)
    lens = torch.full((batch,), per_seq, dtype=torch.int32, device=device)
    lens[0] = max(1, per_seq - 3)  # one ragged sequence
    got = arkernels.paged_kv_gather(k, v, table, lens, per_seq)
    if n <= 4096:
        want = paged_kv_gather_ref(k.cpu(), v.cpu(), table.cpu(), lens.cpu(), per_seq)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), "gather disagrees"
    pos = torch.arange(per_seq, device=device)

    def torch_baseline():  # advanced indexing + a length mask, transformers' layout
        outs = []
        for c in (k, v):
            x = c[table].flatten(1, 2)[:, :per_seq].transpose(1, 2)
            outs.append(x * (pos < lens[:, None])[:, None, :, None])
        return outs

    t_ours = timeit(lambda: arkernels.paged_kv_gather(k, v, table, lens, per_seq, check=False), device=device)
    t_torch = timeit(torch_baseline, device=device)
    row = HEADS * HEAD_DIM * k.element_size()
    nbytes = 2 * row * (int(lens.sum()) + batch * per_seq) + table.numel() * 4
    return t_ours, t_torch, nbytes


def main():
    args = parser(__doc__.splitlines()[0]).parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    sizes = [1, 64, 1024] if args.quick else [1, 16, 256, 1024, 4096, 16384, 65536]
    ceiling = copy_bandwidth(dev)
    rows = []
    es = torch.empty(0, dtype=dtype).element_size()
    for op, fn in (("append", bench_append), ("append_fp8", bench_append_fp8), ("gather", bench_gather)):
        for n in sizes:
            t_ours, t_torch, nbytes, *written = fn(n, dtype, dev)
            # bytes written into the caches (append: K and V rows in the cache dtype; gather writes no cache)
            written = written[0] if written else (2 * n * HEADS * HEAD_DIM * es if op == "append" else 0)
            for impl, t in (("arkernels", t_ours), ("torch", t_torch)):
                rows.append(dict(op=op, impl=impl, series=f"{op}/{impl}", num_tokens=n, us=t * 1e6,
                                 gbps=nbytes / t / 1e9, pct_copy_bw=100 * nbytes / t / 1e9 / ceiling,
                                 speedup_vs_torch=t_torch / t if impl == "arkernels" else 1.0,
                                 bytes_written=written, dtype=str(dtype).split(".")[-1], device=device_name(dev)))
    write_results(rows, args.out, "paged_kv", plot=("num_tokens", "gbps", "series"),
                  title=f"paged KV append/gather, {device_name(dev)}, copy bw {ceiling:.0f} GB/s")
    print(f"device {device_name(dev)}: measured copy bandwidth {ceiling:.1f} GB/s; results in {args.out}/paged_kv.*")
    print_table([r for r in rows if r["impl"] == "arkernels"],
                ["op", "num_tokens", "us", "gbps", "pct_copy_bw", "speedup_vs_torch", "bytes_written"])
    if args.quick:
        print_traffic()


def print_traffic():
    """Bytes the CUDA kernels move / bytes they must move, counted by the SIMT emulator (1.0 = every byte once)."""
    gen = torch.Generator().manual_seed(0)
    n, blocks = 64, 8
    key, value = (torch.randn(n, HEADS, HEAD_DIM, generator=gen).half() for _ in range(2))
    k, v = (torch.zeros(blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.half) for _ in range(2))
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=gen)[:n]
    row_b = HEADS * HEAD_DIM * 2
    rows = [simt_traffic("paged_kv_append", lambda: arkernels.paged_kv_append(key, value, k, v, slots),
                         4 * n * row_b + n * 8)]  # K, V read and written once; the slots once
    table = torch.randperm(blocks, generator=gen).int().view(2, blocks // 2)
    lens = torch.tensor([BLOCK_SIZE * blocks // 2 - 3, 5], dtype=torch.int32)
    per_seq = int(lens.max())
    visible = int(lens.sum())
    rows.append(simt_traffic("paged_kv_gather", lambda: arkernels.paged_kv_gather(k, v, table, lens, per_seq),
                             2 * row_b * (visible + 2 * per_seq) + table.numel() * 4 + 8))
    if rows[0] is None:
        print("SIMT emulator not built: no traffic ratios (python -m arkernels.simt build)")
        return
    print("global-memory traffic of the CUDA kernels (SIMT emulator; bytes read/written per buffer):")
    print_table(rows, sorted({c for r in rows for c in r}, key=lambda c: (c not in ("kernel", "ratio"), c)))


if __name__ == "__main__":
    main()
