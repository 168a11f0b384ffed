// ensemble_logits on the CPU: the logits of an ensemble of models' next-token distributions, for
// chain_verify / tree_verify / sampling to consume like one model's. Semantics: specops/reference.py.
//
// Per row: each member's maximum (one scan, which also rejects NaN / +inf) and, for the weighted
// ensemble, its softmax normalizer (one pass, from cache); then one combine pass that reads every member
// once per vocabulary chunk and writes the ensemble row. Rows, members and chunks run in parallel; every
// per-row reduction is combined in a fixed order, so the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "sampling.h"

#define SPECOPS_ISA_HEADER "ensemble_simd.h"
#include "per_isa.h"
#undef SPECOPS_ISA_HEADER

namespace specops {
namespace {

constexpr int64_t kWeighted = 0;
constexpr int64_t kContrastive = 1;
constexpr int64_t kCombineChunk = 16384;  // vocabulary entries per combine task
constexpr double kWeightSumTolerance = 1e-4;

struct CombinePasses {
  void (*weighted)(const float* const*, int64_t, const float*, const float*, int64_t, float*);
  int64_t (*contrastive)(const float*, const float*, float, float, float, float, int64_t, float*);
};

#define SPECOPS_COMBINE(ns) CombinePasses{ns::weighted, ns::contrastive}

const CombinePasses& combine_passes() {
  static const CombinePasses selected = [] {
    switch (cpu_isa()) {
#ifdef SPECOPS_X86_DISPATCH
      case Isa::avx512: return SPECOPS_COMBINE(avx512);
      case Isa::avx2: return SPECOPS_COMBINE(avx2);
#endif
      default: return SPECOPS_COMBINE(base);
    }
  }();
  return selected;
}

at::Tensor ensemble_logits_cpu(at::TensorList members, const at::Tensor& weights, int64_t mode, double mu,
                               double alpha, bool validate) {
  const char* op = "ensemble_logits";
  const int64_t count = static_cast<int64_t>(members.size());
  TORCH_CHECK_VALUE(mode == kWeighted || mode == kContrastive, op, ": mode must be 0 (weighted) or 1 (contrastive)");
  TORCH_CHECK_VALUE(count >= 1, op, ": needs at least one member");
  TORCH_CHECK_VALUE(mode != kContrastive || count == 2, op, ": a contrastive ensemble has exactly 2 members "
                    "(expert, amateur), got ", count);
  const at::Tensor& first = members[0];
  TORCH_CHECK_VALUE(first.dim() >= 1 && first.size(-1) >= 1, op, ": members must be [..., V] with V >= 1");
  for (int64_t m = 0; m < count; ++m) {
    TORCH_CHECK_VALUE(members[m].sizes() == first.sizes(), op, ": member ", m, " has shape ", members[m].sizes(),
                      ", member 0 has ", first.sizes());
    TORCH_CHECK_VALUE(members[m].device().is_cpu(), op, ": member ", m, " is not on the CPU");
    check_logit_dtype(op, "members", members[m]);
  }
  const int64_t vocab = first.size(-1);
  const int64_t rows = first.numel() / vocab;
  std::vector<at::Tensor> data(static_cast<size_t>(count));
  std::vector<const float*> ptr(static_cast<size_t>(count));
  for (int64_t m = 0; m < count; ++m) {
    data[m] = members[m].to(at::kFloat).contiguous();
    ptr[m] = data[m].data_ptr<float>();
  }
  std::vector<double> weight(static_cast<size_t>(count), 1.0);
  if (mode == kWeighted) {
    TORCH_CHECK_VALUE(weights.dim() == 1 && weights.size(0) == count, op, ": weights must be [", count,
                      "] (one per member)");
    TORCH_CHECK_TYPE(weights.scalar_type() == at::kFloat, op, ": weights must be float32");
    const at::Tensor w = weights.contiguous();
    double total = 0.0;
    for (int64_t m = 0; m < count; ++m) {
      weight[m] = w.data_ptr<float>()[m];
      TORCH_CHECK_VALUE(std::isfinite(weight[m]) && weight[m] >= 0.0, op, ": weights must be finite and >= 0, got ",
                        weight[m], " for member ", m);
      total += weight[m];
    }
    TORCH_CHECK_VALUE(std::abs(total - 1.0) <= kWeightSumTolerance, op, ": weights must sum to 1, got ", total);
  } else {
    TORCH_CHECK_VALUE(std::isfinite(mu) && mu >= 0.0, op, ": mu must be finite and >= 0, got ", mu);
    TORCH_CHECK_VALUE(alpha >= 0.0 && alpha < 1.0, op, ": alpha must be in [0, 1), got ", alpha);
  }
  auto out = at::empty(first.sizes(), first.options().dtype(at::kFloat));
  if (rows == 0) return out;
  float* out_p = out.data_ptr<float>();

  // Phase 1: each (row, member)'s maximum and (weighted) softmax normalizer.
  const int64_t pairs = rows * count;
  std::vector<float> row_max(static_cast<size_t>(pairs));
  std::vector<double> row_sum(static_cast<size_t>(pairs), 1.0);
  std::vector<char> bad(static_cast<size_t>(pairs));
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r = p / count, m = p % count;
      const float* x = ptr[m] + r * vocab;
      bool b = false;
      row_max[p] = passes().scan_row(x, vocab, &b);
      bad[p] = b;
      if (!b && mode == kWeighted && row_max[p] > -kInf) row_sum[p] = passes().sum_exp(x, vocab, 1.0f, row_max[p], -kInf);
    }
  });
  (void)validate;  // every value is checked: the scan above is needed anyway
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK_VALUE(!bad[p], op, ": member ", p % count, ", row ", p / count, " contains NaN or +inf");
    TORCH_CHECK_VALUE(row_max[p] > -kInf, op, ": member ", p % count, ", row ", p / count, " has no finite logit");
  }

  // Phase 2: combine, by (row, vocabulary chunk).
  const int64_t chunks = (vocab + kCombineChunk - 1) / kCombineChunk;
  std::vector<int64_t> finite(static_cast<size_t>(rows * chunks));
  const float log_alpha = alpha > 0.0 ? static_cast<float>(std::log(alpha)) : -kInf;
  const auto combine = [&](int64_t r, int64_t c, float amateur_mu, bool with_amateur) {
    const int64_t begin = c * kCombineChunk, len = std::min(kCombineChunk, vocab - begin);
    float* dst = out_p + r * vocab + begin;
    if (mode == kWeighted) {
      std::vector<float> top(static_cast<size_t>(count)), add(static_cast<size_t>(count));
      std::vector<const float*> src(static_cast<size_t>(count));
      for (int64_t m = 0; m < count; ++m) {
        const int64_t p = r * count + m;
        top[m] = row_max[p];
        add[m] = weight[m] > 0.0 ? static_cast<float>(std::log(weight[m]) - std::log(row_sum[p])) : -kInf;
        src[m] = ptr[m] + r * vocab + begin;
      }
      combine_passes().weighted(src.data(), count, top.data(), add.data(), len, dst);
      return int64_t{1};  // the weighted ensemble always has a finite token (every member row has one)
    }
    const float* e = ptr[0] + r * vocab + begin;
    const float* a = with_amateur ? ptr[1] + r * vocab + begin : e;
    return combine_passes().contrastive(e, a, row_max[r * 2], with_amateur ? row_max[r * 2 + 1] : row_max[r * 2],
                                        amateur_mu, log_alpha, len, dst);
  };
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) finite[t] = combine(t / chunks, t % chunks, static_cast<float>(mu), true);
  });
  if (mode == kContrastive) {
    // A row where no token is both plausible for the expert and known to the amateur (members with
    // different vocabularies) falls back to the expert's plausible tokens alone.
    for (int64_t r = 0; r < rows; ++r) {
      int64_t total = 0;
      for (int64_t c = 0; c < chunks; ++c) total += finite[r * chunks + c];
      if (total == 0)
        for (int64_t c = 0; c < chunks; ++c) combine(r, c, 0.0f, false);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("ensemble_logits", &ensemble_logits_cpu); }

}  // namespace specops
