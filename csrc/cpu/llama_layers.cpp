// llama_layers on the CPU: the decoder layers of a Llama-family model (pre-norm RMSNorm, attention with
// rotary embedding (rotate-half form) over a KV cache, SiLU-gated MLP) for the few rows of a decoding
// forward, in one call. Semantics: specops/reference.py.
//
// Why an op: a small model's decoding forward on a CPU is as much framework time as arithmetic. From
// Python a SmolLM2-135M layer is about 25 ATen calls at 4-10 us each (an rms_norm alone decomposes into
// seven), about 3.3 ms of a 9.5 ms int8 forward over 30 layers. Here the products are direct calls of
// skinny_linear / quantized_linear (float32 or low-precision weights), attention is one
// scaled_dot_product_attention, the cache append is one cat per tensor, and the norms, rotary embedding,
// SiLU gate and residual adds are plain loops over the few rows.
//
// Each norm is x * (1 / sqrt(mean(x^2) + eps)) * w with the mean summed in double; rotary embedding is
// x * cos + rotate_half(x) * sin on q and k; results differ from transformers' modules by summation order
// only (about 1e-6 relative per layer).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace specops {
namespace {

constexpr int64_t kSlots = 7;       // q, k, v, o, gate, up, down
constexpr int64_t kPerSlot = 4;     // weight, scales, mins, bias
constexpr int64_t kPerLayer = kSlots * kPerSlot;

using OptTensor = std::optional<at::Tensor>;

at::Tensor skinny(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("specops::skinny_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op.call(x, w, bias);
}

at::Tensor quantized(const at::Tensor& x, const at::Tensor& w, const OptTensor& scales, const OptTensor& mins,
                     const OptTensor& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("specops::quantized_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                            const OptTensor&)>();
  return op.call(x, w, scales, mins, bias);
}

bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// The linear layers of one product (q|k|v, o, gate|up or down): slots first .. first + count - 1 of a
// layer, each (weight, scales, mins, bias); a slot without a weight is absent (its layer is fused into
// an earlier slot's weight). Outputs of the present slots are concatenated along the features.
at::Tensor product(const c10::List<OptTensor>& linears, int64_t base, int64_t first, int64_t count,
                   const at::Tensor& x) {
  std::vector<at::Tensor> outs;
  for (int64_t s = first; s < first + count; ++s) {
    const int64_t i = base + s * kPerSlot;
    const OptTensor w = linears.get(i);
    if (!present(w)) continue;
    const OptTensor scales = linears.get(i + 1), mins = linears.get(i + 2), bias = linears.get(i + 3);
    if (w->scalar_type() == at::kFloat && !present(scales) && !present(mins)) {
      outs.push_back(skinny(x, *w, bias));
    } else {
      outs.push_back(quantized(x, *w, scales, mins, bias));
    }
  }
  TORCH_CHECK(!outs.empty(), "llama_layers: a product with no weight (slot ", first, ")");
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}

// out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w for rows of width d.
void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t d, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + static_cast<double>(eps)));
    float* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

// In place on heads of width dim in each row of qkv: x * cos + rotate_half(x) * sin, rotate_half(x) =
// [-x[half:], x[:half]]; cos and sin [rows, dim].
void rotate(float* qkv, int64_t rows, int64_t width, int64_t heads, int64_t dim, const float* cos,
            const float* sin) {
  const int64_t half = dim / 2;
  std::vector<float> tmp(dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * dim;
    const float* s = sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = qkv + r * width + h * dim;
      for (int64_t i = 0; i < dim; ++i) tmp[i] = v[i];
      for (int64_t i = 0; i < half; ++i) v[i] = tmp[i] * c[i] - tmp[i + half] * s[i];
      for (int64_t i = half; i < dim; ++i) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
    }
  }
}

void add_into(float* x, const at::Tensor& y) {
  const at::Tensor yc = y.contiguous();
  const float* yp = yc.data_ptr<float>();
  const int64_t n = yc.numel();
  for (int64_t i = 0; i < n; ++i) x[i] += yp[i];
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "llama_layers: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "llama_layers: ", name, " must be on the CPU");
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> llama_layers_cpu(
    const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, const OptTensor& attn_mask,
    at::TensorList norms, const c10::List<OptTensor>& linears, at::TensorList keys, at::TensorList values,
    int64_t heads, int64_t kv_heads, double eps, double scale) {
  check_float(hidden, "hidden");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes(), "llama_layers: cos and sin must be [B, n, D] alike");
  const int64_t batch = cos.size(0), n = cos.size(1), dim = cos.size(2);
  const int64_t rows = batch * n;
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == rows, "llama_layers: hidden must be [B * n, d] = [", rows,
              ", d]");
  TORCH_CHECK(dim > 0 && dim % 2 == 0, "llama_layers: the head dim D must be even, got ", dim);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "llama_layers: heads must be a positive multiple of kv_heads");
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == layers && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(linears.size()) == kPerLayer * layers,
              "llama_layers: for L layers give L keys, L values, 2 L norms and ", kPerLayer, " L linears");
  const int64_t d = hidden.size(1);
  const int64_t q_width = heads * dim, kv_width = kv_heads * dim;
  for (const at::Tensor& w : norms) {
    check_float(w, "a norm weight");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == d && w.is_contiguous(), "llama_layers: norm weights must be [d]");
  }
  at::Tensor x = hidden.contiguous().clone();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor h = at::empty_like(x);
  std::vector<at::Tensor> new_keys, new_values;
  new_keys.reserve(layers);
  new_values.reserve(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t base = l * kPerLayer;
    rms_norm(x.data_ptr<float>(), norms[2 * l].data_ptr<float>(), static_cast<float>(eps), rows, d,
             h.data_ptr<float>());
    at::Tensor qkv = product(linears, base, 0, 3, h);
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == q_width + 2 * kv_width && qkv.is_contiguous(),
                "llama_layers: layer ", l, "'s q|k|v gives ", qkv.size(1),
                " features, not heads * D + 2 kv_heads * D = ", q_width + 2 * kv_width);
    rotate(qkv.data_ptr<float>(), rows, qkv.size(1), heads + kv_heads, dim, c.data_ptr<float>(), s.data_ptr<float>());
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({batch, n, heads, dim}).transpose(1, 2);
    const at::Tensor k = qkv.narrow(1, q_width, kv_width).view({batch, n, kv_heads, dim}).transpose(1, 2);
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({batch, n, kv_heads, dim}).transpose(1, 2);
    at::Tensor all_k = at::cat({keys[l], k}, 2);
    at::Tensor all_v = at::cat({values[l], v}, 2);
    const at::Tensor attn = at::scaled_dot_product_attention(q, all_k, all_v, attn_mask, 0.0, false, scale,
                                                             heads != kv_heads);
    const at::Tensor o = product(linears, base, 3, 1, attn.transpose(1, 2).reshape({rows, q_width}));
    TORCH_CHECK(o.size(1) == d, "llama_layers: layer ", l, "'s output projection gives ", o.size(1),
                " features, not ", d);
    add_into(x.data_ptr<float>(), o);
    rms_norm(x.data_ptr<float>(), norms[2 * l + 1].data_ptr<float>(), static_cast<float>(eps), rows, d,
             h.data_ptr<float>());
    const at::Tensor gu = product(linears, base, 4, 2, h);
    TORCH_CHECK(gu.size(1) % 2 == 0, "llama_layers: layer ", l, "'s gate|up gives an odd number of features");
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor act = at::silu(gu.narrow(1, 0, inter)).mul_(gu.narrow(1, inter, inter));
    const at::Tensor down = product(linears, base, 6, 1, act);
    TORCH_CHECK(down.size(1) == d, "llama_layers: layer ", l, "'s down projection gives ", down.size(1),
                " features, not ", d);
    add_into(x.data_ptr<float>(), down);
    new_keys.push_back(std::move(all_k));
    new_values.push_back(std::move(all_v));
  }
  return {x, new_keys, new_values};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace specops
