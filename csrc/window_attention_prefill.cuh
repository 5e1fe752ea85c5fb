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
// row's visible range are skipped; scores enter exp2 through one FFMA, most tiles need no per-score work (compile-time
// variants for masked and softcapped tiles), the O rescale is skipped where no row max moved. fp8 caches: the ring
// holds the tiles as stored and each is converted once per CTA into an fp16 tile (bf16 queries: scaled into fp16 by a
// power of two per warp). Shared memory per CTA: prefill_smem. `python scripts/sass_report.py` prints registers,
// occupancy, instruction counts and the key loop's SASS per tile of every instantiation (CI fails on any spill).
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

// Tile width and ring depth for head_dim d and the caches' layout under a per-block shared-memory limit: the widest
// key tile that fits (from prefill_bn_max(d) down; 32-key tiles are compiled for D >= 96 only), and at that width the
// ring depth, 3 or 2, giving the most CTAs per SM (at most 2 by registers), 3 on a tie (docs/kernels.md "Prefill").
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

// The prefill kernel's steps, per packed query tile: prefill_block, prefill_load_q and prefill_load_tile (cp.async),
// fp8: warp_bf16_to_f16 (bf16 queries); per key tile prefill_fp8_convert (fp8), prefill_qk (S = Q K^T), prefill_scores,
// prefill_online_softmax (S -> P) and prefill_pv (O += P V); then prefill_write_out (O / l and the lse).

// This lane's row r (0: g, 1: g + 8) of m16 half mt, as a row of the query tile: warp * WM + mt * 16 + g + 8 r.
template <int D>
__device__ __forceinline__ int prefill_lane_row(int mt, int r) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4;
  return warp * prefill_warp_rows(D) + mt * 16 + g + 8 * r;
}

// One packed query tile of one CTA (FlashAttention-2's BlockInfo): rows R0 .. R0 + BM - 1 of sequence b for KV head
// kvh, the keys its rows see and where the keys live. Packed row R0 + x (0 <= x < BM): token t_first + u / group, head
// kvh * group + u % group with u = h_first + x < group + BM; live iff token < q_len.
struct PrefillBlock {
  int64_t first;          // the sequence's first query row
  int q_len;              // its query tokens
  int r0;                 // R0 (< 2^31: packed rows < rows * hq, checked at launch)
  int group;              // query heads per KV head
  int kvh;                // the KV head
  int kstart;             // max(kv_start, 0)
  int cap;                // keys >= cap are masked: the table's capacity, seq_len, 2^31 - BN
  int64_t pos0;           // token 0's position: seq_len - q_len
  int t_first, h_first;   // packed row R0's token and head in the group
  int klo, khi;           // keys some row of the tile sees: [klo, khi]
  int lo_all, hi_all;     // keys every row of the tile sees: [lo_all, hi_all]
  int tile_first;         // the first key tile's first key: klo rounded down to BN
  int ntiles;             // key tiles from tile_first to khi (0: no row sees a key)
  int bs;                 // block_size
  const int32_t* table;   // the sequence's block-table row

  __device__ __forceinline__ void split_row(int x, int& tok, int& hig) const {  // packed row R0 + x
    const int u = h_first + x, du = u / group;
    tok = t_first + du;
    hig = u - du * group;
  }
  __device__ __forceinline__ int position(int tok) const { return static_cast<int>(max64(pos0 + tok, -1)); }
  // A token's first visible key, in [0, 2^31): at most max(kstart, position).
  __device__ __forceinline__ int first_key(const AttnParams& p, int tok) const {
    return window_attention_first_key<int>(position(tok), kstart, p.window, p.chunk);
  }
  // Its last visible key, -1 for none (cap is INT32_MIN when seq_len is: cap - 1 in 64 bits).
  __device__ __forceinline__ int last_key(int tok) const {
    return static_cast<int>(max64(min64(position(tok), int64_t(cap) - 1), -1));
  }
};

// The packed query tile at R0 of sequence b (BM rows, BN-key tiles) and the keys its rows see.
template <int BM, int BN>
__device__ __forceinline__ PrefillBlock prefill_block(const AttnParams& p, int64_t b, int64_t R0, int kvh, int bs,
                                                      const int32_t* table) {
  PrefillBlock blk;
  blk.first = prefill_first_row(p, b);
  blk.q_len = prefill_q_len(p, b);
  // 32-bit row and key arithmetic only (a 64-bit division is a called subroutine, and ptxas spilled the 32-row
  // layout's O around such calls): packed rows < rows * hq < 2^31 (checked at launch), so R0 fits int here.
  // Positions: with check=False seq_len and kv_start are any int32 (seq_len INT32_MIN: len - q_len wraps in int),
  // so a token's position is formed in 64 bits and clamped to [-1, 2^31 - 1] (a row at position < 0 sees no key
  // either way). Key bounds come out in [-1, 2^31 - 1 - BN]: keys are >= 0, and keys at or past 2^31 - BN are
  // masked so that every key index of a tile (j0 + BN - 1) fits int32.
  blk.r0 = static_cast<int>(R0);
  blk.group = p.group;
  blk.kvh = kvh;
  // Keys at or past the table's capacity are masked (check=False); positions are int32 (seq_lens is).
  const int64_t cap64 = p.max_blocks * p.block_size;
  const int64_t len = dev::ld_global(p.seq_lens + b);
  blk.kstart = p.kv_start ? static_cast<int>(max64(dev::ld_global(p.kv_start + b), 0)) : 0;
  blk.cap = static_cast<int>(min64(min64(cap64, len), int64_t(0x7fffffff) - BN + 1));  // keys >= cap: masked
  blk.pos0 = len - blk.q_len;                                                         // token 0's position
  const int nrows = blk.q_len * blk.group;
  blk.t_first = blk.r0 / blk.group;
  blk.h_first = blk.r0 - blk.t_first * blk.group;
  const int t_last = (nrows - blk.r0 > BM ? blk.r0 + BM - 1 : nrows - 1) / blk.group;  // no r0 + BM: it may pass 2^31
  // A row's first key never decreases with its position: window and chunk bounds alike.
  blk.klo = blk.first_key(p, blk.t_first);
  blk.khi = blk.last_key(t_last);
  blk.lo_all = blk.first_key(p, t_last);
  blk.hi_all = blk.last_key(blk.t_first);
  blk.tile_first = blk.klo / BN * BN;
  blk.ntiles = blk.klo <= blk.khi ? (blk.khi - blk.tile_first) / BN + 1 : 0;
  blk.bs = bs;
  blk.table = table;
  return blk;
}

// The Q tile [BM][LD] (packed row r: PrefillBlock::split_row; rows past the sequence: zeros), by cp.async where the
// query rows are 16-byte aligned (commit group 0), and in each row's padding (element D, 2 ints) the keys it sees,
// [first, last] ([1, 0]: none, past the sequence), which the masked tiles read (prefill_score_variant): no per-row
// window / chunk arithmetic per tile, and none of the registers it took across the key loop.
template <typename T, int D>
__device__ __forceinline__ void prefill_load_q(const AttnParams& p, const PrefillBlock& blk, T* q_s) {
  constexpr int BM = prefill_rows(D), NT = prefill_threads(D), LD = D + 8;
  constexpr int kQChunks = D / 8;  // 16-byte chunks per query row
  const T* const qg = static_cast<const T*>(p.query);
  const int tid = threadIdx.x;
  for (int idx = tid; idx < BM * kQChunks; idx += NT) {
    const int r = idx / kQChunks, c = idx % kQChunks;
    int tok, hig;
    blk.split_row(r, tok, hig);
    T* dst = q_s + r * LD + c * 8;
    const bool live = tok < blk.q_len;
    const T* src = live ? qg + (blk.first + tok) * p.s.q0 + (blk.kvh * blk.group + hig) * p.s.q1 + c * 8 : qg;
    if (c == 0) {
      // FAULT(prefill_row_range)
      const int2 range = live ? make_int2(blk.first_key(p, tok), blk.last_key(tok)) : make_int2(1, 0);
      *reinterpret_cast<int2*>(q_s + r * LD + D) = range;
    }
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
}

// K/V tile i of the query tile into ring stage i % stages (kv_s: stage 0's K tile; flag_s: the fp8 valid flags):
// this thread's key, chunks my_sub, my_sub + TPK, ... of its K and V rows, and the key's valid flag.
template <typename KV, int D, int BN>
__device__ __forceinline__ void prefill_load_tile(const AttnParams& p, const PrefillBlock& blk, KV* kv_s,
                                                  uint8_t* flag_s, int stages, int i) {
  constexpr bool kFp8 = sizeof(KV) == 1;
  constexpr int NT = prefill_threads(D), SLD = kFp8 ? D : D + 8;
  constexpr int kChunkElems = 16 / int(sizeof(KV));
  constexpr int kChunks = D / kChunkElems;  // 16-byte chunks per cached row
  constexpr int TPK = NT / BN;              // threads copying one key's rows
  const KV* const kc = static_cast<const KV*>(p.k_cache);
  const KV* const vc = static_cast<const KV*>(p.v_cache);
  const int tid = threadIdx.x;
  const int my_key = tid / TPK, my_sub = tid % TPK;  // this thread's key row of every tile, its first chunk
  const int j = blk.tile_first + i * BN + my_key;
  KV* const ks = kv_s + (i % stages) * 2 * BN * SLD + my_key * SLD;
  KV* const vs = ks + BN * SLD;
  int64_t ko = 0, vo = 0;
  bool valid = false;
  if (j >= blk.klo && j <= blk.khi) {
    const int64_t bid = dev::ld_global(blk.table + j / blk.bs);
    valid = bid >= 0 && bid < p.num_blocks;
    const int64_t off = j % blk.bs;
    ko = bid * p.s.k0 + off * p.s.k1 + blk.kvh * p.s.k2;
    vo = bid * p.s.v0 + off * p.s.v1 + blk.kvh * p.s.v2;
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
}

// fp8 caches: ring stage it % stages (its e4m3 K rows, then V rows) -> the fp16 K and V tiles cv_s [2 BN][LD] the warps
// read, once per CTA (8 bytes -> one 16-byte chunk per thread and pass, 4 cvt), and the keys' valid flags (flag_s) into
// the K rows' padding; e4m3 -> fp16 is exact. Ends with a barrier: the stage may be refilled from there on.
template <typename T, int D, int BN>
__device__ __forceinline__ void prefill_fp8_convert(const uint8_t* ring, const uint8_t* flag_s, T* cv_s, int it,
                                                    int stages) {
  constexpr int NT = prefill_threads(D), LD = D + 8, kC = D / 8;  // kC: 8-byte chunks per stored row
  static_assert(2 * BN * kC % NT == 0, "whole passes over the tile");
  const int tid = threadIdx.x;
  // A compile-time trip count, 2 passes unrolled: ptxas kept 4 passes' addresses live across the loop otherwise.
#pragma unroll 2
  // FAULT(prefill_fp8_convert_rows)
  for (int i = 0; i < 2 * BN * kC / NT; ++i) {
    const int idx = tid + i * NT, row = idx / kC, c = idx % kC;
    const uint2 w = *reinterpret_cast<const uint2*>(ring + idx * 8);  // stored rows are unpadded: row * D + c * 8
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
}

// S = Q K^T for this warp's WM rows x BN keys of the K tile ks [BN][LD]: each K fragment serves the MT m16 halves
// (q_warp: this lane's ldmatrix.x4 row address in half 0 of the Q tile; half mt at q_warp + mt * 16 rows).
template <typename T, int D, int MT, int NS>
__device__ __forceinline__ void prefill_qk(float (&s)[MT][NS][4], const T* q_warp, const T* ks) {
  constexpr int LD = D + 8, KD = D / 16;  // k-steps of S = Q K^T
  constexpr int kQHalf = 16 * LD;         // q_warp + mt * kQHalf: half mt
  const int tid = threadIdx.x, lane = tid % 32;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
  // k-steps unrolled (rolled before issue 34: at 251 registers ptxas hoisted the unrolled loads and spilled).
#pragma unroll
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
}

// Scores enter the softmax as the operand of one FFMA before exp2: p = 2^(s c2 - m). An unmasked tile without softcap
// takes nothing here (c2 is the scale: the max of s times c2 > 0 is the max of the scaled scores); the others take a
// compile-time variant (docs/kernels.md "Prefill"): masked (-inf where a row's range or a key's valid flag excludes
// it, the rest times mul: 1, or the scale where c2 cannot hold it, <= 0 or NaN) and softcap (softcap log2(e)
// tanh(s mul), c2 = 1), masked or not. A lane's score e of n-tile n is key j0 + 2 t4 + c, c = n * 8 + (e & 1): row
// (mt, r) sees it iff lo_c <= c <= hi_c (c a compile-time constant: 2 compares with immediates per score).
template <bool kMasked, bool kCapped, typename T, int D, int BN, int MT, int NS>
__device__ __forceinline__ void prefill_score_variant(const AttnParams& p, float (&s)[MT][NS][4], const T* ks,
                                                      const void* q_s, int j0, float mul) {
  constexpr int LD = D + 8;
  const int tid = threadIdx.x, t4 = tid % 32 % 4;
  int lo_c[MT][2], hi_c[MT][2];
  if constexpr (kMasked) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // The row's [first, last] key from its Q row's padding (prefill_load_q).
        // FAULT(prefill_row_mask)
        const int row = prefill_lane_row<D>(mt, r);
        const int2 range = *reinterpret_cast<const int2*>(static_cast<const uint16_t*>(q_s) + row * LD + D);
        lo_c[mt][r] = range.x - (j0 + 2 * t4);
        hi_c[mt][r] = range.y - (j0 + 2 * t4);
      }
  }
#pragma unroll
  for (int n = 0; n < NS; ++n) {
    uint16_t flag[2] = {1, 1};
    if constexpr (kMasked) {  // key row k's valid flag: the K row's padding (element D)
      memcpy(&flag[0], ks + (n * 8 + 2 * t4) * LD + D, 2);
      memcpy(&flag[1], ks + (n * 8 + 2 * t4 + 1) * LD + D, 2);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[mt][n][e] * mul;
        if constexpr (kCapped) v = (p.softcap * kLog2e) * tanhf(v);
        if constexpr (kMasked) {
          const int c = n * 8 + (e & 1);
          const bool vis = flag[e & 1] != 0 && c >= lo_c[mt][e / 2] && c <= hi_c[mt][e / 2];
          v = vis ? v : neg_inf();
        }
        s[mt][n][e] = v;
      }
  }
}

// Every key of the K tile ks has a valid block id (the flags in the K rows' padding), as one vote of the warp.
template <typename T, int D, int BN>
__device__ __forceinline__ bool prefill_tile_valid(const T* ks) {
  const int lane = threadIdx.x % 32;
  bool ok = true;
#pragma unroll
  for (int k = lane; k < BN; k += 32) {
    uint16_t flag;
    memcpy(&flag, ks + k * (D + 8) + D, 2);
    ok = ok && flag != 0;
  }
  return dev::warp_all(ok);
}

// Key tile j0's variant, or none. fold: the scale is c2 (not applied here); otherwise mul is.
template <typename T, int D, int BN, int MT, int NS>
__device__ __forceinline__ void prefill_scores(const AttnParams& p, const PrefillBlock& blk, float (&s)[MT][NS][4],
                                               const T* ks, const void* q_s, int j0, bool fold, float mul) {
  // FAULT(prefill_unmasked_pick)
  const bool ranged = j0 < blk.lo_all || j0 + BN - 1 > blk.hi_all;
  // FAULT(prefill_tile_vote)
  const bool masked = ranged || !prefill_tile_valid<T, D, BN>(ks);
  // FAULT(prefill_softcap)
  if (p.softcap > 0.f) {
    if (masked) {
      prefill_score_variant<true, true, T, D, BN>(p, s, ks, q_s, j0, mul);
    } else {
      prefill_score_variant<false, true, T, D, BN>(p, s, ks, q_s, j0, mul);
    }
  } else if (masked || !fold) {
    prefill_score_variant<true, false, T, D, BN>(p, s, ks, q_s, j0, fold ? 1.f : mul);
  }
}

// Online softmax in log2 units: rows g (e = 0, 1) and g + 8 (e = 2, 3) of each m16 half (a quad per row). m (of
// s c2) and this lane's share of l updated, S -> P = 2^(s c2 - m); O and l rescaled by 2^(m_old - m_new) only where
// some row of the warp moved its max (a vote per row pair; alpha is exactly 1 for the others: no bit changes). A row
// with no key yet keeps m = -inf and takes 0 for it in the exponent (2^-inf = 0, no NaN).
template <int MT, int NS, int ND>
__device__ __forceinline__ void prefill_online_softmax(float (&s)[MT][NS][4], float (&o)[MT][ND][4],
                                                       float (&m)[MT][2], float (&l)[MT][2], float c2) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = neg_inf();
#pragma unroll
      for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // FAULT(prefill_row_max)
      const float m_new = fmaxf(m[mt][r], mx * c2);
      const bool moved = m_new != m[mt][r];  // m_new > m_old >= -inf: m_new is finite here
      // FAULT(prefill_rescale_vote)
      if (dev::warp_any(moved)) {
        const float alpha = moved ? exp2f(m[mt][r] - m_new) : 1.f;
        l[mt][r] *= alpha;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          o[mt][n][2 * r] *= alpha;
          o[mt][n][2 * r + 1] *= alpha;
        }
      }
      m[mt][r] = m_new;
      const float neg_m = m_new == neg_inf() ? 0.f : -m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NS; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float pr = exp2f(fmaf(s[mt][n][e], c2, neg_m));
          s[mt][n][e] = pr;
          sum += pr;  // fp32, as FlashAttention: lse exact to fp32
        }
      }
      l[mt][r] += sum;  // this lane's share; the quad's shares are added at the end
    }
}

// O += P V with the V tile vs [BN][LD]: P's A fragment for keys 16kk..16kk+15 is the accumulators of n-tiles 2kk and
// 2kk+1; each V fragment serves the MT m16 halves.
template <typename T, int D, int MT, int NS, int ND>
__device__ __forceinline__ void prefill_pv(float (&o)[MT][ND][4], const float (&s)[MT][NS][4], const T* vs) {
  constexpr int LD = D + 8, BN = NS * 8;
  const int tid = threadIdx.x, lane = tid % 32;
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
}

// This lane's rows of the query tile: O / l (times out_scale, fp8's v_scale) and the lse (m is in log2 units), with the
// attention sink (one more term in the denominator, no value); zeros and -inf for a row with no visible key.
template <typename T, int D, int MT, int ND>
__device__ __forceinline__ void prefill_write_out(const AttnParams& p, const PrefillBlock& blk,
                                                  const float (&o)[MT][ND][4], const float (&m)[MT][2],
                                                  const float (&l)[MT][2], float out_scale) {
  const int tid = threadIdx.x, t4 = tid % 32 % 4;
  const int kvh = blk.kvh, group = blk.group;
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
      const unsigned row = unsigned(blk.r0) + unsigned(prefill_lane_row<D>(mt, r));
      const unsigned tok = row / unsigned(group), hig = row - tok * unsigned(group);
      if (tok < unsigned(blk.q_len)) {
        const int h = kvh * group + static_cast<int>(hig);
        const int64_t oh = (blk.first + int64_t(tok)) * p.hq + h;
        // FAULT(prefill_lse)
        float lse2 = lr > 0.f ? m[mt][r] + log2f(lr) : neg_inf();  // log2 units, as m
        float w = 1.f;  // the attention sink: one more term in the denominator, no value (once per row, here)
        // FAULT(prefill_sink)
        if (p.sinks) lse2 = add_sink_log2(lse2, dev::ld_global(p.sinks + h) * kLog2e, w);
        const float lse = lse2 / kLog2e;  // natural log (-inf stays -inf)
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

// KV: the caches' element type, T (fp16/bf16) or uint8_t (float8_e4m3fn: staged as stored, converted once per CTA and
// tile into fp16 (MmaT) whatever T, one cvt per pair; bf16 queries go through warp_bf16_to_f16, P is fp16, the
// output T; key = stored * k_scale folded into the score scale, value = stored * v_scale into the output).
template <typename T, typename KV, int D, int BN>
__global__ void __launch_bounds__(prefill_threads(D), 1)
    window_attention_prefill_kernel(const AttnParams p, int stages) {
  constexpr bool kFp8 = sizeof(KV) == 1;
  static_assert(kFp8 || std::is_same_v<KV, T>, "16-bit caches have the query's dtype");
  using MmaT = std::conditional_t<kFp8, __half, T>;  // the MMA operands' type
  constexpr bool kQToFp16 = !std::is_same_v<MmaT, T>;
  constexpr int BM = prefill_rows(D), NT = prefill_threads(D), LD = D + 8;
  constexpr int WM = prefill_warp_rows(D), MT = WM / 16;  // packed rows per warp, its m16 halves
  constexpr int SLD = kFp8 ? D : LD;  // row stride of the ring's tiles, cache elements (fp8: unpadded)
  constexpr int NS = BN / 8;          // n8 tiles of S
  constexpr int ND = D / 8;           // n8 tiles of O
  static_assert(NT % BN == 0 && NS % 2 == 0 && ND % 2 == 0, "threads per key, n8 tile pairs");
  static_assert(!kFp8 || BN <= NT, "one thread per key copies the fp8 valid flags");
  AK_DYNAMIC_SHARED(T, smem);
  T* const q_s = smem;  // [BM][LD]
  // fp8: the fp16 K and V tiles [2 * BN][LD] the warps read (K rows, then V rows).
  MmaT* const cv_s = reinterpret_cast<MmaT*>(smem + BM * LD);
  // Ring stage s: K at kv_s + s * 2 * BN * SLD, V after it; fp8: then flag_s [stages][BN] (1: block id in range).
  KV* const kv_s = reinterpret_cast<KV*>(smem + prefill_tile_rows(D, BN, kFp8) * LD);
  uint8_t* const flag_s = reinterpret_cast<uint8_t*>(kv_s + stages * 2 * BN * SLD);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kvh = blockIdx.y;
  const int64_t b = blockIdx.z;
  // PDL (pdl.cuh): Q, cu_seqlens_q, seq_lens, block tables and K/V pages are written upstream, out and lse may still
  // be read there. Nothing above this line touches global memory.
  // FAULT(pdl_prefill_wait)
  dev::pdl_wait();
  // FAULT(prefill_zero_unowned)
  if (b == 0 || b == int64_t(gridDim.z) - 1) prefill_zero_unowned_rows<T, D>(p, b, kvh);
  const int bs = static_cast<int>(p.block_size);
  const int32_t* const table = p.block_table + b * p.max_blocks;

  // Tiles in reverse: CTAs start in blockIdx order, so the last query tiles (the most keys under a causal mask)
  // start first and the short ones fill in behind them (FlashAttention-2's causal load balancing).
  for (int64_t R0 = int64_t(gridDim.x - 1 - blockIdx.x) * BM; R0 < int64_t(prefill_q_len(p, b)) * p.group;
       R0 += int64_t(gridDim.x) * BM) {
    const PrefillBlock blk = prefill_block<BM, BN>(p, b, R0, kvh, bs, table);
    __syncthreads();  // the previous query tile's last reads of the ring and of q_s are done
    prefill_load_q<T, D>(p, blk, q_s);
    dev::cp_async_commit();  // group 0: the Q tile alone (the waits below count the tile groups after it)
    for (int i = 0; i < stages - 1; ++i) {
      if (i < blk.ntiles) prefill_load_tile<KV, D, BN>(p, blk, kv_s, flag_s, stages, i);
      dev::cp_async_commit();
    }
    float q_down = 1.f;  // 2^-e of the warp's Q scale (dev::warp_bf16_to_f16)
    if constexpr (kQToFp16) {
      if (blk.ntiles > 0) {  // CTA-uniform
        if (stages == 3) {
          dev::cp_async_wait<2>();
        } else {
          dev::cp_async_wait<1>();
        }
        __syncthreads();  // the Q tile landed for every thread's copies (its tile groups may still be in flight)
        // this warp's rows, which only it reads (ldmatrix of q_warp)
        q_down = dev::warp_bf16_to_f16<WM, D, LD>(reinterpret_cast<uint16_t*>(q_s) + warp * WM * LD);
      }
    }

    // Per-lane rows g and g + 8 of each m16 half mt of this warp: packed row R0 + prefill_lane_row<D>(mt, r).
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
    // The exponent's scale (prefill_scores): qk_scale log2(e), or with softcap, softcap log2(e) tanh(s qk_scale /
    // softcap) with the division folded in once per query tile; either times the warp's 2^-e of the Q scale.
    // FAULT(prefill_score_mul)
    const float score_mul = (p.softcap > 0.f ? qk_scale / p.softcap : qk_scale * kLog2e) * q_down;
    // ldmatrix.x4 row address of m16 half mt's A fragment (rows lane % 16, columns (lane / 16) * 8 of each k-step).
    const MmaT* const q_warp = reinterpret_cast<const MmaT*>(q_s) + (warp * WM + lane % 16) * LD + (lane / 16) * 8;

#pragma unroll 1
    for (int it = 0; it < blk.ntiles; ++it) {
      if (it + stages - 1 < blk.ntiles) prefill_load_tile<KV, D, BN>(p, blk, kv_s, flag_s, stages, it + stages - 1);
      dev::cp_async_commit();  // possibly empty: wait_group counts groups
      // FAULT(prefill_tile_wait)
      if (stages == 3) {
        dev::cp_async_wait<2>();
      } else {
        dev::cp_async_wait<1>();
      }
      __syncthreads();  // tile `it` (and at it == 0 the Q tile) landed for every thread's copies
      const KV* const ring = kv_s + (it % stages) * 2 * BN * SLD;
      const MmaT* ks;  // the K tile the warps read, [BN][LD]; the V tile follows it
      if constexpr (kFp8) {
        prefill_fp8_convert<MmaT, D, BN>(ring, flag_s, cv_s, it, stages);
        ks = cv_s;
      } else {
        ks = ring;
      }
      const MmaT* const vs = ks + BN * LD;
      const int j0 = blk.tile_first + it * BN;
      float s[MT][NS][4];
      prefill_qk<MmaT, D>(s, q_warp, ks);
      // The scale is the FFMA's (c2), not applied per score; formed per tile (registers: 251 with them kept).
      const bool fold = !(p.softcap > 0.f) && score_mul > 0.f;
      prefill_scores<MmaT, D, BN>(p, blk, s, ks, q_s, j0, fold, score_mul);
      prefill_online_softmax(s, o, m, l, fold ? score_mul : 1.f);
      prefill_pv<MmaT, D>(o, s, vs);
      // 16-bit caches: the warps read the ring stage itself, refilled by the next iteration's cp.async. fp8: they
      // read cv_s; the stage was free after the conversion's barrier, and the next conversion writes cv_s only after
      // the next iteration's first barrier, which every warp reaches after these reads.
      // FAULT(prefill_refill_sync)
      if constexpr (!kFp8) __syncthreads();
    }
    // PDL (pdl.cuh): this query tile's key loop is over (a CTA's first tile is normally its only one); once every CTA
    // has come here or exited, the successor's launch and prologue may overlap the write-outs.
    dev::pdl_launch_dependents();
    dev::cp_async_wait<0>();  // the prologue's groups when no tile was visited (Q, empty groups)
    // FAULT(prefill_out_scale)
    const float out_scale = kFp8 ? dev::ld_global(p.v_scale) : 1.f;  // fp8: value = stored * v_scale
    prefill_write_out<T, D>(p, blk, o, m, l, out_scale);
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
    return launch_pdl(prefill, grid, prefill_threads(D), plan.smem, stream, p, plan.stages);
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
