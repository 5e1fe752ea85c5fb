// Shared helpers for every arkernels op's ATen side: input checks (written once), dtype dispatch.
// Light includes only: this header is pulled into .cu files, and torch/extension.h would make each of
// them several times slower to compile.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "int_math.h"

// Every message names the op and the argument, so the user can act on it.
#define AK_CHECK(op, cond, ...) TORCH_CHECK((cond), op, ": ", __VA_ARGS__)

#define AK_CHECK_DIM(op, t, name, n) \
  AK_CHECK(op, (t).dim() == (n), name " must be ", n, "-D, got ", (t).dim(), "-D ", (t).sizes())

#define AK_CHECK_DTYPE(op, t, name, dt) \
  AK_CHECK(op, (t).scalar_type() == (dt), name " must be ", dt, ", got ", (t).scalar_type())

#define AK_CHECK_SAME_DEVICE(op, a, aname, b, bname)                                               \
  AK_CHECK(op, (a).device() == (b).device(), aname " and " bname " must be on one device, got ", \
           (a).device(), " and ", (b).device())

#define AK_CHECK_LAST_CONTIGUOUS(op, t, name) \
  AK_CHECK(op, (t).size(-1) <= 1 || (t).stride(-1) == 1, name " must have a contiguous last dimension, got strides ", (t).strides())

namespace arkernels {

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]: 4-D, one shape, one of fp32/fp16/bf16/fp8 e4m3,
// last dim contiguous (other strides free), one device. Shared by every op that reads or writes the paged cache.
inline void check_paged_cache(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  AK_CHECK_DIM(op, k_cache, "k_cache", 4);
  AK_CHECK_DIM(op, v_cache, "v_cache", 4);
  AK_CHECK(op, k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape, got ", k_cache.sizes(),
           " and ", v_cache.sizes());
  const auto dt = k_cache.scalar_type();
  AK_CHECK(op, dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat8_e4m3fn,
           "k_cache must be float32, float16, bfloat16 or float8_e4m3fn, got ", dt);
  AK_CHECK(op, v_cache.scalar_type() == dt, "k_cache and v_cache must share one dtype, got ", dt, " and ",
           v_cache.scalar_type());
  AK_CHECK_SAME_DEVICE(op, v_cache, "v_cache", k_cache, "k_cache");
  AK_CHECK_LAST_CONTIGUOUS(op, k_cache, "k_cache");
  AK_CHECK_LAST_CONTIGUOUS(op, v_cache, "v_cache");
}

// fp8 cache scales (vLLM's convention: stored = saturate(x / scale), value = stored * scale): k_scale, v_scale fp32
// one-element tensors on the cache's device (read on the device: no host sync), required iff the cache is
// float8_e4m3fn. A scale given for a cache of another dtype is an error too: it would be silently meaningless.
inline void check_kv_scales(const char* op, const at::Tensor& k_cache, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const std::pair<const std::optional<at::Tensor>*, const char*> scales[] = {{&k_scale, "k_scale"},
                                                                            {&v_scale, "v_scale"}};
  for (const auto& [s, name] : scales) {
    if (!fp8) {
      AK_CHECK(op, !s->has_value(), name, " is only taken with float8_e4m3fn caches, but k_cache is ",
               k_cache.scalar_type());
      continue;
    }
    AK_CHECK(op, s->has_value() && (*s)->numel() == 1 && (*s)->scalar_type() == at::kFloat &&
                     (*s)->device() == k_cache.device(),
             name, " must be a one-element float32 tensor on the cache's device (", k_cache.device(),
             ") when k_cache is float8_e4m3fn, got ",
             s->has_value() ? c10::str((*s)->scalar_type(), " ", (*s)->sizes(), " on ", (*s)->device())
                            : std::string("None"));
  }
}

// block_table int32 [batch, max_blocks] and seq_lens int32 [batch] on k_cache's device.
inline void check_block_table(const char* op, const at::Tensor& block_table, const at::Tensor& seq_lens,
                              const at::Tensor& k_cache) {
  AK_CHECK_DIM(op, block_table, "block_table", 2);
  AK_CHECK_DIM(op, seq_lens, "seq_lens", 1);
  AK_CHECK_DTYPE(op, block_table, "block_table", at::kInt);
  AK_CHECK_DTYPE(op, seq_lens, "seq_lens", at::kInt);
  AK_CHECK(op, seq_lens.size(0) == block_table.size(0), "seq_lens has ", seq_lens.size(0),
           " entries but block_table has ", block_table.size(0), " rows");
  AK_CHECK_SAME_DEVICE(op, block_table, "block_table", k_cache, "k_cache");
  AK_CHECK_SAME_DEVICE(op, seq_lens, "seq_lens", k_cache, "k_cache");
}

}  // namespace arkernels

// fp32, fp16 and bf16: the dtypes every floating kernel in this package claims.
#define AK_DISPATCH_FLOAT(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
