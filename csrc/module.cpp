// gaengine._C: the module definition. The Python bindings (pybind11: what gaengine.backends calls) and the
// torch.library ops (torch.ops.gaengine.*: the schemas, and the CPU kernels under them; the CUDA kernels register
// under the same names in csrc/cuda/cuda_ops.cu). Each op's contract is in the header that declares it.
#include <torch/extension.h>

#include <type_traits>

#include "adamw.h"
#include "cpu_ops.h"
#include "op_library.h"

namespace gaengine {
void register_hot_path(pybind11::module_& m);  // csrc/hot_path.cpp
#if defined(GAENGINE_WITH_CUDA)
void register_cuda_ops(pybind11::module_& m);  // csrc/cuda/cuda_ops.cu: the "cuda" backend's ops
#endif

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
}

GAENGINE_TORCH_LIBRARY_IMPL(CPU, m) {
  m.impl("accumulate_", &gaengine::accumulate_);
  m.impl("l2norm_sq", &gaengine::l2norm_sq);
  m.impl("scale_", &gaengine::scale_);
  m.impl("accumulate_bucket_", &gaengine::accumulate_bucket_op);
  m.impl("adamw_step_", &gaengine::adamw_step_op<gaengine::adamw_step_cpu>);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "gaengine._C: compiled CPU kernels for gradient buffers (see gaengine.backends.CpuBackend)";
  m.attr("OP_NAMESPACE") = GAENGINE_OP_NAMESPACE_NAME;  // torch.ops.<OP_NAMESPACE>: the ops registered below
  m.def("accumulate_", &gaengine::accumulate_, "dst = (0 if overwrite else dst) + float(src) * scale, in place",
        py::arg("dst"), py::arg("src"), py::arg("scale"), py::arg("overwrite"),
        py::call_guard<py::gil_scoped_release>());
  m.def("l2norm_sq", &gaengine::l2norm_sq, "(sum of squares, found_inf) of x as two 0-d fp32 tensors",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("scale_", &gaengine::scale_, "x *= coef in place, coef a 0-d CPU tensor", py::arg("x"), py::arg("coef"),
        py::call_guard<py::gil_scoped_release>());
  gaengine::def_adamw_step<gaengine::adamw_step_cpu>(
      m, "adamw_step_",
      "fused AdamW step of each param (one pass: m, v, param and the optional bf16/fp16 model copy), skipped "
      "when found_inf != 0; see csrc/adamw.h");
  m.def("accumulate_bucket_", &gaengine::accumulate_bucket_,
        "dst[offsets[j]:offsets[j] + srcs[j].numel()] = (0 if overwrite[j] else dst[...]) + srcs[j] for every j, in "
        "one parallel region; partials / source_partials: None or a (len(srcs), 2) float64 tensor receiving each "
        "source's (sum of squares, found_inf) of the values written / of the source's own values",
        py::arg("dst"), py::arg("srcs"), py::arg("offsets"), py::arg("overwrite"), py::arg("partials") = py::none(),
        py::arg("source_partials") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.attr("BUCKET_SOURCE_PARTIALS") = true;  // accumulate_bucket_ (and accumulate_bucket_cuda_) take source_partials
  gaengine::register_hot_path(m);  // csrc/hot_path.cpp: HotPath, the accumulator's per-parameter work
#if defined(GAENGINE_WITH_CUDA)
  gaengine::register_cuda_ops(m);  // built with CUDA (setup.py): accumulate_cuda_, l2norm_sq_cuda, scale_cuda_, ...
#endif
  // The fake (meta) implementations of the ops above, for torch.compile: registered in Python, once per namespace.
  py::module_::import("gaengine._ops_registry").attr("register_fakes")(GAENGINE_OP_NAMESPACE_NAME);
}
