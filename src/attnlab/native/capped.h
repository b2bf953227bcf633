// Soft-capped attention probabilities of one tile, in one pass: the element-wise part of
// attnlab.backends.blockwise.tiles.capped_row_block.
//
// There a tile's scores arrive as t = -2 log2(e) s / c (s the scaled score, c the cap; the
// factor rides on the query) and the probability against the cap's bound is
//
//   p = exp(c tanh(s / c) - c) = exp(-2c sigmoid(-2 s / c)) = 2^(K / (1 + 2^t) - K),
//   K = 2c log2(e),
//
// with the row's sum of p added into its running sum. PyTorch takes four passes over the
// tile for that (sigmoid, a product, exp2, a sum), each a transcendental or a reduction at
// the vector width of its own kernel; here it is one pass of two powers of two and a
// reciprocal an element, and a causal (diagonal) tile's hidden upper triangle is neither
// computed nor summed, only zeroed.
//
// Accuracy: t is clamped to [-58, 58] first (the sigmoid is 0 or 1 in float32 well
// inside that), so 2^t is finite; 1 / (1 + 2^t) is a reciprocal estimate refined by one
// Newton step in the vector branches (about 1 ulp) and a division in the plain one; 2^f
// on [-1/2, 1/2] is a degree-6 polynomial (fitted for relative error: 1.6 ulp at most) scaled by
// 2^n. p's relative error is then K times the reciprocal's absolute error, as it is for
// PyTorch's passes (K's product with the sigmoid rounds the same way). The exponent of p is
// held at -126 and above (a normal number), which only a cap above 43 reaches: the caller
// checks such rows (capped_row_block's underflow test).
//
// Each branch (AVX-512, AVX2 with FMA, plain C++) computes the same formula; the last
// (partial) vector of a row and the plain branch take the scalar code.

#pragma once

#include "simd.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace attnlab_capped {

constexpr float kClamp = 58.f;      // |t| beyond this: the sigmoid is 0 or 1 in float32
constexpr float kLowest = -126.f;   // the exponent of p is held here and above

// 2^f for f in [-1/2, 1/2]: coefficients of degree 0..6
constexpr float kPow2[7] = {1.f,           0.6931471825f,  0.2402264625f, 0.05550328642f,
                            0.009618489072f, 0.001339993090f, 0.0001534581097f};

// 2^t for t in [-126, 127], in arithmetic only (vectorises; std::exp2 does not)
inline float pow2(float t) {
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest, as exp_fast does
  const float f = t - n;
  float p = kPow2[6];
  for (int k = 5; k >= 0; --k) p = p * f + kPow2[k];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One element: p from t, as the vector branches compute it (k2 = K).
inline float capped_one(float t, float k2) {
  t = t < -kClamp ? -kClamp : (t > kClamp ? kClamp : t);
  const float u = 1.f / (1.f + pow2(t));
  const float z = k2 * u - k2;
  return pow2(z < kLowest ? kLowest : (z > 0.f ? 0.f : z));
}

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int W = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T zero() { return _mm512_setzero_ps(); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T fnma(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T clamp(T x, T lo, T hi) { return _mm512_min_ps(_mm512_max_ps(x, lo), hi); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
  static T scale2(T p, T n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral
  static T rcp(T d) { return _mm512_rcp14_ps(d); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int W = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T zero() { return _mm256_setzero_ps(); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T fnma(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T clamp(T x, T lo, T hi) { return _mm256_min_ps(_mm256_max_ps(x, lo), hi); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p 2^n for integral n in [-126, 127] (the callers clamp their arguments to that range)
  static T scale2(T p, T n) {
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static T rcp(T d) { return _mm256_rcp_ps(d); }
  static float sum(T v) { return attnlab_simd::hsum(v); }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// 2^t on W lanes, t in [-126, 127]: pow2's steps.
[[gnu::always_inline]] inline Vec::T pow2_vec(Vec::T t) {
  const Vec::T n = Vec::round(t);
  const Vec::T f = Vec::sub(t, n);
  Vec::T p = Vec::set1(kPow2[6]);
  for (int k = 5; k >= 0; --k) p = Vec::fma(p, f, Vec::set1(kPow2[k]));
  return Vec::scale2(p, n);
}

// p for W lanes of t (k2 = K on every lane).
[[gnu::always_inline]] inline Vec::T capped_vec(Vec::T t, Vec::T k2) {
  t = Vec::clamp(t, Vec::set1(-kClamp), Vec::set1(kClamp));
  const Vec::T d = Vec::add(Vec::set1(1.f), pow2_vec(t));  // in [1, 1 + 2^58]
  Vec::T u = Vec::rcp(d);
  u = Vec::mul(u, Vec::fnma(d, u, Vec::set1(2.f)));  // one Newton step: u (2 - d u)
  const Vec::T z = Vec::fma(k2, u, Vec::sub(Vec::zero(), k2));  // K u - K, one rounding
  return pow2_vec(Vec::clamp(z, Vec::set1(kLowest), Vec::zero()));
}
#endif

// Row r of s (n rows of `cols`, all of a tile's heads stacked) holds t; overwrites it with
// p, zero where a causal tile hides the key (column j > r % tq), and adds the row's sum of
// p into sums[r] when sums is given.
inline void capped_probs(float* s, int64_t n, int64_t cols, float* sums, float cap,
                         int64_t tq, bool causal) {
  const float k2 = 2.f * cap * 1.44269504088896341f;
  for (int64_t r = 0; r < n; ++r) {
    float* row = s + r * cols;
    const int64_t lim = causal ? std::min<int64_t>(cols, r % tq + 1) : cols;
    float total = 0.f;
    int64_t j = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const Vec::T kv = Vec::set1(k2);
    Vec::T acc = Vec::zero();
    for (; j + Vec::W <= lim; j += Vec::W) {
      const Vec::T p = capped_vec(Vec::load(row + j), kv);
      Vec::store(row + j, p);
      acc = Vec::add(acc, p);
    }
    total = Vec::sum(acc);
#endif
    for (; j < lim; ++j) {
      row[j] = capped_one(row[j], k2);
      total += row[j];
    }
    for (; j < cols; ++j) row[j] = 0.f;
    if (sums != nullptr) sums[r] += total;
  }
}

// The module's entry: scores (..., rows, cols) contiguous float32 in place; sums: None or
// a contiguous float32 tensor of one value per row (rows of every leading index).
inline void capped_probs_tensor(const at::Tensor& scores, const std::optional<at::Tensor>& sums,
                                double cap, int64_t tq, bool causal) {
  TORCH_CHECK(scores.dim() >= 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "capped_probs: scores must be a contiguous float32 tensor of rows, got ",
              scores.scalar_type(), " of shape ", scores.sizes());
  TORCH_CHECK(cap > 0, "capped_probs: the cap must be positive, got ", cap);
  const int64_t cols = scores.size(-1);
  const int64_t n = cols == 0 ? 0 : scores.numel() / cols;
  TORCH_CHECK(!causal || (tq > 0 && scores.size(-2) % tq == 0),
              "capped_probs: a causal tile's rows must be whole stacks of tq = ", tq,
              " rows, got ", scores.size(-2));
  float* sp = nullptr;
  if (sums.has_value()) {
    TORCH_CHECK(sums->scalar_type() == at::kFloat && sums->is_contiguous() && sums->numel() == n,
                "capped_probs: sums must be a contiguous float32 tensor of ", n,
                " values (one a row), got ", sums->scalar_type(), " of shape ", sums->sizes());
    sp = sums->data_ptr<float>();
  }
  capped_probs(scores.data_ptr<float>(), n, cols, sp, static_cast<float>(cap), tq, causal);
}

}  // namespace attnlab_capped
