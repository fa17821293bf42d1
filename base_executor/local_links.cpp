// [Proven placement] at the front door: connections to the local socket, each one's proof of the
// process its Hello named, and the set-up messages a proven client then sends on its link.
#include "base_executor/front_door.h"

#include <spdlog/spdlog.h>

#include "transport/zmq_wire.h"

namespace symbiosis {

void FrontDoor::accept_local() {
  while (auto connection = listener_.accept()) {
    if (unproven_.size() >= kMaxPendingProofs) continue;  // closed at once: it may connect again later
    unproven_.push_back({std::move(connection), Clock::now() + kProofWindow});
  }
}

void FrontDoor::handle_proof(UniqueFd connection) {
  auto refuse_proof = [&](const std::string& why) {
    try {
      local::send(connection.get(), wire::error_envelope(0, {StatusCode::kPermissionDenied, why}, /*as_reply=*/false));
    } catch (const std::exception&) {
      // It has gone already.
    }
    note_bad_input("placement proof refused: " + why);
  };
  auto message = local::receive(connection.get());
  if (!message.is_ok()) return refuse_proof(message.status().message());
  if (!message.value()) return;  // closed before proving
  const auto& env = message.value()->envelope;
  if (!env.has_prove()) return refuse_proof("the first message on the local socket must be Prove");
  const auto it = pending_.find(env.prove().token());
  if (it == pending_.end()) return refuse_proof("unknown or expired proof token");
  auto pending = std::move(it->second);
  pending_.erase(it);
  const auto peer = local::peer_credentials(connection.get());
  if (peer.pid != pending.hello.placement().pid()) {
    const std::string why = "the Hello named process " + std::to_string(pending.hello.placement().pid()) +
                            ", but process " + std::to_string(peer.pid) + " came to prove it";
    // Told on the local socket only: the client may go on over ZeroMQ with a Hello for tcp.
    statistics_.record_error(StatusCode::kPermissionDenied);
    return refuse_proof("same-host placement not proven: " + why);
  }
  admit(pending.key, pending.hello, pending.kind, std::move(connection), pending.public_key);
}

void FrontDoor::handle_link(int fd) {
  const std::string key = links_.at(fd);
  ClientRecord* client = registry_.seen(key);
  if (client == nullptr) {
    links_.erase(fd);
    return;
  }
  auto message = local::receive(fd);
  if (!message.is_ok() || !message.value()) {
    if (!message.is_ok()) note_bad_input("client's local link failed: " + message.status().message());
    spdlog::info("client {} (tenant '{}') closed its local link", client->id, client->tenant);
    return forget(key);
  }
  auto& [env, descriptors] = *message.value();
  const bool set_up = env.has_register_buffer() || env.has_share_segments() || env.has_nccl_setup();
  if (!set_up) {
    return refuse(key, 0, {StatusCode::kMalformed, "the local link takes RegisterBuffer, ShareSegments and NcclSetup"},
                  false);
  }
  const size_t expected = env.has_register_buffer() && client->transport == TransportKind::kShm ? 1 : 0;
  if (descriptors.size() != expected) {
    return refuse(key, 0,
                  {StatusCode::kMalformed, "a set-up message with " + std::to_string(descriptors.size()) +
                                               " descriptors (expected " + std::to_string(expected) + ")"},
                  false);
  }
  SetupArrived setup{client->channel, std::move(env), key, {}};
  if (expected == 1) setup.segment = std::move(descriptors[0]);
  scheduler_.post(std::move(setup));
}

}  // namespace symbiosis
