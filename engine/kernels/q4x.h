// x's rounding for the 4-bit kernels (included by int4.h inside namespace aotlm_q4): per row and group of
// K rows, one int8 part (llama.cpp's q8 rounding), two int8 digits of one int16 value, or three int8
// parts (f32-like).
#pragma once

constexpr int32_t X16 = 32639;  // 127 * 257: the largest |X| whose two digits (X + 128) >> 8 and the rest are int8

// r [n] -> X = round(r * inv) (|X| <= X16) as two int8 digits, qh = (X + 128) >> 8 and ql = X - 256 qh, so
// X = 256 qh + ql exactly; returns sum(X).
inline int32_t round_digits(const float* r, int64_t n, float inv, int8_t* qh, int8_t* ql) {
  const __m256 vi = _mm256_set1_ps(inv);
  const __m256i hi = _mm256_set1_epi32(X16), lo = _mm256_set1_epi32(-X16), half = _mm256_set1_epi32(128);
  __m256i vs = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), vi));
    a = _mm256_min_epi32(_mm256_max_epi32(a, lo), hi);
    vs = _mm256_add_epi32(vs, a);
    const __m256i h = _mm256_srai_epi32(_mm256_add_epi32(a, half), 8);
    aotlm_i8::store_i8(h, qh + k), aotlm_i8::store_i8(_mm256_sub_epi32(a, _mm256_slli_epi32(h, 8)), ql + k);
  }
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), vs);
  int32_t sum = 0;
  for (int32_t v : t) sum += v;
  for (; k < n; ++k) {
    const int32_t a = std::clamp(int32_t(std::lrintf(r[k] * inv)), -X16, X16), h = (a + 128) >> 8;
    qh[k] = int8_t(h), ql[k] = int8_t(a - 256 * h), sum += a;
  }
  return sum;
}

// x [M, K] -> xq int8 (zero padded), per row and group: sx (the scale), xi = sum(X) and xs = sx * xi, X the
// integers x is held by (X * sx ~ x). D = 2 (R = 1): X = round(x / sx) with sx = max|x| / X16, held as two
// digit rows (xq rows 2m, 2m + 1: 256 * the first + the second; the kernels shift the first's sums), so x
// is within max|x| / (2 * X16) per group; [M] scales. D = 1, R parts (1..3): xq [M * R, Kp], sx = max|x| /
// 127 per part; row m * R + h rounds what rows m * R .. + h - 1 left of x's row m (x - sx * xq, each
// product rounded to f32: XLA's numbers), so R parts hold x within max|x| / (127 * 254^(R - 1)) per group
// (3 parts: f32-like); [M * R] scales. Prompt rows in parallel.
inline void quantize_x(const float* x, int64_t M, int64_t K, const W4& w, int8_t* xq, float* sx, float* xs,
                       int32_t* xi, int64_t R = 1, int64_t D = 1) {
  const int64_t G = w.Kp / w.group;
  const auto part = [&](int64_t m0, int64_t m1) {  // rows m0..m1-1
    std::vector<float> res(R > 1 ? w.group : 0);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t h = 0; h < R; ++h) {
          const int64_t k0 = g * w.group, k1 = std::min(K, k0 + w.group), r = m * R + h;
          const float* xr = h ? res.data() : x + m * K + k0;
          int8_t* q = xq + r * D * w.Kp;
          if (h) {  // what the part before left (a non-finite row's: zeros)
            const float sp = sx[(r - 1) * G + g], *prev = h == 1 ? x + m * K + k0 : res.data();
            for (int64_t k = k0; k < k1; ++k) {
              volatile float p = sp * float(q[k - w.Kp]);  // volatile: never contracted into one fma
              res[k - k0] = std::isfinite(sp) ? prev[k - k0] - p : 0.f;
            }
          }
          bool finite = true;
          const float amax = aotlm_i8::abs_max(xr, k1 - k0, finite);
          const float s = amax / (D == 2 ? float(X16) : 127.f), inv = amax > 0.f && finite ? 1.f / s : 0.f;
          int32_t sum = 0;  // a row with inf / NaN: its q are 0 (its sums come out NaN through sx)
          for (int64_t d = 0; d < D; ++d) std::fill(q + d * w.Kp + k0, q + d * w.Kp + k0 + w.group, int8_t(0));
          if (finite && D == 2)
            sum = round_digits(xr, k1 - k0, inv, q + k0, q + w.Kp + k0);
          else if (finite)
            sum = aotlm_i8::round_i8(xr, k1 - k0, inv, q + k0);
          sx[r * G + g] = finite ? s : std::numeric_limits<float>::quiet_NaN();  // inf/NaN in: NaN out
          xs[r * G + g] = sx[r * G + g] * float(sum), xi[r * G + g] = sum;
        }
  };
  if (M <= 16) return part(0, M);  // decode rows: on the calling thread
  const int64_t n = std::min<int64_t>(M, 32);
  aotlm::parallel_for(int(n), [&](int c) { part(M * c / n, M * (c + 1) / n); });
}
