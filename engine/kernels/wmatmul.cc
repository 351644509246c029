// Weight-only low-precision matmuls for XLA:CPU, called through JAX's FFI.
//
//   aotlm_wmm_nn:  y[M,N] = x[M,K] @ W[K,N]      (dense weights, row-major [in, out])
//   aotlm_wmm_nt:  y[M,N] = x[M,K] @ W[N,K]^T    (embedding rows: tied lm_head)
//
// W is bf16, f16, f32 or int8 (then times a per-output-channel f32 scale); x and y are f32,
// bf16 or f16 (y has x's dtype); products accumulate in f32. Why: XLA:CPU converts a whole
// low-precision matrix before a GEMV (1-2 GB/s), so decode with bf16/int8 weights was slower
// than f32. Here every weight byte is read once per call, converted in registers (AVX2 +
// FMA + F16C) and used for all M rows, with the work split over a thread pool (all cores by
// default). int8 weights take integer dot products instead (int8.h: x rounded to int16 per
// row). Built on first use by aotlm.kernels (g++ -O3 -mavx2 -mfma -mf16c).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using ffi::DataType;

namespace {

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

// Output: f32 values -> y (dtype of x) at y[off .. off+n).
struct Out {
  void* y;
  DataType dt;
  void put(int64_t off, const float* v, int n) const {
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
    case 1: return nt_rows<W, 1, 4>(x, w, scale, K, N, n0, n1, out, m0);
    case 2: return nt_rows<W, 2, 4>(x, w, scale, K, N, n0, n1, out, m0);
    case 3: return nt_rows<W, 3, 3>(x, w, scale, K, N, n0, n1, out, m0);
    case 4: return nt_rows<W, 4, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 5: return nt_rows<W, 5, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 6: return nt_rows<W, 6, 2>(x, w, scale, K, N, n0, n1, out, m0);
    case 7: return nt_rows<W, 7, 1>(x, w, scale, K, N, n0, n1, out, m0);
    default: return nt_rows<W, 8, 1>(x, w, scale, K, N, n0, n1, out, m0);
  }
}

#include "bdot.h"  // batched attention dots: uses the element types and hsum above

// ------------------------------------------------------------------ driver
// x as f32 (converted once, shared read-only by the workers).
const float* x_f32(const ffi::AnyBuffer& x, int64_t n, std::vector<float>& tmp) {
  if (x.element_type() == DataType::F32) return static_cast<const float*>(x.untyped_data());
  tmp.resize(n);
  const uint16_t* p = static_cast<const uint16_t*>(x.untyped_data());
  bool bf = x.element_type() == DataType::BF16;
  for (int64_t i = 0; i < n; ++i) tmp[i] = bf ? bf16_to_f32(p[i]) : f16_to_f32(p[i]);
  return tmp.data();
}

template <class W>
void run(bool nt, const float* x, const void* wraw, const float* scale, int64_t M, int64_t K, int64_t N,
         const Out& out) {
  const typename W::T* w = static_cast<const typename W::T*>(wraw);
  // Column chunks: multiples of 32 columns (whole cache lines of W for nn), ~4 per thread.
  const int64_t threads = aotlm::pool_size();
  const int64_t align = nt ? 4 : 32;
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::max<int64_t>(align, (chunk + align - 1) / align * align);
  if (!nt) chunk = std::min<int64_t>(chunk, 1024);  // partial sums of a chunk stay in L2
  const int64_t n_chunks = (N + chunk - 1) / chunk;
  aotlm::parallel_for(int(n_chunks), [&](int c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int mr = int(std::min<int64_t>(8, M - m0));
      if (nt)
        nt_block<W>(mr, x + m0 * K, w, scale, K, N, n0, n1, out, m0);
      else
        nn_block<W>(mr, x + m0 * K, w, scale, K, N, n0, n1, out, m0);
    }
  });
}

// int8 weights (int8.h): x rounded to int16 per row, integer dot products, then * sx * scale.
void run_i8(bool nt, const float* x, const int8_t* w, const float* scale, int64_t M, int64_t K, int64_t N,
            const Out& out) {
  const int64_t Kp = (K + 16) / 16 * 16;  // >= K + 1: the pair (k, k+1) at an odd K reads a zero
  std::vector<int16_t> xq(M * Kp);
  std::vector<float> sx(M);
  aotlm_i8::quantize_rows(x, M, K, Kp, xq.data(), sx.data());
  const int64_t threads = aotlm::pool_size();
  // buf [rows, ld]: unscaled sums for columns [n0, n0 + ld) of rows m0.. -> y, one put per row
  auto finish = [&](float* buf, int64_t m0, int64_t rows, int64_t ld, int64_t n0) {
    for (int64_t m = 0; m < rows; ++m) {
      float* r = buf + m * ld;
      for (int64_t j = 0; j < ld; ++j) r[j] *= sx[m0 + m] * (scale ? scale[n0 + j] : 1.f);
      out.put((m0 + m) * N + n0, r, int(ld));
    }
  };
  if (nt) {  // rows of W split over threads, ~4 chunks each
    const int64_t chunk = std::max<int64_t>(8, (N + 4 * threads - 1) / (4 * threads) / 8 * 8);
    aotlm::parallel_for(int((N + chunk - 1) / chunk), [&](int c) {
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk), ld = n1 - n0;
      thread_local std::vector<float> buf;
      buf.resize(M * ld);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int16_t* xm = xq.data() + m0 * Kp;
        auto emit = [&](int m, int64_t n, float v) { buf[(m0 + m) * ld + (n - n0)] = v; };
        switch (std::min<int64_t>(4, M - m0)) {  // MR * NR accumulators + MR x + 1 w <= 16
          case 1: aotlm_i8::nk_rows<1, 8>(xm, Kp, w, K, n0, n1, emit); break;
          case 2: aotlm_i8::nk_rows<2, 4>(xm, Kp, w, K, n0, n1, emit); break;
          case 3: aotlm_i8::nk_rows<3, 3>(xm, Kp, w, K, n0, n1, emit); break;
          default: aotlm_i8::nk_rows<4, 2>(xm, Kp, w, K, n0, n1, emit); break;
        }
      }
      finish(buf.data(), 0, M, ld, n0);
    });
    return;
  }
  if (M == 1) {  // split K: each part streams its rows of W; the N partial sums are added at the end
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(2 * threads, K / 64));
    const int64_t step = (K / parts + 1) / 2 * 2;  // even: a part never splits a pair of rows
    std::vector<float> part(parts * N, 0.f);
    aotlm::parallel_for(int(parts), [&](int c) {
      const int64_t k0 = c * step, k1 = c == parts - 1 ? K : std::min(K, k0 + step);
      thread_local std::vector<int32_t> acc;
      if (int64_t(acc.size()) < N) acc.resize(N);
      if (k0 < k1) aotlm_i8::kn_row_stream(xq.data(), w, N, k0, k1, part.data() + c * N, acc.data());
    });
    for (int64_t c = 1; c < parts; ++c)
      for (int64_t n = 0; n < N; ++n) part[n] += part[c * N + n];
    finish(part.data(), 0, 1, N, 0);
    return;
  }
  // several rows: column chunks (multiples of 64 columns, <= 1024 so the partial sums stay in L1/L2)
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::min<int64_t>(1024, std::max<int64_t>(64, (chunk + 63) / 64 * 64));
  aotlm::parallel_for(int((N + chunk - 1) / chunk), [&](int c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk), ld = n1 - n0;
    thread_local std::vector<float> buf;
    buf.assign(M * ld, 0.f);
    aotlm_i8::kn_rows(xq.data(), Kp, M, w, K, N, n0, n1, buf.data());
    finish(buf.data(), 0, M, ld, n0);
  });
}

ffi::Error wmm(bool nt, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
               ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("aotlm_wmm: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = nt ? wd[0] : wd[1];
  if ((nt ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("aotlm_wmm: contracting dims differ");
  if (y->element_type() != x.element_type()) return ffi::Error::InvalidArgument("aotlm_wmm: y dtype != x dtype");
  const DataType xt = x.element_type();
  if (xt != DataType::F32 && xt != DataType::BF16 && xt != DataType::F16)
    return ffi::Error::InvalidArgument("aotlm_wmm: x must be f32, bf16 or f16");
  const float* s = nullptr;
  if (scale.element_count() > 0) {
    if (scale.element_type() != DataType::F32 || int64_t(scale.element_count()) != N)
      return ffi::Error::InvalidArgument("aotlm_wmm: scale must be f32 [N]");
    s = static_cast<const float*>(scale.untyped_data());
  }
  std::vector<float> tmp;
  const float* xf = x_f32(x, M * K, tmp);
  Out out{y->untyped_data(), xt};
  switch (w.element_type()) {
    case DataType::S8: run_i8(nt, xf, static_cast<const int8_t*>(w.untyped_data()), s, M, K, N, out); break;
    case DataType::BF16: run<BF16>(nt, xf, w.untyped_data(), s, M, K, N, out); break;
    case DataType::F16: run<F16>(nt, xf, w.untyped_data(), s, M, K, N, out); break;
    case DataType::F32: run<F32>(nt, xf, w.untyped_data(), s, M, K, N, out); break;
    default: return ffi::Error::InvalidArgument("aotlm_wmm: w must be int8, bf16, f16 or f32");
  }
  return ffi::Error::Success();
}

ffi::Error wmm_nn(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> y) {
  return wmm(false, x, w, s, y);
}
ffi::Error wmm_nt(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> y) {
  return wmm(true, x, w, s, y);
}

ffi::Error bdot(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer lim, ffi::Result<ffi::AnyBuffer> c) {
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 3 || bd.size() != 3 || cd.size() != 3)
    return ffi::Error::InvalidArgument("aotlm_bdot: a, b and c must be 3-D");
  const int64_t I = ad[0], M = ad[1], L = ad[2], NB = bd[1], LB = bd[2], N = cd[2];
  if (bd[0] != I || cd[0] != I || cd[1] != M || N > NB || L > LB)
    return ffi::Error::InvalidArgument("aotlm_bdot: shapes do not match");
  if (c->element_type() != DataType::F32) return ffi::Error::InvalidArgument("aotlm_bdot: c must be f32");
  if (lim.element_type() != DataType::S32 || lim.element_count() != 2)
    return ffi::Error::InvalidArgument("aotlm_bdot: lim must be int32 [2]");
  const int32_t* lp = static_cast<const int32_t*>(lim.untyped_data());
  const int64_t n_lim = lp[0], l_lim = lp[1];
  const DataType at = a.element_type();
  if (at != DataType::F32 && at != DataType::BF16 && at != DataType::F16)
    return ffi::Error::InvalidArgument("aotlm_bdot: a must be f32, bf16 or f16");
  std::vector<float> tmp;
  const float* af = x_f32(a, I * M * L, tmp);
  float* cf = static_cast<float*>(c->untyped_data());
  switch (b.element_type()) {
    case DataType::F32: aotlm_bd::run<F32>(af, b.untyped_data(), cf, I, M, L, NB, LB, N, n_lim, l_lim); break;
    case DataType::BF16: aotlm_bd::run<BF16>(af, b.untyped_data(), cf, I, M, L, NB, LB, N, n_lim, l_lim); break;
    case DataType::F16: aotlm_bd::run<F16>(af, b.untyped_data(), cf, I, M, L, NB, LB, N, n_lim, l_lim); break;
    default: return ffi::Error::InvalidArgument("aotlm_bdot: b must be f32, bf16 or f16");
  }
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmWmmNN, wmm_nn,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmWmmNT, wmm_nt,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmBdot, bdot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

extern "C" int aotlm_kernels_cpu_ok() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
extern "C" int aotlm_kernels_threads() { return aotlm::pool_size(); }
