#include "transport/transport.h"

#include <c10/util/Exception.h>

#include <array>

#include "common/untrusted.h"

namespace symbiosis {

// Each transport's folder defines its plugin (transport/KIND/KIND_plugin.cpp).
namespace tcp {
extern const TransportPlugin kPlugin;
}
namespace shm {
extern const TransportPlugin kPlugin;
}
namespace cuda_ipc {
extern const TransportPlugin kPlugin;
}
namespace nccl {
extern const TransportPlugin kPlugin;
}

namespace {

struct Name {
  TransportKind kind;
  const char* name;
};
constexpr std::array<Name, 4> kNames{{{TransportKind::kTcp, "tcp"},
                                      {TransportKind::kShm, "shm"},
                                      {TransportKind::kCudaIpc, "cuda-ipc"},
                                      {TransportKind::kNccl, "nccl"}}};

}  // namespace

const char* transport_name(TransportKind kind) {
  for (const auto& n : kNames) {
    if (n.kind == kind) return n.name;
  }
  return "?";
}

std::optional<TransportKind> parse_transport(std::string_view name) {
  for (const auto& n : kNames) {
    if (name == n.name) return n.kind;
  }
  return std::nullopt;
}

const char* transport_names() { return "tcp, shm, cuda-ipc, nccl"; }

bool same_host(const proto::Placement& a, const proto::Placement& b) {
  return !a.host_id().empty() && a.host_id() == b.host_id();
}

StatusOr<TransportKind> choose_transport(const proto::Placement& client, const proto::Placement& executor,
                                         std::string_view asked, bool nccl_available) {
  const bool one_host = same_host(client, executor);
  const bool client_gpu = !client.gpu_uuid().empty();
  const bool executor_gpu = !executor.gpu_uuid().empty();
  const bool same_gpu = one_host && client_gpu && client.gpu_uuid() == executor.gpu_uuid();
  if (asked.empty() || asked == "auto") {
    if (!one_host) return TransportKind::kTcp;
    if (same_gpu) return TransportKind::kCudaIpc;
    if (client_gpu && executor_gpu && nccl_available) return TransportKind::kNccl;
    return TransportKind::kShm;
  }
  const auto kind = parse_transport(asked);
  if (!kind) {
    return Status(StatusCode::kFailedPrecondition,
                  "unknown transport '" + bounded(asked) + "' (expected auto, " + transport_names() + ")");
  }
  auto refuse = [&](const std::string& why) {
    return Status(StatusCode::kFailedPrecondition,
                  std::string("transport ") + transport_name(*kind) + " is not possible here: " + why);
  };
  if (*kind == TransportKind::kTcp) return *kind;
  if (!one_host && *kind != TransportKind::kNccl) {
    return refuse("the client is on another host (" + bounded(client.host_id()) + "); use tcp, or nccl from a GPU");
  }
  if (*kind == TransportKind::kCudaIpc && !same_gpu) {
    return refuse("it needs the client on the executor's GPU (" + executor.device() + " " + executor.gpu_uuid() +
                  "), but the client is on " + bounded(client.device()) + " " + bounded(client.gpu_uuid()));
  }
  if (*kind == TransportKind::kNccl) {
    if (!executor_gpu || !client_gpu || same_gpu) {
      return refuse("it needs the client and the executor on two different GPUs (client " + bounded(client.device()) +
                    ", executor " + executor.device() + ")");
    }
    if (!nccl_available) return refuse("this executor was built without NCCL");
  }
  return *kind;
}

const TransportPlugin& plugin(TransportKind kind) {
  // [Transports]: one row a transport.
  static const std::array<const TransportPlugin*, 4> kPlugins{&tcp::kPlugin, &shm::kPlugin, &cuda_ipc::kPlugin,
                                                              &nccl::kPlugin};
  for (const auto* p : kPlugins) {
    if (p->kind == kind) return *p;
  }
  TORCH_CHECK(false, "internal: no plugin for transport ", static_cast<int>(kind));
}

}  // namespace symbiosis
