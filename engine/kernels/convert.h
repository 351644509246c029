// Whole-matrix weight conversion for prefill (included by wmatmul.cc after wfloat.h).
//
//   aotlm_convert:  y = float(w)   w int8 / bf16 / f16 -> y f32 / bf16 / f16 (same shape)
//
// Why: prefill (more than MAX_ROWS rows) multiplies by a whole weight matrix, which XLA's GEMM
// does well in f32, but XLA:CPU's own convert of an int8 or bf16 matrix ran at ~1 GB/s inside
// the prefill graph (GPT-2-small int8: 350 ms of converts around 250 ms of GEMMs). Converting
// here (AVX2, all cores) and handing XLA a plain f32 matrix keeps low-precision prefill close
// to f32's.
#pragma once

namespace aotlm_cv {

// elements [i0, i1) of w -> f32 in dst (dst[0] is element i0)
template <class W>
inline void to_f32(const typename W::T* w, int64_t i0, int64_t i1, float* dst) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(dst + (i - i0), W::load8(w + i));
  for (; i < i1; ++i) dst[i - i0] = W::one(w + i);
}

struct I8 {  // int8 as an element type (for to_f32 only; the matmuls use int8.h)
  using T = int8_t;
  static __m256 load8(const T* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static float one(const T* p) { return float(*p); }
};

// n elements of w (dtype wt) -> y (dtype of out), in blocks over the thread pool
inline bool run(xla::ffi::DataType wt, const void* w, int64_t n, const Out& out) {
  constexpr int64_t BLOCK = 1 << 14;
  auto conv = [&](const auto tag, int64_t i0, int64_t i1, float* buf) {
    using W = decltype(tag);
    to_f32<W>(static_cast<const typename W::T*>(w), i0, i1, buf);
  };
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  if (wt != DataType::S8 && wt != DataType::BF16 && wt != DataType::F16 && wt != DataType::F32) return false;
  aotlm::parallel_for(int(blocks), [&](int c) {
    thread_local std::vector<float> buf;
    buf.resize(BLOCK);
    const int64_t i0 = c * BLOCK, i1 = std::min(n, i0 + BLOCK);
    if (wt == DataType::S8) conv(I8{}, i0, i1, buf.data());
    else if (wt == DataType::BF16) conv(BF16{}, i0, i1, buf.data());
    else if (wt == DataType::F16) conv(F16{}, i0, i1, buf.data());
    else conv(F32{}, i0, i1, buf.data());
    out.put(i0, buf.data(), int(i1 - i0));
  });
  return true;
}

}  // namespace aotlm_cv
