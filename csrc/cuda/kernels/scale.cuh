// scale: x *= *coef, the coefficient read on the device (the CUDA counterpart of kernels/scale.py).
#pragma once

#include "common.cuh"

namespace gaengine {
namespace cuda {

// ---------------------------------------------------------------------------------------------------------
// scale
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    scale_kernel(float* __restrict__ x,  // (n,) fp32, read and written
                 int64_t n,
                 const float* __restrict__ coef) {  // () fp32, read
  const float c = *coef;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t scalar_start = 0;
  if (aligned16(x)) {
    const int64_t n_vectors = n / 4;
    float4* x4 = reinterpret_cast<float4*>(x);
    for (int64_t v = tid; v < n_vectors; v += stride) {
      float4 d = x4[v];
      d.x = __fmul_rn(d.x, c);
      d.y = __fmul_rn(d.y, c);
      d.z = __fmul_rn(d.z, c);
      d.w = __fmul_rn(d.w, c);
      x4[v] = d;
    }
    scalar_start = n_vectors * 4;
  }
  for (int64_t i = scalar_start + tid; i < n; i += stride) x[i] = __fmul_rn(x[i], c);
}

// ---------------------------------------------------------------------------------------------------------
// host launcher: no allocation, no sync; returns the launch's error
// ---------------------------------------------------------------------------------------------------------
// x *= *coef.
inline cudaError_t launch_scale(float* x, int64_t n, const float* coef, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  scale_kernel<<<elementwise_blocks(n, 4), kThreads, 0, stream>>>(x, n, coef);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gaengine
