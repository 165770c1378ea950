// The op every fused elementwise optimizer runs through, optimizer_step_ (functor.h): its schema, its argument
// lists and the contracts both launchers check before anything is written (the CPU launcher in
// csrc/optimizer_step.cpp, the CUDA one in csrc/cuda/cuda_ops.cu; each also checks devices and contiguity).
//
// optimizer_step_(str optimizer, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] states, Tensor(c!)[] steps,
//                 Tensor(d!)?[] model_params, float[] hyper, Tensor? grad_scale, Tensor? found_inf) -> ()
//   optimizer:       a functor's kName (csrc/optim/all.h); another name raises, listing the known ones
//   params[i]:       contiguous, updated in place: fp32 (the master weight) or bf16 | fp16 (no master: computed
//                    in fp32, the parameter and its states each rounded to nearest even)
//   grads[i]:        fp32 | bf16 | fp16, contiguous, params[i]'s numel, read
//   states:          kStates * len(params) tensors, state-major: states[k * len(params) + i] is state k of
//                    params[i], in params[i]'s dtype, contiguous, its numel, updated in place
//   steps:           len(params) 0-d fp32 step counts when the functor keeps them (kStep), incremented in place
//                    (the new value is the update's); else empty
//   model_params[i]: None, or (fp32 params[i] only) bf16 | fp16 contiguous with the same numel, overwritten with
//                    the new params[i]'s rounding
//   hyper:           the functor's kHyper hyper-parameters (its make_hyper)
//   grad_scale:      None, or a 0-d fp32 tensor on the device: the gradient used is grads[i] / grad_scale
//   found_inf:       None, or a 0-d fp32 tensor on the device: when != 0 nothing is written (steps included)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "all.h"

namespace gaengine {
namespace optim {

inline constexpr const char* kOptimizerStepSchema =
    "optimizer_step_(str optimizer, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] states, Tensor(c!)[] steps, "
    "Tensor(d!)?[] model_params, float[] hyper, Tensor? grad_scale, Tensor? found_inf) -> ()";

// The lists of one step; states[k][i] is state k of params[i] (k < the functor's kStates).
struct OptimizerLists {
  c10::ArrayRef<at::Tensor> params;
  c10::ArrayRef<at::Tensor> grads;
  std::array<c10::ArrayRef<at::Tensor>, kMaxStates> states;
  c10::ArrayRef<at::Tensor> steps;
  c10::ArrayRef<std::optional<at::Tensor>> model_params;
};

// The op's flat state list split by state (checked: kStates * len(params) tensors).
template <class F>
OptimizerLists split_lists(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& states, const std::vector<at::Tensor>& steps,
                           const std::vector<std::optional<at::Tensor>>& model_params) {
  const size_t n = params.size();
  TORCH_CHECK(states.size() == F::kStates * n, F::kName, ": states must hold ", F::kStates, " tensors per parameter (",
              F::kStates * n, " for ", n, " params), got ", states.size());
  OptimizerLists lists{params, grads, {}, steps, model_params};
  for (int k = 0; k < F::kStates; ++k) lists.states[k] = c10::ArrayRef<at::Tensor>(states).slice(k * n, n);
  return lists;
}

inline std::string state_names(const char* const* names, int n_states, const char* sep, const char* last_sep,
                               const char* suffix) {
  std::string out;
  for (int k = 0; k < n_states; ++k) {
    if (k > 0) out += k + 1 == n_states ? last_sep : sep;
    out += names[k];
    out += suffix;
  }
  return out;
}

inline const char* dtype_name(at::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : "other";
}

// Every list has params.size() entries (steps: when F keeps them; else none).
template <class F>
void check_lengths(const OptimizerLists& l) {
  const size_t n = l.params.size();
  bool same = l.grads.size() == n && l.model_params.size() == n && l.steps.size() == (F::kStep ? n : 0);
  for (int k = 0; k < F::kStates; ++k) same = same && l.states[k].size() == n;
  TORCH_CHECK(same, "params, grads, ", state_names(F::kStateNames, F::kStates, ", ", ", ", ""),
              F::kStep ? ", steps" : "", " and model_params must have the same length",
              F::kStep ? "" : " (steps must be empty)");
}

// params[i] fp32 | bf16 | fp16; its states in its dtype; grads[i] fp32 | bf16 | fp16; all with params[i]'s numel;
// model_params[i], when given, bf16 | fp16 with that numel and beside an fp32 params[i] only.
template <class F>
void check_param(const OptimizerLists& l, size_t i) {
  const int64_t n = l.params[i].numel();
  const auto pt = l.params[i].scalar_type();
  TORCH_CHECK(pt == at::kFloat || pt == at::kBFloat16 || pt == at::kHalf, "params[", i,
              "] must be float32, bfloat16 or float16, got ", pt);
  const std::string idx = "[" + std::to_string(i) + "]";
  bool same_dtype = true, same_numel = l.grads[i].numel() == n;
  std::string got;
  for (int k = 0; k < F::kStates; ++k) {
    same_dtype = same_dtype && l.states[k][i].scalar_type() == pt;
    same_numel = same_numel && l.states[k][i].numel() == n;
    got += std::string(k == 0 ? "" : " and ") + c10::toString(l.states[k][i].scalar_type());
  }
  TORCH_CHECK(same_dtype, state_names(F::kStateNames, F::kStates, ", ", " and ", idx.c_str()), " must be ",
              dtype_name(pt), " (the dtype of params", idx, "), got ", got);
  const auto gt = l.grads[i].scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf, "grads", idx,
              " must be float32, bfloat16 or float16, got ", gt);
  TORCH_CHECK(same_numel, "grads", idx, F::kStates > 1 ? ", " : " and ",
              state_names(F::kStateNames, F::kStates, ", ", " and ", idx.c_str()), " must have the ", n,
              " elements of params", idx);
  if (!l.model_params[i].has_value()) return;
  const at::Tensor& model = *l.model_params[i];
  TORCH_CHECK(model.scalar_type() == at::kBFloat16 || model.scalar_type() == at::kHalf, "model_params", idx,
              " must be bfloat16 or float16, got ", model.scalar_type());
  TORCH_CHECK(model.numel() == n, "model_params", idx, " must have the ", n, " elements of params", idx);
  TORCH_CHECK(pt == at::kFloat, "model_params", idx, " must be None: params", idx, " is ", dtype_name(pt),
              " and updated in place (a model parameter is written from an fp32 master only)");
}

template <class F>
typename F::Hyper make_hyper(c10::ArrayRef<double> hyper) {
  TORCH_CHECK(hyper.size() == static_cast<size_t>(F::kHyper), F::kName, ": hyper must hold ", F::kHyper,
              " values, got ", hyper.size());
  return F::make_hyper(hyper.data());
}

// The names of AllOptimizers, for the message of an unknown one.
template <typename... Fs>
std::string optimizer_names(OptimizerList<Fs...>) {
  std::string out;
  ((out += (out.empty() ? "" : ", ") + std::string(Fs::kName)), ...);
  return out;
}

// Calls visitor.template visit<F>() for the functor named `name`; raises naming the known ones otherwise.
template <class Visitor>
void dispatch_optimizer(const std::string& name, Visitor& visitor) {
  TORCH_CHECK(visit_optimizer(AllOptimizers{}, name.c_str(), visitor), "optimizer_step_: unknown optimizer '", name,
              "' (this gaengine._C has: ", optimizer_names(AllOptimizers{}), ")");
}

// optimizer_step_ on one device: the functor named `optimizer` (dispatch_optimizer), the flat state list split
// (split_lists) and the hyper list read (make_hyper), then Launch::template run<F>(lists, hyper, grad_scale,
// found_inf), the device's launcher. The CPU and CUDA kernels of the op are its instantiations.
template <class Launch>
struct StepVisitor {
  const std::vector<at::Tensor>& params;
  const std::vector<at::Tensor>& grads;
  const std::vector<at::Tensor>& states;
  const std::vector<at::Tensor>& steps;
  const std::vector<std::optional<at::Tensor>>& model_params;
  c10::ArrayRef<double> hyper;
  const std::optional<at::Tensor>& grad_scale;
  const std::optional<at::Tensor>& found_inf;

  template <class F>
  void visit() {
    const OptimizerLists l = split_lists<F>(params, grads, states, steps, model_params);
    Launch::template run<F>(l, make_hyper<F>(hyper), grad_scale, found_inf);
  }
};

template <class Launch>
void optimizer_step(c10::string_view optimizer, const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& states,
                    const std::vector<at::Tensor>& steps, const std::vector<std::optional<at::Tensor>>& model_params,
                    c10::ArrayRef<double> hyper, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  StepVisitor<Launch> visitor{params, grads, states, steps, model_params, hyper, grad_scale, found_inf};
  dispatch_optimizer(std::string(optimizer), visitor);
}

}  // namespace optim
}  // namespace gaengine
