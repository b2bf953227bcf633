// One new token's attention over a key/value cache: o = softmax(scale q k^T) v for every
// query head, over the cache positions [s0, S) (s0 > 0 for a sliding window).
//
// Shape legend: B batch, H query heads, G key/value heads (groups), Hg = H / G heads a
// group, D head dim, S cache positions attended.
//
// At depth this is a stream over the cache (keys and values, float32 or float16: a cache
// element type E, each value widened to float32 as it is loaded, so the math is the same
// float32 math on the values the cache holds): each group's keys and values are read once
// for all the Hg query heads of the group. A float16 cache is half the bytes to stream,
// which is what a step at depth waits on. The positions are cut
// into chunks of kChunk; each (row, group, chunk) is one piece of work giving, per head,
// the chunk's largest score m, the sum l of exp(score - m) and the unnormalised sum
// acc = sum exp(score - m) v. The pieces are merged as the blockwise (online) softmax does:
// with M the largest m of a head's chunks, o = sum_c exp(m_c - M) acc_c / sum_c
// exp(m_c - M) l_c. The chunks do not depend on the thread count, so neither do the
// numbers: threads only share the pieces out (several per group at depth, which is what
// keeps both threads busy on a model with one group).
//
// Scores take W positions at a time (the vector width): W vector sums over D, one per
// position, reduced together into one vector of W scores (a transpose by shuffles), in
// place of one horizontal sum per position. The weighted sum of values holds up to 4
// heads' sums for a stretch of D in registers while it walks the chunk's positions.
//
// Each branch (AVX-512, AVX2 with FMA, plain C++) computes the same float32 math; they
// differ only in the order of float32 sums. The plain one also serves a head dim that is
// not a multiple of the vector width.

#pragma once

#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace attnlab_attend {

// Positions a piece of work covers: enough to amortise a piece's merge (Hg (D + 2) values)
// and small enough that a group with a long cache makes several pieces; a chunk's values
// (kChunk D 4 bytes, 256 KiB at D = 256) stay in a core's L2 for the value pass's second
// and later stretches of D.
constexpr int64_t kChunk = 256;

// Plain float "vectors" of one lane: the fallback, and any head dim.
struct Scalar {
  using T = float;
  static constexpr int W = 1;
  static constexpr int kAccs = 16;  // accumulators the value pass may keep
  static T zero() { return 0.f; }
  static T load(const float* p) { return *p; }
  static T load(const c10::Half* p) { return static_cast<float>(*p); }
  static void store(float* p, T v) { *p = v; }
  static T set1(float x) { return x; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T mul(T a, T b) { return a * b; }
  // out = the sums of W vectors, lane i the sum of v[i]'s lanes
  static T reduce(const T* v) { return v[0]; }
};

#if defined(__AVX512F__)
struct Simd : attnlab_simd::F32x {
  static constexpr int kAccs = 16;  // of 32 registers
  using F32x::load;
  static T load(const c10::Half* p) {  // 16 float16 values widened
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // Lane i of the result is the sum of v[i]'s 16 lanes. Four levels, each adding two
  // shuffles of a pair: 256-bit halves (16 -> 8 vectors, each two sources' 8 partials),
  // 128-bit quarters (-> 4, four sources' 4 partials), pairs (-> 2), single lanes (-> 1). The tree
  // leaves lane 4j + t holding the source it was given in slot 4t + j: the sources go in
  // transposed so that lane i holds v[i].
  static T reduce(const T* v) {
    auto slot = [v](int n) { return v[4 * (n % 4) + n / 4]; };
    T a[8], b[4], c[2];
    for (int k = 0; k < 8; ++k) {
      const T x = slot(2 * k), y = slot(2 * k + 1);
      a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int k = 0; k < 4; ++k) {
      const T x = a[2 * k], y = a[2 * k + 1];
      b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    }
    for (int k = 0; k < 2; ++k) {
      const T x = b[2 * k], y = b[2 * k + 1];
      c[k] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Simd : attnlab_simd::F32x {
  static constexpr int kAccs = 8;  // of 16 registers
  using F32x::load;
  static T load(const c10::Half* p) {  // 8 float16 values widened
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float t[W];
    for (int i = 0; i < W; ++i) t[i] = static_cast<float>(p[i]);
    return F32x::load(t);
#endif
  }
  // Lane i of the result is the sum of v[i]'s 8 lanes: two rounds of pairwise sums within
  // 128-bit halves, then the halves added across.
  static T reduce(const T* v) {
    const T t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const T t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const T u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#else
using Simd = Scalar;
#endif

// Software prefetch, as far ahead as measured best on a shared 2-core EPYC (Zen 5) at
// S = 4096: 15-45% less time than with the hardware prefetchers alone. Keys: kKeysAhead
// blocks of W rows ahead of the block in use; values: kValuesAhead rows ahead. The same
// rows ahead for a float16 cache (as many bytes ahead was no faster on a Xeon with AMX).
constexpr int64_t kKeysAhead = 4;
constexpr int64_t kValuesAhead = 16;

// Prefetches the 64-byte lines of [p, end) into L1.
template <typename E>
inline void prefetch_span(const E* p, const E* end) {
  const char* e = reinterpret_cast<const char*>(end);
  for (const char* c = reinterpret_cast<const char*>(p); c < e; c += 64)
    __builtin_prefetch(c, 0, 3);
}

// One chunk's scores: sc[j * ld + p] = scale q_j . k_p for the group's Hg heads j and the
// chunk's n positions p; keys (n, D) rows of E. Writes whole vectors: up to n rounded up to
// W (ld >= that), the extra lanes repeating the last position.
template <class V, typename E>
inline void chunk_scores(const float* q, int64_t Hg, int64_t D, const E* keys, int64_t n,
                         float scale, float* sc, int64_t ld) {
  constexpr int W = V::W;
  const typename V::T vscale = V::set1(scale);
  for (int64_t p0 = 0; p0 < n; p0 += W) {
    const int64_t ahead = p0 + kKeysAhead * W;
    if (ahead < n) prefetch_span(keys + ahead * D, keys + std::min<int64_t>(ahead + W, n) * D);
    const E* k[W];
    for (int i = 0; i < W; ++i) k[i] = keys + std::min<int64_t>(p0 + i, n - 1) * D;
    for (int64_t j = 0; j < Hg; ++j) {  // the block's keys stay in L1 across the heads
      const float* qj = q + j * D;
      typename V::T acc[W];
      for (int i = 0; i < W; ++i) acc[i] = V::zero();
      for (int64_t d = 0; d < D; d += W) {
        const typename V::T qv = V::load(qj + d);
        for (int i = 0; i < W; ++i) acc[i] = V::fma(qv, V::load(k[i] + d), acc[i]);
      }
      V::store(sc + j * ld + p0, V::mul(V::reduce(acc), vscale));
    }
  }
}

// acc[j * acc_ld + d] = sum_p w[j * ld + p] v_p[d] for NH heads j and the n positions'
// values (n, D) rows of E, TV vectors of D at a time (TV divides D / W).
template <class V, int NH, int TV, typename E>
inline void chunk_values(const float* w, int64_t ld, const E* vals, int64_t n, int64_t D,
                         float* acc, int64_t acc_ld) {
  constexpr int W = V::W;
  for (int64_t d0 = 0; d0 < D; d0 += TV * W) {
    typename V::T sum[NH][TV];
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < TV; ++t) sum[h][t] = V::zero();
    for (int64_t p = 0; p < n; ++p) {
      const E* v = vals + p * D + d0;
      if (p + kValuesAhead < n) prefetch_span(v + kValuesAhead * D, v + kValuesAhead * D + TV * W);
      typename V::T vv[TV];
      for (int t = 0; t < TV; ++t) vv[t] = V::load(v + t * W);
      for (int h = 0; h < NH; ++h) {
        const typename V::T wh = V::set1(w[h * ld + p]);
        for (int t = 0; t < TV; ++t) sum[h][t] = V::fma(wh, vv[t], sum[h][t]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < TV; ++t) V::store(acc + h * acc_ld + d0 + t * W, sum[h][t]);
  }
}

// chunk_values for nh (1..4) heads with tv (1, 2 or 4) vectors of D at a time
template <class V, int NH, typename E>
inline void chunk_values_tv(int tv, const float* w, int64_t ld, const E* vals, int64_t n,
                            int64_t D, float* acc, int64_t acc_ld) {
  if (tv == 4)
    chunk_values<V, NH, 4>(w, ld, vals, n, D, acc, acc_ld);
  else if (tv == 2)
    chunk_values<V, NH, 2>(w, ld, vals, n, D, acc, acc_ld);
  else
    chunk_values<V, NH, 1>(w, ld, vals, n, D, acc, acc_ld);
}

// One piece: the Hg heads of one group over n positions (keys, vals: (n, D) rows) into
// part: per head j, part[j * (D + 2)] = m, [+1] = l, [+2 ..] = acc (see the top).
template <class V, typename E>
void chunk(const float* q, int64_t Hg, int64_t D, const E* keys, const E* vals, int64_t n,
           float scale, float* sc, float* part) {
  constexpr int W = V::W;
  const int64_t ld = (n + W - 1) / W * W;
  chunk_scores<V>(q, Hg, D, keys, n, scale, sc, ld);
  for (int64_t j = 0; j < Hg; ++j) {
    float* s = sc + j * ld;
    float mx = s[0];
#pragma omp simd reduction(max : mx)
    for (int64_t p = 0; p < n; ++p) mx = std::max(mx, s[p]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < n; ++p) {
      s[p] = attnlab_simd::exp_fast(s[p] - mx);
      total += s[p];
    }
    part[j * (D + 2)] = mx;
    part[j * (D + 2) + 1] = total;
  }
  // each value row is read from memory once for the group, up to 4 heads a pass (more
  // passes for more heads, over values then in L2)
  const int64_t nvec = D / W;
  for (int64_t j0 = 0; j0 < Hg; j0 += 4) {
    const int nh = static_cast<int>(std::min<int64_t>(4, Hg - j0));
    int tv = 4;
    while (tv > 1 && (nh * tv > V::kAccs || nvec % tv != 0)) tv /= 2;
    const float* w = sc + j0 * ld;
    float* acc = part + j0 * (D + 2) + 2;
    switch (nh) {
      case 4: chunk_values_tv<V, 4>(tv, w, ld, vals, n, D, acc, D + 2); break;
      case 3: chunk_values_tv<V, 3>(tv, w, ld, vals, n, D, acc, D + 2); break;
      case 2: chunk_values_tv<V, 2>(tv, w, ld, vals, n, D, acc, D + 2); break;
      default: chunk_values_tv<V, 1>(tv, w, ld, vals, n, D, acc, D + 2);
    }
  }
}

// o (B rows of o_ld, H D each) = softmax(scale q k^T) v of each head over the cache
// positions [s0, S); q: B rows of q_ld, the H query vectors first; kc, vc: (B, G, max_len,
// D) of E (float or c10::Half); query head h reads group h / (H / G).
template <typename E>
inline void attend(const float* q, int64_t q_ld, const E* kc, const E* vc, int64_t max_len,
                   int64_t B, int64_t H, int64_t G, int64_t D, int64_t s0,
                   int64_t S, float scale, float* o, int64_t o_ld) {
  const int64_t Hg = H / G, len = S - s0;
  if (len <= 0) {  // nothing to attend to: zeros (attnlab's rule for an empty row)
    for (int64_t r = 0; r < B; ++r) std::fill_n(o + r * o_ld, H * D, 0.f);
    return;
  }
  const int64_t chunks = (len + kChunk - 1) / kChunk, pieces = B * G * chunks;
  const int64_t stride = Hg * (D + 2);  // one piece's partial results
  std::vector<float> parts(pieces * stride);
  const bool vector = D % Simd::W == 0;
  // a thread takes pieces worth at least ~2^18 multiply-adds (tens of microseconds): a
  // short cache stays on the calling thread
  const int64_t piece_work = 2 * Hg * std::min(len, kChunk) * D;
  const int64_t grain = std::max<int64_t>(1, ((int64_t{1} << 18) + piece_work - 1) / piece_work);
  at::parallel_for(0, pieces, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(Hg * (kChunk + Simd::W));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i % chunks, rg = i / chunks, r = rg / G, g = rg % G;
      const int64_t a = s0 + c * kChunk, n = std::min(kChunk, S - a);
      const float* qg = q + r * q_ld + g * Hg * D;
      const E* keys = kc + (rg * max_len + a) * D;
      const E* vals = vc + (rg * max_len + a) * D;
      if (vector)
        chunk<Simd>(qg, Hg, D, keys, vals, n, scale, sc.data(), parts.data() + i * stride);
      else
        chunk<Scalar>(qg, Hg, D, keys, vals, n, scale, sc.data(), parts.data() + i * stride);
    }
  });
  for (int64_t rg = 0; rg < B * G; ++rg) {
    const int64_t r = rg / G, g = rg % G;
    const float* first = parts.data() + rg * chunks * stride;
    for (int64_t j = 0; j < Hg; ++j) {
      float M = first[j * (D + 2)];
      for (int64_t c = 1; c < chunks; ++c) M = std::max(M, first[c * stride + j * (D + 2)]);
      float L = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* pc = first + c * stride + j * (D + 2);
        L += attnlab_simd::exp_fast(pc[0] - M) * pc[1];
      }
      float* od = o + r * o_ld + (g * Hg + j) * D;
      std::fill_n(od, D, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* pc = first + c * stride + j * (D + 2);
        const float f = attnlab_simd::exp_fast(pc[0] - M) / L;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) od[d] += f * pc[2 + d];
      }
    }
  }
}

}  // namespace attnlab_attend
