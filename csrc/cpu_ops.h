// The CPU ops of gaengine._C (defined in cpu_ops.cpp, registered in module.cpp): the checked ops, and
// the bucket accumulate without its argument checks, for callers inside the extension that have already checked
// everything once (csrc/hot_path.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace gaengine {

// The checked CPU ops (TORCH_CHECK contracts first; gaengine.backends.CompiledBackend checks them in Python
// before).
//   accumulate_:  dst = (0 if overwrite else dst) + float(src) * scale; dst fp32, src fp32 | bf16 | fp16, both
//                 contiguous CPU tensors with the same numel; scale_tensor, when given (0-d fp32 CPU), replaces
//                 scale
//   l2norm_sq:    (sum of squares, found_inf) of x, two 0-d fp32 tensors
//   scale_:       x *= coef, x fp32 contiguous, coef a 0-d CPU tensor
//   accumulate_bucket_: dst[offsets[j] : offsets[j] + srcs[j].numel()] = (0 if overwrite[j] else that slice)
//                 + float(srcs[j]) for every j, in one parallel region; partials / source_partials: None or a
//                 (len(srcs), 2) float64 tensor whose row j receives the (sum of squares, found_inf) of the values
//                 written for source j / of source j's own values (float(srcs[j]), before the add)
void accumulate_(const at::Tensor& dst, const at::Tensor& src, double scale, bool overwrite,
                 const std::optional<at::Tensor>& scale_tensor);
std::tuple<at::Tensor, at::Tensor> l2norm_sq(const at::Tensor& x);
void scale_(const at::Tensor& x, const at::Tensor& coef);
void accumulate_bucket_(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
                        const std::vector<bool>& overwrite, const std::optional<at::Tensor>& partials,
                        const std::optional<at::Tensor>& source_partials);

// One source of a bucket: dst[0 : numel) = (overwrite ? 0 : dst) + float(src), and, when partial is not null,
// partial[0] = fp64 sum of squares of the values written, partial[1] = 1.0 if one of them is inf/NaN else 0.0;
// when source_partial is not null, the same of the source's own values (float(src), before the add).
//   src:     fp32 | bf16 | fp16, contiguous CPU tensor of numel elements, read
//   dst:     the fp32 slice of main_grad it goes to, written
struct BucketSource {
  const at::Tensor* src;
  float* dst;
  int64_t numel;
  bool overwrite;
  double* partial;
  double* source_partial;
};

// Every source of a bucket in one parallel region (the CPU's "one launch per bucket"): the sources are cut at
// fixed 65536-element chunks (the norm chunks of l2norm_sq) that at::parallel_for spreads over the threads;
// each source's partials are the sums of its chunks' partials in chunk order, so their bits do not depend on the
// thread count. No checks: see torch.ops.gaengine.accumulate_bucket_.
void accumulate_bucket_cpu(const std::vector<BucketSource>& sources);

}  // namespace gaengine
