// symbiosis-bench-client: one benchmark client process, started by symbiosis-bench. Fine-tunes a
// LoRA adapter (forward, backward, AdamW step per iteration), runs a synthetic inference loop
// (forward only), or generates (--mode generate: each iteration is --batch requests of --seq prompt
// tokens and --new-tokens greedy new tokens through the Generator, its tokens counted as output
// tokens, with each request's time to first token and time per output token), split against an
// executor or monolithic (--monolithic, the baseline), on CPU or a GPU, and writes its
// per-iteration latencies and its measured window as JSON.
//
// [Measurement window] With --ready-file and --go-file, the client warms up, creates the ready
// file and waits for the go file, which holds the window's start and end (epoch seconds) that
// symbiosis-bench wrote once every client was warm; it counts the iterations that end inside the
// window. So all clients, and all systems compared, are measured over the same window after all
// processes are warm. The Python clients follow the same protocol (bench/harness.py). With --stop-file
// instead (capacity runs), it iterates until that file exists.
#include <CLI/CLI.hpp>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <symbiosis/client.h>
#include <symbiosis/inference.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>
#include <symbiosis/training.h>

#include "bench/op_profile.h"
#include "bench/transport_name.h"

using namespace symbiosis;

namespace {

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

size_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

size_t gpu_peak_reserved_bytes(const at::Device& device) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  return 0;
}

// [Op profile] (bench/op_profile.h), per iteration: each operation's count and host milliseconds,
// the largest first.
nlohmann::json op_report(const std::vector<bench::OpProfile::Op>& ops, int iterations, double seconds) {
  nlohmann::json rows = nlohmann::json::array();
  int64_t count = 0;
  for (const auto& op : ops) {
    count += op.count;
    rows.push_back({{"name", op.name},
                    {"per_iteration", double(op.count) / iterations},
                    {"ms_per_iteration", 1e3 * op.seconds / iterations}});
  }
  return {{"iterations", iterations},
          {"iteration_ms", 1e3 * seconds / iterations},
          {"top_level_ops_per_iteration", double(count) / iterations},
          {"ops", rows}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string executor = "tcp://127.0.0.1:5555", model_dir, mode = "finetune", targets = "q_proj,v_proj", out;
  std::string device_name = "cpu", dtype = "fp32", transport = "auto", ready_file, go_file, stop_file;
  int64_t batch = 1, seq = 64, rank = 8, new_tokens = 128;
  double alpha = 16;
  int iterations = 10, warmup = 2, threads = 1;
  uint64_t seed = 0;
  bool monolithic = false, cuda_graph = false, mask = false, mask_effects_here = false, decode_halves = false;
  CLI::App app{"symbiosis-bench-client: one benchmark client"};
  app.add_option("--executor", executor, "executor endpoint");
  app.add_option("--model", model_dir, "checkpoint directory")->required();
  app.add_option("--mode", mode, "finetune, inference (one forward) or generate")
      ->check(CLI::IsMember({"finetune", "inference", "generate"}));
  app.add_option("--new-tokens", new_tokens, "generate: new tokens per request");
  app.add_option("--batch", batch, "sequences per iteration");
  app.add_option("--seq", seq, "tokens per sequence");
  app.add_option("--rank", rank, "LoRA rank");
  app.add_option("--alpha", alpha, "LoRA alpha");
  app.add_option("--targets", targets, "LoRA target modules, comma-separated");
  app.add_option("--iterations", iterations, "timed iterations (without a window)");
  app.add_option("--warmup", warmup, "untimed iterations first");
  app.add_option("--threads", threads, "intra-op threads of this process");
  app.add_option("--seed", seed, "seed");
  app.add_option("--device", device_name, "where this client's model runs: cpu or cuda:N");
  app.add_option("--dtype", dtype, "this client's model dtype: fp32, bf16 or fp16");
  app.add_option("--transport", transport,
                 "auto, tcp, shm, cuda-ipc, cuda-ipc-buffer (copies through the payload buffer) or nccl");
  app.add_option("--ready-file", ready_file, "create this file once warm (see [Measurement window])");
  app.add_option("--go-file", go_file, "wait for this file, then measure the window it names");
  app.add_option("--stop-file", stop_file, "iterate until this file exists (capacity runs)");
  app.add_option("--out", out, "write the results here (JSON)")->required();
  app.add_flag("--monolithic", monolithic, "compute the base layers in-process (the baseline)");
  app.add_flag("--mask", mask, "mask activations and gradients with noise ([Noise masking] in privacy/noise_mask.h)");
  app.add_flag(
      "--mask-effects-here", mask_effects_here,
      "mask, and compute the noise's effects here from --model's weights (the executor never sees a noise row)");
  app.add_flag("--cuda-graph", cuda_graph,
               "on a GPU, capture the fine-tuning step in CUDA graphs after one eager "
               "step and replay it (see [Captured steps] in client_runtime/training/step_graph.h); generate: the "
               "decode steps ([Captured decode] in client_runtime/inference/generator.h)");
  app.add_flag("--decode-halves", decode_halves,
               "generate, split: each decode step's sequences in two halves over two connections, one "
               "computing while the other's calls are at the executor ([Decode halves] in "
               "client_runtime/inference/generator.h)");
  std::string trace;
  int trace_iterations = 3;
  app.add_option("--trace", trace,
                 "write a Chrome trace of --trace-iterations iterations here (LibTorch's Kineto "
                 "profiler: host operations and GPU kernels; bench/trace_summary.py sums the kernels): after "
                 "warm-up, or with --go-file the window's first ones, beside the other clients' (then FILE.done "
                 "is written after it; bench/merge_traces.py merges them, docs/tracing.md)");
  app.add_option("--trace-iterations", trace_iterations, "iterations --trace covers")->capture_default_str();
  int mps_thread_percentage = 0;
  app.add_option("--mps-thread-percentage", mps_thread_percentage,
                 "under MPS, the share of the GPU's SMs this "
                 "process's own kernels may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); 0: all")
      ->check(CLI::Range(0, 100));
  int op_profile = 0;
  app.add_option("--op-profile", op_profile,
                 "after warm-up, profile this many iterations' host time by operation "
                 "(see [Op profile]) into the results");
  CLI11_PARSE(app, argc, argv);
  // [Inference first on the GPU]: under MPS, a fine-tuning tenant's kernels yield to inference's
  // (MPS client priority, read when CUDA starts; one set in the environment wins).
  if (mode == "finetune") ::setenv("CUDA_MPS_CLIENT_PRIORITY", "1", /*overwrite=*/0);
  if (mps_thread_percentage > 0)
    ::setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", std::to_string(mps_thread_percentage).c_str(), 1);
  at::set_num_threads(threads);
  try {
    const at::Device device(device_name);
    auto checkpoint = Checkpoint::open(model_dir);
    std::shared_ptr<Client> client;
    if (!monolithic) {
      ClientOptions options;
      options.endpoint = executor;
      options.tenant = mode + "-b" + std::to_string(batch);
      options.expected_model_hash = checkpoint->model_hash();
      options.device = device_name;
      bench::set_transport(options, transport);
      options.privacy.mask = mask || mask_effects_here;
      if (mask_effects_here) options.privacy.effects_checkpoint = model_dir;
      // (generate: the Generator sets prefill and decode itself)
      options.latency_class = mode == "finetune" ? LatencyClass::kFineTuning
                              : seq > 1          ? LatencyClass::kInferencePrefill
                                                 : LatencyClass::kInferenceDecode;
      client = Client::connect(options);
    }
    auto lm = open_causal_lm(*checkpoint, client, {parse_dtype_name(dtype), device});
    LoraConfig lora;
    lora.r = rank;
    lora.alpha = alpha;
    lora.target_modules.clear();
    std::stringstream ss(targets);
    for (std::string t; std::getline(ss, t, ',');) lora.target_modules.push_back(t);
    at::manual_seed(seed);
    auto params = add_lora(*lm.module, lora);
    FusedAdamW optimizer(params, {.lr = 1e-4});
    const int64_t vocab = static_cast<int64_t>(checkpoint->config_number("vocab_size").value_or(256));
    auto ids = at::randint(0, vocab, {batch, seq}, at::kLong).to(device);

    StepGraph step(
        [&] {
          optimizer.zero_grad();
          causal_lm_loss(lm.forward(ids, {}), ids).backward();
        },
        [&] { optimizer.step(); }, client, device, {.capture = cuda_graph, .warmup = 1});
    std::unique_ptr<Generator> generator;
    if (mode == "generate") {
      // --cuda-graph: decode steps in CUDA graphs ([Captured decode] in inference/generator.h).
      generator = std::make_unique<Generator>(lm, GeneratorOptions{.max_sequences = batch,
                                                                   .max_tokens = seq + new_tokens,
                                                                   .capture_decode = cuda_graph,
                                                                   .decode_halves = decode_halves});
    }
    std::vector<double> first_token_s, per_token_s;  // generate: each request's, over the timed iterations
    // The measured window; generate: the tokens produced inside it, whatever iteration they are of
    // (a tenant may end only a few iterations in a window, so whole iterations count coarsely).
    double start = 0, end = 0;
    int64_t window_tokens = 0;
    bool timing = false;
    auto generate = [&] {
      std::vector<std::vector<double>> times(batch);
      std::string error;  // a failed request fails the benchmark: its tokens must not count
      const double submitted = epoch_seconds();
      for (int64_t r = 0; r < batch; ++r) {
        GenerationRequest request;
        const auto prompt = ids[r].cpu();
        request.prompt_ids.assign(prompt.data_ptr<int64_t>(), prompt.data_ptr<int64_t>() + seq);
        request.sampling.max_new_tokens = new_tokens;
        generator->submit(std::move(request), [&times, &error, r](const TokenEvent& event) {
          if (event.token >= 0) times[r].push_back(epoch_seconds());
          if (event.finished == FinishReason::kError && error.empty()) error = event.error;
        });
      }
      generator->run();
      TORCH_CHECK(error.empty(), "a generation request failed: ", error);
      if (!timing) return;
      for (const auto& t : times) {
        window_tokens += std::count_if(t.begin(), t.end(), [&](double at) { return at >= start && at <= end; });
        first_token_s.push_back(t.front() - submitted);
        if (t.size() > 1) per_token_s.push_back((t.back() - t.front()) / static_cast<double>(t.size() - 1));
      }
    };
    auto iteration = [&] {
      if (mode == "finetune") {
        step.run();
      } else if (mode == "generate") {
        generate();
      } else {
        at::InferenceMode inference;
        lm.forward(ids, {});
      }
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
    };
    for (int i = 0; i < warmup; ++i) iteration();
    // --trace: `iterations` of them traced (in the window, its first, with the other clients').
    auto traced = [&](auto&& iterations) {
      namespace profiler = torch::autograd::profiler;
      using torch::profiler::impl::ActivityType;
      const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
      const std::set<ActivityType> activities = {ActivityType::CPU, ActivityType::CUDA};
      profiler::prepareProfiler(config, activities);
      profiler::enableProfiler(config, activities);
      iterations();
      profiler::disableProfiler()->save(trace);
      std::ofstream(trace + ".done") << "written\n";
    };
    if (!trace.empty() && go_file.empty()) {
      traced([&] {
        for (int i = 0; i < trace_iterations; ++i) iteration();
      });
    }
    nlohmann::json profile;
    if (op_profile > 0) {
      bench::OpProfile recorder(bench::OpProfile::Threads::kAll);
      const double t0 = epoch_seconds();
      for (int i = 0; i < op_profile; ++i) iteration();
      profile = op_report(recorder.ops(), op_profile, epoch_seconds() - t0);
    }

    std::vector<double> latencies;
    timing = true;
    if (!ready_file.empty()) std::ofstream(ready_file) << "warm\n";
    if (!stop_file.empty()) {
      start = epoch_seconds();
      while (!std::filesystem::exists(stop_file)) {
        const double t0 = epoch_seconds();
        iteration();
        latencies.push_back(epoch_seconds() - t0);
      }
      end = epoch_seconds();
    } else if (!go_file.empty()) {
      while (!std::filesystem::exists(go_file)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the writer has finished
      std::ifstream(go_file) >> start >> end;
      if (!trace.empty()) {
        traced([&] {
          for (int i = 0; i < trace_iterations; ++i) iteration();
        });
      }
      while (epoch_seconds() < end) {
        const double t0 = epoch_seconds();
        iteration();
        const double t1 = epoch_seconds();
        if (t1 >= start && t1 <= end) latencies.push_back(t1 - t0);
      }
    } else {
      start = epoch_seconds();
      for (int i = 0; i < iterations; ++i) {
        const double t0 = epoch_seconds();
        iteration();
        latencies.push_back(epoch_seconds() - t0);
      }
      end = epoch_seconds();
    }
    const auto completed = static_cast<int64_t>(latencies.size());
    const int64_t tokens_per_iteration = mode == "generate" ? batch * new_tokens : batch * seq;
    nlohmann::json j = {{"system", monolithic ? "monolithic" : "symbiosis"},
                        {"mode", mode},
                        {"monolithic", monolithic},
                        {"transport", client ? client->transport() : "none"},
                        {"cuda_graph", generator ? generator->captured_batch_sizes() > 0 : step.captured()},
                        {"device", device_name},
                        {"batch", batch},
                        {"seq", seq},
                        {"rank", rank},
                        {"iterations", completed},
                        {"tokens_per_iteration", tokens_per_iteration},
                        {"latencies_s", latencies},
                        {"start_epoch_s", start},
                        {"end_epoch_s", end},
                        {"tokens_per_s", tokens_per_iteration * completed / std::max(end - start, 1e-9)},
                        {"peak_rss_bytes", peak_rss_bytes()},
                        {"gpu_peak_reserved_bytes", gpu_peak_reserved_bytes(device)}};
    if (!profile.is_null()) j["op_profile"] = profile;
    if (mode == "generate") {
      j["new_tokens"] = new_tokens;
      j["tokens_in_window"] = window_tokens;
      for (auto& [name, values] :
           {std::pair{"time_to_first_token", &first_token_s}, {"time_per_output_token", &per_token_s}}) {
        std::sort(values->begin(), values->end());
        auto at = [&](double q) {
          return values->empty() ? 0.0 : (*values)[std::min(values->size() - 1, size_t(q * values->size()))];
        };
        j[std::string(name) + "_p50_s"] = at(0.5);
        j[std::string(name) + "_p99_s"] = at(0.99);
        j[std::string(name) + "_mean_s"] =
            values->empty() ? 0.0 : std::accumulate(values->begin(), values->end(), 0.0) / values->size();
      }
    }
    std::ofstream(out) << j.dump(2) << "\n";
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "symbiosis-bench-client: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
