// The output pass of the matmul kernels (included by wmatmul.cc before packed.h): scale, bias and
// the MLP's activation applied to the f32 sums as they are written, instead of XLA's separate pass
// over the output (GPT-2-small's gelu: 1.5 ms per layer of a batch-8 prefill, 77 us per layer of a
// batch-8 decode step).
#pragma once

namespace aotlm_ep {

// e^x in 8 lanes: 2^n * e^r, |r| <= ln2 / 2, degree-6 polynomial (relative error ~1e-7); x is
// clamped to [-87, 88] (about 0 below, no inf above).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp256's polynomial in 16 lanes (the same numbers lane for lane).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

// What the GEMMs (gemm.h) and the packed row kernels (packed.h) do to their sums before writing them
// (models.layers.dense's order):
// y = sum * scale[n] (+ bias[n]), then the activation (Act: the MLP's up projection).
enum Act : int32_t { ACT_NONE = 0, ACT_GELU_TANH = 1, ACT_RELU = 2 };
inline __m256 finish(__m256 v, __m256 s, const float* bias, int32_t act) {
  v = _mm256_mul_ps(v, s);
  if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
  if (act == ACT_RELU) return _mm256_max_ps(v, _mm256_setzero_ps());
  if (act == ACT_GELU_TANH) {  // 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
    const __m256 x2 = _mm256_mul_ps(v, v);
    const __m256 u = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(0.7978845608f)),
                                   _mm256_fmadd_ps(x2, _mm256_set1_ps(0.044715f), _mm256_set1_ps(1.f)));
    const __m256 e = exp256(_mm256_mul_ps(u, _mm256_set1_ps(-2.f)));
    return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  }
  return v;
}

}  // namespace aotlm_ep
