// AVX-512 variant of packed.h's int8 row kernel (included by packed.h inside namespace aotlm_pk, after
// panel_rows). Compiled only into the avx512 levels' builds (aotlm.kernels.isa).
#pragma once

#if defined(__AVX512BW__)
// panel_rows on 512-bit registers (the avx512 builds): a pair of rows x 16 columns is one vpmovsxbw
// zmm, so a row of x costs one broadcast and one vpdpwssd (vpmaddwd + vpaddd without AVX512-VNNI)
// per 32 multiply-adds, against two of each on 256 bits, and 32 registers hold up to 8 rows' sums
// (SmolLM2-135M's decode matmuls, same process: 1.05-1.27x faster at 1-16 rows).
// The same exact int32 sums per KB_PAIRS block as panel_rows, flushed to f32 in the same order:
// the results equal the AVX2 build's bit for bit.
inline __m512i madd_add512(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

template <int MR>
inline void panel_rows_z(const int16_t* xq, int64_t Kp, const int8_t* panel, int64_t Kh, float* out, int64_t ld) {
  constexpr int A = MR <= 2 ? 2 : 1;  // few rows: even and odd pairs in separate sums (the add latency)
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < Kh; j0 += KB_PAIRS) {
    const int64_t j1 = std::min(Kh, j0 + KB_PAIRS);
    __m512i acc[MR][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_si512();
    const auto step = [&](int64_t j, int a) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 2 * P)));
      for (int m = 0; m < MR; ++m) {
        int32_t x2;
        std::memcpy(&x2, xq + m * Kp + 2 * j, 4);
        acc[m][a] = madd_add512(acc[m][a], w, _mm512_set1_epi32(x2));
      }
    };
    int64_t j = j0;
    for (; j + 1 < j1; j += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + j * 2 * P + PFB), _MM_HINT_T0);
      step(j, 0);
      step(j + 1, A - 1);
    }
    if (j < j1) step(j, 0);
    for (int m = 0; m < MR; ++m) {
      const __m512i s = A == 2 ? _mm512_add_epi32(acc[m][0], acc[m][A - 1]) : acc[m][0];
      f[m] = _mm512_add_ps(f[m], _mm512_cvtepi32_ps(s));
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * ld, f[m]);
}

// rows() on panel_rows_z: groups of <= 8 rows (16 sums + 1 weight vector + 1 broadcast of 32 registers).
inline void rows_z(const int16_t* xq, int64_t Kp, int64_t M, const int8_t* wp, int64_t Kh, int64_t p0, int64_t p1,
                   float* buf, int64_t ld) {
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* panel = wp + p * Kh * 2 * P;
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int mr = left >= 8 ? 8 : int(left);
      const int16_t* x = xq + m0 * Kp;
      float* o = buf + m0 * ld + (p - p0) * P;
      switch (mr) {
        case 1: panel_rows_z<1>(x, Kp, panel, Kh, o, ld); break;
        case 2: panel_rows_z<2>(x, Kp, panel, Kh, o, ld); break;
        case 3: panel_rows_z<3>(x, Kp, panel, Kh, o, ld); break;
        case 4: panel_rows_z<4>(x, Kp, panel, Kh, o, ld); break;
        case 5: panel_rows_z<5>(x, Kp, panel, Kh, o, ld); break;
        case 6: panel_rows_z<6>(x, Kp, panel, Kh, o, ld); break;
        case 7: panel_rows_z<7>(x, Kp, panel, Kh, o, ld); break;
        default: panel_rows_z<8>(x, Kp, panel, Kh, o, ld); break;
      }
      m0 += mr;
    }
  }
}

#if defined(__AVX512VNNI__)
// W8A8 decode rows (a8, quant="w8a8"): x rounded to int8 per row (xq [M, Kq], zero padded) times the
// panel's int8 W on vpdpbusd, 4 multiply-adds per int32 lane against vpdpwssd's 2 on int16 x: the
// 16-row steps of SmolLM2-135M were compute-bound on the int16 products. Each 64-byte line (pairs
// 2q, 2q + 1) is regrouped in registers as gemm512.h's vnni_regroup does (one vpermw: a column's 4
// rows in one lane; xor 0x80: w + 128 unsigned), and corr[m] = 128 * sum_k xq[m, k] is taken off:
// one exact int32 sum per row and column over all K (|sum| <= 255 * 127 * K < 2^31 for K < 66,000;
// run_s8 takes the int16 route above that), so a row's result does not depend on the other rows.
template <int MR>
inline void panel_rows_s8(const int8_t* xq, int64_t Kq, const int8_t* panel, int64_t Kh, const int32_t* corr,
                          float* out, int64_t ld) {
  constexpr int A = MR <= 2 ? 2 : 1;  // few rows: even and odd lines in separate sums (the latency)
  alignas(64) static const int16_t idx[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                              8,  24, 9,  25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(idx), flip = _mm512_set1_epi8(char(0x80));
  __m512i acc[MR][A];
  for (int m = 0; m < MR; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_si512();
  const auto line = [&](int64_t j, __mmask64 in, int a) {  // pairs j, j + 1 = rows 2j..2j+3 = x's quad j / 2
    const __m512i v = _mm512_maskz_loadu_epi8(in, panel + j * 2 * P);
    const __m512i w = _mm512_xor_si512(_mm512_permutexvar_epi16(perm, v), flip);
    for (int m = 0; m < MR; ++m) {
      int32_t x4;
      std::memcpy(&x4, xq + m * Kq + 2 * j, 4);
      acc[m][a] = _mm512_dpbusd_epi32(acc[m][a], w, _mm512_set1_epi32(x4));
    }
  };
  int64_t j = 0;
  for (; j + 3 < Kh; j += 4) {  // two lines per iteration, one prefetch each
    _mm_prefetch(reinterpret_cast<const char*>(panel + j * 2 * P + PFB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + j * 2 * P + PFB + 64), _MM_HINT_T0);
    line(j, ~__mmask64(0), 0);
    line(j + 2, ~__mmask64(0), A - 1);
  }
  for (; j < Kh; j += 2) line(j, j + 1 < Kh ? ~__mmask64(0) : __mmask64(0xffffffffu), 0);  // an odd Kh: 0s
  for (int m = 0; m < MR; ++m) {
    const __m512i s = A == 2 ? _mm512_add_epi32(acc[m][0], acc[m][A - 1]) : acc[m][0];
    _mm512_storeu_ps(out + m * ld, _mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_set1_epi32(corr[m]))));
  }
}

// rows_z for int8 x: groups of <= 8 rows per panel.
inline void rows_s8(const int8_t* xq, int64_t Kq, int64_t M, const int32_t* corr, const int8_t* wp, int64_t Kh,
                    int64_t p0, int64_t p1, float* buf, int64_t ld) {
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* panel = wp + p * Kh * 2 * P;
    for (int64_t m0 = 0; m0 < M;) {
      const int mr = M - m0 >= 8 ? 8 : int(M - m0);
      const int8_t* x = xq + m0 * Kq;
      float* o = buf + m0 * ld + (p - p0) * P;
      switch (mr) {
        case 1: panel_rows_s8<1>(x, Kq, panel, Kh, corr + m0, o, ld); break;
        case 2: panel_rows_s8<2>(x, Kq, panel, Kh, corr + m0, o, ld); break;
        case 3: panel_rows_s8<3>(x, Kq, panel, Kh, corr + m0, o, ld); break;
        case 4: panel_rows_s8<4>(x, Kq, panel, Kh, corr + m0, o, ld); break;
        case 5: panel_rows_s8<5>(x, Kq, panel, Kh, corr + m0, o, ld); break;
        case 6: panel_rows_s8<6>(x, Kq, panel, Kh, corr + m0, o, ld); break;
        case 7: panel_rows_s8<7>(x, Kq, panel, Kh, corr + m0, o, ld); break;
        default: panel_rows_s8<8>(x, Kq, panel, Kh, corr + m0, o, ld); break;
      }
      m0 += mr;
    }
  }
}
#endif  // __AVX512VNNI__
#endif
