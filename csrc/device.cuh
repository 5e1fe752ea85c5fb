// The one portability header of the device code: what differs between nvcc (the GPU build) and the SIMT emulator
// (csrc/simt/simt.h, the same sources compiled by the host compiler and run on the CPU). Kernel headers
// (csrc/<stem>_kernels.cuh) include only this (and device_mma.cuh), never ATen or c10, so both builds see the same
// source. What lives here:
//   AK_LAUNCH(kernel, grid, block, smem, stream, args...)   instead of kernel<<<grid, block, smem, stream>>>(args...)
//   AK_SHARED(align, T, name, dims)                        a static __shared__ array (dims: `[N]` or `[A][B]`)
//   AK_DYNAMIC_SHARED(T, name)                             the dynamic shared memory buffer as T*
//   dev::ld_global / dev::st_global                        every global load and store of a kernel: a plain (vector)
//                                                          access on the GPU, counted by the emulator's traffic meter
//   dev::ld_global_cg, atomic_add, atomic_max, threadfence  the same for data blocks exchange within one launch
//   dev::atomic_add_release, fence_acq_rel                  one thread's release / acquire at device scope (below)
//   AK_TRACK_SCRATCH(name, ptr, bytes)                      names a launch's own scratch buffer for the emulator's
//                                                          traffic meter (nothing on the GPU)
//   dev::warp_all / dev::warp_any                           warp votes (__all_sync / __any_sync)
//   dev::cluster_ctarank, cluster_sync[_relaxed], ld_dsmem, st_dsmem  thread-block clusters, distributed shared memory
//   DeviceProps + cuda_device_props()                       what launch planning may ask of a device
// Fast-math intrinsics (__expf, __logf, __int_as_float) and fp16/bf16 conversions are the CUDA headers' own on the
// GPU; the emulator supplies host versions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "int_math.h"

#if defined(ARKERNELS_SIMT)
#include "simt/simt.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#endif

namespace arkernels {

// What launch planning may depend on: shapes and these device properties, nothing else (so the CUDA launcher and the
// emulator, which reads them from a table of sm_80 / sm_90 entries, plan identically).
struct DeviceProps {
  int sm_count = 0;
  int smem_optin = 0;  // bytes of dynamic shared memory one block may opt in to
  int cc_major = 0, cc_minor = 0;
};

namespace dev {

// Global memory access, one place: `T` is the access width (uint4: a 128-bit LDG/STG; an element type: a scalar one).
template <typename T>
__device__ __forceinline__ T ld_global(const T* p) {
#if defined(ARKERNELS_SIMT)
  ::simt::on_global_read(p, sizeof(T));
#endif
  return *p;
}
template <typename T>
__device__ __forceinline__ void st_global(T* p, const T& v) {
#if defined(ARKERNELS_SIMT)
  ::simt::on_global_write(p, sizeof(T));
#endif
  *p = v;
}

// A load that bypasses L1 (ld.global.cg): for data another block wrote during this launch (L1 is not coherent).
template <typename T>
__device__ __forceinline__ T ld_global_cg(const T* p) {
#if defined(ARKERNELS_SIMT)
  ::simt::on_global_read(p, sizeof(T));
#endif
  return __ldcg(p);
}
// Device-scope atomic add (counted as one read and one write) and the device-scope fence.
template <typename T>
__device__ __forceinline__ T atomic_add(T* p, T v) {
#if defined(ARKERNELS_SIMT)
  ::simt::on_global_atomic(p, sizeof(T));
#endif
  return atomicAdd(p, v);
}
// Device-scope atomic max, result unused (a RED.MAX on the GPU; counted as one read and one write).
template <typename T>
__device__ __forceinline__ void atomic_max(T* p, T v) {
#if defined(ARKERNELS_SIMT)
  ::simt::on_global_atomic(p, sizeof(T));
#endif
  atomicMax(p, v);
}
__device__ __forceinline__ void threadfence() { __threadfence(); }

// One thread's release and acquire at device scope, for blocks that publish data and count themselves done (CUTLASS's
// GenericBarrier: __syncthreads, then one thread's red.release; one thread's acquire, then __syncthreads), instead of
// a fence.sc (MEMBAR.SC.GPU) by every thread:
// - atomic_add_release: atom.add.release.gpu. The release is cumulative: it orders before the add every store of this
//   thread and every store another thread of the block made before a __syncthreads this thread passed since.
// - fence_acq_rel: fence.acq_rel.gpu. After an atomic that read a count, it is the acquire of what the releases that
//   count observed published: this thread's later loads see it, and another thread's after a __syncthreads both pass.
// The emulator models both (csrc/simt/simt.h: stores no release published are invisible to later blocks; a load of
// another block's published bytes with no acquire before it is reported).
__device__ __forceinline__ unsigned long long atomic_add_release(unsigned long long* p, unsigned long long v) {
#if defined(ARKERNELS_SIMT)
  ::simt::on_global_atomic(p, sizeof(v));
  ::simt::release_publishes();
  return atomicAdd(p, v);
#else
  unsigned long long old;
  asm volatile("atom.release.gpu.global.add.u64 %0, [%1], %2;\n" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
#endif
}
__device__ __forceinline__ void fence_acq_rel() {
#if defined(ARKERNELS_SIMT)
  std::atomic_thread_fence(std::memory_order_seq_cst);
  ::simt::fence_publishes();
#else
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
#endif
}

// Thread-block clusters (sm_90; launched by csrc/cluster.cuh's launch_cluster). AK_CLUSTER_CODE is 1 where the
// instructions exist (sm_90+ device code, and the emulator): a kernel compiles its cluster path only there; elsewhere
// these functions trap (a launcher that takes the cluster path only on sm_90 cubins never reaches them).
// - cluster_ctarank / cluster_nctarank: the block's rank in its cluster and the cluster's block count.
// - cluster_sync: barrier.cluster.arrive.release + barrier.cluster.wait.acquire (both .aligned: every thread of the
//   warp executes them together): every thread of every block of the cluster arrives; what each wrote to shared
//   memory before it is visible to every thread of the cluster after it. A block must pass one after its last
//   distributed-shared-memory access and after the last access other blocks make to its shared memory, before it
//   exits (an exited block's shared memory is gone).
// - cluster_sync_relaxed: barrier.cluster.arrive.relaxed + barrier.cluster.wait: the same rendezvous without the
//   arrival's release (which ptxas emits as a MEMBAR.ALL.GPU: every thread waits for its global stores to be
//   acknowledged): for a barrier that publishes nothing, e.g. the one that keeps shared memory alive until the other
//   blocks' DSMEM loads of it, whose values their threads consumed before arriving, have completed.
// - ld_dsmem / st_dsmem: a load / store at the address `p` of the caller's dynamic shared memory maps to in block
//   `rank`'s (mapa.shared::cluster, then ld / st.shared::cluster): float, float2, float4.
// The emulator (csrc/simt/simt_cluster.h) runs a cluster's blocks at once and reports accesses no cluster barrier
// orders (a load of bytes written after the loader's last barrier, a block exiting while another may access it).
#if defined(ARKERNELS_SIMT) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define AK_CLUSTER_CODE 1
#else
#define AK_CLUSTER_CODE 0
#endif
#if defined(ARKERNELS_SIMT)
__device__ __forceinline__ unsigned cluster_ctarank() { return ::simt::cluster_ctarank(); }
__device__ __forceinline__ unsigned cluster_nctarank() { return ::simt::cluster_nctarank(); }
__device__ __forceinline__ void cluster_sync(int line = __builtin_LINE()) { ::simt::cluster_sync(line, true); }
__device__ __forceinline__ void cluster_sync_relaxed(int line = __builtin_LINE()) {
  ::simt::cluster_sync(line, false);
}
template <typename T>
__device__ __forceinline__ T ld_dsmem(const T* p, unsigned rank) {
  return ::simt::ld_dsmem(p, rank);
}
template <typename T>
__device__ __forceinline__ void st_dsmem(T* p, unsigned rank, const T& v) {
  ::simt::st_dsmem(p, rank, v);
}
#else
__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r = 0;
#if AK_CLUSTER_CODE
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ unsigned cluster_nctarank() {
  unsigned r = 1;
#if AK_CLUSTER_CODE
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ void cluster_sync() {
#if AK_CLUSTER_CODE
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
__device__ __forceinline__ void cluster_sync_relaxed() {
#if AK_CLUSTER_CODE
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
// The shared::cluster address of `p` (the caller's shared memory) in block `rank`: pure, so repeated maps fold.
__device__ __forceinline__ uint32_t dsmem_addr(const void* p, unsigned rank) {
  uint32_t r = 0;
#if AK_CLUSTER_CODE
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
#endif
  return r;
}
template <typename T>
__device__ __forceinline__ T ld_dsmem(const T* p, unsigned rank) {
  T v{};
#if AK_CLUSTER_CODE
  const uint32_t a = dsmem_addr(p, rank);
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
  } else if constexpr (std::is_same_v<T, float2>) {
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory");
  } else {
    static_assert(std::is_same_v<T, float4>, "ld_dsmem: float, float2 or float4");
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return v;
}
template <typename T>
__device__ __forceinline__ void st_dsmem(T* p, unsigned rank, const T& v) {
#if AK_CLUSTER_CODE
  const uint32_t a = dsmem_addr(p, rank);
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(a), "f"(v) : "memory");
  } else if constexpr (std::is_same_v<T, float2>) {
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(v.x), "f"(v.y) : "memory");
  } else {
    static_assert(std::is_same_v<T, float4>, "st_dsmem: float, float2 or float4");
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w) : "memory");
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
#endif

// Warp votes over all 32 lanes (every lane must call; the result is the same in every lane): one VOTE on the GPU; the
// emulator forms them from xor shuffles, which check the mask and the lanes' convergence as a vote would.
__device__ __forceinline__ bool warp_all(bool v) {
#if defined(ARKERNELS_SIMT)
  int x = v;
  for (int d = 1; d < 32; d *= 2) x &= __shfl_xor_sync(0xffffffffu, x, d);
  return x != 0;
#else
  return __all_sync(0xffffffffu, v);
#endif
}
__device__ __forceinline__ bool warp_any(bool v) {
#if defined(ARKERNELS_SIMT)
  int x = v;
  for (int d = 1; d < 32; d *= 2) x |= __shfl_xor_sync(0xffffffffu, x, d);
  return x != 0;
#else
  return __any_sync(0xffffffffu, v);
#endif
}

}  // namespace dev
}  // namespace arkernels

#if defined(ARKERNELS_SIMT)
#define AK_LAUNCH(kernel, grid, block, smem, stream, ...) ::simt::launch((grid), (block), (smem), (kernel), __VA_ARGS__)
#define AK_SHARED(align, T, name, dims) \
  alignas(align) static T name dims;    \
  ::simt::register_shared(name, sizeof(name))
#define AK_DYNAMIC_SHARED(T, name) T* const name = reinterpret_cast<T*>(::simt::dyn_smem())
#define AK_SET_MAX_DYNAMIC_SMEM(kernel, bytes) ::simt::set_max_dynamic_smem((kernel), (bytes))
#define AK_LAST_ERROR() cudaSuccess
#define AK_TRACK_SCRATCH(name, ptr, bytes) ::simt::track_buffer((name), (ptr), (bytes))
#else
#define AK_LAUNCH(kernel, grid, block, smem, stream, ...) (kernel)<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define AK_SHARED(align, T, name, dims) __shared__ __align__(align) T name dims
#define AK_DYNAMIC_SHARED(T, name) \
  extern __shared__ __align__(128) unsigned char ak_dynamic_smem_[]; \
  T* const name = reinterpret_cast<T*>(ak_dynamic_smem_)
#define AK_SET_MAX_DYNAMIC_SMEM(kernel, bytes) \
  cudaFuncSetAttribute((kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes))
#define AK_LAST_ERROR() cudaGetLastError()
#define AK_TRACK_SCRATCH(name, ptr, bytes) ((void)0)
#endif
