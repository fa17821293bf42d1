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
#include "tests/transport/hostile_gpu_tenant.h"
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

#define SKIP_WITHOUT_NCCL() \
  SKIP_WITHOUT_GPUS(2);     \
  if (!nccl::nccl_available()) GTEST_SKIP() << "this build of symbiosis has no NCCL"

TEST_F(RemoteGpuClients, ANcclClientOnAnotherGpuEqualsItsMonolithicRun) {
  SKIP_WITHOUT_NCCL();
  start();
  EXPECT_TRUE(testing::run_all(
      {client("cuda:1", "auto",
              {"--verify", "--steps", "4", "--tolerance", "1e-5", "--rank", "8", "--targets", "all-linear"})}));
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
  EXPECT_TRUE(testing::run_all(
      {client("cuda:1", "nccl", {"--verify", "--steps", "3", "--tolerance", "1e-5", "--control", "zmq", "--seed", "5"}),
       client("cuda:1", "nccl", {"--verify", "--steps", "3", "--tolerance", "1e-5", "--seed", "6", "--batch", "3"})}));
  EXPECT_EQ(executor_->stats().errors, 0u);
}

class MixedPlacements : public RemoteGpuClients, public ::testing::WithParamInterface<std::string> {};

TEST_P(MixedPlacements, NcclCudaIpcShmAndTcpClientsShareOneExecutorEachExact) {
  SKIP_WITHOUT_NCCL();
  start(GetParam());
  // Losses to 1e-5; adapters to 1e-4, as in gpu_executor_test: while the GPU is stalled, the honest
  // tenants' calls queue up and run packed together, and a packed fp32 GEMM's rows may round apart
  // from a lone one's (seen: 1.02e-5 after 4 steps).
  auto exact = [](std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--verify", "--steps", "4", "--tolerance", "1e-5", "--adapter-tolerance", "1e-4"});
    return extra;
  };
  EXPECT_TRUE(testing::run_all({
      client("cuda:1", "nccl", exact({"--rank", "4", "--batch", "2", "--seq", "16", "--seed", "1"})),
      client("cuda:1", "nccl", exact({"--rank", "8", "--batch", "1", "--seq", "33", "--seed", "2"})),
      client("cuda:0", "cuda-ipc", exact({"--rank", "16", "--batch", "2", "--seq", "9", "--seed", "3"})),
      // A CPU client's reference is on the CPU: held to 1e-3 (see cuda_ipc_test.cpp, MixedTransports).
      client("cpu", "shm",
             {"--rank", "2", "--batch", "1", "--seq", "12", "--seed", "4", "--verify", "--steps", "4", "--tolerance",
              "1e-3"}),
      client("cpu", "tcp",
             {"--rank", "4", "--batch", "2", "--seq", "7", "--seed", "5", "--verify", "--steps", "4", "--tolerance",
              "1e-3"}),
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
    ASSERT_TRUE(testing::requests_reach(*executor_, requests, 150))
        << "the victim stopped calling before it was killed";
    kill(victim, SIGKILL);
    waitpid(victim, nullptr, 0);
    EXPECT_TRUE(testing::exited_ok(bystander)) << "a client beside the killed one failed or differed";
    EXPECT_TRUE(testing::same_host_clients_become(*executor_, 0)) << "the executor still holds the dead client";
  }
  EXPECT_TRUE(testing::run_all({client("cuda:1", "nccl", {"--verify", "--steps", "3", "--tolerance", "1e-5"})}));
  ASSERT_TRUE(testing::same_host_clients_become(*executor_, 0));
  const size_t bound = used_before + (size_t{64} << 20);
  const size_t used_after = testing::gpu_memory_used_settled(0, bound, std::chrono::seconds(10));
  EXPECT_LE(used_after, bound) << "executor GPU memory in use grew from " << used_before << " to " << used_after
                               << " bytes";
}

// Issue 44, its GPU half ([Hostile GPU tenants] in tests/transport/hostile_gpu_tenant.cpp): an
// nccl tenant on cuda:1 sends a call's input and never posts the receive of its result (one too
// large for NCCL to buffer; then it sends another input), pushes a call and never sends its input,
// or aborts its communicator under a send and exits. Each stalls the executor's GPU until it is
// dropped ([NCCL transfer watchdog] in transport/nccl/nccl_channel.cpp: the first two while the
// tenant stays, the reason in the log); honest tenants beside it (nccl on cuda:1, cuda-ipc on
// cuda:0, a CPU tenant over shm, and one more CPU tenant that comes during the stall), fine-tuning
// with --verify against their monolithic runs, still finish exact; the executor serves a new nccl
// tenant exactly afterwards.
class HostileNcclTenant : public RemoteGpuClients, public ::testing::WithParamInterface<std::string> {
 protected:
  // Before log_ goes: the executor's threads log into it.
  void TearDown() override { testing::end_executor(executor_, log_, HasFailure()); }
  testing::ExecutorLog log_;
};

TEST_P(HostileNcclTenant, HonestTenantsFinishExactAndTheAttackerIsDroppedWithAReason) {
  SKIP_WITHOUT_NCCL();
  const std::string attack = GetParam();
  ASSERT_TRUE(std::filesystem::exists(testing::hostile_tenant_binary()))
      << testing::hostile_tenant_binary() << " is missing: build the target hostile_gpu_tenant (and carry it)";
  start();
  // A tenant that withholds its side of a transfer stays until the executor has dropped it, so
  // that the drop is the executor's doing, not its leaving.
  const bool withholds = attack != "abort-mid-transfer";
  testing::HostileTenant attacker(executor_->endpoint(), attack,
                                  withholds ? std::vector<std::string>{"--hold", "600"} : std::vector<std::string>{});
  ASSERT_TRUE(attacker.ready()) << "the hostile tenant could not set up (its output is above)";
  // Losses to 1e-5; adapters to 1e-4, as in gpu_executor_test: while the GPU is stalled, the honest
  // tenants' calls queue up and run packed together, and a packed fp32 GEMM's rows may round apart
  // from a lone one's (seen: 1.02e-5 after 4 steps).
  auto exact = [](std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--verify", "--steps", "4", "--tolerance", "1e-5", "--adapter-tolerance", "1e-4"});
    return extra;
  };
  const auto requests = executor_->stats().requests;
  const std::vector<pid_t> honest = {
      testing::spawn(client("cuda:1", "nccl", exact({"--seed", "1", "--tenant", "honest-nccl"}))),
      testing::spawn(client("cuda:0", "cuda-ipc", exact({"--seed", "2", "--tenant", "honest-ipc"}))),
      // A CPU client's reference is on the CPU: held to 1e-3 (see cuda_ipc_test.cpp, MixedTransports).
      testing::spawn(client(
          "cpu", "shm", {"--verify", "--steps", "4", "--seed", "3", "--tolerance", "1e-3", "--tenant", "honest-shm"})),
  };
  // The attack comes once the honest tenants call (what the test asserts holds either way).
  EXPECT_TRUE(testing::requests_reach(*executor_, requests, 50)) << "the honest tenants did not start calling";
  attacker.attack();
  EXPECT_TRUE(attacker.attacked()) << "the hostile tenant did not make its attack (its output is above)";
  // One more comes while the withheld transfer stalls the executor's GPU: it joins (its buffer
  // registered and pinned), trains and leaves then, and must wait, not fail.
  std::optional<pid_t> late;
  if (withholds) {
    late = testing::spawn(client(
        "cpu", "shm", {"--verify", "--steps", "3", "--seed", "5", "--tolerance", "1e-3", "--tenant", "honest-late"}));
  }
  for (const pid_t pid : honest) {
    EXPECT_TRUE(testing::exited_ok(pid)) << "an honest tenant failed or left its monolithic run beside " << attack;
  }
  if (late) {
    EXPECT_TRUE(testing::exited_ok(*late)) << "an honest tenant that came during the stall failed or left its "
                                              "monolithic run";
  }
  const uint64_t id = log_.client_id("hostile-" + attack);
  EXPECT_GT(id, 0u) << "the executor's log has no line of the hostile tenant connecting";
  if (withholds) {
    // Dropped while it stays: its transfer waited past the watchdog's limit (10 s).
    EXPECT_TRUE(
        testing::wait_until([&] { return executor_->stats().same_host_clients == 0; }, std::chrono::seconds(60)))
        << "the executor still holds the tenant that withholds its transfer";
    EXPECT_TRUE(attacker.alive()) << "the hostile tenant left before the executor dropped it";
    EXPECT_NE(log_.drop_reason(id).find("[NCCL transfer watchdog]"), std::string::npos)
        << "the executor's log says of client " << id << ": " << log_.drop_reason(id);
    attacker.end(SIGKILL);
  } else {
    EXPECT_EQ(attacker.wait(), 0) << "the hostile tenant's attack went otherwise (its output is above)";
    EXPECT_TRUE(testing::same_host_clients_become(*executor_, 0)) << "the executor still holds the hostile tenant";
    EXPECT_NE(log_.drop_reason(id), "") << "the executor's log does not say why client " << id << " went";
  }
  EXPECT_TRUE(testing::run_all({client("cuda:1", "nccl", exact({"--seed", "4", "--tenant", "after"}))}))
      << "the executor did not serve a new tenant exactly after " << attack;
  EXPECT_TRUE(testing::same_host_clients_become(*executor_, 0));
}

INSTANTIATE_TEST_SUITE_P(Attacks, HostileNcclTenant,
                         // An attack that wedges the executor ends the test binary's use of the GPU:
                         // the one seen to do so (issue 44) comes last.
                         ::testing::Values("abort-mid-transfer", "no-send", "no-receive"), [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace symbiosis
