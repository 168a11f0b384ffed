// sample_without_replacement on the CPU: num_samples distinct tokens per row in draw order from the
// filtered softmax q, and q. Semantics: specops/reference.py.
//
// One pass writes q straight into the output with its per-chunk float64 sums; the draws then run on a
// copy: each is chain_verify's chunked inverse CDF, after which the drawn token's weight is subtracted
// from its chunk's sum and zeroed, so a draw costs one walk over the chunk sums and one chunk, not a
// pass over the row. Rows run in parallel; greedy rows take the largest logits by a partial sort.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "sampling.h"

namespace specops {
namespace {

void sample_row(const float* logit, int64_t vocab, int64_t num_samples, float t, int64_t top_k, float top_p,
                int64_t seed, uint64_t offset, int64_t row, int64_t* tokens, float* probs,
                std::vector<float>& weights, std::vector<float>& scratch, std::vector<int64_t>& order) {
  bool bad = false;
  const float row_max = passes().scan_row(logit, vocab, &bad);
  TORCH_CHECK_VALUE(!bad, "sample_without_replacement: logits[", row, "] contains NaN or +inf");
  TORCH_CHECK_VALUE(row_max > -kInf, "sample_without_replacement: logits[", row, "] has no finite value");
  const float m = row_max / t;
  std::fill(tokens, tokens + num_samples, -1);
  if (t == 0.0f || m == kInf) {  // greedy, or the T -> 0 limit where logits / T overflows
    std::fill(probs, probs + vocab, 0.0f);
    order.resize(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    const auto larger = [logit](int64_t a, int64_t b) {
      return logit[a] > logit[b] || (logit[a] == logit[b] && a < b);
    };
    std::partial_sort(order.begin(), order.begin() + num_samples, order.end(), larger);
    for (int64_t i = 0; i < num_samples && logit[order[i]] > -kInf; ++i) tokens[i] = order[i];
    probs[order[0]] = 1.0f;
    return;
  }
  const bool filtered = (top_k > 0 && top_k < vocab) || top_p < 1.0f;
  const float thr = filtered ? filter_threshold(logit, vocab, t, m, top_k, top_p, scratch) : -kInf;
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<double> sums(static_cast<size_t>(num_chunks));
  double z = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk;
    z += passes().sum_exp(logit + begin, std::min(kChunk, vocab - begin), t, m, thr);
  }
  const float inv_z = static_cast<float>(1.0 / z);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk;
    sums[c] = passes().fill_weights(logit + begin, nullptr, std::min(kChunk, vocab - begin), t, m, inv_z, thr,
                                    probs + begin);
  }
  weights.assign(probs, probs + vocab);
  int64_t left = 0;  // tokens with q > 0 not yet drawn
  for (int64_t c = 0; c < num_chunks && left < num_samples; ++c) {
    const int64_t begin = c * kChunk, end = std::min(vocab, begin + kChunk);
    for (int64_t i = begin; i < end; ++i) left += weights[i] > 0.0f;
  }
  for (int64_t i = 0; i < num_samples && i < left; ++i) {
    const int64_t token = inverse_cdf(weights.data(), sums, vocab,
                                      uniform(seed, offset, i, kStreamWithoutReplacement));
    tokens[i] = token;
    sums[token / kChunk] -= weights[token];
    weights[token] = 0.0f;
  }
}

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
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights, scratch;
    std::vector<int64_t> order;
    for (int64_t r = begin; r < end; ++r) {
      sample_row(x_p + r * vocab, vocab, num_samples, sampling.temperature[r], sampling.top_k[r], sampling.top_p[r],
                 sampling.seed[r], static_cast<uint64_t>(offset), r, tok_p + r * num_samples,
                 prob_p + r * vocab, weights, scratch, order);
    }
  });
  return {tokens, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("sample_without_replacement", &sample_without_replacement_cpu); }

}  // namespace specops
