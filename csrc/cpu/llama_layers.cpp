// llama_layers on the CPU: the decoder layers of a Llama-family model (pre-norm RMSNorm, attention with
// rotary embedding (rotate-half form) over a KV cache, SiLU-gated MLP) for the few rows of a decoding
// forward, in one call. Semantics: specops/reference.py.
//
// Why an op: a small model's decoding forward on a CPU is as much framework time as arithmetic. From
// Python a SmolLM2-135M layer is about 25 ATen calls at 4-10 us each (an rms_norm alone decomposes into
// seven), about 3.3 ms of a 9.5 ms int8 forward over 30 layers. Here the products are direct calls of
// skinny_linear / quantized_linear (float32 or low-precision weights), and the norms, rotary embedding,
// cache writes, attention, SiLU gate and residual adds are plain loops over the few rows.
//
// The caches are written in place: each layer's keys and values come with room for the new rows (their
// last n slots), which the op fills. Appending by a cat per tensor copied every layer's cache on every
// forward, and a library attention (SDPA) cost about 30 us a layer over 150 slots for a few microseconds
// of arithmetic (SmolLM2-135M, int8, AMD EPYC: about 2 ms of an 8.5 ms forward together).
//
// Each norm is x * (1 / sqrt(mean(x^2) + eps)) * w with the mean summed in double; rotary embedding is
// x * cos + rotate_half(x) * sin on q and k; attention sums in float32 with exp to about 1 ulp
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
#include <vector>

#define SPECOPS_ISA_HEADER "attention_simd.h"
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

// out[r, i] = silu(gate) * up for rows [gate | up] of width 2 * inter; silu(g) = g / (1 + exp(-g)).
void silu_gate(const float* gu, int64_t rows, int64_t inter, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
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

at::Tensor llama_layers_cpu(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                            const OptTensor& attn_mask, at::TensorList norms, const c10::List<OptTensor>& linears,
                            at::TensorList keys, at::TensorList values, int64_t heads, int64_t kv_heads, double eps,
                            double scale) {
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
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(values.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(linears.size()) == kPerLayer * layers,
              "llama_layers: for L >= 1 layers give L keys, L values, 2 L norms and ", kPerLayer, " L linears");
  const int64_t slots = keys[0].dim() == 4 ? keys[0].size(2) : 0;
  TORCH_CHECK(slots >= n, "llama_layers: keys[0] must hold past + n >= n slots (room for the new rows)");
  const int64_t past = slots - n;
  std::vector<Cache> key_caches, value_caches;
  for (int64_t l = 0; l < layers; ++l) {
    key_caches.push_back(cache_of(keys[l], "keys", l, batch, kv_heads, slots, dim));
    value_caches.push_back(cache_of(values[l], "values", l, batch, kv_heads, slots, dim));
  }
  const int64_t d = hidden.size(1);
  const int64_t q_width = heads * dim, kv_width = kv_heads * dim;
  for (const at::Tensor& w : norms) {
    check_float(w, "a norm weight");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == d && w.is_contiguous(), "llama_layers: norm weights must be [d]");
  }
  // The mask as a score bias per (request, new row, slot): 0 where seen, -inf where not.
  std::vector<float> bias;
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor m = attn_mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == batch && m.size(1) == 1 &&
                    m.size(2) == n && m.size(3) == slots,
                "llama_layers: attn_mask must be bool [B, 1, n, past + n] = [", batch, ", 1, ", n, ", ", slots, "]");
    const bool* mp = m.data_ptr<bool>();
    bias.resize(static_cast<size_t>(rows * slots));
    for (int64_t i = 0; i < rows * slots; ++i) bias[i] = mp[i] ? 0.0f : -std::numeric_limits<float>::infinity();
  }
  at::Tensor x = hidden.contiguous().clone();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor h = at::empty_like(x);
  at::Tensor attn = at::empty({rows, q_width}, x.options());
  const int64_t group = heads / kv_heads;
  // Threads over (request, head) pairs where there is enough to split: one task per ~128 K multiply-adds
  // (a SmolLM2 layer over 150 slots, 9 heads of about 19 K, splits in two: 8 us against 25 on one thread).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, 2 * n * slots * dim));
  const AttendFn attend = attend_row();
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t base = l * kPerLayer;
    rms_norm(x.data_ptr<float>(), norms[2 * l].data_ptr<float>(), static_cast<float>(eps), rows, d,
             h.data_ptr<float>());
    at::Tensor qkv = product(linears, base, 0, 3, h, {q_width, kv_width, kv_width});
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == q_width + 2 * kv_width && qkv.is_contiguous(),
                "llama_layers: layer ", l, "'s q|k|v gives ", qkv.size(1),
                " features, not heads * D + 2 kv_heads * D = ", q_width + 2 * kv_width);
    const int64_t width = qkv.size(1);
    float* qp = qkv.data_ptr<float>();
    rotate(qp, rows, width, heads + kv_heads, dim, c.data_ptr<float>(), s.data_ptr<float>());
    const Cache& kc = key_caches[l];
    const Cache& vc = value_caches[l];
    for (int64_t b = 0; b < batch; ++b) {  // the new rows' keys and values into the caches' last n slots
      for (int64_t t = 0; t < n; ++t) {
        const float* row = qp + (b * n + t) * width;
        for (int64_t g = 0; g < kv_heads; ++g) {
          const int64_t slot = b * kc.batch_stride + g * kc.head_stride + (past + t) * kc.slot_stride;
          std::memcpy(kc.data + slot, row + q_width + g * dim, static_cast<size_t>(dim) * sizeof(float));
          const int64_t vslot = b * vc.batch_stride + g * vc.head_stride + (past + t) * vc.slot_stride;
          std::memcpy(vc.data + vslot, row + q_width + kv_width + g * dim, static_cast<size_t>(dim) * sizeof(float));
        }
      }
    }
    float* ap = attn.data_ptr<float>();
    const float softmax_scale = static_cast<float>(scale);
    at::parallel_for(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(static_cast<size_t>(slots));
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t b = pair / heads, head = pair % heads, g = head / group;
        const float* kp = kc.data + b * kc.batch_stride + g * kc.head_stride;
        const float* vp = vc.data + b * vc.batch_stride + g * vc.head_stride;
        for (int64_t t = 0; t < n; ++t) {
          const int64_t r = b * n + t;
          attend(qp + r * width + head * dim, kp, kc.slot_stride, vp, vc.slot_stride, slots, dim, softmax_scale,
                 bias.empty() ? nullptr : bias.data() + r * slots, scores.data(), ap + r * q_width + head * dim);
        }
      }
    });
    const at::Tensor o = product(linears, base, 3, 1, attn, {d});
    add_into(x.data_ptr<float>(), o);
    rms_norm(x.data_ptr<float>(), norms[2 * l + 1].data_ptr<float>(), static_cast<float>(eps), rows, d,
             h.data_ptr<float>());
    // gate and up give inter features each: the gate weight's rows, half of them when up is fused in.
    const OptTensor gate = linears.get(base + 4 * kPerSlot);
    TORCH_CHECK_VALUE(present(gate) && gate->dim() == 2, "llama_layers: layer ", l,
                      " needs a 2-D gate weight");
    const int64_t gate_rows = present(linears.get(base + 5 * kPerSlot)) ? gate->size(0) : gate->size(0) / 2;
    const at::Tensor gu = product(linears, base, 4, 2, h, {gate_rows, gate_rows});
    TORCH_CHECK(gu.size(1) % 2 == 0 && gu.is_contiguous(), "llama_layers: layer ", l,
                "'s gate|up gives an odd number of features");
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor act = at::empty({rows, inter}, x.options());
    silu_gate(gu.data_ptr<float>(), rows, inter, act.data_ptr<float>());
    const at::Tensor down = product(linears, base, 6, 1, act, {d});
    add_into(x.data_ptr<float>(), down);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace specops
