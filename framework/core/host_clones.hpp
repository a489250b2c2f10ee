#pragma once
// Host kernels compiled once per instruction set (AVX-512, AVX2, the baseline), the best one
// picked by the loader (GCC's target_clones); elsewhere (clang, nvcc, other CPUs) the baseline
// only. The build itself targets generic x86-64 (SSE2), so a loop that vectorizes runs 4 lanes
// wide unless its function carries MESHTRAIN_HOST_CLONES:
//
//   MESHTRAIN_HOST_CLONES
//   void add_row(const float* __restrict a, const float* __restrict b, float* __restrict out,
//                int64_t cols);
//
// Functions a clone calls are compiled into it when they are inlined (MESHTRAIN_INLINE,
// KOKKOS_INLINE_FUNCTION, KOKKOS_FORCEINLINE_FUNCTION): keep the per-element arithmetic there.
// GCC contracts a * b + c into one FMA (one rounding instead of two) where the clone's ISA has
// it, so the AVX2 and AVX-512 clones of MESHTRAIN_HOST_CLONES move results by an ulp or so
// against the baseline (no FMA) and against a Kokkos kernel of the same formula. Kernels whose
// results must stay the bits of the code they replace (the training step's) take
// MESHTRAIN_HOST_CLONES_EXACT: no contraction, so each element is the same IEEE operations in
// every clone, only more lanes at a time (sums reordered for lanes would still differ).
// Such functions are host code: call them from host lambdas only (inference::runs_host_kernels()).
// Adding an EXACT clone to a source file: add its object (e.g. `foo.cpp.o`, under its library)
// to the core_host_clones_fma registration in tests/core.cmake, which disassembles the clones and
// fails on an FMA instruction; list only objects whose clones are all EXACT.

// GCC 12 is the first to know the arch=x86-64-vN levels (older GCC rejects them); clang is
// left to the baseline (its target_clones with these levels is not checked here), as is nvcc.
#if defined(__GNUC__) && __GNUC__ >= 12 && !defined(__clang__) && !defined(__CUDACC__) && \
    defined(__x86_64__)
#define MESHTRAIN_HOST_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define MESHTRAIN_HOST_CLONES_EXACT                                            \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), \
                 optimize("fp-contract=off")))
#define MESHTRAIN_INLINE inline __attribute__((always_inline))
#else
#define MESHTRAIN_HOST_CLONES
#define MESHTRAIN_HOST_CLONES_EXACT
#define MESHTRAIN_INLINE inline
#endif
