// What ngram_memory_insert and ngram_memory_lookup share: the store's key order and the level policy.
// Semantics: specops/reference.py ("The n-gram memory's index").
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace specops {
namespace memory {

constexpr int64_t kLevelRatio = 8;  // reference.MEMORY_LEVEL_RATIO
constexpr int64_t kMaxDepth = 64;   // the longest key, hence the longest match
constexpr int64_t kMaxWidth = 256;  // continuation tokens per candidate
constexpr int64_t kMaxOccurrences = 256;
constexpr int64_t kMaxStore = (int64_t{1} << 31) - 1;  // positions are int32

// The store: runs of tokens apart, separated by negative tokens. Reads outside it are -1, so no input can
// make a key or a continuation read out of bounds.
struct Store {
  const int32_t* t;
  int64_t size;
  int64_t depth;

  int32_t at(int64_t p) const { return (p >= 0 && p < size) ? t[p] : -1; }

  // (key(a), a) < (key(b), b): keys read backwards from the end position, at most depth tokens, stopping
  // before the first negative one; a stopped key is smaller than any token.
  bool less(int64_t a, int64_t b) const {
    for (int64_t j = 0; j < depth; ++j) {
      const int32_t x = at(a - j), y = at(b - j);
      const bool x_end = x < 0, y_end = y < 0;
      if (x_end || y_end) {
        if (x_end && y_end) break;
        return x_end;
      }
      if (x != y) return x < y;
    }
    return a < b;
  }
};

// reference.memory_merged_blocks: of [*levels, added] (oldest first), how many blocks from the newest merge into
// the new newest level.
inline int64_t merged_blocks(at::IntArrayRef levels, int64_t added) {
  if (added == 0) return 0;
  const int64_t count = static_cast<int64_t>(levels.size());
  int64_t merged = 1, size = added;
  while (merged <= count && size * kLevelRatio > levels[count - merged]) {
    size += levels[count - merged];
    ++merged;
  }
  return merged;
}

// The checks both ops make on the store and the index (tokens int32 [T]; entries an int32 buffer [capacity]
// holding levels of the given sizes from its start, oldest first, each >= 1) and on depth. Returns the
// entries held.
inline int64_t check_index(const char* op, const at::Tensor& tokens, const at::Tensor& entries, at::IntArrayRef levels,
                           int64_t depth) {
  TORCH_CHECK_VALUE(tokens.dim() == 1, op, ": tokens must be [T], got ", tokens.dim(), " dimensions");
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kInt, op, ": tokens must be int32, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.size(0) <= kMaxStore, op, ": tokens must have T < 2**31 positions, got ", tokens.size(0));
  TORCH_CHECK_VALUE(entries.dim() == 1, op, ": entries must be [capacity], got ", entries.dim(), " dimensions");
  TORCH_CHECK_TYPE(entries.scalar_type() == at::kInt, op, ": entries must be int32, got ", entries.scalar_type());
  TORCH_CHECK_VALUE(entries.device() == tokens.device(), op, ": entries is on ", entries.device(),
                    " but tokens is on ", tokens.device());
  int64_t total = 0;
  for (size_t l = 0; l < levels.size(); ++l) {
    TORCH_CHECK_VALUE(levels[l] >= 1, op, ": levels[", l, "] = ", levels[l], " must be >= 1");
    total += levels[l];
  }
  TORCH_CHECK_VALUE(total <= entries.size(0), op, ": levels sum to ", total, " but entries has room for ",
                    entries.size(0));
  TORCH_CHECK_VALUE(1 <= depth && depth <= kMaxDepth, op, ": depth must be in [1, ", kMaxDepth, "], got ", depth);
  return total;
}

}  // namespace memory
}  // namespace specops
