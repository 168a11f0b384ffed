// The register tiles of skinny_linear (csrc/cpu/skinny_linear.cpp): a panel of 16 weight rows against
// every input row. Compiled once per instruction set through per_isa.h, with SPECOPS_ISA naming the
// namespace. No include guard; internal linkage.

namespace specops {
namespace {
namespace SPECOPS_ISA {

#include "simd_math.h"

// The pairwise step of a 16-vector transpose-reduce at `level` (0..3): lane halves of a and b added.
template <int level>
SPECOPS_INLINE f32x16 fold(f32x16 a, f32x16 b) {
  if constexpr (level == 0) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  } else if constexpr (level == 1) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  } else if constexpr (level == 2) {
    return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  } else {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
}

// Lane i of the result is the sum of the lanes of v[i]. Every vector is summed by the same tree
// (lanes l and l + 8, then + 4, + 2, + 1) whatever its place, so a row's result does not depend on
// which tile computed it.
SPECOPS_INLINE f32x16 reduce16(f32x16* v) {
  for (int i = 0; i < 8; ++i) v[i] = fold<0>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) v[i] = fold<1>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) v[i] = fold<2>(v[2 * i], v[2 * i + 1]);
  return fold<3>(v[0], v[1]);
}

// out[b * ldo + a] = dot(x row b, w row a) for a < JB weight rows and b < RB input rows (JB * RB <= 16
// accumulators). Each dot runs 16 lanes over k, then the lane tree, then the k % 16 tail in order.
// `ahead` is prefetched alongside each weight row (the next panel's rows: the hardware prefetcher ramps
// up too slowly on streams 2.5 KB long; nullptr: none).
template <int JB, int RB>
SPECOPS_INLINE void tile(const float* x, const float* w, int64_t k_dim, const float* ahead, float* out,
                         int64_t ldo) {
  static_assert(JB * RB <= 16, "a tile holds at most 16 accumulators");
  f32x16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = f32x16{};
  int64_t k = 0;
  for (; k + kLanes <= k_dim; k += kLanes) {
    f32x16 wv[JB], xv[RB];
    for (int a = 0; a < JB; ++a) wv[a] = load16(w + a * k_dim + k);
    if (ahead != nullptr) {
      for (int a = 0; a < JB; ++a) __builtin_prefetch(ahead + a * k_dim + k, 0, 3);
    }
    for (int b = 0; b < RB; ++b) xv[b] = load16(x + b * k_dim + k);
    for (int b = 0; b < RB; ++b) {
      for (int a = 0; a < JB; ++a) acc[b * JB + a] += wv[a] * xv[b];
    }
  }
  const f32x16 sums = reduce16(acc);
  for (int b = 0; b < RB; ++b) {
    for (int a = 0; a < JB; ++a) {
      float s = sums[b * JB + a];
      for (int64_t t = k; t < k_dim; ++t) s += w[a * k_dim + t] * x[b * k_dim + t];
      out[b * ldo + a] = s;
    }
  }
}

// A panel of 16 weight rows w against all m input rows x: out[r * ldo + j] for r < m, j < 16. Rows go
// four at a time (4 x 4 tiles, the panel re-read from L1), the last 1-3 in tiles as wide as 16
// accumulators allow. The weight is read from memory once; `ahead` as in tile().
void panel(const float* x, int64_t m, int64_t k_dim, const float* w, const float* ahead, float* out,
           int64_t ldo) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) {
    for (int j = 0; j < 16; j += 4) {
      tile<4, 4>(x + r * k_dim, w + j * k_dim, k_dim, r == 0 && ahead ? ahead + j * k_dim : nullptr,
                 out + r * ldo + j, ldo);
    }
  }
  const float* xr = x + r * k_dim;
  float* o = out + r * ldo;
  const bool first = r == 0 && ahead != nullptr;
  switch (m - r) {
    case 3:
      for (int j = 0; j < 16; j += 4) tile<4, 3>(xr, w + j * k_dim, k_dim, first ? ahead + j * k_dim : nullptr, o + j, ldo);
      break;
    case 2:
      for (int j = 0; j < 16; j += 8) tile<8, 2>(xr, w + j * k_dim, k_dim, first ? ahead + j * k_dim : nullptr, o + j, ldo);
      break;
    case 1:
      tile<16, 1>(xr, w, k_dim, first ? ahead : nullptr, o, ldo);
      break;
    default:
      break;
  }
}

// Weight rows past the last full panel (fewer than 16), one at a time against every input row.
void tail_rows(const float* x, int64_t m, int64_t k_dim, const float* w, int64_t rows, float* out, int64_t ldo) {
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t r = 0; r < m; ++r) tile<1, 1>(x + r * k_dim, w + j * k_dim, k_dim, nullptr, out + r * ldo + j, ldo);
  }
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
