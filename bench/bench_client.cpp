// symbiosis-bench-client: one benchmark client process, started by symbiosis-bench. Fine-tunes a
// LoRA adapter (forward, backward, AdamW step per iteration) or runs a synthetic inference loop
// (forward only), split against an executor or monolithic (--monolithic, the baseline), and writes
// its per-iteration latencies and its measured window as JSON.
#include <CLI/CLI.hpp>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "client_runtime/causal_lm.h"
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

}  // namespace

int main(int argc, char** argv) {
  std::string executor = "tcp://127.0.0.1:5555", model_dir, mode = "finetune", targets = "q_proj,v_proj", out;
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
  app.add_option("--iterations", iterations, "timed iterations");
  app.add_option("--warmup", warmup, "untimed iterations first");
  app.add_option("--threads", threads, "intra-op threads of this process");
  app.add_option("--seed", seed, "seed");
  app.add_option("--out", out, "write the results here (JSON)")->required();
  app.add_flag("--monolithic", monolithic, "compute the base layers in-process (the baseline)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);
  try {
    auto checkpoint = Checkpoint::open(model_dir);
    std::shared_ptr<Client> client;
    if (!monolithic) {
      ClientOptions options;
      options.endpoint = executor;
      options.tenant = mode + "-b" + std::to_string(batch);
      options.expected_model_hash = checkpoint->model_hash();
      options.latency_class = mode == "finetune" ? LatencyClass::kFineTuning
                              : seq > 1          ? LatencyClass::kInferencePrefill
                                                 : LatencyClass::kInferenceDecode;
      client = Client::connect(options);
    }
    auto lm = open_causal_lm(*checkpoint, client);
    LoraConfig lora;
    lora.r = rank;
    lora.alpha = alpha;
    lora.target_modules.clear();
    std::stringstream ss(targets);
    for (std::string t; std::getline(ss, t, ',');) lora.target_modules.push_back(t);
    at::manual_seed(seed);
    auto params = add_lora(*lm.module, lora);
    torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3));
    const int64_t vocab = static_cast<int64_t>(checkpoint->config_number("vocab_size").value_or(256));
    auto ids = at::randint(0, vocab, {batch, seq}, at::kLong);

    auto iteration = [&] {
      if (mode == "finetune") {
        optimizer.zero_grad();
        auto loss = causal_lm_loss(lm.forward(ids, {}), ids);
        loss.backward();
        optimizer.step();
      } else {
        at::NoGradGuard no_grad;
        lm.forward(ids, {});
      }
    };
    for (int i = 0; i < warmup; ++i) iteration();
    std::vector<double> latencies;
    const double start = epoch_seconds();
    for (int i = 0; i < iterations; ++i) {
      const double t0 = epoch_seconds();
      iteration();
      latencies.push_back(epoch_seconds() - t0);
    }
    const double end = epoch_seconds();
    nlohmann::json j = {{"mode", mode},
                        {"monolithic", monolithic},
                        {"batch", batch},
                        {"seq", seq},
                        {"rank", rank},
                        {"iterations", iterations},
                        {"tokens_per_iteration", batch * seq},
                        {"latencies_s", latencies},
                        {"start_epoch_s", start},
                        {"end_epoch_s", end},
                        {"tokens_per_s", batch * seq * iterations / (end - start)},
                        {"peak_rss_bytes", peak_rss_bytes()}};
    std::ofstream(out) << j.dump(2) << "\n";
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "symbiosis-bench-client: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
