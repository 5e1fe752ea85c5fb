// primitives.cpp -- tests of the tensor-core / async-copy primitives of csrc/device_mma.cuh under the SIMT emulator:
// each primitive against a plain matmul or copy, plus a small tiled GEMM (cp.async ring -> ldmatrix -> mma.sync) that
// scripts/simt_faults.py injects faults into. No libtorch. Prints one line per case; exits 1 on any failure or
// unexpected emulator report. Optional argument: a substring selecting cases (e.g. `gemm`).
//   g++ -std=c++20 -O2 -pthread -DARKERNELS_SIMT -ftrivial-auto-var-init=pattern -I/usr/local/cuda/include
//       -Icsrc csrc/simt/tests/primitives.cpp -o build/simt_primitives && build/simt_primitives
//   sanitizers: add `-O1 -g -fsanitize=thread`, or `-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all`.
// -ftrivial-auto-var-init=pattern: uninitialised registers (a missing accumulator init) hold 0xFE.. garbage, as on a
// GPU, instead of the zeros of a fresh thread stack.
// The same file compiles as CUDA (nvcc -x cu -arch=sm_90; managed memory) for a GPU run of the same kernels; the
// checks of emulator-only behaviour (poison before a wait, reports) are skipped there.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device.cuh"
#include "device_mma.cuh"

using namespace arkernels;

#if defined(ARKERNELS_SIMT)
constexpr bool kEmulated = true;
static long emulator_errors() { return simt::g_errors.load(); }
static void clear_emulator_errors() { simt::clear_errors(); }
template <typename T>
static T* alloc(size_t n) {  // exact size (ASan sees overruns), 256-byte aligned like cudaMalloc
  return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(256)));
}
static void release(void* p) { ::operator delete(p, std::align_val_t(256)); }
static void device_sync() {}
#else
constexpr bool kEmulated = false;
static long emulator_errors() { return 0; }
static void clear_emulator_errors() {}
template <typename T>
static T* alloc(size_t n) {
  T* p = nullptr;
  if (cudaMallocManaged(&p, n * sizeof(T)) != cudaSuccess) std::abort();
  return p;
}
static void release(void* p) { cudaFree(p); }
static void device_sync() {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
    std::exit(2);
  }
}
#endif

// ---------------------------------------------------------------- helpers
template <typename T>
__device__ __forceinline__ uint16_t bits16(T v) {
  uint16_t b;
  memcpy(&b, &v, 2);
  return b;
}
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  return uint32_t(bits16(lo)) | uint32_t(bits16(hi)) << 16;
}
template <typename T>
static T to_t(float x);
template <>
__half to_t<__half>(float x) { return __float2half(x); }
template <>
__nv_bfloat16 to_t<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
static float to_f(__half x) { return __half2float(x); }
static float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

struct Runner {
  std::string filter;
  int cases = 0, failed = 0;
  bool want(const char* name) const { return filter.empty() || std::string(name).find(filter) != std::string::npos; }
  // ok: the case's own verdict; reports_expected: the case provokes emulator reports on purpose (checked by it).
  void done(const char* name, bool ok, double err, double tol, bool reports_expected = false) {
    const long rep = emulator_errors();
    if (!reports_expected && rep) ok = false;
    ++cases;
    failed += !ok;
    std::printf("%-34s %-4s max_err %.3g (tol %.3g)%s\n", name, ok ? "ok" : "FAIL", err, tol,
                !reports_expected && rep ? "  [emulator reports]" : "");
    std::fflush(stdout);
    clear_emulator_errors();
  }
};

// ---------------------------------------------------------------- mma.sync m16n8k16: fragments by direct indexing
// One 16x8x16 problem per block (one warp): A [16][16] row-major, B [16][8] row-major ([k][n]), C, D [16][8] fp32.
template <typename T>
__global__ void mma_kernel(const T* A, const T* B, const float* C, float* D) {
  A += blockIdx.x * 256;
  B += blockIdx.x * 128;
  C += blockIdx.x * 128;
  D += blockIdx.x * 128;
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto a_at = [&](int r, int c) { return dev::ld_global(A + r * 16 + c); };
  auto b_at = [&](int k, int n) { return dev::ld_global(B + k * 8 + n); };
  const uint32_t a[4] = {pack2(a_at(g, 2 * t), a_at(g, 2 * t + 1)), pack2(a_at(g + 8, 2 * t), a_at(g + 8, 2 * t + 1)),
                         pack2(a_at(g, 2 * t + 8), a_at(g, 2 * t + 9)),
                         pack2(a_at(g + 8, 2 * t + 8), a_at(g + 8, 2 * t + 9))};
  const uint32_t b[2] = {pack2(b_at(2 * t, g), b_at(2 * t + 1, g)), pack2(b_at(2 * t + 8, g), b_at(2 * t + 9, g))};
  float c[4], d[4];
  for (int e = 0; e < 4; ++e) c[e] = dev::ld_global(C + (g + 8 * (e / 2)) * 8 + 2 * t + e % 2);
  dev::mma_m16n8k16<T>(d, a, b, c);
  for (int e = 0; e < 4; ++e) dev::st_global(D + (g + 8 * (e / 2)) * 8 + 2 * t + e % 2, d[e]);
}

// fp32 sequential sum of 16 exact products: |error| <= ~17 * 2^-24 * (|c| + sum |a b|); 2x that leaves room for the
// tensor cores' own order and truncation. A fragment-layout error is O(|a b|), far above.
static double mma_tol(int K, double abs_sum) { return 2.0 * (K + 1) * std::ldexp(1.0, -24) * abs_sum + 1e-30; }

template <typename T>
static void test_mma(Runner& run, const char* name, bool integers) {
  if (!run.want(name)) return;
  const int tiles = 4;
  std::mt19937 rng(integers ? 7 : 11);
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  std::uniform_int_distribution<int> small(-3, 3);
  T *A = alloc<T>(tiles * 256), *B = alloc<T>(tiles * 128);
  float *C = alloc<float>(tiles * 128), *D = alloc<float>(tiles * 128);
  for (int i = 0; i < tiles * 256; ++i) A[i] = to_t<T>(integers ? float(small(rng)) : uni(rng));
  for (int i = 0; i < tiles * 128; ++i) {
    B[i] = to_t<T>(integers ? float(small(rng)) : uni(rng));
    C[i] = integers ? float(small(rng)) : uni(rng);
    D[i] = std::nanf("");
  }
  AK_LAUNCH(mma_kernel<T>, dim3(tiles), dim3(32), 0, 0, A, B, C, D);
  device_sync();
  double err = 0, tol_at_worst = 0;
  int bad = 0, swap_seen = 0;
  for (int t = 0; t < tiles; ++t)
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 8; ++n) {
        double ref = C[t * 128 + m * 8 + n], abs_sum = std::fabs(ref), ref_swapped = ref;
        for (int k = 0; k < 16; ++k) {
          const double p = double(to_f(A[t * 256 + m * 16 + k])) * to_f(B[t * 128 + k * 8 + n]);
          ref += p;
          abs_sum += std::fabs(p);
          // the same sum with rows k and k^1 of B exchanged: what a wrong packing order would compute
          ref_swapped += double(to_f(A[t * 256 + m * 16 + k])) * to_f(B[t * 128 + (k ^ 1) * 8 + n]);
        }
        const double tol = integers ? 0.0 : mma_tol(16, abs_sum);
        const double e = std::fabs(D[t * 128 + m * 8 + n] - ref);
        bad += !(e <= tol);
        if (!(e <= err)) err = std::isnan(e) ? INFINITY : e, tol_at_worst = tol;
        swap_seen += std::fabs(ref_swapped - ref) > tol;
      }
  bool ok = bad == 0;
  // The tolerance can fail: a wrong packing order (B rows k, k^1 exchanged) must exceed it on almost every output.
  if (swap_seen < tiles * 128 * 9 / 10) {
    std::printf("%s: tolerance too loose: a swapped packing exceeds it on only %d of %d outputs\n", name, swap_seen,
                tiles * 128);
    ok = false;
  }
  run.done(name, ok, err, tol_at_worst);
  release(A), release(B), release(C), release(D);
}

// ---------------------------------------------------------------- ldmatrix x1/x2/x4 (.trans) vs direct indexing
constexpr int kLdStride = 24;  // shared row stride in 16-bit elements: 48 bytes, 16-byte aligned, not 8 elements
template <int N, bool Trans>
__device__ __forceinline__ void ldmatrix_n(uint32_t (&r)[N], const void* p) {
  if constexpr (N == 1 && !Trans) dev::ldmatrix_x1(r, p);
  if constexpr (N == 2 && !Trans) dev::ldmatrix_x2(r, p);
  if constexpr (N == 4 && !Trans) dev::ldmatrix_x4(r, p);
  if constexpr (N == 1 && Trans) dev::ldmatrix_x1_trans(r, p);
  if constexpr (N == 2 && Trans) dev::ldmatrix_x2_trans(r, p);
  if constexpr (N == 4 && Trans) dev::ldmatrix_x4_trans(r, p);
}
// src [32][8]: row r of matrix m is src row 8m + r. It is stored at the permuted shared row (13 * (8m + r)) % 32, so
// every lane's own row address matters. misalign: byte offset added to lane 3's address (an emulator report).
template <int N, bool Trans>
__global__ void ldmatrix_kernel(const uint16_t* src, uint32_t* out, int misalign) {
  AK_SHARED(16, uint16_t, tile, [32 * kLdStride]);
  const int lane = threadIdx.x, srow = (lane * 13) % 32;
  for (int c = 0; c < 8; ++c) tile[srow * kLdStride + c] = dev::ld_global(src + lane * 8 + c);
  __syncwarp();
  uint32_t r[N];
  ldmatrix_n<N, Trans>(r, reinterpret_cast<const unsigned char*>(&tile[srow * kLdStride]) + (lane == 3 ? misalign : 0));
  for (int m = 0; m < N; ++m) dev::st_global(out + lane * 4 + m, r[m]);
}

template <int N, bool Trans>
static void test_ldmatrix(Runner& run, const char* name) {
  if (!run.want(name)) return;
  uint16_t* src = alloc<uint16_t>(256);
  uint32_t* out = alloc<uint32_t>(128);
  std::mt19937 rng(N * 2 + Trans);
  for (int i = 0; i < 256; ++i) src[i] = uint16_t(rng());
  for (int i = 0; i < 128; ++i) out[i] = 0xdeadbeef;
  AK_LAUNCH((ldmatrix_kernel<N, Trans>), dim3(1), dim3(32), 0, 0, src, out, 0);
  device_sync();
  auto id = [&](int m, int r, int c) { return uint32_t(src[(8 * m + r) * 8 + c]); };
  int bad = 0;
  for (int l = 0; l < 32; ++l)
    for (int m = 0; m < N; ++m) {
      const int g = l / 4, t = l % 4;
      const uint32_t want = Trans ? id(m, 2 * t, g) | id(m, 2 * t + 1, g) << 16 : id(m, g, 2 * t) | id(m, g, 2 * t + 1) << 16;
      bad += out[l * 4 + m] != want;
    }
  run.done(name, bad == 0, bad, 0);
  if (kEmulated && N == 4 && !Trans && run.want("ldmatrix_misaligned")) {  // a row address off 16 bytes is reported
    AK_LAUNCH((ldmatrix_kernel<N, Trans>), dim3(1), dim3(32), 0, 0, src, out, 2);
    device_sync();
    run.done("ldmatrix_misaligned_reported", emulator_errors() > 0, 0, 0, true);
  }
  release(src), release(out);
}

// ---------------------------------------------------------------- cp.async commit groups, wait_group N, zero-fill
// 64 threads; thread i copies chunk (g, i) (16 bytes, nbytes[g][i] of them from src, the rest zero-filled) into stage g
// of shared memory and commits one group per stage. After wait_group w (w = G-1 .. 0) it snapshots all its stages:
// out[w][g][i]. A source with 0 bytes points one past the end of src: reading it would be an ASan report.
constexpr int kCpThreads = 64;
template <int G>
__global__ void cp_groups_kernel(const unsigned char* src, const int* nbytes, unsigned char* out) {
  AK_SHARED(16, unsigned char, buf, [3 * kCpThreads * 16]);
  const int i = threadIdx.x;
  for (int g = 0; g < G; ++g) {
    const int chunk = g * kCpThreads + i, n = dev::ld_global(nbytes + chunk);
    dev::cp_async_16(&buf[chunk * 16], n ? src + chunk * 16 : src + G * kCpThreads * 16, n);
    dev::cp_async_commit();
  }
  auto snapshot = [&](int w) {
    for (int g = 0; g < G; ++g) {
      const int chunk = g * kCpThreads + i;
      dev::st_global(reinterpret_cast<uint4*>(out) + w * G * kCpThreads + chunk,
                     *reinterpret_cast<const uint4*>(&buf[chunk * 16]));
    }
  };
  if constexpr (G >= 3) {
    dev::cp_async_wait<2>();
    snapshot(2);
  }
  if constexpr (G >= 2) {
    dev::cp_async_wait<1>();
    snapshot(1);
  }
  dev::cp_async_wait<0>();
  snapshot(0);
}

template <int G>
static void test_cp_groups(Runner& run, const char* name) {
  if (!run.want(name)) return;
  const int chunks = G * kCpThreads;
  unsigned char* src = alloc<unsigned char>(chunks * 16);
  int* nbytes = alloc<int>(chunks);
  unsigned char* out = alloc<unsigned char>(G * chunks * 16);
  std::mt19937 rng(G);
  for (int i = 0; i < chunks * 16; ++i) src[i] = uint8_t(rng() | 1);  // never 0: zero-fill shows
  for (int c = 0; c < chunks; ++c) nbytes[c] = (c % 3) ? 16 : int(rng() % 17);  // every size 0..16 appears
  std::memset(out, 0x55, G * chunks * 16);
  AK_LAUNCH(cp_groups_kernel<G>, dim3(1), dim3(kCpThreads), 0, 0, src, nbytes, out);
  device_sync();
  int bad = 0, stale = 0;
  for (int w = 0; w < G; ++w)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kCpThreads; ++c) {
        const int chunk = g * kCpThreads + c;
        const unsigned char* got = out + (w * chunks + chunk) * 16;
        if (g < G - w) {  // wait_group w covers the G - w oldest groups
          for (int b = 0; b < 16; ++b) bad += got[b] != (b < nbytes[chunk] ? src[chunk * 16 + b] : 0);
        } else if (kEmulated) {  // still in flight: poison (on a GPU it may have landed early)
          for (int b = 0; b < 16; ++b) stale += got[b] != 0xFF;
        }
      }
  run.done(name, bad == 0 && stale == 0, bad + stale, 0);
  release(src), release(nbytes), release(out);
}

// wait_group 0 does not cover copies issued after the last commit; wait_all does (it commits them first).
__global__ void cp_wait_all_kernel(const unsigned char* src, unsigned char* out) {
  AK_SHARED(16, unsigned char, buf, [2 * 32 * 16]);
  const int i = threadIdx.x;
  dev::cp_async_16(&buf[i * 16], src + i * 16, 16);
  dev::cp_async_commit();
  dev::cp_async_16(&buf[(32 + i) * 16], src + (32 + i) * 16, 16);  // not committed
  dev::cp_async_wait<0>();
  dev::st_global(reinterpret_cast<uint4*>(out) + i, *reinterpret_cast<const uint4*>(&buf[i * 16]));
  dev::st_global(reinterpret_cast<uint4*>(out) + 32 + i, *reinterpret_cast<const uint4*>(&buf[(32 + i) * 16]));
  dev::cp_async_wait_all();
  dev::st_global(reinterpret_cast<uint4*>(out) + 64 + i, *reinterpret_cast<const uint4*>(&buf[(32 + i) * 16]));
}

static void test_cp_wait_all(Runner& run) {
  const char* name = "cp_async_wait_all";
  if (!run.want(name)) return;
  unsigned char *src = alloc<unsigned char>(64 * 16), *out = alloc<unsigned char>(96 * 16);
  for (int i = 0; i < 64 * 16; ++i) src[i] = uint8_t(i * 7 + 1);
  AK_LAUNCH(cp_wait_all_kernel, dim3(1), dim3(32), 0, 0, src, out);
  device_sync();
  int bad = 0;
  for (int b = 0; b < 32 * 16; ++b) bad += out[b] != src[b];                   // group 0 after wait_group 0
  for (int b = 0; b < 32 * 16 && kEmulated; ++b) bad += out[512 + b] != 0xFF;  // uncommitted: not covered
  for (int b = 0; b < 32 * 16; ++b) bad += out[1024 + b] != src[512 + b];      // after wait_all
  run.done(name, bad == 0, bad, 0);
  release(src), release(out);
}

// Reading the destination before the wait: must see the poison (emulator), i.e. wrong data.
__global__ void cp_read_before_wait_kernel(const unsigned char* src, unsigned char* out) {
  AK_SHARED(16, unsigned char, buf, [32 * 16]);
  const int i = threadIdx.x;
  dev::cp_async_16(&buf[i * 16], src + i * 16, 16);
  dev::cp_async_commit();
  dev::st_global(reinterpret_cast<uint4*>(out) + i, *reinterpret_cast<const uint4*>(&buf[i * 16]));  // too early
  dev::cp_async_wait<0>();
}
// A copy never waited for: reported when the block ends.
__global__ void cp_no_wait_kernel(const unsigned char* src) {
  AK_SHARED(16, unsigned char, buf, [32 * 16]);
  dev::cp_async_16(&buf[threadIdx.x * 16], src + threadIdx.x * 16, 16);
  dev::cp_async_commit();
}

static void test_cp_misuse(Runner& run) {
  if (!kEmulated) return;
  unsigned char *src = alloc<unsigned char>(32 * 16), *out = alloc<unsigned char>(32 * 16);
  for (int i = 0; i < 32 * 16; ++i) src[i] = uint8_t(i % 254 + 1);  // never 0xFF, the poison
  if (run.want("cp_async_read_before_wait_wrong")) {
    AK_LAUNCH(cp_read_before_wait_kernel, dim3(1), dim3(32), 0, 0, src, out);
    device_sync();
    int same = 0;
    for (int b = 0; b < 32 * 16; ++b) same += out[b] == src[b];
    run.done("cp_async_read_before_wait_wrong", same == 0, same, 0);
  }
  if (run.want("cp_async_no_wait_reported")) {
    AK_LAUNCH(cp_no_wait_kernel, dim3(2), dim3(32), 0, 0, src);
    device_sync();
    // one report per thread and block: block 0's when the thread starts block 1, block 1's when the launch ends
    run.done("cp_async_no_wait_reported", emulator_errors() == 64, 0, 0, true);
  }
  release(src), release(out);
}

// ---------------------------------------------------------------- a tiled GEMM: cp.async ring -> ldmatrix -> mma.sync
// C [M][N] fp32 = A [M][K] row-major * B [K][N] row-major, T = __half or bf16. CTA tile 64x64, 4 warps (2x2, each
// 32x32 = 2 m16 x 4 n8 mma tiles), BK = 32 in a 2-stage cp.async ring. Rows are 16-byte chunks: K % 8 == 0 and
// N % 8 == 0; chunks past M, N or K are zero-filled (src_bytes 0). Shared rows padded by 8 elements (16 bytes) so
// ldmatrix row addresses stay 16-byte aligned and the 8 rows of a matrix fall in different bank groups.
constexpr int kBM = 64, kBN = 64, kBK = 32, kLdsA = kBK + 8, kLdsB = kBN + 8;
template <typename T>
__global__ void __launch_bounds__(128) gemm_kernel(const T* A, const T* B, float* C, int M, int N, int K) {
  AK_SHARED(16, T, As, [2][kBM][kLdsA]);
  AK_SHARED(16, T, Bs, [2][kBK][kLdsB]);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN, wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  float acc[2][4][4];
  // FAULT(gemm_acc_zero)
  for (int i = 0; i < 32; ++i) acc[i / 16][(i / 4) % 4][i % 4] = 0.f;
  auto load_stage = [&](int s, int k0) {
    for (int i = 0; i < 2; ++i) {  // A: 64 rows x 4 chunks, 2 per thread
      const int c = tid + i * 128, r = c / 4, kc = (c % 4) * 8, gm = m0 + r, gk = k0 + kc;
      const bool in = gm < M && gk < K;
      // FAULT(gemm_copy_a)
      dev::cp_async_16(&As[s][r][kc], in ? A + size_t(gm) * K + gk : A, in ? 16 : 0);
    }
    for (int i = 0; i < 2; ++i) {  // B: 32 rows x 8 chunks, 2 per thread
      const int c = tid + i * 128, r = c / 8, nc = (c % 8) * 8, gk = k0 + r, gn = n0 + nc;
      const bool in = gk < K && gn < N;
      dev::cp_async_16(&Bs[s][r][nc], in ? B + size_t(gk) * N + gn : B, in ? 16 : 0);
    }
  };
  const int ktiles = (K + kBK - 1) / kBK;
  load_stage(0, 0);
  dev::cp_async_commit();
  for (int kt = 0; kt < ktiles; ++kt) {
    const int s = kt & 1;
    if (kt + 1 < ktiles) load_stage(s ^ 1, (kt + 1) * kBK);
    dev::cp_async_commit();  // an empty group on the last tile keeps wait_group 1 meaning "stage s has landed"
    // FAULT(gemm_stage_wait)
    dev::cp_async_wait<1>();
    __syncthreads();  // every thread's copies of stage s are visible
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t a[2][4], b[4][2];
      for (int mi = 0; mi < 2; ++mi)  // x4: rows 0-7 / 8-15 at k 0-7, then at k 8-15 = a[0..3]
        // FAULT(gemm_ldmatrix_a)
        dev::ldmatrix_x4(a[mi], &As[s][wm + mi * 16 + lane % 16][kk + (lane / 16) * 8]);
      for (int nj = 0; nj < 2; ++nj) {  // x4.trans of [k][n]: k 0-7 / 8-15 at n 0-7, then at n 8-15 = two b pairs
        uint32_t r[4];
        // FAULT(gemm_ldmatrix_b)
        dev::ldmatrix_x4_trans(r, &Bs[s][kk + lane % 16][wn + nj * 16 + (lane / 16) * 8]);
        b[2 * nj][0] = r[0], b[2 * nj][1] = r[1], b[2 * nj + 1][0] = r[2], b[2 * nj + 1][1] = r[3];
      }
      for (int mi = 0; mi < 2; ++mi)
        for (int ni = 0; ni < 4; ++ni) dev::mma_m16n8k16<T>(acc[mi][ni], a[mi], b[ni], acc[mi][ni]);
    }
    // FAULT(gemm_refill_sync)
    __syncthreads();  // stage s is refilled by the next iteration's cp.async
  }
  for (int mi = 0; mi < 2; ++mi)
    for (int ni = 0; ni < 4; ++ni)
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + wm + mi * 16 + lane / 4 + 8 * (e / 2), col = n0 + wn + ni * 8 + 2 * (lane % 4) + e % 2;
        if (row < M && col < N) dev::st_global(C + size_t(row) * N + col, acc[mi][ni][e]);
      }
}

template <typename T>
static void test_gemm(Runner& run, const char* name, int M, int N, int K) {
  if (!run.want(name)) return;
  T *A = alloc<T>(size_t(M) * K), *B = alloc<T>(size_t(K) * N);
  float* C = alloc<float>(size_t(M) * N);
  std::mt19937 rng(M * 7 + K);
  std::normal_distribution<float> nd;
  for (size_t i = 0; i < size_t(M) * K; ++i) A[i] = to_t<T>(nd(rng));
  for (size_t i = 0; i < size_t(K) * N; ++i) B[i] = to_t<T>(nd(rng));
  for (size_t i = 0; i < size_t(M) * N; ++i) C[i] = std::nanf("");  // every output must be written
  const int grid_n = (N + kBN - 1) / kBN, grid_m = (M + kBM - 1) / kBM;
#if defined(ARKERNELS_SIMT)
  simt::reset_traffic();
  simt::track_buffer("A", A, size_t(M) * K * sizeof(T));
  simt::track_buffer("B", B, size_t(K) * N * sizeof(T));
  simt::track_buffer("C", C, size_t(M) * N * sizeof(float));
#endif
  AK_LAUNCH(gemm_kernel<T>, dim3(grid_n, grid_m), dim3(128), 0, 0, A, B, C, M, N, K);
  device_sync();
  bool ok = true;
#if defined(ARKERNELS_SIMT)
  // Traffic (cp.async counts its src_bytes at issue, zero-filled chunks nothing): each byte of A is read once per
  // column of blocks, each byte of B once per row of blocks, each output written once; nothing outside them.
  auto every = [](const simt::Buffer* b, bool write, uint32_t want) {
    for (size_t i = 0; i < b->bytes; ++i)
      if ((write ? b->writes : b->reads)[i].load() != want) return false;
    return true;
  };
  const bool traffic = every(simt::find_buffer("A"), false, grid_n) && every(simt::find_buffer("B"), false, grid_m) &&
                       every(simt::find_buffer("C"), true, 1) && simt::g_other_read == 0 && simt::g_other_write == 0;
  if (!traffic) std::printf("%s: global traffic is not exactly A x %d, B x %d, C written once\n", name, grid_n, grid_m);
  ok = ok && traffic;
  simt::reset_traffic();
#endif
  double err = 0, tol_at = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0, abs_sum = 0;
      for (int k = 0; k < K; ++k) {
        const double p = double(to_f(A[size_t(m) * K + k])) * to_f(B[size_t(k) * N + n]);
        ref += p;
        abs_sum += std::fabs(p);
      }
      const double tol = mma_tol(K, abs_sum), e = std::fabs(C[size_t(m) * N + n] - ref);
      if (!(e <= tol)) ok = false;
      if (!(e <= err)) err = std::isnan(e) ? INFINITY : e, tol_at = tol;
    }
  run.done(name, ok, err, tol_at);
  release(A), release(B), release(C);
}

int main(int argc, char** argv) {
  Runner run;
  if (argc > 1) run.filter = argv[1];
  test_mma<__half>(run, "mma_m16n8k16_f16", false);
  test_mma<__nv_bfloat16>(run, "mma_m16n8k16_bf16", false);
  test_mma<__half>(run, "mma_m16n8k16_f16_integers_exact", true);
  test_mma<__nv_bfloat16>(run, "mma_m16n8k16_bf16_integers_exact", true);
  test_ldmatrix<1, false>(run, "ldmatrix_x1");
  test_ldmatrix<2, false>(run, "ldmatrix_x2");
  test_ldmatrix<4, false>(run, "ldmatrix_x4");
  test_ldmatrix<1, true>(run, "ldmatrix_x1_trans");
  test_ldmatrix<2, true>(run, "ldmatrix_x2_trans");
  test_ldmatrix<4, true>(run, "ldmatrix_x4_trans");
  test_cp_groups<1>(run, "cp_async_1_group");
  test_cp_groups<2>(run, "cp_async_2_groups");
  test_cp_groups<3>(run, "cp_async_3_groups");
  test_cp_wait_all(run);
  test_cp_misuse(run);
  // M, N not multiples of 64 and K not of 32: partial tiles, zero-filled chunks, an odd number of ring stages.
  test_gemm<__half>(run, "gemm_f16_80x72x200", 80, 72, 200);
  test_gemm<__nv_bfloat16>(run, "gemm_bf16_80x72x200", 80, 72, 200);
  std::printf("%d cases, %d failed\n", run.cases, run.failed);
  return run.failed || run.cases == 0 ? 1 : 0;
}
