// gaengine._C: the module definition. The torch.library ops (torch.ops.gaengine.*, the one way Python reaches the
// kernels: the schemas, and the CPU kernels under them; the CUDA kernels register under the same names in
// csrc/cuda/cuda_ops.cu) and the pybind11 module, which holds what is not an op: HotPath (csrc/hot_path.cpp, the
// accumulator's per-parameter hooks) and the constants gaengine.backends reads when it loads the extension. Each
// op's contract is in the header that declares it.
// pybind11 as torch configures it (PYBIND11_MODULE below), not <torch/extension.h>: that also parses the C++ frontend
// (torch/all.h), which nothing here uses.
#include <torch/csrc/utils/pybind.h>

#include <type_traits>

#include "adamw.h"
#include "cpu_ops.h"
#include "op_library.h"
#include "wgrad.h"

namespace gaengine {
void register_hot_path(pybind11::module_& m);  // csrc/hot_path.cpp

namespace {

// The op's CPU kernel (its signature AccumulateBucketKernel, op_library.h: HotPath calls it unboxed).
void accumulate_bucket_op(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
                          const c10::List<bool>& overwrite, const std::optional<at::Tensor>& partials,
                          const std::optional<at::Tensor>& source_partials) {
  accumulate_bucket_(dst, srcs, offsets, to_flags(overwrite), partials, source_partials);
}
static_assert(std::is_same_v<decltype(accumulate_bucket_op), AccumulateBucketKernel>);

}  // namespace
}  // namespace gaengine

GAENGINE_TORCH_LIBRARY(m) {
  m.def(gaengine::kAccumulateSchema);
  m.def(gaengine::kL2NormSqSchema);
  m.def(gaengine::kScaleSchema);
  m.def(gaengine::kAccumulateBucketSchema);
  m.def(gaengine::kAdamWStepSchema);
  m.def(gaengine::kFusedLinearSchema);
  m.def(gaengine::kWgradAccumulateSchema);
}

// fused_linear (wgrad.h): at::linear (transposed: addmm) forward on every device, and its autograd formula in C++ (wgrad.cpp), which
// hands the weight and bias gradients to the HotPath that fuses them.
GAENGINE_TORCH_LIBRARY_IMPL(CompositeExplicitAutograd, m) {
  m.impl("fused_linear", &gaengine::fused_linear_forward);
}
GAENGINE_TORCH_LIBRARY_IMPL(Autograd, m) {
  m.impl("fused_linear", &gaengine::fused_linear_autograd);
}
// Under torch.autocast: the operands cast to autocast's dtype inside the autograd Function (wgrad.h).
GAENGINE_TORCH_LIBRARY_IMPL(AutocastCPU, m) {
  m.impl("fused_linear", &gaengine::fused_linear_autocast_cpu);
}
GAENGINE_TORCH_LIBRARY_IMPL(AutocastCUDA, m) {
  m.impl("fused_linear", &gaengine::fused_linear_autocast_cuda);
}

// The CPU kernels. The emulated build of tests/cuda_emu has the CUDA kernels under its CPU key (op_library.h).
#if !defined(GAENGINE_EMULATED_CUDA)
GAENGINE_TORCH_LIBRARY_IMPL(CPU, m) {
  m.impl("accumulate_", &gaengine::accumulate_);
  m.impl("l2norm_sq", &gaengine::l2norm_sq);
  m.impl("scale_", &gaengine::scale_);
  m.impl("accumulate_bucket_", &gaengine::accumulate_bucket_op);
  m.impl("adamw_step_", &gaengine::adamw_step_op<gaengine::adamw_step_cpu>);
  m.impl("wgrad_accumulate_", &gaengine::wgrad_accumulate_cpu);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gaengine._C: the gradient-buffer ops (torch.ops.gaengine.*, see gaengine.backends) and HotPath";
  m.attr("OP_NAMESPACE") = GAENGINE_OP_NAMESPACE_NAME;  // torch.ops.<OP_NAMESPACE>: the ops registered above
  m.attr("ABI_VERSION") = GAENGINE_ABI_VERSION;         // checked against gaengine.backends.EXTENSION_ABI_VERSION
#if defined(GAENGINE_WITH_CUDA)
  constexpr bool with_cuda = true;  // cuda_ops.cu's kernels are registered (setup.py built it with CUDA)
#else
  constexpr bool with_cuda = false;
#endif
  m.attr("WITH_CUDA") = with_cuda;
  gaengine::register_hot_path(m);  // csrc/hot_path.cpp: HotPath, the accumulator's per-parameter work
  // The fake (meta) implementations of the ops above, for torch.compile: registered in Python, once per namespace.
  pybind11::module_::import("gaengine._ops_registry").attr("register_fakes")(GAENGINE_OP_NAMESPACE_NAME, with_cuda);
}
