// Batched attention dots for decode (included by wmatmul.cc after the element types).
//
//   aotlm_bdot:  c[i, m, n] = sum_{l < L'} a[i, m, l] * b[i, n, l]   for n < N', else 0 (f32 out)
//   a [I, M, L]  (queries, or softmax weights), b [IB >= I, NB, LB] with NB >= N, LB >= L (only
//   the first I blocks are read: a decode call over a serving batch's first rows),
//   lim int32 [2] or [I, 2]: N' = min(N, lim[0]), L' = min(L, lim[1]) -- the cache slots written so
//   far (traced; one pair for every i, or one per i: each serving row its own), so a decode step
//   reads the slots its row can see, not the whole bucket nor the longest row's slots: the scores
//   of later slots are masked and their softmax weights are exactly 0.
//
// Why: XLA:CPU ran decode attention's two einsums (one [G*T, Dh] x [Dh, W] product per batch
// row and kv head) at ~2 GFLOP/s -- 0.8 ms per dot at batch 8, 40% of a decode step -- and
// copied the cache slice [:W] first when W < S. Here b is the whole cache ([B*K, S, Dh] keys
// or [B*K, Dh, S] values): only its first N rows and L columns are read, so nothing is copied.
#pragma once

namespace aotlm_bd {

// rows [n0, n1) of b for every row of a (already f32) in batch item i.
template <class W, int NR>
inline void rows(const float* a, int64_t M, int64_t L, int64_t l_lim, const typename W::T* b, int64_t LB, int64_t n,
                 float* c, int64_t N) {
  const int64_t le = std::max<int64_t>(0, std::min(L, l_lim)), lv = le / 8 * 8;
  for (int64_t m = 0; m < M; ++m) {
    const float* am = a + m * L;
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t l = 0; l < lv; l += 8) {
      const __m256 av = _mm256_loadu_ps(am + l);
      for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(av, W::load8(b + (n + r) * LB + l), acc[r]);
    }
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[r]);
      for (int64_t l = lv; l < le; ++l) s += am[l] * W::one(b + (n + r) * LB + l);
      c[m * N + n + r] = s;
    }
  }
}

// One long row n of b (a value row: one head dim over the slots) for every row of a: read once,
// in order, with four sums over l (the FMA latency). Four value rows at a time (1 KB apart)
// streamed 14-15 GB/s at batch 8 in a harness where a plain read of those rows gets 21-23; one
// at a time 19-22 (keys, 64-element rows: 19-20 -> 20-22).
template <class W>
inline void long_row(const float* a, int64_t M, int64_t L, int64_t l_lim, const typename W::T* b, int64_t LB,
                     int64_t n, float* c, int64_t N) {
  const int64_t le = std::max<int64_t>(0, std::min(L, l_lim)), l32 = le / 32 * 32, lv = le / 8 * 8;
  const typename W::T* bn = b + n * LB;
  for (int64_t m = 0; m < M; ++m) {
    const float* am = a + m * L;
    __m256 acc[4];
    for (int u = 0; u < 4; ++u) acc[u] = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l < l32; l += 32)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(am + l + 8 * u), W::load8(bn + l + 8 * u), acc[u]);
    for (; l < lv; l += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(am + l), W::load8(bn + l), acc[0]);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; l < le; ++l) s += am[l] * W::one(bn + l);
    c[m * N + n] = s;
  }
}

// Sums of 8 vectors -> [hsum(v[0]), ..., hsum(v[7])]: 6 hadds, 2 lane permutes and an add for 8 sums.
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // [0123 | 0123]
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // [4567 | 4567]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Eight short rows n..n+7 of b (keys: one slot each, contiguous) for every row of a: eight sums
// per row of a reduced at once (hsum8) instead of one horizontal sum per slot. Keys of a batch-8
// GPT-2-small step (64 dims; harness, 12 layers x 96 heads x 192 slots) on long_row before: 13.1
// GB/s f32, 9.5 bf16; here, with the prefetch and 256 rows per job: 16.0 / 15.6.
template <class W>
inline void rows8(const float* a, int64_t M, int64_t L, int64_t l_lim, const typename W::T* b, int64_t LB, int64_t n,
                  float* c, int64_t N) {
  const int64_t le = std::max<int64_t>(0, std::min(L, l_lim)), lv = le / 8 * 8;
  const typename W::T* bn = b + n * LB;
  const char* next = reinterpret_cast<const char*>(bn + 16 * LB);  // eight rows, a block ahead (contiguous)
  for (int64_t o = 0; o < int64_t(8 * LB * sizeof(typename W::T)); o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
  for (int64_t m = 0; m < M; ++m) {
    const float* am = a + m * L;
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int r = 0; r < 8; ++r)  // the eight rows in memory order (their sums are independent chains)
      for (int64_t l = 0; l < lv; l += 8)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(am + l), W::load8(bn + r * LB + l), acc[r]);
    alignas(32) float t[8];
    _mm256_store_ps(t, hsum8(acc));
    for (int r = 0; r < 8; ++r)
      for (int64_t l = lv; l < le; ++l) t[r] += am[l] * W::one(bn + r * LB + l);
    std::memcpy(c + m * N + n, t, sizeof t);
  }
}

// Eight long rows n..n+7 of b (values: eight head dims over the slots) for every row of a: the eight
// sums are independent chains (l outer, rows inner), reduced at once (hsum8), and the next eight rows'
// first le slots are prefetched. long_row (one row at a time; rows LB apart, each a short stream)
// read a 16-row SmolLM2-135M step's values at ~6 GB/s, 0.40 ms of 1.2 per layer.
template <class W>
inline void long_rows8(const float* a, int64_t M, int64_t L, int64_t l_lim, const typename W::T* b, int64_t LB,
                       int64_t n, int64_t n_end, float* c, int64_t N) {
  const int64_t le = std::max<int64_t>(0, std::min(L, l_lim)), lv = le / 8 * 8;
  const typename W::T* bn = b + n * LB;
  const int64_t bytes = le * int64_t(sizeof(typename W::T));
  for (int64_t r = 8; r < 16 && n + r < n_end; ++r)
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(bn + r * LB) + o, _MM_HINT_T0);
  for (int64_t m = 0; m < M; ++m) {
    const float* am = a + m * L;
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t l = 0; l < lv; l += 8) {
      const __m256 av = _mm256_loadu_ps(am + l);
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(av, W::load8(bn + r * LB + l), acc[r]);
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, hsum8(acc));
    for (int r = 0; r < 8; ++r)
      for (int64_t l = lv; l < le; ++l) t[r] += am[l] * W::one(bn + r * LB + l);
    std::memcpy(c + m * N + n, t, sizeof t);
  }
}

// c[m, n] (row stride N) for rows n in [n0, ne) of b (one batch item), each taken by the loop its
// row length suits.
template <class W>
inline void dots(const float* ai, int64_t M, int64_t L, int64_t l_lim, const typename W::T* bi, int64_t LB,
                 int64_t n0, int64_t ne, float* ci, int64_t N) {
  int64_t n = n0;
  const int64_t le = std::min(L, l_lim);
  if (le <= 128)  // short rows (keys): eight at a time
    for (; n + 8 <= ne; n += 8) rows8<W>(ai, M, L, l_lim, bi, LB, n, ci, N);
  if (le > 128)  // long rows (values: one head dim over the slots): eight at a time
    for (; n + 8 <= ne; n += 8) long_rows8<W>(ai, M, L, l_lim, bi, LB, n, ne, ci, N);
  if (le >= 32)  // rows of >= 32 elements: one at a time, in order
    for (; n < ne; ++n) long_row<W>(ai, M, L, l_lim, bi, LB, n, ci, N);
  for (; n + 4 <= ne; n += 4) rows<W, 4>(ai, M, L, l_lim, bi, LB, n, ci, N);
  for (; n < ne; ++n) rows<W, 1>(ai, M, L, l_lim, bi, LB, n, ci, N);
}

template <class W>
void run(const float* a, const void* braw, float* c, int64_t I, int64_t M, int64_t L, int64_t NB, int64_t LB,
         int64_t N, const int32_t* lim, int64_t lim_stride) {
  const typename W::T* b = static_cast<const typename W::T*>(braw);
  constexpr int64_t CH = 256;  // rows of b per job
  const int64_t per = (N + CH - 1) / CH;
  aotlm::parallel_for(int(I * per), [&](int job) {
    const int64_t i = job / per, n0 = job % per * CH, n1 = std::min(N, n0 + CH);
    const int64_t n_lim = lim[i * lim_stride], l_lim = lim[i * lim_stride + 1];
    float* ci = c + i * M * N;
    const int64_t ne = std::max(n0, std::min(n1, n_lim));
    dots<W>(a + i * M * L, M, L, l_lim, b + i * NB * LB, LB, n0, ne, ci, N);
    for (int64_t m = 0; m < M; ++m) std::fill(ci + m * N + ne, ci + m * N + n1, 0.f);
  });
}

}  // namespace aotlm_bd
