// window_attention on the CPU: the same schema and checks as csrc/window_attention.cu.
//
// Parallel over (query row, kv head): one task computes every query head of one GQA group for one query, so each
// key/value row it reads serves all `group` query heads. Scores of the visible keys go to a scratch buffer
// [group, n_visible] (fp32), then an exact two-pass softmax (max, then sum of exp) and the weighted sum of V rows,
// all in fp32 whatever the input dtype. fp8 (float8_e4m3fn) caches: each key/value row is dequantized once per task
// (stored * k_scale / v_scale, fp32) before it serves the group. Attention sinks join each head's max and sum as one
// more logit with no value; chunked attention only moves the first visible key (window_attention_first_key). The CPU
// can afford to validate the data (block ids, cu_seqlens_q against seq_lens) at no sync cost, so it raises where the
// CUDA kernel can only mask.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "window_attention.h"

namespace arkernels {
namespace {

// cache_t: scalar_t, or c10::Float8_e4m3fn (k_scale/v_scale then multiply each stored element; 1 otherwise).
template <typename scalar_t, typename cache_t>
void window_attention_cpu_kernel(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const int32_t* table, int64_t max_blocks, const int32_t* lens,
                                 const int32_t* starts,  // [batch] or nullptr
                                 const std::vector<int64_t>& row_batch, const std::vector<int64_t>& row_pos,
                                 int64_t window, int64_t chunk_size, float scale, float softcap, float k_scale,
                                 float v_scale, const float* sinks,  // [hq] or nullptr
                                 at::Tensor& out, at::Tensor& lse) {
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2);
  const int64_t hkv = k_cache.size(2), group = hq / hkv, block_size = k_cache.size(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  constexpr bool kFp8 = std::is_same_v<cache_t, c10::Float8_e4m3fn>;
  scalar_t* o_ptr = out.data_ptr<scalar_t>();  // contiguous [rows, hq, d]
  float* lse_ptr = lse.data_ptr<float>();      // contiguous [rows, hq]
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, rows * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * d), acc(group * d), scores, row(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / hkv, kvh = item % hkv;
      const int64_t b = row_batch[r], i = row_pos[r];
      const int64_t lo = window_attention_first_key<int64_t>(i, starts ? starts[b] : 0, window, chunk_size);
      // i < seq_len always; keys past the block table's capacity are masked (the rule of every kernel, see
      // window_attention.h), the query keeps its position
      const int64_t hi = std::min<int64_t>({i, lens[b] - 1, max_blocks * block_size - 1});
      const int64_t n = hi - lo + 1;
      if (n <= 0) {  // no visible key: zeros and lse -inf (or the sink: its denominator), never NaN
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = kvh * group + g;
          std::fill(o_ptr + (r * hq + h) * d, o_ptr + (r * hq + h + 1) * d, scalar_t(0));
          lse_ptr[r * hq + h] = sinks ? sinks[h] : kNegInf;
        }
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + r * qs0 + (kvh * group + g) * qs1;
        for (int64_t x = 0; x < d; ++x) q[g * d + x] = static_cast<float>(src[x]);
      }
      scores.resize(group * n);
      for (int64_t j = lo; j <= hi; ++j) {
        const int64_t blk = table[b * max_blocks + j / block_size];
        const cache_t* kp = k_ptr + blk * ks0 + (j % block_size) * ks1 + kvh * ks2;
        // the key row dequantized once for the whole group (fp8: stored * k_scale, as the reference does)
        for (int64_t x = 0; x < d; ++x) row[x] = kFp8 ? static_cast<float>(kp[x]) * k_scale : static_cast<float>(kp[x]);
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
          for (int64_t x = 0; x < d; ++x) s += q[g * d + x] * row[x];
          s *= scale;
          if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
          scores[g * n + (j - lo)] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> inv(group), mx(group);
      for (int64_t g = 0; g < group; ++g) {
        // The sink is one more logit in the max and the sum, with no value row.
        const float sink = sinks ? sinks[kvh * group + g] : kNegInf;
        float m = sink;
        for (int64_t x = 0; x < n; ++x) m = std::max(m, scores[g * n + x]);
        float l = sinks ? std::exp(sink - m) : 0.f;  // 0 for a -inf sink (m is finite: n > 0 keys)
        for (int64_t x = 0; x < n; ++x) {
          const float p = std::exp(scores[g * n + x] - m);
          scores[g * n + x] = p;
          l += p;
        }
        mx[g] = m;
        inv[g] = 1.f / l;  // l >= 1: the max term contributes exp(0)
        lse_ptr[r * hq + kvh * group + g] = m + std::log(l);
      }
      for (int64_t j = lo; j <= hi; ++j) {
        const int64_t blk = table[b * max_blocks + j / block_size];
        const cache_t* vp = v_ptr + blk * vs0 + (j % block_size) * vs1 + kvh * vs2;
        for (int64_t x = 0; x < d; ++x) row[x] = kFp8 ? static_cast<float>(vp[x]) * v_scale : static_cast<float>(vp[x]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + (j - lo)];
          float* a = acc.data() + g * d;
          for (int64_t x = 0; x < d; ++x) a[x] += p * row[x];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = o_ptr + (r * hq + kvh * group + g) * d;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(acc[g * d + x] * inv[g]);
      }
    }
  });
}

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
  std::vector<int64_t> row_batch(rows), row_pos(rows);
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
    for (int64_t t = 0; t < q_len; ++t) {
      row_batch[first + t] = b;
      row_pos[first + t] = len - q_len + t;
    }
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
  AK_DISPATCH_FLOAT(query.scalar_type(), "window_attention_cpu", [&] {
    if (fp8) {
      window_attention_cpu_kernel<scalar_t, c10::Float8_e4m3fn>(
          query, k_cache, v_cache, table_ptr, max_blocks, lens, starts, row_batch, row_pos, window, chunk_size,
          static_cast<float>(scale), static_cast<float>(softcap), ks, vs, sinks_ptr, out, lse);
    } else {
      window_attention_cpu_kernel<scalar_t, scalar_t>(query, k_cache, v_cache, table_ptr, max_blocks, lens, starts,
                                                      row_batch, row_pos, window, chunk_size,
                                                      static_cast<float>(scale), static_cast<float>(softcap), 1.f,
                                                      1.f, sinks_ptr, out, lse);
    }
  });
  return {out, lse};
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CPU, m) { m.impl("window_attention", &arkernels::window_attention_cpu); }
