#!/usr/bin/env python3
"""Fuzz the hand-written CUDA ops' integer arguments under the SIMT emulator built with ASan + UBSan.

Every op is called with ``check=False`` (the kernels must be memory-safe whatever the indices; the checks only give
good messages) on small random shapes, with the integer arguments drawn from typical values and from a dictionary
of hostile ones (0, +-1, the int32 / int64 extremes, values just past the cache, the table or the rows):
block tables, seq_lens, kv_start, cu_seqlens_q, max_q_len, window, chunk_size, max_seq_len, slot_mapping. A finding
is

- a sanitizer report (ASan: a read or write outside an allocation; UBSan: signed overflow, a bad shift, ...):
  it ends the worker process, which is restarted after the case;
- an emulator report (a global access straddling a buffer's edge, a divergent barrier, ...);
- NaN in an output (the inputs are finite, and the emulator poisons what it allocates: an unwritten row);
- a write into the guard bytes around the caches (inside their allocation, so ASan cannot see it);
- a case that makes no progress for --case-timeout seconds (e.g. a loop over 2^31 keys);
- an exception other than a refusal naming the op (RuntimeError/ValueError "<op>: ...").

Seeded and time-bounded; the summary says how many inputs were tried in how many minutes and lists each finding
with the command that replays it:

    python scripts/simt_fuzz.py --minutes 2.5                 # CI (scripts/simt_check.sh)
    python scripts/simt_fuzz.py --minutes 60 --seed 7         # by hand
    python scripts/simt_fuzz.py --seed 0 --case 123 -v        # replay one case

The library is ARKERNELS_SIMT_LIB, else build/simt-address (built if missing: ``python -m arkernels.simt build
--sanitize address``). Exit status 1 when anything was found.
"""
from __future__ import annotations

import argparse
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
I32_MIN, I32_MAX = -2 ** 31, 2 ** 31 - 1
I64_MIN, I64_MAX = -2 ** 63, 2 ** 63 - 1
OPS = ("append", "gather", "decode", "prefill")


# ------------------------------------------------------------------------------------------------ case generation
def _hostile(rng: random.Random, near: list[int], wide: bool = False) -> int:
    """A hostile integer: an int32 (or int64 when `wide`) extreme, a small signed value, or one next to a size."""
    # the int32 extremes thrice: the values whose arithmetic overflows (len - q_len at INT32_MIN, i - window + 1 at
    # INT32_MAX) are the ones a fuzzer must not take minutes to draw
    pool = [0, 1, -1, 2, -2, I32_MIN + 1, I32_MAX - 1, 2 ** 16, -2 ** 16, 2 ** 30, -2 ** 30] + [I32_MIN, I32_MAX] * 3
    if wide:
        pool += [I64_MIN, I64_MAX, 2 ** 31, 2 ** 32, 2 ** 32 + 1, -2 ** 32, 2 ** 40]
    for n in near:
        pool += [n - 1, n, n + 1, 2 * n, -n]
    v = rng.choice(pool)
    lim = (I64_MIN, I64_MAX) if wide else (I32_MIN, I32_MAX)
    return min(max(v, lim[0]), lim[1])


def _int(rng: random.Random, lo: int, hi: int, near: list[int], p_hostile: float = 0.3, wide: bool = False) -> int:
    return _hostile(rng, near, wide) if rng.random() < p_hostile else rng.randint(lo, hi)


def _corpus() -> list[dict]:
    """The review's hostile inputs (issue 27), run first by every fuzz run whatever the seed: a random draw need not
    hit the exact combination (prefill with seq_len INT32_MIN and two queries walked ~33.5M key tiles past the block
    table before the fix)."""
    base = dict(block_size=16, num_blocks=4, hq=4, hkv=2, batch=2, dtype="float16", fp8=False,
                table=[[0, 1, 2], [3, 0, 1]], seq_lens=[40, 9], window=0, kv_start=None, softcap=0.0, chunk=0)
    pre = dict(base, op="prefill", cu=[0, 5, 7], rows=7, max_q_len=None)
    dec = dict(base, op="decode")
    return [
        dict(pre, seq_lens=[I32_MIN, 9], cu=[0, 2, 4], rows=4),
        dict(pre, seq_lens=[I32_MIN, I32_MIN], cu=[0, 2, 4], rows=4, window=I32_MAX, chunk=I32_MAX),
        dict(pre, cu=[0, 4, 4], rows=8),
        dict(pre, cu=[-2 ** 30, 4, 8], rows=8),
        dict(pre, kv_start=[I32_MAX, 0]), dict(pre, kv_start=[0, -1]), dict(pre, kv_start=[I32_MIN, 50]),
        dict(dec, kv_start=[50, 0]), dict(dec, kv_start=[-3, I32_MIN]), dict(dec, kv_start=[I32_MAX, 9]),
        dict(pre, max_q_len=2 ** 40), dict(pre, max_q_len=2 ** 62), dict(pre, max_q_len=I64_MAX),
        dict(dec, seq_lens=[I32_MAX, I32_MIN]), dict(dec, seq_lens=[48, 9], table=[[0, 1, -7], [I32_MAX, 0, 1]]),
        dict(base, op="gather", max_seq_len=8), dict(base, op="gather", seq_lens=[I32_MIN, 9], max_seq_len=48),
        dict(base, op="append", tokens=3, slots=[64, -1, 2 ** 40], slot_dtype="int64"),
        dict(base, op="append", tokens=2, slots=[I32_MAX, I32_MIN], slot_dtype="int32"),
    ]


CORPUS = _corpus()


def make_case(seed: int, index: int) -> dict:
    """The index-th case of a seed: plain Python values only (printed to replay it). The first len(CORPUS) indices
    are the fixed hostile corpus."""
    if index < len(CORPUS):
        return dict(CORPUS[index])
    rng = random.Random(seed * 1_000_003 + index)
    op = OPS[rng.randrange(len(OPS))]
    block_size = rng.choice([1, 4, 13, 16])
    num_blocks = rng.randint(1, 6)
    hq, hkv = rng.choice([(2, 1), (4, 2), (3, 3)])
    batch = rng.randint(1, 3)
    width = rng.randint(1, 4)  # block-table columns
    cap = width * block_size
    c = dict(op=op, block_size=block_size, num_blocks=num_blocks, hq=hq, hkv=hkv, batch=batch,
             dtype=rng.choice(["float16", "bfloat16"]), fp8=rng.random() < 0.15)
    c["table"] = [[_int(rng, -1, num_blocks - 1, [num_blocks], 0.2) for _ in range(width)] for _ in range(batch)]
    c["seq_lens"] = [_int(rng, 0, cap, [cap, block_size]) for _ in range(batch)]
    if op == "append":
        tokens = rng.randint(1, 6)
        c["tokens"] = tokens
        c["slots"] = [_int(rng, -1, num_blocks * block_size - 1, [num_blocks * block_size], 0.4, wide=True)
                      for _ in range(rng.randint(0, tokens))]
        c["slot_dtype"] = rng.choice(["int32", "int64"])
        if c["slot_dtype"] == "int32":
            c["slots"] = [min(max(s, I32_MIN), I32_MAX) for s in c["slots"]]
    elif op == "gather":
        c["max_seq_len"] = _int(rng, 0, cap, [cap], 0.3)
    else:
        c["window"] = rng.choice([0, 0, 1, 3, 17, I32_MAX, _int(rng, 0, 40, [cap], 0.5)])
        c["kv_start"] = None if rng.random() < 0.4 else [_int(rng, 0, cap, [cap], 0.4) for _ in range(batch)]
        c["softcap"] = rng.choice([0.0, 0.0, 5.0])
        c["chunk"] = rng.choice([0, 0, 0, 1, 5, 16, I32_MAX, _int(rng, 0, 40, [cap], 0.5)])
    if op == "prefill":
        q = [rng.randint(0, 5) for _ in range(batch)]
        cu = [0]
        for n in q:
            cu.append(cu[-1] + n)
        rows = cu[-1] + rng.choice([0, 0, 0, 3])  # sometimes rows no sequence owns
        c["cu"] = [(_hostile(rng, [rows, x]) if rng.random() < 0.15 else x) for x in cu]
        c["rows"] = max(rows, 1)
        c["max_q_len"] = None if rng.random() < 0.5 else _int(rng, 0, 8, [c["rows"]], 0.4, wide=True)
    return c


# ------------------------------------------------------------------------------------------------ running a case
class Finding(Exception):
    pass


def run_case(c: dict) -> None:
    """Runs one case under the emulator; raises Finding for anything but a clean run or a named refusal."""
    import torch

    import arkernels.simt
    from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather
    from arkernels.ops.window_attention import window_attention

    gen = torch.Generator().manual_seed(len(str(c)))
    dtype = getattr(torch, c["dtype"])
    bs, nb, hkv, d = c["block_size"], c["num_blocks"], c["hkv"], 64
    cache_dtype = torch.float8_e4m3fn if c["fp8"] else dtype
    guard = 1  # guard blocks on both sides of each cache, inside its allocation
    store = [torch.randn(nb + 2 * guard, bs, hkv, d, generator=gen).to(cache_dtype) for _ in range(2)]
    before = [s.clone() for s in store]
    k_cache, v_cache = (s[guard:guard + nb] for s in store)
    scales = {}
    if c["fp8"]:
        scales = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([0.25]))
    table = torch.tensor(c["table"], dtype=torch.int32)
    lens = torch.tensor(c["seq_lens"], dtype=torch.int32)
    outs = []
    try:
        with arkernels.simt.emulate():
            if c["op"] == "append":
                key = torch.randn(c["tokens"], hkv, d, generator=gen).to(dtype)
                slots = torch.tensor(c["slots"], dtype=getattr(torch, c["slot_dtype"]))
                paged_kv_append(key, key, k_cache, v_cache, slots, check=False, **scales)
            elif c["op"] == "gather":
                outs = list(paged_kv_gather(k_cache, v_cache, table, lens, c["max_seq_len"], check=False))
            else:
                prefill = c["op"] == "prefill"
                rows = c["rows"] if prefill else c["batch"]
                query = torch.randn(rows, c["hq"], d, generator=gen).to(dtype)
                kw = dict(window=c["window"], softcap=c["softcap"], chunk_size=c["chunk"], return_lse=True,
                          check=False, **scales)
                if c["kv_start"] is not None:
                    kw["kv_start"] = torch.tensor(c["kv_start"], dtype=torch.int32)
                if prefill:
                    kw["cu_seqlens_q"] = torch.tensor(c["cu"], dtype=torch.int32)
                    kw["max_q_len"] = c["max_q_len"]
                outs = list(window_attention(query, k_cache, v_cache, table, lens, **kw))
    except (RuntimeError, ValueError) as e:
        msg = str(e)
        if "(SIMT emulator)" in msg and "report(s)" in msg:
            raise Finding("emulator report: " + msg.strip().splitlines()[-1][:300]) from None
        names = ("paged_kv_append", "paged_kv_gather", "window_attention")
        if any(msg.startswith(n + ":") or f"{n} (SIMT emulator)" in msg for n in names):
            return  # refused, naming the op
        raise Finding(f"unexpected {type(e).__name__}: {msg[:300]}") from None
    except Exception as e:  # noqa: BLE001 (any other exception is a finding)
        raise Finding(f"unexpected {type(e).__name__}: {str(e)[:300]}") from None
    for i, o in enumerate(outs):
        if o.is_floating_point() and bool(torch.isnan(o.float()).any()):
            raise Finding(f"NaN in output {i} (an element never written: outputs start poisoned)")
    for s, b in zip(store, before):
        for side in (slice(0, guard), slice(guard + nb, None)):
            if not torch.equal(s[side].view(torch.uint8), b[side].view(torch.uint8)):
                raise Finding("a write into the guard blocks around a cache (outside the cache view)")


# ------------------------------------------------------------------------------------------------ worker / driver
def worker(seed: int, start: int, deadline: float, only: str | None, count: int | None) -> int:
    sys.path.insert(0, REPO)
    import torch

    torch.set_num_threads(1)
    i = start
    while time.time() < deadline and (count is None or i < start + count):
        c = make_case(seed, i)
        if only and c["op"] != only:
            i += 1
            continue
        print(f"CASE {i} {c}", flush=True)
        try:
            run_case(c)
            print(f"OK {i}", flush=True)
        except Finding as f:
            print(f"FINDING {i} {f}", flush=True)
        i += 1
    print(f"DONE {i}", flush=True)
    return 0


def _gcc_file(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()


def _library() -> str:
    lib = os.environ.get("ARKERNELS_SIMT_LIB") or os.path.join(REPO, "build", "simt-address", "arkernels_simt.so")
    if not os.path.exists(lib):
        subprocess.run([sys.executable, "-m", "arkernels.simt", "build", "--sanitize", "address"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO), check=True)
    return lib


def _sanitizer_env(lib: str) -> dict:
    env = dict(os.environ)
    env.update(
        ARKERNELS_SIMT_LIB=lib, ARKERNELS_SIMT_REQUIRED="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1", TRITON_INTERPRET="1",
        # libstdc++ up front: ASan's __cxa_throw interceptor needs it (python does not link it)
        LD_PRELOAD=f"{_gcc_file('libasan.so')} {_gcc_file('libstdc++.so')}",
        ASAN_OPTIONS="detect_leaks=0 halt_on_error=1 allocator_may_return_null=1",
        UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1",
        SIMT_WATCHDOG="30")
    return env


def _report_line(text: str) -> str:
    for line in text.splitlines():
        if "runtime error:" in line or "ERROR: AddressSanitizer" in line or "[simt]" in line:
            return line.strip()[:300]
    lines = [x for x in text.splitlines() if x.strip()]
    return (lines[-1].strip() if lines else "no output")[:300]


def _tail(f, n: int = 20000) -> str:
    f.flush()
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - n))
    return f.read().decode(errors="replace")


def drive(args) -> int:
    env = _sanitizer_env(_library())
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    tried, findings, nxt = 0, [], args.start
    while time.time() < deadline - 5:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(args.seed), "--start", str(nxt),
               "--deadline", str(deadline)] + (["--op", args.op] if args.op else [])
        errf = tempfile.TemporaryFile()  # a file, not a pipe: a worker's stderr can outgrow a pipe's buffer
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=errf, text=True)
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        current, last_progress, hung, last = None, time.time(), False, nxt - 1
        while True:
            if sel.select(timeout=1.0):
                line = p.stdout.readline()
                if not line:
                    break
                last_progress = time.time()
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind == "CASE":
                    current = rest
                    if args.v:
                        print(line, end="")
                elif kind == "OK":
                    tried += 1
                    current = None
                    last = int(rest)
                elif kind == "FINDING":
                    tried += 1
                    idx, _, what = rest.partition(" ")
                    last = int(idx)
                    findings.append((int(idx), what, current))
                    print(f"[simt_fuzz] finding at case {idx}: {what}\n    {current}", flush=True)
                    current = None
                elif kind == "DONE":
                    nxt = int(rest)
            elif time.time() - last_progress > args.case_timeout:
                hung = True
                p.kill()
                break
        p.wait()
        err = _tail(errf)
        errf.close()
        if current is None:
            if p.returncode == 0:
                break  # deadline reached
            # died between cases (killed from outside, e.g. by the OOM killer): say so, go on after the last case
            print(f"[simt_fuzz] the worker died between cases (exit {p.returncode}) after case {last}: "
                  f"{_report_line(err)}", flush=True)
            nxt = last + 1
            continue
        idx = int(current.split(" ", 1)[0])
        tried += 1
        what = (f"no progress for {args.case_timeout} s" if hung else
                f"process died (exit {p.returncode}): {_report_line(err)}")
        findings.append((idx, what, current))
        print(f"[simt_fuzz] finding at case {idx}: {what}\n    {current}", flush=True)
        if args.v:
            print(err[-4000:])
        nxt = idx + 1
    minutes = (time.time() - t0) / 60
    for idx, what, case in findings:
        print(f"  case {idx}: {what}\n    replay: python scripts/simt_fuzz.py --seed {args.seed} --case {idx}")
    print(f"[simt_fuzz] seed {args.seed}: {tried} inputs tried in {minutes:.1f} min, {len(findings)} findings")
    return 1 if findings else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--case", type=int, default=None, help="replay this case alone (under the sanitizers) and "
                    "print everything it printed")
    ap.add_argument("--op", choices=OPS, default=None, help="only cases of this op")
    ap.add_argument("--case-timeout", type=float, default=60.0)
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.seed, args.start, args.deadline, args.op, args.count)
    if args.case is not None:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(args.seed), "--start",
               str(args.case), "--count", "1", "--deadline", str(time.time() + 3600)]
        p = subprocess.run(cmd, cwd=REPO, env=_sanitizer_env(_library()), text=True, capture_output=True)
        print(p.stdout + p.stderr[-8000:])
        return 0 if p.returncode == 0 and "FINDING" not in p.stdout else 1
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
