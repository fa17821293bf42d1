#include "base_executor/front_door.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <chrono>

#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/nccl/nccl_comm.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kLivenessInterval = std::chrono::milliseconds(200);

}  // namespace

FrontDoor::FrontDoor(const ExecutorOptions& options, const BaseModel& model, proto::Placement placement,
                     Scheduler& scheduler, Statistics& statistics, zmq::context_t& context,
                     const std::string& replies_endpoint)
    : options_(options),
      model_(model),
      placement_(std::move(placement)),
      scheduler_(scheduler),
      statistics_(statistics),
      context_(context),
      replies_endpoint_(replies_endpoint),
      router_(context, zmq::socket_type::router),
      replies_in_(context, zmq::socket_type::pull) {
  router_.set(zmq::sockopt::linger, 0);
  router_.set(zmq::sockopt::sndhwm, 0);
  try {
    router_.bind(options.listen);
  } catch (const zmq::error_t& e) {
    TORCH_CHECK(false, "cannot listen on ", options.listen, ": ", e.what());
  }
  endpoint_ = router_.get(zmq::sockopt::last_endpoint);
  replies_in_.bind(replies_endpoint_);
}

void FrontDoor::refuse(const std::string& key, uint64_t request_id, const Status& status, bool as_reply) {
  statistics_.errors++;
  spdlog::debug("error to client: {}", status.message());
  wire::send_to(router_, key, wire::error_envelope(request_id, status, as_reply));
}

void FrontDoor::handle_hello(const proto::Hello& hello, const std::string& key) {
  auto precondition = [](std::string message) { return Status(StatusCode::kFailedPrecondition, std::move(message)); };
  if (hello.protocol_version() != wire::kProtocolVersion) {
    return refuse(key, 0,
                  precondition("client speaks protocol " + std::to_string(hello.protocol_version()) +
                               ", executor speaks " + std::to_string(wire::kProtocolVersion)),
                  false);
  }
  if (!hello.expected_model_hash().empty() && hello.expected_model_hash() != model_.model_hash()) {
    return refuse(key, 0,
                  precondition("model mismatch: the client was built for model " + hello.expected_model_hash() +
                               ", but this executor serves model " + model_.model_hash() + " (" +
                               options_.model_dir.string() + ")"),
                  false);
  }
  const auto chosen =
      choose_transport(hello.placement(), placement_, hello.transport(), nccl::nccl_available());
  if (!chosen.is_ok()) return refuse(key, 0, chosen.status(), false);
  const TransportKind kind = chosen.value();
  if (kind != TransportKind::kTcp && !hello.control().empty() && hello.control() != "auto" &&
      hello.control() != "zmq") {
    return refuse(key, 0, precondition("unknown control '" + hello.control() + "' (expected auto or zmq)"), false);
  }
  if (registry_.seen(key)) forget(key);  // a second Hello starts the client afresh
  std::shared_ptr<Channel> channel;
  ChannelContext context;
  context.client_id = registry_.next_id();
  context.device = model_.device();
  auto& gpu_count = gpu_clients_[hello.placement().gpu_uuid()];
  if (!gpu_count) gpu_count = std::make_shared<std::atomic<int>>(0);
  context.gpu_clients = gpu_count;
  try {
    channel = plugin(kind).make_channel(context);
  } catch (const std::exception& e) {
    return refuse(key, 0, status_of_exception(e, StatusCode::kFailedPrecondition), false);
  }
  // Headers come over ZeroMQ for tcp, from another host, and when the client asks; otherwise
  // through the control segment, and the client's process is watched for its end.
  const bool zmq_control = kind == TransportKind::kTcp || !same_host(hello.placement(), placement_) ||
                           hello.control() == "zmq";
  if (zmq_control) channel->control_over_zmq(context_, replies_endpoint_, key);
  const int pid = zmq_control ? 0 : hello.placement().pid();
  if (kind == TransportKind::kCudaIpc && !(hello.placement().mps() && placement_.mps())) {
    spdlog::warn(
        "client {} (tenant '{}') shares {} with the executor without NVIDIA MPS ({} lacks it): every hand-off of GPU "
        "work between the two processes then costs a context switch (~300 us instead of ~14 us). To use MPS, {}",
        context.client_id, hello.tenant(), placement_.device(), placement_.mps() ? "the client" : "the executor",
        cuda::mps_hint());
  }
  auto& client = registry_.add(key, hello.tenant(), kind, pid, channel);
  statistics_.clients = registry_.size();
  if (kind != TransportKind::kTcp) statistics_.same_host_clients++;
  scheduler_.post(ClientJoined{channel});
  spdlog::info("client {} (tenant '{}', {} on {}) connected", client.id, hello.tenant(), transport_name(kind),
               hello.placement().device().empty() ? "?" : hello.placement().device());
  proto::Envelope reply;
  auto* welcome = reply.mutable_welcome();
  welcome->set_client_id(client.id);
  welcome->set_model_hash(model_.model_hash());
  welcome->set_max_request_bytes(options_.max_request_bytes);
  welcome->set_executor_version("symbiosis 0.2.0");
  welcome->set_transport(transport_name(kind));
  *welcome->mutable_placement() = placement_;
  if (!channel->zmq_control()) {
    welcome->set_control_segment(channel->control_segment());
    welcome->set_doorbell_segment(scheduler_.doorbell_segment());
  }
  for (const auto& layer : model_.layers()) *welcome->add_layers() = wire::to_proto(layer);
  for (const auto& group : model_.groups()) *welcome->add_groups() = wire::to_proto(group);
  wire::send_to(router_, key, reply);
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
  CallArrived call{channel, {}, {r.shape().begin(), r.shape().end()}, {}};
  auto& h = call.header;
  h.request_id = r.request_id();
  h.layer_id = r.layer_id();
  h.op = r.op();
  h.dtype = r.dtype();
  h.latency_class = r.latency_class();
  h.in_offset = r.in_offset();
  h.out_offset = r.out_offset();
  h.buffer_generation = r.buffer_generation();
  for (size_t i = 2; i < frames.size(); ++i) call.frames.push_back(std::move(frames[i]));
  scheduler_.post(std::move(call));
}

void FrontDoor::handle(std::vector<zmq::message_t>& frames) {
  const std::string key(static_cast<const char*>(frames[0].data()), frames[0].size());
  if (frames.size() < 2) return refuse(key, 0, {StatusCode::kMalformed, "message has no header frame"}, false);
  proto::Envelope env;
  if (!wire::parse(frames[1], &env)) {
    return refuse(key, 0,
                  {StatusCode::kMalformed,
                   "header frame of " + std::to_string(frames[1].size()) + " bytes is not a symbiosis Envelope"},
                  false);
  }
  ClientRecord* client = registry_.seen(key);
  switch (env.body_case()) {
    case proto::Envelope::kHello:
      return handle_hello(env.hello(), key);
    case proto::Envelope::kRequest:
      return handle_request(env.request(), client, frames, key);
    case proto::Envelope::kRegisterBuffer:
    case proto::Envelope::kShareSegments:
    case proto::Envelope::kNcclSetup:
      if (client == nullptr || client->transport == TransportKind::kTcp) {
        return refuse(key, 0,
                      {StatusCode::kFailedPrecondition,
                       "payload set-up from a client without a same-host transport (shm, cuda-ipc or nccl)"},
                      false);
      }
      client->channel->attached();  // it has mapped its control segment
      return scheduler_.post(SetupArrived{client->channel, std::move(env), key});
    case proto::Envelope::kGoodbye:
      if (client != nullptr) {
        spdlog::info("client {} (tenant '{}') left", client->id, client->tenant);
        forget(key);
      }
      return;
    case proto::Envelope::kStatsRequest: {
      proto::Envelope reply;
      *reply.mutable_stats() = statistics_.snapshot();
      return wire::send_to(router_, key, reply);
    }
    default:
      return refuse(key, 0,
                    {StatusCode::kMalformed,
                     "unexpected message: the executor takes Hello, Request, RegisterBuffer, ShareSegments, "
                     "NcclSetup, Goodbye and StatsRequest"},
                    false);
  }
}

void FrontDoor::forget(const std::string& key) {
  auto record = registry_.remove(key);
  if (!record) return;
  record->channel->abort();  // nothing may wait on a client that is gone (NCCL kernels)
  if (record->transport != TransportKind::kTcp) statistics_.same_host_clients--;
  statistics_.clients = registry_.size();
  scheduler_.post(ClientLeft{record->id});
}

void FrontDoor::check_liveness() {
  for (const auto& key : registry_.gone()) {
    const auto* client = registry_.find(key);
    spdlog::info("client {} (tenant '{}') is gone; releasing what it held", client->id, client->tenant);
    forget(key);
  }
}

void FrontDoor::run() {
  zmq::pollitem_t items[] = {{router_.handle(), 0, ZMQ_POLLIN, 0}, {replies_in_.handle(), 0, ZMQ_POLLIN, 0}};
  auto last_stats = Clock::now();
  auto last_liveness = Clock::now();
  while (!stopping_) {
    zmq::poll(items, 2, kLivenessInterval);
    if (items[0].revents & ZMQ_POLLIN) {
      auto frames = wire::recv_all(router_);
      try {
        handle(frames);
      } catch (const std::exception& e) {
        // A message that slipped past the checks must not take the executor down.
        spdlog::error("failed handling a message: {}", e.what());
        if (!frames.empty()) {
          refuse(std::string(static_cast<const char*>(frames[0].data()), frames[0].size()), 0,
                 status_of_exception(e, StatusCode::kInternal), false);
        }
      }
    }
    if (items[1].revents & ZMQ_POLLIN) {
      auto frames = wire::recv_all(replies_in_);
      for (size_t i = 0; i < frames.size(); ++i) {
        router_.send(frames[i], i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
    }
    const auto now = Clock::now();
    if (options_.stats_interval_seconds > 0 && now - last_stats > std::chrono::seconds(options_.stats_interval_seconds)) {
      statistics_.log();
      last_stats = now;
    }
    if (now - last_liveness > kLivenessInterval) {
      check_liveness();
      last_liveness = now;
    }
  }
}

void FrontDoor::abort_clients() {
  for (const auto& [key, record] : registry_.all()) record.channel->abort();
}

}  // namespace symbiosis
