// The SIMT emulator as torch ops: the CUDA kernels' exact source (csrc/<stem>_kernels.cuh + csrc/<stem>_launch.h,
// the same files csrc/<stem>.cu compiles) run on CPU tensors, registered as arkernels_simt::<op> with arkernels'
// own schemas (arkernels/simt.py copies them, so they are written once, in csrc/torch_bindings.cpp).
// Built by `python -m arkernels.simt build` (plain, or with -fsanitize=thread / address,undefined); used by the tests
// through `with arkernels.simt.emulate(): ...`, which routes arkernels::<op> on CPU tensors here.
// Per op call: the traffic meter is reset, the op's tensors are registered by argument name, and emulator reports
// (divergent barriers aside, which abort) become an error.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../paged_kv_launch.h"
#include "../window_attention_launch.h"

namespace arkernels {
namespace {

void track(const char* name, const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  // the whole storage span the view can reach: strided views (e.g. a k_cache slice of a wider tensor) included
  const auto& st = t.storage();
  ::simt::track_buffer(name, st.data(), st.nbytes());
}

// Runs f under the emulator: one op at a time, a fresh traffic window and error log; reports become an exception.
template <typename F>
auto emulated(const char* op, F&& f) {
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  ::simt::clear_errors();
  ::simt::g_max_dynamic_smem.clear();
  auto result = f();
  TORCH_CHECK(::simt::g_errors == 0, op, " (SIMT emulator): ", long(::simt::g_errors), " report(s):\n",
              ::simt::g_error_text);
  return result;
}

DeviceProps emulated_device_props() {
  const auto& d = ::simt::device();
  return DeviceProps{d.sm_count, d.smem_optin, d.cc_major, d.cc_minor};
}

void paged_kv_append_simt(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale) {
  check_paged_kv_append(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  emulated("paged_kv_append", [&] {
    ::simt::reset_traffic();
    track("key", key);
    track("value", value);
    track("k_cache", k_cache);
    track("v_cache", v_cache);
    track("slot_mapping", slot_mapping);
    if (k_scale) track("k_scale", *k_scale);
    if (v_scale) track("v_scale", *v_scale);
    const cudaError_t err =
        paged_kv_append_launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, nullptr);
    TORCH_CHECK(err == cudaSuccess, "paged_kv_append (SIMT emulator): launch failed");
    return 0;
  });
}

std::tuple<at::Tensor, at::Tensor> paged_kv_gather_simt(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                        const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                        int64_t max_seq_len) {
  check_paged_kv_gather(k_cache, v_cache, block_table, seq_lens, max_seq_len);
  return emulated("paged_kv_gather", [&] {
    ::simt::reset_traffic();
    track("k_cache", k_cache);
    track("v_cache", v_cache);
    track("block_table", block_table);
    track("seq_lens", seq_lens);
    at::Tensor k_out, v_out;
    const cudaError_t err =
        paged_kv_gather_launch(k_cache, v_cache, block_table, seq_lens, max_seq_len, k_out, v_out, nullptr);
    TORCH_CHECK(err == cudaSuccess, "paged_kv_gather (SIMT emulator): launch failed");
    return std::make_tuple(k_out, v_out);
  });
}

std::tuple<at::Tensor, at::Tensor> window_attention_simt(const at::Tensor& query, const at::Tensor& k_cache,
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
  return emulated("window_attention", [&] {
    ::simt::reset_traffic();
    track("query", query);
    track("k_cache", k_cache);
    track("v_cache", v_cache);
    track("block_table", block_table);
    track("seq_lens", seq_lens);
    if (cu_seqlens_q) track("cu_seqlens_q", *cu_seqlens_q);
    if (kv_start) track("kv_start", *kv_start);
    if (k_scale) track("k_scale", *k_scale);
    if (v_scale) track("v_scale", *v_scale);
    if (sinks) track("sinks", *sinks);
    at::Tensor out, lse;
    const cudaError_t err = window_attention_launch(query, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                                                    kv_start, max_q_len, window, scale, softcap, k_scale, v_scale,
                                                    sinks, chunk_size, emulated_device_props(), nullptr, /*capturing=*/false, out,
                                                    lse);
    TORCH_CHECK(err == cudaSuccess, "window_attention (SIMT emulator): launch failed");
    return std::make_tuple(out, lse);
  });
}

// ---- the emulator's own controls (not arkernels ops) ----
// Per-byte read / write counts of a buffer registered by the last op call ([bytes] int32), or an empty tensor.
std::tuple<at::Tensor, at::Tensor> traffic_map(const std::string& name) {
  const ::simt::Buffer* b = ::simt::find_buffer(name);
  if (!b) return {at::empty({0}, at::kInt), at::empty({0}, at::kInt)};
  at::Tensor r = at::empty({int64_t(b->bytes)}, at::kInt), w = at::empty({int64_t(b->bytes)}, at::kInt);
  int32_t* rp = r.data_ptr<int32_t>();
  int32_t* wp = w.data_ptr<int32_t>();
  for (size_t i = 0; i < b->bytes; ++i) {
    rp[i] = int32_t(b->reads[i].load());
    wp[i] = int32_t(b->writes[i].load());
  }
  return {r, w};
}
// (names, read bytes, write bytes) of the last op call; the last entry is "other" (outside every named buffer).
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>> traffic_totals() {
  std::vector<std::string> names;
  std::vector<int64_t> reads, writes;
  for (auto& b : ::simt::g_buffers) {
    names.push_back(b->name);
    reads.push_back(int64_t(b->read_total.load()));
    writes.push_back(int64_t(b->write_total.load()));
  }
  names.push_back("other");
  reads.push_back(int64_t(::simt::g_other_read.load()));
  writes.push_back(int64_t(::simt::g_other_write.load()));
  return {names, reads, writes};
}
// The last op call's launches, flattened: (grid x, y, z, threads, dynamic smem bytes) per launch.
std::vector<int64_t> launch_log() {
  std::vector<int64_t> out;
  for (const auto& l : ::simt::g_launches) out.insert(out.end(), l.begin(), l.end());
  return out;
}
void set_device(const std::string& name) {
  TORCH_CHECK(::simt::set_device(name), "arkernels.simt: unknown device ", name, " (sm_80, sm_89, sm_90)");
}
std::string get_device() { return ::simt::device().name; }
// 0: blocks in linear order; otherwise a permutation drawn from this seed (see simt.h, g_block_order).
void set_block_order(int64_t seed) { ::simt::g_block_order = static_cast<unsigned>(seed); }
int64_t get_block_order() { return ::simt::g_block_order; }

}  // namespace
}  // namespace arkernels

TORCH_LIBRARY_FRAGMENT(arkernels_simt, m) {
  m.def("traffic_map(str name) -> (Tensor, Tensor)", &arkernels::traffic_map);
  m.def("traffic_totals() -> (str[], int[], int[])", &arkernels::traffic_totals);
  m.def("launch_log() -> int[]", &arkernels::launch_log);
  m.def("set_device(str name) -> ()", &arkernels::set_device);
  m.def("get_device() -> str", &arkernels::get_device);
  m.def("set_block_order(int seed) -> ()", &arkernels::set_block_order);
  m.def("get_block_order() -> int", &arkernels::get_block_order);
}

TORCH_LIBRARY_IMPL(arkernels_simt, CPU, m) {
  m.impl("paged_kv_append", &arkernels::paged_kv_append_simt);
  m.impl("paged_kv_gather", &arkernels::paged_kv_gather_simt);
  m.impl("window_attention", &arkernels::window_attention_simt);
}
