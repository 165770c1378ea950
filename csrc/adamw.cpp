// adamw_step_cpu: the fused AdamW step on CPU tensors (gaengine._C.adamw_step_, torch.ops.gaengine.adamw_step_;
// adamw.h; kernels in adamw_kernels.h).
//
// Contracts first, for every tensor of every parameter, so a bad call writes nothing. Then, per parameter:
// read found_inf and skip everything when it is set; step += 1; bias corrections from the new step in
// double (as torch does); one pass over the elements, at::parallel_for over 4096-element-aligned blocks.
// Reading the 0-d grad_scale / found_inf / step tensors is a plain load of CPU memory, not a device sync.

// Exactly the fp32 operations written in the kernels: no fused multiply-add the source does not ask for
// (GCC contracts a * b + c by default, even in ISO mode, in functions that target FMA).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adamw.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "adamw_kernels.h"
#include "cpu_isa.h"

#define ADAMW_CHECK_TENSOR(x, what, i)                                                                   \
  do {                                                                                                   \
    TORCH_CHECK((x).device().is_cpu(), what "[", i, "] must be a CPU tensor, got device ", (x).device()); \
    TORCH_CHECK((x).is_contiguous(), what "[", i, "] must be contiguous");                               \
  } while (0)

namespace gaengine {
namespace {

constexpr int64_t kBlockNumel = 4096;  // parallel blocks start at multiples of this (never split a vector)
constexpr int64_t kGrainNumel = 32768;  // at least this many elements per thread
// Parameters from this size on (30 MB of streams) write their model copy with non-temporal stores: it
// would leave the caches before the next forward anyway. Smaller ones keep it cached.
constexpr int64_t kStreamNumel = int64_t{1} << 20;

void check_scalar(const std::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->device().is_cpu(), name, " must be a CPU tensor, got device ", t->device());
  TORCH_CHECK(t->dim() == 0 && t->scalar_type() == at::kFloat, name, " must be a 0-d float32 tensor, got ",
              t->sizes(), " ", t->scalar_type());
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : "other";
}

template <typename param_t, typename grad_t, typename model_t>
void run(param_t* param, param_t* exp_avg, param_t* exp_avg_sq, const grad_t* grad, model_t* model, int64_t n,
         const AdamWCoefs& c, bool avx2) {
  const int64_t n_blocks = (n + kBlockNumel - 1) / kBlockNumel;
  at::parallel_for(0, n_blocks, kGrainNumel / kBlockNumel, [&](int64_t b0, int64_t b1) {
    const int64_t begin = b0 * kBlockNumel, end = std::min(b1 * kBlockNumel, n);
    model_t* out = model == nullptr ? nullptr : model + begin;
#if defined(GAENGINE_X86_KERNELS)
    if (avx2) return avx2::adamw(param + begin, exp_avg + begin, exp_avg_sq + begin, grad + begin, out, end - begin, c);
#endif
    portable::adamw(param + begin, exp_avg + begin, exp_avg_sq + begin, grad + begin, out, end - begin, c);
  });
}

template <typename grad_t>
void run_model(float* param, float* exp_avg, float* exp_avg_sq, const grad_t* grad,
               const std::optional<at::Tensor>& model, int64_t n, const AdamWCoefs& c, bool avx2) {
  if (!model.has_value()) {
    return run<float, grad_t, NoModel>(param, exp_avg, exp_avg_sq, grad, nullptr, n, c, avx2);
  }
  if (model->scalar_type() == at::kBFloat16) {
    return run(param, exp_avg, exp_avg_sq, grad, model->data_ptr<c10::BFloat16>(), n, c, avx2);
  }
  run(param, exp_avg, exp_avg_sq, grad, model->data_ptr<c10::Half>(), n, c, avx2);
}

// A bf16 | fp16 parameter updated in place, m and v in its dtype (no model parameter).
template <typename param_t>
void run_in_place(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                  const at::Tensor& grad, int64_t n, const AdamWCoefs& c, bool avx2) {
  param_t* p = param.data_ptr<param_t>();
  param_t* m = exp_avg.data_ptr<param_t>();
  param_t* v = exp_avg_sq.data_ptr<param_t>();
  NoModel* none = nullptr;
  switch (grad.scalar_type()) {
    case at::kBFloat16:
      return run(p, m, v, grad.data_ptr<c10::BFloat16>(), none, n, c, avx2);
    case at::kHalf:
      return run(p, m, v, grad.data_ptr<c10::Half>(), none, n, c, avx2);
    default:
      return run(p, m, v, grad.data_ptr<float>(), none, n, c, avx2);
  }
}

}  // namespace

void check_adamw_lengths(const AdamWLists& lists) {
  const size_t n_params = lists.params.size();
  TORCH_CHECK(lists.grads.size() == n_params && lists.exp_avgs.size() == n_params &&
                  lists.exp_avg_sqs.size() == n_params && lists.steps.size() == n_params &&
                  lists.model_params.size() == n_params,
              "params, grads, exp_avgs, exp_avg_sqs, steps and model_params must have the same length");
}

void check_adamw_param(const AdamWLists& lists, size_t i) {
  const auto& [params, grads, exp_avgs, exp_avg_sqs, steps, model_params] = lists;
  const int64_t n = params[i].numel();
  const auto pt = params[i].scalar_type();
  TORCH_CHECK(pt == at::kFloat || pt == at::kBFloat16 || pt == at::kHalf, "params[", i,
              "] must be float32, bfloat16 or float16, got ", pt);
  TORCH_CHECK(exp_avgs[i].scalar_type() == pt && exp_avg_sqs[i].scalar_type() == pt, "exp_avgs[", i,
              "] and exp_avg_sqs[", i, "] must be ", dtype_name(pt), " (the dtype of params[", i, "]), got ",
              exp_avgs[i].scalar_type(), " and ", exp_avg_sqs[i].scalar_type());
  const auto gt = grads[i].scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf, "grads[", i,
              "] must be float32, bfloat16 or float16, got ", gt);
  TORCH_CHECK(grads[i].numel() == n && exp_avgs[i].numel() == n && exp_avg_sqs[i].numel() == n, "grads[", i,
              "], exp_avgs[", i, "] and exp_avg_sqs[", i, "] must have the ", n, " elements of params[", i, "]");
  if (!model_params[i].has_value()) return;
  const at::Tensor& model = *model_params[i];
  TORCH_CHECK(model.scalar_type() == at::kBFloat16 || model.scalar_type() == at::kHalf, "model_params[", i,
              "] must be bfloat16 or float16, got ", model.scalar_type());
  TORCH_CHECK(model.numel() == n, "model_params[", i, "] must have the ", n, " elements of params[", i, "]");
  TORCH_CHECK(pt == at::kFloat, "model_params[", i, "] must be None: params[", i, "] is ", dtype_name(pt),
              " and updated in place (a model parameter is written from an fp32 master only)");
}

void adamw_step_cpu(const AdamWLists& lists, const AdamWHyperparams& hyper,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const auto& [params, grads, exp_avgs, exp_avg_sqs, steps, model_params] = lists;
  const auto [lr, beta1, beta2, eps, weight_decay, maximize] = hyper;
  const size_t n_params = params.size();
  check_adamw_lengths(lists);
  check_scalar(grad_scale, "grad_scale");
  check_scalar(found_inf, "found_inf");
  for (size_t i = 0; i < n_params; ++i) {
    ADAMW_CHECK_TENSOR(params[i], "params", i);
    ADAMW_CHECK_TENSOR(grads[i], "grads", i);
    ADAMW_CHECK_TENSOR(exp_avgs[i], "exp_avgs", i);
    ADAMW_CHECK_TENSOR(exp_avg_sqs[i], "exp_avg_sqs", i);
    TORCH_CHECK(steps[i].device().is_cpu() && steps[i].dim() == 0 && steps[i].scalar_type() == at::kFloat,
                "steps[", i, "] must be a 0-d float32 CPU tensor");
    if (model_params[i].has_value()) ADAMW_CHECK_TENSOR(*model_params[i], "model_params", i);
    check_adamw_param(lists, i);
  }
  if (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.0f) return;  // skipped: nothing written

  const bool avx2 = use_avx2();
  const double lerp_weight = 1.0 - beta1;
  AdamWCoefs c{};
  c.has_grad_scale = grad_scale.has_value();
  c.grad_scale = c.has_grad_scale ? *grad_scale->data_ptr<float>() : 1.0f;
  c.maximize = maximize;
  c.decay = weight_decay != 0.0;
  c.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  // torch's lerp: |w| < 0.5 ? m + w * (g - m) : g - (g - m) * (1 - w), the weight and w - 1 in fp32.
  c.lerp_small = std::abs(static_cast<float>(lerp_weight)) < 0.5f;
  c.lerp_coeff = c.lerp_small ? static_cast<float>(lerp_weight) : static_cast<float>(lerp_weight) - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);

  for (size_t i = 0; i < n_params; ++i) {
    float* step_ptr = steps[i].data_ptr<float>();
    *step_ptr += 1.0f;  // torch: _foreach_add_(steps, 1) in fp32
    const double step = *step_ptr;
    const double bias_correction1 = 1.0 - std::pow(beta1, step);
    const double bias_correction2 = 1.0 - std::pow(beta2, step);
    c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
    c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));

    const int64_t n = params[i].numel();
    if (n == 0) continue;
    c.stream_model = n >= kStreamNumel;
    if (params[i].scalar_type() == at::kBFloat16) {
      run_in_place<c10::BFloat16>(params[i], exp_avgs[i], exp_avg_sqs[i], grads[i], n, c, avx2);
      continue;
    }
    if (params[i].scalar_type() == at::kHalf) {
      run_in_place<c10::Half>(params[i], exp_avgs[i], exp_avg_sqs[i], grads[i], n, c, avx2);
      continue;
    }
    float* param = params[i].data_ptr<float>();
    float* exp_avg = exp_avgs[i].data_ptr<float>();
    float* exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    switch (grads[i].scalar_type()) {
      case at::kBFloat16:
        run_model(param, exp_avg, exp_avg_sq, grads[i].data_ptr<c10::BFloat16>(), model_params[i], n, c, avx2);
        break;
      case at::kHalf:
        run_model(param, exp_avg, exp_avg_sq, grads[i].data_ptr<c10::Half>(), model_params[i], n, c, avx2);
        break;
      default:
        run_model(param, exp_avg, exp_avg_sq, grads[i].data_ptr<float>(), model_params[i], n, c, avx2);
    }
  }
}

}  // namespace gaengine
