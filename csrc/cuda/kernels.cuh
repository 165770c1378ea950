// CUDA kernels of gaengine's "cuda" backend (gaengine.backends.CudaBackend), with no torch dependency:
// tests/test_nvcc.py compiles them with nvcc for sm_80 and sm_90 on machines without a GPU or a CUDA torch,
// and csrc/cuda/cuda_ops.cu binds them.
//
// Kernels (every pointer is a device pointer; n and offsets are int64: buffers pass 2^31 elements):
//   accumulate_kernel<src_t, kOverwrite, kHasScale>  dst = (0 if overwrite else dst) + float(src) * scale
//   l2norm_sq_partial_kernel<src_t>                  per-block sum of squares + non-finite flag (stage 1)
//   l2norm_sq_finalize_kernel                        one block sums the partials in a fixed order (stage 2)
//   scale_kernel                                     x *= *coef (coef read on the device)
// and a host launcher for each (launch_accumulate, launch_l2norm_sq, launch_scale) that returns the launch's
// cudaError_t.
//
// Memory access: 128-bit loads and stores (float4 for fp32, uint4 = eight bf16 | fp16 for 16-bit sources)
// over the largest prefix of whole vectors when every pointer is 16-byte aligned (gaengine/buffer.py starts
// each parameter at a multiple of ALIGN_NUMEL = 64 elements; fresh gradients are 512-byte aligned), then a
// scalar tail; unaligned pointers take the scalar loop throughout. The choice is made in the kernel from the
// pointer values (uniform per launch), so the host needs no knowledge of alignment.
//
// Numerics, the contract of gaengine.backends (the Triton kernels round the same way):
//   accumulate, unscaled:   one IEEE fp32 add (__fadd_rn), bitwise equal to torch's dst.add_(src);
//                           overwrite is an exact widening copy.
//   accumulate, scaled:     one fused multiply-add (__fmaf_rn: one rounding, within 0.5 fp32 ulp), or one
//                           multiply (__fmul_rn) when overwriting. scale is a float argument, or read from
//                           scale_ptr (a 0-d fp32 device tensor) when scale_ptr is not null.
//   l2norm_sq:              fp32 squares fused into per-thread sums (__fmaf_rn), then fixed-order trees: each
//                           block covers a fixed chunk of kNormChunkNumel elements, so the bits depend on n
//                           only (not on the GPU, the grid or a run). found_inf: 1.0 if an element is inf or
//                           NaN, else 0.0 (a finite sum that overflows fp32 is not flagged).
//   scale:                  one fp32 multiply (__fmul_rn), bitwise equal to torch's x.mul_(coef).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gaengine {
namespace cuda {

constexpr int kThreads = 256;                  // threads per block of every kernel
// Blocks of kThreads that fill an sm_80 / sm_90 SM (2048 threads): __launch_bounds__ then holds ptxas to
// 65536 / 2048 = 32 registers per thread, full occupancy (tests/test_nvcc.py checks that nothing spills).
constexpr int kMinBlocksPerSm = 2048 / kThreads;
constexpr int kVectorBytes = 16;               // one 128-bit access
constexpr int64_t kMaxBlocks = 65536;          // elementwise grids stride over larger buffers
constexpr int64_t kNormChunkNumel = 16384;     // elements per stage-1 block: 64 per thread, 16 fp32 vectors
constexpr int kFinalizeThreads = 1024;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// kElems values of src_t in one 128-bit vector: 4 fp32, 8 bf16 | fp16.
template <typename src_t>
struct Vector {
  static constexpr int kElems = kVectorBytes / sizeof(src_t);
};

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }

// One 128-bit load of kElems src_t values, widened to fp32 (exact).
template <typename src_t>
__device__ __forceinline__ void load_vector(const src_t* p, float (&out)[Vector<src_t>::kElems]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const src_t* values = reinterpret_cast<const src_t*>(&raw);
#pragma unroll
  for (int k = 0; k < Vector<src_t>::kElems; ++k) out[k] = to_float(values[k]);
}

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
// l2norm_sq
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool non_finite(float x) { return !isfinite(x); }

// Sum over the block in a fixed order (warp shuffles, then warp 0 over the warps' sums); valid in thread 0.
__device__ __forceinline__ float block_sum(float value, float* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = 0.f;
  if (warp == 0) {
    value = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  __syncthreads();  // `shared` may be reused by the caller
  return value;
}

__device__ __forceinline__ bool block_any(bool flag) { return __syncthreads_or(flag) != 0; }

template <typename src_t>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    l2norm_sq_partial_kernel(const src_t* __restrict__ x,  // (n,) fp32 | bf16 | fp16, read
                             int64_t n,
                             float* __restrict__ partials,  // (2, n_partials) fp32, written: sums, flags
                             int64_t n_partials) {
  __shared__ float shared[kThreads / 32];
  constexpr int kElems = Vector<src_t>::kElems;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kNormChunkNumel;
  const int64_t end = begin + kNormChunkNumel < n ? begin + kNormChunkNumel : n;
  float sum_sq = 0.f;
  bool found = false;
  int64_t scalar_start = begin;
  if (aligned16(x)) {  // begin is a multiple of kNormChunkNumel, hence of kElems
    const int64_t vector_end = begin + (end - begin) / kElems * kElems;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * kElems; i < vector_end; i += kThreads * kElems) {
      float v[kElems];
      load_vector(x + i, v);
#pragma unroll
      for (int k = 0; k < kElems; ++k) {
        sum_sq = __fmaf_rn(v[k], v[k], sum_sq);
        found |= non_finite(v[k]);
      }
    }
    scalar_start = vector_end;
  }
  for (int64_t i = scalar_start + threadIdx.x; i < end; i += kThreads) {
    const float v = to_float(x[i]);
    sum_sq = __fmaf_rn(v, v, sum_sq);
    found |= non_finite(v);
  }
  sum_sq = block_sum(sum_sq, shared);
  found = block_any(found);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = sum_sq;
    partials[n_partials + blockIdx.x] = found ? 1.f : 0.f;
  }
}

__global__ void __launch_bounds__(kFinalizeThreads)
    l2norm_sq_finalize_kernel(const float* __restrict__ partials,  // (2, n_partials) fp32, read
                              int64_t n_partials,
                              float* __restrict__ out) {  // (2,) fp32, written: [sum of squares, found_inf]
  __shared__ float shared[kFinalizeThreads / 32];
  float sum_sq = 0.f;
  bool found = false;
  for (int64_t i = threadIdx.x; i < n_partials; i += kFinalizeThreads) {  // a fixed per-thread order
    sum_sq += partials[i];
    found |= partials[n_partials + i] != 0.f;
  }
  sum_sq = block_sum(sum_sq, shared);
  found = block_any(found);
  if (threadIdx.x == 0) {
    out[0] = sum_sq;
    out[1] = found ? 1.f : 0.f;
  }
}

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
// host launchers: no allocation, no sync; each returns the launch's error
// ---------------------------------------------------------------------------------------------------------
inline unsigned int elementwise_blocks(int64_t n, int elems_per_thread) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * elems_per_thread;
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

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

// Partials needed by launch_l2norm_sq for n elements: a (2, l2norm_sq_num_partials(n)) fp32 scratch buffer.
inline int64_t l2norm_sq_num_partials(int64_t n) { return (n + kNormChunkNumel - 1) / kNormChunkNumel; }

// out[0] = sum of squares of x, out[1] = found_inf; partials: (2, l2norm_sq_num_partials(n)) fp32 scratch.
template <typename src_t>
cudaError_t launch_l2norm_sq(const src_t* x, int64_t n, float* partials, float* out, cudaStream_t stream) {
  const int64_t n_partials = l2norm_sq_num_partials(n);
  if (n_partials > 0) {
    l2norm_sq_partial_kernel<src_t><<<static_cast<unsigned int>(n_partials), kThreads, 0, stream>>>(
        x, n, partials, n_partials);
  }
  l2norm_sq_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partials, n_partials, out);  // n == 0: zeros
  return cudaGetLastError();
}

// x *= *coef.
inline cudaError_t launch_scale(float* x, int64_t n, const float* coef, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  scale_kernel<<<elementwise_blocks(n, 4), kThreads, 0, stream>>>(x, n, coef);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gaengine
