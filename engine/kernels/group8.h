// int8 weights with a scale (and minimum) per group of rows along K -- a GGUF file's Q8_0 blocks kept as
// stored (models/quant8.py) -- included by wmatmul.cc after int4.h; aotlm_wmm_q4 / aotlm_unpack_q4 take
// them when W is int8:
//
//   y[M,N] = act(x[M,K] @ W[K,N] (+ bias)),  W[k,n] = s[g,n] * q[k,n] (+ m[g,n]),  g = k / group
//
// q: int8 in packed.h's panel layout ([Np / 16][K / 2][16][2]: per panel of 16 columns, each pair of rows
// interleaved per column); s, m: f16 [Np / 16][G][S][16] (S = 1: symmetric, 2: scale then minimum;
// panel-major as int4.h's). K is a multiple of the group (a multiple of 2).
//
// Math: each row of x is rounded to int16 per group (scale sx = max|x| / 32767 over the group's rows, an
// error <= 1.5e-5 of the group's largest value -- not to int8 as the 4-bit kernel does, so the product
// stays within f32-like error of the file's own weights; per group, not per row: a row's outliers then
// cost the other groups nothing), int16 x int8 products summed exactly in int32 per group (vpdpwssd /
// vpmaddwd; |sum| <= group * 32767 * 128 < 2^31 for groups up to 256), then
//   y += float(sum) * (s[g] * sx[g]) (+ m[g] * sx[g] * sum_k xq[k]).
#pragma once

namespace aotlm_g8 {
constexpr int64_t P = 16;      // columns per panel
constexpr int64_t PFB = 1024;  // prefetch distance in the panel stream (bytes)
constexpr int64_t ROWS = 64;   // rows of x per pass over a panel range

struct W8 {
  const int8_t* q;     // panels [Np / 16][K / 2][32]
  const uint16_t* sm;  // f16 [Np / 16][G][S][16]
  int64_t K, Np, group, S;
  const uint16_t* scales(int64_t p) const { return sm + p * (K / group) * S * P; }  // panel p's [G][S][16]
};

inline float scale_of(const W8& w, int64_t g, int64_t s, int64_t n) {
  return f16_to_f32(w.scales(n / P)[(g * w.S + s) * P + n % P]);
}

#if defined(__AVX512BW__)
constexpr int MR_MAX = 8;
// MR rows of xq [MR, ld_x] x panel p -> out[m * ld + 0..15]; sx, xs [MR][G]: x's scales, and sx * sum(xq)
// per group (minimums only).
template <int MR>
inline void panel_rows(const int16_t* xq, int64_t ldx, const float* sx, const float* xs, const W8& w, int64_t p,
                       float* out, int64_t ld) {
  constexpr int A = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // few rows: pairs in separate sums (the add latency)
  const int8_t* panel = w.q + p * (w.K / 2) * 2 * P;
  const uint16_t* ps = w.scales(p);
  const int64_t G = w.K / w.group, gp = w.group / 2;  // gp: pairs per group (a multiple of 4)
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[MR][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_si512();
    const auto step = [&](int64_t j, int a) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 2 * P)));
      for (int m = 0; m < MR; ++m) {
        int32_t x2;
        std::memcpy(&x2, xq + m * ldx + 2 * j, 4);
        acc[m][a] = aotlm_pk::madd_add512(acc[m][a], wv, _mm512_set1_epi32(x2));
      }
    };
    for (int64_t j = g * gp; j < (g + 1) * gp; j += 4) {  // four pairs = two 64-byte lines
      _mm_prefetch(reinterpret_cast<const char*>(panel + j * 2 * P + PFB), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(panel + j * 2 * P + 64 + PFB), _MM_HINT_T0);
      for (int i = 0; i < 4; ++i) step(j + i, i % A);
    }
    const uint16_t* sg = ps + g * w.S * P;
    _mm_prefetch(reinterpret_cast<const char*>(sg + 4 * w.S * P), _MM_HINT_T0);  // scales: a few groups ahead
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
    for (int m = 0; m < MR; ++m) {
      __m512i a = acc[m][0];
      for (int i = 1; i < A; ++i) a = _mm512_add_epi32(a, acc[m][i]);
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, _mm512_set1_ps(sx[m * G + g])), f[m]);
    }
    if (w.S == 2) {
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + P)));
      for (int m = 0; m < MR; ++m) f[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), mn, f[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * ld, f[m]);
}
#else
constexpr int MR_MAX = 4;
// AVX2: columns 0-7 and 8-15 of each pair of rows as two vectors (packed.h's w16).
template <int MR>
inline void panel_rows(const int16_t* xq, int64_t ldx, const float* sx, const float* xs, const W8& w, int64_t p,
                       float* out, int64_t ld) {
  const int8_t* panel = w.q + p * (w.K / 2) * 2 * P;
  const uint16_t* ps = w.scales(p);
  const int64_t G = w.K / w.group, gp = w.group / 2;
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int64_t j = g * gp; j < (g + 1) * gp; ++j) {
      const int8_t* r = panel + j * 2 * P;
      if ((j & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(r) + PFB, _MM_HINT_T0);
      const __m256i w0 = aotlm_pk::w16(r), w1 = aotlm_pk::w16(r + 16);
      for (int m = 0; m < MR; ++m) {
        const __m256i xb = aotlm_i8::pair_at(xq + m * ldx + 2 * j);
        acc[m][0] = aotlm_i8::madd_add(acc[m][0], w0, xb);
        acc[m][1] = aotlm_i8::madd_add(acc[m][1], w1, xb);
      }
    }
    const uint16_t* sg = ps + g * w.S * P;
    for (int v = 0; v < 2; ++v) {
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 8 * v)));
      const __m256 mn = w.S == 2 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + P + 8 * v)))
                                 : _mm256_setzero_ps();
      for (int m = 0; m < MR; ++m) {
        f[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][v]), _mm256_mul_ps(s, _mm256_set1_ps(sx[m * G + g])), f[m][v]);
        if (w.S == 2) f[m][v] = _mm256_fmadd_ps(_mm256_set1_ps(xs[m * G + g]), mn, f[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + m * ld + 8 * v, f[m][v]);
}
#endif

// M rows (<= ROWS) x panels [p0, p1) -> buf[m * ld + (p - p0) * 16 + c].
inline void rows(const int16_t* xq, int64_t ldx, const float* sx, const float* xs, int64_t M, const W8& w, int64_t p0,
                 int64_t p1, float* buf, int64_t ld) {
  const int64_t G = w.K / w.group;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int mr = int(left > MR_MAX && left < 2 * MR_MAX ? (left + 1) / 2 : std::min<int64_t>(left, MR_MAX));
      const int16_t* x = xq + m0 * ldx;
      const float *s = sx + m0 * G, *t = xs + m0 * G;
      float* o = buf + m0 * ld + (p - p0) * P;
      with_rows<MR_MAX>(mr, [&](auto r) { panel_rows<decltype(r)::value>(x, ldx, s, t, w, p, o, ld); });
      m0 += mr;
    }
}

// x [M, K] -> xq [M, ldx] int16, per row and group: sx (the scale) and xs = sx * sum(xq).
inline void quantize_x(const float* x, int64_t M, const W8& w, int64_t ldx, int16_t* xq, float* sx, float* xs) {
  const int64_t G = w.K / w.group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* r = x + m * w.K + g * w.group;
      int16_t* q = xq + m * ldx + g * w.group;
      bool finite = true;
      const float amax = aotlm_i8::abs_max(r, w.group, finite);
      const float s = amax > 0.f && finite ? amax / 32767.f : 1.f;
      int32_t sum = 0;
      if (finite) {
        aotlm_i8::round_i16(r, w.group, 1.f / s, q);
        for (int64_t k = 0; k < w.group; ++k) sum += q[k];
      } else {
        std::fill(q, q + w.group, int16_t(0));
      }
      sx[m * G + g] = finite ? s : std::numeric_limits<float>::quiet_NaN();  // inf/NaN in: NaN out
      xs[m * G + g] = sx[m * G + g] * float(sum);
    }
}

// y [M, N] = act(x [M, K] @ W (+ bias)); bias: f32 [Np] (zero padded) or null.
inline void run(const float* x, const W8& w, const float* bias, int32_t act, int64_t M, int64_t N, const Out& out) {
  const int64_t ldx = w.K, G = w.K / w.group;
  std::vector<int16_t> xq(M * ldx);
  std::vector<float> sx(M * G), xs(M * G);
  quantize_x(x, M, w, ldx, xq.data(), sx.data(), xs.data());
  drive_rows(M, N, w.Np, ROWS, bias, act, out, [&](int64_t m0, int64_t mc, int64_t p0, int64_t p1, float* buf, int64_t ld) {
    rows(xq.data() + m0 * ldx, ldx, sx.data() + m0 * G, xs.data() + m0 * G, mc, w, p0, p1, buf, ld);
  });
}

// Whole W -> y [K, N] f32 / bf16 / f16 (the dequantized matrix, for tests and XLA's dot).
inline void run_unpack(const W8& w, int64_t N, const Out& out) {
  aotlm_pk::panel_ranges(w.Np / P, 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * P, n0 = p0 * P, width = std::min(ld, N - n0);
    std::vector<float> row(ld);
    for (int64_t k = 0; k < w.K; ++k) {
      const int64_t g = k / w.group;
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* r = w.q + (p * (w.K / 2) + k / 2) * 2 * P + (k & 1);
        for (int64_t c = 0; c < P; ++c) {
          const int64_t n = p * P + c;
          const float mn = w.S == 2 ? scale_of(w, g, 1, n) : 0.f;
          row[(p - p0) * P + c] = scale_of(w, g, 0, n) * float(r[2 * c]) + mn;
        }
      }
      out.put(k * N + n0, row.data(), int(width));
    }
  });
}

}  // namespace aotlm_g8

// The operands of an int8 W in groups for y [.., K] x [.., N]: w holds Np * K bytes (Np: N up to 16), sm
// f16 [Np / 16][G][S][16] with S = 1 or 2, G = K / group. Returns "" or the problem.
std::string g8_operands(const ffi::AnyBuffer& w, const ffi::AnyBuffer& sm, int64_t K, int64_t N, int32_t group,
                        aotlm_g8::W8* out) {
  if (group < 8 || group > 256 || group % 8 || K % group)
    return "int8 groups must be a multiple of 8 rows, <= 256, and divide K";
  const int64_t Np = (N + 15) / 16 * 16, G = K / group;
  if (int64_t(w.element_count()) != K * Np) return "int8 w must hold Np * K bytes (Np: N rounded up to 16)";
  if (sm.element_type() != DataType::F16 || (int64_t(sm.element_count()) != G * Np && int64_t(sm.element_count()) != 2 * G * Np))
    return "scales of int8 groups must be f16 [Np / 16, G, 1 or 2, 16] (G = K / group)";
  *out = {static_cast<const int8_t*>(w.untyped_data()), static_cast<const uint16_t*>(sm.untyped_data()), K, Np, group,
          int64_t(sm.element_count()) / (G * Np)};
  return "";
}
