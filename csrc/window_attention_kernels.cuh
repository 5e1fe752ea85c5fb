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
// reference): max(kv_start[b], 0) <= j <= i and (window == 0 or j > i - window), i the query's absolute position.
//
// Keys in a block whose id is out of range, and keys past the block table's capacity (a seq_len above
// max_blocks * block_size), are masked and never read (check=False callers); queries keep the positions seq_lens gives
// them, so such a query may see no key at all (zeros, lse -inf). Offsets are int64.
//
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "device.cuh"
#include "device_mma.cuh"

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
  __device__ static float2 to_float2(uint32_t x) { return __half22float2(*reinterpret_cast<__half2*>(&x)); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static float to_float(__half x) { return __half2float(x); }
};
template <>
struct Conv<__nv_bfloat16> {
  __device__ static float2 to_float2(uint32_t x) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
  }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// 16 bytes = 8 elements -> 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const float2 a = Conv<T>::to_float2(v.x), b = Conv<T>::to_float2(v.y), c = Conv<T>::to_float2(v.z),
               d = Conv<T>::to_float2(v.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

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
  const float* k_scale;        // fp8 caches: stored = key / k_scale (a one-element fp32 tensor); nullptr otherwise
  const float* v_scale;
  void* out;                   // [rows, Hq, D] contiguous
  float* lse;                  // [rows, Hq]
  float* part_out;             // [num_splits, rows, Hq, D] fp32 (decode, num_splits > 1)
  float* part_lse;             // [num_splits, rows, Hq]
  AttnStrides s;
  int64_t rows, num_blocks, block_size, max_blocks;
  int hq, hkv, group, head_chunks, num_splits, window;
  float scale, softcap;
  bool q_vec;  // query rows 16-byte aligned
};

// Element offset of key j's row for KV head h in a cache with strides (s0, s1, s2); -1 when its block id is invalid.
__device__ __forceinline__ int64_t key_offset(const AttnParams& p, int64_t b, int64_t j, int h, int64_t s0, int64_t s1,
                                              int64_t s2) {
  const int64_t blk = dev::ld_global(p.block_table + b * p.max_blocks + j / p.block_size);
  if (blk < 0 || blk >= p.num_blocks) return -1;
  return blk * s0 + (j % p.block_size) * s1 + h * s2;
}

// Stage keys [j0, j0 + N) of KV head kvh into shared tiles k_dst / v_dst (row stride ld elements), the K/V tile load
// of both kernels: thread t < N computes key j0 + t's row offsets (-1 outside [lo, hi] or under an invalid block id,
// kept in koff_s / voff_s for the caller's masking), then all threads copy 16-byte chunks (zeros for -1 rows).
// Requires N <= kAttnThreads; the caller synchronises before (previous tile consumed) and after (tile ready).
template <typename T, int D, int N>
__device__ __forceinline__ void stage_kv_tile(const AttnParams& p, int64_t b, int kvh, int64_t j0, int64_t lo, int64_t hi,
                                              int64_t* koff_s, int64_t* voff_s, T* k_dst, T* v_dst, int ld, int tid) {
  static_assert(N <= kAttnThreads, "one thread per key computes the offsets");
  constexpr int kChunks = D / 8;
  if (tid < N) {
    const int64_t j = j0 + tid;
    const bool in = j >= lo && j <= hi;
    koff_s[tid] = in ? key_offset(p, b, j, kvh, p.s.k0, p.s.k1, p.s.k2) : -1;
    voff_s[tid] = in ? key_offset(p, b, j, kvh, p.s.v0, p.s.v1, p.s.v2) : -1;
  }
  __syncthreads();
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int idx = tid; idx < N * kChunks; idx += kAttnThreads) {
    const int k = idx / kChunks, c = idx % kChunks;
    const int64_t ko = koff_s[k], vo = voff_s[k];
    uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
    if (ko >= 0) {
      kv = dev::ld_global(reinterpret_cast<const uint4*>(kc + ko + c * 8));
      vv = dev::ld_global(reinterpret_cast<const uint4*>(vc + vo + c * 8));
    }
    *reinterpret_cast<uint4*>(k_dst + k * ld + c * 8) = kv;
    *reinterpret_cast<uint4*>(v_dst + k * ld + c * 8) = vv;
  }
}

// Copy one query row (D elements) into shared memory as fp32 (decode) -- vectorised when aligned.
template <typename T, int D>
__device__ __forceinline__ void load_q_f32(const AttnParams& p, const T* src, float* dst, int tid, int nthreads) {
  if (p.q_vec) {
    for (int c = tid; c < D / 8; c += nthreads) {
      float f[8];
      unpack8<T>(dev::ld_global(reinterpret_cast<const uint4*>(src + c * 8)), f);
#pragma unroll
      for (int x = 0; x < 8; ++x) dst[c * 8 + x] = f[x];
    }
  } else {
    for (int x = tid; x < D; x += nthreads) dst[x] = Conv<T>::to_float(dev::ld_global(src + x));
  }
}

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

// prefill: cu_seqlens_q given. rows = query rows; max_blocks x block_size = the block table's capacity; fp8: the caches
// are float8_e4m3fn (decode only: prefill takes 16-bit caches).
inline WindowAttentionPlan plan_window_attention(bool prefill, int64_t batch, int64_t rows, int64_t hq, int64_t hkv,
                                                 int64_t d, bool fp8, int64_t max_blocks, int64_t block_size,
                                                 int64_t window, int64_t max_q_len, const DeviceProps& props) {
  WindowAttentionPlan plan;
  plan.prefill = prefill;
  if (prefill) {
    plan.pre = plan_prefill(batch, hq, d, max_q_len, props);
  } else {
    plan.decode = plan_decode(batch, rows, hq, hkv, d, fp8, max_blocks, block_size, window, props);
  }
  return plan;
}

// The launches of one call, in stream order; returns the first launch error. KV: the caches' element type (T, or
// uint8_t for float8_e4m3fn, decode only).
template <typename T, typename KV, int D>
cudaError_t run_window_attention(const AttnParams& p, const WindowAttentionPlan& plan, cudaStream_t stream) {
  if (plan.prefill) {
    if constexpr (std::is_same_v<KV, T>) return run_prefill<T, D>(p, plan.pre, stream);
    return cudaErrorInvalidValue;
  }
  return run_decode<T, KV, D>(p, plan.decode, stream);
}

}  // namespace arkernels
