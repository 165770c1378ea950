// The CPU kernels of gaengine._C's ops (torch.ops.gaengine.*, gaengine.backends.CompiledBackend), declared in
// cpu_ops.h, registered in module.cpp.
//
// Contracts at the top, one dtype dispatch per op, at::parallel_for over fixed-size blocks, the GIL
// released, and the vector ISA chosen at run time (cpu_kernels.h). GAENGINE_CPU_ISA=auto|avx2|portable
// (read once, at the first call) forces a path, for testing the fallback on an AVX2 machine.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "adamw.h"
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "cpu_ops.h"
#include "scratch.h"

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

void accumulate_(const at::Tensor& dst, const at::Tensor& src, double scale, bool overwrite,
                 const std::optional<at::Tensor>& scale_tensor) {
  CHECK_CPU(dst);
  CHECK_CPU(src);
  CHECK_CONTIGUOUS(dst);
  CHECK_CONTIGUOUS(src);
  CHECK_DTYPE(dst, dst.scalar_type() == at::kFloat, "float32 (the main_grad buffer)");
  CHECK_GRAD_DTYPE(src);
  TORCH_CHECK(src.numel() == dst.numel(), "src has ", src.numel(), " elements but dst has ", dst.numel(),
              "; they must match");
  if (scale_tensor.has_value()) {
    const at::Tensor& scale_t = *scale_tensor;
    TORCH_CHECK(scale_t.device().is_cpu() && scale_t.scalar_type() == at::kFloat && scale_t.dim() == 0,
                "scale_tensor must be a 0-d float32 CPU tensor, got shape ", scale_t.sizes(), " ",
                scale_t.scalar_type(), " on ", scale_t.device());
    scale = static_cast<double>(scale_t.item<float>());  // a plain load on CPU, not a device sync
  }
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
  std::vector<double> partials(n_chunks, scratch_init(0.0));  // each chunk writes its own
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

namespace {

// One chunk of a bucket source: accumulate, and the sums of squares asked for (kWritten: of the values written,
// kSource: of the source's values), the vector ISA chosen at run time.
template <bool kWritten, bool kSource, typename src_t>
portable::Sums bucket_chunk(float* dst, const src_t* src, int64_t n, bool overwrite, [[maybe_unused]] bool avx2) {
  if (!kWritten && !kSource) {
#if defined(GAENGINE_X86_KERNELS)
    if (avx2) {
      avx2::accumulate(dst, src, n, 1.0, overwrite);
      return {};
    }
#endif
    portable::accumulate(dst, src, n, 1.0, overwrite);
    return {};
  }
#if defined(GAENGINE_X86_KERNELS)
  if (avx2) return avx2::accumulate_sums<kWritten, kSource>(dst, src, n, overwrite);
#endif
  return portable::accumulate_sums<kWritten, kSource>(dst, src, n, overwrite);
}

// (sum of squares, 1.0 if it is not finite else 0.0) into a partials row.
void write_partial(double* row, double sum_sq) {
  row[0] = sum_sq;
  row[1] = std::isfinite(sum_sq) ? 0.0 : 1.0;
}

}  // namespace

void accumulate_bucket_cpu(const std::vector<BucketSource>& sources) {
  // Chunk table: (source, chunk start) for every kNormChunkNumel-element chunk of every source.
  std::vector<std::pair<int64_t, int64_t>> chunks;
  int64_t total_numel = 0;
  bool want_written = false, want_source = false;
  for (size_t j = 0; j < sources.size(); ++j) {
    const int64_t n = sources[j].numel;
    total_numel += n;
    want_written = want_written || sources[j].partial != nullptr;
    want_source = want_source || sources[j].source_partial != nullptr;
    for (int64_t begin = 0; begin < n; begin += kNormChunkNumel) chunks.emplace_back(static_cast<int64_t>(j), begin);
  }
  std::vector<portable::Sums> chunk_sums(want_written || want_source ? chunks.size() : 0,
                                         portable::Sums{scratch_init(0.0), scratch_init(0.0)});  // run_chunk writes each
  const bool avx2 = use_avx2();
  auto run_chunk = [&](int64_t c) {
    const BucketSource& s = sources[chunks[c].first];
    const int64_t begin = chunks[c].second, len = std::min(kNormChunkNumel, s.numel - begin);
    float* d = s.dst + begin;
    const bool written = s.partial != nullptr, source = s.source_partial != nullptr;
    GAENGINE_DISPATCH_GRAD_TYPES(s.src->scalar_type(), "gaengine.accumulate_bucket", [&] {
      const scalar_t* p = s.src->const_data_ptr<scalar_t>() + begin;
      if (written && source) {
        chunk_sums[c] = bucket_chunk<true, true>(d, p, len, s.overwrite, avx2);
      } else if (written) {
        chunk_sums[c] = bucket_chunk<true, false>(d, p, len, s.overwrite, avx2);
      } else if (source) {
        chunk_sums[c] = bucket_chunk<false, true>(d, p, len, s.overwrite, avx2);
      } else {
        bucket_chunk<false, false>(d, p, len, s.overwrite, avx2);
      }
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
  if (want_written || want_source) {
    for (int64_t c = 0; c < n_chunks;) {  // each source's chunks are consecutive: sum them in chunk order
      const int64_t j = chunks[c].first;
      portable::Sums total;
      for (; c < n_chunks && chunks[c].first == j; ++c) {
        total.written += chunk_sums[c].written;
        total.source += chunk_sums[c].source;
      }
      const BucketSource& s = sources[j];
      if (s.partial != nullptr) write_partial(s.partial, total.written);
      if (s.source_partial != nullptr) write_partial(s.source_partial, total.source);
    }
  }
  for (const BucketSource& s : sources) {  // an empty source has no chunk: its partials are empty sums
    if (s.numel != 0) continue;
    if (s.partial != nullptr) write_partial(s.partial, 0.0);
    if (s.source_partial != nullptr) write_partial(s.source_partial, 0.0);
  }
}

namespace {

// A partials table of accumulate_bucket_: None, or a contiguous (n_srcs, 2) float64 CPU tensor.
double* bucket_partials(const std::optional<at::Tensor>& partials, const char* name, size_t n_srcs) {
  if (!partials.has_value()) return nullptr;
  const at::Tensor& t = *partials;
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kDouble, name, " must be float64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == static_cast<int64_t>(n_srcs) && t.size(1) == 2, name,
              " must have shape (", n_srcs, ", 2), got ", t.sizes());
  return t.data_ptr<double>();
}

}  // namespace

// gaengine._C.accumulate_bucket_ and torch.ops.gaengine.accumulate_bucket_ on CPU tensors: the checked entry of
// accumulate_bucket_cpu. partials / source_partials: None, or a (len(srcs), 2) float64 tensor whose row j receives
// source j's partial (of the values written / of the source's values).
void accumulate_bucket_(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
                        const std::vector<bool>& overwrite, const std::optional<at::Tensor>& partials,
                        const std::optional<at::Tensor>& source_partials) {
  CHECK_CPU(dst);
  CHECK_CONTIGUOUS(dst);
  CHECK_DTYPE(dst, dst.scalar_type() == at::kFloat, "float32 (the main_grad buffer)");
  TORCH_CHECK(offsets.size() == srcs.size() && overwrite.size() == srcs.size(),
              "srcs, offsets and overwrite must have the same length, got ", srcs.size(), ", ", offsets.size(),
              " and ", overwrite.size());
  double* const rows = bucket_partials(partials, "partials", srcs.size());
  double* const source_rows = bucket_partials(source_partials, "source_partials", srcs.size());
  std::vector<BucketSource> sources;
  sources.reserve(srcs.size());
  float* const d = dst.data_ptr<float>();
  for (size_t j = 0; j < srcs.size(); ++j) {
    const at::Tensor& src = srcs[j];
    TORCH_CHECK(src.device().is_cpu(), "srcs[", j, "] must be a CPU tensor, got device ", src.device());
    TORCH_CHECK(src.is_contiguous(), "srcs[", j, "] must be contiguous");
    const auto t = src.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "srcs[", j,
                "] must be float32, bfloat16 or float16, got ", t);
    TORCH_CHECK(offsets[j] >= 0 && offsets[j] + src.numel() <= dst.numel(), "offsets[", j, "] = ", offsets[j],
                " puts srcs[", j, "] (", src.numel(), " elements) outside dst (", dst.numel(), " elements)");
    sources.push_back({&src, d + offsets[j], src.numel(), static_cast<bool>(overwrite[j]),
                       rows == nullptr ? nullptr : rows + 2 * j, source_rows == nullptr ? nullptr : source_rows + 2 * j});
  }
  accumulate_bucket_cpu(sources);
}

}  // namespace gaengine
