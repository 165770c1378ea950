// The CUDA kernels of csrc/cuda/kernels.cuh, executed on CPU under the tests/cuda_emu shim: every kernel through
// its host launcher, against independent references:
//   * bitwise: csrc/cpu_kernels.h and csrc/adamw_kernels.h (portable::, the CPU backend's specification), or a
//     documented host oracle where the CUDA contract names the rounding (the scaled accumulate is one fused
//     multiply-add: std::fma on floats);
//   * bitwise: a host replay of the documented reduction order of the norms (per-thread __fmaf_rn sums over the
//     kernel's fixed chunks and strides, the warp shuffle-down tree, warp 0 over the warps' sums; the finalize's
//     per-thread fp32 sums over 1024 threads, then the same tree);
//   * within tests/tolerances.py's budgets of an fp64 oracle (sum_sq_rtol for the norms, 1 fp32 ulp for the
//     scaled accumulate, the unscaled accumulate rounded once from fp64).
// Build: tests/cuda_emu/build.py (the rewritten kernels.cuh first on the include path, the shim's include dir,
// torch's include dir for c10/util/BFloat16.h and Half.h). Run: run_kernels [quick|reduced|full]
//   reduced  every kernel and dtype mode, fewer sizes (the sanitizer build)
//   quick    every case below but the > 2^31 one (CI)
//   full     quick + a bucket whose dst slices lie past 2^31 elements (a MAP_NORESERVE buffer of 8 GiB, only the
//            touched pages backed)
// Prints "FAIL [check] detail" per failed check and "emu: N checks passed" (exit 0) or "emu: N checks passed,
// F FAILED" (exit 1).

#include "kernels.cuh"  // the rewritten copy (tests/cuda_emu/rewrite.py)

#include <sys/mman.h>

#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "adamw_kernels.h"
#include "cpu_kernels.h"

namespace g = gaengine::cuda;
namespace cpu = gaengine::portable;

namespace {

// ---------------------------------------------------------------------------------------------------------
// checks
// ---------------------------------------------------------------------------------------------------------
long g_passed = 0, g_failed = 0;
std::string g_first_failure;

__attribute__((format(printf, 3, 4))) bool check(bool ok, const std::string& name, const char* fmt = "", ...) {
  if (ok) {
    ++g_passed;
    return true;
  }
  ++g_failed;
  char detail[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(detail, sizeof(detail), fmt, args);
  va_end(args);
  if (g_failed <= 30) fprintf(stdout, "FAIL [%s] %s\n", name.c_str(), detail);
  if (g_first_failure.empty()) g_first_failure = name;
  fflush(stdout);
  return false;
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list args;
  va_start(args, f);
  vsnprintf(buf, sizeof(buf), f, args);
  va_end(args);
  return buf;
}

void check_launch(cudaError_t err, const std::string& name) {
  check(err == cudaSuccess, name + "/launch", "launcher returned %s", cudaGetErrorString(err));
  const cudaError_t sticky = cudaGetLastError();
  check(sticky == cudaSuccess, name + "/launch", "cudaGetLastError after the launch: %s", cudaGetErrorString(sticky));
}

uint32_t bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

// Bitwise equality of n fp32 values (also tells NaN payloads and the sign of zero apart).
bool same_bits(const float* a, const float* b, int64_t n, const std::string& name) {
  for (int64_t i = 0; i < n; ++i) {
    if (bits(a[i]) != bits(b[i])) {
      int64_t count = 0;
      for (int64_t j = i; j < n; ++j) count += bits(a[j]) != bits(b[j]);
      return check(false, name, "not bitwise equal at %" PRId64 ": %.9g (0x%08x) != %.9g (0x%08x), %" PRId64 " of %" PRId64 " differ",
                   i, a[i], bits(a[i]), b[i], bits(b[i]), count, n);
    }
  }
  return check(true, name);
}
bool same_bits16(const uint16_t* a, const uint16_t* b, int64_t n, const std::string& name) {
  for (int64_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) {
      return check(false, name, "not bitwise equal at %" PRId64 ": 0x%04x != 0x%04x", i, a[i], b[i]);
    }
  }
  return check(true, name);
}

// tests/tolerances.py
constexpr double kFp32Eps = 1.0 / (1 << 24);
double sum_sq_rtol(int64_t n) { return 4 * kFp32Eps * std::max(1.0, std::sqrt(static_cast<double>(n))) + 1e-7; }
double fp32_ulp(double x) {
  const double ax = std::max(std::fabs(x), static_cast<double>(std::numeric_limits<float>::min()));
  return std::exp2(std::floor(std::log2(ax)) - 23);
}

// ---------------------------------------------------------------------------------------------------------
// data
// ---------------------------------------------------------------------------------------------------------
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }
  double normal() {
    const double u = std::max(uniform(), 1e-300), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
};

// A gradient-like value: normal, spanning 5 decades over the tensor (as tests/test_nvcc.py's _grad), with
// occasional zeros of both signs, fp32 subnormals and values near the fp16 range's top.
float grad_value(Rng& rng, int64_t i, int64_t n) {
  if ((rng.next() & 63) == 0) {
    static const float specials[] = {0.0f, -0.0f, 1e-40f, -2.5e-39f, 65504.0f, -6e4f, 1e-7f, -3.0e4f};
    return specials[rng.next() % 8];
  }
  const double decades = n > 1 ? -3.0 + 5.0 * static_cast<double>(i) / static_cast<double>(n - 1) : 0.0;
  return static_cast<float>(rng.normal() * std::pow(10.0, decades));
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// An allocation of exactly `offset + n` elements (ASan sees the true end), 256-byte aligned, the view at offset.
template <typename T>
struct Buffer {
  T* base = nullptr;
  T* p = nullptr;
  int64_t n = 0;
  Buffer(int64_t numel, int64_t offset = 0) : n(numel) {
    void* mem = nullptr;
    if (posix_memalign(&mem, 256, static_cast<size_t>(numel + offset) * sizeof(T) + (numel + offset == 0)) != 0) abort();
    base = static_cast<T*>(mem);
    p = base + offset;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { free(base); }
  T& operator[](int64_t i) { return p[i]; }
};

// dtype k: the device type, the CPU reference's type (the same 2 bytes), a name.
enum Dtype { kFp32 = 0, kBf16 = 1, kFp16 = 2 };
const char* dtype_name(int d) { return d == kFp32 ? "fp32" : d == kBf16 ? "bf16" : "fp16"; }
template <int D>
struct Types;
template <>
struct Types<kFp32> {
  using dev = float;
  using ref = float;
};
template <>
struct Types<kBf16> {
  using dev = __nv_bfloat16;
  using ref = c10::BFloat16;
};
template <>
struct Types<kFp16> {
  using dev = __half;
  using ref = c10::Half;
};
static_assert(sizeof(__nv_bfloat16) == sizeof(c10::BFloat16) && sizeof(__half) == sizeof(c10::Half), "");

// A source tensor of dtype D: stored as the reference type (c10 rounds fp32 to nearest even), read by the
// kernel through the device type.
template <int D>
struct Source {
  using ref_t = typename Types<D>::ref;
  using dev_t = typename Types<D>::dev;
  Buffer<ref_t> buf;
  Source(int64_t n, int64_t offset, Rng& rng) : buf(n, offset) {
    for (int64_t i = 0; i < n; ++i) buf[i] = ref_t(grad_value(rng, i, n));
  }
  const ref_t* ref() const { return buf.p; }
  const dev_t* dev() const { return reinterpret_cast<const dev_t*>(buf.p); }
  float at(int64_t i) const { return cpu::to_float(buf.p[i]); }
};

// ---------------------------------------------------------------------------------------------------------
// host replays of the kernels' reduction order (kernels.cuh block_sum, l2norm_sq_*_kernel, accumulate_chunk)
// ---------------------------------------------------------------------------------------------------------
// __shfl_down_sync tree over 32 lanes (offsets 16, 8, 4, 2, 1; a lane past the warp reads its own value): lane 0.
float warp_tree(float v[32]) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    float next[32];
    for (int lane = 0; lane < 32; ++lane) next[lane] = v[lane] + (lane + offset < 32 ? v[lane + offset] : v[lane]);
    memcpy(v, next, sizeof(next));
  }
  return v[0];
}
// block_sum: each warp's tree, then warp 0's tree over the warps' sums (lanes past the warp count: 0).
float block_tree(const std::vector<float>& per_thread) {
  const int n_warps = static_cast<int>(per_thread.size()) / 32;
  std::vector<float> warp_sums(static_cast<size_t>(n_warps));
  for (int w = 0; w < n_warps; ++w) {
    float v[32];
    for (int l = 0; l < 32; ++l) v[l] = per_thread[static_cast<size_t>(w * 32 + l)];
    warp_sums[static_cast<size_t>(w)] = warp_tree(v);
  }
  float v[32];
  for (int l = 0; l < 32; ++l) v[l] = l < n_warps ? warp_sums[static_cast<size_t>(l)] : 0.0f;
  return warp_tree(v);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Sum of squares of values(i), i in [0, n), as one block of kThreads threads sums them with kElems-wide vectors
// when `vector_path` (threads take vectors t, t + kThreads, ...; values in order within a vector), then a scalar
// tail (elements vector_end + t, + kThreads, ...), then block_tree.
template <typename F>
float replay_block_sum_sq(int64_t n, int elems, bool vector_path, F values) {
  std::vector<float> sums(g::kThreads, 0.0f);
  int64_t scalar_start = 0;
  if (vector_path) {
    const int64_t vector_end = n / elems * elems;
    for (int t = 0; t < g::kThreads; ++t) {
      for (int64_t i = static_cast<int64_t>(t) * elems; i < vector_end; i += static_cast<int64_t>(g::kThreads) * elems) {
        for (int k = 0; k < elems; ++k) {
          const float v = values(i + k);
          sums[static_cast<size_t>(t)] = std::fma(v, v, sums[static_cast<size_t>(t)]);
        }
      }
    }
    scalar_start = vector_end;
  }
  for (int t = 0; t < g::kThreads; ++t) {
    for (int64_t i = scalar_start + t; i < n; i += g::kThreads) {
      const float v = values(i);
      sums[static_cast<size_t>(t)] = std::fma(v, v, sums[static_cast<size_t>(t)]);
    }
  }
  return block_tree(sums);
}

// l2norm_sq_finalize_kernel / launch_sum_partials: thread t sums row0[t], row0[t + 1024], ... in fp32, then the tree.
float replay_finalize(const float* row0, int64_t n) {
  std::vector<float> sums(g::kFinalizeThreads, 0.0f);
  for (int t = 0; t < g::kFinalizeThreads; ++t) {
    for (int64_t i = t; i < n; i += g::kFinalizeThreads) sums[static_cast<size_t>(t)] += row0[i];
  }
  return block_tree(sums);
}

// ---------------------------------------------------------------------------------------------------------
// accumulate
// ---------------------------------------------------------------------------------------------------------
struct Alignment {
  int64_t dst_offset, src_offset;
  const char* name;
};
const Alignment kAlignments[] = {{0, 0, "aligned"}, {1, 1, "unaligned"}, {0, 1, "src-unaligned"}};

template <int D>
void test_accumulate(int64_t n, const Alignment& a, uint64_t seed) {
  Rng rng(seed);
  Source<D> src(n, a.src_offset, rng);
  Buffer<float> init(n);
  for (int64_t i = 0; i < n; ++i) init[i] = static_cast<float>(rng.normal() * 10.0);
  const float kScale = 0.3f;  // as tests/test_nvcc.py: an fp32 scale that is not a power of 2
  Buffer<float> scale_dev(1);
  *scale_dev.p = 1.7f;
  for (int mode = 0; mode < 6; ++mode) {
    // 0 add, 1 overwrite, 2 add scale arg, 3 overwrite scale arg, 4 add *scale_ptr, 5 overwrite *scale_ptr
    const bool overwrite = mode % 2 == 1;
    const bool by_ptr = mode >= 4;
    const float s = mode < 2 ? 1.0f : by_ptr ? *scale_dev.p : kScale;
    const std::string name = fmt("accumulate/%s/%s%s/n%" PRId64 "/%s", dtype_name(D), overwrite ? "overwrite" : "add",
                                 mode < 2 ? "" : by_ptr ? "-scale_ptr" : "-scaled", n, a.name);
    Buffer<float> dst(n, a.dst_offset);
    for (int64_t i = 0; i < n; ++i) dst[i] = overwrite ? kNaN : init[i];  // overwrite never reads dst
    // by_ptr: the float argument must be ignored (7.0 would show)
    check_launch(g::launch_accumulate(dst.p, src.dev(), n, by_ptr ? 7.0f : s, by_ptr ? scale_dev.p : nullptr,
                                      overwrite, nullptr),
                 name);
    std::vector<float> expected(static_cast<size_t>(n));
    if (mode < 2 || overwrite) {
      // The CPU kernel: dst + float(src) (one fp32 add), float(src), or float(double(src) * s): the exact
      // product of two fp32 rounded once, which is __fmul_rn's result.
      for (int64_t i = 0; i < n; ++i) expected[static_cast<size_t>(i)] = init[i];
      cpu::accumulate(expected.data(), src.ref(), n, static_cast<double>(s), overwrite);
      same_bits(dst.p, expected.data(), n, name + "/vs-cpu-kernel");
    } else {
      // One fused multiply-add (the contract's __fmaf_rn): std::fma on floats. The CPU kernel's fp64 path
      // may round differently by one ulp; the fp64 oracle's budget below holds for both.
      for (int64_t i = 0; i < n; ++i) expected[static_cast<size_t>(i)] = std::fma(src.at(i), s, init[i]);
      same_bits(dst.p, expected.data(), n, name + "/vs-fmaf");
    }
    if (mode >= 2) {  // tests/tolerances.py assert_within_ulp: 1 ulp of max(|src * s|, |exact|)
      int64_t bad = -1;
      for (int64_t i = 0; i < n && bad < 0; ++i) {
        const double product = static_cast<double>(src.at(i)) * s;
        const double exact = (overwrite ? 0.0 : static_cast<double>(init[i])) + product;
        if (std::fabs(static_cast<double>(dst[i]) - exact) > fp32_ulp(std::max(std::fabs(product), std::fabs(exact)))) {
          bad = i;
        }
      }
      check(bad < 0, name + "/fp64-1ulp", "at %" PRId64, bad);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// l2norm_sq
// ---------------------------------------------------------------------------------------------------------
template <int D>
void test_l2norm(int64_t n, int64_t offset, uint64_t seed) {
  Rng rng(seed);
  Source<D> x(n, offset, rng);
  const std::string name = fmt("l2norm_sq/%s/n%" PRId64 "/%s", dtype_name(D), n, offset ? "unaligned" : "aligned");
  const int64_t np = g::l2norm_sq_num_partials(n);
  check(np == (n + 16383) / 16384, name + "/num-partials");
  Buffer<float> partials(2 * np);
  for (int64_t i = 0; i < 2 * np; ++i) partials[i] = kNaN;
  Buffer<float> out(2);
  out[0] = out[1] = kNaN;
  check_launch(g::launch_l2norm_sq(x.dev(), n, np ? partials.p : nullptr, out.p, nullptr), name);
  // replay: one block per 16384-element chunk; the vector path when x is 16-byte aligned
  constexpr int kElems = g::Vector<typename Types<D>::dev>::kElems;
  std::vector<float> row0(static_cast<size_t>(np));
  double exact = 0.0;
  for (int64_t c = 0; c < np; ++c) {
    const int64_t begin = c * g::kNormChunkNumel, end = std::min(n, begin + g::kNormChunkNumel);
    row0[static_cast<size_t>(c)] =
        replay_block_sum_sq(end - begin, kElems, aligned16(x.dev()), [&](int64_t i) { return x.at(begin + i); });
  }
  for (int64_t i = 0; i < n; ++i) exact += static_cast<double>(x.at(i)) * x.at(i);
  same_bits(partials.p, row0.data(), np, name + "/partials-replay");
  const float expected = replay_finalize(row0.data(), np);
  same_bits(out.p, &expected, 1, name + "/sum-replay");
  check(std::fabs(out[0] - exact) <= sum_sq_rtol(n) * exact, name + "/fp64-rtol", "%.9g vs exact %.17g", out[0], exact);
  check(out[1] == 0.0f, name + "/found_inf-clear", "found_inf %g", out[1]);
  bool flags_clear = true;
  for (int64_t c = 0; c < np; ++c) flags_clear &= partials[np + c] == 0.0f;
  check(flags_clear, name + "/partial-flags-clear");
  if (n == 0) return;
  // one non-finite value, in the last chunk: flagged
  using ref_t = typename Types<D>::ref;
  const int64_t at = n - 1 - (n / 3) % 7 > 0 ? n - 1 - (n / 3) % 7 : 0;
  const ref_t saved = x.buf[at];
  x.buf[at] = ref_t(at % 2 ? std::numeric_limits<float>::infinity() : kNaN);
  check_launch(g::launch_l2norm_sq(x.dev(), n, partials.p, out.p, nullptr), name + "/non-finite");
  check(out[1] == 1.0f, name + "/found_inf-set", "found_inf %g with x[%" PRId64 "] non-finite", out[1], at);
  check(partials[np + at / g::kNormChunkNumel] == 1.0f, name + "/partial-flag-set");
  x.buf[at] = saved;
}

// ---------------------------------------------------------------------------------------------------------
// scale
// ---------------------------------------------------------------------------------------------------------
void test_scale(int64_t n, int64_t offset, uint64_t seed) {
  Rng rng(seed);
  const std::string name = fmt("scale/n%" PRId64 "/%s", n, offset ? "unaligned" : "aligned");
  Buffer<float> x(n, offset), coef(1);
  std::vector<float> expected(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = expected[static_cast<size_t>(i)] = grad_value(rng, i, n);
  coef[0] = 0.3f;
  check_launch(g::launch_scale(x.p, n, coef.p, nullptr), name);
  cpu::scale(expected.data(), n, coef[0]);
  same_bits(x.p, expected.data(), n, name + "/vs-cpu-kernel");
}

// ---------------------------------------------------------------------------------------------------------
// bucket accumulate, sum_partials
// ---------------------------------------------------------------------------------------------------------
// A type-erased source of any dtype.
struct AnySource {
  int dtype;
  int64_t n;
  std::vector<uint8_t> storage;  // offset + n elements, + 16 bytes of slack for the alignment shift
  uint8_t* data;                 // the view
  AnySource(int d, int64_t numel, bool unaligned, Rng& rng) : dtype(d), n(numel) {
    const size_t es = d == kFp32 ? 4 : 2;
    storage.resize((static_cast<size_t>(n) + 1) * es + 32);
    uintptr_t p = (reinterpret_cast<uintptr_t>(storage.data()) + 15) & ~uintptr_t{15};
    data = reinterpret_cast<uint8_t*>(p) + (unaligned ? es : 0);
    for (int64_t i = 0; i < n; ++i) set(i, grad_value(rng, i, n));
  }
  void set(int64_t i, float v) {
    if (dtype == kFp32) reinterpret_cast<float*>(data)[i] = v;
    if (dtype == kBf16) reinterpret_cast<c10::BFloat16*>(data)[i] = c10::BFloat16(v);
    if (dtype == kFp16) reinterpret_cast<c10::Half*>(data)[i] = c10::Half(v);
  }
  float at(int64_t i) const {
    if (dtype == kFp32) return reinterpret_cast<const float*>(data)[i];
    if (dtype == kBf16) return cpu::to_float(reinterpret_cast<const c10::BFloat16*>(data)[i]);
    return cpu::to_float(reinterpret_cast<const c10::Half*>(data)[i]);
  }
  // the CPU kernel's accumulate into dst (n elements)
  void cpu_accumulate(float* dst, bool overwrite) const {
    if (dtype == kFp32) cpu::accumulate(dst, reinterpret_cast<const float*>(data), n, 1.0, overwrite);
    if (dtype == kBf16) cpu::accumulate(dst, reinterpret_cast<const c10::BFloat16*>(data), n, 1.0, overwrite);
    if (dtype == kFp16) cpu::accumulate(dst, reinterpret_cast<const c10::Half*>(data), n, 1.0, overwrite);
  }
  int elems() const { return dtype == kFp32 ? 4 : 8; }
};

struct BucketCase {
  std::vector<int64_t> numels;
  std::vector<int> dtypes;
  std::vector<int> overwrite;
  bool dst_unaligned = false;  // slices at 64k + 1 elements (else at multiples of 64)
  bool src_unaligned = false;  // sources one element past a 16-byte boundary
  int64_t partials_extra = 0;  // > 0: the partials tables are column slices (starting at column 3) of wider ones
  bool partials = true;
  bool source_partials = false;  // the sources' partials too, in the same launch
  int64_t dst_base = 0;        // element offset of the first slice (past 2^31 for the sparse case)
};

// One partials table of a bucket launch (table: the whole, possibly wider, table as allocated): per chunk, the
// replay of the kernel's order over values(i, k) (source i's k-th value: written or read), the non-finite flags, the
// fp64 oracle within budget, nothing written outside the column slice, and launch_sum_partials over it.
template <typename F>
void check_bucket_partials(const BucketCase& bc, const float* dst, const std::vector<AnySource>& srcs,
                           const std::vector<int64_t>& offsets, const std::vector<float>& table, int64_t n_chunks,
                           const std::string& name, F values) {
  const int n = static_cast<int>(srcs.size());
  const int64_t width = n_chunks + bc.partials_extra, first = bc.partials_extra ? 3 : 0;
  const float* partials = table.data() + first;
  const int64_t stride = bc.partials_extra ? width : n_chunks;
  std::vector<float> row0, row1;
  std::vector<double> exact, underflow;
  for (int i = 0; i < n; ++i) {
    const AnySource& s = srcs[static_cast<size_t>(i)];
    const int64_t o = offsets[static_cast<size_t>(i)];
    for (int64_t begin = 0; begin < s.n; begin += g::kBucketChunkNumel) {
      const int64_t len = std::min<int64_t>(g::kBucketChunkNumel, s.n - begin);
      const uint8_t* sp = s.data + begin * (s.dtype == kFp32 ? 4 : 2);
      const bool vector_path = aligned16(dst + o + begin) && aligned16(sp);
      auto value = [&](int64_t k) { return values(i, begin + k); };
      row0.push_back(replay_block_sum_sq(len, s.elems(), vector_path, value));
      double e = 0.0, u = 0.0;
      bool found = false;
      for (int64_t k = 0; k < len; ++k) {
        const float v = value(k);
        e += static_cast<double>(v) * v;
        found |= !std::isfinite(v);
        // a square below fp32's normal range is rounded to a multiple of 2^-149 (a source's special values:
        // 1e-40): up to half of that absolute, on top of the relative budget, per such fma
        if (static_cast<double>(v) * v < 0x1p-126) u += 0x1p-150;
      }
      exact.push_back(e);
      underflow.push_back(u);
      row1.push_back(found ? 1.0f : 0.0f);
    }
  }
  same_bits(partials, row0.data(), n_chunks, name + "-replay");
  same_bits(partials + stride, row1.data(), n_chunks, name + "/flags");
  {
    int64_t bad = -1;
    for (int64_t c = 0; c < n_chunks && bad < 0; ++c) {
      const double budget = sum_sq_rtol(g::kBucketChunkNumel) * exact[static_cast<size_t>(c)] + underflow[static_cast<size_t>(c)];
      if (!(std::fabs(partials[c] - exact[static_cast<size_t>(c)]) <= budget)) bad = c;
    }
    check(bad < 0, name + "/fp64-rtol", "column %" PRId64, bad);
  }
  if (bc.partials_extra) {  // nothing outside the column slice
    bool untouched = true;
    for (int64_t r = 0; r < 2; ++r) {
      for (int64_t c = 0; c < width; ++c) {
        if (c >= first && c < first + n_chunks) continue;
        untouched &= std::isnan(table[static_cast<size_t>(r * width + c)]);
      }
    }
    check(untouched, name + "/outside-slice-untouched");
    return;  // launch_sum_partials takes contiguous partials
  }
  Buffer<float> out(2);
  out[0] = out[1] = kNaN;
  check_launch(g::launch_sum_partials(partials, n_chunks, out.p, out.p + 1, nullptr), name + "/sum_partials");
  const float expected_sum = replay_finalize(row0.data(), n_chunks);
  same_bits(out.p, &expected_sum, 1, name + "/sum_partials-replay");
  double total = 0.0;
  bool any = false;
  for (int64_t c = 0; c < n_chunks; ++c) {
    total += exact[static_cast<size_t>(c)];
    any |= row1[static_cast<size_t>(c)] != 0.0f;
  }
  int64_t numel = 0;
  for (int64_t x : bc.numels) numel += x;
  check(std::fabs(out[0] - total) <= sum_sq_rtol(numel) * total, name + "/sum_partials-fp64-rtol", "%.9g vs %.17g",
        out[0], total);
  check(out[1] == (any ? 1.0f : 0.0f), name + "/sum_partials-found_inf");
}

// dst: `total` floats at `dst` (poisoned NaN except the add slices); returns false when it could not run.
void run_bucket(const BucketCase& bc, const std::string& name, uint64_t seed, float* dst, int64_t dst_numel) {
  Rng rng(seed);
  const int n = static_cast<int>(bc.numels.size());
  std::vector<AnySource> srcs;
  srcs.reserve(static_cast<size_t>(n));
  std::vector<g::BucketEntry> entries(static_cast<size_t>(n));
  std::vector<int64_t> offsets(static_cast<size_t>(n));
  int64_t cursor = bc.dst_base;
  for (int i = 0; i < n; ++i) {
    srcs.emplace_back(bc.dtypes[static_cast<size_t>(i)], bc.numels[static_cast<size_t>(i)], bc.src_unaligned, rng);
    offsets[static_cast<size_t>(i)] = cursor + (bc.dst_unaligned ? 1 : 0);
    cursor += (bc.numels[static_cast<size_t>(i)] + 1 + 63) / 64 * 64;  // gaengine/buffer.py: ALIGN_NUMEL = 64, a gap
  }
  if (cursor > dst_numel) {
    check(false, name + "/setup", "the bucket needs %" PRId64 " elements, dst has %" PRId64, cursor, dst_numel);
    return;
  }
  // dst: NaN everywhere the bucket spans, data in the slices to add into (reads of the rest show as NaN)
  for (int64_t i = bc.dst_base; i < cursor; ++i) dst[i] = kNaN;
  for (int i = 0; i < n; ++i) {
    if (bc.overwrite[static_cast<size_t>(i)]) continue;
    for (int64_t k = 0; k < srcs[static_cast<size_t>(i)].n; ++k) {
      dst[offsets[static_cast<size_t>(i)] + k] = static_cast<float>(rng.normal() * 10.0);
    }
  }
  std::vector<float> before(dst + bc.dst_base, dst + cursor), expected = before;
  for (int i = 0; i < n; ++i) {
    const AnySource& s = srcs[static_cast<size_t>(i)];
    entries[static_cast<size_t>(i)] = g::BucketEntry{s.data, offsets[static_cast<size_t>(i)], s.n, s.dtype,
                                                     bc.overwrite[static_cast<size_t>(i)]};
    s.cpu_accumulate(expected.data() + (offsets[static_cast<size_t>(i)] - bc.dst_base), bc.overwrite[static_cast<size_t>(i)] != 0);
  }
  int64_t n_chunks = 0, non_empty = 0;
  for (int i = 0; i < n; ++i) {
    n_chunks += (bc.numels[static_cast<size_t>(i)] + 4095) / 4096;
    non_empty += bc.numels[static_cast<size_t>(i)] > 0;
  }
  check(g::bucket_num_chunks(bc.numels.data(), n) == n_chunks, name + "/bucket_num_chunks");
  const int64_t width = n_chunks + bc.partials_extra, first = bc.partials_extra ? 3 : 0;
  std::vector<float> table(static_cast<size_t>(2 * std::max<int64_t>(width, 1)), kNaN), source_table = table;
  float* partials = bc.partials ? table.data() + first : nullptr;
  float* source_partials = bc.source_partials ? source_table.data() + first : nullptr;
  int launches = -1;
  const int64_t stride = bc.partials_extra ? width : 0;
  check_launch(g::launch_accumulate_bucket(dst, entries.data(), n, partials, nullptr, &launches, stride,
                                           source_partials, stride),
               name);
  const int64_t expected_launches = (non_empty + g::kMaxBucketEntries - 1) / g::kMaxBucketEntries;
  check(launches == expected_launches, name + "/n_launches", "%d launches for %" PRId64 " non-empty sources", launches,
        non_empty);
  same_bits(dst + bc.dst_base, expected.data(), cursor - bc.dst_base, name + "/vs-cpu-kernel(padding untouched)");
  // the fp64 oracle rounded once (an fp32 sum computed in fp64 and rounded is the correctly rounded sum)
  {
    int64_t bad = -1;
    for (int i = 0; i < n && bad < 0; ++i) {
      const AnySource& s = srcs[static_cast<size_t>(i)];
      const int64_t o = offsets[static_cast<size_t>(i)];
      for (int64_t k = 0; k < s.n; ++k) {
        // overwrite: the exact widening (0.0 + x would lose the sign of a -0.0)
        const double value = bc.overwrite[static_cast<size_t>(i)]
                                 ? static_cast<double>(s.at(k))
                                 : static_cast<double>(before[static_cast<size_t>(o - bc.dst_base + k)]) + s.at(k);
        if (bits(static_cast<float>(value)) != bits(dst[o + k])) {
          bad = o + k;
          break;
        }
      }
    }
    check(bad < 0, name + "/vs-fp64-rounded-once", "at dst[%" PRId64 "]", bad);
  }
  // partials of the values written (dst after the launch), source partials of the sources' values
  if (bc.partials) {
    check_bucket_partials(bc, dst, srcs, offsets, table, n_chunks, name + "/partials",
                          [&](int i, int64_t k) { return dst[offsets[static_cast<size_t>(i)] + k]; });
  }
  if (bc.source_partials) {
    check_bucket_partials(bc, dst, srcs, offsets, source_table, n_chunks, name + "/source-partials",
                          [&](int i, int64_t k) { return srcs[static_cast<size_t>(i)].at(k); });
  }
}

BucketCase mixed_bucket(const std::vector<int64_t>& sizes, bool dst_unaligned, bool src_unaligned) {
  BucketCase bc;
  bc.dst_unaligned = dst_unaligned;
  bc.src_unaligned = src_unaligned;
  for (size_t i = 0; i < sizes.size(); ++i) {
    bc.numels.push_back(sizes[i]);
    bc.dtypes.push_back(static_cast<int>(i % 3));
    bc.overwrite.push_back(static_cast<int>((i / 3) % 2));  // every dtype both ways
  }
  return bc;
}

void test_bucket(const BucketCase& bc, const std::string& name, uint64_t seed) {
  int64_t total = bc.dst_base;
  for (int64_t x : bc.numels) total += (x + 1 + 63) / 64 * 64;
  Buffer<float> dst(std::max<int64_t>(total, 1));
  run_bucket(bc, name, seed, dst.p, total);
}

// A non-finite source value: exactly its chunk's flag (written and source), and sum_partials' found_inf; a finite
// source added to a non-finite dst value: only the written flag.
void test_bucket_non_finite(uint64_t seed) {
  BucketCase bc = mixed_bucket({4097, 100, 8193, 3}, false, false);
  const std::string name = "bucket/non-finite";
  Rng rng(seed);
  int64_t total = 0;
  for (int64_t x : bc.numels) total += (x + 1 + 63) / 64 * 64;
  Buffer<float> dst(total);
  for (int64_t i = 0; i < total; ++i) dst[i] = 0.0f;
  std::vector<AnySource> srcs;
  std::vector<g::BucketEntry> entries;
  int64_t cursor = 0;
  for (size_t i = 0; i < bc.numels.size(); ++i) {
    srcs.emplace_back(bc.dtypes[i], bc.numels[i], false, rng);
  }
  for (size_t i = 0; i < bc.numels.size(); ++i) {
    entries.push_back(g::BucketEntry{srcs[i].data, cursor, srcs[i].n, srcs[i].dtype, 1});
    cursor += (bc.numels[i] + 1 + 63) / 64 * 64;
  }
  srcs[2].set(4096, std::numeric_limits<float>::infinity());  // source 2, chunk 1: column 2 + 1 + 1 = 4 of 7
  const int64_t n_chunks = g::bucket_num_chunks(bc.numels.data(), static_cast<int>(bc.numels.size()));
  std::vector<float> partials(static_cast<size_t>(2 * n_chunks), kNaN), source_partials = partials;
  check_launch(g::launch_accumulate_bucket(dst.p, entries.data(), static_cast<int>(entries.size()), partials.data(),
                                           nullptr, nullptr, 0, source_partials.data()),
               name);
  auto flags = [&](const std::vector<float>& table) {
    std::string out;
    for (int64_t c = 0; c < n_chunks; ++c) out += table[static_cast<size_t>(n_chunks + c)] == 1.0f ? '1' : '0';
    return out;
  };
  check(flags(partials) == "0000100", name + "/flag-column", "flags %s, expected 0000100", flags(partials).c_str());
  check(flags(source_partials) == "0000100", name + "/source-flag-column", "flags %s, expected 0000100",
        flags(source_partials).c_str());
  Buffer<float> out(2);
  check_launch(g::launch_sum_partials(partials.data(), n_chunks, out.p, out.p + 1, nullptr), name + "/sum_partials");
  check(out[1] == 1.0f, name + "/found_inf");
  // Added again, finite this time: the inf already in dst flags the values written, not the sources.
  srcs[2].set(4096, 1.0f);
  for (g::BucketEntry& e : entries) e.overwrite = 0;
  check_launch(g::launch_accumulate_bucket(dst.p, entries.data(), static_cast<int>(entries.size()), partials.data(),
                                           nullptr, nullptr, 0, source_partials.data()),
               name + "/add");
  check(flags(partials) == "0000100", name + "/add-flag-column", "flags %s, expected 0000100", flags(partials).c_str());
  check(flags(source_partials) == "0000000", name + "/add-source-flags-clear", "flags %s, expected 0000000",
        flags(source_partials).c_str());
}

void test_bucket_of_nothing() {
  const std::string name = "bucket/empty";
  Buffer<float> dst(8);
  for (int i = 0; i < 8; ++i) dst[i] = 0.0f;
  int launches = -1;
  check_launch(g::launch_accumulate_bucket(dst.p, nullptr, 0, nullptr, nullptr, &launches), name + "/no-entries");
  check(launches == 0, name + "/no-entries-launches");
  g::BucketEntry empties[3] = {{nullptr, 8, 0, kFp32, 1}, {nullptr, 0, 0, kBf16, 0}, {nullptr, 3, 0, kFp16, 1}};
  float partials_dummy = kNaN;
  check_launch(g::launch_accumulate_bucket(dst.p, empties, 3, &partials_dummy, nullptr, &launches), name + "/empties");
  check(launches == 0, name + "/empties-launches");
  check(std::isnan(partials_dummy), name + "/empties-no-partials");
  Buffer<float> out(2);
  out[0] = out[1] = kNaN;
  check_launch(g::launch_sum_partials(nullptr, 0, out.p, out.p + 1, nullptr), name + "/sum_partials-of-nothing");
  check(bits(out[0]) == 0 && out[1] == 0.0f, name + "/sum_partials-zero");
  bool zero = true;
  for (int i = 0; i < 8; ++i) zero &= bits(dst[i]) == 0;
  check(zero, name + "/dst-untouched");
}

void test_sum_partials(int64_t n, uint64_t seed) {
  Rng rng(seed);
  const std::string name = fmt("sum_partials/n%" PRId64, n);
  Buffer<float> partials(2 * n), out(2);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    partials[i] = static_cast<float>(rng.uniform() * std::pow(10.0, 4 * rng.uniform() - 2));
    partials[n + i] = 0.0f;
    total += partials[i];
  }
  check_launch(g::launch_sum_partials(partials.p, n, out.p, out.p + 1, nullptr), name);
  const float expected = replay_finalize(partials.p, n);
  same_bits(out.p, &expected, 1, name + "/replay");
  check(std::fabs(out[0] - total) <= sum_sq_rtol(n) * total, name + "/fp64-rtol");
  check(out[1] == 0.0f, name + "/found_inf-clear");
  if (n == 0) return;
  partials[n + n / 2] = 1.0f;
  check_launch(g::launch_sum_partials(partials.p, n, out.p, out.p + 1, nullptr), name + "/flagged");
  check(out[1] == 1.0f, name + "/found_inf-set");
}

// The slices of a bucket at element offsets past 2^31 of one dst (64-bit offsets and pointer arithmetic): an
// 8 GiB MAP_NORESERVE mapping of which only the touched pages are backed.
void test_bucket_past_2_31(uint64_t seed) {
  const int64_t base = (int64_t{1} << 31) - 4100;  // the first slice straddles element 2^31
  BucketCase bc = mixed_bucket({10000, 5003, 8192, 4097, 1, 70000}, false, false);
  bc.dst_base = base;
  int64_t total = base;
  for (int64_t x : bc.numels) total += (x + 1 + 63) / 64 * 64;
  const size_t bytes = static_cast<size_t>(total) * sizeof(float);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    check(false, "bucket/past-2^31/setup", "cannot map %zu bytes", bytes);
    return;
  }
  float* dst = static_cast<float*>(mem);
  run_bucket(bc, "bucket/past-2^31/aligned", seed, dst, total);
  bc.dst_unaligned = bc.src_unaligned = true;
  bc.partials_extra = 5;
  bc.source_partials = true;
  run_bucket(bc, "bucket/past-2^31/unaligned-strided", seed + 1, dst, total);
  munmap(mem, bytes);
}

// ---------------------------------------------------------------------------------------------------------
// multi-tensor AdamW
// ---------------------------------------------------------------------------------------------------------
struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool maximize;
  const char* name;
};
const Hyper kHypers[] = {{1e-3, 0.9, 0.999, 1e-8, 1e-2, false, "default"},
                         {1e-2, 0.3, 0.95, 1e-6, 0.0, true, "lerp-large-maximize"}};

// The CPU launcher's (optimizer_step.cpp) per-call and per-parameter AdamW coefficients (written out again here: the
// reference must not share the kernel's make_adamw_hyper).
gaengine::AdamWCoefs cpu_coefs(const Hyper& h, const float* grad_scale, float step_after) {
  gaengine::AdamWCoefs c{};
  const double lerp_weight = 1.0 - h.beta1;
  c.has_grad_scale = grad_scale != nullptr;
  c.grad_scale = grad_scale ? *grad_scale : 1.0f;
  c.maximize = h.maximize;
  c.decay = h.weight_decay != 0.0;
  c.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.lerp_small = std::abs(static_cast<float>(lerp_weight)) < 0.5f;
  c.lerp_coeff = c.lerp_small ? static_cast<float>(lerp_weight) : static_cast<float>(lerp_weight) - 1.0f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  const double step = step_after;
  const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
  c.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.stream_model = false;
  return c;
}

// One parameter's state in both copies (device: what the kernel updates; ref: what the CPU kernel updates).
// param_bytes: 4 (fp32 masters) or 2 (bf16 | fp16 in place).
struct AdamWParam {
  int64_t n;
  int param_dtype, grad_dtype, model_dtype;  // model_dtype -1: none
  std::vector<uint8_t> dev[5], ref[5];       // param, grad, exp_avg, exp_avg_sq, model
  size_t shift[5];                            // byte offset of each view (unaligned params: one element)
  float dev_step, ref_step;
  static size_t esize(int d) { return d == kFp32 ? 4 : 2; }
  void* view(std::vector<uint8_t>* s, int k) { return s[k].data() + shift[k]; }
};

void store_as(int dtype, void* base, int64_t i, float v) {
  if (dtype == kFp32) static_cast<float*>(base)[i] = v;
  if (dtype == kBf16) static_cast<c10::BFloat16*>(base)[i] = c10::BFloat16(v);
  if (dtype == kFp16) static_cast<c10::Half*>(base)[i] = c10::Half(v);
}

// unaligned: a mask of the streams (bit k: param, grad, exp_avg, exp_avg_sq, model) that start one element past a
// 16-byte boundary (kAllStreams: every one).
constexpr int kAllStreams = 0x1F;
AdamWParam make_param(int64_t n, int param_dtype, int grad_dtype, int model_dtype, int unaligned, float step, Rng& rng) {
  AdamWParam p;
  p.n = n;
  p.param_dtype = param_dtype, p.grad_dtype = grad_dtype, p.model_dtype = model_dtype;
  const int dtypes[5] = {param_dtype, grad_dtype, param_dtype, param_dtype, model_dtype < 0 ? kBf16 : model_dtype};
  for (int k = 0; k < 5; ++k) {
    const size_t es = AdamWParam::esize(dtypes[k]);
    p.dev[k].assign(static_cast<size_t>(n + 1) * es + 32, 0);
    const uintptr_t a = (reinterpret_cast<uintptr_t>(p.dev[k].data()) + 15) & ~uintptr_t{15};
    p.shift[k] = (a - reinterpret_cast<uintptr_t>(p.dev[k].data())) + (((unaligned >> k) & 1) ? es : 0);
    void* v = p.view(p.dev, k);
    for (int64_t i = 0; i < n; ++i) {
      float x = 0.0f;
      if (k == 0) x = static_cast<float>(rng.normal());
      if (k == 1) x = static_cast<float>(rng.normal());
      if (k == 2) x = static_cast<float>(rng.normal() * 0.1);
      if (k == 3) x = static_cast<float>(rng.uniform() * 0.01);
      if (k == 4) x = kNaN;  // the model parameter: poisoned, every element must be written
      store_as(dtypes[k], v, i, x);
    }
  }
  for (int k = 0; k < 5; ++k) p.ref[k] = p.dev[k];
  p.dev_step = p.ref_step = step;
  return p;
}

template <typename param_t, typename grad_t>
void cpu_adamw_typed(AdamWParam& p, const gaengine::AdamWCoefs& c) {
  param_t* param = static_cast<param_t*>(p.view(p.ref, 0));
  const grad_t* grad = static_cast<const grad_t*>(p.view(p.ref, 1));
  param_t* m = static_cast<param_t*>(p.view(p.ref, 2));
  param_t* v = static_cast<param_t*>(p.view(p.ref, 3));
  if (p.model_dtype < 0) {
    cpu::adamw(param, m, v, grad, static_cast<gaengine::NoModel*>(nullptr), p.n, c);
  } else if (p.model_dtype == kBf16) {
    cpu::adamw(param, m, v, grad, static_cast<c10::BFloat16*>(p.view(p.ref, 4)), p.n, c);
  } else {
    cpu::adamw(param, m, v, grad, static_cast<c10::Half*>(p.view(p.ref, 4)), p.n, c);
  }
}
template <typename param_t>
void cpu_adamw(AdamWParam& p, const gaengine::AdamWCoefs& c) {
  if (p.grad_dtype == kFp32) cpu_adamw_typed<param_t, float>(p, c);
  if (p.grad_dtype == kBf16) cpu_adamw_typed<param_t, c10::BFloat16>(p, c);
  if (p.grad_dtype == kFp16) cpu_adamw_typed<param_t, c10::Half>(p, c);
}

// The reference step of gaengine::adamw_step_ (optimizer_step.cpp): found_inf skips everything; per parameter step += 1,
// the coefficients, one pass of the CPU kernel.
void reference_step(std::vector<AdamWParam>& ps, const Hyper& h, const float* grad_scale, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  for (AdamWParam& p : ps) {
    p.ref_step += 1.0f;
    if (p.n == 0) continue;
    const gaengine::AdamWCoefs c = cpu_coefs(h, grad_scale, p.ref_step);
    if (p.param_dtype == kFp32) cpu_adamw<float>(p, c);
    if (p.param_dtype == kBf16) cpu_adamw<c10::BFloat16>(p, c);
    if (p.param_dtype == kFp16) cpu_adamw<c10::Half>(p, c);
  }
}

template <typename param_t>
void adamw_case(const std::string& name, std::vector<AdamWParam>& ps, const Hyper& h, bool scaled, int found_inf_mode,
                int steps) {
  Buffer<float> grad_scale(1), found_inf(1);
  Buffer<unsigned int> counter(1);
  grad_scale[0] = 1000.0f;  // not a power of 2: the division rounds
  found_inf[0] = found_inf_mode == 2 ? 1.0f : 0.0f;
  counter[0] = 0;
  const g::AdamWHyper hyper = g::make_adamw_hyper(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.maximize);
  for (int step = 0; step < steps; ++step) {
    std::vector<g::AdamWEntry> entries;
    for (AdamWParam& p : ps) {
      entries.push_back(g::AdamWEntry{p.view(p.dev, 0), p.view(p.dev, 1), p.view(p.dev, 2), p.view(p.dev, 3),
                                      p.model_dtype < 0 ? nullptr : p.view(p.dev, 4), &p.dev_step, p.n, p.grad_dtype,
                                      p.model_dtype < 0 ? 0 : p.model_dtype});
    }
    const std::string sname = name + fmt("/step%d", step);
    int launches = -1;
    check_launch(g::launch_adamw_multi<param_t>(entries.data(), static_cast<int>(entries.size()), hyper,
                                                scaled ? grad_scale.p : nullptr,
                                                found_inf_mode ? found_inf.p : nullptr, counter.p, nullptr, &launches),
                 sname);
    reference_step(ps, h, scaled ? grad_scale.p : nullptr, found_inf_mode ? found_inf.p : nullptr);
    const int expected_launches = (static_cast<int>(ps.size()) + g::kMaxAdamWEntries - 1) / g::kMaxAdamWEntries;
    check(launches == expected_launches, sname + "/n_launches", "%d, expected %d", launches, expected_launches);
    check(counter[0] == 0u, sname + "/counter-reset", "counter left at %u", counter[0]);
    bool steps_ok = true;
    size_t bad_step = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
      if (bits(ps[i].dev_step) != bits(ps[i].ref_step)) {
        if (steps_ok) bad_step = i;
        steps_ok = false;
      }
    }
    check(steps_ok, sname + "/steps-incremented-once", "param %zu: step %g, expected %g", bad_step,
          steps_ok ? 0.0 : ps[bad_step].dev_step, steps_ok ? 0.0 : ps[bad_step].ref_step);
    static const char* kStreams[5] = {"param", "grad", "exp_avg", "exp_avg_sq", "model"};
    for (size_t i = 0; i < ps.size(); ++i) {
      AdamWParam& p = ps[i];
      for (int k = 0; k < 5; ++k) {
        if (k == 4 && p.model_dtype < 0) continue;
        // whole allocations: the view and the bytes around it (nothing written outside the view)
        const std::string what = sname + fmt("/%s[%zu]-n%" PRId64 "-%s", kStreams[k], i, p.n, p.shift[k] % 16 ? "unaligned" : "aligned");
        const bool ok = p.dev[k] == p.ref[k];
        if (ok) {
          check(true, what);
          continue;
        }
        const int dtype = k == 1 ? p.grad_dtype : k == 4 ? p.model_dtype : p.param_dtype;
        const size_t es = AdamWParam::esize(dtype);
        size_t b = 0;
        while (p.dev[k][b] == p.ref[k][b]) ++b;
        const int64_t elem = (static_cast<int64_t>(b) - static_cast<int64_t>(p.shift[k])) / static_cast<int64_t>(es);
        check(false, what, "not bitwise equal at element %" PRId64 " (%s)", elem,
              elem < 0 || elem >= p.n ? "outside the tensor" : "inside");
      }
    }
  }
}

const std::vector<int64_t> kAdamWSizesQuick = {1, 127, 0, 4097, 3, 4095, 4096, 16385, 100003};
const std::vector<int64_t> kAdamWSizesReduced = {1, 127, 0, 4097, 3};

void test_adamw(const std::vector<int64_t>& sizes, int steps, uint64_t seed) {
  for (const Hyper& h : kHypers) {
    for (int scaled = 0; scaled < 2; ++scaled) {
      // fp32 masters: every (grad dtype, model dtype) pair over the sizes; the last parameter unaligned
      {
        Rng rng(seed++);
        std::vector<AdamWParam> ps;
        for (size_t i = 0; i < sizes.size(); ++i) {
          const int grad_dtype = static_cast<int>(i % 3), model_dtype = static_cast<int>((i / 3) % 3) - 1;
          ps.push_back(make_param(sizes[i], kFp32, grad_dtype, model_dtype, 0, static_cast<float>(i % 3), rng));
        }
        for (int gd = 0; gd < 3; ++gd) {
          for (int md = -1; md < 3; ++md) {
            ps.push_back(make_param(1000 + gd * 4 + md, kFp32, gd, md, kAllStreams, 0.0f, rng));  // unaligned: scalar path
          }
        }
        // one stream off its boundary, the others aligned: the scalar path too
        for (int stream : {0, 1, 2, 3, 4}) ps.push_back(make_param(777, kFp32, stream % 3, kBf16, 1 << stream, 1.0f, rng));
        adamw_case<float>(fmt("adamw/fp32-masters/%s/%s", h.name, scaled ? "grad_scale" : "unscaled"), ps, h, scaled,
                          1, steps);
      }
      // bf16 | fp16 in place, every grad dtype
      for (int pd : {kBf16, kFp16}) {
        Rng rng(seed++);
        std::vector<AdamWParam> ps;
        for (size_t i = 0; i < sizes.size(); ++i) {
          ps.push_back(make_param(sizes[i], pd, static_cast<int>(i % 3), -1, 0, static_cast<float>(i % 3), rng));
        }
        for (int gd = 0; gd < 3; ++gd) ps.push_back(make_param(999 + gd, pd, gd, -1, kAllStreams, 1.0f, rng));
        for (int stream : {0, 1, 2, 3}) ps.push_back(make_param(555, pd, (stream + 1) % 3, -1, 1 << stream, 2.0f, rng));
        const std::string name = fmt("adamw/%s-in-place/%s/%s", dtype_name(pd), h.name, scaled ? "grad_scale" : "unscaled");
        if (pd == kBf16) adamw_case<__nv_bfloat16>(name, ps, h, scaled, 1, steps);
        if (pd == kFp16) adamw_case<__half>(name, ps, h, scaled, 1, steps);
      }
    }
  }
  // found_inf set: nothing written, steps included
  {
    Rng rng(seed++);
    std::vector<AdamWParam> ps;
    for (size_t i = 0; i < sizes.size(); ++i) ps.push_back(make_param(sizes[i], kFp32, static_cast<int>(i % 3), kBf16, 0, 2.0f, rng));
    adamw_case<float>("adamw/found_inf-skips/fp32", ps, kHypers[0], true, 2, 1);
    std::vector<AdamWParam> qs;
    for (size_t i = 0; i < sizes.size(); ++i) qs.push_back(make_param(sizes[i], kBf16, static_cast<int>(i % 3), -1, 0, 2.0f, rng));
    adamw_case<__nv_bfloat16>("adamw/found_inf-skips/bf16", qs, kHypers[0], false, 2, 1);
  }
  // non-finite gradients (NaN of both signs, inf): the CPU kernel's NaN and inf propagation, and the model /
  // in-place roundings of a NaN (bf16 -> 0x7FC0, fp16 -> sign | 0x7E00)
  {
    Rng rng(seed++);
    std::vector<AdamWParam> ps, bf, hf;
    for (int i = 0; i < 6; ++i) ps.push_back(make_param(4097 + i, kFp32, i % 3, i / 3 == 0 ? kBf16 : kFp16, i == 5 ? kAllStreams : 0, 1.0f, rng));
    for (int i = 0; i < 3; ++i) bf.push_back(make_param(300 + i, kBf16, i, -1, i == 2 ? kAllStreams : 0, 0.0f, rng));
    for (int i = 0; i < 3; ++i) hf.push_back(make_param(300 + i, kFp16, i, -1, i == 2 ? kAllStreams : 0, 0.0f, rng));
    for (std::vector<AdamWParam>* list : {&ps, &bf, &hf}) {
      for (AdamWParam& p : *list) {
        const int64_t at[3] = {3, p.n / 2, p.n - 1};
        for (int j = 0; j < 3; ++j) {
          for (std::vector<uint8_t>* copy : {p.dev, p.ref}) {
            void* g = p.view(copy, 1);
            const uint32_t f32[3] = {0x7FC00000u, 0xFFC00000u, 0x7F800000u};  // NaN, -NaN, inf
            const uint16_t b16[3] = {0x7FC0u, 0xFFC0u, 0x7F80u}, h16[3] = {0x7E00u, 0xFE00u, 0x7C00u};
            if (p.grad_dtype == kFp32) memcpy(static_cast<uint32_t*>(g) + at[j], &f32[j], 4);
            if (p.grad_dtype == kBf16) memcpy(static_cast<uint16_t*>(g) + at[j], &b16[j], 2);
            if (p.grad_dtype == kFp16) memcpy(static_cast<uint16_t*>(g) + at[j], &h16[j], 2);
          }
        }
      }
    }
    adamw_case<float>("adamw/non-finite-grads/fp32-masters", ps, kHypers[0], false, 0, 2);
    adamw_case<__nv_bfloat16>("adamw/non-finite-grads/bf16-in-place", bf, kHypers[1], true, 0, 2);
    adamw_case<__half>("adamw/non-finite-grads/fp16-in-place", hf, kHypers[0], false, 0, 2);
  }
  // more parameters than one launch takes (kMaxAdamWEntries = 384): two launches, every step once
  {
    Rng rng(seed++);
    std::vector<AdamWParam> ps;
    for (int i = 0; i < g::kMaxAdamWEntries + 21; ++i) {
      ps.push_back(make_param(i % 7 == 0 ? 0 : 1 + i % 37, kFp32, i % 3, (i % 4) - 1 < 2 ? (i % 4) - 1 : -1,
                              i % 5 == 0 ? kAllStreams : 0, static_cast<float>(i % 4), rng));
    }
    adamw_case<float>("adamw/split-launches/fp32", ps, kHypers[1], true, 0, 2);
    std::vector<AdamWParam> qs;
    for (int i = 0; i < 2 * g::kMaxAdamWEntries + 5; ++i) {
      qs.push_back(make_param(i % 11 == 0 ? 0 : 1 + i % 13, kFp16, i % 3, -1, i % 2 == 0 ? kAllStreams : 0, 0.0f, rng));
    }
    adamw_case<__half>("adamw/split-launches/fp16", qs, kHypers[0], false, 0, 1);
  }
  // no parameters: no launch
  {
    Buffer<unsigned int> counter(1);
    counter[0] = 0;
    int launches = -1;
    const g::AdamWHyper hyper = g::make_adamw_hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, false);
    check_launch(g::launch_adamw_multi<float>(nullptr, 0, hyper, nullptr, nullptr, counter.p, nullptr, &launches),
                 "adamw/no-entries");
    check(launches == 0 && counter[0] == 0u, "adamw/no-entries/no-launch", "%d launches", launches);
  }
  // only empty parameters: one block still bumps every step
  {
    Rng rng(seed++);
    std::vector<AdamWParam> ps;
    for (int i = 0; i < 5; ++i) ps.push_back(make_param(0, kFp32, i % 3, -1, 0, static_cast<float>(i), rng));
    adamw_case<float>("adamw/all-empty", ps, kHypers[0], false, 0, 2);
  }
}

// ---------------------------------------------------------------------------------------------------------
// the grid cap (GAENGINE_EMU_MAX_GRID): the grid-stride kernels' grids obey it
// ---------------------------------------------------------------------------------------------------------
long long g_grid_cap = 0;
long long g_grid_stride_launches = 0, g_grid_over_cap = 0;
void on_launch(const gaemu::LaunchInfo& info) {
  const std::string k = info.kernel;
  const bool grid_stride = k.rfind("accumulate", 0) == 0 || k.rfind("scale_kernel", 0) == 0 || k.rfind("adamw", 0) == 0;
  if (!grid_stride) return;
  ++g_grid_stride_launches;
  if (g_grid_cap > 0 && info.grid.x > g_grid_cap) ++g_grid_over_cap;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string set = argc > 1 ? argv[1] : "quick";
  if (set != "quick" && set != "reduced" && set != "full") {
    fprintf(stderr, "usage: %s [quick|reduced|full]\n", argv[0]);
    return 2;
  }
  const bool reduced = set == "reduced", full = set == "full";
  if (const char* cap = getenv("GAENGINE_EMU_MAX_GRID")) g_grid_cap = atoll(cap);
  gaemu::set_launch_hook(on_launch);

  const std::vector<int64_t> sizes = reduced ? std::vector<int64_t>{0, 1, 3, 127, 4097}
                                             : std::vector<int64_t>{0, 1, 3, 127, 4095, 4096, 4097, 16385, 100003};
  uint64_t seed = 1;
  for (int64_t n : sizes) {
    for (const Alignment& a : kAlignments) {
      test_accumulate<kFp32>(n, a, seed++);
      test_accumulate<kBf16>(n, a, seed++);
      test_accumulate<kFp16>(n, a, seed++);
    }
  }
  const std::vector<int64_t> norm_sizes = reduced ? std::vector<int64_t>{0, 1, 127, 16385}
                                                  : std::vector<int64_t>{0, 1, 3, 127, 4097, 16384, 16385, 3 * 16384 + 5, 100003};
  for (int64_t n : norm_sizes) {
    for (int64_t offset : {0, 1}) {
      test_l2norm<kFp32>(n, offset, seed++);
      test_l2norm<kBf16>(n, offset, seed++);
      test_l2norm<kFp16>(n, offset, seed++);
    }
  }
  for (int64_t n : sizes) {
    test_scale(n, 0, seed++);
    test_scale(n, 1, seed++);
  }

  // buckets: odd sizes, a chunk boundary inside a source, empties, every dtype both ways, aligned and not
  const std::vector<int64_t> bucket_sizes =
      reduced ? std::vector<int64_t>{1, 127, 0, 4097, 3, 8200, 4096, 2, 64}
              : std::vector<int64_t>{1, 127, 0, 4097, 3, 4095, 4096, 16385, 0, 100003, 5, 8192, 64, 4099, 1, 777};
  for (bool unaligned : {false, true}) {
    BucketCase bc = mixed_bucket(bucket_sizes, unaligned, unaligned);
    const char* al = unaligned ? "unaligned" : "aligned";
    bc.partials = false;
    test_bucket(bc, fmt("bucket/mixed/%s", al), seed++);
    bc.source_partials = true;
    test_bucket(bc, fmt("bucket/mixed-source-partials/%s", al), seed++);
    bc.partials = true;
    bc.source_partials = false;
    test_bucket(bc, fmt("bucket/mixed-partials/%s", al), seed++);
    bc.source_partials = true;
    bc.partials_extra = 5;
    test_bucket(bc, fmt("bucket/mixed-both-partials-strided/%s", al), seed++);
  }
  // one side aligned, the other not: the scalar path (the 128-bit path needs both)
  for (int side = 0; side < 2; ++side) {
    BucketCase bc = mixed_bucket(bucket_sizes, side == 0, side == 1);
    test_bucket(bc, side == 0 ? "bucket/mixed-partials/dst-unaligned" : "bucket/mixed-partials/src-unaligned", seed++);
  }
  {  // past kMaxBucketEntries: ~1300 sources (3 launches), empties between, partials across the launches
    BucketCase bc;
    const int n = reduced ? 600 : 1300;
    for (int i = 0; i < n; ++i) {
      bc.numels.push_back(i % 97 == 0 ? 0 : (i % 50 == 7 ? 4100 + i : 1 + (i * 7) % 300));
      bc.dtypes.push_back(i % 3);
      bc.overwrite.push_back(i % 2);
    }
    bc.source_partials = true;
    test_bucket(bc, fmt("bucket/split-%d-sources", n), seed++);
    bc.partials = bc.source_partials = false;
    bc.dst_unaligned = bc.src_unaligned = true;
    test_bucket(bc, fmt("bucket/split-%d-sources-unaligned", n), seed++);
  }
  test_bucket_non_finite(seed++);
  test_bucket_of_nothing();
  for (int64_t n : reduced ? std::vector<int64_t>{0, 1, 1025} : std::vector<int64_t>{0, 1, 3, 1023, 1024, 1025, 5000}) {
    test_sum_partials(n, seed++);
  }
  if (full) test_bucket_past_2_31(seed++);

  test_adamw(reduced ? kAdamWSizesReduced : kAdamWSizesQuick, reduced ? 2 : 3, seed++);

  check(g_grid_stride_launches > 0, "grid-cap/launches-seen");
  check(g_grid_over_cap == 0, "grid-cap/obeyed", "%lld grid-stride launches over GAENGINE_EMU_MAX_GRID=%lld",
        g_grid_over_cap, g_grid_cap);
  const gaemu::Stats& s = gaemu::stats();
  if (g_failed == 0) {
    printf("emu: %ld checks passed (%s; %lld launches, %lld blocks, %lld threads run%s)\n", g_passed, set.c_str(),
           s.launches, s.blocks, s.threads, g_grid_cap ? fmt(", grid cap %lld", g_grid_cap).c_str() : "");
    return 0;
  }
  printf("emu: %ld checks passed, %ld FAILED (first: %s)\n", g_passed, g_failed, g_first_failure.c_str());
  return 1;
}
