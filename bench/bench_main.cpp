// symbiosis-bench: runs a benchmark scenario. For each batching policy it starts an executor and
// the scenario's clients as separate processes, collects each client's iteration latencies and
// tokens/s, the executor's batch statistics and peak memory; optionally it runs the same clients
// as independent monolithic processes (the baseline) in the same invocation, and reports ratios.
// Writes OUT/results.json and, when Python with matplotlib is there, OUT/results.png.
//   symbiosis-bench --scenario bench/scenarios/table5_cpu.json --out /tmp/bench
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <google/protobuf/util/json_util.h>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "transport/zmq_wire.h"

extern char** environ;

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The build directory: this program lives in <build>/bench/.
fs::path build_dir() { return fs::read_symlink("/proc/self/exe").parent_path().parent_path(); }

pid_t spawn(const std::vector<std::string>& args, const fs::path& stdout_file, const fs::path& stderr_file) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, stdout_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start " + args[0] + ": " + std::strerror(rc));
  return pid;
}

bool wait_ok(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

size_t peak_rss_bytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Each client entry may stand for several identical clients ("count").
std::vector<json> expand_clients(const json& scenario) {
  std::vector<json> out;
  for (const auto& c : scenario.at("clients")) {
    for (int i = 0; i < c.value("count", 1); ++i) out.push_back(c);
  }
  return out;
}

std::vector<std::string> client_args(const json& c, const fs::path& model, int index, const json& defaults) {
  auto get = [&](const char* key) { return c.contains(key) ? c[key] : defaults.at(key); };
  return {(build_dir() / "bench/symbiosis-bench-client").string(),
          "--model", model.string(),
          "--mode", get("mode").get<std::string>(),
          "--batch", std::to_string(get("batch").get<int64_t>()),
          "--seq", std::to_string(get("seq").get<int64_t>()),
          "--rank", std::to_string(get("rank").get<int64_t>()),
          "--targets", get("targets").get<std::string>(),
          "--iterations", std::to_string(get("iterations").get<int>()),
          "--warmup", std::to_string(get("warmup").get<int>()),
          "--seed", std::to_string(index + 1)};
}

// Runs every client at once; returns their results and the aggregate figures.
json run_clients(const std::vector<json>& clients, const fs::path& model, const json& defaults, const fs::path& dir,
                 const std::string& executor, bool monolithic) {
  std::vector<pid_t> pids;
  for (size_t i = 0; i < clients.size(); ++i) {
    auto args = client_args(clients[i], model, static_cast<int>(i), defaults);
    args.insert(args.end(), {"--out", (dir / ("client" + std::to_string(i) + ".json")).string()});
    if (monolithic) {
      args.push_back("--monolithic");
    } else {
      args.insert(args.end(), {"--executor", executor});
    }
    pids.push_back(spawn(args, dir / ("client" + std::to_string(i) + ".out"),
                         dir / ("client" + std::to_string(i) + ".err")));
  }
  json result = {{"clients", json::array()}};
  bool ok = true;
  for (size_t i = 0; i < pids.size(); ++i) ok = wait_ok(pids[i]) && ok;
  if (!ok) throw std::runtime_error("a client failed; see the .err files in " + dir.string());
  double start = 1e300, end = 0, tokens = 0, latency_sum = 0;
  size_t latency_count = 0, peak = 0;
  for (size_t i = 0; i < pids.size(); ++i) {
    json c = json::parse(read_file(dir / ("client" + std::to_string(i) + ".json")));
    start = std::min(start, c["start_epoch_s"].get<double>());
    end = std::max(end, c["end_epoch_s"].get<double>());
    tokens += c["tokens_per_iteration"].get<double>() * c["iterations"].get<double>();
    for (double l : c["latencies_s"]) {
      latency_sum += l;
      latency_count++;
    }
    peak += c["peak_rss_bytes"].get<size_t>();
    c.erase("latencies_s");
    result["clients"].push_back(c);
  }
  result["aggregate_tokens_per_s"] = tokens / (end - start);
  result["mean_iteration_s"] = latency_sum / latency_count;
  result["clients_peak_rss_bytes_total"] = peak;
  return result;
}

json run_policy(const json& scenario, const std::vector<json>& clients, const fs::path& model, const json& defaults,
                const std::string& policy, const fs::path& dir) {
  fs::create_directories(dir);
  const json& ex = scenario.value("executor", json::object());
  std::vector<std::string> args = {(build_dir() / "base_executor/symbiosis-executor").string(),
                                   "--model", model.string(),
                                   "--listen", "tcp://127.0.0.1:*",
                                   "--device", ex.value("device", "cpu"),
                                   "--batching", policy,
                                   "--max-wait", std::to_string(ex.value("max_wait_us", 2000)),
                                   "--lockstep-timeout", std::to_string(ex.value("lockstep_timeout_ms", 1000)),
                                   "--threads", std::to_string(ex.value("threads", 1)),
                                   "--log-level", "warn"};
  if (ex.contains("dtype")) args.insert(args.end(), {"--dtype", ex["dtype"].get<std::string>()});
  pid_t executor = spawn(args, dir / "executor.out", dir / "executor.err");
  std::string endpoint;
  for (int i = 0; i < 600 && endpoint.empty(); ++i) {
    auto text = read_file(dir / "executor.out");
    if (text.rfind("ready ", 0) == 0) endpoint = text.substr(6, text.find('\n') - 6);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (endpoint.empty()) {
    kill(executor, SIGKILL);
    throw std::runtime_error("executor did not start: " + read_file(dir / "executor.err"));
  }
  json result;
  try {
    result = run_clients(clients, model, defaults, dir, endpoint, false);
  } catch (...) {
    kill(executor, SIGKILL);
    throw;
  }
  auto stats = symbiosis::wire::request_stats(endpoint, 10000);
  if (stats) {
    std::string text;
    (void)google::protobuf::util::MessageToJsonString(*stats, &text);
    result["executor"] = json::parse(text);
    result["mean_batch_requests"] = stats->batches() ? double(stats->requests()) / stats->batches() : 0.0;
    result["mean_batch_tokens"] = stats->batches() ? double(stats->tokens()) / stats->batches() : 0.0;
  }
  result["executor_peak_rss_bytes"] = peak_rss_bytes(executor);
  result["policy"] = policy;
  kill(executor, SIGTERM);
  wait_ok(executor);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  std::string scenario_file, out_dir;
  CLI::App app{"symbiosis-bench: run a benchmark scenario (see docs/benchmarks.md)"};
  app.add_option("--scenario", scenario_file, "scenario JSON file")->required();
  app.add_option("--out", out_dir, "directory for results.json, results.png and the logs")->required();
  CLI11_PARSE(app, argc, argv);
  try {
    const json scenario = json::parse(read_file(scenario_file));
    const fs::path out = out_dir;
    fs::create_directories(out);
    const json defaults = {{"mode", "finetune"}, {"batch", 1},  {"seq", 64},   {"rank", 8},
                           {"targets", "q_proj,v_proj"}, {"iterations", 10}, {"warmup", 2}};
    json merged_defaults = defaults;
    if (scenario.contains("client_defaults")) merged_defaults.update(scenario["client_defaults"]);

    fs::path model;
    const json& m = scenario.at("model");
    if (m.contains("checkpoint")) {
      model = m["checkpoint"].get<std::string>();
    } else {
      model = out / "model";
      const std::string command = (build_dir() / "tools/symbiosis-make-checkpoint").string() + " --preset " +
                                  m.at("preset").get<std::string>() + " --dtype " + m.value("dtype", "fp32") +
                                  (m.contains("layers") ? " --layers " + std::to_string(m["layers"].get<int>()) : "") +
                                  " --out " + model.string() + " > " + (out / "make_checkpoint.log").string();
      if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
    }
    const auto clients = expand_clients(scenario);
    json results = {{"scenario", scenario}, {"runs", json::array()}};
    const json& ex = scenario.value("executor", json::object());
    for (const auto& policy : ex.value("policies", std::vector<std::string>{"opportunistic"})) {
      std::cerr << "symbiosis-bench: " << clients.size() << " clients, policy " << policy << std::endl;
      results["runs"].push_back(run_policy(scenario, clients, model, merged_defaults, policy, out / policy));
    }
    if (scenario.value("baseline", true)) {
      std::cerr << "symbiosis-bench: baseline, " << clients.size() << " monolithic processes" << std::endl;
      fs::create_directories(out / "baseline");
      results["baseline"] = run_clients(clients, model, merged_defaults, out / "baseline", "", true);
      const double base = results["baseline"]["aggregate_tokens_per_s"];
      for (auto& run : results["runs"]) {
        run["throughput_vs_baseline"] = run["aggregate_tokens_per_s"].get<double>() / base;
        run["iteration_time_vs_baseline"] =
            run["mean_iteration_s"].get<double>() / results["baseline"]["mean_iteration_s"].get<double>();
      }
    }
    std::ofstream(out / "results.json") << results.dump(2) << "\n";

    std::printf("%-15s %14s %16s %16s %14s %14s\n", "run", "tokens/s", "mean iter (ms)", "mean batch (req)",
                "vs baseline", "exec RSS MiB");
    for (const auto& run : results["runs"]) {
      std::printf("%-15s %14.1f %16.2f %16.2f %14.2f %14.1f\n", run["policy"].get<std::string>().c_str(),
                  run["aggregate_tokens_per_s"].get<double>(), 1e3 * run["mean_iteration_s"].get<double>(),
                  run.value("mean_batch_requests", 0.0), run.value("throughput_vs_baseline", 0.0),
                  run["executor_peak_rss_bytes"].get<double>() / 1048576.0);
    }
    if (results.contains("baseline")) {
      const auto& b = results["baseline"];
      std::printf("%-15s %14.1f %16.2f %16s %14.2f %14s\n", "monolithic", b["aggregate_tokens_per_s"].get<double>(),
                  1e3 * b["mean_iteration_s"].get<double>(), "-", 1.0, "-");
    }
    const std::string plot = std::string(SYMBIOSIS_PYTHON) + " " + SYMBIOSIS_SOURCE_DIR + "/bench/plot.py " +
                             (out / "results.json").string() + " " + (out / "results.png").string();
    if (std::system(plot.c_str()) != 0) std::cerr << "symbiosis-bench: no plot (" << plot << " failed)\n";
    std::printf("results: %s\n", (out / "results.json").c_str());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-bench: " << e.what() << std::endl;
    return 1;
  }
}
