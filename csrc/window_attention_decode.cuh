// window_attention decode kernel and its launch planning; included by window_attention_kernels.cuh (after the shared
// definitions), never on its own. Design, arithmetic and measured SASS figures: docs/kernels.md ("Decode").
//
// Decode (cu_seqlens_q None, one query per sequence at i = seq_len - 1): window_attention_decode_kernel, FlashInfer's
// tensor-core decode structure. Grid (num_splits, Hkv * head_chunks, batch), 128 threads = 4 warps. A CTA owns one KV
// head, up to 16 of its query heads (the M = 16 rows of mma.m16n8k16, zero-padded) and one split of the visible range
// [max(kv_start, i - W + 1, chunk start, 0), i]: each visible K/V byte is read once per KV head (and 16 query heads).
// K/V move in 64-key tiles through a ring of 1..4 cp.async stages (rows of D + 8 elements, fp8: D + 16 bytes), each
// warp owning 16 keys of a tile: S = Q K^T, online softmax and O += P V in registers; the 4 warps merge through shared
// memory. num_splits comes from shapes only (one wave of CTAs, graph-capturable); with num_splits > 1 the last split
// CTA of each column (an epoch-stamped counter, decode_arrive) merges the fp32 (out, lse) partials (combine_if_last),
// published by one thread's release after the CTA barrier and acquired by the last CTA's one thread (combine_arrive);
// on sm_90 the split CTAs of a column are instead one thread-block cluster that combines the partials from each
// other's shared memory (decode_cluster_combine, window_attention_decode_cluster.cuh: <= 16 splits, no global
// partials, no counters).
// fp8 caches are staged as stored and converted in the MMA operand registers, into fp16 (bf16 queries: times a power
// of two per CTA, folded into the score scale). The issue-34 arithmetic (SASS counts, estimates, no GPU):
// docs/kernels.md, "Decode after issue 34": B = 1, 8k, 32/8 heads, D 128, bf16 est. 11-13.5 us (58-70% of copy)
// with the global combine; with the sm_90 cluster combine (16 splits) est. 10.3-12.8 us (61-76%), estimate, no GPU.
// Multi-query decode (cu_seqlens_q given, 1 <= max_q_len <= kDecodeMaxQueries: speculative verification): the same
// kernel, its M = 16 rows the packed (query row t, query head of the GQA group) pairs R = t * group + head, so the
// k + 1 query rows of a sequence share every staged K/V tile (FlashInfer's way); head_chunks =
// ceil(max_q_len * group / 16).
// A CTA's key loop covers the union of its rows' visible ranges and each row masks the keys outside its own range
// (decode_row_range); decode (one query per sequence) is the case q_len = 1.
// Shared memory per CTA: stages x 2 x 64 x (D + 8) x 2 B (K, V ring) + the query tile and the per-tile key offsets.
// Resource use: `python scripts/sass_report.py` prints the current registers, shared memory, occupancy and instruction
// counts of every instantiation (CI fails on any spill).
#pragma once

#include "cluster.cuh"

namespace arkernels {

constexpr int kDecodeTileKeys = 64;                 // keys per pipeline stage: 16 per warp
// Multi-query decode takes calls with cu_seqlens_q when 1 <= max_q_len <= kDecodeMaxQueries and max_q_len x group <=
// kDecodeMaxPackedRows (at most 4 head chunks: each chunk stages the sequence's K/V tiles again, an L2 read, where the
// prefill kernel's 64- or 128-row tile stages them once; the rule's reasoning: docs/kernels.md, "Decode").
// Head dims up to kDecodeMaxQueryHeadDim: at D = 256 the multi-query instantiation spilled (sm_90, 254 registers and
// more; docs/kernels.md), so those calls stay on prefill and that instantiation is never compiled.
constexpr int kDecodeMaxQueries = 8;
constexpr int kDecodeMaxPackedRows = 64;
constexpr int kDecodeMaxQueryHeadDim = 128;
__host__ __device__ constexpr bool use_multiquery_decode(int64_t max_q_len, int64_t group, int64_t d) {
  return max_q_len >= 1 && max_q_len <= kDecodeMaxQueries && max_q_len * group <= kDecodeMaxPackedRows &&
         d <= kDecodeMaxQueryHeadDim;
}
constexpr int kDecodeRows = 16;                     // query heads per CTA: the M of mma.m16n8k16
constexpr int kDecodeWarps = kAttnThreads / 32;     // 4; warp w owns keys [16w, 16w + 16) of every tile
constexpr int kDecodeMaxStages = 4;
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;
// A masked key's K/V offset (decode's koff_s / voff_s): the sign marks it masked, and the other bits are 0, so
// `offset & kOffBits` is 0 for it -- a copy's source address stays inside the cache while the copy zero-fills and
// reads nothing -- and the offset itself for a visible key (offsets are >= 0).
constexpr int64_t kMaskedOff = -0x7fffffffffffffffll - 1;
constexpr int64_t kOffBits = 0x7fffffffffffffffll;

// Dynamic shared memory of a decode CTA (bytes): `stages` K/V tile pairs as stored (rows padded by 16 bytes: 16-bit
// rows of D + 8 elements, fp8 rows of D + 16 bytes), the query tile, per-stage K offsets (their sign is the key's
// validity) and the V offsets of the tiles resolved but not yet issued (decode_voff_sets: the prologue resolves all its
// tiles at once); at least what the final merge of
// the 4 warps reuses it for ([4][16][D + 8] fp32 O and [2][4][16] m, l). One formula for the kernel and the plan.
// V offsets are kept for the tiles resolved but not yet issued: the prologue's stages - 1 at most (1 with 1 stage).
__host__ __device__ constexpr int decode_voff_sets(int stages) { return stages > 1 ? stages - 1 : 1; }
template <int D>
constexpr int kDecodeMergeLd = D + 8;  // fp32 row stride of the warps' merge buffer (padded: conflict-free stores)
struct DecodeLayout {
  int ld;                 // row stride of the 16-bit Q tile, elements: D + 8
  int stage_ld;           // row stride of a stage's K and V tiles, cache elements: D + 8 (16-bit) or D + 16 (fp8):
                          // 16 bytes of skew, so the 8 rows of an ldmatrix hit distinct banks
  size_t stage, off_q, off_koff, off_voff, smem;
};
__host__ __device__ constexpr DecodeLayout decode_layout(int d, int stages, bool fp8 = false) {
  DecodeLayout l{d + 8, fp8 ? d + 16 : d + 8, 0, 0, 0, 0, 0};
  l.stage = size_t(2) * kDecodeTileKeys * l.stage_ld * (fp8 ? 1 : 2);  // K tile + V tile as stored
  l.off_q = size_t(stages) * l.stage;
  l.off_koff = l.off_q + size_t(kDecodeRows) * l.ld * 2;      // Q tile [16][ld]
  l.off_voff = l.off_koff + size_t(stages) * kDecodeTileKeys * 8;
  const size_t merge = size_t(kDecodeWarps) * kDecodeRows * (d + 8 + 2) * 4;  // [4][16][D + 8] O, [2][4][16] m, l
  l.smem = l.off_voff + size_t(decode_voff_sets(stages)) * kDecodeTileKeys * 8;
  l.smem = l.smem < merge ? merge : l.smem;
  return l;
}

// 2 e4m3 bytes (low byte first) -> a pair of T in one register (decode's operands; prefill's per-CTA conversion);
// exact for both fp16 and bf16 (e4m3 has 4 exponent bits and 3 mantissa bits, subnormals down to 2^-9).
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    uint32_t r;
    memcpy(&r, &h, 4);
    return r;
  } else {
    return pack_pair<T>(__half2float(__half(__half_raw{h.x})), __half2float(__half(__half_raw{h.y})));
  }
}

// fp8 fragments straight from the staged tiles (decode and prefill): ldmatrix moves 16-bit words, so on e4m3 rows a lane gets
// 4 bytes where an fp16 operand would have 2 elements, and the layouts are matched by permutations instead of a
// conversion pass through shared memory.
// - K (non-trans, rows = keys): lane (g, t4) gets dims 4 t4 .. 4 t4 + 3 of key g in a 16-dim k-step; as the B
//   fragment of Q K^T they stand at k = 2 t4, 2 t4 + 1 (low pair) and 2 t4 + 8, 2 t4 + 9 (high pair). The sum over k
//   does not care about the order as long as Q follows it: the query tile stores dim fp8_k_dim(c) at column c.
__host__ __device__ constexpr int fp8_k_dim(int c) {  // c in [0, 16): the dim at mma column c of a k-step
  return c < 8 ? 4 * (c / 2) + c % 2 : 4 * ((c - 8) / 2) + 2 + c % 2;
}
__host__ __device__ constexpr int fp8_k_col(int dim) {  // its inverse: the mma column of dim (in [0, 16))
  return dim % 4 < 2 ? 2 * (dim / 4) + dim % 4 : 8 + 2 * (dim / 4) + dim % 4 - 2;
}
// One ldmatrix register of e4m3 K (dims 4 t4 .. 4 t4 + 3 of one key) -> the B fragment of one k-step.
template <typename T>
__device__ __forceinline__ void fp8_k_frag(uint32_t r, uint32_t (&b)[2]) {
  b[0] = fp8x2_to<T>(uint16_t(r));
  b[1] = fp8x2_to<T>(uint16_t(r >> 16));
}
// - V (.trans, rows = keys): lane (g, t4) gets bytes {key 2 t4: dims 2g, 2g + 1; key 2 t4 + 1: dims 2g, 2g + 1} of a
//   16-dim block; one byte permute gives the key pair of dim 2g (low half) and of dim 2g + 1 (high half), each the
//   B fragment half of an 8-column block whose column n is dim 2n (even block) or 2n + 1 (odd block). So a 32-dim
//   chunk of V is one ldmatrix.x4.trans -> O blocks 4c + {0, 1, 2, 3} at dims 32c + {0, 1, 16, 17} + 2n, and the
//   merge puts O's columns back in place (fp8_o_dim).
__host__ __device__ constexpr int fp8_o_dim(int block, int n) {  // dim of column n of O block `block` (fp8 path)
  return (block / 4) * 32 + (block % 4 >= 2 ? 16 : 0) + block % 2 + 2 * n;
}
// O += P V for the even and odd 8-column blocks of one 16-dim block of e4m3 V, from its two ldmatrix.trans registers
// (keys 0-7, keys 8-15); pa: P's A fragment.
template <typename T>
__device__ __forceinline__ void fp8_pv(float (&o_even)[4], float (&o_odd)[4], const uint32_t (&pa)[4],
                                       uint32_t lo_keys, uint32_t hi_keys) {
  // FAULT(fp8_pv_permute)
  const uint32_t p0 = __byte_perm(lo_keys, 0u, 0x3120u), p1 = __byte_perm(hi_keys, 0u, 0x3120u);
  const uint32_t be[2] = {fp8x2_to<T>(uint16_t(p0)), fp8x2_to<T>(uint16_t(p1))};
  const uint32_t bo[2] = {fp8x2_to<T>(uint16_t(p0 >> 16)), fp8x2_to<T>(uint16_t(p1 >> 16))};
  dev::mma_m16n8k16<T>(o_even, pa, be, o_even);
  dev::mma_m16n8k16<T>(o_odd, pa, bo, o_odd);
}

// cp.async.wait_group n for a run-time n in [0, 2 * kDecodeMaxStages - 1].
__device__ __forceinline__ void cp_async_wait_n(int n) {
  switch (n) {
    case 0: dev::cp_async_wait<0>(); break;
    case 1: dev::cp_async_wait<1>(); break;
    case 2: dev::cp_async_wait<2>(); break;
    case 3: dev::cp_async_wait<3>(); break;
    case 4: dev::cp_async_wait<4>(); break;
    case 5: dev::cp_async_wait<5>(); break;
    case 6: dev::cp_async_wait<6>(); break;
    default: dev::cp_async_wait<7>(); break;
  }
}

// One more softmax term with no value, the attention sink (log2 units; -inf: none), added to a state whose output was
// normalised by its own sum: returns the new lse (log2 units) and sets w, the factor that output takes (0 when the
// state had no key, lse2 = -inf: the output stays 0 and the lse is the sink's).
__device__ __forceinline__ float add_sink_log2(float lse2, float sink2, float& w) {
  const float m = fmaxf(lse2, sink2);
  if (m == neg_inf()) {  // no key and no sink
    w = 0.f;
    return m;
  }
  const float total = m + log2f(exp2f(lse2 - m) + exp2f(sink2 - m));
  w = exp2f(lse2 - total);
  return total;
}

// The multi-query path reads cu_seqlens_q as prefill does (clamped to [0, rows]: check=False callers) and, like it,
// writes zeros to the query rows no sequence owns (window_attention_prefill.cuh, included after this file).
__device__ __forceinline__ int64_t prefill_first_row(const AttnParams& p, int64_t b);
__device__ __forceinline__ int prefill_q_len(const AttnParams& p, int64_t b);
template <typename T, int D>
__device__ __forceinline__ void prefill_zero_unowned_rows(const AttnParams& p, int64_t b, int kvh);

// A decode CTA's query rows: the packed rows m0 .. m0 + hc - 1 of sequence b, packed row R = t * group + h standing for
// query row q0 + t and query head kvh * group + h (decode: q0 = b, q_len = 1, so R = h).
struct DecodeRows {
  int64_t q0;  // the sequence's first query row
  int qlen;    // its query rows
  int kvh;     // the KV head
  int m0, hc;  // this CTA's first packed row and its row count (rows hc .. 15 of the tile are padding)
};
struct DecodeRow {
  int t;       // the query's index in its sequence
  int head;    // its query head
  int64_t oh;  // its (row, head) index into out / lse / the partials: (q0 + t) * hq + head
};
// kMulti: the multi-query instantiation of the kernel; without it q_len is 1 and R = h, no division.
template <bool kMulti>
__device__ __forceinline__ DecodeRow decode_row(const AttnParams& p, const DecodeRows& rows, int r) {
  if constexpr (!kMulti) {
    const int head = rows.kvh * p.group + rows.m0 + r;
    return {0, head, rows.q0 * p.hq + head};
  } else {
    const int m = rows.m0 + r, t = m / p.group;
    const int head = rows.kvh * p.group + (m - t * p.group);
    return {t, head, (rows.q0 + t) * p.hq + head};
  }
}

// Split-KV completion counters that no failed launch can poison. A launch with epoch e (window_attention_launch.h:
// one more than the last launch on these counters; epochs only grow) owns the counter values
// [e * kMaxSplits, e * kMaxSplits + num_splits]: each split CTA of a column first lifts the column's counter to
// e * kMaxSplits (atomic max: a no-op once the first CTA of the launch did it), then adds 1; the CTA that sees
// e * kMaxSplits + num_splits - 1 before its add is the last. Whatever an earlier launch left -- num_splits arrivals
// after a good launch, fewer after one that aborted (a trap, an illegal address, a cancelled graph: some CTAs never
// arrived) -- is at most (e - 1) * kMaxSplits + kMaxSplits = e * kMaxSplits, so the max erases it and no later launch
// depends on an earlier one having finished. Nothing resets the counters (no second kernel, no memset per call);
// the max and the add are one thread's atomics on one address, which the memory model keeps in program order.
// (The issue's form, counts compared against (epoch + 1) * num_splits - 1 on counters that are never lifted, would
// let the arrivals an aborted launch left behind count for the next one.) CUDA graphs: a captured launch's epoch is
// frozen, so a capture allocates its own counters, zeroed by a memset node at every replay (split_counters): each
// replay starts clean whatever the previous replay did.
// The add is a release (atom.add.release.gpu): the caller, one thread after a __syncthreads, publishes every thread's
// partials with it (a release is cumulative). The max stays relaxed: it carries no data.
__device__ __forceinline__ bool decode_arrive(const AttnParams& p, unsigned long long* counter) {
  const unsigned long long base = p.epoch * kMaxSplits;
  // FAULT(split_arrive)
  dev::atomic_max(counter, base);
  // FAULT(split_release)
  return dev::atomic_add_release(counter, 1ull) == base + p.num_splits - 1;
}

// Split-KV combine, fused: the split CTAs of one (sequence, KV head, head chunk) count themselves done on their
// counter after publishing their partials (decode_arrive); the last one merges them -- lse = log2 (sum_s 2^lse_s +
// 2^sink), out = sum_s 2^(lse_s - lse) out_s (sink: the head's attention sink in log2 units, -inf without).
// Publication is one thread's: __syncthreads, then thread 0's release add (decode_arrive), and in the last CTA thread
// 0's acquire (fence.acq_rel.gpu) before the __syncthreads that lets every thread read (CUTLASS's GenericBarrier).
// Two MEMBAR.SC.GPU + CCTL.IVALL by all 128 threads of every CTA did this before (est. 0.5-1 us more tail).
// The partials of other CTAs are read through L2 (ld.global.cg / cp.async.cg: L1 is not coherent across SMs), and
// every load is issued before any is used, so the tail costs about one L2 round trip per round, not one per split:
// the weights first (every split's lse of this CTA's rows: <= 64 x 16 scalar loads, 8 per thread, all in flight),
// then the outputs as 16-byte cp.async straight into shared memory (no registers held), as many splits per round as
// the CTA's shared memory holds (smem_bytes: the CTA's dynamic shared memory, free again: every warp passed the
// merge's reads); the weights are computed while the first round lands.
// Fixed ownership: thread tid owns the 16-byte slots tid + 128 k of the [hc][D] output (row slot / (D / 4), dims
// 4 (slot % (D / 4)) .. + 3, a compile-time divisor, once per kernel); it copies exactly those slots of every split
// (one 64-bit add, one LDGSTS per copy: the run-time division by hc D / 4 of a loop over every copy cost ~33 SASS per
// copy, ~1100 issue slots per thread at 33 splits), sums them from shared memory (LDS.128, conflict-free) and writes
// them: it reads only what it copied, so a round needs no barrier.
// B = 1, 32/8 heads, D 128, bf16 (hc = 4 rows, 2 KB of partial per split): 52 splits per round in a 108.8 KB CTA, so
// up to 64 splits take 2 rounds (the one-wave plan gives 33: 1 round, 33 copies per thread).
// Every byte of every partial is read exactly once (tests/test_window_attention_decode_tail.py counts them).
// Its header: the weights [64][16], then per row its (row, head) index (8 bytes), its head and its lse (4 + 4 bytes),
// then the last-arrival flag.
constexpr size_t kCombineHeader =
    ((kMaxSplits * kDecodeRows + 2 * kDecodeRows + 1) * 4 + kDecodeRows * 8 + 15) / 16 * 16;

// Thread 0 counts the CTA done (decode_arrive, after the barrier: its release publishes every thread's partials) and
// the last CTA's thread 0 acquires them; returns whether this CTA is the last, to every thread (after a barrier, which
// also orders every thread's loads after the acquire). Each row's (row, head) index and head into oh_s / head_s.
template <bool kMulti>
__device__ __forceinline__ bool combine_arrive(const AttnParams& p, int64_t b, const DecodeRows& rows, int64_t* oh_s,
                                               int* head_s, int* last_s) {
  const int tid = threadIdx.x;
  // FAULT(split_fence)
  __syncthreads();  // every thread's partials are stored (and the merge's shared-memory reads are over)
  if (tid == 0) {
    const bool last = decode_arrive(p, p.counters + b * gridDim.y + blockIdx.y);
    // FAULT(split_acquire)
    if (last) dev::fence_acq_rel();  // the acquire: the partials every release before the count published
    *last_s = last;
  }
  if (tid < rows.hc) {
    const DecodeRow row = decode_row<kMulti>(p, rows, tid);
    oh_s[tid] = row.oh;
    head_s[tid] = row.head;
  }
  __syncthreads();  // the flag, the rows, and every thread's loads after thread 0's acquire
  return *last_s != 0;
}

// The weights of the splits for the CTA's hc rows from their lse in w_s [ns][16] (log2), in place, and each row's lse
// into lse_s: one warp per row, lanes over splits.
__device__ __forceinline__ void combine_weights(const AttnParams& p, int hc, int ns, float* w_s, const int* head_s,
                                                float* lse_s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < hc; r += kDecodeWarps) {
    float m = neg_inf();
    for (int s = lane; s < ns; s += 32) m = fmaxf(m, w_s[s * kDecodeRows + r]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    // The attention sink joins the head's denominator here, once (the splits' partials leave it out): one more
    // term 2^sink2 with no value, added by lane 0 before the sum over lanes.
    // FAULT(combine_sink_head)
    const float sink2 = p.sinks ? dev::ld_global(p.sinks + head_s[r]) * kLog2e : neg_inf();
    m = fmaxf(m, sink2);
    float sum = 0.f;
    if (m != neg_inf())
      for (int s = lane; s < ns; s += 32) sum += exp2f(w_s[s * kDecodeRows + r] - m);
    // FAULT(combine_sink)
    if (lane == 0 && sink2 != neg_inf()) sum += exp2f(sink2 - m);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float lse = sum > 0.f ? m + log2f(sum) : neg_inf();
    for (int s = lane; s < ns; s += 32) {
      const float ls = w_s[s * kDecodeRows + r];
      w_s[s * kDecodeRows + r] = sum > 0.f && ls != neg_inf() ? exp2f(ls - lse) : 0.f;
    }
    if (lane == 0) lse_s[r] = lse;
  }
}

template <typename T, int D, bool kMulti>
__device__ __forceinline__ void combine_if_last(const AttnParams& p, int64_t b, const DecodeRows& rows,
                                                unsigned char* smem, size_t smem_bytes) {
  const int tid = threadIdx.x;
  const int hc = rows.hc;
  float* w_s = reinterpret_cast<float*>(smem);   // [num_splits][16]: the splits' lse (log2), then their weights
  int64_t* oh_s = reinterpret_cast<int64_t*>(w_s + kMaxSplits * kDecodeRows);  // [16] each row's (row, head) index
  int* head_s = reinterpret_cast<int*>(oh_s + kDecodeRows);  // [16] each row's query head
  float* lse_s = reinterpret_cast<float*>(head_s + kDecodeRows);  // [16] lse, log2 units
  int* last_s = reinterpret_cast<int*>(lse_s + kDecodeRows);
  float* part_s = reinterpret_cast<float*>(smem + kCombineHeader);  // [splits of a round][hc D / 4] 16-byte slots
  if (!combine_arrive<kMulti>(p, b, rows, oh_s, head_s, last_s)) return;
  const int ns = p.num_splits;
  const int64_t stride = p.rows * p.hq;  // part_*[s][oh]: split s, (row, head) index oh
  // Weights first: entry (split tid / 16 + 8 k, row tid % 16) of w_s [64][16], 8 per thread (rows past hc: none).
  constexpr int kLse = kMaxSplits * kDecodeRows / kAttnThreads;
  const int lr = tid % kDecodeRows, ls0 = tid / kDecodeRows;
  const bool lrow = lr < hc;
  const float* lse_src = p.part_lse + (lrow ? oh_s[lr] : 0);
  float lv[kLse];
#pragma unroll
  for (int k = 0; k < kLse; ++k) {
    const int s = ls0 + k * (kAttnThreads / kDecodeRows);
    lv[k] = lrow && s < ns ? dev::ld_global_cg(lse_src + s * stride) : neg_inf();
  }
  // This thread's slots: slot tid + 128 k (live: < hc D / 4) is row slot / (D / 4), dims 4 (slot % (D / 4)) .. + 3;
  // src[k]: its place in split 0's partial.
  constexpr int kSlots = (kDecodeRows * D / 4 + kAttnThreads - 1) / kAttnThreads;
  const int row4 = hc * D / 4;  // 16-byte slots of one split's partial
  const float* src[kSlots];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int slot = tid + k * kAttnThreads, r = slot / (D / 4);
    // FAULT(mq_combine_rows)
    src[k] = p.part_out + (slot < row4 ? oh_s[r] * D + 4 * (slot - r * (D / 4)) : 0);
  }
  const int per_round = min(ns, int((smem_bytes - kCombineHeader) / (size_t(row4) * 16)));
  const int64_t split_step = stride * D;  // floats from one split's partial to the next
  auto issue = [&](int s0) {  // this thread's slots of splits s0 .. s0 + per_round - 1 (at most ns)
    const int n = min(per_round, ns - s0);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      if (tid + k * kAttnThreads >= row4) break;  // live slots are a prefix of k
      const float* from = src[k] + s0 * split_step;
      float* dst = part_s + 4 * (tid + k * kAttnThreads);
      for (int s = 0; s < n; ++s) {  // a copy: the LDGSTS and two address adds
        dev::cp_async_16(dst, from, 16);
        from += split_step;
        dst += 4 * row4;
      }
    }
    dev::cp_async_commit();
  };
  issue(0);
  // The weights, while the round lands.
#pragma unroll
  for (int k = 0; k < kLse; ++k) {
    const int s = ls0 + k * (kAttnThreads / kDecodeRows);
    if (lrow && s < ns) w_s[s * kDecodeRows + lr] = lv[k];
  }
  __syncthreads();  // every split's lse
  combine_weights(p, hc, ns, w_s, head_s, lse_s);
  __syncthreads();  // the weights and the rows' lse
  float acc[kSlots][4];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.f;
  for (int s0 = 0; s0 < ns; s0 += per_round) {
    // Only this thread's copies are read: its wait suffices, and the next round overwrites only slots it has read.
    if (s0 > 0) issue(s0);
    dev::cp_async_wait_all();
    const int n = min(per_round, ns - s0);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int slot = tid + k * kAttnThreads;
      if (slot < row4) {
        const int r = slot / (D / 4);
        // FAULT(combine_splits)
        for (int s = 0; s < n; ++s) {
          // FAULT(combine_weights)
          const float w = w_s[(s0 + s) * kDecodeRows + r];
          if (w != 0.f) {  // an empty split's partial is 0 and its weight 0; skipping keeps a 0 x inf out
            const float4 x = *reinterpret_cast<const float4*>(part_s + 4 * (s * row4 + slot));
            acc[k][0] += w * x.x;
            acc[k][1] += w * x.y;
            acc[k][2] += w * x.z;
            acc[k][3] += w * x.w;
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int slot = tid + k * kAttnThreads;
    if (slot < row4) {
      const int r = slot / (D / 4), c4 = slot - r * (D / 4);
      const int64_t oh = oh_s[r];
      const uint2 v = make_uint2(pack_pair<T>(acc[k][0], acc[k][1]), pack_pair<T>(acc[k][2], acc[k][3]));
      dev::st_global(reinterpret_cast<uint2*>(static_cast<T*>(p.out) + oh * D + 4 * c4), v);
      if (c4 == 0) dev::st_global(p.lse + oh, lse_s[r] / kLog2e);  // natural log (-inf stays -inf)
    }
  }
}

}  // namespace arkernels

#include "window_attention_decode_cluster.cuh"

namespace arkernels {

// ------------------------------------------------------------------------------------------------ decode
// The decode kernel's steps, in the order it runs them: decode_load_q (the query rows into registers), decode_cta (this
// split's keys and their page math), decode_resolve + decode_issue_tile (a tile's cache offsets, then its cp.async
// copies), decode_store_q (the query tile), then per key tile decode_qk (S = Q K^T), decode_online_softmax (S -> P,
// running max and sum, O rescaled) and decode_pv (O += P V); decode_merge_warps + decode_write_out merge the 4 warps
// and write the output (or the split's partial), and combine_if_last (decode_cluster_combine in a cluster) merges the
// splits.

// Q's A fragments stay in registers for the whole key loop up to D = 128 (D = 256: 64 more registers would spill).
template <int D>
constexpr bool kDecodeQInRegs = D <= 128;
// 16-byte query chunks per thread: the [16][D] tile over 128 threads.
template <int D>
constexpr int kDecodeQPer = (kDecodeRows * D / 8 + kAttnThreads - 1) / kAttnThreads;

// A decode CTA's keys and the shared memory that stages them: the offset slots of the ring, the split's key range and
// the page math that locates a key.
struct DecodeCta {
  unsigned char* smem;    // the K/V ring: stage s at smem + s * decode_layout(D, 1, fp8).stage, K tile then V tile
  int64_t* koff_s;        // [stages][64] K offsets of the staged tiles (their sign: kMaskedOff, the key is masked)
  int64_t* voff_s;        // [decode_voff_sets(stages)][64] V offsets of the tiles resolved but not yet issued
  int stages;             // ring depth, 1..kDecodeMaxStages
  int kvh;                // the KV head
  int64_t s_lo, s_hi;     // this split's keys [s_lo, s_hi] (whole tiles: splits never share a tile)
  int rlo[2], rhi[2];     // visible keys of this thread's rows g and g + 8, relative to s_lo (empty: rlo > rhi)
  int ntiles;             // its 64-key tiles (0: no visible key)
  int32_t bs;             // block_size (clamped to int32)
  int bs_shift;           // log2(bs) when bs is a power of two (page math by shifts), else -1
  const int32_t* table;   // the sequence's block-table row
};

// The CTA's query rows (decode_row) into registers: chunk idx of the [16][D] tile (8 elements each) is row
// idx / (D / 8), columns 8 (idx % (D / 8)) .. + 7; zeros for the padding rows. The kernel issues them first: they
// depend on nothing it loads, so they are in flight with seq_len's (the chain before the first K/V copy is seq_len ->
// block table -> cp.async, the query off it).
template <typename T, int D, bool kMulti, int QPer>
__device__ __forceinline__ void decode_load_q(const AttnParams& p, const DecodeRows& rows, uint4 (&qv)[QPer]) {
  constexpr int kQChunks = kDecodeRows * D / 8;
  const int tid = threadIdx.x;
#pragma unroll
  for (int k = 0; k < QPer; ++k) {
    const int idx = tid + k * kAttnThreads, r = idx / (D / 8), c = idx % (D / 8);
    qv[k] = make_uint4(0, 0, 0, 0);
    if (idx < kQChunks && r < rows.hc) {
      // FAULT(mq_row_head)
      const DecodeRow row = decode_row<kMulti>(p, rows, r);
      const T* src = static_cast<const T*>(p.query) + (rows.q0 + row.t) * p.s.q0 + row.head * p.s.q1 + c * 8;
      if (p.q_vec) {
        qv[k] = dev::ld_global(reinterpret_cast<const uint4*>(src));
      } else {
        T e[8];
#pragma unroll
        for (int x = 0; x < 8; ++x) e[x] = dev::ld_global(src + x);
        memcpy(&qv[k], e, 16);
      }
    }
  }
}

// Query t of a sequence of length seq_len with q_len queries sits at i = seq_len - q_len + t whatever the block table
// holds (keys past the table, check=False, are masked); it sees keys [lo, hi] (empty: lo > hi).
__device__ __forceinline__ void decode_row_range(const AttnParams& p, int64_t seq_len, int64_t kv_start, int qlen,
                                                 int t, int64_t& lo, int64_t& hi) {
  // FAULT(mq_row_position)
  const int64_t i = seq_len - qlen + t;
  // FAULT(decode_first_key)
  lo = window_attention_first_key<int64_t>(i, kv_start, p.window, p.chunk);  // window, kv_start and chunk bounds
  // FAULT(mq_row_causal)
  hi = min64(i, p.max_blocks * p.block_size - 1);
}

// Split `split` of `nsplits` of the union of the visible ranges of the CTA's rows (decode: the one query's
// [max(kv_start, i - W + 1, chunk start, 0), i]) for KV head rows.kvh, each of this thread's rows' own range within it,
// and the shared-memory views of the ring's offset slots (lay: decode_layout(D, stages, fp8)). A row's range only
// moves up with t, so the union is [lo of the first row, hi of the last]; keys in it that a row does not see (the
// later rows' newer keys, the earlier rows' older keys under a window or chunk) are masked per element.
template <bool kMulti>
__device__ __forceinline__ DecodeCta decode_cta(const AttnParams& p, unsigned char* smem, const DecodeLayout& lay,
                                                int stages, int64_t b, const DecodeRows& rows, int split,
                                                int nsplits) {
  const int64_t seq_len = dev::ld_global(p.seq_lens + b);
  const int64_t kv_start = p.kv_start ? dev::ld_global(p.kv_start + b) : 0;
  int64_t lo, hi, unused;
  decode_row_range(p, seq_len, kv_start, rows.qlen, decode_row<kMulti>(p, rows, 0).t, lo, unused);
  // FAULT(mq_union_hi)
  decode_row_range(p, seq_len, kv_start, rows.qlen, decode_row<kMulti>(p, rows, rows.hc - 1).t, unused, hi);
  const int64_t n = hi - lo + 1;                                  // keys in the union (<= 0: none)
  // This split's keys: whole tiles, so splits never share a tile.
  const int64_t tiles = n > 0 ? (n + kDecodeTileKeys - 1) / kDecodeTileKeys : 0;
  // FAULT(decode_per_split)
  const int64_t per_split = (tiles + nsplits - 1) / nsplits;
  DecodeCta cta;
  cta.smem = smem;
  cta.koff_s = reinterpret_cast<int64_t*>(smem + lay.off_koff);
  cta.voff_s = reinterpret_cast<int64_t*>(smem + lay.off_voff);
  cta.stages = stages;
  cta.kvh = rows.kvh;
  cta.s_lo = lo + split * per_split * kDecodeTileKeys;
  cta.s_hi = min64(hi, cta.s_lo + per_split * kDecodeTileKeys - 1);
  cta.ntiles = cta.s_hi >= cta.s_lo ? int((cta.s_hi - cta.s_lo) / kDecodeTileKeys + 1) : 0;
  // Multi-query: this thread's rows g and g + 8, their ranges relative to s_lo, clamped to [-1, 2^31 - 1] (a key's
  // index in the split is in [0, 2^31)); padding rows see nothing. (Decode: every row sees the whole split.)
  if constexpr (kMulti) {
    const int g = threadIdx.x % 32 / 4;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int r = g + 8 * x;
      int64_t rl = 1, rh = 0;
      if (r < rows.hc) decode_row_range(p, seq_len, kv_start, rows.qlen, decode_row<kMulti>(p, rows, r).t, rl, rh);
      cta.rlo[x] = int(max64(-1, min64(rl - cta.s_lo, 0x7fffffff)));
      cta.rhi[x] = int(max64(-1, min64(rh - cta.s_lo, 0x7fffffff)));
    }
  }
  // Page math in 32 bits (key positions are int32 by source): a shift when block_size is a power of two.
  const int32_t bs = int32_t(min64(p.block_size, 0x7fffffff));
  int bs_shift = 0;
  while (bs_shift < 31 && (int32_t(1) << bs_shift) < bs) ++bs_shift;
  if ((int32_t(1) << bs_shift) != bs) bs_shift = -1;
  cta.bs = bs;
  cta.bs_shift = bs_shift;
  cta.table = p.block_table + b * p.max_blocks;
  return cta;
}

// Offsets of key k of tile t (key s_lo + 64 t + k) into koff_s[kslot][k] / voff_s[vslot][k] (kslot = t % stages,
// vslot = t % vsets: the callers track them without a division); kMaskedOff when masked. A V slot is reused
// stages - 1 tiles later, after at least one barrier (the one closing the prologue, or those of a loop trip).
__device__ __forceinline__ void decode_resolve(const AttnParams& p, const DecodeCta& cta, int t, int k, int kslot,
                                               int vslot) {
  const int kvh = cta.kvh;
  const int32_t bs = cta.bs, bs_shift = cta.bs_shift;
  const int64_t j = cta.s_lo + int64_t(t) * kDecodeTileKeys + k;
  int64_t ko = kMaskedOff, vo = kMaskedOff;
  if (t < cta.ntiles && j <= cta.s_hi) {
    const int32_t j32 = int32_t(j);
    const int32_t jb = bs_shift >= 0 ? (j32 >> bs_shift) : j32 / bs;
    const int32_t jo = bs_shift >= 0 ? (j32 & (bs - 1)) : j32 - jb * bs;
    const int64_t blk = dev::ld_global(cta.table + jb);
    if (blk >= 0 && blk < p.num_blocks) {
      // FAULT(decode_kv_offsets)
      ko = blk * p.s.k0 + jo * p.s.k1 + kvh * p.s.k2;
      vo = blk * p.s.v0 + jo * p.s.v1 + kvh * p.s.v2;
    }
  }
  cta.koff_s[kslot * kDecodeTileKeys + k] = ko;
  cta.voff_s[vslot * kDecodeTileKeys + k] = vo;
}

// One tensor's tile (K or V) into dst from the offsets offs[64] (live: the tile exists), one commit group (an empty
// one past the last tile keeps the group count uniform for the waits).
// Fixed (key, chunk) ownership of the tile copies: copy i of this thread moves chunk own_c(i) of key own_k(i) of
// every tile, K and V alike, so the shared-memory destination, the column and the offset slot depend on the thread
// only (computed once per kernel: a base register plus immediates when 128 % chunks == 0, every D but 80 and 96),
// and a copy costs its key's offset load (LDS.64), the validity test, the 64-bit address add and the LDGSTS; the
// src-size arithmetic and the per-copy index math of a loop over idx are gone. Consecutive threads still cover
// whole rows (8 per 128-byte fp8 row at D = 128, 16 per 16-bit row), so each warp-wide copy moves 4 (2) whole rows,
// coalesced as before, and each visible byte is still copied once per tile.
template <typename KV, int D>
__device__ __forceinline__ void decode_copy_tile(unsigned char* dst, const KV* src, const int64_t* offs, bool live) {
  constexpr int SLD = decode_layout(D, 1, sizeof(KV) == 1).stage_ld;
  constexpr int kChunks = D * int(sizeof(KV)) / 16;  // 16-byte chunks per cached row
  constexpr int kChunkElems = 16 / int(sizeof(KV));
  constexpr int kOwn = (kDecodeTileKeys * kChunks + kAttnThreads - 1) / kAttnThreads;  // copies per thread, tensor, tile
  constexpr bool kOwnAffine = kAttnThreads % kChunks == 0;  // chunk fixed, key + 128 / chunks per copy
  const int tid = threadIdx.x;
  auto own_k = [&](int i) {
    return kOwnAffine ? tid / kChunks + i * (kAttnThreads / kChunks) : (tid + i * kAttnThreads) / kChunks;
  };
  auto own_c = [&](int i) { return kOwnAffine ? tid % kChunks : (tid + i * kAttnThreads) % kChunks; };
  auto own_live = [&](int i) {  // D = 80 fp8 (5 chunks): the last copy of threads >= 64 has no chunk
    return kDecodeTileKeys * kChunks % kAttnThreads == 0 || i + 1 < kOwn ||
           tid + i * kAttnThreads < kDecodeTileKeys * kChunks;
  };
  if (live) {
    int64_t o[kOwn];  // sign set: masked, and o & kOffBits = 0 (the cache's first row, never read)
#pragma unroll
    // FAULT(decode_copy_offsets)
    for (int i = 0; i < kOwn; ++i) o[i] = own_live(i) ? offs[own_k(i)] : kMaskedOff;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      if (own_live(i)) {
        const int k = own_k(i), c = own_c(i);
        dev::cp_async_16_or_zero(dst + (k * SLD + c * kChunkElems) * int(sizeof(KV)),
                                 // FAULT(decode_masked_copy)
                                 src + (o[i] & kOffBits) + c * kChunkElems, o[i] >= 0);
      }
    }
  }
  dev::cp_async_commit();
}

// The copies of a tile into ring stage kslot from the offsets of koff_s[kslot] / voff_s[vslot] (live: the tile
// exists): K, then V, each its own commit group.
template <typename KV, int D>
__device__ __forceinline__ void decode_issue_tile(const AttnParams& p, const DecodeCta& cta, bool live, int kslot,
                                                  int vslot) {
  constexpr DecodeLayout L = decode_layout(D, 1, sizeof(KV) == 1);
  unsigned char* k_dst = cta.smem + kslot * L.stage;
  // FAULT(decode_k_copy)
  decode_copy_tile<KV, D>(k_dst, static_cast<const KV*>(p.k_cache), cta.koff_s + kslot * kDecodeTileKeys, live);
  decode_copy_tile<KV, D>(k_dst + kDecodeTileKeys * L.stage_ld * int(sizeof(KV)), static_cast<const KV*>(p.v_cache),
                          cta.voff_s + vslot * kDecodeTileKeys, live);
}

// fp8 caches under bf16 queries: the MMAs run in fp16 with Q times 2^e, one e per CTA (every warp reads every query
// row), chosen by prefill's rule (dev::bf16_f16_pow2: the largest |q| into fp16's top binade, all 8 significant bits
// of every value down to 2^-29 of it kept) and 2^-e folded into the score scale: exact, a power of two. In registers,
// before the query tile is stored, so no pass over shared memory and no barrier beyond the prologue's:
// decode_q_max (before it) puts each warp's largest |q| (bf16 bits) into max_s[warp]; decode_q_to_f16 (after it)
// converts this thread's chunks and returns 2^-e.
template <int QPer>
__device__ __forceinline__ void decode_q_max(const uint4 (&qv)[QPer], int* max_s) {
  int mx = 0;
#pragma unroll
  for (int k = 0; k < QPer; ++k)
    for (const uint32_t x : {qv[k].x, qv[k].y, qv[k].z, qv[k].w}) mx = max(mx, int(dev::bf16x2_abs_max_bits(x)));
#pragma unroll
  for (int d = 1; d < 32; d *= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  if (threadIdx.x % 32 == 0) max_s[threadIdx.x / 32] = mx;
}
template <int QPer>
__device__ __forceinline__ float decode_q_to_f16(uint4 (&qv)[QPer], const int* max_s) {
  int mx = max_s[0];
#pragma unroll
  // FAULT(decode_q_cta_max)
  for (int w = 1; w < kDecodeWarps; ++w) mx = max(mx, max_s[w]);
  const int e = dev::bf16_f16_pow2(uint32_t(mx));
  const float up = dev::pow2f(e);
#pragma unroll
  for (int k = 0; k < QPer; ++k)
    qv[k] = make_uint4(dev::bf16x2_to_f16x2(qv[k].x, up), dev::bf16x2_to_f16x2(qv[k].y, up),
                       dev::bf16x2_to_f16x2(qv[k].z, up), dev::bf16x2_to_f16x2(qv[k].w, up));
  return dev::pow2f(-e);
}

// The query tile [16][LD] from its registers (decode_load_q's chunks); fp8: each dim at its mma column (fp8_k_col),
// the order in which the K fragments hold the dims.
template <typename T, int D, bool kFp8, int QPer>
__device__ __forceinline__ void decode_store_q(const uint4 (&qv)[QPer], T* q_s) {
  constexpr int LD = decode_layout(D, 1, kFp8).ld, kQChunks = kDecodeRows * D / 8;
  const int tid = threadIdx.x;
#pragma unroll
  for (int k = 0; k < QPer; ++k) {
    const int idx = tid + k * kAttnThreads, r = idx / (D / 8), c = idx % (D / 8);
    if (idx < kQChunks) {
      if constexpr (kFp8) {  // each dim at its mma column (fp8_k_col)
        T e[8];
        memcpy(e, &qv[k], 16);
#pragma unroll
        // FAULT(decode_fp8_q_cols)
        for (int x = 0; x < 8; ++x) q_s[r * LD + (c / 2) * 16 + fp8_k_col((c % 2) * 8 + x)] = e[x];
      } else {
        *reinterpret_cast<uint4*>(q_s + r * LD + c * 8) = qv[k];
      }
    }
  }
}

// S = Q K^T for this warp's 16 keys of the staged K tile k_s: two 8-key blocks, s[nb] = {S[g][8nb + 2t4 + {0,1}],
// S[g+8][8nb + 2t4 + {0,1}]}. Q's A fragments from registers (qf) or, at D = 256, from the query tile (q_lane).
// k_row, k_col: this lane's ldmatrix row and column in a 16-bit K tile; v_row, f_col: in an fp8 tile.
// Four accumulation chains, not two: key block nb's even k-steps accumulate in s[nb], its odd ones in s1[nb], and
// S = s + s1 at the end (each score: the fp32 sum over the even 16-dim k-steps plus the sum over the odd ones), so
// the 2 x D / 16 dependent HMMA of a tile become 4 chains of D / 32 (D 128: ~250 -> ~125 clk of chain latency).
template <typename T, typename KV, int D, int QF>
__device__ __forceinline__ void decode_qk(float (&s)[2][4], const uint32_t (&qf)[QF][4], const T* q_lane,
                                          const KV* k_s, int k_row, int k_col, int v_row, int f_col) {
  constexpr bool kFp8 = sizeof(KV) == 1, kQInRegs = kDecodeQInRegs<D>;
  constexpr int SLD = decode_layout(D, 1, kFp8).stage_ld, kKSteps = D / 16;
  float s1[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  auto qk = [&](int ks, const uint32_t (&b0)[2], const uint32_t (&b1)[2]) {
    float (&acc)[2][4] = ks % 2 == 0 ? s : s1;  // ks is a compile-time constant once unrolled
    if constexpr (kQInRegs) {
      dev::mma_m16n8k16<T>(acc[0], qf[ks], b0, acc[0]);
      dev::mma_m16n8k16<T>(acc[1], qf[ks], b1, acc[1]);
    } else {
      uint32_t a[4];
      dev::ldmatrix_x4(a, q_lane + ks * 16);
      dev::mma_m16n8k16<T>(acc[0], a, b0, acc[0]);
      dev::mma_m16n8k16<T>(acc[1], a, b1, acc[1]);
    }
  };
  if constexpr (kFp8) {  // two k-steps per ldmatrix.x4 (registers: {key block 0, 1} x {k-step ks, ks + 1})
#pragma unroll
    for (int ks = 0; ks < kKSteps; ks += 2) {
      uint32_t kf[4] = {0u, 0u, 0u, 0u};
      if (ks + 1 < kKSteps) {
        dev::ldmatrix_x4(kf, k_s + v_row * SLD + ks * 16 + f_col);
      } else {  // D = 80: the last k-step alone
        uint32_t two[2];
        dev::ldmatrix_x2(two, k_s + v_row * SLD + ks * 16);
        kf[0] = two[0];
        kf[1] = two[1];
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (ks + h < kKSteps) {
          uint32_t b0[2], b1[2];
          fp8_k_frag<T>(kf[2 * h], b0);
          fp8_k_frag<T>(kf[2 * h + 1], b1);
          qk(ks + h, b0, b1);
        }
      }
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t kf[4];
      dev::ldmatrix_x4(kf, k_s + k_row * SLD + ks * 16 + k_col);
      const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
      qk(ks, b0, b1);
    }
  }
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      // FAULT(decode_qk_chains)
      s[nb][x] += s1[nb][x];
    }
}

// One tile's scores for rows g and g + 8 in log2 units: times mul, softcapped (kCapped: cap tanh(s mul), cap the
// softcap times log2(e), mul the scale over the softcap) and masked (ko: the warp's 16 key offsets, negative when
// masked; k0: the index of its first key in the split, and a key outside the row's own range, cta.rlo / cta.rhi, is
// masked too); mx: the rows' maxima over this thread's scores. The softcap is a compile-time variant chosen once per
// tile by a uniform branch (prefill's way): with it off no tanh / division takes an issue slot.
template <bool kCapped, bool kMulti>
__device__ __forceinline__ void decode_scores(float (&s)[2][4], float (&mx)[2], const int64_t* ko, int k0,
                                              const DecodeCta& cta, float mul, float cap) {
  const int t4 = threadIdx.x % 32 % 4;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      float v = s[nb][x] * mul;
      if constexpr (kCapped) v = cap * tanhf(v);
      // Key k0 + c of the split (c: this element's column) is staged (its offset's sign) and, multi-query, in the
      // row's own range.
      const int c = nb * 8 + 2 * t4 + (x & 1), r = x / 2;
      bool seen = ko[c] >= 0;
      if constexpr (kMulti) {
        // FAULT(mq_row_mask)
        seen = seen && k0 + c >= cta.rlo[r] && k0 + c <= cta.rhi[r];
      }
      v = seen ? v : neg_inf();
      s[nb][x] = v;
      mx[x / 2] = fmaxf(mx[x / 2], v);
    }
}

// Online softmax over one tile for rows g and g + 8 (log2 units): S scored (decode_scores: mul, cap), the running max
// m_run and this thread's partial sum l_run updated, O rescaled by 2^(m_old - m_new), and P = 2^(S - m) packed as the
// A fragment pa of O += P V (16 heads x 16 keys).
template <typename T, bool kMulti, int NB>
__device__ __forceinline__ void decode_online_softmax(float (&s)[2][4], float (&o)[NB][4], float (&m_run)[2],
                                                      float (&l_run)[2], const int64_t* ko, int k0,
                                                      const DecodeCta& cta, float mul, float cap, uint32_t (&pa)[4]) {
  float mx[2] = {neg_inf(), neg_inf()};
  // FAULT(decode_softcap)
  if (cap > 0.f) {
    decode_scores<true, kMulti>(s, mx, ko, k0, cta, mul, cap);
  } else {
    decode_scores<false, kMulti>(s, mx, ko, k0, cta, mul, cap);
  }
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    // FAULT(decode_row_max)
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m_run[r], mx[r]);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;  // no visible key yet: p = 0, nothing to rescale
    alpha[r] = exp2f(m_run[r] - m_use);
    m_run[r] = m_new;
    mx[r] = m_use;
  }
  float rs[2] = {0.f, 0.f};
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      s[nb][x] = exp2f(s[nb][x] - mx[x / 2]);
      rs[x / 2] += s[nb][x];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rs[r];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    // FAULT(decode_o_rescale)
    o[nb][0] *= alpha[0];
    o[nb][1] *= alpha[0];
    o[nb][2] *= alpha[1];
    o[nb][3] *= alpha[1];
  }
  // P as the A fragment (16 heads x 16 keys): a[0] = P[g][2t4..], a[1] = P[g+8][2t4..], a[2] = P[g][2t4+8..],
  // a[3] = P[g+8][2t4+8..] -- the S accumulators of key blocks 0 and 1.
  pa[0] = pack_pair<T>(s[0][0], s[0][1]);
  pa[1] = pack_pair<T>(s[0][2], s[0][3]);
  pa[2] = pack_pair<T>(s[1][0], s[1][1]);
  pa[3] = pack_pair<T>(s[1][2], s[1][3]);
}

// O += P V for this warp's 16 keys of the staged V tile v_s (o[nb]: {O[g][8nb + 2t4 + {0,1}], O[g+8][...]}; fp8: O
// block nb holds the dims fp8_o_dim(nb, .)). v_row, v_col: this lane's ldmatrix.trans row and column in a 16-bit V
// tile; v_row, f_col: in an fp8 tile.
template <typename T, typename KV, int D, int NB>
__device__ __forceinline__ void decode_pv(float (&o)[NB][4], const uint32_t (&pa)[4], const KV* v_s, int v_row,
                                          int v_col, int f_col) {
  constexpr bool kFp8 = sizeof(KV) == 1;
  constexpr int SLD = decode_layout(D, 1, kFp8).stage_ld, kKSteps = D / 16;
  if constexpr (kFp8) {  // 32 dims per ldmatrix.x4.trans: O blocks 4c .. 4c + 3 (fp8_o_dim)
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      uint32_t vf[4];
      dev::ldmatrix_x4_trans(vf, v_s + v_row * SLD + c * 32 + f_col);
      fp8_pv<T>(o[4 * c], o[4 * c + 1], pa, vf[0], vf[1]);
      fp8_pv<T>(o[4 * c + 2], o[4 * c + 3], pa, vf[2], vf[3]);
    }
    if constexpr (D % 32 != 0) {  // D = 80: the last 16 dims
      uint32_t vf[2];
      dev::ldmatrix_x2_trans(vf, v_s + v_row * SLD + (D / 32) * 32);
      fp8_pv<T>(o[4 * (D / 32)], o[4 * (D / 32) + 1], pa, vf[0], vf[1]);
    }
  } else {
#pragma unroll
    for (int dp = 0; dp < kKSteps; ++dp) {  // columns [16 dp, 16 dp + 16): two 8-column blocks
      uint32_t vf[4];
      // FAULT(decode_v_ldmatrix)
      dev::ldmatrix_x4_trans(vf, v_s + v_row * SLD + dp * 16 + v_col);
      const uint32_t b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
      dev::mma_m16n8k16<T>(o[2 * dp], pa, b0, o[2 * dp]);
      dev::mma_m16n8k16<T>(o[2 * dp + 1], pa, b1, o[2 * dp + 1]);
    }
  }
}

// The first half of merging the 4 warps' (m, l, O): each warp's state into shared memory (the tile ring, drained), O
// as [4][16][MLD] fp32 rows, then [4][16] m and [4][16] l (l summed over the row's quad first); decode_write_out
// reads them after the closing barrier.
template <int D, bool kFp8, int NB>
__device__ __forceinline__ void decode_merge_warps(unsigned char* smem, const float (&o)[NB][4],
                                                   const float (&m_run)[2], float (&l_run)[2]) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  dev::cp_async_wait_all();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  __syncthreads();
  // Rows of MLD = D + 8 floats: a warp's 8-byte stores (lane: row g, dims 2 t4, 2 t4 + 1) fall in 32 distinct banks per
  // half-warp (g MLD = 8 g mod 32), where rows of D floats put all 8 rows g on the same banks (8-way conflicts).
  constexpr int MLD = kDecodeMergeLd<D>;
  float* mo_s = reinterpret_cast<float*>(smem);                               // [4][16][MLD]
  float* ml_s = mo_s + kDecodeWarps * kDecodeRows * MLD;                      // [4][16] m, then [4][16] l
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    float* row0 = mo_s + (warp * kDecodeRows + g) * MLD;
    if constexpr (kFp8) {  // dims 2 apart (fp8_o_dim): scalar stores
      // FAULT(decode_fp8_o_dims)
      const int d0 = fp8_o_dim(nb, 2 * t4), d1 = fp8_o_dim(nb, 2 * t4 + 1);
      row0[d0] = o[nb][0];
      row0[d1] = o[nb][1];
      row0[8 * MLD + d0] = o[nb][2];
      row0[8 * MLD + d1] = o[nb][3];
    } else {
      const int d0 = nb * 8 + 2 * t4;
      *reinterpret_cast<float2*>(row0 + d0) = make_float2(o[nb][0], o[nb][1]);
      *reinterpret_cast<float2*>(row0 + 8 * MLD + d0) = make_float2(o[nb][2], o[nb][3]);
    }
  }
  if (t4 == 0) {
    ml_s[warp * kDecodeRows + g] = m_run[0];
    ml_s[warp * kDecodeRows + g + 8] = m_run[1];
    ml_s[kDecodeWarps * kDecodeRows + warp * kDecodeRows + g] = l_run[0];
    ml_s[kDecodeWarps * kDecodeRows + warp * kDecodeRows + g + 8] = l_run[1];
  }
  __syncthreads();
}

// The second half of the merge, for the CTA's hc rows from decode_merge_warps' buffers: M = max m_w,
// L = sum l_w 2^(m_w - M), O = sum O_w 2^(m_w - M) / L (times v_scale), written as the output and its lse (one split)
// or as this split's fp32 partial, lse in log2 units (combine_if_last merges them): to global memory, or in a cluster
// into warp 0's plane of the merge buffer, in place, with the lse at the row's padding column D
// (decode_cluster_combine reads them there).
template <typename T, int D, bool kMulti>
__device__ __forceinline__ void decode_write_out(const AttnParams& p, unsigned char* smem, const DecodeRows& rows,
                                                 int split, int nsplits, bool cluster, float v_scale) {
  constexpr int MLD = kDecodeMergeLd<D>;
  float* mo_s = reinterpret_cast<float*>(smem);                               // [4][16][MLD]
  const float* ml_s = mo_s + kDecodeWarps * kDecodeRows * MLD;                // [4][16] m, then [4][16] l
  const int tid = threadIdx.x;
  for (int idx = tid; idx < rows.hc * D; idx += kAttnThreads) {
    const int r = idx / D, x = idx % D;
    const DecodeRow row = decode_row<kMulti>(p, rows, r);
    float mw[kDecodeWarps], big = neg_inf();
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      mw[w] = ml_s[w * kDecodeRows + r];
      big = fmaxf(big, mw[w]);
    }
    float l = 0.f, acc = 0.f;
    if (big != neg_inf()) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float f = exp2f(mw[w] - big);
        l += ml_s[kDecodeWarps * kDecodeRows + w * kDecodeRows + r] * f;
        acc += mo_s[(w * kDecodeRows + r) * MLD + x] * f;
      }
    }
    float lse2 = l > 0.f ? big + log2f(l) : neg_inf();  // log2 units
    float w = 1.f;
    // The attention sink joins the denominator once: here when this CTA holds the whole key range, else in the
    // combine (a partial that added it too would count it num_splits + 1 times).
    // FAULT(decode_sink_here)
    const bool sink_here = p.sinks != nullptr && nsplits == 1;
    if (sink_here) lse2 = add_sink_log2(lse2, dev::ld_global(p.sinks + row.head) * kLog2e, w);
    const float inv = l > 0.f ? w / l : 0.f;
    const int64_t oh = row.oh;
    if (nsplits == 1) {
      // FAULT(decode_out_scale)
      dev::st_global(static_cast<T*>(p.out) + oh * D + x, Conv<T>::from_float(acc * inv * v_scale));
      if (x == 0) dev::st_global(p.lse + oh, lse2 / kLog2e);  // natural log (partials: log2)
    } else if (cluster) {  // (r, x) of warp 0's plane: only this thread read it (above)
      mo_s[r * MLD + x] = acc * inv * v_scale;
      if (x == 0) mo_s[r * MLD + D] = lse2;
    } else {
      dev::st_global(p.part_out + (split * p.rows * p.hq + oh) * D + x, acc * inv * v_scale);
      if (x == 0) dev::st_global(p.part_lse + split * p.rows * p.hq + oh, lse2);
    }
  }
}

// One pass of a decode CTA: rows of sequence b against split `split` of `nsplits` of their keys, written as the output
// (nsplits = 1) or as the split's partial, merged by the column's last split CTA, or (cluster: the column's split CTAs
// are one thread-block cluster) by the cluster together.
template <typename T, typename KV, int D, bool kMulti>
__device__ __forceinline__ void decode_attend(const AttnParams& p, unsigned char* smem, const int stages, int64_t b,
                                              const DecodeRows& rows, int split, int nsplits, bool cluster) {
  constexpr bool kFp8 = sizeof(KV) == 1;
  // The MMA operands' type: fp8 caches run in fp16 whatever T (e4m3 -> f16x2 is one cvt per pair, into bf16 four;
  // P in fp16 is finer than in bf16), bf16 queries scaled into fp16 (decode_q_to_f16), as prefill does.
  using MmaT = std::conditional_t<kFp8, __half, T>;
  constexpr bool kQToFp16 = !std::is_same_v<MmaT, T>;
  constexpr DecodeLayout L = decode_layout(D, 1, kFp8);
  constexpr int LD = L.ld, SLD = L.stage_ld;
  constexpr int kKSteps = D / 16;  // k-steps of Q K^T, and pairs of 8-column blocks of P V
  constexpr bool kQInRegs = kDecodeQInRegs<D>;
  const DecodeLayout lay = decode_layout(D, stages, kFp8);
  T* q_s = reinterpret_cast<T*>(smem + lay.off_q);
  const int vsets = decode_voff_sets(stages);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  uint4 qv[kDecodeQPer<D>];
  decode_load_q<T, D, kMulti>(p, rows, qv);
  const DecodeCta cta = decode_cta<kMulti>(p, smem, lay, stages, b, rows, split, nsplits);

  // Prologue: the offsets of tiles 0 .. stages-2 resolved together (their block-table loads all in flight: one round
  // trip, not one per tile), the query tile [16][LD] stored from its registers, then every prologue tile's copies.
  // bf16 queries of fp8 caches: each warp's largest |q| into the Q tile's row-0 padding (never read by ldmatrix).
  int* q_max_s = reinterpret_cast<int*>(q_s + D);
  if constexpr (kQToFp16) decode_q_max(qv, q_max_s);
  for (int idx = tid; idx < (stages - 1) * kDecodeTileKeys; idx += kAttnThreads)
    decode_resolve(p, cta, idx / kDecodeTileKeys, idx % kDecodeTileKeys, idx / kDecodeTileKeys,
                   idx / kDecodeTileKeys);  // t < vsets
  __syncthreads();  // the prologue's offsets (and the warps' |q| maxima) are ready
  float q_down = 1.f;  // 2^-e of the CTA's Q scale (kQToFp16)
  if constexpr (kQToFp16) q_down = decode_q_to_f16(qv, q_max_s);
  decode_store_q<T, D, kFp8>(qv, q_s);
  for (int t = 0; t < stages - 1; ++t) decode_issue_tile<KV, D>(p, cta, t < cta.ntiles, t, t);
  __syncthreads();  // q_s is stored; tile 0's V offsets are read before loop trip 0 resolves tile stages - 1 over them
  // A fragments of Q (lane: rows g and g + 8, columns 2 t4 + {0, 1, 8, 9} of each k-step), from ldmatrix.x4: lane l
  // addresses row l % 16 at column 8 (l / 16).
  uint32_t qf[kQInRegs ? kKSteps : 1][4];
  const MmaT* q_lane = reinterpret_cast<const MmaT*>(q_s) + (lane % 16) * LD + (lane / 16) * 8;
  if constexpr (kQInRegs) {
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) dev::ldmatrix_x4(qf[ks], q_lane + ks * 16);
  }

  // Per-warp state for rows g and g + 8: running max (log2 units), this thread's partial row sum, O fragments
  // (8-column block nb: {O[g][8nb + 2t4 + {0,1}], O[g+8][8nb + 2t4 + {0,1}]}).
  float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
  float o[2 * kKSteps][4];
#pragma unroll
  for (int nb = 0; nb < 2 * kKSteps; ++nb)
#pragma unroll
    for (int x = 0; x < 4; ++x) o[nb][x] = 0.f;
  // fp8: key = stored * k_scale, so the scores of the stored keys take scale * k_scale; value = stored * v_scale.
  // The scores' factor (decode_scores): the scale (times k_scale and the Q scale's 2^-e) times log2(e), or with softcap
  // over the softcap, the division folded in once per CTA.
  const float k_scale = kFp8 ? dev::ld_global(p.k_scale) : 1.f, v_scale = kFp8 ? dev::ld_global(p.v_scale) : 1.f;
  // FAULT(decode_q_down)
  const float qk_scale = p.scale * k_scale * q_down;
  const float cap = p.softcap > 0.f ? p.softcap * kLog2e : 0.f;
  const float score_mul = p.softcap > 0.f ? qk_scale / p.softcap : qk_scale * kLog2e;
  // ldmatrix lane addressing inside a warp's 16 keys: K (non-trans): matrix l / 8 = (key half, column half) ->
  // key (l / 16) * 8 + l % 8, column ((l / 8) % 2) * 8; V (.trans): matrix l / 8 = (column half, key half) ->
  // key ((l / 8) % 2) * 8 + l % 8, column (l / 16) * 8.
  const int k_row = warp * 16 + (lane / 16) * 8 + lane % 8, k_col = ((lane / 8) % 2) * 8;
  const int v_row = warp * 16 + ((lane / 8) % 2) * 8 + lane % 8, v_col = (lane / 16) * 8;
  // fp8 (K and V alike): matrix l / 8 = (key half, 16-byte column half) -> key ((l / 8) % 2) * 8 + l % 8, byte
  // column (l / 16) * 16: registers {keys 0-7, keys 8-15} x {first 16 dims, next 16 dims}.
  const int f_col = (lane / 16) * 16;

  // Ring positions without divisions: tile t is in stage st = t % stages; tile t + stages - 1, resolved and issued in
  // trip t, goes to stage st_new = (t + stages - 1) % stages with its V offsets in set vs_new = (t + stages - 1) % vsets.
  int st = 0, st_new = stages - 1, vs_new = 0;
  for (int t = 0; t < cta.ntiles; ++t) {
    if (tid < kDecodeTileKeys) decode_resolve(p, cta, t + stages - 1, tid, st_new, vs_new);
    __syncthreads();  // tile t-1 fully consumed (its stage is reused now), offsets of tile t + stages - 1 ready
    decode_issue_tile<KV, D>(p, cta, t + stages - 1 < cta.ntiles, st_new, vs_new);
    // FAULT(decode_k_wait)
    cp_async_wait_n(2 * stages - 1);  // K of tile t landed (this thread's copies) ...
    // FAULT(decode_k_sync)
    __syncthreads();                  // ... and everyone's
    const KV* k_s = reinterpret_cast<const KV*>(smem + st * lay.stage);
    const KV* v_s = k_s + kDecodeTileKeys * SLD;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    decode_qk<MmaT, KV, D>(s, qf, q_lane, k_s, k_row, k_col, v_row, f_col);
    uint32_t pa[4];
    decode_online_softmax<MmaT, kMulti>(s, o, m_run, l_run, cta.koff_s + st * kDecodeTileKeys + warp * 16,
                                        t * kDecodeTileKeys + warp * 16, cta, score_mul, cap, pa);
    cp_async_wait_n(2 * stages - 2);  // V of tile t landed
    __syncthreads();
    decode_pv<MmaT, KV, D>(o, pa, v_s, v_row, v_col, f_col);
    st = st + 1 == stages ? 0 : st + 1;
    // FAULT(decode_ring_advance)
    st_new = st_new + 1 == stages ? 0 : st_new + 1;
    vs_new = vs_new + 1 == vsets ? 0 : vs_new + 1;
  }
  // PDL (pdl.cuh): the key loop is over; the successor's launch and prologue may overlap the merge, write-out, combine.
  // FAULT(pdl_decode_trigger)
  dev::pdl_launch_dependents();

  decode_merge_warps<D, kFp8>(smem, o, m_run, l_run);
  decode_write_out<T, D, kMulti>(p, smem, rows, split, nsplits, cluster, v_scale);
  if (nsplits == 1) return;
  if constexpr (!kMulti) {
    if (cluster) return decode_cluster_combine<T, D>(p, rows, smem);
  }
  combine_if_last<T, D, kMulti>(p, b, rows, smem, lay.smem);
}

// KV: the cache's element type, T (fp16/bf16) or uint8_t (float8_e4m3fn: staged as stored, converted to T in the
// MMA operand registers (fp8_k_dim, fp8_o_dim), key = stored * k_scale folded into the score scale, value = stored *
// v_scale into the output).
// __launch_bounds__(threads, 1): without the minimum, ptxas capped some sm_80 fp8 kernels below the registers they
// need and spilled (sass_report fails on any spill; the figures: docs/kernels.md). The CTAs per SM come from shared
// memory and the planner (decode_ctas_per_sm), not from this bound.
// kMulti: the multi-query instantiation (cu_seqlens_q given: use_multiquery_decode), its own so that decode's code
// keeps none of its row bookkeeping (the per-row masks, the cu_seqlens_q rows, the extra passes: 23..35 more registers
// per thread at D 64..128 when one kernel did both; the figures: docs/kernels.md).
// cluster: launched in clusters of num_splits blocks along x (launch_cluster; decode only, never kMulti): the split-KV
// combine through distributed shared memory (decode_cluster_combine) instead of global partials and counters.
template <typename T, typename KV, int D, bool kMulti>
__global__ void __launch_bounds__(kAttnThreads, 1) window_attention_decode_kernel(const AttnParams p,
                                                                                  const int stages,
                                                                                  const bool cluster) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  AK_DYNAMIC_SHARED(unsigned char, smem);
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks;
  const int64_t b = blockIdx.z;
  // PDL (pdl.cuh): Q, seq_lens, block tables, K/V pages, cu_seqlens_q are written upstream; out, lse, the partials and
  // the split counters may still be read there. Nothing above this line touches global memory.
  // FAULT(pdl_decode_wait)
  dev::pdl_wait();
  if constexpr (!kMulti) {  // query row b, packed rows = the group's heads h0 .. h0 + hc - 1
    const DecodeRows rows{b, 1, kvh, chunk * kDecodeRows, min(kDecodeRows, p.group - chunk * kDecodeRows)};
    decode_attend<T, KV, D, false>(p, smem, stages, b, rows, split, p.num_splits, cluster);
  } else {  // sequence b's rows as cu_seqlens_q gives them
    DecodeRows rows{prefill_first_row(p, b), prefill_q_len(p, b), kvh, 0, 0};
    // FAULT(mq_unowned_rows)
    if (chunk == 0) prefill_zero_unowned_rows<T, D>(p, b, kvh);
    const int64_t packed = int64_t(rows.qlen) * p.group;
    // Pass 0 is the planned one: head chunk `chunk`, split-KV. A sequence with more query rows than the max_q_len the
    // plan was given (check=False callers) gets more passes, chunk + head_chunks, ..., each by the column's split 0
    // alone over all of its keys (no split: the column's counter serves one combine per launch), so every row is
    // computed whatever max_q_len said.
    // FAULT(mq_passes)
    for (int64_t m0 = int64_t(chunk) * kDecodeRows; m0 < packed; m0 += int64_t(p.head_chunks) * kDecodeRows) {
      const bool first = m0 < int64_t(p.head_chunks) * kDecodeRows;
      const int nsplits = first ? p.num_splits : 1;
      if (split >= nsplits) return;
      if (!first) __syncthreads();  // the previous pass's reads of shared memory are over
      rows.m0 = int(m0);
      rows.hc = int(min64(kDecodeRows, packed - m0));
      decode_attend<T, KV, D, true>(p, smem, stages, b, rows, split, nsplits, false);
    }
  }
}

// Shared memory of one SM: the per-block opt-in limit plus the 1 KB the system reserves per block (sm_80: 163 + 1,
// sm_86/sm_89/sm_120: 99 + 1, sm_90: 227 + 1 KB).
inline int64_t smem_per_sm(const DeviceProps& props) { return int64_t(props.smem_optin) + 1024; }

// Stage count: the most stages (<= 4) that keep 2 CTAs per SM with at least double buffering; else the most that fit
// one CTA (1 on a 99 KB GPU at D = 256: no overlap inside the CTA, but correct).
inline int decode_stages(int64_t d, bool fp8, const DeviceProps& props) {
  const int64_t half = smem_per_sm(props) / 2 - 1024;
  for (int s = kDecodeMaxStages; s >= 2; --s)
    if (int64_t(decode_layout(int(d), s, fp8).smem) <= half) return s;
  for (int s = kDecodeMaxStages; s >= 1; --s)
    if (int64_t(decode_layout(int(d), s, fp8).smem) <= props.smem_optin) return s;
  return 0;
}

// CTAs of `smem` bytes of dynamic shared memory resident per SM: what shared memory allows (each CTA also takes the
// 1 KB the system reserves), at most kDecodeCtasPerSmMax, the register bound: 3 CTAs of 128 threads fit 64K registers
// at <= 168 registers per thread. Where a head dim takes more (`python scripts/sass_report.py`; the figures and why
// the plan never exceeds what is resident: docs/kernels.md), shared memory already limits it to 2 or 1.
// The multi-query instantiation takes more (up to 221 at D = 128), so it is planned at 2 at most.
constexpr int kDecodeCtasPerSmMax = 3;
constexpr int kMultiQueryCtasPerSmMax = 2;
inline int decode_ctas_per_sm(size_t smem, const DeviceProps& props, bool multi = false) {
  const int64_t by_smem = smem_per_sm(props) / (int64_t(smem) + 1024);
  const int64_t most = multi ? kMultiQueryCtasPerSmMax : kDecodeCtasPerSmMax;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(by_smem, most)));
}

// Split-KV count from shapes only, sized to one wave (FlashInfer's max_grid_size = blocks per SM x SMs): the most
// splits that keep ctas x splits <= wave, at most kMaxSplits and at least 2 tiles (128 keys) per split; 1 when the
// columns alone fill the wave. A second wave would start its splits only as the first drains and double the tail.
inline int decode_splits(int64_t ctas, int64_t max_keys, int64_t wave) {
  if (ctas >= wave || max_keys <= 2 * kDecodeTileKeys) return 1;
  const int64_t fit = wave / ctas;
  const int64_t most = ceil_div<int64_t>(max_keys, 2 * kDecodeTileKeys);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({fit, most, int64_t{kMaxSplits}})));
}

struct DecodePlan {
  bool multi = false;      // the multi-query instantiation (cu_seqlens_q given)
  int head_chunks = 1;     // CTAs per KV head (ceil(q_len x group / kDecodeRows), q_len: queries per sequence)
  int num_splits = 1;      // split-KV partitions (> 1: fp32 partials, merged by the last CTA of each column)
  int cluster = 0;         // > 0: blocks per thread-block cluster (= num_splits: the combine through DSMEM, no partials
                           // or counters in global memory); 0: the global combine
  int stages = 0;          // cp.async ring depth; 0: refused (the device's shared memory is too small)
  size_t smem = 0;         // dynamic shared memory, bytes
  dim3 grid;
  int64_t counters() const {  // AttnParams::counters
    return num_splits > 1 && cluster == 0 ? int64_t(grid.y) * grid.z : 0;
  }
};

// batch sequences of q_len query rows at most (decode: 1; multi: the multi-query instantiation, cu_seqlens_q given);
// max_blocks x block_size = the block table's capacity; window, chunk: a query sees at most that many keys (0: no
// bound).
inline DecodePlan plan_decode(int64_t batch, int64_t q_len, bool multi, int64_t hq, int64_t hkv, int64_t d, bool fp8,
                              int64_t max_blocks, int64_t block_size, int64_t window, int64_t chunk,
                              const DeviceProps& props) {
  DecodePlan plan;
  const int64_t group = hq / hkv;
  plan.head_chunks = static_cast<int>(ceil_div<int64_t>(q_len * group, kDecodeRows));
  const int64_t cap = max_blocks * block_size;
  int64_t max_keys = window > 0 ? std::min<int64_t>(window, cap) : cap;
  // FAULT(split_plan_chunk)
  if (chunk > 0) max_keys = std::min<int64_t>(max_keys, chunk);
  max_keys = std::min<int64_t>(max_keys + q_len - 1, cap);  // the union of a CTA's rows' ranges
  plan.stages = decode_stages(d, fp8, props);
  plan.smem = plan.stages ? decode_layout(int(d), plan.stages, fp8).smem : 0;
  const int64_t wave = int64_t(decode_ctas_per_sm(plan.smem, props, multi)) * props.sm_count;
  plan.multi = multi;
  plan.num_splits = decode_splits(batch * hkv * plan.head_chunks, max_keys, wave);
  if (!multi && cluster_plannable(props)) {  // sm_90: the split CTAs of a column as one cluster, where that pays
    plan.cluster = decode_cluster_splits(batch * hkv * plan.head_chunks, plan.num_splits, props);
    if (plan.cluster > 0) plan.num_splits = plan.cluster;
  }
  plan.grid = dim3(plan.num_splits, static_cast<unsigned>(hkv * plan.head_chunks), static_cast<unsigned>(batch));
  return plan;
}

// Whether the planned cluster launch (plan.cluster > 0) can run on this device (csrc/cluster.cuh, cluster_usable: the
// cubin has the cluster path, every cluster resident at once); the caller takes the global path where not, before it
// allocates the global path's partials and counters.
template <typename T, typename KV, int D>
cudaError_t decode_cluster_usable(const DecodePlan& plan, bool& usable) {
  usable = false;
  if (plan.cluster == 0 || plan.stages == 0) return cudaSuccess;
  auto decode = window_attention_decode_kernel<T, KV, D, false>;
  const cudaError_t err = AK_SET_MAX_DYNAMIC_SMEM(decode, plan.smem);
  if (err != cudaSuccess) return err;
  return cluster_usable(reinterpret_cast<const void*>(decode), plan.grid, dim3(kAttnThreads), plan.smem,
                        unsigned(plan.cluster), usable);
}

// The launch of one decode call (the split-KV combine is fused into it); returns the launch error.
template <typename T, typename KV, int D>
cudaError_t run_decode(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream) {
  if (plan.stages == 0) return cudaErrorInvalidValue;
  auto go = [&](auto multi) -> cudaError_t {
    auto decode = window_attention_decode_kernel<T, KV, D, decltype(multi)::value>;
    const cudaError_t err = AK_SET_MAX_DYNAMIC_SMEM(decode, plan.smem);
    if (err != cudaSuccess) return err;
    // FAULT(cluster_launch)
    if (plan.cluster > 0)
      return launch_cluster(decode, plan.grid, kAttnThreads, plan.smem, stream, unsigned(plan.cluster), p,
                            plan.stages, true);
    return launch_pdl(decode, plan.grid, kAttnThreads, plan.smem, stream, p, plan.stages, false);
  };
  if (!plan.multi) return go(std::false_type{});
  if constexpr (D <= kDecodeMaxQueryHeadDim) return go(std::true_type{});
  return cudaErrorInvalidValue;  // use_multiquery_decode refuses D past it
}

}  // namespace arkernels
