// Shared helpers for every arkernels kernel: input checks (written once), dtype dispatch, ceil_div.
// Light includes only: this header is pulled into .cu files, and torch/extension.h would make each of
// them several times slower to compile.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace arkernels {

template <typename T>
C10_HOST_DEVICE constexpr inline T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace arkernels

// Every message names the op and the argument, so the user can act on it.
#define AK_CHECK(op, cond, ...) TORCH_CHECK((cond), op ": ", __VA_ARGS__)

#define AK_CHECK_DIM(op, t, name, n) \
  AK_CHECK(op, (t).dim() == (n), name " must be ", n, "-D, got ", (t).dim(), "-D ", (t).sizes())

#define AK_CHECK_DTYPE(op, t, name, dt) \
  AK_CHECK(op, (t).scalar_type() == (dt), name " must be ", dt, ", got ", (t).scalar_type())

#define AK_CHECK_SAME_DEVICE(op, a, aname, b, bname)                                               \
  AK_CHECK(op, (a).device() == (b).device(), aname " and " bname " must be on one device, got ", \
           (a).device(), " and ", (b).device())

#define AK_CHECK_LAST_CONTIGUOUS(op, t, name) \
  AK_CHECK(op, (t).size(-1) <= 1 || (t).stride(-1) == 1, name " must have a contiguous last dimension, got strides ", (t).strides())

// fp32, fp16 and bf16: the dtypes every floating kernel in this package claims.
#define AK_DISPATCH_FLOAT(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
