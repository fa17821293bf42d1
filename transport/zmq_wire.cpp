#include "transport/zmq_wire.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace symbiosis::wire {

proto::DType to_proto(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return proto::FLOAT32;
    case at::kBFloat16: return proto::BFLOAT16;
    case at::kHalf: return proto::FLOAT16;
    default: TORCH_CHECK(false, "dtype ", dtype, " cannot travel (expected float32, bfloat16 or float16)");
  }
}

at::ScalarType from_proto(proto::DType dtype) {
  switch (dtype) {
    case proto::FLOAT32: return at::kFloat;
    case proto::BFLOAT16: return at::kBFloat16;
    case proto::FLOAT16: return at::kHalf;
    default:
      TORCH_CHECK(false, "unknown wire dtype ", static_cast<int>(dtype), " (expected FLOAT32, BFLOAT16 or FLOAT16)");
  }
}

proto::LayerInfo to_proto(const LayerInfo& info) {
  proto::LayerInfo p;
  p.set_id(info.id);
  p.set_name(info.name);
  p.set_kind(info.kind == LayerKind::kLinear ? proto::LINEAR : proto::CONV1D);
  p.set_in_features(info.in_features);
  p.set_out_features(info.out_features);
  p.set_bias(info.bias);
  p.set_dtype(to_proto(info.dtype));
  for (const uint32_t member : info.members) p.add_members(member);
  p.set_activation(info.activation);
  return p;
}

LayerInfo from_proto(const proto::LayerInfo& p) {
  LayerInfo info;
  info.id = p.id();
  info.name = p.name();
  info.kind = p.kind() == proto::CONV1D ? LayerKind::kConv1D : LayerKind::kLinear;
  info.in_features = p.in_features();
  info.out_features = p.out_features();
  info.bias = p.bias();
  info.dtype = from_proto(p.dtype());
  info.members.assign(p.members().begin(), p.members().end());
  info.activation = p.activation();
  return info;
}

std::string op_name(proto::Op op) { return proto::Op_Name(op); }

zmq::message_t serialize(const proto::Envelope& envelope) {
  zmq::message_t frame(envelope.ByteSizeLong());
  envelope.SerializeToArray(frame.data(), static_cast<int>(frame.size()));
  return frame;
}

proto::ErrorCode to_proto(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return proto::OK;
    case StatusCode::kInvalidArgument: return proto::INVALID_ARGUMENT;
    case StatusCode::kNotFound: return proto::NOT_FOUND;
    case StatusCode::kResourceExhausted: return proto::RESOURCE_EXHAUSTED;
    case StatusCode::kMalformed: return proto::MALFORMED;
    case StatusCode::kFailedPrecondition: return proto::FAILED_PRECONDITION;
    case StatusCode::kInternal: return proto::INTERNAL;
    case StatusCode::kPermissionDenied: return proto::PERMISSION_DENIED;
    case StatusCode::kUnavailable: return proto::UNAVAILABLE;
  }
  return proto::INTERNAL;
}

proto::LatencyClass to_proto(LatencyClass latency) {
  switch (latency) {
    case LatencyClass::kInferenceDecode: return proto::INFERENCE_DECODE;
    case LatencyClass::kInferencePrefill: return proto::INFERENCE_PREFILL;
    default: return proto::FINE_TUNING;
  }
}

LatencyClass latency_from_proto(int32_t latency) {
  switch (latency) {
    case proto::INFERENCE_DECODE: return LatencyClass::kInferenceDecode;
    case proto::INFERENCE_PREFILL: return LatencyClass::kInferencePrefill;
    default: return LatencyClass::kFineTuning;
  }
}

proto::Envelope error_envelope(uint64_t request_id, const Status& status, bool as_reply) {
  proto::Envelope env;
  proto::Error* err = as_reply ? env.mutable_reply()->mutable_error() : env.mutable_error();
  if (as_reply) env.mutable_reply()->set_request_id(request_id);
  err->set_code(to_proto(status.code()));
  err->set_message(status.message());
  return env;
}

void send_to(zmq::socket_t& socket, std::string_view identity, const proto::Envelope& envelope,
             std::vector<zmq::message_t>& payload) {
  socket.send(zmq::message_t(identity.data(), identity.size()), zmq::send_flags::sndmore);
  socket.send(serialize(envelope), payload.empty() ? zmq::send_flags::none : zmq::send_flags::sndmore);
  for (size_t i = 0; i < payload.size(); ++i) {
    socket.send(payload[i], i + 1 < payload.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

void send_to(zmq::socket_t& socket, std::string_view identity, const proto::Envelope& envelope) {
  std::vector<zmq::message_t> none;
  send_to(socket, identity, envelope, none);
}

void validate_endpoint(const std::string& endpoint, const std::string& what, bool allow_inproc) {
  const std::string expected = std::string("expected tcp://HOST:PORT or ipc://PATH") +
                               (allow_inproc ? " (or inproc://NAME)" : "") + ", e.g. tcp://127.0.0.1:5555";
  const auto scheme_end = endpoint.find("://");
  TORCH_CHECK(scheme_end != std::string::npos, what, " '", endpoint, "' has no scheme: ", expected);
  const std::string scheme = endpoint.substr(0, scheme_end), rest = endpoint.substr(scheme_end + 3);
  if (scheme == "tcp") {
    const auto colon = rest.rfind(':');
    TORCH_CHECK(colon != std::string::npos && colon != 0 && colon + 1 != rest.size(), what, " '", endpoint,
                "' names no host and port: ", expected);
    return;
  }
  TORCH_CHECK((scheme == "ipc" || (allow_inproc && scheme == "inproc")) && !rest.empty(), what, " '", endpoint,
              "' is not a ZeroMQ endpoint this project uses: ", expected);
}

bool parse(const zmq::message_t& frame, proto::Envelope* envelope) {
  return envelope->ParseFromArray(frame.data(), static_cast<int>(frame.size()));
}

shm::CallHeader call_header(const proto::Request& r) {
  shm::CallHeader h;
  h.request_id = r.request_id();
  h.layer_id = r.layer_id();
  h.op = r.op();
  h.dtype = r.dtype();
  h.latency_class = r.latency_class();
  h.in_offset = r.in_offset();
  h.out_offset = r.out_offset();
  h.buffer_generation = r.buffer_generation();
  return h;
}

std::vector<zmq::message_t> tensor_frames(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "tensor frames need contiguous CPU tensors");
  std::vector<zmq::message_t> frames;
  auto* bytes = static_cast<char*>(t.data_ptr());
  const size_t total = t.nbytes();
  size_t offset = 0;
  do {
    const size_t size = std::min(kPayloadFrameBytes, total - offset);
    auto* keep = new at::Tensor(t);
    frames.emplace_back(
        bytes + offset, size, [](void*, void* hint) { delete static_cast<at::Tensor*>(hint); }, keep);
    offset += size;
  } while (offset < total);
  return frames;
}

size_t frame_bytes(const std::vector<zmq::message_t>& frames) {
  size_t total = 0;
  for (const auto& frame : frames) total += frame.size();
  return total;
}

at::Tensor frames_to_tensor(std::vector<zmq::message_t>&& frames, at::ScalarType dtype, at::IntArrayRef shape) {
  auto options = at::TensorOptions().dtype(dtype);
  if (frames.size() == 1 && reinterpret_cast<uintptr_t>(frames[0].data()) % 16 == 0) {
    auto owner = std::make_shared<zmq::message_t>(std::move(frames[0]));
    return at::from_blob(
        owner->data(), shape, [owner](void*) mutable { owner.reset(); }, options);
  }
  auto out = at::empty(shape, options);
  auto* into = static_cast<char*>(out.data_ptr());
  for (const auto& frame : frames) {
    std::memcpy(into, frame.data(), frame.size());
    into += frame.size();
  }
  return out;
}

std::vector<zmq::message_t> recv_all(zmq::socket_t& socket) {
  std::vector<zmq::message_t> frames;
  do {
    zmq::message_t frame;
    auto got = socket.recv(frame, zmq::recv_flags::none);
    if (!got) break;
    frames.push_back(std::move(frame));
  } while (frames.back().more());
  return frames;
}

}  // namespace symbiosis::wire
