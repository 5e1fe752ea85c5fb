#!/usr/bin/env python3
"""Fault injection for the CUDA sources run under the SIMT emulator (issue 9, item 6).

Each fault replaces a piece of text in a file under csrc/ with a bug, in a temporary copy of csrc/; the text is the one
just below the fault's marker line `// FAULT(site)` (several faults may share a site), so a kernel edit that keeps the
marker above the line it edits keeps the fault table valid. The copy
is built and run with the fault's own commands, and the table says whether the bug was caught and how (compile,
sanitizer, emulator report, wrong output). The unmodified copy must pass every distinct command pair first, else the
table would mean nothing. Run it once per kernel change and paste the table into the note:

    python3 scripts/simt_faults.py            # all faults, 2 at a time
    python3 scripts/simt_faults.py -k gemm    # only faults whose name contains "gemm"

To add a fault, append a Fault to FAULTS: `build` and `run` are shell command templates with {src} (the faulted copy
of csrc/), {out} (an empty build folder), {repo} (the repository root) and {python} (this interpreter).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")

# The C++ driver of the primitives (csrc/simt/tests/primitives.cpp); `gemm` runs only its tiled GEMM cases.
_CXX = f"g++ -std=c++20 -pthread -DARKERNELS_SIMT -ftrivial-auto-var-init=pattern -I{CUDA_HOME}/include -I{{src}}"
PRIMITIVES_BUILD = _CXX + " -O2 {src}/simt/tests/primitives.cpp -o {out}/primitives"
PRIMITIVES_BUILD_TSAN = _CXX + " -O1 -g -fsanitize=thread {src}/simt/tests/primitives.cpp -o {out}/primitives"
PRIMITIVES_RUN = "{out}/primitives gemm"

# How a failed run was caught, from its output; every pattern that matches is listed.
HOW = [
    ("sanitizer", re.compile(r"ThreadSanitizer|AddressSanitizer|LeakSanitizer|runtime error:")),
    ("emulator report", re.compile(r"^\[simt\]|\[emulator reports\]", re.M)),
    ("wrong output", re.compile(r"\bFAIL\b|^FAILED |\d+ failed", re.M)),
]


@dataclasses.dataclass
class Fault:
    name: str
    file: str  # under csrc/
    site: str  # the marker line `// FAULT(site)` in that file, just above the text the fault edits
    find: str  # exact text, beginning in one of the two lines after the marker (its first occurrence there)
    replace: str
    build: str = PRIMITIVES_BUILD
    run: str = PRIMITIVES_RUN
    # what counts as caught: a crash too (the catching test dies on the bad access, e.g. a segfault or an abort:
    # the suite fails loudly), never a timeout (a busy machine is not a catch)
    caught_by: tuple = ("compile", "sanitizer", "emulator report", "wrong output", "crash")
    timeout: int = 600
    runs: int = 1  # runs of the one build: a timing-dependent catch shows as k/runs


_PRIM = "simt/tests/primitives.cpp"
_WAIT = "    dev::cp_async_wait<1>();\n    __syncthreads();  // every thread's copies of stage s are visible\n"
_SYNC_TOP = "    __syncthreads();  // every thread's copies of stage s are visible\n"
_SYNC_END = "    __syncthreads();  // stage s is refilled by the next iteration's cp.async\n"
FAULTS = [
    Fault("gemm: ldmatrix .trans dropped (B)", _PRIM,
          "gemm_ldmatrix_b", "dev::ldmatrix_x4_trans(r, &Bs", "dev::ldmatrix_x4(r, &Bs"),
    Fault("gemm: ldmatrix .trans added (A)", _PRIM,
          "gemm_ldmatrix_a", "dev::ldmatrix_x4(a[mi]", "dev::ldmatrix_x4_trans(a[mi]"),
    Fault("gemm: cp.async wait before the stage removed", _PRIM, "gemm_stage_wait", _WAIT, _SYNC_TOP),
    Fault("gemm: cp.async wait_group 2 instead of 1", _PRIM, "gemm_stage_wait", _WAIT, _WAIT.replace("<1>", "<2>")),
    Fault("gemm: __syncthreads after the wait removed", _PRIM, "gemm_stage_wait", _SYNC_TOP, ""),
    Fault("gemm: __syncthreads after the wait removed (TSan)", _PRIM,
          "gemm_stage_wait", _SYNC_TOP, "", build=PRIMITIVES_BUILD_TSAN),
    # Caught only when a warp runs ahead into the refill while another still reads the stage (timing), and TSan misses
    # it while simt.h's std::barrier gives it false happens-before edges (libstdc++'s shared atomic-wait pools).
    Fault("gemm: __syncthreads before the refill removed", _PRIM, "gemm_refill_sync", _SYNC_END, "", runs=5),
    Fault("gemm: __syncthreads before the refill removed (TSan)", _PRIM,
          "gemm_refill_sync", _SYNC_END, "", build=PRIMITIVES_BUILD_TSAN,
          runs=5),
    Fault("gemm: chunks past the edge read anyway (src_bytes 16)", _PRIM,
          "gemm_copy_a", "gk : A, in ? 16 : 0", "gk : A, 16"),
    Fault("gemm: accumulators not zeroed", _PRIM,
          "gemm_acc_zero", "  for (int i = 0; i < 32; ++i) acc[i / 16][(i / 4) % 4][i % 4] = 0.f;\n", ""),
]


# The hand-written kernels (csrc/<stem>_kernels.cuh) through the emulator library (arkernels/simt.py) and a slice of
# their emulated pytest cases (the "simt" device of tests/test_window_attention.py and tests/test_paged_kv.py).
KERNEL_BUILD = "PYTHONPATH={repo} {python} -m arkernels.simt build --src {src} --out {out}"
KERNEL_BUILD_TSAN = KERNEL_BUILD + " --sanitize thread"
_TSAN = "LD_PRELOAD=$(gcc -print-file-name=libtsan.so) TSAN_OPTIONS=halt_on_error=1 "


_KERNEL_TESTS = ("test_window_attention.py", "test_paged_kv.py")


def _kernel_run(select: str, tsan: bool = False, tests: tuple = _KERNEL_TESTS) -> str:
    files = " ".join(f"{{repo}}/tests/{t}" for t in tests)
    return ((_TSAN if tsan else "") + "PYTHONPATH={repo} OMP_NUM_THREADS=1 TRITON_INTERPRET=1 ARKERNELS_SIMT_REQUIRED=1 "
            "ARKERNELS_SIMT_LIB={out}/arkernels_simt.so {python} -m pytest -s -x -q -p no:cacheprovider -m simt "
            f"-k '{select}' {files}")


_DECODE_FILE = "window_attention_decode.cuh"
_DECODE = ("decode_grid and 13-16 or decode_long_context or decode_traffic and heads1 or stages_and_groups and 128 "
           "or fp8_cache and False or split_combine or q_scale_spans_warps")
_PREFILL = ("prefill_grid and gqa1-128 or prefill_grid and gqa0-64 or 99kb or prefill_traffic and 24-heads1 "
            "or prefill_fp8 and 80-sm_90 or prefill_fp8 and 256-sm_89 or invalid_blocks and True-True "
            "or invalid_blocks and True-False")
_K_WAIT = "    cp_async_wait_n(2 * stages - 1);  // K of tile t landed (this thread's copies) ...\n"
_K_SYNC = "    __syncthreads();                  // ... and everyone's\n"
_PF = "window_attention_prefill.cuh"
_PF_WAIT = ("      if (stages == 3) {\n        dev::cp_async_wait<2>();\n      } else {\n        dev::cp_async_wait<1>();\n"
            "      }\n")


# The visibility lower bound (window, kv_start, chunk) is written once for both kernels (and the CPU kernel, which the
# emulator build does not include).
_MASK = "window_attention_mask.h"
_WINDOW_LO = "if (window > 0 && i - window + 1 > lo) lo = i - window + 1;"
_WINDOW_LO_OFF = "if (window > 0 && i - window > lo) lo = i - window;"
_CHUNK_LO = "const I c = s + (i - s) / chunk * chunk;"


def _decode_fault(what: str, site: str, find: str, replace: str) -> Fault:
    """A fault in the decode kernel, caught (or not) by the decode slice of the emulated tests."""
    return Fault(f"decode: {what}", _DECODE_FILE, site, find, replace, build=KERNEL_BUILD, run=_kernel_run(_DECODE))


def _prefill_fault(what: str, site: str, find: str, replace: str) -> Fault:
    """A fault in the prefill kernel, caught (or not) by the prefill slice of the emulated tests."""
    return Fault(f"prefill: {what}", _PF, site, find, replace, build=KERNEL_BUILD, run=_kernel_run(_PREFILL))


# Attention sinks and chunked attention (issue 21): caught by tests/test_window_attention_sinks.py.
_SINKS_TESTS = ("test_window_attention_sinks.py",)
_SINK_DECODE = "sinks_decode and 64-dtype1 or sinks_decode and 256-dtype2 or sinks_decode_splits and 1-simt"
_SINK_PREFILL = ("sinks_prefill and 64-dtype1 or sinks_prefill and 80-dtype2 or sinks_prefill and 128-dtype1 "
                 "or sinks_chunked_fp8 and True-128")
_CHUNK = ("chunked_decode and 16-0 or chunked_decode and 13-5 or chunked_prefill and 0-16 or chunked_prefill and 20-37 "
          "or chunked_decode_traffic and False-0")
_SINK_HERE = "const bool sink_here = p.sinks != nullptr && nsplits == 1;"
_COMBINE_SINK = "    if (lane == 0 && sink2 != neg_inf()) sum += exp2f(sink2 - m);\n"
_PF_SINK = "if (p.sinks) lse2 = add_sink_log2(lse2, dev::ld_global(p.sinks + h) * kLog2e, w);"


def _sinks_fault(what: str, file: str, site: str, find: str, replace: str, select: str) -> Fault:
    return Fault(what, file, site, find, replace, build=KERNEL_BUILD, run=_kernel_run(select, tests=_SINKS_TESTS))


_SINK_FAULTS = [
    _sinks_fault("decode: sink dropped (one split)", _DECODE_FILE,
                 "decode_sink_here", _SINK_HERE, "const bool sink_here = false;",
                 _SINK_DECODE),
    _sinks_fault("decode: sink dropped in the split-KV combine", _DECODE_FILE,
                 "combine_sink", _COMBINE_SINK, "", _SINK_DECODE),
    _sinks_fault("decode: sink added twice (by every split's partial and by the combine)", _DECODE_FILE,
                 "decode_sink_here", _SINK_HERE,
                 "const bool sink_here = p.sinks != nullptr;", _SINK_DECODE),
    _sinks_fault("decode: sink added by every lane of the combine (32 times)", _DECODE_FILE,
                 "combine_sink", _COMBINE_SINK,
                 _COMBINE_SINK.replace("lane == 0 && ", ""), _SINK_DECODE),
    _sinks_fault("decode: the combine takes the sink of head r of the chunk, not the row's head", _DECODE_FILE,
                 "combine_sink_head",
                 "dev::ld_global(p.sinks + head_s[r]) * kLog2e : neg_inf();", "dev::ld_global(p.sinks + r) * kLog2e : "
                 "neg_inf();", _SINK_DECODE),
    _sinks_fault("prefill: sink dropped", _PF, "prefill_sink", _PF_SINK, "", _SINK_PREFILL),
    _sinks_fault("prefill: sink added twice", _PF,
                 "prefill_sink", _PF_SINK, _PF_SINK + "\n        " + _PF_SINK, _SINK_PREFILL),
    _sinks_fault("prefill: sink multiplied by the score scale", _PF,
                 "prefill_sink", "dev::ld_global(p.sinks + h) * kLog2e",
                 "dev::ld_global(p.sinks + h) * p.scale * kLog2e", _SINK_PREFILL),
    _sinks_fault("prefill: a packed row takes its KV head's first sink", _PF,
                 "prefill_sink", "dev::ld_global(p.sinks + h)",
                 "dev::ld_global(p.sinks + kvh * group)", _SINK_PREFILL),
    _sinks_fault("chunk boundary off by one (a chunk's last query starts the next chunk)", _MASK, "chunk_lo", _CHUNK_LO,
                 "const I c = s + (i - s + 1) / chunk * chunk;", _CHUNK),
    _sinks_fault("chunk boundary off by one (a chunk's first query sees the previous chunk)", _MASK,
                 "chunk_lo", _CHUNK_LO,
                 "const I c = s + (i - s - 1) / chunk * chunk;", _CHUNK),
    _sinks_fault("chunks counted from position 0, not from kv_start (left padding)", _MASK, "chunk_lo", _CHUNK_LO,
                 "const I c = i / chunk * chunk;", _CHUNK),
    _sinks_fault("decode: split planning ignores the chunk (as many splits as the whole context)", _DECODE_FILE,
                 "split_plan_chunk", "  if (chunk > 0) max_keys = std::min<int64_t>(max_keys, chunk);\n", "", _CHUNK),
]

# The decode tail (issue 26): epoch-stamped split counters, the combine's batched partial loads, one-wave planning;
# caught by tests/test_window_attention_decode_tail.py (and the split-KV cases of tests/test_window_attention.py).
_TAIL_TESTS = ("test_window_attention_decode_tail.py", "test_window_attention.py")
_TAIL = "aborted_launch and last or combine_reads and 64 or split_combine and 0-simt"
_LAUNCH = "window_attention_launch.h"
_RETURN = "  return dev::atomic_add_release(counter, 1ull) == base + p.num_splits - 1;"
_ARRIVE = "  dev::atomic_max(counter, base);\n  // FAULT(split_release)\n" + _RETURN + "\n"
_ACQUIRE = "    if (last) dev::fence_acq_rel();  // the acquire: the partials every release before the count published\n"


def _tail_fault(what: str, file: str, site: str, find: str, replace: str) -> Fault:
    return Fault(f"decode tail: {what}", file, site, find, replace, build=KERNEL_BUILD,
                 run=_kernel_run(_TAIL, tests=_TAIL_TESTS))


_TAIL_FAULTS = [
    # (a base shifted by a whole epoch, (epoch - 1) * kMaxSplits, is the same protocol relabelled: not a fault)
    _tail_fault("last-CTA compare off by one (the next-to-last arrival combines)", _DECODE_FILE,
                "split_release", _RETURN, _RETURN.replace("num_splits - 1;", "num_splits - 2;")),
    _tail_fault("epoch not advanced per launch", _LAUNCH,
                "split_epoch", "out.epoch = ++e.epoch;", "out.epoch = e.epoch + 1;"),
    # the protocol before epochs: plain counts from 0, reset by the last CTA; only an aborted launch shows it
    _tail_fault("counters reset by their last CTA instead of an epoch (an aborted launch poisons the next)",
                _DECODE_FILE, "split_arrive", _ARRIVE,
                "  (void)base;\n  const bool last = dev::atomic_add_release(counter, 1ull) == p.num_splits - 1;\n"
                "  if (last) dev::atomic_add(counter, 0ull - p.num_splits);\n  return last;\n"),
    # issue 34: one thread's release / acquire instead of every thread's fence.sc; the emulator takes back the
    # partials no release published (the last CTA reads poison) and reports a load of another CTA's published
    # partials that no acquire ordered (this replaces the safety entry "__threadfence before the split counter
    # removed": the fence is gone)
    _tail_fault("the count's release dropped (a relaxed add publishes no partial)", _DECODE_FILE,
                "split_release", "dev::atomic_add_release(counter, 1ull)", "dev::atomic_add(counter, 1ull)"),
    _tail_fault("the last CTA's acquire dropped", _DECODE_FILE, "split_acquire", _ACQUIRE, ""),
    _tail_fault("the barrier before the release removed (thread 0 releases only its own partials)", _DECODE_FILE,
                "split_fence",
                "  __syncthreads();  // every thread's partials are stored (and the merge's shared-memory reads are over)\n",
                ""),
    _tail_fault("combine: a split's partial skipped (the last of each round)", _DECODE_FILE,
                "combine_splits", "        for (int s = 0; s < n; ++s) {", "        for (int s = 0; s + 1 < n; ++s) {"),
    _tail_fault("combine: weights of split s taken from split s + 1", _DECODE_FILE,
                "combine_weights", "const float w = w_s[(s0 + s) * kDecodeRows + r];",
                "const float w = w_s[(s0 + s + 1 < ns ? s0 + s + 1 : s0 + s) * kDecodeRows + r];"),
]

FAULTS += [
    _decode_fault("cp.async wait for the K tile removed", "decode_k_wait", _K_WAIT, ""),
    Fault("decode: __syncthreads after the K wait removed (TSan)", _DECODE_FILE, "decode_k_sync", _K_SYNC, "",
          build=KERNEL_BUILD_TSAN, run=_kernel_run(_DECODE, tsan=True)),
    Fault("decode: window off by one (W + 1 keys)", _MASK, "window_lo", _WINDOW_LO, _WINDOW_LO_OFF, build=KERNEL_BUILD,
          run=_kernel_run(_DECODE)),
    _decode_fault("ldmatrix .trans dropped for V",
                  "decode_v_ldmatrix", "dev::ldmatrix_x4_trans(vf, v_s + v_row * SLD + dp * 16",
                  "dev::ldmatrix_x4(vf, v_s + v_row * SLD + dp * 16"),
    _decode_fault("wrong quad shuffle in the row max",
                  "decode_row_max", "mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));",
                  "mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 4));"),
    _decode_fault("O not rescaled by the new running max", "decode_o_rescale", "    o[nb][0] *= alpha[0];\n", ""),
    _decode_fault("split size rounded down",
                  "decode_per_split", "const int64_t per_split = (tiles + nsplits - 1) / nsplits;",
                  "const int64_t per_split = tiles / nsplits;"),
    _decode_fault("masked keys read anyway (src_bytes 16)",
                  "decode_masked_copy", "src + (o[i] & kOffBits) + c * kChunkElems, o[i] >= 0);",
                  "src + (o[i] & kOffBits) + c * kChunkElems, true);"),
    _decode_fault("fp8 v_scale not applied", "decode_out_scale", "Conv<T>::from_float(acc * inv * v_scale)",
                  "Conv<T>::from_float(acc * inv)"),
    _decode_fault("fp8 V: wrong byte permute in fp8_pv (keys of one dim not paired; shared with prefill)",
                  "fp8_pv_permute", "p0 = __byte_perm(lo_keys, 0u, 0x3120u)", "p0 = __byte_perm(lo_keys, 0u, 0x3210u)"),
    _decode_fault("fp8 K: query columns not permuted like the K fragments",
                  "decode_fp8_q_cols", "fp8_k_col((c % 2) * 8 + x)] = e[x];", "(c % 2) * 8 + x] = e[x];"),
    _decode_fault("fp8 V: O columns not put back in place",
                  "decode_fp8_o_dims", "const int d0 = fp8_o_dim(nb, 2 * t4), d1 = fp8_o_dim(nb, 2 * t4 + 1);",
                  "const int d0 = nb * 8 + 2 * t4, d1 = d0 + 1;"),
    _decode_fault("split-KV: the highest split index taken to be the last CTA",
                  "split_release", _RETURN,
                  "  return (dev::atomic_add_release(counter, 1ull), int(blockIdx.x) == p.num_splits - 1);"),
    _decode_fault("QK^T: the odd k-steps' chain never added (4 chains, issue 34)",
                  "decode_qk_chains", "      s[nb][x] += s1[nb][x];\n", "      (void)s1;\n"),
    _decode_fault("softcap variant never taken (uniform branch, issue 34)",
                  "decode_softcap", "  if (cap > 0.f) {", "  if (false) {"),
    _decode_fault("fp8 under bf16 queries: the Q scale's 2^-e not folded into the score scale (issue 34)",
                  "decode_q_down", "const float qk_scale = p.scale * k_scale * q_down;",
                  "const float qk_scale = p.scale * k_scale;"),
    _decode_fault("fp8 under bf16 queries: the Q scale from warp 0's |q| only (issue 34)",
                  "decode_q_cta_max", "  for (int w = 1; w < kDecodeWarps; ++w) mx = max(mx, max_s[w]);\n", ""),
    *_TAIL_FAULTS,
    Fault("prefill: window off by one (W + 1 keys)", _MASK, "window_lo", _WINDOW_LO, _WINDOW_LO_OFF, build=KERNEL_BUILD,
          run=_kernel_run(_PREFILL)),
    _prefill_fault("ldmatrix .trans dropped (V)",
                   "prefill_v_ldmatrix", "dev::ldmatrix_x4_trans(r, vs +", "dev::ldmatrix_x4(r, vs +"),
    _prefill_fault("ldmatrix .trans added (K)",
                   "prefill_k_ldmatrix", "dev::ldmatrix_x4(r, ks +", "dev::ldmatrix_x4_trans(r, ks +"),
    _prefill_fault("cp.async wait before the tile removed", "prefill_tile_wait", _PF_WAIT, ""),
    _prefill_fault("cp.async wait_group 3 instead of 2 (3-stage ring)", "prefill_tile_wait", "dev::cp_async_wait<2>();",
                   "dev::cp_async_wait<3>();"),
    _prefill_fault("__syncthreads before the refill removed",
                   "prefill_refill_sync", "      if constexpr (!kFp8) __syncthreads();\n", ""),
    _prefill_fault("P.V k-step reads the wrong S tile pair",
                   "prefill_pv_pair", "a[mt][2] = pack_pair<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);",
                   "a[mt][2] = pack_pair<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);"),
    _prefill_fault("fp8 v_scale not applied",
                   "prefill_out_scale", "const float out_scale = kFp8 ? dev::ld_global(p.v_scale) : 1.f;",
                   "const float out_scale = 1.f;"),
    _prefill_fault("fp8 k_scale not folded into the score scale",
                   "prefill_qk_scale", "kFp8 ? p.scale * dev::ld_global(p.k_scale) : p.scale;", "p.scale;"),
    _prefill_fault("fp8 valid flags ignored", "prefill_fp8_flags", "flag_s[(it % stages) * BN + tid];", "1;"),
    *_SINK_FAULTS,
    Fault("append: negative (padding) slots written", "paged_kv_kernels.cuh",
          "append_slot_check", "if (slot < 0 || slot >= num_slots)",
          "if (slot >= num_slots)", build=KERNEL_BUILD, run=_kernel_run("append_grid and 13-64 or append_traffic")),
]


# ---- memory safety (issue 27): each fault the adversarial review found surviving, with the named test that now
# catches it. Kernel faults run the named tests on the emulator; the PTX fault runs tests/test_simt_ptx.py's nvcc
# check on the faulted copy (no GPU: nvcc -ptx, the operand binding read back from the PTX).
# One selection for all of them (one baseline build instead of one per fault): the union of the catching tests, each
# fault's own named in its entry; -x stops a faulted run at the first failure, which the output tail names.
_SAFETY_TESTS = ("append_unchecked_never_writes_past_cache or offsets_past_2_31 or decode_split_combine or "
                 "k_and_v_of_different_layouts or kv_start_negative_or_past_the_sequence or hostile_input")
_SAFETY_RUN = _kernel_run(_SAFETY_TESTS, tests=_KERNEL_TESTS + ("test_window_attention_safety.py",))


def _safety_fault(what: str, file: str, site: str, find: str, replace: str, caught_by_test: str) -> Fault:
    """caught_by_test: the test (and parameters) that catches it."""
    return Fault(f"safety: {what} [{caught_by_test}]", file, site, find, replace, build=KERNEL_BUILD, run=_SAFETY_RUN,
                 timeout=2400)  # a build is a few minutes on a busy 2-core machine: a timeout must not read as caught


_PTX_RUN = ("ARKERNELS_PTX_CSRC={src} PYTHONPATH={repo} {python} -m pytest -x -q -p no:cacheprovider "
            "{repo}/tests/test_simt_ptx.py -k 'ptx_mma or ptx_ldmatrix'")
_PTX_F16_B = ('"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), '
              '"f"(c[3]));\n}\ntemplate <>\n__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>')
FAULTS += [
    _safety_fault("append: slot upper bound removed", "paged_kv_kernels.cuh",
                  "append_slot_check", "if (slot < 0 || slot >= num_slots) continue;", "if (slot < 0) continue;",
                  "test_paged_kv_append_unchecked_never_writes_past_cache[simt]"),
    _safety_fault("append: cache offsets truncated to 32 bits", "paged_kv_kernels.cuh",
                  "append_row",
                  "const int64_t row = (slot / block_size) * cache_s0 + (slot % block_size) * cache_s1 + h * cache_s2;",
                  "const int64_t row = int32_t((slot / block_size) * cache_s0 + (slot % block_size) * cache_s1 + "
                  "h * cache_s2);", "test_paged_kv_append_offsets_past_2_31_elements[simt]"),
    _safety_fault("gather: cache offsets truncated to 32 bits", "paged_kv_kernels.cuh",
                  "gather_offset", "dev::ld_global(k_cache + blk * cache_s0 + off * cache_s1 + h * cache_s2 + u)",
                  "dev::ld_global(k_cache + int32_t(blk * cache_s0 + off * cache_s1 + h * cache_s2 + u))",
                  "test_paged_kv_gather_offsets_past_2_31_elements[simt]"),
    _safety_fault("decode: V offsets computed from K's strides", _DECODE_FILE,
                  "decode_kv_offsets",
                  "vo = blk * p.s.v0 + jo * p.s.v1 + kvh * p.s.v2;", "vo = blk * p.s.k0 + jo * p.s.k1 + kvh * p.s.k2;",
                  "test_window_attention_k_and_v_of_different_layouts[decode, simt]"),
    _safety_fault("decode: negative kv_start not clamped", _DECODE_FILE,
                  "decode_first_key", "lo = window_attention_first_key<int64_t>(i, kv_start, p.window, p.chunk);",
                  "lo = kv_start < 0 ? kv_start : window_attention_first_key<int64_t>(i, kv_start, p.window, p.chunk);",
                  "test_window_attention_kv_start_negative_or_past_the_sequence[decode, simt]"),
    _safety_fault("decode: cache offsets truncated to 32 bits", _DECODE_FILE,
                  "decode_kv_offsets",
                  "ko = blk * p.s.k0 + jo * p.s.k1 + kvh * p.s.k2;\n      vo = blk * p.s.v0 + jo * p.s.v1 + kvh * "
                  "p.s.v2;", "ko = int32_t(blk * p.s.k0 + jo * p.s.k1 + kvh * p.s.k2);\n      vo = int32_t(blk * "
                  "p.s.v0 + jo * p.s.v1 + kvh * p.s.v2);", "test_window_attention_offsets_past_2_31_elements[decode, simt]"),
    _safety_fault("prefill: rows no sequence owns left unwritten", _PF,
                  "prefill_zero_unowned",
                  "  if (b == 0 || b == int64_t(gridDim.z) - 1) prefill_zero_unowned_rows<T, D>(p, b, kvh);\n", "",
                  "test_window_attention_hostile_input[cu_seqlens_q_*, simt]"),
    Fault("safety: PTX mma (f16) with its B registers swapped", "device_mma.cuh", "ptx_mma_f16_operands", _PTX_F16_B,
          _PTX_F16_B.replace('"r"(b[0]), "r"(b[1])', '"r"(b[1]), "r"(b[0])'), build="true", run=_PTX_RUN),
    Fault("safety: PTX ldmatrix_x2_trans without .trans", "device_mma.cuh",
          "ptx_ldmatrix_x2_trans", 'ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];',
          'ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];', build="true", run=_PTX_RUN),
]


# ---- prefill tile machinery (issue 26): the per-tile softcap variants and the fp8 tiles converted once per CTA,
# caught by tests/test_window_attention_prefill_layout.py (and the prefill slice above).
_LAYOUT_TESTS = ("test_window_attention_prefill_layout.py",)
_LAYOUT = "fp8_equals_16bit and (dtype1-128-sm_90-bn32 or dtype0-256-sm_89) or softcap_variants and 128"
_LAYOUT_TSAN = "fp8_equals_16bit and (dtype0-128-sm_90-bn32 or dtype0-256-sm_89)"
_PF_CVT_SYNC = ("  __syncthreads();  // the 16-bit tiles are complete; ring stage it % stages may be "
                "refilled from here on\n")
_PF_SOFTCAP = "  if (p.softcap > 0.f) {\n    if (masked) {"


def _layout_fault(what: str, site: str, find: str, replace: str, tsan: bool = False) -> Fault:
    return Fault(f"prefill: {what}" + (" (TSan)" if tsan else ""), _PF, site, find, replace,
                 build=KERNEL_BUILD_TSAN if tsan else KERNEL_BUILD,
                 run=_kernel_run(_LAYOUT_TSAN if tsan else _LAYOUT, tsan=tsan, tests=_LAYOUT_TESTS))


FAULTS += [
    _layout_fault("softcap variant never taken",
                  "prefill_softcap", _PF_SOFTCAP, _PF_SOFTCAP.replace("p.softcap > 0.f", "false")),
    _layout_fault("softcap variant always taken",
                  "prefill_softcap", _PF_SOFTCAP, _PF_SOFTCAP.replace("p.softcap > 0.f", "true")),
    _layout_fault("softcap's 1 / softcap not folded into the score scale",
                  "prefill_score_mul", "(p.softcap > 0.f ? qk_scale / p.softcap : qk_scale * kLog2e)",
                  "(p.softcap > 0.f ? qk_scale : qk_scale * kLog2e)"),
    _layout_fault("fp8 conversion skipped (the warps read the Q tile or poison)",
                  "prefill_fp8_convert_store",
                  "    *reinterpret_cast<uint4*>(cv_s + row * LD + c * 8) = h;\n", ""),
    _layout_fault("fp8 conversion of the K rows only (V left unconverted)",
                  "prefill_fp8_convert_rows", "for (int i = 0; i < 2 * BN * kC / NT; ++i) {",
                  "for (int i = 0; i < BN * kC / NT; ++i) {"),
    _layout_fault("fp8 valid flags not carried into the 16-bit tile",
                  "prefill_fp8_flag_copy", "    memcpy(cv_s + tid * LD + D, &flag, 2);\n", ""),
    _layout_fault("fp8 valid flags of ring stage 0 on every tile",
                  "prefill_fp8_flags", "flag_s[(it % stages) * BN + tid];",
                  "flag_s[tid];"),
    _layout_fault("fp8 barrier after the conversion removed", "prefill_fp8_convert_sync", _PF_CVT_SYNC, ""),
    _layout_fault("fp8 barrier after the conversion removed", "prefill_fp8_convert_sync", _PF_CVT_SYNC, "", tsan=True),
]


# ---- the 32-row warp layout of prefill (issue 26): a warp's two m16 halves share each K / V fragment but own their
# rows' Q fragments, masks, max and sum; caught by test_window_attention_prefill_warp_halves.
_HALVES = "warp_halves"


def _halves_fault(what: str, site: str, find: str, replace: str) -> Fault:
    return Fault(f"prefill 32-row warp: {what}", _PF, site, find, replace, build=KERNEL_BUILD,
                 run=_kernel_run(_HALVES, tests=_LAYOUT_TESTS))


FAULTS += [
    _halves_fault("second m16 half reads the first half's Q rows",
                  "prefill_q_frags", "dev::ldmatrix_x4(a[mt], q_warp + mt * kQHalf + kk * 16);",
                  "dev::ldmatrix_x4(a[mt], q_warp + kk * 16);"),
    _halves_fault("second m16 half masked with the first half's row ranges",
                  "prefill_row_mask", "const int row = prefill_lane_row<D>(mt, r);",
                  "const int row = prefill_lane_row<D>(0, r);"),
    _halves_fault("second m16 half's lse from the first half's row max",
                  "prefill_lse", "float lse2 = lr > 0.f ? m[mt][r] + log2f(lr) : neg_inf();",
                  "float lse2 = lr > 0.f ? m[0][r] + log2f(lr) : neg_inf();"),
]

# ---- prefill instruction diet (issue 34, item 5): the compile-time unmasked tile variant (picked per tile from the
# tile's position against every row's range and a warp vote over the keys' valid flags), the rows' key ranges kept in
# their Q rows' padding, scores scaled inside the exponent's FFMA, the O rescale skipped by a vote where no row max
# moved; caught by the prefill slice above (causal, windows, chunked caches, invalid block ids).
FAULTS += [
    _prefill_fault("unmasked variant on tiles crossing a row's range (no range test)",
                   "prefill_unmasked_pick", "const bool ranged = j0 < blk.lo_all || j0 + BN - 1 > blk.hi_all;",
                   "const bool ranged = false;"),
    # the prefill slice's invalid blocks lie on tiles that cross a row's range anyway; the layout test's block ids out
    # of range from table column 18 on fill whole tiles inside every row's range
    Fault("prefill: unmasked variant on tiles holding a key of an invalid block id (no flag vote)", _PF,
          "prefill_tile_vote", "const bool masked = ranged || !prefill_tile_valid<T, D, BN>(ks);",
          "const bool masked = ranged;", build=KERNEL_BUILD,
          run=_kernel_run("fp8_equals_16bit and 128-sm_90-bn32", tests=_LAYOUT_TESTS)),
    _prefill_fault("O rescale skipped unless every row of the warp moved its max (all instead of any)",
                   "prefill_rescale_vote", "if (dev::warp_any(moved)) {", "if (dev::warp_all(moved)) {"),
    _prefill_fault("O rescale decided by lane 0's rows only",
                   "prefill_rescale_vote", "if (dev::warp_any(moved)) {",
                   "if (__shfl_sync(0xffffffffu, int(moved), 0)) {"),
    _prefill_fault("row max kept in raw score units (not times the exponent's scale)",
                   "prefill_row_max", "fmaxf(m[mt][r], mx * c2);", "fmaxf(m[mt][r], mx);"),
    _prefill_fault("a row's last visible key one past its bound (Q-padding key range)",
                   "prefill_row_range", "make_int2(blk.first_key(p, tok), blk.last_key(tok))",
                   "make_int2(blk.first_key(p, tok), blk.last_key(tok) + 1)"),
]

# ---- fp8 caches under bf16 queries (issue 34, item 6): fp16 MMAs on a Q tile scaled by a power of two per warp;
# caught by the bf16 cases of tests/test_window_attention_prefill_layout.py (the exact relation to fp16 queries, and
# queries past fp16's range both ways).
_Q16 = "fp8_equals_16bit and dtype1-128-sm_90-bn32 or out_of_fp16"
FAULTS += [
    Fault("prefill: bf16 -> fp16 Q scale one binade too high (the largest |q| past 65504)", "device_mma.cuh",
          "bf16_f16_pow2", "const int e = 142 - ex;", "const int e = 143 - ex;", build=KERNEL_BUILD,
          run=_kernel_run(_Q16, tests=_LAYOUT_TESTS)),
    Fault("prefill: bf16 -> fp16 Q scale 2^-24 too low (small queries flushed)", "device_mma.cuh",
          "bf16_f16_pow2", "const int e = 142 - ex;", "const int e = 118 - ex;", build=KERNEL_BUILD,
          run=_kernel_run(_Q16, tests=_LAYOUT_TESTS)),
    Fault("prefill: the Q scale's 2^-e not folded into the score scale", "device_mma.cuh",
          "prefill_q_pow2_fold", "return pow2f(-e);", "return 1.f;", build=KERNEL_BUILD,
          run=_kernel_run(_Q16, tests=_LAYOUT_TESTS)),
]


def _sh(cmd: str, timeout: int) -> tuple[int, str, float]:
    t0 = time.time()
    env = dict(os.environ, SIMT_WATCHDOG=os.environ.get("SIMT_WATCHDOG", "30"))
    try:
        p = subprocess.run(cmd, shell=True, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, text=True, errors="replace")
        return p.returncode, p.stdout, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + "\n[timeout]", time.time() - t0


def _classify(rc: int, log: str) -> str:
    if rc == 0:
        return "passed"
    hows = [name for name, pat in HOW if pat.search(log)] + (["timeout"] if rc == 124 else [])
    return " + ".join(hows) or f"crash (exit {rc})"


CSRC = os.path.join(REPO, "csrc")  # the tree that is copied and faulted (--csrc)


def _attempt(build: str, run: str, timeout: int, edit=None, runs: int = 1) -> tuple[list[str], float, str]:
    """Copy csrc/, apply `edit`, build once, run `runs` times. Returns (how of each run, seconds, last output tail);
    how is "passed" where nothing failed."""
    with tempfile.TemporaryDirectory(prefix="simt_fault_") as tmp:
        src, out = os.path.join(tmp, "csrc"), os.path.join(tmp, "out")
        shutil.copytree(CSRC, src)
        os.mkdir(out)
        if edit:
            edit(src)
        fmt = dict(src=src, out=out, repo=REPO, python=sys.executable)
        rc, log, secs = _sh(build.format(**fmt), timeout)
        if rc:
            return ["compile"], secs, log[-2000:]
        hows = []
        for _ in range(runs):
            rc, log, t_run = _sh(run.format(**fmt), timeout)
            hows.append(_classify(rc, log))
            secs += t_run
        return hows, secs, log[-2000:]


def _site(text: str, fault: Fault) -> int:
    """Where `fault.find` begins: its first occurrence after the fault's marker line, which must begin in one of the
    two lines after the marker (a multi-line find may run on). The marker, not the text, names the site: a kernel
    edit elsewhere in the file (even one that repeats the text) leaves the fault valid."""
    marker = re.compile(rf"^[ \t]*// FAULT\({re.escape(fault.site)}\)[ \t]*\n", re.M)
    hits = list(marker.finditer(text))
    if len(hits) != 1:
        raise ValueError(f"{fault.name}: the marker // FAULT({fault.site}) occurs {len(hits)} times in "
                         f"csrc/{fault.file}, not once")
    start = hits[0].end()
    i = text.find(fault.find, start)
    if i < 0 or text.count("\n", start, i) >= 2:
        raise ValueError(f"{fault.name}: the text to replace does not begin in the two lines after "
                         f"// FAULT({fault.site}) in csrc/{fault.file}")
    return i


def _apply(fault: Fault):
    def edit(src: str):
        path = os.path.join(src, fault.file)
        with open(path) as f:
            text = f.read()
        i = _site(text, fault)
        with open(path, "w") as f:
            f.write(text[:i] + fault.replace + text[i + len(fault.find):])
    return edit


# Fixed (key, chunk) ownership of the decode tile copies (issue 26): copy i of a thread always moves chunk own_c(i) of
# key own_k(i); the offsets come from the tile's own slot of the per-tile block lookup.
FAULTS += [
    _decode_fault("fixed ownership: a thread's copy takes the offset of another of its keys (wrong key's row)",
                  "decode_copy_offsets", "o[i] = own_live(i) ? offs[own_k(i)] : kMaskedOff;",
                  "o[i] = own_live(i) ? offs[own_k((i + 1) % kOwn)] : kMaskedOff;"),
    _decode_fault("fixed ownership: K copies reuse the previous tile's block lookup (offset slot of tile t - 1)",
                  "decode_k_copy", "cta.koff_s + kslot * kDecodeTileKeys, live);",
                  "cta.koff_s + (kslot == 0 ? cta.stages - 1 : kslot - 1) * kDecodeTileKeys, live);"),
    _decode_fault("fixed ownership: the ring's issue stage not advanced (tiles copied over one stage)",
                  "decode_ring_advance", "    st_new = st_new + 1 == stages ? 0 : st_new + 1;\n", ""),
]


# The multi-query decode path (issue 33: speculative verification): per-row bounds of the packed (query row, head)
# rows, their union as the key loop's range, the rows' mapping to query rows and heads, the split-KV combine over rows
# of different query rows, the extra passes of an unchecked max_q_len, the rows no sequence owns, the dispatch rule;
# caught by tests/test_window_attention_multiquery.py.
def _mq_fault(what: str, site: str, find: str, replace: str) -> Fault:
    return Fault(f"multi-query decode: {what}", _DECODE_FILE, site, find, replace, build=KERNEL_BUILD,
                 run=_kernel_run("multiquery", tests=("test_window_attention_multiquery.py",)))


FAULTS += [
    _mq_fault("a row's causal limit one past its position (it sees the next query's key)", "mq_row_causal",
              "hi = min64(i, p.max_blocks * p.block_size - 1);", "hi = min64(i + 1, p.max_blocks * p.block_size - 1);"),
    _mq_fault("every row placed at the last query's position (decode's i = seq_len - 1)", "mq_row_position",
              "const int64_t i = seq_len - qlen + t;", "const int64_t i = seq_len - 1 + 0 * t;"),
    _mq_fault("per-row mask dropped (only the union's range and the key offsets mask)", "mq_row_mask",
              "seen = seen && k0 + c >= cta.rlo[r] && k0 + c <= cta.rhi[r];", "(void)r;"),
    _mq_fault("the key loop's union ends at the first row's limit", "mq_union_hi",
              "decode_row<kMulti>(p, rows, rows.hc - 1).t, unused, hi);", "decode_row<kMulti>(p, rows, 0).t, unused, hi);"),
    _mq_fault("the query tile packs rows head-major (head * q_len + t) unlike the rest (t * group + head)",
              "mq_row_head", "const DecodeRow row = decode_row<kMulti>(p, rows, r);",
              "DecodeRow row = decode_row<kMulti>(p, rows, r);\n      row.t = (rows.m0 + r) % rows.qlen;\n"
              "      row.head = rows.kvh * p.group + (rows.m0 + r) / rows.qlen;"),
    _mq_fault("the combine reads a split's rows as contiguous from the first row (decode's layout)", "mq_combine_rows",
              "(slot < row4 ? oh_s[r] * D + 4 * (slot - r * (D / 4)) : 0);",
              "(slot < row4 ? oh_s[0] * D + 4 * slot : 0);"),
    _mq_fault("no extra passes when a sequence has more rows than max_q_len (check=False)", "mq_passes",
              "m0 < packed;", "m0 < packed && m0 < int64_t(p.head_chunks) * kDecodeRows;"),
    _mq_fault("rows no sequence owns left unwritten", "mq_unowned_rows",
              "if (chunk == 0) prefill_zero_unowned_rows<T, D>(p, b, kvh);", "(void)kvh;"),
    Fault("multi-query decode: dispatch never takes the decode kernel", "window_attention_kernels.cuh", "mq_dispatch",
          "plan.prefill = varlen && !use_multiquery_decode(max_q_len, hq / hkv, d);", "plan.prefill = varlen;",
          build=KERNEL_BUILD, run=_kernel_run("multiquery", tests=("test_window_attention_multiquery.py",))),
]


# Programmatic dependent launch (csrc/pdl.cuh, issue 34): every thread of a PDL launch waits (griddepcontrol.wait)
# before its first global access, and the CTAs trigger their dependents. Caught by tests/test_pdl.py: the emulator's
# sanitizer rule (an access before the wait, a thread that exits without one), the launch log (PDL on, CTAs that
# triggered), and nvcc's PTX of pdl.cuh (the sm_90 instructions present, none for sm_80).
_PDL_RUN = _kernel_run("every_launch", tests=("test_pdl.py",))
_PDL_PTX_RUN = ("ARKERNELS_PTX_CSRC={src} PYTHONPATH={repo} {python} -m pytest -x -q -p no:cacheprovider "
                "{repo}/tests/test_pdl.py -k ptx")
_DECODE_ENTRY = "  if constexpr (!kMulti) {  // query row b, packed rows = the group's heads h0 .. h0 + hc - 1\n"
_PREFILL_ZERO = "  if (b == 0 || b == int64_t(gridDim.z) - 1) prefill_zero_unowned_rows<T, D>(p, b, kvh);\n"
_GATHER_LEN = "  const int64_t len = dev::ld_global(seq_lens + b);\n"


def _pdl_fault(what: str, file: str, site: str, find: str, replace: str) -> Fault:
    return Fault(f"pdl: {what}", file, site, find, replace, build=KERNEL_BUILD, run=_PDL_RUN)


FAULTS += [
    _pdl_fault("append: the wait dropped", "paged_kv_kernels.cuh", "pdl_append", "  dev::pdl_wait();\n", ""),
    _pdl_fault("gather: seq_lens read above the wait", "paged_kv_kernels.cuh", "pdl_gather",
               "  dev::pdl_wait();\n  dev::pdl_launch_dependents();\n" + _GATHER_LEN,
               _GATHER_LEN + "  dev::pdl_wait();\n  dev::pdl_launch_dependents();\n"),
    _pdl_fault("decode: the wait dropped", _DECODE_FILE, "pdl_decode_wait", "  dev::pdl_wait();\n", ""),
    _pdl_fault("decode: the wait on the one-query path only (multi-query reads cu_seqlens_q unwaited)", _DECODE_FILE,
               "pdl_decode_wait", "  dev::pdl_wait();\n" + _DECODE_ENTRY, _DECODE_ENTRY + "    dev::pdl_wait();\n"),
    _pdl_fault("decode: its dependents never triggered", _DECODE_FILE, "pdl_decode_trigger",
               "  dev::pdl_launch_dependents();\n", ""),
    _pdl_fault("prefill: cu_seqlens_q read (unowned rows zeroed) above the wait", _PF, "pdl_prefill_wait",
               "  dev::pdl_wait();\n  // FAULT(prefill_zero_unowned)\n" + _PREFILL_ZERO,
               "  // FAULT(prefill_zero_unowned)\n" + _PREFILL_ZERO + "  dev::pdl_wait();\n"),
    _pdl_fault("emulator: launch_pdl never makes a PDL launch (the rule silently off)", "pdl.cuh", "pdl_simt_launch",
               "::simt::launch_pdl(pdl_allowed_by_env() && ", "::simt::launch_pdl(false && "),
    Fault("pdl: PTX: griddepcontrol.wait compiled only from sm_100", "pdl.cuh", "pdl_ptx_wait",
          "__CUDA_ARCH__ >= 900", "__CUDA_ARCH__ >= 1000", build="true", run=_PDL_PTX_RUN),
]


# ---- the w8a16 fragment GEMV (issue 34 item 1: csrc/int8_matmul_kernels.cuh + int8_matmul_launch.h), against the
# emulated cases of tests/test_int8_fragment_matmul.py (the float64 reference, weight / x / y traffic per byte, the
# plan per device, determinism under permuted CTA orders, the 64-bit x offsets).
_FRAG = "int8_matmul_kernels.cuh"
_FRAG_LAUNCH = "int8_matmul_launch.h"
_FRAG_RUN = _kernel_run("", tests=("test_int8_fragment_matmul.py",))


def _frag_fault(what: str, file: str, site: str, find: str, replace: str) -> Fault:
    return Fault(f"w8a16 fragment: {what}", file, site, find, replace, build=KERNEL_BUILD, run=_FRAG_RUN)


FAULTS += [
    _frag_fault("lane's 16 bytes off by one lane (fragment index + 1)", _FRAG, "frag_lane_offset",
                "kFragUnitBytes + lane * 16", "kFragUnitBytes + ((lane + 1) % 32) * 16"),
    _frag_fault("fragment words of (s, j) taken as (j, s)", _FRAG, "frag_word_index",
                "words[2 * s + j]", "words[2 * j + s]"),
    _frag_fault("dequant: b1's bytes from b0's pair", _FRAG, "frag_dequant_select",
                "r == 0 ? 0x4140u : 0x4342u", "r == 0 ? 0x4140u : 0x4140u"),
    _frag_fault("M mask of the A loads off by one (row M read)", _FRAG, "frag_m_mask", "m < p.M", "m <= p.M"),
    _frag_fault("M mask of the stores off by one (row M written)", _FRAG, "frag_store_mask", "m >= p.M", "m > p.M"),
    _frag_fault("K tail dropped", _FRAG, "frag_k_tail", "if (p.tail && ", "if (false && p.tail && "),
    _frag_fault("a partial last K step run unchecked (units past the split read)", _FRAG, "frag_partial_step",
                " || (u_end - u_begin) % kStep;", ";"),
    _frag_fault("split-K: the barrier before the release dropped", _FRAG, "frag_split_fence", "  __syncthreads();\n",
                ""),
    _frag_fault("split-K: release dropped (relaxed add)", _FRAG, "frag_split_release",
                "dev::atomic_add_release(counter, 1ull)", "dev::atomic_add(counter, 1ull)"),
    _frag_fault("split-K: acquire dropped", _FRAG, "frag_split_acquire", "if (last) dev::fence_acq_rel();", ""),
    _frag_fault("plan: split count not capped by K (splits of less than 2 steps)", _FRAG, "frag_plan_cap",
                "std::max<int64_t>(1, units / kFragMinSplitUnits), ", ""),
    _frag_fault("split-K counters: epoch not advanced between calls", _FRAG_LAUNCH, "frag_epoch",
                "  e.epoch += static_cast<unsigned long long>(launches);\n", ""),
    _frag_fault("split-K counters: one epoch for every 16-row slice of a call", _FRAG_LAUNCH, "frag_slice_epoch",
                "counters.epoch + static_cast<unsigned long long>(m0 / 16)", "counters.epoch"),
]


# The decode split-KV combine of a thread-block cluster (issue 34, item 3; csrc/window_attention_decode_cluster.cuh):
# the split CTAs of a column combine their partials from each other's shared memory between two cluster barriers,
# each CTA owning slots rank, rank + ns, ... of the output. Caught by tests/test_window_attention_cluster.py (the
# emulator's cluster model: a DSMEM load no barrier orders, an exit before another block's load, wrong output,
# the launch log, the traffic meter).
# sm_90 (the emulator's default device) now takes the cluster combine wherever it applies, so the faults of the global
# combine (counters, release / acquire, its loads, weights and sink) run their slices with ARKERNELS_CLUSTER=0: the
# global path, on the emulated H200 as on sm_80 (the slices' split-KV cases would otherwise never reach it).
_GLOBAL_COMBINE_SITES = {"split_arrive", "split_release", "split_fence", "split_acquire", "split_epoch",
                         "combine_splits", "combine_weights", "combine_sink", "combine_sink_head"}
FAULTS[:] = [dataclasses.replace(f, run="ARKERNELS_CLUSTER=0 " + f.run) if f.site in _GLOBAL_COMBINE_SITES else f
             for f in FAULTS]

_CLUSTER_FILE = "window_attention_decode_cluster.cuh"
_CLUSTER = ("cluster_grid and (s5-b3 or s8-b1 or s16-b3) or cluster_ran and 3-simt or global_path or capped_plan "
            "or cluster_aborted")
_CLUSTER_SINKS = "sinks_decode_splits and 0-simt"


def _cluster_fault(what: str, site: str, find: str, replace: str, file: str = _CLUSTER_FILE,
                   select: str = _CLUSTER, tests: tuple = ("test_window_attention_cluster.py",)) -> Fault:
    return Fault(f"decode cluster: {what}", file, site, find, replace, build=KERNEL_BUILD,
                 run=_kernel_run(select, tests=tests))


FAULTS += [
    _cluster_fault("the first cluster barrier dropped (partials read before they are written)", "cluster_first_sync",
                   "  dev::cluster_sync();  // every CTA's partial and lse are in its shared memory (a release / acquire)\n",
                   ""),
    _cluster_fault("the first cluster barrier relaxed (it publishes no partial)", "cluster_first_sync",
                   "  dev::cluster_sync();  // every CTA's", "  dev::cluster_sync_relaxed();  // every CTA's"),
    _cluster_fault("the last cluster barrier dropped (a CTA exits while others read its shared memory)",
                   "cluster_last_sync", "  dev::cluster_sync_relaxed();\n", ""),
    _cluster_fault("a CTA's slot count off by one (its last slot never written)", "cluster_owner",
                   "const int mine = (nslots - rank + ns - 1) / ns;", "const int mine = (nslots - rank + ns - 2) / ns;"),
    _cluster_fault("a split's partial read from the next rank", "cluster_part_rank",
                   "unsigned(s));", "unsigned((s + 1) % ns));"),
    _cluster_fault("a split's lse read from the next rank", "cluster_lse_rank",
                   "unsigned(lane)) : neg_inf();", "unsigned((lane + 1) % ns)) : neg_inf();"),
    _cluster_fault("the attention sink dropped", "cluster_sink",
                   "const float sink2 = p.sinks ?", "const float sink2 = false ?",
                   select=_CLUSTER_SINKS, tests=("test_window_attention_sinks.py",)),
    _cluster_fault("splits capped at 16 whatever the columns (SMs left idle)", "cluster_plan_fill",
                   "  if (columns * kClusterMax * 10 >= int64_t(props.sm_count) * 9) return kClusterMax;\n",
                   "  return kClusterMax;\n"),
    _cluster_fault("launched in clusters of half the splits (each combines half the partials)", "cluster_launch",
                   "unsigned(plan.cluster), p,", "unsigned(plan.cluster / 2 > 0 ? plan.cluster / 2 : 1), p,",
                   file=_DECODE_FILE),
]


def main() -> int:
    global CSRC
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only faults whose name contains this")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("-v", action="store_true", help="print the output tail of every fault")
    ap.add_argument("--csrc", default=None, help="the csrc/ tree to copy and fault (default: this checkout's)")
    args = ap.parse_args()
    CSRC = os.path.abspath(args.csrc or CSRC)
    faults = [f for f in FAULTS if args.k in f.name]
    if not faults:
        print("no fault matches", file=sys.stderr)
        return 2

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        pairs = sorted({(f.build, f.run, f.timeout) for f in faults})
        for (build, run, timeout), (hows, secs, tail) in zip(pairs, pool.map(lambda p: _attempt(*p), pairs)):
            print(f"baseline ({secs:.0f} s): {hows[0]}: {build.split(' -o ')[0][-60:]} ; {run}")
            if hows[0] != "passed":
                print(tail)
                print("the unmodified sources fail: fix that first, the fault table would mean nothing")
                return 1

        def one(f: Fault):
            try:
                return _attempt(f.build, f.run, f.timeout, _apply(f), f.runs)
            except ValueError as e:
                return [f"not applied ({e})"], 0.0, ""

        results = list(pool.map(one, faults))

    w = max(len(f.name) for f in faults)
    print(f"\n| {'fault':{w}} | caught | how | s |\n|{'-' * (w + 2)}|--------|-----|---|")
    missed = 0
    for f, (hows, secs, tail) in zip(faults, results):
        k = sum(any(h.split(" (", 1)[0] in f.caught_by for h in how.split(" + ")) for how in hows)
        caught = k == len(hows)
        missed += not caught
        verdict = ("yes" if caught else "NO") + (f" {k}/{len(hows)}" if len(hows) > 1 else "")
        how = "; ".join(sorted(set(hows), key=hows.index))
        print(f"| {f.name:{w}} | {verdict} | {how} | {secs:.0f} |")
        if args.v or not caught:
            print("    " + tail.strip().replace("\n", "\n    ")[-1500:])
    print(f"\n{len(faults) - missed} of {len(faults)} faults caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
