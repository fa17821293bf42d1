// The front door's hold on its clients' connections: forgetting a client (its channel torn down
// off the front door's thread), liveness, and the ROUTER's connection events ([Disconnected peers],
// [Connections in handshake]).
#include "base_executor/front_door.h"

#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <cstring>

namespace symbiosis {

void FrontDoor::forget(const std::string& key) {
  auto record = registry_.remove(key);
  if (!record) return;
  if (record->link) {
    links_.erase(record->link.get());
    if (record->channel) record->channel->close_link_when_gone(std::move(record->link));  // [Link closed last]
  }
  if (record->transport != TransportKind::kTcp) buffers_.give_back(kControlSegmentBytes);
  statistics_.client_left(record->id);
  scheduler_.post(ClientLeft{record->id});
  // Aborted there at once: nothing may wait on a client that is gone (NCCL kernels).
  teardown_.hand_over(std::move(record->channel));
}

void FrontDoor::check_liveness() {
  for (const auto& key : registry_.gone()) {
    const auto* client = registry_.find(key);
    spdlog::info("client {} (tenant '{}') is gone; releasing what it held", client->id, client->tenant);
    forget(key);
  }
  const auto now = Clock::now();
  std::erase_if(pending_, [&](const auto& entry) { return entry.second.deadline < now; });
  std::erase_if(unproven_, [&](const Unproven& u) { return u.deadline < now; });
}

// [Disconnected peers]
// A client whose ZeroMQ connection closes (killed, crashed, gone from the network) cannot be
// answered any more: a DEALER that connects again is a new peer with another routing id, and must
// say Hello again. So the front door forgets it when the ROUTER reports the connection closed
// (its monitor's DISCONNECTED, naming the descriptor), instead of waiting out the idle limit with
// its record counted against --max-clients. Each message's descriptor (ZMQ_SRCFD) says which
// connection a client is on. A descriptor is reused only after it is closed, and the monitor
// hears of the close first, so the events are read before each message: a late event never
// forgets the new peer of a reused descriptor. Same-host clients with a local link are watched
// by the link.
//
// [Connections in handshake]
// ZeroMQ caps no number of connections in handshake, and each may hold a frame of up to the
// executor's limit (message_limit: [Bounded frames] in transport/zmq_wire.h) until
// kHandshakeInterval drops it. So the front door counts them: a connection is in handshake from
// its ACCEPTED event until its first message is read (ZMQ_SRCFD) or it closes; past
// --max-handshakes the oldest is cut, by shutting its descriptor down (ZeroMQ, which owns it, sees
// the connection end and closes it). A stranger thus makes the executor hold at most
// max_handshakes frames of message_limit (256 x 1.06 MiB by default), and for no longer than the
// handshake interval; a flood of them slows honest newcomers (whose handshakes take milliseconds,
// and whose ZeroMQ sockets connect again when cut) but never reaches those admitted.
void FrontDoor::read_connection_events() {
  zmq::message_t event;
  while (connection_events_.recv(event, zmq::recv_flags::dontwait)) {
    zmq::message_t endpoint;  // the event's second frame
    while (event.more() && connection_events_.recv(endpoint, zmq::recv_flags::dontwait) && endpoint.more()) {
    }
    if (event.size() < 6) continue;
    uint16_t kind = 0;
    int32_t descriptor = -1;
    std::memcpy(&kind, event.data(), sizeof kind);
    std::memcpy(&descriptor, static_cast<const char*>(event.data()) + sizeof kind, sizeof descriptor);
    if (descriptor < 0) continue;
    if (kind == ZMQ_EVENT_ACCEPTED) {
      in_handshake_.push_back(descriptor);
      continue;
    }
    if (kind != ZMQ_EVENT_DISCONNECTED) continue;
    std::erase(in_handshake_, descriptor);
    std::vector<std::string> closed;
    for (const auto& [key, record] : registry_.all()) {
      if (record.connection == descriptor && !record.link) closed.push_back(key);
    }
    for (const auto& key : closed) {
      const auto* client = registry_.find(key);
      spdlog::info("client {} (tenant '{}') disconnected; releasing what it held", client->id, client->tenant);
      forget(key);
    }
  }
  // Every event read first, so that no descriptor cut here was closed and reused meanwhile.
  while (in_handshake_.size() > options_.max_handshakes) {
    ::shutdown(in_handshake_.front(), SHUT_RDWR);
    in_handshake_.pop_front();
    note_bad_input(
        "more than " + std::to_string(options_.max_handshakes) +
        " connections in handshake at once: cut the oldest (max_handshakes; raise it with --max-handshakes)");
  }
}

}  // namespace symbiosis
