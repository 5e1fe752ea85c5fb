// int8_matmul on the CPU: the w8a16 fragment GEMV's CPU kernel (same schema and checks as csrc/int8_matmul.cu). It
// reads the fragment layout element by element (the offsets of int8_matmul_kernels.cuh's header), dequantises to fp32
// [N, K] and multiplies in fp32 (x fp32 | fp16 | bf16), the scale applied after the sum, as the GPU kernel does.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <torch/library.h>

#include "int8_matmul.h"

namespace arkernels {
namespace {

// The plain fp32 values [N, K] of a fragment weight: whole 16-row groups in fragment order (512-byte units of 32
// columns, a 256-byte unit for a 16-column K tail), a short last group plain.
at::Tensor unfragment_f32(const at::Tensor& w, int64_t N, int64_t K) {
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const int8_t* src = static_cast<const int8_t*>(w.data_ptr());
  float* dst = out.data_ptr<float>();
  const int64_t units = K / 32, groups = (N + 15) / 16;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t G = g0; G < g1; ++G) {
      const int8_t* gb = src + G * 16 * K;
      const int64_t rows = std::min<int64_t>(16, N - G * 16);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = dst + (G * 16 + r) * K;
        if (rows < 16) {  // the short last group: plain
          for (int64_t k = 0; k < K; ++k) row[k] = gb[r * K + k];
          continue;
        }
        const int64_t j = r / 8, g = r % 8;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t u = k / 32, s = (k % 32) / 16, h = (k % 16) / 8, t = (k % 8) / 2, e = k % 2;
          const int64_t off = u < units ? u * 512 + (4 * g + t) * 16 + 8 * s + 4 * j + 2 * h + e
                                        : units * 512 + (4 * g + t) * 8 + 4 * j + 2 * h + e;
          row[k] = gb[off];
        }
      }
    }
  });
  return out;
}

at::Tensor w8a16_fragment_matmul_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                     const std::optional<at::Tensor>& bias) {
  check_w8a16_fragment_matmul(x, w, w_scale, bias);
  const int64_t N = w.size(0), K = x.size(1);
  at::Tensor acc = at::matmul(x.to(at::kFloat), unfragment_f32(w, N, K).t());
  acc.mul_(w_scale.unsqueeze(0));
  if (bias.has_value()) acc.add_(bias->to(at::kFloat).unsqueeze(0));
  return acc.to(x.scalar_type());
}

}  // namespace
}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CPU, m) { m.impl("w8a16_fragment_matmul", &arkernels::w8a16_fragment_matmul_cpu); }
