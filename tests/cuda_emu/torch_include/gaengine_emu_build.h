// Force-included (g++ -include) first into every translation unit of tests/cuda_emu/engine.py's emulated build of
// gaengine._C: csrc/*.cpp + csrc/cuda/cuda_ops.cu compiled as C++ against the shim, in the CUDA configuration, with
// CPU tensors standing in for CUDA ones. Nothing else includes it.
#pragma once

// As setup.py's CUDAExtension: cuda_ops.cu registers the CUDA kernels, module.cpp says WITH_CUDA.
#define GAENGINE_WITH_CUDA 1
// csrc/op_library.h: the CUDA kernels' tensors are CPU ones (standing in), and the kernels register under the CPU
// dispatch key of this module's namespace, so torch.ops.<namespace>.* and HotPath run them on CPU tensors.
#define GAENGINE_EMULATED_CUDA 1
// csrc/op_library.h: the torch.library namespace of the ops, the module's own name (gaengine_emu_C): gaengine._C,
// loaded in the same process, has gaengine, and a second build() in one process loads a copy (gaengine_emu_C_v1).
#define GAENGINE_OP_NAMESPACE TORCH_EXTENSION_NAME
