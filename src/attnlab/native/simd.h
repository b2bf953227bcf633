// Small pieces the kernels share.

#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace attnlab_simd {

// The sum of a vector's 8 floats.
inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

}  // namespace attnlab_simd
#endif
