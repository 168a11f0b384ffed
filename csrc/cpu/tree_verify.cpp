// tree_verify on the CPU: recursive rejection sampling over a draft tree (RSD, Jeon et al. 2024;
// SpecInfer's multi-step speculative sampling with replacement), or traversal verification (scheme
// "traversal", verify_request_traversal). Semantics: specops/reference.py.
//
// Per request the walk starts at the root and reads only the rows it reaches. At a node, one pass after
// the row's maximum writes the unnormalized target weights w = exp(x - m) into a residual buffer with
// their mass, so p(x) = w(x) / z needs no normalization pass. With one-hot q (deterministic drafts) a
// rejection zeroes one entry; with draft probabilities it is one SIMD pass max(0, r / R - q / s). The
// emitted token is drawn by the chunked inverse CDF of chain_verify. Where top-p keeps few ids (found among
// the cut's candidates, sampling.h) the node's residual lives on those ids alone, with no pass over the row
// after the cut's (walk_kept). Requests run in parallel; with fewer requests than threads, a request's row
// passes are split across threads instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
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
  std::vector<int64_t> kept;          // a node's kept ids where top-p found them few (filter_threshold)
  std::vector<float> kept_residual, kept_next;  // the residual on those ids
  std::vector<double> chunk_sums, next_sums;
  std::vector<int64_t> first_child, next_sibling;
  std::vector<std::vector<float>> depth_rows;  // traversal: the residual of the node of each depth,
  std::vector<std::vector<double>> depth_sums;
  std::vector<std::vector<int64_t>> depth_kept;  // and its kept ids where top-p found them few (then the
                                                 // row holds their values alone), else empty
};

// Where x's value sits among the kept ids (increasing; -1: x is not kept).
int64_t kept_slot(const std::vector<int64_t>& ids, int64_t x) {
  const auto at = std::lower_bound(ids.begin(), ids.end(), x);
  return at != ids.end() && *at == x ? at - ids.begin() : -1;
}

// The residual max(0, r * a - q * b) over the kept ids into `next` (r: their values; q: the draft row over
// the vocabulary); returns its float64 sum. The kept counterpart of the passes' update_residual.
double update_residual_kept(const std::vector<int64_t>& ids, const std::vector<float>& r, const float* q,
                            float a, float b, std::vector<float>& next) {
  next.resize(ids.size());
  double total = 0.0;
  for (size_t k = 0; k < ids.size(); ++k) {
    const float d = r[k] * a - q[ids[k]] * b;
    total += next[k] = d > 0.0f ? d : 0.0f;
  }
  return total;
}

// A node's children tried in order where top-p kept few ids (s.kept, increasing): verify_request's rule on
// the residual over those ids alone, p being 0 elsewhere (as max(0, p - q) is then). The same values up to
// float64 round-off of the sums (in id order, not the passes' lanes), no pass over the row. Returns the
// accepted child, or -1 after drawing the emitted token into `token`.
int64_t walk_kept(const Request& rq, const float* logit, const float* q, float t, float m, float thr,
                  int64_t node, uint64_t offset, bool replacement, Scratch& s, int64_t& token) {
  const std::vector<int64_t>& ids = s.kept;
  double mass = fill_kept(logit, ids, t, m, thr, 1.0f, nullptr, -1, s.kept_residual);  // r = w, R = z
  double left = 1.0;  // as verify_request's
  for (int64_t c = s.first_child[node]; c >= 0; c = s.next_sibling[c]) {
    const int64_t x = rq.tokens[c];
    const int64_t j = kept_slot(ids, x);
    const float r_x = j >= 0 ? s.kept_residual[j] : 0.0f;
    const double q_x = q != nullptr ? q[x] / left : 1.0;
    if (uniform(rq.seed, offset, c - 1, kStreamAccept) * q_x * mass < r_x) return c;
    if (q == nullptr) {  // max(0, p_i - onehot(x)): p_i without x, unless nothing would be left
      const double rest = mass - r_x;
      if (rest > 0.0 && j >= 0) {
        s.kept_residual[j] = 0.0f;
        mass = rest;
      }
      continue;
    }
    const float a = static_cast<float>(1.0 / mass), b = static_cast<float>(1.0 / left);
    const double total = update_residual_kept(ids, s.kept_residual, q, a, b, s.kept_next);
    if (total > 0.0) {  // else the residual has no mass (round-off): keep p_i
      std::swap(s.kept_residual, s.kept_next);
      mass = total;
    }
    if (!replacement) left -= q[x];
  }
  token = inverse_cdf_kept(ids, s.kept_residual, uniform(rq.seed, offset, node, kStreamSample));
  TORCH_INTERNAL_ASSERT(token >= 0, "tree_verify: a residual without mass");  // mass stays > 0 above
  return -1;
}

// One request: walks the tree from the root, writes out_tokens / out_nodes and returns the number of
// accepted drafts. One function: the current node, its row and the sibling draws carry across the walk.
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
    s.kept.clear();  // filter_threshold fills it where top-p finds few ids
    const float thr =
        filtered ? filter_threshold(logit, vocab, t, m, rq.top_k, rq.top_p, s.filter, &s.kept) : -kInf;
    const float* q = rq.probs != nullptr ? rq.probs + node * vocab : nullptr;
    if (!s.kept.empty()) {  // top-p kept few ids: the node's residual lives on them alone (p is 0 elsewhere)
      const int64_t accepted =
          walk_kept(rq, logit, q, t, m, thr, node, offset, replacement, s, out_tokens[depth]);
      if (accepted < 0) return depth;
      out_tokens[depth] = rq.tokens[accepted];
      out_nodes[depth++] = accepted;
      node = accepted;
      continue;
    }
    dense_buffer(s.residual, vocab);  // not for greedy or top-p walks
    dense_buffer(s.next, vocab);
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

// Traversal verification of one request (scheme "traversal"; Weng et al., "Traversal Verification for
// Speculative Tree Decoding", NeurIPS 2025, arXiv 2505.12398; semantics and random numbers:
// specops.reference._traversal_verify_request). Node b's target law for its children is r_b / R_b, r_b the
// unnormalized weights exp(x - m) (R = z) until b loses a child, then its residual. Rows are read lazily:
// a node's weight is computed when the walk descends to it, so a row is read (one pass that writes the
// weights and sums them) only for the nodes with children on the paths the walk explores, as the
// recursive walk reads only the rows it reaches. Those nodes are the ancestors of the current candidate,
// one per depth, so a row per depth holds them. A rejection with q is one pass max(0, r * w / R - q / s);
// a one-hot rejection zeroes one entry. Where top-p kept few ids at a node (sampling.h's cut), its row holds
// their values alone and every pass runs over them. Requests whose temperature is 0 go through
// verify_request.
// One function (issue 50: a long kernel says why it stays whole): the walk's candidate, its per-depth rows
// and their sums carry from one iteration to the next, and splitting would pass them all around.
int64_t verify_request_traversal(const Request& rq, float* row_max, int64_t vocab, bool replacement,
                                 uint64_t offset, bool split, int64_t* out_tokens, int64_t* out_nodes, Scratch& s) {
  const int64_t count = rq.count;
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  const float t = rq.temperature;
  const size_t n_nodes = static_cast<size_t>(count);
  s.next_sums.assign(static_cast<size_t>(num_chunks), 0.0);
  std::vector<int64_t> parent(n_nodes, -1), depth(n_nodes, 0), head(n_nodes, -1), sibling(n_nodes, -1);
  for (int64_t c = count - 1; c >= 1; --c) {  // backwards, so each list is in node order
    parent[c] = rq.parents[c];
    sibling[c] = head[parent[c]];
    head[parent[c]] = c;
  }
  int64_t max_depth = 0;
  for (int64_t c = 1; c < count; ++c) max_depth = std::max(max_depth, depth[c] = depth[parent[c]] + 1);
  if (s.depth_rows.size() < static_cast<size_t>(max_depth + 1)) s.depth_rows.resize(max_depth + 1);
  if (s.depth_sums.size() < static_cast<size_t>(max_depth + 1)) s.depth_sums.resize(max_depth + 1);
  if (s.depth_kept.size() < static_cast<size_t>(max_depth + 1)) s.depth_kept.resize(max_depth + 1);

  struct Node {
    bool loaded = false;   // r_b is in the row of its depth
    bool fraction = false; // has lost a child: w = num / den
    double mass = 1.0;     // R_b
    double left = 1.0;     // s_b
    double w = 1.0, num = 0.0, den = 1.0;
  };
  std::vector<Node> node(n_nodes);
  const auto row_of = [&](int64_t n) -> std::vector<float>& { return s.depth_rows[depth[n]]; };
  const auto sums_of = [&](int64_t n) -> std::vector<double>& { return s.depth_sums[depth[n]]; };
  const auto kept_of = [&](int64_t n) -> std::vector<int64_t>& { return s.depth_kept[depth[n]]; };
  // Where n's row holds x's value (-1: nowhere, x is not kept): x itself in a dense row.
  const auto slot_of = [&](int64_t n, int64_t x) -> int64_t {
    const std::vector<int64_t>& ids = kept_of(n);
    return ids.empty() ? x : kept_slot(ids, x);
  };
  // Writes p's weights exp(x / T - m) (kept by top-k / top-p; a point mass where logits / T overflows) into
  // the row of n's depth, with their chunk sums and mass R = z.
  const auto load = [&](int64_t n) -> Node& {
    Node& nd = node[static_cast<size_t>(n)];
    if (nd.loaded) return nd;
    const float* logit = rq.logits + n * vocab;
    if (std::isnan(row_max[n])) row_max[n] = checked_row_max("tree_verify", logit, vocab, rq.index, n);
    std::vector<float>& row = row_of(n);
    std::vector<double>& sums = sums_of(n);
    std::vector<int64_t>& ids = kept_of(n);
    ids.clear();
    const float m = row_max[n] / t;
    const bool filtered = (rq.top_k > 0 && rq.top_k < vocab) || rq.top_p < 1.0f;
    const float thr = !std::isinf(m) && filtered
                          ? filter_threshold(logit, vocab, t, m, rq.top_k, rq.top_p, s.filter, &ids)
                          : -kInf;
    if (!ids.empty()) {  // top-p kept few ids: the row holds their weights alone (p is 0 elsewhere)
      nd.mass = fill_kept(logit, ids, t, m, thr, 1.0f, nullptr, -1, row);
      nd.loaded = true;
      return nd;
    }
    row.resize(static_cast<size_t>(vocab));
    sums.assign(static_cast<size_t>(num_chunks), 0.0);
    if (std::isinf(m)) {
      const int64_t point = passes().find_first(logit, vocab, row_max[n]);
      std::fill(row.begin(), row.end(), 0.0f);
      row[point] = 1.0f;
      sums[point / kChunk] = 1.0;
    } else {
      for_each_chunk(num_chunks, split, [&](int64_t k) {
        const int64_t begin = k * kChunk;
        sums[k] = passes().fill_weights(logit + begin, nullptr, std::min(kChunk, vocab - begin), t, m, 1.0f, thr,
                                        row.data() + begin);
      });
    }
    double z = 0.0;
    for (double v : sums) z += v;
    nd.mass = z;
    nd.loaded = true;
    return nd;
  };
  const auto weight_of = [&](int64_t n) -> double {
    if (n == 0) return 1.0;
    const Node& nd = node[static_cast<size_t>(n)];
    return nd.fraction ? nd.num / nd.den : nd.w;
  };

  int64_t a = 0;
  for (;;) {
    // The candidate: the first leaf, each node's weight w_c = min(1, w_b p_b(x_c) / q_b(x_c)) computed on
    // the way down (a node that has lost a child keeps num / den); a node of weight 0 stands for its subtree.
    a = 0;
    while (head[a] >= 0) {
      const int64_t b = a, c = head[a], x = rq.tokens[c];
      a = c;
      Node& nc = node[static_cast<size_t>(c)];
      if (!nc.fraction) {
        const double w_b = weight_of(b);
        const double q_x = rq.probs != nullptr ? rq.probs[b * vocab + x] / node[b].left : 1.0;
        double pw = 0.0;  // a parent of weight 0 gives weight 0: its row need not be read
        if (w_b != 0.0) {
          const Node& nb = load(b);
          const int64_t slot = slot_of(b, x);
          pw = slot < 0 ? 0.0 : w_b * (static_cast<double>(row_of(b)[slot]) / nb.mass);
        }
        nc.w = pw >= q_x ? 1.0 : pw / q_x;
      }
      if (weight_of(c) == 0.0) break;
    }
    if (a == 0) break;
    const Node& cand = node[static_cast<size_t>(a)];
    const double u = uniform(rq.seed, offset, a - 1, kStreamAccept);
    if (cand.fraction ? u * cand.den < cand.num : u < cand.w) break;
    // Reject a: remove it and update its parent's target.
    const int64_t b = parent[a], x = rq.tokens[a];
    head[b] = sibling[a];
    Node& pb = load(b);
    std::vector<float>& row = row_of(b);
    const double w_b = weight_of(b);
    double mass = 0.0;
    const std::vector<int64_t>& ids = kept_of(b);
    if (rq.probs == nullptr) {  // max(0, w p - onehot(x)): w p without x
      const int64_t slot = slot_of(b, x);
      const float r_x = slot < 0 ? 0.0f : row[slot];
      mass = w_b * (pb.mass - r_x) / pb.mass;
      if (mass > 0.0 && slot >= 0) {
        if (ids.empty()) sums_of(b)[x / kChunk] -= r_x;
        row[slot] = 0.0f;
        pb.mass -= r_x;
      }
    } else if (!ids.empty()) {  // the same residual over the kept ids
      const float* q = rq.probs + b * vocab;
      const float scale_r = static_cast<float>(w_b / pb.mass), scale_q = static_cast<float>(1.0 / pb.left);
      mass = update_residual_kept(ids, row, q, scale_r, scale_q, s.kept_next);
      if (mass > 0.0) {  // else the residual has no mass (round-off): keep r_b
        row.swap(s.kept_next);
        pb.mass = mass;
      }
      if (!replacement) pb.left -= q[x];
    } else {
      const float* q = rq.probs + b * vocab;
      const float scale_r = static_cast<float>(w_b / pb.mass), scale_q = static_cast<float>(1.0 / pb.left);
      s.next.resize(static_cast<size_t>(vocab));
      for_each_chunk(num_chunks, split, [&](int64_t k) {
        const int64_t begin = k * kChunk;
        s.next_sums[k] = passes().update_residual(row.data() + begin, q + begin, std::min(kChunk, vocab - begin),
                                                  scale_r, scale_q, s.next.data() + begin);
      });
      for (double v : s.next_sums) mass += v;
      if (mass > 0.0) {  // else the residual has no mass (round-off): keep r_b
        row.swap(s.next);
        sums_of(b).swap(s.next_sums);
        s.next_sums.assign(static_cast<size_t>(num_chunks), 0.0);
        pb.mass = mass;
      }
      if (!replacement) pb.left -= q[x];
    }
    if (b != 0) {
      const double den = mass + 1.0 - w_b;
      pb.fraction = true;
      pb.num = den > 0.0 ? mass : 0.0;
      pb.den = den > 0.0 ? den : 1.0;
    }
  }
  // Keep the path to a, and emit from r_a.
  for (int64_t n = a; n != 0; n = parent[n]) {
    out_tokens[depth[n] - 1] = rq.tokens[n];
    out_nodes[depth[n] - 1] = n;
  }
  load(a);
  const double u = uniform(rq.seed, offset, a, kStreamSample);
  const std::vector<int64_t>& ids = kept_of(a);
  out_tokens[depth[a]] = ids.empty() ? inverse_cdf(row_of(a).data(), sums_of(a), vocab, u)
                                     : inverse_cdf_kept(ids, row_of(a), u);
  TORCH_INTERNAL_ASSERT(out_tokens[depth[a]] >= 0, "tree_verify: a residual without mass");
  return depth[a];
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
  parallel_rows(batch * nodes, [&](int64_t begin, int64_t end, int64_t& r) {
    for (r = begin; r < end; ++r) {
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
    int64_t offset, bool validate, c10::string_view scheme) {
  TORCH_CHECK_VALUE(scheme == "recursive" || scheme == "traversal",
                    "tree_verify: scheme must be 'recursive' or 'traversal', got '", std::string(scheme), "'");
  const bool traversal = scheme == "traversal";
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
  const auto verify_requests = [&](int64_t begin, int64_t end, int64_t& b) {
    Scratch s;  // the dense residual buffers are sized where a walk first needs them
    for (b = begin; b < end; ++b) {
      const Request rq{logit_p + b * nodes * vocab, token_p + b * nodes, parent_p + b * nodes,
                       prob_p == nullptr ? nullptr : prob_p + b * nodes * vocab, count_p[b], b,
                       sampling.temperature[b], sampling.top_k[b], sampling.top_p[b], sampling.seed[b]};
      const auto verify = traversal && rq.temperature > 0.0f ? verify_request_traversal : verify_request;
      acc_p[b] = verify(rq, row_max.data() + b * nodes, vocab, replacement, static_cast<uint64_t>(offset), split,
                        out_tok_p + b * nodes, out_node_p + b * nodes, s);
    }
  };
  if (split) {
    int64_t b = 0;
    verify_requests(0, batch, b);
  } else {
    parallel_rows(batch, verify_requests);
  }
  return {out_tokens, out_nodes, num_accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("tree_verify", &tree_verify_cpu); }

}  // namespace specops
