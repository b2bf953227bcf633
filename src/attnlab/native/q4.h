// attnlab's int4 product for a few rows: y (M, N) = x (M, K) @ W^T for attnlab.quant.Int4Linear's
// weight, W[n, k] = q * s + o per group of 32 weights, q in 0..15, s the group's scale and
// o = zero - 8 s its offset, both float32 (N, K/32, 2) (s and zero are Int4Linear's bf16 ones,
// o computed once in float32). The codes are (N, K/2) bytes: per row, per group 16 bytes,
// weight j < 16 of the group in the low nibble of byte j and weight j + 16 in its high nibble.
// 0.75 bytes a weight.
//
// Each weight is fma(q, s, o) in float32, one rounding (q * s is exact: s is a bf16 value): the value PyTorch's
// AVX2 int4 kernel (_weight_int4pack_mm_for_cpu) gives it, and Int4Linear.weight's. Every
// product and sum then runs in float32, so the result is x @ W^T up to the order of the float32
// sums. Where PyTorch's int4 kernels are its AVX-512 ones they are used instead; this one is for
// the CPUs where they are slow (AVX2 without AVX-512). One output row of W at a time (parallel
// over N): its codes are read once for up to kRowsAtOnce rows of x.
//
// Used by decode_step.cpp (Product kind kQ4) and bound as q4_mm (attnlab.quant.Int4Linear).

#pragma once

#include "simd.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace attnlab_q4 {

constexpr int64_t kBlock = 32;      // weights per group
constexpr int64_t kRowsAtOnce = 8;  // rows of x per pass over a weight row (registers)

// Independent sums a row of x keeps: one row alone would wait on each multiply-add's latency,
// more rows fill the pipeline themselves (and need the registers).
template <int R>
constexpr int chains() {
  return R == 1 ? 4 : (R == 2 ? 2 : 1);
}

// out[r] = sum_k x[r * K + k] * W[k] for R rows of x (fp32, row stride K); q one weight row's
// K/2 bytes of codes, so its K/32 (scale, offset) pairs.
template <int R>
inline void row_dots(const uint8_t* q, const float* so, const float* x, int64_t K, float* out) {
  constexpr int C = chains<R>();
#if defined(__AVX512F__)
  // Sums over groups g % C, C a compile-time count: sums picked by a run-time index
  // (g % C) lived in memory, and took 46 us for 1536 x 576 and one row against 28.
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto block = [&](int64_t g, __m512* sums) {
    // the group's 16 weight values fma(q, s, o), looked up by code: a permute reads only
    // its index's low 4 bits, so a byte's low nibble needs no mask
    const __m512 values =
        _mm512_fmadd_ps(codes, _mm512_set1_ps(so[2 * g]), _mm512_set1_ps(so[2 * g + 1]));
    const __m512i b32 =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16)));
    const __m512 w0 = _mm512_permutexvar_ps(b32, values);
    const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b32, 4), values);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      sums[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), sums[r]);
      sums[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), sums[r]);
    }
  };
  attnlab_simd::sum_groups<C, R>(K / kBlock, block, out);
#elif defined(__AVX2__) && defined(__FMA__)
  // Sums over the group's four vectors j % C (j a compile-time index once unrolled): with
  // four multiply-adds a group this took 25 us for 1536 x 576 and one row, where sums over
  // groups g % C (as above) took 29 to 36.
  __m256 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  const __m256i low_nibble = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const __m256 vs = _mm256_set1_ps(so[2 * g]), vo = _mm256_set1_ps(so[2 * g + 1]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    // bytes 0-7 hold weights 0-7 (low nibbles) and 16-23 (high); bytes 8-15 the others
    const __m256i b0 = _mm256_cvtepu8_epi32(bytes);
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
    __m256 w[4];
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low_nibble)), vs, vo);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low_nibble)), vs, vo);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), vs, vo);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), vs, vo);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      for (int j = 0; j < 4; ++j) {
        __m256& a = acc[j % C][r];
        a = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), a);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 total = acc[0][r];
    for (int c = 1; c < C; ++c) total = _mm256_add_ps(total, acc[c][r]);
    out[r] = attnlab_simd::hsum(total);
  }
#else
  (void)C;
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  float w[kBlock];
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const float s = so[2 * g], o = so[2 * g + 1];
    const uint8_t* qg = q + g * 16;
    for (int j = 0; j < 16; ++j) {
      // q * s is exact (s a bf16 value), so this is the vector branches' fma to the bit
      w[j] = static_cast<float>(qg[j] & 0x0F) * s + o;
      w[j + 16] = static_cast<float>(qg[j] >> 4) * s + o;
    }
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < kBlock; ++k) sum += w[k] * xg[k];
      out[r] += sum;
    }
  }
#endif
}

inline void rows_dots(int64_t rows, const uint8_t* q, const float* so, const float* x,
                      int64_t K, float* out) {
  switch (rows) {
    case 1: return row_dots<1>(q, so, x, K, out);
    case 2: return row_dots<2>(q, so, x, K, out);
    case 3: return row_dots<3>(q, so, x, K, out);
    case 4: return row_dots<4>(q, so, x, K, out);
    case 5: return row_dots<5>(q, so, x, K, out);
    case 6: return row_dots<6>(q, so, x, K, out);
    case 7: return row_dots<7>(q, so, x, K, out);
    default: return row_dots<8>(q, so, x, K, out);
  }
}

// y (M, N) in T (float or bf16) from x (M, K) float32, codes (N, K/2), scales and offsets
// (N, K/32, 2).
template <typename T>
inline void q4_rows(const float* x, const uint8_t* codes, const float* so, T* y, int64_t M,
                    int64_t N, int64_t K) {
  // Chunks of at least 32 KiB of codes: a thread's start costs about what reading that does.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (K / 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float dots[kRowsAtOnce];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* q = codes + n * (K / 2);
      const float* s = so + n * (K / kBlock) * 2;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, M - m0);
        rows_dots(rows, q, s, x + m0 * K, K, dots);
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = static_cast<T>(dots[r]);
      }
    }
  });
}

// x (M, K) bf16 or float32 -> (M, N) in x's dtype (bf16: each sum rounded once).
inline at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& scale_offset) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "q4_mm: codes must be a contiguous 2-D uint8 tensor, got ", codes.scalar_type(),
              " of shape ", codes.sizes());
  const int64_t N = codes.size(0), K = 2 * codes.size(1);
  TORCH_CHECK(K % kBlock == 0, "q4_mm: codes have ", K / 2, " bytes a row (", K,
              " weights), not a multiple of ", kBlock, " weights");
  TORCH_CHECK(scale_offset.dim() == 3 && scale_offset.size(0) == N &&
                  scale_offset.size(1) == K / kBlock && scale_offset.size(2) == 2 &&
                  scale_offset.is_contiguous() && scale_offset.scalar_type() == at::kFloat,
              "q4_mm: scale_offset must be a contiguous (", N, ", ", K / kBlock,
              ", 2) float32 tensor, got ", scale_offset.scalar_type(), " of shape ",
              scale_offset.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "q4_mm: x must be (M, ", K, ") bfloat16 or float32, got ", x.scalar_type(),
              " of shape ", x.sizes());
  const int64_t M = x.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float* sp = scale_offset.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16)
    q4_rows(xp, qp, sp, y.data_ptr<c10::BFloat16>(), M, N, K);
  else
    q4_rows(xp, qp, sp, y.data_ptr<float>(), M, N, K);
  return y;
}

}  // namespace attnlab_q4
