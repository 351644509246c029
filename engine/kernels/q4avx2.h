// The AVX2 build's row kernel of int4.h (included by it inside namespace aotlm_q4, in place of the
// AVX-512 one): panel_rows on two vectors of 8 columns, with the same operations in the same order.
#pragma once

constexpr int MR_MAX = 2;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// AVX2: the same on two vectors of 8 columns (bytes 0-31 of a block: columns 0-7; the K6 form's high
// bits: the low nibbles of its 32 bytes, then the high ones; Q5_K's and the Q5 forms': shifts 0 / 2, then 4 / 6).
template <int MR, int HB, int D>
inline void panel_rows(const int8_t* xq, const float* sx, const float* xs, const int32_t* xi, int64_t G, const W4& w,
                       int64_t p, float* out, int64_t ld) {
  const uint8_t* panel = w.q + p * (w.Kp / B) * 64, *ps = w.scales(p);
  const int64_t per = 256 / w.group;
  const __m256i lo4 = _mm256_set1_epi8(15);
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  const int64_t gb = w.group / B;
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[MR][D][2];
    for (int m = 0; m < MR; ++m)
      for (int d = 0; d < D; ++d)
        acc[m][d][0] = acc[m][d][1] = _mm256_set1_epi32(HB == 2 && d == D - 1 ? -32 * xi[m * G + g] : 0);
    for (int64_t j = g * gb; j < (g + 1) * gb; ++j) {
      const uint8_t* r = panel + j * 64;
      _mm_prefetch(reinterpret_cast<const char*>(r) + PFB, _MM_HINT_T0);
      for (int v = 0; v < 2; ++v) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 32 * v));
        __m256i lo = _mm256_and_si256(b, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4);
        if constexpr (HB == 1 || HB >= 3) {
          const __m256i h = _mm256_broadcastsi128_si256(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + high_row<HB>(j) * P)));
          const __m256i z = _mm256_srlv_epi32(h, v ? _mm256_set_epi32(6, 6, 6, 6, 4, 4, 4, 4) : _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0));
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(z, _mm256_set1_epi8(1)), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(z, _mm256_set1_epi8(2)), 3));
        }
        if constexpr (HB == 2) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ps + (j / 32) * K6 * P + (18 + 2 * (j % 32)) * P));
          const __m256i z = _mm256_and_si256(v ? _mm256_srli_epi16(h, 4) : h, lo4);
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(z, _mm256_set1_epi8(3)), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(z, _mm256_set1_epi8(12)), 2));
        }
        for (int m = 0; m < MR; ++m)
          for (int d = 0; d < D; ++d) {
            const int8_t* x = xq + (m * D + d) * w.Kp + j * B;
            __m256i& a = acc[m][d][v];
            a = dot4(dot4(a, lo, _mm256_set1_epi32(x4(x))), hi, _mm256_set1_epi32(x4(x + 4)));
          }
      }
    }
    for (int v = 0; v < 2; ++v) {
      __m256 s, mn;
      if constexpr (HB >= 3) {  // a Q5 form's f16 d (and m) per group
        const uint8_t* b = ps + g * Q5R<HB> * P;
        const __m256i d = f16_planes(b, b + P);
        s = _mm256_cvtph_ps(v ? _mm256_extracti128_si256(d, 1) : _mm256_castsi256_si128(d));
        const __m256i m = f16_planes(b + 2 * P, b + 3 * P);
        mn = HB == 4 ? _mm256_cvtph_ps(v ? _mm256_extracti128_si256(m, 1) : _mm256_castsi256_si128(m))
                     : _mm256_mul_ps(s, _mm256_set1_ps(-16.f));
      } else if (w.k8) {
        const uint8_t* b = ps + (g / per) * w.KR * P;
        const auto half = [&](int row) {  // f16 planes at row, row + 1 -> this vector's 8 as f32
          const __m256i d = f16_planes(b + row * P, b + (row + 1) * P);
          return _mm256_cvtph_ps(v ? _mm256_extracti128_si256(d, 1) : _mm256_castsi256_si128(d));
        };
        const auto i8 = [&](int row) {
          const __m128i x8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + row * P + 8 * v));
          return _mm256_cvtepi32_ps(HB == 2 ? _mm256_cvtepi8_epi32(x8) : _mm256_cvtepu8_epi32(x8));
        };
        s = _mm256_mul_ps(half(16), i8(int(g % per)));
        mn = HB == 2 ? _mm256_mul_ps(s, _mm256_set1_ps(-32.f)) : _mm256_mul_ps(half(18), i8(int(8 + g % per)));
      } else {
        const uint16_t* sg = reinterpret_cast<const uint16_t*>(ps) + g * w.S * P;
        s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 8 * v)));
        mn = w.S == 2 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + P + 8 * v)))
                      : _mm256_mul_ps(s, _mm256_set1_ps(-8.f));
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 sc = _mm256_mul_ps(s, _mm256_set1_ps(sx[m * G + g]));
        const __m256i a0 = acc[m][0][v], t = D == 2 ? _mm256_add_epi32(_mm256_slli_epi32(a0, 8), acc[m][D - 1][v]) : a0;
        f[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, f[m][v]);
        if constexpr (HB != 2) f[m][v] = _mm256_fmadd_ps(_mm256_set1_ps(xs[m * G + g]), mn, f[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + m * ld + 8 * v, f[m][v]);
}
