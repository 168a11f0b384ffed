// ngram_memory_insert on the CPU: new end positions join the n-gram memory's sorted index, in place. Semantics:
// specops/reference.py ("The n-gram memory's index").
//
// The new positions are sorted (std::sort on the key order), then merged with the newest levels they have
// outgrown (std::merge, one level at a time, newest first) and written over those levels at the buffer's
// tail; older levels are not touched. Keys never change once written (a key reads only tokens before its
// position, and runs only grow forwards), so a merge of two sorted levels is sorted.
//
// A comparison reads the store at two random places, so sorting n positions is bound by memory latency;
// for large inserts (a corpus) each position first gets its first two key tokens packed in one word, so
// most comparisons of the sort touch only that array.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ngram_memory.h"

namespace specops {
namespace {

constexpr int64_t kPackedSort = 4096;  // inserts of at least this many positions sort on packed key words

// The first two key tokens of e as one word ordered as the keys are (a stopped token is 0, a token x is x + 1).
uint64_t packed_key(const memory::Store& s, int64_t e) {
  const int32_t x = s.at(e);
  if (x < 0 || s.depth < 2) return static_cast<uint64_t>(x < 0 ? 0 : int64_t{x} + 1) << 32;
  const int32_t y = s.at(e - 1);
  return (static_cast<uint64_t>(int64_t{x} + 1) << 32) | static_cast<uint64_t>(y < 0 ? 0 : int64_t{y} + 1);
}

void sort_positions(const memory::Store& s, std::vector<int32_t>& positions) {
  if (static_cast<int64_t>(positions.size()) < kPackedSort) {
    std::sort(positions.begin(), positions.end(), [&](int32_t a, int32_t b) { return s.less(a, b); });
    return;
  }
  struct Item {
    uint64_t key;
    int32_t position;
  };
  std::vector<Item> items(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) items[i] = {packed_key(s, positions[i]), positions[i]};
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    if (a.key != b.key) return a.key < b.key;
    return s.less(a.position, b.position);  // the packed tokens are equal: the full comparison decides
  });
  for (size_t i = 0; i < items.size(); ++i) positions[i] = items[i].position;
}

void ngram_memory_insert_cpu(const at::Tensor& tokens, const at::Tensor& entries, at::IntArrayRef levels,
                             const at::Tensor& positions, int64_t depth, bool validate) {
  const char* op = "ngram_memory_insert";
  const int64_t total = memory::check_index(op, tokens, entries, levels, depth);
  TORCH_CHECK_VALUE(entries.is_contiguous(), op, ": entries must be contiguous (it is written in place)");
  TORCH_CHECK_VALUE(positions.dim() == 1, op, ": positions must be [n], got ", positions.dim(), " dimensions");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong, op, ": positions must be int64, got ",
                   positions.scalar_type());
  TORCH_CHECK_VALUE(positions.device() == tokens.device(), op, ": positions is on ", positions.device(),
                    " but tokens is on ", tokens.device());
  const at::Tensor store = tokens.contiguous(), added = positions.contiguous();
  const int64_t size = store.size(0), n = added.size(0);
  TORCH_CHECK_VALUE(total + n <= entries.size(0), op, ": entries has room for ", entries.size(0),
                    " entries, and the index would hold ", total + n);
  const memory::Store s{store.data_ptr<int32_t>(), size, depth};
  const int64_t* pos_p = added.data_ptr<int64_t>();
  if (validate) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pos_p[i];
      TORCH_CHECK_VALUE(p >= 0 && p + 1 < size, op, ": positions[", i, "] = ", p, " is outside [0, ", size - 1,
                        "): an entry is a token with a token after it");
      TORCH_CHECK_VALUE(i == 0 || p > pos_p[i - 1], op, ": positions must increase strictly, but positions[", i,
                        "] = ", p, " follows ", pos_p[i - 1]);
      TORCH_CHECK_VALUE(s.t[p] >= 0 && s.t[p + 1] >= 0, op, ": positions[", i, "] = ", p,
                        " does not hold a token followed by a token (tokens[", p, ":", p + 2, "] = ", s.t[p], ", ",
                        s.t[p + 1], ")");
    }
  }
  const int64_t merged = memory::merged_blocks(levels, n);
  if (merged == 0) return;
  std::vector<int32_t> front(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) front[i] = static_cast<int32_t>(pos_p[i]);
  sort_positions(s, front);
  int32_t* buffer = entries.data_ptr<int32_t>();
  int64_t end = total;  // the newest levels lie at the buffer's tail: merge them in from the newest
  std::vector<int32_t> next;
  const int64_t count = static_cast<int64_t>(levels.size());
  for (int64_t k = 1; k < merged; ++k) {
    const int64_t size_k = levels[count - k];
    const int32_t* level = buffer + end - size_k;
    next.resize(front.size() + static_cast<size_t>(size_k));
    std::merge(front.begin(), front.end(), level, level + size_k, next.begin(),
               [&](int32_t a, int32_t b) { return s.less(a, b); });
    front.swap(next);
    end -= size_k;
  }
  std::copy(front.begin(), front.end(), buffer + end);
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("ngram_memory_insert", &ngram_memory_insert_cpu); }

}  // namespace specops
