// paged_kv: the tensor side of a launch (checks, the copy-unit choice, planning, the launches), shared by the CUDA
// extension (csrc/paged_kv.cu, which adds the device guard and the stream) and the SIMT emulator
// (csrc/simt/simt_ops.cpp), so the two cannot drift. Returns the first launch error (cudaSuccess when none).
#pragma once

#include <ATen/ops/empty.h>

#include "paged_kv.h"
#include "paged_kv_kernels.cuh"

namespace arkernels {

// The copy unit: 16 bytes when every pointer and byte stride allows it, else one element.
template <typename F>
void dispatch_copy_unit(bool vec, int64_t element_size, F&& f) {
  if (vec) {
    f(uint4{});
  } else if (element_size == 1) {  // fp8
    f(uint8_t{});
  } else if (element_size == 2) {
    f(uint16_t{});
  } else {
    f(uint32_t{});
  }
}

// fp8 caches (checked by check_paged_kv_append: k_scale, v_scale given): quantize on write, V elements per thread.
inline cudaError_t paged_kv_append_fp8_launch(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                                              at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                              const at::Tensor& k_scale, const at::Tensor& v_scale,
                                              cudaStream_t stream) {
  const int64_t n = slot_mapping.size(0);
  const int64_t src_es = key.element_size(), head_dim = key.size(2), heads = key.size(1);
  const int64_t v_elems = 16 / src_es;  // one 16-byte load of the source, one v_elems-byte store of fp8
  bool vec = head_dim % v_elems == 0 && aligned16(key.data_ptr()) && aligned16(value.data_ptr()) &&
             reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % v_elems == 0 &&
             reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % v_elems == 0;
  for (int d = 0; d < 3; ++d) {
    vec = vec && k_cache.stride(d) % v_elems == 0;
    if (d < 2) vec = vec && (key.stride(d) * src_es) % 16 == 0 && (value.stride(d) * src_es) % 16 == 0;
  }
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor slots = slot_mapping.contiguous();
  cudaError_t err = cudaSuccess;
  auto run = [&](auto src_tag, auto v_tag) {
    using Src = decltype(src_tag);
    constexpr int V = decltype(v_tag)::value;
    const int units = static_cast<int>(head_dim / V);
    const PagedKvPlan plan = plan_paged_kv_append(n, heads, units);
    auto launch = [&](const auto* slot_ptr) {
      using Slot = std::remove_cv_t<std::remove_pointer_t<decltype(slot_ptr)>>;
      auto kernel = paged_kv_append_fp8_kernel<Src, V, Slot>;
      err = launch_pdl(kernel, plan.grid, plan.threads, 0, stream, static_cast<const Src*>(key.data_ptr()),
                      static_cast<const Src*>(value.data_ptr()), static_cast<uint8_t*>(k_cache.data_ptr()),
                      static_cast<uint8_t*>(v_cache.data_ptr()), slot_ptr, k_scale.data_ptr<float>(),
                      v_scale.data_ptr<float>(), n, num_slots, k_cache.size(1), static_cast<int>(heads), units,
                      plan.rows_per_cta, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2));
    };
    if (slots.scalar_type() == at::kInt) {
      launch(slots.data_ptr<int32_t>());
    } else {
      launch(slots.data_ptr<int64_t>());
    }
  };
  auto by_width = [&](auto src_tag) {
    constexpr int kVec = 16 / sizeof(decltype(src_tag));
    if (vec) {
      run(src_tag, std::integral_constant<int, kVec>{});
    } else {
      run(src_tag, std::integral_constant<int, 1>{});
    }
  };
  switch (key.scalar_type()) {
    case at::kFloat: by_width(float{}); break;
    case at::kHalf: by_width(__half{}); break;
    default: by_width(__nv_bfloat16{}); break;  // bfloat16: the only other dtype the checks admit
  }
  return err;
}

// k_scale/v_scale: defined iff the caches are fp8 (checked by check_paged_kv_append).
inline cudaError_t paged_kv_append_launch(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                                          at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                          const std::optional<at::Tensor>& k_scale,
                                          const std::optional<at::Tensor>& v_scale, cudaStream_t stream) {
  const int64_t n = slot_mapping.size(0);
  if (n == 0 || key.numel() == 0) return cudaSuccess;
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    return paged_kv_append_fp8_launch(key, value, k_cache, v_cache, slot_mapping, *k_scale, *v_scale, stream);
  }
  const int64_t es = k_cache.element_size();
  const int64_t row_bytes = key.size(2) * es;
  bool vec = row_bytes % 16 == 0 && aligned16(key.data_ptr()) && aligned16(value.data_ptr()) &&
             aligned16(k_cache.data_ptr()) && aligned16(v_cache.data_ptr());
  for (int d = 0; d < 3; ++d) {
    vec = vec && (k_cache.stride(d) * es) % 16 == 0;
    if (d < 2) vec = vec && (key.stride(d) * es) % 16 == 0 && (value.stride(d) * es) % 16 == 0;
  }
  const int64_t heads = key.size(1);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor slots = slot_mapping.contiguous();
  cudaError_t err = cudaSuccess;
  dispatch_copy_unit(vec, es, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t k = sizeof(Unit) / es;  // elements per unit
    const int units = static_cast<int>(row_bytes / sizeof(Unit));
    const PagedKvPlan plan = plan_paged_kv_append(n, heads, units);
    auto launch = [&](const auto* slot_ptr) {
      using Slot = std::remove_cv_t<std::remove_pointer_t<decltype(slot_ptr)>>;
      auto kernel = paged_kv_append_kernel<Unit, Slot>;
      err = launch_pdl(kernel, plan.grid, plan.threads, 0, stream, static_cast<const Unit*>(key.data_ptr()),
                      static_cast<const Unit*>(value.data_ptr()), static_cast<Unit*>(k_cache.data_ptr()),
                      static_cast<Unit*>(v_cache.data_ptr()), slot_ptr, n, num_slots, k_cache.size(1),
                      static_cast<int>(heads), units, plan.rows_per_cta, key.stride(0) / k, key.stride(1) / k,
                      value.stride(0) / k, value.stride(1) / k, k_cache.stride(0) / k, k_cache.stride(1) / k,
                      k_cache.stride(2) / k);
    };
    if (slots.scalar_type() == at::kInt) {
      launch(slots.data_ptr<int32_t>());
    } else {
      launch(slots.data_ptr<int64_t>());
    }
  });
  return err;
}

// Allocates (k_out, v_out) [batch, heads, max_seq_len, head_dim] like k_cache and fills them.
inline cudaError_t paged_kv_gather_launch(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& block_table, const at::Tensor& seq_lens,
                                          int64_t max_seq_len, at::Tensor& k_out, at::Tensor& v_out,
                                          cudaStream_t stream) {
  AK_CHECK("paged_kv_gather", block_table.size(0) <= 65535, "batch must be <= 65535 on CUDA, got ",
           block_table.size(0));
  const int64_t batch = block_table.size(0), heads = k_cache.size(2), head_dim = k_cache.size(3);
  k_out = at::empty({batch, heads, max_seq_len, head_dim}, k_cache.options());
  v_out = at::empty({batch, heads, max_seq_len, head_dim}, k_cache.options());
  if (k_out.numel() == 0) return cudaSuccess;
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t es = k_cache.element_size();
  const int64_t row_bytes = head_dim * es;
  bool vec = row_bytes % 16 == 0 && aligned16(k_cache.data_ptr()) && aligned16(v_cache.data_ptr());
  // k and v carry their own strides: the CPU kernel (and window_attention) accept caches of different layouts, e.g.
  // key.permute(0, 2, 1, 3) of a transformers cache and a value cache that was never transposed the same way.
  for (int d = 0; d < 3; ++d) {
    vec = vec && (k_cache.stride(d) * es) % 16 == 0 && (v_cache.stride(d) * es) % 16 == 0;
  }
  cudaError_t err = cudaSuccess;
  dispatch_copy_unit(vec, es, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t k = sizeof(Unit) / es;
    const int units = static_cast<int>(row_bytes / sizeof(Unit));
    const PagedKvPlan plan = plan_paged_kv_gather(batch, max_seq_len, heads, units);
    auto kernel = paged_kv_gather_kernel<Unit>;
    err = launch_pdl(kernel, plan.grid, plan.threads, 0, stream, static_cast<const Unit*>(k_cache.data_ptr()),
                    static_cast<const Unit*>(v_cache.data_ptr()), table.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                    static_cast<Unit*>(k_out.data_ptr()), static_cast<Unit*>(v_out.data_ptr()), max_seq_len,
                    block_table.size(1), k_cache.size(0), k_cache.size(1), static_cast<int>(heads), units,
                    plan.rows_per_cta, k_cache.stride(0) / k, k_cache.stride(1) / k, k_cache.stride(2) / k,
                    v_cache.stride(0) / k, v_cache.stride(1) / k, v_cache.stride(2) / k);
  });
  return err;
}

}  // namespace arkernels
