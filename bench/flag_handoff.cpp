// symbiosis-bench-flag-handoff: what a GPU-to-GPU hand-off through a flag costs, with the flag in
// mapped host memory (what a captured call's input_ready and result_ready are now: [Stream-ordered
// hand-off] in transport/call_ring.h) and in device memory, against the same work on one stream.
// Two streams of one process stand for a tenant and the executor ([Steps launched ahead] in
// transport/cuda_ipc/cuda_ipc_channel.cpp): each step is `calls` calls, captured as one graph per
// stream; the tenant's graph runs its own kernels, sets a call's input flag and waits for its result
// flag; the executor's waits for the input flag, clears it, runs the GEMM and sets the result flag.
// Prints, as JSON, the step's time and each hand-off's cost over the one-stream step.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <vector>

#include "transport/cuda_ipc/cuda_ipc.h"

// flag_handoff_kernels.cu: one thread sets `set` (when given), then spins until `await` (when given)
// is non-zero and clears it.
cudaError_t flag_handoff(uint32_t* set, uint32_t* await, cudaStream_t stream);

namespace {

using namespace symbiosis;
using Clock = std::chrono::steady_clock;

struct Options {
  int calls = 65;        // a Llama-3.2-1B decode step's base-layer calls (16 layers x 4, lm_head)
  int64_t rows = 1;      // tokens a call
  int64_t hidden = 2048;
  int64_t out = 4096;
  int own_kernels = 3;   // the tenant's kernels between two calls (norms, attention, LoRA)
  int steps = 300;
};

// Flags in one place or the other: the GPU's address of each call's input_ready and result_ready.
struct Flags {
  std::vector<void*> input, result;
  at::Tensor device;                // flags in device memory
  std::unique_ptr<uint32_t[]> host;  // flags in host memory, mapped
  cuda::PinnedRange pin;
};

Flags device_flags(int calls) {
  Flags flags;
  flags.device = at::zeros({2 * calls}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA));
  auto* base = static_cast<uint32_t*>(flags.device.data_ptr());
  for (int i = 0; i < calls; ++i) {
    flags.input.push_back(base + 2 * i);
    flags.result.push_back(base + 2 * i + 1);
  }
  return flags;
}

Flags host_flags(int calls) {
  Flags flags;
  flags.host.reset(new uint32_t[2 * calls]());
  flags.pin = cuda::PinnedRange(flags.host.get(), sizeof(uint32_t) * 2 * calls, /*mapped=*/true);
  for (int i = 0; i < calls; ++i) {
    flags.input.push_back(flags.pin.device_pointer(&flags.host[2 * i]));
    flags.result.push_back(flags.pin.device_pointer(&flags.host[2 * i + 1]));
  }
  return flags;
}

struct Work {
  at::Tensor x, weight, y, scratch;
  void own_kernels(int count) {
    for (int k = 0; k < count; ++k) scratch.add_(1);
  }
  void gemm() { at::mm_out(y, x, weight.t()); }
};

double seconds_per_step(const std::function<void()>& step, int steps) {
  step();  // warm
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  return std::chrono::duration<double>(Clock::now() - start).count() / steps;
}

// One stream: each call's GEMM in place, as a monolithic process runs it.
double one_stream(const Options& o, Work& work) {
  auto stream = cuda::OwnedStream::create(0, /*high_priority=*/false);
  cuda::CurrentStreamScope scope(stream.get());
  work.own_kernels(1);
  work.gemm();  // cuBLAS's handle and workspace, before the capture
  const auto graph = cuda::CapturedWork::capture(stream.get(), [&] {
    for (int c = 0; c < o.calls; ++c) {
      work.own_kernels(o.own_kernels);
      work.gemm();
    }
  });
  return seconds_per_step([&] {
    graph.launch(stream.get());
    cuda::synchronize_stream(stream.get());
  }, o.steps);
}

void handoff_by_kernel(cuda::Stream stream, void* set, void* await) {
  TORCH_CHECK(flag_handoff(static_cast<uint32_t*>(set), static_cast<uint32_t*>(await),
                           static_cast<cudaStream_t>(stream.handle)) == cudaSuccess, "flag_handoff failed");
}

// Two streams handing each call over through `flags`, set and awaited by the driver's stream memory
// operations or, `by_kernels`, by spinning kernels.
double two_streams(const Options& o, Work& work, const Flags& flags, bool by_kernels = false) {
  auto tenant = cuda::OwnedStream::create(0, /*high_priority=*/false);
  auto executor = cuda::OwnedStream::create(0, /*high_priority=*/true);
  cuda::CapturedWork tenant_graph, executor_graph;
  {
    cuda::CurrentStreamScope scope(tenant.get());
    work.own_kernels(1);
    tenant_graph = cuda::CapturedWork::capture(tenant.get(), [&] {
      for (int c = 0; c < o.calls; ++c) {
        work.own_kernels(o.own_kernels);
        if (by_kernels) {
          handoff_by_kernel(tenant.get(), flags.input[c], flags.result[c]);
          continue;
        }
        cuda::memory_ops_on_stream(tenant.get(), {{cuda::MemoryOp::kWrite, flags.input[c], 1},
                                                  {cuda::MemoryOp::kWaitReached, flags.result[c], 1},
                                                  {cuda::MemoryOp::kWrite, flags.result[c], 0}});
      }
    });
  }
  {
    cuda::CurrentStreamScope scope(executor.get());
    work.gemm();
    executor_graph = cuda::CapturedWork::capture(executor.get(), [&] {
      for (int c = 0; c < o.calls; ++c) {
        if (by_kernels) {
          handoff_by_kernel(executor.get(), nullptr, flags.input[c]);
          work.gemm();
          handoff_by_kernel(executor.get(), flags.result[c], nullptr);
          continue;
        }
        cuda::memory_ops_on_stream(executor.get(), {{cuda::MemoryOp::kWaitReached, flags.input[c], 1},
                                                    {cuda::MemoryOp::kWrite, flags.input[c], 0}});
        work.gemm();
        cuda::write_value_on_stream(executor.get(), flags.result[c], 1);
      }
    });
  }
  return seconds_per_step([&] {
    executor_graph.launch(executor.get());
    tenant_graph.launch(tenant.get());
    cuda::synchronize_stream(tenant.get());
    cuda::synchronize_stream(executor.get());
  }, o.steps);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"symbiosis-bench-flag-handoff: a GPU-to-GPU hand-off through flags in host and in device memory"};
  app.add_option("--calls", o.calls, "calls a step");
  app.add_option("--rows", o.rows, "tokens a call");
  app.add_option("--hidden", o.hidden, "the GEMM's input width");
  app.add_option("--out", o.out, "the GEMM's output width");
  app.add_option("--own-kernels", o.own_kernels, "the tenant's kernels between two calls");
  app.add_option("--steps", o.steps, "steps timed");
  CLI11_PARSE(app, argc, argv);

  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  Work work{at::randn({o.rows, o.hidden}, options), at::randn({o.out, o.hidden}, options),
            at::empty({o.rows, o.out}, options), at::zeros({o.rows, o.hidden}, options)};
  const double monolithic = one_stream(o, work);
  const double host = two_streams(o, work, host_flags(o.calls));
  const double device = two_streams(o, work, device_flags(o.calls));
  const double kernels = two_streams(o, work, device_flags(o.calls), /*by_kernels=*/true);
  const auto per_call_us = [&](double step) { return (step - monolithic) / o.calls * 1e6; };
  nlohmann::json result = {
      {"calls", o.calls}, {"rows", o.rows}, {"hidden", o.hidden}, {"out", o.out}, {"own_kernels", o.own_kernels},
      {"step_us", {{"one_stream", monolithic * 1e6}, {"host_flags", host * 1e6}, {"device_flags", device * 1e6},
                   {"device_flags_by_kernels", kernels * 1e6}}},
      {"handoff_us_per_call", {{"host_flags", per_call_us(host)}, {"device_flags", per_call_us(device)},
                               {"device_flags_by_kernels", per_call_us(kernels)}}},
  };
  std::cout << result.dump() << std::endl;
  return 0;
}
