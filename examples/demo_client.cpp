// symbiosis-demo-client: one tenant fine-tuning its own LoRA adapter against a shared executor.
// It loads the checkpoint's non-base weights, virtualizes the model, attaches LoRA and takes
// AdamW steps on a fixed synthetic batch, printing the loss as it falls. With --verify it then
// repeats the run monolithically (base layers in-process) and exits 1 unless both agree.
#include <CLI/CLI.hpp>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>
#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>

#include <symbiosis/client.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>
#include <symbiosis/training.h>

#include "examples/tenant_flags.h"

using namespace symbiosis;

namespace {

struct Settings {
  examples::TenantFlags connection{.tenant = "demo"};
  std::string model;
  int64_t rank = 8;
  double alpha = 16;
  std::string targets = "q_proj,v_proj";
  int steps = 20;
  double lr = 1e-2;
  int64_t batch = 2;
  int64_t seq = 32;
  uint64_t seed = 0;
  bool verify = false;
  bool quiet = false;
  std::string save;
  int threads = 1;
  std::string transport = "auto";
  std::string control = "auto";
  std::string device = "cpu";
  std::string dtype = "fp32";
  double tolerance = 1e-5;
  double adapter_tolerance = -1;  // < 0: tolerance
  bool buffer_copies = false;
  bool empty_cache = false;
  bool cuda_graph = false;
};

struct Result {
  std::vector<double> losses;
  std::vector<at::Tensor> adapter;
};

Result train(const Settings& s, const Checkpoint& checkpoint, const std::shared_ptr<Client>& client) {
  const at::Device device = examples::require_device(s.device);
  auto lm = open_causal_lm(checkpoint, client, {parse_dtype_name(s.dtype), device});
  LoraConfig lora;
  lora.r = s.rank;
  lora.alpha = s.alpha;
  lora.target_modules.clear();
  std::stringstream targets(s.targets);
  for (std::string t; std::getline(targets, t, ',');) lora.target_modules.push_back(t);
  at::manual_seed(s.seed);
  Result result;
  result.adapter = add_lora(*lm.module, lora);
  // A captured step keeps the optimizer's step count on the GPU (FusedAdamW): torch::optim::AdamW
  // computes its bias correction on the host, which a graph would freeze. Both runs of --verify
  // use the same optimizer.
  std::unique_ptr<torch::optim::AdamW> adamw;
  std::unique_ptr<FusedAdamW> fused;
  if (s.cuda_graph) {
    fused = std::make_unique<FusedAdamW>(result.adapter, FusedAdamWOptions{.lr = s.lr});
  } else {
    adamw = std::make_unique<torch::optim::AdamW>(result.adapter, torch::optim::AdamWOptions(s.lr));
  }
  const int64_t vocab = static_cast<int64_t>(checkpoint.config_number("vocab_size").value_or(256));
  auto ids = at::randint(0, vocab, {s.batch, s.seq}, at::kLong).to(device);
  at::Tensor loss;
  // The step settles between the two parts: a failed base-layer call must not update the adapter.
  StepGraph training_step(
      [&] {
        fused ? fused->zero_grad() : adamw->zero_grad();
        loss = causal_lm_loss(lm.forward(ids, {}), ids);
        loss.backward();
      },
      [&] { fused ? fused->step() : static_cast<void>(adamw->step()); }, client, device,
      {.capture = s.cuda_graph && client != nullptr, .warmup = 1});
  for (int step = 0; step < s.steps; ++step) {
    training_step.run();
    result.losses.push_back(loss.item<double>());
#ifdef SYMBIOSIS_WITH_CUDA
    if (s.empty_cache && device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    if (!s.quiet) {
      std::printf("[%s] step %3d  loss %.4f\n", s.connection.tenant.c_str(), step, result.losses.back());
      std::fflush(stdout);
    }
  }
  if (!s.save.empty() && client) save_lora(*lm.module, lora, s.save);
  return result;
}

double relative_error(const at::Tensor& a, const at::Tensor& b) {
  auto diff = (a.detach().to(at::kDouble) - b.detach().to(at::kDouble)).abs().max().item<double>();
  auto scale = b.detach().abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"symbiosis-demo-client: fine-tune a LoRA adapter against a shared base executor"};
  examples::add_tenant_flags(app, s.connection, /*monolithic_flag=*/false);
  app.add_option("--model", s.model, "the checkpoint directory the executor serves")->required();
  app.add_option("--rank", s.rank, "LoRA rank")->capture_default_str();
  app.add_option("--alpha", s.alpha, "LoRA alpha")->capture_default_str();
  app.add_option("--targets", s.targets, "comma-separated target modules")->capture_default_str();
  app.add_option("--steps", s.steps, "AdamW steps")->capture_default_str();
  app.add_option("--lr", s.lr, "learning rate")->capture_default_str();
  app.add_option("--batch", s.batch, "sequences per step")->capture_default_str();
  app.add_option("--seq", s.seq, "tokens per sequence")->capture_default_str();
  app.add_option("--seed", s.seed, "seed for the adapter and the data")->capture_default_str();
  app.add_option("--save", s.save, "save the trained adapter here (PEFT format)");
  app.add_flag("--verify", s.verify, "repeat monolithically and require equal losses and adapters (1e-5)");
  app.add_flag("--quiet", s.quiet, "print only the verdict");
  app.add_option("--threads", s.threads, "CPU threads of this process (tenants share the host)")->capture_default_str();
  app.add_option("--transport", s.transport, "auto, tcp, shm, cuda-ipc or nccl")->capture_default_str();
  app.add_option("--control", s.control, "where call headers go: auto, or zmq (ZeroMQ even on the executor's host)")
      ->capture_default_str();
  app.add_option("--device", s.device, "where this client's model runs: cpu or cuda:N")->capture_default_str();
  app.add_option("--dtype", s.dtype, "this client's model dtype: fp32, bf16 or fp16")->capture_default_str();
  app.add_flag("--buffer-copies", s.buffer_copies,
               "cuda-ipc: copy each call's input and result through the payload buffer instead of handing the "
               "executor this client's own tensors");
  app.add_flag("--empty-cache", s.empty_cache,
               "give this process's cached GPU memory back to CUDA after every step (as a tenant short of memory "
               "would)");
  app.add_flag("--cuda-graph", s.cuda_graph,
               "on a GPU, capture the split step in CUDA graphs after one eager step and replay it (--verify's "
               "monolithic run stays eager); the optimizer is then FusedAdamW, in both runs");
  app.add_option("--tolerance", s.tolerance, "--verify: largest relative difference accepted")->capture_default_str();
  app.add_option("--adapter-tolerance", s.adapter_tolerance,
                 "--verify: largest relative difference of the adapters after the last step (default: --tolerance); "
                 "AdamW's first, sign-like steps enlarge differences in the gradients' last bits");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(s.threads);
  return examples::report_errors(s.connection, [&] {
    auto checkpoint = Checkpoint::open(s.model);
    auto options = examples::client_options(s.connection, *checkpoint);
    options.transport = s.transport;
    options.control = s.control;
    options.device = s.device;
    options.direct_operands = !s.buffer_copies;
    auto client = Client::connect(options);
    if (!s.quiet) std::printf("[%s] transport %s\n", s.connection.tenant.c_str(), client->transport().c_str());
    auto split = train(s, *checkpoint, client);
    if (!s.verify) return 0;
    auto mono = train(Settings(s), *checkpoint, nullptr);
    // A NaN on either side is the worst difference (std::max would drop it: NaN compares false).
    auto worst = [](double so_far, double d) { return std::isnan(d) ? INFINITY : std::max(so_far, d); };
    double losses = 0, adapters = 0;
    for (size_t i = 0; i < split.losses.size(); ++i) {
      losses = worst(losses, std::abs(split.losses[i] - mono.losses[i]) / std::abs(mono.losses[i]));
    }
    for (size_t i = 0; i < split.adapter.size(); ++i) {
      adapters = worst(adapters, relative_error(split.adapter[i], mono.adapter[i]));
    }
    const bool exact =
        losses <= s.tolerance && adapters <= (s.adapter_tolerance < 0 ? s.tolerance : s.adapter_tolerance);
    std::printf(
        "[%s] verify (%s): max relative difference split vs monolithic over %d steps: losses %.3g, "
        "adapters %.3g: %s\n",
        s.connection.tenant.c_str(), client->transport().c_str(), s.steps, losses, adapters,
        exact ? "EXACT" : "MISMATCH");
    return exact ? 0 : 1;
  });
}
