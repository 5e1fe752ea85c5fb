// window_attention prefill kernel and its launch planning; included by window_attention_kernels.cuh (after the shared
// definitions and the decode kernel, whose smem_per_sm it uses), never on its own. Design, arithmetic and measured
// SASS figures: docs/kernels.md ("Prefill").
//
// Prefill (cu_seqlens_q given): window_attention_prefill_kernel, FlashAttention-2 style on mma.sync.m16n8k16.
// Packed GQA: a CTA owns one KV head and BM packed rows of one sequence, row R = token * group + head-in-group, so the
// group's query heads share every staged K/V tile. Grid (ceil(max_q_len * group / BM), Hkv, batch), longest tile
// first, then a stride of gridDim.x over the sequence's tiles. 4 warps: D <= 128 BM = 128, 32 rows per warp as two m16
// halves sharing each K/V fragment; D = 256 BM = 64, 16 rows per warp. Q tile in shared memory (ldmatrix per k-step);
// K/V tiles of BN keys (64, or 32 at D = 96 and 128: prefill_bn_max) in a 2- or 3-stage cp.async ring of rows of
// D + 8 elements (the padding of a K row carries its valid flag). S, P and O stay in registers; tiles outside every
// row's visible range are skipped. fp8 caches: the ring holds the tiles as stored and each tile is converted once per
// CTA into a 16-bit tile that the warps read. Arithmetic per CTA and key tile: 4 x BM x BN x D FLOPs against
// 2 x BN x D x 2 B of K + V staged (fp8: 2 x BN x D). Shared memory per CTA: BM x (D + 8) x 2 (Q)
// + stages x 2 x BN x (D + 8) x 2 (ring); fp8: (BM + 2 BN) x (D + 8) x 2 + stages x BN x (2 D + 1).
// Resource use: `python scripts/sass_report.py` prints the current registers, shared memory, occupancy and instruction
// counts of every instantiation (CI fails on any spill).
#pragma once

#include <cstring>
#include <type_traits>

#include "device_mma.cuh"

namespace arkernels {

// ------------------------------------------------------------------------------------------------ prefill
// Packed query rows per CTA: 128 for D <= 128, 64 for D = 256.
constexpr int prefill_rows(int d) { return d <= 128 ? 128 : 64; }
// Packed rows per warp (FlashAttention-2's layout): 32, two m16 halves, for D <= 128, so each ldmatrix of a K or V
// fragment feeds two mma (half the shared-memory reads per row of the 16-row layout); 16 at D = 256, where 32 rows'
// O accumulators alone would be 2 x 32 n8 tiles x 4 = 256 fp32 registers per thread (the 255 cap, before S and P).
constexpr int prefill_warp_rows(int d) { return d <= 128 ? 32 : 16; }
constexpr int prefill_threads(int d) { return prefill_rows(d) / prefill_warp_rows(d) * 32; }  // 128: 4 warps
// The widest key tile: 64, but 32 where a warp owns 32 rows at D >= 96, so that its O and S accumulators stay within
// 160 fp32 registers per thread (D=128: O 2 x 16 x 4 = 128 + S 2 x 4 x 4 = 32; BN=64 would make S 64: ptxas
// spilled 16-330 bytes per kernel at D = 96 and 128 with it, sm_80 and sm_90). Q's A fragments are re-read from shared
// memory per key tile in every layout (FlashAttention-2 does too): 32 rows of Q in registers are D / 2 more per thread.
constexpr int prefill_bn_max(int d) { return prefill_warp_rows(d) == 32 && d >= 96 ? 32 : 64; }

// Rows of D + 8 16-bit elements at the start of a prefill CTA's shared memory: the Q tile [BM], and for fp8 caches
// after it the 16-bit copy of the current K and V tiles [2 BN] that the conversion pass writes once per CTA.
constexpr int prefill_tile_rows(int d, int bn, bool fp8) { return prefill_rows(d) + (fp8 ? 2 * bn : 0); }

// Dynamic shared memory of a prefill CTA (bytes), one formula for the kernel and the plan: prefill_tile_rows rows of
// D + 8 elements (16 bytes of padding: conflict-free ldmatrix), then the ring of `stages` x (K tile, V tile) as stored:
// 16-bit rows of D + 8 elements (the K row's padding holds the key's valid flag); fp8 rows of D bytes, unpadded (only
// the conversion pass reads them, 8 consecutive bytes per thread), then one valid-flag byte per key and stage.
constexpr size_t prefill_smem(int d, int bn, int stages, bool fp8 = false) {
  return size_t(prefill_tile_rows(d, bn, fp8)) * size_t(d + 8) * 2 +
         (fp8 ? size_t(stages) * bn * (2 * size_t(d) + 1) : size_t(stages) * 2 * bn * size_t(d + 8) * 2);
}

struct PrefillPlan {
  int64_t batch = 0, max_q_len = 0;  // the grid is finished by run_prefill (it needs the GQA group: AttnParams)
  int bn = 0;                        // key-tile width; 0: refused (the device's shared memory is too small)
  int stages = 0;                    // depth of the K/V cp.async ring (2 or 3)
  size_t smem = 0;                   // dynamic shared memory, bytes
};

// Tile width and ring depth for head_dim d and the caches' layout (fp8 or 16-bit) under a per-block shared-memory
// limit: the widest key tile that fits (64, then 32, from prefill_bn_max(d) down; 32-key tiles are compiled for D >=
// 96 only: D = 64 and 80 always fit 64), and at that width the ring depth, 3 or 2, that gives the most CTAs per SM, 3
// on a tie. At most 2 CTAs of 4 warps fit an SM by registers (128 threads x up to 256 registers), and 2 CTAs are 8
// warps per SM, 2 per scheduler, one's MMAs covering the other's softmax and barriers (FlashAttention-2 runs 2 CTAs of
// 4 warps too); with 1 CTA the third stage keeps two tiles in flight while one is consumed. sm_80 (164 KB per SM):
// 16-bit D = 80 and 128 take 2 stages for 2 CTAs (66 KB, 68 KB instead of 88 KB, 85 KB).
inline PrefillPlan plan_prefill(int64_t batch, int64_t hq, int64_t d, bool fp8, int64_t max_q_len,
                                const DeviceProps& props) {
  (void)hq;
  PrefillPlan plan;
  plan.batch = batch;
  plan.max_q_len = max_q_len;
  constexpr int64_t kMaxCtas = 2;
  for (int bn = prefill_bn_max(int(d)); bn >= (d < 96 ? 64 : 32) && plan.bn == 0; bn /= 2) {
    int64_t best = 0;
    for (int stages = 3; stages >= 2; --stages) {
      const size_t bytes = prefill_smem(int(d), bn, stages, fp8);
      if (bytes > size_t(props.smem_optin)) continue;
      const int64_t ctas = std::min<int64_t>(kMaxCtas, smem_per_sm(props) / (int64_t(bytes) + 1024));
      if (ctas > best) {
        best = ctas;
        plan.bn = bn;
        plan.stages = stages;
        plan.smem = bytes;
      }
    }
  }
  return plan;
}

// Sequence b's query rows [first, first + q_len): cu_seqlens_q[b] .. cu_seqlens_q[b + 1] clamped to [0, rows]
// (check=False callers); int32 by source.
__device__ __forceinline__ int64_t prefill_first_row(const AttnParams& p, int64_t b) {
  return min64(max64(dev::ld_global(p.cu_seqlens_q + b), 0), p.rows);
}
__device__ __forceinline__ int prefill_q_len(const AttnParams& p, int64_t b) {
  return static_cast<int>(max64(min64(dev::ld_global(p.cu_seqlens_q + b + 1), p.rows) - prefill_first_row(p, b), 0));
}

// Query rows no sequence owns -- [0, cu[0]) and [cu[batch], rows), cu clamped to [0, rows]; whatever cu holds, a row
// between those two is some sequence's, as the clamped walk cu[0] .. cu[batch] crosses it upward -- are written too
// (zeros, lse -inf), never left as allocated (check=False callers): by sequence 0's CTAs and by the last sequence's,
// each for its KV head's query heads.
template <typename T, int D>
__device__ __forceinline__ void prefill_zero_unowned_rows(const AttnParams& p, int64_t b, int kvh) {
  int64_t ranges[2][2] = {{0, 0}, {0, 0}};
  if (b == 0) ranges[0][1] = prefill_first_row(p, 0);
  if (b == int64_t(gridDim.z) - 1) {
    ranges[1][0] = min64(max64(dev::ld_global(p.cu_seqlens_q + gridDim.z), 0), p.rows);
    ranges[1][1] = p.rows;
  }
  // A row per CTA, its words over the threads: no 64-bit division (a called subroutine; ptxas saved registers
  // around it for the whole kernel).
  const int per_row = p.group * (D / 2);  // 2-element words of this KV head's query heads in a row (< 2^23)
  for (const auto& range : ranges) {
    for (int64_t row = range[0] + blockIdx.x; row < range[1]; row += gridDim.x) {
      for (int i = threadIdx.x; i < per_row; i += blockDim.x) {
        const int h = kvh * p.group + i / (D / 2), x = i % (D / 2);
        dev::st_global(reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + (row * p.hq + h) * D) + x, 0u);
        if (x == 0) dev::st_global(p.lse + row * p.hq + h, neg_inf());
      }
    }
  }
}

// KV: the caches' element type, T (fp16/bf16) or uint8_t (float8_e4m3fn: staged as stored, converted to T once per
// CTA and tile; key = stored * k_scale folded into the score scale, value = stored * v_scale into the output).
template <typename T, typename KV, int D, int BN>
__global__ void __launch_bounds__(prefill_threads(D), 1)
    window_attention_prefill_kernel(const AttnParams p, int stages) {
  constexpr bool kFp8 = sizeof(KV) == 1;
  static_assert(kFp8 || std::is_same_v<KV, T>, "16-bit caches have the query's dtype");
  constexpr int BM = prefill_rows(D), NT = prefill_threads(D), LD = D + 8;
  constexpr int WM = prefill_warp_rows(D), MT = WM / 16;  // packed rows per warp, its m16 halves
  constexpr int SLD = kFp8 ? D : LD;  // row stride of the ring's tiles, cache elements (fp8: unpadded)
  constexpr int KD = D / 16;          // k-steps of S = Q K^T
  constexpr int NS = BN / 8;          // n8 tiles of S
  constexpr int ND = D / 8;           // n8 tiles of O
  constexpr int kChunkElems = 16 / int(sizeof(KV));
  constexpr int kChunks = D / kChunkElems;  // 16-byte chunks per cached row
  constexpr int kQChunks = D / 8;     // 16-byte chunks per query row
  constexpr int TPK = NT / BN;        // threads copying one key's rows
  static_assert(NT % BN == 0 && NS % 2 == 0 && ND % 2 == 0, "threads per key, n8 tile pairs");
  static_assert(!kFp8 || BN <= NT, "one thread per key copies the fp8 valid flags");
  AK_DYNAMIC_SHARED(T, smem);
  T* const q_s = smem;  // [BM][LD]
  // fp8: the 16-bit K and V tiles [2 * BN][LD] the warps read (K rows, then V rows).
  T* const cv_s = smem + BM * LD;
  // Ring stage s: K at kv_s + s * 2 * BN * SLD, V after it; fp8: then flag_s [stages][BN] (1: block id in range).
  KV* const kv_s = reinterpret_cast<KV*>(smem + prefill_tile_rows(D, BN, kFp8) * LD);
  uint8_t* const flag_s = reinterpret_cast<uint8_t*>(kv_s + stages * 2 * BN * SLD);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int kvh = blockIdx.y;
  const int64_t b = blockIdx.z;
  // FAULT(prefill_zero_unowned)
  if (b == 0 || b == int64_t(gridDim.z) - 1) prefill_zero_unowned_rows<T, D>(p, b, kvh);
  const int group = p.group;
  const int bs = static_cast<int>(p.block_size);
  // Keys at or past the table's capacity are masked (check=False); positions are int32 (seq_lens is).
  const int64_t cap64 = p.max_blocks * p.block_size;
  const T* const qg = static_cast<const T*>(p.query);
  const KV* const kc = static_cast<const KV*>(p.k_cache);
  const KV* const vc = static_cast<const KV*>(p.v_cache);
  const int32_t* const table = p.block_table + b * p.max_blocks;
  // This thread's key row in every tile, and its 16-byte chunks of that row.
  const int my_key = tid / TPK, my_sub = tid % TPK;

  // Tiles in reverse: CTAs start in blockIdx order, so the last query tiles (the most keys under a causal mask)
  // start first and the short ones fill in behind them (FlashAttention-2's causal load balancing).
  for (int64_t R0 = int64_t(gridDim.x - 1 - blockIdx.x) * BM; R0 < int64_t(prefill_q_len(p, b)) * group;
       R0 += int64_t(gridDim.x) * BM) {
    const int64_t first = prefill_first_row(p, b);
    const int q_len = prefill_q_len(p, b);
    // 32-bit row and key arithmetic only (a 64-bit division is a called subroutine, and ptxas spilled the 32-row
    // layout's O around such calls): packed rows < rows * hq < 2^31 (checked at launch), so R0 fits int here.
    // Positions: with check=False seq_len and kv_start are any int32 (seq_len INT32_MIN: len - q_len wraps in int),
    // so a token's position is formed in 64 bits and clamped to [-1, 2^31 - 1] (a row at position < 0 sees no key
    // either way). Key bounds come out in [-1, 2^31 - 1 - BN]: keys are >= 0, and keys at or past 2^31 - BN are
    // masked so that every key index of a tile (j0 + BN - 1) fits int32.
    const int r0 = static_cast<int>(R0);
    const int64_t len = dev::ld_global(p.seq_lens + b);
    const int kstart = p.kv_start ? static_cast<int>(max64(dev::ld_global(p.kv_start + b), 0)) : 0;
    const int cap = static_cast<int>(min64(min64(cap64, len), int64_t(0x7fffffff) - BN + 1));  // keys >= cap: masked
    const int64_t pos0 = len - q_len;                                                           // token 0's position
    const int nrows = q_len * group;
    const int t_first = r0 / group, h_first = r0 - t_first * group;
    // Packed row R0 + x (0 <= x < BM): token t_first + u / group, head kvh * group + u % group with u = h_first + x <
    // group + BM. Live iff token < q_len.
    auto split_row = [&](int x, int& tok, int& hig) {
      const int u = h_first + x, du = u / group;
      tok = t_first + du;
      hig = u - du * group;
    };
    const int t_last = (nrows - r0 > BM ? r0 + BM - 1 : nrows - 1) / group;  // no r0 + BM: it may pass 2^31
    auto position = [&](int tok) { return static_cast<int>(max64(pos0 + tok, -1)); };
    auto first_key = [&](int tok) {  // in [0, 2^31): at most max(kstart, position)
      return window_attention_first_key<int>(position(tok), kstart, p.window, p.chunk);
    };
    // (cap is INT32_MIN when seq_len is: cap - 1 in 64 bits)
    auto last_key = [&](int tok) { return static_cast<int>(max64(min64(position(tok), int64_t(cap) - 1), -1)); };
    // Keys some row of this tile sees: [klo, khi]; keys every row sees: [lo_all, hi_all] (a row's first key never
    // decreases with its position: window and chunk bounds alike).
    const int klo = first_key(t_first);
    const int khi = last_key(t_last);
    const int lo_all = first_key(t_last);
    const int hi_all = last_key(t_first);
    const int tile_first = klo / BN * BN;
    const int ntiles = klo <= khi ? (khi - tile_first) / BN + 1 : 0;

    __syncthreads();  // the previous query tile's last reads of the ring and of q_s are done
    // Q tile: packed row r (split_row); rows past the sequence: zeros.
    for (int idx = tid; idx < BM * kQChunks; idx += NT) {
      const int r = idx / kQChunks, c = idx % kQChunks;
      int tok, hig;
      split_row(r, tok, hig);
      T* dst = q_s + r * LD + c * 8;
      const bool live = tok < q_len;
      const T* src = live ? qg + (first + tok) * p.s.q0 + (kvh * group + hig) * p.s.q1 + c * 8 : qg;
      if (p.q_vec) {
        dev::cp_async_16(dst, src, live ? 16 : 0);
      } else {
        uint4 v = make_uint4(0, 0, 0, 0);
        T* vp = reinterpret_cast<T*>(&v);
        if (live) {
#pragma unroll
          for (int x = 0; x < 8; ++x) vp[x] = dev::ld_global(src + x);
        }
        *reinterpret_cast<uint4*>(dst) = v;
      }
    }
    // K/V tile i into ring stage i % stages: this thread's key, chunks my_sub, my_sub + TPK, ...
    auto load_tile = [&](int i) {
      const int j = tile_first + i * BN + my_key;
      KV* const ks = kv_s + (i % stages) * 2 * BN * SLD + my_key * SLD;
      KV* const vs = ks + BN * SLD;
      int64_t ko = 0, vo = 0;
      bool valid = false;
      if (j >= klo && j <= khi) {
        const int64_t blk = dev::ld_global(table + j / bs);
        valid = blk >= 0 && blk < p.num_blocks;
        const int64_t off = j % bs;
        ko = blk * p.s.k0 + off * p.s.k1 + kvh * p.s.k2;
        vo = blk * p.s.v0 + off * p.s.v1 + kvh * p.s.v2;
      }
      const int n = valid ? 16 : 0;
#pragma unroll
      for (int c = my_sub; c < kChunks; c += TPK) {
        dev::cp_async_16(ks + c * kChunkElems, valid ? kc + ko + c * kChunkElems : kc, n);
        dev::cp_async_16(vs + c * kChunkElems, valid ? vc + vo + c * kChunkElems : vc, n);
      }
      if (my_sub == 0) {
        const uint16_t flag = valid ? 1 : 0;
        if constexpr (kFp8) {
          flag_s[(i % stages) * BN + my_key] = uint8_t(flag);  // into the 16-bit K row's padding at conversion
        } else {
          memcpy(ks + D, &flag, 2);  // the row's padding: read by the masking, never by ldmatrix
        }
      }
    };
    for (int i = 0; i < stages - 1; ++i) {
      if (i < ntiles) load_tile(i);
      dev::cp_async_commit();  // group 0 carries the Q tile too
    }

    // Per-lane rows g and g + 8 of each m16 half mt of this warp: packed row R0 + lane_row(mt, r).
    auto lane_row = [&](int mt, int r) { return warp * WM + mt * 16 + g + 8 * r; };
    float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
      m[mt][0] = m[mt][1] = neg_inf();
      l[mt][0] = l[mt][1] = 0.f;
    }
    // fp8: key = stored * k_scale, so the scores of the stored keys take scale * k_scale.
    // FAULT(prefill_qk_scale)
    const float qk_scale = kFp8 ? p.scale * dev::ld_global(p.k_scale) : p.scale;
    // softcap: softcap * tanh(s * qk_scale / softcap), the division folded into the scale once per query tile.
    // FAULT(prefill_score_mul)
    const float score_mul = p.softcap > 0.f ? qk_scale / p.softcap : qk_scale;
    // ldmatrix.x4 row address of m16 half mt's A fragment (rows lane % 16, columns (lane / 16) * 8 of each k-step).
    const T* const q_warp = q_s + (warp * WM + lane % 16) * LD + (lane / 16) * 8;
    constexpr int kQHalf = 16 * LD;  // q_warp + mt * kQHalf: half mt

#pragma unroll 1
    for (int it = 0; it < ntiles; ++it) {
      if (it + stages - 1 < ntiles) load_tile(it + stages - 1);
      dev::cp_async_commit();  // possibly empty: wait_group counts groups
      // FAULT(prefill_tile_wait)
      if (stages == 3) {
        dev::cp_async_wait<2>();
      } else {
        dev::cp_async_wait<1>();
      }
      __syncthreads();  // tile `it` (and at it == 0 the Q tile) landed for every thread's copies
      const KV* const ring = kv_s + (it % stages) * 2 * BN * SLD;
      const T* ks;  // the K tile the warps read, [BN][LD]; the V tile follows it
      if constexpr (kFp8) {
        // The stage's e4m3 K and V rows -> 16-bit rows of cv_s, once per CTA (each thread 8 bytes -> one 16-byte
        // chunk per step: 2 * BN * D / 8 / NT steps, 4 cvt each), and the keys' valid flags into the K rows' padding.
        // e4m3 -> fp16 / bf16 is exact, so the warps then run the 16-bit path on the same values.
        // FAULT(prefill_fp8_convert_rows)
        for (int idx = tid; idx < 2 * BN * (D / 8); idx += NT) {
          const int row = idx / (D / 8), c = idx % (D / 8);
          const uint2 w = *reinterpret_cast<const uint2*>(ring + row * SLD + c * 8);
          const uint4 h = make_uint4(fp8x2_to<T>(uint16_t(w.x)), fp8x2_to<T>(uint16_t(w.x >> 16)),
                                     fp8x2_to<T>(uint16_t(w.y)), fp8x2_to<T>(uint16_t(w.y >> 16)));
          // FAULT(prefill_fp8_convert_store)
          *reinterpret_cast<uint4*>(cv_s + row * LD + c * 8) = h;
        }
        if (tid < BN) {
          // FAULT(prefill_fp8_flags)
          const uint16_t flag = flag_s[(it % stages) * BN + tid];
          // FAULT(prefill_fp8_flag_copy)
          memcpy(cv_s + tid * LD + D, &flag, 2);
        }
        // FAULT(prefill_fp8_convert_sync)
        __syncthreads();  // the 16-bit tiles are complete; ring stage it % stages may be refilled from here on
        ks = cv_s;
      } else {
        ks = ring;
      }
      const T* const vs = ks + BN * LD;
      const int j0 = tile_first + it * BN;
      // S = Q K^T for this warp's WM rows x BN keys: each K fragment serves the MT m16 halves.
      float s[MT][NS][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
      // k-steps not unrolled: each one's Q and K fragments are loaded in it, and unrolled ptxas hoisted them.
#pragma unroll 1
      for (int kk = 0; kk < KD; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        // FAULT(prefill_q_frags)
        for (int mt = 0; mt < MT; ++mt) dev::ldmatrix_x4(a[mt], q_warp + mt * kQHalf + kk * 16);
#pragma unroll
        for (int n = 0; n < NS; n += 2) {
          // matrices: keys n*8..+7 at d 0-7 / 8-15, keys n*8+8..+15 at d 0-7 / 8-15
          uint32_t r[4];
          // FAULT(prefill_k_ldmatrix)
          dev::ldmatrix_x4(r, ks + (n * 8 + (lane / 16) * 8 + lane % 8) * LD + kk * 16 + ((lane / 8) % 2) * 8);
          const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            dev::mma_m16n8k16<T>(s[mt][n], a[mt], b0, s[mt][n]);
            dev::mma_m16n8k16<T>(s[mt][n + 1], a[mt], b1, s[mt][n + 1]);
          }
        }
      }
      // Scale, softcap, masks (valid flags always; ranges only on tiles crossing some row's boundary). softcap is
      // uniform over the launch: one branch per tile picks the variant with or without tanh, so the scores of a
      // launch without softcap carry no tanh and no per-score select.
      // A lane's score e of n-tile n is key j0 + 2 t4 + c, c = n * 8 + (e & 1): row (mt, r) sees it iff lo_c <= c <=
      // hi_c, its range made relative to the lane's first key once per tile (tiles inside every row's range: [0, BN),
      // no test). c is a compile-time constant: 2 compares with immediates per score, and 4 registers per m16 half
      // instead of a key index per score (the 32-row layout spilled with those).
      // The rows' ranges are formed here, on straddling tiles only (a few per query tile), not kept in registers
      // across the loop (4 per m16 half: the 32-row layout spilled with them); rows past the sequence see nothing.
      const bool ranged = j0 < lo_all || j0 + BN - 1 > hi_all;
      int lo_c[MT][2], hi_c[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          lo_c[mt][r] = 0;
          hi_c[mt][r] = BN;
        }
      if (ranged) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            int tok, hig;
            // FAULT(prefill_row_mask)
            split_row(lane_row(mt, r), tok, hig);
            const bool live = tok < q_len;
            lo_c[mt][r] = (live ? first_key(tok) : 1) - (j0 + 2 * t4);
            hi_c[mt][r] = (live ? last_key(tok) : 0) - (j0 + 2 * t4);
          }
      }
      auto scale_and_mask = [&](auto capped) {
#pragma unroll
        for (int n = 0; n < NS; ++n) {
          // Key row k's valid flag: the K row's padding (element D).
          uint16_t flag[2];
          memcpy(&flag[0], ks + (n * 8 + 2 * t4) * LD + D, 2);
          memcpy(&flag[1], ks + (n * 8 + 2 * t4 + 1) * LD + D, 2);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = n * 8 + (e & 1);
              const bool vis = flag[e & 1] != 0 && c >= lo_c[mt][e / 2] && c <= hi_c[mt][e / 2];
              float v = s[mt][n][e] * score_mul;
              if constexpr (decltype(capped)::value) v = p.softcap * tanhf(v);
              s[mt][n][e] = vis ? v : neg_inf();
            }
        }
      };
      // FAULT(prefill_softcap)
      if (p.softcap > 0.f) {
        scale_and_mask(std::true_type{});
      } else {
        scale_and_mask(std::false_type{});
      }
      // Online softmax: rows g (e = 0, 1) and g + 8 (e = 2, 3) of each m16 half; the row's 4 lanes are a quad.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = neg_inf();
#pragma unroll
          for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][r], mx);
          const float alpha = m[mt][r] == neg_inf() ? 0.f : __expf(m[mt][r] - m_new);
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < NS; ++n) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              const float pr = s[mt][n][e] == neg_inf() ? 0.f : __expf(s[mt][n][e] - m_new);
              s[mt][n][e] = pr;
              sum += pr;  // fp32, as FlashAttention: lse exact to fp32
            }
          }
          l[mt][r] = l[mt][r] * alpha + sum;  // this lane's share; the quad's shares are added at the end
          m[mt][r] = m_new;
#pragma unroll
          for (int n = 0; n < ND; ++n) {
            o[mt][n][2 * r] *= alpha;
            o[mt][n][2 * r + 1] *= alpha;
          }
        }
      // O += P V: P's A fragment for keys 16kk..16kk+15 is the accumulators of n-tiles 2kk and 2kk+1; each V
      // fragment serves the MT m16 halves.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack_pair<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack_pair<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          // FAULT(prefill_pv_pair)
          a[mt][2] = pack_pair<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack_pair<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < ND; n += 2) {
          // .trans over V[key][d]: keys 0-7 / 8-15 at d n*8..+7, then at d n*8+8..+15
          uint32_t r[4];
          // FAULT(prefill_v_ldmatrix)
          dev::ldmatrix_x4_trans(r, vs + (kk * 16 + lane % 16) * LD + n * 8 + (lane / 16) * 8);
          const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            dev::mma_m16n8k16<T>(o[mt][n], a[mt], b0, o[mt][n]);
            dev::mma_m16n8k16<T>(o[mt][n + 1], a[mt], b1, o[mt][n + 1]);
          }
        }
      }
      // 16-bit caches: the warps read the ring stage itself, refilled by the next iteration's cp.async. fp8: they
      // read cv_s; the stage was free after the conversion's barrier, and the next conversion writes cv_s only after
      // the next iteration's first barrier, which every warp reaches after these reads.
      // FAULT(prefill_refill_sync)
      if constexpr (!kFp8) __syncthreads();
    }
    dev::cp_async_wait<0>();  // the prologue's groups when no tile was visited (Q, empty groups)
    // FAULT(prefill_out_scale)
    const float out_scale = kFp8 ? dev::ld_global(p.v_scale) : 1.f;  // fp8: value = stored * v_scale

    // Write this lane's rows: O / l, lse (zeros and -inf for a row with no visible key).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float lr = l[mt][r];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        // Formed here from r0 (not split_row's form: the compiler would keep the prologue's values live across the key
        // loop instead, 8 registers the 32-row layout has not got).
        // Unsigned: r0 + lane_row may pass 2^31 - 1 (rows past the sequence of the last tile).
        const unsigned row = unsigned(r0) + unsigned(lane_row(mt, r));
        const unsigned tok = row / unsigned(group), hig = row - tok * unsigned(group);
        if (tok < unsigned(q_len)) {
          const int h = kvh * group + static_cast<int>(hig);
          const int64_t oh = (first + int64_t(tok)) * p.hq + h;
          // FAULT(prefill_lse)
          float lse = lr > 0.f ? m[mt][r] + __logf(lr) : neg_inf();
          float w = 1.f;  // the attention sink: one more term in the denominator, no value (once per row, here)
          // FAULT(prefill_sink)
          if (p.sinks) lse = add_sink_log2(lse * kLog2e, dev::ld_global(p.sinks + h) * kLog2e, w) / kLog2e;
          const float inv = lr > 0.f ? out_scale * w / lr : 0.f;
          T* const out = static_cast<T*>(p.out) + oh * D;
#pragma unroll
          for (int n = 0; n < ND; ++n)
            dev::st_global(reinterpret_cast<uint32_t*>(out + 2 * t4 + n * 8),
                           pack_pair<T>(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv));
          if (t4 == 0) dev::st_global(p.lse + oh, lse);
        }
      }
  }
}

// The prefill launch; returns the first launch error. The grid: packed query tiles x KV heads x batch.
template <typename T, typename KV, int D>
cudaError_t run_prefill(const AttnParams& p, const PrefillPlan& plan, cudaStream_t stream) {
  const int64_t tiles = std::min<int64_t>(
      std::max<int64_t>(1, ceil_div<int64_t>(plan.max_q_len * p.group, prefill_rows(D))), int64_t{0x7fffffff});
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(p.hkv), static_cast<unsigned>(plan.batch));
  auto go = [&](auto bn) -> cudaError_t {
    constexpr int BN = decltype(bn)::value;
    auto prefill = window_attention_prefill_kernel<T, KV, D, BN>;
    const cudaError_t err = AK_SET_MAX_DYNAMIC_SMEM(prefill, plan.smem);
    if (err != cudaSuccess) return err;
    AK_LAUNCH(prefill, grid, prefill_threads(D), plan.smem, stream, p, plan.stages);
    return AK_LAST_ERROR();
  };
  if constexpr (prefill_bn_max(D) == 64) {
    if (plan.bn == 64) return go(std::integral_constant<int, 64>{});
  }
  if constexpr (D >= 96) {  // 32-key tiles: the widest at D = 96 and 128, else where 64 may not fit (D = 256)
    if (plan.bn == 32) return go(std::integral_constant<int, 32>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace arkernels
