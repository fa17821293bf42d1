#pragma once
// [Traces]
// Where a call's time goes, on one timeline with its tenants. While an operator traces the
// executor (symbiosis-ctl trace start / stop, or symbiosis-bench --trace), the scheduler's thread
// runs LibTorch's Kineto profiler: its host operations and, on a GPU, the kernels they launch, each
// batch inside a scope that names its calls:
//   symbiosis::batch <layer> <op> <tokens>t c<client>:r<request> c<client>:r<request> ...
// A client's calls are scopes "symbiosis::call c<client>:r<request> <layer> <op>", and a replay of
// captured calls "symbiosis::replay c<client>:r<first>-r<last>" (client_runtime/client.cpp), so
// bench/merge_traces.py can put the executor's trace and its tenants' on one clock (Kineto's epoch
// base, the same on one host) and link each call to the batch that computed it (docs/tracing.md).
// Not tracing, a batch pays one check of LibTorch's profiler callbacks.
// Thread safety: the Tracer belongs to the scheduler's thread, where the profiler runs; the
// scheduler writes a trace still running when it stops, so that stopping the executor loses none.
#include <cstdint>
#include <string>

#include "base_executor/batch_runner.h"

namespace symbiosis {

class Tracer {
 public:
  Tracer() = default;
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Starts the profiler on the calling thread: host operations, and the GPU's kernels with `cuda`.
  // `batches_so_far`: the executor's batch count now. Throws, naming the problem, when a trace
  // runs already or `path` cannot be written.
  void start(const std::string& path, bool cuda, uint64_t batches_so_far);
  // Stops the profiler and writes the trace to start's path; returns the batches run meanwhile.
  // Throws when no trace runs.
  uint64_t stop(uint64_t batches_so_far);
  bool active() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;  // empty: not tracing
  uint64_t first_batch_ = 0;
};

// The scope name of a batch (above).
std::string batch_scope_name(const CallBatcher::Batch& batch, const std::string& layer_name);
const char* layer_op_name(LayerOp op);

}  // namespace symbiosis
