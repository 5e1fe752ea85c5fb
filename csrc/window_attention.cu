// window_attention on CUDA: causal (sliding-window) attention over the paged KV cache, fp16/bf16, GQA.
//
// Layout: query [num_queries, Hq, D] (rows and heads strided, last dim contiguous); caches
// [num_blocks, block_size, Hkv, D] (any 16-byte aligned strides); key j of sequence b lives in block
// block_table[b, j / block_size] at offset j % block_size. Visibility (same rule as the CPU kernel and the
// reference): max(kv_start[b], 0) <= j <= i and (window == 0 or j > i - window), i the query's absolute position.
//
// Decode (cu_seqlens_q None, one query per sequence at i = seq_len - 1): window_attention_decode_kernel.
//   Grid (num_splits, Hkv * head_chunks, batch), 128 threads. A CTA owns one KV head and up to 8 of its query heads
//   (GQA: each K/V row is read from memory once for all of them) and one split of the visible range
//   [max(kv_start, i - W + 1, 0), i] -- only min(seq_len, W) keys, so time stops growing past the window.
//   Tiles of 32 keys are loaded into shared memory with 16-byte vector loads (per-key offsets resolved once per tile);
//   scores: 8-lane groups per (head, key), each lane one 16-byte chunk of the row, shuffle reduce; online softmax in
//   fp32 (one warp per head, one lane per key); P.V: each thread owns 8 output columns of one head, fp32 registers.
//   num_splits comes from shapes only (batch, heads, table width, window, SM count): no host sync, graph-capturable.
//   With num_splits > 1 each split writes fp32 (out, lse) partials and window_attention_combine_kernel merges them.
// Prefill (cu_seqlens_q given): window_attention_prefill_kernel, FlashAttention-2 style with WMMA tensor cores
//   (16x16x16, fp16/bf16 in, fp32 accumulate). Grid (max(1, ceil(max_q_len / 64)), Hq, batch), 128 threads; a CTA
//   strides over its sequence's 64-row query blocks (once with a right max_q_len; a too-small max_q_len costs time,
//   never unwritten rows); each warp owns 16 query rows. Key tiles of BN (64, or 32 for D = 256, and for D = 128 on
//   99 KB-per-block GPUs) are loaded into shared memory; only tiles intersecting
//   [min visible key of the block's first row, last row's position] are visited, so tiles wholly outside the causal
//   window are skipped. S = Q K^T (WMMA) -> shared fp32; mask/scale/softcap/online softmax per row in fp32 (2 lanes
//   per row); P (fp16/bf16) . V (WMMA) accumulates into an fp32 O tile in shared memory, rescaled per row.
// Keys in a block whose id is out of range are masked and never read (check=False callers); offsets are int64.
//
// Resource use (nvcc 13.0 -Xptxas -v; registers sm_80 fp16/bf16, sm_90 fp16/bf16; no spills in any of the 48):
//   decode  D=64: 72/80, 72/72 regs, 11.6 KB static smem    prefill D=64: 104/124, 106/127 regs, 71.2 KB dynamic smem
//   decode  D=80: 72/72, 72/72 regs, 14.1 KB                prefill D=80: 107/128, 108/128 regs, 81.2 KB
//   decode  D=96: 72/72, 72/72 regs, 16.6 KB                prefill D=96: 109/128, 110/128 regs, 91.2 KB
//   decode D=128: 72/80, 72/72 regs, 21.6 KB                prefill D=128: 128/128, 128/128 regs, 111.2 KB
//   decode D=256: 96/118, 96/96 regs, 41.6 KB               prefill D=128, BN=32: 128/124, 126/128 regs, 81.8 KB
//   combine: 32 regs, no smem.                              prefill D=256: 128/128, 128/128 regs, 145.8 KB (BN = 32)
//   Prefill is __launch_bounds__(128, 4): at most 128 registers, which never limits occupancy (shared memory allows
//   at most 3 CTAs per SM), and without the min-blocks hint ptxas kept 64-80 registers and spilled 4-12 bytes in
//   6 of the 24 prefill kernels once the query-block loop was added. Compile time: about 2 minutes on 2 cores.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "window_attention.h"

namespace arkernels {
namespace {

constexpr int kThreads = 128;
constexpr int kDecodeTileKeys = 32;  // one warp lane per key in the softmax step
constexpr int kDecodeHeads = 8;      // query heads per decode CTA (GQA groups above 8 take several CTAs)
constexpr int kMaxSplits = 64;
constexpr int kPrefillRows = 64;     // query rows per prefill CTA: 4 warps x 16

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

__device__ __forceinline__ float cap_score(float s, float softcap) {
  return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

struct Strides {
  int64_t q0, q1;          // query [rows, Hq, D], in elements
  int64_t k0, k1, k2;      // k_cache
  int64_t v0, v1, v2;      // v_cache
};

struct Params {
  const void* query;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_table;  // [batch, max_blocks], contiguous
  const int32_t* seq_lens;     // [batch]
  const int32_t* cu_seqlens_q; // [batch + 1] or nullptr (decode)
  const int32_t* kv_start;     // [batch] or nullptr
  void* out;                   // [rows, Hq, D] contiguous
  float* lse;                  // [rows, Hq]
  float* part_out;             // [num_splits, rows, Hq, D] fp32 (decode, num_splits > 1)
  float* part_lse;             // [num_splits, rows, Hq]
  Strides s;
  int64_t rows, num_blocks, block_size, max_blocks;
  int hq, hkv, group, head_chunks, num_splits, window;
  float scale, softcap;
  bool q_vec;  // query rows 16-byte aligned
};

// Element offset of key j's row for KV head h in a cache with strides (s0, s1, s2); -1 when its block id is invalid.
__device__ __forceinline__ int64_t key_offset(const Params& p, int64_t b, int64_t j, int h, int64_t s0, int64_t s1,
                                              int64_t s2) {
  const int64_t blk = p.block_table[b * p.max_blocks + j / p.block_size];
  if (blk < 0 || blk >= p.num_blocks) return -1;
  return blk * s0 + (j % p.block_size) * s1 + h * s2;
}

// Stage keys [j0, j0 + N) of KV head kvh into shared tiles k_dst / v_dst (row stride ld elements), the K/V tile load
// of both kernels: thread t < N computes key j0 + t's row offsets (-1 outside [lo, hi] or under an invalid block id,
// kept in koff_s / voff_s for the caller's masking), then all threads copy 16-byte chunks (zeros for -1 rows).
// Requires N <= kThreads; the caller synchronises before (previous tile consumed) and after (tile ready).
template <typename T, int D, int N>
__device__ __forceinline__ void stage_kv_tile(const Params& p, int64_t b, int kvh, int64_t j0, int64_t lo, int64_t hi,
                                              int64_t* koff_s, int64_t* voff_s, T* k_dst, T* v_dst, int ld, int tid) {
  static_assert(N <= kThreads, "one thread per key computes the offsets");
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
  for (int idx = tid; idx < N * kChunks; idx += kThreads) {
    const int k = idx / kChunks, c = idx % kChunks;
    const int64_t ko = koff_s[k], vo = voff_s[k];
    uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
    if (ko >= 0) {
      kv = *reinterpret_cast<const uint4*>(kc + ko + c * 8);
      vv = *reinterpret_cast<const uint4*>(vc + vo + c * 8);
    }
    *reinterpret_cast<uint4*>(k_dst + k * ld + c * 8) = kv;
    *reinterpret_cast<uint4*>(v_dst + k * ld + c * 8) = vv;
  }
}

// Copy one query row (D elements) into shared memory as fp32 (decode) -- vectorised when aligned.
template <typename T, int D>
__device__ __forceinline__ void load_q_f32(const Params& p, const T* src, float* dst, int tid, int nthreads) {
  if (p.q_vec) {
    for (int c = tid; c < D / 8; c += nthreads) {
      float f[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(src + c * 8), f);
#pragma unroll
      for (int x = 0; x < 8; ++x) dst[c * 8 + x] = f[x];
    }
  } else {
    for (int x = tid; x < D; x += nthreads) dst[x] = Conv<T>::to_float(src[x]);
  }
}

// ------------------------------------------------------------------------------------------------ decode
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) window_attention_decode_kernel(const Params p) {
  constexpr int kChunks = D / 8;                                  // 16-byte chunks per row
  constexpr int kPairsPerThread = (kDecodeHeads * kChunks + kThreads - 1) / kThreads;  // <= 2
  __shared__ __align__(16) T k_tile[kDecodeTileKeys * D];
  __shared__ __align__(16) T v_tile[kDecodeTileKeys * D];
  __shared__ __align__(16) float q_s[kDecodeHeads * D];
  __shared__ float s_s[kDecodeHeads][kDecodeTileKeys];
  __shared__ float alpha_s[kDecodeHeads], m_s[kDecodeHeads], l_s[kDecodeHeads];
  __shared__ int64_t koff_s[kDecodeTileKeys], voff_s[kDecodeTileKeys];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks;
  const int64_t b = blockIdx.z;
  const int h0 = kvh * p.group + chunk * kDecodeHeads;             // first query head of this CTA
  const int hc = min(kDecodeHeads, p.group - chunk * kDecodeHeads);  // query heads of this CTA
  const int64_t len = min64(p.seq_lens[b], p.max_blocks * p.block_size);
  const int64_t i = len - 1;  // the query's position
  int64_t lo = p.kv_start ? max64(p.kv_start[b], 0) : 0;
  if (p.window > 0) lo = max64(lo, i - p.window + 1);
  const int64_t n = i - lo + 1;  // visible keys (<= 0: none)
  // This split's keys: whole tiles, so splits never share a tile.
  const int64_t per_split = n > 0 ? ((n + p.num_splits - 1) / p.num_splits + kDecodeTileKeys - 1) /
                                        kDecodeTileKeys * kDecodeTileKeys
                                  : 0;
  const int64_t s_lo = lo + split * per_split;
  const int64_t s_hi = min64(i, s_lo + per_split - 1);

  const T* q = static_cast<const T*>(p.query);
  for (int h = 0; h < hc; ++h) load_q_f32<T, D>(p, q + b * p.s.q0 + (h0 + h) * p.s.q1, q_s + h * D, tid, kThreads);
  if (tid < kDecodeHeads) {
    m_s[tid] = neg_inf();
    l_s[tid] = 0.f;
  }
  float acc[kPairsPerThread][8];
#pragma unroll
  for (int r = 0; r < kPairsPerThread; ++r)
#pragma unroll
    for (int x = 0; x < 8; ++x) acc[r][x] = 0.f;

  const int grp = tid / 8, gl = tid % 8;  // 16 groups of 8 lanes for the scores
  for (int64_t t0 = s_lo; t0 <= s_hi; t0 += kDecodeTileKeys) {
    __syncthreads();  // the previous tile is fully consumed (and q_s / m_s are ready on the first pass)
    stage_kv_tile<T, D, kDecodeTileKeys>(p, b, kvh, t0, s_lo, s_hi, koff_s, voff_s, k_tile, v_tile, D, tid);
    __syncthreads();
    // Scores: pair (head, key) per 8-lane group.
    for (int pr = grp; pr < hc * kDecodeTileKeys; pr += kThreads / 8) {
      const int h = pr / kDecodeTileKeys, k = pr % kDecodeTileKeys;
      float dot = 0.f;
      for (int c = gl; c < kChunks; c += 8) {
        float f[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(k_tile + k * D + c * 8), f);
        const float4 qa = *reinterpret_cast<const float4*>(q_s + h * D + c * 8);
        const float4 qb = *reinterpret_cast<const float4*>(q_s + h * D + c * 8 + 4);
        dot += qa.x * f[0] + qa.y * f[1] + qa.z * f[2] + qa.w * f[3] + qb.x * f[4] + qb.y * f[5] + qb.z * f[6] +
               qb.w * f[7];
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 4);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      if (gl == 0) s_s[h][k] = koff_s[k] >= 0 ? cap_score(dot * p.scale, p.softcap) : neg_inf();
    }
    __syncthreads();
    // Online softmax: one warp per head, one lane per key.
    for (int h = warp; h < hc; h += kThreads / 32) {
      const float s = s_s[h][lane];
      float mx = s;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = m_s[h];
      const float m_new = fmaxf(m_old, mx);
      const float pr = s == neg_inf() ? 0.f : __expf(s - m_new);
      float sum = pr;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      s_s[h][lane] = pr;
      __syncwarp();
      if (lane == 0) {
        const float alpha = m_old == neg_inf() ? 0.f : __expf(m_old - m_new);
        alpha_s[h] = alpha;
        l_s[h] = l_s[h] * alpha + sum;
        m_s[h] = m_new;
      }
    }
    __syncthreads();
    // P.V: thread owns 8 columns of one head.
#pragma unroll
    for (int r = 0; r < kPairsPerThread; ++r) {
      const int pi = tid + r * kThreads;
      const int h = pi / kChunks, c = pi % kChunks;
      if (h >= hc) continue;
      const float alpha = alpha_s[h];
#pragma unroll
      for (int x = 0; x < 8; ++x) acc[r][x] *= alpha;
      for (int k = 0; k < kDecodeTileKeys; ++k) {
        const float w = s_s[h][k];
        float f[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(v_tile + k * D + c * 8), f);
#pragma unroll
        for (int x = 0; x < 8; ++x) acc[r][x] += w * f[x];
      }
    }
  }
  __syncthreads();
  // Write: directly (one split) or as an fp32 partial normalised by this split's own sum.
#pragma unroll
  for (int r = 0; r < kPairsPerThread; ++r) {
    const int pi = tid + r * kThreads;
    const int h = pi / kChunks, c = pi % kChunks;
    if (h >= hc) continue;
    const float l = l_s[h];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse = l > 0.f ? m_s[h] + __logf(l) : neg_inf();
    const int64_t oh = b * p.hq + h0 + h;  // (row, head) index
    if (p.num_splits == 1) {
      T* o = static_cast<T*>(p.out) + oh * D + c * 8;
#pragma unroll
      for (int x = 0; x < 8; ++x) o[x] = Conv<T>::from_float(acc[r][x] * inv);
      if (c == 0) p.lse[oh] = lse;
    } else {
      float* o = p.part_out + (split * p.rows * p.hq + oh) * D + c * 8;
#pragma unroll
      for (int x = 0; x < 8; ++x) o[x] = acc[r][x] * inv;
      if (c == 0) p.part_lse[split * p.rows * p.hq + oh] = lse;
    }
  }
}

// Merge num_splits partials: lse = logsumexp_s(lse_s), out = sum_s exp(lse_s - lse) * out_s. One CTA per (row, head).
template <typename T>
__global__ void __launch_bounds__(kThreads) window_attention_combine_kernel(const Params p, int d) {
  const int64_t oh = blockIdx.x;
  const int64_t stride = p.rows * p.hq;
  float m = neg_inf();
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.part_lse[s * stride + oh]);
  float total = 0.f;
  if (m != neg_inf()) {
    for (int s = 0; s < p.num_splits; ++s) total += __expf(p.part_lse[s * stride + oh] - m);
  }
  const float lse = total > 0.f ? m + __logf(total) : neg_inf();
  T* o = static_cast<T*>(p.out) + oh * d;
  for (int x = threadIdx.x; x < d; x += blockDim.x) {
    float v = 0.f;
    if (total > 0.f) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float ls = p.part_lse[s * stride + oh];
        if (ls != neg_inf()) v += __expf(ls - lse) * p.part_out[(s * stride + oh) * d + x];
      }
    }
    o[x] = Conv<T>::from_float(v);
  }
  if (threadIdx.x == 0) p.lse[oh] = lse;
}

// ------------------------------------------------------------------------------------------------ prefill
// Key tile width by head_dim: D = 256 takes 32-key tiles to stay under sm_80's 163 KB. A GPU whose per-block opt-in
// limit is lower (sm_86/sm_89/sm_120: 99 KB) cannot take the 111.2 KB of D = 128 with BN = 64: the host then launches
// the BN = 32 variant (81.8 KB); D = 256 (145.8 KB even with BN = 32) is refused there with a clear error.
template <int D>
constexpr int kPrefillKeys = D <= 128 ? 64 : 32;

template <int D, int BN_>
struct PrefillTile {
  static constexpr int BM = kPrefillRows;
  static constexpr int BN = BN_;
  static constexpr int LDQ = D + 8, LDK = D + 8, LDS = BN + 4, LDP = BN + 8, LDO = D + 4;  // skewed rows
  static constexpr size_t q_bytes = size_t(BM) * LDQ * 2, k_bytes = size_t(BN) * LDK * 2;
  static constexpr size_t s_bytes = size_t(BM) * LDS * 4, p_bytes = size_t(BM) * LDP * 2;
  static constexpr size_t o_bytes = size_t(BM) * LDO * 4;
  static constexpr size_t off_k = q_bytes, off_v = off_k + k_bytes, off_s = off_v + k_bytes, off_p = off_s + s_bytes,
                          off_o = off_p + p_bytes, off_koff = off_o + o_bytes, off_voff = off_koff + BN * 8,
                          off_alpha = off_voff + BN * 8;
  static constexpr size_t smem = off_alpha + BM * 4;
};

// Sequence b's query count from cu_seqlens_q, clamped to the rows of query (check=False callers); int32 by source.
__device__ __forceinline__ int prefill_q_len(const Params& p, int64_t b) {
  const int64_t first = p.cu_seqlens_q[b];
  return static_cast<int>(max64(min64(p.cu_seqlens_q[b + 1], p.rows) - first, 0));
}

template <typename T, int D, int BN_>
__global__ void __launch_bounds__(kThreads, 4) window_attention_prefill_kernel(const Params p) {
  using namespace nvcuda;
  using Tile = PrefillTile<D, BN_>;
  constexpr int BM = Tile::BM, BN = Tile::BN, LDQ = Tile::LDQ, LDK = Tile::LDK, LDS = Tile::LDS, LDP = Tile::LDP,
                LDO = Tile::LDO;
  constexpr int kChunks = D / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* k_s = reinterpret_cast<T*>(smem + Tile::off_k);
  T* v_s = reinterpret_cast<T*>(smem + Tile::off_v);
  float* s_s = reinterpret_cast<float*>(smem + Tile::off_s);
  T* p_s = reinterpret_cast<T*>(smem + Tile::off_p);
  float* o_s = reinterpret_cast<float*>(smem + Tile::off_o);
  int64_t* koff_s = reinterpret_cast<int64_t*>(smem + Tile::off_koff);
  int64_t* voff_s = reinterpret_cast<int64_t*>(smem + Tile::off_voff);
  float* alpha_s = reinterpret_cast<float*>(smem + Tile::off_alpha);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int h = blockIdx.y, kvh = h / p.group;
  const int64_t b = blockIdx.z;
  if (p.cu_seqlens_q[b] < 0) return;

  // max_q_len only sizes the grid (no host sync): a CTA takes query blocks blockIdx.x, blockIdx.x + gridDim.x, ...
  // so a max_q_len below a sequence's real q_len (check=False) still writes every one of its rows (once they were
  // left as uninitialised memory from at::empty). With a right max_q_len each CTA runs this loop once.
  for (int64_t t0 = int64_t(blockIdx.x) * BM; t0 < prefill_q_len(p, b); t0 += int64_t(gridDim.x) * BM) {
    __syncthreads();  // the previous query block's O tile is written out before it is zeroed again
    // Re-read per query block (L1 hits) rather than kept live across it: fewer registers, no spills.
    const int first = p.cu_seqlens_q[b];
    const int q_len = prefill_q_len(p, b);
    const int len = static_cast<int>(min64(p.seq_lens[b], p.max_blocks * p.block_size));  // <= seq_lens[b]
    const int kstart = p.kv_start ? max(p.kv_start[b], 0) : 0;
    const int64_t pos0 = int64_t(len) - q_len;  // position of query t is pos0 + t

    // Q tile (rows past q_len: zeros), and O = 0.
    const T* q = static_cast<const T*>(p.query);
    for (int idx = tid; idx < BM * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int64_t t = t0 + r;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (t < q_len) {
        const T* src = q + (first + t) * p.s.q0 + h * p.s.q1 + c * 8;
        if (p.q_vec) {
          v = *reinterpret_cast<const uint4*>(src);
        } else {
          T* vp = reinterpret_cast<T*>(&v);
#pragma unroll
          for (int x = 0; x < 8; ++x) vp[x] = src[x];
        }
      }
      *reinterpret_cast<uint4*>(q_s + r * LDQ + c * 8) = v;
    }
    for (int idx = tid; idx < BM * D; idx += kThreads) o_s[(idx / D) * LDO + idx % D] = 0.f;

    // Keys this CTA can see: [klo, khi] (tiles outside are skipped).
    const int64_t t_last = min64(t0 + BM, q_len) - 1;
    const int64_t khi = min64(pos0 + t_last, len - 1);
    int64_t klo = kstart;
    if (p.window > 0) klo = max64(klo, pos0 + t0 - p.window + 1);
    // Softmax state of the 2 lanes per row: row = warp * 16 + lane / 2, columns half = lane % 2.
    const int row = warp * 16 + lane / 2, half = lane % 2;
    const int64_t qi = pos0 + t0 + row;  // this row's position
    const bool row_live = t0 + row < q_len;
    float m = neg_inf(), l = 0.f;

    const int64_t tile_first = klo >= 0 ? klo / BN * BN : 0;
    for (int64_t j0 = tile_first; j0 <= khi; j0 += BN) {
      __syncthreads();  // previous K/V tile consumed (and Q/O initialised on the first pass)
      stage_kv_tile<T, D, BN>(p, b, kvh, j0, klo, khi, koff_s, voff_s, k_s, v_s, LDK, tid);
      __syncthreads();
      // S[warp rows] = Q K^T.
#pragma unroll 1
      for (int nf = 0; nf < BN / 16; ++nf) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> sf;
        wmma::fill_fragment(sf, 0.f);
        for (int kf = 0; kf < D / 16; ++kf) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
          wmma::load_matrix_sync(af, q_s + warp * 16 * LDQ + kf * 16, LDQ);
          wmma::load_matrix_sync(bf, k_s + nf * 16 * LDK + kf * 16, LDK);  // B[d][key] = K[key][d]
          wmma::mma_sync(sf, af, bf, sf);
        }
        wmma::store_matrix_sync(s_s + warp * 16 * LDS + nf * 16, sf, LDS, wmma::mem_row_major);
      }
      __syncwarp();
      // Mask, scale, softcap, online softmax; P -> shared (fp16/bf16), alpha per row.
      {
        float* srow = s_s + row * LDS;
        float mx = neg_inf();
        for (int c = half * (BN / 2); c < (half + 1) * (BN / 2); ++c) {
          const int64_t j = j0 + c;
          const bool vis = row_live && koff_s[c] >= 0 && j <= qi && (p.window == 0 || j > qi - p.window);
          const float s = vis ? cap_score(srow[c] * p.scale, p.softcap) : neg_inf();
          srow[c] = s;
          mx = fmaxf(mx, s);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        float sum = 0.f;
        T* prow = p_s + row * LDP;
        for (int c = half * (BN / 2); c < (half + 1) * (BN / 2); ++c) {
          const float s = srow[c];
          const float pr = s == neg_inf() ? 0.f : __expf(s - m_new);
          const T pt = Conv<T>::from_float(pr);
          prow[c] = pt;
          sum += Conv<T>::to_float(pt);  // the sum of the probabilities actually multiplied into V
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        const float alpha = m == neg_inf() ? 0.f : __expf(m - m_new);
        l = l * alpha + sum;
        m = m_new;
        if (half == 0) alpha_s[row] = alpha;
      }
      __syncwarp();
      // O[warp rows] = O * alpha + P V.
      for (int idx = lane; idx < 16 * D; idx += 32) {
        const int r = warp * 16 + idx / D;
        o_s[r * LDO + idx % D] *= alpha_s[r];
      }
      __syncwarp();
#pragma unroll 1
      for (int df = 0; df < D / 16; ++df) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> of;
        wmma::load_matrix_sync(of, o_s + warp * 16 * LDO + df * 16, LDO, wmma::mem_row_major);
        for (int kf = 0; kf < BN / 16; ++kf) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bf;
          wmma::load_matrix_sync(af, p_s + warp * 16 * LDP + kf * 16, LDP);
          wmma::load_matrix_sync(bf, v_s + kf * 16 * LDK + df * 16, LDK);
          wmma::mma_sync(of, af, bf, of);
        }
        wmma::store_matrix_sync(o_s + warp * 16 * LDO + df * 16, of, LDO, wmma::mem_row_major);
      }
    }
    __syncthreads();  // O initialised by every thread when no key tile was visited
    // Write this warp's rows: O / l, lse (zeros and -inf for a row with no visible key).
    if (row_live) {
      const int64_t oh = (first + t0 + row) * p.hq + h;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* o = static_cast<T*>(p.out) + oh * D;
      for (int x = half; x < D; x += 2) o[x] = Conv<T>::from_float(o_s[row * LDO + x] * inv);
      if (half == 0) p.lse[oh] = l > 0.f ? m + __logf(l) : neg_inf();
    }
  }
}

// ------------------------------------------------------------------------------------------------ host
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cached[device] = n;
  return n;
}

// Largest dynamic shared memory one block may opt in to (sm_80/sm_87: 163 KB, sm_86/sm_89/sm_120: 99 KB, sm_90: 227
// KB). ARKERNELS_MAX_SMEM_PER_BLOCK (bytes) lowers it: a test knob that makes a large GPU take the small-GPU tiles.
int64_t smem_optin(int device) {
  static int cached[64] = {0};
  int n = device < 64 ? cached[device] : 0;
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (device < 64) cached[device] = n;
  }
  int64_t limit = n;
  if (const char* env = std::getenv("ARKERNELS_MAX_SMEM_PER_BLOCK")) {
    const long long cap = std::atoll(env);
    if (cap > 0) limit = std::min<int64_t>(limit, cap);
  }
  return limit;
}

// Split-KV count from shapes only: enough CTAs for two waves, at least 4 tiles (128 keys) per split.
int decode_splits(int64_t ctas, int64_t max_keys, int sms) {
  const int64_t target = 2 * static_cast<int64_t>(sms);
  if (ctas >= target || max_keys <= 4 * kDecodeTileKeys) return 1;
  const int64_t want = ceil_div<int64_t>(target, ctas);
  const int64_t most = ceil_div<int64_t>(max_keys, 4 * kDecodeTileKeys);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, most, int64_t{kMaxSplits}})));
}

template <typename F>
void dispatch_head_dim(int64_t d, F&& f) {
  switch (d) {
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 80: f(std::integral_constant<int, 80>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    default: AK_CHECK("window_attention", false, "head_dim must be 64, 80, 96, 128 or 256 on CUDA, got ", d);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> window_attention_cuda(const at::Tensor& query, const at::Tensor& k_cache,
                                                         const at::Tensor& v_cache, const at::Tensor& block_table,
                                                         const at::Tensor& seq_lens,
                                                         const std::optional<at::Tensor>& cu_seqlens_q,
                                                         const std::optional<at::Tensor>& kv_start, int64_t max_q_len,
                                                         int64_t window, double scale, double softcap) {
  check_window_attention(query, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_q_len, window,
                         scale, softcap);
  const auto dt = query.scalar_type();
  AK_CHECK("window_attention", dt == at::kHalf || dt == at::kBFloat16,
           "CUDA kernels take float16 or bfloat16, got ", dt, " (float32 runs on the CPU)");
  const int64_t d = query.size(2);
  AK_CHECK("window_attention", d == 64 || d == 80 || d == 96 || d == 128 || d == 256,
           "head_dim must be 64, 80, 96, 128 or 256 on CUDA, got ", d);
  const int64_t es = k_cache.element_size();
  bool aligned = aligned16(k_cache.data_ptr()) && aligned16(v_cache.data_ptr());
  for (int x = 0; x < 3; ++x) aligned = aligned && (k_cache.stride(x) * es) % 16 == 0 && (v_cache.stride(x) * es) % 16 == 0;
  AK_CHECK("window_attention", aligned, "on CUDA k_cache and v_cache rows must be 16-byte aligned (data pointer and "
           "strides), got strides ", k_cache.strides(), " and ", v_cache.strides());
  const int64_t batch = seq_lens.size(0), rows = query.size(0), hq = query.size(1), hkv = k_cache.size(2);
  AK_CHECK("window_attention", batch <= 65535, "batch must be <= 65535 on CUDA, got ", batch);
  AK_CHECK("window_attention", window <= INT32_MAX, "window must fit in int32, got ", window);
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty({rows, hq, d}, query.options());
  at::Tensor lse = at::empty({rows, hq}, query.options().dtype(at::kFloat));
  if (rows == 0 || hq == 0 || batch == 0) return {out, lse};
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor cu, starts;
  if (cu_seqlens_q.has_value()) cu = cu_seqlens_q->contiguous();
  if (kv_start.has_value()) starts = kv_start->contiguous();

  Params p{};
  p.query = query.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_table = table.data_ptr<int32_t>();
  p.seq_lens = lens.data_ptr<int32_t>();
  p.cu_seqlens_q = cu.defined() ? cu.data_ptr<int32_t>() : nullptr;
  p.kv_start = starts.defined() ? starts.data_ptr<int32_t>() : nullptr;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.s = Strides{query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  p.rows = rows;
  p.num_blocks = k_cache.size(0);
  p.block_size = k_cache.size(1);
  p.max_blocks = block_table.size(1);
  p.hq = static_cast<int>(hq);
  p.hkv = static_cast<int>(hkv);
  p.group = static_cast<int>(hq / hkv);
  p.window = static_cast<int>(window);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.q_vec = aligned16(query.data_ptr()) && (query.stride(0) * es) % 16 == 0 && (query.stride(1) * es) % 16 == 0;
  if (p.max_blocks == 0 || p.block_size == 0) {  // nothing addressable: every query sees no key
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  at::Tensor part_out, part_lse;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    dispatch_head_dim(d, [&](auto dc) {
      constexpr int D = decltype(dc)::value;
      if (!cu_seqlens_q.has_value()) {
        p.head_chunks = static_cast<int>(ceil_div<int64_t>(p.group, kDecodeHeads));
        const int64_t cap = p.max_blocks * p.block_size;
        const int64_t max_keys = window > 0 ? std::min<int64_t>(window, cap) : cap;
        p.num_splits = decode_splits(batch * hkv * p.head_chunks, max_keys, sm_count(query.get_device()));
        if (p.num_splits > 1) {
          part_out = at::empty({p.num_splits, rows, hq, d}, query.options().dtype(at::kFloat));
          part_lse = at::empty({p.num_splits, rows, hq}, query.options().dtype(at::kFloat));
          p.part_out = part_out.data_ptr<float>();
          p.part_lse = part_lse.data_ptr<float>();
        }
        // gridDim.y <= 65535; the combine grid (one CTA per (row, head)) <= 2^31 - 1.
        AK_CHECK("window_attention", hkv * p.head_chunks <= 65535 && rows * hq <= INT32_MAX,
                 "decode grid too large on CUDA: num_kv_heads * ceil(group / 8) = ", hkv * p.head_chunks,
                 " (at most 65535), batch * num_q_heads = ", rows * hq, " (at most 2^31 - 1)");
        const dim3 grid(p.num_splits, static_cast<unsigned>(hkv * p.head_chunks), static_cast<unsigned>(batch));
        window_attention_decode_kernel<T, D><<<grid, kThreads, 0, stream>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (p.num_splits > 1) {
          window_attention_combine_kernel<T><<<static_cast<unsigned>(rows * hq), kThreads, 0, stream>>>(
              p, static_cast<int>(d));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      } else {
        p.head_chunks = 1;
        p.num_splits = 1;
        AK_CHECK("window_attention", hq <= 65535, "num_q_heads must be <= 65535 on CUDA (prefill grid), got ", hq);
        // At least one query block even for max_q_len 0: the kernel strides over each sequence's real q_len, so a
        // max_q_len that is too small (check=False) costs time, never leaves rows of `out` unwritten.
        const int64_t qblocks =
            std::min<int64_t>(std::max<int64_t>(1, ceil_div<int64_t>(max_q_len, kPrefillRows)), INT32_MAX);
        const dim3 grid(static_cast<unsigned>(qblocks), static_cast<unsigned>(hq), static_cast<unsigned>(batch));
        auto run = [&](auto bn) {
          constexpr int BN = decltype(bn)::value;
          constexpr size_t smem = PrefillTile<D, BN>::smem;
          auto kernel = window_attention_prefill_kernel<T, D, BN>;
          C10_CUDA_CHECK(
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
          kernel<<<grid, kThreads, smem, stream>>>(p);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        // Shared memory per block: the default tiles where the device allows them (sm_80, sm_90), else (99 KB
        // devices) 32-key tiles for D = 128; once D = 128 asked for 111.2 KB there and failed in cudaFuncSetAttribute.
        constexpr int kBN = kPrefillKeys<D>;
        constexpr size_t least = D == 128 ? PrefillTile<D, 32>::smem : PrefillTile<D, kBN>::smem;
        const int64_t optin = smem_optin(query.get_device());
        AK_CHECK("window_attention", static_cast<int64_t>(least) <= optin, "prefill with head_dim ", D, " needs ",
                 least, " bytes of shared memory per block but this GPU allows ", optin,
                 " (head_dim 256 needs a GPU with >= 163 KB per block: sm_80, sm_90)");
        if (static_cast<int64_t>(PrefillTile<D, kBN>::smem) <= optin) {
          run(std::integral_constant<int, kBN>{});
        } else if constexpr (D == 128) {
          run(std::integral_constant<int, 32>{});
        }
      }
    });
  };
  if (dt == at::kHalf) {
    launch(__half{});
  } else {
    launch(__nv_bfloat16{});
  }
  return {out, lse};
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CUDA, m) { m.impl("window_attention", &arkernels::window_attention_cuda); }
