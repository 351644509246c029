// Prefill GEMMs (included by wmatmul.cc after packed.h): many rows (M > MAX_ROWS, up to thousands).
//
//   aotlm_gemm:     y[M,N] = x[M,K] @ W[K,N]                   f32 x, f32 W row-major
//   aotlm_gemm_i8:  y[M,N] = (xq[M,K] @ W[K,N]) * sx[m] * s[n]  int8 W in the panel layout (packed.h)
//
// f32: W is packed per call, per thread, into blocks of KC rows x 16 columns (a 16-column panel
// of a KC block is 16 KB: it stays in L1 while every group of 6 rows of x passes over it; a
// row-major W walked 16 columns down N-strided rows maps onto 4 of L1's 64 sets for GPT-2's N and
// thrashes). x is packed once per call as [K blocks][groups of 6 rows][KC][6], so the micro-kernel's
// 6 broadcasts per k come from one 24-byte run; a block of MC rows x KC stays in L2 across panels.
// Micro-kernel: 6 rows x 16 columns = 12 accumulators + 2 W vectors + 1 broadcast (15 of 16 ymm).
//
// int8 (quant="int8" prefill, and W8A8): x rounded per row to int16 (scale max|x| / 32767: the
// decode kernels' rounding, int8.h) or given as int8 with its per-row scale (W8A8: absmax / 127,
// computed in the graph so the pure-JAX path does the same math), packed into [groups of 6 rows]
// [K/2][6][2] int16 pairs; W is already in panels of 16 columns x pairs of rows (the vpmaddwd
// operands after a vpmovsxbw), so nothing of W is repacked. Why vpmaddwd on sign-extended int8
// and not vpmaddubsw (u8 x s8): on the 2-core EPYC here (Zen 2) every vector integer multiply
// issues on one pipe, so vpmaddubsw + vpmaddwd(ones) (32 MACs per 2 multiplies) runs no faster
// than vpmaddwd alone (16 MACs per multiply) and both match the f32 FMA peak (2 pipes x 8): in one
// L1-resident tile run f32 6x16 FMA 105 Gop/s, int8 W / int16 x 6x16 vpmaddwd 94, u8 x s8 4x24
// 102 (one core). vpmaddubsw would also saturate: u8 x s8 pairs reach 2 * 255 * 127 > 32767 unless
// x is cut to 7 bits. Only int16 sums of two vpmaddubsw (6-bit x) beat it (137), too coarse for
// activations. So int8's gain here is bytes (W read as int8, no f32 copy of it), not arithmetic.
// W8A8 sums stay int32 over all of K (|x|, |w| <= 127: no overflow below K = 133k), so the result
// equals the graph's ``dot(int8, int8) -> int32`` exactly; int16 x is flushed to f32 every
// KB_PAIRS pairs (int8.h).
#pragma once

namespace aotlm_gm {
constexpr int64_t MR = 6, NR = 16;
constexpr int64_t KC = 256;  // f32: rows of W per block (a 16-column panel block = 16 KB)

// ----------------------------------------------------------------- f32
// c[6 x 16] (= or +=) a [kc][6] . b [kc][16]; only mr rows x nr columns of c are written.
inline void f32_micro(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool add, int64_t mr,
                      int64_t nr) {
  // 12 named accumulators: with an __m256 array g++ stored every one to the stack each k (4x slower)
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
    const float* ak = a + k * MR;
#define AOTLM_ROW(m, r0, r1)                          \
  {                                                    \
    const __m256 av = _mm256_broadcast_ss(ak + m);     \
    r0 = _mm256_fmadd_ps(av, b0, r0);                  \
    r1 = _mm256_fmadd_ps(av, b1, r1);                  \
  }
    AOTLM_ROW(0, c00, c01)
    AOTLM_ROW(1, c10, c11)
    AOTLM_ROW(2, c20, c21)
    AOTLM_ROW(3, c30, c31)
    AOTLM_ROW(4, c40, c41)
    AOTLM_ROW(5, c50, c51)
#undef AOTLM_ROW
  }
  alignas(32) float t[MR][NR];
  const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int m = 0; m < MR; ++m) {
    _mm256_store_ps(t[m], acc[m][0]);
    _mm256_store_ps(t[m] + 8, acc[m][1]);
  }
  if (nr == NR) {
    for (int64_t m = 0; m < mr; ++m)
      for (int v = 0; v < 2; ++v) {
        float* p = c + m * ldc + 8 * v;
        const __m256 r = _mm256_load_ps(t[m] + 8 * v);
        _mm256_storeu_ps(p, add ? _mm256_add_ps(_mm256_loadu_ps(p), r) : r);
      }
    return;
  }
  for (int64_t m = 0; m < mr; ++m)
    for (int64_t n = 0; n < nr; ++n) c[m * ldc + n] = add ? c[m * ldc + n] + t[m][n] : t[m][n];
}

// x [M, K] -> xp [K blocks][M groups][kc][6] (rows past M are zero): a block's groups are contiguous.
inline void f32_pack_x(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t G = (M + MR - 1) / MR;
  aotlm::parallel_for(int(G), [&](int g) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      float* dst = xp + k0 * G * MR + g * kc * MR;
      for (int64_t r = 0; r < MR; ++r) {
        const int64_t m = g * MR + r;
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + r] = m < M ? x[m * K + k0 + k] : 0.f;
      }
    }
  });
}

// y [M, N] = x @ W [K, N] (row-major f32). Threads take ranges of 16-column panels (~4 per thread:
// the machine is shared, so smaller parts balance better), pack their panels of each KC block of W,
// then run every group of rows over each panel, MC rows at a time (a block of x stays in L2).
inline void f32_gemm(const float* x, const float* w, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t G = (M + MR - 1) / MR, Np = (N + NR - 1) / NR;
  constexpr int64_t MCG = 32;  // groups per MC block: 192 rows x KC of packed x = 192 KB (L2 holds 512)
  std::vector<float> xp(size_t(G * MR * K));
  f32_pack_x(x, M, K, xp.data());
  aotlm_pk::panel_ranges(Np, 4, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> bp;
    bp.resize(size_t((p1 - p0) * KC * NR));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t p = p0; p < p1; ++p) {  // pack: [panel][kc][16], columns past N zero
        float* dst = bp.data() + (p - p0) * KC * NR;
        const int64_t n0 = p * NR, nr = std::min(NR, N - n0);
        for (int64_t k = 0; k < kc; ++k) {
          const float* src = w + (k0 + k) * N + n0;
          if (nr == NR) {
            _mm256_storeu_ps(dst + k * NR, _mm256_loadu_ps(src));
            _mm256_storeu_ps(dst + k * NR + 8, _mm256_loadu_ps(src + 8));
          } else {
            for (int64_t n = 0; n < NR; ++n) dst[k * NR + n] = n < nr ? src[n] : 0.f;
          }
        }
      }
      const float* xb = xp.data() + k0 * G * MR;
      for (int64_t g0 = 0; g0 < G; g0 += MCG)
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * NR, nr = std::min(NR, N - n0);
          for (int64_t g = g0; g < std::min(G, g0 + MCG); ++g)
            f32_micro(xb + g * kc * MR, bp.data() + (p - p0) * KC * NR, kc, y + g * MR * N + n0, N, k0 > 0,
                      std::min(MR, M - g * MR), nr);
        }
    }
  });
}

// ----------------------------------------------------------------- int8 W (panels)
// xq rows (int16, zero padded to Kp) -> xp [groups][Kh][6][2]: one group's pairs for a k are contiguous.
inline void i8_pack_x(const int16_t* xq, int64_t M, int64_t Kp, int64_t Kh, int16_t* xp) {
  const int64_t G = (M + MR - 1) / MR;
  aotlm::parallel_for(int(G), [&](int g) {
    int16_t* dst = xp + g * Kh * MR * 2;
    for (int64_t r = 0; r < MR; ++r) {
      const int64_t m = g * MR + r;
      for (int64_t j = 0; j < Kh; ++j) {
        dst[(j * MR + r) * 2] = m < M ? xq[m * Kp + 2 * j] : 0;
        dst[(j * MR + r) * 2 + 1] = m < M ? xq[m * Kp + 2 * j + 1] : 0;
      }
    }
  });
}

// One group of 6 packed rows x one panel over all Kh pairs -> out[m * ld + 0..15] (unscaled, f32),
// only mr rows written. EXACT: one int32 sum over all of K (int8 x); else flushed every KB_PAIRS.
template <bool EXACT>
inline void i8_micro(const int16_t* a, const int8_t* panel, int64_t Kh, float* out, int64_t ld, int64_t mr) {
  alignas(32) float f[MR][NR] = {};
  const int64_t step = EXACT ? Kh : aotlm_i8::KB_PAIRS;
  for (int64_t j0 = 0; j0 < Kh; j0 += step) {
    const int64_t j1 = std::min(Kh, j0 + step);
    __m256i acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int64_t j = j0; j < j1; ++j) {
      const int8_t* r = panel + j * 2 * NR;
      const __m256i w0 = aotlm_pk::w16(r), w1 = aotlm_pk::w16(r + 16);
      const int16_t* aj = a + j * MR * 2;
      for (int m = 0; m < MR; ++m) {
        const __m256i xb = aotlm_i8::pair_at(aj + 2 * m);
        acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(w0, xb));
        acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(w1, xb));
      }
    }
    for (int m = 0; m < MR; ++m)  // a panel row's first 16 bytes are columns 0-7, the next 16 columns 8-15
      for (int v = 0; v < 2; ++v)
        _mm256_store_ps(f[m] + 8 * v, _mm256_add_ps(_mm256_load_ps(f[m] + 8 * v), _mm256_cvtepi32_ps(acc[m][v])));
  }
  for (int64_t m = 0; m < mr; ++m) std::memcpy(out + m * ld, f[m], NR * sizeof(float));
}

// y [M, N] = xq @ W * sx[m] * scale[n]; xq [M, Kp] int16 (int8 values when exact), W packed [N/16][K/2][16][2].
// Threads take panel ranges; per range, MC rows at a time (their packed x ~192 KB, in L2), each
// panel (K/2 x 32 bytes, in L1/L2) passes under every group of the block.
inline void i8_gemm(const int16_t* xq, int64_t Kp, const float* sx, bool exact, const int8_t* w, const float* scale,
                    int64_t M, int64_t K, int64_t N, const Out& out) {
  const int64_t G = (M + MR - 1) / MR, Kh = K / 2, Np = N / NR;
  std::vector<int16_t> xp(size_t(G * Kh * MR * 2));
  i8_pack_x(xq, M, Kp, Kh, xp.data());
  const int64_t MCG = std::max<int64_t>(1, (192 << 10) / (Kh * MR * 2 * 2));
  aotlm_pk::panel_ranges(Np, 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * NR, n0 = p0 * NR;
    thread_local std::vector<float> buf;
    buf.resize(size_t(MR * MCG * ld));
    for (int64_t g0 = 0; g0 < G; g0 += MCG) {
      const int64_t g1 = std::min(G, g0 + MCG), m0 = g0 * MR, rows = std::min(M, g1 * MR) - m0;
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t g = g0; g < g1; ++g) {
          const int16_t* a = xp.data() + g * Kh * MR * 2;
          float* o = buf.data() + (g - g0) * MR * ld + (p - p0) * NR;
          const int64_t mr = std::min(MR, M - g * MR);
          if (exact)
            i8_micro<true>(a, w + p * Kh * 2 * NR, Kh, o, ld, mr);
          else
            i8_micro<false>(a, w + p * Kh * 2 * NR, Kh, o, ld, mr);
        }
      for (int64_t m = 0; m < rows; ++m) {  // (sum * sx[m]) * scale[n]: the graph's order of the W8A8 math
        float* r = buf.data() + m * ld;
        for (int64_t j = 0; j < ld; ++j) r[j] = r[j] * sx[m0 + m] * (scale ? scale[n0 + j] : 1.f);
        out.put((m0 + m) * N + n0, r, int(ld));
      }
    }
  });
}

// f32 FMA peak of the pool's threads (GFLOP/s, best of runs): 12 independent chains per thread.
inline double fma_peak(int runs) {
  const int parts = aotlm::pool_size();
  constexpr int64_t IT = 4000000;
  double best = 0;
  std::vector<float> sink(parts);
  for (int r = 0; r < std::max(1, runs); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    aotlm::parallel_for(parts, [&](int c) {
      __m256 a[12];
      for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1e-3f * (i + c));
      const __m256 b = _mm256_set1_ps(0.999f), d = _mm256_set1_ps(1e-4f);
      for (int64_t i = 0; i < IT; ++i)
        for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], b, d);
      for (int j = 1; j < 12; ++j) a[0] = _mm256_add_ps(a[0], a[j]);
      sink[c] = _mm256_cvtss_f32(a[0]);
    });
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * 8 * 12 * IT * parts / t / 1e9);
  }
  return sink[0] == 12345.f ? 0.0 : best;
}

}  // namespace aotlm_gm
