// accumulate: dst = (0 if overwrite else dst) + float(src) * scale, one tensor per launch (the CUDA
// counterpart of kernels/accumulate.py).
#pragma once

#include "common.cuh"

namespace gaengine {
namespace cuda {

template <bool kOverwrite, bool kHasScale>
__device__ __forceinline__ float accumulate_one(float dst, float grad, float scale) {
  if constexpr (kHasScale) return kOverwrite ? __fmul_rn(grad, scale) : __fmaf_rn(grad, scale, dst);
  return kOverwrite ? grad : __fadd_rn(dst, grad);
}

// ---------------------------------------------------------------------------------------------------------
// accumulate
// ---------------------------------------------------------------------------------------------------------
template <typename src_t, bool kOverwrite, bool kHasScale>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    accumulate_kernel(float* __restrict__ dst,            // (n,) fp32, read unless kOverwrite, written
                      const src_t* __restrict__ src,      // (n,) fp32 | bf16 | fp16, read
                      int64_t n, float scale,
                      const float* __restrict__ scale_ptr) {  // () fp32 or null: then `scale` is used
  [[maybe_unused]] const float s = (kHasScale && scale_ptr != nullptr) ? *scale_ptr : scale;
  constexpr int kElems = Vector<src_t>::kElems;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t scalar_start = 0;
  if (aligned16(dst) && aligned16(src)) {
    const int64_t n_vectors = n / kElems;
    for (int64_t v = tid; v < n_vectors; v += stride) {
      float grad[kElems];
      load_vector(src + v * kElems, grad);
      float4* out = reinterpret_cast<float4*>(dst + v * kElems);
#pragma unroll
      for (int q = 0; q < kElems / 4; ++q) {
        float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
        if constexpr (!kOverwrite) d = out[q];
        d.x = accumulate_one<kOverwrite, kHasScale>(d.x, grad[4 * q + 0], s);
        d.y = accumulate_one<kOverwrite, kHasScale>(d.y, grad[4 * q + 1], s);
        d.z = accumulate_one<kOverwrite, kHasScale>(d.z, grad[4 * q + 2], s);
        d.w = accumulate_one<kOverwrite, kHasScale>(d.w, grad[4 * q + 3], s);
        out[q] = d;
      }
    }
    scalar_start = n_vectors * kElems;
  }
  for (int64_t i = scalar_start + tid; i < n; i += stride) {
    float d = 0.f;
    if constexpr (!kOverwrite) d = dst[i];
    dst[i] = accumulate_one<kOverwrite, kHasScale>(d, to_float(src[i]), s);
  }
}

// ---------------------------------------------------------------------------------------------------------
// host launcher: no allocation, no sync; returns the launch's error
// ---------------------------------------------------------------------------------------------------------
// dst = (0 if overwrite else dst) + float(src) * s, s = *scale_ptr if scale_ptr else scale (1.0: no multiply).
template <typename src_t>
cudaError_t launch_accumulate(float* dst, const src_t* src, int64_t n, float scale, const float* scale_ptr,
                              bool overwrite, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned int blocks = elementwise_blocks(n, Vector<src_t>::kElems);
  const bool has_scale = scale_ptr != nullptr || scale != 1.0f;
  if (overwrite && has_scale) {
    accumulate_kernel<src_t, true, true><<<blocks, kThreads, 0, stream>>>(dst, src, n, scale, scale_ptr);
  } else if (overwrite) {
    accumulate_kernel<src_t, true, false><<<blocks, kThreads, 0, stream>>>(dst, src, n, scale, scale_ptr);
  } else if (has_scale) {
    accumulate_kernel<src_t, false, true><<<blocks, kThreads, 0, stream>>>(dst, src, n, scale, scale_ptr);
  } else {
    accumulate_kernel<src_t, false, false><<<blocks, kThreads, 0, stream>>>(dst, src, n, scale, scale_ptr);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gaengine
