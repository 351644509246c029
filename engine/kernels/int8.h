// int8-weight matmuls on integer dot products (included by wmatmul.cc).
//
// Why not convert W to f32 and FMA (the bf16/f16 path): that costs 3 ops per 8 weights
// (widen, int->float, FMA), which kept one-row decode compute-bound at ~10 GB/s of int8 on
// the 2-core EPYC, below the ~18 GB/s the memory delivers. Here the rows of x are rounded to
// int16 once per call (per-row scale max|x| / 32767: a relative error <= 1.5e-5 of the row's
// largest value, far below int8 weights' own 1/254) and multiplied with sign-extended W by
// vpmaddwd, which does 16 multiply-adds into 8 int32 lanes per op. int32 partial sums are
// flushed to f32 every KB_PAIRS pairs of rows of W (2 * 32767 * 127 * 128 < 2^31).
//
// Layouts: W [K, N] (dense weights) and W [N, K] (embedding rows for a tied lm_head).
// * [K, N], one row of x: the threads split K and each streams its rows of W front to back
//   (the longest sequential reads; a column split walks N-strided rows and reached ~60% of
//   the bandwidth), keeping the N partial sums in L1/L2; the parts are summed at the end.
// * [K, N], several rows: register tiles (MR rows x 16 columns), columns split over threads.
// * [N, K]: every output is a dot product along contiguous K; rows of W split over threads.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace aotlm_i8 {
// Software prefetch: one thread's demand loads alone kept too few lines in flight (a row of
// a 768-wide matrix is only 12 lines): prefetching the next pair of rows (the next tile's
// rows for [N, K]) took one-row GEMVs from ~10 to ~13-20 GB/s cold on the 2-core EPYC.
constexpr int64_t PF = 2;

constexpr int64_t KB_PAIRS = 128;  // pairs of K rows between int32 -> f32 flushes

// max |r[k]| for k < n, and whether every r[k] is finite; AVX-512: 2 x 16 lanes and a masked tail, else 8
// lanes at a time and the tail scalar (a max is exact: the same value either way).
inline float abs_max(const float* r, int64_t n, bool& finite) {
#if defined(__AVX512F__)  // two independent max chains
  const __m512 big = _mm512_set1_ps(3.4028235e38f);
  __m512 m0 = _mm512_setzero_ps(), m1 = m0;
  __mmask16 bad = 0;
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(r + k)), b = _mm512_abs_ps(_mm512_loadu_ps(r + k + 16));
    m0 = _mm512_max_ps(m0, a), m1 = _mm512_max_ps(m1, b);
    bad |= _mm512_cmp_ps_mask(a, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(b, big, _CMP_NLE_UQ);  // inf or NaN
  }
  for (; k < n; k += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(__mmask16((1u << std::min<int64_t>(16, n - k)) - 1), r + k));
    m0 = _mm512_max_ps(m0, a);
    bad |= _mm512_cmp_ps_mask(a, big, _CMP_NLE_UQ);
  }
  finite = bad == 0;
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
#else
  const int64_t nv = n / 8 * 8;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(3.4028235e38f);
  __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t k = 0; k < nv; k += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(r + k), absmask);
    vmax = _mm256_max_ps(vmax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // inf or NaN
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, vmax);
  float amax = 0.f;
  for (float v : t) amax = std::max(amax, v);
  finite = _mm256_movemask_ps(bad) == 0;
  for (int64_t k = nv; k < n; ++k) {
    amax = std::max(amax, std::fabs(r[k]));
    finite &= std::isfinite(r[k]);
  }
  return amax;
#endif
}

// q[k] = lrintf(r[k] * inv) for k < n (finite r, |r * inv| < 32767.5): vcvtps2dq rounds to nearest
// even as lrintf does in the default mode, so the 8-lane loop and the scalar tail give the same numbers.
inline void round_i16(const float* r, int64_t n, float inv, int16_t* q) {
  const __m256 vi = _mm256_set1_ps(inv);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), vi));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k + 8), vi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
  }
  for (; k < n; ++k) q[k] = int16_t(std::lrintf(r[k] * inv));
}

// 8 int32 lanes (each within int8) -> 8 int8 at q.
inline void store_i8(__m256i a, int8_t* q) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w, w));
}

// As round_i16 into int8 (|r * inv| < 127.5), returning sum_k q[k].
inline int32_t round_i8(const float* r, int64_t n, float inv, int8_t* q) {
  const __m256 vi = _mm256_set1_ps(inv);
  __m256i vs = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), vi));
    vs = _mm256_add_epi32(vs, a);
    store_i8(a, q + k);
  }
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), vs);
  int32_t sum = 0;
  for (int32_t v : t) sum += v;
  for (; k < n; ++k) sum += q[k] = int8_t(std::lrintf(r[k] * inv));
  return sum;
}

// One row r f32 [K] -> o int8 [K], returning s, as the graph's quantization (models/lowp.quantize_rows):
// s = max|r| / 127 (1 for an all-zero row), o = clip(round half to even(r / s), -127, 127), in the f32
// operations XLA:CPU compiles that to (its simplifier: s = max|r| * f32(1/127), r / s = r * (1 / s)), so
// W8A8 on f32 x (the GEMM's quant_x, the decode rows' a8) equals the graph's int8 x bit for bit (finite
// x; XLA's max keeps a NaN where this one drops it; tests/test_gemm.py holds it equal). 8 lanes at a time.
inline float round_row_s8(const float* r, int64_t K, int8_t* o) {
  bool finite = true;  // not needed here: a non-finite row's q and s follow from amax as in the graph
  const float amax = abs_max(r, K, finite);
  const float sc = amax > 0.f ? amax * (1.f / 127.f) : 1.f, inv = 1.f / sc;
  const __m256 d = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  int64_t k = 0;
#if defined(__AVX512F__)  // the same operations on 16 lanes, packed to int8 by one vpmovsdb
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(r + k), _mm512_set1_ps(inv)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
  }
#endif
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(r + k), d), _MM_FROUND_TO_NEAREST_INT |
                                                                               _MM_FROUND_NO_EXC);
    store_i8(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi)), o + k);
  }
  for (; k < K; ++k) o[k] = int8_t(std::min(std::max(std::nearbyint(r[k] * inv), -127.f), 127.f));
  return sc;
}

// x [M, K] f32 -> xq [M, Kp] int16 (zero padded), sx [M] (q * sx ~ x). Vectorized (abs_max, round_i16):
// a 16-row call with K = 1536 and 16 columns took 103 us on the scalar loops, 20 us on these.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* xq, float* sx) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    bool finite = true;
    const float amax = abs_max(r, K, finite);
    const float s = amax > 0.f && finite ? amax / 32767.f : 1.f, inv = 1.f / s;
    sx[m] = finite ? s : std::numeric_limits<float>::quiet_NaN();  // inf/NaN in: NaN out, as f32 gives
    int16_t* q = xq + m * Kp;
    if (finite)
      round_i16(r, K, inv, q);
    else
      std::fill(q, q + K, int16_t(0));
    std::fill(q + K, q + Kp, int16_t(0));
  }
}

// acc + vpmaddwd(a, b) (8 int32 lanes, each the sum of two int16 products): one vpdpwssd in the
// avx512vnni build (aotlm.kernels.isa), else vpmaddwd + vpaddd. Equal results: neither saturates, and
// |x| <= 32767, |w| <= 127 here.
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// (q[0], q[1]) broadcast to all 8 int32 lanes, as one load uop (a scalar load + vmovd +
// vpbroadcastd through a general register was 3 per row of x in the multi-row tile). The row
// of q is zero padded past K, so the pair at an odd K's last row is (x, 0).
inline __m256i pair_at(const int16_t* q) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(q)));
}

// Two rows of W (k, k+1; b may be zero) x 16 columns -> the vpmaddwd operands: lanes hold
// columns {0-3, 8-11} (lo) and {4-7, 12-15} (hi), each as a (row k, row k+1) int16 pair.
inline void pairs16(const int8_t* r0, const int8_t* r1, __m256i& lo, __m256i& hi) {
  __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0)));
  __m256i b = r1 ? _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1)))
                 : _mm256_setzero_si256();
  lo = _mm256_unpacklo_epi16(a, b);
  hi = _mm256_unpackhi_epi16(a, b);
}

// f32 += int32 lanes (lo, hi as from pairs16) for 16 consecutive columns at dst.
inline void flush16(__m256i lo, __m256i hi, float* dst) {
  __m256 l = _mm256_cvtepi32_ps(lo), h = _mm256_cvtepi32_ps(hi);
  _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), _mm256_permute2f128_ps(l, h, 0x20)));
  _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_loadu_ps(dst + 8), _mm256_permute2f128_ps(l, h, 0x31)));
}

// ----------------------------------------------------------------- W [K, N], one row of x
// part[n] += sum over k in [k0, k1) of xq[k] * W[k, n], streaming rows of W in order.
inline void kn_row_stream(const int16_t* xq, const int8_t* w, int64_t N, int64_t k0, int64_t k1, float* part,
                          int32_t* acc) {
  const int64_t nv = N / 16 * 16;
  for (int64_t kb = k0; kb < k1; kb += 2 * KB_PAIRS) {
    const int64_t ke = std::min(k1, kb + 2 * KB_PAIRS);
    std::memset(acc, 0, nv * sizeof(int32_t));
    for (int64_t k = kb; k < ke; k += 2) {
      const bool two = k + 1 < ke;
      const int8_t* r0 = w + k * N;
      const __m256i xb = pair_at(xq + k);
      for (int64_t n = 0; n < nv; n += 16) {
        if ((n & 63) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(r0 + PF * N + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r0 + (PF + 1) * N + n), _MM_HINT_T0);
        }
        __m256i lo, hi;
        pairs16(r0 + n, two ? r0 + N + n : nullptr, lo, hi);
        __m256i* o = reinterpret_cast<__m256i*>(acc + n);
        _mm256_storeu_si256(o, _mm256_add_epi32(_mm256_loadu_si256(o), _mm256_madd_epi16(lo, xb)));
        _mm256_storeu_si256(o + 1, _mm256_add_epi32(_mm256_loadu_si256(o + 1), _mm256_madd_epi16(hi, xb)));
      }
    }
    for (int64_t n = 0; n < nv; n += 16)
      flush16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + n)),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + n + 8)), part + n);
    for (int64_t n = nv; n < N; ++n) {  // column tail
      int64_t s = 0;
      for (int64_t k = kb; k < ke; ++k) s += int32_t(xq[k]) * w[k * N + n];
      part[n] += float(s);
    }
  }
}

// ----------------------------------------------------------------- W [K, N], several rows
// MR rows of xq x 16*NV columns at n, rows [k0, k1) of W (<= 2*KB_PAIRS): buf[m*ld + ..] +=.
template <int MR, int NV>
inline void kn_tile(const int16_t* xq, int64_t Kp, const int8_t* w, int64_t N, int64_t n, int64_t k0, int64_t k1,
                    float* buf, int64_t ld) {
  __m256i acc[MR][2 * NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NV; ++v) acc[m][v] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 2) {
    const bool two = k + 1 < k1;
    const int8_t* p = w + k * N + n;
    __m256i wv[2 * NV];
    for (int v = 0; v < NV; ++v) pairs16(p + 16 * v, two ? p + N + 16 * v : nullptr, wv[2 * v], wv[2 * v + 1]);
    for (int m = 0; m < MR; ++m) {
      const __m256i xb = pair_at(xq + m * Kp + k);
      for (int v = 0; v < 2 * NV; ++v) acc[m][v] = madd_add(acc[m][v], wv[v], xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) flush16(acc[m][2 * v], acc[m][2 * v + 1], buf + m * ld + 16 * v);
}

template <int MR, int NV>
inline void kn_group(const int16_t* xq, int64_t Kp, const int8_t* w, int64_t N, int64_t n0, int64_t vec_end,
                     int64_t k0, int64_t k1, float* buf, int64_t ld) {
  int64_t n = n0;
  for (; n + 16 * NV <= vec_end; n += 16 * NV) kn_tile<MR, NV>(xq, Kp, w, N, n, k0, k1, buf + (n - n0), ld);
  for (; n < vec_end; n += 16) kn_tile<MR, 1>(xq, Kp, w, N, n, k0, k1, buf + (n - n0), ld);
}

// All M rows x columns [n0, n1): buf [M, n1 - n0] (zeroed by the caller) += x . W (unscaled).
inline void kn_rows(const int16_t* xq, int64_t Kp, int64_t M, const int8_t* w, int64_t K, int64_t N, int64_t n0,
                    int64_t n1, float* buf) {
  const int64_t ld = n1 - n0, vec_end = n0 + (n1 - n0) / 16 * 16;
  for (int64_t kb = 0; kb < K; kb += 2 * KB_PAIRS) {  // k outer: a block of W is reused by all row groups
    const int64_t ke = std::min(K, kb + 2 * KB_PAIRS);
    for (int64_t m0 = 0; m0 < M;) {  // register budget: MR * 2NV accumulators + 2NV weights + 1 <= 16
      const int64_t left = M - m0;
      const int16_t* x = xq + m0 * Kp;
      float* b = buf + m0 * ld;
      const int mr = left >= 7 ? 4 : int(left);  // 8 rows: 4 + 4, 7: 4 + 3
      switch (mr) {
        case 1: kn_group<1, 4>(x, Kp, w, N, n0, vec_end, kb, ke, b, ld); break;
        case 2: kn_group<2, 2>(x, Kp, w, N, n0, vec_end, kb, ke, b, ld); break;
        case 3: kn_group<3, 1>(x, Kp, w, N, n0, vec_end, kb, ke, b, ld); break;
        case 4: kn_group<4, 1>(x, Kp, w, N, n0, vec_end, kb, ke, b, ld); break;
        case 5: kn_group<5, 1>(x, Kp, w, N, n0, vec_end, kb, ke, b, ld); break;
        default: kn_group<6, 1>(x, Kp, w, N, n0, vec_end, kb, ke, b, ld); break;
      }
      m0 += mr;
    }
  }
  for (int64_t n = vec_end; n < n1; ++n)  // column tail
    for (int64_t m = 0; m < M; ++m) {
      int64_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += int32_t(xq[m * Kp + k]) * w[k * N + n];
      buf[m * ld + (n - n0)] += float(s);
    }
}

// ----------------------------------------------------------------- W [N, K]
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// MR rows of xq (Kp a multiple of 16) . NR rows of W from n: res[m * NR + r] (unscaled).
template <int MR, int NR>
inline void nk_tile(const int16_t* xq, int64_t Kp, const int8_t* w, int64_t K, int64_t n, float* res) {
  constexpr int64_t KB = 16 * KB_PAIRS;  // 8 lanes each add KB_PAIRS pairs before a flush
  float tot[MR][NR] = {};
  const int64_t kv = K / 16 * 16;
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    __m256i acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_si256();
    const int64_t k1 = std::min(kv, k0 + KB);
    for (int64_t k = k0; k < k1; k += 16) {
      __m256i xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + k));
      if ((k & 63) == 0)
        for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + NR) * K + k), _MM_HINT_T0);
      for (int r = 0; r < NR; ++r) {
        const __m256i wv =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + r) * K + k)));
        for (int m = 0; m < MR; ++m) acc[m][r] = madd_add(acc[m][r], xv[m], wv);
      }
    }
    if (k0 + KB >= K && kv < K) {  // K tail: a zero-padded copy of each row's last < 16 bytes
      for (int r = 0; r < NR; ++r) {
        alignas(16) int8_t t[16] = {};
        std::memcpy(t, w + (n + r) * K + kv, K - kv);
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
        for (int m = 0; m < MR; ++m) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + kv));
          acc[m][r] = madd_add(acc[m][r], xv, wv);
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) tot[m][r] += float(hsum_i32(acc[m][r]));
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) res[m * NR + r] = tot[m][r];
}

// Rows [n0, n1) of W for MR rows of x; emit(m, n, value) takes each unscaled result.
template <int MR, int NR, class Emit>
inline void nk_rows(const int16_t* xq, int64_t Kp, const int8_t* w, int64_t K, int64_t n0, int64_t n1,
                    const Emit& emit) {
  float res[MR * NR];
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    nk_tile<MR, NR>(xq, Kp, w, K, n, res);
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) emit(m, n + r, res[m * NR + r]);
  }
  for (; n < n1; ++n) {
    nk_tile<MR, 1>(xq, Kp, w, K, n, res);
    for (int m = 0; m < MR; ++m) emit(m, n, res[m]);
  }
}

}  // namespace aotlm_i8
