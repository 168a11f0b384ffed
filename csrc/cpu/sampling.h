// Sampling helpers shared by the CPU kernels (chain_verify, vocab_project): the Philox generator of
// specops.reference, the SIMD row passes (row_simd.h, built for AVX-512, AVX2 and a baseline;
// the running CPU's build is chosen once), top-k / top-p thresholds, the chunked inverse CDF, and the
// checks of the arguments every sampling op takes.
// Everything here has internal linkage: each kernel's translation unit compiles its own copy.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

// Helpers are forced inline so that every instruction-set build of the SIMD passes inlines them.
#define SPECOPS_INLINE __attribute__((always_inline)) inline

namespace specops {
namespace {

constexpr int64_t kChunk = 2048;  // chunk of the two-level inverse-CDF search
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- rows in parallel, errors in row order ----

// Runs rows [0, count) on the intra-op threads as at::parallel_for(0, count, 1, ...) does, through
// chunk(begin, end, row), which works on rows begin..end-1 keeping `row` at the one it is on. Where rows
// raise, the others still run, and the error of the first such row is rethrown at the end: which row an
// error names does not depend on the number of threads or on their timing (the checks made for devices
// whose kernels cannot raise, specops/ops, name the first bad row too).
template <typename Chunk>
void parallel_rows(int64_t count, const Chunk& chunk) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(count));
  std::atomic<bool> failed{false};
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    int64_t row = begin;
    while (row < end) {
      try {
        chunk(row, end, row);
        row = end;
      } catch (...) {
        errors[static_cast<size_t>(row)] = std::current_exception();
        failed = true;
        ++row;
      }
    }
  });
  if (!failed) return;
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

// ---- Philox4x32-10 (Salmon et al., SC'11): the generator shared with Triton and the reference ----

SPECOPS_INLINE void philox4x32(uint64_t key, uint32_t c[4]) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53u} * c[0];
    const uint64_t p1 = uint64_t{0xCD9E8D57u} * c[2];
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1;
    c[1] = static_cast<uint32_t>(p1);
    c[3] = static_cast<uint32_t>(p0);
    c[0] = n0;
    c[2] = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// Uniform in (0, 1), never 0 or 1: 52 random bits plus one half, exactly representable in a double.
SPECOPS_INLINE double uniform(int64_t seed, uint64_t offset, int64_t position, uint32_t stream) {
  uint32_t c[4] = {static_cast<uint32_t>(position), stream, static_cast<uint32_t>(offset),
                   static_cast<uint32_t>(offset >> 32)};
  philox4x32(static_cast<uint64_t>(seed), c);
  const uint64_t k = (uint64_t{c[0] >> 6} << 26) | (c[1] >> 6);
  return (static_cast<double>(k) + 0.5) * 0x1p-52;
}

constexpr uint32_t kStreamAccept = 0;
constexpr uint32_t kStreamSample = 1;
constexpr uint32_t kStreamDraft = 2;
constexpr uint32_t kStreamWithoutReplacement = 3;
constexpr uint32_t kStreamBeam = 4;

}  // namespace
}  // namespace specops

// The SIMD passes, once per instruction set.
#define SPECOPS_ISA_HEADER "row_simd.h"
#include "per_isa.h"
#undef SPECOPS_ISA_HEADER

namespace specops {
namespace {

// The row passes for the running CPU, chosen once.
struct RowPasses {
  float (*scan_row)(const float*, int64_t, bool*);
  int64_t (*find_first)(const float*, int64_t, float);
  double (*scan_probs)(const float*, int64_t, bool*);
  double (*sum_exp)(const float*, int64_t, float, float, float);
  double (*sum_exp_above)(const float*, int64_t, float, float, float, float, std::vector<float>&,
                          std::vector<int64_t>&, size_t, bool*);
  double (*fill_weights)(const float*, const float*, int64_t, float, float, float, float, float*);
  double (*update_residual)(const float*, const float*, int64_t, float, float, float*);
};

#define SPECOPS_PASSES(ns) \
  RowPasses{ns::scan_row,     ns::find_first,   ns::scan_probs,     ns::sum_exp, \
            ns::sum_exp_above, ns::fill_weights, ns::update_residual}

const RowPasses& passes() {
  static const RowPasses selected = [] {
    switch (cpu_isa()) {
#ifdef SPECOPS_X86_DISPATCH
      case Isa::avx512: return SPECOPS_PASSES(avx512);
      case Isa::avx2: return SPECOPS_PASSES(avx2);
#endif
      default: return SPECOPS_PASSES(base);
    }
  }();
  return selected;
}

using base::exp_nonpositive;
using base::kept_weight;

// ---- filtering thresholds (rows with top-k / top-p only) ----

// Largest value t of x such that the weight of {x >= t} reaches `need`: weighted quickselect,
// expected linear time. x is reordered.
float weighted_upper_threshold(std::vector<float>& x, float m, double need) {
  size_t lo = 0, hi = x.size();
  double above = 0.0;
  float last = x.empty() ? -kInf : x[0];
  while (lo < hi) {
    const float pivot = x[lo + (hi - lo) / 2];
    last = pivot;
    auto first = x.begin() + static_cast<std::ptrdiff_t>(lo);
    auto end = x.begin() + static_cast<std::ptrdiff_t>(hi);
    auto mid1 = std::partition(first, end, [pivot](float v) { return v > pivot; });
    auto mid2 = std::partition(mid1, end, [pivot](float v) { return v == pivot; });
    double greater = 0.0;
    for (auto it = first; it != mid1; ++it) greater += exp_nonpositive(*it - m);
    const double equal = static_cast<double>(mid2 - mid1) * exp_nonpositive(pivot - m);
    if (above + greater >= need) {
      hi = static_cast<size_t>(mid1 - x.begin());
    } else if (above + greater + equal >= need) {
      return pivot;
    } else {
      above += greater + equal;
      lo = static_cast<size_t>(mid2 - x.begin());
    }
  }
  return last;  // round-off left `need` above the total: keep everything seen
}

// Mass buckets of the top-p cut: a kept weight w = exp(x - m) in (0, 1] goes to bucket (its float bits >> 20):
// 8 exponent bits and 3 mantissa bits, so a bucket spans at most an eighth of its weight, and a larger bucket
// holds only larger weights, hence larger x.
constexpr int kMassShift = 20;
constexpr int kMassBuckets = (0x3F800000 >> kMassShift) + 1;  // w = 1 included
constexpr int kMassCopies = 4;  // interleaved histograms: consecutive tokens rarely wait on one another

int mass_bucket(float w) { return static_cast<int>(std::bit_cast<uint32_t>(w) >> kMassShift); }

// The top-p cut by the mass histogram of every kept weight: one SIMD pass (the weights), a histogram of
// their mass by bucket, and a weighted quickselect over the one bucket where the mass from the top reaches
// the need (the buckets above it hold every larger value). It added about 0.42 ms to sampling a 262,144-token
// row (selecting over all of it took 3 to 8); top_p_threshold's fallback.
float top_p_threshold_by_mass(const float* logit, int64_t vocab, float t, float m, float thr, float top_p,
                              std::vector<float>& scratch) {
  scratch.resize(static_cast<size_t>(vocab));
  float* w = scratch.data();
  passes().fill_weights(logit, nullptr, vocab, t, m, 1.0f, thr, w);
  std::vector<double> mass(kMassBuckets * kMassCopies, 0.0);
  int64_t i = 0;
  for (; i + kMassCopies <= vocab; i += kMassCopies) {
    for (int c = 0; c < kMassCopies; ++c) mass[mass_bucket(w[i + c]) * kMassCopies + c] += w[i + c];
  }
  for (; i < vocab; ++i) mass[mass_bucket(w[i]) * kMassCopies] += w[i];
  double total = 0.0;
  std::vector<double> bucket(kMassBuckets, 0.0);
  for (int b = 0; b < kMassBuckets; ++b) {
    for (int c = 0; c < kMassCopies; ++c) bucket[b] += mass[b * kMassCopies + c];
    total += bucket[b];
  }
  const double need = static_cast<double>(top_p) * total;
  double above = 0.0;
  int cut = 0;  // bucket 0 holds weights that underflowed to 0: reached only when round-off keeps everything
  for (int b = kMassBuckets - 1; b > 0; --b) {
    if (above + bucket[b] >= need) {
      cut = b;
      break;
    }
    above += bucket[b];
  }
  std::vector<float> values;
  for (int64_t j = 0; j < vocab; ++j) {
    if (mass_bucket(w[j]) == cut) {
      const float x = logit[j] / t;
      if (x >= thr) values.push_back(x);
    }
  }
  if (cut == 0) return values.empty() ? thr : *std::min_element(values.begin(), values.end());
  return weighted_upper_threshold(values, m, need - above);
}

// Candidates of the top-p cut: x within kCandidateSpan of the maximum (weights >= ~1e-4 of its weight), at
// most kCandidateCap of them. Over Gemma-3-270M's own logits at T = 0.8, top-p 0.95 a row has a median of 10
// (at most about 500) and they hold the needed mass in every row; at T = 1.3 a median of 62 (at most about
// 5,600), holding it in 9 rows of 10. A flat row (N(0, 3^2) logits: 8 % of the ids) overflows the cap early
// in its pass, which then stops.
constexpr float kCandidateSpan = 9.21f;
constexpr size_t kCandidateCap = 4096;

// Largest value t of the kept x = logit / t (x >= thr) such that the weight exp(x - m) of {x >= t} reaches
// top_p of the kept total: the cut weighted_upper_threshold finds over every kept x. One SIMD pass sums the
// kept weights and gathers the candidates {x >= m - kCandidateSpan}; where their weight reaches the need the
// cut is among them (every x at or above a candidate is one), found by a quickselect over a few values, and
// `kept` (where given) receives the ids the cut keeps, in increasing order. Else the mass histogram finds it
// and `kept` is left empty. Drawing a token from a row of Gemma-3-270M's 262,144 logits at T = 0.8, top-p
// 0.95 (bench/bench_sampling.py, AMD EPYC Zen 4, 2026-12-06): 0.52-0.78 ms with the histogram's cut,
// 0.26-0.27 with this one, 0.15 with chain_verify drawing over the kept ids (sample_kept); 0.15-0.18 without
// top-p.
float top_p_threshold(const float* logit, int64_t vocab, float t, float m, float thr, float top_p,
                      std::vector<float>& scratch, std::vector<int64_t>* kept) {
  scratch.clear();
  std::vector<int64_t> own;
  std::vector<int64_t>& ids = kept != nullptr ? *kept : own;
  ids.clear();
  bool complete = false;
  const float bound = std::max(thr, m - kCandidateSpan);
  const double total =
      passes().sum_exp_above(logit, vocab, t, m, thr, bound, scratch, ids, kCandidateCap, &complete);
  const double need = static_cast<double>(top_p) * total;
  if (complete) {
    double mass = 0.0;
    for (float x : scratch) mass += exp_nonpositive(x - m);
    if (mass >= need) {
      const float cut = weighted_upper_threshold(scratch, m, need);
      // the candidates the cut keeps, x computed as the pass did (x / 1 == x)
      ids.erase(std::remove_if(ids.begin(), ids.end(), [&](int64_t i) { return !(logit[i] / t >= cut); }),
                ids.end());
      return cut;
    }
  }
  ids.clear();
  return top_p_threshold_by_mass(logit, vocab, t, m, thr, top_p, scratch);
}

// Keep-threshold of a sampled row: x = logit / t is kept iff x >= threshold. `kept` (where given): the kept
// ids in increasing order where top-p found them among its candidates (top_p_threshold), else empty.
float filter_threshold(const float* logit, int64_t vocab, float t, float m, int64_t top_k, float top_p,
                       std::vector<float>& scratch, std::vector<int64_t>* kept = nullptr) {
  if (kept != nullptr) kept->clear();
  float thr = -kInf;
  if (top_k > 0 && top_k < vocab) {
    scratch.assign(logit, logit + vocab);
    for (float& v : scratch) v /= t;
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(), std::greater<float>());
    thr = scratch[static_cast<size_t>(top_k - 1)];
  }
  if (top_p < 1.0f) thr = top_p_threshold(logit, vocab, t, m, thr, top_p, scratch, kept);
  return thr;
}

// A row-sized scratch buffer, sized (and zeroed) where a dense pass first needs it: 1 MB a worker at 262,144
// words that greedy draws and draws over few kept ids never touch.
void dense_buffer(std::vector<float>& buffer, int64_t vocab) {
  if (buffer.size() != static_cast<size_t>(vocab)) buffer.resize(static_cast<size_t>(vocab));
}

// Inverse CDF over weights w[r] of the ids kept[r] (increasing): the first id whose float64 running sum
// exceeds u * total, their float64 sum in id order; the last id of positive weight if round-off leaves none;
// -1 where none has weight.
int64_t inverse_cdf_kept(const std::vector<int64_t>& kept, const std::vector<float>& w, double u) {
  double total = 0.0;
  for (size_t r = 0; r < kept.size(); ++r) total += w[r];
  if (!(total > 0.0)) return -1;
  const double target = u * total;
  double run = 0.0;
  for (size_t r = 0; r < kept.size(); ++r) {
    run += w[r];
    if (run > target) return kept[r];
  }
  for (size_t r = kept.size(); r-- > 0;)
    if (w[r] > 0.0f) return kept[r];
  return -1;
}

// The weights max(0, p - q) over a row's kept ids (increasing; p is 0 elsewhere, so they are too) into w,
// p = kept_weight * inv_z; q == nullptr: q = 0, but the weight at `skip` (a one-hot draft's token, -1 for
// none) is 0. Returns their float64 sum.
double fill_kept(const float* logit, const std::vector<int64_t>& kept, float t, float m, float thr,
                 float inv_z, const float* q, int64_t skip, std::vector<float>& w) {
  w.resize(kept.size());
  double total = 0.0;
  for (size_t r = 0; r < kept.size(); ++r) {
    const int64_t i = kept[r];
    float d = kept_weight(logit[i], t, m, thr) * inv_z;
    if (q != nullptr) d -= q[i];
    if (i == skip) d = 0.0f;
    total += w[r] = d > 0.0f ? d : 0.0f;
  }
  return total;
}

// A token drawn from the weights max(0, p - q) over a row's kept ids (fill_kept), falling back to p where
// they have no mass: inverse_cdf's first index whose float64 running sum exceeds u * total, over those ids
// alone (inverse_cdf_kept). w: scratch for the weights.
int64_t sample_kept(const float* logit, const std::vector<int64_t>& kept, float t, float m, float thr,
                    float inv_z, const float* q, int64_t skip, double u, std::vector<float>& w) {
  for (int pass = 0; pass < 2; ++pass) {
    const bool residual = pass == 0;
    fill_kept(logit, kept, t, m, thr, inv_z, residual ? q : nullptr, residual ? skip : -1, w);
    const int64_t token = inverse_cdf_kept(kept, w, u);
    if (token >= 0) return token;
  }
  return kept.back();  // unreachable: p has mass at the row's maximum
}

// Inverse CDF over a row's weights, searched chunk by chunk: first index whose running float64 sum
// exceeds u * total; the last positive index if round-off leaves none.
int64_t inverse_cdf(const float* w, const std::vector<double>& chunk_sums, int64_t vocab, double u) {
  double total = 0.0;
  for (double s : chunk_sums) total += s;
  const double target = u * total;
  double run = 0.0;
  for (size_t c = 0; c < chunk_sums.size(); ++c) {
    if (run + chunk_sums[c] > target) {
      const int64_t begin = static_cast<int64_t>(c) * kChunk;
      const int64_t end = std::min(vocab, begin + kChunk);
      for (int64_t i = begin; i < end; ++i) {
        run += w[i];
        if (run > target) return i;
      }
      break;
    }
    run += chunk_sums[c];
  }
  for (int64_t i = vocab - 1; i >= 0; --i)
    if (w[i] > 0.0f) return i;
  return 0;  // unreachable: p always has mass
}

// How far from 1 a used draft-probability row may sum (validate only; chain_verify, tree_verify): the
// reasons are in specops.ops.chain_verify's docstring, and ops.py applies it on accelerators.
constexpr double kProbSumTolerance = 1e-3;

// ---- row passes over several threads ----

// With fewer requests than threads, a request's row passes are split across threads by chunks of the
// vocabulary (chain_verify, tree_verify). Chunk results are combined in chunk order, so the output does
// not depend on the thread count.
constexpr int64_t kSplitMinChunks = 16;  // below ~32K tokens a row is too short to be worth splitting
constexpr int64_t kSplitGrain = 4;

template <typename Body>
void for_each_chunk(int64_t num_chunks, bool split, const Body& body) {
  if (split && num_chunks >= kSplitMinChunks) {
    at::parallel_for(0, num_chunks, kSplitGrain, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) body(c);
    });
  } else {
    for (int64_t c = 0; c < num_chunks; ++c) body(c);
  }
}

// A target logit row's maximum, or the error for a row that holds NaN / +inf or nothing finite.
inline float checked_row_max(const char* op, const float* logit, int64_t vocab, int64_t b, int64_t j) {
  bool bad = false;
  const float m = passes().scan_row(logit, vocab, &bad);
  TORCH_CHECK_VALUE(!bad, op, ": target_logits[", b, ", ", j, "] contains NaN or +inf");
  TORCH_CHECK_VALUE(m > -kInf, op, ": target_logits[", b, ", ", j, "] has no finite logit");
  return m;
}

// ---- arguments of the sampling ops (messages start with the op's name, as specops/ops/'s) ----

inline void check_logit_dtype(const char* op, const char* name, const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": ", name,
                   " must be float32, bfloat16 or float16");
}

// Per-row tensors: each one-dimensional, of `rows` values of `dtype`; `rule` is the message's rule
// (e.g. "top_k and seed must be [N] int64").
inline void check_per_row(const char* op, std::initializer_list<const at::Tensor*> tensors, int64_t rows,
                          at::ScalarType dtype, const char* rule) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == dtype, op, ": ", rule);
  }
}

// The per-row sampling arguments (temperature, top_k, top_p, seed; shapes and dtypes already checked
// with check_per_row), contiguous and read through pointers. check(r) checks row r's values; the ops
// always do (O(rows), and the row passes rely on them).
struct SamplingRows {
  SamplingRows(const char* op, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
               const at::Tensor& seed)
      : op_(op),
        temperature_t_(temperature.contiguous()),
        top_k_t_(top_k.contiguous()),
        top_p_t_(top_p.contiguous()),
        seed_t_(seed.contiguous()),
        temperature(temperature_t_.data_ptr<float>()),
        top_k(top_k_t_.data_ptr<int64_t>()),
        top_p(top_p_t_.data_ptr<float>()),
        seed(seed_t_.data_ptr<int64_t>()) {}

  void check(int64_t r) const {
    TORCH_CHECK_VALUE(temperature[r] >= 0.0f && std::isfinite(temperature[r]), op_, ": temperature[", r, "] = ",
                      temperature[r], " must be finite and >= 0");
    TORCH_CHECK_VALUE(top_k[r] >= 0, op_, ": top_k[", r, "] = ", top_k[r], " must be >= 0");
    TORCH_CHECK_VALUE(top_p[r] > 0.0f && top_p[r] <= 1.0f, op_, ": top_p[", r, "] = ", top_p[r],
                      " must be in (0, 1]");
  }

 private:
  const char* op_;
  at::Tensor temperature_t_, top_k_t_, top_p_t_, seed_t_;  // what the pointers read

 public:
  const float* temperature;
  const int64_t* top_k;
  const float* top_p;
  const int64_t* seed;
};

}  // namespace
}  // namespace specops
