// The torch.library ops of gaengine._C, the one way Python reaches its kernels (torch.ops.gaengine.*, through
// gaengine.backends.CompiledBackend): the namespace they live in, their schemas and the extension's ABI version,
// shared by csrc/module.cpp (TORCH_LIBRARY: the schemas; TORCH_LIBRARY_IMPL(CPU): the CPU kernels) and
// csrc/cuda/cuda_ops.cu (TORCH_LIBRARY_IMPL(CUDA): the CUDA kernels under the same names, so the tensors' device
// picks the kernel; a TORCH_LIBRARY_FRAGMENT for the two ops only the CUDA partials layout has). Fake (meta)
// implementations, for torch.compile, are registered from Python (gaengine/_ops_registry.py, imported when the
// module loads).
#pragma once

#include <torch/library.h>

#include <optional>
#include <vector>

// The device test of the CUDA kernels' contracts (cuda_ops.cu) and of the kernel HotPath dispatches to
// (hot_path.cpp), and the dispatch key the CUDA kernels register under: t is a CUDA tensor, key CUDA. Only
// tests/cuda_emu/engine.py's emulated build (the kernels executed on CPU by the shim, CPU tensors standing in for
// CUDA ones) defines GAENGINE_EMULATED_CUDA: then (t).is_cpu() and the key CPU, which its CUDA kernels take in its
// own namespace (module.cpp registers no CPU kernels there).
#if defined(GAENGINE_EMULATED_CUDA)
#define GAENGINE_IS_CUDA_TENSOR(t) ((t).is_cpu())
#define GAENGINE_CUDA_DISPATCH_KEY CPU
#else
#define GAENGINE_IS_CUDA_TENSOR(t) ((t).is_cuda())
#define GAENGINE_CUDA_DISPATCH_KEY CUDA
#endif

// The version of what gaengine._C offers Python: its ops' schemas, HotPath's and HotPathCore's methods, its module
// attributes.
// Compiled into the module as gaengine._C.ABI_VERSION and compared, when gaengine loads the extension, with
// gaengine.backends.EXTENSION_ABI_VERSION: a module built from other sources is refused with one message (rebuild
// it with `make install`). Raise both together whenever any of those changes.
#define GAENGINE_ABI_VERSION 7

// The namespace of the ops: torch.ops.gaengine. tests/cuda_emu/engine.py's emulated build, loaded beside gaengine._C
// in one process, defines it as its module name (a library namespace may be defined once per process).
#ifndef GAENGINE_OP_NAMESPACE
#define GAENGINE_OP_NAMESPACE gaengine
#endif
#define GAENGINE_STRINGIFY_(x) #x
#define GAENGINE_STRINGIFY(x) GAENGINE_STRINGIFY_(x)
#define GAENGINE_OP_NAMESPACE_NAME GAENGINE_STRINGIFY(GAENGINE_OP_NAMESPACE)

// TORCH_LIBRARY / TORCH_LIBRARY_IMPL paste their namespace argument unexpanded: expand the macro first.
#define GAENGINE_TORCH_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define GAENGINE_TORCH_LIBRARY(m) GAENGINE_TORCH_LIBRARY_(GAENGINE_OP_NAMESPACE, m)
#define GAENGINE_TORCH_LIBRARY_IMPL_(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define GAENGINE_TORCH_LIBRARY_IMPL(key, m) GAENGINE_TORCH_LIBRARY_IMPL_(GAENGINE_OP_NAMESPACE, key, m)
#define GAENGINE_TORCH_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define GAENGINE_TORCH_LIBRARY_FRAGMENT(m) GAENGINE_TORCH_LIBRARY_FRAGMENT_(GAENGINE_OP_NAMESPACE, m)

namespace gaengine {

// The schemas (gaengine.backends' operation table; mutated arguments annotated (a!)). adamw_step_'s is
// kAdamWStepSchema in adamw.h, beside its flat argument list. accumulate_'s scale_tensor, when given (a 0-d fp32
// tensor on dst's device), replaces scale: the CUDA kernel reads it on the device, the CPU one with a plain load.
inline constexpr const char* kAccumulateSchema =
    "accumulate_(Tensor(a!) dst, Tensor src, float scale, bool overwrite, Tensor? scale_tensor=None) -> ()";
inline constexpr const char* kL2NormSqSchema = "l2norm_sq(Tensor x) -> (Tensor, Tensor)";
inline constexpr const char* kScaleSchema = "scale_(Tensor(a!) x, Tensor coef) -> ()";
inline constexpr const char* kAccumulateBucketSchema =
    "accumulate_bucket_(Tensor(a!) dst, Tensor[] srcs, int[] offsets, bool[] overwrite, Tensor(b!)? partials=None, "
    "Tensor(c!)? source_partials=None) -> ()";
// The ops of the CUDA partials layout ((2, n_chunks) fp32 columns), defined by cuda_ops.cu when it is built:
// sum_partials finishes a table (CUDA kernel), bucket_num_chunks gives its columns for sources of these numels.
inline constexpr const char* kSumPartialsSchema = "sum_partials(Tensor partials) -> (Tensor, Tensor)";
inline constexpr const char* kBucketNumChunksSchema = "bucket_num_chunks(int[] numels) -> int";

// The C++ signature of accumulate_bucket_'s kernels (CPU: module.cpp, CUDA: cuda_ops.cu), one for both: a typed
// dispatcher handle (csrc/hot_path.cpp) calls them unboxed with exactly these argument types.
using AccumulateBucketKernel = void(const at::Tensor& dst, const std::vector<at::Tensor>& srcs,
                                    const std::vector<int64_t>& offsets, const c10::List<bool>& overwrite,
                                    const std::optional<at::Tensor>& partials,
                                    const std::optional<at::Tensor>& source_partials);

// bool[] arrives as a c10::List<bool> (the dispatcher takes no std::vector<bool>).
inline std::vector<bool> to_flags(const c10::List<bool>& flags) {
  std::vector<bool> out;
  out.reserve(flags.size());
  for (const bool f : flags) out.push_back(f);
  return out;
}

}  // namespace gaengine
