"""End-to-end decode: tokens/s and achieved memory bandwidth of the ways to generate with one model.

Methods (greedy, the same prompts):
- ``stock``: transformers ``model.generate`` (sdpa, DynamicCache, eager): the baseline every ratio is against.
- ``static+compile``: ``cache_implementation="static"`` + ``compile_config`` (transformers' own compiled decode step;
  ``_compile_all_devices`` on the CPU).
- ``patched``: ``arkernels.patch(model)`` + the same ``model.generate``, the patch's default (``compile="auto"``: a
  fixed-shape paged cache, eager for the patched model's first ``COMPILE_AFTER`` (1024) decode steps on every device,
  then compiled). Timed in its steady state: one patch stays on a copy of the model across the method's calls, and
  its warm-up runs as many calls as the tier-up takes (``compile_s``: the compiling call's time minus the median).
- ``patched-eager``: a fresh ``arkernels.patch(model)`` per call: what the default runs before its tier-up (the
  fixed-shape cache, eager).
- ``patched+compile``: ``arkernels.patch(model, compile=True)`` + ``compile_config`` (``_compile_all_devices``): the
  decode forward compiled over the fixed-shape paged cache from the first call, CUDA graphs through the config's
  mode on a GPU.
- ``patched+host``: ``arkernels.patch(model, compile=False)``: the host-path paged cache (blocks reserved per step).
- ``arkernels``: ``arkernels.generate`` (eager decode steps).
- ``arkernels+graphs``: ``arkernels.generate(cuda_graphs=True)``: on a GPU each batch-size bucket's decode step is
  captured in a CUDA graph and replayed; on the CPU the same static step runs eagerly (its host overhead, no graphs).
- ``arkernels+compile``: ``arkernels.generate(compile=True)``: that static step under ``torch.compile`` (captured per
  bucket on a GPU).
Compiled methods compile on their first (warm-up) call: ``compile_s`` is that call's time minus the method's median
full-length time.

Named cases (``--case``): ``host-bound``: a tiny random Llama (4 layers, hidden 64, fp32 on the CPU), batch 1, a
16-token prompt, 48 new tokens: compute is negligible, so what is timed is the host's work per step, the regime of
batch-1 decoding on a GPU. ``--rules`` sets the generation rules of every call (``none``: no processor;
``min_new_tokens`` (default); ``repetition_penalty``; ``bad_words_ids``; ``all``: each in turn); ``--isolate`` runs each
(rules, method) pair in a process of its own, rounds of processes alternating, each process timing stock beside its
method (its ``vs_stock`` is that in-process ratio; ``vs_static`` compares two processes' ratios).

Methods are timed interleaved (A B C A B C ..., ``--repeats`` rounds) and each reports the median; ``vs_stock`` is
the ratio of the medians.

``--count``: no timing; per decode step, from a CPU profiler trace of one ``arkernels.generate`` call per way to run
the step (eager default, eager static, compiled static): ops launched per layer (leaf aten / arkernels ops and
Inductor kernels inside the step, divided by the layer count) and host-device syncs (``aten::_local_scalar_dense``
outside arkernels' own CPU kernels, which are host code on the CPU and one launch on a GPU, plus host reads of tensor
data: ``.tolist()`` / ``.numpy()``), per step over the whole loop.

Decode time = time(prompt + N new tokens) - time(prompt + 1 token); decode tokens/s = batch * (N - 1) / decode time.
Achieved bandwidth = (model bytes + KV bytes read per step at the mean context) / decode step time: the bytes a decode
step must read at least. Each method's greedy tokens are checked against stock before timing (``match`` column).

Models: SmolLM2-135M-Instruct on the CPU (tiny random Llama with ``--quick`` or without the model package); on a GPU
also a Llama-3-8B-shaped model with random bf16 weights (coded; not measured on this project's CPU machines).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.hf.patch import COMPILE_AFTER  # noqa: E402
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


METHODS = ["stock", "static+compile", "patched", "patched-eager", "patched+compile", "patched+host", "arkernels",
           "arkernels+graphs", "arkernels+compile"]
# minutes to compile on a 2-core CPU ("patched": the default's steady state on the CPU is compiled, after its tier-up)
COMPILED = ("static+compile", "patched", "patched+compile", "arkernels+compile")


def host_bound_model(device):
    """The ``host-bound`` case's model: a tiny random Llama with 4 layers (fp32 on the CPU; bf16 with head_dim 64 on a
    GPU, what the CUDA attention kernel takes)."""
    if torch.device(device).type == "cuda":
        return tiny_llama(0, dtype=torch.bfloat16, num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                          head_dim=64).to(device)
    return tiny_llama(0, num_hidden_layers=4).to(device)


def _compile_config():
    from transformers import CompileConfig

    config = CompileConfig()  # transformers' defaults (inductor, mode "reduce-overhead": CUDA graphs on a GPU)
    config._compile_all_devices = True  # generate compiles on accelerators only otherwise
    return config


# ``--rules``: the generation rules of every ``model.generate`` call (greedy): transformers' processors stock, whatever
# the patch makes of them patched. Each set keeps every call at full length (an EOS that can fire is masked).
RULES = {
    "none": lambda n: dict(eos_token_id=-1),  # no processor at all (an EOS id no token has: generate warns, runs)
    "min_new_tokens": lambda n: dict(min_new_tokens=n, eos_token_id=None),  # the model's EOS, masked n tokens
    "repetition_penalty": lambda n: dict(repetition_penalty=1.3, eos_token_id=-1),
    "bad_words_ids": lambda n: dict(bad_words_ids=[[5], [7]], eos_token_id=-1),
}


def _stock(model, ids, n, rules="min_new_tokens", **kw):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **RULES[rules](n), **kw)[:, ids.shape[1]:]


# the same rules as arkernels.generate's arguments (its EOS: the model's, for min_new_tokens; none otherwise)
OUR_RULES = {"none": lambda n: dict(eos_token_id=[]), "min_new_tokens": lambda n: dict(min_new_tokens=n),
             "repetition_penalty": lambda n: dict(repetition_penalty=1.3, eos_token_id=[]),
             "bad_words_ids": lambda n: dict(bad_words_ids=[[5], [7]], eos_token_id=[])}


def _ours(model, ids, n, rules="min_new_tokens", cuda_graphs=False, compile=False):
    return torch.tensor(arkernels.generate(model, ids, max_new_tokens=n, cuda_graphs=cuda_graphs, compile=compile,
                                           **OUR_RULES[rules](n)).tokens)


_CLOCK = time.perf_counter  # --clock cpu: time.process_time (see main)


def _time_once(fn, device):
    _sync(device)
    t0 = _CLOCK()
    fn()
    _sync(device)
    return _CLOCK() - t0


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def bench_model(name, model, batches, prompt_len, new_tokens, device, methods, repeats, rules="min_new_tokens"):
    cfg = model.config
    elem = next(model.parameters()).element_size()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    rows = []
    g = torch.Generator().manual_seed(0)
    twin, twin_steps = None, [0]  # the twin's decode steps so far (the tier counts them)
    if "patched" in methods:  # the default's tier counts steps over a patch's calls: one patch, kept on a copy
        twin = copy.deepcopy(model)
        twin_handle = arkernels.patch(twin)
    for batch in batches:
        ids = torch.randint(3, min(cfg.vocab_size, 30000), (batch, prompt_len), generator=g).to(device)
        fns = {}
        config = _compile_config()  # one object: transformers recompiles when the config changes
        for method in methods:
            if method == "stock":
                fns[method] = lambda n: _stock(model, ids, n, rules)  # noqa: E731
            elif method == "static+compile":
                fns[method] = lambda n: _stock(model, ids, n, rules, cache_implementation="static",  # noqa: E731
                                               compile_config=config)
            elif method == "patched":
                fns[method] = lambda n: _stock(twin, ids, n, rules)  # noqa: E731  (twin: patched for the whole run)
            elif method in ("patched-eager", "patched+host"):
                fns[method] = lambda n: _stock(model, ids, n, rules)  # noqa: E731  (runs inside the patch below)
            elif method == "patched+compile":
                fns[method] = lambda n: _stock(model, ids, n, rules, compile_config=config)  # noqa: E731
            elif method == "arkernels+graphs":
                fns[method] = lambda n: _ours(model, ids, n, rules, cuda_graphs=True)  # noqa: E731
            elif method == "arkernels+compile":
                fns[method] = lambda n: _ours(model, ids, n, rules, compile=True)  # noqa: E731
            else:
                fns[method] = lambda n: _ours(model, ids, n, rules)  # noqa: E731

        def run(method, n):
            handle = None
            if method.startswith("patched") and method != "patched":
                handle = arkernels.patch(model, compile={"patched+host": False, "patched+compile": True}.get(
                    method, "auto"))  # patched-eager: a fresh patch, below its tier
            try:
                return fns[method](n)
            finally:
                if handle is not None:
                    handle.undo()

        runs, first = {}, {}
        for m in methods:  # warm-up (and compile) + the check against stock
            calls = 1
            if m == "patched":  # up to and including the compiling call
                calls = 1 + max(-(-(COMPILE_AFTER - twin_steps[0]) // max(new_tokens - 1, 1)), 0)
            first[m] = max(_time_once(lambda: runs.__setitem__(m, run(m, new_tokens)), device) for _ in range(calls))
            if m == "patched":
                twin_steps[0] += calls * (new_tokens - 1)
        full, prefill = {m: [] for m in methods}, {m: [] for m in methods}
        for _ in range(repeats):  # interleaved: A B C A B C ..., so drifts of a shared machine hit every method
            for m in methods:
                full[m].append(_time_once(lambda: run(m, new_tokens), device))
                prefill[m].append(_time_once(lambda: run(m, 1), device))
        for method in methods:
            t_full, t_prefill = _median(full[method]), _median(prefill[method])
            step = max(t_full - t_prefill, 1e-9) / max(new_tokens - 1, 1)
            ctx = prompt_len + new_tokens / 2
            gbs = (model_bytes + batch * ctx * kv_per_token) / step / 1e9
            rows.append(dict(model=name, device=device_name(device), method=method, rules=rules, batch=batch,
                             prompt=prompt_len,
                             new_tokens=new_tokens, repeats=repeats, tokens_per_s=batch / step, step_ms=step * 1e3,
                             gb_per_s=gbs, prefill_s=t_prefill, compile_s=max(first[method] - t_full, 0.0),
                             match=bool(torch.equal(runs[method].cpu(), runs["stock"].cpu()))))
        base = next(r for r in rows if r["batch"] == batch and r["method"] == "stock" and r["model"] == name)
        twin_steps[0] += repeats * (new_tokens - 1)  # (the prefill-only runs decode nothing)
        for r in rows:
            if r["batch"] == batch and r["model"] == name:
                r["vs_stock"] = r["tokens_per_s"] / base["tokens_per_s"]  # the ratio of the median step times
        static = next((r for r in rows if r["batch"] == batch and r["method"] == "static+compile"
                       and r["model"] == name), None)
        for r in rows:
            if r["batch"] == batch and r["model"] == name:
                r["clock"] = "cpu" if _CLOCK is time.process_time else "wall"
            if r["batch"] == batch and r["model"] == name and static is not None:
                r["vs_static"] = r["tokens_per_s"] / static["tokens_per_s"]
    if twin is not None:
        twin_handle.undo()
    return rows


# leaf ops that only make views or allocate: no kernel on a GPU
_NO_KERNEL = {f"aten::{n}" for n in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "t", "permute", "slice", "select", "as_strided",
    "unsqueeze", "squeeze", "expand", "alias", "detach", "narrow", "split", "chunk", "unflatten", "contiguous",
    "empty", "empty_strided", "empty_like", "resolve_conj", "resolve_neg", "lift_fresh", "view_as", "unbind")}


def _leaf_ops(events, outer, kernels_only=False) -> int:
    """Ops inside ``outer`` that launch work themselves: aten / arkernels ops with no such op under them, and
    Inductor's kernels (recorded with ``cpp.enable_kernel_profile``); ``kernels_only``: without views and
    allocations (``_NO_KERNEL``)."""
    def counted(e):
        return e.name.startswith(("aten::", "arkernels::")) or "cpp_fused" in e.name or "triton_" in e.name

    inside = [e for e in events if counted(e) and outer.time_range.start <= e.time_range.start
              and e.time_range.end <= outer.time_range.end]
    parents = set()
    for e in inside:
        p = e.cpu_parent
        while p is not None and p is not outer:
            parents.add(id(p))
            p = p.cpu_parent
    return sum(1 for e in inside if id(e) not in parents and not (kernels_only and e.name in _NO_KERNEL))


def count_step(model, name, batch, prompt_len, new_tokens):
    """Ops per layer per decode step and host-device syncs per step, from CPU profiler traces (see ``--count``)."""
    import contextlib
    import functools

    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile, record_function

    gen = sys.modules["arkernels.generate"]
    layers = model.config.get_text_config().num_hidden_layers
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(model.config.vocab_size, 30000), (batch, prompt_len), generator=g)

    def marked(label, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return wrapper

    @contextlib.contextmanager
    def patched(obj, attr, value):
        own = attr in obj.__dict__
        old = obj.__dict__.get(attr)
        setattr(obj, attr, value)
        try:
            yield
        finally:
            if own:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)

    rows = []
    for method, kw in (("arkernels", {}), ("arkernels+graphs", dict(cuda_graphs=True)),
                       ("arkernels+compile", dict(compile=True))):
        inductor_config.cpp.enable_kernel_profile = bool(kw.get("compile"))
        try:
            arkernels.generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], **kw)  # warm-up / compile
            with contextlib.ExitStack() as stack:
                stack.enter_context(patched(torch.Tensor, "tolist", marked("host_read", torch.Tensor.tolist)))
                stack.enter_context(patched(torch.Tensor, "numpy", marked("host_read", torch.Tensor.numpy)))
                stack.enter_context(patched(gen._DecodeStep, "step", marked("decode_step", gen._DecodeStep.step)))
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    arkernels.generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], **kw)
        finally:
            inductor_config.cpp.enable_kernel_profile = False
            torch._dynamo.reset()
        events = sorted(prof.events(), key=lambda e: e.time_range.start)
        steps = [e for e in events if e.name == "decode_step"]
        loop = (steps[0].time_range.start, events[-1].time_range.end)
        in_loop = [e for e in events if loop[0] <= e.time_range.start <= loop[1]]

        def in_arkernels_op(e):
            while e.cpu_parent is not None:
                e = e.cpu_parent
                if e.name.startswith("arkernels::"):
                    return True
            return False

        scalar = [e for e in in_loop if e.name == "aten::_local_scalar_dense" and not in_arkernels_op(e)]
        reads = [e for e in in_loop if e.name == "host_read"]
        ops = [_leaf_ops(events, s) for s in steps]
        kernels = [_leaf_ops(events, s, kernels_only=True) for s in steps]
        forwards = len(steps) + 1  # the prefill's ids are read in the loop too: one read per forward
        step_scalar = sum(1 for e in scalar if any(s.time_range.start <= e.time_range.start <= s.time_range.end
                                                   for s in steps))
        rows.append(dict(model=name, method=method, batch=batch, layers=layers, steps=len(steps),
                         ops_per_step=_median(ops), ops_per_layer=_median(ops) / layers,
                         kernels_per_layer=_median(kernels) / layers,
                         syncs_per_step=(len(scalar) + len(reads)) / forwards,
                         scalar_syncs_per_step=len(scalar) / forwards, host_reads_per_step=len(reads) / forwards,
                         scalar_syncs_inside_step=step_scalar))
    return rows
def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--compile", action="store_true", help="include the compiled methods on the CPU")
    p.add_argument("--case", default=None, choices=["host-bound"],
                   help="host-bound: tiny 4-layer Llama, batch 1 (--batches to change), 16-token prompt, 48 new tokens, "
                        "every method (compiled ones included)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="interleaved timing rounds (medians reported)")
    p.add_argument("--methods", default=None, help="comma-separated subset of methods to time (stock always runs)")
    p.add_argument("--rules", default="min_new_tokens",
                   help=f"comma-separated generation rules of every call ({', '.join(RULES)}) or 'all'")
    p.add_argument("--isolate", action="store_true",
                   help="host-bound: each (rules, method) pair in a process of its own, --repeats rounds of processes "
                        "alternating (several compiled variants of one forward in one process hit dynamo's "
                        "recompile limit); the median over processes of each one's median")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one --isolate process
    p.add_argument("--count", action="store_true", help="ops per layer and host-device syncs per decode step "
                                                        "(CPU profiler; no timing)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: this process's CPU time (time.process_time) instead of wall time: on a shared, "
                        "oversubscribed CPU machine it counts only the work the host does for the decode (use with "
                        "--threads 1, where no idle worker thread spins); a GPU needs wall time")
    args = p.parse_args()
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.device(device).type == "cuda":
            p.error("--clock cpu measures host work only: time a GPU with the wall clock")
        global _CLOCK
        _CLOCK = time.process_time
    gpu = torch.device(device).type == "cuda"
    methods = [m for m in METHODS if gpu or args.compile or args.case or m not in COMPILED]
    if args.methods:
        methods = ["stock"] + [m for m in args.methods.split(",") if m != "stock"]
    if args.count:
        if gpu:
            p.error("--count profiles on the CPU (--device cpu); on a GPU see gpu_check.sh's sync count")
        model, name = None, "SmolLM2-135M"
        if not args.quick:
            model, _ = load_model(device="cpu", dtype=torch.float32)
        if model is None:
            model, name = tiny_llama(0), "tiny-llama"
        batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 8]
        rows = [r for b in batches for r in count_step(model, name, b, min(args.prompt, 64), min(args.new_tokens, 8))]
        write_results(rows, args.out, "bench_decode_count")
        print_table(rows, ["model", "method", "batch", "ops_per_layer", "kernels_per_layer", "ops_per_step",
                           "syncs_per_step",
                           "scalar_syncs_per_step", "host_reads_per_step"])
        return
    rules = list(RULES) if args.rules == "all" else args.rules.split(",")
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        p.error(f"--rules: unknown {unknown}; choose from {list(RULES)} or 'all'")
    rows = []
    if args.case == "host-bound" and args.isolate and not args.worker:
        rows = isolated(sys.argv[1:], methods, rules, max(args.repeats, 3))
    elif args.case == "host-bound":
        batches = [int(b) for b in args.batches.split(",")] if args.batches else [1]
        for r in rules:
            rows += bench_model("tiny-llama-4l", host_bound_model(device), batches, 16, 48, device, methods,
                                max(args.repeats, 5) if not args.worker else args.repeats, rules=r)
        if args.worker:
            print(json.dumps(rows))
            return
    elif args.quick:  # CI: a tiny random Llama, seconds on the CPU
        batches = [1, 4]
        rows += bench_model("tiny-llama", tiny_llama(0).to(device), batches, 32, 16, device,
                            [m for m in methods if m not in COMPILED or args.compile], 2)
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
    print_table(rows, ["model", "method", "rules", "batch", "tokens_per_s", "vs_stock", "vs_static", "step_ms",
                       "compile_s", "match"] + (["processes"] if args.isolate else []))


def isolated(argv, methods, rules, rounds):
    """``--isolate``: every (rules, method) pair of the host-bound case timed in a process of its own (this script
    with ``--worker``: stock alongside, for its ``match`` and ratio; stock's row gathers every process's stock),
    ``rounds`` rounds of such processes, the pairs alternating within each round. A row per pair: ``step_ms``, the median over its processes of each process's median step;
    ``vs_stock``, the median over its processes of the ratio to the stock method timed interleaved in the same
    process (on a shared machine the drift between processes is larger than the gaps between methods: each process
    is its own control); ``vs_static``, this row's ``vs_stock`` over the ``static+compile`` row's."""
    base = [a for a in argv if a not in ("--isolate",)]
    drop = {"--methods", "--rules", "--repeats", "--out"}
    base = [a for i, a in enumerate(base) if a not in drop and (i == 0 or base[i - 1] not in drop)]
    steps, keep = {}, {}
    for k in range(rounds):
        for r in rules:
            for m in [m for m in methods if m != "stock"] or ["stock"]:  # every process times stock beside its method
                cmd = [sys.executable, os.path.abspath(__file__), *base, "--worker", "--methods", m, "--rules", r,
                       "--repeats", "3", "--out", os.path.join("bench_out", "isolated")]
                print(f"[bench_decode] round {k + 1}/{rounds}: {r} / {m}", file=sys.stderr, flush=True)
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    raise RuntimeError(f"bench_decode worker {r} / {m} failed:\n{run.stderr[-3000:]}")
                for row in json.loads(run.stdout.strip().splitlines()[-1]):
                    if row["method"] in (m, "stock"):
                        key = (r, row["method"], row["batch"])
                        steps.setdefault(key, []).append((row["step_ms"], row["vs_stock"]))
                        keep[key] = row
    rows = []
    for (r, m, b), xs in steps.items():
        step = _median([x[0] for x in xs])
        row = dict(keep[(r, m, b)], step_ms=step, tokens_per_s=b / (step / 1e3), processes=len(xs), repeats=3,
                   vs_stock=_median([x[1] for x in xs]))
        row.pop("vs_static", None)
        rows.append(row)
    for row in rows:
        static = [x for x in rows if x["rules"] == row["rules"] and x["batch"] == row["batch"]
                  and x["method"] == "static+compile"]
        if static:
            row["vs_static"] = row["vs_stock"] / static[0]["vs_stock"]
    return rows


if __name__ == "__main__":
    main()
