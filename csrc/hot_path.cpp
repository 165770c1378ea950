// gaengine._C.HotPath: the per-parameter work of GradientAccumulator, in C++ hooks on AccumulateGrad nodes.
//
// On a GPU the plain recipe is launch-bound, so every host microsecond per parameter is wall time. torch DDP's
// Reducer (torch/csrc/distributed/c10d/reducer.cpp) registers a C++ post-hook on each parameter's AccumulateGrad
// node and keeps the nodes alive; HotPath does the same, and everything that happens per parameter per
// micro-batch happens here, with no Python and no GIL:
//
//   * take the gradient out of p.grad at once (p.grad = None: autograd's next use of p starts afresh),
//   * micro-batch 0 of the window writes main_grad, later ones add (the window's `written` flags),
//   * hold the gradient until every parameter of its bucket has arrived, then accumulate the whole bucket in one
//     launch (CPU: one parallel region, csrc/cpu_ops.cpp; CUDA: one multi-tensor kernel, csrc/cuda/) and drop
//     the held gradients; "aten" kernels (any device without ours) add each gradient at once with one ATen op,
//   * in the window's last micro-batch, the free-norm partials of the values written, and, when the micro-batch
//     is armed (several ranks), the Python callback `on_bucket_ready(b)` once per complete bucket, which starts
//     that bucket's asynchronous all-reduce: the only Python entered from a hook, at most once per bucket,
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
#include <torch/extension.h>

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
#include <utility>
#include <vector>

#include "cpu_ops.h"
#if defined(GAENGINE_WITH_CUDA)
#include "cuda/bucket_ops.h"
#endif

namespace gaengine {
namespace {

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

enum class Kernels { kCpu, kCuda, kAten };

Kernels parse_kernels(const std::string& name, const at::Tensor& main_grad) {
  if (name == "cpu") {
    TORCH_CHECK_VALUE(main_grad.device().is_cpu(), "kernels='cpu' needs a CPU main_grad, got ", main_grad.device());
    return Kernels::kCpu;
  }
  if (name == "cuda") {
#if defined(GAENGINE_WITH_CUDA)
    TORCH_CHECK_VALUE(GAENGINE_IS_CUDA_TENSOR(main_grad), "kernels='cuda' needs a CUDA main_grad, got ",
                      main_grad.device());
    return Kernels::kCuda;
#else
    TORCH_CHECK_VALUE(false, "kernels='cuda': gaengine._C was built without its CUDA kernels");
#endif
  }
  TORCH_CHECK_VALUE(name == "aten", "kernels must be 'cpu', 'cuda' or 'aten', got '", name, "'");
  return Kernels::kAten;
}

class HotPath {
 public:
  // params: the accumulator's parameters in layout order (leaf tensors that require grad, all on main_grad's
  //   device). main_grad: (n,) fp32 contiguous, the flat buffer; offsets[i]: where parameter i starts in it.
  // bucket_of[i]: parameter i's bucket (buckets are runs of consecutive parameters, 0 .. n_buckets - 1).
  // kernels: "cpu" | "cuda" | "aten". on_bucket_ready: a Python callable(int), or None.
  HotPath(std::vector<at::Tensor> params, at::Tensor main_grad, std::vector<int64_t> offsets,
          std::vector<int64_t> bucket_of, const std::string& kernels, py::object on_bucket_ready)
      : params_(std::move(params)),
        main_grad_(std::move(main_grad)),
        offsets_(std::move(offsets)),
        bucket_of_(std::move(bucket_of)),
        kernels_(parse_kernels(kernels, main_grad_)),
        on_bucket_ready_(std::move(on_bucket_ready)) {
    const size_t n = params_.size();
    TORCH_CHECK_VALUE(n > 0, "params must not be empty");
    TORCH_CHECK_VALUE(offsets_.size() == n && bucket_of_.size() == n, "params, offsets and bucket_of must have the ",
                      "same length, got ", n, ", ", offsets_.size(), " and ", bucket_of_.size());
    TORCH_CHECK_VALUE(main_grad_.scalar_type() == at::kFloat && main_grad_.is_contiguous() && main_grad_.dim() == 1,
                      "main_grad must be a 1-d contiguous float32 tensor");
    int64_t n_buckets = 0;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& p = params_[i];
      TORCH_CHECK_VALUE(p.requires_grad() && p.is_leaf(), "params[", i, "] must be a leaf tensor that requires grad");
      TORCH_CHECK_VALUE(p.device() == main_grad_.device(), "params[", i, "] is on ", p.device(), ", main_grad on ",
                        main_grad_.device());
      TORCH_CHECK_VALUE(offsets_[i] >= 0 && offsets_[i] + p.numel() <= main_grad_.numel(), "offsets[", i,
                        "] puts params[", i, "] outside main_grad");
      TORCH_CHECK_VALUE(bucket_of_[i] == n_buckets || (n_buckets > 0 && bucket_of_[i] == n_buckets - 1),
                        "bucket_of must number runs of consecutive parameters 0, 1, 2, ...; got ", bucket_of_[i],
                        " at index ", i);
      n_buckets = bucket_of_[i] + 1;
    }
    bucket_size_.assign(n_buckets, 0);
    for (int64_t b : bucket_of_) ++bucket_size_[b];
    written_.assign(n, 0);
    arrivals_.assign(n, 0);
    expected_.assign(n, 1);
    held_at_.assign(n, -1);
    held_.resize(n_buckets);
    pending_ = bucket_size_;
    // One hook per parameter on its AccumulateGrad node, which we keep alive (a parameter holds its node only
    // weakly, and a node made afresh would not carry the hook).
    nodes_.reserve(n);
    keys_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      c10::intrusive_ptr<Node> node = torch::autograd::impl::grad_accumulator(params_[i]);
      TORCH_CHECK(node, "params[", i, "] has no AccumulateGrad node");
      keys_.push_back(node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const variable_list& outputs, const variable_list& /*inputs*/) {
            on_gradient(i);
            return outputs;
          })));
      nodes_.push_back(std::move(node));
    }
  }

  ~HotPath() { close(); }

  HotPath(const HotPath&) = delete;
  HotPath& operator=(const HotPath&) = delete;

  // Remove the hooks (idempotent). Gradients held for an incomplete bucket are dropped.
  void close() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < nodes_.size(); ++i) nodes_[i]->del_post_hook(keys_[i]);
    nodes_.clear();
    keys_.clear();
    drop_held();
  }

  // Start of one micro-batch's backward. want_norm: write the free-norm partials (the window's last micro-batch
  // on one rank). armed: call on_bucket_ready for each bucket completed in this micro-batch.
  void begin(bool want_norm, bool armed) {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_held();
    std::fill(arrivals_.begin(), arrivals_.end(), 0);
    std::fill(pending_.begin(), pending_.end(), 0);
    for (size_t i = 0; i < params_.size(); ++i) pending_[bucket_of_[i]] += expected_[i];
    arrived_ = 0;
    norm_missed_ = false;
    late_.clear();
    late_count_ = 0;
    armed_ = armed;
    want_norm_ = want_norm;
    if (want_norm) {
      if (kernels_ == Kernels::kCpu) {
        partials_ = at::empty({static_cast<int64_t>(params_.size()), 2}, at::dtype(at::kDouble));
      } else {
#if defined(GAENGINE_WITH_CUDA)
        if (kernels_ == Kernels::kCuda) prepare_cuda_partials();
#endif
      }
    } else {
      partials_ = at::Tensor();
    }
    in_backward_ = true;
  }

  // After autograd returned: accumulate the buckets left incomplete (parameters that got no gradient).
  void end() {
    std::lock_guard<std::mutex> lock(mutex_);
    in_backward_ = false;
    if (!late_.empty()) {
      const std::string first = std::exchange(late_, std::string());
      const int64_t n = std::exchange(late_count_, 0);
      TORCH_CHECK(false, first, n > 1 ? c10::str(" (and ", n - 1, " more late arrival(s))") : std::string(),
                  " (a layer shared by reentrant-checkpointed segments, or a graph that changed) after its bucket's ",
                  "all-reduce had started, so the window cannot be reduced exactly. The accumulator has learned the ",
                  "new counts: call acc.zero_grad() and run the window again");
    }
    for (size_t b = 0; b < held_.size(); ++b) {
      if (!held_[b].empty()) launch(b);
    }
  }

  // Backward raised: forget what is held (the window is no longer a sum of whole micro-batches).
  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    in_backward_ = false;
    drop_held();
    partials_ = at::Tensor();
  }

  // The free-norm partials of the last micro-batch when they cover every parameter, else None. CPU: (P, 2)
  // float64 rows (sum of squares, found_inf) per parameter; CUDA: (2, n_chunks) float32 per-chunk partials.
  std::optional<at::Tensor> norm_partials() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!partials_.defined() || norm_missed_ || arrived_ != static_cast<int64_t>(params_.size())) return std::nullopt;
    return partials_;
  }

  std::vector<bool> written() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {written_.begin(), written_.end()};
  }

  void set_written(int64_t index, bool value) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(written_.size()), "index ", index,
                      " out of range for ", written_.size(), " parameters");
    written_[index] = value;
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

  int64_t launches() {
    std::lock_guard<std::mutex> lock(mutex_);
    return launches_;
  }

  int64_t num_buckets() const { return static_cast<int64_t>(bucket_size_.size()); }

 private:
  struct Held {
    int64_t index;
    at::Tensor grad;
    bool overwrite;
    c10::Stream stream;  // current at the hook that made it ready (CPU: the one default stream)
  };

  c10::Stream current_stream() const {
    return c10::impl::getDeviceGuardImpl(main_grad_.device().type())->getStream(main_grad_.device());
  }

  // Make `stream` safe to read `h.grad`: wait for the stream that produced it, and tell the caching allocator
  // that `stream` uses its memory (DDP's reducer does the same). Nothing to do on one stream (always on CPU).
  void use_on(const Held& h, const c10::Stream& stream) const {
    if (h.stream == stream) return;
    c10::Event ready(stream.device_type());
    ready.record(h.stream);
    ready.block(stream);
    c10::impl::getDeviceGuardImpl(stream.device_type())
        ->recordDataPtrOnStream(h.grad.storage().data_ptr(), stream);
  }

  void drop_held() {
    for (auto& held : held_) held.clear();
    std::fill(held_at_.begin(), held_at_.end(), -1);
  }

  // The post-hook of parameter i's AccumulateGrad node: autograd has just summed every use of p in this autograd
  // pass into p.grad. Several passes of one backward (reentrant checkpointing) each call it.
  void on_gradient(size_t i) {
    int64_t ready = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      at::Tensor& slot = params_[i].mutable_grad();
      if (!slot.defined()) return;
      if (!in_backward_) {
        slot.reset();  // nothing is accumulated; the window stays intact
        stale_ = true;
        TORCH_CHECK(false, "a gradient reached a parameter managed by GradientAccumulator outside acc.backward(); ",
                    "call acc.backward(loss) instead of loss.backward() (or acc.close() to detach the accumulator)");
      }
      if (slot.layout() != c10::kStrided) {
        const auto layout = slot.layout();
        slot.reset();
        TORCH_CHECK_VALUE(false, "parameter ", i, " (shape ", params_[i].sizes(), ") received a ", layout,
                          " gradient; gaengine accumulates dense gradients only (build embeddings with sparse=False)");
      }
      at::Tensor grad = std::move(slot);  // the parameter lets go of its low-precision gradient at once
      slot.reset();
      if (!grad.is_contiguous()) grad = grad.contiguous();
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
      if (kernels_ == Kernels::kAten) {
        accumulate_aten(i, grad, overwrite);  // a later arrival adds to what the earlier one wrote
      } else if (held_at_[i] >= 0) {
        combine(held_[b][held_at_[i]], grad);
      } else {
        held_at_[i] = static_cast<int64_t>(held_[b].size());
        held_[b].push_back({static_cast<int64_t>(i), std::move(grad), overwrite, current_stream()});
        if (pending_[b] == 0) {
          norm_missed_ = true;  // bucket b was launched already: this arrival goes on its own
          launch(b);
        }
      }
      if (counts && --pending_[b] == 0) {
        if (!held_[b].empty()) launch(b);
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
  // + this one, each one IEEE fp32 add), written over the slice. Runs on the current stream.
  void combine(Held& h, const at::Tensor& grad) {
    const c10::Stream stream = current_stream();
    use_on(h, stream);
    const at::Tensor earlier = h.grad.reshape({-1});
    at::Tensor sum = h.overwrite ? earlier.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                                 : at::add(main_grad_.narrow(0, offsets_[h.index], earlier.numel()), earlier);
    sum.add_(grad.reshape({-1}));
    h.grad = std::move(sum);
    h.overwrite = true;
    h.stream = stream;
  }

  void accumulate_aten(size_t i, const at::Tensor& grad, bool overwrite) {
    at::Tensor view = main_grad_.narrow(0, offsets_[i], params_[i].numel());
    const at::Tensor src = grad.reshape({-1});
    if (overwrite) {
      view.copy_(src);
    } else {
      view.add_(src);
    }
    ++launches_;
  }

  // Accumulate bucket b's held gradients in one launch and drop them. Called with the mutex held.
  void launch(size_t b) {
    std::vector<Held>& held = held_[b];
    std::sort(held.begin(), held.end(), [](const Held& x, const Held& y) { return x.index < y.index; });
    if (kernels_ == Kernels::kCpu) {
      std::vector<BucketSource> sources;
      sources.reserve(held.size());
      double* partials = partials_.defined() ? partials_.data_ptr<double>() : nullptr;
      float* dst = main_grad_.data_ptr<float>();
      for (const Held& h : held) {
        sources.push_back({&h.grad, dst + offsets_[h.index], h.grad.numel(), h.overwrite,
                           partials == nullptr ? nullptr : partials + 2 * h.index});
      }
      accumulate_bucket_cpu(sources);
      ++launches_;
    }
#if defined(GAENGINE_WITH_CUDA)
    if (kernels_ == Kernels::kCuda) launch_cuda(b, held);
#endif
    for (const Held& h : held) held_at_[h.index] = -1;
    held.clear();
  }

#if defined(GAENGINE_WITH_CUDA)
  // Per-chunk partials of the whole buffer: bucket b's columns start at chunk_offset_[b] and are written only
  // when its launch holds all of its parameters (a complete bucket), so a complete micro-batch covers them all.
  void prepare_cuda_partials() {
    if (chunk_offset_.empty()) {
      int64_t total = 0;
      size_t i = 0;
      for (size_t b = 0; b < bucket_size_.size(); ++b) {
        chunk_offset_.push_back(total);
        std::vector<int64_t> numels;
        for (int64_t k = 0; k < bucket_size_[b]; ++k, ++i) numels.push_back(params_[i].numel());
        total += bucket_num_chunks(numels);
      }
      total_chunks_ = total;
    }
    // (2, 0) when every parameter is empty: sum_partials_cuda reduces no column to (0, 0), reading nothing.
    partials_ = at::empty({2, total_chunks_}, main_grad_.options());
    partials_stream_ = current_stream();
  }

  void launch_cuda(size_t b, const std::vector<Held>& held) {
    const c10::Stream stream = current_stream();
    for (const Held& h : held) use_on(h, stream);
    std::vector<at::Tensor> srcs;
    std::vector<int64_t> offsets;
    std::vector<uint8_t> overwrite;
    srcs.reserve(held.size());
    offsets.reserve(held.size());
    overwrite.reserve(held.size());
    for (const Held& h : held) {
      srcs.push_back(h.grad);
      offsets.push_back(offsets_[h.index]);
      overwrite.push_back(h.overwrite ? 1 : 0);
    }
    const bool complete = static_cast<int64_t>(held.size()) == bucket_size_[b];
    float* partials = nullptr;
    int64_t partials_stride = 0;
    if (partials_.defined() && complete) {
      partials = partials_.data_ptr<float>() + chunk_offset_[b];
      partials_stride = partials_.size(1);
      if (partials_stream_.has_value() && *partials_stream_ != stream) {  // made on the caller's stream in begin()
        use_on(Held{-1, partials_, false, *partials_stream_}, stream);
      }
    }
    launches_ += accumulate_bucket_cuda(main_grad_, srcs, offsets, overwrite, partials, partials_stride);
  }

  std::vector<int64_t> chunk_offset_;
  int64_t total_chunks_ = 0;
  std::optional<c10::Stream> partials_stream_;
#endif

  std::vector<at::Tensor> params_;
  at::Tensor main_grad_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> bucket_of_;
  Kernels kernels_;
  py::object on_bucket_ready_;

  std::vector<c10::intrusive_ptr<Node>> nodes_;
  std::vector<uintptr_t> keys_;
  std::vector<int64_t> bucket_size_;

  std::mutex mutex_;
  std::vector<uint8_t> written_;        // per parameter: written in this window (later micro-batches add)
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
  bool want_norm_ = false;
  bool stale_ = false;
  at::Tensor partials_;
  int64_t launches_ = 0;
};

}  // namespace

void register_hot_path(py::module_& m) {
  py::class_<HotPath>(m, "HotPath",
                      "The accumulator's per-parameter work in C++ post-hooks on AccumulateGrad nodes "
                      "(csrc/hot_path.cpp; bound in gaengine/hot_path.py)")
      .def(py::init<std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, std::vector<int64_t>,
                    const std::string&, py::object>(),
           py::arg("params"), py::arg("main_grad"), py::arg("offsets"), py::arg("bucket_of"), py::arg("kernels"),
           py::arg("on_bucket_ready"))
      .def("begin", &HotPath::begin, "start of a micro-batch's backward", py::arg("want_norm"), py::arg("armed"),
           py::call_guard<py::gil_scoped_release>())
      .def("end", &HotPath::end, "after backward: accumulate the incomplete buckets",
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &HotPath::abort, "backward raised: drop what is held", py::call_guard<py::gil_scoped_release>())
      .def("close", &HotPath::close, "remove the hooks", py::call_guard<py::gil_scoped_release>())
      .def("norm_partials", &HotPath::norm_partials, "the last micro-batch's free-norm partials, or None")
      .def("written", &HotPath::written, "per parameter: written in this window")
      .def("set_written", &HotPath::set_written, py::arg("index"), py::arg("value"))
      .def("set_all_written", &HotPath::set_all_written, py::arg("values"))
      .def("arrival", &HotPath::arrival, "first-arrival order being learned, or None")
      .def("set_arrival", &HotPath::set_arrival, "learn from first arrivals after `order` (None: stop)",
           py::arg("order"))
      .def("expected_arrivals", &HotPath::expected_arrivals, "per parameter: gradient arrivals per backward, learned")
      .def("set_expected_arrivals", &HotPath::set_expected_arrivals, py::arg("values"))
      .def("take_stale", &HotPath::take_stale, "a gradient was dropped outside acc.backward() (clears the flag)")
      .def("launches", &HotPath::launches, "accumulate launches since construction")
      .def("num_buckets", &HotPath::num_buckets);
}

}  // namespace gaengine
