// Float-weight kernels (included by wmatmul.cc): W in f32, bf16 or f16, converted to f32 in
// registers and FMA-ed (AVX2 + FMA + F16C); the element types and the output writer are shared
// with the int8 and attention kernels.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace {
using xla::ffi::DataType;

// ------------------------------------------------------------------ element conversions
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

struct F32 {  // f32 weights: XLA:CPU runs a few-row f32 product as a GEMM that reads W ~2x slower
  using T = float;
  static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
  static float one(const T* p) { return *p; }
};
struct BF16 {
  using T = uint16_t;
  static __m256 load8(const T* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static float one(const T* p) { return bf16_to_f32(*p); }
};
struct F16 {
  using T = uint16_t;
  static __m256 load8(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static float one(const T* p) { return f16_to_f32(*p); }
};

// Output: f32 values -> y (dtype of x) at y[off .. off+n). With ``rows`` (live.h: a call on some rows of x),
// row r of the call is row rows[r] of y, whose rows are ``ld`` long.
struct Out {
  void* y;
  DataType dt;
  const int64_t* rows = nullptr;
  int64_t ld = 0;
  void put(int64_t off, const float* v, int n) const {
    if (rows) off = rows[off / ld] * ld + off % ld;
    if (dt == DataType::F32) {
      std::memcpy(static_cast<float*>(y) + off, v, n * sizeof(float));
    } else {
      uint16_t* o = static_cast<uint16_t*>(y) + off;
      for (int i = 0; i < n; ++i) o[i] = dt == DataType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
    }
  }
};

// ------------------------------------------------------------------ W[K,N] kernels
// One register tile: MR rows of x times NV*8 columns of W over the rows [k0, k1) of W. Rows of
// W are N elements apart, so a tile walking all of K would touch a new page per row (TLB
// misses made that 3x slower than a contiguous stream): k is blocked instead, every block
// sweeping all tiles of the chunk, with the f32 partial sums parked in ``buf`` between blocks.
template <class W, int MR, int NV>
inline void nn_tile(const float* x, const typename W::T* w, const float* scale, int64_t K, int64_t N,
                    int64_t n, int64_t k0, int64_t k1, float* buf, int64_t ld, const Out& out, int64_t m0) {
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + m * ld + 8 * v);
  const typename W::T* p = w + k0 * N + n;
#pragma GCC unroll 2
  for (int64_t k = k0; k < k1; ++k, p += N) {
    __m256 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = W::load8(p + 8 * v);
    for (int m = 0; m < MR; ++m) {
      __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(xb, wv[v], acc[m][v]);
    }
  }
  if (k1 < K) {
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(buf + m * ld + 8 * v, acc[m][v]);
    return;
  }
  alignas(32) float res[NV * 8];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      __m256 r = acc[m][v];
      if (scale) r = _mm256_mul_ps(r, _mm256_loadu_ps(scale + n + 8 * v));
      _mm256_store_ps(res + 8 * v, r);
    }
    out.put((m0 + m) * N + n, res, NV * 8);
  }
}

// Columns [n0, n1) for MR rows starting at m0: k blocks x (wide tiles, 8-wide tiles), then scalar.
template <class W, int MR, int NV>
void nn_cols(const float* x, const typename W::T* w, const float* scale, int64_t K, int64_t N, int64_t n0,
             int64_t n1, const Out& out, int64_t m0) {
  constexpr int64_t KB = 32;
  const int64_t ld = n1 - n0;
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < MR * ld) buf.resize(MR * ld);
  const int64_t wide_end = n0 + (n1 - n0) / (8 * NV) * (8 * NV), vec_end = n0 + (n1 - n0) / 8 * 8;
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    for (int64_t n = n0; n < wide_end; n += 8 * NV)
      nn_tile<W, MR, NV>(x, w, scale, K, N, n, k0, k1, buf.data() + (n - n0), ld, out, m0);
    for (int64_t n = wide_end; n < vec_end; n += 8)
      nn_tile<W, MR, 1>(x, w, scale, K, N, n, k0, k1, buf.data() + (n - n0), ld, out, m0);
  }
  for (int64_t n = vec_end; n < n1; ++n) {
    for (int m = 0; m < MR; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * W::one(w + k * N + n);
      if (scale) s *= scale[n];
      out.put((m0 + m) * N + n, &s, 1);
    }
  }
}

// One row of x, W[K,N]: part[n] += sum over k in [k0, k1) of x[k] W[k, n], streaming the rows of
// W front to back, R rows per pass (one load/store of the partial sums per R FMAs), with software
// prefetch of the next R rows. The column-chunk tiles above walk N-strided 64-byte runs and
// read a bf16 GEMV at ~10 GB/s on the 2-core EPYC; this stream reads it at ~17-21 GB/s.
template <class W, int R = 4>
inline void kn_row_stream(const float* x, const typename W::T* w, int64_t N, int64_t k0, int64_t k1,
                          float* part) {
  constexpr int64_t EPL = 64 / sizeof(typename W::T);  // elements per cache line
  const int64_t nv = N / 8 * 8;
  int64_t k = k0;
  for (; k + R <= k1; k += R) {
    const typename W::T* r = w + k * N;
    const bool pf = k + 2 * R <= k1;
    __m256 xb[R];
    for (int i = 0; i < R; ++i) xb[i] = _mm256_set1_ps(x[k + i]);
    for (int64_t n = 0; n < nv; n += 8) {
      if (pf && n % EPL == 0)
        for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(r + (R + i) * N + n), _MM_HINT_T0);
      __m256 a = _mm256_loadu_ps(part + n);
      for (int i = 0; i < R; ++i) a = _mm256_fmadd_ps(xb[i], W::load8(r + i * N + n), a);
      _mm256_storeu_ps(part + n, a);
    }
    for (int64_t n = nv; n < N; ++n)
      for (int i = 0; i < R; ++i) part[n] += x[k + i] * W::one(r + i * N + n);
  }
  for (; k < k1; ++k) {  // the last < R rows
    const typename W::T* r = w + k * N;
    const __m256 xb = _mm256_set1_ps(x[k]);
    int64_t n = 0;
    for (; n < nv; n += 8) _mm256_storeu_ps(part + n, _mm256_fmadd_ps(xb, W::load8(r + n), _mm256_loadu_ps(part + n)));
    for (; n < N; ++n) part[n] += x[k] * W::one(r + n);
  }
}

template <class W>
void nn_block(int mr, const float* x, const typename W::T* w, const float* scale, int64_t K, int64_t N,
              int64_t n0, int64_t n1, const Out& out, int64_t m0) {
  switch (mr) {  // register budget: MR*NV accumulators + NV weights + 1 broadcast <= 16
    case 1: return nn_cols<W, 1, 4>(x, w, scale, K, N, n0, n1, out, m0);
    case 2: return nn_cols<W, 2, 4>(x, w, scale, K, N, n0, n1, out, m0);
    case 3: return nn_cols<W, 3, 3>(x, w, scale, K, N, n0, n1, out, m0);
    case 4: return nn_cols<W, 4, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 5: return nn_cols<W, 5, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 6: return nn_cols<W, 6, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 7: return nn_cols<W, 7, 1>(x, w, scale, K, N, n0, n1, out, m0);
    default: return nn_cols<W, 8, 1>(x, w, scale, K, N, n0, n1, out, m0);
  }
}

// ------------------------------------------------------------------ W[N,K] kernels
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MR rows of x against NR consecutive rows of W (dot products over contiguous K).
template <class W, int MR, int NR>
inline void nt_tile(const float* x, const typename W::T* w, const float* scale, int64_t K, int64_t N,
                    int64_t n, const Out& out, int64_t m0) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const typename W::T* p = w + n * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (k % (64 / sizeof(typename W::T)) == 0)  // the next tile's rows: ~15 -> ~19 GB/s on a tied lm_head
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(p + (r + NR) * K + k), _MM_HINT_T0);
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = W::load8(p + r * K + k);
    for (int m = 0; m < MR; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * W::one(p + r * K + kk);
      if (scale) s *= scale[n + r];
      out.put((m0 + m) * N + n + r, &s, 1);
    }
  }
}

template <class W, int MR, int NR>
void nt_rows(const float* x, const typename W::T* w, const float* scale, int64_t K, int64_t N, int64_t n0,
             int64_t n1, const Out& out, int64_t m0) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) nt_tile<W, MR, NR>(x, w, scale, K, N, n, out, m0);
  for (; n < n1; ++n) nt_tile<W, MR, 1>(x, w, scale, K, N, n, out, m0);
}

template <class W>
void nt_block(int mr, const float* x, const typename W::T* w, const float* scale, int64_t K, int64_t N,
              int64_t n0, int64_t n1, const Out& out, int64_t m0) {
  switch (mr) {
    case 1: return nt_rows<W, 1, 8>(x, w, scale, K, N, n0, n1, out, m0);
    case 2: return nt_rows<W, 2, 4>(x, w, scale, K, N, n0, n1, out, m0);
    case 3: return nt_rows<W, 3, 3>(x, w, scale, K, N, n0, n1, out, m0);
    case 4: return nt_rows<W, 4, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 5: return nt_rows<W, 5, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 6: return nt_rows<W, 6, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 7: return nt_rows<W, 7, 1>(x, w, scale, K, N, n0, n1, out, m0);
    default: return nt_rows<W, 8, 1>(x, w, scale, K, N, n0, n1, out, m0);
  }
}

}  // namespace
