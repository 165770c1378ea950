// Bit casts between fp32 and its 32 bits, shared by the shim headers of tests/cuda_emu.
#pragma once

#include <cstdint>
#include <cstring>

namespace gaemu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace gaemu
