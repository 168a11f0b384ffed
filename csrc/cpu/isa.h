// The instruction set the C++ kernels take (per_isa.h compiles each SIMD header once per set).
#pragma once
#include <cstdlib>
#include <cstring>

#ifndef SPECOPS_INLINE  // helpers are forced inline so that every instruction-set copy inlines them
#define SPECOPS_INLINE __attribute__((always_inline)) inline
#endif

namespace specops {
namespace {

enum class Isa { avx512, avx2, base };

// The instruction set of the running CPU, found once; the environment variable SPECOPS_CPU_ISA ("avx2" or
// "base", checked by `import specops`) caps it, so that an AVX-512 machine can time the AVX2 copies.
[[maybe_unused]] Isa cpu_isa() {
  static const Isa isa = [] {
    Isa found = Isa::base;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
      found = Isa::avx512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      found = Isa::avx2;
#endif
    const char* cap = std::getenv("SPECOPS_CPU_ISA");
    if (cap != nullptr && std::strcmp(cap, "base") == 0) return Isa::base;
    if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && found == Isa::avx512) return Isa::avx2;
    return found;
  }();
  return isa;
}

// Whether the running CPU is Intel's, found once: where a kernel's best blocking was measured to differ
// between Intel and AMD CPUs (skinny_linear's row groups).
[[maybe_unused]] bool cpu_is_intel() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
#else
  return false;
#endif
}

[[maybe_unused]] const char* isa_name(Isa isa) { return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "base"; }

}  // namespace
}  // namespace specops
