// window_attention device code and launch planning: causal (sliding-window) attention over the paged KV cache,
// fp16/bf16, GQA. No ATen here: nvcc compiles this for the GPU (csrc/window_attention.cu) and the host compiler for
// the SIMT emulator (csrc/simt/simt_ops.cpp), from the same source. Launch planning (plan_window_attention) is a
// pure function of shapes and DeviceProps, called by both.
//
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
// Keys in a block whose id is out of range, and keys past the block table's capacity (a seq_len above
// max_blocks * block_size), are masked and never read (check=False callers); queries keep the positions seq_lens gives
// them, so such a query may see no key at all (zeros, lse -inf). Offsets are int64.
//
// Resource use (nvcc 13.0 -Xptxas -v at 6607198; registers sm_80 fp16/bf16, sm_90 fp16/bf16; no spills in any of
// the 48; since the fp32 prefill row sum, prefill bf16 D=64 on sm_90 takes 122; `python scripts/sass_report.py`
// prints the current figures, occupancy and instruction counts, and CI fails on any spill):
//   decode  D=64: 72/80, 72/72 regs, 11.6 KB static smem    prefill D=64: 104/124, 106/127 regs, 71.2 KB dynamic smem
//   decode  D=80: 72/72, 72/72 regs, 14.1 KB                prefill D=80: 107/128, 108/128 regs, 81.2 KB
//   decode  D=96: 72/72, 72/72 regs, 16.6 KB                prefill D=96: 109/128, 110/128 regs, 91.2 KB
//   decode D=128: 72/80, 72/72 regs, 21.6 KB                prefill D=128: 128/128, 128/128 regs, 111.2 KB
//   decode D=256: 96/118, 96/96 regs, 41.6 KB               prefill D=128, BN=32: 128/124, 126/128 regs, 81.8 KB
//   combine: 32 regs, no smem.                              prefill D=256: 128/128, 128/128 regs, 145.8 KB (BN = 32)
//   Prefill is __launch_bounds__(128, 4): at most 128 registers, which never limits occupancy (shared memory allows
//   at most 3 CTAs per SM), and without the min-blocks hint ptxas kept 64-80 registers and spilled 4-12 bytes in
//   6 of the 24 prefill kernels once the query-block loop was added. Compile time: about 2 minutes on 2 cores.
#pragma once

#include <algorithm>
#include <type_traits>

#include "device.cuh"

namespace arkernels {

constexpr int kAttnThreads = 128;
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

// ------------------------------------------------------------------------------------------------ decode
template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) window_attention_decode_kernel(const AttnParams p) {
  constexpr int kChunks = D / 8;                                  // 16-byte chunks per row
  constexpr int kPairsPerThread = (kDecodeHeads * kChunks + kAttnThreads - 1) / kAttnThreads;  // <= 2
  AK_SHARED(16, T, k_tile, [kDecodeTileKeys * D]);
  AK_SHARED(16, T, v_tile, [kDecodeTileKeys * D]);
  AK_SHARED(16, float, q_s, [kDecodeHeads * D]);
  AK_SHARED(4, float, s_s, [kDecodeHeads][kDecodeTileKeys]);
  AK_SHARED(4, float, alpha_s, [kDecodeHeads]);
  AK_SHARED(4, float, m_s, [kDecodeHeads]);
  AK_SHARED(4, float, l_s, [kDecodeHeads]);
  AK_SHARED(8, int64_t, koff_s, [kDecodeTileKeys]);
  AK_SHARED(8, int64_t, voff_s, [kDecodeTileKeys]);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks;
  const int64_t b = blockIdx.z;
  const int h0 = kvh * p.group + chunk * kDecodeHeads;             // first query head of this CTA
  const int hc = min(kDecodeHeads, p.group - chunk * kDecodeHeads);  // query heads of this CTA
  // The query sits at i = seq_len - 1 whatever the block table holds; keys past the table (check=False) are masked.
  const int64_t i = int64_t(dev::ld_global(p.seq_lens + b)) - 1;
  int64_t lo = p.kv_start ? max64(dev::ld_global(p.kv_start + b), 0) : 0;
  if (p.window > 0) lo = max64(lo, i - p.window + 1);
  const int64_t hi = min64(i, p.max_blocks * p.block_size - 1);  // last visible key
  const int64_t n = hi - lo + 1;  // visible keys (<= 0: none)
  // This split's keys: whole tiles, so splits never share a tile.
  const int64_t per_split = n > 0 ? ((n + p.num_splits - 1) / p.num_splits + kDecodeTileKeys - 1) /
                                        kDecodeTileKeys * kDecodeTileKeys
                                  : 0;
  const int64_t s_lo = lo + split * per_split;
  const int64_t s_hi = min64(hi, s_lo + per_split - 1);

  const T* q = static_cast<const T*>(p.query);
  for (int h = 0; h < hc; ++h) load_q_f32<T, D>(p, q + b * p.s.q0 + (h0 + h) * p.s.q1, q_s + h * D, tid, kAttnThreads);
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
    for (int pr = grp; pr < hc * kDecodeTileKeys; pr += kAttnThreads / 8) {
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
    for (int h = warp; h < hc; h += kAttnThreads / 32) {
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
      const int pi = tid + r * kAttnThreads;
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
    const int pi = tid + r * kAttnThreads;
    const int h = pi / kChunks, c = pi % kChunks;
    if (h >= hc) continue;
    const float l = l_s[h];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse = l > 0.f ? m_s[h] + __logf(l) : neg_inf();
    const int64_t oh = b * p.hq + h0 + h;  // (row, head) index
    if (p.num_splits == 1) {
      T* o = static_cast<T*>(p.out) + oh * D + c * 8;
#pragma unroll
      for (int x = 0; x < 8; ++x) dev::st_global(o + x, Conv<T>::from_float(acc[r][x] * inv));
      if (c == 0) dev::st_global(p.lse + oh, lse);
    } else {
      float* o = p.part_out + (split * p.rows * p.hq + oh) * D + c * 8;
#pragma unroll
      for (int x = 0; x < 8; ++x) dev::st_global(o + x, acc[r][x] * inv);
      if (c == 0) dev::st_global(p.part_lse + split * p.rows * p.hq + oh, lse);
    }
  }
}

// Merge num_splits partials: lse = logsumexp_s(lse_s), out = sum_s exp(lse_s - lse) * out_s. One CTA per (row, head).
template <typename T>
__global__ void __launch_bounds__(kAttnThreads) window_attention_combine_kernel(const AttnParams p, int d) {
  const int64_t oh = blockIdx.x;
  const int64_t stride = p.rows * p.hq;
  float m = neg_inf();
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, dev::ld_global(p.part_lse + s * stride + oh));
  float total = 0.f;
  if (m != neg_inf()) {
    for (int s = 0; s < p.num_splits; ++s) total += __expf(dev::ld_global(p.part_lse + s * stride + oh) - m);
  }
  const float lse = total > 0.f ? m + __logf(total) : neg_inf();
  T* o = static_cast<T*>(p.out) + oh * d;
  for (int x = threadIdx.x; x < d; x += blockDim.x) {
    float v = 0.f;
    if (total > 0.f) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float ls = dev::ld_global(p.part_lse + s * stride + oh);
        if (ls != neg_inf()) v += __expf(ls - lse) * dev::ld_global(p.part_out + (s * stride + oh) * d + x);
      }
    }
    dev::st_global(o + x, Conv<T>::from_float(v));
  }
  if (threadIdx.x == 0) dev::st_global(p.lse + oh, lse);
}

// ------------------------------------------------------------------------------------------------ prefill
// Key tile width by head_dim: D = 256 takes 32-key tiles to stay under sm_80's 163 KB. A GPU whose per-block opt-in
// limit is lower (sm_86/sm_89/sm_120: 99 KB) cannot take the 111.2 KB of D = 128 with BN = 64: the host then launches
// the BN = 32 variant (81.8 KB); D = 256 (145.8 KB even with BN = 32) is refused there with a clear error.
template <int D>
constexpr int kPrefillKeys = D <= 128 ? 64 : 32;

// Shared-memory layout of a prefill CTA (bytes), a constexpr function so that launch planning can size any (D, BN)
// at run time and the kernel at compile time from one formula.
struct PrefillLayout {
  int LDQ, LDK, LDS, LDP, LDO;  // row strides in elements, skewed against bank conflicts
  size_t off_k, off_v, off_s, off_p, off_o, off_koff, off_voff, off_alpha, smem;
};
constexpr PrefillLayout prefill_layout(int D, int BN) {
  PrefillLayout l{D + 8, D + 8, BN + 4, BN + 8, D + 4, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const size_t BM = kPrefillRows;
  l.off_k = BM * l.LDQ * 2;                           // Q tile, 16-bit
  l.off_v = l.off_k + size_t(BN) * l.LDK * 2;         // K tile
  l.off_s = l.off_v + size_t(BN) * l.LDK * 2;         // V tile
  l.off_p = l.off_s + BM * l.LDS * 4;                 // S, fp32
  l.off_o = l.off_p + BM * l.LDP * 2;                 // P, 16-bit
  l.off_koff = l.off_o + BM * l.LDO * 4;              // O, fp32
  l.off_voff = l.off_koff + size_t(BN) * 8;           // per-key K offsets
  l.off_alpha = l.off_voff + size_t(BN) * 8;          // per-key V offsets
  l.smem = l.off_alpha + BM * 4;                      // per-row rescale factors
  return l;
}

template <int D, int BN_>
struct PrefillTile {
  static constexpr PrefillLayout L = prefill_layout(D, BN_);
  static constexpr int BM = kPrefillRows;
  static constexpr int BN = BN_;
  static constexpr int LDQ = L.LDQ, LDK = L.LDK, LDS = L.LDS, LDP = L.LDP, LDO = L.LDO;
  static constexpr size_t off_k = L.off_k, off_v = L.off_v, off_s = L.off_s, off_p = L.off_p, off_o = L.off_o,
                          off_koff = L.off_koff, off_voff = L.off_voff, off_alpha = L.off_alpha, smem = L.smem;
};

// Sequence b's query count from cu_seqlens_q, clamped to the rows of query (check=False callers); int32 by source.
__device__ __forceinline__ int prefill_q_len(const AttnParams& p, int64_t b) {
  const int64_t first = dev::ld_global(p.cu_seqlens_q + b);
  return static_cast<int>(max64(min64(dev::ld_global(p.cu_seqlens_q + b + 1), p.rows) - first, 0));
}

template <typename T, int D, int BN_>
__global__ void __launch_bounds__(kAttnThreads, 4) window_attention_prefill_kernel(const AttnParams p) {
  using namespace nvcuda;
  using Tile = PrefillTile<D, BN_>;
  constexpr int BM = Tile::BM, BN = Tile::BN, LDQ = Tile::LDQ, LDK = Tile::LDK, LDS = Tile::LDS, LDP = Tile::LDP,
                LDO = Tile::LDO;
  constexpr int kChunks = D / 8;
  AK_DYNAMIC_SHARED(unsigned char, smem);
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
  if (dev::ld_global(p.cu_seqlens_q + b) < 0) return;

  // max_q_len only sizes the grid (no host sync): a CTA takes query blocks blockIdx.x, blockIdx.x + gridDim.x, ...
  // so a max_q_len below a sequence's real q_len (check=False) still writes every one of its rows (once they were
  // left as uninitialised memory from at::empty). With a right max_q_len each CTA runs this loop once.
  for (int64_t t0 = int64_t(blockIdx.x) * BM; t0 < prefill_q_len(p, b); t0 += int64_t(gridDim.x) * BM) {
    __syncthreads();  // the previous query block's O tile is written out before it is zeroed again
    // Re-read per query block (L1 hits) rather than kept live across it: fewer registers, no spills.
    const int first = dev::ld_global(p.cu_seqlens_q + b);
    const int q_len = prefill_q_len(p, b);
    const int len = dev::ld_global(p.seq_lens + b);
    const int kstart = p.kv_start ? max(dev::ld_global(p.kv_start + b), 0) : 0;
    // Position of query t is pos0 + t whatever the block table holds; keys past the table (check=False) are masked.
    const int64_t pos0 = int64_t(len) - q_len;

    // Q tile (rows past q_len: zeros), and O = 0.
    const T* q = static_cast<const T*>(p.query);
    for (int idx = tid; idx < BM * kChunks; idx += kAttnThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int64_t t = t0 + r;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (t < q_len) {
        const T* src = q + (first + t) * p.s.q0 + h * p.s.q1 + c * 8;
        if (p.q_vec) {
          v = dev::ld_global(reinterpret_cast<const uint4*>(src));
        } else {
          T* vp = reinterpret_cast<T*>(&v);
#pragma unroll
          for (int x = 0; x < 8; ++x) vp[x] = dev::ld_global(src + x);
        }
      }
      *reinterpret_cast<uint4*>(q_s + r * LDQ + c * 8) = v;
    }
    for (int idx = tid; idx < BM * D; idx += kAttnThreads) o_s[(idx / D) * LDO + idx % D] = 0.f;

    // Keys this CTA can see: [klo, khi] (tiles outside are skipped).
    const int64_t t_last = min64(t0 + BM, q_len) - 1;
    const int64_t khi = min64(pos0 + t_last, min64(len, p.max_blocks * p.block_size) - 1);
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
          sum += pr;  // fp32, as FlashAttention: lse stays exact to fp32 (the rounded sum was off by ~1e-3 in bf16)
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
      for (int x = half; x < D; x += 2) dev::st_global(o + x, Conv<T>::from_float(o_s[row * LDO + x] * inv));
      if (half == 0) dev::st_global(p.lse + oh, l > 0.f ? m + __logf(l) : neg_inf());
    }
  }
}

// ------------------------------------------------------------------------------------------------ launch planning
// Everything a launch needs, from shapes and device properties only (no host sync, so graph-capturable), shared by
// the CUDA launcher and the emulator.
struct WindowAttentionPlan {
  bool prefill = false;
  int head_chunks = 1;     // decode: CTAs per KV head (ceil(group / kDecodeHeads))
  int num_splits = 1;      // decode: split-KV partitions (> 1: fp32 partials + the combine kernel)
  dim3 grid, combine_grid;
  int threads = kAttnThreads;
  int bn = 0;              // prefill key-tile width; 0: refused (the device's shared memory is too small)
  size_t smem = 0;         // prefill dynamic shared memory, bytes
};

// Split-KV count from shapes only: enough CTAs for two waves, at least 4 tiles (128 keys) per split.
inline int decode_splits(int64_t ctas, int64_t max_keys, int sms) {
  const int64_t target = 2 * static_cast<int64_t>(sms);
  if (ctas >= target || max_keys <= 4 * kDecodeTileKeys) return 1;
  const int64_t want = ceil_div<int64_t>(target, ctas);
  const int64_t most = ceil_div<int64_t>(max_keys, 4 * kDecodeTileKeys);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, most, int64_t{kMaxSplits}})));
}

// Prefill key-tile width for head_dim d under a per-block shared-memory limit: the default tiles where they fit
// (sm_80, sm_90), else 32-key tiles for d = 128 (99 KB GPUs: 81.8 KB instead of 111.2 KB); 0 when nothing fits.
inline int prefill_key_tile(int64_t d, int64_t smem_optin) {
  const int bn = d <= 128 ? 64 : 32;
  if (static_cast<int64_t>(prefill_layout(int(d), bn).smem) <= smem_optin) return bn;
  if (d == 128 && static_cast<int64_t>(prefill_layout(128, 32).smem) <= smem_optin) return 32;
  return 0;
}

// prefill: cu_seqlens_q given. rows = query rows; max_blocks x block_size = the block table's capacity.
inline WindowAttentionPlan plan_window_attention(bool prefill, int64_t batch, int64_t rows, int64_t hq, int64_t hkv,
                                                 int64_t d, int64_t max_blocks, int64_t block_size, int64_t window,
                                                 int64_t max_q_len, const DeviceProps& props) {
  WindowAttentionPlan plan;
  plan.prefill = prefill;
  if (!prefill) {
    const int64_t group = hq / hkv;
    plan.head_chunks = static_cast<int>(ceil_div<int64_t>(group, kDecodeHeads));
    const int64_t cap = max_blocks * block_size;
    const int64_t max_keys = window > 0 ? std::min<int64_t>(window, cap) : cap;
    plan.num_splits = decode_splits(batch * hkv * plan.head_chunks, max_keys, props.sm_count);
    plan.grid = dim3(plan.num_splits, static_cast<unsigned>(hkv * plan.head_chunks), static_cast<unsigned>(batch));
    plan.combine_grid = dim3(static_cast<unsigned>(rows * hq));
  } else {
    // At least one query block even for max_q_len 0: the kernel strides over each sequence's real q_len, so a
    // max_q_len that is too small (check=False) costs time, never leaves rows of `out` unwritten.
    const int64_t qblocks = std::min<int64_t>(std::max<int64_t>(1, ceil_div<int64_t>(max_q_len, kPrefillRows)),
                                              int64_t{0x7fffffff});
    plan.grid = dim3(static_cast<unsigned>(qblocks), static_cast<unsigned>(hq), static_cast<unsigned>(batch));
    plan.bn = prefill_key_tile(d, props.smem_optin);
    plan.smem = plan.bn ? prefill_layout(int(d), plan.bn).smem : 0;
  }
  return plan;
}

// The launches of one call (decode + combine, or prefill), in stream order; returns the first launch error.
template <typename T, int D>
cudaError_t run_window_attention(const AttnParams& p, const WindowAttentionPlan& plan, cudaStream_t stream) {
  if (!plan.prefill) {
    auto decode = window_attention_decode_kernel<T, D>;
    AK_LAUNCH(decode, plan.grid, plan.threads, 0, stream, p);
    const cudaError_t err = AK_LAST_ERROR();
    if (err != cudaSuccess || plan.num_splits == 1) return err;
    auto combine = window_attention_combine_kernel<T>;
    AK_LAUNCH(combine, plan.combine_grid, plan.threads, 0, stream, p, D);
    return AK_LAST_ERROR();
  }
  auto go = [&](auto bn) -> cudaError_t {
    constexpr int BN = decltype(bn)::value;
    auto prefill = window_attention_prefill_kernel<T, D, BN>;
    const cudaError_t err = AK_SET_MAX_DYNAMIC_SMEM(prefill, plan.smem);
    if (err != cudaSuccess) return err;
    AK_LAUNCH(prefill, plan.grid, plan.threads, plan.smem, stream, p);
    return AK_LAST_ERROR();
  };
  if (plan.bn == kPrefillKeys<D>) return go(std::integral_constant<int, kPrefillKeys<D>>{});
  if constexpr (D == 128) {
    if (plan.bn == 32) return go(std::integral_constant<int, 32>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace arkernels
