// l2norm_sq: the sum of squares and the non-finite flag of a tensor in two fixed-order stages (per-chunk
// partials, then one block), and launch_sum_partials, which finishes the bucket accumulate's free-norm
// partials with the same stage 2 (the CUDA counterpart of kernels/norm.py).
#pragma once

#include "common.cuh"

namespace gaengine {
namespace cuda {

constexpr int64_t kNormChunkNumel = 16384;     // elements per stage-1 block: 64 per thread, 16 fp32 vectors
constexpr int kFinalizeThreads = 1024;

// ---------------------------------------------------------------------------------------------------------
// l2norm_sq
// ---------------------------------------------------------------------------------------------------------
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

// Also stage 2 of the bucket accumulate's free norm (launch_sum_partials): the same partials layout.
__global__ void __launch_bounds__(kFinalizeThreads)
    l2norm_sq_finalize_kernel(const float* __restrict__ partials,  // (2, n_partials) fp32, read
                              int64_t n_partials,
                              float* __restrict__ sum_sq_out,      // () fp32, written: the sum of row 0
                              float* __restrict__ found_inf_out) {  // () fp32, written: 1.0 if a row-1 flag is set
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
    *sum_sq_out = sum_sq;
    *found_inf_out = found ? 1.f : 0.f;
  }
}

// ---------------------------------------------------------------------------------------------------------
// host launchers: no allocation, no sync; each returns the launch's error
// ---------------------------------------------------------------------------------------------------------
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
  l2norm_sq_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partials, n_partials, out, out + 1);  // n == 0: 0s
  return cudaGetLastError();
}

// *sum_sq_out = the sum of row 0 of a contiguous (2, n_chunks) partials array, *found_inf_out = 1.0 if a flag of
// row 1 is set, else 0.0 (both 0 for n_chunks == 0): one block, a fixed order (the same bits every run).
inline cudaError_t launch_sum_partials(const float* partials, int64_t n_chunks, float* sum_sq_out,
                                       float* found_inf_out, cudaStream_t stream) {
  l2norm_sq_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partials, n_chunks, sum_sq_out, found_inf_out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gaengine
