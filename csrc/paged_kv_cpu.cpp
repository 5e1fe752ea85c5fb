// paged_kv on the CPU: the same schema and checks as csrc/paged_kv.cu. Data movement only, so rows are
// copied as bytes (memcpy of head_dim elements); parallel over tokens (append) and batch x positions (gather).
// fp8 (float8_e4m3fn) caches: append quantizes element by element (x / scale, saturated); gather moves fp8 bytes.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>

#include <cstring>

#include "paged_kv.h"

namespace arkernels {

namespace {

// x / scale, clamped to +-448 (NaN kept), rounded to nearest even e4m3: saturating, as cvt.rn.satfinite on the GPU.
inline c10::Float8_e4m3fn quantize_e4m3(float x, float scale) {
  float y = x / scale;
  if (y > 448.f) y = 448.f;
  if (y < -448.f) y = -448.f;
  return c10::Float8_e4m3fn(y);
}

// The append's loop, one place for both paths: row(t, h, dst) for every token t whose slot is valid and every head
// h, dst = the element offset of that (slot, head) row in the caches (k_cache and v_cache share their strides).
template <typename F>
void for_each_append_row(const at::Tensor& slot_mapping, int64_t heads, const at::Tensor& k_cache, F&& row) {
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  at::parallel_for(0, slots.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slot_ptr[t];
      if (slot < 0 || slot >= num_slots) continue;  // padding, or past the cache: never written
      const int64_t blk = slot / block_size, off = slot % block_size;
      for (int64_t h = 0; h < heads; ++h)
        row(t, h, blk * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2));
    }
  });
}

// fp8 caches: each element of key/value (src_t) is divided by its scale and saturated to e4m3 on write.
template <typename src_t>
void paged_kv_append_fp8_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& slot_mapping, float k_scale, float v_scale) {
  const int64_t head_dim = key.size(2);
  const src_t* k_src = key.data_ptr<src_t>();
  const src_t* v_src = value.data_ptr<src_t>();
  auto* k_dst = k_cache.data_ptr<c10::Float8_e4m3fn>();
  auto* v_dst = v_cache.data_ptr<c10::Float8_e4m3fn>();
  for_each_append_row(slot_mapping, key.size(1), k_cache, [&](int64_t t, int64_t h, int64_t dst) {
    const src_t* kr = k_src + t * key.stride(0) + h * key.stride(1);
    const src_t* vr = v_src + t * value.stride(0) + h * value.stride(1);
    for (int64_t x = 0; x < head_dim; ++x) {
      k_dst[dst + x] = quantize_e4m3(static_cast<float>(kr[x]), k_scale);
      v_dst[dst + x] = quantize_e4m3(static_cast<float>(vr[x]), v_scale);
    }
  });
}

}  // namespace

void paged_kv_append_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  check_paged_kv_append(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    const float ks = k_scale->data_ptr<float>()[0], vs = v_scale->data_ptr<float>()[0];  // CPU tensors: no sync
    AK_DISPATCH_FLOAT(key.scalar_type(), "paged_kv_append_fp8_cpu", [&] {
      paged_kv_append_fp8_cpu<scalar_t>(key, value, k_cache, v_cache, slot_mapping, ks, vs);
    });
    return;
  }
  const int64_t es = k_cache.element_size(), row_bytes = key.size(2) * es;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  for_each_append_row(slot_mapping, key.size(1), k_cache, [&](int64_t t, int64_t h, int64_t dst) {
    std::memcpy(k_dst + dst * es, k_src + (t * key.stride(0) + h * key.stride(1)) * es, row_bytes);
    std::memcpy(v_dst + dst * es, v_src + (t * value.stride(0) + h * value.stride(1)) * es, row_bytes);
  });
}

std::tuple<at::Tensor, at::Tensor> paged_kv_gather_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                       int64_t max_seq_len) {
  check_paged_kv_gather(k_cache, v_cache, block_table, seq_lens, max_seq_len);
  const int64_t batch = block_table.size(0), num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3);
  at::Tensor k_out = at::empty({batch, heads, max_seq_len, head_dim}, k_cache.options());
  at::Tensor v_out = at::empty({batch, heads, max_seq_len, head_dim}, k_cache.options());
  const int64_t es = k_cache.element_size(), row_bytes = head_dim * es;
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* table_ptr = table.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const char* k_src = static_cast<const char*>(k_cache.data_ptr());
  const char* v_src = static_cast<const char*>(v_cache.data_ptr());
  char* k_dst = static_cast<char*>(k_out.data_ptr());
  char* v_dst = static_cast<char*>(v_out.data_ptr());
  const int64_t max_blocks = block_table.size(1);
  at::parallel_for(0, batch * max_seq_len, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / max_seq_len, t = i % max_seq_len;
      int64_t blk = -1;
      if (t < len_ptr[b]) blk = table_ptr[b * max_blocks + t / block_size];
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (((b * heads + h) * max_seq_len) + t) * row_bytes;
        if (blk < 0 || blk >= num_blocks) {  // past the sequence (or a bad entry, refused by the wrapper): zeros
          std::memset(k_dst + dst, 0, row_bytes);
          std::memset(v_dst + dst, 0, row_bytes);
          continue;
        }
        const int64_t off = t % block_size;
        const int64_t src = (blk * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2)) * es;
        const int64_t vsrc = (blk * v_cache.stride(0) + off * v_cache.stride(1) + h * v_cache.stride(2)) * es;
        std::memcpy(k_dst + dst, k_src + src, row_bytes);
        std::memcpy(v_dst + dst, v_src + vsrc, row_bytes);
      }
    }
  });
  return {k_out, v_out};
}

}  // namespace arkernels

TORCH_LIBRARY_IMPL(arkernels, CPU, m) {
  m.impl("paged_kv_append", &arkernels::paged_kv_append_cpu);
  m.impl("paged_kv_gather", &arkernels::paged_kv_gather_cpu);
}
