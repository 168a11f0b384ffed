// Vector basics for the SIMD passes of the CPU kernels: 16-lane float / int vectors for the register tiles,
// vectors as wide as the copy's registers for the row passes (GCC vector extensions, lowered to AVX-512,
// AVX2 or SSE by the `#pragma GCC target` region around the includer), loads, stores, a lane sum and exp
// for non-positive arguments. No include guard: included inside each instruction set's namespace by
// row_simd.h (sampling kernels), attention_simd.h (tree_attention) and skinny_simd.h.

constexpr int64_t kLanes = 16;
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- 16-lane vectors (GCC vector extensions: lowered to AVX-512, AVX2 or SSE per clone) ----

using f32x16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));

SPECOPS_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

SPECOPS_INLINE void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// ---- row vectors: as wide as the copy's registers ----
// A 16-lane vector is one register only with AVX-512. With AVX2 (two ymm) and SSE (four xmm), GCC 12 lowers
// the comparisons and selects of a vector wider than the registers lane by lane, through the stack: the AVX2
// copy of every row pass ran scalar, and chain_verify took 7-14x the AVX-512 copy's time on one machine
// (bench/bench_chain_verify.py with SPECOPS_CPU_ISA=avx2). The row passes (row_simd.h, attention_simd.h,
// ensemble_simd.h) use fvec / ivec of kRowLanes lanes instead; with AVX-512 they are f32x16 / i32x16, so
// that copy computes what it did. The tiles keep 16 lanes: their bits are defined by 16 lanes and a
// lane tree (skinny_simd.h writes the AVX2 copy's as two 8-lane halves).
#undef SPECOPS_ROW_LANES
#if defined(SPECOPS_ISA_AVX512)
#define SPECOPS_ROW_LANES 16
#elif defined(SPECOPS_ISA_AVX2)
#define SPECOPS_ROW_LANES 8
#else
#define SPECOPS_ROW_LANES 4
#endif
constexpr int64_t kRowLanes = SPECOPS_ROW_LANES;
using fvec = float __attribute__((vector_size(4 * SPECOPS_ROW_LANES)));
using ivec = int32_t __attribute__((vector_size(4 * SPECOPS_ROW_LANES)));

SPECOPS_INLINE fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

SPECOPS_INLINE void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

// The sum of a vector's lanes in lane order, in float64.
template <typename V>
SPECOPS_INLINE double lane_total(V v) {
  double s = 0.0;
  for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(float)); ++l) s += v[l];
  return s;
}

// exp for x <= 0 (softmax arguments): Cody-Waite reduction and a degree-6 polynomial, about 1 ulp;
// x below the normal range gives 0. Written once for vectors and scalars alike.
template <typename F, typename I>
SPECOPS_INLINE F exp_nonpositive_t(F x) {
  const float lo = -87.33654475f;
  const F xc = x < lo ? F{} + lo : x;
  const F n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  F r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const F z = r * r;
  F y = F{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  I bits;
  if constexpr (std::is_same_v<F, float>) {
    bits = (static_cast<int32_t>(n) + 127) << 23;
  } else {
    bits = (__builtin_convertvector(n, I) + 127) << 23;
  }
  const F scale = std::bit_cast<F>(bits);
  return x < lo ? F{} : y * scale;
}

SPECOPS_INLINE float exp_nonpositive(float x) { return exp_nonpositive_t<float, int32_t>(x); }
SPECOPS_INLINE f32x16 exp_nonpositive(f32x16 x) { return exp_nonpositive_t<f32x16, i32x16>(x); }
#ifndef SPECOPS_ISA_AVX512  // otherwise fvec is f32x16
SPECOPS_INLINE fvec exp_nonpositive(fvec x) { return exp_nonpositive_t<fvec, ivec>(x); }
#endif
