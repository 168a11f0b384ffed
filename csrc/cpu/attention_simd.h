// SIMD row passes of tree_attention's online softmax (csrc/cpu/tree_attention.cpp): scale, soft-cap and
// mask a row of scores, exponentiate it against the running maximum, rescale an accumulator row.
// Compiled once per instruction set through per_isa.h, with SPECOPS_ISA naming the namespace. No
// include guard; internal linkage.

namespace specops {
namespace {
namespace SPECOPS_ISA {

#include "simd_math.h"

// softcap * tanh(x / softcap) from exp of a non-positive argument: tanh|y| = (1 - e) / (1 + e) with
// e = exp(-2|y|).
template <typename F>
SPECOPS_INLINE F soft_cap(F x, float cap) {
  const F y = x * (1.0f / cap);
  const F magnitude = y < 0.0f ? -y : y;
  const F e = exp_nonpositive(-2.0f * magnitude);
  const F t = cap * (1.0f - e) / (1.0f + e);
  return y < 0.0f ? -t : t;
}

// Scores row s[0, n): s * scale, soft-capped when cap > 0, then -inf where bias says so (bias[j] is 0
// or -inf; nullptr: none) and over the first `hidden` entries. Returns the row's maximum.
float prepare_row(float* s, int64_t n, float scale, float cap, const float* bias, int64_t hidden) {
  hidden = hidden < n ? hidden : n;
  for (int64_t k = 0; k < hidden; ++k) s[k] = -kInf;
  f32x16 mx = f32x16{} - kInf;
  int64_t j = hidden;
  for (; j + kLanes <= n; j += kLanes) {
    f32x16 v = load16(s + j) * scale;
    if (cap > 0.0f) v = soft_cap(v, cap);
    if (bias != nullptr) v = v + load16(bias + j);
    store16(s + j, v);
    mx = v > mx ? v : mx;
  }
  float m = -kInf;
  for (int l = 0; l < kLanes; ++l) m = mx[l] > m ? mx[l] : m;
  for (; j < n; ++j) {
    float v = s[j] * scale;
    if (cap > 0.0f) v = soft_cap(v, cap);
    if (bias != nullptr) v += bias[j];
    s[j] = v;
    m = v > m ? v : m;
  }
  return m;
}

// s = exp(s - m) in place (0 where s is -inf); returns the sum. m must be finite.
float exp_row(float* s, int64_t n, float m) {
  f32x16 total = f32x16{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f32x16 e = exp_nonpositive(load16(s + j) - m);
    store16(s + j, e);
    total += e;
  }
  float sum = static_cast<float>(lane_total(total));
  for (; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// acc[0, n) *= factor.
void scale_row(float* acc, int64_t n, float factor) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store16(acc + j, load16(acc + j) * factor);
  for (; j < n; ++j) acc[j] *= factor;
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
