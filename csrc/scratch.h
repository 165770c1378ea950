// Poisoned scratch tables in test runs (STYLE.md §3, the C++ side of tests/poison.py).
//
// With GAENGINE_POISON_SCRATCH=1 in the environment (tests/conftest.py sets it; the gloo ranks the tests start
// inherit it), the tables gaengine._C allocates and then has its kernels fill come back NaN instead of whatever
// memory held: the hot path's per-micro-batch free-norm and source-partials tables (csrc/hot_path.cpp), the cuda
// ops' norm partials and results (csrc/cuda/cuda_ops.cu), the CPU ops' per-chunk sums (csrc/cpu_ops.cpp). An entry
// no launch wrote then reaches the norm, found_inf or the noise scale as NaN, where a fresh allocation could hold
// zeros and pass. Read once, at the first allocation; unset (normal use) nothing is filled.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <limits>

namespace gaengine {

inline bool poison_scratch() {
  static const bool on = [] {
    const char* value = std::getenv("GAENGINE_POISON_SCRATCH");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  return on;
}

// at::empty of a table the kernels write in full; NaN-filled (floating dtypes) when poison_scratch().
inline at::Tensor scratch_empty(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor table = at::empty(shape, options);
  if (poison_scratch() && at::isFloatingType(table.scalar_type())) {
    table.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  return table;
}

// The starting value of a host scratch entry the kernels overwrite: NaN when poison_scratch(), else `value`.
template <class T>
inline T scratch_init(T value) {
  return poison_scratch() ? std::numeric_limits<T>::quiet_NaN() : value;
}

}  // namespace gaengine
