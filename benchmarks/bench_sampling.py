"""Sampling (temperature 0.8, top-k 50, top-p 0.9, min-p 0.05): microseconds per call and GB/s of logits read,
against the sort-based PyTorch paths users have today:
  * ``hf``: transformers' logits warpers (Temperature, TopK, TopP, MinP) + softmax + ``torch.multinomial``;
  * ``sort``: the vLLM-style filter: one descending sort, top-k by rank, softmax + cumsum top-p, min-p,
    ``torch.multinomial``.
GB/s counts the logits bytes once (batch x vocab x element size): the floor any sampler must read.
Every configuration's kept set is checked against the float64 reference (two rows) before timing.
GPU goals (issue 4, H200): vocab 128256 batch 1 <= 25 us; batch 256 >= 5x the sort path and >= 50% of HBM.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, timeit, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.reference.sampling import sampling_probs_ref  # noqa: E402

T, TOP_K, TOP_P, MIN_P = 0.8, 50, 0.9, 0.05
VOCABS = [32000, 128256, 152064]
BATCHES = [1, 8, 64, 256, 512]
QUICK_VOCABS, QUICK_BATCHES = [32000, 49152], [1, 8]


def hf_sample(logits):
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    scores = logits.float()
    for w in (TemperatureLogitsWarper(T), TopKLogitsWarper(TOP_K), TopPLogitsWarper(TOP_P), MinPLogitsWarper(MIN_P)):
        scores = w(None, scores)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]


def sort_sample(logits):
    scores = logits.float() / T
    sorted_s, idx = torch.sort(scores, dim=-1, descending=True)
    ranks = torch.arange(scores.shape[1], device=scores.device)
    sorted_s = sorted_s.masked_fill(ranks >= TOP_K, float("-inf"))
    probs = torch.softmax(sorted_s, dim=-1)
    above = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(above >= TOP_P, 0.0)
    probs = probs.masked_fill(probs < MIN_P * probs[:, :1], 0.0)
    pick = torch.multinomial(probs, 1)
    return idx.gather(1, pick)[:, 0]


def check(logits):
    got = arkernels.sampling_probs(logits[:2], temperature=T, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P).cpu()
    n = logits.shape[0] if logits.shape[0] < 2 else 2
    want = sampling_probs_ref(logits[:n].cpu(), [T] * n, [TOP_K] * n, [TOP_P] * n, [MIN_P] * n)
    assert torch.equal(got > 0, want > 0), "sampling_probs: kept set differs from the reference"
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def main():
    args = parser(__doc__.splitlines()[0]).parse_args()
    dev = args.device
    if dev == "cpu":
        torch.set_num_threads(1)  # CI's 2 cores are shared: one thread per implementation is the steadier measure
    vocabs, batches = (QUICK_VOCABS, QUICK_BATCHES) if args.quick else (VOCABS, BATCHES)
    iters = 5 if args.quick or dev == "cpu" else 50
    rows = []
    for vocab in vocabs:
        for batch in batches:
            gen = torch.Generator().manual_seed(vocab + batch)
            logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dev)  # peaked, as LM logits are
            check(logits)
            seed, step = torch.arange(batch, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev)
            ours = lambda: arkernels.sample(logits, temperature=T, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P,  # noqa: E731
                                            seed=seed, step=step)
            nbytes = logits.numel() * logits.element_size()
            t_ours = timeit(ours, iters=iters, device=dev)
            t_hf = timeit(lambda: hf_sample(logits), iters=iters, device=dev)
            t_sort = timeit(lambda: sort_sample(logits), iters=iters, device=dev)
            for impl, t in (("arkernels", t_ours), ("hf", t_hf), ("sort", t_sort)):
                rows.append(dict(vocab=vocab, batch=batch, impl=impl, us=t * 1e6, gbps=nbytes / t / 1e9,
                                 speedup_vs_sort=t_sort / t, device=device_name(dev)))
    write_results(rows, args.out, "bench_sampling", plot=("batch", "us", "impl"),
                  title=f"sampling, T={T} k={TOP_K} p={TOP_P} min_p={MIN_P} ({device_name(dev)})")
    print_table(rows, ["vocab", "batch", "impl", "us", "gbps", "speedup_vs_sort"])


if __name__ == "__main__":
    main()
