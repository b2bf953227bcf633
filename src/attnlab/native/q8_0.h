// attnlab's Q8_0 product for a few rows: y (M, N) = x (M, K) @ W^T, W[n, k] = d[n, k/32] *
// q[n, k], read as stored: int8 codes (N, K) and one scale per 32 weights (N, K/32), fp16 or
// bf16. 1.0625 bytes a weight (llama.cpp's Q8_0), where PyTorch's kernels would need the
// codes split into two 4-bit halves (1.25 bytes) or one scale per row (int8).
//
// Integer dot products. Each 32-block of each row of x is quantised once per call to 16-bit
// codes with a float scale (attnlab_simd::quantise_rows, shared with q4.h's AVX2 branch):
// a = max |x| over the block, e = a / 32767, p[k] = round(x[k] / a * 32767) in
// -32767..32767 (half to even), so that x[k] = e * p[k] within about e / 2.
// A weight block's dot with it is the integer sum S = sum q[k] p[k] (|S| <= 32 * 127 *
// 32767 < 2^31), computed exactly, and y = sum over blocks of (d * e) * S in float32. The
// branches form S from the same products: AVX-512BW one vpmaddwd of 32 int16 pairs a block
// (16 partial sums of two products), AVX2 two of 16 pairs (8 partial sums of four products:
// at most 4 * 127 * 32767 < 2^24, so exact in float32 too, as are AVX-512's), AVX_VNNI's
// vpdpwssd fusing the second multiply-add with the add; the plain loop sums S in int32. So
// they agree up to the order of the float32 sums of the blocks' scaled sums.
//
// Error: per weight, |x - e p| <= 0.506 e (half a step, plus float32's rounding of x / a,
// of its product by 32767 and of e: three roundings of at most 2^-24 |x| <= 2^-24 * 32767
// e each). A product's error is at most 0.506 / 32767 * sum over blocks of a_block * sum
// |w| over the block, about 2^-16 of each block's largest |x| times its |w| sum, on top of
// the float32 sums' own (the float kernel this replaces had those alone). Relative to a
// product's sum |x w| that is larger where a block holds an outlier: Gemma 3's activations
// gave 2e-5 to 9e-5 of it (the float kernel 2e-7), still far below bfloat16's rounding of
// the output (2^-9 = 2e-3), which is where decoding rounds it. A block with a non-finite x
// gets e = NaN, so every output of its row is NaN; an all-zero block has e = 0 and codes 0.
//
// Why 16-bit codes rather than llama.cpp's 8-bit ones: AVX2's vpmaddubsw on 8-bit codes needs
// the sign trick (two more instructions a block) and its error is 2^-8 of a block's largest
// |x|; 16-bit codes cost one widening of the weights (shared by every row of x) and one
// more multiply-add per row on AVX2, none on AVX-512 (one block fills one register).
// Measured on AVX2, one core, one row, the same four-row passes: 8-bit codes took as long
// for Gemma's 262144 x 640 head (6.2-6.6 ms against 6.2-6.4: the codes' reading bounds
// both) and 15% less for a 1536 x 576 weight in cache (20.8 us against 24.0-24.4). With
// AVX512_VNNI there is nothing to fuse (one vpmaddwd per block), so that build runs the
// AVX-512BW branch.
//
// A few output rows of W at a time (parallel over N): their codes are read once for up
// to kRowsAtOnce rows of x.
//
// Used by decode_step.cpp (Product kind kQ8) and bound as q8_0_mm (attnlab.quant.Q8Linear).

#pragma once

#include "simd.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace attnlab_q8 {

constexpr int64_t kBlock = 32;       // weights per scale
constexpr int64_t kRowsAtOnce = 8;   // rows of x per pass over a weight row (registers)

inline float scale_value(c10::Half s) {
#ifdef __F16C__
  return _cvtsh_ss(s.x);
#else
  return static_cast<float>(s);
#endif
}

inline float scale_value(c10::BFloat16 s) { return static_cast<float>(s); }

// c (R, G) = d[g] * e[r * G + g]: each block's two scales in one, for R rows of x.
template <int R, typename S>
[[gnu::always_inline]] inline void block_scales(const S* d, const float* e, int64_t G, float* c) {
  int64_t g = 0;
#if defined(__AVX512F__)
  for (; g + 16 <= G; g += 16) {
    __m512 vd;
    if constexpr (std::is_same_v<S, c10::Half>) {
      vd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g)));
    } else {
      vd = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g))),
          16));
    }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(c + r * G + g, _mm512_mul_ps(vd, _mm512_loadu_ps(e + r * G + g)));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  for (; g + 8 <= G; g += 8) {
    __m256 vd;
    if constexpr (std::is_same_v<S, c10::Half>) {
      vd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g)));
    } else {
      vd = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g))),
          16));
    }
    for (int r = 0; r < R; ++r)
      _mm256_storeu_ps(c + r * G + g, _mm256_mul_ps(vd, _mm256_loadu_ps(e + r * G + g)));
  }
#endif
  for (; g < G; ++g) {
    const float dg = scale_value(d[g]);
    for (int r = 0; r < R; ++r) c[r * G + g] = dg * e[r * G + g];
  }
}

// Weight rows a pass takes at once for R rows of x: one row of x against one weight row
// would wait on each multiply-add's latency and pay a weight row's setup and final sum for
// 20 blocks (Gemma's K = 640); four weight rows keep four independent sums. More rows of
// x fill the pipeline themselves (and need the registers).
template <int R>
constexpr int weight_rows() {
  return R == 1 ? 4 : (R == 2 ? 2 : 1);
}
constexpr int64_t kTile = 4;  // weight rows per step of the loop over N (the most above)

// out[j * R + r] = sum over blocks g of c[(j * R + r) * G + g] * sum_k q[j * K + g * 32 + k] *
// p[r * K + g * 32 + k] for NR weight rows of codes q (stride K) and R rows of x's codes p
// (stride K); c from block_scales, one weight row after another.
template <int R, int NR>
[[gnu::always_inline]] inline void dots(const int8_t* q, const int16_t* p, const float* c,
                                        int64_t K, float* out) {
  const int64_t G = K / kBlock;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 sums[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) sums[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    attnlab_simd::prefetch_ahead(q + g * NR * kBlock, NR * kBlock);
    __m512i x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_si512(p + r * K + g * kBlock);
    for (int j = 0; j < NR; ++j) {
      const __m512i w = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + g * kBlock)));
      for (int r = 0; r < R; ++r) {
        // 16 sums of two products each: exact in float32 (|s| <= 2 * 127 * 32767 < 2^24)
        const __m512 s = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, x[r]));
        sums[j][r] = _mm512_fmadd_ps(s, _mm512_set1_ps(c[(j * R + r) * G + g]), sums[j][r]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) out[j * R + r] = _mm512_reduce_add_ps(sums[j][r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 sums[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) sums[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    attnlab_simd::prefetch_ahead(q + g * NR * kBlock, NR * kBlock);
    for (int j = 0; j < NR; ++j) {
      const int8_t* qg = q + j * K + g * kBlock;
      const __m256i w0 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
      const __m256i w1 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)));
      for (int r = 0; r < R; ++r) {
        const __m256i i = attnlab_simd::block_products(w0, w1, p + r * K + g * kBlock);
        const __m256 s = _mm256_cvtepi32_ps(i);  // exact: |s| <= 4 * 127 * 32767 < 2^24
        sums[j][r] = _mm256_fmadd_ps(s, _mm256_broadcast_ss(c + (j * R + r) * G + g),
                                     sums[j][r]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) out[j * R + r] = attnlab_simd::hsum(sums[j][r]);
#else
  for (int j = 0; j < NR; ++j) {
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* qg = q + j * K + g * kBlock;
        const int16_t* pg = p + r * K + g * kBlock;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < kBlock; ++k) sum += static_cast<int32_t>(qg[k]) * pg[k];
        total += c[(j * R + r) * G + g] * static_cast<float>(sum);
      }
      out[j * R + r] = total;
    }
  }
#endif
}

// out[j * R + r] for the tile's nw (<= kTile) weight rows and R rows of x: weight_rows<R>()
// at a time, then one at a time. c: scratch of kTile * R * G floats.
template <int R, typename S>
[[gnu::always_inline]] inline void tile(int64_t nw, const int8_t* q, const S* d,
                                        const int16_t* p, const float* e, int64_t K, float* c,
                                        float* out) {
  constexpr int NR = weight_rows<R>();
  const int64_t G = K / kBlock;
  for (int64_t j = 0; j < nw; ++j) block_scales<R>(d + j * G, e, G, c + j * R * G);
  int64_t j = 0;
  for (; j + NR <= nw; j += NR) dots<R, NR>(q + j * K, p, c + j * R * G, K, out + j * R);
  for (; j < nw; ++j) dots<R, 1>(q + j * K, p, c + j * R * G, K, out + j * R);
}

template <typename S>
[[gnu::always_inline]] inline void tile_rows(int64_t rows, int64_t nw, const int8_t* q,
                                             const S* d, const int16_t* p, const float* e,
                                             int64_t K, float* c, float* out) {
  switch (rows) {
    case 1: return tile<1>(nw, q, d, p, e, K, c, out);
    case 2: return tile<2>(nw, q, d, p, e, K, c, out);
    case 3: return tile<3>(nw, q, d, p, e, K, c, out);
    case 4: return tile<4>(nw, q, d, p, e, K, c, out);
    case 5: return tile<5>(nw, q, d, p, e, K, c, out);
    case 6: return tile<6>(nw, q, d, p, e, K, c, out);
    case 7: return tile<7>(nw, q, d, p, e, K, c, out);
    default: return tile<8>(nw, q, d, p, e, K, c, out);
  }
}

// y (M, N) in T (float or bf16) from x's codes p (M, K) and scales e (M, K/32), the
// weight's codes (N, K) and scales (N, K/32) in S.
template <typename S, typename T>
inline void q8_0_rows(const int16_t* p, const float* e, const int8_t* codes, const S* scales,
                      T* y, int64_t M, int64_t N, int64_t K) {
  // Chunks of at least 32 KiB of codes: a thread's start costs about what reading that does.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / K);
  const int64_t G = K / kBlock;
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[kTile * kRowsAtOnce];
    std::vector<float> c(kTile * kRowsAtOnce * G);  // the tile's block scales
    for (int64_t n = begin; n < end; n += kTile) {
      const int64_t nw = std::min(kTile, end - n);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, M - m0);
        tile_rows(rows, nw, codes + n * K, scales + n * G, p + m0 * K, e + m0 * G, K,
                  c.data(), out);
        for (int64_t j = 0; j < nw; ++j)
          for (int64_t r = 0; r < rows; ++r)
            y[(m0 + r) * N + n + j] = static_cast<T>(out[j * rows + r]);
      }
    }
  });
}

// x (M, K) bf16 or float32 -> (M, N) in x's dtype (bf16: each sum rounded once).
inline at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "q8_0_mm: codes must be a contiguous 2-D int8 tensor, got ", codes.scalar_type(),
              " of shape ", codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(K % kBlock == 0, "q8_0_mm: codes have ", K, " columns, not a multiple of ",
              kBlock);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / kBlock &&
                  scales.is_contiguous() &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kBFloat16),
              "q8_0_mm: scales must be a contiguous (", N, ", ", K / kBlock,
              ") float16 or bfloat16 tensor, got ", scales.scalar_type(), " of shape ",
              scales.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "q8_0_mm: x must be (M, ", K, ") bfloat16 or float32, got ", x.scalar_type(),
              " of shape ", x.sizes());
  const int64_t M = x.size(0);
  const at::Tensor xc = x.contiguous();
  std::vector<int16_t> p(M * K);
  std::vector<float> e(M * (K / kBlock));
  if (x.scalar_type() == at::kBFloat16)
    attnlab_simd::quantise_rows(xc.data_ptr<c10::BFloat16>(), M, K, p.data(), e.data());
  else
    attnlab_simd::quantise_rows(xc.data_ptr<float>(), M, K, p.data(), e.data());
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* qp = codes.data_ptr<int8_t>();
  auto run = [&](auto* sp) {
    if (x.scalar_type() == at::kBFloat16)
      q8_0_rows(p.data(), e.data(), qp, sp, y.data_ptr<c10::BFloat16>(), M, N, K);
    else
      q8_0_rows(p.data(), e.data(), qp, sp, y.data_ptr<float>(), M, N, K);
  };
  if (scales.scalar_type() == at::kHalf)
    run(scales.data_ptr<c10::Half>());
  else
    run(scales.data_ptr<c10::BFloat16>());
  return y;
}

// The weight (N, K) in bfloat16, each d * q (exact in float32) rounded once, for a
// prompt's dense product.
inline at::Tensor q8_0_dequant(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) % kBlock == 0,
              "q8_0_dequant: codes must be a contiguous (N, K) int8 tensor, K a multiple of 32, "
              "got ", codes.scalar_type(), " of shape ", codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / kBlock &&
                  scales.is_contiguous() &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kBFloat16),
              "q8_0_dequant: scales must be a contiguous (", N, ", ", K / kBlock,
              ") float16 or bfloat16 tensor, got ", scales.scalar_type(), " of shape ",
              scales.sizes());
  at::Tensor w = at::empty({N, K}, codes.options().dtype(at::kBFloat16));
  const int8_t* qp = codes.data_ptr<int8_t>();
  c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  auto run = [&](auto* sp) {
    at::parallel_for(0, N, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t g = 0; g < K / kBlock; ++g) {
          const float d = scale_value(sp[n * (K / kBlock) + g]);
          const int8_t* q = qp + n * K + g * kBlock;
          c10::BFloat16* o = wp + n * K + g * kBlock;
          for (int64_t j = 0; j < kBlock; ++j) o[j] = c10::BFloat16(d * static_cast<float>(q[j]));
        }
      }
    });
  };
  if (scales.scalar_type() == at::kHalf)
    run(scales.data_ptr<c10::Half>());
  else
    run(scales.data_ptr<c10::BFloat16>());
  return w;
}

// A GGUF file's Q8_0 blocks as stored, (n, 34) uint8 (d: f16, then 32 int8 codes), read
// into out (n, 32) float32: each d * q, exact (a float32 model's load; one pass, where
// numpy's multiply of the strided codes by the scales casts both on the way). Returns how
// many blocks have a d that is inf or NaN: the loader's check of the scales, in this pass.
inline int64_t q8_0_blocks_float32(const at::Tensor& blocks, const at::Tensor& out) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == kBlock + 2,
              "q8_0_blocks_float32: blocks must be a contiguous (n, 34) uint8 tensor, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  const int64_t n = blocks.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == n && out.size(1) == kBlock,
              "q8_0_blocks_float32: out must be a contiguous (", n, ", 32) float32 tensor, got ",
              out.scalar_type(), " of shape ", out.sizes());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* b = bp + i * (kBlock + 2);
    c10::Half h;
    std::memcpy(&h, b, 2);
    const float d = scale_value(h);
    bad += !attnlab_simd::finite_bits(d);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    float* o = op + i * kBlock;
    for (int64_t j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(q[j]);
  }
  return bad;
}

}  // namespace attnlab_q8
