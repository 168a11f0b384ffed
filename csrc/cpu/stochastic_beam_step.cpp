// stochastic_beam_step on the CPU: one level of Stochastic Beam Search (RSD-S). Semantics:
// specops/reference.py.
//
// Every live beam's draws and q come from the row sampler of sample_without_replacement
// (without_replacement.h), beams in parallel; the scores follow the draws down from the beam's own in
// float64 (top-down truncated Gumbels). Then, per request, the candidates are ordered by float32 score
// (ties: beam, then draw) and the first beam_width kept.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "without_replacement.h"

namespace specops {
namespace {

constexpr uint64_t kBeamStride = 0x632BE59BD9B4E019ull;  // specops/_seeds.py BEAM_STRIDE

// -log(exp(-bound) + exp(-g)) without overflow or cancellation: a Gumbel g conditioned below bound.
inline double truncated_gumbel(double g, double bound) {
  return std::min(bound, g) - std::log1p(std::exp(-std::abs(bound - g)));
}

struct Beam {
  double phi, score;
  bool live() const { return phi > -INFINITY && score > -INFINITY; }
};

// Beam row r's children: draws into tokens[0, k), their float32 scores and log-probabilities.
void beam_children(const float* logit, int64_t vocab, int64_t k, Beam beam, float t, int64_t top_k, float top_p,
                   int64_t seed, uint64_t offset, int64_t row, int64_t* tokens, float* scores, float* log_probs,
                   float* probs, std::vector<float>& weights, std::vector<float>& scratch,
                   std::vector<int64_t>& order) {
  std::vector<double> sums;
  const bool greedy = sample_row("stochastic_beam_step", logit, vocab, k, t, top_k, top_p, seed, offset, row, tokens,
                                 probs, weights, scratch, order, &sums);
  // The mass left before draw i, without cancellation (one token may hold nearly all of q): what no draw
  // took (the chunk sums after the draws), plus the q of draws i.. (all terms >= 0).
  double rest = std::accumulate(sums.begin(), sums.end(), 0.0);
  std::vector<double> left(static_cast<size_t>(k), 0.0);  // left[i]: the mass before draw i
  if (!greedy) {
    int64_t drawn = 0;
    while (drawn < k && tokens[drawn] >= 0) ++drawn;
    for (int64_t i = drawn - 1; i >= 0; --i) rest = left[i] = rest + probs[tokens[i]];
  }
  double log_z = 0.0;
  float row_max = 0.0f;
  if (greedy) {  // deterministic beam search: phi + log_softmax(logits)
    row_max = *std::max_element(logit, logit + vocab);
    log_z = std::log(passes().sum_exp(logit, vocab, 1.0f, row_max, -kInf));
  }
  double score = beam.score;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t token = tokens[i];
    if (token < 0) {
      scores[i] = log_probs[i] = -kInf;
      continue;
    }
    const double log_prob = beam.phi + (greedy ? static_cast<double>(logit[token]) - row_max - log_z
                                               : std::log(static_cast<double>(probs[token])));
    if (greedy) {
      score = log_prob;
    } else if (i > 0) {
      const double noise = -std::log(-std::log(uniform(seed, offset, i, kStreamBeam)));
      score = truncated_gumbel(beam.phi + std::log(left[i]) + noise, score);
    }
    scores[i] = static_cast<float>(score);
    log_probs[i] = static_cast<float>(log_prob);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> stochastic_beam_step_cpu(
    const at::Tensor& logits, const at::Tensor& beam_log_probs, const at::Tensor& beam_scores, int64_t beam_width,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    int64_t offset, bool /*validate: every live row is read, and checked*/) {
  constexpr const char* op = "stochastic_beam_step";
  TORCH_CHECK_VALUE(logits.dim() == 3, op, ": logits must be [B, W, V]");
  const int64_t batch = logits.size(0), beams = logits.size(1), vocab = logits.size(2);
  TORCH_CHECK_VALUE(beams >= 1 && vocab >= 1, op, ": logits needs W >= 1 and V >= 1");
  const int64_t k = beam_width;
  TORCH_CHECK_VALUE(k >= 1 && k <= vocab, op, ": beam_width must be in [1, ", vocab, "], got ", k);
  for (const at::Tensor* t : {&beam_log_probs, &beam_scores}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == batch && t->size(1) == beams && t->scalar_type() == at::kFloat,
                      op, ": beam_log_probs and beam_scores must be [B, W] float32");
  }
  check_per_row(op, {&top_k, &seed}, batch, at::kLong, "top_k and seed must be [B] int64");
  check_per_row(op, {&temperature, &top_p}, batch, at::kFloat, "temperature and top_p must be [B] float32");
  TORCH_CHECK_VALUE(offset >= 0, op, ": offset must be >= 0");
  check_logit_dtype(op, "logits", logits);
  const at::Tensor x = logits.to(at::kFloat).contiguous();
  const at::Tensor phi_t = beam_log_probs.contiguous(), score_t = beam_scores.contiguous();
  const float* phi = phi_t.data_ptr<float>();
  const float* beam_score = score_t.data_ptr<float>();
  for (int64_t r = 0; r < batch * beams; ++r) {
    TORCH_CHECK_VALUE(!std::isnan(phi[r]) && phi[r] < kInf && !std::isnan(beam_score[r]) && beam_score[r] < kInf,
                      op, ": beam_log_probs and beam_scores must not hold NaN or +inf (beam ", r % beams,
                      " of request ", r / beams, ")");
  }
  const SamplingRows sampling(op, temperature, top_k, top_p, seed);
  for (int64_t b = 0; b < batch; ++b) sampling.check(b);

  auto long_opts = seed.options().dtype(at::kLong);
  auto float_opts = x.options();
  // Live rows are written whole by the row sampler; only dead beams' rows are zeroed (a fresh zeroed
  // [B, W, V] would be one more pass over memory the op is bound by).
  auto probs = at::empty({batch, beams, vocab}, float_opts);
  // Every beam's draws, scores and log-probabilities, [B, W, K].
  std::vector<int64_t> draws(static_cast<size_t>(batch * beams * k), -1);
  std::vector<float> draw_scores(draws.size(), -kInf), draw_log_probs(draws.size(), -kInf);
  const float* x_p = x.data_ptr<float>();
  float* prob_p = probs.data_ptr<float>();
  parallel_rows(batch * beams, [&](int64_t begin, int64_t end, int64_t& r) {
    std::vector<float> weights, scratch;
    std::vector<int64_t> order;
    for (r = begin; r < end; ++r) {
      const Beam beam{phi[r], beam_score[r]};
      if (!beam.live()) {
        std::fill(prob_p + r * vocab, prob_p + (r + 1) * vocab, 0.0f);
        continue;
      }
      const int64_t b = r / beams, w = r % beams;
      const auto beam_seed = static_cast<int64_t>(static_cast<uint64_t>(sampling.seed[b]) +
                                                  static_cast<uint64_t>(w) * kBeamStride);
      beam_children(x_p + r * vocab, vocab, k, beam, sampling.temperature[b], sampling.top_k[b], sampling.top_p[b],
                    beam_seed, static_cast<uint64_t>(offset), r, draws.data() + r * k, draw_scores.data() + r * k,
                    draw_log_probs.data() + r * k, prob_p + r * vocab, weights, scratch, order);
    }
  });

  auto parents = at::full({batch, k}, -1, long_opts);
  auto tokens = at::full({batch, k}, -1, long_opts);
  auto log_probs = at::full({batch, k}, -kInf, float_opts);
  auto scores = at::full({batch, k}, -kInf, float_opts);
  int64_t* parent_p = parents.data_ptr<int64_t>();
  int64_t* token_p = tokens.data_ptr<int64_t>();
  float* log_prob_p = log_probs.data_ptr<float>();
  float* score_p = scores.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t base = b * beams * k;
      cand.clear();
      for (int64_t c = 0; c < beams * k; ++c) {
        if (draws[base + c] >= 0) cand.push_back(c);
      }
      const auto better = [&](int64_t a, int64_t c) { return draw_scores[base + a] > draw_scores[base + c]; };
      std::stable_sort(cand.begin(), cand.end(), better);  // ties keep the lower beam, then draw
      for (int64_t j = 0; j < k && j < static_cast<int64_t>(cand.size()); ++j) {
        const int64_t c = cand[j];
        parent_p[b * k + j] = c / k;
        token_p[b * k + j] = draws[base + c];
        log_prob_p[b * k + j] = draw_log_probs[base + c];
        score_p[b * k + j] = draw_scores[base + c];
      }
    }
  });
  return {parents, tokens, log_probs, scores, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("stochastic_beam_step", &stochastic_beam_step_cpu); }

}  // namespace specops
