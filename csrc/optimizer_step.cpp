// The CPU multi-tensor launcher of the fused elementwise optimizers (csrc/optim/functor.h): optimizer_step_ on CPU
// tensors for every functor of csrc/optim/all.h (by name), and adamw_step_ (adamw.h), AdamW's own spelling of it.
//
// Contracts first, for every tensor of every parameter, so a bad call writes nothing. Then, per parameter:
// found_inf set skips everything; step += 1 (functors that keep one); the functor's coefficients of this step;
// one pass over the elements, at::parallel_for over 4096-element-aligned blocks, each block through the
// functor's CPU range kernel (CpuRange: element by element through F::update, or a functor's own vector kernel,
// the same bits). Reading the 0-d grad_scale / found_inf / step tensors is a plain load of CPU memory, not a sync.

// Exactly the fp32 operations written in the kernels: no fused multiply-add the source does not ask for
// (GCC contracts a * b + c by default, even in ISO mode, in functions that target FMA).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <string>

#include "adamw.h"
#include "adamw_kernels.h"
#include "cpu_isa.h"
#include "op_library.h"
#include "optim/step.h"

namespace gaengine {
namespace {

constexpr int64_t kBlockNumel = 4096;   // parallel blocks start at multiples of this (never split a vector)
constexpr int64_t kGrainNumel = 32768;  // at least this many elements per thread
// Parameters from this size on (30 MB of streams) write their model copy with non-temporal stores where a range
// kernel can: it would leave the caches before the next forward anyway. Smaller ones keep it cached.
constexpr int64_t kStreamNumel = int64_t{1} << 20;

// The gradient's divisor (grad_scale) and the per-parameter choices of a range kernel.
struct RangeOptions {
  bool has_grad_scale;
  float grad_scale;
  bool avx2;
  bool stream_model;
};

// [0, n) of one parameter, from its first element: param, states[k], grad and model (null: none) all offset alike.
// The generic kernel: element by element, fp32, through F::update; each result rounded to its tensor's dtype.
template <class F>
struct CpuRange {
  template <typename param_t, typename grad_t, typename model_t>
  static void run(param_t* param, param_t* const* states, const grad_t* grad, model_t* model, int64_t n,
                  const typename F::Hyper& h, const typename F::Coefs& c, const RangeOptions& o) {
    for (int64_t i = 0; i < n; ++i) {
      float g = portable::to_float(grad[i]);
      if (o.has_grad_scale) g = g / o.grad_scale;
      float p = portable::to_float(param[i]);
      float s[optim::kMaxStates];
      for (int k = 0; k < F::kStates; ++k) s[k] = portable::to_float(states[k][i]);
      F::template update<optim::HostMath>(p, s, g, h, c);
      for (int k = 0; k < F::kStates; ++k) portable::store_rounded(states[k], i, s[k]);
      portable::store_rounded(param, i, p);
      portable::store_rounded(model, i, p);
    }
  }
};

// AdamW: adamw_kernels.h's range kernels (AVX2 where the CPU has it, else portable::adamw, which is F::update's
// operations in the same order: the same bits as the generic kernel, tested by tests/ops/test_adamw.py).
template <>
struct CpuRange<optim::AdamW> {
  template <typename param_t, typename grad_t, typename model_t>
  static void run(param_t* param, param_t* const* states, const grad_t* grad, model_t* model, int64_t n,
                  const optim::AdamW::Hyper& h, const optim::AdamW::Coefs& c, const RangeOptions& o) {
    AdamWCoefs k{};
    k.grad_scale = o.grad_scale;
    k.has_grad_scale = o.has_grad_scale;
    k.maximize = h.maximize != 0;
    k.decay = h.decay != 0;
    k.decay_factor = h.decay_factor;
    k.lerp_small = h.lerp_small != 0;
    k.lerp_coeff = h.lerp_coeff;
    k.beta2 = h.beta2_f;
    k.one_minus_beta2 = h.one_minus_beta2;
    k.bias_correction2_sqrt = c.bias_correction2_sqrt;
    k.eps = h.eps;
    k.neg_step_size = c.neg_step_size;
    k.stream_model = o.stream_model;
#if defined(GAENGINE_X86_KERNELS)
    if (o.avx2) return avx2::adamw(param, states[0], states[1], grad, model, n, k);
#endif
    portable::adamw(param, states[0], states[1], grad, model, n, k);
  }
};

template <class F, typename param_t, typename grad_t, typename model_t>
void run_blocks(param_t* param, param_t* const* states, const grad_t* grad, model_t* model, int64_t n,
                const typename F::Hyper& h, const typename F::Coefs& c, const RangeOptions& o) {
  const int64_t n_blocks = (n + kBlockNumel - 1) / kBlockNumel;
  at::parallel_for(0, n_blocks, kGrainNumel / kBlockNumel, [&](int64_t b0, int64_t b1) {
    const int64_t begin = b0 * kBlockNumel, end = std::min(b1 * kBlockNumel, n);
    param_t* s[optim::kMaxStates] = {};
    for (int k = 0; k < F::kStates; ++k) s[k] = states[k] + begin;
    model_t* out = model == nullptr ? nullptr : model + begin;
    CpuRange<F>::run(param + begin, s, grad + begin, out, end - begin, h, c, o);
  });
}

// One parameter: its dtypes dispatched (param_t float with an optional model, or bf16 | fp16 in place).
template <class F, typename param_t>
void run_param(const optim::OptimizerLists& l, size_t i, const typename F::Hyper& h, const typename F::Coefs& c,
               const RangeOptions& o) {
  const int64_t n = l.params[i].numel();
  param_t* param = l.params[i].data_ptr<param_t>();
  param_t* states[optim::kMaxStates] = {};
  for (int k = 0; k < F::kStates; ++k) states[k] = l.states[k][i].data_ptr<param_t>();
  const std::optional<at::Tensor>& model = l.model_params[i];
  auto with_grad = [&](const auto* grad) {
    if (!model.has_value()) return run_blocks<F>(param, states, grad, static_cast<NoModel*>(nullptr), n, h, c, o);
    if constexpr (std::is_same_v<param_t, float>) {  // check_param: a model beside an fp32 param only
      if (model->scalar_type() == at::kBFloat16) {
        return run_blocks<F>(param, states, grad, model->data_ptr<c10::BFloat16>(), n, h, c, o);
      }
      run_blocks<F>(param, states, grad, model->data_ptr<c10::Half>(), n, h, c, o);
    }
  };
  switch (l.grads[i].scalar_type()) {
    case at::kBFloat16:
      return with_grad(l.grads[i].data_ptr<c10::BFloat16>());
    case at::kHalf:
      return with_grad(l.grads[i].data_ptr<c10::Half>());
    default:
      return with_grad(l.grads[i].data_ptr<float>());
  }
}

void check_scalar(const std::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->device().is_cpu(), name, " must be a CPU tensor, got device ", t->device());
  TORCH_CHECK(t->dim() == 0 && t->scalar_type() == at::kFloat, name, " must be a 0-d float32 tensor, got ",
              t->sizes(), " ", t->scalar_type());
}

void check_cpu_tensor(const at::Tensor& t, const char* what, size_t i) {
  TORCH_CHECK(t.device().is_cpu(), what, "[", i, "] must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, "[", i, "] must be contiguous");
}

// The CPU launcher: one update of every parameter of `l` by functor F (functor.h, step.h).
template <class F>
void cpu_step(const optim::OptimizerLists& l, const typename F::Hyper& h, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf) {
  optim::check_lengths<F>(l);
  check_scalar(grad_scale, "grad_scale");
  check_scalar(found_inf, "found_inf");
  const size_t n_params = l.params.size();
  for (size_t i = 0; i < n_params; ++i) {
    check_cpu_tensor(l.params[i], "params", i);
    check_cpu_tensor(l.grads[i], "grads", i);
    for (int k = 0; k < F::kStates; ++k) check_cpu_tensor(l.states[k][i], F::kStateNames[k], i);
    if constexpr (F::kStep) {
      TORCH_CHECK(l.steps[i].device().is_cpu() && l.steps[i].dim() == 0 && l.steps[i].scalar_type() == at::kFloat,
                  "steps[", i, "] must be a 0-d float32 CPU tensor");
    }
    if (l.model_params[i].has_value()) check_cpu_tensor(*l.model_params[i], "model_params", i);
    optim::check_param<F>(l, i);
  }
  if (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.0f) return;  // skipped: nothing written

  RangeOptions o{grad_scale.has_value(), grad_scale.has_value() ? *grad_scale->data_ptr<float>() : 1.0f, use_avx2(),
                 false};
  for (size_t i = 0; i < n_params; ++i) {
    double step = 0.0;
    if constexpr (F::kStep) {
      float* step_ptr = l.steps[i].data_ptr<float>();
      *step_ptr += 1.0f;  // torch: _foreach_add_(steps, 1) in fp32
      step = *step_ptr;
    }
    const typename F::Coefs c = F::coefs(h, step);
    const int64_t n = l.params[i].numel();
    if (n == 0) continue;
    o.stream_model = n >= kStreamNumel;
    switch (l.params[i].scalar_type()) {
      case at::kBFloat16:
        run_param<F, c10::BFloat16>(l, i, h, c, o);
        break;
      case at::kHalf:
        run_param<F, c10::Half>(l, i, h, c, o);
        break;
      default:
        run_param<F, float>(l, i, h, c, o);
    }
  }
}

// optimizer_step_'s CPU kernel (optim/step.h): the functor by name, then cpu_step.
struct CpuLaunch {
  template <class F>
  static void run(const optim::OptimizerLists& l, const typename F::Hyper& h,
                  const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    cpu_step<F>(l, h, grad_scale, found_inf);
  }
};

}  // namespace

void adamw_step_cpu(const AdamWLists& lists, const AdamWHyperparams& hyper,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const double args[optim::AdamW::kHyper] = {hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
                                              hyper.maximize ? 1.0 : 0.0};
  const optim::OptimizerLists l{lists.params, lists.grads, {lists.exp_avgs, lists.exp_avg_sqs}, lists.steps,
                                lists.model_params};
  cpu_step<optim::AdamW>(l, optim::AdamW::make_hyper(args), grad_scale, found_inf);
}

}  // namespace gaengine

// The op every fused elementwise optimizer runs through (its schema: optim/step.h), and its CPU kernel (the
// emulated CUDA build of tests/cuda_emu registers its CUDA kernel under the CPU key instead: op_library.h).
GAENGINE_TORCH_LIBRARY_FRAGMENT(m) {
  m.def(gaengine::optim::kOptimizerStepSchema);
}
#if !defined(GAENGINE_EMULATED_CUDA)
GAENGINE_TORCH_LIBRARY_IMPL(CPU, m) {
  m.impl("optimizer_step_", &gaengine::optim::optimizer_step<gaengine::CpuLaunch>);
}
#endif
