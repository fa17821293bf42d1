// Generation on a GPU: a tenant on the executor's GPU (CUDA IPC, its calls stream-ordered) generates
// what the same model generates monolithic on that GPU, tokens and every step's logits, with
// requests joining and leaving the batch; and in bf16, the split run's tokens equal the monolithic
// run's. The split run decodes in CUDA graphs ([Captured decode]), one per batch size it meets, and
// the monolithic run it is held to decodes eagerly. Skipped without a GPU; runs on the GPU machine
// (scripts/gpu_check.sh generate).
#include "bench/process.h"
#include "transport/client_transport.h"
#include "tests/client_runtime/inference/generation_util.h"
#include "tests/gpu_test_util.h"

namespace symbiosis {
namespace {

void expect_split_equals_monolithic(at::ScalarType dtype, double tolerance) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto checkpoint = Checkpoint::open(dir);
  // CUDA IPC takes two processes: the executor runs as its own.
  const auto executor = bench::start_executor({"--model", dir.string(), "--listen", "tcp://127.0.0.1:*", "--device", "cuda:0",
                                               "--dtype", dtype == at::kFloat ? "fp32" : "bf16", "--log-level", "warn"},
                                              testing::temp_dir("gpu-generator-executor"));
  auto client = Client::connect(
      {.endpoint = executor.endpoint, .expected_model_hash = checkpoint->model_hash(), .device = "cuda:0"});
  EXPECT_EQ(client->transport(), "cuda-ipc");
  const CausalLMOptions on_gpu{dtype, at::Device("cuda:0")};
  auto split_lm = open_causal_lm(*checkpoint, client, on_gpu);
  auto mono_lm = open_causal_lm(*checkpoint, nullptr, on_gpu);
  testing::add_test_lora(split_lm);
  testing::add_test_lora(mono_lm);
  GeneratorOptions captured;
  captured.max_sequences = 3;
  captured.max_tokens = 24;
  captured.capture_warmup = 1;
  auto eager = captured;
  eager.capture_decode = false;
  const auto split = testing::generate(split_lm, testing::mixed_requests(), captured);
  const auto mono = testing::generate(mono_lm, testing::mixed_requests(), eager);
  EXPECT_GE(split.captured, 2);  // the requests meet batches of several sizes
  EXPECT_EQ(mono.captured, 0);
  testing::expect_same(split, mono, std::string("cuda ") + c10::toString(dtype), tolerance);
  // Monolithic, captured against eager.
  testing::expect_same(testing::generate(mono_lm, testing::mixed_requests(), captured), mono,
                       std::string("cuda monolithic captured ") + c10::toString(dtype), tolerance);
  EXPECT_EQ(request_stats(executor.endpoint, 10000).errors(), 0u);
  split_lm = {};
  client.reset();
  bench::stop(executor.pid);
}

TEST(GpuGeneration, SplitOverCudaIpcEqualsMonolithicInFp32) {
  SKIP_WITHOUT_GPUS(1);
  expect_split_equals_monolithic(at::kFloat, 1e-5);
}

TEST(GpuGeneration, SplitOverCudaIpcGivesTheMonolithicTokensInBf16) {
  SKIP_WITHOUT_GPUS(1);
  expect_split_equals_monolithic(at::kBFloat16, 2e-2);
}

}  // namespace
}  // namespace symbiosis
