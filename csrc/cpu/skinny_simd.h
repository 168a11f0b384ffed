// The register tiles of skinny_linear (csrc/cpu/skinny_linear.cpp): a panel of 16 weight rows against
// every input row. Compiled once per instruction set through per_isa.h, with SPECOPS_ISA naming the
// namespace. No include guard; internal linkage.

namespace specops {
namespace {
namespace SPECOPS_ISA {

#include "simd_math.h"
#include "lane_tree.h"

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
