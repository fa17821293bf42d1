// The executor on a GPU with clients on CPU: over TCP (payloads staged through pinned memory) and
// over same-host shared memory (pinned in place), split equals monolithic. Skipped, with a message
// saying so, where there is no GPU. The executor's kernels are tested in tests/kernels/.
#include <random>
#include <thread>

#include "base_executor/metrics.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/loss.h"
#include "kernels/direct_gemm.h"
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

// [Packed rows are exact]
// Packing is bitwise: under lockstep every batch holds one call of each of three clients (two on
// the executor's GPU over cuda-ipc, one on the CPU over shm, as in the soak), and each client's
// result rows equal, bit for bit, its rows of the executor's GEMM run by this test on the
// concatenated inputs (the same function, cuda::gemm_into, on the same GPU, so the same kernel for
// the packed row count). A race in packing, staging or unpacking (another call's rows, a stale
// buffer) breaks the equality. The same rows computed alone differ from the packed ones by the
// GEMM kernel's reduction order for another row count: printed, not held, since that is by design.
TEST(PackedBatchTest, PackedRowsEqualTheSameGemmOfThePackedShapeBitForBit) {
  SKIP_WITHOUT_GPUS(1);
  const auto dir = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(dir);
  testing::ExecutorProcess executor(dir, {"--device", "cuda:0", "--batching", "lockstep", "--log-level", "warn"});
  const std::vector<std::pair<std::string, std::string>> placements = {{"cuda-ipc", "cuda:0"}, {"cuda-ipc", "cuda:0"},
                                                                       {"shm", "cpu"}};
  std::vector<std::shared_ptr<Client>> clients;
  for (const auto& [transport, device] : placements) {
    ClientOptions options;
    options.endpoint = executor.endpoint();
    options.transport = transport;
    options.device = device;
    clients.push_back(Client::connect(options));
    ASSERT_EQ(clients.back()->transport(), transport);
  }
  const std::string name = "model.layers.1.mlp.down_proj";
  const auto& layers = clients[0]->layers();
  const auto layer = std::find_if(layers.begin(), layers.end(), [&](const LayerInfo& l) { return l.name == name; });
  ASSERT_NE(layer, layers.end()) << name;
  const auto weight = checkpoint->tensor(name + ".weight").to(at::kFloat).to(at::Device("cuda:0")).contiguous();

  // Round r: every client makes one call of r's op with its own number of tokens (1 to 96).
  constexpr int kRounds = 80;
  std::mt19937 random(7);
  at::manual_seed(7);
  std::vector<std::vector<at::Tensor>> inputs(clients.size()), outputs(clients.size());
  for (int r = 0; r < kRounds; ++r) {
    const int64_t features = r % 2 == 0 ? layer->in_features : layer->out_features;  // forward, backward input
    for (size_t c = 0; c < clients.size(); ++c) {
      inputs[c].push_back(at::randn({1 + static_cast<int64_t>(random() % 96), features}));
    }
  }
  std::vector<std::thread> threads;
  for (size_t c = 0; c < clients.size(); ++c) {
    threads.emplace_back([&, c] {
      const at::Device device(placements[c].second);
      for (int r = 0; r < kRounds; ++r) {
        const auto x = inputs[c][r].to(device);
        const auto y = r % 2 == 0 ? clients[c]->forward(*layer, x, false) : clients[c]->backward_input(*layer, x);
        outputs[c].push_back(y.to(at::kCPU));
      }
    });
  }
  for (auto& t : threads) t.join();

  double largest_alone = 0;
  for (int r = 0; r < kRounds; ++r) {
    const auto matrix = r % 2 == 0 ? weight.t() : weight;
    auto gemm = [&](const at::Tensor& x) {
      const auto on_gpu = x.to(weight.device()).contiguous();
      auto out = at::empty({on_gpu.size(0), matrix.size(1)}, on_gpu.options());
      EXPECT_TRUE(cuda::gemm_into(on_gpu, matrix, out));
      return out.to(at::kCPU);
    };
    std::vector<at::Tensor> round;
    for (size_t c = 0; c < clients.size(); ++c) round.push_back(inputs[c][r]);
    const auto packed = gemm(at::cat(round, 0));
    int64_t row = 0;
    for (size_t c = 0; c < clients.size(); ++c) {
      const int64_t tokens = inputs[c][r].size(0);
      const auto expected = packed.narrow(0, row, tokens);
      row += tokens;
      const double difference = (outputs[c][r] - expected).abs().max().item<double>();
      EXPECT_EQ(difference, 0.0) << "round " << r << ", client " << c << " (" << placements[c].first << ", "
                                 << tokens << " of " << packed.size(0) << " packed rows)";
      largest_alone = std::max(largest_alone, (gemm(inputs[c][r]) - expected).abs().max().item<double>() /
                                                  expected.abs().max().item<double>());
    }
  }
  std::cout << "[packed rows] the same rows computed alone differ from the packed ones by up to " << largest_alone
            << " of the largest value (another kernel for another row count)" << std::endl;
}

}  // namespace
}  // namespace symbiosis
