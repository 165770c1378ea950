// The AdamW functor (functor.h): torch.optim.AdamW's update (Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization", ICLR 2019, Algorithm 2) in the fp32 operations of torch's fused CPU AdamW, in its order:
//   p  = p * (1 - lr * wd)                      (skipped when wd == 0)
//   m  = fma(w, g - m, m)         (|w| < 0.5)   m.lerp_(g, w), w = 1 - beta1, one rounding
//      = fma(w - 1, g - m, g)     (otherwise)
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   p  = p + (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
// with g = -g under maximize, the coefficients rounded to fp32 once from their double values and the bias
// corrections 1 - beta^step in double. csrc/adamw_kernels.h is the same update as CPU range kernels (portable and
// AVX2, which the CPU launcher runs for this functor); the CUDA launcher runs update() itself. States: exp_avg,
// exp_avg_sq. Hyper list: lr, beta1, beta2, eps, weight_decay, maximize (0 | 1).
#pragma once

#include "functor.h"

namespace gaengine {
namespace optim {

struct AdamW {
  static constexpr const char* kName = "adamw";
  static constexpr int kStates = 2;
  static constexpr bool kStep = true;
  static constexpr const char* kStateNames[kStates] = {"exp_avgs", "exp_avg_sqs"};  // in messages
  static constexpr int kHyper = 6;

  struct Hyper {
    double lr;
    double beta1;
    double beta2;
    float decay_factor;     // 1 - lr * weight_decay
    float lerp_coeff;       // torch's lerp weight w = 1 - beta1 when lerp_small, else w - 1
    float beta2_f;
    float one_minus_beta2;
    float eps;
    int32_t decay;          // weight_decay != 0
    int32_t lerp_small;     // |w| < 0.5: m = fma(w, g - m, m), else m = fma(w - 1, g - m, g)
    int32_t maximize;
  };

  struct Coefs {
    float neg_step_size;          // -lr / (1 - beta1^step)
    float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  };

  static Hyper make_hyper(const double* a) {
    const double lr = a[0], beta1 = a[1], beta2 = a[2], eps = a[3], weight_decay = a[4];
    Hyper h{};
    h.lr = lr;
    h.beta1 = beta1;
    h.beta2 = beta2;
    const float lerp_weight = static_cast<float>(1.0 - beta1);
    h.lerp_small = (lerp_weight < 0.f ? -lerp_weight : lerp_weight) < 0.5f;
    h.lerp_coeff = h.lerp_small ? lerp_weight : lerp_weight - 1.0f;
    h.decay = weight_decay != 0.0;
    h.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
    h.beta2_f = static_cast<float>(beta2);
    h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    h.eps = static_cast<float>(eps);
    h.maximize = a[5] != 0.0;
    return h;
  }

  GAENGINE_HD static Coefs coefs(const Hyper& h, double step) {
    const double bias_correction1 = 1.0 - pow(h.beta1, step);
    const double bias_correction2 = 1.0 - pow(h.beta2, step);
    return Coefs{static_cast<float>(-(h.lr / bias_correction1)), static_cast<float>(sqrt(bias_correction2))};
  }

  template <class M>
  GAENGINE_HD static void update(float& p, float* s, float g, const Hyper& h, const Coefs& c) {
    if (h.maximize) g = -g;
    if (h.decay) p = M::mul(p, h.decay_factor);
    const float m_old = s[0];
    s[0] = M::fma(h.lerp_coeff, M::sub(g, m_old), h.lerp_small ? m_old : g);
    s[1] = M::fma(M::mul(h.one_minus_beta2, g), g, M::mul(s[1], h.beta2_f));
    const float denom = M::add(M::div(M::sqrt(s[1]), c.bias_correction2_sqrt), h.eps);
    p = M::add(p, M::div(M::mul(c.neg_step_size, s[0]), denom));
  }
};

}  // namespace optim
}  // namespace gaengine
