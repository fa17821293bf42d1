// [Transport choice]: every placement of a client against an executor, asked "auto" or a named
// transport, gives the transport it should, or a refusal that says why.
#include "transport/transport.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

namespace symbiosis {
namespace {

proto::Placement placement(const std::string& host, const std::string& device, const std::string& gpu) {
  proto::Placement p;
  p.set_host_id(host);
  p.set_device(device);
  p.set_gpu_uuid(gpu);
  return p;
}

struct Row {
  const char* what;
  proto::Placement client;
  std::string asked;
  bool nccl;
  std::optional<TransportKind> expected;  // nullopt: refused
  const char* refusal = "";               // part of the refusal's message
};

TEST(ChooseTransport, EveryPlacementGetsItsTransportOrAReason) {
  const auto executor = placement("host-a", "cuda:0", "GPU-0");
  const auto cpu_here = placement("host-a", "cpu", "");
  const auto same_gpu = placement("host-a", "cuda:0", "GPU-0");
  const auto other_gpu = placement("host-a", "cuda:1", "GPU-1");
  const auto elsewhere = placement("host-b", "cpu", "");
  const auto gpu_elsewhere = placement("host-b", "cuda:0", "GPU-9");
  const auto no_host = placement("", "cpu", "");
  using K = TransportKind;
  const Row rows[] = {
      {"auto, cpu client here", cpu_here, "auto", true, K::kShm},
      {"empty means auto", cpu_here, "", true, K::kShm},
      {"auto, same gpu", same_gpu, "auto", true, K::kCudaIpc},
      {"auto, other gpu", other_gpu, "auto", true, K::kNccl},
      {"auto, other gpu without nccl", other_gpu, "auto", false, K::kShm},
      {"auto, other host", elsewhere, "auto", true, K::kTcp},
      {"auto, gpu on other host", gpu_elsewhere, "auto", true, K::kTcp},
      {"auto, no host id", no_host, "auto", true, K::kTcp},
      {"tcp anywhere", same_gpu, "tcp", true, K::kTcp},
      {"shm here", cpu_here, "shm", true, K::kShm},
      {"shm from a gpu here", other_gpu, "shm", true, K::kShm},
      {"shm from elsewhere", elsewhere, "shm", true, std::nullopt, "the client is on another host (host-b"},
      {"cuda-ipc on the same gpu", same_gpu, "cuda-ipc", true, K::kCudaIpc},
      {"cuda-ipc from another gpu", other_gpu, "cuda-ipc", true, std::nullopt,
       "needs the client on the executor's GPU (cuda:0 GPU-0), but the client is on cuda:1 GPU-1"},
      {"cuda-ipc from the cpu", cpu_here, "cuda-ipc", true, std::nullopt, "needs the client on the executor's GPU"},
      {"nccl from another gpu", other_gpu, "nccl", true, K::kNccl},
      {"nccl from a gpu elsewhere", gpu_elsewhere, "nccl", true, K::kNccl},
      {"nccl on the same gpu", same_gpu, "nccl", true, std::nullopt, "two different GPUs"},
      {"nccl from the cpu", cpu_here, "nccl", true, std::nullopt, "two different GPUs"},
      {"nccl without nccl", other_gpu, "nccl", false, std::nullopt, "built without NCCL"},
      {"unknown name", cpu_here, "carrier-pigeon", true, std::nullopt,
       "unknown transport 'carrier-pigeon' (expected auto, tcp, shm, cuda-ipc, nccl)"},
  };
  for (const auto& row : rows) {
    const auto chosen = choose_transport(row.client, executor, row.asked, row.nccl);
    if (row.expected) {
      ASSERT_TRUE(chosen.is_ok()) << row.what << ": " << chosen.status().message();
      EXPECT_EQ(chosen.value(), *row.expected) << row.what << ": got " << transport_name(chosen.value());
    } else {
      ASSERT_FALSE(chosen.is_ok()) << row.what << ": got " << transport_name(chosen.value());
      EXPECT_EQ(chosen.status().code(), StatusCode::kFailedPrecondition) << row.what;
      EXPECT_NE(chosen.status().message().find(row.refusal), std::string::npos)
          << row.what << ": " << chosen.status().message();
    }
  }
}

TEST(ChooseTransport, ACpuExecutorServesShmHereAndTcpElsewhere) {
  const auto executor = placement("host-a", "cpu", "");
  EXPECT_EQ(choose_transport(placement("host-a", "cpu", ""), executor, "auto", true).value(), TransportKind::kShm);
  EXPECT_EQ(choose_transport(placement("host-a", "cuda:0", "GPU-0"), executor, "auto", true).value(),
            TransportKind::kShm);
  EXPECT_EQ(choose_transport(placement("host-b", "cpu", ""), executor, "auto", true).value(), TransportKind::kTcp);
  const auto refused = choose_transport(placement("host-a", "cuda:0", "GPU-0"), executor, "nccl", true);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("two different GPUs"), std::string::npos) << refused.status().message();
}

TEST(TransportNames, RoundTripAndEveryKindHasAPlugin) {
  for (const auto kind : {TransportKind::kTcp, TransportKind::kShm, TransportKind::kCudaIpc, TransportKind::kNccl}) {
    EXPECT_EQ(parse_transport(transport_name(kind)), kind);
    EXPECT_EQ(plugin(kind).kind, kind);
    EXPECT_NE(plugin(kind).available, nullptr);
    EXPECT_NE(plugin(kind).make_channel, nullptr);
    EXPECT_NE(plugin(kind).make_client, nullptr);
  }
  EXPECT_EQ(parse_transport("auto"), std::nullopt);
  EXPECT_EQ(parse_transport("TCP"), std::nullopt);
}

// Each plug-in says whether it can serve here: tcp and shm always, nccl where NCCL is built in
// (the front door asks nccl's at the handshake, [Transport choice]).
TEST(TransportNames, EveryPluginSaysWhetherItIsAvailable) {
  EXPECT_TRUE(plugin(TransportKind::kTcp).available());
  EXPECT_TRUE(plugin(TransportKind::kShm).available());
#ifdef SYMBIOSIS_WITH_NCCL
  EXPECT_TRUE(plugin(TransportKind::kNccl).available());
#else
  EXPECT_FALSE(plugin(TransportKind::kNccl).available());
#endif
#ifndef SYMBIOSIS_WITH_CUDA
  EXPECT_FALSE(plugin(TransportKind::kCudaIpc).available());
#endif
}

}  // namespace
}  // namespace symbiosis
