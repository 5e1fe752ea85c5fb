// int8_matmul (the hand-written w8a16 fragment GEMV): input checks shared by the CPU and CUDA kernels (one copy, so
// both refuse the same inputs).
#pragma once

#include "common.h"

namespace arkernels {

// x [M, K] fp32|fp16|bf16 (fp32: the CPU kernel only; rows strided, any strides accepted: the launcher copies what
// the kernel cannot read); w int8 [N, K / 16, 4, 4] contiguous (the fragment layout, LAYOUT_FRAGMENT of
// arkernels/ops/int8_matmul_layout.py); w_scale fp32 [N]; bias [N] fp32|fp16|bf16 or None.
inline void check_w8a16_fragment_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                        const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "w8a16_fragment_matmul";
  AK_CHECK_DIM(op, x, "x", 2);
  const auto xt = x.scalar_type();
  AK_CHECK(op, xt == at::kFloat || xt == at::kHalf || xt == at::kBFloat16,
           "x must be float16 or bfloat16 (float32 on the CPU), got ", xt);
  AK_CHECK(op, w.dim() == 4 && w.size(2) == 4 && w.size(3) == 4 && w.is_contiguous(),
           "w must be the fragment layout [N, K / 16, 4, 4], contiguous (fragment_weight), got shape ", w.sizes(),
           ", strides ", w.strides());
  AK_CHECK_DTYPE(op, w, "w", at::kChar);
  const int64_t N = w.size(0), K = w.size(1) * 16;
  AK_CHECK(op, x.size(1) == K, "K mismatch: x is [M, K] = ", x.sizes(), " and w holds [N, K] = [", N, ", ", K, "]");
  AK_CHECK(op, N <= INT32_MAX - 16 && K <= INT32_MAX - 32, "N and K must fit in int32, got ", N, " and ", K);
  AK_CHECK_DIM(op, w_scale, "w_scale", 1);
  AK_CHECK(op, w_scale.size(0) == N, "w_scale must have shape [N = ", N, "], got ", w_scale.sizes());
  AK_CHECK_DTYPE(op, w_scale, "w_scale", at::kFloat);
  AK_CHECK_SAME_DEVICE(op, x, "x", w, "w");
  AK_CHECK_SAME_DEVICE(op, x, "x", w_scale, "w_scale");
  if (bias.has_value()) {
    const auto bt = bias->scalar_type();
    AK_CHECK_DIM(op, (*bias), "bias", 1);
    AK_CHECK(op, bias->size(0) == N, "bias must have shape [N = ", N, "], got ", bias->sizes());
    AK_CHECK(op, bt == at::kFloat || bt == at::kHalf || bt == at::kBFloat16,
             "bias must be float32, float16 or bfloat16, got ", bt);
    AK_CHECK_SAME_DEVICE(op, x, "x", (*bias), "bias");
  }
}

}  // namespace arkernels
