"""Beam search on the paged cache: K/V bytes copied per step, PagedCache vs transformers' DynamicCache.

A beam step of ``generate(num_beams=n)`` appends one token to every beam and then calls ``cache.reorder_cache(idx)``.
``DynamicCache`` answers with ``index_select`` over every layer's whole ``[beams, Hkv, S, D]`` K and V (a copy of the
entire cache, every step); ``PagedCache`` permutes block-table rows and bumps reference counts, and copies only a
shared, partly filled last block when a beam first writes to it (copy-on-write).

Measured, not modelled: DynamicCache's bytes are the bytes of the tensors its reorder allocates (``keys`` / ``values``
after the call, which are new tensors); PagedCache's are its own counter (``bytes_copied``), both summed over layers,
K and V. Each step draws a random beam permutation (repeats allowed, as beam search does) from a fixed seed; both
caches see the same K/V and the same permutations, and their dense K/V are checked equal at the end. Step time is
append + reorder on this device (CPU figures are CPU figures).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, write_results  # noqa: E402

from arkernels.hf.cache import PagedCache  # noqa: E402


def _config(layers: int, hkv: int, head_dim: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=hkv, num_key_value_heads=hkv, head_dim=head_dim,
                       hidden_size=hkv * head_dim, vocab_size=256)


def run(kind: str, cfg, beams: int, prompt: int, steps: int, block_size: int, dtype, device) -> dict:
    from transformers import DynamicCache

    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    cache = (DynamicCache(config=cfg) if kind == "DynamicCache"
             else PagedCache(cfg, block_size=block_size, max_length=prompt + steps, paged_attention=False))
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, beams, H, prompt, D, generator=g).to(device=device, dtype=dtype)
    for layer in range(L):
        cache.update(kv[0], kv[1], layer)
    copied, t_total = 0, 0.0
    for step in range(steps):
        kv = torch.randn(2, beams, H, 1, D, generator=g).to(device=device, dtype=dtype)
        idx = torch.randint(0, beams, (beams,), generator=g).sort().values.to(device)
        before = cache.bytes_copied if kind == "PagedCache" else 0  # copy-on-write happens in the next update
        t0 = time.perf_counter()
        for layer in range(L):
            cache.update(kv[0], kv[1], layer)
        cache.reorder_cache(idx)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_total += time.perf_counter() - t0
        if kind == "PagedCache":
            copied += cache.bytes_copied - before
        else:  # reorder replaced every layer's keys/values with new tensors: those bytes were copied
            copied += sum(2 * lay.keys.numel() * lay.keys.element_size() for lay in cache.layers)
    dense = [(lay.keys, lay.values) for lay in cache.layers]
    return dict(cache=kind, beams=beams, prompt=prompt, steps=steps, block_size=block_size,
                kv_bytes_copied_per_step=copied / steps, step_ms=1e3 * t_total / steps, _dense=dense)


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if args.quick:
        cfg, sweeps, steps = _config(2, 2, 64), [(4, 64)], 16
    else:  # Llama-3-8B's K/V shape per layer (8 KV heads x 128), 8 layers to keep the CPU run short
        cfg, sweeps, steps = _config(8, 8, 128), [(4, 256), (4, 1024), (8, 1024)], 32
    rows = []
    for beams, prompt in sweeps:
        pair = [run(k, cfg, beams, prompt, steps, args.block_size, dtype, device)
                for k in ("DynamicCache", "PagedCache")]
        for (dk, dv), (pk, pv) in zip(pair[0]["_dense"], pair[1]["_dense"]):
            assert torch.equal(dk, pk) and torch.equal(dv, pv), "PagedCache diverged from DynamicCache"
        base = pair[0]["kv_bytes_copied_per_step"]
        for r in pair:
            del r["_dense"]
            r["bytes_vs_dynamic"] = r["kv_bytes_copied_per_step"] / base if base else float("nan")
            r["device"] = device_name(device)
            rows.append(r)
    write_results(rows, args.out, "bench_beam")
    print_table(rows, ["cache", "beams", "prompt", "steps", "kv_bytes_copied_per_step", "bytes_vs_dynamic",
                       "step_ms"])


if __name__ == "__main__":
    main()
