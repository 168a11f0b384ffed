// tree_verify on the CPU: recursive rejection sampling over a draft tree (RSD, Jeon et al. 2024;
// SpecInfer's multi-step speculative sampling with replacement). Semantics: specops/reference.py.
//
// Per request the walk starts at the root and reads only the rows it reaches. At a node, one pass after
// the row's maximum writes the unnormalized target weights w = exp(x - m) into a residual buffer with
// their mass, so p(x) = w(x) / z needs no normalization pass. With one-hot q (deterministic drafts) a
// rejection zeroes one entry; with draft probabilities it is one SIMD pass max(0, r / R - q / s). The
// emitted token is drawn by the chunked inverse CDF of chain_verify. Requests run in parallel; with
// fewer requests than threads, a request's row passes are split across threads instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sampling.h"

namespace specops {
namespace {

struct Request {
  const float* logits;    // [N, V]
  const int64_t* tokens;  // [N]
  const int64_t* parents; // [N]
  const float* probs;     // [N, V] or nullptr (one-hot q)
  int64_t count;          // valid nodes
  int64_t index;          // b, for messages
  float temperature;
  int64_t top_k;
  float top_p;
  int64_t seed;
};

// Scratch of one worker: the residual, its next value, per-chunk sums, filter scratch, the tree's
// child lists (first child and next sibling, in node order).
struct Scratch {
  std::vector<float> residual, next, filter;
  std::vector<double> chunk_sums, next_sums;
  std::vector<int64_t> first_child, next_sibling;
};

// One request: walks the tree from the root, writes out_tokens / out_nodes and returns the number of
// accepted drafts.
int64_t verify_request(const Request& rq, float* row_max, int64_t vocab, bool replacement, uint64_t offset,
                       bool split, int64_t* out_tokens, int64_t* out_nodes, Scratch& s) {
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  s.chunk_sums.assign(static_cast<size_t>(num_chunks), 0.0);
  s.next_sums.assign(static_cast<size_t>(num_chunks), 0.0);
  s.first_child.assign(static_cast<size_t>(rq.count), -1);
  s.next_sibling.assign(static_cast<size_t>(rq.count), -1);
  for (int64_t c = rq.count - 1; c >= 1; --c) {  // backwards, so each list is in node order
    s.next_sibling[c] = s.first_child[rq.parents[c]];
    s.first_child[rq.parents[c]] = c;
  }
  const float t = rq.temperature;
  int64_t node = 0, depth = 0;
  for (;;) {
    const float* logit = rq.logits + node * vocab;
    if (std::isnan(row_max[node])) row_max[node] = checked_row_max("tree_verify", logit, vocab, rq.index, node);
    const float m = row_max[node] / t;
    if (t == 0.0f || std::isinf(m)) {  // greedy, or the T -> 0 limit: logits / T overflows (to +-inf)
      const int64_t best = passes().find_first(logit, vocab, row_max[node]);
      out_tokens[depth] = best;
      int64_t follow = s.first_child[node];
      while (follow >= 0 && rq.tokens[follow] != best) follow = s.next_sibling[follow];
      if (follow < 0) return depth;
      out_nodes[depth++] = follow;
      node = follow;
      continue;
    }
    const bool filtered = (rq.top_k > 0 && rq.top_k < vocab) || rq.top_p < 1.0f;
    const float thr = filtered ? filter_threshold(logit, vocab, t, m, rq.top_k, rq.top_p, s.filter) : -kInf;
    // One pass: the kept weights w = exp(x - m) into the residual buffer, with their chunk sums. The
    // residual r and its mass R then stand for p_i = r / R, starting at p = w / z (the reference starts
    // at r = softmax, R = 1: the same values up to float rounding).
    for_each_chunk(num_chunks, split, [&](int64_t k) {
      const int64_t begin = k * kChunk;
      s.chunk_sums[k] = passes().fill_weights(logit + begin, nullptr, std::min(kChunk, vocab - begin), t, m, 1.0f,
                                              thr, s.residual.data() + begin);
    });
    double mass = 0.0;
    for (double v : s.chunk_sums) mass += v;
    const float* q = rq.probs != nullptr ? rq.probs + node * vocab : nullptr;
    double left = 1.0;  // q_i = q / left (the mass not yet drawn, without replacement)
    int64_t accepted = -1;
    for (int64_t c = s.first_child[node]; c >= 0; c = s.next_sibling[c]) {
      const int64_t x = rq.tokens[c];
      const double q_x = q != nullptr ? q[x] / left : 1.0;
      if (uniform(rq.seed, offset, c - 1, kStreamAccept) * q_x * mass < s.residual[x]) {
        accepted = c;
        break;
      }
      if (q == nullptr) {  // max(0, p_i - onehot(x)): p_i without x, unless nothing would be left
        const double rest = mass - s.residual[x];
        if (rest > 0.0) {
          s.chunk_sums[x / kChunk] -= s.residual[x];
          s.residual[x] = 0.0f;
          mass = rest;
        }
        continue;
      }
      // max(0, p_i - q_i) = max(0, r / R - q / left) into `next`.
      const float a = static_cast<float>(1.0 / mass), b = static_cast<float>(1.0 / left);
      for_each_chunk(num_chunks, split, [&](int64_t k) {
        const int64_t begin = k * kChunk;
        s.next_sums[k] = passes().update_residual(s.residual.data() + begin, q + begin,
                                                  std::min(kChunk, vocab - begin), a, b, s.next.data() + begin);
      });
      double total = 0.0;
      for (double v : s.next_sums) total += v;
      if (total > 0.0) {  // else the residual has no mass (round-off): keep p_i
        std::swap(s.residual, s.next);
        std::swap(s.chunk_sums, s.next_sums);
        mass = total;
      }
      if (!replacement) left -= q[x];
    }
    if (accepted < 0) {
      out_tokens[depth] = inverse_cdf(s.residual.data(), s.chunk_sums, vocab,
                                      uniform(rq.seed, offset, node, kStreamSample));
      return depth;
    }
    out_tokens[depth] = rq.tokens[accepted];
    out_nodes[depth++] = accepted;
    node = accepted;
  }
}

// The checks every call makes (they keep the walk in bounds): node counts, parents before children,
// draft ids inside the vocabulary.
void check_structure(const int64_t* tokens, const int64_t* parents, const int64_t* counts, int64_t batch,
                     int64_t nodes, int64_t vocab) {
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(counts[b] >= 1 && counts[b] <= nodes, "tree_verify: num_nodes[", b, "] = ", counts[b],
                      " is outside [1, ", nodes, "]");
    for (int64_t n = 1; n < counts[b]; ++n) {
      const int64_t parent = parents[b * nodes + n], token = tokens[b * nodes + n];
      TORCH_CHECK_VALUE(parent >= 0 && parent < n, "tree_verify: parents[", b, ", ", n, "] = ", parent,
                        " must be in [0, ", n, ") (parents come before their children)");
      TORCH_CHECK_VALUE(token >= 0 && token < vocab, "tree_verify: tokens[", b, ", ", n, "] = ", token,
                        " is outside the vocabulary [0, ", vocab, ")");
    }
  }
}

// validate: every valid logit row (NaN / +inf, a finite value) and every draft-probability row of a
// node with children (finite, >= 0, sums to 1), and each child's q > 0 (without replacement: among
// what its earlier siblings left, so a repeated sibling fails too).
void check_values(const float* logits, const float* probs, const int64_t* tokens, const int64_t* parents,
                  const int64_t* counts, int64_t batch, int64_t nodes, int64_t vocab, bool replacement,
                  float* row_max) {
  at::parallel_for(0, batch * nodes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (r % nodes < counts[r / nodes]) {
        row_max[r] = checked_row_max("tree_verify", logits + r * vocab, vocab, r / nodes, r % nodes);
      }
    }
  });
  if (probs == nullptr) return;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<char> has_children(static_cast<size_t>(nodes), 0);
    for (int64_t n = 1; n < counts[b]; ++n) has_children[parents[b * nodes + n]] = 1;
    for (int64_t n = 0; n < counts[b]; ++n) {
      if (!has_children[n]) continue;
      bool bad = false;
      const double sum = passes().scan_probs(probs + (b * nodes + n) * vocab, vocab, &bad);
      TORCH_CHECK_VALUE(!bad, "tree_verify: draft_probs[", b, ", ", n, "] contains NaN, inf or negative values");
      TORCH_CHECK_VALUE(std::abs(sum - 1.0) <= kProbSumTolerance, "tree_verify: draft_probs[", b, ", ", n,
                        "] sums to ", sum, ", not 1 (each row of a node with children must be a distribution)");
    }
    for (int64_t c = 1; c < counts[b]; ++c) {
      const int64_t parent = parents[b * nodes + c], x = tokens[b * nodes + c];
      TORCH_CHECK_VALUE(probs[(b * nodes + parent) * vocab + x] > 0.0f, "tree_verify: tokens[", b, ", ", c,
                        "] = ", x, " has q = 0 under draft_probs[", b, ", ", parent,
                        "] (it could not have been drawn)");
      for (int64_t e = 1; !replacement && e < c; ++e) {
        TORCH_CHECK_VALUE(parents[b * nodes + e] != parent || tokens[b * nodes + e] != x, "tree_verify: nodes ", e,
                          " and ", c, " of request ", b, " are siblings with the same token ", x,
                          " although drawn without replacement");
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_cpu(
    const at::Tensor& target_logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& num_nodes, bool replacement,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    int64_t offset, bool validate) {
  TORCH_CHECK_VALUE(target_logits.dim() == 3, "tree_verify: target_logits must be [B, N, V]");
  const int64_t batch = target_logits.size(0), nodes = target_logits.size(1), vocab = target_logits.size(2);
  TORCH_CHECK_VALUE(nodes >= 1 && vocab >= 1, "tree_verify: target_logits needs N >= 1 and V >= 1");
  for (const at::Tensor* t : {&tokens, &parents}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == batch && t->size(1) == nodes,
                      "tree_verify: tokens and parents must be [B, N] matching target_logits");
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong, "tree_verify: tokens and parents must be int64");
  }
  check_per_row("tree_verify", {&num_nodes, &top_k, &seed}, batch, at::kLong,
                "num_nodes, top_k and seed must be [B] int64");
  check_per_row("tree_verify", {&temperature, &top_p}, batch, at::kFloat, "temperature and top_p must be [B] float32");
  TORCH_CHECK_VALUE(offset >= 0, "tree_verify: offset must be >= 0");
  check_logit_dtype("tree_verify", "target_logits", target_logits);
  const at::Tensor logits = target_logits.to(at::kFloat).contiguous();
  const at::Tensor token_t = tokens.contiguous(), parent_t = parents.contiguous(), count_t = num_nodes.contiguous();
  at::Tensor probs;
  if (draft_probs.has_value()) {
    probs = draft_probs->contiguous();
    TORCH_CHECK_VALUE(probs.dim() == 3 && probs.size(0) == batch && probs.size(1) == nodes && probs.size(2) == vocab,
                      "tree_verify: draft_probs must be [B, N, V] matching target_logits");
    TORCH_CHECK_TYPE(probs.scalar_type() == at::kFloat, "tree_verify: draft_probs must be float32");
  }
  const SamplingRows sampling("tree_verify", temperature, top_k, top_p, seed);
  const int64_t* token_p = token_t.data_ptr<int64_t>();
  const int64_t* parent_p = parent_t.data_ptr<int64_t>();
  const int64_t* count_p = count_t.data_ptr<int64_t>();
  const float* logit_p = logits.data_ptr<float>();
  const float* prob_p = probs.defined() ? probs.data_ptr<float>() : nullptr;
  for (int64_t b = 0; b < batch; ++b) sampling.check(b);
  check_structure(token_p, parent_p, count_p, batch, nodes, vocab);
  std::vector<float> row_max(static_cast<size_t>(batch * nodes), std::numeric_limits<float>::quiet_NaN());
  if (validate) {
    check_values(logit_p, prob_p, token_p, parent_p, count_p, batch, nodes, vocab, replacement, row_max.data());
  }

  auto out_tokens = at::full({batch, nodes}, -1, token_t.options());
  auto out_nodes = at::full({batch, nodes}, -1, token_t.options());
  auto num_accepted = at::zeros({batch}, token_t.options());
  int64_t* out_tok_p = out_tokens.data_ptr<int64_t>();
  int64_t* out_node_p = out_nodes.data_ptr<int64_t>();
  int64_t* acc_p = num_accepted.data_ptr<int64_t>();
  const bool split = batch < at::get_num_threads();
  const auto verify_requests = [&](int64_t begin, int64_t end) {
    Scratch s;
    s.residual.resize(static_cast<size_t>(vocab));
    s.next.resize(static_cast<size_t>(vocab));
    for (int64_t b = begin; b < end; ++b) {
      const Request rq{logit_p + b * nodes * vocab, token_p + b * nodes, parent_p + b * nodes,
                       prob_p == nullptr ? nullptr : prob_p + b * nodes * vocab, count_p[b], b,
                       sampling.temperature[b], sampling.top_k[b], sampling.top_p[b], sampling.seed[b]};
      acc_p[b] = verify_request(rq, row_max.data() + b * nodes, vocab, replacement, static_cast<uint64_t>(offset),
                                split, out_tok_p + b * nodes, out_node_p + b * nodes, s);
    }
  };
  if (split) {
    verify_requests(0, batch);
  } else {
    at::parallel_for(0, batch, 1, verify_requests);
  }
  return {out_tokens, out_nodes, num_accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("tree_verify", &tree_verify_cpu); }

}  // namespace specops
