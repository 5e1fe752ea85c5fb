// paged_kv device code and launch planning: append new K/V rows into the paged cache, gather sequences out of it.
// No ATen here: nvcc compiles this for the GPU (csrc/paged_kv.cu) and the host compiler for the SIMT emulator
// (csrc/simt/simt_ops.cpp), from the same source.
//
// Layout: caches [num_blocks, block_size, num_kv_heads, head_dim] (last dim contiguous, other strides free);
// slot = block * block_size + offset. Both kernels only move bytes, so they are dtype-agnostic: a row of head_dim
// elements is copied in 16-byte units (uint4) when every base pointer and byte stride is 16-byte aligned, else element
// by element (2 or 4 bytes). Parallelisation: a CTA of 256 threads owns `rows_per_cta` token rows (append) or sequence
// positions (gather), chosen so that a CTA has about 256 units of work even for small head counts; threads stride
// over (row, head, unit). Offsets are int64: num_blocks * block_size * heads * head_dim passes 2^31 on real caches.
// Bytes: append reads each given K/V byte once and writes it once (plus one slot id per token); gather reads each
// visible cache byte once and writes the output once (zeros past a sequence's length). The emulator's traffic meter
// checks both ratios in tests/test_paged_kv.py. Resources: `python scripts/sass_report.py` (figures: docs/kernels.md).
// fp8 caches (float8_e4m3fn, vLLM's convention): paged_kv_append_fp8_kernel converts instead of copying: each element
// of the fp32/fp16/bf16 key/value becomes saturate_e4m3(x / scale) (IEEE division __fdiv_rn, not fast-math's
// approximation, so the GPU, the emulator and the CPU kernel store the same bytes; cvt.rn.satfinite: round to nearest
// even, clamped to +-448, NaN kept). A thread converts V elements: one 16-byte load, one V-byte store (else V = 1).
// Gather stays a byte copy (1-byte units for fp8); dequantization is the reader's (window_attention, the wrapper).
// Launches overlap the kernel before them on sm_90 (programmatic dependent launch, pdl.cuh): each kernel waits before
// its first global access and lets its successor be scheduled right after.
#pragma once

#include <cstring>
#include <type_traits>

#include "device.cuh"
#include "pdl.cuh"

#include <cuda_fp8.h>  // __nv_cvt_float_to_fp8: cvt.rn.satfinite on sm_89+, the header's own software path elsewhere

namespace arkernels {

constexpr int kPagedKvThreads = 256;

// The append's work split, one place for both kernels: rows of `units` units each (per head), one CTA takes token rows
// [blockIdx.x * rows_per_cta, ...); calls unit(t, h, u, dst) for every unit whose slot is valid, dst = the cache offset
// of unit u of head h at that slot (in cache elements of `unit_elems`-element units).
template <typename Slot, typename F>
__device__ __forceinline__ void paged_kv_for_each_unit(const Slot* slot_mapping, int64_t num_tokens, int64_t num_slots,
                                                       int64_t block_size, int heads, int units, int unit_elems,
                                                       int rows_per_cta, int64_t cache_s0, int64_t cache_s1,
                                                       int64_t cache_s2, F&& unit) {
  const int work = rows_per_cta * heads * units;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int u = i % units;
    const int h = (i / units) % heads;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * rows_per_cta + i / (units * heads);
    if (t >= num_tokens) return;  // i only grows, so t does too
    const int64_t slot = static_cast<int64_t>(dev::ld_global(slot_mapping + t));
    // FAULT(append_slot_check)
    if (slot < 0 || slot >= num_slots) continue;  // padding (or past the cache): never written
    // FAULT(append_row)
    const int64_t row = (slot / block_size) * cache_s0 + (slot % block_size) * cache_s1 + h * cache_s2;
    unit(t, h, u, row + int64_t(u) * unit_elems);
  }
}

// Rows of `units` copy units each (strides in units).
template <typename Unit, typename Slot>
__global__ void __launch_bounds__(kPagedKvThreads)
    paged_kv_append_kernel(const Unit* __restrict__ key, const Unit* __restrict__ value, Unit* __restrict__ k_cache,
                           Unit* __restrict__ v_cache, const Slot* __restrict__ slot_mapping, int64_t num_tokens,
                           int64_t num_slots, int64_t block_size, int heads, int units,  // units per head row
                           int rows_per_cta,
                           int64_t key_s0, int64_t key_s1,  // in units
                           int64_t val_s0, int64_t val_s1, int64_t cache_s0, int64_t cache_s1, int64_t cache_s2) {
  // PDL (pdl.cuh): key, value and slot_mapping come from the kernels before this one, the caches may still be read by
  // them. One pass, no reuse: the successor may be scheduled at once.
  // FAULT(pdl_append)
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  paged_kv_for_each_unit(slot_mapping, num_tokens, num_slots, block_size, heads, units, 1, rows_per_cta, cache_s0,
                         cache_s1, cache_s2, [&](int64_t t, int h, int u, int64_t dst) {
                           dev::st_global(k_cache + dst, dev::ld_global(key + t * key_s0 + h * key_s1 + u));
                           dev::st_global(v_cache + dst, dev::ld_global(value + t * val_s0 + h * val_s1 + u));
                         });
}

__device__ __forceinline__ float paged_kv_to_float(float x) { return x; }
__device__ __forceinline__ float paged_kv_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float paged_kv_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// V consecutive Src elements at src -> V e4m3 bytes at dst (V = 1, or 16 / sizeof(Src): one 16-byte load).
template <typename Src, int V>
__device__ __forceinline__ void paged_kv_quantize_store(uint8_t* dst, const Src* src, float scale) {
  using LoadT = std::conditional_t<V == 1, Src, uint4>;
  using StoreT = std::conditional_t<V == 1, uint8_t, std::conditional_t<V == 4, uint32_t, uint2>>;
  static_assert(sizeof(LoadT) == V * sizeof(Src) && sizeof(StoreT) == V, "one load and one store per V elements");
  const LoadT in = dev::ld_global(reinterpret_cast<const LoadT*>(src));
  Src x[V];
  memcpy(x, &in, sizeof in);
  uint8_t q[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    q[i] = __nv_cvt_float_to_fp8(__fdiv_rn(paged_kv_to_float(x[i]), scale), __NV_SATFINITE, __NV_E4M3);
  }
  StoreT out;
  memcpy(&out, q, sizeof out);
  dev::st_global(reinterpret_cast<StoreT*>(dst), out);
}

// fp8 caches: as paged_kv_append_kernel, but rows of `units` groups of V elements are quantized on the way
// (k_scale, v_scale: one fp32 each, read on the device). Strides in elements.
template <typename Src, int V, typename Slot>
__global__ void __launch_bounds__(kPagedKvThreads)
    paged_kv_append_fp8_kernel(const Src* __restrict__ key, const Src* __restrict__ value,
                               uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                               const Slot* __restrict__ slot_mapping, const float* __restrict__ k_scale,
                               const float* __restrict__ v_scale,
                               int64_t num_tokens, int64_t num_slots, int64_t block_size, int heads, int units,
                               int rows_per_cta, int64_t key_s0, int64_t key_s1, int64_t val_s0, int64_t val_s1,
                               int64_t cache_s0, int64_t cache_s1, int64_t cache_s2) {
  dev::pdl_wait();  // as paged_kv_append_kernel: the scales too may be written upstream
  dev::pdl_launch_dependents();
  const float ks = dev::ld_global(k_scale), vs = dev::ld_global(v_scale);
  paged_kv_for_each_unit(slot_mapping, num_tokens, num_slots, block_size, heads, units, V, rows_per_cta, cache_s0,
                         cache_s1, cache_s2, [&](int64_t t, int h, int u, int64_t dst) {
                           paged_kv_quantize_store<Src, V>(k_cache + dst, key + t * key_s0 + h * key_s1 + u * V, ks);
                           paged_kv_quantize_store<Src, V>(v_cache + dst, value + t * val_s0 + h * val_s1 + u * V, vs);
                         });
}

// out [batch, heads, max_seq_len, units] contiguous; CTA (blockIdx.x, blockIdx.y = b) owns positions
// [blockIdx.x * rows_per_cta, ...) of sequence b. Positions past seq_len (or under a bad block entry) get zeros.
template <typename Unit>
__global__ void __launch_bounds__(kPagedKvThreads)
    paged_kv_gather_kernel(const Unit* __restrict__ k_cache, const Unit* __restrict__ v_cache,
                           const int32_t* __restrict__ block_table, const int32_t* __restrict__ seq_lens,
                           Unit* __restrict__ k_out, Unit* __restrict__ v_out, int64_t max_seq_len, int64_t max_blocks,
                           int64_t num_blocks, int64_t block_size, int heads, int units, int rows_per_cta,
                           int64_t cache_s0, int64_t cache_s1, int64_t cache_s2, int64_t vcache_s0, int64_t vcache_s1,
                           int64_t vcache_s2) {
  const int64_t b = blockIdx.y;
  // PDL (pdl.cuh): the caches, block_table and seq_lens are written upstream; k_out / v_out are fresh allocations
  // the predecessor may have used last. One pass: the successor may be scheduled at once.
  // FAULT(pdl_gather)
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t len = dev::ld_global(seq_lens + b);
  const int work = rows_per_cta * heads * units;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int u = i % units;
    const int h = (i / units) % heads;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * rows_per_cta + i / (units * heads);
    if (t >= max_seq_len) return;
    const int64_t dst = ((b * heads + h) * max_seq_len + t) * units + u;
    int64_t blk = -1;
    if (t < len) blk = dev::ld_global(block_table + b * max_blocks + t / block_size);
    if (blk < 0 || blk >= num_blocks) {
      dev::st_global(k_out + dst, Unit{});
      dev::st_global(v_out + dst, Unit{});
      continue;
    }
    const int64_t off = t % block_size;
    // FAULT(gather_offset)
    dev::st_global(k_out + dst, dev::ld_global(k_cache + blk * cache_s0 + off * cache_s1 + h * cache_s2 + u));
    dev::st_global(v_out + dst, dev::ld_global(v_cache + blk * vcache_s0 + off * vcache_s1 + h * vcache_s2 + u));
  }
}

// ------------------------------------------------------------------------------------------------ launch planning
// Pure functions of shapes (no device property matters here): used by the CUDA launcher and the emulator alike.
struct PagedKvPlan {
  dim3 grid;
  int threads = kPagedKvThreads;
  int rows_per_cta = 1;
};

inline int paged_kv_rows_per_cta(int64_t heads, int64_t units) {
  const int64_t per_row = heads * units;
  return static_cast<int>(per_row >= kPagedKvThreads ? 1 : kPagedKvThreads / (per_row > 0 ? per_row : 1));
}

// n tokens of `heads` rows of `units` copy units.
inline PagedKvPlan plan_paged_kv_append(int64_t n, int64_t heads, int64_t units) {
  PagedKvPlan p;
  p.rows_per_cta = paged_kv_rows_per_cta(heads, units);
  p.grid = dim3(static_cast<unsigned>(ceil_div<int64_t>(n, p.rows_per_cta)));
  return p;
}

// batch sequences of max_seq_len positions (gridDim.y = batch <= 65535: checked by the caller).
inline PagedKvPlan plan_paged_kv_gather(int64_t batch, int64_t max_seq_len, int64_t heads, int64_t units) {
  PagedKvPlan p;
  p.rows_per_cta = paged_kv_rows_per_cta(heads, units);
  p.grid = dim3(static_cast<unsigned>(ceil_div<int64_t>(max_seq_len, p.rows_per_cta)), static_cast<unsigned>(batch));
  return p;
}

}  // namespace arkernels
