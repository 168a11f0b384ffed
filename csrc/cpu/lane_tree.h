// The fixed lane tree that sums 16 dot-product vectors at once (skinny_linear, quantized_linear): lane i
// of reduce16(v) is the sum of v[i]'s lanes, every vector summed in the same order. No include guard:
// included inside each instruction set's namespace after simd_math.h.

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
