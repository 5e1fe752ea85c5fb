// window_attention: input checks shared by the CPU and CUDA kernels (one copy, so both refuse the same inputs),
// and the visibility rule written once for host code.
//
// Visibility of key j to the query at absolute position i of sequence b (window 0: no window; chunk_size 0: no
// chunks), with s = max(kv_start[b], 0) the sequence's first real position:
//   s <= j <= i  and  (window == 0 or j > i - window)  and  j < max_blocks * block_size
//   and  (chunk_size == 0 or (j - s) / chunk_size == (i - s) / chunk_size)
// i.e. one lower bound, lo = max(s, i - window + 1 (window > 0), s + (i - s) / C * C (C > 0)): chunks of C positions
// count from the first real token, as transformers' chunked mask does with left padding (chunked_overlay).
// Attention sinks (sinks[h], one logit per query head, natural-log units, neither scaled nor softcapped) join the
// softmax denominator of every query of head h and carry no value: out = sum_j e^(s_j) v_j / (sum_j e^(s_j) +
// e^(sinks[h])), lse = log(sum_j e^(s_j) + e^(sinks[h])) (the sink is in the lse: FlashInfer's convention). A query
// with no visible key gets zeros and lse = sinks[h] (-inf without sinks).
// Sequence b's queries are its last q_len_b positions: query t (0 <= t < q_len_b) sits at i = seq_lens[b] - q_len_b + t,
// whatever the block table holds: a seq_len past the table's capacity (possible with check=False) masks the keys the
// table cannot address, it never moves the queries (every kernel: CPU, CUDA, the emulator; and the reference).
#pragma once

#include "common.h"
#include "window_attention_mask.h"

#include <cmath>
#include <optional>

namespace arkernels {

// query [num_queries, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_table int32 [batch, max_blocks];
// seq_lens int32 [batch]; cu_seqlens_q int32 [batch + 1]? (None: decode, num_queries == batch);
// kv_start int32 [batch]?; max_q_len >= 0; window >= 0; softcap >= 0; k_scale/v_scale fp32 [1] iff the caches are
// float8_e4m3fn (then the query is fp32|fp16|bf16 and the output takes its dtype); sinks fp32 [Hq]? on the query's
// device (any stride); chunk_size >= 0.
inline void check_window_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                                   const std::optional<at::Tensor>& cu_seqlens_q,
                                   const std::optional<at::Tensor>& kv_start, int64_t max_q_len, int64_t window,
                                   double scale, double softcap, const std::optional<at::Tensor>& k_scale,
                                   const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                                   int64_t chunk_size) {
  AK_CHECK_DIM("window_attention", query, "query", 3);
  check_paged_cache("window_attention", k_cache, v_cache);
  check_block_table("window_attention", block_table, seq_lens, k_cache);
  check_kv_scales("window_attention", k_cache, k_scale, v_scale);
  const auto dt = query.scalar_type();
  AK_CHECK("window_attention", dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
           "query must be float32, float16 or bfloat16, got ", dt);
  AK_CHECK("window_attention", k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == dt,
           "query, k_cache and v_cache must share one dtype (or the caches be float8_e4m3fn), got ", dt, ", ",
           k_cache.scalar_type(), ", ", v_cache.scalar_type());
  const int64_t hq = query.size(1), hkv = k_cache.size(2), d = query.size(2);
  AK_CHECK("window_attention", k_cache.size(3) == d, "head_dim of query (", d, ") and k_cache (", k_cache.size(3),
           ") differ");
  AK_CHECK("window_attention", hkv > 0 && hq % hkv == 0, "num_q_heads (", hq,
           ") must be a whole multiple of num_kv_heads (", hkv, ")");
  AK_CHECK("window_attention", d >= 1 && d <= 512, "head_dim must be in [1, 512], got ", d);
  const int64_t batch = seq_lens.size(0);
  if (cu_seqlens_q.has_value()) {
    const at::Tensor& cu = *cu_seqlens_q;
    AK_CHECK_DIM("window_attention", cu, "cu_seqlens_q", 1);
    AK_CHECK_DTYPE("window_attention", cu, "cu_seqlens_q", at::kInt);
    AK_CHECK("window_attention", cu.size(0) == batch + 1, "cu_seqlens_q must have batch + 1 = ", batch + 1,
             " entries, got ", cu.size(0));
    AK_CHECK_SAME_DEVICE("window_attention", cu, "cu_seqlens_q", query, "query");
  } else {
    AK_CHECK("window_attention", query.size(0) == batch, "decode (cu_seqlens_q None) takes one query per sequence: ",
             "query has ", query.size(0), " rows but seq_lens has ", batch, " entries");
  }
  if (kv_start.has_value()) {
    const at::Tensor& ks = *kv_start;
    AK_CHECK_DIM("window_attention", ks, "kv_start", 1);
    AK_CHECK_DTYPE("window_attention", ks, "kv_start", at::kInt);
    AK_CHECK("window_attention", ks.size(0) == batch, "kv_start must have batch = ", batch, " entries, got ",
             ks.size(0));
    AK_CHECK_SAME_DEVICE("window_attention", ks, "kv_start", query, "query");
  }
  AK_CHECK("window_attention", max_q_len >= 0, "max_q_len must be >= 0, got ", max_q_len);
  // No sequence has more queries than query has rows: the bound that keeps the prefill grid's planning
  // (max_q_len * group query rows) from overflowing, whatever the caller passes.
  AK_CHECK("window_attention", !cu_seqlens_q.has_value() || max_q_len <= query.size(0),
           "max_q_len must be <= num_queries = ", query.size(0), ", got ", max_q_len);
  AK_CHECK("window_attention", window >= 0, "window must be >= 0 (0: no window), got ", window);
  AK_CHECK("window_attention", chunk_size >= 0, "chunk_size must be >= 0 (0: no chunks), got ", chunk_size);
  if (sinks.has_value()) {
    const at::Tensor& sk = *sinks;
    AK_CHECK_DIM("window_attention", sk, "sinks", 1);
    AK_CHECK_DTYPE("window_attention", sk, "sinks", at::kFloat);
    AK_CHECK("window_attention", sk.size(0) == hq, "sinks must have num_q_heads = ", hq, " entries, got ",
             sk.size(0));
    AK_CHECK_SAME_DEVICE("window_attention", sk, "sinks", query, "query");
  }
  AK_CHECK("window_attention", softcap >= 0.0, "softcap must be >= 0 (0: off), got ", softcap);
  AK_CHECK("window_attention", std::isfinite(scale), "scale must be finite, got ", scale);
  AK_CHECK_SAME_DEVICE("window_attention", k_cache, "k_cache", query, "query");
  AK_CHECK_LAST_CONTIGUOUS("window_attention", query, "query");
}

}  // namespace arkernels
