// SIMD row passes of tree_attention's online softmax (csrc/cpu/tree_attention.cpp): scale, soft-cap and
// mask a row of scores, exponentiate it against the running maximum, rescale an accumulator row; and
// llama_layers' attention of one query row over a short cache (csrc/cpu/llama_layers.cpp), built on the
// same passes. Compiled once per instruction set through per_isa.h, with SPECOPS_ISA naming the
// namespace. No include guard; internal linkage.

namespace specops {
namespace {
namespace SPECOPS_ISA {

#include "simd_math.h"
#include "lane_tree.h"

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

// Scores row s[0, n): s * scale, soft-capped when cap > 0; then -inf where bias says so (bias[j] is 0 or
// -inf; nullptr: none) and over the first `hidden` entries. Masked entries are replaced, never added to:
// a masked key may hold anything (NaN from an uninitialized cache slot included). Returns the maximum
// of the entries left, or NaN if one of them is NaN (a NaN query, key or score is never dropped).
float prepare_row(float* s, int64_t n, float scale, float cap, const float* bias, int64_t hidden) {
  hidden = hidden < n ? hidden : n;
  for (int64_t k = 0; k < hidden; ++k) s[k] = -kInf;
  const fvec neg_inf = fvec{} - kInf;
  fvec mx = neg_inf;
  ivec nan = ivec{};
  int64_t j = hidden;
  for (; j + kRowLanes <= n; j += kRowLanes) {
    const fvec raw = loadv(s + j) * scale;
    fvec v = raw;
    if (cap > 0.0f) v = raw != raw ? raw : soft_cap(raw, cap);
    if (bias != nullptr) v = loadv(bias + j) == 0.0f ? v : neg_inf;
    storev(s + j, v);
    nan |= v != v;
    mx = v > mx ? v : mx;
  }
  float m = -kInf;
  bool any_nan = false;
  for (int l = 0; l < kRowLanes; ++l) {
    m = mx[l] > m ? mx[l] : m;
    any_nan = any_nan || nan[l] != 0;
  }
  for (; j < n; ++j) {
    const float raw = s[j] * scale;
    float v = raw;
    if (cap > 0.0f && raw == raw) v = soft_cap(raw, cap);
    if (bias != nullptr && bias[j] != 0.0f) v = -kInf;
    s[j] = v;
    any_nan = any_nan || v != v;
    m = v > m ? v : m;
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// s = exp(s - m) in place (0 where s is -inf); returns the sum. m must be finite.
float exp_row(float* s, int64_t n, float m) {
  fvec total = fvec{};
  int64_t j = 0;
  for (; j + kRowLanes <= n; j += kRowLanes) {
    const fvec e = exp_nonpositive(loadv(s + j) - m);
    storev(s + j, e);
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
  for (; j + kRowLanes <= n; j += kRowLanes) storev(acc + j, loadv(acc + j) * factor);
  for (; j < n; ++j) acc[j] *= factor;
}

// Attention of one query row q [dim] over `slots` cached rows (key j at k + j * k_stride, value j at
// v + j * v_stride): out [dim] = softmax_j(q . key_j * scale + bias[j]) value_j, bias[j] 0 or -inf
// (nullptr: every slot seen). scores: `slots` floats of scratch. A row that sees no slot gives zeros; one
// whose seen scores hold a NaN or +inf gives NaN.
// Sixteen keys at a time, their dot products summed by the lane tree (with AVX-512; a key at a time in row
// vectors otherwise); then the row passes above, and the values accumulated slot by slot. For the few
// query rows of a decoding step, where a library attention's setup costs more than the arithmetic
// (SmolLM2's 9 heads over 150 slots: SDPA about 30 us, this about 25 on one thread).
void attend_row(const float* q, const float* k, int64_t k_stride, const float* v, int64_t v_stride, int64_t slots,
                int64_t dim, float scale, const float* bias, float* scores, float* out) {
#ifdef SPECOPS_ISA_AVX512
  const int64_t full = dim / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < slots; j0 += kLanes) {
    const int64_t count = slots - j0 < kLanes ? slots - j0 : kLanes;
    const float* kj = k + j0 * k_stride;
    f32x16 acc[kLanes];
    for (int l = 0; l < kLanes; ++l) acc[l] = f32x16{};
    if (count == kLanes) {
      for (int64_t c = 0; c < full; c += kLanes) {
        const f32x16 qv = load16(q + c);
        for (int l = 0; l < kLanes; ++l) acc[l] += qv * load16(kj + l * k_stride + c);
      }
    } else {
      for (int64_t c = 0; c < full; c += kLanes) {
        const f32x16 qv = load16(q + c);
        for (int64_t l = 0; l < count; ++l) acc[l] += qv * load16(kj + l * k_stride + c);
      }
    }
    float dots[kLanes];
    store16(dots, reduce16(acc));
    for (int64_t l = 0; l < count; ++l) {
      float s = dots[l];
      for (int64_t d = full; d < dim; ++d) s += q[d] * kj[l * k_stride + d];
      scores[j0 + l] = s;
    }
  }
#else
  // Without 64-byte registers the sixteen 16-lane accumulators went through the stack: here each key's dot
  // product runs in one row vector, its lanes then summed in order.
  const int64_t full = dim / kRowLanes * kRowLanes;
  for (int64_t j = 0; j < slots; ++j) {
    const float* kj = k + j * k_stride;
    fvec acc = {};
    for (int64_t c = 0; c < full; c += kRowLanes) acc += loadv(q + c) * loadv(kj + c);
    float s = 0.0f;
    for (int l = 0; l < kRowLanes; ++l) s += acc[l];
    for (int64_t d = full; d < dim; ++d) s += q[d] * kj[d];
    scores[j] = s;
  }
#endif
  const float m = prepare_row(scores, slots, scale, 0.0f, bias, 0);
  // A NaN or +inf score among the seen slots leaves no softmax: the row is NaN, never plausible numbers.
  const float fill = m < kInf ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  for (int64_t d = 0; d < dim; ++d) out[d] = fill;
  if (!(m > -kInf && m < kInf)) return;
  const float sum = exp_row(scores, slots, m);
  for (int64_t j = 0; j < slots; ++j) {
    // Masked slots are never read (their values may be anything); a seen one adds p * value even at
    // p = 0, so that a NaN there shows.
    if (bias != nullptr && bias[j] != 0.0f) continue;
    const float p = scores[j];
    const float* vj = v + j * v_stride;
    int64_t d = 0;
    for (; d + kRowLanes <= dim; d += kRowLanes) storev(out + d, loadv(out + d) + p * loadv(vj + d));
    for (; d < dim; ++d) out[d] += p * vj[d];
  }
  scale_row(out, dim, 1.0f / sum);
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
