// The register tiles of skinny_linear (csrc/cpu/skinny_linear.cpp): a panel of 16 weight rows against
// every input row. Compiled once per instruction set through per_isa.h, with SPECOPS_ISA naming the
// namespace. No include guard; internal linkage.

namespace specops {
namespace {
namespace SPECOPS_ISA {

#include "simd_math.h"
#include "lane_tree.h"

// Where it is this group's turn, prefetches k step k of the next panel's JB rows (`ahead`) into L2; then
// moves the turn on by one k step (the turns of `tile` below).
template <int JB>
SPECOPS_INLINE void prefetch_turn(const float* ahead, int64_t k_dim, int64_t k, int phases, int& turn) {
  if (ahead != nullptr && turn < 2) {
    for (int a = 0; a < JB; ++a) __builtin_prefetch(ahead + a * k_dim + k, 0, 1);
  }
  turn = turn + 1 == 2 * phases ? 0 : turn + 1;
}

// out[b * ldo + a] = dot(x row b, w row a) for a < JB weight rows and b < RB input rows (JB * RB <= 16
// accumulators). Each dot runs 16 lanes over k, then the lane tree, then the k % 16 tail in order, one
// explicit fused multiply-add per term (left to the compiler, a term's multiply and add were contracted in
// one tile and not in another: quantized_linear's tail, vectorized across its accumulators, rounded twice).
// The same rows of `ahead` (the next panel: the hardware prefetcher ramps up too slowly on streams 2.5 KB
// long; nullptr: none) are prefetched into L2 by pairs of k steps (128 bytes of a row): pairs phase,
// phase + phases, ...: prefetching into L1, or every line in a burst, fills the core's miss queue and
// stalls the arithmetic behind it. By pairs, because the L2 fetches a line's 128-byte buddy with it: with
// single k steps dealt out in turn, the groups of a panel after the first found their lines already there
// whenever their count was even, the memory then sat idle for half of the panel's arithmetic, and 8 rows
// (2 groups) cost 35-36 ms of Gemma-3's 671 MB head where 9 rows (3 groups) cost 29 (2-vCPU Xeon).
template <int JB, int RB>
SPECOPS_INLINE void tile(const float* x, const float* w, int64_t k_dim, const float* ahead, int phase, int phases,
                         float* out, int64_t ldo) {
  static_assert(JB * RB <= 16, "a tile holds at most 16 accumulators");
  f32x16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = f32x16{};
  int64_t k = 0;
  int turn = phase == 0 ? 0 : 2 * (phases - phase);  // k step i is prefetched where (i / 2) % phases == phase
#ifdef SPECOPS_ISA_AVX512
  for (; k + kLanes <= k_dim; k += kLanes) {
    f32x16 wv[JB], xv[RB];
    for (int a = 0; a < JB; ++a) wv[a] = load16(w + a * k_dim + k);
    prefetch_turn<JB>(ahead, k_dim, k, phases, turn);
    for (int b = 0; b < RB; ++b) xv[b] = load16(x + b * k_dim + k);
    for (int b = 0; b < RB; ++b) {
      for (int a = 0; a < JB; ++a) acc[b * JB + a] += wv[a] * xv[b];
    }
  }
#else
  // Without 64-byte registers GCC keeps a 16-lane vector in memory between operations (the loop was all
  // moves: 240 vmovdqa for 32 FMAs). The same 16 lanes as two 8-lane halves stay in ymm registers; each
  // lane sees the same products in the same order, so a row's result is the AVX-512 copy's bits.
  using f32x8 = float __attribute__((vector_size(32)));
  f32x8 lo[JB * RB], hi[JB * RB];
  for (int i = 0; i < JB * RB; ++i) lo[i] = hi[i] = f32x8{};
  for (; k + kLanes <= k_dim; k += kLanes) {
    f32x8 wl[JB], wh[JB], xl[RB], xh[RB];
    for (int a = 0; a < JB; ++a) {
      std::memcpy(&wl[a], w + a * k_dim + k, sizeof(f32x8));
      std::memcpy(&wh[a], w + a * k_dim + k + 8, sizeof(f32x8));
    }
    prefetch_turn<JB>(ahead, k_dim, k, phases, turn);
    for (int b = 0; b < RB; ++b) {
      std::memcpy(&xl[b], x + b * k_dim + k, sizeof(f32x8));
      std::memcpy(&xh[b], x + b * k_dim + k + 8, sizeof(f32x8));
    }
    for (int b = 0; b < RB; ++b) {
      for (int a = 0; a < JB; ++a) {
        lo[b * JB + a] += wl[a] * xl[b];
        hi[b * JB + a] += wh[a] * xh[b];
      }
    }
  }
  for (int i = 0; i < JB * RB; ++i) {
    acc[i] = __builtin_shufflevector(lo[i], hi[i], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
#endif
  const f32x16 sums = reduce16(acc);
  for (int b = 0; b < RB; ++b) {
    for (int a = 0; a < JB; ++a) {
      float s = sums[b * JB + a];
      for (int64_t t = k; t < k_dim; ++t) s = __builtin_fmaf(w[a * k_dim + t], x[b * k_dim + t], s);
      out[b * ldo + a] = s;
    }
  }
}

// Input rows per group. A 16-lane vector is one zmm register with AVX-512 (32 of them: 4 x 4 tiles keep 16
// accumulators and 8 operands in registers) and two ymm registers with AVX2 (16 of them: 2 x 2 tiles, 4
// accumulators and 4 operands, fill them; the 4 x 4 tiles spilled to the stack on every FMA and made 16 rows
// cost 14x what reading the weight does, against 2x with AVX-512: bench/bench_floor.py).
#ifdef SPECOPS_ISA_AVX512
constexpr int64_t kGroupRows = 4;
#else
constexpr int64_t kGroupRows = 2;
#endif

// One group of RB input rows against the 16 rows of a panel, JB weight rows per tile.
template <int JB, int RB>
SPECOPS_INLINE void tiles(const float* x, const float* w, int64_t k_dim, const float* ahead, int phase, int phases,
                          float* out, int64_t ldo) {
  for (int j = 0; j < 16; j += JB) {
    tile<JB, RB>(x, w + j * k_dim, k_dim, ahead ? ahead + j * k_dim : nullptr, phase, phases, out + j, ldo);
  }
}

// A panel of 16 weight rows w against all m input rows x: out[r * ldo + j] for r < m, j < 16. The rows
// go in G = ceil(m / kGroupRows) groups (AVX-512: 5 to 8 rows in one group of 2 x m tiles, and from 9 rows
// on Intel CPUs one more group where G is even) of near-equal size (AVX-512: 4 rows in 4 x 4 tiles, 1-3 in
// tiles as wide as 16 accumulators allow; AVX2 and the baseline: 2 x 2 and 2 x 1), the panel re-read from
// L1/L2 by every group after the first. The weight is read from memory once. Group g prefetches its share of
// the next panel (`ahead`, nullptr: none): pairs of k steps g, g + G, ..., so that requests to memory are
// spread over the panel's whole arithmetic.
void panel(const float* x, int64_t m, int64_t k_dim, const float* w, const float* ahead, float* out,
           int64_t ldo) {
  int64_t groups = (m + kGroupRows - 1) / kGroupRows;
#ifdef SPECOPS_ISA_AVX512
  // 5 to 8 rows: one group in 2 x m tiles rather than two or three groups of 1-4 rows, so the panel is read
  // once, from memory, and not again from L2 while the next panel's prefetches arrive there. The arithmetic
  // costs about the same either way (5 rows on a weight held in L2: 11.4 ms for the 671 MB head's products
  // both ways), but the stream hides it better: on the 2-vCPU Xeon Gemma-3's head took 5 rows in 26.1-27.5 ms
  // against 26.9-28.2, 6 rows in 27.2-27.6 against 27.7-28.8 (four runs each way, alternating), 7 and 8 rows
  // the same time either way, and 12 rows in two such groups 10 % longer (2026-12-05). On a 2-vCPU AMD EPYC
  // (Zen 4) 7 rows took 21.0-23.3 ms against 27.6-29.7 in three groups, 8 rows 23.2-24.9 against 28.8-29.3,
  // and 9 to 16 rows in groups of 5 to 8 took 10-15 % longer than in groups of 3 and 4 (2026-12-05).
  //
  // From 9 rows, on Intel CPUs, an odd number of groups: 16 rows in 5 groups took 37.1-38.4 ms where 4 groups
  // of 4 took 38.2-38.6 (and 8 rows in 3 groups 30.2-30.6 against 31.8-31.9 in 2, before the rule above; the
  // 2-vCPU Xeon), which the L2's fetches of a line's 128-byte buddy explain (`tile`). The Zen 4 EPYC went the
  // other way: 13 rows in 5 groups 36.5-38.6 ms against 29.9-31.5 in 4, 14 rows 37.0-38.1 against 32.1-32.3,
  // 16 rows 35.1-36.4 against 34.3-35.0, so other CPUs keep ceil(m / 4). The AVX2 copy's groups of 2 went
  // the other way on the Xeon too (16 rows: 61.5-63.2 ms against 57.5-57.6), so it keeps ceil(m / 2). Each
  // output is the same dot product in any group, so the bits do not change.
  if (m >= 5 && m <= 8) {
    groups = 1;
  } else if (groups % 2 == 0 && groups < m && cpu_is_intel()) {
    ++groups;
  }
#endif
  const int64_t base = m / groups, extra = m % groups;
  const int phases = static_cast<int>(std::min<int64_t>(groups, 16));
  int64_t r = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = base + (g < extra ? 1 : 0);
    const float* xr = x + r * k_dim;
    float* o = out + r * ldo;
    const float* pf = g < phases ? ahead : nullptr;
    const int phase = static_cast<int>(g);
#ifdef SPECOPS_ISA_AVX512
    switch (rows) {
      case 8: tiles<2, 8>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 7: tiles<2, 7>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 6: tiles<2, 6>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 5: tiles<2, 5>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 4: tiles<4, 4>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 3: tiles<4, 3>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      case 2: tiles<8, 2>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
      default: tiles<16, 1>(xr, w, k_dim, pf, phase, phases, o, ldo); break;
    }
#else
    if (rows == 2) {
      tiles<2, 2>(xr, w, k_dim, pf, phase, phases, o, ldo);
    } else {
      tiles<2, 1>(xr, w, k_dim, pf, phase, phases, o, ldo);
    }
#endif
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
