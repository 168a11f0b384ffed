// ngram_match on the CPU: context n-gram drafting (paper 001, section 4.2). Semantics and ranking:
// specops/reference.py.
//
// Per row, one pass over the end positions e measures m(e) by comparing backwards from e against the
// row's last tokens and stopping at the first mismatch: O(n * average match length). Occurrences are
// grouped by continuation in an open-addressing table whose slots keep a position of the group (its
// recency R) instead of a copy of its tokens. R identifies its group, so the top k are chosen on the
// int64 keys alone and decoded afterwards. Rows run in parallel; each thread reuses its buffers.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace specops {
namespace {

constexpr int kKeyBits = 28;  // reference.NGRAM_KEY_BITS: key = (L << 56) | (N << 28) | R
constexpr int64_t kKeyMask = (int64_t{1} << kKeyBits) - 1;
constexpr int64_t kMaxNgram = 63;  // L in bits 56..61 keeps every key positive

// A row's context; positions past its end read as -1, the padding of continuations.
template <typename T>
struct Context {
  const T* tokens;
  int64_t n;
  int64_t at(int64_t p) const { return p < n ? static_cast<int64_t>(tokens[p]) : -1; }
};

struct Occurrence {
  int64_t end, level;
};

// One distinct continuation: its level L, count N and recency R. level 0 marks an empty slot.
struct Group {
  uint64_t hash;
  int64_t level, count, recency;
};

// Per-thread buffers, reused row after row.
struct Scratch {
  std::vector<Occurrence> occurrences;
  std::vector<Group> table;
  std::vector<int64_t> keys;
};

template <typename T>
uint64_t continuation_hash(const Context<T>& ctx, int64_t end, int64_t width) {
  uint64_t h = 0;
  for (int64_t i = 1; i <= width; ++i) h = (h + static_cast<uint64_t>(ctx.at(end + i))) * 0x9E3779B97F4A7C15ull;
  // splitmix64's finalizer: the table is indexed by the low bits, which the multiplications leave weak.
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

template <typename T>
bool same_continuation(const Context<T>& ctx, int64_t a, int64_t b, int64_t width) {
  for (int64_t i = 1; i <= width; ++i) {
    if (ctx.at(a + i) != ctx.at(b + i)) return false;
  }
  return true;
}

// One row: writes its top k continuations to candidates [k, width], counts [k] and ngram [k], which
// arrive filled with "no candidate".
template <typename T>
void match_row(const Context<T>& ctx, int64_t min_ngram, int64_t max_ngram, int64_t k, int64_t width,
               Scratch& s, int64_t* candidates, int64_t* counts, int64_t* ngram) {
  const T* x = ctx.tokens;
  const int64_t last = ctx.n - 1;
  s.occurrences.clear();
  for (int64_t e = 0; e < last; ++e) {
    // The match may overlap the query; it stops at the context's start (e - m >= 0).
    const int64_t cap = std::min(max_ngram, e + 1);
    int64_t m = 0;
    while (m < cap && x[e - m] == x[last - m]) ++m;
    if (m >= min_ngram) s.occurrences.push_back({e, m});
  }
  if (s.occurrences.empty()) return;

  // A power of two at least twice the occurrences: the load stays under 1/2, so probes stay short.
  size_t capacity = 16;
  while (capacity < 2 * s.occurrences.size()) capacity *= 2;
  s.table.assign(capacity, Group{0, 0, 0, 0});
  const uint64_t mask = capacity - 1;
  for (const Occurrence& o : s.occurrences) {
    const uint64_t h = continuation_hash(ctx, o.end, width);
    uint64_t slot = h & mask;
    while (s.table[slot].level != 0 &&
           (s.table[slot].hash != h || !same_continuation(ctx, s.table[slot].recency, o.end, width))) {
      slot = (slot + 1) & mask;
    }
    Group& g = s.table[slot];
    // Occurrences arrive in increasing e, so one at the group's level is always its latest.
    if (o.level > g.level) {
      g = Group{h, o.level, 1, o.end};
    } else if (o.level == g.level) {
      ++g.count;
      g.recency = o.end;
    }
  }

  s.keys.clear();
  for (const Group& g : s.table) {
    if (g.level != 0) s.keys.push_back((g.level << (2 * kKeyBits)) | (g.count << kKeyBits) | g.recency);
  }
  const int64_t take = std::min(k, static_cast<int64_t>(s.keys.size()));
  std::partial_sort(s.keys.begin(), s.keys.begin() + take, s.keys.end(), std::greater<int64_t>());
  for (int64_t i = 0; i < take; ++i) {
    const int64_t key = s.keys[i], recency = key & kKeyMask;
    for (int64_t j = 0; j < width; ++j) candidates[i * width + j] = ctx.at(recency + 1 + j);
    counts[i] = (key >> kKeyBits) & kKeyMask;
    ngram[i] = key >> (2 * kKeyBits);
  }
}

// The position of a row's first negative token, or -1.
template <typename T>
int64_t first_negative(const T* x, int64_t n) {
  // The OR of the tokens is negative iff one is: a reduction without early exit, which vectorizes.
  T any = 0;
  for (int64_t i = 0; i < n; ++i) any |= x[i];
  if (any >= 0) return -1;
  return std::find_if(x, x + n, [](T v) { return v < 0; }) - x;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ngram_match_cpu(const at::Tensor& tokens, const at::Tensor& lengths,
                                                               int64_t min_ngram, int64_t max_ngram,
                                                               int64_t num_candidates, int64_t width, bool validate) {
  TORCH_CHECK_VALUE(tokens.dim() == 2, "ngram_match: tokens must be [B, L], got ", tokens.dim(), " dimensions");
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kInt || tokens.scalar_type() == at::kLong,
                   "ngram_match: tokens must be int32 or int64, got ", tokens.scalar_type());
  const int64_t batch = tokens.size(0), len = tokens.size(1);
  TORCH_CHECK_VALUE(len < (int64_t{1} << kKeyBits), "ngram_match: tokens must have L < 2**28 columns, got ", len);
  TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.size(0) == batch, "ngram_match: lengths must be [B] = [", batch,
                    "], got ", lengths.sizes());
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kLong, "ngram_match: lengths must be int64, got ",
                   lengths.scalar_type());
  TORCH_CHECK_VALUE(lengths.device() == tokens.device(), "ngram_match: lengths is on ", lengths.device(),
                    " but tokens is on ", tokens.device());
  TORCH_CHECK_VALUE(1 <= min_ngram && min_ngram <= max_ngram && max_ngram <= kMaxNgram,
                    "ngram_match: need 1 <= min_ngram <= max_ngram <= ", kMaxNgram, ", got min_ngram = ", min_ngram,
                    ", max_ngram = ", max_ngram);
  // Caps as L's: the outputs are [B, k, width], and nothing asks for more than a context holds.
  TORCH_CHECK_VALUE(num_candidates >= 1 && num_candidates < (int64_t{1} << kKeyBits),
                    "ngram_match: num_candidates must be >= 1 and < 2**28, got ", num_candidates);
  TORCH_CHECK_VALUE(width >= 1 && width < (int64_t{1} << kKeyBits),
                    "ngram_match: width must be >= 1 and < 2**28, got ", width);

  const at::Tensor ctx = tokens.contiguous();
  const at::Tensor lens = lengths.contiguous();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  // Always checked, whatever validate says: a length past L would read out of bounds.
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(len_p[b] >= 0 && len_p[b] <= len, "ngram_match: lengths[", b, "] = ", len_p[b],
                      " is outside [0, ", len, "]");
  }

  const auto options = tokens.options().dtype(at::kLong);
  auto candidates = at::full({batch, num_candidates, width}, -1, options);
  auto counts = at::zeros({batch, num_candidates}, options);
  auto ngram = at::zeros({batch, num_candidates}, options);
  int64_t* cand_p = candidates.data_ptr<int64_t>();
  int64_t* count_p = counts.data_ptr<int64_t>();
  int64_t* ngram_p = ngram.data_ptr<int64_t>();
  // validate: each row's first negative token, reported after the parallel loop for the first bad row
  // so that the error does not depend on the thread count.
  std::vector<int64_t> negative_at(static_cast<size_t>(batch), -1);
  AT_DISPATCH_INDEX_TYPES(ctx.scalar_type(), "ngram_match", [&] {
    const index_t* tok_p = ctx.data_ptr<index_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t b = begin; b < end; ++b) {
        const Context<index_t> row{tok_p + b * len, len_p[b]};
        if (validate && (negative_at[b] = first_negative(row.tokens, row.n)) >= 0) continue;
        match_row(row, min_ngram, max_ngram, num_candidates, width, scratch, cand_p + b * num_candidates * width,
                  count_p + b * num_candidates, ngram_p + b * num_candidates);
      }
    });
  });
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(negative_at[b] < 0, "ngram_match: tokens[", b, ", ", negative_at[b], "] = ",
                      ctx[b][negative_at[b]].item<int64_t>(), " is negative; context tokens must be ids >= 0");
  }
  return {candidates, counts, ngram};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("ngram_match", &ngram_match_cpu); }

}  // namespace specops
