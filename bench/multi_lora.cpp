// symbiosis-bench-multi-lora: [Multi-adapter batches] (client_runtime/peft/lora_bank.h) measured,
// against one executor process that this program starts.
//
// For each count N of --adapters, --requests requests (--prompt random token ids and --new-tokens
// greedy new tokens each, every request exactly that long; with --mixed-lengths SEED, each request's
// prompt and new tokens drawn, seeded, from 1/8 of those to all of them) are spread round-robin over N LoRA
// adapters (random, rank --rank on --targets, saved as PEFT files under --out) and generated
//  one       by one Generator holding the N adapters (load_adapter), --max-sequences at once: one
//            batch of every adapter's requests, each layer's adapters in one grouped kernel;
//  separate  by N Generators of one adapter each (the adapter their model's own), each over a
//            client of its own (N inference tenants of the executor) with its share of the
//            sequences, all at once in N threads;
//  monolithic by one Generator of a model whose base layers are its own (no executor) holding the
//            N adapters: what the split costs with the same bank;
//  transformers+peft (with --python) transformers + PEFT's mixed-adapter generate, one batch;
// and once, `bound`: one monolithic process decoding every request with one adapter (the bound no
// multi-process system passes), and `base`: every request by one split Generator of the base
// model alone (LoRA's cost is `one` at N = 1 against it). Each run is repeated after a warm-up run
// of --warmup-tokens new tokens (so that the decode graphs are captured; with --mixed-lengths the warm-up
// is the measured workload itself, whose batch shrinks through every size), and gives output tokens/s
// (every request's new tokens over the wall time from the first submission to the last token), the
// time per output token after each request's first (p50 and p99 over the requests) and the ratios
// to `base` and `bound`. With --finetune-tenants K, `one` of --beside-adapters adapters is measured
// again beside K fine-tuning tenants training on the same executor (and they alone for as long).
//
// The executor batches with --batching (its default, opportunistic: the separate tenants' calls are
// batched as they meet), and takes any other flag of its in --executor-flags. Results:
// --out/multi_lora.csv and a table on stdout. --device cpu runs it all on the CPU (the code paths,
// not the speed).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
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
  std::string device = "cuda:0", executor_device, dtype = "bf16";  // executor_device: --device's by default
  std::vector<int64_t> adapters = {1, 8, 32};
  int64_t requests = 64, prompt = 512, new_tokens = 128, warmup_tokens = 4, rank = 16, max_sequences = 64;
  std::vector<std::string> targets = {"q_proj", "k_proj", "v_proj", "o_proj"};
  std::string batching = "opportunistic";
  std::string executor_flags;  // more of the executor's flags, split at spaces
  std::string out = "multi-lora-bench";
  std::string python, hf_peft_script = "bench/hf_peft_client.py";  // the transformers + PEFT baseline
  int64_t finetune_tenants = 0, beside_adapters = 8;
  int64_t mixed_lengths = -1;  // the seed of the lengths' mix; -1: every request --prompt + --new-tokens
  bool decode_halves = false;  // the split generators' ([Decode halves])
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Requests of `new_tokens` new tokens each (with --mixed-lengths, a seeded draw of 1/8 of them to
// all, and of --prompt's prompt tokens likewise), request i naming names[i % N] (none when names is
// empty).
std::vector<GenerationRequest> make_requests(const Settings& s, int64_t vocab, const std::vector<std::string>& names,
                                             int64_t new_tokens) {
  std::vector<GenerationRequest> requests;
  at::manual_seed(17);
  std::mt19937_64 lengths(static_cast<uint64_t>(s.mixed_lengths));
  auto length = [&](int64_t most) {
    if (s.mixed_lengths < 0) return most;
    return std::uniform_int_distribution<int64_t>(std::max<int64_t>(1, most / 8), most)(lengths);
  };
  for (int64_t i = 0; i < s.requests; ++i) {
    GenerationRequest r;
    const int64_t prompt = length(s.prompt);
    const auto ids = at::randint(vocab, {prompt}, at::kLong);
    r.prompt_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + prompt);
    r.sampling.max_new_tokens = length(new_tokens);
    if (!names.empty()) r.adapter = names[static_cast<size_t>(i) % names.size()];
    requests.push_back(std::move(r));
  }
  return requests;
}

// Each request's token times (seconds, steady clock), in the order of the requests.
using TokenTimes = std::vector<std::vector<double>>;

// Submits `requests` to `generator` with callbacks that note each token's time, and runs it.
TokenTimes run_timed(Generator& generator, const std::vector<GenerationRequest>& requests) {
  TokenTimes times(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    generator.submit(requests[i], [&times, i](const TokenEvent& event) {
      if (event.token >= 0) times[i].push_back(now_s());
    });
  }
  generator.run();
  return times;
}

struct Figures {
  double tokens_per_s = 0;                  // every request's new tokens over the wall time from the first submission
  double tpot_p50_ms = 0, tpot_p99_ms = 0;  // time per output token after the first, over requests
};

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(q * static_cast<double>(values.size() - 1) + 0.5)];
}

// Runs `generate(new_tokens)` once to warm up (warmup_tokens; the measured workload with
// --mixed-lengths) and once measured.
Figures measure(const Settings& s, const std::function<TokenTimes(int64_t)>& generate) {
  generate(s.mixed_lengths < 0 ? s.warmup_tokens : s.new_tokens);
  const double t0 = now_s();
  const auto times = generate(s.new_tokens);
  double last = t0;
  int64_t tokens = 0;
  std::vector<double> tpot;
  for (const auto& t : times) {
    tokens += static_cast<int64_t>(t.size());
    if (t.empty()) continue;
    last = std::max(last, t.back());
    if (t.size() > 1) tpot.push_back(1e3 * (t.back() - t.front()) / static_cast<double>(t.size() - 1));
  }
  return {static_cast<double>(tokens) / (last - t0), percentile(tpot, 0.5), percentile(tpot, 0.99)};
}

// --targets as the benchmark clients take it: comma-separated.
std::string targets_flag(const Settings& s) {
  std::string joined;
  for (const auto& t : s.targets) joined += (joined.empty() ? "" : ",") + t;
  return joined;
}

// transformers + PEFT's mixed-adapter `generate` (bench/hf_peft_client.py --mode generate: one batch
// of every request, rows over n adapters by PEFT's adapter_names), once warm. It gives no token
// times: its TPOT is the batch's time over the new tokens (prefill included).
Figures hf_peft(const Settings& s, const fs::path& model, int64_t n) {
  const auto out = fs::path(s.out) / ("hf-peft-" + std::to_string(n));
  const auto pid = bench::spawn({s.python,       s.hf_peft_script,
                                 "--model",      model.string(),
                                 "--mode",       "generate",
                                 "--adapters",   std::to_string(n),
                                 "--batch",      std::to_string(s.requests),
                                 "--seq",        std::to_string(s.prompt),
                                 "--new-tokens", std::to_string(s.new_tokens),
                                 "--rank",       std::to_string(s.rank),
                                 "--alpha",      std::to_string(2 * s.rank),
                                 "--targets",    targets_flag(s),
                                 "--iterations", "1",
                                 "--warmup",     "1",
                                 "--device",     s.device,
                                 "--dtype",      s.dtype,
                                 "--out",        out.string() + ".json"},
                                out.string() + ".out", out.string() + ".err");
  TORCH_CHECK(bench::wait_ok(pid), s.hf_peft_script, " failed: ", bench::read_file(out.string() + ".err"));
  const auto j = nlohmann::json::parse(bench::read_file(out.string() + ".json"));
  const double per_token_ms = 1e3 * j["latencies_s"][0].get<double>() / static_cast<double>(s.new_tokens);
  return {j["tokens_per_s"].get<double>(), per_token_ms, per_token_ms};
}

// --finetune-tenants fine-tuning tenants (symbiosis-bench-client --mode finetune, 2 x 512 tokens a
// step, LoRA r8 on --targets, captured steps) training on the executor while `during` runs, from
// when they are all warm; returns their tokens/s together.
double finetuning(const Settings& s, const std::string& endpoint, const fs::path& model, const std::string& tag,
                  const std::function<void()>& during) {
  const auto dir = fs::path(s.out) / ("finetune-" + tag);
  fs::remove_all(dir);  // an earlier run's stop file in the same --out would stop the tenants at once
  fs::create_directories(dir);
  std::vector<pid_t> pids;
  for (int64_t i = 0; i < s.finetune_tenants; ++i) {
    const auto me = dir / std::to_string(i);
    pids.push_back(bench::spawn({(bench::build_dir() / "bench/symbiosis-bench-client").string(),
                                 "--executor",
                                 endpoint,
                                 "--model",
                                 model.string(),
                                 "--mode",
                                 "finetune",
                                 "--batch",
                                 "2",
                                 "--seq",
                                 "512",
                                 "--rank",
                                 "8",
                                 "--targets",
                                 targets_flag(s),
                                 "--device",
                                 s.device,
                                 "--dtype",
                                 s.dtype,
                                 "--cuda-graph",
                                 "--warmup",
                                 "3",
                                 "--ready-file",
                                 me.string() + ".ready",
                                 "--stop-file",
                                 (dir / "stop").string(),
                                 "--out",
                                 me.string() + ".json"},
                                me.string() + ".out", me.string() + ".err"));
  }
  for (int64_t i = 0; i < s.finetune_tenants; ++i) {
    const auto me = dir / std::to_string(i);
    while (!fs::exists(me.string() + ".ready")) {
      TORCH_CHECK(!bench::exited(pids[i]), "fine-tuning tenant ", i,
                  " failed: ", bench::read_file(me.string() + ".err"));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  during();
  std::ofstream(dir / "stop") << "stop\n";
  double tokens_per_s = 0;
  for (int64_t i = 0; i < s.finetune_tenants; ++i) {
    const auto me = dir / std::to_string(i);
    TORCH_CHECK(bench::wait_ok(pids[i]), "fine-tuning tenant ", i, " failed: ", bench::read_file(me.string() + ".err"));
    const auto result = nlohmann::json::parse(bench::read_file(me.string() + ".json"));
    TORCH_CHECK(result["iterations"].get<int64_t>() > 0, "fine-tuning tenant ", i, " finished no step in the run ", tag,
                ": no figure of it, nor of what ran beside it, would mean anything");
    tokens_per_s += result["tokens_per_s"].get<double>();
  }
  return tokens_per_s;
}

}  // namespace

int main(int argc, char** argv) {
  // [Hardware queues] (client_runtime/training/step_graph.cpp): `separate` runs N generators in
  // threads of this process, each step waiting on the GPU for the executor. For this process alone:
  // under MPS every process's queues come from one pool, and with 32 for the fine-tuning tenants too
  // the pool ran out (their first cudaEventCreate failed, "out of memory").
  bench::set_for_this_process("CUDA_DEVICE_MAX_CONNECTIONS", "32");
  Settings s;
  CLI::App app{"symbiosis-bench-multi-lora: N adapters' requests in one generator against N single-adapter generators"};
  app.add_option("--model", s.model, "a checkpoint directory");
  app.add_option("--preset", s.preset, "without --model: a symbiosis-make-checkpoint preset written under --out")
      ->capture_default_str();
  app.add_option("--device", s.device, "the clients' device")->capture_default_str();
  app.add_option("--executor-device", s.executor_device, "the executor's device (default: --device's)");
  app.add_option("--dtype", s.dtype, "bf16, fp16 or fp32")->capture_default_str();
  app.add_option("--adapters", s.adapters, "adapter counts N, comma-separated")->delimiter(',')->capture_default_str();
  app.add_option("--requests", s.requests, "requests a run")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--prompt", s.prompt, "prompt tokens a request")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--new-tokens", s.new_tokens, "new tokens a request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup-tokens", s.warmup_tokens, "new tokens a request in the warm-up run")->capture_default_str();
  app.add_option("--rank", s.rank, "the adapters' rank")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--targets", s.targets, "the adapters' target modules")->delimiter(',')->capture_default_str();
  app.add_option("--max-sequences", s.max_sequences, "sequences decoded at once (all generators together)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batching", s.batching, "the executor's batching policy (its --batching)")->capture_default_str();
  app.add_option("--executor-flags", s.executor_flags,
                 "more of the executor's flags, in one argument (e.g. '--finetune-sm-percent 25')");
  app.add_option("--python", s.python, "with it, also transformers + PEFT's mixed-adapter generate, run by this python")
      ->capture_default_str();
  app.add_option("--hf-peft-script", s.hf_peft_script, "the baseline's script")->capture_default_str();
  app.add_option("--finetune-tenants", s.finetune_tenants,
                 "with it, `one` of --beside-adapters adapters measured also beside this many fine-tuning tenants")
      ->capture_default_str();
  app.add_option("--beside-adapters", s.beside_adapters, "the adapters of the run beside fine-tuning")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--mixed-lengths", s.mixed_lengths,
                 "a seed: each request's prompt and new tokens drawn from 1/8 of --prompt and --new-tokens to all of "
                 "them (without it, every request is that long); transformers + PEFT is left out")
      ->capture_default_str();
  app.add_flag("--decode-halves", s.decode_halves,
               "the split generators' decode steps in two halves over two connections ([Decode halves] in "
               "client_runtime/inference/generator.h)");
  app.add_option("--out", s.out, "where the checkpoint, adapters, logs and results go")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (s.executor_device.empty()) s.executor_device = s.device;
  fs::create_directories(s.out);
  fs::path model = s.model;
  if (model.empty()) {
    model = fs::path(s.out) / ("model-" + s.preset + "-" + s.dtype);
    if (!fs::exists(model / "config.json")) {
      const auto pid = bench::spawn({(bench::build_dir() / "tools/symbiosis-make-checkpoint").string(), "--preset",
                                     s.preset, "--dtype", s.dtype, "--out", model.string()},
                                    fs::path(s.out) / "make-checkpoint.out", fs::path(s.out) / "make-checkpoint.err");
      TORCH_CHECK(bench::wait_ok(pid),
                  "symbiosis-make-checkpoint failed: ", bench::read_file(fs::path(s.out) / "make-checkpoint.err"));
    }
  }
  const auto dtype = parse_dtype_name(s.dtype);
  std::vector<std::string> executor_args = {
      "--model", model.string(), "--listen", "tcp://127.0.0.1:*", "--device", s.executor_device, "--dtype",
      s.dtype,   "--log-level",  "warn",     "--batching",        s.batching};
  std::istringstream more(s.executor_flags);
  for (std::string flag; more >> flag;) executor_args.push_back(flag);
  const auto executor = bench::start_executor(executor_args, fs::path(s.out) / "executor", 900);
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
    auto split = options;  // the split generators'
    split.decode_halves = s.decode_halves;
    std::ofstream csv(fs::path(s.out) / "multi_lora.csv");
    csv << "mode,adapters,requests,prompt,new_tokens,output_tokens_per_s,tpot_p50_ms,tpot_p99_ms,of_base,of_bound\n";
    double base = 0, bound = 0;
    // The lengths in the table: "mix<seed>:" before the longest with --mixed-lengths.
    const std::string mix = s.mixed_lengths < 0 ? "" : "mix" + std::to_string(s.mixed_lengths) + ":";
    auto report = [&](const std::string& mode, int64_t n, const Figures& f) {
      csv << mode << "," << n << "," << s.requests << "," << mix << s.prompt << "," << mix << s.new_tokens << ","
          << f.tokens_per_s << "," << f.tpot_p50_ms << "," << f.tpot_p99_ms << "," << f.tokens_per_s / base << ","
          << f.tokens_per_s / bound << std::endl;
      std::cout << std::left << std::setw(22) << mode << std::right << std::setw(4) << n << " adapters  " << std::fixed
                << std::setprecision(1) << std::setw(10) << f.tokens_per_s << " output tokens/s  TPOT p50 "
                << std::setprecision(2) << f.tpot_p50_ms << " ms, p99 " << f.tpot_p99_ms << " ms  "
                << std::setprecision(3) << f.tokens_per_s / base << " x base  " << f.tokens_per_s / bound << " x bound"
                << std::endl;
    };
    // Every request through `generator`, naming names[i % N].
    auto through = [&](Generator& generator, const std::vector<std::string>& names) {
      return [&, names](int64_t tokens) { return run_timed(generator, make_requests(s, vocab, names, tokens)); };
    };
    // The bound: one monolithic process (the base layers its own) decoding every request with one adapter.
    {
      auto local = open_causal_lm(*checkpoint, nullptr, {dtype, at::Device(s.device)});
      load_peft_adapter(*local.module, dirs[0]);
      auto own = options;
      own.max_loras = 0;
      Generator generator(local, own);
      const auto f = measure(s, through(generator, {}));
      base = bound = f.tokens_per_s;
      report("bound", 1, f);
    }
    {
      Generator generator(lm, split);
      const auto f = measure(s, through(generator, {}));
      base = f.tokens_per_s;
      report("base", 0, f);
    }
    for (const int64_t n : s.adapters) {
      std::vector<std::string> names;
      for (int64_t i = 0; i < n; ++i) names.push_back("adapter-" + std::to_string(i));
      {
        Generator generator(lm, split);
        for (int64_t i = 0; i < n; ++i) generator.load_adapter(names[i], dirs[i]);
        report("one", n, measure(s, through(generator, names)));
      }
      {
        auto local = open_causal_lm(*checkpoint, nullptr, {dtype, at::Device(s.device)});
        Generator generator(local, options);
        for (int64_t i = 0; i < n; ++i) generator.load_adapter(names[i], dirs[i]);
        report("monolithic", n, measure(s, through(generator, names)));
      }
      // N tenants of one adapter each, their share of the requests and of the sequences.
      std::vector<CausalLM> lms;
      std::vector<std::unique_ptr<Generator>> generators;
      auto own = split;
      own.max_sequences = (s.max_sequences + n - 1) / n;
      own.max_loras = 0;
      for (int64_t i = 0; i < n; ++i) {
        lms.push_back(open());
        load_peft_adapter(*lms.back().module, dirs[i]);
        generators.push_back(std::make_unique<Generator>(lms.back(), own));
      }
      report("separate", n, measure(s, [&](int64_t tokens) {
               const auto all = make_requests(s, vocab, names, tokens);
               std::vector<TokenTimes> each(static_cast<size_t>(n));
               std::vector<std::thread> threads;
               for (int64_t i = 0; i < n; ++i) {
                 threads.emplace_back([&, i] {
                   std::vector<GenerationRequest> mine;
                   for (const auto& r : all) {
                     if (r.adapter != names[i]) continue;
                     mine.push_back(r);
                     mine.back().adapter.clear();
                   }
                   each[i] = run_timed(*generators[i], mine);
                 });
               }
               for (auto& t : threads) t.join();
               TokenTimes times;
               for (auto& e : each) times.insert(times.end(), e.begin(), e.end());
               return times;
             }));
      generators.clear();
      lms.clear();
      if (!s.python.empty() && s.mixed_lengths < 0) report("transformers+peft", n, hf_peft(s, model, n));
    }
    // The server's decode beside fine-tuning: `one` of beside_adapters adapters alone, then with the
    // fine-tuning tenants training; and they alone for as long.
    if (s.finetune_tenants > 0) {
      const int64_t n = std::min(s.beside_adapters, most);
      std::vector<std::string> names;
      for (int64_t i = 0; i < n; ++i) names.push_back("adapter-" + std::to_string(i));
      Generator generator(lm, split);
      for (int64_t i = 0; i < n; ++i) generator.load_adapter(names[i], dirs[i]);
      const auto alone = measure(s, through(generator, names));
      report("one alone", n, alone);
      Figures beside;
      double seconds = 0;
      const double finetune_beside = finetuning(s, executor.endpoint, model, "beside", [&] {
        const double t0 = now_s();
        beside = measure(s, through(generator, names));
        seconds = now_s() - t0;
      });
      report("one beside fine-tuning", n, beside);
      const double finetune_alone = finetuning(s, executor.endpoint, model, "alone", [&] {
        std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      });
      csv << "finetune alone," << s.finetune_tenants << ",,,," << finetune_alone << ",,,,\n"
          << "finetune beside," << s.finetune_tenants << ",,,," << finetune_beside << ",,,," << std::endl;
      std::cout << "beside " << s.finetune_tenants << " fine-tuning tenants: TPOT p50 " << std::setprecision(3)
                << beside.tpot_p50_ms / alone.tpot_p50_ms << "x alone, p99 " << beside.tpot_p99_ms / alone.tpot_p99_ms
                << "x; fine-tuning " << finetune_beside << " tokens/s, " << finetune_beside / finetune_alone
                << " of alone (" << finetune_alone << ")" << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-bench-multi-lora: " << e.what() << std::endl;
    status = 1;
  }
  bench::stop(executor.pid);
  return status;
}
