// ngram_memory_lookup on the CPU: the longest match of each row's last tokens in the n-gram memory, and the
// continuations that followed it. Semantics: specops/reference.py ("The n-gram memory's index").
//
// The index is levels (sorted runs of entries) laid out oldest first. Per row and level: a binary search for the
// query's place in the level's order; the entries matching the
// most query tokens are its neighbours there (keys sharing a prefix are contiguous). The row's match L is the
// largest such length over the levels; each level's entries matching L tokens are found by galloping out from
// the query's place, so a lookup costs O(log N) comparisons per level, each a few reads of the store. Then at
// most max_occurrences continuations are read, sorted to group equal ones, and the top k kept. Rows run in
// parallel; each thread reuses its buffers.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "ngram_memory.h"

namespace specops {
namespace {

struct Level {
  const int32_t* entries;
  int64_t size;
};

// A row's query: its last tokens, newest first.
struct Query {
  const int64_t* q;
  int64_t len;
};

// (matched tokens, key(e) < query).
struct Compared {
  int64_t match;
  bool less;
};

Compared compare(const memory::Store& s, int64_t e, const Query& query) {
  for (int64_t j = 0; j < query.len; ++j) {
    const int32_t x = s.at(e - j);
    if (x != query.q[j]) return {j, x < query.q[j]};  // a stopped key (-1) is below every token
  }
  return {query.len, false};
}

bool matches(const memory::Store& s, int64_t e, const Query& query, int64_t length) {
  for (int64_t j = 0; j < length; ++j) {
    if (s.at(e - j) != query.q[j]) return false;
  }
  return true;
}

// The first index in [0, place] from which every entry up to place matches `length` tokens (entries that
// share a prefix with the query are contiguous around its place), by galloping down from place.
int64_t first_matching(const memory::Store& s, const Level& level, int64_t place, const Query& query,
                       int64_t length) {
  int64_t good = place, step = 1;  // entries [good, place) match
  while (good > 0) {
    const int64_t probe = std::max<int64_t>(good - step, 0);
    if (!matches(s, level.entries[probe], query, length)) {
      int64_t lo = probe + 1, hi = good;  // the answer is in [lo, hi]
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (matches(s, level.entries[mid], query, length)) hi = mid; else lo = mid + 1;
      }
      return lo;
    }
    good = probe;
    step *= 2;
  }
  return 0;
}

// One past the last index from place on whose entries match `length` tokens.
int64_t end_matching(const memory::Store& s, const Level& level, int64_t place, const Query& query,
                     int64_t length) {
  int64_t good = place, step = 1;  // entries [place, good) match
  while (good < level.size) {
    const int64_t probe = std::min(good + step, level.size) - 1;
    if (!matches(s, level.entries[probe], query, length)) {
      int64_t lo = good, hi = probe;  // the answer is in [lo, hi]
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (matches(s, level.entries[mid], query, length)) lo = mid + 1; else hi = mid;
      }
      return lo;
    }
    good = probe + 1;
    step *= 2;
  }
  return level.size;
}

struct Scratch {
  std::vector<int64_t> place, chosen, q;
  std::vector<int32_t> continuations;  // [chosen, width]
  std::vector<int64_t> order, keys;
};

// One row: writes its candidates [k, width], counts [k], latest [k], match and occurrences, which arrive
// filled with "no candidate".
void lookup_row(const memory::Store& s, const std::vector<Level>& levels, const Query& query, int64_t min_match,
                int64_t k, int64_t width, int64_t max_occurrences, Scratch& w, int64_t* candidates,
                int64_t* counts, int64_t* latest, int64_t* match, int64_t* occurrences) {
  if (query.len == 0) return;
  const size_t n_levels = levels.size();
  w.place.assign(n_levels, 0);
  int64_t best = 0;
  for (size_t l = 0; l < n_levels; ++l) {
    const Level& level = levels[l];
    int64_t lo = 0, hi = level.size;
    while (lo < hi) {  // the first entry whose key is not below the query
      const int64_t mid = lo + (hi - lo) / 2;
      if (compare(s, level.entries[mid], query).less) lo = mid + 1; else hi = mid;
    }
    w.place[l] = lo;
    // The entries matching the most query tokens are the query's neighbours in the order.
    if (lo > 0) best = std::max(best, compare(s, level.entries[lo - 1], query).match);
    if (lo < level.size) best = std::max(best, compare(s, level.entries[lo], query).match);
  }
  if (best < min_match) return;
  *match = best;

  // The occurrences: every level's matching stretch; the quota taken from the newest levels first.
  w.chosen.clear();
  int64_t found = 0, left = max_occurrences;
  for (size_t l = n_levels; l-- > 0;) {  // newest level first
    const Level& level = levels[l];
    const int64_t first = first_matching(s, level, w.place[l], query, best);
    const int64_t end = end_matching(s, level, w.place[l], query, best);
    const int64_t count = end - first;
    found += count;
    if (left == 0 || count == 0) continue;
    if (count <= left) {
      for (int64_t i = first; i < end; ++i) w.chosen.push_back(level.entries[i]);
      left -= count;
    } else {
      for (int64_t i = 0; i < left; ++i) w.chosen.push_back(level.entries[first + (i * count) / left]);
      left = 0;
    }
  }
  *occurrences = found;

  // Group equal continuations: sort the read occurrences by their continuation, then rank the groups.
  const int64_t n = static_cast<int64_t>(w.chosen.size());
  w.continuations.assign(static_cast<size_t>(n * width), -1);
  for (int64_t i = 0; i < n; ++i) {
    int32_t* row = w.continuations.data() + i * width;
    for (int64_t j = 0; j < width; ++j) {
      const int32_t x = s.at(w.chosen[i] + 1 + j);
      if (x < 0) break;
      row[j] = x;
    }
  }
  auto same = [&](int64_t a, int64_t b) {
    return std::equal(w.continuations.begin() + a * width, w.continuations.begin() + (a + 1) * width,
                      w.continuations.begin() + b * width);
  };
  w.order.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) w.order[i] = i;
  std::sort(w.order.begin(), w.order.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(w.continuations.begin() + a * width, w.continuations.begin() + (a + 1) * width,
                                        w.continuations.begin() + b * width, w.continuations.begin() + (b + 1) * width);
  });
  // A group's key: (count << 32) | its latest position; its continuation is then that position's.
  w.keys.clear();
  for (int64_t i = 0; i < n;) {
    int64_t j = i, last = -1;
    while (j < n && same(w.order[i], w.order[j])) last = std::max(last, w.chosen[w.order[j++]]);
    w.keys.push_back(((j - i) << 32) | last);
    i = j;
  }
  const int64_t take = std::min<int64_t>(k, static_cast<int64_t>(w.keys.size()));
  std::partial_sort(w.keys.begin(), w.keys.begin() + take, w.keys.end(), std::greater<int64_t>());
  for (int64_t i = 0; i < take; ++i) {
    const int64_t e = w.keys[i] & 0xFFFFFFFFll;
    for (int64_t j = 0; j < width; ++j) {
      const int32_t x = s.at(e + 1 + j);
      if (x < 0) break;
      candidates[i * width + j] = x;
    }
    counts[i] = w.keys[i] >> 32;
    latest[i] = e;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ngram_memory_lookup_cpu(
    const at::Tensor& tokens, const at::Tensor& entries, at::IntArrayRef levels, const at::Tensor& contexts,
    const at::Tensor& lengths, int64_t depth, int64_t min_match, int64_t num_candidates, int64_t width,
    int64_t max_occurrences, bool validate) {
  const char* op = "ngram_memory_lookup";
  memory::check_index(op, tokens, entries, levels, depth);  // levels oldest first, from the buffer's start
  TORCH_CHECK_VALUE(contexts.dim() == 2, op, ": contexts must be [B, C], got ", contexts.dim(), " dimensions");
  TORCH_CHECK_TYPE(contexts.scalar_type() == at::kInt || contexts.scalar_type() == at::kLong, op,
                   ": contexts must be int32 or int64, got ", contexts.scalar_type());
  const int64_t batch = contexts.size(0), columns = contexts.size(1);
  TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.size(0) == batch, op, ": lengths must be [B] = [", batch,
                    "], got ", lengths.sizes());
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kLong, op, ": lengths must be int64, got ", lengths.scalar_type());
  TORCH_CHECK_VALUE(contexts.device() == tokens.device() && lengths.device() == tokens.device(), op,
                    ": contexts and lengths must be on tokens' device (", tokens.device(), ")");
  TORCH_CHECK_VALUE(1 <= min_match && min_match <= depth, op, ": min_match must be in [1, depth = ", depth,
                    "], got ", min_match);
  TORCH_CHECK_VALUE(1 <= max_occurrences && max_occurrences <= memory::kMaxOccurrences, op,
                    ": max_occurrences must be in [1, ", memory::kMaxOccurrences, "], got ", max_occurrences);
  TORCH_CHECK_VALUE(1 <= num_candidates && num_candidates <= max_occurrences, op,
                    ": num_candidates must be in [1, max_occurrences = ", max_occurrences, "], got ", num_candidates);
  TORCH_CHECK_VALUE(1 <= width && width <= memory::kMaxWidth, op, ": width must be in [1, ", memory::kMaxWidth,
                    "], got ", width);

  const at::Tensor store = tokens.contiguous(), index = entries.contiguous();
  const at::Tensor ctx = contexts.contiguous(), lens = lengths.contiguous();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  // Always checked, whatever validate says: a length past C would read out of bounds.
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(len_p[b] >= 0 && len_p[b] <= columns, op, ": lengths[", b, "] = ", len_p[b],
                      " is outside [0, ", columns, "]");
  }
  const auto options = contexts.options().dtype(at::kLong);
  auto candidates = at::full({batch, num_candidates, width}, -1, options);
  auto counts = at::zeros({batch, num_candidates}, options);
  auto latest = at::full({batch, num_candidates}, -1, options);
  auto match = at::zeros({batch}, options);
  auto occurrences = at::zeros({batch}, options);
  const memory::Store s{store.data_ptr<int32_t>(), store.size(0), depth};
  std::vector<Level> level_list;
  int64_t start = 0;
  for (const int64_t size : levels) {
    level_list.push_back({index.data_ptr<int32_t>() + start, size});
    start += size;
  }
  std::vector<int64_t> negative_at(static_cast<size_t>(batch), -1);
  AT_DISPATCH_INDEX_TYPES(ctx.scalar_type(), "ngram_memory_lookup", [&] {
    const index_t* ctx_p = ctx.data_ptr<index_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t b = begin; b < end; ++b) {
        const index_t* row = ctx_p + b * columns;
        const int64_t n = len_p[b], q = std::min(n, depth);
        if (validate) {
          for (int64_t i = 0; i < n && negative_at[b] < 0; ++i) {
            if (row[i] < 0) negative_at[b] = i;
          }
          if (negative_at[b] >= 0) continue;
        }
        scratch.q.resize(static_cast<size_t>(q));
        for (int64_t j = 0; j < q; ++j) scratch.q[j] = static_cast<int64_t>(row[n - 1 - j]);
        lookup_row(s, level_list, Query{scratch.q.data(), q}, min_match, num_candidates, width, max_occurrences,
                   scratch, candidates.data_ptr<int64_t>() + b * num_candidates * width,
                   counts.data_ptr<int64_t>() + b * num_candidates, latest.data_ptr<int64_t>() + b * num_candidates,
                   match.data_ptr<int64_t>() + b, occurrences.data_ptr<int64_t>() + b);
      }
    });
  });
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(negative_at[b] < 0, op, ": contexts[", b, ", ", negative_at[b], "] = ",
                      ctx[b][negative_at[b]].item<int64_t>(), " is negative; context tokens must be ids >= 0");
  }
  return {candidates, counts, latest, match, occurrences};
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("ngram_memory_lookup", &ngram_memory_lookup_cpu); }

}  // namespace specops
