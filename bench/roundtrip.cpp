// symbiosis-bench-roundtrip: the per-layer round-trip time of each transport. An executor
// process serves one [hidden, hidden] layer; a client in this process sends FORWARD requests of 1
// and 1024 tokens over each transport asked for, and waits for each result to be usable (on a GPU
// client, its stream synchronized). The baseline in the same run is the same GEMM computed locally
// on the client's device, so a transport's cost is the difference. Where the time goes: the
// client's host time per call (until forward returns, before the synchronization) and the
// executor's, from its stats (means: a call's wait from arrival until its batch starts, its batch's
// host time until the GEMM is enqueued, and from then until the reply).
//   symbiosis-bench-roundtrip --executor-device cuda:0 --client-device cuda:0 --transports cuda-ipc,tcp
#include <CLI/CLI.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include <symbiosis/client.h>

#include "bench/process.h"
#include "bench/transport_name.h"
#include "common/checkpoint.h"
#include "transport/client_transport.h"
#ifdef SYMBIOSIS_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>

#include <atomic>

#include "common/cuda.h"
#include "kernels/direct_gemm.h"
#include "kernels/few_rows_gemm.h"
#include "transport/cuda_ipc/cuda_ipc.h"
#endif

using namespace symbiosis;
using Clock = std::chrono::steady_clock;

namespace {

struct Summary {
  double median_us;
  double p99_us;
};

// The value `percent`% of v lie below (50: the median).
double percentile(std::vector<double> v, size_t percent) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, v.size() * percent / 100)];
}

// The executor's host time per call, as its stats give it.
struct ExecutorShare {
  double wait_us = 0;     // arrival until the call's batch starts
  double launch_us = 0;   // the batch's start until its GEMM is enqueued
  double deliver_us = 0;  // then until the reply is sent
};

proto::Stats stats_of(const std::string& endpoint) { return request_stats(endpoint, 10000); }

ExecutorShare share_between(const proto::Stats& before, const proto::Stats& after) {
  const double calls = static_cast<double>(after.requests() - before.requests());
  if (calls <= 0) return {};
  const double deliver = after.deliver_seconds() - before.deliver_seconds();
  return {1e6 * (after.wait_seconds() - before.wait_seconds()) / calls,
          1e6 * (after.compute_seconds() - before.compute_seconds() - deliver) / calls, 1e6 * deliver / calls};
}

template <typename F>
Summary time_it(
    int iterations, F&& f, const std::function<void()>& warm = [] {}) {
  for (int i = 0; i < std::max(10, iterations / 10); ++i) f();  // warm-up
  warm();
  std::vector<double> us;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    f();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return {percentile(us, 50), percentile(us, 99)};
}

#ifdef SYMBIOSIS_WITH_CUDA
// The host time of each operation a CUDA IPC call is made of, alone on this process's stream
// (median; the stream is synchronized between batches of calls, outside the timed part).
void time_primitives(at::Device device, at::ScalarType type, int64_t hidden, int iterations) {
  const int index = device.index();
  const auto opts = at::TensorOptions().dtype(type).device(device);
  const auto x = at::randn({1, hidden}, opts), weight = at::randn({hidden, hidden}, opts);
  auto out = at::empty({1, hidden}, opts);
  auto buffer = cuda::DeviceBuffer::allocate(index, x.nbytes());
  auto event = cuda::InterprocessEvent::create(index);
  const cuda::Stream stream = cuda::current_stream(index);
  std::printf("host time of one operation, median of %d (us):\n", iterations);
  auto measure = [&](const char* what, const std::function<void()>& op) {
    std::vector<double> us;
    for (int i = 0; i < iterations; ++i) {
      if (i % 32 == 0) cuda::synchronize_stream(stream);
      const auto t0 = Clock::now();
      op();
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    cuda::synchronize_stream(stream);
    std::printf("  %-48s %7.2f\n", what, percentile(us, 50));
  };
  const auto matrix = weight.t();  // a Linear's forward operand
  measure("at::mm, 1 token", [&] { at::mm(x, matrix); });
  measure("at::mm_out into a given tensor, 1 token", [&] { at::mm_out(out, x, matrix); });
  measure("cublasGemmEx directly, 1 token", [&] { cuda::cublas_gemm_into(x, matrix, out); });
  measure("few-row kernel (the executor's GEMM), 1 token", [&] { cuda::gemm_into(x, matrix, out); });
  measure("at::from_blob over device memory", [&] { at::from_blob(buffer.data(), {1, hidden}, opts); });
  measure("at::empty, 1 row", [&] { at::empty({1, hidden}, opts); });
  measure("cudaMemcpyAsync device to device, 1 row",
          [&] { cuda::copy_on_stream(buffer.data(), x.data_ptr(), x.nbytes(), stream); });
  measure("cudaEventRecord, interprocess event", [&] { event.record(stream); });
  measure("cudaStreamWaitEvent, interprocess event", [&] { event.make_stream_wait(stream); });
  // The flags of [Stream-ordered hand-off]: a word of pinned host memory the GPU addresses.
  std::unique_ptr<void, decltype(&std::free)> page(std::aligned_alloc(4096, 4096), &std::free);
  std::memset(page.get(), 0, 4096);
  cuda::PinnedRange pinned(page.get(), 4096, /*mapped=*/true);
  void* word = pinned.device_pointer(page.get());
  measure("cuStreamWriteValue32, mapped host word", [&] { cuda::write_value_on_stream(stream, word, 1); });
  measure("cuStreamWaitValue32, mapped host word (met)", [&] { cuda::wait_value_on_stream(stream, word, 1); });
  // GPU time of a product, the host out of the way: the stream waits on a word while 100 products
  // are enqueued behind the wait, then runs them back to back between two events.
  auto& gate = *static_cast<std::atomic<uint32_t>*>(page.get());
  auto gpu_us = [&](const std::function<void()>& op) {
    constexpr int kProducts = 100;
    gate.store(0);
    cuda::wait_value_on_stream(stream, word, 1);
    at::cuda::CUDAEvent start(cudaEventDefault), end(cudaEventDefault);
    start.record();
    for (int i = 0; i < kProducts; ++i) op();
    end.record();
    gate.store(1);
    end.synchronize();
    return start.elapsed_time(end) * 1000.0 / kProducts;
  };
  std::printf("GPU time of one product [tokens, %ld] x [%ld, %ld], mean of 100 back to back (us):\n", hidden, hidden,
              hidden);
  for (int64_t tokens = 1; tokens <= kernels::kFewRowsMax; tokens *= 2) {
    const auto rows = at::randn({tokens, hidden}, opts);
    auto result = at::empty({tokens, hidden}, opts);
    std::printf("  %-48s %7.2f\n", ("cublasGemmEx, " + std::to_string(tokens) + " tokens").c_str(),
                gpu_us([&] { cuda::cublas_gemm_into(rows, matrix, result); }));
    std::printf("  %-48s %7.2f\n", ("few-row kernel, " + std::to_string(tokens) + " tokens").c_str(),
                gpu_us([&] { kernels::few_rows_gemm(rows, matrix, result); }));
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  int64_t hidden = 2048;
  int iterations = 300;
  std::string json_out, executor_device = "cpu", client_device = "cpu", transports = "tcp,shm", dtype = "fp32";
  int spin_us = -1;
  CLI::App app{"symbiosis-bench-roundtrip: per-layer round trip of each transport against local compute"};
  app.add_option("--hidden", hidden, "layer size (in = out)")->capture_default_str();
  app.add_option("--iterations", iterations, "timed calls per size")->capture_default_str();
  app.add_option("--executor-device", executor_device, "the executor's device: cpu or cuda:N")->capture_default_str();
  app.add_option("--client-device", client_device, "this client's device: cpu or cuda:N")->capture_default_str();
  app.add_option("--transports", transports,
                 "comma-separated: tcp, shm, cuda-ipc, cuda-ipc-buffer (copies through the payload buffer), nccl")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--spin-us", spin_us, "spin before sleeping, executor and client (us; -1: by device)")
      ->capture_default_str();
  app.add_option("--json", json_out, "also write the results here");
  bool primitives = false;
  app.add_flag("--primitives", primitives,
               "also time the host side of each CUDA operation a call is made of, and the executor's GEMMs' GPU time "
               "(GPU client)");
  CLI11_PARSE(app, argc, argv);
  try {
    char dir_template[] = "/tmp/symbiosis-bench-XXXXXX";
    const std::filesystem::path dir = ::mkdtemp(dir_template);
    const auto type = parse_dtype_name(dtype);
    at::manual_seed(0);
    const auto weight = (at::randn({hidden, hidden}) * 0.02).to(type);
    write_safetensors(dir / "model.safetensors", {{"model.layers.0.self_attn.q_proj.weight", weight}});
    std::ofstream(dir / "config.json") << R"({"model_type": "llama"})";
    auto executor = bench::start_executor(
        {"--model", dir.string(), "--listen", "tcp://127.0.0.1:*", "--device", executor_device, "--max-request-bytes",
         std::to_string(1 << 30), "--spin-us", std::to_string(spin_us), "--log-level", "warn"},
        dir);
    const at::Device device(client_device);
    const bool gpu = device.is_cuda();
    auto sync = [&] {
      if (gpu) torch::cuda::synchronize(device.index());
    };
    const auto local_weight = weight.to(device);
    std::printf("executor on %s, client on %s, %s, hidden %ld\n", executor_device.c_str(), client_device.c_str(),
                dtype.c_str(), static_cast<long>(hidden));
    std::printf("%-15s %-7s %13s %11s %15s %13s %14s %14s %9s %11s %12s\n", "transport", "tokens", "rtt median us",
                "rtt p99 us", "local median us", "local p99 us", "overhead us", "client host us", "exec wait",
                "exec launch", "exec deliver");
    nlohmann::json results = nlohmann::json::array();
    std::stringstream list(transports);
    for (std::string transport; std::getline(list, transport, ',');) {
      ClientOptions options;
      options.endpoint = executor.endpoint;
      bench::set_transport(options, transport);
      options.device = client_device;
      options.spin_us = spin_us;
      auto client = Client::connect(options);
      const auto& layer = client->layers().at(0);
      const std::string label = options.direct_operands ? client->transport() : transport;
      for (int64_t tokens : {1, 1024}) {
        const auto x = at::randn({tokens, hidden}, at::TensorOptions().device(device)).to(type);
        std::vector<double> host_us;
        proto::Stats before;
        const auto remote = time_it(
            iterations,
            [&] {
              const auto t0 = Clock::now();
              client->forward(layer, x, true);
              host_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
              sync();
            },
            [&] {
              host_us.clear();
              before = stats_of(executor.endpoint);
            });
        const auto executor_share = share_between(before, stats_of(executor.endpoint));
        const double client_host_us = percentile(host_us, 50);
        const auto local = time_it(iterations, [&] {
          at::mm(x, local_weight.t());
          sync();
        });
        std::printf("%-15s %-7ld %13.1f %11.1f %15.1f %13.1f %14.1f %14.1f %9.1f %11.1f %12.1f\n", label.c_str(),
                    static_cast<long>(tokens), remote.median_us, remote.p99_us, local.median_us, local.p99_us,
                    remote.median_us - local.median_us, client_host_us, executor_share.wait_us,
                    executor_share.launch_us, executor_share.deliver_us);
        results.push_back({{"transport", label},
                           {"tokens", tokens},
                           {"rtt_median_us", remote.median_us},
                           {"rtt_p99_us", remote.p99_us},
                           {"local_median_us", local.median_us},
                           {"local_p99_us", local.p99_us},
                           {"client_host_median_us", client_host_us},
                           {"executor_wait_mean_us", executor_share.wait_us},
                           {"executor_launch_mean_us", executor_share.launch_us},
                           {"executor_deliver_mean_us", executor_share.deliver_us}});
      }
    }
    bench::stop(executor.pid);
    if (!json_out.empty()) {
      std::ofstream(json_out) << nlohmann::json{{"executor_device", executor_device},
                                                {"client_device", client_device},
                                                {"dtype", dtype},
                                                {"hidden", hidden},
                                                {"results", results}}
                                     .dump(2)
                              << "\n";
    }
    std::filesystem::remove_all(dir);
#ifdef SYMBIOSIS_WITH_CUDA
    if (primitives && gpu) time_primitives(device, type, hidden, iterations);
#endif
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "symbiosis-bench-roundtrip: %s\n", e.what());
    return 1;
  }
}
