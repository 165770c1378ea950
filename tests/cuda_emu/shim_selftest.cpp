// The shim's own checks (tests/cuda_emu/include): what the kernel driver relies on, against expectations written
// from the CUDA programming guide's definitions, and planted errors that must abort the run.
//
//   shim_selftest [quick|full]   shuffles (down, up, xor, indexed; widths 32 and 8), votes, __syncthreads_or/_and/
//                                _count, a barrier that really waits (shared data written before it, read after),
//                                exited threads at a barrier, a 3-D grid's indices, atomics across blocks, launch
//                                validation, the IEEE intrinsics, and the bf16 / fp16 conversions bitwise against
//                                c10 (every half; floats sampled, or all 2^32 with `full`)
//   shim_selftest plant:NAME     runs one planted error and exits 0 if it was NOT caught (the pytest expects an abort
//                                with the shim's or a sanitizer's message): misaligned-float4 (needs
//                                -fsanitize=alignment), shared-overflow (needs ASan), divergent-warp-op,
//                                shfl-outside-mask, shfl-exited-lane
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

long g_passed = 0, g_failed = 0;

bool check(bool ok, const std::string& name, const std::string& detail = "") {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    printf("FAIL [%s] %s\n", name.c_str(), detail.c_str());
  }
  return ok;
}

#define LAUNCH(kernel, grid, block) ::gaemu::launch(&kernel, #kernel, grid, block, 0, nullptr)

// ---------------------------------------------------------------------------------------------------------
// warp ops: 64 threads, 2 warps; lane value v(t) = 1000 * warp + lane
// ---------------------------------------------------------------------------------------------------------
__global__ void shuffle_kernel(int* out) {  // out: (8, 64)
  const int t = threadIdx.x, lane = t % 32;
  const int v = 1000 * (t / 32) + lane;
  out[0 * 64 + t] = __shfl_down_sync(0xFFFFFFFFu, v, 3);
  out[1 * 64 + t] = __shfl_up_sync(0xFFFFFFFFu, v, 5);
  out[2 * 64 + t] = __shfl_xor_sync(0xFFFFFFFFu, v, 9);
  out[3 * 64 + t] = __shfl_sync(0xFFFFFFFFu, v, (lane * 7) % 32);
  out[4 * 64 + t] = __shfl_down_sync(0xFFFFFFFFu, v, 3, 8);
  out[5 * 64 + t] = __shfl_up_sync(0xFFFFFFFFu, v, 5, 8);
  out[6 * 64 + t] = __shfl_xor_sync(0xFFFFFFFFu, v, 9, 8);
  out[7 * 64 + t] = __shfl_sync(0xFFFFFFFFu, v, lane + 3, 8);
}

int expected_shuffle(int op, int t) {
  const int lane = t % 32, base = 1000 * (t / 32);
  auto value = [&](int l) { return base + l; };
  const int width = op >= 4 ? 8 : 32, sub = lane % width, group = lane - sub;
  switch (op % 4) {
    case 0: return value(sub + 3 < width ? lane + 3 : lane);                  // down: lane + delta within the group
    case 1: return value(sub >= 5 ? lane - 5 : lane);                         // up: lane - delta within the group
    case 2: return value((lane ^ 9) < group + width ? lane ^ 9 : lane);       // xor: a later group gives its own
    default: return value(op == 3 ? (lane * 7) % 32 : group + (lane + 3) % width);  // indexed, modulo width
  }
}

__global__ void vote_kernel(unsigned* out) {  // out: (6, 64)
  const int t = threadIdx.x, lane = t % 32;
  out[0 * 64 + t] = __ballot_sync(0xFFFFFFFFu, lane % 3 == 0);
  out[1 * 64 + t] = static_cast<unsigned>(__any_sync(0xFFFFFFFFu, t == 40));
  out[2 * 64 + t] = static_cast<unsigned>(__all_sync(0xFFFFFFFFu, t < 40));
  out[3 * 64 + t] = static_cast<unsigned>(__syncthreads_or(t == 63));
  out[4 * 64 + t] = static_cast<unsigned>(__syncthreads_and(t != 5));
  out[5 * 64 + t] = static_cast<unsigned>(__syncthreads_count(t % 4 == 1));
}

// A barrier that waits: each thread writes its slot, then reads its neighbour's (poisoned without the wait).
__global__ void barrier_kernel(int* out, int rounds) {
  __shared__ int slots[256];
  const int t = threadIdx.x, n = blockDim.x;
  int acc = 0;
  for (int r = 0; r < rounds; ++r) {
    slots[t] = 7 * r + t;
    __syncthreads();
    acc += slots[(t + 1 + r) % n];
    __syncthreads();
  }
  out[blockIdx.x * n + t] = acc;
}

// Threads past `live` exit at once; the others still meet at barriers.
__global__ void exit_kernel(int* out, int live) {
  __shared__ int total;
  const int t = threadIdx.x;
  if (t >= live) return;
  if (t == 0) total = 0;
  __syncthreads();
  atomicAdd(&total, t);
  __syncthreads();
  out[t] = total;
}

__global__ void index_kernel(int* out) {  // every (block, thread) of a 3-D launch writes its own linear index once
  const long long block = blockIdx.x + gridDim.x * (blockIdx.y + static_cast<long long>(gridDim.y) * blockIdx.z);
  const long long thread = threadIdx.x + blockDim.x * (threadIdx.y + static_cast<long long>(blockDim.y) * threadIdx.z);
  const long long threads = static_cast<long long>(blockDim.x) * blockDim.y * blockDim.z;
  atomicAdd(&out[block * threads + thread], static_cast<int>(block * threads + thread) + 1);
}

__global__ void atomic_kernel(unsigned* counter, float* sum, unsigned* last) {
  atomicAdd(sum, 0.5f);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(counter, 1u) == gridDim.x - 1) *last = blockIdx.x;
  }
}

__global__ void nothing_kernel(int*) {}

void test_warp_ops() {
  std::vector<int> out(8 * 64, -1);
  LAUNCH(shuffle_kernel, 1, 64)(out.data());
  static const char* names[8] = {"down", "up", "xor", "indexed", "down-w8", "up-w8", "xor-w8", "indexed-w8"};
  for (int op = 0; op < 8; ++op) {
    int bad = -1;
    for (int t = 0; t < 64 && bad < 0; ++t) {
      if (out[static_cast<size_t>(op * 64 + t)] != expected_shuffle(op, t)) bad = t;
    }
    check(bad < 0, std::string("shfl/") + names[op],
          bad < 0 ? "" : "thread " + std::to_string(bad) + ": " + std::to_string(out[static_cast<size_t>(op * 64 + bad)]) +
                             " != " + std::to_string(expected_shuffle(op, bad)));
  }
  std::vector<unsigned> votes(6 * 64, 0xDEADu);
  LAUNCH(vote_kernel, 1, 64)(votes.data());
  bool ballot = true, any = true, all = true, bor = true, band = true, bcount = true;
  for (int t = 0; t < 64; ++t) {
    ballot &= votes[static_cast<size_t>(t)] == 0x49249249u;  // lanes 0, 3, 6, ..., 30
    any &= votes[static_cast<size_t>(64 + t)] == (t >= 32 ? 1u : 0u);
    all &= votes[static_cast<size_t>(128 + t)] == (t < 32 ? 1u : 0u);
    bor &= votes[static_cast<size_t>(192 + t)] == 1u;
    band &= votes[static_cast<size_t>(256 + t)] == 0u;
    bcount &= votes[static_cast<size_t>(320 + t)] == 16u;
  }
  check(ballot, "vote/ballot");
  check(any, "vote/any");
  check(all, "vote/all");
  check(bor, "syncthreads_or");
  check(band, "syncthreads_and");
  check(bcount, "syncthreads_count");
}

void test_barriers() {
  for (int n : {32, 96, 256}) {
    std::vector<int> out(static_cast<size_t>(3 * n), -1);
    LAUNCH(barrier_kernel, 3, n)(out.data(), 4);
    bool ok = true;
    for (int b = 0; b < 3; ++b) {
      for (int t = 0; t < n; ++t) {
        int acc = 0;
        for (int r = 0; r < 4; ++r) acc += 7 * r + (t + 1 + r) % n;
        ok &= out[static_cast<size_t>(b * n + t)] == acc;
      }
    }
    check(ok, "syncthreads/waits-n" + std::to_string(n));
  }
  std::vector<int> out(256, -1);
  LAUNCH(exit_kernel, 1, 256)(out.data(), 100);
  bool ok = true;
  for (int t = 0; t < 256; ++t) ok &= out[static_cast<size_t>(t)] == (t < 100 ? 4950 : -1);
  check(ok, "syncthreads/exited-threads-count-as-arrived");
}

void test_indices_and_atomics() {
  const dim3 grid(3, 2, 2), block(8, 4, 2);
  std::vector<int> out(12 * 64, 0);
  LAUNCH(index_kernel, grid, block)(out.data());
  bool ok = true;
  for (size_t i = 0; i < out.size(); ++i) ok &= out[i] == static_cast<int>(i) + 1;
  check(ok, "indices/3d-grid-each-thread-once");
  unsigned counter = 0, last = 12345;
  float sum = 0.0f;
  LAUNCH(atomic_kernel, 7, 64)(&counter, &sum, &last);
  check(counter == 7 && sum == 224.0f && last == 6, "atomics/across-blocks");
}

void test_launch_validation() {
  int x = 0;
  check(cudaGetLastError() == cudaSuccess, "launch/no-error-before");
  LAUNCH(nothing_kernel, 0, 32)(&x);
  check(cudaGetLastError() == cudaErrorInvalidConfiguration, "launch/grid-0-invalid");
  check(cudaGetLastError() == cudaSuccess, "launch/error-cleared-by-get");
  LAUNCH(nothing_kernel, 1, 1025)(&x);
  check(cudaPeekAtLastError() == cudaErrorInvalidConfiguration, "launch/block-1025-invalid");
  check(cudaGetLastError() == cudaErrorInvalidConfiguration, "launch/peek-keeps-error");
  LAUNCH(nothing_kernel, dim3(1, 65536), 32)(&x);
  check(cudaGetLastError() == cudaErrorInvalidConfiguration, "launch/grid-y-65536-invalid");
  check(std::string(cudaGetErrorString(cudaErrorInvalidConfiguration)) == "invalid configuration argument",
        "launch/error-string");
  int sms = 0, dev = -1;
  check(cudaGetDevice(&dev) == cudaSuccess && dev == 0, "device/get");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess &&
            sms == gaemu::max_grid(132),
        "device/sm-count-capped");
}

void test_intrinsics() {
  // a * b + c rounds twice; __fmaf_rn once: 1 + 2^-23 squared - 1 keeps the 2^-46 term only when fused
  const float a = 1.0f + 0x1p-23f, c = -(1.0f + 0x1p-22f);
  check(__fmaf_rn(a, a, c) == 0x1p-46f, "intrinsics/fmaf-fused");
  check(__fmul_rn(a, a) + c == 0.0f, "intrinsics/fmul-then-add-rounds-twice");
  check(__fdiv_rn(1.0f, 3.0f) == 1.0f / 3.0f && __fsqrt_rn(2.0f) == std::sqrt(2.0f), "intrinsics/div-sqrt-ieee");
  check(__float_as_uint(-0.0f) == 0x80000000u && __uint_as_float(0x3F800000u) == 1.0f, "intrinsics/bit-casts");
  float4 v{};
  uint4 u{};
  uint2 w{};
  check(alignof(float4) == 16 && alignof(uint4) == 16 && alignof(uint2) == 8 && sizeof(v) == 16 && sizeof(u) == 16 &&
            sizeof(w) == 8,
        "types/vector-alignment");
}

// bf16 / fp16 conversions against c10 (torch's CPU rounding): bitwise for every non-NaN input; NaN -> a NaN.
bool half_ok(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  const uint16_t mine = __half_as_ushort(__float2half_rn(f));
  if (std::isnan(f)) return (mine & 0x7C00u) == 0x7C00u && (mine & 0x3FFu) != 0;
  return mine == c10::Half(f).x;
}
bool bf16_ok(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  const uint16_t mine = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  if (std::isnan(f)) return (mine & 0x7F80u) == 0x7F80u && (mine & 0x7Fu) != 0;
  return mine == c10::BFloat16(f).x;  // c10's constructor rounds to nearest even
}

void test_conversions(bool full) {
  bool widen = true;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float mine = __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
    c10::Half ref;
    ref.x = static_cast<uint16_t>(h);
    const float theirs = static_cast<float>(ref);
    widen &= memcmp(&mine, &theirs, 4) == 0 || (std::isnan(mine) && std::isnan(theirs));
    widen &= __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(h))) ==
                 c10::detail::f32_from_bits(static_cast<uint16_t>(h)) ||
             std::isnan(c10::detail::f32_from_bits(static_cast<uint16_t>(h)));
  }
  check(widen, "convert/half-and-bf16-to-float-all-65536");
  // every float near the rounding boundaries of both formats, then a stride over all 2^32 (all of them with full)
  uint64_t bad_half = 0, bad_bf16 = 0, tried = 0;
  auto one = [&](uint32_t u) {
    ++tried;
    bad_half += !half_ok(u);
    bad_bf16 += !bf16_ok(u);
  };
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const uint32_t base = sign | (e << 23);
      for (uint32_t m : {0u, 1u, 0xFFFu, 0x1000u, 0x1001u, 0x2000u, 0x3000u, 0x7FFFu, 0x8000u, 0x8001u, 0x18000u,
                         0x7FE000u, 0x7FEFFFu, 0x7FF000u, 0x7FF001u, 0x7FFFFFu}) {
        one(base | m);
      }
    }
  }
  for (uint32_t u = 0x33000000u - 4096; u < 0x38800000u + 4096; u += 1) one(u);  // all fp16 subnormal results
  const uint64_t step = full ? 1 : 9973;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += step) one(static_cast<uint32_t>(u));
  check(bad_half == 0, "convert/float-to-half-rn-vs-c10", std::to_string(bad_half) + " of " + std::to_string(tried));
  check(bad_bf16 == 0, "convert/float-to-bf16-rn-vs-c10", std::to_string(bad_bf16) + " of " + std::to_string(tried));
}

// ---------------------------------------------------------------------------------------------------------
// planted errors
// ---------------------------------------------------------------------------------------------------------
__global__ void misaligned_kernel(const float* x, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(x + 1 + 4 * threadIdx.x);  // 4 bytes past a 16-byte boundary
  out[threadIdx.x] = v.x + v.y + v.z + v.w;
}
__global__ void shared_overflow_kernel(float* out, int n) {
  __shared__ float shared[8];
  float* p = shared;
  p[n] = 1.0f;  // n = 8: one past the end
  out[0] = p[0];
}
__global__ void divergent_warp_op_kernel(int* out) {
  const int t = threadIdx.x;
  if (t < 16) {
    out[t] = __shfl_down_sync(0xFFFFFFFFu, t, 1);  // lanes 16..31 never come: they wait at the block barrier
  } else {
    __syncthreads();
  }
}
__global__ void shfl_outside_mask_kernel(int* out) {
  const int t = threadIdx.x;
  if (t < 16) out[t] = __shfl_down_sync(0x0000FFFFu, t, 8);  // lanes 8..15 read lanes 16..23: not in the mask
}
__global__ void shfl_exited_lane_kernel(int* out) {
  const int t = threadIdx.x;
  if (t == 31) return;
  out[t] = __shfl_down_sync(0xFFFFFFFFu, t, 1);
}

int plant(const std::string& name) {
  alignas(16) static float x[1024 + 8];
  static float outf[256];
  static int outi[64];
  if (name == "misaligned-float4") {
    LAUNCH(misaligned_kernel, 1, 32)(x, outf);
  } else if (name == "shared-overflow") {
    LAUNCH(shared_overflow_kernel, 1, 1)(outf, 8);
  } else if (name == "divergent-warp-op") {
    LAUNCH(divergent_warp_op_kernel, 1, 32)(outi);
  } else if (name == "shfl-outside-mask") {
    LAUNCH(shfl_outside_mask_kernel, 1, 32)(outi);
  } else if (name == "shfl-exited-lane") {
    LAUNCH(shfl_exited_lane_kernel, 1, 32)(outi);
  } else {
    fprintf(stderr, "unknown plant %s\n", name.c_str());
    return 2;
  }
  printf("plant %s: NOT caught\n", name.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "quick";
  if (mode.rfind("plant:", 0) == 0) return plant(mode.substr(6));
  test_warp_ops();
  test_barriers();
  test_indices_and_atomics();
  test_launch_validation();
  test_intrinsics();
  test_conversions(mode == "full");
  if (g_failed) {
    printf("shim: %ld checks passed, %ld FAILED\n", g_passed, g_failed);
    return 1;
  }
  printf("shim: %ld checks passed\n", g_passed);
  return 0;
}
