// Range kernels of the compiled CPU backend: each works on one contiguous range [0, n) of a flat buffer.
//
// Two implementations of every kernel, chosen at run time (never at build time, so the .so runs on any
// x86-64 machine):
//   portable::  plain C++ the compiler may auto-vectorize for the baseline ISA (SSE2 on x86-64, NEON on
//               aarch64); the fallback, and the only path off x86-64.
//   avx2::      AVX2 + FMA + F16C intrinsics in functions marked GAENGINE_AVX2; compiled without
//               -mavx2 and only called after cpu_has_avx2() said yes.
//
// Numerics (the contract of gaengine.backends; both paths keep it):
//   accumulate, scale == 1: dst = dst + float(src), one IEEE fp32 add (bitwise equal to torch's
//                           dst.add_(src)); with overwrite, dst = float(src), an exact widening copy.
//   accumulate, scaled:     computed in fp64 (fma(src, scale, dst)) and rounded once more to fp32, so the
//                           result is within 0.5 fp32 ulp (+2^-29 ulp) of the exact value even when scale
//                           is not representable in fp32.
//   sum_sq:                 squares summed in fp64. Squares of finite fp32 values (<= 1.2e77) cannot
//                           overflow fp64 over any realistic length, so the sum is non-finite exactly when
//                           an input is inf or NaN: found_inf is read off the sum, at no extra cost.
//   scale:                  x = x * coef, one fp32 multiply (bitwise equal to torch's x.mul_(coef)).
//   accumulate_sums:        unscaled accumulate (the same arithmetic, the same bits) and, in the same pass, the sums of
//                           squares in fp64 of the values it wrote (the "free norm") and / or of the sources it
//                           read (float(src), before the add; AVX2: fp32 squares summed 4 per lane first, see
//                           avx2::accumulate_sums_mode). Each non-finite exactly when one of its values is inf or
//                           NaN (as for sum_sq; AVX2 sources: or a square overflows fp32).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

// x86-64 builds carry the AVX2 kernels; other targets (or -DGAENGINE_NO_X86_KERNELS, which checks that
// the portable-only build still compiles) get the portable ones alone.
#if defined(__x86_64__) && !defined(GAENGINE_NO_X86_KERNELS)
#define GAENGINE_X86_KERNELS 1
#include <immintrin.h>
#define GAENGINE_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace gaengine {

// ------------------------------------------------------------------------------------------------------
// portable: the fallback. Conversions are written as bit operations so the loops can auto-vectorize.
// ------------------------------------------------------------------------------------------------------
namespace portable {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {  // bf16 is the top half of an fp32: zero-extend, shift left 16
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float to_float(c10::Half x) { return static_cast<float>(x); }  // exact (c10's IEEE conversion)

template <typename src_t>
void accumulate(float* dst, const src_t* src, int64_t n, double scale, bool overwrite) {
  if (scale == 1.0) {
    if (overwrite) {
      for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + to_float(src[i]);
    }
  } else if (overwrite) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(static_cast<double>(to_float(src[i])) * scale);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<float>(static_cast<double>(dst[i]) + static_cast<double>(to_float(src[i])) * scale);
    }
  }
}

template <typename src_t>
double sum_sq(const src_t* x, int64_t n) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0};  // four fixed lanes, combined in a fixed order: deterministic
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double v = to_float(x[i + k]);
      acc[k] += v * v;
    }
  }
  for (; i < n; ++i) {
    const double v = to_float(x[i]);
    acc[0] += v * v;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// The bucket's modes of an unscaled accumulate: an exact widening copy, or one IEEE fp32 add (accumulate above with
// scale == 1, element for element).
enum AccMode { kCopy, kAdd };

// The sums of squares an accumulate pass gives for free, in fp64: of the values it wrote (the free norm) and of the
// sources it read (float(src), before the add: the per-micro-batch norm of issue 17's noise scale).
struct Sums {
  double written = 0.0;
  double source = 0.0;
};

// accumulate of one mode and, with kWritten / kSource, the sums of squares of the values written / of the sources:
// four fixed lanes each (as in sum_sq), combined in a fixed order.
template <AccMode kMode, bool kWritten, bool kSource, typename src_t>
Sums accumulate_sums_mode(float* dst, const src_t* src, int64_t n) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0}, src_acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const float s = to_float(src[i + k]);
      const float r = kMode == kCopy ? s : dst[i + k] + s;
      dst[i + k] = r;
      if (kWritten) acc[k] += static_cast<double>(r) * static_cast<double>(r);
      if (kSource) src_acc[k] += static_cast<double>(s) * static_cast<double>(s);
    }
  }
  for (; i < n; ++i) {
    const float s = to_float(src[i]);
    const float r = kMode == kCopy ? s : dst[i] + s;
    dst[i] = r;
    if (kWritten) acc[0] += static_cast<double>(r) * static_cast<double>(r);
    if (kSource) src_acc[0] += static_cast<double>(s) * static_cast<double>(s);
  }
  return {(acc[0] + acc[1]) + (acc[2] + acc[3]), (src_acc[0] + src_acc[1]) + (src_acc[2] + src_acc[3])};
}

// accumulate(dst, src, n, 1.0, overwrite), returning the fp64 sums of squares of the values written (kWritten) and
// of the sources read (kSource); a sum not asked for is 0.
template <bool kWritten, bool kSource, typename src_t>
Sums accumulate_sums(float* dst, const src_t* src, int64_t n, bool overwrite) {
  return overwrite ? accumulate_sums_mode<kCopy, kWritten, kSource>(dst, src, n)
                   : accumulate_sums_mode<kAdd, kWritten, kSource>(dst, src, n);
}

inline void scale(float* x, int64_t n, float coef) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * coef;
}

}  // namespace portable

// ------------------------------------------------------------------------------------------------------
// avx2: 8 fp32 lanes per register, 4 registers per loop trip, scalar tails.
// ------------------------------------------------------------------------------------------------------
#if defined(GAENGINE_X86_KERNELS)
namespace avx2 {

GAENGINE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

GAENGINE_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

GAENGINE_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// dst[0:8] = float(fma(src, scale, base)) in fp64; base is dst (accumulate) or 0 (overwrite).
template <bool kOverwrite>
GAENGINE_AVX2 inline __m256 scaled8(__m256 s, const float* dst, __m256d scale) {
  const __m256d s_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(s));
  const __m256d s_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1));
  __m256d r_lo, r_hi;
  if (kOverwrite) {
    r_lo = _mm256_mul_pd(s_lo, scale);
    r_hi = _mm256_mul_pd(s_hi, scale);
  } else {
    const __m256 d = _mm256_loadu_ps(dst);
    r_lo = _mm256_fmadd_pd(s_lo, scale, _mm256_cvtps_pd(_mm256_castps256_ps128(d)));
    r_hi = _mm256_fmadd_pd(s_hi, scale, _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1)));
  }
  return _mm256_set_m128(_mm256_cvtpd_ps(r_hi), _mm256_cvtpd_ps(r_lo));
}

template <typename src_t>
GAENGINE_AVX2 void accumulate(float* dst, const src_t* src, int64_t n, double scale, bool overwrite) {
  int64_t i = 0;
  if (scale == 1.0 && overwrite) {
    for (; i + 32 <= n; i += 32) {
      const __m256 s0 = load8(src + i), s1 = load8(src + i + 8), s2 = load8(src + i + 16), s3 = load8(src + i + 24);
      _mm256_storeu_ps(dst + i, s0);
      _mm256_storeu_ps(dst + i + 8, s1);
      _mm256_storeu_ps(dst + i + 16, s2);
      _mm256_storeu_ps(dst + i + 24, s3);
    }
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  } else if (scale == 1.0) {
    for (; i + 32 <= n; i += 32) {
      const __m256 s0 = load8(src + i), s1 = load8(src + i + 8), s2 = load8(src + i + 16), s3 = load8(src + i + 24);
      _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), s0));
      _mm256_storeu_ps(dst + i + 8, _mm256_add_ps(_mm256_loadu_ps(dst + i + 8), s1));
      _mm256_storeu_ps(dst + i + 16, _mm256_add_ps(_mm256_loadu_ps(dst + i + 16), s2));
      _mm256_storeu_ps(dst + i + 24, _mm256_add_ps(_mm256_loadu_ps(dst + i + 24), s3));
    }
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), load8(src + i)));
  } else {
    const __m256d s = _mm256_set1_pd(scale);
    if (overwrite) {
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, scaled8<true>(load8(src + i), dst + i, s));
    } else {
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, scaled8<false>(load8(src + i), dst + i, s));
    }
  }
  portable::accumulate(dst + i, src + i, n - i, scale, overwrite);  // tail: < 8 elements, same numerics
}

template <typename src_t>
GAENGINE_AVX2 double sum_sq(const src_t* x, int64_t n) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = load8(x + i), b = load8(x + i + 8);
    const __m256d a_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(a)), a_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    const __m256d b_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(b)), b_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
    acc0 = _mm256_fmadd_pd(a_lo, a_lo, acc0);
    acc1 = _mm256_fmadd_pd(a_hi, a_hi, acc1);
    acc2 = _mm256_fmadd_pd(b_lo, b_lo, acc2);
    acc3 = _mm256_fmadd_pd(b_hi, b_hi, acc3);
  }
  const __m256d acc = _mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + portable::sum_sq(x + i, n - i);
}

// acc_lo/acc_hi += r*r in fp64 (the low and the high four lanes of r).
GAENGINE_AVX2 inline void sq_acc(__m256 r, __m256d& acc_lo, __m256d& acc_hi) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(r)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1));
  acc_lo = _mm256_fmadd_pd(lo, lo, acc_lo);
  acc_hi = _mm256_fmadd_pd(hi, hi, acc_hi);
}

// Eight written values of an unscaled accumulate, by mode, from the eight loaded sources sv: exactly the vectors
// accumulate() above stores.
template <portable::AccMode kMode>
GAENGINE_AVX2 inline __m256 accumulated8(__m256 sv, const float* dst) {
  return kMode == portable::kCopy ? sv : _mm256_add_ps(_mm256_loadu_ps(dst), sv);
}

// accumulate of one mode and the sums of portable::accumulate_sums_mode: per sum, four fp64 accumulators of four
// lanes each, combined in a fixed order, then the portable tail (< 8 elements, the same arithmetic). The sources'
// squares go through fp32 first, in blocks of 64 elements: each of 16 fp32 lanes sums its 4 squares by FMA (exact
// squares for bf16 / fp16 sources; at most 4 roundings of 2^-24), then the block joins the fp64 lanes. Converting
// every square to fp64 (as the written sum does) costs the single-threaded pass about 25% of its time; the blocks
// cost about 3% (a square beyond fp32's range, |v| > 1.8e19, then reads as inf, as in the CUDA kernel).
template <portable::AccMode kMode, bool kWritten, bool kSource, typename src_t>
GAENGINE_AVX2 portable::Sums accumulate_sums_mode(float* dst, const src_t* src, int64_t n) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  __m256d src0 = _mm256_setzero_pd(), src1 = _mm256_setzero_pd();
  __m256d src2 = _mm256_setzero_pd(), src3 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 64 <= n;) {
    __m256 sq0 = _mm256_setzero_ps(), sq1 = _mm256_setzero_ps();  // this block's source squares, fp32
    for (int k = 0; k < 4; ++k, i += 16) {
      const __m256 v0 = load8(src + i), v1 = load8(src + i + 8);
      const __m256 r0 = accumulated8<kMode>(v0, dst + i), r1 = accumulated8<kMode>(v1, dst + i + 8);
      if (kSource) {
        sq0 = _mm256_fmadd_ps(v0, v0, sq0);
        sq1 = _mm256_fmadd_ps(v1, v1, sq1);
      }
      _mm256_storeu_ps(dst + i, r0);
      _mm256_storeu_ps(dst + i + 8, r1);
      if (kWritten) {
        sq_acc(r0, acc0, acc1);
        sq_acc(r1, acc2, acc3);
      }
    }
    if (kSource) {
      src0 = _mm256_add_pd(src0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq0)));
      src1 = _mm256_add_pd(src1, _mm256_cvtps_pd(_mm256_extractf128_ps(sq0, 1)));
      src2 = _mm256_add_pd(src2, _mm256_cvtps_pd(_mm256_castps256_ps128(sq1)));
      src3 = _mm256_add_pd(src3, _mm256_cvtps_pd(_mm256_extractf128_ps(sq1, 1)));
    }
  }
  // < 64 left: per element in fp64 (the written sum's order is that of 16-element steps throughout)
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = load8(src + i), v1 = load8(src + i + 8);
    const __m256 r0 = accumulated8<kMode>(v0, dst + i), r1 = accumulated8<kMode>(v1, dst + i + 8);
    if (kSource) {
      sq_acc(v0, src0, src1);
      sq_acc(v1, src2, src3);
    }
    _mm256_storeu_ps(dst + i, r0);
    _mm256_storeu_ps(dst + i + 8, r1);
    if (kWritten) {
      sq_acc(r0, acc0, acc1);
      sq_acc(r1, acc2, acc3);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(src + i);
    const __m256 r = accumulated8<kMode>(v, dst + i);
    if (kSource) sq_acc(v, src0, src1);
    _mm256_storeu_ps(dst + i, r);
    if (kWritten) sq_acc(r, acc0, acc1);
  }
  alignas(32) double lanes[4], src_lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3)));
  _mm256_store_pd(src_lanes, _mm256_add_pd(_mm256_add_pd(src0, src1), _mm256_add_pd(src2, src3)));
  const portable::Sums tail = portable::accumulate_sums_mode<kMode, kWritten, kSource>(dst + i, src + i, n - i);
  return {((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + tail.written,
          ((src_lanes[0] + src_lanes[1]) + (src_lanes[2] + src_lanes[3])) + tail.source};
}

template <bool kWritten, bool kSource, typename src_t>
GAENGINE_AVX2 portable::Sums accumulate_sums(float* dst, const src_t* src, int64_t n, bool overwrite) {
  return overwrite ? accumulate_sums_mode<portable::kCopy, kWritten, kSource>(dst, src, n)
                   : accumulate_sums_mode<portable::kAdd, kWritten, kSource>(dst, src, n);
}

GAENGINE_AVX2 inline void scale(float* x, int64_t n, float coef) {
  const __m256 c = _mm256_set1_ps(coef);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), c));
    _mm256_storeu_ps(x + i + 8, _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), c));
    _mm256_storeu_ps(x + i + 16, _mm256_mul_ps(_mm256_loadu_ps(x + i + 16), c));
    _mm256_storeu_ps(x + i + 24, _mm256_mul_ps(_mm256_loadu_ps(x + i + 24), c));
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), c));
  portable::scale(x + i, n - i, coef);
}

}  // namespace avx2
#endif  // GAENGINE_X86_KERNELS

}  // namespace gaengine
