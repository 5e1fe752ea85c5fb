"""End-to-end decode: tokens/s and achieved memory bandwidth of four ways to generate with one model.

Methods (greedy, the same prompts):
- ``stock``: transformers ``model.generate`` (sdpa, DynamicCache): the baseline every ratio is against.
- ``static+compile``: ``cache_implementation="static"`` + ``torch.compile`` (GPU, or ``--compile`` on the CPU: its
  compile time on 2 cores is minutes).
- ``patched``: ``arkernels.patch(model)`` + the same ``model.generate``.
- ``arkernels``: ``arkernels.generate`` (eager decode steps).
- ``arkernels+graphs``: ``arkernels.generate(cuda_graphs=True)``: on a GPU each batch-size bucket's decode step is
  captured in a CUDA graph and replayed; on the CPU the same static step runs eagerly (its host overhead, no graphs).

Decode time = time(prompt + N new tokens) - time(prompt + 1 token); decode tokens/s = batch * (N - 1) / decode time.
Achieved bandwidth = (model bytes + KV bytes read per step at the mean context) / decode step time: the bytes a decode
step must read at least. Each method's greedy tokens are checked against stock before timing (``match`` column).

Models: SmolLM2-135M-Instruct on the CPU (tiny random Llama with ``--quick`` or without the model package); on a GPU
also a Llama-3-8B-shaped model with random bf16 weights (coded; not measured on this project's CPU machines).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.models import load_model, tiny_llama  # noqa: E402


def llama3_8b_shape(device, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _stock(model, ids, n, **kw):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kw)[:, ids.shape[1]:]


def _ours(model, ids, n, cuda_graphs=False):
    return torch.tensor(arkernels.generate(model, ids, max_new_tokens=n, eos_token_id=[],
                                           cuda_graphs=cuda_graphs).tokens)


def _time(fn, device, repeats):
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_model(name, model, batches, prompt_len, new_tokens, device, methods, repeats):
    cfg = model.config
    elem = next(model.parameters()).element_size()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        ids = torch.randint(3, min(cfg.vocab_size, 30000), (batch, prompt_len), generator=g).to(device)
        runs = {}
        for method in methods:
            if method == "stock":
                fn = lambda n: _stock(model, ids, n)  # noqa: E731
            elif method == "static+compile":
                fn = lambda n: _stock(model, ids, n, cache_implementation="static",  # noqa: E731
                                      compile_config=None)
            elif method == "patched":
                fn = lambda n: _stock(model, ids, n)  # noqa: E731  (runs inside the patch below)
            elif method == "arkernels+graphs":
                fn = lambda n: _ours(model, ids, n, cuda_graphs=True)  # noqa: E731
            else:
                fn = lambda n: _ours(model, ids, n)  # noqa: E731
            handle = arkernels.patch(model) if method == "patched" else None
            try:
                out = fn(new_tokens)  # warm-up (and compile) + the check against stock
                runs[method] = out
                t_full = _time(lambda: fn(new_tokens), device, repeats)
                t_prefill = _time(lambda: fn(1), device, repeats)
            finally:
                if handle is not None:
                    handle.undo()
            step = max(t_full - t_prefill, 1e-9) / max(new_tokens - 1, 1)
            ctx = prompt_len + new_tokens / 2
            gbs = (model_bytes + batch * ctx * kv_per_token) / step / 1e9
            rows.append(dict(model=name, device=device_name(device), method=method, batch=batch, prompt=prompt_len,
                             new_tokens=new_tokens, tokens_per_s=batch / step, step_ms=step * 1e3, gb_per_s=gbs,
                             prefill_s=t_prefill, match=bool(torch.equal(out.cpu(), runs["stock"].cpu()))))
        base = next(r for r in rows if r["batch"] == batch and r["method"] == "stock" and r["model"] == name)
        for r in rows:
            if r["batch"] == batch and r["model"] == name:
                r["vs_stock"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--compile", action="store_true", help="include static cache + torch.compile on the CPU")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    device = args.device
    gpu = torch.device(device).type == "cuda"
    methods = (["stock"] + (["static+compile"] if gpu or args.compile else [])
               + ["patched", "arkernels", "arkernels+graphs"])
    rows = []
    if args.quick:  # CI: a tiny random Llama, seconds on the CPU
        batches = [1, 4]
        rows += bench_model("tiny-llama", tiny_llama(0).to(device), batches, 32, 16, device,
                            [m for m in methods if m != "static+compile"], 2)
    else:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 8, 32]
        model, _ = load_model(device=device, dtype=torch.bfloat16 if gpu else torch.float32)
        name = "SmolLM2-135M"
        if model is None:
            print("bench_decode: SmolLM2 package absent, using a tiny random Llama", file=sys.stderr)
            model, name = tiny_llama(0).to(device), "tiny-llama"
        rows += bench_model(name, model, batches, args.prompt, args.new_tokens, device, methods, args.repeats)
        del model
        if gpu:
            rows += bench_model("llama3-8b-shape", llama3_8b_shape(device), batches, args.prompt, args.new_tokens,
                                device, methods, args.repeats)
    write_results(rows, args.out, "bench_decode", plot=("batch", "tokens_per_s", "method"),
                  title="decode tokens/s")
    print_table(rows, ["model", "method", "batch", "tokens_per_s", "vs_stock", "step_ms", "gb_per_s", "match"])


if __name__ == "__main__":
    main()
