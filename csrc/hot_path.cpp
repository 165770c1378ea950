// gaengine._C.HotPath and gaengine._C.HotPathCore: the per-parameter work of GradientAccumulator, in C++.
//
// HotPathCore owns main_grad's slots, the window's counts, the held gradients and the bucket launches, and takes
// each gradient handed to arrive(i, grad) (FSDP2's reduce-scattered shards, gaengine/fsdp2.py). HotPath is the same
// core fed by C++ hooks on AccumulateGrad nodes, plus gradient accumulation fusion, which needs those hooks. How a
// gradient arrives is which object is built; the core never asks.
//
// On a GPU the plain recipe is launch-bound, so every host microsecond per parameter is wall time. torch DDP's
// Reducer (torch/csrc/distributed/c10d/reducer.cpp) registers a C++ post-hook on each parameter's AccumulateGrad
// node and keeps the nodes alive; HotPath does the same, and everything that happens per parameter per
// micro-batch happens here, with no Python and no GIL:
//
//   * take the gradient out of p.grad at once (p.grad = None: autograd's next use of p starts afresh),
//   * micro-batch 0 of the window writes main_grad, later ones add (the window's `written` flags),
//   * hold the gradient until every parameter of its bucket has arrived, then accumulate the whole bucket with one
//     call of the torch.library op accumulate_bucket_ (op_library.h) through the dispatcher, which main_grad's
//     device sends to its kernel (CPU: one parallel region, csrc/cpu_ops.cpp; CUDA: one multi-tensor kernel,
//     csrc/cuda/), and drop the held gradients,
//   * in the window's last micro-batch, the free-norm partials of the values written, and, when the micro-batch
//     is armed (several ranks), the Python callback `on_bucket_ready(b)` once per complete bucket, which starts
//     that bucket's asynchronous all-reduce: the only Python entered from a hook, at most once per bucket,
//   * when measuring sources (set_measure_sources), the partials of the sources' own squares in every micro-batch,
//     written by the same launches, one table per micro-batch kept until the window's end (source_partials()),
//   * the errors of a hook: a gradient outside acc.backward() (RuntimeError) and a sparse gradient
//     (ValueError); both drop that gradient and leave the window's buffer untouched.
//
// A parameter's AccumulateGrad post-hook may fire more than once in one backward: a layer shared by two segments
// under reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) gets one arrival per
// segment, because each segment's backward is its own autograd pass. A later arrival of the same micro-batch is
// added to what that micro-batch already holds (or wrote) for the parameter: never a second source on the same
// slice, never a second count toward the bucket's readiness. The number of arrivals per backward is learned per
// parameter (torch DDP's static_graph learns the same count); a bucket is complete once each of its parameters has
// arrived as often as learned, so a bucket whose parameter comes twice is launched (and reduced) after the second
// arrival. An arrival beyond the learned count after its bucket's all-reduce already started cannot be reduced
// correctly: it raises, and the next try knows the count.
//
// Streams (CUDA): each held gradient remembers the stream current at its hook (where autograd made it ready). The
// bucket launch runs on the stream current at the hook that completes the bucket (or the caller's, in end()); it
// waits on an event of every other stream it reads from and records its stream on those gradients' storage (and
// on the partials), as torch DDP's reducer does, so the caching allocator cannot reuse them under the kernel.
//
// Threading: autograd calls the hooks on the thread that runs backward (the caller's for CPU tensors, a device
// thread for CUDA ones) with the GIL released; the methods below are called from Python between backwards. A
// mutex orders the two; the GIL is taken only around the callback, with the mutex released.
// ATen and torch's pybind11 type casters (at::Tensor arguments of HotPath's bound methods), not <torch/extension.h>:
// that also parses the C++ frontend (torch/all.h: nn, optim, data, serialize), which nothing here uses; the compile
// takes a third less CPU time without it.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "op_library.h"
#include "scratch.h"
#include "wgrad.h"

namespace gaengine {
namespace {

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

// The kernel of accumulate_bucket_ that main_grad's device picks: CUDA for a CUDA tensor (in the emulated build of
// tests/cuda_emu, whose CPU tensors stand in for CUDA ones, every tensor, under its CPU key), else CPU. Only the
// backend key is dispatched on (HotPath's tensors never need autograd, and its host time is per bucket, not per op
// layer).
// The operator `name` of namespace `ns`, defined (ValueError naming the namespace otherwise).
c10::OperatorHandle find_op(const std::string& ns, const char* name) {
  const auto op = c10::Dispatcher::singleton().findOp({ns + "::" + name, ""});
  TORCH_CHECK_VALUE(op.has_value() && op->hasSchema(), "op_namespace ", ns, " defines no ", name,
                    " (torch.ops.", ns, ".", name, "): pass the namespace of the compiled ops or of a backend's ",
                    "registered kernels (gaengine.backends)");
  return *op;
}

c10::DispatchKeySet kernel_keys(const at::Tensor& main_grad) {
  if (GAENGINE_IS_CUDA_TENSOR(main_grad)) return c10::DispatchKeySet(c10::DispatchKey::GAENGINE_CUDA_DISPATCH_KEY);
  TORCH_CHECK_VALUE(main_grad.device().is_cpu(), "main_grad must be a CPU or CUDA tensor, got ", main_grad.device());
  return c10::DispatchKeySet(c10::DispatchKey::CPU);
}

class HotPath;

// Gradient accumulation fusion: the parameters whose fused Linear gradients a HotPath takes (set_fusion), by their
// TensorImpl (a parameter belongs to one live accumulator; its HotPath keeps it alive while registered). The lock
// is taken before a HotPath's own mutex, never after.
struct FusedOwner {
  HotPath* hot = nullptr;
  int64_t index = -1;
};
std::mutex& fusion_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const c10::TensorImpl*, FusedOwner>& fusion_owners() {
  static std::unordered_map<const c10::TensorImpl*, FusedOwner> owners;
  return owners;
}

// The core: main_grad and its slots, the window's written flags, the arrival counts, the held gradients and the
// bucket launches, the partials tables. It registers no hook: each gradient is handed to arrive(i, grad) (FSDP2's
// sharded parameters, whose reduce-scattered shards FSDP2 assigns and hands over itself, gaengine/fsdp2.py), and
// HotPath below, its hooked front, hands over each parameter's p.grad from an AccumulateGrad post-hook. Both reach
// the one receive(); nothing in it depends on which front is built.
class HotPathCore {
 public:
  // params: the tensors whose gradients main_grad accumulates, in layout order, all on main_grad's device (the
  //   hooked front's: leaf tensors that require grad; the core alone only reads their shapes and device, e.g. the
  //   local shards of FSDP2's parameters). op_namespace: the torch.library namespace whose accumulate_bucket_ (and,
  //   for HotPath's fusion, wgrad_accumulate_) the launches dispatch to: the compiled ops' (GAENGINE_OP_NAMESPACE),
  //   or one where a backend registered its own kernel of the same schema (gaengine.backends: torch, triton).
  //   main_grad: (n,) fp32 contiguous, the flat buffer; offsets[i]: where parameter i starts in it.
  // bucket_of[i]: parameter i's bucket (buckets are runs of consecutive parameters, 0 .. n_buckets - 1).
  // partials_like: a tensor (any device: only its shape and dtype are read) shaped as the backend's partials table
  //   of all parameters in layout order (Backend.new_bucket_partials: (P, 2) fp64 rows on cpu, (2, n_chunks) fp32
  //   on cuda); partials_dim: the dimension along which that table is the concatenation of the parameters' own
  //   tables, partials_extent[i] parameter i's extent along it (cpu: 1 row, cuda: its chunks). A launch's table is
  //   a slice along partials_dim. on_bucket_ready: a Python callable(int), or None. main_grad may be on the meta
  //   device (layout only) when every bucket is written into the destinations set_acquire's callable gives.
  HotPathCore(std::vector<at::Tensor> params, at::Tensor main_grad, std::vector<int64_t> offsets,
              std::vector<int64_t> bucket_of, const at::Tensor& partials_like, int64_t partials_dim,
              std::vector<int64_t> partials_extent, py::object on_bucket_ready, const std::string& op_namespace)
      : params_(std::move(params)),
        main_grad_(std::move(main_grad)),
        offsets_(std::move(offsets)),
        bucket_of_(std::move(bucket_of)),
        extent_(std::move(partials_extent)),
        partials_dim_(partials_dim),
        on_bucket_ready_(std::move(on_bucket_ready)),
        op_(find_op(op_namespace, "accumulate_bucket_").typed<AccumulateBucketKernel>()) {
    const size_t n = params_.size();
    TORCH_CHECK_VALUE(n > 0, "params must not be empty");
    like_ = main_grad_.is_meta() ? at::empty({0}, params_[0].options().dtype(at::kFloat)) : main_grad_;
    keys_ = kernel_keys(like_);
    TORCH_CHECK_VALUE(offsets_.size() == n && bucket_of_.size() == n && extent_.size() == n,
                      "params, offsets, bucket_of and partials_extent must have the same length, got ", n, ", ",
                      offsets_.size(), ", ", bucket_of_.size(), " and ", extent_.size());
    TORCH_CHECK_VALUE(main_grad_.scalar_type() == at::kFloat && main_grad_.is_contiguous() && main_grad_.dim() == 1,
                      "main_grad must be a 1-d contiguous float32 tensor");
    TORCH_CHECK_VALUE(partials_like.dim() == 2 && (partials_dim_ == 0 || partials_dim_ == 1),
                      "partials_like must be 2-d and partials_dim 0 or 1, got shape ", partials_like.sizes(),
                      " and partials_dim ", partials_dim_);
    int64_t n_buckets = 0;
    int64_t total_extent = 0;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& p = params_[i];
      TORCH_CHECK_VALUE(p.device() == like_.device(), "params[", i, "] is on ", p.device(), ", main_grad on ",
                        like_.device());
      TORCH_CHECK_VALUE(offsets_[i] >= 0 && offsets_[i] + p.numel() <= main_grad_.numel(), "offsets[", i,
                        "] puts params[", i, "] outside main_grad");
      TORCH_CHECK_VALUE(bucket_of_[i] == n_buckets || (n_buckets > 0 && bucket_of_[i] == n_buckets - 1),
                        "bucket_of must number runs of consecutive parameters 0, 1, 2, ...; got ", bucket_of_[i],
                        " at index ", i);
      TORCH_CHECK_VALUE(extent_[i] >= 0, "partials_extent[", i, "] must be >= 0, got ", extent_[i]);
      if (bucket_of_[i] == n_buckets) {
        bucket_start_.push_back(total_extent);
        bucket_extent_.push_back(0);
      }
      n_buckets = bucket_of_[i] + 1;
      bucket_extent_.back() += extent_[i];
      total_extent += extent_[i];
    }
    TORCH_CHECK_VALUE(total_extent == partials_like.size(partials_dim_), "partials_extent sums to ", total_extent,
                      " but partials_like has ", partials_like.size(partials_dim_), " along dimension ",
                      partials_dim_);
    partials_shape_ = partials_like.sizes().vec();
    partials_options_ = like_.options().dtype(partials_like.scalar_type());
    bucket_size_.assign(n_buckets, 0);
    for (int64_t b : bucket_of_) ++bucket_size_[b];
    written_.assign(n, 0);
    fused_.assign(n, 0);
    fused_sources_.resize(n);
    arrivals_.assign(n, 0);
    expected_.assign(n, 1);
    held_at_.assign(n, -1);
    held_.resize(n_buckets);
    source_written_.assign(n_buckets, 0);
    pending_ = bucket_size_;
  }

  HotPathCore(const HotPathCore&) = delete;
  HotPathCore& operator=(const HotPathCore&) = delete;

  // Drop the gradients held for an incomplete bucket (idempotent; the core has no hook to remove).
  void close() {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_held();
  }

  // Start of one micro-batch's backward. want_norm: write the free-norm partials (the window's last micro-batch
  // on one rank). armed: call on_bucket_ready for each bucket completed in this micro-batch. When measuring
  // sources, this micro-batch's source-partials table is made here (on the caller's stream).
  void begin(bool want_norm, bool armed) {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_held();
    std::fill(arrivals_.begin(), arrivals_.end(), 0);
    std::fill(fused_.begin(), fused_.end(), 0);
    std::fill(pending_.begin(), pending_.end(), 0);
    for (size_t i = 0; i < params_.size(); ++i) pending_[bucket_of_[i]] += expected_[i];
    arrived_ = 0;
    norm_missed_ = false;
    late_.clear();
    late_count_ = 0;
    armed_ = armed;
    partials_ = want_norm ? scratch_empty(partials_shape_, partials_options_) : at::Tensor();
    source_table_ = at::Tensor();
    if (measure_sources_) {
      source_table_ = scratch_empty(partials_shape_, partials_options_);
      sources_.push_back(source_table_);
      sources_inexact_.push_back(false);
      std::fill(source_written_.begin(), source_written_.end(), 0);
    }
    tables_stream_ = current_stream();
    in_backward_ = true;
  }

  // After autograd returned: accumulate the buckets left incomplete (parameters that got no gradient); when
  // measuring sources, zero the parts of this micro-batch's table no launch wrote (those parameters' sources).
  void end() {
    std::lock_guard<std::mutex> lock(mutex_);
    in_backward_ = false;
    if (!late_.empty()) {
      if (source_table_.defined()) sources_inexact_.back() = true;
      source_table_ = at::Tensor();
      const std::string first = std::exchange(late_, std::string());
      const int64_t n = std::exchange(late_count_, 0);
      TORCH_CHECK(false, first, n > 1 ? c10::str(" (and ", n - 1, " more late arrival(s))") : std::string(),
                  " (a layer shared by reentrant-checkpointed segments, or a graph that changed) after its bucket's ",
                  "all-reduce had started, so the window cannot be reduced exactly. The accumulator has learned the ",
                  "new counts: call acc.zero_grad() and run the window again");
    }
    for (size_t b = 0; b < held_.size(); ++b) {
      if (!held_[b].empty()) {
        launch(b, /*solo=*/false);
      } else if (!acquire_.is_none() && !dest_[b].defined()) {
        target(b);  // a bucket no gradient reached: staged as zeros
      }
    }
    if (source_table_.defined()) zero_unwritten_sources();
    source_table_ = at::Tensor();
  }

  // Backward raised: forget what is held (the window is no longer a sum of whole micro-batches); this micro-batch's
  // source partials, if any, are inexact.
  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (source_table_.defined()) sources_inexact_.back() = true;
    source_table_ = at::Tensor();
    in_backward_ = false;
    drop_held();
    std::fill(fused_.begin(), fused_.end(), 0);
    partials_ = at::Tensor();
  }

  // Parameter index's gradient handed over by its caller (FSDP2, gaengine/fsdp2.py: this rank's reduce-scattered
  // shard, shaped as params[index]), received as HotPath's AccumulateGrad hook receives p.grad.
  void arrive(int64_t index, at::Tensor grad) {
    TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(params_.size()), "index ", index,
                      " out of range for ", params_.size(), " parameters");
    TORCH_CHECK_VALUE(!grad.defined() || (grad.sizes() == params_[index].sizes() &&
                                          grad.device() == params_[index].device()),
                      "grad of parameter ", index, " must have shape ", params_[index].sizes(), " on ",
                      params_[index].device(), ", got ", grad.sizes(), " on ", grad.device());
    receive(static_cast<size_t>(index), grad);
  }

  // The free-norm partials of the last micro-batch when they cover every parameter, else None: the backend's
  // partials table of all parameters (partials_like's shape and dtype, on main_grad's device).
  std::optional<at::Tensor> norm_partials() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!partials_.defined() || norm_missed_ || arrived_ != static_cast<int64_t>(params_.size())) return std::nullopt;
    return partials_;
  }

  // Measure the sources from the next begin() on (on), or stop and forget the tables (off).
  void set_measure_sources(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    measure_sources_ = on;
    if (!on) clear_sources_locked();
  }

  // The source-partials tables of the micro-batches since the last clear_sources(), one per begin() while
  // measuring (partials_like's layout: (sum of squares, non-finite flag) of the sources, zero where a parameter got
  // no gradient), and per table whether it is inexact (a later arrival launched on its own after its bucket, or a
  // backward that raised).
  std::pair<std::vector<at::Tensor>, std::vector<bool>> source_partials() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {sources_, sources_inexact_};
  }

  void clear_sources() {
    std::lock_guard<std::mutex> lock(mutex_);
    clear_sources_locked();
  }

  std::vector<bool> written() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {written_.begin(), written_.end()};
  }

  void set_all_written(const std::vector<bool>& values) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK_VALUE(values.size() == written_.size(), "values must have ", written_.size(), " entries, got ",
                      values.size());
    std::copy(values.begin(), values.end(), written_.begin());
  }

  // First-arrival order of the window being learned (None when not learning).
  std::optional<std::vector<int64_t>> arrival() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!learning_) return std::nullopt;
    return arrival_;
  }

  // Learn the layout from this window's first arrivals, continuing `order` (None: stop learning).
  void set_arrival(const std::optional<std::vector<int64_t>>& order) {
    std::lock_guard<std::mutex> lock(mutex_);
    learning_ = order.has_value();
    arrival_ = order.value_or(std::vector<int64_t>{});
  }

  // True when a hook dropped a gradient that arrived outside acc.backward() since the last call; clears it.
  bool take_stale() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(stale_, false);
  }

  // Per parameter: the gradient arrivals per backward learned so far (1 unless a hook fired more often).
  std::vector<int64_t> expected_arrivals() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {expected_.begin(), expected_.end()};
  }

  void set_expected_arrivals(const std::vector<int64_t>& values) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK_VALUE(values.size() == expected_.size(), "values must have ", expected_.size(), " entries, got ",
                      values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      TORCH_CHECK_VALUE(values[i] >= 1, "expected arrivals must be >= 1, got ", values[i], " at index ", i);
      expected_[i] = static_cast<int32_t>(values[i]);
    }
  }

  // accumulate_bucket_ calls since construction (one per bucket launch).
  int64_t launches() {
    std::lock_guard<std::mutex> lock(mutex_);
    return launches_;
  }

  int64_t num_buckets() const { return static_cast<int64_t>(bucket_size_.size()); }

  // acquire: a Python callable(b) -> (n,) fp32 contiguous tensor on the parameters' device, bucket b's destination
  // for the micro-batch (ZeRO stage 2's staging ring), called with the GIL once per bucket and micro-batch right
  // before its first launch; parameter i is written at offsets[i] - bucket_base[b] in it, and the bucket's parameters
  // that had no gradient by then are zeroed there; end() acquires the buckets no gradient reached and zeroes them.
  // None: every bucket is written into main_grad (which must then not be on meta).
  void set_acquire(py::object acquire, std::vector<int64_t> bucket_base) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t n_buckets = bucket_size_.size();
    TORCH_CHECK_VALUE(!acquire.is_none() || !main_grad_.is_meta(), "acquire=None needs a main_grad that is not on meta");
    TORCH_CHECK_VALUE(acquire.is_none() || bucket_base.size() == n_buckets, "bucket_base must have ", n_buckets,
                      " entries, got ", bucket_base.size());
    bucket_first_.assign(n_buckets, -1);
    bucket_span_.assign(n_buckets, 0);
    for (size_t i = 0; i < params_.size() && !acquire.is_none(); ++i) {
      const int64_t b = bucket_of_[i];
      if (bucket_first_[b] < 0) bucket_first_[b] = static_cast<int64_t>(i);
      TORCH_CHECK_VALUE(offsets_[i] >= bucket_base[b], "bucket_base[", b, "] is past parameter ", i, "'s offset");
      bucket_span_[b] = std::max(bucket_span_[b], offsets_[i] + params_[i].numel() - bucket_base[b]);
    }
    acquire_ = std::move(acquire);
    bucket_base_ = std::move(bucket_base);
    dest_.assign(n_buckets, at::Tensor());
  }

 protected:
  struct Held {
    int64_t index;
    at::Tensor grad;
    bool overwrite;
    c10::Stream stream;  // current at the hook that made it ready (CPU: the one default stream)
    at::Tensor source;   // measuring, after an add-mode combine: the arrivals' sum apart from main_grad (fp32)
  };

  c10::Stream current_stream() const {
    return c10::impl::getDeviceGuardImpl(like_.device().type())->getStream(like_.device());
  }

  // Make `stream` safe to read `t`, made ready on `made_on`: wait for that stream, and tell the caching allocator
  // that `stream` uses its memory (DDP's reducer does the same). Nothing to do on one stream (always on CPU).
  static void use_on(const at::Tensor& t, const c10::Stream& made_on, const c10::Stream& stream) {
    if (made_on == stream) return;
    c10::Event ready(stream.device_type());
    ready.record(made_on);
    ready.block(stream);
    c10::impl::getDeviceGuardImpl(stream.device_type())->recordDataPtrOnStream(t.storage().data_ptr(), stream);
  }

  // Parameter i's main_grad view, shaped like the parameter.
  at::Tensor slice(int64_t i) const {
    return main_grad_.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes());
  }

  void drop_held() {
    for (auto& source : fused_sources_) source.reset();
    for (auto& held : held_) held.clear();
    for (auto& dest : dest_) dest.reset();
    std::fill(held_at_.begin(), held_at_.end(), -1);
  }

  void clear_sources_locked() {
    sources_.clear();
    sources_inexact_.clear();
    source_table_ = at::Tensor();  // a backward under way writes no table
  }

  // Parameter i's gradient of this autograd pass, in `slot` (p.grad, which is emptied: the parameter lets go of it).
  void receive(size_t i, at::Tensor& slot) {
    int64_t ready = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const bool fused = std::exchange(fused_[i], 0) != 0;  // fuse() wrote this pass's fused uses into main_grad
      if (!slot.defined() && !fused) return;
      if (!in_backward_) {
        slot.reset();  // nothing is accumulated; the window stays intact
        stale_ = true;
        TORCH_CHECK(false, "a gradient reached a parameter managed by GradientAccumulator outside acc.backward(); ",
                    "call acc.backward(loss) instead of loss.backward() (or acc.close() to detach the accumulator)");
      }
      if (slot.defined() && slot.layout() != c10::kStrided) {
        const auto layout = slot.layout();
        slot.reset();
        TORCH_CHECK_VALUE(false, "parameter ", i, " (shape ", params_[i].sizes(), ") received a ", layout,
                          " gradient; gaengine accumulates dense gradients only (build embeddings with sparse=False)");
      }
      at::Tensor grad = std::move(slot);  // the parameter lets go of its low-precision gradient at once
      slot.reset();
      if (fused_sources_[i].defined()) {  // measuring: this pass's fused uses, in fp32, plus its other uses
        at::Tensor source = std::move(fused_sources_[i]);
        fused_sources_[i].reset();
        if (grad.defined()) source.add_(grad.reshape(source.sizes()));
        grad = std::move(source);
      }
      if (grad.defined() && !grad.is_contiguous()) grad = grad.contiguous();
      const int64_t b = bucket_of_[i];
      const int32_t count = ++arrivals_[i];
      const bool counts = count <= expected_[i];  // toward its bucket's readiness
      if (!counts) {
        expected_[i] = count;  // learned: later micro-batches wait for this many arrivals
        if (armed_ && pending_[b] == 0) {
          // Too late to be reduced. Backward goes on so that every such parameter is learned; end() raises.
          if (late_.empty()) {
            late_ = c10::str("parameter ", i, " (shape ", params_[i].sizes(), ") received its gradient ", count,
                             " times in one backward");
          }
          ++late_count_;
          return;
        }
      }
      bool overwrite = false;
      if (count == 1) {
        ++arrived_;
        overwrite = !written_[i];
        if (overwrite) {
          written_[i] = 1;
          if (learning_) arrival_.push_back(static_cast<int64_t>(i));
        }
      }
      if (!grad.defined()) {
        // fused only: main_grad already holds this arrival's gradient (fuse()); nothing to hold
      } else if (held_at_[i] >= 0) {
        combine(held_[b][held_at_[i]], grad);  // a later arrival while the earlier one is held: one source
      } else {
        held_at_[i] = static_cast<int64_t>(held_[b].size());
        held_[b].push_back({static_cast<int64_t>(i), std::move(grad), overwrite, current_stream(), at::Tensor()});
        if (pending_[b] == 0) {
          norm_missed_ = true;  // bucket b was launched already: this arrival goes on its own
          launch(b, /*solo=*/true);
        }
      }
      if (counts && --pending_[b] == 0) {
        if (!held_[b].empty()) launch(b, /*solo=*/false);
        if (armed_) ready = b;
      }
    }
    if (ready >= 0 && !on_bucket_ready_.is_none()) {
      py::gil_scoped_acquire gil;  // the one Python call of a hook: start bucket `ready`'s all-reduce
      on_bucket_ready_(ready);
    }
  }

  // A later arrival of a parameter whose earlier one is still held: the held source becomes the fp32 value that
  // one add per arrival would have left in the slice (bitwise: an exact widening, or main_grad + earlier, then
  // + this one, each one IEEE fp32 add), written over the slice. When measuring sources and the slice is added to,
  // that value is no longer the micro-batch's source: the arrivals' own sum (float(earlier) + this one + ..., one
  // fp32 add per arrival) is kept apart for launch() to measure. Runs on the current stream.
  void combine(Held& h, const at::Tensor& grad) {
    const c10::Stream stream = current_stream();
    use_on(h.grad, h.stream, stream);
    if (source_table_.defined() && (h.source.defined() || !h.overwrite)) {
      if (!h.source.defined()) h.source = h.grad.reshape({-1}).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      h.source.add_(grad.reshape({-1}));
    }
    const at::Tensor earlier = h.grad.reshape({-1});
    at::Tensor sum;
    if (h.overwrite) {
      sum = earlier.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    } else {  // added to what this window wrote: with acquire, the bucket was launched (staged) in this micro-batch
      const int64_t b = bucket_of_[h.index];
      const bool staged = !acquire_.is_none();
      TORCH_CHECK(!staged || dest_[b].defined(), "gaengine: bucket ", b, " adds to a destination never acquired (a bug)");
      const at::Tensor& base = staged ? dest_[b] : main_grad_;
      sum = at::add(base.narrow(0, offsets_[h.index] - (staged ? bucket_base_[b] : 0), earlier.numel()), earlier);
    }
    sum.add_(grad.reshape({-1}));
    h.grad = std::move(sum);
    h.overwrite = true;
    h.stream = stream;
  }

  // Accumulate bucket b's held gradients with one accumulate_bucket_ call and drop them. Called with the mutex
  // held, on the stream current at the hook that completes the bucket (or the caller's, in end()); it waits for
  // every other stream it reads from. The free-norm partials are written by a launch of the whole bucket (its slice
  // of the table); the source partials by every launch but a solo one (a later arrival after its bucket was
  // launched: its micro-batch's source norm is then inexact), into the first part of the bucket's slice (an
  // incomplete bucket's rest is zeroed by end()).
  void launch(size_t b, bool solo) {
    std::vector<Held>& held = held_[b];
    std::sort(held.begin(), held.end(), [](const Held& x, const Held& y) { return x.index < y.index; });
    const c10::Stream stream = current_stream();
    const at::Tensor dest = target(b);
    const int64_t base = acquire_.is_none() ? 0 : bucket_base_[b];
    std::vector<at::Tensor> srcs;
    std::vector<int64_t> offsets;
    c10::List<bool> overwrite;
    srcs.reserve(held.size());
    offsets.reserve(held.size());
    overwrite.reserve(held.size());
    int64_t extent = 0;
    for (const Held& h : held) {
      use_on(h.grad, h.stream, stream);
      srcs.push_back(h.grad);
      offsets.push_back(offsets_[h.index] - base);
      overwrite.push_back(h.overwrite);
      extent += extent_[h.index];
    }
    std::optional<at::Tensor> partials, source_partials;
    if (partials_.defined() && static_cast<int64_t>(held.size()) == bucket_size_[b]) {
      partials = table_slice(partials_, bucket_start_[b], extent, stream);
    }
    if (source_table_.defined()) {
      if (solo) {
        sources_inexact_.back() = true;
      } else {
        source_partials = table_slice(source_table_, bucket_start_[b], extent, stream);
        source_written_[b] = extent;
      }
    }
    op_.redispatch(keys_, dest, srcs, offsets, overwrite, partials, source_partials);
    ++launches_;
    if (source_partials.has_value()) measure_apart(b, held, stream);
    for (const Held& h : held) held_at_[h.index] = -1;
    held.clear();
  }

  // Where bucket b is written: main_grad, or with acquire its destination for this micro-batch, acquired (with the
  // GIL) on its first launch, the bucket's parameters not held now zeroed in it (they had no gradient before it).
  at::Tensor target(size_t b) {
    if (acquire_.is_none()) return main_grad_;
    if (!dest_[b].defined()) {
      at::Tensor dest;
      {
        py::gil_scoped_acquire gil;  // once per bucket and micro-batch, like on_bucket_ready
        dest = acquire_(static_cast<int64_t>(b)).cast<at::Tensor>();
      }
      TORCH_CHECK(dest.scalar_type() == at::kFloat && dest.dim() == 1 && dest.is_contiguous() &&
                      dest.device() == like_.device() && dest.numel() >= bucket_span_[b],
                  "acquire(", b, ") must return a 1-d contiguous float32 tensor of at least ", bucket_span_[b],
                  " elements on ", like_.device(), ", got ", dest.scalar_type(), " of shape ", dest.sizes(), " on ",
                  dest.device());
      for (int64_t i = bucket_first_[b]; i < bucket_first_[b] + bucket_size_[b]; ++i) {
        if (held_at_[i] < 0) dest.narrow(0, offsets_[i] - bucket_base_[b], params_[i].numel()).zero_();
      }
      dest_[b] = std::move(dest);
    }
    return dest_[b];
  }

  // The source partials of the held sources kept apart (combined arrivals added to main_grad): the launch above
  // measured main_grad + their sum; one more accumulate_bucket_ call per such source (into a scratch buffer)
  // rewrites its part of the table with its own. Only after a double arrival while measuring.
  void measure_apart(size_t b, const std::vector<Held>& held, const c10::Stream& stream) {
    int64_t position = bucket_start_[b];
    for (const Held& h : held) {
      if (h.source.defined()) {
        const at::Tensor scratch = at::empty_like(h.source);
        c10::List<bool> overwrite({true});
        op_.redispatch(keys_, scratch, {h.source}, {0}, overwrite, std::nullopt,
                       table_slice(source_table_, position, extent_[h.index], stream));
        ++launches_;
      }
      position += extent_[h.index];
    }
  }

  // [start, start + extent) of a table along partials_dim, usable on `stream` (the tables are made in begin()).
  at::Tensor table_slice(const at::Tensor& table, int64_t start, int64_t extent, const c10::Stream& stream) const {
    if (tables_stream_.has_value()) use_on(table, *tables_stream_, stream);
    return table.narrow(partials_dim_, start, extent);
  }

  // Zero the parts of this micro-batch's source table that no launch wrote (parameters without a gradient), one
  // zero_ per run of adjacent parts: none in a micro-batch where every bucket was launched whole.
  void zero_unwritten_sources() {
    const at::Tensor& table = source_table_;
    int64_t run_start = -1, run_end = -1;
    auto flush = [&] {
      if (run_end > run_start) table.narrow(partials_dim_, run_start, run_end - run_start).zero_();
      run_start = run_end = -1;
    };
    for (size_t b = 0; b < bucket_start_.size(); ++b) {
      const int64_t begin = bucket_start_[b] + source_written_[b], end = bucket_start_[b] + bucket_extent_[b];
      if (begin == end) continue;
      if (begin != run_end) flush();
      if (run_start < 0) run_start = begin;
      run_end = end;
    }
    flush();
  }

  std::vector<at::Tensor> params_;
  at::Tensor main_grad_;
  at::Tensor like_;                      // main_grad, or (main_grad on meta) an empty fp32 tensor on its device
  std::vector<int64_t> offsets_;
  std::vector<int64_t> bucket_of_;
  std::vector<int64_t> extent_;          // per parameter: its extent in a partials table along partials_dim_
  int64_t partials_dim_;
  py::object on_bucket_ready_;
  py::object acquire_ = py::none();      // set_acquire's callable, or None
  std::vector<int64_t> bucket_base_;     // acquire: per bucket, where its destination starts in main_grad's offsets
  std::vector<int64_t> bucket_first_;    // acquire: per bucket, its first parameter
  std::vector<int64_t> bucket_span_;     // acquire: per bucket, the elements its destination must hold
  std::vector<at::Tensor> dest_;         // acquire: per bucket, this micro-batch's destination, or undefined
  c10::TypedOperatorHandle<AccumulateBucketKernel> op_;  // torch.ops.<namespace>.accumulate_bucket_
  c10::DispatchKeySet keys_;                            // its kernel for main_grad's device (kernel_keys)

  std::vector<int64_t> bucket_size_;
  std::vector<int64_t> bucket_start_;    // per bucket: its first position in a partials table along partials_dim_
  std::vector<int64_t> bucket_extent_;   // per bucket: its extent there
  std::vector<int64_t> partials_shape_;  // the whole table (partials_like's shape)
  at::TensorOptions partials_options_;

  std::mutex mutex_;
  std::vector<uint8_t> written_;        // per parameter: written in this window (later micro-batches add)
  std::vector<uint8_t> fused_;          // per parameter: HotPath::fuse() wrote it since its last hook call
  std::vector<at::Tensor> fused_sources_;  // measuring sources: per parameter, its fused uses since its last hook
  std::vector<int64_t> arrival_;        // first arrivals of the window being learned
  bool learning_ = false;
  std::vector<std::vector<Held>> held_;  // per bucket: gradients waiting for the rest of their bucket
  std::vector<int64_t> pending_;         // per bucket: arrivals still expected in this micro-batch
  std::vector<int32_t> arrivals_;        // per parameter: hook calls in this micro-batch
  std::vector<int32_t> expected_;        // per parameter: hook calls per backward, learned (>= 1)
  std::vector<int64_t> held_at_;         // per parameter: its entry in held_[bucket], or -1
  int64_t arrived_ = 0;                  // distinct parameters arrived in this micro-batch
  bool norm_missed_ = false;             // a launch wrote values the partials do not cover
  std::string late_;                     // the first arrival too late to be reduced (armed), raised by end()
  int64_t late_count_ = 0;
  bool in_backward_ = false;
  bool armed_ = false;
  bool stale_ = false;
  at::Tensor partials_;                  // this micro-batch's free-norm table (want_norm), or undefined
  bool measure_sources_ = false;
  at::Tensor source_table_;              // this micro-batch's source-partials table (measuring), or undefined
  std::vector<at::Tensor> sources_;      // per micro-batch since clear_sources(): its source-partials table
  std::vector<bool> sources_inexact_;    // per micro-batch: its table is inexact
  std::vector<int64_t> source_written_;  // per bucket: extent of this micro-batch's table a launch wrote
  std::optional<c10::Stream> tables_stream_;  // where begin() made the tables
  int64_t launches_ = 0;
};

// The hooked front: the core fed by a C++ post-hook on each parameter's AccumulateGrad node, and gradient
// accumulation fusion (fused_linear's backward writing registered parameters' gradients into main_grad), which
// needs those hooks. The hook calls the core's receive() directly (no virtual call, no allocation).
class HotPath : public HotPathCore {
 public:
  // The core's arguments (HotPathCore); params must be leaf tensors that require grad.
  HotPath(std::vector<at::Tensor> params, at::Tensor main_grad, std::vector<int64_t> offsets,
          std::vector<int64_t> bucket_of, const at::Tensor& partials_like, int64_t partials_dim,
          std::vector<int64_t> partials_extent, py::object on_bucket_ready, const std::string& op_namespace)
      : HotPathCore(std::move(params), std::move(main_grad), std::move(offsets), std::move(bucket_of),
                    partials_like, partials_dim, std::move(partials_extent), std::move(on_bucket_ready),
                    op_namespace) {
    const auto wgrad = c10::Dispatcher::singleton().findOp({op_namespace + "::wgrad_accumulate_", ""});
    if (wgrad.has_value() && wgrad->hasSchema()) wgrad_op_ = wgrad->typed<WgradAccumulateKernel>();
    const size_t n = params_.size();
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK_VALUE(params_[i].requires_grad() && params_[i].is_leaf(), "params[", i,
                        "] must be a leaf tensor that requires grad (HotPath hooks its AccumulateGrad node; ",
                        "gradients handed over by the caller go to a HotPathCore's arrive())");
    }
    // One hook per parameter on its AccumulateGrad node, which we keep alive (a parameter holds its node only
    // weakly, and a node made afresh would not carry the hook).
    nodes_.reserve(n);
    keys_of_hooks_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      NodePtr node = torch::autograd::impl::grad_accumulator(params_[i]);
      TORCH_CHECK(node, "params[", i, "] has no AccumulateGrad node");
      keys_of_hooks_.push_back(node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const variable_list& outputs, const variable_list& /*inputs*/) {
            on_gradient(i);
            return outputs;
          })));
      nodes_.push_back(std::move(node));
    }
  }

  ~HotPath() { close(); }

  // Remove the hooks and the fusion registrations (idempotent). Gradients held for an incomplete bucket are
  // dropped.
  void close() {
    set_fusion(false);
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < nodes_.size(); ++i) nodes_[i]->del_post_hook(keys_of_hooks_[i]);
    nodes_.clear();
    keys_of_hooks_.clear();
    drop_held();
  }

  // Gradient accumulation fusion on (register the parameters: fused_linear's backward hands their gradients to
  // fuse()) or off (unregister them). Off is idempotent; close() turns it off.
  void set_fusion(bool on) { set_fused(std::vector<bool>(params_.size(), on)); }

  // Gradient accumulation fusion per parameter: which[i] registers parameter i (fused_linear's backward hands its
  // gradient to fuse()), false unregisters it (fused_linear's backward returns its ordinary gradient to autograd,
  // which runs the parameter's tensor and post-accumulate hooks before this HotPath's AccumulateGrad hook takes it:
  // the unfused path, gaengine.fusion.FusionHooks). Takes effect at the next backward.
  void set_fused(const std::vector<bool>& which) {
    TORCH_CHECK_VALUE(which.size() == params_.size(), "set_fused needs one flag per parameter (", params_.size(),
                      "), got ", which.size());
    const bool any = std::find(which.begin(), which.end(), true) != which.end();
    TORCH_CHECK_VALUE(!any || wgrad_op_.has_value(), "gradient accumulation fusion needs wgrad_accumulate_ in the ",
                      "namespace of this HotPath's kernels, which has none (the compiled backends' namespace has it)");
    std::lock_guard<std::mutex> registry(fusion_mutex());
    auto& owners = fusion_owners();
    for (size_t i = 0; i < params_.size(); ++i) {
      const c10::TensorImpl* key = params_[i].unsafeGetTensorImpl();
      if (which[i]) {
        owners[key] = {this, static_cast<int64_t>(i)};
      } else {
        auto it = owners.find(key);
        if (it != owners.end() && it->second.hot == this) owners.erase(it);
      }
    }
  }

  // fused_linear's backward (take_fused_gradients, with the registry lock held): write or add the gradient of
  // parameter weight_index (a Linear weight, (out, in)) and/or bias_index (its bias, (out,)), -1 for none, into
  // their main_grad slices with one wgrad_accumulate_ call (transposed: a weight (in, out), whose gradient
  // input^T @ grad_output is a call with the operands swapped, and the bias a second call). grad_output: (N, out),
  // input: (N, in). Each parameter
  // counts as arrived at its AccumulateGrad hook, which autograd still runs (with no p.grad, or with the gradient
  // of the parameter's other, unfused uses, which is then added).
  void fuse(int64_t weight_index, int64_t bias_index, const at::Tensor& grad_output, const at::Tensor& input,
            bool transposed) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(in_backward_, "a gradient reached a parameter managed by GradientAccumulator outside acc.backward(); ",
                "call acc.backward(loss) instead of loss.backward() (or acc.close() to detach the accumulator)");
    TORCH_CHECK(acquire_.is_none(), "gaengine: gradient accumulation fusion needs main_grad, not per-bucket staging ",
                "(a bug: the accumulator refuses zero_stage=2 with gradient_accumulation_fusion)");
    std::optional<at::Tensor> dw, db;
    bool write_w = false, write_b = false;
    if (weight_index >= 0) dw = fused_destination(weight_index, write_w);
    if (bias_index >= 0) db = fused_destination(bias_index, write_b);
    if (transposed && dw.has_value()) {  // dW (in, out) = input^T @ grad_output: the op with its operands swapped
      wgrad_op_->redispatch(keys_, dw, std::nullopt, input, grad_output, write_w, false);
      ++launches_;
      if (!db.has_value()) return;
      dw.reset();
      write_w = false;
    }
    wgrad_op_->redispatch(keys_, dw, db, grad_output, input, write_w, write_b);
    ++launches_;
  }

 private:
  using HotPathCore::arrive;  // the gradients come from the hooks

  // The post-hook of parameter i's AccumulateGrad node: autograd has just summed every use of p in this autograd
  // pass into p.grad. Several passes of one backward (reentrant checkpointing) each call it.
  void on_gradient(size_t i) { receive(i, params_[i].mutable_grad()); }

  // Where parameter i's fused gradient goes, and whether the kernel writes it (write) or adds to it. Measuring the
  // sources (the noise scale needs each micro-batch's own gradient norm, which a GEMM adding into main_grad cannot
  // give): an fp32 tensor of the parameter's shape, this pass's fused uses summed in it, which its hook then holds
  // like an arrived gradient (the bucket launch adds it to main_grad exactly and measures it). Otherwise its
  // main_grad slice (claim()).
  at::Tensor fused_destination(int64_t i, bool& write) {
    fused_[i] = 1;
    if (!source_table_.defined()) {
      write = claim(i);
      return slice(i);
    }
    at::Tensor& source = fused_sources_[i];
    write = !source.defined();
    if (write) source = at::empty(params_[i].sizes(), like_.options());
    return source;
  }

  // Parameter i's slice is about to receive a fused gradient: whether the kernel writes it (the window's first
  // contribution) or adds to it. Its next hook call counts an arrival even without p.grad; the free-norm and
  // source partials of this micro-batch no longer cover every value written (step() reads the buffer once).
  bool claim(int64_t i) {
    fused_[i] = 1;
    norm_missed_ = true;
    if (source_table_.defined()) sources_inexact_.back() = true;
    if (held_at_[i] >= 0) {  // an earlier arrival of this micro-batch is held: it adds to what the kernel writes
      Held& h = held_[bucket_of_[i]][held_at_[i]];
      return std::exchange(h.overwrite, false);
    }
    if (written_[i]) return false;
    written_[i] = 1;
    if (learning_) arrival_.push_back(i);
    return true;
  }

  std::optional<c10::TypedOperatorHandle<WgradAccumulateKernel>> wgrad_op_;  // its wgrad_accumulate_, if any
  // The owning pointer to a node: c10::intrusive_ptr from torch 2.12 on, std::shared_ptr before.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> nodes_;
  std::vector<uintptr_t> keys_of_hooks_;
};

}  // namespace

FusedTaken take_fused_gradients(int64_t weight_key, int64_t bias_key, const at::Tensor& grad_output,
                                const at::Tensor& input, bool want_weight, bool want_bias, bool transposed) {
  std::lock_guard<std::mutex> registry(fusion_mutex());
  const auto& owners = fusion_owners();
  auto owner = [&](int64_t key, bool want) {
    if (!want || key == 0) return FusedOwner{};
    const auto it = owners.find(reinterpret_cast<const c10::TensorImpl*>(static_cast<intptr_t>(key)));
    return it == owners.end() ? FusedOwner{} : it->second;
  };
  const FusedOwner w = owner(weight_key, want_weight), b = owner(bias_key, want_bias);
  if (w.hot != nullptr && w.hot == b.hot) {
    w.hot->fuse(w.index, b.index, grad_output, input, transposed);  // one kernel call for both
  } else {
    if (w.hot != nullptr) w.hot->fuse(w.index, -1, grad_output, input, transposed);
    if (b.hot != nullptr) b.hot->fuse(-1, b.index, grad_output, input, transposed);
  }
  return {w.hot != nullptr, b.hot != nullptr};
}

namespace {

// What HotPathCore and HotPath both bind: the window's calls and state. Each class binds them on its own (no Python
// base class), so that neither has the other's way in: arrive() only on the core, set_fusion() only on the front.
template <class T>
py::class_<T>& bind_core(py::class_<T>& cls) {
  return cls
      .def(py::init<std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, std::vector<int64_t>,
                    const at::Tensor&, int64_t, std::vector<int64_t>, py::object, const std::string&>(),
           py::arg("params"), py::arg("main_grad"), py::arg("offsets"), py::arg("bucket_of"), py::arg("partials_like"),
           py::arg("partials_dim"), py::arg("partials_extent"), py::arg("on_bucket_ready"),
           py::arg("op_namespace") = std::string(GAENGINE_OP_NAMESPACE_NAME))
      .def("begin", &T::begin, "start of a micro-batch's backward", py::arg("want_norm"), py::arg("armed"),
           py::call_guard<py::gil_scoped_release>())
      .def("end", &T::end, "after backward: accumulate the incomplete buckets",
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &T::abort, "backward raised: drop what is held", py::call_guard<py::gil_scoped_release>())
      .def("close", &T::close, "drop what is held (HotPath: and remove the hooks)",
           py::call_guard<py::gil_scoped_release>())
      .def("norm_partials", &T::norm_partials, "the last micro-batch's free-norm partials, or None")
      .def("set_measure_sources", &T::set_measure_sources,
           "write the sources' partials in every micro-batch from the next begin() (False: stop and forget them)",
           py::arg("on"))
      .def("source_partials", &T::source_partials,
           "(tables, inexact): one source-partials table per micro-batch since clear_sources(), and which are inexact")
      .def("clear_sources", &T::clear_sources, "forget the source-partials tables")
      .def("written", &T::written, "per parameter: written in this window")
      .def("set_all_written", &T::set_all_written, py::arg("values"))
      .def("arrival", &T::arrival, "first-arrival order being learned, or None")
      .def("set_arrival", &T::set_arrival, "learn from first arrivals after `order` (None: stop)", py::arg("order"))
      .def("expected_arrivals", &T::expected_arrivals, "per parameter: gradient arrivals per backward, learned")
      .def("set_expected_arrivals", &T::set_expected_arrivals, py::arg("values"))
      .def("take_stale", &T::take_stale, "a gradient was dropped outside acc.backward() (clears the flag)")
      .def("launches", &T::launches, "accumulate launches since construction")
      .def("num_buckets", &T::num_buckets)
      .def("set_acquire", &T::set_acquire, "write each bucket into acquire(b) (None: into main_grad)",
           py::arg("acquire"), py::arg("bucket_base"));
}

}  // namespace

void register_hot_path(py::module_& m) {
  py::class_<HotPathCore> core(m, "HotPathCore",
                               "The accumulator's per-parameter work with the gradients handed over by the caller "
                               "(arrive; FSDP2's shards), no hook (csrc/hot_path.cpp; bound in gaengine/hot_path.py)");
  bind_core(core).def("arrive", &HotPathCore::arrive, "parameter index's gradient, handed over", py::arg("index"),
                      py::arg("grad"), py::call_guard<py::gil_scoped_release>());
  py::class_<HotPath> hooked(m, "HotPath",
                             "The accumulator's per-parameter work in C++ post-hooks on AccumulateGrad nodes "
                             "(csrc/hot_path.cpp; bound in gaengine/hot_path.py)");
  bind_core(hooked)
      .def("set_fusion", &HotPath::set_fusion,
           "gradient accumulation fusion: fused_linear's backward writes these parameters' gradients into main_grad",
           py::arg("on"), py::call_guard<py::gil_scoped_release>())
      .def("set_fused", &HotPath::set_fused,
           "gradient accumulation fusion per parameter: which[i] False gives parameter i its ordinary gradient",
           py::arg("which"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace gaengine
