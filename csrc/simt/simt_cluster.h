// simt_cluster.h -- thread-block clusters (sm_90) in the SIMT emulator; included by simt.h, never on its own.
//
// A launch with a cluster dimension (launch_cluster: csrc/cluster.cuh's path) runs the blocks of one cluster
// concurrently -- each its own threads, block and warp groups, poisoned dynamic shared memory and blockIdx -- and the
// clusters one after another (in the seeded block order, over clusters). What a kernel may use:
// - cluster_ctarank / cluster_nctarank (%cluster_ctarank, %cluster_nctarank);
// - cluster_sync (barrier.cluster.arrive.release + barrier.cluster.wait.acquire): every thread of every block of the
//   cluster; its threads met at different source lines is reported; a thread that exited no longer takes part. With
//   relaxed arrivals only (cluster_sync_relaxed) the barrier publishes nothing: DSMEM loads after it are compared with
//   the snapshot of the last barrier a release arrived at. It still orders an access before a later exit (the
//   accessing thread consumed the value before arriving);
// - ld_dsmem / st_dsmem (mapa.shared::cluster + ld / st.shared::cluster): an address in the caller's dynamic shared
//   memory, mapped to the same offset in block `rank`'s.
// Reported (emulator reports, the run continues):
// - a rank outside the cluster, or an address outside the caller's dynamic shared memory (not mapped);
// - an access to a block that has exited, and a block that exits while another may still access its shared memory
//   (the access not ordered before the exit by a cluster barrier: the accessor had arrived at the cluster barrier k
//   times, the exiting block had passed at most k waits). Both are decided from barrier counts, not timing;
// - a DSMEM load of another block's bytes that changed since the last cluster barrier the loading thread passed
//   (written with no cluster barrier between the store and the load: a race), found by comparing the bytes with a
//   snapshot of every block's dynamic shared memory taken when each cluster barrier completes (the launch's poison
//   before the first). A store no barrier ordered that lands after the load shows as poison or stale data instead,
//   and, being a real race between the emulator's threads, to ThreadSanitizer;
// - a launch refused as a GPU refuses it: a cluster of more than 8 blocks without the kernel's
//   cudaFuncAttributeNonPortableClusterSizeAllowed, more than 16, a grid not divisible by the cluster, a device below
//   sm_90; and a static __shared__ array (AK_SHARED) in a cluster of more than one block (one host array would be
//   shared by the concurrent blocks: not modelled).
// Not modelled: which SMs and GPCs the blocks land on (cudaOccupancyMaxActiveClusters), the split arrive / wait form,
// global-memory visibility between the blocks of one cluster (they run at once: a store is seen when it is made),
// DSMEM atomics, and distributed shared memory of static __shared__ arrays.
#pragma once

namespace simt {

inline thread_local int t_cl_arrived = 0;  // cluster barriers this thread arrived at in the current cluster
inline thread_local int t_cl_waited = 0;   // cluster barriers it passed (waited on)

// A barrier of every thread of the cluster; phase k completes when every thread still running arrived for the k-th
// time; its completion takes the snapshot of every block's shared memory that DSMEM loads are compared against.
struct ClusterBarrier {
  std::mutex mu;
  std::condition_variable cv;
  long expected, count, phase = 0;
  bool released = false;  // some thread arrived with a release in the running phase
  std::vector<int> line;  // [thread of the cluster] the source line of its arrival in the running phase (-1: none)
  std::function<void()> on_complete;
  explicit ClusterBarrier(long n) : expected(n), count(n), line(size_t(n), -1) {}
  void complete() {
    int first = -1;
    for (int& l : line) {
      if (l >= 0 && first < 0) first = l;
      if (l >= 0 && l != first)
        report("cluster barrier: threads of one cluster met at different source lines (%s%ld vs %ld)", "", first, l);
      l = -1;
    }
    if (on_complete) on_complete();
    released = false;
    count = expected;
    ++phase;
    cv.notify_all();
  }
  void arrive_and_wait(int gtid, int at, bool release) {
    std::unique_lock<std::mutex> l(mu);
    line[gtid] = at;
    released = released || release;
    const long p = phase;
    if (--count == 0)
      complete();
    else
      cv.wait(l, [&] { return phase != p; });
  }
  void drop() {  // an exited thread (the last one completes nothing: nobody waits, and no snapshot is needed)
    std::unique_lock<std::mutex> l(mu);
    --expected;
    if (--count == 0 && expected > 0) complete();
  }
};

struct ClusterState {
  int size = 1;  // blocks
  dim3 dims{1, 1, 1};
  int threads = 0;      // per block
  size_t smem = 0;      // dynamic shared-memory bytes per block
  std::vector<unsigned char*> dyn;  // [rank] each block's dynamic shared memory
  std::unique_ptr<ClusterBarrier> bar;
  std::vector<std::vector<std::vector<unsigned char>>> snaps;  // [phase - 1][rank] at each barrier's completion
  std::unique_ptr<std::atomic<int>[]> exited_threads, min_waited;  // [rank]
  std::unique_ptr<std::atomic<bool>[]> exited, exit_reported;       // [rank]
  std::unique_ptr<std::atomic<int>[]> latest_access;  // [rank] the highest arrival count of an access to it (-1: none)
  std::vector<long> block_ids;                         // [rank] linear block ids (reports)
  std::atomic<uint64_t> dsmem_read{0}, dsmem_written{0};  // bytes moved through DSMEM, the whole launch
};
inline ClusterState g_cl;

// A new cluster (the launch's own thread, before its blocks start).
inline void cluster_begin(const std::vector<long>& ids) {
  const int n = g_cl.size;
  g_cl.bar = std::make_unique<ClusterBarrier>(long(n) * g_cl.threads);
  g_cl.snaps.clear();
  g_cl.bar->on_complete = [] {  // every running thread has arrived: shared memory is what the phase left
    std::vector<std::vector<unsigned char>> s(size_t(g_cl.size));
    if (!g_cl.bar->released) {  // relaxed arrivals only: what the last release published, or the launch's poison
      for (int r = 0; r < g_cl.size; ++r)
        s[r] = g_cl.snaps.empty() ? std::vector<unsigned char>(g_cl.smem, (unsigned char)(g_poison))
                                  : g_cl.snaps.back()[r];
    } else {
      for (int r = 0; r < g_cl.size; ++r) s[r].assign(g_cl.dyn[r], g_cl.dyn[r] + g_cl.smem);
    }
    g_cl.snaps.push_back(std::move(s));
  };
  g_cl.exited_threads.reset(new std::atomic<int>[n]);
  g_cl.min_waited.reset(new std::atomic<int>[n]);
  g_cl.exited.reset(new std::atomic<bool>[n]);
  g_cl.exit_reported.reset(new std::atomic<bool>[n]);
  g_cl.latest_access.reset(new std::atomic<int>[n]);
  for (int r = 0; r < n; ++r) {
    g_cl.exited_threads[r] = 0;
    g_cl.min_waited[r] = std::numeric_limits<int>::max();
    g_cl.exited[r] = false;
    g_cl.exit_reported[r] = false;
    g_cl.latest_access[r] = -1;
  }
  g_cl.block_ids = ids;
}

inline void cluster_thread_start() {
  t_cl_arrived = 0;
  t_cl_waited = 0;
}

// A thread of block t_rank left the kernel: the last one marks the block exited and checks that every access other
// blocks made to its shared memory was ordered before the exit by a cluster barrier; then it leaves the barrier.
inline void cluster_thread_exit() {
  const int r = t_rank;
  int cur = g_cl.min_waited[r].load();
  while (t_cl_waited < cur && !g_cl.min_waited[r].compare_exchange_weak(cur, t_cl_waited)) {
  }
  if (g_cl.exited_threads[r].fetch_add(1) + 1 == g_cl.threads) {
    g_cl.exited[r].store(true);  // seq_cst: an access either sees the flag or left its count for the check below
    const int waited = g_cl.min_waited[r].load(), latest = g_cl.latest_access[r].load();
    if (latest >= waited)
      report("cluster: block %s%ld exited after %ld cluster barrier(s) while another block may still access its shared "
             "memory (no cluster barrier between that access and the exit)", "", g_cl.block_ids[r], waited);
  }
  g_cl.bar->drop();
}

inline unsigned cluster_ctarank() { return unsigned(t_rank); }
inline unsigned cluster_nctarank() { return unsigned(g_cl.size); }
inline dim3 cluster_dim() { return g_cl.dims; }

inline void cluster_sync(int line, bool release) {
  ++t_cl_arrived;
  g_cl.bar->arrive_and_wait(t_gtid, line, release);
  ++t_cl_waited;
}

// The address in block `rank`'s shared memory that `p` (in the caller's dynamic shared memory) maps to, or null
// (reported) when it maps to nothing.
inline unsigned char* dsmem_map(const void* p, unsigned rank, size_t bytes, const char* what) {
  const auto* a = static_cast<const unsigned char*>(p);
  const unsigned char* base = g_cl.dyn[t_rank];
  if (rank >= unsigned(g_cl.size)) {
    report("cluster: a DSMEM %s of rank %ld in a cluster of %ld blocks", what, long(rank), long(g_cl.size));
    return nullptr;
  }
  if (a < base || a + bytes > base + g_cl.smem) {
    report("cluster: a DSMEM %s of an address outside the dynamic shared memory (offset %ld, %ld bytes)", what,
           long(a - base), long(g_cl.smem));
    return nullptr;
  }
  if (g_cl.exited[rank].load() && !g_cl.exit_reported[rank].exchange(true))  // once per block: the report log
    report("cluster: a DSMEM %s of block %ld, which has exited (thread %ld)", what, g_cl.block_ids[rank], t_tid);
  if (int(rank) != t_rank) {  // its own block's accesses need no barrier before its exit
    std::atomic<int>& latest = g_cl.latest_access[rank];
    int cur = latest.load();
    while (t_cl_arrived > cur && !latest.compare_exchange_weak(cur, t_cl_arrived)) {
    }
  }
  return g_cl.dyn[rank] + (a - base);
}

template <typename T>
T ld_dsmem(const T* p, unsigned rank) {
  T v;
  std::memset(&v, g_poison, sizeof(T));
  unsigned char* q = dsmem_map(p, rank, sizeof(T), "load");
  if (!q) return v;
  std::memcpy(&v, q, sizeof(T));
  g_cl.dsmem_read.fetch_add(sizeof(T), std::memory_order_relaxed);
  if (int(rank) != t_rank) {
    const size_t off = size_t(q - g_cl.dyn[rank]);
    bool same = true;
    if (t_cl_waited == 0) {
      for (size_t i = 0; i < sizeof(T); ++i) same = same && q[i] == (unsigned char)(g_poison);
    } else {
      same = std::memcmp(q, g_cl.snaps[t_cl_waited - 1][rank].data() + off, sizeof(T)) == 0;
    }
    if (!same)
      report("cluster: a DSMEM load of bytes block %s%ld wrote after the last cluster barrier the loading thread "
             "passed (%ld passed): no cluster barrier between the store and the load", "", g_cl.block_ids[rank],
             t_cl_waited);
  }
  return v;
}

template <typename T>
void st_dsmem(T* p, unsigned rank, const T& v) {
  unsigned char* q = dsmem_map(p, rank, sizeof(T), "store");
  if (!q) return;
  std::memcpy(q, &v, sizeof(T));
  g_cl.dsmem_written.fetch_add(sizeof(T), std::memory_order_relaxed);
}

}  // namespace simt
