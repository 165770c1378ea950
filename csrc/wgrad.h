// Gradient accumulation fusion (AccumulatorConfig.gradient_accumulation_fusion): a Linear whose weight gradient is
// computed straight into the fp32 main_grad, with no low-precision weight gradient in between (Megatron-Core's
// gradient_accumulation_fusion, TransformerEngine's fuse_wgrad_accumulation).
//
// Two ops, schemas below, registered in module.cpp:
//   fused_linear(input, weight, bias, transposed):  y = input @ weight^T + bias, as at::linear (weight (out, in));
//       transposed: y = input @ weight + bias with weight (in, out), as transformers' Conv1D (GPT-2's layer:
//       addmm(bias, input_2d, weight)). input (..., in), y (..., out). Its autograd kernel (wgrad.cpp, a
//       torch::autograd::Function: no Python in backward) computes dX as usual; a weight or bias whose gradient a
//       live HotPath takes (hot_path.cpp: the parameter belongs to a GradientAccumulator that fuses) gets it
//       written into its main_grad slice by wgrad_accumulate_ (a transposed weight's slice, (in, out), as
//       fp32(input)^T @ fp32(grad_output)) and returns no gradient to autograd; any other gets its ordinary
//       gradient (the op is then plain linear / addmm). Its Autocast kernels (CPU, CUDA) cast input, weight and
//       bias as autocast's lower-precision policy casts at::linear's (floating, not float64, to the autocast
//       dtype) inside the autograd Function, which keeps the parameters themselves as its inputs: the backward's
//       GEMM operands are the casts, the fp32 main_grad is written from them, and the gradients not taken are
//       returned in the parameters' own dtypes.
//   wgrad_accumulate_(dw, db, grad_output, input, overwrite_w, overwrite_b): the kernel behind the op table.
//       dw: (out, in) fp32 contiguous, dw = (0 if overwrite_w else dw) + fp32(grad_output)^T @ fp32(input);
//       db: (out,) fp32 contiguous, db = (0 if overwrite_b else db) + sum over rows of fp32(grad_output); either may
//       be None. grad_output: (N, out), input: (N, in), fp32 | bf16 | fp16, read. CPU: one fp32 GEMM per block of
//       rows, bf16/fp16 operands widened a block at a time (exact), sums within fp32 rounding.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace gaengine {

inline constexpr const char* kFusedLinearSchema =
    "fused_linear(Tensor input, Tensor weight, Tensor? bias=None, bool transposed=False) -> Tensor";
inline constexpr const char* kWgradAccumulateSchema =
    "wgrad_accumulate_(Tensor(a!)? dw, Tensor(b!)? db, Tensor grad_output, Tensor input, bool overwrite_w, "
    "bool overwrite_b) -> ()";

// The C++ signature of wgrad_accumulate_'s kernels (hot_path.cpp calls it unboxed through the dispatcher).
using WgradAccumulateKernel = void(const std::optional<at::Tensor>& dw, const std::optional<at::Tensor>& db,
                                   const at::Tensor& grad_output, const at::Tensor& input, bool overwrite_w,
                                   bool overwrite_b);

// The CPU kernel of wgrad_accumulate_ (checked: TORCH_CHECK contracts first).
void wgrad_accumulate_cpu(const std::optional<at::Tensor>& dw, const std::optional<at::Tensor>& db,
                          const at::Tensor& grad_output, const at::Tensor& input, bool overwrite_w, bool overwrite_b);

// fused_linear's kernels: the forward (CompositeExplicitAutograd: at::linear, or addmm when transposed), the
// autograd one, and the Autocast ones (CPU, CUDA).
at::Tensor fused_linear_forward(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                bool transposed);
at::Tensor fused_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, bool transposed);
at::Tensor fused_linear_autocast_cpu(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, bool transposed);
at::Tensor fused_linear_autocast_cuda(const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, bool transposed);

// Which of a fused Linear's parameter gradients a HotPath wrote into its main_grad.
struct FusedTaken {
  bool weight = false;
  bool bias = false;
};

// hot_path.cpp: hand the weight gradient (want_weight) and bias gradient (want_bias) of a fused Linear to the
// HotPath that holds each parameter, if any; it writes or adds them into main_grad (wgrad_accumulate_) and counts
// the parameter as arrived when its AccumulateGrad hook runs. weight_key, bias_key: the parameters' TensorImpl
// addresses as the forward saw them (0: none; a saved tensor may come back as another TensorImpl, e.g. detached by
// non-reentrant activation checkpointing; the graph's AccumulateGrad nodes keep the parameters alive).
// grad_output: (N, out), input: (N, in). transposed: the weight is (in, out) (fused_linear's transposed), its
// gradient fp32(input)^T @ fp32(grad_output). What is not taken must be returned to autograd.
FusedTaken take_fused_gradients(int64_t weight_key, int64_t bias_key, const at::Tensor& grad_output,
                                const at::Tensor& input, bool want_weight, bool want_bias, bool transposed);

}  // namespace gaengine
