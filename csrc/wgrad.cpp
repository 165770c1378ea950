// Gradient accumulation fusion: fused_linear's autograd formula and wgrad_accumulate_'s CPU kernel (wgrad.h).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

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

// y = input @ weight^T + bias (transposed: input @ weight + bias, as transformers' Conv1D's addmm).
at::Tensor linear_or_addmm(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                           bool transposed) {
  if (!transposed) return at::linear(input, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  TORCH_CHECK_VALUE(weight.dim() == 2 && input.dim() >= 1 && input.size(-1) == weight.size(0),
                    "fused_linear(transposed=True) needs weight (in, out) and input (..., in), got weight of shape ",
                    weight.sizes(), " and input of shape ", input.sizes());
  std::vector<int64_t> size_out = input.sizes().vec();
  size_out.back() = weight.size(1);
  const at::Tensor input_2d = input.reshape({-1, weight.size(0)});
  const at::Tensor y = bias.defined() ? at::addmm(bias, input_2d, weight) : at::mm(input_2d, weight);
  return y.view(size_out);
}

// Autocast's lower-precision policy for one operand (at::autocast::cached_cast, without its cache of parameter
// casts: a cast made inside the autograd Function tracks no gradient and must not be handed to other ops): a
// floating tensor that is not float64 and not yet `dtype` is cast.
at::Tensor autocast_operand(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  if (!dtype.has_value() || !t.defined() || !t.is_floating_point() || t.scalar_type() == at::kDouble ||
      t.scalar_type() == *dtype) {
    return t;
  }
  return t.to(*dtype);
}

// y = input @ weight^T + bias (or the transposed layout); backward: dX as at::linear's (addmm's), dW and db into
// main_grad where a HotPath takes them. cast: autocast's dtype (the operands are cast inside forward, the
// parameters stay the Function's inputs, so the registry finds them), or none.
struct FusedLinear : public torch::autograd::Function<FusedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool transposed,
                            std::optional<at::ScalarType> cast) {
    const at::Tensor x = autocast_operand(input, cast), w = autocast_operand(weight, cast);
    const at::Tensor b = autocast_operand(bias.value_or(at::Tensor()), cast);
    ctx->save_for_backward({x, w, b});
    ctx->saved_data["weight_key"] = key_of(weight);
    ctx->saved_data["bias_key"] = bias.has_value() ? key_of(*bias) : int64_t{0};
    ctx->saved_data["transposed"] = transposed;
    // The dtypes the gradients returned to autograd must have (the operands' own, before a cast).
    ctx->saved_data["input_dtype"] = static_cast<int64_t>(input.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(b.defined() ? bias->scalar_type() : at::kFloat);
    return linear_or_addmm(x, w, b, transposed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const bool transposed = ctx->saved_data["transposed"].toBool();
    auto as = [&](const at::Tensor& g, const char* name) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data[name].toInt());
      return g.scalar_type() == dtype ? g : g.to(dtype);
    };
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_input, grad_weight, grad_bias;
    if (!grad.defined()) return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
    const int64_t out = weight.size(transposed ? 1 : 0), in = weight.size(transposed ? 0 : 1);
    if (ctx->needs_input_grad(0)) {  // (..., out) @ (out, in)
      grad_input = as(at::matmul(grad, transposed ? weight.t() : weight), "input_dtype");
    }
    const bool want_weight = ctx->needs_input_grad(1), want_bias = bias.defined() && ctx->needs_input_grad(2);
    if (want_weight || want_bias) {
      const at::Tensor grad_2d = grad.reshape({-1, out});
      const at::Tensor input_2d = input.reshape({-1, in});
      const FusedTaken taken = take_fused_gradients(ctx->saved_data["weight_key"].toInt(),
                                                    ctx->saved_data["bias_key"].toInt(), grad_2d, input_2d,
                                                    want_weight, want_bias, transposed);
      if (want_weight && !taken.weight) {  // a parameter no HotPath fuses
        grad_weight = as(transposed ? input_2d.t().mm(grad_2d) : grad_2d.t().mm(input_2d), "weight_dtype");
      }
      if (want_bias && !taken.bias) grad_bias = as(grad_2d.sum(0), "bias_dtype");
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
  }
};

// fused_linear under torch.autocast on `device_type`: the autograd Function with autocast's dtype, autocast off
// inside (as every autocast kernel runs its op).
at::Tensor fused_linear_autocast(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, bool transposed, c10::DeviceType device_type) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  return FusedLinear::apply(input, weight, bias, transposed,
                            std::optional<at::ScalarType>(at::autocast::get_autocast_dtype(device_type)));
}

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
  if (write_w && dw.has_value()) dw->zero_();  // no rows: the micro-batch's gradient is zero
  if (write_b && db.has_value()) db->zero_();
}

at::Tensor fused_linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, bool transposed) {
  return linear_or_addmm(input, weight, bias.value_or(at::Tensor()), transposed);
}

at::Tensor fused_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, bool transposed) {
  return FusedLinear::apply(input, weight, bias, transposed, std::optional<at::ScalarType>());
}

at::Tensor fused_linear_autocast_cpu(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, bool transposed) {
  return fused_linear_autocast(input, weight, bias, transposed, c10::DeviceType::CPU);
}

at::Tensor fused_linear_autocast_cuda(const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, bool transposed) {
  return fused_linear_autocast(input, weight, bias, transposed, c10::DeviceType::CUDA);
}

}  // namespace gaengine
