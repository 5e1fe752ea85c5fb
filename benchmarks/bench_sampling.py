"""Sampling: microseconds per call and GB/s of logits read, per setting, against what users run today:
  * ``hf``: transformers' logits warpers (Temperature, TopK, TopP, MinP as the setting asks) + softmax +
    ``torch.multinomial`` (greedy: argmax);
  * ``sort``: the vLLM-style filter: one descending sort, top-k by rank, softmax + cumsum top-p, min-p,
    ``torch.multinomial``;
  * ``topk``: ``torch.topk(k)`` then top-p / min-p on the k values (settings with top-k, and greedy).
Settings: greedy, temperature 0.8 only, top-k 50, top-p 0.9, top-k 50 + top-p 0.9, min-p 0.05 (all at T 0.8).
GB/s counts the logits bytes once (batch x vocab x element size): the floor any sampler must read.
``speedup_vs_sort`` / ``speedup_vs_hf``: the baselines' time over ours, measured in the same run.

Passes: the Triton kernels' own debug counter (``sample_triton(debug=True)``) of full-row passes per row (max
over the batch) and the share of sampled rows that took the fast path (candidates <= CAND_CAP) rather than
the full-row fallback. On a GPU they come from the GPU run; on the CPU from the Triton interpreter
(``--quick``: batch 1 x vocab 128256, every setting).

On the CPU, ``arkernels.sample`` runs its CPU kernel (torch), so CPU timings say nothing about the GPU kernels.
Each (setting, vocab)'s kept set is checked against the float64 reference (two rows, smallest batch) before timing.
GPU goals (issue 13, H200): vocab 128k batch 1 top-k + top-p <= 25 us; batch 256 >= 5x the sort path and
>= 50% of HBM bandwidth (4.3 TB/s) for one read of the logits.

Headline case (``--headline``, ``bench_sampling_headline``; gpu_check runs it first): vocab 128256 fp32, batch 1 and
256, every setting, ``arkernels.sample`` captured in a CUDA graph and replayed (the device time of its two launches,
without the Python wrapper's host time) next to the eager call, the graphed kernels with the on-chip draw off
(``graph_search``, ``kmax=0``) and at batch 1 without PDL (``graph_nopdl``); on the CPU only the eager CPU op.

Penalties case (``bench_sampling_penalties``): vocab 128256, batch 1 and 256, a 4096-token history per row (prompt
3072 + 1024 generated), T 0.8 + top-k 50 + top-p 0.9 with repetition 1.1, frequency 0.2, presence 0.1, against
``hf+torch`` (transformers' RepetitionPenaltyLogitsProcessor over the 4096 input ids, vLLM's frequency / presence
lines in torch over a bincount, then ``hf``'s warpers and multinomial) and ``no_rules`` (the same kernels without
penalties). ``arkernels`` times the draw plus the history update (``update_token_state``), what a decode step runs.
GB/s counts the logits and the int32 token_state once. ``--quick``: vocab 32000, batch 1 and 8.
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
from arkernels.reference.sampling import sampling_probs_ref  # noqa: E402
from arkernels.triton.pdl import pdl_supported  # noqa: E402
from arkernels.triton.sampling_launch import sample_triton  # noqa: E402

T0 = 0.8
# name: (temperature, top_k, top_p, min_p)
SETTINGS = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (T0, 0, 1.0, 0.0),
    "top_k50": (T0, 50, 1.0, 0.0),
    "top_p0.9": (T0, 0, 0.9, 0.0),
    "top_k50+top_p0.9": (T0, 50, 0.9, 0.0),
    "min_p0.05": (T0, 0, 1.0, 0.05),
}
VOCABS = [32000, 128256, 256000]
BATCHES = [1, 8, 64, 256]
QUICK_VOCABS, QUICK_BATCHES = [32000], [1, 8]
QUICK_PASS_SHAPE = (1, 128256)  # the pass budget is stated at vocab 128k


def hf_sample(logits, T, k, p, mp):
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    if T == 0:
        return logits.argmax(dim=-1)
    scores = TemperatureLogitsWarper(T)(None, logits.float())
    for on, w in ((k > 0, lambda: TopKLogitsWarper(k)), (p < 1, lambda: TopPLogitsWarper(p)),
                  (mp > 0, lambda: MinPLogitsWarper(mp))):
        if on:
            scores = w()(None, scores)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]


def _filter_sorted(sorted_s, k, p, mp):
    """top-k by rank, top-p by the mass above, min-p, on descending scores -> probabilities."""
    if k > 0:
        ranks = torch.arange(sorted_s.shape[1], device=sorted_s.device)
        sorted_s = sorted_s.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_s, dim=-1)
    if p < 1:
        probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= p, 0.0)
    if mp > 0:
        probs = probs.masked_fill(probs < mp * probs[:, :1], 0.0)
    return probs


def sort_sample(logits, T, k, p, mp):
    if T == 0:
        return logits.argmax(dim=-1)
    sorted_s, idx = torch.sort(logits.float() / T, dim=-1, descending=True)
    return idx.gather(1, torch.multinomial(_filter_sorted(sorted_s, k, p, mp), 1))[:, 0]


def topk_sample(logits, T, k, p, mp):
    if T == 0:
        return torch.topk(logits, 1, dim=-1).indices[:, 0]
    vals, idx = torch.topk(logits.float() / T, k, dim=-1)  # sorted, descending
    return idx.gather(1, torch.multinomial(_filter_sorted(vals, 0, p, mp), 1))[:, 0]


def check(logits, T, k, p, mp):
    n = min(2, logits.shape[0])
    got = arkernels.sampling_probs(logits[:n], temperature=T, top_k=k, top_p=p, min_p=mp).cpu()
    want = sampling_probs_ref(logits[:n].cpu(), [T] * n, [k] * n, [p] * n, [mp] * n)
    assert torch.equal(got > 0, want > 0), "sampling_probs: kept set differs from the reference"
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    ids = arkernels.sample(logits[:n], temperature=T, top_k=k, top_p=p, min_p=mp, seed=torch.arange(n), step=0)
    assert bool((want.gather(1, ids.cpu()[:, None]) > 0).all()), "sample: a token outside the kept set"


def passes(logits, T, k, p, mp):
    """(max full-row passes over the rows, share of sampled rows on the fast path) from the debug counter."""
    batch, dev = logits.shape[0], logits.device
    f = lambda v, dt=torch.float32: torch.full((batch,), v, dtype=dt, device=dev)  # noqa: E731
    _, _, (ncand, npass) = sample_triton(logits, f(T), f(k, torch.int32), f(p), f(mp), torch.arange(batch, device=dev),
                                         f(0, torch.int64), debug=True)
    fast = float((ncand >= 0).float().mean()) if T > 0 else 1.0
    return int(npass.max()), fast


def _logits(batch, vocab, dev):
    gen = torch.Generator().manual_seed(vocab + batch)
    return (torch.randn(batch, vocab, generator=gen) * 4).to(dev)  # peaked, as LM logits are


PEN = dict(temperature=T0, top_k=50, top_p=0.9)
PEN_RULES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
PEN_SHAPES, QUICK_PEN_SHAPES = [(128256, 1), (128256, 256)], [(32000, 1), (32000, 8)]
PEN_PROMPT, PEN_GENERATED = 3072, 1024


def hf_penalized_logits(logits, input_ids, generated):
    """What users run today: transformers' repetition processor + vLLM's frequency / presence lines, in torch."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    scores = RepetitionPenaltyLogitsProcessor(PEN_RULES["repetition_penalty"])(input_ids, logits.float())
    counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
    scores = scores - PEN_RULES["frequency_penalty"] * counts
    return scores - PEN_RULES["presence_penalty"] * (counts > 0).to(scores.dtype)


def bench_penalties(args, dev, iters):
    rows = []
    for vocab, batch in (QUICK_PEN_SHAPES if args.quick else PEN_SHAPES):
        gen = torch.Generator().manual_seed(vocab)
        logits = _logits(batch, vocab, dev)
        prompt = torch.randint(0, vocab, (batch, PEN_PROMPT), generator=gen).to(dev)
        generated = torch.randint(0, vocab, (batch, PEN_GENERATED), generator=gen).to(dev)
        state = arkernels.token_state(prompt.cpu(), vocab, device=dev)
        for j in range(PEN_GENERATED):
            arkernels.update_token_state(state, generated[:, j])
        input_ids = torch.cat([prompt, generated], dim=1)
        # check before timing: the fused rules give the torch baseline's processed logits exactly (one row), and the
        # draw lies in the reference's kept set
        want = hf_penalized_logits(logits[:1], input_ids[:1], generated[:1])
        got = arkernels.sampling_rules(logits[:1], token_state=state[:1], **PEN_RULES)
        assert torch.equal(got, want), "sampling_rules: processed logits differ from transformers + vLLM's rule"
        q = sampling_probs_ref(want.cpu(), [T0], [50], [0.9], [0.0])
        ids = arkernels.sample(logits[:1], **PEN, seed=0, token_state=state[:1], **PEN_RULES)
        assert float(q[0, int(ids[0])]) > 0, "sample: a token outside the kept set"
        seed, step = torch.arange(batch, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev)
        st = state.clone()

        def ours():
            out = arkernels.sample(logits, **PEN, seed=seed, step=step, token_state=st, **PEN_RULES)
            arkernels.update_token_state(st, out)
            return out

        def hf():
            return hf_sample(hf_penalized_logits(logits, input_ids, generated), *PEN.values(), 0.0)

        extra = {}
        if dev != "cpu" or (os.environ.get("TRITON_INTERPRET") == "1" and batch == 1):
            # the Triton kernels' own pass counter with the rules on: they add no full-row pass
            from arkernels.ops.sampling import rule_tensors

            f = lambda v, dt=torch.float32: torch.full((batch,), v, dtype=dt, device=dev)  # noqa: E731
            r = rule_tensors("bench", logits, st, None, 0, 0, *PEN_RULES.values(), None)
            _, _, (ncand, npass) = sample_triton(logits, f(T0), f(50, torch.int32), f(0.9), f(0.0), seed, step, *r,
                                                 debug=True)
            extra = dict(passes=int(npass.max()), fast_share=float((ncand >= 0).float().mean()))
        times = {"arkernels": timeit(ours, iters=iters, device=dev), "hf+torch": timeit(hf, iters=iters, device=dev),
                 "no_rules": timeit(lambda: arkernels.sample(logits, **PEN, seed=seed, step=step), iters=iters,
                                    device=dev)}
        nbytes = logits.numel() * (logits.element_size() + 4)
        for impl, t in times.items():
            rows.append(dict(setting="penalties", vocab=vocab, batch=batch, history=PEN_PROMPT + PEN_GENERATED,
                             impl=impl, us=t * 1e6, gbps=nbytes / t / 1e9, speedup_vs_hf=times["hf+torch"] / t,
                             cost_vs_no_rules=t / times["no_rules"], device=device_name(dev),
                             **(extra if impl == "arkernels" else {})))
    return rows


HEADLINE_VOCAB, HEADLINE_BATCHES = 128256, (1, 256)


def _graphed(run, iters, dev):
    """us per replay of ``run`` captured in a CUDA graph (the device time of its launches)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and allocate (the stream's ticket workspace too) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the warmed-up stream: no zero fill captured
        run()
    return timeit(graph.replay, iters=iters, device=dev)


def bench_headline(dev, iters):
    """``sample`` at the issues' headline shapes: eager and CUDA-graph replayed (us per call); on a GPU also the
    kernels with the on-chip draw off (``graph_search``: top-k rows search their candidates, issue 34 item 4's
    before) and, at batch 1 on sm_90, without programmatic dependent launch (``graph_nopdl``), graph-replayed."""
    rows = []
    for batch in HEADLINE_BATCHES:
        logits = _logits(batch, HEADLINE_VOCAB, dev)
        seed, step = torch.arange(batch, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev)
        for name, (T, k, p, mp) in SETTINGS.items():
            run = lambda: arkernels.sample(logits, temperature=T, top_k=k, top_p=p, min_p=mp,  # noqa: E731
                                           seed=seed, step=step)
            times = {"eager": timeit(run, iters=iters, device=dev)}
            if dev != "cpu":
                times["graph"] = _graphed(run, iters, dev)
                rowp = [torch.full((batch,), v, dtype=d, device=dev)
                        for v, d in ((T, torch.float32), (k, torch.int32), (p, torch.float32), (mp, torch.float32))]
                times["graph_search"] = _graphed(lambda: sample_triton(logits, *rowp, seed, step, kmax=0), iters, dev)
                if batch == 1 and pdl_supported(logits.device):  # what programmatic dependent launch hides
                    times["graph_nopdl"] = _graphed(lambda: sample_triton(logits, *rowp, seed, step, pdl=False), iters,
                                                    dev)
            for impl, t in times.items():
                rows.append(dict(setting=name, vocab=HEADLINE_VOCAB, batch=batch, impl=impl, us=t * 1e6,
                                 gbps=logits.numel() * logits.element_size() / t / 1e9, device=device_name(dev)))
    return rows


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--headline", action="store_true", help="only vocab 128256 at batch 1 and 256, eager and graphed")
    args = p.parse_args()
    dev = args.device
    if args.headline:
        rows = bench_headline(dev, 50 if dev != "cpu" else 2)
        write_results(rows, args.out, "bench_sampling_headline")
        print_table(rows, ["setting", "vocab", "batch", "impl", "us", "gbps"])
        return
    if dev == "cpu":
        torch.set_num_threads(1)  # CI's 2 cores are shared: one thread per implementation is the steadier measure
    vocabs, batches = (QUICK_VOCABS, QUICK_BATCHES) if args.quick else (VOCABS, BATCHES)
    iters = 5 if args.quick or dev == "cpu" else 20  # gpu_check gives this script 60 s for 72 configurations x 4
    count_passes = dev != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"
    rows, pass_rows = [], []
    for name, (T, k, p, mp) in SETTINGS.items():
        if count_passes and (args.quick or dev == "cpu"):
            b, v = QUICK_PASS_SHAPE
            n, fast = passes(_logits(b, v, dev), T, k, p, mp)
            pass_rows.append(dict(setting=name, vocab=v, batch=b, passes=n, fast_share=fast))
        for vocab in vocabs:
            for batch in batches:
                logits = _logits(batch, vocab, dev)
                if batch == batches[0]:  # the fp64 reference costs ~0.1 s per 128k row on the host: once per vocab
                    check(logits, T, k, p, mp)
                seed, step = torch.arange(batch, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev)
                extra = {}
                if count_passes and not (args.quick or dev == "cpu"):
                    extra["passes"], extra["fast_share"] = passes(logits, T, k, p, mp)
                nbytes = logits.numel() * logits.element_size()
                ours = lambda: arkernels.sample(logits, temperature=T, top_k=k, top_p=p, min_p=mp,  # noqa: E731
                                                seed=seed, step=step)
                times = {"arkernels": timeit(ours, iters=iters, device=dev),
                         "hf": timeit(lambda: hf_sample(logits, T, k, p, mp), iters=iters, device=dev),
                         "sort": timeit(lambda: sort_sample(logits, T, k, p, mp), iters=iters, device=dev)}
                if k > 0 or T == 0:
                    times["topk"] = timeit(lambda: topk_sample(logits, T, k, p, mp), iters=iters, device=dev)
                for impl, t in times.items():
                    rows.append(dict(setting=name, vocab=vocab, batch=batch, impl=impl, us=t * 1e6,
                                     gbps=nbytes / t / 1e9, speedup_vs_sort=times["sort"] / t,
                                     speedup_vs_hf=times["hf"] / t, device=device_name(dev),
                                     **(extra if impl == "arkernels" else {})))
    pen_rows = bench_penalties(args, dev, iters)
    write_results(pen_rows, args.out, "bench_sampling_penalties")
    write_results(rows, args.out, "bench_sampling", plot=("batch", "us", "impl"),
                  title=f"sampling, all settings ({device_name(dev)})")
    if pass_rows:
        write_results(pass_rows, args.out, "bench_sampling_passes")
    print_table(rows, ["setting", "vocab", "batch", "impl", "us", "gbps", "speedup_vs_sort", "speedup_vs_hf"]
                + (["passes", "fast_share"] if rows and "passes" in rows[0] else []))
    print("penalties (4096-token history)")
    print_table(pen_rows, ["vocab", "batch", "impl", "us", "gbps", "speedup_vs_hf", "cost_vs_no_rules", "passes",
                           "fast_share"])
    if pass_rows:
        print("full-row passes of the Triton kernels (debug counter" +
              (", Triton interpreter)" if dev == "cpu" else ")"))
        print_table(pass_rows, ["setting", "vocab", "batch", "passes", "fast_share"])


if __name__ == "__main__":
    main()
