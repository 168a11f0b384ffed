// llama_layers on the CPU: the decoder layers of a Llama-family model (pre-norm RMSNorm, attention with
// rotary embedding (rotate-half form) over a KV cache, SiLU-gated MLP) for the few rows of a decoding
// forward, in one call, and the same layers with Gemma-3's and Qwen3's extras: RMSNorm of each q and k head
// before the rotary embedding, norms of the attention and MLP outputs before their residual adds, a
// GELU-tanh gate, norms that scale by 1 + w, and two kinds of layer (Gemma-3's sliding-window layers read
// their own rotary tables and mask). Semantics: specops/reference.py.
//
// Why an op: a small model's decoding forward on a CPU is as much framework time as arithmetic. From
// Python a SmolLM2-135M layer is about 25 ATen calls at 4-10 us each (an rms_norm alone decomposes into
// seven), about 3.3 ms of a 9.5 ms int8 forward over 30 layers. Here the products are direct calls of
// skinny_linear / quantized_linear (float32 or low-precision weights), and the norms, rotary embedding,
// cache writes, attention, activation gate and residual adds are plain loops over the few rows.
//
// The caches are written in place: each layer's keys and values come with room for the new rows (their
// last n slots), which the op fills. Appending by a cat per tensor copied every layer's cache on every
// forward, and a library attention (SDPA) cost about 30 us a layer over 150 slots for a few microseconds
// of arithmetic (SmolLM2-135M, int8, AMD EPYC: about 2 ms of an 8.5 ms forward together).
//
// Each norm is x * (1 / sqrt(mean(x^2) + eps)) * (w + offset) with the mean summed in double; rotary
// embedding is x * cos + rotate_half(x) * sin on q and k; attention sums in float32 with exp to about 1 ulp
// (attention_simd.h); results differ from transformers' modules by summation order only (about 1e-6
// relative per layer).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#define SPECOPS_ISA_HEADER "layer_simd.h"
#include "per_isa.h"
#undef SPECOPS_ISA_HEADER

namespace specops {
namespace {

using AttendFn = void (*)(const float*, const float*, int64_t, const float*, int64_t, int64_t, int64_t, float,
                          const float*, float*, float*);

AttendFn attend_row() {
  static const AttendFn selected = [] {
    switch (cpu_isa()) {
#ifdef SPECOPS_X86_DISPATCH
      case Isa::avx512: return &avx512::attend_row;
      case Isa::avx2: return &avx2::attend_row;
#endif
      default: return &base::attend_row;
    }
  }();
  return selected;
}

using GateFn = void (*)(const float*, const float*, int64_t, int, float*);

GateFn gate_row() {
  static const GateFn selected = [] {
    switch (cpu_isa()) {
#ifdef SPECOPS_X86_DISPATCH
      case Isa::avx512: return &avx512::gate_row;
      case Isa::avx2: return &avx2::gate_row;
#endif
      default: return &base::gate_row;
    }
  }();
  return selected;
}

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

constexpr const char* kSlotNames[kSlots] = {"q", "k", "v", "o", "gate", "up", "down"};

// The linear layers of one product (q|k|v, o, gate|up or down): slots first .. first + count - 1 of a
// layer, each (weight, scales, mins, bias); a slot without a weight is absent (its layer is fused into
// an earlier slot's weight). Outputs of the present slots are concatenated along the features. widths:
// each slot's output features; a present weight must give those of its slot and the absent ones after
// it, so that a wrong width is an error rather than a different split of the concatenation.
at::Tensor product(const c10::List<OptTensor>& linears, int64_t base, int64_t first, int64_t count,
                   const at::Tensor& x, std::initializer_list<int64_t> widths) {
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
    int64_t want = widths.begin()[s - first];
    for (int64_t t = s + 1; t < first + count && !present(linears.get(base + t * kPerSlot)); ++t) {
      want += widths.begin()[t - first];
    }
    TORCH_CHECK_VALUE(outs.back().size(1) == want, "llama_layers: layer ", base / kPerLayer, "'s ",
                      kSlotNames[s], " weight (linears[", i, "]) gives ", outs.back().size(1),
                      " features, not ", want);
  }
  TORCH_CHECK(!outs.empty(), "llama_layers: a product with no weight (slot ", first, ")");
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}

// out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * (w + offset) for rows of width d, r < rows, the rows
// `stride` floats apart in x and out (in place allowed: a row's sum is taken before it is written). Gemma's
// norms scale by 1 + w (offset 1); Llama's by w (offset 0, w itself: the bits of a -0 weight stay).
void rms_norm(const float* x, const float* w, float offset, float eps, int64_t rows, int64_t d, int64_t stride,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * stride;
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + static_cast<double>(eps)));
    float* o = out + r * stride;
    if (offset == 0.0f) {
      for (int64_t i = 0; i < d; ++i) o[i] = w[i] * (xr[i] * inv);
    } else {
      for (int64_t i = 0; i < d; ++i) o[i] = (w[i] + offset) * (xr[i] * inv);
    }
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

enum class Activation { silu, gelu_tanh };

// out[r, i] = act(gate) * up for rows [gate | up] of width 2 * inter; silu(g) = g / (1 + exp(-g)),
// gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))), in vectors (layer_simd.h: a scalar
// exp or tanh per element was 12 ms of a 16-row Gemma-3-270M step).
void gate_product(const float* gu, int64_t rows, int64_t inter, Activation act, float* out) {
  const GateFn gate = gate_row();
  for (int64_t r = 0; r < rows; ++r) {
    gate(gu + r * 2 * inter, gu + r * 2 * inter + inter, inter, act == Activation::silu ? 0 : 1, out + r * inter);
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

// A layer's cache as the loops read it: [B, kv_heads, S, D] floats at `data` with these strides.
struct Cache {
  float* data;
  int64_t batch_stride, head_stride, slot_stride;
};

Cache cache_of(const at::Tensor& t, const char* name, int64_t l, int64_t batch, int64_t kv_heads, int64_t slots,
               int64_t dim) {
  check_float(t, name);
  TORCH_CHECK(t.dim() == 4 && t.size(0) == batch && t.size(1) == kv_heads && t.size(2) == slots && t.size(3) == dim,
              "llama_layers: ", name, "[", l, "] must be [B, kv_heads, past + n, D] = [", batch, ", ", kv_heads, ", ",
              slots, ", ", dim, "]");
  TORCH_CHECK(t.stride(3) == 1, "llama_layers: ", name, "[", l, "] must be contiguous along D");
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}

// A mask [B, 1, n, slots] as a score bias per (request, new row, slot): 0 where seen, -inf where not; empty
// for no mask (every slot seen).
std::vector<float> mask_bias(const OptTensor& mask, const char* name, int64_t batch, int64_t n, int64_t slots) {
  std::vector<float> bias;
  if (!present(mask)) return bias;
  const at::Tensor m = mask->contiguous();
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == batch && m.size(1) == 1 &&
                  m.size(2) == n && m.size(3) == slots,
              "llama_layers: ", name, " must be bool [B, 1, n, past + n] = [", batch, ", 1, ", n, ", ", slots, "]");
  const bool* mp = m.data_ptr<bool>();
  bias.resize(static_cast<size_t>(batch * n * slots));
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = mp[i] ? 0.0f : -std::numeric_limits<float>::infinity();
  return bias;
}

// What one kind of layer reads besides its weights: rotary tables [B * n, D] and the mask as a score bias
// (empty: every slot seen). Gemma-3's sliding-window layers are one kind, its global layers another.
struct Kind {
  const float* cos;
  const float* sin;
  std::vector<float> bias;
};

// The shapes every layer shares, and the variant of the layer: Llama's (two norms, SiLU) or with Gemma-3's
// or Qwen3's extras (per-head q and k norms, norms after attention and the MLP too, GELU-tanh, 1 + w norms).
struct Layout {
  int64_t batch, n, rows, dim, slots, past, d, heads, kv_heads, q_width, kv_width;
  float eps, scale, norm_offset;
  int64_t norms_per_layer;  // 2: input and post-attention; 4: input, post-attention, pre- and post-MLP
  bool qk_norms;
  Activation act;
};

// Attention of layer l: the new rows' q, k, v from the normed x (h), rotary embedding (after the q and k
// norms where the layer has them), k and v into the caches' last n slots, attention over the cache;
// returns the attention output projected by o.
at::Tensor attention_block(const Layout& s, int64_t l, const c10::List<OptTensor>& linears, at::TensorList qk_norms,
                           const at::Tensor& h, const Kind& kind, const Cache& kc, const Cache& vc,
                           at::Tensor& attn) {
  const int64_t base = l * kPerLayer;
  at::Tensor qkv = product(linears, base, 0, 3, h, {s.q_width, s.kv_width, s.kv_width});
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == s.q_width + 2 * s.kv_width && qkv.is_contiguous(),
              "llama_layers: layer ", l, "'s q|k|v gives ", qkv.size(1),
              " features, not heads * D + 2 kv_heads * D = ", s.q_width + 2 * s.kv_width);
  const int64_t width = qkv.size(1);
  float* qp = qkv.data_ptr<float>();
  if (s.qk_norms) {  // each head of each row: q heads with q_norm, then kv_heads k heads with k_norm
    for (int64_t r = 0; r < s.rows; ++r) {
      float* row = qp + r * width;
      rms_norm(row, qk_norms[2 * l].data_ptr<float>(), s.norm_offset, s.eps, s.heads, s.dim, s.dim, row);
      rms_norm(row + s.q_width, qk_norms[2 * l + 1].data_ptr<float>(), s.norm_offset, s.eps, s.kv_heads, s.dim,
               s.dim, row + s.q_width);
    }
  }
  rotate(qp, s.rows, width, s.heads + s.kv_heads, s.dim, kind.cos, kind.sin);
  for (int64_t b = 0; b < s.batch; ++b) {  // the new rows' keys and values into the caches' last n slots
    for (int64_t t = 0; t < s.n; ++t) {
      const float* row = qp + (b * s.n + t) * width;
      for (int64_t g = 0; g < s.kv_heads; ++g) {
        const int64_t slot = b * kc.batch_stride + g * kc.head_stride + (s.past + t) * kc.slot_stride;
        std::memcpy(kc.data + slot, row + s.q_width + g * s.dim, static_cast<size_t>(s.dim) * sizeof(float));
        const int64_t vslot = b * vc.batch_stride + g * vc.head_stride + (s.past + t) * vc.slot_stride;
        std::memcpy(vc.data + vslot, row + s.q_width + s.kv_width + g * s.dim,
                    static_cast<size_t>(s.dim) * sizeof(float));
      }
    }
  }
  float* ap = attn.data_ptr<float>();
  const int64_t group = s.heads / s.kv_heads;
  // Threads over (request, head) pairs where there is enough to split: one task per ~128 K multiply-adds
  // (a SmolLM2 layer over 150 slots, 9 heads of about 19 K, splits in two: 8 us against 25 on one thread).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, 2 * s.n * s.slots * s.dim));
  const AttendFn attend = attend_row();
  const float* bias = kind.bias.empty() ? nullptr : kind.bias.data();
  at::parallel_for(0, s.batch * s.heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(s.slots));
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / s.heads, head = pair % s.heads, g = head / group;
      const float* kp = kc.data + b * kc.batch_stride + g * kc.head_stride;
      const float* vp = vc.data + b * vc.batch_stride + g * vc.head_stride;
      for (int64_t t = 0; t < s.n; ++t) {
        const int64_t r = b * s.n + t;
        attend(qp + r * width + head * s.dim, kp, kc.slot_stride, vp, vc.slot_stride, s.slots, s.dim, s.scale,
               bias == nullptr ? nullptr : bias + r * s.slots, scores.data(), ap + r * s.q_width + head * s.dim);
      }
    }
  });
  return product(linears, base, 3, 1, attn, {s.d});
}

// The MLP of layer l on the normed x (h): down(act(gate) * up).
at::Tensor mlp_block(const Layout& s, int64_t l, const c10::List<OptTensor>& linears, const at::Tensor& h) {
  const int64_t base = l * kPerLayer;
  // gate and up give inter features each: the gate weight's rows, half of them when up is fused in.
  const OptTensor gate = linears.get(base + 4 * kPerSlot);
  TORCH_CHECK_VALUE(present(gate) && gate->dim() == 2, "llama_layers: layer ", l, " needs a 2-D gate weight");
  const int64_t gate_rows = present(linears.get(base + 5 * kPerSlot)) ? gate->size(0) : gate->size(0) / 2;
  const at::Tensor gu = product(linears, base, 4, 2, h, {gate_rows, gate_rows});
  TORCH_CHECK(gu.size(1) % 2 == 0 && gu.is_contiguous(), "llama_layers: layer ", l,
              "'s gate|up gives an odd number of features");
  const int64_t inter = gu.size(1) / 2;
  const at::Tensor act = at::empty({s.rows, inter}, h.options());
  gate_product(gu.data_ptr<float>(), s.rows, inter, s.act, act.data_ptr<float>());
  return product(linears, base, 6, 1, act, {s.d});
}

// x += y, or x += norm(y) where the layer norms its sublayers' outputs too (Gemma-3's post-norms).
void residual(const Layout& s, at::Tensor& x, at::Tensor y, const at::Tensor* post_norm) {
  if (post_norm != nullptr) {
    y = y.contiguous();
    rms_norm(y.data_ptr<float>(), post_norm->data_ptr<float>(), s.norm_offset, s.eps, s.rows, s.d, s.d,
             y.data_ptr<float>());
  }
  add_into(x.data_ptr<float>(), y);
}

Activation activation_of(c10::string_view name) {
  if (name == "silu") return Activation::silu;
  TORCH_CHECK_VALUE(name == "gelu_tanh", "llama_layers: activation must be \"silu\" or \"gelu_tanh\", got \"",
                    std::string(name), "\"");
  return Activation::gelu_tanh;
}

at::Tensor llama_layers_cpu(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                            const OptTensor& attn_mask, at::TensorList norms, const c10::List<OptTensor>& linears,
                            at::TensorList keys, at::TensorList values, int64_t heads, int64_t kv_heads, double eps,
                            double scale, const std::optional<at::TensorList>& qk_norm_list, double norm_offset, c10::string_view activation,
                            at::IntArrayRef local_layers, const OptTensor& local_cos, const OptTensor& local_sin,
                            const OptTensor& local_mask) {
  const at::TensorList qk_norms = qk_norm_list.has_value() ? *qk_norm_list : at::TensorList();
  check_float(hidden, "hidden");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes(), "llama_layers: cos and sin must be [B, n, D] alike");
  Layout s{};
  s.batch = cos.size(0), s.n = cos.size(1), s.dim = cos.size(2);
  s.rows = s.batch * s.n;
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == s.rows, "llama_layers: hidden must be [B * n, d] = [", s.rows,
              ", d]");
  TORCH_CHECK(s.dim > 0 && s.dim % 2 == 0, "llama_layers: the head dim D must be even, got ", s.dim);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "llama_layers: heads must be a positive multiple of kv_heads");
  const int64_t layers = static_cast<int64_t>(keys.size());
  const int64_t norm_count = static_cast<int64_t>(norms.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(values.size()) == layers &&
                  (norm_count == 2 * layers || norm_count == 4 * layers) &&
                  static_cast<int64_t>(linears.size()) == kPerLayer * layers,
              "llama_layers: for L >= 1 layers give L keys, L values, 2 L or 4 L norms and ", kPerLayer, " L linears");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "llama_layers: qk_norms must be empty or 2 L weights [D]");
  s.slots = keys[0].dim() == 4 ? keys[0].size(2) : 0;
  TORCH_CHECK(s.slots >= s.n, "llama_layers: keys[0] must hold past + n >= n slots (room for the new rows)");
  s.past = s.slots - s.n;
  s.d = hidden.size(1);
  s.heads = heads, s.kv_heads = kv_heads;
  s.q_width = heads * s.dim, s.kv_width = kv_heads * s.dim;
  s.eps = static_cast<float>(eps), s.scale = static_cast<float>(scale), s.norm_offset = static_cast<float>(norm_offset);
  s.norms_per_layer = norm_count / layers;
  s.qk_norms = !qk_norms.empty();
  s.act = activation_of(activation);
  std::vector<Cache> key_caches, value_caches;
  for (int64_t l = 0; l < layers; ++l) {
    key_caches.push_back(cache_of(keys[l], "keys", l, s.batch, kv_heads, s.slots, s.dim));
    value_caches.push_back(cache_of(values[l], "values", l, s.batch, kv_heads, s.slots, s.dim));
  }
  for (const at::Tensor& w : norms) {
    check_float(w, "a norm weight");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == s.d && w.is_contiguous(), "llama_layers: norm weights must be [d]");
  }
  for (const at::Tensor& w : qk_norms) {
    check_float(w, "a q or k norm weight");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == s.dim && w.is_contiguous(),
                "llama_layers: q and k norm weights must be [D]");
  }
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  std::vector<Kind> kinds;
  kinds.push_back({c.data_ptr<float>(), sn.data_ptr<float>(), mask_bias(attn_mask, "attn_mask", s.batch, s.n, s.slots)});
  std::vector<uint8_t> local(static_cast<size_t>(layers), 0);
  at::Tensor lc, ls;
  if (!local_layers.empty()) {
    TORCH_CHECK(present(local_cos) && present(local_sin), "llama_layers: local_layers needs local_cos and local_sin");
    check_float(*local_cos, "local_cos");
    check_float(*local_sin, "local_sin");
    TORCH_CHECK(local_cos->sizes() == cos.sizes() && local_sin->sizes() == cos.sizes(),
                "llama_layers: local_cos and local_sin must be [B, n, D] like cos");
    lc = local_cos->contiguous(), ls = local_sin->contiguous();
    kinds.push_back({lc.data_ptr<float>(), ls.data_ptr<float>(),
                     mask_bias(local_mask, "local_mask", s.batch, s.n, s.slots)});
    for (const int64_t l : local_layers) {
      TORCH_CHECK(l >= 0 && l < layers, "llama_layers: local_layers holds ", l, ", not a layer index in [0, ", layers,
                  ")");
      local[static_cast<size_t>(l)] = 1;
    }
  }
  at::Tensor x = hidden.contiguous().clone();
  at::Tensor h = at::empty_like(x);
  at::Tensor attn = at::empty({s.rows, s.q_width}, x.options());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* norm = &norms[s.norms_per_layer * l];  // input, post-attention[, pre-MLP, post-MLP]
    const bool sandwich = s.norms_per_layer == 4;
    rms_norm(x.data_ptr<float>(), norm[0].data_ptr<float>(), s.norm_offset, s.eps, s.rows, s.d, s.d,
             h.data_ptr<float>());
    const at::Tensor o = attention_block(s, l, linears, qk_norms, h, kinds[local[static_cast<size_t>(l)]],
                                         key_caches[l], value_caches[l], attn);
    residual(s, x, o, sandwich ? &norm[1] : nullptr);
    rms_norm(x.data_ptr<float>(), norm[sandwich ? 2 : 1].data_ptr<float>(), s.norm_offset, s.eps, s.rows, s.d, s.d,
             h.data_ptr<float>());
    residual(s, x, mlp_block(s, l, linears, h), sandwich ? &norm[3] : nullptr);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace specops
