// Host emulation of the CUDA toolkit's cuda_runtime.h (tests/cuda_emu): the qualifiers, built-in variables,
// vector types, barriers, warp ops, atomics, intrinsics and runtime API that csrc/cuda/*.cu use, with kernels run
// on CPU memory by gaemu.h (the execution model, its checks and its environment variables are described there;
// the file list in tests/cuda_emu/README.md).
#pragma once

#include "gaemu.h"
