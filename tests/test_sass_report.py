"""scripts/sass_report.py's parsers and occupancy arithmetic on stored cuobjdump text (no .so, no GPU, < 1 s).

The samples are cut from cuobjdump 13.1's output on our extension (sm_80 + sm_90 cubins); one invented kernel
(`spilly_kernel`, with STL/LDL and a stack frame) exercises the failure path.
"""
import importlib.util
import json
import shutil
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sass_report", ROOT / "scripts" / "sass_report.py")
sr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sr)

NS_WA = "_ZN9arkernels52_GLOBAL__N__b279223b_19_window_attention_cu_db9532b5"
DECODE = NS_WA + "30window_attention_decode_kernelI6__halfLi128EEEvNS0_6ParamsE"
PREFILL = NS_WA + "31window_attention_prefill_kernelI6__halfS2_Li128ELi64EEEvNS0_6ParamsE"  # <__half, __half, 128, 64>
GATHER = ("_ZN9arkernels44_GLOBAL__N__d47db4b3_11_paged_kv_cu_098fbcbe22paged_kv_gather_kernelI5uint4EEvPKT_S5_PKiS7_"
          "PS3_S8_lllliiillllll")
SPILLY = "_Z13spilly_kernelPf"

RES_USAGE = f"""
Fatbin elf code:
================
arch = sm_80
code version = [1,8]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:28 CONSTANT[4]:224
 Function {DECODE}:
  REG:72 STACK:0 SHARED:22144 LOCAL:0 CONSTANT[0]:576 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

Resource usage:
 Function {PREFILL}:
  REG:128 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:752 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function {DECODE}:
  REG:72 STACK:0 SHARED:23168 LOCAL:0 CONSTANT[0]:752 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function {GATHER}:
  REG:30 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:496 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function {SPILLY}:
  REG:255 STACK:16 SHARED:0 LOCAL:0 CONSTANT[0]:360 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

ELF = f"""
Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

64-bit ELF: type=ET_EXEC, ABI=8, sm=90, toolkit=13.0, flags=0x6005a04
Sections:
   64  c2e80   5a80  0 80                       NOBITS       43    0       4a .nv.shared.{DECODE}
.section .symtab
 0x5               0             0x4     0x21        0      0     .nv.reservedSmem.offset0

.nv.info
\t<0x1>
\tAttribute:\tEIATTR_REGCOUNT
\tFormat:\tEIFMT_SVAL
\tValue:\tfunction: {DECODE}(0x3e)\tregister count: 72

.nv.info.{GATHER}
\t<0x1>
\tAttribute:\tEIATTR_KPARAM_INFO
\tFormat:\tEIFMT_SVAL
\tValue:\tIndex : 0x0\tOrdinal : 0x12\tOffset  : 0x88\tSize    : 0x8
\t<0x2>
\tAttribute:\tEIATTR_CRS_STACK_SIZE
\tFormat:\tEIFMT_SVAL
\tValue:\t0x0 

.nv.info.{PREFILL}
\t<0x5>
\tAttribute:\tEIATTR_MAXREG_COUNT
\tFormat:\tEIFMT_HVAL
\tValue:\t0x80
\t<0x11>
\tAttribute:\tEIATTR_MAX_THREADS
\tFormat:\tEIFMT_SVAL
\tValue:\t0x80 0x1 0x1 

.nv.info.{DECODE}
\t<0x11>
\tAttribute:\tEIATTR_MAX_THREADS
\tFormat:\tEIFMT_SVAL
\tValue:\t0x40 0x2 0x1 

.nv.info.{SPILLY}
\t<0x11>
\tAttribute:\tEIATTR_MAX_THREADS
\tFormat:\tEIFMT_SVAL
\tValue:\t0x100 0x1 0x1 
"""


def _insn(addr, text):
    return f"        /*{addr:04x}*/                   {text} ;   /* 0x0000001016087981 */\n" \
           f"                                                                /* 0x000fe20000000800 */\n"


SASS = f"""
Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

\tcode for sm_90
\t.target\tsm_90

\t\tFunction : {PREFILL}
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
""" + "".join(_insn(16 * i, t) for i, t in enumerate([
    "ACQBULK",  # griddepcontrol.wait (csrc/pdl.cuh)
    "LDG.E.128.CONSTANT R8, desc[UR16][R22.64]",
    "@P0 LDG.E.128 R28, desc[UR12][R32.64]",
    "LDG.E.U16 R4, desc[UR4][R2.64]",
    "STG.E.128 desc[UR4][R2.64], R8",
    "LDSM.16.M88.4 R4, [R3]",
    "@!P1 LDSM.16.MT88.4 R8, [R3+0x400]",
    "HMMA.16816.F32 R16, R4, R8, R16",
    "HFMA2.MMA R3, -RZ, RZ, 0, 0",  # a half2 FMA on the MMA pipe, not a tensor-core op
    "LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64]",
    "BAR.SYNC.DEFER_BLOCKING 0x0",
    "SHFL.BFLY PT, R5, R4, 0x1, 0x1f",
    "PREEXIT",  # griddepcontrol.launch_dependents
    "EXIT",
])) + f"""
\t\tFunction : {SPILLY}
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
""" + "".join(_insn(16 * i, t) for i, t in enumerate([
    "STL.64 [R1], R4",
    "@P0 LDL R6, [R1+0x8]",
    "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24",
    "EXIT",
]))


def test_parse_res_usage_splits_archs():
    res = sr.parse_res_usage(RES_USAGE)
    assert res[("sm_80", DECODE)]["SHARED"] == 22144
    assert res[("sm_90", DECODE)]["SHARED"] == 23168
    assert res[("sm_90", PREFILL)]["REG"] == 128
    assert res[("sm_90", SPILLY)]["STACK"] == 16
    assert len(res) == 5


def test_parse_elf_max_threads_and_reserved_smem():
    max_threads, reserved = sr.parse_elf(ELF)
    assert max_threads == {("sm_90", PREFILL): 128, ("sm_90", DECODE): 128, ("sm_90", SPILLY): 256}
    assert reserved == {"sm_90"}


def test_parse_sass_counts():
    sass = sr.parse_sass(SASS)
    p, s = sass[("sm_90", PREFILL)], sass[("sm_90", SPILLY)]
    assert (p["LDG128"], p["STG128"], p["LDSM"], p["HMMA"], p["LDGSTS"], p["BAR"], p["SHFL"]) == (2, 1, 2, 1, 1, 1, 1)
    assert (p["HGMMA"], p["STL"], p["LDL"], p["insns"]) == (0, 0, 0, 14)
    assert (p["ACQBULK"], p["PREEXIT"], p["pdl"], s["pdl"]) == (1, 1, "ok", "BAD")
    assert (s["STL"], s["LDL"], s["HGMMA"], s["HMMA"], s["insns"]) == (1, 1, 1, 0, 4)
    assert (s["stl_bytes"], s["ldl_bytes"], p["stl_bytes"]) == (8, 4, 0)  # STL.64, LDL


def test_short_name():
    name = sr.short_name("void arkernels::(anonymous namespace)::window_attention_prefill_kernel<__half, unsigned char, "
                         "128, 64>(arkernels::(anonymous namespace)::Params)")
    assert name == "window_attention_prefill_kernel<__half, unsigned char, 128, 64>"
    assert sr.short_name("void arkernels::(anonymous namespace)::paged_kv_append_kernel<uint4, long>(uint4 const*, "
                         "long const*, long)") == "paged_kv_append_kernel<uint4, long>"
    assert sr.short_name("spilly_kernel(float*)") == "spilly_kernel"


def test_prefill_smem_matches_source_comment():
    # window_attention_prefill.cuh's header: D=64 72 KB (3 stages), D=96 65 KB (BN=32, 3 stages), D=128 85 KB (BN=32,
    # 3 stages, every GPU), D=256 165 KB (BN=64, 2 stages, sm_90), 132 KB (BN=32, 3, sm_80), 99 KB (BN=32, 2)
    assert [sr.prefill_smem(d, bn, st) for d, bn, st in [(64, 64, 3), (96, 32, 3), (128, 32, 3), (256, 64, 2),
                                                         (256, 32, 3), (256, 32, 2)]] == \
        [73728, 66560, 87040, 168960, 135168, 101376]
    sm80, sm90 = sr.GPU_SPECS["sm_80"]["smem_block"], sr.GPU_SPECS["sm_90"]["smem_block"]
    assert [sr.prefill_plan_smem(256, 64, sm90), sr.prefill_plan_smem(256, 32, sm80),
            sr.prefill_plan_smem(128, 32, sm80)] == [168960, 135168, 87040]
    # with the SM's shared memory: the ring depth that gives the most CTAs per SM (sm_80 D=128: 2 stages, 68 KB, 2
    # CTAs instead of 85 KB and 1; sm_90: 3 stages and 2 CTAs; D=256 on sm_80: 1 CTA either way, 3 stages)
    sm80_sm, sm90_sm = sr.GPU_SPECS["sm_80"]["smem_sm"], sr.GPU_SPECS["sm_90"]["smem_sm"]
    assert [sr.prefill_plan_smem(128, 32, sm80, smem_sm=sm80_sm), sr.prefill_plan_smem(128, 32, sm90, smem_sm=sm90_sm),
            sr.prefill_plan_smem(80, 64, sm80, smem_sm=sm80_sm), sr.prefill_plan_smem(256, 32, sm80, smem_sm=sm80_sm)] \
        == [69632, 87040, 67584, 135168]


def test_prefill_smem_fp8_matches_source_comment():
    # fp8 caches: the 16-bit K/V copy (converted once per CTA) after the Q tile; ring rows of d bytes + a flag byte
    # per key and stage. D=64 60.2 KB, D=96 57.1 KB (BN=32, 3 stages), D=128 75.1 KB (BN=32, 3 stages, every GPU),
    # D=256 195.2 KB (BN=64, 3: sm_90), 163.1 KB (BN=64, 2: 128 bytes over sm_80's limit), 114.1 KB (BN=32, 3:
    # sm_80), 98.1 KB (BN=32, 2: 99 KB GPUs, the smallest plan)
    assert [sr.prefill_smem(d, bn, st, fp8=True) for d, bn, st in [(64, 64, 3), (96, 32, 3), (128, 32, 3),
                                                                   (256, 64, 3), (256, 64, 2), (256, 32, 3),
                                                                   (256, 32, 2)]] == \
        [61632, 58464, 76896, 199872, 167040, 116832, 100416]
    sm80, sm90 = sr.GPU_SPECS["sm_80"]["smem_block"], sr.GPU_SPECS["sm_90"]["smem_block"]
    assert [sr.prefill_plan_smem(256, 64, sm90, fp8=True), sr.prefill_plan_smem(256, 32, sm80, fp8=True),
            sr.prefill_plan_smem(128, 32, sm80, fp8=True)] == [199872, 116832, 76896]


def _dynamic_smem(name, arch):
    spec = sr.GPU_SPECS[arch]
    return next((f(m, spec) for pat, f in sr.DYNAMIC_SMEM for m in [pat.match(name)] if m), None)


def test_dynamic_smem_table_tells_fp8_from_16bit_prefill():
    # The report's short names carry the caches' element type (unsigned char: float8_e4m3fn): each gets its layout.
    assert _dynamic_smem("window_attention_prefill_kernel<__half, __half, 128, 32>", "sm_90") == 87040
    assert _dynamic_smem("window_attention_prefill_kernel<__nv_bfloat16, __nv_bfloat16, 256, 64>", "sm_90") == 168960
    assert _dynamic_smem("window_attention_prefill_kernel<__half, unsigned char, 128, 32>", "sm_90") == 76896
    assert _dynamic_smem("window_attention_prefill_kernel<__nv_bfloat16, unsigned char, 256, 64>", "sm_90") == 199872
    assert _dynamic_smem("window_attention_prefill_kernel<__nv_bfloat16, unsigned char, 256, 32>", "sm_80") == 116832


@pytest.mark.parametrize("arch,regs,threads,smem,ctas,limiter", [
    ("sm_90", 72, 128, 22144, 7, "regs"),              # decode D=128: 2304 regs/warp, 7 warps per sub-partition
    ("sm_90", 96, 128, 42624, 5, "regs/smem"),         # decode D=256: (42624 + 1024) B -> 5 in 228 KB
    ("sm_80", 96, 128, 42624, 3, "smem"),              # same on A100's 164 KB
    ("sm_90", 128, 128, 113920, 2, "smem"),            # 111.2 KB (the WMMA prefill D=128 of 6607198)
    ("sm_80", 128, 128, 113920, 1, "smem"),
    ("sm_90", 30, 256, 0, 8, "threads/regs"),          # 32 regs/thread after rounding: 64 warps either way
    ("sm_90", 24, 32, 0, 32, "ctas"),                 # one-warp CTAs: the 32-CTA cap binds
    ("sm_90", 32, 128, 232448 + 1, 0, "smem"),         # over the 227 KB opt-in: cannot launch
    ("sm_80", 255, 1024, 0, 0, "regs"),                # 255 x 1024 > 64K registers per block
])
def test_occupancy(arch, regs, threads, smem, ctas, limiter):
    occ = sr.occupancy(sr.GPU_SPECS[arch], regs, threads, smem)
    assert (occ["ctas_per_sm"], occ["limiter"]) == (ctas, limiter)
    assert occ["warps_per_sm"] == ctas * threads // 32


needs_cxxfilt = pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) not installed")


@needs_cxxfilt
def test_build_rows():
    res = sr.parse_res_usage(RES_USAGE)
    max_threads, reserved = sr.parse_elf(ELF)
    names = sr.demangle(sorted({fn for _, fn in res}))
    rows = {(r["arch"], r["kernel"]): r for r in sr.build_rows(res, max_threads, reserved, sr.parse_sass(SASS), names)}
    dec90, dec80 = rows[("sm_90", "window_attention_decode_kernel<__half, 128>")], \
        rows[("sm_80", "window_attention_decode_kernel<__half, 128>")]
    assert dec90["static_smem"] == dec80["static_smem"] == 22144  # sm_90's in-cubin 1 KB reservation taken out
    assert (dec90["threads"], dec90["threads_from"]) == (128, "launch_bounds")  # 64 x 2 x 1
    assert (dec80["threads"], dec80["threads_from"]) == (128, "fallback")
    pre = rows[("sm_90", "window_attention_prefill_kernel<__half, __half, 128, 64>")]
    # a stored 16-row-era kernel (D=128, BN=64): the plan's rule gives it 2 stages, 102 KB, for 2 CTAs per SM
    assert (pre["static_smem"], pre["dynamic_smem"], pre["ctas_per_sm"], pre["hmma"]) == (0, 104448, 2, 1)
    gat = rows[("sm_90", "paged_kv_gather_kernel<uint4>")]
    assert (gat["threads"], gat["threads_from"], gat["dynamic_smem"]) == (256, "fallback", 0)
    assert [k for k, r in rows.items() if r["local_memory"]] == [("sm_90", "spilly_kernel")]


@needs_cxxfilt
def test_main_with_stored_output_fails_on_local_memory(tmp_path, monkeypatch, capsys):
    # A stand-in cuobjdump that prints the stored samples: the whole CLI path, exit status and JSON.
    for name, text in [("lelf", "ELF file    1: x.1.sm_80.cubin\nELF file    2: x.2.sm_90.cubin\n"),
                       ("res", RES_USAGE), ("elf", ELF), ("sass", SASS)]:
        (tmp_path / f"{name}.txt").write_text(text)
    fake = tmp_path / "cuobjdump"
    fake.write_text(f"""#!/bin/sh
d={tmp_path}
case "$1" in -lelf) cat $d/lelf.txt;; -res-usage) cat $d/res.txt;; -elf) cat $d/elf.txt;; -sass) cat $d/sass.txt;;
  *) exit 3;; esac
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    so = tmp_path / "_C.so"
    so.write_bytes(b"")
    monkeypatch.setenv("CUOBJDUMP", str(fake))
    out_json = tmp_path / "rows.json"
    assert sr.main(["--so", str(so), "--arch", "sm_90", "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert "FAIL local memory: sm_90 spilly_kernel: STL 1 (8 B), LDL 1 (4 B), stack 16 B" in out
    assert "FAIL PDL: sm_90 spilly_kernel: ACQBULK 0, PREEXIT 0" in out and "FAIL PDL: sm_90 window" not in out
    assert "window_attention_prefill_kernel<__half, __half, 128, 64>" in out and "summary: 4 kernel cubins" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["arch"] for r in rows} == {"sm_90"} and len(rows) == 4
    assert "warning" not in out
    assert sr.main(["--so", str(so), "--arch", "sm_86"]) == 2  # an arch the .so lacks: an error, not a pass
    # A kernel that touches shared memory with neither static nor tabled dynamic bytes is called out.
    monkeypatch.setattr(sr, "DYNAMIC_SMEM", [])
    capsys.readouterr()
    assert sr.main(["--so", str(so), "--arch", "sm_90"]) == 1
    assert "warning: sm_90 window_attention_prefill_kernel<__half, __half, 128, 64>: accesses shared memory" in \
        capsys.readouterr().out


def test_combine_order():
    """The decode combine's instruction order: every lse load (8 LDG), then the partials' cp.async (LDGSTS), then the
    first use of a loaded lse (STS) and the first cp.async wait (DEPBAR); a kernel without the split counter's ATOMG
    has no combine."""
    head = ["LDGSTS.E.BYPASS.128", "HMMA.16816.F32", "ATOMG.E.MAX.64.STRONG.GPU", "ATOMG.E.ADD.64.STRONG.GPU",
            "STS", "BAR.SYNC.DEFER_BLOCKING"]
    lse = ["LDG.E.STRONG.GPU"] * 8
    good = head + lse + ["IMAD", "LDGSTS.E.BYPASS.128", "LDGSTS.E.BYPASS.128", "LDGDEPBAR", "STS", "BAR.SYNC",
                         "DEPBAR.LE", "LDS.128"]
    assert sr.combine_order(good) == "ok"
    assert sr.combine_order(head[:2] + lse + ["LDGSTS.E.BYPASS.128"]) == "-"
    # an lse used (stored as a weight) before the partial copies are issued: one round trip more
    assert sr.combine_order(head + lse + ["STS", "LDGSTS.E.BYPASS.128", "DEPBAR.LE"]) == "BAD"
    # copies issued one split at a time, each waited for before the next
    assert sr.combine_order(head + lse + ["DEPBAR.LE", "LDGSTS.E.BYPASS.128", "STS"]) == "BAD"
    # fewer lse loads than splits' worth before the copies (loads issued inside the copy loop)
    assert sr.combine_order(head + lse[:4] + ["LDGSTS.E.BYPASS.128"] + lse[4:] + ["STS", "DEPBAR.LE"]) == "BAD"
    assert sr.combine_order(head + lse + ["STS", "DEPBAR.LE"]) == "BAD"  # no cp.async at all


def test_fence_scope():
    """Decode's split-KV publication: one thread's fences (each MEMBAR behind a branch some threads take after the
    CTA barrier) pass; a MEMBAR.SC, or a MEMBAR that every thread past the barrier runs, fails (issue 34)."""
    def insn(pc, op, pred=None, operands=""):
        return (pc, pred, op, operands)
    one_thread = [insn(0x10, "BAR.SYNC.DEFER_BLOCKING"), insn(0x20, "ISETP.NE.AND"),
                  insn(0x30, "BRA", "@P0", " 0x90"), insn(0x40, "ATOMG.E.MAX.64.STRONG.GPU"),
                  insn(0x50, "MEMBAR.ALL.GPU"), insn(0x60, "ATOMG.E.ADD.64.STRONG.GPU"),
                  insn(0x70, "BRA", "@P1", " 0x90"), insn(0x80, "MEMBAR.ALL.GPU"), insn(0x88, "CCTL.IVALL"),
                  insn(0x90, "BAR.SYNC.DEFER_BLOCKING")]
    assert sr.fence_scope(one_thread) == "1T x2"
    assert sr.fence_scope([insn(0x10, "BAR.SYNC"), insn(0x20, "LDS")]) == "-"
    every = [insn(0x10, "STG.E"), insn(0x20, "MEMBAR.SC.GPU"), insn(0x30, "CCTL.IVALL"), insn(0x40, "BAR.SYNC")]
    assert sr.fence_scope(every) == "SC"
    # a MEMBAR.ALL with no branch over it since the barrier, or only a backward branch: every thread runs it
    assert sr.fence_scope([insn(0x10, "BAR.SYNC"), insn(0x20, "MEMBAR.ALL.GPU")]) == "ALL"
    assert sr.fence_scope([insn(0x10, "BAR.SYNC"), insn(0x20, "BRA", "@P0", " 0x10"),
                           insn(0x30, "MEMBAR.ALL.GPU")]) == "ALL"
    # a branch before the barrier does not guard a fence after it
    assert sr.fence_scope([insn(0x10, "BRA", "@P0", " 0x90"), insn(0x20, "BAR.SYNC"),
                           insn(0x30, "MEMBAR.ALL.GPU")]) == "ALL"



def test_fence_scope_cluster_barrier():
    """The sm_90 cluster combine's barrier release (MEMBAR.ALL.GPU, CGAERRBAR, UCGABAR_ARV: every thread of the cluster
    path) is counted apart from the split-KV fences: one passes beside them or alone; two fail (the exit barrier must
    stay relaxed); a MEMBAR.SC there fails; a MEMBAR.ALL every thread runs that is no cluster barrier still fails."""
    def insn(pc, op, pred=None, operands=""):
        return (pc, pred, op, operands)
    cbr = [insn(0x100, "MEMBAR.ALL.GPU"), insn(0x108, "CGAERRBAR"), insn(0x110, "UCGABAR_ARV"),
           insn(0x118, "UCGABAR_WAIT"), insn(0x120, "CCTL.IVALL")]
    relaxed = [insn(0x200, "UCGABAR_ARV"), insn(0x208, "UCGABAR_WAIT")]
    one_thread = [insn(0x10, "BAR.SYNC"), insn(0x30, "BRA", "@P0", " 0x90"), insn(0x50, "MEMBAR.ALL.GPU"),
                  insn(0x60, "ATOMG.E.ADD.64.STRONG.GPU"), insn(0x70, "BRA", "@P1", " 0x90"),
                  insn(0x80, "MEMBAR.ALL.GPU"), insn(0x90, "BAR.SYNC")]
    assert sr.fence_scope(one_thread + cbr + relaxed) == "1T x2 CBR x1"
    assert sr.fence_scope([insn(0x10, "BAR.SYNC")] + cbr + relaxed) == "CBR x1"
    assert sr.fence_scope([insn(0x10, "BAR.SYNC")] + cbr + [insn(0x1f0, "STG.E")] + cbr) == "CBR"
    assert sr.fence_scope([insn(0x10, "BAR.SYNC"), insn(0x20, "MEMBAR.SC.GPU"), insn(0x28, "UCGABAR_ARV")]) == "SC"
    assert sr.fence_scope([insn(0x10, "BAR.SYNC")] + cbr + [insn(0x130, "BAR.SYNC"),
                                                           insn(0x140, "MEMBAR.ALL.GPU")]) == "ALL"


def test_pdl_order():
    """sm_90: a wait (ACQBULK) above every global access and a trigger (PREEXIT); sm_80: neither instruction."""
    good = ["S2R", "LDC.64", "ULDC.64", "ACQBULK", "LDG.E.CONSTANT", "STG.E", "PREEXIT", "LDGSTS.E.BYPASS.128", "EXIT"]
    assert sr.pdl_order(good, "sm_90") == "ok"
    assert sr.pdl_order(good, "sm_90a") == "ok"
    # a load hoisted above the wait, a generic load there, a cp.async there, a store there
    for early in ("LDG.E.128", "LD.E", "LDGSTS.E.BYPASS.128", "STG.E.128", "ATOMG.E.ADD.64.STRONG.GPU"):
        assert sr.pdl_order(["S2R", early, "ACQBULK", "PREEXIT", "EXIT"], "sm_90") == "BAD", early
    assert sr.pdl_order([op for op in good if op != "ACQBULK"], "sm_90") == "BAD"  # no wait
    assert sr.pdl_order([op for op in good if op != "PREEXIT"], "sm_90") == "BAD"  # never triggers
    plain = [op for op in good if op not in ("ACQBULK", "PREEXIT")]
    assert sr.pdl_order(plain, "sm_80") == "-"
    assert sr.pdl_order(good, "sm_80") == "BAD"  # cannot happen with pdl.cuh's guard: the guard is what it checks


def _synthetic_key_loop(n_fmul=4, with_rescale=True):
    """A prefill-like key loop: a guarded cp.async, a rolled k-step loop (1 HMMA a trip), a masked block, a softcap
    block (tanh), an O rescale block (n_fmul FMUL, skippable or not), one more HMMA, the back edge."""
    ops = ["MOV R0, R1", "@P0 BRA kloop", "LDGSTS [R2], [R4.64]", "NOP", "kloop:HMMA.16816.F32 R8, R12, R14, R8",
           "@P1 BRA kloop", "@P2 BRA nomask", "ISETP.GE.AND P3, PT, R1, R2, PT", "FSEL R9, R9, -INF , P3",
           "nomask:@P3 BRA nocap", "MUFU.TANH R9, R9", "FMUL R9, R9, R3",
           "nocap:@P4 BRA " + ("pv" if with_rescale else "resc"), "resc:FMUL R20, R20, R5",
           *["FMUL R21, R21, R5"] * (n_fmul - 1), "pv:HMMA.16816.F32 R24, R12, R14, R24", "@P5 BRA top", "EXIT"]
    ops[1] = "top:" + ops[1]
    labels = {text.split(":", 1)[0]: i * 0x10 for i, text in enumerate(ops) if ":" in text.split(" ", 1)[0]}
    insns = []
    for i, text in enumerate(ops):
        text = text.split(":", 1)[1] if ":" in text.split(" ", 1)[0] else text
        pred, rest = (text.split(" ", 1) if text.startswith("@") else (None, text))
        op, _, args = rest.partition(" ")
        if op == "BRA":
            args = f"{labels[args]:#x}"
        insns.append((i * 0x10, pred, op, " " + args))
    return insns


def test_tile_paths_on_a_synthetic_key_loop():
    shape = dict(d=16, bn=8, fp8=False, mt=1, ns=1, nd=1, kd=2, threads=128)
    # unmasked: guard (falls into the copy), copy, NOP, 2 k-step trips x 2, 3 taken branches, HMMA, back edge;
    # + the 4 FMUL of the rescale; masked: + ISETP, FSEL, the rescale, never the tanh
    assert sr.tile_paths(_synthetic_key_loop(), shape) == {"unmasked": 12, "rescale": 16, "masked": 18, "hmma": 3}
    # the rescale block made unskippable: every path has it
    assert sr.tile_paths(_synthetic_key_loop(with_rescale=False), shape)["unmasked"] == 16
    # a rescale block short of 4 MT ND FMUL: no rescaled path, no figure rather than a wrong one
    assert sr.tile_paths(_synthetic_key_loop(n_fmul=3), shape) is None
    # no loop holding both cp.async and HMMA: no key loop
    assert sr.tile_paths([x for x in _synthetic_key_loop() if x[2] != "LDGSTS"], shape) is None


def test_parse_sass_prefill_tile_figures():
    """parse_sass hands a prefill kernel's instructions, predicates and branch targets to tile_paths, with the tiling
    of its template arguments (<__half, __half, 128, 64>: MT 2, NS 8, KD 8: 128 k-step trips of the 1-HMMA loop;
    the rescale is 4 x 2 x 16 = 128 FMUL)."""
    body = "\n".join(f"        /*{pc:04x}*/                   {(pred + ' ') if pred else ''}{op}{args} ;"
                     for pc, pred, op, args in _synthetic_key_loop(n_fmul=128))
    text = f"arch = sm_90\n\n\tFunction : {PREFILL}\n{body}\n"
    got = sr.parse_sass(text)[("sm_90", PREFILL)]["tile"]
    assert got == {"unmasked": 3 + 256 + 5, "rescale": 264 + 128, "masked": 264 + 2 + 128, "hmma": 129}


def test_tile_paths_runs_every_inner_loop():
    """A branch around the k-step loop (a compiler's remainder code) is not a tile: the path must run the loop."""
    ops = [(0x00, None, "MOV", " R0, R1"), (0x10, "@P0", "BRA", " 0x40"), (0x20, None, "HMMA.16816.F32", " R8"),
           (0x30, "@P1", "BRA", " 0x20"), (0x40, None, "LDGSTS", " [R2]"), *[(0x50 + 0x10 * k, None, "FMUL", " R9")
                                                                           for k in range(4)],
           (0x90, "@P5", "BRA", " 0x10"), (0xa0, None, "EXIT", "")]
    shape = dict(d=16, bn=8, fp8=False, mt=1, ns=1, nd=1, kd=2, threads=128)
    # guard + 2 trips x 2 + copy + 4 FMUL + back edge, never the 6 of the path around the loop
    assert sr.tile_paths(ops, shape) == {"unmasked": 11, "rescale": 11, "masked": 11, "hmma": 2}
