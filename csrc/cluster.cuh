// Thread-block cluster launches (sm_90+) for arkernels' own kernels: the CTAs of one cluster are scheduled together on
// one GPC and may read and write each other's shared memory (distributed shared memory, DSMEM: csrc/device.cuh's
// dev::ld_dsmem / st_dsmem) between cluster barriers (dev::cluster_sync).
// - launch_cluster: cudaLaunchKernelEx with cudaLaunchAttributeClusterDimension (x blocks per cluster) and, where
//   pdl_usable says so (pdl.cuh), programmatic stream serialization: the kernel still waits (pdl_wait) before any
//   global access, as every PDL launch does.
// - cluster_plannable(props): launch planning may count on clusters: compute capability >= 9.0 and ARKERNELS_CLUSTER
//   not 0 (read once per process: the switch that measures the cluster path, benchmarks/gpu_check.sh, and the way
//   out should a driver misbehave). Planning decides split counts from it; the launcher then confirms per kernel.
// - cluster_usable(kernel, ...): the cubin that runs was built for a virtual arch >= 9.0 (cudaFuncAttributes::
//   ptxVersion: a compute_80 "+PTX" build JIT-compiled for sm_90 has the cluster path compiled out), clusters above 8
//   blocks are allowed (cudaFuncAttributeNonPortableClusterSizeAllowed, set here), and every cluster of the grid is
//   resident at once (cudaOccupancyMaxActiveClusters: a GPC too small for a 16-block cluster, or shared memory that
//   packs too few blocks per SM, would run the clusters in several waves). Queried once per (kernel, device, cluster,
//   shared memory) and cached. Where it says no, the caller takes its non-cluster path.
// The SIMT emulator (csrc/simt/simt_cluster.h) runs a cluster launch's blocks concurrently and refuses what a GPU
// refuses (more than 8 blocks without the attribute, more than 16, a grid not divisible by the cluster, sm_80);
// cluster placement (the occupancy query) is not modelled there: every cluster is taken to be resident.
#pragma once

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "device.cuh"
#include "pdl.cuh"

namespace arkernels {

constexpr int kClusterMaxPortable = 8;  // blocks per cluster every sm_90 GPU accepts
constexpr int kClusterMax = 16;         // with cudaFuncAttributeNonPortableClusterSizeAllowed (H100 / H200)

// False when ARKERNELS_CLUSTER=0 (read once per process).
inline bool cluster_allowed_by_env() {
  static const bool on = [] {
    const char* e = std::getenv("ARKERNELS_CLUSTER");
    return !(e != nullptr && std::strcmp(e, "0") == 0);
  }();
  return on;
}

inline bool cluster_plannable(const DeviceProps& props) {
#if defined(ARKERNELS_SIMT)
  if (!::simt::g_cluster_enabled) return false;
#endif
  return props.cc_major >= 9 && cluster_allowed_by_env();
}

#if !defined(ARKERNELS_SIMT)
inline cudaError_t cluster_usable(const void* kernel, dim3 grid, dim3 block, size_t smem, unsigned cluster,
                                  bool& usable) {
  usable = false;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::mutex mu;
  static auto* cache = new std::map<std::tuple<const void*, int, unsigned, size_t, long>, bool>();  // never freed
  const long clusters = long(grid.x) * grid.y * grid.z / cluster;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(kernel, device, cluster, smem, clusters);
  const auto it = cache->find(key);
  if (it != cache->end()) {
    usable = it->second;
    return cudaSuccess;
  }
  cudaFuncAttributes attr{};
  err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  bool ok = attr.ptxVersion >= 90 && cluster <= unsigned(kClusterMax) && grid.x % cluster == 0;
  if (ok && cluster > unsigned(kClusterMaxPortable)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
  }
  if (ok) {
    cudaLaunchAttribute a[1] = {};
    a[0].id = cudaLaunchAttributeClusterDimension;
    a[0].val.clusterDim.x = cluster;
    a[0].val.clusterDim.y = 1;
    a[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = a;
    cfg.numAttrs = 1;
    int active = 0;
    err = cudaOccupancyMaxActiveClusters(&active, kernel, &cfg);
    if (err != cudaSuccess) return err;
    ok = active >= clusters;
  }
  cache->emplace(key, ok);
  usable = ok;
  return cudaSuccess;
}

// One launch in clusters of `cluster` blocks along x (the caller checked cluster_usable), PDL where pdl_usable says
// so; the caller holds the device guard and passes the current stream. Returns the launch's error.
template <typename... KArgs, typename... Args>
cudaError_t launch_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                           unsigned cluster, Args&&... args) {
  bool pdl = false;
  cudaError_t err = pdl_usable(reinterpret_cast<const void*>(kernel), pdl);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[2] = {};
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  const cudaError_t last = cudaGetLastError();
  return err != cudaSuccess ? err : last;
}
#else
// The emulator: the kernel's attribute set as on a GPU (the emulator refuses > 8 blocks without it); every cluster
// taken to be resident.
inline cudaError_t cluster_usable(const void* kernel, dim3 grid, dim3, size_t, unsigned cluster, bool& usable) {
  usable = cluster <= unsigned(kClusterMax) && grid.x % cluster == 0;
  if (usable && cluster > unsigned(kClusterMaxPortable)) ::simt::g_nonportable_cluster[kernel] = true;
  return cudaSuccess;
}
template <typename... KArgs, typename... Args>
cudaError_t launch_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
                           unsigned cluster, Args&&... args) {
  ::simt::launch_cluster(pdl_allowed_by_env() && ::simt::device().cc_major >= 9, dim3(cluster, 1, 1), grid, block,
                         smem, kernel, std::forward<Args>(args)...);
  return cudaSuccess;
}
#endif

}  // namespace arkernels
