// sample_without_replacement on the CPU: num_samples distinct tokens per row in draw order from the
// filtered softmax q, and q (the row sampler is without_replacement.h). Semantics: specops/reference.py.
// Rows run in parallel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "without_replacement.h"

namespace specops {
namespace {

std::tuple<at::Tensor, at::Tensor> sample_without_replacement_cpu(const at::Tensor& logits, int64_t num_samples,
                                                                  const at::Tensor& temperature,
                                                                  const at::Tensor& top_k, const at::Tensor& top_p,
                                                                  const at::Tensor& seed, int64_t offset,
                                                                  bool /*validate: every row is read, and checked*/) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "sample_without_replacement: logits must be [N, V]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK_VALUE(vocab >= 1, "sample_without_replacement: logits has no columns");
  TORCH_CHECK_VALUE(num_samples >= 1 && num_samples <= vocab, "sample_without_replacement: num_samples must be in [1, ",
                    vocab, "], got ", num_samples);
  check_per_row("sample_without_replacement", {&top_k, &seed}, rows, at::kLong, "top_k and seed must be [N] int64");
  check_per_row("sample_without_replacement", {&temperature, &top_p}, rows, at::kFloat,
                "temperature and top_p must be [N] float32");
  TORCH_CHECK_VALUE(offset >= 0, "sample_without_replacement: offset must be >= 0");
  check_logit_dtype("sample_without_replacement", "logits", logits);
  const at::Tensor x = logits.to(at::kFloat).contiguous();
  const SamplingRows sampling("sample_without_replacement", temperature, top_k, top_p, seed);
  for (int64_t r = 0; r < rows; ++r) sampling.check(r);
  auto tokens = at::empty({rows, num_samples}, seed.options().dtype(at::kLong));
  auto probs = at::empty({rows, vocab}, x.options());
  const float* x_p = x.data_ptr<float>();
  int64_t* tok_p = tokens.data_ptr<int64_t>();
  float* prob_p = probs.data_ptr<float>();
  parallel_rows(rows, [&](int64_t begin, int64_t end, int64_t& r) {
    std::vector<float> weights, scratch;
    std::vector<int64_t> order;
    for (r = begin; r < end; ++r) {
      sample_row("sample_without_replacement", x_p + r * vocab, vocab, num_samples, sampling.temperature[r],
                 sampling.top_k[r], sampling.top_p[r], sampling.seed[r], static_cast<uint64_t>(offset), r,
                 tok_p + r * num_samples, prob_p + r * vocab, weights, scratch, order);
    }
  });
  return {tokens, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("sample_without_replacement", &sample_without_replacement_cpu); }

}  // namespace specops
