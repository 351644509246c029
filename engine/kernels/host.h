// Host-side array moves for the weight loader (``transposed`` in models/checkpoint/formats.py,
// models/packing.py), called through ctypes while a checkpoint is converted, not from XLA.
#pragma once

namespace aotlm_host {
// A tile's source rows and columns (4-byte values: 8 x 8 register blocks, 15 GB/s on 2 Zen 4 cores where
// numpy's a.T copy moved 1 GB/s; other sizes element by element, where smaller tiles conflict less).
template <class T>
constexpr int64_t TILE = sizeof(T) == 4 ? 64 : 32;

// dst [C, R] = src [R, C]^T. Bands of TILE source rows are shared out over the pool's threads; within a
// tile each destination row gets its TILE values as one run while the tile's source lines stay cached.
// d[8, 8] (row stride ld) = s[8, 8]^T (row stride ls), 4-byte values in AVX registers.
inline void block8x8(const uint32_t* s, int64_t ls, uint32_t* d, int64_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(s + i * ls));
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0x44);
      r[i + j + 2] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0xEE);
    }
  // r[0..3] hold rows 0-3's columns {0,4}, {2,6}, {1,5}, {3,7} in 128-bit halves; r[4..7] rows 4-7's
  const int order[4] = {0, 2, 1, 3};
  for (int k = 0; k < 4; ++k) {
    const __m256 a = r[order[k]], b = r[4 + order[k]];
    _mm256_storeu_ps(reinterpret_cast<float*>(d + k * ld), _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(reinterpret_cast<float*>(d + (k + 4) * ld), _mm256_permute2f128_ps(a, b, 0x31));
  }
}

template <class T>
inline void transpose(const T* src, T* dst, int64_t R, int64_t C) {
  constexpr int64_t TB = TILE<T>;
  const int64_t bands = (R + TB - 1) / TB;
  aotlm::parallel_for(int(bands), [&](int b) {
    const int64_t r0 = b * TB, r1 = std::min(R, r0 + TB);
    for (int64_t c0 = 0; c0 < C; c0 += TB) {
      const int64_t c1 = std::min(C, c0 + TB);
      int64_t cs = c0;  // columns done by 8 x 8 blocks
      if constexpr (sizeof(T) == 4)
        if (r1 - r0 == TB)
          for (; cs + 8 <= c1; cs += 8)
            for (int64_t r = r0; r < r1; r += 8)
              block8x8(reinterpret_cast<const uint32_t*>(src + r * C + cs), C, reinterpret_cast<uint32_t*>(dst + cs * R + r), R);
      for (int64_t c = cs; c < c1; ++c) {
        T* out = dst + c * R;
        for (int64_t r = r0; r < r1; ++r) out[r] = src[r * C + c];
      }
    }
  });
}

// The kernels' panel layouts of a row-major W [K, N] (models/packing.py), written band by band of
// BAND rows over the pool's threads (each band's rows read once, front to back; each panel's part of
// the band written as one run):
// * pairs (int8 / bf16 / f16 / f32, packed.h): dst [N / 16][K / 2][16][2] = W[2 kp + j][16 p + c];
// * 4-bit codes (one per byte in W, int4.h): dst [N / 16][K / 8][16][4] bytes, byte (p, kb, c, t) =
//   W[8 kb + t][16 p + c] | W[8 kb + 4 + t][16 p + c] << 4.
constexpr int64_t BAND = 64;  // rows per band: a multiple of 8 (4-bit blocks) and of 2 (pairs)

// fn(p, k) for every panel p and every ``step`` rows k, a band of BAND rows per task.
template <class Fn>
inline void over_bands(int64_t K, int64_t N, int64_t step, const Fn& fn) {
  aotlm::parallel_for(int((K + BAND - 1) / BAND), [&](int b) {
    const int64_t k0 = b * BAND, k1 = std::min(K, k0 + BAND);
    for (int64_t p = 0; p < N / 16; ++p)
      for (int64_t k = k0; k < k1; k += step) fn(p, k);
  });
}

template <class T>
inline void pack_pairs(const T* src, T* dst, int64_t K, int64_t N) {
  over_bands(K, N, 2, [&](int64_t p, int64_t k) {
    T* out = dst + ((p * (K / 2) + k / 2) * 16) * 2;
    const T *r0 = src + k * N + p * 16, *r1 = r0 + N;
    for (int64_t c = 0; c < 16; ++c) out[2 * c] = r0[c], out[2 * c + 1] = r1[c];
  });
}

inline void pack_codes(const uint8_t* src, uint8_t* dst, int64_t K, int64_t N) {
  over_bands(K, N, 8, [&](int64_t p, int64_t k) {
    uint8_t* out = dst + (p * (K / 8) + k / 8) * 64;
    __m128i v[4];  // v[t]: rows t (low nibbles) and t + 4 (high) of the panel's 16 columns
    for (int64_t t = 0; t < 4; ++t) {
      const uint8_t* lo = src + (k + t) * N + p * 16;
      const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo));
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + 4 * N));
      v[t] = _mm_or_si128(l, _mm_and_si128(_mm_slli_epi16(h, 4), _mm_set1_epi8(char(0xF0))));
    }
    // byte 4c + t <- v[t][c]: interleave bytes of (0, 1) and (2, 3), then their 16-bit pairs
    const __m128i a0 = _mm_unpacklo_epi8(v[0], v[1]), a1 = _mm_unpackhi_epi8(v[0], v[1]);
    const __m128i b0 = _mm_unpacklo_epi8(v[2], v[3]), b1 = _mm_unpackhi_epi8(v[2], v[3]);
    __m128i* o = reinterpret_cast<__m128i*>(out);
    _mm_storeu_si128(o, _mm_unpacklo_epi16(a0, b0));
    _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(a0, b0));
    _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(a1, b1));
    _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(a1, b1));
  });
}
}  // namespace aotlm_host

// 0 when done, 1 for an element size other than 1, 2, 4 or 8 bytes.
extern "C" int aotlm_transpose(const void* src, void* dst, int64_t rows, int64_t cols, int64_t itemsize) {
  switch (itemsize) {
    case 1: aotlm_host::transpose(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), rows, cols); return 0;
    case 2: aotlm_host::transpose(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols); return 0;
    case 4: aotlm_host::transpose(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), rows, cols); return 0;
    case 8: aotlm_host::transpose(static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), rows, cols); return 0;
    default: return 1;
  }
}

// W [K, N] -> its panel layout (K even, N a multiple of 16; ``codes``: 4-bit codes one per byte, K a
// multiple of 8). 0 when done, 1 for an element size the layout does not take.
extern "C" int aotlm_pack_panels(const void* src, void* dst, int64_t K, int64_t N, int64_t itemsize, int codes) {
  if (codes) {
    if (itemsize != 1) return 1;
    aotlm_host::pack_codes(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), K, N);
    return 0;
  }
  switch (itemsize) {
    case 1: aotlm_host::pack_pairs(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), K, N); return 0;
    case 2: aotlm_host::pack_pairs(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), K, N); return 0;
    case 4: aotlm_host::pack_pairs(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), K, N); return 0;
    default: return 1;
  }
}
