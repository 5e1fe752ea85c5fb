// Integer helpers with no dependencies, usable from host code, device code and the SIMT emulator alike.
#pragma once

#if defined(__CUDACC__)
#define AK_HOST_DEVICE __host__ __device__
#else
#define AK_HOST_DEVICE
#endif

namespace arkernels {

template <typename T>
AK_HOST_DEVICE constexpr inline T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace arkernels
