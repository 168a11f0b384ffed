// SIMD combine passes of ensemble_logits: one vocabulary chunk of one row, every member read once.
// Compiled once per instruction set through per_isa.h, inside the namespace SPECOPS_ISA names, after
// row_simd.h (sampling.h) has put the 16-lane vector basics of simd_math.h into that namespace. No
// include guard.

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

// Weighted: out[x] = log sum_i exp(l_i[x] + c_i), c_i = log w_i - max_i - log z_i (member i's log-softmax
// plus its log-weight), as A + log sum_i exp(l_i[x] + c_i - A) with A the largest term; -inf where every
// member has -inf (or weight 0). Returns the number of finite outputs.
template <typename Load>
SPECOPS_INLINE int64_t weighted_impl(const Load& load, int64_t members, const float* shift, int64_t n, float* out) {
  int64_t finite = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    f32x16 top = f32x16{} - kInf;
    for (int64_t m = 0; m < members; ++m) {
      const f32x16 a = load16(load(m) + i) + shift[m];
      top = a > top ? a : top;
    }
    const i32x16 some = top > -kInf;
    const f32x16 safe = some ? top : f32x16{};
    f32x16 sum = {};
    for (int64_t m = 0; m < members; ++m) sum += exp_nonpositive(load16(load(m) + i) + shift[m] - safe);
    const f32x16 v = safe + log_at_least_one(some ? sum : f32x16{} + 1.0f);
    store16(out + i, some ? v : f32x16{} - kInf);
    for (int l = 0; l < kLanes; ++l) finite += some[l] != 0;
  }
  for (; i < n; ++i) {
    float top = -kInf;
    for (int64_t m = 0; m < members; ++m) top = std::max(top, load(m)[i] + shift[m]);
    if (top == -kInf) {
      out[i] = -kInf;
      continue;
    }
    float sum = 0.0f;
    for (int64_t m = 0; m < members; ++m) sum += exp_nonpositive(load(m)[i] + shift[m] - top);
    out[i] = top + log_at_least_one(sum);
    ++finite;
  }
  return finite;
}

int64_t weighted(const float* const* member, int64_t members, const float* shift, int64_t n, float* out) {
  if (members == 2) {  // the common pair, with the member loop unrolled
    const float* two[2] = {member[0], member[1]};
    return weighted_impl([&](int64_t m) { return two[m & 1]; }, 2, shift, n, out);
  }
  return weighted_impl([&](int64_t m) { return member[m]; }, members, shift, n, out);
}

// Contrastive: out[x] = (e[x] - max_e) - mu (a[x] - max_a), -inf where e[x] or a[x] is -inf or where the
// expert's probability is below alpha times its largest (e[x] - max_e < log_alpha; log_alpha = -inf: no cut).
// Returns the number of finite outputs.
int64_t contrastive(const float* e, const float* a, float max_e, float max_a, float mu, float log_alpha, int64_t n,
                    float* out) {
  int64_t finite = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32x16 de = load16(e + i) - max_e;
    const f32x16 da = load16(a + i) - max_a;
    const i32x16 keep = (de >= log_alpha) & (de > -kInf) & (da > -kInf);
    store16(out + i, keep ? de - mu * da : f32x16{} - kInf);
    for (int l = 0; l < kLanes; ++l) finite += keep[l] != 0;
  }
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
