// Two forms of skinny_linear's register tiles, measured apart from the op (docs/benchmarks.md, "Eight requests
// together, and two forms of tile"):
//
// - dot: skinny_linear's own (csrc/cpu/skinny_simd.h): a weight in its model layout [N, K]; each accumulator
//   holds 16 lanes of one (input row, weight row) dot product over k, summed by the lane tree at the end.
//   Per k step a JB x RB tile loads JB weight vectors and RB input vectors for JB * RB fused multiply-adds.
// - outer: a weight packed in panels [N / (16 NV)][K][16 NV]; per k, NV weight vectors meet one broadcast
//   input value per row, for NV * RB fused multiply-adds; no lane tree. It needs the weight packed (a copy of
//   it beside the model's own, or the model's own replaced).
//
//   g++ -O3 -march=native -fopenmp -std=c++20 bench/tile_forms.cpp -o /tmp/tile_forms
//   /tmp/tile_forms hot      # one core, 983 KB of panels held in L2, the tile's GFLOP/s
//   OMP_NUM_THREADS=2 /tmp/tile_forms cold  # Gemma-3's 671 MB head streamed from memory, both cores
//
// "hot" also runs the dot tiles on operands 16 bytes off a 64-byte boundary, as a 512-bit load then spans two
// cache lines. The values are arbitrary (only times are reported); each figure is the best of 7 runs.
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define SPECOPS_INLINE __attribute__((always_inline)) inline
typedef float f32x16 __attribute__((vector_size(64)));
SPECOPS_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
#include "../csrc/cpu/lane_tree.h"

constexpr int64_t K = 640;

// out[b * ldo + a] for a < 16 weight rows of w, b < RB rows of x, in JB x RB tiles (prefetching `ahead`'s
// rows into L2, one line per row and k step, as the op spreads them).
template <int JB, int RB>
void dot_panel(const float* x, const float* w, const float* ahead, float* out, int64_t ldo) {
  for (int j = 0; j < 16; j += JB) {
    f32x16 acc[16];
    for (auto& a : acc) a = f32x16{};
    for (int64_t k = 0; k < K; k += 16) {
      f32x16 wv[JB], xv[RB];
      for (int a = 0; a < JB; ++a) wv[a] = load16(w + (j + a) * K + k);
      if (ahead != nullptr) {
        for (int a = 0; a < JB; ++a) __builtin_prefetch(ahead + (j + a) * K + k, 0, 1);
      }
      for (int b = 0; b < RB; ++b) xv[b] = load16(x + b * K + k);
      for (int b = 0; b < RB; ++b) {
        for (int a = 0; a < JB; ++a) acc[b * JB + a] += wv[a] * xv[b];
      }
    }
    const f32x16 sums = reduce16(acc);
    for (int b = 0; b < RB; ++b) {
      for (int a = 0; a < JB; ++a) out[b * ldo + j + a] = sums[b * JB + a];
    }
  }
}

// The same products for 16 NV packed weight rows (panel [K][16 NV]) and RB input rows.
template <int NV, int RB>
void outer_panel(const float* x, const float* w, const float* ahead, float* out, int64_t ldo) {
  f32x16 acc[NV * RB];
  for (auto& a : acc) a = f32x16{};
  for (int64_t k = 0; k < K; ++k) {
    f32x16 wv[NV];
    for (int a = 0; a < NV; ++a) wv[a] = load16(w + (k * NV + a) * 16);
    if (ahead != nullptr) {
      for (int a = 0; a < NV; ++a) __builtin_prefetch(ahead + (k * NV + a) * 16, 0, 1);
    }
    for (int b = 0; b < RB; ++b) {
      const f32x16 xb = f32x16{} + x[b * K + k];
      for (int a = 0; a < NV; ++a) acc[b * NV + a] += wv[a] * xb;
    }
  }
  for (int b = 0; b < RB; ++b) {
    for (int a = 0; a < NV; ++a) std::memcpy(out + b * ldo + 16 * a, &acc[b * NV + a], sizeof(f32x16));
  }
}

using Panel = void (*)(const float*, const float*, const float*, float*, int64_t);

struct Form {
  const char* name;
  Panel panel;
  int64_t weight_rows;  // per panel call
  int rows;  // input rows per group
  int groups;  // groups of input rows, each a call over the same panel (the first prefetches the next)
};

template <class F>
double best_of_7(F run) {
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

float* buffer(int64_t floats, int64_t offset_bytes) {
  char* p = static_cast<char*>(std::aligned_alloc(64, floats * 4 + 64));
  for (int64_t i = 0; i < floats * 4 + 64; ++i) p[i] = static_cast<char>(i % 61);  // pages touched
  float* f = reinterpret_cast<float*>(p + offset_bytes);
  for (int64_t i = 0; i < floats; ++i) f[i] = static_cast<float>(i % 97) * 0.01f;
  return f;
}

// Every panel of an n x K weight, the rows of x in `groups` groups; panels split over the threads.
void pass(const Form& form, const float* x, const float* w, int64_t n, float* out) {
  const int64_t panels = n / form.weight_rows;
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = panels * t / threads, end = panels * (t + 1) / threads;
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = w + p * form.weight_rows * K;
      const float* ahead = p + 1 < end ? panel + form.weight_rows * K : nullptr;
      for (int g = 0; g < form.groups; ++g) {
        float* o = out + g * form.rows * n + p * form.weight_rows;
        form.panel(x + g * form.rows * K, panel, g == 0 ? ahead : nullptr, o, n);
      }
    }
  }
}

int main(int argc, char** argv) {
  const bool hot = argc > 1 && std::strcmp(argv[1], "hot") == 0;
  const Form forms[] = {
      {"dot 16x1", dot_panel<16, 1>, 16, 1, 1},
      {"outer 4x1", outer_panel<4, 1>, 64, 1, 1},
      {"dot 4x4", dot_panel<4, 4>, 16, 4, 1},
      {"dot 2x8", dot_panel<2, 8>, 16, 8, 1},
      {"outer 2x8", outer_panel<2, 8>, 32, 8, 1},
      {"outer 3x8", outer_panel<3, 8>, 48, 8, 1},
      {"dot 4x4, 4 groups", dot_panel<4, 4>, 16, 4, 4},
      {"dot 2x8, 2 groups", dot_panel<2, 8>, 16, 8, 2},
      {"outer 3x8, 2 groups", outer_panel<3, 8>, 48, 8, 2},
      {"outer 1x16", outer_panel<1, 16>, 16, 16, 1},
      {"dot 4x4, 8 groups", dot_panel<4, 4>, 16, 4, 8},
      {"dot 2x8, 4 groups", dot_panel<2, 8>, 16, 8, 4},
      {"dot 4x4, 16 groups", dot_panel<4, 4>, 16, 4, 16},
      {"dot 2x8, 8 groups", dot_panel<2, 8>, 16, 8, 8},
      {"outer 3x8, 8 groups", outer_panel<3, 8>, 48, 8, 8},
  };

  if (hot) {
    omp_set_num_threads(1);
    const int64_t n = 384;  // 384 x 640 floats: 983 KB, within one core's L2; a multiple of 16, 48 and 64
    for (int64_t offset : {0, 16}) {
      const float* w = buffer(n * K, offset);
      const float* x = buffer(64 * K, offset);
      float* out = buffer(64 * n, 0);
      for (const Form& form : forms) {
        if (offset != 0 && form.name[0] != 'd') continue;
        const int rows = form.rows * form.groups;
        const int repeats = 200;
        const double seconds = best_of_7([&] {
          for (int r = 0; r < repeats; ++r) pass(form, x, w, n, out);
        }) / repeats;
        std::printf("hot  %-22s rows %2d  operands %s  %6.1f GFLOP/s\n", form.name, rows,
                    offset ? "16 B off 64" : "64-byte aligned", 2.0 * rows * n * K / seconds / 1e9);
      }
    }
  } else {
    const int64_t n = 262144;  // Gemma-3-270M's head: 671 MB
    const float* w = buffer(n * K, 0);
    const float* x = buffer(64 * K, 0);
    float* out = buffer(64 * n, 0);
    for (const Form& form : forms) {
      const int rows = form.rows * form.groups;
      const double seconds = best_of_7([&] { pass(form, x, w, n, out); });
      std::printf("cold %-22s rows %2d  %6.1f ms  %5.1f GB/s  %6.1f GFLOP/s\n", form.name, rows, seconds * 1e3,
                  n * K * 4.0 / seconds / 1e9, 2.0 * rows * n * K / seconds / 1e9);
    }
  }
}
