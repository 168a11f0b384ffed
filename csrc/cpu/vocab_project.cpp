// vocab_project on the CPU: a heterogeneous drafter's distribution over the vocabulary it shares with
// the target, renormalized and in target ids, and a draft sampled from it (TLI, paper 000 Alg 4).
// Semantics: specops/reference.py.
//
// The map is read once per call into two lists, the mapped drafter ids and their target ids (with
// validate, ids are range-checked and repeats found with a bitmap over the target vocabulary). Each
// row gathers its mapped logits into a dense float32 buffer in drafter-id order, and every later pass
// (maximum, top-k / top-p thresholds, softmax, inverse CDF) runs on that buffer with chain_verify's
// SIMD row passes and threshold code (sampling.h): unmapped ids cost nothing after the gather, and the
// inverse CDF in buffer order is the inverse CDF in drafter-id order. The output row is written once,
// 16 KB window by window: zeros, then the weights whose target ids fall in the window. Rows run in
// parallel.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "sampling.h"

namespace specops {
namespace {

// Output rows are written window by window (16 KB: L1-resident): zero-fill, then the window's
// weights. Random scatter over a whole 1 MB row would miss the cache on most stores.
constexpr int kWindowBits = 12;
constexpr int64_t kWindow = int64_t{1} << kWindowBits;

// The intersection: drafter id src[j] is target id dst[j] for j < size, src increasing. For the
// output, the same pairs grouped by window of target ids: entries window_begin[b] .. window_begin[b+1]
// write weight out_j[k] at target id out_dst[k]. 32-bit ids halve what every row reads; the buffers are
// left uninitialized (filled once per call).
struct Mapping {
  std::unique_ptr<int32_t[]> src, dst, out_dst, out_j;
  std::vector<int32_t> window_begin;
  int64_t size = 0;
};

// Counting sort of the pairs by window (stable: repeated target ids, possible only without validate,
// keep the last drafter id's weight as a plain scatter would).
void group_by_window(Mapping& map, int64_t target_vocab) {
  const int64_t n = map.size;
  const int64_t num_windows = (target_vocab + kWindow - 1) / kWindow;
  const int32_t* dst = map.dst.get();
  map.window_begin.assign(static_cast<size_t>(num_windows + 1), 0);
  for (int64_t j = 0; j < n; ++j) ++map.window_begin[static_cast<size_t>((dst[j] >> kWindowBits) + 1)];
  for (int64_t b = 0; b < num_windows; ++b) map.window_begin[b + 1] += map.window_begin[b];
  std::vector<int32_t> cursor(map.window_begin.begin(), map.window_begin.end() - 1);
  map.out_dst.reset(new int32_t[static_cast<size_t>(std::max<int64_t>(n, 1))]);
  map.out_j.reset(new int32_t[static_cast<size_t>(std::max<int64_t>(n, 1))]);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t k = cursor[static_cast<size_t>(dst[j] >> kWindowBits)]++;
    map.out_dst[k] = dst[j];
    map.out_j[k] = static_cast<int32_t>(j);
  }
}

// probs row = weights w (indexed like the mapping) at their target ids, 0 elsewhere; one pass.
void write_row(const Mapping& map, const float* w, int64_t target_vocab, float* out) {
  const int64_t num_windows = static_cast<int64_t>(map.window_begin.size()) - 1;
  const int32_t* out_dst = map.out_dst.get();
  const int32_t* out_j = map.out_j.get();
  for (int64_t b = 0; b < num_windows; ++b) {
    const int64_t lo = b << kWindowBits;
    std::memset(out + lo, 0, static_cast<size_t>(std::min(kWindow, target_vocab - lo)) * sizeof(float));
    for (int32_t k = map.window_begin[b]; k < map.window_begin[b + 1]; ++k) out[out_dst[k]] = w[out_j[k]];
  }
}

// The first bad id, for the error message: out of range, or a target id seen before.
[[noreturn]] void throw_bad_ids(const int64_t* ids, int64_t draft_vocab, int64_t target_vocab) {
  std::vector<int64_t> first(static_cast<size_t>(target_vocab), -1);
  for (int64_t v = 0; v < draft_vocab; ++v) {
    const int64_t id = ids[v];
    TORCH_CHECK_VALUE(id >= -1 && id < target_vocab, "vocab_project: target_ids[", v, "] = ", id,
                      " must be -1 or in [0, ", target_vocab, ")");
    if (id < 0) continue;
    TORCH_CHECK_VALUE(first[id] < 0, "vocab_project: target_ids maps two drafter ids to the same target id (",
                      "drafter ids ", first[id], " and ", v, " to target id ", id, ")");
    first[id] = v;
  }
  TORCH_CHECK(false, "vocab_project: internal error: bad target_ids not found");
}

// Ids outside [0, target_vocab) are left out (unmapped), so no row pass can index out of bounds. With
// validate, such ids (other than -1) and repeated target ids (a bitmap over the target vocabulary)
// raise. Branch-free: about 2/3 of the ids are mapped, in no predictable pattern.
Mapping read_mapping(const int64_t* ids, int64_t draft_vocab, int64_t target_vocab, bool validate) {
  Mapping map;
  map.src.reset(new int32_t[static_cast<size_t>(draft_vocab)]);
  map.dst.reset(new int32_t[static_cast<size_t>(draft_vocab)]);
  int32_t* src = map.src.get();
  int32_t* dst = map.dst.get();
  int64_t n = 0;
  bool bad = false;
  for (int64_t v = 0; v < draft_vocab; ++v) {
    const int64_t id = ids[v];
    src[n] = static_cast<int32_t>(v);
    dst[n] = static_cast<int32_t>(id);
    const bool mapped = static_cast<uint64_t>(id) < static_cast<uint64_t>(target_vocab);
    n += mapped;
    bad |= !mapped & (id != -1);
  }
  map.size = n;
  if (validate) {
    std::vector<uint64_t> seen(static_cast<size_t>((target_vocab + 63) / 64));
    uint64_t repeated = 0;
    for (int64_t j = 0; j < n; ++j) {
      uint64_t& word = seen[static_cast<size_t>(dst[j] >> 6)];
      const uint64_t bit = uint64_t{1} << (dst[j] & 63);
      repeated |= word & bit;
      word |= bit;
    }
    if (bad || repeated) throw_bad_ids(ids, draft_vocab, target_vocab);
  }
  group_by_window(map, target_vocab);
  return map;
}

// Whether a logit row holds NaN or +inf anywhere, mapped or not (validate only).
template <typename T>
bool has_bad_logit(const T* logit, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    bool bad = false;
    passes().scan_row(logit, n, &bad);
    return bad;
  } else {
    bool bad = false;
    for (int64_t i = 0; i < n; ++i) bad |= !(static_cast<float>(logit[i]) < kInf);
    return bad;
  }
}

struct RowParams {
  int64_t index;
  float temperature;
  int64_t top_k;
  float top_p;
  int64_t seed;
};

// Per-thread buffers, reused row after row: the gathered logits, the weights, the top-k/top-p scratch.
struct Scratch {
  std::vector<float> x, w, filter;
  std::vector<double> chunk_sums;
};

// One row: writes probs_row [target_vocab] and returns the index j into the mapping of the draft.
template <typename T>
int64_t project_row(const T* logit, const Mapping& map, int64_t draft_vocab, int64_t target_vocab,
                    const RowParams& rp, uint64_t offset, bool validate, float* probs_row, Scratch& s) {
  const int64_t n = map.size;
  if (validate) {
    TORCH_CHECK_VALUE(!has_bad_logit(logit, draft_vocab), "vocab_project: draft_logits[", rp.index,
                      "] contains NaN or +inf");
  }
  float* x = s.x.data();
  const int32_t* src = map.src.get();
  for (int64_t j = 0; j < n; ++j) x[j] = static_cast<float>(logit[src[j]]);
  // The mapped logits are checked even without validate: every later pass needs them ordered.
  bool bad = false;
  const float row_max = passes().scan_row(x, n, &bad);
  TORCH_CHECK_VALUE(!bad, "vocab_project: draft_logits[", rp.index, "] contains NaN or +inf");
  TORCH_CHECK_VALUE(row_max > -kInf, "vocab_project: draft_logits[", rp.index,
                    "] has no finite logit inside the intersection (target_ids >= 0)");

  const float t = rp.temperature;
  // Greedy at T = 0, and where the largest logit / T overflows (to +inf, or to -inf with every other one):
  // that is the T -> 0 limit, a point mass on the argmax.
  const float m = row_max / t;
  if (t == 0.0f || std::isinf(m)) {
    const int64_t j = passes().find_first(x, n, row_max);
    std::memset(probs_row, 0, static_cast<size_t>(target_vocab) * sizeof(float));
    probs_row[map.dst[j]] = 1.0f;
    return j;
  }
  // top_k >= n keeps everything, as top_k >= V_d does in the reference (the rest are -inf there).
  const bool filtered = (rp.top_k > 0 && rp.top_k < n) || rp.top_p < 1.0f;
  const float thr = filtered ? filter_threshold(x, n, t, m, rp.top_k, rp.top_p, s.filter) : -kInf;
  const float inv_z = static_cast<float>(1.0 / passes().sum_exp(x, n, t, m, thr));
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  s.chunk_sums.resize(static_cast<size_t>(num_chunks));
  float* w = s.w.data();
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk;
    s.chunk_sums[c] =
        passes().fill_weights(x + begin, nullptr, std::min(kChunk, n - begin), t, m, inv_z, thr, w + begin);
  }
  write_row(map, w, target_vocab, probs_row);
  return inverse_cdf(w, s.chunk_sums, n, uniform(rp.seed, offset, 0, kStreamDraft));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> vocab_project_cpu(
    const at::Tensor& draft_logits, const at::Tensor& target_ids, int64_t target_vocab,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    int64_t offset, bool validate) {
  TORCH_CHECK_VALUE(draft_logits.dim() == 2, "vocab_project: draft_logits must be an [N, V_d] tensor");
  check_logit_dtype("vocab_project", "draft_logits", draft_logits);
  const int64_t rows = draft_logits.size(0), draft_vocab = draft_logits.size(1);
  TORCH_CHECK_VALUE(draft_vocab >= 1, "vocab_project: draft_logits has no columns");
  TORCH_CHECK_VALUE(target_ids.dim() == 1 && target_ids.size(0) == draft_vocab,
                    "vocab_project: target_ids must be [V_d] = [", draft_vocab, "] to match draft_logits");
  TORCH_CHECK_TYPE(target_ids.scalar_type() == at::kLong, "vocab_project: target_ids must be int64");
  TORCH_CHECK_VALUE(target_vocab >= 1, "vocab_project: target_vocab must be an int >= 1, got ", target_vocab);
  TORCH_CHECK_VALUE(draft_vocab <= INT32_MAX && target_vocab <= INT32_MAX,
                    "vocab_project: vocabularies of 2**31 tokens or more are not supported");
  check_per_row("vocab_project", {&top_k, &seed}, rows, at::kLong, "top_k and seed must be [N] int64");
  check_per_row("vocab_project", {&temperature, &top_p}, rows, at::kFloat,
                "temperature and top_p must be [N] float32");
  TORCH_CHECK_VALUE(offset >= 0, "vocab_project: offset must be >= 0");
  const auto logits = draft_logits.contiguous();
  const auto ids = target_ids.contiguous();
  const SamplingRows sampling("vocab_project", temperature, top_k, top_p, seed);
  for (int64_t r = 0; r < rows; ++r) sampling.check(r);
  const Mapping map = read_mapping(ids.data_ptr<int64_t>(), draft_vocab, target_vocab, validate);
  const int64_t n = map.size;

  // Every row is written whole by its thread (zero-fill, then scatter): no at::zeros pass first.
  auto probs = at::empty({rows, target_vocab}, logits.options().dtype(at::kFloat));
  auto tokens = at::empty({rows}, ids.options());
  auto draft_tokens = at::empty({rows}, ids.options());
  float* probs_p = probs.data_ptr<float>();
  int64_t* tokens_p = tokens.data_ptr<int64_t>();
  int64_t* drafts_p = draft_tokens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "vocab_project", [&] {
    const scalar_t* logit_p = logits.data_ptr<scalar_t>();
    parallel_rows(rows, [&](int64_t begin, int64_t end, int64_t& r) {
      Scratch s;
      s.x.resize(static_cast<size_t>(n));
      s.w.resize(static_cast<size_t>(n));
      for (r = begin; r < end; ++r) {
        const RowParams rp{r, sampling.temperature[r], sampling.top_k[r], sampling.top_p[r], sampling.seed[r]};
        const int64_t j = project_row(logit_p + r * draft_vocab, map, draft_vocab, target_vocab, rp,
                                      static_cast<uint64_t>(offset), validate, probs_p + r * target_vocab, s);
        drafts_p[r] = map.src[j];
        tokens_p[r] = map.dst[j];
      }
    });
  });
  return {probs, tokens, draft_tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("vocab_project", &vocab_project_cpu); }

}  // namespace specops
