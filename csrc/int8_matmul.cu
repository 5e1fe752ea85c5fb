// int8_matmul on CUDA: the ATen side of the hand-written w8a16 fragment GEMV (checks, device guard, stream, the
// device's properties, registration). The kernel, its design notes and planning are in int8_matmul_kernels.cuh, the
// tensor side of the launch in int8_matmul_launch.h: both are also compiled into the SIMT emulator, which runs this
// exact device code on the CPU. (The other int8 ops are Triton kernels registered from arkernels/ops/int8_matmul.py.)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "int8_matmul_launch.h"

namespace arkernels {
namespace {

// SM count (the planning's input) and the rest of DeviceProps, read once per device.
DeviceProps frag_device_props(int device) {
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

at::Tensor w8a16_fragment_matmul_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                      const std::optional<at::Tensor>& bias) {
  check_w8a16_fragment_matmul(x, w, w_scale, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  at::Tensor y;
  C10_CUDA_CHECK(w8a16_fragment_matmul_launch(x, w, w_scale, bias, frag_device_props(x.get_device()), stream,
                                              capture != cudaStreamCaptureStatusNone, y));
  return y;
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CUDA, m) { m.impl("w8a16_fragment_matmul", &arkernels::w8a16_fragment_matmul_cuda); }
