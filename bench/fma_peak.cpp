// The arithmetic ceiling of one core: 16 independent 16-lane float32 fused multiply-add chains, register
// operands only (no loads), for a few seconds. Run one copy per core at once to see the machine's.
//
//   g++ -O3 -mavx512f -mfma bench/fma_peak.cpp -o /tmp/fma_peak && { /tmp/fma_peak & /tmp/fma_peak & wait; }
//
// skinny_linear's tiles (csrc/cpu/skinny_simd.h) are measured against this (docs/benchmarks.md).
#include <chrono>
#include <cstdio>

typedef float f32x16 __attribute__((vector_size(64)));

int main() {
  f32x16 acc[16], a, b;
  for (int l = 0; l < 16; ++l) {
    a[l] = 0.999f;
    b[l] = 0.001f;
  }
  for (int i = 0; i < 16; ++i) acc[i] = f32x16{};
  const long steps = 200000000;
  const auto start = std::chrono::steady_clock::now();
  for (long s = 0; s < steps; ++s) {
    asm volatile("" : "+v"(a), "+v"(b));  // keep the operands opaque, so the chains are not folded
    for (int j = 0; j < 16; ++j) acc[j] = acc[j] * a + b;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sum = 0;
  for (int j = 0; j < 16; ++j) sum += acc[j][0];
  std::printf("%.1f GFLOP/s per core (checksum %g)\n", steps * 16.0 * 32 / seconds / 1e9, sum);
}
