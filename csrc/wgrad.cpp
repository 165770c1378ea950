// Gradient accumulation fusion: fused_linear's autograd formula and wgrad_accumulate_'s CPU kernel (wgrad.h).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "wgrad.h"

#define CHECK_OPERAND(x)                                                                                       \
  TORCH_CHECK_VALUE((x).device().is_cpu() && (x).dim() == 2 &&                                                 \
                        ((x).scalar_type() == at::kFloat || (x).scalar_type() == at::kBFloat16 ||              \
                         (x).scalar_type() == at::kHalf),                                                      \
                    #x " must be a 2-d float32, bfloat16 or float16 CPU tensor, got ", (x).scalar_type(),      \
                    " of shape ", (x).sizes(), " on ", (x).device())
#define CHECK_MAIN_GRAD(x, ...)                                                                                \
  TORCH_CHECK_VALUE((x).device().is_cpu() && (x).scalar_type() == at::kFloat && (x).is_contiguous() &&         \
                        (x).sizes() == at::IntArrayRef({__VA_ARGS__}),                                         \
                    #x " must be a contiguous float32 CPU tensor of shape ", at::IntArrayRef({__VA_ARGS__}),   \
                    ", got ", (x).scalar_type(), " of shape ", (x).sizes(), " on ", (x).device())

namespace gaengine {
namespace {

// Rows of grad_output and input widened to fp32 at a time: at most ~kBlockElems fp32 elements of temporaries
// (4 MiB), never a tensor of the weight's shape in a low precision.
constexpr int64_t kBlockElems = int64_t{1} << 20;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The registry key of a parameter (take_fused_gradients): its TensorImpl's address.
int64_t key_of(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(reinterpret_cast<intptr_t>(t.unsafeGetTensorImpl())) : 0;
}

// y = input @ weight^T + bias; backward: dX as at::linear's, dW and db into main_grad where a HotPath takes them.
struct FusedLinear : public torch::autograd::Function<FusedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    ctx->save_for_backward({input, weight, bias.value_or(at::Tensor())});
    ctx->saved_data["weight_key"] = key_of(weight);
    ctx->saved_data["bias_key"] = bias.has_value() ? key_of(*bias) : int64_t{0};
    return at::linear(input, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_input, grad_weight, grad_bias;
    if (!grad.defined()) return {grad_input, grad_weight, grad_bias};
    if (ctx->needs_input_grad(0)) grad_input = at::matmul(grad, weight);  // (..., out) @ (out, in)
    const bool want_weight = ctx->needs_input_grad(1), want_bias = bias.defined() && ctx->needs_input_grad(2);
    if (want_weight || want_bias) {
      const at::Tensor grad_2d = grad.reshape({-1, weight.size(0)});
      const at::Tensor input_2d = input.reshape({-1, weight.size(1)});
      const FusedTaken taken = take_fused_gradients(ctx->saved_data["weight_key"].toInt(),
                                                    ctx->saved_data["bias_key"].toInt(), grad_2d, input_2d,
                                                    want_weight, want_bias);
      if (want_weight && !taken.weight) grad_weight = grad_2d.t().mm(input_2d);  // a parameter no HotPath fuses
      if (want_bias && !taken.bias) grad_bias = grad_2d.sum(0);
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

}  // namespace

void wgrad_accumulate_cpu(const std::optional<at::Tensor>& dw, const std::optional<at::Tensor>& db,
                          const at::Tensor& grad_output, const at::Tensor& input, bool overwrite_w, bool overwrite_b) {
  CHECK_OPERAND(grad_output);
  CHECK_OPERAND(input);
  const int64_t rows = grad_output.size(0), out = grad_output.size(1), in = input.size(1);
  TORCH_CHECK_VALUE(input.size(0) == rows, "grad_output and input must have the same rows, got ", rows, " and ",
                    input.size(0));
  if (dw.has_value()) CHECK_MAIN_GRAD(*dw, out, in);
  if (db.has_value()) CHECK_MAIN_GRAD(*db, out);
  const bool widen = grad_output.scalar_type() != at::kFloat || input.scalar_type() != at::kFloat;
  const int64_t block = widen ? std::max<int64_t>(1, kBlockElems / std::max<int64_t>(1, out + in)) : rows;
  bool write_w = overwrite_w, write_b = overwrite_b;
  for (int64_t r = 0; r < rows; r += block) {
    const int64_t n = std::min(block, rows - r);
    const at::Tensor g = grad_output.narrow(0, r, n).to(at::kFloat);  // exact widening, a block at a time
    if (dw.has_value()) {
      const at::Tensor x = input.narrow(0, r, n).to(at::kFloat);
      dw->addmm_(g.t(), x, /*beta=*/write_w ? 0 : 1, /*alpha=*/1);  // beta 0: the old values are not read
      write_w = false;
    }
    if (db.has_value()) {
      if (write_b) {
        at::Tensor sum = *db;
        at::sum_out(sum, g, {0});
      } else {
        db->add_(g.sum(0));
      }
      write_b = false;
    }
  }
  if (write_w) dw->zero_();  // no rows: the micro-batch's gradient is zero
  if (write_b) db->zero_();
}

at::Tensor fused_linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias) {
  return at::linear(input, weight, bias);
}

at::Tensor fused_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  return FusedLinear::apply(input, weight, bias);
}

}  // namespace gaengine
