// C++ entry points of the cuda backend's bucket accumulate, for code in csrc/ that runs without Python
// (csrc/hot_path.cpp's backward hooks). Defined in csrc/cuda/cuda_ops.cu, which is built only with CUDA
// (setup.py then defines GAENGINE_WITH_CUDA): include this header and call these under
// #if defined(GAENGINE_WITH_CUDA). No CUDA header is needed: it compiles in plain .cpp files.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

// The device test of the CUDA ops' contracts (cuda_ops.cu) and of HotPath's kernels="cuda" (hot_path.cpp): t is a
// CUDA tensor. Only tests/cuda_emu/engine.py's emulated build (the kernels executed on CPU by the shim, CPU tensors
// standing in for CUDA ones) defines it otherwise, as (t).is_cpu(); production builds never define it.
#ifndef GAENGINE_IS_CUDA_TENSOR
#define GAENGINE_IS_CUDA_TENSOR(t) ((t).is_cuda())
#endif

namespace gaengine {

// Chunks of a bucket of sources with these numels: the columns of its (2, n) fp32 free-norm partials. Chunks
// are kernels.cuh's kBucketChunkNumel = 4096 elements, numbered source by source in the order given (an empty
// source has none). Raises (c10::Error) for a negative numel.
int64_t bucket_num_chunks(const std::vector<int64_t>& numels);

// For every i: dst[offsets[i] : offsets[i] + srcs[i].numel()] = (0 if overwrite[i] else that slice) + float(srcs[i]),
// unscaled: one IEEE fp32 add per element (bitwise equal to torch's add_); an overwrite is an exact widening
// copy that never reads dst. One kernel launch for up to 512 non-empty sources (kernels.cuh kMaxBucketEntries),
// on the current CUDA stream of dst's device, no host sync, no allocation; returns the number of launches.
//   dst:       (n,) fp32, contiguous, CUDA (the main_grad buffer); only the named slices are read / written
//   srcs[i]:   fp32 | bf16 | fp16, contiguous, on dst's device, read; the slices may not overlap or pass n
//   overwrite: one flag (0 | 1) per source
//   partials_or_null: null, or a device fp32 array of 2 rows of bucket_num_chunks(numels) columns, row 1 at
//       partials_or_null + partials_stride (0: the chunk count, i.e. contiguous): column j receives the sum of
//       squares (row 0) and the non-finite flag (row 1, 1.0 | 0.0) of the values chunk j wrote. A column slice
//       of a whole-buffer (2, total) table: pass its first column's address and partials_stride = total.
// Contracts (device, dtype, contiguity, lengths, bounds, overlap) raise c10::Error naming the argument before
// anything is launched.
int64_t accumulate_bucket_cuda(const at::Tensor& dst, const std::vector<at::Tensor>& srcs,
                               const std::vector<int64_t>& offsets, const std::vector<uint8_t>& overwrite,
                               float* partials_or_null, int64_t partials_stride = 0);

}  // namespace gaengine
