// w8a16 decode GEMV on the fragment-order int8 weight (issue 34 item 1; Marlin's idea on our int8 format):
// y[M, N] = x[M, K] @ (w[N, K] * scale[N, None]).T + bias[N], x fp16 | bf16, M <= 16 (one m16 tile; rows >= M are
// zero in the A operand and never stored). No ATen here: nvcc compiles this for the GPU (csrc/int8_matmul.cu) and
// the host compiler for the SIMT emulator (csrc/simt/simt_ops.cpp), from the same source; the planning
// (plan_w8a16_fragment) is a pure function of shapes and DeviceProps, called by both.
//
// Layout (arkernels/ops/int8_matmul_layout.py, LAYOUT_FRAGMENT): each whole 16-row group is a run of 512-byte units
// (32 columns); lane l's 16 bytes of a unit are its mma.m16n8k16 B fragments for 2 n8 tiles (j) x 2 k16 steps (s):
// byte 8 s + 4 j + {0, 1, 2, 3} = w[16 G + 8 j + l / 4, 32 u + 16 s + 2 (l % 4) + {0, 1, 8, 9}]. A K tail
// (K % 32 == 16) is a 256-byte unit, 8 bytes per lane (s = 0). A short last group (N % 16 rows) is plain [r, K].
// So the weight goes global -> registers (one LDG.128 per lane per unit and group) -> int8 -> fp16/bf16 in registers
// (exact: fp16 by the 0x6400 magic, bf16 through fp32's 0x4B000000 magic) -> HMMA: no shared memory on its way.
//
// Parallelisation: CTAs of 4 warps; blockIdx.x = a column of kFragGroups (2) 16-row groups (32 outputs, 4 n8 MMA
// tiles), blockIdx.y = a split of K (plan_w8a16_fragment: split only where the columns alone cannot keep
// kFragNeedPerSm CTAs on every SM). Inside a split, K goes in steps of 4 warps x kFragUnits (2) units; warp w takes
// units w * 2, w * 2 + 1 of each step. A step's weight (4 LDG.128 per lane: 2 units x 2 groups) and x A fragments
// (16 LDG.32, rows predicated) are loaded into one of two register buffers while the other buffer's MMAs run: every
// load of step i + 1 is issued before the first HMMA of step i. The 4 warps' fp32 sums are added in warp order
// through shared memory (fixed order: deterministic), then (splits > 1) each CTA stores its partial [32 n][16 m] to
// the workspace and counts itself done on its column's epoch-stamped counter (one thread's release after a CTA
// barrier); the last CTA acquires and adds the splits in split order 0, 1, ..., so equal inputs give equal bits
// whatever order the CTAs finish in. No fp32 atomics on the output.
// PDL (pdl.cuh): every thread waits (griddepcontrol.wait) before its first global access; launch_dependents after the
// K loop. Offsets into w, x, y and the workspace are int64.
//
// Arithmetic (nvcc 13.0 SASS, scripts/sass_report.py; estimate, no GPU). sm_90: 125 registers (sm_80: 128, at the
// __launch_bounds__ cap: another toolkit may spill), no local memory, 6 KB static shared, 4 CTAs (16 warps) per SM
// by registers. The unchecked K loop (every CTA but the edge column's and a ragged last split's): per 2 steps of a
// warp (4 KB of weight) 319 SASS in fp16 / 511 in bf16 (8 LDG.128, 32 LDG.32 of x, 32 HMMA; dequant per 4 bytes:
// fp16 1 LOP3 + 2 PRMT + 2 HADD2, bf16 1 LOP3 + 6 PRMT + 4 FADD): 0.078 / 0.125 warp-instructions per weight byte,
// 33% / 52% of the ~0.24 an H200 SM can issue per byte of its HBM share. In SASS each step's 4 LDG.128 (and x's
// loads) are issued before the 16 HMMA of the step before, with no barrier in the loop. Bytes in flight: one step
// per warp (8 KB per CTA), 24-32 KB per SM at 3-4 CTAs, against ~23 KB for the SM's share of HBM (Little's law).
// Llama-3-8B, M = 1, 132 SMs: gate/up 14336x4096 and the fused 28672x4096 run unsplit (448 / 896 CTAs, 128 KB of
// weight each, one launch, no workspace): the round trip before the first MMA and the CTA-barrier reduction are ~1 us
// on ~14 / ~27 us, est. 80-88% of copy bandwidth (the review's 88% target at the top of the range; the Triton GEMV
// 70-80%); q/o 4096x4096 (4 splits, 512 CTAs of 32 KB, one wave) and k/v 1024x4096 (8 splits, 256 CTAs) are ~4 us and
// ~1 us kernels where the first round trip and the split tail (workspace store, release / acquire ticket, the last
// CTA's 2 KB per split read back) weigh ~1-1.5 us: est. 60-75%. M = 16 reads x's 16 rows from L2 (8 KB per CTA step,
// as many bytes as the weight: L2, not HBM). Only bench_int8_fragment.py on a GPU can confirm any of this.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "device.cuh"
#include "device_mma.cuh"
#include "pdl.cuh"

namespace arkernels {

constexpr int kFragThreads = 128;
constexpr int kFragWarps = kFragThreads / 32;
constexpr int kFragGroups = 2;       // 16-row groups per CTA (4 n8 MMA tiles)
constexpr int kFragUnits = 2;        // 32-column units per warp per step (4 k16 MMA steps)
constexpr int kFragUnitK = 32;       // K columns per unit
constexpr int kFragUnitBytes = 512;  // one group's unit: 16 bytes per lane
constexpr int kFragMaxSplits = 64;   // split count bound (and the epoch stride of the counters)
constexpr int kFragMinSplitUnits = 2 * kFragWarps * kFragUnits;  // a split runs at least 2 steps (16 units, 512 cols)
// CTAs one SM must hold for its HBM share: ~23 KB in flight per SM (Little's law, docs/kernels.md) over ~8 KB per CTA
// (a step: 128 threads x 4 x 16 B, with the next step's loads issued behind it: up to 16 KB).
constexpr int kFragNeedPerSm = 3;
constexpr int kFragMinBlocks = 4;  // __launch_bounds__: <= 128 registers, 4 CTAs per SM by registers

enum FragBias : int { kFragNoBias = 0, kFragBiasF32 = 1, kFragBiasT = 2 };  // bias dtype: none, fp32, x's dtype

struct FragParams {
  const void* x;        // [M, K] fp16 | bf16, rows strided by sx elements, last dim contiguous, 4-byte aligned
  int64_t sx;           // x's row stride in elements (even)
  const int8_t* w;      // the fragment layout, N * K bytes, 16-byte aligned
  const float* scale;   // [N] fp32
  const void* bias;     // [N] (bias_kind) or nullptr
  int bias_kind;        // FragBias
  void* y;              // [M, N] contiguous, x's dtype
  float* part;          // [splits, groups, 16 n, 16 m] fp32 partial sums (splits > 1), else nullptr
  unsigned long long* counters;  // [columns] epoch-stamped arrival counts (splits > 1)
  unsigned long long epoch;      // this launch's epoch on counters (larger than every earlier launch's)
  int M, N, K;
  int groups;           // ceil(N / 16)
  int units;            // K / 32 (whole units)
  int tail;             // 1 when K % 32 == 16 (one 16-column unit more, in the last split)
  int split_units;      // units per split (a multiple of kFragWarps * kFragUnits)
  int splits;
};

// ---------------------------------------------------------------- planning
struct FragPlan {
  dim3 grid;
  int split_units = 0, splits = 1;
  int64_t part_floats() const { return splits > 1 ? int64_t(splits) * grid.x * kFragGroups * 256 : 0; }
  int64_t counters() const { return splits > 1 ? int64_t(grid.x) : 0; }
};

inline FragPlan plan_w8a16_fragment(int64_t N, int64_t K, const DeviceProps& props) {
  FragPlan p;
  const int64_t groups = (N + 15) / 16, cols = (groups + kFragGroups - 1) / kFragGroups;
  const int64_t units = K / kFragUnitK, step = int64_t(kFragWarps) * kFragUnits;
  const int64_t want = int64_t(props.sm_count) * kFragNeedPerSm;  // CTAs that keep every SM's share in flight
  int64_t splits = cols >= want ? 1 : (want + cols - 1) / cols;
  // FAULT(frag_plan_cap)
  splits = std::min<int64_t>({splits, std::max<int64_t>(1, units / kFragMinSplitUnits), kFragMaxSplits});
  int64_t per = (units + splits - 1) / std::max<int64_t>(splits, 1);
  per = (per + step - 1) / step * step;  // whole steps per split
  p.split_units = int(per);
  p.splits = per > 0 ? int((units + per - 1) / per) : 1;
  if (p.splits < 1) p.splits = 1;
  p.grid = dim3(unsigned(cols), unsigned(p.splits), 1);
  return p;
}

// ---------------------------------------------------------------- device helpers
template <typename T>
struct FragConv;
template <>
struct FragConv<__half> {
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ static float to_float(__half v) { return __half2float(v); }
};
template <>
struct FragConv<__nv_bfloat16> {
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};

__device__ __forceinline__ uint32_t frag_float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
__device__ __forceinline__ float frag_bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// 4 int8 of one (s, j): bytes {k 2t, 2t+1, 2t+8, 2t+9} -> the B fragment's 2 registers of T pairs, exactly.
// fp16: 0x6400 | (b ^ 0x80) is 1024 + b + 128 exactly; one HSUB2 of 1152 leaves b (|b| <= 128: exact in fp16).
// bf16: 0x4B000000 | (b ^ 0x80) is 2^23 + b + 128 in fp32; one FADD leaves b exactly, whose top 16 bits are b in bf16.
template <typename T>
__device__ __forceinline__ void frag_dequant(uint32_t v, uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void frag_dequant<__half>(uint32_t v, uint32_t (&b)[2]) {
  const uint32_t u = v ^ 0x80808080u;
  const __half2 bias = __half2half2(__ushort_as_half(0x6480));  // 1152
  for (int r = 0; r < 2; ++r) {
    // FAULT(frag_dequant_select)
    const uint32_t bits = __byte_perm(u, 0x64646464u, r == 0 ? 0x4140u : 0x4342u);  // [b, 0x64, b', 0x64]
    __half2 h;
    memcpy(&h, &bits, 4);
    h = __hsub2(h, bias);
    memcpy(&b[r], &h, 4);
  }
}
template <>
__device__ __forceinline__ void frag_dequant<__nv_bfloat16>(uint32_t v, uint32_t (&b)[2]) {
  const uint32_t u = v ^ 0x80808080u;
  float f[4];
  // one PRMT per value builds the fp32 word [byte i, 0, 0, 0x4B]
  for (int i = 0; i < 4; ++i) f[i] = frag_bits_float(__byte_perm(u, 0x4B000000u, 0x7440u + i)) - 8388736.f;
  for (int r = 0; r < 2; ++r)
    b[r] = __byte_perm(frag_float_bits(f[2 * r]), frag_float_bits(f[2 * r + 1]), 0x7632u);
}

// The 4 bytes k0 + 2t + {0, 1, 8, 9} of plain row `row` (the short last group, or nothing past its rows).
__device__ __forceinline__ uint32_t frag_plain_word(const int8_t* row_ptr, int64_t k0, int t) {
  const uint16_t lo = dev::ld_global(reinterpret_cast<const uint16_t*>(row_ptr + k0 + 2 * t));
  const uint16_t hi = dev::ld_global(reinterpret_cast<const uint16_t*>(row_ptr + k0 + 2 * t + 8));
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// Lane (g, t)'s 16 bytes of unit u of group `grp`: one LDG.128. kEdge (the CTA column holding the short last group
// or a missing one): zeros past the groups, 16-bit loads of the plain rows in the short last group.
template <bool kEdge>
__device__ __forceinline__ uint4 frag_load_unit(const FragParams& p, int grp, int u, int lane) {
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  if (kEdge && grp >= p.groups) return r;
  const int8_t* gb = p.w + int64_t(grp) * 16 * p.K;
  const int rows = p.N - grp * 16;
  if (!kEdge || rows >= 16) {
    // FAULT(frag_lane_offset)
    return dev::ld_global(reinterpret_cast<const uint4*>(gb + int64_t(u) * kFragUnitBytes + lane * 16));
  }
  const int g = lane / 4, t = lane % 4;
  uint32_t words[4] = {0u, 0u, 0u, 0u};
  for (int s = 0; s < 2; ++s)
    for (int j = 0; j < 2; ++j)
      if (8 * j + g < rows)
        words[2 * s + j] = frag_plain_word(gb + int64_t(8 * j + g) * p.K, int64_t(u) * kFragUnitK + 16 * s, t);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Lane (g, t)'s 8 bytes of the 16-column K tail of group `grp` (j = 0, 1), zeros past N.
__device__ __forceinline__ uint2 frag_load_tail(const FragParams& p, int grp, int lane) {
  uint2 r = make_uint2(0u, 0u);
  if (grp >= p.groups) return r;
  const int8_t* gb = p.w + int64_t(grp) * 16 * p.K;
  const int rows = p.N - grp * 16;
  if (rows >= 16)
    return dev::ld_global(reinterpret_cast<const uint2*>(gb + int64_t(p.units) * kFragUnitBytes + lane * 8));
  const int g = lane / 4, t = lane % 4;
  const int64_t k0 = int64_t(p.units) * kFragUnitK;
  if (g < rows) r.x = frag_plain_word(gb + int64_t(g) * p.K, k0, t);
  if (8 + g < rows) r.y = frag_plain_word(gb + int64_t(8 + g) * p.K, k0, t);
  return r;
}

// Lane (g, t)'s A fragment of x for the k16 step at k0: rows g and g + 8 (zero at or past M), columns k0 + 2t + {0,
// 1} and k0 + 2t + {8, 9}.
template <typename T>
__device__ __forceinline__ void frag_load_a(const FragParams& p, int64_t k0, int lane, uint32_t (&a)[4]) {
  const int g = lane / 4, t = lane % 4;
  const T* x = static_cast<const T*>(p.x);
  for (int h = 0; h < 2; ++h) {
    const int m = g + 8 * h;
    // FAULT(frag_m_mask)
    const bool live = m < p.M;
    const T* row = x + int64_t(m) * p.sx + k0 + 2 * t;
    a[h] = live ? dev::ld_global(reinterpret_cast<const uint32_t*>(row)) : 0u;
    a[2 + h] = live ? dev::ld_global(reinterpret_cast<const uint32_t*>(row + 8)) : 0u;
  }
}

// One step's registers: the weight of kFragUnits units x kFragGroups groups and x's A fragments of their k16 steps.
struct FragStep {
  uint4 w[kFragUnits][kFragGroups];
  uint32_t a[kFragUnits][2][4];
};

// Issues every load of warp `warp`'s share of step `step`. kEdge: units at or past `u_end` are skipped (a
// warp-uniform test) and groups may be short or missing; otherwise every unit and group of the step is whole.
template <typename T, bool kEdge>
__device__ __forceinline__ void frag_load_step(const FragParams& p, FragStep& st, int u_begin, int u_end, int step,
                                               int warp, int lane, int grp0) {
#pragma unroll
  for (int q = 0; q < kFragUnits; ++q) {
    const int u = u_begin + step * kFragWarps * kFragUnits + warp * kFragUnits + q;
    if (kEdge && u >= u_end) continue;
#pragma unroll
    for (int G = 0; G < kFragGroups; ++G) st.w[q][G] = frag_load_unit<kEdge>(p, grp0 + G, u, lane);
#pragma unroll
    for (int s = 0; s < 2; ++s) frag_load_a<T>(p, int64_t(u) * kFragUnitK + 16 * s, lane, st.a[q][s]);
  }
}

// The MMAs of a loaded step: acc[G][j] += A(s) B(G, j, s) over its units and k16 steps.
template <typename T, bool kEdge>
__device__ __forceinline__ void frag_mma_step(const FragStep& st, float (&acc)[kFragGroups][2][4], int u_begin,
                                              int u_end, int step, int warp) {
#pragma unroll
  for (int q = 0; q < kFragUnits; ++q) {
    const int u = u_begin + step * kFragWarps * kFragUnits + warp * kFragUnits + q;
    if (kEdge && u >= u_end) continue;
#pragma unroll
    for (int G = 0; G < kFragGroups; ++G) {
      const uint32_t words[4] = {st.w[q][G].x, st.w[q][G].y, st.w[q][G].z, st.w[q][G].w};
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t b[2];
          // FAULT(frag_word_index)
          frag_dequant<T>(words[2 * s + j], b);
          dev::mma_m16n8k16<T>(acc[G][j], st.a[q][s], b, acc[G][j]);
        }
    }
  }
}

// Steps [first, last) of the split's K range on two register buffers: step i + 1's loads are all issued before step
// i's first HMMA.
template <typename T, bool kEdge>
__device__ __forceinline__ void frag_k_loop(const FragParams& p, float (&acc)[kFragGroups][2][4], int u_begin,
                                            int u_end, int first, int last, int warp, int lane, int grp0) {
  FragStep buf0, buf1;
  if (first < last) frag_load_step<T, kEdge>(p, buf0, u_begin, u_end, first, warp, lane, grp0);
  for (int i = first; i < last; i += 2) {
    if (i + 1 < last) frag_load_step<T, kEdge>(p, buf1, u_begin, u_end, i + 1, warp, lane, grp0);
    frag_mma_step<T, kEdge>(buf0, acc, u_begin, u_end, i, warp);
    if (i + 1 < last) {
      if (i + 2 < last) frag_load_step<T, kEdge>(p, buf0, u_begin, u_end, i + 2, warp, lane, grp0);
      frag_mma_step<T, kEdge>(buf1, acc, u_begin, u_end, i + 1, warp);
    }
  }
}

// Thread 0 counts the CTA done on its column's counter (after the barrier: its release publishes every thread's
// partial stores) and the last CTA's thread 0 acquires; returns whether this CTA is the last, to every thread.
// Epochs (as decode_arrive in window_attention_decode.cuh): a launch owns counter values [epoch * kFragMaxSplits,
// + splits]; the relaxed max lifts whatever an earlier launch (an aborted one too) left to its base.
__device__ __forceinline__ bool frag_arrive(const FragParams& p, int* last_s) {
  // FAULT(frag_split_fence)
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long* counter = p.counters + blockIdx.x;
    const unsigned long long base = p.epoch * kFragMaxSplits;
    dev::atomic_max(counter, base);
    // FAULT(frag_split_release)
    const bool last = dev::atomic_add_release(counter, 1ull) == base + p.splits - 1;
    // FAULT(frag_split_acquire)
    if (last) dev::fence_acq_rel();
    *last_s = last;
  }
  __syncthreads();
  return *last_s != 0;
}

// Warp 0's outputs: y[m, n] = acc * scale[n] + bias[n] for m < M, n < N. Lane (g, t), tile (G, j), register e holds
// m = g + 8 (e / 2), n = 16 (grp0 + G) + 8 j + 2 t + e % 2.
template <typename T>
__device__ __forceinline__ void frag_epilogue(const FragParams& p, const float (&acc)[kFragGroups][2][4], int grp0,
                                              int lane) {
  const int g = lane / 4, t = lane % 4;
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int G = 0; G < kFragGroups; ++G)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = g + 8 * (e / 2);
        const int64_t n = int64_t(grp0 + G) * 16 + 8 * j + 2 * t + e % 2;
        // FAULT(frag_store_mask)
        if (m >= p.M || n >= p.N) continue;
        float v = acc[G][j][e] * dev::ld_global(p.scale + n);
        if (p.bias_kind == kFragBiasF32) v += dev::ld_global(static_cast<const float*>(p.bias) + n);
        if (p.bias_kind == kFragBiasT) v += FragConv<T>::to_float(dev::ld_global(static_cast<const T*>(p.bias) + n));
        dev::st_global(y + int64_t(m) * p.N + n, FragConv<T>::from_float(v));
      }
}

// The partial of (split, column) in the workspace: [kFragGroups * 16 n][16 m] floats; lane's element (G, j, e).
__device__ __forceinline__ int64_t frag_part_index(int split, int col, int G, int j, int e, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int n = G * 16 + 8 * j + 2 * t + e % 2, m = g + 8 * (e / 2);
  return ((int64_t(split) * gridDim.x + col) * (kFragGroups * 16) + n) * 16 + m;
}

template <typename T>
__global__ void __launch_bounds__(kFragThreads, kFragMinBlocks) w8a16_fragment_kernel(const FragParams p) {
  AK_SHARED(16, float, red, [kFragWarps - 1][kFragGroups * 8][32]);
  AK_SHARED(4, int, last_s, [1]);
  dev::pdl_wait();  // x, the workspace, the counters and y may belong to the kernels before us
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp0 = blockIdx.x * kFragGroups, split = blockIdx.y;
  const int u_begin = split * p.split_units;
  const int u_end = split == p.splits - 1 ? p.units : u_begin + p.split_units;
  constexpr int kStep = kFragWarps * kFragUnits;
  const int steps = (u_end - u_begin + kStep - 1) / kStep;
  // The checked loop runs in the column holding the short last group (or a missing one) and in a split whose K range
  // ends in a partial step (the last split, where units is not a multiple of its length: none on the Llama shapes);
  // every other CTA runs the unchecked one (no per-unit or per-group tests).
  // FAULT(frag_partial_step)
  const bool edge = grp0 + kFragGroups > p.groups || (grp0 + kFragGroups) * 16 > p.N || (u_end - u_begin) % kStep;

  float acc[kFragGroups][2][4];
#pragma unroll
  for (int G = 0; G < kFragGroups; ++G)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[G][j][e] = 0.f;

  if (edge) {
    frag_k_loop<T, true>(p, acc, u_begin, u_end, 0, steps, warp, lane, grp0);
  } else {
    frag_k_loop<T, false>(p, acc, u_begin, u_end, 0, steps, warp, lane, grp0);
  }
  // The 16-column K tail, in the last split, by the last warp (the one with the least of the last step's units).
  // FAULT(frag_k_tail)
  if (p.tail && split == p.splits - 1 && warp == kFragWarps - 1) {
    uint32_t a[4];
    frag_load_a<T>(p, int64_t(p.units) * kFragUnitK, lane, a);
#pragma unroll
    for (int G = 0; G < kFragGroups; ++G) {
      const uint2 wt = frag_load_tail(p, grp0 + G, lane);
      const uint32_t words[2] = {wt.x, wt.y};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t b[2];
        frag_dequant<T>(words[j], b);
        dev::mma_m16n8k16<T>(acc[G][j], a, b, acc[G][j]);
      }
    }
  }
  dev::pdl_launch_dependents();  // the weight stream is over: the next kernel's launch overlaps our reduction

  // The warps' sums, added in warp order by warp 0.
  if (warp > 0)
#pragma unroll
    for (int G = 0; G < kFragGroups; ++G)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp - 1][(G * 2 + j) * 4 + e][lane] = acc[G][j][e];
  __syncthreads();
  if (warp == 0)
    for (int w = 0; w < kFragWarps - 1; ++w)
#pragma unroll
      for (int G = 0; G < kFragGroups; ++G)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[G][j][e] += red[w][(G * 2 + j) * 4 + e][lane];

  if (p.splits > 1) {
    if (warp == 0)
#pragma unroll
      for (int G = 0; G < kFragGroups; ++G)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dev::st_global(p.part + frag_part_index(split, blockIdx.x, G, j, e, lane), acc[G][j][e]);
    if (!frag_arrive(p, last_s)) return;
    if (warp != 0) return;
    // Every split's partial, added in split order (L2 reads: other CTAs wrote them during this launch).
#pragma unroll
    for (int G = 0; G < kFragGroups; ++G)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[G][j][e] = 0.f;
    for (int s = 0; s < p.splits; ++s)
#pragma unroll
      for (int G = 0; G < kFragGroups; ++G)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[G][j][e] += dev::ld_global_cg(p.part + frag_part_index(s, blockIdx.x, G, j, e, lane));
  } else if (warp != 0) {
    return;
  }
  frag_epilogue<T>(p, acc, grp0, lane);
}

}  // namespace arkernels
