// symbiosis-bench-roundtrip: the per-layer round-trip time of the ZeroMQ TCP transport on CPU.
// An executor (in this process, on loopback) serves one [hidden, hidden] layer; a client sends
// FORWARD requests of 1 and 1024 tokens. The baseline in the same run is the same GEMM computed
// locally, so the transport's cost is the difference and the ratio.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include "base_executor/executor.h"
#include "client_runtime/client.h"
#include "common/checkpoint.h"

using namespace symbiosis;
using Clock = std::chrono::steady_clock;

namespace {

struct Summary {
  double median_us;
  double p99_us;
};

Summary summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]};
}

template <typename F>
Summary time_it(int iterations, F&& f) {
  for (int i = 0; i < std::max(3, iterations / 10); ++i) f();  // warm-up
  std::vector<double> us;
  for (int i = 0; i < iterations; ++i) {
    auto t0 = Clock::now();
    f();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return summarize(us);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t hidden = 2048;
  int iterations = 200;
  std::string json_out;
  CLI::App app{"symbiosis-bench-roundtrip: per-layer TCP round trip against local compute"};
  app.add_option("--hidden", hidden, "layer size (in = out)")->capture_default_str();
  app.add_option("--iterations", iterations, "timed calls per size")->capture_default_str();
  app.add_option("--json", json_out, "also write the results here");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);

  char dir_template[] = "/tmp/symbiosis-bench-XXXXXX";
  const std::filesystem::path dir = ::mkdtemp(dir_template);
  at::manual_seed(0);
  auto weight = at::randn({hidden, hidden}) * 0.02;
  write_safetensors(dir / "model.safetensors", {{"model.layers.0.self_attn.q_proj.weight", weight}});
  std::ofstream(dir / "config.json") << R"({"model_type": "llama"})";

  ExecutorOptions options;
  options.model_dir = dir;
  options.listen = "tcp://127.0.0.1:*";
  options.max_request_bytes = size_t{1} << 30;
  auto executor = Executor::start(options);
  ClientOptions client_options;
  client_options.endpoint = executor->endpoint();
  auto client = Client::connect(client_options);
  const auto& layer = client->layers().at(0);

  std::printf("%-8s %14s %14s %16s %16s %10s\n", "tokens", "rtt median us", "rtt p99 us", "local median us",
              "local p99 us", "rtt/local");
  std::string json = "{\"transport\": \"tcp\", \"hidden\": " + std::to_string(hidden) + ", \"results\": [";
  for (int64_t tokens : {1, 1024}) {
    auto x = at::randn({tokens, hidden});
    auto remote = time_it(iterations, [&] { client->forward(layer, x, true); });
    auto local = time_it(iterations, [&] { at::mm(x, weight.t()); });
    std::printf("%-8ld %14.1f %14.1f %16.1f %16.1f %10.2f\n", static_cast<long>(tokens), remote.median_us,
                remote.p99_us, local.median_us, local.p99_us, remote.median_us / local.median_us);
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%s{\"tokens\": %ld, \"rtt_median_us\": %.1f, \"rtt_p99_us\": %.1f, \"local_median_us\": %.1f, "
                  "\"local_p99_us\": %.1f}",
                  tokens == 1 ? "" : ", ", static_cast<long>(tokens), remote.median_us, remote.p99_us,
                  local.median_us, local.p99_us);
    json += buf;
  }
  json += "]}\n";
  if (!json_out.empty()) std::ofstream(json_out) << json;
  client.reset();
  executor->shutdown();
  std::filesystem::remove_all(dir);
  return 0;
}
