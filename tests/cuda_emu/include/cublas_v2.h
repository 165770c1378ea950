// The shim's cuBLAS: the one call gaengine makes (cublasGemmEx, wgrad_accumulate_'s CUDA kernel in
// csrc/cuda/cuda_ops.cu), executed on CPU memory as cuBLAS documents it, so that the emulated build runs the call
// with its transposes, leading dimensions, dtypes and beta. Types and enumerator values as cuBLAS's headers
// (library_types.h, cublas_api.h); only what cuda_ops.cu uses.
//
// Semantics checked (cuBLAS's documentation of cublasGemmEx): C (column-major m x n, ldc) = alpha * op(A) @ op(B) +
// beta * C, op(A) m x k, op(B) k x n; A stored column-major with lda >= max(1, transa == N ? m : k), B with
// ldb >= max(1, transb == N ? k : n), ldc >= max(1, m); m, n, k >= 0, else CUBLAS_STATUS_INVALID_VALUE. Supported:
// Atype == Btype in {16BF, 16F, 32F}, Ctype 32F, CUBLAS_COMPUTE_32F, else CUBLAS_STATUS_NOT_SUPPORTED. beta == 0:
// C is not read (NaN in C does not propagate). Each product term is formed in fp32 and summed in fp32 in k order
// (a GPU's order differs: within fp32 rounding of the exact sum, which is all gaengine's tests assume). Pointer
// mode host (torch's handle): alpha and beta are read on the host. ASan sees every access.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

struct gaemu_cublas_context {
  int64_t gemm_calls = 0;  // cublasGemmEx calls that returned CUBLAS_STATUS_SUCCESS
};
typedef gaemu_cublas_context* cublasHandle_t;

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

inline const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "<unknown>";
}

namespace gaemu {

inline float cublas_load(const void* base, cudaDataType_t type, int64_t index) {
  switch (type) {
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    case CUDA_R_16F: return __half2float(static_cast<const __half*>(base)[index]);
    case CUDA_R_32F: return static_cast<const float*>(base)[index];
  }
  return 0.0f;
}

}  // namespace gaemu

inline cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m,
                                   int n, int k, const void* alpha, const void* A, cudaDataType_t Atype, int lda,
                                   const void* B, cudaDataType_t Btype, int ldb, const void* beta, void* C,
                                   cudaDataType_t Ctype, int ldc, cublasComputeType_t computeType,
                                   cublasGemmAlgo_t /*algo*/) {
  auto max1 = [](int v) { return v > 1 ? v : 1; };
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || (transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
      (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T) || lda < max1(transa == CUBLAS_OP_N ? m : k) ||
      ldb < max1(transb == CUBLAS_OP_N ? k : n) || ldc < max1(m) || alpha == nullptr || beta == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool operand_type = Atype == CUDA_R_16BF || Atype == CUDA_R_16F || Atype == CUDA_R_32F;
  if (!operand_type || Btype != Atype || Ctype != CUDA_R_32F || computeType != CUBLAS_COMPUTE_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const float a_scale = *static_cast<const float*>(alpha), c_scale = *static_cast<const float*>(beta);
  float* c = static_cast<float*>(C);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      float sum = 0.0f;
      for (int l = 0; l < k; ++l) {
        // op(A)[i, l] and op(B)[l, j], read from column-major storage
        const int64_t ia = transa == CUBLAS_OP_N ? i + int64_t{l} * lda : l + int64_t{i} * lda;
        const int64_t ib = transb == CUBLAS_OP_N ? l + int64_t{j} * ldb : j + int64_t{l} * ldb;
        sum = __fadd_rn(sum, __fmul_rn(gaemu::cublas_load(A, Atype, ia), gaemu::cublas_load(B, Btype, ib)));
      }
      float& out = c[i + int64_t{j} * ldc];
      out = c_scale == 0.0f ? __fmul_rn(a_scale, sum) : __fadd_rn(__fmul_rn(a_scale, sum), __fmul_rn(c_scale, out));
    }
  }
  ++handle->gemm_calls;
  return CUBLAS_STATUS_SUCCESS;
}
