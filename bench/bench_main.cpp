// symbiosis-bench: runs a benchmark scenario (its format: docs/benchmarks-history.md, "Programs
// and method"). For each client count and batching policy it starts an executor and the scenario's
// clients as separate processes, and runs the baselines asked for with the same clients in the
// same invocation:
// "monolithic" (our C++ client with its own copy of the base layers) and "hf_peft" (Hugging Face
// PEFT jobs, bench/hf_peft_client.py). It collects each client's iteration latencies and tokens/s
// over a common window after every process is warm ([Measurement window] in bench_client.cpp),
// the executor's batch statistics, peak host memory and the GPU's peak memory in use, and reports
// each run against the strongest baseline. A "capacity" scenario instead starts clients one after
// another until one fails (out of memory) and reports how many ran at once, for each system.
// Writes OUT/results.json and, when Python with matplotlib is there, OUT/results.png.
//   symbiosis-bench --scenario bench/scenarios/table5_cpu.json --out /tmp/bench
// With --trace, each run also writes trace.json in its folder: the executor and every client on one
// timeline, each call linked to its batch ([Traced runs] below; docs/tracing.md).
#include <CLI/CLI.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <google/protobuf/util/json_util.h>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "bench/process.h"
#include "transport/client_transport.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace symbiosis::bench;

namespace {

// Where the Python with transformers and peft is, and this source tree (for the HF PEFT client and
// the plot); compiled in, overridable on the command line (a build carried to another machine).
std::string python = SYMBIOSIS_PYTHON;
std::string source_dir = SYMBIOSIS_SOURCE_DIR;

// [Traced runs] --trace N: the clients of our systems each trace their first N iterations of the
// window (bench_client's --trace); a Symbiosis run's executor traces from before the window opens
// until every client has written its trace ([Traces] in base_executor/tracing.h). Then
// bench/merge_traces.py puts them on one timeline, trace.json, and prints where each call's time
// went. Tracing slows what it traces: a traced run's figures say where time goes, not how fast.
int trace_iterations = 0;  // 0: no traces

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// [Scenario keys] A scenario's keys are checked before anything runs: one the harness does not read
// (a misspelt setting) is refused, naming it, where it stands and what that place takes; else the
// run would use the default and report its figures as the setting's.
const std::set<std::string> kClientKeys = {
    "mode",  "batch",     "seq",     "rank",       "targets", "iterations",        "warmup",     "device",
    "dtype", "transport", "threads", "cuda_graph", "mask",    "mask_effects_here", "new_tokens", "decode_halves"};

const std::set<std::string> kExecutorKeys = {"device",
                                             "dtype",
                                             "policies",
                                             "max_wait_us",
                                             "lockstep_timeout_ms",
                                             "threads",
                                             "spin_us",
                                             "log_level",
                                             "decode_align_wait_us",
                                             "judge_window_ms",
                                             "streams",
                                             "launch_ahead",
                                             "launch_together",
                                             "launch_together_max",
                                             "launch_together_from",
                                             "launch_together_wait_us",
                                             "finetune_sm_percent",
                                             "finetune_piece_rows",
                                             "concurrent_tokens",
                                             "mlp_blocks",
                                             "mlp_bridges",
                                             "lm_head"};

void check_keys(const json& object, const std::string& where, const std::set<std::string>& known) {
  if (!object.is_object()) {
    throw std::runtime_error(where + " is a JSON " + object.type_name() + "; expected an object");
  }
  for (const auto& entry : object.items()) {
    if (known.count(entry.key())) continue;
    std::string names;
    for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
    throw std::runtime_error(where + " has the key \"" + entry.key() +
                             "\", which symbiosis-bench does not read; expected one of: " + names);
  }
}

std::set<std::string> with(std::set<std::string> keys, std::initializer_list<const char*> more) {
  keys.insert(more.begin(), more.end());
  return keys;
}

void check_scenario(const json& scenario) {
  check_keys(scenario, "the scenario",
             {"name", "model", "executor", "client_defaults", "clients", "variants", "counts", "window_s", "alone",
              "baseline", "baselines", "mode", "capacity_limit", "capacity_wave"});
  if (!scenario.contains("model")) throw std::runtime_error("the scenario has no \"model\"; expected one");
  check_keys(scenario["model"], "model", {"preset", "dtype", "layers", "checkpoint"});
  if (scenario.contains("executor")) check_keys(scenario["executor"], "executor", kExecutorKeys);
  if (scenario.contains("client_defaults")) check_keys(scenario["client_defaults"], "client_defaults", kClientKeys);
  if (!scenario.contains("clients") || !scenario["clients"].is_array()) {
    throw std::runtime_error("the scenario has no \"clients\" list; expected one");
  }
  for (size_t i = 0; i < scenario["clients"].size(); ++i) {
    check_keys(scenario["clients"][i], "clients[" + std::to_string(i) + "]",
               with(kClientKeys, {"count", "group", "mps_thread_percentage"}));
  }
  for (size_t i = 0; scenario.contains("variants") && i < scenario["variants"].size(); ++i) {
    const std::string where = "variants[" + std::to_string(i) + "]";
    const json& variant = scenario["variants"][i];
    check_keys(variant, where, with(kClientKeys, {"name", "executor"}));
    if (variant.contains("executor")) check_keys(variant["executor"], where + ".executor", kExecutorKeys);
  }
}

// Each client entry may stand for several identical clients ("count"), and names their group
// ("group"; by default "group0", "group1", ... in the scenario's order), which the results report
// apart (e.g. the inference and the fine-tuning tenants of a mixed workload).
std::vector<json> expand_clients(const json& scenario, int count_override) {
  std::vector<json> out;
  const json& entries = scenario.at("clients");
  for (size_t e = 0; e < entries.size(); ++e) {
    const json& c = entries[e];
    const int count = count_override > 0 ? count_override : c.value("count", 1);
    json client = c;
    client["group"] = c.value("group", "group" + std::to_string(e));
    for (int i = 0; i < count; ++i) out.push_back(client);
  }
  return out;
}

// The clients (or their results) of one group.
std::vector<json> members_of(const std::vector<json>& clients, const std::string& group) {
  std::vector<json> members;
  std::copy_if(clients.begin(), clients.end(), std::back_inserter(members),
               [&](const json& c) { return c["group"] == group; });
  return members;
}

std::vector<std::string> group_names(const std::vector<json>& clients) {
  std::vector<std::string> names;
  for (const auto& c : clients) {
    if (std::find(names.begin(), names.end(), c["group"]) == names.end()) names.push_back(c["group"]);
  }
  return names;
}

// The aggregate figures of some clients' results (each with its latencies_s): tokens/s over their
// common window, iteration latencies, and for generation the slowest tenant's time to first token
// and per output token, the fastest tenant's time per output token (p50: how evenly the tenants
// share the GPU) and the tenants' mean time per output token.
json summarize(const std::vector<json>& clients) {
  double start = 1e300, end = 0, tokens = 0, latency_sum = 0, tpot_sum = 0;
  int tpot_count = 0;
  std::vector<double> latencies;
  for (const auto& c : clients) {
    start = std::min(start, c["start_epoch_s"].get<double>());
    end = std::max(end, c["end_epoch_s"].get<double>());
    tokens += c["tokens_per_iteration"].get<double>() * c["iterations"].get<double>();
    for (double l : c["latencies_s"]) {
      latency_sum += l;
      latencies.push_back(l);
    }
    if (c.contains("time_per_output_token_mean_s")) {
      tpot_sum += c["time_per_output_token_mean_s"].get<double>();
      ++tpot_count;
    }
  }
  std::sort(latencies.begin(), latencies.end());
  // Generation: the tokens produced inside the window, rather than those of whole iterations.
  const bool token_counts =
      std::all_of(clients.begin(), clients.end(), [](const json& c) { return c.contains("tokens_in_window"); });
  if (token_counts) {
    tokens = 0;
    for (const auto& c : clients) tokens += c["tokens_in_window"].get<double>();
  }
  json summary = {{"aggregate_tokens_per_s", tokens / std::max(end - start, 1e-9)},
                  {"mean_iteration_s", latencies.empty() ? 0.0 : latency_sum / latencies.size()},
                  {"p50_iteration_s", latencies.empty() ? 0.0 : latencies[latencies.size() / 2]}};
  if (tpot_count) summary["mean_tenant_time_per_output_token_s"] = tpot_sum / tpot_count;
  for (const char* key : {"time_to_first_token_p50_s", "time_to_first_token_p99_s", "time_per_output_token_p50_s",
                          "time_per_output_token_p99_s"}) {
    double worst = -1;
    for (const auto& c : clients) worst = std::max(worst, c.value(key, -1.0));
    if (worst >= 0) summary[std::string("worst_tenant_") + key] = worst;
  }
  double best = 1e300;
  for (const auto& c : clients) best = std::min(best, c.value("time_per_output_token_p50_s", 1e300));
  if (best < 1e300) summary["best_tenant_time_per_output_token_p50_s"] = best;
  return summary;
}

// The command line of one client of `system` ("symbiosis", "monolithic" or "hf_peft").
std::vector<std::string> client_args(const std::string& system, const json& c, const fs::path& model, int index,
                                     const json& defaults) {
  auto get = [&](const char* key) { return c.contains(key) ? c[key] : defaults.at(key); };
  std::vector<std::string> args;
  if (system == "hf_peft") {
    args = {python, source_dir + "/bench/hf_peft_client.py"};
  } else {
    args = {(build_dir() / "bench/symbiosis-bench-client").string(), "--threads",
            std::to_string(get("threads").get<int>()), "--transport", get("transport").get<std::string>()};
    if (system == "monolithic") args.push_back("--monolithic");
    if (get("cuda_graph").get<bool>()) args.push_back("--cuda-graph");
    if (system != "monolithic" && get("mask").get<bool>()) args.push_back("--mask");
    if (system != "monolithic" && get("mask_effects_here").get<bool>()) args.push_back("--mask-effects-here");
    if (system != "monolithic" && get("decode_halves").get<bool>()) args.push_back("--decode-halves");
    if (c.contains("mps_thread_percentage")) {
      args.insert(args.end(), {"--mps-thread-percentage", std::to_string(c["mps_thread_percentage"].get<int>())});
    }
  }
  std::vector<std::string> common = {"--model",      model.string(),
                                     "--mode",       get("mode").get<std::string>(),
                                     "--batch",      std::to_string(get("batch").get<int64_t>()),
                                     "--seq",        std::to_string(get("seq").get<int64_t>()),
                                     "--rank",       std::to_string(get("rank").get<int64_t>()),
                                     "--targets",    get("targets").get<std::string>(),
                                     "--iterations", std::to_string(get("iterations").get<int>()),
                                     "--warmup",     std::to_string(get("warmup").get<int>()),
                                     "--device",     get("device").get<std::string>(),
                                     "--dtype",      get("dtype").get<std::string>(),
                                     "--seed",       std::to_string(index + 1)};
  args.insert(args.end(), common.begin(), common.end());
  if (c.contains("new_tokens") || defaults.contains("new_tokens")) {
    args.insert(args.end(), {"--new-tokens", std::to_string(get("new_tokens").get<int64_t>())});
  }
  return args;
}

// [Traced runs]: merges the run's traces in `dir` into dir/trace.json; returns the summary that
// bench/merge_traces.py wrote (where each call's time went).
json merge_traces(const fs::path& dir, size_t clients, bool with_executor) {
  std::string command = python + " " + source_dir + "/bench/merge_traces.py --out " + (dir / "trace.json").string() +
                        " --summary " + (dir / "trace_summary.json").string();
  if (with_executor) command += " executor=" + (dir / "executor.trace.json").string();
  for (size_t i = 0; i < clients; ++i) {
    const std::string name = "client" + std::to_string(i);
    command += " " + name + "=" + (dir / (name + ".trace.json")).string();
  }
  command += " > " + (dir / "trace_summary.txt").string();
  if (std::system(command.c_str()) != 0) throw std::runtime_error("merging the traces failed: " + command);
  std::cerr << read_file(dir / "trace_summary.txt");
  return json::parse(read_file(dir / "trace_summary.json"));
}

// Samples the GPU's memory in use (MiB, nvidia-smi) while alive; peak() is the largest reading.
class GpuMemorySampler {
 public:
  explicit GpuMemorySampler(int gpu) : gpu_(gpu) {
    if (gpu_ < 0) return;
    thread_ = std::thread([this] {
      while (!stop_) {
        peak_ = std::max(peak_.load(), gpu_memory_mib(gpu_));
        std::this_thread::sleep_for(std::chrono::milliseconds(250));
      }
    });
  }
  ~GpuMemorySampler() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  double peak_mib() const { return peak_; }

 private:
  int gpu_;
  std::atomic<bool> stop_{false};
  std::atomic<double> peak_{0};
  std::thread thread_;
};

// Runs every client at once and measures them over one window; returns their results and the
// aggregate figures.
json run_clients(const std::string& system, const std::vector<json>& clients, const fs::path& model,
                 const json& defaults, const fs::path& dir, const std::string& executor, double window_s, int gpu) {
  fs::create_directories(dir);
  const double idle_mib = gpu_memory_mib(gpu);
  GpuMemorySampler sampler(gpu);
  const bool traced = trace_iterations > 0 && system != "hf_peft" && window_s > 0;
  std::vector<pid_t> pids;
  const fs::path go = dir / "go";
  fs::remove(go);
  for (size_t i = 0; i < clients.size(); ++i) {
    const std::string name = "client" + std::to_string(i);
    auto args = client_args(system, clients[i], model, static_cast<int>(i), defaults);
    args.insert(args.end(), {"--out", (dir / (name + ".json")).string()});
    if (window_s > 0) {
      fs::remove(dir / (name + ".ready"));
      args.insert(args.end(), {"--ready-file", (dir / (name + ".ready")).string(), "--go-file", go.string()});
    }
    if (system == "symbiosis") args.insert(args.end(), {"--executor", executor});
    if (traced) {
      fs::remove(dir / (name + ".trace.json.done"));
      args.insert(args.end(), {"--trace", (dir / (name + ".trace.json")).string(), "--trace-iterations",
                               std::to_string(trace_iterations)});
    }
    pids.push_back(spawn(args, dir / (name + ".out"), dir / (name + ".err")));
  }
  auto fail = [&](const std::string& why) {
    for (pid_t pid : pids) kill(pid, SIGKILL);
    for (pid_t pid : pids) waitpid(pid, nullptr, 0);
    throw std::runtime_error(system + ": " + why + "; see the .err files in " + dir.string());
  };
  if (window_s > 0) {
    // [Measurement window]: open it once every client is warm.
    for (size_t i = 0; i < clients.size(); ++i) {
      const auto ready = dir / ("client" + std::to_string(i) + ".ready");
      for (int t = 0; !fs::exists(ready); ++t) {
        int status = 0;
        if (waitpid(pids[i], &status, WNOHANG) == pids[i])
          fail("client " + std::to_string(i) + " exited while warming up");
        if (t > 9000) fail("client " + std::to_string(i) + " not warm after 15 minutes");
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    if (traced && !executor.empty())
      symbiosis::request_trace(executor, 10000, true, fs::absolute(dir / "executor.trace.json"));
    const double start = epoch_seconds() + 0.5;
    std::ofstream(dir / "go.tmp") << std::to_string(start) << " " << std::to_string(start + window_s) << "\n";
    fs::rename(dir / "go.tmp", go);
  }
  if (traced) {
    // [Traced runs]: the executor's trace ends once every client's is written (or it ended).
    for (size_t i = 0; i < clients.size(); ++i) {
      const auto done = dir / ("client" + std::to_string(i) + ".trace.json.done");
      siginfo_t exited{};
      while (!fs::exists(done) && waitid(P_PID, pids[i], &exited, WEXITED | WNOHANG | WNOWAIT) == 0 &&
             exited.si_pid == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    if (!executor.empty()) symbiosis::request_trace(executor, 600000, false);
  }
  bool ok = true;
  for (pid_t pid : pids) ok = wait_ok(pid) && ok;
  if (!ok) fail("a client failed");
  json result = {{"system", system}, {"count", clients.size()}, {"clients", json::array()}, {"groups", json::object()}};
  std::vector<json> reported;
  size_t rss = 0, gpu_reserved = 0;
  for (size_t i = 0; i < pids.size(); ++i) {
    json c = json::parse(read_file(dir / ("client" + std::to_string(i) + ".json")));
    c["group"] = clients[i]["group"];
    rss += c["peak_rss_bytes"].get<size_t>();
    gpu_reserved += c.value("gpu_peak_reserved_bytes", size_t{0});
    reported.push_back(c);
  }
  result.update(summarize(reported));
  const auto groups = group_names(clients);
  for (const auto& group : groups) {
    if (groups.size() < 2) break;
    result["groups"][group] = summarize(members_of(reported, group));
  }
  for (auto& c : reported) {
    c.erase("latencies_s");
    result["clients"].push_back(c);
  }
  if (traced) result["trace"] = merge_traces(dir, clients.size(), !executor.empty());
  result["clients_peak_rss_bytes_total"] = rss;
  result["clients_gpu_peak_reserved_bytes_total"] = gpu_reserved;
  result["gpu_memory_used_peak_mib"] = sampler.peak_mib();
  result["gpu_memory_idle_mib"] = idle_mib;
  return result;
}

// The executor's --threads: a number (0: [CPU threads]' choice per batch), or "all" (the host's cores).
std::string executor_threads(const json& threads) {
  if (threads.is_string() && threads.get<std::string>() == "all")
    return std::to_string(std::thread::hardware_concurrency());
  return std::to_string(threads.get<int>());
}

std::vector<std::string> executor_args(const json& scenario, const fs::path& model, const std::string& policy) {
  const json& ex = scenario.value("executor", json::object());
  std::vector<std::string> args = {"--model",
                                   model.string(),
                                   "--listen",
                                   "tcp://127.0.0.1:*",
                                   "--device",
                                   ex.value("device", "cpu"),
                                   "--batching",
                                   policy,
                                   "--max-wait",
                                   std::to_string(ex.value("max_wait_us", 2000)),
                                   "--lockstep-timeout",
                                   std::to_string(ex.value("lockstep_timeout_ms", 1000)),
                                   "--threads",
                                   executor_threads(ex.value("threads", json(1))),
                                   "--spin-us",
                                   std::to_string(ex.value("spin_us", -1)),
                                   "--log-level",
                                   ex.value("log_level", "warn")};
  // The optional settings, each passed on as set (a bool as true/false).
  static const std::pair<const char*, const char*> kFlags[] = {{"dtype", "--dtype"},
                                                               {"decode_align_wait_us", "--decode-align-wait"},
                                                               {"judge_window_ms", "--judge-window"},
                                                               {"streams", "--streams"},
                                                               {"launch_ahead", "--launch-ahead"},
                                                               {"launch_together", "--launch-together"},
                                                               {"launch_together_max", "--launch-together-max"},
                                                               {"launch_together_from", "--launch-together-from"},
                                                               {"launch_together_wait_us", "--launch-together-wait"},
                                                               {"finetune_sm_percent", "--finetune-sm-percent"},
                                                               {"finetune_piece_rows", "--finetune-piece-rows"},
                                                               {"concurrent_tokens", "--concurrent-tokens"},
                                                               {"mlp_blocks", "--mlp-blocks"},
                                                               {"mlp_bridges", "--mlp-bridges"}};
  for (const auto& [key, flag] : kFlags) {
    if (!ex.contains(key)) continue;
    const json& value = ex[key];
    args.insert(args.end(), {flag, value.is_string()    ? value.get<std::string>()
                                   : value.is_boolean() ? std::string(value.get<bool>() ? "true" : "false")
                                                        : std::to_string(value.get<int64_t>())});
  }
  if (ex.value("lm_head", false)) args.push_back("--lm-head");  // a flag: [Served tied head] too
  return args;
}

// What the executor warned about its tenants in `log` (its lines "[...] [warning] client N: ..."),
// each line once with how often it came: a tenant whose steps stopped being launched ahead, or
// whose captured calls stopped replaying, says why here, where the run's figures alone would not.
json tenant_warnings(const std::string& log) {
  json said = json::array();
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    const auto level = line.find("] [warning] client ");
    if (level == std::string::npos) continue;
    const std::string text = line.substr(level + std::string("] [warning] ").size());
    const auto same = std::find_if(said.begin(), said.end(), [&](const json& w) { return w["text"] == text; });
    if (same != said.end()) {
      (*same)["count"] = (*same)["count"].get<int>() + 1;
    } else {
      said.push_back({{"text", text}, {"count", 1}});
    }
  }
  return said;
}

json run_symbiosis(const json& scenario, const std::vector<json>& clients, const fs::path& model, const json& defaults,
                   const std::string& policy, const fs::path& dir, double window_s, int gpu) {
  auto executor = start_executor(executor_args(scenario, model, policy), dir);
  json result;
  try {
    result = run_clients("symbiosis", clients, model, defaults, dir, executor.endpoint, window_s, gpu);
  } catch (...) {
    kill(executor.pid, SIGKILL);
    waitpid(executor.pid, nullptr, 0);
    throw;
  }
  {
    const auto stats = symbiosis::request_stats(executor.endpoint, 10000);
    std::string text;
    (void)google::protobuf::util::MessageToJsonString(stats, &text);
    result["executor"] = json::parse(text);
    // Calls launched ahead ([Steps launched ahead]) are in no batch.
    const double batched = double(stats.requests() - stats.ahead_calls());
    result["mean_batch_requests"] = stats.batches() ? batched / stats.batches() : 0.0;
    result["mean_call_tokens"] = stats.requests() ? double(stats.tokens()) / stats.requests() : 0.0;
    result["ahead_share"] = stats.requests() ? double(stats.ahead_calls()) / stats.requests() : 0.0;
    result["together_share"] = stats.requests() ? double(stats.together_calls()) / stats.requests() : 0.0;
    result["yielding_calls"] = stats.yielding_calls();
  }
  result["executor_peak_rss_bytes"] = peak_rss_bytes(executor.pid);
  result["policy"] = policy;
  stop(executor.pid);
  result["executor_tenant_warnings"] = tenant_warnings(read_file(dir / "executor.err"));  // its log's sink
  return result;
}

// Capacity: clients of `system` start in waves (each once the previous is warm) until one fails or
// `limit` run; all then stop. Returns how many ran at once. A wave starts at most `wave` clients,
// and no more than the memory left fits by the peak memory each running client has taken so far:
// near the end they start one at a time, so a wave that overshoots does not undercount.
json run_capacity(const std::string& system, const json& scenario, const json& client, const fs::path& model,
                  const json& defaults, const fs::path& dir, int limit, int wave, int gpu) {
  fs::create_directories(dir);
  std::optional<ExecutorProcess> executor;
  if (system == "symbiosis") executor = start_executor(executor_args(scenario, model, "opportunistic"), dir);
  const fs::path stop_file = dir / "stop";
  fs::remove(stop_file);
  GpuMemorySampler sampler(gpu);
  const double before_clients = gpu_memory_mib(gpu), total = gpu_memory_mib(gpu, "memory.total");
  std::vector<pid_t> pids;
  std::string reason = "reached the limit of " + std::to_string(limit);
  for (int first = 0, size = wave; first < limit && reason.rfind("reached", 0) == 0; first += size) {
    if (!pids.empty() && total > 0) {
      const double per_client = (sampler.peak_mib() - before_clients) / static_cast<double>(pids.size());
      const double left = total - sampler.peak_mib();
      size = per_client > 0 ? std::clamp(static_cast<int>(left / per_client), 1, wave) : wave;
    }
    std::vector<std::pair<int, pid_t>> starting;
    for (int i = first; i < std::min(limit, first + size); ++i) {
      const std::string name = "client" + std::to_string(i);
      auto args = client_args(system, client, model, i, defaults);
      args.insert(args.end(), {"--out", (dir / (name + ".json")).string(), "--ready-file",
                               (dir / (name + ".ready")).string(), "--stop-file", stop_file.string()});
      if (executor) args.insert(args.end(), {"--executor", executor->endpoint});
      starting.emplace_back(i, spawn(args, dir / (name + ".out"), dir / (name + ".err")));
    }
    for (const auto& [i, pid] : starting) {
      const std::string name = "client" + std::to_string(i);
      bool warm = false, died = false;
      while (!warm && !died) {
        warm = fs::exists(dir / (name + ".ready"));
        died = waitpid(pid, nullptr, WNOHANG) == pid;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      if (warm) {
        pids.push_back(pid);
      } else {
        reason = "client " + std::to_string(i) + " failed: " + read_file(dir / (name + ".err")).substr(0, 400);
      }
    }
  }
  std::this_thread::sleep_for(std::chrono::seconds(3));  // the running ones keep iterating together
  std::ofstream(stop_file) << "stop\n";
  int still_ok = 0;
  for (pid_t pid : pids) still_ok += wait_ok(pid) ? 1 : 0;
  if (executor) stop(executor->pid);
  return {{"system", system},
          {"clients_that_fit", still_ok},
          {"started", pids.size()},
          {"stopped_because", reason},
          {"gpu_memory_used_peak_mib", sampler.peak_mib()}};
}

// Generation: the tenants' mean time per output token, the fastest tenant's p50, the slowest
// tenant's p50 and p99 (ms).
std::string token_latencies(const json& figures) {
  if (!figures.contains("worst_tenant_time_per_output_token_p50_s")) return "";
  char text[200];
  std::snprintf(
      text, sizeof text,
      "  per output token: mean %.2f ms, tenants' p50 %.2f to %.2f, worst tenant p99 %.2f ms; first token p50 "
      "%.1f ms",
      1e3 * figures.value("mean_tenant_time_per_output_token_s", 0.0),
      1e3 * figures.value("best_tenant_time_per_output_token_p50_s", 0.0),
      1e3 * figures["worst_tenant_time_per_output_token_p50_s"].get<double>(),
      1e3 * figures["worst_tenant_time_per_output_token_p99_s"].get<double>(),
      1e3 * figures["worst_tenant_time_to_first_token_p50_s"].get<double>());
  return text;
}

void print_row(const json& run, double best_baseline) {
  const std::string name =
      run["system"].get<std::string>() + (run.contains("policy") ? "/" + run["policy"].get<std::string>() : "");
  const double tps = run["aggregate_tokens_per_s"].get<double>();
  std::printf("%-26s %5d %12.1f %14.2f %14.2f %12.0f %16s%s\n", name.c_str(), run["count"].get<int>(), tps,
              1e3 * run["mean_iteration_s"].get<double>(), 1e3 * run["p50_iteration_s"].get<double>(),
              run["gpu_memory_used_peak_mib"].get<double>(),
              best_baseline > 0 ? (std::to_string(tps / best_baseline).substr(0, 5) + "x").c_str() : "-",
              token_latencies(run).c_str());
  if (run.contains("mean_batch_requests")) {
    std::printf("%-26s mean batch %.2f requests, %.1f tokens a call; %.0f%% of the calls launched ahead\n", "",
                run["mean_batch_requests"].get<double>(), run["mean_call_tokens"].get<double>(),
                100 * run.value("ahead_share", 0.0));
  }
  for (const auto& warning : run.value("executor_tenant_warnings", json::array())) {
    std::printf("%-26s the executor: %s (%d times)\n", "", warning["text"].get<std::string>().c_str(),
                warning["count"].get<int>());
  }
  const json groups = run.value("groups", json::object());
  for (const auto& [group, figures] : groups.items()) {
    std::printf("%-26s group %s: %.1f tokens/s%s\n", "", group.c_str(), figures["aggregate_tokens_per_s"].get<double>(),
                token_latencies(figures).c_str());
  }
}

// [Mixed workload] A scenario with "alone": true also runs each group of its clients alone on an
// executor of its own (the first policy), and reports each group's figures together against alone:
// tokens/s, and for generation the time per output token.
void compare_alone(const json& together, const std::vector<json>& alone) {
  for (const auto& run : alone) {
    const auto& group = run["alone_group"].get<std::string>();
    const auto& mixed = together["groups"][group];
    std::printf("group %-12s together/alone: tokens/s %.3f", group.c_str(),
                mixed["aggregate_tokens_per_s"].get<double>() / run["aggregate_tokens_per_s"].get<double>());
    for (const char* key : {"worst_tenant_time_per_output_token_p50_s", "worst_tenant_time_per_output_token_p99_s"}) {
      if (run.contains(key)) std::printf(", %s %.3f", key, mixed[key].get<double>() / run[key].get<double>());
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string scenario_file, out_dir;
  CLI::App app{"symbiosis-bench: run a benchmark scenario (see docs/benchmarks.md)"};
  app.add_option("--scenario", scenario_file, "scenario JSON file")->required();
  app.add_option("--out", out_dir, "directory for results.json, results.png and the logs (required to run)");
  bool check_only = false;
  app.add_flag("--check", check_only, "check the scenario's keys ([Scenario keys]) and run nothing");
  app.add_option("--python", python, "Python with transformers and peft (HF PEFT baseline, plot)")
      ->capture_default_str();
  app.add_option("--source-dir", source_dir, "the Symbiosis source tree")->capture_default_str();
  std::string checkpoint_override;
  std::vector<int> counts_override;
  app.add_option("--checkpoint", checkpoint_override, "use this checkpoint instead of the scenario's model");
  app.add_option("--counts", counts_override, "client counts instead of the scenario's (comma-separated)")
      ->delimiter(',');
  app.add_option("--trace", trace_iterations,
                 "trace this many iterations of each client in the window, with the "
                 "executor, into each run's trace.json (see [Traced runs]; a scenario with a window_s)");
  CLI11_PARSE(app, argc, argv);
  try {
    const json scenario = json::parse(read_file(scenario_file));
    check_scenario(scenario);
    if (check_only) return 0;
    if (out_dir.empty()) throw std::runtime_error("--out is required to run a scenario");
    const fs::path out = out_dir;
    fs::create_directories(out);
    json defaults = {{"mode", "finetune"},
                     {"batch", 1},
                     {"seq", 64},
                     {"rank", 8},
                     {"targets", "q_proj,v_proj"},
                     {"iterations", 10},
                     {"warmup", 2},
                     {"device", "cpu"},
                     {"dtype", "fp32"},
                     {"transport", "auto"},
                     {"threads", 1},
                     {"cuda_graph", false},
                     {"mask", false},
                     {"mask_effects_here", false},
                     {"decode_halves", false}};
    if (scenario.contains("client_defaults")) defaults.update(scenario["client_defaults"]);
    const int gpu = gpu_index(scenario.value("executor", json::object()).value("device", "cpu"));

    fs::path model;
    const json& m = scenario.at("model");
    if (!checkpoint_override.empty()) {
      model = checkpoint_override;
    } else if (m.contains("checkpoint")) {
      model = m["checkpoint"].get<std::string>();
    } else {
      model = out / "model";
      const std::string command = (build_dir() / "tools/symbiosis-make-checkpoint").string() + " --preset " +
                                  m.at("preset").get<std::string>() + " --dtype " + m.value("dtype", "fp32") +
                                  (m.contains("layers") ? " --layers " + std::to_string(m["layers"].get<int>()) : "") +
                                  " --out " + model.string() + " > " + (out / "make_checkpoint.log").string();
      if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
    }
    std::vector<std::string> baselines = scenario.value("baselines", std::vector<std::string>{});
    if (scenario.value("baseline", false)) baselines.push_back("monolithic");
    const auto systems_with_baselines = [&] {
      std::vector<std::string> s = {"symbiosis"};
      s.insert(s.end(), baselines.begin(), baselines.end());
      return s;
    }();
    json results = {{"scenario", scenario}, {"runs", json::array()}};

    if (scenario.value("mode", "throughput") == "capacity") {
      const int limit = scenario.value("capacity_limit", 16);
      const int wave = scenario.value("capacity_wave", 1);
      for (const auto& system : systems_with_baselines) {
        std::cerr << "symbiosis-bench: capacity of " << system << std::endl;
        results["runs"].push_back(run_capacity(system, scenario, scenario.at("clients").at(0), model, defaults,
                                               out / system, limit, wave, gpu));
        std::printf("%-12s %3d clients fit (%s)\n", system.c_str(),
                    results["runs"].back()["clients_that_fit"].get<int>(),
                    results["runs"].back()["stopped_because"].get<std::string>().c_str());
      }
      std::ofstream(out / "results.json") << results.dump(2) << "\n";
      return 0;
    }

    const double window_s = scenario.value("window_s", 0.0);
    const std::vector<int> counts =
        counts_override.empty() ? scenario.value("counts", std::vector<int>{0}) : counts_override;
    // Variants of the Symbiosis clients run side by side (e.g. remote and local placement).
    const auto variants = scenario.value("variants", std::vector<json>{json::object()});
    const auto policies =
        scenario.value("executor", json::object()).value("policies", std::vector<std::string>{"opportunistic"});
    std::printf("%-26s %5s %12s %14s %14s %12s %16s\n", "run", "N", "tokens/s", "mean iter ms", "p50 iter ms",
                "GPU MiB", "vs best base");
    for (int count : counts) {
      const auto clients = expand_clients(scenario, count);
      const std::string tag = count > 0 ? "n" + std::to_string(count) : "all";
      std::vector<json> runs;
      for (const auto& variant : variants) {
        // A variant's "executor" settings replace the scenario's for its runs; the rest are client settings.
        json variant_scenario = scenario, variant_defaults = defaults, settings = variant;
        if (settings.contains("executor")) {
          json& executor = variant_scenario["executor"];
          if (executor.is_null()) executor = json::object();
          executor.update(settings["executor"]);
          settings.erase("executor");
        }
        variant_defaults.update(settings);
        const std::string name = variant.value("name", "");
        for (const auto& policy : policies) {
          std::cerr << "symbiosis-bench: " << clients.size() << " clients " << name << ", policy " << policy
                    << std::endl;
          runs.push_back(run_symbiosis(variant_scenario, clients, model, variant_defaults, policy,
                                       out / tag / (name.empty() ? policy : name + "-" + policy), window_s, gpu));
          if (!name.empty()) runs.back()["system"] = "symbiosis/" + name;
        }
      }
      double best_baseline = 0, best_baseline_iteration = 0;
      for (const auto& system : baselines) {
        std::cerr << "symbiosis-bench: baseline " << system << ", " << clients.size() << " processes" << std::endl;
        runs.push_back(run_clients(system, clients, model, defaults, out / tag / system, "", window_s, gpu));
        if (runs.back()["aggregate_tokens_per_s"].get<double>() > best_baseline) {
          best_baseline = runs.back()["aggregate_tokens_per_s"].get<double>();
          best_baseline_iteration = runs.back()["mean_iteration_s"].get<double>();
        }
      }
      std::vector<json> alone;
      if (scenario.value("alone", false)) {
        for (const auto& group : group_names(clients)) {
          const auto members = members_of(clients, group);
          std::cerr << "symbiosis-bench: group " << group << " alone, " << members.size() << " clients" << std::endl;
          alone.push_back(run_symbiosis(scenario, members, model, defaults, policies.front(),
                                        out / tag / ("alone-" + group), window_s, gpu));
          alone.back()["system"] = "symbiosis/alone-" + group;
          alone.back()["alone_group"] = group;
        }
        runs.insert(runs.end(), alone.begin(), alone.end());
      }
      for (auto& run : runs) {
        if (best_baseline > 0) {
          run["throughput_vs_best_baseline"] = run["aggregate_tokens_per_s"].get<double>() / best_baseline;
          run["iteration_time_vs_best_baseline"] = run["mean_iteration_s"].get<double>() / best_baseline_iteration;
        }
        print_row(run, best_baseline);
        results["runs"].push_back(run);
      }
      if (!alone.empty()) compare_alone(runs.front(), alone);
      std::fflush(stdout);
      std::ofstream(out / "results.json") << results.dump(2) << "\n";  // partial results survive a later failure
    }
    const std::string plot = python + " " + source_dir + "/bench/plot.py " + (out / "results.json").string() + " " +
                             (out / "results.png").string();
    if (std::system(plot.c_str()) != 0) std::cerr << "symbiosis-bench: no plot (" << plot << " failed)\n";
    std::printf("results: %s\n", (out / "results.json").c_str());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-bench: " << scenario_file << ": " << e.what() << std::endl;
    return 1;
  }
}
