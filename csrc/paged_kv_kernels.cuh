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
// checks both ratios in tests/test_paged_kv.py. Resources: see scripts/sass_report.py (< 32 registers, no smem).
#pragma once

#include "device.cuh"

namespace arkernels {

constexpr int kPagedKvThreads = 256;

// Rows of `units` copy units each: one CTA takes rows [blockIdx.x * rows_per_cta, ...).
template <typename Unit, typename Slot>
__global__ void __launch_bounds__(kPagedKvThreads)
    paged_kv_append_kernel(const Unit* __restrict__ key, const Unit* __restrict__ value, Unit* __restrict__ k_cache,
                           Unit* __restrict__ v_cache, const Slot* __restrict__ slot_mapping, int64_t num_tokens,
                           int64_t num_slots, int64_t block_size, int heads, int units,  // units per head row
                           int rows_per_cta,
                           int64_t key_s0, int64_t key_s1,  // in units
                           int64_t val_s0, int64_t val_s1, int64_t cache_s0, int64_t cache_s1, int64_t cache_s2) {
  const int work = rows_per_cta * heads * units;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int u = i % units;
    const int h = (i / units) % heads;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * rows_per_cta + i / (units * heads);
    if (t >= num_tokens) return;  // i only grows, so t does too
    const int64_t slot = static_cast<int64_t>(dev::ld_global(slot_mapping + t));
    if (slot < 0 || slot >= num_slots) continue;  // padding (or past the cache): never written
    const int64_t dst = (slot / block_size) * cache_s0 + (slot % block_size) * cache_s1 + h * cache_s2 + u;
    dev::st_global(k_cache + dst, dev::ld_global(key + t * key_s0 + h * key_s1 + u));
    dev::st_global(v_cache + dst, dev::ld_global(value + t * val_s0 + h * val_s1 + u));
  }
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
