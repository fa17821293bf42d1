// [Executor restart] (client_runtime/client.cpp): a client outlives its executor. An executor
// process is stopped (SIGTERM: it says so) or killed (SIGKILL: it says nothing) while a tenant
// fine-tunes or generates, and started again on the same endpoint: the tenant's run goes on and
// ends exactly as a monolithic run of the same weights does, over tcp and shm. An executor that
// comes back with another model is refused at once; one that does not come back within
// reconnect_ms fails the call naming the endpoint; reconnect_ms 0 fails it at once.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "client_runtime/client.h"
#include "client_runtime/inference/generator.h"
#include "common/checkpoint.h"
#include "tests/client_runtime/inference/generation_util.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using testing::ExecutorProcess;
constexpr double kTolerance = 1e-5;

ClientOptions client_options(const ExecutorProcess& executor, const std::string& transport) {
  ClientOptions options;
  options.endpoint = executor.endpoint();
  options.transport = transport;
  options.timeout_ms = 30000;
  options.reconnect_ms = 30000;
  return options;
}

class RestartTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// The steps before the restart, the one that meets it, and those after: every loss, logit and
// gradient, and the adapter at the end, equal the monolithic run's.
TEST_P(RestartTest, FineTuningAcrossARestartEqualsARunWithout) {
  const auto& [transport, signal] = GetParam();
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto checkpoint = Checkpoint::open(dir);
  ExecutorProcess executor(dir);
  auto client = Client::connect(client_options(executor, transport));
  ASSERT_EQ(client->transport(), transport);
  const auto adapter = testing::lora_adapter(testing::moving_lora());
  auto split = testing::make_training_run(*checkpoint, client, adapter, {}, 1e-2, 1234);
  auto mono = testing::make_training_run(*checkpoint, nullptr, adapter, {}, 1e-2, 1234);
  at::manual_seed(7);
  const auto ids = at::randint(0, 200, {2, 12}, at::kLong);
  testing::expect_same_training(split, mono, ids, 3, kTolerance);

  executor.restart(signal, dir);
  testing::expect_same_training(split, mono, ids, 3, kTolerance);
  EXPECT_EQ(client->connection(), 2u);
  EXPECT_EQ(client->transport(), transport);
  EXPECT_EQ(client->model_hash(), checkpoint->model_hash());

  // A second restart, while the client is idle: the next step finds it as well.
  executor.wait_started();
  executor.restart(signal, dir);
  executor.wait_started();
  testing::expect_same_training(split, mono, ids, 2, kTolerance);
  EXPECT_EQ(client->connection(), 3u);
}

INSTANTIATE_TEST_SUITE_P(TransportsAndEndings, RestartTest,
                         ::testing::Combine(::testing::Values("tcp", "shm"), ::testing::Values(SIGTERM, SIGKILL)),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) == SIGKILL ? "_killed" : "_stopped");
                         });

// A generation under way when the executor is killed goes on where it was (its cache is the
// client's) and produces what monolithic generation produces; in [Decode halves] too, whose two
// connections both connect again.
TEST(RestartGenerationTest, GenerationResumesWhereItWas) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto checkpoint = Checkpoint::open(dir);
  ExecutorProcess executor(dir);
  auto split_lm = open_causal_lm(*checkpoint, Client::connect(client_options(executor, "shm")));
  auto mono_lm = open_causal_lm(*checkpoint);
  testing::add_test_lora(split_lm);
  testing::add_test_lora(mono_lm);
  const auto requests = std::vector<GenerationRequest>{testing::request({5, 9, 33, 2, 7}, 12),
                                                       testing::request({100, 4, 18}, 10, 0.8, 20, 1.0, 1)};
  const auto mono = Generator(mono_lm).generate(requests);
  for (const bool halves : {false, true}) {
    Generator generator(split_lm, {.decode_halves = halves});
    std::vector<std::vector<int64_t>> split(requests.size());
    int tokens = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      generator.submit(requests[i], [&, i](const TokenEvent& event) {
        ASSERT_TRUE(event.error.empty()) << event.error;
        if (event.token >= 0) split[i].push_back(event.token);
        if (++tokens == 6) executor.restart(SIGKILL, dir);  // mid-generation
      });
    }
    generator.run();
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(split[i], mono[i].output_ids) << "request " << i << (halves ? ", in decode halves" : "");
    }
    EXPECT_GE(tokens, 6);
    executor.wait_started();
  }
}

// After a restart with another checkpoint behind the endpoint (another model hash), the client is
// refused at once, not retried, and says which model it holds.
TEST(RestartRefusalTest, AnExecutorBackWithAnotherModelIsRefusedNotRetried) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto other = testing::make_checkpoint("tiny-llama", "--seed 99");
  ASSERT_NE(Checkpoint::open(dir)->model_hash(), Checkpoint::open(other)->model_hash());
  ExecutorProcess executor(dir);
  auto client = Client::connect(client_options(executor, "tcp"));
  const auto* q = client->find_layer("model.layers.0.self_attn.q_proj");
  ASSERT_TRUE(q);
  const auto x = at::randn({3, q->in_features});
  client->forward(*q, x, false);
  executor.restart(SIGKILL, other);
  const auto start = Clock::now();
  const auto message = testing::error_of([&] { client->forward(*q, x, false); });
  EXPECT_NE(message.find("the executor there now refuses this client"), std::string::npos) << message;
  EXPECT_NE(message.find(client->model_hash()), std::string::npos) << message;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(20));  // not the 30 s of reconnect_ms
}

// An executor that does not come back: the call fails past reconnect_ms, naming the endpoint, why
// the connection was lost and the last try; with reconnect_ms 0 it fails at once.
TEST(RestartRefusalTest, AClientGivesUpPastReconnectMsNamingTheEndpoint) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  ExecutorProcess executor(dir);
  auto options = client_options(executor, "shm");
  options.reconnect_ms = 1500;
  auto patient = Client::connect(options);
  options.reconnect_ms = 0;
  auto impatient = Client::connect(options);
  const auto* q = patient->find_layer("model.layers.0.self_attn.q_proj");
  ASSERT_TRUE(q);
  const auto x = at::randn({3, q->in_features});
  patient->forward(*q, x, false);
  impatient->forward(*q, x, false);
  executor.end(SIGKILL);

  const auto message = testing::error_of([&] { patient->forward(*q, x, false); });
  EXPECT_NE(message.find("no executor took this client back at " + options.endpoint + " within 1500 ms"),
            std::string::npos)
      << message;
  // Why: whichever the client noticed first, its ZeroMQ connection or its local link.
  EXPECT_TRUE(message.find("broke off") != std::string::npos ||
              message.find("closed this client's local link") != std::string::npos)
      << message;
  // A client whose reconnection failed tries again at its next call, and fails as clearly.
  const auto again = testing::error_of([&] { patient->forward(*q, x, false); });
  EXPECT_NE(again.find("connecting again failed before; no executor took this client back"), std::string::npos)
      << again;
  const auto start = Clock::now();
  const auto at_once = testing::error_of([&] { impatient->forward(*q, x, false); });
  EXPECT_NE(at_once.find("this client does not reconnect (reconnect_ms is 0)"), std::string::npos) << at_once;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace symbiosis
