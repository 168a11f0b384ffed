// int8_linear on the CPU: int8 input [M, K] times int8 weight [N, K]^T with exact int32 sums, each output
// scaled by its input row's and its weight row's scale (semantics: specops/reference.py). Both operands in
// int8 let AVX-512 VNNI multiply 64 pairs of bytes per instruction where a float32 FMA takes 16: the int8
// screen of a greedy step's output head (specops/decoding/greedy_head.py) reads a quarter of the float32
// head's bytes, and with its activations in int8 too its product stays bound by that read to about 16 rows.
//
// Copies, by the running CPU (int8_dot_isa(); SPECOPS_CPU_ISA caps it as it caps cpu_isa()):
//   avx512_vnni  tiles of 4 weight rows x 4 input rows, 64 bytes of K per step (vpdpbusd, which multiplies
//                unsigned by signed bytes: the input is copied once as x + 128, and 128 * sum_k w is taken off),
//                input rows in blocks of 16 that each sweep up to 64 weight rows;
//   avx2         tiles of 2 x 4, 16 bytes of K per step, widened to int16 (vpmaddwd: exact, no saturation);
//   base         plain loops.
// Every copy's sums are exact, so every copy returns the same bits: float(sum) * input scale * weight scale,
// rounded in that order in float32.
//
// The weight may also come packed (specops.reference.int8_linear_pack: uint8 [ceil(N / 16), ceil(K / 4), 64],
// weight + 128, each 64-byte line 4 consecutive k of 16 weight rows). Then the VNNI copy needs no sums across
// lanes: a line meets 4 bytes of an input row broadcast to every lane, and its 16 lanes are 16 outputs
// (tiles of 2 blocks of 16 weight rows x up to 4 input rows: 8 accumulators; the unsigned operand is the
// stored weight + 128, so 128 sum_k x comes off each input row's sums). Each block is one contiguous run, read
// once from memory and re-read from L1 by each further group of 4 input rows; 1 or 2 input rows go one block
// at a time, in one stream. On Gemma-3-270M's head shape (262,144 x 640, 2-vCPU Zen 5, bench/
// bench_int8_linear.py, 2026-12-07) the op took 16 rows in 7.51 ms against 11.3 row by row, 24 rows in 9.19
// against 15.6. The AVX2 and base copies read the packed layout in plain loops (the greedy head packs only for
// VNNI).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define SPECOPS_INT8_X86 1
#endif

namespace specops {
namespace {

constexpr int64_t kMostK = (int64_t{1} << 17) - 1;  // reference.INT8_LINEAR_MOST_K: K * 128 * 128 < 2^31

struct Int8Args {
  const int8_t* x;      // [M, K]
  const uint8_t* xu;    // [M, K]: x + 128 (the VNNI copy's unsigned operand)
  const float* xs;      // [M]
  const int8_t* w;      // [N, K]
  const float* ws;      // [N]
  float* out;           // [M, N]
  int64_t m, n, k;
};

SPECOPS_INLINE float scaled(int32_t sum, float x_scale, float w_scale) {
  return static_cast<float>(sum) * x_scale * w_scale;
}

// Weight rows [row0, row0 + rows) against every input row, in plain loops.
void rows_base(const Int8Args& a, int64_t row0, int64_t rows) {
  for (int64_t v = row0; v < row0 + rows; ++v) {
    const int8_t* wv = a.w + v * a.k;
    for (int64_t i = 0; i < a.m; ++i) {
      const int8_t* xi = a.x + i * a.k;
      int32_t sum = 0;
      for (int64_t j = 0; j < a.k; ++j) sum += static_cast<int32_t>(wv[j]) * static_cast<int32_t>(xi[j]);
      a.out[i * a.n + v] = scaled(sum, a.xs[i], a.ws[v]);
    }
  }
}

#ifdef SPECOPS_INT8_X86

// (GCC 12's headers build shuffles and reductions from an undefined vector and warn about it.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Lane l of the result is the sum of the 16 lanes of acc[l].
__attribute__((target("avx512f,avx512bw,avx512vl"))) SPECOPS_INLINE __m512i sum16(const __m512i* acc) {
  __m512i pairs[8], quads[4];
  for (int p = 0; p < 8; ++p)
    pairs[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * p], acc[2 * p + 1]),
                                _mm512_unpackhi_epi32(acc[2 * p], acc[2 * p + 1]));
  for (int q = 0; q < 4; ++q)
    quads[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * q], pairs[2 * q + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * q], pairs[2 * q + 1]));
  // quads[q]'s 128-bit lane L holds lane L's partial sums of acc[4q .. 4q + 3]; add the four lanes.
  const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], 0x88),
                                       _mm512_shuffle_i32x4(quads[0], quads[1], 0xdd));
  const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], 0x88),
                                       _mm512_shuffle_i32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xdd));
}

// A tile of up to 4 weight rows (v0 ..) by IN input rows (i0 ..): accumulator 4 * i + r holds input row i0 + i
// against weight row v0 + r, so the 4 outputs of an input row are 4 adjacent lanes of the sums. (rows_vnni
// prefetches the weight rows of the tile after next into L2: the hardware prefetcher follows 4 short rows late.)
template <int IN>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) SPECOPS_INLINE void tile_vnni(
    const Int8Args& a, int64_t v0, int64_t vn, int64_t i0, const int32_t* wsum) {
  __m512i acc[16];
  for (auto& t : acc) t = _mm512_setzero_si512();
  const int8_t* wr[4];
  const uint8_t* xr[IN];
  for (int r = 0; r < 4; ++r) wr[r] = a.w + (v0 + std::min<int64_t>(r, vn - 1)) * a.k;
  for (int i = 0; i < IN; ++i) xr[i] = a.xu + (i0 + i) * a.k;
  for (int64_t j = 0; j < a.k; j += 64) {
    const __mmask64 mask = a.k - j >= 64 ? ~__mmask64{0} : (__mmask64{1} << (a.k - j)) - 1;
    __m512i w[4];
    for (int r = 0; r < 4; ++r) w[r] = _mm512_maskz_loadu_epi8(mask, wr[r] + j);  // zeros past K: no term there
    for (int i = 0; i < IN; ++i) {
      const __m512i x = _mm512_maskz_loadu_epi8(mask, xr[i] + j);
      for (int r = 0; r < 4; ++r) acc[4 * i + r] = _mm512_dpbusd_epi32(acc[4 * i + r], x, w[r]);
    }
  }
  // Lane 4 i + r: the sum less 128 sum_k w[v0 + r], to float, times the input row's scale, then the weight
  // row's. The lanes' sums of (x + 128) w wrap modulo 2^32 (vpdpbusd does not saturate), and so does the
  // subtraction, which leaves sum_k x w: it fits an int32.
  const __mmask8 quad = static_cast<__mmask8>((1u << vn) - 1);
  const __m512i sums = _mm512_sub_epi32(sum16(acc), _mm512_broadcast_i32x4(_mm_loadu_si128(
                                                        reinterpret_cast<const __m128i*>(wsum))));
  const __m512 w_scales = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(quad, a.ws + v0));
  alignas(64) float x_scales[16] = {};
  for (int i = 0; i < IN; ++i)
    for (int r = 0; r < 4; ++r) x_scales[4 * i + r] = a.xs[i0 + i];
  const __m512 out = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_load_ps(x_scales)), w_scales);
  for (int i = 0; i < IN; ++i) {
    const __m128 o4 = i == 0   ? _mm512_castps512_ps128(out)
                      : i == 1 ? _mm512_extractf32x4_ps(out, 1)
                      : i == 2 ? _mm512_extractf32x4_ps(out, 2)
                               : _mm512_extractf32x4_ps(out, 3);
    _mm_mask_storeu_ps(a.out + (i0 + i) * a.n + v0, quad, o4);
  }
}

// 128 sum_k w[v0 + r, k] for the tile's 4 weight rows (the correction for the input's + 128).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) SPECOPS_INLINE void row_sums_vnni(
    const Int8Args& a, int64_t v0, int64_t vn, int32_t* wsum) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int r = 0; r < 4; ++r) {
    const int8_t* wr = a.w + (v0 + std::min<int64_t>(r, vn - 1)) * a.k;
    __m512i acc = _mm512_setzero_si512();
    for (int64_t j = 0; j < a.k; j += 64) {
      const __mmask64 mask = a.k - j >= 64 ? ~__mmask64{0} : (__mmask64{1} << (a.k - j)) - 1;
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(mask, wr + j));
    }
    wsum[r] = static_cast<int32_t>(128u * static_cast<uint32_t>(_mm512_reduce_add_epi32(acc)));  // 128 sum w
  }
}

// Input rows per sweep of the weight rows: the VNNI copy's input block stays in L1 (16 x K bytes, 10 KB for
// Gemma-3-270M's head). On its head's shape, 48 rows took 44 ms against 51 with every row in one sweep, 64 rows
// 60 against 67, and up to 32 rows the same (medians of 3 alternating runs, 2-vCPU Zen 5).
constexpr int64_t kInputBlock = 16;
// Weight bytes a sweep covers before the next input block re-reads them (from L2): up to 64 rows, at least 4.
constexpr int64_t kSweepBytes = int64_t{1} << 18;

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void rows_vnni(const Int8Args& a, int64_t row0,
                                                                                 int64_t rows) {
  const int64_t end = row0 + rows;
  const int64_t sweep = std::clamp<int64_t>(kSweepBytes / std::max<int64_t>(a.k, 1) / 4 * 4, 4, 64);
  int32_t wsum[64];
  for (int64_t s = row0; s < end; s += sweep) {
    const int64_t s_end = std::min(s + sweep, end);
    for (int64_t i0 = 0; i0 < a.m; i0 += kInputBlock) {
      const int64_t i_end = std::min(i0 + kInputBlock, a.m);
      for (int64_t v = s; v < s_end; v += 4) {
        const int64_t vn = std::min<int64_t>(4, s_end - v);
        int32_t* sums = wsum + (v - s);
        if (i0 == 0) {  // the first input block reads the weight rows from memory
          if (v + 12 <= a.n) {
            const char* ahead = reinterpret_cast<const char*>(a.w + (v + 8) * a.k);
            for (int64_t b = 0; b < 4 * a.k; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
          }
          row_sums_vnni(a, v, vn, sums);
        }
        int64_t i = i0;
        for (; i + 4 <= i_end; i += 4) tile_vnni<4>(a, v, vn, i, sums);
        switch (i_end - i) {
          case 3: tile_vnni<3>(a, v, vn, i, sums); break;
          case 2: tile_vnni<2>(a, v, vn, i, sums); break;
          case 1: tile_vnni<1>(a, v, vn, i, sums); break;
          default: break;
        }
      }
    }
  }
}

#pragma GCC diagnostic pop

// Lane sums of 8 int32 lanes, for one accumulator.
__attribute__((target("avx2"))) SPECOPS_INLINE int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// A tile of up to 2 weight rows by up to 4 input rows, 16 bytes of K at a time widened to int16.
__attribute__((target("avx2"))) void tile_avx2(const Int8Args& a, int64_t v0, int64_t vn, int64_t i0, int64_t in) {
  __m256i acc[8];
  for (auto& t : acc) t = _mm256_setzero_si256();
  const int8_t* wr[2];
  const int8_t* xr[4];
  for (int r = 0; r < 2; ++r) wr[r] = a.w + (v0 + std::min<int64_t>(r, vn - 1)) * a.k;
  for (int i = 0; i < 4; ++i) xr[i] = a.x + (i0 + std::min<int64_t>(i, in - 1)) * a.k;
  const int64_t whole = a.k - a.k % 16;
  for (int64_t j = 0; j < whole; j += 16) {
    __m256i w[2];
    for (int r = 0; r < 2; ++r)
      w[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[r] + j)));
    for (int i = 0; i < 4; ++i) {
      if (i >= in) break;
      const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr[i] + j)));
      for (int r = 0; r < 2; ++r) acc[2 * i + r] = _mm256_add_epi32(acc[2 * i + r], _mm256_madd_epi16(w[r], x));
    }
  }
  for (int i = 0; i < in; ++i) {
    float* o = a.out + (i0 + i) * a.n + v0;
    for (int r = 0; r < vn; ++r) {
      int32_t sum = sum8(acc[2 * i + r]);
      for (int64_t j = whole; j < a.k; ++j) sum += static_cast<int32_t>(wr[r][j]) * static_cast<int32_t>(xr[i][j]);
      o[r] = scaled(sum, a.xs[i0 + i], a.ws[v0 + r]);
    }
  }
}

__attribute__((target("avx2"))) void rows_avx2(const Int8Args& a, int64_t row0, int64_t rows) {
  for (int64_t v = row0; v < row0 + rows; v += 2) {
    const int64_t vn = std::min<int64_t>(2, row0 + rows - v);
    for (int64_t i = 0; i < a.m; i += 4) tile_avx2(a, v, vn, i, std::min<int64_t>(4, a.m - i));
  }
}

#endif  // SPECOPS_INT8_X86

enum class Int8Isa { vnni, avx2, base };
Int8Isa int8_isa();

// ---- The packed layout ----

constexpr int64_t kBlock = 16;  // weight rows per packed block

struct PackedArgs {
  const int8_t* x;       // [M, K]
  const int32_t* xq;     // [M, K4]: 4 bytes of an input row each, zeros past K (the VNNI copy's broadcasts)
  const uint32_t* xsum;  // [M]: 128 sum_k x, modulo 2^32
  const float* xs;       // [M]
  const uint8_t* p;      // [NB, K4, 64]: weight + 128
  const float* ws;       // [N]
  float* out;            // [M, N]
  int64_t m, n, k, k4, blocks;
};

// Blocks [b0, b1) against every input row, in plain loops.
void blocks_base(const PackedArgs& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* pb = a.p + b * a.k4 * 64;
    for (int64_t c = 0; c < kBlock && b * kBlock + c < a.n; ++c) {
      const int64_t v = b * kBlock + c;
      for (int64_t i = 0; i < a.m; ++i) {
        const int8_t* xi = a.x + i * a.k;
        int32_t sum = 0;
        for (int64_t j = 0; j < a.k; ++j)
          sum += (static_cast<int32_t>(pb[(j / 4) * 64 + c * 4 + j % 4]) - 128) * static_cast<int32_t>(xi[j]);
        a.out[i * a.n + v] = scaled(sum, a.xs[i], a.ws[v]);
      }
    }
  }
}

#ifdef SPECOPS_INT8_X86

#pragma GCC diagnostic push  // (as above)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// CB blocks from block b (32 or 16 weight rows) against R input rows from i0: accumulator CB r + c holds input
// row i0 + r against the 16 rows of block b + c. `ahead` (nullptr: none): the same place in the blocks after
// these, prefetched into L2 a line per line read (the next tile's weight arrives while this one computes).
template <int R, int CB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) SPECOPS_INLINE void packed_tile_vnni(
    const PackedArgs& a, int64_t b, int64_t i0, const uint8_t* ahead) {
  __m512i acc[R * CB];
  for (auto& t : acc) t = _mm512_setzero_si512();
  const int64_t stride = a.k4 * 64;  // bytes per block
  const uint8_t* pb = a.p + b * stride;
  const int32_t* xr = a.xq + i0 * a.k4;
  for (int64_t q = 0; q < a.k4; ++q) {
    __m512i w[CB];
    for (int c = 0; c < CB; ++c) w[c] = _mm512_loadu_si512(pb + c * stride + q * 64);
    if (ahead != nullptr) {
      for (int c = 0; c < CB; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + c * stride + q * 64), _MM_HINT_T1);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(xr[r * a.k4 + q]);
      for (int c = 0; c < CB; ++c) acc[r * CB + c] = _mm512_dpbusd_epi32(acc[r * CB + c], w[c], xb);
    }
  }
  // Lane l of accumulator (r, c): sum_k (w + 128) x, modulo 2^32 (vpdpbusd does not saturate); less
  // 128 sum_k x it is sum_k w x, which fits an int32. Then float, times the input row's scale, then the
  // weight row's.
  for (int c = 0; c < CB; ++c) {
    const int64_t v0 = (b + c) * kBlock;
    const __mmask16 cols = static_cast<__mmask16>(a.n - v0 >= kBlock ? 0xffff : (1u << (a.n - v0)) - 1);
    const __m512 w_scales = _mm512_maskz_loadu_ps(cols, a.ws + v0);
    for (int r = 0; r < R; ++r) {
      const __m512i sums = _mm512_sub_epi32(acc[r * CB + c], _mm512_set1_epi32(static_cast<int32_t>(a.xsum[i0 + r])));
      const __m512 out = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(a.xs[i0 + r])), w_scales);
      _mm512_mask_storeu_ps(a.out + (i0 + r) * a.n + v0, cols, out);
    }
  }
}

template <int CB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void packed_rows_vnni(const PackedArgs& a, int64_t b,
                                                                                       const uint8_t* ahead) {
  // Input rows in near-equal groups of at most 4 (8 accumulators: with 16 or more GCC kept some in memory).
  const int64_t groups = (a.m + 3) / 4, base = a.m / groups, extra = a.m % groups;
  int64_t i = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = base + (g < extra ? 1 : 0);
    const uint8_t* pf = g == 0 ? ahead : nullptr;  // the first group reads from memory
    switch (rows) {
      case 4: packed_tile_vnni<4, CB>(a, b, i, pf); break;
      case 3: packed_tile_vnni<3, CB>(a, b, i, pf); break;
      case 2: packed_tile_vnni<2, CB>(a, b, i, pf); break;
      default: packed_tile_vnni<1, CB>(a, b, i, pf); break;
    }
    i += rows;
  }
}

// Blocks [b0, b1) in pairs (the last may be one block).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void blocks_vnni(const PackedArgs& a, int64_t b0,
                                                                                   int64_t b1) {
  const int64_t stride = a.k4 * 64;
  if (a.m <= 2) {
    // Bound by the read: one block at a time, one stream, prefetched two blocks ahead. Gemma-3-270M's head
    // (2-vCPU Zen 5, bench/bench_int8_linear.py, medians of three alternating runs of each build, 2026-12-07):
    // 1 and 2 rows 4.3-4.6 ms against 5.1-5.2 in pairs (two streams 10 KB apart); from a few rows on the
    // pairs' 8 accumulators pay.
    for (int64_t b = b0; b < b1; ++b) packed_rows_vnni<1>(a, b, b + 3 <= a.blocks ? a.p + (b + 2) * stride : nullptr);
    return;
  }
  for (int64_t b = b0; b < b1; b += 2) {
    const uint8_t* ahead = b + 4 <= a.blocks ? a.p + (b + 2) * stride : nullptr;
    if (b + 2 <= b1) {
      packed_rows_vnni<2>(a, b, ahead);
    } else {
      packed_rows_vnni<1>(a, b, nullptr);
    }
  }
}

#pragma GCC diagnostic pop

#endif  // SPECOPS_INT8_X86

at::Tensor packed_product(const at::Tensor& x, const at::Tensor& xs, const at::Tensor& p, const at::Tensor& ws,
                          at::Tensor out) {
  const int64_t m = x.size(0), k = x.size(1), n = ws.size(0), k4 = p.size(1), blocks = p.size(0);
  const int8_t* xp = x.data_ptr<int8_t>();
  void (*fn)(const PackedArgs&, int64_t, int64_t) = blocks_base;
#ifdef SPECOPS_INT8_X86
  if (int8_isa() == Int8Isa::vnni) fn = blocks_vnni;
#endif
  // The VNNI copy's broadcast rows and row sums; the plain loops read x itself.
  std::vector<int32_t> xq;
  std::vector<uint32_t> xsum;
  if (fn != blocks_base) {
    xq.assign(m * k4, 0);
    xsum.assign(m, 0);
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(xq.data() + i * k4, xp + i * k, k);
      int64_t sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += xp[i * k + j];
      xsum[i] = 128u * static_cast<uint32_t>(sum);
    }
  }
  const PackedArgs args{xp, xq.data(), xsum.data(), xs.data_ptr<float>(), p.data_ptr<uint8_t>(), ws.data_ptr<float>(),
                        out.data_ptr<float>(), m, n, k, k4, blocks};
  // Tasks of pairs of blocks, at least 256 KB of weight each.
  const int64_t pairs = (blocks + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (2 * 64 * std::max<int64_t>(k4, 1)));
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    fn(args, 2 * begin, std::min(2 * end, blocks));
  });
  return out;
}

using RowsFn = void (*)(const Int8Args&, int64_t, int64_t);

Int8Isa int8_isa() {
  static const Int8Isa isa = [] {
#ifdef SPECOPS_INT8_X86
    const Isa cap = cpu_isa();  // SPECOPS_CPU_ISA's cap included
    if (cap == Isa::avx512 && __builtin_cpu_supports("avx512vnni")) return Int8Isa::vnni;
    if (cap == Isa::avx512 || cap == Isa::avx2) return Int8Isa::avx2;
#endif
    return Int8Isa::base;
  }();
  return isa;
}

RowsFn rows_fn() {
  switch (int8_isa()) {
#ifdef SPECOPS_INT8_X86
    case Int8Isa::vnni: return rows_vnni;
    case Int8Isa::avx2: return rows_avx2;
#endif
    default: return rows_base;
  }
}

at::Tensor int8_linear_cpu(const at::Tensor& input, const at::Tensor& input_scales, const at::Tensor& weight,
                           const at::Tensor& weight_scales) {
  TORCH_CHECK_VALUE(input.dim() == 2 && input.scalar_type() == at::kChar, "int8_linear: input must be int8 [M, K]");
  const bool packed = weight.dim() == 3 && weight.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE(packed || (weight.dim() == 2 && weight.scalar_type() == at::kChar),
                    "int8_linear: weight must be int8 [N, K], or uint8 [ceil(N / 16), ceil(K / 4), 64] packed by "
                    "int8_linear_pack");
  const int64_t m = input.size(0), k = input.size(1);
  const int64_t n = packed ? (weight_scales.dim() == 1 ? weight_scales.size(0) : -1) : weight.size(0);
  TORCH_CHECK_VALUE(packed || weight.size(1) == k, "int8_linear: weight must be [N, K] with K = ", k, ", got [", n,
                    ", ", weight.size(1), "]");
  TORCH_CHECK_VALUE(k <= kMostK, "int8_linear: K = ", k, " is longer than ", kMostK,
                    " (the int32 sums would overflow)");
  TORCH_CHECK_VALUE(input_scales.dim() == 1 && input_scales.size(0) == m && input_scales.scalar_type() == at::kFloat,
                    "int8_linear: input_scales must be float32 [M] with M = ", m);
  TORCH_CHECK_VALUE(weight_scales.dim() == 1 && weight_scales.size(0) == n &&
                        weight_scales.scalar_type() == at::kFloat,
                    "int8_linear: weight_scales must be float32 [N]", packed ? "" : " with N = ",
                    packed ? "" : std::to_string(n));
  if (packed) {
    const int64_t blocks = (n + 15) / 16, quads = (k + 3) / 4;
    TORCH_CHECK_VALUE(weight.size(0) == blocks && weight.size(1) == quads && weight.size(2) == 64,
                      "int8_linear: a packed weight for N = ", n, " and K = ", k, " must be [", blocks, ", ", quads,
                      ", 64], got ", weight.sizes());
  }
  at::Tensor out = at::empty({m, n}, input.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  if (packed) {
    return packed_product(input.contiguous(), input_scales.contiguous(), weight.contiguous(),
                          weight_scales.contiguous(), out);
  }
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const at::Tensor xs = input_scales.contiguous(), ws = weight_scales.contiguous();
  const int8_t* xp = x.data_ptr<int8_t>();
  std::vector<uint8_t> shifted(m * k);
  for (int64_t j = 0; j < m * k; ++j) shifted[j] = static_cast<uint8_t>(static_cast<int32_t>(xp[j]) + 128);
  const Int8Args args{xp, shifted.data(), xs.data_ptr<float>(), w.data_ptr<int8_t>(), ws.data_ptr<float>(),
                      out.data_ptr<float>(), m, n, k};
  const RowsFn fn = rows_fn();
  constexpr int64_t kPanel = 64;  // weight rows per task step (a multiple of every copy's tile)
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (kPanel * std::max<int64_t>(k, 1)));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t row0 = p * kPanel;
      fn(args, row0, std::min(kPanel, n - row0));
    }
  });
  return out;
}

}  // namespace

// The copy int8_linear takes on this CPU ("avx512_vnni", "avx2" or "base"), for specops._C.int8_dot_isa().
const char* int8_dot_isa_name() {
  switch (int8_isa()) {
    case Int8Isa::vnni: return "avx512_vnni";
    case Int8Isa::avx2: return "avx2";
    default: return "base";
  }
}

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("int8_linear", &int8_linear_cpu); }

}  // namespace specops
