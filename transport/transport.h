#pragma once
// [Transports] How one call's tensors travel between a client and the executor. Each transport is
// a folder of its own holding both of its ends (transport/tcp/, shm/, cuda_ipc/, nccl/), behind
// the two interfaces every transport fills:
//  - the executor's end, a Channel (transport/channel.h): one per client, owned by the
//    executor's scheduler; it reads a call's input where it lies and puts the result where the
//    client reads it;
//  - the client's end, a ClientTransport (transport/client_transport.h): one per Client; it
//    sends a call and returns its result.
// plugin(kind) finds both; a new transport is a new folder and one row in transport.cpp's table.
//
//  - tcp: header and payload in ZeroMQ frames (another host, or any client that asks).
//  - shm: a host shared-memory payload buffer (CPU clients on the executor's host).
//  - cuda-ipc: the client's GPU memory, mapped by the executor through CUDA IPC (clients on the
//    executor's GPU).
//  - nccl: a 2-rank NCCL communicator (GPU clients on another GPU, of this host or another).
// Calls of shm, cuda-ipc and nccl clients carry their headers through the shared-memory control
// channel ([Shared-memory control channel] in transport/call_ring.h) on the executor's host, or
// over ZeroMQ from another host.
#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "symbiosis.pb.h"

namespace symbiosis {

enum class TransportKind { kTcp, kShm, kCudaIpc, kNccl };

// The wire name ("tcp", "shm", "cuda-ipc", "nccl") of a kind, and back (nullopt for another name).
const char* transport_name(TransportKind kind);
std::optional<TransportKind> parse_transport(std::string_view name);
// "tcp, shm, cuda-ipc, nccl": for messages.
const char* transport_names();

// [Transport choice]
// A client names a transport or asks for "auto" (or ""). Auto picks by where the client runs (its
// Hello's Placement) against where the executor runs: another host, tcp; the same host and the
// executor's own GPU (same GPU UUID), cuda-ipc; another GPU of this host with NCCL built in,
// nccl; else (a CPU client of this host) shm. A named transport that the placement cannot support
// is refused with the reason (kFailedPrecondition). nccl also reaches a GPU client on another host
// (NCCL's network transport), which asks for it by name. Pure: a table-driven test covers it.
StatusOr<TransportKind> choose_transport(const proto::Placement& client, const proto::Placement& executor,
                                         std::string_view asked, bool nccl_available);
// Whether the two placements name the same host (a non-empty host id, equal).
bool same_host(const proto::Placement& a, const proto::Placement& b);

class Channel;
class ClientTransport;
class ControlSocket;

// What the executor tells a transport's factory about the client it makes a channel for.
struct ChannelContext {
  uint64_t client_id = 0;
  at::Device device{at::kCPU};  // the executor's
  // nccl: how many nccl channels serve the client's GPU (the executor keeps one count per GPU);
  // a channel counts itself while it lives ([NCCL readiness] in transport/nccl/nccl_channel.cpp).
  std::shared_ptr<std::atomic<int>> gpu_clients;
  bool mps = false;   // whether NVIDIA MPS serves the executor (its placement, asked once at its start)
  uint32_t lane = 0;  // the client's Hello.lane ([Decode halves])
};

// What a client's end needs of the Client's options.
struct ClientEndOptions {
  at::Device device{at::kCPU};  // where the client's tensors live
  int spin_us = -1;             // [Spin, then sleep]; -1: by device
  bool direct_operands = true;  // cuda-ipc: [Direct operands]
};

// One transport's two ends.
struct TransportPlugin {
  TransportKind kind;
  // Whether the transport can serve here (cuda-ipc: CUDA is built in and a GPU is visible; nccl:
  // NCCL is built in), asked at the handshake ([Transport choice]). Never throws.
  bool (*available)();
  // The executor's end for a new client. Throws naming the problem (e.g. no CUDA in this build).
  std::shared_ptr<Channel> (*make_channel)(const ChannelContext& context);
  // The client's end, after the Welcome named this transport. Throws naming the problem.
  std::unique_ptr<ClientTransport> (*make_client)(ControlSocket& socket, const proto::Welcome& welcome,
                                                  const ClientEndOptions& options);
};

const TransportPlugin& plugin(TransportKind kind);

}  // namespace symbiosis
