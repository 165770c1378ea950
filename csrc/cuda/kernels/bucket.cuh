// The multi-tensor bucket accumulate: a bucket of sources into slices of one fp32 buffer in one launch, with
// the optional per-chunk free-norm partials (of the values written) and source partials (of the sources' own
// values, before the add), in the same pass (the CUDA counterpart of kernels/bucket.py; norm.cuh's
// launch_sum_partials finishes either).
#pragma once

#include "common.cuh"

namespace gaengine {
namespace cuda {

// ---------------------------------------------------------------------------------------------------------
// bucket accumulate: dst[off_i : off_i + n_i] = (0 if overwrite_i else dst[...]) + float(src_i), every i
// ---------------------------------------------------------------------------------------------------------
// 4096 elements per chunk: 16 per thread (4 fp32 | 2 bf16/fp16 128-bit vectors), 40 KB of traffic per
// chunk when adding a bf16 source, against one binary search (9 steps at 512 entries) and, with partials,
// one block reduction.
constexpr int64_t kBucketChunkNumel = 4096;
// 512 entries x (32 B + 8 B of chunk_start) + 64 B = 20544 B of parameters, under kMaxKernelParamBytes with
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
  float* source_partials;                   // null, or (2, source_partials_stride) fp32: as partials
  int64_t source_partials_stride;
  int64_t chunk_base;                       // partials column of this launch's chunk 0
  int64_t n_chunks;                         // chunks of this launch
  int32_t n_entries;
};
static_assert(sizeof(BucketParams) <= kMaxKernelParamBytes, "BucketParams exceeds the 32764-byte kernel-parameter "
              "limit: lower kMaxBucketEntries");

// One chunk of one source into its dst slice: n <= kBucketChunkNumel elements from dst / src (the chunk's
// first element; 64-bit pointer arithmetic done by the caller, so the offsets here are 32-bit); with
// kPartials, the sum of squares and the non-finite flag of the values written go into sum_sq / found; with
// kSource, those of the source values (fp32-widened, before the add) into src_sum_sq / src_found, element for
// element in the same order.
template <typename src_t, bool kPartials, bool kSource>
__device__ __forceinline__ void accumulate_chunk(float* __restrict__ dst, const src_t* __restrict__ src, int n,
                                                 bool overwrite, float& sum_sq, bool& found, float& src_sum_sq,
                                                 bool& src_found) {
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
      if constexpr (kSource) {
#pragma unroll
        for (int k = 0; k < kElems; ++k) {
          src_sum_sq = __fmaf_rn(grad[k], grad[k], src_sum_sq);
          src_found |= non_finite(grad[k]);
        }
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
    if constexpr (kSource) {
      src_sum_sq = __fmaf_rn(d, d, src_sum_sq);
      src_found |= non_finite(d);
    }
    if (!overwrite) d = __fadd_rn(dst[i], d);
    dst[i] = d;
    if constexpr (kPartials) {
      sum_sq = __fmaf_rn(d, d, sum_sq);
      found |= non_finite(d);
    }
  }
}

// One column per chunk: (sum of squares, non-finite flag) into row 0 / row 1 of a partials table.
__device__ __forceinline__ void write_column(float* partials, int64_t stride, int64_t column, float sum_sq,
                                             bool found) {
  partials[column] = sum_sq;
  partials[stride + column] = found ? 1.f : 0.f;
}

// Both tables at once (the last micro-batch of a window measured for the noise scale, once per window) need two
// more accumulators than 32 registers hold without spilling: that instantiation runs at half occupancy
// (kMinBlocksPerSm / 2 blocks, 64 registers), the others at full.
template <bool kPartials, bool kSource>
__global__ void __launch_bounds__(kThreads, kPartials && kSource ? kMinBlocksPerSm / 2 : kMinBlocksPerSm)
    accumulate_bucket_kernel(const __grid_constant__ BucketParams params) {
  __shared__ float shared[kThreads / 32];  // block_sum's, with kPartials or kSource only
  int entry = 0;
  for (int64_t c = blockIdx.x; c < params.n_chunks; c += gridDim.x) {  // uniform: every barrier is reached
    entry = find_tensor(params.chunk_start, entry, params.n_entries, c);
    const BucketEntry& e = params.entries[entry];
    const int64_t begin = (c - params.chunk_start[entry]) * kBucketChunkNumel;  // int64: tensors pass 2^31
    const int n = static_cast<int>(e.numel - begin < kBucketChunkNumel ? e.numel - begin : kBucketChunkNumel);
    float* dst = params.dst + e.dst_offset + begin;
    const bool overwrite = e.overwrite != 0;
    float sum_sq = 0.f, src_sum_sq = 0.f;
    bool found = false, src_found = false;
    if (e.src_dtype == kDtypeBf16) {
      accumulate_chunk<__nv_bfloat16, kPartials, kSource>(dst, static_cast<const __nv_bfloat16*>(e.src) + begin, n,
                                                          overwrite, sum_sq, found, src_sum_sq, src_found);
    } else if (e.src_dtype == kDtypeFp16) {
      accumulate_chunk<__half, kPartials, kSource>(dst, static_cast<const __half*>(e.src) + begin, n, overwrite,
                                                   sum_sq, found, src_sum_sq, src_found);
    } else {
      accumulate_chunk<float, kPartials, kSource>(dst, static_cast<const float*>(e.src) + begin, n, overwrite,
                                                  sum_sq, found, src_sum_sq, src_found);
    }
    // This chunk's own column: no atomics, the same bits every run.
    const int64_t column = params.chunk_base + c;
    if constexpr (kPartials) {
      sum_sq = block_sum(sum_sq, shared);
      found = block_any(found);
      if (threadIdx.x == 0) write_column(params.partials, params.partials_stride, column, sum_sq, found);
    }
    if constexpr (kSource) {
      src_sum_sq = block_sum(src_sum_sq, shared);
      src_found = block_any(src_found);
      if (threadIdx.x == 0) {
        write_column(params.source_partials, params.source_partials_stride, column, src_sum_sq, src_found);
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

inline int64_t bucket_num_chunks_of(const BucketEntry* entries, int n) {
  int64_t total = 0;
  for (int i = 0; i < n; ++i) total += num_chunks(entries[i].numel, kBucketChunkNumel);
  return total;
}

// For every entry i: dst[off_i : off_i + n_i] = (0 if overwrite_i else dst[...]) + float(src_i), unscaled (one
// __fadd_rn per element, bitwise equal to torch's add_; an overwrite is an exact widening copy). The slices
// must not overlap. One launch per kMaxBucketEntries non-empty entries (one for any usual bucket);
// *n_launches (when given) receives the number issued.
// partials: null, or a (2, bucket_num_chunks) fp32 device array (row stride partials_stride, 0: the chunk
// count, i.e. contiguous): column j receives the sum of squares (row 0) and the non-finite flag (row 1, 1.0 |
// 0.0) of the values written by chunk j; launch_sum_partials finishes the norm.
// source_partials: null, or the same for the source values chunk j read (fp32-widened, before the add), row
// stride source_partials_stride (0: contiguous), in the same launch.
// entries: a host array, read before this returns. Returns the first launch error.
inline cudaError_t launch_accumulate_bucket(float* dst, const BucketEntry* entries, int n_entries, float* partials,
                                            cudaStream_t stream, int* n_launches = nullptr,
                                            int64_t partials_stride = 0, float* source_partials = nullptr,
                                            int64_t source_partials_stride = 0) {
  if (n_launches != nullptr) *n_launches = 0;
  const int64_t total_chunks = bucket_num_chunks_of(entries, n_entries);
  BucketParams params;  // only the n_entries used are filled: the rest is never read
  params.dst = dst;
  params.partials = partials;
  params.partials_stride = partials_stride == 0 ? total_chunks : partials_stride;
  params.source_partials = source_partials;
  params.source_partials_stride = source_partials_stride == 0 ? total_chunks : source_partials_stride;
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
    const unsigned int blocks = chunk_blocks(chunks);
    if (partials != nullptr && source_partials != nullptr) {
      accumulate_bucket_kernel<true, true><<<blocks, kThreads, 0, stream>>>(params);
    } else if (partials != nullptr) {
      accumulate_bucket_kernel<true, false><<<blocks, kThreads, 0, stream>>>(params);
    } else if (source_partials != nullptr) {
      accumulate_bucket_kernel<false, true><<<blocks, kThreads, 0, stream>>>(params);
    } else {
      accumulate_bucket_kernel<false, false><<<blocks, kThreads, 0, stream>>>(params);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (n_launches != nullptr) *n_launches = launches;
    chunk_base += chunks;
  }
}

}  // namespace cuda
}  // namespace gaengine
