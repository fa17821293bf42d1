// Invariant 1 (exactness): split execution against an executor computes what the same model
// computes monolithically: logits, loss and every LoRA gradient within 1e-5 relative (fp32, CPU),
// and adapter weights still agree after 5 AdamW steps. Llama, Qwen2, Qwen3, Mistral, Gemma 2, Phi-3, GPT-2
// (also as the Hub names GPT-2's tensors: [Checkpoint layouts]), GPTBigCode, GPT-NeoX, Phi and OPT, over each CPU transport
// (ZeroMQ TCP, and shared memory with headers through the shared-memory control channel or over
// ZeroMQ), in one process and in four client processes at once under each batching policy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/optim/adamw.h>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/loss.h"
#include "tests/test_util.h"

extern char** environ;

namespace symbiosis {
namespace {

constexpr double kTolerance = 1e-5;

// A transport as the tests name it: "shm+zmq-control" is shm with its headers over ZeroMQ.
constexpr const char* kZmqControl = "+zmq-control";

class ExactnessTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ExactnessTest, SplitEqualsMonolithicInLossLogitsGradientsAndAfterFiveSteps) {
  const auto& [preset, transport] = GetParam();
  ClientOptions options;
  options.transport = transport.substr(0, transport.find(kZmqControl));
  if (options.transport != transport) options.control = "zmq";
  auto served = testing::serve_model(preset, options);
  const auto& checkpoint = served.checkpoint;
  const auto& client = served.client;
  ASSERT_EQ(client->transport(), options.transport);

  LoraConfig lora;
  lora.r = 4;
  lora.target_modules = {"q_proj",   "v_proj",          "down_proj",     "c_attn", "c_fc",
                         "qkv_proj", "query_key_value", "dense_4h_to_h", "fc2"};
  lora.init_b_zero = false;  // non-zero gradients everywhere from the first step
  auto split = testing::make_training_run(*checkpoint, client, testing::lora_adapter(lora), {}, 1e-2, 1234);
  auto mono = testing::make_training_run(*checkpoint, nullptr, testing::lora_adapter(lora), {}, 1e-2, 1234);
  ASSERT_GT(split.lm.virtual_layers, 0u);
  EXPECT_EQ(split.lm.virtual_layers, client->layers().size());
  at::manual_seed(7);
  auto ids = at::randint(0, 200, {2, 12}, at::kLong);
  testing::expect_same_training(split, mono, ids, 5, kTolerance);
  // Every base layer went through the executor forward, each step, and gradients came back through
  // it (not below the first adapter: the frozen base needs none there).
  EXPECT_GT(client->calls(), 5 * testing::forward_calls(*client) + 5);
}

INSTANTIATE_TEST_SUITE_P(Models, ExactnessTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-llama-tied", "tiny-qwen2",
                                                              "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gpt2",
                                                              "tiny-gpt2-hub", "tiny-gpt-bigcode", "tiny-phi3",
                                                              "tiny-phi3-longrope", "tiny-gpt-neox", "tiny-phi",
                                                              "tiny-opt", "tiny-opt-projected"),
                                            ::testing::Values("tcp", "shm", std::string("shm") + kZmqControl)),
                         [](const auto& info) {
                           auto name = std::get<0>(info.param) + "_" + std::get<1>(info.param);
                           std::replace_if(
                               name.begin(), name.end(), [](char c) { return !std::isalnum(c); }, '_');
                           return name;
                         });

// [Checkpoint layouts]: the executor serves a GPT-2 checkpoint named as the Hub's (no "transformer."
// prefix) by its own names, and the client's model, whose paths keep the prefix, binds every one.
TEST(CheckpointLayoutTest, HubGPT2LayersAreServedByTheCheckpointsNames) {
  auto served = testing::serve_model("tiny-gpt2-hub");
  ASSERT_FALSE(served.client->layers().empty());
  for (const auto& layer : served.client->layers()) EXPECT_EQ(layer.name.rfind("h.", 0), 0u) << layer.name;
  EXPECT_EQ(served.client->layers()[0].kind, LayerKind::kConv1D);
  const auto lm = open_causal_lm(*served.checkpoint, served.client);
  EXPECT_EQ(lm.virtual_layers, served.client->layers().size());
}

// Separate client processes share one executor at once, with different batch sizes, sequence
// lengths and adapters, under each batching policy; each checks its own split run against its own
// monolithic run (the demo client's --verify mode) and exits 0 only if they agree within 1e-5.
class MultiProcessExactness : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(MultiProcessExactness, EveryClientEqualsItsMonolithicRun) {
  const auto& [policy, transport] = GetParam();
  const auto dir = testing::make_checkpoint("tiny-llama");
  ExecutorOptions options;
  options.batching.policy = parse_batching_policy(policy);
  options.batching.lockstep_timeout = std::chrono::milliseconds(300);
  auto executor = testing::start_executor(dir, options);
  const std::string program = testing::binary("examples/symbiosis-demo-client");
  const std::vector<std::vector<std::string>> configs = {
      {"--rank", "4", "--targets", "q_proj,v_proj", "--seed", "1", "--batch", "1", "--seq", "8"},
      {"--rank", "8", "--targets", "q_proj,k_proj,v_proj,o_proj", "--seed", "2", "--batch", "4", "--seq", "16"},
      {"--rank", "2", "--targets", "gate_proj,up_proj,down_proj", "--seed", "3", "--batch", "2", "--seq", "32"},
      {"--rank", "16", "--targets", "all-linear", "--seed", "4", "--batch", "3", "--seq", "5"}};
  std::vector<pid_t> pids;
  for (const auto& extra : configs) {
    std::vector<std::string> args = {program,   "--executor", executor->endpoint(), "--model", dir.string(),
                                     "--steps", "4",          "--verify",           "--quiet", "--transport",
                                     transport};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    ASSERT_EQ(posix_spawn(&pid, program.c_str(), nullptr, nullptr, argv.data(), environ), 0);
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "client process " << pid << " status " << status;
  }
  const auto stats = executor->stats();
  EXPECT_EQ(stats.errors, 0u);
  // Every client: forward through every layer each step, and backward (not below its first adapter).
  EXPECT_GT(stats.requests, 4u * 4u * executor->model().layers().size());
}

INSTANTIATE_TEST_SUITE_P(Policies, MultiProcessExactness,
                         ::testing::Combine(::testing::Values("none", "lockstep", "opportunistic"),
                                            ::testing::Values("tcp", "shm")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

}  // namespace
}  // namespace symbiosis
