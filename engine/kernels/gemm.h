// Prefill GEMMs (included by wmatmul.cc after packed.h): many rows (M > the row kernels' limit).
//
//   gemm<RowMajorW>:  y[M,N] = act(x[M,K] @ W[K,N] + b)            f32 x, f32 W row-major    (aotlm_gemm)
//   gemm<PanelW>:     y[M,N] = act(x @ float(W) * s[n] + b)        f32 x, int8 / bf16 / f16 / f32 W panels (packed.h)
//   i8_gemm:          y[M,N] = (xq[M,K] @ W[K,N]) * sx[m] * s[n]    W8A8: int8 x, int8 W panels (aotlm_gemm_pk)
//
// Micro-kernel (f32): 6 rows x 16 columns = 12 accumulators + 2 W vectors + 1 broadcast (15 of 16
// ymm) over a block of KC rows of W laid out [kc][16]; the 6 rows of x are read where they are
// (Rows; also the attention's scores and p @ v, attn.h).
//
// W: each KC-row block of a 16-column panel is widened to f32 [kc][16] in the thread's buffer
// (packed.h's unpack_pairs for int8 / bf16 / f16 / f32 panels; a copy of 16 columns of a row-major f32
// W) just before every group of rows of the MC block passes over it, so x stays f32 (no rounding)
// and W is read in its stored bytes once per MC block; the int8 scale, the bias and the MLP's
// activation are applied to the sums as they are written (finish). Measured on the 2-core EPYC
// (Zen 2) against the f32 FMA peak of 215 GFLOP/s (scripts/bench_gemm.py): int8 panels 181-192
// GFLOP/s on GPT-2-small's prefill shapes at 128 and 1024 rows, where XLA's f32 dot ran 155-168 at
// 128 rows inside the model. int8 panels first took int16-rounded x and vpmaddwd (below): no
// faster, because on Zen 2 vector integer multiplies issue on one pipe, f32 FMAs on two.
//
// W8A8 (quant="w8a8"): x given as int8 with its per-row scale (absmax / 127, computed in the graph
// so the pure-JAX path does the same math), packed into [groups of 6 rows][K/2][6][2] int16 pairs;
// W's panels are already the vpmaddwd operands after a vpmovsxbw, so nothing of W is repacked.
// Why vpmaddwd on sign-extended int8 and not vpmaddubsw (u8 x s8): every vector integer multiply
// issues on one pipe here, so vpmaddubsw + vpmaddwd(ones) runs no faster than vpmaddwd alone and
// both match the f32 FMA peak (one core, L1-resident tile: f32 6x16 FMA 105 Gop/s, vpmaddwd 94,
// u8 x s8 4x24 102); vpmaddubsw would also saturate (2 * 255 * 127 > 32767). Sums stay int32 over
// all of K (|x|, |w| <= 127: no overflow below K = 133k), so the result equals the graph's
// ``dot(int8, int8) -> int32`` exactly.
//
// ISA levels (aotlm.kernels.isa; one source, built per level): avx2 as above; avx512 runs f32_micro
// (this GEMM's and attn.h's) on 16-lane FMAs (gemm512.h); avx512vnni also W8A8 on vpdpbusd
// (i8_gemm_vnni) and i8_micro's vpmaddwd + vpaddd as one vpdpwssd.
#pragma once

namespace aotlm_gm {
constexpr int64_t MR = 6, NR = 16;

// The calling thread's packed-x buffer, kept between calls (a fresh vector page-faults and zeroes
// MBs per call). Lambdas run on other threads must use the pointer: a thread_local named inside
// them would be that thread's own.
template <class T>
inline T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

using aotlm_ep::ACT_GELU_TANH;  // the output pass (epilogue.h), shared with the decode kernels
using aotlm_ep::ACT_NONE;
using aotlm_ep::ACT_RELU;
using aotlm_ep::exp256;
#if defined(__AVX512F__)
using aotlm_ep::exp512;
#endif
using aotlm_ep::finish;

// The W8A8 GEMMs' output pass over one row r [ld] of sums (columns n0..): (sum * sx) * scale[n] -- the
// graph's order of the W8A8 math, so without bias and act equal bit for bit to XLA's -- then + bias[n]
// and the activation (finish), written to out at off.
inline void i8_finish(float* r, float sx, const float* scale, const float* bias, int32_t act, int64_t n0, int64_t ld,
                      const Out& out, int64_t off) {
  const __m256 sv = _mm256_set1_ps(sx);
  const bool direct = out.dt == DataType::F32 && !out.rows;  // f32 out in place: written once, no copy
  float* dst = direct ? static_cast<float*>(out.y) + off : r;
  for (int64_t j = 0; j < ld; j += 8) {
    const __m256 sc = scale ? _mm256_loadu_ps(scale + n0 + j) : _mm256_set1_ps(1.f);
    _mm256_storeu_ps(dst + j, finish(_mm256_mul_ps(_mm256_loadu_ps(r + j), sv), sc, bias ? bias + n0 + j : nullptr, act));
  }
  if (!direct) out.put(off, r, int(ld));
}

// The blocking of the GEMMs on packed x (W8A8, bf16 x): threads take ranges of units of U panels; per range,
// MCG groups of `rows` packed rows at a time (their packed x within x_budget, in L2; `group_bytes` each), and every
// unit passes under each group of the block: prep(u) readies unit u (panels uU .. uU + U - 1, the last unit
// possibly fewer), tile(g, u, c, ld, mr) writes group g's sums for its panels at c (row stride ld, mr rows),
// then done(m, r, n0, ld) takes each finished row m's sums r.
// Packed x per pass: half a core's L2 (the rest holds the panel and the sums; 192 KB where the size is
// unknown): the fewer passes, the fewer times each panel is regrouped (scripts/README.md, bench_gemm).
inline int64_t x_budget() {
  static const int64_t b = std::max<int64_t>(192 << 10, sysconf(_SC_LEVEL2_CACHE_SIZE) / 2);
  return b;
}

template <int U = 1, class Prep, class Tile, class Done>
inline void blocked(int64_t M, int64_t Np, int64_t rows, int64_t group_bytes, const Prep& prep, const Tile& tile,
                    const Done& done) {
  const int64_t G = (M + rows - 1) / rows, cap = std::max<int64_t>(1, x_budget() / group_bytes);
  const int64_t passes = (G + cap - 1) / cap, MCG = (G + passes - 1) / passes;  // passes of even size
  aotlm_pk::panel_ranges((Np + U - 1) / U, 4, [&](int64_t u0, int64_t u1) {
    const int64_t p0 = u0 * U, ld = (std::min(Np, u1 * U) - p0) * NR, n0 = p0 * NR;
    thread_local std::vector<float> buf;
    buf.resize(size_t(rows * MCG * ld));
    for (int64_t g0 = 0; g0 < G; g0 += MCG) {
      const int64_t g1 = std::min(G, g0 + MCG), m0 = g0 * rows, last = std::min(M, g1 * rows);
      for (int64_t u = u0; u < u1; ++u) {
        prep(u);
        for (int64_t g = g0; g < g1; ++g)
          tile(g, u, buf.data() + (g - g0) * rows * ld + (u * U - p0) * NR, ld, std::min(rows, M - g * rows));
      }
      for (int64_t m = m0; m < last; ++m) done(m, buf.data() + (m - m0) * ld, n0, ld);
    }
  });
}

// ----------------------------------------------------------------- f32
// The micro-kernel's x operand: 6 rows read in place (rows of x, or of the attention's q and p).
struct Rows {
  const float* r[MR];
  const float* at(int m, int64_t k) const { return r[m] + k; }
};

// c[6 x 16] (= or +=) a [6][kc] . b [kc][16]; only mr rows x nr columns of c are written. R < 6: only
// R rows are computed (the last group of a GEMM's rows; 128 rows are 21 groups and 2 rows).
#include "gemm512.h"  // the avx512 / avx512vnni builds' inner loops (f32_micro_z, i8_gemm_vnni)

template <int R = MR>
inline void f32_micro(const Rows& a_in, const float* b, int64_t kc, float* c, int64_t ldc, bool add, int64_t mr,
                      int64_t nr) {
#if defined(__AVX512F__)
  return f32_micro_z<R>(a_in, b, kc, c, ldc, add, mr, nr);  // 16-lane FMAs (gemm512.h)
#endif
  const Rows a = a_in;  // a local copy: the row pointers stay in registers
  // 12 named accumulators: with an __m256 array g++ stored every one to the stack each k (4x slower)
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
#define AOTLM_ROW(m, r0, r1)                            \
  if constexpr (m < R) {                                 \
    const __m256 av = _mm256_broadcast_ss(a.at(m, k));   \
    r0 = _mm256_fmadd_ps(av, b0, r0);                    \
    r1 = _mm256_fmadd_ps(av, b1, r1);                    \
  }
    AOTLM_ROW(0, c00, c01)
    AOTLM_ROW(1, c10, c11)
    AOTLM_ROW(2, c20, c21)
    AOTLM_ROW(3, c30, c31)
    AOTLM_ROW(4, c40, c41)
    AOTLM_ROW(5, c50, c51)
#undef AOTLM_ROW
  }
  const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  if (mr == MR && nr == NR) {
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 2; ++v) {
        float* p = c + m * ldc + 8 * v;
        _mm256_storeu_ps(p, add ? _mm256_add_ps(_mm256_loadu_ps(p), acc[m][v]) : acc[m][v]);
      }
    return;
  }
  alignas(32) float t[MR][NR];
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

// ----------------------------------------------------------------- W sources
// What the GEMM's W is: each gives rows [k0, k0 + kc) of its 16-column panel p as f32 [kc][16].
struct RowMajorW {  // f32 W [K, N] (columns past N: zeros)
  const float* w;
  int64_t N;
  void operator()(int64_t p, int64_t k0, int64_t kc, float* dst) const {
    const int64_t nr = std::min(NR, N - p * NR);
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = w + (k0 + k) * N + p * NR;
      if (nr == NR) {
        _mm256_storeu_ps(dst + k * NR, _mm256_loadu_ps(src));
        _mm256_storeu_ps(dst + k * NR + 8, _mm256_loadu_ps(src + 8));
      } else {
        for (int64_t n = 0; n < NR; ++n) dst[k * NR + n] = n < nr ? src[n] : 0.f;
      }
    }
  }
};
struct PanelW {  // int8 / bf16 / f16 / f32 W packed [N/16][K/2][16][2] (packed.h), widened (k0, kc even)
  DataType wt;
  const void* wp;
  int64_t Kh;
  void operator()(int64_t p, int64_t k0, int64_t kc, float* dst) const {
    const int64_t off = (p * Kh + k0 / 2) * 2 * NR;
    if (wt == DataType::BF16)
      aotlm_pk::bf16_unpack_pairs(static_cast<const uint16_t*>(wp) + off, kc / 2, dst, NR);
    else if (wt == DataType::F16)
      aotlm_pk::f16_unpack_pairs(static_cast<const uint16_t*>(wp) + off, kc / 2, dst, NR);
    else if (wt == DataType::F32)
      aotlm_pk::f32_unpack_pairs(static_cast<const float*>(wp) + off, kc / 2, dst, NR);
    else
      aotlm_pk::unpack_pairs(static_cast<const int8_t*>(wp) + off, kc / 2, dst, NR);
  }
};

// y [M, N] = act(x [M, K] @ W (* scale[n]) (+ bias[n])) (W's last panel may be partial). Threads take ranges of
// panels, PC panels at a time; per MC block of rows, each panel's KC blocks are widened to f32 in
// turn (bb, in L2) and every group of 6 rows (read in place: Rows) runs over it, the sums parked in
// cb (MC rows x PC panels) until finish() writes each row's PC * 16 columns.
template <class W>
inline void gemm(const W& w, const float* x, const float* scale, const float* bias, int32_t act, int64_t M,
                 int64_t K, int64_t N, const Out& out) {
  const int64_t G = (M + MR - 1) / MR, Np = (N + NR - 1) / NR;
  // Blocks: KC 768 rows of a panel widened at once (48 KB), MC 64 groups (384 rows), PC 4 panels
  // per output write (256 bytes per row: 64-byte writes to rows 12 KB apart cost the 1024 x 768 x
  // 3072 product its TLB: 179.8 -> 189.3 GFLOP/s). In the standalone harness of GPT-2-small's
  // shapes KC 768 / MC 64 beat 256 / 32 by 1-4%, x read in place beat packing it per call by 1-5%
  // (1024 x 3072 x 768: 196.6 vs 188.1 GFLOP/s; its packing alone took 1.6 ms), and larger blocks
  // did not help.
  constexpr int64_t KC = 768, MCG = 64, PC = 4, LD = PC * NR;
  aotlm_pk::panel_ranges(Np, 4, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> bb, cb;
    bb.resize(size_t(KC * NR));
    cb.resize(size_t(MCG * MR * LD));
    for (int64_t g0 = 0; g0 < G; g0 += MCG) {
      const int64_t g1 = std::min(G, g0 + MCG);
      for (int64_t q0 = p0; q0 < p1; q0 += PC) {
        const int64_t q1 = std::min(p1, q0 + PC);
        for (int64_t p = q0; p < q1; ++p)
          for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = std::min(KC, K - k0);
            w(p, k0, kc, bb.data());
            for (int64_t g = g0; g < g1; ++g) {
              Rows a;  // rows past M repeat the last one (their sums are not written)
              for (int64_t r = 0; r < MR; ++r) a.r[r] = x + std::min(g * MR + r, M - 1) * K + k0;
              float* c = cb.data() + (g - g0) * MR * LD + (p - q0) * NR;
              switch (std::min(MR, M - g * MR)) {  // the last group: only its rows
                case 1: f32_micro<1>(a, bb.data(), kc, c, LD, k0 > 0, MR, NR); break;
                case 2: f32_micro<2>(a, bb.data(), kc, c, LD, k0 > 0, MR, NR); break;
                case 3: f32_micro<3>(a, bb.data(), kc, c, LD, k0 > 0, MR, NR); break;
                case 4: f32_micro<4>(a, bb.data(), kc, c, LD, k0 > 0, MR, NR); break;
                case 5: f32_micro<5>(a, bb.data(), kc, c, LD, k0 > 0, MR, NR); break;
                default: f32_micro(a, bb.data(), kc, c, LD, k0 > 0, MR, NR); break;
              }
            }
          }
        const int64_t width = std::min((q1 - q0) * NR, N - q0 * NR);
        for (int64_t m = g0 * MR; m < std::min(M, g1 * MR); ++m) {
          float* r = cb.data() + (m - g0 * MR) * LD;
          for (int64_t j = 0; j < width; j += 8) {
            const int64_t n = q0 * NR + j;
            alignas(32) float st[8] = {1, 1, 1, 1, 1, 1, 1, 1}, bt[8] = {};
            const float *sp = scale ? scale + n : nullptr, *bp = bias ? bias + n : nullptr;
            if (j + 8 > width) {  // the last columns of a partial panel: scale and bias padded
              for (int64_t e = 0; e < width - j; ++e) {
                st[e] = scale ? scale[n + e] : 1.f;
                bt[e] = bias ? bias[n + e] : 0.f;
              }
              sp = scale ? st : nullptr;
              bp = bias ? bt : nullptr;
            }
            const __m256 sv = sp ? _mm256_loadu_ps(sp) : _mm256_set1_ps(1.f);
            _mm256_storeu_ps(r + j, finish(_mm256_loadu_ps(r + j), sv, bp, act));
          }
          out.put(m * N + q0 * NR, r, int(width));
        }
      }
    }
  });
}

// ----------------------------------------------------------------- W8A8 (int8 x, int8 W panels)
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
// only mr rows written; one int32 sum over all of K (exact for int8 x).
inline void i8_micro(const int16_t* a, const int8_t* panel, int64_t Kh, float* out, int64_t ld, int64_t mr) {
  __m256i acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  for (int64_t j = 0; j < Kh; ++j) {
    const int8_t* r = panel + j * 2 * NR;
    const __m256i w0 = aotlm_pk::w16(r), w1 = aotlm_pk::w16(r + 16);
    const int16_t* aj = a + j * MR * 2;
    for (int m = 0; m < MR; ++m) {
      const __m256i xb = aotlm_i8::pair_at(aj + 2 * m);
      acc[m][0] = aotlm_i8::madd_add(acc[m][0], w0, xb);
      acc[m][1] = aotlm_i8::madd_add(acc[m][1], w1, xb);
    }
  }
  for (int64_t m = 0; m < mr; ++m)  // a panel row's first 16 bytes are columns 0-7, the next 16 columns 8-15
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + m * ld + 8 * v, _mm256_cvtepi32_ps(acc[m][v]));
}

// x f32 [M, K] -> q int8 [M, K] and s [M]: aotlm_i8::round_row_s8 per row, rows in parallel.
inline void quantize_rows_s8(const float* x, int64_t M, int64_t K, int8_t* q, float* s) {
  aotlm::parallel_for(int(std::min<int64_t>(M, 64)), [&](int part) {
    const int64_t parts = std::min<int64_t>(M, 64);
    for (int64_t m = M * part / parts; m < M * (part + 1) / parts; ++m)
      s[m] = aotlm_i8::round_row_s8(x + m * K, K, q + m * K);
  });
}

// y [M, N] = act(xq @ W * sx[m] * scale[n] + bias[n]); xq [M, Kp] int16 holding int8 values, W packed
// [N/16][K/2][16][2].
// Threads take panel ranges; per range, MC rows at a time (their packed x ~192 KB, in L2), each
// panel (K/2 x 32 bytes, in L1/L2) passes under every group of the block.
inline void i8_gemm(const int16_t* xq, int64_t Kp, const float* sx, const int8_t* w, const float* scale,
                    const float* bias, int32_t act, int64_t M, int64_t K, int64_t N, const Out& out) {
  const int64_t G = (M + MR - 1) / MR, Kh = K / 2;
  int16_t* xp = scratch<int16_t>(size_t(G * Kh * MR * 2));
  i8_pack_x(xq, M, Kp, Kh, xp);
  blocked(
      M, N / NR, MR, Kh * MR * 2 * 2, [](int64_t) {},
      [&](int64_t g, int64_t p, float* c, int64_t ld, int64_t mr) {
        i8_micro(xp + g * Kh * MR * 2, w + p * Kh * 2 * NR, Kh, c, ld, mr);
      },
      [&](int64_t m, float* r, int64_t n0, int64_t ld) { i8_finish(r, sx[m], scale, bias, act, n0, ld, out, m * N + n0); });
}

}  // namespace aotlm_gm
