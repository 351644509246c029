// AVX-512 variants of the prefill GEMMs' inner loops (included by gemm.h inside namespace aotlm_gm, after
// MR / NR / Rows / scratch). Compiled only into the avx512 / avx512vnni builds (aotlm.kernels.isa): the
// AVX2 build never sees these instructions, and a CPU without them never loads that build.
//
//   f32_micro_z:  the f32 micro-kernel (gemm.h's f32_micro: 6 rows x 16 columns) on 16-lane FMAs. One
//                 zmm is one 16-column row of the widened panel, so a k costs 1 load + 6 broadcast FMAs
//                 instead of 2 loads + 12 FMAs; even and odd k go to separate sums (12 chains: two
//                 512-bit FMA ports x latency 4-5 on Intel servers), masked stores for partial tiles.
//   i8_gemm_vnni: W8A8 on vpdpbusd (AVX512-VNNI): 4 int8 multiply-adds per int32 lane, 64 per
//                 instruction, against vpmaddwd's 2 (+ a vpaddd) on AVX2. vpdpbusd multiplies
//                 unsigned by signed bytes: W's panel bytes are flipped to w + 128 (xor 0x80) as the
//                 panel is regrouped, x stays signed (broadcast), and 128 * sum_k x[m, k] is taken off
//                 each row's sums: sum (w + 128) x - 128 sum x = sum w x, exact in int32 (|sum| <=
//                 255 * 127 * K), so the result equals gemm.h's i8_gemm and the graph's int8 dot bit for bit.
//   bf16_gemm_dp: bf16 x times bf16 W panels on vdpbf16ps (AVX512-BF16): a 32-bit lane holds one column's
//                 (k, k + 1) pair, the panel layout as stored, so 32 multiply-adds per instruction against
//                 16 for an f32 FMA. Only for activations rounded to bf16 (quant="bf16a"); f32 x never is.
#pragma once
#if defined(__AVX512F__)

constexpr int64_t MRV = 12;  // rows per VNNI micro-tile: 12 independent vpdpbusd chains, one zmm of W

// c[mr x nr] (= or +=) a [6][kc] . b [kc][16], as f32_micro; R < 6: only R rows are computed.
template <int R>
inline void f32_micro_z(const Rows& a_in, const float* b, int64_t kc, float* c, int64_t ldc, bool add, int64_t mr,
                        int64_t nr) {
  const Rows a = a_in;
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, e4 = e0, e5 = e0;
  __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0, o4 = e0, o5 = e0;
  int64_t k = 0;
#define AOTLM_ROW_Z(m, e, o)                                                 \
  if constexpr (m < R) {                                                     \
    e = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(m, k)), b0, e);                 \
    o = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(m, k + 1)), b1, o);             \
  }
  for (; k + 1 < kc; k += 2) {
    const __m512 b0 = _mm512_loadu_ps(b + k * NR), b1 = _mm512_loadu_ps(b + (k + 1) * NR);
    AOTLM_ROW_Z(0, e0, o0)
    AOTLM_ROW_Z(1, e1, o1)
    AOTLM_ROW_Z(2, e2, o2)
    AOTLM_ROW_Z(3, e3, o3)
    AOTLM_ROW_Z(4, e4, o4)
    AOTLM_ROW_Z(5, e5, o5)
  }
#undef AOTLM_ROW_Z
  if (k < kc) {  // an odd kc's last k: into the even sums
    const __m512 b0 = _mm512_loadu_ps(b + k * NR);
    e0 = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(0, k)), b0, e0);
    if constexpr (R > 1) e1 = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(1, k)), b0, e1);
    if constexpr (R > 2) e2 = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(2, k)), b0, e2);
    if constexpr (R > 3) e3 = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(3, k)), b0, e3);
    if constexpr (R > 4) e4 = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(4, k)), b0, e4);
    if constexpr (R > 5) e5 = _mm512_fmadd_ps(_mm512_set1_ps(*a.at(5, k)), b0, e5);
  }
  const __m512 acc[MR] = {_mm512_add_ps(e0, o0), _mm512_add_ps(e1, o1), _mm512_add_ps(e2, o2),
                          _mm512_add_ps(e3, o3), _mm512_add_ps(e4, o4), _mm512_add_ps(e5, o5)};
  const __mmask16 cols = nr >= NR ? __mmask16(0xffff) : __mmask16((1u << nr) - 1);
  for (int64_t m = 0; m < mr; ++m) {
    float* p = c + m * ldc;
    const __m512 v = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(cols, p), acc[m]) : acc[m];
    _mm512_mask_storeu_ps(p, cols, v);
  }
}

// c[MR x 32] = a [6][kc] . [b0 | b1] (two [kc][16] panels), the first nr columns (attn.h's scores and p @ v):
// per k 2 loads of W and 6 broadcasts feed 12 FMAs, where f32_micro_z's 6 broadcasts feed 6.
inline void f32_micro_z2(const Rows& a_in, const float* b0, const float* b1, int64_t kc, float* c, int64_t ldc,
                         int64_t nr) {
  const Rows a = a_in;
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m512 d0 = c0, d1 = c0, d2 = c0, d3 = c0, d4 = c0, d5 = c0;
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w0 = _mm512_loadu_ps(b0 + k * NR), w1 = _mm512_loadu_ps(b1 + k * NR);
#define AOTLM_ROW_Z2(m, x, y)                      \
  {                                                 \
    const __m512 av = _mm512_set1_ps(*a.at(m, k));  \
    x = _mm512_fmadd_ps(av, w0, x);                 \
    y = _mm512_fmadd_ps(av, w1, y);                 \
  }
    AOTLM_ROW_Z2(0, c0, d0)
    AOTLM_ROW_Z2(1, c1, d1)
    AOTLM_ROW_Z2(2, c2, d2)
    AOTLM_ROW_Z2(3, c3, d3)
    AOTLM_ROW_Z2(4, c4, d4)
    AOTLM_ROW_Z2(5, c5, d5)
#undef AOTLM_ROW_Z2
  }
  const __m512 lo[MR] = {c0, c1, c2, c3, c4, c5}, hi[MR] = {d0, d1, d2, d3, d4, d5};
  const __mmask16 second = nr >= 2 * NR ? __mmask16(0xffff) : __mmask16((1u << (nr - NR)) - 1);
  for (int64_t m = 0; m < MR; ++m) {
    _mm512_storeu_ps(c + m * ldc, lo[m]);
    _mm512_mask_storeu_ps(c + m * ldc + NR, second, hi[m]);
  }
}

#if defined(__AVX512VNNI__)
// x int8 [M, K] -> xp [groups of MRV rows][K4][MRV][4] bytes (rows past M and k past K: 0), and
// corr[m] = 128 * sum_k x[m, k] (0 past M).
inline void vnni_pack_x(const int8_t* x, int64_t M, int64_t K, int64_t K4, int8_t* xp, int32_t* corr) {
  const int64_t G = (M + MRV - 1) / MRV;
  aotlm::parallel_for(int(G), [&](int g) {
    int8_t* dst = xp + g * K4 * MRV * 4;
    for (int64_t r = 0; r < MRV; ++r) {
      const int64_t m = g * MRV + r, full = m < M ? K / 4 : 0;  // rows past M: all zeros
      const int8_t* src = x + std::min(m, M - 1) * K;
      __m512i acc = _mm512_setzero_si512();  // sum of the row: vpdpbusd of ones and 64 bytes at a time
      for (int64_t k = 0; k < (m < M ? K : 0); k += 64) {
        const __mmask64 in = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
        acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi8(1), _mm512_maskz_loadu_epi8(in, src + k));
      }
      const int32_t sum = _mm512_reduce_add_epi32(acc);
      for (int64_t q = 0; q < full; ++q) std::memcpy(dst + (q * MRV + r) * 4, src + 4 * q, 4);
      for (int64_t q = full; q < K4; ++q) {  // an odd K / 2's last group (2 rows, 2 zeros); rows past M
        int8_t t[4] = {0, 0, 0, 0};
        if (m < M) std::memcpy(t, src + 4 * q, size_t(K - 4 * q));
        std::memcpy(dst + (q * MRV + r) * 4, t, 4);
      }
      corr[g * MRV + r] = 128 * sum;
    }
  });
}

// One int8 panel (Kh pairs of rows, [Kh][16][2]) -> wb [K4][16][4] unsigned bytes w + 128: each 64
// bytes (pairs 2q and 2q + 1) regrouped by one vpermw so a column's 4 rows share an int32 lane (``offset``
// false: the signed bytes as they are, for AMX's tdpbssd). An
// odd Kh's last group reads only its own 32 bytes (the rest: 0, which x's zero padding multiplies).
inline void vnni_regroup(const int8_t* panel, int64_t Kh, uint8_t* wb, bool offset = true) {
  alignas(64) static const int16_t idx[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                              8,  24, 9,  25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(idx), flip = _mm512_set1_epi8(offset ? char(0x80) : char(0));
  for (int64_t j = 0; j < Kh; j += 2) {
    const __mmask64 in = j + 1 < Kh ? ~__mmask64(0) : __mmask64(0xffffffffu);
    const __m512i v = _mm512_maskz_loadu_epi8(in, panel + j * 2 * NR);
    _mm512_storeu_si512(wb + j * 2 * NR, _mm512_xor_si512(_mm512_permutexvar_epi16(perm, v), flip));
  }
}

// What vnni_micro<NP, FIN> does to its sums before storing them: FIN false, nothing (the raw sums, for
// i8_finish); true: i8_finish's math, (sum * sx[m]) * scale[n] (+ bias[n], act), on 8-lane halves with the same
// operations, so the numbers are i8_finish's bit for bit, without the pass over a buffer of sums.
struct VnniOut {
  const float *sx = nullptr, *scale = nullptr, *bias = nullptr;
  int32_t act = 0;
};

template <bool FIN>
inline void vnni_store(__m512 v, const VnniOut& e, int64_t m, int64_t j, float* dst) {
  if constexpr (!FIN) {
    _mm512_storeu_ps(dst, v);
  } else {
    v = _mm512_mul_ps(v, _mm512_set1_ps(e.sx[m]));
    const __m256 h[2] = {_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)};
    for (int i = 0; i < 2; ++i) {
      const int64_t n = j + 8 * i;
      const __m256 sc = e.scale ? _mm256_loadu_ps(e.scale + n) : _mm256_set1_ps(1.f);
      _mm256_storeu_ps(dst + 8 * i, finish(h[i], sc, e.bias ? e.bias + n : nullptr, e.act));
    }
  }
}

// MRV packed rows (a: [K4][MRV][4]) x NP (1 or 2) regrouped panels (wb: [NP][K4][64]) -> out[m * ld + 0..16 NP)
// (f32, unscaled; FIN: finished by vnni_store), mr rows. Two panels: each broadcast of x feeds two vpdpbusd
// (24 sums), so a step of 4 K rows issues 2 + 12 loads for 24 multiply-adds instead of 1 + 12 for 12 (the
// loads had bound the loop).
// Named accumulators: with an array g++ rotated them through 24 register moves per 12 vpdpbusd.
template <int NP, bool FIN>
inline void vnni_micro(const int8_t* a, const uint8_t* wb, int64_t K4, const int32_t* corr, float* out, int64_t ld,
                       int64_t mr, const VnniOut& e) {
  __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
          c9 = c0, c10 = c0, c11 = c0;
  __m512i d0 = c0, d1 = c0, d2 = c0, d3 = c0, d4 = c0, d5 = c0, d6 = c0, d7 = c0, d8 = c0, d9 = c0, d10 = c0,
          d11 = c0;
  const uint8_t* wb1 = wb + K4 * 64;
  for (int64_t q = 0; q < K4; ++q) {
    const __m512i w = _mm512_loadu_si512(wb + q * 64);
    const __m512i v = NP == 2 ? _mm512_loadu_si512(wb1 + q * 64) : w;
    const int8_t* aq = a + q * MRV * 4;
#define AOTLM_DP(m, c, d)                                    \
  {                                                          \
    int32_t x4;                                              \
    std::memcpy(&x4, aq + 4 * m, 4);                         \
    const __m512i xb = _mm512_set1_epi32(x4);                \
    c = _mm512_dpbusd_epi32(c, w, xb);                       \
    if constexpr (NP == 2) d = _mm512_dpbusd_epi32(d, v, xb); \
  }
    AOTLM_DP(0, c0, d0)
    AOTLM_DP(1, c1, d1)
    AOTLM_DP(2, c2, d2)
    AOTLM_DP(3, c3, d3)
    AOTLM_DP(4, c4, d4)
    AOTLM_DP(5, c5, d5)
    AOTLM_DP(6, c6, d6)
    AOTLM_DP(7, c7, d7)
    AOTLM_DP(8, c8, d8)
    AOTLM_DP(9, c9, d9)
    AOTLM_DP(10, c10, d10)
    AOTLM_DP(11, c11, d11)
#undef AOTLM_DP
  }
  const __m512i acc[MRV] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  const __m512i acd[MRV] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11};
  for (int64_t m = 0; m < mr; ++m) {
    const __m512i k = _mm512_set1_epi32(corr[m]);
    vnni_store<FIN>(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m], k)), e, m, 0, out + m * ld);
    if constexpr (NP == 2)
      vnni_store<FIN>(_mm512_cvtepi32_ps(_mm512_sub_epi32(acd[m], k)), e, m, NR, out + m * ld + NR);
  }
}

// y [M, N] = act((x [M, K] @ W) * sx[m] * scale[n] + bias[n]) for int8 x and int8 W panels, as gemm.h's
// i8_gemm (the same blocking on pairs of panels: threads take ranges of pairs, MC groups of packed x per
// pass, ~192 KB in L2).
inline void i8_gemm_vnni(const int8_t* x, const float* sx, const int8_t* w, const float* scale, const float* bias,
                         int32_t act, int64_t M, int64_t K, int64_t N, const Out& out) {
  const int64_t G = (M + MRV - 1) / MRV, Kh = K / 2, K4 = (Kh + 1) / 2, Np = N / NR;
  // f32 out in place (as i8_finish's) and no activation: each tile writes its finished rows into y. With the
  // gelu in the tiles GPT-2-small's prompt was slower (1 x 128: 0.97x), so that keeps the pass.
  const bool direct = out.dt == DataType::F32 && !out.rows && act == ACT_NONE;
  int8_t* xp = scratch<int8_t>(size_t(G * K4 * MRV * 4));
  int32_t* corr = scratch<int32_t>(size_t(G * MRV));
  vnni_pack_x(x, M, K, K4, xp, corr);
  const auto wb = [K4]() -> uint8_t* {  // the calling thread's regrouped pair of panels
    thread_local std::vector<uint8_t> b;
    b.resize(size_t(2 * K4 * 64));
    return b.data();
  };
  blocked<2>(
      M, Np, MRV, K4 * MRV * 4,
      [&](int64_t u) {
        for (int64_t p = 2 * u; p < std::min(Np, 2 * u + 2); ++p)
          vnni_regroup(w + p * Kh * 2 * NR, Kh, wb() + (p - 2 * u) * K4 * 64);
      },
      [&](int64_t g, int64_t u, float* c, int64_t ld, int64_t mr) {
        const int64_t m0 = g * MRV, n0 = 2 * u * NR;  // f32 out in place: the tile writes the finished rows
        const VnniOut e = direct ? VnniOut{sx + m0, scale ? scale + n0 : nullptr, bias ? bias + n0 : nullptr, act}
                                 : VnniOut{};
        float* dst = direct ? static_cast<float*>(out.y) + m0 * N + n0 : c;
        const int64_t dld = direct ? N : ld;
        const int8_t* a = xp + g * K4 * MRV * 4;
        if (2 * u + 1 < Np)
          direct ? vnni_micro<2, true>(a, wb(), K4, corr + m0, dst, dld, mr, e)
                 : vnni_micro<2, false>(a, wb(), K4, corr + m0, dst, dld, mr, e);
        else
          direct ? vnni_micro<1, true>(a, wb(), K4, corr + m0, dst, dld, mr, e)
                 : vnni_micro<1, false>(a, wb(), K4, corr + m0, dst, dld, mr, e);
      },
      [&](int64_t m, float* r, int64_t n0, int64_t ld) {
        if (!direct) i8_finish(r, sx[m], scale, bias, act, n0, ld, out, m * N + n0);
      });
}
#if defined(AOTLM_AMX)
#include "amx8.h"  // the same GEMM on AMX tiles (the amx level)
#endif
#endif  // __AVX512VNNI__

#if defined(__AVX512BF16__)
// bf16 x [M, K] (K even) -> xp [groups of MRV rows][Kh][MRV] 32-bit words, each a row's (k, k + 1) pair of
// bf16 values as vdpbf16ps broadcasts it (rows past M: 0).
inline void bf16_pack_x(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t G = (M + MRV - 1) / MRV, Kh = K / 2;
  aotlm::parallel_for(int(G), [&](int g) {
    uint32_t* dst = xp + g * Kh * MRV;
    for (int64_t r = 0; r < MRV; ++r) {
      const int64_t m = g * MRV + r;
      if (m >= M) {
        for (int64_t q = 0; q < Kh; ++q) dst[q * MRV + r] = 0;
        continue;
      }
      const uint16_t* src = x + m * K;
      for (int64_t q = 0; q < Kh; ++q) std::memcpy(dst + q * MRV + r, src + 2 * q, 4);
    }
  });
}

// MRV packed rows (a: [Kh][MRV] pairs) x one bf16 panel ([Kh][16][2], as stored) -> out[m * ld + 0..15]
// (f32 sums), mr rows: per pair of K rows one 64-byte load of W and MRV vdpbf16ps, each adding a lane's
// two bf16 products (exact in f32) to its f32 sum.
inline void bf16_micro(const uint32_t* a, const uint16_t* panel, int64_t Kh, float* out, int64_t ld, int64_t mr) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
         c9 = c0, c10 = c0, c11 = c0;
  for (int64_t q = 0; q < Kh; ++q) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + q * 2 * NR);
    const uint32_t* aq = a + q * MRV;
#define AOTLM_BF(m, c) c = _mm512_dpbf16_ps(c, w, (__m512bh)_mm512_set1_epi32(int(aq[m])));
    AOTLM_BF(0, c0)
    AOTLM_BF(1, c1)
    AOTLM_BF(2, c2)
    AOTLM_BF(3, c3)
    AOTLM_BF(4, c4)
    AOTLM_BF(5, c5)
    AOTLM_BF(6, c6)
    AOTLM_BF(7, c7)
    AOTLM_BF(8, c8)
    AOTLM_BF(9, c9)
    AOTLM_BF(10, c10)
    AOTLM_BF(11, c11)
#undef AOTLM_BF
  }
  const __m512 acc[MRV] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  for (int64_t m = 0; m < mr; ++m) _mm512_storeu_ps(out + m * ld, acc[m]);
}

// The bf16 GEMMs' output pass over one row r [ld] of sums (columns n0..): * scale[n] (null: 1), + bias[n]
// (null: none), the activation, written to out at off.
inline void bf16_finish(float* r, const float* scale, const float* bias, int32_t act, int64_t n0, int64_t ld,
                        const Out& out, int64_t off) {
  for (int64_t j = 0; j < ld; j += 8) {
    const __m256 sv = scale ? _mm256_loadu_ps(scale + n0 + j) : _mm256_set1_ps(1.f);
    _mm256_storeu_ps(r + j, finish(_mm256_loadu_ps(r + j), sv, bias ? bias + n0 + j : nullptr, act));
  }
  out.put(off, r, int(ld));
}

// y [M, N] = act(x @ W * scale[n] + bias[n]) for bf16 x and bf16 W panels (scale / bias may be null), on
// vdpbf16ps: the blocking of i8_gemm_vnni (threads take panel ranges, MC groups of packed x per pass).
inline void bf16_gemm_dp(const uint16_t* x, const uint16_t* w, const float* scale, const float* bias, int32_t act,
                         int64_t M, int64_t K, int64_t N, const Out& out) {
  const int64_t G = (M + MRV - 1) / MRV, Kh = K / 2;
  uint32_t* xp = scratch<uint32_t>(size_t(G * Kh * MRV));
  bf16_pack_x(x, M, K, xp);
  blocked(
      M, N / NR, MRV, Kh * MRV * 4, [](int64_t) {},
      [&](int64_t g, int64_t p, float* c, int64_t ld, int64_t mr) {
        bf16_micro(xp + g * Kh * MRV, w + p * Kh * 2 * NR, Kh, c, ld, mr);
      },
      [&](int64_t m, float* r, int64_t n0, int64_t ld) { bf16_finish(r, scale, bias, act, n0, ld, out, m * N + n0); });
}
#if defined(AOTLM_AMX)
#include "amx16.h"  // bf16 panels on AMX tiles: bf16 x, and f32 x in three bf16 parts (the amx level)
#endif
#endif  // __AVX512BF16__
#endif  // __AVX512F__
