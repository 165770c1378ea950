// The contract of a fused elementwise optimizer: one functor per optimizer (csrc/optim/<name>.h), run by one
// multi-tensor launcher per device (the CPU one in csrc/optimizer_step.cpp, the CUDA one in
// csrc/cuda/kernels/optimizer.cuh), reached from Python through the one op optimizer_step_(name, ...) (by the
// functor's kName: csrc/optim/all.h lists them). Adding an optimizer is its functor header, its line in all.h, its
// Triton kernel, its Python class with its row of gaengine.optimizers.OPTIMIZERS, and its test: no new op, no ABI
// change. (The idea is apex's multi_tensor_apply, which takes a functor.)
//
// A functor F is a struct with only static members, usable by the host and by CUDA device code (no torch, no
// std::, no device intrinsics: its arithmetic goes through the Math policy it is instantiated with):
//   static constexpr const char* kName;     the name Python passes ("adamw", "lion")
//   static constexpr int kStates;           state tensors per parameter (1 .. kMaxStates), in the param's dtype
//   static constexpr const char* kStateNames[kStates];  how messages name the state lists ("exp_avgs")
//   static constexpr bool kStep;            it keeps a 0-d fp32 step count per parameter, incremented by the
//                                           launcher before the update reads it (skipped steps leave it alone)
//   static constexpr int kHyper;            the number of floats of the op's hyper list
//   struct Hyper;                           the per-call coefficients (trivially copyable: it travels in the CUDA
//                                           kernel's parameters)
//   static Hyper make_hyper(const double* hyper);       host: from the op's hyper list (kHyper values)
//   struct Coefs;                           the per-parameter coefficients of one step
//   GAENGINE_HD static Coefs coefs(const Hyper&, double step);   step: the count after this update's increment
//                                                                (0 when !kStep)
//   template <class Math> GAENGINE_HD static void update(float& p, float* s, float g, const Hyper&, const Coefs&);
//                                           one element, in fp32: p the parameter, s[0 .. kStates) the states, g
//                                           the gradient (already divided by grad_scale); p and s updated in place
// The launchers do the rest, the same for every functor: the contracts (all checked before anything is written),
// found_inf (!= 0: nothing written, step counts included), g = grad / grad_scale, the dtypes (params and states
// fp32, or bf16 | fp16 updated in place with each fp32 result rounded to nearest even; gradients fp32 | bf16 |
// fp16; an optional bf16 | fp16 model parameter written with the rounding of an fp32 parameter), the step counts.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define GAENGINE_HD __host__ __device__ __forceinline__
#else
#define GAENGINE_HD inline
#endif

namespace gaengine {
namespace optim {

constexpr int kMaxStates = 2;  // state tensors per parameter a launcher carries (the CUDA entry's size depends on it)
constexpr int kMaxHyper = 8;   // floats of the op's hyper list

// The host's fp32 arithmetic: each operation rounded once (the CPU sources are built with fp-contract off), fma
// the one fused operation.
struct HostMath {
  static inline float add(float a, float b) { return a + b; }
  static inline float sub(float a, float b) { return a - b; }
  static inline float mul(float a, float b) { return a * b; }
  static inline float div(float a, float b) { return a / b; }
  static inline float sqrt(float a) { return std::sqrt(a); }
  static inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
};

// sign(x) as torch.sign: -1, 0 (for +-0 and NaN) or 1.
GAENGINE_HD float sign(float x) { return static_cast<float>((0.0f < x) - (x < 0.0f)); }

// The functors in a list (csrc/optim/all.h): visit_optimizer(List{}, name, visitor) calls
// visitor.template visit<F>() for the one whose kName is name and returns true; false when none is.
// optimizer_names(List{}) lists them, for messages.
template <typename... Fs>
struct OptimizerList {};

inline bool same_name(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}

template <typename F, typename... Rest, typename Visitor>
bool visit_optimizer(OptimizerList<F, Rest...>, const char* name, Visitor& visitor) {
  if (same_name(F::kName, name)) {
    visitor.template visit<F>();
    return true;
  }
  if constexpr (sizeof...(Rest) > 0) {
    return visit_optimizer(OptimizerList<Rest...>{}, name, visitor);
  } else {
    return false;
  }
}

}  // namespace optim
}  // namespace gaengine
