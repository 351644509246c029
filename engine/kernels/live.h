// Prefill rows that need no products (included by wmatmul.cc after epilogue.h). A prompt shorter than its
// context bucket is padded; the graph passes the prefill GEMMs which rows are live (int8 [M], 1: a real
// token; aotlm/kernels/padding.py), and they multiply only those, writing each padding row as the product
// of a row of zeros: the epilogue of a zero sum, act(bias). A 139-token prompt in the 192-token bucket
// skips 28% of the GEMM work; a live row's output is unchanged (every kernel computes a row from that row
// alone).
#pragma once

namespace aotlm_lr {

// The live-rows operand, as scale_of reads a scale: empty -> *flags stays null (every row); else int8 [M].
inline bool live_of(const ffi::AnyBuffer& live, int64_t M, const int8_t** flags) {
  if (live.element_count() == 0) return true;
  if (live.element_type() != DataType::S8 || int64_t(live.element_count()) != M) return false;
  *flags = static_cast<const int8_t*>(live.untyped_data());
  return true;
}

// fn(x rows, their count, out) on the live rows of x [M, K] (all of them when ``live`` is null; out then
// remapped to their rows of y [M, N]), then every other row of y := act(bias) (bias: f32, at least N
// rounded up to 8, or null).
template <class T, class Fn>
void live_rows(const T* x, const int8_t* live, int64_t M, int64_t K, int64_t N, const float* bias, int32_t act,
               const Out& out, Fn&& fn) {
  std::vector<int64_t> rows;
  if (live)
    for (int64_t m = 0; m < M; ++m)
      if (live[m]) rows.push_back(m);
  if (!live || int64_t(rows.size()) == M) {
    fn(x, M, out);
    return;
  }
  if (!rows.empty()) {
    std::vector<T> xc(rows.size() * size_t(K));
    for (size_t r = 0; r < rows.size(); ++r) std::memcpy(&xc[r * K], x + rows[r] * K, size_t(K) * sizeof(T));
    fn(xc.data(), int64_t(rows.size()), Out{out.y, out.dt, rows.data(), N});
  }
  std::vector<float> zero((N + 7) / 8 * 8);
  for (int64_t j = 0; j < N; j += 8)
    _mm256_storeu_ps(&zero[j], aotlm_ep::finish(_mm256_setzero_ps(), _mm256_set1_ps(1.f), bias ? bias + j : nullptr, act));
  for (int64_t m = 0; m < M; ++m)
    if (!live[m]) out.put(m * N, zero.data(), int(N));
}
}  // namespace aotlm_lr
