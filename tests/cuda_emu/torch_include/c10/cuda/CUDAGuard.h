// Stub of torch's c10/cuda/CUDAGuard.h for tests/cuda_emu/engine.py's emulated build of gaengine._C (see
// CUDAStream.h here): one device, the CPU, so selecting it is a no-op. Only what csrc/cuda/cuda_ops.cu uses.
#pragma once

#include <c10/core/Device.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device /*device*/) {}
  explicit CUDAGuard(c10::DeviceIndex /*device_index*/) {}
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
};

}  // namespace c10::cuda
