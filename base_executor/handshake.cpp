// The front door's handshake: a Hello checked (protocol, tenant, model hash, [Transport choice],
// room for a control segment), the same-host placement challenged ([Proven placement]), and the
// client admitted: its channel, its record and its Welcome with the layer table.
#include "base_executor/front_door.h"

#include <spdlog/spdlog.h>

#include <random>

#include "common/cuda.h"
#include "transport/call_ring.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

// The longest tenant name the executor keeps ([Untrusted input]).
constexpr size_t kMaxTenantBytes = 128;
constexpr const char* kControlSegment = "a same-host client's control segment";

std::string random_token() {
  std::random_device random;
  std::string token(16, '\0');
  for (auto& c : token) c = static_cast<char>(random());
  return token;
}

}  // namespace

const uint64_t FrontDoor::kControlSegmentBytes = sizeof(shm::ControlBlock);

void FrontDoor::handle_hello(proto::Hello hello, const std::string& key, const std::string& public_key) {
  auto precondition = [](std::string message) { return Status(StatusCode::kFailedPrecondition, std::move(message)); };
  if (hello.protocol_version() != wire::kProtocolVersion) {
    return refuse(key, 0,
                  precondition("client speaks protocol " + std::to_string(hello.protocol_version()) +
                               ", executor speaks " + std::to_string(wire::kProtocolVersion)),
                  false);
  }
  if (hello.tenant().size() > kMaxTenantBytes) {
    return refuse(
        key, 0,
        {StatusCode::kInvalidArgument, "Hello.tenant of " + std::to_string(hello.tenant().size()) +
                                           " bytes is over the limit of " + std::to_string(kMaxTenantBytes) + " bytes"},
        false);
  }
  if (keys_) {
    // [Admission]: with keys, a tenant is its key. Its Hello may repeat its key's name or say none;
    // another admitted key's name is an impersonation, and any other label gives way to the key's.
    const std::string& own = keys_->lookup(public_key).name;
    if (!hello.tenant().empty() && hello.tenant() != own) {
      if (keys_->admits_name(hello.tenant())) {
        return refuse(key, 0,
                      Status(StatusCode::kPermissionDenied,
                             "refused: this client's Hello says tenant '" + hello.tenant() +
                                 "', the name of another admitted key, but its key is '" + own +
                                 "'; with keys a tenant is named by its key (say tenant '" + own + "', or none)"),
                      false);
      }
      spdlog::info("a client with key '{}' says tenant '{}'; with keys a tenant is named by its key: '{}'", own,
                   bounded(hello.tenant(), 64), own);
    }
    hello.set_tenant(own);
  }
  if (!hello.expected_model_hash().empty() && hello.expected_model_hash() != model_.model_hash()) {
    // The checkpoint's directory name says which model this is (its path on the executor's host
    // stays there). The hash covers the weights' bytes: a fine-tuned base of the same shape differs.
    auto served = options_.model_dir.lexically_normal();
    if (served.filename().empty()) served = served.parent_path();
    return refuse(key, 0,
                  precondition("model mismatch: this executor serves model " + model_.model_hash() + " ('" +
                               served.filename().string() + "'), but the client's checkpoint is model " +
                               bounded(hello.expected_model_hash()) +
                               "; the model hash covers config.json and the weights' bytes, so the client must "
                               "open the very checkpoint the executor serves"),
                  false);
  }
  const auto chosen =
      choose_transport(hello.placement(), placement_, hello.transport(), plugin(TransportKind::kNccl).available());
  if (!chosen.is_ok()) return refuse(key, 0, chosen.status(), false);
  const TransportKind kind = chosen.value();
  if (kind != TransportKind::kTcp && !hello.control().empty() && hello.control() != "auto" &&
      hello.control() != "zmq") {
    return refuse(key, 0, precondition("unknown control '" + bounded(hello.control()) + "' (expected auto or zmq)"),
                  false);
  }
  if (registry_.seen(key)) forget(key);  // a second Hello starts the client afresh
  std::erase_if(pending_, [&](const auto& entry) { return entry.second.key == key; });
  if (registry_.size() + pending_.size() >= options_.max_clients) {
    return refuse(
        key, 0,
        {StatusCode::kResourceExhausted, "the executor serves its limit of " + std::to_string(options_.max_clients) +
                                             " clients (max_clients; raise it with --max-clients)"},
        false);
  }
  if (kind != TransportKind::kTcp) {
    if (auto room = buffers_.has_room(kControlSegmentBytes, kControlSegment); !room.is_ok()) {
      return refuse(key, 0, room, false);
    }
  }
  // [Proven placement]: a transport that shares memory on this host is given only to the process
  // that proves it runs here; NCCL between two hosts shares none.
  const bool shares_memory = kind == TransportKind::kShm || kind == TransportKind::kCudaIpc ||
                             (kind == TransportKind::kNccl && same_host(hello.placement(), placement_));
  if (!shares_memory) return admit(key, hello, kind, UniqueFd(), public_key);
  if (pending_.size() >= kMaxPendingProofs) {
    return refuse(key, 0, {StatusCode::kResourceExhausted, "too many placement proofs pending; try again"}, false);
  }
  auto token = random_token();
  proto::Envelope challenge;
  challenge.mutable_prove_host()->set_local_socket(listener_.name());
  challenge.mutable_prove_host()->set_token(token);
  pending_[std::move(token)] = {key, hello, kind, public_key, Clock::now() + kProofWindow};
  wire::send_to(router_, key, challenge);
}

void FrontDoor::admit(const std::string& key, const proto::Hello& hello, TransportKind kind, UniqueFd link,
                      const std::string& public_key) {
  std::shared_ptr<Channel> channel;
  ChannelContext context;
  context.client_id = registry_.next_id();
  context.device = model_.device();
  context.mps = placement_.mps();
  context.lane = hello.lane();
  auto& gpu_count = gpu_clients_[hello.placement().gpu_uuid()];
  if (!gpu_count) gpu_count = std::make_shared<std::atomic<int>>(0);
  context.gpu_clients = gpu_count;
  // [Buffer budget]: checked at the Hello, taken now (others may have taken it meanwhile). A client
  // proving its placement hears the refusal on its local link, where it waits.
  const uint64_t control_bytes = kind == TransportKind::kTcp ? 0 : kControlSegmentBytes;
  if (auto taken = buffers_.take(control_bytes, kControlSegment); !taken.is_ok()) {
    if (!link) return refuse(key, 0, taken, false);
    statistics_.record_error(taken.code());
    try {
      local::send(link.get(), wire::error_envelope(0, taken, /*as_reply=*/false));
    } catch (const std::exception&) {
      // It has gone already.
    }
    return;
  }
  try {
    channel = plugin(kind).make_channel(context);
  } catch (const std::exception& e) {
    buffers_.give_back(control_bytes);
    return refuse(key, 0, status_of_exception(e, StatusCode::kFailedPrecondition), false);
  }
  // Headers come over ZeroMQ for tcp, from another host, and when the client asks; otherwise
  // through the control segment, and the client's process (proven) is watched for its end.
  const bool zmq_control = !link || hello.control() == "zmq";
  if (zmq_control) channel->control_over_zmq(context_, replies_endpoint_, key);
  const int pid = zmq_control ? 0 : hello.placement().pid();
  if (kind == TransportKind::kCudaIpc && !(hello.placement().mps() && placement_.mps())) {
    spdlog::warn(
        "client {} (tenant '{}') shares {} with the executor without NVIDIA MPS ({} lacks it): every hand-off of GPU "
        "work between the two processes then costs a context switch (~300 us instead of ~14 us). To use MPS, {}",
        context.client_id, hello.tenant(), placement_.device(), placement_.mps() ? "the client" : "the executor",
        cuda::mps_hint());
  }
  if (link) {
    proto::Envelope proven;
    std::vector<int> descriptors;
    UniqueFd wake_writer;  // [Wake sockets] (transport/call_ring.h): the client's alone; closed here once sent
    if (!zmq_control) {
      wake_writer = channel->take_wake_writer();
      descriptors = {channel->control_descriptor(), wake_writer.get()};
    }
    proven.mutable_proven()->set_descriptors(static_cast<uint32_t>(descriptors.size()));
    try {
      local::send(link.get(), proven, descriptors);
    } catch (const std::exception& e) {
      buffers_.give_back(control_bytes);
      return note_bad_input(std::string("a client left during its placement proof: ") + e.what());
    }
    links_[link.get()] = key;
  }
  auto& client = registry_.add(key, hello.tenant(), kind, pid, channel);
  if (!link) client.connection = message_connection_;  // its Hello's ([Disconnected peers])
  client.link = std::move(link);
  client.public_key = public_key;
  statistics_.client_joined(client.id, client.tenant, kind);
  scheduler_.post(ClientJoined{channel, keys_ ? hello.tenant() : std::string()});
  spdlog::info("client {} (tenant '{}'{}, {} on {}) connected", client.id, hello.tenant(), keys_ ? ", by its key" : "",
               transport_name(kind),
               hello.placement().device().empty() ? "?" : bounded(hello.placement().device(), 16));
  proto::Envelope reply;
  auto* welcome = reply.mutable_welcome();
  welcome->set_client_id(client.id);
  welcome->set_model_hash(model_.model_hash());
  welcome->set_max_request_bytes(options_.max_request_bytes);
  welcome->set_executor_version("symbiosis 0.2.0");
  welcome->set_transport(transport_name(kind));
  welcome->set_control_channel(!zmq_control);
  for (const auto& layer : model_.layers()) *welcome->add_layers() = wire::to_proto(layer);
  for (const auto& group : model_.groups()) *welcome->add_groups() = wire::to_proto(group);
  wire::send_to(router_, key, reply);
}

}  // namespace symbiosis
