#!/usr/bin/env bash
# The GPU check: on a CUDA machine with no network (torch, triton, transformers preinstalled), build arkernels from
# source, run the CUDA tests, run compute-sanitizer memcheck over the CUDA kernels' tests, run every benchmark in
# its GPU mode, and measure the copy-bandwidth ceiling. Everything lands in one folder:
#   benchmarks/gpu_check.sh [OUT_DIR]      (default: $OUT, else gpu_check_out)
# Files written: summary.txt (the figures; read this first) and logs.tar.gz (build log with the -Xptxas -v
# report, test logs, sanitizer log, benchmark CSV/JSON/PNG). Budget: under 8 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/logs"
mkdir -p "$LOG"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
PY=${PYTHON:-python3}
say() { echo "$*" | tee -a "$SUMMARY"; }
DEADLINE=${GPU_CHECK_DEADLINE_S:-450}  # the whole check must end within 8 minutes: steps share what is left
step() {  # step NAME TIMEOUT_S CMD...: run with a time limit, log to $LOG/NAME.log, record the exit code
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then say "[$name] skipped: the 8-minute budget is spent"; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  say "[$name] rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL_LINES:-12}" "$LOG/$name.log" | sed 's/^/    /' >> "$SUMMARY"
  return $rc
}

say "== arkernels GPU check $(date -u +%FT%TZ) =="
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$SUMMARY"
$PY -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tee -a "$SUMMARY"

# First, in seconds: csrc/device_mma.cuh's inline PTX (mma.sync m16n8k16 f16/bf16, ldmatrix x1/x2/x4 [.trans],
# cp.async groups, a tiled GEMM) built by nvcc from the emulator's own driver (csrc/simt/tests/primitives.cpp) and
# checked on this GPU against plain host matmuls and copies. CI runs the same cases on the emulator's model of these
# instructions (csrc/simt/simt_mma.h), so a failure here says the PTX path and the emulated one disagree, and every
# emulated kernel result is then suspect.
mkdir -p build
step ptx_primitives 90 bash -c "nvcc -x cu -std=c++20 -O2 -arch=native -Icsrc csrc/simt/tests/primitives.cpp \
  -o build/primitives_gpu && build/primitives_gpu"

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export ARKERNELS_CUDA=1
if ! step build 240 $PY -m pip install --no-build-isolation --no-deps -v -e .; then
  say "BUILD FAILED: see logs/build.log"
else
  grep -E "ptxas info|spill" "$LOG/build.log" > "$LOG/ptxas.txt"
  say "ptxas: $(grep -c 'Used' "$LOG/ptxas.txt") kernels, $(grep -E '[1-9][0-9]* bytes spill (stores|loads)' "$LOG/ptxas.txt" | wc -l) lines with spills"
  $PY -c "import arkernels; print('cuda kernels built:', arkernels.cuda_kernels_built()); print(arkernels.kernels_report())" 2>&1 | tee -a "$SUMMARY"

  # ARKERNELS_AUTOTUNE=0: one Triton config per shape class (the int8 grid would trigger ~70 autotune sweeps)
  ARKERNELS_AUTOTUNE=0 step tests_cuda 150 $PY -m pytest -q -m cuda -p no:cacheprovider tests
  # memcheck over the hand-written CUDA kernels' tests (a slice: the sanitizer is ~10-100x slower)
  ARKERNELS_AUTOTUNE=0 step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -x -m cuda -p no:cacheprovider tests/test_paged_kv.py tests/test_window_attention.py -k "not compile"

  # host-device syncs per decode step: a few steps of arkernels.generate (eager, CUDA graphs) on a tiny bf16 model under
  # torch.cuda.set_sync_debug_mode("warn"), each synchronizing call counted (expected: 0 inside a step; the loop's
  # one wait is an event synchronize on the previous step's ids, which the debug mode does not flag)
  DECODE_SYNCS='
import warnings, sys, torch, arkernels
from arkernels.hf.tiny import tiny_model
gen = sys.modules["arkernels.generate"]
model = tiny_model("gemma3_text", dtype=torch.bfloat16, head_dim=64).cuda()
prompts = [[5, 6, 7, 8, 9], [3, 4], [20, 21, 22]]
counts = {"step": 0, "steps": 0}
step = gen._DecodeStep.step
def counted(self, *a, **k):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = step(self, *a, **k)
    counts["step"] += sum("synchroniz" in str(x.message) for x in w)
    counts["steps"] += 1
    return out
gen._DecodeStep.step = counted
for graphs in (False, True):
    kw = dict(max_new_tokens=16, eos_token_id=[], block_size=4, cuda_graphs=graphs)
    arkernels.generate(model, prompts, **kw)  # warm-up (Triton JIT, graph capture)
    counts.update(step=0, steps=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        arkernels.generate(model, prompts, **kw)
    torch.cuda.set_sync_debug_mode("default")
    n, inside = counts["steps"], counts["step"]
    total = inside + sum("synchroniz" in str(x.message) for x in w)
    print(f"cuda_graphs={graphs}: {n} decode steps, syncs inside steps {inside} ({inside / max(n, 1):.2f}/step), "
          f"whole call incl. prefill {total}")
'
  step decode_syncs 90 $PY -c "$DECODE_SYNCS"

  # Programmatic dependent launch (csrc/pdl.cuh, issue 34): on sm_90 each of our kernels' launch and prologue overlaps
  # the kernel before it. The chain of one decode layer's arkernels launches at batch 1 (append the token's K/V, then
  # decode attention over 4k keys; Llama-8B shapes), 32 layers in one CUDA graph, per-layer time of a replay, in a
  # process with PDL on and one with ARKERNELS_PDL=0 (read once per process): the difference is the overlap (review
  # estimate: ~0.7 us per launch pair; no GPU has measured it). The same switch on the decode benchmark below.
  PDL_CHAIN='
import os, torch
from arkernels.ops.paged_kv import paged_kv_append
from arkernels.ops.window_attention import window_attention
layers, hkv, hq, d, bs, n = 32, 8, 32, 128, 16, 4096
caches = [(torch.randn(n // bs + 1, bs, hkv, d, device="cuda").bfloat16(),
           torch.randn(n // bs + 1, bs, hkv, d, device="cuda").bfloat16()) for _ in range(layers)]
table = torch.arange(n // bs + 1, dtype=torch.int32, device="cuda").view(1, -1)
lens = torch.tensor([n], dtype=torch.int32, device="cuda")
slot = torch.tensor([n - 1], device="cuda")
kv = torch.randn(1, hkv, d, device="cuda").bfloat16()
q = torch.randn(1, hq, d, device="cuda").bfloat16()
def chain():
    for k, v in caches:
        paged_kv_append(kv, kv, k, v, slot)
        window_attention(q, k, v, table, lens)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    chain()  # warm-up: plans, counters
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        chain()
    for _ in range(20):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / 200 / layers
    chain()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20):
        chain()
    t1.record()
    torch.cuda.synchronize()
    eager = t0.elapsed_time(t1) * 1e3 / 20 / layers
pdl = os.environ.get("ARKERNELS_PDL", "1")
print(f"ARKERNELS_PDL={pdl}: append + decode (B=1, 4k keys, 8/32 heads, D 128) "
      f"per layer: CUDA graph {us:.2f} us, eager {eager:.2f} us")
'
  ARKERNELS_PDL=1 step pdl_chain_on 45 $PY -c "$PDL_CHAIN"
  ARKERNELS_PDL=0 step pdl_chain_off 45 $PY -c "$PDL_CHAIN"
  # decode kernel, issue 34 items 3 and 6: the SASS of the build (no MEMBAR.SC in any decode kernel, each fence one
  # thread's: the FENCE column "1T x2") and the decode cases the change targets, each a CUDA graph of 20 calls over
  # caches rotated past the 50 MB L2: B=1 8k bf16 (split-KV tail: est. 11-13.5 us, 58-70% of copy bandwidth; was
  # 12.5-15.5), B=1 8k fp8 under bf16 queries (fp16 MMAs: est. 7.5-9.5 us; was 9.5-11.5) and B=32 8k fp8 (issue:
  # est. 80-86%; was 72-82%). GQA 32/8, D 128, block size 16. Estimates, no GPU: docs/kernels.md "Decode after
  # issue 34".
  DECODE_TAIL='
import os, subprocess, sys, torch, arkernels
b1_only = os.environ.get("DECODE_CASES") == "b1"  # the cluster on / off pair: B=1 only, no SASS
cluster = os.environ.get("ARKERNELS_CLUSTER", "1")
if not b1_only:
    rep = subprocess.run([sys.executable, "scripts/sass_report.py", "--arch", "sm_90"], capture_output=True, text=True)
    rows = [l for l in rep.stdout.splitlines() if "decode_kernel" in l or "FAIL" in l or "TAIL" in l]
    print("\n".join(rows) or rep.stdout[-2000:] + rep.stderr[-2000:])
dev, hq, hkv, d, bs = "cuda", 32, 8, 128, 16
x = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
y = torch.empty_like(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
y.copy_(x)
s.record(); [y.copy_(x) for _ in range(5)]; e.record(); torch.cuda.synchronize()
gbps_copy = 2 * 5 * x.numel() / (s.elapsed_time(e) * 1e6)
for batch, fp8 in ((1, False), (1, True)) + (() if b1_only else ((32, True),)):
    ctx, nb = 8192, 8192 // bs
    kv_bytes = 2 * batch * ctx * hkv * d * (1 if fp8 else 2)
    rot = max(2, -(-200 << 20) // kv_bytes)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    one = torch.ones(1, device=dev)
    calls = []
    for _ in range(rot):
        k = torch.randn(batch * nb, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        if fp8:
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        table = torch.randperm(batch * nb, device=dev, dtype=torch.int32).view(batch, nb)
        kw = dict(k_scale=one, v_scale=one) if fp8 else {}
        calls.append(lambda k=k, v=v, t=table, kw=kw: arkernels.window_attention(q, k, v, t, lens, check=False, **kw))
    for c in calls: c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(20): calls[i % rot]()
    g.replay(); torch.cuda.synchronize()
    s.record(); [g.replay() for _ in range(5)]; e.record(); torch.cuda.synchronize()
    us = s.elapsed_time(e) * 1e3 / 100
    kind, gbps = "fp8/bf16q" if fp8 else "bf16", kv_bytes / us / 1e3
    print(f"decode B={batch} 8k {kind} ARKERNELS_CLUSTER={cluster}: {us:.2f} us/call, "
          f"{gbps:.0f} GB/s, {100 * gbps / gbps_copy:.0f}% of copy ({gbps_copy:.0f} GB/s)")
'
  step decode_tail 60 $PY -c "$DECODE_TAIL"
  # issue 34 item 3: the split-KV combine of a thread-block cluster (sm_90: the split CTAs of a column combine through
  # distributed shared memory; B=1 8k plans 16 splits in clusters of 16) against the global combine (33 splits,
  # partials through L2), B=1 8k bf16 and fp8, each in its own process (ARKERNELS_CLUSTER is read once per process).
  # Estimate, no GPU: the cluster row 0.5-1 us under the other (docs/kernels.md "Decode after issue 34"); a cluster
  # row slower than the global one points at cluster placement (cudaOccupancyMaxActiveClusters) or the longer splits.
  ARKERNELS_CLUSTER=1 DECODE_CASES=b1 step decode_cluster_on 30 $PY -c "$DECODE_TAIL"
  ARKERNELS_CLUSTER=0 DECODE_CASES=b1 step decode_cluster_off 30 $PY -c "$DECODE_TAIL"

  export ARKERNELS_BENCH_OUT="$LOG/bench"
  # int8: one Llama-8B shape and three M classes (a full sweep autotunes ~36 times, too long for the budget); its
  # 14336x4096 (N x K) M = 1 row is the w8a16 GEMV case of issue 34 (rows w8a16 / w8a16-packed: plain / packed layout)
  # decode: the host-bound case first (tiny 4-layer bf16 Llama, batch 1 and 8, 16-token prompt, 48 new tokens, every
  # method: stock eager, stock static + compile, patched default (compiled) / host path, arkernels.generate
  # eager / graphs / compile; ratios vs stock eager and vs static + compile), then SmolLM2 / Llama-8B-shape at batch 1
  # and 32, 64 new tokens, without the compiled methods (each compiles per model and batch: past the budget)
  # window_attention: the issues' headline shapes (--short), each with SDPA, flex_attention (compiled per shape), fp8
  # cb: transformers' continuous batching, stock sdpa / paged|eager (/ flash where installed) vs patched, 64 requests
  # of 16-256 prompt tokens, 32 new tokens; patched+graphs: CB's padded step captured in CUDA graphs (use_cuda_graph)
  declare -A extra=([int8_matmul]="--shapes 14336x4096 --ms 1 4 8 16 4096"
                    [decode]="--batches 1,32 --new-tokens 64 --methods patched+host,arkernels,arkernels+graphs"
                    [window_attention]="--short"
                    [cb]="--requests 64 --prompt-max 256 --new-tokens 32 --repeats 2 --max-batch-tokens 1024"
                    [spec_sampling]="--quick" [spec]="--new-tokens 64 --repeats 3 --draft-layers 8 --static")
  declare -A limit=([decode]=100 [window_attention]=150 [cb]=60 [spec]=120)
  # (the default tiers up on CUDA too: patched-eager is its first calls, patched its steady state)
  step bench_decode_host 150 $PY benchmarks/bench_decode.py --case host-bound --batches 1,8 --out "$LOG/bench_host" \
    --methods static+compile,patched,patched-eager,patched+host,arkernels,arkernels+graphs,arkernels+compile
  # spec_sampling: the fused acceptance op (--quick: the full sweep's fp64 reference checks outlast the budget);
  # spec: prompt lookup and a draft model (the first 8 of SmolLM2's layers) in arkernels.generate vs the one-token
  # loop, stock's and patched assisted loops (host-bound
  # tiny model and SmolLM2 on the GPU)
  # sampling's headline shapes first (vocab 128k, batch 1 and 256, eager and CUDA-graph replayed: the two launches'
  # device time; graph_search: the on-chip draw off, issue 34 item 4's before; graph_nopdl: batch 1 without
  # programmatic dependent launch), then its full sweep below
  step bench_sampling_headline 75 $PY benchmarks/bench_sampling.py --headline --out "$LOG/bench"
  # w8a16 GEMV plan (issue 34): M = 1 and 4 on the LM head (128256x4096: N alone fills the machine, the plan runs the
  # K loop with no split) and the fused gate/up (28672x4096, the same) against the per-chunk GEMV's 8 splits (rows
  # w8a16-loop / w8a16-chunk), and PDL on / off (w8a16-packed / w8a16-nopdl: back-to-back calls overlap a launch's
  # weight prefetch with the previous one's tail)
  step bench_int8_gemv_plan 60 $PY benchmarks/bench_int8_matmul.py --shapes 128256x4096 28672x4096 --ms 1 4 \
    --out "$LOG/bench_gemv_plan"
  # w8a16 decode GEMV, issue 34 item 1's hand-written CUDA kernel on the fragment layout (w8a16_fragment_matmul) against
  # the Triton w8a16 kernels on the packed layout and bf16 F.linear: the Llama-3-8B projection shapes, M = 1, 4, 16
  # (rows cuda-fragment / triton-packed; the target is >= 88% of copy bandwidth at M = 1). Int8Linear's
  # layout="fragment" becomes the default only once these rows say so.
  step bench_int8_fragment 60 $PY benchmarks/bench_int8_fragment.py --out "$LOG/bench_fragment"
  for b in paged_kv window_attention sampling int8_matmul cb decode spec_sampling spec; do
    [ -f "benchmarks/bench_$b.py" ] || { say "[bench_$b] missing"; continue; }
    # shellcheck disable=SC2086
    step "bench_$b" "${limit[$b]:-60}" $PY "benchmarks/bench_$b.py" --out "$LOG/bench" ${extra[$b]:-}
  done
  # the decode benchmark's graph-replayed step at batch 1 with PDL off, against its PDL-on row above
  ARKERNELS_PDL=0 step bench_decode_pdl_off 60 $PY benchmarks/bench_decode.py --out "$LOG/bench_pdl_off" \
    --batches 1 --new-tokens 64 --methods arkernels+graphs
fi
tar -czf "$OUT_DIR/logs.tar.gz" -C "$OUT_DIR" logs && rm -rf "$LOG"
say "== done in $SECONDS s; logs in $OUT_DIR/logs.tar.gz =="
