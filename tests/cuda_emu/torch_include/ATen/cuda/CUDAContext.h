// Stub of torch's ATen/cuda/CUDAContext.h for tests/cuda_emu/engine.py's emulated build of gaengine._C (see
// c10/cuda/CUDAStream.h here): the current cuBLAS handle is the shim's one context (include/cublas_v2.h). Only what
// csrc/cuda/cuda_ops.cu uses.
#pragma once

#include <cublas_v2.h>

namespace at::cuda {

inline cublasHandle_t getCurrentCUDABlasHandle() {
  static gaemu_cublas_context context;
  return &context;
}

}  // namespace at::cuda
