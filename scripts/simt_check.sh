#!/usr/bin/env bash
# The SIMT emulator's sanitizer runs (issue 9), after scripts/test.sh (which builds the package and the plain emulator
# and runs every emulated test case): the tensor-core / async-copy primitives driver (plain, ThreadSanitizer,
# AddressSanitizer + UBSan) and a slice of the emulated kernel tests under each sanitizer, with the emulator library
# rebuilt with -fsanitize and the sanitizer runtime preloaded into Python. Any sanitizer report fails the run.
# Usage: bash scripts/simt_check.sh        (CI: .ci/run; about 9-11 minutes on 2 cores, 2.5 of them fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export CUDA_HOME
mkdir -p build
tick() { date +%s; }
say() { echo "[simt_check] $*"; }

# 1. Primitives driver (no libtorch): mma.sync, ldmatrix, cp.async against plain matmul / copy, and a tiled GEMM.
CXX=(g++ -std=c++20 -pthread -DARKERNELS_SIMT -ftrivial-auto-var-init=pattern -I"$CUDA_HOME/include" -Icsrc)
for variant in plain thread address; do
  t0=$(tick)
  case $variant in
    plain) flags=(-O2) ;;
    thread) flags=(-O1 -g -fsanitize=thread) ;;
    address) flags=(-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer) ;;
  esac
  "${CXX[@]}" "${flags[@]}" csrc/simt/tests/primitives.cpp -o "build/simt_primitives_$variant"
  # (its deliberate-fault cases print [simt] reports they expect; the log keeps them)
  if ! TSAN_OPTIONS="halt_on_error=1" ASAN_OPTIONS="detect_leaks=0" "build/simt_primitives_$variant" \
      > "build/simt_primitives_$variant.log" 2>&1; then
    tail -40 "build/simt_primitives_$variant.log"; say "primitives ($variant): FAILED"; exit 1
  fi
  say "primitives ($variant): $(tail -1 "build/simt_primitives_$variant.log") in $(( $(tick) - t0 )) s"
done

# 2. Emulated kernel tests under each sanitizer: a slice that covers every kernel (append, gather, decode with
#    split-KV and combine, prefill with 64- and 32-key tiles, head dims 64/128/256, fp16 and bf16, GQA, windows,
#    the traffic meter, multi-query decode: fp8 at head_dim 80 with GQA 4, split-KV with sinks, unchecked rows, the
#    sm_90 cluster combine: concurrent CTAs reading each other's shared memory; the w8a16 fragment GEMV with split-K
#    and a partial last step), the hostile inputs of tests/test_window_attention_safety.py (not its 64 GB sparse views:
#    nothing in a mapping that large is a heap overrun to find). halt_on_error: the first report fails the run.
SLICE="simt and (append_grid and 13-64 or gather_grid and 13-128 or traffic or length_past or decode_long_context or decode_grid and 13-16 or prefill_grid and gqa1-128 or prefill_grid and gqa2-256 or 99kb or strided_inputs_and_kv_start or unchecked or lengths_vs or fenced or poisoned or safety and not offsets_past or multiquery_grid and True-gqa1-80 or multiquery_splits and sinks_fp8-1 or multiquery_unchecked or cluster_grid and (s3-b2 or s16-b3) or cluster_ran and 3-simt or fragment_matmul_matches_reference and (3-4021 or 4-64-656))"
for variant in thread address; do
  t0=$(tick)
  lib=$("$PY" -m arkernels.simt build --sanitize "$variant" | tail -1)
  # the sanitizer runtime must be loaded first; ASan also needs libstdc++ loaded up front (python does not link it:
  # ASan's __cxa_throw interceptor finds nothing to forward to otherwise and aborts at the first C++ exception)
  runtime=$(gcc -print-file-name=libtsan.so)
  [ "$variant" = address ] && runtime="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
  t1=$(tick)
  # OMP_NUM_THREADS=1: torch's own OpenMP threads are not instrumented (TSan reports their memcpy as races);
  # -s: a sanitizer that halts must not take its report down with pytest's captured output.
  log="build/simt_check_$variant.log"
  if ! OMP_NUM_THREADS=1 ARKERNELS_SIMT_LIB="$lib" ARKERNELS_SIMT_REQUIRED=1 LD_PRELOAD="$runtime" \
      TSAN_OPTIONS="halt_on_error=1 report_signal_unsafe=0" \
      ASAN_OPTIONS="detect_leaks=0 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1" \
      TRITON_INTERPRET=1 "$PY" -m pytest -s -q -p no:cacheprovider -m simt -k "$SLICE" tests/test_paged_kv.py \
      tests/test_window_attention.py tests/test_simt_emulator.py tests/test_window_attention_safety.py \
      tests/test_window_attention_multiquery.py tests/test_window_attention_cluster.py \
      tests/test_int8_fragment_matmul.py > "$log" 2>&1; then
    tail -60 "$log"; say "emulated tests under the $variant sanitizer: FAILED"; exit 1
  fi
  say "emulated tests ($variant sanitizer): $(tail -1 "$log"); build $(( t1 - t0 )) s, run $(( $(tick) - t1 )) s"
done
# 3. Fuzz the ops' integer arguments (block tables, lengths, kv_start, cu_seqlens_q, slots, max_q_len, window), all
#    with check=False, on the ASan + UBSan build for a bounded time (issue 27): any sanitizer or emulator report, NaN
#    output (an unwritten row) or write beside a cache fails the run. Longer by hand: scripts/simt_fuzz.py --minutes 60.
t0=$(tick)
fuzz_log=build/simt_fuzz.log
if ! ARKERNELS_SIMT_LIB="$(pwd)/build/simt-address/arkernels_simt.so" "$PY" scripts/simt_fuzz.py \
    --minutes "${SIMT_FUZZ_MINUTES:-2.5}" --seed "${SIMT_FUZZ_SEED:-0}" > "$fuzz_log" 2>&1; then
  tail -40 "$fuzz_log"; say "fuzz: FAILED"; exit 1
fi
say "fuzz: $(tail -1 "$fuzz_log") ($(( $(tick) - t0 )) s)"
say "done"
