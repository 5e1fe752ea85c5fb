// window_attention: the tensor side of a launch (the checks the GPU kernels add to the shared ones, outputs, params,
// planning, the launches), shared by the CUDA extension (csrc/window_attention.cu, which adds the device guard, the
// stream and the device's properties) and the SIMT emulator (csrc/simt/simt_ops.cpp, which gives a table's
// properties), so the two cannot drift. Returns the first launch error (cudaSuccess when none).
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "window_attention.h"
#include "window_attention_kernels.cuh"

namespace arkernels {

template <typename F>
void dispatch_head_dim(int64_t d, F&& f) {
  switch (d) {
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 80: f(std::integral_constant<int, 80>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    default: AK_CHECK("window_attention", false, "head_dim must be 64, 80, 96, 128 or 256 on CUDA, got ", d);
  }
}

// ARKERNELS_MAX_SMEM_PER_BLOCK (bytes) lowers the device's opt-in limit: a test knob that makes a large GPU take the
// tiles of a small one (sm_86/sm_89/sm_120: 99 KB per block).
inline DeviceProps apply_smem_knob(DeviceProps props) {
  if (const char* env = std::getenv("ARKERNELS_MAX_SMEM_PER_BLOCK")) {
    const long long cap = std::atoll(env);
    if (cap > 0 && cap < props.smem_optin) props.smem_optin = static_cast<int>(cap);
  }
  return props;
}

// Split-KV completion counters (AttnParams::counters) and the launch's epoch on them (decode_arrive in
// window_attention_decode.cuh: a launch owns the counter values from epoch * kMaxSplits up, so whatever earlier
// launches left, an aborted one included, is erased by its first arrival; nothing resets them). Kept per (device,
// stream) with the last epoch given out: launches in one stream's order reuse them, each with the next epoch (a
// 64-bit count: it never wraps); launches on different streams, which may overlap, never share them. `lock` holds the
// epoch's order to the launch's: the caller keeps it until the launch is enqueued, so two host threads on one stream
// cannot enqueue epochs out of order (a later epoch first would make the earlier launch's counts never reach its
// last value). While the stream is being captured into a CUDA graph the counters are allocated and zeroed per call
// instead (a memset node of the graph, run at every replay) with epoch 1: a graph's replays, whose epoch is frozen,
// each start from zero, and never share counters with eager launches.
struct SplitCounters {
  at::Tensor hold;  // keeps the buffer alive for the call
  unsigned long long* ptr = nullptr;
  unsigned long long epoch = 0;
  std::unique_lock<std::mutex> lock;
};
inline void split_counters(const at::Tensor& like, int64_t n, const void* stream, bool capturing, SplitCounters& out) {
  const auto opts = like.options().dtype(at::kLong);
  if (capturing) {
    out.hold = at::zeros({n}, opts);
    out.ptr = reinterpret_cast<unsigned long long*>(out.hold.data_ptr<int64_t>());
    out.epoch = 1;
    return;
  }
  static std::mutex mu;
  struct Entry {
    at::Tensor t;
    unsigned long long epoch = 0;  // the last epoch given out on t
  };
  // Never destroyed: a CUDA tensor must not outlive the caching allocator at exit.
  static auto* cache = new std::map<std::tuple<int, int, const void*>, Entry>();
  out.lock = std::unique_lock<std::mutex>(mu);
  Entry& e = (*cache)[{int(like.device().type()), int(like.device().index()), stream}];
  if (!e.t.defined() || e.t.numel() < n) {  // a fresh buffer: zeros are below every epoch's values
    e.t = at::zeros({std::max<int64_t>(n, e.t.defined() ? 2 * e.t.numel() : 0)}, opts);
  }
  out.hold = e.t;
  out.ptr = reinterpret_cast<unsigned long long*>(e.t.data_ptr<int64_t>());
  // FAULT(split_epoch)
  out.epoch = ++e.epoch;
  AK_TRACK_SCRATCH("split_counters", out.ptr, size_t(e.t.numel()) * 8);
}

// Shared checks already ran (check_window_attention). Allocates out [rows, Hq, D] like query and lse fp32 [rows, Hq].
inline cudaError_t window_attention_launch(const at::Tensor& query, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& block_table,
                                           const at::Tensor& seq_lens, const std::optional<at::Tensor>& cu_seqlens_q,
                                           const std::optional<at::Tensor>& kv_start, int64_t max_q_len,
                                           int64_t window, double scale, double softcap,
                                           const std::optional<at::Tensor>& k_scale,
                                           const std::optional<at::Tensor>& v_scale,
                                           const std::optional<at::Tensor>& sinks, int64_t chunk_size,
                                           DeviceProps props,
                                           cudaStream_t stream, bool capturing, at::Tensor& out, at::Tensor& lse) {
  const auto dt = query.scalar_type();
  AK_CHECK("window_attention", dt == at::kHalf || dt == at::kBFloat16,
           "CUDA kernels take float16 or bfloat16, got ", dt, " (float32 runs on the CPU)");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;  // scales present (check_kv_scales)
  const int64_t d = query.size(2);
  AK_CHECK("window_attention", d == 64 || d == 80 || d == 96 || d == 128 || d == 256,
           "head_dim must be 64, 80, 96, 128 or 256 on CUDA, got ", d);
  const int64_t es = k_cache.element_size();
  bool aligned = aligned16(k_cache.data_ptr()) && aligned16(v_cache.data_ptr());
  for (int x = 0; x < 3; ++x) aligned = aligned && (k_cache.stride(x) * es) % 16 == 0 && (v_cache.stride(x) * es) % 16 == 0;
  AK_CHECK("window_attention", aligned, "on CUDA k_cache and v_cache rows must be 16-byte aligned (data pointer and "
           "strides), got strides ", k_cache.strides(), " and ", v_cache.strides());
  const int64_t batch = seq_lens.size(0), rows = query.size(0), hq = query.size(1), hkv = k_cache.size(2);
  AK_CHECK("window_attention", batch <= 65535, "batch must be <= 65535 on CUDA, got ", batch);
  AK_CHECK("window_attention", window <= INT32_MAX, "window must fit in int32, got ", window);
  AK_CHECK("window_attention", chunk_size <= INT32_MAX, "chunk_size must fit in int32, got ", chunk_size);
  out = at::empty({rows, hq, d}, query.options());
  lse = at::empty({rows, hq}, query.options().dtype(at::kFloat));
  if (rows == 0 || hq == 0 || batch == 0) return cudaSuccess;
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor cu, starts, sinks_c;
  if (cu_seqlens_q.has_value()) cu = cu_seqlens_q->contiguous();
  if (kv_start.has_value()) starts = kv_start->contiguous();
  if (sinks.has_value()) sinks_c = sinks->contiguous();

  AttnParams p{};
  p.query = query.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_scale = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;  // fp8 caches only (check_kv_scales)
  p.v_scale = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
  p.block_table = table.data_ptr<int32_t>();
  p.seq_lens = lens.data_ptr<int32_t>();
  p.cu_seqlens_q = cu.defined() ? cu.data_ptr<int32_t>() : nullptr;
  p.kv_start = starts.defined() ? starts.data_ptr<int32_t>() : nullptr;
  p.sinks = sinks_c.defined() ? sinks_c.data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.s = AttnStrides{query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                    v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  p.rows = rows;
  p.num_blocks = k_cache.size(0);
  p.block_size = k_cache.size(1);
  p.max_blocks = block_table.size(1);
  p.hq = static_cast<int>(hq);
  p.hkv = static_cast<int>(hkv);
  p.group = static_cast<int>(hq / hkv);
  p.window = static_cast<int>(window);
  p.chunk = static_cast<int>(chunk_size);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  const int64_t qes = query.element_size();
  p.q_vec = aligned16(query.data_ptr()) && (query.stride(0) * qes) % 16 == 0 && (query.stride(1) * qes) % 16 == 0;
  if (p.max_blocks == 0 || p.block_size == 0) {  // nothing addressable: every query sees no key
    out.zero_();
    if (sinks_c.defined()) {
      lse.copy_(sinks_c.expand({rows, hq}));  // the sink alone is the denominator
    } else {
      lse.fill_(-std::numeric_limits<float>::infinity());
    }
    return cudaSuccess;
  }

  WindowAttentionPlan plan = plan_window_attention(cu_seqlens_q.has_value(), batch, rows, hq, hkv, d, fp8,
                                                         p.max_blocks, p.block_size, window, chunk_size, max_q_len,
                                                         apply_smem_knob(props));
  p.head_chunks = plan.decode.head_chunks;
  p.num_splits = plan.decode.num_splits;
  at::Tensor part_out, part_lse;
  SplitCounters counters;  // its lock, when held, is released after the launch is enqueued
  // Both kernels that take cu_seqlens_q (prefill, multi-query decode) index packed rows (token * group + head) in
  // 32 bits.
  AK_CHECK("window_attention", !cu_seqlens_q.has_value() || rows * hq <= int64_t(0x7fffffff),
           "cu_seqlens_q needs num_tokens * num_q_heads < 2^31 on CUDA, got ", rows, " * ", hq);
  if (!plan.prefill) {
    AK_CHECK("window_attention", hkv * plan.decode.head_chunks <= 65535,
             "decode grid too large on CUDA: num_kv_heads * ceil(group / 16) = ", hkv * plan.decode.head_chunks,
             " (at most 65535)");
    AK_CHECK("window_attention", plan.decode.stages > 0, "decode with head_dim ", d, " needs ",
             decode_layout(int(d), 1, fp8).smem, " bytes of shared memory per block but this GPU allows ",
             apply_smem_knob(props).smem_optin);
    if (plan.decode.cluster > 0) {  // the planned cluster launch, unless this device cannot run it (the global path)
      bool usable = false;
      cudaError_t err = cudaSuccess;
      dispatch_head_dim(d, [&](auto dc) {
        constexpr int D = decltype(dc)::value;
        if (dt == at::kHalf) {
          err = fp8 ? decode_cluster_usable<__half, uint8_t, D>(plan.decode, usable)
                    : decode_cluster_usable<__half, __half, D>(plan.decode, usable);
        } else {
          err = fp8 ? decode_cluster_usable<__nv_bfloat16, uint8_t, D>(plan.decode, usable)
                    : decode_cluster_usable<__nv_bfloat16, __nv_bfloat16, D>(plan.decode, usable);
        }
      });
      if (err != cudaSuccess) return err;
      if (!usable) plan.decode.cluster = 0;
    }
    if (plan.decode.num_splits > 1 && plan.decode.cluster == 0) {
      part_out = at::empty({plan.decode.num_splits, rows, hq, d}, query.options().dtype(at::kFloat));
      part_lse = at::empty({plan.decode.num_splits, rows, hq}, query.options().dtype(at::kFloat));
      p.part_out = part_out.data_ptr<float>();
      p.part_lse = part_lse.data_ptr<float>();
      AK_TRACK_SCRATCH("part_out", p.part_out, size_t(part_out.numel()) * 4);
      AK_TRACK_SCRATCH("part_lse", p.part_lse, size_t(part_lse.numel()) * 4);
      split_counters(query, plan.decode.counters(), stream, capturing, counters);
      p.counters = counters.ptr;
      p.epoch = counters.epoch;
    }
  } else {
    AK_CHECK("window_attention", hq <= 65535, "num_q_heads must be <= 65535 on CUDA (prefill grid), got ", hq);
    AK_CHECK("window_attention", plan.pre.bn > 0, "prefill with head_dim ", d, " needs at least ",
             prefill_smem(int(d), d < 96 ? 64 : 32, 2, fp8), " bytes of shared memory per block but this GPU allows ",
             apply_smem_knob(props).smem_optin);
  }
  cudaError_t err = cudaSuccess;
  dispatch_head_dim(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (dt == at::kHalf) {
      err = fp8 ? run_window_attention<__half, uint8_t, D>(p, plan, stream)
                : run_window_attention<__half, __half, D>(p, plan, stream);
    } else {
      err = fp8 ? run_window_attention<__nv_bfloat16, uint8_t, D>(p, plan, stream)
                : run_window_attention<__nv_bfloat16, __nv_bfloat16, D>(p, plan, stream);
    }
  });
  return err;
}

}  // namespace arkernels
