"""Continuous batching throughput: many requests of mixed prompt lengths through transformers' ``generate_batch``.

Methods (greedy, the same requests, each through ``model.generate_batch``):
- ``sdpa``: stock CB with ``attn_implementation="sdpa"`` (CB builds a float block-diagonal mask per step and sdpa
  reads K/V gathered from its paged cache): the baseline every ratio is against.
- ``paged|eager``: stock CB's eager path (``attn_implementation="eager"``, which CB switches to ``"paged|eager"``).
- ``flash``: stock CB with ``flash_attention_2``, only where the flash-attn package is installed.
- ``patched``: ``arkernels.patch(model)`` + the same call: our attention reads CB's pages in place (full-attention
  layers), our append writes them, CB's sampler draw is ours for sampled requests (greedy here: CB's argmax).
  transformers >= 5.23 capture CB's varlen step in CUDA graphs by default for our (mask-free) name on a GPU.
- ``patched+graphs`` (GPU only): the same with ``use_cuda_graph=True`` (CB's padded static-shape step captured and
  replayed; 5.17-5.22 do not turn graphs on by default for our name).

Each method's generated tokens are checked against ``sdpa`` before timing (``match`` column). Methods are timed
interleaved (A B C A B C ..., ``--repeats`` rounds), medians reported; a call's time includes CB's manager and cache
set-up (what a ``generate_batch`` user waits for). ``requests_per_s`` = requests / call time, ``tokens_per_s`` =
generated tokens / call time, ``ttft_ms`` = mean over requests of (first generated token - request creation), from
CB's own per-token timestamps (``record_timestamps=True``).

Models: ``--quick`` (CI, CPU): a tiny random Llama (full attention) and a tiny Gemma 3 (interleaved sliding / full
layers). Otherwise SmolLM2-135M-Instruct when its package is installed (bf16 on a GPU, fp32 on the CPU), else a
tiny random Llama with head_dim 64 (bf16 on a GPU).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.hf.tiny import tiny_model  # noqa: E402
from arkernels.models import load_model  # noqa: E402


def _cb_config(page_size, max_batch_tokens, num_blocks, **extra):
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    # transformers 5.24 renamed block_size to page_size; an explicit size keeps CB from sizing its cache (and, on the
    # CPU, its masks) from all free memory
    kw = {"page_size" if "page_size" in fields else "block_size": page_size}
    return ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, num_blocks=num_blocks, **kw, **extra)


def _requests(n, lo, hi, vocab, seed=0):
    """``n`` prompts of lengths uniform in [lo, hi] (a shared 1-token BOS start, the rest random)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, vocab, (m - 1,), generator=g).tolist() for m in lens]


def _methods(model):
    from transformers.utils import is_flash_attn_2_available

    methods = ["sdpa", "paged|eager"]
    if model.device.type == "cuda" and is_flash_attn_2_available():
        methods.append("flash")
    return methods + ["patched"] + (["patched+graphs"] if model.device.type == "cuda" else [])


def _run(model, method, prompts, new_tokens, cb_args):
    """One ``generate_batch`` call under ``method``; returns (seconds, outputs)."""
    from transformers import GenerationConfig

    impl = {"paged|eager": "eager", "flash": "flash_attention_2"}.get(method, "sdpa")
    model.set_attn_implementation(impl)
    handle = arkernels.patch(model) if method.startswith("patched") else None
    extra = dict(use_cuda_graph=True) if method.endswith("+graphs") else {}
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
    try:
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        config = _cb_config(*cb_args, **extra)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config,
                                   record_timestamps=True)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out
    finally:
        if handle is not None:
            handle.undo()
        model.set_attn_implementation("sdpa")


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def bench_model(name, model, num_requests, prompt_range, new_tokens, cb_args, repeats):
    prompts = _requests(num_requests, *prompt_range, model.config.vocab_size)
    methods = _methods(model)
    checks = {m: _run(model, m, prompts, new_tokens, cb_args)[1] for m in methods}  # warm-up + the token check
    ref = {k: v.generated_tokens for k, v in checks["sdpa"].items()}
    times, ttft = {m: [] for m in methods}, {m: [] for m in methods}
    for _ in range(repeats):  # interleaved, so drifts of a shared machine hit every method
        for m in methods:
            seconds, out = _run(model, m, prompts, new_tokens, cb_args)
            times[m].append(seconds)
            firsts = [r.timestamps[0] - r.created_time for r in out.values() if r.timestamps]
            ttft[m].append(sum(firsts) / max(len(firsts), 1))
    rows = []
    generated = sum(len(t) for t in ref.values())
    for m in methods:
        t = _median(times[m])
        rows.append(dict(model=name, device=device_name(model.device), method=m, requests=num_requests,
                         prompt=f"{prompt_range[0]}-{prompt_range[1]}", new_tokens=new_tokens,
                         page_size=cb_args[0], max_batch_tokens=cb_args[1], repeats=repeats, seconds=t,
                         requests_per_s=num_requests / t, tokens_per_s=generated / t,
                         ttft_ms=_median(ttft[m]) * 1e3,
                         match={k: v.generated_tokens for k, v in checks[m].items()} == ref))
    base = next(r for r in rows if r["method"] == "sdpa")
    for r in rows:
        r["vs_sdpa"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=None, help="CB cache blocks (default: room for every request)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (medians reported)")
    args = p.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    rows = []
    if args.quick:  # CI: tiny random models on the CPU, seconds per method
        cb_args = (8, 64, 256)
        for family in ("llama", "gemma3_text"):
            rows += bench_model(f"tiny-{family}", tiny_model(family).to(device), 24, (4, 40), 8, cb_args, 2)
    else:
        dtype = torch.bfloat16 if gpu else torch.float32
        model, _ = load_model(device=device, dtype=dtype)
        name = "SmolLM2-135M"
        if model is None:
            print("bench_cb: SmolLM2 package absent, using a tiny random Llama (head_dim 64)", file=sys.stderr)
            model, name = tiny_model("llama", dtype=dtype, head_dim=64).to(device), "tiny-llama-d64"
        blocks = args.num_blocks or args.requests * (-(-(args.prompt_max + args.new_tokens) // args.page_size) + 1)
        cb_args = (args.page_size, args.max_batch_tokens, blocks)
        rows += bench_model(name, model, args.requests, (args.prompt_min, args.prompt_max), args.new_tokens,
                            cb_args, args.repeats)
    write_results(rows, args.out, "bench_cb")
    print_table(rows, ["model", "method", "requests", "prompt", "new_tokens", "requests_per_s", "tokens_per_s",
                       "ttft_ms", "vs_sdpa", "match"])


if __name__ == "__main__":
    main()
