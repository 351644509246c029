// Measured compute peaks of the kernels' threads (included by wmatmul.cc after gemm.h), for
// scripts/bench_gemm.py and bench.py: GEMM figures read as a fraction of them. Each thread runs 12
// independent chains of the instruction the GEMMs use at this build's ISA level (aotlm.kernels.isa).
#pragma once

namespace aotlm_peak {
constexpr int64_t IT = 4000000, CHAINS = 12;

// best of runs of (ops per instruction * CHAINS * IT * threads) / seconds, fn(c) one thread's chains
template <class Fn>
inline double best_rate(int runs, double ops_per_op, const Fn& fn) {
  const int parts = aotlm::pool_size();
  double best = 0;
  std::vector<int64_t> sink(parts);
  for (int r = 0; r < std::max(1, runs); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    aotlm::parallel_for(parts, [&](int c) { sink[c] = fn(c); });
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, ops_per_op * CHAINS * IT * parts / t / 1e9);
  }
  return sink[0] == 12345 ? 0.0 : best;
}

// f32 FMA peak (GFLOP/s): 8-lane FMAs in the avx2 build, 16-lane in the avx512 ones.
inline double fma_peak(int runs) {
#if defined(__AVX512F__)
  using V = __m512;
  constexpr int L = 16;
  const auto set1 = [](float v) { return _mm512_set1_ps(v); };
  const auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  const auto add = [](V a, V b) { return _mm512_add_ps(a, b); };
  const auto first = [](V a) { return _mm512_cvtss_f32(a); };
#else
  using V = __m256;
  constexpr int L = 8;
  const auto set1 = [](float v) { return _mm256_set1_ps(v); };
  const auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  const auto add = [](V a, V b) { return _mm256_add_ps(a, b); };
  const auto first = [](V a) { return _mm256_cvtss_f32(a); };
#endif
  return best_rate(runs, 2.0 * L, [&](int c) {
    V a[CHAINS];
    for (int i = 0; i < CHAINS; ++i) a[i] = set1(1e-3f * (i + c));
    const V b = set1(0.999f), d = set1(1e-4f);
    for (int64_t i = 0; i < IT; ++i)
      for (int j = 0; j < CHAINS; ++j) a[j] = fma(a[j], b, d);
    for (int j = 1; j < CHAINS; ++j) a[0] = add(a[0], a[j]);
    return int64_t(first(a[0]));
  });
}

// int8 multiply-add peak (Gop/s, 2 per multiply-add) with W8A8's instruction: vpdpbusd on 512 bits
// (64 per instruction) in the avx512vnni build, else vpmaddwd + vpaddd on 256 bits (16 per pair; plus one
// vpaddw per 12 pairs that keeps the products from being hoisted).
inline double int8_peak(int runs) {
#if defined(__AVX512VNNI__)
  return best_rate(runs, 2.0 * 64, [](int c) {
    __m512i a[CHAINS];
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_set1_epi32(i + c);
    const __m512i b = _mm512_set1_epi8(char(3 + c)), x = _mm512_set1_epi8(char(-5 - c));
    for (int64_t i = 0; i < IT; ++i)
      for (int j = 0; j < CHAINS; ++j) a[j] = _mm512_dpbusd_epi32(a[j], b, x);
    for (int j = 1; j < CHAINS; ++j) a[0] = _mm512_add_epi32(a[0], a[j]);
    return int64_t(_mm_cvtsi128_si32(_mm512_castsi512_si128(a[0])));
  });
#else
  return best_rate(runs, 2.0 * 16, [](int c) {
    __m256i a[CHAINS], x[CHAINS];
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm256_set1_epi32(i + c), x[i] = _mm256_set1_epi16(short(i - 7));
    __m256i b = _mm256_set1_epi16(short(3 + c));
    const __m256i one = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < IT; ++i) {  // b changes every iteration, so no product can be hoisted
      for (int j = 0; j < CHAINS; ++j) a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(b, x[j]));
      b = _mm256_add_epi16(b, one);
    }
    for (int j = 1; j < CHAINS; ++j) a[0] = _mm256_add_epi32(a[0], a[j]);
    return int64_t(_mm_cvtsi128_si32(_mm256_castsi256_si128(a[0])));
  });
#endif
}

// bf16 multiply-add peak (GFLOP/s, 2 per multiply-add) with quant="bf16a"'s instruction: vdpbf16ps on 512
// bits (32 per instruction) in the avx512bf16 build; 0 where the level has no bf16 dot product.
inline double bf16_peak(int runs) {
#if defined(__AVX512BF16__)
  return best_rate(runs, 2.0 * 32, [](int c) {
    __m512 a[CHAINS];
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_set1_ps(1e-3f * float(i + c));
    const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f), x = (__m512bh)_mm512_set1_epi32(0x38d138d1);
    for (int64_t i = 0; i < IT; ++i)
      for (int j = 0; j < CHAINS; ++j) a[j] = _mm512_dpbf16_ps(a[j], b, x);
    for (int j = 1; j < CHAINS; ++j) a[0] = _mm512_add_ps(a[0], a[j]);
    return int64_t(_mm512_cvtss_f32(a[0]));
  });
#else
  (void)runs;
  return 0.0;
#endif
}

// Streaming read bandwidth in GB/s (median of ``runs``) over ``mib`` MiB, read by the pool's threads the
// way the one-row kernels read weights.
inline double read_gbps(int64_t mib, int runs) {
  const int64_t n = (mib << 20) / 64 * 64;
  std::vector<int8_t> a(n, 1);
  std::vector<double> ts;
  std::vector<int64_t> sums(64);
  for (int it = 0; it < std::max(1, runs); ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    aotlm::parallel_for(64, [&](int c) {  // 64 contiguous parts, handed out to whichever thread is free
      const int64_t lo = n / 64 / 64 * 64 * c, hi = c == 63 ? n : lo + n / 64 / 64 * 64;
      __m256i s0 = _mm256_setzero_si256(), s1 = s0;
      for (int64_t i = lo; i < hi; i += 64) {
        s0 = _mm256_add_epi64(s0, _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a[i])),
                                                  _mm256_setzero_si256()));
        s1 = _mm256_add_epi64(s1, _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a[i + 32])),
                                                  _mm256_setzero_si256()));
      }
      s0 = _mm256_add_epi64(s0, s1);
      sums[c] = _mm256_extract_epi64(s0, 0) + _mm256_extract_epi64(s0, 2);
    });
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (sums[0] == 0) return 0.0;  // keeps the reads (a sum of ones is never 0)
  }
  std::sort(ts.begin(), ts.end());
  return double(n) / ts[ts.size() / 2] / 1e9;
}

}  // namespace aotlm_peak
