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

// u = 1 / (1 + 2^t) of t clamped to [-kClamp, kClamp], and e = 2^t: what the forward's
// and the backward's elements start from.
inline float capped_u(float t, float* e) {
  t = t < -kClamp ? -kClamp : (t > kClamp ? kClamp : t);
  *e = pow2(t);
  return 1.f / (1.f + *e);
}

// One element: p from t, as the vector branches compute it (k2 = K).
inline float capped_one(float t, float k2) {
  float e;
  const float u = capped_u(t, &e);
  const float z = k2 * u - k2;
  return pow2(z < kLowest ? kLowest : (z > 0.f ? 0.f : z));
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
using Vec = attnlab_simd::F32x;
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

// capped_u on W lanes: 1 / (1 + 2^t) as a reciprocal estimate and one Newton step.
[[gnu::always_inline]] inline Vec::T capped_u_vec(Vec::T t, Vec::T* e) {
  *e = pow2_vec(Vec::clamp(t, Vec::set1(-kClamp), Vec::set1(kClamp)));
  const Vec::T d = Vec::add(Vec::set1(1.f), *e);  // in [1, 1 + 2^58]
  const Vec::T u = Vec::rcp(d);
  return Vec::mul(u, Vec::fnma(d, u, Vec::set1(2.f)));  // u (2 - d u)
}

// p for W lanes of t (k2 = K on every lane).
[[gnu::always_inline]] inline Vec::T capped_vec(Vec::T t, Vec::T k2) {
  Vec::T e;
  const Vec::T u = capped_u_vec(t, &e);
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The backward's p = 2^(K u - L) and g = u (1 - u) for W lanes of t (u = 1 / (1 + 2^t));
// p is 0 where K u - L is below 2^-126's exponent (a row that saw nothing has L = inf).
[[gnu::always_inline]] inline void capped_grad_vec(Vec::T t, Vec::T k2, Vec::T l, Vec::T* p,
                                                   Vec::T* g) {
  Vec::T e;
  const Vec::T u = capped_u_vec(t, &e);
  *g = Vec::mul(Vec::mul(e, u), u);  // u (1 - u) as 2^t u u: 1 - u = 2^t u, no cancellation
  const Vec::T z = Vec::fma(k2, u, Vec::sub(Vec::zero(), l));  // K u - L, one rounding
  *p = Vec::keep_from(z, Vec::set1(kLowest), pow2_vec(Vec::clamp(z, Vec::set1(kLowest), Vec::zero())));
}
#endif

// One element of the backward's p and g, as the vector branches compute them.
inline void capped_grad_one(float t, float k2, float l, float* p, float* g) {
  float e;
  const float u = capped_u(t, &e);
  *g = e * u * u;
  const float z = k2 * u - l;
  *p = z < kLowest ? 0.f : pow2(z > 0.f ? 0.f : z);
}

// The backward of a soft-capped tile, its element-wise first half: row r of s (n rows of
// `cols`) holds t as the forward's did; it becomes p = exp(c tanh(s / c) - lse), the
// tile's probabilities against the row's final log-sum-exp (l[r] = (lse + c) log2 e),
// and g (the same shape) gets u (1 - u), a quarter of the soft-cap's derivative
// 1 - tanh^2, computed as 2^t u^2 (1 - u = 2^t u): u - u^2 would lose g's digits to
// cancellation where u is near 1. A causal tile's hidden keys get p = 0 and g = 0.
inline void capped_grad_parts(float* s, const float* l, float* g, int64_t n, int64_t cols,
                              float cap, int64_t tq, bool causal) {
  const float k2 = 2.f * cap * 1.44269504088896341f;
  for (int64_t r = 0; r < n; ++r) {
    float* row = s + r * cols;
    float* grow = g + r * cols;
    const int64_t lim = causal ? std::min<int64_t>(cols, r % tq + 1) : cols;
    int64_t j = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const Vec::T kv = Vec::set1(k2), lv = Vec::set1(l[r]);
    for (; j + Vec::W <= lim; j += Vec::W) {
      Vec::T p, gv;
      capped_grad_vec(Vec::load(row + j), kv, lv, &p, &gv);
      Vec::store(row + j, p);
      Vec::store(grow + j, gv);
    }
#endif
    for (; j < lim; ++j) capped_grad_one(row[j], k2, l[r], row + j, grow + j);
    for (; j < cols; ++j) row[j] = grow[j] = 0.f;
  }
}

// The second half: ds = p (dp - delta[r]) g, in place of p (rows of `cols`).
inline void capped_grad_scores(float* p, const float* dp, const float* delta, const float* g,
                               int64_t n, int64_t cols) {
  for (int64_t r = 0; r < n; ++r) {
    float* pr = p + r * cols;
    const float* dr = dp + r * cols;
    const float* gr = g + r * cols;
    const float dl = delta[r];
    for (int64_t j = 0; j < cols; ++j) pr[j] = pr[j] * (dr[j] - dl) * gr[j];
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

namespace detail {
inline void check_rows(const at::Tensor& t, const char* what, const char* name) {
  TORCH_CHECK(t.dim() >= 2 && t.scalar_type() == at::kFloat && t.is_contiguous(), name, ": ",
              what, " must be a contiguous float32 tensor of rows, got ", t.scalar_type(),
              " of shape ", t.sizes());
}
inline void check_per_row(const at::Tensor& t, int64_t n, const char* what, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, name, ": ",
              what, " must be a contiguous float32 tensor of ", n, " values (one a row), got ",
              t.scalar_type(), " of shape ", t.sizes());
}
}  // namespace detail

// The module's entries of the backward: scores in place (-> p), l one value a row, g the
// scores' shape (written); then p in place (-> ds) from dp (p's shape), delta a row and g.
inline void capped_grad_parts_tensor(const at::Tensor& scores, const at::Tensor& l,
                                     const at::Tensor& g, double cap, int64_t tq, bool causal) {
  const char* name = "capped_grad_parts";
  detail::check_rows(scores, "scores", name);
  detail::check_rows(g, "g", name);
  TORCH_CHECK(g.sizes() == scores.sizes(), name, ": g must have the scores' shape ",
              scores.sizes(), ", got ", g.sizes());
  TORCH_CHECK(cap > 0, name, ": the cap must be positive, got ", cap);
  const int64_t cols = scores.size(-1), n = cols == 0 ? 0 : scores.numel() / cols;
  detail::check_per_row(l, n, "l", name);
  TORCH_CHECK(!causal || (tq > 0 && scores.size(-2) % tq == 0), name,
              ": a causal tile's rows must be whole stacks of tq = ", tq, " rows, got ",
              scores.size(-2));
  capped_grad_parts(scores.data_ptr<float>(), l.data_ptr<float>(), g.data_ptr<float>(), n, cols,
                    static_cast<float>(cap), tq, causal);
}

inline void capped_grad_scores_tensor(const at::Tensor& p, const at::Tensor& dp,
                                      const at::Tensor& delta, const at::Tensor& g) {
  const char* name = "capped_grad_scores";
  detail::check_rows(p, "p", name);
  for (const at::Tensor* t : {&dp, &g}) {
    detail::check_rows(*t, "dp and g", name);
    TORCH_CHECK(t->sizes() == p.sizes(), name, ": dp and g must have p's shape ", p.sizes(),
                ", got ", t->sizes());
  }
  const int64_t cols = p.size(-1), n = cols == 0 ? 0 : p.numel() / cols;
  detail::check_per_row(delta, n, "delta", name);
  capped_grad_scores(p.data_ptr<float>(), dp.data_ptr<float>(), delta.data_ptr<float>(),
                     g.data_ptr<float>(), n, cols);
}

}  // namespace attnlab_capped
