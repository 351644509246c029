// Prefill attention over a call's own tokens (included by wmatmul.cc after gemm.h):
//
//   aotlm_attn:  o[b,i,h,:] = sum_j p[b,h,i,j] v[b,j,h/g,:],  p = softmax_j(mask[b,i,j] ? scale q.k_j : -inf)
//
// q [B,T,H,Dh], k and v [B,T,Kh,Dh] (H = g * Kh: grouped-query heads), mask [B,T,T] (bool) is
// causal (j <= i; only those keys are computed: half the work) with padding keys and any sliding
// window already cleared; a query row with no visible key gets zeros. f32 throughout. Also out:
// k as [B,Kh,T,Dh] and v as [B,Kh,Dh,T], the KV cache's layouts (layers.update_cache), written
// while packing them: XLA's transposing cache write of v took 2.1 ms per layer at batch 8.
//
// Why a kernel: XLA ran GPT-2-small's 128-token prefill attention as a batched dot for the scores,
// a mask select, a softmax, a layout copy and a second batched dot, all on whole [T, T] blocks
// (~9 ms per layer at batch 8, ~10% of the prefill). Here one task is (row b, kv head, block of QB
// query rows): K^T and V of the block's keys are packed into 16-column panels once and serve the
// g query heads; scores and p @ v run on gemm.h's 6 x 16 FMA micro-kernel (6 x 32 in 16-lane builds),
// so a whole head's scores never leave L2.
#pragma once

namespace aotlm_at {
using aotlm_gm::MR;
using aotlm_gm::NR;
constexpr int64_t QB = 48;  // query rows per task: 8 groups of 6
#if defined(__AVX512F__)
constexpr int64_t STEP = 2;  // 16-column panels per micro-kernel tile (gemm512.h's f32_micro_z2)
#else
constexpr int64_t STEP = 1;
#endif

struct Dims {
  int64_t B, T, H, Kh, Dh;
};

// Where q, k and v rows live: q of head h at token t of row b is q + (b * T + t) * qs + (h / g) *
// gs + (h % g) * Dh (g = H / Kh), k and v of kv head kh at k / v + (b * T + t) * ks + kh * kgs.
// Separate arrays [B,T,H,Dh] / [B,T,Kh,Dh], or views into one fused qkv [B,T,Kh,g+2,Dh] (the
// fused projection's output, models/layers.project_qkv: no slicing copies in the graph).
struct Src {
  const float *q, *k, *v;
  int64_t qs, gs, ks, kgs;
};

#if defined(__AVX512F__)
// softmax_row on 16 lanes, the row's tail under a mask: no scalar std::exp for the last n % 8 keys.
inline float softmax_row_z(float* si, const uint8_t* mi, int64_t n, int64_t last, float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  const auto lanes = [n](int64_t j) { return n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1); };
  const auto vis = [&](int64_t j, __mmask16 in) {  // visible lanes: mask byte != 0
    return _mm_mask_cmpneq_epi8_mask(in, _mm_maskz_loadu_epi8(in, mi + j), _mm_setzero_si128());
  };
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = lanes(j);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, si + j), sc);
    _mm512_mask_storeu_ps(si + j, in, x);
    mx = _mm512_mask_max_ps(mx, vis(j, in), mx, x);
  }
  const float m = _mm512_reduce_max_ps(mx);
  if (m == -INFINITY) {
    std::fill(si, si + std::max(n, last), 0.f);
    return 0.f;
  }
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = lanes(j);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, si + j), mv);
    const __m512 e = _mm512_maskz_mov_ps(vis(j, in), aotlm_gm::exp512(x));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(si + j, in, e);
  }
  std::fill(si + n, si + std::max(n, last), 0.f);
  return 1.f / _mm512_reduce_add_ps(sum);
}
#endif

// Softmax of one row of scores si[0..n) (keys j <= i; mi: visibility bytes), in place: si[j] becomes
// the unnormalised weight for j < last (0 past n and where hidden). Returns 1 / sum, or 0 when no
// key is visible (a padding query: its output is zeros).
inline float softmax_row(float* si, const uint8_t* mi, int64_t n, int64_t last, float scale) {
#if defined(__AVX512F__)
  return softmax_row_z(si, mi, n, last, scale);
#endif
  float* pr = si;
  const int64_t n8 = n / 8 * 8;
  const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  const auto vis = [&](int64_t j) {  // lanes j..j+7 visible: mask byte != 0
    const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mi + j));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(m8), _mm256_setzero_si256()));
  };
  __m256 mx = ninf;
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(si + j), sc);
    _mm256_storeu_ps(si + j, x);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, x, vis(j)));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, mx);
  float m = -INFINITY;
  for (float y : t) m = std::max(m, y);
  for (int64_t j = n8; j < n; ++j) {
    si[j] *= scale;
    if (mi[j]) m = std::max(m, si[j]);
  }
  if (m == -INFINITY) {
    std::fill(si, si + last, 0.f);
    return 0.f;
  }
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256 e = _mm256_and_ps(aotlm_gm::exp256(_mm256_sub_ps(_mm256_loadu_ps(si + j), mv)), vis(j));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(pr + j, e);
  }
  _mm256_store_ps(t, sum);
  float total = 0.f;
  for (float y : t) total += y;
  for (int64_t j = n8; j < n; ++j) {
    const float e = mi[j] ? std::exp(si[j] - m) : 0.f;
    total += e;
    pr[j] = e;
  }
  std::fill(pr + n, pr + std::max(n, last), 0.f);
  return 1.f / total;
}

// c [6 x nr] = a . b for kc rows of b: np = 2 panels (b0, b1: 32 columns) on the 6 x 32 tile of 16-lane builds
// (gemm512.h's f32_micro_z2), np = 1 the 6 x 16 one (b0); the only place that choice is made.
inline void tile_panels(const aotlm_gm::Rows& a, const float* b0, const float* b1, int64_t kc, float* c, int64_t ldc,
                        int64_t np, int64_t nr) {
#if defined(__AVX512F__)
  if (np == 2) return aotlm_gm::f32_micro_z2(a, b0, b1, kc, c, ldc, nr);
#endif
  aotlm_gm::f32_micro(a, b0, kc, c, ldc, false, MR, nr);
}

// One task: row b, kv head kh, query blocks [blk0, blk1) of QB rows. Keys 0..nk-1 (causal: up to
// the last block's end) are packed once for the g query heads: kt [panel][Dh][16] (K^T, the
// micro-kernel's B for scores), vp [Dh panel][key][16] (V, its B for p @ v). Per head and block,
// each group of 6 rows only as far as its last row's keys: q rows read in place -> scores s
// [rows][ld] -> softmax in place -> p rows of s -> o (packing q and p as [k][6] runs cost 12% more
// at batch 8 of GPT-2-small: 3.33 vs 2.92 ms per layer). The task holding the last block also
// writes k and v in the cache's layouts (kc [B,Kh,T,Dh], vt [B,Kh,Dh,T]).
inline void task(const Src& src, const uint8_t* mask, const Dims& d, float scale, int64_t b, int64_t kh,
                 int64_t blk0, int64_t blk1, float* o, float* kc, float* vt) {
  const int64_t nk = std::min(d.T, blk1 * QB), kp = (nk + NR - 1) / NR, ld = kp * NR, vc = (d.Dh + NR - 1) / NR;
  const int64_t g = d.H / d.Kh, GB = (QB + MR - 1) / MR;
  thread_local std::vector<float> kt, vp, s, zero;
  kt.resize(size_t(kp * d.Dh * NR));
  vp.resize(size_t(vc * nk * NR));
  s.resize(size_t(GB * MR * ld));
  zero.assign(size_t(vc * NR), 0.f);
  const auto krow = [&](int64_t j) { return src.k + (b * d.T + j) * src.ks + kh * src.kgs; };
  const auto vrow = [&](int64_t j) { return src.v + (b * d.T + j) * src.ks + kh * src.kgs; };
  for (int64_t p = 0; p < kp; ++p) {  // K^T: 16 keys' rows (in L1) -> contiguous 16-wide stores
    const float* rows[NR];
    for (int64_t jj = 0; jj < NR; ++jj) rows[jj] = p * NR + jj < nk ? krow(p * NR + jj) : zero.data();
    float* dst = kt.data() + p * d.Dh * NR;
    for (int64_t e = 0; e < d.Dh; ++e)
      for (int64_t jj = 0; jj < NR; ++jj) dst[e * NR + jj] = rows[jj][e];
  }
  for (int64_t j = 0; j < nk; ++j) {  // V: each row's 16-column pieces into their panels
    const float* vj = vrow(j);
    for (int64_t c = 0; c < vc; ++c) {
      float* dst = vp.data() + (c * nk + j) * NR;
      const int64_t w = std::min(NR, d.Dh - c * NR);
      if (w == NR) {
        _mm256_storeu_ps(dst, _mm256_loadu_ps(vj + c * NR));
        _mm256_storeu_ps(dst + 8, _mm256_loadu_ps(vj + c * NR + 8));
      } else {
        for (int64_t e = 0; e < NR; ++e) dst[e] = e < w ? vj[c * NR + e] : 0.f;
      }
    }
  }
  if (nk == d.T) {
    const int64_t bh = b * d.Kh + kh;
    for (int64_t j = 0; j < nk; ++j) std::memcpy(kc + (bh * d.T + j) * d.Dh, krow(j), d.Dh * sizeof(float));
    for (int64_t e = 0; e < d.Dh; ++e) {
      float* dst = vt + (bh * d.Dh + e) * d.T;
      const float* col = vp.data() + (e / NR) * nk * NR + e % NR;
      for (int64_t j = 0; j < nk; ++j) dst[j] = col[j * NR];
    }
  }
  float inv[GB * MR];
  alignas(64) float tile[MR * STEP * NR];
  for (int64_t h = kh * g; h < (kh + 1) * g; ++h) {
    const float* qh = src.q + kh * src.gs + (h - kh * g) * d.Dh;
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      const int64_t i0 = blk * QB, i1 = std::min(d.T, i0 + QB), G = (i1 - i0 + MR - 1) / MR;
      for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t last = std::min(i1, i0 + (gi + 1) * MR);  // keys < last reach this group
        aotlm_gm::Rows qr, pr;  // q rows in place (past i1: the last one again), p rows of s
        for (int64_t r = 0; r < MR; ++r) {
          qr.r[r] = qh + (b * d.T + std::min(i0 + gi * MR + r, i1 - 1)) * src.qs;
          pr.r[r] = s.data() + (gi * MR + r) * ld;
        }
        for (int64_t p = 0; p * NR < last; p += STEP) {  // scores: one or two panels of keys a tile
          const int64_t np = (p + 1) * NR < last ? STEP : 1;
          const float* kp0 = kt.data() + p * d.Dh * NR;
          tile_panels(qr, kp0, kp0 + d.Dh * NR, d.Dh, s.data() + gi * MR * ld + p * NR, ld, np, np * NR);
        }
        for (int64_t r = 0; r < MR; ++r) {
          const int64_t i = i0 + gi * MR + r;
          float* si = s.data() + (gi * MR + r) * ld;
          if (i >= i1) {
            std::fill(si, si + last, 0.f);
            inv[gi * MR + r] = 0.f;
          } else {
            inv[gi * MR + r] = softmax_row(si, mask + (b * d.T + i) * d.T, i + 1, last, scale);
          }
        }
        for (int64_t c = 0; c < vc; c += STEP) {  // p @ v: one or (16-lane builds) two Dh panels a tile
          const int64_t np = std::min<int64_t>(STEP, vc - c), w = std::min(np * NR, d.Dh - c * NR);
          const float* v0 = vp.data() + c * nk * NR;
          tile_panels(pr, v0, v0 + nk * NR, last, tile, STEP * NR, np, w);
          for (int64_t r = 0; r < MR && i0 + gi * MR + r < i1; ++r) {
            float* dst = o + ((b * d.T + i0 + gi * MR + r) * d.H + h) * d.Dh + c * NR;
            for (int64_t e = 0; e < w; ++e) dst[e] = tile[r * STEP * NR + e] * inv[gi * MR + r];
          }
        }
      }
    }
  }
}

// Every (b, kv head) over parallel_for: one task each with all its query blocks when there are
// enough of them for the threads (K^T and V packed once), else one task per query block too, the
// longest (last) blocks first.
inline void attend(const Src& src, const uint8_t* mask, const Dims& d, float scale, float* o, float* kc, float* vt) {
  const int64_t nb = (d.T + QB - 1) / QB, bk = d.B * d.Kh;
  const bool whole = bk >= 4 * aotlm::pool_size();
  aotlm::parallel_for(int(whole ? bk : bk * nb), [&](int t) {
    const int64_t blk = whole ? 0 : nb - 1 - t % nb, r = whole ? t : t / nb;
    task(src, mask, d, scale, r / d.Kh, r % d.Kh, blk, whole ? nb : blk + 1, o, kc, vt);
  });
}

}  // namespace aotlm_at
