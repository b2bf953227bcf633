// attnlab's native decode step: the short loop of attnlab.models.decode.short
// (step_short) for one new token per row, written once in C++
// (attnlab.models.decode.compiled drives it).
//
// The Python loop spends much of its time around the weight products: some forty tensor
// operations a layer (benchmarks/bench_decode_step.py). Here the products are the
// same kernels with the same inputs (PyTorch's int4 / int8 / dense kernels, and q4.h's,
// q5_0.h's and q8_0.h's, on rows in the layer's dtype); everything around them (RMSNorm,
// QK-norm, RoPE, the cache write, the activation, the residual adds) is a plain loop over
// float32 rows, and attention over the cache is attend.h's. The numbers are the Python
// loop's up to the order of float32 sums.
//
// Built on first use by attnlab.native (torch.utils.cpp_extension) and cached on disk.

// The ATen operators it calls, one header each, and PyTorch's pybind11 casters: not
// <ATen/ATen.h> (every operator) or <torch/extension.h> (the whole C++ frontend too), which
// took most of a build's time (tests/decode/test_native_build.py holds the includes).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "attend.h"
#include "capped.h"
#include "gguf_header.h"
#include "kquants.h"
#include "q4.h"
#include "q5_0.h"
#include "q8_0.h"

namespace {

// attnlab.native.PRODUCT_KINDS and STEP_ACTIVATIONS name these; the module exports them
// (PRODUCT_KINDS, ACTIVATIONS below) and attnlab.native checks them after each build.
enum Kind : int64_t { kInt4 = 0, kInt8 = 2, kLinear = 3, kQ8 = 4, kQ5 = 5, kQ4 = 6 };
enum Act : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2, kRelu = 3 };

// One weight product: (B, K) rows in the layer's dtype -> (B, n) float32 at a column
// offset of a wider row buffer, bias added.
struct Product {
  int64_t kind;
  // int4: packed, scales_and_zeros; q4: codes, scale_offset; int8: codes, scales; linear: weight
  at::Tensor a, b;
  int64_t group_size;
  int64_t n;
  at::Tensor bias;  // (n,) float32, or undefined

  void run(const at::Tensor& x, float* dst, int64_t ld) const {
    at::Tensor y;
    switch (kind) {
      case kInt4:
        y = at::_weight_int4pack_mm_for_cpu(x, a, group_size, b);
        break;
      case kQ8:
        y = attnlab_q8::q8_0_mm(x, a, b);
        break;
      case kQ5:
        y = attnlab_q5::q5_0_mm(x, a);
        break;
      case kQ4:
        y = attnlab_q4::q4_mm(x, a, b);
        break;
      case kInt8:
        y = at::_weight_int8pack_mm(x, a, b);
        break;
      default:
        y = at::linear(x, a);
    }
    y = y.contiguous();
    const int64_t B = x.size(0), width = y.size(1);
    const float* bias_p = bias.defined() ? bias.data_ptr<float>() : nullptr;
    for (int64_t r = 0; r < B; ++r) {
      float* out = dst + r * ld;
      if (y.scalar_type() == at::kBFloat16) {
        const c10::BFloat16* row = y.data_ptr<c10::BFloat16>() + r * width;
        for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(row[j]);
      } else {
        TORCH_CHECK(y.scalar_type() == at::kFloat, "native step: product output ",
                    y.scalar_type(), " is neither bfloat16 nor float32");
        const float* row = y.data_ptr<float>() + r * width;
        for (int64_t j = 0; j < n; ++j) out[j] = row[j];
      }
      if (bias_p != nullptr)
        for (int64_t j = 0; j < n; ++j) out[j] += bias_p[j];
    }
  }
};

struct Norm {
  at::Tensor weight;  // float32, (C,) or (rows, C)
  double eps = 0.0;
  bool defined() const { return weight.defined(); }
};

struct Layer {
  Norm norm1, norm2, attn_post, mlp_post, qk_norm;
  at::ScalarType dtype;
  std::vector<Product> qkv, out, gate_up, down;
  int64_t act;
  double scale;
  int64_t window;  // keys a query sees, itself included; 0 = all
  int64_t rope;    // index into the step's rotations
};

// y = w * (x * rsqrt(mean(x^2) + eps)) over rows of width n (w: one row, or one per row)
void rms_rows(const float* x, float* y, int64_t rows, int64_t n, const Norm& norm,
              bool weight_per_row) {
  const float* w = norm.weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; ++j) ss += xr[j] * xr[j];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(norm.eps));
    const float* wr = weight_per_row ? w + r * n : w;
    float* yr = y + r * n;
    for (int64_t j = 0; j < n; ++j) yr[j] = wr[j] * (xr[j] * inv);
  }
}

at::Tensor as_input(const std::vector<float>& buf, int64_t B, int64_t K, at::ScalarType dtype) {
  at::Tensor t = at::empty({B, K}, at::TensorOptions().dtype(dtype));
  if (dtype == at::kBFloat16) {
    c10::BFloat16* p = t.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < B * K; ++i) p[i] = c10::BFloat16(buf[i]);
  } else {
    TORCH_CHECK(dtype == at::kFloat, "native step: products in ", dtype, " are not supported");
    std::copy(buf.begin(), buf.begin() + B * K, t.data_ptr<float>());
  }
  return t;
}

using attnlab_simd::exp_fast;

// out[j] = act(gate[j]) * up[j], as torch's silu and gelu (tanh: through exp, within a
// few ulp of torch.tanh).
void gated(const float* gate, const float* up, float* out, int64_t n, int64_t act) {
  switch (act) {
    case kSilu:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = gate[j] / (1.f + exp_fast(-gate[j])) * up[j];
      break;
    case kGeluTanh:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = gate[j];
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);  // sqrt(2/pi)
        const float t = 1.f - 2.f / (exp_fast(2.f * u) + 1.f);             // tanh(u)
        out[j] = 0.5f * v * (1.f + t) * up[j];
      }
      break;
    case kGelu:
      for (int64_t j = 0; j < n; ++j)
        out[j] = 0.5f * gate[j] * (1.f + std::erf(gate[j] * 0.7071067811865476f)) * up[j];
      break;
    default:
      for (int64_t j = 0; j < n; ++j) out[j] = (gate[j] > 0.f ? gate[j] : 0.f) * up[j];
  }
}

// Products whose outputs sit side by side: each writes its n columns of (B, ld) rows.
void run_products(const std::vector<Product>& products, const at::Tensor& in, float* dst,
                  int64_t ld) {
  int64_t col = 0;
  for (const Product& p : products) {
    p.run(in, dst + col, ld);
    col += p.n;
  }
}

// RoPE in place on `vectors` head vectors of width D: x cos + roll(x, D/2) sin (sin's first
// half negated by the caller)
void rotate(float* qk, int64_t vectors, int64_t D, const float* cs, const float* sn) {
  std::vector<float> tmp(D);
  for (int64_t v = 0; v < vectors; ++v) {
    float* hv = qk + v * D;
    for (int64_t d = 0; d < D; ++d) tmp[d] = hv[d] * cs[d] + hv[(d + D / 2) % D] * sn[d];
    std::copy(tmp.begin(), tmp.end(), hv);
  }
}

// n floats into a cache row as it holds them: false where a finite value became infinite
// (a float16 cache and a value beyond its range; the caller refuses the step).
inline bool write_row(const float* src, int64_t n, float* dst) {
  std::copy_n(src, n, dst);
  return true;
}

inline bool write_row(const float* src, int64_t n, c10::Half* dst) {
  bool held = true;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = c10::Half(src[i]);
    held &= (dst[i].x & 0x7C00) != 0x7C00 || !attnlab_simd::finite_bits(src[i]);
  }
  return held;
}

class Step {
 public:
  Step(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t ffn)
      : C_(hidden), H_(heads), G_(kv_heads), D_(head_dim), F_(ffn) {
    TORCH_CHECK(H_ % G_ == 0, "native step: ", H_, " heads in ", G_, " groups");
    TORCH_CHECK(D_ % 2 == 0, "native step: odd head dim ", D_);
  }

  // spec: one layer, its fields read by name (attnlab.models.decode.compiled.NativeLayer):
  // norm1, norm2, attn_post, mlp_post, qk_norm ((weight, eps) or None), dtype, the products
  // qkv, out, gate_up, down (lists of attnlab.quant.NativeProduct), act, scale, window, rope.
  void add_layer(const py::object& spec) {
    Layer l;
    l.norm1 = norm(spec, "norm1", C_);
    l.norm2 = norm(spec, "norm2", C_);
    l.attn_post = norm(spec, "attn_post", C_, true);
    l.mlp_post = norm(spec, "mlp_post", C_, true);
    l.qk_norm = norm(spec, "qk_norm", (H_ + G_) * D_, true);
    l.dtype = spec.attr("dtype").cast<at::ScalarType>();
    l.qkv = products(spec, "qkv", (H_ + 2 * G_) * D_);
    l.out = products(spec, "out", C_);
    l.gate_up = products(spec, "gate_up", 2 * F_);
    l.down = products(spec, "down", C_);
    l.act = spec.attr("act").cast<int64_t>();
    TORCH_CHECK(l.act >= kSilu && l.act <= kRelu, "native step: activation ", l.act);
    l.scale = spec.attr("scale").cast<double>();
    l.window = spec.attr("window").cast<int64_t>();
    l.rope = spec.attr("rope").cast<int64_t>();
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: (B, C) float32 after the embedding; rotations: (cos, sin) at this position per
  // rotary embedding, float32 (D,) each, sin's first half negated; caches: keys and values
  // of every layer, (B, G, max_len, D) float32 or float16 each (a layer's two alike), the
  // new position at `pos` (or, in a
  // sliding-window layer's ring of `window` slots, at `pos % window`).
  at::Tensor run(const at::Tensor& x_in, int64_t pos,
                 const std::vector<std::tuple<at::Tensor, at::Tensor>>& rotations,
                 const std::vector<at::Tensor>& caches) {
    const int64_t L = num_layers();
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == C_ && x_in.scalar_type() == at::kFloat,
                "native step: x must be (B, ", C_, ") float32");
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * L, "native step: ", caches.size(),
                " cache tensors for ", L, " layers");
    const int64_t B = x_in.size(0), D = D_, G = G_;
    for (int64_t i = 0; i < 2 * L; ++i) {
      const at::Tensor& t = caches[i];
      const int64_t window = layers_[i / 2].window;
      TORCH_CHECK(t.dim() == 4 && t.size(0) == B && t.size(1) == G && t.size(3) == D &&
                      (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) &&
                      t.is_contiguous() && (pos < t.size(2) || (window > 0 && t.size(2) == window)),
                  "native step: a cache is not a contiguous (", B, ", ", G, ", >", pos, ", ",
                  D, ") float32 or float16 tensor, nor its layer's ring of ", window, " slots");
      TORCH_CHECK(i % 2 == 0 || t.scalar_type() == caches[i - 1].scalar_type(),
                  "native step: layer ", i / 2, "'s keys are ", caches[i - 1].scalar_type(),
                  " and its values ", t.scalar_type());
    }
    for (const auto& r : rotations) {
      TORCH_CHECK(std::get<0>(r).numel() == D && std::get<1>(r).numel() == D,
                  "native step: rotation tables must have ", D, " values");
    }
    at::Tensor x_out = x_in.contiguous().clone();  // an ordinary tensor, as the caches
    c10::InferenceMode guard;  // the products' outputs: no version counters, no views
    float* x = x_out.data_ptr<float>();
    Rows rows(B, C_, (H_ + G_) * D_, (H_ + 2 * G_) * D_, H_ * D_, F_);
    for (int64_t li = 0; li < L; ++li) {
      const Layer& l = layers_[li];
      attention_block(li, l, x, B, pos, rotations.at(l.rope), caches[2 * li],
                      caches[2 * li + 1], rows);
      mlp_block(l, x, B, rows);
    }
    return x_out;
  }

 private:
  // One call's scratch rows, reused by every layer.
  struct Rows {
    std::vector<float> h, qkv, qk, o, a, gu;
    Rows(int64_t B, int64_t C, int64_t nqk, int64_t nqkv, int64_t nq, int64_t F)
        : h(B * std::max(C, 2 * F)), qkv(B * nqkv), qk(B * nqk), o(B * nq), a(B * C),
          gu(B * 2 * F) {}
  };

  // x += out(attention(norm1(x))): Q/K/V, QK-norm, RoPE, the cache write at `pos`,
  // softmax(q k^T scale) v over the cache, the output product and its sandwich norm.
  // A sliding-window layer's cache may be a ring of `window` slots
  // (attnlab.attention.StaticWindowKVCache): position p in slot p % window, and once it
  // has wrapped every slot is in the window (the keys carry their rotations, so the
  // slots' order does not matter to the softmax).
  void attention_block(int64_t li, const Layer& l, float* x, int64_t B, int64_t pos,
                       const std::tuple<at::Tensor, at::Tensor>& rotation,
                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                       Rows& w) const {
    const int64_t D = D_, H = H_, G = G_, C = C_;
    const int64_t nq = H * D, nqk = (H + G) * D, nqkv = (H + 2 * G) * D;
    rms_rows(x, w.h.data(), B, C, l.norm1, false);
    run_products(l.qkv, as_input(w.h, B, C, l.dtype), w.qkv.data(), nqkv);
    for (int64_t r = 0; r < B; ++r)
      std::copy(w.qkv.begin() + r * nqkv, w.qkv.begin() + r * nqkv + nqk,
                w.qk.begin() + r * nqk);
    if (l.qk_norm.defined()) {
      for (int64_t r = 0; r < B; ++r)
        rms_rows(w.qk.data() + r * nqk, w.qk.data() + r * nqk, H + G, D, l.qk_norm, true);
    }
    rotate(w.qk.data(), B * (H + G), D, std::get<0>(rotation).data_ptr<float>(),
           std::get<1>(rotation).data_ptr<float>());
    const int64_t max_len = key_cache.size(2);
    const bool ring = pos >= max_len;  // run() checked: then max_len is the window
    const int64_t slot = ring ? pos % max_len : pos;
    const int64_t S = ring ? max_len : pos + 1;
    const int64_t s0 = (!ring && l.window > 0 && S > l.window) ? S - l.window : 0;
    // The new keys and values written into the slot (a float16 cache rounds each to
    // nearest even, as PyTorch's conversion does), then attention over the cache.
    auto write_and_attend = [&](auto* kc, auto* vc) {
      bool held = true;
      for (int64_t r = 0; r < B; ++r) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t at_pos = ((r * G + g) * max_len + slot) * D;
          held &= write_row(w.qk.data() + r * nqk + (H + g) * D, D, kc + at_pos);
          held &= write_row(w.qkv.data() + r * nqkv + nqk + g * D, D, vc + at_pos);
        }
      }
      TORCH_CHECK(held, "native step: layer ", li, "'s new key or value is beyond float16's ",
                  "range (65504), which its float16 cache would hold as infinity: set ",
                  "model.kv_cache_dtype = None (float32) for this model");
      attnlab_attend::attend(w.qk.data(), nqk, kc, vc, max_len, B, H, G, D, s0, S,
                             static_cast<float>(l.scale), w.o.data(), nq);
    };
    if (key_cache.scalar_type() == at::kHalf)
      write_and_attend(key_cache.data_ptr<c10::Half>(), value_cache.data_ptr<c10::Half>());
    else
      write_and_attend(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
    run_products(l.out, as_input(w.o, B, nq, l.dtype), w.a.data(), C);
    if (l.attn_post.defined()) rms_rows(w.a.data(), w.a.data(), B, C, l.attn_post, false);
    for (int64_t i = 0; i < B * C; ++i) x[i] += w.a[i];
  }

  // x += down(act(gate(norm2(x))) * up(norm2(x))), then its sandwich norm
  void mlp_block(const Layer& l, float* x, int64_t B, Rows& w) const {
    const int64_t C = C_, F = F_;
    rms_rows(x, w.h.data(), B, C, l.norm2, false);
    run_products(l.gate_up, as_input(w.h, B, C, l.dtype), w.gu.data(), 2 * F);
    for (int64_t r = 0; r < B; ++r) {
      const float* gr = w.gu.data() + r * 2 * F;
      gated(gr, gr + F, w.h.data() + r * F, F, l.act);
    }
    run_products(l.down, as_input(w.h, B, F, l.dtype), w.a.data(), C);
    if (l.mlp_post.defined()) rms_rows(w.a.data(), w.a.data(), B, C, l.mlp_post, false);
    for (int64_t i = 0; i < B * C; ++i) x[i] += w.a[i];
  }

  // spec.<name>: (weight, eps), or None where `optional`
  static Norm norm(const py::object& spec, const char* name, int64_t numel,
                   bool optional = false) {
    Norm n;
    const py::object field = spec.attr(name);
    if (field.is_none()) {
      TORCH_CHECK(optional, "native step: the layer's ", name, " is None");
      return n;
    }
    const auto pair = field.cast<std::tuple<at::Tensor, double>>();
    n.weight = std::get<0>(pair).to(at::kFloat).contiguous();
    n.eps = std::get<1>(pair);
    TORCH_CHECK(n.weight.numel() == numel, "native step: ", name, "'s weight has ",
                n.weight.numel(), " values, ", numel, " expected");
    return n;
  }

  static at::Tensor optional_tensor(const py::object& value) {
    return value.is_none() ? at::Tensor() : value.cast<at::Tensor>();
  }

  // spec.<name>: products whose outputs sit side by side, `width` columns in all; each
  // read by name: kind, a, b (or None), group_size, n, bias (or None)
  static std::vector<Product> products(const py::object& spec, const char* name,
                                       int64_t width) {
    std::vector<Product> found;
    int64_t total = 0;
    for (const py::handle s : spec.attr(name)) {
      const at::Tensor bias = optional_tensor(s.attr("bias"));
      Product p{s.attr("kind").cast<int64_t>(),
                s.attr("a").cast<at::Tensor>(),
                optional_tensor(s.attr("b")),
                s.attr("group_size").cast<int64_t>(),
                s.attr("n").cast<int64_t>(),
                bias.defined() ? bias.to(at::kFloat).contiguous() : bias};
      TORCH_CHECK(p.kind == kInt4 || (p.kind >= kInt8 && p.kind <= kQ4),
                  "native step: product kind ", p.kind);
      total += p.n;
      found.push_back(std::move(p));
    }
    TORCH_CHECK(total == width, "native step: ", name, " products give ", total,
                " columns, ", width, " expected");
    return found;
  }

  int64_t C_, H_, G_, D_, F_;
  std::vector<Layer> layers_;
};

// attend.h's attention alone, for its tests and benchmarks: o (B, H, D) float32 from
// queries (B, H, D) float32 and caches (B, G, max_len, D), both float32 or both float16,
// over the positions [s0, S).
at::Tensor attend(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, int64_t s0, int64_t S, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat,
              "attend: query must be (B, H, D) float32");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const bool half = key_cache.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&key_cache, &value_cache}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(3) == D &&
                    t->scalar_type() == (half ? at::kHalf : at::kFloat) && t->is_contiguous() &&
                    t->sizes() == key_cache.sizes(),
                "attend: the caches must be contiguous (", B, ", G, max_len, ", D,
                ") tensors of one shape, both float32 or both float16");
  }
  const int64_t G = key_cache.size(1), max_len = key_cache.size(2);
  TORCH_CHECK(G > 0 && H % G == 0, "attend: ", H, " heads in ", G, " groups");
  TORCH_CHECK(0 <= s0 && s0 <= S && S <= max_len, "attend: positions [", s0, ", ", S,
              ") of a cache of ", max_len);
  const at::Tensor q = query.contiguous();
  at::Tensor o = at::empty({B, H, D}, q.options());
  auto run = [&](const auto* kc, const auto* vc) {
    attnlab_attend::attend(q.data_ptr<float>(), H * D, kc, vc, max_len, B, H, G, D, s0, S,
                           static_cast<float>(scale), o.data_ptr<float>(), H * D);
  };
  if (half)
    run(key_cache.data_ptr<c10::Half>(), value_cache.data_ptr<c10::Half>());
  else
    run(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  return o;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Step>(m, "Step")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("add_layer", &Step::add_layer, py::arg("spec"))
      .def("num_layers", &Step::num_layers)
      .def("run", &Step::run, py::call_guard<py::gil_scoped_release>());
  py::dict kinds;
  kinds["int4"] = static_cast<int64_t>(kInt4);
  kinds["int8"] = static_cast<int64_t>(kInt8);
  kinds["linear"] = static_cast<int64_t>(kLinear);
  kinds["q8_0"] = static_cast<int64_t>(kQ8);
  kinds["q5_0"] = static_cast<int64_t>(kQ5);
  kinds["q4"] = static_cast<int64_t>(kQ4);
  m.attr("PRODUCT_KINDS") = kinds;
  py::dict acts;
  acts["silu"] = static_cast<int64_t>(kSilu);
  acts["gelu_tanh"] = static_cast<int64_t>(kGeluTanh);
  acts["gelu"] = static_cast<int64_t>(kGelu);
  acts["relu"] = static_cast<int64_t>(kRelu);
  m.attr("ACTIVATIONS") = acts;
  // The kernels' compile-time branch (q4.h, q8_0.h, q5_0.h, attend.h, simd.h), set by
  // -march: what `attnlab info` reports and what the per-branch tests check they built.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
  m.attr("SIMD") = "avx512-bf16";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  m.attr("SIMD") = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  m.attr("SIMD") = "avx2";
#else
  m.attr("SIMD") = "scalar";
#endif
  // Whether q4 and q5_0 quantise rows of x to 16-bit codes and sum integer products (their
  // headers give the error bound; q8_0 always does): q4 wherever there is AVX2, q5_0
  // where there are no bf16 dot products as well (AVX2, and AVX-512 without BF16).
  m.attr("Q4_INTEGER") = static_cast<bool>(ATTNLAB_Q4_INTEGER);
#ifdef ATTNLAB_Q5_INTEGER
  m.attr("Q5_INTEGER") = true;
#else
  m.attr("Q5_INTEGER") = false;
#endif
  m.def("attend", &attend, py::call_guard<py::gil_scoped_release>(),
        "o (B, H, D) = softmax(scale q k^T) v over cache positions [s0, S): query (B, H, D), "
        "caches (B, G, max_len, D), float32 or float16", py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("s0"), py::arg("S"), py::arg("scale"));
  // positions a piece of attend's work covers (its tests derive their bounds from it)
  m.attr("ATTEND_CHUNK") = attnlab_attend::kChunk;
  m.def("q8_0_mm", &attnlab_q8::q8_0_mm, py::call_guard<py::gil_scoped_release>(),
        "y (M, N) = x (M, K) @ W^T for W in Q8_0: int8 codes (N, K), scales (N, K/32)");
  m.def("q5_0_mm", &attnlab_q5::q5_0_mm, py::call_guard<py::gil_scoped_release>(),
        "y (M, N) = x (M, K) @ W^T for W in Q5_0: its blocks as stored, (N, K/32 * 22) uint8");
  m.def("q4_mm", &attnlab_q4::q4_mm, py::call_guard<py::gil_scoped_release>(),
        "y (M, N) = x (M, K) @ W^T for attnlab's int4 layout: codes (N, K/2) uint8, "
        "scale_offset (N, K/32, 2) float32");
  m.def("q8_0_dequant", &attnlab_q8::q8_0_dequant, py::call_guard<py::gil_scoped_release>(),
        "the Q8_0 weight (N, K) in bfloat16 from its codes and scales");
  m.def("q4_blocks_float32", &attnlab_q4::q4_blocks_float32,
        py::call_guard<py::gil_scoped_release>(),
        "a file's Q4_0 (n, 18) or Q4_1 (n, 20) blocks into out (n, 32) float32, as ggml "
        "reads them; returns how many blocks have an inf or NaN scale",
        py::arg("blocks"), py::arg("out"));
  m.def("q8_0_blocks_float32", &attnlab_q8::q8_0_blocks_float32,
        py::call_guard<py::gil_scoped_release>(),
        "a file's Q8_0 blocks (n, 34) uint8 into out (n, 32) float32, each d * q exact; "
        "returns how many blocks have an inf or NaN scale", py::arg("blocks"), py::arg("out"));
  m.def("q5_0_blocks_float32", &attnlab_q5::q5_0_blocks_float32,
        py::call_guard<py::gil_scoped_release>(),
        "a file's Q5_0 blocks (n, 22) uint8 into out (n, 32) float32, each d (q - 16) exact; "
        "returns how many blocks have an inf or NaN scale", py::arg("blocks"), py::arg("out"));
  m.def("q4_k_blocks_float32", &attnlab_kq::q4_k_blocks_float32,
        py::call_guard<py::gil_scoped_release>(),
        "a file's Q4_K super-blocks (n, 144) uint8 into out (n, 256) float32, as ggml reads "
        "them; returns how many have an inf or NaN scale", py::arg("blocks"), py::arg("out"));
  m.def("q6_k_blocks_float32", &attnlab_kq::q6_k_blocks_float32,
        py::call_guard<py::gil_scoped_release>(),
        "a file's Q6_K super-blocks (n, 210) uint8 into out (n, 256) float32, as ggml reads "
        "them; returns how many have an inf or NaN scale", py::arg("blocks"), py::arg("out"));
  m.def("capped_probs", &attnlab_capped::capped_probs_tensor,
        py::call_guard<py::gil_scoped_release>(),
        "soft-capped probabilities in place: scores (..., rows, cols) float32 holding "
        "x = -2 s / cap become exp(-2 cap sigmoid(x)), 0 above a causal tile's diagonal "
        "(column > row % tq); each row's sum is added into sums when given",
        py::arg("scores"), py::arg("sums"), py::arg("cap"), py::arg("tq"), py::arg("causal"));
  m.def("capped_grad_parts", &attnlab_capped::capped_grad_parts_tensor,
        py::call_guard<py::gil_scoped_release>(),
        "a soft-capped tile's backward, first half: scores holding t (as capped_probs reads "
        "them) become p = 2^(K u - l) with u = 1 / (1 + 2^t), K = 2 cap log2 e, l a row's "
        "(lse + cap) log2 e; g gets u (1 - u); a causal tile's hidden keys 0",
        py::arg("scores"), py::arg("l"), py::arg("g"), py::arg("cap"), py::arg("tq"),
        py::arg("causal"));
  m.def("capped_grad_scores", &attnlab_capped::capped_grad_scores_tensor,
        py::call_guard<py::gil_scoped_release>(),
        "ds = p (dp - delta) g in place of p, delta one value a row",
        py::arg("p"), py::arg("dp"), py::arg("delta"), py::arg("g"));
  m.def("string_run", &attnlab_gguf::string_run, py::call_guard<py::gil_scoped_release>(),
        "(end, lengths) of a GGUF run of count strings at pos of buf (1-D uint8); end -1 "
        "where one runs past the end", py::arg("buf"), py::arg("pos"), py::arg("count"));
  m.def("q5_0_dequant", &attnlab_q5::q5_0_dequant, py::call_guard<py::gil_scoped_release>(),
        "the Q5_0 weight (N, K) from its blocks: bfloat16, or exact in float32",
        py::arg("blocks"), py::arg("as_float32") = false);
}
