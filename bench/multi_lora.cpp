// symbiosis-bench-multi-lora: [Multi-adapter batches] (client_runtime/peft/lora_bank.h) measured,
// against one executor process that this program starts.
//
// For each count N of --adapters, --requests requests (--prompt random token ids and --new-tokens
// greedy new tokens each, every request exactly that long) are spread round-robin over N LoRA
// adapters (random, rank --rank on --targets, saved as PEFT files under --out) and generated
//  one       by one Generator holding the N adapters (load_adapter), --max-sequences at once: one
//            batch of every adapter's requests, each layer's adapters in one grouped kernel;
//  separate  by N Generators of one adapter each (the adapter their model's own), each over a
//            client of its own (N inference tenants of the executor) with its share of the
//            sequences, all at once in N threads;
// and once, `base`: every request by one Generator of the base model alone (LoRA's cost is `one`
// at N = 1 against it). Each run is repeated after a warm-up run of --warmup-tokens new tokens (so
// that the decode graphs are captured), and gives output tokens/s (every request's new tokens over
// the wall time from the first submission to the last token) and its ratio to `base`.
//
// The executor batches with --batching (its default, opportunistic: the separate tenants' calls are
// batched as they meet). Results: --out/multi_lora.csv and a table on stdout. --device cpu runs it all on the CPU (the code
// paths, not the speed).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <thread>

#include <symbiosis/client.h>
#include <symbiosis/inference.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>

#include "bench/process.h"

using namespace symbiosis;
namespace fs = std::filesystem;

namespace {

struct Settings {
  std::string model, preset = "llama-3.2-1b";
  std::string device = "cuda:0", executor_device = "cuda:0", dtype = "bf16";
  std::vector<int64_t> adapters = {1, 8, 32};
  int64_t requests = 64, prompt = 512, new_tokens = 128, warmup_tokens = 4, rank = 16, max_sequences = 64;
  std::vector<std::string> targets = {"q_proj", "k_proj", "v_proj", "o_proj"};
  std::string batching = "opportunistic";
  std::string out = "multi-lora-bench";
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Requests of `new_tokens` new tokens each, request i naming names[i % N] (none when names is empty).
std::vector<GenerationRequest> make_requests(const Settings& s, int64_t vocab, const std::vector<std::string>& names,
                                             int64_t new_tokens) {
  std::vector<GenerationRequest> requests;
  at::manual_seed(17);
  for (int64_t i = 0; i < s.requests; ++i) {
    GenerationRequest r;
    const auto ids = at::randint(vocab, {s.prompt}, at::kLong);
    r.prompt_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + s.prompt);
    r.sampling.max_new_tokens = new_tokens;
    if (!names.empty()) r.adapter = names[static_cast<size_t>(i) % names.size()];
    requests.push_back(std::move(r));
  }
  return requests;
}

// Runs `generate(new_tokens)` once to warm up (warmup_tokens) and once measured; returns output tokens/s.
double measure(const Settings& s, const std::function<int64_t(int64_t)>& generate) {
  generate(s.warmup_tokens);
  const double t0 = now_s();
  const int64_t tokens = generate(s.new_tokens);
  return static_cast<double>(tokens) / (now_s() - t0);
}

int64_t output_tokens(const std::vector<GenerationResult>& results) {
  int64_t n = 0;
  for (const auto& r : results) n += static_cast<int64_t>(r.output_ids.size());
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"symbiosis-bench-multi-lora: N adapters' requests in one generator against N single-adapter generators"};
  app.add_option("--model", s.model, "a checkpoint directory");
  app.add_option("--preset", s.preset, "without --model: a symbiosis-make-checkpoint preset written under --out")
      ->capture_default_str();
  app.add_option("--device", s.device, "the clients' device")->capture_default_str();
  app.add_option("--executor-device", s.executor_device, "the executor's device")->capture_default_str();
  app.add_option("--dtype", s.dtype, "bf16, fp16 or fp32")->capture_default_str();
  app.add_option("--adapters", s.adapters, "adapter counts N, comma-separated")->delimiter(',')->capture_default_str();
  app.add_option("--requests", s.requests, "requests a run")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--prompt", s.prompt, "prompt tokens a request")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--new-tokens", s.new_tokens, "new tokens a request")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--warmup-tokens", s.warmup_tokens, "new tokens a request in the warm-up run")->capture_default_str();
  app.add_option("--rank", s.rank, "the adapters' rank")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--targets", s.targets, "the adapters' target modules")->delimiter(',')->capture_default_str();
  app.add_option("--max-sequences", s.max_sequences, "sequences decoded at once (all generators together)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batching", s.batching, "the executor's batching policy (its --batching)")->capture_default_str();
  app.add_option("--out", s.out, "where the checkpoint, adapters, logs and results go")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  fs::create_directories(s.out);
  fs::path model = s.model;
  if (model.empty()) {
    model = fs::path(s.out) / ("model-" + s.preset + "-" + s.dtype);
    if (!fs::exists(model / "config.json")) {
      const auto pid = bench::spawn({(bench::build_dir() / "tools/symbiosis-make-checkpoint").string(), "--preset",
                                     s.preset, "--dtype", s.dtype, "--out", model.string()},
                                    fs::path(s.out) / "make-checkpoint.out", fs::path(s.out) / "make-checkpoint.err");
      TORCH_CHECK(bench::wait_ok(pid), "symbiosis-make-checkpoint failed: ",
                  bench::read_file(fs::path(s.out) / "make-checkpoint.err"));
    }
  }
  const auto dtype = parse_dtype_name(s.dtype);
  const auto executor = bench::start_executor({"--model", model.string(), "--listen", "tcp://127.0.0.1:*", "--device",
                                               s.executor_device, "--dtype", s.dtype, "--log-level", "warn",
                                               "--batching", s.batching},
                                              fs::path(s.out) / "executor", 900);
  int status = 0;
  try {
    const auto checkpoint = Checkpoint::open(model);
    int tenants = 0;
    auto open = [&] {
      ClientOptions options;
      options.endpoint = executor.endpoint;
      options.expected_model_hash = checkpoint->model_hash();
      options.device = s.device;
      options.tenant = "multi-lora-" + std::to_string(tenants++);
      return open_causal_lm(*checkpoint, Client::connect(options), {dtype, at::Device(s.device)});
    };
    // The adapters, random (B drawn, so that they change what the model computes).
    const int64_t most = *std::max_element(s.adapters.begin(), s.adapters.end());
    std::vector<fs::path> dirs;
    {
      auto lm = open_causal_lm(*checkpoint, nullptr, {at::kFloat, at::kCPU});
      LoraConfig config;
      config.r = s.rank;
      config.alpha = 2.0 * static_cast<double>(s.rank);
      config.target_modules = s.targets;
      config.init_b_zero = false;
      add_lora(*lm.module, config);
      for (int64_t i = 0; i < most; ++i) {
        at::manual_seed(1000 + i);
        for (auto& [name, t] : lora_state(*lm.module)) {
          at::NoGradGuard no_grad;
          t.normal_(0.0, name.find("lora_A") != std::string::npos ? 0.02 : 0.01);
        }
        dirs.push_back(fs::path(s.out) / "adapters" / std::to_string(i));
        save_lora(*lm.module, config, dirs.back());
      }
    }
    auto lm = open();
    const int64_t vocab = cached_model(*lm.module).token_embeddings().size(0);
    GeneratorOptions options;
    options.max_sequences = s.max_sequences;
    options.max_tokens = s.prompt + s.new_tokens;
    options.max_loras = most;
    options.max_lora_rank = s.rank;
    std::ofstream csv(fs::path(s.out) / "multi_lora.csv");
    csv << "mode,adapters,requests,prompt,new_tokens,output_tokens_per_s,of_base\n";
    double base = 0;
    auto report = [&](const std::string& mode, int64_t n, double rate) {
      if (mode == "base") base = rate;
      csv << mode << "," << n << "," << s.requests << "," << s.prompt << "," << s.new_tokens << "," << rate << ","
          << rate / base << std::endl;
      std::cout << std::left << std::setw(10) << mode << std::right << std::setw(4) << n << " adapters  " << std::fixed
                << std::setprecision(1) << std::setw(10) << rate << " output tokens/s  " << std::setprecision(3)
                << rate / base << " x base" << std::endl;
    };
    {
      Generator generator(lm, options);
      report("base", 0, measure(s, [&](int64_t tokens) {
               return output_tokens(generator.generate(make_requests(s, vocab, {}, tokens)));
             }));
    }
    for (const int64_t n : s.adapters) {
      std::vector<std::string> names;
      for (int64_t i = 0; i < n; ++i) names.push_back("adapter-" + std::to_string(i));
      {
        Generator generator(lm, options);
        for (int64_t i = 0; i < n; ++i) generator.load_adapter(names[i], dirs[i]);
        report("one", n, measure(s, [&](int64_t tokens) {
                 return output_tokens(generator.generate(make_requests(s, vocab, names, tokens)));
               }));
      }
      // N tenants of one adapter each, their share of the requests and of the sequences.
      std::vector<CausalLM> lms;
      std::vector<std::unique_ptr<Generator>> generators;
      auto own = options;
      own.max_sequences = (s.max_sequences + n - 1) / n;
      own.max_loras = 0;
      for (int64_t i = 0; i < n; ++i) {
        lms.push_back(open());
        load_peft_adapter(*lms.back().module, dirs[i]);
        generators.push_back(std::make_unique<Generator>(lms.back(), own));
      }
      report("separate", n, measure(s, [&](int64_t tokens) {
               const auto all = make_requests(s, vocab, names, tokens);
               std::vector<int64_t> produced(static_cast<size_t>(n), 0);
               std::vector<std::thread> threads;
               for (int64_t i = 0; i < n; ++i) {
                 threads.emplace_back([&, i] {
                   std::vector<GenerationRequest> mine;
                   for (const auto& r : all) {
                     if (r.adapter != names[i]) continue;
                     mine.push_back(r);
                     mine.back().adapter.clear();
                   }
                   produced[i] = output_tokens(generators[i]->generate(mine));
                 });
               }
               for (auto& t : threads) t.join();
               int64_t total = 0;
               for (const auto p : produced) total += p;
               return total;
             }));
    }
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-bench-multi-lora: " << e.what() << std::endl;
    status = 1;
  }
  bench::stop(executor.pid);
  return status;
}
