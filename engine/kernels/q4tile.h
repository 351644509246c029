// The AVX-512 builds' pieces of int4.h (included by it inside namespace aotlm_q4, after dot4): the high
// bits of 5- and 6-bit codes, a group's scales, and the prompt tiles.
//
// Prompt tiles (more than MAX_TILE_ROWS rows of x in a call): panel_rows unpacks every 64-byte block
// of codes again for each group of up to 8 rows (the 5- and 6-bit codes' high bits too) and feeds each
// broadcast of x to one vpdpbusd (figures: the kernels README, "4-bit weights"). Here a pair of panels
// is unpacked once per chunk of rows into whole bytes, vnni_regroup's layout ([K / 4][64]: step q is
// rows 4q..4q+3 of the 16 columns), x is packed per 6 rows as [K / 4][6][4] (vnni_pack_x's order), and
// a 6 x 32 tile keeps 12 int32 group sums and 12 f32 rows in registers: each broadcast of x feeds two
// vpdpbusd. The group sums are exact and each group is flushed into the f32 rows with panel_rows'
// operations in its order, so a row's result is the same bits either way (tests/kernels/test_q4.py
// checks prompt rows against decode rows).
#pragma once

// The K6 form's high bits of block j (its 32 bytes at h) added above the low codes lo / hi (int4.h top).
inline void or_bits(__m512i& q, __m512i v, char mask) {  // q |= v & mask (per byte), one vpternlogd
  q = _mm512_ternarylogic_epi32(q, v, _mm512_set1_epi8(mask), 0xF8);
}

inline void high2(const uint8_t* h, __m512i& lo, __m512i& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
  or_bits(lo, _mm512_slli_epi16(z, 4), 0x30), or_bits(hi, _mm512_slli_epi16(z, 2), 0x30);
}

// The Q5_K form's high bits of block j (its 16 bytes at h) added above the low codes lo / hi.
inline void high1(const uint8_t* h, __m512i& lo, __m512i& hi) {
  const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  const __m512i z = _mm512_srlv_epi32(b, _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0));
  or_bits(lo, _mm512_slli_epi16(z, 4), 0x10), or_bits(hi, _mm512_slli_epi16(z, 3), 0x10);
}

// Block j's codes of a panel (its 64 bytes at r, its scales at ps) -> lo (rows 8j..8j+3), hi (8j+4..8j+7).
template <int HB>
inline void codes(const uint8_t* r, const uint8_t* ps, int64_t j, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_loadu_si512(r), lo4 = _mm512_set1_epi8(15);
  lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
  if constexpr (HB == 2) high2(ps + (j / 32) * K6 * P + (18 + 2 * (j % 32)) * P, lo, hi);
  if constexpr (HB == 1 || HB >= 3) high1(ps + high_row<HB>(j) * P, lo, hi);
}

// Scale s and minimum mn of group g for a panel's 16 columns (its scales at ps), g = 0, 1, .. in turn:
// a K form's super-scale kd and -dmin kn are read at each 256 rows' first group and kept.
template <int HB>
inline void group_scales(const W4& w, const uint8_t* ps, int64_t g, __m512& kd, __m512& kn, __m512& s, __m512& mn) {
  if constexpr (HB >= 3) {  // Q5_0 / Q5_1: f16 d (and m) per group of 32 as byte planes
    const uint8_t* b = ps + g * Q5R<HB> * P;
    s = _mm512_cvtph_ps(f16_planes(b, b + P));
    mn = HB == 4 ? _mm512_cvtph_ps(f16_planes(b + 2 * P, b + 3 * P)) : _mm512_mul_ps(s, _mm512_set1_ps(-16.f));
    return;
  }
  if (w.k8) {
    const int64_t per = 256 / w.group;  // groups per 256 rows
    const uint8_t* b = ps + (g / per) * w.KR * P;
    if (g % per == 0) kd = _mm512_cvtph_ps(f16_planes(b + 16 * P, b + 17 * P));
    if (g % per == 0 && HB != 2) kn = _mm512_cvtph_ps(f16_planes(b + 18 * P, b + 19 * P));
    const auto i8 = [&](int row) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + row * P));
      return _mm512_cvtepi32_ps(HB == 2 ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
    };
    s = _mm512_mul_ps(kd, i8(int(g % per)));
    mn = HB == 2 ? _mm512_mul_ps(s, _mm512_set1_ps(-32.f)) : _mm512_mul_ps(kn, i8(int(8 + g % per)));
    return;
  }
  const uint16_t* sg = reinterpret_cast<const uint16_t*>(ps) + g * w.S * P;
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
  mn = w.S == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + P)))
                : _mm512_mul_ps(s, _mm512_set1_ps(-8.f));
}

constexpr int64_t TR = 6;              // rows of x per prompt tile
constexpr int64_t MAX_TILE_ROWS = 16;  // calls of more rows take the tiles (decode's row counts never do)

// Whether the tiles take a group of this size (a group's steps of 4 rows are unrolled: 16 to 128 rows).
inline bool tiles_take(int64_t group) { return group == 16 || group == 32 || group == 64 || group == 128; }

// fn(integral_constant<int, HB>, integral_constant<int, GQ>) for w's high bits and group / 4.
template <class Fn>
inline void with_form(const W4& w, Fn&& fn) {
  const auto steps = [&](auto hb) {
    if constexpr (decltype(hb)::value >= 3) {
      fn(hb, std::integral_constant<int, 8>{});  // Q5_0 / Q5_1: groups of 32
    } else {
      switch (w.group) {
        case 16: return fn(hb, std::integral_constant<int, 4>{});
        case 32: return fn(hb, std::integral_constant<int, 8>{});
        case 64: return fn(hb, std::integral_constant<int, 16>{});
        default: return fn(hb, std::integral_constant<int, 32>{});  // 128 (tiles_take)
      }
    }
  };
  with_bits(w, steps);
}

// xq [M, Kp] int8 -> xp [ceil(M / 6)][Kp / 4][6][4] (rows past M: 0), tiles in parallel.
inline void pack_x6(const int8_t* xq, int64_t M, int64_t Kp, int8_t* xp) {
  const int64_t K4 = Kp / 4, T = (M + TR - 1) / TR;
  aotlm::parallel_for(int(T), [&](int t) {
    int8_t* dst = xp + t * K4 * TR * 4;
    for (int64_t r = 0; r < TR; ++r) {
      const int64_t m = t * TR + r;
      for (int64_t q = 0; q < K4; ++q) {
        if (m < M)
          std::memcpy(dst + (q * TR + r) * 4, xq + m * Kp + 4 * q, 4);
        else
          std::memset(dst + (q * TR + r) * 4, 0, 4);
      }
    }
  });
}

// Panel p's codes -> u [Kp / 4][64] whole bytes (step 2j: block j's lo, 2j + 1: its hi).
template <int HB>
inline void unpack_panel(const W4& w, int64_t p, uint8_t* u) {
  const uint8_t* panel = w.q + p * (w.Kp / B) * 64, *ps = w.scales(p);
  for (int64_t j = 0; j < w.Kp / B; ++j) {
    __m512i lo, hi;
    codes<HB>(panel + j * 64, ps, j, lo, hi);
    _mm512_storeu_si512(u + 2 * j * 64, lo);
    _mm512_storeu_si512(u + (2 * j + 1) * 64, hi);
  }
}

// One tile: 6 packed rows (xp [Kp / 4][6][4]) x NP unpacked panels p.. (u [NP][Kp / 4][64]) -> out[m * ld +
// 0..16 NP) for rows m < mr of x (6 / D of them: D = 2, a row's two digits in packed rows 2m, 2m + 1, the
// first's sums shifted 8 bits up). sx / xs / xi: the rows' per-group values at m * G + g.
template <int HB, int NP, int GQ, int D>
inline void tile6(const int8_t* xp, const uint8_t* u, const float* sx, const float* xs, const int32_t* xi, int64_t G,
                  int64_t mr, const W4& w, int64_t p, float* out, int64_t ld) {
  const int64_t K4 = w.Kp / 4;
  const uint8_t *ps0 = w.scales(p), *ps1 = w.scales(p + NP - 1), *u1 = u + (NP - 1) * K4 * 64;
  int64_t ro[TR];  // a row's offset into sx / xs / xi (rows past mr: the last real one's)
  for (int64_t m = 0; m < TR; ++m) ro[m] = std::min(m / D, mr - 1) * G;  // packed row m's row of x
  const __m512 z = _mm512_setzero_ps();
  __m512 e0 = z, e1 = z, e2 = z, e3 = z, e4 = z, e5 = z, h0 = z, h1 = z, h2 = z, h3 = z, h4 = z, h5 = z;
  __m512 kd0 = z, kn0 = z, kd1 = z, kn1 = z;
  for (int64_t g = 0; g < G; ++g) {
    const auto init = [&](int m) {  // Q6_K's offset: in the last digit's sums
      return _mm512_set1_epi32(HB == 2 && m % D == D - 1 ? -32 * xi[ro[m] + g] : 0);
    };
    __m512i c0 = init(0), c1 = init(1), c2 = init(2), c3 = init(3), c4 = init(4), c5 = init(5);
    __m512i d0 = c0, d1 = c1, d2 = c2, d3 = c3, d4 = c4, d5 = c5;
#pragma GCC unroll 32
    for (int64_t q = g * GQ; q < (g + 1) * GQ; ++q) {
      const __m512i w0 = _mm512_loadu_si512(u + q * 64), w1 = NP == 2 ? _mm512_loadu_si512(u1 + q * 64) : w0;
      const int8_t* aq = xp + q * TR * 4;
#define AOTLM_Q4DP(m, c, d)                          \
  {                                                  \
    const __m512i xb = _mm512_set1_epi32(x4(aq + 4 * m)); \
    c = dot4(c, w0, xb);                             \
    if constexpr (NP == 2) d = dot4(d, w1, xb);      \
  }
      AOTLM_Q4DP(0, c0, d0)
      AOTLM_Q4DP(1, c1, d1)
      AOTLM_Q4DP(2, c2, d2)
      AOTLM_Q4DP(3, c3, d3)
      AOTLM_Q4DP(4, c4, d4)
      AOTLM_Q4DP(5, c5, d5)
#undef AOTLM_Q4DP
    }
    __m512 s0, mn0, s1 = z, mn1 = z;
    group_scales<HB>(w, ps0, g, kd0, kn0, s0, mn0);
    if constexpr (NP == 2) group_scales<HB>(w, ps1, g, kd1, kn1, s1, mn1);
    const auto flush = [&](int m, __m512i a, __m512& f, __m512 s, __m512 mn) {  // panel_rows' operations
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, _mm512_set1_ps(sx[ro[m] + g])), f);
      if constexpr (HB != 2) f = _mm512_fmadd_ps(_mm512_set1_ps(xs[ro[m] + g]), mn, f);
    };
    if constexpr (D == 2) {  // row m of x: packed rows 2m (shifted) and 2m + 1
      const auto two = [](__m512i a, __m512i b) { return _mm512_add_epi32(_mm512_slli_epi32(a, 8), b); };
      flush(0, two(c0, c1), e0, s0, mn0), flush(2, two(c2, c3), e1, s0, mn0), flush(4, two(c4, c5), e2, s0, mn0);
      if constexpr (NP == 2)
        flush(0, two(d0, d1), h0, s1, mn1), flush(2, two(d2, d3), h1, s1, mn1), flush(4, two(d4, d5), h2, s1, mn1);
    } else {
      flush(0, c0, e0, s0, mn0), flush(1, c1, e1, s0, mn0), flush(2, c2, e2, s0, mn0);
      flush(3, c3, e3, s0, mn0), flush(4, c4, e4, s0, mn0), flush(5, c5, e5, s0, mn0);
      if constexpr (NP == 2) {
        flush(0, d0, h0, s1, mn1), flush(1, d1, h1, s1, mn1), flush(2, d2, h2, s1, mn1);
        flush(3, d3, h3, s1, mn1), flush(4, d4, h4, s1, mn1), flush(5, d5, h5, s1, mn1);
      }
    }
  }
  const __m512 es[TR] = {e0, e1, e2, e3, e4, e5}, hs[TR] = {h0, h1, h2, h3, h4, h5};
  for (int64_t m = 0; m < mr; ++m) {
    _mm512_storeu_ps(out + m * ld, es[m]);
    if constexpr (NP == 2) _mm512_storeu_ps(out + m * ld + P, hs[m]);
  }
}

// M rows of x packed (xp: D rows each, from row 0 of sx / xs / xi) x panels [p0, p1) -> buf[m * ld + (p - p0) *
// 16 + c]: each pair of panels unpacked once, then every tile of 6 packed rows under it.
template <int HB, int GQ, int D>
inline void tile_rows(const int8_t* xp, const float* sx, const float* xs, const int32_t* xi, int64_t G, int64_t M,
                      const W4& w, int64_t p0, int64_t p1, float* buf, int64_t ld) {
  constexpr int64_t TM = TR / D;  // rows of x per tile
  const int64_t K4 = w.Kp / 4, T = (M + TM - 1) / TM;
  thread_local std::vector<uint8_t> u;
  u.resize(size_t(2 * K4 * 64));
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    unpack_panel<HB>(w, p, u.data());
    if (two) unpack_panel<HB>(w, p + 1, u.data() + K4 * 64);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t m0 = t * TM, mr = std::min(TM, M - m0);
      float* o = buf + m0 * ld + (p - p0) * P;
      const int8_t* x = xp + t * K4 * TR * 4;
      if (two)
        tile6<HB, 2, GQ, D>(x, u.data(), sx + m0 * G, xs + m0 * G, xi + m0 * G, G, mr, w, p, o, ld);
      else
        tile6<HB, 1, GQ, D>(x, u.data(), sx + m0 * G, xs + m0 * G, xi + m0 * G, G, mr, w, p, o, ld);
    }
  }
}
