// Force-included (g++ -include) first into every translation unit of tests/cuda_emu/engine.py's emulated build of
// gaengine._C: csrc/*.cpp + csrc/cuda/cuda_ops.cu compiled as C++ against the shim, in the CUDA configuration, with
// CPU tensors standing in for CUDA ones. Nothing else includes it.
#pragma once

// As setup.py's CUDAExtension: module.cpp calls register_cuda_ops, cuda_ops.cu registers the CUDA kernels.
#define GAENGINE_WITH_CUDA 1
// csrc/op_library.h: the device the CUDA kernels' tensors are on (here the CPU, standing in); HotPath dispatches a
// main_grad on it to the ops' CUDA kernels.
#define GAENGINE_IS_CUDA_TENSOR(t) ((t).is_cpu())
// csrc/op_library.h: the torch.library namespace of the ops, the module's own name (gaengine_emu_C): gaengine._C,
// loaded in the same process, has gaengine, and a second build() in one process loads a copy (gaengine_emu_C_v1).
#define GAENGINE_OP_NAMESPACE TORCH_EXTENSION_NAME
