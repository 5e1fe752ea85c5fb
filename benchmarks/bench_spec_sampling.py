"""Speculative sampling (``chain_speculative_sampling``): microseconds per call and GB/s of logits read, per setting,
against what users run today:
  * ``torch``: the batched form of transformers' ``_speculative_sampling`` (generation/utils.py) with the settings'
    filters in torch: softmax of the filtered target and draft logits, ``p / q`` at the drafts, ``torch.rand``
    acceptance, the first rejection by cumprod, the residual and the bonus token by ``torch.multinomial``
    (greedy: argmax comparisons).
Settings: greedy, temperature 0.8, top-k 50 (at T 0.8), top-p 0.9 (at T 0.8, torch: sort + cumsum); the draft as
logits (a draft model) or as ids only (prompt lookup, one-hot). GB/s counts the logits bytes once (batch x (k+1)
target rows, + batch x k draft rows, x vocab x element size): the floor any verifier must read.
``speedup_vs_torch``: the baseline's time over ours, measured in the same run.

Before timing, each (setting, draft, vocab) is checked against the float64 reference (two rows of the smallest
batch): the same tokens and accepted counts. On the CPU ``arkernels.chain_speculative_sampling`` runs its CPU kernel
(``sampling_probs`` per position + the torch walk), so CPU timings say nothing about the GPU kernels.
``--quick``: vocab 32000, batch 1 and 8, k 4.
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # without a GPU the Triton kernels only run interpreted

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, timeit, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.reference.spec_sampling import chain_speculative_sampling_ref  # noqa: E402

T0 = 0.8
# name: (temperature, top_k, top_p)
SETTINGS = {"greedy": (0.0, 0, 1.0), "temperature": (T0, 0, 1.0), "top_k50": (T0, 50, 1.0), "top_p0.9": (T0, 0, 0.9)}
DRAFTS = ["logits", "onehot"]
VOCABS, BATCHES, KS = [32000, 128256], [1, 8, 64], [4, 8]
QUICK_VOCABS, QUICK_BATCHES, QUICK_KS = [32000], [1, 8], [4]


def _inputs(batch, k, vocab, dev):
    """Peaked target logits, a draft close to them, and drafts drawn from the draft (most accepted, not all)."""
    gen = torch.Generator().manual_seed(vocab + batch + k)
    x = torch.randn(batch, k + 1, vocab, generator=gen) * 4
    d = x[:, :k] + torch.randn(batch, k, vocab, generator=gen)
    ids = torch.stack([torch.multinomial(torch.softmax(d[:, j] / T0, dim=-1), 1, generator=gen)[:, 0]
                       for j in range(k)], dim=1)
    return x.to(dev), d.to(dev), ids.to(dev)


def _filtered_probs(logits, T, k, p):
    """The settings' filters in torch (what users write): temperature, top-k by threshold, top-p by sort + cumsum."""
    z = logits.float() / T
    if k > 0:
        z = z.masked_fill(z < torch.topk(z, k, dim=-1).values[..., -1:], float("-inf"))
    if p < 1:
        s, idx = torch.sort(z, dim=-1, descending=True)
        ps = torch.softmax(s, dim=-1)
        drop = (torch.cumsum(ps, dim=-1) - ps) >= p
        z = z.scatter(-1, idx, s.masked_fill(drop, float("-inf")))
    return torch.softmax(z, dim=-1)


def torch_spec(x, d, ids, T, k, p):
    """Batched transformers-style speculative sampling in torch -> (tokens [batch, K+1] (-1 padded), accepted)."""
    batch, kp1, vocab = x.shape
    K = kp1 - 1
    ar = torch.arange(kp1, device=x.device)
    if T == 0:
        tgt = x.argmax(dim=-1)
        acc = (ids == tgt[:, :K]).long().cumprod(dim=1).sum(dim=1)
        drawn = tgt.gather(1, acc[:, None])[:, 0]
    else:
        pp = _filtered_probs(x, T, k, p)
        qq = (_filtered_probs(d, T, k, p) if d is not None
              else torch.zeros_like(pp[:, :K]).scatter_(2, ids[..., None], 1.0))
        pt, qt = pp[:, :K].gather(2, ids[..., None])[..., 0], qq.gather(2, ids[..., None])[..., 0]
        ok = torch.rand(batch, K, device=x.device) < (pt / qt).clamp(max=1.0)
        acc = ok.long().cumprod(dim=1).sum(dim=1)
        rows = torch.arange(batch, device=x.device)
        ps = pp[rows, acc]
        qs = torch.where((acc < K)[:, None], qq[rows, acc.clamp(max=K - 1)], 0.0)
        r = (ps - qs).clamp(min=0)
        r = torch.where(r.sum(dim=-1, keepdim=True) > 0, r, ps)
        drawn = torch.multinomial(r, 1)[:, 0]
    ext = torch.cat([ids, ids.new_full((batch, 1), -1)], dim=1)
    tokens = torch.where(ar < acc[:, None], ext, torch.where(ar == acc[:, None], drawn[:, None], -1))
    return tokens, acc


def check(x, d, ids, T, k, p):
    """The op against the fp64 reference on two rows: the same tokens and accepted counts, several seeds."""
    n = min(2, x.shape[0])
    x, d, ids = x[:n].cpu(), None if d is None else d[:n].cpu(), ids[:n].cpu()
    f = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt)  # noqa: E731
    for s in range(2):
        seed = torch.arange(n) + 10 * s
        tokens, acc = arkernels.chain_speculative_sampling(x, ids, d, temperature=T, top_k=k, top_p=p, seed=seed,
                                                           step=s)
        want = chain_speculative_sampling_ref(x, d, ids, f(T), f(k, torch.int32), f(p), f(0.0), seed,
                                              torch.full((n,), s))
        assert torch.equal(tokens, want[0]) and torch.equal(acc, want[1]), "chain_speculative_sampling != reference"


def main():
    args = parser(__doc__.splitlines()[0]).parse_args()
    dev = args.device
    if dev == "cpu":
        torch.set_num_threads(1)  # CI's 2 cores are shared: one thread per implementation is the steadier measure
    vocabs, batches, ks = (QUICK_VOCABS, QUICK_BATCHES, QUICK_KS) if args.quick else (VOCABS, BATCHES, KS)
    iters = 5 if args.quick or dev == "cpu" else 20
    rows = []
    for name, (T, k, p) in SETTINGS.items():
        for draft in DRAFTS:
            for vocab in vocabs:
                for K in ks:
                    for batch in batches:
                        x, d, ids = _inputs(batch, K, vocab, dev)
                        d = d if draft == "logits" else None
                        if batch == batches[0] and K == ks[0]:  # the fp64 reference is slow: once per vocab
                            check(x, d, ids, T, k, p)
                        seed, step = torch.arange(batch, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev)
                        ours = lambda: arkernels.chain_speculative_sampling(  # noqa: E731
                            x, ids, d, temperature=T, top_k=k, top_p=p, seed=seed, step=step)
                        times = {"arkernels": timeit(ours, iters=iters, device=dev),
                                 "torch": timeit(lambda: torch_spec(x, d, ids, T, k, p), iters=iters, device=dev)}
                        nbytes = (x.numel() + (d.numel() if d is not None else 0)) * x.element_size()
                        accepted = float(ours()[1].double().mean())
                        for impl, t in times.items():
                            rows.append(dict(setting=name, draft=draft, vocab=vocab, k=K, batch=batch, impl=impl,
                                             us=t * 1e6, gbps=nbytes / t / 1e9, speedup_vs_torch=times["torch"] / t,
                                             mean_accepted=accepted, device=device_name(dev)))
    write_results(rows, args.out, "bench_spec_sampling", plot=("batch", "us", "impl"),
                  title=f"chain_speculative_sampling, all settings ({device_name(dev)})")
    print_table(rows, ["setting", "draft", "vocab", "k", "batch", "impl", "us", "gbps", "speedup_vs_torch",
                       "mean_accepted"])


if __name__ == "__main__":
    main()
