// attnlab's Q8_0 product for a few rows: y (M, N) = x (M, K) @ W^T, W[n, k] = d[n, k/32] *
// q[n, k], read as stored: int8 codes (N, K) and one scale per 32 weights (N, K/32), fp16 or
// bf16. 1.0625 bytes a weight (llama.cpp's Q8_0), where PyTorch's kernels would need the
// codes split into two 4-bit halves (1.25 bytes) or one scale per row (int8).
//
// x stays float (no activation quantisation): each weight d * q is exact in float32 (8-bit
// code times a scale of at most 11 significant bits), and every product and sum runs in
// float32, so the result is x @ W^T up to the order of the float32 sums. One output row of
// W at a time (parallel over N): its codes are read once for up to kRowsAtOnce rows of x.
//
// Used by decode_step.cpp (Product kind kQ8) and bound as q8_0_mm (attnlab.quant.Q8Linear).

#pragma once

#include "simd.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

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

// out[r] = sum_k x[r * K + k] * d[k / 32] * q[k] for R rows of x (fp32, row stride K).
template <int R, typename S>
inline void row_dots(const int8_t* q, const S* d, const float* x, int64_t K, float* out) {
#if defined(__AVX512F__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const __m512 vd = _mm512_set1_ps(scale_value(d[g]));
    const int8_t* qg = q + g * kBlock;
    const __m512 w0 = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qg))), vd);
    const __m512 w1 = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qg + 16)))),
        vd);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), acc[r]);
      acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const __m256 vd = _mm256_set1_ps(scale_value(d[g]));
    const int8_t* qg = q + g * kBlock;
    __m256 w[4];
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64((const __m128i*)(qg + 8 * j)))),
                           vd);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      for (int j = 0; j < 4; ++j) acc[r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = attnlab_simd::hsum(acc[r]);
  }
#else
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const float dg = scale_value(d[g]);
    const int8_t* qg = q + g * kBlock;
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < kBlock; ++k) sum += (dg * static_cast<float>(qg[k])) * xg[k];
      out[r] += sum;
    }
  }
#endif
}

template <typename S>
inline void rows_dots(int64_t rows, const int8_t* q, const S* d, const float* x, int64_t K,
                      float* out) {
  switch (rows) {
    case 1: return row_dots<1>(q, d, x, K, out);
    case 2: return row_dots<2>(q, d, x, K, out);
    case 3: return row_dots<3>(q, d, x, K, out);
    case 4: return row_dots<4>(q, d, x, K, out);
    case 5: return row_dots<5>(q, d, x, K, out);
    case 6: return row_dots<6>(q, d, x, K, out);
    case 7: return row_dots<7>(q, d, x, K, out);
    default: return row_dots<8>(q, d, x, K, out);
  }
}

// y (M, N) in T (float or bf16) from x (M, K) float32, codes (N, K), scales (N, K/32) in S.
template <typename S, typename T>
inline void q8_0_rows(const float* x, const int8_t* codes, const S* scales, T* y, int64_t M,
                      int64_t N, int64_t K) {
  // Chunks of at least 32 KiB of codes: a thread's start costs about what reading that does.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float dots[kRowsAtOnce];
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* q = codes + n * K;
      const S* d = scales + n * (K / kBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, M - m0);
        rows_dots(rows, q, d, x + m0 * K, K, dots);
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = static_cast<T>(dots[r]);
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
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  auto run = [&](auto* sp) {
    if (x.scalar_type() == at::kBFloat16)
      q8_0_rows(xp, qp, sp, y.data_ptr<c10::BFloat16>(), M, N, K);
    else
      q8_0_rows(xp, qp, sp, y.data_ptr<float>(), M, N, K);
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

}  // namespace attnlab_q8
