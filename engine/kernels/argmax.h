// Greedy decoding's argmax over the vocabulary (included by wmatmul.cc).
//
//   aotlm_argmax:  y[b] = the first index of the largest x[b, :]   x f32 [B, V], y s32 [B]
//
// Why: XLA:CPU ran the sampler's argmax (a variadic (value, index) reduce fused with the
// penalties) at ~1.7 ns per logit -- 0.68 ms of a batch-8 GPT-2-small decode step (8 x 50257),
// about as long as a layer's MLP. Here eight lanes keep their largest value and its index (a
// strictly greater value replaces it, so each lane keeps its first), then the lanes are merged.
// A NaN counts as the largest value, as in jnp.argmax: the first NaN's index is returned.
#pragma once

namespace aotlm_am {

inline int32_t argmax_row(const float* x, int64_t n) {
  const int64_t nv = n / 8 * 8;
  __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  __m256i bi = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t i = 0; i < nv; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i), gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    bi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(idx), gt));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    idx = _mm256_add_epi32(idx, eight);
  }
  if (!_mm256_testz_ps(nan, nan))
    for (int64_t i = 0; i < nv; ++i)
      if (std::isnan(x[i])) return int32_t(i);
  alignas(32) float bv[8];
  alignas(32) int32_t bx[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bx), bi);
  float m = bv[0];
  int32_t r = bx[0];
  for (int l = 1; l < 8; ++l)  // the largest value; the smallest index among equal ones
    if (bv[l] > m || (bv[l] == m && bx[l] < r)) m = bv[l], r = bx[l];
  for (int64_t i = nv; i < n; ++i) {
    if (std::isnan(x[i])) return int32_t(i);
    if (x[i] > m) m = x[i], r = int32_t(i);
  }
  return r;
}

}  // namespace aotlm_am

// x f32 [..., V] -> y s32 [...]: one row per job over the kernels' pool.
ffi::Error argmax(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions();
  if (x.element_type() != DataType::F32 || xd.size() == 0 || xd.back() < 1 || y->element_type() != DataType::S32)
    return ffi::Error::InvalidArgument("aotlm_argmax: x must be f32 [..., V >= 1] and y s32 [...]");
  const int64_t V = xd.back(), B = int64_t(x.element_count()) / V;
  if (int64_t(y->element_count()) != B) return ffi::Error::InvalidArgument("aotlm_argmax: y must hold one index per row");
  const float* xp = static_cast<const float*>(x.untyped_data());
  int32_t* yp = static_cast<int32_t*>(y->untyped_data());
  aotlm::parallel_for(int(B), [&](int b) { yp[b] = aotlm_am::argmax_row(xp + b * V, V); });
  return ffi::Error::Success();
}
