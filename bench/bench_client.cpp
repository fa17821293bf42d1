// symbiosis-bench-client: one benchmark client process, started by symbiosis-bench. Fine-tunes a
// LoRA adapter (forward, backward, AdamW step per iteration) or runs a synthetic inference loop
// (forward only), split against an executor or monolithic (--monolithic, the baseline), on CPU or
// a GPU, and writes its per-iteration latencies and its measured window as JSON.
//
// [Measurement window] With --ready-file and --go-file, the client warms up, creates the ready
// file and waits for the go file, which holds the window's start and end (epoch seconds) that
// symbiosis-bench wrote once every client was warm; it counts the iterations that end inside the
// window. So all clients, and all systems compared, are measured over the same window after all
// processes are warm. bench/hf_peft_client.py follows the same protocol. With --stop-file
// instead (capacity runs), it iterates until that file exists.
#include <CLI/CLI.hpp>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "client_runtime/causal_lm.h"
#include "client_runtime/fused_adamw.h"
#include "client_runtime/lora.h"
#include "client_runtime/training.h"

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

}  // namespace

int main(int argc, char** argv) {
  std::string executor = "tcp://127.0.0.1:5555", model_dir, mode = "finetune", targets = "q_proj,v_proj", out;
  std::string device_name = "cpu", dtype = "fp32", transport = "auto", ready_file, go_file, stop_file;
  int64_t batch = 1, seq = 64, rank = 8;
  double alpha = 16;
  int iterations = 10, warmup = 2, threads = 1;
  uint64_t seed = 0;
  bool monolithic = false;
  CLI::App app{"symbiosis-bench-client: one benchmark client"};
  app.add_option("--executor", executor, "executor endpoint");
  app.add_option("--model", model_dir, "checkpoint directory")->required();
  app.add_option("--mode", mode, "finetune or inference")->check(CLI::IsMember({"finetune", "inference"}));
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
  app.add_option("--transport", transport, "auto, tcp, shm, cuda-ipc or nccl");
  app.add_option("--ready-file", ready_file, "create this file once warm (see [Measurement window])");
  app.add_option("--go-file", go_file, "wait for this file, then measure the window it names");
  app.add_option("--stop-file", stop_file, "iterate until this file exists (capacity runs)");
  app.add_option("--out", out, "write the results here (JSON)")->required();
  app.add_flag("--monolithic", monolithic, "compute the base layers in-process (the baseline)");
  CLI11_PARSE(app, argc, argv);
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
      options.transport = transport;
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

    auto iteration = [&] {
      if (mode == "finetune") {
        optimizer.zero_grad();
        auto loss = causal_lm_loss(lm.forward(ids, {}), ids);
        loss.backward();
        optimizer.step();
      } else {
        at::InferenceMode inference;
        lm.forward(ids, {});
      }
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
    };
    for (int i = 0; i < warmup; ++i) iteration();

    std::vector<double> latencies;
    double start = 0, end = 0;
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
    nlohmann::json j = {{"system", monolithic ? "monolithic" : "symbiosis"},
                        {"mode", mode},
                        {"monolithic", monolithic},
                        {"transport", client ? client->transport() : "none"},
                        {"device", device_name},
                        {"batch", batch},
                        {"seq", seq},
                        {"rank", rank},
                        {"iterations", completed},
                        {"tokens_per_iteration", batch * seq},
                        {"latencies_s", latencies},
                        {"start_epoch_s", start},
                        {"end_epoch_s", end},
                        {"tokens_per_s", batch * seq * completed / std::max(end - start, 1e-9)},
                        {"peak_rss_bytes", peak_rss_bytes()},
                        {"gpu_peak_reserved_bytes", gpu_peak_reserved_bytes(device)}};
    std::ofstream(out) << j.dump(2) << "\n";
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "symbiosis-bench-client: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
