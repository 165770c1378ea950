// Host emulation of the CUDA toolkit's cuda_fp16.h (tests/cuda_emu): the __half type and the conversions
// csrc/cuda/*.cu use, bit for bit as the device does them. See tests/cuda_emu/README.md.
//
//   __half, __half_raw       2 bytes, the IEEE binary16 bits in __x (resp. x); __half(float) and
//                            operator float() as in CUDA (round to nearest even / exact widening)
//   __float2half(_rn)(f)     round to nearest even, subnormals and overflow to inf as IEEE; NaN -> 0x7FFF
//                            (the canonical NaN of cvt.rn.f16.f32)
//   __float2half_rz(f)       round toward zero
//   __half2float(h)          exact widening
//   __half_as_ushort / __ushort_as_half / __half_as_short / __short_as_half: bit casts
//   __hisnan, __hisinf
#pragma once

#include <cstdint>

#include "gaemu_bits.h"  // gaemu::float_bits, gaemu::bits_float

namespace gaemu {

// IEEE binary32 -> binary16, round to nearest even (kTowardZero: truncate).
template <bool kTowardZero = false>
inline uint16_t float_to_half_bits(float f) {
  uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return 0x7FFFu;                            // NaN
  if (u == 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u);  // inf
  if (kTowardZero) {
    if (u >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7BFFu);  // >= 65536: the largest finite
  } else if (u >= 0x477FF000u) {
    return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: rounds to inf
  }
  if (u >= 0x38800000u) {  // a normal half (>= 2^-14): rebias the exponent, round the 13 dropped bits
    if (!kTowardZero) u += 0xFFFu + ((u >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((u - 0x38000000u) >> 13));
  }
  if (u < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero (2^-25 itself: a tie, to 0)
  // A subnormal half: the value is m * 2^(e - 150), the half's unit is 2^-24, so the result is m >> (126 - e).
  const int e = static_cast<int>(u >> 23);
  const uint32_t m = (u & 0x7FFFFFu) | 0x800000u;
  const int shift = 126 - e;  // 14 .. 24
  uint32_t r = m >> shift;
  if (!kTowardZero) {
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
  }
  return static_cast<uint16_t>(sign | r);
}

// IEEE binary16 -> binary32, exact.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // subnormal: mant * 2^-24, normalized
  int e = 113;  // biased fp32 exponent of 2^-14
  uint32_t m = mant;
  while ((m & 0x400u) == 0) {
    m <<= 1;
    --e;
  }
  return bits_float(sign | (static_cast<uint32_t>(e) << 23) | ((m & 0x3FFu) << 13));
}

}  // namespace gaemu

struct __half_raw {
  unsigned short x;
};

struct alignas(2) __half {
  unsigned short __x;
  __half() = default;
  __half(const __half_raw& r) : __x(r.x) {}
  __half(float f) : __x(gaemu::float_to_half_bits(f)) {}
  __half(double d) : __x(gaemu::float_to_half_bits(static_cast<float>(d))) {}
  operator __half_raw() const { return __half_raw{__x}; }
  operator float() const { return gaemu::half_bits_to_float(__x); }
};
static_assert(sizeof(__half) == 2, "__half is 2 bytes");

struct alignas(4) __half2 {
  __half x, y;
};

inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __short_as_half(short s) { return __ushort_as_half(static_cast<unsigned short>(s)); }
inline short __half_as_short(__half h) { return static_cast<short>(h.__x); }
inline __half __float2half_rn(float f) { return __ushort_as_half(gaemu::float_to_half_bits(f)); }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __float2half_rz(float f) { return __ushort_as_half(gaemu::float_to_half_bits<true>(f)); }
inline float __half2float(__half h) { return gaemu::half_bits_to_float(h.__x); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline bool __hisnan(__half h) { return (h.__x & 0x7FFFu) > 0x7C00u; }
inline int __hisinf(__half h) { return (h.__x & 0x7FFFu) == 0x7C00u ? ((h.__x & 0x8000u) ? -1 : 1) : 0; }
