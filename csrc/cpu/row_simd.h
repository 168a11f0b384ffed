// SIMD row passes over a vocabulary row (maximum, first index of a value, probability checks, softmax
// sums and sampling weights) for the sampling kernels, chain_verify and vocab_project. Compiled once
// per instruction set through per_isa.h (sampling.h includes it with this file's name), with
// SPECOPS_ISA naming the namespace. No include guard. Internal linkage: every kernel's translation
// unit that includes sampling.h gets its own copy.

namespace specops {
namespace {
namespace SPECOPS_ISA {

#include "simd_math.h"

// ---- vectorized row passes (fvec: as wide as the copy's registers, simd_math.h) ----

// Maximum of a row, and whether it holds NaN or +inf (-inf is a legitimate "impossible token").
float scan_row(const float* x, int64_t n, bool* bad) {
  // NaN or +inf is exactly !(v < inf): one ordered compare per vector catches both.
  fvec mx = fvec{} - kInf;
  ivec ok = ivec{} - 1;
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    const fvec v = loadv(x + i);
    mx = v > mx ? v : mx;
    ok &= v < kInf;
  }
  float m = -kInf;
  bool f = false;
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    f |= !(x[i] < kInf);
  }
  for (int l = 0; l < kRowLanes; ++l) {
    m = mx[l] > m ? mx[l] : m;
    f |= ok[l] == 0;
  }
  *bad = f;
  return m;
}

// First index of `value` in x (present by construction).
int64_t find_first(const float* x, int64_t n, float value) {
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    const ivec eq = loadv(x + i) == value;
    bool any = false;
    for (int l = 0; l < kRowLanes; ++l) any |= eq[l] != 0;
    if (any) break;
  }
  for (; i < n; ++i)
    if (x[i] == value) return i;
  return n - 1;
}

// A probability row's sum in float64 (float lanes flushed every 256 values, so its error is about
// 256 / kRowLanes float32 roundings of the row's mass, ~1e-6), and whether the row holds NaN, inf or
// negative entries.
double scan_probs(const float* q, int64_t n, bool* bad) {
  constexpr int64_t kBlock = 256;
  ivec ok = ivec{} - 1;
  double total = 0.0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fvec acc = {};
    for (int64_t k = i; k < i + kBlock; k += kRowLanes) {
      const fvec v = loadv(q + k);
      ok &= (v >= 0.0f) & (v < kInf);
      acc += v;
    }
    total += lane_total(acc);
  }
  bool f = false;
  for (; i < n; ++i) {
    f |= !(q[i] >= 0.0f && q[i] < kInf);
    total += q[i];
  }
  for (int l = 0; l < kRowLanes; ++l) f |= ok[l] == 0;
  *bad = f;
  return total;
}

// Unnormalized kept weight of logits: exp(logit / t - m) if logit / t >= thr, else 0. x / 1 == x
// exactly, so kDivide = false (for t == 1) changes no value and saves the division.
template <bool kDivide = true, typename F>
SPECOPS_INLINE F kept_weight(F logit, float t, float m, float thr) {
  const F x = kDivide ? logit / t : logit;
  return x >= thr ? exp_nonpositive(x - m) : F{};
}

template <bool kDivide>
double sum_exp_impl(const float* logit, int64_t n, float t, float m, float thr) {
  constexpr int64_t kBlock = 256;
  double total = 0.0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fvec acc = {};
    for (int64_t k = i; k < i + kBlock; k += kRowLanes) acc += kept_weight<kDivide>(loadv(logit + k), t, m, thr);
    total += lane_total(acc);
  }
  for (; i < n; ++i) total += kept_weight<kDivide>(logit[i], t, m, thr);
  return total;
}

// Sum over kept tokens of exp(logit / t - m), in float64 (float lanes flushed every block).
double sum_exp(const float* logit, int64_t n, float t, float m, float thr) {
  return t == 1.0f ? sum_exp_impl<false>(logit, n, t, m, thr) : sum_exp_impl<true>(logit, n, t, m, thr);
}

template <bool kDivide>
double sum_exp_above_impl(const float* logit, int64_t n, float t, float m, float thr, float bound,
                          std::vector<float>& above, std::vector<int64_t>& ids, size_t cap, bool* complete) {
  constexpr int64_t kBlock = 256;
  double total = 0.0;
  bool fits = true;
  const auto take = [&](float x, int64_t id) {
    if (above.size() < cap) {
      above.push_back(x);
      ids.push_back(id);
    } else {
      fits = false;
    }
  };
  const auto take_from = [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const float x = kDivide ? logit[k] / t : logit[k];
      if (x >= bound) take(x, k);
    }
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fvec acc = {};
    ivec hit = {};
    for (int64_t k = i; k < i + kBlock; k += kRowLanes) {
      const fvec v = loadv(logit + k);
      const fvec x = kDivide ? v / t : v;
      acc += x >= thr ? exp_nonpositive(x - m) : fvec{};
      hit |= x >= bound;
    }
    total += lane_total(acc);
    // A block rarely holds a candidate: it is read again, one value at a time, where it does.
    bool any = false;
    for (int l = 0; l < kRowLanes; ++l) any |= hit[l] != 0;
    if (any) take_from(i, i + kBlock);
    if (!fits) break;  // too many candidates: the caller takes another way, the total unused
  }
  if (fits) {
    for (int64_t k = i; k < n; ++k) total += kept_weight<kDivide>(logit[k], t, m, thr);
    take_from(i, n);
  }
  *complete = fits;
  return total;
}

// sum_exp's total, and besides every x = logit / t >= bound (bound >= thr) appended to `above`, its index
// to `ids`, in index order; *complete says whether all of them fit in `cap` values (where they do not, the
// pass stops at the block that overflowed, and the total is partial).
double sum_exp_above(const float* logit, int64_t n, float t, float m, float thr, float bound,
                     std::vector<float>& above, std::vector<int64_t>& ids, size_t cap, bool* complete) {
  return t == 1.0f ? sum_exp_above_impl<false>(logit, n, t, m, thr, bound, above, ids, cap, complete)
                   : sum_exp_above_impl<true>(logit, n, t, m, thr, bound, above, ids, cap, complete);
}

template <bool kDivide>
double fill_weights_impl(const float* logit, const float* q, int64_t n, float t, float m, float inv_z, float thr,
                         float* w) {
  fvec acc = {};
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    fvec d = kept_weight<kDivide>(loadv(logit + i), t, m, thr) * inv_z;
    if (q != nullptr) d -= loadv(q + i);
    d = d > 0.0f ? d : fvec{};
    storev(w + i, d);
    acc += d;
  }
  double total = lane_total(acc);
  for (; i < n; ++i) {
    const float d = kept_weight<kDivide>(logit[i], t, m, thr) * inv_z - (q != nullptr ? q[i] : 0.0f);
    w[i] = d > 0.0f ? d : 0.0f;
    total += w[i];
  }
  return total;
}

// Sampling weights w_i = max(0, p_i - q_i) (q == nullptr: w = p) for one chunk of a row, written to w;
// returns their float64 sum.
double fill_weights(const float* logit, const float* q, int64_t n, float t, float m, float inv_z, float thr,
                    float* w) {
  return t == 1.0f ? fill_weights_impl<false>(logit, q, n, t, m, inv_z, thr, w)
                   : fill_weights_impl<true>(logit, q, n, t, m, inv_z, thr, w);
}

// tree_verify's residual update for one chunk: w_i = max(0, r_i * a - q_i * b), written to w; returns
// their float64 sum.
double update_residual(const float* r, const float* q, int64_t n, float a, float b, float* w) {
  fvec acc = {};
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    fvec d = loadv(r + i) * a - loadv(q + i) * b;
    d = d > 0.0f ? d : fvec{};
    storev(w + i, d);
    acc += d;
  }
  double total = lane_total(acc);
  for (; i < n; ++i) {
    const float d = r[i] * a - q[i] * b;
    w[i] = d > 0.0f ? d : 0.0f;
    total += w[i];
  }
  return total;
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
