// Programmatic dependent launch (PDL, sm_90+) for arkernels' own kernels: a kernel's launch, block scheduling and
// prologue (parameters, index arithmetic, shared-memory set-up) overlap the tail of the kernel before it in the stream.
//
// The protocol (PTX ISA, "griddepcontrol"; CUDA programming guide, "Programmatic Dependent Launch"):
// - The launch carries cudaLaunchAttributeProgrammaticStreamSerialization = 1 (launch_pdl below, on devices of compute
//   capability >= 9.0 running a cubin built for sm_90+). The kernel may then start before the kernel ahead of it in
//   the stream (its prerequisite) has finished: as soon as every CTA of the prerequisite has executed
//   griddepcontrol.launch_dependents or exited (a prerequisite that never executes it triggers when it completes).
// - dev::pdl_wait() (griddepcontrol.wait) blocks the executing thread until every prerequisite grid in flight has
//   completed and all of its memory operations are performed and visible to this grid. Before it, a thread may touch
//   no global memory a preceding kernel may write or read: a load may see data not yet written (Q, K/V pages, block
//   tables, seq_lens, cu_seqlens_q, slot mappings: all written upstream), and a store may overwrite what the
//   predecessor still reads (an output or scratch buffer the caching allocator just recycled in stream order). So in
//   every kernel here only kernel parameters, pure index arithmetic and shared-memory set-up precede it; the asm's
//   "memory" clobber keeps the compiler from hoisting a load above it (scripts/sass_report.py checks that no global
//   access precedes the wait in the SASS: column PDL).
// - Every thread executes pdl_wait() before it exits, even one with nothing to load: a grid then cannot complete before
//   its prerequisite has, so "kernel N finished" still implies "every kernel before N finished" for the kernels after
//   it (whose own wait covers only their immediate prerequisite) and for the host (events, synchronisation).
// - dev::pdl_launch_dependents() (griddepcontrol.launch_dependents) lets the next PDL launch in the stream be scheduled
//   once every CTA of this grid has executed it (the first thread of a CTA to execute it counts for the CTA; more
//   calls do nothing) or exited. It promises nothing about memory: the dependent's own pdl_wait() still waits for this
//   grid's completion and memory flush, so where it is placed changes speed only, never results. Every CTA of this
//   grid must have executed it before any dependent CTA is scheduled, so a dependent never takes a place one of our
//   unscheduled CTAs needed; its CTAs do hold SM resources (registers, shared memory) while they wait. Placement: where
//   the kernel's main loop is over (attention: after the key loop, before the epilogue's merge, write-out and split-KV
//   combine, so the successor's launch and prologue overlap that epilogue), or right after the wait in the one-pass
//   copy kernels (paged_kv: their whole body is the loop; the successor's CTAs take the places ours free).
// On sm_80 (and in any cubin built for < sm_90) both functions compile to nothing and launches are plain: no
// griddepcontrol instruction is emitted (sass_report: PDL "-" in sm_80 cubins, ACQBULK / PREEXIT in sm_90 ones).
// ARKERNELS_PDL=0 in the environment (read once per process) makes every launch plain: the switch that measures the
// overlap (benchmarks/gpu_check.sh) and the way out should a driver misbehave.
// The SIMT emulator (csrc/simt/simt.h) runs the same launches as PDL launches when its device is sm_90 and reports any
// global access of a thread before its pdl_wait(), and a thread that exits without one (tests/test_simt_emulator.py,
// scripts/simt_faults.py "pdl:").
#pragma once

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "device.cuh"

namespace arkernels {
namespace dev {

__device__ __forceinline__ void pdl_wait() {
#if defined(ARKERNELS_SIMT)
  ::simt::pdl_wait();
// FAULT(pdl_ptx_wait)
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(ARKERNELS_SIMT)
  ::simt::pdl_launch_dependents();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace dev

// False when ARKERNELS_PDL=0 (read once per process): every launch plain.
inline bool pdl_allowed_by_env() {
  static const bool on = [] {
    const char* e = std::getenv("ARKERNELS_PDL");
    return !(e != nullptr && std::strcmp(e, "0") == 0);
  }();
  return on;
}

#if !defined(ARKERNELS_SIMT)
// Whether `kernel` may be launched with PDL on the current device: compute capability >= 9.0 and the cubin that runs
// was compiled for a virtual arch >= 9.0 (cudaFuncAttributes::ptxVersion): a "+PTX" build of compute_80 JIT-compiled
// for an sm_90 GPU has no griddepcontrol.wait, and a PDL launch of it would race its predecessor. Both queried once
// per (kernel, device) and cached (a map under a mutex: a few dozen entries, ~50 ns a launch).
inline cudaError_t pdl_usable(const void* kernel, bool& usable) {
  usable = false;
  if (!pdl_allowed_by_env()) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<const void*, int>, bool>();  // never destroyed: launches at exit
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = cache->find({kernel, device});
  if (it != cache->end()) {
    usable = it->second;
    return cudaSuccess;
  }
  int major = 0;
  err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  bool ok = false;
  if (major >= 9) {
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) return err;
    ok = attr.ptxVersion >= 90;
  }
  cache->emplace(std::make_pair(kernel, device), ok);
  usable = ok;
  return cudaSuccess;
}

// The one launch of every arkernels kernel (the caller holds the device guard and passes the current stream):
// cudaLaunchKernelEx with programmatic stream serialization where pdl_usable says so, else the same call without
// attributes (a plain launch). Returns the launch's error; the runtime's last-error state is cleared as the
// <<<>>> + cudaGetLastError path did.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  bool pdl = false;
  cudaError_t err = pdl_usable(reinterpret_cast<const void*>(kernel), pdl);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  const cudaError_t last = cudaGetLastError();
  return err != cudaSuccess ? err : last;
}
#else
// The emulator: a PDL launch (its sanitizer rule on) where the emulated device is sm_90 and ARKERNELS_PDL allows it.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
                       Args&&... args) {
  // FAULT(pdl_simt_launch)
  ::simt::launch_pdl(pdl_allowed_by_env() && ::simt::device().cc_major >= 9, grid, block, smem, kernel,
                     std::forward<Args>(args)...);
  return cudaSuccess;
}
#endif

}  // namespace arkernels
