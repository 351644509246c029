// What the group-scaled row kernels (int4.h, group8.h) share, included by wmatmul.cc before them: the
// register tile's row count as a template argument (with_rows), the driver over panel ranges and chunks
// of rows (drive_rows) and the scales' panel-major copy (with_scales).
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

// The scales of the group-scaled row kernels as the panels read them. In a scale leaf ([rows][Np] of
// ``e``-byte elements: int4.h's f16 [G][S][Np] or K form [G / 8][20][Np], group8.h's f16 [G][S][Np]) a
// panel's groups are Np apart: one cache line (on a page of its own for wide N) per group, read between
// the code stream's lines. With ``copy`` each thread first copies the scales of SCALE_COPY_PANELS panels
// into a panel-major buffer -- the leaf's rows read as contiguous pieces -- and the panels read theirs
// from there; without it they read them in place. The callers copy from SCALE_COPY_ROWS rows of x on:
// for fewer the copy, a pass of its own, costs more than it saves. panel(p, ps, rs): panel p's scales
// at ps, rs elements from one leaf row to the next (Np in place, 16 in the copy).
constexpr int64_t SCALE_COPY_ROWS = 8, SCALE_COPY_PANELS = 32;
template <class Panel>
inline void with_scales(const uint8_t* leaf, int64_t rows, int64_t Np, int64_t e, bool copy, int64_t p0, int64_t p1,
                        const Panel& panel) {
  constexpr int64_t P = 16;
  if (!copy) {
    for (int64_t p = p0; p < p1; ++p) panel(p, leaf + p * P * e, Np);
    return;
  }
  const int64_t pb = rows * P * e;  // bytes of one panel's scales
  thread_local std::vector<uint8_t> buf;
  buf.resize(std::min(SCALE_COPY_PANELS, p1 - p0) * pb);
  for (int64_t c0 = p0; c0 < p1; c0 += SCALE_COPY_PANELS) {
    const int64_t c1 = std::min(p1, c0 + SCALE_COPY_PANELS);
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = leaf + (r * Np + c0 * P) * e;
      for (int64_t p = 0; p < c1 - c0; ++p) std::memcpy(buf.data() + p * pb + r * P * e, row + p * P * e, P * e);
    }
    for (int64_t p = c0; p < c1; ++p) panel(p, buf.data() + (p - c0) * pb, P);
  }
}
