// The register tiles of quantized_linear (csrc/cpu/quantized_linear.cpp): skinny_linear's tiles with the
// weight de-quantized to float32 in registers as it streams in (bfloat16, int8 with per-group scales,
// int4 with per-group scales and minimums), the activations staying float32; or, for many input rows and
// without 64-byte registers, de-quantized once per panel into a buffer that skinny_linear's own panel
// reads. Compiled once per instruction set through per_isa.h, with SPECOPS_ISA naming the namespace. No
// include guard; internal linkage.

#include "skinny_simd.h"  // skinny_linear's panel (and, inside this copy's namespace, simd_math.h, lane_tree.h)

namespace specops {
namespace {
namespace SPECOPS_ISA {

// 16 bytes or 16 halves widened to 32-bit lanes (sign-extended for int8_t, zero-extended otherwise). One
// widening load per vector with AVX-512 and two with AVX2; GCC 12 splits __builtin_convertvector between
// these sizes into several shuffles per vector, which made the tiles shuffle-bound, so the x86 copies use
// intrinsics and the portable copy the conversion.
template <typename T>
SPECOPS_INLINE i32x16 widen(const T* p) {
  static_assert(sizeof(T) <= 2, "bytes or halves");
#if defined(SPECOPS_ISA_AVX512)
  __m512i v;
  if constexpr (std::is_same_v<T, int8_t>) {
    v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (sizeof(T) == 1) {
    v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  return reinterpret_cast<i32x16>(v);
#elif defined(SPECOPS_ISA_AVX2)
  __m256i half[2];
  for (int h = 0; h < 2; ++h) {
    if constexpr (std::is_same_v<T, int8_t>) {
      half[h] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    } else if constexpr (sizeof(T) == 1) {
      half[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    } else {
      half[h] = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h)));
    }
  }
  i32x16 v;
  std::memcpy(&v, half, sizeof(v));
  return v;
#else
  T b[16];
  std::memcpy(b, p, sizeof(b));
  i32x16 v;
  for (int l = 0; l < 16; ++l) v[l] = b[l];
  return v;
#endif
}

// Each format gives the float32 weights of `row` at k .. k + 16 * kVectors - 1 (k a multiple of that
// inside one group) from that group's parameters, the address to prefetch for them, and single weights
// for the k % 16 tail. kPrefetchEvery: weights per 64-byte line.
struct Bf16Weights {
  static constexpr int kVectors = 1;
  static constexpr int64_t kPrefetchEvery = 32;
  const QuantArgs& q;
  struct Group {};
  SPECOPS_INLINE Group group(int64_t, int64_t) const { return {}; }
  SPECOPS_INLINE const uint16_t* at(int64_t row, int64_t k) const {
    return static_cast<const uint16_t*>(q.weight) + row * q.k_dim + k;
  }
  SPECOPS_INLINE void load(int64_t row, int64_t k, Group, f32x16* out) const {
    out[0] = std::bit_cast<f32x16>(widen(at(row, k)) << 16);
  }
  SPECOPS_INLINE float scalar(int64_t row, int64_t k) const {
    return std::bit_cast<float>(static_cast<uint32_t>(*at(row, k)) << 16);
  }
  SPECOPS_INLINE void fill(int64_t row, int64_t k, int64_t end, Group, float* out) const {
    const uint16_t* v = at(row, 0);
    for (int64_t t = k; t < end; ++t) out[t] = std::bit_cast<float>(static_cast<uint32_t>(v[t]) << 16);
  }
};

struct Int8Weights {
  static constexpr int kVectors = 1;
  static constexpr int64_t kPrefetchEvery = 64;
  const QuantArgs& q;
  struct Group {
    float scale;
  };
  SPECOPS_INLINE Group group(int64_t row, int64_t g) const { return {q.scales[row * q.groups + g]}; }
  SPECOPS_INLINE const int8_t* at(int64_t row, int64_t k) const {
    return static_cast<const int8_t*>(q.weight) + row * q.k_dim + k;
  }
  SPECOPS_INLINE void load(int64_t row, int64_t k, Group p, f32x16* out) const {
    out[0] = __builtin_convertvector(widen(at(row, k)), f32x16) * p.scale;
  }
  SPECOPS_INLINE float scalar(int64_t row, int64_t k) const {
    return static_cast<float>(*at(row, k)) * q.scales[row * q.groups + k / q.group_size];
  }
  SPECOPS_INLINE void fill(int64_t row, int64_t k, int64_t end, Group p, float* out) const {
    const int8_t* v = at(row, 0);
    for (int64_t t = k; t < end; ++t) out[t] = static_cast<float>(v[t]) * p.scale;
  }
};

// Two 4-bit weights per byte: in each block of 32 weights, byte j holds weight j in its low nibble and
// weight j + 16 in its high nibble, so one widening load gives both vectors of a block. K is a multiple
// of 32: there is no tail.
struct Int4Weights {
  static constexpr int kVectors = 2;
  static constexpr int64_t kPrefetchEvery = 128;
  const QuantArgs& q;
  struct Group {
    float scale, min;
  };
  SPECOPS_INLINE Group group(int64_t row, int64_t g) const {
    return {q.scales[row * q.groups + g], q.mins[row * q.groups + g]};
  }
  SPECOPS_INLINE const uint8_t* at(int64_t row, int64_t k) const {
    return static_cast<const uint8_t*>(q.weight) + row * (q.k_dim / 2) + k / 2;
  }
  SPECOPS_INLINE void load(int64_t row, int64_t k, Group p, f32x16* out) const {
    const i32x16 v = widen(at(row, k));
#if defined(SPECOPS_ISA_AVX512)
    // The group's 16 values min + scale * i in one register, looked up by nibble (vpermps reads the low
    // 4 bits of each lane): one multiply-add per 32 weights instead of two conversions and two.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(p.scale), iota, _mm512_set1_ps(p.min));
    const __m512i lanes = reinterpret_cast<__m512i>(v);
    out[0] = reinterpret_cast<f32x16>(_mm512_permutexvar_ps(lanes, table));
    out[1] = reinterpret_cast<f32x16>(_mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table));
#else
    out[0] = __builtin_convertvector(v & 15, f32x16) * p.scale + p.min;
    out[1] = __builtin_convertvector(v >> 4, f32x16) * p.scale + p.min;
#endif
  }
  SPECOPS_INLINE float scalar(int64_t, int64_t) const { return 0.0f; }  // never called: K % 32 == 0
  SPECOPS_INLINE void fill(int64_t row, int64_t k, int64_t end, Group p, float* out) const {
    for (; k < end; k += 32) {
      const uint8_t* v = at(row, k);
      for (int j = 0; j < 16; ++j) {
        out[k + j] = static_cast<float>(v[j] & 15) * p.scale + p.min;
        out[k + 16 + j] = static_cast<float>(v[j] >> 4) * p.scale + p.min;
      }
    }
  }
};

// Input rows from which a full panel is de-quantized once into a float32 buffer and handed to
// skinny_linear's panel: 16 with AVX-512 (a prefill, where de-quantizing in registers per 4 input rows made
// the tiles half conversion work), and 1 otherwise: a 16-lane vector is two ymm registers with AVX2 (four
// xmm in the baseline), and GCC kept the in-register tiles' vectors on the stack (int8, Gemma-3-270M's head,
// 2 threads, AMD EPYC with SPECOPS_CPU_ISA=avx2: 4 rows 86 ms, against 9 with AVX-512). The buffer holds
// exactly the values the format's `load` gives and skinny_linear's tiles sum the same products in the same
// lane order: the bits do not depend on which path computed a row.
#ifdef SPECOPS_ISA_AVX512
constexpr int64_t kBufferedRows = 16;
#else
constexpr int64_t kBufferedRows = 1;
#endif

// Weight rows row0 .. row0 + 15 of format W into buf [16, k_dim] as float32, the next panel (`ahead`)
// prefetched alongside. With AVX-512 through the format's `load` (16 weights a register); otherwise through
// its `fill`, a plain loop over a group that GCC vectorizes in 8-lane registers (the 16-lane `load` went
// through the stack there: int4 at 2 cycles a weight). Both give the same values: one conversion and one
// multiply (int4: a multiply-add, fused where `load`'s is) per weight.
template <class W>
void dequantize_panel(const W& w, int64_t row0, int64_t ahead, float* buf) {
  const int64_t k_dim = w.q.k_dim;
  const int64_t full = k_dim / (kLanes * W::kVectors) * (kLanes * W::kVectors);
  for (int64_t a = 0; a < 16; ++a) {
    float* row = buf + a * k_dim;
    int64_t k = 0;
    for (int64_t g = 0; g < w.q.groups; ++g) {
      const typename W::Group p = w.group(row0 + a, g);
      const int64_t end = std::min(full, (g + 1) * w.q.group_size);
#ifdef SPECOPS_ISA_AVX512
      for (; k < end; k += kLanes * W::kVectors) {
        f32x16 wv[W::kVectors];
        w.load(row0 + a, k, p, wv);
        for (int v = 0; v < W::kVectors; ++v) store16(row + k + v * kLanes, wv[v]);
        if (ahead >= 0 && k % W::kPrefetchEvery == 0) __builtin_prefetch(w.at(ahead + a, k), 0, 1);
      }
#else
      if (ahead >= 0) {
        for (int64_t t = k; t < end; t += W::kPrefetchEvery) __builtin_prefetch(w.at(ahead + a, t), 0, 1);
      }
      w.fill(row0 + a, k, end, p, row);
      k = std::max(k, end);
#endif
    }
    for (; k < k_dim; ++k) row[k] = w.scalar(row0 + a, k);
  }
}

// out[b * ldo + a] = dot(x row b, weight row row0 + a) for a < JB, b < RB, as skinny_linear's tile: 16
// lanes over k (group by group, each lane in k order), the lane tree, then the k % 16 tail in order. A
// row's result is the same bits whatever the number of rows is. `ahead` >= 0: the first weight row of
// the next panel, prefetched into L2 alongside.
template <class W, int JB, int RB>
SPECOPS_INLINE void tile(const float* x, const W& w, int64_t row0, int64_t ahead, float* out, int64_t ldo) {
  static_assert(JB * RB <= 16, "a tile holds at most 16 accumulators");
  const int64_t k_dim = w.q.k_dim;
  const int64_t full = k_dim / (kLanes * W::kVectors) * (kLanes * W::kVectors);
  f32x16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = f32x16{};
  int64_t k = 0;
  for (int64_t g = 0; g < w.q.groups; ++g) {
    typename W::Group p[JB];
    for (int a = 0; a < JB; ++a) p[a] = w.group(row0 + a, g);
    const int64_t end = std::min(full, (g + 1) * w.q.group_size);
    for (; k < end; k += kLanes * W::kVectors) {
      f32x16 xv[RB][W::kVectors];
      for (int b = 0; b < RB; ++b) {
        for (int v = 0; v < W::kVectors; ++v) xv[b][v] = load16(x + b * k_dim + k + v * kLanes);
      }
      for (int a = 0; a < JB; ++a) {  // each weight vector used as soon as it is de-quantized
        f32x16 wv[W::kVectors];
        w.load(row0 + a, k, p[a], wv);
        for (int v = 0; v < W::kVectors; ++v) {
          for (int b = 0; b < RB; ++b) acc[b * JB + a] += wv[v] * xv[b][v];
        }
      }
      if (ahead >= 0 && k % W::kPrefetchEvery == 0) {  // one prefetch per 64-byte line
        for (int a = 0; a < JB; ++a) __builtin_prefetch(w.at(ahead + a, k), 0, 1);
      }
    }
  }
  const f32x16 sums = reduce16(acc);
  for (int b = 0; b < RB; ++b) {
    for (int a = 0; a < JB; ++a) {
      float s = sums[b * JB + a];
      for (int64_t t = k; t < k_dim; ++t) s = __builtin_fmaf(w.scalar(row0 + a, t), x[b * k_dim + t], s);
      out[b * ldo + a] = s;
    }
  }
}

// Weight rows row0 .. row0 + rows - 1 (rows <= 16) against all m input rows x: out[r * ldo + j]. A full
// panel of 16 goes through the buffer from kBufferedRows input rows on, and otherwise four input rows at a
// time (4 x 4 tiles), the last 1-3 in tiles as wide as 16 accumulators allow; fewer than 16 weight rows
// (the last panel) go one at a time.
template <class W>
void rows_of(const float* x, int64_t m, const W& w, int64_t row0, int64_t rows, int64_t ahead, float* out,
             int64_t ldo) {
  const int64_t k_dim = w.q.k_dim;
  if (rows == 16 && m >= kBufferedRows) {  // de-quantize once, then skinny_linear's panel on the buffer
    thread_local std::vector<float> panel_buf;
    if (static_cast<int64_t>(panel_buf.size()) < 16 * k_dim) panel_buf.resize(static_cast<size_t>(16 * k_dim));
    dequantize_panel(w, row0, ahead, panel_buf.data());
    panel(x, m, k_dim, panel_buf.data(), nullptr, out, ldo);
    return;
  }
  if (rows < 16) {
    for (int64_t j = 0; j < rows; ++j) {
      for (int64_t r = 0; r < m; ++r) tile<W, 1, 1>(x + r * k_dim, w, row0 + j, -1, out + r * ldo + j, ldo);
    }
    return;
  }
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) {
    for (int j = 0; j < 16; j += 4) {
      tile<W, 4, 4>(x + r * k_dim, w, row0 + j, r == 0 && ahead >= 0 ? ahead + j : -1, out + r * ldo + j, ldo);
    }
  }
  const float* xr = x + r * k_dim;
  float* o = out + r * ldo;
  const bool first = r == 0 && ahead >= 0;
  switch (m - r) {
    case 3:
      for (int j = 0; j < 16; j += 4) tile<W, 4, 3>(xr, w, row0 + j, first ? ahead + j : -1, o + j, ldo);
      break;
    case 2:
      if constexpr (W::kVectors == 2) {  // int4: narrower tiles (below)
        for (int j = 0; j < 16; j += 4) tile<W, 4, 2>(xr, w, row0 + j, first ? ahead + j : -1, o + j, ldo);
      } else {
        for (int j = 0; j < 16; j += 8) tile<W, 8, 2>(xr, w, row0 + j, first ? ahead + j : -1, o + j, ldo);
      }
      break;
    case 1:
      // int4 de-quantizes with a table per weight row and group of 32: with 16 or 8 rows a tile the
      // compiler runs out of registers, and 2 rows at a time are 1.3-1.5x faster (SmolLM2's head, AMD
      // EPYC, 2 threads: 1.75 -> 1.18 ms at 1 row; 4 rows a tile at 2 rows: 1.37 -> 1.24 ms).
      if constexpr (W::kVectors == 2) {
        for (int j = 0; j < 16; j += 2) tile<W, 2, 1>(xr, w, row0 + j, first ? ahead + j : -1, o + j, ldo);
      } else {
        tile<W, 16, 1>(xr, w, row0, first ? ahead : -1, o, ldo);
      }
      break;
    default:
      break;
  }
}

void rows_bf16(const float* x, int64_t m, const QuantArgs& q, int64_t row0, int64_t rows, int64_t ahead, float* out,
               int64_t ldo) {
  rows_of(x, m, Bf16Weights{q}, row0, rows, ahead, out, ldo);
}
void rows_int8(const float* x, int64_t m, const QuantArgs& q, int64_t row0, int64_t rows, int64_t ahead, float* out,
               int64_t ldo) {
  rows_of(x, m, Int8Weights{q}, row0, rows, ahead, out, ldo);
}
void rows_int4(const float* x, int64_t m, const QuantArgs& q, int64_t row0, int64_t rows, int64_t ahead, float* out,
               int64_t ldo) {
  rows_of(x, m, Int4Weights{q}, row0, rows, ahead, out, ldo);
}

}  // namespace SPECOPS_ISA
}  // namespace
}  // namespace specops
