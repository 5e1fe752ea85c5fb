// window_attention decode: the split-KV combine of a thread-block cluster (sm_90); included by
// window_attention_decode.cuh (after combine_weights), never on its own. Design and estimates: docs/kernels.md
// ("Decode after issue 34").
//
// On sm_90 the split CTAs of one column (sequence, KV head, head chunk) form one cluster (grid.x = num_splits = the
// cluster's blocks, <= 16; rank = split): each keeps its fp32 partial (O normalised by its own sum, lse in log2
// units) in its own shared memory, the cluster barrier publishes them, and every CTA combines a fixed slice of the
// output from all partials read through distributed shared memory (DSMEM). No partial goes to global memory, no
// counter, no fence, no last-CTA election: the global path's tail (decode_arrive + combine_if_last: a release, the
// counter round trip, an acquire, then the partials from L2) becomes two cluster barriers and ~1 DSMEM round trip.
// Where the cluster path does not apply (sm_80, multi-query decode, splits that need more than 16 CTAs per column and
// cannot be capped, ARKERNELS_CLUSTER=0, a cubin without it, clusters that would not all be resident) the global path
// runs (csrc/cluster.cuh decides with the planner, decode_cluster_splits).
//
// Shared memory, reused from the warps' merge (decode_merge_warps: [4][16][D + 8] fp32 O, then [2][4][16] m, l):
// - warp 0's plane [16][D + 8] holds the CTA's partial in place: decode_write_out's thread for (row r, dim x) reads the
//   4 warps' O at (r, x) and writes the partial there (no other thread touches (r, x)); the row's lse (log2) goes to
//   the row's padding column D, which nothing else writes;
// - warp 1's plane (free once every thread passed the first cluster barrier) holds the combine's header: the splits'
//   weights [16][16] and each row's lse [16].
// Ownership: the [hc][D] output is hc D / 4 slots of 4 dims (16 bytes of fp32 partial); slot k is rank k % ns's. A
// CTA's 128 threads take its slots G at a time (G = ns rounded up to a power of two: thread (slot j, split s) =
// (tid / G, tid % G)); each loads split s's 16 bytes of its slot through DSMEM, weights them, and the G lanes sum by
// xor shuffles; lane s = 0 writes the 4 outputs (and the row's lse with its first slot). So every output byte is
// written once, by one CTA, and each CTA reads ns x (its slots) 16-byte DSMEM loads in one round (B = 1, 32/8 heads,
// D 128, 16 splits: hc = 4 rows -> 128 slots, 8 per CTA, 128 loads per CTA: one per thread).
#pragma once

namespace arkernels {

// The split count of the cluster path for `columns` CTAs per split whose one-wave plan (decode_splits) gave `splits`;
// 0: the global path. <= kClusterMax splits are a cluster as planned. More are capped to kClusterMax when the capped
// grid still puts a CTA on >= 90% of the SMs: the stream is HBM-bound and one CTA with its 2-3 tiles in flight
// (~64 KB at D 128) holds more than the ~23 KB per SM that saturates HBM (Little's law), so fewer, longer splits lose
// ~nothing on the stream while the tail loses its global round trips (B = 1, 8 KV heads, 132 SMs: 33 splits -> 16, 128
// CTAs). Else (few columns: 16 splits would leave SMs idle) the global path keeps the wave's split count.
inline int decode_cluster_splits(int64_t columns, int splits, const DeviceProps& props) {
  if (splits <= 1) return 0;
  if (splits <= kClusterMax) return splits;
  // FAULT(cluster_plan_fill)
  if (columns * kClusterMax * 10 >= int64_t(props.sm_count) * 9) return kClusterMax;
  return 0;
}

// Each row's split weights w_s [split][16] = 2^(lse_s - lse) and its lse (log2, the attention sink's term
// included) into lse_s [16]: one warp per row, lane s holding split s's lse (one DSMEM load from its CTA's padding
// column D): <= 16 splits fit a warp, so no loop over splits (combine_weights' loops for up to 64 cost ~80 LDS and
// ~40 MUFU static here).
template <int D>
__device__ __forceinline__ void decode_cluster_weights(const AttnParams& p, const DecodeRows& rows,
                                                       const float* part_s, float* w_s, float* lse_s, int ns) {
  constexpr int MLD = kDecodeMergeLd<D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows.hc; r += kDecodeWarps) {  // uniform per warp
    // FAULT(cluster_lse_rank)
    const float ls = lane < ns ? dev::ld_dsmem(part_s + r * MLD + D, unsigned(lane)) : neg_inf();
    float m = ls;
#pragma unroll
    for (int o = 8; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));  // lanes 0-15: the splits
    // FAULT(cluster_sink)
    const float sink2 = p.sinks ? dev::ld_global(p.sinks + decode_row<false>(p, rows, r).head) * kLog2e : neg_inf();
    m = fmaxf(m, sink2);
    float sum = m != neg_inf() && ls != neg_inf() ? exp2f(ls - m) : 0.f;
#pragma unroll
    for (int o = 8; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sink2 != neg_inf()) sum += exp2f(sink2 - m);  // once: every lane holds the sum already
    const float lse = sum > 0.f ? m + log2f(sum) : neg_inf();
    if (lane < ns) w_s[lane * kDecodeRows + r] = sum > 0.f && ls != neg_inf() ? exp2f(ls - lse) : 0.f;
    if (lane == 0) lse_s[r] = lse;
  }
}

// The combine of one cluster (every thread of every CTA calls it after decode_write_out wrote the CTA's partial into
// its shared memory; see the header). Two cluster barriers: before the first DSMEM load (every partial written: a
// release / acquire) and before exit (no CTA's shared memory goes away while another still reads it).
template <typename T, int D>
__device__ __forceinline__ void decode_cluster_combine(const AttnParams& p, const DecodeRows& rows,
                                                       unsigned char* smem) {
#if AK_CLUSTER_CODE
  constexpr int MLD = kDecodeMergeLd<D>;
  constexpr int kSlotsPerRow = D / 4;
  const float* part_s = reinterpret_cast<const float*>(smem);       // [16][MLD]: partial O, lse (log2) at column D
  float* w_s = reinterpret_cast<float*>(smem) + kDecodeRows * MLD;  // [16][16] the splits' weights (warp 1's plane)
  float* lse_s = w_s + kClusterMax * kDecodeRows;                   // [16] each row's lse, log2 units
  const int tid = threadIdx.x, hc = rows.hc;
  const int ns = int(dev::cluster_nctarank()), rank = int(dev::cluster_ctarank());
  // FAULT(cluster_first_sync)
  dev::cluster_sync();  // every CTA's partial and lse are in its shared memory (a release / acquire)
  decode_cluster_weights<D>(p, rows, part_s, w_s, lse_s, ns);
  __syncthreads();  // the weights and the rows' lse
  const int g = ns <= 2 ? 2 : ns <= 4 ? 4 : ns <= 8 ? 8 : 16;  // lanes per slot: a power of two >= ns
  const int s = tid % g;                                        // the split this thread loads
  const int nslots = hc * kSlotsPerRow;
  // FAULT(cluster_owner)
  const int mine = (nslots - rank + ns - 1) / ns;  // this CTA's slots: rank, rank + ns, ...
  for (int j0 = 0; j0 < mine; j0 += kAttnThreads / g) {  // uniform: every lane takes part in the shuffles
    const int j = j0 + tid / g;
    const bool live = j < mine;
    const int slot = rank + j * ns;
    const int r = live ? slot / kSlotsPerRow : 0, c4 = slot - r * kSlotsPerRow;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    const float w = live && s < ns ? w_s[s * kDecodeRows + r] : 0.f;
    if (w != 0.f) {  // an empty split's partial is 0 and its weight 0; skipping keeps a 0 x inf out
      // FAULT(cluster_part_rank)
      const float4 v = dev::ld_dsmem(reinterpret_cast<const float4*>(part_s + r * MLD + 4 * c4), unsigned(s));
      x = make_float4(w * v.x, w * v.y, w * v.z, w * v.w);
    }
    for (int o = g / 2; o > 0; o /= 2) {
      x.x += __shfl_xor_sync(0xffffffffu, x.x, o);
      x.y += __shfl_xor_sync(0xffffffffu, x.y, o);
      x.z += __shfl_xor_sync(0xffffffffu, x.z, o);
      x.w += __shfl_xor_sync(0xffffffffu, x.w, o);
    }
    if (live && s == 0) {
      const int64_t oh = decode_row<false>(p, rows, r).oh;
      const uint2 v = make_uint2(pack_pair<T>(x.x, x.y), pack_pair<T>(x.z, x.w));
      dev::st_global(reinterpret_cast<uint2*>(static_cast<T*>(p.out) + oh * D + 4 * c4), v);
      if (c4 == 0) dev::st_global(p.lse + oh, lse_s[r] / kLog2e);  // natural log (-inf stays -inf)
    }
  }
  // No CTA exits while another may still read its shared memory. Relaxed: this barrier publishes nothing (nothing is
  // read after it); every DSMEM load above has completed before its thread arrives (its value was consumed by the
  // shuffles), and a release here would make every thread wait for its output stores' acknowledgement first (the
  // release is a MEMBAR.ALL.GPU in the SASS: ~one L2 round trip of tail).
  // FAULT(cluster_last_sync)
  dev::cluster_sync_relaxed();
#else
  (void)p, (void)rows, (void)smem;
#endif
}

}  // namespace arkernels
