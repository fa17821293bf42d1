// [Fuzzing] wire_request: one ZeroMQ message from a tcp client as the executor's front door and
// scheduler take it (base_executor/front_door.cpp's handle and handle_request, the scheduler's
// accept): the header frame parsed as an Envelope; a Request made a call header, its payload
// frames given to a tcp channel, the call checked ([Call check]) and, when it passes, computed
// into its destination from the frame's bytes. A Hello goes through [Transport choice].
// Input: the header frame, then up to three payload frames, split by kPartMarker.
#include <zmq.hpp>

#include "base_executor/base_model.h"
#include "base_executor/call_check.h"
#include "fuzz/fuzz_support.h"
#include "transport/channel.h"
#include "transport/transport.h"
#include "transport/zmq_wire.h"

namespace symbiosis::fuzz {
namespace {

LayerOp to_layer_op(int32_t op) {
  return op == proto::BACKWARD_INPUT    ? LayerOp::kBackwardInput
         : op == proto::FORWARD_NO_BIAS ? LayerOp::kForwardNoBias
                                        : LayerOp::kForward;
}

void take_request(const proto::Request& request, std::vector<zmq::message_t> payload) {
  const BaseModel& model = small_base_model();
  auto channel = plugin(TransportKind::kTcp).make_channel({.client_id = 1});
  shm::CallHeader h = wire::call_header(request);
  const std::vector<int64_t> shape(request.shape().begin(), request.shape().end());
  channel->receive_frames(h, std::move(payload));
  const Status status = check_call(model, kMaxRequestBytes, *channel, h, shape);
  if (!status.is_ok()) {
    FUZZ_ASSERT(!status.message().empty());
    return;
  }
  // What the check promises the batch: a known layer and op, the layer's dtype, [tokens, features]
  // within the limit, and a frame of exactly that many bytes.
  FUZZ_ASSERT(h.layer_id < model.layer_count());
  const auto& layer = model.layer(h.layer_id);
  FUZZ_ASSERT(h.tokens >= 1 &&
              static_cast<uint64_t>(h.tokens * h.features) * at::elementSize(layer.dtype) <= kMaxRequestBytes);
  const auto op = to_layer_op(h.op);
  const int64_t out_features = op == LayerOp::kBackwardInput ? layer.in_features : layer.out_features;
  auto input = channel->input(h, layer.dtype, {h.tokens, h.features});
  auto destination = channel->destination(h, layer.dtype, {h.tokens, out_features});
  model.compute_into(h.layer_id, op, input, destination);
}

void take(const uint8_t* data, size_t size) {
  const auto parts = split_parts(data, size, 4);
  zmq::message_t header(parts[0].data(), parts[0].size());
  proto::Envelope envelope;
  if (!wire::parse(header, &envelope)) return;  // refused as MALFORMED
  if (envelope.has_request()) {
    std::vector<zmq::message_t> payload;
    for (size_t i = 1; i < parts.size(); ++i) payload.emplace_back(parts[i].data(), parts[i].size());
    return take_request(envelope.request(), std::move(payload));
  }
  if (envelope.has_hello()) {
    proto::Placement executor;
    executor.set_host_id("fuzz-host");
    executor.set_device("cpu");
    const auto& hello = envelope.hello();
    for (const bool nccl : {false, true}) {
      auto kind = choose_transport(hello.placement(), executor, hello.transport(), nccl);
      FUZZ_ASSERT(kind.is_ok() || !kind.status().message().empty());
    }
  }
}

std::string serialized(const proto::Envelope& envelope) { return envelope.SerializeAsString(); }

}  // namespace

void write_seeds(const std::filesystem::path& dir) {
  const BaseModel& model = small_base_model();
  int n = 0;
  auto seed = [&](const std::vector<std::string>& parts) {
    write_file(dir / ("seed-" + std::to_string(n++)), join_parts(parts));
  };
  for (uint32_t id = 0; id < model.layer_count(); ++id) {
    const auto& layer = model.layer(id);
    for (const auto op : {proto::FORWARD, proto::BACKWARD_INPUT, proto::FORWARD_NO_BIAS}) {
      const int64_t features = op == proto::BACKWARD_INPUT ? layer.out_features : layer.in_features;
      proto::Envelope env;
      auto* r = env.mutable_request();
      r->set_request_id(7 + id);
      r->set_layer_id(id);
      r->set_op(op);
      r->set_dtype(wire::to_proto(layer.dtype));
      r->add_shape(2);
      r->add_shape(features);
      r->set_latency_class(proto::INFERENCE_DECODE);
      const std::string payload(2 * features * at::elementSize(layer.dtype), '\x01');
      seed({serialized(env), payload});
    }
  }
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  hello.mutable_hello()->set_tenant("tenant");
  hello.mutable_hello()->set_transport("shm");
  hello.mutable_hello()->mutable_placement()->set_host_id("fuzz-host");
  hello.mutable_hello()->mutable_placement()->set_device("cpu");
  seed({serialized(hello)});
}

}  // namespace symbiosis::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  symbiosis::fuzz::expect_refusal_or_success([&] { symbiosis::fuzz::take(data, size); });
  return 0;
}
