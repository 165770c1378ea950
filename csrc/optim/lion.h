// The Lion functor (functor.h): Chen et al., "Symbolic Discovery of Optimization Algorithms" (2023), Algorithm 2
// (decoupled weight decay), in fp32, each operation rounded once:
//   c = beta1 * m + (1 - beta1) * g
//   p = p * (1 - lr * wd)                       (skipped when wd == 0)
//   p = p - lr * sign(c)                        (sign as torch.sign: 0 for 0 and NaN)
//   m = beta2 * m + (1 - beta2) * g
// the coefficients rounded to fp32 once from their double values. State: exp_avg (m). No step count.
// Hyper list: lr, beta1, beta2, weight_decay. Defaults (gaengine.optim.FusedLion): lr 1e-4, betas (0.9, 0.99),
// weight_decay 0, the paper's.
#pragma once

#include "functor.h"

namespace gaengine {
namespace optim {

struct Lion {
  static constexpr const char* kName = "lion";
  static constexpr int kStates = 1;
  static constexpr bool kStep = false;
  static constexpr const char* kStateNames[kStates] = {"exp_avgs"};  // in messages
  static constexpr int kHyper = 4;

  struct Hyper {
    float lr;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float decay_factor;  // 1 - lr * weight_decay
    int32_t decay;       // weight_decay != 0
  };
  struct Coefs {};

  static Hyper make_hyper(const double* a) {
    const double lr = a[0], beta1 = a[1], beta2 = a[2], weight_decay = a[3];
    return Hyper{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(1.0 - beta1),
                 static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
                 static_cast<float>(1.0 - lr * weight_decay), weight_decay != 0.0};
  }

  GAENGINE_HD static Coefs coefs(const Hyper&, double) { return Coefs{}; }

  template <class M>
  GAENGINE_HD static void update(float& p, float* s, float g, const Hyper& h, const Coefs&) {
    const float m = s[0];
    const float c = M::add(M::mul(h.beta1, m), M::mul(h.one_minus_beta1, g));
    if (h.decay) p = M::mul(p, h.decay_factor);
    p = M::sub(p, M::mul(h.lr, sign(c)));
    s[0] = M::add(M::mul(h.beta2, m), M::mul(h.one_minus_beta2, g));
  }
};

}  // namespace optim
}  // namespace gaengine
