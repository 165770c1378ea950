// The fused AdamW step of gaengine.optim.FusedAdamW, adamw_step_: AdamW's own spelling of
// optimizer_step_("adamw", ...) (csrc/optim/step.h; the functor csrc/optim/adamw.h), its arguments written once, and
// the CPU kernel (the CPU launcher, csrc/optimizer_step.cpp; registered in module.cpp, the CUDA kernel, the CUDA
// launcher, in csrc/cuda/cuda_ops.cu).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace gaengine {

// The arguments of one AdamW step, written once: the lists (one entry per parameter) and the hyper-parameters.
//   params[i]:       contiguous, updated in place: fp32 (the master weight), or bf16 | fp16 (the model parameter
//                    itself, no master: computed in fp32, p, m, v each rounded to nearest even)
//   grads[i]:        fp32 | bf16 | fp16, contiguous, same numel, read
//   exp_avgs[i], exp_avg_sqs[i]: params[i]'s dtype, contiguous, same numel, updated in place
//   steps[i]:        0-d fp32 step count, incremented in place (the new value sets the bias corrections)
//   model_params[i]: None, or (fp32 params[i] only) bf16 | fp16 contiguous with the same numel, overwritten
struct AdamWLists {
  const std::vector<at::Tensor>& params;
  const std::vector<at::Tensor>& grads;
  const std::vector<at::Tensor>& exp_avgs;
  const std::vector<at::Tensor>& exp_avg_sqs;
  const std::vector<at::Tensor>& steps;
  const std::vector<std::optional<at::Tensor>>& model_params;
};

// torch.optim.AdamW's hyper-parameters, as Python floats (double) and maximize.
struct AdamWHyperparams {
  double lr, beta1, beta2, eps, weight_decay;
  bool maximize;
};

// A device's AdamW kernel: one update of every parameter of `lists` (torch.optim.AdamW semantics; Loshchilov &
// Hutter 2019), one pass over each: reads grads[i], exp_avgs[i], exp_avg_sqs[i], params[i]; writes exp_avgs[i],
// exp_avg_sqs[i], params[i] and, when model_params[i] is given, its bf16/fp16 rounding of the new params[i].
//   grad_scale:      None, or a 0-d fp32 tensor on the device: the gradient used is grads[i] / grad_scale
//   found_inf:       None, or a 0-d fp32 tensor on the device: when != 0 nothing is written (steps included)
// Contract violations raise (TORCH_CHECK) before anything is written.
using AdamWKernel = void (*)(const AdamWLists& lists, const AdamWHyperparams& hyper,
                             const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

// The CPU kernel (csrc/optimizer_step.cpp): CPU tensors, AVX2 or portable, at::parallel_for.
void adamw_step_cpu(const AdamWLists& lists, const AdamWHyperparams& hyper,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

// The op's flat argument list, in the order of its schema (kAdamWStepSchema): the one
// place the 14 arguments are spelled out in C++. Forwards to Kernel.
template <AdamWKernel Kernel>
void adamw_step_op(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                   const std::vector<at::Tensor>& steps, const std::vector<std::optional<at::Tensor>>& model_params,
                   double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  Kernel(AdamWLists{params, grads, exp_avgs, exp_avg_sqs, steps, model_params},
         AdamWHyperparams{lr, beta1, beta2, eps, weight_decay, maximize}, grad_scale, found_inf);
}

// The torch.library schema of adamw_step_op (csrc/module.cpp defines it; the CPU and CUDA kernels register under it).
inline constexpr const char* kAdamWStepSchema =
    "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] steps, Tensor(e!)?[] model_params, float lr, float beta1, float beta2, float eps, "
    "float weight_decay, bool maximize, Tensor? grad_scale, Tensor? found_inf) -> ()";

}  // namespace gaengine
