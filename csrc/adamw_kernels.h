// Range kernels of the fused AdamW step (gaengine.optim.FusedAdamW): one pass over [0, n) of one
// parameter that reads grad, exp_avg (m), exp_avg_sq (v) and the param, and writes m, v, the param and, when a
// low-precision model parameter is attached, its bf16/fp16 rounding. Templated on the param/state type param_t:
//   float:          the fp32 master weight with fp32 m, v (16 B read + 12 B written with an fp32 grad, + 2 B for
//                   an attached bf16/fp16 model parameter);
//   bf16 | fp16:    the model parameter updated in place with m, v in its dtype (master_weights=False): p, m, v
//                   widened to fp32 (exact), the same fp32 arithmetic, then each rounded to nearest even, as
//                   torch's .to(bf16 | fp16): 4 (fp32 grad) + 2 + 2 + 2 read, 2 + 2 + 2 written = 16 B/param.
//
// Two implementations, chosen at run time like cpu_kernels.h: portable:: (the specification; plain C++)
// and avx2:: (AVX2 + FMA + F16C intrinsics in GAENGINE_AVX2 functions, the portable kernel for the tail).
//
// Numerics: the fp32 operations of torch's fused CPU AdamW kernel (aten/src/ATen/native/cpu/
// FusedAdamKernel.cpp, ADAM_MODE::ADAMW), in its order, with its coefficients rounded from double once:
//   g  = grad / grad_scale                     (when a grad scale is given; then -g under maximize)
//   p  = p * (1 - lr * wd)                     (decoupled weight decay; skipped when wd == 0)
//   m  = fma(w, g - m, m)         (w < 0.5)    m.lerp_(g, w) with w = 1 - beta1, one rounding
//      = fma(w - 1, g - m, g)     (w >= 0.5)
//   v  = fma((1 - beta2) * g, g, v * beta2)    torch's source says v * beta2 + (1 - beta2) * g * g; its
//                                              AVX2 build contracts it to this FMA (objdump of libtorch_cpu)
//   p  = p + (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
// No other contraction: optimizer_step.cpp (which runs these for the AdamW functor) is built with fp-contract off,
// so these are exactly the roundings.
// Every division is the IEEE one, RN(a / b): the AVX2 path computes the two divisions by a per-call scalar
// (grad_scale, sqrt(bias_correction2)) with Markstein's correction where that is provably exact, and divides
// elsewhere (avx2::div_by_scalar): on this CPU-bound loop a vdivps costs as much as ten other instructions.
// Both paths produce the same bits (the portable one calls std::fma where the AVX2 one has an FMA).
// The model parameter (and a bf16 | fp16 param_t's new p, m, v) receives round-to-nearest-even of the fp32
// value, bitwise equal to .to(bf16 | fp16) (NaN -> 0x7FC0 for bf16, as c10::BFloat16; model parameters from
// 2^20 elements on are written with non-temporal stores).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>

#include "cpu_kernels.h"  // portable::to_float, avx2::load8, GAENGINE_X86_KERNELS, GAENGINE_AVX2

namespace gaengine {

// The per-step coefficients, fp32 (each rounded once from its double value, as torch does).
struct AdamWCoefs {
  float grad_scale;        // g = grad / grad_scale when has_grad_scale
  bool has_grad_scale;
  bool maximize;           // g = -g
  bool decay;              // weight_decay != 0
  float decay_factor;      // 1 - lr * weight_decay
  bool lerp_small;         // (1 - beta1) < 0.5: m = fma(w, g - m, m), else fma(w - 1, g - m, g)
  float lerp_coeff;        // w or w - 1
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;     // -lr / bias_correction1
  bool stream_model;       // write the model parameter with non-temporal stores (large tensors only)
};

// Tag for "no model parameter attached": nothing is written.
struct NoModel {};

namespace portable {

inline uint16_t bf16_bits(float x) {  // c10::BFloat16's round_to_nearest_even, bit operations only
  if (std::isnan(x)) return UINT16_C(0x7FC0);
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return static_cast<uint16_t>((u + (((u >> 16) & 1u) + UINT32_C(0x7FFF))) >> 16);
}

// x stored as out's type: fp32 as is, bf16 | fp16 rounded to nearest even (torch's .to(dtype)).
inline void store_rounded(NoModel*, int64_t, float) {}
inline void store_rounded(float* out, int64_t i, float x) { out[i] = x; }
inline void store_rounded(c10::BFloat16* out, int64_t i, float x) { out[i].x = bf16_bits(x); }
inline void store_rounded(c10::Half* out, int64_t i, float x) { out[i] = c10::Half(x); }  // RNE, exact IEEE

// param_t: float (model_t: NoModel | bf16 | fp16) or bf16 | fp16 (model_t: NoModel; p, m, v in place).
template <typename param_t, typename grad_t, typename model_t>
void adamw(param_t* param, param_t* exp_avg, param_t* exp_avg_sq, const grad_t* grad, model_t* model, int64_t n,
           const AdamWCoefs& c) {
  for (int64_t i = 0; i < n; ++i) {
    float g = to_float(grad[i]);
    if (c.has_grad_scale) g = g / c.grad_scale;
    if (c.maximize) g = -g;
    float p = to_float(param[i]);
    if (c.decay) p = p * c.decay_factor;
    const float m_old = to_float(exp_avg[i]);
    const float m = std::fma(c.lerp_coeff, g - m_old, c.lerp_small ? m_old : g);
    const float g_scaled = c.one_minus_beta2 * g;
    const float v_decayed = to_float(exp_avg_sq[i]) * c.beta2;
    const float v = std::fma(g_scaled, g, v_decayed);
    store_rounded(exp_avg, i, m);  // the fp32 m and v feed the update below; only the stored copies are rounded
    store_rounded(exp_avg_sq, i, v);
    const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    p = p + (c.neg_step_size * m) / denom;
    store_rounded(param, i, p);
    store_rounded(model, i, p);
  }
}

}  // namespace portable

#if defined(GAENGINE_X86_KERNELS)
namespace avx2 {

// The 8 rounded values of x, as 16 bytes.
GAENGINE_AVX2 inline __m128i round8(c10::BFloat16*, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Every lane is <= 0xFFFF, so the unsigned-saturating pack is exact.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

GAENGINE_AVX2 inline __m128i round8(c10::Half*, __m256 x) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// kStream: a non-temporal store (out 16-byte aligned): the model parameter is only written here, so a large
// one need not be read into the cache first (saves 2 B/element of read-for-ownership traffic).
template <bool kStream>
GAENGINE_AVX2 inline void store8(NoModel*, __m256) {}

template <bool kStream>
GAENGINE_AVX2 inline void store8(float* out, __m256 x) { _mm256_storeu_ps(out, x); }  // an fp32 param_t's stream

template <bool kStream, typename model_t>
GAENGINE_AVX2 inline void store8(model_t* out, __m256 x) {
  const __m128i v = round8(out, x);
  if (kStream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(out), v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), v);
  }
}

template <typename model_t>
GAENGINE_AVX2 inline model_t* offset(model_t* p, int64_t i) { return p + i; }
GAENGINE_AVX2 inline NoModel* offset(NoModel* p, int64_t) { return p; }

// RN(a / b) for 8 lanes and one divisor, by Markstein's correction instead of a division (as IA-64 does):
// with y = RN(1 / b), q = RN(a * y), r = a - q * b (exact: one FMA), RN(q + r * y) = RN(a / b), provided
// nothing underflows or overflows. The callers guarantee 2^-20 <= |b| <= 2^20. A lane whose q is not finite
// (a inf or NaN, or a / b overflowing) keeps q, which is then a / b (r would be NaN).
// kCheckRange: a may be anywhere (a gradient): a vector with a lane whose |a| is outside [2^-100, 2^100)
// (zero, subnormal, tiny, huge, inf, NaN) takes the IEEE division. Without it, a must be 0 or in
// [2^-100, 2^100) or inf/NaN (a square root of an fp32: [2^-75, 2^64]); a zero gives +0 (its sign is lost).
// Checked against _mm256_div_ps on 8e8 random and adversarial (all-ones significand) pairs: no difference.
template <bool kCheckRange>
GAENGINE_AVX2 inline __m256 div_by_scalar(__m256 a, __m256 b, __m256 y) {
  if (kCheckRange) {
    const __m256i exponent = _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000));
    const __m256i in_range = _mm256_and_si256(_mm256_cmpgt_epi32(exponent, _mm256_set1_epi32(26 << 23)),
                                              _mm256_cmpgt_epi32(_mm256_set1_epi32(227 << 23), exponent));
    if (_mm256_movemask_ps(_mm256_castsi256_ps(in_range)) != 0xFF) return _mm256_div_ps(a, b);
  }
  const __m256 q = _mm256_mul_ps(a, y);
  const __m256 r = _mm256_fnmadd_ps(q, b, a);
  const __m256 corrected = _mm256_fmadd_ps(r, y, q);
  if (kCheckRange) return corrected;
  return _mm256_blendv_ps(corrected, q, _mm256_cmp_ps(corrected, corrected, _CMP_UNORD_Q));
}

// How the gradient is divided by grad_scale: not at all, by Markstein's correction, or by vdivps (for a
// grad_scale outside [2^-20, 2^20]).
enum class Scale { kNone, kFast, kDivide };

// The vector loop over whole vectors of [0, n); returns the number of elements it did (a multiple of 8).
// Every per-call choice is a template argument or a local hoisted out of the loop: GCC reloads a struct
// member on every iteration, because the stores through float* may alias it.
template <bool kStream, Scale kScale, typename param_t, typename grad_t, typename model_t>
GAENGINE_AVX2 int64_t adamw_body(param_t* param, param_t* exp_avg, param_t* exp_avg_sq, const grad_t* grad,
                                 model_t* model, int64_t n, const AdamWCoefs& c) {
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  const __m256 grad_scale_rcp = _mm256_set1_ps(1.0f / c.grad_scale);
  const bool maximize = c.maximize, decay = c.decay, lerp_small = c.lerp_small;
  const bool fast_bc2 = c.bias_correction2_sqrt >= 0x1p-20f && c.bias_correction2_sqrt <= 0x1p20f;
  const __m256 decay_factor = _mm256_set1_ps(c.decay_factor);
  const __m256 lerp_coeff = _mm256_set1_ps(c.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bias_correction2_sqrt);
  const __m256 bc2_sqrt_rcp = _mm256_set1_ps(1.0f / c.bias_correction2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 neg_step_size = _mm256_set1_ps(c.neg_step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g = load8(grad + i);
    if constexpr (kScale == Scale::kFast) g = div_by_scalar<true>(g, grad_scale, grad_scale_rcp);
    if constexpr (kScale == Scale::kDivide) g = _mm256_div_ps(g, grad_scale);
    if (maximize) g = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
    __m256 p = load8(param + i);
    if (decay) p = _mm256_mul_ps(p, decay_factor);
    const __m256 m_old = load8(exp_avg + i);
    const __m256 m = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(g, m_old), lerp_small ? m_old : g);
    const __m256 g_scaled = _mm256_mul_ps(one_minus_beta2, g);
    const __m256 v_decayed = _mm256_mul_ps(load8(exp_avg_sq + i), beta2);
    const __m256 v = _mm256_fmadd_ps(g_scaled, g, v_decayed);
    store8<false>(exp_avg + i, m);  // fp32, or rounded to bf16 | fp16 (the update uses the fp32 m, v)
    store8<false>(exp_avg_sq + i, v);
    const __m256 sqrt_v = _mm256_sqrt_ps(v);
    const __m256 denom = _mm256_add_ps(
        fast_bc2 ? div_by_scalar<false>(sqrt_v, bc2_sqrt, bc2_sqrt_rcp) : _mm256_div_ps(sqrt_v, bc2_sqrt), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    store8<false>(param + i, p);
    store8<kStream>(offset(model, i), p);
  }
  return i;
}

template <bool kStream, typename param_t, typename grad_t, typename model_t>
GAENGINE_AVX2 int64_t adamw_body(param_t* param, param_t* exp_avg, param_t* exp_avg_sq, const grad_t* grad,
                                 model_t* model, int64_t n, const AdamWCoefs& c) {
  if (!c.has_grad_scale) return adamw_body<kStream, Scale::kNone>(param, exp_avg, exp_avg_sq, grad, model, n, c);
  const float gs = std::fabs(c.grad_scale);
  if (gs >= 0x1p-20f && gs <= 0x1p20f) {
    return adamw_body<kStream, Scale::kFast>(param, exp_avg, exp_avg_sq, grad, model, n, c);
  }
  return adamw_body<kStream, Scale::kDivide>(param, exp_avg, exp_avg_sq, grad, model, n, c);
}

template <typename param_t, typename grad_t, typename model_t>
GAENGINE_AVX2 void adamw(param_t* param, param_t* exp_avg, param_t* exp_avg_sq, const grad_t* grad, model_t* model,
                         int64_t n, const AdamWCoefs& c) {
  int64_t i;
  if constexpr (!std::is_same_v<model_t, NoModel>) {
    if (c.stream_model) {
      // Peel elements until the model pointer is 16-byte aligned (it is 2-byte aligned), then stream.
      const auto misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(model) & 15);
      const int64_t head = std::min<int64_t>(n, ((16 - misaligned) & 15) / 2);
      portable::adamw(param, exp_avg, exp_avg_sq, grad, model, head, c);
      i = head + adamw_body<true>(param + head, exp_avg + head, exp_avg_sq + head, grad + head, model + head,
                                  n - head, c);
      _mm_sfence();  // order the non-temporal stores before whatever follows the parallel region
      portable::adamw(param + i, exp_avg + i, exp_avg_sq + i, grad + i, model + i, n - i, c);
      return;
    }
  }
  i = adamw_body<false>(param, exp_avg, exp_avg_sq, grad, model, n, c);
  portable::adamw(param + i, exp_avg + i, exp_avg_sq + i, grad + i, offset(model, i), n - i, c);
}

}  // namespace avx2
#endif  // GAENGINE_X86_KERNELS

}  // namespace gaengine
