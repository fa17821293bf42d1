// Clients on another GPU than the executor's (the `remote` placement) over NCCL: each equals its
// monolithic run (fp32 within 1e-5, bf16 within bf16 tolerance); NCCL, CUDA IPC and CPU clients
// (over shm and over TCP) share one executor, each exact; a remote client killed mid-iteration
// leaves the executor serving the others, with its communicator aborted and nothing leaked; call
// headers over ZeroMQ (as from another host) work too. Two nccl clients on one GPU take the path
// where the executor holds each reply until the result is computed ([NCCL readiness]); one alone,
// the path where it does not. The executor runs in this process on cuda:0, the clients as
// processes on cuda:1. Needs two GPUs; skipped elsewhere, saying so.
#include <signal.h>
#include <sys/wait.h>

#include "tests/gpu_test_util.h"
#include "transport/nccl/nccl_comm.h"

namespace symbiosis {
namespace {

class RemoteGpuClients : public ::testing::Test {
 protected:
  void start(const std::string& policy = "opportunistic", const std::string& dtype = "fp32") {
    dir_ = testing::make_checkpoint("tiny-llama");
    ExecutorOptions options;
    options.device = "cuda:0";
    options.dtype = parse_dtype_name(dtype);
    options.batching.policy = parse_batching_policy(policy);
    options.batching.lockstep_timeout = std::chrono::milliseconds(300);
    executor_ = testing::start_executor(dir_, options);
  }
  std::vector<std::string> client(const std::string& device, const std::string& transport,
                                  std::vector<std::string> extra) {
    return testing::demo_client(executor_->endpoint(), dir_, device, transport, extra);
  }
  std::filesystem::path dir_;
  std::unique_ptr<Executor> executor_;
};

#define SKIP_WITHOUT_NCCL()                                                               \
  SKIP_WITHOUT_GPUS(2);                                                                   \
  if (!nccl::nccl_available()) GTEST_SKIP() << "this build of symbiosis has no NCCL"

TEST_F(RemoteGpuClients, ANcclClientOnAnotherGpuEqualsItsMonolithicRun) {
  SKIP_WITHOUT_NCCL();
  start();
  EXPECT_TRUE(testing::run_all({client("cuda:1", "auto", {"--verify", "--steps", "4", "--tolerance", "1e-5",
                                                          "--rank", "8", "--targets", "all-linear"})}));
  EXPECT_EQ(executor_->stats().errors, 0u);
}

TEST_F(RemoteGpuClients, Bf16NcclClientsAreWithinBf16Tolerance) {
  SKIP_WITHOUT_NCCL();
  start("opportunistic", "bf16");
  const std::vector<std::string> bf16 = {"--verify", "--steps", "2", "--dtype", "bf16", "--tolerance", "5e-2"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), bf16.begin(), bf16.end());
    return extra;
  };
  EXPECT_TRUE(testing::run_all({client("cuda:1", "nccl", with({"--seed", "1"})),
                                client("cuda:1", "nccl", with({"--seed", "2", "--batch", "4"}))}));
}

// What a client on another host does (NCCL for the tensors, ZeroMQ for the headers), here from
// the second GPU of this host with control "zmq".
TEST_F(RemoteGpuClients, NcclWithHeadersOverZeroMQEqualsItsMonolithicRun) {
  SKIP_WITHOUT_NCCL();
  start();
  EXPECT_TRUE(testing::run_all({client("cuda:1", "nccl", {"--verify", "--steps", "3", "--tolerance", "1e-5",
                                                          "--control", "zmq", "--seed", "5"}),
                                client("cuda:1", "nccl", {"--verify", "--steps", "3", "--tolerance", "1e-5",
                                                          "--seed", "6", "--batch", "3"})}));
  EXPECT_EQ(executor_->stats().errors, 0u);
}

class MixedPlacements : public RemoteGpuClients, public ::testing::WithParamInterface<std::string> {};

TEST_P(MixedPlacements, NcclCudaIpcShmAndTcpClientsShareOneExecutorEachExact) {
  SKIP_WITHOUT_NCCL();
  start(GetParam());
  auto exact = [](std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--verify", "--steps", "4", "--tolerance", "1e-5"});
    return extra;
  };
  EXPECT_TRUE(testing::run_all({
      client("cuda:1", "nccl", exact({"--rank", "4", "--batch", "2", "--seq", "16", "--seed", "1"})),
      client("cuda:1", "nccl", exact({"--rank", "8", "--batch", "1", "--seq", "33", "--seed", "2"})),
      client("cuda:0", "cuda-ipc", exact({"--rank", "16", "--batch", "2", "--seq", "9", "--seed", "3"})),
      // A CPU client's reference is on the CPU: held to 1e-3 (see cuda_ipc_test.cpp, MixedTransports).
      client("cpu", "shm", {"--rank", "2", "--batch", "1", "--seq", "12", "--seed", "4", "--verify", "--steps", "4",
                            "--tolerance", "1e-3"}),
      client("cpu", "tcp", {"--rank", "4", "--batch", "2", "--seq", "7", "--seed", "5", "--verify", "--steps", "4",
                            "--tolerance", "1e-3"}),
  })) << "a client's split run differed from its monolithic run (see its output above)";
  EXPECT_EQ(executor_->stats().errors, 0u);
}

INSTANTIATE_TEST_SUITE_P(Policies, MixedPlacements, ::testing::Values("none", "lockstep", "opportunistic"));

TEST_F(RemoteGpuClients, ARemoteClientKilledMidIterationLeavesTheOthersServedAndNothingLeaked) {
  SKIP_WITHOUT_NCCL();
  start();
  ASSERT_TRUE(testing::run_all({client("cuda:1", "nccl", {"--steps", "2"})}));  // warm-up
  ASSERT_TRUE(testing::same_host_clients_become(*executor_, 0));
  const size_t used_before = testing::gpu_memory_used(0);
  for (int round = 0; round < 2; ++round) {
    // The victim first: a bystander started beside it can finish before the victim has connected.
    const pid_t victim = testing::spawn(client("cuda:1", "nccl", {"--steps", "100000", "--seq", "64"}));
    ASSERT_TRUE(testing::same_host_clients_become(*executor_, 1));
    const pid_t bystander =
        testing::spawn(client("cpu", "shm", {"--verify", "--steps", "12", "--seed", "9", "--tolerance", "1e-3"}));
    ASSERT_TRUE(testing::same_host_clients_become(*executor_, 2));
    const auto requests = executor_->stats().requests;
    ASSERT_TRUE(testing::requests_reach(*executor_, requests, 150)) << "the victim stopped calling before it was killed";
    kill(victim, SIGKILL);
    waitpid(victim, nullptr, 0);
    EXPECT_TRUE(testing::exited_ok(bystander)) << "a client beside the killed one failed or differed";
    EXPECT_TRUE(testing::same_host_clients_become(*executor_, 0)) << "the executor still holds the dead client";
  }
  EXPECT_TRUE(testing::run_all({client("cuda:1", "nccl", {"--verify", "--steps", "3", "--tolerance", "1e-5"})}));
  ASSERT_TRUE(testing::same_host_clients_become(*executor_, 0));
  const size_t bound = used_before + (size_t{64} << 20);
  const size_t used_after = testing::gpu_memory_used_settled(0, bound, std::chrono::seconds(10));
  EXPECT_LE(used_after, bound)
      << "executor GPU memory in use grew from " << used_before << " to " << used_after << " bytes";
}

}  // namespace
}  // namespace symbiosis
