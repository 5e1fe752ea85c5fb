// window_attention's CPU kernel body, included twice by window_attention_cpu.cpp: once for the baseline ISA
// (kLanes = 4: SSE2 on x86-64, NEON on arm64) and once under `#pragma GCC target("avx2")` (kLanes = 8), picked at run
// time. Both do the same IEEE operations in the same order (element-wise mul, then add: AVX2 without FMA), so their
// outputs are bit-identical; the width only sets how many keys or dims advance side by side. No include guard: each
// inclusion defines its own copy inside the namespace that includes it.
//
// Parallel over (chunk of up to kRowChunk query rows of one sequence, KV head): a task computes every query head of
// one GQA group for its rows. Scores of the visible keys go to a scratch buffer [heads, n] (fp32), then an exact
// two-pass softmax (max, then sum of exp) and the weighted sum of V rows, all in fp32 whatever the input dtype; each
// K/V row is read and converted (fp8: stored * scale) once per task and serves group x rows query heads.

// kLanes fp32 lanes (GCC / Clang vector extension: one SIMD register): element-wise IEEE mul and add, the arithmetic
// of the scalar code, whatever the width.
typedef float FV __attribute__((vector_size(kLanes * sizeof(float))));
typedef float FVu __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));  // from any float*
constexpr int64_t kKeyTile = 4 * kLanes;  // keys scored side by side: 4 FV of independent running sums
struct KeyLanes {
  FV v[4];
  float& operator[](int64_t u) { return v[u / kLanes][u % kLanes]; }
};

// One thread's scratch, reused by its tasks. Head h = r * group + g (row r of the chunk, query head g of the group);
// scores [h][n] over the chunk's key range [lo, lo + n).
struct CpuAttnScratch {
  std::vector<float> q, acc, scores, vbuf, inv;
  std::vector<KeyLanes> kt;  // [d]: a tile's keys transposed, lane u = key j0 + u
  std::vector<int64_t> lo, hi;  // [rows of the chunk]: each row's visible keys (empty when hi < lo)
};

// scores[h][j - lo] = scale * q_h . k_j (softcapped) for every key j visible to head h's row. Each score is one running
// sum over the head dim in order x = 0, 1, ..., d - 1, the arithmetic of a plain dot product, so a score does not
// depend on the tiling or on the other rows; a tile holds kKeyTile keys transposed ([x][key]) so that their sums
// advance side by side, and one tile serves every row of the chunk.
template <typename scalar_t, typename cache_t>
void score_keys(const CpuAttn<scalar_t, cache_t>& a, int64_t b, int64_t kvh, int64_t rows, int64_t lo, int64_t n,
                CpuAttnScratch& s) {
  const int64_t d = a.d;
  for (int64_t j0 = lo; j0 < lo + n; j0 += kKeyTile) {
    const int64_t m = std::min<int64_t>(kKeyTile, lo + n - j0);
    for (int64_t u = 0; u < kKeyTile; ++u) {
      const cache_t* kp = u < m ? a.k_row(b, j0 + u, kvh) : nullptr;
      for (int64_t x = 0; x < d; ++x) s.kt[x][u] = kp ? cache_to_float(kp[x], a.k_scale) : 0.f;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t first = std::max(j0, s.lo[r]), last = std::min(j0 + m - 1, s.hi[r]);
      if (first > last) continue;
      for (int64_t g = 0; g < a.group; ++g) {
        const int64_t h = r * a.group + g;
        FV a0 = {}, a1 = {}, a2 = {}, a3 = {};
        const float* qh = s.q.data() + h * d;
        for (int64_t x = 0; x < d; ++x) {
          const FV* kx = s.kt[x].v;
          a0 += qh[x] * kx[0];
          a1 += qh[x] * kx[1];
          a2 += qh[x] * kx[2];
          a3 += qh[x] * kx[3];
        }
        const KeyLanes acc{{a0, a1, a2, a3}};
        for (int64_t j = first; j <= last; ++j) {
          float v = acc.v[(j - j0) / kLanes][(j - j0) % kLanes] * a.scale;
          if (a.softcap > 0.f) v = a.softcap * std::tanh(v / a.softcap);
          s.scores[h * n + (j - lo)] = v;
        }
      }
    }
  }
}

// Exact two-pass softmax of each head's visible scores, in place (scores become exp(s - m)); writes lse and keeps
// 1 / sum for the output. The sink is one more logit in the max and the sum, with no value row.
template <typename scalar_t, typename cache_t>
void softmax_heads(const CpuAttn<scalar_t, cache_t>& a, int64_t r0, int64_t kvh, int64_t rows, int64_t lo, int64_t n,
                   CpuAttnScratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    if (s.hi[r] < s.lo[r]) continue;
    for (int64_t g = 0; g < a.group; ++g) {
      const int64_t h = r * a.group + g, qh = kvh * a.group + g;
      float* sc = s.scores.data() + h * n;  // sc[j - lo] for the row's keys j
      const float sink = a.sinks ? a.sinks[qh] : kNegInf;
      float m = sink;
      for (int64_t j = s.lo[r] - lo; j <= s.hi[r] - lo; ++j) m = std::max(m, sc[j]);
      float l = a.sinks ? std::exp(sink - m) : 0.f;  // 0 for a -inf sink (m is finite: the row has keys)
      for (int64_t j = s.lo[r] - lo; j <= s.hi[r] - lo; ++j) {
        const float p = std::exp(sc[j] - m);
        sc[j] = p;
        l += p;
      }
      s.inv[h] = 1.f / l;  // l >= 1: the max term contributes exp(0)
      a.lse[(r0 + r) * a.hq + qh] = m + std::log(l);
    }
  }
}

// acc[h] = sum_j p_h(j) v_j over head h's visible keys, each element summed in key order. The chunk's V rows are
// converted once into vbuf [n][d] (fp32), then each head runs down its keys 4 x kLanes dims at a time in registers
// (then one FV at a time, then single dims).
template <typename scalar_t, typename cache_t>
void weigh_values(const CpuAttn<scalar_t, cache_t>& a, int64_t b, int64_t kvh, int64_t rows, int64_t lo, int64_t n,
                  CpuAttnScratch& s) {
  const int64_t d = a.d, d4 = d / (4 * kLanes) * (4 * kLanes), d1 = d / kLanes * kLanes;
  s.vbuf.resize(n * d);
  for (int64_t j = 0; j < n; ++j) {
    const cache_t* vp = a.v_row(b, lo + j, kvh);
    for (int64_t x = 0; x < d; ++x) s.vbuf[j * d + x] = cache_to_float(vp[x], a.v_scale);
  }
  const float* vrow = s.vbuf.data();  // vrow + k * d: the V row of key lo + k
  for (int64_t r = 0; r < rows; ++r) {
    if (s.hi[r] < s.lo[r]) continue;
    const int64_t k0 = s.lo[r] - lo, k1 = s.hi[r] - lo;  // the row's keys, as indices into [lo, lo + n)
    for (int64_t g = 0; g < a.group; ++g) {
      const int64_t h = r * a.group + g;
      const float* p = s.scores.data() + h * n;
      float* acc = s.acc.data() + h * d;
      for (int64_t x = 0; x < d4; x += 4 * kLanes) {
        FV a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t k = k0; k <= k1; ++k) {
          const FVu* v = reinterpret_cast<const FVu*>(vrow + k * d + x);
          a0 += p[k] * v[0];
          a1 += p[k] * v[1];
          a2 += p[k] * v[2];
          a3 += p[k] * v[3];
        }
        FVu* out = reinterpret_cast<FVu*>(acc + x);
        out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
      }
      for (int64_t x = d4; x < d1; x += kLanes) {
        FV a0 = {};
        for (int64_t k = k0; k <= k1; ++k) a0 += p[k] * *reinterpret_cast<const FVu*>(vrow + k * d + x);
        *reinterpret_cast<FVu*>(acc + x) = a0;
      }
      for (int64_t x = d1; x < d; ++x) {
        float t = 0.f;
        for (int64_t k = k0; k <= k1; ++k) t += p[k] * vrow[k * d + x];
        acc[x] = t;
      }
    }
  }
}

// One task: the rows of chunk c against KV head kvh. Rows without a visible key get zeros and lse = the sink's
// logit (-inf without sinks), never NaN.
template <typename scalar_t, typename cache_t>
void attend_chunk(const CpuAttn<scalar_t, cache_t>& a, const RowChunk& c, int64_t kvh, CpuAttnScratch& s) {
  const int64_t rows = c.r1 - c.r0, heads = rows * a.group, d = a.d;
  const int64_t len = a.lens[c.b], start = a.starts ? a.starts[c.b] : 0;
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  s.lo.resize(rows);
  s.hi.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = a.row_pos[c.r0 + r];
    s.lo[r] = window_attention_first_key<int64_t>(i, start, a.window, a.chunk_size);
    // i < seq_len always; keys past the block table's capacity are masked (the rule of every kernel, see
    // window_attention.h), the query keeps its position
    s.hi[r] = std::min<int64_t>({i, len - 1, a.max_blocks * a.block_size - 1});
    if (s.hi[r] >= s.lo[r]) lo = std::min(lo, s.lo[r]), hi = std::max(hi, s.hi[r]);
  }
  const int64_t n = hi >= lo ? hi - lo + 1 : 0;
  s.q.resize(heads * d);
  s.acc.assign(heads * d, 0.f);
  s.inv.resize(heads);
  s.scores.resize(heads * n);
  s.kt.resize(d);
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* src = a.q + (c.r0 + h / a.group) * a.qs0 + (kvh * a.group + h % a.group) * a.qs1;
    for (int64_t x = 0; x < d; ++x) s.q[h * d + x] = static_cast<float>(src[x]);
  }
  if (n > 0) {
    score_keys(a, c.b, kvh, rows, lo, n, s);
    softmax_heads(a, c.r0, kvh, rows, lo, n, s);
    weigh_values(a, c.b, kvh, rows, lo, n, s);
  }
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t r = h / a.group, qh = kvh * a.group + h % a.group;
    scalar_t* dst = a.out + ((c.r0 + r) * a.hq + qh) * d;
    const bool empty = s.hi[r] < s.lo[r];
    for (int64_t x = 0; x < d; ++x) dst[x] = empty ? scalar_t(0) : static_cast<scalar_t>(s.acc[h * d + x] * s.inv[h]);
    if (empty) a.lse[(c.r0 + r) * a.hq + qh] = a.sinks ? a.sinks[qh] : -std::numeric_limits<float>::infinity();
  }
}

// Parallel over (chunk of up to kRowChunk query rows of one sequence, KV head): a task computes every query head of
// one GQA group for its rows, so each K/V row it reads and converts serves group x rows query heads.
template <typename scalar_t, typename cache_t>
void window_attention_cpu_kernel(const CpuAttn<scalar_t, cache_t>& a, const std::vector<RowChunk>& chunks) {
  const int64_t tasks = static_cast<int64_t>(chunks.size()) * a.hkv;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    CpuAttnScratch s;
    for (int64_t t = begin; t < end; ++t) attend_chunk(a, chunks[t / a.hkv], t % a.hkv, s);
  });
}

