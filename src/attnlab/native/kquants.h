// A GGUF file's Q4_K and Q6_K super-blocks (256 weights each) read into float32, as ggml
// and attnlab's numpy readers (attnlab.pretrained.gguf_file) read them, bit for bit: a
// float32 model's load of Gemma 3's 27 Q4_K and 9 Q6_K tensors, which numpy takes in
// several passes (nibbles, scales, products) and these in one. No format holds these
// types as stored (int4 regroups Q4_K, int8 and q8_0 requantise Q6_K), so the readers are
// all there is of them here.
//
// Q4_K (144 bytes): d and dmin (float16), 12 bytes of 6-bit scales sc and mins m for 8
// sub-blocks of 32, 128 bytes of codes; sub-block s of pair j = s / 2 is the low (s even)
// or high (s odd) nibbles of the pair's 32 bytes; its weights are (d sc) q - (dmin m):
// both products exact in float32 (an 11-bit significand times a 6-bit integer), then one
// rounding of the product with q and one of the difference (contraction off).
//
// Q6_K (210 bytes): ql (128 bytes), qh (64), 16 int8 scales (one per 16 weights), d
// (float16) last. Each half of 128 weights takes 64 bytes of ql and 32 of qh: weight
// j's low four bits are the low nibbles of the 64 bytes for j < 64, then their high
// nibbles; its top two bits are bits 2 (j / 32) and up of qh[j % 32]. Its value is
// (d sc) (q - 32), d sc exact, so one rounding.
//
// Each returns how many super-blocks have a float16 scale (d, dmin) that is inf or NaN:
// the loader's check of the file's scales, made in the same pass.

#pragma once

#include "simd.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace attnlab_kq {

constexpr int64_t kSuper = 256;  // weights per super-block

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

inline void check_blocks(const at::Tensor& blocks, const at::Tensor& out, int64_t bytes,
                         const char* name) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == bytes,
              name, ": blocks must be a contiguous (n, ", bytes, ") uint8 tensor, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == blocks.size(0) && out.size(1) == kSuper,
              name, ": out must be a contiguous (", blocks.size(0), ", 256) float32 tensor, got ",
              out.scalar_type(), " of shape ", out.sizes());
}

ATTNLAB_NO_CONTRACT inline int64_t q4_k_blocks_float32(const at::Tensor& blocks,
                                                       const at::Tensor& out) {
  ATTNLAB_NO_CONTRACT_BODY
  check_blocks(blocks, out, 144, "q4_k_blocks_float32");
  const int64_t n = blocks.size(0);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* b = bp + i * 144;
    const float d = half_at(b), dmin = half_at(b + 2);
    bad += !(attnlab_simd::finite_bits(d) && attnlab_simd::finite_bits(dmin));
    const uint8_t* sm = b + 4;  // ggml's get_scale_min_k4
    const uint8_t* qs = b + 16;
    float* o = op + i * kSuper;
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      if (s < 4) {
        sc = sm[s] & 63;
        m = sm[s + 4] & 63;
      } else {
        sc = (sm[s + 4] & 15) | ((sm[s - 4] >> 6) << 4);
        m = (sm[s + 4] >> 4) | ((sm[s] >> 6) << 4);
      }
      const float scale = d * static_cast<float>(sc), low = dmin * static_cast<float>(m);
      const uint8_t* q = qs + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      float* w = o + 32 * s;
      for (int k = 0; k < 32; ++k) {
        const float prod = static_cast<float>((q[k] >> shift) & 15) * scale;
        w[k] = prod - low;
      }
    }
  }
  return bad;
}

inline int64_t q6_k_blocks_float32(const at::Tensor& blocks, const at::Tensor& out) {
  check_blocks(blocks, out, 210, "q6_k_blocks_float32");
  const int64_t n = blocks.size(0);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* b = bp + i * 210;
    const float d = half_at(b + 208);
    bad += !attnlab_simd::finite_bits(d);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    float* o = op + i * kSuper;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      for (int j = 0; j < 128; ++j) {
        const int low = j < 64 ? (ql[j] & 15) : (ql[j - 64] >> 4);
        const int top = (qh[j % 32] >> (2 * (j / 32))) & 3;
        const int idx = 128 * h + j;
        o[idx] = static_cast<float>((low | (top << 4)) - 32) * (d * static_cast<float>(sc[idx / 16]));
      }
    }
  }
  return bad;
}

}  // namespace attnlab_kq
