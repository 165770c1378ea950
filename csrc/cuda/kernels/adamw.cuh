// The multi-tensor AdamW: gaengine::adamw_step_ for a whole list of parameters in one launch (the CUDA
// counterpart of kernels/adamw.py).
#pragma once

#include "common.cuh"

#include <type_traits>

namespace gaengine {
namespace cuda {

// ---------------------------------------------------------------------------------------------------------
// multi-tensor AdamW: gaengine::adamw_step_ (csrc/adamw.h) for a whole list of parameters in one launch
// ---------------------------------------------------------------------------------------------------------
// Numerics: exactly the fp32 operations of csrc/adamw_kernels.h (portable::adamw, torch's fused CPU AdamW),
// in its order, with IEEE division and square root (__fdiv_rn, __fsqrt_rn) and no contraction beyond the
// two FMAs written; the bias corrections 1 - beta^step in double from step + 1 (pow, sqrt), rounded to fp32
// once, as adamw.cpp does. The model parameter receives bf16 | fp16 round-to-nearest-even of the new param
// (bf16 NaN -> 0x7FC0 and fp16 NaN -> sign | 0x7E00, as c10 on the CPU).
// param_t (one kernel instantiation per type; every entry of a launch has it): float, the fp32 master weight
// with fp32 m, v and an optional model parameter (28 B/param with an fp32 grad, + 2 for the model write); or
// __nv_bfloat16 | __half, the model parameter updated in place with m, v in its dtype (master_weights=False):
// p, m, v widened to fp32, the same fp32 update, each rounded to nearest even as model_bits does (4 B of fp32
// grad + 3 x 2 read, 3 x 2 written = 16 B/param).
// Skip: when *found_inf != 0 every block returns before touching memory (step counts included).
// Step counts: every block reads step (the old count) for the bias corrections; the LAST block to finish
// (__threadfence + atomicAdd on *counter, the threadFenceReduction pattern) adds 1 to every step of the launch
// and resets *counter to 0, so no block can read an incremented count.
// 4096 elements per chunk (16 per thread, 4 vectors of 4): 112 KiB of traffic per chunk with fp32 grads, against
// one binary search and, when a block meets a new parameter, two double pows.
constexpr int64_t kAdamWChunkNumel = 4096;
// 384 entries x (64 B + 8 B of chunk_start) + 96 B = 27744 B of parameters, under kMaxKernelParamBytes.
constexpr int kMaxAdamWEntries = 384;
// 4 blocks of 256 threads per SM (half occupancy, <= 64 registers): each thread keeps four independent
// 16-byte loads in flight (grad, param, exp_avg, exp_avg_sq), 64 KB per SM, enough to saturate HBM; the
// update (two IEEE divisions, a square root) and the double pow of the bias corrections do not fit in 32
// registers without spilling.
constexpr int kAdamWMinBlocksPerSm = 4;

struct AdamWEntry {
  void* param;          // (numel,) param_t of the launch (fp32: the master weight; bf16 | fp16: in place), read and written
  const void* grad;     // (numel,) fp32 | bf16 | fp16 (grad_dtype), read
  void* exp_avg;        // (numel,) param_t, read and written
  void* exp_avg_sq;     // (numel,) param_t, read and written
  void* model;          // null, or (numel,) bf16 | fp16 (model_dtype), written
  float* step;          // () fp32: read (the count before this update), then incremented by 1
  int64_t numel;
  int32_t grad_dtype;   // kDtypeFp32 | kDtypeBf16 | kDtypeFp16
  int32_t model_dtype;  // kDtypeBf16 | kDtypeFp16 when model is not null (fp32 param_t only)
};
static_assert(sizeof(AdamWEntry) == 64, "AdamWEntry is part of the kernel-parameter budget");

// The per-call hyper-parameters: doubles for the bias corrections, fp32 coefficients rounded once from
// double (make_adamw_hyper, as adamw.cpp computes them).
struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  float decay_factor;     // 1 - lr * weight_decay
  float lerp_coeff;       // torch's lerp weight w = 1 - beta1 when lerp_small, else w - 1
  float beta2_f;
  float one_minus_beta2;
  float eps;
  int32_t decay;          // weight_decay != 0
  int32_t lerp_small;     // |w| < 0.5: m = fma(w, g - m, m), else m = fma(w - 1, g - m, g)
  int32_t maximize;
};

inline AdamWHyper make_adamw_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   bool maximize) {
  AdamWHyper h{};
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  const float lerp_weight = static_cast<float>(1.0 - beta1);
  h.lerp_small = (lerp_weight < 0.f ? -lerp_weight : lerp_weight) < 0.5f;
  h.lerp_coeff = h.lerp_small ? lerp_weight : lerp_weight - 1.0f;
  h.decay = weight_decay != 0.0;
  h.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  h.beta2_f = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.maximize = maximize;
  return h;
}

struct AdamWParams {
  AdamWEntry entries[kMaxAdamWEntries];  // this launch's parameters (empty ones too: their steps count)
  int64_t chunk_start[kMaxAdamWEntries];
  AdamWHyper hyper;
  const float* grad_scale;  // null, or () fp32: the gradient used is grad / *grad_scale
  const float* found_inf;   // null, or () fp32: != 0 skips the launch entirely
  unsigned int* counter;    // () u32, 0 before and after the launch: blocks finished so far
  int64_t n_chunks;
  int32_t n_entries;
};
static_assert(sizeof(AdamWParams) <= kMaxKernelParamBytes, "AdamWParams exceeds the 32764-byte kernel-parameter "
              "limit: lower kMaxAdamWEntries");

struct NoModelParam {};  // model_t when no model parameter is attached: nothing is written

// The bits of the model parameter's rounding of x, in the low 16 bits (selects, no branch).
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

__device__ __forceinline__ void store4(NoModelParam*, const float (&)[4]) {}
template <typename model_t>
__device__ __forceinline__ void store4(model_t* out, const float (&p)[4]) {  // one 64-bit store
  // __stwb: a plain (write-back) store that stays one 64-bit st.global.v2 (NVVM splits the assignment).
  __stwb(reinterpret_cast<uint2*>(out), make_uint2(model_bits(out, p[0]) | (model_bits(out, p[1]) << 16),
                                                   model_bits(out, p[2]) | (model_bits(out, p[3]) << 16)));
}
__device__ __forceinline__ void store1(NoModelParam*, int64_t, float) {}
template <typename model_t>
__device__ __forceinline__ void store1(model_t* out, int64_t i, float p) {
  reinterpret_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(model_bits(out, p));
}

// The per-parameter fp32 coefficients, from this update's step count (adamw.cpp's formulas).
struct AdamWStepCoefs {
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};

// One element: csrc/adamw_kernels.h portable::adamw, operation for operation.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const AdamWHyper& h,
                                              bool has_grad_scale, float grad_scale, const AdamWStepCoefs& s) {
  if (has_grad_scale) g = __fdiv_rn(g, grad_scale);
  if (h.maximize) g = -g;
  if (h.decay) p = __fmul_rn(p, h.decay_factor);
  const float m_old = m;
  m = __fmaf_rn(h.lerp_coeff, __fsub_rn(g, m_old), h.lerp_small ? m_old : g);
  v = __fmaf_rn(__fmul_rn(h.one_minus_beta2, g), g, __fmul_rn(v, h.beta2_f));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), h.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Elements [begin, end) of one parameter (begin: a multiple of kAdamWChunkNumel).
template <typename grad_t, typename model_t>
__device__ __forceinline__ void adamw_chunk(const AdamWEntry& e, int64_t begin, int64_t end, const AdamWHyper& h,
                                            bool has_grad_scale, float grad_scale, const AdamWStepCoefs& s) {
  float* __restrict__ param = static_cast<float*>(e.param);
  const grad_t* __restrict__ grad = static_cast<const grad_t*>(e.grad);
  float* __restrict__ exp_avg = static_cast<float*>(e.exp_avg);
  float* __restrict__ exp_avg_sq = static_cast<float*>(e.exp_avg_sq);
  model_t* __restrict__ model = static_cast<model_t*>(e.model);
  constexpr bool kHasModel = !std::is_same<model_t, NoModelParam>::value;
  int64_t scalar_start = begin;
  if (aligned16(param) && aligned16(exp_avg) && aligned16(exp_avg_sq) && aligned_to(grad, 4 * sizeof(grad_t)) &&
      (!kHasModel || aligned_to(model, 8))) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * 4; i < vector_end; i += kThreads * 4) {
      float g[4];
      load4(grad + i, g);
      float4* p4 = reinterpret_cast<float4*>(param + i);
      float4* m4 = reinterpret_cast<float4*>(exp_avg + i);
      float4* v4 = reinterpret_cast<float4*>(exp_avg_sq + i);
      float4 p = *p4, m = *m4, v = *v4;
      adamw_element(p.x, m.x, v.x, g[0], h, has_grad_scale, grad_scale, s);
      adamw_element(p.y, m.y, v.y, g[1], h, has_grad_scale, grad_scale, s);
      adamw_element(p.z, m.z, v.z, g[2], h, has_grad_scale, grad_scale, s);
      adamw_element(p.w, m.w, v.w, g[3], h, has_grad_scale, grad_scale, s);
      *m4 = m;
      *v4 = v;
      *p4 = p;
      if constexpr (kHasModel) {
        const float out[4] = {p.x, p.y, p.z, p.w};
        store4(model + i, out);
      }
    }
    scalar_start = vector_end;
  }
#pragma unroll 1
  for (int64_t i = scalar_start + threadIdx.x; i < end; i += kThreads) {  // unaligned tensors, and the last < 4
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_element(p, m, v, to_float(grad[i]), h, has_grad_scale, grad_scale, s);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    store1(model, i, p);
  }
}

template <typename grad_t>
__device__ __forceinline__ void adamw_chunk_model(const AdamWEntry& e, int64_t begin, int64_t end,
                                                  const AdamWHyper& h, bool has_grad_scale, float grad_scale,
                                                  const AdamWStepCoefs& s) {
  if (e.model == nullptr) {
    adamw_chunk<grad_t, NoModelParam>(e, begin, end, h, has_grad_scale, grad_scale, s);
  } else if (e.model_dtype == kDtypeBf16) {
    adamw_chunk<grad_t, __nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, s);
  } else {
    adamw_chunk<grad_t, __half>(e, begin, end, h, has_grad_scale, grad_scale, s);
  }
}

// Elements [begin, end) of a bf16 | fp16 parameter updated in place (param_t = __nv_bfloat16 | __half): p, m, v
// loaded as four 16-bit values (one 64-bit access each), computed in fp32 (adamw_element), stored rounded.
template <typename param_t, typename grad_t>
__device__ __forceinline__ void adamw_chunk_in_place(const AdamWEntry& e, int64_t begin, int64_t end,
                                                     const AdamWHyper& h, bool has_grad_scale, float grad_scale,
                                                     const AdamWStepCoefs& s) {
  param_t* __restrict__ param = static_cast<param_t*>(e.param);
  const grad_t* __restrict__ grad = static_cast<const grad_t*>(e.grad);
  param_t* __restrict__ exp_avg = static_cast<param_t*>(e.exp_avg);
  param_t* __restrict__ exp_avg_sq = static_cast<param_t*>(e.exp_avg_sq);
  int64_t scalar_start = begin;
  if (aligned_to(param, 8) && aligned_to(exp_avg, 8) && aligned_to(exp_avg_sq, 8) &&
      aligned_to(grad, 4 * sizeof(grad_t))) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * 4; i < vector_end; i += kThreads * 4) {
      float g[4], p[4], m[4], v[4];
      load4(grad + i, g);
      load4(param + i, p);
      load4(exp_avg + i, m);
      load4(exp_avg_sq + i, v);
#pragma unroll
      for (int k = 0; k < 4; ++k) adamw_element(p[k], m[k], v[k], g[k], h, has_grad_scale, grad_scale, s);
      store4(exp_avg + i, m);
      store4(exp_avg_sq + i, v);
      store4(param + i, p);
    }
    scalar_start = vector_end;
  }
#pragma unroll 1
  for (int64_t i = scalar_start + threadIdx.x; i < end; i += kThreads) {  // unaligned tensors, and the last < 4
    float p = to_float(param[i]), m = to_float(exp_avg[i]), v = to_float(exp_avg_sq[i]);
    adamw_element(p, m, v, to_float(grad[i]), h, has_grad_scale, grad_scale, s);
    store1(exp_avg, i, m);
    store1(exp_avg_sq, i, v);
    store1(param, i, p);
  }
}

template <typename param_t>
__global__ void __launch_bounds__(kThreads, kAdamWMinBlocksPerSm)
    adamw_multi_kernel(const __grid_constant__ AdamWParams params) {
  if (params.found_inf != nullptr && *params.found_inf != 0.f) return;  // skipped by every block: nothing written
  const AdamWHyper& h = params.hyper;
  const bool has_grad_scale = params.grad_scale != nullptr;
  const float grad_scale = has_grad_scale ? *params.grad_scale : 1.f;
  int entry = 0, coefs_entry = -1;
  AdamWStepCoefs s{0.f, 1.f};
  for (int64_t c = blockIdx.x; c < params.n_chunks; c += gridDim.x) {
    entry = find_tensor(params.chunk_start, entry, params.n_entries, c);
    const AdamWEntry& e = params.entries[entry];
    if (entry != coefs_entry) {  // adamw.cpp: step += 1 (fp32), then the bias corrections in double
      const double step = static_cast<double>(__fadd_rn(*e.step, 1.f));  // not written until every block is done
      const double bias_correction1 = 1.0 - pow(h.beta1, step);
      const double bias_correction2 = 1.0 - pow(h.beta2, step);
      s.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
      s.bias_correction2_sqrt = static_cast<float>(sqrt(bias_correction2));
      coefs_entry = entry;
    }
    const int64_t begin = (c - params.chunk_start[entry]) * kAdamWChunkNumel;
    const int64_t end = begin + kAdamWChunkNumel < e.numel ? begin + kAdamWChunkNumel : e.numel;
    if constexpr (std::is_same<param_t, float>::value) {
      if (e.grad_dtype == kDtypeBf16) {
        adamw_chunk_model<__nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, s);
      } else if (e.grad_dtype == kDtypeFp16) {
        adamw_chunk_model<__half>(e, begin, end, h, has_grad_scale, grad_scale, s);
      } else {
        adamw_chunk_model<float>(e, begin, end, h, has_grad_scale, grad_scale, s);
      }
    } else if (e.grad_dtype == kDtypeBf16) {
      adamw_chunk_in_place<param_t, __nv_bfloat16>(e, begin, end, h, has_grad_scale, grad_scale, s);
    } else if (e.grad_dtype == kDtypeFp16) {
      adamw_chunk_in_place<param_t, __half>(e, begin, end, h, has_grad_scale, grad_scale, s);
    } else {
      adamw_chunk_in_place<param_t, float>(e, begin, end, h, has_grad_scale, grad_scale, s);
    }
  }
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

// One AdamW update of every entry (gaengine::adamw_step_'s semantics; see above), one launch per
// kMaxAdamWEntries entries; *n_launches (when given) receives the number issued. param_t: float | __nv_bfloat16 |
// __half, the dtype of every entry's param, exp_avg and exp_avg_sq (model: null unless param_t is float).
// grad_scale, found_inf: null or () fp32 device pointers read by the kernel. counter: () u32 device scratch,
// 0 on entry and left 0; launches that may run concurrently need distinct counters.
// entries: a host array, read before this returns. Returns the first launch error.
template <typename param_t>
inline cudaError_t launch_adamw_multi(const AdamWEntry* entries, int n_entries, const AdamWHyper& hyper,
                                      const float* grad_scale, const float* found_inf, unsigned int* counter,
                                      cudaStream_t stream, int* n_launches = nullptr) {
  if (n_launches != nullptr) *n_launches = 0;
  AdamWParams params;  // only the n_entries used are filled: the rest is never read
  params.hyper = hyper;
  params.grad_scale = grad_scale;
  params.found_inf = found_inf;
  params.counter = counter;
  int launches = 0;
  for (int first = 0; first < n_entries; first += kMaxAdamWEntries) {
    const int k = n_entries - first < kMaxAdamWEntries ? n_entries - first : kMaxAdamWEntries;
    int64_t chunks = 0;
    for (int j = 0; j < k; ++j) {
      params.entries[j] = entries[first + j];
      params.chunk_start[j] = chunks;
      chunks += num_chunks(entries[first + j].numel, kAdamWChunkNumel);
    }
    params.n_entries = k;
    params.n_chunks = chunks;
    // At least one block, for the step counts of a list of empty parameters.
    adamw_multi_kernel<param_t><<<chunk_blocks(chunks), kThreads, 0, stream>>>(params);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (n_launches != nullptr) *n_launches = ++launches;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace gaengine
