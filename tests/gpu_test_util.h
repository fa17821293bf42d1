#pragma once
// Shared by the GPU tests: skipping where there is no GPU (with a message saying so), the GPU
// memory in use, running demo clients as separate processes, waiting for the executor to notice
// clients that left, and a LoRA training step captured in CUDA graphs.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base_executor/executor.h"
#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/fused_adamw.h"
#include "client_runtime/training/step_graph.h"
#include "tests/test_util.h"

#define SKIP_WITHOUT_GPUS(n)                                                                          \
  if (static_cast<int>(torch::cuda::device_count()) < (n))                                            \
  GTEST_SKIP() << "needs " << (n) << " CUDA GPU(s), this machine has " << torch::cuda::device_count() \
               << ": GPU tests run on the GPU machine (scripts/gpu_check.sh)"

namespace symbiosis::testing {

// Bytes in use on the GPU, by every process (cudaMemGetInfo), after this process's cached but
// unused blocks are returned.
size_t gpu_memory_used(int device);
// gpu_memory_used, read again until it is at most `bound` or `wait` has passed (what a killed
// process held is released by the driver after the process ends, not at once); the last reading.
size_t gpu_memory_used_settled(int device, size_t bound, std::chrono::milliseconds wait);

// Peak bytes this process's caching allocator has reserved on `device`; reset_gpu_peak() restarts it.
size_t gpu_peak_reserved(int device);
void reset_gpu_peak(int device);

// Arguments of one demo client (examples/demo_client.cpp) that fine-tunes against `endpoint` and,
// with --verify, exits 0 only if its split run equals its monolithic run within `tolerance`.
std::vector<std::string> demo_client(const std::string& endpoint, const std::filesystem::path& model,
                                     const std::string& device, const std::string& transport,
                                     const std::vector<std::string>& extra = {});

// Runs the clients at once; true when every one exited 0.
bool run_all(const std::vector<std::vector<std::string>>& clients);

// Waits until the executor has answered `more` requests after `since` (its stats().requests),
// at most `limit`: false if it did not (a client it waits on died early, say).
bool requests_reach(const Executor& executor, uint64_t since, uint64_t more,
                    std::chrono::milliseconds limit = std::chrono::seconds(60));

// The GPU tests' LoRA: q, k, v, o and down, B drawn (not zero) so that every gradient is nonzero.
LoraConfig same_gpu_lora();

// [Captured steps]: a model with same_gpu_lora() (drawn with seed 21) on cuda:0, split through
// `client` or monolithic (nullptr), and its training step (loss, backward, AdamW at 1e-3), captured
// in CUDA graphs after one eager run or run eagerly throughout; what the step computed stays
// readable after it.
struct CapturedLoraStep {
  CausalLM lm;
  std::vector<at::Tensor> adapter;
  std::unique_ptr<FusedAdamW> optimizer;
  at::Tensor logits, loss;
  std::unique_ptr<StepGraph> step;

  CapturedLoraStep(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client, at::ScalarType dtype,
                   const at::Tensor& ids, bool capture);
  CapturedLoraStep(CapturedLoraStep&&) = delete;  // the step's functions hold `this`
};

}  // namespace symbiosis::testing
