// Host-side array moves for the weight loader (models/weights.py ``transposed``), called through ctypes
// while a checkpoint is converted, not from XLA. Included by wmatmul.cc after pool.h.
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
