#!/usr/bin/env python3
"""SASS report of the built CUDA kernels: resources, occupancy, design-revealing instructions; fails on local memory.

    python scripts/sass_report.py [--so PATH] [--arch sm_90] [--json OUT]

Reads only the built extension (arkernels/_C*.so), never the sources, so it does not care how csrc/ is laid out.
Per kernel and per cubin arch it prints registers, stack frame / local memory bytes, static and dynamic shared
memory, theoretical occupancy on that arch's reference GPU (sm_80: A100, sm_90: H100/H200), and static counts of
the SASS instructions that show the design:
  LDG128  128-bit global loads (LDG.E.128[.CONSTANT]): 16-byte vector loads
  LDGSTS  cp.async (global -> shared without registers)      LDSM   ldmatrix
  HMMA    mma.sync / WMMA tensor-core instructions             HGMMA  Hopper wgmma
  SHFL    warp shuffles                                        BAR    barriers (__syncthreads, named barriers)
  STL/LDL local memory stores/loads: register spills or local arrays. Any of them, or a nonzero frame, fails.
  TAIL    decode kernels: the split-KV combine issues its partial loads before it uses any (combine_order): "ok" or
          "BAD" (fails), "-" for other kernels.
  PDL     programmatic dependent launch (csrc/pdl.cuh, pdl_order): "W/T ok" in sm_90+ cubins where the kernel has W
          griddepcontrol.wait (ACQBULK) and T launch_dependents (PREEXIT), W, T >= 1, and no global (or generic)
          memory access above its first wait in the code; "-" in older cubins, which must have neither; else "BAD"
          (fails: every kernel here is launched with PDL on sm_90).
  FENCE   decode kernels: where their device-scope fences run (fence_scope): "1T xN" (N MEMBAR, each behind a
          branch some threads take, none MEMBAR.SC: one thread's release / acquire), "SC" or "ALL" (fails: a
          MEMBAR.SC, or a MEMBAR every thread reaching it runs), "-" none or other kernels; " CBR x1": the sm_90
          cluster combine's one cluster-barrier release (MEMBAR.ALL.GPU before UCGABAR_ARV), counted apart; "CBR"
          (fails): more than one.
Then, per prefill kernel, the key loop's dynamic SASS per warp and key tile (tile_paths): the unmasked tile, the same
with the O rescale, and a masked tile.
Exit status: 0 clean, 1 some kernel uses local memory, a decode combine waits before issuing its loads, a decode
kernel runs a MEMBAR.SC or a fence every thread executes, or a kernel's PDL column is BAD (listed), 2 the tools or the
cubins are missing.

Tools: cuobjdump and nvdisasm from $CUOBJDUMP (its folder must hold nvdisasm too), else Triton's wheel
(triton/backends/nvidia/bin: the CUDA toolkit on our machines lacks both), else PATH / $CUDA_HOME/bin.
Cost: about 3 s per arch on one core (cuobjdump -sass of the 2-arch .so is ~100k lines per arch).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------- GPU specs
# Per-SM limits used for theoretical occupancy (CUDA programming guide, "compute capabilities" table, and the
# occupancy calculator's constants). smem_sm: shared memory per SM at the largest carveout, the 1 KB per-CTA
# reservation included; smem_block: per-block opt-in limit (what cudaFuncAttributeMaxDynamicSharedMemorySize admits).
GPU_SPECS = {
    "sm_80": dict(gpu="A100", regs=65536, reg_unit=256, sub_partitions=4, max_warps=64, max_ctas=32,
                  smem_sm=164 * 1024, smem_block=163 * 1024, smem_unit=128, reserved=1024),
    "sm_90": dict(gpu="H100/H200", regs=65536, reg_unit=256, sub_partitions=4, max_warps=64, max_ctas=32,
                  smem_sm=228 * 1024, smem_block=227 * 1024, smem_unit=128, reserved=1024),
}

# ------------------------------------------------------------------------------------ launch facts not in the cubin
# Threads per CTA when the kernel carries no __launch_bounds__ (no EIATTR_MAX_THREADS in its ELF info): the first
# prefix of the kernel's short name that matches. Keep in step with each launcher's block size.
FALLBACK_THREADS = [
    ("paged_kv_", 256),          # kThreads in the paged_kv launcher
    ("window_attention_", 128),  # kAttnThreads (every kernel also declares __launch_bounds__: prefill 128)
]


def prefill_smem(d: int, bn: int, stages: int, fp8: bool = False) -> int:
    """prefill_smem(d, bn, stages, fp8) of window_attention_prefill.cuh: the prefill CTA's dynamic shared memory, bytes.

    A Q tile of 128 packed rows (64 for head_dim 256) of head_dim + 8 halves (16 bytes of padding: conflict-free
    ldmatrix) and a ring of `stages` (K, V) tiles of `bn` keys as stored: 16-bit rows padded like Q (the K row's
    padding holds the key's valid flag). fp8: the 16-bit copy of the current K and V tiles (2 * bn rows of head_dim +
    8, converted once per CTA) after the Q tile; ring rows of head_dim bytes, then one valid-flag byte per key and
    stage.
    """
    rows, ld = (128 if d <= 128 else 64), d + 8
    if fp8:
        return (rows + 2 * bn) * ld * 2 + stages * bn * (2 * d + 1)
    return (rows + stages * 2 * bn) * ld * 2


def decode_smem(d: int, fp8: bool, spec: dict) -> int:
    """Dynamic shared memory of a decode CTA as planned on the GPU of GPU_SPECS entry `spec` (window_attention
    decode_layout + decode_stages): `stages` K/V pairs of 64-key tiles as stored (16-bit rows padded to d + 8
    elements, fp8 rows to d + 16 bytes), the 16-row query tile, 8-byte K offsets per stage and V offsets for
    max(stages - 1, 1) tiles, at least the warps' merge buffer (rows of d + 8 fp32); the most stages (<= 4) that keep
    2 CTAs per SM, else the most that fit one CTA. sm_90: D=64 4 stages, 77.8 KB; D=128 3 stages, 108.8 KB; D=256 3
    stages (1 CTA), 208.8 KB; fp8 D=128 4 stages, 79.8 KB; fp8 D=256 3 stages, 112.8 KB."""
    def layout(stages):
        ld = d + 8
        stage = 2 * 64 * (d + 16) if fp8 else 2 * 64 * ld * 2
        return max(stages * stage + 16 * ld * 2 + (stages + max(stages - 1, 1)) * 64 * 8,
               4 * 16 * (d + 10) * 4)
    half = spec["smem_sm"] // 2 - spec["reserved"]
    for s in (4, 3, 2):
        if layout(s) <= half:
            return layout(s)
    return next(layout(s) for s in (4, 3, 2, 1) if layout(s) <= spec["smem_block"])


def prefill_plan_smem(d: int, bn: int, smem_block: int, fp8: bool = False, smem_sm: int | None = None) -> int:
    """The bytes plan_prefill gives kernel <T, KV, D, BN> under a per-block limit: of 3 and 2 stages, those that fit;
    with `smem_sm` (shared memory per SM, the per-CTA reservations included) the one giving the most CTAs per SM (at
    most 2), 3 on a tie; without it, 3 if they fit. 16-bit D=80 and D=128 on sm_80 take 2 stages (2 CTAs per SM).

    16-bit: D=64: 73728 (72 KB); D=128, BN=32: 87040 (85 KB) on sm_80 and sm_90; D=256: BN=64 168960 (165 KB,
    sm_90), BN=32 135168 (132 KB, sm_80). fp8: D=64: 61632 (60.2 KB); D=128, BN=32: 76896 (75.1 KB); D=256, BN=64:
    199872 (195.2 KB, sm_90), BN=32: 116832 (114.1 KB, sm_80). A variant the arch never launches (16-bit or fp8 D=256,
    BN=64 on sm_80) shows its 2-stage bytes.
    """
    fits = [s for s in (3, 2) if prefill_smem(d, bn, s, fp8) <= smem_block]
    if not fits:
        return prefill_smem(d, bn, 2, fp8)
    if smem_sm is None:
        return prefill_smem(d, bn, fits[0], fp8)
    return prefill_smem(d, bn, max(fits, key=lambda s: min(2, smem_sm // (prefill_smem(d, bn, s, fp8) + 1024))), fp8)


# Dynamic shared memory per launch: (regex on the short name, bytes from the match and the arch's GPU_SPECS entry).
# THE place to update when a kernel's shared memory plan changes or a kernel with `extern __shared__` is added;
# kernels matching none get 0.
DYNAMIC_SMEM = [
    (re.compile(r"^window_attention_prefill_kernel<[^,<>]+, ([^,<>]+), (\d+), (\d+)>$"),
     lambda m, spec: prefill_plan_smem(int(m.group(2)), int(m.group(3)), spec["smem_block"],
                                       m.group(1) == "unsigned char", spec["smem_sm"])),
    # <T, KV, D, kMulti>: the multi-query instantiation (kMulti true) plans the same shared memory
    (re.compile(r"^window_attention_decode_kernel<[^,<>]+, ([^,<>]+), (\d+), (?:true|false)>$"),
     lambda m, spec: decode_smem(int(m.group(2)), m.group(1) == "unsigned char", spec)),
]

# SASS instruction classes: column -> predicate on the opcode (mnemonic with its modifiers, e.g. LDG.E.128.CONSTANT).
INSN_CLASSES = {
    "LDG128": lambda op: op.startswith("LDG.") and ".128" in op,
    "STG128": lambda op: op.startswith("STG.") and ".128" in op,  # JSON only
    # JSON only: generic-address loads (the compiler could not tell shared from global: no LDSM, no 128-bit LDS;
    # bf16 WMMA fragment loads compile to 96 of them in prefill D=128 where fp16 gets 24 LDSM)
    "LD_GENERIC": lambda op: op.split(".")[0] == "LD",
    # JSON only: any shared memory access; with no static smem and no DYNAMIC_SMEM entry it means a missing entry
    "SMEM_OPS": lambda op: op.split(".")[0] in ("LDS", "STS", "LDSM", "LDGSTS", "ATOMS", "REDS", "STSM"),
    "LDGSTS": lambda op: op.startswith("LDGSTS"),
    "LDSM": lambda op: op.startswith("LDSM"),
    "HMMA": lambda op: op.split(".")[0] == "HMMA",
    "HGMMA": lambda op: op.split(".")[0] == "HGMMA",
    "SHFL": lambda op: op.split(".")[0] == "SHFL",
    "BAR": lambda op: op.split(".")[0] == "BAR",
    "STL": lambda op: op.split(".")[0] == "STL",
    "LDL": lambda op: op.split(".")[0] == "LDL",
    # programmatic dependent launch (csrc/pdl.cuh), sm_90+: griddepcontrol.wait / .launch_dependents
    "ACQBULK": lambda op: op.split(".")[0] == "ACQBULK",
    "PREEXIT": lambda op: op.split(".")[0] == "PREEXIT",
}


# ------------------------------------------------------------------------------------------------------ tools
def find_tool(name: str) -> str | None:
    env = os.environ.get(name.upper())
    if env:
        return env
    spec = importlib.util.find_spec("triton")  # locates the package without importing it
    if spec and spec.origin:
        cand = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / name
        if cand.is_file():
            return str(cand)
    for pat in glob.glob(str(REPO / ".venv" / "lib" / "python3*" / "site-packages" / "triton" / "backends" /
                             "nvidia" / "bin" / name)):
        return pat
    found = shutil.which(name)
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = Path(cuda_home) / "bin" / name
    return str(cand) if cand.is_file() else None


def run_cuobjdump(cuobjdump: str, nvdisasm: str | None, args: list[str]) -> str:
    env = dict(os.environ)
    if nvdisasm:  # cuobjdump -sass runs nvdisasm from PATH (or NVDISASM_PATH) for sm_80+
        env["PATH"] = str(Path(nvdisasm).parent) + os.pathsep + env.get("PATH", "")
    res = subprocess.run([cuobjdump, *args], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join([cuobjdump, *args])} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> short readable name ('window_attention_prefill_kernel<__half, __half, 128, 64>'); mangled if no
    c++filt."""
    full = dict(zip(names, names))
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        print("warning: c++filt not found (binutils): names stay mangled, DYNAMIC_SMEM and FALLBACK_THREADS "
              "patterns will not match", file=sys.stderr)
    elif names:
        res = subprocess.run([cxxfilt], input="\n".join(names) + "\n", capture_output=True, text=True)
        if res.returncode == 0:
            out = res.stdout.splitlines()
            if len(out) == len(names):
                full = dict(zip(names, out))
    return {m: short_name(d) for m, d in full.items()}


def short_name(demangled: str) -> str:
    """Drops namespaces (arkernels::(anonymous namespace)::) and the parameter list; keeps template arguments."""
    s = demangled
    # Cut the parameter list: the last top-level '(' (outside <>).
    depth, cut = 0, len(s)
    for i, c in enumerate(s):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and not s.startswith("(anonymous namespace)", i):
            cut = i
            break
    s = s[:cut]
    if s.startswith("void "):
        s = s[5:]
    # Strip qualifiers of the function name (before its template arguments), not those inside them.
    lt = s.find("<")
    head, tail = (s, "") if lt < 0 else (s[:lt], s[lt:])
    head = head.rsplit("::", 1)[-1]
    tail = tail.replace("(anonymous namespace)::", "")
    return head + tail


# ---------------------------------------------------------------------------------------------------- parsers
_ARCH = re.compile(r"^arch = (sm_\d+a?)\s*$")


def split_by_arch(text: str) -> list[tuple[str, str]]:
    """cuobjdump prints one block per cubin, each opening with 'arch = sm_XX': [(arch, block text)]."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = _ARCH.match(line)
        if m:
            blocks.append((m.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
    return [(a, "\n".join(lines)) for a, lines in blocks]


_RES_FN = re.compile(r"^\s*Function (\S+):\s*$")
_RES_KV = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")


def parse_res_usage(text: str) -> dict[tuple[str, str], dict[str, int]]:
    """`cuobjdump -res-usage`: {(arch, mangled): {'REG':..,'STACK':..,'SHARED':..,'LOCAL':..}}."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for arch, block in split_by_arch(text):
        fn = None
        for line in block.splitlines():
            m = _RES_FN.match(line)
            if m:
                fn = m.group(1)
                continue
            if fn and "REG:" in line:
                out[(arch, fn)] = {k: int(v) for k, v in _RES_KV.findall(line)}
                fn = None
    return out


_ELF_INFO = re.compile(r"^\.nv\.info\.(\S+)\s*$")
_ELF_SECTION = re.compile(r"^\.\S+")


def parse_elf(text: str) -> tuple[dict[tuple[str, str], int], set[str]]:
    """`cuobjdump -elf`: ({(arch, mangled): max threads per CTA from EIATTR_MAX_THREADS}, {archs whose cubins
    place static shared memory after the 1 KB reserved region (symbol .nv.reservedSmem.offset0)})."""
    max_threads: dict[tuple[str, str], int] = {}
    reserved_archs: set[str] = set()
    for arch, block in split_by_arch(text):
        fn, attr = None, None
        for line in block.splitlines():
            if ".nv.reservedSmem.offset0" in line:
                reserved_archs.add(arch)
            m = _ELF_INFO.match(line)
            if m:
                fn, attr = m.group(1), None
                continue
            if _ELF_SECTION.match(line):
                fn = None
                continue
            if fn is None:
                continue
            s = line.strip()
            if s.startswith("Attribute:"):
                attr = s.split(None, 1)[1].strip()
            elif s.startswith("Value:") and attr == "EIATTR_MAX_THREADS":
                dims = [int(x, 16) for x in s.split()[1:4]]
                max_threads[(arch, fn)] = math.prod(dims)
    return max_threads, reserved_archs


_SASS_FN = re.compile(r"^\s*Function : (\S+)\s*$")
_SASS_INSN = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?\w+\s+)?([A-Z][A-Z0-9_.]*)")


_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # access size by modifier; none: 4 bytes
SASS_KEYS = [*INSN_CLASSES, "insns", "stl_bytes", "ldl_bytes"]


def access_bytes(op: str) -> int:
    return next((_WIDTH[m] for m in op.split(".")[1:] if m in _WIDTH), 4)


# The decode kernel's split-KV combine (window_attention_decode.cuh, combine_if_last) loads every split's lse (8 scalar
# loads per thread, unrolled), then issues the partial outputs as cp.async, and only then uses an lse (stores it as a
# weight) or waits for a copy: one L2 round trip for the whole first round instead of one per split.
COMBINE_LSE_LOADS = 8  # kMaxSplits * kDecodeRows / kAttnThreads


def combine_order(ops: list[str]) -> str:
    """'ok' when, after the kernel's last ATOMG (the split counter's count), at least COMBINE_LSE_LOADS LDG come
    before the first LDGSTS, the first LDGSTS comes before the first STS after those loads (the first use of a loaded
    lse) and before the first DEPBAR (a cp.async wait); 'BAD' otherwise; '-' without an ATOMG (no combine)."""
    atoms = [i for i, op in enumerate(ops) if op.startswith("ATOMG")]
    if not atoms:
        return "-"
    tail = ops[atoms[-1] + 1:]
    copies = [i for i, op in enumerate(tail) if op.startswith("LDGSTS")]
    if not copies:
        return "BAD"
    first_copy = copies[0]
    loads = [i for i, op in enumerate(tail[:first_copy]) if op.startswith("LDG.")]
    if len(loads) < COMBINE_LSE_LOADS:
        return "BAD"
    first_use = next((i for i, op in enumerate(tail) if i > loads[0] and op.split(".")[0] == "STS"), len(tail))
    first_wait = next((i for i, op in enumerate(tail) if op.split(".")[0] == "DEPBAR"), len(tail))
    return "ok" if first_copy < first_use and first_copy < first_wait else "BAD"


# Programmatic dependent launch: before griddepcontrol.wait (ACQBULK) a kernel may touch no global memory (pdl.cuh).
# Generic loads / stores (LD, ST) may address global memory: they count too.
_GLOBAL_ACCESS = {"LDG", "STG", "LDGSTS", "ATOMG", "ATOM", "RED", "REDG", "LD", "ST", "UTMALDG", "UBLKCP"}


def pdl_order(ops: list[str], arch: str) -> str:
    """'ok' in an sm_90+ cubin when the kernel waits (ACQBULK) and triggers (PREEXIT) and no global memory access comes
    before its first ACQBULK in the code (static order: the emulator checks the executed order); '-' in an older
    cubin with neither (pdl.cuh compiles both to nothing there); 'BAD' otherwise."""
    names = [op.split(".")[0] for op in ops]
    if int(re.sub(r"\D", "", arch) or 0) < 90:
        return "-" if "ACQBULK" not in names and "PREEXIT" not in names else "BAD"
    if "ACQBULK" not in names or "PREEXIT" not in names:
        return "BAD"
    first = names.index("ACQBULK")
    return "BAD" if any(n in _GLOBAL_ACCESS for n in names[:first]) else "ok"


# The decode kernel's split-KV publication (window_attention_decode.cuh, combine_arrive): after the CTA barrier one
# thread's release add (MEMBAR.ALL.GPU + ATOMG) and, in the last CTA, that thread's acquire (MEMBAR.ALL.GPU +
# CCTL.IVALL), instead of MEMBAR.SC.GPU by all 128 threads twice (issue 34).
# On sm_90 the decode kernel's cluster combine (window_attention_decode_cluster.cuh) publishes through a cluster
# barrier instead: barrier.cluster.arrive.release is MEMBAR.ALL.GPU + CGAERRBAR + UCGABAR_ARV in the SASS, run by every
# thread of the cluster path. That MEMBAR is the cluster barrier's release, not a split-KV fence: it is counted apart
# ("CBR xN") and the split-KV rules apply to the other MEMBARs. One is the design (the first barrier, with no global
# store pending: the partials are in shared memory); a second (the exit barrier made a release: every thread would
# wait for its output stores' acknowledgement) fails as "CBR", as does a MEMBAR.SC at a cluster barrier.
def _cluster_release(insns: list[tuple], i: int) -> bool:
    return any(op.startswith("UCGABAR_ARV") for _, _, op, _ in insns[i + 1:i + 4])


def fence_scope(insns: list[tuple]) -> str:
    """insns: (pc, predicate or None, opcode, operands) of one kernel. '-' without MEMBAR; 'SC' with a MEMBAR.SC;
    'ALL' when some MEMBAR has no predicated branch over it between it and the barrier (BAR.SYNC) before it, i.e.
    every thread that passed the barrier runs it; else '1T xN' (N MEMBAR, each skipped by some threads). Cluster
    barrier releases (a MEMBAR right before UCGABAR_ARV) are not counted there: ' CBR x1' is appended for one, and
    more than one is 'CBR'."""
    membars = [i for i, (_, _, op, _) in enumerate(insns) if op.startswith("MEMBAR")]
    if any(insns[i][2].startswith("MEMBAR.SC") for i in membars):
        return "SC"
    cbr = [i for i in membars if _cluster_release(insns, i)]
    if len(cbr) > 1:
        return "CBR"
    fences = [i for i in membars if i not in cbr]
    tag = f" CBR x{len(cbr)}" if cbr else ""
    if not fences:
        return tag.strip() or "-"
    for i in fences:
        start = next((j for j in range(i - 1, -1, -1) if insns[j][2].startswith("BAR.")), -1)
        guarded = False
        for pc, pred, op, operands in insns[start + 1:i]:
            target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" and pred else None
            guarded = guarded or (target is not None and int(target.group(1), 16) > insns[i][0])
        if not guarded:
            return "ALL"
    return f"1T x{len(fences)}" + tag


# The prefill kernel's key loop (window_attention_prefill.cuh), per warp and key tile in steady state (the next tile's
# cp.async issued), as dynamic SASS: the loop body is a DAG of forward branches once its inner loops (the rolled
# QK^T k-steps; fp8: the conversion passes) are counted as their instructions times their trips, and each variant is a
# path through it that runs every inner loop (a path around a loop is its remainder code, not a tile). Unmasked: the
# shortest path (no score variant, no O rescale); + rescale: the shortest through the O rescale of every row (FMUL >=
# 4 MT ND); masked: the longest path without tanh (a masked tile that rescales).
_BRANCH = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_PREFILL_ARGS = re.compile(r"window_attention_prefill_kernelI(\w+?)(h|S\d*_)Li(\d+)ELi(\d+)E")


def prefill_shape(mangled: str) -> dict | None:
    """D, BN, fp8 and the warp's tiling (MT m16 halves, NS n8 tiles of S, ND of O, KD k-steps) of a prefill kernel."""
    m = _PREFILL_ARGS.search(mangled)
    if not m:
        return None
    d, bn = int(m.group(3)), int(m.group(4))
    mt = 2 if d <= 128 else 1
    return dict(d=d, bn=bn, fp8=m.group(2) == "h", mt=mt, ns=bn // 8, nd=d // 8, kd=d // 16, threads=128)


def tile_paths(insns: list[tuple], shape: dict) -> dict | None:
    """insns: (pc, predicate or None, opcode, operands) of one kernel. Returns {'unmasked', 'rescale', 'masked',
    'hmma'} (dynamic SASS per warp per key tile; hmma: on the unmasked path, to check against the tiling), or None
    when the key loop or an inner loop's trip count is not found."""
    n = len(insns)
    def target(i):
        hexes = re.findall(r"0x([0-9a-f]+)", insns[i][3])
        return next((j for j, x in enumerate(insns) if x[0] == int(hexes[-1], 16)), None) if hexes else None
    branches = {i: target(i) for i in range(n) if insns[i][2].startswith("BRA")}
    back = [(t, i) for i, t in branches.items() if t is not None and t <= i]
    def has(lo, hi, prefix):
        return any(insns[k][2].startswith(prefix) for k in range(lo, hi + 1))
    keys = [(t, i) for t, i in back if has(t, i, "HMMA") and has(t, i, "LDGSTS")]
    if not keys:
        return None
    head, tail = min(keys, key=lambda ti: ti[1] - ti[0])
    # inner loops (outermost ones inside the key loop) and their trips: the k-steps make MT NS KD HMMA per tile, the fp8
    # conversion 2 BN (D / 8) / threads 16-byte stores
    inner = {}
    for t, i in sorted(back):
        if head < t and i < tail and not any(a <= t and i <= b for a, (b, _) in inner.items()):
            body = [insns[k][2] for k in range(t, i + 1)]
            if any(op.startswith("HMMA") for op in body):
                total, per = shape["mt"] * shape["ns"] * shape["kd"], sum(op.startswith("HMMA") for op in body)
            elif shape["fp8"] and any(op.startswith("STS.128") for op in body):
                total = 2 * shape["bn"] * (shape["d"] // 8) // shape["threads"]
                per = sum(op.startswith("STS.128") for op in body)
            else:
                return None
            if total % per:
                return None
            inner[t] = (i, total // per)
    threshold = 4 * shape["mt"] * shape["nd"]  # the O rescale's FMUL
    def walk(better):
        # best[i][(ldgsts seen, FMUL capped at threshold, inner loops run)] = (SASS, HMMA) from head to instruction i
        best = [dict() for _ in range(n + 1)]
        best[head][(False, 0, 0)] = (0, 0)
        done = {}
        def push(j, state, val):
            if head <= j <= tail and (state not in best[j] or better(val[0], best[j][state][0])):
                best[j][state] = val
        for i in range(head, tail + 1):
            for (seen, fmul, loops), (cost, hmma) in list(best[i].items()):
                if i in inner:
                    end, trips = inner[i]
                    ops = [insns[k][2] for k in range(i, end + 1)]
                    st = (seen or any(op.startswith("LDGSTS") for op in ops),
                          min(threshold, fmul + trips * sum(op.startswith("FMUL") for op in ops)), loops + 1)
                    push(end + 1, st, (cost + trips * len(ops), hmma + trips * sum(op.startswith("HMMA") for op in ops)))
                    continue
                op, pred = insns[i][2], insns[i][1]
                if op.startswith("MUFU.TANH") or op == "EXIT":
                    continue
                st = (seen or op.startswith("LDGSTS"), min(threshold, fmul + op.startswith("FMUL")), loops)
                val = (cost + 1, hmma + op.startswith("HMMA"))
                if i == tail:
                    if loops == len(inner) and (st not in done or better(val[0], done[st][0])):
                        done[st] = val
                    continue
                if i in branches:
                    t = branches[i]
                    if t is not None and i < t <= tail:
                        push(t, st, val)
                    if (pred and "PT" not in pred) or "UP" in insns[i][3] or ".DIV" in op:
                        push(i + 1, st, val)
                    continue
                push(i + 1, st, val)
        return done
    low = walk(lambda a, b: a < b)
    high = walk(lambda a, b: a > b)
    seen_low = [v for (seen, _, _), v in low.items() if seen]
    rescaled = [v for (seen, fmul, _), v in low.items() if seen and fmul >= threshold]
    masked = [v for (seen, fmul, _), v in high.items() if seen and fmul >= threshold]
    if not seen_low or not rescaled or not masked:
        return None
    unmasked = min(seen_low)
    return {"unmasked": unmasked[0], "rescale": min(rescaled)[0], "masked": max(masked)[0], "hmma": unmasked[1]}


def parse_sass(text: str) -> dict[tuple[str, str], dict[str, int]]:
    """`cuobjdump -sass`: {(arch, mangled): {class: static count}} for INSN_CLASSES, plus 'insns' (total),
    'stl_bytes' / 'ldl_bytes': the bytes the STL / LDL instructions move, each counted once (as ptxas -v counts
    'bytes spill stores / loads', which the cubin does not record), 'tail': combine_order of decode kernels, and
    'pdl': pdl_order of every kernel."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for arch, block in split_by_arch(text):
        counts = None
        for line in block.splitlines():
            m = _SASS_FN.match(line)
            if m:
                counts = out.setdefault((arch, m.group(1)), dict.fromkeys(SASS_KEYS, 0))
                ops = counts.setdefault("ops", [])
                decode = "window_attention_decode_kernel" in m.group(1)
                shape = prefill_shape(m.group(1))
                insns = counts.setdefault("insns_full", []) if shape or decode else None
                continue
            if counts is None:
                continue
            m = _SASS_INSN.match(line)
            if m:
                op = m.group(1)
                counts["insns"] += 1
                if ops is not None:
                    ops.append(op)
                full = _BRANCH.match(line) if insns is not None else None
                if full:
                    insns.append((int(full.group(1), 16), (full.group(2) or "").strip() or None, full.group(3),
                                  full.group(4)))
                for k, pred in INSN_CLASSES.items():
                    if pred(op):
                        counts[k] += 1
                        if k in ("STL", "LDL"):
                            counts[k.lower() + "_bytes"] += access_bytes(op)
    for (arch, fn), counts in out.items():
        ops = counts.pop("ops", [])
        counts["tail"] = combine_order(ops) if "window_attention_decode_kernel" in fn else "-"
        counts["pdl"] = pdl_order(ops, arch)
        insns = counts.pop("insns_full", None)
        counts["fence"] = fence_scope(insns) if "window_attention_decode_kernel" in fn and insns is not None else "-"
        if insns is not None and prefill_shape(fn):
            counts["tile"] = tile_paths(insns, prefill_shape(fn)) or "?"
    return out


# -------------------------------------------------------------------------------------------------- occupancy
def occupancy(spec: dict, regs: int, threads: int, smem_block: int) -> dict:
    """Theoretical CTAs and warps per SM (cuda_occupancy.h's rules): registers are allocated per warp in units of
    reg_unit and split evenly over the SM's sub-partitions; shared memory per CTA is static + dynamic + the 1 KB
    reservation, rounded up to smem_unit; smem_block is static + dynamic (what must fit the per-block opt-in)."""
    warps = -(-threads // 32)
    limits = {"ctas": spec["max_ctas"], "threads": spec["max_warps"] // warps}
    if regs > 0:
        per_warp = -(-regs * 32 // spec["reg_unit"]) * spec["reg_unit"]
        per_side = spec["regs"] // spec["sub_partitions"]
        assumed = per_warp * -(-warps // spec["sub_partitions"]) * spec["sub_partitions"]
        fits = assumed <= spec["regs"] and regs <= 255  # 64K registers per block, 255 per thread
        limits["regs"] = (per_side // per_warp) * spec["sub_partitions"] // warps if fits else 0
    if smem_block > spec["smem_block"]:
        limits["smem"] = 0
    else:
        per_cta = -(-(smem_block + spec["reserved"]) // spec["smem_unit"]) * spec["smem_unit"]
        limits["smem"] = spec["smem_sm"] // per_cta
    ctas = min(limits.values())
    limiter = "/".join(k for k, v in limits.items() if v == ctas)
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps, "occupancy": ctas * warps / spec["max_warps"],
            "limiter": limiter}


# ------------------------------------------------------------------------------------------------------ report
def natural_key(s: str) -> list:
    """'..., 64>' before '..., 128>': digit runs compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def build_rows(res: dict, max_threads: dict, reserved_archs: set, sass: dict, names: dict) -> list[dict]:
    rows = []
    def order(item):
        (arch, fn), _ = item
        return arch, natural_key(names.get(fn, fn))

    for (arch, fn), r in sorted(res.items(), key=order):
        name = names.get(fn, fn)
        shared = r.get("SHARED", 0)
        # sm_90 cubins place static shared memory after the 1 KB reserved region and report it included (ptxas -v
        # does not): 23168 in the ELF for decode D=128's 22144, 1024 for kernels with none of their own (combine,
        # prefill). We take that 1 KB to be the driver's per-CTA reservation, counted once in occupancy(); if the
        # driver counted it twice, no CTA count in today's table would change (checked by hand for every kernel).
        static_smem = max(shared - 1024, 0) if arch in reserved_archs and shared >= 1024 else shared
        dyn = 0
        for pat, fn_bytes in DYNAMIC_SMEM:
            m = pat.match(name)
            if m:
                dyn = fn_bytes(m, GPU_SPECS.get(arch.rstrip("a"), GPU_SPECS["sm_90"]))
                break
        threads, threads_from = max_threads.get((arch, fn)), "launch_bounds"
        if threads is None:
            threads_from = "fallback"
            threads = next((t for p, t in FALLBACK_THREADS if name.startswith(p)), None)
        counts = sass.get((arch, fn), {})
        row = {
            "arch": arch, "kernel": name, "mangled": fn, "regs": r.get("REG", 0), "stack": r.get("STACK", 0),
            "local": r.get("LOCAL", 0), "static_smem": static_smem, "dynamic_smem": dyn,
            "threads": threads, "threads_from": threads_from if threads else "unknown",
            **{k.lower(): counts.get(k, 0) for k in SASS_KEYS},
            "tail": counts.get("tail", "-"),
            "pdl": counts.get("pdl", "-"),
            "fence": counts.get("fence", "-"),
            "tile": counts.get("tile", "-"),
        }
        spec = GPU_SPECS.get(arch.rstrip("a"))
        if spec and threads:
            occ = occupancy(spec, row["regs"], threads, static_smem + dyn)
            row.update(occ, gpu=spec["gpu"])
        row["local_memory"] = bool(row["stl"] or row["ldl"] or row["stack"] or row["local"])
        rows.append(row)
    return rows


def kb(n: int) -> str:
    return f"{n / 1024:.1f}K" if n else "0"


COLUMNS = [  # (header, width, row -> text)
    ("kernel", 56, lambda r: r["kernel"]),
    ("regs", 4, lambda r: str(r["regs"])),
    ("stack", 5, lambda r: str(r["stack"])),
    ("local", 5, lambda r: str(r["local"])),
    ("smem", 6, lambda r: kb(r["static_smem"])),
    ("dyn", 6, lambda r: kb(r["dynamic_smem"])),
    ("thr", 4, lambda r: str(r["threads"] or "?") + ("*" if r["threads_from"] == "fallback" else "")),
    ("cta/SM", 6, lambda r: str(r.get("ctas_per_sm", "-"))),
    ("warps", 5, lambda r: str(r.get("warps_per_sm", "-"))),
    ("occ", 4, lambda r: f"{round(100 * r['occupancy'])}%" if "occupancy" in r else "-"),
    ("limit", 12, lambda r: r.get("limiter", "-")),
    ("LDG128", 6, lambda r: str(r["ldg128"])),
    ("LDGSTS", 6, lambda r: str(r["ldgsts"])),
    ("LDSM", 4, lambda r: str(r["ldsm"])),
    ("HMMA", 4, lambda r: str(r["hmma"])),
    ("HGMMA", 5, lambda r: str(r["hgmma"])),
    ("SHFL", 4, lambda r: str(r["shfl"])),
    ("BAR", 3, lambda r: str(r["bar"])),
    ("STL", 3, lambda r: str(r["stl"])),
    ("LDL", 3, lambda r: str(r["ldl"])),
    ("TAIL", 4, lambda r: r["tail"]),
    ("PDL", 6, lambda r: r["pdl"] if r["pdl"] == "-" else f"{r['acqbulk']}/{r['preexit']} {r['pdl']}"),
    ("FENCE", 5, lambda r: r["fence"]),
]


def format_table(arch: str, rows: list[dict]) -> str:
    spec = GPU_SPECS.get(arch.rstrip("a"))
    gpu = f"occupancy on {spec['gpu']}" if spec else "no occupancy: arch not in GPU_SPECS"
    width = max([COLUMNS[0][1], *(len(r["kernel"]) for r in rows)])
    cols = [(h, width if i == 0 else w, f) for i, (h, w, f) in enumerate(COLUMNS)]
    lines = [f"== {arch} ({len(rows)} kernels; {gpu}; smem/dyn = static/dynamic shared per CTA, "
             f"thr* = threads from the fallback table)"]
    lines.append(" ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w, _) in enumerate(cols)))
    for r in rows:
        lines.append(" ".join(f(r).ljust(w) if i == 0 else f(r).rjust(w) for i, (_, w, f) in enumerate(cols)))
    return "\n".join(lines)


def format_tiles(arch: str, rows: list[dict]) -> str:
    """The prefill kernels' key-tile issue (tile_paths): dynamic SASS per warp per key tile in steady state."""
    pre = [r for r in rows if r["tile"] != "-"]
    if not pre:
        return ""
    width = max(len(r["kernel"]) for r in pre)
    lines = [f"-- {arch} prefill key tile, SASS per warp (steady state: next tile's cp.async issued): unmasked = no "
             "score variant, no O rescale; +rescale = every row's max moved; masked = the longest path without tanh",
             f"{'kernel'.ljust(width)} unmasked +rescale masked HMMA"]
    for r in pre:
        t = r["tile"]
        if t == "?":
            lines.append(f"{r['kernel'].ljust(width)} ? (key loop or an inner loop's trip count not recognised)")
        else:
            lines.append(f"{r['kernel'].ljust(width)} {t['unmasked']:8d} {t['rescale']:8d} {t['masked']:6d} "
                         f"{t['hmma']:4d}")
    return "\n".join(lines)


def default_so() -> Path | None:
    cands = glob.glob(str(REPO / "arkernels" / "_C*.so"))
    if not cands:
        spec = importlib.util.find_spec("arkernels")  # top-level: found without importing (no torch import)
        if spec and spec.origin:
            cands = glob.glob(str(Path(spec.origin).parent / "_C*.so"))
    return Path(max(cands, key=os.path.getmtime)) if cands else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", type=Path, default=None, help="extension to inspect (default: arkernels/_C*.so)")
    ap.add_argument("--arch", action="append", default=None,
                    help="cubin arch to report (sm_90); repeat for several; default: every arch in the .so")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (all columns) to this JSON file")
    args = ap.parse_args(argv)

    so = args.so or default_so()
    if so is None or not so.is_file():
        print(f"sass_report: extension not found ({so or 'arkernels/_C*.so'}): build it first", file=sys.stderr)
        return 2
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None:
        print("sass_report: cuobjdump not found: set CUOBJDUMP, install triton (its wheel ships it) or a CUDA "
              "toolkit that has it", file=sys.stderr)
        return 2
    try:
        listing = run_cuobjdump(cuobjdump, nvdisasm, ["-lelf", str(so)])
        in_so = sorted(set(re.findall(r"\.(sm_\d+a?)\.cubin", listing)))
        archs = args.arch or in_so
        missing = [a for a in archs if a not in in_so]
        if not in_so or missing:
            print(f"sass_report: {so.name} holds cubins for {in_so or 'no arch'}; asked for {archs}. Build with "
                  "ARKERNELS_CUDA=1 and TORCH_CUDA_ARCH_LIST covering them.", file=sys.stderr)
            return 2
        res_text = run_cuobjdump(cuobjdump, nvdisasm, ["-res-usage", str(so)])
        elf_text, sass_text = [], []
        for a in archs:  # -arch keeps cuobjdump from disassembling archs nobody asked for
            elf_text.append(run_cuobjdump(cuobjdump, nvdisasm, ["-elf", "-arch", a, str(so)]))
            sass_text.append(run_cuobjdump(cuobjdump, nvdisasm, ["-sass", "-arch", a, str(so)]))
    except (OSError, RuntimeError) as e:
        print(f"sass_report: {e}", file=sys.stderr)
        return 2

    res = {k: v for k, v in parse_res_usage(res_text).items() if k[0] in archs}
    max_threads, reserved_archs = parse_elf("\n".join(elf_text))
    sass = parse_sass("\n".join(sass_text))
    names = demangle(sorted({fn for _, fn in res}))
    rows = build_rows(res, max_threads, reserved_archs, sass, names)

    print(f"sass_report: {so} (cuobjdump: {cuobjdump})")
    for a in archs:
        print(format_table(a, [r for r in rows if r["arch"] == a]))
    for a in archs:
        tiles = format_tiles(a, [r for r in rows if r["arch"] == a])
        if tiles:
            print(tiles)
    bad = [r for r in rows if r["local_memory"]]
    unknown = [r for r in rows if r["threads"] is None]
    for r in rows:
        if r["smem_ops"] and not r["static_smem"] and not r["dynamic_smem"]:
            print(f"warning: {r['arch']} {r['kernel']}: accesses shared memory but has no static shared memory and "
                  "no DYNAMIC_SMEM entry: add one, or its occupancy is overstated")
    for r in unknown:
        print(f"warning: {r['arch']} {r['kernel']}: no __launch_bounds__ and no FALLBACK_THREADS entry: "
              "occupancy not computed")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"so": str(so), "archs": archs, "rows": rows}, indent=1) + "\n")
    bad_tail = [r for r in rows if r["tail"] == "BAD"]
    for r in bad_tail:
        print(f"FAIL combine order: {r['arch']} {r['kernel']}: the split-KV combine waits for or uses a load before "
              "issuing all of its lse loads and its first partial copies")
    bad_pdl = [r for r in rows if r["pdl"] == "BAD"]
    for r in bad_pdl:
        print(f"FAIL PDL: {r['arch']} {r['kernel']}: ACQBULK {r['acqbulk']}, PREEXIT {r['preexit']}: sm_90 cubins need "
              "both, with no global access above the first ACQBULK; older cubins neither (csrc/pdl.cuh)")
    bad_fence = [r for r in rows if r["fence"] in ("SC", "ALL", "CBR")]
    for r in bad_fence:
        what = {"SC": "a MEMBAR.SC", "ALL": "a MEMBAR every thread executes",
                "CBR": "more than one cluster barrier with a release (the exit barrier is relaxed)"}[r["fence"]]
        print(f"FAIL decode fences: {r['arch']} {r['kernel']}: {what} (the split-KV combine publishes with one "
              "thread's release / acquire, the cluster combine with one cluster barrier's release)")
    for r in bad:
        print(f"FAIL local memory: {r['arch']} {r['kernel']}: STL {r['stl']} ({r['stl_bytes']} B), "
              f"LDL {r['ldl']} ({r['ldl_bytes']} B), stack {r['stack']} B, local {r['local']} B")
    n_k = len({r["kernel"] for r in rows})
    print(f"summary: {len(rows)} kernel cubins ({n_k} kernels x {len(archs)} archs), {len(bad)} with local memory "
          f"or spills, max regs {max((r['regs'] for r in rows), default=0)}, "
          f"HMMA in {sum(1 for r in rows if r['hmma'])}, LDGSTS in {sum(1 for r in rows if r['ldgsts'])}, "
          f"LDSM in {sum(1 for r in rows if r['ldsm'])}, HGMMA in {sum(1 for r in rows if r['hgmma'])}, "
          f"PDL ok in {sum(1 for r in rows if r['pdl'] == 'ok')}, BAD in {len(bad_pdl)}")
    return 1 if bad or bad_tail or bad_pdl or bad_fence else 0


if __name__ == "__main__":
    sys.exit(main())
