// The front door's loop and its dispatch: every ZeroMQ message framed, parsed and handed to the
// handshake (handshake.cpp), the scheduler or an operator's answer; the local socket's proofs and
// links (local_links.cpp); connections and liveness (connections.cpp); keys reloaded; the
// [Shutdown notice].
#include "base_executor/front_door.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <chrono>

#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

constexpr auto kLivenessInterval = std::chrono::milliseconds(200);
constexpr auto kKeysInterval = std::chrono::seconds(1);

Status denied(std::string message) { return {StatusCode::kPermissionDenied, std::move(message)}; }

// What a peer whose key is not (or no longer) admitted is told.
Status refusal_of(Role role) {
  return denied(role == Role::kRevoked ? "refused: this client's key was revoked"
                                       : "refused: this client's key is not admitted here");
}

}  // namespace

FrontDoor::FrontDoor(const ExecutorOptions& options, const BaseModel& model, proto::Placement placement,
                     Scheduler& scheduler, Statistics& statistics, BufferBudget& buffers, zmq::context_t& context,
                     const std::string& replies_endpoint)
    : options_(options),
      model_(model),
      placement_(std::move(placement)),
      scheduler_(scheduler),
      statistics_(statistics),
      buffers_(buffers),
      context_(context),
      replies_endpoint_(replies_endpoint),
      router_(context, zmq::socket_type::router),
      connection_events_(context, zmq::socket_type::pair),
      replies_in_(context, zmq::socket_type::pull) {
  router_.set(zmq::sockopt::linger, 0);
  // [Overload]: a peer that never reads its replies holds at most max_queued_messages of them here;
  // past that the ROUTER drops its replies (no ROUTER_MANDATORY). A frame larger than any call may
  // carry drops its sender's connection before it is read.
  router_.set(zmq::sockopt::sndhwm, options.max_queued_messages);
  router_.set(zmq::sockopt::rcvhwm, options.max_queued_messages);
  router_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(options.message_limit()));
  // [Admission]: a connection that has not finished its handshake by then is dropped.
  router_.set(zmq::sockopt::handshake_ivl, static_cast<int>(kHandshakeInterval.count()));
  if (!options.keys_dir.empty()) {
    keys_ = std::make_unique<Keys>(options.keys_dir);
    zap_ = std::make_unique<ZapHandler>(context);
    serve_with_keys(router_, *keys_);
  }
  try {
    router_.bind(options.listen);
  } catch (const zmq::error_t& e) {
    TORCH_CHECK(false, "cannot listen on ", options.listen, ": ", e.what());
  }
  endpoint_ = router_.get(zmq::sockopt::last_endpoint);
  replies_in_.bind(replies_endpoint_);
  // [Disconnected peers]
  const std::string monitor = replies_endpoint_ + "-connections";
  if (zmq_socket_monitor(router_.handle(), monitor.c_str(), ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) != 0) {
    TORCH_CHECK(false, "cannot watch the executor's connections: ", zmq_strerror(zmq_errno()));
  }
  connection_events_.connect(monitor);
  if (keys_) {
    spdlog::info("admitting tenants by key from {}; traffic is encrypted (CURVE)", options.keys_dir.string());
  } else {
    spdlog::warn("no keys: any process that can reach {} may use this executor, and traffic is not encrypted{}",
                 endpoint_, options.insecure ? " (--insecure)" : " (loopback only)");
  }
}

void FrontDoor::refuse(const std::string& key, uint64_t request_id, const Status& status, bool as_reply) {
  const auto* client = registry_.find(key);
  statistics_.record_error(status.code(), client != nullptr ? client->id : 0);
  spdlog::debug("error to client: {}", bounded(status.message(), 200));
  wire::send_to(router_, key, wire::error_envelope(request_id, status, as_reply));
}

void FrontDoor::note_bad_input(const std::string& line) {
  uint64_t held_back = 0;
  const bool write = log_budget_.take(&held_back);
  if (held_back > 0) spdlog::warn("{} more lines about bad input were held back", held_back);
  if (write) spdlog::warn("{}", line);
}

void FrontDoor::handle_request(const proto::Request& r, ClientRecord* client, std::vector<zmq::message_t>& frames,
                               const std::string& key) {
  if (client == nullptr) {
    return refuse(key, r.request_id(),
                  {StatusCode::kFailedPrecondition,
                   "request " + std::to_string(r.request_id()) + " before the handshake: send Hello first"},
                  true);
  }
  const auto& channel = client->channel;
  if (!channel->zmq_control()) {
    return refuse(
        key, r.request_id(),
        {StatusCode::kMalformed, "this client's calls go through its shared-memory control channel, not ZeroMQ"}, true);
  }
  if (!channel->payload_in_frames() && frames.size() != 2) {
    return refuse(key, r.request_id(),
                  {StatusCode::kMalformed,
                   std::string("a ") + channel->kind_name() + " client's request carries no payload frame"},
                  true);
  }
  CallArrived call{channel, wire::call_header(r), {r.shape().begin(), r.shape().end()}, {}};
  for (size_t i = 2; i < frames.size(); ++i) call.frames.push_back(std::move(frames[i]));
  // [Overload]: refused here, before it waits in the scheduler's inbox, when the queue is full.
  if (auto posted = scheduler_.post_call(std::move(call)); !posted.is_ok()) refuse(key, r.request_id(), posted, true);
}

void FrontDoor::handle(std::vector<zmq::message_t>& frames) {
  const std::string key(static_cast<const char*>(frames[0].data()), frames[0].size());
  if (frames.size() < 2) return refuse(key, 0, {StatusCode::kMalformed, "message has no header frame"}, false);
  // [Admission]: without keys, whoever can connect may do anything (loopback only, or --insecure).
  Role role = Role::kOperator;
  const std::string public_key = keys_ ? peer_key(frames[1]) : "";
  if (keys_) {
    role = keys_->lookup(public_key).role;
    if (role == Role::kUnknown || role == Role::kRevoked) {
      if (registry_.find(key) != nullptr) forget(key);
      note_bad_input("refused a peer whose key " + public_key.substr(0, 8) + "... is " +
                     (role == Role::kRevoked ? "revoked" : "not admitted"));
      return refuse(key, 0, refusal_of(role), false);
    }
  }
  proto::Envelope env;
  if (!wire::parse(frames[1], &env)) {
    note_bad_input("a header frame of " + std::to_string(frames[1].size()) + " bytes that does not parse");
    return refuse(key, 0,
                  {StatusCode::kMalformed,
                   "header frame of " + std::to_string(frames[1].size()) + " bytes is not a symbiosis Envelope"},
                  false);
  }
  ClientRecord* client = registry_.seen(key);
  message_connection_ = frames[1].get(ZMQ_SRCFD);                              // [Disconnected peers]
  if (!in_handshake_.empty()) std::erase(in_handshake_, message_connection_);  // [Connections in handshake]
  if (client != nullptr) client->connection = message_connection_;
  switch (env.body_case()) {
    case proto::Envelope::kHello: return handle_hello(std::move(*env.mutable_hello()), key, public_key);
    case proto::Envelope::kRequest: return handle_request(env.request(), client, frames, key);
    case proto::Envelope::kRegisterBuffer:
    case proto::Envelope::kShareSegments:
    case proto::Envelope::kNcclSetup:
      // [Proven placement]: a same-host client's set-up comes on its local link; over ZeroMQ only
      // an nccl client's from another host, which shares no memory.
      if (client == nullptr || client->link || !env.has_nccl_setup() || client->transport != TransportKind::kNccl) {
        return refuse(key, 0,
                      {StatusCode::kFailedPrecondition,
                       "payload set-up over ZeroMQ: a same-host client sends it on its proven local link, and only an "
                       "nccl client from another host sends NcclSetup here"},
                      false);
      }
      return scheduler_.post(SetupArrived{client->channel, std::move(env), key, {}});
    case proto::Envelope::kGoodbye:
      if (client != nullptr) {
        spdlog::info("client {} (tenant '{}') left", client->id, client->tenant);
        forget(key);
      }
      return;
    case proto::Envelope::kStatsRequest: {
      if (role != Role::kOperator) {
        return refuse(key, 0, denied("refused: statistics are for operators, and this client's key is a tenant's"),
                      false);
      }
      proto::Envelope reply;
      *reply.mutable_stats() = statistics_.snapshot();
      return wire::send_to(router_, key, reply);
    }
    case proto::Envelope::kTraceRequest:  // [Traces]: answered by the scheduler, where the batches run
      if (role != Role::kOperator) {
        return refuse(key, 0, denied("refused: traces are for operators, and this client's key is a tenant's"), false);
      }
      return scheduler_.post(TraceArrived{env.trace_request(), key});
    default:
      return refuse(key, 0,
                    {StatusCode::kMalformed,
                     "unexpected message: the executor takes Hello, Request, RegisterBuffer, ShareSegments, "
                     "NcclSetup, Goodbye, StatsRequest and TraceRequest"},
                    false);
  }
}

void FrontDoor::reload_keys() {
  if (!keys_ || !keys_->reload()) return;
  std::vector<std::pair<std::string, Role>> dropped;
  for (const auto& [key, record] : registry_.all()) {
    const Role role = keys_->lookup(record.public_key).role;
    if (role != Role::kTenant && role != Role::kOperator) dropped.emplace_back(key, role);
  }
  for (const auto& [key, role] : dropped) {
    const auto* client = registry_.find(key);
    spdlog::info("client {} (tenant '{}'): its key is {}; refusing its calls", client->id, client->tenant,
                 role == Role::kRevoked ? "revoked" : "no longer admitted");
    if (!client->link || client->channel->zmq_control()) {
      forget(key);  // its calls come through here, and are refused here
      continue;
    }
    // Its calls come through its control segment: the scheduler refuses them until it leaves.
    scheduler_.post(ClientRefused{client->id, refusal_of(role)});
  }
}

void FrontDoor::run() {
  auto last_stats = Clock::now();
  auto last_liveness = Clock::now();
  auto last_keys = Clock::now();
  // A message that slipped past the checks must not take the executor down.
  auto guarded = [&](const char* what, const std::string& key, auto&& work) {
    try {
      work();
    } catch (const std::exception& e) {
      note_bad_input(std::string("failed handling ") + what + ": " + bounded(e.what(), 200));
      if (!key.empty()) refuse(key, 0, status_of_exception(e, StatusCode::kInternal), false);
    }
  };
  std::vector<zmq::pollitem_t> items;
  std::vector<int> links;
  while (!stopping_) {
    // The sockets, then the local connections that have not proved yet, then the proven links.
    // Kept between turns, so that a turn (one per TCP call) allocates nothing.
    items.assign({{router_.handle(), 0, ZMQ_POLLIN, 0},
                  {replies_in_.handle(), 0, ZMQ_POLLIN, 0},
                  {nullptr, listener_.fd(), ZMQ_POLLIN, 0},
                  {connection_events_.handle(), 0, ZMQ_POLLIN, 0}});
    if (zap_) items.push_back({zap_->socket().handle(), 0, ZMQ_POLLIN, 0});
    const size_t first_unproven = items.size();
    for (const auto& u : unproven_) items.push_back({nullptr, u.connection.get(), ZMQ_POLLIN, 0});
    const size_t first_link = items.size();
    links.clear();
    for (const auto& [fd, key] : links_) {
      items.push_back({nullptr, fd, ZMQ_POLLIN, 0});
      links.push_back(fd);
    }
    zmq::poll(items.data(), items.size(), kLivenessInterval);
    auto ready = [&](size_t i) { return (items[i].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) != 0; };
    if (ready(0) || ready(3)) read_connection_events();  // before the message: [Disconnected peers]
    if (ready(0)) {
      auto frames = wire::recv_all(router_);
      const std::string key =
          frames.empty() ? "" : std::string(static_cast<const char*>(frames[0].data()), frames[0].size());
      guarded("a message", key, [&] { handle(frames); });
    }
    if (ready(1)) {
      auto frames = wire::recv_all(replies_in_);
      for (size_t i = 0; i < frames.size(); ++i) {
        router_.send(frames[i], i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
    }
    if (zap_ && ready(4)) {
      // [Admission]: refused in the handshake itself; counted, and logged within the log budget.
      const auto verdict = zap_->answer(*keys_);
      if (!verdict.admitted) {
        statistics_.record_error(StatusCode::kPermissionDenied);
        note_bad_input(verdict.public_key.empty() ? std::string("refused a handshake without a CURVE key")
                       : verdict.role == Role::kRevoked
                           ? "refused at the handshake the revoked key '" + keys_->lookup(verdict.public_key).name + "'"
                           : "refused at the handshake a key not admitted (" + verdict.public_key.substr(0, 8) +
                                 "...)");
      }
    }
    // Proofs and links, before new connections change the lists the items were made from.
    std::vector<UniqueFd> proving;
    for (size_t i = 0; i < first_link - first_unproven; ++i) {
      if (ready(first_unproven + i)) proving.push_back(std::move(unproven_[i].connection));
    }
    std::erase_if(unproven_, [](const Unproven& u) { return !u.connection; });
    for (auto& connection : proving) guarded("a placement proof", "", [&] { handle_proof(std::move(connection)); });
    for (size_t i = 0; i < links.size(); ++i) {
      if (!ready(first_link + i) || !links_.count(links[i])) continue;
      const std::string key = links_.at(links[i]);
      guarded("a set-up message", key, [&] { handle_link(links[i]); });
    }
    if (ready(2)) accept_local();
    const auto now = Clock::now();
    if (options_.stats_interval_seconds > 0 &&
        now - last_stats > std::chrono::seconds(options_.stats_interval_seconds)) {
      statistics_.log();
      last_stats = now;
    }
    if (now - last_liveness > kLivenessInterval) {
      check_liveness();
      last_liveness = now;
    }
    if (now - last_keys > kKeysInterval) {
      reload_keys();
      last_keys = now;
    }
  }
  tell_clients_goodbye();
}

// [Shutdown notice]: every client this executor knows hears that it stops, so that none waits out
// its call timeout for an answer that will not come. A same-host client hears it over ZeroMQ too
// (it looks there while it waits on its control segment). The router lingers long enough for the
// notices to leave; a peer already gone is dropped at once.
void FrontDoor::tell_clients_goodbye() {
  proto::Envelope notice;
  {
    std::lock_guard<std::mutex> lock(goodbye_mutex_);
    notice.mutable_shutting_down()->set_reason(goodbye_);
  }
  for (const auto& [key, record] : registry_.all()) {
    try {
      wire::send_to(router_, key, notice);
    } catch (const zmq::error_t& e) {
      spdlog::warn("could not tell client {} that the executor stops: {}", record.id, e.what());
    }
  }
  router_.set(zmq::sockopt::linger, 1000);
}

void FrontDoor::abort_clients() {
  for (const auto& [key, record] : registry_.all()) record.channel->abort();
}

}  // namespace symbiosis
