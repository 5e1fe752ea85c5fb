// window_attention on the CPU: the same schema and checks as csrc/window_attention.cu.
//
// The kernel body (tasks, tiles, SIMD lanes) is in window_attention_cpu_kernels.h, compiled for the baseline ISA and
// for AVX2 (bit-identical outputs; the width is picked at run time). fp8 (float8_e4m3fn) caches: each key/value row
// is dequantized (stored * k_scale / v_scale, fp32) once per task. Attention sinks join each head's max and sum as one
// more logit with no value; chunked attention only moves the first visible key (window_attention_first_key). The CPU
// can afford to validate the data (block ids, cu_seqlens_q against seq_lens) at no sync cost, so it raises where the
// CUDA kernel can only mask.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <limits>
#include <type_traits>
#include <vector>

#include "window_attention.h"

namespace arkernels {
namespace {

constexpr int64_t kRowChunk = 8;  // query rows of one sequence per task: each K/V row read serves all of them

// Stored element -> fp32 (fp8: stored * scale, as the reference does).
template <typename cache_t>
inline float cache_to_float(cache_t v, float scale) {
  if constexpr (std::is_same_v<cache_t, c10::Float8_e4m3fn>) return static_cast<float>(v) * scale;
  return static_cast<float>(v);
}

// A task's query rows: rows [r0, r1) of sequence b (consecutive positions), for one KV head.
struct RowChunk {
  int64_t b, r0, r1;
};

// The call's tensors and parameters, as every task reads them. cache_t: scalar_t, or c10::Float8_e4m3fn (k_scale /
// v_scale then multiply each stored element; 1 otherwise).
template <typename scalar_t, typename cache_t>
struct CpuAttn {
  const scalar_t* q;  // [rows, hq, d], strides qs0, qs1 (the last one 1)
  int64_t qs0, qs1;
  const cache_t* k;  // [num_blocks, block_size, hkv, d]
  int64_t ks0, ks1, ks2;
  const cache_t* v;
  int64_t vs0, vs1, vs2;
  const int32_t* table;  // [batch, max_blocks], contiguous
  int64_t max_blocks, block_size;
  const int32_t* lens;    // [batch]
  const int32_t* starts;  // [batch] or nullptr
  const int64_t* row_pos;  // [rows]: each query row's absolute position
  int64_t hq, hkv, group, d, window, chunk_size;
  float scale, softcap, k_scale, v_scale;
  const float* sinks;  // [hq] or nullptr
  scalar_t* out;       // contiguous [rows, hq, d]
  float* lse;          // contiguous [rows, hq]

  const cache_t* k_row(int64_t b, int64_t j, int64_t kvh) const {
    return k + table[b * max_blocks + j / block_size] * ks0 + (j % block_size) * ks1 + kvh * ks2;
  }
  const cache_t* v_row(int64_t b, int64_t j, int64_t kvh) const {
    return v + table[b * max_blocks + j / block_size] * vs0 + (j % block_size) * vs1 + kvh * vs2;
  }
};

namespace baseline {
constexpr int64_t kLanes = 4;
#include "window_attention_cpu_kernels.h"
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ARKERNELS_CPU_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
constexpr int64_t kLanes = 8;
#include "window_attention_cpu_kernels.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

}  // namespace

std::tuple<at::Tensor, at::Tensor> window_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& block_table,
                                                        const at::Tensor& seq_lens,
                                                        const std::optional<at::Tensor>& cu_seqlens_q,
                                                        const std::optional<at::Tensor>& kv_start, int64_t max_q_len,
                                                        int64_t window, double scale, double softcap,
                                                        const std::optional<at::Tensor>& k_scale,
                                                        const std::optional<at::Tensor>& v_scale,
                                                        const std::optional<at::Tensor>& sinks, int64_t chunk_size) {
  check_window_attention(query, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, kv_start, max_q_len, window,
                         scale, softcap, k_scale, v_scale, sinks, chunk_size);
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2);
  const int64_t batch = seq_lens.size(0), max_blocks = block_table.size(1);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  at::Tensor out = at::empty({rows, hq, d}, query.options());
  at::Tensor lse = at::empty({rows, hq}, query.options().dtype(at::kFloat));
  if (rows == 0 || hq == 0) return {out, lse};

  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens_t = seq_lens.contiguous();
  const int32_t* table_ptr = table.data_ptr<int32_t>();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  at::Tensor starts_t;
  if (kv_start.has_value()) starts_t = kv_start->contiguous();
  const int32_t* starts = kv_start.has_value() ? starts_t.data_ptr<int32_t>() : nullptr;

  // Each query row's sequence and absolute position; the data checks the CUDA kernel cannot afford.
  std::vector<int64_t> row_pos(rows);
  std::vector<RowChunk> chunks;
  at::Tensor cu_t;
  const int32_t* cu = nullptr;
  if (cu_seqlens_q.has_value()) {
    cu_t = cu_seqlens_q->contiguous();
    cu = cu_t.data_ptr<int32_t>();
    AK_CHECK("window_attention", cu[0] == 0 && cu[batch] == rows, "cu_seqlens_q must run from 0 to num_queries = ",
             rows, ", got ", cu[0], " .. ", cu[batch]);
    for (int64_t b = 0; b < batch; ++b) {
      AK_CHECK("window_attention", cu[b] <= cu[b + 1], "cu_seqlens_q must be non-decreasing, got cu_seqlens_q[", b,
               "] = ", cu[b], " > cu_seqlens_q[", b + 1, "] = ", cu[b + 1]);
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    AK_CHECK("window_attention", len >= 0, "seq_lens[", b, "] = ", len, " is negative");
    // A length past the table's capacity is not an error here: those keys are masked (the wrapper's check=True
    // refuses it before any kernel runs).
    for (int64_t blk = 0; blk < max_blocks && blk * block_size < len; ++blk) {
      const int64_t id = table_ptr[b * max_blocks + blk];
      AK_CHECK("window_attention", id >= 0 && id < num_blocks, "block_table[", b, ", ", blk, "] = ", id,
               " is out of range [0, ", num_blocks, ") within sequence ", b, "'s length ", len);
    }
    const int64_t first = cu ? cu[b] : b, q_len = cu ? cu[b + 1] - cu[b] : 1;
    if (cu) {
      AK_CHECK("window_attention", q_len <= len, "cu_seqlens_q gives sequence ", b, " ", q_len,
               " queries but seq_lens[", b, "] = ", len, " (queries are the last q_len positions)");
      AK_CHECK("window_attention", q_len <= max_q_len, "max_q_len = ", max_q_len, " is smaller than sequence ", b,
               "'s query count ", q_len);
    }
    for (int64_t t = 0; t < q_len; ++t) row_pos[first + t] = len - q_len + t;
    for (int64_t t = 0; t < q_len; t += kRowChunk) chunks.push_back({b, first + t, first + std::min(q_len, t + kRowChunk)});
  }

  at::Tensor sinks_t;
  if (sinks.has_value()) sinks_t = sinks->contiguous();
  const float* sinks_ptr = sinks.has_value() ? sinks_t.data_ptr<float>() : nullptr;
  for (int64_t h = 0; sinks_ptr && h < hq; ++h) {  // -inf is allowed: no sink for that head
    AK_CHECK("window_attention", !std::isnan(sinks_ptr[h]) && sinks_ptr[h] != std::numeric_limits<float>::infinity(),
             "sinks[", h, "] = ", sinks_ptr[h], " must be finite or -inf");
  }

  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const float ks = fp8 ? k_scale->data_ptr<float>()[0] : 1.f, vs = fp8 ? v_scale->data_ptr<float>()[0] : 1.f;
#ifdef ARKERNELS_CPU_AVX2
  // ARKERNELS_CPU_ISA=baseline forces the baseline build (the tests compare the two bit for bit).
  const char* isa = std::getenv("ARKERNELS_CPU_ISA");
  const bool use_avx2 = __builtin_cpu_supports("avx2") && !(isa && std::string(isa) == "baseline");
#endif
  AK_DISPATCH_FLOAT(query.scalar_type(), "window_attention_cpu", [&] {
    auto run = [&](auto cache_zero) {
      using cache_t = decltype(cache_zero);
      const CpuAttn<scalar_t, cache_t> a{query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
                                         k_cache.data_ptr<cache_t>(), k_cache.stride(0), k_cache.stride(1),
                                         k_cache.stride(2), v_cache.data_ptr<cache_t>(), v_cache.stride(0),
                                         v_cache.stride(1), v_cache.stride(2), table_ptr, max_blocks, block_size,
                                         lens, starts, row_pos.data(), hq, k_cache.size(2), hq / k_cache.size(2), d,
                                         window, chunk_size, static_cast<float>(scale), static_cast<float>(softcap),
                                         ks, vs, sinks_ptr, out.data_ptr<scalar_t>(), lse.data_ptr<float>()};
#ifdef ARKERNELS_CPU_AVX2
      if (use_avx2) return avx2::window_attention_cpu_kernel(a, chunks);
#endif
      baseline::window_attention_cpu_kernel(a, chunks);
    };
    if (fp8) {
      run(c10::Float8_e4m3fn());
    } else {
      run(scalar_t());
    }
  });
  return {out, lse};
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CPU, m) { m.impl("window_attention", &arkernels::window_attention_cpu); }
