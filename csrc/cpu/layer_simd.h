// The row passes of llama_layers (csrc/cpu/llama_layers.cpp): attention_simd.h's attention of one query row,
// and the MLP's activation gate. Compiled once per instruction set through per_isa.h, with SPECOPS_ISA naming
// the namespace. No include guard; internal linkage.

#include "attention_simd.h"

namespace specops {
namespace {
namespace SPECOPS_ISA {

// silu(g) = g / (1 + exp(-g)), through exp of -|g| (exp_nonpositive, about 1 ulp): the sigmoid is
// 1 / (1 + e) for g >= 0 and e / (1 + e) below.
template <typename F>
SPECOPS_INLINE F silu_t(F g) {
  const F e = exp_nonpositive(g < 0 ? g : -g);
  return g * ((g < 0 ? e : F{} + 1.0f) / (e + 1.0f));
}

// gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3), tanh(|u|) = (1 - t) / (1 + t)
// with t = exp(-2 |u|) (exp_nonpositive). The cancellation in 1 - t for small |u| costs tanh relative
// precision there, not the gate's: 1 + tanh(u) stays within a few ulp.
template <typename F>
SPECOPS_INLINE F gelu_tanh_t(F g) {
  const F u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const F t = exp_nonpositive(u < 0 ? u * 2.0f : u * -2.0f);
  const F th = (1.0f - t) / (1.0f + t);
  return 0.5f * g * (1.0f + (u < 0 ? -th : th));
}

// out[i] = act(gate[i]) * up[i] for i < n; act 0: silu, 1: gelu_tanh. Vectors as wide as the registers,
// the tail one lane at a time by the same formula.
void gate_row(const float* gate, const float* up, int64_t n, int act, float* out) {
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    const fvec g = loadv(gate + i);
    storev(out + i, (act == 0 ? silu_t(g) : gelu_tanh_t(g)) * loadv(up + i));
  }
  for (; i < n; ++i) out[i] = (act == 0 ? silu_t(gate[i]) : gelu_tanh_t(gate[i])) * up[i];
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
