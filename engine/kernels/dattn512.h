// AVX-512 inner loops of aotlm_dattn (included by dattn.h inside namespace aotlm_da, before run). Compiled
// only into the avx512 levels' builds (aotlm.kernels.isa); the AVX2 build keeps bdot.h's dots.
//
// One (row, kv head) job has G query heads over the same keys and values. bdot.h's dots take the G
// queries one after another, so every cache element is widened to f32 G times, 8 lanes at a time, and
// each key's score is one horizontal sum. Here each 16 cache elements are widened once and multiplied
// by all G queries (G <= 4: up to 16 sums in registers), and 4 keys' (or 4 value rows') sums are
// reduced together (sums4: 14 shuffles and adds for 4 results). A 16-row SmolLM2-135M step's attention
// (G = 3, bf16 cache, rows of 100-300 slots; harness of 30 layers' caches, cold): 305 -> 263 us per
// layer, 220 with dattn.h's prefetch of the values (the call was ~10 ms of a ~27 ms step).
#pragma once

#if defined(__AVX512BW__)
template <class W>
inline __m512 load16(const typename W::T* p, __mmask16 k) {  // 16 cache elements (lanes past k: 0) as f32
  if constexpr (std::is_same_v<W, F32>) {
    return _mm512_maskz_loadu_ps(k, p);
  } else if constexpr (std::is_same_v<W, BF16>) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
  }
}

// The lane sums of a, b, c, d -> out[0..3].
inline void sums4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a b a b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // per 128 bits: a b c d
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));  // + the neighbouring 128 bits
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));  // + the other half
  _mm_storeu_ps(out, _mm512_castps512_ps128(s));
}

// s[g * ld + j] = q[g] . k[j] for j < n (k: [n, Dh] rows, Dh % 16 == 0), q [G, Dh] f32.
template <class W, int G>
inline void qk(const float* q, const typename W::T* k, int64_t Dh, int64_t n, float* s, int64_t ld) {
  alignas(16) float t[4];
  for (int64_t j = 0; j < n; j += 4) {
    const int keys = int(std::min<int64_t>(4, n - j));
    __m512 acc[4][G];
    for (int r = 0; r < 4; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(k + (j + 8) * Dh), _MM_HINT_T0);
    for (int64_t c = 0; c < Dh; c += 16)
      for (int r = 0; r < keys; ++r) {
        const __m512 kv = load16<W>(k + (j + r) * Dh + c, __mmask16(0xffff));
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + g * Dh + c), acc[r][g]);
      }
    for (int g = 0; g < G; ++g) {
      sums4(acc[0][g], acc[1][g], acc[2][g], acc[3][g], t);
      for (int r = 0; r < keys; ++r) s[g * ld + j + r] = t[r];
    }
  }
}

// o[g * Dh + d] = sum_{j < n} p[g * ld + j] v[d, j] for d < Dh (v: [Dh, S] rows; Dh % 4 == 0).
template <class W, int G>
inline void pv(const float* p, int64_t ld, const typename W::T* v, int64_t S, int64_t Dh, int64_t n, float* o) {
  alignas(16) float t[4];
  const int64_t line = 64 / int64_t(sizeof(typename W::T));
  for (int64_t d = 0; d < Dh; d += 4) {
    if (d + 4 < Dh)  // the next four rows' slots
      for (int r = 4; r < 8; ++r)
        for (int64_t j = 0; j < n; j += line)
          _mm_prefetch(reinterpret_cast<const char*>(v + (d + r) * S + j), _MM_HINT_T0);
    __m512 acc[4][G];
    for (int r = 0; r < 4; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      __m512 pg[G];
      for (int g = 0; g < G; ++g) pg[g] = _mm512_maskz_loadu_ps(k, p + g * ld + j);
      for (int r = 0; r < 4; ++r) {
        const __m512 vv = load16<W>(v + (d + r) * S + j, k);
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(vv, pg[g], acc[r][g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      sums4(acc[0][g], acc[1][g], acc[2][g], acc[3][g], t);
      std::memcpy(o + g * Dh + d, t, sizeof t);
    }
  }
}

// The G-query loops where they apply (G <= 4, Dh % 16 == 0): false leaves the job to bdot.h's dots.
template <class W>
inline bool qk_g(const float* q, int64_t G, const typename W::T* k, int64_t Dh, int64_t n, float* s, int64_t ld) {
  if (Dh % 16) return false;
  switch (G) {
    case 1: qk<W, 1>(q, k, Dh, n, s, ld); return true;
    case 2: qk<W, 2>(q, k, Dh, n, s, ld); return true;
    case 3: qk<W, 3>(q, k, Dh, n, s, ld); return true;
    case 4: qk<W, 4>(q, k, Dh, n, s, ld); return true;
    default: return false;
  }
}

template <class W>
inline bool pv_g(const float* p, int64_t G, int64_t ld, const typename W::T* v, int64_t S, int64_t Dh, int64_t n,
                 float* o) {
  if (Dh % 16) return false;
  switch (G) {
    case 1: pv<W, 1>(p, ld, v, S, Dh, n, o); return true;
    case 2: pv<W, 2>(p, ld, v, S, Dh, n, o); return true;
    case 3: pv<W, 3>(p, ld, v, S, Dh, n, o); return true;
    case 4: pv<W, 4>(p, ld, v, S, Dh, n, o); return true;
    default: return false;
  }
}
#else  // the avx2 build: bdot.h's dots take every job
template <class W>
inline bool qk_g(const float*, int64_t, const typename W::T*, int64_t, int64_t, float*, int64_t) {
  return false;
}
template <class W>
inline bool pv_g(const float*, int64_t, int64_t, const typename W::T*, int64_t, int64_t, int64_t, float*) {
  return false;
}
#endif
