// quantized_linear on the CPU: input [M, K] float32 @ W^T (+ bias) with W stored in low precision and
// de-quantized in registers (weight-only quantization: the activations stay float32). Semantics and
// formats: specops/reference.py. Formats, told apart by the weight's dtype:
//   bfloat16 [N, K]                                   W = weight
//   int8 [N, K], scales [N, G]                        W[n, k] = weight[n, k] * scales[n, k / (K / G)]
//   uint8 [N, K / 2] (int4), scales, mins [N, G]      W[n, k] = q[n, k] * scales[n, g] + mins[n, g]
// A decoding forward (1 to a few dozen rows) is bound by reading the weights, so fewer bytes per weight
// make it faster. torch's own weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) re-run
// per input row and, on a 2-core Xeon, stream 0.1-2.7 GB/s; this kernel reads the weight once for any M,
// with skinny_linear's panels and tiles (and its batch invariance: a row's result is the same bits
// whatever M is).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>  // the widening loads of quantized_simd.h's x86 copies
#endif

namespace specops {
namespace {

// A quantized weight as the tiles read it: weight rows of k_dim values in `groups` groups of group_size.
struct QuantArgs {
  const void* weight;
  const float* scales;  // [N, groups] (int8, int4)
  const float* mins;    // [N, groups] (int4)
  int64_t k_dim, groups, group_size;
};

}  // namespace
}  // namespace specops

#define SPECOPS_ISA_HEADER "quantized_simd.h"
#include "per_isa.h"
#undef SPECOPS_ISA_HEADER

namespace specops {
namespace {

constexpr int64_t kPanel = 16;  // weight rows per panel

using RowsFn = void (*)(const float*, int64_t, const QuantArgs&, int64_t, int64_t, int64_t, float*, int64_t);

struct Formats {
  RowsFn bf16, int8, int4;
};

const Formats& formats() {
  static const Formats selected = [] {
    switch (cpu_isa()) {
#ifdef SPECOPS_X86_DISPATCH
      case Isa::avx512: return Formats{avx512::rows_bf16, avx512::rows_int8, avx512::rows_int4};
      case Isa::avx2: return Formats{avx2::rows_bf16, avx2::rows_int8, avx2::rows_int4};
#endif
      default: return Formats{base::rows_bf16, base::rows_int8, base::rows_int4};
    }
  }();
  return selected;
}

void check_params(const c10::optional<at::Tensor>& t, const char* name, int64_t n) {
  TORCH_CHECK_VALUE(t.has_value() && t->defined(), "quantized_linear: this weight format needs ", name);
  TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == n && t->size(1) >= 1 && t->scalar_type() == at::kFloat,
                    "quantized_linear: ", name, " must be float32 [N, G] with N = ", n);
}

at::Tensor quantized_linear_cpu(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                                const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(input.dim() == 2 && input.scalar_type() == at::kFloat, "quantized_linear: input must be float32 [M, K]");
  TORCH_CHECK_VALUE(weight.dim() == 2, "quantized_linear: weight must be 2-D");
  const auto dtype = weight.scalar_type();
  const int64_t m = input.size(0), k_dim = input.size(1), n = weight.size(0);
  const at::Tensor w = weight.contiguous();
  QuantArgs q{w.data_ptr(), nullptr, nullptr, k_dim, 1, std::max<int64_t>(k_dim, 1)};
  at::Tensor s, z;
  RowsFn rows_fn;
  int64_t row_bytes;
  const Formats& f = formats();
  if (dtype == at::kBFloat16) {
    TORCH_CHECK_VALUE(weight.size(1) == k_dim, "quantized_linear: a bfloat16 weight must be [N, K] with K = ", k_dim);
    TORCH_CHECK_VALUE(!(scales.has_value() && scales->defined()) && !(mins.has_value() && mins->defined()),
                      "quantized_linear: a bfloat16 weight takes no scales or mins");
    rows_fn = f.bf16;
    row_bytes = 2 * k_dim;
  } else if (dtype == at::kChar || dtype == at::kByte) {
    const bool int4 = dtype == at::kByte;
    TORCH_CHECK_VALUE(weight.size(1) * (int4 ? 2 : 1) == k_dim, "quantized_linear: an ", int4 ? "int4 (uint8)" : "int8",
                      " weight must be [N, ", int4 ? "K / 2" : "K", "] with K = ", k_dim);
    check_params(scales, "scales", n);
    s = scales->contiguous();
    const int64_t groups = s.size(1);
    TORCH_CHECK_VALUE(k_dim % groups == 0 && (groups == 1 || (k_dim / groups) % 32 == 0),
                      "quantized_linear: scales [N, G] must split K = ", k_dim, " into G groups of a multiple of 32 (or G = 1)");
    TORCH_CHECK_VALUE(!int4 || k_dim % 32 == 0, "quantized_linear: int4 weights need K a multiple of 32, got ", k_dim);
    q.scales = s.data_ptr<float>();
    q.groups = groups;
    q.group_size = k_dim / groups;
    if (int4) {
      check_params(mins, "mins", n);
      z = mins->contiguous();
      TORCH_CHECK_VALUE(z.size(1) == groups, "quantized_linear: mins must have the shape of scales");
      q.mins = z.data_ptr<float>();
    } else {
      TORCH_CHECK_VALUE(!(mins.has_value() && mins->defined()), "quantized_linear: int8 weights are symmetric: no mins");
    }
    rows_fn = int4 ? f.int4 : f.int8;
    row_bytes = k_dim;  // int4 too: de-quantizing it is compute-bound, so its tasks are sized in weights
  } else {
    TORCH_CHECK_TYPE(false, "quantized_linear: weight must be bfloat16, int8 or uint8 (packed int4), got ", dtype);
  }
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK_VALUE(!has_bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat),
                    "quantized_linear: bias must be float32 [N] with N = ", n);
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty({m, n}, input.options());
  if (m == 0 || n == 0) return out;
  if (k_dim == 0) {
    out.zero_();
  } else {
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t panels = (n + kPanel - 1) / kPanel;
    // At least 256 KB of weight per task: smaller layers run on fewer threads.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (kPanel * row_bytes));
    // The next panel is prefetched into L2 while this one is computed (the hardware prefetcher ramps up
    // too slowly on short rows). Into L1, or 32 KB ahead, the prefetches filled the core's miss queue and
    // int8 streamed 9-13 GB/s instead of 23 (SmolLM2's head, AMD EPYC, 2 threads): skinny_linear's lesson.
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t row0 = p * kPanel, rows = std::min(kPanel, n - row0);
        const int64_t ahead = p + 1 < end && (p + 2) * kPanel <= n ? row0 + kPanel : -1;
        rows_fn(xp, m, q, row0, rows, ahead, op + row0, n);
      }
    });
  }
  if (has_bias) out.add_(*bias);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("quantized_linear", &quantized_linear_cpu); }

}  // namespace specops
