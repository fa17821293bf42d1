// [Parts] (base_executor/parts.h): a sharded executor of two and four parts over Gloo. Each part
// holds only its share of every layer; clients attached to different parts train and generate
// exactly as monolithic runs do, under each batching policy; bad part options are refused naming
// the flag; killing one part gives every client a clear error within the stated time and leaves no
// process behind, and stopping the launcher stops every part.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <fstream>
#include <thread>

#include "bench/process.h"
#include "client_runtime/inference/generator.h"
#include "tests/client_runtime/inference/generation_util.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;
constexpr double kTolerance = 1e-5;
// A sharded backward-input sums its parts' shares ([Rounds] in parts.h): the same fp32 sum in
// another order, as a GEMM library's blocking of the reduction would be. Through a few AdamW steps
// of an adapter on every layer that moved the gradients by up to 1.3e-5 of the largest (measured
// here). A forward keeps each column's whole reduction: generation holds kTolerance.
constexpr double kGradientTolerance = 5e-5;

using testing::start_parts;

std::string name_of(const std::string& preset) {
  std::string name;
  for (char c : preset) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return name;
}

TEST(ShardedExecutorTest, EachPartHoldsItsShareOfEveryLayerAndClientsSeeTheWholeModel) {
  EXPECT_FALSE(
      testing::start_executor(testing::make_checkpoint("tiny-llama"))->model().groups().back().activation.empty())
      << "a whole executor of Llama serves MLP blocks";
  for (const char* preset : {"tiny-llama", "tiny-gpt2"}) {
    const auto dir = testing::make_checkpoint(preset);
    const auto whole = testing::start_executor(dir);
    const uint64_t total = whole->stats().weight_bytes;
    for (const int count : {2, 4}) {
      auto parts = start_parts(dir, count);
      uint64_t sum = 0;
      for (const auto& part : parts) {
        const uint64_t held = part->stats().weight_bytes;
        sum += held;
        // Each part holds rows [out * r / n, out * (r + 1) / n) of each layer: within a row a layer of the even share.
        EXPECT_LE(held, total / count + total / 16) << preset << ", " << count << " parts";
        EXPECT_GE(held, total / count - total / 16) << preset << ", " << count << " parts";
        const auto client = testing::connect(*part);
        ASSERT_EQ(client->layers().size(), testing::connect(*whole)->layers().size());
        for (const auto& layer : client->layers()) {
          const auto& served = whole->model().layer(layer.id);
          EXPECT_EQ(layer.name, served.name);
          EXPECT_EQ(layer.in_features, served.in_features);
          EXPECT_EQ(layer.out_features, served.out_features);
        }
        // [MLP blocks]: none on a part, which holds a share of each MLP's intermediate features.
        for (const auto& group : client->groups()) EXPECT_TRUE(group.activation.empty()) << group.name;
      }
      EXPECT_EQ(sum, total) << preset << ", " << count << " parts";
    }
  }
}

// Clients attached to different parts fine-tune at once, each equal to its monolithic run:
// `per_part` tenants on each of the parts.
void clients_of_every_part_train_as_monolithic_runs_do(const std::string& preset, int count, const std::string& policy,
                                                       int per_part = 1) {
  const auto dir = testing::make_checkpoint(preset);
  const auto checkpoint = Checkpoint::open(dir);
  ExecutorOptions options;
  options.batching.policy = parse_batching_policy(policy);
  options.batching.lockstep_timeout = std::chrono::milliseconds(20);
  auto parts = start_parts(dir, count, options);
  struct Tenant {
    testing::TrainingRun split, mono;
    at::Tensor ids;
  };
  std::vector<Tenant> tenants;
  for (int i = 0; i < count * per_part; ++i) {
    ClientOptions client_options;
    client_options.transport = i % 2 == 0 ? "shm" : "tcp";
    const auto client = testing::connect(*parts[i % count], *checkpoint, client_options);
    LoraConfig config;  // every base layer, with gradients from the first step
    config.r = 4;
    config.target_modules = {"all-linear"};
    config.init_b_zero = false;
    const auto lora = testing::lora_adapter(config);
    tenants.push_back({testing::make_training_run(*checkpoint, client, lora, {}, 1e-3, 10 + i),
                       testing::make_training_run(*checkpoint, nullptr, lora, {}, 1e-3, 10 + i),
                       at::randint(200, {2, 10 + 3 * i}, at::kLong)});
  }
  std::vector<std::thread> threads;
  for (auto& tenant : tenants) {
    threads.emplace_back(
        [&tenant] { testing::expect_same_training(tenant.split, tenant.mono, tenant.ids, 3, kGradientTolerance); });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& part : parts) {
    EXPECT_EQ(part->stats().errors, 0u);
    EXPECT_GT(part->stats().requests, 0u);
  }
}

class ShardedTrainingTest : public ::testing::TestWithParam<std::tuple<std::string, int, std::string>> {};

TEST_P(ShardedTrainingTest, ClientsOfEveryPartTrainAsMonolithicRunsDo) {
  const auto& [preset, count, policy] = GetParam();
  clients_of_every_part_train_as_monolithic_runs_do(preset, count, policy);
}

// Three tenants a part, at different layers (their sequences differ in length): each part's
// batches, of one tenant or packed from several, computed with the other part's in its rounds.
TEST(ShardedTenantsTest, SeveralTenantsOfEachPartTrainAsMonolithicRunsDo) {
  clients_of_every_part_train_as_monolithic_runs_do("tiny-llama", 2, "none", 3);
  clients_of_every_part_train_as_monolithic_runs_do("tiny-gpt2", 2, "opportunistic", 3);
}

INSTANTIATE_TEST_SUITE_P(Parts, ShardedTrainingTest,
                         ::testing::Values(std::make_tuple("tiny-llama", 2, "none"),
                                           std::make_tuple("tiny-llama", 2, "lockstep"),
                                           std::make_tuple("tiny-llama", 2, "opportunistic"),
                                           std::make_tuple("tiny-llama", 4, "opportunistic"),
                                           std::make_tuple("tiny-gpt2", 2, "opportunistic"),
                                           std::make_tuple("tiny-gpt2", 4, "lockstep")),
                         [](const auto& info) {
                           return name_of(std::get<0>(info.param)) + "_" + std::to_string(std::get<1>(info.param)) +
                                  "_parts_" + std::get<2>(info.param);
                         });

// An inference tenant on one part generates what a monolithic run generates (tokens, sampled with
// seeds too, and every step's logits) while a fine-tuning tenant trains on the other.
class ShardedGenerationTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardedGenerationTest, GenerationOnOnePartEqualsMonolithicWhileAnotherPartsTenantTrains) {
  const auto dir = testing::make_checkpoint(GetParam());
  const auto checkpoint = Checkpoint::open(dir);
  auto parts = start_parts(dir, 2);
  auto run = testing::make_training_run(*checkpoint, testing::connect(*parts[0], *checkpoint),
                                        testing::lora_adapter(testing::test_lora()), {}, 1e-3, 5);
  testing::BackgroundTraining fine_tuning(run, at::randint(200, {2, 12}, at::kLong));
  const auto [split, mono] =
      testing::generate_split_and_monolithic(*checkpoint, testing::connect(*parts[1], *checkpoint));
  EXPECT_GT(fine_tuning.stop(), 0);
  testing::expect_same(split, mono, GetParam());
  for (const auto& part : parts) EXPECT_EQ(part->stats().errors, 0u);
}

INSTANTIATE_TEST_SUITE_P(Models, ShardedGenerationTest, ::testing::Values("tiny-llama", "tiny-gpt2"),
                         [](const auto& info) { return name_of(info.param); });

TEST(ShardedExecutorTest, BadPartOptionsAreRefusedNamingTheFlag) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  auto refused = [&](PartOptions parts) {
    ExecutorOptions options;
    options.parts = parts;
    return testing::error_of([&] { testing::start_executor(dir, options); });
  };
  EXPECT_NE(refused({.rank = 2, .world_size = 2, .rendezvous = "127.0.0.1:1"}).find("--rank"), std::string::npos);
  EXPECT_NE(refused({.rank = 0, .world_size = 0, .rendezvous = "127.0.0.1:1"}).find("--world-size"), std::string::npos);
  EXPECT_NE(refused({.rendezvous = "nowhere"}).find("--rendezvous must be HOST:PORT"), std::string::npos);
  // A part whose others never come gives up after its timeout, saying what it waited for.
  const auto started = std::chrono::steady_clock::now();
  const auto alone = refused({.rank = 1,
                              .world_size = 2,
                              .rendezvous = free_loopback_rendezvous(),
                              .timeout = std::chrono::milliseconds(1500)});
  EXPECT_NE(alone.find("rendezvous"), std::string::npos) << alone;
  EXPECT_NE(alone.find("part 1 of 2"), std::string::npos) << alone;
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(30));
}

// The launcher's exit status within `limit`, or -1 (and it is killed).
int exit_status_within(pid_t pid, std::chrono::milliseconds limit) {
  int status = 0;
  if (!testing::wait_until([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, limit)) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The stated time ([Lost part]): a killed part is noticed at its others' next collective, at once;
// each refuses its calls and stops within a second or so. 10 s leaves room on a loaded machine.
constexpr auto kStatedTime = std::chrono::seconds(10);

TEST(ShardedProcessesTest, KillingOnePartFailsEveryClientClearlyAndLeavesNoProcessBehind) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto logs = testing::temp_dir("sharded-kill");
  auto launched = testing::launch_parts(dir, {"--parts", "2", "--threads", "1"}, 2, logs);
  ASSERT_EQ(launched.endpoints.size(), 2u) << bench::read_file(logs / "err");
  ASSERT_EQ(launched.pids.size(), 2u);
  std::vector<std::shared_ptr<Client>> clients;
  for (const auto& [endpoint, transport] :
       {std::pair{launched.endpoints[0], "shm"}, {launched.endpoints[0], "tcp"}, {launched.endpoints[1], "tcp"}}) {
    ClientOptions options;
    options.endpoint = endpoint;
    options.transport = transport;
    options.reconnect_ms = 0;
    options.timeout_ms = 30000;
    clients.push_back(Client::connect(options));
  }
  const auto* up = clients[0]->find_layer("model.layers.0.mlp.up_proj");
  for (auto& client : clients) client->forward(*up, at::randn({3, up->in_features}), true);  // all served
  // Part 1 is killed: the third client's; the first two are part 0's, which survives it.
  const pid_t killed = launched.pids[1];
  ASSERT_EQ(::kill(killed, SIGKILL), 0);
  const auto started = std::chrono::steady_clock::now();
  for (size_t i = 0; i < clients.size(); ++i) {
    std::string error;
    testing::wait_until(
        [&] {
          error = testing::error_of([&] { clients[i]->forward(*up, at::randn({3, up->in_features}), true); });
          return error != "(no error)";
        },
        kStatedTime);
    EXPECT_LT(std::chrono::steady_clock::now() - started, kStatedTime) << "client " << i;
    if (i < 2) {  // the surviving part's clients hear why
      EXPECT_NE(error.find("part"), std::string::npos) << "client " << i << ": " << error;
      EXPECT_NE(error.find("stop"), std::string::npos) << "client " << i << ": " << error;
    }
    EXPECT_NE(error, "(no error)") << "client " << i;
  }
  // The surviving part stopped by itself (status 3: its parts were lost), so the launcher ended too.
  EXPECT_EQ(exit_status_within(launched.launcher, kStatedTime), 1) << bench::read_file(logs / "err");
  for (const pid_t pid : launched.pids) EXPECT_NE(::kill(pid, 0), 0) << "part " << pid << " is still there";
  EXPECT_NE(bench::read_file(logs / "err").find("lost another part"), std::string::npos);
}

TEST(ShardedProcessesTest, StoppingTheLauncherStopsEveryPartAndTheirClientsHearWhy) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto logs = testing::temp_dir("sharded-stop");
  auto launched = testing::launch_parts(dir, {"--parts", "2", "--threads", "1"}, 2, logs);
  ASSERT_EQ(launched.endpoints.size(), 2u) << bench::read_file(logs / "err");
  ClientOptions options;
  options.endpoint = launched.endpoints[1];
  options.reconnect_ms = 0;
  const auto client = Client::connect(options);
  const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
  client->forward(*up, at::randn({2, up->in_features}), true);
  ASSERT_EQ(::kill(launched.launcher, SIGTERM), 0);
  EXPECT_EQ(exit_status_within(launched.launcher, kStatedTime), 0) << bench::read_file(logs / "err");
  for (const pid_t pid : launched.pids) EXPECT_NE(::kill(pid, 0), 0) << "part " << pid << " is still there";
  const auto error = testing::error_of([&] { client->forward(*up, at::randn({2, up->in_features}), true); });
  EXPECT_NE(error.find("shut down"), std::string::npos) << error;
}

}  // namespace
}  // namespace symbiosis
