// CUDA kernels of gaengine's "cuda" backend (torch.ops.gaengine.* on CUDA tensors), with no torch dependency:
// tests/test_nvcc.py compiles them with nvcc for sm_80 and sm_90 on machines without a GPU or a CUDA torch,
// and csrc/cuda/cuda_ops.cu registers them as the ops' CUDA kernels.
//
// Kernels (every pointer is a device pointer; n and offsets are int64: buffers pass 2^31 elements):
//   accumulate_kernel<src_t, kOverwrite, kHasScale>  dst = (0 if overwrite else dst) + float(src) * scale
//   l2norm_sq_partial_kernel<src_t>                  per-block sum of squares + non-finite flag (stage 1)
//   l2norm_sq_finalize_kernel                        one block sums the partials in a fixed order (stage 2)
//   scale_kernel                                     x *= *coef (coef read on the device)
//   accumulate_bucket_kernel<kPartials>              a bucket of sources into slices of dst, one launch (+ the
//                                                    per-chunk free-norm partials of the values written)
//   optimizer_multi_kernel<F, param_t>               a fused elementwise optimizer step (functor F, csrc/optim/) of
//                                                    a list of parameters, one launch: param_t float (fp32 masters,
//                                                    fp32 states, an optional bf16 | fp16 model write) or bf16 |
//                                                    fp16 (in place, states in that dtype); AdamW's is adamw_multi
// and a host launcher for each (launch_accumulate, launch_l2norm_sq, launch_scale, launch_accumulate_bucket,
// launch_sum_partials, launch_optimizer_multi<F, param_t>, launch_adamw_multi<param_t>) that returns the launch's cudaError_t. The two multi-tensor kernels
// take their tensor list by value as the kernel-parameter struct (kernels/common.cuh, "Multi-tensor kernels").
//
// Memory access: 128-bit loads and stores (float4 for fp32, uint4 = eight bf16 | fp16 for 16-bit sources)
// over the largest prefix of whole vectors when every pointer is 16-byte aligned (gaengine/buffer.py starts
// each parameter at a multiple of ALIGN_NUMEL = 64 elements; fresh gradients are 512-byte aligned), then a
// scalar tail; unaligned pointers take the scalar loop throughout. The choice is made in the kernel from the
// pointer values (uniform per launch; per chunk in the multi-tensor kernels), so the host needs no knowledge of
// alignment. (The multi-tensor AdamW moves 4 elements a step: float4 for its fp32 streams, 64-bit accesses for
// bf16 | fp16 gradients, model parameters and the p, m, v of a bf16 | fp16 param_t.)
//
// Numerics, the contract of gaengine.backends (the Triton kernels round the same way):
//   accumulate, unscaled:   one IEEE fp32 add (__fadd_rn), bitwise equal to torch's dst.add_(src);
//                           overwrite is an exact widening copy.
//   accumulate, scaled:     one fused multiply-add (__fmaf_rn: one rounding, within 0.5 fp32 ulp), or one
//                           multiply (__fmul_rn) when overwriting. scale is a float argument, or read from
//                           scale_ptr (a 0-d fp32 device tensor) when scale_ptr is not null.
//   l2norm_sq:              fp32 squares fused into per-thread sums (__fmaf_rn), then fixed-order trees: each
//                           block covers a fixed chunk of kNormChunkNumel elements, so the bits depend on n
//                           only (not on the GPU, the grid or a run). found_inf: 1.0 if an element is inf or
//                           NaN, else 0.0 (a finite sum that overflows fp32 is not flagged).
//   scale:                  one fp32 multiply (__fmul_rn), bitwise equal to torch's x.mul_(coef).
//   accumulate_bucket:      unscaled accumulate / overwrite as above, per source; partials as l2norm_sq's stage 1
//                           over kBucketChunkNumel-element chunks of each source (of the values written).
//   adamw_multi:            csrc/adamw_kernels.h's fp32 operations exactly (kernels/adamw.cuh).
//
// This header is the umbrella: it includes every family of csrc/cuda/kernels/, which match the Triton
// families of kernels/*.py (each a self-contained header over common.cuh):
//   kernels/common.cuh      kThreads, kMaxBlocks, to_float, aligned16, load_vector, block_sum / block_any,
//                           grid sizing, and the multi-tensor ground (kMaxKernelParamBytes, kDtype*, find_tensor)
//   kernels/accumulate.cuh  accumulate_kernel + launch_accumulate                    (kernels/accumulate.py)
//   kernels/norm.cuh        l2norm_sq_{partial,finalize}_kernel + launch_l2norm_sq,  (kernels/norm.py)
//                           launch_sum_partials (the bucket's free norm, stage 2)
//   kernels/scale.cuh       scale_kernel + launch_scale                              (kernels/scale.py)
//   kernels/bucket.cuh      accumulate_bucket_kernel + launch_accumulate_bucket      (kernels/bucket.py)
//   kernels/optimizer.cuh   optimizer_multi_kernel + launch_optimizer_multi          (any functor of csrc/optim/)
//   kernels/adamw.cuh       launch_adamw_multi: the launcher over the AdamW functor  (kernels/adamw.py)
#pragma once

#include "kernels/common.cuh"
#include "kernels/accumulate.cuh"
#include "kernels/norm.cuh"
#include "kernels/scale.cuh"
#include "kernels/bucket.cuh"
#include "kernels/optimizer.cuh"
#include "kernels/adamw.cuh"
