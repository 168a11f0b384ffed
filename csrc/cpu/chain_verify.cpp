// chain_verify on the CPU: speculative-sampling verification of a chain of drafts
// (Leviathan et al. 2023; Chen et al. 2023). Semantics: specops/reference.py.
//
// Per request the chain is walked in order and a row's softmax statistics are computed only when the
// walk reaches it, so a request rejected at draft j reads logit rows 0..j (plus one cheap scan of
// every row for NaN/+inf and its maximum). The recovered token is drawn by inverse CDF over the
// residual; chunk sums make the search touch one chunk instead of the whole vocabulary. Requests run
// in parallel. The row passes (row_simd.h, through sampling.h) are written on 16-lane vectors
// and built for AVX-512, AVX2 and a baseline; the running CPU's build is chosen once.
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


struct RowParams {
  int64_t index;
  int64_t num_draft;
  float temperature;
  int64_t top_k;
  float top_p;
  int64_t seed;
};

// One request: walks the chain, writes out[0..K] and returns the number of accepted drafts.
int64_t verify_row(const float* logits, const int64_t* drafts, const float* probs, float* row_max,
                   int64_t vocab, const RowParams& rp, uint64_t offset, bool split, int64_t* out,
                   std::vector<float>& weights, std::vector<float>& scratch) {
  const float t = rp.temperature;
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<double> chunk_sums(static_cast<size_t>(num_chunks));
  std::vector<int64_t> kept;  // a position's kept ids where top-p found them few (filter_threshold)
  for (int64_t j = 0;; ++j) {
    const float* logit = logits + j * vocab;
    const bool has_draft = j < rp.num_draft;
    const int64_t draft = has_draft ? drafts[j] : -1;
    if (std::isnan(row_max[j])) row_max[j] = checked_row_max("chain_verify", logit, vocab, rp.index, j);
    // Greedy at T = 0, and where the largest logit / T overflows (to +inf, or to -inf with every other one):
    // that is the T -> 0 limit, a point mass on the argmax.
    const float m = row_max[j] / t;
    if (t == 0.0f || std::isinf(m)) {
      const float best = row_max[j];
      const int64_t arg = passes().find_first(logit, vocab, best);
      out[j] = has_draft && draft == arg ? draft : arg;
      if (has_draft && draft == arg) continue;
      return j;
    }
    const bool filtered = (rp.top_k > 0 && rp.top_k < vocab) || rp.top_p < 1.0f;
    const float thr =
        filtered ? filter_threshold(logit, vocab, t, m, rp.top_k, rp.top_p, scratch, &kept) : -kInf;
    // Where top-p keeps few tokens, the normalizer and the draw read those alone: the same sums up to float64
    // round-off (in id order, not the passes' lanes). 8 rows of Gemma-3-270M at T = 0.8, top-p 0.95 took
    // 1.4-1.9 ms before, 0.53-0.56 so (bench/bench_sampling.py, AMD EPYC Zen 4).
    double z = 0.0;
    if (!kept.empty()) {
      for (int64_t i : kept) z += kept_weight(logit[i], t, m, thr);
    } else {
      for_each_chunk(num_chunks, split, [&](int64_t c) {
        const int64_t begin = c * kChunk;
        chunk_sums[c] = passes().sum_exp(logit + begin, std::min(kChunk, vocab - begin), t, m, thr);
      });
      for (double s : chunk_sums) z += s;
    }
    const float inv_z = static_cast<float>(1.0 / z);
    const float* q = nullptr;
    if (has_draft) {
      const float p = kept_weight(logit[draft], t, m, thr) * inv_z;
      const float q_draft = probs != nullptr ? probs[j * vocab + draft] : 1.0f;
      if (uniform(rp.seed, offset, j, kStreamAccept) * q_draft < static_cast<double>(p)) {
        out[j] = draft;
        continue;
      }
      q = probs != nullptr ? probs + j * vocab : nullptr;
    }
    const double u = uniform(rp.seed, offset, j, kStreamSample);
    if (!kept.empty()) {
      const int64_t skip = has_draft && probs == nullptr ? draft : -1;  // one-hot q: the draft is out
      out[j] = sample_kept(logit, kept, t, m, thr, inv_z, q, skip, u, scratch);
      return j;
    }
    // Recovered token from max(0, p - q) (bonus: q = 0), falling back to p if that has no mass.
    dense_buffer(weights, vocab);
    bool fallback = false;
    for (int pass = 0; pass < 2; ++pass) {
      const float* qq = fallback ? nullptr : q;
      double total = 0.0;
      for_each_chunk(num_chunks, split, [&](int64_t c) {
        const int64_t begin = c * kChunk, len = std::min(kChunk, vocab - begin);
        chunk_sums[c] = passes().fill_weights(logit + begin, qq == nullptr ? nullptr : qq + begin, len, t, m,
                                              inv_z, thr, weights.data() + begin);
      });
      if (has_draft && probs == nullptr && !fallback) {  // one-hot q: the residual is p without the draft
        chunk_sums[draft / kChunk] -= weights[draft];
        weights[draft] = 0.0f;
      }
      for (double s : chunk_sums) total += s;
      if (total > 0.0 || fallback) break;
      fallback = true;
    }
    out[j] = inverse_cdf(weights.data(), chunk_sums, vocab, u);
    return j;
  }
}

// Block verification of one request (scheme "block"; Sun et al., ICLR 2025, arXiv 2403.10444; semantics:
// specops.reference._block_verify_row). A forward pass over the drafts gives the weights W_k; the walk then
// goes back from the longest prefix and computes a residual's mass only at the positions it reaches, so a
// chain kept whole reads each row once for its softmax normalizer, as token-level verification does.
// Greedy requests (T = 0) go through verify_row. One function: both passes share the weights W_k and the
// rows' normalizers, which a split would hand around.
int64_t verify_row_block(const float* logits, const int64_t* drafts, const float* probs, float* row_max,
                         int64_t vocab, const RowParams& rp, uint64_t offset, bool split, int64_t* out,
                         std::vector<float>& weights, std::vector<float>& scratch) {
  const float t = rp.temperature;
  const int64_t n = rp.num_draft;
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<double> chunk_sums(static_cast<size_t>(num_chunks));
  struct Stats {
    float m = 0.0f, thr = -kInf, inv_z = 1.0f;
    int64_t point = -1;  // >= 0: logits / T overflows and p is a point mass there
    bool ready = false;
    std::vector<int64_t> kept;  // the kept ids where top-p found them few (filter_threshold), else empty
  };
  std::vector<Stats> stats(static_cast<size_t>(n + 1));
  const auto row_stats = [&](int64_t j) -> const Stats& {
    Stats& s = stats[static_cast<size_t>(j)];
    if (s.ready) return s;
    const float* logit = logits + j * vocab;
    if (std::isnan(row_max[j])) row_max[j] = checked_row_max("chain_verify", logit, vocab, rp.index, j);
    s.m = row_max[j] / t;
    s.ready = true;
    if (std::isinf(s.m)) {
      s.point = passes().find_first(logit, vocab, row_max[j]);
      return s;
    }
    const bool filtered = (rp.top_k > 0 && rp.top_k < vocab) || rp.top_p < 1.0f;
    s.thr = filtered ? filter_threshold(logit, vocab, t, s.m, rp.top_k, rp.top_p, scratch, &s.kept) : -kInf;
    if (!s.kept.empty()) {  // the normalizer over the kept ids alone, as verify_row's
      double z = 0.0;
      for (int64_t i : s.kept) z += kept_weight(logit[i], t, s.m, s.thr);
      s.inv_z = static_cast<float>(1.0 / z);
      return s;
    }
    for_each_chunk(num_chunks, split, [&](int64_t c) {
      const int64_t begin = c * kChunk;
      chunk_sums[c] = passes().sum_exp(logit + begin, std::min(kChunk, vocab - begin), t, s.m, s.thr);
    });
    double z = 0.0;
    for (double v : chunk_sums) z += v;
    s.inv_z = static_cast<float>(1.0 / z);
    return s;
  };
  const auto p_at = [&](int64_t j, int64_t token) -> float {
    const Stats& s = row_stats(j);
    if (s.point >= 0) return token == s.point ? 1.0f : 0.0f;
    return kept_weight(logits[j * vocab + token], t, s.m, s.thr) * s.inv_z;
  };
  // weights <- max(0, W p_j - q_j) (w_scale = W; q = 0 at the bonus position j = n); returns its mass. Where
  // top-p kept few ids at j, the residual is on those alone: `sparse` then points at them, their weights in
  // `kept_weights` (p, and so the residual, is 0 elsewhere).
  const std::vector<int64_t>* sparse = nullptr;
  std::vector<float> kept_weights;
  const auto fill_residual = [&](int64_t j, double w_scale, bool subtract_q) -> double {
    const Stats& s = row_stats(j);
    const float* logit = logits + j * vocab;
    const float* q = subtract_q && probs != nullptr ? probs + j * vocab : nullptr;
    const float scale = static_cast<float>(w_scale);
    sparse = s.kept.empty() ? nullptr : &s.kept;
    if (sparse != nullptr) {
      const int64_t skip = subtract_q && probs == nullptr ? drafts[j] : -1;  // one-hot q: 0 at the draft
      return fill_kept(logit, s.kept, t, s.m, s.thr, s.inv_z * scale, q, skip, kept_weights);
    }
    dense_buffer(weights, vocab);
    if (s.point >= 0) {
      std::fill(weights.begin(), weights.end(), 0.0f);
      std::fill(chunk_sums.begin(), chunk_sums.end(), 0.0);
      float v = scale - (q != nullptr ? q[s.point] : (subtract_q && drafts[j] == s.point ? 1.0f : 0.0f));
      weights[s.point] = v > 0.0f ? v : 0.0f;
      chunk_sums[s.point / kChunk] = weights[s.point];
    } else {
      const float inv_z = s.inv_z * scale;
      for_each_chunk(num_chunks, split, [&](int64_t c) {
        const int64_t begin = c * kChunk, len = std::min(kChunk, vocab - begin);
        chunk_sums[c] = passes().fill_weights(logit + begin, q == nullptr ? nullptr : q + begin, len, t, s.m,
                                              inv_z, s.thr, weights.data() + begin);
      });
      if (subtract_q && probs == nullptr) {  // one-hot q: W p(d) <= 1, so the residual is 0 at the draft
        chunk_sums[drafts[j] / kChunk] -= weights[drafts[j]];
        weights[drafts[j]] = 0.0f;
      }
    }
    double total = 0.0;
    for (double v : chunk_sums) total += v;
    return total;
  };

  // Forward: W_0 = 1, W_k = min(1, W_{k-1} p(x_k) / q(x_k)); past the first W_k = 0 nothing can be kept.
  std::vector<double> w(static_cast<size_t>(n + 1), 1.0);
  int64_t top = n;
  for (int64_t k = 1; k <= n; ++k) {
    const int64_t d = drafts[k - 1];
    const double pw = w[k - 1] * static_cast<double>(p_at(k - 1, d));
    const double q = probs != nullptr ? static_cast<double>(probs[(k - 1) * vocab + d]) : 1.0;
    w[k] = pw >= q ? 1.0 : pw / q;
    if (w[k] == 0.0) {
      top = k - 1;
      break;
    }
  }
  // Backward: keep k drafts when u_k (S_k + 1 - W_k) < S_k (u_n < W_n at the end of the chain). S_k <= W_k,
  // so that probability S_k / (S_k + 1 - W_k) is at most W_k: where u_k >= W_k the residual is not computed.
  int64_t kept = 0;
  double mass = -1.0;  // the residual in `weights` belongs to position `kept` once mass >= 0
  for (int64_t k = top; k >= 1; --k) {
    const double u = uniform(rp.seed, offset, k - 1, kStreamAccept);
    if (k == n || u >= w[k]) {
      if (u < w[k]) {
        kept = k;
        break;
      }
      continue;
    }
    const double s = fill_residual(k, w[k], true);
    if (u * (s + 1.0 - w[k]) < s) {
      kept = k;
      mass = s;
      break;
    }
  }
  if (kept == n) {
    mass = fill_residual(n, 1.0, false);
  } else if (mass < 0.0) {  // kept == 0: the token-level residual max(0, p - q) at the first position
    mass = fill_residual(0, 1.0, true);
  }
  if (!(mass > 0.0)) fill_residual(kept, 1.0, false);  // no residual mass (round-off): p instead
  for (int64_t j = 0; j < kept; ++j) out[j] = drafts[j];
  const double u = uniform(rp.seed, offset, kept, kStreamSample);
  out[kept] = sparse != nullptr ? inverse_cdf_kept(*sparse, kept_weights, u)
                                : inverse_cdf(weights.data(), chunk_sums, vocab, u);
  TORCH_INTERNAL_ASSERT(out[kept] >= 0, "chain_verify: a residual without mass");  // p has mass above
  return kept;
}

std::tuple<at::Tensor, at::Tensor> chain_verify_cpu(const at::Tensor& target_logits,
                                                    const at::Tensor& draft_tokens,
                                                    const std::optional<at::Tensor>& draft_probs,
                                                    const at::Tensor& num_draft, const at::Tensor& temperature,
                                                    const at::Tensor& top_k, const at::Tensor& top_p,
                                                    const at::Tensor& seed, int64_t offset, bool validate,
                                                    c10::string_view scheme) {
  TORCH_CHECK_VALUE(target_logits.dim() == 3, "chain_verify: target_logits must be [B, K+1, V]");
  const int64_t batch = target_logits.size(0), k1 = target_logits.size(1), vocab = target_logits.size(2);
  TORCH_CHECK_VALUE(k1 >= 1 && vocab >= 1, "chain_verify: target_logits needs K+1 >= 1 and V >= 1");
  TORCH_CHECK_VALUE(draft_tokens.dim() == 2 && draft_tokens.size(0) == batch && draft_tokens.size(1) == k1 - 1,
                    "chain_verify: draft_tokens must be [B, K] matching target_logits [B, K+1, V]");
  TORCH_CHECK_TYPE(draft_tokens.scalar_type() == at::kLong, "chain_verify: draft_tokens must be int64");
  check_per_row("chain_verify", {&num_draft, &top_k, &seed}, batch, at::kLong,
                "num_draft, top_k and seed must be [B] int64");
  check_per_row("chain_verify", {&temperature, &top_p}, batch, at::kFloat,
                "temperature and top_p must be [B] float32");
  TORCH_CHECK_VALUE(offset >= 0, "chain_verify: offset must be >= 0");
  TORCH_CHECK_VALUE(scheme == "token" || scheme == "block", "chain_verify: scheme must be 'token' or 'block', got '",
                    std::string(scheme), "'");
  const bool block = scheme == "block";
  check_logit_dtype("chain_verify", "target_logits", target_logits);
  const at::Tensor logits = target_logits.to(at::kFloat).contiguous();
  const at::Tensor drafts = draft_tokens.contiguous();
  at::Tensor probs;
  if (draft_probs.has_value()) {
    probs = draft_probs->contiguous();
    TORCH_CHECK_VALUE(probs.dim() == 3 && probs.size(0) == batch && probs.size(1) == k1 - 1 &&
                          probs.size(2) == vocab,
                      "chain_verify: draft_probs must be [B, K, V] matching target_logits");
    TORCH_CHECK_TYPE(probs.scalar_type() == at::kFloat, "chain_verify: draft_probs must be float32");
  }
  const auto nd = num_draft.contiguous();
  const int64_t* nd_p = nd.data_ptr<int64_t>();
  const SamplingRows sampling("chain_verify", temperature, top_k, top_p, seed);
  const int64_t* draft_p = drafts.data_ptr<int64_t>();
  const float* logit_p = logits.data_ptr<float>();
  const float* prob_p = probs.defined() ? probs.data_ptr<float>() : nullptr;

  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(nd_p[b] >= 0 && nd_p[b] <= k1 - 1, "chain_verify: num_draft[", b, "] = ", nd_p[b],
                      " is outside [0, ", k1 - 1, "]");
    sampling.check(b);
    for (int64_t j = 0; j < nd_p[b]; ++j) {  // positions past num_draft are ignored (e.g. -1 padding)
      const int64_t d = draft_p[b * (k1 - 1) + j];
      TORCH_CHECK_VALUE(d >= 0 && d < vocab, "chain_verify: draft_tokens[", b, ", ", j, "] = ", d,
                        " is outside the vocabulary [0, ", vocab, ")");
    }
  }

  // validate: one scan of every logit row (its maximum, NaN / +inf) and every draft-probability row
  // (NaN / inf / negative entries, and its sum) up front, so bad values raise wherever they are; the
  // sums are checked for the used rows only (positions < num_draft). Otherwise rows are scanned (and
  // still checked) only when the chain reaches them, and draft probabilities are trusted.
  const int64_t rows = batch * k1;
  std::vector<float> row_max(static_cast<size_t>(rows), std::numeric_limits<float>::quiet_NaN());
  if (validate) {
    std::vector<char> prob_bad(static_cast<size_t>(batch * (k1 - 1)));
    std::vector<double> prob_sum(prob_bad.size());
    parallel_rows(rows, [&](int64_t begin, int64_t end, int64_t& r) {
      for (r = begin; r < end; ++r) {
        row_max[r] = checked_row_max("chain_verify", logit_p + r * vocab, vocab, r / k1, r % k1);
        if (prob_p != nullptr && r % k1 < k1 - 1) {
          const int64_t pr = (r / k1) * (k1 - 1) + r % k1;
          bool bad = false;
          prob_sum[pr] = passes().scan_probs(prob_p + pr * vocab, vocab, &bad);
          prob_bad[pr] = bad;
        }
      }
    });
    for (size_t r = 0; r < prob_bad.size(); ++r) {
      TORCH_CHECK_VALUE(!prob_bad[r], "chain_verify: draft_probs[", r / (k1 - 1), ", ", r % (k1 - 1),
                        "] contains NaN, inf or negative values");
    }
    for (int64_t b = 0; prob_p != nullptr && b < batch; ++b) {
      for (int64_t j = 0; j < nd_p[b]; ++j) {
        const double sum = prob_sum[b * (k1 - 1) + j];
        TORCH_CHECK_VALUE(std::abs(sum - 1.0) <= kProbSumTolerance, "chain_verify: draft_probs[", b, ", ", j,
                          "] sums to ", sum, ", not 1 (each used row must be a distribution)");
      }
    }
  }

  auto out = at::full({batch, k1}, -1, drafts.options());
  auto num_accepted = at::zeros({batch}, drafts.options());
  int64_t* out_p = out.data_ptr<int64_t>();
  int64_t* acc_p = num_accepted.data_ptr<int64_t>();
  // Requests in parallel; with fewer requests than threads, each request's row passes instead.
  const bool split = batch < at::get_num_threads();
  const auto verify_requests = [&](int64_t begin, int64_t end, int64_t& b) {
    std::vector<float> weights, scratch;  // weights: sized where a dense draw first needs them
    for (b = begin; b < end; ++b) {
      const RowParams rp{b, nd_p[b], sampling.temperature[b], sampling.top_k[b], sampling.top_p[b],
                         sampling.seed[b]};
      const auto verify = block && rp.temperature > 0.0f ? verify_row_block : verify_row;
      acc_p[b] = verify(logit_p + b * k1 * vocab, draft_p + b * (k1 - 1),
                        prob_p == nullptr ? nullptr : prob_p + b * (k1 - 1) * vocab,
                        row_max.data() + b * k1, vocab, rp, static_cast<uint64_t>(offset), split,
                        out_p + b * k1, weights, scratch);
    }
  };
  if (split) {
    int64_t b = 0;
    verify_requests(0, batch, b);
  } else {
    parallel_rows(batch, verify_requests);
  }
  return {out, num_accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("chain_verify", &chain_verify_cpu); }

}  // namespace specops
