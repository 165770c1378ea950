// The run-time choice of the vector ISA, shared by cpu_ops.cpp and optimizer_step.cpp.
//
// GAENGINE_CPU_ISA=auto|avx2|portable (read once, at the first call) forces a path, for testing the
// fallback on an AVX2 machine; auto takes the AVX2 kernels when __builtin_cpu_supports says the CPU has
// AVX2, FMA and F16C.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#include "cpu_kernels.h"  // GAENGINE_X86_KERNELS

namespace gaengine {

// True when the avx2:: kernels are to be used. Inline with a function-local static: one choice per process.
inline bool use_avx2() {
  static const bool avx2 = [] {
    const char* env = std::getenv("GAENGINE_CPU_ISA");
    const std::string isa = env ? env : "auto";
    TORCH_CHECK(isa == "auto" || isa == "avx2" || isa == "portable",
                "GAENGINE_CPU_ISA must be auto, avx2 or portable, got '", isa, "'");
#if defined(GAENGINE_X86_KERNELS)
    __builtin_cpu_init();
    const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    const bool has = false;
#endif
    TORCH_CHECK(isa != "avx2" || has, "GAENGINE_CPU_ISA=avx2 but this CPU lacks AVX2, FMA or F16C");
    return isa != "portable" && has;
  }();
  return avx2;
}

}  // namespace gaengine
