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
// The same rows of `ahead` (the next panel: the hardware prefetcher ramps up too slowly on streams 2.5 KB
// long; nullptr: none) are prefetched into L2 at k steps phase, phase + phases, ...: prefetching into L1,
// or every line in a burst, fills the core's miss queue and stalls the arithmetic behind it.
template <int JB, int RB>
SPECOPS_INLINE void tile(const float* x, const float* w, int64_t k_dim, const float* ahead, int phase, int phases,
                         float* out, int64_t ldo) {
  static_assert(JB * RB <= 16, "a tile holds at most 16 accumulators");
  f32x16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = f32x16{};
  int64_t k = 0;
  int turn = phase;
  for (; k + kLanes <= k_dim; k += kLanes) {
    f32x16 wv[JB], xv[RB];
    for (int a = 0; a < JB; ++a) wv[a] = load16(w + a * k_dim + k);
    if (ahead != nullptr && turn == 0) {
      for (int a = 0; a < JB; ++a) __builtin_prefetch(ahead + a * k_dim + k, 0, 1);
    }
    turn = turn + 1 == phases ? 0 : turn + 1;
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

// One group of RB input rows against the 16 rows of a panel, JB weight rows per tile.
template <int JB, int RB>
SPECOPS_INLINE void tiles(const float* x, const float* w, int64_t k_dim, const float* ahead, int phase, int phases,
                          float* out, int64_t ldo) {
  for (int j = 0; j < 16; j += JB) {
    tile<JB, RB>(x, w + j * k_dim, k_dim, ahead ? ahead + j * k_dim : nullptr, phase, phases, out + j, ldo);
  }
}

// A panel of 16 weight rows w against all m input rows x: out[r * ldo + j] for r < m, j < 16. The rows
// go in G = ceil(m / 4) groups of near-equal size (4 rows: 4 x 4 tiles; 1-3: tiles as wide as 16
// accumulators allow), the panel re-read from L1/L2 by every group after the first. The weight is read
// from memory once. Group g prefetches its share of the next panel (`ahead`, nullptr: none): k steps
// g, g + G, ..., so that requests to memory are spread over the panel's whole arithmetic.
void panel(const float* x, int64_t m, int64_t k_dim, const float* w, const float* ahead, float* out,
           int64_t ldo) {
  const int64_t groups = (m + 3) / 4;
  const int64_t base = m / groups, extra = m % groups;
  const int phases = static_cast<int>(std::min<int64_t>(groups, 16));
  int64_t r = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = base + (g < extra ? 1 : 0);
    const float* xr = x + r * k_dim;
    float* o = out + r * ldo;
    const float* pf = g < phases ? ahead : nullptr;
    const int phase = static_cast<int>(g);
    switch (rows) {
      case 4: tiles<4, 4>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 3: tiles<4, 3>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 2: tiles<8, 2>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      default: tiles<16, 1>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
    }
    r += rows;
  }
}

// Weight rows past the last full panel (fewer than 16), one at a time against every input row.
void tail_rows(const float* x, int64_t m, int64_t k_dim, const float* w, int64_t rows, float* out, int64_t ldo) {
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t r = 0; r < m; ++r) {
      tile<1, 1>(x + r * k_dim, w + j * k_dim, k_dim, nullptr, 0, 1, out + r * ldo + j, ldo);
    }
  }
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
