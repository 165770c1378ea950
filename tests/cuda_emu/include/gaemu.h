// gaemu: a host emulation of the CUDA execution model, so that CUDA C++ sources (csrc/cuda/kernels/*.cuh) compile
// with g++ and their kernels RUN on CPU memory (tests/cuda_emu; README.md there lists the files and the API).
// Header-only, C++17; included through the shim's cuda_runtime.h.
//
// Execution model
//   * A launch runs synchronously when it is issued (streams are ignored), one block after the other (ascending,
//     or descending with GAENGINE_EMU_ORDER=reverse), under a process-wide lock (one launch at a time).
//   * Each thread of a block is a fiber with its own stack (x86-64: a 20-instruction register switch; elsewhere
//     ucontext). Fibers switch only at barriers: __syncthreads* (all non-exited threads of the block),
//     __syncwarp, the warp shuffles and votes (the lanes of the mask, which must agree on it and exist). The
//     exchange of a shuffle is real: every lane deposits its value, the last to arrive hands each lane the value
//     of its source lane. Reading a lane outside the mask, a lane missing from a warp op, or threads waiting at
//     different barriers (a deadlock on a GPU) abort with a report.
//   * Scheduling is round-robin in thread order (reversed with GAENGINE_EMU_ORDER=reverse): between two
//     barriers a thread runs alone, so a missing barrier shows as stale or poisoned data.
//   * __shared__ variables are function-scope statics: shared by the threads of the running block. Without ASan
//     they live in the section "gaemu_shared", filled with 0xFF bytes (NaN for floats) before every block, so
//     data read before it is written in this block is visible; with ASan they are plain statics with redzones
//     (out-of-bounds accesses are reported), not poisoned. Dynamic shared memory (extern __shared__) is not
//     supported: a launch with shmem > 0 fails with cudaErrorInvalidValue.
//   * Launch configurations are validated as the driver does (grid and block dimensions >= 1, <= 1024 threads
//     per block, grid.y/z <= 65535): an invalid one runs nothing and sets the sticky error cudaGetLastError
//     returns (cudaErrorInvalidConfiguration).
//   * 128-bit vector types (float4, uint4, int4, double2) are alignas(16), 64-bit ones (float2, uint2, int2)
//     alignas(8): built with -fsanitize=alignment, a misaligned vector access through a cast pointer is
//     reported (the device would fault).
//   * Device math (__fadd_rn, __fmaf_rn, __fdiv_rn, __fsqrt_rn, ...) is the exact IEEE fp32 operation on the
//     host (std::fma on floats, IEEE sqrt and division); build without -ffast-math and with -ffp-contract=off.
//
// Environment
//   GAENGINE_EMU_MAX_GRID=N     gaemu::max_grid(limit) returns min(limit, N): tests/cuda_emu/rewrite.py makes
//                               the launchers' grid cap (kernels/common.cuh kMaxBlocks) read it, and
//                               cudaDevAttrMultiProcessorCount returns min(132, N), so grid-stride loops and
//                               several chunks per block run at small sizes
//   GAENGINE_EMU_ORDER=reverse  blocks in descending order, threads scheduled in descending order
//   GAENGINE_EMU_STACK_KB=K     fiber stack size (default 256 KiB; a guard page below each)
//   GAENGINE_EMU_DRIVER_VERSION=N  what cudaDriverGetVersion reports (default 12040: CUDA 12.4)
//
// API for drivers (namespace gaemu)
//   launch(&kernel, "name", grid, block, shmem = 0, stream = 0)(args...)  what rewrite.py turns
//       `kernel<<<grid, block, shmem, stream>>>(args...)` into
//   max_grid(limit)                     the grid cap above
//   stats()                             launches issued, blocks and threads run, largest grid, last kernel
//   set_launch_hook(fn)                 fn(const LaunchInfo&) before each valid launch runs (null: none)
#pragma once

#include <stdarg.h>
#include <math.h>  // ::isfinite, ::isnan, ::pow, ::sqrt as device code calls them unqualified
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gaemu_bits.h"  // gaemu::float_bits, gaemu::bits_float

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define GAEMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GAEMU_ASAN 1
#endif
#endif
#if defined(GAEMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#define GAENGINE_CUDA_EMULATION 1

// ---------------------------------------------------------------------------------------------------------
// qualifiers
// ---------------------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __constant__ static
#if defined(GAEMU_ASAN) || defined(GAEMU_NO_SHARED_POISON)
#define __shared__ static
#else
#define __shared__ static __attribute__((section("gaemu_shared"), aligned(16)))
#endif

// ---------------------------------------------------------------------------------------------------------
// vector types
// ---------------------------------------------------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) double2 {
  double x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
inline double2 make_double2(double x, double y) { return double2{x, y}; }

constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------------------
// runtime API types
// ---------------------------------------------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorNotSupported = 801,
  cudaErrorUnknown = 999,
};
typedef cudaError_t cudaError;
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxBlockDimX = 2,
  cudaDevAttrMaxBlockDimY = 3,
  cudaDevAttrMaxBlockDimZ = 4,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
};
struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int major;
  int minor;
  int multiProcessorCount;
  int maxThreadsPerMultiProcessor;
};
#define cudaStreamNonBlocking 0x01
#define cudaStreamDefault 0x00

namespace gaemu {

// ---------------------------------------------------------------------------------------------------------
// configuration
// ---------------------------------------------------------------------------------------------------------
inline long env_long(const char* name, long fallback) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = strtol(v, &end, 10);
  if (end == v || *end != '\0' || x <= 0) {
    fprintf(stderr, "gaemu: %s=%s is not a positive integer\n", name, v);
    abort();
  }
  return x;
}
inline long grid_cap() {
  static const long cap = env_long("GAENGINE_EMU_MAX_GRID", 0x7FFFFFFFL);
  return cap;
}
// min(limit, GAENGINE_EMU_MAX_GRID): what a launcher's grid cap becomes (tests/cuda_emu/rewrite.py).
template <typename T>
inline T max_grid(T limit) {
  return static_cast<T>(std::min<long long>(static_cast<long long>(limit), grid_cap()));
}
inline bool reverse_order() {
  static const bool reverse = [] {
    const char* v = getenv("GAENGINE_EMU_ORDER");
    if (v == nullptr || *v == '\0' || strcmp(v, "forward") == 0) return false;
    if (strcmp(v, "reverse") == 0) return true;
    fprintf(stderr, "gaemu: GAENGINE_EMU_ORDER=%s: expected forward or reverse\n", v);
    abort();
  }();
  return reverse;
}
inline size_t stack_bytes() {
  static const size_t bytes = static_cast<size_t>(env_long("GAENGINE_EMU_STACK_KB", 256)) * 1024;
  return bytes;
}

struct LaunchInfo {
  const char* kernel;
  dim3 grid, block;
  size_t shmem;
  cudaStream_t stream;
};
struct Stats {
  long long launches = 0;       // valid launches run
  long long blocks = 0;         // blocks run
  long long threads = 0;        // threads run
  long long max_grid_x = 0;     // the largest gridDim.x launched
  const char* last_kernel = nullptr;
};
inline Stats& stats() {
  static Stats s;
  return s;
}
inline void (*&launch_hook())(const LaunchInfo&) {
  static void (*hook)(const LaunchInfo&) = nullptr;
  return hook;
}
inline void set_launch_hook(void (*hook)(const LaunchInfo&)) { launch_hook() = hook; }

inline cudaError_t& last_error() {
  static thread_local cudaError_t err = cudaSuccess;
  return err;
}

// ---------------------------------------------------------------------------------------------------------
// context switch
// ---------------------------------------------------------------------------------------------------------
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};
}  // namespace gaemu
// gaemu_switch_context(save, load): saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save, and resumes the context whose stack pointer is load.
// Weak: every translation unit that includes this header defines it, the linker keeps one.
extern "C" void gaemu_switch_context(void** save, void* load);
asm(R"(
  .text
  .weak gaemu_switch_context
  .type gaemu_switch_context, @function
gaemu_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw (%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size gaemu_switch_context, .-gaemu_switch_context
)");
namespace gaemu {
inline void context_init(Context* c, char* stack, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t{15};
  uint64_t* frame = reinterpret_cast<uint64_t*>(top - 80);
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  memset(frame, 0, 80);
  memcpy(&frame[0], &fpucw, sizeof(fpucw));
  memcpy(reinterpret_cast<char*>(&frame[1]), &mxcsr, sizeof(mxcsr));
  // frame[2..7]: r15 r14 r13 r12 rbx rbp = 0; frame[8]: the address `ret` jumps to; frame[9]: entry's
  // return address (none: entry never returns), which leaves rsp = 8 mod 16 at entry, as after a call.
  frame[8] = reinterpret_cast<uint64_t>(entry);
  c->sp = frame;
}
inline void context_switch(Context* from, Context* to) { gaemu_switch_context(&from->sp, to->sp); }
#else
struct Context {
  ucontext_t uc;
};
inline void context_init(Context* c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, entry, 0);
}
inline void context_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
#endif

// ---------------------------------------------------------------------------------------------------------
// block execution: one fiber per thread
// ---------------------------------------------------------------------------------------------------------
enum class ThreadState : uint8_t { kReady, kAtBlockBarrier, kAtWarpOp, kDone };

struct Thread {
  Context ctx;
  char* stack = nullptr;  // the usable stack (a guard page lies below it)
  ThreadState state = ThreadState::kReady;
  uint3 tid{0, 0, 0};
  // the pending warp op
  uint64_t value = 0;  // deposited
  int src_lane = 0;    // the lane whose value this lane receives
  int pred = 0;
  uint64_t result = 0;  // received
  // the pending block barrier's reductions, valid after release
  int bar_or = 0, bar_and = 0, bar_count = 0;
};

struct Warp {
  uint32_t arrived = 0;  // lanes at the pending op
  uint32_t mask = 0;     // its mask
  const char* op = nullptr;
};

struct Runner {
  Context scheduler;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<char*> stacks;  // reused across blocks and launches
  int n_threads = 0;
  int current = 0;
  int at_barrier = 0, exited = 0;
  int red_or = 0, red_and = 1, red_count = 0;
  void (*invoke)(void*) = nullptr;
  void* invoke_arg = nullptr;
  const char* kernel = "";
  dim3 grid, block;
  uint3 block_idx{0, 0, 0};
#if defined(GAEMU_ASAN)
  const void* scheduler_bottom = nullptr;
  size_t scheduler_size = 0;
#endif
};

inline Runner& runner() {
  static Runner r;  // launches are serialized by launch_mutex()
  return r;
}
inline std::recursive_mutex& launch_mutex() {
  static std::recursive_mutex m;
  return m;
}
inline bool& in_kernel() {
  static thread_local bool inside = false;
  return inside;
}

}  // namespace gaemu

// The built-in variables, set by the scheduler before it resumes a thread.
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};

namespace gaemu {

[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
  Runner& r = runner();
  fprintf(stderr, "gaemu: error in kernel %s, block (%u,%u,%u), thread (%u,%u,%u): ", r.kernel, r.block_idx.x,
          r.block_idx.y, r.block_idx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  va_list args;
  va_start(args, fmt);
  vfprintf(stderr, fmt, args);
  va_end(args);
  fputc('\n', stderr);
  fflush(stderr);
  abort();
}

inline size_t page_bytes() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

inline char* new_stack() {
  const size_t page = page_bytes();
  void* p = mmap(nullptr, stack_bytes() + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    fprintf(stderr, "gaemu: cannot map a fiber stack\n");
    abort();
  }
  mprotect(p, page, PROT_NONE);  // guard: a stack overflow faults instead of writing into a neighbour
  return static_cast<char*>(p) + page;
}

// Switches from the running thread to the scheduler; returns when the scheduler resumes this thread.
inline void yield_to_scheduler(bool finished = false) {
  Runner& r = runner();
  Thread& t = r.threads[r.current];
#if defined(GAEMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, r.scheduler_bottom, r.scheduler_size);
  context_switch(&t.ctx, &r.scheduler);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)finished;
  context_switch(&t.ctx, &r.scheduler);
#endif
}

[[noreturn]] inline void fiber_entry() {
  Runner& r = runner();
#if defined(GAEMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &r.scheduler_bottom, &r.scheduler_size);
#endif
  r.invoke(r.invoke_arg);
  Thread& t = r.threads[r.current];
  t.state = ThreadState::kDone;
  ++r.exited;
  if (r.at_barrier > 0 && r.at_barrier + r.exited == r.n_threads) {  // exited threads count as arrived
    for (Thread& w : r.threads) {
      if (w.state == ThreadState::kAtBlockBarrier) {
        w.state = ThreadState::kReady;
        w.bar_or = r.red_or, w.bar_and = r.red_and, w.bar_count = r.red_count;
      }
    }
    r.at_barrier = 0, r.red_or = 0, r.red_and = 1, r.red_count = 0;
  }
  yield_to_scheduler(true);
  __builtin_unreachable();
}

inline int linear_tid(const Runner& r) { return r.current; }

// __syncthreads / __syncthreads_or / _and / _count: every non-exited thread of the block.
inline void block_barrier(int pred, int* out_or, int* out_and, int* out_count) {
  Runner& r = runner();
  Thread& t = r.threads[r.current];
  r.red_or |= pred != 0;
  r.red_and &= pred != 0;
  r.red_count += pred != 0;
  ++r.at_barrier;
  t.state = ThreadState::kAtBlockBarrier;
  if (r.at_barrier + r.exited == r.n_threads) {
    for (Thread& w : r.threads) {
      if (w.state == ThreadState::kAtBlockBarrier) {
        w.state = ThreadState::kReady;
        w.bar_or = r.red_or, w.bar_and = r.red_and, w.bar_count = r.red_count;
      }
    }
    r.at_barrier = 0, r.red_or = 0, r.red_and = 1, r.red_count = 0;
  } else {
    yield_to_scheduler();
  }
  if (out_or) *out_or = t.bar_or;
  if (out_and) *out_and = t.bar_and;
  if (out_count) *out_count = t.bar_count;
}

// One warp-synchronous op of the running lane: deposits `value` and `pred`, waits for every lane of `mask`,
// returns the value deposited by lane `src_lane` (which must be in the mask); *ballot receives the lanes whose
// pred was non-zero.
inline uint64_t warp_op(const char* op, uint32_t mask, uint64_t value, int src_lane, int pred, uint32_t* ballot) {
  Runner& r = runner();
  const int tid = linear_tid(r), lane = tid % 32, warp = tid / 32;
  Thread& t = r.threads[tid];
  if (((mask >> lane) & 1u) == 0) fail("%s: the calling lane %d is not in the mask 0x%08x", op, lane, mask);
  const int base = warp * 32;
  for (int l = 0; l < 32; ++l) {
    if (((mask >> l) & 1u) == 0) continue;
    if (base + l >= r.n_threads) fail("%s: mask 0x%08x names lane %d, which the block does not have", op, mask, l);
    if (r.threads[base + l].state == ThreadState::kDone) {
      fail("%s: mask 0x%08x names lane %d, which has exited", op, mask, l);
    }
  }
  Warp& w = r.warps[warp];
  if (w.arrived == 0) {
    w.mask = mask;
    w.op = op;
  } else if (w.mask != mask) {
    fail("%s with mask 0x%08x while lanes 0x%08x of the warp wait at %s with mask 0x%08x", op, mask, w.arrived, w.op,
         w.mask);
  } else if (strcmp(w.op, op) != 0) {
    fail("%s while lanes 0x%08x of the warp wait at %s (divergent warp-synchronous ops)", op, w.arrived, w.op);
  }
  t.value = value;
  t.src_lane = src_lane;
  t.pred = pred != 0;
  t.state = ThreadState::kAtWarpOp;
  w.arrived |= 1u << lane;
  if (w.arrived == mask) {
    uint32_t votes = 0;
    for (int l = 0; l < 32; ++l) {
      if ((mask >> l) & 1u) votes |= static_cast<uint32_t>(r.threads[base + l].pred) << l;
    }
    for (int l = 0; l < 32; ++l) {
      if (((mask >> l) & 1u) == 0) continue;
      Thread& x = r.threads[base + l];
      if (((mask >> x.src_lane) & 1u) == 0) {
        fail("%s: lane %d reads lane %d, which is not in the mask 0x%08x (undefined on the device)", op, l,
             x.src_lane, mask);
      }
      x.result = r.threads[base + x.src_lane].value;
      x.pred = static_cast<int>(votes);  // the ballot, handed back through pred
      x.state = ThreadState::kReady;
    }
    w.arrived = 0;
  } else {
    yield_to_scheduler();
  }
  if (ballot) *ballot = static_cast<uint32_t>(t.pred);
  return t.result;
}

[[noreturn]] inline void report_deadlock() {
  Runner& r = runner();
  std::string msg;
  int i = 0;
  while (i < r.n_threads) {  // runs of threads in the same state
    const Thread& t = r.threads[i];
    int j = i + 1;
    while (j < r.n_threads && r.threads[j].state == t.state) ++j;
    char line[256];
    const char* what = t.state == ThreadState::kDone ? "exited"
                       : t.state == ThreadState::kAtBlockBarrier ? "at __syncthreads"
                       : t.state == ThreadState::kAtWarpOp ? r.warps[i / 32].op
                                                          : "ready";
    snprintf(line, sizeof(line), "\n  threads %d..%d: %s", i, j - 1, what);
    msg += line;
    i = j;
  }
  fprintf(stderr,
          "gaemu: deadlock in kernel %s, block (%u,%u,%u): no thread can proceed (threads wait at different "
          "barriers, or a warp op misses lanes):%s\n",
          r.kernel, r.block_idx.x, r.block_idx.y, r.block_idx.z, msg.c_str());
  fflush(stderr);
  abort();
}

extern "C" __attribute__((weak, visibility("hidden"))) char __start_gaemu_shared[];
extern "C" __attribute__((weak, visibility("hidden"))) char __stop_gaemu_shared[];

inline void poison_shared() {
  if (__start_gaemu_shared != nullptr && __stop_gaemu_shared != nullptr) {
    memset(__start_gaemu_shared, 0xFF, static_cast<size_t>(__stop_gaemu_shared - __start_gaemu_shared));
  }
}

// Runs every block of a validated launch; invoke(arg) runs the kernel body in the current thread.
inline void run_grid(const char* kernel, dim3 grid, dim3 block, void (*invoke)(void*), void* arg) {
  Runner& r = runner();
  r.kernel = kernel;
  r.grid = grid;
  r.block = block;
  r.invoke = invoke;
  r.invoke_arg = arg;
  r.n_threads = static_cast<int>(block.x * block.y * block.z);
  r.threads.assign(static_cast<size_t>(r.n_threads), Thread{});
  r.warps.assign(static_cast<size_t>((r.n_threads + 31) / 32), Warp{});
  while (r.stacks.size() < r.threads.size()) r.stacks.push_back(new_stack());
  gridDim = grid;
  blockDim = block;
  const long long n_blocks = static_cast<long long>(grid.x) * grid.y * grid.z;
  const bool reverse = reverse_order();
  const size_t usable = stack_bytes();
  for (long long b = 0; b < n_blocks; ++b) {
    const long long lb = reverse ? n_blocks - 1 - b : b;
    r.block_idx = uint3{static_cast<unsigned>(lb % grid.x), static_cast<unsigned>((lb / grid.x) % grid.y),
                        static_cast<unsigned>(lb / (static_cast<long long>(grid.x) * grid.y))};
    blockIdx = r.block_idx;
    r.at_barrier = 0, r.exited = 0, r.red_or = 0, r.red_and = 1, r.red_count = 0;
    for (Warp& w : r.warps) w = Warp{};
#if !defined(GAEMU_ASAN) && !defined(GAEMU_NO_SHARED_POISON)
    poison_shared();
#endif
    for (int i = 0; i < r.n_threads; ++i) {
      Thread& t = r.threads[static_cast<size_t>(i)];
      t = Thread{};
      t.stack = r.stacks[static_cast<size_t>(i)];
      t.tid = uint3{static_cast<unsigned>(i % block.x), static_cast<unsigned>((i / block.x) % block.y),
                    static_cast<unsigned>(i / (block.x * block.y))};
#if defined(GAEMU_ASAN)
      // The frames a previous fiber left on this stack (it was switched away from, not unwound) keep their
      // redzones: clear them before the stack is reused.
      __asan_unpoison_memory_region(t.stack, usable);
#endif
      context_init(&t.ctx, t.stack, usable, fiber_entry);
    }
    int done = 0;
    while (done < r.n_threads) {
      bool progressed = false;
      for (int k = 0; k < r.n_threads; ++k) {
        const int i = reverse ? r.n_threads - 1 - k : k;
        Thread& t = r.threads[static_cast<size_t>(i)];
        if (t.state != ThreadState::kReady) continue;
        r.current = i;
        threadIdx = t.tid;
#if defined(GAEMU_ASAN)
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, t.stack, usable);
        context_switch(&r.scheduler, &t.ctx);
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
        context_switch(&r.scheduler, &t.ctx);
#endif
        progressed = true;
        if (t.state == ThreadState::kDone) ++done;
      }
      if (!progressed && done < r.n_threads) report_deadlock();
    }
    stats().blocks += 1;
    stats().threads += r.n_threads;
  }
}

inline cudaError_t validate(dim3 grid, dim3 block, size_t shmem) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0) {
    return cudaErrorInvalidConfiguration;
  }
  if (static_cast<unsigned long long>(block.x) * block.y * block.z > 1024 || block.z > 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (grid.x > 0x7FFFFFFFu || grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidConfiguration;
  if (shmem > 0) return cudaErrorInvalidValue;  // dynamic shared memory is not emulated
  return cudaSuccess;
}

// The launch `kernel<<<grid, block, shmem, stream>>>(args...)`, as rewrite.py writes it:
// launch(&kernel, "kernel", grid, block, shmem, stream)(args...).
template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), const char* name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream)
      : kernel_(kernel), info_{name, grid, block, shmem, stream} {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "a kernel launch with the wrong number of arguments");
    // The arguments converted to the kernel's parameter types once, as the driver copies them to the device.
    std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    const cudaError_t err = validate(info_.grid, info_.block, info_.shmem);
    if (err != cudaSuccess) {
      last_error() = err;
      return;
    }
    std::lock_guard<std::recursive_mutex> lock(launch_mutex());
    if (in_kernel()) {
      fprintf(stderr, "gaemu: kernel %s launched from inside a kernel (dynamic parallelism is not emulated)\n",
              info_.kernel);
      abort();
    }
    if (launch_hook() != nullptr) launch_hook()(info_);
    Stats& s = stats();
    s.launches += 1;
    s.max_grid_x = std::max<long long>(s.max_grid_x, info_.grid.x);
    s.last_kernel = info_.kernel;
    Call call{kernel_, &params};
    in_kernel() = true;
    run_grid(info_.kernel, info_.grid, info_.block, &Call::invoke, &call);
    in_kernel() = false;
  }

 private:
  struct Call {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...>* params;
    static void invoke(void* p) {
      Call* c = static_cast<Call*>(p);
      std::apply(c->kernel, *c->params);  // each thread gets its own copy of by-value parameters
    }
  };
  void (*kernel_)(Params...);
  LaunchInfo info_;
};

template <typename... Params>
Launch<Params...> launch(void (*kernel)(Params...), const char* name, dim3 grid, dim3 block, size_t shmem = 0,
                         cudaStream_t stream = nullptr) {
  return Launch<Params...>(kernel, name, grid, block, shmem, stream);
}

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp shuffles move at most 8 bytes");
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
inline T from_bits(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}
inline int lane_id() { return runner().current % 32; }
inline void check_width(const char* op, int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) fail("%s: width %d is not a power of 2 <= 32", op, width);
}
inline void require_kernel(const char* what) {
  if (!in_kernel()) {
    fprintf(stderr, "gaemu: %s called outside a kernel\n", what);
    abort();
  }
}

}  // namespace gaemu

// ---------------------------------------------------------------------------------------------------------
// synchronization, warp ops
// ---------------------------------------------------------------------------------------------------------
inline void __syncthreads() {
  gaemu::require_kernel("__syncthreads");
  gaemu::block_barrier(0, nullptr, nullptr, nullptr);
}
inline int __syncthreads_or(int pred) {
  gaemu::require_kernel("__syncthreads_or");
  int out;
  gaemu::block_barrier(pred, &out, nullptr, nullptr);
  return out;
}
inline int __syncthreads_and(int pred) {
  gaemu::require_kernel("__syncthreads_and");
  int out;
  gaemu::block_barrier(pred, nullptr, &out, nullptr);
  return out;
}
inline int __syncthreads_count(int pred) {
  gaemu::require_kernel("__syncthreads_count");
  int out;
  gaemu::block_barrier(pred, nullptr, nullptr, &out);
  return out;
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  gaemu::require_kernel("__syncwarp");
  gaemu::warp_op("__syncwarp", mask, 0, gaemu::lane_id(), 0, nullptr);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  gaemu::require_kernel("__shfl_sync");
  gaemu::check_width("__shfl_sync", width);
  const int lane = gaemu::lane_id();
  const int src = (lane / width) * width + (src_lane & (width - 1));
  return gaemu::from_bits<T>(gaemu::warp_op("__shfl_sync", mask, gaemu::to_bits(var), src, 0, nullptr));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  gaemu::require_kernel("__shfl_up_sync");
  gaemu::check_width("__shfl_up_sync", width);
  const int lane = gaemu::lane_id();
  const int src = (lane % width) >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
  return gaemu::from_bits<T>(gaemu::warp_op("__shfl_up_sync", mask, gaemu::to_bits(var), src, 0, nullptr));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  gaemu::require_kernel("__shfl_down_sync");
  gaemu::check_width("__shfl_down_sync", width);
  const int lane = gaemu::lane_id();
  const int src = (lane % width) + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane;
  return gaemu::from_bits<T>(gaemu::warp_op("__shfl_down_sync", mask, gaemu::to_bits(var), src, 0, nullptr));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  gaemu::require_kernel("__shfl_xor_sync");
  gaemu::check_width("__shfl_xor_sync", width);
  const int lane = gaemu::lane_id();
  int src = lane ^ lane_mask;
  if (src >= (lane / width + 1) * width || src > 31) src = lane;  // a later group: the lane's own value
  return gaemu::from_bits<T>(gaemu::warp_op("__shfl_xor_sync", mask, gaemu::to_bits(var), src, 0, nullptr));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  gaemu::require_kernel("__ballot_sync");
  uint32_t ballot;
  gaemu::warp_op("__ballot_sync", mask, 0, gaemu::lane_id(), pred, &ballot);
  return ballot;
}
inline int __any_sync(unsigned mask, int pred) {
  gaemu::require_kernel("__any_sync");
  uint32_t ballot;
  gaemu::warp_op("__any_sync", mask, 0, gaemu::lane_id(), pred, &ballot);
  return ballot != 0;
}
inline int __all_sync(unsigned mask, int pred) {
  gaemu::require_kernel("__all_sync");
  uint32_t ballot;
  gaemu::warp_op("__all_sync", mask, 0, gaemu::lane_id(), pred, &ballot);
  return ballot == mask;
}
inline unsigned __activemask() {  // the lanes of the running warp that have not exited
  gaemu::require_kernel("__activemask");
  const gaemu::Runner& r = gaemu::runner();
  const int base = r.current / 32 * 32;
  unsigned mask = 0;
  for (int l = 0; l < 32 && base + l < r.n_threads; ++l) {
    if (r.threads[static_cast<size_t>(base + l)].state != gaemu::ThreadState::kDone) mask |= 1u << l;
  }
  return mask;
}

// Memory fences: blocks run one after the other and threads switch only at barriers, so every access is
// already visible; a missing fence cannot be observed here (README.md: what the emulation cannot prove).
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---------------------------------------------------------------------------------------------------------
// atomics (one launch at a time: plain read-modify-writes, done atomically anyway)
// ---------------------------------------------------------------------------------------------------------
template <typename T>
inline T gaemu_atomic_rmw(T* address, T (*op)(T, T), T val) {
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (!__atomic_compare_exchange_n(address, &old, op(old, val), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* a, float v) {
  static_assert(sizeof(float) == sizeof(uint32_t), "");
  uint32_t* bits = reinterpret_cast<uint32_t*>(a);
  uint32_t old = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
  for (;;) {
    const float sum = gaemu::bits_float(old) + v;  // one IEEE fp32 add (round to nearest even), as the device
    if (__atomic_compare_exchange_n(bits, &old, gaemu::float_bits(sum), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      return gaemu::bits_float(old);
    }
  }
}
inline double atomicAdd(double* a, double v) {
  uint64_t* bits = reinterpret_cast<uint64_t*>(a);
  uint64_t old = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
  for (;;) {
    double o, s;
    memcpy(&o, &old, 8);
    s = o + v;
    uint64_t sb;
    memcpy(&sb, &s, 8);
    if (__atomic_compare_exchange_n(bits, &old, sb, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return o;
  }
}
inline int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicSub(unsigned int* a, unsigned int v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline int atomicExch(int* a, int v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicExch(unsigned int* a, unsigned int v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) {
  return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);
}
inline float atomicExch(float* a, float v) {
  return gaemu::bits_float(__atomic_exchange_n(reinterpret_cast<uint32_t*>(a), gaemu::float_bits(v), __ATOMIC_SEQ_CST));
}
inline int atomicCAS(int* a, int compare, int v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
inline unsigned int atomicCAS(unsigned int* a, unsigned int compare, unsigned int v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long compare, unsigned long long v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
inline int atomicMax(int* a, int v) { return gaemu_atomic_rmw<int>(a, [](int x, int y) { return x > y ? x : y; }, v); }
inline unsigned int atomicMax(unsigned int* a, unsigned int v) {
  return gaemu_atomic_rmw<unsigned int>(a, [](unsigned x, unsigned y) { return x > y ? x : y; }, v);
}
inline int atomicMin(int* a, int v) { return gaemu_atomic_rmw<int>(a, [](int x, int y) { return x < y ? x : y; }, v); }
inline unsigned int atomicMin(unsigned int* a, unsigned int v) {
  return gaemu_atomic_rmw<unsigned int>(a, [](unsigned x, unsigned y) { return x < y ? x : y; }, v);
}
inline int atomicOr(int* a, int v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicOr(unsigned int* a, unsigned int v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline int atomicAnd(int* a, int v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAnd(unsigned int* a, unsigned int v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicInc(unsigned int* a, unsigned int limit) {
  return gaemu_atomic_rmw<unsigned int>(
      a, [](unsigned old, unsigned lim) { return old >= lim ? 0u : old + 1u; }, limit);
}

// ---------------------------------------------------------------------------------------------------------
// IEEE fp32 intrinsics: the exact operation, round to nearest even (-ffp-contract=off, no -ffast-math)
// ---------------------------------------------------------------------------------------------------------
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
// The approximate intrinsics, computed exactly here (the device result may differ in the last bits).
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return std::exp(a); }
inline float __logf(float a) { return std::log(a); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }

inline unsigned int __float_as_uint(float f) { return gaemu::float_bits(f); }
inline float __uint_as_float(unsigned int u) { return gaemu::bits_float(u); }
inline int __float_as_int(float f) { return static_cast<int>(gaemu::float_bits(f)); }
inline float __int_as_float(int i) { return gaemu::bits_float(static_cast<uint32_t>(i)); }
inline long long __double_as_longlong(double d) {
  long long x;
  memcpy(&x, &d, 8);
  return x;
}
inline double __longlong_as_double(long long x) {
  double d;
  memcpy(&d, &x, 8);
  return d;
}
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
  return (x >> 16) | (x << 16);
}

// Cache-hinted loads and stores: plain accesses of the same width (so -fsanitize=alignment checks them).
template <typename T>
inline void __stwb(T* p, T v) { *p = v; }
template <typename T>
inline void __stcg(T* p, T v) { *p = v; }
template <typename T>
inline void __stcs(T* p, T v) { *p = v; }
template <typename T>
inline void __stwt(T* p, T v) { *p = v; }
template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
template <typename T>
inline T __ldca(const T* p) { return *p; }
template <typename T>
inline T __ldcs(const T* p) { return *p; }
template <typename T>
inline T __ldlu(const T* p) { return *p; }
template <typename T>
inline T __ldcv(const T* p) { return *p; }

// ---------------------------------------------------------------------------------------------------------
// runtime API: one device (0), host memory, streams that run everything at once
// ---------------------------------------------------------------------------------------------------------
inline cudaError_t cudaGetLastError() {
  const cudaError_t err = gaemu::last_error();
  gaemu::last_error() = cudaSuccess;
  return err;
}
inline cudaError_t cudaPeekAtLastError() { return gaemu::last_error(); }
inline const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotSupported: return "operation not supported";
    default: return "unknown error";
  }
}
inline const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    default: return "cudaErrorUnknown";
  }
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
// The CUDA version the driver supports, encoded 1000 * major + 10 * minor: 12040 (12.4), or
// GAENGINE_EMU_DRIVER_VERSION=N (an older driver: csrc/cuda/cuda_ops.cu's check_driver_for_multi_tensor).
inline cudaError_t cudaDriverGetVersion(int* version) {
  const char* env = getenv("GAENGINE_EMU_DRIVER_VERSION");
  *version = env != nullptr && *env != '\0' ? atoi(env) : 12040;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
// An sm_90 device with 132 SMs; the SM count capped by GAENGINE_EMU_MAX_GRID (grid = a multiple of SMs).
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxBlockDimX: *value = 1024; break;
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 0x7FFFFFFF; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = gaemu::max_grid(132); break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  memset(prop, 0, sizeof(*prop));
  snprintf(prop->name, sizeof(prop->name), "gaemu (host emulation of an sm_90 device)");
  prop->totalGlobalMem = size_t{80} << 30;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024, prop->maxThreadsDim[1] = 1024, prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7FFFFFFF, prop->maxGridSize[1] = 65535, prop->maxGridSize[2] = 65535;
  prop->major = 9, prop->minor = 0;
  prop->multiProcessorCount = gaemu::max_grid(132);
  prop->maxThreadsPerMultiProcessor = 2048;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = nullptr;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) { return cudaStreamCreate(s); }
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  if (posix_memalign(p, 256, bytes) != 0) return cudaErrorMemoryAllocation;  // cudaMalloc: 256-byte aligned
  return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFree(void* p) {
  free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes) memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t = nullptr) {
  return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (bytes) memset(dst, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t = nullptr) {
  return cudaMemset(dst, value, bytes);
}
