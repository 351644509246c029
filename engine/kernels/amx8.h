// W8A8 prefill GEMM on AMX tiles (included by gemm512.h inside namespace aotlm_gm, after i8_gemm_vnni; the
// amx build only). tdpbssd multiplies 16 rows x 64 bytes of int8 x (a tile) by 64 rows x 16 columns of
// int8 W (a tile of 16 K-quads x 16 columns x 4 bytes, vnni_regroup's layout without the sign offset) into
// 16 x 16 exact int32 sums: 16,384 multiply-adds per instruction where vpdpbusd does 64. Four sums tiles
// (32 rows x 2 panels) stay in the tile registers over all of K and are stored once. The sums are the
// exact integers i8_gemm_vnni computes and i8_finish scales them the same way, so the result is equal
// bit for bit (a row's output does not depend on which path, or which rows, share its call).
#pragma once

// x [M, K] (int8 here, bf16 bits in amx16.h) -> xp [Mp][Kp] (rows past M and k past K: 0), Kp: K padded
// to the tiles' row of 64 bytes.
template <class T>
inline void amx_pack_x(const T* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp, T* xp) {
  aotlm::parallel_for(int(Mp / 16), [&](int b) {
    for (int64_t m = b * 16; m < b * 16 + 16; ++m) {
      T* dst = xp + m * Kp;
      const int64_t n = m < M ? K : 0;
      if (n) std::memcpy(dst, x + m * K, size_t(n) * sizeof(T));
      std::memset(dst + n, 0, size_t(Kp - n) * sizeof(T));
    }
  });
}

// 32 rows of xp (from a) x panels wb0 and wb1 (wb1 null: one panel) over Kp -> c [32][32] int32.
inline void amx_block(const int8_t* a, int64_t Kp, const uint8_t* wb0, const uint8_t* wb1, int32_t* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += 64) {
    _tile_loadd(4, a + k, int(Kp));
    _tile_loadd(5, a + 16 * Kp + k, int(Kp));
    _tile_loadd(6, wb0 + k * 16, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(2, 5, 6);
    if (wb1) {
      _tile_loadd(7, wb1 + k * 16, 64);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(2, c + 16 * 32, 128);
  if (wb1) {
    _tile_stored(1, c + 16, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// y [M, N] = act((x [M, K] @ W) * sx[m] * scale[n] + bias[n]): i8_gemm_vnni's contract on tiles. Threads
// take panel ranges; per range, MC rows of x at a time (<= 768 KB at GPT-2's widest K: in L2) pass under
// every pair of panels, then those rows are scaled and written.
inline void i8_gemm_amx(const int8_t* x, const float* sx, const int8_t* w, const float* scale, const float* bias,
                        int32_t act, int64_t M, int64_t K, int64_t N, const Out& out) {
  constexpr int64_t MC = 256;
  const int64_t Kh = K / 2, Kp = (K + 63) / 64 * 64, Mp = (M + 31) / 32 * 32;
  int8_t* xp = scratch<int8_t>(size_t(Mp * Kp));
  amx_pack_x(x, M, K, Mp, Kp, xp);
  aotlm_pk::panel_ranges(N / NR, 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * NR, n0 = p0 * NR;
    thread_local std::vector<uint8_t> wb;
    thread_local std::vector<float> buf;
    wb.assign(size_t(2 * Kp * 16), 0);  // two regrouped panels, zero past K
    buf.resize(size_t(std::min(Mp, MC) * ld));
    alignas(64) int32_t c[32 * 32];
    aotlm_amx::config_16x64();
    for (int64_t mc = 0; mc < Mp; mc += MC) {
      const int64_t me = std::min(Mp, mc + MC);
      for (int64_t p = p0; p < p1; p += 2) {
        const bool two = p + 1 < p1;
        vnni_regroup(w + p * Kh * 2 * NR, Kh, wb.data(), false);
        if (two) vnni_regroup(w + (p + 1) * Kh * 2 * NR, Kh, wb.data() + Kp * 16, false);
        for (int64_t m0 = mc; m0 < me; m0 += 32) {
          amx_block(xp + m0 * Kp, Kp, wb.data(), two ? wb.data() + Kp * 16 : nullptr, c);
          for (int64_t r = 0; r < 32; ++r)
            for (int64_t h = 0; h < (two ? 2 : 1); ++h)
              _mm512_storeu_ps(buf.data() + (m0 - mc + r) * ld + (p - p0 + h) * NR,
                               _mm512_cvtepi32_ps(_mm512_load_si512(c + r * 32 + h * 16)));
        }
      }
      for (int64_t m = mc; m < std::min(M, me); ++m)
        i8_finish(buf.data() + (m - mc) * ld, sx[m], scale, bias, act, n0, ld, out, m * N + n0);
    }
    _tile_release();
  });
}
