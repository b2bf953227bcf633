// Small pieces the kernels share.

#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

namespace attnlab_simd {

// The sum of a vector's 8 floats.
inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

#if defined(__AVX512F__)
// out[r] = the sum of every group's products for row r: block(g, acc[c]) adds group g into
// the c-th of C sets of R sums (c = g % C, a compile-time index in the main loop, so the
// sums stay in registers), then each row's C sums are added and reduced.
template <int C, int R, typename Block>
inline void sum_groups(int64_t G, Block&& block, float* out) {
  __m512 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + C <= G; g += C)
    for (int c = 0; c < C; ++c) block(g + c, acc[c]);
  for (int c = 0; g < G; ++g, ++c) block(g, acc[c]);
  for (int r = 0; r < R; ++r) {
    __m512 total = acc[0][r];
    for (int c = 1; c < C; ++c) total = _mm512_add_ps(total, acc[c][r]);
    out[r] = _mm512_reduce_add_ps(total);
  }
}
#endif

}  // namespace attnlab_simd
#endif
