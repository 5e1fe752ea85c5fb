// paged_kv on CUDA: the ATen side only (checks, device guard, stream, registration). The kernels and their launch
// planning are in paged_kv_kernels.cuh, the tensor side of the launch in paged_kv_launch.h: both are also compiled
// into the SIMT emulator, which runs this exact device code on the CPU in every CI run.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "paged_kv_launch.h"

namespace arkernels {

void paged_kv_append_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale) {
  check_paged_kv_append(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  const c10::cuda::CUDAGuard guard(k_cache.device());
  C10_CUDA_CHECK(paged_kv_append_launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                        c10::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor> paged_kv_gather_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                        const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                        int64_t max_seq_len) {
  check_paged_kv_gather(k_cache, v_cache, block_table, seq_lens, max_seq_len);
  const c10::cuda::CUDAGuard guard(k_cache.device());
  at::Tensor k_out, v_out;
  C10_CUDA_CHECK(paged_kv_gather_launch(k_cache, v_cache, block_table, seq_lens, max_seq_len, k_out, v_out,
                                        c10::cuda::getCurrentCUDAStream()));
  return {k_out, v_out};
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CUDA, m) {
  m.impl("paged_kv_append", &arkernels::paged_kv_append_cuda);
  m.impl("paged_kv_gather", &arkernels::paged_kv_gather_cuda);
}
