// Stub of torch's c10/cuda/CUDAStream.h for tests/cuda_emu/engine.py's emulated build of gaengine._C (this dir is
// searched before torch's headers there, and nowhere else): "CUDA" is the CPU device, whose tensors stand in for
// CUDA ones, and the current stream is the shim's only stream (null; launches run at once, tests/cuda_emu/README.md).
// Only what csrc/cuda/cuda_ops.cu uses.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime.h>  // the shim's: cudaStream_t

namespace c10::cuda {

class CUDAStream {
 public:
  explicit CUDAStream(c10::DeviceIndex device_index) : device_index_(device_index) {}
  operator cudaStream_t() const { return stream(); }  // NOLINT(google-explicit-constructor): as torch's
  cudaStream_t stream() const { return nullptr; }
  c10::DeviceIndex device_index() const { return device_index_; }

 private:
  c10::DeviceIndex device_index_;
};

inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex device_index = -1) { return CUDAStream(device_index); }

}  // namespace c10::cuda
