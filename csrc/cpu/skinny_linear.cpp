// skinny_linear on the CPU: input [M, K] @ weight[N, K]^T (+ bias) for the few rows a decoding forward
// carries (1 token, or a draft chain or tree of a few to a few dozen). Semantics: specops/reference.py.
//
// BLAS GEMMs are tuned for many rows. For few, MKL on an Intel Xeon reads the weight once per three rows
// (Gemma-3-270M's 671 MB output head: 31 ms for 1-3 rows, 62 ms for 4, 101 ms for 8, 145 ms for 12) and on
// AMD EPYC about once per row. This kernel streams the weight once for any M: threads split the weight into
// panels of 16 rows; a panel meets every input row in groups of up to 4 rows (4 x 4 register tiles: 16
// accumulators, 8 loads per 16 FMAs; 5 to 8 rows in one group of 2 x m tiles; with AVX2, whose 16
// ymm registers hold 8 such vectors, groups of 2 in 2 x 2 tiles, skinny_simd.h), re-read from cache after the
// first group, while every group prefetches its share of the next panel into L2. With the prefetches spread
// that way, arithmetic and memory overlap: the 671 MB head takes 1.0-1.2x the time of summing it for 1-8 rows
// (1.3-1.7x when the whole next panel was prefetched into L1 by the first group; AMD EPYC, 2 threads). Each
// output is a 16-lane dot product over k, summed by one fixed lane tree, then the k % 16 tail: a row's result
// is the same bits whatever M is and wherever the row sits. llama_layers runs a layer's q, k and v (or gate
// and up) through skinny_products (skinny_linear.h): the same panels of several weights in one parallel
// region, written side by side.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#define SPECOPS_ISA_HEADER "skinny_simd.h"
#include "per_isa.h"
#undef SPECOPS_ISA_HEADER

#include "skinny_linear.h"

namespace specops {
namespace {

constexpr int64_t kPanel = 16;  // weight rows per panel
constexpr int64_t kMaxWeights = 8;  // weights in one skinny_products call

struct Tiles {
  void (*panel)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t);
  void (*tail_rows)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t);
};

const Tiles& tiles() {
  static const Tiles selected = [] {
    switch (cpu_isa()) {
#ifdef SPECOPS_X86_DISPATCH
      case Isa::avx512: return Tiles{avx512::panel, avx512::tail_rows};
      case Isa::avx2: return Tiles{avx2::panel, avx2::tail_rows};
#endif
      default: return Tiles{base::panel, base::tail_rows};
    }
  }();
  return selected;
}

// skinny_products' dot products (k_dim > 0, m > 0, 1 <= count <= kMaxWeights); weight i's outputs from
// column[i].
void products(const float* x, int64_t m, int64_t k_dim, const SkinnyWeight* weights, int64_t count,
              const int64_t* column, float* out, int64_t ldo) {
  // The weights' full panels numbered as one sequence: weight i's from first[i].
  int64_t first[kMaxWeights + 1];
  first[0] = 0;
  for (int64_t i = 0; i < count; ++i) first[i + 1] = first[i] + weights[i].rows / kPanel;
  const int64_t panels = first[count];
  const auto panel_at = [&](int64_t p, int64_t& i) {  // panel p's weight rows; i: its weight, from a guess below
    while (p >= first[i + 1]) ++i;
    return weights[i].data + (p - first[i]) * kPanel * k_dim;
  };
  const Tiles& t = tiles();
  // At least 256 KB of weight per task (quantized_linear's grain): smaller layers run on fewer threads.
  // With 1 MB per task Gemma-3-270M's k and v weights (655 KB each) ran on one thread of two, and every
  // Gemma step took 1-5 % longer (chains and trees of 1-16 tokens, medians of three alternating runs each
  // way, 2-vCPU Xeon, 2026-12-05).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kPanel * k_dim));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    int64_t i = 0, next = 0;
    for (int64_t p = begin; p < end; ++p) {
      const float* panel_w = panel_at(p, i);
      next = i;
      const float* ahead = p + 1 < end ? panel_at(p + 1, next) : nullptr;
      t.panel(x, m, k_dim, panel_w, ahead, out + column[i] + (p - first[i]) * kPanel, ldo);
    }
  });
  for (int64_t i = 0; i < count; ++i) {
    const int64_t done = (first[i + 1] - first[i]) * kPanel;
    if (done < weights[i].rows) {
      t.tail_rows(x, m, k_dim, weights[i].data + done * k_dim, weights[i].rows - done, out + column[i] + done, ldo);
    }
  }
}

at::Tensor skinny_linear_cpu(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(input.dim() == 2 && weight.dim() == 2, "skinny_linear: input must be [M, K] and weight [N, K]");
  TORCH_CHECK_TYPE(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
                   "skinny_linear: the CPU kernel takes float32 input and weight");
  const int64_t m = input.size(0), k_dim = input.size(1), n = weight.size(0);
  TORCH_CHECK_VALUE(weight.size(1) == k_dim, "skinny_linear: weight must be [N, K] with K = ", k_dim, ", got [", n, ", ",
                    weight.size(1), "]");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK_VALUE(!has_bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat),
                    "skinny_linear: bias must be float32 [N] with N = ", n);
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor b = has_bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({m, n}, input.options());
  const SkinnyWeight one{w.data_ptr<float>(), n, has_bias ? b.data_ptr<float>() : nullptr};
  skinny_products(x.data_ptr<float>(), m, k_dim, &one, 1, out.data_ptr<float>(), n);
  return out;
}

}  // namespace

void skinny_products(const float* x, int64_t m, int64_t k_dim, const SkinnyWeight* weights, int64_t count,
                     float* out, int64_t ldo) {
  TORCH_CHECK(count >= 1 && count <= kMaxWeights, "skinny_products: 1 to ", kMaxWeights, " weights, got ", count);
  if (m == 0) return;
  int64_t column[kMaxWeights + 1];  // weight i's outputs from column[i]; column[count]: all of them
  column[0] = 0;
  for (int64_t i = 0; i < count; ++i) column[i + 1] = column[i] + weights[i].rows;
  if (k_dim == 0) {  // empty dot products: zeros, then the biases
    for (int64_t r = 0; r < m; ++r) std::fill(out + r * ldo, out + r * ldo + column[count], 0.0f);
  } else {
    products(x, m, k_dim, weights, count, column, out, ldo);
  }
  for (int64_t i = 0; i < count; ++i) {
    const float* bias = weights[i].bias;
    if (bias == nullptr) continue;
    for (int64_t r = 0; r < m; ++r) {
      float* o = out + r * ldo + column[i];
      for (int64_t c = 0; c < weights[i].rows; ++c) o[c] += bias[c];
    }
  }
}

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

}  // namespace specops
