// CUDA kernels of gaengine's "cuda" backend (gaengine.backends.CudaBackend), with no torch dependency:
// tests/test_nvcc.py compiles them with nvcc for sm_80 and sm_90 on machines without a GPU or a CUDA torch,
// and csrc/cuda/cuda_ops.cu binds them.
//
// Kernels (every pointer is a device pointer; n and offsets are int64: buffers pass 2^31 elements):
//   accumulate_kernel<src_t, kOverwrite, kHasScale>  dst = (0 if overwrite else dst) + float(src) * scale
//   l2norm_sq_partial_kernel<src_t>                  per-block sum of squares + non-finite flag (stage 1)
//   l2norm_sq_finalize_kernel                        one block sums the partials in a fixed order (stage 2)
//   scale_kernel                                     x *= *coef (coef read on the device)
//   accumulate_bucket_kernel<kPartials>              a bucket of sources into slices of dst, one launch (+ the
//                                                    per-chunk free-norm partials of the values written)
//   adamw_multi_kernel<param_t>                      the fused AdamW step of a list of parameters, one launch:
//                                                    param_t float (fp32 masters, fp32 m, v, an optional bf16 |
//                                                    fp16 model write) or bf16 | fp16 (in place, m, v in that dtype)
// and a host launcher for each (launch_accumulate, launch_l2norm_sq, launch_scale, launch_accumulate_bucket,
// launch_sum_partials, launch_adamw_multi<param_t>) that returns the launch's cudaError_t. The two multi-tensor kernels
// take their tensor list by value as the kernel-parameter struct (see "Multi-tensor kernels" below).
//
// Memory access: 128-bit loads and stores (float4 for fp32, uint4 = eight bf16 | fp16 for 16-bit sources)
// over the largest prefix of whole vectors when every pointer is 16-byte aligned (gaengine/buffer.py starts
// each parameter at a multiple of ALIGN_NUMEL = 64 elements; fresh gradients are 512-byte aligned), then a
// scalar tail; unaligned pointers take the scalar loop throughout. The choice is made in the kernel from the
// pointer values (uniform per launch; per chunk in the multi-tensor kernels), so the host needs no knowledge of
// alignment. (The multi-tensor AdamW moves 4 elements a step: float4 for its fp32 streams, 64-bit accesses for
// bf16 | fp16 gradients, model parameters and the p, m, v of a bf16 | fp16 param_t.)
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
//   accumulate_bucket:      unscaled accumulate / overwrite as above, per source; partials as l2norm_sq's stage 1
//                           over kBucketChunkNumel-element chunks of each source (of the values written).
//   adamw_multi:            csrc/adamw_kernels.h's fp32 operations exactly (see the section below).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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
  l2norm_sq_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partials, n_partials, out, out + 1);  // n == 0: 0s
  return cudaGetLastError();
}

// x *= *coef.
inline cudaError_t launch_scale(float* x, int64_t n, const float* coef, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  scale_kernel<<<elementwise_blocks(n, 4), kThreads, 0, stream>>>(x, n, coef);
  return cudaGetLastError();
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

// ---------------------------------------------------------------------------------------------------------
// bucket accumulate: dst[off_i : off_i + n_i] = (0 if overwrite_i else dst[...]) + float(src_i), every i
// ---------------------------------------------------------------------------------------------------------
// 4096 elements per chunk: 16 per thread (4 fp32 | 2 bf16/fp16 128-bit vectors), 40 KB of traffic per
// chunk when adding a bf16 source, against one binary search (9 steps at 512 entries) and, with partials,
// one block reduction.
constexpr int64_t kBucketChunkNumel = 4096;
// 512 entries x (32 B + 8 B of chunk_start) + 48 B = 20528 B of parameters, under kMaxKernelParamBytes with
// room to spare (a larger table costs more to launch: the driver copies the whole struct every launch).
constexpr int kMaxBucketEntries = 512;

struct BucketEntry {
  const void* src;     // (numel,) fp32 | bf16 | fp16 device pointer, read
  int64_t dst_offset;  // element offset of this source's slice in dst
  int64_t numel;
  int32_t src_dtype;   // kDtypeFp32 | kDtypeBf16 | kDtypeFp16
  int32_t overwrite;   // != 0: dst's slice is written without being read (an exact widening copy)
};
static_assert(sizeof(BucketEntry) == 32, "BucketEntry is part of the kernel-parameter budget");

struct BucketParams {
  BucketEntry entries[kMaxBucketEntries];   // the non-empty entries of this launch, in the caller's order
  int64_t chunk_start[kMaxBucketEntries];   // first chunk of entries[k], counted from this launch's first
  float* dst;                               // (dst_numel,) fp32: the slices are read (unless overwrite), written
  float* partials;                          // null, or (2, partials_stride) fp32: columns chunk_base + c written
  int64_t partials_stride;                  // elements from row 0 to row 1 of partials
  int64_t chunk_base;                       // partials column of this launch's chunk 0
  int64_t n_chunks;                         // chunks of this launch
  int32_t n_entries;
};
static_assert(sizeof(BucketParams) <= kMaxKernelParamBytes, "BucketParams exceeds the 32764-byte kernel-parameter "
              "limit: lower kMaxBucketEntries");

// One chunk of one source into its dst slice: n <= kBucketChunkNumel elements from dst / src (the chunk's
// first element; 64-bit pointer arithmetic done by the caller, so the offsets here are 32-bit); with
// kPartials, the sum of squares and the non-finite flag of the values written go into sum_sq / found.
template <typename src_t, bool kPartials>
__device__ __forceinline__ void accumulate_chunk(float* __restrict__ dst, const src_t* __restrict__ src, int n,
                                                 bool overwrite, float& sum_sq, bool& found) {
  constexpr int kElems = Vector<src_t>::kElems;
  int scalar_start = 0;
  if (aligned16(dst) && aligned16(src)) {  // a chunk starts a multiple of kElems in: it keeps the alignment
    const int vector_end = n / kElems * kElems;
    // Not unrolled: all iterations' loads in flight at once (what the compiler does otherwise) need more than
    // the 32 registers of full occupancy, and 2048 threads x 16-48 bytes in flight already cover HBM latency.
#pragma unroll 1
    for (int i = threadIdx.x * kElems; i < vector_end; i += kThreads * kElems) {
      float grad[kElems];
      load_vector(src + i, grad);
      float4* out = reinterpret_cast<float4*>(dst + i);
      float4 old[kElems / 4];
      if (!overwrite) {  // uniform per chunk
#pragma unroll
        for (int q = 0; q < kElems / 4; ++q) old[q] = out[q];
      }
#pragma unroll
      for (int q = 0; q < kElems / 4; ++q) {
        float4 d = make_float4(grad[4 * q + 0], grad[4 * q + 1], grad[4 * q + 2], grad[4 * q + 3]);
        if (!overwrite) {
          d.x = __fadd_rn(old[q].x, d.x);
          d.y = __fadd_rn(old[q].y, d.y);
          d.z = __fadd_rn(old[q].z, d.z);
          d.w = __fadd_rn(old[q].w, d.w);
        }
        __stwb(out + q, d);  // a plain store, kept one 128-bit st.global.v4 (NVVM splits `out[q] = d` here)
        if constexpr (kPartials) {
          sum_sq = __fmaf_rn(d.x, d.x, sum_sq);
          sum_sq = __fmaf_rn(d.y, d.y, sum_sq);
          sum_sq = __fmaf_rn(d.z, d.z, sum_sq);
          sum_sq = __fmaf_rn(d.w, d.w, sum_sq);
          found |= non_finite(d.x) | non_finite(d.y) | non_finite(d.z) | non_finite(d.w);
        }
      }
    }
    scalar_start = vector_end;
  }
#pragma unroll 2
  for (int i = scalar_start + threadIdx.x; i < n; i += kThreads) {
    float d = to_float(src[i]);
    if (!overwrite) d = __fadd_rn(dst[i], d);
    dst[i] = d;
    if constexpr (kPartials) {
      sum_sq = __fmaf_rn(d, d, sum_sq);
      found |= non_finite(d);
    }
  }
}

template <bool kPartials>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    accumulate_bucket_kernel(const __grid_constant__ BucketParams params) {
  __shared__ float shared[kThreads / 32];  // block_sum's, with kPartials only
  int entry = 0;
  for (int64_t c = blockIdx.x; c < params.n_chunks; c += gridDim.x) {  // uniform: every barrier is reached
    entry = find_tensor(params.chunk_start, entry, params.n_entries, c);
    const BucketEntry& e = params.entries[entry];
    const int64_t begin = (c - params.chunk_start[entry]) * kBucketChunkNumel;  // int64: tensors pass 2^31
    const int n = static_cast<int>(e.numel - begin < kBucketChunkNumel ? e.numel - begin : kBucketChunkNumel);
    float* dst = params.dst + e.dst_offset + begin;
    const bool overwrite = e.overwrite != 0;
    float sum_sq = 0.f;
    bool found = false;
    if (e.src_dtype == kDtypeBf16) {
      accumulate_chunk<__nv_bfloat16, kPartials>(dst, static_cast<const __nv_bfloat16*>(e.src) + begin, n,
                                                 overwrite, sum_sq, found);
    } else if (e.src_dtype == kDtypeFp16) {
      accumulate_chunk<__half, kPartials>(dst, static_cast<const __half*>(e.src) + begin, n, overwrite, sum_sq,
                                          found);
    } else {
      accumulate_chunk<float, kPartials>(dst, static_cast<const float*>(e.src) + begin, n, overwrite, sum_sq,
                                         found);
    }
    if constexpr (kPartials) {  // this chunk's own slot: no atomics, the same bits every run
      sum_sq = block_sum(sum_sq, shared);
      found = block_any(found);
      if (threadIdx.x == 0) {
        const int64_t column = params.chunk_base + c;
        params.partials[column] = sum_sq;
        params.partials[params.partials_stride + column] = found ? 1.f : 0.f;
      }
    }
  }
}

// Chunks (= partials columns) of a bucket of these numels; entry i's chunks follow those of entries < i.
inline int64_t bucket_num_chunks(const int64_t* numels, int n) {
  int64_t total = 0;
  for (int i = 0; i < n; ++i) total += num_chunks(numels[i], kBucketChunkNumel);
  return total;
}

// For every entry i: dst[off_i : off_i + n_i] = (0 if overwrite_i else dst[...]) + float(src_i), unscaled (one
// __fadd_rn per element, bitwise equal to torch's add_; an overwrite is an exact widening copy). The slices
// must not overlap. One launch per kMaxBucketEntries non-empty entries (one for any usual bucket);
// *n_launches (when given) receives the number issued.
// partials: null, or a (2, bucket_num_chunks) fp32 device array (row stride partials_stride, 0: the chunk
// count, i.e. contiguous): column j receives the sum of squares (row 0) and the non-finite flag (row 1, 1.0 |
// 0.0) of the values written by chunk j; launch_sum_partials finishes the norm.
// entries: a host array, read before this returns. Returns the first launch error.
inline cudaError_t launch_accumulate_bucket(float* dst, const BucketEntry* entries, int n_entries, float* partials,
                                            cudaStream_t stream, int* n_launches = nullptr,
                                            int64_t partials_stride = 0) {
  if (n_launches != nullptr) *n_launches = 0;
  if (partials != nullptr && partials_stride == 0) {
    for (int i = 0; i < n_entries; ++i) partials_stride += num_chunks(entries[i].numel, kBucketChunkNumel);
  }
  BucketParams params;  // only the n_entries used are filled: the rest is never read
  params.dst = dst;
  params.partials = partials;
  params.partials_stride = partials_stride;
  int64_t chunk_base = 0;
  int i = 0;
  for (int launches = 1;; ++launches) {
    int k = 0;
    int64_t chunks = 0;
    for (; i < n_entries && k < kMaxBucketEntries; ++i) {
      const int64_t n = num_chunks(entries[i].numel, kBucketChunkNumel);
      if (n <= 0) continue;  // empty: no chunk, no partials column
      params.entries[k] = entries[i];
      params.chunk_start[k++] = chunks;
      chunks += n;
    }
    if (k == 0) return cudaSuccess;
    params.n_entries = k;
    params.n_chunks = chunks;
    params.chunk_base = chunk_base;
    if (partials != nullptr) {
      accumulate_bucket_kernel<true><<<chunk_blocks(chunks), kThreads, 0, stream>>>(params);
    } else {
      accumulate_bucket_kernel<false><<<chunk_blocks(chunks), kThreads, 0, stream>>>(params);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (n_launches != nullptr) *n_launches = launches;
    chunk_base += chunks;
  }
}

// *sum_sq_out = the sum of row 0 of a contiguous (2, n_chunks) partials array, *found_inf_out = 1.0 if a flag of
// row 1 is set, else 0.0 (both 0 for n_chunks == 0): one block, a fixed order (the same bits every run).
inline cudaError_t launch_sum_partials(const float* partials, int64_t n_chunks, float* sum_sq_out,
                                       float* found_inf_out, cudaStream_t stream) {
  l2norm_sq_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partials, n_chunks, sum_sq_out, found_inf_out);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------------------
// multi-tensor AdamW: gaengine::adamw_step_ (csrc/adamw.h) for a whole list of parameters in one launch
// ---------------------------------------------------------------------------------------------------------
// Numerics: exactly the fp32 operations of csrc/adamw_kernels.h (portable::adamw, torch's fused CPU AdamW),
// in its order, with IEEE division and square root (__fdiv_rn, __fsqrt_rn) and no contraction beyond the
// two FMAs written; the bias corrections 1 - beta^step in double from step + 1 (pow, sqrt), rounded to fp32
// once, as adamw.cpp does. The model parameter receives bf16 | fp16 round-to-nearest-even of the new param
// (bf16 NaN -> 0x7FC0 and fp16 NaN -> sign | 0x7E00, as c10 on the CPU).
// param_t (one kernel instantiation per type; every entry of a launch has it): float, the fp32 master weight
// with fp32 m, v and an optional model parameter (28 B/param with an fp32 grad, + 2 for the model write); or
// __nv_bfloat16 | __half, the model parameter updated in place with m, v in its dtype (master_weights=False):
// p, m, v widened to fp32, the same fp32 update, each rounded to nearest even as model_bits does (4 B of fp32
// grad + 3 x 2 read, 3 x 2 written = 16 B/param).
// Skip: when *found_inf != 0 every block returns before touching memory (step counts included).
// Step counts: every block reads step (the old count) for the bias corrections; the LAST block to finish
// (__threadfence + atomicAdd on *counter, the threadFenceReduction pattern) adds 1 to every step of the launch
// and resets *counter to 0, so no block can read an incremented count.
// 4096 elements per chunk (16 per thread, 4 vectors of 4): 112 KiB of traffic per chunk with fp32 grads, against
// one binary search and, when a block meets a new parameter, two double pows.
constexpr int64_t kAdamWChunkNumel = 4096;
// 384 entries x (64 B + 8 B of chunk_start) + 96 B = 27744 B of parameters, under kMaxKernelParamBytes.
constexpr int kMaxAdamWEntries = 384;
// 4 blocks of 256 threads per SM (half occupancy, <= 64 registers): each thread keeps four independent
// 16-byte loads in flight (grad, param, exp_avg, exp_avg_sq), 64 KB per SM, enough to saturate HBM; the
// update (two IEEE divisions, a square root) and the double pow of the bias corrections do not fit in 32
// registers without spilling.
constexpr int kAdamWMinBlocksPerSm = 4;

struct AdamWEntry {
  void* param;          // (numel,) param_t of the launch (fp32: the master weight; bf16 | fp16: in place), read and written
  const void* grad;     // (numel,) fp32 | bf16 | fp16 (grad_dtype), read
  void* exp_avg;        // (numel,) param_t, read and written
  void* exp_avg_sq;     // (numel,) param_t, read and written
  void* model;          // null, or (numel,) bf16 | fp16 (model_dtype), written
  float* step;          // () fp32: read (the count before this update), then incremented by 1
  int64_t numel;
  int32_t grad_dtype;   // kDtypeFp32 | kDtypeBf16 | kDtypeFp16
  int32_t model_dtype;  // kDtypeBf16 | kDtypeFp16 when model is not null (fp32 param_t only)
};
static_assert(sizeof(AdamWEntry) == 64, "AdamWEntry is part of the kernel-parameter budget");

// The per-call hyper-parameters: doubles for the bias corrections, fp32 coefficients rounded once from
// double (make_adamw_hyper, as adamw.cpp computes them).
struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  float decay_factor;     // 1 - lr * weight_decay
  float lerp_coeff;       // torch's lerp weight w = 1 - beta1 when lerp_small, else w - 1
  float beta2_f;
  float one_minus_beta2;
  float eps;
  int32_t decay;          // weight_decay != 0
  int32_t lerp_small;     // |w| < 0.5: m = fma(w, g - m, m), else m = fma(w - 1, g - m, g)
  int32_t maximize;
};

inline AdamWHyper make_adamw_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   bool maximize) {
  AdamWHyper h{};
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  const float lerp_weight = static_cast<float>(1.0 - beta1);
  h.lerp_small = (lerp_weight < 0.f ? -lerp_weight : lerp_weight) < 0.5f;
  h.lerp_coeff = h.lerp_small ? lerp_weight : lerp_weight - 1.0f;
  h.decay = weight_decay != 0.0;
  h.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  h.beta2_f = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.maximize = maximize;
  return h;
}

struct AdamWParams {
  AdamWEntry entries[kMaxAdamWEntries];  // this launch's parameters (empty ones too: their steps count)
  int64_t chunk_start[kMaxAdamWEntries];
  AdamWHyper hyper;
  const float* grad_scale;  // null, or () fp32: the gradient used is grad / *grad_scale
  const float* found_inf;   // null, or () fp32: != 0 skips the launch entirely
  unsigned int* counter;    // () u32, 0 before and after the launch: blocks finished so far
  int64_t n_chunks;
  int32_t n_entries;
};
static_assert(sizeof(AdamWParams) <= kMaxKernelParamBytes, "AdamWParams exceeds the 32764-byte kernel-parameter "
              "limit: lower kMaxAdamWEntries");

struct NoModelParam {};  // model_t when no model parameter is attached: nothing is written

// The bits of the model parameter's rounding of x, in the low 16 bits (selects, no branch).
__device__ __forceinline__ uint32_t model_bits(__nv_bfloat16*, float x) {  // c10::BFloat16's rounding
  const uint32_t u = __float_as_uint(x);
  const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  return isnan(x) ? 0x7FC0u : rounded;
}
__device__ __forceinline__ uint32_t model_bits(__half*, float x) {  // IEEE round to nearest even
  const uint32_t rounded = __half_as_ushort(__float2half_rn(x));
  return isnan(x) ? (((__float_as_uint(x) >> 16) & 0x8000u) | 0x7E00u) : rounded;
}

// Four consecutive values widened to fp32: one 128-bit load for fp32, one 64-bit load for bf16 | fp16.
__device__ __forceinline__ void load4(const float* p, float (&out)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
template <typename half_t>
__device__ __forceinline__ void load4(const half_t* p, float (&out)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const half_t* values = reinterpret_cast<const half_t*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = to_float(values[k]);
}

__device__ __forceinline__ void store4(NoModelParam*, const float (&)[4]) {}
template <typename model_t>
__device__ __forceinline__ void store4(model_t* out, const float (&p)[4]) {  // one 64-bit store
  // __stwb: a plain (write-back) store that stays one 64-bit st.global.v2 (NVVM splits the assignment).
  __stwb(reinterpret_cast<uint2*>(out), make_uint2(model_bits(out, p[0]) | (model_bits(out, p[1]) << 16),
                                                   model_bits(out, p[2]) | (model_bits(out, p[3]) << 16)));
}
__device__ __forceinline__ void store1(NoModelParam*, int64_t, float) {}
template <typename model_t>
__device__ __forceinline__ void store1(model_t* out, int64_t i, float p) {
  reinterpret_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(model_bits(out, p));
}

// The per-parameter fp32 coefficients, from this update's step count (adamw.cpp's formulas).
struct AdamWStepCoefs {
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};

// One element: csrc/adamw_kernels.h portable::adamw, operation for operation.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const AdamWHyper& h,
                                              bool has_grad_scale, float grad_scale, const AdamWStepCoefs& s) {
  if (has_grad_scale) g = __fdiv_rn(g, grad_scale);
  if (h.maximize) g = -g;
  if (h.decay) p = __fmul_rn(p, h.decay_factor);
  const float m_old = m;
  m = __fmaf_rn(h.lerp_coeff, __fsub_rn(g, m_old), h.lerp_small ? m_old : g);
  v = __fmaf_rn(__fmul_rn(h.one_minus_beta2, g), g, __fmul_rn(v, h.beta2_f));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), h.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Elements [begin, end) of one parameter (begin: a multiple of kAdamWChunkNumel).
template <typename grad_t, typename model_t>
__device__ __forceinline__ void adamw_chunk(const AdamWEntry& e, int64_t begin, int64_t end, const AdamWHyper& h,
                                            bool has_grad_scale, float grad_scale, const AdamWStepCoefs& s) {
  float* __restrict__ param = static_cast<float*>(e.param);
  const grad_t* __restrict__ grad = static_cast<const grad_t*>(e.grad);
  float* __restrict__ exp_avg = static_cast<float*>(e.exp_avg);
  float* __restrict__ exp_avg_sq = static_cast<float*>(e.exp_avg_sq);
  model_t* __restrict__ model = static_cast<model_t*>(e.model);
  constexpr bool kHasModel = !std::is_same<model_t, NoModelParam>::value;
  int64_t scalar_start = begin;
  if (aligned16(param) && aligned16(exp_avg) && aligned16(exp_avg_sq) && aligned_to(grad, 4 * sizeof(grad_t)) &&
      (!kHasModel || aligned_to(model, 8))) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * 4; i < vector_end; i += kThreads * 4) {
      float g[4];
      load4(grad + i, g);
      float4* p4 = reinterpret_cast<float4*>(param + i);
      float4* m4 = reinterpret_cast<float4*>(exp_avg + i);
      float4* v4 = reinterpret_cast<float4*>(exp_avg_sq + i);
      float4 p = *p4, m = *m4, v = *v4;
      adamw_element(p.x, m.x, v.x, g[0], h, has_grad_scale, grad_scale, s);
      adamw_element(p.y, m.y, v.y, g[1], h, has_grad_scale, grad_scale, s);
      adamw_element(p.z, m.z, v.z, g[2], h, has_grad_scale, grad_scale, s);
      adamw_element(p.w, m.w, v.w, g[3], h, has_grad_scale, grad_scale, s);
      *m4 = m;
      *v4 = v;
      *p4 = p;
      if constexpr (kHasModel) {
        const float out[4] = {p.x, p.y, p.z, p.w};
        store4(model + i, out);
      }
    }
    scalar_start = vector_end;
  }
#pragma unroll 1
  for (int64_t i = scalar_start + threadIdx.x; i < end; i += kThreads) {  // unaligned tensors, and the last < 4
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_element(p, m, v, to_float(grad[i]), h, has_grad_scale, grad_scale, s);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    store1(model, i, p);
  }
}

template <typename grad_t>
__device__ __forceinline__ void adamw_chunk_model(const AdamWEntry& e, int64_t begin, int64_t end,
                                                  const AdamWHyper& h, bool has_grad_scale, float grad_scale,
                                                  const AdamWStepCoefs& s) {
  if (e.model == nullptr) {
    adamw_chunk<grad_t, NoModelParam>(e, begin, end, h, has_grad_scale, grad_scale, s);
  } else if (e.model_dtype == kDtypeBf16) {
    adamw_chunk<grad_t, __nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, s);
  } else {
    adamw_chunk<grad_t, __half>(e, begin, end, h, has_grad_scale, grad_scale, s);
  }
}

// Elements [begin, end) of a bf16 | fp16 parameter updated in place (param_t = __nv_bfloat16 | __half): p, m, v
// loaded as four 16-bit values (one 64-bit access each), computed in fp32 (adamw_element), stored rounded.
template <typename param_t, typename grad_t>
__device__ __forceinline__ void adamw_chunk_in_place(const AdamWEntry& e, int64_t begin, int64_t end,
                                                     const AdamWHyper& h, bool has_grad_scale, float grad_scale,
                                                     const AdamWStepCoefs& s) {
  param_t* __restrict__ param = static_cast<param_t*>(e.param);
  const grad_t* __restrict__ grad = static_cast<const grad_t*>(e.grad);
  param_t* __restrict__ exp_avg = static_cast<param_t*>(e.exp_avg);
  param_t* __restrict__ exp_avg_sq = static_cast<param_t*>(e.exp_avg_sq);
  int64_t scalar_start = begin;
  if (aligned_to(param, 8) && aligned_to(exp_avg, 8) && aligned_to(exp_avg_sq, 8) &&
      aligned_to(grad, 4 * sizeof(grad_t))) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * 4; i < vector_end; i += kThreads * 4) {
      float g[4], p[4], m[4], v[4];
      load4(grad + i, g);
      load4(param + i, p);
      load4(exp_avg + i, m);
      load4(exp_avg_sq + i, v);
#pragma unroll
      for (int k = 0; k < 4; ++k) adamw_element(p[k], m[k], v[k], g[k], h, has_grad_scale, grad_scale, s);
      store4(exp_avg + i, m);
      store4(exp_avg_sq + i, v);
      store4(param + i, p);
    }
    scalar_start = vector_end;
  }
#pragma unroll 1
  for (int64_t i = scalar_start + threadIdx.x; i < end; i += kThreads) {  // unaligned tensors, and the last < 4
    float p = to_float(param[i]), m = to_float(exp_avg[i]), v = to_float(exp_avg_sq[i]);
    adamw_element(p, m, v, to_float(grad[i]), h, has_grad_scale, grad_scale, s);
    store1(exp_avg, i, m);
    store1(exp_avg_sq, i, v);
    store1(param, i, p);
  }
}

template <typename param_t>
__global__ void __launch_bounds__(kThreads, kAdamWMinBlocksPerSm)
    adamw_multi_kernel(const __grid_constant__ AdamWParams params) {
  if (params.found_inf != nullptr && *params.found_inf != 0.f) return;  // skipped by every block: nothing written
  const AdamWHyper& h = params.hyper;
  const bool has_grad_scale = params.grad_scale != nullptr;
  const float grad_scale = has_grad_scale ? *params.grad_scale : 1.f;
  int entry = 0, coefs_entry = -1;
  AdamWStepCoefs s{0.f, 1.f};
  for (int64_t c = blockIdx.x; c < params.n_chunks; c += gridDim.x) {
    entry = find_tensor(params.chunk_start, entry, params.n_entries, c);
    const AdamWEntry& e = params.entries[entry];
    if (entry != coefs_entry) {  // adamw.cpp: step += 1 (fp32), then the bias corrections in double
      const double step = static_cast<double>(__fadd_rn(*e.step, 1.f));  // not written until every block is done
      const double bias_correction1 = 1.0 - pow(h.beta1, step);
      const double bias_correction2 = 1.0 - pow(h.beta2, step);
      s.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
      s.bias_correction2_sqrt = static_cast<float>(sqrt(bias_correction2));
      coefs_entry = entry;
    }
    const int64_t begin = (c - params.chunk_start[entry]) * kAdamWChunkNumel;
    const int64_t end = begin + kAdamWChunkNumel < e.numel ? begin + kAdamWChunkNumel : e.numel;
    if constexpr (std::is_same<param_t, float>::value) {
      if (e.grad_dtype == kDtypeBf16) {
        adamw_chunk_model<__nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, s);
      } else if (e.grad_dtype == kDtypeFp16) {
        adamw_chunk_model<__half>(e, begin, end, h, has_grad_scale, grad_scale, s);
      } else {
        adamw_chunk_model<float>(e, begin, end, h, has_grad_scale, grad_scale, s);
      }
    } else if (e.grad_dtype == kDtypeBf16) {
      adamw_chunk_in_place<param_t, __nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, s);
    } else if (e.grad_dtype == kDtypeFp16) {
      adamw_chunk_in_place<param_t, __half>(e, begin, end, h, has_grad_scale, grad_scale, s);
    } else {
      adamw_chunk_in_place<param_t, float>(e, begin, end, h, has_grad_scale, grad_scale, s);
    }
  }
  // The last block to finish increments every step count (all reads of them are done), then resets the counter.
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(params.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (is_last) {
    for (int k = threadIdx.x; k < params.n_entries; k += kThreads) {
      float* step = params.entries[k].step;
      *step = __fadd_rn(*step, 1.f);  // torch: _foreach_add_(steps, 1) in fp32
    }
    if (threadIdx.x == 0) *params.counter = 0u;
  }
}

// One AdamW update of every entry (gaengine::adamw_step_'s semantics; see above), one launch per
// kMaxAdamWEntries entries; *n_launches (when given) receives the number issued. param_t: float | __nv_bfloat16 |
// __half, the dtype of every entry's param, exp_avg and exp_avg_sq (model: null unless param_t is float).
// grad_scale, found_inf: null or () fp32 device pointers read by the kernel. counter: () u32 device scratch,
// 0 on entry and left 0; launches that may run concurrently need distinct counters.
// entries: a host array, read before this returns. Returns the first launch error.
template <typename param_t>
inline cudaError_t launch_adamw_multi(const AdamWEntry* entries, int n_entries, const AdamWHyper& hyper,
                                      const float* grad_scale, const float* found_inf, unsigned int* counter,
                                      cudaStream_t stream, int* n_launches = nullptr) {
  if (n_launches != nullptr) *n_launches = 0;
  AdamWParams params;  // only the n_entries used are filled: the rest is never read
  params.hyper = hyper;
  params.grad_scale = grad_scale;
  params.found_inf = found_inf;
  params.counter = counter;
  int launches = 0;
  for (int first = 0; first < n_entries; first += kMaxAdamWEntries) {
    const int k = n_entries - first < kMaxAdamWEntries ? n_entries - first : kMaxAdamWEntries;
    int64_t chunks = 0;
    for (int j = 0; j < k; ++j) {
      params.entries[j] = entries[first + j];
      params.chunk_start[j] = chunks;
      chunks += num_chunks(entries[first + j].numel, kAdamWChunkNumel);
    }
    params.n_entries = k;
    params.n_chunks = chunks;
    // At least one block, for the step counts of a list of empty parameters.
    adamw_multi_kernel<param_t><<<chunk_blocks(chunks), kThreads, 0, stream>>>(params);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (n_launches != nullptr) *n_launches = ++launches;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace gaengine
