// Compiles the header named by SPECOPS_ISA_HEADER (a string literal) once per instruction set, each copy
// inside `#pragma GCC target(...)` and in the namespace SPECOPS_ISA names: avx512 and avx2 on x86-64
// with GCC (then SPECOPS_X86_DISPATCH is defined), and base everywhere. (GCC's target_clones lowers
// generic vectors for the base target before cloning, which scalarizes the comparisons; a pragma region
// compiles helpers and callers for the same target.) cpu_isa() says which copy the running CPU takes.
// No include guard around the copies: a translation unit may include this once per SIMD header.

#include "isa.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,fma")
#define SPECOPS_ISA avx512
#define SPECOPS_ISA_AVX512 1  // for a header that uses intrinsics in this copy
#include SPECOPS_ISA_HEADER
#undef SPECOPS_ISA_AVX512
#undef SPECOPS_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SPECOPS_ISA avx2
#define SPECOPS_ISA_AVX2 1
#include SPECOPS_ISA_HEADER
#undef SPECOPS_ISA_AVX2
#undef SPECOPS_ISA
#pragma GCC pop_options
#ifndef SPECOPS_X86_DISPATCH
#define SPECOPS_X86_DISPATCH 1
#endif
#endif
#define SPECOPS_ISA base
#include SPECOPS_ISA_HEADER
#undef SPECOPS_ISA
