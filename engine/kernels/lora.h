// Per-row LoRA updates of a projection (included by wmatmul.cc).
//
//   aotlm_lora:  y[m, :] += (x[m, :] @ A[s[m]]) @ B[s[m]]    (rows whose s[m] is not a slot: unchanged)
//     y f32 [M, O] (updated in place: the output aliases it), x f32 [M, K], s s32 [M],
//     A f32 | bf16 | s8 [N, K, R], B (A's type) [N, R, O]; s8 tables: h = (x @ A) * scale[s[m]]
//   (one call takes every projection of one x: operands x, s, then (y, A, B, scale) each)
//
// Why: each row's adapter is read in place, once for all the rows that use it, and multiplied by
// those rows only. XLA:CPU either gathers every row's A and B into new arrays first (a copy of the
// adapters per row and per step) or multiplies every row by every slot (N times the work); both cost
// more than the product. A base row costs nothing: no zeros written, no separate add.
// Two passes over the kernels' pool: h = x @ A per slot's rows (R sums in one or a few vectors),
// then y += h @ B per slot and block of outputs (a block of B stays in L1 across the slot's rows).
#pragma once

namespace aotlm_lora {

constexpr int64_t kSerialWork = 1 << 17;  // multiply-adds below which one thread does both passes
constexpr int64_t kBlock = 256;           // outputs per job of the second pass

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16: the top half of an f32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const int8_t* p) {  // int8 tables: the slot's scales applied to h (run)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const int8_t* p, int64_t i) { return float(p[i]); }
inline float ld(const uint16_t* p, int64_t i) {
  uint32_t bits = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Spreads software prefetches of another table (the slot's B, read next) over a loop's steps, so its
// lines arrive from memory while the loop streams A: two streams in flight, not one after the other.
struct Prefetch {
  const char* p = nullptr;
  int64_t lines = 0, steps = 1, acc = 0, done = 0;
  void step() {  // lines * (i + 1) / steps lines issued after step i
    for (acc += lines; acc >= steps && done < lines; acc -= steps) _mm_prefetch(p + 64 * done++, _MM_HINT_T0);
  }
};

// h[0:R] = x[0:K] @ a[K, R], R = 8 * NC: NC vectors of sums, two k at a time.
template <int NC, typename T>
void shrink_v(const float* x, const T* a, int64_t K, int64_t R, float* h, Prefetch& pf) {
  __m256 s0[NC], s1[NC];
  for (int c = 0; c < NC; ++c) s0[c] = s1[c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const __m256 x0 = _mm256_set1_ps(x[k]), x1 = _mm256_set1_ps(x[k + 1]);
    for (int c = 0; c < NC; ++c) {
      s0[c] = _mm256_fmadd_ps(x0, load8(a + k * R + 8 * c), s0[c]);
      s1[c] = _mm256_fmadd_ps(x1, load8(a + (k + 1) * R + 8 * c), s1[c]);
    }
    pf.step();
  }
  for (; k < K; ++k)
    for (int c = 0; c < NC; ++c) s0[c] = _mm256_fmadd_ps(_mm256_set1_ps(x[k]), load8(a + k * R + 8 * c), s0[c]);
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(h + 8 * c, _mm256_add_ps(s0[c], s1[c]));
}

template <typename T>
void shrink(const float* x, const T* a, int64_t K, int64_t R, float* h, Prefetch& pf) {
  pf.steps = std::max<int64_t>(1, K / 2);
  switch (R) {
    case 8: return shrink_v<1>(x, a, K, R, h, pf);
    case 16: return shrink_v<2>(x, a, K, R, h, pf);
    case 32: return shrink_v<4>(x, a, K, R, h, pf);
    case 64: return shrink_v<8>(x, a, K, R, h, pf);
    default:
      for (int64_t r = 0; r < R; ++r) h[r] = 0.f;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < R; ++r) h[r] += x[k] * ld(a + k * R, r);
  }
}

// h_m[0:R] = x_m[0:K] @ a[K, R] for MR rows of one slot at once: each vector of a is read and
// widened once for all of them (several rows of a slot: batched decode, prefill).
template <int NC, int MR, typename T>
void shrink_rows(const float* const* xs, const T* a, int64_t K, int64_t R, float* const* hs) {
  constexpr int U = MR * NC <= 4 ? 2 : 1;  // k steps in flight: at least 8 independent sums
  __m256 acc[U][MR][NC];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < NC; ++c) acc[u][m][c] = _mm256_setzero_ps();
  int64_t k = 0;
  auto step = [&](int u, int64_t kk) {
    __m256 av[NC];
    for (int c = 0; c < NC; ++c) av[c] = load8(a + kk * R + 8 * c);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_set1_ps(xs[m][kk]);
      for (int c = 0; c < NC; ++c) acc[u][m][c] = _mm256_fmadd_ps(xv, av[c], acc[u][m][c]);
    }
  };
  for (; k + U <= K; k += U)
    for (int u = 0; u < U; ++u) step(u, k + u);
  for (; k < K; ++k) step(0, k);
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) {
      __m256 v = acc[0][m][c];
      for (int u = 1; u < U; ++u) v = _mm256_add_ps(v, acc[u][m][c]);
      _mm256_storeu_ps(hs[m] + 8 * c, v);
    }
}

// shrink for n rows of one slot (xs, hs: each row's x and h): in fours or twos where R allows.
template <typename T>
void shrink_group(const float* const* xs, const T* a, int64_t K, int64_t R, float* const* hs, int64_t n,
                  Prefetch& pf) {
  int64_t i = 0;
  if (R == 8 || R == 16)
    for (; i + 4 <= n; i += 4)
      R == 8 ? shrink_rows<1, 4>(xs + i, a, K, R, hs + i) : shrink_rows<2, 4>(xs + i, a, K, R, hs + i);
  if (R == 16 || R == 32)
    for (; i + 2 <= n; i += 2)
      R == 16 ? shrink_rows<2, 2>(xs + i, a, K, R, hs + i) : shrink_rows<4, 2>(xs + i, a, K, R, hs + i);
  for (; i < n; ++i) shrink(xs[i], a, K, R, hs[i], pf);
}

// y[o0:o1] += h[0:R] @ b[R, O][:, o0:o1]: four rows of b at a time, each read in order over the
// block (four sequential streams the prefetchers follow; y's block stays in L1 across them).
template <typename T>
void expand(const float* h, const T* b, int64_t R, int64_t O, int64_t o0, int64_t o1, float* y) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    const __m256 h0 = _mm256_set1_ps(h[r]), h1 = _mm256_set1_ps(h[r + 1]);
    const __m256 h2 = _mm256_set1_ps(h[r + 2]), h3 = _mm256_set1_ps(h[r + 3]);
    const T *b0 = b + r * O, *b1 = b0 + O, *b2 = b1 + O, *b3 = b2 + O;
    int64_t o = o0;
    for (; o + 8 <= o1; o += 8) {
      __m256 acc = _mm256_fmadd_ps(h0, load8(b0 + o), _mm256_loadu_ps(y + o));
      acc = _mm256_fmadd_ps(h1, load8(b1 + o), acc);
      acc = _mm256_fmadd_ps(h2, load8(b2 + o), acc);
      _mm256_storeu_ps(y + o, _mm256_fmadd_ps(h3, load8(b3 + o), acc));
    }
    for (; o < o1; ++o) y[o] += h[r] * ld(b0, o) + h[r + 1] * ld(b1, o) + h[r + 2] * ld(b2, o) + h[r + 3] * ld(b3, o);
  }
  for (; r < R; ++r)
    for (int64_t o = o0; o < o1; ++o) y[o] += h[r] * ld(b + r * O, o);
}

// expand for two rows of one slot: each vector of b read and widened once for both.
template <typename T>
void expand2(const float* h0, const float* h1, const T* b, int64_t R, int64_t O, int64_t o0, int64_t o1, float* y0,
             float* y1) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    const __m256 a0 = _mm256_set1_ps(h0[r]), a1 = _mm256_set1_ps(h0[r + 1]);
    const __m256 a2 = _mm256_set1_ps(h0[r + 2]), a3 = _mm256_set1_ps(h0[r + 3]);
    const __m256 c0 = _mm256_set1_ps(h1[r]), c1 = _mm256_set1_ps(h1[r + 1]);
    const __m256 c2 = _mm256_set1_ps(h1[r + 2]), c3 = _mm256_set1_ps(h1[r + 3]);
    const T *b0 = b + r * O, *b1 = b0 + O, *b2 = b1 + O, *b3 = b2 + O;
    int64_t o = o0;
    for (; o + 8 <= o1; o += 8) {
      const __m256 v0 = load8(b0 + o), v1 = load8(b1 + o), v2 = load8(b2 + o), v3 = load8(b3 + o);
      __m256 p = _mm256_fmadd_ps(a0, v0, _mm256_loadu_ps(y0 + o)), q = _mm256_fmadd_ps(c0, v0, _mm256_loadu_ps(y1 + o));
      p = _mm256_fmadd_ps(a1, v1, p), q = _mm256_fmadd_ps(c1, v1, q);
      p = _mm256_fmadd_ps(a2, v2, p), q = _mm256_fmadd_ps(c2, v2, q);
      _mm256_storeu_ps(y0 + o, _mm256_fmadd_ps(a3, v3, p)), _mm256_storeu_ps(y1 + o, _mm256_fmadd_ps(c3, v3, q));
    }
    for (; o < o1; ++o) {
      const float w0 = ld(b0, o), w1 = ld(b1, o), w2 = ld(b2, o), w3 = ld(b3, o);
      y0[o] += h0[r] * w0 + h0[r + 1] * w1 + h0[r + 2] * w2 + h0[r + 3] * w3;
      y1[o] += h1[r] * w0 + h1[r + 1] * w1 + h1[r + 2] * w2 + h1[r + 3] * w3;
    }
  }
  for (; r < R; ++r)
    for (int64_t o = o0; o < o1; ++o) y0[o] += h0[r] * ld(b + r * O, o), y1[o] += h1[r] * ld(b + r * O, o);
}

// The rows of each slot in use, slots in first-use order: group g is slot[g], with rows
// rows[start[g] .. start[g + 1]). Kept per calling thread, so a call allocates nothing once warm.
struct Groups {
  std::vector<int32_t> slot;
  std::vector<int64_t> start, rows;
};

inline const Groups& group_rows(const int32_t* s, int64_t M, int64_t N) {
  thread_local Groups g;  // returned by reference: workers use the caller's
  g.slot.clear(), g.start.clear(), g.rows.clear();
  for (int64_t m = 0; m < M; ++m)
    if (s[m] >= 0 && s[m] < N && std::find(g.slot.begin(), g.slot.end(), s[m]) == g.slot.end())
      g.slot.push_back(s[m]);
  for (int32_t slot : g.slot) {
    g.start.push_back(int64_t(g.rows.size()));
    for (int64_t m = 0; m < M; ++m)
      if (s[m] == slot) g.rows.push_back(m);
  }
  g.start.push_back(int64_t(g.rows.size()));
  return g;
}

template <typename T>
void run(const float* x, const int32_t* s, const T* a, const T* b, const float* sc, int64_t M, int64_t N, int64_t K,
         int64_t R, int64_t O, float* y) {
  const Groups& g = group_rows(s, M, N);
  const int64_t n_groups = int64_t(g.slot.size()), live = int64_t(g.rows.size());
  if (live == 0) return;
  // a few rows of a small projection (one-row decode): less work than waking the pool twice
  const bool serial = live * R * (K + O) < kSerialWork;
  auto par = [&](int64_t n, const std::function<void(int)>& fn) {
    if (serial)
      for (int i = 0; i < int(n); ++i) fn(i);
    else
      aotlm::parallel_for(int(n), fn);
  };
  // fewer slots than workers (one-row decode): each slot's sums split over K, then added up
  const int64_t workers = serial ? 1 : int64_t(aotlm::pool_size());
  const int64_t split = std::max<int64_t>(1, std::min<int64_t>(workers / n_groups, 4));
  const int64_t chunk = (K + split - 1) / split;
  thread_local std::vector<float> h_buf;  // the caller's: workers reach it through hp
  h_buf.assign(size_t(split * M * R), 0.f);
  float* hp = h_buf.data();
  par(n_groups * split, [&](int job) {  // h = x @ A, the slot's A read once for its rows
    const int64_t i = job / split, p = job % split, k0 = p * chunk, k1 = std::min(K, k0 + chunk);
    if (k0 >= k1) return;
    const T* as = a + int64_t(g.slot[size_t(i)]) * K * R + k0 * R;
    Prefetch pf;  // the slot's B (this part of it) while its A streams in, with the first row
    const int64_t b_lines = (R * O * int64_t(sizeof(T)) + 63) / 64, per = (b_lines + split - 1) / split;
    pf.p = reinterpret_cast<const char*>(b + int64_t(g.slot[size_t(i)]) * R * O) + 64 * p * per;
    pf.lines = std::max<int64_t>(0, std::min(per, b_lines - p * per));
    const int64_t j0 = g.start[size_t(i)], n = g.start[size_t(i) + 1] - j0;
    thread_local std::vector<const float*> xs;
    thread_local std::vector<float*> hs;
    xs.resize(size_t(n)), hs.resize(size_t(n));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t m = g.rows[size_t(j0 + j)];
      xs[size_t(j)] = x + m * K + k0, hs[size_t(j)] = hp + (p * M + m) * R;
    }
    shrink_group(xs.data(), as, k1 - k0, R, hs.data(), n, pf);
  });
  for (int64_t p = 1; p < split; ++p)
    for (int64_t m : g.rows)
      for (int64_t r = 0; r < R; ++r) hp[m * R + r] += hp[(p * M + m) * R + r];
  if (sc != nullptr)  // int8 tables: h times the slot's scale of each rank (A's column times B's row)
    for (int64_t i = 0; i < n_groups; ++i)
      for (int64_t j = g.start[size_t(i)]; j < g.start[size_t(i) + 1]; ++j)
        for (int64_t r = 0; r < R; ++r) hp[g.rows[size_t(j)] * R + r] *= sc[int64_t(g.slot[size_t(i)]) * R + r];
  const int64_t block = serial ? O : kBlock;  // one thread: whole rows of B, in order
  const int64_t blocks = (O + block - 1) / block;
  par(n_groups * blocks, [&](int job) {  // y += h @ B, per slot and block
    const int64_t i = job / blocks, o0 = job % blocks * block, o1 = std::min(O, o0 + block);
    const T* bs = b + int64_t(g.slot[size_t(i)]) * R * O;
    int64_t j = g.start[size_t(i)];
    for (; j + 2 <= g.start[size_t(i) + 1]; j += 2) {  // rows in pairs: b read once for both
      const int64_t m0 = g.rows[size_t(j)], m1 = g.rows[size_t(j + 1)];
      expand2(hp + m0 * R, hp + m1 * R, bs, R, O, o0, o1, y + m0 * O, y + m1 * O);
    }
    for (; j < g.start[size_t(i) + 1]; ++j) expand(hp + g.rows[size_t(j)] * R, bs, R, O, o0, o1, y + g.rows[size_t(j)] * O);
  });
}

}  // namespace aotlm_lora

// One projection's update: y (aliasing y_in) += per-row LoRA of x with tables a, b.
inline ffi::Error lora_one(const float* xp, const int32_t* sp, int64_t M, int64_t K, ffi::AnyBuffer y_in,
                           ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer scale, ffi::AnyBuffer* y) {
  auto ad = a.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  const DataType t = a.element_type();
  const bool int8 = t == DataType::S8;
  const bool types = y->element_type() == DataType::F32 && y_in.element_type() == DataType::F32 &&
                     b.element_type() == t && (t == DataType::F32 || t == DataType::BF16 || int8) &&
                     scale.element_type() == DataType::F32;
  if (!types || ad.size() != 3 || bd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "aotlm_lora: each y f32 [M, O], A f32|bf16|s8 [N, K, R], B [N, R, O] of A's type, scale f32");
  const int64_t N = ad[0], R = ad[2], O = bd[2];
  if (ad[1] != K || bd[0] != N || bd[1] != R || yd[0] != M || yd[1] != O || int64_t(y_in.element_count()) != M * O ||
      (int8 && int64_t(scale.element_count()) != N * R))
    return ffi::Error::InvalidArgument("aotlm_lora: the shapes of y, x, s, A, B and scale do not fit together");
  float* yp = static_cast<float*>(y->untyped_data());
  if (y_in.untyped_data() != y->untyped_data())  // not aliased after all: start from a copy
    std::memcpy(yp, y_in.untyped_data(), size_t(M * O) * sizeof(float));
  if (t == DataType::F32)
    aotlm_lora::run(xp, sp, static_cast<const float*>(a.untyped_data()), static_cast<const float*>(b.untyped_data()),
                    nullptr, M, N, K, R, O, yp);
  else if (t == DataType::BF16)
    aotlm_lora::run(xp, sp, static_cast<const uint16_t*>(a.untyped_data()),
                    static_cast<const uint16_t*>(b.untyped_data()), nullptr, M, N, K, R, O, yp);
  else
    aotlm_lora::run(xp, sp, static_cast<const int8_t*>(a.untyped_data()), static_cast<const int8_t*>(b.untyped_data()),
                    static_cast<const float*>(scale.untyped_data()), M, N, K, R, O, yp);
  return ffi::Error::Success();
}

// Operands x f32 [M, K], s s32 [M], then (y, A, B, scale) per projection reading x (q / k / v, gate /
// up: one call for all); results: each y, aliasing its operand. ``scale`` f32 [N, R] for int8 tables
// (A's column scale times B's row scale, per slot and rank), unread otherwise.
ffi::Error lora(ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::RemainingArgs rest, ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (x.element_type() != DataType::F32 || s.element_type() != DataType::S32 || xd.size() != 2 ||
      int64_t(s.element_count()) != xd[0] || rest.size() != 4 * ys.size())
    return ffi::Error::InvalidArgument("aotlm_lora: x f32 [M, K], s s32 [M], then (y, A, B, scale) per output");
  const float* xp = static_cast<const float*>(x.untyped_data());
  const int32_t* sp = static_cast<const int32_t*>(s.untyped_data());
  for (size_t i = 0; i < ys.size(); ++i) {
    auto y_in = rest.get<ffi::AnyBuffer>(4 * i), a = rest.get<ffi::AnyBuffer>(4 * i + 1);
    auto b = rest.get<ffi::AnyBuffer>(4 * i + 2), scale = rest.get<ffi::AnyBuffer>(4 * i + 3);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!y_in.has_value() || !a.has_value() || !b.has_value() || !scale.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("aotlm_lora: an operand or result is missing");
    ffi::AnyBuffer out = **y;
    ffi::Error err = lora_one(xp, sp, xd[0], xd[1], *y_in, *a, *b, *scale, &out);
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}
