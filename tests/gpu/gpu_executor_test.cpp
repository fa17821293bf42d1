// The executor on a GPU with clients on CPU: over TCP (payloads staged through pinned memory) and
// over same-host shared memory (pinned in place), split equals monolithic; and the batch packing
// kernel. Skipped, with a message saying so, where there is no GPU.
#include <torch/optim/adamw.h>

#include "client_runtime/causal_lm.h"
#include "client_runtime/lora.h"
#include "client_runtime/training.h"
#include "kernels/batched_copy.h"
#include "tests/gpu/gpu_test_util.h"

namespace symbiosis {
namespace {

using testing::relative_error;

// A CPU client fine-tunes LoRA against a GPU executor for three steps; returns the largest
// relative difference from the monolithic CPU run in loss, logits, gradients and adapter weights.
double cpu_client_against_gpu_executor(const std::string& dtype, const std::string& transport) {
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
  std::vector<CausalLM> models = {open_causal_lm(*checkpoint, client), open_causal_lm(*checkpoint, nullptr)};
  std::vector<std::vector<at::Tensor>> params;
  std::vector<std::unique_ptr<torch::optim::AdamW>> optimizers;
  for (auto& m : models) {
    at::manual_seed(11);
    params.push_back(add_lora(*m.module, lora));
    optimizers.push_back(std::make_unique<torch::optim::AdamW>(params.back(), torch::optim::AdamWOptions(1e-3)));
  }
  auto ids = at::randint(0, 200, {2, 16}, at::kLong);
  double worst = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<at::Tensor> logits, losses;
    for (size_t i = 0; i < 2; ++i) {
      optimizers[i]->zero_grad();
      logits.push_back(models[i].forward(ids, {}));
      losses.push_back(causal_lm_loss(logits.back(), ids));
      losses.back().backward();
    }
    worst = std::max({worst, relative_error(logits[0], logits[1]), relative_error(losses[0], losses[1])});
    for (size_t j = 0; j < params[0].size(); ++j) {
      worst = std::max(worst, relative_error(params[0][j].grad(), params[1][j].grad()));
    }
    for (auto& o : optimizers) o->step();
  }
  for (size_t j = 0; j < params[0].size(); ++j) worst = std::max(worst, relative_error(params[0][j], params[1][j]));
  EXPECT_GT(executor->stats().requests, 0u);
  EXPECT_EQ(executor->stats().errors, 0u);
  return worst;
}

class CpuClientGpuExecutorTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CpuClientGpuExecutorTest, Fp32EqualsMonolithicWithin1e5) {
  SKIP_WITHOUT_GPUS(1);
  EXPECT_LT(cpu_client_against_gpu_executor("fp32", GetParam()), 1e-5);
}

// bf16 base layers against the fp32 CPU reference: bf16 rounding, nothing more.
TEST_P(CpuClientGpuExecutorTest, Bf16IsWithinBf16Tolerance) {
  SKIP_WITHOUT_GPUS(1);
  EXPECT_LT(cpu_client_against_gpu_executor("bf16", GetParam()), 5e-2);
}

INSTANTIATE_TEST_SUITE_P(Transports, CpuClientGpuExecutorTest, ::testing::Values("tcp", "shm"));

TEST(BatchedCopyKernelTest, PacksAndUnpacksLikeCatAndSplitForAnySizes) {
  SKIP_WITHOUT_GPUS(1);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t features : {2048, 3}) {  // 3 features: rows not 16-byte multiples, the fallback path
      std::vector<at::Tensor> parts, rows, back;
      const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
      int64_t total = 0;
      for (int64_t tokens : {1, 7, 128, 3, 1024}) {
        parts.push_back(at::randn({tokens, features}, options));
        total += tokens;
      }
      auto packed = at::empty({total, features}, options);
      int64_t offset = 0;
      for (const auto& p : parts) {
        rows.push_back(packed.narrow(0, offset, p.size(0)));
        back.push_back(at::empty_like(p));
        offset += p.size(0);
      }
      kernels::copy_tensors(parts, rows);
      EXPECT_TRUE(packed.equal(at::cat(parts, 0)));
      kernels::copy_tensors(rows, back);
      for (size_t i = 0; i < parts.size(); ++i) EXPECT_TRUE(back[i].equal(parts[i]));
    }
  }
}

}  // namespace
}  // namespace symbiosis
