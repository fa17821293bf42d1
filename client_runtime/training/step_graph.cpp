#include "client_runtime/training/step_graph.h"

#include <c10/util/Exception.h>

#include <optional>

#ifdef SYMBIOSIS_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>

#include "common/cuda.h"
#endif

namespace symbiosis {

#ifdef SYMBIOSIS_WITH_CUDA
namespace {

// [Hardware queues]
// CUDA spreads a process's streams over CUDA_DEVICE_MAX_CONNECTIONS hardware queues, 8 unless set,
// and a stream's wait on the GPU holds back whatever shares its queue. A captured step's stream
// waits for the executor's results, and the executor's run launched ahead waits for the step's
// inputs ([Steps launched ahead] in transport/cuda_ipc/cuda_ipc_channel.cpp): with eight
// generators decoding in threads of one process, steps stood behind one another's waits until the
// executor dropped a client after 5 s (benchmarks-history.md, V29 and V30), and with 32 queues in
// that process they did not (V31, V33). The executor asks for 32 itself (base_executor/main.cpp).
// A client's process does not: under MPS every process's queues come from one pool, and 32 in
// each ran the GPU tests' processes out of it (V32). So a process with more steps running at once
// than queues to spare says so, once, and how to give it more.
class RunningSteps {
 public:
  RunningSteps() {
    const int now = running_.fetch_add(1) + 1;
    static const int queues = [] {
      const char* set = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
      const int asked = set != nullptr ? std::atoi(set) : 0;
      return asked > 0 ? asked : 8;  // CUDA's default
    }();
    // One queue stays for the rest of the process's work (its default stream's among it).
    if (now < queues || warned_.exchange(true)) return;
    spdlog::warn(
        "{} captured steps run at once in this process, over {} hardware queues: a step's wait for the executor "
        "may hold back another's, until the executor drops a client that stood still 5 s; set "
        "CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment the process starts in (under MPS every process's "
        "queues come from one pool)",
        now, queues);
  }
  ~RunningSteps() { running_.fetch_sub(1); }

 private:
  static inline std::atomic<int> running_{0};
  static inline std::atomic<bool> warned_{false};
};

}  // namespace
#endif

struct StepGraph::Impl {
  std::function<void()> compute, apply;
  std::shared_ptr<Client> client;
  StepGraphOptions options;
  int runs = 0;

  bool launched = false;  // launch() ran, finish() not yet

  // What finish() does after a launch: settle (an executor error throws here), then apply, eagerly
  // before the capture and from the apply graph after it.
  void apply_settled() const {
    if (client) client->settle();
#ifdef SYMBIOSIS_WITH_CUDA
    if (apply_graph) return apply_graph->replay();
#endif
    if (apply) apply();
  }

#ifdef SYMBIOSIS_WITH_CUDA
  // Warm-up, capture and replays all run on this stream: a graph is captured on a stream of its
  // own, and a client's calls order after the stream of its previous call. It is one of the [Kept
  // streams] (common/cuda.h), which no other StepGraph uses while this one lives: from LibTorch's
  // pool, which hands its 32 streams a priority out in turn, two of more than 32 captured steps
  // alive in a process (many generators' decode buckets) shared one, and a capture on it (relaxed)
  // took in the other's replay instead of running it.
  std::optional<c10::cuda::CUDAStream> stream;
  std::unique_ptr<at::cuda::CUDAGraph> compute_graph, apply_graph;  // apply_graph shares compute_graph's memory
  std::shared_ptr<const CapturedCalls> calls;                       // what compute_graph's replays send
  // Order each run after the caller's stream and the caller's later work after it; made once.
  c10::cuda::CUDAEvent caller_ready, step_done;
  std::optional<c10::cuda::CUDAStream> caller;  // the launch's current stream, which finish() orders
  std::optional<RunningSteps> running;          // from launch to finish

  ~Impl() {
    // The graphs' memory goes back to the allocator with them: the GPU must be done with it. Then
    // the stream goes to the next StepGraph.
    if (!stream) return;
    stream->synchronize();
    apply_graph.reset();
    compute_graph.reset();
    cuda::KeptStreams::instance().give_back({stream->stream(), stream->device_index()}, /*high_priority=*/!apply);
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
    std::optional<cuda::CallsStartEarly> early;  // [Early dependents] (common/cuda.h): a decode step's
    if (!apply) early.emplace();
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
      if (client && cuda::CallsStartEarly::here()) {  // [Early dependents]
        spdlog::warn(
            "StepGraph: the step could not be captured with its calls starting the next kernel early "
            "({}); capturing it, and every later step of this process, without",
            e.what_without_backtrace());
        cuda::CallsStartEarly::stop();
        early.reset();
        (void)cudaGetLastError();  // the refused enqueue's error must not fail the next launch's check
        return capture_step();
      }
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
    // [Cache kept after a capture]
    // A training step's eager runs leave their activations in the allocator's cache, and the graphs
    // never use them: they go back to CUDA. A decode step's (nothing to apply) are one step's, and
    // stay for the allocator to reuse: a generator captures a step for each batch size it meets
    // while it, and in a process of several the others, decode. emptyCache then frees every cached
    // segment of the process, and a cuda-ipc client has the executor close its mapping of each one
    // it shared first (SegmentFrees in transport/cuda_ipc/cuda_ipc_client.cpp), under the
    // allocator's lock: every thread that allocates waits, and the close waits for the executor's
    // whole GPU, the other generators' runs launched ahead among it (V32: 237 ms; V30: 5 s, caught
    // in a stall of [Hardware queues]).
    if (apply) c10::cuda::CUDACachingAllocator::emptyCache();
  }

  // [Executor restart] (client_runtime/client.cpp): the client connected again since the capture,
  // and the graph signals the old connection's slots: the step is captured anew.
  void forget_capture() {
    stream->synchronize();
    apply_graph.reset();
    compute_graph.reset();
    calls.reset();
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
    const int index = device.has_index() ? device.index() : 0;
    const auto kept = cuda::KeptStreams::instance().take(index, /*high_priority=*/decode);
    impl_->stream = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(kept.handle), index);
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
  launch();
  finish();
}

void StepGraph::launch() {
  auto& s = *impl_;
  TORCH_CHECK(!s.launched, "StepGraph::launch: the last launch was not finished");
#ifdef SYMBIOSIS_WITH_CUDA
  if (s.stream) {
    s.running.emplace();  // [Hardware queues]
    try {
      c10::cuda::CUDAGuard device_guard(s.stream->device_index());
      s.caller = c10::cuda::getCurrentCUDAStream(s.stream->device_index());
      s.caller_ready.record(*s.caller);
      s.caller_ready.block(*s.stream);
      c10::cuda::CUDAStreamGuard on_side_stream(*s.stream);
      if (s.runs < s.options.warmup) {
        s.runs++;
        s.compute();
      } else {
        if (s.compute_graph && s.client && s.calls && !s.client->replayable(*s.calls)) s.forget_capture();
        if (!s.compute_graph) s.capture_step();
        s.compute_graph->replay();
        if (s.client) s.client->replay(*s.calls);
      }
    } catch (...) {
      s.running.reset();
      throw;
    }
    s.launched = true;
    return;
  }
#endif
  s.compute();
  s.launched = true;
}

void StepGraph::finish() {
  auto& s = *impl_;
  TORCH_CHECK(s.launched, "StepGraph::finish: nothing was launched");
  s.launched = false;
#ifdef SYMBIOSIS_WITH_CUDA
  if (s.stream) {
    c10::cuda::CUDAGuard device_guard(s.stream->device_index());
    const auto caller = *s.caller;
    const auto done = [&] {
      s.step_done.record(*s.stream);
      s.step_done.block(caller);
      s.running.reset();
    };
    try {
      c10::cuda::CUDAStreamGuard on_side_stream(*s.stream);
      s.apply_settled();
    } catch (...) {
      done();
      throw;
    }
    done();
    return;
  }
#endif
  s.apply_settled();
}

}  // namespace symbiosis
