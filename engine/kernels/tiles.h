// What the group-scaled row kernels (int4.h, group8.h) share, included by wmatmul.cc before them: the
// register tile's row count as a template argument (with_rows) and the driver over panel ranges and
// chunks of rows (drive_rows).
//
// with_rows<MAX>(mr, fn) calls fn(std::integral_constant<int, mr>{}) for mr in 1..MAX, so a kernel's
// register tile of mr rows of x is one instantiation each and one call picks it.
#pragma once
#include <type_traits>

template <int MAX, class Fn>
inline void with_rows(int mr, Fn&& fn) {
  if constexpr (MAX > 1) {
    if (mr < MAX) {
      with_rows<MAX - 1>(mr, fn);
      return;
    }
  }
  fn(std::integral_constant<int, MAX>{});
}

// The drivers of the group-scaled row kernels (int4.h, group8.h): threads take ranges of the Np / 16 panels
// (one range per thread for one row), rows of x go in chunks of ``chunk``; fill(m0, mc, p0, p1, buf, ld)
// writes the finished sums of rows m0..m0+mc-1 over panels [p0, p1) to buf [mc, ld], then the bias
// (f32 [Np] or null) and activation are applied and the row's N columns written to out.
template <class Fill>
inline void drive_rows(int64_t M, int64_t N, int64_t Np, int64_t chunk, const float* bias, int32_t act,
                       const Out& out, const Fill& fill) {
  aotlm_pk::panel_ranges(Np / 16, M == 1 ? 1 : 4, [&](int64_t p0, int64_t p1) {
    const int64_t ld = (p1 - p0) * 16, n0 = p0 * 16, width = std::min(ld, N - n0);
    thread_local std::vector<float> buf;
    buf.resize(std::min(M, chunk) * ld);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t mc = std::min(chunk, M - m0);
      fill(m0, mc, p0, p1, buf.data(), ld);
      for (int64_t m = 0; m < mc; ++m) {
        float* r = buf.data() + m * ld;
        if (bias || act)
          for (int64_t j = 0; j < ld; j += 8)
            _mm256_storeu_ps(r + j, aotlm_ep::finish(_mm256_loadu_ps(r + j), _mm256_set1_ps(1.f),
                                                     bias ? bias + n0 + j : nullptr, act));
        out.put((m0 + m) * N + n0, r, int(width));
      }
    }
  });
}
