// The CPU accumulate kernels of gaengine._C without their argument checks, for callers inside the
// extension that have already checked everything once (csrc/hot_path.cpp). Defined in cpu_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace gaengine {

// One source of a bucket: dst[0 : numel) = (overwrite ? 0 : dst) + float(src), and, when partial is not null,
// partial[0] = fp64 sum of squares of the values written, partial[1] = 1.0 if one of them is inf/NaN else 0.0.
//   src:     fp32 | bf16 | fp16, contiguous CPU tensor of numel elements, read
//   dst:     the fp32 slice of main_grad it goes to, written
struct BucketSource {
  const at::Tensor* src;
  float* dst;
  int64_t numel;
  bool overwrite;
  double* partial;
};

// Every source of a bucket in one parallel region (the CPU's "one launch per bucket"): the sources are cut at
// fixed 65536-element chunks (the norm chunks of l2norm_sq) that at::parallel_for spreads over the threads;
// each source's partial is the sum of its chunks' partials in chunk order, so its bits equal
// accumulate_sumsq_'s and do not depend on the thread count. No checks: see gaengine._C.accumulate_bucket_.
void accumulate_bucket_cpu(const std::vector<BucketSource>& sources);

}  // namespace gaengine
