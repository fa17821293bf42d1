// [Executor restart] (client_runtime/client.cpp) on a GPU: an executor process on cuda:0 is killed
// while a same-GPU (cuda-ipc) tenant generates with captured decode steps, or trains with captured
// steps (or, with two GPUs, a tenant on cuda:1 trains over NCCL), and is started again. Calls
// ordered on the GPU lose their results (ResultsLost): the generator and the trainer run the step
// again, StepGraph captures anew on the new connection, and the tokens and losses are those of a run
// without the restart. The same holds for a tenant the executor drops while it lives, having let its
// step's run go without its inputs ([Voided runs]).
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "client_runtime/inference/generator.h"
#include "client_runtime/training/step_graph.h"
#include "client_runtime/training/trainer.h"
#include "common/cuda.h"
#include "tests/client_runtime/inference/generation_util.h"
#include "tests/gpu_test_util.h"
#include "transport/control_socket.h"

namespace symbiosis {
namespace {

using testing::ExecutorProcess;

// A client on `device`: cuda:0 (the executor's GPU) talks over cuda-ipc, cuda:1 over NCCL.
std::shared_ptr<Client> gpu_client(const ExecutorProcess& executor, const std::string& device = "cuda:0") {
  ClientOptions options;
  options.endpoint = executor.endpoint();
  options.device = device;
  options.reconnect_ms = 60000;
  auto client = Client::connect(options);
  EXPECT_EQ(client->transport(), device == "cuda:0" ? "cuda-ipc" : "nccl");
  return client;
}

// tiny-llama served by an executor process on cuda:0.
class GpuRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPUS(1);
    dir = testing::make_checkpoint("tiny-llama");
    checkpoint = Checkpoint::open(dir);
    executor =
        std::make_unique<ExecutorProcess>(dir, std::vector<std::string>{"--device", "cuda:0", "--log-level", "warn"});
  }

  std::filesystem::path dir;
  std::shared_ptr<Checkpoint> checkpoint;
  std::unique_ptr<ExecutorProcess> executor;
};

TEST_F(GpuRestartTest, CapturedGenerationResumesAcrossAKill) {
  auto client = gpu_client(*executor);
  const CausalLMOptions on_gpu{at::kFloat, at::Device("cuda:0")};
  auto split_lm = open_causal_lm(*checkpoint, client, on_gpu);
  auto mono_lm = open_causal_lm(*checkpoint, nullptr, on_gpu);
  testing::add_test_lora(split_lm);
  testing::add_test_lora(mono_lm);
  GeneratorOptions options;
  options.max_sequences = 3;
  options.max_tokens = 40;
  options.capture_warmup = 1;
  const auto requests =
      std::vector<GenerationRequest>{testing::request({5, 9, 33, 2, 7}, 20), testing::request({100, 4, 18}, 18)};
  Generator generator(split_lm, options);
  std::vector<std::vector<int64_t>> split(requests.size());
  int tokens = 0;
  bool killed = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    generator.submit(requests[i], [&, i](const TokenEvent& event) {
      ASSERT_TRUE(event.error.empty()) << event.error;
      if (event.token >= 0) split[i].push_back(event.token);
      // Mid-generation, once decode runs in captured graphs.
      if (++tokens == 12 && generator.captured_batch_sizes() > 0) {
        executor->restart(SIGKILL, dir);
        killed = true;
      }
    });
  }
  generator.run();
  EXPECT_TRUE(killed);
  EXPECT_GE(client->connection(), 2u);
  auto eager = options;
  eager.capture_decode = false;
  const auto mono = Generator(mono_lm, eager).generate(requests);
  for (size_t i = 0; i < requests.size(); ++i) EXPECT_EQ(split[i], mono[i].output_ids) << "request " << i;
}

// [Voided runs] (transport/cuda_ipc/cuda_ipc_channel.cpp): the executor launches a captured step's
// run ahead while this client's GPU stands still (the step's stream waits for the caller's, held
// here by a wait on a host word, as another stream's wait on a shared hardware queue holds it), lets
// the run go without its inputs after 5 s, and drops the client. The run's results come, and are
// void: the step throws ResultsLost, and run again on the new connection once the GPU goes on, it
// computes what the layers compute.
TEST_F(GpuRestartTest, AStepWhoseRunTheExecutorLetGoWithoutItsInputsIsVoid) {
  auto client = gpu_client(*executor);
  const auto* q = client->find_layer("model.layers.0.self_attn.q_proj");
  const auto* o = client->find_layer("model.layers.0.self_attn.o_proj");
  ASSERT_TRUE(q && o);
  const auto on_gpu = at::TensorOptions().device(at::kCUDA).dtype(q->dtype);
  at::manual_seed(3);
  const auto x = at::randn({4, q->in_features}, on_gpu);
  at::Tensor out;
  client->set_latency_class(LatencyClass::kInferenceDecode);  // the executor launches decode steps ahead
  StepGraph step([&] { out = client->forward(*o, client->forward(*q, x, true), true); }, {}, client,
                 at::Device("cuda:0"), {.warmup = 1});
  for (int i = 0; i < 200 && request_stats(executor->endpoint(), 10000).ahead_calls() == 0; ++i) step.run();
  ASSERT_GT(request_stats(executor->endpoint(), 10000).ahead_calls(), 0u) << "the executor launched no run ahead";
  const auto weight = [&](const LayerInfo& layer) { return checkpoint->tensor(layer.name + ".weight").to(on_gpu); };
  const auto reference = at::linear(at::linear(x, weight(*q)), weight(*o));  // tiny-llama's have no bias
  EXPECT_TRUE(at::allclose(out, reference, 1e-5, 1e-5));
  std::vector<uint32_t> word(1024, 0);
  const cuda::PinnedRange pinned(word.data(), word.size() * sizeof(uint32_t), /*mapped=*/true);
  cuda::wait_value_on_stream(cuda::current_stream(0), pinned.device_pointer(word.data()), 1);
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::seconds(10));  // past the executor's 5 s
    std::atomic_ref<uint32_t>(word[0]).store(1, std::memory_order_release);
  });
  out.zero_();
  EXPECT_THROW(step.run(), ResultsLost);
  step.run();  // captured anew, once the held stream goes
  release.join();
  EXPECT_EQ(client->connection(), 2u);
  EXPECT_TRUE(at::allclose(out, reference, 1e-5, 1e-5));
}

// Trainer losses on `device` through `client` (captured steps on the executor's GPU); `after_step`
// runs after each update.
std::vector<double> train_losses(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client,
                                 const std::function<void(int64_t)>& after_step, const std::string& device = "cuda:0") {
  auto lm = open_causal_lm(checkpoint, client, {at::kFloat, at::Device(device)});
  at::manual_seed(5);
  LoraConfig lora;
  lora.r = 4;
  lora.init_b_zero = false;
  auto parameters = add_lora(*lm.module, lora);
  at::manual_seed(61);
  std::vector<TokenExample> examples;
  for (int i = 0; i < 8; ++i) {
    auto ids = at::randint(0, 256, {10}, at::kLong);
    examples.push_back({std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + 10), {}});
  }
  TrainerOptions options;
  options.batching.micro_batch_size = 2;
  options.max_steps = 6;
  options.learning_rate = 1e-2;
  options.shuffle = false;
  options.progress = false;
  Trainer trainer(lm, parameters, TokenDataset::from_examples(std::move(examples)), options);
  trainer.set_hooks({.after_update = after_step});
  std::vector<double> losses;
  for (const auto& step : trainer.train()) losses.push_back(step.loss);
  return losses;
}

void expect_same_losses(const std::vector<double>& across, const std::vector<double>& without) {
  ASSERT_EQ(without.size(), 6u);
  ASSERT_EQ(across.size(), 6u);
  for (size_t i = 0; i < without.size(); ++i) {
    EXPECT_TRUE(std::isfinite(without[i])) << i;
    EXPECT_NEAR(across[i], without[i], 1e-5 * std::abs(without[i])) << "step " << i;
  }
}

TEST_F(GpuRestartTest, CapturedTrainingAcrossAKillEqualsARunWithout) {
  const auto without = train_losses(*checkpoint, gpu_client(*executor), {});
  auto client = gpu_client(*executor);
  const auto across = train_losses(*checkpoint, client, [&](int64_t step) {
    if (step == 3) executor->restart(SIGKILL, dir);  // the steps are captured by then
  });
  EXPECT_EQ(client->connection(), 2u);
  expect_same_losses(across, without);
}

// A tenant on another GPU (NCCL): the restart makes it set up a new communicator with the new
// executor ([Executor restart]), and its training goes on as without one.
TEST_F(GpuRestartTest, NcclTrainingAcrossAKillEqualsARunWithout) {
  SKIP_WITHOUT_GPUS(2);
  const auto without = train_losses(*checkpoint, gpu_client(*executor, "cuda:1"), {}, "cuda:1");
  auto client = gpu_client(*executor, "cuda:1");
  const auto across = train_losses(
      *checkpoint, client,
      [&](int64_t step) {
        if (step == 3) executor->restart(SIGKILL, dir);
      },
      "cuda:1");
  EXPECT_EQ(client->connection(), 2u);
  expect_same_losses(across, without);
}

}  // namespace
}  // namespace symbiosis
