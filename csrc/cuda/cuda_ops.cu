// The CUDA kernels of gaengine._C's torch.library ops (op_library.h; torch.ops.gaengine.* on CUDA tensors, reached
// from Python through gaengine.backends.CompiledBackend, and csrc/hot_path.cpp launches its buckets through
// accumulate_bucket_'s), compiled in when the extension is built with CUDA (setup.py defines GAENGINE_WITH_CUDA).
// The kernels are in kernels.cuh; this file holds the contracts (all checked before any launch), the dtype dispatch
// and the launches on the current stream, and registers them (the end of the file). No op syncs the host or
// allocates beyond its outputs (the optimizer steps: one 4-byte counter per device and stream, allocated at its first
// use).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// wgrad_accumulate_'s CUDA kernel is one cuBLAS call (cublasGemmEx on torch's handle), compiled where the toolkit
// has cuBLAS's headers (every full CUDA toolkit; tests/cuda_emu has a reference cublasGemmEx): without them the op
// has no compiled CUDA kernel and gaengine.fusion registers the Triton one.
#if __has_include(<cublas_v2.h>)
#define GAENGINE_HAS_CUBLAS 1
#include <ATen/cuda/CUDAContext.h>  // at::cuda::getCurrentCUDABlasHandle: on the current stream, torch's workspace
#include <cublas_v2.h>
#else
#define GAENGINE_HAS_CUBLAS 0
#endif

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../adamw.h"
#include "../op_library.h"
#include "../optim/step.h"
#include "../scratch.h"
#include "../wgrad.h"
#include "kernels.cuh"

#define CHECK_CUDA(x) TORCH_CHECK(GAENGINE_IS_CUDA_TENSOR(x), #x " must be a CUDA tensor, got device ", (x).device())
#define CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")
#define CHECK_DTYPE(x, cond, expected) TORCH_CHECK(cond, #x " must be " expected ", got ", (x).scalar_type())
#define CHECK_SAME_DEVICE(x, y) \
  TORCH_CHECK((x).device() == (y).device(), #x " is on ", (x).device(), " but " #y " is on ", (y).device())
#define CHECK_GRAD_DTYPE(x)                                                                              \
  CHECK_DTYPE(x, (x).scalar_type() == at::kFloat || (x).scalar_type() == at::kBFloat16 ||                \
                     (x).scalar_type() == at::kHalf,                                                     \
              "float32, bfloat16 or float16")
#define CHECK_LAUNCH(err) TORCH_CHECK((err) == cudaSuccess, "gaengine CUDA launch failed: ", cudaGetErrorString(err))

// The one dtype dispatch: the gradient dtypes, as the CUDA types kernels.cuh is written for.
#define GAENGINE_DISPATCH_CUDA_GRAD_TYPES(TYPE, ...)               \
  [&] {                                                            \
    switch (TYPE) {                                                \
      case at::kFloat: {                                           \
        using src_t = float;                                       \
        return __VA_ARGS__();                                      \
      }                                                            \
      case at::kBFloat16: {                                        \
        using src_t = __nv_bfloat16;                               \
        return __VA_ARGS__();                                      \
      }                                                            \
      case at::kHalf: {                                            \
        using src_t = __half;                                      \
        return __VA_ARGS__();                                      \
      }                                                            \
      default:                                                     \
        TORCH_CHECK(false, "unsupported gradient dtype ", TYPE);   \
    }                                                              \
  }()

namespace gaengine {
namespace {

// The multi-tensor kernels take up to 27.7 KB of parameters by value (README.md): a driver for CUDA < 12.1 refuses
// every launch of them (cudaErrorInvalidValue). Read once per process, before the first; Python checks first
// (gaengine.backends.cuda_kernels_unusable). A failed query is let through, as in Python: the launch then says why.
void check_driver_for_multi_tensor() {
  static const int driver = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess ? version : -1;
  }();
  TORCH_CHECK(driver < 0 || driver >= 12010, "the CUDA driver supports CUDA ", driver / 1000, ".", driver % 1000 / 10,
              " (cudaDriverGetVersion() = ", driver, "), but the multi-tensor CUDA kernels of gaengine._C need CUDA >= "
              "12.1: update the NVIDIA driver (R530 or newer), or use backend='triton'");
}

// dst = (0 if overwrite else dst) + float(src) * scale; scale_tensor (0-d fp32, same device) replaces scale.
void accumulate_cuda(const at::Tensor& dst, const at::Tensor& src, double scale, bool overwrite,
                     const std::optional<at::Tensor>& scale_tensor) {
  CHECK_CUDA(dst);
  CHECK_CONTIGUOUS(dst);
  CHECK_DTYPE(dst, dst.scalar_type() == at::kFloat, "float32 (the main_grad buffer)");
  CHECK_CUDA(src);
  CHECK_CONTIGUOUS(src);
  CHECK_GRAD_DTYPE(src);
  CHECK_SAME_DEVICE(src, dst);
  TORCH_CHECK(src.numel() == dst.numel(), "src has ", src.numel(), " elements but dst has ", dst.numel(),
              "; they must match");
  const float* scale_ptr = nullptr;
  if (scale_tensor.has_value()) {
    const at::Tensor& s = *scale_tensor;
    CHECK_CUDA(s);
    CHECK_SAME_DEVICE(s, dst);
    CHECK_DTYPE(s, s.scalar_type() == at::kFloat, "float32");
    TORCH_CHECK(s.dim() == 0, "scale must be a 0-d tensor, got shape ", s.sizes());
    scale_ptr = s.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  GAENGINE_DISPATCH_CUDA_GRAD_TYPES(src.scalar_type(), [&] {
    CHECK_LAUNCH(cuda::launch_accumulate<src_t>(dst.data_ptr<float>(), static_cast<const src_t*>(src.data_ptr()),
                                                dst.numel(), static_cast<float>(scale), scale_ptr, overwrite,
                                                stream));
  });
}

// (sum of squares, found_inf) of x as two 0-d fp32 tensors on x.device, views of one (2,) output.
std::tuple<at::Tensor, at::Tensor> l2norm_sq_cuda(const at::Tensor& x) {
  CHECK_CUDA(x);
  CHECK_CONTIGUOUS(x);
  CHECK_GRAD_DTYPE(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = x.options().dtype(at::kFloat);
  at::Tensor out = scratch_empty({2}, options);  // both written by the finalize
  at::Tensor partials = scratch_empty({2, std::max<int64_t>(cuda::l2norm_sq_num_partials(x.numel()), 1)}, options);
  GAENGINE_DISPATCH_CUDA_GRAD_TYPES(x.scalar_type(), [&] {
    CHECK_LAUNCH(cuda::launch_l2norm_sq<src_t>(static_cast<const src_t*>(x.data_ptr()), x.numel(),
                                               partials.data_ptr<float>(), out.data_ptr<float>(), stream));
  });
  return {out.select(0, 0), out.select(0, 1)};
}

// x *= coef in place; coef a 0-d fp32 tensor on x.device, read by the kernel.
void scale_cuda(const at::Tensor& x, const at::Tensor& coef) {
  CHECK_CUDA(x);
  CHECK_CONTIGUOUS(x);
  CHECK_DTYPE(x, x.scalar_type() == at::kFloat, "float32");
  CHECK_CUDA(coef);
  CHECK_SAME_DEVICE(coef, x);
  CHECK_DTYPE(coef, coef.scalar_type() == at::kFloat, "float32");
  TORCH_CHECK(coef.dim() == 0, "coef must be a 0-d tensor, got shape ", coef.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  CHECK_LAUNCH(cuda::launch_scale(x.data_ptr<float>(), x.numel(), coef.data_ptr<float>(),
                                  c10::cuda::getCurrentCUDAStream()));
}

// ---------------------------------------------------------------------------------------------------------
// multi-tensor ops: one launch for a list of tensors (kernels.cuh, "Multi-tensor kernels")
// ---------------------------------------------------------------------------------------------------------
int32_t kernel_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? cuda::kDtypeBf16 : (t == at::kHalf ? cuda::kDtypeFp16 : cuda::kDtypeFp32);
}

// A tensor of a list: "what[i] must be ...", on `device`.
void check_list_tensor(const at::Tensor& t, const char* what, size_t i, const at::Device& device) {
  TORCH_CHECK(GAENGINE_IS_CUDA_TENSOR(t), what, "[", i, "] must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == device, what, "[", i, "] is on ", t.device(), " but must be on ", device);
  TORCH_CHECK(t.is_contiguous(), what, "[", i, "] must be contiguous");
}

void check_bucket(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
                  size_t n_overwrite) {
  CHECK_CUDA(dst);
  CHECK_CONTIGUOUS(dst);
  CHECK_DTYPE(dst, dst.scalar_type() == at::kFloat, "float32 (the main_grad buffer)");
  TORCH_CHECK(offsets.size() == srcs.size(), "offsets has ", offsets.size(), " entries but srcs has ", srcs.size(),
              "; they must match");
  TORCH_CHECK(n_overwrite == srcs.size(), "overwrite has ", n_overwrite, " flags but srcs has ", srcs.size(),
              "; they must match");
  std::vector<std::tuple<int64_t, int64_t, size_t>> spans;  // [begin, end) of each non-empty slice
  spans.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& src = srcs[i];
    check_list_tensor(src, "srcs", i, dst.device());
    const auto st = src.scalar_type();
    TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "srcs[", i,
                "] must be float32, bfloat16 or float16, got ", st);
    const int64_t n = src.numel();
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] <= dst.numel() - n, "offsets[", i, "] = ", offsets[i], " puts the ",
                n, " elements of srcs[", i, "] outside dst (", dst.numel(), " elements)");
    if (n > 0) spans.emplace_back(offsets[i], offsets[i] + n, i);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    TORCH_CHECK(std::get<0>(spans[k]) >= std::get<1>(spans[k - 1]), "the dst slices of srcs[",
                std::get<2>(spans[k - 1]), "] and srcs[", std::get<2>(spans[k]), "] overlap");
  }
}

// A partials table of a bucket of n_chunks chunks: None, or a (2, n_chunks) fp32 tensor on dst's device with unit
// column stride (rows may be strided: a column slice of a whole-buffer table). Returns (first column, row stride),
// (null, 0) for None.
std::pair<float*, int64_t> bucket_partials(const std::optional<at::Tensor>& partials, const char* name,
                                           const at::Tensor& dst, int64_t n_chunks) {
  if (!partials.has_value()) return {nullptr, 0};
  const at::Tensor& t = *partials;
  TORCH_CHECK(GAENGINE_IS_CUDA_TENSOR(t), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == dst.device(), name, " is on ", t.device(), " but dst is on ", dst.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == 2 && t.size(1) == n_chunks && (t.stride(1) == 1 || n_chunks <= 1) &&
                  t.stride(0) >= n_chunks,
              name, " must be a (2, ", n_chunks, ") tensor (bucket_num_chunks of the srcs' numels) with unit column "
              "stride, got shape ", t.sizes(), " and strides ", t.strides());
  return {t.data_ptr<float>(), t.stride(0)};
}

// accumulate_bucket_(dst, srcs, offsets, overwrite, partials=None, source_partials=None) on CUDA tensors, in one
// launch per 512 sources (its signature AccumulateBucketKernel, op_library.h: HotPath calls it unboxed).
// partials / source_partials: None, or a (2, bucket_num_chunks(numels)) fp32 tensor (bucket_partials), written: per
// chunk, the (sum of squares, non-finite flag) of the values written / of the source values read. Every contract is
// checked before anything is launched.
void accumulate_bucket_cuda(const at::Tensor& dst, const std::vector<at::Tensor>& srcs,
                            const std::vector<int64_t>& offsets, const c10::List<bool>& overwrite_flags,
                            const std::optional<at::Tensor>& partials,
                            const std::optional<at::Tensor>& source_partials) {
  const std::vector<bool> overwrite = to_flags(overwrite_flags);
  check_bucket(dst, srcs, offsets, overwrite.size());
  std::vector<cuda::BucketEntry> entries(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    entries[i] = cuda::BucketEntry{srcs[i].data_ptr(), offsets[i], srcs[i].numel(),
                                   kernel_dtype(srcs[i].scalar_type()), overwrite[i] ? 1 : 0};
  }
  const int64_t n_chunks = cuda::bucket_num_chunks_of(entries.data(), static_cast<int>(entries.size()));
  const auto [rows, stride] = bucket_partials(partials, "partials", dst, n_chunks);
  const auto [source_rows, source_stride] = bucket_partials(source_partials, "source_partials", dst, n_chunks);
  check_driver_for_multi_tensor();
  const c10::cuda::CUDAGuard guard(dst.device());
  CHECK_LAUNCH(cuda::launch_accumulate_bucket(dst.data_ptr<float>(), entries.data(), static_cast<int>(entries.size()),
                                              rows, c10::cuda::getCurrentCUDAStream(), nullptr, stride,
                                              source_rows, source_stride));
}
static_assert(std::is_same_v<decltype(accumulate_bucket_cuda), AccumulateBucketKernel>);

// (sum of row 0, 1.0 if a row-1 flag is set else 0.0) of (2, n) fp32 partials: two 0-d fp32 tensors, views of
// one (2,) output, reduced in a fixed order (the same bits every run).
std::tuple<at::Tensor, at::Tensor> sum_partials_cuda(const at::Tensor& partials) {
  CHECK_CUDA(partials);
  CHECK_CONTIGUOUS(partials);
  CHECK_DTYPE(partials, partials.scalar_type() == at::kFloat, "float32");
  TORCH_CHECK(partials.dim() == 2 && partials.size(0) == 2, "partials must have shape (2, n_chunks), got ",
              partials.sizes());
  const c10::cuda::CUDAGuard guard(partials.device());
  at::Tensor out = scratch_empty({2}, partials.options());  // both written by the kernel
  float* o = out.data_ptr<float>();
  CHECK_LAUNCH(cuda::launch_sum_partials(partials.data_ptr<float>(), partials.size(1), o, o + 1,
                                         c10::cuda::getCurrentCUDAStream()));
  return {out.select(0, 0), out.select(0, 1)};
}

void check_device_scalar(const std::optional<at::Tensor>& t, const char* name,
                         const std::optional<at::Device>& device) {
  if (!t.has_value()) return;
  TORCH_CHECK(GAENGINE_IS_CUDA_TENSOR(*t), name, " must be a CUDA tensor, got device ", t->device());
  TORCH_CHECK(!device.has_value() || t->device() == *device, name, " is on ", t->device(), " but params are on ",
              *device);
  TORCH_CHECK(t->dim() == 0 && t->scalar_type() == at::kFloat, name, " must be a 0-d float32 tensor, got ",
              t->sizes(), " ", t->scalar_type());
}

// The () u32 completion counter of launch_optimizer_multi for (device, stream): zeroed once on that stream, left
// zero by every launch. One per stream, so concurrent steps on different streams never share one. Never
// freed (the map outlives the CUDA context at exit on purpose).
unsigned int* optimizer_counter(const at::Device& device, cudaStream_t stream) {
  static std::mutex mutex;
  static auto* counters = new std::map<std::pair<c10::DeviceIndex, cudaStream_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device.index(), stream);
  auto it = counters->find(key);
  if (it == counters->end()) {
    it = counters->emplace(key, at::zeros({1}, at::TensorOptions().device(device).dtype(at::kInt))).first;
  }
  return reinterpret_cast<unsigned int*>(it->second.data_ptr<int32_t>());
}

// The CUDA launcher of the fused elementwise optimizers (csrc/optim/functor.h): functor F on CUDA tensors, one launch
// for the whole list per parameter dtype (fp32 masters; bf16 or fp16 parameters updated in place), the same
// arguments and semantics as the CPU launcher (csrc/optimizer_step.cpp), found_inf / grad_scale / steps read on the
// device (no host sync).
template <class F>
void cuda_step(const optim::OptimizerLists& l, const typename F::Hyper& hyper,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  static_assert(optim::kMaxStates == cuda::kMaxOptimizerStates, "one state capacity for both launchers");
  const size_t n_params = l.params.size();
  optim::check_lengths<F>(l);
  std::optional<at::Device> device;
  if (n_params > 0) {
    TORCH_CHECK(GAENGINE_IS_CUDA_TENSOR(l.params[0]), "params[0] must be a CUDA tensor, got device ",
                l.params[0].device());
    device = l.params[0].device();
  }
  check_device_scalar(grad_scale, "grad_scale", device);
  check_device_scalar(found_inf, "found_inf", device);
  if (n_params == 0) return;
  std::vector<cuda::OptimizerEntry> entries(n_params);
  std::vector<at::ScalarType> param_dtypes(n_params);
  for (size_t i = 0; i < n_params; ++i) {
    check_list_tensor(l.params[i], "params", i, *device);
    check_list_tensor(l.grads[i], "grads", i, *device);
    for (int k = 0; k < F::kStates; ++k) check_list_tensor(l.states[k][i], F::kStateNames[k], i, *device);
    if (l.model_params[i].has_value()) check_list_tensor(*l.model_params[i], "model_params", i, *device);
    optim::check_param<F>(l, i);
    param_dtypes[i] = l.params[i].scalar_type();
    cuda::OptimizerEntry& e = entries[i];
    e.param = l.params[i].data_ptr();
    e.grad = l.grads[i].data_ptr();
    for (int k = 0; k < cuda::kMaxOptimizerStates; ++k) {
      e.states[k] = k < F::kStates ? l.states[k][i].data_ptr() : nullptr;
    }
    e.model = nullptr;
    e.step = nullptr;
    if constexpr (F::kStep) {
      const at::Tensor& step = l.steps[i];
      TORCH_CHECK(GAENGINE_IS_CUDA_TENSOR(step) && step.device() == *device && step.dim() == 0 &&
                      step.scalar_type() == at::kFloat,
                  "steps[", i, "] must be a 0-d float32 tensor on ", *device, ", got ", step.sizes(), " ",
                  step.scalar_type(), " on ", step.device());
      e.step = step.data_ptr<float>();
    }
    e.numel = l.params[i].numel();
    e.grad_dtype = kernel_dtype(l.grads[i].scalar_type());
    e.model_dtype = cuda::kDtypeBf16;
    if (l.model_params[i].has_value()) {
      const at::Tensor& model = *l.model_params[i];
      e.model = model.data_ptr();
      e.model_dtype = kernel_dtype(model.scalar_type());
    }
  }
  check_driver_for_multi_tensor();
  const c10::cuda::CUDAGuard guard(*device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float* scale_ptr = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  const float* found_inf_ptr = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  // Launches on one stream run one after another: one counter per stream serves every functor.
  unsigned int* counter = F::kStep ? optimizer_counter(*device, stream) : nullptr;
  // One launch (per kMaxOptimizerEntries) per parameter dtype present, in list order within each.
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    std::vector<cuda::OptimizerEntry> group;
    for (size_t i = 0; i < n_params; ++i) {
      if (param_dtypes[i] == dtype) group.push_back(entries[i]);
    }
    if (group.empty()) continue;
    const int n_group = static_cast<int>(group.size());
    const auto launch = dtype == at::kBFloat16 ? cuda::launch_optimizer_multi<F, __nv_bfloat16>
                        : dtype == at::kHalf   ? cuda::launch_optimizer_multi<F, __half>
                                               : cuda::launch_optimizer_multi<F, float>;
    const cudaError_t err = launch(group.data(), n_group, hyper, scale_ptr, found_inf_ptr, counter, stream, nullptr);
    CHECK_LAUNCH(err);
  }
}

// adamw_step_'s CUDA kernel (csrc/adamw.h): the launcher over the AdamW functor.
void adamw_step_cuda(const AdamWLists& lists, const AdamWHyperparams& h, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  const optim::OptimizerLists l{lists.params, lists.grads, {lists.exp_avgs, lists.exp_avg_sqs}, lists.steps,
                                lists.model_params};
  cuda_step<optim::AdamW>(l, cuda::make_adamw_hyper(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.maximize),
                          grad_scale, found_inf);
}

// optimizer_step_'s CUDA kernel (csrc/optim/step.h): the functor by name, then cuda_step.
struct CudaLaunch {
  template <class F>
  static void run(const optim::OptimizerLists& l, const typename F::Hyper& h,
                  const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    cuda_step<F>(l, h, grad_scale, found_inf);
  }
};

#if GAENGINE_HAS_CUBLAS
// ---------------------------------------------------------------------------------------------------------
// gradient accumulation fusion (wgrad.h): a Linear's weight and bias gradients straight into fp32 main_grad

cudaDataType_t cublas_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? CUDA_R_16BF : t == at::kHalf ? CUDA_R_16F : CUDA_R_32F;
}

int cublas_int(int64_t v, const char* what) {
  TORCH_CHECK(v <= std::numeric_limits<int>::max(), "wgrad_accumulate_: ", what, " = ", v,
              " exceeds cuBLAS's int range");
  return static_cast<int>(v);
}

// C (column-major, m x n, ldc) = alpha * op(A) @ op(B) + beta * C, fp32 C, A and B of one dtype, fp32 compute
// (CUBLAS_COMPUTE_32F: bf16/fp16 products accumulated in fp32, as torch's own bf16 GEMMs; fp32 operands follow the
// handle's math mode, i.e. torch.backends.cuda.matmul.allow_tf32, as the unfused gradient's GEMM does).
void gemm_into_fp32(cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n, int64_t k,
                    const at::Tensor& a, int64_t lda, const at::Tensor& b, int64_t ldb, float beta, float* c,
                    int64_t ldc, const char* what) {
  const float alpha = 1.0f;
  const cublasStatus_t status =
      cublasGemmEx(at::cuda::getCurrentCUDABlasHandle(), op_a, op_b, cublas_int(m, "m"), cublas_int(n, "n"),
                   cublas_int(k, "k"), &alpha, a.data_ptr(), cublas_dtype(a.scalar_type()), cublas_int(lda, "lda"),
                   b.data_ptr(), cublas_dtype(b.scalar_type()), cublas_int(ldb, "ldb"), &beta, c, CUDA_R_32F,
                   cublas_int(ldc, "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "gaengine wgrad_accumulate_: cublasGemmEx (", what, ") failed: ",
              cublasGetStatusString(status), " (status ", static_cast<int>(status), ")");
}

// A row-major (rows, cols) operand with unit column stride, as cuBLAS reads it: column-major (cols, rows) with
// leading dimension stride(0) (a contiguous copy otherwise); `dtype` when it differs (the operands of one GEMM
// share a dtype: the narrower is widened, exactly).
at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType dtype) {
  at::Tensor out = t.scalar_type() == dtype ? t : t.to(dtype);
  const bool row_major = out.size(1) <= 1 || out.stride(1) == 1;
  const bool lead_ok = out.size(0) <= 1 || out.stride(0) >= std::max<int64_t>(1, out.size(1));
  return row_major && lead_ok ? out : out.contiguous();
}

int64_t leading_dim(const at::Tensor& t) {  // of gemm_operand's result
  return t.size(0) <= 1 ? std::max<int64_t>(1, t.size(1)) : t.stride(0);
}

// wgrad.h: dw (out, in) = (0 | dw) + fp32(grad_output)^T @ fp32(input); db (out) = (0 | db) + row sum of
// grad_output. Row-major dw is column-major dw^T (in x out, ld in) = input^T @ grad_output: input read as stored
// (column-major in x N), grad_output transposed (stored column-major out x N). db = grad_output^T @ ones(N). beta 0
// on the window's first contribution: main_grad's old values (NaN, in tests) are not read.
void wgrad_accumulate_cuda(const std::optional<at::Tensor>& dw, const std::optional<at::Tensor>& db,
                           const at::Tensor& grad_output, const at::Tensor& input, bool overwrite_w,
                           bool overwrite_b) {
  for (const at::Tensor* t : {&grad_output, &input}) {
    const char* name = t == &grad_output ? "grad_output" : "input";
    TORCH_CHECK_VALUE(GAENGINE_IS_CUDA_TENSOR(*t) && t->dim() == 2 &&
                          (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16 ||
                           t->scalar_type() == at::kHalf),
                      name, " must be a 2-d float32, bfloat16 or float16 CUDA tensor, got ", t->scalar_type(),
                      " of shape ", t->sizes(), " on ", t->device());
  }
  CHECK_SAME_DEVICE(input, grad_output);
  const int64_t rows = grad_output.size(0), out = grad_output.size(1), in = input.size(1);
  TORCH_CHECK_VALUE(input.size(0) == rows, "grad_output and input must have the same rows, got ", rows, " and ",
                    input.size(0));
  auto check_main_grad = [&](const at::Tensor& t, const char* name, at::IntArrayRef shape) {
    TORCH_CHECK_VALUE(GAENGINE_IS_CUDA_TENSOR(t) && t.device() == grad_output.device() &&
                          t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == shape,
                      name, " must be a contiguous float32 tensor of shape ", shape, " on ", grad_output.device(),
                      ", got ", t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
  };
  if (dw.has_value()) check_main_grad(*dw, "dw", {out, in});
  if (db.has_value()) check_main_grad(*db, "db", {out});
  if (!dw.has_value() && !db.has_value()) return;
  const c10::cuda::CUDAGuard guard(grad_output.device());
  if (rows == 0) {  // an empty micro-batch: its gradient is zero (k = 0 is not asked of cuBLAS)
    if (dw.has_value() && overwrite_w) dw->zero_();
    if (db.has_value() && overwrite_b) db->zero_();
    return;
  }
  // One dtype for both operands: bf16 or fp16 when they agree, fp32 otherwise.
  const at::ScalarType dtype = grad_output.scalar_type() == input.scalar_type() ? input.scalar_type() : at::kFloat;
  const at::Tensor g = gemm_operand(grad_output, dtype);
  if (dw.has_value()) {
    const at::Tensor x = gemm_operand(input, dtype);
    gemm_into_fp32(CUBLAS_OP_N, CUBLAS_OP_T, in, out, rows, x, leading_dim(x), g, leading_dim(g),
                   overwrite_w ? 0.0f : 1.0f, dw->data_ptr<float>(), in, "dw");
  }
  if (db.has_value()) {
    const at::Tensor ones = at::ones({rows, 1}, g.options());
    gemm_into_fp32(CUBLAS_OP_N, CUBLAS_OP_N, out, 1, rows, g, leading_dim(g), ones, rows,
                   overwrite_b ? 0.0f : 1.0f, db->data_ptr<float>(), out, "db");
  }
}
#endif  // GAENGINE_HAS_CUBLAS

// Chunks of a bucket of sources with these numels: the columns of its (2, n) fp32 partials tables (kernels/bucket.cuh
// kBucketChunkNumel = 4096 elements per chunk, numbered source by source; an empty source has none).
int64_t bucket_num_chunks(const std::vector<int64_t>& numels) {
  for (size_t i = 0; i < numels.size(); ++i) {
    TORCH_CHECK(numels[i] >= 0, "numels[", i, "] must be >= 0, got ", numels[i]);
  }
  return cuda::bucket_num_chunks(numels.data(), static_cast<int>(numels.size()));
}

}  // namespace
}  // namespace gaengine

// The CUDA kernels of the ops csrc/module.cpp defines (under the CPU key in tests/cuda_emu's emulated build).
GAENGINE_TORCH_LIBRARY_IMPL(GAENGINE_CUDA_DISPATCH_KEY, m) {
  m.impl("accumulate_", &gaengine::accumulate_cuda);
  m.impl("l2norm_sq", &gaengine::l2norm_sq_cuda);
  m.impl("scale_", &gaengine::scale_cuda);
  m.impl("accumulate_bucket_", &gaengine::accumulate_bucket_cuda);
  m.impl("adamw_step_", &gaengine::adamw_step_op<gaengine::adamw_step_cuda>);
  m.impl("optimizer_step_", &gaengine::optim::optimizer_step<gaengine::CudaLaunch>);
#if GAENGINE_HAS_CUBLAS
  m.impl("wgrad_accumulate_", &gaengine::wgrad_accumulate_cuda);
#endif
}

// The ops of the CUDA partials layout ((2, n_chunks) fp32 columns per bucket): sum_partials has this CUDA kernel
// only; bucket_num_chunks reads no tensor (one kernel for every device).
GAENGINE_TORCH_LIBRARY_FRAGMENT(m) {
  m.def(gaengine::kSumPartialsSchema);
  m.impl("sum_partials", c10::DispatchKey::GAENGINE_CUDA_DISPATCH_KEY, TORCH_FN(gaengine::sum_partials_cuda));
  m.def(gaengine::kBucketNumChunksSchema, &gaengine::bucket_num_chunks);
}
