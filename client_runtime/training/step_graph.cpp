#include "client_runtime/training/step_graph.h"

#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#ifdef SYMBIOSIS_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda.h"
#endif

namespace symbiosis {

#ifdef SYMBIOSIS_WITH_CUDA
namespace {

// [Step streams]
// Each StepGraph runs on a stream no other StepGraph uses while it lives. LibTorch's pool hands its
// 32 streams a priority out in turn, so in a process with more than 32 captured steps alive (many
// generators' decode buckets, each a StepGraph) two would share one; a capture on it (relaxed)
// then takes in the other's replay instead of running it, and that other's calls wait at the
// executor for inputs that never come, until its watchdog drops the client. The streams are kept
// for the process's life and handed to the next StepGraph when one goes: a client orders its next
// call after the stream of its last, which must outlive the StepGraph it came from. Never
// destroyed.
class StepStreams {
 public:
  static StepStreams& instance() {
    static auto* streams = new StepStreams();
    return *streams;
  }
  c10::cuda::CUDAStream take(c10::DeviceIndex device, bool high_priority) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = free_[{device, high_priority}];
    if (free.empty()) {
      owned_.push_back(cuda::OwnedStream::create(device, high_priority));
      free.push_back(static_cast<cudaStream_t>(owned_.back().get().handle));
    }
    const cudaStream_t stream = free.back();
    free.pop_back();
    return c10::cuda::getStreamFromExternal(stream, device);
  }
  void give_back(const c10::cuda::CUDAStream& stream, bool high_priority) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[{stream.device_index(), high_priority}].push_back(stream.stream());
  }

 private:
  std::mutex mutex_;
  std::vector<cuda::OwnedStream> owned_;
  std::map<std::pair<c10::DeviceIndex, bool>, std::vector<cudaStream_t>> free_;  // by device and priority
};

}  // namespace
#endif

struct StepGraph::Impl {
  std::function<void()> compute, apply;
  std::shared_ptr<Client> client;
  StepGraphOptions options;
  int runs = 0;

  void eager() const {
    compute();
    if (client) client->settle();
    if (apply) apply();
  }

#ifdef SYMBIOSIS_WITH_CUDA
  // Warm-up, capture and replays all run on this stream: a graph is captured on a stream of its
  // own, and a client's calls order after the stream of its previous call ([Step streams]).
  std::optional<c10::cuda::CUDAStream> stream;
  std::unique_ptr<at::cuda::CUDAGraph> compute_graph, apply_graph;  // apply_graph shares compute_graph's memory
  std::shared_ptr<const CapturedCalls> calls;                       // what compute_graph's replays send
  // Order each run after the caller's stream and the caller's later work after it; made once.
  c10::cuda::CUDAEvent caller_ready, step_done;

  ~Impl() {
    // The graphs' memory goes back to the allocator with them: the GPU must be done with it. Then
    // the stream goes to the next StepGraph.
    if (!stream) return;
    stream->synchronize();
    apply_graph.reset();
    compute_graph.reset();
    StepStreams::instance().give_back(*stream, /*high_priority=*/!apply);
  }

  // Captures `part` into `graph` on the current stream (the side stream). Relaxed: the client
  // shares the new segments of the graph's memory with the executor while capturing.
  static void capture(at::cuda::CUDAGraph& graph, const std::function<void()>& part, c10::MempoolId_t pool) {
    graph.capture_begin(pool, cudaStreamCaptureModeRelaxed);
    try {
      part();
    } catch (...) {
      try {
        graph.capture_end();  // ends the stream's capture and the allocator's use of the graph's pool
      } catch (const c10::Error&) {
      }
      throw;
    }
    graph.capture_end();
  }

  void capture_step() {
    // A client that cannot be captured says why here, before any graph exists: captured() stays
    // false and the caller may go on eagerly.
    if (client) client->begin_capture();
    compute_graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      capture(*compute_graph, compute, {0, 0});
    } catch (const ResultsLost&) {
      // [Executor restart]: the client connected again during the capture; the caller runs the
      // step again, and it is captured then.
      client->end_capture();
      compute_graph.reset();
      throw;
    } catch (const c10::Error& e) {
      if (client) client->end_capture();
      compute_graph.reset();
      TORCH_CHECK(false, "StepGraph: the step could not be captured in a CUDA graph (", e.what_without_backtrace(),
                  "); run it with StepGraphOptions::capture = false");
    }
    if (client) calls = client->end_capture();
    if (apply) {
      // Shares the compute graph's pool: the two are always replayed in the order they were captured.
      apply_graph = std::make_unique<at::cuda::CUDAGraph>();
      try {
        capture(*apply_graph, apply, compute_graph->pool());
      } catch (const c10::Error& e) {
        apply_graph.reset();
        compute_graph.reset();
        calls.reset();
        TORCH_CHECK(false, "StepGraph: the step's apply could not be captured in a CUDA graph (",
                    e.what_without_backtrace(), "); run it with StepGraphOptions::capture = false");
      }
    }
    // The eager runs' blocks stay in the allocator's cache, and the graphs never use them.
    c10::cuda::CUDACachingAllocator::emptyCache();
  }

  // [Executor restart] (client_runtime/client.cpp): the client connected again since the capture,
  // and the graph signals the old connection's slots: the step is captured anew.
  void forget_capture() {
    stream->synchronize();
    apply_graph.reset();
    compute_graph.reset();
    calls.reset();
  }

  void replay() const {
    compute_graph->replay();
    if (client) {
      client->replay(*calls);
      client->settle();
    }
    if (apply_graph) apply_graph->replay();
  }
#endif
};

StepGraph::StepGraph(std::function<void()> compute, std::function<void()> apply, std::shared_ptr<Client> client,
                     at::Device device, StepGraphOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(options.warmup >= 1, "StepGraphOptions::warmup must be at least 1, got ", options.warmup);
  TORCH_CHECK(compute, "StepGraph needs a compute function");
  impl_->compute = std::move(compute);
  impl_->apply = std::move(apply);
  impl_->client = std::move(client);
  impl_->options = options;
#ifdef SYMBIOSIS_WITH_CUDA
  // A client that cannot be captured (a tenant on another GPU over NCCL, or over tcp) runs eagerly.
  impl_->options.capture = options.capture && (!impl_->client || impl_->client->can_capture());
  if (device.is_cuda() && impl_->options.capture) {
    // [Inference first on the GPU]: a step with nothing to apply is a decode step; its kernels go on a
    // high-priority stream, so that the GPU starts their blocks before those of training work queued
    // beside them (under MPS, other processes' too).
    const bool decode = !impl_->apply;
    impl_->stream = StepStreams::instance().take(device.has_index() ? device.index() : 0, /*high_priority=*/decode);
  }
#endif
}

StepGraph::~StepGraph() = default;

bool StepGraph::captures() const {
#ifdef SYMBIOSIS_WITH_CUDA
  return impl_->stream.has_value();
#else
  return false;
#endif
}

bool StepGraph::captured() const {
#ifdef SYMBIOSIS_WITH_CUDA
  return impl_->compute_graph != nullptr;
#else
  return false;
#endif
}

void StepGraph::run() {
  auto& s = *impl_;
#ifdef SYMBIOSIS_WITH_CUDA
  if (s.stream) {
    c10::cuda::CUDAGuard device_guard(s.stream->device_index());
    const auto caller = c10::cuda::getCurrentCUDAStream(s.stream->device_index());
    s.caller_ready.record(caller);
    s.caller_ready.block(*s.stream);
    {
      c10::cuda::CUDAStreamGuard on_side_stream(*s.stream);
      if (s.runs < s.options.warmup) {
        s.runs++;
        s.eager();
      } else {
        if (s.compute_graph && s.client && s.calls && !s.client->replayable(*s.calls)) s.forget_capture();
        if (!s.compute_graph) s.capture_step();
        s.replay();
      }
    }
    s.step_done.record(*s.stream);
    s.step_done.block(caller);
    return;
  }
#endif
  s.eager();
}

}  // namespace symbiosis
