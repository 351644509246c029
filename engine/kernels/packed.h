// int8, bf16, f16 and f32 weights in the panel layout (included by wmatmul.cc after int8.h).
//
//   aotlm_wmm_pk:  y[M,N] = x[M,K] @ W[K,N] (* scale[N]),  int8, bf16, f16 or f32 W as panels (models/packing.py)
//   aotlm_unpack:  y[K,N] = float(W)                      (prefill: XLA's GEMM reads a plain matrix)
//
// Layout: wp[N/16][K/2][16][2] -- panel p holds columns 16p..16p+15 of all K rows, and in it
// each pair of rows (k, k+1) is interleaved per column, so 32 consecutive bytes are exactly the
// vpmaddwd operands of one pair of rows x 16 columns (two vpmovsxbw loads, no unpack).
//
// Why: the row-major one-row stream (int8.h) keeps N partial sums in memory and unpacks every
// pair of rows: 12 uops per 32 weights, and one decode step's int8 matmuls read only 11-14 GB/s
// of the ~18 GB/s two threads can stream on the 2-core EPYC. A panel is one contiguous stream
// whose 16 sums stay in registers for all K (6 uops per 32 weights): 15-18 GB/s in the same
// harness run (/tmp-style harness of GPT-2-small's 48 decode matmuls, cold). The threads split
// the panels (contiguous ranges of memory), so no partial sums are added at the end either.
#pragma once

namespace aotlm_pk {
constexpr int64_t P = 16;       // columns per panel
constexpr int64_t PFB = 1024;   // software prefetch distance (bytes ahead in the panel stream)
using aotlm_i8::KB_PAIRS;       // pairs of rows between int32 -> f32 flushes (no int32 overflow)
using aotlm_i8::pair_at;

inline __m256i w16(const int8_t* p) {  // 16 int8 -> 16 int16 (8 columns x a pair of rows)
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// MR rows of xq [MR, Kp] (zero padded past K) x panel (Kh pairs of rows): out[m * ld + 0..15] =
// the unscaled dot products. Kh pairs = K/2 rows of the panel, 32 bytes each.
// Two pairs (one 64-byte line, one prefetch 1 KB ahead) per iteration: GPT-2-small's 49 decode
// matmuls at one row went 25.7 -> 29.9 GB/s (plain two-thread read with the same syncs: 30.5)
// against one pair and a prefetch every other pair 512 B ahead, in one harness run.
template <int MR>
inline void panel_rows(const int16_t* xq, int64_t Kp, const int8_t* panel, int64_t Kh, float* out, int64_t ld) {
  constexpr int A = MR == 1 ? 2 : 1;  // one row: even and odd pairs in separate sums (the add latency)
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < Kh; j0 += KB_PAIRS) {
    const int64_t j1 = std::min(Kh, j0 + KB_PAIRS);
    __m256i acc[MR][2][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][0][a] = acc[m][1][a] = _mm256_setzero_si256();
    const auto step = [&](int64_t j, int a) {
      const int8_t* r = panel + j * 2 * P;
      const __m256i w0 = w16(r), w1 = w16(r + 16);
      for (int m = 0; m < MR; ++m) {
        const __m256i xb = pair_at(xq + m * Kp + 2 * j);
        acc[m][0][a] = aotlm_i8::madd_add(acc[m][0][a], w0, xb);
        acc[m][1][a] = aotlm_i8::madd_add(acc[m][1][a], w1, xb);
      }
    };
    int64_t j = j0;
    for (; j + 1 < j1; j += 2) {  // two pairs = one 64-byte line per iteration, one prefetch each
      _mm_prefetch(reinterpret_cast<const char*>(panel + j * 2 * P + PFB), _MM_HINT_T0);
      step(j, 0);
      step(j + 1, A - 1);
    }
    if (j < j1) step(j, 0);
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 2; ++v) {
        const __m256i s = A == 2 ? _mm256_add_epi32(acc[m][v][0], acc[m][v][A - 1]) : acc[m][v][0];
        f[m][v] = _mm256_add_ps(f[m][v], _mm256_cvtepi32_ps(s));
      }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * ld, f[m][0]);
    _mm256_storeu_ps(out + m * ld + 8, f[m][1]);
  }
}

#include "packed512.h"  // rows_z: the avx512 builds' panel_rows on 512-bit registers

// All M rows x panels [p0, p1): buf[m * ld + (p - p0) * 16 + c] (unscaled). Row groups of <= 6
// (12 accumulators + 2 weight vectors + 1 broadcast <= 16 registers); a panel is at most
// KB_PAIRS * 32 = 4 KB per block, so the groups after the first read it from L1/L2. The avx512
// builds take rows_z instead.
inline void rows(const int16_t* xq, int64_t Kp, int64_t M, const int8_t* wp, int64_t Kh, int64_t p0, int64_t p1,
                 float* buf, int64_t ld) {
#if defined(__AVX512BW__)
  rows_z(xq, Kp, M, wp, Kh, p0, p1, buf, ld);
  return;
#endif
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* panel = wp + p * Kh * 2 * P;
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int mr = left >= 7 ? 4 : int(left);  // 8 rows: 4 + 4, 7: 4 + 3
      const int16_t* x = xq + m0 * Kp;
      float* o = buf + m0 * ld + (p - p0) * P;
      switch (mr) {
        case 1: panel_rows<1>(x, Kp, panel, Kh, o, ld); break;
        case 2: panel_rows<2>(x, Kp, panel, Kh, o, ld); break;
        case 3: panel_rows<3>(x, Kp, panel, Kh, o, ld); break;
        case 4: panel_rows<4>(x, Kp, panel, Kh, o, ld); break;
        case 5: panel_rows<5>(x, Kp, panel, Kh, o, ld); break;
        default: panel_rows<6>(x, Kp, panel, Kh, o, ld); break;
      }
      m0 += mr;
    }
  }
}

// ``pairs`` pairs of rows of one panel from r -> f32 rows of the logical W: dst[k * ld + c], c < 16.
inline void unpack_pairs(const int8_t* r, int64_t pairs, float* dst, int64_t ld) {
  // vpshufb within each 128-bit half: even bytes (row k) first, then odd bytes (row k+1)
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                         12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t j = 0; j < pairs; ++j) {
    __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j * 2 * P)), split);
    v = _mm256_permute4x64_epi64(v, 0xd8);  // [row k: columns 0-15 | row k+1: columns 0-15]
    const __m128i r0 = _mm256_castsi256_si128(v), r1 = _mm256_extracti128_si256(v, 1);
    float* a = dst + 2 * j * ld;
    float* b = a + ld;
    _mm256_storeu_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(r0)));
    _mm256_storeu_ps(a + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(r0, 8))));
    _mm256_storeu_ps(b, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(r1)));
    _mm256_storeu_ps(b + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(r1, 8))));
  }
}

// ----------------------------------------------------------------- bf16 panels
// The same layout with 2-byte elements: a 32-bit word holds one column's (row k, row k+1), so
// row k+1 as f32 is ``word & 0xffff0000`` and row k is ``word << 16`` -- 2 ops per 16 weights
// instead of widening each (the row-major stream also kept its N partial sums in memory).
// MR rows of x [MR, K] f32 x one panel -> out[m * ld + 0..15]. One row keeps even and odd rows
// of W in separate sums (the FMA latency); several rows chain them (2 * MR independent sums).
template <int MR>
inline void bf16_panel_rows(const float* x, int64_t K, const uint16_t* panel, int64_t Kh, float* out, int64_t ld) {
  constexpr int A = MR == 1 ? 2 : 1;
  __m256 acc[MR][2][A];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v)
      for (int a = 0; a < A; ++a) acc[m][v][a] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  for (int64_t j = 0; j < Kh; ++j) {
    const uint16_t* r = panel + j * 2 * P;  // 64 bytes: one cache line
    _mm_prefetch(reinterpret_cast<const char*>(r) + PFB, _MM_HINT_T0);
    __m256 e[2], o[2];
    for (int v = 0; v < 2; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * v));
      e[v] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      o[v] = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 xe = _mm256_broadcast_ss(x + m * K + 2 * j), xo = _mm256_broadcast_ss(x + m * K + 2 * j + 1);
      for (int v = 0; v < 2; ++v) {
        acc[m][v][0] = _mm256_fmadd_ps(e[v], xe, acc[m][v][0]);
        acc[m][v][A - 1] = _mm256_fmadd_ps(o[v], xo, acc[m][v][A - 1]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v)
      _mm256_storeu_ps(out + m * ld + 8 * v, A == 2 ? _mm256_add_ps(acc[m][v][0], acc[m][v][A - 1]) : acc[m][v][0]);
}

// All M rows x bf16 panels [p0, p1): buf[m * ld + (p - p0) * 16 + c]; row groups of <= 4
// (8 sums + 4 weight vectors + 2 broadcasts <= 16 registers).
inline void bf16_rows(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t p0, int64_t p1, float* buf,
                      int64_t ld) {
  const int64_t Kh = K / 2;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* panel = wp + p * Kh * 2 * P;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float* xm = x + m0 * K;
      float* o = buf + m0 * ld + (p - p0) * P;
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: bf16_panel_rows<1>(xm, K, panel, Kh, o, ld); break;
        case 2: bf16_panel_rows<2>(xm, K, panel, Kh, o, ld); break;
        case 3: bf16_panel_rows<3>(xm, K, panel, Kh, o, ld); break;
        default: bf16_panel_rows<4>(xm, K, panel, Kh, o, ld); break;
      }
    }
  }
}

// ``pairs`` pairs of rows of one bf16 panel from r -> f32 rows: dst[k * ld + c], c < 16.
inline void bf16_unpack_pairs(const uint16_t* r, int64_t pairs, float* dst, int64_t ld) {
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  // the words hold columns 0-7 then 8-15 in order, so no shuffle: split each into its two rows
  for (int64_t j = 0; j < pairs; ++j)
    for (int v = 0; v < 2; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j * 2 * P + 16 * v));
      _mm256_storeu_ps(dst + 2 * j * ld + 8 * v, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      _mm256_storeu_ps(dst + (2 * j + 1) * ld + 8 * v, _mm256_castsi256_ps(_mm256_and_si256(w, hi)));
    }
}

// ----------------------------------------------------------------- f16 panels
// The same layout again. F16C converts 8 halves at a time, so one pair of rows x 4 columns (16
// bytes, (row k, row k+1) per column) becomes 8 f32 in one vcvtph2ps and is FMA-ed with
// (x[k], x[k+1]) broadcast as one 64-bit pair; each sum lane then holds one column's even or
// odd rows, and a horizontal add of neighbours at the end gives the columns in order. 4
// conversions + 4 FMAs + 1 broadcast per 64-byte line and row of x, no shuffles in the loop.
// Row-major f16 (wfloat.h's stream, N partial sums in memory) decoded GPT-2-small at ~1.55x f32,
// bf16 panels at ~1.8x: this gives f16 the bf16 panels' speed.
inline __m256 pair_bcast(const float* p) {  // [p[0], p[1]] x 4
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_castsi256_ps(_mm256_set1_epi64x(v));
}

// Sums of 8 columns [c0e c0o c1e c1o | c2e c2o c3e c3o], [c4e .. c5o | c6e .. c7o] -> c0..c7.
inline __m256 pair_sums(__m256 a, __m256 b) {
  const __m256 h = _mm256_hadd_ps(a, b);  // [c0 c1 c4 c5 | c2 c3 c6 c7]
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xd8));
}

// MR rows of x [MR, K] f32 x one panel of f16 or f32 pairs (E: wfloat.h's F16 / F32, 8 elements =
// 4 columns' pairs) -> out[m * ld + 0..15]; acc[m][v]: columns 4v..4v+3.
template <class E, int MR>
inline void pair_panel_rows(const float* x, int64_t K, const typename E::T* panel, int64_t Kh, float* out,
                            int64_t ld) {
  constexpr int64_t LINES = 2 * P * sizeof(typename E::T) / 64;  // one pair of rows: 1 (f16) or 2 (f32) lines
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < Kh; ++j) {
    const typename E::T* r = panel + j * 2 * P;
    for (int64_t l = 0; l < LINES; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(r) + LINES * PFB + 64 * l, _MM_HINT_T0);
    __m256 xp[MR];
    for (int m = 0; m < MR; ++m) xp[m] = pair_bcast(x + m * K + 2 * j);
    for (int v = 0; v < 4; ++v) {
      const __m256 w = E::load8(r + 8 * v);
      for (int m = 0; m < MR; ++m) acc[m][v] = _mm256_fmadd_ps(w, xp[m], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * ld, pair_sums(acc[m][0], acc[m][1]));
    _mm256_storeu_ps(out + m * ld + 8, pair_sums(acc[m][2], acc[m][3]));
  }
}

// All M rows x f16 / f32 panels [p0, p1): buf[m * ld + (p - p0) * 16 + c]; row groups of <= 3
// (12 sums + 3 broadcasts + 1 weight vector <= 16 registers).
template <class E>
inline void pair_rows(const float* x, int64_t M, int64_t K, const typename E::T* wp, int64_t p0, int64_t p1,
                      float* buf, int64_t ld) {
  const int64_t Kh = K / 2;
  for (int64_t p = p0; p < p1; ++p) {
    const typename E::T* panel = wp + p * Kh * 2 * P;
    for (int64_t m0 = 0; m0 < M; m0 += 3) {
      const float* xm = x + m0 * K;
      float* o = buf + m0 * ld + (p - p0) * P;
      switch (std::min<int64_t>(3, M - m0)) {
        case 1: pair_panel_rows<E, 1>(xm, K, panel, Kh, o, ld); break;
        case 2: pair_panel_rows<E, 2>(xm, K, panel, Kh, o, ld); break;
        default: pair_panel_rows<E, 3>(xm, K, panel, Kh, o, ld); break;
      }
    }
  }
}

// ``pairs`` pairs of rows of one f16 panel from r -> f32 rows: dst[k * ld + c], c < 16.
inline void f16_unpack_pairs(const uint16_t* r, int64_t pairs, float* dst, int64_t ld) {
  // vpshufb within each 128-bit half (4 columns): row k's halves first, then row k+1's
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12,
                                         13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int64_t j = 0; j < pairs; ++j)
    for (int v = 0; v < 2; ++v) {
      __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j * 2 * P + 16 * v));
      w = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, split), 0xd8);  // [row k: 8 columns | row k+1]
      _mm256_storeu_ps(dst + 2 * j * ld + 8 * v, _mm256_cvtph_ps(_mm256_castsi256_si128(w)));
      _mm256_storeu_ps(dst + (2 * j + 1) * ld + 8 * v, _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1)));
    }
}

// ----------------------------------------------------------------- f32 panels
// The same layout with 4-byte elements (f32 weights packed at load, so prefill's GEMM reads
// panels instead of copying 16 columns of a row-major matrix per block): 8 floats are 4 columns'
// (row k, row k+1), multiplied by pair_rows<F32> as f16's are; a pair of rows is 128 bytes (two
// lines, both prefetched).

// ``pairs`` pairs of rows of one f32 panel from r -> rows dst[k * ld + c], c < 16: per 8 columns the
// even and odd floats of two vectors, put back in column order by one 64-bit permute each.
inline void f32_unpack_pairs(const float* r, int64_t pairs, float* dst, int64_t ld) {
  for (int64_t j = 0; j < pairs; ++j)
    for (int v = 0; v < 2; ++v) {
      const __m256 a = _mm256_loadu_ps(r + j * 2 * P + 16 * v), b = _mm256_loadu_ps(r + j * 2 * P + 16 * v + 8);
      const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));  // [c0 c1 c4 c5 | c2 c3 c6 c7]
      const __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      _mm256_storeu_ps(dst + 2 * j * ld + 8 * v, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xd8)));
      _mm256_storeu_ps(dst + (2 * j + 1) * ld + 8 * v,
                       _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xd8)));
    }
}

// ----------------------------------------------------------------- drivers
// The threads take contiguous ranges of panels (one per thread for one row, ~4 per thread
// otherwise, for balance when the pool is busy); panels(p0, p1, buf, ld) fills buf [M, ld] with
// unscaled sums, which are multiplied by rs[m] (int8: x's per-row scale) and scale[n].
// Panels [0, Np) as up to per_thread * threads contiguous ranges over the pool: fn(p0, p1) each.
template <class Fn>
inline void panel_ranges(int64_t Np, int64_t per_thread, const Fn& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(Np, per_thread * aotlm::pool_size()));
  aotlm::parallel_for(int(parts), [&](int c) {
    const int64_t p0 = Np * c / parts, p1 = Np * (c + 1) / parts;
    if (p0 < p1) fn(p0, p1);
  });
}

// ``bias`` / ``act``: added and applied after the scales (epilogue.h), as aotlm_gemm_pk does.
template <class Panels>
inline void drive(int64_t M, int64_t N, const float* rs, const float* scale, const float* bias, int32_t act,
                  const Out& out, const Panels& panels) {
  panel_ranges(N / P, M == 1 ? 1 : 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * P, n0 = p0 * P;
    thread_local std::vector<float> buf;
    buf.resize(M * ld);
    panels(p0, p1, buf.data(), ld);
    for (int64_t m = 0; m < M; ++m) {
      float* r = buf.data() + m * ld;
      if (rs || scale || bias || act)
        for (int64_t j = 0; j < ld; j += 8) {
          const __m256 sv = scale ? _mm256_loadu_ps(scale + n0 + j) : _mm256_set1_ps(1.f);
          const __m256 s = rs ? _mm256_mul_ps(sv, _mm256_set1_ps(rs[m])) : sv;
          _mm256_storeu_ps(r + j, aotlm_ep::finish(_mm256_loadu_ps(r + j), s, bias ? bias + n0 + j : nullptr, act));
        }
      out.put(m * N + n0, r, int(ld));
    }
  });
}

// W8A8 decode rows (a8): x rounded to int8 per row as prefill's GEMM rounds it (round_row_s8), then
// vpdpbusd (rows_s8) where the build has AVX512-VNNI and K < 66,000, else the same int8 values as
// int16 on the int16 route (the same exact products, sums flushed per KB_PAIRS). Either way a row's
// result does not depend on how many rows share the call.
inline void run_s8(const float* x, const int8_t* w, const float* scale, const float* bias, int32_t act, int64_t M,
                   int64_t K, int64_t N, const Out& out) {
  std::vector<float> sx(M);
#if defined(__AVX512VNNI__)
  if (K < 66000) {
    const int64_t Kq = (K + 3) / 4 * 4;
    std::vector<int8_t> xq(M * Kq, 0);
    std::vector<int32_t> corr(M);
    for (int64_t m = 0; m < M; ++m) {
      sx[m] = aotlm_i8::round_row_s8(x + m * K, K, xq.data() + m * Kq);
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += xq[m * Kq + k];
      corr[m] = 128 * sum;
    }
    drive(M, N, sx.data(), scale, bias, act, out, [&](int64_t p0, int64_t p1, float* buf, int64_t ld) {
      rows_s8(xq.data(), Kq, M, corr.data(), w, K / 2, p0, p1, buf, ld);
    });
    return;
  }
#endif
  const int64_t Kp = (K + 16) / 16 * 16;
  std::vector<int8_t> q8(K);
  std::vector<int16_t> xq(M * Kp, 0);
  for (int64_t m = 0; m < M; ++m) {
    sx[m] = aotlm_i8::round_row_s8(x + m * K, K, q8.data());
    std::copy(q8.begin(), q8.end(), xq.begin() + m * Kp);
  }
  drive(M, N, sx.data(), scale, bias, act, out,
        [&](int64_t p0, int64_t p1, float* buf, int64_t ld) { rows(xq.data(), Kp, M, w, K / 2, p0, p1, buf, ld); });
}

#if defined(AOTLM_AMX)
void i16_rows_amx(const float* x, const int8_t* w, const float* scale, const float* bias, int32_t act, int64_t M,
                  int64_t K, int64_t N, const Out& out);  // amx16i.h (after gemm.h: its panel regrouping)
#endif

// y [M, N] = x [M, K] @ W (* scale) for packed W (wt: S8, BF16, F16 or F32; K even, N a multiple of 16);
// a8: int8 W times x rounded to int8 (run_s8), else int16 x.
inline void run(DataType wt, const float* x, const void* wp, const float* scale, const float* bias, int32_t act,
                int64_t M, int64_t K, int64_t N, const Out& out, bool a8 = false) {
  if (wt == DataType::F32) {
    const float* w = static_cast<const float*>(wp);
    drive(M, N, nullptr, scale, bias, act, out,
          [&](int64_t p0, int64_t p1, float* buf, int64_t ld) { pair_rows<F32>(x, M, K, w, p0, p1, buf, ld); });
    return;
  }
  if (wt == DataType::BF16 || wt == DataType::F16) {
    const uint16_t* w = static_cast<const uint16_t*>(wp);
    const bool bf16 = wt == DataType::BF16;
    drive(M, N, nullptr, scale, bias, act, out, [&](int64_t p0, int64_t p1, float* buf, int64_t ld) {
      if (bf16)
        bf16_rows(x, M, K, w, p0, p1, buf, ld);
      else
        pair_rows<F16>(x, M, K, w, p0, p1, buf, ld);
    });
    return;
  }
  if (a8) {
    run_s8(x, static_cast<const int8_t*>(wp), scale, bias, act, M, K, N, out);
    return;
  }
  const int8_t* w = static_cast<const int8_t*>(wp);
#if defined(AOTLM_AMX)  // prefill rows on AMX tiles, the same sums bit for bit (amx16i.h)
  if (M > aotlm_amx::MIN_ROWS_I16 && aotlm_amx::ready()) return i16_rows_amx(x, w, scale, bias, act, M, K, N, out);
#endif
  const int64_t Kp = (K + 16) / 16 * 16;
  std::vector<int16_t> xq(M * Kp);
  std::vector<float> sx(M);
  aotlm_i8::quantize_rows(x, M, K, Kp, xq.data(), sx.data());
  drive(M, N, sx.data(), scale, bias, act, out,
        [&](int64_t p0, int64_t p1, float* buf, int64_t ld) { rows(xq.data(), Kp, M, w, K / 2, p0, p1, buf, ld); });
}

// Whole packed W -> y [K, N] (dtype of out), in blocks of rows of panels over the thread pool.
inline void run_unpack(DataType wt, const void* wp, int64_t K, int64_t N, const Out& out) {
  const int64_t Kh = K / 2;
  panel_ranges(N / P, 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * P;
    constexpr int64_t KB = 64;  // pairs per block: 128 rows of the chunk in a buffer, then put
    thread_local std::vector<float> buf;
    buf.resize(2 * KB * ld);
    for (int64_t j0 = 0; j0 < Kh; j0 += KB) {
      const int64_t j1 = std::min(Kh, j0 + KB);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t off = (p * Kh + j0) * 2 * P;
        if (wt == DataType::BF16)
          bf16_unpack_pairs(static_cast<const uint16_t*>(wp) + off, j1 - j0, buf.data() + (p - p0) * P, ld);
        else if (wt == DataType::F16)
          f16_unpack_pairs(static_cast<const uint16_t*>(wp) + off, j1 - j0, buf.data() + (p - p0) * P, ld);
        else if (wt == DataType::F32)
          f32_unpack_pairs(static_cast<const float*>(wp) + off, j1 - j0, buf.data() + (p - p0) * P, ld);
        else
          unpack_pairs(static_cast<const int8_t*>(wp) + off, j1 - j0, buf.data() + (p - p0) * P, ld);
      }
      for (int64_t k = 2 * j0; k < 2 * j1; ++k) out.put(k * N + p0 * P, buf.data() + (k - 2 * j0) * ld, int(ld));
    }
  });
}

}  // namespace aotlm_pk
