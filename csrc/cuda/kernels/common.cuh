// What every kernel family of csrc/cuda/kernels/ shares: the block shape and grid cap, fp32 widening and
// 128-bit vector loads, the fixed-order block reductions, grid sizing, and the multi-tensor kernels' common
// ground (the kernel-parameter limit, the dtype codes of an entry, the chunk -> tensor search).
// csrc/cuda/kernels.cuh (the umbrella) describes the access pattern and the numerics contract.
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

// ---------------------------------------------------------------------------------------------------------
// block reductions (fixed order: the same bits every run)
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

// ---------------------------------------------------------------------------------------------------------
// grid sizing
// ---------------------------------------------------------------------------------------------------------
inline unsigned int elementwise_blocks(int64_t n, int elems_per_thread) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * elems_per_thread;
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// =========================================================================================================
// Multi-tensor kernels: one launch for a whole list of tensors
// =========================================================================================================
// The list travels BY VALUE, as the kernel's parameter struct (`const __grid_constant__`: read in place from
// the constant bank, so no device-side table, no host-to-device copy, no allocation, no sync). CUDA >= 12.1
// on sm_70+ allows kMaxKernelParamBytes = 32764 bytes of kernel parameters (4096 before); the capacities
// kMaxBucketEntries and kMaxAdamWEntries are chosen so each struct fits (static_asserts below;
// tests/test_nvcc.py also reads the .param sizes from the PTX), and a launcher splits a longer list into
// ceil(n / capacity) launches, the only case with more than one.
//
// Work split: every tensor is cut into fixed chunks of kChunkNumel elements, numbered over the list (tensor
// 0's chunks first); chunk_start[k] is the prefix sum of the chunk counts of the tensors before k. Block b
// walks chunks b, b + gridDim.x, ... (grid-stride) and finds the tensor of chunk c by binary search over
// chunk_start, from the tensor of its previous chunk (a block's chunks increase). All threads of a block
// search the same values: uniform constant-bank reads, no shared memory, no barrier.

constexpr int kMaxKernelParamBytes = 32764;  // sm_70+ with CUDA >= 12.1 (driver and toolkit)

// BucketEntry::src_dtype and AdamWEntry::grad_dtype / model_dtype.
constexpr int32_t kDtypeFp32 = 0;
constexpr int32_t kDtypeBf16 = 1;
constexpr int32_t kDtypeFp16 = 2;

// The tensor of chunk c: the largest k in [lo, n) with chunk_start[k] <= c (an empty tensor has the start
// of the next one, so the result has c inside it). Requires chunk_start[lo] <= c < the list's chunk count.
__device__ __forceinline__ int find_tensor(const int64_t* chunk_start, int lo, int n, int64_t c) {
  int hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (chunk_start[mid] <= c) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

inline int64_t num_chunks(int64_t numel, int64_t chunk_numel) { return (numel + chunk_numel - 1) / chunk_numel; }

inline unsigned int chunk_blocks(int64_t n_chunks) {
  return static_cast<unsigned int>(n_chunks < 1 ? 1 : (n_chunks > kMaxBlocks ? kMaxBlocks : n_chunks));
}

}  // namespace cuda
}  // namespace gaengine
