// The multi-tensor AdamW: gaengine::adamw_step_ (csrc/adamw.h) for a whole list of parameters in one launch, the
// multi-tensor optimizer launcher (kernels/optimizer.cuh) over the AdamW functor (csrc/optim/adamw.h; the CUDA
// counterpart of kernels/adamw.py). Its names, for the launches of csrc/cuda/cuda_ops.cu's adamw_step_ and the
// drivers of tests/cuda_emu and tests/test_nvcc.py.
// Numerics: exactly the fp32 operations of csrc/adamw_kernels.h (portable::adamw, torch's fused CPU AdamW), in its
// order, with IEEE division and square root and no contraction beyond the two FMAs written; the bias corrections
// 1 - beta^step in double from step + 1 (pow, sqrt), rounded to fp32 once, as the CPU launcher computes them.
// fp32 masters: 28 B/param with an fp32 grad (+ 2 for the model write); bf16 | fp16 params in place: 16 B/param.
#pragma once

#include "optimizer.cuh"
#include "optim/adamw.h"  // csrc/ on the include path: setup.py's include_dirs, the emulated build, test_cuda_build

namespace gaengine {
namespace cuda {

using AdamWEntry = OptimizerEntry;  // states[0] exp_avg, states[1] exp_avg_sq, step: the step count
using AdamWHyper = optim::AdamW::Hyper;
constexpr int64_t kAdamWChunkNumel = kOptimizerChunkNumel;
constexpr int kMaxAdamWEntries = kMaxOptimizerEntries;
constexpr int kAdamWMinBlocksPerSm = kOptimizerMinBlocksPerSm;

inline AdamWHyper make_adamw_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   bool maximize) {
  const double args[optim::AdamW::kHyper] = {lr, beta1, beta2, eps, weight_decay, maximize ? 1.0 : 0.0};
  return optim::AdamW::make_hyper(args);
}

// One AdamW update of every entry (launch_optimizer_multi's contract).
template <typename param_t>
inline cudaError_t launch_adamw_multi(const AdamWEntry* entries, int n_entries, const AdamWHyper& hyper,
                                      const float* grad_scale, const float* found_inf, unsigned int* counter,
                                      cudaStream_t stream, int* n_launches = nullptr) {
  return launch_optimizer_multi<optim::AdamW, param_t>(entries, n_entries, hyper, grad_scale, found_inf, counter,
                                                       stream, n_launches);
}

}  // namespace cuda
}  // namespace gaengine
