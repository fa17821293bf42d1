// symbiosis-bench-long-context: issue 28's benchmark, in one run against one executor process.
//
// Single request (batch 1), for each context of --contexts (prompt tokens) and --new-tokens greedy
// new tokens, the inter-token latency (the mean time between a request's tokens after its first) of
//  gpu      the all-GPU client: the model's client layers and the KV cache on --device
//           (decode captured in CUDA graphs, as a user gets it);
//  offload  the same client with its cache in page-locked host memory, each layer's keys and values
//           copied to the GPU at each decode step ([Offloaded decode] in models/kv_cache.h: the
//           baseline, what transformers' OffloadedCache does);
//  host     the heterogeneous placement ([Host decode] in inference/heterogeneous.h): prefill on
//           --device, the cache in page-locked host memory, decode on the CPU over a client of its own.
// A run that does not fit (the GPU's memory, the host capacity, page-locking) is reported "does not
// fit" with the reason, and the next runs go on. The decode steps' cache read rate (the bytes of
// keys and values a step reads over the inter-token latency) is reported for the offload and host
// modes: against the host link's rate, and against the host's memory bandwidth.
//
// First (--attention-bandwidth) the host's memory bandwidth, measured here (a sum over a large
// buffer with every thread and with one; a copy), against [CPU decode attention] over one layer's
// cache of each context (with every thread and with one), and LibTorch's
// scaled_dot_product_attention over the same up to 16K (the kernel it replaced); with the CPUs the
// process may use (online, affinity mask, CFS quota, NUMA nodes) and the threads it runs.
// Each host row also gives where its decode step's time goes ([Decode profile], --profile-ops).
//
// Last (--multi-request) the paper's Figure 20 point: requests of --multi-prompt tokens, as many as
// the host capacity holds on the heterogeneous placement (decode on the CPU) against as many as the
// GPU's free memory (less --gpu-reserve-bytes) holds on the all-GPU client, all submitted at once
// and prefilled --multi-prefill-tokens a step; requests held and the decode tokens/s of the steps
// in which every request decodes.
//
// Results: --out/long_context.csv and --out/long_context.md (and stdout). With --device cpu every
// mode runs on the CPU (the code paths, not the placements): the ctest smoke (long_context_smoke).
// A budget (--budget-s) skips a run whose estimate (twice the same mode's previous context) would
// pass it, reported "skipped".
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <CLI/CLI.hpp>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include <symbiosis/client.h>
#include <symbiosis/inference.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>

#include "bench/op_profile.h"
#include "bench/process.h"
#include "client_runtime/models/attention.h"

using namespace symbiosis;
namespace fs = std::filesystem;

namespace {

struct Settings {
  std::string model;    // a checkpoint directory, or
  std::string preset;   // one symbiosis-make-checkpoint writes under --out
  int64_t layers = -1;  // the preset's layers, or this many
  std::string device = "cuda:0";
  std::string executor_device = "cuda:0";
  std::string dtype = "bf16";
  std::string contexts = "4K,8K,16K,32K,64K,128K";
  std::string modes = "gpu,host,offload";  // under a budget, the last is skipped first
  int64_t new_tokens = 64;
  int64_t lora_r = 8;
  int threads = 0;           // 0: the CPUs this process may use (CpuInfo::usable)
  int64_t profile_ops = 12;  // host rows: the decode step's top operations ([Decode profile]); 0: none
  int64_t host_cache_capacity_bytes = 100LL << 30;
  double budget_s = 0;  // 0: none
  bool attention_bandwidth = true;
  int64_t bandwidth_bytes = 4LL << 30;
  bool multi_request = true;
  int64_t multi_prompt = 1024;
  int64_t multi_new_tokens = 16;
  int64_t multi_max_requests = 0;        // 0: as many as fit
  int64_t multi_prefill_tokens = 16384;  // prompt tokens a step prefills
  int64_t gpu_reserve_bytes =
      8LL << 30;  // left free on the GPU for the prefill's activations and the executor's buffers
  std::string out = "/tmp/long-context";
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::vector<int64_t> parse_contexts(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    int64_t scale = 1;
    if (item.back() == 'K' || item.back() == 'k') {
      scale = 1024;
      item.pop_back();
    }
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
    }
    TORCH_CHECK(used == item.size() && value > 0, "--contexts: '", item, "' is not a positive count (like 4096 or 4K)");
    out.push_back(value * scale);
  }
  return out;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string context_name(int64_t tokens) {
  return tokens % 1024 == 0 ? std::to_string(tokens / 1024) + "K" : std::to_string(tokens);
}

void release_device_memory() {
#ifdef SYMBIOSIS_WITH_CUDA
  if (c10::cuda::device_count() > 0) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

int64_t free_device_bytes(const at::Device& device) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (device.is_cuda()) {
    release_device_memory();
    size_t free = 0, total = 0;
    c10::cuda::CUDAGuard guard(device);
    if (cudaMemGetInfo(&free, &total) == cudaSuccess) return static_cast<int64_t>(free);
  }
#endif
  return 0;
}

// Whether a failure is the placement's memory running out (or refused by the host capacity).
bool does_not_fit(const std::string& error) {
  for (const char* sign : {"out of memory", "OutOfMemory", "cannot page-lock", "cannot map",
                           "more than host_cache_capacity_bytes", "CUDA error: out of memory"}) {
    if (error.find(sign) != std::string::npos) return true;
  }
  return false;
}

std::string first_line(const std::string& text) {
  auto line = text.substr(0, text.find('\n'));
  return line.size() > 240 ? line.substr(0, 240) + "..." : line;
}

// [Decode profile] Where a decode step's CPU time goes: the [Op profile] (bench/op_profile.h) of
// the stepping thread alone, recording from the first token (the prefill's) to the last; its model's
// operators, its calls to the executor and [CPU decode attention].
struct StepOp {
  std::string name;
  double calls_per_step = 0, ms_per_step = 0;
};
// The `top` operations that took longest over `steps` steps, per step, the longest first.
std::vector<StepOp> step_ops(const std::vector<bench::OpProfile::Op>& ops, int64_t steps, size_t top) {
  std::vector<StepOp> out;
  for (const auto& op : ops) {
    if (out.size() == top) break;
    out.push_back({op.name, static_cast<double>(op.count) / steps, op.seconds * 1e3 / steps});
  }
  return out;
}

// The CPUs this process may use, and what LibTorch makes of them: a VM or container may show more
// CPUs than it may run on (an affinity mask, a CFS quota), and threads beyond those only contend.
struct CpuInfo {
  unsigned online = 0;  // std::thread::hardware_concurrency(): the CPUs online
  int affinity = 0;     // in this process's affinity mask
  double quota = 0;     // CPUs' worth of the cgroup's CFS quota; 0: none
  int numa_nodes = 0;   // /sys/devices/system/node/node*
  // The threads to use by default: the affinity mask's CPUs, no more than the quota allows.
  int usable() const {
    int n = affinity > 0 ? affinity : static_cast<int>(online);
    if (quota > 0) n = std::min(n, std::max(1, static_cast<int>(std::ceil(quota))));
    return std::max(1, n);
  }
  std::string describe() const {
    std::ostringstream out;
    out << online << " CPUs online, " << affinity << " in the affinity mask, "
        << (quota > 0 ? std::to_string(quota).substr(0, 5) + " CPUs of CFS quota" : std::string("no CFS quota")) << ", "
        << numa_nodes << " NUMA node" << (numa_nodes == 1 ? "" : "s");
    // OpenMP's own settings, where the environment gives them (LibTorch's threads are OpenMP's).
    for (const char* name : {"OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}) {
      if (const char* value = std::getenv(name)) out << ", " << name << "=" << value;
    }
    return out.str();
  }
};

CpuInfo cpu_info() {
  CpuInfo info;
  info.online = std::thread::hardware_concurrency();
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) info.affinity = CPU_COUNT(&set);
  // cgroup v2 (cpu.max: "QUOTA PERIOD" or "max PERIOD"), else v1.
  std::ifstream v2("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (v2 >> quota >> period) {
    if (quota != "max" && period > 0) info.quota = std::stod(quota) / period;
  } else {
    std::ifstream q("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
    double us = 0;
    if (q >> us && p >> period && us > 0 && period > 0) info.quota = us / period;
  }
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator("/sys/devices/system/node", ignored)) {
    const auto name = entry.path().filename().string();
    if (name.rfind("node", 0) == 0 && name.size() > 4 && std::isdigit(static_cast<unsigned char>(name[4])))
      ++info.numa_nodes;
  }
  return info;
}

struct Row {
  std::string mode;
  int64_t context = 0;
  std::string status = "ok";  // ok, does not fit, failed, skipped
  std::string reason;
  int64_t requests = 1;
  double prefill_s = 0, itl_ms = 0, tokens_per_s = 0;
  double cache_gib = 0;            // the cache the run allocated
  double cache_read_gb_per_s = 0;  // bytes of keys and values a decode step reads / inter-token latency
  double seconds = 0;              // the run's wall time, allocation included
  std::vector<StepOp> profile;     // host: the decode steps' top operations ([Decode profile])
};

// The models, their clients and the executor they share.
struct Models {
  std::shared_ptr<Checkpoint> checkpoint;
  std::shared_ptr<Client> device_client, host_client;
  CausalLM device_lm, host_lm;  // on --device; on the CPU (host decode's decode side)
  ModelShape shape;
  at::ScalarType dtype = at::kBFloat16;
};

GenerationRequest make_request(int64_t prompt, int64_t new_tokens, int64_t vocab, uint64_t seed) {
  GenerationRequest request;
  request.prompt_ids.resize(static_cast<size_t>(prompt));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& id : request.prompt_ids) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = static_cast<int64_t>(x % static_cast<uint64_t>(vocab));
  }
  request.sampling.max_new_tokens = new_tokens;
  return request;
}

std::unique_ptr<Generator> make_generator(Models& m, const std::string& mode, GeneratorOptions options) {
  options.offload_cache = mode == "offload";
  if (mode == "host") return std::make_unique<Generator>(m.device_lm, m.host_lm, options);
  return std::make_unique<Generator>(m.device_lm, options);
}

// Runs `run` (one row's measurement), then gives back the device memory it cached and records its
// seconds; where it throws, the row's status says why ("does not fit": out of memory) and its
// reason gives the error's first line.
void measure(Row& row, const std::function<void()>& run) {
  const double start = now_s();
  try {
    run();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    row.status = does_not_fit(what) ? "does not fit" : "failed";
    row.reason = first_line(what);
  } catch (const std::exception& e) {
    row.status = does_not_fit(e.what()) ? "does not fit" : "failed";
    row.reason = first_line(e.what());
  }
  release_device_memory();
  row.seconds = now_s() - start;
}

// One request of `prompt` tokens and `new_tokens` new ones; fills the row's timings, or its status
// and reason. The inter-token latency leaves out the first three decode steps when there are at
// least 8 tokens: a captured client's first decode steps are its warm-up and capture
// ([Captured decode]), which a long generation amortizes.
void generate(Models& m, const std::string& mode, int64_t prompt, int64_t new_tokens, GeneratorOptions options,
              Row& row, size_t profile_ops = 0) {
  measure(row, [&] {
    options.max_sequences = 1;
    options.max_tokens = prompt + new_tokens;
    options.max_prefill_tokens = prompt;
    auto generator = make_generator(m, mode, options);
    row.cache_gib = static_cast<double>(generator->cache().bytes()) / (1LL << 30);
    const int64_t vocab = cached_model(*m.device_lm.module).token_embeddings().size(0);
    std::vector<double> times;  // each token's arrival
    std::string error;
    // [Decode profile]: the decode steps, from the first token (the prefill's) to the last.
    std::optional<bench::OpProfile> profile;
    if (profile_ops > 0) {
      profile.emplace(bench::OpProfile::Threads::kThisOne);
      profile->recording = false;  // from the first token on
    }
    generator->submit(make_request(prompt, new_tokens, vocab, 1), [&](const TokenEvent& event) {
      if (event.token >= 0) times.push_back(now_s());
      if (event.finished && !event.error.empty() && error.empty()) error = event.error;
      if (profile) profile->recording = !event.finished;
    });
    const double submitted = now_s();
    generator->run();
    TORCH_CHECK(error.empty(), error);
    if (profile && times.size() >= 2)
      row.profile = step_ops(profile->ops(), static_cast<int64_t>(times.size() - 1), profile_ops);
    TORCH_CHECK(times.size() >= 2, "the request produced ", times.size(), " tokens, expected ", new_tokens);
    row.prefill_s = times.front() - submitted;
    const size_t from = times.size() >= 8 ? 3 : 0;
    const double intervals = static_cast<double>(times.size() - 1 - from);
    row.itl_ms = (times.back() - times[from]) / intervals * 1e3;
    row.tokens_per_s = 1e3 / row.itl_ms;
    // A decode step reads the sequence's keys and values: the prompt and, on average, half the new tokens.
    const double positions = static_cast<double>(prompt) + new_tokens / 2.0;
    row.cache_read_gb_per_s = positions * KvCache::bytes_per_position(m.shape, m.dtype) / (row.itl_ms / 1e3) / 1e9;
  });
}

// The multi-request point: `requests` requests of `prompt` tokens, prefilled at most `prefill_tokens`
// a step (so the prefill's activations stay small beside the caches), each with enough new tokens
// that all of them decode together for at least `new_tokens` steps; the decode rate counts only
// those steps (every request in the batch).
void generate_many(Models& m, const std::string& mode, int64_t requests, int64_t prompt, int64_t new_tokens,
                   int64_t prefill_tokens, GeneratorOptions options, Row& row) {
  measure(row, [&] {
    const int64_t per_step = std::max<int64_t>(1, prefill_tokens / prompt);
    const int64_t total_new = new_tokens + (requests + per_step - 1) / per_step + 1;
    options.max_sequences = requests;
    options.max_tokens = prompt + total_new;
    options.max_prefill_tokens = per_step * prompt;
    auto generator = make_generator(m, mode, options);
    row.cache_gib = static_cast<double>(generator->cache().bytes()) / (1LL << 30);
    const int64_t vocab = cached_model(*m.device_lm.module).token_embeddings().size(0);
    std::string error;
    for (int64_t r = 0; r < requests; ++r) {
      generator->submit(make_request(prompt, total_new, vocab, static_cast<uint64_t>(r + 1)),
                        [&](const TokenEvent& event) {
                          if (event.finished && !event.error.empty() && error.empty()) error = event.error;
                        });
    }
    const double submitted = now_s();
    int64_t full_steps = 0;
    double full_seconds = 0;
    while (true) {
      const bool full = generator->running() == requests;  // no slot free: a step of decode alone, every request
      const double before = now_s();
      if (!generator->step()) break;
      if (full) {
        if (full_steps == 0) row.prefill_s = before - submitted;
        ++full_steps;
        full_seconds += now_s() - before;
      }
      if (!error.empty()) break;
    }
    TORCH_CHECK(error.empty(), error);
    TORCH_CHECK(full_steps > 0, "no step decoded every request");
    row.itl_ms = full_seconds / static_cast<double>(full_steps) * 1e3;
    row.tokens_per_s = static_cast<double>(requests * full_steps) / full_seconds;
    const double positions = static_cast<double>(requests) * (static_cast<double>(prompt) + total_new / 2.0);
    row.cache_read_gb_per_s = positions * KvCache::bytes_per_position(m.shape, m.dtype) / (row.itl_ms / 1e3) / 1e9;
  });
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

// [CPU decode attention] against the host's memory bandwidth and LibTorch's attention.
struct BandwidthRow {
  int64_t context;
  double bytes, kernel_gb_per_s, kernel_one_thread_gb_per_s, sdpa_gb_per_s;
};
// The host's memory bandwidth: a sum over a large buffer (a read) with every thread and with one,
// and a copy (a read and a write) with every thread.
struct MemoryBandwidth {
  double sum_gb_per_s = 0, sum_one_thread_gb_per_s = 0, copy_gb_per_s = 0;
};

double timed(const std::function<void()>& run, int repeats) {
  run();  // warm: first touch, thread pool
  const double start = now_s();
  for (int i = 0; i < repeats; ++i) run();
  return (now_s() - start) / repeats;
}

MemoryBandwidth memory_bandwidth(int64_t bytes) {
  const auto a = at::ones({bytes / 4}, at::kFloat);
  auto b = at::empty_like(a);
  MemoryBandwidth out;
  out.sum_gb_per_s = static_cast<double>(bytes) / timed([&] { (void)a.sum().item<float>(); }, 5) / 1e9;
  out.copy_gb_per_s = 2.0 * static_cast<double>(bytes) / timed([&] { b.copy_(a); }, 5) / 1e9;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  out.sum_one_thread_gb_per_s = static_cast<double>(bytes) / timed([&] { (void)a.sum().item<float>(); }, 2) / 1e9;
  at::set_num_threads(threads);
  return out;
}

// LibTorch's sdpa reads a few GB/s: beyond this context it would take longer than the rest.
constexpr int64_t kSdpaUpTo = 16384;

std::vector<BandwidthRow> attention_bandwidth(const Models& m, const std::vector<int64_t>& contexts) {
  std::vector<BandwidthRow> rows;
  const auto& s = m.shape;
  for (const auto context : contexts) {
    // One layer's keys and values, one sequence: a layer of a decode step. (Filled, not drawn:
    // drawing 2 GiB at 128K takes longer than reading it many times.)
    const auto options = at::TensorOptions().dtype(m.dtype);
    const auto keys = at::empty({1, s.num_key_value_heads, context, s.head_dim}, options).fill_(0.01);
    const auto values = at::empty({1, s.num_key_value_heads, context, s.head_dim}, options).fill_(0.02);
    const auto q = at::randn({1, s.num_attention_heads, s.head_dim}, options);
    const double bytes = 2.0 * static_cast<double>(keys.nbytes());
    const int repeats = std::max<int>(3, static_cast<int>(8e9 / bytes));
    BandwidthRow row{context, bytes, 0, 0, 0};
    if (symbiosis::detail::cpu_decode_attention_supports(q, keys, {})) {
      auto attend = [&] { symbiosis::detail::cpu_decode_attention(q, keys, values, {0}, {context - 1}); };
      row.kernel_gb_per_s = bytes / timed(attend, repeats) / 1e9;
      const int threads = at::get_num_threads();
      at::set_num_threads(1);
      row.kernel_one_thread_gb_per_s = bytes / timed(attend, 1) / 1e9;
      at::set_num_threads(threads);
    }
    if (context <= kSdpaUpTo) {
      const auto q4 = q.unsqueeze(2);  // [1, heads, 1, head_dim]
      row.sdpa_gb_per_s =
          bytes / timed([&] { symbiosis::detail::attention_over(q4, keys, values, {}); }, std::min(repeats, 5)) / 1e9;
    }
    rows.push_back(row);
  }
  return rows;
}

int run(Settings& s) {
  fs::create_directories(s.out);
  const auto cpus = cpu_info();
  const int threads = s.threads > 0 ? s.threads : cpus.usable();
  at::set_num_threads(threads);
  std::cerr << "CPUs: " << cpus.describe() << "; " << threads << " threads (at::get_num_threads() "
            << at::get_num_threads() << ")" << std::endl;
  const auto build = bench::build_dir();
  fs::path model = s.model;
  if (model.empty()) {
    TORCH_CHECK(!s.preset.empty(), "give --model (a checkpoint directory) or --preset (one to write)");
    model =
        fs::path(s.out) / ("model-" + s.preset + (s.layers >= 0 ? "-" + std::to_string(s.layers) : "") + "-" + s.dtype);
    if (!fs::exists(model / "config.json")) {
      std::cerr << "writing the " << s.preset << " checkpoint to " << model << std::endl;
      std::vector<std::string> args = {(build / "tools/symbiosis-make-checkpoint").string(),
                                       "--preset",
                                       s.preset,
                                       "--dtype",
                                       s.dtype,
                                       "--out",
                                       model.string()};
      if (s.layers >= 0) args.insert(args.end(), {"--layers", std::to_string(s.layers)});
      const auto pid =
          bench::spawn(args, fs::path(s.out) / "make-checkpoint.out", fs::path(s.out) / "make-checkpoint.err");
      TORCH_CHECK(bench::wait_ok(pid),
                  "symbiosis-make-checkpoint failed: ", bench::read_file(fs::path(s.out) / "make-checkpoint.err"));
    }
  }
  const auto dtype = parse_dtype_name(s.dtype);
  const double t0 = now_s();
  // One tenant runs at a time (its two clients, one idle): nothing to batch with, so the executor
  // does not wait for companions (opportunistic batching would wait for the idle client's decode
  // steps). A prefill's largest call, 128K tokens x 11008 bf16, is 2.7 GiB.
  const auto executor = bench::start_executor(
      {"--model", model.string(), "--listen", "tcp://127.0.0.1:*", "--device", s.executor_device, "--dtype", s.dtype,
       "--log-level", "warn", "--batching", "none", "--max-request-bytes", std::to_string(16LL << 30)},
      fs::path(s.out) / "executor", 900);
  // For whoever must stop a run cut short (scripts/gpu_check.sh long-context under its timeout).
  std::ofstream(fs::path(s.out) / "executor.pid") << executor.pid << "\n";
  std::cerr << "executor ready at " << executor.endpoint << " after " << fixed(now_s() - t0, 1) << " s" << std::endl;
  std::vector<Row> rows;
  // Each row goes to the CSV as it is measured, so a run stopped early keeps what it measured.
  std::ofstream csv(fs::path(s.out) / "long_context.csv");
  csv << "mode,context,requests,status,prefill_s,itl_ms,tokens_per_s,cache_gib,cache_read_gb_per_s,seconds,reason\n";
  auto record = [&](const Row& r) {
    rows.push_back(r);
    csv << r.mode << "," << r.context << "," << r.requests << "," << r.status << "," << r.prefill_s << "," << r.itl_ms
        << "," << r.tokens_per_s << "," << r.cache_gib << "," << r.cache_read_gb_per_s << "," << r.seconds << ",\""
        << r.reason << "\"" << std::endl;
  };
  std::vector<BandwidthRow> bandwidth;
  MemoryBandwidth memory;
  int status = 0;
  try {
    Models m;
    m.checkpoint = Checkpoint::open(model);
    m.dtype = dtype;
    auto connect = [&](const std::string& device, const std::string& tenant) {
      ClientOptions options;
      options.endpoint = executor.endpoint;
      options.expected_model_hash = m.checkpoint->model_hash();
      options.device = device;
      options.tenant = tenant;
      return Client::connect(options);
    };
    m.device_client = connect(s.device, "long-context");
    m.host_client = connect("cpu", "long-context-host-decode");
    m.device_lm = open_causal_lm(*m.checkpoint, m.device_client, {dtype, at::Device(s.device)});
    m.host_lm = open_causal_lm(*m.checkpoint, m.host_client, {dtype, at::kCPU});
    if (s.lora_r > 0) {
      LoraConfig lora;
      lora.r = s.lora_r;
      add_lora(*m.device_lm.module, lora);
      add_lora(*m.host_lm.module, lora);  // AdapterMirror copies the device model's
    }
    m.shape = model_adapter_host(*m.device_lm.module).model_shape();
    std::cerr << "transports: " << m.device_client->transport() << " (" << s.device << "), "
              << m.host_client->transport() << " (cpu); " << threads << " CPU threads" << std::endl;

    const auto contexts = parse_contexts(s.contexts);
    const auto modes = split(s.modes);
    for (const auto& mode : modes) {
      TORCH_CHECK(mode == "gpu" || mode == "offload" || mode == "host", "--modes: '", mode,
                  "' is not gpu, offload or host");
    }
    GeneratorOptions base;
    base.host_cache_capacity_bytes = s.host_cache_capacity_bytes;
    // A warm-up generation of each mode (kernels chosen, graphs captured, pools filled), not reported.
    for (const auto& mode : modes) {
      Row warm;
      generate(m, mode, std::min<int64_t>(512, contexts.front()), 4, base, warm);
      if (warm.status != "ok")
        std::cerr << "warm-up of " << mode << ": " << warm.status << ": " << warm.reason << std::endl;
    }
    // The memory's bandwidth and the attention's first (a few seconds): what the rows are read against.
    if (s.attention_bandwidth) {
      memory = memory_bandwidth(s.bandwidth_bytes);
      std::cerr << "host memory: a sum reads " << fixed(memory.sum_gb_per_s, 1) << " GB/s ("
                << fixed(memory.sum_one_thread_gb_per_s, 1) << " on one thread), a copy moves "
                << fixed(memory.copy_gb_per_s, 1) << " GB/s" << std::endl;
      bandwidth = attention_bandwidth(m, contexts);
      for (const auto& b : bandwidth) {
        std::cerr << "CPU decode attention " << context_name(b.context) << ": " << fixed(b.kernel_gb_per_s, 1)
                  << " GB/s (" << fixed(b.kernel_one_thread_gb_per_s, 1) << " on one thread)" << std::endl;
      }
    }
    const double start = now_s();
    std::map<std::string, double> previous_seconds;
    for (const auto context : contexts) {
      for (const auto& mode : modes) {
        Row row;
        row.mode = mode;
        row.context = context;
        const double estimate = 2 * previous_seconds[mode];
        if (s.budget_s > 0 && now_s() - start + estimate > s.budget_s) {
          row.status = "skipped";
          row.reason = "over the time budget (--budget-s " + fixed(s.budget_s, 0) + ")";
        } else {
          generate(m, mode, context, s.new_tokens, base, row, mode == "host" ? static_cast<size_t>(s.profile_ops) : 0);
          previous_seconds[mode] = row.seconds;
        }
        std::cerr << mode << " " << context_name(context) << ": " << row.status
                  << (row.status == "ok"
                          ? ", " + fixed(row.itl_ms, 2) + " ms a token, prefill " + fixed(row.prefill_s, 2) + " s"
                          : ": " + row.reason)
                  << " (" << fixed(row.seconds, 1) << " s)" << std::endl;
        if (!row.profile.empty()) {  // here too, for a run that a timeout cuts before the markdown
          std::cerr << "  a decode step, ms by operation:";
          for (const auto& op : row.profile)
            std::cerr << " " << op.name << " " << fixed(op.ms_per_step, 2) << " (" << fixed(op.calls_per_step, 0)
                      << ")";
          std::cerr << std::endl;
        }
        record(row);
      }
    }
    if (s.multi_request) {
      // A request's cache: its prompt, its new tokens, and the steps it decodes while the others join
      // (at most one a prefill step: generate_many).
      const int64_t per_position = KvCache::bytes_per_position(m.shape, dtype);
      auto requests_in = [&](int64_t bytes) {
        int64_t n = bytes / (per_position * (s.multi_prompt + s.multi_new_tokens));
        const int64_t per_step = std::max<int64_t>(1, s.multi_prefill_tokens / s.multi_prompt);
        n = bytes / (per_position * (s.multi_prompt + s.multi_new_tokens + (n + per_step - 1) / per_step + 1));
        return s.multi_max_requests > 0 ? std::min(n, s.multi_max_requests) : n;
      };
      const int64_t on_host = requests_in(s.host_cache_capacity_bytes);
      const at::Device device(s.device);
      const int64_t on_device =
          device.is_cuda() ? requests_in(free_device_bytes(device) - s.gpu_reserve_bytes) : on_host;
      for (const auto& [mode, requests] : {std::pair<std::string, int64_t>{"host", on_host}, {"gpu", on_device}}) {
        Row row;
        row.mode = "multi-" + mode;
        row.context = s.multi_prompt;
        row.requests = requests;
        if (requests < 1) {
          row.status = "does not fit";
          row.reason = "not one request fits";
        } else {
          generate_many(m, mode, requests, s.multi_prompt, s.multi_new_tokens, s.multi_prefill_tokens, base, row);
        }
        std::cerr << row.mode << " x " << requests << ": " << row.status
                  << (row.status == "ok" ? ", " + fixed(row.tokens_per_s, 1) + " tokens/s" : ": " + row.reason)
                  << std::endl;
        record(row);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "long-context: " << e.what() << std::endl;
    status = 1;
  }
  bench::stop(executor.pid);
  fs::remove(fs::path(s.out) / "executor.pid");

  // The results.
  std::ostringstream md;
  md << "Inter-token latency (ms), batch 1, " << s.new_tokens << " new tokens, " << s.dtype << ", client on "
     << s.device << ", executor on " << s.executor_device << ", " << threads << " CPU threads:\n\n"
     << "| context | gpu | offload | host | offload / host | offload cache read | host cache read |\n"
     << "| --- | --- | --- | --- | --- | --- | --- |\n";
  auto find = [&](const std::string& mode, int64_t context) -> const Row* {
    for (const auto& r : rows) {
      if (r.mode == mode && r.context == context) return &r;
    }
    return nullptr;
  };
  auto cell = [](const Row* r) {
    if (r == nullptr) return std::string("-");
    return r->status == "ok" ? fixed(r->itl_ms, 1) : r->status;
  };
  for (const auto context : parse_contexts(s.contexts)) {
    const auto *offload = find("offload", context), *host = find("host", context);
    const bool both = offload && host && offload->status == "ok" && host->status == "ok";
    md << "| " << context_name(context) << " | " << cell(find("gpu", context)) << " | " << cell(offload) << " | "
       << cell(host) << " | " << (both ? fixed(offload->itl_ms / host->itl_ms, 2) + "x" : "-") << " | "
       << (offload && offload->status == "ok" ? fixed(offload->cache_read_gb_per_s, 1) + " GB/s" : "-") << " | "
       << (host && host->status == "ok" ? fixed(host->cache_read_gb_per_s, 1) + " GB/s" : "-") << " |\n";
  }
  md << "\nNot run or not fitting:\n\n";
  for (const auto& r : rows) {
    if (r.status != "ok")
      md << "- " << r.mode << " " << context_name(r.context) << ": " << r.status << ": " << r.reason << "\n";
  }
  for (const auto& r : rows) {
    if (r.profile.empty()) continue;
    md << "\nA " << r.mode << " decode step at " << context_name(r.context) << " (" << fixed(r.itl_ms, 1)
       << " ms a token), by top-level operation of the stepping thread, nested ones included ([Decode profile]):\n\n"
       << "| operation | calls a step | ms a step |\n| --- | --- | --- |\n";
    for (const auto& op : r.profile) {
      md << "| " << op.name << " | " << fixed(op.calls_per_step, 1) << " | " << fixed(op.ms_per_step, 2) << " |\n";
    }
  }
  if (!bandwidth.empty()) {
    md << "\nCPUs: " << cpus.describe() << "; " << threads << " threads. Host memory: a sum reads "
       << fixed(memory.sum_gb_per_s, 1) << " GB/s (" << fixed(memory.sum_one_thread_gb_per_s, 1)
       << " GB/s on one thread), a copy moves " << fixed(memory.copy_gb_per_s, 1)
       << " GB/s (read + write). One layer's decode attention, one sequence:\n\n"
       << "| context | layer's keys and values | CPU decode attention | of the sum's bandwidth | on one thread | "
          "LibTorch sdpa |\n"
       << "| --- | --- | --- | --- | --- | --- |\n";
    for (const auto& b : bandwidth) {
      md << "| " << context_name(b.context) << " | " << fixed(b.bytes / (1 << 20), 0) << " MiB | "
         << fixed(b.kernel_gb_per_s, 1) << " GB/s | " << fixed(100 * b.kernel_gb_per_s / memory.sum_gb_per_s, 0)
         << "% | " << fixed(b.kernel_one_thread_gb_per_s, 1) << " GB/s | "
         << (b.sdpa_gb_per_s > 0 ? fixed(b.sdpa_gb_per_s, 1) + " GB/s" : std::string("-")) << " |\n";
    }
  }
  bool any_multi = false;
  for (const auto& r : rows) any_multi = any_multi || r.mode.rfind("multi-", 0) == 0;
  if (any_multi) {
    md << "\nRequests of " << s.multi_prompt << " prompt tokens and " << s.multi_new_tokens
       << " new ones (decoding together), all at once (host capacity "
       << fixed(static_cast<double>(s.host_cache_capacity_bytes) / (1LL << 30), 1)
       << " GiB; the GPU's free memory less " << fixed(static_cast<double>(s.gpu_reserve_bytes) / (1LL << 30), 1)
       << " GiB):\n\n| placement | requests held | cache | decode tokens/s | ms a step | prefill s |\n"
       << "| --- | --- | --- | --- | --- | --- |\n";
    for (const auto& r : rows) {
      if (r.mode.rfind("multi-", 0) != 0) continue;
      md << "| " << (r.mode == "multi-host" ? "CPU decode (host cache)" : "GPU client") << " | " << r.requests << " | "
         << fixed(r.cache_gib, 1) << " GiB | "
         << (r.status == "ok" ? fixed(r.tokens_per_s, 1) : r.status + ": " + r.reason) << " | " << fixed(r.itl_ms, 1)
         << " | " << fixed(r.prefill_s, 1) << " |\n";
    }
  }
  std::ofstream(fs::path(s.out) / "long_context.md") << md.str();
  std::cout << md.str() << std::flush;
  for (const auto& r : rows) {
    if (r.status == "failed") status = 1;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"symbiosis-bench-long-context: long-context decode on the GPU, with an offloaded cache, and on the CPU"};
  app.add_option("--model", s.model, "a checkpoint directory");
  app.add_option("--preset", s.preset,
                 "without --model: a symbiosis-make-checkpoint preset written under --out (llama-2-7b)");
  app.add_option("--layers", s.layers, "with --preset: this many layers instead of the preset's");
  app.add_option("--device", s.device, "the client's device: cuda:N (cpu runs every mode on the CPU)")
      ->capture_default_str();
  app.add_option("--executor-device", s.executor_device, "the executor's device")->capture_default_str();
  app.add_option("--dtype", s.dtype, "the model's dtype: bf16, fp16 or fp32 (the cache's too)")->capture_default_str();
  app.add_option("--contexts", s.contexts, "prompt lengths, comma-separated (4K = 4096)")->capture_default_str();
  app.add_option("--modes", s.modes, "gpu, offload, host, comma-separated")->capture_default_str();
  app.add_option("--new-tokens", s.new_tokens, "new tokens a request")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--lora-r", s.lora_r, "a LoRA of this rank on q_proj and v_proj (0: none)")->capture_default_str();
  app.add_option("--threads", s.threads,
                 "CPU threads (0: the CPUs this process may use: its affinity mask, its CFS quota)")
      ->capture_default_str();
  app.add_option("--profile-ops", s.profile_ops,
                 "host rows: the decode step's top operations, this many (0: no profile)")
      ->capture_default_str();
  app.add_option("--host-cache-capacity-bytes", s.host_cache_capacity_bytes,
                 "host memory a cache may take (offload, host and the multi-request point)")
      ->capture_default_str();
  app.add_option("--budget-s", s.budget_s, "skip a run whose estimate passes this many seconds (0: none)")
      ->capture_default_str();
  app.add_option("--attention-bandwidth", s.attention_bandwidth,
                 "measure CPU decode attention against the host's memory bandwidth")
      ->capture_default_str();
  app.add_option("--bandwidth-bytes", s.bandwidth_bytes, "the buffer that measures the host's memory bandwidth")
      ->capture_default_str();
  app.add_option("--multi-request", s.multi_request, "the multi-request point")->capture_default_str();
  app.add_option("--multi-prompt", s.multi_prompt, "its prompt tokens a request")->capture_default_str();
  app.add_option("--multi-new-tokens", s.multi_new_tokens, "its new tokens a request")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--multi-prefill-tokens", s.multi_prefill_tokens, "its prompt tokens prefilled a step")
      ->capture_default_str();
  app.add_option("--multi-max-requests", s.multi_max_requests, "at most this many requests (0: as many as fit)")
      ->capture_default_str();
  app.add_option("--gpu-reserve-bytes", s.gpu_reserve_bytes,
                 "GPU memory left free when counting the GPU client's requests")
      ->capture_default_str();
  app.add_option("--out", s.out, "where the results and logs go")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return run(s);
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-bench-long-context: " << e.what() << std::endl;
    return 1;
  }
}
