// window_attention device code and launch planning: causal (sliding-window) attention over the paged KV cache,
// fp16/bf16, GQA. No ATen here: nvcc compiles this for the GPU (csrc/window_attention.cu) and the host compiler for
// the SIMT emulator (csrc/simt/simt_ops.cpp), from the same source. Launch planning (plan_window_attention) is a
// pure function of shapes and DeviceProps, called by both. The decode kernel and its planning are in
// window_attention_decode.cuh, the prefill kernel and its planning in window_attention_prefill.cuh; this file holds
// what both share and the dispatch between them.
//
//
// Layout: query [num_queries, Hq, D] (rows and heads strided, last dim contiguous); caches
// [num_blocks, block_size, Hkv, D] (any 16-byte aligned strides); key j of sequence b lives in block
// block_table[b, j / block_size] at offset j % block_size. Visibility (same rule as the CPU kernel and the
// reference): max(kv_start[b], 0) <= j <= i and (window == 0 or j > i - window), i the query's absolute position, and
// with chunk_size C only keys of i's chunk (window_attention_mask.h: one lower bound). Attention sinks: one more
// softmax term per query head with no value, added once per query after its keys (decode: by the single split, or in
// the split-KV combine; prefill: when a row's output is written).
//
// Keys in a block whose id is out of range, and keys past the block table's capacity (a seq_len above
// max_blocks * block_size), are masked and never read (check=False callers); queries keep the positions seq_lens gives
// them, so such a query may see no key at all (zeros, lse -inf). Offsets are int64.
// Launches overlap the kernel before them on sm_90 (programmatic dependent launch, pdl.cuh): both kernels wait before
// their first global access and let their successor be scheduled when their key loop is over.
//
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "device.cuh"
#include "device_mma.cuh"
#include "pdl.cuh"
#include "window_attention_mask.h"

#include <cuda_fp8.h>  // e4m3 -> half (cvt on sm_89+; the header's software path elsewhere and in the emulator)

namespace arkernels {

constexpr int kAttnThreads = 128;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

template <typename T>
struct Conv;
template <>
struct Conv<__half> {
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Conv<__nv_bfloat16> {
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// Two fp32 values -> one 32-bit register of a T pair (the lower-indexed element in the low half): an mma A fragment
// register, or a 2-element store.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const T a = Conv<T>::from_float(lo), c = Conv<T>::from_float(hi);
  uint16_t ua, uc;
  memcpy(&ua, &a, 2);
  memcpy(&uc, &c, 2);
  return uint32_t(ua) | uint32_t(uc) << 16;
}

__device__ __forceinline__ float cap_score(float s, float softcap) {
  return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

struct AttnStrides {
  int64_t q0, q1;          // query [rows, Hq, D], in elements
  int64_t k0, k1, k2;      // k_cache
  int64_t v0, v1, v2;      // v_cache
};

struct AttnParams {
  const void* query;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_table;  // [batch, max_blocks], contiguous
  const int32_t* seq_lens;     // [batch]
  const int32_t* cu_seqlens_q; // [batch + 1] or nullptr (decode)
  const int32_t* kv_start;     // [batch] or nullptr
  const float* sinks;          // [Hq] fp32 attention-sink logits (natural log, unscaled) or nullptr
  const float* k_scale;        // fp8 caches: stored = key / k_scale (a one-element fp32 tensor); nullptr otherwise
  const float* v_scale;
  void* out;                   // [rows, Hq, D] contiguous
  float* lse;                  // [rows, Hq]
  float* part_out;             // [num_splits, rows, Hq, D] fp32 (decode, num_splits > 1)
  float* part_lse;             // [num_splits, rows, Hq], log2 units
  unsigned long long* counters;  // [>= batch * gridDim.y] split-KV arrival counts, epoch-stamped (decode_arrive)
  unsigned long long epoch;      // this launch's epoch on `counters`: larger than every earlier launch's on them
  AttnStrides s;
  int64_t rows, num_blocks, block_size, max_blocks;
  int hq, hkv, group, head_chunks, num_splits, window;
  int chunk;  // chunked attention: chunks of `chunk` positions from max(kv_start, 0); 0: off
  float scale, softcap;
  bool q_vec;  // query rows 16-byte aligned
};

}  // namespace arkernels

#include "window_attention_decode.cuh"
#include "window_attention_prefill.cuh"

namespace arkernels {

// Everything a launch needs, from shapes and device properties only (no host sync, so graph-capturable), shared by
// the CUDA launcher and the emulator.
struct WindowAttentionPlan {
  bool prefill = false;
  DecodePlan decode;
  PrefillPlan pre;
};

// varlen: cu_seqlens_q given, max_q_len its host-known bound: the multi-query decode kernel when
// use_multiquery_decode(max_q_len, group, d) (speculative verification: a few query rows per sequence), else prefill;
// without it, decode. rows = query rows; max_blocks x block_size = the block table's capacity; fp8: the caches are
// float8_e4m3fn (both kernels read them as stored: the shared-memory layouts differ).
inline WindowAttentionPlan plan_window_attention(bool varlen, int64_t batch, int64_t rows, int64_t hq, int64_t hkv,
                                                 int64_t d, bool fp8, int64_t max_blocks, int64_t block_size,
                                                 int64_t window, int64_t chunk, int64_t max_q_len,
                                                 const DeviceProps& props) {
  (void)rows;
  WindowAttentionPlan plan;
  // FAULT(mq_dispatch)
  plan.prefill = varlen && !use_multiquery_decode(max_q_len, hq / hkv, d);
  if (plan.prefill) {
    plan.pre = plan_prefill(batch, hq, d, fp8, max_q_len, props);
  } else {
    plan.decode = plan_decode(batch, varlen ? max_q_len : 1, varlen, hq, hkv, d, fp8, max_blocks, block_size, window,
                              chunk, props);
  }
  return plan;
}

// The launches of one call, in stream order; returns the first launch error. KV: the caches' element type (T, or
// uint8_t for float8_e4m3fn).
template <typename T, typename KV, int D>
cudaError_t run_window_attention(const AttnParams& p, const WindowAttentionPlan& plan, cudaStream_t stream) {
  if (plan.prefill) return run_prefill<T, KV, D>(p, plan.pre, stream);
  return run_decode<T, KV, D>(p, plan.decode, stream);
}

}  // namespace arkernels
