"""Write the model-family table of docs/model-families.md: every causal-LM type the installed transformers ships,
built as a tiny random model (``arkernels.hf.tiny``), through ``arkernels.hf.capability.check_model``; with
``--verify`` (default), each accepted family also runs a left-padded greedy ``model.generate`` past its window stock
vs patched, and ``arkernels.generate`` vs stock, and is listed as "works" only when both give stock's tokens.

    PYTHONPATH=$PWD python scripts/families_table.py [--no-verify] [--write docs/model-families.md] [TYPE ...]

Prints the Markdown table, or with ``--write FILE`` replaces the block between that file's ``families-table`` markers;
one row per type: works / refused (the refusal's reason) /
not built (transformers' own error building a tiny model) / not run (transformers' own generate fails on it).
The full conformance test is tests/test_hf_families.py.
"""
from __future__ import annotations

import argparse
import re
import sys
import warnings

import torch


START, END = "<!-- families-table:start -->", "<!-- families-table:end -->"


def _reason(e: Exception) -> str:
    """The refusal's reason, without the caller's name and the closing advice."""
    msg = str(e).split(": ", 1)[-1]
    msg = msg.replace(". Keep this model on transformers' attention (do not patch it).", "")
    return re.sub(r"^\S+ \(model type '[^']*'\)(: | )", "", msg)


class _StockFails(Exception):
    pass


def _verify(model) -> str | None:
    """None when patched generate and arkernels.generate give stock's greedy tokens, else what differed."""
    import arkernels

    prompt = [(7 * i + 3) % 250 + 3 for i in range(19)]  # past the tiny window / chunk of 8
    ids = torch.tensor([[0, 0, 0] + prompt[:13], prompt[:16]])
    mask = (ids != 0).long()
    kw = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            stock = model.generate(input_ids=ids, attention_mask=mask, **kw)
            single = model.generate(input_ids=torch.tensor([prompt]), **kw)[0, len(prompt):].tolist()
        except Exception as e:  # noqa: BLE001  (transformers' own model fails: nothing to compare against)
            raise _StockFails(f"{type(e).__name__}: {' '.join(str(e).split())[:120]}") from e
        with arkernels.patch(model, block_size=4):
            ours = model.generate(input_ids=ids, attention_mask=mask, **kw)
        res = arkernels.generate(model, [prompt], max_new_tokens=4, eos_token_id=[], block_size=4)
    if not torch.equal(stock, ours):
        return "patched model.generate differs from stock"
    if res.tokens[0] != single:
        return "arkernels.generate differs from stock"
    return None


def survey(types: list[str], verify: bool = True) -> list[tuple[str, str, str]]:
    """``(model_type, status, detail)`` per type; status: works / refused / not built / not run / differs."""
    from arkernels.hf.capability import check_model
    from arkernels.hf.tiny import CannotBuild, build_family

    rows = []
    for t in types:
        try:
            model = build_family(t)
        except CannotBuild as e:
            rows.append((t, "not built", f"transformers: {e}"))
            continue
        name = type(model).__name__
        try:
            check_model(model)
        except NotImplementedError as e:
            rows.append((t, "refused", f"{name}: {_reason(e)}"))
            continue
        try:
            problem = _verify(model) if verify else None
        except _StockFails as e:
            rows.append((t, "not run", f"{name}: transformers' own generate fails on the tiny model: {e}"))
            continue
        rows.append((t, "differs" if problem else "works", f"{name}" + (f": {problem}" if problem else "")))
    return rows


def table(rows) -> str:
    import transformers

    counts = {s: sum(r[1] == s for r in rows) for s in ("works", "refused", "not built", "not run", "differs")}
    lines = [f"transformers {transformers.__version__}: {len(rows)} causal-LM model types; "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ".", "",
             "| model type | status | class / reason |", "|---|---|---|"]
    lines += [f"| `{t}` | {s} | {d.replace('|', '/')} |" for t, s, d in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import transformers

    from arkernels.hf.tiny import causal_lm_types

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    p.add_argument("--no-verify", action="store_true", help="detection only, no generate")
    p.add_argument("--write", "--readme", dest="write", metavar="FILE",
                   help="replace the table between this file's families-table markers (docs/model-families.md)")
    args = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    rows = survey(args.types or causal_lm_types(), verify=not args.no_verify)
    text = table(rows)
    if args.write:
        with open(args.write) as f:
            doc = f.read()
        start, end = doc.index(START) + len(START), doc.index(END)
        with open(args.write, "w") as f:
            f.write(doc[:start] + "\n" + text + doc[end:])
    else:
        sys.stdout.write(text)
    return 1 if any(r[1] == "differs" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
