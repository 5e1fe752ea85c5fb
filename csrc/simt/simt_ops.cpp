// The SIMT emulator as torch ops: the CUDA kernels' exact source (csrc/<stem>_kernels.cuh + csrc/<stem>_launch.h,
// the same files csrc/<stem>.cu compiles) run on CPU tensors, registered as arkernels_simt::<op> with arkernels'
// own schemas (arkernels/simt.py copies them, so they are written once, in csrc/torch_bindings.cpp).
// Built by `python -m arkernels.simt build` (plain, or with -fsanitize=thread / address,undefined); used by the tests
// through `with arkernels.simt.emulate(): ...`, which routes arkernels::<op> on CPU tensors here.
// Per op call: the traffic meter is reset, the op's tensors are registered by argument name, every tensor the launch
// code allocates (outputs, split partials) is poisoned, and emulator reports (divergent barriers aside, which abort)
// become an error.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <atomic>

#include "../cluster.cuh"
#include "../int8_matmul_launch.h"
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

// The CPU allocator, wrapped: while an emulated op runs, every allocation is filled with the poison byte (0xFF: NaN in
// fp32/fp16/bf16), so an output row or partial the kernel never writes reads as NaN instead of whatever the allocator
// recycled (often the right answer of the previous, identical call).
struct PoisonAllocator final : c10::Allocator {
  c10::Allocator* inner = nullptr;
  std::atomic<bool> on{false};
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr p = inner->allocate(n);
    if (on.load() && n > 0 && p.get() != nullptr) std::memset(p.get(), ::simt::g_poison, n);
    return p;
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner->copy_data(dest, src, count);
  }
  bool is_simple_data_ptr(const c10::DataPtr& p) const override { return inner->is_simple_data_ptr(p); }
};
PoisonAllocator& poison_allocator() {
  static PoisonAllocator* const a = [] {
    auto* x = new PoisonAllocator;  // never destroyed: tensors it handed out may outlive any static
    x->inner = c10::GetCPUAllocator();
    c10::SetCPUAllocator(x, /*priority=*/0);
    return x;
  }();
  TORCH_CHECK(c10::GetCPUAllocator() == a, "arkernels.simt: another CPU allocator replaced the poisoning one");
  return *a;
}
struct PoisonScope {
  PoisonScope() { poison_allocator().on = true; }
  ~PoisonScope() { poison_allocator().on = false; }
};

// Runs f under the emulator: one op at a time, a fresh traffic window and error log, allocations poisoned; reports
// become an exception.
template <typename F>
auto emulated(const char* op, F&& f) {
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  ::simt::clear_errors();
  ::simt::g_max_dynamic_smem.clear();
  ::simt::g_nonportable_cluster.clear();
  auto result = [&] {
    const PoisonScope poison;
    return f();
  }();
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

at::Tensor w8a16_fragment_matmul_simt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                      const std::optional<at::Tensor>& bias) {
  check_w8a16_fragment_matmul(x, w, w_scale, bias);
  return emulated("w8a16_fragment_matmul", [&] {
    ::simt::reset_traffic();
    track("x", x);
    track("w", w);
    track("w_scale", w_scale);
    if (bias) track("bias", *bias);
    at::Tensor y;
    const cudaError_t err = w8a16_fragment_matmul_launch(x, w, w_scale, bias, emulated_device_props(), nullptr,
                                                         /*capturing=*/false, y);
    TORCH_CHECK(err == cudaSuccess, "w8a16_fragment_matmul (SIMT emulator): launch failed");
    return y;
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
// The last op call's launches, flattened: (grid x, y, z, threads, dynamic smem bytes, PDL launch 0/1, CTAs that
// executed griddepcontrol.launch_dependents, blocks per cluster, bytes moved through distributed shared memory) per
// launch.
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
// True (default): a block's global stores reach later blocks only through __threadfence (see simt.h, g_visibility).
void set_visibility(bool on) { ::simt::g_visibility = on; }
// The next launch aborts on block `block` (linear id, x fastest): that block never runs (see simt.h, g_abort_block).
void abort_block_of_next_launch(int64_t block) { ::simt::g_abort_block = static_cast<long>(block); }
bool get_visibility() { return ::simt::g_visibility; }
// True (default): launch_pdl makes PDL launches on an sm_90 device (see simt.h, g_pdl_enabled); false: plain ones.
void set_pdl(bool on) { ::simt::g_pdl_enabled = on; }
bool get_pdl() { return ::simt::g_pdl_enabled; }
// True (default): launch planning may take thread-block clusters on an sm_90 device (csrc/cluster.cuh,
// cluster_plannable); false: none (ARKERNELS_CLUSTER=0 at process start does the same).
void set_cluster(bool on) { ::simt::g_cluster_enabled = on; }
bool get_cluster() { return ::simt::g_cluster_enabled; }

// ---- probes of the emulator's own model (tests/test_simt_emulator.py) ----
// `blocks` blocks of 32 threads: each thread of block k stores k + 1 to slot[k * 32 + tid] and, when `fence`,
// executes __threadfence; thread 0 then counts the block done; the block that counts last sums every slot into out[0]
// (the threadFenceReduction pattern of the CUDA samples, and of decode's split-KV combine).
__global__ void fence_probe_kernel(float* slot, int* counter, float* out, bool fence) {
  AK_SHARED(4, int, last, [1]);
  const int tid = threadIdx.x;
  dev::st_global(slot + blockIdx.x * 32 + tid, float(blockIdx.x + 1));
  if (fence) dev::threadfence();
  __syncthreads();
  if (tid == 0) last[0] = dev::atomic_add(counter, 1) == int(gridDim.x) - 1;
  __syncthreads();
  if (!last[0] || tid != 0) return;
  dev::threadfence();
  float sum = 0.f;
  for (unsigned i = 0; i < gridDim.x * 32; ++i) sum += dev::ld_global_cg(slot + i);
  dev::st_global(out, sum);
}
// -> (the sum the last block saw, the slots after the launch)
std::tuple<at::Tensor, at::Tensor> fence_probe(int64_t blocks, bool fence) {
  TORCH_CHECK(blocks >= 1 && blocks <= 64, "blocks: 1..64");
  return emulated("fence_probe", [&] {
    ::simt::reset_traffic();
    at::Tensor slot = at::zeros({blocks * 32}, at::kFloat), out = at::zeros({1}, at::kFloat);
    at::Tensor counter = at::zeros({1}, at::kInt);
    ::simt::launch(dim3(unsigned(blocks)), dim3(32), 0, fence_probe_kernel, slot.data_ptr<float>(),
                   counter.data_ptr<int32_t>(), out.data_ptr<float>(), fence);
    return std::make_tuple(out, slot);
  });
}
// One block of 32 threads launched by launch_pdl (pdl.cuh): each thread copies src[tid] to dst[tid]; `order` 0 waits
// (pdl_wait) first, 1 loads before the wait, 2 stores (a zero) before it, 3 returns at once (no access, no wait);
// every thread then triggers its dependents.
__global__ void pdl_probe_kernel(const float* src, float* dst, int order) {
  const int tid = threadIdx.x;
  if (order == 3) return;
  if (order == 2) dev::st_global(dst + tid, 0.f);
  if (order == 0 || order == 2) dev::pdl_wait();
  const float v = dev::ld_global(src + tid);
  if (order == 1) dev::pdl_wait();
  dev::st_global(dst + tid, v);
  dev::pdl_launch_dependents();
}
// -> dst (src's values 1 .. 32; zeros for order 3)
at::Tensor pdl_probe(int64_t order) {
  TORCH_CHECK(order >= 0 && order <= 3, "order: 0..3");
  return emulated("pdl_probe", [&] {
    ::simt::reset_traffic();
    at::Tensor src = at::arange(1, 33, at::kFloat), dst = at::zeros({32}, at::kFloat);
    const cudaError_t err = launch_pdl(pdl_probe_kernel, dim3(1), dim3(32), 0, nullptr, src.data_ptr<float>(),
                                       dst.data_ptr<float>(), int(order));
    TORCH_CHECK(err == cudaSuccess, "pdl_probe: launch failed");
    return dst;
  });
}
// The same protocol with one thread's release / acquire (decode's split-KV combine, CUTLASS's GenericBarrier): every
// thread stores, then `mode` 0: __syncthreads, thread 0's release add (dev::atomic_add_release), the last block's
// thread 0 acquires (dev::fence_acq_rel), __syncthreads, every thread of the last block sums the slots of its lane;
// 1: the add relaxed (no release); 2: no acquire; 3: the release before the __syncthreads (it orders only thread 0's
// own stores). The counter is 64-bit (the release add's type).
__global__ void release_probe_kernel(float* slot, unsigned long long* counter, float* out, int mode) {
  AK_SHARED(4, int, last, [1]);
  const int tid = threadIdx.x;
  dev::st_global(slot + blockIdx.x * 32 + tid, float(blockIdx.x + 1));
  if (mode != 3) __syncthreads();
  if (tid == 0) {
    const unsigned long long n = mode == 1 ? dev::atomic_add(counter, 1ull) : dev::atomic_add_release(counter, 1ull);
    last[0] = n == gridDim.x - 1;
    if (last[0] && mode != 2) dev::fence_acq_rel();
  }
  __syncthreads();
  if (!last[0]) return;
  float sum = 0.f;
  for (unsigned b = 0; b < gridDim.x; ++b) sum += dev::ld_global_cg(slot + b * 32 + tid);
  dev::st_global(out + tid, sum);
}
// -> (each lane's sum in the last block [32], the slots after the launch)
std::tuple<at::Tensor, at::Tensor> release_probe(int64_t blocks, int64_t mode) {
  TORCH_CHECK(blocks >= 1 && blocks <= 64, "blocks: 1..64");
  TORCH_CHECK(mode >= 0 && mode <= 3, "mode: 0..3");
  return emulated("release_probe", [&] {
    ::simt::reset_traffic();
    at::Tensor slot = at::zeros({blocks * 32}, at::kFloat), out = at::zeros({32}, at::kFloat);
    at::Tensor counter = at::zeros({1}, at::kLong);
    ::simt::launch(dim3(unsigned(blocks)), dim3(32), 0, release_probe_kernel, slot.data_ptr<float>(),
                   reinterpret_cast<unsigned long long*>(counter.data_ptr<int64_t>()), out.data_ptr<float>(),
                   int(mode));
    return std::make_tuple(out, slot);
  });
}
// Thread-block clusters (csrc/simt/simt_cluster.h): blocks of 32 threads in clusters of `cluster` along x, 64 floats of
// dynamic shared memory each. Every thread stores v(block, tid) = 100 * block + tid to its smem[tid], then by `mode`:
// 0: cluster barrier; loads smem[tid] of rank (rank + 1) % n through DSMEM into out[block][tid]; cluster barrier.
// 1: no barrier before the load: polls the neighbour's smem[tid] through DSMEM until it changes (a flag read with no
//    barrier: the race the emulator reports), then as 0.
// 2: as 0 without the barrier before exit (a block may exit while its neighbour still reads it).
// 3: as 0 with rank n (outside the cluster).
// 4: stores v to smem[32 + tid] of rank (rank + 1) % n through DSMEM; cluster barrier; out[block][tid] = own
//    smem[32 + tid] (the value of rank (rank - 1) % n); cluster barrier.
// 5: as 0 with a relaxed first barrier (it publishes nothing: the load is a race) and a relaxed last one (enough to
//    order the load before the neighbour's exit).
// info[block] = rank + 100 * nctarank.
__global__ void cluster_probe_kernel(float* out, int* info, int mode) {
  AK_DYNAMIC_SHARED(float, smem);
  const int tid = threadIdx.x;
  const unsigned rank = dev::cluster_ctarank(), n = dev::cluster_nctarank();
  const unsigned next = mode == 3 ? n : (rank + 1) % n;
  const float v = float(100 * blockIdx.x + tid);
  smem[tid] = v;
  if (tid == 0) info[blockIdx.x] = int(rank + 100 * n);
  if (mode == 4) dev::st_dsmem(smem + 32 + tid, next, v);
  if (mode == 1) {
    float seen = dev::ld_dsmem(smem + tid, next);
    while (std::isnan(seen)) seen = dev::ld_dsmem(smem + tid, next);
  } else if (mode == 5) {
    dev::cluster_sync_relaxed();
  } else {
    dev::cluster_sync();
  }
  out[blockIdx.x * 32 + tid] = mode == 4 ? smem[32 + tid] : dev::ld_dsmem(smem + tid, next);
  if (mode == 5) dev::cluster_sync_relaxed();
  if (mode != 2 && mode != 5) dev::cluster_sync();
}
// -> (out [blocks, 32], info [blocks]); `nonportable`: the kernel's NonPortableClusterSizeAllowed attribute.
std::tuple<at::Tensor, at::Tensor> cluster_probe(int64_t blocks, int64_t cluster, int64_t mode, bool nonportable) {
  TORCH_CHECK(blocks >= 1 && blocks <= 64 && cluster >= 1, "blocks: 1..64, cluster >= 1");
  TORCH_CHECK(mode >= 0 && mode <= 5, "mode: 0..5");
  return emulated("cluster_probe", [&] {
    ::simt::reset_traffic();
    at::Tensor out = at::zeros({blocks, 32}, at::kFloat), info = at::zeros({blocks}, at::kInt);
    ::simt::set_nonportable_cluster(cluster_probe_kernel, nonportable);
    ::simt::launch_cluster(false, dim3(unsigned(cluster)), dim3(unsigned(blocks)), dim3(32), 64 * 4,
                           cluster_probe_kernel, out.data_ptr<float>(), info.data_ptr<int32_t>(), int(mode));
    return std::make_tuple(out, info);
  });
}

// An fp32 [n] tensor allocated inside an emulated call and never written: what an unwritten output holds.
at::Tensor alloc_probe(int64_t n) {
  return emulated("alloc_probe", [&] { return at::empty({n}, at::kFloat); });
}

// ---- probes of the tensor-core primitives (tests/test_simt_ptx.py checks them against the PTX ISA's tables) ----
// One warp; lane l passes a[l] (4 registers), b[l] (2), c[l] (4) to dev::mma_m16n8k16<T> and gets d[l].
template <typename T>
__global__ void mma_probe_kernel(const uint32_t* a, const uint32_t* b, const float* c, float* d) {
  const int l = threadIdx.x;
  uint32_t ra[4], rb[2];
  float rc[4], rd[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[l * 4 + i], rc[i] = c[l * 4 + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[l * 2 + i];
  dev::mma_m16n8k16<T>(rd, ra, rb, rc);
  for (int i = 0; i < 4; ++i) d[l * 4 + i] = rd[i];
}
// a int32 [32, 4], b int32 [32, 2], c fp32 [32, 4] (per-lane registers) -> d fp32 [32, 4].
at::Tensor mma_probe(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool bf16) {
  auto lanes = [](const at::Tensor& t, int64_t n, at::ScalarType dt) {
    return t.sizes() == at::IntArrayRef({32, n}) && t.scalar_type() == dt && t.is_contiguous();
  };
  TORCH_CHECK(lanes(a, 4, at::kInt) && lanes(b, 2, at::kInt) && lanes(c, 4, at::kFloat),
              "mma_probe: a int32 [32, 4], b int32 [32, 2], c fp32 [32, 4], contiguous");
  return emulated("mma_probe", [&] {
    ::simt::reset_traffic();
    at::Tensor d = at::empty({32, 4}, c.options());
    auto* pa = reinterpret_cast<const uint32_t*>(a.data_ptr<int32_t>());
    auto* pb = reinterpret_cast<const uint32_t*>(b.data_ptr<int32_t>());
    auto run = [&](auto kernel) {
      ::simt::launch(dim3(1), dim3(32), 0, kernel, pa, pb, c.data_ptr<float>(), d.data_ptr<float>());
    };
    bf16 ? run(mma_probe_kernel<__nv_bfloat16>) : run(mma_probe_kernel<__half>);
    return d;
  });
}
// One warp; lane l gives the address of row l of a [32][8] 16-bit tile in shared memory (row stride 24 elements: 16-byte
// aligned rows that are not adjacent) to dev::ldmatrix_x{n}[_trans] and gets its n registers.
template <int N, bool Trans>
__global__ void ldmatrix_probe_kernel(const uint16_t* tile, uint32_t* out) {
  AK_SHARED(16, uint16_t, s, [32 * 24]);
  const int l = threadIdx.x;
  for (int c = 0; c < 8; ++c) s[l * 24 + c] = tile[l * 8 + c];
  __syncwarp();
  uint32_t r[N];
  const uint16_t* row = &s[l * 24];
  if constexpr (N == 1) Trans ? dev::ldmatrix_x1_trans(r, row) : dev::ldmatrix_x1(r, row);
  if constexpr (N == 2) Trans ? dev::ldmatrix_x2_trans(r, row) : dev::ldmatrix_x2(r, row);
  if constexpr (N == 4) Trans ? dev::ldmatrix_x4_trans(r, row) : dev::ldmatrix_x4(r, row);
  for (int m = 0; m < N; ++m) out[l * N + m] = r[m];
}
// tile int16 [32, 8] (row 8m + r = row r of matrix m) -> int32 [32, n]: lane l's registers.
at::Tensor ldmatrix_probe(const at::Tensor& tile, int64_t n, bool trans) {
  TORCH_CHECK(tile.sizes() == at::IntArrayRef({32, 8}) && tile.scalar_type() == at::kShort && tile.is_contiguous(),
              "tile: int16 [32, 8]");
  TORCH_CHECK(n == 1 || n == 2 || n == 4, "n: 1, 2 or 4");
  return emulated("ldmatrix_probe", [&] {
    ::simt::reset_traffic();
    at::Tensor out = at::empty({32, n}, tile.options().dtype(at::kInt));
    auto* src = reinterpret_cast<const uint16_t*>(tile.data_ptr<int16_t>());
    auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
    auto run = [&](auto kernel) { ::simt::launch(dim3(1), dim3(32), 0, kernel, src, dst); };
    if (n == 1) trans ? run(ldmatrix_probe_kernel<1, true>) : run(ldmatrix_probe_kernel<1, false>);
    if (n == 2) trans ? run(ldmatrix_probe_kernel<2, true>) : run(ldmatrix_probe_kernel<2, false>);
    if (n == 4) trans ? run(ldmatrix_probe_kernel<4, true>) : run(ldmatrix_probe_kernel<4, false>);
    return out;
  });
}

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
  m.def("set_visibility(bool on) -> ()", &arkernels::set_visibility);
  m.def("get_visibility() -> bool", &arkernels::get_visibility);
  m.def("abort_block_of_next_launch(int block) -> ()", &arkernels::abort_block_of_next_launch);
  m.def("fence_probe(int blocks, bool fence) -> (Tensor, Tensor)", &arkernels::fence_probe);
  m.def("release_probe(int blocks, int mode) -> (Tensor, Tensor)", &arkernels::release_probe);
  m.def("alloc_probe(int n) -> Tensor", &arkernels::alloc_probe);
  m.def("set_pdl(bool on) -> ()", &arkernels::set_pdl);
  m.def("get_pdl() -> bool", &arkernels::get_pdl);
  m.def("pdl_probe(int order) -> Tensor", &arkernels::pdl_probe);
  m.def("set_cluster(bool on) -> ()", &arkernels::set_cluster);
  m.def("get_cluster() -> bool", &arkernels::get_cluster);
  m.def("cluster_probe(int blocks, int cluster, int mode, bool nonportable) -> (Tensor, Tensor)",
        &arkernels::cluster_probe);
  m.def("mma_probe(Tensor a, Tensor b, Tensor c, bool bf16) -> Tensor", &arkernels::mma_probe);
  m.def("ldmatrix_probe(Tensor tile, int n, bool trans) -> Tensor", &arkernels::ldmatrix_probe);
}

TORCH_LIBRARY_IMPL(arkernels_simt, CPU, m) {
  m.impl("paged_kv_append", &arkernels::paged_kv_append_simt);
  m.impl("paged_kv_gather", &arkernels::paged_kv_gather_simt);
  m.impl("window_attention", &arkernels::window_attention_simt);
  m.impl("w8a16_fragment_matmul", &arkernels::w8a16_fragment_matmul_simt);
}
