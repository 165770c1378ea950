// The "cuda" backend's ops (gaengine.backends.CudaBackend), registered into gaengine._C by
// register_cuda_ops when the extension is built with CUDA (setup.py defines GAENGINE_WITH_CUDA and
// csrc/cpu_ops.cpp calls it). The kernels are in kernels.cuh; this file holds the contracts, the dtype
// dispatch and the launches on the current stream. No op syncs the host or allocates beyond its outputs.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <tuple>

#include "kernels.cuh"

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got device ", (x).device())
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

// dst = (0 if overwrite else dst) + float(src) * scale; scale_tensor (0-d fp32, same device) replaces scale.
void accumulate_cuda_(const at::Tensor& dst, const at::Tensor& src, double scale,
                      const c10::optional<at::Tensor>& scale_tensor, bool overwrite) {
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
  at::Tensor out = at::empty({2}, options);  // both written by the finalize
  at::Tensor partials = at::empty({2, std::max<int64_t>(cuda::l2norm_sq_num_partials(x.numel()), 1)}, options);
  GAENGINE_DISPATCH_CUDA_GRAD_TYPES(x.scalar_type(), [&] {
    CHECK_LAUNCH(cuda::launch_l2norm_sq<src_t>(static_cast<const src_t*>(x.data_ptr()), x.numel(),
                                               partials.data_ptr<float>(), out.data_ptr<float>(), stream));
  });
  return {out.select(0, 0), out.select(0, 1)};
}

// x *= coef in place; coef a 0-d fp32 tensor on x.device, read by the kernel.
void scale_cuda_(const at::Tensor& x, const at::Tensor& coef) {
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

}  // namespace

void register_cuda_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("accumulate_cuda_", &accumulate_cuda_,
        "dst = (0 if overwrite else dst) + float(src) * scale on CUDA tensors; scale_tensor (0-d fp32) replaces scale",
        py::arg("dst"), py::arg("src"), py::arg("scale"), py::arg("scale_tensor"), py::arg("overwrite"),
        py::call_guard<py::gil_scoped_release>());
  m.def("l2norm_sq_cuda", &l2norm_sq_cuda, "(sum of squares, found_inf) of a CUDA tensor, two 0-d fp32 tensors",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("scale_cuda_", &scale_cuda_, "x *= coef in place on CUDA tensors, coef a 0-d fp32 tensor", py::arg("x"),
        py::arg("coef"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace gaengine
