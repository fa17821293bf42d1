#include "base_executor/front_door.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <random>

#include "common/cuda.h"
#include "transport/call_ring.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

constexpr auto kLivenessInterval = std::chrono::milliseconds(200);
constexpr auto kKeysInterval = std::chrono::seconds(1);
// How long a same-host client has to prove its placement after its Hello.
constexpr auto kProofWindow = std::chrono::seconds(10);
// The longest tenant name the executor keeps ([Untrusted input]).
constexpr size_t kMaxTenantBytes = 128;
// [Buffer budget]: what a client's control segment takes (every transport but tcp has one).
constexpr uint64_t kControlSegmentBytes = sizeof(shm::ControlBlock);
constexpr const char* kControlSegment = "a same-host client's control segment";
// At most this many handshakes wait for their proof, and local connections for their first
// message, so that nobody can make the executor hold state without end.
constexpr size_t kMaxPendingProofs = 256;

std::string random_token() {
  std::random_device random;
  std::string token(16, '\0');
  for (auto& c : token) c = static_cast<char>(random());
  return token;
}

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

void FrontDoor::handle_hello(proto::Hello hello, const std::string& key, const std::string& public_key) {
  auto precondition = [](std::string message) { return Status(StatusCode::kFailedPrecondition, std::move(message)); };
  if (hello.protocol_version() != wire::kProtocolVersion) {
    return refuse(key, 0,
                  precondition("client speaks protocol " + std::to_string(hello.protocol_version()) +
                               ", executor speaks " + std::to_string(wire::kProtocolVersion)),
                  false);
  }
  if (hello.tenant().size() > kMaxTenantBytes) {
    return refuse(key, 0,
                  {StatusCode::kInvalidArgument, "Hello.tenant of " + std::to_string(hello.tenant().size()) +
                                                     " bytes is over the limit of " + std::to_string(kMaxTenantBytes) +
                                                     " bytes"},
                  false);
  }
  if (keys_) {
    // [Admission]: with keys, a tenant is its key. Its Hello may repeat its key's name or say none;
    // another admitted key's name is an impersonation, and any other label gives way to the key's.
    const std::string& own = keys_->lookup(public_key).name;
    if (!hello.tenant().empty() && hello.tenant() != own) {
      if (keys_->admits_name(hello.tenant())) {
        return refuse(key, 0,
                      denied("refused: this client's Hello says tenant '" + hello.tenant() +
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
    return refuse(key, 0,
                  {StatusCode::kResourceExhausted,
                   "the executor serves its limit of " + std::to_string(options_.max_clients) +
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
  spdlog::info("client {} (tenant '{}'{}, {} on {}) connected", client.id, hello.tenant(),
               keys_ ? ", by its key" : "", transport_name(kind),
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

void FrontDoor::accept_local() {
  while (auto connection = listener_.accept()) {
    if (unproven_.size() >= kMaxPendingProofs) continue;  // closed at once: it may connect again later
    unproven_.push_back({std::move(connection), Clock::now() + kProofWindow});
  }
}

void FrontDoor::handle_proof(UniqueFd connection) {
  auto refuse_proof = [&](const std::string& why) {
    try {
      local::send(connection.get(), wire::error_envelope(0, denied(why), /*as_reply=*/false));
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
    return refuse(key, 0,
                  {StatusCode::kMalformed, "the local link takes RegisterBuffer, ShareSegments and NcclSetup"}, false);
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
    return refuse(key, r.request_id(),
                  {StatusCode::kMalformed,
                   "this client's calls go through its shared-memory control channel, not ZeroMQ"},
                  true);
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
  message_connection_ = frames[1].get(ZMQ_SRCFD);  // [Disconnected peers]
  if (!in_handshake_.empty()) std::erase(in_handshake_, message_connection_);  // [Connections in handshake]
  if (client != nullptr) client->connection = message_connection_;
  switch (env.body_case()) {
    case proto::Envelope::kHello:
      return handle_hello(std::move(*env.mutable_hello()), key, public_key);
    case proto::Envelope::kRequest:
      return handle_request(env.request(), client, frames, key);
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

void FrontDoor::forget(const std::string& key) {
  auto record = registry_.remove(key);
  if (!record) return;
  if (record->link) links_.erase(record->link.get());
  if (record->transport != TransportKind::kTcp) buffers_.give_back(kControlSegmentBytes);
  statistics_.client_left(record->id);
  scheduler_.post(ClientLeft{record->id});
  // Aborted there at once: nothing may wait on a client that is gone (NCCL kernels).
  teardown_.hand_over(std::move(record->channel));
}

Teardown::Teardown() : thread_([this] { run(); }) {}

Teardown::~Teardown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Teardown::hand_over(std::shared_ptr<Channel> channel) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    channels_.push_back(std::move(channel));
  }
  wake_.notify_one();
}

void Teardown::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || !channels_.empty(); });
    if (channels_.empty()) return;  // stopping, and nothing left
    auto channel = std::move(channels_.front());
    channels_.pop_front();
    lock.unlock();
    channel->abort();
    channel.reset();
    lock.lock();
  }
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
    note_bad_input("more than " + std::to_string(options_.max_handshakes) +
                   " connections in handshake at once: cut the oldest (max_handshakes; raise it with --max-handshakes)");
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
                           : "refused at the handshake a key not admitted (" + verdict.public_key.substr(0, 8) + "...)");
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
    if (options_.stats_interval_seconds > 0 && now - last_stats > std::chrono::seconds(options_.stats_interval_seconds)) {
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
