// A GGUF header's run of strings (a vocabulary: Gemma 3's 262,144 tokens), walked for its
// lengths: each string is a little-endian u64 length and that many bytes, so where the
// next field starts is known only after every length is read, one after another. In
// Python that walk took 0.04 s of a load's critical path (attnlab.pretrained.gguf_file,
// _Cursor.strings); here it is a loop over the bytes.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <tuple>

namespace attnlab_gguf {

// (end, lengths): the offset just past `count` strings starting at `pos` of `buf` (1-D
// uint8), and their lengths (int64); end = -1 when a length field or a string runs past
// the buffer's end (the caller then reads them one by one to name the string at fault).
inline std::tuple<int64_t, at::Tensor> string_run(const at::Tensor& buf, int64_t pos,
                                                  int64_t count) {
  TORCH_CHECK(buf.dim() == 1 && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "string_run: buf must be a contiguous 1-D uint8 tensor, got ", buf.scalar_type(),
              " of shape ", buf.sizes());
  const int64_t size = buf.numel();
  TORCH_CHECK(pos >= 0 && pos <= size && count >= 0, "string_run: ", count,
              " strings cannot start at ", pos, " of ", size, " bytes");
  if (count > (size - pos) / 8)  // not even their length fields fit
    return {-1, at::empty({0}, buf.options().dtype(at::kLong))};
  at::Tensor lengths = at::empty({count}, buf.options().dtype(at::kLong));
  int64_t* out = lengths.data_ptr<int64_t>();
  const uint8_t* p = buf.data_ptr<uint8_t>();
  for (int64_t i = 0; i < count; ++i) {
    if (size - pos < 8) return {-1, lengths};
    uint64_t n = 0;  // little-endian, whatever this machine's order
    for (int k = 7; k >= 0; --k) n = (n << 8) | p[pos + k];
    pos += 8;
    if (n > static_cast<uint64_t>(size - pos)) return {-1, lengths};
    out[i] = static_cast<int64_t>(n);
    pos += static_cast<int64_t>(n);
  }
  return {pos, lengths};
}

}  // namespace attnlab_gguf
