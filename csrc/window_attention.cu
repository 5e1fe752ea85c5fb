// window_attention on CUDA: the ATen side only (checks, device guard, stream, the device's properties,
// registration). The kernels, their design notes and launch planning are in window_attention_kernels.cuh, the tensor
// side of the launch in window_attention_launch.h: both are also compiled into the SIMT emulator, which runs this exact
// device code on the CPU in every CI run.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "window_attention_launch.h"

namespace arkernels {
namespace {

// SM count, shared-memory opt-in limit (sm_80/sm_87: 163 KB, sm_86/sm_89/sm_120: 99 KB, sm_90: 227 KB) and compute
// capability of a device, read once per device.
DeviceProps cuda_device_props(int device) {
  static DeviceProps cached[64];
  if (device >= 0 && device < 64 && cached[device].sm_count > 0) return cached[device];
  DeviceProps props;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&props.sm_count, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&props.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&props.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&props.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  if (device >= 0 && device < 64) cached[device] = props;
  return props;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> window_attention_cuda(const at::Tensor& query, const at::Tensor& k_cache,
                                                         const at::Tensor& v_cache, const at::Tensor& block_table,
                                                         const at::Tensor& seq_lens,
                                                         const std::optional<at::Tensor>& cu_seqlens_q,
                                                         const std::optional<at::Tensor>& kv_start, int64_t max_q_len,
                                                         int64_t window, double scale, double softcap,
                                                         const std::optional<at::Tensor>& k_scale,
                                                         const std::optional<at::Tensor>& v_scale,
                                                         const std::optional<at::Tensor>& sinks, int64_t chunk_size) {
  check_window_attention(query, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_q_len, window,
                         scale, softcap, k_scale, v_scale, sinks, chunk_size);
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  at::Tensor out, lse;
  C10_CUDA_CHECK(window_attention_launch(query, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start,
                                         max_q_len, window, scale, softcap, k_scale, v_scale, sinks, chunk_size,
                                         cuda_device_props(query.get_device()), stream,
                                         capture != cudaStreamCaptureStatusNone, out, lse));
  return {out, lse};
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CUDA, m) { m.impl("window_attention", &arkernels::window_attention_cuda); }
