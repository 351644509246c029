// int8 W panels times x rounded to int16 (quant="int8" prefill rows) on AMX tiles (included by wmatmul.cc
// after gemm.h, inside namespace aotlm_pk as packed.h's run declares it; the amx build only). Each int16 of
// x is two bytes, x = 256 * hi + lo (hi signed, lo unsigned): tdpbssd multiplies hi and tdpbusd lo by the
// panel's int8 W (regrouped in quads as i8_gemm_amx regroups it), 16,384 multiply-adds each per instruction
// where vpdpwssd does 32. Per KB_PAIRS block of K (256 rows) the two int32 sums give the block's exact sum
// 256 * hi + lo (|sum| <= 32767 * 127 * 256 < 2^31) and it is added to the row's f32 sum in the order
// panel_rows adds it, so the results equal the row kernels' bit for bit (prefill rows as decode rows).
#pragma once

namespace aotlm_pk {
// xq [M, Kp] int16 -> hi (int8) and lo (uint8) digits, each [Mp][Kt] (rows past M and k past K: 0).
inline void amx_digits(const int16_t* xq, int64_t M, int64_t K, int64_t Kp, int64_t Mp, int64_t Kt, int8_t* hi,
                       uint8_t* lo) {
  aotlm::parallel_for(int(Mp / 16), [&](int b) {
    for (int64_t m = b * 16; m < b * 16 + 16; ++m) {
      const int64_t n = m < M ? K : 0;
      for (int64_t k = 0; k < Kt; k += 32) {
        const __mmask32 in = k >= n ? 0 : k + 32 <= n ? ~__mmask32(0) : __mmask32((1u << (n - k)) - 1);
        const __m512i v = _mm512_maskz_loadu_epi16(in, xq + m * Kp + k);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + m * Kt + k), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + m * Kt + k),
                            _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xff))));
      }
    }
  });
}

// Rows m0..m0+31 (hi / lo at row m0, stride Kt) x one regrouped panel wb -> f[32][16] unscaled f32 sums.
inline void amx_i16_block(const int8_t* hi, const uint8_t* lo, int64_t Kt, const uint8_t* wb, float* f) {
  alignas(64) int32_t s[4][16 * 16];
  for (int64_t i = 0; i < 32 * 16; i += 16) _mm512_store_ps(f + i, _mm512_setzero_ps());
  for (int64_t kb = 0; kb < Kt; kb += 2 * KB_PAIRS) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = kb; k < std::min(Kt, kb + 2 * KB_PAIRS); k += 64) {
      _tile_loadd(6, wb + k * 16, 64);
      _tile_loadd(4, hi + k, int(Kt));
      _tile_loadd(5, lo + k, int(Kt));
      _tile_dpbssd(0, 4, 6);
      _tile_dpbusd(1, 5, 6);
      _tile_loadd(4, hi + 16 * Kt + k, int(Kt));
      _tile_loadd(5, lo + 16 * Kt + k, int(Kt));
      _tile_dpbssd(2, 4, 6);
      _tile_dpbusd(3, 5, 6);
    }
    _tile_stored(0, s[0], 64);
    _tile_stored(1, s[1], 64);
    _tile_stored(2, s[2], 64);
    _tile_stored(3, s[3], 64);
    for (int64_t r = 0; r < 32; ++r) {
      const int h = r < 16 ? 0 : 2, i = int(r % 16) * 16;
      const __m512i sum =
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(s[h] + i), 8), _mm512_load_si512(s[h + 1] + i));
      _mm512_store_ps(f + r * 16, _mm512_add_ps(_mm512_load_ps(f + r * 16), _mm512_cvtepi32_ps(sum)));
    }
  }
}

// run()'s int16-x path on tiles: x rounded per row as quantize_rows rounds it, then drive()'s threads take
// panel ranges; per range every panel is regrouped once, and blocks of up to 128 rows of the digits (in L2)
// pass under each panel.
void i16_rows_amx(const float* x, const int8_t* w, const float* scale, const float* bias, int32_t act, int64_t M,
                  int64_t K, int64_t N, const Out& out) {
  const int64_t Kp = (K + 16) / 16 * 16, Kt = (K + 63) / 64 * 64, Mp = (M + 31) / 32 * 32, Kh = K / 2;
  std::vector<int16_t> xq(static_cast<size_t>(M * Kp));
  std::vector<float> sx(static_cast<size_t>(M));
  aotlm::parallel_for(int((M + 15) / 16), [&](int b) {  // each row as quantize_rows rounds it, 16 per part
    const int64_t m0 = b * 16;
    aotlm_i8::quantize_rows(x + m0 * K, std::min<int64_t>(16, M - m0), K, Kp, xq.data() + m0 * Kp, sx.data() + m0);
  });
  std::vector<int8_t> hi(static_cast<size_t>(Mp * Kt));
  std::vector<uint8_t> lo(static_cast<size_t>(Mp * Kt));
  amx_digits(xq.data(), M, K, Kp, Mp, Kt, hi.data(), lo.data());
  drive(M, N, sx.data(), scale, bias, act, out, [&](int64_t p0, int64_t p1, float* buf, int64_t ld) {
    thread_local std::vector<uint8_t> wb;
    wb.assign(size_t((p1 - p0) * Kt * 16), 0);  // the range's panels regrouped, zero past K
    for (int64_t p = p0; p < p1; ++p)
      aotlm_gm::vnni_regroup(w + p * Kh * 2 * P, Kh, wb.data() + (p - p0) * Kt * 16, false);
    alignas(64) float f[32 * 16];
    aotlm_amx::config_16x64();
    for (int64_t mc = 0; mc < Mp; mc += 128)
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t m0 = mc; m0 < std::min(Mp, mc + 128); m0 += 32) {
          amx_i16_block(hi.data() + m0 * Kt, lo.data() + m0 * Kt, Kt, wb.data() + (p - p0) * Kt * 16, f);
          for (int64_t r = 0; r < std::min<int64_t>(32, M - m0); ++r)
            std::memcpy(buf + (m0 + r) * ld + (p - p0) * P, f + r * 16, 16 * sizeof(float));
        }
    _tile_release();
  });
}
}  // namespace aotlm_pk
