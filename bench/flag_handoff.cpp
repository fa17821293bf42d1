// symbiosis-bench-flag-handoff: what a captured call's GPU-to-GPU hand-off costs ([Device words] in
// transport/cuda_ipc/device_words.h), against the same work on one stream. Two streams of one process,
// or two processes (--processes 2, under MPS, as a same-GPU tenant and the executor are), stand for a
// tenant and the executor running a step launched ahead ([Steps launched ahead] in
// transport/cuda_ipc/cuda_ipc_channel.cpp): each step is `calls` calls, captured as one graph a side;
// the tenant's graph runs its own kernels, sets a call's input flag and waits for its result flag; the
// executor's waits for the input flag, clears it, runs the GEMM and sets the result flag. Three ways:
// the driver's stream memory operations on flags in mapped host memory (the transport's way) and in
// device memory, and the transport's [Device words]: one kernel a hand-off, which sets its words
// and spins on one in device memory. Prints, as JSON, the step's time and each call's hand-off cost over the
// one-stream step.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/cuda.h"
#include "common/cuda_check.h"
#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/cuda_ipc/device_words.h"

namespace {

using namespace symbiosis;
using Clock = std::chrono::steady_clock;

struct Options {
  int calls = 65;    // a Llama-3.2-1B decode step's base-layer calls (16 layers x 4, lm_head)
  int64_t rows = 1;  // tokens a call
  int64_t hidden = 2048;
  int64_t out = 4096;
  int own_kernels = 3;  // the tenant's kernels between two calls (norms, attention, LoRA)
  int steps = 300;
};

// One process's addresses of each call's input_ready and result_ready, in mapped host memory and in
// device memory.
struct Side {
  std::vector<uint32_t*> host_input, host_result, device_input, device_result;
  Side(void* host, const cuda::PinnedRange& pin, void* device, int calls) {
    auto* host_words = static_cast<uint32_t*>(host);
    auto* device_words = static_cast<uint32_t*>(device);
    for (int c = 0; c < calls; ++c) {
      host_input.push_back(static_cast<uint32_t*>(pin.device_pointer(host_words + 2 * c)));
      host_result.push_back(static_cast<uint32_t*>(pin.device_pointer(host_words + 2 * c + 1)));
      device_input.push_back(device_words + 2 * c);
      device_result.push_back(device_words + 2 * c + 1);
    }
  }
};

enum class Handoff { kHostMemoryOps, kDeviceMemoryOps, kDeviceFlags };
constexpr Handoff kHandoffs[] = {Handoff::kHostMemoryOps, Handoff::kDeviceMemoryOps, Handoff::kDeviceFlags};
const char* name(Handoff how) {
  switch (how) {
    case Handoff::kHostMemoryOps: return "host_memory_ops";
    case Handoff::kDeviceMemoryOps: return "device_memory_ops";
    case Handoff::kDeviceFlags: return "device_flags";
  }
  return "";
}

struct Work {
  explicit Work(const Options& o) {
    const auto options = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
    x = at::randn({o.rows, o.hidden}, options);
    weight = at::randn({o.out, o.hidden}, options);
    y = at::empty({o.rows, o.out}, options);
    scratch = at::zeros({o.rows, o.hidden}, options);
  }
  at::Tensor x, weight, y, scratch;
  void own_kernels(int count) {
    for (int k = 0; k < count; ++k) scratch.add_(1);
  }
  void gemm() { at::mm_out(y, x, weight.t()); }
};

// `calls` enqueued on `stream`, captured as one graph (warmed first: cuBLAS's handle and workspace).
cuda::CapturedWork capture(cuda::Stream stream, Work& work, const std::function<void()>& calls) {
  cuda::CurrentStreamScope scope(stream);
  work.own_kernels(1);
  work.gemm();
  cuda::synchronize_stream(stream);
  return cuda::CapturedWork::capture(stream, calls);
}

void hand_off(cuda::Stream stream, const cuda::HandOff& h) {
  SYMBIOSIS_CUDA_CHECK(cuda::launch_hand_off(h, static_cast<cudaStream_t>(stream.handle)));
}

// The tenant's step: its own kernels, then each call handed over `how` (host memory operations are
// cuda_ipc_client.cpp's announce_captured) and, with no executor, the GEMM in place (a monolithic process).
cuda::CapturedWork tenant_step(const Options& o, Work& work, cuda::Stream stream, const Side* side, Handoff how) {
  return capture(stream, work, [&] {
    for (int c = 0; c < o.calls; ++c) {
      work.own_kernels(o.own_kernels);
      if (side == nullptr) {
        work.gemm();
      } else if (how == Handoff::kDeviceFlags) {  // as cuda_ipc_client.cpp's announce_captured
        hand_off(stream, {.set = {side->host_input[c], side->device_input[c]},
                          .await = side->device_result[c],
                          .release = side->host_result[c],
                          .clear = {side->device_input[c], nullptr},
                          .clear_release = true,
                          .host_clears = false});
      } else {
        const bool host = how == Handoff::kHostMemoryOps;
        void* input = host ? side->host_input[c] : side->device_input[c];
        void* result = host ? side->host_result[c] : side->device_result[c];
        cuda::memory_ops_on_stream(stream, {{cuda::MemoryOp::kWrite, input, 1},
                                            {cuda::MemoryOp::kWaitReached, result, 1},
                                            {cuda::MemoryOp::kWrite, result, 0}});
      }
    }
  });
}

// The executor's step launched ahead (host memory operations are cuda_ipc_channel.cpp's capture_run).
cuda::CapturedWork executor_step(const Options& o, Work& work, cuda::Stream stream, const Side& side, Handoff how) {
  return capture(stream, work, [&] {
    for (int c = 0; c < o.calls; ++c) {
      if (how == Handoff::kDeviceFlags) {  // as cuda_ipc_channel.cpp's await_input and capture_run
        hand_off(stream, {.await = side.device_input[c], .clear = {side.host_input[c], nullptr}});
        work.gemm();
        cuda::write_value_on_stream(stream, side.device_result[c], 1);
        continue;
      }
      const bool host = how == Handoff::kHostMemoryOps;
      void* input = host ? side.host_input[c] : side.device_input[c];
      cuda::memory_ops_on_stream(stream,
                                 {{cuda::MemoryOp::kWaitReached, input, 1}, {cuda::MemoryOp::kWrite, input, 0}});
      work.gemm();
      cuda::write_value_on_stream(stream, host ? side.host_result[c] : side.device_result[c], 1);
    }
  });
}

// Seconds a step, over o.steps launches of `launch` after one to warm.
double seconds_per_step(const Options& o, const std::function<void()>& launch) {
  launch();
  const auto start = Clock::now();
  for (int i = 0; i < o.steps; ++i) launch();
  return std::chrono::duration<double>(Clock::now() - start).count() / o.steps;
}

void send(int fd, const void* data, size_t bytes) {
  TORCH_CHECK(::write(fd, data, bytes) == static_cast<ssize_t>(bytes), "flag-handoff: pipe write failed");
}
void receive(int fd, void* data, size_t bytes) {
  TORCH_CHECK(::read(fd, data, bytes) == static_cast<ssize_t>(bytes), "flag-handoff: pipe read failed");
}

// The executor's process (--processes 2): maps the tenant's device flags, then for each way in turn
// captures its step and launches it as often as the tenant does.
[[noreturn]] void executor_process(const Options& o, void* host_words, int from_tenant, int to_tenant) {
  std::string handle(64, '\0');  // cudaIpcMemHandle_t
  receive(from_tenant, handle.data(), handle.size());
  const auto device_words = cuda::MappedDeviceBuffer::open(0, handle, sizeof(uint32_t) * 2 * o.calls);
  const cuda::PinnedRange pin(host_words, sizeof(uint32_t) * 2 * o.calls, /*mapped=*/true);
  const Side side(host_words, pin, device_words.data(), o.calls);
  Work work(o);
  const auto stream = cuda::OwnedStream::create(0, /*high_priority=*/true);
  for (const Handoff how : kHandoffs) {
    const auto step = executor_step(o, work, stream.get(), side, how);
    const char ready = 1;
    send(to_tenant, &ready, 1);
    for (int i = 0; i < o.steps + 1; ++i) {
      step.launch(stream.get());
      cuda::synchronize_stream(stream.get());
    }
  }
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  int processes = 1;
  CLI::App app{"symbiosis-bench-flag-handoff: a captured call's GPU-to-GPU hand-off, three ways"};
  app.add_option("--calls", o.calls, "calls a step");
  app.add_option("--rows", o.rows, "tokens a call");
  app.add_option("--hidden", o.hidden, "the GEMM's input width");
  app.add_option("--out", o.out, "the GEMM's output width");
  app.add_option("--own-kernels", o.own_kernels, "the tenant's kernels between two calls");
  app.add_option("--steps", o.steps, "steps timed");
  app.add_option("--processes", processes,
                 "1: tenant and executor are two streams of this process; 2: two processes, "
                 "as a same-GPU tenant and the executor are (run it under MPS)")
      ->check(CLI::IsMember({1, 2}));
  CLI11_PARSE(app, argc, argv);

  // The flags' host words, shared with the executor's process (made before CUDA is, and before fork).
  const size_t flag_bytes = sizeof(uint32_t) * 2 * o.calls;
  void* host_words = ::mmap(nullptr, flag_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(host_words != MAP_FAILED, "flag-handoff: mmap failed");
  int to_executor[2], from_executor[2];
  TORCH_CHECK(::pipe(to_executor) == 0 && ::pipe(from_executor) == 0, "flag-handoff: pipe failed");
  if (processes == 2 && ::fork() == 0) executor_process(o, host_words, to_executor[0], from_executor[1]);

  Work work(o);
  const auto stream = cuda::OwnedStream::create(0, /*high_priority=*/false);
  const auto monolithic = tenant_step(o, work, stream.get(), nullptr, Handoff::kDeviceFlags);
  const double one_stream = seconds_per_step(o, [&] {
    monolithic.launch(stream.get());
    cuda::synchronize_stream(stream.get());
  });
  const auto device_words = cuda::DeviceBuffer::allocate(0, flag_bytes, /*zeroed=*/true);
  const cuda::PinnedRange pin(host_words, flag_bytes, /*mapped=*/true);
  const Side side(host_words, pin, device_words.data(), o.calls);
  if (processes == 2) {
    const auto handle = device_words.ipc_handle();
    send(to_executor[1], handle.data(), handle.size());
  }
  const auto executor_stream = cuda::OwnedStream::create(0, /*high_priority=*/true);
  nlohmann::json step_us = {{"one_stream", one_stream * 1e6}}, per_call_us;
  for (const Handoff how : kHandoffs) {
    const auto tenant = tenant_step(o, work, stream.get(), &side, how);
    cuda::CapturedWork executor;
    if (processes == 2) {
      char ready = 0;
      receive(from_executor[0], &ready, 1);
    } else {
      executor = executor_step(o, work, executor_stream.get(), side, how);
    }
    const double step = seconds_per_step(o, [&] {
      if (processes == 1) executor.launch(executor_stream.get());
      tenant.launch(stream.get());
      cuda::synchronize_stream(stream.get());
      if (processes == 1) cuda::synchronize_stream(executor_stream.get());
    });
    step_us[name(how)] = step * 1e6;
    per_call_us[name(how)] = (step - one_stream) / o.calls * 1e6;
  }
  if (processes == 2) ::wait(nullptr);
  const nlohmann::json result = {{"processes", processes},
                                 {"mps", cuda::mps_active()},
                                 {"calls", o.calls},
                                 {"rows", o.rows},
                                 {"hidden", o.hidden},
                                 {"out", o.out},
                                 {"own_kernels", o.own_kernels},
                                 {"step_us", step_us},
                                 {"handoff_us_per_call", per_call_us}};
  std::cout << result.dump() << std::endl;
  return 0;
}
