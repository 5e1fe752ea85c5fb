// int8_matmul (w8a16 fragment GEMV): the tensor side of a launch (the CUDA-only checks, the output, the workspace and
// counters, planning, the launches), shared by the CUDA extension (csrc/int8_matmul.cu, which adds the device guard,
// the stream and the device's properties) and the SIMT emulator (csrc/simt/simt_ops.cpp), so the two cannot drift.
// Returns the first launch error (cudaSuccess when none).
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "int8_matmul.h"
#include "int8_matmul_kernels.cuh"

namespace arkernels {

// Split-K arrival counters and this launch's epoch on them (frag_arrive: a launch owns the values from
// epoch * kFragMaxSplits up, so what an earlier launch left, an aborted one included, is erased by the first arrival;
// nothing resets them). Per (device, stream), as window_attention's split counters (window_attention_launch.h): one
// stream's launches reuse them with growing epochs, under a lock held until the launch is enqueued; a stream being
// captured into a CUDA graph gets counters of its own, zeroed per call (a memset node of the graph), epoch 1.
struct FragCounters {
  at::Tensor hold;
  unsigned long long* ptr = nullptr;
  unsigned long long epoch = 0;
  std::unique_lock<std::mutex> lock;
};
// `launches`: the launches of this call (M > 16: one per 16-row slice), given the epochs epoch, epoch + 1, ...
inline void frag_counters(const at::Tensor& like, int64_t n, int64_t launches, const void* stream, bool capturing,
                          FragCounters& out) {
  const auto opts = like.options().dtype(at::kLong);
  if (capturing) {
    out.hold = at::zeros({n}, opts);
    out.ptr = reinterpret_cast<unsigned long long*>(out.hold.data_ptr<int64_t>());
    out.epoch = 1;
    return;
  }
  static std::mutex mu;
  struct Entry {
    at::Tensor t;
    unsigned long long epoch = 0;
  };
  static auto* cache = new std::map<std::tuple<int, int, const void*>, Entry>();  // never destroyed (CUDA tensors)
  out.lock = std::unique_lock<std::mutex>(mu);
  Entry& e = (*cache)[{int(like.device().type()), int(like.device().index()), stream}];
  if (!e.t.defined() || e.t.numel() < n)  // a fresh buffer: zeros are below every epoch's values
    e.t = at::zeros({std::max<int64_t>(n, e.t.defined() ? 2 * e.t.numel() : 0)}, opts);
  out.hold = e.t;
  out.ptr = reinterpret_cast<unsigned long long*>(e.t.data_ptr<int64_t>());
  // FAULT(frag_epoch)
  out.epoch = e.epoch + 1;
  e.epoch += static_cast<unsigned long long>(launches);
  AK_TRACK_SCRATCH("frag_counters", out.ptr, size_t(e.t.numel()) * 8);
}

// Shared checks already ran (check_w8a16_fragment_matmul). Allocates y [M, N] like x. M > 16 runs as 16-row slices
// (each reads the whole weight again: prefill belongs to w8a16_matmul's tiled kernel).
inline cudaError_t w8a16_fragment_matmul_launch(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& w_scale,
                                                const std::optional<at::Tensor>& bias, DeviceProps props,
                                                cudaStream_t stream, bool capturing, at::Tensor& y) {
  constexpr const char* op = "w8a16_fragment_matmul";
  const auto dt = x_in.scalar_type();
  AK_CHECK(op, dt == at::kHalf || dt == at::kBFloat16, "the CUDA kernel takes x float16 or bfloat16, got ", dt,
           " (float32 runs on the CPU)");
  AK_CHECK(op, aligned16(w.data_ptr()), "w must be 16-byte aligned on CUDA (a slice of a fragment weight at a "
           "16-row boundary is)");
  const int64_t M = x_in.size(0), N = w.size(0), K = x_in.size(1);
  y = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return cudaSuccess;
  AK_TRACK_SCRATCH("y", y.data_ptr(), size_t(y.numel()) * y.element_size());
  if (K == 0) {
    y.zero_();
    if (bias.has_value()) y.add_(bias->to(dt));
    return cudaSuccess;
  }
  // The A fragments are 4-byte loads of x: rows 4-byte aligned, elements contiguous; anything else is copied.
  const bool x_ok = (x_in.stride(1) == 1 || K == 1) && (M == 1 || x_in.stride(0) % 2 == 0) &&
                    reinterpret_cast<uintptr_t>(x_in.data_ptr()) % 4 == 0;
  const at::Tensor x = x_ok ? x_in : x_in.contiguous();
  const at::Tensor scale = w_scale.contiguous();
  at::Tensor b;
  int bias_kind = kFragNoBias;
  if (bias.has_value()) {
    b = bias->scalar_type() == at::kFloat || bias->scalar_type() == dt ? bias->contiguous() : bias->to(at::kFloat);
    bias_kind = b.scalar_type() == at::kFloat ? kFragBiasF32 : kFragBiasT;
  }
  const FragPlan plan = plan_w8a16_fragment(N, K, props);
  at::Tensor part;
  FragCounters counters;  // its lock, when held, is released after the launches are enqueued
  FragParams p{};
  p.sx = M == 1 ? 0 : x.stride(0);
  p.w = static_cast<const int8_t*>(w.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.bias = bias_kind ? b.data_ptr() : nullptr;
  p.bias_kind = bias_kind;
  p.N = int(N);
  p.K = int(K);
  p.groups = int((N + 15) / 16);
  p.units = int(K / kFragUnitK);
  p.tail = int(K % kFragUnitK != 0);
  p.split_units = plan.split_units;
  p.splits = plan.splits;
  if (plan.splits > 1) {
    part = at::empty({plan.part_floats()}, x.options().dtype(at::kFloat));
    AK_TRACK_SCRATCH("frag_part", part.data_ptr(), size_t(part.numel()) * 4);
    p.part = part.data_ptr<float>();
    frag_counters(x, plan.counters(), (M + 15) / 16, stream, capturing, counters);
    p.counters = counters.ptr;
  }
  cudaError_t err = cudaSuccess;
  for (int64_t m0 = 0; m0 < M && err == cudaSuccess; m0 += 16) {
    p.M = int(std::min<int64_t>(16, M - m0));
    p.x = static_cast<const char*>(x.data_ptr()) + m0 * x.stride(0) * x.element_size();
    p.y = static_cast<char*>(y.data_ptr()) + m0 * N * y.element_size();
    // FAULT(frag_slice_epoch)
    p.epoch = counters.epoch + static_cast<unsigned long long>(m0 / 16);  // one epoch per launch
    auto launch = [&](auto tag) {
      using T = decltype(tag);
      err = launch_pdl(w8a16_fragment_kernel<T>, plan.grid, dim3(kFragThreads), 0, stream, p);
    };
    if (dt == at::kHalf) {
      launch(__half{});
    } else {
      launch(__nv_bfloat16{});
    }
  }
  return err;
}

}  // namespace arkernels
