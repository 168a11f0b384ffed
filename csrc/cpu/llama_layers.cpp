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
// skinny_linear's products (float32: q|k|v in one call and one parallel region, gate|up in another, each
// into a buffer of the call; skinny_linear.h) or quantized_linear (low-precision weights), and the norms,
// rotary embedding, cache writes, attention, activation gate and residual adds are plain loops over the few
// rows. Per product and layer a tensor of outputs, a cat of q|k|v and of gate|up and a parallel region for
// each weight cost Gemma-3-270M's layers 0.1-0.4 ms of the op's 15.5 ms for one token and about 1 ms of
// its 23 ms for 8 (four alternating runs each way, 2-vCPU Xeon, 2026-12-05).
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
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define SPECOPS_ISA_HEADER "layer_simd.h"
#include "per_isa.h"
#undef SPECOPS_ISA_HEADER

#include "skinny_linear.h"

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

// `buffer`, [rows, width] floats: the products' outputs and the MLP's gate take their room from buffers
// allocated once per call (again only where a layer's widths differ), not one tensor per product and layer.
const at::Tensor& room(at::Tensor& buffer, int64_t rows, int64_t width, const at::TensorOptions& options) {
  if (!buffer.defined() || buffer.size(0) != rows || buffer.size(1) != width) {
    buffer = at::empty({rows, width}, options);
  }
  return buffer;
}

// The linear layers of one product (q|k|v, o, gate|up or down): slots first .. first + count - 1 of a
// layer, each (weight, scales, mins, bias); a slot without a weight is absent (its layer is fused into
// an earlier slot's weight). Outputs of the present slots are concatenated along the features. widths:
// each slot's output features; a present weight must give those of its slot and the absent ones after
// it, so that a wrong width is an error rather than a different split of the concatenation. Where every
// present weight is float32 the product is one call of skinny_linear's products, straight into `buffer`
// with its bias (skinny_linear.h: the bits skinny_linear gives each weight alone); otherwise one
// quantized_linear call per present weight, concatenated.
at::Tensor product(const c10::List<OptTensor>& linears, int64_t base, int64_t first, int64_t count,
                   const at::Tensor& x, std::initializer_list<int64_t> widths, at::Tensor& buffer) {
  struct Slot {
    int64_t slot, index, width;
  };
  std::vector<Slot> slots;
  bool dense = true;  // every present weight float32, without scales or mins
  int64_t total = 0;
  for (int64_t s = first; s < first + count; ++s) {
    const int64_t i = base + s * kPerSlot;
    if (!present(linears.get(i))) continue;
    int64_t want = widths.begin()[s - first];
    for (int64_t t = s + 1; t < first + count && !present(linears.get(base + t * kPerSlot)); ++t) {
      want += widths.begin()[t - first];
    }
    dense = dense && linears.get(i)->scalar_type() == at::kFloat && !present(linears.get(i + 1)) &&
            !present(linears.get(i + 2));
    slots.push_back({s, i, want});
    total += want;
  }
  TORCH_CHECK(!slots.empty(), "llama_layers: a product with no weight (slot ", first, ")");
  const auto check_width = [&](const Slot& slot, int64_t got) {
    TORCH_CHECK_VALUE(got == slot.width, "llama_layers: layer ", base / kPerLayer, "'s ", kSlotNames[slot.slot],
                      " weight (linears[", slot.index, "]) gives ", got, " features, not ", slot.width);
  };
  const int64_t rows = x.size(0);
  if (!dense) {
    std::vector<at::Tensor> outs;
    for (const Slot& slot : slots) {
      outs.push_back(quantized(x, *linears.get(slot.index), linears.get(slot.index + 1), linears.get(slot.index + 2),
                               linears.get(slot.index + 3)));
      check_width(slot, outs.back().size(1));
    }
    return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  }
  std::vector<at::Tensor> held;  // the weights and biases as dense tensors, alive through the products
  held.reserve(2 * slots.size());  // no reallocation: `w` below refers into it
  std::vector<SkinnyWeight> weights;
  for (const Slot& slot : slots) {
    const at::Tensor& w = held.emplace_back(linears.get(slot.index)->contiguous());
    check_width(slot, w.size(0));
    TORCH_CHECK_VALUE(w.size(1) == x.size(1), "llama_layers: layer ", base / kPerLayer, "'s ", kSlotNames[slot.slot],
                      " weight (linears[", slot.index, "]) takes ", w.size(1), " inputs, not ", x.size(1));
    const OptTensor bias = linears.get(slot.index + 3);
    const float* bp = present(bias) ? held.emplace_back(bias->contiguous()).data_ptr<float>() : nullptr;
    weights.push_back({w.data_ptr<float>(), slot.width, bp});
  }
  const at::Tensor out = room(buffer, rows, total, x.options());
  const at::Tensor xc = x.contiguous();
  skinny_products(xc.data_ptr<float>(), rows, x.size(1), weights.data(), static_cast<int64_t>(weights.size()),
                  out.data_ptr<float>(), total);
  return out;
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

// A layer's cache as the loops read it: [B, kv_heads, S, D] floats at `data` with these strides.
struct Cache {
  float* data;
  int64_t batch_stride, head_stride, slot_stride;
};

Cache cache_of(const at::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }

// A mask [B, 1, n, slots] as a score bias per (request, new row, slot): 0 where seen, -inf where not; empty
// for no mask (every slot seen).
std::vector<float> mask_bias(const OptTensor& mask, int64_t batch, int64_t n, int64_t slots) {
  std::vector<float> bias;
  if (!present(mask)) return bias;
  const at::Tensor m = mask->contiguous();
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

// Where a call's products and the MLP's gate write, reused by every layer (room() above).
struct Buffers {
  at::Tensor qkv, o, gate_up, act, down;
};

// Attention of layer l: the new rows' q, k, v from the normed x (h), rotary embedding (after the q and k
// norms where the layer has them), k and v into the caches' last n slots, attention over the cache;
// returns the attention output projected by o.
at::Tensor attention_block(const Layout& s, int64_t l, const c10::List<OptTensor>& linears, at::TensorList qk_norms,
                           const at::Tensor& h, const Kind& kind, const Cache& kc, const Cache& vc,
                           at::Tensor& attn, Buffers& buffers) {
  const int64_t base = l * kPerLayer;
  at::Tensor qkv = product(linears, base, 0, 3, h, {s.q_width, s.kv_width, s.kv_width}, buffers.qkv);
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
  return product(linears, base, 3, 1, attn, {s.d}, buffers.o);
}

// The MLP of layer l on the normed x (h): down(act(gate) * up).
at::Tensor mlp_block(const Layout& s, int64_t l, const c10::List<OptTensor>& linears, const at::Tensor& h,
                     Buffers& buffers) {
  const int64_t base = l * kPerLayer;
  // gate and up give inter features each: the gate weight's rows, half of them when up is fused in.
  const OptTensor gate = linears.get(base + 4 * kPerSlot);
  const int64_t gate_rows = present(linears.get(base + 5 * kPerSlot)) ? gate->size(0) : gate->size(0) / 2;
  const at::Tensor gu = product(linears, base, 4, 2, h, {gate_rows, gate_rows}, buffers.gate_up);
  TORCH_CHECK(gu.size(1) % 2 == 0 && gu.is_contiguous(), "llama_layers: layer ", l,
              "'s gate|up gives an odd number of features");
  const int64_t inter = gu.size(1) / 2;
  const at::Tensor act = room(buffers.act, s.rows, inter, h.options());
  gate_product(gu.data_ptr<float>(), s.rows, inter, s.act, act.data_ptr<float>());
  return product(linears, base, 6, 1, act, {s.d}, buffers.down);
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

Activation activation_of(c10::string_view name) { return name == "silu" ? Activation::silu : Activation::gelu_tanh; }

// ---- The arguments' checks: the op's one checker (its Python wrapper only shapes arguments). All are made
// before any work: ValueError naming the argument and the shape or value it needs, TypeError for a dtype. ----

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

void check_cpu_float(const at::Tensor& t, const std::string& name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "llama_layers runs on the CPU; ", name, " is on ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "llama_layers: ", name, " must be float32, got ", t.scalar_type());
}

// A quantized_linear weight of a layer (the format its dtype names) with its scales and mins, for inputs of
// width k (`k_rule` says where k comes from); messages start with `label`.
void check_quantized_weight(const std::string& label, const at::Tensor& weight, const OptTensor& scales,
                            const OptTensor& mins, int64_t k, const std::string& k_rule) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kChar || dtype == at::kByte, "llama_layers: ", label,
                   ": weight must be bfloat16, int8 or uint8 (packed int4), got ", dtype);
  const char* fmt = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kChar ? "int8" : "int4";
  const char* article = dtype == at::kBFloat16 ? "a" : "an";
  const bool int4 = dtype == at::kByte;
  const int64_t n = weight.size(0);
  TORCH_CHECK_VALUE(weight.size(1) == (int4 ? k / 2 : k) && (!int4 || k % 32 == 0), "llama_layers: ", label, ": ",
                    article, " ", fmt, " weight must be ", int4 ? "[N, K / 2] with K a multiple of 32" : "[N, K]",
                    ", K = ", k, " (", k_rule, "); got ", weight.sizes());
  const bool needs_scales = dtype != at::kBFloat16, needs_mins = int4;
  for (const auto& [name, value, needed] : {std::tuple<const char*, const OptTensor&, bool>{"scales", scales,
                                                                                          needs_scales},
                                            {"mins", mins, needs_mins}}) {
    if (!needed) {
      TORCH_CHECK_VALUE(!present(value), "llama_layers: ", label, ": ", article, " ", fmt, " weight takes no ", name);
      continue;
    }
    TORCH_CHECK_VALUE(present(value) && value->dim() == 2 && value->size(0) == n, "llama_layers: ", label, ": ", name,
                      " must be [N, G] = [", n, ", G] for ", article, " ", fmt, " weight, got ",
                      present(value) ? shape_of(*value) : std::string("None"));
    TORCH_CHECK_TYPE(value->scalar_type() == at::kFloat, "llama_layers: ", label, ": ", name,
                     " must be float32, got ", value->scalar_type());
    TORCH_CHECK_VALUE(value->device().is_cpu(), "llama_layers runs on the CPU; ", label, "'s ", name, " is on ",
                      value->device());
  }
  if (needs_scales) {
    const int64_t groups = scales->size(1);
    TORCH_CHECK_VALUE(groups >= 1 && k % groups == 0 && (groups == 1 || (k / groups) % 32 == 0), "llama_layers: ",
                      label, ": scales [N, G] must split K = ", k,
                      " into G groups of a multiple of 32 weights (or G = 1), got G = ", groups);
    TORCH_CHECK_VALUE(!needs_mins || mins->sizes() == scales->sizes(), "llama_layers: ", label,
                      ": mins must have the shape of scales ", scales->sizes(), ", got ", mins->sizes());
  }
}

// linears[index .. index + 3]: the weight, scales, mins and bias giving the outputs of `count` slots from
// `first` (concatenated: the slots after the first are fused into its weight and hold nothing), n rows of
// inputs of width k.
void check_weight(const c10::List<OptTensor>& linears, int64_t layer, int64_t first, int64_t count, int64_t n,
                  const std::string& n_rule, int64_t k, const std::string& k_rule) {
  const int64_t index = layer * kPerLayer + first * kPerSlot;
  std::string names = kSlotNames[first];
  for (int64_t s = first + 1; s < first + count; ++s) names += std::string("|") + kSlotNames[s];
  const std::string label = "linears[" + std::to_string(index) + "] (layer " + std::to_string(layer) + "'s " +
                            names + " weight)";
  for (int64_t extra = index + kPerSlot; extra < index + kPerSlot * count; ++extra) {
    TORCH_CHECK_VALUE(!present(linears.get(extra)), "llama_layers: linears[", extra,
                      "] must be None: its slot has no weight (fused into ", label, ")");
  }
  const OptTensor weight = linears.get(index), scales = linears.get(index + 1), mins = linears.get(index + 2),
                  bias = linears.get(index + 3);
  TORCH_CHECK_VALUE(present(weight) && weight->dim() == 2, "llama_layers: ", label, " must be a 2-D tensor");
  TORCH_CHECK_VALUE(weight->device().is_cpu(), "llama_layers runs on the CPU; ", label, " is on ", weight->device());
  const bool packed = weight->scalar_type() == at::kByte;  // int4, two weights a byte
  TORCH_CHECK_VALUE(weight->size(0) == n && weight->size(1) == (packed ? k / 2 : k), "llama_layers: ", label,
                    " must be [", n_rule, ", ", k_rule, packed ? " / 2" : "", "] = [", n, ", ", packed ? k / 2 : k,
                    "], got ", weight->sizes());
  if (weight->scalar_type() == at::kFloat) {
    TORCH_CHECK_VALUE(!present(scales) && !present(mins), "llama_layers: ", label,
                      " is float32 and takes no scales or mins");
  } else {
    check_quantized_weight(label, *weight, scales, mins, k, k_rule);
  }
  TORCH_CHECK_VALUE(!present(bias) || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat &&
                                       bias->device().is_cpu()),
                    "llama_layers: the bias of ", label, " must be float32 [", n_rule, "] = [", n,
                    "] on the CPU, got ", present(bias) ? shape_of(*bias) : std::string());
}

// Each present weight of layer l has the shape its slot (and the absent slots fused into it) needs: q
// [heads * D, d], k and v [kv_heads * D, d], o [d, heads * D], gate and up [inter, d] alike (gate|up fused:
// [2 inter, d]), down [d, inter]. Only totals would reach the products, which would split a wrong-width q|k
// or gate|up elsewhere.
void check_layer_weights(const c10::List<OptTensor>& linears, int64_t l, int64_t d, int64_t heads, int64_t kv_heads,
                         int64_t dim) {
  const int64_t base = l * kPerLayer;
  for (const int64_t slot : {0, 3, 4, 6}) {
    TORCH_CHECK_VALUE(present(linears.get(base + slot * kPerSlot)), "llama_layers: layer ", l,
                      " needs q, o, gate and down weights");
  }
  const OptTensor gate = linears.get(base + 4 * kPerSlot);
  TORCH_CHECK_VALUE(gate->dim() == 2, "llama_layers: linears[", base + 4 * kPerSlot, "] (layer ", l,
                    "'s gate weight) must be a 2-D tensor");
  const bool fused_up = !present(linears.get(base + 5 * kPerSlot));
  TORCH_CHECK_VALUE(!fused_up || gate->size(0) % 2 == 0, "llama_layers: linears[", base + 4 * kPerSlot, "] (layer ",
                    l, "'s gate|up weight) must be [2 inter, d] with an even 2 inter, got ", gate->sizes());
  const int64_t inter = fused_up ? gate->size(0) / 2 : gate->size(0);
  // Per slot: output rows and their rule, input width and its rule.
  const int64_t rows[kSlots] = {heads * dim, kv_heads * dim, kv_heads * dim, d, inter, inter, d};
  const char* row_rules[kSlots] = {"heads * D", "kv_heads * D", "kv_heads * D", "d", "inter",
                                   "inter (the gate weight's)", "d"};
  const int64_t inputs[kSlots] = {d, d, d, heads * dim, d, d, inter};
  const char* input_rules[kSlots] = {"d", "d", "d", "heads * D", "d", "d", "inter"};
  // The products: slots multiplied by one input, a slot without a weight fused into the one before it.
  for (const auto& [first, count] : {std::pair<int64_t, int64_t>{0, 3}, {3, 1}, {4, 2}, {6, 1}}) {
    int64_t s = first;
    while (s < first + count) {
      int64_t fused = 1;
      while (s + fused < first + count && !present(linears.get(base + (s + fused) * kPerSlot))) ++fused;
      int64_t n = 0;
      std::string n_rule;
      for (int64_t t = s; t < s + fused; ++t) {
        n += rows[t];
        n_rule += (t > s ? " + " : "") + std::string(row_rules[t]);
      }
      check_weight(linears, l, s, fused, n, n_rule, inputs[s], input_rules[s]);
      s += fused;
    }
  }
}

void check_arguments(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, const OptTensor& attn_mask,
                     at::TensorList norms, const c10::List<OptTensor>& linears, at::TensorList keys,
                     at::TensorList values, int64_t heads, int64_t kv_heads, double eps, double scale,
                     at::TensorList qk_norms, bool has_qk_norms, double norm_offset, c10::string_view activation,
                     at::IntArrayRef local_layers, const OptTensor& local_cos, const OptTensor& local_sin,
                     const OptTensor& local_mask) {
  TORCH_CHECK_VALUE(cos.dim() == 3 && sin.sizes() == cos.sizes(),
                    "llama_layers: cos and sin must be tensors [B, n, D] of one shape");
  const int64_t batch = cos.size(0), n = cos.size(1), dim = cos.size(2);
  TORCH_CHECK_VALUE(dim % 2 == 0, "llama_layers: the head dim D must be even, got ", dim);
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(0) == batch * n, "llama_layers: hidden must be [B * n, d] = [",
                    batch * n, ", d]");
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"heads", heads}, {"kv_heads", kv_heads}}) {
    TORCH_CHECK_VALUE(value >= 1 && value < (int64_t{1} << 31), "llama_layers: ", name,
                      " must be an int >= 1 and < 2**31, got ", value);
  }
  TORCH_CHECK_VALUE(heads % kv_heads == 0, "llama_layers: heads (", heads,
                    ") must be a positive multiple of kv_heads (", kv_heads, ")");
  const int64_t layers = static_cast<int64_t>(keys.size());
  const int64_t norm_count = static_cast<int64_t>(norms.size());
  TORCH_CHECK_VALUE(layers >= 1 && static_cast<int64_t>(values.size()) == layers &&
                        (norm_count == 2 * layers || norm_count == 4 * layers) &&
                        static_cast<int64_t>(linears.size()) == kPerLayer * layers,
                    "llama_layers: for L >= 1 layers give L keys, L values, 2 L or 4 L norms and ", kPerLayer,
                    " L linears; got ", layers, ", ", values.size(), ", ", norm_count, " and ", linears.size());
  const int64_t slots = keys[0].dim() == 4 ? keys[0].size(2) : -1;
  TORCH_CHECK_VALUE(slots >= n, "llama_layers: keys[0] must be [B, kv_heads, past + n, D] with room for the n = ", n,
                    " new rows");
  for (int64_t l = 0; l < layers; ++l) {
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"keys", keys[l]}, {"values", values[l]}}) {
      TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef({batch, kv_heads, slots, dim}), "llama_layers: ", name, "[", l,
                        "] must be [B, kv_heads, past + n, D] = [", batch, ", ", kv_heads, ", ", slots, ", ", dim,
                        "] like keys[0], got ", t.sizes());
      TORCH_CHECK_VALUE(t.stride(3) == 1, "llama_layers: ", name, "[", l, "] must be contiguous along D");
    }
  }
  check_cpu_float(hidden, "hidden");
  check_cpu_float(cos, "cos");
  check_cpu_float(sin, "sin");
  for (const at::Tensor& w : norms) check_cpu_float(w, "a norm");
  for (int64_t l = 0; l < layers; ++l) {
    check_cpu_float(keys[l], "keys[" + std::to_string(l) + "]");
    check_cpu_float(values[l], "values[" + std::to_string(l) + "]");
  }
  const int64_t d = hidden.size(1);
  for (const at::Tensor& w : norms) {
    TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == d, "llama_layers: norm weights must be [d] = [", d, "]");
  }
  for (const auto& [name, mask] : {std::pair<const char*, const OptTensor&>{"attn_mask", attn_mask},
                                   {"local_mask", local_mask}}) {
    TORCH_CHECK_VALUE(!present(mask) || (mask->scalar_type() == at::kBool &&
                                         mask->sizes() == at::IntArrayRef({batch, 1, n, slots})),
                      "llama_layers: ", name, " must be bool [B, 1, n, past + n] = [", batch, ", 1, ", n, ", ", slots,
                      "] or None");
  }
  if (has_qk_norms) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(qk_norms.size()) == 2 * layers,
                      "llama_layers: qk_norms must be None or 2 L = ", 2 * layers, " weights [D], got ",
                      qk_norms.size());
    for (const at::Tensor& w : qk_norms) {
      TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == dim && w.scalar_type() == at::kFloat && w.device().is_cpu(),
                        "llama_layers: q and k norm weights must be float32 [D] = [", dim, "] on the CPU");
    }
  }
  TORCH_CHECK_VALUE(activation == "silu" || activation == "gelu_tanh",
                    "llama_layers: activation must be 'silu' or 'gelu_tanh', got '", std::string(activation), "'");
  for (const int64_t l : local_layers) {
    TORCH_CHECK_VALUE(l >= 0 && l < layers, "llama_layers: a local_layers entry must be a layer index in [0, ", layers,
                      "), got ", l);
  }
  if (!local_layers.empty()) {
    for (const auto& [name, t] : {std::pair<const char*, const OptTensor&>{"local_cos", local_cos},
                                  {"local_sin", local_sin}}) {
      TORCH_CHECK_VALUE(present(t) && t->sizes() == cos.sizes() && t->scalar_type() == at::kFloat &&
                            t->device().is_cpu(),
                        "llama_layers: local_layers needs ", name, " float32 [B, n, D] = ", cos.sizes(), " on the CPU");
    }
  }
  for (const auto& [name, number] : {std::pair<const char*, double>{"eps", eps}, {"scale", scale},
                                     {"norm_offset", norm_offset}}) {
    TORCH_CHECK_VALUE(std::isfinite(number), "llama_layers: ", name, " must be a finite number, got ", number);
  }
  for (int64_t l = 0; l < layers; ++l) check_layer_weights(linears, l, d, heads, kv_heads, dim);
}

at::Tensor llama_layers_cpu(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                            const OptTensor& attn_mask, at::TensorList norms, const c10::List<OptTensor>& linears,
                            at::TensorList keys, at::TensorList values, int64_t heads, int64_t kv_heads, double eps,
                            double scale, const std::optional<at::TensorList>& qk_norm_list, double norm_offset, c10::string_view activation,
                            at::IntArrayRef local_layers, const OptTensor& local_cos, const OptTensor& local_sin,
                            const OptTensor& local_mask) {
  const at::TensorList qk_norms = qk_norm_list.has_value() ? *qk_norm_list : at::TensorList();
  check_arguments(hidden, cos, sin, attn_mask, norms, linears, keys, values, heads, kv_heads, eps, scale, qk_norms,
                  qk_norm_list.has_value(), norm_offset, activation, local_layers, local_cos, local_sin, local_mask);
  Layout s{};
  s.batch = cos.size(0), s.n = cos.size(1), s.dim = cos.size(2);
  s.rows = s.batch * s.n;
  const int64_t layers = static_cast<int64_t>(keys.size());
  s.slots = keys[0].size(2);
  s.past = s.slots - s.n;
  s.d = hidden.size(1);
  s.heads = heads, s.kv_heads = kv_heads;
  s.q_width = heads * s.dim, s.kv_width = kv_heads * s.dim;
  s.eps = static_cast<float>(eps), s.scale = static_cast<float>(scale), s.norm_offset = static_cast<float>(norm_offset);
  s.norms_per_layer = static_cast<int64_t>(norms.size()) / layers;
  s.qk_norms = !qk_norms.empty();
  s.act = activation_of(activation);
  std::vector<Cache> key_caches, value_caches;
  for (int64_t l = 0; l < layers; ++l) {
    key_caches.push_back(cache_of(keys[l]));
    value_caches.push_back(cache_of(values[l]));
  }
  // The norm weights as the loops read them: dense.
  std::vector<at::Tensor> dense_norms, dense_qk_norms;
  for (const at::Tensor& w : norms) dense_norms.push_back(w.contiguous());
  for (const at::Tensor& w : qk_norms) dense_qk_norms.push_back(w.contiguous());
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  std::vector<Kind> kinds;
  kinds.push_back({c.data_ptr<float>(), sn.data_ptr<float>(), mask_bias(attn_mask, s.batch, s.n, s.slots)});
  std::vector<uint8_t> local(static_cast<size_t>(layers), 0);
  at::Tensor lc, ls;
  if (!local_layers.empty()) {
    lc = local_cos->contiguous(), ls = local_sin->contiguous();
    kinds.push_back({lc.data_ptr<float>(), ls.data_ptr<float>(), mask_bias(local_mask, s.batch, s.n, s.slots)});
    for (const int64_t l : local_layers) local[static_cast<size_t>(l)] = 1;
  }
  at::Tensor x = hidden.contiguous().clone();
  at::Tensor h = at::empty_like(x);
  at::Tensor attn = at::empty({s.rows, s.q_width}, x.options());
  Buffers buffers;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* norm = &dense_norms[s.norms_per_layer * l];  // input, post-attention[, pre-MLP, post-MLP]
    const bool sandwich = s.norms_per_layer == 4;
    rms_norm(x.data_ptr<float>(), norm[0].data_ptr<float>(), s.norm_offset, s.eps, s.rows, s.d, s.d,
             h.data_ptr<float>());
    const at::Tensor o = attention_block(s, l, linears, dense_qk_norms, h, kinds[local[static_cast<size_t>(l)]],
                                         key_caches[l], value_caches[l], attn, buffers);
    residual(s, x, o, sandwich ? &norm[1] : nullptr);
    rms_norm(x.data_ptr<float>(), norm[sandwich ? 2 : 1].data_ptr<float>(), s.norm_offset, s.eps, s.rows, s.d, s.d,
             h.data_ptr<float>());
    residual(s, x, mlp_block(s, l, linears, h, buffers), sandwich ? &norm[3] : nullptr);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace specops
