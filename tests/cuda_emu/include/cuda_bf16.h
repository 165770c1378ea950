// Host emulation of the CUDA toolkit's cuda_bf16.h (tests/cuda_emu): the __nv_bfloat16 type and the conversions
// csrc/cuda/*.cu use, bit for bit as the device does them. See tests/cuda_emu/README.md.
//
//   __nv_bfloat16, __nv_bfloat16_raw   2 bytes, the top half of an fp32 in __x (resp. x); __nv_bfloat16(float)
//                                      and operator float() as in CUDA
//   __float2bfloat16(_rn)(f)           round to nearest even (overflow to inf); NaN -> 0x7FFF (the canonical NaN
//                                      of cvt.rn.bf16.f32)
//   __float2bfloat16_rz(f)             round toward zero (truncation; NaN -> 0x7FFF)
//   __bfloat162float(b)                exact widening (b << 16)
//   __bfloat16_as_ushort / __ushort_as_bfloat16 / __bfloat16_as_short / __short_as_bfloat16: bit casts
#pragma once

#include <cstdint>

#include "cuda_fp16.h"    // the toolkit's cuda_bf16.h includes it too
#include "gaemu_bits.h"  // gaemu::float_bits, gaemu::bits_float

namespace gaemu {

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline uint16_t float_to_bf16_bits_rz(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

}  // namespace gaemu

struct __nv_bfloat16_raw {
  unsigned short x;
};

struct alignas(2) __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
  __nv_bfloat16(float f) : __x(gaemu::float_to_bf16_bits(f)) {}
  __nv_bfloat16(double d) : __x(gaemu::float_to_bf16_bits(static_cast<float>(d))) {}
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
  operator float() const { return gaemu::bf16_bits_to_float(__x); }
};
static_assert(sizeof(__nv_bfloat16) == 2, "__nv_bfloat16 is 2 bytes");

struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16(__nv_bfloat16_raw{u}); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __short_as_bfloat16(short s) { return __ushort_as_bfloat16(static_cast<unsigned short>(s)); }
inline short __bfloat16_as_short(__nv_bfloat16 b) { return static_cast<short>(b.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __ushort_as_bfloat16(gaemu::float_to_bf16_bits(f)); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { return __ushort_as_bfloat16(gaemu::float_to_bf16_bits_rz(f)); }
inline float __bfloat162float(__nv_bfloat16 b) { return gaemu::bf16_bits_to_float(b.__x); }
inline float __low2float(__nv_bfloat162 b) { return __bfloat162float(b.x); }
inline float __high2float(__nv_bfloat162 b) { return __bfloat162float(b.y); }
inline bool __hisnan(__nv_bfloat16 b) { return (b.__x & 0x7FFFu) > 0x7F80u; }
