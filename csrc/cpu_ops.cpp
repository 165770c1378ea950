// The CPU kernels of gaengine._C (gaengine.backends.CpuBackend), declared in cpu_ops.h, bound in module.cpp.
//
// Contracts at the top, one dtype dispatch per op, at::parallel_for over fixed-size blocks, the GIL
// released, and the vector ISA chosen at run time (cpu_kernels.h). GAENGINE_CPU_ISA=auto|avx2|portable
// (read once, at the first call) forces a path, for testing the fallback on an AVX2 machine.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "adamw.h"
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "cpu_ops.h"

#define CHECK_CPU(x) TORCH_CHECK((x).device().is_cpu(), #x " must be a CPU tensor, got device ", (x).device())
#define CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")
#define CHECK_DTYPE(x, cond, expected) \
  TORCH_CHECK(cond, #x " must be " expected ", got ", (x).scalar_type())
#define CHECK_GRAD_DTYPE(x)                                                                              \
  CHECK_DTYPE(x, (x).scalar_type() == at::kFloat || (x).scalar_type() == at::kBFloat16 ||                \
                     (x).scalar_type() == at::kHalf,                                                     \
              "float32, bfloat16 or float16")

// The one dtype dispatch: the gradient dtypes, nothing else (float64 is rejected by CHECK_GRAD_DTYPE).
#define GAENGINE_DISPATCH_GRAD_TYPES(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace gaengine {
namespace {

// Elementwise ops split [0, n) at multiples of kBlockNumel (aligned chunks, never a split vector) and hand
// each thread at least kGrainNumel elements; the norm sums fixed kNormChunkNumel chunks into an array of
// partials and combines them in index order, so its bits do not depend on the thread count.
constexpr int64_t kBlockNumel = 4096;
constexpr int64_t kGrainNumel = 32768;
constexpr int64_t kNormChunkNumel = 65536;

// Run fn(begin, end) over [0, n) in parallel, with boundaries at multiples of kBlockNumel.
template <typename F>
void parallel_blocks(int64_t n, const F& fn) {
  const int64_t n_blocks = (n + kBlockNumel - 1) / kBlockNumel;
  at::parallel_for(0, n_blocks, kGrainNumel / kBlockNumel, [&](int64_t b0, int64_t b1) {
    const int64_t begin = b0 * kBlockNumel, end = std::min(b1 * kBlockNumel, n);
    fn(begin, end);
  });
}

}  // namespace

void accumulate_(const at::Tensor& dst, const at::Tensor& src, double scale, bool overwrite) {
  CHECK_CPU(dst);
  CHECK_CPU(src);
  CHECK_CONTIGUOUS(dst);
  CHECK_CONTIGUOUS(src);
  CHECK_DTYPE(dst, dst.scalar_type() == at::kFloat, "float32 (the main_grad buffer)");
  CHECK_GRAD_DTYPE(src);
  TORCH_CHECK(src.numel() == dst.numel(), "src has ", src.numel(), " elements but dst has ", dst.numel(),
              "; they must match");
  const int64_t n = dst.numel();
  if (n == 0) return;
  [[maybe_unused]] const bool avx2 = use_avx2();
  float* d = dst.data_ptr<float>();
  GAENGINE_DISPATCH_GRAD_TYPES(src.scalar_type(), "gaengine.accumulate_", [&] {
    const scalar_t* s = src.data_ptr<scalar_t>();
    parallel_blocks(n, [&](int64_t begin, int64_t end) {
#if defined(GAENGINE_X86_KERNELS)
      if (avx2) return avx2::accumulate(d + begin, s + begin, end - begin, scale, overwrite);
#endif
      portable::accumulate(d + begin, s + begin, end - begin, scale, overwrite);
    });
  });
}

std::tuple<at::Tensor, at::Tensor> l2norm_sq(const at::Tensor& x) {
  CHECK_CPU(x);
  CHECK_CONTIGUOUS(x);
  CHECK_GRAD_DTYPE(x);
  const int64_t n = x.numel();
  const int64_t n_chunks = (n + kNormChunkNumel - 1) / kNormChunkNumel;
  std::vector<double> partials(n_chunks, 0.0);
  [[maybe_unused]] const bool avx2 = use_avx2();
  GAENGINE_DISPATCH_GRAD_TYPES(x.scalar_type(), "gaengine.l2norm_sq", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, n_chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t begin = c * kNormChunkNumel, len = std::min(kNormChunkNumel, n - begin);
#if defined(GAENGINE_X86_KERNELS)
        if (avx2) {
          partials[c] = avx2::sum_sq(p + begin, len);
          continue;
        }
#endif
        partials[c] = portable::sum_sq(p + begin, len);
      }
    });
  });
  double total = 0.0;
  for (const double part : partials) total += part;  // fixed order: the same bits for any thread count
  const auto options = x.options().dtype(at::kFloat);
  return {at::scalar_tensor(static_cast<float>(total), options),
          at::scalar_tensor(std::isfinite(total) ? 0.0f : 1.0f, options)};
}

// accumulate_ and, in the same pass, the sum of squares (fp64) of the values written into dst and whether
// any is inf/NaN, stored into partials[index] = (sum_sq, found_inf). The norm chunks of l2norm_sq (fixed
// kNormChunkNumel boundaries, partials combined in index order): the same bits for any thread count.
void accumulate_sumsq_(const at::Tensor& dst, const at::Tensor& src, double scale, bool overwrite,
                       const at::Tensor& partials, int64_t index) {
  CHECK_CPU(dst);
  CHECK_CPU(src);
  CHECK_CPU(partials);
  CHECK_CONTIGUOUS(dst);
  CHECK_CONTIGUOUS(src);
  CHECK_CONTIGUOUS(partials);
  CHECK_DTYPE(dst, dst.scalar_type() == at::kFloat, "float32 (the main_grad buffer)");
  CHECK_GRAD_DTYPE(src);
  CHECK_DTYPE(partials, partials.scalar_type() == at::kDouble, "float64");
  TORCH_CHECK(src.numel() == dst.numel(), "src has ", src.numel(), " elements but dst has ", dst.numel(),
              "; they must match");
  TORCH_CHECK(partials.dim() == 2 && partials.size(1) == 2, "partials must have shape (n, 2), got ",
              partials.sizes());
  TORCH_CHECK(index >= 0 && index < partials.size(0), "index ", index, " is out of range for partials with ",
              partials.size(0), " rows");
  const int64_t n = dst.numel();
  const int64_t n_chunks = (n + kNormChunkNumel - 1) / kNormChunkNumel;
  std::vector<double> chunk_sums(n_chunks, 0.0);
  [[maybe_unused]] const bool avx2 = use_avx2();
  float* d = dst.data_ptr<float>();
  if (n > 0) {
    GAENGINE_DISPATCH_GRAD_TYPES(src.scalar_type(), "gaengine.accumulate_sumsq_", [&] {
      const scalar_t* s = src.data_ptr<scalar_t>();
      at::parallel_for(0, n_chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t begin = c * kNormChunkNumel, len = std::min(kNormChunkNumel, n - begin);
#if defined(GAENGINE_X86_KERNELS)
          if (avx2) {
            chunk_sums[c] = avx2::accumulate_sumsq(d + begin, s + begin, len, scale, overwrite);
            continue;
          }
#endif
          chunk_sums[c] = portable::accumulate_sumsq(d + begin, s + begin, len, scale, overwrite);
        }
      });
    });
  }
  double total = 0.0;
  for (const double part : chunk_sums) total += part;  // fixed order: the same bits for any thread count
  double* out = partials.data_ptr<double>() + 2 * index;
  out[0] = total;
  out[1] = std::isfinite(total) ? 0.0 : 1.0;
}

void scale_(const at::Tensor& x, const at::Tensor& coef) {
  CHECK_CPU(x);
  CHECK_CPU(coef);
  CHECK_CONTIGUOUS(x);
  CHECK_DTYPE(x, x.scalar_type() == at::kFloat, "float32");
  TORCH_CHECK(coef.dim() == 0, "coef must be a 0-d tensor, got shape ", coef.sizes());
  const float c = coef.item<float>();  // a plain load on CPU, not a device sync
  const int64_t n = x.numel();
  if (n == 0) return;
  [[maybe_unused]] const bool avx2 = use_avx2();
  float* p = x.data_ptr<float>();
  parallel_blocks(n, [&](int64_t begin, int64_t end) {
#if defined(GAENGINE_X86_KERNELS)
    if (avx2) return avx2::scale(p + begin, end - begin, c);
#endif
    portable::scale(p + begin, end - begin, c);
  });
}

void accumulate_bucket_cpu(const std::vector<BucketSource>& sources) {
  // Chunk table: (source, chunk start) for every kNormChunkNumel-element chunk of every source.
  std::vector<std::pair<int64_t, int64_t>> chunks;
  int64_t total_numel = 0;
  bool want_partials = false;
  for (size_t j = 0; j < sources.size(); ++j) {
    const int64_t n = sources[j].numel;
    total_numel += n;
    want_partials = want_partials || sources[j].partial != nullptr;
    for (int64_t begin = 0; begin < n; begin += kNormChunkNumel) chunks.emplace_back(static_cast<int64_t>(j), begin);
  }
  std::vector<double> chunk_sums(want_partials ? chunks.size() : 0, 0.0);
  [[maybe_unused]] const bool avx2 = use_avx2();
  auto run_chunk = [&](int64_t c) {
    const BucketSource& s = sources[chunks[c].first];
    const int64_t begin = chunks[c].second, len = std::min(kNormChunkNumel, s.numel - begin);
    float* d = s.dst + begin;
    GAENGINE_DISPATCH_GRAD_TYPES(s.src->scalar_type(), "gaengine.accumulate_bucket", [&] {
      const scalar_t* p = s.src->const_data_ptr<scalar_t>() + begin;
      if (s.partial != nullptr) {
#if defined(GAENGINE_X86_KERNELS)
        if (avx2) {
          chunk_sums[c] = avx2::accumulate_sumsq(d, p, len, 1.0, s.overwrite);
          return;
        }
#endif
        chunk_sums[c] = portable::accumulate_sumsq(d, p, len, 1.0, s.overwrite);
        return;
      }
#if defined(GAENGINE_X86_KERNELS)
      if (avx2) return avx2::accumulate(d, p, len, 1.0, s.overwrite);
#endif
      portable::accumulate(d, p, len, 1.0, s.overwrite);
    });
  };
  const auto n_chunks = static_cast<int64_t>(chunks.size());
  if (total_numel < kGrainNumel) {  // a bucket of small parameters: not worth waking the thread pool
    for (int64_t c = 0; c < n_chunks; ++c) run_chunk(c);
  } else {
    at::parallel_for(0, n_chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) run_chunk(c);
    });
  }
  if (!want_partials) return;
  for (int64_t c = 0; c < n_chunks;) {  // each source's chunks are consecutive: sum them in chunk order
    const BucketSource& s = sources[chunks[c].first];
    double total = 0.0;
    const int64_t j = chunks[c].first;
    for (; c < n_chunks && chunks[c].first == j; ++c) total += chunk_sums[c];
    if (s.partial != nullptr) {
      s.partial[0] = total;
      s.partial[1] = std::isfinite(total) ? 0.0 : 1.0;
    }
  }
  for (const BucketSource& s : sources) {  // an empty source has no chunk: its partial is an empty sum
    if (s.partial != nullptr && s.numel == 0) s.partial[0] = s.partial[1] = 0.0;
  }
}

// gaengine._C.accumulate_bucket_: the checked binding of accumulate_bucket_cpu, for tests and callers that own
// their buffers. partials: None, or a (len(srcs), 2) float64 tensor whose row j receives source j's partial.
void accumulate_bucket_(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
                        const std::vector<bool>& overwrite, const std::optional<at::Tensor>& partials) {
  CHECK_CPU(dst);
  CHECK_CONTIGUOUS(dst);
  CHECK_DTYPE(dst, dst.scalar_type() == at::kFloat, "float32 (the main_grad buffer)");
  TORCH_CHECK(offsets.size() == srcs.size() && overwrite.size() == srcs.size(),
              "srcs, offsets and overwrite must have the same length, got ", srcs.size(), ", ", offsets.size(),
              " and ", overwrite.size());
  if (partials.has_value()) {
    CHECK_CPU(*partials);
    CHECK_CONTIGUOUS(*partials);
    CHECK_DTYPE(*partials, partials->scalar_type() == at::kDouble, "float64");
    TORCH_CHECK(partials->dim() == 2 && partials->size(0) == static_cast<int64_t>(srcs.size()) &&
                    partials->size(1) == 2,
                "partials must have shape (", srcs.size(), ", 2), got ", partials->sizes());
  }
  std::vector<BucketSource> sources;
  sources.reserve(srcs.size());
  for (size_t j = 0; j < srcs.size(); ++j) {
    const at::Tensor& src = srcs[j];
    TORCH_CHECK(src.device().is_cpu(), "srcs[", j, "] must be a CPU tensor, got device ", src.device());
    TORCH_CHECK(src.is_contiguous(), "srcs[", j, "] must be contiguous");
    const auto t = src.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "srcs[", j,
                "] must be float32, bfloat16 or float16, got ", t);
    TORCH_CHECK(offsets[j] >= 0 && offsets[j] + src.numel() <= dst.numel(), "offsets[", j, "] = ", offsets[j],
                " puts srcs[", j, "] (", src.numel(), " elements) outside dst (", dst.numel(), " elements)");
    double* partial = partials.has_value() ? partials->data_ptr<double>() + 2 * j : nullptr;
    sources.push_back({&src, dst.data_ptr<float>() + offsets[j], src.numel(), static_cast<bool>(overwrite[j]), partial});
  }
  accumulate_bucket_cpu(sources);
}

}  // namespace gaengine
