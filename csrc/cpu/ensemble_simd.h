// SIMD combine passes of ensemble_logits: one vocabulary chunk of one row, every member read once.
// Compiled once per instruction set through per_isa.h, inside the namespace SPECOPS_ISA names, after
// row_simd.h (sampling.h) has put the vector basics of simd_math.h into that namespace (the passes use
// its row vectors, as wide as the copy's registers). No include guard.

namespace specops {
namespace {
namespace SPECOPS_ISA {

// log(s) for s in [1, 2^24]: s = 2^e * f with f in [sqrt(1/2), sqrt(2)), log f = 2 atanh(u), u = (f-1)/(f+1),
// |u| < 0.1716, by its odd series to u^9 (relative error below 2e-8: about float's resolution).
template <typename F, typename I>
SPECOPS_INLINE F log_at_least_one_t(F s) {
  I bits = std::bit_cast<I>(s);
  I e = ((bits >> 23) & 0xff) - 127;
  F f = std::bit_cast<F>((bits & 0x007fffff) | 0x3f800000);  // mantissa in [1, 2)
  if constexpr (std::is_same_v<F, float>) {
    if (f > 1.41421356f) {
      f = f * 0.5f;
      e = e + 1;
    }
  } else {
    const I big = f > 1.41421356f;  // all ones where true
    f = big ? f * 0.5f : f;
    e = e - big;
  }
  const F u = (f - 1.0f) / (f + 1.0f);
  const F u2 = u * u;
  F series = F{} + (1.0f / 9.0f);
  series = series * u2 + (1.0f / 7.0f);
  series = series * u2 + (1.0f / 5.0f);
  series = series * u2 + (1.0f / 3.0f);
  series = series * u2 + 1.0f;
  F ef;
  if constexpr (std::is_same_v<F, float>) {
    ef = static_cast<float>(e);
  } else {
    ef = __builtin_convertvector(e, F);
  }
  return ef * 0.69314718056f + 2.0f * u * series;
}

SPECOPS_INLINE float log_at_least_one(float s) { return log_at_least_one_t<float, int32_t>(s); }
SPECOPS_INLINE f32x16 log_at_least_one(f32x16 s) { return log_at_least_one_t<f32x16, i32x16>(s); }
#ifndef SPECOPS_ISA_AVX512  // otherwise fvec is f32x16
SPECOPS_INLINE fvec log_at_least_one(fvec s) { return log_at_least_one_t<fvec, ivec>(s); }
#endif

// Weighted: out[x] = log sum_i exp((l_i[x] - max_i) + c_i), c_i = log w_i - log z_i (member i's log-softmax
// plus its log-weight; the maximum comes off first, so a row far from zero keeps full precision), as
// A + log sum_i exp(a_i - A) with A the largest term a_i; -inf where every member has -inf (or weight 0).
template <typename Load>
SPECOPS_INLINE void weighted_impl(const Load& load, int64_t members, const float* top, const float* add, int64_t n,
                                  float* out) {
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    fvec best = fvec{} - kInf;
    for (int64_t m = 0; m < members; ++m) {
      const fvec a = (loadv(load(m) + i) - top[m]) + add[m];
      best = a > best ? a : best;
    }
    const ivec some = best > -kInf;
    const fvec safe = some ? best : fvec{};
    fvec sum = {};
    for (int64_t m = 0; m < members; ++m) sum += exp_nonpositive(((loadv(load(m) + i) - top[m]) + add[m]) - safe);
    const fvec v = safe + log_at_least_one(some ? sum : fvec{} + 1.0f);
    storev(out + i, some ? v : fvec{} - kInf);
  }
  for (; i < n; ++i) {
    float best = -kInf;
    for (int64_t m = 0; m < members; ++m) best = std::max(best, (load(m)[i] - top[m]) + add[m]);
    if (best == -kInf) {
      out[i] = -kInf;
      continue;
    }
    float sum = 0.0f;
    for (int64_t m = 0; m < members; ++m) sum += exp_nonpositive(((load(m)[i] - top[m]) + add[m]) - best);
    out[i] = best + log_at_least_one(sum);
  }
}

// Two members: A + log(1 + exp(-|a_0 - a_1|)), one exp and one log per token.
SPECOPS_INLINE void weighted_pair(const float* x0, const float* x1, const float* top, const float* add, int64_t n,
                                  float* out) {
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    const fvec a = (loadv(x0 + i) - top[0]) + add[0];
    const fvec b = (loadv(x1 + i) - top[1]) + add[1];
    const fvec hi = a > b ? a : b, lo = a > b ? b : a;
    const ivec some = hi > -kInf;
    const fvec gap = some ? lo - hi : fvec{} - kInf;  // <= 0; -inf where lo is -inf
    const fvec v = hi + log_at_least_one(1.0f + exp_nonpositive(gap));
    storev(out + i, some ? v : fvec{} - kInf);
  }
  for (; i < n; ++i) {
    const float a = (x0[i] - top[0]) + add[0], b = (x1[i] - top[1]) + add[1];
    const float hi = std::max(a, b), lo = std::min(a, b);
    out[i] = hi == -kInf ? -kInf : hi + log_at_least_one(1.0f + exp_nonpositive(lo - hi));
  }
}

void weighted(const float* const* member, int64_t members, const float* top, const float* add, int64_t n, float* out) {
  if (members == 2) {
    weighted_pair(member[0], member[1], top, add, n, out);
    return;
  }
  weighted_impl([&](int64_t m) { return member[m]; }, members, top, add, n, out);
}

// Contrastive: out[x] = (e[x] - max_e) - mu (a[x] - max_a), -inf where e[x] or a[x] is -inf or where the
// expert's probability is below alpha times its largest (e[x] - max_e < log_alpha; log_alpha = -inf: no cut).
// Returns the number of finite outputs.
int64_t contrastive(const float* e, const float* a, float max_e, float max_a, float mu, float log_alpha, int64_t n,
                    float* out) {
  int64_t finite = 0;
  ivec kept = {};
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    const fvec de = loadv(e + i) - max_e;
    const fvec da = loadv(a + i) - max_a;
    const ivec keep = (de >= log_alpha) & (de > -kInf) & (da > -kInf);
    storev(out + i, keep ? de - mu * da : fvec{} - kInf);
    kept -= keep;  // keep is -1 where true
  }
  for (int l = 0; l < kRowLanes; ++l) finite += kept[l];
  for (; i < n; ++i) {
    const float de = e[i] - max_e, da = a[i] - max_a;
    const bool keep = de >= log_alpha && de > -kInf && da > -kInf;
    out[i] = keep ? de - mu * da : -kInf;
    finite += keep;
  }
  return finite;
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
