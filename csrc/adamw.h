// The fused AdamW step of gaengine.optim.FusedAdamW on CPU tensors (defined in adamw.cpp, bound in cpu_ops.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace gaengine {

// One AdamW update (torch.optim.AdamW semantics; Loshchilov & Hutter 2019) of every parameter i, one pass
// over each: reads grads[i], exp_avgs[i], exp_avg_sqs[i], params[i]; writes exp_avgs[i], exp_avg_sqs[i],
// params[i] and, when model_params[i] is given, its bf16/fp16 rounding of the new params[i].
//   params[i]:       contiguous, CPU, updated in place: fp32 (the master weight), or bf16 | fp16 (the model
//                    parameter itself, no master: computed in fp32, p, m, v each rounded to nearest even)
//   grads[i]:        fp32 | bf16 | fp16, contiguous, same numel, read
//   exp_avgs[i], exp_avg_sqs[i]: params[i]'s dtype, contiguous, same numel, updated in place
//   steps[i]:        0-d fp32 step count, incremented in place (the new value sets the bias corrections)
//   model_params[i]: None, or (fp32 params[i] only) bf16 | fp16 contiguous with the same numel, overwritten
//   grad_scale:      None, or a 0-d fp32 CPU tensor: the gradient used is grads[i] / grad_scale
//   found_inf:       None, or a 0-d fp32 CPU tensor: when != 0 nothing is written (steps included)
// Contract violations raise (TORCH_CHECK) before anything is written.
void adamw_step_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& steps, const std::vector<std::optional<at::Tensor>>& model_params,
                 double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

// The contracts of adamw_step_ that do not depend on the device, checked by the CPU op and by the CUDA op
// (csrc/cuda/cuda_ops.cu) before anything is written; each op checks devices and contiguity itself.
// check_adamw_lengths: every list has params.size() entries. check_adamw_param(i): params[i] fp32 | bf16 | fp16;
// its moments in its dtype; grads[i] fp32 | bf16 | fp16; all with params[i]'s numel; model_params[i], when
// given, bf16 | fp16 with that numel and beside an fp32 params[i] only. Raise c10::Error naming the argument.
void check_adamw_lengths(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                         const std::vector<at::Tensor>& steps,
                         const std::vector<std::optional<at::Tensor>>& model_params);
void check_adamw_param(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<std::optional<at::Tensor>>& model_params, size_t i);

}  // namespace gaengine
