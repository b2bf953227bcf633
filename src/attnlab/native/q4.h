// attnlab's int4 product for a few rows: y (M, N) = x (M, K) @ W^T for attnlab.quant.Int4Linear's
// weight, W[n, k] = q * s + o per group of 32 weights, q in 0..15, s the group's scale and
// o = zero - 8 s its offset, both float32 (N, K/32, 2) (s and zero are Int4Linear's bf16 ones,
// o computed once in float32). The codes are (N, K/2) bytes: per row, per group 16 bytes,
// weight j < 16 of the group in the low nibble of byte j and weight j + 16 in its high nibble.
// 0.75 bytes a weight.
//
// Wherever there is AVX2 (AVX-512 CPUs included), it is used instead of PyTorch's int4
// kernels (attnlab.quant picks): on one thread of a Zen 4 with PyTorch held to its AVX-512
// kernels (ATEN_CPU_CAPABILITY=avx512), one bf16 row, SmolLM2's 1536 x 576 took 39 us against
// PyTorch's 52, 576 x 1536 36 against 52, 576 x 576 16 against 22. A few output rows of W at a
// time (parallel over N; four for one row of x): their codes are read once for up to
// kRowsAtOnce rows of x.
//
// Integer dot products, as q8_0.h. Each 32-block of each row of x is quantised once per
// call to 16-bit codes p with a float scale e (attnlab_simd::quantise_rows: x = e p within
// 0.506 e, e = 2^-15 of the block's largest |x|), and its float32 sum X is kept. A group's
// product is then s * e * S + o * X, S = sum q p the exact integer sum (two vpmaddwd of 16
// pairs: 8 partial sums of four products, at most 4 * 15 * 32767 < 2^24, so exact in float32
// too), every other product and sum in float32. Its error beyond the float32 sums' is at most
// 0.506 * e * s * sum q over each group: 2^-16 of the block's largest |x| times the group's
// |s q| sum, far below bfloat16's rounding of the output (2^-9), where decoding rounds it.
// Measured on a Zen 4 built for x86-64-v3, one thread, one bf16 row, interleaved with the
// float weights it replaces (fma(q, s, o), 21 vector instructions a group): SmolLM2's
// 49152 x 576 head 1.73-1.97 ms against 3.19-3.29, a 6144 x 576 weight 218-259 us against
// 358-395 (in a slow hour; the decode's own ratio is in bench_llama_cpp.py --isa avx2).
//
// Without AVX2, the plain loop: each weight is fma(q, s, o) in float32, one rounding (q * s is
// exact: s is a bf16 value), the value PyTorch's AVX2 int4 kernel (_weight_int4pack_mm_for_cpu)
// gives it and Int4Linear.weight's, and every product and sum runs in float32, so the result
// is x @ W^T up to the order of the float32 sums.
//
// Used by decode_step.cpp (Product kind kQ4) and bound as q4_mm (attnlab.quant.Int4Linear).

#pragma once

#include "simd.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define ATTNLAB_Q4_INTEGER 1  // 16-bit activation codes, integer dots (AVX-512 builds too)
#else
#define ATTNLAB_Q4_INTEGER 0
#endif

namespace attnlab_q4 {

constexpr int64_t kBlock = 32;      // weights per group
constexpr int64_t kRowsAtOnce = 8;  // rows of x per pass over a weight row (registers)

// The rows of x (M, K) as this build's branch reads them: for the integer branch their
// 16-bit codes, the codes' scales and the blocks' float32 sums (M, K/32), made from float32
// or bf16 rows as they are; for the plain loop the float32 rows.
struct Rows {
  int64_t K;
#if ATTNLAB_Q4_INTEGER
  std::vector<int16_t> p;
  std::vector<float> e, sums;
  template <typename X>
  Rows(const X* x_, int64_t M, int64_t K_) : K(K_) {
    p.resize(M * K);
    e.resize(M * (K / kBlock));
    sums.resize(M * (K / kBlock));
    attnlab_simd::quantise_rows(x_, M, K, p.data(), e.data(), sums.data());
  }
#else
  const float* x;
  Rows(const float* x_, int64_t, int64_t K_) : K(K_), x(x_) {}
#endif
};

#if ATTNLAB_Q4_INTEGER
// Weight rows a pass takes at once for R rows of x: one row of x against one weight row
// would wait on each multiply-add's latency and pay a weight row's setup and final sums for
// 18 groups (SmolLM2's K = 576): 25 ns a weight row against 6 for the float branch, which
// made the product no faster than it (SmolLM2's 6144 x 576, one row, one thread). Four
// weight rows keep four independent sums. More rows of x fill the pipeline themselves (and
// need the registers).
template <int R>
constexpr int weight_rows() {
  return R == 1 ? 4 : (R == 2 ? 2 : 1);
}

// out[j * R + r] = sum_k x[(m0 + r) * K + k] * W_j[k] for NR weight rows (codes q, K/2
// bytes a row; (scale, offset) pairs so, K/32 a row) and R rows of x from row m0.
template <int R, int NR>
inline void dots(const uint8_t* q, const float* so, const Rows& rows, int64_t m0, float* out) {
  const int64_t K = rows.K, G = K / kBlock;
  const int16_t* p = rows.p.data() + m0 * K;
  const float* e = rows.e.data() + m0 * G;
  const float* xs = rows.sums.data() + m0 * G;
  __m256 acc[NR][R];
  float offsets[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) {
      acc[j][r] = _mm256_setzero_ps();
      offsets[j][r] = 0.f;
    }
  const __m256i low_nibble = _mm256_set1_epi16(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    // the tile's codes and (scale, offset) pairs, each swept as one stream (simd.h)
    attnlab_simd::prefetch_ahead(q + g * NR * 16, NR * 16);
    attnlab_simd::prefetch_ahead(so + g * NR * 2, NR * 2 * sizeof(float));
    for (int j = 0; j < NR; ++j) {
      // the group's 32 codes as 16-bit lanes: bytes widened, then the low nibbles (weights
      // 0-15) and the high ones (16-31)
      const __m256i b = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * (K / 2) + g * 16)));
      const __m256i w0 = _mm256_and_si256(b, low_nibble), w1 = _mm256_srli_epi16(b, 4);
      const float s = so[j * 2 * G + 2 * g], o = so[j * 2 * G + 2 * g + 1];
      for (int r = 0; r < R; ++r) {
        const int16_t* pg = p + r * K + g * kBlock;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 16));
        // exact: |i| <= 4 * 15 * 32767 < 2^24
        const __m256i i =
            _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
        acc[j][r] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(s * e[r * G + g]), acc[j][r]);
        offsets[j][r] += o * xs[r * G + g];
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) out[j * R + r] = attnlab_simd::hsum(acc[j][r]) + offsets[j][r];
}
#else
template <int R>
constexpr int weight_rows() {
  return 1;
}

// out[r] = sum_k x[(m0 + r) * K + k] * W[k] for R rows of x from row m0; q one weight row's
// K/2 bytes of codes, so its K/32 (scale, offset) pairs.
template <int R, int NR>
inline void dots(const uint8_t* q, const float* so, const Rows& rows, int64_t m0, float* out) {
  static_assert(NR == 1, "the plain loop takes one weight row at a time");
  const int64_t K = rows.K;
  const float* x = rows.x + m0 * K;
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  float w[kBlock];
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const float s = so[2 * g], o = so[2 * g + 1];
    const uint8_t* qg = q + g * 16;
    for (int j = 0; j < 16; ++j) {
      // q * s is exact (s a bf16 value): the value PyTorch's AVX2 kernel gives the weight
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
}
#endif

// Weight rows per step of the loop over N (the most weight_rows gives).
constexpr int64_t kTile = weight_rows<1>();

// out[j * R + r] for a tile's nw (<= kTile) weight rows and R rows of x from row m0:
// weight_rows<R>() at a time, then one at a time.
template <int R>
inline void tile(int64_t nw, const uint8_t* q, const float* so, const Rows& rows, int64_t m0,
                 float* out) {
  constexpr int NR = weight_rows<R>();
  const int64_t K = rows.K, G = K / kBlock;
  int64_t j = 0;
  for (; j + NR <= nw; j += NR)
    dots<R, NR>(q + j * (K / 2), so + j * 2 * G, rows, m0, out + j * R);
  for (; j < nw; ++j) dots<R, 1>(q + j * (K / 2), so + j * 2 * G, rows, m0, out + j * R);
}

inline void tile_rows(int64_t count, int64_t nw, const uint8_t* q, const float* so,
                      const Rows& rows, int64_t m0, float* out) {
  switch (count) {
    case 1: return tile<1>(nw, q, so, rows, m0, out);
    case 2: return tile<2>(nw, q, so, rows, m0, out);
    case 3: return tile<3>(nw, q, so, rows, m0, out);
    case 4: return tile<4>(nw, q, so, rows, m0, out);
    case 5: return tile<5>(nw, q, so, rows, m0, out);
    case 6: return tile<6>(nw, q, so, rows, m0, out);
    case 7: return tile<7>(nw, q, so, rows, m0, out);
    default: return tile<8>(nw, q, so, rows, m0, out);
  }
}

// y (M, N) in T (float or bf16) from x (M, K) in X (float32; bf16 too for the integer
// branch), codes (N, K/2), scales and offsets (N, K/32, 2).
template <typename X, typename T>
inline void q4_rows(const X* x, const uint8_t* codes, const float* so, T* y, int64_t M,
                    int64_t N, int64_t K) {
  // Chunks of at least 32 KiB of codes: a thread's start costs about what reading that does.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (K / 2));
  const int64_t G = K / kBlock;
  const Rows rows(x, M, K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[kTile * kRowsAtOnce];
    for (int64_t n = begin; n < end; n += kTile) {
      const int64_t nw = std::min(kTile, end - n);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
        const int64_t count = std::min(kRowsAtOnce, M - m0);
        tile_rows(count, nw, codes + n * (K / 2), so + n * 2 * G, rows, m0, out);
        for (int64_t j = 0; j < nw; ++j)
          for (int64_t r = 0; r < count; ++r)
            y[(m0 + r) * N + n + j] = static_cast<T>(out[j * count + r]);
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
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float* sp = scale_offset.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
#if ATTNLAB_Q4_INTEGER  // bf16 rows quantised as they are
    const at::Tensor xc = x.contiguous();
    q4_rows(xc.data_ptr<c10::BFloat16>(), qp, sp, y.data_ptr<c10::BFloat16>(), M, N, K);
#else
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    q4_rows(xf.data_ptr<float>(), qp, sp, y.data_ptr<c10::BFloat16>(), M, N, K);
#endif
  } else {
    const at::Tensor xc = x.contiguous();
    q4_rows(xc.data_ptr<float>(), qp, sp, y.data_ptr<float>(), M, N, K);
  }
  return y;
}

// A GGUF file's Q4_0 or Q4_1 blocks as stored, (n, 18) or (n, 20) uint8 (d: f16, Q4_1's m:
// f16, then 16 bytes of codes: weight j < 16 the low nibble of byte j, weight 16 + j its
// high nibble), read into out (n, 32) float32 as ggml reads them (a float32 model's load):
// Q4_0 (q - 8) d, one rounding; Q4_1 q d + m, two roundings, the product and then the sum,
// so the compiler must not fuse them into one multiply-add (contraction off here).
// Returns how many blocks have a scale (d, or Q4_1's m) that is inf or NaN: the loader's
// check of the file's scales, made in the same pass.
ATTNLAB_NO_CONTRACT inline int64_t q4_blocks_float32(const at::Tensor& blocks,
                                                     const at::Tensor& out) {
  ATTNLAB_NO_CONTRACT_BODY
  const int64_t bytes = blocks.dim() == 2 ? blocks.size(1) : 0;
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  (bytes == 18 || bytes == 20),
              "q4_blocks_float32: blocks must be a contiguous (n, 18) Q4_0 or (n, 20) Q4_1 uint8 "
              "tensor, got ", blocks.scalar_type(), " of shape ", blocks.sizes());
  const int64_t n = blocks.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == n && out.size(1) == 32,
              "q4_blocks_float32: out must be a contiguous (", n, ", 32) float32 tensor, got ",
              out.scalar_type(), " of shape ", out.sizes());
  const bool with_min = bytes == 20;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* b = bp + i * bytes;
    c10::Half h[2];
    std::memcpy(h, b, with_min ? 4 : 2);
    const float d = static_cast<float>(h[0]);
    const uint8_t* qs = b + (with_min ? 4 : 2);
    float* o = op + i * 32;
    bad += !attnlab_simd::finite_bits(d);
    if (with_min) {
      const float m = static_cast<float>(h[1]);
      bad += attnlab_simd::finite_bits(d) && !attnlab_simd::finite_bits(m);
      for (int j = 0; j < 16; ++j) {
        o[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
        o[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
      }
    } else {
      for (int j = 0; j < 16; ++j) {
        o[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
        o[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
      }
    }
  }
  return bad;
}

}  // namespace attnlab_q4
