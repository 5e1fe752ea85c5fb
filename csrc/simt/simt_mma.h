// simt_mma.h -- the emulation of mma.sync m16n8k16, ldmatrix and cp.async behind csrc/device_mma.cuh (included there
// after simt.h under ARKERNELS_SIMT; kernels call arkernels::dev::*, never this directly).
//
// - mma / ldmatrix are warp collectives: each lane deposits its registers (or row address) in a per-warp exchange,
//   meets the others at a warp barrier (simt::group_sync, mask 0xffffffff: a lane missing or arriving from another
//   line is reported as for shuffles), then builds its own outputs from the PTX ISA fragment layouts. The exchange
//   is double-buffered (collective i uses buffer i%2), so one barrier per collective suffices: a lane can only
//   overwrite buffer i%2 in collective i+2, after the barrier of i+1, which every lane reaches after its reads of i.
// - mma computes in fp32: the 16 products of each output are exact (fp16/bf16 x fp16/bf16 fits in fp32) and are added
//   to C in k order. Tensor cores add in another order with their own internal rounding, so results differ by
//   rounding: compare with a tolerance of the K=16 sum (|C| + sum |a*b|) * O(K * 2^-24), never bit for bit.
// - cp.async: each thread keeps its copies in commit groups; a copy lands (source read, bytes past src_bytes zeroed)
//   only when a wait_group covering it executes, the latest moment the PTX memory model allows, so a read before the
//   wait sees poison (a missing wait shows as wrong output, or as a race under TSan). The destination is poisoned at
//   issue too, so a copy into a buffer other threads still read (a missing barrier before refilling a ring stage)
//   shows as poison and as a TSan race, which the late landing alone would hide. Copies still pending when the
//   block ends are reported. Global bytes are counted at issue (simt::on_global_read).
// Assumes one launch at a time per process, as the static shared memory of AK_SHARED already does: the exchange is a
// process-wide array indexed by warp (a per-Group scratch in simt.h would lift that).
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

namespace simt {
namespace mma {

// Shared memory is read and written through these plain (aliasing) types, never memcpy/memset: g++ expands small
// memcpy/memset inline after its TSan pass, so TSan would not see those accesses (a race with them goes unreported).
using u16_any = uint16_t __attribute__((may_alias, aligned(1)));
using u64_any = uint64_t __attribute__((may_alias, aligned(1)));  // aligned(1): still defined after a misalignment report

struct WarpExchange {
  uint32_t regs[2][32][6];  // mma: a[0..3], b[0..1] of each lane
  const void* rows[2][32];  // ldmatrix: each lane's row address
};
// One per warp of a 1024-thread block, per block of a cluster (simt_cluster.h: a cluster's blocks run at once).
inline WarpExchange g_exchange[16][32];
inline thread_local unsigned t_collective;  // this thread's count of collectives: selects the buffer

inline float b16_to_float(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}
inline float lo(uint32_t r, bool bf16) { return b16_to_float(uint16_t(r & 0xffffu), bf16); }
inline float hi(uint32_t r, bool bf16) { return b16_to_float(uint16_t(r >> 16), bf16); }

inline void check_full_warp(Group& w, const char* what, int line) {
  if (w.size != 32) report("%s at line %ld in a partial warp of %ld threads (needs all 32 lanes)", what, line, w.size);
}

template <typename T>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4], int line) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "mma_m16n8k16: T is __half or bf16");
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  Group& w = my_warp();
  check_full_warp(w, "mma.sync", line);
  const int lane = lane_id();
  auto& x = g_exchange[t_rank][t_tid / 32].regs[t_collective++ & 1];
  for (int i = 0; i < 4; ++i) x[lane][i] = a[i];
  x[lane][4] = b[0];
  x[lane][5] = b[1];
  group_sync(w, line, 0xffffffffu);
  const int g = lane / 4, t = lane % 4;
  // Row g (h = 0) and row g + 8 (h = 1) of A: lane 4g + u holds columns 2u, 2u+1 (regs 0 / 1) and 2u+8, 2u+9 (2 / 3).
  // Columns 2t (j = 0) and 2t + 1 (j = 1) of B: lane 4n + u holds rows 2u, 2u+1 (reg 4) and 2u+8, 2u+9 (reg 5).
  float A[2][16], B[2][16];
  for (int u = 0; u < 4; ++u) {
    for (int h = 0; h < 2; ++h) {
      const uint32_t* q = x[4 * g + u];
      A[h][2 * u] = lo(q[h], bf16);
      A[h][2 * u + 1] = hi(q[h], bf16);
      A[h][2 * u + 8] = lo(q[2 + h], bf16);
      A[h][2 * u + 9] = hi(q[2 + h], bf16);
    }
    for (int j = 0; j < 2; ++j) {
      const uint32_t* q = x[4 * (2 * t + j) + u];
      B[j][2 * u] = lo(q[4], bf16);
      B[j][2 * u + 1] = hi(q[4], bf16);
      B[j][2 * u + 8] = lo(q[5], bf16);
      B[j][2 * u + 9] = hi(q[5], bf16);
    }
  }
  float out[4];
  for (int e = 0; e < 4; ++e) {  // d[e] = D[g + 8 * (e / 2)][2t + e % 2]
    float s = c[e];
    for (int k = 0; k < 16; ++k) s += A[e / 2][k] * B[e % 2][k];
    out[e] = s;
  }
  for (int e = 0; e < 4; ++e) d[e] = out[e];  // after reading c: d and c may be the same registers
}

template <int N, bool Trans>
void ldmatrix(uint32_t (&r)[N], const void* p, int line) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix: x1, x2 or x4");
  Group& w = my_warp();
  check_full_warp(w, "ldmatrix", line);
  const int lane = lane_id();
  auto& rows = g_exchange[t_rank][t_tid / 32].rows[t_collective++ & 1];
  rows[lane] = p;
  if (lane < 8 * N && reinterpret_cast<uintptr_t>(p) % 16)
    report("ldmatrix%s: lane %ld gives a row address %ld bytes past a 16-byte boundary", Trans ? ".trans" : "", lane,
           long(reinterpret_cast<uintptr_t>(p) % 16));
  group_sync(w, line, 0xffffffffu);
  auto elem = [&](int m, int row, int col) {  // element [row][col] of matrix m, from the row address of lane 8m + row
    return uint32_t(*reinterpret_cast<const u16_any*>(static_cast<const unsigned char*>(rows[8 * m + row]) + 2 * col));
  };
  const int g = lane / 4, t = lane % 4;
  for (int m = 0; m < N; ++m)
    r[m] = Trans ? elem(m, 2 * t, g) | elem(m, 2 * t + 1, g) << 16 : elem(m, g, 2 * t) | elem(m, g, 2 * t + 1) << 16;
}

// ---------------------------------------------------------------- cp.async
struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;
};
struct AsyncState {
  std::vector<AsyncCopy> open;                // issued, not yet committed
  std::deque<std::vector<AsyncCopy>> groups;  // committed, oldest first
  uint3 block{};                              // the block that issued them
  size_t pending() const {
    size_t n = open.size();
    for (auto& g : groups) n += g.size();
    return n;
  }
  void drop_pending() {
    if (const size_t n = pending())
      report("cp.async: %s%ld copies still pending when block %ld ended (no wait_group covered them)", "", long(n),
             long(block.x + gridDim.x * (block.y + gridDim.y * block.z)));
    open.clear();
    groups.clear();
  }
  ~AsyncState() { drop_pending(); }  // the launch's threads end with the launch: the last block's leftovers
};
inline thread_local AsyncState t_async;

// Copies left by this thread's previous block are reported (and never land in the next block's shared memory).
inline AsyncState& async_state() {
  AsyncState& s = t_async;
  if (s.block.x != blockIdx.x || s.block.y != blockIdx.y || s.block.z != blockIdx.z) {
    s.drop_pending();
    s.block = blockIdx;
  }
  return s;
}

inline void store16(void* dst, uint64_t lo, uint64_t hi) {
  u64_any* d = static_cast<u64_any*>(dst);
  d[0] = lo;
  d[1] = hi;
}
inline void land(const AsyncCopy& c) {
  unsigned char v[16] = {};
  for (int i = 0; i < c.bytes; ++i) v[i] = static_cast<const unsigned char*>(c.src)[i];
  uint64_t lo, hi;
  std::memcpy(&lo, v, 8);
  std::memcpy(&hi, v + 8, 8);
  store16(c.dst, lo, hi);
}

inline void cp_async_16(void* dst, const void* src, int bytes) {
  AsyncState& s = async_state();
  if (bytes < 0 || bytes > 16) {
    report("cp.async: %ssrc_bytes %ld outside [0, 16]", "", bytes);
    bytes = bytes < 0 ? 0 : 16;
  }
  if (reinterpret_cast<uintptr_t>(dst) % 16)
    report("cp.async: shared destination %s%ld bytes past a 16-byte boundary", "", long(reinterpret_cast<uintptr_t>(dst) % 16));
  if (bytes > 0 && reinterpret_cast<uintptr_t>(src) % 16)
    report("cp.async: global source %s%ld bytes past a 16-byte boundary", "", long(reinterpret_cast<uintptr_t>(src) % 16));
  if (bytes > 0) on_global_read(src, size_t(bytes));
  // In flight, the destination is undefined: poison from the issue on. A reader racing with the copy then sees poison
  // (and TSan sees this write), even where the late landing alone would have left the old, still plausible, data.
  const uint64_t poison = 0x0101010101010101ull * uint8_t(g_poison);
  store16(dst, poison, poison);
  s.open.push_back({dst, src, bytes});
}
inline void cp_async_commit() {
  AsyncState& s = async_state();
  s.groups.push_back(std::move(s.open));  // an empty group is a group too (it counts for wait_group)
  s.open.clear();
}
inline void cp_async_wait(int n) {
  AsyncState& s = async_state();
  while (s.groups.size() > size_t(n)) {
    for (auto& c : s.groups.front()) land(c);
    s.groups.pop_front();
  }
}
inline void cp_async_wait_all() {  // = commit_group; wait_group 0
  cp_async_commit();
  cp_async_wait(0);
}

}  // namespace mma
}  // namespace simt
