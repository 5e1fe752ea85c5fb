// Tensor-core and async-copy primitives, one set of device functions for every kernel: inline PTX under nvcc
// (sm_80+), the emulation of csrc/simt/simt_mma.h under ARKERNELS_SIMT (same names, same per-lane fragments).
//   mma_m16n8k16<T>(d, a, b, c)   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: D = A*B + C,
//                                 A 16x16 row-major (4 regs of 2 elements), B 16x8 "col" (2 regs), C/D 16x8 fp32 (4)
//   ldmatrix_x{1,2,4}[_trans](r, p) ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lane l gives the address
//                                 of row l%8 of matrix l/8 (16-byte aligned), register i gets matrix i
//   cp_async_16(dst, src, n)      cp.async.cg.shared.global 16 bytes, bytes [n, 16) zero-filled, src not read if n == 0
//   cp_async_16_or_zero(dst, src, read)  the same with n = read ? 16 : 0, as the ignore-src predicate: no src-size
//                                 arithmetic in SASS (the src-size form costs ~5 more instructions per copy on sm_90)
//   cp_async_commit() / cp_async_wait<N>() / cp_async_wait_all()   commit_group / wait_group N / wait_all
//   bf16_f16_pow2(bits) / bf16x2_to_f16x2(w, 2^e) / warp_bf16_to_f16<R, C, LD>(rows)   bf16 operands into fp16
//                                 MMAs times a power of two (below; bf16x2_abs_max_bits: the input of the first)
// Fragment layouts (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type"), g = lane/4, t = lane%4,
// the lower 16 bits of a register hold the lower-indexed element:
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   c/d  = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}
// ldmatrix: lane l receives M[l/4][2(l%4)..2(l%4)+1] of each matrix M, or with .trans M[2(l%4)][l/4], M[2(l%4)+1][l/4]
// (so x4 over a row-major 16x16 tile gives the A fragment, x2/x4 .trans over a row-major [k][n] tile gives B).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(ARKERNELS_SIMT)
#include "simt/simt.h"
#include "simt/simt_mma.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace arkernels {
namespace dev {

#if defined(ARKERNELS_SIMT)

// The emulation takes the caller's line (__builtin_LINE() as a default argument) so that lanes meeting at different
// call sites are reported as a divergent collective; the GPU functions do not have that parameter.
template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                         int line = __builtin_LINE()) {
  ::simt::mma::mma_m16n8k16<T>(d, a, b, c, line);
}
#define AK_SIMT_LDMATRIX(name, n, trans)                                                          \
  inline void name(uint32_t (&r)[n], const void* p, int line = __builtin_LINE()) {                \
    ::simt::mma::ldmatrix<n, trans>(r, p, line);                                                  \
  }
AK_SIMT_LDMATRIX(ldmatrix_x1, 1, false)
AK_SIMT_LDMATRIX(ldmatrix_x2, 2, false)
AK_SIMT_LDMATRIX(ldmatrix_x4, 4, false)
AK_SIMT_LDMATRIX(ldmatrix_x1_trans, 1, true)
AK_SIMT_LDMATRIX(ldmatrix_x2_trans, 2, true)
AK_SIMT_LDMATRIX(ldmatrix_x4_trans, 4, true)
#undef AK_SIMT_LDMATRIX
inline void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  ::simt::mma::cp_async_16(smem_dst, gmem_src, src_bytes);
}
inline void cp_async_16_or_zero(void* smem_dst, const void* gmem_src, bool read) {
  ::simt::mma::cp_async_16(smem_dst, gmem_src, read ? 16 : 0);
}
inline void cp_async_commit() { ::simt::mma::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group takes a non-negative count");
  ::simt::mma::cp_async_wait(N);
}
inline void cp_async_wait_all() { ::simt::mma::cp_async_wait_all(); }

#else  // nvcc

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "device_mma.cuh: mma.sync m16n8k16 with bf16, ldmatrix and cp.async need sm_80 or newer"
#endif

// Ordering of the inline asm against memory, stated (the compiler sees only the operands it is given):
// - mma.sync reads and writes registers only: its operands carry every dependency, so it has no "memory" clobber
//   (one would only keep the compiler from moving unrelated loads and stores around the tensor-core work).
// - ldmatrix reads shared memory through an address the compiler cannot follow: it carries a "memory" clobber, so
//   the compiler keeps it in program order with the C++ loads and stores around it (without, only the barriers
//   between a tile's stores and its ldmatrix -- compiler barriers too -- kept them apart); stores by other threads,
//   even of the same warp, still need a barrier (__syncwarp / __syncthreads), which orders the hardware as well.
// - cp.async and its commit / wait carry "memory" clobbers (below): shared-memory reads of a destination stay after
//   the wait that lands it, and the issue stays after earlier writes of its source.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             const float (&c)[4]);
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                     const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      // FAULT(ptx_mma_f16_operands)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                            const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x1(uint32_t (&r)[1], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t (&r)[1], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* p) {
  // FAULT(ptx_ldmatrix_x2_trans)
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// "memory" clobbers: the compiler must not move shared-memory reads of the destination across the wait, nor the
// issue across earlier writes of the source.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_16_or_zero(void* smem_dst, const void* gmem_src, bool read) {
  asm volatile(
      "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, ignore;\n}\n" ::"r"(
          smem_addr(smem_dst)),
      "l"(gmem_src), "r"(int(read))
      : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

#endif

// bf16 operands of fp16 MMAs (fp8 caches under bf16 queries: e4m3 -> f16x2 is one cvt per pair, into bf16 four).
// The bf16 values go in times 2^e, e chosen from the largest magnitude's biased exponent `ex` (bits 7..14 of the bf16:
// |x| < 2^(ex - 126)) so that it lands in fp16's top binade, [2^15, 2^16): the largest bf16 significand, 1.9921875,
// times 2^15 is 65280 < 65504, so every scaled value is finite, and every value down to 2^-29 of the largest keeps all
// its 8 significant bits (fp16: 11, subnormal below 2^-14). Clamped to [-112, 64]: 2^e and 2^-e stay normal floats
// (a zero or subnormal maximum takes 2^64; inf / NaN stay inf / NaN). bf16_f16_pow2 returns e, bf16x2_to_f16x2 converts
// one register (two bf16, low element first) times up = 2^e, round to nearest (exact but below fp16's normal range).
__device__ __forceinline__ int bf16_f16_pow2(uint32_t max_abs_bits) {
  const int ex = static_cast<int>(max_abs_bits >> 7);
  // FAULT(bf16_f16_pow2)
  const int e = 142 - ex;
  return e < -112 ? -112 : (e > 64 ? 64 : e);
}
// The larger |x| of a register's two bf16, as bits without the sign (the input of bf16_f16_pow2).
__device__ __forceinline__ uint32_t bf16x2_abs_max_bits(uint32_t x) {
  const uint32_t lo = x & 0x7fffu, hi = (x >> 16) & 0x7fffu;
  return lo > hi ? lo : hi;
}
__device__ __forceinline__ float pow2f(int e) {  // 2^e for e in [-126, 127]
  const uint32_t bits = uint32_t(127 + e) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w, float up) {
  const uint32_t lo_bits = w << 16, hi_bits = w & 0xffff0000u;
  float lo, hi;
  memcpy(&lo, &lo_bits, 4);
  memcpy(&hi, &hi_bits, 4);
  const __half a = __float2half_rn(lo * up), c = __float2half_rn(hi * up);
  uint16_t ua, uc;
  memcpy(&ua, &a, 2);
  memcpy(&uc, &c, 2);
  return uint32_t(ua) | uint32_t(uc) << 16;
}

// A warp's R x C block of bf16 in shared memory (rows LD elements apart, 16-byte aligned; C % 8 == 0) -> fp16 in
// place, times 2^e from the block's largest |x| (bf16_f16_pow2); returns 2^-e, for the scale that takes it back
// (exact: a power of two). Every lane of the warp calls it; it ends with a __syncwarp (the block is then the warp's
// to read, as ldmatrix operands).
template <int R, int C, int LD>
__device__ __forceinline__ float warp_bf16_to_f16(uint16_t* rows) {
  constexpr int kChunks = C / 8;  // 16-byte chunks per row
  const int lane = threadIdx.x % 32;
  int mx = 0;  // the largest |x| of the lane's chunks, as bf16 bits without the sign
  for (int i = lane; i < R * kChunks; i += 32) {
    const uint4 w = *reinterpret_cast<const uint4*>(rows + i / kChunks * LD + i % kChunks * 8);
    for (const uint32_t x : {w.x, w.y, w.z, w.w}) mx = max(mx, int(bf16x2_abs_max_bits(x)));
  }
  for (int d = 1; d < 32; d *= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  const int e = bf16_f16_pow2(uint32_t(mx));
  const float up = pow2f(e);
  for (int i = lane; i < R * kChunks; i += 32) {
    uint4* const at = reinterpret_cast<uint4*>(rows + i / kChunks * LD + i % kChunks * 8);
    const uint4 w = *at;
    *at = make_uint4(bf16x2_to_f16x2(w.x, up), bf16x2_to_f16x2(w.y, up), bf16x2_to_f16x2(w.z, up),
                     bf16x2_to_f16x2(w.w, up));
  }
  __syncwarp();
  // FAULT(prefill_q_pow2_fold)
  return pow2f(-e);
}

}  // namespace dev
}  // namespace arkernels
