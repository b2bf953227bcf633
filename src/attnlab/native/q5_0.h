// attnlab's Q5_0 product for a few rows: y (M, N) = x (M, K) @ W^T, W read as llama.cpp
// stores it (ggml's block_q5_0): per 32 weights 22 bytes, a float16 scale d (bytes 0-1), the
// codes' fifth bits qh (bytes 2-5, a little-endian uint32: bit j is weight j's) and their low
// four bits qs (bytes 6-21: weight j < 16 in the low nibble of qs[j], weight j + 16 in its high
// nibble). W[n, k] = d * (q - 16), q in 0..31: 0.6875 bytes a weight, where q8_0 reads 1.0625.
//
// The AVX-512 BF16 and plain branches keep x as given (no activation quantisation): each weight
// d * (q - 16) is exact in float32 (a 5-bit integer times an 11-bit significand), and every
// product and sum runs in float32, so the result is x @ W^T up to the order of the float32
// sums. One output row of W at a time (parallel over N): its blocks are read and unpacked once
// for up to kRowsAtOnce rows of x. With AVX-512 a block's codes are unpacked by byte
// operations (the fifth bits are a mask) and turned into q - 16 by a table lookup; bf16 rows
// are then read as they are, a block's 32 products summed by one bf16 dot-product instruction
// (q - 16 is exact in bf16) and scaled by d.
//
// Without bf16 dot products (AVX2, and AVX-512 without BF16: Skylake and Cascade Lake), the
// kernel sums integer products, as q8_0.h does: each 32-block of each row of x
// becomes 16-bit codes p with a scale e (attnlab_simd::quantise_rows: x = e p within 0.506 e,
// e = 2^-15 of the block's largest |x|), the block's codes are spread to bytes q - 16 (a
// shuffle and a compare spread the fifth bits, as ggml does) and widened to int16, and
// S = sum (q - 16) p is exact (two vpmaddwd). A block adds d e S to a float32 sum; four weight
// rows a pass for one row of x. Error: on top of the float32 sums' own, at most
// 0.506 * sum over blocks of e * |d| * sum |q - 16|, 2^-16 of each block's largest |x| times
// its |w| sum. Gemma 3's 2048 x 640, one row, one thread of a Zen 4 built for x86-64-v3: 105 us
// a product, against 182 us for the float32 branch it replaced, timed side by side. Built for
// skylake-avx512 (AVX-512 without BF16), Gemma 3's decode step at depth 4,096 took 19.0-19.1
// ms a token on one thread against 20.6 with AVX-512's float32 products, which also needed
// bf16 rows converted to float32 first (benchmarks/bench_decode_step.py --depth 4096).
//
// Used by decode_step.cpp (Product kind kQ5) and bound as q5_0_mm (attnlab.quant.Q5Linear).

#pragma once

#include "simd.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace attnlab_q5 {

constexpr int64_t kBlock = 32;       // weights per block
constexpr int64_t kBlockBytes = 22;  // d (2), qh (4), qs (16)
constexpr int64_t kRowsAtOnce = 8;   // rows of x per pass over a weight row (registers)

inline float scale_at(const uint8_t* block) {
  uint16_t bits;
  std::memcpy(&bits, block, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline uint32_t high_bits_at(const uint8_t* block) {
  uint32_t qh;
  std::memcpy(&qh, block + 2, 4);  // little-endian, as the file (x86)
  return qh;
}

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#define ATTNLAB_Q5_INTEGER 1  // integer products (integer_dots below) without bf16 dots
// The 32 codes of a block less 16 (-16..15) as bytes in weight order: the low nibbles of qs
// (weights 0-15), then its high nibbles (16-31), 16 added where qh's bit is set: each byte
// of the result takes qh's byte for its weight (a shuffle within each 128-bit half) and
// keeps its own bit of it (a compare), as ggml spreads Q5 bits to bytes.
inline __m256i centred_codes_avx2(const uint8_t* b) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i nibbles =
      _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), _mm_and_si128(qs, low4));
  const __m256i qh = _mm256_set1_epi32(static_cast<int>(high_bits_at(b)));
  const __m256i byte_of_weight = _mm256_setr_epi8(  // weight w's bit is in qh's byte w / 8
      0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
      3, 3, 3);
  const __m256i bit_of_weight = _mm256_set1_epi64x(0x8040201008040201);  // bit w % 8
  const __m256i set = _mm256_cmpeq_epi8(
      _mm256_and_si256(_mm256_shuffle_epi8(qh, byte_of_weight), bit_of_weight), bit_of_weight);
  const __m256i codes = _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  return _mm256_sub_epi8(codes, _mm256_set1_epi8(16));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATTNLAB_Q5_AVX512 1
// The 32 codes of a block (0..31) as bytes in weight order: the low nibbles of qs, then its
// high nibbles, 16 added where qh's bit is set (the fifth bits are a byte mask).
inline __m256i codes_at(const uint8_t* b) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
  const __m256i both =
      _mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1);
  const __m256i nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  return _mm256_mask_add_epi8(nibbles, static_cast<__mmask32>(high_bits_at(b)), nibbles,
                              _mm256_set1_epi8(16));
}
#endif

// out[r] = sum_k x[r * K + k] * W[k] for R rows of x (fp32, row stride K), W one weight row's
// K / 32 blocks.
template <int R>
inline void row_dots(const uint8_t* blocks, const float* x, int64_t K, float* out) {
#if defined(ATTNLAB_Q5_AVX512)
  // Two sums a row (a block's first and second 16 weights): one would wait on each
  // multiply-add's latency.
  __m512 acc[R], acc1[R];
  for (int r = 0; r < R; ++r) acc[r] = acc1[r] = _mm512_setzero_ps();
  // q - 16 as float by a table lookup on the code: lanes 0..15 of the pair are -16..-1,
  // lanes 16..31 are 0..15.
  const __m512 below = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5,
                                      -4, -3, -2, -1);
  const __m512 above = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* b = blocks + g * kBlockBytes;
    const __m512 vd = _mm512_set1_ps(scale_at(b));
    const __m256i q = codes_at(b);
    const __m512 w0 = _mm512_mul_ps(
        _mm512_permutex2var_ps(below, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)), above),
        vd);
    const __m512 w1 = _mm512_mul_ps(
        _mm512_permutex2var_ps(below, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)),
                               above),
        vd);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), acc[r]);
      acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc1[r]));
#else
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  float w[kBlock];
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* b = blocks + g * kBlockBytes;
    const float d = scale_at(b);
    const uint32_t qh = high_bits_at(b);
    const uint8_t* qs = b + 6;
#pragma omp simd
    for (int j = 0; j < kBlock / 2; ++j) {
      const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = d * static_cast<float>(lo - 16);
      w[j + kBlock / 2] = d * static_cast<float>(hi - 16);
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

#if defined(ATTNLAB_Q5_AVX512) && defined(__AVX512BF16__)
#define ATTNLAB_Q5_BF16 1
// The same for bf16 rows of x, read as they are: q - 16 is exact in bf16, so a block's 32
// products are summed in float32 by one dot-product instruction (VDPBF16PS: each bf16
// product exact in float32) and the block's sum then scaled by d. Its float32 sums flush
// subnormal results to zero (below 1.2e-38, far under any sum's rounding here).
// bf16 bits of q - 16 for q = 0..31 (each exact in bf16: at most 5 significant bits).
constexpr int16_t bf16_bits_of(int v) {
  if (v == 0) return 0;
  const int sign = v < 0 ? 1 : 0, m = v < 0 ? -v : v;
  int e = 0;
  while ((m >> (e + 1)) != 0) ++e;  // m in [2^e, 2^(e+1))
  return static_cast<int16_t>((sign << 15) | ((127 + e) << 7) | ((m << (7 - e)) & 0x7F));
}

alignas(64) constexpr int16_t kBf16Values[32] = {
    bf16_bits_of(-16), bf16_bits_of(-15), bf16_bits_of(-14), bf16_bits_of(-13),
    bf16_bits_of(-12), bf16_bits_of(-11), bf16_bits_of(-10), bf16_bits_of(-9),
    bf16_bits_of(-8),  bf16_bits_of(-7),  bf16_bits_of(-6),  bf16_bits_of(-5),
    bf16_bits_of(-4),  bf16_bits_of(-3),  bf16_bits_of(-2),  bf16_bits_of(-1),
    bf16_bits_of(0),   bf16_bits_of(1),   bf16_bits_of(2),   bf16_bits_of(3),
    bf16_bits_of(4),   bf16_bits_of(5),   bf16_bits_of(6),   bf16_bits_of(7),
    bf16_bits_of(8),   bf16_bits_of(9),   bf16_bits_of(10),  bf16_bits_of(11),
    bf16_bits_of(12),  bf16_bits_of(13),  bf16_bits_of(14),  bf16_bits_of(15)};
static_assert(bf16_bits_of(1) == 0x3F80 && bf16_bits_of(-16) == static_cast<int16_t>(0xC180) &&
                  bf16_bits_of(15) == 0x4170 && bf16_bits_of(-3) == static_cast<int16_t>(0xC040),
              "bf16 bits of small integers");

template <int R>
inline void row_dots(const uint8_t* blocks, const c10::BFloat16* x, int64_t K, float* out) {
  // C sums a row over blocks g % C: one row's blocks one after another into one sum would
  // wait on each multiply-add's latency (more sums for fewer rows: registers).
  constexpr int C = 2;
  const __m512i table = _mm512_load_si512(kBf16Values);
  auto block = [&](int64_t g, __m512* sums) {
    const uint8_t* b = blocks + g * kBlockBytes;
    const __m512 vd = _mm512_set1_ps(scale_at(b));
    const __m512bh w =
        (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes_at(b)), table);
    for (int r = 0; r < R; ++r) {
      const __m512bh xg = (__m512bh)_mm512_loadu_si512(x + r * K + g * kBlock);
      sums[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w, xg), vd, sums[r]);
    }
  };
  attnlab_simd::sum_groups<C, R>(K / kBlock, block, out);
}

// One bf16 row of x (decoding) against two weight rows at once: a sum per weight row (two
// chains of multiply-adds, as the two sums above), x read once for both, the table loaded and
// the final sums reduced once per pair. Fewer instructions a weight row than row_dots<1>:
// 0.88 of its time for K = 640, 0.95 for K = 2048.
inline void pair_dots(const uint8_t* b0, const uint8_t* b1, const c10::BFloat16* x, int64_t K,
                      float* out) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  const __m512i table = _mm512_load_si512(kBf16Values);
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const __m512bh xg = (__m512bh)_mm512_loadu_si512(x + g * kBlock);
    const uint8_t* p0 = b0 + g * kBlockBytes;
    const uint8_t* p1 = b1 + g * kBlockBytes;
    const __m512bh w0 =
        (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes_at(p0)), table);
    const __m512bh w1 =
        (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes_at(p1)), table);
    acc0 = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w0, xg),
                           _mm512_set1_ps(scale_at(p0)), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w1, xg),
                           _mm512_set1_ps(scale_at(p1)), acc1);
  }
  out[0] = _mm512_reduce_add_ps(acc0);
  out[1] = _mm512_reduce_add_ps(acc1);
}
#endif

#ifdef ATTNLAB_Q5_INTEGER
// AVX2: integer products with 16-bit activation codes (attnlab_simd::quantise_rows, as
// q8_0.h and q4.h read them). Block g of weight row j against row r of x is
// d[j, g] * e[r, g] * S, S = sum (q - 16) p, an exact integer sum (two vpmaddwd a block:
// four products a lane, at most 4 * 16 * 32767 < 2^24, so exact in float32 too). Per 32
// weights that is two widenings and two multiply-adds, where the float32 branch this replaced
// widened in four steps and multiplied each by d.
//
// Weight rows a pass takes at once for R rows of x: four independent sums for one row of x
// (its setup and final sums paid once per four weight rows), fewer with more rows of x,
// which fill the pipeline themselves (and need the registers).
template <int R>
constexpr int weight_rows() {
  return R == 1 ? 4 : (R == 2 ? 2 : 1);
}
constexpr int64_t kTile = weight_rows<1>();  // weight rows per step of the loop over N

// out[j * R + r] = sum over blocks g of d[j, g] * e[r * G + g] * S[j, r, g] for NR weight
// rows (stride row_bytes) and R rows of x's codes p (stride K), scales e (stride K / 32).
template <int R, int NR>
inline void integer_dots(const uint8_t* blocks, int64_t row_bytes, const int16_t* p,
                         const float* e, int64_t K, float* out) {
  const int64_t G = K / kBlock;
  __m256 sums[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) sums[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    attnlab_simd::prefetch_ahead(blocks + g * NR * kBlockBytes, NR * kBlockBytes);
    for (int j = 0; j < NR; ++j) {
      const uint8_t* b = blocks + j * row_bytes + g * kBlockBytes;
      const __m256i q = centred_codes_avx2(b);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
      const float d = scale_at(b);
      for (int r = 0; r < R; ++r) {
        const __m256i i = attnlab_simd::block_products(w0, w1, p + r * K + g * kBlock);
        sums[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d * e[r * G + g]),
                                     sums[j][r]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) out[j * R + r] = attnlab_simd::hsum(sums[j][r]);
}

// out[j * R + r] for nw (<= kTile) weight rows and R rows of x: weight_rows<R>() at a time,
// then one at a time.
template <int R>
inline void integer_tile(int64_t nw, const uint8_t* blocks, int64_t row_bytes,
                         const int16_t* p, const float* e, int64_t K, float* out) {
  constexpr int NR = weight_rows<R>();
  int64_t j = 0;
  for (; j + NR <= nw; j += NR)
    integer_dots<R, NR>(blocks + j * row_bytes, row_bytes, p, e, K, out + j * R);
  for (; j < nw; ++j) integer_dots<R, 1>(blocks + j * row_bytes, row_bytes, p, e, K, out + j * R);
}

inline void integer_tile_rows(int64_t rows, int64_t nw, const uint8_t* blocks, int64_t row_bytes,
                              const int16_t* p, const float* e, int64_t K, float* out) {
  switch (rows) {
    case 1: return integer_tile<1>(nw, blocks, row_bytes, p, e, K, out);
    case 2: return integer_tile<2>(nw, blocks, row_bytes, p, e, K, out);
    case 3: return integer_tile<3>(nw, blocks, row_bytes, p, e, K, out);
    case 4: return integer_tile<4>(nw, blocks, row_bytes, p, e, K, out);
    case 5: return integer_tile<5>(nw, blocks, row_bytes, p, e, K, out);
    case 6: return integer_tile<6>(nw, blocks, row_bytes, p, e, K, out);
    case 7: return integer_tile<7>(nw, blocks, row_bytes, p, e, K, out);
    default: return integer_tile<8>(nw, blocks, row_bytes, p, e, K, out);
  }
}
#endif

template <typename X>
inline void rows_dots(int64_t rows, const uint8_t* blocks, const X* x, int64_t K, float* out) {
  switch (rows) {
    case 1: return row_dots<1>(blocks, x, K, out);
    case 2: return row_dots<2>(blocks, x, K, out);
    case 3: return row_dots<3>(blocks, x, K, out);
    case 4: return row_dots<4>(blocks, x, K, out);
    case 5: return row_dots<5>(blocks, x, K, out);
    case 6: return row_dots<6>(blocks, x, K, out);
    case 7: return row_dots<7>(blocks, x, K, out);
    default: return row_dots<8>(blocks, x, K, out);
  }
}

// y (M, N) in T (float or bf16) from x (M, K) in X and blocks (N, K / 32 * 22).
template <typename X, typename T>
inline void q5_0_rows(const X* x, const uint8_t* blocks, T* y, int64_t M, int64_t N,
                      int64_t K) {
  const int64_t row_bytes = K / kBlock * kBlockBytes;
  // Chunks of at least 32 KiB of blocks: a thread's start costs about what reading that does.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / row_bytes);
#ifdef ATTNLAB_Q5_INTEGER
  const int64_t G = K / kBlock;
  std::vector<int16_t> p(M * K);
  std::vector<float> e(M * G);
  attnlab_simd::quantise_rows(x, M, K, p.data(), e.data());
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[kTile * kRowsAtOnce];
    for (int64_t n = begin; n < end; n += kTile) {
      const int64_t nw = std::min(kTile, end - n);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, M - m0);
        integer_tile_rows(rows, nw, blocks + n * row_bytes, row_bytes, p.data() + m0 * K,
                          e.data() + m0 * G, K, out);
        for (int64_t j = 0; j < nw; ++j)
          for (int64_t r = 0; r < rows; ++r)
            y[(m0 + r) * N + n + j] = static_cast<T>(out[j * rows + r]);
      }
    }
  });
#else
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float dots[kRowsAtOnce];
    int64_t n = begin;
#ifdef ATTNLAB_Q5_BF16
    if constexpr (std::is_same_v<X, c10::BFloat16>) {
      if (M == 1) {  // weight rows in pairs (pair_dots); an odd last one below
        for (; n + 2 <= end; n += 2) {
          pair_dots(blocks + n * row_bytes, blocks + (n + 1) * row_bytes, x, K, dots);
          y[n] = static_cast<T>(dots[0]);
          y[n + 1] = static_cast<T>(dots[1]);
        }
      }
    }
#endif
    for (; n < end; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, M - m0);
        rows_dots(rows, row, x + m0 * K, K, dots);
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = static_cast<T>(dots[r]);
      }
    }
  });
#endif
}

// x (M, K) bf16 or float32 -> (M, N) in x's dtype (bf16: each sum rounded once).
inline at::Tensor q5_0_mm(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "q5_0_mm: x must be (M, K) bfloat16 or float32, got ", x.scalar_type(),
              " of shape ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "q5_0_mm: x has ", K, " columns, not a multiple of ", kBlock);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == K / kBlock * kBlockBytes,
              "q5_0_mm: blocks must be a contiguous (N, ", K / kBlock * kBlockBytes,
              ") uint8 tensor for K=", K, ", got ", blocks.scalar_type(), " of shape ",
              blocks.sizes());
  const int64_t M = x.size(0), N = blocks.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16) {
#if defined(ATTNLAB_Q5_BF16) || defined(ATTNLAB_Q5_INTEGER)  // bf16 rows read as they are
    const at::Tensor xc = x.contiguous();
    q5_0_rows(xc.data_ptr<c10::BFloat16>(), bp, y.data_ptr<c10::BFloat16>(), M, N, K);
#else
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    q5_0_rows(xf.data_ptr<float>(), bp, y.data_ptr<c10::BFloat16>(), M, N, K);
#endif
  } else {
    const at::Tensor xc = x.contiguous();
    q5_0_rows(xc.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
  }
  return y;
}

// The weight (N, K) for a prompt's dense product (torch's shifts and masks over the blocks
// cost about as much as the product): in bfloat16, each d * (q - 16) (exact in float32)
// rounded once, or with as_float32 exact, for the float32 products of a CPU without bf16
// arithmetic.
inline at::Tensor q5_0_dequant(const at::Tensor& blocks, bool as_float32) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) % kBlockBytes == 0,
              "q5_0_dequant: blocks must be a contiguous (N, K/32 * 22) uint8 tensor, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  const int64_t N = blocks.size(0), G = blocks.size(1) / kBlockBytes, K = G * kBlock;
  at::Tensor w = at::empty({N, K}, blocks.options().dtype(as_float32 ? at::kFloat : at::kBFloat16));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  auto run = [&](auto* wp) {
    using T = std::remove_pointer_t<decltype(wp)>;
    at::parallel_for(0, N, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = bp + (n * G + g) * kBlockBytes;
          const float d = scale_at(b);
          const uint32_t qh = high_bits_at(b);
          const uint8_t* qs = b + 6;
          T* o = wp + n * K + g * kBlock;
          for (int j = 0; j < 16; ++j) {
            const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1u) << 4);
            const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
            o[j] = static_cast<T>(d * static_cast<float>(lo - 16));
            o[j + 16] = static_cast<T>(d * static_cast<float>(hi - 16));
          }
        }
      }
    });
  };
  if (as_float32)
    run(w.data_ptr<float>());
  else
    run(w.data_ptr<c10::BFloat16>());
  return w;
}

// A GGUF file's Q5_0 blocks as stored, (n, 22) uint8, read into out (n, 32) float32 as
// q5_0_dequant's float32 reading does (each d (q - 16), exact), one thread: the loader
// runs it on halves of the rows (attnlab.quant.base.in_halves). Returns how many blocks
// have a d that is inf or NaN: the loader's check of the scales, made in the same pass.
inline int64_t q5_0_blocks_float32(const at::Tensor& blocks, const at::Tensor& out) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == kBlockBytes,
              "q5_0_blocks_float32: blocks must be a contiguous (n, 22) uint8 tensor, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  const int64_t n = blocks.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == n && out.size(1) == kBlock,
              "q5_0_blocks_float32: out must be a contiguous (", n, ", 32) float32 tensor, got ",
              out.scalar_type(), " of shape ", out.sizes());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* b = bp + i * kBlockBytes;
    const float d = scale_at(b);
    bad += !attnlab_simd::finite_bits(d);
    const uint32_t qh = high_bits_at(b);
    const uint8_t* qs = b + 6;
    float* o = op + i * kBlock;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1u) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
      o[j] = d * static_cast<float>(lo - 16);
      o[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
  return bad;
}

}  // namespace attnlab_q5
