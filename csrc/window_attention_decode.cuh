// window_attention decode kernel and its launch planning; included by window_attention_kernels.cuh (after the shared
// definitions), never on its own.
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
// Resource use: `python scripts/sass_report.py` prints the current registers, shared memory, occupancy and instruction
// counts of every instantiation (CI fails on any spill).
#pragma once

namespace arkernels {

constexpr int kDecodeTileKeys = 32;  // one warp lane per key in the softmax step
constexpr int kDecodeHeads = 8;      // query heads per decode CTA (GQA groups above 8 take several CTAs)
constexpr int kMaxSplits = 64;

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


// Split-KV count from shapes only: enough CTAs for two waves, at least 4 tiles (128 keys) per split.
inline int decode_splits(int64_t ctas, int64_t max_keys, int sms) {
  const int64_t target = 2 * static_cast<int64_t>(sms);
  if (ctas >= target || max_keys <= 4 * kDecodeTileKeys) return 1;
  const int64_t want = ceil_div<int64_t>(target, ctas);
  const int64_t most = ceil_div<int64_t>(max_keys, 4 * kDecodeTileKeys);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, most, int64_t{kMaxSplits}})));
}

struct DecodePlan {
  int head_chunks = 1;     // CTAs per KV head (ceil(group / kDecodeHeads))
  int num_splits = 1;      // split-KV partitions (> 1: fp32 partials + the combine kernel)
  dim3 grid, combine_grid;
};

// batch sequences, rows = batch query rows; max_blocks x block_size = the block table's capacity.
inline DecodePlan plan_decode(int64_t batch, int64_t rows, int64_t hq, int64_t hkv, int64_t max_blocks,
                              int64_t block_size, int64_t window, const DeviceProps& props) {
  DecodePlan plan;
  const int64_t group = hq / hkv;
  plan.head_chunks = static_cast<int>(ceil_div<int64_t>(group, kDecodeHeads));
  const int64_t cap = max_blocks * block_size;
  const int64_t max_keys = window > 0 ? std::min<int64_t>(window, cap) : cap;
  plan.num_splits = decode_splits(batch * hkv * plan.head_chunks, max_keys, props.sm_count);
  plan.grid = dim3(plan.num_splits, static_cast<unsigned>(hkv * plan.head_chunks), static_cast<unsigned>(batch));
  plan.combine_grid = dim3(static_cast<unsigned>(rows * hq));
  return plan;
}

// The launches of one decode call (decode + combine), in stream order; returns the first launch error.
template <typename T, int D>
cudaError_t run_decode(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream) {
  auto decode = window_attention_decode_kernel<T, D>;
  AK_LAUNCH(decode, plan.grid, kAttnThreads, 0, stream, p);
  const cudaError_t err = AK_LAST_ERROR();
  if (err != cudaSuccess || plan.num_splits == 1) return err;
  auto combine = window_attention_combine_kernel<T>;
  AK_LAUNCH(combine, plan.combine_grid, kAttnThreads, 0, stream, p, D);
  return AK_LAST_ERROR();
}

}  // namespace arkernels
