// paged_kv on CUDA: append new K/V rows into the paged cache, and gather a batch of sequences out of it.
//
// Layout: caches [num_blocks, block_size, num_kv_heads, head_dim] (last dim contiguous, other strides free);
// slot = block * block_size + offset. Both kernels only move bytes, so they are dtype-agnostic: a row of
// head_dim elements is copied in 16-byte units (uint4) when every base pointer and byte stride is 16-byte
// aligned, else element by element (2 or 4 bytes). Parallelisation: a CTA of 256 threads owns
// `rows_per_cta` token rows (append) or sequence positions (gather), chosen on the host so that a CTA has
// about 256 units of work even for small head counts; threads stride over (row, head, unit).
// Offsets are int64: num_blocks * block_size * heads * head_dim passes 2^31 on real caches.
// Resource use (nvcc -Xptxas -v, sm_90): see the build log; both kernels use < 32 registers, no spills, no smem.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "paged_kv.h"

namespace arkernels {
namespace {

constexpr int kThreads = 256;

// Rows of `units` copy units each: one CTA takes rows [blockIdx.x * rows_per_cta, ...).
template <typename Unit, typename Slot>
__global__ void paged_kv_append_kernel(const Unit* __restrict__ key, const Unit* __restrict__ value,
                                       Unit* __restrict__ k_cache, Unit* __restrict__ v_cache,
                                       const Slot* __restrict__ slot_mapping, int64_t num_tokens, int64_t num_slots,
                                       int64_t block_size, int heads, int units,  // units per head row
                                       int rows_per_cta,
                                       int64_t key_s0, int64_t key_s1,  // in units
                                       int64_t val_s0, int64_t val_s1, int64_t cache_s0, int64_t cache_s1,
                                       int64_t cache_s2) {
  const int work = rows_per_cta * heads * units;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int u = i % units;
    const int h = (i / units) % heads;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * rows_per_cta + i / (units * heads);
    if (t >= num_tokens) return;  // i only grows, so t does too
    const int64_t slot = static_cast<int64_t>(slot_mapping[t]);
    if (slot < 0 || slot >= num_slots) continue;  // padding (or past the cache): never written
    const int64_t dst = (slot / block_size) * cache_s0 + (slot % block_size) * cache_s1 + h * cache_s2 + u;
    k_cache[dst] = key[t * key_s0 + h * key_s1 + u];
    v_cache[dst] = value[t * val_s0 + h * val_s1 + u];
  }
}

// out [batch, heads, max_seq_len, units] contiguous; CTA (blockIdx.x, blockIdx.y = b) owns positions
// [blockIdx.x * rows_per_cta, ...) of sequence b. Positions past seq_len (or under a bad block entry) get zeros.
template <typename Unit>
__global__ void paged_kv_gather_kernel(const Unit* __restrict__ k_cache, const Unit* __restrict__ v_cache,
                                       const int32_t* __restrict__ block_table, const int32_t* __restrict__ seq_lens,
                                       Unit* __restrict__ k_out, Unit* __restrict__ v_out, int64_t max_seq_len,
                                       int64_t max_blocks, int64_t num_blocks, int64_t block_size, int heads,
                                       int units, int rows_per_cta, int64_t cache_s0, int64_t cache_s1,
                                       int64_t cache_s2, int64_t vcache_s0, int64_t vcache_s1, int64_t vcache_s2) {
  const int64_t b = blockIdx.y;
  const int64_t len = seq_lens[b];
  const int work = rows_per_cta * heads * units;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int u = i % units;
    const int h = (i / units) % heads;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * rows_per_cta + i / (units * heads);
    if (t >= max_seq_len) return;
    const int64_t dst = ((b * heads + h) * max_seq_len + t) * units + u;
    int64_t blk = -1;
    if (t < len) blk = block_table[b * max_blocks + t / block_size];
    if (blk < 0 || blk >= num_blocks) {
      k_out[dst] = Unit{};
      v_out[dst] = Unit{};
      continue;
    }
    const int64_t off = t % block_size;
    k_out[dst] = k_cache[blk * cache_s0 + off * cache_s1 + h * cache_s2 + u];
    v_out[dst] = v_cache[blk * vcache_s0 + off * vcache_s1 + h * vcache_s2 + u];
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The copy unit: 16 bytes when every pointer and byte stride allows it, else one element.
template <typename F>
void dispatch_unit(bool vec, int64_t element_size, F&& f) {
  if (vec) {
    f(uint4{});
  } else if (element_size == 2) {
    f(uint16_t{});
  } else {
    f(uint32_t{});
  }
}

int rows_per_cta(int64_t heads, int64_t units) {
  const int64_t per_row = heads * units;
  return static_cast<int>(std::max<int64_t>(1, kThreads / std::max<int64_t>(1, per_row)));
}

}  // namespace

void paged_kv_append_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& slot_mapping) {
  check_paged_kv_append(key, value, k_cache, v_cache, slot_mapping);
  const int64_t n = slot_mapping.size(0);
  if (n == 0 || key.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
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
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_unit(vec, es, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t k = sizeof(Unit) / es;  // elements per unit
    const int units = static_cast<int>(row_bytes / sizeof(Unit));
    const int rows = rows_per_cta(heads, units);
    const auto grid = static_cast<unsigned>(ceil_div<int64_t>(n, rows));
    auto launch = [&](const auto* slots) {
      paged_kv_append_kernel<<<grid, kThreads, 0, stream>>>(
          static_cast<const Unit*>(key.data_ptr()), static_cast<const Unit*>(value.data_ptr()),
          static_cast<Unit*>(k_cache.data_ptr()), static_cast<Unit*>(v_cache.data_ptr()), slots, n, num_slots,
          k_cache.size(1), static_cast<int>(heads), units, rows, key.stride(0) / k, key.stride(1) / k,
          value.stride(0) / k, value.stride(1) / k, k_cache.stride(0) / k, k_cache.stride(1) / k,
          k_cache.stride(2) / k);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (slot_mapping.scalar_type() == at::kInt) {
      launch(slot_mapping.contiguous().data_ptr<int32_t>());
    } else {
      launch(slot_mapping.contiguous().data_ptr<int64_t>());
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_kv_gather_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                        const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                        int64_t max_seq_len) {
  check_paged_kv_gather(k_cache, v_cache, block_table, seq_lens, max_seq_len);
  AK_CHECK("paged_kv_gather", block_table.size(0) <= 65535, "batch must be <= 65535 on CUDA, got ",
           block_table.size(0));
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const int64_t batch = block_table.size(0), heads = k_cache.size(2), head_dim = k_cache.size(3);
  at::Tensor k_out = at::empty({batch, heads, max_seq_len, head_dim}, k_cache.options());
  at::Tensor v_out = at::empty({batch, heads, max_seq_len, head_dim}, k_cache.options());
  if (k_out.numel() == 0) return {k_out, v_out};
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
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_unit(vec, es, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t k = sizeof(Unit) / es;
    const int units = static_cast<int>(row_bytes / sizeof(Unit));
    const int rows = rows_per_cta(heads, units);
    const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(max_seq_len, rows)), static_cast<unsigned>(batch));
    paged_kv_gather_kernel<<<grid, kThreads, 0, stream>>>(
        static_cast<const Unit*>(k_cache.data_ptr()), static_cast<const Unit*>(v_cache.data_ptr()),
        table.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), static_cast<Unit*>(k_out.data_ptr()),
        static_cast<Unit*>(v_out.data_ptr()), max_seq_len, block_table.size(1), k_cache.size(0), k_cache.size(1),
        static_cast<int>(heads), units, rows, k_cache.stride(0) / k, k_cache.stride(1) / k, k_cache.stride(2) / k,
        v_cache.stride(0) / k, v_cache.stride(1) / k, v_cache.stride(2) / k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {k_out, v_out};
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CUDA, m) {
  m.impl("paged_kv_append", &arkernels::paged_kv_append_cuda);
  m.impl("paged_kv_gather", &arkernels::paged_kv_gather_cuda);
}
