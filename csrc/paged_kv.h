// paged_kv: input checks shared by the CPU and CUDA kernels (one copy, so both refuse the same inputs).
#pragma once

#include "common.h"

namespace arkernels {

// The kernels' per-CTA work counts (rows x heads x units) are int: a token row of num_kv_heads x head_dim elements must
// stay below 2^31 (every offset into the tensors is int64).
inline void check_paged_kv_row(const char* op, const at::Tensor& k_cache) {
  AK_CHECK(op, k_cache.size(2) * k_cache.size(3) <= INT32_MAX, "num_kv_heads * head_dim must be < 2^31, got ",
           k_cache.size(2), " * ", k_cache.size(3));
}

// key/value [num_tokens, num_kv_heads, head_dim]; k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim];
// slot_mapping [n <= num_tokens] int32|int64; k_scale/v_scale fp32 [1] iff the caches are float8_e4m3fn (then key and
// value are fp32|fp16|bf16, quantized on write).
inline void check_paged_kv_append(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  AK_CHECK_DIM("paged_kv_append", key, "key", 3);
  AK_CHECK_DIM("paged_kv_append", value, "value", 3);
  check_paged_cache("paged_kv_append", k_cache, v_cache);
  AK_CHECK_DIM("paged_kv_append", slot_mapping, "slot_mapping", 1);
  AK_CHECK("paged_kv_append", key.sizes() == value.sizes(), "key and value must have one shape, got ", key.sizes(),
           " and ", value.sizes());
  AK_CHECK("paged_kv_append", key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
           "key [num_tokens, num_kv_heads, head_dim] = ", key.sizes(),
           " does not match k_cache [num_blocks, block_size, num_kv_heads, head_dim] = ", k_cache.sizes());
  const auto dt = k_cache.scalar_type();
  check_kv_scales("paged_kv_append", k_cache, k_scale, v_scale);
  if (dt == at::kFloat8_e4m3fn) {
    const auto kt = key.scalar_type();
    AK_CHECK("paged_kv_append",
             (kt == at::kFloat || kt == at::kHalf || kt == at::kBFloat16) && value.scalar_type() == kt,
             "key and value must share one dtype of float32, float16 or bfloat16 with float8_e4m3fn caches, got ", kt,
             " and ", value.scalar_type());
  } else {
    AK_CHECK("paged_kv_append", key.scalar_type() == dt && value.scalar_type() == dt,
             "key, value, k_cache and v_cache must share one dtype, got ", key.scalar_type(), ", ",
             value.scalar_type(), ", ", dt, ", ", v_cache.scalar_type());
  }
  AK_CHECK("paged_kv_append", slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
           "slot_mapping must be int32 or int64, got ", slot_mapping.scalar_type());
  AK_CHECK("paged_kv_append", slot_mapping.size(0) <= key.size(0), "slot_mapping has ", slot_mapping.size(0),
           " entries but key has only ", key.size(0), " tokens");
  AK_CHECK_SAME_DEVICE("paged_kv_append", key, "key", k_cache, "k_cache");
  AK_CHECK_SAME_DEVICE("paged_kv_append", value, "value", k_cache, "k_cache");
  AK_CHECK_SAME_DEVICE("paged_kv_append", slot_mapping, "slot_mapping", k_cache, "k_cache");
  AK_CHECK_LAST_CONTIGUOUS("paged_kv_append", key, "key");
  AK_CHECK_LAST_CONTIGUOUS("paged_kv_append", value, "value");
  AK_CHECK("paged_kv_append", k_cache.strides() == v_cache.strides(), "k_cache and v_cache must have one layout, got strides ",
           k_cache.strides(), " and ", v_cache.strides());
  check_paged_kv_row("paged_kv_append", k_cache);
}

// k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]; block_table int32 [batch, max_blocks];
// seq_lens int32 [batch]; max_seq_len: the output length (positions at or past it are not gathered; the wrapper
// refuses a seq_len above it with check=True: the device kernels cannot, without a host sync).
inline void check_paged_kv_gather(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, int64_t max_seq_len) {
  check_paged_cache("paged_kv_gather", k_cache, v_cache);
  check_block_table("paged_kv_gather", block_table, seq_lens, k_cache);
  check_paged_kv_row("paged_kv_gather", k_cache);
  AK_CHECK("paged_kv_gather", max_seq_len >= 0 && max_seq_len <= INT32_MAX,
           "max_seq_len must be in [0, 2^31) (seq_lens is int32), got ", max_seq_len);
  AK_CHECK("paged_kv_gather", max_seq_len <= block_table.size(1) * k_cache.size(1), "max_seq_len ", max_seq_len,
           " exceeds what block_table can address (", block_table.size(1), " blocks of ", k_cache.size(1), ")");
}

}  // namespace arkernels
