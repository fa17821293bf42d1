#include "tests/gpu_test_util.h"

#include "client_runtime/training/loss.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

namespace symbiosis::testing {

size_t gpu_memory_used(int device) {
  torch::cuda::synchronize(device);
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t free = 0, total = 0;
  TORCH_CHECK(cudaMemGetInfo(&free, &total) == cudaSuccess, "cudaMemGetInfo failed");
  return total - free;
}

size_t gpu_memory_used_settled(int device, size_t bound, std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  size_t used = gpu_memory_used(device);
  while (used > bound && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    used = gpu_memory_used(device);
  }
  return used;
}

size_t gpu_peak_reserved(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  return stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

void reset_gpu_peak(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

std::vector<std::string> demo_client(const std::string& endpoint, const std::filesystem::path& model,
                                     const std::string& device, const std::string& transport,
                                     const std::vector<std::string>& extra) {
  std::vector<std::string> args = {binary("examples/symbiosis-demo-client"),
                                   "--executor",
                                   endpoint,
                                   "--model",
                                   model.string(),
                                   "--device",
                                   device,
                                   "--transport",
                                   transport,
                                   "--quiet"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

bool run_all(const std::vector<std::vector<std::string>>& clients) {
  std::vector<pid_t> pids;
  for (const auto& args : clients) pids.push_back(spawn(args));
  bool ok = true;
  for (pid_t pid : pids) ok = exited_ok(pid) && ok;
  return ok;
}

bool requests_reach(const Executor& executor, uint64_t since, uint64_t more, std::chrono::milliseconds limit) {
  return wait_until([&] { return executor.stats().requests >= since + more; }, limit);
}

LoraConfig same_gpu_lora() {
  LoraConfig lora;
  lora.init_b_zero = false;
  lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"};
  return lora;
}

CapturedLoraStep::CapturedLoraStep(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client,
                                   at::ScalarType dtype, const at::Tensor& ids, bool capture) {
  lm = open_causal_lm(checkpoint, client, {dtype, at::Device(at::kCUDA, 0)});
  at::manual_seed(21);
  adapter = add_lora(*lm.module, same_gpu_lora());
  optimizer = std::make_unique<FusedAdamW>(adapter, FusedAdamWOptions{.lr = 1e-3});
  step = std::make_unique<StepGraph>(
      [this, ids] {
        optimizer->zero_grad();
        logits = lm.forward(ids, {});
        loss = causal_lm_loss(logits, ids);
        loss.backward();
      },
      [this] { optimizer->step(); }, client, at::Device(at::kCUDA, 0),
      StepGraphOptions{.capture = capture, .warmup = 1});
}

}  // namespace symbiosis::testing
