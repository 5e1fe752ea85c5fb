"""One rank of the tensor-parallel tests (tests/test_tp.py), and the cases both sides run.

``run_cases(model)`` is what tests/test_tp.py compares: the single-process model runs it inside pytest, every rank
of a ``from_pretrained(tp_plan="auto")`` model runs it here. Launched with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), by tests/test_tp.py or by hand:

    torchrun --nproc-per-node 2 tests/tp_worker.py SPEC.json OUT_DIR

SPEC.json: ``{"models": {family: folder}, "load": {family: "tp_plan" | "distributed_config"}, "device": "cpu" |
"cuda", "dtype": "float32" | "bfloat16", "cli": family or absent}``. Each rank
writes ``OUT_DIR/rank<r>.json``: per family the cases' results, the sharding it saw and what quantize did.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import sys

import torch

# model.generate: batch 2, row 0 left padded by 3, 11 positions > the tiny sliding window of 5
INPUT_IDS = [[0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
# arkernels.generate: ragged prompts, one longer than the window
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23, 24, 25]]
NEW_TOKENS = 12
BLOCK_SIZE = 4  # small blocks: sliding layers free blocks during these short runs
SAMPLE_SEED = 5  # torch.manual_seed before a sampled model.generate (the patched sampler seeds from it)
SEEDS = [11, 12, 13]  # arkernels.generate: one seed per prompt
CLI_PROMPTS = ["a", "b"]  # python -m arkernels generate --tp --prompt a --prompt b
GEN_TIMEOUT_S = 120  # a collective that waits longer than this fails the rank instead of hanging it


def _load_kwargs() -> dict:
    """The two spellings of "shard this model": ``tp_plan="auto"`` (5.24 warns it is deprecated, still takes it) and
    ``distributed_config=DistributedConfig(tp_plan="auto")`` (5.17 and 5.24)."""
    from transformers import DistributedConfig

    return {"tp_plan": {"tp_plan": "auto"},
            "distributed_config": {"distributed_config": DistributedConfig(tp_plan="auto")}}


def run_cases(model) -> dict:
    """Greedy and sampled tokens, stock and patched, through ``model.generate`` and ``arkernels.generate``; the
    KV heads of the patched run's cache pools (per rank under tensor parallelism)."""
    import arkernels

    device = next(model.parameters()).device
    ids = torch.tensor(INPUT_IDS, device=device)
    kw = dict(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=NEW_TOKENS, eos_token_id=None,
              pad_token_id=0)
    width = ids.shape[1]
    out = {"stock_greedy": model.generate(do_sample=False, **kw)[:, width:].tolist(),
           "stock_per_prompt": [model.generate(input_ids=torch.tensor([p], device=device), max_new_tokens=NEW_TOKENS,
                                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                                for p in PROMPTS]}
    with arkernels.patch(model, block_size=BLOCK_SIZE):
        res = model.generate(do_sample=False, return_dict_in_generate=True, **kw)
        out["patched_greedy"] = res.sequences[:, width:].tolist()
        cache = getattr(res, "cache", None) or res.past_key_values  # 5.24 renamed past_key_values
        out["cache"] = type(cache).__name__
        out["cache_kv_heads"] = sorted({layer.k_pool.shape[2] for layer in cache.layers})
        torch.manual_seed(SAMPLE_SEED)
        out["patched_sample"] = model.generate(do_sample=True, temperature=1.5, top_p=0.9, **kw)[:, width:].tolist()
    out["ours_greedy"] = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                            block_size=BLOCK_SIZE).tokens
    out["ours_sample"] = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                            temperature=1.3, top_p=0.95, seed=SEEDS, block_size=BLOCK_SIZE).tokens
    return out


def _sharding(model) -> dict:
    """What tensor parallelism did to the first layer's q_proj (column-parallel) and o_proj (row-parallel)."""
    attn = model.model.layers[0].self_attn
    res = {}
    for name in ("q_proj", "o_proj"):
        w = getattr(attn, name).weight
        local = w.to_local() if hasattr(w, "to_local") else w
        res[name] = {"type": type(w).__name__, "shape": list(w.shape), "local_shape": list(local.shape)}
    return res


def _quantize(model) -> dict:
    """``arkernels.quantize`` on the sharded model: what it raised, and whether it left the model untouched."""
    import arkernels
    from arkernels.quant import Int8Linear

    try:
        report = arkernels.quantize(model)
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        report, error = None, {"type": type(e).__name__, "message": str(e)}
    try:  # one row-parallel layer by hand
        Int8Linear.from_linear(model.model.layers[0].self_attn.o_proj)
        layer_error = None
    except Exception as e:  # noqa: BLE001
        layer_error = {"type": type(e).__name__, "message": str(e)}
    return {"error": error, "report": None if report is None else str(report), "layer_error": layer_error,
            "int8_layers": sum(isinstance(m, Int8Linear) for m in model.modules())}


def _cli(folder: str, dtype: str) -> str:
    """``python -m arkernels generate --tp`` on this rank (the process group is already up); its stdout."""
    from arkernels.__main__ import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["generate", "--tp", "--model", folder, "--dtype", dtype, "--max-new-tokens", str(NEW_TOKENS)]
                  + [arg for p in CLI_PROMPTS for arg in ("--prompt", p)])
    return f"rc={rc}\n{buf.getvalue()}"


def main(spec_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)  # 2 ranks on a 2-core CI machine
    backend = "nccl" if spec["device"] == "cuda" else "gloo"
    if spec["device"] == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # our own init (from_pretrained reuses it) for the timeout: a rank whose peer died fails instead of waiting 30 min
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=GEN_TIMEOUT_S))
    dtype = getattr(torch, spec["dtype"])
    load_kwargs = _load_kwargs()
    result = {}
    try:
        for family, folder in spec["models"].items():
            load = load_kwargs[spec["load"][family]]
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **load).eval()
            result[family] = {"tp_size": getattr(model, "tp_size", None), "sharding": _sharding(model),
                              "device": str(next(model.parameters()).device), **run_cases(model)}
            result[family]["quantize"] = _quantize(model)
        if spec.get("cli"):
            result["cli"] = _cli(spec["models"][spec["cli"]], spec["dtype"])
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
