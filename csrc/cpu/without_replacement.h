// Sequential sampling without replacement from one row, shared by the CPU kernels that draw distinct
// children (sample_without_replacement, stochastic_beam_step). Semantics: specops/reference.py.
//
// One pass writes q straight into the output with its per-chunk float64 sums; the draws then run on a
// copy: each is chain_verify's chunked inverse CDF, after which the drawn token's weight is subtracted
// from its chunk's sum and zeroed, so a draw costs one walk over the chunk sums and one chunk, not a
// pass over the row. Greedy rows take the largest logits by a partial sort.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "sampling.h"

namespace specops {
namespace {

// Draws num_samples tokens (-1 past q's support) and writes q into probs. Returns whether the row is
// greedy (T == 0, or logits / T overflowing float32); `op` names the caller in errors. For a sampled row,
// `weights` ends as q with the drawn tokens zeroed and, when chunk_sums is not null, *chunk_sums as the
// per-chunk float64 sums of q after the draws.
bool sample_row(const char* op, const float* logit, int64_t vocab, int64_t num_samples, float t, int64_t top_k,
                float top_p, int64_t seed, uint64_t offset, int64_t row, int64_t* tokens, float* probs,
                std::vector<float>& weights, std::vector<float>& scratch, std::vector<int64_t>& order,
                std::vector<double>* chunk_sums = nullptr) {
  bool bad = false;
  const float row_max = passes().scan_row(logit, vocab, &bad);
  TORCH_CHECK_VALUE(!bad, op, ": logits[", row, "] contains NaN or +inf");
  TORCH_CHECK_VALUE(row_max > -kInf, op, ": logits[", row, "] has no finite value");
  const float m = row_max / t;
  std::fill(tokens, tokens + num_samples, -1);
  if (t == 0.0f || std::isinf(m)) {  // greedy, or the T -> 0 limit: logits / T overflows (to +-inf)
    std::fill(probs, probs + vocab, 0.0f);
    order.resize(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    const auto larger = [logit](int64_t a, int64_t b) {
      return logit[a] > logit[b] || (logit[a] == logit[b] && a < b);
    };
    std::partial_sort(order.begin(), order.begin() + num_samples, order.end(), larger);
    for (int64_t i = 0; i < num_samples && logit[order[i]] > -kInf; ++i) tokens[i] = order[i];
    probs[order[0]] = 1.0f;
    return true;
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
    weights[token] = 0.0f;
    // Re-summed rather than decremented: a drawn token may hold nearly all of its chunk's mass, and the
    // difference would keep only round-off of what is left.
    const int64_t chunk = token / kChunk, begin = chunk * kChunk, end = std::min(vocab, begin + kChunk);
    sums[chunk] = std::accumulate(weights.begin() + begin, weights.begin() + end, 0.0);
  }
  if (chunk_sums != nullptr) *chunk_sums = std::move(sums);
  return false;
}


}  // namespace
}  // namespace specops
