// The multi-tensor optimizer launcher: one fused elementwise optimizer step (a functor of csrc/optim/, see
// csrc/optim/functor.h) for a whole list of parameters in one launch. The functor is a template argument; this
// header knows none (kernels/adamw.cuh instantiates it for AdamW, csrc/cuda/cuda_ops.cu for every functor of
// csrc/optim/all.h). The CUDA counterpart of the CPU launcher (csrc/optimizer_step.cpp).
#pragma once

#include "common.cuh"

#include <type_traits>

namespace gaengine {
namespace cuda {

// ---------------------------------------------------------------------------------------------------------
// Numerics: the functor's update() with DeviceMath (IEEE __fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn:
// no contraction beyond the fmas it writes), g = __fdiv_rn(grad, *grad_scale) before it; the functor's per-step
// coefficients from step + 1 (its coefs(), in double). The results are stored in the tensor's dtype: fp32 as is,
// bf16 | fp16 rounded to nearest even (bf16 NaN -> 0x7FC0 and fp16 NaN -> sign | 0x7E00, as c10 on the CPU).
// param_t (one kernel instantiation per type; every entry of a launch has it): float, the fp32 master weight with
// fp32 states and an optional bf16 | fp16 model parameter; or __nv_bfloat16 | __half, the model parameter updated
// in place with its states in its dtype (master_weights=False).
// Skip: when *found_inf != 0 every block returns before touching memory (step counts included).
// Step counts (functors with kStep): every block reads step (the old count) for the coefficients; the LAST block to
// finish (__threadfence + atomicAdd on *counter, the threadFenceReduction pattern) adds 1 to every step of the launch
// and resets *counter to 0, so no block can read an incremented count.
// 4096 elements per chunk (16 per thread, 4 vectors of 4), against one binary search and, when a block meets a new
// parameter, the functor's coefs() (AdamW: two double pows).
constexpr int64_t kOptimizerChunkNumel = 4096;
constexpr int kMaxOptimizerStates = 2;  // = gaengine::optim::kMaxStates (csrc/optim/functor.h)
// 384 entries x (64 B + 8 B of chunk_start) + the hyper-parameters = about 27.7 KB, under kMaxKernelParamBytes.
constexpr int kMaxOptimizerEntries = 384;
// 4 blocks of 256 threads per SM (half occupancy, <= 64 registers): each thread keeps its independent 16-byte loads
// in flight (grad, param, each state), enough to saturate HBM; AdamW's update (two IEEE divisions, a square root)
// and the double pow of its bias corrections do not fit in 32 registers without spilling.
constexpr int kOptimizerMinBlocksPerSm = 4;

struct OptimizerEntry {
  void* param;                         // (numel,) param_t of the launch, read and written
  const void* grad;                    // (numel,) fp32 | bf16 | fp16 (grad_dtype), read
  void* states[kMaxOptimizerStates];   // (numel,) param_t each, the functor's kStates first, read and written
  void* model;                         // null, or (numel,) bf16 | fp16 (model_dtype), written
  float* step;                         // () fp32 (functors with kStep; else unused): read, then incremented by 1
  int64_t numel;
  int32_t grad_dtype;                  // kDtypeFp32 | kDtypeBf16 | kDtypeFp16
  int32_t model_dtype;                 // kDtypeBf16 | kDtypeFp16 when model is not null (fp32 param_t only)
};
static_assert(sizeof(OptimizerEntry) == 64, "OptimizerEntry is part of the kernel-parameter budget");

template <class Hyper>
struct OptimizerParams {
  OptimizerEntry entries[kMaxOptimizerEntries];  // this launch's parameters (empty ones too: their steps count)
  int64_t chunk_start[kMaxOptimizerEntries];
  Hyper hyper;
  const float* grad_scale;  // null, or () fp32: the gradient used is grad / *grad_scale
  const float* found_inf;   // null, or () fp32: != 0 skips the launch entirely
  unsigned int* counter;    // () u32, 0 before and after the launch: blocks finished so far (kStep functors)
  int64_t n_chunks;
  int32_t n_entries;
};

// The device's fp32 arithmetic for a functor's update(): one IEEE rounding per operation. (nvcc's host pass
// compiles these too, never to run them.)
struct DeviceMath {
#if defined(__CUDA_ARCH__) || !defined(__CUDACC__)
  static __host__ __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __host__ __device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
  static __host__ __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  static __host__ __device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
  static __host__ __device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
  static __host__ __device__ __forceinline__ float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#else
  static __host__ __device__ __forceinline__ float add(float a, float b) { return a + b; }
  static __host__ __device__ __forceinline__ float sub(float a, float b) { return a - b; }
  static __host__ __device__ __forceinline__ float mul(float a, float b) { return a * b; }
  static __host__ __device__ __forceinline__ float div(float a, float b) { return a / b; }
  static __host__ __device__ __forceinline__ float sqrt(float a) { return ::sqrtf(a); }
  static __host__ __device__ __forceinline__ float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
#endif
};

struct NoModelParam {};  // model_t when no model parameter is attached: nothing is written

// The bits of the rounding of x to a 16-bit type, in the low 16 bits (selects, no branch).
__device__ __forceinline__ uint32_t model_bits(__nv_bfloat16*, float x) {  // c10::BFloat16's rounding
  const uint32_t u = __float_as_uint(x);
  const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  return isnan(x) ? 0x7FC0u : rounded;
}
__device__ __forceinline__ uint32_t model_bits(__half*, float x) {  // IEEE round to nearest even
  const uint32_t rounded = __half_as_ushort(__float2half_rn(x));
  return isnan(x) ? (((__float_as_uint(x) >> 16) & 0x8000u) | 0x7E00u) : rounded;
}

// Four consecutive values widened to fp32: one 128-bit load for fp32, one 64-bit load for bf16 | fp16.
__device__ __forceinline__ void load4(const float* p, float (&out)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
template <typename half_t>
__device__ __forceinline__ void load4(const half_t* p, float (&out)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const half_t* values = reinterpret_cast<const half_t*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = to_float(values[k]);
}

// Four values stored: fp32 as one 128-bit store, bf16 | fp16 rounded as one 64-bit store, none for NoModelParam.
__device__ __forceinline__ void store4(NoModelParam*, const float (&)[4]) {}
__device__ __forceinline__ void store4(float* out, const float (&p)[4]) {  // __stwb: one st.global.v4 (see below)
  __stwb(reinterpret_cast<float4*>(out), make_float4(p[0], p[1], p[2], p[3]));
}
template <typename half_t>
__device__ __forceinline__ void store4(half_t* out, const float (&p)[4]) {
  // __stwb: a plain (write-back) store that stays one 64-bit st.global.v2 (NVVM splits the assignment).
  __stwb(reinterpret_cast<uint2*>(out), make_uint2(model_bits(out, p[0]) | (model_bits(out, p[1]) << 16),
                                                   model_bits(out, p[2]) | (model_bits(out, p[3]) << 16)));
}
__device__ __forceinline__ void store1(NoModelParam*, int64_t, float) {}
__device__ __forceinline__ void store1(float* out, int64_t i, float p) { out[i] = p; }
template <typename half_t>
__device__ __forceinline__ void store1(half_t* out, int64_t i, float p) {
  reinterpret_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(model_bits(out, p));
}

__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Elements [begin, end) of one parameter (begin: a multiple of kOptimizerChunkNumel): four at a time when every
// pointer allows the vector accesses, then (or else) one at a time.
template <class F, typename param_t, typename grad_t, typename model_t>
__device__ __forceinline__ void optimizer_chunk(const OptimizerEntry& e, int64_t begin, int64_t end,
                                                const typename F::Hyper& h, bool has_grad_scale, float grad_scale,
                                                const typename F::Coefs& c) {
  constexpr int kStates = F::kStates;
  static_assert(kStates >= 1 && kStates <= kMaxOptimizerStates, "a functor's kStates must be in [1, kMaxStates]");
  param_t* __restrict__ param = static_cast<param_t*>(e.param);
  const grad_t* __restrict__ grad = static_cast<const grad_t*>(e.grad);
  param_t* states[kStates];
  bool aligned = aligned_to(param, 4 * sizeof(param_t)) && aligned_to(grad, 4 * sizeof(grad_t));
#pragma unroll
  for (int k = 0; k < kStates; ++k) {
    states[k] = static_cast<param_t*>(e.states[k]);
    aligned = aligned && aligned_to(states[k], 4 * sizeof(param_t));
  }
  model_t* __restrict__ model = static_cast<model_t*>(e.model);
  constexpr bool kHasModel = !std::is_same<model_t, NoModelParam>::value;
  int64_t scalar_start = begin;
  if (aligned && (!kHasModel || aligned_to(model, 8))) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * 4; i < vector_end; i += kThreads * 4) {
      float g[4], p[4], s[kStates][4];
      load4(grad + i, g);
      load4(param + i, p);
#pragma unroll
      for (int k = 0; k < kStates; ++k) load4(states[k] + i, s[k]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float sj[kStates];
#pragma unroll
        for (int k = 0; k < kStates; ++k) sj[k] = s[k][j];
        const float gj = has_grad_scale ? __fdiv_rn(g[j], grad_scale) : g[j];
        F::template update<DeviceMath>(p[j], sj, gj, h, c);
#pragma unroll
        for (int k = 0; k < kStates; ++k) s[k][j] = sj[k];
      }
#pragma unroll
      for (int k = 0; k < kStates; ++k) store4(states[k] + i, s[k]);
      store4(param + i, p);
      if constexpr (kHasModel) store4(model + i, p);
    }
    scalar_start = vector_end;
  }
#pragma unroll 1
  for (int64_t i = scalar_start + threadIdx.x; i < end; i += kThreads) {  // unaligned tensors, and the last < 4
    float p = to_float(param[i]), s[kStates];
#pragma unroll
    for (int k = 0; k < kStates; ++k) s[k] = to_float(states[k][i]);
    float g = to_float(grad[i]);
    if (has_grad_scale) g = __fdiv_rn(g, grad_scale);
    F::template update<DeviceMath>(p, s, g, h, c);
#pragma unroll
    for (int k = 0; k < kStates; ++k) store1(states[k], i, s[k]);
    store1(param, i, p);
    store1(model, i, p);
  }
}

template <class F, typename param_t, typename grad_t>
__device__ __forceinline__ void optimizer_chunk_model(const OptimizerEntry& e, int64_t begin, int64_t end,
                                                      const typename F::Hyper& h, bool has_grad_scale,
                                                      float grad_scale, const typename F::Coefs& c) {
  if constexpr (std::is_same<param_t, float>::value) {
    if (e.model != nullptr && e.model_dtype == kDtypeBf16) {
      return optimizer_chunk<F, param_t, grad_t, __nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, c);
    }
    if (e.model != nullptr) {
      return optimizer_chunk<F, param_t, grad_t, __half>(e, begin, end, h, has_grad_scale, grad_scale, c);
    }
  }
  optimizer_chunk<F, param_t, grad_t, NoModelParam>(e, begin, end, h, has_grad_scale, grad_scale, c);
}

template <class F, typename param_t>
__global__ void __launch_bounds__(kThreads, kOptimizerMinBlocksPerSm)
    optimizer_multi_kernel(const __grid_constant__ OptimizerParams<typename F::Hyper> params) {
  if (params.found_inf != nullptr && *params.found_inf != 0.f) return;  // skipped by every block: nothing written
  const typename F::Hyper& h = params.hyper;
  const bool has_grad_scale = params.grad_scale != nullptr;
  const float grad_scale = has_grad_scale ? *params.grad_scale : 1.f;
  int entry = 0, coefs_entry = -1;
  typename F::Coefs c{};
  if constexpr (!F::kStep) c = F::coefs(h, 0.0);  // kStep functors: per entry, below
  for (int64_t chunk = blockIdx.x; chunk < params.n_chunks; chunk += gridDim.x) {
    entry = find_tensor(params.chunk_start, entry, params.n_entries, chunk);
    const OptimizerEntry& e = params.entries[entry];
    if constexpr (F::kStep) {
      if (entry != coefs_entry) {  // step += 1 (fp32), then the coefficients; not written until every block is done
        c = F::coefs(h, static_cast<double>(__fadd_rn(*e.step, 1.f)));
        coefs_entry = entry;
      }
    }
    const int64_t begin = (chunk - params.chunk_start[entry]) * kOptimizerChunkNumel;
    const int64_t end = begin + kOptimizerChunkNumel < e.numel ? begin + kOptimizerChunkNumel : e.numel;
    if (e.grad_dtype == kDtypeBf16) {
      optimizer_chunk_model<F, param_t, __nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, c);
    } else if (e.grad_dtype == kDtypeFp16) {
      optimizer_chunk_model<F, param_t, __half>(e, begin, end, h, has_grad_scale, grad_scale, c);
    } else {
      optimizer_chunk_model<F, param_t, float>(e, begin, end, h, has_grad_scale, grad_scale, c);
    }
  }
  if constexpr (F::kStep) {
    // The last block to finish increments every step count (all reads of them are done), then resets the counter.
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      is_last = atomicAdd(params.counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last) {
      for (int k = threadIdx.x; k < params.n_entries; k += kThreads) {
        float* step = params.entries[k].step;
        *step = __fadd_rn(*step, 1.f);  // torch: _foreach_add_(steps, 1) in fp32
      }
      if (threadIdx.x == 0) *params.counter = 0u;
    }
  }
}

// One update of every entry by functor F (see above), one launch per kMaxOptimizerEntries entries; *n_launches
// (when given) receives the number issued. param_t: float | __nv_bfloat16 | __half, the dtype of every entry's param
// and states (model: null unless param_t is float). grad_scale, found_inf: null or () fp32 device pointers read by
// the kernel. counter (kStep functors): () u32 device scratch, 0 on entry and left 0; launches that may run
// concurrently need distinct counters. entries: a host array, read before this returns. Returns the first launch
// error.
template <class F, typename param_t>
inline cudaError_t launch_optimizer_multi(const OptimizerEntry* entries, int n_entries, const typename F::Hyper& hyper,
                                          const float* grad_scale, const float* found_inf, unsigned int* counter,
                                          cudaStream_t stream, int* n_launches = nullptr) {
  static_assert(sizeof(OptimizerParams<typename F::Hyper>) <= kMaxKernelParamBytes,
                "OptimizerParams exceeds the 32764-byte kernel-parameter limit: a smaller Hyper, or lower "
                "kMaxOptimizerEntries");
  if (n_launches != nullptr) *n_launches = 0;
  OptimizerParams<typename F::Hyper> params;  // only the n_entries used are filled: the rest is never read
  params.hyper = hyper;
  params.grad_scale = grad_scale;
  params.found_inf = found_inf;
  params.counter = counter;
  int launches = 0;
  for (int first = 0; first < n_entries; first += kMaxOptimizerEntries) {
    const int k = n_entries - first < kMaxOptimizerEntries ? n_entries - first : kMaxOptimizerEntries;
    int64_t chunks = 0;
    for (int j = 0; j < k; ++j) {
      params.entries[j] = entries[first + j];
      params.chunk_start[j] = chunks;
      chunks += num_chunks(entries[first + j].numel, kOptimizerChunkNumel);
    }
    params.n_entries = k;
    params.n_chunks = chunks;
    // At least one block, for the step counts of a list of empty parameters.
    optimizer_multi_kernel<F, param_t><<<chunk_blocks(chunks), kThreads, 0, stream>>>(params);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (n_launches != nullptr) *n_launches = ++launches;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace gaengine
