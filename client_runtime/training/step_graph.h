#pragma once
// [Captured steps]
// A training step captured once into CUDA graphs and replayed. A client's step launches some
// 1 500 kernels on a GPU, and the host work around each launch (LibTorch's dispatch, autograd's
// bookkeeping, the caching allocator) is most of a small step's time: a 1 x 128 Llama-3.2-1B step
// takes ~25 ms of host time for a few ms of GPU work (docs/benchmarks-history.md). Replayed, the
// step costs the host two graph launches and, split, the headers of its base-layer calls: each call
// was recorded at the capture with its operands in the graph's own memory, and its two hand-offs
// are ordered on the GPU through a slot of flags of its own ([Captured calls] in
// transport/call_ring.h).
//
// A step is two parts: `compute` (forward, loss and backward: the gradients) and `apply` (what
// uses them: the optimizer step). Between the two, run() settles the client (Client::settle), so
// that an executor error is thrown before the adapters are updated, as in an eager step. A step
// with nothing to apply (a decode step: [Captured decode] in inference/generator.h) passes an
// empty `apply`.
//
// What a captured step must keep to (as for any CUDA graph):
//  - the same work every time: the same shapes, its inputs read from the same tensors (copy a new
//    batch into them before run()), and its results read from the tensors it wrote at the capture;
//  - no host synchronization and no host-side decisions on GPU values inside it;
//  - the optimizer's settings fixed (a learning rate read at the capture stays).
// The first `warmup` runs are eager (lazy initializations happen outside the capture); the next one
// captures and replays. On a CPU device, with capture off, or with a client that cannot be captured
// (Client::can_capture: a tenant on another GPU over NCCL, or over tcp), every run is eager.
//
// Thread safety: one thread runs a StepGraph. Not copyable.
#include <ATen/ATen.h>

#include <functional>
#include <memory>

#include "client_runtime/client.h"

namespace symbiosis {

struct StepGraphOptions {
  bool capture = true;  // false: every run is eager
  int warmup = 3;       // eager runs before the capture (at least 1)
};

class StepGraph {
 public:
  // client: the executor connection the step's base layers call, or null (a monolithic model).
  StepGraph(std::function<void()> compute, std::function<void()> apply, std::shared_ptr<Client> client,
            at::Device device, StepGraphOptions options = {});
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // One step: compute, settle, apply. Ordered after the caller's work on its current stream, and
  // the caller's later work after it. Throws an executor error before apply.
  void run();
  // run() in two parts, so that the host may launch another step between them ([Decode halves] in
  // inference/generator.h): launch() starts the compute (replayed: the graph and its calls'
  // headers) without waiting for it; finish() settles, applies and orders the caller's current
  // stream (as at the launch) after the step. Each launch() is followed by one finish().
  void launch();
  void finish();
  bool captured() const;
  // Whether run() captures the step after its warm-up: a CUDA device, capture on and a client (if
  // any) that can be captured.
  bool captures() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace symbiosis
