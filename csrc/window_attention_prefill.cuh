// window_attention prefill kernel and its launch planning; included by window_attention_kernels.cuh (after the shared
// definitions), never on its own.
//
// Prefill (cu_seqlens_q given): window_attention_prefill_kernel, FlashAttention-2 style with WMMA tensor cores
//   (16x16x16, fp16/bf16 in, fp32 accumulate). Grid (max(1, ceil(max_q_len / 64)), Hq, batch), 128 threads; a CTA
//   strides over its sequence's 64-row query blocks (once with a right max_q_len; a too-small max_q_len costs time,
//   never unwritten rows); each warp owns 16 query rows. Key tiles of BN (64, or 32 for D = 256, and for D = 128 on
//   99 KB-per-block GPUs) are loaded into shared memory; only tiles intersecting
//   [min visible key of the block's first row, last row's position] are visited, so tiles wholly outside the causal
//   window are skipped. S = Q K^T (WMMA) -> shared fp32; mask/scale/softcap/online softmax per row in fp32 (2 lanes
//   per row); P (fp16/bf16) . V (WMMA) accumulates into an fp32 O tile in shared memory, rescaled per row.
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

namespace arkernels {

constexpr int kPrefillRows = 64;     // query rows per prefill CTA: 4 warps x 16

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


// Prefill key-tile width for head_dim d under a per-block shared-memory limit: the default tiles where they fit
// (sm_80, sm_90), else 32-key tiles for d = 128 (99 KB GPUs: 81.8 KB instead of 111.2 KB); 0 when nothing fits.
inline int prefill_key_tile(int64_t d, int64_t smem_optin) {
  const int bn = d <= 128 ? 64 : 32;
  if (static_cast<int64_t>(prefill_layout(int(d), bn).smem) <= smem_optin) return bn;
  if (d == 128 && static_cast<int64_t>(prefill_layout(128, 32).smem) <= smem_optin) return 32;
  return 0;
}

struct PrefillPlan {
  dim3 grid;
  int bn = 0;              // key-tile width; 0: refused (the device's shared memory is too small)
  size_t smem = 0;         // dynamic shared memory, bytes
};

inline PrefillPlan plan_prefill(int64_t batch, int64_t hq, int64_t d, int64_t max_q_len, const DeviceProps& props) {
  PrefillPlan plan;
  // At least one query block even for max_q_len 0: the kernel strides over each sequence's real q_len, so a
  // max_q_len that is too small (check=False) costs time, never leaves rows of `out` unwritten.
  const int64_t qblocks = std::min<int64_t>(std::max<int64_t>(1, ceil_div<int64_t>(max_q_len, kPrefillRows)),
                                            int64_t{0x7fffffff});
  plan.grid = dim3(static_cast<unsigned>(qblocks), static_cast<unsigned>(hq), static_cast<unsigned>(batch));
  plan.bn = prefill_key_tile(d, props.smem_optin);
  plan.smem = plan.bn ? prefill_layout(int(d), plan.bn).smem : 0;
  return plan;
}

// The prefill launch; returns the first launch error.
template <typename T, int D>
cudaError_t run_prefill(const AttnParams& p, const PrefillPlan& plan, cudaStream_t stream) {
  auto go = [&](auto bn) -> cudaError_t {
    constexpr int BN = decltype(bn)::value;
    auto prefill = window_attention_prefill_kernel<T, D, BN>;
    const cudaError_t err = AK_SET_MAX_DYNAMIC_SMEM(prefill, plan.smem);
    if (err != cudaSuccess) return err;
    AK_LAUNCH(prefill, plan.grid, kAttnThreads, plan.smem, stream, p);
    return AK_LAST_ERROR();
  };
  if (plan.bn == kPrefillKeys<D>) return go(std::integral_constant<int, kPrefillKeys<D>>{});
  if constexpr (D == 128) {
    if (plan.bn == 32) return go(std::integral_constant<int, 32>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace arkernels
