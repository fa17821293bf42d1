// The executor on a GPU with clients on CPU: over TCP (payloads staged through pinned memory) and
// over same-host shared memory (pinned in place), split equals monolithic. Skipped, with a message
// saying so, where there is no GPU. The executor's kernels are tested in tests/kernels/.
#include "base_executor/metrics.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/loss.h"
#include "tests/gpu_test_util.h"

namespace symbiosis {
namespace {

// A CPU client fine-tunes LoRA against a GPU executor for three steps, held against the
// monolithic CPU run within `tolerance` (loss, logits, gradients, adapter weights).
void cpu_client_against_gpu_executor(const std::string& dtype, const std::string& transport, double tolerance) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(dir);
  ExecutorOptions options;
  options.device = "cuda:0";
  options.dtype = parse_dtype_name(dtype);
  auto executor = testing::start_executor(dir, options);
  ClientOptions client_options;
  client_options.endpoint = executor->endpoint();
  client_options.transport = transport;
  auto client = Client::connect(client_options);
  EXPECT_EQ(client->transport(), transport);
  LoraConfig lora;
  lora.init_b_zero = false;
  lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  auto split = testing::make_training_run(*checkpoint, client, testing::lora_adapter(lora), {}, 1e-3, 11);
  auto mono = testing::make_training_run(*checkpoint, nullptr, testing::lora_adapter(lora), {}, 1e-3, 11);
  testing::expect_same_training(split, mono, at::randint(0, 200, {2, 16}, at::kLong), 3, tolerance);
  EXPECT_GT(executor->stats().requests, 0u);
  EXPECT_EQ(executor->stats().errors, 0u);
}

class CpuClientGpuExecutorTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CpuClientGpuExecutorTest, Fp32EqualsMonolithicWithin1e5) {
  SKIP_WITHOUT_GPUS(1);
  cpu_client_against_gpu_executor("fp32", GetParam(), 1e-5);
}

// bf16 base layers against the fp32 CPU reference: bf16 rounding, nothing more.
TEST_P(CpuClientGpuExecutorTest, Bf16IsWithinBf16Tolerance) {
  SKIP_WITHOUT_GPUS(1);
  cpu_client_against_gpu_executor("bf16", GetParam(), 5e-2);
}

INSTANTIATE_TEST_SUITE_P(Transports, CpuClientGpuExecutorTest, ::testing::Values("tcp", "shm"));

// [Metrics]: on a GPU the metrics show the GPU memory in tensors, at least the executor's weights
// (the HTTP endpoint and every other figure are tested on CPU, in metrics_test).
TEST(GpuMetricsTest, GpuAllocatedBytesHoldTheExecutorsWeights) {
  SKIP_WITHOUT_GPUS(1);
  ExecutorOptions options;
  options.device = "cuda:0";
  auto executor = testing::start_executor(testing::make_checkpoint("tiny-llama"), options);
  MetricsGauges gauges;
  gauges.gpu = 0;
  const auto text = prometheus_text(MetricsSnapshot{}, gauges);
  const std::string sample = "symbiosis_gpu_allocated_bytes{device=\"cuda:0\"} ";
  const auto at = text.find(sample);
  ASSERT_NE(at, std::string::npos) << text;
  const double allocated = std::stod(text.substr(at + sample.size()));
  EXPECT_GE(allocated, static_cast<double>(executor->model().weight_bytes())) << text;
  EXPECT_NE(text.find("symbiosis_gpu_reserved_bytes{device=\"cuda:0\"} "), std::string::npos);
}

}  // namespace
}  // namespace symbiosis
