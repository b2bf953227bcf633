// Small pieces the kernels share.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// A function whose float products and sums must round one at a time, as ggml's and numpy's
// readings do (the file readers of q4.h, q5_0.h and kquants.h): the compiler must not fuse
// a product and a sum into one multiply-add.
#if defined(__clang__)
#define ATTNLAB_NO_CONTRACT
#define ATTNLAB_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define ATTNLAB_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define ATTNLAB_NO_CONTRACT_BODY
#else
#define ATTNLAB_NO_CONTRACT
#define ATTNLAB_NO_CONTRACT_BODY
#endif

namespace attnlab_simd {

// Whether a float is neither infinite nor NaN (a file's scale): by its exponent bits, so
// that no compiler setting can assume it away.
inline bool finite_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return (b & 0x7F800000u) != 0x7F800000u;
}

// exp(x) within about 1 ulp (Cody-Waite reduction by ln 2, Cephes' degree-6 polynomial)
// in arithmetic only, so that loops over it vectorise: std::exp does not without
// -ffast-math, and the activations and the softmax call it for every element.
inline float exp_fast(float x) {
  x = x < -87.33654f ? -87.33654f : (x > 88.37626f ? 88.37626f : x);  // 2^n stays normal
  // n = round(x / ln 2), by adding and taking away 1.5 * 2^23: std::floor and std::min
  // keep GCC from vectorising the loops this is inlined into
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Weight codes are fetched this many bytes ahead of a pass over a tile of weight rows. A
// tile's rows read side by side are streams a row apart that the hardware prefetchers follow
// badly: Gemma's 262144 x 640 Q8_0 head took 12-15 ms on one core read so (AVX-512 and
// AVX2), 8 one row at a time, 6 with this (benchmarks/bench_q8_0.py; 4 to 16 KiB ahead about
// alike).
constexpr int64_t kPrefetchBytes = 8192;

// A pass over a tile (contiguous rows) sweeps `bytes` of it per block: fetch the part of the
// tile kPrefetchBytes ahead of `at`, where this block's sweep begins.
[[gnu::always_inline]] inline void prefetch_ahead(const void* at, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(static_cast<const char*>(at) + kPrefetchBytes + b, 0, 3);
}

// 16-bit activation codes, read by the integer products of q8_0.h, q4.h and q5_0.h (AVX2): per
// 32-block of a row of x, a = max |x| over the block, e = a / 32767 and p[k] = round(x[k] /
// a * 32767) in -32767..32767 (half to even), so that x[k] = e * p[k] within 0.506 e (half a
// step, plus float32's three roundings of x / a, of its product by 32767 and of e).
constexpr int64_t kCodeBlock = 32;   // activations per scale
constexpr float kLevels = 32767.f;   // activation codes in -kLevels..kLevels

// x (M, K) in T (float or bf16) -> p (M, K) int16 codes and e (M, K/32) float scales, each
// block as above; where sums is given, also sums (M, K/32) each block's float32 sum of x in
// order. The same scalar code in every build (a compiler that vectorises it keeps each
// division, product and rounding), so every branch reads the same codes. A block with a
// non-finite x gets e = NaN (so every output of its row is NaN); an all-zero block has e = 0
// and codes 0.
template <typename T>
inline void quantise_rows(const T* x, int64_t M, int64_t K, int16_t* p, float* e,
                          float* sums = nullptr) {
  for (int64_t b = 0; b < M * (K / kCodeBlock); ++b) {
    const T* xb = x + b * kCodeBlock;
    float v[kCodeBlock];
    float a = 0.f, sum = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < kCodeBlock; ++k) {
      v[k] = static_cast<float>(xb[k]);
      const float m = std::fabs(v[k]);
      finite = finite && m <= std::numeric_limits<float>::max();  // false for inf and NaN
      a = std::max(a, m);
      sum += v[k];
    }
    if (sums != nullptr) sums[b] = sum;
    int16_t* pb = p + b * kCodeBlock;
    if (!finite || a == 0.f) {
      for (int64_t k = 0; k < kCodeBlock; ++k) pb[k] = 0;
      e[b] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    // x / a first: in [-1, 1] whatever a's size (a * (32767 / a) would overflow for a
    // below 32767 / FLT_MAX), so the code is within -32767..32767 without a clamp.
    for (int64_t k = 0; k < kCodeBlock; ++k)
      pb[k] = static_cast<int16_t>(std::nearbyint((v[k] / a) * kLevels));
    e[b] = a / kLevels;
  }
}

}  // namespace attnlab_simd

#if defined(__AVX2__)
#include <immintrin.h>

namespace attnlab_simd {

// A block's 32 products of int16 weight codes (w0: the first 16, w1: the last 16) with 32
// 16-bit activation codes at p, as 8 int32 sums of four products each: two vpmaddwd, or
// AVX-VNNI's vpdpwssd fusing the second with the add (q8_0.h and q5_0.h's AVX2 branches).
// Exact in int32, and in float32 while four |w p| stay under 2^24 (|w| <= 127).
[[gnu::always_inline]] inline __m256i block_products(__m256i w0, __m256i w1, const int16_t* p) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w0, x0), w1, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
#endif
}

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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace attnlab_simd {

// This build's float32 vector (AVX-512: 16 lanes; AVX2 with FMA: 8) and the operations the
// kernels take on it, one copy: attend.h's Simd adds its transposing sum, capped.h uses it
// as it is. Builds with neither (the plain branch) have none; their kernels loop over floats.
#if defined(__AVX512F__)
struct F32x {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T fnma(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
  static T clamp(T x, T lo, T hi) { return _mm512_min_ps(_mm512_max_ps(x, lo), hi); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
  static T scale2(T p, T n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral
  static T rcp(T d) { return _mm512_rcp14_ps(d); }               // 1 / d within 2^-14
  // v where x >= lo, else 0
  static T keep_from(T x, T lo, T v) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), v);
  }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
};
#else
struct F32x {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T fnma(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  static T clamp(T x, T lo, T hi) { return _mm256_min_ps(_mm256_max_ps(x, lo), hi); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p 2^n for integral n in [-126, 127] (the callers clamp their arguments to that range)
  static T scale2(T p, T n) {
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static T rcp(T d) { return _mm256_rcp_ps(d); }  // 1 / d within 1.5 2^-12
  // v where x >= lo, else 0
  static T keep_from(T x, T lo, T v) {
    return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), v);
  }
  static float sum(T v) { return hsum(v); }
};
#endif

}  // namespace attnlab_simd
#endif
