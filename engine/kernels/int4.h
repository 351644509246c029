// 4-bit weights in groups along K (quant="int4", models/quant4.py), included by wmatmul.cc after packed.h.
//
//   aotlm_wmm_q4:  y[M,N] = act(x[M,K] @ W[K,N] (+ bias)),  W[k,n] = s[g,n] * q[k,n] + m[g,n],  g = k / group
//
// q is 0..15; symmetric groups have no m and mean m = -8 s (Q4_0's w = d (q - 8)), asymmetric ones
// store it (Q4_1, Q4_K: w = d q + m). Scales and minimums are f16 [Np / 16][G][S][16] (S = 1 or 2:
// scale, then minimum; G = Kp / group): panel-major, each panel's a stream of its own beside its codes
// (models/packing.py pack_scales; in [G][S][Np] a panel read its scales a cache line Np apart per group,
// between its code stream's lines). Layout of q: panels of 16 columns (as packed.h's), each a stream of
// Kp / 8 blocks of 64 bytes; byte 4c + t of block j holds column c's q[8j + t] (low nibble) and
// q[8j + 4 + t] (high nibble), so ``v & 15`` and ``(v >> 4) & 15`` are each 16 lanes of 4 consecutive
// rows of one column: the operands of vpdpbusd (Kp = K up to the group, Np = N up to 16; padded
// rows multiply zeros, padded columns are not written).
//
// A GGUF Q4_K matrix keeps its own scales instead (the "K form", models/kscales.py): sm is uint8
// [Np / 16][G / 8][20][16] -- per panel and 256 rows, 8 rows of 6-bit sub-scales sc, 8 of sub-minimums
// mb, then the low and high bytes of the f16 super-scale d and of the f16 -dmin -- and a group's
// s = d * sc, m = -dmin * mb (each exact in f32, as gguf-py computes them): 0.625 bits a weight
// instead of 1.
//
// A GGUF Q6_K matrix (the "K6 form", models/k6scales.py): 6-bit codes q (0..63), w = d * sc * (q - 32)
// per group of 16 rows (sc int8, d f16 per 256 rows). The code panels hold the low 4 bits as above; sm
// is uint8 [Np / 16][K / 256][82][16]: rows 0-15 the groups' sc, 16 / 17 the low / high byte of d, then
// the high 2 bits of the block's codes, 32 bytes per block j of 8 rows (rows 18 + 2j, 19 + 2j): byte i's
// low nibble belongs to lane i of the block's 64, its high nibble to lane i + 32 (lane 4c + t: column
// c, rows 8j + t in bits 0-1, 8j + 4 + t in bits 2-3), so two shifts and masks put them over the lanes
// of ``v & 15`` and ``v >> 4``: 6.5625 bits a weight, as the file. A Q5_K matrix (5-bit codes, Q4_K's
// scales): sm is [Np / 16][K / 256][52][16], the K form's 20 rows, then the codes' high bits, 16 bytes per
// block j (row 20 + j): byte i holds lane i + 16m in bits 2m (row 8j + t) and 2m + 1 (row 8j + 4 + t).
// A Q5_0 / Q5_1 matrix (5-bit codes, w = d (q - 16) / d q + m per group of 32, the "Q5 form",
// models/q5scales.py): sm is uint8 [Np / 16][Kp / 32][R][16], per group the low and high bytes of the f16
// d (rows 0 / 1), Q5_1's of m (2 / 3), then its 4 blocks' high bits as Q5_K's (rows R - 4 + j % 4):
// R = 6 or 8, 5.5 / 6 bits a weight as the file's blocks.
//
// Math, as llama.cpp multiplies its Q4 blocks: each row of x is rounded to int8 per group (scale
// sx = max|x| / 127 over the group's K rows), the 4-bit codes times the int8 x summed in int32
// (vpdpbusd: u8 x s8, 4 products per lane; without VNNI vpmaddubsw + vpmaddwd, which cannot
// saturate here: 2 * 15 * 127 < 2^15), and per group and column
//   y += s * sx * sum_k xq[k] q[k] + m * sx * sum_k xq[k],
// i.e. exactly (xq * sx) @ W in real arithmetic; the XLA fallback (models/quant4.py) rounds x the
// same way and dots it with the dequantized W. Closer x (q4x.h): int16 per group (sx = max|x| / 32639)
// as two int8 digits h, l (x = sx (256 h + l)), whose sums are added as 256 sum(q h) + sum(q l), exact in
// int32 (|256 * 128 * 15 * 128| < 2^31 for a group of 128), then flushed as above: 2x the vpdpbusd; or
// three int8 parts, each flushed (3x). Why integers: widening every nibble to f32 for an FMA
// (7 vector ops per 32 weights) kept GPT-2-small's decode compute-bound at ~5 GB/s; here one
// 64-byte block (128 weights) is 1 load, 3 logic ops and 2 vpdpbusd per row of x.
#pragma once

namespace aotlm_q4 {
constexpr int64_t P = 16;     // columns per panel
constexpr int64_t B = 8;      // rows per 64-byte block
constexpr int64_t PFB = 1024;  // prefetch distance in the panel stream (bytes)
constexpr int64_t ROWS = 64;  // rows of x per pass over a panel range (bounds the sums buffer)
constexpr int64_t TILE_ROWS = 132;  // the prompt tiles: a 128-token prompt in one pass; whole tiles of 6 at 1-3 parts
constexpr int64_t K4 = 20, K5 = 52, K6 = 82;  // rows of 16 bytes per 256 rows of W: Q4_K's, Q5_K's, Q6_K's
constexpr int64_t Q50 = 6, Q51 = 8;            // rows of 16 bytes per 32 rows of W: Q5_0's, Q5_1's
template <int HB>
constexpr int64_t Q5R = HB == 4 ? Q51 : Q50;  // HB 3: a Q5_0 form, 4: a Q5_1 form
// The row (of 16 bytes, in a panel's scales) of block j's high bits: Q5_K's (HB 1) or a Q5 form's.
template <int HB>
inline int64_t high_row(int64_t j) {
  return HB == 1 ? (j / 32) * K5 + K4 + j % 32 : (j / 4) * Q5R<HB> + Q5R<HB> - 4 + j % 4;
}

struct W4 {
  const uint8_t* q;    // panels [Np / 16][Kp / 8][64]
  const uint16_t* sm;  // f16 [Np / 16][G][S][16] (panel-major), or null in the K form
  const uint8_t* k8;   // a K form: uint8 [Np / 16][Kp / 256][KR][16] (a Q5 form: [Kp / 32]), else null
  int64_t Kp, Np, group, S;
  // the K form's rows per 256: K4 (Q4_K), K5 (Q5_K, 5-bit codes) or K6 (Q6_K, 6-bit); a Q5 form's per 32
  int64_t KR = 0;
  bool q5() const { return KR == Q50 || KR == Q51; }
  // Panel p's scales: rows of 16 columns (G * S f16 ones, the K form's Kp / 256 * KR bytes, a Q5 form's
  // Kp / 32 * KR), read as one stream beside the panel's codes.
  const uint8_t* scales(int64_t p) const {
    if (!k8) return reinterpret_cast<const uint8_t*>(sm + p * (Kp / group) * S * P);
    return k8 + p * (Kp / (q5() ? 32 : 256)) * KR * P;
  }
};

// fn(integral_constant<int, HB>) for w's codes' high bits: 2 (Q6_K), 1 (Q5_K), 3 / 4 (Q5_0 / Q5_1) or 0.
template <class Fn>
inline void with_bits(const W4& w, Fn&& fn) {
  w.KR == K6    ? fn(std::integral_constant<int, 2>{})
  : w.KR == K5  ? fn(std::integral_constant<int, 1>{})
  : w.KR == Q50 ? fn(std::integral_constant<int, 3>{})
  : w.KR == Q51 ? fn(std::integral_constant<int, 4>{})
                : fn(std::integral_constant<int, 0>{});
}

// Scale and minimum of group g, column n (scalar: run_unpack).
inline void scale_min(const W4& w, int64_t g, int64_t n, float& s, float& mn) {
  const uint8_t* ps = w.scales(n / P);
  const int64_t c = n % P;
  if (w.q5()) {  // f16 d (and m) as byte planes at rows 0 / 1 (2 / 3) of group g
    const uint8_t* b = ps + g * w.KR * P + c;
    const auto f16 = [&](int row) { return f16_to_f32(uint16_t(b[row * P] | (b[(row + 1) * P] << 8))); };
    s = f16(0), mn = w.KR == Q51 ? f16(2) : -16.f * s;
    return;
  }
  if (w.k8) {
    const int64_t per = 256 / w.group;  // groups per 256 rows
    const uint8_t* b = ps + (g / per) * w.KR * P + c;
    const auto f16 = [&](int row) { return f16_to_f32(uint16_t(b[row * P] | (b[(row + 1) * P] << 8))); };
    if (w.KR == K6)
      s = f16(16) * float(int8_t(b[(g % per) * P])), mn = -32.f * s;
    else
      s = f16(16) * float(b[(g % per) * P]), mn = f16(18) * float(b[(8 + g % per) * P]);
    return;
  }
  const uint16_t* sg = reinterpret_cast<const uint16_t*>(ps) + g * w.S * P + c;
  s = f16_to_f32(sg[0]), mn = w.S == 2 ? f16_to_f32(sg[P]) : -8.f * s;
}

// 16 f16 values stored as two byte planes (low bytes at lo, high at hi) -> 16 u16 lanes.
inline __m256i f16_planes(const uint8_t* lo, const uint8_t* hi) {
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi));
  return _mm256_set_m128i(_mm_unpackhi_epi8(l, h), _mm_unpacklo_epi8(l, h));
}

#include "q4x.h"  // x rounded per group: one int8 part, two int8 digits (int16) or three parts

inline int32_t x4(const int8_t* p) {  // 4 int8 of x as one int32 (broadcast to every lane)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__)
constexpr int MR_MAX = 8;
inline __m512i dot4(__m512i acc, __m512i u, __m512i s) {  // acc + sum of 4 u8 x s8 per int32 lane
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

#include "q4tile.h"  // high bits, group scales, the prompt tiles

// MR rows of x x panel p -> out[m * ld + 0..15]; HB: the codes' high bits (0, 1: Q5_K's, 2: Q6_K's); D: rows
// of xq [MR * D, Kp] per row of x (2: int8 digits, the first's sums shifted 8 bits up, quantize_x).
template <int MR, int HB, int D>
inline void panel_rows(const int8_t* xq, const float* sx, const float* xs, const int32_t* xi, int64_t G, const W4& w,
                       int64_t p, float* out, int64_t ld) {
  constexpr int A = MR == 1 ? 2 : 1;  // one row: low and high nibbles in separate sums (latency)
  const uint8_t* panel = w.q + p * (w.Kp / B) * 64, *ps = w.scales(p);
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  __m512 kd = _mm512_setzero_ps(), kn = kd;  // the K form's super-scale and -dmin (every 8 groups)
  const int64_t gb = w.group / B;  // blocks per group
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[MR][D][A];  // Q6_K: the sums start at -32 sum(X), its codes' offset, exact in int32
    for (int m = 0; m < MR; ++m)
      for (int d = 0; d < D; ++d)
        for (int a = 0; a < A; ++a)
          acc[m][d][a] = _mm512_set1_epi32(HB == 2 && a == 0 && d == D - 1 ? -32 * xi[m * G + g] : 0);
    for (int64_t j = g * gb; j < (g + 1) * gb; ++j) {
      const uint8_t* r = panel + j * 64;
      _mm_prefetch(reinterpret_cast<const char*>(r) + PFB, _MM_HINT_T0);
      __m512i lo, hi;
      codes<HB>(r, ps, j, lo, hi);
      for (int m = 0; m < MR; ++m)
        for (int d = 0; d < D; ++d) {
          const int8_t* x = xq + (m * D + d) * w.Kp + j * B;
          acc[m][d][0] = dot4(acc[m][d][0], lo, _mm512_set1_epi32(x4(x)));
          acc[m][d][A - 1] = dot4(acc[m][d][A - 1], hi, _mm512_set1_epi32(x4(x + 4)));
        }
    }
    __m512 s, mn;
    group_scales<HB>(w, ps, g, kd, kn, s, mn);
    for (int m = 0; m < MR; ++m) {
      __m512i a[D];
      for (int d = 0; d < D; ++d) a[d] = A == 2 ? _mm512_add_epi32(acc[m][d][0], acc[m][d][A - 1]) : acc[m][d][0];
      const __m512i t = D == 2 ? _mm512_add_epi32(_mm512_slli_epi32(a[0], 8), a[D - 1]) : a[0];
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, _mm512_set1_ps(sx[m * G + g])), f[m]);
      if constexpr (HB != 2) f[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), mn, f[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * ld, f[m]);
}
#else
#include "q4avx2.h"  // the same on AVX2 (two vectors of 8 columns)
#endif

// M rows of x (<= ROWS; D rows of xq each, quantize_x) x panels [p0, p1) -> buf[m * ld + (p - p0) * 16 + c];
// xp: the same rows packed for the prompt tiles (pack_x6), or null.
inline void rows(const int8_t* xq, const int8_t* xp, const float* sx, const float* xs, const int32_t* xi, int64_t G,
                 int64_t M, const W4& w, int64_t p0, int64_t p1, float* buf, int64_t ld, int64_t D) {
  const auto digits = [&](auto dd) {
    constexpr int DD = decltype(dd)::value;
#if defined(__AVX512F__)
    if (xp) {
      with_form(w, [&](auto hb, auto gq) {
        tile_rows<decltype(hb)::value, decltype(gq)::value, DD>(xp, sx, xs, xi, G, M, w, p0, p1, buf, ld);
      });
      return;
    }
#endif
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0;
        const int mr = int(left > MR_MAX && left < 2 * MR_MAX ? (left + 1) / 2 : std::min<int64_t>(left, MR_MAX));
        const int8_t* x = xq + m0 * DD * w.Kp;
        const float *s = sx + m0 * G, *t = xs + m0 * G;
        const int32_t* u = xi + m0 * G;
        float* o = buf + m0 * ld + (p - p0) * P;
        with_rows<MR_MAX>(mr, [&](auto r) {
          with_bits(w, [&](auto hb) {
            panel_rows<decltype(r)::value, decltype(hb)::value, DD>(x, s, t, u, G, w, p, o, ld);
          });
        });
        m0 += mr;
      }
  };
  D == 2 ? digits(std::integral_constant<int, 2>{}) : digits(std::integral_constant<int, 1>{});
}

// y [M, N] = act(x [M, K] @ W (+ bias)); bias: f32 [Np] (zero padded) or null; X: how x is held (quantize_x):
// 1 int8 part, 2 int8 digits (int16), 3 int8 parts (each multiplied, their products summed in order).
inline void run(const float* x, const W4& w, const float* bias, int32_t act, int64_t M, int64_t K, int64_t N,
                const Out& out, int64_t X = 1) {
  const int64_t G = w.Kp / w.group, D = X == 2 ? 2 : 1, R = X == 2 ? 1 : X;  // digits, parts
  std::vector<int8_t> xq(R * D * M * w.Kp);
  std::vector<float> sx(R * M * G), xs(R * M * G);
  std::vector<int32_t> xi(R * M * G);
  quantize_x(x, M, K, w, xq.data(), sx.data(), xs.data(), xi.data(), R, D);
  std::vector<int8_t> xp;  // the prompt tiles' x (AVX-512), in chunks of TILE_ROWS rows: whole tiles
#if defined(__AVX512F__)
  if (R * D * M > MAX_TILE_ROWS && tiles_take(w.group)) {
    xp.resize(size_t((R * D * M + TR - 1) / TR * TR * w.Kp));
    pack_x6(xq.data(), R * D * M, w.Kp, xp.data());
  }
#endif
  const int64_t chunk = xp.empty() ? ROWS / R : TILE_ROWS / (R * D);
  drive_rows(M, N, w.Np, chunk, bias, act, out, [&](int64_t m0, int64_t mc, int64_t p0, int64_t p1, float* buf, int64_t ld) {
    const int64_t r0 = R * m0;
    thread_local std::vector<float> parts;
    parts.resize(R > 1 ? R * mc * ld : 0);
    float* o = R > 1 ? parts.data() : buf;
    const int8_t* xpr = xp.empty() ? nullptr : xp.data() + r0 * D * w.Kp;  // r0 * D: a multiple of TR
    const int64_t g0 = r0 * G;
    const int8_t* xr = xq.data() + r0 * D * w.Kp;
    rows(xr, xpr, sx.data() + g0, xs.data() + g0, xi.data() + g0, G, R * mc, w, p0, p1, o, ld, D);
    for (int64_t m = 0; R > 1 && m < mc; ++m)
      for (int64_t j = 0; j < ld; ++j) {
        float v = o[m * R * ld + j];
        for (int64_t h = 1; h < R; ++h) v += o[(m * R + h) * ld + j];
        buf[m * ld + j] = v;
      }
  });
}

// Whole W -> y [K, N] f32 / bf16 / f16 (the dequantized matrix, for tests and XLA's dot).
inline void run_unpack(const W4& w, int64_t K, int64_t N, const Out& out) {
  aotlm_pk::panel_ranges(w.Np / P, 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * P, n0 = p0 * P, width = std::min(ld, N - n0);
    std::vector<float> row(ld);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / w.group, half = (k % B) / 4, t = k % 4;
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* r = w.q + (p * (w.Kp / B) + k / B) * 64;
        for (int64_t c = 0; c < P; ++c) {
          float s, mn;
          scale_min(w, g, p * P + c, s, mn);
          int q = (r[4 * c + t] >> (4 * half)) & 15;
          if (w.KR == K6) {  // lane 4c + t: byte (4c + t) % 32 of the block's plane, nibble (4c + t) / 32
            const int64_t lane = 4 * c + t, j = (k % 256) / B;
            const uint8_t h = w.scales(p)[((k / 256) * K6 + 18 + 2 * j) * P + lane % 32];
            q |= ((h >> (4 * (lane / 32) + 2 * half)) & 3) << 4;
          } else if (w.KR == K5 || w.q5()) {  // lane 4c + t: byte (4c + t) % 16 of block j's row, bit 2 ((4c + t) / 16) + half
            const int64_t lane = 4 * c + t, j = k / B;
            const int64_t row = w.KR == K5 ? high_row<1>(j) : w.KR == Q51 ? high_row<4>(j) : high_row<3>(j);
            q |= ((w.scales(p)[row * P + lane % 16] >> (2 * (lane / 16) + half)) & 1) << 4;
          }
          row[(p - p0) * P + c] = s * float(q) + mn;
        }
      }
      out.put(k * N + n0, row.data(), int(width));
    }
  });
}

}  // namespace aotlm_q4

// ------------------------------------------------------------------ handlers
// The operands of a 4-bit W for y [.., K] x [.., N]: Kp (K up to the group) and Np (N up to 16) from
// ``group``; w holds Np * Kp / 2 bytes, sm f16 [Np / 16][G][S][16] with S = 1 or 2. Returns "" or the problem.
std::string q4_operands(const ffi::AnyBuffer& w, const ffi::AnyBuffer& sm, int64_t K, int64_t N, int32_t group,
                        aotlm_q4::W4* out) {
  if (group < aotlm_q4::B || group % aotlm_q4::B) return "group must be a multiple of 8";
  const int64_t Kp = (K + group - 1) / group * group, Np = (N + 15) / 16 * 16, G = Kp / group;
  if (w.element_type() != DataType::U8 || int64_t(w.element_count()) != Kp * Np / 2)
    return "w must be uint8 with Np * Kp / 2 bytes (Kp: K rounded up to the group, Np: N up to 16)";
  const auto* q = static_cast<const uint8_t*>(w.untyped_data());
  if (sm.element_type() == DataType::U8 && group == 32)  // a Q5 form: Q5_0's / Q5_1's, 6 / 8 rows per 32
    for (const int64_t r : {aotlm_q4::Q50, aotlm_q4::Q51})
      if (int64_t(sm.element_count()) == G * r * Np) {
        *out = {q, nullptr, static_cast<const uint8_t*>(sm.untyped_data()), Kp, Np, group, 2, r};
        return "";
      }
  if (sm.element_type() == DataType::U8) {  // a K form: Q4_K's / Q5_K's (groups of 32) or Q6_K's (16)
    const int64_t rows = Kp % 256 ? 0 : int64_t(sm.element_count()) / (Kp / 256 * Np);
    const int64_t kr = group == 16 ? aotlm_q4::K6 : rows == aotlm_q4::K5 ? aotlm_q4::K5 : aotlm_q4::K4;
    if ((group != 32 && group != 16) || Kp % 256 || int64_t(sm.element_count()) != Kp / 256 * kr * Np)
      return "K-form scales must be uint8 [Np / 16, K / 256, 20 or 52, 16] with groups of 32 (Q4_K, Q5_K), "
             "[.., 82, 16] with groups of 16 (Q6_K), or [Np / 16, K / 32, 6 or 8, 16] (Q5_0, Q5_1)";
    *out = {q, nullptr, static_cast<const uint8_t*>(sm.untyped_data()), Kp, Np, group, 2, kr};
    return "";
  }
  if (sm.element_type() != DataType::F16 || (int64_t(sm.element_count()) != G * Np && int64_t(sm.element_count()) != 2 * G * Np))
    return "scales must be f16 [Np / 16, G, 1 or 2, 16] (G = Kp / group) or uint8 [Np / 16, K / 256, 20, 16]";
  *out = {q, static_cast<const uint16_t*>(sm.untyped_data()), nullptr, Kp, Np, group, int64_t(sm.element_count()) / (G * Np)};
  return "";
}

// x [M, K] (f32 / bf16 / f16) -> y [M, N] of x's dtype; bias f32 [N] or empty; act as aotlm_wmm_pk's; live
// int8 [M] (the rows to multiply, live.h) or empty.
ffi::Error wmm_q4(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer sm, ffi::AnyBuffer bias, ffi::AnyBuffer live,
                  ffi::Result<ffi::AnyBuffer> y, int32_t group, int32_t act, int32_t parts) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("aotlm_wmm_q4: x [M, K] and y [M, N] must be 2-D with equal M");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const DataType xt = x.element_type();
  if (y->element_type() != xt || (xt != DataType::F32 && xt != DataType::BF16 && xt != DataType::F16))
    return ffi::Error::InvalidArgument("aotlm_wmm_q4: x and y must both be f32, bf16 or f16");
  const bool int8 = w.element_type() == DataType::S8;  // int8 codes in groups (group8.h)
  aotlm_q4::W4 w4;
  aotlm_g8::W8 w8;
  if (const std::string e = int8 ? g8_operands(w, sm, K, N, group, &w8) : q4_operands(w, sm, K, N, group, &w4);
      !e.empty())
    return ffi::Error::InvalidArgument("aotlm_wmm_q4: " + e);
  const int64_t Np = int8 ? w8.Np : w4.Np;
  const float* b = nullptr;
  if (!scale_of(bias, N, &b)) return ffi::Error::InvalidArgument("aotlm_wmm_q4: bias must be f32 [N] or empty");
  if (act < aotlm_ep::ACT_NONE || act > aotlm_ep::ACT_RELU || parts < 1 || parts > 3)
    return ffi::Error::InvalidArgument(
        "aotlm_wmm_q4: act must be 0 (none), 1 (gelu tanh) or 2 (relu), parts 1-3 (2: x as int16 in two digits)");
  std::vector<float> bp;  // bias zero padded to Np (the output pass reads whole panels)
  if (b) bp.assign(Np, 0.f), std::memcpy(bp.data(), b, N * sizeof(float));
  const int8_t* lv = nullptr;
  if (!aotlm_lr::live_of(live, M, &lv))
    return ffi::Error::InvalidArgument("aotlm_wmm_q4: live rows must be int8 [M] or empty");
  std::vector<float> tmp;
  const float* bb = b ? bp.data() : nullptr;
  aotlm_lr::live_rows(x_f32(x, M * K, tmp), lv, M, K, N, bb, act, Out{y->untyped_data(), xt},
                      [&](const float* xr, int64_t Mr, const Out& o) {
                        if (int8)
                          aotlm_g8::run(xr, w8, bb, act, Mr, N, o);
                        else
                          aotlm_q4::run(xr, w4, bb, act, Mr, K, N, o, parts);
                      });
  return ffi::Error::Success();
}

// 4-bit W -> y [K, N] (f32 / bf16 / f16), dequantized; ``after``: unused (orders the call, see convert).
ffi::Error unpack_q4(ffi::AnyBuffer w, ffi::AnyBuffer sm, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> y,
                     int32_t group) {
  auto yd = y->dimensions();
  const DataType yt = y->element_type();
  if (yd.size() != 2 || (yt != DataType::F32 && yt != DataType::BF16 && yt != DataType::F16))
    return ffi::Error::InvalidArgument("aotlm_unpack_q4: y must be 2-D f32, bf16 or f16");
  if (w.element_type() == DataType::S8) {  // int8 codes in groups (group8.h)
    aotlm_g8::W8 w8;
    if (const std::string e = g8_operands(w, sm, yd[0], yd[1], group, &w8); !e.empty())
      return ffi::Error::InvalidArgument("aotlm_unpack_q4: " + e);
    aotlm_g8::run_unpack(w8, yd[1], Out{y->untyped_data(), yt});
    return ffi::Error::Success();
  }
  aotlm_q4::W4 w4;
  if (const std::string e = q4_operands(w, sm, yd[0], yd[1], group, &w4); !e.empty())
    return ffi::Error::InvalidArgument("aotlm_unpack_q4: " + e);
  aotlm_q4::run_unpack(w4, yd[0], yd[1], Out{y->untyped_data(), yt});
  return ffi::Error::Success();
}
