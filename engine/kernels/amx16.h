// bf16 W panels on AMX tiles (included by gemm512.h inside namespace aotlm_gm, after bf16_gemm_dp; the amx
// build only). tdpbf16ps multiplies 16 rows x 32 bf16 of x (a tile) by 32 rows x 16 columns of W (a tile of
// 16 K-pairs x 16 columns x 2 bf16: the panel layout [Kh][16][2] as stored, 1 KB a tile) into 16 x 16 f32
// sums, each bf16 product exact: 8,192 multiply-adds per instruction where vdpbf16ps does 32.
//
//   x in bf16 (quant="bf16a"): one pass, the products vdpbf16ps forms, f32 sums in another order.
//   x in f32 (bf16 panels under amp="bf16" / quant="bf16"): x is split into three bf16 parts, h = bf16(x),
//     m = bf16(x - h), l = bf16(x - h - m), each difference exact in f32, so h + m + l holds x to 2^-24 of
//     |x| (f32's own precision) and the three passes sum exact products of x's parts and W: the f32-x GEMM
//     of gemm.h within f32 summation error, at three tdpbf16ps passes instead of widening W to f32.
// Tiles treat bf16 denormals as zero (values under 1.2e-38); the split keeps x's infinities (m = l = 0).
#pragma once

namespace aotlm_amx16 {
constexpr int64_t L2_ROWS_BYTES = int64_t(1) << 20;  // x rows kept under a thread's panels (L2 per core)

// f32 -> bf16 (round to nearest even) and back, 16 lanes.
inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// f32 x [M, K] -> three bf16 parts xp, xp + Mp * Kp, xp + 2 * Mp * Kp, each [Mp][Kp] (zero padded).
inline void split3(const float* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp, uint16_t* xp) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  aotlm::parallel_for(int(Mp / 16), [&](int b) {
    for (int64_t m = b * 16; m < b * 16 + 16; ++m) {
      uint16_t* d[3] = {xp + m * Kp, xp + (Mp + m) * Kp, xp + (2 * Mp + m) * Kp};
      const int64_t n = m < M ? K : 0;
      for (int64_t k = 0; k < Kp; k += 16) {
        const __mmask16 in = k >= n ? 0 : k + 16 <= n ? __mmask16(0xffff) : __mmask16((1u << (n - k)) - 1);
        __m512 r = _mm512_maskz_loadu_ps(in, x + m * K + k);
        const __m256i h = round16(r);
        const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(widen16(h)), inf, _CMP_LT_OQ);
        r = _mm512_maskz_sub_ps(finite, r, widen16(h));  // exact; 0 where h is inf or NaN
        const __m256i mid = round16(r);
        const __m256i low = round16(_mm512_sub_ps(r, widen16(mid)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d[0] + k), h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d[1] + k), mid);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d[2] + k), low);
      }
    }
  });
}

// Panel p's K-pairs from pair q0, 16 of them as one B tile: in place, or (past Kh) copied zero-padded to tail.
inline const uint16_t* b_tile(const uint16_t* panel, int64_t Kh, int64_t q0, uint16_t* tail) {
  if (q0 + 16 <= Kh) return panel + q0 * 32;
  std::memset(tail, 0, 16 * 64);
  std::memcpy(tail, panel + q0 * 32, size_t(Kh - q0) * 64);
  return tail;
}

// Rows m0..m0+31 of the P parts (xp, part stride ps) x panels w0 and w1 (w1 null: one panel) over K -> the
// f32 sums c (32 rows, row stride ld floats; the second panel at c + 16).
template <int P>
inline void block(const uint16_t* xp, int64_t ps, int64_t Kp, int64_t Kh, const uint16_t* w0, const uint16_t* w1,
                  float* c, int64_t ld) {
  alignas(64) uint16_t tail[2][16 * 32];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += 32) {
    _tile_loadd(6, b_tile(w0, Kh, k / 2, tail[0]), 64);
    if (w1) _tile_loadd(7, b_tile(w1, Kh, k / 2, tail[1]), 64);
    for (int part = 0; part < P; ++part) {
      const uint16_t* a = xp + part * ps + k;
      _tile_loadd(4, a, int(Kp * 2));
      _tile_loadd(5, a + 16 * Kp, int(Kp * 2));
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if (w1) {
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, c, int(ld * 4));
  _tile_stored(2, c + 16 * ld, int(ld * 4));
  if (w1) {
    _tile_stored(1, c + 16, int(ld * 4));
    _tile_stored(3, c + 16 * ld + 16, int(ld * 4));
  }
}

// y = act(parts @ W * scale[n] + bias[n]) over the packed parts xp (P x [Mp][Kp]): threads take panel
// ranges; per range, as many rows of x as fill L2_ROWS_BYTES pass under every pair of panels, then are
// scaled and written.
template <int P>
inline void gemm(const uint16_t* xp, int64_t M, int64_t Mp, int64_t Kp, const uint16_t* w, const float* scale,
                 const float* bias, int32_t act, int64_t K, int64_t N, const Out& out) {
  const int64_t Kh = K / 2, MC = std::clamp<int64_t>(L2_ROWS_BYTES / (Kp * 2 * P) / 32 * 32, 32, 256);
  aotlm_pk::panel_ranges(N / NR, 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * NR, n0 = p0 * NR;
    thread_local std::vector<float> buf;
    buf.resize(size_t(std::min(Mp, MC) * ld));
    aotlm_amx::config_16x64();
    for (int64_t mc = 0; mc < Mp; mc += MC) {
      const int64_t me = std::min(Mp, mc + MC);
      for (int64_t p = p0; p < p1; p += 2) {
        const uint16_t* w1 = p + 1 < p1 ? w + (p + 1) * Kh * 2 * NR : nullptr;
        for (int64_t m0 = mc; m0 < me; m0 += 32)
          block<P>(xp + m0 * Kp, Mp * Kp, Kp, Kh, w + p * Kh * 2 * NR, w1, buf.data() + (m0 - mc) * ld + (p - p0) * NR,
                   ld);
      }
      for (int64_t m = mc; m < std::min(M, me); ++m)
        bf16_finish(buf.data() + (m - mc) * ld, scale, bias, act, n0, ld, out, m * N + n0);
    }
    _tile_release();
  });
}
}  // namespace aotlm_amx16

// bf16_gemm_dp's contract (bf16 x) on tiles.
inline void bf16_gemm_amx(const uint16_t* x, const uint16_t* w, const float* scale, const float* bias, int32_t act,
                          int64_t M, int64_t K, int64_t N, const Out& out) {
  const int64_t Kp = (K + 31) / 32 * 32, Mp = (M + 31) / 32 * 32;
  uint16_t* xp = scratch<uint16_t>(size_t(Mp * Kp));
  amx_pack_x(x, M, K, Mp, Kp, xp);
  aotlm_amx16::gemm<1>(xp, M, Mp, Kp, w, scale, bias, act, K, N, out);
}

// f32 x times bf16 W panels (gemm.h's contract for them) on tiles, x in three bf16 parts.
inline void f32x_bf16_gemm_amx(const float* x, const uint16_t* w, const float* scale, const float* bias, int32_t act,
                               int64_t M, int64_t K, int64_t N, const Out& out) {
  const int64_t Kp = (K + 31) / 32 * 32, Mp = (M + 31) / 32 * 32;
  uint16_t* xp = scratch<uint16_t>(size_t(3 * Mp * Kp));
  aotlm_amx16::split3(x, M, K, Mp, Kp, xp);
  aotlm_amx16::gemm<3>(xp, M, Mp, Kp, w, scale, bias, act, K, N, out);
}
